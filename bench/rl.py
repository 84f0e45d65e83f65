"""Benchmark of rl.py's rollout phase inside real RL steps against vLLM's own LLM.generate, in one
run on one engine:

    python -m bench.rl configs/tiny.yaml rollout.use_tool=false filter_all_equal=false
    python -m bench.rl configs/tiny.yaml                      # tools on (the demo's config)
        [bench_steps=4] [any rl.py key=value]

rl.py's own run (rl.start_run) and steps (rl.rl_step: weight sync, rollout, rewards, selection,
old log-probs, update) on the SFT'd policy, sampling freely with per-request seeds. The first step
is unmeasured (the engine's first calls build its kernels). Before each measured step, on the same
engine and the same weights (rl.sync_weights, so both start on an empty prefix cache), one
LLM.generate of that step's own first-turn requests: the same prompts, seeds, stop tokens, budgets
and log-probs, so the same tokens; the hash of both is printed. Tools off those are all the
rollout's tokens and the seconds compare directly. Tools on the rollout goes on after each tool
call: it prints its seconds per sampled token with the loop's waits on a tool (nothing left to
decode) taken out, to hold against the tools-off run's. The tiny policy without its tool scores 0
everywhere: filter_all_equal=false keeps an update before each rollout.

Per mode: seconds and CPU seconds, sampled tokens, engine steps (vLLM's step() calls), seconds
inside vLLM's step() against the rest of the loop, seconds waiting on tools. tools/gpu_check.py runs
bench() on a GPU.
"""
import dataclasses
import hashlib
import os
import sys
import tempfile
import time

import torch

import rl
import rollout
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
    """The RL config in `out_dir`, a fresh run directory (machinery/run_dir.py), never resumed,
    without evaluations or checkpoints: only steps and their rollouts are measured."""
    return load_config(rl.RLConfig, [*rl_argv, f"out_dir={out_dir}", "resume=never",
                                     "init_from=", "eval_data=", "steps=1000000",
                                     "save_every=1000000"])


# -----------------------------------------------------------------------------
# what is counted: vLLM's steps, the loop's waits on tools


class Counters:
    """Engine steps and the seconds inside them (vLLM's LLMEngine.step, which plain LLM.generate
    calls too) and seconds the loop blocked on a tool result with nothing to decode; reset before
    each timed mode."""

    def __init__(self, engine):
        self.engine = engine
        vllm_step = engine.engine.step

        def counted_step():
            self.steps += 1
            started = time.perf_counter()
            try:
                return vllm_step()
            finally:
                self.in_vllm_s += time.perf_counter() - started

        engine.engine.step = counted_step
        self.reset()

    def reset(self):
        self.steps = 0
        self.in_vllm_s = self.tool_wait_s = 0.0
        self.cpu_started = time.process_time()

    def close(self):
        del self.engine.engine.step


class WaitTimedQueue:
    """The loop's queue of finished tool calls, timing get(): the loop calls it while the queue is
    empty only when nothing is left to decode (rollout.Rollouts.run)."""

    def __init__(self, inner, counters):
        self.inner, self.counters = inner, counters

    def put(self, item):
        self.inner.put(item)

    def empty(self):
        return self.inner.empty()

    def get(self):
        started = time.perf_counter()
        item = self.inner.get()
        self.counters.tool_wait_s += time.perf_counter() - started
        return item


def time_tool_waits(counters):
    """rollout.Rollouts with its result queue timed, for as long as the bench runs."""

    class TimedRollouts(rollout.Rollouts):
        def __init__(self, *args):
            super().__init__(*args)
            self.results = WaitTimedQueue(self.results, counters)

    rollout.Rollouts = TimedRollouts


# -----------------------------------------------------------------------------
# the two modes


def first_turn_requests(run, rows, step):
    """The requests rollout.generate sends first for this step's rows, in its order: same token
    prompts, seeds (rollout.request_seed), stop tokens, budget and sampling."""
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


def first_turn(t):
    """The tokens of a trajectory's first assistant turn (sampled: loss_mask 1, up to the first tool
    token)."""
    return t.response_ids[:t.loss_mask.index(0)] if 0 in t.loss_mask else t.response_ids


def plain_generate(run, rows, step, counters):
    """One LLM.generate of the step's first-turn requests after rl.sync_weights: the weights the
    step samples with, an empty prefix cache."""
    rl.sync_weights(run.engine, run.model, run.weight_dtype)
    prompts, params = first_turn_requests(run, rows, step)
    counters.reset()
    started = time.perf_counter()
    outs = run.engine.llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    turns = [list(o.outputs[0].token_ids) for o in outs]
    return record(counters, seconds, sum(map(len, turns)), turns)


def record(counters, seconds, sampled_tokens, first_turns, **more):
    # process_time: the CPU of every thread of this process (the loop, the engine, its OpenMP
    # threads, spinning included); load stretches the seconds far more than that
    return dict(seconds=seconds, cpu_s=time.process_time() - counters.cpu_started,
                sampled_tokens=sampled_tokens, steps=counters.steps,
                in_vllm_s=counters.in_vllm_s, tool_wait_s=counters.tool_wait_s,
                torch_threads=torch.get_num_threads(),
                first_turns_hash=hashlib.sha256(repr(first_turns).encode()).hexdigest()[:16],
                **more)


def timed_roll_out(counters, measured):
    """rl.roll_out as rl_step calls it, timed and counted, each call's record appended to
    `measured`."""
    roll_out = rl.roll_out

    def timed(run, rows, step, times):
        counters.reset()
        started = time.perf_counter()
        groups = roll_out(run, rows, step, times)
        seconds = time.perf_counter() - started
        flat = [t for g in groups for t in g]
        measured.append(record(counters, seconds, sum(t.num_model_tokens for t in flat),
                               [first_turn(t) for t in flat], tool_busy_s=times["tool_busy"],
                               tool_calls=sum(t.num_tool_calls for t in flat)))
        return groups

    return timed


# -----------------------------------------------------------------------------
# the benchmark


def bench(bench_cfg, cfg):
    """bench_steps RL steps, each measured against plain LLM.generate; -> JSON-ready rows, one per
    mode and step (tools/gpu_check.py writes them out)."""
    run = rl.start_run(cfg)
    counters = Counters(run.engine)
    loop, roll_out = rollout.Rollouts, rl.roll_out
    time_tool_waits(counters)
    measured, trained, rows_out = [], [], []
    rl.roll_out = timed_roll_out(counters, measured)
    try:
        for step in range(1 + bench_cfg.bench_steps):
            position = run.state["data_position"]
            rows = [run.problems[i] for i in prompt_indices(len(run.problems), cfg.seed,
                                                            position, cfg.prompts_per_step)]
            plain = plain_generate(run, rows, step, counters) if step else None
            metrics = rl.rl_step(run, step)  # rank 0's: the benchmark is one process
            trained.append(metrics.get("train_tokens", 0))
            if not step:
                continue
            in_step = measured[-1]
            if plain["first_turns_hash"] != in_step["first_turns_hash"]:
                raise RuntimeError(f"step {step}: plain generate and the rollout phase sampled "
                                   "different first turns; the comparison is void")
            rows_out += [dict(mode="plain LLM.generate", step=step, **plain),
                         dict(mode="rl.py rollout phase", step=step, trained_tokens_before=
                              trained[-2], **in_step)]
    finally:
        rl.roll_out, rollout.Rollouts = roll_out, loop
        counters.close()
    print_table(rows_out, cfg)
    if run.executor:
        run.executor.close()
    run.engine.close()
    return rows_out


def per_token_s(row):
    """Seconds per sampled token, the loop's waits on a tool (nothing to decode) taken out."""
    return (row["seconds"] - row["tool_wait_s"]) / row["sampled_tokens"]


def print_table(rows, cfg):
    tools = cfg.rollout.use_tool
    print(f"\nrl.py steps on {cfg.model}, {cfg.prompts_per_step} prompts x "
          f"{cfg.rollouts_per_prompt} rollouts, tools {'on' if tools else 'off'}, torch threads "
          f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f} at the end")
    print("| step | mode | s | CPU s | sampled tokens | engine steps | s in vLLM | s in the loop | "
          "s waiting on tools | tool busy s | trained tokens before | first turns |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['mode']} | {r['seconds']:.2f} | {r['cpu_s']:.2f} | "
              f"{r['sampled_tokens']:,} | {r['steps']} | {r['in_vllm_s']:.2f} | "
              f"{r['seconds'] - r['in_vllm_s'] - r['tool_wait_s']:.2f} | {r['tool_wait_s']:.2f} | "
              f"{r.get('tool_busy_s', 0):.2f} | {r.get('trained_tokens_before', '-')} | "
              f"{r['first_turns_hash']} |")
    plain = [r for r in rows if r["mode"] == "plain LLM.generate"]
    phase = [r for r in rows if r["mode"] == "rl.py rollout phase"]
    if not tools:  # the same tokens: seconds compare directly
        ratio = sum(r["seconds"] for r in plain) / sum(r["seconds"] for r in phase)
        cpu = sum(r["cpu_s"] for r in plain) / sum(r["cpu_s"] for r in phase)
        print(f"rollout phase / plain LLM.generate, tools off, same tokens, tokens/s over "
              f"{len(phase)} steps: {ratio:.2f}x (target >= 0.95x), per step " + ", ".join(
                  f"{p['seconds'] / r['seconds']:.2f}x" for p, r in zip(plain, phase))
              + f"; per CPU second (load stretches the wall seconds, not these): {cpu:.2f}x")
    else:
        # Plain generate of the first turns only runs every request at once, a fuller batch than
        # the rollout's continuations: its tokens check the sampling, its speed is no baseline.
        ratio = sum(map(per_token_s, phase)) / len(phase) * 1e3
        print(f"rollout phase, tools on: {ratio:.3f} ms per sampled token (tool waits taken out; "
              "target: no more than the tools-off run's), the loop outside vLLM "
              f"{sum(r['seconds'] - r['in_vllm_s'] - r['tool_wait_s'] for r in phase):.2f} s of "
              f"{sum(r['seconds'] for r in phase):.2f} s")
    return ratio


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as run_dir:
        try:
            bench_config, rl_args = split_args(sys.argv[1:])
            config = bench_rl_config(rl_args, run_dir)
        except ConfigError as e:
            sys.exit(f"bench.rl: {e}")
        configure_vllm_logging(config.verbose)
        bench(bench_config, config)
