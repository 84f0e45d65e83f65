"""Seconds of one CPU training step (rl.py's steps 6-7 on the demo's model shape and batch) with
torch's own thread count (train_threads=0: one per core), with 1 thread and with cores - 1, side by
side, first on the machine as it is, then with `busy` busy-looping processes that this script starts
(and stops) beside it:

    python -m bench.threads                   # about 6 minutes on 2 cores at load 12
    python -m bench.threads busy=4 repeats=7

The settings alternate inside each repeat, so each sees the same load; the medians are printed as
ratios against torch's own count, in wall and in CPU seconds, with the load average. It also says
whether the loss and grad norm a few steps in are bit-identical across the thread counts: float
sums in another order change the demo's numbers. Each busy process has a session of its own, as
other users' work does: the kernel's autogroups share the CPU between sessions first.
"""
import dataclasses
import os
import random
import statistics
import subprocess
import sys

import torch

import rl
from bench.train_step import BenchConfig as StepConfig
from bench.train_step import batch, seconds, tiny_model
from machinery.config import load_config
from machinery.distributed import TORCH_THREADS, init_distributed


@dataclasses.dataclass
class ThreadsBenchConfig:
    repeats: int = 5
    busy: int = 4               # busy processes for the loaded phase; 0 = only the machine as it is
    numeric_steps: int = 3      # steps in a row whose last loss and grad norm are compared


def train_steps(threads, samples, rl_cfg, step_cfg, steps=1):
    """(wall s, CPU s) of the last of `steps` rl.train_step calls from the same weights on
    `threads`, and its (loss, grad norm)."""
    torch.set_num_threads(threads)
    model, optimizer = tiny_model(step_cfg)
    out = {}
    for step in range(steps):
        fresh = [dataclasses.replace(s) for s in samples]
        wall, cpu = seconds(lambda: out.update(rl.train_step(model, optimizer, fresh, rl_cfg,
                                                             step, 0, torch.device("cpu"))))
    return (wall, cpu), (float(out["loss"]), out["grad_norm"])


def measure(settings, samples, rl_cfg, step_cfg, repeats):
    times = {name: [] for name in settings}
    for _ in range(repeats):
        for name, threads in settings.items():
            times[name].append(train_steps(threads, samples, rl_cfg, step_cfg)[0])
    return {name: [statistics.median(t[k] for t in values) for k in (0, 1)]
            for name, values in times.items()}


def report(title, medians, load):
    print(f"{title}; load average before and after: {load[0]}, {load[1]}")
    print(f"  {'threads':28s}{'wall s':>8s}{'ratio':>8s}{'CPU s':>8s}{'ratio':>8s}")
    wall0, cpu0 = medians["torch's own"]
    for name, (wall, cpu) in medians.items():
        print(f"  {name:28s}{wall:8.2f}{wall / wall0:8.2f}{cpu:8.2f}{cpu / cpu0:8.2f}")


def main(cfg):
    init_distributed()
    cores = len(os.sched_getaffinity(0))
    settings = {"torch's own": TORCH_THREADS, "1": 1}
    if cores - 1 > 1:
        settings[f"cores - 1 = {cores - 1}"] = cores - 1
    else:
        print(f"{cores} cores: cores - 1 is 1, measured once")
    step_cfg = StepConfig()
    rl_cfg = load_config(rl.RLConfig, ["configs/tiny.yaml"])
    samples = batch(step_cfg, random.Random(0))
    print(f"torch's own count here: {TORCH_THREADS} thread(s); {step_cfg.samples} trajectories "
          f"of ~{step_cfg.prompt_tokens + step_cfg.response_tokens} tokens, median of "
          f"{cfg.repeats}")
    # Numbers first (also the warm-up: allocator, thread pools): the demo's numbers move with the
    # thread count only if some step's loss or grad norm does, which a few steps in shows.
    results = {name: train_steps(threads, samples, rl_cfg, step_cfg, cfg.numeric_steps)[1]
               for name, threads in settings.items()}
    load = os.getloadavg()
    medians = measure(settings, samples, rl_cfg, step_cfg, cfg.repeats)
    report("the machine as it is", medians, (load, os.getloadavg()))
    if cfg.busy:
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                  start_new_session=True) for _ in range(cfg.busy)]
        try:
            load = os.getloadavg()
            medians = measure(settings, samples, rl_cfg, step_cfg, cfg.repeats)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        report(f"with {cfg.busy} busy processes beside it", medians, (load, os.getloadavg()))
    print(f"loss, grad norm of step {cfg.numeric_steps} per thread count (the same weights and "
          "batch):")
    for name, (loss, grad_norm) in results.items():
        print(f"  {name:28s}{loss!r:>24s}{grad_norm!r:>24s}")
    identical = len(set(results.values())) == 1
    print("bit-identical across thread counts" if identical else
          "NOT bit-identical: a thread count other than torch's own moves the demo's numbers")
    torch.distributed.destroy_process_group()
    return medians, results


if __name__ == "__main__":
    main(load_config(ThreadsBenchConfig, sys.argv[1:]))
