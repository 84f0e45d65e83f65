"""A run directory holds one run. rl.py and sft.py call claim_run_dir before they write anything,
record_start once the checkpoint they start from has loaded, and finish_run_dir after their last
write.

    config.yaml          the run's settings: its identity, and what a rerun continues with
    config_history.yaml  every start and finish in the directory, oldest first: when, at which
                         step, with which changes (a continued run's settings in full)
    run.lock             the one writer: pid, host, start time and its lease's last renewal
                         while a run holds it

A rerun with other settings is refused unless continue_with_changes=true says so; keys that do not
change what is trained (a script's KEYS_A_RESUME_MAY_CHANGE: steps, logging, worker counts ...) may
differ. Every other key counts, a key added later included. docs/design.md, "The run directory"."""
import atexit
import dataclasses
import errno
import fcntl
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import torch.distributed as dist
import yaml

from machinery.checkpoint import check_fits, checkpoint_step, requested_checkpoint
from machinery.config import (ConfigError, atomic_write_text, flatten_config, read_saved_config,
                              save_config, warn_torn)
from machinery.metrics import check_logger_packages

LOCK_NAME = "run.lock"
HISTORY_NAME = "config_history.yaml"
HISTORY_HEADER = ("# Every start and finish of a run in this directory, oldest first "
                  "(machinery/run_dir.py).\n# config.yaml holds the newest settings: the ones a "
                  "rerun continues with.\n")
_HELD = {}  # run directory -> (this process's locked file descriptor, its lease's renewal)
# RolloutConfig fields that change speed or memory, never what a sample is: free in every script
ROLLOUT_RESOURCE_FIELDS = ("gpu_memory_utilization", "cpu_kv_cache_gb", "tensor_parallel_size",
                           "enforce_eager", "enable_prefix_caching", "max_concurrency",
                           "sleep_level", "tool_workers")


@dataclasses.dataclass
class RunDir:
    path: Path
    checkpoint: Path | None  # where this run starts from (rank 0 chose it, every rank has it)
    # Checkpoints at or before this step were written under earlier settings (a continued run's
    # take-over point and before): rotation keeps them.
    keep_through: int
    rank: int
    # The history's record of this start, written with config.yaml once the run's checkpoint
    # has loaded (record_start): a refused or failed resume leaves both as they were.
    start_record: dict | None = None


def claim_run_dir(cfg, out_dir, free_keys, steps, export, rank):
    """Take out_dir for this run (rank 0 decides, every rank learns the outcome) and return its
    RunDir, or None when the run there is already at `steps` (and its `export`, e.g.
    "hf_step_{step}", exists): nothing to do. Refuses (ConfigError) a directory in use, another
    run's directory, or resume=never into a non-empty one. Writes nothing but the lock: config.yaml
    and the history follow once the checkpoint has loaded (record_start)."""
    decision = None
    if rank == 0:
        made = _missing_ancestor(Path(out_dir))
        try:
            decision = _claim(cfg, Path(out_dir), free_keys, steps, export)
        except ConfigError as e:
            release_lock(out_dir)
            _unmake(Path(out_dir), made)  # a refused start leaves no new directory behind
            decision = {"error": str(e)}
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [decision]
        dist.broadcast_object_list(box, src=0)
        decision = box[0]
    if "error" in decision:
        raise ConfigError(decision["error"])
    if decision["done"]:
        return None
    return RunDir(Path(out_dir), decision["checkpoint"], decision["keep_through"], rank,
                  decision["start_record"])


def record_start(run_dir, cfg):
    """config.yaml (the settings a rerun continues with) and the history's record of this start,
    once the run's checkpoint has loaded: a resume that fails to load changes neither."""
    if run_dir.rank == 0 and run_dir.start_record is not None:
        save_config(cfg, run_dir.path)
        append_history(run_dir.path, {**run_dir.start_record, "time": _now()})


def finish_run_dir(run_dir, step):
    """Record that the run finished at `step` (a rerun then says "already at step N") and let the
    directory go."""
    if run_dir.rank == 0:
        append_history(run_dir.path, {"event": "finished", "at_step": step, "time": _now()})
        release_lock(run_dir.path)


def _claim(cfg, out_dir, free_keys, steps, export):
    check_logger_packages(cfg.wandb_project, cfg.tensorboard)
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise ConfigError(f"out_dir={out_dir}: is a file, not a directory; choose a directory")
        out_dir.mkdir(parents=True, exist_ok=True)
        take_lock(out_dir)
    except OSError as e:  # a read-only filesystem, a directory of another user
        reason = "a read-only filesystem" if e.errno == errno.EROFS else e.strerror
        raise ConfigError(f"out_dir={out_dir}: cannot write there ({reason}: {e.filename}); "
                          "choose a writable out_dir") from None
    old = read_saved_config(out_dir)
    _check_owner(out_dir, old, cfg.resume)
    if not _results(out_dir):
        old = None  # a start that wrote nothing but its config: nothing of it to mix or to lose
    history = read_history(out_dir)
    new = dataclasses.asdict(cfg)
    changes = changed_settings(old, new) if old is not None else {}
    free_keys = {*free_keys, *(f"rollout.{name}" for name in ROLLOUT_RESOURCE_FIELDS)}
    method = {key: change for key, change in changes.items() if key not in free_keys}
    checkpoint = requested_checkpoint(cfg.resume, out_dir / "checkpoints")
    check_fits(checkpoint, cfg.model)
    at_step = checkpoint_step(checkpoint) if checkpoint is not None else 0
    if method and not cfg.continue_with_changes:
        raise ConfigError(_refusal(out_dir, method, at_step))
    finished = history[-1]["at_step"] if history and history[-1]["event"] == "finished" else None
    if finished is not None and finished >= steps and (out_dir / export.format(
            step=finished)).exists():
        print(f"{out_dir}: already at step {finished} (steps={steps}); nothing to train, nothing "
              "written. To train further, raise steps; for another run, use a new out_dir.",
              flush=True)
        release_lock(out_dir)
        return {"done": True}
    event = ("new" if old is None else "continued_with_changes" if method else "resumed")
    since = [e["at_step"] for e in history if e["event"] in ("new", "continued_with_changes")]
    keep_through = at_step if method else (since[-1] if since and old is not None else 0)
    record = {"event": event, "at_step": at_step, "time": None, "host": socket.gethostname(),
              "pid": os.getpid(), "changes": {k: list(v) for k, v in changes.items()}}
    if event != "resumed":
        record["config"] = new
    return {"done": False, "checkpoint": checkpoint, "keep_through": keep_through,
            "start_record": record}


def _missing_ancestor(out_dir):
    """The outermost directory of out_dir's path that does not exist yet (None: it exists)."""
    missing = None
    for path in (out_dir, *out_dir.parents):
        try:
            if path.exists():
                return missing
        except OSError:  # a name too long: no directory there (the claim then says why)
            pass
        missing = path


def _unmake(out_dir, made):
    """Remove the directories _claim made, from out_dir up to `made`, if they hold nothing but
    the lock it took."""
    if made is None:
        return
    try:
        (out_dir / LOCK_NAME).unlink(missing_ok=True)
    except OSError:  # out_dir is no directory (its parent is a file): nothing of it was made
        return
    for path in (out_dir, *out_dir.parents):
        try:
            path.rmdir()
        except OSError:
            return
        if path == made:
            return


def _check_owner(out_dir, old, resume):
    """Refuse a directory this run may not write into, before anything in it is touched."""
    entries = _results(out_dir)
    listed = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    if resume == "never" and entries:
        raise ConfigError(f"resume=never starts a new run, and {out_dir} already holds one "
                          f"({listed}); nothing was changed. Use a new out_dir, or move the old "
                          f"run away yourself (mv {out_dir} {out_dir}.old)")
    if old is None and entries:
        raise ConfigError(f"{out_dir} is not empty ({listed}) and holds no run (no config.yaml); "
                          "use a new or empty out_dir")


def _results(out_dir):
    """What runs wrote into out_dir besides the bookkeeping of this file (an empty metrics.jsonl
    or checkpoints/ included): what a new run must not mix with nor delete."""
    bookkeeping = (LOCK_NAME, "config.yaml", HISTORY_NAME)
    return sorted(p.name for p in out_dir.iterdir() if p.name not in bookkeeping
                  and not (p.is_dir() and not any(p.iterdir()))
                  and not (p.is_file() and p.stat().st_size == 0))


def changed_settings(old, new):
    """{dotted key: (old value, new value)} over both configs; a key one of them lacks (a key
    added to the code since) counts as changed."""
    old, new = flatten_config(old), flatten_config(new)
    missing = "(not set)"
    pairs = {key: (old.get(key, missing), new.get(key, missing)) for key in set(old) | set(new)}
    return {key: pair for key, pair in sorted(pairs.items()) if pair[0] != pair[1]}


def _refusal(out_dir, method, at_step):
    lines = "\n".join(f"  {key}: {old!r} -> {new!r}" for key, (old, new) in method.items())
    return (f"{out_dir} holds a run with other settings (its config.yaml; checkpoint at step "
            f"{at_step}). What differs, saved -> now:\n{lines}\n"
            "A run directory holds one run. Either start a new run elsewhere: out_dir=NEW_DIR, or "
            f"continue this one from step {at_step} with the new settings: "
            f"continue_with_changes=true (recorded in {out_dir / HISTORY_NAME})")


# -----------------------------------------------------------------------------
# the history

def read_history(run_dir):
    """The history's events, oldest first. A torn last event (a file cut short: no final newline,
    YAML that does not parse, or no event and at_step) is dropped with a warning, as a torn line
    of metrics.jsonl is (machinery.config.read_records); a bad event before it is an error."""
    path = Path(run_dir) / HISTORY_NAME
    if not path.is_file():
        return []
    text = path.read_text(errors="replace")
    documents, start = [], 0
    lines = text.splitlines(keepends=True)
    for number, line in enumerate(lines):
        if line.rstrip("\n") == "---":
            documents.append((start + 1, "".join(lines[start:number])))
            start = number + 1
    documents.append((start + 1, "".join(lines[start:])))
    events = []
    for index, (number, document) in enumerate(documents):
        last = index == len(documents) - 1
        try:
            event = yaml.safe_load(document)
        except yaml.YAMLError as e:
            event = e
        if event is None:  # the header's comments, an empty document
            continue
        whole = isinstance(event, dict) and {"event", "at_step"} <= set(event)
        if last and (not whole or not text.endswith("\n")):
            warn_torn(path, f"the {len(events)} events before it are kept")
            break
        if not whole:
            raise ConfigError(f"{path}:{number}: not a history event ("
                              f"{' '.join(str(event).split())[:200]}); fix or move it")
        events.append(event)
    return events


def append_history(run_dir, event):
    """Rewritten whole through a rename, so a crash leaves the old history, never half an event."""
    path = Path(run_dir) / HISTORY_NAME
    events = [*read_history(run_dir), event]  # a torn last event is left out, not kept inside
    atomic_write_text(path, HISTORY_HEADER + "".join(
        "---\n" + yaml.safe_dump(e, sort_keys=False) for e in events))


def _now():
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


# -----------------------------------------------------------------------------
# the lock: flock(2), which the kernel releases when the holder dies, however it dies, and a lease
# for where it does not reach: the file's text says who holds it, and its holder renews the text's
# timestamp every LEASE_RENEW_S. (The filelock package truncates the file it locks, so it cannot
# carry that text, and it is no direct dependency.)

# A lease not renewed for LEASE_S seconds is expired: its holder is gone, whatever host it ran on.
# A start that finds a fresh lease of another host watches it that long at most, so a requeue onto
# another host after a lost node waits up to LEASE_S; a live holder renews within LEASE_RENEW_S.
# Both compare the holder's clock with this host's: cluster clocks agree to a second (NTP).
LEASE_S = 300.0
LEASE_RENEW_S = 60.0
LEASE_POLL_S = 5.0  # how often a waiting start rereads the lease
LOCK_TEXT_BYTES = 256  # the text is padded to this, so a renewal overwrites it in place


def take_lock(run_dir):
    """Lock run_dir for this process, or raise ConfigError naming the holder. A lock held by a
    running process (flock says so) is refused. One whose flock is free, yet whose text names a
    holder, was left by a process that died without letting go (SIGKILL, a lost node): on this
    host it is taken over at once; from another host only once its lease has expired, since where
    flock is node-local (Lustre's localflock, NFS with local_lock=flock, BeeGFS without global
    locks) a free flock says nothing about a run on another node, which may still be writing here:
    a lease renewed while this start waits is refused."""
    path = Path(run_dir) / LOCK_NAME
    release_lock(run_dir)  # a process never waits for itself (an in-process rerun after an error)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    holder = _read_holder(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"{run_dir} is in use by {_describe(holder)} ({path}); wait for that "
                          "run to end or stop it, or use another out_dir") from None
    except OSError as e:  # a filesystem without flock (some Lustre mounts): run, but say so
        print(f"WARNING: {path}: no lock on this filesystem ({e}); nothing stops a second run "
              "from writing into this directory at the same time", flush=True)
    try:
        if holder and holder.get("host") not in (None, socket.gethostname()):
            holder = _wait_out_lease(fd, path, holder)
    except ConfigError:
        os.close(fd)
        raise
    if holder is not None:  # flock is free (and any lease expired): its holder is gone
        renewed = holder.get("renewed")
        expired = (f", its lease last renewed {time.time() - renewed:.0f} s ago"
                   if isinstance(renewed, (int, float)) else "")
        print(f"{path}: taking over from {_describe(holder)}{expired}, which ended without "
              "releasing it (killed? a lost node?)", flush=True)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": _now(),
          "renewed": time.time()}
    _write_holder(fd, me)
    stop = threading.Event()
    renewal = threading.Thread(target=_renew_lease, args=(fd, path, me, stop), daemon=True,
                               name="run.lock lease")
    renewal.start()
    if not _HELD:
        atexit.register(_release_all)  # an exit by exception or sys.exit leaves no stale text
    _HELD[os.path.realpath(run_dir)] = (fd, stop, renewal)


def release_lock(run_dir):
    held = _HELD.pop(os.path.realpath(run_dir), None)  # (Path.resolve raises on a symlink loop)
    if held is not None:
        fd, stop, renewal = held
        stop.set()
        renewal.join()  # before the descriptor closes: a late renewal would write to a reused one
        current = _read_holder(fd)
        if not current or _is_me(current):  # another host's text after a take-over stays
            os.ftruncate(fd, 0)  # never unlinked: a waiter could lock the old file, a third the new
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _release_all():
    for run_dir in list(_HELD):
        release_lock(run_dir)


def _wait_out_lease(fd, path, holder):
    """The holder of another host once its lease has expired (None if it let go meanwhile); a
    ConfigError if it renews it while this start watches."""
    renewed = holder.get("renewed")
    left = renewed + LEASE_S - time.time() if isinstance(renewed, (int, float)) else 0
    if left <= 0:
        return holder
    print(f"{path}: held by {_describe(holder)}, another host, whose lease was renewed "
          f"{time.time() - renewed:.0f} s ago; waiting up to {min(left, LEASE_S):.0f} s for it to "
          f"expire (a live run renews it every {LEASE_RENEW_S:.0f} s)", flush=True)
    deadline = time.monotonic() + min(left, LEASE_S)
    while time.monotonic() < deadline:
        time.sleep(min(LEASE_POLL_S, max(deadline - time.monotonic(), 0)))
        now = _read_holder(fd)
        if now is None:  # released meanwhile
            return None
        if now != holder:
            raise ConfigError(
                f"{path.parent} is in use by {_describe(now)} ({path}), on another host: it "
                "renewed its lease while this start waited, so it still runs (this filesystem's "
                "flock is node-local: Lustre localflock, NFS local_lock=flock). Wait for that run "
                "to end or stop it, or use another out_dir")
    return holder


def _renew_lease(fd, path, me, stop):
    """The holder's daemon thread: the lease's timestamp renewed every LEASE_RENEW_S. Finding
    another holder's text (this process was stopped or stalled past LEASE_S, and a start on
    another host took the directory over) it stops this process: one run writes a directory."""
    while not stop.wait(LEASE_RENEW_S):
        current = _read_holder(fd)
        if current and not _is_me(current):
            print(f"ERROR: {path}: taken over by {_describe(current)} while this process held it "
                  f"(its lease went unrenewed for over {LEASE_S:.0f} s: was it stopped or "
                  "stalled?); stopping, so that one run writes the directory", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        me["renewed"] = time.time()
        _write_holder(fd, me)


def _is_me(holder):
    return (holder.get("pid"), holder.get("host")) == (os.getpid(), socket.gethostname())


def _read_holder(fd):
    """The lock's text as a dict, None if empty; text that is no JSON object: {} (an unknown
    holder, on this host as far as anyone can tell)."""
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if not text:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _write_holder(fd, holder):
    """Overwritten in place, then cut to its length: a reader on another host never sees it empty
    (which would read as a free directory)."""
    text = (json.dumps(holder).ljust(LOCK_TEXT_BYTES - 1) + "\n").encode()
    os.pwrite(fd, text, 0)
    os.ftruncate(fd, len(text))


def _describe(holder):
    try:
        return f"pid {holder['pid']} on {holder['host']} since {holder['since']}"
    except (KeyError, TypeError):
        return "another process"
