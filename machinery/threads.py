"""How many torch threads each CPU phase runs on when the config leaves it to the run
(train_threads=0), decided once at the start. A count above the free cores waits at every kernel's
OpenMP barrier (2 threads beside busy processes on 2 cores: 2.7-3.7x the time of 1), one below
leaves a core idle (docs/benchmarks.md, "Threads"). The rule: the update takes this rank's share of
the cores that processes outside the run's own tree left idle FREE_WHEN_IDLE of WINDOW_S (its own
start-up counts as free, so an idle machine decides the same every time); the decode one less when
the tool's workers run beside it. train_threads=N sets the update's count; OMP_NUM_THREADS, where
set, both. config.yaml keeps the count chosen, so a resume sums as the run did."""
import contextlib
import dataclasses
import math
import os
import time
from pathlib import Path

import psutil
import yaml

from machinery.distributed import RANKS_ON_NODE, cores_per_rank, cpu_threads

WINDOW_S = 0.5   # sees a neighbour that runs in bursts; short beside a run's start (10 s and more)
FREE_WHEN_IDLE = 0.7   # on 2 cores: a light neighbour (a shell) leaves 2, a busy process 1


@dataclasses.dataclass(frozen=True)
class Threads:
    update: int
    decode: int
    why: str      # what decided them, for the settings line


def idle_cores(window_s=WINDOW_S):
    """This process's affinity cores idle over the next window_s, or busy with its own tree; None
    where the kernel's counters cannot be read."""
    try:
        idle_before, all_before, own_before = cpu_seconds()
        time.sleep(window_s)
        idle_after, all_after, own_after = cpu_seconds()
    except (OSError, psutil.Error):
        return None
    cores = len(os.sched_getaffinity(0))
    if all_after <= all_before:
        return None
    idle = cores * (idle_after - idle_before) / (all_after - all_before)
    return min(cores, idle + max(0.0, own_after - own_before) / window_s)


def cpu_seconds():
    """(idle + iowait seconds of the affinity cores, all their seconds, CPU seconds of this
    process's tree with the children it reaped)."""
    cpus = os.sched_getaffinity(0)
    per_cpu = [t for cpu, t in enumerate(psutil.cpu_times(percpu=True)) if cpu in cpus]
    # guest time is inside user: the first eight fields are all there is
    idle = sum(t.idle + t.iowait for t in per_cpu)
    total = sum(sum(t[:8]) for t in per_cpu)
    me = psutil.Process()
    own = 0.0
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):   # gone meanwhile
            own += sum(process.cpu_times()[:4])   # user, system, children_user, children_system
    return idle, total, own


def omp_threads():
    """OMP_NUM_THREADS as a count; None where unset or not a positive number."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def threads_for(train_threads, use_tool, cores, ranks_on_node, idle, omp=None):
    """The rule (the module docstring) as a function of what it reads: -> Threads."""
    if train_threads:
        update, why = train_threads, f"train_threads={train_threads}"
    elif omp:
        update, why = omp, f"OMP_NUM_THREADS={omp}"
    elif idle is None:   # a share of 1 core, or no CPU counters to read
        update, why = 1, f"the rule: nothing measured, {cores} core(s) in this rank's share"
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


def choose_threads(cfg, device, rank):
    """On CPU: torch on the update's count, the settings line on rank 0 (no decode for sft.py,
    which has no engine); -> cfg with train_threads resolved (config.yaml records it). On GPU: cfg
    as it is."""
    if device.type != "cpu":
        return cfg
    use_tool = cfg.rollout.use_tool if hasattr(cfg, "rollout") else None
    threads = decide(cfg.train_threads, use_tool)
    cpu_threads(threads.update, device)
    beside = ("; the tool workers keep a core beside the decode" if use_tool
              and threads.decode < threads.update else "")
    decode = "" if use_tool is None else f", decode {threads.decode}"
    if rank == 0:
        print(f"threads: update {threads.update}{decode} ({threads.why}{beside}); config.yaml: "
              f"train_threads={threads.update}", flush=True)
    return dataclasses.replace(cfg, train_threads=threads.update)


def decode_threads(rollout_cfg, train_threads=0):
    """The engine's count: from rl.py's chosen train_threads, or (0: eval.py, the tools) the rule,
    measured only where the tool would leave the decode more than one core."""
    if not (train_threads or omp_threads()) and cores_per_rank() - rollout_cfg.use_tool <= 1:
        return 1
    return decide(train_threads, rollout_cfg.use_tool).decode


def recorded_train_threads(out_dir):
    """The update's count a run in out_dir chose (0: none), for a replay to sum as the run did."""
    path = Path(out_dir) / "config.yaml"
    return int(yaml.safe_load(path.read_text()).get("train_threads") or 0) if path.is_file() else 0
