"""Seconds of the demo's RL step (rl.rl_step on configs/tiny.yaml: weight sync, rollout with the
tool, rewards, selection, update) under three thread settings, alternated, on the machine as it is
and beside busy-looping processes that this script starts and stops:

    python -m bench.threads                     # after demo.py (its SFT'd policy): 6-8 min idle
    python -m bench.threads bench_busy=0,12 bench_repeats=5 [any rl.py key=value]

    1 thread      train_threads=1, the engine on 1: the default before machinery/threads.py
    torch's own   train_threads=torch's count (one per core), the engine on 1: train_threads=0 once
    the rule      machinery/threads.py's counts, measured at the start of each condition, as a run
                  started then would choose them

Every measured call is the same step: the weights, the optimizer's state and the data position are
put back before each, so every setting does the same work on the same prompts and seeds, and the
settings take turns (the order rotates each repeat) so each sees the same load. Each busy process
has a session of its own, as other users' work does: the kernel's autogroups share the CPU between
sessions first (bench.busy_processes). Printed per condition: the rule's choice, median seconds of
the step, its rollout and its update, and each setting's time as a ratio of 1 thread's, with the
load average; then which metrics differ between thread counts (float sums in another order) and
whether a count repeats its own numbers bit for bit.
"""
import dataclasses
import os
import statistics
import sys
import tempfile
import time

import torch

import rl
from bench import busy_processes
from bench.rl import bench_rl_config
from machinery.config import ConfigError, load_config
from machinery.distributed import TORCH_THREADS, cpu_threads
from machinery.engine import configure_vllm_logging
from machinery.threads import decide, settings_line

# past warmup_steps, saving nothing: every measured call runs this step
STEP = 4


@dataclasses.dataclass
class ThreadsBenchConfig:
    bench_repeats: int = 3          # measured steps per setting and condition
    bench_busy: list[int] = dataclasses.field(default_factory=lambda: [0, 4, 12])  # 0: as it is


def snapshot(run):
    """The state rl_step changes: weights, optimizer moments, data position."""
    with torch.no_grad():
        weights = [p.detach().clone() for p in run.model.parameters()]
    moments = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
               for p, state in run.optimizer.state.items()}
    return weights, moments, dict(run.state)


def restore(run, saved):
    weights, moments, state = saved
    with torch.no_grad():
        for p, w in zip(run.model.parameters(), weights):
            p.detach().copy_(w)
        for p, kept in moments.items():
            for k, v in kept.items():
                if torch.is_tensor(v):
                    run.optimizer.state[p][k].copy_(v)
                else:
                    run.optimizer.state[p][k] = v
    run.state = dict(state)


def timed_step(run, cfg, saved, update, decode):
    """One rl_step on `update` training threads with the engine on `decode`, from `saved`."""
    restore(run, saved)
    run.cfg = dataclasses.replace(cfg, train_threads=update)
    cpu_threads(decode, run.device)  # rl_step puts this count back after its update
    started = time.perf_counter()
    row = rl.rl_step(run, STEP)
    seconds = time.perf_counter() - started
    with torch.no_grad():  # the weights after the update: where another thread count shows first
        row["weights_after"] = torch.cat([
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
            for p in run.model.parameters()])
    return seconds, row


def measure(run, cfg, saved, settings, repeats):
    """{setting: [(seconds, metrics row)]}, the settings taking turns."""
    names, out = list(settings), {name: [] for name in settings}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(timed_step(run, cfg, saved, *settings[name]))
    return out


def report(busy, rule, settings, measured, load):
    print(f"\n{'the machine as it is' if not busy else f'beside {busy} busy processes'}; load "
          f"average {load[0]:.1f} before, {load[1]:.1f} after; {settings_line(rule, True)}")
    print(f"  {'setting':14s}{'update':>7s}{'decode':>7s}{'step s':>8s}{'rollout s':>10s}"
          f"{'train s':>9s}{'/ 1 thread':>11s}")
    base = statistics.median(s for s, _ in measured["1 thread"])
    ratios = {}
    for name, runs in measured.items():
        step = statistics.median(s for s, _ in runs)
        rollout = statistics.median(row["time/rollout"] for _, row in runs)
        train = statistics.median(row["time/train"] for _, row in runs)
        ratios[name] = step / base
        print(f"  {name:14s}{settings[name][0]:7d}{settings[name][1]:7d}{step:8.2f}{rollout:10.2f}"
              f"{train:9.2f}{step / base:10.2f}x")
    return ratios


def numbers(rows_by_threads):
    """Which metrics differ between thread counts, by how much; whether a count repeats itself."""
    def plain(row):
        return {k: v for k, v in row.items() if not k.startswith("time/")
                and not k.endswith("_per_s") and k != "weights_after"}

    print("\nnumbers of the same step (same weights, prompts, seeds) per (update, decode) threads:")
    rows = {threads: [plain(r) for r in group] for threads, group in rows_by_threads.items()}
    weights = {threads: [r["weights_after"] for r in group]
               for threads, group in rows_by_threads.items()}
    for threads, group in rows.items():
        same = (all(r == group[0] for r in group)
                and all(torch.equal(w, weights[threads][0]) for w in weights[threads]))
        print(f"  {threads}: {len(group)} steps, metrics and weights after "
              f"{'bit-identical' if same else 'NOT bit-identical'} among themselves")
    counts = sorted(rows)
    for other in counts[1:]:
        a, b = rows[counts[0]][0], rows[other][0]
        moved = {k: abs(a[k] - b[k]) / max(abs(a[k]), 1e-30) for k in a
                 if k in b and a[k] != b[k] and isinstance(a[k], (int, float))
                 and isinstance(b[k], (int, float))}
        gap = (weights[counts[0]][0] - weights[other][0]).abs().max().item()
        print(f"  {counts[0]} against {other}: " + (", ".join(
            f"{k} (relative {d:.1e})" for k, d in sorted(moved.items(), key=lambda x: -x[1]))
            or "every metric equal") + f"; weights after the update: max |difference| {gap:.1e}")


def main(bench_cfg, cfg):
    started = time.time()
    run = rl.start_run(cfg)
    cfg = run.cfg
    settings = {"1 thread": (1, 1), "torch's own": (TORCH_THREADS, 1)}
    print(f"torch's own count here: {TORCH_THREADS}; {bench_cfg.bench_repeats} steps per setting "
          "and condition, medians")
    rl.rl_step(run, STEP)  # the engine's and the update's first calls build their kernels
    saved = snapshot(run)
    for name, threads in settings.items():  # each thread pool once, unmeasured
        timed_step(run, cfg, saved, *threads)
    ratios, rows_by_threads = {}, {}
    for busy in bench_cfg.bench_busy:
        with busy_processes(busy):
            time.sleep(1.0 if busy else 0)  # running before the rule looks
            rule = decide(0, cfg.rollout.use_tool)
            load = os.getloadavg()[0]
            conditions = {**settings, "the rule": (rule.update, rule.decode)}
            measured = measure(run, cfg, saved, conditions, bench_cfg.bench_repeats)
            ratios[busy] = (report(busy, rule, conditions, measured, (load, os.getloadavg()[0])),
                            (rule.update, rule.decode) == settings["1 thread"])
        for name, runs in measured.items():
            rows_by_threads.setdefault(conditions[name], []).extend(row for _, row in runs)
    numbers(rows_by_threads)
    print()
    for busy, (step_ratios, same) in ratios.items():
        # where the rule chose 1 thread the two rows ran the same setting: their ratio is noise
        note = " (the rule chose 1 thread here too: the load's noise)" if same else ""
        if not busy:
            print(f"as it is: the rule {1 / step_ratios['the rule']:.2f}x faster than 1 thread"
                  f"{note} (target on an idle machine: >= 1.2x)")
        else:
            print(f"beside {busy} busy processes: the rule at {step_ratios['the rule']:.2f}x 1 "
                  f"thread's time{note} (target beside 12: <= 1.1x)")
    print(f"bench.threads: {time.time() - started:.0f} s")
    if run.executor:
        run.executor.close()
    run.engine.close()
    return ratios


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as run_dir:
        argv = sys.argv[1:]
        try:
            bench_config = load_config(ThreadsBenchConfig, [a for a in argv
                                                            if a.startswith("bench_")])
            rl_args = [a for a in argv if not a.startswith("bench_")]
            if not any(a.endswith((".yaml", ".yml")) for a in rl_args):
                rl_args = ["configs/tiny.yaml", *rl_args]  # the demo's
            config = bench_rl_config(rl_args, run_dir)
            config = dataclasses.replace(config, save_rollouts_every=0)
        except ConfigError as e:
            sys.exit(f"bench.threads: {e}")
        configure_vllm_logging(config.verbose)
        main(bench_config, config)
