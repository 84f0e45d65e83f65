"""Behaviour of grpo_roc.py: RoC penalties, selection, group advantages, the token-level loss and
its rollout correction."""
import itertools
import math
import random

import numpy as np
import pytest
import torch

from grpo_roc import (LOSS_AGGREGATIONS, POSITIVE_RULES, ROLLOUT_CORRECTIONS, Rollout,
                      batch_reward_std, filter_groups, group_advantages, loss_weights,
                      policy_loss, resample_on_correct, roc_penalty, rollout_correction,
                      rollout_weights, select_group)

# roc_penalty: Eq. 4 (p_err) + Eq. 5 (p_format)


@pytest.mark.parametrize("counts, penalty", [
    ((3, 0, 1, 4), 0.0),     # a clean tool user with one answer
    ((4, 1, 1, 5), 0.25),    # p_err: failed calls over all calls
    ((2, 2, 1, 3), 1.0),
    # no call costs half; Eq. 5 as written gives a single-turn answer no format penalty (the
    # released code would give p_format = 1, total 1.5)
    ((0, 0, 1, 1), 0.5),
    ((3, 0, 3, 5), 2 / 5),   # p_format: extra answers per turn, capped at 1
    ((3, 0, 9, 2), 1.0),
    ((3, 0, 0, 4), 1.0),     # no answer at all
    ((0, 0, 0, 1), 1.5),     # the worst: no tool, no answer
])
def test_roc_penalty_is_the_error_ratio_plus_the_format_penalty(counts, penalty):
    assert roc_penalty(*counts) == pytest.approx(penalty)
    # each term can be switched off
    errors, answers = roc_penalty(*counts, use_answer_format=False), roc_penalty(
        *counts, use_error_ratio=False)
    assert errors + answers == pytest.approx(penalty)
    assert roc_penalty(*counts, use_error_ratio=False, use_answer_format=False) == 0.0


@pytest.mark.parametrize("args, message", [
    ((2, 3, 1, 1), "num_tool_errors"), ((-1, 0, 1, 1), "num_tool_calls"),
    ((1, 0, 1.0, 1), "num_answer_tags"), ((1, 0, 1, 0), "num_turns"),
])
def test_roc_penalty_rejects_impossible_counts(args, message):
    with pytest.raises(ValueError, match=message):
        roc_penalty(*args)


# filter_groups


def test_filter_drops_all_equal_groups_and_reports_their_fraction_even_when_off():
    assert filter_groups([[1, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 0]]) == ([0, 3], 0.5)
    assert filter_groups([[1, 1], [0, 1], [0, 0]], enabled=False) == ([0, 1, 2], 2 / 3)
    assert filter_groups([]) == ([], 0.0)
    with pytest.raises(ValueError, match="group 1 has no rewards"):
        filter_groups([[1, 0], []])


# resample_on_correct: counts, determinism, and who gets picked

def _rollouts(rewards, penalties=None, lengths=None):
    return [Rollout(r, 0.0 if penalties is None else penalties[i],
                    0 if lengths is None else lengths[i]) for i, r in enumerate(rewards)]


def _group(num_pos, num_rollouts, penalty_fn=lambda i: 0.1 * (i % 7)):
    """num_pos correct rollouts spread through the group, with varied penalties and lengths."""
    correct = set(np.random.default_rng(num_pos).choice(num_rollouts, num_pos, replace=False))
    rewards = [1.0 if i in correct else 0.0 for i in range(num_rollouts)]
    return _rollouts(rewards, [penalty_fn(i) for i in range(num_rollouts)],
                     [50 + 37 * i % 23 for i in range(num_rollouts)])


ALL_RULES = list(POSITIVE_RULES)  # every rule in the mapping gets the invariant tests


# Kept positives of G for each number of positives among 2G, by hand: round(n / 2), halves to even,
# then at least min(2, available) of each side; for an odd G negatives take the rest (the release's
# two rounded shares would add up to 6 or 8 of G = 7).
EXPECTED_KEPT_POSITIVES = {
    16: [0, 1, 2, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 8, 8,
         8, 9, 10, 10, 10, 11, 12, 12, 12, 13, 14, 14, 14, 14, 15, 16],
    7: [0, 1, 2, 2, 2, 2, 3, 4, 4, 4, 5, 5, 5, 6, 7]}


@pytest.mark.parametrize("rule", ALL_RULES)
@pytest.mark.parametrize("keep", [4, 5, 7, 8, 9, 16])
def test_pos_neg_ratio_preserved_for_every_split_of_2g(keep, rule):
    for num_pos in range(2 * keep + 1):
        rollouts = _group(num_pos, 2 * keep)
        kept = resample_on_correct(rollouts, keep, np.random.default_rng(1), rule)
        kept_pos = sum(rollouts[i].reward for i in kept)
        kept_neg = keep - kept_pos
        assert len(kept) == len(set(kept)) == keep and kept == sorted(kept), num_pos
        if keep in EXPECTED_KEPT_POSITIVES:
            assert kept_pos == EXPECTED_KEPT_POSITIVES[keep][num_pos], num_pos
        # Each side is halved to within rounding, or lifted to the 2-per-side minimum.
        assert abs(kept_pos - num_pos / 2) <= 0.5 or kept_pos == min(2, num_pos) \
            or kept_neg == min(2, 2 * keep - num_pos), (keep, num_pos, kept_pos)
        assert kept_pos >= min(2, num_pos) and kept_neg >= min(2, 2 * keep - num_pos)


@pytest.mark.parametrize("rule", ALL_RULES)
def test_same_seed_same_selection_and_different_seeds_differ(rule):
    rollouts = _group(12, 32)
    first = resample_on_correct(rollouts, 16, np.random.default_rng(7), rule)
    assert resample_on_correct(rollouts, 16, np.random.default_rng(7), rule) == first
    others = {tuple(resample_on_correct(rollouts, 16, np.random.default_rng(s), rule))
              for s in range(20)}
    assert len(others) > 10


def test_shortest_keeps_the_fewest_response_tokens_among_the_correct_ties_in_order():
    rewards = [1, 1, 1, 1, 1, 0, 0, 0]
    lengths = [90, 40, 120, 40, 10, 5, 5, 5]  # a short negative is never a positive
    rollouts = _rollouts(rewards, [0.0] * 8, lengths)
    kept = resample_on_correct(rollouts, 4, np.random.default_rng(0), "shortest")
    assert [i for i in kept if rewards[i]] == [1, 4]        # 10 tokens, then the first of 40s
    assert resample_on_correct(_rollouts(rewards, [0.0] * 8, [40] * 8), 4,
                               np.random.default_rng(3), "shortest")[:2] == [0, 1]


def _exact_inclusion(weights, k):
    """P(item i among k drawn one by one without replacement, each draw ~ weight)."""
    inclusion = np.zeros(len(weights))
    for order in itertools.permutations(range(len(weights)), k):
        prob, left = 1.0, sum(weights)
        for i in order:
            prob *= weights[i] / left
            left -= weights[i]
        inclusion[list(order)] += prob
    return inclusion


def test_lower_penalty_positives_are_kept_more_often_at_the_exact_rate():
    # 4 positives (penalties 0, 0.1, 0.5, 1.5) and 4 negatives; 2 of each are kept.
    rewards = [1, 0, 1, 0, 1, 0, 1, 0]
    penalties = [0.0, 2.0, 0.1, 2.0, 0.5, 2.0, 1.5, 2.0]
    positives = [0, 2, 4, 6]
    draws = 4000
    counts = np.zeros(8)
    for seed in range(draws):
        counts[resample_on_correct(_rollouts(rewards, penalties), 4,
                                   np.random.default_rng(seed))] += 1
    freq = counts[positives] / draws
    assert np.all(np.diff(freq) < 0), freq
    exact = _exact_inclusion([1 / (penalties[i] + 0.1) for i in positives], 2)
    tolerance = 4.5 * np.sqrt(exact * (1 - exact) / draws)
    assert np.all(np.abs(freq - exact) < tolerance), (freq, exact)
    # Negatives ignore their (high) penalties: each is kept half the time.
    neg_freq = counts[[1, 3, 5, 7]] / draws
    assert np.all(np.abs(neg_freq - 0.5) < 4.5 * np.sqrt(0.25 / draws)), neg_freq


def test_topk_keeps_lowest_penalties_with_ties_in_rollout_order():
    rewards = [1, 1, 1, 1, 1, 0, 0, 0]
    rollouts = _rollouts(rewards, [0.5, 0.0, 0.5, 1.0, 0.5, 0, 0, 0])
    kept = resample_on_correct(rollouts, 4, np.random.default_rng(0), "topk")
    assert [i for i in kept if rewards[i]] == [0, 1]       # 0.0 first, then the first 0.5
    assert resample_on_correct(rollouts, 4, np.random.default_rng(5), "topk")[:2] == [0, 1]


def test_edge_cases_all_correct_all_wrong_one_correct_and_small_groups():
    rng = np.random.default_rng(3)
    assert len(resample_on_correct(_rollouts([1] * 32, [0.5] * 32), 16, rng)) == 16
    assert len(resample_on_correct(_rollouts([0] * 32, [0.5] * 32), 16, rng)) == 16
    rewards = [0] * 32
    rewards[9] = 1
    kept = resample_on_correct(_rollouts(rewards), 16, rng)
    assert 9 in kept and len(kept) == 16                   # the lone success is kept
    assert resample_on_correct(_rollouts([1, 0, 1]), 16, rng) == [0, 1, 2]
    assert resample_on_correct(_rollouts([1, 0] * 8), 16, rng) == list(range(16))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(rollouts=_rollouts([1, 0] * 4, [-0.1] + [0.0] * 7)), ValueError, "penalties"),
    (dict(rollouts=_rollouts([1, float("nan")] * 4)), ValueError, "rewards"),
    (dict(rng=random.Random(0)), TypeError, "rng"),
    (dict(keep=3), ValueError, "keep"),
])
def test_resample_rejects_bad_input(kwargs, error, message):
    args = dict(rollouts=_rollouts([1, 0] * 4), keep=4, rng=np.random.default_rng(0))
    with pytest.raises(error, match=message):
        resample_on_correct(**{**args, **kwargs})


# select_group: RoC vs the plain-GRPO ablation


def test_plain_grpo_keeps_all_of_g_and_thins_a_larger_group_uniformly_regardless_of_reward():
    rollouts = _rollouts([1, 0, 0, 1, 1, 0, 1, 1])
    assert select_group(rollouts, 8, np.random.default_rng(0), mode="grpo") == list(range(8))
    rewards = [1] * 2 + [0] * 14
    kept_correct = [sum(rewards[i] for i in select_group(_rollouts(rewards), 8,
                                                         np.random.default_rng(s), mode="grpo"))
                    for s in range(2000)]
    # Hypergeometric mean 2 * 8/16 = 1; RoC would always keep both correct rollouts.
    assert abs(np.mean(kept_correct) - 1.0) < 0.06
    assert min(kept_correct) == 0


def test_roc_keeps_fewer_positives_with_tool_errors_than_uniform_selection():
    """What RoC is for (§2.2.3, Fig. 4); per rollout (tool calls, failed calls, reward)."""
    clean_right, recovered_right, clean_wrong, failed_wrong = ((1, 0, 1.0), (2, 1, 1.0),
                                                               (1, 0, 0.0), (2, 1, 0.0))
    batch = [
        [clean_right] * 3 + [recovered_right] * 2 + [clean_wrong] * 2 + [failed_wrong],
        [clean_right] * 2 + [recovered_right] * 2 + [clean_wrong] * 3 + [failed_wrong],
        [clean_right] * 4 + [recovered_right] * 1 + [clean_wrong] * 1 + [failed_wrong] * 2,
        [clean_right] * 1 + [recovered_right] * 3 + [clean_wrong] * 3 + [failed_wrong],
        [clean_right] * 5 + [recovered_right] * 2 + [failed_wrong],
    ]
    kept = {"roc": [0, 0], "grpo": [0, 0]}  # [positives kept, of them with a failed call]
    for seed in range(200):
        for g, group in enumerate(batch):
            rewards = [reward for _, _, reward in group]
            penalties = [roc_penalty(calls, errors, 1, calls + 1) for calls, errors, _ in group]
            for mode in kept:
                for i in select_group(_rollouts(rewards, penalties), 4,
                                      np.random.default_rng([seed, g]),
                                      mode=mode):
                    if rewards[i]:
                        kept[mode][0] += 1
                        kept[mode][1] += group[i][1] > 0
    share = {mode: errors / positives for mode, (positives, errors) in kept.items()}
    in_batch = (sum(t == recovered_right for group in batch for t in group)
                / sum(t[2] for group in batch for t in group))
    # uniform: the batch's own share (10 of 25)
    assert abs(share["grpo"] - in_batch) < 0.03, (share, in_batch)
    # RoC: clean positives weigh 1/0.1 against 1/0.6 (penalty_offset 0.1)
    assert share["roc"] < 0.5 * share["grpo"], share
    assert kept["roc"][1] < kept["grpo"][1], kept


# group_advantages (Eq. 7)


def test_advantages_are_standardised_with_the_unbiased_std():
    rewards = [1, 1, 0, 0, 0, 1, 0, 0]
    expected = (torch.tensor(rewards, dtype=torch.float64) - 3 / 8) / (
        torch.tensor(rewards, dtype=torch.float64).std() + 1e-6)    # torch.std is unbiased
    advantages = torch.tensor(group_advantages(rewards), dtype=torch.float64)
    assert torch.allclose(advantages, expected, atol=1e-12)
    biased = (torch.tensor(rewards, dtype=torch.float64) - 3 / 8) / math.sqrt(15 / 64)
    assert not torch.allclose(advantages, biased, atol=1e-3)
    assert group_advantages([1, 0])[0] == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-5)
    # degenerate groups: zero
    assert group_advantages([1, 1, 1, 1]) == [0.0] * 4 and group_advantages([0.0]) == [0.0]
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")])


def test_advantage_scaling_none_is_dr_grpo_s_mean_centred_reward_and_batch_divides_by_one_std():
    rewards = [1, 1, 0, 0, 0, 1, 0, 0]
    # Dr. GRPO (TRL scale_rewards="none"): r - mean(r), no division
    assert group_advantages(rewards, "none") == pytest.approx([5 / 8] * 2 + [-3 / 8] * 3
                                                              + [5 / 8] + [-3 / 8] * 2, abs=1e-15)
    # batch (TRL scale_rewards="batch"): the same centring over one std given for the whole step
    assert group_advantages(rewards, "batch", batch_std=0.25) == pytest.approx(
        [(r - 3 / 8) / (0.25 + 1e-6) for r in rewards], abs=1e-12)
    assert group_advantages([1, 1, 1], "none") == [0.0] * 3


def test_the_batch_std_is_the_unbiased_std_of_every_reward_the_step_sampled():
    groups = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 1]]   # 6 of 10 correct, all-equal groups included
    assert batch_reward_std(groups) == pytest.approx(math.sqrt((6 - 36 / 10) / 9), abs=1e-15)
    assert batch_reward_std([[1.0]]) == 0.0


# policy_loss (Eq. 6)

def _corrected(logp, old_logp, advantages, mask, engine_logp, correction, threshold,
               num_tokens=None):
    """As train_step: the correction's weights and gap metrics, then Eq. 6."""
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    weights, gap = rollout_correction(old_logp, engine_logp, mask, correction, threshold,
                                      num_tokens)
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, num_tokens, weights=weights)
    return loss, {**metrics, **gap}


def _batch(seed, lengths, width=None, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    old_logp = -torch.rand(len(lengths), width, generator=gen, dtype=dtype) * 3
    logp = (old_logp + 0.4 * torch.randn(len(lengths), width, generator=gen, dtype=dtype))
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    advantages = torch.randn(len(lengths), generator=gen, dtype=dtype)
    return logp.requires_grad_(), old_logp, advantages, mask


def test_loss_gradient_matches_the_hand_derived_surrogate_gradient():
    # Ratios placed in every region: inside the clip range, above it, below it, for A > 0 and A < 0.
    ratios = torch.tensor([[1.1, 1.5, 0.5, 1.0], [1.1, 1.5, 0.5, 1.0]], dtype=torch.float64)
    advantages = torch.tensor([2.0, -1.0], dtype=torch.float64)
    old_logp = torch.full((2, 4), -1.0, dtype=torch.float64)
    logp = (old_logp + ratios.log()).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    loss, metrics = policy_loss(logp, old_logp, advantages, mask)
    loss.backward()
    # d/dlogp of -rho * A is -rho * A; zero where the clip is active (A > 0 and rho > 1.28,
    # or A < 0 and rho < 0.8); the sum is divided by the 7 unmasked tokens.
    expected = torch.tensor([[-1.1 * 2, 0.0, -0.5 * 2, 0.0],
                             [1.1, 1.5, 0.0, 1.0]], dtype=torch.float64) / 7
    assert torch.allclose(logp.grad, expected, atol=1e-12)
    expected_loss = (-(1.1 + 1.28 + 0.5) * 2 + (1.1 + 1.5 + 0.8 + 1.0)) / 7
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    assert metrics["clip_high_fraction"].item() == pytest.approx(1 / 7)
    assert metrics["clip_low_fraction"].item() == pytest.approx(1 / 7)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)
    assert metrics["ratio_mean"].item() == pytest.approx(
        (1.1 + 1.5 + 0.5 + 1.1 + 1.5 + 0.5 + 1) / 7)


def test_loss_gradient_matches_float64_finite_differences():
    logp, old_logp, advantages, mask = _batch(0, [5, 2, 4])
    noise = torch.randn(old_logp.shape, generator=torch.Generator().manual_seed(0),
                        dtype=old_logp.dtype)
    logp = (old_logp + 0.05 * noise).requires_grad_()   # ratios near 1, away from the clip kinks
    assert torch.autograd.gradcheck(
        lambda lp: policy_loss(lp, old_logp, advantages, mask)[0], (logp,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("correction", ["token_mis", "geometric_tis"])
def test_metrics_sum_over_micro_batches_to_the_full_batch_value(correction):
    logp, old_logp, advantages, mask = _batch(2, [8, 3, 6, 5])
    engine_logp = old_logp + 0.5 * torch.randn(old_logp.shape, dtype=old_logp.dtype,
                                               generator=torch.Generator().manual_seed(2))
    _, full = _corrected(logp, old_logp, advantages, mask, engine_logp, correction, 1.3)
    parts = [_corrected(logp[r], old_logp[r], advantages[r], mask[r], engine_logp[r], correction,
                        1.3, num_tokens=mask.sum())[1]
             for r in ([0], [1, 2], [3])]
    assert full["rollout_corr/weight_mean"] != 1.0  # the correction acted
    for name in full:
        combine = max if name.endswith("_max") else sum
        assert combine(p[name] for p in parts).item() == pytest.approx(full[name].item(),
                                                                       abs=1e-12), name


def test_padding_with_minus_inf_is_ignored():
    logp, old_logp, advantages, mask = _batch(3, [4, 2])
    reference, _ = policy_loss(logp, old_logp, advantages, mask)
    grad_reference, = torch.autograd.grad(reference, logp)
    padded_logp = torch.where(mask, logp, float("-inf"))
    padded_old = torch.where(mask, old_logp, float("-inf"))
    loss, metrics = policy_loss(padded_logp, padded_old, advantages, mask)
    grad, = torch.autograd.grad(loss, logp)
    assert loss.item() == reference.item()
    assert torch.equal(grad, grad_reference) and torch.isfinite(metrics["approx_kl"])
    # per-token advantages, as the per-rollout ones broadcast
    per_token, _ = policy_loss(logp, old_logp, advantages[:, None].expand_as(logp), mask)
    assert per_token.item() == reference.item()


def test_dual_clip_bounds_the_loss_of_exploded_negative_tokens():
    old_logp = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.full((1, 1), math.log(10.0), dtype=torch.float64)
    advantages, mask = torch.tensor([-1.0], dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool)
    assert policy_loss(logp, old_logp, advantages, mask)[0].item() == pytest.approx(10.0)
    assert policy_loss(logp, old_logp, advantages, mask,
                       dual_clip=3.0)[0].item() == pytest.approx(3.0)


# the field's loss variants: aggregation (loss_weights) and GSPO's sequence-level ratio

def _on_policy(lengths, advantages):
    """logp = old_logp (every ratio 1): each token's loss is -A_i, its gradient -A_i too."""
    width = max(lengths)
    old_logp = torch.full((len(lengths), width), -1.0, dtype=torch.float64)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return (old_logp.clone().requires_grad_(), old_logp,
            torch.tensor(advantages, dtype=torch.float64), mask)


@pytest.mark.parametrize("aggregation, expected", [
    # Eq. 6: -(2*1 + 4*(-1) + 1*0.5) / 7 tokens
    ("token_mean", -(2 * 1 - 4 * 1 + 0.5) / 7),
    # each rollout's token mean (-1, 1, -0.5), averaged over the 3 rollouts
    ("seq_mean_token_mean", -(1 - 1 + 0.5) / 3),
    # Dr. GRPO: the token sums (-2, 4, -0.5) over 3 rollouts x a fixed 10 tokens
    ("seq_mean_token_sum_norm", -(2 - 4 + 0.5) / 30),
])
def test_each_loss_aggregation_is_its_hand_computed_average(aggregation, expected):
    logp, old_logp, advantages, mask = _on_policy([2, 4, 1], [1.0, -1.0, 0.5])
    weights = loss_weights(mask, aggregation, mask.sum(), 3, 10)
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, mask.sum(), weights=weights)
    assert loss.item() == pytest.approx(expected, abs=1e-15)
    assert metrics["approx_kl"].item() == 0.0 and metrics["ratio_mean"].item() == 1.0
    # the gradient per token is -A_i times the token's weight in the average
    per_token = {"token_mean": [1 / 7] * 3, "seq_mean_token_mean": [1 / 6, 1 / 12, 1 / 3],
                 "seq_mean_token_sum_norm": [1 / 30] * 3}[aggregation]
    grad, = torch.autograd.grad(loss, logp)
    for row, (a, w) in enumerate(zip([1.0, -1.0, 0.5], per_token)):
        assert grad[row][mask[row]].tolist() == pytest.approx([-a * w] * int(mask[row].sum()))


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_every_aggregation_adds_up_over_micro_batches_and_ranks_to_the_full_batch(aggregation):
    lengths = [9, 2, 7, 1, 12, 4, 6]
    logp, old_logp, advantages, mask = _batch(1, lengths)
    tokens, sequences, world = int(mask.sum()), len(lengths), 2

    def loss_of(rows, num_tokens, num_sequences):
        weights = loss_weights(mask[rows], aggregation, num_tokens, num_sequences, 16)
        return policy_loss(logp[rows], old_logp[rows], advantages[rows], mask[rows], num_tokens,
                           weights=weights)[0]

    full_loss = loss_of(list(range(7)), tokens, sequences)
    full_grad, = torch.autograd.grad(full_loss, logp)
    # two ranks of uneven micro-batches; each passes the global counts / world, as rl.train_step
    # does, and FSDP averages ranks
    parts = [loss_of(rows, tokens / world, sequences / world)
             for rows in ([0, 1], [2], [3, 4, 5], [6])]
    split = sum(torch.autograd.grad(part, logp)[0] for part in parts) / world
    torch.testing.assert_close(split, full_grad, atol=1e-14, rtol=0)
    assert sum(part.item() for part in parts) / world == pytest.approx(full_loss.item(), abs=1e-12)
    if aggregation != "token_mean":  # a real change from Eq. 6
        eq6, = torch.autograd.grad(policy_loss(logp, old_logp, advantages, mask)[0], logp)
        assert not torch.allclose(full_grad, eq6, atol=1e-6)


def test_a_sequence_level_ratio_is_the_geometric_mean_of_the_token_ratios_clipped_as_one():
    # GSPO: s_i = exp(mean_t log(pi / pi_old)); rollout 0's tokens 1.1 and 1.6 give
    # s = sqrt(1.76) = 1.327 > 1.28, clipped as a whole for A > 0: no gradient on either token;
    # rollout 1's 0.9 and 1.0 give s = 0.949, inside the range: both its tokens' loss -s A
    # depends on each logp_t through ds/dlogp_t = s / 2, so the gradient is 2 * (-A s / 2) / 4
    old_logp = torch.full((2, 3), -1.0, dtype=torch.float64)
    token_ratios = torch.tensor([[1.1, 1.6, 1.0], [0.9, 1.0, 1.0]], dtype=torch.float64)
    logp = (old_logp + token_ratios.log()).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    advantages = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, ratio_level="sequence")
    s0, s1 = math.sqrt(1.1 * 1.6), math.sqrt(0.9)
    assert loss.item() == pytest.approx((-2 * 1.28 * 1.0 + 2 * s1 * 2.0) / 4, abs=1e-12)
    grad, = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[0, 0, 0], [2 * s1 / 4, 2 * s1 / 4, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, atol=1e-12, rtol=0)
    assert metrics["ratio_max"].item() == pytest.approx(s0)
    assert metrics["clip_high_fraction"].item() == pytest.approx(2 / 4)
    token_level, _ = policy_loss(logp, old_logp, advantages, mask)
    assert token_level.item() != pytest.approx(loss.item())


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_at_ratio_1_the_clips_and_the_sequence_ratio_leave_the_gradient_as_it_was(aggregation):
    """old_logp = logp: the token-level gradient; off ratio 1, or with weights varying within a
    rollout, not."""
    logp, old_logp, advantages, mask = _batch(11, [6, 2, 5, 4])
    per_rollout = torch.tensor([[0.7], [1.3], [1.0], [0.4]], dtype=torch.float64)
    per_token = torch.rand(4, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    variants = {"clip_low": dict(clip_low=3e-4), "clip_high": dict(clip_high=4e-4),
                "dual_clip": dict(dual_clip=1.001), "ratio_level": dict(ratio_level="sequence")}

    def gradient(old, weights, **variant):
        factors = loss_weights(mask, aggregation, 17.0, 4.0, 6, weights)
        loss, _ = policy_loss(logp, old, advantages, mask, 17.0, weights=factors, **variant)
        return torch.autograd.grad(loss, logp)[0]

    for name, variant in variants.items():
        for old, weights, acts in ((logp.detach(), per_rollout, False),
                                   (old_logp, per_rollout, True),
                                   (logp.detach(), per_token, name == "ratio_level")):
            paper, changed = gradient(old, weights), gradient(old, weights, **variant)
            assert torch.allclose(changed, paper, rtol=1e-12, atol=1e-15) is not acts, (name, acts)


# rollout correction: the engine sampled, the trainer's pi_old is in the ratio (Yao et al. 2025)

@pytest.mark.parametrize("correction", ROLLOUT_CORRECTIONS)
def test_with_the_engine_equal_to_the_trainer_every_correction_is_today_s_loss_exactly(correction):
    logp, old_logp, advantages, mask = _batch(7, [6, 2, 5])
    today, today_metrics = policy_loss(logp, old_logp, advantages, mask)
    today_grad, = torch.autograd.grad(today, logp)
    loss, metrics = _corrected(logp, old_logp, advantages, mask, old_logp.clone(), correction,
                               1.01)
    grad, = torch.autograd.grad(loss, logp)
    assert torch.equal(loss, today) and torch.equal(grad, today_grad)
    assert all(torch.equal(metrics[k], v) for k, v in today_metrics.items())
    assert metrics["rollout_corr/weight_mean"].item() == 1.0  # over the tokens: every w is 1
    assert metrics["rollout_corr/k3_kl"].item() == metrics["rollout_corr/log_ratio_mean"] == 0.0


# Two rollouts; pi_theta / pi_old per token (r) puts tokens in and beyond the clip range, the
# engine's rho = pi_old / pi_engine puts them in and beyond [1/2, 2]; the last token is padding.
CLIP_RATIOS = [[1.1, 1.5, 1.0, 1.0], [1.0, 1.0, 0.5, 1.0]]
ENGINE_RHO = [[0.4, 0.9, 1.5, 3.0], [2.5, 1.0, 0.6, 5.0]]
# min(r A, clip(r, 0.8, 1.28) A) with A = (2, -1), and its derivative in log pi_theta (r A where
# the unclipped branch is the min, else 0)
SURROGATE = [[2.2, 2.56, 2.0, 2.0], [-1.0, -1.0, -0.8, 0.0]]
SURROGATE_GRAD = [[2.2, 0.0, 2.0, 2.0], [-1.0, -1.0, 0.0, 0.0]]
GEOMETRIC = [(0.4 * 0.9 * 1.5 * 3.0) ** (1 / 4), (2.5 * 1.0 * 0.6) ** (1 / 3)]  # 1.128, 1.145


def _mismatched(correction, threshold):
    old_logp = torch.full((2, 4), -1.0, dtype=torch.float64)
    logp = (old_logp + torch.tensor(CLIP_RATIOS, dtype=torch.float64).log()).requires_grad_()
    engine_logp = old_logp - torch.tensor(ENGINE_RHO, dtype=torch.float64).log()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    loss, metrics = _corrected(logp, old_logp, torch.tensor([2.0, -1.0], dtype=torch.float64),
                               mask, engine_logp, correction, threshold)
    loss.backward()
    return loss.item(), logp.grad, metrics


@pytest.mark.parametrize("correction, threshold, weights", [
    # truncated: min(rho, 2)
    ("token_tis", 2.0, [[0.4, 0.9, 1.5, 2.0], [2.0, 1.0, 0.6, 0.0]]),
    # masked: rho inside [1/2, 2], else 0
    ("token_mis", 2.0, [[0.0, 0.9, 1.5, 0.0], [0.0, 1.0, 0.6, 0.0]]),
    # the sequence's geometric mean of rho, truncated at / masked beyond 1.14
    ("geometric_tis", 1.14, [[GEOMETRIC[0]] * 4, [1.14] * 3 + [0.0]]),
    ("geometric_mis", 1.14, [[GEOMETRIC[0]] * 4, [0.0] * 4]),
])
def test_a_mismatch_weights_each_token_s_loss_and_gradient_as_by_hand(correction, threshold,
                                                                      weights):
    loss, grad, metrics = _mismatched(correction, threshold)
    w = torch.tensor(weights, dtype=torch.float64)
    # -w * surrogate, summed over the 7 model-written tokens and divided by 7 (Eq. 6); the weight
    # is a constant: the gradient is w times the uncorrected one
    expected_loss = -(w * torch.tensor(SURROGATE, dtype=torch.float64)).sum().item() / 7
    assert loss == pytest.approx(expected_loss, abs=1e-12)
    torch.testing.assert_close(grad, -w * torch.tensor(SURROGATE_GRAD, dtype=torch.float64) / 7,
                               atol=1e-12, rtol=0)
    assert metrics["rollout_corr/weight_mean"].item() == pytest.approx(w.sum().item() / 7)
    assert metrics["rollout_corr/weight_max"].item() == pytest.approx(w.max().item())


def test_the_mismatch_metrics_are_their_direct_computation_whatever_the_setting():
    rho = torch.tensor(ENGINE_RHO, dtype=torch.float64)[torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]],
                                                                     dtype=torch.bool)]
    for correction in ROLLOUT_CORRECTIONS:
        metrics = _mismatched(correction, 2.0)[2]
        assert metrics["rollout_corr/log_ratio_mean"].item() == pytest.approx(
            rho.log().mean().item(), abs=1e-12)
        # k3: E_engine[rho - 1 - log rho] estimates KL(pi_engine || pi_old) >= 0
        assert metrics["rollout_corr/k3_kl"].item() == pytest.approx(
            (rho - 1 - rho.log()).mean().item(), abs=1e-12)
        assert metrics["rollout_corr/ratio_max"].item() == pytest.approx(3.0)  # not the padding's 5
    truncated = _mismatched("token_tis", 2.0)[2]["rollout_corr/truncated_fraction"]
    masked = _mismatched("token_mis", 2.0)[2]["rollout_corr/masked_fraction"]
    assert truncated.item() == pytest.approx(2 / 7) and masked.item() == pytest.approx(3 / 7)
    none = {k: v.item() for k, v in _mismatched("none", 2.0)[2].items()}
    assert none["rollout_corr/weight_mean"] == none["rollout_corr/weight_max"] == 1.0
    assert none["rollout_corr/truncated_fraction"] == none["rollout_corr/masked_fraction"] == 0


def test_a_geometric_weight_does_not_shrink_with_length_as_a_product_would():
    # trl#5814: a per-sequence product of token ratios collapses on long responses
    log_rho = torch.full((1, 8192), -0.01, dtype=torch.float64)
    mask = torch.ones_like(log_rho, dtype=torch.bool)
    weights, _ = rollout_weights(log_rho, torch.zeros_like(log_rho), mask, "geometric_tis", 2.0)
    assert math.exp(log_rho.sum().item()) < 1e-35
    assert weights[0, 0].item() == pytest.approx(math.exp(-0.01))


@pytest.mark.parametrize("change, message", [
    (dict(mask=torch.ones(2, 4, dtype=torch.bool)), "shape"),
    (dict(advantages=torch.zeros(3)), "advantages"),
    (dict(mask=torch.zeros(2, 3, dtype=torch.bool)), "num_tokens"),
])
def test_policy_loss_rejects_bad_input(change, message):
    logp, old_logp, advantages, mask = _batch(6, [3, 2])
    args = dict(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    with pytest.raises(ValueError, match=message):
        policy_loss(**{**args, **change})


def test_one_synthetic_group_through_steps_1_to_4():
    """The module docstring's steps on 2G = 8 rollouts; RoC mode is resample_on_correct."""
    # (tool calls, failed calls, <answer> blocks, assistant turns, reward)
    counts = [(3, 0, 1, 4, 1.0), (2, 2, 1, 3, 1.0), (0, 0, 1, 1, 1.0), (4, 1, 3, 5, 1.0),
              (1, 0, 1, 2, 0.0), (5, 5, 0, 6, 0.0), (2, 1, 1, 3, 0.0), (0, 0, 1, 1, 0.0)]
    rollouts = [Rollout(r, roc_penalty(*c), 0, c[0], c[1], {}, c[2], c[3]) for *c, r in counts]
    # p_err: failed / calls, 0.5 with no call; p_format: 0.15 for rollout 3's two extra answers
    assert [r.penalty for r in rollouts][:4] == pytest.approx([0, 1, 0.5, 0.65])
    assert filter_groups([[r.reward for r in rollouts]])[1] == 0.0
    kept = select_group(rollouts, 4, np.random.default_rng(0), mode="roc")
    assert kept == resample_on_correct(rollouts, 4, np.random.default_rng(0))
    assert len(kept) == 4 and sorted(rollouts[i].reward for i in kept) == [0, 0, 1, 1]
    advantages = group_advantages([rollouts[i].reward for i in kept])
    assert sum(advantages) == pytest.approx(0)
    assert np.std(advantages, ddof=1) == pytest.approx(1, abs=1e-5)
