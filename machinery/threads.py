"""How many torch threads each CPU phase runs on when the config leaves it to the run
(train_threads=0, the default), decided once at the start; rl.py and sft.py call choose_threads,
the engine takes decode_threads.

Every torch kernel ends at an OpenMP barrier, so a count above the cores that are really free makes
each kernel wait for the thread another process preempted (beside busy processes on 2 cores a step
on 2 threads took 2.7-3.7x the time of 1), while on a free machine one thread leaves a core idle
(docs/benchmarks.md, "Threads"). So:

    cores    this rank's share of the node's cores (cores_per_rank)
    idle     that share of the cores that processes outside this one's own tree left idle over
             WINDOW_S: the run's own start-up (its workers importing sympy) counts as free, so an
             idle machine decides the same every time
    update   the cores of that share idle FREE_WHEN_IDLE of the window; at least 1, at most cores
    decode   the update's count less one core when the tool is on (its workers run beside it)

train_threads=N sets the update's count; OMP_NUM_THREADS, where set (torchrun sets 1 for several
ranks a node), is both counts, train_threads still the update's. The run keeps the count it chose
in config.yaml, so a resume sums as the run did (on the demo 1 and 2 threads give the same
gradients, tests/test_threads.py; a larger model's reductions may split otherwise).
"""
import dataclasses
import math
import os
import time
from pathlib import Path

import psutil
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
    """How many of this process's affinity cores were idle over the next window_s seconds, or busy
    with this process's own tree (the caller sleeps meanwhile: what is busy besides is someone
    else); None where the kernel's counters cannot be read."""
    try:
        before = cpu_seconds()
        time.sleep(window_s)
        after = cpu_seconds()
    except (OSError, psutil.Error):
        return None
    (idle_before, all_before, own_before), (idle_after, all_after, own_after) = before, after
    cores = len(os.sched_getaffinity(0))
    if all_after <= all_before:
        return None
    idle = cores * (idle_after - idle_before) / (all_after - all_before)
    return min(cores, idle + max(0.0, own_after - own_before) / window_s)


def cpu_seconds():
    """(idle + iowait seconds of this process's affinity cores, all their seconds, CPU seconds of
    this process's tree: itself, its descendants and the children it reaped)."""
    cpus = os.sched_getaffinity(0)
    per_cpu = [t for cpu, t in enumerate(psutil.cpu_times(percpu=True)) if cpu in cpus]
    # guest time is inside user: the first eight fields are all there is
    idle = sum(t.idle + t.iowait for t in per_cpu)
    total = sum(sum(t[:8]) for t in per_cpu)
    me = psutil.Process()
    own = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            own += sum(process.cpu_times()[:4])   # user, system, children_user, children_system
        except psutil.Error:   # gone meanwhile
            pass
    return idle, total, own


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
        update, why = 1, "the rule: no CPU counters to read, so the count that waits on no one"
    else:
        update = max(1, min(cores, math.floor(idle / ranks_on_node + 1 - FREE_WHEN_IDLE)))
        share = f", this rank's share {cores}" if ranks_on_node > 1 else ""
        why = (f"the rule: {idle:.1f} of {cores * ranks_on_node} cores free of other processes "
               f"over {WINDOW_S} s{share}")
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
