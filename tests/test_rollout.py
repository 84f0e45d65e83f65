"""rollout.py: the rStar2 prompt and tool-turn format, the tool-call parser, and (marked slow) multi-turn rollouts
on the real vLLM engine with the real executor and the tiny model.

    .venv/bin/python -m pytest tests/test_rollout.py -q
"""
import json
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
