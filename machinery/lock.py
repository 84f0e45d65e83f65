"""One writer per directory: run.lock, held with flock(2) and, where flock is node-local (Lustre
localflock, NFS local_lock=flock), as a lease the holder renews from its own progress (hold_lease),
so a stuck holder loses it to a requeue on another host (docs/design.md, "The run directory")."""
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
    """Lock `directory` for this process, or raise ConfigError naming the holder. A free flock with
    a holder's text was left by one that died: taken over at once, or once its lease expires."""
    path = Path(directory) / LOCK_NAME
    release_lock(directory)  # a process never waits for itself (an in-process rerun after an error)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    holder = _read_holder(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"{path}: in use by {_describe(holder)}; stop it or use another out_dir")
    except OSError as e:  # a filesystem without flock (some Lustre mounts): run, but say so
        print(f"WARNING: {path}: no lock on this filesystem ({e})", flush=True)

    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": timestamp(),
          "renewed": time.time()}
    try:
        elsewhere = holder and holder.get("host") not in (None, me["host"])
        if elsewhere:
            holder = _wait_out_lease(fd, path, holder)
        if elsewhere and holder is not None:  # another host's expired lease: taken with care
            _settle(fd, path, me)
        else:
            _write_holder(fd, me)
    except ConfigError:
        os.close(fd)
        raise
    if holder is not None:  # flock is free and any lease expired: its holder is gone
        print(f"{path}: taking over from {_describe(holder)}, which ended", flush=True)
    if not _HELD:
        atexit.register(_release_all)  # an exit by exception or sys.exit leaves no stale text
    _HELD[os.path.realpath(directory)] = (fd, me)


def hold_lease(directory):
    """The renewal and the fence, before each of the holder's writes: a ConfigError if another
    start took the directory over; a lease this process let expire is taken again as starts do."""
    fd, me = _HELD.get(os.path.realpath(directory), (None, {"renewed": time.time()}))
    quiet = time.time() - me["renewed"]
    if quiet < LEASE_RENEW_S:  # not held, or nobody takes it before LEASE_S: no need to read it
        return
    path = Path(directory) / LOCK_NAME
    current = _read_holder(fd)
    if current != me:
        raise ConfigError(f"{path}: taken over by {_describe(current)}; this run stops writing")
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
    left = min(holder["renewed"] + LEASE_S - time.time(), LEASE_S)
    if left > 0:
        print(f"{path}: held by {_describe(holder)}; waiting {left:.0f} s", flush=True)
    deadline = time.monotonic() + left
    while time.monotonic() < deadline:
        time.sleep(min(LEASE_POLL_S, max(deadline - time.monotonic(), 0)))
        now = _read_holder(fd)
        if now != holder and now is not None:
            raise ConfigError(f"{path}: in use by {_describe(now)}: it renewed its lease; stop it")
        if now is None:  # released meanwhile
            return None
    return holder


def _settle(fd, path, me):
    """Take an expired lease: write `me`, wait SETTLE_S, read it back: a rival's text won."""
    _write_holder(fd, me)
    time.sleep(SETTLE_S)
    current = _read_holder(fd)
    if current != me:
        raise ConfigError(f"{path}: in use by {_describe(current)}; stop it or use another out_dir")



def _read_holder(fd):
    """The lock's text as a dict, None if empty, {} if no JSON (an unknown holder)."""
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    try:
        return json.loads(text) if text else None
    except ValueError:
        return {}


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


def timestamp():
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")
