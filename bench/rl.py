"""Benchmark of rl.py's rollout phase inside real RL steps against vLLM's own LLM.generate, in one
run on one engine (docs/benchmarks.md, "The rollout phase inside the RL step"):

    python -m bench.rl configs/tiny.yaml rollout.use_tool=false filter_all_equal=false
    python -m bench.rl configs/tiny.yaml                      # tools on (the demo's config)
        [bench_steps=4] [any rl.py key=value]

Before each measured step of rl.py's own run (the first is unmeasured), on the same weights and an
empty prefix cache, one LLM.generate of that step's first-turn requests: the same tokens, hashes
checked. Tools off the seconds compare directly; tools on the table shows the rollout's engine
steps, tool calls and seconds. filter_all_equal=false: without its tool the tiny policy
scores 0 everywhere and every group would be dropped. tools/gpu_check.py runs bench() on a GPU.
"""
import dataclasses
import hashlib
import sys
import tempfile

import torch

import rl
import rollout
from bench import count_engine_steps, print_markdown, timed
from machinery.config import ConfigError, load_config
from machinery.data import prompt_indices
from machinery.engine import configure_vllm_logging
from machinery.prompts import render_prompt


@dataclasses.dataclass
class BenchConfig:
    bench_steps: int = 4          # measured RL steps, after one unmeasured


def split_args(argv):
    """bench_* keys -> BenchConfig, the rest (a config file first) -> rl.RLConfig."""
    ours = [a for a in argv if a.startswith("bench_")]
    return load_config(BenchConfig, ours), [a for a in argv if not a.startswith("bench_")]


def bench_rl_config(rl_argv, out_dir):
    """The RL config in `out_dir`, a fresh run directory, never resumed, without evaluations or
    checkpoints: only steps and their rollouts are measured."""
    return load_config(rl.RLConfig, [*rl_argv, f"out_dir={out_dir}", "resume=never",
                                     "init_from=", "eval_data=", "steps=1000000",
                                     "save_every=1000000"])


def first_turn_requests(run, rows, step):
    """The requests rollout.generate sends first for this step's rows, in its order: same token
    prompts, seeds (rollout.request_seed), stop tokens, budget and sampling."""
    # vLLM here, after configure_vllm_logging: it reads its logging settings on import
    from vllm import SamplingParams, TokensPrompt

    cfg, tokenizer = run.cfg.rollout, run.tokenizer
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    if cfg.use_tool:
        stop.add(tokenizer.convert_tokens_to_ids("</tool_call>"))
    prompts, params = [], []
    for p, row in enumerate(rows):
        ids = render_prompt(tokenizer, row["problem"], cfg)
        for s in range(run.cfg.rollouts_per_prompt):
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            params.append(SamplingParams(
                max_tokens=cfg.max_response_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                seed=rollout.request_seed(run.cfg.seed, step, p, s, 0),
                stop_token_ids=sorted(stop), logprobs=0, detokenize=False))
    return prompts, params


def record(measured, sampled_tokens, first_turns, **more):
    return dict(measured, sampled_tokens=sampled_tokens, torch_threads=torch.get_num_threads(),
                first_turns_hash=hashlib.sha256(repr(first_turns).encode()).hexdigest()[:16],
                **more)


def plain_generate(run, rows, step):
    """One LLM.generate of the step's first-turn requests after rl.sync_weights: the weights the
    step samples with, an empty prefix cache."""
    rl.sync_weights(run.engine, run.model, run.weight_dtype)
    prompts, params = first_turn_requests(run, rows, step)
    measured = timed(run.engine, lambda: run.engine.llm.generate(prompts, params, use_tqdm=False))
    turns = [list(o.outputs[0].token_ids) for o in measured.pop("result")]
    return record(measured, sum(map(len, turns)), turns)


def timed_roll_out(engine, measured):
    """rl.roll_out as rl_step calls it, timed, each call's record appended to `measured`."""
    roll_out = rl.roll_out

    def timed_call(run, rows, step, times):
        timing = timed(engine, lambda: roll_out(run, rows, step, times))
        groups = timing.pop("result")
        flat = [t for g in groups for t in g]
        # a trajectory's first turn: its sampled tokens (loss_mask 1) up to the first tool token
        first_turns = [t.response_ids[:t.loss_mask.index(0)] if 0 in t.loss_mask
                       else t.response_ids for t in flat]
        measured.append(record(timing, sum(t.num_model_tokens for t in flat), first_turns,
                               tool_busy_s=times["tool_busy"],
                               tool_calls=sum(t.num_tool_calls for t in flat)))
        return groups

    return timed_call


def bench(bench_cfg, cfg):
    """bench_steps RL steps, each measured against plain LLM.generate; -> JSON-ready rows, one per
    mode and step (tools/gpu_check.py writes them out)."""
    run = rl.start_run(cfg)
    count_engine_steps(run.engine)
    roll_out, measured, trained, rows_out = rl.roll_out, [], [], []
    rl.roll_out = timed_roll_out(run.engine, measured)
    try:
        for step in range(1 + bench_cfg.bench_steps):
            position = run.state["data_position"]
            rows = [run.problems[i] for i in prompt_indices(len(run.problems), cfg.seed,
                                                            position, cfg.prompts_per_step)]
            plain = plain_generate(run, rows, step) if step else None
            trained.append(rl.rl_step(run, step).get("train_tokens", 0))  # one process: rank 0's
            if not step:
                continue
            if plain["first_turns_hash"] != measured[-1]["first_turns_hash"]:
                raise RuntimeError(f"step {step}: plain generate and the rollout phase sampled "
                                   "different first turns; the comparison is void")
            rows_out += [dict(mode="plain LLM.generate", step=step, **plain),
                         dict(mode="rl.py rollout phase", step=step,
                              trained_tokens_before=trained[-2], **measured[-1])]
    finally:
        rl.roll_out = roll_out
        del run.engine.engine.step
    print_table(rows_out, cfg)
    if run.executor:
        run.executor.close()
    run.engine.close()
    return rows_out


def print_table(rows, cfg):
    tools = cfg.rollout.use_tool
    print_markdown(
        f"rl.py steps on {cfg.model}, {cfg.prompts_per_step} prompts x {cfg.rollouts_per_prompt} "
        f"rollouts, tools {'on' if tools else 'off'}, torch threads {torch.get_num_threads()}",
        ["step", "mode", "s", "CPU s", "sampled tokens", "engine steps", "s in vLLM",
         "s outside vLLM", "tool calls", "tool busy s", "trained tokens before", "first turns"],
        [(r["step"], r["mode"], f"{r['seconds']:.2f}", f"{r['cpu_s']:.2f}",
          f"{r['sampled_tokens']:,}", r["steps"], f"{r['in_vllm_s']:.2f}",
          f"{r['seconds'] - r['in_vllm_s']:.2f}", r.get("tool_calls", "-"),
          f"{r.get('tool_busy_s', 0):.2f}", r.get("trained_tokens_before", "-"),
          r["first_turns_hash"]) for r in rows])
    plain = [r for r in rows if r["mode"] == "plain LLM.generate"]
    phase = [r for r in rows if r["mode"] == "rl.py rollout phase"]
    # Tools on, plain generate of the first turns runs every request at once, a fuller batch than
    # the rollout's continuations: its tokens check the sampling, its speed is no baseline.
    if not tools:
        ratio = sum(r["seconds"] for r in plain) / sum(r["seconds"] for r in phase)
        cpu = sum(r["cpu_s"] for r in plain) / sum(r["cpu_s"] for r in phase)
        print(f"rollout phase / plain LLM.generate, tools off, same tokens, tokens/s over "
              f"{len(phase)} steps: {ratio:.2f}x (target >= 0.95x), per step " + ", ".join(
                  f"{p['seconds'] / r['seconds']:.2f}x" for p, r in zip(plain, phase))
              + f"; per CPU second (load stretches the wall seconds, not these): {cpu:.2f}x")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as run_dir:
        try:
            bench_config, rl_args = split_args(sys.argv[1:])
            config = bench_rl_config(rl_args, run_dir)
        except ConfigError as e:
            sys.exit(f"bench.rl: {e}")
        configure_vllm_logging(config.verbose)
        bench(bench_config, config)
