"""A saved RL step again, offline: its selection, advantages and update (rl.py's phases 4-7) rerun
on the trajectories the run saved, from the weights that sampled them, under this config; no
engine, no tool, nothing written. RoC rules, losses or corrections compared on the same data.

    python -m tools.replay configs/tiny.yaml replay_step=1 positive_rule=topk
    torchrun --nproc_per_node=2 -m tools.replay configs/tiny.yaml    # the newest saved step

The config is the run's (rl.py's keys, out_dir the run directory) plus the replay_* keys below.
Unchanged, a replay reproduces the live step exactly (docs/design.md, Saved rollouts).
"""
import dataclasses
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from rl import RLConfig, balance_blocks, learn, select_samples
from rollout import Trajectory
from machinery.config import ConfigError, load_config, resolve
from machinery.distributed import cpu_threads, init_distributed
from machinery.exits import is_main_rank, run_script
from machinery.metrics import step_metrics
from machinery.model import check_model_dir
from machinery.saved_rollouts import kept_statistics, print_replay, read_rollouts, replay_policy
from machinery.threads import recorded_train_threads
from machinery.training import collate, equal_micro_batches, token_logprobs


@dataclasses.dataclass
class ReplayConfig(RLConfig):
    """rl.py's config (the run's own, with what the replay changes) and which step to replay."""
    replay_step: int = 0          # the saved step (as in metrics.jsonl); 0 = the newest
    replay_weights: str = ""      # "": those that sampled it (exact); or a checkpoint / HF dir
    replay_update_effect: bool = False  # also the kept tokens' log-prob change the update made


def replay(cfg):
    """Select, compute advantages and update once on saved step replay_step of out_dir, with the
    weights that sampled it; print the live step's numbers beside the replay's. Returns (rank 0)
    its metrics and kept trajectories {(stream position, sample_index): advantage}."""
    started = time.perf_counter()
    rank, world_size, _, device = init_distributed(cfg.collective_timeout_min)
    for line in cfg.inert_keys() if is_main_rank() else []:
        print(f"tools.replay: {line}", flush=True)
    run_dir = resolve(cfg.out_dir)
    number, meta, saved = read_rollouts(run_dir, cfg.replay_step, rank, world_size)
    step, position = number - 1, meta["data_position"]
    groups, rewards = saved_groups(saved, meta, cfg)
    model, optimizer, source = replay_policy(cfg, run_dir, number, device, rank)
    tokenizer = AutoTokenizer.from_pretrained(check_model_dir(cfg.model))
    pad_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    loaded = time.perf_counter()
    # steps 4-7 as rl_step runs them, on its CPU threads: train_threads, else the run's own count
    cpu_threads(cfg.train_threads or recorded_train_threads(run_dir) or 1, device)
    samples, probes, records = select_samples(groups, rewards, cfg, step, position)
    blocks = balance_blocks(samples, cfg, {})
    mine = [s for block in blocks for s in block]
    train_metrics, skipped, gap = learn(model, optimizer, blocks, probes, cfg, step, pad_id,
                                        device, {})
    effect = (update_effect(model, mine, cfg, pad_id, device) if cfg.replay_update_effect
              else {})
    kept = {(position + s.problem_index, s.sample_index): s.advantage for s in samples}
    parts = [None] * world_size if rank == 0 else None
    dist.gather_object((records, kept, len(groups)), parts, dst=0)
    if rank != 0:
        return None
    metrics = step_metrics([r for part in parts for r in part[0]], sum(p[2] for p in parts))
    metrics.update({**train_metrics, **gap, **effect, "skipped_updates": skipped})
    kept = {key: a for part in parts for key, a in part[1].items()}
    live_records = read_rollouts(run_dir, number)[2]
    live_kept = {(r["position"], r["sample_index"]) for r in live_records if r["selected"]}
    seconds = {"load": loaded - started, "steps 4-7": time.perf_counter() - loaded}
    # what the rule chose: the kept set live and replayed, and how much of it is the same
    live, replayed = (kept_statistics(live_records),
                      kept_statistics([r for part in parts for r in part[0]]))
    replayed["kept/overlap_with_live"] = len(set(kept) & live_kept) / max(len(live_kept), 1)
    print_replay(cfg, run_dir, number, meta, source, metrics, train_metrics, kept, live_kept,
                 seconds, world_size, {k: (live.get(k, 1.0), v) for k, v in replayed.items()})
    return SimpleNamespace(metrics=metrics, kept=kept)


def saved_groups(records, meta, cfg):
    """Saved records -> (groups of rollout.Trajectory, their rewards), as rl.roll_out and
    rl.score_groups gave them."""
    fields = {f.name for f in dataclasses.fields(Trajectory)}
    groups, rewards = {}, {}
    for r in records:
        groups.setdefault(r["problem_index"], []).append(
            Trajectory(**{k: v for k, v in r.items() if k in fields}))
        rewards.setdefault(r["problem_index"], []).append(r["reward"])
    saved, wanted = meta["rollouts_per_prompt"], cfg.rollouts_per_prompt
    # plain GRPO thins more rollouts uniformly, as if it had sampled G (grpo_roc.select_group)
    if saved < wanted or (saved > wanted and cfg.algorithm != "grpo"):
        raise ConfigError(f"group_size={cfg.group_size}: the saved step has {saved} rollouts per "
                          f"prompt, algorithm={cfg.algorithm} needs {wanted}; or algorithm=grpo")
    return [groups[i] for i in sorted(groups)], [rewards[i] for i in sorted(groups)]


@torch.no_grad()
def update_effect(model, samples, cfg, pad_id, device):
    """replay_update_effect: the mean log-prob change the update made on the positives' and the
    negatives' trained tokens, over all ranks."""
    sums = torch.zeros(4, dtype=torch.float64)  # change and count, positives then negatives
    for batch in equal_micro_batches(samples, cfg):
        input_ids, old, mask, advantages, _ = collate(batch, pad_id, device)
        change = (token_logprobs(model, input_ids, cfg.rollout.temperature,
                                 cfg.logprob_chunk_tokens) - old).double().cpu() * mask.cpu()
        for side, rows in enumerate((advantages.cpu() > 0, advantages.cpu() < 0)):
            sums[2 * side] += change[rows].sum()
            sums[2 * side + 1] += mask.cpu()[rows].sum()
    dist.all_reduce(sums)
    return {"replay/logprob_change_positives": (sums[0] / sums[1].clamp(min=1)).item(),
            "replay/logprob_change_negatives": (sums[2] / sums[3].clamp(min=1)).item()}


if __name__ == "__main__":
    run_script("tools.replay", lambda argv: load_config(ReplayConfig, argv, doc=__doc__),
               replay, lambda cfg, argv: "tools.replay: interrupted")  # it writes nothing
