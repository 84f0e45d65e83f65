"""Agentic RL with GRPO-RoC (rStar2-Agent, arXiv 2508.20722 §2.2, §4.3), one loop from one CPU
process to 64 GPUs.

    python rl.py configs/tiny.yaml                        # 1 CPU process (the tiny demo's RL stage)
    python rl.py configs/qwen3_1p7b_1gpu.yaml             # 1 GPU, a small real model
    torchrun --nproc_per_node=8 rl.py configs/stage1.yaml world_size=8      # 1 node of 8 GPUs
    torchrun --nnodes=8 --node_rank=$NODE_RANK --nproc_per_node=8 \\
        --master_addr=$MASTER_ADDR --master_port=29500 rl.py configs/stage1.yaml   # 64 GPUs
    python rl.py configs/stage3.yaml mode=filter          # stage-3 data: drop problems solved 8/8
    python rl.py configs/stage1.yaml mode=plan            # memory, bytes, time of a step per rank
    python rl.py configs/tiny.yaml mode=replay positive_rule=topk   # a saved step again, offline

Every rank is a trainer and a rollout worker at once (colocated, as verl's hybrid engine): an
FSDP2 shard of the policy and its own in-process vLLM engine. One RL step, a function per phase:

    1. weight sync  the trainer's weights -> every engine, in memory (never through disk)
    2. rollouts     2G multi-turn trajectories per prompt with the Python tool (rollout.py, §3.2)
    3. rewards      0/1 on the final \\boxed{} answer, 0 if truncated (Eq. 3, §4.3.1; reward.py)
    4. selection    drop all-equal groups, Resample-on-Correct keeps G of 2G (§2.2.3; grpo_roc.py);
                    every save_rollouts_every steps the trajectories and the choice go to disk
    5. balance      the kept trajectories spread across ranks by token count
    6. old logp     the trainer's, compared with the engine's (the sync guard); a pass of its own
                    only with mini_batches > 1, else from the update's own forward
    7. update       the clipped token-level loss of Eq. 6 over the GLOBAL token count, one step;
                    optionally weighted for the engine-vs-trainer gap (rollout_correction)
    8. log, checkpoint, evaluate

Paper vs this file:
  - one optimizer step per RL step (the release's ppo_mini_batch_size covers the whole batch);
    mini_batches=k splits it into k steps on the same rollouts, for off-policy ablations.
  - warm-up: linear from lr/warmup_steps, not from 0 as in verl (a wasted step 0), then constant.
  - weight decay 0.01 and grad clip 1.0 are verl defaults the paper does not state.
  - rollouts run on vLLM, not SGLang, in every rank's own process (no Ray).
  - algorithm=grpo is the paper's "GRPO with Tool" baseline (Fig. 9): G rollouts, all kept.
  - rollout_correction (none in the paper): truncated / masked importance weights for the gap
    between the engine that sampled and the trainer (grpo_roc.rollout_weights).
"""
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoTokenizer

from executor import Executor
from grpo_roc import (ROLLOUT_CORRECTIONS, filter_groups, group_advantages, policy_loss,
                      roc_penalty, rollouts_per_prompt, select_group)
from reward import extract_answer, score_batch
from rollout import RolloutConfig, Trajectory, generate
from machinery.checkpoint import (check_inputs, epoch_plan, latest_checkpoint, restore,
                                  save_checkpoint)
from machinery.config import ConfigError, atomic_write_text, load_config, resolve
from machinery.data import drop_long_prompts
from machinery.distributed import (TORCH_THREADS, add_traffic, balance_by_tokens, compute_dtype,
                                   cpu_threads, free_cached_memory, full_weights, init_distributed,
                                   own_groups)
from machinery.engine import Engine, configure_vllm_logging
from machinery.exits import (close_progress_bars, exit_status, interrupted, is_main_rank,
                             rerun_command, shown, stop_on_signals, training_interrupted)
from machinery.metrics import (MetricsLogger, TimedExecutor, pass_at_k, sample_metrics,
                               step_metrics, timed, trajectory_record, warn_untrained)
from machinery.model import check_model_dir, save_hf_model
from machinery.plan import print_plan, split_plan_args
from machinery.prompts import load_format
from machinery.results import CHUNK_PROBLEMS, ROLLOUT_RESOURCE_FIELDS
from machinery.run_dir import claim_run_dir, finish_run_dir
from machinery.saved_rollouts import (print_replay, read_rollouts, replay_policy, rollout_record,
                                      sample_table, write_rollouts)
from machinery.training import (TrainSample, collate, equalize_micro_batches, micro_batches,
                                token_logprobs)


# -----------------------------------------------------------------------------
# config: defaults are the paper's stage-1 values (§4.3, §5.1) where it gives one

@dataclasses.dataclass
class RLConfig:
    model: str = ""               # HF directory (or hub id) of the SFT policy, with its tokenizer
    train_data: str = "data/train_int_mix.jsonl"
    out_dir: str = "out/rl"
    # plan: memory, bytes, time of a step; replay: a saved step's selection and update, offline
    mode: Literal["train", "filter", "plan", "replay"] = "train"
    plan_model_config: str = ""   # mode=plan: the model's config.json when `model` is not on disk
    seed: int = 0
    world_size: int = 0           # ranks this config was written for (0 = any), checked at start
    # the method (§2.2.3, §4.3)
    algorithm: Literal["roc", "grpo"] = "roc"  # roc: 2G sampled, RoC keeps G; grpo: G, all kept
    group_size: int = 16          # G, rollouts per prompt that are trained on
    positive_rule: Literal["sample", "topk"] = "sample"  # paper: sample ~1/penalty; release: topk
    roc_error_ratio: bool = True  # p_err (Eq. 4) in the positives' penalty
    roc_answer_format: bool = True  # p_format (Eq. 5) in the positives' penalty
    filter_all_equal: bool = True  # drop groups whose rewards are all equal (release: same)
    prompts_per_step: int = 512
    steps: int = 300              # total RL steps of this run (a resume continues up to it)
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0        # 0 = off (paper); verl's default would be 3.0
    # the engine samples with its own kernels (and dtype): weight each token for that gap (Yao et
    # al. 2025; grpo_roc.rollout_weights). none = the paper; token_tis / token_mis / geometric_*
    rollout_correction: Literal[ROLLOUT_CORRECTIONS] = "none"
    rollout_is_threshold: float = 2.0  # C: tis truncates weights at C; mis drops those off [1/C, C]
    # optimizer: AdamW, constant lr after a linear warm-up (§5.1)
    lr: float = 1e-6
    warmup_steps: int = 20
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0        # max global grad norm; 0 = no clipping (logged either way)
    mini_batches: int = 1         # optimizer steps per RL step, each on 1/k of the kept rollouts
    # memory and speed; none of them changes the maths (tests/test_rl.py checks that)
    micro_batch_tokens: int = 20480  # padded tokens per forward/backward (release: 20480 per GPU)
    micro_batch_size: int = 0     # trajectories per forward/backward; 0 = no cap
    train_dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    activation_checkpointing: bool = False
    logprob_chunk_tokens: int = 1024  # output projection this many tokens at a time; 0 = off
    attn_implementation: str = "sdpa"  # trainer attention (flash_attention_2 on GPU, if installed)
    # CPU only: torch threads for steps 6-7; 0 = torch's own (OMP_NUM_THREADS, else all cores).
    # The engine decodes on 1 (machinery.engine.set_cpu_engine_threads). On 2 loaded cores 1
    # thread beat 2: 5x in vLLM decoding (OpenMP spin-waits), 2x in training.
    train_threads: int = 0
    logprob_gap_warn: float = 0.05  # sync guard: warn above this mean |trainer - engine| gap
    untrained_steps_warn: int = 3  # warn when this many steps in a row train on nothing; 0 = never
    # checkpoints and logs
    save_every: int = 10
    keep_checkpoints: int = 2
    resume: str = "auto"          # auto: newest intact checkpoint in out_dir; never; a PATH
    # true: resume this out_dir's run with changed settings (config_history.yaml records them);
    # false: a change of a key outside KEYS_A_RESUME_MAY_CHANGE is refused
    continue_with_changes: bool = False
    # with resume=auto and no checkpoint in out_dir yet, start from this checkpoint of another run
    init_from: str = ""
    # false: init_from's (fp32 master) weights only, a fresh AdamW from step 0: stage 3 (§4.3)
    init_optimizer: bool = True
    eval_data: str = ""           # held-out problems, scored every eval_every steps, 0, and last
    eval_every: int = 0           # 0 = only at the start and the end (when eval_data is set)
    eval_at_start: bool = True    # false: the ablation measures only the end
    eval_samples: int = 1         # rollouts per eval problem
    eval_temperature: float = 0.6  # the paper's evaluation temperature (§5.1)
    wandb_project: str = ""
    wandb_samples: int = 8        # trajectories per step in W&B's sample table (rank 0's); 0 = none
    tensorboard: bool = False
    # saved rollouts (machinery/saved_rollouts.py): what the model wrote, and what mode=replay reads
    # steps 1, 1+N, 1+2N, ...: each was sampled by the weights of a checkpoint when N is a multiple
    # of save_every, so it replays exactly (while keep_checkpoints keeps that one); 0 = never
    save_rollouts_every: int = 10
    keep_rollouts: int = 0        # the newest this many saved steps stay on disk; 0 = all
    # mode=replay: rerun a saved step's selection, advantages and update without an engine
    replay_step: int = 0          # the saved step (as in metrics.jsonl); 0 = the newest
    replay_weights: str = ""      # "": those that sampled it (exact); or a checkpoint / HF dir
    replay_update_effect: bool = False  # also the kept tokens' log-prob change the update made
    verbose: bool = False         # all of vLLM's logging; default: its warnings
    # stage-3 filter (§4.3, mode=filter)
    filter_source: str = ""
    filter_samples: int = 8
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)

    @property
    def rollouts_per_prompt(self):
        return rollouts_per_prompt(self.group_size, self.algorithm)  # 2G for RoC, G for GRPO

    def validate(self):
        """Errors that can be found before loading anything."""
        if not self.model:
            raise ConfigError("model: set the policy to train (an HF directory with its "
                              "tokenizer), e.g. model=out/sft")
        if self.group_size < 4 and self.algorithm == "roc":
            raise ConfigError(f"group_size={self.group_size}: GRPO-RoC keeps at least 2 positives "
                              "and 2 negatives per group (grpo_roc.resample_on_correct), so G must "
                              "be >= 4")
        if self.group_size < 2:
            raise ConfigError(f"group_size={self.group_size}: a group advantage needs at least 2 "
                              "rollouts (Eq. 7)")
        for name in ("prompts_per_step", "steps", "mini_batches", "micro_batch_tokens",
                     "save_every", "keep_checkpoints", "eval_samples", "filter_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("warmup_steps", "micro_batch_size", "eval_every", "world_size",
                     "train_threads", "logprob_chunk_tokens", "wandb_samples",
                     "save_rollouts_every", "keep_rollouts", "replay_step", "untrained_steps_warn"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip={self.dual_clip}: must be 0 (off) or > 1")
        if not self.rollout_is_threshold > 1:
            raise ConfigError(f"rollout_is_threshold={self.rollout_is_threshold}: must be > 1 "
                              "(weights are truncated at it, or kept inside [1/C, C])")
        if self.mode == "filter" and not self.filter_source:
            raise ConfigError("mode=filter needs filter_source (the problems to filter); the kept "
                              "ones go to train_data")
        if not self.init_optimizer and not self.init_from:
            raise ConfigError("init_optimizer=false takes the weights of init_from, which is not "
                              "set")
        if self.resume not in ("auto", "never") and not resolve(self.resume).is_dir():
            raise ConfigError(f"resume={self.resume!r}: expected auto, never or a checkpoint "
                              "directory")
        if self.prompts_per_step % self.mini_batches:
            raise ConfigError(f"prompts_per_step={self.prompts_per_step} does not divide into "
                              f"mini_batches={self.mini_batches} optimizer steps of whole prompt "
                              "groups")
        longest = self.rollout.max_prompt_tokens + self.rollout.max_response_tokens
        if self.micro_batch_tokens < longest:
            raise ConfigError(f"micro_batch_tokens={self.micro_batch_tokens} cannot hold one "
                              "trajectory of rollout.max_prompt_tokens + "
                              f"rollout.max_response_tokens = {longest} tokens")
        try:
            self.rollout.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None


# Keys that do not change what is trained: a rerun into the same out_dir may change them (steps to
# train further, the cadence of saves and logs, how fast and in how much memory). Any other key
# changed is another run (machinery/run_dir.py).
KEYS_A_RESUME_MAY_CHANGE = {
    "out_dir", "mode", "plan_model_config", "world_size", "steps", "save_every", "keep_checkpoints",
    "resume", "continue_with_changes", "eval_every", "eval_at_start", "wandb_project",
    "tensorboard", "verbose", "filter_source", "filter_samples", "micro_batch_tokens",
    "micro_batch_size", "activation_checkpointing", "logprob_chunk_tokens", "train_threads",
    "logprob_gap_warn", *(f"rollout.{name}" for name in ROLLOUT_RESOURCE_FIELDS)}


# -----------------------------------------------------------------------------
# data order and schedule: a fresh permutation per epoch from the seed, so a resumed run reads
# what the uninterrupted one would

def prompt_indices(num_problems, seed, start, count):
    """Indices of `count` problems from absolute position `start` of the endless shuffled stream."""
    out = []
    position = start
    while len(out) < count:
        epoch, offset = divmod(position, num_problems)
        order = np.random.default_rng([seed, epoch]).permutation(num_problems)
        take = min(count - len(out), num_problems - offset)
        out.extend(int(i) for i in order[offset:offset + take])
        position += take
    return out


def lr_at(step, cfg):
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


# -----------------------------------------------------------------------------
# step 1, the weight sync: the trainer's FSDP2 shards into every rank's engine

def sync_weights(engine, model, dtype, traffic=None):
    """Step 1: the trainer's weights into this rank's sleeping engine, in memory, in verl's order
    (fsdp_workers.rollout_mode): the KV cache, most of the GPU, wakes last, once the gathered
    tensors are freed (waking both first needed it while the training peak still held its own)."""
    free_cached_memory()
    engine.wake_up(tags=["weights"])
    engine.update_weights(full_weights(model, dtype, traffic))
    free_cached_memory()
    engine.wake_up(tags=["kv_cache"])


# -----------------------------------------------------------------------------
# steps 6-7 on a fixed batch, without any engine (tests/test_rl.py drives exactly this code)

@torch.no_grad()
def recompute_logprobs(model, samples, cfg, pad_id, device, temperature):
    """Step 6: the trainer's old_logprobs under the current weights. The loss uses these, not the
    engine's, so the ratio of Eq. 6 starts at exactly 1 whatever the engine's numerics. A pass of
    its own only where the update cannot give them: with mini_batches > 1 the weights have moved
    by the second optimizer step; with one, train_step takes them from its own forward."""
    for batch in equalize_micro_batches(micro_batches(samples, cfg)):
        input_ids, *_ = collate(batch, pad_id, device)
        store_old_logprobs(batch, token_logprobs(model, input_ids, temperature,
                                                 cfg.logprob_chunk_tokens))


def logprob_gap(samples):
    """The sync guard (step 6): mean and max |trainer - engine| log-prob over every rank's
    model-written tokens. The engine sampled them with the weights just synced, so both agree up
    to kernel noise; a broken sync (wrong names, stale weights, wrong dtype) shows here at step 1,
    not as a slow, silent divergence."""
    total, count, largest = 0.0, 0, 0.0
    for s in samples:
        if s.engine_logprobs is None or s.old_logprobs is None:  # not sampled, or not forwarded
            continue
        gap = np.abs(np.asarray(s.old_logprobs) - np.asarray(s.engine_logprobs))
        gap = gap[np.asarray(s.loss_mask) > 0]
        total, count = total + float(gap.sum()), count + gap.size
        largest = max(largest, float(gap.max(initial=0.0)))
    sums, largest = torch.tensor([total, count], dtype=torch.float64), torch.tensor([largest])
    dist.all_reduce(sums)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return {"logprob_gap_mean": sums[0].item() / max(sums[1].item(), 1),
            "logprob_gap_max": largest.item()}


def train_step(model, optimizer, samples, cfg, step, pad_id, device, temperature=1.0):
    """One optimizer step on this rank's samples; all ranks call it together.
    Eq. 6's loss is a sum over every model-written token of the GLOBAL batch (all micro-batches,
    all ranks) over that count: each micro-batch's token sum is divided by (global count / world
    size) and FSDP's mean over ranks restores the rest, so the gradient is the same however the
    batch is split (the invariance test). A per-micro-batch mean would weigh a token of a short
    micro-batch more than one of a long one.
    Samples without old_logprobs take them from this forward, detached: before the optimizer
    step the weights are the ones the old log-probs stand for, so the loss and gradient are the
    separate pass's (tests/test_rl.py) at a forward less. They are written back to the samples
    for the sync guard (logprob_gap)."""
    world_size = dist.get_world_size()
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    global_tokens = torch.tensor([float(sum(sum(s.loss_mask) for s in samples))])
    dist.all_reduce(global_tokens)
    if global_tokens.item() == 0:
        raise RuntimeError("train_step: the batch has no model-written token on any rank "
                           "(every loss mask is 0)")
    batches = equalize_micro_batches(micro_batches(samples, cfg))
    sums, maxima = {}, {}
    num_tokens = global_tokens.item() / world_size
    for batch in batches:
        input_ids, old, mask, advantages, engine = collate(batch, pad_id, device)
        logp, entropy = token_logprobs(model, input_ids, temperature, cfg.logprob_chunk_tokens,
                                       with_entropy=True)
        if all(s.old_logprobs is None for s in batch):  # from this forward, detached
            old = store_old_logprobs(batch, logp.detach())
        loss, metrics = policy_loss(logp, old, advantages, mask, clip_low=cfg.clip_low,
                                    clip_high=cfg.clip_high, dual_clip=cfg.dual_clip or None,
                                    num_tokens=num_tokens, engine_logp=engine,
                                    rollout_correction=cfg.rollout_correction,
                                    rollout_is_threshold=cfg.rollout_is_threshold)
        loss.backward()  # accumulates; FSDP2 reduce-scatters (a mean over ranks) after each
        metrics["loss"] = loss.detach()
        # the policy's token-mean entropy over the trained tokens (logged, never in the loss)
        metrics["entropy"] = torch.where(mask, entropy, 0.0).sum() / num_tokens
        for key, value in metrics.items():
            if key.endswith("_max"):
                maxima[key] = torch.maximum(maxima.get(key, value.cpu()), value.cpu())
            else:
                sums[key] = sums.get(key, 0.0) + value.detach().cpu()
    # The global grad norm before clipping: a loss-scaling bug shows here even where AdamW hides it.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                               cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    # Freed now, not next step: the engine needs that memory for the sync and rollout (as verl)
    optimizer.zero_grad(set_to_none=True)
    out = global_metrics(sums, maxima, world_size)
    out.update(grad_norm=float(grad_norm), lr=lr_at(step, cfg), num_micro_batches=len(batches),
               train_tokens=int(global_tokens.item()))
    return out


def global_metrics(sums, maxima, world_size):
    """This rank's summed and largest loss metrics -> the batch's over all ranks. Every summed
    metric was divided by the per-rank share of tokens, so the mean over ranks is the global one;
    *_max combine by max."""
    keys, max_keys = sorted(sums), sorted(maxima)
    packed = torch.stack([torch.as_tensor(sums[k], dtype=torch.float32) for k in keys])
    largest = torch.stack([torch.as_tensor(maxima[k], dtype=torch.float32) for k in max_keys])
    dist.all_reduce(packed)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    out = {k: float(v) / world_size for k, v in zip(keys, packed)}
    out.update({k: float(v) for k, v in zip(max_keys, largest)})
    return out


def store_old_logprobs(batch, logp):
    """Set each sample's old_logprobs to its model-written span of the [B, T] `logp` (what
    collate gives the loss as Eq. 6's old log-probs, and the sync guard reads); returns logp."""
    rows = logp.cpu()
    for row, s in enumerate(batch):
        s.old_logprobs = rows[row, len(s.prompt_ids) - 1: len(s) - 1].tolist()
    return logp


# -----------------------------------------------------------------------------
# step 4: group filter + Resample-on-Correct + advantages; the step's metrics

def select_samples(groups, rewards, cfg, step, position):
    """Step 4: this rank's groups -> (samples to train on, probes, a record per sampled trajectory).
    Groups are complete on the rank that generated them, so selection needs no communication. Each
    group's RoC draw is seeded from (seed, step, the problem's position in the stream): the same on
    a rerun, whichever rank claimed the problem (timing decides, §3.2). A dropped (all-equal) group
    still gives one probe, never trained on but checked by the sync guard, which so never goes
    blind, even if all groups are dropped."""
    kept_groups, _ = filter_groups(rewards, enabled=cfg.filter_all_equal)
    samples, probes, records = [], [], []
    for g, (group, group_rewards) in enumerate(zip(groups, rewards)):
        # The penalties only rank the positives (§2.2.3); they never enter the reward.
        penalties = [roc_penalty(t.num_tool_calls, t.num_tool_errors, t.num_answer_tags,
                                 max(t.num_turns, 1), use_error_ratio=cfg.roc_error_ratio,
                                 use_answer_format=cfg.roc_answer_format) for t in group]
        kept = []
        if g in kept_groups:
            rng = np.random.default_rng([cfg.seed, step, position + group[0].problem_index])
            kept = select_group(group_rewards, penalties, cfg.group_size, rng, mode=cfg.algorithm,
                                positive_rule=cfg.positive_rule)
            # Eq. 7 over the G kept, not the 2G sampled
            for i, advantage in zip(kept, group_advantages([group_rewards[i] for i in kept])):
                samples.append(train_sample(group[i], advantage))
        else:  # advantage 0 and never trained: only the guard reads it
            probes.append(train_sample(group[0], 0.0))
        all_equal = max(group_rewards) == min(group_rewards)
        for i, (t, reward, penalty) in enumerate(zip(group, group_rewards, penalties)):
            records.append(dict(
                reward=reward, selected=i in kept, all_equal=all_equal, penalty=penalty,
                format_penalty=roc_penalty(t.num_tool_calls, t.num_tool_errors, t.num_answer_tags,
                                           max(t.num_turns, 1), use_error_ratio=False),  # Eq. 5
                tool_calls=t.num_tool_calls, tool_errors=t.num_tool_errors,
                parse_errors=t.tool_errors_by_kind.get("parse", 0),
                errors_by_kind=dict(t.tool_errors_by_kind), response_tokens=len(t.response_ids),
                model_tokens=t.num_model_tokens, truncated=t.truncated, turns=t.num_turns,
                problem=position + t.problem_index))
    return samples, probes, records


def train_sample(t, advantage):
    return TrainSample(t.prompt_ids, t.response_ids, t.loss_mask, advantage,
                       engine_logprobs=t.logprobs, problem_index=t.problem_index,
                       sample_index=t.sample_index)





# -----------------------------------------------------------------------------
# one RL step, phase by phase (the module docstring's steps; 1, 4, 6 and 7 are above)

def roll_out(run, rows, step, times):
    """Step 2: this rank's groups of 2G (or G) trajectories; times["rollout"], ["tool_busy"]."""
    started, busy_before = time.perf_counter(), run.tool.busy_s if run.tool else 0.0
    groups = generate(run.engine, run.tool, run.tokenizer, [r["problem"] for r in rows],
                      run.cfg.rollouts_per_prompt, run.cfg.rollout, seed=run.cfg.seed, step=step)
    run.engine.sleep()  # free the KV cache and weights for training (on CPU vLLM frees nothing)
    groups = own_groups(groups, len(rows), run.rank)
    times["rollout"] = time.perf_counter() - started
    times["tool_busy"] = (run.tool.busy_s if run.tool else 0.0) - busy_before
    return groups


def score_groups(groups, rows):
    """Step 3: the rewards, per group. Each rank grades its own trajectories in its own verifier
    pool, so grading scales with the ranks (the paper offloads it to the tool service, §3.1)."""
    flat = [t for g in groups for t in g]
    flat_rewards = score_batch([t.model_text for t in flat],
                               [rows[t.problem_index]["answer"] for t in flat],
                               [t.finished for t in flat])
    rewards, at = [], 0
    for g in groups:
        rewards.append(flat_rewards[at:at + len(g)])
        at += len(g)
    return rewards


def save_rollouts(run, step, position, rows, groups, rewards, records, samples, times):
    """Step 4, kept: this rank's trajectories with their reward, RoC penalty, selection and
    advantage, as saved rollouts (steps 1, 1 + save_rollouts_every, ...) and, with W&B on, as the
    step's sample table; times["save_rollouts"]. `records` are select_samples', in group order."""
    cfg, started = run.cfg, time.perf_counter()
    # the same on every rank (write_rollouts is collective); the table: rank 0's logger only
    saving = cfg.save_rollouts_every and step % cfg.save_rollouts_every == 0
    table = run.logger.wandb is not None and cfg.wandb_samples
    if saving or table:
        advantages = {(s.problem_index, s.sample_index): s.advantage for s in samples}
        flat = [(t, reward) for group, group_rewards in zip(groups, rewards)
                for t, reward in zip(group, group_rewards)]
        lines = [rollout_record(t, rows[t.problem_index], reward, record["penalty"],
                                record["selected"],
                                advantages.get((t.problem_index, t.sample_index)), step + 1,
                                position)
                 for (t, reward), record in zip(flat, records)]
        if saving:
            write_rollouts(run.out_dir, step + 1, lines, keep=cfg.keep_rollouts,
                           meta={"data_position": position,
                                 "rollouts_per_prompt": cfg.rollouts_per_prompt,
                                 "config": dataclasses.asdict(cfg)})
        if table:
            run.logger.log_table(step + 1, "rollouts", *sample_table(lines, cfg.wandb_samples))
    times["save_rollouts"] = time.perf_counter() - started


def balance_blocks(samples, cfg, traffic):
    """Step 5: the kept trajectories in mini_batches blocks of whole prompt groups (one per
    optimizer step), each dealt across ranks by tokens: the update waits for its slowest rank."""
    blocks = [[s for s in samples
               if s.problem_index * cfg.mini_batches // cfg.prompts_per_step == b]
              for b in range(cfg.mini_batches)]
    balanced = [balance_by_tokens(block) for block in blocks]
    add_traffic(traffic, "balance_received_bytes",
                sum(moved["received_bytes"] + moved["keys_bytes"] for _, moved in balanced))
    return [share for share, _ in balanced]


def update_policy(model, optimizer, blocks, cfg, step, pad_id, device):
    """Step 7: one optimizer step (Eq. 6) per block; (their mean metrics, blocks skipped)."""
    updates = []
    for block in blocks:
        count = torch.tensor([len(block)])
        dist.all_reduce(count)
        if count.item() == 0:  # every group of the block was all-equal (the release skips too)
            continue
        updates.append(train_step(model, optimizer, block, cfg, step, pad_id, device,
                                  cfg.rollout.temperature))
    train_metrics = {k: sum(u[k] for u in updates) / len(updates)
                     for k in (updates[0] if updates else {})}
    if updates:
        train_metrics["train_tokens"] = sum(u["train_tokens"] for u in updates)
    return train_metrics, len(blocks) - len(updates)


def learn(model, optimizer, blocks, probes, cfg, step, pad_id, device, times):
    """Steps 6-7 on the balanced blocks, as rl_step and mode=replay both run them: (the update's
    metrics, blocks skipped, the sync guard's gap); times["old_logprobs"], ["train"],
    ["logprob_gap"].
    6. A pass of its own for the old log-probs only with several optimizer steps; with one,
    step 7's forward gives them, and the dropped groups' probes are read only when nothing was
    trained (the weights did not move), so that the sync guard never goes blind."""
    mine = [s for block in blocks for s in block]
    with timed(times, "old_logprobs"):
        if cfg.mini_batches > 1:
            recompute_logprobs(model, mine + probes, cfg, pad_id, device, cfg.rollout.temperature)
    with timed(times, "train"):
        train_metrics, skipped = update_policy(model, optimizer, blocks, cfg, step, pad_id,
                                               device)
    if skipped == cfg.mini_batches == 1:
        with timed(times, "old_logprobs"):
            recompute_logprobs(model, probes, cfg, pad_id, device, cfg.rollout.temperature)
    with timed(times, "logprob_gap"):  # the sync guard: two all-reduces, a sync point
        gap = logprob_gap(mine + probes)
    return train_metrics, skipped, gap


def gather_metrics(local, learner, step, cfg, rank, world_size):
    """Step 8: the step's metrics on rank 0 ({} elsewhere) from every rank's `local` numbers and
    the `learner`'s (the same on every rank); a loud warning when the sync guard's gap is large.
    time/PHASE is the slowest rank's seconds in each phase; rl_step adds time/metrics (this call)
    and time/step, which the phases add up to. time/tool_busy overlaps time/rollout (the tool's
    load, not a phase); time/checkpoint and time/eval come after the step, outside time/step."""
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if rank != 0:
        return {}
    metrics = step_metrics([r for part in gathered for r in part["records"]],
                           sum(p["groups"] for p in gathered))
    metrics.update(learner)
    for key in local["times"]:  # the slowest rank's: the others wait for it at the next collective
        metrics[f"time/{key}"] = max(part["times"][key] for part in gathered)
    for key in local["traffic"]:  # the busiest rank's
        metrics[f"bytes/{key}"] = max(part["traffic"].get(key, 0) for part in gathered)
    metrics["rollout_tokens_per_s"] = (sum(p["rollout_tokens"] for p in gathered)
                                       / max(metrics["time/rollout"], 1e-9))
    # prompt + response tokens through the trainer (the update; with mini_batches > 1 also a
    # no-grad pass for the old log-probs)
    metrics["train_tokens_per_s"] = (sum(p["trained_tokens"] for p in gathered)
                                     / max(metrics["time/train"] + metrics["time/old_logprobs"],
                                           1e-9))
    if metrics["logprob_gap_mean"] > cfg.logprob_gap_warn:
        print(f"\n{'!' * 100}\nWARNING step {step + 1}: trainer and engine log-probs of the "
              f"sampled tokens differ by {metrics['logprob_gap_mean']:.4f} on average (max "
              f"{metrics['logprob_gap_max']:.3f}), above logprob_gap_warn={cfg.logprob_gap_warn}.\n"
              "The engine is not sampling from the policy being trained: check the weight sync "
              f"(names, dtype), the temperature, and the chat template.\n{'!' * 100}", flush=True)
    return metrics


def evaluate_held_out(run):
    """Held-out accuracy (eval/ metrics and time/eval) through the training engine, as eval.py
    measures it: eval_samples trajectories per problem at eval_temperature, the reward of Eq. 3."""
    cfg, rows = run.cfg, run.eval_rows
    started = time.perf_counter()
    sync_weights(run.engine, run.model, run.weight_dtype)  # the engine has the sampled-with weights
    # generate() sends the temperature with every request: the engine's own config never sets it
    rollout_cfg = dataclasses.replace(cfg.rollout, temperature=cfg.eval_temperature)
    records = {}
    for step, start in enumerate(range(0, len(rows), CHUNK_PROBLEMS)):
        chunk = rows[start:start + CHUNK_PROBLEMS]
        groups = generate(run.engine, run.tool, run.tokenizer, [r["problem"] for r in chunk],
                          cfg.eval_samples, rollout_cfg, seed=cfg.seed, step=step)
        flat = [t for group in groups for t in group]
        rewards = score_batch([t.model_text for t in flat],
                              [chunk[t.problem_index]["answer"] for t in flat],
                              [t.finished for t in flat])
        for t, reward in zip(flat, rewards):
            # the tensor-parallel ranks of one engine may all report its samples: each counts once
            records[start + t.problem_index, t.sample_index] = trajectory_record(
                t, reward == 1.0, extract_answer(t.model_text))
    parts = [None] * run.world_size
    dist.all_gather_object(parts, records)
    records = {key: record for part in parts for key, record in part.items()}
    correct = [sum(records[p, s]["correct"] for s in range(cfg.eval_samples))
               for p in range(len(rows))]
    summary = {"pass@1": statistics.fmean(pass_at_k(cfg.eval_samples, c, 1) for c in correct),
               **sample_metrics(list(records.values()))}
    keys = ("pass@1", "tool_calls_per_trajectory", "tool_error_rate", "tool_error_rate_in_correct",
            "answer_rate", "response_tokens")
    metrics = {f"eval/{k}": summary[k] for k in keys if summary.get(k) is not None}
    metrics["time/eval"] = time.perf_counter() - started
    return metrics


# -----------------------------------------------------------------------------
# the run: train (one RL step after another), filter_solved (mode=filter)

def start_executor(rollout_cfg):
    if not rollout_cfg.use_tool:
        return None
    return Executor(workers=rollout_cfg.tool_workers or None, timeout_s=rollout_cfg.tool_timeout_s,
                    memory_mb=rollout_cfg.tool_memory_mb)


def start_run(cfg):
    """What an RL run holds across its steps: inputs, policy and optimizer, engine, tool, log;
    None when out_dir's run is already at `steps`."""
    model_path, problems, eval_rows = check_inputs(cfg)
    rank, world_size, _, device = init_distributed()
    run = SimpleNamespace(cfg=cfg, model_path=model_path, rank=rank, world_size=world_size,
                          device=device, out_dir=resolve(cfg.out_dir))
    run.ckpt_root = run.out_dir / "checkpoints"
    run.dir = claim_run_dir(cfg, run.out_dir, KEYS_A_RESUME_MAY_CHANGE, cfg.steps,
                            "hf_step_{step}", rank)
    if run.dir is None:
        return None
    tokenizer = run.tokenizer = AutoTokenizer.from_pretrained(model_path)
    run.pad_id = (tokenizer.eos_token_id if tokenizer.pad_token_id is None
                  else tokenizer.pad_token_id)
    run.problems = drop_long_prompts(problems, tokenizer, cfg.rollout, cfg.train_data)
    run.eval_rows = (drop_long_prompts(eval_rows, tokenizer, cfg.rollout, cfg.eval_data)
                     if eval_rows else [])
    run.model, run.optimizer, run.state = restore(cfg, run.dir.checkpoint, device, rank)
    if rank == 0:
        print(epoch_plan(cfg, len(run.problems), run.state["step"])[1], flush=True)
    run.logger = MetricsLogger(run.out_dir, enabled=rank == 0, wandb_project=cfg.wandb_project,
                               tensorboard=cfg.tensorboard, config=dataclasses.asdict(cfg),
                               resume_step=run.state["step"])
    run.engine = Engine(model_path, cfg.rollout, seed=cfg.seed)
    run.executor = start_executor(cfg.rollout)
    run.tool = TimedExecutor(run.executor) if run.executor else None
    dtype = cfg.rollout.dtype  # the engine's: the weights are cast to it before they are gathered
    run.weight_dtype = (getattr(torch, dtype) if dtype in ("float32", "bfloat16", "float16")
                        else torch.float32)
    return run


def rl_step(run, step):
    """One RL step, the module docstring's phases 1-8; the step's metrics (on rank 0)."""
    cfg, times, traffic = run.cfg, {}, {}  # this rank's seconds per phase, bytes it moved
    started = time.perf_counter()
    # 1, also before a fresh run's first step: one code path, guarded from step 1 on
    with timed(times, "weight_update"):
        sync_weights(run.engine, run.model, run.weight_dtype, traffic)
    position = run.state["data_position"]
    rows = [run.problems[i] for i in prompt_indices(len(run.problems), cfg.seed, position,
                                                    cfg.prompts_per_step)]
    groups = roll_out(run, rows, step, times)
    with timed(times, "reward"):
        rewards = score_groups(groups, rows)
    with timed(times, "selection"):
        samples, probes, records = select_samples(groups, rewards, cfg, step, position)
    save_rollouts(run, step, position, rows, groups, rewards, records, samples, times)
    with timed(times, "balance"):
        blocks = balance_blocks(samples, cfg, traffic)
    mine = [s for block in blocks for s in block]
    # 6-7 on train_threads, then the engine's
    threads = cpu_threads(cfg.train_threads or TORCH_THREADS, run.device)
    train_metrics, skipped, gap = learn(run.model, run.optimizer, blocks, probes, cfg, step,
                                        run.pad_id, run.device, times)
    cpu_threads(threads, run.device)
    # 8. A resume needs, besides weights and optimizer, the data position (whole steps); a rerun of
    # a step draws the same tokens (seeds from (seed, step, problem, sample): rollout.request_seed)
    run.state = {"step": step + 1, "data_position": position + cfg.prompts_per_step}
    local = dict(records=records, groups=len(groups), times=times, traffic=traffic,
                 rollout_tokens=sum(len(t.response_ids) for g in groups for t in g),
                 trained_tokens=sum(map(len, mine)))
    learner = {**train_metrics, **gap, "skipped_updates": skipped,
               "data_position": run.state["data_position"]}
    gathering = time.perf_counter()
    metrics = gather_metrics(local, learner, step, cfg, run.rank, run.world_size)
    if run.rank == 0:  # the phases' time/ keys add up to time/step; checkpoint and eval are apart
        ended = time.perf_counter()
        metrics.update({"time/metrics": ended - gathering, "time/step": ended - started})
    # Saved before the evaluation, so a run killed while evaluating loses no training.
    if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
        with timed(metrics, "time/checkpoint"):
            save_checkpoint(run.ckpt_root, step + 1, run.model, run.optimizer, run.state,
                            keep=cfg.keep_checkpoints, keep_through=run.dir.keep_through)
    return metrics


def train(cfg):
    """The RL run; returns the last step's metrics (rank 0; {} elsewhere)."""
    run = start_run(cfg)
    if run is None:
        return {}
    metrics = {}
    if run.state["step"] == 0 and run.eval_rows and cfg.eval_at_start:  # the demo's "before" row
        metrics = evaluate_held_out(run)
        run.logger.log(0, metrics)
    progress = tqdm(total=cfg.steps, initial=run.state["step"], desc="rl", disable=run.rank != 0,
                    dynamic_ncols=True)
    untrained = streak = 0  # steps that trained on nothing: in all, and in a row up to now
    for step in range(run.state["step"], cfg.steps):
        metrics = rl_step(run, step)
        if run.rank == 0:
            nothing = metrics["selected"] == 0
            untrained, streak = untrained + nothing, (streak + 1) * nothing
            warn_untrained(streak, metrics, cfg.untrained_steps_warn)
        if run.eval_rows and (step + 1 == cfg.steps
                              or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
            metrics.update(evaluate_held_out(run))
        if run.rank == 0:
            run.logger.log(step + 1, metrics)
            progress.update(1)
            err_ok = metrics["tool_error_ratio_in_correct"]
            progress.set_postfix(acc=f"{metrics['accuracy']:.3f}",
                                 err_ok="-" if err_ok is None else f"{err_ok:.3f}",
                                 gap=f"{metrics['logprob_gap_mean']:.1e}",
                                 tok_s=f"{metrics['rollout_tokens_per_s']:.0f}")
    progress.close()
    run.logger.close()
    # The trained policy as a Hugging Face directory (what eval.py, vLLM and the next stage load)
    # in the engine's dtype (bf16 on GPU); the fp32 master weights stay in the DCP checkpoint.
    hf_dir = run.out_dir / f"hf_step_{run.state['step']}"
    save_hf_model(run.model, run.tokenizer, run.model_path, hf_dir, compute_dtype(run.device),
                  run.rank, load_format(cfg.rollout)[:2], "rl.py")
    if run.executor:
        run.executor.close()
    run.engine.close()
    finish_run_dir(run.dir, run.state["step"])
    if run.rank == 0:
        if untrained:
            print(f"WARNING: {untrained} of the run's steps trained on nothing "
                  "(skipped_updates in metrics.jsonl)", flush=True)
        # configs/eval_tiny.yaml on CPU: configs/eval.yaml's 30K-token budget is for a GPU
        eval_config = "configs/eval.yaml" if run.device.type == "cuda" else "configs/eval_tiny.yaml"
        print(f"rl.py: wrote {shown(hf_dir)} (the trained policy, a Hugging Face directory), "
              f"{shown(run.out_dir / 'metrics.jsonl')} (a row per step) and "
              f"{shown(run.ckpt_root)} (resumable)\n"
              f"next: {rerun_command('eval.py', [eval_config, f'model={shown(hf_dir)}'])}",
              flush=True)
    return metrics


def filter_solved(cfg):
    """Stage-3 data (§4.3): sample filter_samples rollouts per problem of filter_source with the
    current policy and keep the problems it does not solve every time (the paper: 42K -> 17.3K
    with 8 samples). Writes train_data."""
    model_path, problems, _ = check_inputs(cfg)
    rank, world_size, _, _ = init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # Too long to roll out means too long to train on: such problems are not written either.
    problems = drop_long_prompts(problems, tokenizer, cfg.rollout, cfg.filter_source)
    engine = Engine(model_path, cfg.rollout, seed=cfg.seed)
    executor = start_executor(cfg.rollout)
    solved = {}  # one pass in chunks of prompts_per_step, every rank claiming as in training
    for chunk, start in enumerate(range(0, len(problems), cfg.prompts_per_step)):
        rows = problems[start:start + cfg.prompts_per_step]
        groups = generate(engine, executor, tokenizer, [r["problem"] for r in rows],
                          cfg.filter_samples, cfg.rollout, seed=cfg.seed, step=chunk)
        groups = own_groups(groups, len(rows), rank)  # a tensor-parallel group counts it once
        for group, rewards in zip(groups, score_groups(groups, rows)):
            for t, reward in zip(group, rewards):
                key = start + t.problem_index
                solved[key] = solved.get(key, 0) + int(reward > 0)
        if rank == 0:
            print(f"[filter] {min(start + len(rows), len(problems))}/{len(problems)} problems",
                  flush=True)
    parts = [None] * world_size
    dist.all_gather_object(parts, solved)
    solved = {i: c for part in parts for i, c in part.items()}
    # "Problems with 8/8 correct are removed" (§4.3); the rest keep their order and rows
    kept = [row for i, row in enumerate(problems) if solved.get(i, 0) < cfg.filter_samples]
    if rank == 0:
        out = resolve(cfg.train_data)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "".join(json.dumps(row) + "\n" for row in kept))
        print(f"[filter] kept {len(kept)} of {len(problems)} problems (dropped those solved "
              f"{cfg.filter_samples}/{cfg.filter_samples}) -> {out}", flush=True)
    if executor:
        executor.close()
    engine.close()
    return kept


# -----------------------------------------------------------------------------
# mode=replay: a saved step's phases 4-7 again, offline, under this config (docs/design.md, Saved
# rollouts): two RoC rules, losses or corrections compared on the very same trajectories

def replay(cfg):
    """Select, compute advantages and update (one optimizer step) on saved step replay_step of
    out_dir, with the weights that sampled it; no engine, no tool, nothing written. Prints the
    live step's numbers beside the replay's; returns (on rank 0) the replay's metrics and its kept
    trajectories {(data stream position, sample_index): advantage}."""
    started = time.perf_counter()
    rank, world_size, _, device = init_distributed()
    run_dir = resolve(cfg.out_dir)
    number, meta, saved = read_rollouts(run_dir, cfg.replay_step, rank, world_size)
    step, position = number - 1, meta["data_position"]
    groups, rewards = saved_groups(saved, meta, cfg)
    model, optimizer, source = replay_policy(cfg, run_dir, number, device, rank)
    tokenizer = AutoTokenizer.from_pretrained(check_model_dir(cfg.model))
    pad_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    loaded = time.perf_counter()
    # steps 4-7 as rl_step runs them, on its CPU threads: train_threads, else the 1 vLLM sets
    cpu_threads(cfg.train_threads or 1, device)
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
    live_kept = {(r["position"], r["sample_index"]) for r in read_rollouts(run_dir, number)[2]
                 if r["selected"]}
    seconds = {"load": loaded - started, "steps 4-7": time.perf_counter() - loaded}
    print_replay(cfg, run_dir, number, meta, source, metrics, train_metrics, kept, live_kept,
                 seconds, world_size)
    return SimpleNamespace(metrics=metrics, kept=kept)


def saved_groups(records, meta, cfg):
    """Saved records -> (groups of rollout.Trajectory, their rewards), as roll_out and
    score_groups gave them; an error where the saved groups cannot be selected from as cfg asks."""
    fields = {f.name for f in dataclasses.fields(Trajectory)}
    groups, rewards = {}, {}
    for r in records:
        groups.setdefault(r["problem_index"], []).append(
            Trajectory(**{k: v for k, v in r.items() if k in fields}))
        rewards.setdefault(r["problem_index"], []).append(r["reward"])
    saved, wanted = meta["rollouts_per_prompt"], cfg.rollouts_per_prompt
    # plain GRPO thins more rollouts uniformly, as if it had sampled G (grpo_roc.select_group)
    if saved < wanted or (saved > wanted and cfg.algorithm != "grpo"):
        raise ConfigError(f"the saved step has {saved} rollouts per prompt; algorithm="
                          f"{cfg.algorithm} with group_size={cfg.group_size} selects from "
                          f"{wanted}: replay it with the group_size and algorithm it was sampled "
                          "with, or algorithm=grpo (any G up to the saved count)")
    return [groups[i] for i in sorted(groups)], [rewards[i] for i in sorted(groups)]


@torch.no_grad()
def update_effect(model, samples, cfg, pad_id, device):
    """replay_update_effect: how far the one update moved the policy on the step's own trained
    tokens: the mean log-prob change over the positives' and the negatives' model-written tokens,
    over all ranks."""
    sums = torch.zeros(4, dtype=torch.float64)  # change and count, positives then negatives
    for batch in equalize_micro_batches(micro_batches(samples, cfg)):
        input_ids, old, mask, advantages, _ = collate(batch, pad_id, device)
        change = (token_logprobs(model, input_ids, cfg.rollout.temperature,
                                 cfg.logprob_chunk_tokens) - old).double().cpu() * mask.cpu()
        for side, rows in enumerate((advantages.cpu() > 0, advantages.cpu() < 0)):
            sums[2 * side] += change[rows].sum()
            sums[2 * side + 1] += mask.cpu()[rows].sum()
    dist.all_reduce(sums)
    return {"replay/logprob_change_positives": (sums[0] / sums[1].clamp(min=1)).item(),
            "replay/logprob_change_negatives": (sums[2] / sums[3].clamp(min=1)).item()}


def interrupt_paragraph(cfg):
    """What rank 0 prints when Ctrl-C or SIGTERM stops rl.py (cfg: None before it is read)."""
    if cfg is None or cfg.mode in ("plan", "replay"):  # they write nothing
        return "rl.py: interrupted"
    if cfg.mode == "filter":
        return (f"rl.py: interrupted; mode=filter writes {cfg.train_data} only after the whole "
                f"pass, so it is unchanged. Rerun: {rerun_command('rl.py', sys.argv[1:])}")
    out_dir = resolve(cfg.out_dir)
    return training_interrupted("rl.py", sys.argv[1:], out_dir,
                                latest_checkpoint(out_dir / "checkpoints"), cfg.steps,
                                cfg.save_every, cfg.resume)


if __name__ == "__main__":
    stop_on_signals()
    config = None
    try:
        argv, plan_args = split_plan_args(sys.argv[1:], RLConfig)  # plan_*=...: the plan's keys
        config = load_config(RLConfig, argv, doc=__doc__)
        configure_vllm_logging(config.verbose)
        if config.mode == "plan" or plan_args:  # no process group, no model: the config's world
            print_plan(config, config.world_size or int(os.environ.get("WORLD_SIZE", "1")),
                       plan_args)
        else:
            {"filter": filter_solved, "replay": replay}.get(config.mode, train)(config)
    except ConfigError as e:
        sys.exit(f"rl.py: {e}")
    except (KeyboardInterrupt, Exception):
        if not interrupted():  # a real error: its traceback
            raise
        # Ctrl-C or SIGTERM (on another rank too: then a collective here fails): one paragraph
        # on rank 0, no traceback; the engine, tool and grading workers close at exit
        if is_main_rank():
            close_progress_bars()
            print(interrupt_paragraph(config), flush=True)
        sys.exit(exit_status())
