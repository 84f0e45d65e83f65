"""rollout.py: the rStar2 prompt and tool-turn format, the tool-call parser, and (marked slow) multi-turn rollouts
on the real vLLM engine with the real executor and the tiny model.

    .venv/bin/python -m pytest tests/test_rollout.py -q
"""
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rollout
from rollout import RolloutConfig, ToolCallError, parse_tool_call

REFERENCE = Path("/work/shared/docs/reference")
SEPARATOR = "# ====================================================================\n"


def reference_text(name):
    """The verbatim part of a shared/docs/reference file (below its source notes)."""
    path = REFERENCE / name
    if not path.exists():
        pytest.skip(f"{path} not available")
    return path.read_text().split(SEPARATOR, 1)[1]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# -----------------------------------------------------------------------------
# format


def test_prompt_is_the_released_prompt_byte_for_byte(tokenizer):
    ids = rollout.render_prompt(tokenizer, "{Question}", RolloutConfig())
    assert tokenizer.decode(ids) == reference_text("prompt_rendered_code.txt")
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n<reason>")


def test_tool_turn_is_the_released_tool_turn_byte_for_byte(tokenizer):
    tool_text = "Tool call success\nstdout: 2\n\nexecution time: 0.03s"
    ids = rollout.render_tool_turn(tokenizer, tool_text, RolloutConfig())
    assert tokenizer.decode(ids) == reference_text("tool_turn_rendered_code.txt")


def test_paper_variant_switches_template_and_tool_together(tokenizer):
    cfg = RolloutConfig(prompt_variant="paper")
    text = tokenizer.decode(rollout.render_prompt(tokenizer, "What is 2+2?", cfg))
    assert "execute_python_code_with_standard_io" in text and "# Tools:" in text
    assert text.endswith("This is the problem: What is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>")
    assert tokenizer.decode(rollout.render_tool_turn(tokenizer, "ok", cfg)).endswith("<|im_start|>assistant\n<think>")
    assert rollout.load_format(cfg)[2] == "execute_python_code_with_standard_io"


def test_without_the_tool_the_prompt_has_no_tools_section(tokenizer):
    text = tokenizer.decode(rollout.render_prompt(tokenizer, "Q", RolloutConfig(use_tool=False)))
    assert "<tools>" not in text and "<tool_call>" not in text
    assert text.startswith("<|im_start|>system\nA conversation between User and Assistant.")
    assert text.endswith("This is the problem:\nQ<|im_end|>\n<|im_start|>assistant\n<reason>")


def test_rendered_pieces_concatenate_to_the_tokens_of_the_whole_text(tokenizer):
    """Token in / token out: the prompt, the model's tokens and the tool turn, each tokenized on its own, are the
    tokens of the concatenated text. So SFT (which tokenizes turn by turn) and RL sample the same sequences."""
    cfg = RolloutConfig()
    model_turn = ' I compute.\n<tool_call>\n{"name": "python_code_with_standard_io", "arguments": {"code": "print(6*7)", "input": ""}}\n</tool_call><|im_end|>'
    pieces = [rollout.render_prompt(tokenizer, "Compute 6 * 7.", cfg),
              tokenizer.encode(model_turn, add_special_tokens=False),
              rollout.render_tool_turn(tokenizer, "Tool call success\nstdout: 42", cfg)]
    joined = [t for piece in pieces for t in piece]
    assert joined == tokenizer.encode(tokenizer.decode(joined), add_special_tokens=False)


def test_bad_format_config_names_the_problem(tmp_path):
    with pytest.raises(ValueError, match="prompt_variant.*'fig3'"):
        RolloutConfig(prompt_variant="fig3").validate()
    with pytest.raises(ValueError, match="chat_template: file not found"):
        RolloutConfig(chat_template=str(tmp_path / "missing.jinja")).validate()
    bad = tmp_path / "schema.json"
    bad.write_text('{"type": "function"}')
    with pytest.raises(ValueError, match="no function name"):
        rollout.load_format(RolloutConfig(tool_schema=str(bad)))
    with pytest.raises(ValueError, match="max_model_len=100 cannot hold"):
        RolloutConfig(max_prompt_tokens=64, max_response_tokens=64, max_model_len=100).validate()
    with pytest.raises(ValueError, match="non-empty string"):
        rollout.render_prompt(None, "  ", RolloutConfig())


# -----------------------------------------------------------------------------
# the tool call parser (tool_io_format.txt §1-2)

TOOL = "python_code_with_standard_io"


def call_text(payload):
    return f"Let me check.\n<tool_call>\n{payload}\n</tool_call>"


def test_parses_a_hermes_call():
    payload = json.dumps({"name": TOOL, "arguments": {"code": "print(input())", "input": "7\n"}})
    assert parse_tool_call(call_text(payload), TOOL) == {"code": "print(input())", "stdin": "7\n"}


def test_a_turn_without_a_call_is_the_final_answer():
    assert parse_tool_call("<reason> done </reason><answer> \\boxed{4} </answer>", TOOL) is None


@pytest.mark.parametrize("payload, message", [
    ('{"name": "python_code_with_standard_io", "arguments": {"code": "print(1)"', "Failed to decode tool call: Expecting"),
    ('[1, 2]', "Failed to decode tool call: expected"),
    ('{"name": "python_code_with_standard_io"}', "Failed to decode tool call: expected"),
    ('{"name": "calculator", "arguments": {"code": "1"}}', "unknown tool 'calculator'"),
    ('{"name": "python_code_with_standard_io", "arguments": "print(1)"}', "arguments must be"),
    ('{"name": "python_code_with_standard_io", "arguments": {"input": ""}}', "arguments must be"),
    ('{"name": "python_code_with_standard_io", "arguments": {"code": "1", "input": 5}}', '"input" must be a string'),
])
def test_malformed_calls_become_error_responses(payload, message):
    with pytest.raises(ToolCallError, match=message):
        parse_tool_call(call_text(payload), TOOL)


def test_a_missing_input_means_empty_stdin_and_a_closing_tag_alone_is_a_bad_call():
    assert parse_tool_call(call_text(f'{{"name": "{TOOL}", "arguments": {{"code": "1"}}}}'), TOOL)["stdin"] == ""
    with pytest.raises(ToolCallError, match="without an opening"):
        parse_tool_call('{"name": "x"}\n</tool_call>', TOOL)


def test_only_the_first_call_of_a_turn_runs():
    first = json.dumps({"name": TOOL, "arguments": {"code": "print(1)", "input": ""}})
    second = json.dumps({"name": TOOL, "arguments": {"code": "print(2)", "input": ""}})
    assert parse_tool_call(call_text(first) + call_text(second), TOOL)["code"] == "print(1)"


# -----------------------------------------------------------------------------
# tool responses and answer tags


def test_truncation_keeps_head_and_tail():
    text = "HEAD" + "x" * 1000 + "TAIL"
    cut = rollout.truncate_middle(text, 256)
    assert cut.startswith("HEAD") and cut.endswith("TAIL") and "...(truncated)..." in cut
    assert len(cut) == 256 + len("...(truncated)...")
    assert rollout.truncate_middle("short", 256) == "short"
    assert rollout.truncate_middle(text, 0) == text


def test_answer_tags_count_closed_pairs_and_unbalanced_tags_count_zero():
    assert rollout.count_answer_tags("<reason>r</reason><answer> \\boxed{1} </answer>") == 1
    assert rollout.count_answer_tags("<answer>1</answer> wait <answer>2</answer>") == 2
    assert rollout.count_answer_tags("<answer>1</answer> <answer> 2") == 0
    assert rollout.count_answer_tags("no answer") == 0


def test_importing_rollout_does_not_import_vllm():
    """sft.py renders prompts with rollout.py; it must not pay vLLM's ~17 s import."""
    code = "import sys, rollout; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], cwd=Path(rollout.__file__).parent, check=True)


# -----------------------------------------------------------------------------
# the loop on the real engine (one vLLM engine for the module, the real executor)
#
# rollout.scripted_policy makes the model's choices deterministic: a vLLM logits processor forcing the tokens of a
# scripted problem's k-th assistant turn. Everything else (stopping, parsing, tool calls, tool turns, masks,
# budgets) is the real loop on the real engine. Unscripted problems sample freely.

SCRIPTS = {}  # tuple(prompt ids) -> [token ids of assistant turn 1, turn 2, ...]; read by the engine's policy
CALL_END = 2049  # </tool_call> in the tiny tokenizer; checked in the engine fixture
ENGINE_CFG = dict(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1, max_prompt_tokens=448,
                  max_response_tokens=576)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tokenizer):
    import common

    assert tokenizer.convert_tokens_to_ids("</tool_call>") == CALL_END
    common.init_distributed()  # a gloo world of one: the external_launcher path torchrun takes
    engine = rollout.Engine(tiny_model_dir, RolloutConfig(**ENGINE_CFG), seed=0,
                            logits_processors=[rollout.scripted_policy(SCRIPTS, CALL_END)])
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def executor():
    from executor import Executor

    with Executor(workers=2, timeout_s=1.0) as ex:
        yield ex


def script(tokenizer, problem, turns, cfg):
    key = tuple(rollout.render_prompt(tokenizer, problem, cfg))
    SCRIPTS[key] = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
    return problem


def tool_call(code, stdin="", name=TOOL):
    return f'\n<tool_call>\n{json.dumps({"name": name, "arguments": {"code": code, "input": stdin}})}\n</tool_call>'


def run(engine, executor, tokenizer, problems, n=1, **overrides):
    cfg = RolloutConfig(**{**ENGINE_CFG, **overrides})
    return rollout.generate(engine, executor, tokenizer, problems, n, cfg, seed=0)


def spans(trajectory):
    """The response as [(mask, token ids)] runs of equal loss mask."""
    out = []
    for token, mask in zip(trajectory.response_ids, trajectory.loss_mask):
        if out and out[-1][0] == mask:
            out[-1][1].append(token)
        else:
            out.append((mask, [token]))
    return out


# The scripted behaviours under the default budget, rolled out together in one call (the engine decodes them as
# one batch, which keeps the module fast); each test below reads its own trajectory.
BEHAVIOURS = {
    "round trip": [tool_call("print(6 * 7)"), " The result is 42. </reason>\n<answer> \\boxed{42} </answer><|im_end|>"],
    "errors": [tool_call("print(1 / 0)"), tool_call("while True: pass"),
               '\n<tool_call>\n{"name": "python_code_with_standard_io", "arguments": {"code": \n</tool_call>',
               tool_call("print(1)", name="calculator"), tool_call("print(input())", stdin="5"),
               " </reason><answer> \\boxed{5} </answer><|im_end|>"],
    "call forever": [tool_call("print(1)")] * 10,
}
MAX_TURNS = 6


@pytest.fixture(scope="module")
def scripted(engine, executor, tokenizer):
    cfg = RolloutConfig(**ENGINE_CFG)
    problems = [script(tokenizer, f"Behaviour: {name}.", turns, cfg) for name, turns in BEHAVIOURS.items()]
    groups = run(engine, executor, tokenizer, problems, max_turns=MAX_TURNS)
    return {name: group[0] for name, group in zip(BEHAVIOURS, groups)}


@pytest.mark.slow
def test_tool_round_trip_token_for_token(scripted, tokenizer):
    cfg = RolloutConfig(**ENGINE_CFG)
    traj = scripted["round trip"]
    turns = SCRIPTS[tuple(traj.prompt_ids)]
    tool_turn = tokenizer.encode("<|im_end|>", add_special_tokens=False) + \
        rollout.render_tool_turn(tokenizer, "Tool call success\nstdout: 42\n", cfg)
    # the sampled call, the unsampled close + tool turn, the sampled answer: mask 0 is exactly the tool turn
    assert spans(traj) == [(1, turns[0]), (0, tool_turn), (1, turns[1])]
    assert traj.prompt_ids == rollout.render_prompt(tokenizer, "Behaviour: round trip.", cfg)
    assert "<tool_response>\nTool call success\nstdout: 42\n\n</tool_response>" in traj.response_text
    assert traj.tool_calls == [{"code": "print(6 * 7)", "stdin": "", "status": "ok"}]
    assert (traj.num_turns, traj.num_tool_calls, traj.num_tool_errors, traj.num_answer_tags) == (2, 1, 0, 1)
    assert traj.finished and not traj.truncated and traj.stop_reason == "answer"
    assert len(traj.logprobs) == len(traj.response_ids)
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if m == 0)


@pytest.mark.slow
def test_tool_errors_are_counted_by_kind_and_returned_to_the_model(scripted):
    traj = scripted["errors"]
    assert [c["status"] for c in traj.tool_calls] == ["error", "timeout", "parse", "parse", "ok"]
    assert traj.tool_errors_by_kind == {"error": 1, "timeout": 1, "oom": 0, "parse": 2}
    assert (traj.num_tool_calls, traj.num_tool_errors, traj.num_turns) == (5, 4, 6)
    assert "ZeroDivisionError" in traj.response_text and "reason: worker_timeout" in traj.response_text
    assert "Failed to decode tool call: Expecting value" in traj.response_text
    assert "Error when executing tool: unknown tool 'calculator'" in traj.response_text
    assert traj.finished


@pytest.mark.slow
def test_the_turn_limit_is_checked_before_the_call_runs(scripted):
    traj = scripted["call forever"]
    # as in the release: the last turn's call is not run, so MAX_TURNS turns make MAX_TURNS - 1 calls
    assert traj.stop_reason == "max_turns" and traj.num_turns == MAX_TURNS and traj.num_tool_calls == MAX_TURNS - 1
    assert traj.response_ids[-1] == CALL_END and traj.truncated and not traj.finished


@pytest.mark.slow
def test_the_token_budget_is_shared_by_model_and_tool_tokens(engine, executor, tokenizer):
    cfg = RolloutConfig(**ENGINE_CFG)
    problems = [script(tokenizer, "Think long.", [" thinking" * 300], cfg),
                script(tokenizer, "Flood the context.", [tool_call("print('x' * 1000)"), " done<|im_end|>"], cfg)]
    long, flooded = [g[0] for g in run(engine, executor, tokenizer, problems, max_response_tokens=100,
                                       max_tool_response_chars=1000)]
    # the model's own tokens hit the budget
    assert long.stop_reason == "max_response_tokens" and len(long.response_ids) == 100 and long.truncated
    # a tool response that would fill the budget is not appended: the last turn is the model's (the release's rule)
    assert flooded.stop_reason == "tool_overflow" and flooded.response_ids[-1] == CALL_END
    assert set(flooded.loss_mask) == {1} and flooded.tool_calls[0]["status"] == "ok"


@pytest.mark.slow
def test_without_the_tool_a_call_is_plain_text(engine, tokenizer):
    cfg = RolloutConfig(**ENGINE_CFG, use_tool=False)
    text = tool_call("print(2)") + " so 2 </reason><answer> \\boxed{2} </answer><|im_end|>"
    [[traj]] = rollout.generate(engine, None, tokenizer, [script(tokenizer, "No tools.", [text], cfg)], 1, cfg, seed=0)
    assert traj.finished and traj.num_turns == 1 and traj.num_tool_calls == 0 and set(traj.loss_mask) == {1}
    assert tokenizer.decode(traj.response_ids) == tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.slow
def test_sampled_log_probs_are_the_trainers_at_the_sampling_temperature(engine, executor, tokenizer, tiny_model_dir):
    """The engine's log-probs are log_softmax(logits / T) of the sampled tokens (vLLM processed_logprobs), so a
    trainer that divides by the same T gets the same numbers (fp32: tight)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    groups = run(engine, executor, tokenizer, ["Compute 12 * 34 + 5."], n=2, temperature=0.7, max_response_tokens=48)
    for traj in groups[0]:
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(traj.prompt_ids) - 1:-1] / 0.7
        trainer = torch.log_softmax(logits, -1).gather(-1, torch.tensor(traj.response_ids)[:, None])[:, 0]
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        assert torch.allclose(trainer[mask], torch.tensor(traj.logprobs)[mask], atol=2e-4)
        # score() is the temperature-1 view of the same tokens
        scored = torch.tensor(engine.score([traj.prompt_ids], [traj.response_ids])[0])
        assert torch.allclose(scored, torch.log_softmax(logits * 0.7, -1).gather(-1, torch.tensor(traj.response_ids)[:, None])[:, 0], atol=2e-4)


@pytest.mark.slow
def test_reruns_reproduce_and_the_schedule_does_not_change_the_result(engine, executor, tokenizer):
    """Per-request seeds from (seed, step, problem, sample, turn): a step gives the same trajectories whether the loop
    runs without a barrier, with one, or with at most two trajectories in flight; another step samples anew."""
    cfg = RolloutConfig(**{**ENGINE_CFG, "max_response_tokens": 32})
    scripted_problem = script(tokenizer, "Compute 3 * 4.", [tool_call("print(3 * 4)"), " 12 </reason><|im_end|>"], cfg)
    problems = [scripted_problem, "Compute 5 + 6.", "Compute 7 - 8."]

    def tokens(groups):
        return [(t.problem_index, t.sample_index, t.response_ids, t.loss_mask) for g in groups for t in g]

    first = rollout.generate(engine, executor, tokenizer, problems, 2, cfg, seed=0)
    assert [len(g) for g in first] == [2, 2, 2] and first[0][0].num_tool_calls == 1
    barrier = rollout.generate(engine, executor, tokenizer, problems, 2, cfg, seed=0, turn_barrier=True)
    assert tokens(barrier) == tokens(first)
    two_at_a_time = rollout.generate(engine, executor, tokenizer, problems, 2, dataclasses.replace(cfg, max_concurrency=2), seed=0)
    assert tokens(two_at_a_time) == tokens(first)
    other_step = rollout.generate(engine, executor, tokenizer, problems, 2, cfg, seed=0, step=1)
    assert tokens(other_step)[:2] == tokens(first)[:2]  # the script is the script
    assert all(a != b for a, b in zip(tokens(other_step)[2:], tokens(first)[2:]))  # free samples are new


@pytest.mark.slow
def test_at_most_k_trajectories_are_in_the_engine(engine, executor, tokenizer):
    """§3.2: the loop admits at most K trajectories at a time (here K = rollout.max_concurrency = 3)."""
    peak = []
    add = engine.add

    def counting_add(*args, **kwargs):
        add(*args, **kwargs)
        peak.append(engine.engine.get_num_unfinished_requests())

    engine.add = counting_add
    try:
        groups = run(engine, executor, tokenizer, ["Compute 1 + 1.", "Compute 2 + 2."], n=4, max_response_tokens=16,
                     max_concurrency=3)
    finally:
        del engine.add
    assert max(peak) == 3 and len(peak) == 8 and sum(len(g) for g in groups) == 8
    cache = engine.engine.vllm_config.cache_config
    assert engine.max_concurrency() == min(256, cache.num_gpu_blocks * cache.block_size // 1024)


def test_split_by_tokens_balances_and_is_deterministic():
    lengths = [50, 10, 40, 30, 30, 20, 10, 10]
    trajs = [rollout.Trajectory(i // 2, i % 2, [0] * 5, response_ids=[0] * n) for i, n in enumerate(lengths)]
    shares = rollout.split_by_tokens(trajs, 2)
    loads = [sum(len(t.prompt_ids) + len(t.response_ids) for t in s) for s in shares]
    assert sorted(t for s in shares for t in [(x.problem_index, x.sample_index) for x in s]) == \
        [(t.problem_index, t.sample_index) for t in trajs]
    assert abs(loads[0] - loads[1]) <= 10
    assert rollout.split_by_tokens(list(reversed(trajs)), 2) == shares


@pytest.mark.slow
def test_torchrun_weight_sync_and_prompt_claiming(tiny_model_dir):
    """Two ranks, FSDP2 trainer + an engine each: after update_weights the engine's log-probs equal the trainer's
    (fp32, < 1e-4; fixed tokens and sampled ones), prompts are claimed once each from the shared counter, and
    balance_by_tokens gives each trajectory to one rank. The checks live in tests/dist_rollout.py."""
    torchrun("tests/dist_rollout.py", str(tiny_model_dir))


@pytest.mark.slow
def test_torchrun_tensor_parallel_engine_runs_the_loop_in_lockstep(tiny_model_dir):
    """tensor_parallel_size=2 over two ranks: one engine, the leader runs the loop (tools included) and the follower
    replays its engine calls, so the two never desync; the leader holds all trajectories."""
    torchrun("tests/dist_rollout.py", str(tiny_model_dir), "tp")


def torchrun(*args):
    repo = Path(rollout.__file__).parent
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    proc = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=900)
    # Both ranks write to one pipe, so their summary lines can land on one line: count them, not lines.
    summary = re.findall(r"rank [01]: (?:claimed|tensor parallel)", proc.stdout)
    assert proc.returncode == 0 and len(set(summary)) == 2, (
        proc.stdout[-2000:] + proc.stderr[-4000:])


def test_command_line_errors_name_the_problem(tmp_path, tiny_model_dir):
    repo = Path(rollout.__file__).parent

    def fails(*args):
        proc = subprocess.run([sys.executable, "rollout.py", *args], cwd=repo, capture_output=True, text=True)
        assert proc.returncode != 0
        return proc.stderr.strip().splitlines()[-1]

    assert "mode must be sample or bench, got 'fast'" in fails("mode=fast")
    assert f"model={tmp_path}: no Hugging Face model directory" in fails(f"model={tmp_path}")
    assert "unknown key" in fails("rollout.max_turn=3")
    assert f"data={tmp_path}/none.jsonl: file not found" in fails(f"model={tiny_model_dir}", f"data={tmp_path}/none.jsonl")
