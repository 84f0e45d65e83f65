"""Saved rollouts: an RL step's trajectories as gzip-compressed JSONL under the run directory, to
read what the model wrote (tools/trajectories.py) and to replay the step offline (tools/replay.py).
The format, field by field: docs/design.md (Saved rollouts).

    RUN/rollouts/step_00000012/rank_00000.jsonl.gz   one JSON object per trajectory, this rank's
    RUN/rollouts/step_00000012/step.json              written last: the step is complete

Step N's rollouts were sampled by the weights of checkpoints/step_{N-1} (the initial policy for
N = 1). Every rank writes the groups it rolled out; a step without step.json is never read.
"""
import dataclasses
import gzip
import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from machinery.checkpoint import (CHECKPOINT_PREFIX, load_policy, load_training_state,
                                  load_weights, start_checkpoint)
from machinery.config import (ConfigError, atomic_write_text, flatten_config, read_records,
                              resolve, warn_torn)

ROLLOUTS_DIR = "rollouts"
STEP_PREFIX = "step_"
STEP_FILE = "step.json"
# The fields of rollout.Trajectory a record carries under the same names, the token lists last
TRAJECTORY_FIELDS = ("problem_index", "sample_index", "response_text", "model_text", "tool_calls",
                     "num_tool_calls", "num_tool_errors", "tool_errors_by_kind", "num_answer_tags",
                     "num_turns", "finished", "truncated", "stop_reason", "prompt_ids",
                     "response_ids", "loss_mask", "logprobs")


def step_dir(run_dir, step):
    return Path(run_dir) / ROLLOUTS_DIR / f"{STEP_PREFIX}{step:08d}"


def rollout_record(trajectory, row, reward, penalty, selected, advantage, step, data_position):
    """One line of the file: what a reader wants first, then the trajectory's own fields. `row`:
    its train_data row; `advantage` None where it was not kept."""
    t = trajectory
    head = {"step": step, "data_position": data_position,
            "position": data_position + t.problem_index,  # in the run's endless shuffled stream
            "id": row.get("id"), "problem_text": row["problem"], "answer": row.get("answer"),
            "reward": reward, "penalty": penalty, "selected": selected, "advantage": advantage,
            "prompt_tokens": len(t.prompt_ids), "response_tokens": len(t.response_ids),
            "model_tokens": sum(t.loss_mask),
            "logprob_sum": sum(lp for lp, m in zip(t.logprobs, t.loss_mask) if m)}
    return {**head, **{name: getattr(t, name) for name in TRAJECTORY_FIELDS}}


def save_rollouts(run, step, position, rows, groups, rewards, records, samples):
    """rl.py's step 4, kept: this rank's trajectories with reward, penalty, selection and
    advantage, as saved rollouts (steps 1, 1 + save_rollouts_every, ...), and the first
    log_samples to W&B and TensorBoard. `records`: select_samples'."""
    cfg = run.cfg
    # the same on every rank (write_rollouts is collective); the table: rank 0's logger only
    saving = cfg.save_rollouts_every and step % cfg.save_rollouts_every == 0
    table = cfg.log_samples and (run.logger.wandb or run.logger.tb)
    if not (saving or table):
        return

    advantages = {(s.problem_index, s.sample_index): s.advantage for s in samples}
    flat = [(t, reward) for group, group_rewards in zip(groups, rewards)
            for t, reward in zip(group, group_rewards)]
    lines = [rollout_record(t, rows[t.problem_index], reward, record["penalty"],
                            record["selected"], advantages.get((t.problem_index, t.sample_index)),
                            step + 1, position)
             for (t, reward), record in zip(flat, records)]

    if saving:
        meta = {"data_position": position, "rollouts_per_prompt": cfg.rollouts_per_prompt,
                "config": dataclasses.asdict(cfg)}
        write_rollouts(run.out_dir, step + 1, lines, meta, keep=cfg.keep_rollouts)
        if dist.get_rank() == 0 and (why := not_replayable(cfg, step + 1)):
            print(f"saved rollouts of step {step + 1}: they will not replay exactly: {why}",
                  flush=True)
    if table:
        run.logger.log_samples(step + 1, lines[:cfg.log_samples])


def not_replayable(cfg, step):
    """Why saved step `step` will not replay exactly once this run ends, or None: its sampling
    checkpoint step_{step - 1} must be saved and among the newest keep_checkpoints."""
    saves = [*range(cfg.save_every, cfg.steps, cfg.save_every), cfg.steps]
    if step == 1 or step - 1 in saves[-cfg.keep_checkpoints:]:
        return None
    if step - 1 not in saves:
        return f"no checkpoint is saved after step {step - 1} (save_every={cfg.save_every})"
    return (f"keep_checkpoints={cfg.keep_checkpoints} removes checkpoints/step_{step - 1} before "
            f"step {cfg.steps} (keep_checkpoints={len(saves) - saves.index(step - 1)} keeps it)")


def write_rollouts(run_dir, step, records, meta, keep=0):
    """Collective: every rank writes its records as rank_R.jsonl.gz (renamed into place); once all
    have, rank 0 writes step.json (`meta` and the rank count) and keeps the newest `keep`."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    folder = step_dir(run_dir, step)
    if rank == 0 and folder.exists():  # a rerun of this step after a resume writes it anew
        shutil.rmtree(folder)
    dist.barrier()

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank_{rank:05d}.jsonl.gz"
    tmp = path.with_name(f".{path.name}.tmp")
    # zlib's default level: 38% smaller than level 1 for 25% more time; 9 only 2% smaller at half
    # the speed
    with gzip.open(tmp, "wt", compresslevel=6) as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)
    dist.barrier()

    if rank == 0:
        atomic_write_text(folder / STEP_FILE,
                          json.dumps({"step": step, "ranks": world_size, **meta}, indent=1) + "\n")
        for old in saved_steps(run_dir)[:-keep]:  # keep=0: [:-0] is empty, all are kept
            shutil.rmtree(step_dir(run_dir, old), ignore_errors=True)
    dist.barrier()
    return folder


def saved_steps(run_dir):
    """The complete saved steps under run_dir, oldest first."""
    root = Path(run_dir) / ROLLOUTS_DIR
    return sorted(int(p.name[len(STEP_PREFIX):]) for p in (root.iterdir() if root.is_dir() else ())
                  if p.name.startswith(STEP_PREFIX) and step_meta(p) is not None)


def step_meta(folder):
    """A saved step's step.json, None where there is none or it is torn (with a warning)."""
    path = Path(folder) / STEP_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        warn_torn(path, "the step counts as not saved")
        return None


def chosen_steps(run_dir, value, key):
    """key=value -> the saved steps of run_dir it names: N (0: the newest), N,M,... or all."""
    saved, root = saved_steps(run_dir), Path(run_dir) / ROLLOUTS_DIR
    if not saved:
        raise ConfigError(f"{root}: no saved rollouts; run rl.py with save_rollouts_every=N")
    if str(value) == "all":
        return saved
    try:
        wanted = [int(part) or saved[-1] for part in str(value).split(",")]
    except ValueError:
        raise ConfigError(f"{key}={value!r}: a step (0: the newest), N,M,... or all") from None
    if missing := [step for step in wanted if step not in saved]:
        raise ConfigError(f"{key}={missing[0]}: not saved under {root} (saved: {saved})")
    return wanted


def rank_files(folder, meta, rank=0, world_size=1):
    """The rank files of a saved step, those of writers r with r % world_size == rank: a group is
    whole in its writer's file, so a reader on several ranks gets whole groups."""
    return [Path(folder) / f"rank_{writer:05d}.jsonl.gz"
            for writer in range(rank, meta["ranks"], world_size)]


def read_rollouts(run_dir, step=0, rank=0, world_size=1):
    """(step, its step.json, records) of saved step `step` (0: the newest), records sorted by
    (problem_index, sample_index); on several ranks, this rank's share (rank_files)."""
    [step] = chosen_steps(run_dir, step, "replay_step")
    meta = step_meta(step_dir(run_dir, step))
    records = [r for path in rank_files(step_dir(run_dir, step), meta, rank, world_size)
               for r in read_records(path)]
    records.sort(key=lambda r: (r["problem_index"], r["sample_index"]))
    return step, meta, records


# -----------------------------------------------------------------------------
# tools/replay.py: the weights a saved step was sampled with, and its report

def replay_policy(cfg, run_dir, number, device, rank):
    """(policy, optimizer, where they came from) as they were when step `number` began (the run's
    start, or checkpoints/step_{number - 1}); or replay_weights, which is not exact."""
    model, optimizer = load_policy(cfg, device, rank)
    if cfg.replay_weights:
        source = resolve(cfg.replay_weights)
        if (source / "COMPLETE").is_file():
            load_training_state(source, model, optimizer)
        elif (source / "config.json").is_file():
            model, optimizer = load_policy(dataclasses.replace(cfg, model=str(source)), device,
                                           rank)
        else:
            raise ConfigError(f"replay_weights={source}: not a checkpoint nor a model directory")
        return model, optimizer, f"{source} (replay_weights, not the step's own)"

    if number == 1:  # where a fresh run starts: no checkpoint of its own, resume=auto
        checkpoint, weights_only = start_checkpoint(dataclasses.replace(cfg, resume="auto"), None)
        if checkpoint is None:
            return model, optimizer, f"{cfg.model} (the initial policy)"
        (load_weights(checkpoint, model) if weights_only
         else load_training_state(checkpoint, model, optimizer))
        return model, optimizer, f"{checkpoint} (init_from, the initial policy)"

    checkpoint = run_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{number - 1:08d}"
    if not (checkpoint / "COMPLETE").is_file():
        exact = ",".join(map(str, replayable(run_dir, saved_steps(run_dir)))) or "none"
        raise ConfigError(f"{checkpoint}: missing; replay_step={exact} or set replay_weights=")
    load_training_state(checkpoint, model, optimizer)
    return model, optimizer, f"{checkpoint} (the weights that sampled it)"


def replayable(run_dir, steps):
    """Those of `steps` whose sampling weights are on disk, so that they replay exactly."""
    checkpoints = Path(run_dir) / "checkpoints"
    return [n for n in steps if n == 1 or (
        checkpoints / f"{CHECKPOINT_PREFIX}{n - 1:08d}" / "COMPLETE").is_file()]


def print_replay(cfg, run_dir, number, meta, source, metrics, learner, kept, live_kept, seconds,
                 world_size, kept_rows):
    """The replay's numbers beside the live step's (metrics.jsonl), with what the config changed,
    then `kept_rows` {key: (live, replay)}: the kept set's statistics."""
    live_cfg, now = flatten_config(meta["config"]), flatten_config(dataclasses.asdict(cfg))
    ignored = ("mode", "replay_step", "replay_weights", "replay_update_effect")
    changed = [f"{k}: {live_cfg.get(k)} -> {v}" for k, v in now.items()
               if live_cfg.get(k) != v and k not in ignored]
    live = next((m for m in read_records(run_dir / "metrics.jsonl") if m.get("step") == number),
                {})
    print(f"replay of step {number}: {run_dir / 'rollouts'} ({metrics['trajectories']} "
          f"trajectories in {metrics['groups']} groups)\nweights: {source}\nchanged from the "
          f"live run: {'; '.join(changed) or 'nothing'}")
    keys = ("selected", "selected_reward_mean", "roc_penalty_kept_positives", *learner,
            "logprob_gap_mean", *(k for k in metrics if k.startswith("replay/")))
    # a replay/ number has no live counterpart
    rows = {k: (None if k.startswith("replay/") else live.get(k), metrics.get(k)) for k in keys}
    print(f"{'':34}{'live':>14}{'replay':>14}")
    for key, cells in {**rows, **kept_rows}.items():
        print(f"{key:34}" + "".join(f"{'-' if v is None else f'{v:.6g}':>14}" for v in cells))
    print(f"kept: {len(kept)} trajectories, {len(set(kept) & live_kept)} of them kept live too "
          f"(live kept {len(live_kept)})\nreplayed on {world_size} rank(s): "
          + ", ".join(f"{phase} {s:.1f} s" for phase, s in seconds.items()), flush=True)


def kept_statistics(records):
    """Per side of the kept set (positives: reward > 0): the mean response tokens, tool calls and
    penalty, and the pooled tool-error ratio; None where there is nothing to measure. `records`:
    saved ones or rl.select_samples' (counts as tool_calls, tool_errors)."""
    out = {}
    for side, correct in (("positives", True), ("negatives", False)):
        kept = [r for r in records if r["selected"] and (r["reward"] > 0) == correct]
        calls = [r.get("num_tool_calls", r.get("tool_calls")) for r in kept]
        errors = sum(r.get("num_tool_errors", r.get("tool_errors")) for r in kept)
        out[f"kept/{side}/response_tokens"] = mean([r["response_tokens"] for r in kept])
        out[f"kept/{side}/tool_calls"] = mean(calls)
        out[f"kept/{side}/tool_error_ratio"] = errors / sum(calls) if sum(calls) else None
        out[f"kept/{side}/penalty"] = mean([r["penalty"] for r in kept])
    return out


def mean(values):
    return sum(values) / len(values) if values else None
