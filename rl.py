"""Agentic RL with GRPO-RoC (rStar2-Agent, arXiv 2508.20722 §2.2, §4.3), one loop from 1 CPU process to 64 GPUs.

    python rl.py configs/tiny.yaml                                   # 1 CPU process (the tiny demo's RL stage)
    python rl.py configs/qwen3_1p7b_1gpu.yaml                        # 1 GPU, a small real model
    torchrun --nproc_per_node=8 rl.py configs/stage1.yaml world_size=8              # 1 node of 8 GPUs
    torchrun --nnodes=8 --node_rank=$NODE_RANK --nproc_per_node=8 \\
        --master_addr=$MASTER_ADDR --master_port=29500 rl.py configs/stage1.yaml   # the paper's 64 GPUs
    (the same for configs/stage2.yaml, which continues stage 1; then stage 3:)
    python rl.py configs/stage3.yaml mode=filter                     # stage-3 data: drop problems solved 8/8
    python rl.py configs/stage1.yaml mode=plan                       # memory, bytes, time of a step per rank (plan.py)

Every rank is a trainer and a rollout worker at once (colocated, as verl's hybrid engine): it holds an FSDP2 shard
of the policy and its own in-process vLLM engine (rollout.py). One RL step, one function per step in train():

    1. weight sync  trainer's full weights -> every engine, in memory (never through disk)
    2. rollouts     2G multi-turn trajectories per prompt with the Python tool; a fast rank claims more prompts (§3.2)
    3. rewards      0/1 on the final \\boxed{} answer, 0 if truncated (Eq. 3, §4.3.1; reward.py)
    4. selection    drop all-equal groups, then Resample-on-Correct keeps G of 2G (§2.2.3; grpo_roc.py)
    5. balance      kept trajectories are spread across ranks by token count
    6. old logp     recomputed by the trainer; compared with the engine's (the sync guard: logprob_gap)
    7. update       the clipped token-level loss of Eq. 6, one optimizer step, normalised by the GLOBAL token count
    8. log, checkpoint, evaluate

Paper vs this file:
  - one optimizer step per RL step (the release's ppo_mini_batch_size covers the whole batch); mini_batches=k splits
    it into k steps on the same rollouts, for off-policy ablations.
  - warm-up: linear over warmup_steps from lr/warmup_steps, not 0 as in verl (wasting step 0), then constant (§6.2).
  - weight decay 0.01 and grad clip 1.0 are verl defaults the paper does not state.
  - rollouts run on vLLM, not SGLang, in every rank's own process (no Ray).
  - algorithm=grpo is the paper's "GRPO with Tool" baseline (Fig. 9): G rollouts per prompt, all kept.

Tests: .venv/bin/python -m pytest tests/test_rl.py -q   (the invariance test: 1x1, 1x4, torchrun 2x2 micro-batches)
"""
import contextlib
import dataclasses
import json
import math
import os
import sys
import statistics
import time
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoTokenizer

from machinery.config import atomic_write_text, ConfigError, load_config, resolve, save_config
from machinery.metrics import MetricsLogger
from machinery.distributed import compute_dtype, cpu_threads, free_cached_memory, init_distributed
from machinery.checkpoint import load_checkpoint, save_checkpoint
from machinery.data import load_problems
from executor import Executor
from grpo_roc import (filter_groups, group_advantages, policy_loss, roc_penalty,
                      rollouts_per_prompt, select_group)
from machinery.plan import print_plan, split_plan_args
from reward import extract_answer, score_batch
from machinery.engine import configure_vllm_logging, Engine
from rollout import generate, RolloutConfig
from machinery.distributed import balance_by_tokens
from machinery.prompts import load_format
from machinery.model import build_model, check_model_dir, save_hf_model
from machinery.checkpoint import load_weights, start_checkpoint
from machinery.data import drop_long_prompts
from machinery.distributed import add_traffic, full_weights, own_groups
from machinery.metrics import TimedExecutor
from machinery.training import collate, equalize_micro_batches, micro_batches, token_logprobs
from machinery.metrics import pass_at_k, sample_metrics, trajectory_record


# -----------------------------------------------------------------------------
# config: defaults are the paper's stage-1 values (§6.2, §6.3) where it gives one

@dataclasses.dataclass
class RLConfig:
    model: str = ""                          # HF directory (or hub id) of the SFT policy, with its tokenizer
    train_data: str = "data/train_int_mix.jsonl"
    out_dir: str = "out/rl"
    mode: Literal["train", "filter", "plan"] = "train"   # plan: memory, bytes and time of a step (plan.py)
    plan_model_config: str = ""              # mode=plan: the model's config.json when `model` is not on disk yet
    seed: int = 0
    world_size: int = 0                      # ranks this config was written for; 0 = any. Checked against torchrun's
    # the method (§2.2.3, §6.2)
    algorithm: Literal["roc", "grpo"] = "roc"    # roc: 2G sampled, RoC keeps G. grpo: G sampled, all kept (Fig. 9)
    group_size: int = 16                     # G, rollouts per prompt that are trained on
    positive_rule: Literal["sample", "topk"] = "sample"  # paper: sample ~1/penalty; release: lowest penalties
    roc_error_ratio: bool = True             # p_err (Eq. 4) in the positives' penalty
    roc_answer_format: bool = True           # p_format (Eq. 5) in the positives' penalty
    filter_all_equal: bool = True            # drop groups whose rewards are all equal (release: reject_equal_reward)
    prompts_per_step: int = 512
    steps: int = 300                         # total RL steps of this run (resume continues up to it)
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0                   # 0 = off (paper); verl's default would be 3.0
    # optimizer (AdamW; constant lr after a linear warm-up, §6.2)
    lr: float = 1e-6
    warmup_steps: int = 20
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0                   # max global grad norm; 0 = no clipping (the norm is logged either way)
    mini_batches: int = 1                    # optimizer steps per RL step, each on 1/k of the kept trajectories
    # memory / speed knobs; none of them changes the maths (tests/test_rl.py checks that)
    micro_batch_tokens: int = 20480          # cap on padded tokens per forward/backward (release: 20480 per GPU)
    micro_batch_size: int = 0                # cap on trajectories per forward/backward; 0 = no cap
    train_dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: bf16 compute on GPU, fp32 on CPU
    activation_checkpointing: bool = False
    logprob_chunk_tokens: int = 1024         # output projection this many tokens at a time (token_logprobs); 0 = off
    attn_implementation: str = "sdpa"        # trainer attention (flash_attention_2 on GPU, if installed)
    train_threads: int = 0                   # CPU only: torch threads for steps 6-7; 0 = vLLM's (1). On 2 loaded cores
                                             # 1 thread beat 2: 5x in vLLM decoding (OpenMP spin-waits), 2x in training
    logprob_gap_warn: float = 0.05           # sync guard: warn above this mean |trainer - engine| log-prob gap
    # checkpoints and logs
    save_every: int = 10
    keep_checkpoints: int = 2
    resume: str = "auto"                     # auto: newest complete checkpoint in out_dir/checkpoints; never; PATH
    init_from: str = ""                      # with resume=auto and no checkpoint in out_dir yet: start from this
                                             # checkpoint of an earlier run (model, optimizer, step, data position)
    init_optimizer: bool = True              # false: take only init_from's weights (its fp32 master weights), with a
                                             # fresh AdamW from step 0 and data position 0: stage 3's reset (§6.3)
    eval_data: str = ""                      # held-out problems scored every eval_every steps (and at 0 and the end)
    eval_every: int = 0                      # 0 = only at the start and the end (when eval_data is set)
    eval_at_start: bool = True               # also before the first step (false: the ablation measures only the end)
    eval_samples: int = 1                    # rollouts per eval problem
    eval_temperature: float = 0.6            # the paper's evaluation temperature (§8.1)
    wandb_project: str = ""
    tensorboard: bool = False
    verbose: bool = False                    # all of vLLM's logging; default: its warnings (VLLM_LOGGING_LEVEL wins)
    # stage-3 filter (§6.3, mode=filter): filter_solved
    filter_source: str = ""
    filter_samples: int = 8
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)

    @property
    def rollouts_per_prompt(self):
        return rollouts_per_prompt(self.group_size, self.algorithm)  # 2G for RoC, G for plain GRPO

    def validate(self):
        """Errors that can be found before loading anything."""
        if not self.model:
            raise ConfigError("model: set the policy to train (an HF directory with its tokenizer), e.g. model=out/sft")
        if self.group_size < 4 and self.algorithm == "roc":
            raise ConfigError(f"group_size={self.group_size}: GRPO-RoC keeps at least 2 positives and 2 negatives "
                              f"per group (grpo_roc.resample_on_correct), so G must be >= 4")
        if self.group_size < 2:
            raise ConfigError(f"group_size={self.group_size}: a group advantage needs at least 2 rollouts (Eq. 7)")
        for name in ("prompts_per_step", "steps", "mini_batches", "micro_batch_tokens", "save_every",
                     "keep_checkpoints", "eval_samples", "filter_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("warmup_steps", "micro_batch_size", "eval_every", "world_size", "train_threads",
                     "logprob_chunk_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip={self.dual_clip}: must be 0 (off) or > 1")
        if self.mode == "filter" and not self.filter_source:
            raise ConfigError("mode=filter needs filter_source (the problems to filter); the kept ones go to train_data")
        if not self.init_optimizer and not self.init_from:
            raise ConfigError("init_optimizer=false takes the weights of init_from, which is not set")
        if self.resume not in ("auto", "never") and not resolve(self.resume).is_dir():
            raise ConfigError(f"resume={self.resume!r}: expected auto, never or a checkpoint directory")
        if self.prompts_per_step % self.mini_batches:
            raise ConfigError(f"prompts_per_step={self.prompts_per_step} does not divide into mini_batches="
                              f"{self.mini_batches} optimizer steps of whole prompt groups")
        longest = self.rollout.max_prompt_tokens + self.rollout.max_response_tokens
        if self.micro_batch_tokens < longest:
            raise ConfigError(f"micro_batch_tokens={self.micro_batch_tokens} cannot hold one trajectory of "
                              f"rollout.max_prompt_tokens + rollout.max_response_tokens = {longest} tokens")
        try:
            self.rollout.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None


# -----------------------------------------------------------------------------
# data order: a fresh permutation per epoch from the seed, so a resumed run reads what the uninterrupted one would

def prompt_indices(num_problems, seed, start, count):
    """Indices of `count` problems starting at absolute position `start` of the endless shuffled stream."""
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
# policy: an HF causal LM, FSDP2-sharded over all ranks (a 14B policy never sits whole on every rank)

def load_policy(cfg, device, rank):
    model, _ = build_model(cfg, cfg.model, device, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    return model, optimizer


def sync_weights(engine, model, dtype, traffic=None):
    """Step 1: the trainer's weights into this rank's (sleeping) engine, in memory, in verl's order
    (fsdp_workers.rollout_mode): the KV cache, which takes most of the GPU, wakes last, once the gathered tensors are
    freed (waking both first asked for it while the training peak and the gathered tensors still held theirs)."""
    free_cached_memory()
    engine.wake_up(tags=["weights"])
    engine.update_weights(full_weights(model, dtype, traffic))
    free_cached_memory()
    engine.wake_up(tags=["kv_cache"])


# -----------------------------------------------------------------------------
# the training step, callable on a fixed batch without any engine (tests/test_rl.py drives exactly this code)

@dataclasses.dataclass
class TrainSample:
    """A selected trajectory for the trainer; field names as rollout.Trajectory's, for rollout.balance_by_tokens."""
    prompt_ids: list[int]
    response_ids: list[int]        # model and tool tokens after the prompt
    loss_mask: list[int]           # per response token: 1 = written by the model, 0 = tool output (never trained)
    advantage: float               # Eq. 7, shared by all tokens of the trajectory
    engine_logprobs: list[float] | None = None  # per response token, as the engine sampled it (for the guard)
    old_logprobs: list[float] | None = None     # per response token, recomputed by the trainer before the update
    problem_index: int = 0
    sample_index: int = 0

    def __len__(self):
        return len(self.prompt_ids) + len(self.response_ids)


@torch.no_grad()
def recompute_logprobs(model, samples, cfg, pad_id, device, temperature):
    """Step 6: the trainer's old_logprobs under the current weights. The loss uses these, not the engine's, so the ratio
    of Eq. 6 starts at exactly 1 whatever the engine's numerics (bf16 kernels, other attention code)."""
    for batch in equalize_micro_batches(micro_batches(samples, cfg)):
        input_ids, *_ = collate(batch, pad_id, device)
        logp = token_logprobs(model, input_ids, temperature, cfg.logprob_chunk_tokens).cpu()
        for row, s in enumerate(batch):
            s.old_logprobs = logp[row, len(s.prompt_ids) - 1: len(s) - 1].tolist()


def logprob_gap(samples):
    """The sync guard (step 6): mean and max |trainer - engine| log-prob over every rank's model-written tokens. The
    engine sampled them with the weights just synced, so both agree up to kernel noise; a broken sync (wrong names,
    stale weights, wrong dtype) shows here on step 1 instead of as a slow, silent divergence."""
    total, count, largest = 0.0, 0, 0.0
    for s in samples:
        if s.engine_logprobs is None:
            continue
        gap = np.abs(np.asarray(s.old_logprobs) - np.asarray(s.engine_logprobs))[np.asarray(s.loss_mask) > 0]
        total, count = total + float(gap.sum()), count + gap.size
        largest = max(largest, float(gap.max(initial=0.0)))
    sums, largest = torch.tensor([total, count], dtype=torch.float64), torch.tensor([largest])
    dist.all_reduce(sums)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return {"logprob_gap_mean": sums[0].item() / max(sums[1].item(), 1), "logprob_gap_max": largest.item()}


def train_step(model, optimizer, samples, cfg, step, pad_id, device, temperature=1.0):
    """One optimizer step on this rank's `samples` (old_logprobs filled); every rank calls it together. Eq. 6's loss
    is a sum over every model-written token of the GLOBAL batch (all micro-batches, all ranks) over that count: each
    micro-batch's token sum is divided by (global count / world size) and FSDP's mean over ranks restores the rest, so
    the gradient is the same however the batch is split (the invariance test). A per-micro-batch mean would weigh a
    token of a short micro-batch more than one of a long one: the bug other frameworks shipped."""
    world_size = dist.get_world_size()
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    local_tokens = sum(sum(s.loss_mask) for s in samples)
    global_tokens = torch.tensor([float(local_tokens)])
    dist.all_reduce(global_tokens)
    if global_tokens.item() == 0:
        raise RuntimeError("train_step: the batch has no model-written token on any rank (every loss mask is 0)")
    per_rank_tokens = global_tokens.item() / world_size
    batches = equalize_micro_batches(micro_batches(samples, cfg))
    sums = {}
    ratio_max = torch.zeros(())
    for batch in batches:
        input_ids, old, mask, advantages = collate(batch, pad_id, device)
        logp = token_logprobs(model, input_ids, temperature, cfg.logprob_chunk_tokens)
        loss, metrics = policy_loss(logp, old, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                    num_tokens=per_rank_tokens, dual_clip=cfg.dual_clip or None)
        loss.backward()  # accumulates over micro-batches; FSDP2 reduce-scatters (averages over ranks) after each
        metrics["loss"] = loss.detach()
        ratio_max = torch.maximum(ratio_max, metrics.pop("ratio_max").cpu())
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value.detach().cpu()
    # The global grad norm, before clipping: a loss-scaling bug changes it even where AdamW's update would not.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    # Freed now, not next step: else the gradients hold memory the engine needs in sync and rollout (as verl does)
    optimizer.zero_grad(set_to_none=True)
    # Every summed metric was divided by the per-rank share of the tokens, so the rank mean is the global value.
    keys = sorted(sums)
    packed = torch.stack([torch.as_tensor(sums[k], dtype=torch.float32) for k in keys])
    dist.all_reduce(packed)
    dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
    out = {k: float(v) / world_size for k, v in zip(keys, packed)}
    out.update(ratio_max=float(ratio_max), grad_norm=float(grad_norm), lr=lr_at(step, cfg),
               num_micro_batches=len(batches), train_tokens=int(global_tokens.item()))
    return out


# -----------------------------------------------------------------------------
# from rollouts to a training batch: group filter + Resample-on-Correct + advantages (step 4), the step's metrics

def select_samples(groups, rewards, cfg, step, position):
    """Step 4: this rank's groups -> (samples to train on, probes, a record per sampled trajectory). Groups are complete
    on the rank that generated them, so selection needs no communication. Each group's RoC draw is seeded from (seed,
    step, the problem's position in the stream), one stream per problem, not per rank: the same on a rerun, whichever
    rank claimed the problem (timing decides, §3.2). A dropped (all-equal) group still gives one probe, never trained on
    but checked by the sync guard, so the guard never goes blind, even if all groups are dropped."""
    kept_groups, _ = filter_groups(rewards, enabled=cfg.filter_all_equal)
    samples, probes, records = [], [], []
    for g, (group, group_rewards) in enumerate(zip(groups, rewards)):
        # The penalties only rank the positives (§2.2.3); they never enter the reward.
        penalties = [roc_penalty(t.num_tool_calls, t.num_tool_errors, t.num_answer_tags, max(t.num_turns, 1),
                                 use_error_ratio=cfg.roc_error_ratio, use_answer_format=cfg.roc_answer_format)
                     for t in group]
        kept = []
        if g in kept_groups:
            rng = np.random.default_rng([cfg.seed, step, position + group[0].problem_index])
            kept = select_group(group_rewards, penalties, cfg.group_size, rng, mode=cfg.algorithm,
                                positive_rule=cfg.positive_rule)
            # Eq. 7 over the G kept, not the 2G sampled
            for i, advantage in zip(kept, group_advantages([group_rewards[i] for i in kept])):
                t = group[i]
                samples.append(TrainSample(t.prompt_ids, t.response_ids, t.loss_mask, advantage,
                                           engine_logprobs=t.logprobs, problem_index=t.problem_index,
                                           sample_index=t.sample_index))
        else:  # advantage 0 and never trained: only the guard reads it
            t = group[0]
            probes.append(TrainSample(t.prompt_ids, t.response_ids, t.loss_mask, 0.0, engine_logprobs=t.logprobs,
                                      problem_index=t.problem_index, sample_index=t.sample_index))
        all_equal = max(group_rewards) == min(group_rewards)
        for i, (t, reward, penalty) in enumerate(zip(group, group_rewards, penalties)):
            records.append(dict(
                reward=reward, selected=i in kept, all_equal=all_equal, penalty=penalty,
                format_penalty=roc_penalty(t.num_tool_calls, t.num_tool_errors, t.num_answer_tags,
                                           max(t.num_turns, 1), use_error_ratio=False),  # p_format alone (Eq. 5)
                tool_calls=t.num_tool_calls, tool_errors=t.num_tool_errors,
                parse_errors=t.tool_errors_by_kind.get("parse", 0), errors_by_kind=dict(t.tool_errors_by_kind),
                response_tokens=len(t.response_ids), model_tokens=t.num_model_tokens, truncated=t.truncated,
                turns=t.num_turns, problem=position + t.problem_index))
    return samples, probes, records


def step_metrics(records, num_groups):
    """The per-step numbers, over every sampled trajectory of every rank (records from select_samples)."""
    n = len(records)
    # None, not 0, where there is nothing to average: "no correct trajectory called the tool" is not "no errors"
    mean = lambda key, rows=records: sum(r[key] for r in rows) / len(rows) if rows else None  # noqa: E731
    ratio = lambda a, b: a / b if b else None  # noqa: E731
    calls = sum(r["tool_calls"] for r in records)
    correct = [r for r in records if r["reward"] > 0]
    correct_calls = sum(r["tool_calls"] for r in correct)
    positives = [r for r in correct if not r["all_equal"]]
    kept_positives = [r for r in positives if r["selected"]]
    by_kind = {}
    for r in records:
        for kind, count in r["errors_by_kind"].items():
            by_kind[kind] = by_kind.get(kind, 0) + count
    out = {
        "accuracy": mean("reward"),                                   # the mean 0/1 reward of everything sampled
        "selected_reward_mean": mean("reward", [r for r in records if r["selected"]]),
        "all_equal_group_fraction": sum(r["all_equal"] for r in records) / max(n, 1),  # groups are equal-sized
        "trajectories": n, "selected": sum(r["selected"] for r in records), "groups": num_groups,
        "tool_calls_per_trajectory": calls / max(n, 1),
        "tool_call_rate": sum(r["tool_calls"] > 0 for r in records) / max(n, 1),  # a policy dropping the tool shows here
        "tool_error_ratio": ratio(sum(r["tool_errors"] for r in records), calls),
        # Fig. 4: failed calls per call, pooled over the trajectories that got the answer right
        "tool_error_ratio_in_correct": ratio(sum(r["tool_errors"] for r in correct), correct_calls),
        "parse_failure_rate": ratio(sum(r["parse_errors"] for r in records), calls),
        "format_penalty": mean("format_penalty"),
        # RoC at work: the kept positives should have a lower penalty than the positives they were drawn from
        "roc_penalty_positives": mean("penalty", positives),
        "roc_penalty_kept_positives": mean("penalty", kept_positives),
        "response_tokens": mean("response_tokens"), "response_tokens_max": max((r["response_tokens"] for r in records), default=0),
        "model_tokens": mean("model_tokens"), "turns": mean("turns"), "truncation_ratio": mean("truncated"),
    }
    out.update({f"tool_errors/{kind}": count for kind, count in sorted(by_kind.items())})
    return out


# -----------------------------------------------------------------------------
# the run: inputs, rollout ownership, checkpoints


def check_inputs(cfg, world_size=None):
    """Everything that can be wrong with the inputs, before a model or an engine is loaded: torchrun's WORLD_SIZE is
    read before any process group exists, so a wrong launch stops before any work."""
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if cfg.world_size and cfg.world_size != world_size:
        raise ConfigError(f"world_size={cfg.world_size}: this config is written for {cfg.world_size} ranks but was "
                          f"launched on {world_size}; change torchrun's --nnodes/--nproc_per_node, or world_size=0")
    tp = cfg.rollout.tensor_parallel_size
    if world_size % tp:
        raise ConfigError(f"rollout.tensor_parallel_size={tp} does not divide the {world_size} ranks into engines")
    engines = world_size // tp
    if cfg.mode == "train" and cfg.prompts_per_step < engines:
        raise ConfigError(f"prompts_per_step={cfg.prompts_per_step} is fewer than the {engines} engines: some would idle")
    model = check_model_dir(cfg.model)
    source = cfg.filter_source if cfg.mode == "filter" else cfg.train_data
    problems = load_problems(source)
    eval_rows = load_problems(cfg.eval_data) if cfg.eval_data and cfg.mode == "train" else []
    return model, problems, eval_rows


# The paper's stage 1 is 300 steps x 512 prompts over 42K problems: about 3.7 passes (§6.2, rstar2-method.md §7)
EPOCHS_WARN = 5.0


def epoch_plan(cfg, num_problems, start_step):
    """(passes over train_data this run makes, the line train() prints), with a warning past EPOCHS_WARN."""
    prompts = (cfg.steps - start_step) * cfg.prompts_per_step
    epochs = prompts / num_problems
    line = (f"plan: steps {start_step} -> {cfg.steps} x {cfg.prompts_per_step} prompts = {prompts:,} prompts over "
            f"{num_problems:,} problems of {cfg.train_data}: {epochs:.1f} epochs")
    if epochs > EPOCHS_WARN:
        line += (f"\nWARNING: {epochs:.1f} passes over the same problems, above {EPOCHS_WARN}; the paper's stage 1 "
                 f"makes 3.7 (300 x 512 prompts over 42K problems). Add problems (prepare_data.py, README: the "
                 f"paper's data size) or lower steps or prompts_per_step.")
    return epochs, line


def restore(cfg, ckpt_root, device, rank):
    """(policy, optimizer, run state) this run starts from: fresh, init_from's weights alone, or a checkpoint restored
    whole (model, optimizer, RNG, step, data position). common.save_checkpoint is atomic by rename, so a run killed
    mid-save resumes from the previous complete checkpoint."""
    checkpoint, weights_only = start_checkpoint(cfg, ckpt_root)
    state = {"step": 0, "data_position": 0}
    model, optimizer = load_policy(cfg, device, rank)
    if weights_only:
        load_weights(checkpoint, model)
        if rank == 0:
            print(f"initialised from {checkpoint}: its weights only, a fresh optimizer from step 0 "
                  "(init_optimizer=false)", flush=True)
    elif checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer)
        if rank == 0:
            print(f"resumed from {checkpoint}: step {state['step']}, data position {state['data_position']}", flush=True)
    return model, optimizer, state


# -----------------------------------------------------------------------------
# one RL step, phase by phase (the module docstring's steps; steps 1, 4 and 6 are above)

@contextlib.contextmanager
def timed(times, key):
    started = time.perf_counter()
    yield
    times[key] = time.perf_counter() - started


def roll_out(engine, tool, tokenizer, rows, rollouts, cfg, step, rank, times):
    """Step 2: this rank's groups of `rollouts` trajectories (rollout.generate); times["rollout"] and ["tool_busy"]."""
    started, busy_before = time.perf_counter(), tool.busy_s if tool else 0.0
    groups = generate(engine, tool, tokenizer, [r["problem"] for r in rows], rollouts, cfg.rollout,
                      seed=cfg.seed, step=step)
    engine.sleep()  # free the KV cache and weights for training (on CPU, vLLM's worker skips the release)
    groups = own_groups(groups, len(rows), rank)
    times["rollout"] = time.perf_counter() - started
    times["tool_busy"] = (tool.busy_s if tool else 0.0) - busy_before
    return groups


def score_groups(groups, rows):
    """Step 3: the rewards, per group (reward.score_batch). Each rank grades its own trajectories in its own reward
    process pool, so grading scales with the ranks (the paper offloads it to the tool service, §3.1)."""
    flat = [t for g in groups for t in g]
    flat_rewards = score_batch([t.model_text for t in flat], [rows[t.problem_index]["answer"] for t in flat],
                               [t.finished for t in flat])
    rewards, at = [], 0
    for g in groups:
        rewards.append(flat_rewards[at:at + len(g)])
        at += len(g)
    return rewards


def balance_blocks(samples, cfg, traffic):
    """Step 5: the kept trajectories in mini_batches blocks of whole prompt groups (one per optimizer step), each dealt
    out across ranks by tokens (rollout.balance_by_tokens): the training step waits for its slowest rank."""
    blocks = [[s for s in samples if s.problem_index * cfg.mini_batches // cfg.prompts_per_step == b]
              for b in range(cfg.mini_batches)]
    balanced = [balance_by_tokens(block) for block in blocks]
    add_traffic(traffic, "balance_received_bytes",
                sum(moved["received_bytes"] + moved["keys_bytes"] for _, moved in balanced))
    return [share for share, _ in balanced]


def update_policy(model, optimizer, blocks, cfg, step, pad_id, device):
    """Step 7: one optimizer step (Eq. 6, train_step) per block; (their mean metrics, the number of blocks skipped)."""
    updates = []
    for block in blocks:
        count = torch.tensor([len(block)])
        dist.all_reduce(count)
        if count.item() == 0:  # every group of this block was all-equal: nothing to learn (the release skips)
            continue
        updates.append(train_step(model, optimizer, block, cfg, step, pad_id, device, cfg.rollout.temperature))
    train_metrics = {k: sum(u[k] for u in updates) / len(updates) for k in (updates[0] if updates else {})}
    if updates:
        train_metrics["train_tokens"] = sum(u["train_tokens"] for u in updates)
    return train_metrics, len(blocks) - len(updates)


def gather_metrics(local, learner, step, cfg, rank, world_size):
    """Step 8: the step's metrics on rank 0 ({} elsewhere), from every rank's `local` numbers and the `learner`'s
    (the same on every rank); a loud warning when the sync guard's gap is past logprob_gap_warn."""
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if rank != 0:
        return {}
    metrics = step_metrics([r for part in gathered for r in part["records"]], sum(p["groups"] for p in gathered))
    metrics.update(learner)
    for key in local["times"]:  # wall times: the slowest rank's (the others wait for it at the next collective)
        metrics[f"time/{key}"] = max(part["times"][key] for part in gathered)
    for key in local["traffic"]:  # the busiest rank's
        metrics[f"bytes/{key}"] = max(part["traffic"].get(key, 0) for part in gathered)
    metrics["rollout_tokens_per_s"] = sum(p["rollout_tokens"] for p in gathered) / max(metrics["time/rollout"], 1e-9)
    # prompt + response tokens through the trainer (one no-grad pass for old log-probs, one for the update)
    metrics["train_tokens_per_s"] = (sum(p["trained_tokens"] for p in gathered)
                                     / max(metrics["time/train"] + metrics["time/old_logprobs"], 1e-9))
    if metrics["logprob_gap_mean"] > cfg.logprob_gap_warn:
        print(f"\n{'!' * 100}\nWARNING step {step + 1}: trainer and engine log-probs of the sampled tokens differ by "
              f"{metrics['logprob_gap_mean']:.4f} on average (max {metrics['logprob_gap_max']:.3f}), above "
              f"logprob_gap_warn={cfg.logprob_gap_warn}.\nThe engine is not sampling from the policy being trained: "
              f"check the weight sync (names, dtype), the temperature, and the chat template.\n{'!' * 100}", flush=True)
    return metrics


# eval.py's chunk_problems: the same chunks of held-out problems get the same sampling seeds (rollout.request_seed)
EVAL_CHUNK_PROBLEMS = 64


def evaluate_held_out(engine, model, weight_dtype, executor, tokenizer, rows, cfg):
    """Held-out accuracy (eval/ metrics and time/eval) through the training engine, measured as eval.py
    measures it: eval_samples trajectories per problem at eval_temperature, graded by the reward (Eq. 3)."""
    sync_weights(engine, model, weight_dtype)  # the engine holds the weights it last sampled with
    started = time.perf_counter()
    # generate() sends the temperature with every request: the engine's own config does not set it
    rollout_cfg = dataclasses.replace(cfg.rollout, temperature=cfg.eval_temperature)
    records = {}
    for step, start in enumerate(range(0, len(rows), EVAL_CHUNK_PROBLEMS)):
        chunk = rows[start:start + EVAL_CHUNK_PROBLEMS]
        groups = generate(engine, executor, tokenizer, [r["problem"] for r in chunk], cfg.eval_samples,
                          rollout_cfg, seed=cfg.seed, step=step)
        flat = [t for group in groups for t in group]
        rewards = score_batch([t.model_text for t in flat], [chunk[t.problem_index]["answer"] for t in flat],
                              [t.finished for t in flat])
        for t, reward in zip(flat, rewards):
            # tensor-parallel ranks of one engine may all report its samples: each counts once
            records[start + t.problem_index, t.sample_index] = trajectory_record(
                t, reward == 1.0, extract_answer(t.model_text))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, records)
    records = {key: record for part in parts for key, record in part.items()}
    correct = [sum(records[p, s]["correct"] for s in range(cfg.eval_samples)) for p in range(len(rows))]
    summary = {"pass@1": statistics.fmean(pass_at_k(cfg.eval_samples, c, 1) for c in correct),
               **sample_metrics(list(records.values()))}
    keys = ("pass@1", "tool_calls_per_trajectory", "tool_error_rate", "tool_error_rate_in_correct",
            "answer_rate", "response_tokens")
    metrics = {f"eval/{k}": summary[k] for k in keys if summary.get(k) is not None}
    metrics["time/eval"] = time.perf_counter() - started
    return metrics


# -----------------------------------------------------------------------------
# the run: train (one RL step after another), filter_solved (mode=filter)

def train(cfg):
    """The RL run; returns the last step's metrics (rank 0; {} elsewhere)."""
    model_path, problems, eval_rows = check_inputs(cfg)
    rank, world_size, _, device = init_distributed()
    out_dir = resolve(cfg.out_dir)
    if rank == 0:
        save_config(cfg, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    problems = drop_long_prompts(problems, tokenizer, cfg.rollout, cfg.train_data)
    eval_rows = drop_long_prompts(eval_rows, tokenizer, cfg.rollout, cfg.eval_data) if eval_rows else []
    ckpt_root = out_dir / "checkpoints"
    model, optimizer, state = restore(cfg, ckpt_root, device, rank)
    if rank == 0:
        print(epoch_plan(cfg, len(problems), state["step"])[1], flush=True)
    logger = MetricsLogger(out_dir, enabled=rank == 0, wandb_project=cfg.wandb_project, tensorboard=cfg.tensorboard,
                           config=dataclasses.asdict(cfg), resume_step=state["step"])
    engine = Engine(model_path, cfg.rollout, seed=cfg.seed)
    executor = Executor(workers=cfg.rollout.tool_workers or None, timeout_s=cfg.rollout.tool_timeout_s,
                        memory_mb=cfg.rollout.tool_memory_mb) if cfg.rollout.use_tool else None
    tool = TimedExecutor(executor) if executor else None
    weight_dtype = getattr(torch, cfg.rollout.dtype) if cfg.rollout.dtype in ("float32", "bfloat16", "float16") else torch.float32
    rollouts = rollouts_per_prompt(cfg.group_size, cfg.algorithm)  # 2G for RoC, G for plain GRPO

    metrics = {}
    if state["step"] == 0 and eval_rows and cfg.eval_at_start:  # the "before" row of the demo's table
        metrics = evaluate_held_out(engine, model, weight_dtype, tool, tokenizer, eval_rows, cfg)
        logger.log(0, metrics)
    progress = tqdm(total=cfg.steps, initial=state["step"], desc="rl", disable=rank != 0, dynamic_ncols=True)
    for step in range(state["step"], cfg.steps):
        times, traffic = {}, {}  # this rank's seconds per phase; bytes it moved (the weight sync, the balance)
        # 1, also before a fresh run's first step (its engine read the same weights): one code path, guarded from step 1
        with timed(times, "weight_update"):
            sync_weights(engine, model, weight_dtype, traffic)
        position = state["data_position"]
        rows = [problems[i] for i in prompt_indices(len(problems), cfg.seed, position, cfg.prompts_per_step)]
        groups = roll_out(engine, tool, tokenizer, rows, rollouts, cfg, step, rank, times)
        with timed(times, "reward"):
            rewards = score_groups(groups, rows)
        samples, probes, records = select_samples(groups, rewards, cfg, step, position)
        blocks = balance_blocks(samples, cfg, traffic)
        mine = [s for block in blocks for s in block]
        threads = cpu_threads(cfg.train_threads, device)  # steps 6-7 on train_threads, then back to vLLM's
        with timed(times, "old_logprobs"):
            recompute_logprobs(model, mine + probes, cfg, pad_id, device, cfg.rollout.temperature)
            gap = logprob_gap(mine + probes)
        with timed(times, "train"):
            train_metrics, skipped = update_policy(model, optimizer, blocks, cfg, step, pad_id, device)
        cpu_threads(threads, device)
        # 8. What a resume needs besides weights and optimizer: the data position advances by whole steps, and a rerun
        # of a step draws the same tokens (sampling seeds from (seed, step, problem, sample), rollout.request_seed)
        state = {"step": step + 1, "data_position": position + cfg.prompts_per_step}
        local = dict(records=records, groups=len(groups), times=times, traffic=traffic,
                     rollout_tokens=sum(len(t.response_ids) for g in groups for t in g),
                     trained_tokens=sum(map(len, mine)))
        learner = {**train_metrics, **gap, "skipped_updates": skipped, "data_position": state["data_position"]}
        metrics = gather_metrics(local, learner, step, cfg, rank, world_size)
        # Saved before the evaluation, so a run killed while evaluating loses no training.
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            with timed(metrics, "time/checkpoint"):
                save_checkpoint(ckpt_root, step + 1, model, optimizer, state, keep=cfg.keep_checkpoints)
        if eval_rows and (step + 1 == cfg.steps or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
            metrics.update(evaluate_held_out(engine, model, weight_dtype, tool, tokenizer, eval_rows, cfg))
        if rank == 0:
            logger.log(step + 1, metrics)
            progress.update(1)
            err_ok = metrics["tool_error_ratio_in_correct"]
            progress.set_postfix(acc=f"{metrics['accuracy']:.3f}", err_ok="-" if err_ok is None else f"{err_ok:.3f}",
                                 gap=f"{gap['logprob_gap_mean']:.1e}", tok_s=f"{metrics['rollout_tokens_per_s']:.0f}")
    progress.close()
    logger.close()
    # The trained policy as a Hugging Face directory: what eval.py, vLLM and the next stage load, in the dtype the
    # engine runs in (bf16 on GPU); the fp32 master weights stay in the DCP checkpoint for resuming.
    save_hf_model(model, tokenizer, model_path, out_dir / f"hf_step_{state['step']}", compute_dtype(device), rank,
                  load_format(cfg.rollout)[:2], "rl.py")
    if executor:
        executor.close()
    engine.close()
    return metrics


def filter_solved(cfg):
    """Stage-3 data (§6.3): sample filter_samples rollouts per problem of filter_source with the current policy and
    keep the problems it does not solve every time (the paper: 42K -> 17.3K with 8 samples). Writes train_data."""
    model_path, problems, _ = check_inputs(cfg)
    rank, world_size, _, _ = init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # Too long to roll out means too long to train on: such problems are not written to train_data either.
    problems = drop_long_prompts(problems, tokenizer, cfg.rollout, cfg.filter_source)
    engine = Engine(model_path, cfg.rollout, seed=cfg.seed)
    executor = Executor(workers=cfg.rollout.tool_workers or None, timeout_s=cfg.rollout.tool_timeout_s,
                        memory_mb=cfg.rollout.tool_memory_mb) if cfg.rollout.use_tool else None
    solved = {}  # one pass in chunks of prompts_per_step; every rank claims from the shared counter, as in training
    for chunk, start in enumerate(range(0, len(problems), cfg.prompts_per_step)):
        rows = problems[start:start + cfg.prompts_per_step]
        groups = generate(engine, executor, tokenizer, [r["problem"] for r in rows], cfg.filter_samples, cfg.rollout,
                          seed=cfg.seed, step=chunk)
        groups = own_groups(groups, len(rows), rank)  # tensor-parallel ranks must not count a problem twice
        for group, rewards in zip(groups, score_groups(groups, rows)):
            for t, reward in zip(group, rewards):
                solved[start + t.problem_index] = solved.get(start + t.problem_index, 0) + int(reward > 0)
        if rank == 0:
            print(f"[filter] {min(start + len(rows), len(problems))}/{len(problems)} problems", flush=True)
    parts = [None] * world_size
    dist.all_gather_object(parts, solved)
    solved = {i: c for part in parts for i, c in part.items()}
    # "Problems with 8/8 correct are removed" (§6.3); the rest keep their original order and rows
    kept = [row for i, row in enumerate(problems) if solved.get(i, 0) < cfg.filter_samples]
    if rank == 0:
        out = resolve(cfg.train_data)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "".join(json.dumps(row) + "\n" for row in kept))
        print(f"[filter] kept {len(kept)} of {len(problems)} problems (dropped those solved {cfg.filter_samples}/"
              f"{cfg.filter_samples}) -> {out}", flush=True)
    if executor:
        executor.close()
    engine.close()
    return kept


if __name__ == "__main__":
    try:
        argv, plan_args = split_plan_args(sys.argv[1:], RLConfig)  # plan_mfu=...: plan.py's, not the method's
        config = load_config(RLConfig, argv)
        configure_vllm_logging(config.verbose)
        if config.mode == "plan" or plan_args:  # no process group, no model: the config's own world size (or torchrun's)
            print_plan(config, config.world_size or int(os.environ.get("WORLD_SIZE", "1")), plan_args)
        else:
            (filter_solved if config.mode == "filter" else train)(config)
    except ConfigError as e:
        sys.exit(f"rl.py: {e}")
