"""GRPO-RoC, the RL objective of rStar2-Agent (arXiv 2508.20722, §2.2), in one file.

For each question the policy writes 2G rollouts that may call a Python tool (rl.py does that).
  1. Reward r_i is 1 if the boxed answer is right, else 0 (Eq. 3). No format or tool reward.
  2. Groups whose rewards are all equal carry no signal and are dropped (filter_groups).
  3. Resample-on-Correct keeps G of the 2G (resample_on_correct):
     - negatives (r = 0) are subsampled uniformly, keeping the many ways of failing;
     - positives (r = 1) are sampled with probability inversely proportional to a penalty
       p = p_err (Eq. 4, share of failed tool calls) + p_format (Eq. 5, repeated <answer>s),
       so right answers reached through noisy tool use are reinforced less often (roc_penalty);
     - each side keeps its share of the slots, so the pos/neg ratio of the 2G is preserved.
     The penalty only chooses which positives are trained on; it never enters the reward.
  4. Advantage A_i = (r_i - mean r) / std r over the G kept, shared by all tokens of o_i (Eq. 7).
  5. Loss: PPO's clipped surrogate with Clip-Higher (eps_low 0.2, eps_high 0.28), averaged over
     every model-written token of the batch (token-level, Eq. 6). No KL, no entropy term (§2.2.1).
     The clip binds only with mini_batches > 1 (several optimizer steps on the same rollouts):
     with one step per RL step, every shipped config, rho = pi_theta / pi_old is exactly 1 and
     only a rollout correction's weight departs from 1. So clip_low, clip_high, dual_clip and
     ratio_level cannot act there (policy_loss says why; rl.RLConfig.inert_keys says so at start).

Paper vs released code (microsoft/rStar @ ecbfb94), and what this file does:
  - positives: the paper samples ~1/p, the release takes the k lowest p: POSITIVE_RULES.
  - penalty 0 has no rule in the paper; weight 1/(p + 0.1). p_format counts every assistant
    turn (Eq. 5 as written; the release only those after a tool response); p_err counts the
    executor's status flags (the release greps tool output for "error").
  - counts per side: positives round(|pos| * G / 2G) (halves to even), negatives the rest,
    then at least min(2, available) each (the release rounds both: G +- 1 for odd G).
  - std: unbiased (torch.std in verl). dual-clip (a verl default, not in the paper): off.
  - plain GRPO (the paper's ablation): select_group(mode="grpo"), G rollouts, no RoC.
The field's other choices, each off by default (rl.py keys; docs/design.md's table): rollout
correction (Yao et al. 2025), advantage_scaling, loss_aggregation (loss_weights), ratio_level.

Use: imported by rl.py; tests/test_grpo_roc.py walks one synthetic group through steps 1-4.
Tests: .venv/bin/python -m pytest tests/test_grpo_roc.py -q
"""
import dataclasses
import math

import numpy as np
import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------
# Penalties that rank correct rollouts (Eq. 4-5)


def roc_penalty(num_tool_calls, num_tool_errors, num_answer_tags, num_turns,
                use_error_ratio=True, use_answer_format=True) -> float:
    """p_total = p_err + p_format of one rollout, in [0, 2]; lower means cleaner.

    num_tool_errors counts failed calls (executor status error / timeout / oom, unparsable);
    num_answer_tags closed <answer> pairs; num_turns assistant turns. The two switches mirror
    the release's roc_error_ratio / roc_answer_format.
    """
    counts = dict(num_tool_calls=num_tool_calls, num_tool_errors=num_tool_errors,
                  num_answer_tags=num_answer_tags, num_turns=num_turns)
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"roc_penalty: {name} must be a non-negative int, got {value!r}")
    if num_tool_errors > num_tool_calls:
        raise ValueError(f"roc_penalty: num_tool_errors ({num_tool_errors}) exceeds "
                         f"num_tool_calls ({num_tool_calls})")
    if num_turns < 1:
        raise ValueError("roc_penalty: num_turns must be >= 1 (the first assistant turn)")

    # Eq. 4: 0.5 with no tool call at all, which nudges the policy to use the tool; a clean
    # tool user scores 0, one whose every call failed scores 1.
    p_err = 0.5 if num_tool_calls == 0 else num_tool_errors / num_tool_calls
    # Eq. 5: no answer is the worst format; otherwise each extra <answer> block costs 1/turns,
    # capped at 1, which targets rollouts that keep reasoning after they have answered.
    p_format = 1.0 if num_answer_tags == 0 else min(1.0, (num_answer_tags - 1) / num_turns)
    return float(use_error_ratio * p_err + use_answer_format * p_format)


@dataclasses.dataclass
class Rollout:
    """What a selection rule may read about one trajectory (rl.select_samples fills it)."""
    reward: float
    penalty: float = 0.0        # roc_penalty: p_err + p_format
    response_tokens: int = 0    # everything after the prompt, tool output included
    tool_calls: int = 0
    tool_errors: int = 0        # failed calls, by executor status, unparsable ones included
    errors_by_kind: dict = dataclasses.field(default_factory=dict)  # {"timeout": 1, ...}
    answer_tags: int = 0
    turns: int = 1


def as_rollout(t, reward, use_error_ratio=True, use_answer_format=True) -> Rollout:
    """A rollout.Trajectory (or a saved record's fields) with its reward, as a Rollout."""
    turns = max(t.num_turns, 1)
    penalty = roc_penalty(t.num_tool_calls, t.num_tool_errors, t.num_answer_tags, turns,
                          use_error_ratio, use_answer_format)
    return Rollout(reward, penalty, len(t.response_ids), t.num_tool_calls, t.num_tool_errors,
                   dict(t.tool_errors_by_kind), t.num_answer_tags, turns)


# -----------------------------------------------------------------------------
# Which groups and which rollouts are trained on (§2.2.3)


def filter_groups(group_rewards, enabled=True):
    """Drop question groups whose rewards are all equal. Returns (kept_indices, all_equal_fraction).
    Their advantages are all 0 (Eq. 7): they would only dilute Eq. 6's token mean. The release
    drops them too; late in training most groups are all-correct ("over 70%", §4.3), so the
    fraction is logged, even when the filter is off."""
    all_equal = []
    for g, rewards in enumerate(group_rewards):
        if len(rewards) == 0:
            raise ValueError(f"filter_groups: group {g} has no rewards")
        # Rewards are 0/1 (Eq. 3); the tolerance only absorbs float noise from summed scores.
        all_equal.append(max(rewards) - min(rewards) <= 1e-9)
    fraction = sum(all_equal) / len(all_equal) if all_equal else 0.0
    kept = [g for g, same in enumerate(all_equal) if not (enabled and same)]
    return kept, fraction


# A clean rollout (penalty 0) needs a finite weight: 0.1 is the smallest non-zero penalty within
# 10 turns (1 failed call of 10), so a clean rollout is twice as likely as that one.
PENALTY_OFFSET = 0.1


def sample_by_penalty(rollouts, positives, count, rng):
    """The paper: draw without replacement, each with probability ~ 1 / (penalty + 0.1). numpy
    draws one at a time and renormalises over those left, so "inversely proportional" holds for
    each draw, not overall."""
    weights = 1.0 / (np.asarray([rollouts[i].penalty for i in positives], float) + PENALTY_OFFSET)
    return rng.choice(positives, size=count, replace=False, p=weights / weights.sum())


def lowest_penalty(rollouts, positives, count, rng):
    """The release: the positives with the lowest penalties, ties in rollout order."""
    return sorted(positives, key=lambda i: (rollouts[i].penalty, i))[:count]


def shortest(rollouts, positives, count, rng):
    """An example rule: the fewest response tokens among the correct, ties in rollout order. It
    reads no penalty, so roc_error_ratio and roc_answer_format cannot act with it."""
    return sorted(positives, key=lambda i: (rollouts[i].response_tokens, i))[:count]


# The positive rules: a new one is a function (rollouts, positive indices, count, rng) -> the
# `count` kept, and its name here; rl.py's positive_rule takes its values from this mapping.
POSITIVE_RULES = {"sample": sample_by_penalty, "topk": lowest_penalty, "shortest": shortest}


def _check_group(rollouts, keep, rng):
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), "
                        f"got {type(rng).__name__}")
    if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or keep < 1:
        raise ValueError(f"keep must be a positive int, got {keep!r}")
    if not all(math.isfinite(r.reward) for r in rollouts):
        raise ValueError(f"rewards must be finite numbers, got {[r.reward for r in rollouts]}")
    if not all(math.isfinite(r.penalty) and r.penalty >= 0 for r in rollouts):
        raise ValueError(f"penalties must be finite and >= 0, got {[r.penalty for r in rollouts]}")


def resample_on_correct(rollouts, keep, rng, positive_rule="sample", min_per_side=2) -> list[int]:
    """Choose `keep` (= G) of one question's 2G Rollouts; returns their indices in rollout order.
    Reward > 0 is correct (as the release). Negatives are a uniform subsample, positives chosen
    by POSITIVE_RULES[positive_rule]; the same rng seed and inputs give the same selection. A
    group no larger than `keep` comes back whole (the release drops it)."""
    _check_group(rollouts, keep, rng)
    if keep < 2 * min_per_side:
        raise ValueError(f"keep ({keep}) must be at least 2 * min_per_side ({2 * min_per_side})")
    num_rollouts = len(rollouts)
    if num_rollouts <= keep:
        return list(range(num_rollouts))
    positives = [i for i, r in enumerate(rollouts) if r.reward > 0]
    negatives = [i for i, r in enumerate(rollouts) if r.reward <= 0]

    # Each side keeps its share of the slots (§2.2.3: both sides are halved). The positives'
    # share is rounded, halves to even as in the release, the negatives take the rest, so
    # exactly G are kept (G = 7 of 14: 5 correct keep 2 + 5, 7 correct keep 4 + 3).
    num_pos = round(len(positives) * keep / num_rollouts)
    # At least min(2, available) of each outcome, so a lone success among 2G (share 0.5,
    # rounded to 0) is still learned from and the group keeps a contrast.
    num_pos = max(num_pos, min(min_per_side, len(positives)))
    num_pos = min(num_pos, keep - min(min_per_side, len(negatives)))
    num_neg = keep - num_pos

    # Negatives: a uniform subsample, "following their original distribution" (§2.2.3).
    kept_neg = rng.choice(negatives, size=num_neg, replace=False) if num_neg else []
    kept_pos = POSITIVE_RULES[positive_rule](rollouts, positives, num_pos, rng) if num_pos else []
    # Rollout order, whatever the rule, so rl.py can index its trajectories with it directly.
    return sorted(int(i) for i in [*kept_pos, *kept_neg])


def select_group(rollouts, keep, rng, mode="roc", positive_rule="sample", **roc_options):
    """The one call rl.py makes per group: RoC (mode="roc") or plain GRPO (mode="grpo"), the
    paper's baseline (§4.3): rl.py samples G rollouts, all kept; more are thinned uniformly,
    distributed exactly like sampling G. GRPO chooses nothing by outcome: positive_rule and the
    penalty's switches cannot act there."""
    if mode == "roc":
        return resample_on_correct(rollouts, keep, rng, positive_rule, **roc_options)
    _check_group(rollouts, keep, rng)
    if len(rollouts) <= keep:
        return list(range(len(rollouts)))
    # Rewards are ignored on purpose: the baseline must not prefer any outcome.
    return sorted(int(i) for i in rng.choice(len(rollouts), size=keep, replace=False))


# -----------------------------------------------------------------------------
# Advantage (Eq. 7) and the clipped token-level loss (Eq. 6)

# group: Eq. 7; batch: one std over the whole step (TRL scale_rewards="batch"); none: Dr. GRPO's
# mean-centred rewards (Liu et al. 2025; TRL scale_rewards="none", verl norm_adv_by_std_in_grpo)
ADVANTAGE_SCALINGS = ("group", "batch", "none")


def group_advantages(rewards, scaling="group", batch_std=None, eps=1e-6) -> list[float]:
    """A_i = (r_i - mean(r)) / (std(r) + eps) over the rollouts kept for one question (Eq. 7).

    Unbiased std (torch.std in the release's verl); eps keeps an all-equal group at 0; a lone
    rollout gets 0. Over the G kept after RoC, not the 2G sampled. scaling="batch" divides by
    batch_std (batch_reward_std) instead, "none" by nothing."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be a flat list of finite numbers, got {rewards!r}")
    if r.size < 2:
        return [0.0] * r.size
    if scaling == "none":
        return (r - r.mean()).tolist()
    std = r.std(ddof=1) if scaling == "group" else batch_std
    return ((r - r.mean()) / (std + eps)).tolist()


def batch_reward_std(group_rewards):
    """advantage_scaling=batch: the unbiased std of every reward the step sampled, over all ranks
    (a collective when torch.distributed is up: every rank calls it)."""
    flat = np.asarray([r for rewards in group_rewards for r in rewards], np.float64)
    sums = torch.tensor([flat.size, flat.sum(), (flat * flat).sum()], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sums)
    n, total, squares = sums.tolist()
    return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1)) if n > 1 else 0.0


# Rollout correction (Yao et al. 2025): "none" is the paper's objective; the others weight each
# model-written token by the trainer's over the engine's probability, per token or per sequence
# (geometric mean), truncated at the threshold (tis) or dropped outside [1/threshold, threshold]
# (mis). verl: rollout_corr; TRL: vllm_importance_sampling_*.
ROLLOUT_CORRECTIONS = ("none", "token_tis", "token_mis", "geometric_tis", "geometric_mis")


def rollout_weights(old_logp, engine_logp, mask, mode="none", threshold=2.0):
    """Importance weights for the gap between the engine that sampled and the trainer (detached).

    The tokens were drawn from pi_engine (vLLM: other kernels, often bf16), while Eq. 6's ratio
    starts from the trainer's pi_old: an unbiased gradient needs w = pi_old / pi_engine on each
    token, tamed because the raw ratio has unbounded variance:
      token_tis:     w = min(rho, threshold), rho = exp(old - engine) per token (truncated IS);
      token_mis:     w = rho inside [1/threshold, threshold], else 0 (masked IS: the token
                     drops out of the loss but still counts in Eq. 6's denominator);
      geometric_*:   the same on the sequence's geometric mean exp(mean(old - engine)): a
                     product over 8K tokens collapses towards 0 (trl#5814), the mean does not.
    Returns (w, ratio) as [B, T]: ratio is what w was taken from; w is 1 for "none".
    """
    with torch.no_grad():
        log_ratio = torch.where(mask, old_logp - engine_logp, 0.0)
        if mode.startswith("geometric"):
            tokens = mask.sum(-1, keepdim=True).clamp(min=1)
            log_ratio = (log_ratio.sum(-1, keepdim=True) / tokens).expand_as(log_ratio)
        ratio = torch.exp(log_ratio)
        if mode == "none":
            return torch.ones_like(ratio), ratio
        if mode.endswith("tis"):
            return ratio.clamp(max=threshold), ratio
        return torch.where((ratio >= 1 / threshold) & (ratio <= threshold), ratio, 0.0), ratio


@torch.no_grad()
def rollout_correction(old_logp, engine_logp, mask, mode, threshold, num_tokens):
    """(policy_loss's weights, None for "none"; the gap's metrics whatever the mode, as verl's
    rollout_corr/: mean log rho, rho = pi_old / pi_engine; k3_kl, the k3 estimate of
    KL(pi_engine || pi_old); the largest rho; the weights' mean and max; the fractions of tokens
    truncated (tis) or masked out (mis)), over the model-written tokens / num_tokens, so they
    sum over micro-batches. engine_logp None: no gap."""
    engine_logp = old_logp if engine_logp is None else engine_logp
    mask = mask.bool()
    weights, ratio = rollout_weights(old_logp, engine_logp, mask, mode, threshold)

    def token_sum(values):
        return torch.where(mask, values, 0.0).sum() / num_tokens

    log_rho = torch.where(mask, old_logp - engine_logp, 0.0)
    rho = torch.exp(log_rho)
    truncated = mode.endswith("tis") & (ratio > threshold)
    masked = mode.endswith("mis") & (weights == 0)
    metrics = {
        "rollout_corr/log_ratio_mean": token_sum(log_rho),
        # rho - 1 - log rho as expm1: for a gap of 1e-6 the plain form is all rounding; >= 0
        "rollout_corr/k3_kl": token_sum((torch.expm1(log_rho) - log_rho).clamp(min=0)),
        "rollout_corr/ratio_max": torch.where(mask, rho, 0.0).max(),
        "rollout_corr/weight_mean": token_sum(weights),
        "rollout_corr/weight_max": torch.where(mask, weights, 0.0).max(),
        "rollout_corr/truncated_fraction": token_sum(truncated.to(rho.dtype)),
        "rollout_corr/masked_fraction": token_sum(masked.to(rho.dtype)),
    }
    return (None if mode == "none" else weights), metrics


# token_mean: Eq. 6, every token of the batch weighs the same (verl loss_agg_mode "token-mean",
# TRL loss_type "dapo"); seq_mean_token_mean: each rollout's token mean, averaged over rollouts
# (verl "seq-mean-token-mean", TRL "grpo"); seq_mean_token_sum_norm: Dr. GRPO's token sums over
# a fixed length (verl "seq-mean-token-sum-norm", TRL "dr_grpo").
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def loss_weights(mask, aggregation, num_tokens, num_sequences, max_tokens, weights=None):
    """`weights` (a correction's, or None) times the per-token factors that turn policy_loss's
    sum / num_tokens into `aggregation`: token_mean none (Eq. 6); seq_mean_token_mean
    num_tokens / (|o_i| num_sequences); seq_mean_token_sum_norm num_tokens / (max_tokens
    num_sequences). num_sequences is global as num_tokens is (over micro-batches and ranks,
    divided by the world size), so the gradient does not depend on the split."""
    if aggregation == "token_mean":
        return weights
    lengths = (mask.sum(-1, keepdim=True).clamp(min=1).double()
               if aggregation == "seq_mean_token_mean" else float(max_tokens))
    factor = float(num_tokens) / (lengths * num_sequences)  # float64: a constant's precision
    return factor if weights is None else weights * factor


RATIO_LEVELS = ("token", "sequence")


def policy_loss(logp, old_logp, advantages, mask, num_tokens=None, clip_low=0.2, clip_high=0.28,
                dual_clip=None, weights=None, ratio_level="token"):
    """Clip-Higher PPO surrogate, summed over unmasked tokens and divided by num_tokens (Eq. 6).

    logp, old_logp: [B, T] log-probs of the sampled tokens under the current / rollout policy.
    advantages:     [B] (one per rollout, broadcast to its tokens, Eq. 7) or [B, T].
    mask:           [B, T], 1 on tokens the model wrote; 0 on prompt, tool output and padding.
    num_tokens:     the whole batch's tokens (all micro-batches and ranks) / the W ranks FSDP
        averages gradients over: micro-batch losses and gradients then add up to the full-batch
        token mean however the batch is split. None: this batch's own count.
    dual_clip:      None (paper), or c > 1 to bound negative-advantage tokens' loss by c * |A|.
    weights:        None, or constant factors on each token's loss ([B, T] or [B, 1]):
        rollout_correction's and loss_weights'.
    ratio_level:    "token" (paper); "sequence": GSPO's one ratio per rollout, the geometric
        mean of its tokens' (Zheng et al. 2025; TRL importance_sampling_level="sequence").
    At ratio 1 (old_logp = logp, rl.py's one step per batch) the clip and dual-clip leave the
    value and gradient alone, and the sequence ratio exp(mean_t log rho_t) gives each of a
    rollout's |o| tokens (1/|o|) sum_t grad log pi_t: in all, the token ratio's gradient, under
    any weights constant within a rollout (every aggregation, a geometric_* correction; not a
    token_* one).
    Returns (loss, metrics): metrics over num_tokens too, to sum over micro-batches (*_max: max).
    """
    advantages = _checked_advantages(logp, old_logp, advantages, mask)
    mask = mask.bool()
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0 (is every token masked?), got {num_tokens}")

    # The advantage and the rollout policy's log-probs are constants of the objective (Eq. 6):
    # gradients flow only through pi_theta.
    advantages, old_logp = advantages.detach(), old_logp.detach()

    # rho = pi_theta / pi_old per token. Padding may hold any value, even -inf, so masked
    # positions get ratio 1 before exp() can turn them into inf or nan.
    log_ratio = torch.where(mask, logp - old_logp, 0.0)
    if ratio_level == "sequence":
        per_rollout = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = torch.where(mask, per_rollout, 0.0)
    ratio = torch.exp(log_ratio)

    # min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), negated for a loss (Clip-Higher above).
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:  # for A < 0 an exploded ratio would give an unbounded loss
        per_token = torch.where(advantages < 0,
                                torch.minimum(per_token, -dual_clip * advantages), per_token)
    if weights is not None:
        per_token = per_token * torch.as_tensor(weights, dtype=per_token.dtype)  # constants

    # Token-level normalisation (Eq. 6): every token of the batch weighs the same, so long
    # rollouts are not down-weighted as a per-sequence mean would do.
    loss = torch.where(mask, per_token, 0.0).sum() / num_tokens
    with torch.no_grad():
        metrics = _loss_metrics(ratio, log_ratio, advantages, mask, clip_low, clip_high, num_tokens)
    return loss, metrics


def _checked_advantages(logp, old_logp, advantages, mask):
    """policy_loss's tensors checked (the clip and ratio settings are rl.py's keys, checked there);
    the advantages as [B, 1] or [B, T]."""
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"logp, old_logp and mask must share one [B, T] shape, got "
                         f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}")
    if advantages.shape == logp.shape[:1]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != logp.shape:
        raise ValueError(f"advantages must be [B] or [B, T] for logp {tuple(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")
    return advantages


def _loss_metrics(ratio, log_ratio, advantages, mask, clip_low, clip_high, num_tokens):
    """Detached metrics of policy_loss, over the same denominator as the loss, so that summing
    them over micro-batches gives global values (ratio_max combines by max)."""
    # Where the clip is active the token gets no gradient: that fraction, per side.
    clipped_low = mask & (ratio < 1 - clip_low) & (advantages < 0)
    clipped_high = mask & (ratio > 1 + clip_high) & (advantages > 0)
    # k3 estimator of KL(pi_old || pi_theta): non-negative, low variance (Schulman 2020).
    kl_per_token = torch.where(mask, ratio - 1 - log_ratio, 0.0)
    return {
        "clip_low_fraction": clipped_low.sum() / num_tokens,
        "clip_high_fraction": clipped_high.sum() / num_tokens,
        "approx_kl": kl_per_token.sum() / num_tokens,
        "ratio_mean": torch.where(mask, ratio, 0.0).sum() / num_tokens,
        "ratio_max": torch.where(mask, ratio, 0.0).max(),
    }
