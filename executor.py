"""The Python tool of rStar2-Agent: model-written code, run isolated in a warm, forked process.

The model calls `python_code_with_standard_io(code, input)` (arXiv 2508.20722 §2.1): `code` runs
as a script with `input` on stdin, and the tool answers with what it printed; a final expression's
repr is printed, IPython-like. rStar2 ran up to 45K calls per RL step at ~0.3 s each (§3.1), so a
call must be cheap; and the code is untrusted (endless loops, 100 GB allocations, fork bombs,
kill(-1), reads of the answer key), so nothing it does may hurt the trainer.

This file is the tool's contract: ExecResult, what a call returns, and the text the model reads
(tool_response); and the Executor, a pool of warm workers that runs calls concurrently, each
finishing on its own (no call waits for another: §3.2 sends each to the tool the moment it is
parsed). Each slot has a light worker (stdlib preloaded, ~1 ms fork) and a heavy one (numpy and
sympy imported and exercised, ~8 ms fork instead of a ~1 s import). How a worker isolates its calls
(namespaces, a uid of its own, hard rlimits, the kill from outside, the fallbacks where the OS
refuses) is machinery/sandbox.py; `Executor.isolation` reports the level reached.

    with Executor(workers=2) as ex:
        ex.run("print(2 + 2)").stdout                 # '4\n'
        ex.submit(code, stdin)                        # a Future[ExecResult], done when that call is
        ex.map(codes, stdins)                         # the results in input order
        result.tool_response(show_time=False)         # the text inside <tool_response>
"""
import dataclasses
import os
import queue
import threading
import weakref
from concurrent.futures import Future

from machinery.sandbox import (BACKSTOP_GRACE_S, HEAVY_RE, STRETCH_CAP, WorkerGone, WorkerProcess,
                               truncate_middle)

MAX_CODE_CHARS = 16 << 20  # bigger code or stdin is a caller's bug, refused by submit()


# -----------------------------------------------------------------------------
# the result
#
# The paper lists what the environment answers (§2.1): printed output, no output (then the value of
# the last expression), an error with its traceback, a timeout; "oom" is ours (code-judge folds it
# into errors). Structured on purpose: GRPO-RoC ranks correct rollouts by their tool-error ratio
# (Eq. 4), which the release gets by grepping the response for "error", missing timeouts and
# counting a printed "error" as one (docs/design.md, the released code's tool I/O).


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """One call. status: "ok" (exit 0), "error" (an exception, a non-zero exit, a signal or the
    output limit; the traceback or the reason is in stderr), "timeout" (wall clock or CPU time),
    "oom" (MemoryError)."""
    status: str
    stdout: str
    stderr: str
    elapsed_s: float      # from fork to the exit of the snippet's process, measured by its worker
    truncated: bool       # stdout or stderr was cut to max_output_chars (head and tail kept)
    reason: str = ""      # for logs: "exit status 1", "signal SIGSEGV", "wall-clock limit", ...
    returncode: int | None = None  # as in subprocess: -N for signal N (os._exit(0) mid-run is 0)
    cpu_s: float = 0.0    # CPU seconds of that process and the children it reaped

    def tool_response(self, max_chars=256, show_time=True):
        """The text inside <tool_response>, worded as the release's code-judge client
        (docs/design.md, the released code's tool I/O).

        max_chars=256 is verl's max_tool_response_length with truncate_side="middle", which the
        released rStar2 scripts leave at its default: the head keeps the first printed lines, the
        tail the traceback's last line, which says what went wrong. Each stream was capped before,
        at max_output_chars (code-judge's 1000). show_time=False leaves out the execution time, the
        only part that differs on a rerun."""
        lines = ["Tool call success" if self.status == "ok" else "Tool call failure"]
        if self.status != "ok":
            # the release's words: code-judge's worker_timeout for a timeout, none for an error
            lines.append("reason: " + {"timeout": "worker_timeout",
                                       "oom": "memory_limit"}.get(self.status, ""))
        if self.stdout:
            lines.append(f"stdout: {self.stdout}")
        if self.stderr:
            lines.append(f"stderr: {self.stderr}")
        if show_time:
            lines.append(f"execution time: {self.elapsed_s:.2f}s")
        return truncate_middle("\n".join(lines), max_chars)


# -----------------------------------------------------------------------------
# the pool: one thread per slot, each blocked on its worker's answer


class Executor:
    """Sandboxed python_code_with_standard_io calls on warm workers; see the module docstring.

    workers:          concurrent calls; None = one per usable core. A slot is a light and a heavy
                      worker.
    timeout_s:        wall clock per call (the release runs code-judge with MAX_EXECUTION_TIME=4),
                      less its waits for a CPU, up to 20 x timeout_s; CPU: timeout_s in all.
    memory_mb:        address space a call may add to what its worker already maps (about 25 MB
                      light, 200 MB heavy; isolation["preloaded_mb"]). Past it: MemoryError, "oom".
    max_output_chars: stdout and stderr each keep this many characters, head and tail (code-judge:
                      1000).
    max_processes:    RLIMIT_NPROC. The sandbox uid is the worker's own: one call's processes.
    max_file_mb:      RLIMIT_FSIZE; each private tmpfs holds this + 16 MB.
    output_limit_mb:  a call that writes more is killed (status "error"): memory is bounded anyway,
                      this bounds the time a print loop wastes.
    hide_paths:       directories the snippet must not see, besides the repo, the cwd and home."""

    def __init__(self, workers=None, timeout_s=4.0, memory_mb=1024, max_output_chars=1000, *,
                 max_processes=64, max_file_mb=64, output_limit_mb=16, hide_paths=()):
        # Each worker runs one call at a time, so `workers` is the parallelism; more than the cores
        # only queues inside the kernel instead of in our queue (and risks timeouts).
        if workers is None:
            workers = len(os.sched_getaffinity(0))  # the cores this process may use
        self.workers, self.timeout_s = workers, float(timeout_s)
        # Hidden by default: the repo (data/ with the answer keys, out/ with checkpoints, the
        # trainer's code), the trainer's cwd (where a run writes) and home (~/.ssh, tokens).
        repo = os.path.dirname(os.path.abspath(__file__))
        settings = dict(timeout_s=self.timeout_s, memory_mb=memory_mb,
                        max_output_chars=max_output_chars, max_processes=max_processes,
                        max_file_mb=max_file_mb, output_limit_mb=output_limit_mb,
                        hide_paths=[repo, os.getcwd(), os.path.expanduser("~"), *hide_paths])
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._slots = []

        # The workers set themselves up in parallel; we wait for the first light one only (~0.1 s),
        # whose sandbox is every worker's: one that cannot run calls raises here, naming why.
        try:
            for _ in range(workers):
                self._slots.append((WorkerProcess("light", settings),
                                    WorkerProcess("heavy", settings)))
            self._slots[0][0].ready()
        except BaseException:
            _shutdown(self._slots, [], self._jobs, self._closed)
            raise

        # The threads hold no reference to `self`: an Executor dropped without close() is
        # collected, and its finalizer stops the workers (it also runs at interpreter exit).
        self._threads = [threading.Thread(target=_serve, name=f"executor-slot-{i}", daemon=True,
                                          args=(*slot, self._jobs, self.timeout_s, self._closed))
                         for i, slot in enumerate(self._slots)]
        for thread in self._threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._slots, self._threads, self._jobs,
                                           self._closed)

    def submit(self, code, stdin=""):
        """Queue one call. Its Future completes as soon as the call does, however long the others
        take; its callbacks run on the executor's threads, so they should be quick."""
        # A bad argument is the caller's bug and raises here; bad *code* is the model's and comes
        # back as a result, whatever it is (a syntax error, a NUL byte, a megabyte of parentheses).
        for name, value in (("code", code), ("stdin", stdin)):
            if not isinstance(value, str):
                raise TypeError(f"Executor.submit: {name} must be a str, got "
                                f"{type(value).__name__}")
            if len(value) > MAX_CODE_CHARS:
                raise ValueError(f"Executor.submit: {name} has {len(value)} characters, the limit "
                                 f"is {MAX_CODE_CHARS}")
        future = Future()
        with self._lock:  # against close(): a job queued after close() drained the queue never runs
            if self._closed.is_set():
                raise RuntimeError("Executor.submit: the executor is closed")
            self._jobs.put((code, stdin, future))
        return future

    def run(self, code, stdin=""):
        return self.submit(code, stdin).result()

    def map(self, codes, stdins=None):
        """All the calls at once (as parallel as `workers` allows); the results in input order, as
        a list (each call has its own timeout, so no lazy iterator is needed)."""
        codes = list(codes)
        stdins = [""] * len(codes) if stdins is None else list(stdins)
        if len(stdins) != len(codes):
            raise ValueError(f"Executor.map: {len(codes)} codes but {len(stdins)} stdins")
        futures = [self.submit(code, stdin) for code, stdin in zip(codes, stdins)]
        return [f.result() for f in futures]

    def wait_ready(self):
        """Block until every worker has started (a heavy one takes 1-2 s). Calls do not need it;
        timings do."""
        for slot in self._slots:
            for worker in slot:
                worker.ready()

    @property
    def isolation(self):
        """What the sandbox reached here: the first worker's report (all of them try the same)."""
        return dict(self._slots[0][0].ready())

    def close(self):
        """Cancel the queued calls and stop the workers (their namespaces die with them).
        Idempotent."""
        with self._lock:
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(light, heavy, jobs, timeout_s, closed):
    """One slot's thread, blocked on its worker's answer: a slow call holds this slot only, each
    Future completes when its call does, and the trainer's own threads (vLLM's engine loop, say)
    only ever touch a queue and a Future."""
    while True:
        job = jobs.get()
        if job is None:
            return
        code, stdin, future = job
        if not future.set_running_or_notify_cancel():
            continue   # cancelled while it waited
        # Heavy only when needed: forking the heavy worker costs ~8 ms against ~1 ms, since a fork
        # copies the page tables of all it holds (~60 MB of numpy and sympy objects) and the exit
        # tears them down again.
        worker = heavy if HEAVY_RE.search(code) else light
        try:
            with worker.lock:
                result = _call(worker, code, stdin, timeout_s, closed)
        except BaseException as exc:   # the thread must outlive any one call
            future.set_exception(exc)
            continue
        future.set_result(result)


def _call(worker, code, stdin, timeout_s, closed):
    """One call on one worker, replacing the worker if it fails. A worker found dead before it took
    the call (killed from outside, say) is replaced and the call is sent again, once; one that fails
    during a call is replaced too, but the call is reported as failed: it may be what killed it."""
    for attempt in range(2):
        if worker.proc is None:
            raise RuntimeError("Executor: closed while the call was queued")
        try:
            return ExecResult(**worker.ask({"code": code, "stdin": stdin, "timeout_s": timeout_s},
                                           timeout_s))
        except WorkerGone as gone:
            if closed.is_set():
                raise RuntimeError("Executor: closed while the call was running") from None
            worker.restart()
            if not gone.sent and attempt == 0:
                continue
            if "in time" in str(gone):  # the backstop: the worker itself did not answer in time
                limit = STRETCH_CAP * timeout_s + BACKSTOP_GRACE_S
                note = f"TimeoutError: the sandbox did not answer within {limit:g} s"
                return ExecResult("timeout", "", note + "\n", 0.0, False, "executor backstop", None)
            note = (f"ExecutorError: the sandbox worker failed during the call ({gone}); it was "
                    "replaced")
            return ExecResult("error", "", note + "\n", 0.0, False, "worker died", None)


def _shutdown(slots, threads, jobs, closed):
    """close() and the finalizer: cancel what is queued, kill the workers (a running call then sees
    EOF at once), let the threads finish, and only then reap the workers and close their pipes."""
    closed.set()  # first: a thread whose worker dies from now on reports "closed", not restarts it
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            break
        if job is not None:
            job[2].cancel()
    for _ in threads:
        jobs.put(None)
    workers = [worker for slot in slots for worker in slot]
    for worker in workers:
        worker.kill()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=30)
    for worker in workers:
        worker.stop()
