"""How many torch threads each CPU phase runs on when the config leaves it to the run
(train_threads=0, the default): from the cores this rank may use and how many of them are free
when it starts. rl.py and sft.py call choose_threads once; the engine takes decode_threads.

On CPU two phases run torch kernels: the engine's decode (the rollout, the held-out evaluation) and
the update (rl.py's steps 6-7, sft.py's steps). Every kernel ends at an OpenMP barrier, so a count
above the cores that are really free makes each kernel wait for the thread another process
preempted: beside busy processes on 2 cores a training step on 2 threads took 2.7-3.7x the time of
1. On a free machine one thread leaves a core idle: the demo's update is ~1.5x faster on 2
(docs/benchmarks.md, "Threads"; python -m bench.threads measures both). So:

    cores    this rank's share of the node's affinity cores (cores_per_rank: what the tool
             workers take by default)
    idle     the node's affinity cores that /proc/stat found idle over WINDOW_S while this process
             slept, this rank's share (divided by the ranks on the node)
    update   the idle cores of that share, a core counted when it was idle FREE_WHEN_IDLE of the
             window; at least 1, at most `cores`
    decode   the update's count less one core when the tool is on: the tool workers run their
             calls beside the decode (a call arrives while the engine decodes the other
             trajectories). The verifier grades between the two phases while both wait, and
             neither pool's idle processes take a core.

train_threads=N sets the update's count (the decode's follows it); OMP_NUM_THREADS, where set
(torchrun sets 1 for several ranks a node), is both counts, train_threads still the update's.

Decided once, at the start, not per step: the update's float sums follow its thread count, so a
count that followed each step's load would put the moment into every step's grad norm. The run
keeps the count it chose in config.yaml (train_threads: the number), and a resume or rerun with
that train_threads sums in the same order; a resume that chose another is in history.jsonl.
The decode's count follows from it and use_tool, and does not change the sampled tokens
(python -m bench.rl compares them); what the update's count moves: docs/benchmarks.md.
"""
import dataclasses
import math
import os
import time
from pathlib import Path

import yaml

from machinery.distributed import RANKS_ON_NODE, cores_per_rank, cpu_threads

# Long enough to see a neighbour that runs in bursts (a test suite, a tool worker), short beside
# a run's start (loading the model, starting the engine: 10 s and more on CPU).
WINDOW_S = 0.5
# A core counts as free when the window found it idle this share of the time: on 2 cores, one
# light neighbour (an editor, a shell) leaves 2, one busy process 1.
FREE_WHEN_IDLE = 0.7


@dataclasses.dataclass(frozen=True)
class Threads:
    update: int
    decode: int
    why: str      # what decided them, for the settings line


def idle_cores(window_s=WINDOW_S):
    """How many of this process's affinity cores were idle over the next window_s seconds (idle
    and iowait jiffies of each core in /proc/stat, summed as fractions of the window); None where
    /proc/stat cannot be read. The caller sleeps meanwhile: what is busy is someone else."""
    cpus = os.sched_getaffinity(0)
    try:
        before = cpu_jiffies(cpus)
        time.sleep(window_s)
        after = cpu_jiffies(cpus)
    except (OSError, ValueError):
        return None
    idle = 0.0
    for cpu, (idle_before, total_before) in before.items():
        idle_after, total_after = after.get(cpu, (idle_before, total_before))
        if total_after > total_before:
            idle += (idle_after - idle_before) / (total_after - total_before)
    return idle


def cpu_jiffies(cpus):
    """{cpu: (idle + iowait jiffies, all jiffies)} of the listed CPUs, from /proc/stat's cpuN
    lines (user nice system idle iowait irq softirq steal; guest time is inside user)."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                values = [int(v) for v in fields[:8]]
                out[int(name[3:])] = (values[3] + values[4], sum(values))
    return out


def omp_threads():
    """OMP_NUM_THREADS as a count, or None where it is unset or not a positive number."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def threads_for(train_threads, use_tool, cores, ranks_on_node, idle, omp=None):
    """The rule (the module docstring) as a function of what it reads: -> Threads."""
    if train_threads:
        update, why = train_threads, f"train_threads={train_threads}"
    elif omp:
        update, why = omp, f"OMP_NUM_THREADS={omp}"
    elif cores == 1:
        update, why = 1, "the rule: this rank's share of the node is 1 core"
    elif idle is None:
        update, why = 1, "the rule: /proc/stat unreadable, so the count that waits on no one"
    else:
        update = max(1, min(cores, math.floor(idle / ranks_on_node + 1 - FREE_WHEN_IDLE)))
        share = f", this rank's share {cores}" if ranks_on_node > 1 else ""
        why = (f"the rule: {idle:.1f} of {cores * ranks_on_node} cores idle over {WINDOW_S} s"
               f"{share}")
    decode = omp or max(1, min(update, cores) - bool(use_tool))
    return Threads(update, decode, why)


def decide(train_threads, use_tool):
    """Threads for this rank now; measures only where the count depends on it."""
    omp, cores = omp_threads(), cores_per_rank()
    measure = not train_threads and not omp and cores > 1
    return threads_for(train_threads, use_tool, cores, RANKS_ON_NODE,
                       idle_cores() if measure else None, omp)


def settings_line(threads, use_tool):
    """The line a script prints once at its start. use_tool None: no engine (sft.py)."""
    kept = f"; config.yaml: train_threads={threads.update}"
    if use_tool is None:
        return f"threads: update {threads.update} ({threads.why}){kept}"
    beside = ("; the tool workers keep a core beside the decode" if use_tool
              and threads.decode < threads.update else "")
    return (f"threads: update {threads.update}, decode {threads.decode} ({threads.why}{beside})"
            f"{kept}")


def choose_threads(cfg, device, rank):
    """rl.py's and sft.py's start on CPU: torch on the update's count and the settings line
    printed on rank 0; -> cfg with train_threads the chosen number (0 resolved), which config.yaml
    then records. On GPU both phases run on the device: cfg as it is, no line."""
    if device.type != "cpu":
        return cfg
    use_tool = cfg.rollout.use_tool if hasattr(cfg, "rollout") else None
    threads = decide(cfg.train_threads, use_tool)
    cpu_threads(threads.update, device)
    if rank == 0:
        print(settings_line(threads, use_tool), flush=True)
    return dataclasses.replace(cfg, train_threads=threads.update)


def decode_threads(rollout_cfg, train_threads=0):
    """The engine's count. rl.py passes the train_threads choose_threads chose (a number: nothing
    is measured again); 0 (eval.py, the tools): the rule, measured only where the tool would leave
    the decode more than one core."""
    if not (train_threads or omp_threads()) and cores_per_rank() - rollout_cfg.use_tool <= 1:
        return 1
    return decide(train_threads, rollout_cfg.use_tool).decode


def recorded_train_threads(out_dir):
    """The update's count a run in out_dir chose (its config.yaml), 0 where there is none: what a
    replay of its steps (tools/replay.py) trains on to sum as the run did."""
    path = Path(out_dir) / "config.yaml"
    return int(yaml.safe_load(path.read_text()).get("train_threads") or 0) if path.is_file() else 0
