"""Behaviour of rl.py: the update does not depend on how the batch is split, the data order survives
a resume, bad configs stop before any work, and a tiny run (real engine, real executor) killed with
SIGKILL resumes exactly."""
import dataclasses
import json
import math
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
# tests/ is on sys.path (pytest's rootdir-relative import)
from dist_rl_train_step import fixed_batch
from rl_runs import MEMO_PROBLEMS, PYTHON, REPO, run, TORCHRUN
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import eval as evaluation
import rl
import rollout
import tiny
import tools.replay as replay_tool
from executor import Executor
from grpo_roc import policy_loss
from machinery.checkpoint import (check_inputs, epoch_plan, latest_checkpoint, load_policy,
                                  load_weights, requested_checkpoint, save_checkpoint,
                                  start_checkpoint)
from machinery.config import ConfigError, load_config
from machinery.data import load_problems, prompt_indices
from machinery.distributed import compute_dtype, init_distributed
from machinery.engine import Engine
from machinery.metrics import MetricsLogger, print_held_out, step_metrics
from machinery.prompts import load_format, read_format
from machinery.saved_rollouts import read_rollouts, save_rollouts, saved_steps, step_dir
from machinery.training import TrainSample, collate, micro_batches, token_logprobs
from rollout import Trajectory


# invariance: one update on a fixed global batch, split three ways (tests/dist_rl_train_step.py)

def train_step(model, out, ranks, *overrides):
    """tests/dist_rl_train_step.py's result in `ranks` processes."""
    path = out / f"{ranks}-{'-'.join(overrides)}.pt"
    launch = [PYTHON] if ranks == 1 else [*TORCHRUN, "--standalone", f"--nproc_per_node={ranks}"]
    run([*launch, REPO / "tests" / "dist_rl_train_step.py", model, path, *overrides], timeout=300)
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def three_splits(tiny_model_dir, tmp_path_factory):
    """The reference (log-probs from the model's full logits) and three splits that compute them
    in chunks: 1 process x 1 micro-batch, 1 x 4, 2 processes x 2."""
    out = tmp_path_factory.mktemp("invariance")
    splits = [(1, "micro_batch_size=0", "logprob_chunk_tokens=0"), (1, "micro_batch_size=0"),
              (1, "micro_batch_size=2"), (2, "micro_batch_size=2")]
    return [train_step(tiny_model_dir, out, *split) for split in splits]


@pytest.mark.slow
def test_gradients_and_metrics_do_not_depend_on_the_split_and_none_are_left(three_splits):
    # each split really runs the micro-batches it claims, on the whole batch
    assert [r["metrics"]["num_micro_batches"] for r in three_splits] == [1, 1, 4, 2]
    assert len({r["metrics"]["train_tokens"] for r in three_splits}) == 1
    # gradients existed (read before optimizer.step()) and none is left to hold memory in the sync
    assert all(r["grads"] and r["grads_left"] == [] for r in three_splits)
    reference, *others = three_splits
    largest = max(g.abs().max().item() for g in reference["grads"].values())
    assert largest > 1e-3  # a real gradient, not zeros
    for other in others:
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(other["grads"][name], grad, atol=1e-6, rtol=1e-4, msg=name)
        for key in ("loss", "grad_norm", "clip_low_fraction", "clip_high_fraction", "approx_kl",
                    "entropy", "rollout_corr/log_ratio_mean", "rollout_corr/k3_kl",
                    "rollout_corr/ratio_max"):
            assert other["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-5,
                                                          abs=1e-7), key
    # both clips were active, so the clipped branches of Eq. 6 were part of what matched
    assert (reference["metrics"]["clip_low_fraction"] > 0
            and reference["metrics"]["clip_high_fraction"] > 0)


@pytest.mark.slow
def test_a_sequence_level_loss_s_gradient_does_not_depend_on_the_split(tiny_model_dir,
                                                                       three_splits, tmp_path):
    """rl.train_step passes loss_weights the global sequence count as Eq. 6 the global token count
    (every aggregation's arithmetic over splits: test_grpo_roc.py); GSPO's ratio too."""
    overrides = ["loss_aggregation=seq_mean_token_mean", "ratio_level=sequence"]
    one = train_step(tiny_model_dir, tmp_path, 1, "micro_batch_size=0", *overrides)
    two = train_step(tiny_model_dir, tmp_path, 2, "micro_batch_size=2", *overrides)
    assert two["metrics"]["num_micro_batches"] == 2
    for param, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][param], grad, atol=1e-6, rtol=1e-4, msg=param)
    assert two["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-5)
    # a real change of the objective, not Eq. 6 under another name
    flat = [torch.cat([g.flatten() for g in r["grads"].values()]) for r in (one, three_splits[0])]
    assert not torch.allclose(*flat, atol=1e-5)


@pytest.mark.slow
def test_updated_weights_do_not_depend_on_the_split(three_splits, tiny_model_dir):
    # lm_head too: rl.full_weights sends it
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    reference, *others = three_splits
    lr = 1e-3  # tests/dist_rl_train_step.py
    moved = torch.cat([(reference["weights"][n] - initial[n]).abs().flatten()
                       for n in reference["weights"]])
    assert moved.median() > 0.5 * lr  # AdamW's first step moves almost every weight by about lr
    for other in others:
        for name, weight in reference["weights"].items():
            # AdamW's first step is lr * g / (|g| + 1e-8): where |g| is float noise the step is
            # noise of up to lr, so weights are compared where |g| > 1e-7, at 5% of lr
            grad = reference["grads"].get(name)
            signal = (grad.abs() > 1e-7 if grad is not None
                      else torch.ones_like(weight, dtype=torch.bool))
            assert signal.float().mean() > 0.5, name
            torch.testing.assert_close(other["weights"][name][signal], weight[signal],
                                       atol=0.05 * lr, rtol=0, msg=name)
            step = (other["weights"][name] - initial[name])[~signal].abs()
            assert step.numel() == 0 or step.max() <= 1.01 * lr, name


# the weight sync: the order of the engine's wake-up, the bytes it gathers

class RecordingEngine:
    """rl.sync_weights' two calls into the Engine, consuming the tensors as vLLM does."""

    def __init__(self, calls):
        self.calls = calls

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def update_weights(self, named_tensors):
        self.calls.append(("update_weights", len(list(named_tensors))))


def test_weight_sync_wakes_the_weights_loads_them_frees_the_cache_and_only_then_wakes_the_kv_cache(
        tiny_model_dir, monkeypatch):
    # verl's order: the KV cache wakes once the gathered tensors and cached blocks are freed
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    calls = []
    monkeypatch.setattr(rl, "free_cached_memory", lambda: calls.append(("free_cached_memory",)))
    rl.sync_weights(RecordingEngine(calls), model, torch.float32)
    sent = len(list(model.named_parameters())) + 1  # the tied lm_head is sent too
    assert calls == [("free_cached_memory",), ("wake_up", ("weights",)), ("update_weights", sent),
                     ("free_cached_memory",), ("wake_up", ("kv_cache",))]


@pytest.mark.slow
def test_weight_sync_gathers_in_the_engine_dtype_in_few_collectives(three_splits):
    """bf16 tensors only (28 GB per rank at 14B, not 56), one collective per bucket."""
    for name, result in enumerate(three_splits):
        fp32, bf16 = result["sync"]["torch.float32"], result["sync"]["torch.bfloat16"]
        assert (bf16["gathers"]
                and {d for _, dtypes in bf16["gathers"] for d in dtypes} == {"c10::BFloat16"}), name
        assert 2 * bf16["gathered_bytes"] == fp32["gathered_bytes"], name
        # the whole model once per rank, plus at most a row of padding per parameter and rank
        assert result["param_bytes"] <= fp32["gathered_bytes"] < 1.1 * result["param_bytes"], name
        assert len(bf16["gathers"]) < result["num_params"] / 4, name
        for key, weight in fp32["weights"].items():
            assert torch.equal(bf16["weights"][key], weight.to(torch.bfloat16)), (name, key)


@pytest.fixture(scope="module")
def shared_and_recomputed(tiny_model_dir, tmp_path_factory):
    """old_logprobs=both (the separate pass and the update's own forward) in 1 process and in 2."""
    out = tmp_path_factory.mktemp("shared-forward")
    return {world: train_step(tiny_model_dir, out, world, "old_logprobs=both",
                              "micro_batch_size=2")
            for world in (1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("correction", ["none", "token_tis"])
def test_the_update_s_own_forward_gives_the_separate_pass_s_loss_gradients_and_guard(
        shared_and_recomputed, world, correction):
    """mini_batches=1: the update's forward, detached, stands in for the old-log-prob pass."""
    recomputed = shared_and_recomputed[world][correction, "recompute"]
    shared = shared_and_recomputed[world][correction, "shared"]
    assert max(g.abs().max() for g in recomputed["grads"].values()) > 1e-3
    for name, grad in recomputed["grads"].items():
        torch.testing.assert_close(shared["grads"][name], grad, atol=1e-9, rtol=1e-6, msg=name)
    assert shared["metrics"].keys() == recomputed["metrics"].keys()
    for key, value in recomputed["metrics"].items():
        assert shared["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    # the forward's log-probs are written back to the samples: the sync guard reads the same gap
    assert shared["filled_vs_pass"] < 1e-6
    assert shared["gap"] == pytest.approx(recomputed["gap"], rel=1e-6)
    # on-policy: rho is 1 and nothing clipped; the engine's noise (+-0.3) is what the weights see
    metrics = shared["metrics"]
    assert metrics["ratio_max"] == 1.0 and metrics["clip_high_fraction"] == 0.0
    assert metrics["rollout_corr/k3_kl"] > 1e-3
    if correction == "token_tis":  # rollout_is_threshold=1.2: some weights were truncated
        assert 0 < metrics["rollout_corr/truncated_fraction"] < 1
        assert metrics["rollout_corr/weight_max"] == pytest.approx(1.2)
    else:
        assert metrics["rollout_corr/weight_mean"] == metrics["rollout_corr/weight_max"] == 1.0


def test_a_per_micro_batch_mean_would_change_this_batch_far_beyond_the_tolerance(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    samples = fixed_batch(model.config.vocab_size)
    cfg = rl.RLConfig(model="x", micro_batch_size=2)
    grads = {}
    for mode in ("global", "per_micro_batch"):
        model.zero_grad()
        total = sum(sum(s.loss_mask) for s in samples)
        batches = micro_batches(samples, cfg)
        for batch in batches:
            input_ids, _, mask, advantages, _ = collate(batch, 0, torch.device("cpu"))
            logp = token_logprobs(model, input_ids, 1.0)
            if mode == "global":  # rl.train_step's scaling (in one process)
                loss, _ = policy_loss(logp, logp.detach(), advantages, mask, num_tokens=total)
            else:                 # each micro-batch's own token mean, averaged over micro-batches
                loss, _ = policy_loss(logp, logp.detach(), advantages, mask)
                loss = loss / len(batches)
            loss.backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (grads["global"] - grads["per_micro_batch"]).abs().max() > 100 * 1e-6


# chunked log-probs: the same values and gradients, no [tokens, vocabulary] copy kept for backward

def logprobs_and_grads(model, input_ids, chunk_tokens):
    model.zero_grad(set_to_none=True)
    logp, _ = token_logprobs(model, input_ids, 0.7, chunk_tokens, with_entropy=True)
    # every position's gradient differs
    (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
    return logp.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_chunked_logprobs_equal_the_full_logits_ones_with_their_gradients(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    input_ids = torch.randint(0, model.config.vocab_size, (3, 50),
                              generator=torch.Generator().manual_seed(0))
    full_logp, full_grads = logprobs_and_grads(model, input_ids, 0)
    # 37 does not divide 3 x 49 positions: chunks cross rows, and the last one is short
    logp, grads = logprobs_and_grads(model, input_ids, 37)
    torch.testing.assert_close(logp, full_logp, atol=1e-6, rtol=1e-6)
    assert max(g.abs().max() for g in full_grads.values()) > 1e-3
    for name, grad in full_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():  # recompute_logprobs' path: no checkpoint, the same values
        torch.testing.assert_close(token_logprobs(model, input_ids, 0.7, 37), full_logp, atol=1e-6,
                                   rtol=1e-6)


@pytest.mark.parametrize("chunk_tokens", [0, 37])
@pytest.mark.parametrize("grad", [True, False])
def test_the_entropy_is_the_categorical_entropy_of_the_tempered_logits(tiny_model_dir,
                                                                      chunk_tokens, grad):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    input_ids = torch.randint(0, model.config.vocab_size, (3, 50),
                              generator=torch.Generator().manual_seed(1))
    with torch.set_grad_enabled(grad):
        logp, entropy = token_logprobs(model, input_ids, 0.7, chunk_tokens, with_entropy=True)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[:, :-1].float() / 0.7
        expected = torch.distributions.Categorical(logits=logits).entropy()
    assert entropy.shape == logp.shape and not entropy.requires_grad
    assert expected.min() > 0.1  # a spread-out policy: the check is not of zeros
    torch.testing.assert_close(entropy, expected, atol=1e-5, rtol=1e-5)


def memory_of_backward(model, input_ids, chunk_tokens):
    """(bytes saved for backward outside the parameters, of them vocabulary-wide, the peak)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in parameters:
            saved.append((tensor.shape[-1] if tensor.dim() else 0,
                          tensor.numel() * tensor.element_size()))
        return tensor

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as profiler:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logprobs_and_grads(model, input_ids, chunk_tokens)
    allocated = peak = 0
    for event in sorted((e for e in profiler.profiler.kineto_results.events()
                         if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        allocated += event.nbytes()
        peak = max(peak, allocated)
    vocab = model.config.vocab_size
    return sum(b for _, b in saved), sum(b for last, b in saved if last == vocab), peak


def test_chunked_logprobs_keep_no_vocabulary_wide_tensor_for_backward_and_lower_the_peak(
        tiny_model_dir):
    # unchunked, backward keeps the fp32 [tokens, V] log-softmax input (12.4 GB at 20,480 tokens)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 200),
                              generator=torch.Generator().manual_seed(0))
    logits_fp32 = 2 * 199 * model.config.vocab_size * 4
    full_saved, full_vocab, full_peak = memory_of_backward(model, input_ids, 0)
    chunk_saved, chunk_vocab, chunk_peak = memory_of_backward(model, input_ids, 32)
    assert full_vocab >= logits_fp32 and chunk_vocab == 0
    assert full_saved - chunk_saved >= logits_fp32
    assert full_peak - chunk_peak >= logits_fp32


# data order, learning rate, micro-batches

def test_every_epoch_is_a_fresh_permutation_and_a_resumed_position_reads_the_same_prompts():
    stream = prompt_indices(10, seed=3, start=0, count=30)
    for epoch in range(3):
        assert sorted(stream[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    assert stream[:10] != stream[10:20]  # reshuffled, not repeated
    # resumed at position 14 (step 7 of 2 prompts): where the uninterrupted one was
    assert prompt_indices(10, seed=3, start=14, count=9) == stream[14:23]
    assert prompt_indices(10, seed=4, start=0, count=10) != stream[:10]


def test_lr_ramps_up_over_the_warmup_then_stays_constant():
    cfg = rl.RLConfig(model="x", lr=1e-6, warmup_steps=20)
    assert rl.lr_at(0, cfg) == pytest.approx(1e-6 / 20)  # step 0 already trains
    assert rl.lr_at(9, cfg) == pytest.approx(0.5e-6)
    assert [rl.lr_at(s, cfg) for s in (19, 20, 300)] == [pytest.approx(1e-6)] * 3


def sample(length, prompt=2):
    return TrainSample(list(range(prompt)), list(range(length - prompt)), [1] * (length - prompt),
                       1.0)


def test_micro_batches_keep_under_both_caps_and_lose_no_sample_or_refuse_one_too_long():
    samples = [sample(n) for n in (50, 10, 30, 30, 20, 5)]
    cfg = rl.RLConfig(model="x", micro_batch_tokens=60, micro_batch_size=0)
    batches = micro_batches(samples, cfg)
    assert all(len(b) * max(len(s) for s in b) <= 60 for b in batches)  # padded size
    assert sorted(len(s) for b in batches for s in b) == sorted(len(s) for s in samples)
    cfg.micro_batch_size = 1
    assert [len(b) for b in micro_batches(samples, cfg)] == [1] * 6
    # a trajectory longer than a micro-batch: the key to raise
    with pytest.raises(ConfigError, match="micro_batch_tokens=60"):
        micro_batches([sample(61)], rl.RLConfig(model="x", micro_batch_tokens=60))


# selection: all-equal groups dropped, RoC keeps G of 2G, plain GRPO keeps all

def trajectory(problem, index, calls=1, errors=0, answers=1, turns=2, prompt_len=3, response_len=6):
    t = Trajectory(problem, index, list(range(prompt_len)), list(range(response_len)),
                   [1] * response_len, [-0.5] * response_len)
    (t.num_tool_calls, t.num_tool_errors, t.num_answer_tags,
     t.num_turns) = calls, errors, answers, turns
    t.tool_errors_by_kind["error"] = errors
    t.finished = True
    return t


def test_roc_keeps_g_of_2g_prefers_clean_positives_and_drops_all_equal_groups():
    cfg = rl.RLConfig(model="x", group_size=4, positive_rule="topk")
    # problem 0: 4 right (two of them with failed calls), 4 wrong; problem 1: all wrong
    mixed = [trajectory(0, i, errors=1 if i in (0, 1) else 0) for i in range(8)]
    rewards = [[1, 1, 1, 1, 0, 0, 0, 0], [0] * 8]
    samples, probes, records = rl.select_samples([mixed, [trajectory(1, i) for i in range(8)]],
                                                 rewards, cfg, step=0, position=0)
    assert len(samples) == 4 and {s.problem_index for s in samples} == {0}
    kept = {s.sample_index for s in samples}
    # the clean positives, not the ones with failed calls
    assert kept & {2, 3} == {2, 3} and not kept & {0, 1}
    assert sorted(s.advantage > 0 for s in samples) == [False, False, True, True]
    # Eq. 7: zero-mean within the group
    assert sum(s.advantage for s in samples) == pytest.approx(0, abs=1e-6)
    # the dropped group still feeds the sync guard
    assert [p.problem_index for p in probes] == [1]
    assert len(records) == 16 and sum(r["selected"] for r in records) == 4


@pytest.mark.parametrize("scaling, expected", [
    ("group", [0.5 / (1 / 3) ** 0.5] * 2 + [-0.5 / (1 / 3) ** 0.5] * 2),  # Eq. 7, this group's std
    ("none", [0.5, 0.5, -0.5, -0.5]),                                       # Dr. GRPO
    # one std over every reward of the step (1, 1, 0, 0 and the all-correct 1, 1, 1, 1): var 3/14
    ("batch", [0.5 / (3 / 14) ** 0.5] * 2 + [-0.5 / (3 / 14) ** 0.5] * 2),
])
def test_plain_grpo_trains_on_every_rollout_with_the_advantage_scaling_chosen(scaling, expected):
    # RoC samples 2G to keep G (§2.2.3); plain GRPO samples the G it trains on
    assert rl.RLConfig(group_size=16).rollouts_per_prompt == 32
    assert rl.RLConfig(group_size=16, algorithm="grpo").rollouts_per_prompt == 16
    cfg = rl.RLConfig(model="x", group_size=4, algorithm="grpo", advantage_scaling=scaling)
    groups = [[trajectory(0, i) for i in range(4)], [trajectory(1, i) for i in range(4)]]
    samples, _, _ = rl.select_samples(groups, [[1, 1, 0, 0], [1, 1, 1, 1]], cfg, step=0,
                                      position=0)
    assert [s.sample_index for s in samples] == [0, 1, 2, 3]
    assert [s.advantage for s in samples] == pytest.approx(expected, rel=1e-5)


def test_roc_draws_are_reproducible_from_seed_step_and_data_position():
    cfg = rl.RLConfig(model="x", group_size=4, positive_rule="sample")
    group = [trajectory(5, i, errors=i % 3 and 1) for i in range(8)]
    rewards = [[1, 1, 1, 1, 1, 1, 0, 0]]
    draw = lambda step, position: sorted(  # noqa: E731
        s.sample_index for s in rl.select_samples([group], rewards, cfg, step, position)[0])
    assert draw(3, 40) == draw(3, 40)
    assert len({tuple(draw(3, p)) for p in range(40, 60)}) > 1  # other positions, other draws


def test_tool_error_ratio_in_correct_pools_the_calls_of_correct_trajectories_only():
    records = [dict(reward=r, selected=True, all_equal=False, penalty=0.0, format_penalty=0.0,
                    tool_calls=c, tool_errors=e, parse_errors=p,
                    errors_by_kind={"error": e - p, "parse": p}, response_tokens=10, model_tokens=8,
                    truncated=False, turns=2, problem=0)
               for r, c, e, p in [(1, 4, 1, 0), (1, 1, 0, 0), (0, 5, 5, 2), (0, 0, 0, 0)]]
    metrics = step_metrics(records, num_groups=1)
    # Fig. 4: 1 failed of 5 calls
    assert metrics["tool_error_ratio_in_correct"] == pytest.approx(1 / 5)
    assert metrics["tool_error_ratio"] == pytest.approx(6 / 10)
    assert metrics["parse_failure_rate"] == pytest.approx(2 / 10)
    assert metrics["tool_call_rate"] == pytest.approx(3 / 4)
    assert metrics["accuracy"] == pytest.approx(0.5)
    # records without the verifier's flag count as graded; flagged ones are counted
    assert metrics["ungraded"] == 0
    records[3]["ungraded"] = True
    assert step_metrics(records, num_groups=1)["ungraded"] == 1


def test_a_run_that_starts_over_or_resumes_logs_every_step_once(tmp_path):
    """Starting over drops the old rows; a resume from step 2 keeps rows 0-2 and logs from 3."""
    path = tmp_path / "metrics.jsonl"
    for resume_step, kept in ((0, []), (2, [0, 1, 2])):
        path.write_text("".join(json.dumps({"step": step, "accuracy": 0.1}) + "\n"
                                for step in range(4)))
        logger = MetricsLogger(tmp_path, resume_step=resume_step)
        assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == kept
        for step in range(resume_step + bool(resume_step), 4):
            logger.log(step, {"accuracy": 0.2})
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [row["step"] for row in rows] == [0, 1, 2, 3]
        assert [row["accuracy"] for row in rows] == [0.1] * len(kept) + [0.2] * (4 - len(kept))


# keys that cannot act: each claim of RLConfig.inert_keys against rl.py's phases 4-6's gradients

# per rollout: (tool calls, failed, <answer> blocks, turns, response tokens); then the rewards
ROLLOUTS = [(2, 2, 1, 3, 30), (1, 0, 3, 2, 12), (1, 0, 1, 2, 40), (2, 1, 1, 3, 9),
            (0, 0, 1, 1, 25), (1, 1, 2, 2, 18), (1, 0, 1, 2, 33), (3, 0, 1, 4, 7)]
REWARDS = [[1, 1, 0, 1, 1, 1, 0, 1], [1, 0, 0, 1, 0, 1, 0, 0]]  # the first 4 mixed too (GRPO)


@pytest.fixture(scope="module")
def scored_groups(tiny_model_dir):
    """Two groups of 8, engine log-probs the tiny model's plus noise (a gap to correct)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rng, groups = random.Random(7), []
    for problem in range(2):
        group = []
        for index, (calls, errors, answers, turns, length) in enumerate(ROLLOUTS):
            t = Trajectory(problem, index, [rng.randrange(3, 500) for _ in range(6)],
                           [rng.randrange(3, 500) for _ in range(length)],
                           [0 if 4 <= j < 8 else 1 for j in range(length)])  # a tool block
            with torch.no_grad():
                logp = token_logprobs(model, torch.tensor([t.prompt_ids + t.response_ids]), 1.0)
            t.logprobs = [(lp + rng.uniform(-0.3, 0.3)) * m for lp, m in
                          zip(logp[0, len(t.prompt_ids) - 1:].tolist(), t.loss_mask)]
            (t.num_tool_calls, t.num_tool_errors, t.num_answer_tags, t.num_turns) = (
                calls, errors, answers, turns)
            t.tool_errors_by_kind["error"] = errors
            group.append(t)
        groups.append(group)
    return groups, REWARDS


UPDATES = {}


def update_gradients(model_dir, scored, overrides):
    """(cfg, each optimizer step's gradient) of rl.py's phases 4-6 under `overrides`, memoised."""
    key = tuple(sorted(overrides))
    if key not in UPDATES:
        init_distributed()
        cfg = load_config(rl.RLConfig, [f"model={model_dir}", "group_size=4", "prompts_per_step=2",
                                        "lr=1e-2", "warmup_steps=0", *overrides])
        model, optimizer = load_policy(cfg, torch.device("cpu"), 0)
        size, (groups, rewards) = cfg.rollouts_per_prompt, scored
        samples, probes, _ = rl.select_samples([g[:size] for g in groups],
                                               [r[:size] for r in rewards], cfg, 0, 0)
        grads = []
        optimizer.register_step_pre_hook(lambda *_: grads.append(torch.cat(
            [p.grad.full_tensor().flatten() for p in model.parameters()])))
        rl.learn(model, optimizer, rl.balance_blocks(samples, cfg, {}), probes, cfg, 0, 0,
                 torch.device("cpu"), {})
        UPDATES[key] = cfg, grads
    return UPDATES[key]


# (keys set off their defaults, a setting where they cannot act, one where they act)
INERT_CLAIMS = [
    (["clip_low=3e-4", "clip_high=4e-4"], [], ["mini_batches=2"]),
    (["dual_clip=1.001"], [], ["mini_batches=2"]),
    (["ratio_level=sequence"], [], ["mini_batches=2"]),
    (["ratio_level=sequence"], ["rollout_correction=geometric_tis"],
     ["rollout_correction=token_tis"]),  # a weight that varies within a rollout
    (["rollout_is_threshold=1.2"], [], ["rollout_correction=token_tis"]),
    (["positive_rule=topk"], ["algorithm=grpo"], []),
    (["roc_error_ratio=false", "roc_answer_format=false"], ["algorithm=grpo"],
     ["positive_rule=topk"]),
    (["roc_error_ratio=false", "roc_answer_format=false"], ["positive_rule=shortest"],
     ["positive_rule=topk"]),
]


@pytest.mark.parametrize("keys, inert, acting", INERT_CLAIMS,
                         ids=[" ".join(k + i) for k, i, _ in INERT_CLAIMS])
def test_a_key_that_cannot_act_says_so_and_leaves_every_gradient_as_it_was(
        keys, inert, acting, tiny_model_dir, scored_groups):
    names = {k.split("=")[0] for k in keys}
    for setting, acts in ((inert, False), (acting, True)):
        _, before = update_gradients(tiny_model_dir, scored_groups, setting)
        cfg, after = update_gradients(tiny_model_dir, scored_groups, setting + keys)
        said = {line.split("=")[0] for line in cfg.inert_keys()}
        assert len(after) == len(before) and max(g.abs().max() for g in before) > 1e-3
        gap = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(after, before))
        if acts:
            assert not names & said and gap > 1e-3, (setting, gap)
        else:
            assert names <= said and gap < 1e-5, (setting, gap)


# saved rollouts: what select_samples saw and chose, written and read back (no engine)

def test_saved_rollouts_hold_what_selection_saw_and_chose_and_keep_the_newest_steps(tmp_path,
                                                                                      capsys):
    init_distributed()
    cfg = rl.RLConfig(model="x", group_size=4, save_rollouts_every=2, keep_rollouts=2)
    rows = [{"id": "p-0", "problem": "Compute 1 + 1.", "answer": "2"},
            {"id": "p-1", "problem": "Compute 2 + 2.", "answer": "4"}]
    groups = [[trajectory(0, i, errors=i % 2) for i in range(8)],
              [trajectory(1, i) for i in range(8)]]
    groups[0][3].tool_calls = [{"code": "print(1/0)", "stdin": "", "status": "error",
                                "output": "ZeroDivisionError: division by zero"}]
    rewards = [[1, 1, 1, 1, 1, 0, 0, 0], [0] * 8]
    run = SimpleNamespace(cfg=cfg, out_dir=tmp_path, logger=MetricsLogger(tmp_path, enabled=False))
    for step in range(7):  # saves steps 1, 3, 5, 7 (0-based 0, 2, 4, 6)
        samples, _, records = rl.select_samples(groups, rewards, cfg, step, position=8 * step)
        save_rollouts(run, step, 8 * step, rows, groups, rewards, records, samples)
    assert saved_steps(tmp_path) == [5, 7]
    number, meta, saved = read_rollouts(tmp_path)  # the newest
    assert (number, meta["data_position"], meta["ranks"], len(saved)) == (7, 48, 1, 16)
    first = saved[3]
    assert (first["id"], first["position"], first["reward"]) == ("p-0", 48, 1)
    assert first["tool_calls"][0]["output"].startswith("ZeroDivisionError")
    assert first["model_tokens"] == 6 and first["logprob_sum"] == pytest.approx(-3.0)
    # the live choice, in the file
    samples, _, records = rl.select_samples(groups, rewards, cfg, 6, position=48)
    assert [r["selected"] for r in saved] == [r["selected"] for r in records]
    live = {(s.problem_index, s.sample_index): s.advantage for s in samples}
    assert {(r["problem_index"], r["sample_index"]): r["advantage"] for r in saved
            if r["selected"]} == live and all(r["advantage"] is None for r in saved
                                              if not r["selected"])
    # read back, selection chooses the same
    replayed_groups, replayed_rewards = replay_tool.saved_groups(saved, meta, cfg)
    assert replayed_groups == groups and replayed_rewards == rewards
    again, _, _ = rl.select_samples(replayed_groups, replayed_rewards, cfg, 6, position=48)
    assert {(s.problem_index, s.sample_index): s.advantage for s in again} == live
    # plain GRPO may thin the 2G saved; RoC needs the count it was sampled with
    replay_tool.saved_groups(saved, meta, dataclasses.replace(cfg, algorithm="grpo"))
    with pytest.raises(ConfigError, match="8 rollouts per"):
        replay_tool.saved_groups(saved, meta, dataclasses.replace(cfg, group_size=5))
    (step_dir(tmp_path, 7) / "step.json").unlink()
    assert saved_steps(tmp_path) == [5]
    with pytest.raises(ConfigError, match=r"replay_step=7"):
        read_rollouts(tmp_path, 7)
    # torn on disk: a .gz keeps what is before the tear, a step.json leaves the step unsaved
    capsys.readouterr()
    shard = step_dir(tmp_path, 5) / "rank_00000.jsonl.gz"
    shard.write_bytes(shard.read_bytes()[:-40])
    assert 0 < len(read_rollouts(tmp_path, 5)[2]) < 16
    (step_dir(tmp_path, 5) / "step.json").write_text('{"step": 5, "ra')
    assert saved_steps(tmp_path) == []
    out = capsys.readouterr().out
    assert f"{shard}: its end is torn" in out and f"{step_dir(tmp_path, 5)}/step.json" in out


# stages: stage 3 from stage 2's master weights, a fresh optimizer (§4.3); the printed data plan

def test_stage_3_starts_from_the_stage_2_master_weights_with_a_fresh_optimizer(tiny_model_dir,
                                                                               tmp_path):
    init_distributed()  # a gloo world of one: FSDP2 and DCP take the path they take under torchrun
    stage2 = tmp_path / "stage2" / "checkpoints"
    cfg = load_config(rl.RLConfig, ["configs/stage3.yaml", f"model={tiny_model_dir}",
                                    f"init_from={stage2}", f"out_dir={tmp_path / 'stage3'}",
                                    "world_size=0", "lr=1e-3"])
    assert not cfg.init_optimizer  # what configs/stage3.yaml says
    model, optimizer = load_policy(cfg, torch.device("cpu"), 0)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 30),
                              generator=torch.Generator().manual_seed(0))
    (-token_logprobs(model, input_ids, 1.0, 16).mean()).backward()
    optimizer.step()  # stage 2's weights and AdamW moments: not the HF directory's any more
    save_checkpoint(stage2, 385, model, optimizer, {"step": 385, "data_position": 385 * 512})

    # stage 3's own run directory has no checkpoint yet
    checkpoint, weights_only = start_checkpoint(cfg, None)
    assert checkpoint == latest_checkpoint(stage2) and weights_only
    fresh, fresh_optimizer = load_policy(cfg, torch.device("cpu"), 0)
    trained = {name: p.full_tensor() for name, p in model.named_parameters()}
    assert any(not torch.equal(p.full_tensor(), trained[name])
               for name, p in fresh.named_parameters())
    load_weights(checkpoint, fresh)
    for name, p in fresh.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.full_tensor(), trained[name]), name
    assert fresh_optimizer.state_dict()["state"] == {}
    # stage 2 (init_optimizer true) takes everything; once stage 3 has saved, its own wins
    assert start_checkpoint(
        load_config(rl.RLConfig, [f"model={tiny_model_dir}", f"init_from={stage2}"]),
        None) == (checkpoint, False)
    save_checkpoint(tmp_path / "stage3" / "checkpoints", 10, fresh, fresh_optimizer,
                    {"step": 10, "data_position": 5120})
    own = requested_checkpoint(cfg.resume, tmp_path / "stage3" / "checkpoints")
    assert start_checkpoint(cfg, own) == (own, False)


def test_bf16_training_is_fsdp2_mixed_precision_on_gloo_as_on_a_gpu(tiny_model_dir):
    """bf16 compute, fp32 master weights, gradients and AdamW step (train_dtype=auto on a GPU)."""
    init_distributed()
    cpu = torch.device("cpu")
    assert (compute_dtype(torch.device("cuda")) == torch.bfloat16
            and compute_dtype(cpu) == torch.float32)
    cfg = load_config(rl.RLConfig, [f"model={tiny_model_dir}", "lr=1e-3", "warmup_steps=0",
                                    "train_dtype=bfloat16"])
    model, optimizer = load_policy(cfg, cpu, 0)
    reference, _ = load_policy(dataclasses.replace(cfg, train_dtype="float32"), cpu, 0)
    before = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, args, out: seen.append((module.weight.dtype, args[0].dtype, out.dtype)))
    samples = fixed_batch(model.config.vocab_size)
    input_ids = collate(samples[:4], 0, cpu)[0]
    with torch.no_grad():
        gap = (token_logprobs(model, input_ids, 1.0)
               - token_logprobs(reference, input_ids, 1.0)).abs()
    assert seen == [(torch.bfloat16,) * 3]
    # bf16 rounding (4e-3 here) of the same weights, not another model
    assert 1e-4 < gap.max() < 0.05, gap.max()

    rl.recompute_logprobs(model, samples, cfg, 0, cpu)
    grads = {}
    optimizer.register_step_pre_hook(
        lambda *_: grads.update((n, p.grad.dtype) for n, p in model.named_parameters()))
    metrics = rl.train_step(model, optimizer, samples, cfg, 0, 0, cpu)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert set(grads.values()) == {torch.float32} and len(grads) == len(before)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and not torch.equal(p.full_tensor(), before[name]), name


def test_the_planned_epochs_are_printed_and_many_passes_warn():
    cfg = load_config(rl.RLConfig, ["configs/stage1.yaml", "model=x"])
    problems = len(load_problems(cfg.train_data))
    epochs, line = epoch_plan(cfg, problems, start_step=0)
    assert epochs == pytest.approx(300 * 512 / 8127) and "18.9 epochs" in line and "WARNING" in line
    epochs, line = epoch_plan(cfg, 42_000, start_step=0)  # the paper's data size
    assert epochs == pytest.approx(3.66, abs=0.01) and "WARNING" not in line
    # a finished run plans nothing more
    assert "0.0 epochs" in epoch_plan(cfg, 42_000, start_step=300)[1]


# bad input stops before any work, with a message that names the problem

@pytest.mark.parametrize("overrides", [
    ["prompts_per_step=6", "mini_batches=4"], ["micro_batch_tokens=512"], ["group_size=2"],
    ["rollout.max_turns=0"], ["rollout.top_p=0"], ["rollout.tool_workers=-1"], ["dual_clip=0.5"],
    ["lr=0"], ["save_every=0"], ["resume=/no/such/checkpoint"], ["init_optimizer=false"],
    ["rollout_correction=token_tis", "rollout_is_threshold=1.0"],
    ["clip_low=1"], ["positive_rule=best"], ["ratio_level=step"],
    ["rollout_correction=off"],  # YAML reads off as false: the refusal names the key
])
def test_bad_configs_are_rejected_when_loaded_in_one_line_naming_the_key(overrides):
    with pytest.raises(ConfigError) as refused:
        load_config(rl.RLConfig, ["configs/tiny.yaml", *overrides])
    key = overrides[-1].split("=")[0]
    if key == "mini_batches":  # the conflict is stated from prompts_per_step's side
        key = "prompts_per_step"
    assert key in str(refused.value) and "\n" not in str(refused.value).strip()


def test_a_tensor_parallel_size_that_does_not_fit_is_rejected_before_loading_anything(
        tiny_model_dir):
    cfg = load_config(rl.RLConfig, ["configs/tiny.yaml", f"model={tiny_model_dir}",
                                    "rollout.tensor_parallel_size=4"])
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 .* 6 ranks"):
        check_inputs(cfg, world_size=6)
    cfg = load_config(rl.RLConfig, ["configs/tiny.yaml", f"model={tiny_model_dir}",
                                    "rollout.tensor_parallel_size=8"])
    with pytest.raises(ConfigError, match="tensor_parallel_size=8 .* 4 attention heads"):
        check_inputs(cfg, world_size=8)


# a real run (engine, executor, reward pool): SIGKILL after a checkpoint, resume=auto, same metrics

def deterministic(metrics):
    """Everything but wall-clock times and rates."""
    return [{k: v for k, v in m.items()
             if not k.startswith("time/") and not k.endswith("_per_s") and k != "timestamp"}
            for m in metrics]


# rl_step's phases, a time/ key each (time/tool_busy overlaps; checkpoint and eval come after)
STEP_PHASES = ("weight_update", "rollout", "reward", "selection", "save_rollouts", "balance",
               "old_logprobs", "train", "logprob_gap", "metrics")


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_with_the_same_data_and_metrics(
        sft_policy, saved_run, tmp_path):
    """saved_run is the run straight through; the same command SIGKILLed after its first
    checkpoint and resumed must reach the same metrics and weights."""
    straight = read_metrics(saved_run.dir)
    assert [m["step"] for m in straight] == [1, 2]
    assert saved_run.started < straight[0]["timestamp"] < straight[1]["timestamp"] < time.time()
    for row in straight:  # a step's time is its phases'; the checkpoint is logged apart
        phases = sum(row[f"time/{phase}"] for phase in STEP_PHASES)
        assert phases == pytest.approx(row["time/step"], rel=0.05) and row["time/checkpoint"] > 0
    # both steps trained: step 2 needs step 1's weights and AdamW moments restored
    assert all(m["selected"] > 0 and m["train_tokens"] > 0 for m in straight)
    # the sync guard on a real update: the engine agrees with the trainer to fp32 noise
    assert all(m["logprob_gap_max"] < 1e-4 for m in straight)
    # logged every step: the policy's entropy, and the same gap as the rollout correction sees it
    assert all(m["entropy"] > 0 and 0 <= m["rollout_corr/k3_kl"] < 1e-6
               and m["rollout_corr/weight_mean"] == 1.0 for m in straight)

    # the same run, SIGKILLed (no cleanup, no atexit) once the step-1 checkpoint is complete
    killed = tmp_path / "killed"
    command = [PYTHON, "rl.py", *(f"out_dir={killed}" if arg.startswith("out_dir=") else arg
                                  for arg in saved_run.args)]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "step_00000001" / "COMPLETE").exists():
        assert proc.poll() is None and time.time() < deadline, (
            "the run ended before its first checkpoint")
        time.sleep(0.2)
    # the process group: the trainer, its tool and reward workers
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # a save that was cut short leaves only a .tmp directory, which resume must ignore
    (killed / "checkpoints" / "step_00000002.tmp").mkdir(exist_ok=True)

    resumed = run(command, timeout=900)
    assert "resumed from" in resumed.stdout and "step 1, data position 4" in resumed.stdout
    after = read_metrics(killed)
    assert [m["step"] for m in after] == [1, 2]
    for a, b in zip(deterministic(straight), deterministic(after)):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
            else:
                assert a[key] == b[key], (a["step"], key)
    # ...and the policy both runs end with is the same
    final_straight = load_file(saved_run.dir / "hf_step_2" / "model.safetensors")
    final_resumed = load_file(killed / "hf_step_2" / "model.safetensors")
    for name, weight in final_straight.items():
        torch.testing.assert_close(final_resumed[name], weight, atol=1e-6, rtol=1e-5, msg=name)
    # both directories say the format they were trained in (configs/tiny.yaml: the code prompt)
    for model_dir in (sft_policy, killed / "hf_step_2"):
        record, template, schema = read_format(model_dir)
        assert record["prompt_variant"] == "code" and (template, schema) == load_format(
            rollout.RolloutConfig(prompt_variant="code"))[:2]
    assert read_format(killed / "hf_step_2")[0]["written_by"] == "rl.py"


@pytest.mark.slow
def test_the_held_out_numbers_of_a_run_are_eval_pys_numbers(sft_policy, tmp_path):
    """rl.py's own held-out pieces give eval.evaluate's numbers on the same engine and seeds."""
    rows = [{**p, "id": f"{p['id']}-{k}"} for k in range(3) for p in MEMO_PROBLEMS]
    cfg = load_config(rl.RLConfig, ["configs/tiny.yaml", f"model={sft_policy}", "eval_samples=2",
                                    "rollout.max_response_tokens=200"])
    init_distributed()
    engine = Engine(sft_policy, cfg.rollout, seed=cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(sft_policy)
    tokenizer = AutoTokenizer.from_pretrained(sft_policy)
    with Executor(workers=1) as executor:
        run = SimpleNamespace(cfg=cfg, eval_rows=rows, engine=engine, model=model, world_size=1,
                              rank=0, weight_dtype=torch.float32, executor=executor,
                              tokenizer=tokenizer)
        mine = rl.evaluate_held_out(run)
        eval_cfg = evaluation.EvalConfig(model=str(sft_policy), benchmarks=["held_out"], n=2,
                                         seed=cfg.seed, rollout=dataclasses.replace(
                                             cfg.rollout, temperature=cfg.eval_temperature))
        theirs = evaluation.evaluate(sft_policy, {"held_out": rows}, eval_cfg, engine=engine,
                                     executor=executor, tokenizer=tokenizer)["held_out"]
    engine.close()
    assert mine["eval/pass@1"] == theirs["pass@1"]
    assert 0 < mine["eval/tool_calls_per_trajectory"] == theirs["tool_calls_per_trajectory"]
    for key in ("tool_error_rate", "tool_error_rate_in_correct", "answer_rate", "response_tokens"):
        assert mine.get(f"eval/{key}") == theirs[key], key


# how a run ends: Ctrl-C, nothing to train on, the closing lines

@pytest.mark.slow
def test_ctrl_c_ends_without_a_traceback_or_a_process_left_and_untrained_steps_warn(
        tiny_model_dir, tmp_path):
    """Ctrl-C (SIGINT to the process group) mid-run: 130, no traceback, no process left, and the
    same command resumes to the end. The untrained model's rewards are all 0: steps train on
    nothing, which the run says."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n"
                            for r in tiny.make_arithmetic_problems(40, 0, split="train")))
    out = tmp_path / "run"
    cmd = [PYTHON, "rl.py", "configs/tiny.yaml", f"model={tiny_model_dir}", f"train_data={data}",
           "eval_data=", f"out_dir={out}", "steps=6", "prompts_per_step=4", "save_every=2",
           "rollout.max_response_tokens=32", "untrained_steps_warn=2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    deadline = time.time() + 600
    while not (out / "checkpoints" / "step_00000002" / "COMPLETE").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    # every process below the run: the tool's and the grader's workers, in their own sessions
    workers = {child.pid for child in psutil.Process(proc.pid).children(recursive=True)}
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    # where it stopped, and the checkpoint a resume starts from (save_every=2)
    reached = re.search(r"interrupted by SIGINT during step (\d) of 6 \((\d) done\)", output)
    assert reached and int(reached[1]) == int(reached[2]) + 1 >= 3, output[-3000:]
    assert str(out / "checkpoints" / f"step_{int(reached[2]) // 2 * 2:08d}") in output
    time.sleep(1)
    assert workers and not any(Path(f"/proc/{pid}").exists() for pid in workers)

    resumed = run(cmd, timeout=600)
    assert "resumed from" in resumed.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["selected"] == 0 and r["skipped_updates"] == 1 for r in rows)
    # the resumed run's first two steps (at least two are left): 2 in a row
    assert "WARNING: 2 steps in a row" in resumed.stdout and "All rewards are 0" in resumed.stdout
    assert "of the run's steps trained on nothing" in resumed.stdout
    assert f"eval.py configs/eval_tiny.yaml model={out / 'hf_step_6'}" in resumed.stdout


def test_a_held_out_evaluation_is_printed_once_when_it_ends(capsys):
    row = {"eval/pass@1": 0.61, "eval/tool_error_rate_in_correct": 0.292, "time/eval": 57.4}
    print_held_out(row, 1, "before step 1")  # another rank: nothing
    print_held_out(row, 0, "before step 1")
    print_held_out({**row, "eval/ungraded": 2}, 0, "after step 20")
    before, after = capsys.readouterr().out.splitlines()
    assert "before step 1: pass@1 0.610" in before and "0.292" in before
    assert "ungraded" not in before
    assert "after step 20" in after and "2 ungraded" in after
