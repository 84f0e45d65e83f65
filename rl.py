"""Agentic RL with GRPO-RoC (rStar2-Agent, arXiv 2508.20722 §2.2, §4.3), one loop from 1 CPU process to 64 GPUs.

    python rl.py configs/tiny.yaml                                   # 1 CPU process (the tiny demo's RL stage)
    torchrun --nproc_per_node=8 rl.py configs/qwen3_1p7b_1gpu.yaml   # (1 GPU: nproc_per_node=1)
    torchrun --nproc_per_node=8 rl.py configs/stage1.yaml            # 1 node of 8 GPUs
    torchrun --nnodes=8 --node_rank=$NODE_RANK --nproc_per_node=8 \\
        --master_addr=$MASTER_ADDR --master_port=29500 rl.py configs/stage1.yaml   # the paper's 64 GPUs
    python rl.py configs/stage3.yaml mode=filter                     # stage-3 data: drop problems solved 8/8

Every rank is a trainer and a rollout worker at once (colocated, as verl's hybrid engine): it holds an FSDP2 shard
of the policy and its own in-process vLLM engine (rollout.py). One RL step is:

    1. weight sync  trainer's full weights -> every engine, in memory (never through disk)
    2. rollouts     2G trajectories per prompt, multi-turn with the Python tool; prompts are claimed dynamically
                    across ranks, so a fast rank takes more (paper §3.2)
    3. rewards      0/1 on the final \\boxed{} answer, 0 if truncated (Eq. 3, §4.3.1; reward.py)
    4. selection    drop all-equal groups, then Resample-on-Correct keeps G of 2G (§2.2.3; grpo_roc.py)
    5. balance      kept trajectories are spread across ranks by token count
    6. old logp     recomputed by the trainer; compared with the engine's (the sync guard, below)
    7. update       the clipped token-level loss of Eq. 6, one optimizer step, normalised by the GLOBAL token count
    8. log, checkpoint

Paper vs this file:
  - one optimizer step per RL step (the release's ppo_mini_batch_size covers the whole batch); mini_batches=k splits
    it into k steps on the same rollouts, for off-policy ablations.
  - warm-up: lr ramps linearly to `lr` over `warmup_steps`, starting at lr/warmup_steps, not 0 (verl starts at 0,
    which wastes step 0); then constant (§6.2).
  - weight decay 0.01 and grad clip 1.0 are verl defaults the paper does not state.
  - rollouts run on vLLM, not SGLang, in every rank's own process (no Ray).
  - algorithm=grpo is the paper's "GRPO with Tool" baseline (Fig. 9): G rollouts per prompt, all kept.
Guards against silent failure: after every weight sync the trainer's log-probs of the sampled tokens are compared with
the engine's (mean and max gap logged, a loud warning past logprob_gap_warn), so a broken sync shows on step 1;
tool-call rate and parse-failure rate are logged every step, so a policy that stops using the tool shows at once.

Tests: .venv/bin/python -m pytest tests/test_rl.py -q   (the invariance test: 1x1, 1x4, torchrun 2x2 micro-batches)
"""
import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

from common import ConfigError, load_config, resolve


# -----------------------------------------------------------------------------
# config: defaults are the paper's stage-1 values (§6.2, §6.3) where it gives one

@dataclasses.dataclass
class RLConfig:
    model: str = ""                          # HF directory (or hub id) of the SFT policy, with its tokenizer
    train_data: str = "data/train_int_mix.jsonl"
    out_dir: str = "out/rl"
    mode: Literal["train", "filter"] = "train"
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
    train_threads: int = 0                   # CPU only: torch threads while training (vLLM sets 1); 0 = all cores
    # guards
    logprob_gap_warn: float = 0.05           # warn when the mean |trainer - engine| log-prob gap exceeds this
    # checkpoints and logs
    save_every: int = 10
    keep_checkpoints: int = 2
    resume: str = "auto"                     # auto: newest complete checkpoint in out_dir/checkpoints; never; PATH
    eval_data: str = ""                      # held-out problems scored every eval_every steps (and at 0 and the end)
    eval_every: int = 0                      # 0 = only at the start and the end (when eval_data is set)
    eval_samples: int = 1                    # rollouts per eval problem
    eval_temperature: float = 0.6            # the paper's evaluation temperature (§8.1)
    wandb_project: str = ""
    tensorboard: bool = False
    # stage-3 filter (§6.3): `mode=filter` samples filter_samples per problem of filter_source with `model`,
    # drops the problems solved every time and writes the rest to train_data
    filter_source: str = ""
    filter_samples: int = 8

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
        for name in ("warmup_steps", "micro_batch_size", "eval_every", "world_size", "train_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")
        if self.dual_clip and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip={self.dual_clip}: must be 0 (off) or > 1")
        if self.mode == "filter" and not self.filter_source:
            raise ConfigError("mode=filter needs filter_source (the problems to filter); the kept ones go to train_data")


# -----------------------------------------------------------------------------
# data order: a fresh permutation per epoch from the seed, so a resumed run reads exactly the prompts the
# uninterrupted run would have read, given only the saved position

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
    """Linear warm-up over warmup_steps, then constant (§6.2). Step 0 already gets lr / warmup_steps."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr


# -----------------------------------------------------------------------------
# policy: an HF causal LM, FSDP2-sharded over all ranks

def load_policy(cfg, device):
    """The policy, FSDP2-sharded (fully_shard per decoder layer, then the root), and its AdamW optimizer."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    # Master weights stay fp32; on GPU the forward/backward runs in bf16 with fp32 gradient reduction. bf16 on an
    # AVX2 CPU is ~4.5x slower than fp32 (shared/docs/cpu-stack.md §2), so auto means fp32 there.
    compute = cfg.train_dtype if cfg.train_dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    # Every rank reads the checkpoint onto its CPU; fully_shard then moves one layer at a time to the device and
    # keeps only this rank's shard, so device memory never holds the full fp32 model.
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    policy = None if compute == "float32" else MixedPrecisionPolicy(param_dtype=getattr(torch, compute),
                                                                   reduce_dtype=torch.float32)
    kwargs = {"mp_policy": policy} if policy else {}
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"{cfg.model}: expected a decoder-only HF model with model.layers "
                          f"(Qwen/Llama layout); got {type(model).__name__}")
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    return model, optimizer


def full_weights(model, dtype):
    """(name, full tensor) for every parameter, one at a time, for the engine's in-place reload.

    Gathering one parameter at a time keeps the peak at one full tensor instead of the whole model on every rank.
    Names are the HF checkpoint names (FSDP2 does not rename parameters); a tied lm_head appears once, as the
    embedding, which is how the checkpoint stores it too.
    """
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        yield name, tensor.detach().to(dtype)


# -----------------------------------------------------------------------------
# the training step, callable on a fixed batch without any engine (tests/test_rl.py drives exactly this code)

@dataclasses.dataclass
class TrainSample:
    """One trajectory as the trainer sees it."""
    input_ids: list[int]           # prompt + response tokens
    prompt_len: int
    loss_mask: list[int]           # per response token: 1 = written by the model, 0 = tool output (never trained)
    advantage: float               # Eq. 7, shared by all tokens of the trajectory
    old_logprobs: list[float] | None = None    # per response token, recomputed by the trainer before the update
    engine_logprobs: list[float] | None = None  # per response token, as the engine sampled it (for the guard)


def micro_batches(samples, cfg):
    """Split this rank's samples into micro-batches under the token and size caps (longest first, so the padding
    per micro-batch stays small). Only memory depends on this: the loss is normalised by the global token count."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
    batches, current, longest = [], [], 0
    for i in order:
        length = len(samples[i].input_ids)
        if length > cfg.micro_batch_tokens:
            raise ConfigError(f"a trajectory of {length} tokens does not fit micro_batch_tokens="
                              f"{cfg.micro_batch_tokens}; raise it to at least max_prompt_tokens + max_response_tokens")
        grown = max(longest, length) * (len(current) + 1)
        full = cfg.micro_batch_size and len(current) >= cfg.micro_batch_size
        if current and (grown > cfg.micro_batch_tokens or full):
            batches.append(current)
            current, longest = [], 0
        current.append(samples[i])
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def equalize_micro_batches(batches):
    """FSDP2 runs collectives inside every forward and backward, so all ranks must run the same number of them: a
    rank with fewer micro-batches runs empty ones (one padding token, nothing masked in, zero gradient)."""
    count = torch.tensor([len(batches)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return batches + [[]] * (int(count) - len(batches))


def collate(batch, pad_id, device):
    """Padded tensors over the *target* positions 0..L-2 (position t predicts token t+1).

    Response token j sits at prompt_len + j and is predicted at prompt_len + j - 1. Right padding needs no
    attention mask: under causal attention no real token sees the padding after it.
    """
    if not batch:  # the empty micro-batch of equalize_micro_batches
        zeros = torch.zeros(1, 1, device=device)
        return torch.full((1, 2), pad_id, device=device), zeros, zeros.bool(), zeros[:, 0], zeros
    length = max(len(s.input_ids) for s in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(batch), length - 1)
    old = torch.zeros(len(batch), length - 1)
    engine = torch.zeros(len(batch), length - 1)
    for row, s in enumerate(batch):
        n = len(s.loss_mask)
        input_ids[row, :len(s.input_ids)] = torch.tensor(s.input_ids)
        at = slice(s.prompt_len - 1, s.prompt_len - 1 + n)
        mask[row, at] = torch.tensor(s.loss_mask, dtype=torch.float)
        if s.old_logprobs is not None:
            old[row, at] = torch.tensor(s.old_logprobs)
        if s.engine_logprobs is not None:
            engine[row, at] = torch.tensor(s.engine_logprobs)
    advantages = torch.tensor([s.advantage for s in batch])
    return (input_ids.to(device), old.to(device), mask.bool().to(device), advantages.to(device), engine.to(device))


def token_logprobs(model, input_ids, temperature):
    """log pi(token t+1 | tokens <= t) for every position, at the sampling temperature.

    One row at a time, so the fp32 log-softmax over a 150K vocabulary never holds [B, T, V] at once.
    """
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1]
    targets = input_ids[:, 1:]
    rows = []
    for row_logits, row_targets in zip(logits, targets):
        row = row_logits.float() / temperature
        rows.append(row.gather(-1, row_targets[:, None]).squeeze(-1) - row.logsumexp(-1))
    return torch.stack(rows)


@torch.no_grad()
def recompute_logprobs(model, samples, cfg, pad_id, device, temperature):
    """Fill each sample's old_logprobs with the trainer's log-probs under the current weights (step 6).

    The loss uses these, not the engine's: the ratio of Eq. 6 must start at exactly 1 for the policy being
    trained, whatever numeric differences the engine has (bf16 kernels, other attention code)."""
    for batch in equalize_micro_batches(micro_batches(samples, cfg)):
        input_ids, *_ = collate(batch, pad_id, device)
        logp = token_logprobs(model, input_ids, temperature).cpu()
        for row, s in enumerate(batch):
            s.old_logprobs = logp[row, s.prompt_len - 1: s.prompt_len - 1 + len(s.loss_mask)].tolist()


def logprob_gap(samples):
    """Mean and max |trainer - engine| over this rank's model-written tokens, summed for an all-reduce."""
    total, count, largest = 0.0, 0, 0.0
    for s in samples:
        if s.engine_logprobs is None:
            continue
        gap = np.abs(np.asarray(s.old_logprobs) - np.asarray(s.engine_logprobs))[np.asarray(s.loss_mask) > 0]
        total, count = total + float(gap.sum()), count + gap.size
        largest = max(largest, float(gap.max(initial=0.0)))
    return total, count, largest


def train_step(model, optimizer, samples, cfg, step, pad_id, device, temperature=1.0):
    """One optimizer step on this rank's `samples` (old_logprobs filled); every rank calls it together.

    The loss is Eq. 6: a sum over every model-written token of the GLOBAL batch (all micro-batches, all ranks),
    divided by that global count. Each micro-batch's loss is its own token sum over (global count / world size);
    FSDP averages gradients over ranks, which restores the division by the global count. So the gradient is the
    same however the batch is split, which is what the invariance test checks. (A per-micro-batch mean instead
    weighs a token of a short micro-batch more than one of a long one: the bug other frameworks shipped.)
    """
    from grpo_roc import policy_loss

    world_size = dist.get_world_size()
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    optimizer.zero_grad(set_to_none=True)
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
        input_ids, old, mask, advantages, _ = collate(batch, pad_id, device)
        logp = token_logprobs(model, input_ids, temperature)
        loss, metrics = policy_loss(logp, old, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                    num_tokens=per_rank_tokens, dual_clip=cfg.dual_clip or None)
        loss.backward()
        metrics["loss"] = loss.detach()
        ratio_max = torch.maximum(ratio_max, metrics.pop("ratio_max").cpu())
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value.detach().cpu()
    # The global grad norm, before clipping: a loss-scaling bug changes it even where AdamW's update would not.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    # Every summed metric was divided by the per-rank share of the tokens, so the rank mean is the global value.
    keys = sorted(sums)
    packed = torch.stack([torch.as_tensor(sums[k], dtype=torch.float32) for k in keys])
    dist.all_reduce(packed)
    dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
    out = {k: float(v) / world_size for k, v in zip(keys, packed)}
    out.update(ratio_max=float(ratio_max), grad_norm=float(grad_norm), lr=lr_at(step, cfg),
               num_micro_batches=len(batches), train_tokens=int(global_tokens.item()))
    return out
