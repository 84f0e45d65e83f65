"""The Python tool of rStar2-Agent: run model-written code in an isolated, warm, forked process.

The model calls `python_code_with_standard_io(code, input)` (arXiv 2508.20722 §2.1): `code` runs as a script with
`input` on stdin, and the tool returns what it printed; if the last statement is an expression its repr is
printed, IPython-like. rStar2 ran up to 45K such calls per RL step at ~0.3 s each (§3.1), so the tool must be
cheap, and since the code is untrusted (infinite loops, 100 GB allocations, fork bombs, kill(-1), reads of the
answer key) it must never hurt the trainer.

How (shared/docs/executor-anchors.md has the designs this draws on):
  - a few warm worker processes per Executor, each the PID 1 of its own PID, mount, network and IPC namespace.
    Each worker forks one child per call, so a call costs a fork, not an interpreter start. Each slot has two
    workers: "light" (stdlib only, ~1 ms fork) and "heavy" (numpy + sympy already imported, ~8 ms fork, saves the
    ~1 s import); a call goes to heavy when its code mentions numpy/sympy/mpmath/scipy.
  - the call's child runs as a per-worker unprivileged uid, with hard rlimits (address space, CPU, processes,
    file size, open files, no core), no_new_privs, a scrubbed environment, in an empty private directory.
  - the worker enforces the wall clock, reads output with a cap while it streams, and after every call kills
    everything left in its namespace (kill(-1) from PID 1 reaches setsid and double-fork escapees) and reaps it.
    The parent (this process) enforces a backstop: a worker that does not answer in time is killed and replaced.
  - inside the mount namespace: the repo, the caller's cwd and home are covered by empty read-only tmpfs (with
    the interpreter bound back), every other mount is read-only, /tmp, /var/tmp, /dev/shm, /run/lock are private
    tmpfs emptied after each call, GPU device nodes are masked, and /proc shows only the namespace.
Where the OS refuses (non-root, containers) the worker falls back, once, at start: a user namespace (same
mounts, capabilities dropped instead of a uid switch), then plain processes (a subreaper catches every
descendant; no hiding, no network cut). `Executor.isolation` reports what was reached. Linux only.

Use:   from executor import Executor
       with Executor(workers=2) as ex:
           ex.run("print(2 + 2)").stdout                              # '4\\n'
           ex.submit(code, stdin).add_done_callback(...)              # a Future[ExecResult]
           ex.map(codes, stdins)                                      # results in input order
           result.tool_response(show_time=False)                      # the text inside <tool_response>
Bench: python executor.py --bench          (calls/s, p50/p99 vs `python -c` per call and vs bare fork+exit+wait)
Soak:  python executor.py --soak calls=10000   (benign + hostile calls; checks zombies, strays, fds, memory)
Run:   python executor.py mode=run code='print(1+1)'
Tests: .venv/bin/python -m pytest tests/test_executor.py -q
"""
import ast
import atexit
import builtins
import ctypes
import dataclasses
import gc
import hashlib
import json
import math
import os
import queue
import random
import re
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
import weakref
from concurrent.futures import Future

STATUSES = ("ok", "error", "timeout", "oom")
# A call goes to the heavy worker when its code mentions one of these (a mention in a comment only costs speed).
HEAVY_RE = re.compile(r"\b(?:numpy|sympy|mpmath|scipy)\b")
LIGHT_PRELOAD = ("math", "cmath", "itertools", "functools", "fractions", "decimal", "collections", "heapq",
                 "bisect", "statistics", "random", "string", "operator", "json", "re")
HEAVY_PRELOAD = LIGHT_PRELOAD + ("numpy", "sympy")
TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")   # world-writable: each worker gets private ones
# Importing is not enough: sympy loads much of itself lazily and caches as it goes, so a cold child spends
# ~200 ms in its first factor() or solve(). The heavy worker runs these once, and every child inherits the result.
HEAVY_WARMUP = """
import numpy as np, sympy as sp
x, y, n = sp.symbols("x y n")
sp.factor(x**4 - 1); sp.solve(x**2 - 5*x + 6, x); sp.solve([x + y - 3, x - y - 1], [x, y])
sp.simplify((x**2 - 1) / (x - 1)); sp.expand((x + 1)**5); sp.diff(sp.sin(x) * x, x); sp.limit(sp.sin(x) / x, x, 0)
sp.isprime(2**61 - 1); sp.factorint(360); sp.Matrix([[1, 2], [3, 4]]).det(); sp.nsimplify(0.5)
sp.summation(n**2, (n, 1, 10)); sp.binomial(10, 3); sp.N(sp.pi, 30); sp.Rational(3, 4) + sp.sqrt(8)
np.linalg.det(np.eye(3)); np.arange(12).reshape(3, 4).sum(axis=0); np.random.default_rng(0).random(3)
"""
MAIN = "main.py"                     # the snippet's filename in tracebacks: fixed, so reruns are byte-identical
SANDBOX_UID_BASE = 2_000_000_000     # sandbox uid = base + worker pid: unique per live worker, below 2**31
EXIT_MEMORY = 201                    # the child's exit code for an uncaught MemoryError (status "oom")
EXIT_SETUP = 202                     # the sandbox could not be set up in the child (an executor error)
MAX_CODE_BYTES = 16 << 20            # submit() refuses bigger code/stdin: that is a caller bug, not model output
STARTUP_TIMEOUT_S = 120.0            # a heavy worker imports sympy (~1-2 s); generous for a loaded CI machine
BACKSTOP_GRACE_S = 5.0               # the parent kills a worker silent for timeout_s + this
TRUNCATION_MARK = "...(truncated)..."

# -----------------------------------------------------------------------------
# the result the caller sees


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """One tool call. status: "ok" (exit 0), "error" (exception, non-zero exit, killed by a signal or the output
    limit; the traceback or reason is in stderr), "timeout" (wall clock or CPU time), "oom" (MemoryError)."""
    status: str
    stdout: str
    stderr: str
    elapsed_s: float                 # fork to exit of the snippet's process, as measured by its worker
    truncated: bool                  # stdout or stderr was cut to max_output_chars (head and tail kept)
    reason: str = ""                 # short cause for logs: "exit status 1", "signal SIGSEGV", "wall-clock limit"
    returncode: int | None = None    # like subprocess: negative for a signal; reported faithfully (os._exit(0) is 0)

    def tool_response(self, max_chars=256, show_time=True):
        """The text inside <tool_response>, worded as the release's code-judge client does (tool_io_format.txt §3).

        max_chars cuts the whole text in the middle like verl's max_tool_response_length=256 with
        truncate_side="middle", which the released rStar2 scripts leave at its default; the head keeps the
        first printed lines and the tail the traceback's last line, which says what went wrong. Each stream
        was already capped at the executor's max_output_chars (code-judge's 1000) before this.
        show_time=False leaves out the execution time, the only part that changes between reruns.
        """
        lines = ["Tool call success" if self.status == "ok" else "Tool call failure"]
        if self.status != "ok":
            # the release's reasons: code-judge says worker_timeout for a timeout and nothing for an error
            lines.append("reason: " + {"timeout": "worker_timeout", "oom": "memory_limit"}.get(self.status, ""))
        if self.stdout:
            lines.append(f"stdout: {self.stdout}")
        if self.stderr:
            lines.append(f"stderr: {self.stderr}")
        if show_time:
            lines.append(f"execution time: {self.elapsed_s:.2f}s")
        return truncate_middle("\n".join(lines), max_chars)


def truncate_middle(text, max_chars):
    """verl's middle cut: the first and last max_chars // 2 characters around a marker."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + TRUNCATION_MARK + text[len(text) - half:]


# -----------------------------------------------------------------------------
# Linux plumbing through libc: Python 3.11 has no os.unshare, os.mount or capset

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 1024, 2048, 4096, 8192, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 36, 38
_MOUNT_OPTION_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                       "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _prctl(option, arg):
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                       ctypes.c_ulong(0)), f"prctl {option}")


def _drop_capabilities():
    """Empty the bounding, effective, permitted and inheritable sets (capset(2), header version 3). Needed
    where the child stays uid 0 of a user namespace: with CAP_SYS_ADMIN it could unmount the tmpfs hiding the repo."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    _check(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def _under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


# -----------------------------------------------------------------------------
# the worker's isolation, set up once at its start


def _isolate(cfg):
    """Enter the strongest sandbox the OS allows and return what was reached. With a PID namespace this forks:
    the caller stays outside as a tiny waiter (so that killing it, via PDEATHSIG, kills the namespace) and the
    function returns in the child, PID 1 of the namespace."""
    info = dict(level="process", pid_namespace=False, mount_namespace=False, net_namespace=False,
                ipc_namespace=False, user_namespace=False, sandbox_uid=None, capabilities_dropped=False,
                kill_scope="subreaper", hidden_paths=[], readonly_mounts=False, private_tmp=False,
                gpu_devices_masked=[], warnings=[])
    flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC
    euid, egid, host_pid = os.geteuid(), os.getegid(), os.getpid()
    try:
        _unshare(flags)
        info["level"] = "namespaces"
    except OSError as root_error:
        try:   # unprivileged: a user namespace makes us root over fresh namespaces, not over the host
            _unshare(flags | CLONE_NEWUSER)
            _write_text("/proc/self/setgroups", "deny")
            _write_text("/proc/self/uid_map", f"0 {euid} 1")
            _write_text("/proc/self/gid_map", f"0 {egid} 1")
            info.update(level="user-namespace", user_namespace=True)
        except OSError as user_error:
            info["warnings"].append(f"no namespaces ({root_error.strerror}; user namespace: {user_error.strerror})")
    if info["level"] == "process":
        _prctl(PR_SET_CHILD_SUBREAPER, 1)   # orphans of a call re-parent to us, not to init, so none escape
        if euid == 0 and not _interpreter_needs_hiding(cfg):
            info["sandbox_uid"] = SANDBOX_UID_BASE + host_pid
        info["capabilities_dropped"] = euid == 0 and info["sandbox_uid"] is None
        return info
    info.update(pid_namespace=True, mount_namespace=True, net_namespace=True, ipc_namespace=True,
                kill_scope="pid namespace")
    child = os.fork()
    if child:   # the waiter: holds nothing, exits with the namespace
        os.closerange(3, 1 << 16)
        while True:
            try:
                _, status = os.waitpid(child, 0)
                os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
            except InterruptedError:
                continue
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # the waiter is single-threaded, so this fires only when it dies
    if info["user_namespace"]:
        info["capabilities_dropped"] = True   # the child cannot switch uid: only one uid is mapped
    else:
        info["sandbox_uid"] = SANDBOX_UID_BASE + host_pid   # per worker, so RLIMIT_NPROC counts one call only
    # Each step that fails (a container that masks /proc, say) is reported and skipped, never fatal: a worker
    # that cannot start would be restarted forever. The flags in `info` say only what really happened.
    steps = (("private mounts", lambda: _mount(None, "/", None, MS_REC | MS_PRIVATE)),   # nothing leaks to the host
             ("fresh /proc", lambda: _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)),
             ("hidden paths", lambda: _hide_paths(cfg, info)),
             ("GPU masks", lambda: _mask_gpus(info)),
             ("read-only mounts", lambda: _remount_readonly(info)),
             ("private tmp", lambda: _private_tmp(cfg, info)))
    for name, step in steps:
        try:
            step()
        except OSError as e:
            info["warnings"].append(f"{name}: {e}")
            if name == "private mounts":
                break
    # SysV IPC objects outlive their processes; in our IPC namespace, make shm die with them and forbid the rest
    for key, value in (("kernel/shm_rmid_forced", "1"), ("kernel/msgmni", "0"), ("kernel/sem", "0 0 0 0"),
                       ("fs/mqueue/queues_max", "0")):
        try:
            _write_text(f"/proc/sys/{key}", value)
        except OSError:
            pass
    return info


def _private_tmp(cfg, info):
    for path in TMP_DIRS:
        if os.path.isdir(path):
            # a little over the file-size limit: one big file meets EFBIG, many meet ENOSPC, RAM stays bounded
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={cfg['max_file_mb'] + 16}m")
    info["private_tmp"] = True


def _keep_paths():
    """What the snippet must still read: the interpreter, its stdlib and the venv's site-packages."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    paths = sorted({os.path.realpath(p) for p in paths})
    return [p for p in paths if not any(q != p and _under(p, q) for q in paths)]


def _interpreter_needs_hiding(cfg):
    """True if an unprivileged uid cannot reach the interpreter (e.g. it lives under root's 0700 home)."""
    for keep in _keep_paths():
        path = keep
        while path != "/":
            if not os.stat(path).st_mode & 0o001:
                return True
            path = os.path.dirname(path)
    return False


def _hide_paths(cfg, info):
    """Cover each hidden directory with an empty read-only tmpfs, binding back the kept paths inside it.
    A kept path is bound from an O_PATH descriptor opened before the cover, since the cover hides its source."""
    keep = _keep_paths()
    hide = {os.path.realpath(p) for p in cfg["hide_paths"] if os.path.isdir(p)}
    for k in keep:   # an ancestor of the interpreter that others cannot traverse (0700 /root) is covered too
        path = os.path.dirname(k)
        while path != "/":
            if not os.stat(path).st_mode & 0o001:
                hide.add(path)
            path = os.path.dirname(path)
    system = {"/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/dev", "/proc", "/sys", "/var", "/run", "/tmp"}
    # a kept path that *is* or contains a hidden one loses (an editable install of the repo stays hidden)
    keep = [k for k in keep if not any(_under(h, k) for h in hide)]
    hide = sorted(h for h in hide if h not in system)
    hide = [h for h in hide if not any(o != h and _under(h, o) for o in hide)]
    for h in hide:
        inside = [k for k in keep if _under(k, h)]
        fds = [os.open(k, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for k in inside]
        _mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
        for k, fd in zip(inside, fds):
            os.makedirs(k, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC)
            os.close(fd)
        _mount(None, h, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        info["hidden_paths"].append(h)


def _mask_gpus(info):
    """CUDA_VISIBLE_DEVICES="" is a request; on training nodes the device nodes are often 0666, so mask them."""
    for name in sorted(os.listdir("/dev")):
        path = "/dev/" + name
        try:
            if name.startswith("nvidia") and not os.path.isdir(path) or name == "kfd":
                _mount("/dev/null", path, None, MS_BIND)
            elif name in ("dri", "nvidia-caps"):
                _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
            else:
                continue
            info["gpu_devices_masked"].append(path)
        except OSError as e:
            info["warnings"].append(f"could not mask {path}: {e.strerror}")


def _remount_readonly(info):
    """Every mount read-only, keeping the flags a user namespace locks (nosuid, nodev, ...). /proc, /sys and /dev
    are skipped: their writable files are root's or the caller's own, and /dev/shm gets a tmpfs next."""
    failures = 0
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    for row in rows:
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), row[4])   # \040 is a space
        if any(_under(target, p) for p in ("/proc", "/sys", "/dev")) or "ro" in row[5].split(","):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in row[5].split(","):
            flags |= _MOUNT_OPTION_FLAGS.get(option, 0)
        try:
            _mount(None, target, None, flags)
        except OSError:
            failures += 1
    info["readonly_mounts"] = failures == 0
    if failures:
        info["warnings"].append(f"{failures} mounts could not be made read-only")


# -----------------------------------------------------------------------------
# one call: the child runs the snippet, the worker watches it


def _run_child(code, stdin, stdin_fd, out_fd, err_fd, workdir, state):
    """In the forked child: drop into the sandbox, run the snippet, exit. Never returns."""
    try:
        os.setsid()   # its own session: in a PID namespace getppid() is 1 and kill(0) must not mean the worker
        os.dup2(stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.closerange(3, state["max_fd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)   # the worker ignores SIGINT; the snippet should not
        try:
            _write_text("/proc/self/oom_score_adj", "1000")   # under host memory pressure the kernel kills us first
        except OSError:
            pass
        os.chdir(workdir)
        for limit, soft, hard in state["rlimits"]:
            resource.setrlimit(limit, (soft, hard))   # hard limits: the snippet cannot raise them back
        uid = state["sandbox_uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            _prctl(PR_SET_DUMPABLE, 1)   # a uid change makes /proc/self root's; give the snippet its own back
        _prctl(PR_SET_NO_NEW_PRIVS, 1)   # no setuid binaries, no file capabilities, even for uid 0 in a userns
        if not state["pid_namespace"]:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # best effort without a namespace: die with the worker
        if state["drop_capabilities"]:
            _drop_capabilities()
    except BaseException as exc:
        os.write(2, f"ExecutorError: the sandbox could not be set up: {exc!r}\n".encode())
        os._exit(EXIT_SETUP)
    try:   # the child must never return into the worker's loop, whatever happens
        os._exit(_run_snippet(code, stdin))
    except BaseException as exc:
        os.write(2, f"ExecutorError: {exc!r}\n".encode())
    finally:
        os._exit(EXIT_SETUP)


def _run_snippet(code, stdin):
    """Run `code` as a script named main.py, printing the repr of a final expression; return the exit code."""
    sys.stdin = sys.__stdin__ = open(0, "r", encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace",
                                       closefd=False)
    os.environ.update(HOME=os.getcwd(), TMPDIR=os.getcwd())
    sys.argv = [MAIN]
    # Seeded from the inputs: the forked child would otherwise share numpy's state with every other call of its
    # worker, and a pure function of (code, stdin) keeps RL reruns byte-identical. os.urandom stays random.
    seed = int.from_bytes(hashlib.sha256(f"{code}\0{stdin}".encode("utf-8", "replace")).digest()[:8], "little")
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)
    main = types.ModuleType("__main__")   # a fresh __main__, so pickling the snippet's functions works
    main.__builtins__, main.__file__ = builtins, MAIN
    sys.modules["__main__"] = main
    returncode = 0
    try:
        tree = ast.parse(code, MAIN)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, MAIN, "exec"), main.__dict__)
        if last is not None:   # IPython-like: the value of a final expression is shown unless it is None
            value = eval(compile(ast.Expression(last.value), MAIN, "eval"), main.__dict__)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        returncode = _system_exit_code(exc)
    except BaseException as exc:
        _print_snippet_traceback(exc)
        returncode = EXIT_MEMORY if isinstance(exc, MemoryError) else 1
    try:   # what the interpreter does at exit: wait for non-daemon threads, run atexit handlers, flush
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    except SystemExit as exc:
        returncode = _system_exit_code(exc)
    except BaseException as exc:
        _print_snippet_traceback(exc)
        returncode = returncode or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    return returncode


def _system_exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)   # sys.exit("message") prints it and exits 1, as the interpreter does
    return 1


def _print_snippet_traceback(exc):
    """The traceback from the snippet's first frame on: our wrapper frames are noise and name this file."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != MAIN:
        tb = tb.tb_next
    try:   # the interpreter's own C printer: the same text as `python main.py`, fast even for 10**6 frames
        sys.__excepthook__(type(exc), exc.with_traceback(tb), tb)
    except BaseException:
        os.write(2, f"{type(exc).__name__}\n".encode())


class _Capture:
    """A stream read while it flows: the first and the last `keep` bytes, and a count of the rest."""

    def __init__(self, keep):
        self.keep, self.head, self.tail, self.total = keep, bytearray(), bytearray(), 0

    def add(self, data):
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            del self.tail[:max(0, len(self.tail) - self.keep)]

    def text(self, max_chars):
        """Decoded (invalid UTF-8 becomes U+FFFD) and cut in the middle to max_chars; returns (text, truncated)."""
        if self.total == len(self.head) + len(self.tail):
            text = (self.head + self.tail).decode("utf-8", "replace")
            if len(text) <= max_chars:
                return text, False
            return truncate_middle(text, max_chars), True
        half = max_chars // 2
        head = self.head.decode("utf-8", "replace")[:half]
        tail = self.tail.decode("utf-8", "replace")[-half:] if half else ""
        return head + TRUNCATION_MARK + tail, True


def _kill_leftovers(state, session):
    """Kill and reap every process the call left. From PID 1, kill(-1) reaches the whole namespace. Without one,
    the subreaper finds them all as children (an orphan re-parents to us); re-scan until none is left."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if state["pid_namespace"]:
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            children = _children()
            if children is None:   # no /proc/<pid>/task/*/children: the call's session is all we can reach
                children = []
                try:
                    os.killpg(session, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
    # something refused to die within 5 s (uninterruptible I/O); the next call's sweep reaps it


def _children():
    try:
        with open(f"/proc/self/task/{os.getpid()}/children") as f:
            return [int(pid) for pid in f.read().split()]
    except OSError:
        return None


def _fresh_workdir(state):
    """An empty directory owned by the sandbox uid. In a mount namespace /tmp is private to this worker, so the
    path is fixed (reruns print the same cwd); otherwise a new temporary directory."""
    if state["private_tmp"]:
        path = "/tmp/sandbox"
        shutil.rmtree(path, ignore_errors=True)   # left by a call whose clean-up failed half-way
        os.mkdir(path, 0o700)
    else:
        path = tempfile.mkdtemp(prefix="rstar2-exec-")
    if state["sandbox_uid"] is not None:
        os.chown(path, state["sandbox_uid"], state["sandbox_uid"])
    return path


def _clean_after_call(state, workdir):
    """Nothing a call wrote survives it: empty the private tmpfs mounts (or remove the temporary directory)."""
    if not state["private_tmp"]:
        _remove_tree(workdir)
        return
    for root in TMP_DIRS:
        if os.path.isdir(root):
            for entry in os.scandir(root):
                _remove_tree(entry.path)


def _remove_tree(path):
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    try:
        shutil.rmtree(path)
    except OSError:   # not root: the snippet may have made its own dirs 000; give them back (never via a link)
        os.chmod(path, 0o700)
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                if not os.path.islink(os.path.join(root, d)):
                    os.chmod(os.path.join(root, d), 0o700)
        shutil.rmtree(path, ignore_errors=True)


def _run_call(code, stdin, cfg, state):
    """Fork the child, stream its output under the caps, enforce the wall clock, then clean up. Returns a dict."""
    workdir = _fresh_workdir(state)
    with open(os.path.join(workdir, MAIN), "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code)   # as for `python main.py`: tracebacks show source lines, __file__ and inspect work
    stdin_fd = os.memfd_create("stdin")   # stdin as a file: a snippet that never reads it cannot block us
    os.write(stdin_fd, stdin.encode("utf-8", "replace"))
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _run_child(code, stdin, stdin_fd, out_w, err_w, workdir, state)
    for fd in (stdin_fd, out_w, err_w):
        os.close(fd)
    captures = {out_r: _Capture(2 * cfg["max_output_chars"] + 4), err_r: _Capture(2 * cfg["max_output_chars"] + 4)}
    poller = select.poll()
    for fd in captures:
        poller.register(fd, select.POLLIN)
    pidfd = os.pidfd_open(pid)   # readable when the child exits, so one poll() waits on output and exit together
    poller.register(pidfd, select.POLLIN)
    deadline, drain_until = start + cfg["timeout_s"], None
    open_fds, returncode, killed_for, elapsed = set(captures), None, None, None
    output_limit = cfg["output_limit_mb"] << 20
    while open_fds or returncode is None:
        now = time.monotonic()
        if returncode is not None:
            wait_until = drain_until
        else:
            wait_until = deadline if killed_for is None else now + 1.0
        for fd, _ in poller.poll(max(0.0, wait_until - now) * 1000):
            if fd == pidfd:
                _, status = os.waitpid(pid, 0)
                returncode, elapsed = os.waitstatus_to_exitcode(status), time.monotonic() - start
                poller.unregister(pidfd)
                _signal_everything(state, pid)   # the call ends with its main process: background ones die now
                drain_until = time.monotonic() + 1.0
                continue
            data = os.read(fd, 1 << 16)
            if not data:
                poller.unregister(fd)
                open_fds.discard(fd)
                continue
            captures[fd].add(data)
            if killed_for is None and sum(c.total for c in captures.values()) > output_limit:
                killed_for = "output limit"   # a flood is stopped at once, not read until the timeout
                _signal_everything(state, pid)
        # The deadline is checked after the events: a child that exited while this worker waited for a CPU
        # has finished, it did not time out.
        now = time.monotonic()
        if returncode is None and killed_for is None and now >= deadline:
            killed_for = "wall-clock limit"
            _signal_everything(state, pid)
        if returncode is not None and now >= drain_until:
            break   # an unkillable writer still holds a pipe; do not wait on it
    _kill_leftovers(state, pid)
    for fd in (out_r, err_r, pidfd):
        os.close(fd)
    _clean_after_call(state, workdir)
    return _describe(returncode, killed_for, elapsed, captures[out_r], captures[err_r], cfg)


def _signal_everything(state, pid):
    """SIGKILL the call's main process and, with a PID namespace, everything else in it (the reap comes later)."""
    try:
        os.kill(-1 if state["pid_namespace"] else pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _describe(returncode, killed_for, elapsed, out, err, cfg):
    """Turn how the child ended into status, reason and an explanatory last stderr line where Python wrote none."""
    stdout, cut_out = out.text(cfg["max_output_chars"])
    stderr, cut_err = err.text(cfg["max_output_chars"])
    def signame(number):
        try:
            return signal.Signals(number).name
        except ValueError:
            return str(number)
    if killed_for == "wall-clock limit":
        status, note = "timeout", f"TimeoutError: the code ran longer than {cfg['timeout_s']:g} s and was killed"
    elif killed_for == "output limit":
        status, note = "error", f"OutputLimitError: the code wrote more than {cfg['output_limit_mb']} MiB and was killed"
    elif returncode == -signal.SIGXCPU:
        killed_for = "cpu-time limit"
        status, note = "timeout", f"TimeoutError: the code used more than its CPU time limit and was killed"
    elif returncode == EXIT_MEMORY:
        killed_for, status, note = "memory limit", "oom", ""   # the MemoryError traceback says it
    elif returncode == 0:
        status, note = "ok", ""
    elif returncode < 0:
        killed_for = f"signal {signame(-returncode)}"
        status, note = "error", f"Killed by signal {-returncode} ({signame(-returncode)})"
    else:
        killed_for, status, note = f"exit status {returncode}", "error", ""
    if note:
        stderr += ("" if not stderr or stderr.endswith("\n") else "\n") + note + "\n"
    return dict(status=status, stdout=stdout, stderr=stderr, elapsed_s=elapsed if elapsed is not None else 0.0,
                truncated=cut_out or cut_err, reason=killed_for or "", returncode=returncode)


# -----------------------------------------------------------------------------
# the worker process: messages are a 4-byte length and JSON (never pickle: a reader must not run code)


def _send(fd, obj):
    data = json.dumps(obj).encode()
    data = struct.pack("<I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _recv_blocking(fd):
    def exact(n):
        buf = bytearray()
        while len(buf) < n:
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)
    header = exact(4)
    body = header and exact(struct.unpack("<I", header)[0])
    return None if body is None else json.loads(body)


def _worker_main(cfg_json):
    """Entry point of a worker process (started by _WorkerProcess with a clean environment)."""
    cfg = json.loads(cfg_json)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the terminal's ^C is the trainer's business
    info = _isolate(cfg)
    os.chdir("/")
    for name in HEAVY_PRELOAD if cfg["kind"] == "heavy" else LIGHT_PRELOAD:
        try:
            __import__(name)
        except ImportError as e:
            info["warnings"].append(f"could not preload {name}: {e}")
    if cfg["kind"] == "heavy":
        try:
            exec(HEAVY_WARMUP, {})
        except Exception as e:   # numpy or sympy missing: the worker still runs plain Python
            info["warnings"].append(f"heavy warm-up failed: {e!r}")
    # The first compile() in a process costs ~3 ms of parser set-up; pay it here once, not in every child.
    compile("x = [i for i in range(3)]\nprint(x)\n", MAIN, "exec")
    ast.parse("x = 1")
    gc.freeze()   # the children's garbage collector then leaves the inherited objects (and their pages) alone
    vm_bytes = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cpu_s = math.ceil(cfg["timeout_s"])
    nproc = cfg["max_processes"]
    if info["level"] == "process" and info["sandbox_uid"] is None:
        nproc += _processes_of_uid(os.getuid())   # RLIMIT_NPROC counts all of the caller's processes here
    state = dict(info, max_fd=resource.getrlimit(resource.RLIMIT_NOFILE)[0], drop_capabilities=info["capabilities_dropped"],
                 rlimits=[(resource.RLIMIT_AS, vm_bytes + (cfg["memory_mb"] << 20), vm_bytes + (cfg["memory_mb"] << 20)),
                          (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),   # SIGXCPU first (a timeout), SIGKILL 1 s later
                          (resource.RLIMIT_NPROC, nproc, nproc),
                          (resource.RLIMIT_FSIZE, cfg["max_file_mb"] << 20, cfg["max_file_mb"] << 20),
                          (resource.RLIMIT_NOFILE, 256, 256),
                          (resource.RLIMIT_CORE, 0, 0)])
    info["preloaded_mb"] = vm_bytes >> 20
    _send(cfg["response_fd"], {"ready": True, "isolation": info})
    while True:
        request = _recv_blocking(cfg["request_fd"])
        if request is None:   # the parent closed the pipe or died: leave, and the namespace goes with us
            os._exit(0)
        _send(cfg["response_fd"], _run_call(request["code"], request["stdin"], cfg, state))


def _processes_of_uid(uid):
    count = 0
    for name in os.listdir("/proc"):
        try:
            count += name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid
        except OSError:
            pass
    return count


# -----------------------------------------------------------------------------
# the parent side: worker processes, slots, the Executor


class _WorkerGone(Exception):
    """The worker died, hung or sent garbage. It gets replaced."""


_BOOT = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('rstar2_executor_worker', "
         "sys.argv[1]); m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; "
         "spec.loader.exec_module(m); m._worker_main(sys.argv[2])")


def _worker_env():
    """The whole environment of a worker, not a scrub of ours: /proc/<pid>/environ keeps what a process was
    started with, so a secret removed after the fact would still be readable."""
    return {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "USER": "sandbox", "LOGNAME": "sandbox", "HOME": "/nonexistent",
            "PYTHONHASHSEED": "0",             # set and dict order of str is then the same on every rerun
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "MPLBACKEND": "Agg",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": ""}


class _WorkerProcess:
    """One warm worker (light or heavy) and its two pipes; used by one slot thread at a time."""

    def __init__(self, kind, settings):
        self.kind, self.settings, self.proc, self.isolation = kind, settings, None, None
        self.lock = threading.Lock()
        self.start()

    def start(self):
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        cfg = dict(self.settings, kind=self.kind, request_fd=req_r, response_fd=resp_w)
        self.proc = subprocess.Popen([sys.executable, "-s", "-B", "-c", _BOOT, os.path.abspath(__file__),
                                      json.dumps(cfg)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     env=_worker_env(), cwd="/", pass_fds=(req_r, resp_w), start_new_session=True)
        os.close(req_r)
        os.close(resp_w)
        os.set_blocking(self.req_w, False)
        self.ready = False

    def kill(self):
        """SIGKILL the waiter; PDEATHSIG then kills the namespace's PID 1, which takes every process in it."""
        if self.proc is not None:
            self.proc.kill()

    def stop(self):
        """Kill, reap and close the pipes. Only the thread that uses this worker (or close(), after the threads
        are gone) may call it: closing an fd under a reader could hand it someone else's reused fd number."""
        if self.proc is None:
            return
        self.kill()
        self.proc.wait()
        os.close(self.req_w)
        os.close(self.resp_r)
        self.proc = None

    def restart(self):
        self.stop()
        self.start()

    def wait_ready(self):
        if not self.ready:
            message = self._receive(time.monotonic() + STARTUP_TIMEOUT_S)
            if message.get("ready") is not True or not isinstance(message.get("isolation"), dict):
                raise _WorkerGone(f"bad first message from the worker: {str(message)[:200]}")
            self.isolation, self.ready = message["isolation"], True
        return self.isolation

    def call(self, code, stdin, timeout_s):
        """Send one call and wait for its result. Raises _WorkerGone(sent=False) if the call never reached it."""
        try:
            if self.proc.poll() is not None:
                raise _WorkerGone("the worker is gone")
            self.wait_ready()
            self._write(json.dumps({"code": code, "stdin": stdin}).encode(), time.monotonic() + BACKSTOP_GRACE_S)
        except _WorkerGone as e:
            e.sent = False
            raise
        message = self._receive(time.monotonic() + timeout_s + BACKSTOP_GRACE_S)
        try:
            result = ExecResult(**message)
            assert result.status in STATUSES and isinstance(result.stdout, str) and isinstance(result.stderr, str)
        except (TypeError, AssertionError):
            raise _WorkerGone(f"malformed result from the worker: {str(message)[:200]}") from None
        return result

    def _write(self, body, deadline):
        data = memoryview(struct.pack("<I", len(body)) + body)
        while data:
            try:
                data = data[os.write(self.req_w, data):]
            except BlockingIOError:
                self._poll(self.req_w, select.POLLOUT, deadline)
            except BrokenPipeError:
                raise _WorkerGone("the worker is gone") from None

    def _receive(self, deadline):
        header = self._read_exact(4, deadline)
        (length,) = struct.unpack("<I", header)
        if length > 64 << 20:
            raise _WorkerGone(f"a {length}-byte message from the worker")
        try:
            return json.loads(self._read_exact(length, deadline))
        except ValueError:
            raise _WorkerGone("a message from the worker is not JSON") from None

    def _read_exact(self, n, deadline):
        buf = bytearray()
        while len(buf) < n:
            self._poll(self.resp_r, select.POLLIN, deadline)
            chunk = os.read(self.resp_r, n - len(buf))
            if not chunk:
                raise _WorkerGone(f"the worker exited (code {self.proc.poll()})")
            buf += chunk
        return bytes(buf)

    @staticmethod
    def _poll(fd, event, deadline):
        poller = select.poll()   # not select.select: a trainer's fds easily pass select's limit of 1024
        poller.register(fd, event)
        while not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            if time.monotonic() >= deadline:
                raise _WorkerGone("the worker did not answer in time")


class Executor:
    """A pool of sandboxed warm workers running python_code_with_standard_io calls. See the module docstring.

    workers:          concurrent calls; None = one per usable core. Each slot holds a light and a heavy worker.
    timeout_s:        wall-clock limit per call (the release's code-judge runs with MAX_EXECUTION_TIME=4).
    memory_mb:        address space a call may add on top of what its warm worker already maps (~30 MB light,
                      ~200 MB heavy; see isolation["preloaded_mb"]); MemoryError beyond it -> status "oom".
    max_output_chars: stdout and stderr are each kept to this many characters, head and tail (code-judge keeps 1000).
    max_processes:    RLIMIT_NPROC per call (the worker's sandbox uid is unique, so this counts one call's tree).
    max_file_mb:      RLIMIT_FSIZE, and the size of each private tmpfs (/tmp, /var/tmp, /dev/shm, /run/lock).
    output_limit_mb:  a call that writes more than this in total is killed (status "error"); memory stays bounded
                      anyway, this bounds the time wasted on a print loop.
    hide_paths:       directories the snippet must not see, besides the repo, the caller's cwd and home.
    """

    def __init__(self, workers=None, timeout_s=4.0, memory_mb=1024, max_output_chars=1000, *, max_processes=64,
                 max_file_mb=64, output_limit_mb=16, hide_paths=()):
        if workers is None:
            workers = len(os.sched_getaffinity(0))
        for name, value, low in (("workers", workers, 1), ("memory_mb", memory_mb, 16), ("max_output_chars", max_output_chars, 8),
                                 ("max_processes", max_processes, 1), ("max_file_mb", max_file_mb, 1),
                                 ("output_limit_mb", output_limit_mb, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Executor: {name} must be an int >= {low}, got {value!r}")
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not 0 < timeout_s <= 3600:
            raise ValueError(f"Executor: timeout_s must be a number of seconds in (0, 3600], got {timeout_s!r}")
        if isinstance(hide_paths, str) or not all(isinstance(p, str) and os.path.isabs(p) for p in hide_paths):
            raise ValueError(f"Executor: hide_paths must be a list of absolute paths, got {hide_paths!r}")
        self.workers, self.timeout_s = workers, float(timeout_s)
        repo = os.path.dirname(os.path.abspath(__file__))
        settings = dict(timeout_s=self.timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars,
                        max_processes=max_processes, max_file_mb=max_file_mb, output_limit_mb=output_limit_mb,
                        hide_paths=[repo, os.getcwd(), os.path.expanduser("~"), *hide_paths])
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._slots = []
        try:
            for i in range(workers):
                self._slots.append((_WorkerProcess("light", settings), _WorkerProcess("heavy", settings)))
        except BaseException:
            _shutdown(self._slots, [], self._jobs, self._closed)
            raise
        # The threads get no reference to `self`, so an Executor that is dropped without close() is collected
        # and its finalizer stops the workers (it also runs at interpreter exit).
        self._threads = [threading.Thread(target=_serve, args=(*slot, self._jobs, self.timeout_s, self._closed),
                                          name=f"executor-slot-{i}", daemon=True) for i, slot in enumerate(self._slots)]
        for thread in self._threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._slots, self._threads, self._jobs, self._closed)

    # ---- the public API

    def submit(self, code, stdin=""):
        """Queue one call; the Future completes as soon as this call finishes, whatever the others do."""
        for name, value in (("code", code), ("stdin", stdin)):
            if not isinstance(value, str):
                raise TypeError(f"Executor.submit: {name} must be a str, got {type(value).__name__}")
            if len(value) > MAX_CODE_BYTES:
                raise ValueError(f"Executor.submit: {name} has {len(value)} characters, the limit is {MAX_CODE_BYTES}")
        future = Future()
        with self._lock:   # against close(): a job queued after its drain would never run
            if self._closed.is_set():
                raise RuntimeError("Executor.submit: the executor is closed")
            self._jobs.put((code, stdin, future))
        return future

    def run(self, code, stdin=""):
        return self.submit(code, stdin).result()

    def map(self, codes, stdins=None):
        """All calls at once (as parallel as `workers` allows), results in input order."""
        codes = list(codes)
        stdins = [""] * len(codes) if stdins is None else list(stdins)
        if len(stdins) != len(codes):
            raise ValueError(f"Executor.map: {len(codes)} codes but {len(stdins)} stdins")
        futures = [self.submit(code, stdin) for code, stdin in zip(codes, stdins)]
        return [f.result() for f in futures]

    def wait_ready(self):
        """Block until every worker has started (a heavy one imports sympy, ~1-2 s); calls do not need this."""
        for slot in self._slots:
            for worker in slot:
                with worker.lock:
                    worker.wait_ready()

    @property
    def isolation(self):
        """What the sandbox reached on this machine (the first worker's report; all workers try the same)."""
        light = self._slots[0][0]
        with light.lock:
            return dict(light.wait_ready())

    def close(self):
        """Cancel queued calls, stop the workers (their namespaces die with them). Idempotent."""
        with self._lock:
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# one thread per slot: a slow call holds its own slot only, and each Future completes when its call does

def _serve(light, heavy, jobs, timeout_s, closed):
    while True:
        job = jobs.get()
        if job is None:
            return
        code, stdin, future = job
        if not future.set_running_or_notify_cancel():
            continue   # cancelled while queued
        worker = heavy if HEAVY_RE.search(code) else light
        try:
            with worker.lock:
                result = _call(worker, code, stdin, timeout_s, closed)
        except BaseException as exc:   # the thread must outlive any single call
            future.set_exception(exc)
            continue
        future.set_result(result)


def _call(worker, code, stdin, timeout_s, closed):
    for attempt in range(2):
        if worker.proc is None:
            raise RuntimeError("Executor: closed while the call was queued")
        try:
            return worker.call(code, stdin, timeout_s)
        except _WorkerGone as gone:
            if closed.is_set():
                raise RuntimeError("Executor: closed while the call was running") from None
            worker.restart()
            if getattr(gone, "sent", True) is False and attempt == 0:
                continue   # it died before taking this call (killed from outside): not this call's doing
            if "in time" in str(gone):
                note = f"TimeoutError: the sandbox did not answer within {timeout_s:g} s + {BACKSTOP_GRACE_S:g} s"
                return ExecResult("timeout", "", note + "\n", 0.0, False, "executor backstop", None)
            note = f"ExecutorError: the sandbox worker failed during the call ({gone}); it was replaced"
            return ExecResult("error", "", note + "\n", 0.0, False, "worker died", None)
    raise AssertionError("unreachable")


def _shutdown(slots, threads, jobs, closed):
    """close() and the finalizer: cancel what is queued, kill the workers (in-flight calls see EOF at once),
    let the threads finish, then reap the workers and close their pipes."""
    closed.set()
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


# -----------------------------------------------------------------------------
# command line: benchmark, soak, one-off run


@dataclasses.dataclass
class ExecutorCLIConfig:
    mode: str = "bench"          # bench | soak | run
    workers: int = 0             # 0 = one per core
    timeout_s: float = 4.0
    memory_mb: int = 1024
    calls: int = 10000           # soak: number of calls
    scale: float = 1.0           # bench: multiply every call count (0.2 for a quick look)
    code: str = ""               # run: the snippet
    stdin: str = ""              # run: its stdin

    def validate(self):
        if self.mode not in ("bench", "soak", "run"):
            raise ValueError(f"mode must be bench, soak or run, got {self.mode!r}")
        if self.workers < 0 or self.calls < 1 or self.scale <= 0:
            raise ValueError("workers must be >= 0, calls >= 1 and scale > 0")
        if self.mode == "run" and not self.code:
            raise ValueError("mode=run needs code='...'")


TRIVIAL = "print(1 + 1)"
HEAVY_SNIPPETS = [
    "import sympy as sp\nx = sp.symbols('x')\nprint(sp.factor(x**4 - 1))",
    "from sympy import symbols, solve\nx = symbols('x')\nprint(solve(x**2 - 5*x + 6, x))",
    "import numpy as np\na = np.arange(12).reshape(3, 4)\nprint(a.sum(axis=0))",
    "import sympy\nprint(sympy.isprime(2**61 - 1), sympy.factorint(360))",
]


def realistic_mix():
    """100 calls shaped like tool calls in math RL: mostly sympy/numpy, some stdlib, 10% errors, 1% timeouts."""
    light = ["print(sum(i * i for i in range(10000)))",
             "from fractions import Fraction\nprint(sum(Fraction(1, k) for k in range(1, 40)))",
             "import math, itertools\nprint(sum(1 for p in itertools.permutations(range(7)) if p[0] < p[-1]))"]
    errors = ["x = [1, 2, 3]\nprint(x[5])", "import sympy\nsympy.Symbol('x') + 'a'"]
    stdin_calls = [("a, b = map(int, input().split())\nprint(a * b)", "6 7")]
    calls = []
    for i in range(100):
        if i == 50:
            calls.append(("while True:\n    pass", ""))
        elif i % 10 == 3:
            calls.append((errors[i % 2], ""))
        elif i % 10 == 7:
            calls.append(stdin_calls[0])
        elif i % 10 in (1, 5):
            calls.append((light[i % 3], ""))
        else:
            calls.append((HEAVY_SNIPPETS[i % 4], ""))
    return calls


def _percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _drive(call_fn, calls, concurrency):
    """Run `calls` through `call_fn(code, stdin)` from `concurrency` client threads; (calls/s, latencies)."""
    latencies, lock, index = [], threading.Lock(), iter(range(len(calls)))
    def client():
        while True:
            with lock:
                i = next(index, None)
            if i is None:
                return
            t = time.perf_counter()
            call_fn(*calls[i])
            with lock:
                latencies.append(time.perf_counter() - t)
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(calls) / (time.perf_counter() - start), latencies


def _naive_call(timeout_s):
    def call(code, stdin):   # the baseline the issue names: a fresh interpreter per call
        try:
            subprocess.run([sys.executable, "-c", code], input=stdin.encode(), capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    return call


FORK_FLOOR = """
import os, sys, time, math, itertools, fractions
n, end = 0, time.perf_counter() + float(sys.argv[1])
while time.perf_counter() < end:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    n += 1
print(n / float(sys.argv[1]))
"""


def bench(cfg):
    """Calls/s and latency of the executor vs a fresh `python -c` per call and vs a bare fork+exit+wait."""
    workers = cfg.workers or len(os.sched_getaffinity(0))
    n = lambda k: max(4, int(k * cfg.scale))
    rows = []
    def report(workload, who, concurrency, rate, lat):
        rows.append((workload, who, concurrency, rate, lat))
        print(f"{workload:9s} {who:9s} c={concurrency:<3d} {rate:8.1f} calls/s   p50 {1e3 * _percentile(lat, .5):8.1f} ms"
              f"   p99 {1e3 * _percentile(lat, .99):8.1f} ms   p99/p50 {_percentile(lat, .99) / _percentile(lat, .5):5.1f}",
              flush=True)
    procs = [subprocess.Popen([sys.executable, "-c", FORK_FLOOR, "3"], stdout=subprocess.PIPE, text=True)
             for _ in range(workers)]
    floor_rate = sum(float(p.communicate()[0]) for p in procs)
    print(f"fork floor: bare fork+exit+wait from {workers} warm stdlib processes: {floor_rate:.0f} calls/s", flush=True)
    naive = _naive_call(cfg.timeout_s)
    mix = realistic_mix()
    with Executor(workers=workers, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb) as ex:
        ex.wait_ready()
        run = lambda code, stdin: ex.run(code, stdin)
        results = {}
        for workload, calls, naive_calls in (("trivial", [(TRIVIAL, "")] * n(2000), [(TRIVIAL, "")] * n(150)),
                                             ("heavy", [(c, "") for c in HEAVY_SNIPPETS] * n(100),
                                              [(c, "") for c in HEAVY_SNIPPETS] * n(4)),
                                             ("mix", mix * max(1, n(2) // 2), mix)):
            for concurrency in (1, workers, 4 * workers):
                rate, lat = _drive(run, calls, concurrency)
                report(workload, "executor", concurrency, rate, lat)
                results[workload, concurrency] = rate
            for concurrency in (1, workers):
                rate, lat = _drive(naive, naive_calls if concurrency == workers or workload == "trivial"
                                   else naive_calls[:max(4, len(naive_calls) // 4)], concurrency)
                report(workload, "python -c", concurrency, rate, lat)
                print(f"{'':9s} ratio executor / python -c at c={concurrency}: "
                      f"{results[workload, concurrency] / rate:.1f}x", flush=True)
        print(f"trivial at c={4 * workers}: {results['trivial', 4 * workers]:.0f} calls/s = "
              f"{100 * results['trivial', 4 * workers] / floor_rate:.0f}% of the bare fork floor", flush=True)
        print("isolation:", json.dumps(ex.isolation))
    return rows


HOSTILE = [
    ("import time\ntime.sleep(30)", "timeout"),
    ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        import time; time.sleep(60)\nprint('parent done')", "ok"),
    ("x = bytearray(1 << 40)", "oom"),
    ("while True:\n    print('x' * 100000)", "error"),
    ("import os, signal\nos.kill(-1, signal.SIGKILL)", None),
    ("import os\nos.kill(os.getppid(), 9)\nprint('still here')", None),
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", None),
    ("raise ValueError('boom')", "error"),
    ("open('/tmp/leak', 'w').write('x')\nimport os\nos.makedirs(os.path.expanduser('~/.cache/x'))", "ok"),
]


def _descendants(pid):
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
    """Processes that calls of `ex` left behind: anything below a worker except its own PID 1, or anything
    running as one of its sandbox uids. Between calls this is empty."""
    workers = [w.proc.pid for slot in ex._slots for w in slot if w.proc is not None]
    inner = 1 if ex.isolation["pid_namespace"] else 0
    strays = [pid for w in workers for pid in _descendants(w)[inner:]]
    uids = {SANDBOX_UID_BASE + w for w in workers}
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid in uids:
                strays.append(int(name))
        except OSError:
            pass
    return sorted(set(strays))


def _leak_counters(ex):
    """(zombie children of this process, stray processes, open fds, RSS in MiB)."""
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


def soak(ex, calls, report_every=0):
    """`calls` calls, one in ten hostile (HOSTILE), then the leak counters before and after. Returns a dict."""
    benign = [("print(sum(range(100)))", "ok", ""), ("a = input()\nprint(a[::-1])", "ok", "stressed"),
              ("import math\nmath.factorial(200)", "ok", ""), ("1/0", "error", "")]
    ex.wait_ready()
    before = _leak_counters(ex)
    futures, wrong = [], []
    for i in range(calls):
        if i % 10 == 9:
            code, expect = HOSTILE[(i // 10) % len(HOSTILE)]
            stdin = ""
        else:
            code, expect, stdin = benign[i % len(benign)]
        futures.append((ex.submit(code, stdin), expect, code))
        if report_every and (i + 1) % report_every == 0:
            print(f"submitted {i + 1}", flush=True)
    statuses = {}
    for future, expect, code in futures:
        result = future.result()
        statuses[result.status] = statuses.get(result.status, 0) + 1
        if expect is not None and result.status != expect:
            wrong.append((code, result))
    time.sleep(0.2)   # the last worker's sweep runs just after it answers
    after = _leak_counters(ex)
    return dict(calls=calls, statuses=statuses, wrong=wrong, zombies=after[0], strays=after[1],
                fds_before=before[2], fds_after=after[2], rss_mb_before=before[3], rss_mb_after=after[3],
                benign_after=ex.run("print('alive')").stdout == "alive\n")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [{"--bench": "mode=bench", "--soak": "mode=soak"}.get(a, a) for a in argv]
    try:
        from common import load_config
        cfg = load_config(ExecutorCLIConfig, argv)
    except ImportError:   # common.py is absent when executor.py is copied out alone: key=value still work
        cfg = ExecutorCLIConfig(**{k: type(getattr(ExecutorCLIConfig, k))(v) for k, v in (a.split("=", 1) for a in argv)})
        cfg.validate()
    if cfg.mode == "bench":
        bench(cfg)
    elif cfg.mode == "soak":
        with Executor(workers=cfg.workers or None, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb) as ex:
            start = time.perf_counter()
            stats = soak(ex, cfg.calls, report_every=1000)
            stats["seconds"] = round(time.perf_counter() - start, 1)
            wrong = stats.pop("wrong")
            print(json.dumps(stats, indent=1))
            for code, result in wrong[:5]:
                print("unexpected:", repr(code[:60]), result)
            ok = not wrong and not stats["zombies"] and not stats["strays"] and stats["benign_after"] \
                and stats["fds_after"] <= stats["fds_before"] and stats["rss_mb_after"] <= stats["rss_mb_before"] + 20
            print("SOAK", "PASSED" if ok else "FAILED")
            sys.exit(0 if ok else 1)
    else:
        with Executor(workers=1, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb) as ex:
            result = ex.run(cfg.code, cfg.stdin)
            print(result.tool_response(max_chars=0))


if __name__ == "__main__":
    main()
