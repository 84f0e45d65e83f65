"""Benchmark and soak of executor.py, the Python tool's sandbox; run from the repo root:

    python -m bench.executor               # calls/s, p50/p99 and CPU per call vs `python -c`
    python -m bench.executor scale=0.2     # the same, a fifth of the calls: a quick look
    python -m bench.executor mode=soak calls=10000 timeout_s=2   # hostile mix: leaks, strays

tests/test_executor.py imports the soak and the leak counters from here."""
import contextlib
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import psutil

from executor import Executor
from machinery.config import NonNegativeInt, PositiveFloat, PositiveInt, load_config
from machinery.sandbox import SANDBOX_UID_BASE


@dataclasses.dataclass
class ExecutorBenchConfig:
    mode: Literal["bench", "soak"] = "bench"
    workers: NonNegativeInt = 0  # 0 = one per core
    timeout_s: PositiveFloat = 4.0
    calls: PositiveInt = 10000   # soak: the number of calls
    scale: PositiveFloat = 1.0     # bench: multiplies every call count


# -----------------------------------------------------------------------------
# leak counters, shared by the soak and the tests, checked from outside


def stray_processes(ex):
    """The processes calls of `ex` left behind, empty between calls: anything below a worker's PID 1
    (or the worker, without a namespace), or running as one of its sandbox uids."""
    pids = [w.proc.pid for slot in ex._slots for w in slot if w.proc is not None]
    roots = [psutil.Process(pid) for pid in pids]
    if ex.isolation["pid_namespace"]:   # the worker's waiter, then its PID 1
        roots = [child for root in roots for child in root.children()]
    strays = {p.pid for root in roots for p in root.children(recursive=True)}
    uids = {SANDBOX_UID_BASE + pid for pid in pids}
    strays.update(p.pid for p in psutil.process_iter(["uids"])
                  if p.info["uids"] and p.info["uids"].real in uids)
    return sorted(strays)


def leak_counters(ex):
    """(zombies among this process's descendants, stray processes, this process's open fds, its RSS
    in MiB)."""
    zombies = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            zombies += child.status() == psutil.STATUS_ZOMBIE
    rss_mb = psutil.Process().memory_info().rss >> 20
    return zombies, len(stray_processes(ex)), len(os.listdir("/proc/self/fd")), rss_mb


# one call in ten of the soak: (code, the status it must get, or None if several are right)
HOSTILE = [
    ("import time\ntime.sleep(30)", "timeout"),
    ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
     "        import time; time.sleep(60)\nprint('parent done')", "ok"),
    ("x = bytearray(1 << 40)", "oom"),
    ("while True:\n    print('x' * 100000)", "error"),
    ("import os, signal\nos.kill(-1, signal.SIGKILL)", None),
    ("import os\nos.kill(os.getppid(), 9)\nprint('still here')", None),
    ("import os\nwhile True:\n    try:\n        os.fork()\n"
     "    except OSError:\n        break", None),
    ("raise ValueError('boom')", "error"),
    ("open('/tmp/leak', 'w').write('x')\nimport os\n"
     "os.makedirs(os.path.expanduser('~/.cache/x'))", "ok"),
]


def soak(ex, calls, wave=500):
    """`calls` calls in waves of `wave`, one in ten from HOSTILE; the leak counters after the first
    wave (allocators and caches warm) and at the end."""
    benign = [("print(sum(range(100)))", "ok", ""),
              ("a = input()\nprint(a[::-1])", "ok", "stressed"),
              ("import math\nmath.factorial(200)", "ok", ""), ("1/0", "error", "")]
    benign_codes = {code for code, _, _ in benign}
    ex.wait_ready()
    before, wrong, statuses, benign_timeouts = None, [], {}, 0

    for first in range(0, calls, wave):
        # a whole wave at once: a queue 250 x workers deep, as in a burst of rollout tool calls
        futures = []
        for i in range(first, min(first + wave, calls)):
            code, expect, stdin = ((*HOSTILE[(i // 10) % len(HOSTILE)], "") if i % 10 == 9
                                   else benign[i % len(benign)])
            futures.append((ex.submit(code, stdin), expect, code))
        for future, expect, code in futures:
            result = future.result()
            statuses[result.status] = statuses.get(result.status, 0) + 1
            if result.status == "timeout" and code in benign_codes:   # a starved machine, not a bug
                benign_timeouts += 1
            elif expect is not None and result.status != expect:
                wrong.append((code, result))
        del futures, future, result   # what a rollout does with results: read them, let them go
        before = before or leak_counters(ex)
    after = leak_counters(ex)
    return dict(calls=calls, statuses=statuses, wrong=wrong, benign_timeouts=benign_timeouts,
                load_average=round(os.getloadavg()[0], 1), zombies=after[0], strays=after[1],
                fds_before=before[2], fds_after=after[2], rss_mb_before=before[3],
                rss_mb_after=after[3], benign_after=ex.run("print('alive')").stdout == "alive\n")


# -----------------------------------------------------------------------------
# the benchmark: three workloads at concurrency 1, workers and 4 x workers against `python -c` per
# call, interleaved in one run so that a busy machine moves all the numbers together


TRIVIAL = "print(1 + 1)"
# calls that import sympy or numpy and do little: the import is what a fresh interpreter pays
IMPORT_SNIPPETS = [
    "import sympy\nprint(sympy.Rational(1, 3) + sympy.Rational(1, 6))",
    "import numpy as np\nprint(np.arange(10).sum())",
    "from sympy import isprime\nprint(isprime(2**31 - 1))",
    "import numpy as np\nprint(np.linalg.det(np.array([[1.0, 2.0], [3.0, 4.0]])))",
]


def realistic_mix():
    """100 calls shaped like math-RL tool calls, in a fixed order: 60% sympy/numpy work, 20% stdlib,
    10% stdin, 9% exceptions, 1% an endless loop (the full timeout_s on both sides)."""
    heavy = ["import sympy as sp\nx = sp.symbols('x')\nprint(sp.factor(x**4 - 1))",
             "from sympy import symbols, solve\nx = symbols('x')\nprint(solve(x**2 - 5*x + 6, x))",
             "import numpy as np\na = np.arange(12).reshape(3, 4)\nprint(a.sum(axis=0))",
             "import sympy\nprint(sympy.isprime(2**61 - 1), sympy.factorint(360))"]
    light = ["print(sum(i * i for i in range(10000)))",
             "from fractions import Fraction\nprint(sum(Fraction(1, k) for k in range(1, 40)))"]
    errors = ["x = [1, 2, 3]\nprint(x[5])", "import sympy\nsympy.Symbol('x') + 'a'"]
    calls = [(light[i % 2] if i % 10 in (1, 5) else heavy[i % 4], "") for i in range(100)]
    calls[3::10] = [(errors[i % 2], "") for i in range(3, 100, 10)]
    calls[7::10] = [("a, b = map(int, input().split())\nprint(a * b)", "6 7")] * 10
    calls[50] = ("while True:\n    pass", "")
    return calls


def _drive(call, calls, concurrency):
    """`calls` through `call(code, stdin)` from `concurrency` client threads: (seconds, latencies of
    the calls that did not time out)."""
    latencies = []

    def timed(item):
        start = time.perf_counter()
        if call(*item) != "timeout":
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as clients:
        list(clients.map(timed, calls))
    return time.perf_counter() - start, latencies


def bench(cfg):
    """Calls/s in 5 interleaved rounds, then CPU per call. About 2 minutes on 2 idle cores."""
    workers = cfg.workers or len(os.sched_getaffinity(0))
    concurrencies = (1, workers, 4 * workers)

    def naive(code, stdin):   # 3 x timeout_s: loaded, `import sympy` alone passes 4 s
        try:
            subprocess.run([sys.executable, "-c", code], input=stdin.encode(), capture_output=True,
                           timeout=3 * cfg.timeout_s)
        except subprocess.TimeoutExpired:
            return "timeout"

    workloads = {"trivial": ([(TRIVIAL, "")] * 1000, 100),
                 "import": ([(c, "") for c in IMPORT_SNIPPETS] * 50, 8),
                 "mix": (realistic_mix(), 100)}
    load_start = os.getloadavg()[0]
    print(f"{workers} workers, {os.cpu_count()} CPUs, load average {load_start:.1f}", flush=True)
    rows, summary = [], []
    with Executor(workers=workers, timeout_s=cfg.timeout_s) as ex:
        ex.wait_ready()   # a heavy worker's 1-2 s start is not what a long run pays per call
        run = lambda code, stdin: ex.run(code, stdin).status
        for name, (calls, naive_calls) in workloads.items():
            calls = calls[:max(1, round(len(calls) * cfg.scale))]
            naive_calls = calls[:max(1, round(naive_calls * cfg.scale))]
            seconds, latencies = {c: 0.0 for c in concurrencies}, {c: [] for c in concurrencies}
            naive_seconds, rounds = 0.0, 5
            for r in range(rounds):   # every fifth call, the two sides alternated
                for c in concurrencies:
                    spent, finished = _drive(run, calls[r::rounds], c)
                    seconds[c] += spent
                    latencies[c] += finished
                naive_seconds += _drive(naive, naive_calls[r::rounds], workers)[0]
            rates = {c: len(calls) / seconds[c] for c in concurrencies}
            naive_rate = len(naive_calls) / naive_seconds
            queue = sorted(latencies[4 * workers])
            p50, p99 = queue[len(queue) // 2], queue[min(len(queue) - 1, int(0.99 * len(queue)))]
            rows.append(f"| {name} | {' / '.join(f'{rates[c]:.0f}' for c in concurrencies)} | "
                        f"{p99 / p50:.1f} | {naive_rate:.1f} | "
                        f"{rates[workers] / naive_rate:.1f}x |")

        # CPU per call: the cost itself, which the load does not move
        for name, code, n in (("trivial", TRIVIAL, 1000), ("import", IMPORT_SNIPPETS[0], 200)):
            n = max(20, round(n * cfg.scale))
            ours = [psutil.Process(), *psutil.Process().children(recursive=True)]
            before = sum(sum(p.cpu_times()[:4]) for p in ours)
            _drive(run, [(code, "")] * n, workers)
            executor_cpu = (sum(sum(p.cpu_times()[:4]) for p in ours) - before) / n
            reaped = lambda: sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])   # user + system
            before, n_naive = reaped(), max(2, n // 50)
            _drive(naive, [(code, "")] * n_naive, workers)
            naive_cpu = (reaped() - before) / n_naive
            summary.append(f"{name}: CPU per call {1e3 * executor_cpu:.2f} ms (this process, the "
                           f"workers and their children) vs {1e3 * naive_cpu:.1f} ms for "
                           f"python -c: {naive_cpu / executor_cpu:.1f}x")
        isolation = ex.isolation
    print("\n".join(summary))
    print(f"\n| workload | executor calls/s c={' / '.join(map(str, concurrencies))} | p99/p50 at "
          f"c={4 * workers} | python -c, c={workers} | ratio at c={workers} |\n"
          "|---|---|---|---|---|\n"
          + "\n".join(rows))
    print(f"\nload average at the start {load_start:.1f}, at the end {os.getloadavg()[0]:.1f}")
    print("isolation:", json.dumps({k: v for k, v in isolation.items()
                                    if v not in ([], False, None)}))


def run_soak(cfg):
    start = time.perf_counter()
    with Executor(workers=cfg.workers or None, timeout_s=cfg.timeout_s) as ex:
        stats = dict(soak(ex, cfg.calls), seconds=round(time.perf_counter() - start, 1))
    wrong = stats.pop("wrong")
    print(json.dumps(stats, indent=1))
    for code, result in wrong[:5]:
        print("unexpected:", repr(code[:60]), result)
    passed = not wrong and not stats["zombies"] and not stats["strays"] and stats["benign_after"] \
        and stats["fds_after"] <= stats["fds_before"] \
        and stats["rss_mb_after"] <= stats["rss_mb_before"] + 20
    print("SOAK", "PASSED" if passed else "FAILED")
    return passed


if __name__ == "__main__":
    cfg = load_config(ExecutorBenchConfig)
    if cfg.mode == "bench":
        bench(cfg)
    else:
        sys.exit(0 if run_soak(cfg) else 1)
