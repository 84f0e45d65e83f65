"""One writer per directory (a run's out_dir, eval.py's): run.lock, held with flock(2), which the
kernel releases however its holder dies, and, where flock is node-local (Lustre localflock, NFS
local_lock=flock), as a lease: the text names the holder and its last renewal. The holder renews
it from its own progress (hold_lease: each logged row, commit, eval's samples), not a thread, so a
stuck holder loses it to a requeue on another host; the same call fences a holder whose lease was
taken over before it logs, commits or rotates. docs/design.md, "The run directory"."""
import atexit
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from machinery.config import ConfigError

LOCK_NAME = "run.lock"
# A lease not renewed for LEASE_S seconds is expired: another host may take the directory over.
# Both sides compare the holder's clock with their own: cluster clocks agree to a second (NTP).
LEASE_S = 300.0
LEASE_RENEW_S = 60.0  # hold_lease writes at most this often; a call in between reads a clock
# Quiet for longer than LEASE_S - LEASE_MARGIN_S, the holder takes its lease again as a start does
# (_settle): the margin covers the clocks' skew and the write a fenced call then finishes.
LEASE_MARGIN_S = 30.0
LEASE_POLL_S = 5.0  # how often a waiting start rereads the lease
# Taking an expired lease, a start writes its text, waits SETTLE_S and reads it back: a holder that
# renewed in between wins (Fischer's timed mutual exclusion; each side writes right after it reads).
SETTLE_S = 5.0
LOCK_TEXT_BYTES = 256  # the text is padded to this, so a renewal overwrites it in place
_HELD = {}  # directory's real path -> (this process's locked descriptor, the text it wrote)


def take_lock(directory):
    """Lock `directory` for this process, or raise ConfigError naming the holder. A free flock
    whose text names a holder was left by a process that died (on this host: taken over at once)
    or by a run on another host (taken over once its lease expires; renewed meanwhile: refused)."""
    path = Path(directory) / LOCK_NAME
    release_lock(directory)  # a process never waits for itself (an in-process rerun after an error)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    holder = _read_holder(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"{directory} is in use by {_describe(holder)} ({path}); wait for it to "
                          "end or stop it, or use another out_dir") from None
    except OSError as e:  # a filesystem without flock (some Lustre mounts): run, but say so
        print(f"WARNING: {path}: no lock on this filesystem ({e}); nothing stops a second run "
              "from writing here at the same time", flush=True)

    try:
        elsewhere = holder and holder.get("host") not in (None, socket.gethostname())
        if elsewhere:
            holder = _wait_out_lease(fd, path, holder)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": _now(),
              "renewed": time.time()}
        if elsewhere and holder is not None:  # another host's expired lease: taken with care
            _settle(fd, path, me)
        else:
            _write_holder(fd, me)
    except ConfigError:
        os.close(fd)
        raise
    if holder is not None:  # flock is free and any lease expired: its holder is gone
        print(f"{path}: taking over from {_describe(holder)}, which ended without releasing it "
              "(killed? a lost node?)", flush=True)
    if not _HELD:
        atexit.register(_release_all)  # an exit by exception or sys.exit leaves no stale text
    _HELD[os.path.realpath(directory)] = (fd, me)


def hold_lease(directory):
    """The renewal and the fence, before each of the holder's writes: a ConfigError if another
    start took the directory over; a lease this process let expire (a long phase, a stall) is taken
    again as a start takes one. Nothing for a directory this process does not hold."""
    held = _HELD.get(os.path.realpath(directory))
    if held is None:
        return
    fd, me = held
    quiet = time.time() - me["renewed"]
    if quiet < LEASE_RENEW_S:  # nobody takes a lease before LEASE_S: no need to read it
        return
    path = Path(directory) / LOCK_NAME
    current = _read_holder(fd)
    if current != me:
        raise ConfigError(f"{path}: taken over by {_describe(current)} after this run renewed its "
                          f"lease {quiet:.0f} s ago; this run stops writing {directory}")
    me["renewed"] = time.time()
    if quiet > LEASE_S - LEASE_MARGIN_S:
        _settle(fd, path, me)
    else:
        _write_holder(fd, me)


def release_lock(directory):
    held = _HELD.pop(os.path.realpath(directory), None)  # (Path.resolve raises on a symlink loop)
    if held is not None:
        fd, me = held
        if _read_holder(fd) in (None, me):  # another host's text after a take-over stays
            os.ftruncate(fd, 0)  # never unlinked: a waiter could lock the old file, a third the new
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _release_all():
    for directory in list(_HELD):
        release_lock(directory)


def _wait_out_lease(fd, path, holder):
    """Another host's holder once its lease expired (None: it let go); renewed meanwhile, refused"""
    renewed = holder.get("renewed")
    left = renewed + LEASE_S - time.time() if isinstance(renewed, (int, float)) else 0
    if left <= 0:
        return holder
    left = min(left, LEASE_S)
    print(f"{path}: held by {_describe(holder)} on another host, its lease renewed "
          f"{time.time() - renewed:.0f} s ago; waiting up to {left:.0f} s for it to expire",
          flush=True)
    deadline = time.monotonic() + left
    while time.monotonic() < deadline:
        time.sleep(min(LEASE_POLL_S, max(deadline - time.monotonic(), 0)))
        now = _read_holder(fd)
        if now is None:  # released meanwhile
            return None
        if now != holder:
            raise ConfigError(f"{path.parent} is in use by {_describe(now)} ({path}): it renewed "
                              "its lease while this start waited; wait for it to end or stop it, "
                              "or use another out_dir")
    return holder


def _settle(fd, path, me):
    """Take an expired lease: write `me`, wait SETTLE_S, read it back: a rival's text won."""
    _write_holder(fd, me)
    time.sleep(SETTLE_S)
    current = _read_holder(fd)
    if current != me:
        raise ConfigError(f"{path.parent} is in use by {_describe(current)} ({path}): it took the "
                          "expired lease at the same time; wait for it to end or stop it")


def _read_holder(fd):
    """The lock's text as a dict, None if empty, {} if no JSON object (an unknown holder)."""
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not text:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _write_holder(fd, holder):
    """In place, then cut: a reader on another host never sees it empty (a free directory)."""
    text = (json.dumps(holder).ljust(LOCK_TEXT_BYTES - 1) + "\n").encode()
    os.pwrite(fd, text, 0)
    os.ftruncate(fd, len(text))


def _describe(holder):
    try:
        return f"pid {holder['pid']} on {holder['host']} since {holder['since']}"
    except (KeyError, TypeError):
        return "another process"


def _now():
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")
