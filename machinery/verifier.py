"""math-verify on the sandbox's worker pool: warm "grader" workers (machinery/sandbox.py: the same
start, pipes, backstop and replacement as the tool's) answer each check under a budget of their own
CPU time, so a verdict does not depend on how busy the machine is; a check past its budget ends
with the safe result, and a worker stuck or starved past the wall-clock backstop is replaced, so
grading never hangs.

Processes, not threads: math-verify's own timeout is signal.alarm, and a big-int power holds the
GIL, so only a signal that kills (RLIMIT_CPU's) ends a check stuck in C code. A worker runs its
checks itself rather than forking one child each, as the tool's workers do: a fork of a worker
holding sympy and math-verify cost ~4x a check's CPU (docs/benchmarks.md, "Reward")."""
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

# What a check may map beside its worker: (10^{10})! or a 10^9-digit power then fails with
# MemoryError (a clean False) instead of swapping the node.
CHECK_MEMORY_MB = 2048

# A check stuck in C code (a big-int power holds the GIL, so the timer's Python handler never runs)
# is ended by RLIMIT_CPU, in whole seconds, at most CPU_GRACE_S + 1 s past its budget: the worker
# dies of SIGXCPU, the pool counts the check out of time (a verdict, 0) and replaces the worker.
CPU_GRACE_S = 0.25


class _Deadline(BaseException):
    pass


def _raise_deadline(signum, frame):
    raise _Deadline()


# several values, which verify never finds equal to one number (is_collection)
COLLECTION = "collection"


_PARSED = {}  # per worker: parse results by string; golds repeat across a group's 2G rollouts


def _parse_cached(latex):
    from math_verify import parse   # the trainer imports this file: only the workers need it

    if latex not in _PARSED:
        if len(_PARSED) > 20000:
            _PARSED.clear()
        _PARSED[latex] = parse(latex, parsing_timeout=None)
    return _PARSED[latex]


def _math_verify_equivalent(pred, gold):
    """math-verify's verdict on two extracted answers, both wrapped in \\boxed{} so that it parses
    exactly that answer (the release does the same for the gold); gold first, as its docs require.
    No time limit of its own: the sandbox's CPU budget bounds it."""
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
    """In a grader worker, before it reports ready: math-verify imported (it raises where it is
    missing: no worker without it), sympy's lazily loaded code paths run once (~1.5 s, not inside a
    budget), the check's timer and the worker's memory cap set."""
    import math_verify  # noqa: F401

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)   # "Timeout is disabled": the point
    for pred, gold in _WARMUP_PAIRS:
        _math_verify_equivalent(pred, gold)
        _math_verify_value(pred)
    _PARSED.clear()
    signal.signal(signal.SIGPROF, _raise_deadline)
    mapped = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = mapped + (CHECK_MEMORY_MB << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # SIGXCPU would dump a core


def check_in_worker(request):
    """In a grader worker: one check {"task": [kind, *strings], "budget": CPU seconds} ->
    {"result", "cpu_s", "out_of_time"}. The timer (ITIMER_PROF: user + system CPU of this process)
    raises in Python; RLIMIT_CPU's SIGXCPU is the kill behind it."""
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
    except _Deadline:
        out_of_time = True
    except Exception:  # noqa: BLE001  (MemoryError, RecursionError, sympy internals: safe result)
        pass
    return {"result": result, "cpu_s": time.process_time() - started, "out_of_time": out_of_time}


def default_num_workers():
    """This rank's share of the node's cores, at most 8: the fast path leaves 25% of the MATH-500
    labeled set open, so more workers would mostly hold memory (~65 MB resident each)."""
    # imported here: the grader workers import this file, and torch would add ~1 s to each start
    from machinery.distributed import cores_per_rank

    return min(8, cores_per_rank())


class VerifierPool:
    """Grader workers (sandbox.WorkerProcess) and a thread per worker that sends checks to them."""

    def __init__(self, num_workers=None):
        self.num_workers = num_workers or default_num_workers()
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError("VerifierPool: num_workers must be a positive int, "
                             f"got {num_workers!r}")
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
        """Run [("verify", pred, gold) or ("value", answer), ...], each under its budget of CPU
        seconds -> (results, seconds, unfinished), one entry per task.

        A task out of its budget gets the safe result (False for verify, None for value) and
        infinite seconds: whatever used that answer is out of time. A task the wall-clock backstop
        ended gets the same, and unfinished=True: no verdict was reached. seconds: the CPU seconds
        a finished task took."""
        if not self.workers:
            raise RuntimeError("VerifierPool.run: the pool is closed")
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
                    # Found dead before it had the check (killed while idle): replaced and sent
                    # again, once. Dead with it: out of time (RLIMIT_CPU) or crashed, a verdict, 0;
                    # past the backstop (stopped, starved): unfinished, no verdict.
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
        self.workers = []


# One pool per process, started on first use and kept for the whole run (a worker costs ~2 s of CPU
# to start). Under torchrun every rank has its own. A process forked from the owner (a DataLoader
# worker) sees owner_pid differ and starts its own instead of sharing pipes.
_POOL = None
_POOL_LOCK = threading.RLock()  # re-entered by run_in_pool -> start_pool


def start_pool(num_workers=None):
    """Start (or restart with a new size) the shared pool. Optional: the first check starts it."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and _POOL.owner_pid == os.getpid():
            if num_workers is None or _POOL.num_workers == num_workers:
                return _POOL
            _POOL.close()
        _POOL = VerifierPool(num_workers)
        return _POOL


def shutdown_pool():
    """Stop the shared pool's workers (also run at exit). The next check starts a new pool."""
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
    """Two values too far apart for any rounding math-verify allows (6 decimal places): 1/3 =
    0.333333 stays open. Two Fractions are compared as Fractions (a 400-digit integer is no
    float)."""
    tolerance = Fraction(1, 1000) if isinstance(a, Fraction) and isinstance(b, Fraction) else 1e-3
    return abs(a - b) > tolerance * max(1, abs(a), abs(b))
