"""Benchmark and soak of executor.py, the Python tool's sandbox.

Run from the repo root, as a module (so that `import executor` is the top-level executor.py):
    python -m bench.executor               # calls/s, p50/p99 vs `python -c` and the fork floor
    python -m bench.executor scale=0.2     # the same, a fifth of the calls: a quick look
    python -m bench.executor mode=soak calls=10000 timeout_s=2
                                           # hostile mix; checks zombies, strays, fds, memory
Other keys: workers (0 = one per core), timeout_s, memory_mb. tests/test_executor.py imports the
soak and the leak counters from here.
"""
import dataclasses
import json
import os
import resource
import subprocess
import sys
import threading
import time

from machinery.config import load_config
from machinery.sandbox import SANDBOX_UID_BASE
from executor import Executor


@dataclasses.dataclass
class ExecutorBenchConfig:
    mode: str = "bench"          # bench | soak
    workers: int = 0             # 0 = one per core
    timeout_s: float = 4.0
    memory_mb: int = 1024
    calls: int = 10000           # soak: the number of calls
    scale: float = 1.0           # bench: multiplies every call count

    def validate(self):
        if self.mode not in ("bench", "soak"):
            raise ValueError(f"mode must be bench or soak, got {self.mode!r}")
        if self.workers < 0 or self.calls < 1 or self.scale <= 0:
            raise ValueError(f"need workers >= 0, calls >= 1, scale > 0; got {self.workers}, "
                             f"{self.calls}, {self.scale}")


# -----------------------------------------------------------------------------
# leak counters, shared by the soak and the tests
#
# What "the caller does not leak because of tool code" means, checked from outside: no zombie below
# this process, no process of a call alive after its result came back, no fd and no memory growth
# here.


def _descendants(pid):
    # /proc/<pid>/task/<tid>/children lists the children of each thread; a worker's children hang
    # off its main thread, this process's off whichever thread started them
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            found += [kid] + _descendants(kid)
    return found


def stray_processes(ex):
    """The processes that calls of `ex` left behind: anything below a worker but its own PID 1, or
    anything running as one of its sandbox uids. Empty between calls."""
    workers = [w.proc.pid for slot in ex._slots for w in slot if w.proc is not None]
    own = 1 if ex.isolation["pid_namespace"] else 0
    strays = [pid for w in workers for pid in _descendants(w)[own:]]
    uids = {SANDBOX_UID_BASE + w for w in workers}
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid in uids:
                strays.append(int(name))
        except OSError:
            pass
    return sorted(set(strays))


def leak_counters(ex):
    """(zombies among this process's descendants, stray processes, this process's open fds, its RSS
    in MiB)."""
    zombies = 0
    for kid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{kid}/stat") as f:
                zombies += f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            pass
    with open("/proc/self/statm") as f:
        rss_mb = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    return zombies, len(stray_processes(ex)), len(os.listdir("/proc/self/fd")), rss_mb


# one call in ten of the soak: (code, the status it must get, or None if several are right)
HOSTILE = [
    # a sleep: no CPU used, so only the wall clock stops it
    ("import time\ntime.sleep(30)", "timeout"),
    # a daemon (setsid + double fork) that would outlive the call and hold its stdout open
    ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
     "        import time; time.sleep(60)\nprint('parent done')", "ok"),
    # a terabyte at once
    ("x = bytearray(1 << 40)", "oom"),
    # endless printing: stopped at the output limit, in memory only head and tail
    ("while True:\n    print('x' * 100000)", "error"),
    # every process it may signal: inside the namespace, only its own
    ("import os, signal\nos.kill(-1, signal.SIGKILL)", None),
    # its parent: PID 1 of the namespace ignores it, without a namespace the worker dies and is
    # replaced
    ("import os\nos.kill(os.getppid(), 9)\nprint('still here')", None),
    # a fork bomb: RLIMIT_NPROC caps it (each process stops at its first failed fork), the sweep
    # kills the rest
    ("import os\nwhile True:\n    try:\n        os.fork()\n"
     "    except OSError:\n        break", None),
    # an ordinary error
    ("raise ValueError('boom')", "error"),
    # files outside the call's directory, which must not be there for the next call
    ("open('/tmp/leak', 'w').write('x')\nimport os\n"
     "os.makedirs(os.path.expanduser('~/.cache/x'))", "ok"),
]


def soak(ex, calls, report_every=0, wave=500):
    """`calls` calls in waves of `wave`, one in ten from HOSTILE, the rest benign. The leak counters
    are taken after the first wave (when allocators and caches have warmed up) and at the end."""
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
            if result.status == "timeout" and code in benign_codes:
                # a machine too busy for even 3 x timeout_s; counted apart from bugs
                benign_timeouts += 1
            elif expect is not None and result.status != expect:
                wrong.append((code, result))
        del futures, future, result   # what a rollout does with results: read them, let them go
        before = before or leak_counters(ex)
        if report_every and (first + wave) % report_every == 0:
            print(f"done {min(first + wave, calls)}", flush=True)
    after = leak_counters(ex)
    return dict(calls=calls, statuses=statuses, wrong=wrong, benign_timeouts=benign_timeouts,
                load_average=round(os.getloadavg()[0], 1), zombies=after[0], strays=after[1],
                fds_before=before[2], fds_after=after[2], rss_mb_before=before[3],
                rss_mb_after=after[3], benign_after=ex.run("print('alive')").stdout == "alive\n")


# -----------------------------------------------------------------------------
# the benchmark
#
# Three workloads, each at concurrency 1 (latency), workers (all cores busy) and 4 x workers (a
# queue: the rollout's case, many trajectories calling at once), against two references measured in
# the same run so that a busy machine moves all the numbers together:
#   python -c   what a tool without warm workers does per call (subprocess.run of a fresh
#               interpreter);
#   fork floor  fork + exit + wait and nothing else, the bound of any design that forks per call.


TRIVIAL = "print(1 + 1)"
# Tool calls that import sympy or numpy and do little: the import is what a fresh interpreter pays
# each time.
IMPORT_SNIPPETS = [
    "import sympy\nprint(sympy.Rational(1, 3) + sympy.Rational(1, 6))",
    "import numpy as np\nprint(np.arange(10).sum())",
    "from sympy import isprime\nprint(isprime(2**31 - 1))",
    "import numpy as np\nprint(np.linalg.det(np.array([[1.0, 2.0], [3.0, 4.0]])))",
]


def realistic_mix():
    """100 calls shaped like math-RL tool calls: 60% sympy/numpy work, 20% stdlib, 10% stdin, 9%
    exceptions, 1% an endless loop (which takes the full timeout_s, in both the executor and the
    baseline)."""
    heavy = ["import sympy as sp\nx = sp.symbols('x')\nprint(sp.factor(x**4 - 1))",
             "from sympy import symbols, solve\nx = symbols('x')\nprint(solve(x**2 - 5*x + 6, x))",
             "import numpy as np\na = np.arange(12).reshape(3, 4)\nprint(a.sum(axis=0))",
             "import sympy\nprint(sympy.isprime(2**61 - 1), sympy.factorint(360))"]
    light = ["print(sum(i * i for i in range(10000)))",
             "from fractions import Fraction\nprint(sum(Fraction(1, k) for k in range(1, 40)))"]
    errors = ["x = [1, 2, 3]\nprint(x[5])", "import sympy\nsympy.Symbol('x') + 'a'"]
    calls = []
    # a fixed interleaving, so the executor and python -c run the very same list
    for i in range(100):
        if i == 50:
            calls.append(("while True:\n    pass", ""))
        elif i % 10 == 3:
            calls.append((errors[i % 2], ""))
        elif i % 10 == 7:
            calls.append(("a, b = map(int, input().split())\nprint(a * b)", "6 7"))
        elif i % 10 in (1, 5):
            calls.append((light[i % 2], ""))
        else:
            calls.append((heavy[i % 4], ""))
    return calls


def _percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _drive(call, calls, concurrency):
    """Push `calls` through `call(code, stdin)` from `concurrency` client threads: (calls/s,
    latencies, and the latencies of the calls that did not time out)."""
    # each client waits for its result before it takes the next call, so `concurrency` calls are in
    # flight
    latencies, finished, lock, todo = [], [], threading.Lock(), iter(calls)
    def client():
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            start = time.perf_counter()
            timed_out = call(*item) == "timeout"
            with lock:
                latencies.append(time.perf_counter() - start)
                if not timed_out:
                    finished.append(latencies[-1])
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(calls) / (time.perf_counter() - start), latencies, finished


# the floor of any fork-per-call design: fork, exit, wait, from a process holding the same stdlib
# modules
FORK_FLOOR = """
import os, sys, time, math, itertools, fractions
start = time.perf_counter()
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
print(int(sys.argv[1]) / (time.perf_counter() - start))
"""


def _fork_floor(workers, forks):
    """fork+exit+wait per second of `workers` processes at once (each times its own loop, not its
    start)."""
    procs = [subprocess.Popen([sys.executable, "-c", FORK_FLOOR, str(forks)],
                              stdout=subprocess.PIPE, text=True)
             for _ in range(workers)]
    return sum(float(p.communicate()[0]) for p in procs)


def _cpu_seconds(pids):
    """CPU seconds of these processes and of their reaped children (utime, stime, cutime,
    cstime)."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            total += sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def _interleaved(runs, rounds, each_round=lambda: None):
    """Run each of `runs` ({label: (call, calls, concurrency)}) in `rounds` slices, the slices of
    all labels alternating (and `each_round` once per round): the load of a shared machine drifts by
    the minute, and so every label sees the same drift. Returns {label: (calls/s, latencies, those
    of calls that did not time out)}."""
    totals = {label: [0.0, [], []] for label in runs}
    for r in range(rounds):
        each_round()
        for label, (call, calls, concurrency) in runs.items():
            part = calls[r * len(calls) // rounds:(r + 1) * len(calls) // rounds]
            if part:
                rate, latencies, finished = _drive(call, part, concurrency)
                totals[label][0] += len(part) / rate
                totals[label][1] += latencies
                totals[label][2] += finished
    return {label: (len(runs[label][1]) / seconds, latencies, finished)
            for label, (seconds, latencies, finished) in totals.items()}


def bench(cfg):
    """The executor at concurrency 1, workers and 4 x workers, and in the same run (interleaved) the
    naive tool (a fresh `python -c` per call) and the fork floor; then CPU per call. About 2 minutes
    on 2 idle cores (python -c on the mix is most of it); scale=0.2 for a quick look. Prints the
    README's table and targets."""
    workers = cfg.workers or len(os.sched_getaffinity(0))
    c_all, c_queue = workers, 4 * workers
    # the first n calls of the list repeated (whole copies where n allows, so a mix keeps its
    # composition)
    scaled = lambda calls, n: (calls * (1 + n // len(calls)))[:max(1, round(n * cfg.scale))]
    def naive(code, stdin):
        # 3 x timeout_s, as the executor's clock stretches while a call waits for a CPU (up to
        # STRETCH_CAP x, which would let the mix's endless loops run 80 s here): on a loaded machine
        # `import sympy` alone passes 4 s, and a tool that fails it is not faster
        try:
            subprocess.run([sys.executable, "-c", code], input=stdin.encode(), capture_output=True,
                           timeout=3 * cfg.timeout_s)
        except subprocess.TimeoutExpired:
            return "timeout"
    def report(label, rate, latencies, finished):
        # Latency is from submit to result, queueing included; p99/p50 shows how evenly a queue
        # drains. Where some calls time out (the mix's endless loops), p99 is theirs; "others" is
        # what the rest waited.
        p50, p99 = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
        others = (f"   p99 of the others {1e3 * _percentile(finished, 0.99):7.1f} ms"
                  if len(finished) < len(latencies) else "")
        print(f"{label:26s} {rate:8.1f} calls/s   p50 {1e3 * p50:8.1f} ms   "
              f"p99 {1e3 * p99:8.1f} ms   p99/p50 {p99 / p50:5.1f}{others}", flush=True)
        return rate, p99 / p50
    # (calls, {concurrency: calls through the executor}, {concurrency: calls through python -c}). A
    # call at c=1 waits for the one before, so fewer there; python -c fills the cores at c=workers
    # already, and runs at c=1 only where it is cheap. The mix's python -c (a sympy import per call)
    # is most of the bench's time.
    workloads = {"trivial": ([(TRIVIAL, "")], {1: 500, c_all: 2000, c_queue: 2000},
                             {1: 60, c_all: 100}),
                 "import": ([(c, "") for c in IMPORT_SNIPPETS], {1: 100, c_all: 200, c_queue: 200},
                            {c_all: 8}),
                 "mix": (realistic_mix(), {1: 100, c_all: 100, c_queue: 100}, {c_all: 100})}
    rounds = 5
    load_start = os.getloadavg()
    print(f"{workers} workers, {os.cpu_count()} CPUs, load average {load_start[0]:.1f} "
          f"{load_start[1]:.1f} {load_start[2]:.1f} (1, 5, 15 min)", flush=True)
    summary, table = [], []
    with Executor(workers=workers, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb) as ex:
        ex.wait_ready()   # startup (a heavy worker's 1-2 s) is not what a long run pays per call
        run = lambda code, stdin: ex.run(code, stdin).status
        for name, (calls, n_executor, n_naive) in workloads.items():
            runs = {f"{name} executor c={c}": (run, scaled(calls, n), c)
                    for c, n in n_executor.items()}
            runs.update({f"{name} python -c c={c}": (naive, scaled(calls, n), c)
                         for c, n in n_naive.items()})
            # the floor is measured once per round of the trivial workload, in the same drift
            floors = []
            each_round = ((lambda: floors.append(_fork_floor(workers, 300))) if name == "trivial"
                          else (lambda: None))
            rates = {label: report(label, *result)
                     for label, result in _interleaved(runs, rounds, each_round).items()}
            executor_rate = lambda c: rates[f"{name} executor c={c}"][0]
            ratio = executor_rate(c_all) / rates[f"{name} python -c c={c_all}"][0]
            table.append(f"| {name} | "
                         f"{' / '.join(f'{executor_rate(c):.0f}' for c in n_executor)} | "
                         f"{rates[f'{name} executor c={c_queue}'][1]:.1f} | "
                         f"{rates[f'{name} python -c c={c_all}'][0]:.1f} | {ratio:.1f}x |")
            for c in n_naive:
                summary.append(f"{name}: executor / python -c at c={c}: "
                               f"{executor_rate(c) / rates[f'{name} python -c c={c}'][0]:.1f}x"
                               + (f" (target >= 5x: {'met' if ratio >= 5 else 'NOT met'})"
                                  if name == "trivial" and c == c_all else ""))
            if floors:
                floor = sum(floors) / len(floors)
                print(f"{'fork floor':26s} {floor:8.1f} calls/s   (bare fork+exit+wait, {workers} "
                      "processes at once)")
                share = executor_rate(c_queue) / floor
                summary.append(f"trivial: executor at c={c_queue} reaches {100 * share:.0f}% of "
                               f"the fork floor ({floor:.0f} calls/s; target >= 25%: "
                               f"{'met' if share >= 0.25 else 'NOT met'})")
        # CPU per call does not depend on what else the machine runs: the cost itself, not its share
        # of a CPU. /proc counts it in clock ticks (10 ms), so enough calls for a 1% error.
        ours = [os.getpid()] + [w.proc.pid for slot in ex._slots for w in slot] + \
               [kid for slot in ex._slots for w in slot for kid in _descendants(w.proc.pid)]
        for name, code, n, n_naive in (("trivial", TRIVIAL, 1000, 20),
                                       ("import", IMPORT_SNIPPETS[0], 200, 4)):
            n, n_naive = max(20, round(n * cfg.scale)), max(2, round(n_naive * cfg.scale))
            before = _cpu_seconds(ours)
            _drive(run, [(code, "")] * n, workers)
            executor_cpu = (_cpu_seconds(ours) - before) / n
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            _drive(naive, [(code, "")] * n_naive, workers)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            naive_cpu = ((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
                         / n_naive)
            summary.append(f"{name}: CPU per call {1e3 * executor_cpu:.2f} ms (this process, "
                           f"workers and their children) vs {1e3 * naive_cpu:.1f} ms for "
                           f"python -c: {naive_cpu / executor_cpu:.1f}x")
        isolation = ex.isolation
    load_end = os.getloadavg()
    print("\n".join(summary))
    print(f"\n| workload | executor calls/s c=1 / {c_all} / {c_queue} | p99/p50 at c={c_queue} | "
          f"python -c, c={c_all} | ratio at c={c_all} |\n|---|---|---|---|---|\n"
          + "\n".join(table))
    print(f"\nload average at the start {load_start[0]:.1f}, at the end {load_end[0]:.1f} (1 min; "
          f"{os.cpu_count()} CPUs)")
    print("isolation:", json.dumps({k: v for k, v in isolation.items()
                                    if v not in ([], False, None)}))


# -----------------------------------------------------------------------------
# command line


def run_soak(cfg):
    with Executor(workers=cfg.workers or None, timeout_s=cfg.timeout_s,
                  memory_mb=cfg.memory_mb) as ex:
        start = time.perf_counter()
        stats = soak(ex, cfg.calls, report_every=1000)
        stats["seconds"] = round(time.perf_counter() - start, 1)
    wrong = stats.pop("wrong")
    print(json.dumps(stats, indent=1))
    for code, result in wrong[:5]:
        print("unexpected:", repr(code[:60]), result)
    # containment and every status are strict; benign calls starved past 3 x timeout_s are reported
    # above
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
