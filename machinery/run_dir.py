"""A run directory holds one run (config.yaml: its settings; history.jsonl: every start and finish
with its changes; run.lock: the one writer). rl.py and sft.py claim_run_dir before they write,
record_start once their checkpoint has loaded, finish_run_dir after their last write. A rerun with
other settings is refused unless continue_with_changes=true: docs/design.md, "The run directory"."""
import contextlib
import dataclasses
import json
import os
import socket
from pathlib import Path

import torch.distributed as dist

from machinery.checkpoint import check_fits, checkpoint_step, requested_checkpoint
from machinery.config import (ConfigError, atomic_write_text, differing, flatten_config,
                              read_records, read_saved_config, save_config)
from machinery.lock import LOCK_NAME, hold_lease, release_lock, take_lock, timestamp
from machinery.metrics import check_logger_packages

HISTORY_NAME = "history.jsonl"
# RolloutConfig fields that change speed or memory, never what a sample is: free in every script
ROLLOUT_RESOURCE_FIELDS = ("gpu_memory_utilization", "cpu_kv_cache_gb", "tensor_parallel_size",
                           "enforce_eager", "enable_prefix_caching", "max_concurrency",
                           "sleep_level", "tool_workers")


@dataclasses.dataclass
class RunDir:
    path: Path
    checkpoint: Path | None  # where this run starts from (rank 0 chose it, every rank has it)
    keep_through: int  # checkpoints at or before it were saved under earlier settings: kept
    rank: int
    start_record: dict | None = None  # the history's record of this start (record_start)


def claim_run_dir(cfg, out_dir, free_keys, steps, export, rank):
    """Take out_dir for this run (rank 0 decides, every rank learns it): its RunDir, or None when
    the run there is already at `steps` and its `export` (e.g. "hf_step_{step}") exists. Refuses
    a directory in use, another run's, or resume=never into a non-empty one; writes the lock."""
    decision = None
    if rank == 0:
        # the outermost directory of out_dir's path that does not exist yet (None: it exists)
        made = next((p for p in [*reversed(Path(out_dir).parents), Path(out_dir)]
                     if not os.path.exists(p)), None)
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
    """config.yaml and the history's record of this start, once the checkpoint has loaded."""
    if run_dir.rank == 0 and run_dir.start_record is not None:
        save_config(cfg, run_dir.path)
        append_history(run_dir.path, {**run_dir.start_record, "time": timestamp()})


def finish_run_dir(run_dir, step):
    """Record that the run finished at `step` (a rerun says "already at step N"); let go."""
    if run_dir.rank == 0:
        hold_lease(run_dir.path)
        append_history(run_dir.path, {"event": "finished", "at_step": step, "time": timestamp()})
        release_lock(run_dir.path)


def _claim(cfg, out_dir, free_keys, steps, export):
    check_logger_packages(cfg.wandb_project, cfg.tensorboard)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        take_lock(out_dir)
    except OSError as e:  # a read-only filesystem, a directory of another user, a file
        raise ConfigError(f"out_dir={out_dir}: {e.strerror}: {e.filename}") from None

    # refuse a directory this run may not write into, before anything in it is touched
    old, entries = read_saved_config(out_dir), _results(out_dir)
    listed = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    if cfg.resume == "never" and entries:
        raise ConfigError(f"resume=never: {out_dir} already holds a run ({listed}); use a new one")
    if old is None and entries:
        raise ConfigError(f"out_dir={out_dir}: holds no config.yaml but {listed}; use a new one")
    if not entries:
        old = None  # a start that wrote nothing but its config: nothing of it to mix or to lose

    history = read_history(out_dir)
    new = dataclasses.asdict(cfg)
    changes = differing(flatten_config(old), flatten_config(new)) if old is not None else {}
    free_keys = {*free_keys, *(f"rollout.{name}" for name in ROLLOUT_RESOURCE_FIELDS)}
    method = {key: change for key, change in changes.items() if key not in free_keys}
    checkpoint = requested_checkpoint(cfg.resume, out_dir / "checkpoints")
    check_fits(checkpoint, cfg.model)
    at_step = checkpoint_step(checkpoint) if checkpoint is not None else 0
    if method and not cfg.continue_with_changes:
        differs = "; ".join(f"{key}: {a!r} -> {b!r}" for key, (a, b) in method.items())
        raise ConfigError(f"{out_dir}: holds a run with other settings ({differs}); use another "
                          f"out_dir, or continue_with_changes=true from step {at_step}")


    last = history[-1] if history else {}
    finished = last.get("at_step") if last.get("event") == "finished" else None
    if finished is not None and finished >= steps and (out_dir / export.format(
            step=finished)).exists():
        print(f"{out_dir}: already at step {finished} (steps={steps}); nothing written", flush=True)
        release_lock(out_dir)
        return {"done": True}
    event = ("new" if old is None else "continued_with_changes" if method else "resumed")
    since = [e.get("at_step", 0) for e in history
             if e.get("event") in ("new", "continued_with_changes")]
    keep_through = at_step if method else (since[-1] if since and old is not None else 0)
    record = {"event": event, "at_step": at_step, "time": None, "host": socket.gethostname(),
              "pid": os.getpid(), "changes": {k: list(v) for k, v in changes.items()}}
    if event != "resumed":
        record["config"] = new
    return {"done": False, "checkpoint": checkpoint, "keep_through": keep_through,
            "start_record": record}


def _unmake(out_dir, made):
    """Remove the directories _claim made (out_dir up to `made`) if they hold only its lock."""
    paths = [out_dir, *out_dir.parents]
    with contextlib.suppress(OSError):
        if made is not None:
            (out_dir / LOCK_NAME).unlink(missing_ok=True)
            for path in paths[:paths.index(made) + 1]:
                path.rmdir()


def _results(out_dir):
    """What runs wrote into out_dir (not bookkeeping, nor empty files or folders)."""
    bookkeeping = (LOCK_NAME, "config.yaml", HISTORY_NAME)
    return sorted(p.name for p in out_dir.iterdir() if p.name not in bookkeeping
                  and not (p.is_dir() and not any(p.iterdir()))
                  and not (p.is_file() and p.stat().st_size == 0))


def read_history(run_dir):
    """The history's events, oldest first; a torn last line is dropped with a warning."""
    return read_records(Path(run_dir) / HISTORY_NAME)


def append_history(run_dir, event):
    """Rewritten whole through a rename: a crash leaves the old history, a torn last line goes."""
    events = [*read_history(run_dir), event]
    atomic_write_text(Path(run_dir) / HISTORY_NAME, "".join(json.dumps(e) + "\n" for e in events))



