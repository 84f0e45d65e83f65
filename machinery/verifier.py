"""math-verify on the sandbox's worker pool: warm "grader" workers answer each check under a budget
of their own CPU time, so a verdict does not depend on the machine's load; a worker past the
wall-clock backstop is replaced. Processes, not threads: only RLIMIT_CPU's signal ends a big-int
power stuck in C code. No fork per check: ~4x a check's CPU (docs/benchmarks.md, "Reward")."""
import atexit
import logging
import math
import os
import queue
import resource
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from itertools import combinations

from machinery.sandbox import WorkerGone, WorkerProcess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# what a check may map beside its worker: (10^{10})! fails with MemoryError, not swapping the node
CHECK_MEMORY_MB = 2048
# a check stuck in C code dies of RLIMIT_CPU (whole seconds) at most this + 1 s past its budget
CPU_GRACE_S = 0.25


COLLECTION = "collection"   # several values, never equal to one number (is_collection)
_PARSED = {}  # per worker: parse results by string; golds repeat across a group's 2G rollouts


def _parse_cached(latex):
    from math_verify import parse   # the trainer imports this file: only the workers need it

    if latex not in _PARSED:
        if len(_PARSED) > 20000:
            _PARSED.clear()
        _PARSED[latex] = parse(latex, parsing_timeout=None)
    return _PARSED[latex]


def _math_verify_equivalent(pred, gold):
    """math-verify's verdict on two extracted answers, each in \\boxed{} so that it parses exactly
    that (as the release does for the gold); gold first, as its docs require."""
    from math_verify import verify

    gold_parsed = _parse_cached("\\boxed{" + gold + "}")
    pred_parsed = _parse_cached("\\boxed{" + pred + "}")
    return bool(gold_parsed and pred_parsed
                and verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _math_verify_value(answer):
    """[re, im] of an answer that math-verify parses to one closed-form number ("-\\sqrt{3}",
    "\\frac{20000}{\\pi}"); COLLECTION for several values ("(6,31,-1)", "[2, 7)"; not "5, 5", the
    set {5}); None for anything else (variables, relations, text)."""
    import sympy

    def is_collection(expr):
        # What verify, comparing it as a set with {number}, can never find equal to one number: a
        # tuple or matrix of two or more entries, an interval or union of more than a point, a set
        # of two or more numbers far apart. Not {0.5, 1/2} or {2, \\sqrt{4}} (equal to 1/2 and 2).
        if isinstance(expr, (sympy.Tuple, sympy.MatrixBase)):
            return len(expr) >= 2
        if isinstance(expr, (sympy.Interval, sympy.Union)):
            return expr.measure.is_positive is True
        if isinstance(expr, sympy.FiniteSet) and all(isinstance(e, sympy.Expr) and e.is_number
                                                     for e in expr.args):
            values = [complex(e.evalf(30)) for e in expr.args]
            return len(values) >= 2 and all(far_apart(a, b) for a, b in combinations(values, 2))
        return False

    parsed = _parse_cached("\\boxed{" + answer + "}")
    expressions = [e for e in parsed if not isinstance(e, str)]   # parse also returns the string
    if expressions and all(map(is_collection, expressions)):
        return COLLECTION
    expr = parsed[0] if parsed else None
    if not isinstance(expr, sympy.Expr) or expr.free_symbols or not expr.is_number:
        return None
    value = complex(expr.evalf(30))
    return [value.real, value.imag] if abs(value) < 1e300 else None


# task kind -> (function, safe result)
_TASKS = {"verify": (_math_verify_equivalent, False), "value": (_math_verify_value, None)}


_WARMUP_PAIRS = [("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"), ("(x+1)^2", "x^2+2x+1"),
                 ("[1, 2)", "(1,2)"), ("\\{1, 2\\}", "1,2"),
                 ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "y = 2x"), ("1+2i", "3.5")]


def warm_up():
    """In a grader worker before it reports ready: math-verify imported (raises where missing),
    sympy's lazy paths run once (~1.5 s, outside any budget), the timer and memory cap set."""
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)   # "Timeout is disabled": the point
    for pred, gold in _WARMUP_PAIRS:
        _math_verify_equivalent(pred, gold)
        _math_verify_value(pred)
    _PARSED.clear()
    # the budget's SIGPROF raises KeyboardInterrupt, past any `except Exception` in sympy (a worker
    # ignores SIGINT: nothing else raises it)
    signal.signal(signal.SIGPROF, signal.default_int_handler)
    mapped = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = mapped + (CHECK_MEMORY_MB << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # SIGXCPU would dump a core


def check_in_worker(request):
    """In a grader worker: {"task": [kind, *strings], "budget": CPU s} -> {"result", "cpu_s",
    "out_of_time"}. ITIMER_PROF (this process's CPU) raises in Python; RLIMIT_CPU kills after."""
    kind, *strings = request["task"]
    function, result = _TASKS[kind]
    budget, started = max(0.01, request["budget"]), time.process_time()
    resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(started + budget + CPU_GRACE_S),
                                             resource.getrlimit(resource.RLIMIT_CPU)[1]))
    out_of_time = False
    signal.setitimer(signal.ITIMER_PROF, budget)
    try:
        try:   # disarmed before the outer handler runs, so a late signal cannot escape
            result = function(*strings)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
    except KeyboardInterrupt:   # the budget's SIGPROF (warm_up)
        out_of_time = True
    except Exception:  # noqa: BLE001  (MemoryError, RecursionError, sympy internals: safe result)
        pass
    return {"result": result, "cpu_s": time.process_time() - started, "out_of_time": out_of_time}


def default_num_workers():
    """This rank's share of the cores, at most 8 (the fast path leaves 25% of MATH-500 open; more
    workers would mostly hold memory, ~65 MB each)."""
    from machinery.distributed import cores_per_rank   # here: torch would cost each grader ~1 s

    return min(8, cores_per_rank())


class VerifierPool:
    """Grader workers (sandbox.WorkerProcess) and a thread per worker that sends checks to them."""

    def __init__(self, num_workers=None):
        self.num_workers = num_workers or default_num_workers()
        self.owner_pid = os.getpid()
        self.kills = 0           # workers killed with a check (its budget, a crash, the backstop)
        self.worker_cpu_s = 0.0  # CPU seconds of the checks that ended in their worker
        self.tasks_run = {"value": 0, "verify": 0}
        self.workers = [WorkerProcess("grader", {"repo": REPO}) for _ in range(self.num_workers)]
        self.idle = queue.SimpleQueue()
        for worker in self.workers:
            self.idle.put(worker)
        self.threads = ThreadPoolExecutor(self.num_workers, thread_name_prefix="verifier")
        try:   # a worker without math-verify says so here (RuntimeError)
            for worker in self.workers:
                worker.ready()
        except BaseException:
            self.close()
            raise

    def run(self, tasks, timeouts):
        """[("verify", pred, gold) or ("value", answer), ...], each under its CPU budget ->
        (results, CPU seconds, unfinished). Out of budget: the safe result (False, None), infinite
        seconds; ended by the backstop: the same, unfinished (no verdict)."""
        outcomes = list(self.threads.map(self._check, tasks, timeouts))
        return tuple(list(column) for column in zip(*outcomes)) if outcomes else ([], [], [])

    def _check(self, task, budget):
        safe = _TASKS[task[0]][1]
        worker = self.idle.get()
        try:
            for attempt in range(2):
                try:
                    answer = worker.ask({"task": list(task), "budget": budget},
                                        budget + CPU_GRACE_S + 1)
                    break
                except WorkerGone as gone:
                    # dead before it had the check: replaced and sent again, once; dead with it:
                    # out of time or crashed (a verdict, 0); past the backstop: unfinished
                    worker.restart()
                    if gone.sent or attempt:
                        self.kills += 1
                        return safe, float("inf"), "in time" in str(gone)
        finally:
            self.idle.put(worker)
        self.worker_cpu_s += answer["cpu_s"]
        if answer["out_of_time"]:
            return safe, float("inf"), False
        self.tasks_run[task[0]] += 1
        return answer["result"], answer["cpu_s"], False

    def close(self):
        """Stop the threads and the workers (their checks die with them)."""
        if os.getpid() != self.owner_pid:
            return  # a forked child must not touch its parent's workers
        self.threads.shutdown(wait=True, cancel_futures=True)
        for worker in self.workers:
            worker.stop()


# One pool per process, kept for the run (a worker costs ~2 s of CPU to start); a forked child (a
# DataLoader worker) sees owner_pid differ and starts its own.
_POOL = None
_POOL_LOCK = threading.RLock()  # re-entered by run_in_pool -> start_pool


def start_pool(num_workers=None):
    """The shared pool, started if this process has none. Optional: the first check starts it."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.owner_pid != os.getpid():
            _POOL = VerifierPool(num_workers)
        return _POOL


def shutdown_pool():
    """Stop the shared pool's workers (also at exit); the next check starts a new pool."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
        _POOL = None


atexit.register(shutdown_pool)


def run_in_pool(tasks, timeouts):
    """VerifierPool.run on the shared pool: (results, CPU seconds, unfinished flags)."""
    if not tasks:
        return [], [], []
    with _POOL_LOCK:  # one batch at a time: the workers are shared by every thread of this process
        return start_pool().run(tasks, timeouts)


def far_apart(a, b):
    """Too far apart for any rounding math-verify allows (1/3 = 0.333333 stays open); Fractions
    compared as Fractions (a 400-digit integer is no float)."""
    tolerance = Fraction(1, 1000) if isinstance(a, Fraction) and isinstance(b, Fraction) else 1e-3
    return abs(a - b) > tolerance * max(1, abs(a), abs(b))
