"""Agentic RL with GRPO-RoC (rStar2-Agent, arXiv 2508.20722 §2.2, §4.3), one loop from one CPU
process to 64 GPUs.

    python rl.py configs/tiny.yaml                        # 1 CPU process (the tiny demo's RL stage)
    torchrun --standalone --nproc_per_node=8 --max-restarts=9 rl.py configs/stage1.yaml
    sbatch --nodes=8 --gpus-per-node=8 slurm/rl.sbatch configs/stage1.yaml   # 64 GPUs (README)
    python rl.py configs/stage1.yaml mode=plan            # memory, bytes, time of a step per rank

Every rank is a trainer and a rollout worker at once (colocated, as verl's hybrid engine): an
FSDP2 shard of the policy and its own vLLM engine. One RL step (rl_step), its phases below it:

    1. weight sync  the engine wakes and takes the trainer's weights, in memory
    2. rollouts     2G multi-turn trajectories per prompt with the Python tool (rollout.py, §3.2)
    3. rewards      0/1 on the final \\boxed{} answer, 0 if truncated (Eq. 3, §4.3.1; reward.py)
    4. selection    drop all-equal groups, Resample-on-Correct keeps G of 2G (§2.2.3; grpo_roc.py)
    5. balance      the kept trajectories spread across ranks by token count
    6. update       one optimizer step on the clipped token-level loss of Eq. 6 over the GLOBAL
                    token count (a no-grad pass for the old log-probs only with mini_batches > 1)
    7. sync guard   the trainer's log-probs of the sampled tokens against the engine's
    8. evaluate, log, checkpoint

Paper vs this file: docs/design.md; algorithm=grpo is the "GRPO with Tool" baseline (Fig. 9).
"""
import dataclasses
import math
import os
import sys
import time
from typing import Annotated, Literal

import numpy as np
import torch
import torch.distributed as dist
from annotated_types import Gt, Interval
from tqdm import tqdm

from executor import Executor
from grpo_roc import (ADVANTAGE_SCALINGS, LOSS_AGGREGATIONS, POSITIVE_RULES, RATIO_LEVELS,
                      ROLLOUT_CORRECTIONS, as_rollout, batch_reward_std, filter_groups,
                      group_advantages, loss_weights, policy_loss, roc_penalty,
                      rollout_correction, select_group)
from reward import extract_answer, grade_batch
from rollout import RolloutConfig, generate
from machinery import checkpoint, metrics, plan
from machinery.config import (ConfigError, NonNegativeFloat, NonNegativeInt, PositiveFloat,
                              PositiveInt, load_config, resolve)
from machinery.data import prompt_indices
from machinery.distributed import (balance_by_tokens, cores_per_rank, cpu_threads,
                                   free_cached_memory, full_weights, own_groups)
from machinery.engine import configure_vllm_logging
from machinery.exits import WHERE, reached, run_script, training_interrupted
from machinery.results import CHUNK_PROBLEMS
from machinery.rl_run import finish_rl_run, start_rl_run
from machinery.saved_rollouts import save_rollouts
from machinery.training import TrainSample, collate, equal_micro_batches, token_logprobs


# -----------------------------------------------------------------------------
# config: defaults are the paper's stage-1 values (§4.3, §5.1) where it gives one

@dataclasses.dataclass
class RLConfig:
    model: str = ""               # HF directory (or hub id) of the SFT policy, with its tokenizer
    train_data: str = "data/train_int_mix.jsonl"
    out_dir: str = "out/rl"
    mode: Literal["train", "plan"] = "train"  # plan: memory, bytes, time of a step; no training
    plan_model_config: str = ""   # mode=plan: the model's config.json when `model` is not on disk
    seed: int = 0
    world_size: NonNegativeInt = 0  # ranks mode=plan assumes (0: the launch's); any launch runs
    collective_timeout_min: PositiveInt = 30  # the most a rank waits at a collective
    heartbeat_min: float = 5.0    # no rank moving this long: a hang, every rank exits; 0 = off
    skip_prompts: list[int] = dataclasses.field(default_factory=list)  # ids a crash loop named
    # the method (§2.2.3, §4.3)
    algorithm: Literal["roc", "grpo"] = "roc"  # roc: 2G sampled, RoC keeps G; grpo: G, all kept
    group_size: int = 16          # G, rollouts per prompt that are trained on
    # paper: sample ~1/penalty; release: topk; shortest: fewest tokens (grpo_roc.POSITIVE_RULES)
    positive_rule: Literal[tuple(POSITIVE_RULES)] = "sample"
    roc_error_ratio: bool = True  # p_err (Eq. 4) in the positives' penalty
    roc_answer_format: bool = True  # p_format (Eq. 5) in the positives' penalty
    filter_all_equal: bool = True  # drop groups whose rewards are all equal (release: 20480/GPU)
    prompts_per_step: PositiveInt = 512
    steps: PositiveInt = 300      # total RL steps of this run (a resume continues up to it)
    clip_low: Annotated[float, Interval(ge=0, lt=1)] = 0.2
    clip_high: NonNegativeFloat = 0.28  # Clip-Higher; binds only with mini_batches > 1 (else
                                  # ratio = 1)
    dual_clip: float = 0.0        # 0 = off (paper); verl's default would be 3.0
    # the field's common variants (grpo_roc.py; docs/design.md's table), the paper's by default:
    advantage_scaling: Literal[ADVANTAGE_SCALINGS] = "group"  # batch: TRL's; none: Dr. GRPO
    loss_aggregation: Literal[LOSS_AGGREGATIONS] = "token_mean"  # Eq. 6; verl's loss_agg_mode
    ratio_level: Literal[RATIO_LEVELS] = "token"  # sequence: GSPO
    # weights for the engine-vs-trainer gap (Yao et al. 2025; grpo_roc.rollout_correction)
    rollout_correction: Literal[ROLLOUT_CORRECTIONS] = "none"
    rollout_is_threshold: Annotated[float, Gt(1)] = 2.0  # C: tis truncates weights at C; mis
                                  # drops those off [1/C, C]
    # optimizer: AdamW, constant lr after a linear warm-up (§5.1)
    lr: PositiveFloat = 1e-6
    warmup_steps: NonNegativeInt = 20
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0        # max global grad norm; 0 = no clipping (logged either way)
    mini_batches: PositiveInt = 1  # optimizer steps per RL step, each on 1/k of the kept rollouts
    # memory and speed; none of them changes the maths (tests/test_rl.py checks that)
    micro_batch_tokens: PositiveInt = 20480  # padded tokens a forward/backward (release: 20480/GPU)
    micro_batch_size: NonNegativeInt = 0  # trajectories per forward/backward; 0 = no cap
    train_dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    activation_checkpointing: bool = False
    logprob_chunk_tokens: NonNegativeInt = 1024  # output projection, so many tokens at once; 0: off
    attn_implementation: str = "sdpa"  # trainer attention (flash_attention_2 on GPU, if installed)
    # CPU only: torch threads for the update; 0 = the cores free at the start (machinery/threads.py;
    # the engine's decode takes one less with the tool on). config.yaml records the number chosen.
    train_threads: NonNegativeInt = 0
    logprob_gap_warn: float = 0.05  # sync guard: warn above this mean |trainer - engine| gap
    untrained_steps_warn: NonNegativeInt = 3  # warn: so many steps in a row train nothing; 0: never
    # checkpoints and logs
    save_every: PositiveInt = 10
    keep_checkpoints: PositiveInt = 2
    resume: str = "auto"          # auto: newest intact checkpoint in out_dir; never; a PATH
    # true: resume this out_dir's run with changed settings (history.jsonl records them);
    # false: a change of a key outside KEYS_A_RESUME_MAY_CHANGE is refused
    continue_with_changes: bool = False
    # with resume=auto and no checkpoint in out_dir yet, start from this checkpoint of another run
    init_from: str = ""
    # false: init_from's (fp32 master) weights only, a fresh AdamW from step 0: stage 3 (§4.3)
    init_optimizer: bool = True
    eval_data: str = ""           # held-out problems, scored every eval_every steps, 0, and last
    eval_every: NonNegativeInt = 0  # 0 = only at the start and the end (when eval_data is set)
    eval_at_start: bool = True    # false: the ablation measures only the end
    eval_samples: PositiveInt = 1  # rollouts per eval problem
    eval_temperature: float = 0.6  # the paper's evaluation temperature (§5.1)
    wandb_project: str = ""
    log_samples: NonNegativeInt = 8  # trajectories a step (rank 0's) to TensorBoard, W&B; 0: none
    tensorboard: bool = False
    # saved rollouts, what tools.replay reads: steps 1, 1+N, 1+2N, ... (0 = never); each replays
    # exactly while the checkpoint that sampled it is kept (N a multiple of save_every; the save
    # says when keep_checkpoints will remove it)
    save_rollouts_every: NonNegativeInt = 10
    keep_rollouts: NonNegativeInt = 0  # the newest this many saved steps stay on disk; 0 = all
    verbose: bool = False         # all of vLLM's logging; default: its warnings
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)

    @property
    def rollouts_per_prompt(self):
        """Sampled per prompt: 2G for GRPO-RoC, which keeps G of them (§2.2.3); G for GRPO."""
        return 2 * self.group_size if self.algorithm == "roc" else self.group_size

    def validate(self):
        """The method's keys, each wrong value refused in one line that names it, before anything
        is loaded; machinery.checkpoint.check_config then checks the paths, sizes and resume."""
        if self.group_size < 4 and self.algorithm == "roc":
            raise ConfigError(f"group_size={self.group_size}: GRPO-RoC keeps at least 2 positives "
                              "and 2 negatives per group (grpo_roc.resample_on_correct), so G must "
                              "be >= 4")
        if self.group_size < 2:
            raise ConfigError(f"group_size={self.group_size}: a group advantage needs at least 2 "
                              "rollouts (Eq. 7)")

        tool_wait = (20 * self.rollout.tool_timeout_s + 5) / 60  # executor.py: a call's longest
        if self.heartbeat_min and not tool_wait < self.heartbeat_min < self.collective_timeout_min:
            raise ConfigError(f"heartbeat_min={self.heartbeat_min}: must be 0 (off), over the "
                              f"longest tool call ({tool_wait:.2g}), under collective_timeout_min")
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip={self.dual_clip}: must be 0 (off) or > 1")

        if self.prompts_per_step % self.mini_batches:
            raise ConfigError(f"prompts_per_step={self.prompts_per_step} does not divide into "
                              f"mini_batches={self.mini_batches} optimizer steps of whole prompt "
                              "groups")

        checkpoint.check_config(self)

    def inert_keys(self):
        """A line per key set off its default that cannot act at these settings (docs/design.md)."""
        one_step = self.mini_batches == 1  # the ratio is exactly 1 (grpo_roc.policy_loss)
        roc_keys = "roc_error_ratio roc_answer_format"  # they only rank RoC's positives
        inert_at = {  # the setting: (whether it holds, the keys it leaves inert)
            "mini_batches=1": (one_step, "clip_low clip_high dual_clip"),
            "mini_batches=1 and no token_* rollout_correction": (
                one_step and not self.rollout_correction.startswith("token"), "ratio_level"),
            "positive_rule=shortest": (self.positive_rule == "shortest", roc_keys),
            "algorithm=grpo": (self.algorithm == "grpo", f"positive_rule {roc_keys}"),
            "rollout_correction=none": (self.rollout_correction == "none", "rollout_is_threshold")}
        default = type(self)()
        return list({key: f"{key}={getattr(self, key)} cannot act at {setting} (docs/design.md)"
                     for setting, (holds, keys) in inert_at.items() if holds
                     for key in keys.split() if getattr(self, key) != getattr(default, key)
                     }.values())  # one line per key, however many settings leave it inert


# Keys that do not change what is trained: a rerun into the same out_dir may change them (steps to
# train further, the cadence of saves and logs, how fast and in how much memory; the rollout's
# engine and tool sizes too). Any other key changed is another run (machinery/run_dir.py).
KEYS_A_RESUME_MAY_CHANGE = {
    "out_dir", "mode", "plan_model_config", "world_size", "collective_timeout_min", "steps",
    "heartbeat_min", "skip_prompts",
    "save_every", "keep_checkpoints", "resume", "continue_with_changes", "eval_every",
    "eval_at_start", "wandb_project", "tensorboard", "verbose", "micro_batch_tokens",
    "micro_batch_size", "activation_checkpointing", "logprob_chunk_tokens", "train_threads",
    "logprob_gap_warn"}


# -----------------------------------------------------------------------------
# one RL step, then its phases 1-8 in the order it runs them

def rl_step(run, step):
    """One RL step, the module docstring's phases 1-8; the step's metrics (on rank 0)."""
    cfg = run.cfg
    times, traffic = {}, {}  # this rank's seconds per phase, and the bytes it moved
    started = time.perf_counter()
    # The same prompts on every rank, from (seed, position) only; on disk (exits.crash_loop)
    position = run.state["data_position"]
    ids = [i for i in prompt_indices(len(run.problems), cfg.seed, position, cfg.prompts_per_step)
           if i not in cfg.skip_prompts]
    WHERE.update(step=step + 1, prompts=ids)

    # 1. Before every step, a fresh run's first too: one code path, checked by the sync guard (7)
    with metrics.timed(times, "weight_update"):
        sync_weights(run.engine, run.model, run.weight_dtype, traffic)  # wakes the engine

    # 2. Every rank's trajectories of the step's prompts
    rows = [run.problems[i] for i in ids]
    groups = roll_out(run, rows, step, times)
    run.engine.sleep()  # frees the KV cache and weights for the update (on CPU vLLM frees nothing)

    # 3-4. Rewards, then selection; every save_rollouts_every steps the step goes to disk
    with metrics.timed(times, "reward"):
        rewards, ungraded = score_groups(groups, rows)
    with metrics.timed(times, "selection"):
        samples, probes, records = select_samples(groups, rewards, cfg, step, position,
                                                  ungraded)
    with metrics.timed(times, "save_rollouts"):
        save_rollouts(run, step, position, rows, groups, rewards, records, samples)

    # 5-7. Balance, update, sync guard. The update runs on train_threads torch threads; cpu_threads
    # returns the count it replaced (the engine's), set back once the update is done.
    with metrics.timed(times, "balance"):
        blocks = balance_blocks(samples, cfg, traffic)
    engine_threads = cpu_threads(cfg.train_threads, run.device)
    learned = learn(run.model, run.optimizer, blocks, probes, cfg, step, run.pad_id, run.device,
                    times)
    cpu_threads(engine_threads, run.device)

    # 8. Evaluate when due, log, checkpoint
    return log_and_checkpoint(run, step, started, groups, blocks, records, learned, times,
                              traffic)


def sync_weights(engine, model, dtype, traffic=None):
    """Step 1: the trainer's weights into this rank's sleeping engine, in memory, in verl's order
    (fsdp_workers.rollout_mode): the engine's weights wake, take the trainer's (full_weights
    all-gathers the FSDP2 shards, cast to the engine's dtype), and only once that copy is freed
    does the KV cache, most of the GPU, wake: waking both first needed it while the training
    peak still held its own."""
    free_cached_memory()
    engine.wake_up(tags=["weights"])
    engine.update_weights(full_weights(model, dtype, traffic))
    free_cached_memory()
    engine.wake_up(tags=["kv_cache"])


def roll_out(run, rows, step, times):
    """Step 2: this rank's groups of 2G (or G) trajectories; times["rollout"], ["tool_busy"],
    ["generate"] (its own seconds, before it waits for the others). Every rank claims prompts from
    a shared counter as its engine has room (§3.2)."""
    busy_before = run.executor.busy_s if run.executor else 0.0
    with metrics.timed(times, "rollout"):
        groups = generate(run.engine, run.executor, run.tokenizer, [r["problem"] for r in rows],
                          run.cfg.rollouts_per_prompt, run.cfg.rollout, seed=run.cfg.seed,
                          step=step, times=times)
        groups = own_groups(groups, len(rows), run.rank)
    times["tool_busy"] = (run.executor.busy_s if run.executor else 0.0) - busy_before
    return groups


def score_groups(groups, rows):
    """Step 3: the rewards per group, and per group whether the verifier reached no verdict (0, yet
    not wrong: logged as `ungraded`). Each rank grades its own trajectories in its own verifier
    pool, so grading scales with the ranks (the paper offloads it to the tool service, §3.1)."""
    flat = [t for g in groups for t in g]
    flat_rewards, flat_ungraded = grade_batch([t.model_text for t in flat],
                                              [rows[t.problem_index]["answer"] for t in flat],
                                              [t.finished for t in flat])

    rewards, ungraded = [], []
    at = 0  # where each group starts in the flat list
    for g in groups:
        rewards.append(flat_rewards[at:at + len(g)])
        ungraded.append(flat_ungraded[at:at + len(g)])
        at += len(g)
    return rewards, ungraded


def select_samples(groups, rewards, cfg, step, position, ungraded=None):
    """Step 4: this rank's groups -> (samples to train on, probes, a record per sampled trajectory).
    Groups are complete on the rank that generated them, so selection needs no communication. Each
    group's RoC draw is seeded from (seed, step, the problem's position in the stream): the same on
    a rerun, whichever rank claimed the problem (timing decides, §3.2). A dropped (all-equal) group
    still gives one probe, never trained on but checked by the sync guard, which so never goes
    blind, even if all groups are dropped."""
    kept_groups, _ = filter_groups(rewards, enabled=cfg.filter_all_equal)
    scale = batch_reward_std(rewards) if cfg.advantage_scaling == "batch" else None
    samples, probes, records = [], [], []

    for g, (group, group_rewards) in enumerate(zip(groups, rewards)):
        # what a rule may read; the penalties only rank the positives (§2.2.3), never the reward
        rollouts = [as_rollout(t, r, cfg.roc_error_ratio, cfg.roc_answer_format)
                    for t, r in zip(group, group_rewards)]
        penalties = [r.penalty for r in rollouts]

        kept = []
        if g in kept_groups:
            rng = np.random.default_rng([cfg.seed, step, position + group[0].problem_index])
            kept = select_group(rollouts, cfg.group_size, rng, mode=cfg.algorithm,
                                positive_rule=cfg.positive_rule)
            # Eq. 7 over the G kept, not the 2G sampled
            for i, advantage in zip(kept, group_advantages([group_rewards[i] for i in kept],
                                                           cfg.advantage_scaling, scale)):
                samples.append(train_sample(group[i], advantage))
        else:  # advantage 0 and never trained: only the guard reads it
            probes.append(train_sample(group[0], 0.0))

        # one record per sampled trajectory: the step's metrics and the saved rollouts read them
        all_equal = max(group_rewards) == min(group_rewards)
        for i, (t, reward, penalty) in enumerate(zip(group, group_rewards, penalties)):
            records.append(dict(
                reward=reward, selected=i in kept, all_equal=all_equal, penalty=penalty,
                # p_format alone (Eq. 5), logged to see the answer format apart from tool errors
                format_penalty=roc_penalty(t.num_tool_calls, t.num_tool_errors, t.num_answer_tags,
                                           max(t.num_turns, 1), use_error_ratio=False),
                tool_calls=t.num_tool_calls, tool_errors=t.num_tool_errors,
                parse_errors=t.tool_errors_by_kind.get("parse", 0),
                errors_by_kind=dict(t.tool_errors_by_kind), response_tokens=len(t.response_ids),
                model_tokens=t.num_model_tokens, truncated=t.truncated, turns=t.num_turns,
                problem=position + t.problem_index,
                ungraded=bool(ungraded and ungraded[g][i])))
    return samples, probes, records


def train_sample(t, advantage):
    return TrainSample(t.prompt_ids, t.response_ids, t.loss_mask, advantage,
                       engine_logprobs=t.logprobs, problem_index=t.problem_index,
                       sample_index=t.sample_index)


def balance_blocks(samples, cfg, traffic):
    """Step 5: the kept trajectories in mini_batches blocks of whole prompt groups (one per
    optimizer step), each dealt across ranks by tokens: the update waits for its slowest rank."""
    blocks = [[s for s in samples
               if s.problem_index * cfg.mini_batches // cfg.prompts_per_step == b]
              for b in range(cfg.mini_batches)]
    balanced = [balance_by_tokens(block) for block in blocks]
    traffic["balance_received_bytes"] = traffic.get("balance_received_bytes", 0) + sum(
        moved["received_bytes"] + moved["keys_bytes"] for _, moved in balanced)
    return [share for share, _ in balanced]


def learn(model, optimizer, blocks, probes, cfg, step, pad_id, device, times):
    """Steps 6-7 on the balanced blocks, as rl_step and tools.replay both run them: (the update's
    metrics, blocks skipped, the sync guard's gap); times["old_logprobs"], ["train"],
    ["logprob_gap"]. The old log-probs need a pass of their own only with several optimizer steps;
    with one, the update's forward gives them, and the dropped groups' probes are read only when
    nothing was trained (the weights did not move), so that the sync guard never goes blind."""
    mine = [s for block in blocks for s in block]
    with metrics.timed(times, "old_logprobs"):
        if cfg.mini_batches > 1:
            recompute_logprobs(model, mine + probes, cfg, pad_id, device)

    with metrics.timed(times, "train"):
        updates = []
        for block in blocks:
            count = torch.tensor([len(block)])
            dist.all_reduce(count)
            if count.item() > 0:  # else every group of the block was all-equal (the release too)
                updates.append(train_step(model, optimizer, block, cfg, step, pad_id, device))
    skipped = len(blocks) - len(updates)

    # 7. The sync guard, two all-reduces (a sync point). With one optimizer step that trained on
    # nothing, no forward gave the probes their trainer log-probs: one pass of their own does.
    if skipped == cfg.mini_batches == 1:
        with metrics.timed(times, "old_logprobs"):
            recompute_logprobs(model, probes, cfg, pad_id, device)
    with metrics.timed(times, "logprob_gap"):
        gap = logprob_gap(mine + probes)

    train_metrics = {k: sum(u[k] for u in updates) / len(updates)
                     for k in (updates[0] if updates else {})}
    if updates:
        train_metrics["train_tokens"] = sum(u["train_tokens"] for u in updates)
    return train_metrics, skipped, gap


@torch.no_grad()
def recompute_logprobs(model, samples, cfg, pad_id, device):
    """The trainer's old log-probs under the current weights. The loss uses these, not the
    engine's, so the ratio of Eq. 6 starts at exactly 1 whatever the engine's numerics."""
    for batch in equal_micro_batches(samples, cfg):
        input_ids, *_ = collate(batch, pad_id, device)
        store_old_logprobs(batch, token_logprobs(model, input_ids, cfg.rollout.temperature,
                                                 cfg.logprob_chunk_tokens))


def train_step(model, optimizer, samples, cfg, step, pad_id, device):
    """Step 6: one optimizer step on this rank's samples; all ranks call it together.
    Eq. 6's loss is a sum over every model-written token of the GLOBAL batch (all micro-batches,
    all ranks) over that count: each micro-batch's token sum is divided by (global count / world
    size) and FSDP's mean over ranks restores the rest, so the gradient is the same however the
    batch is split (the invariance test). Samples without old log-probs take them from this
    forward, detached: before the optimizer step the weights are the ones they stand for."""
    world_size = dist.get_world_size()
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)

    totals = torch.tensor([float(sum(sum(s.loss_mask) for s in samples)), float(len(samples))])
    dist.all_reduce(totals)  # tokens and sequences (loss_aggregation) of the global batch
    global_tokens, global_sequences = totals.tolist()
    if global_tokens == 0:
        raise RuntimeError("train_step: the batch has no model-written token on any rank "
                           "(every loss mask is 0)")

    batches = equal_micro_batches(samples, cfg)
    per_batch = []  # each micro-batch's loss metrics, combined over all of them and all ranks
    num_tokens = global_tokens / world_size
    for batch in batches:
        # the loss mask is 1 on the model's own tokens, 0 on prompt, tool output and padding,
        # placed on the positions that predict them (machinery/training.py: collate)
        input_ids, old, mask, advantages, engine_logp = collate(batch, pad_id, device)
        logp, entropy = token_logprobs(model, input_ids, cfg.rollout.temperature,
                                       cfg.logprob_chunk_tokens, with_entropy=True)
        if all(s.old_logprobs is None for s in batch):
            old = store_old_logprobs(batch, logp.detach())
        weights, correction = rollout_correction(old, engine_logp, mask, cfg.rollout_correction,
                                                 cfg.rollout_is_threshold, num_tokens)
        weights = loss_weights(mask, cfg.loss_aggregation, num_tokens,
                               global_sequences / world_size, cfg.rollout.max_response_tokens,
                               weights)
        loss, loss_metrics = policy_loss(logp, old, advantages, mask, num_tokens, cfg.clip_low,
                                         cfg.clip_high, cfg.dual_clip or None, weights,
                                         cfg.ratio_level)
        loss_metrics.update(correction)
        loss.backward()  # accumulates; FSDP2 reduce-scatters (a mean over ranks) after each
        loss_metrics["loss"] = loss.detach()
        # the policy's token-mean entropy over the trained tokens (logged, never in the loss)
        loss_metrics["entropy"] = torch.where(mask, entropy, 0.0).sum() / num_tokens
        per_batch.append({k: v.detach().cpu() for k, v in loss_metrics.items()})

    # The global grad norm before clipping: a loss-scaling bug shows here even where AdamW hides it.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                               cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    # Freed now, not next step: the engine needs that memory for the sync and rollout (as verl)
    optimizer.zero_grad(set_to_none=True)

    out = metrics.global_metrics(per_batch, world_size)
    out.update(grad_norm=float(grad_norm), lr=lr_at(step, cfg), num_micro_batches=len(batches),
               train_tokens=int(global_tokens))
    return out


def lr_at(step, cfg):
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


def store_old_logprobs(batch, logp):
    """Set each sample's old_logprobs to its model-written span of the [B, T] `logp` (what
    collate gives the loss as Eq. 6's old log-probs, and the sync guard reads); returns logp."""
    rows = logp.cpu()
    for row, s in enumerate(batch):
        s.old_logprobs = rows[row, len(s.prompt_ids) - 1: len(s) - 1].tolist()
    return logp


def logprob_gap(samples):
    """Step 7, the sync guard: mean and max |trainer - engine| log-prob over every rank's
    model-written tokens. The engine sampled them with the weights just synced, so both agree up
    to kernel noise; a broken sync (wrong names, stale weights, wrong dtype) shows here at step 1,
    not as a slow, silent divergence."""
    total = 0.0  # |gap| summed over the tokens
    count = 0
    largest = 0.0
    for s in samples:
        if s.engine_logprobs is None or s.old_logprobs is None:  # not sampled, or not forwarded
            continue
        gap = np.abs(np.asarray(s.old_logprobs) - np.asarray(s.engine_logprobs))
        gap = gap[np.asarray(s.loss_mask) > 0]
        total += float(gap.sum())
        count += gap.size
        largest = max(largest, float(gap.max(initial=0.0)))

    sums = torch.tensor([total, count], dtype=torch.float64)
    largest = torch.tensor([largest])
    dist.all_reduce(sums)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return {"logprob_gap_mean": sums[0].item() / max(sums[1].item(), 1),
            "logprob_gap_max": largest.item()}


def log_and_checkpoint(run, step, started, groups, blocks, records, learned, times, traffic):
    """Step 8: the step's metrics, gathered on rank 0 (the phases' time/ keys add up to time/step;
    the checkpoint's and the evaluation's are apart), the evaluation when due, the row logged, and
    a checkpoint every save_every steps and at the last. A resume needs, besides weights and
    optimizer, the data position (whole steps): a rerun of a step draws the same tokens
    (rollout.request_seed seeds each request from seed, step, problem and sample)."""
    cfg = run.cfg
    train_metrics, skipped, gap = learned
    run.state = {"step": step + 1, "data_position": run.state["data_position"]
                 + cfg.prompts_per_step}

    local = dict(records=records, groups=len(groups), times=times, traffic=traffic,
                 rollout_tokens=sum(len(t.response_ids) for g in groups for t in g),
                 trained_tokens=sum(len(s) for block in blocks for s in block))
    learner = {**train_metrics, **gap, "skipped_updates": skipped,
               "data_position": run.state["data_position"]}
    gathering = time.perf_counter()
    row = metrics.gather_step_metrics(local, learner, step + 1, cfg.logprob_gap_warn)
    if run.rank == 0:
        ended = time.perf_counter()
        row["time/metrics"] = ended - gathering
        row["time/step"] = ended - started

    if run.eval_rows and (step + 1 == cfg.steps
                          or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
        row.update(evaluate_held_out(run))
        metrics.print_held_out(row, run.rank, f"after step {step + 1}")

    # logged before the commit: every step once (docs/design.md, Faults)
    written = None
    if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
        with metrics.timed(row, "time/checkpoint"):
            written = checkpoint.write_checkpoint(run.ckpt_root, step + 1, run.model,
                                                  run.optimizer, run.state)
    if run.rank == 0:
        run.logger.log(step + 1, row)
    if written:
        checkpoint.commit_checkpoint(written, keep=cfg.keep_checkpoints,
                                     keep_through=run.dir.keep_through)
    return row


def evaluate_held_out(run):
    """Held-out accuracy (eval/ metrics and time/eval) through the training engine, as eval.py
    measures it: eval_samples trajectories per problem at eval_temperature, the reward of Eq. 3."""
    cfg = run.cfg
    rows = run.eval_rows
    started = time.perf_counter()
    reached("eval")
    # The engine still holds the weights that sampled the last step, one update behind: the
    # evaluation scores the trained ones.
    sync_weights(run.engine, run.model, run.weight_dtype)
    # generate() sends the temperature with every request: the engine's own config never sets it
    rollout_cfg = dataclasses.replace(cfg.rollout, temperature=cfg.eval_temperature)

    records = {}
    progress = tqdm(total=len(rows), desc="held-out", disable=run.rank != 0, leave=False,
                    dynamic_ncols=True)
    for step, start in enumerate(range(0, len(rows), CHUNK_PROBLEMS)):
        chunk = rows[start:start + CHUNK_PROBLEMS]
        groups = generate(run.engine, run.executor, run.tokenizer, [r["problem"] for r in chunk],
                          cfg.eval_samples, rollout_cfg, seed=cfg.seed, step=step)
        flat = [t for group in groups for t in group]
        rewards, ungraded = score_groups([flat], chunk)
        for t, reward, cut in zip(flat, rewards[0], ungraded[0]):
            records[start + t.problem_index, t.sample_index] = metrics.trajectory_record(
                t, reward == 1.0, extract_answer(t.model_text), cut)
        progress.update(len(chunk))
    progress.close()

    # every rank scored the problems it claimed: rank 0 needs them all
    parts = [None] * run.world_size
    dist.all_gather_object(parts, records)
    records = {key: record for part in parts for key, record in part.items()}
    held_out = metrics.held_out_metrics(records, len(rows), cfg.eval_samples)
    held_out["time/eval"] = time.perf_counter() - started
    return held_out


# -----------------------------------------------------------------------------
# the run: its start, one RL step after another, its end

def train(cfg):
    """The RL run; returns the last step's metrics (rank 0; {} elsewhere)."""
    run = start_run(cfg)
    if run is None:
        return {}

    row = {}
    if run.state["step"] == 0 and run.eval_rows and cfg.eval_at_start:  # the demo's "before" row
        row = evaluate_held_out(run)
        metrics.print_held_out(row, run.rank, "before step 1")
        run.logger.log(0, row)

    progress = tqdm(total=cfg.steps, initial=run.state["step"], desc="rl", disable=run.rank != 0,
                    dynamic_ncols=True)
    untrained = 0  # steps that trained on nothing, in all
    streak = 0  # and in a row, up to this one
    for step in range(run.state["step"], cfg.steps):
        row = rl_step(run, step)
        if run.rank == 0:
            if row["selected"] == 0:
                untrained += 1
                streak += 1
            else:
                streak = 0
            metrics.warn_untrained(streak, row, cfg.untrained_steps_warn)
            progress.update(1)
            progress.set_postfix(metrics.progress_fields(row))
    progress.close()

    # the trained policy as a Hugging Face directory, in the engine's dtype (machinery/rl_run.py)
    finish_rl_run(run, untrained)
    return row


def start_executor(rollout_cfg, engine):
    """The tool's workers, this node's cores shared out among its ranks; none on a
    tensor-parallel follower, which replays its leader's engine calls and never runs a tool."""
    if not rollout_cfg.use_tool or not engine.is_leader:
        return None
    return Executor(workers=rollout_cfg.tool_workers or cores_per_rank(),
                    timeout_s=rollout_cfg.tool_timeout_s,
                    memory_mb=rollout_cfg.tool_memory_mb)


def start_run(cfg):
    """What an RL run holds across its steps (machinery/rl_run.py: inputs, policy and optimizer,
    log, engine) and the tool's executor, timed (time/tool_busy); None when out_dir's run is
    already at `steps`."""
    run = start_rl_run(cfg, KEYS_A_RESUME_MAY_CHANGE)
    if run is not None:
        executor = start_executor(cfg.rollout, run.engine)
        run.executor = metrics.TimedExecutor(executor) if executor else None
    return run


def interrupt_paragraph(cfg, argv):
    """What rank 0 prints when Ctrl-C or SIGTERM stops rl.py (cfg: None before it is read)."""
    if cfg is None or cfg.mode == "plan":  # it writes nothing
        return "rl.py: interrupted"
    out_dir = resolve(cfg.out_dir)
    return training_interrupted("rl.py", argv, out_dir,
                                checkpoint.latest_checkpoint(out_dir / "checkpoints"), cfg.steps,
                                cfg.save_every, cfg.resume)


def main(cfg):
    configure_vllm_logging(cfg.verbose)
    plan_args = plan.split_plan_args(sys.argv[1:], RLConfig)[1]  # plan_*=...: the plan's own keys
    if cfg.mode == "plan" or plan_args:  # no process group, no model: the config's world
        plan.print_plan(cfg, cfg.world_size or int(os.environ.get("WORLD_SIZE", "1")), plan_args)
    else:
        train(cfg)


if __name__ == "__main__":
    run_script("rl.py", lambda argv: load_config(RLConfig, plan.split_plan_args(argv, RLConfig)[0],
                                                 doc=__doc__), main, interrupt_paragraph)
