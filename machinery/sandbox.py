"""The worker pool beneath the tool and the verifier: warm workers, their isolation, one call's
fork, watch, kill and sweep. Standard library only: a worker loads this file by path, so a light
worker's fork stays cheap.

Kinds: "light" (stdlib preloaded, ~1 ms fork), "heavy" (numpy and sympy warmed, ~8 ms fork) fork a
child per call; a "grader" answers machinery/verifier.py's checks itself. The isolation ladder
(namespaces as root, else a user namespace, else a plain process under a subreaper), Linux 5.3+:
docs/design.md, "The sandbox"."""
import ast
import builtins
import contextlib
import ctypes
import importlib
import json
import math
import os
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


MAIN = "main.py"          # the snippet's file name: fixed, so tracebacks are the same on a rerun
TRUNCATION_MARK = "...(truncated)..."   # verl's marker for a middle cut
SANDBOX_UID_BASE = 2_000_000_000        # a worker's sandbox uid is this + its pid: unique, < 2**31
EXIT_MEMORY = 201         # the child's exit code for an uncaught MemoryError (status "oom")
EXIT_SETUP = 202          # the child could not enter the sandbox: an executor failure
STARTUP_TIMEOUT_S = 120.0  # a heavy worker imports sympy in 1-2 s; generous for a loaded machine

# a call's deadline stretches by its CPU waits to at most this x timeout_s; its CPU is timeout_s
STRETCH_CAP = 20
BACKSTOP_GRACE_S = 5.0    # the parent gives up on a worker silent for STRETCH_CAP x timeout + this

TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")   # world-writable: private per worker
TMP_INODES = 65536        # files, directories and links in each of them: a flood's bound

# The router: a mention in a comment only costs a few ms of speed, never correctness.
HEAVY_RE = re.compile(r"\b(?:numpy|sympy|mpmath|scipy)\b")
LIGHT_PRELOAD = ("math", "cmath", "itertools", "functools", "fractions", "decimal", "collections",
                 "heapq", "bisect", "statistics", "random", "string", "operator", "json", "re")

# sympy loads lazily: a child forked after a bare import spends ~200 ms in its first factor().
HEAVY_WARMUP = """
import numpy as np, sympy as sp
x, y, n = sp.symbols("x y n")
sp.factor(x**4 - 1); sp.solve(x**2 - 5*x + 6, x); sp.solve([x + y - 3, x - y - 1], [x, y])
sp.simplify((x**2 - 1) / (x - 1)); sp.expand((x + 1)**5); sp.diff(sp.sin(x) * x, x); \
sp.limit(sp.sin(x) / x, x, 0)
sp.isprime(2**61 - 1); sp.factorint(360); sp.Matrix([[1, 2], [3, 4]]).det(); sp.nsimplify(0.5)
sp.summation(n**2, (n, 1, 10)); sp.binomial(10, 3); sp.N(sp.pi, 30); sp.Rational(3, 4) + sp.sqrt(8)
np.linalg.det(np.eye(3)); np.arange(12).reshape(3, 4).sum(axis=0); \
np.random.default_rng(0).random(3)
"""


def truncate_middle(text, max_chars):
    """verl's middle cut: max_chars // 2 characters each side of a marker (0 = no cut)."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + TRUNCATION_MARK + text[len(text) - half:]


# -----------------------------------------------------------------------------
# Linux through libc: Python 3.11 has no os.unshare, os.mount or capset

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
(PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER,
 PR_SET_NO_NEW_PRIVS) = 1, 4, 24, 36, 38

# a remount must repeat these flags, or a user namespace refuses it (they are locked there)
_MOUNT_OPTION_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                       "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME,
                       "strictatime": MS_STRICTATIME}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags):
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def _prctl(option, arg):
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def _under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")


# -----------------------------------------------------------------------------
# a worker's isolation, set up once when it starts (per call each layer would cost 0.5-2.5 ms).
# PID 1 of a PID namespace: kill(-1) reaches every process a call made, even past setsid.


def _isolate(cfg):
    """Enter the strongest sandbox the OS allows; -> its report. With a PID namespace (and mount,
    net, IPC ones) this forks: the caller waits outside (its death kills PID 1); PID 1 returns."""
    info = dict(level="process", pid_namespace=False, sandbox_uid=None,
                capabilities_dropped=False, private_proc=False, hidden_paths=[],
                readonly_mounts=False, private_tmp=False, gpu_devices_masked=[], warnings=[],
                kept_paths=_keep_paths({os.path.realpath(p) for p in cfg["hide_paths"]}))
    flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC
    euid, egid, host_pid = os.geteuid(), os.getegid(), os.getpid()
    try:
        _unshare(flags)
        info["level"] = "namespaces"
    except OSError as root_error:
        try:   # without root: in a user namespace we own fresh namespaces, but nothing of the host
            _unshare(flags | CLONE_NEWUSER)
            # one may map only oneself, and must deny setgroups(2) before a gid map
            _write_text("/proc/self/setgroups", "deny")
            _write_text("/proc/self/uid_map", f"0 {euid} 1")
            _write_text("/proc/self/gid_map", f"0 {egid} 1")
            info["level"] = "user-namespace"
        except OSError as user_error:
            info["warnings"].append(f"no namespaces ({root_error.strerror}; "
                                    f"user namespace: {user_error.strerror})")

    if info["level"] == "process":
        # a call's orphans re-parent to us, not to init: none escapes the sweep
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        if euid == 0 and not any(map(_closed_to_others, info["kept_paths"])):
            info["sandbox_uid"] = SANDBOX_UID_BASE + host_pid
        info["capabilities_dropped"] = euid == 0 and info["sandbox_uid"] is None
        return info
    info["pid_namespace"] = True
    child = os.fork()   # unshare(CLONE_NEWPID) moves our children, not us: the first child is PID 1
    if child:
        os.closerange(3, 1 << 16)   # the waiter holds no pipe: the parent sees EOF when PID 1 dies
        _, status = os.waitpid(child, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    # PDEATHSIG follows the parent *thread*; the waiter has one, so: when the waiter dies
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if info["level"] == "user-namespace":
        info["capabilities_dropped"] = True   # one uid is mapped: no switch to another
    else:
        info["sandbox_uid"] = SANDBOX_UID_BASE + host_pid

    # a failed step is reported; the probe call (_worker_main) decides whether calls still run
    steps = (("private mounts", lambda: _mount(None, "/", None, MS_REC | MS_PRIVATE)),
             # a /proc of this PID namespace: no other process is seen, /proc/<pid> is ours
             ("fresh /proc",
              lambda: _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)),
             ("hidden paths", lambda: _hide_paths(cfg["hide_paths"], info["kept_paths"], info)),
             ("GPU masks", lambda: _mask_gpus(info)),
             ("read-only mounts", lambda: _remount_readonly(info)),
             ("private tmp", lambda: _private_tmp(cfg, info)))
    for name, step in steps:
        try:
            step()
            info["private_proc"] |= name == "fresh /proc"
        except OSError as e:
            info["warnings"].append(f"{name}: {e}")
            if name == "private mounts":
                break   # any further mount would show on the host
    # SysV IPC objects outlive their processes: shm dies with its users; no queues, no semaphores
    for key, value in (("kernel/shm_rmid_forced", "1"), ("kernel/msgmni", "0"),
                       ("kernel/sem", "0 0 0 0"), ("fs/mqueue/queues_max", "0")):
        with contextlib.suppress(OSError):
            _write_text(f"/proc/sys/{key}", value)
    return info


def _interpreter_path():
    """The interpreter, its directory resolved (a venv is found from its directory)."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)),
                        os.path.basename(sys.executable))


def _keep_paths(hide=()):
    """What the snippet must still read (the interpreter, stdlib, site-packages), the outermost;
    `hide` (real paths) wins over a path that contains it."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))}
    paths.update(p for p in sys.path if p and os.path.isdir(p))   # "" is the call's own directory
    paths = {os.path.realpath(p) for p in paths}   # a bind needs the real directory
    paths = sorted(p for p in paths if not any(_under(h, p) for h in hide))
    return [p for p in paths if not any(q != p and _under(p, q) for q in paths)]


def _closed_to_others(path):
    """`path` and the directories above it that others may not enter (o-x), like a 0700 /root."""
    closed = []
    while path != "/":
        if not os.stat(path).st_mode & 0o001:
            closed.append(path)
        path = os.path.dirname(path)
    return closed


def _bind_back(inside, readonly=False):
    """O_PATH fds of `inside`, opened before a cover is mounted; -> a function binding them back."""
    fds = [os.open(k, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for k in inside]

    def bind():
        for k, fd in zip(inside, fds):
            os.makedirs(k, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC)
            if readonly:
                _mount(None, k, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            os.close(fd)
    return bind


def _hide_paths(hide_paths, keep, info):
    """An empty read-only tmpfs over each hidden directory, the kept paths inside bound back; so
    over an ancestor a sandbox uid could not pass. Never a system directory, whatever the cwd."""
    hide = {os.path.realpath(p) for p in hide_paths if os.path.isdir(p)}
    hide.update(h for k in keep for h in _closed_to_others(os.path.dirname(k)))
    hide = sorted(hide - {"/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/dev", "/proc",
                          "/sys", "/var", "/run", "/tmp"})
    hide = [h for h in hide if not any(o != h and _under(h, o) for o in hide)]   # the outermost
    for h in hide:
        bind = _bind_back([k for k in keep if _under(k, h)])
        _mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
        bind()
        _mount(None, h, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        info["hidden_paths"].append(h)


def _mask_gpus(info):
    """CUDA_VISIBLE_DEVICES="" is only a request, and GPU nodes are often 0666: /dev/null over the
    NVIDIA and AMD (kfd) nodes, an empty tmpfs over /dev/dri (docs/design.md, "GPU masking")."""
    for name in sorted(os.listdir("/dev")):
        path = "/dev/" + name
        if name == "dri":
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
        elif name == "kfd" or name.startswith("nvidia") and not os.path.isdir(path):
            _mount("/dev/null", path, None, MS_BIND)
        else:
            continue
        info["gpu_devices_masked"].append(path)


def _remount_readonly(info):
    """Every mount read-only but /proc, /sys and /dev (/dev/shm gets its own tmpfs next)."""
    failures = 0
    with open("/proc/self/mountinfo") as f:
        rows = f.read().splitlines()   # all of it before the first remount changes it
    for row in map(str.split, rows):
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), row[4])   # \040: " "
        options = row[5].split(",")
        if any(_under(target, p) for p in ("/proc", "/sys", "/dev")) or "ro" in options:
            continue
        # MS_BIND with MS_REMOUNT changes this mount's flags only: the host keeps rw
        locked = {_MOUNT_OPTION_FLAGS.get(option, 0) for option in options}   # distinct bits
        try:
            _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | sum(locked))
        except OSError:
            failures += 1
    info["readonly_mounts"] = failures == 0
    if failures:
        info["warnings"].append(f"{failures} mounts could not be made read-only")


def _private_tmp(cfg, info):
    # a little over the file-size limit: one big file meets EFBIG, many ENOSPC, and the RAM a call
    # fills here (tmpfs is not in RLIMIT_AS) stays bounded
    for path in TMP_DIRS:
        if os.path.isdir(path):
            bind = _bind_back([k for k in info["kept_paths"] if _under(k, path)], readonly=True)
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
                   f"mode=1777,size={cfg['max_file_mb'] + 16}m,nr_inodes={TMP_INODES}")
            bind()
    info["private_tmp"] = True


# -----------------------------------------------------------------------------
# one call, in the child: the fds first (nothing of the worker's stays reachable), then what needs
# root (oom_score_adj, hard rlimits), then the uid switch; then the snippet as a script


def _run_child(code, seed, stdin_fd, out_fd, err_fd, workdir, state):
    """Runs in the forked child and never returns."""
    # seeded from (code, stdin): an RL rerun stays byte-identical (PYTHONHASHSEED=0), and no child
    # shares numpy's state with another call of its worker
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)

    try:
        os.setsid()   # its own session and group: from PID 2 on, kill(0) must not mean the worker
        for fd, standard in ((stdin_fd, 0), (out_fd, 1), (err_fd, 2)):
            os.dup2(fd, standard)
        os.closerange(3, state["max_fd"])   # the worker's pipes to the parent must not be reachable
        signal.signal(signal.SIGINT, signal.default_int_handler)   # the worker ignores it
        with contextlib.suppress(OSError):   # under host memory pressure the kernel kills us first
            _write_text("/proc/self/oom_score_adj", "1000")
        os.chdir(workdir)
        for limit, soft, hard in state["rlimits"]:
            resource.setrlimit(limit, (soft, hard))   # hard: the snippet cannot raise them back
        uid = state["sandbox_uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            _prctl(PR_SET_DUMPABLE, 1)   # a uid change hands /proc/self to root; give it back
        if not state["pid_namespace"]:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # without a namespace, die with the worker
        if state["capabilities_dropped"]:
            # CAP_SYS_ADMIN would let uid 0 of a user namespace unmount the tmpfs that hides the
            # repo. capset(2), header version 3, two empty data blocks
            for cap in range(64):
                if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                    break
            header = (ctypes.c_uint32 * 2)(0x20080522, 0)
            _check(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    except BaseException as exc:
        os.write(2, f"ExecutorError: the sandbox could not be set up: {exc!r}\n".encode())
        os._exit(EXIT_SETUP)

    # os._exit: a normal exit would run the worker's atexit; never return into the worker's loop
    try:
        os._exit(_run_snippet(code, state["private_tmp"]))
    except BaseException as exc:
        os.write(2, f"ExecutorError: {exc!r}\n".encode())
    finally:
        os._exit(EXIT_SETUP)


def _run_snippet(code, private_tmp):
    """`python main.py` (argv, __main__ and __file__ set once by the worker), with the value of a
    final expression shown, IPython-like; -> the exit code."""
    if not private_tmp:   # without a private /tmp the call's directory changes every time
        os.environ.update(HOME=os.getcwd(), TMPDIR=os.getcwd())
        tempfile.tempdir = None   # the worker's own mkdtemp() cached /tmp
    main = sys.modules["__main__"]   # the worker's empty one
    returncode = 0
    try:
        tree = compile(code, MAIN, "exec", ast.PyCF_ONLY_AST)   # ast.parse, minus a frame
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, MAIN, "exec"), main.__dict__)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), MAIN, "eval"), main.__dict__)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            returncode = (exc.code or 0) & 0xFF
        else:
            print(exc.code, file=sys.stderr)   # sys.exit("message") prints it and exits 1
            returncode = 1
    except BaseException as exc:   # KeyboardInterrupt included, as for a script
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != MAIN:
            tb = tb.tb_next   # the traceback from the snippet's first frame on
        with contextlib.suppress(BaseException):   # the C printer: fast for 10**6 frames
            sys.__excepthook__(type(exc), exc.with_traceback(tb), tb)
        returncode = EXIT_MEMORY if isinstance(exc, MemoryError) else 1

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return returncode


# -----------------------------------------------------------------------------
# one call, in the worker: fork, watch, kill, sweep, describe. Only a SIGKILL from outside is sure
# to stop a snippet (it can catch any exception or sit in C code, 10**10**9).


class _Capture:
    """A stream's first and last `keep` bytes and a count of all: no gigabyte sits in memory."""

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
        """(text, truncated): decoded (bad UTF-8 as U+FFFD), cut as truncate_middle cuts; `keep`
        (2 * max_chars + 4 bytes) holds max_chars // 2 characters of 4 bytes at each end."""
        if self.total == len(self.head) + len(self.tail):
            text = (self.head + self.tail).decode("utf-8", "replace")
            return truncate_middle(text, max_chars), len(text) > max_chars
        half = max_chars // 2
        tail = self.tail.decode("utf-8", "replace")[-half:] if half else ""
        return self.head.decode("utf-8", "replace")[:half] + TRUNCATION_MARK + tail, True


def _run_call(code, stdin, cfg, state):
    """One call from fork to sweep; returns the fields of an ExecResult."""
    # an empty directory of the sandbox uid; with a private /tmp always the same path
    if state["private_tmp"]:
        workdir = "/tmp/sandbox"
        shutil.rmtree(workdir, ignore_errors=True)   # left by a call whose clean-up failed half-way
        os.mkdir(workdir, 0o700)
    else:
        workdir = tempfile.mkdtemp(prefix="rstar2-exec-")
    if state["sandbox_uid"] is not None:
        os.chown(workdir, state["sandbox_uid"], state["sandbox_uid"])
    # on disk as for `python main.py`: tracebacks show source lines, inspect works
    with open(os.path.join(workdir, MAIN), "x", encoding="utf-8", errors="surrogatepass") as f:
        f.write(code)
    # stdin as a file, not a pipe: writing it cannot block, and reads past its end get EOF at once
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, stdin.encode("utf-8", "replace"))
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    keep = 2 * cfg["max_output_chars"] + 4   # bytes per end: see _Capture.text
    captures = {out_r: _Capture(keep), err_r: _Capture(keep)}
    poller = select.poll()
    for fd in captures:
        poller.register(fd, select.POLLIN)
    drain_until, output_limit = None, cfg["output_limit_mb"] << 20
    open_fds, returncode, killed_for, elapsed, ran_ns, cpu_s = set(captures), None, None, 0, 0, 0
    start = time.monotonic()
    deadline = start + cfg["timeout_s"]
    pid = os.fork()
    if pid == 0:
        _run_child(code, hash((code, stdin)) & (2**64 - 1), stdin_fd, out_w, err_w, workdir, state)
    for fd in (stdin_fd, out_w, err_w):
        os.close(fd)
    pidfd = os.pidfd_open(pid)   # readable at the child's exit: one poll() waits for all
    poller.register(pidfd, select.POLLIN)

    # until the main process is reaped, read its output and kill it at the deadline or the output
    # limit (killed_for: why *we* killed it); then a short drain
    while open_fds or returncode is None:
        now = time.monotonic()
        wait_until = (drain_until if returncode is not None
                      else deadline if killed_for is None else now + 1.0)
        for fd, _ in poller.poll(max(0.0, wait_until - now) * 1000):
            if fd == pidfd:
                _, status, usage = os.wait4(pid, 0)
                returncode, elapsed = os.waitstatus_to_exitcode(status), time.monotonic() - start
                cpu_s = usage.ru_utime + usage.ru_stime
                poller.unregister(pidfd)
                _signal_everything(state, pid)   # the call ends with its main process
                drain_until = time.monotonic() + 1.0
                continue
            data = os.read(fd, 1 << 16)
            if not data:
                poller.unregister(fd)
                open_fds.discard(fd)
                continue
            captures[fd].add(data)
            if killed_for is None and sum(c.total for c in captures.values()) > output_limit:
                killed_for = "output limit"   # a print loop is stopped at once
                _signal_everything(state, pid)
        # after the events: a child that exited while this worker waited for a CPU finished
        now = time.monotonic()
        if returncode is None and killed_for is None and now >= deadline:
            killed_for, deadline, ran_ns = _past_deadline(pid, start, now, ran_ns, cfg, state)
        if returncode is not None and now >= drain_until:
            break   # a writer stuck in uninterruptible I/O still holds a pipe: stop waiting

    # the sweep, before the answer: when the parent has the result, the call left nothing behind.
    # Kill and reap: from PID 1 the namespace, else the subreaper's children (or, where the kernel
    # has no task/*/children, the call's session); one stuck in uninterruptible I/O after 5 s: the
    # next call's sweep reaps it
    sweep_until = time.monotonic() + 5.0
    while time.monotonic() < sweep_until:
        if state["pid_namespace"]:
            _signal_everything(state, pid)
        else:
            children = _proc_fields(f"self/task/{os.getpid()}", "children")
            for leftover in [-pid] if children is None else map(int, children):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(leftover, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    for fd in (out_r, err_r, pidfd):
        os.close(fd)
    # nothing a call wrote survives it: the private tmpfs emptied but for the interpreter bound
    # back there (or the call's directory removed)
    if state["private_tmp"]:
        for root in filter(os.path.isdir, TMP_DIRS):
            _empty_dir(root, state["kept_paths"])
    else:
        _remove_tree(workdir)

    # status and reason from how the child ended; a last stderr line where Python wrote none
    stdout, cut_out = captures[out_r].text(cfg["max_output_chars"])
    stderr, cut_err = captures[err_r].text(cfg["max_output_chars"])
    status, note = "error", ""
    if killed_for in ("wall-clock limit", "wall-clock backstop"):
        status, note = "timeout", (f"TimeoutError: the code ran longer than {cfg['timeout_s']:g} s "
                                   "and was killed")
    elif killed_for == "output limit":
        note = (f"OutputLimitError: the code wrote more than {cfg['output_limit_mb']} MiB and was "
                "killed")
    elif killed_for == "cpu-time limit" or returncode == -signal.SIGXCPU:
        killed_for, status = "cpu-time limit", "timeout"
        note = "TimeoutError: the code used more than its CPU time limit and was killed"
    elif returncode == EXIT_MEMORY:   # the child's own word (the OOM killer is a signal)
        killed_for, status = "memory limit", "oom"
    elif returncode == 0:
        status = "ok"
    elif returncode < 0:   # a real-time signal has no name
        name = next((s.name for s in signal.Signals if s == -returncode), str(-returncode))
        killed_for, note = f"signal {name}", f"Killed by signal {-returncode} ({name})"
    else:
        killed_for = f"exit status {returncode}"

    if note:   # after the truncation, so the model always sees why the call ended
        stderr += ("" if not stderr or stderr.endswith("\n") else "\n") + note + "\n"
    return dict(status=status, stdout=stdout, stderr=stderr, elapsed_s=elapsed, cpu_s=cpu_s,
                truncated=cut_out or cut_err, reason=killed_for or "", returncode=returncode)


def _past_deadline(pid, start, now, ran_ns, cfg, state):
    """At the deadline: (why the call is killed or None, the next deadline, its CPU ns so far).
    A wait for a CPU is the machine's, else RoC's tool-error ratio (Eq. 4) would measure the load;
    runnable and not run since our last look is waiting too (the kernel books it when it runs)."""
    own_proc = state["private_proc"] or not state["pid_namespace"]   # /proc/<pid> is our child
    pids = ([p for p in os.listdir("/proc") if p.isdigit() and p != "1"]
            if state["pid_namespace"] and own_proc else [pid] if own_proc else [])
    ticks = sum(sum(map(int, fields[11:15]))   # utime, stime, cutime, cstime
                for fields in map(_proc_fields, pids) if fields)
    cpu_left = cfg["timeout_s"] - ticks / os.sysconf("SC_CLK_TCK")
    run_ns, wait_ns = map(int, (own_proc and _proc_fields(pid, "schedstat") or [0, 0])[:2])
    stretched = start + cfg["timeout_s"] + wait_ns / 1e9
    if run_ns == ran_ns and own_proc and (_proc_fields(pid) or ["?"])[0] == "R":
        stretched = max(stretched, now + 0.05)
    backstop = start + STRETCH_CAP * cfg["timeout_s"]

    if stretched <= now + 0.001:
        killed_for = "wall-clock limit"
    elif cpu_left <= 0:
        killed_for = "cpu-time limit"
    elif now >= backstop:
        killed_for = "wall-clock backstop"   # starved: it had time left
    else:
        return None, min(stretched, backstop, now + max(0.05, cpu_left / state["cores"])), run_ns

    _signal_everything(state, pid)
    return killed_for, now, run_ns


def _proc_fields(pid, name="stat"):
    """/proc/<pid>/<name>, split (of stat, the fields after the command's name: state first); None
    if gone. schedstat: ns on a CPU, ns waiting for one."""
    try:
        with open(f"/proc/{pid}/{name}") as f:
            return f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def _signal_everything(state, pid):
    """SIGKILL the main process and, from PID 1, everything in the namespace (the sweep reaps)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1 if state["pid_namespace"] else pid, signal.SIGKILL)


def _empty_dir(path, keep):
    for entry in os.scandir(path):
        if entry.path in keep:
            continue
        if any(_under(k, entry.path) for k in keep) and entry.is_dir(follow_symlinks=False):
            _empty_dir(entry.path, keep)
        else:
            _remove_tree(entry.path)


def _remove_tree(path):
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    try:
        shutil.rmtree(path)
    except OSError:
        # not root: the snippet may have made its own dirs 000; open them up (never through a link)
        os.chmod(path, 0o700)
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                if not os.path.islink(os.path.join(root, d)):
                    os.chmod(os.path.join(root, d), 0o700)
        shutil.rmtree(path, ignore_errors=True)


# -----------------------------------------------------------------------------
# the worker process. Messages are a 4-byte length and JSON (never pickle, whose reader runs code),
# over two pipes per worker: nothing to bind, nothing another process can reach.


def _send(fd, obj, deadline=math.inf):
    body = json.dumps(obj).encode()
    data = memoryview(struct.pack("<I", len(body)) + body)
    while data:   # a 1 MB snippet is more than a pipe holds: write what fits, wait for room
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:   # the parent's non-blocking end: a stuck worker cannot block it
            _poll(fd, select.POLLOUT, deadline)


def _receive(fd, deadline=math.inf):
    """One message; None at EOF."""
    header = _read_exact(fd, 4, deadline)
    body = header and _read_exact(fd, struct.unpack("<I", header)[0], deadline)
    return None if body is None else json.loads(body)


def _read_exact(fd, n, deadline):
    buf = bytearray()
    while len(buf) < n:
        _poll(fd, select.POLLIN, deadline)
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _poll(fd, event, deadline):
    poller = select.poll()   # not select.select: a trainer's fds easily pass its limit of 1024
    poller.register(fd, event)
    while not poller.poll(None if deadline == math.inf else
                          max(0.0, deadline - time.monotonic()) * 1000):
        if time.monotonic() >= deadline:
            raise WorkerGone("the worker did not answer in time")


# a worker's own call before it reports ready: the interpreter's files as a call sees them
SANDBOX_PROBE = """
import json, os, sys
def reached(path, dev, ino):
    st = os.stat(path) if os.path.exists(path) else None
    return st and (st.st_dev, st.st_ino) == (dev, ino) and os.access(path, os.R_OK | os.X_OK)
print(json.dumps([path for path, dev, ino in json.load(sys.stdin) if not reached(path, dev, ino)]))
"""


def _worker_main(cfg_json):
    """A worker's life. One whose sandbox cannot run calls says why in its first message."""
    cfg = json.loads(cfg_json)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a ^C in the terminal is for the trainer
    problem = None
    try:
        if cfg["kind"] == "grader":
            # trusted code on untrusted strings, in this process: no sandbox (a PID namespace's
            # init would even ignore the SIGXCPU that ends a check stuck in C code)
            sys.path.insert(0, cfg["repo"])
            grader = importlib.import_module("machinery.verifier")
            sys.path.remove(cfg["repo"])
            grader.warm_up()
            info = {"level": "none"}
        else:
            info, state = _start_worker(cfg)
            # a call must run and see the interpreter (generous: a loaded machine must not fail it)
            probe = _run_call(SANDBOX_PROBE, json.dumps(state["interpreter"]),
                              dict(cfg, timeout_s=max(cfg["timeout_s"], 30.0)), state)
            if probe["status"] != "ok":
                problem = f"a call failed ({probe['reason']}: {probe['stderr'][-1000:].strip()})"
            elif json.loads(probe["stdout"]):
                problem = f"the interpreter's files {probe['stdout'].strip()} are out of reach"
            if problem:
                problem += f"; isolation warnings: {'; '.join(state['warnings']) or 'none'}"
    except Exception as exc:   # a bug or an OS we do not know: the parent gets the reason
        info, problem = {}, f"{type(exc).__name__}: {exc}"
    _send(cfg["response_fd"], {"ready": not problem, "error": problem, "isolation": info})
    if problem:
        os._exit(EXIT_SETUP)

    # one request at a time; EOF: the parent closed the pipe or died (the namespace goes with us).
    # A grader answers a check itself: a fork per check costs ~4x its CPU (docs/benchmarks.md).
    while (request := _receive(cfg["request_fd"])) is not None:
        if cfg["kind"] == "grader":
            answer = grader.check_in_worker(request)
        else:
            answer = _run_call(request["code"], request["stdin"],
                               dict(cfg, timeout_s=request["timeout_s"]), state)
        _send(cfg["response_fd"], answer)
    os._exit(0)


def _start_worker(cfg):
    """Isolation, preloads and limits: (the isolation report, the state every child gets)."""
    # the prefixes and sys.path as real paths, before _isolate takes the paths to keep: a venv
    # reached through a link in /tmp or home would be imported through a link the sandbox removes
    prefixes = ("prefix", "base_prefix", "exec_prefix", "base_exec_prefix")
    for name in prefixes:
        setattr(sys, name, os.path.realpath(getattr(sys, name)))
    sys.path[:] = dict.fromkeys(os.path.realpath(p) if p else p for p in sys.path)
    # [path, st_dev, st_ino] of the interpreter and its own sys.path entries (not a .pth line into
    # the hidden repo) before any mount: the probe call must find each, not an empty cover
    own = [sys.executable] + [p for p in sys.path if p and os.path.isdir(p)
                              and any(_under(p, getattr(sys, q)) for q in prefixes)]
    interpreter = [[p, st.st_dev, st.st_ino] for p in own for st in [os.stat(p)]]

    info = _isolate(cfg)   # from here on PID 1 of the worker's namespaces (if the OS allowed them)
    for name in LIGHT_PRELOAD:
        __import__(name)
    if cfg["kind"] == "heavy":   # numpy and sympy: the project's own dependencies
        exec(HEAVY_WARMUP, {})
    # argv and an empty __main__ (the snippet's functions then pickle); a child's changes die
    sys.argv = [MAIN]
    main = types.ModuleType("__main__")
    main.__builtins__, main.__file__ = builtins, MAIN
    sys.modules["__main__"] = main
    # the first compile() in a process costs ~3 ms of parser set-up: paid here, not in every child
    compile("x = [i for i in range(3)]\nprint(x)\n", MAIN, "exec")

    # memory_mb is what a call may add: RLIMIT_AS counts the worker's mappings, which a child has
    vm_bytes = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    address_space = vm_bytes + (cfg["memory_mb"] << 20)
    cpu_s = math.ceil(cfg["timeout_s"]) + 1   # past the wall clock, so the clock's kill comes first
    nproc = cfg["max_processes"]   # without a uid of its own, NPROC counts all of ours
    if info["level"] == "process" and info["sandbox_uid"] is None:
        for name in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):   # gone meanwhile
                nproc += os.stat(f"/proc/{name}").st_uid == os.getuid()
    # Hard = soft, or nearly: code-judge and SandboxFusion set only soft limits, which the snippet
    # raises right back (docs/design.md, the sandbox's hostile inputs).
    rlimits = [(resource.RLIMIT_AS, address_space, address_space),  # bytearray(10**11): MemoryError
               (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),  # behind the clock: SIGXCPU, then KILL
               (resource.RLIMIT_NPROC, nproc, nproc),   # a fork bomb meets EAGAIN
               (resource.RLIMIT_FSIZE, cfg["max_file_mb"] << 20, cfg["max_file_mb"] << 20),
               (resource.RLIMIT_NOFILE, 256, 256),      # fd exhaustion stays in the child
               (resource.RLIMIT_CORE, 0, 0)]            # a segfault writes no core file
    state = dict(info, max_fd=resource.getrlimit(resource.RLIMIT_NOFILE)[0], rlimits=rlimits,
                 interpreter=interpreter, cores=len(os.sched_getaffinity(0)))
    info["preloaded_mb"] = vm_bytes >> 20
    if info["private_tmp"]:   # the call's directory is always the same: its environment too
        os.environ.update(HOME="/tmp/sandbox", TMPDIR="/tmp/sandbox")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)   # no setuid binary or file capability lifts a child back up
    return info, state


# -----------------------------------------------------------------------------
# this process's side: the worker handles


class WorkerGone(Exception):
    """The worker died or hung; it gets replaced. sent=False: before it had the call."""
    sent = True


# The worker loads this file under another module name: a script that imported us (`__main__`, say)
# never runs again.
_BOOT = ("import importlib.util, sys; "
         "spec = importlib.util.spec_from_file_location('rstar2_executor_worker', sys.argv[1]); "
         "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; "
         "spec.loader.exec_module(m); m._worker_main(sys.argv[2])")


class WorkerProcess:
    """One warm worker and its two pipes. One thread at a time uses it, holding `lock`."""

    def __init__(self, kind, settings):
        self.kind, self.settings, self.proc = kind, settings, None
        self.lock = threading.Lock()
        self.start()

    def start(self):
        # Popen, not fork: only exec leaves this process's threads (ours, vLLM's) behind cleanly.
        # start_new_session: a ^C in the terminal goes to the foreground group, not the workers.
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        cfg = dict(self.settings, kind=self.kind, request_fd=req_r, response_fd=resp_w)
        # the whole environment, built rather than scrubbed: /proc/<pid>/environ keeps what a
        # process was started with, so a secret deleted from os.environ later would still be there
        env = {"PATH": f"{os.path.dirname(_interpreter_path())}:/usr/local/bin:/usr/bin:/bin",
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "USER": "sandbox", "LOGNAME": "sandbox",
               "HOME": "/nonexistent",
               "PYTHONHASHSEED": "0",   # a set of strings in the same order on every rerun
               "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg",
               "PYTHONIOENCODING": "utf-8:surrogateescape",   # stdin and stdout as in UTF-8
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "NUMEXPR_NUM_THREADS": "1",
               "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": ""}

        self.proc = subprocess.Popen([_interpreter_path(), "-s", "-B", "-c", _BOOT,
                                      os.path.abspath(__file__), json.dumps(cfg)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     env=env, cwd="/", pass_fds=(req_r, resp_w),
                                     start_new_session=True)
        os.close(req_r)
        os.close(resp_w)
        os.set_blocking(self.req_w, False)
        self.isolation = None   # its first message

    def kill(self):
        """SIGKILL the waiter; PDEATHSIG then kills PID 1, and with it the whole namespace."""
        if self.proc is not None:
            self.proc.kill()

    def stop(self):
        """Kill, reap and close the pipes; only from the thread that uses this worker (an fd closed
        under a reader can come back as someone else's)."""
        if self.proc is not None:
            self.kill()
            self.proc.wait()
            os.close(self.req_w)
            os.close(self.resp_r)
            self.proc = None

    def restart(self):
        self.stop()
        self.start()

    def wait_ready(self):
        """The worker's isolation report, once it has started."""
        if self.isolation is None:
            message = self._receive(time.monotonic() + STARTUP_TIMEOUT_S)
            if not message["ready"]:   # not WorkerGone: a restart would fail the same way
                raise RuntimeError(f"Executor: the {self.kind} worker could not set up its "
                                   f"sandbox: {message['error']}")
            self.isolation = message["isolation"]
        return self.isolation

    def ready(self):
        """wait_ready under the lock."""
        with self.lock:
            try:
                return self.wait_ready()
            except WorkerGone as gone:
                raise RuntimeError(f"Executor: a {self.kind} worker failed to start ({gone})")

    def ask(self, request, timeout_s):
        """Send one request, return the worker's answer; WorkerGone past the backstop."""
        try:   # up to the write, a failure leaves the request unsent
            if self.proc.poll() is not None:
                raise WorkerGone("the worker is gone")
            self.wait_ready()
            _send(self.req_w, request, time.monotonic() + BACKSTOP_GRACE_S)
        except BrokenPipeError:
            raise WorkerGone("the worker is gone") from None
        except WorkerGone as e:
            e.sent = False
            raise
        return self._receive(time.monotonic() + STRETCH_CAP * timeout_s + BACKSTOP_GRACE_S)

    def _receive(self, deadline):
        message = _receive(self.resp_r, deadline)
        if message is None:
            raise WorkerGone(f"the worker exited (code {self.proc.poll()})")
        return message
