"""A run directory holds one run. rl.py and sft.py call claim_run_dir before they write anything and
finish_run_dir after their last write.

    config.yaml          the run's settings: its identity, and what a rerun continues with
    config_history.yaml  every start and finish in the directory, oldest first: when, at which
                         step, with which changes (a continued run's settings in full)
    run.lock             the one writer: pid, host and start time while a run holds it

A rerun with other settings is refused unless continue_with_changes=true says so; keys that do not
change what is trained (a script's KEYS_A_RESUME_MAY_CHANGE: steps, logging, worker counts ...) may
differ. Every other key counts, a key added later included. docs/design.md, "The run directory"."""
import atexit
import dataclasses
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist
import yaml

from machinery.checkpoint import check_fits, checkpoint_step, requested_checkpoint
from machinery.config import ConfigError, atomic_write_text, flatten_config, save_config
from machinery.metrics import check_logger_packages

LOCK_NAME = "run.lock"
HISTORY_NAME = "config_history.yaml"
HISTORY_HEADER = ("# Every start and finish of a run in this directory, oldest first "
                  "(machinery/run_dir.py).\n# config.yaml holds the newest settings: the ones a "
                  "rerun continues with.\n")
_HELD = {}  # run directory -> this process's locked file descriptor
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


def claim_run_dir(cfg, out_dir, free_keys, steps, export, rank):
    """Take out_dir for this run (rank 0 decides, every rank learns the outcome) and return its
    RunDir, or None when the run there is already at `steps` (and its `export`, e.g.
    "hf_step_{step}", exists): nothing to do. Refuses (ConfigError) a directory in use, another
    run's directory, or resume=never into a non-empty one; writes config.yaml and the history only
    once the run will run."""
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
    return RunDir(Path(out_dir), decision["checkpoint"], decision["keep_through"], rank)


def finish_run_dir(run_dir, step):
    """Record that the run finished at `step` (a rerun then says "already at step N") and let the
    directory go."""
    if run_dir.rank == 0:
        append_history(run_dir.path, {"event": "finished", "at_step": step, "time": _now()})
        release_lock(run_dir.path)


def _claim(cfg, out_dir, free_keys, steps, export):
    check_logger_packages(cfg.wandb_project, cfg.tensorboard)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        take_lock(out_dir)
    except OSError as e:  # a read-only filesystem, a directory of another user
        reason = "a read-only filesystem" if e.errno == errno.EROFS else e.strerror
        raise ConfigError(f"out_dir={out_dir}: cannot write there ({reason}: {e.filename}); "
                          "choose a writable out_dir") from None
    config_path = out_dir / "config.yaml"
    old = yaml.safe_load(config_path.read_text()) if config_path.is_file() else None
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
    save_config(cfg, out_dir)
    record = {"event": event, "at_step": at_step, "time": _now(), "host": socket.gethostname(),
              "pid": os.getpid(), "changes": {k: list(v) for k, v in changes.items()}}
    if event != "resumed":
        record["config"] = new
    append_history(out_dir, record)
    return {"done": False, "checkpoint": checkpoint, "keep_through": keep_through}


def _missing_ancestor(out_dir):
    """The outermost directory of out_dir's path that does not exist yet (None: it exists)."""
    missing = None
    for path in (out_dir, *out_dir.parents):
        if path.exists():
            return missing
        missing = path


def _unmake(out_dir, made):
    """Remove the directories _claim made, from out_dir up to `made`, if they hold nothing but
    the lock it took."""
    if made is None:
        return
    (out_dir / LOCK_NAME).unlink(missing_ok=True)
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
    path = Path(run_dir) / HISTORY_NAME
    if not path.is_file():
        return []
    try:
        return [event for event in yaml.safe_load_all(path.read_text()) if event]
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e}); fix or move it") from None


def append_history(run_dir, event):
    """Rewritten whole through a rename, so a crash leaves the old history, never half an event."""
    path = Path(run_dir) / HISTORY_NAME
    text = path.read_text() if path.is_file() else HISTORY_HEADER
    atomic_write_text(path, text + "---\n" + yaml.safe_dump(event, sort_keys=False))


def _now():
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


# -----------------------------------------------------------------------------
# the lock: flock(2), which the kernel releases when the holder dies, however it dies; the file's
# text says who holds it. (The filelock package truncates the file it locks, so it cannot carry
# that text, and it is no direct dependency.)

def take_lock(run_dir):
    """Lock run_dir for this process, or raise ConfigError naming the holder. A lock whose holder
    on this host died without letting go (SIGKILL) is taken over, with a message. One whose holder
    ran on another host is refused: where flock is node-local (Lustre's localflock, NFS with
    local_lock=flock, BeeGFS without global locks), a free flock says nothing about a run on
    another node, which may still be writing here."""
    path = Path(run_dir) / LOCK_NAME
    release_lock(run_dir)  # a process never waits for itself (an in-process rerun after an error)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"{run_dir} is in use by {_describe(holder)} ({path}); wait for that "
                          "run to end or stop it, or use another out_dir") from None
    except OSError as e:  # a filesystem without flock (some Lustre mounts): run, but say so
        print(f"WARNING: {path}: no lock on this filesystem ({e}); nothing stops a second run "
              "from writing into this directory at the same time", flush=True)
    if _holder_host(holder) not in (None, socket.gethostname()):
        os.close(fd)
        raise ConfigError(
            f"{run_dir} is held by {_describe(holder)} ({path}), another host, yet this host "
            "could lock it: either that run ended without releasing it (a lost node), or this "
            "filesystem's flock is node-local (Lustre localflock, NFS local_lock=flock) and it "
            "still runs. Check on that host; once no run uses this out_dir, empty the file "
            f"(: > {path}) and rerun, or use another out_dir")
    if holder:  # flock is free, so its holder on this host is gone; its text was never cleared
        print(f"{path}: taking over from {_describe(holder)}, which ended without releasing it "
              "(killed?)", flush=True)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": _now()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    if not _HELD:
        atexit.register(_release_all)  # an exit by exception or sys.exit leaves no stale text
    _HELD[str(Path(run_dir).resolve())] = fd


def release_lock(run_dir):
    fd = _HELD.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.ftruncate(fd, 0)  # never unlinked: a waiter could lock the old file, a third the new one
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _release_all():
    for run_dir in list(_HELD):
        release_lock(run_dir)


def _holder_host(holder):
    try:
        return json.loads(holder)["host"]
    except (ValueError, KeyError, TypeError):
        return None


def _describe(holder):
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']} since {info['since']}"
    except (ValueError, KeyError, TypeError):
        return "another process"
