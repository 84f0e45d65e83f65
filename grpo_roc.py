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
     Optionally each token is weighted by how much likelier the trainer finds it than the engine
     that sampled it (rollout_weights; off in the paper).

Paper vs released code (microsoft/rStar @ ecbfb94), and what this file does:
  - positives: the paper samples ~1/p, the release takes the k lowest p. Both: positive_rule.
  - penalty 0 (common: a clean run) has no rule in the paper; weight = 1/(p + 0.1) here.
  - p_format's num_turns: the release counts only turns after a tool response, so a clean
    no-tool answer scores 1; here every assistant turn counts, Eq. 5 as written (it scores 0).
  - p_err: the release greps tool responses for "error" (missing timeouts, parse failures);
    here the caller counts the executor's status flags.
  - negatives: uniform in both (the release dropped penalty-sorting them, rStar PR #50).
  - counts per side: positives round(|pos| * G / 2G) (halves to even), negatives the rest,
    then at least min(2, available) each. The release rounds both sides, which keeps G-1 or
    G+1 for odd G.
  - std: unbiased (torch.std in verl); the paper does not say which.
  - all-equal groups: dropped, as the release's reject_equal_reward; filter_groups(enabled=).
  - dual-clip (c = 3 on negative advantages) is a verl default the paper never mentions:
    off here unless policy_loss(dual_clip=3.0).
  - plain GRPO (the paper's ablation): select_group(mode="grpo"), G rollouts, no RoC.
  - rollout correction: Eq. 6 treats the engine that sampled (vLLM, its own kernels and dtype)
    and the trainer as one policy; neither paper nor release corrects the gap. rollout_weights
    offers the truncated / masked importance weights of Yao et al. 2025 (verl's rollout_corr,
    TRL's vllm_importance_sampling_*); "none" is the paper's objective.

Use: imported by rl.py. `python grpo_roc.py` walks one synthetic group through steps 1-4.
Tests: .venv/bin/python -m pytest tests/test_grpo_roc.py -q
"""
import math

import numpy as np
import torch

# -----------------------------------------------------------------------------
# Penalties that rank correct rollouts (Eq. 4-5)


def roc_penalty(num_tool_calls, num_tool_errors, num_answer_tags, num_turns,
                use_error_ratio=True, use_answer_format=True) -> float:
    """p_total = p_err + p_format of one rollout, in [0, 2]; lower means cleaner.

    num_tool_calls:  tool calls the model made, parsable or not.
    num_tool_errors: of those, calls that failed: executor status error / timeout / oom, plus
                     calls that did not parse. Count statuses, not the word "error" in output.
    num_answer_tags: closed <answer>...</answer> pairs (pass 0 for unbalanced tags, which the
                     release also scores 1).
    num_turns:       assistant turns, the first one included.
    The two switches mirror the release's roc_error_ratio / roc_answer_format, for ablations.
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
        raise ValueError("roc_penalty: num_turns must be >= 1 (every rollout has an assistant "
                         "turn)")
    # Eq. 4: 0.5 with no tool call at all, which nudges the policy to use the tool; a clean
    # tool user scores 0, one whose every call failed scores 1.
    p_err = 0.5 if num_tool_calls == 0 else num_tool_errors / num_tool_calls
    # Eq. 5: no answer is the worst format; otherwise each extra <answer> block costs 1/turns,
    # capped at 1, which targets rollouts that keep reasoning after they have answered.
    p_format = 1.0 if num_answer_tags == 0 else min(1.0, (num_answer_tags - 1) / num_turns)
    # A switched-off term counts 0, so the sampling then ranks positives by the other alone.
    return float(use_error_ratio * p_err + use_answer_format * p_format)


# -----------------------------------------------------------------------------
# Which groups and which rollouts are trained on (§2.2.3)


def filter_groups(group_rewards, enabled=True):
    """Drop question groups whose rewards are all equal. Returns (kept_indices, all_equal_fraction).

    All-correct or all-wrong groups get zero advantage everywhere (Eq. 7), so they would only
    dilute the token mean of Eq. 6. The release drops them and does not refill the batch; late
    in training most groups are all-correct ("over 70%", §4.3), so the fraction is worth logging.
    The fraction is measured even when the filter is off.
    """
    all_equal = []
    for g, rewards in enumerate(group_rewards):
        if len(rewards) == 0:
            raise ValueError(f"filter_groups: group {g} has no rewards")
        # Rewards are 0/1 (Eq. 3); the tolerance only absorbs float noise from summed scores.
        all_equal.append(max(rewards) - min(rewards) <= 1e-9)
    fraction = sum(all_equal) / len(all_equal) if all_equal else 0.0
    kept = [g for g, same in enumerate(all_equal) if not (enabled and same)]
    return kept, fraction


def _check_group(rewards, penalties, keep, rng, penalties_needed):
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), "
                        f"got {type(rng).__name__}")
    if isinstance(keep, bool) or not isinstance(keep, (int, np.integer)) or keep < 1:
        raise ValueError(f"keep must be a positive int, got {keep!r}")
    if not all(math.isfinite(r) for r in rewards):
        raise ValueError(f"rewards must be finite numbers, got {list(rewards)}")
    if penalties_needed:
        if penalties is None or len(penalties) != len(rewards):
            raise ValueError(f"need one penalty per rollout: {len(rewards)} rewards, "
                             f"{'no' if penalties is None else len(penalties)} penalties")
        if not all(math.isfinite(p) and p >= 0 for p in penalties):
            raise ValueError(f"penalties must be finite and >= 0, got {list(penalties)}")


def resample_on_correct(rewards, penalties, keep, rng, positive_rule="sample",
                        min_per_side=2, penalty_offset=0.1) -> list[int]:
    """Choose `keep` (= G) of one question's 2G rollouts; returns their indices in rollout order.

    rewards:   one per rollout; > 0 counts as correct (the release's rule).
    penalties: one roc_penalty per rollout; only the positives' are used.
    rng:       a numpy Generator; the same seed and inputs give the same selection.
    positive_rule: "sample" (paper): draw positives without replacement, one at a time, each
        with probability proportional to 1 / (penalty + penalty_offset). The offset gives a
        clean rollout (penalty 0) a finite weight: 0.1 is the smallest non-zero penalty within
        10 turns (1 failed call of 10), so a clean rollout is twice as likely as that one.
        "topk" (release): the positives with the lowest penalties, ties in rollout order.
    A group no larger than `keep` cannot be thinned and comes back whole (the release drops
    groups smaller than `keep`; here they are trained on as they are).
    """
    _check_group(rewards, penalties, keep, rng, penalties_needed=True)
    if positive_rule not in ("sample", "topk"):
        raise ValueError(f"positive_rule must be 'sample' or 'topk', got {positive_rule!r}")
    if penalty_offset <= 0:
        raise ValueError(f"penalty_offset must be > 0 (a penalty-0 rollout needs a finite weight), "
                         f"got {penalty_offset}")
    if keep < 2 * min_per_side:
        raise ValueError(f"keep ({keep}) must be at least 2 * min_per_side ({2 * min_per_side})")
    num_rollouts = len(rewards)
    if num_rollouts <= keep:
        return list(range(num_rollouts))
    positives = [i for i, r in enumerate(rewards) if r > 0]
    negatives = [i for i, r in enumerate(rewards) if r <= 0]

    # Each side keeps its share of the slots, which preserves the pos/neg ratio (§2.2.3:
    # both sides are halved). The positives' share is rounded, halves to even as in the
    # release, and the negatives take the rest, so exactly G are kept. The release rounds
    # both shares; that adds up to G only for even G: with odd G and an odd split both
    # shares end in .5 and round the same way (5 of 10, G = 5: round(2.5) + round(2.5) = 4).
    # Here, with G = 7 of 14, 5 correct keep 2 positives and 5 negatives (shares 2.5 and 4.5),
    # 7 correct keep 4 and 3 (shares 3.5 and 3.5): the spare slot goes to either side as
    # halves to even alternate, so neither is favoured, and before the 2-per-side minimum
    # each side is within half a slot of its exact share.
    num_pos = round(len(positives) * keep / num_rollouts)
    # At least min(2, available) of each outcome, so a lone success among 2G (share 0.5,
    # rounded to 0) is still learned from and the group keeps a contrast.
    num_pos = max(num_pos, min(min_per_side, len(positives)))
    num_pos = min(num_pos, keep - min(min_per_side, len(negatives)))
    num_neg = keep - num_pos

    # Negatives: a uniform subsample, "following their original distribution" (§2.2.3).
    kept_neg = rng.choice(negatives, size=num_neg, replace=False) if num_neg else []
    if positive_rule == "topk":
        kept_pos = sorted(positives, key=lambda i: (penalties[i], i))[:num_pos]
    elif num_pos:
        # numpy draws one at a time and renormalises over those left (successive sampling),
        # so "probability inversely proportional to p" holds for each draw, not overall.
        weights = 1.0 / (np.asarray([penalties[i] for i in positives], float) + penalty_offset)
        kept_pos = rng.choice(positives, size=num_pos, replace=False, p=weights / weights.sum())
    else:
        kept_pos = []
    # Rollout order, whatever the rule, so rl.py can index its trajectories with it directly.
    return sorted(int(i) for i in [*kept_pos, *kept_neg])


def rollouts_per_prompt(group_size, mode="roc") -> int:
    """How many rollouts rl.py samples per question: 2G for GRPO-RoC (§2.2.3), G for plain GRPO."""
    if mode not in ("roc", "grpo"):
        raise ValueError(f"mode must be 'roc' or 'grpo', got {mode!r}")
    return 2 * group_size if mode == "roc" else group_size


def select_group(rewards, penalties, keep, rng, mode="roc", positive_rule="sample",
                 **roc_options) -> list[int]:
    """The one call rl.py makes per group: RoC (mode="roc") or plain GRPO (mode="grpo").

    Plain GRPO is the paper's ablation baseline (§4.3): rl.py samples only G rollouts
    (rollouts_per_prompt), so this keeps them all. Given more, it thins them uniformly, which
    is distributed exactly like sampling G. Penalties may be None in this mode.
    """
    if mode == "roc":
        return resample_on_correct(rewards, penalties, keep, rng, positive_rule, **roc_options)
    if mode != "grpo":
        raise ValueError(f"mode must be 'roc' or 'grpo', got {mode!r}")
    _check_group(rewards, penalties, keep, rng, penalties_needed=False)
    if len(rewards) <= keep:
        return list(range(len(rewards)))
    # Rewards are ignored on purpose: the baseline must not prefer any outcome.
    return sorted(int(i) for i in rng.choice(len(rewards), size=keep, replace=False))


# -----------------------------------------------------------------------------
# Advantage (Eq. 7) and the clipped token-level loss (Eq. 6)


def group_advantages(rewards, eps=1e-6) -> list[float]:
    """A_i = (r_i - mean(r)) / (std(r) + eps) over the rollouts kept for one question (Eq. 7).

    std is the unbiased (n - 1) one, as torch.std in the release's verl GRPO; eps keeps an
    all-equal group at exactly 0. A lone rollout has nothing to be compared with: 0.
    Computed after RoC, on the G kept, not on the 2G sampled.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be a flat list of finite numbers, got {rewards!r}")
    if r.size < 2:
        return [0.0] * r.size
    return ((r - r.mean()) / (r.std(ddof=1) + eps)).tolist()


# Rollout correction (Yao et al. 2025): "none" is the paper's objective; the others weight each
# model-written token by the trainer's over the engine's probability, per token or per sequence
# (geometric mean), truncated at the threshold (tis) or dropped outside [1/threshold, threshold]
# (mis).
ROLLOUT_CORRECTIONS = ("none", "token_tis", "token_mis", "geometric_tis", "geometric_mis")


def rollout_weights(old_logp, engine_logp, mask, mode="none", threshold=2.0):
    """Importance weights for the gap between the engine that sampled and the trainer (detached).

    The tokens were drawn from pi_engine (vLLM: other kernels, often bf16), while Eq. 6's ratio
    starts from the trainer's pi_old: an unbiased gradient needs w = pi_old / pi_engine on each
    token. The raw ratio has unbounded variance, so it is tamed (Yao et al. 2025, "Your Efficient
    RL Framework Secretly Brings You Off-Policy RL Training"):
      token_tis:     w = min(rho, threshold), rho = exp(old - engine) per token (truncated IS);
      token_mis:     w = rho inside [1/threshold, threshold], else 0 (masked IS: the token
                     drops out of the loss but still counts in Eq. 6's denominator);
      geometric_*:   the same on the sequence's geometric mean exp(mean(old - engine)) over its
                     model-written tokens, shared by all of them. A plain product over 8K tokens
                     collapses towards 0 (trl#5814); the mean does not grow with length.
    old_logp, engine_logp, mask: [B, T], one row per sequence. Returns (w, ratio) as [B, T]:
    ratio is what w was taken from (per token, or the sequence's geometric mean broadcast to its
    tokens; per token for "none", where w is 1). With engine_logp == old_logp every w is exactly 1.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout correction must be one of {ROLLOUT_CORRECTIONS}, got {mode!r}")
    if not threshold > 1:
        raise ValueError(f"the rollout correction threshold must be > 1, got {threshold}")
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


def policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28,
                num_tokens=None, dual_clip=None, engine_logp=None, rollout_correction="none",
                rollout_is_threshold=2.0):
    """Clip-Higher PPO surrogate, summed over unmasked tokens and divided by num_tokens (Eq. 6).

    logp, old_logp: [B, T] log-probs of the sampled tokens under the current / rollout policy.
    advantages:     [B] (one per rollout, broadcast to its tokens, Eq. 7) or [B, T].
    mask:           [B, T], 1 on tokens the model wrote; 0 on prompt, tool output and padding.
    num_tokens:     the denominator. Eq. 6 divides by the tokens of the whole batch, so pass the
        global count over all micro-batches and ranks: then micro-batch losses (and gradients)
        add up to the full-batch token mean however the batch is split. DDP and FSDP average
        gradients over W ranks, so there pass global_count / W. None: this batch's own count.
    dual_clip:      None (paper), or c > 1 to bound the loss of negative-advantage tokens by
        c * |A| as verl does by default.
    engine_logp:    [B, T] the engine's log-probs of the same tokens, as it sampled them; None:
        taken equal to old_logp (no gap). rollout_correction, rollout_is_threshold: how the
        per-token loss is weighted for the gap (rollout_weights); the gap is measured whatever
        the setting.
    Returns (loss, metrics). Metrics are detached 0-dim tensors; all but those named *_max are
    divided by num_tokens too, so they also sum over micro-batches; *_max combine by max.
    """
    advantages = _checked_advantages(logp, old_logp, advantages, mask, clip_low, clip_high,
                                     dual_clip)
    mask = mask.bool()
    if num_tokens is None:
        num_tokens = mask.sum()
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0 (is every token masked?), got {num_tokens}")
    # The advantage and the rollout policy's log-probs are constants of the objective (Eq. 6):
    # gradients flow only through pi_theta.
    advantages, old_logp = advantages.detach(), old_logp.detach()
    engine_logp = old_logp if engine_logp is None else engine_logp.detach()
    weights, weighted_ratio = rollout_weights(old_logp, engine_logp, mask, rollout_correction,
                                              rollout_is_threshold)

    # Importance ratio rho = pi_theta / pi_old per token. Padding may hold any value, even
    # -inf, so masked positions get ratio 1 before exp() can turn them into inf or nan.
    log_ratio = torch.where(mask, logp - old_logp, 0.0)
    ratio = torch.exp(log_ratio)
    # min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A), negated for a loss. The clip stops
    # the update once a token moved far enough; the higher upper bound (DAPO's Clip-Higher)
    # lets unlikely tokens of good rollouts grow more, which delays entropy collapse. With one
    # optimizer step per RL step (mini_batches: 1, every shipped config) the update is
    # on-policy: old_logp is the same weights' log-prob, rho is exactly 1, the clip never binds
    # and a KL-to-old term would have zero gradient; with a rollout correction on, the
    # engine-vs-trainer weight is what departs from 1. The clip acts from the second optimizer
    # step on the same rollouts (mini_batches > 1).
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        # For A < 0 an exploded ratio would give an unbounded loss; cap it at c * |A|.
        per_token = torch.where(advantages < 0,
                                torch.minimum(per_token, -dual_clip * advantages), per_token)
    if rollout_correction != "none":
        per_token = per_token * weights  # a constant factor per token, as verl and TRL apply it
    # Token-level normalisation (Eq. 6): every token of the batch weighs the same, so long
    # rollouts are not down-weighted as a per-sequence mean would do.
    loss = torch.where(mask, per_token, 0.0).sum() / num_tokens

    with torch.no_grad():
        metrics = _loss_metrics(ratio, log_ratio, advantages, mask, clip_low, clip_high, num_tokens)
        metrics.update(_rollout_metrics(weights, weighted_ratio, old_logp - engine_logp, mask,
                                        rollout_correction, rollout_is_threshold, num_tokens))
    return loss, metrics


def _checked_advantages(logp, old_logp, advantages, mask, clip_low, clip_high, dual_clip):
    """policy_loss's arguments checked; the advantages as [B, 1] or [B, T]."""
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"logp, old_logp and mask must share one [B, T] shape, got "
                         f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(mask.shape)}")
    if advantages.shape == logp.shape[:1]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != logp.shape:
        raise ValueError(f"advantages must be [B] or [B, T] for logp {tuple(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be None or > 1, got {dual_clip}")
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


def _rollout_metrics(weights, weighted_ratio, log_rho, mask, mode, threshold, num_tokens):
    """The engine-vs-trainer gap and what the correction did, over the model-written tokens,
    whatever the setting (verl logs the like under rollout_corr/): the mean of
    log rho = log(pi_old / pi_engine); k3_kl, the k3 estimate of KL(pi_engine || pi_old) from
    the tokens the engine sampled (non-negative, low variance); the largest token rho; the
    weights' mean and max (1 with none); the fractions of tokens truncated to the threshold (tis)
    or masked out (mis)."""
    def token_sum(values):
        return torch.where(mask, values, 0.0).sum() / num_tokens

    log_rho = torch.where(mask, log_rho, 0.0)
    rho = torch.exp(log_rho)
    truncated = mode.endswith("tis") & (weighted_ratio > threshold)
    masked = mode.endswith("mis") & (weights == 0)
    return {
        "rollout_corr/log_ratio_mean": token_sum(log_rho),
        # rho - 1 - log rho as expm1: for a gap of 1e-6 the plain form is all rounding; >= 0
        "rollout_corr/k3_kl": token_sum((torch.expm1(log_rho) - log_rho).clamp(min=0)),
        "rollout_corr/ratio_max": torch.where(mask, rho, 0.0).max(),
        "rollout_corr/weight_mean": token_sum(weights),
        "rollout_corr/weight_max": torch.where(mask, weights, 0.0).max(),
        "rollout_corr/truncated_fraction": token_sum(truncated.to(rho.dtype)),
        "rollout_corr/masked_fraction": token_sum(masked.to(rho.dtype)),
    }


# -----------------------------------------------------------------------------
# A worked example: one synthetic group through steps 1-4

if __name__ == "__main__":
    group_size = 4
    rng = np.random.default_rng(0)
    # 2G = 8 rollouts: (tool calls, failed calls, <answer> blocks, assistant turns, reward)
    rollouts = [(3, 0, 1, 4, 1.0), (2, 2, 1, 3, 1.0), (0, 0, 1, 1, 1.0), (4, 1, 3, 5, 1.0),
                (1, 0, 1, 2, 0.0), (5, 5, 0, 6, 0.0), (2, 1, 1, 3, 0.0), (0, 0, 1, 1, 0.0)]
    rewards = [r[4] for r in rollouts]
    penalties = [roc_penalty(*r[:4]) for r in rollouts]
    kept_groups, all_equal_fraction = filter_groups([rewards])
    kept = select_group(rewards, penalties, group_size, rng, mode="roc")
    advantages = group_advantages([rewards[i] for i in kept])
    topk = select_group(rewards, penalties, group_size, rng, positive_rule="topk")
    print(f"all-equal groups: {all_equal_fraction:.0%}; kept rollouts: {kept} "
          f"(topk would keep {topk})")
    for i, (calls, errors, tags, turns, reward) in enumerate(rollouts):
        advantage = f"{advantages[kept.index(i)]:+.3f}" if i in kept else "dropped"
        print(f"rollout {i}: reward {reward:.0f}  calls {calls} failed {errors} answers {tags} "
              f"turns {turns}  penalty {penalties[i]:.2f}  advantage {advantage}")
