"""Behaviour of rl.py: the update does not depend on how the batch is split, the data order survives a resume,
bad configs stop before any work, and a tiny run (real engine, real executor) killed with SIGKILL resumes exactly.

Run: .venv/bin/python -m pytest tests/test_rl.py -q        (-m "not slow" for the fast half, ~10 s)
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rl
from common import ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def run(cmd, **kw):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


# -----------------------------------------------------------------------------
# invariance: one update on a fixed global batch, split three ways (tests/dist_rl_train_step.py)

@pytest.fixture(scope="module")
def three_splits(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("invariance")
    script = REPO / "tests" / "dist_rl_train_step.py"
    splits = {
        "1 process x 1 micro-batch": [PYTHON, script, tiny_model_dir, out / "a.pt", "micro_batch_size=0"],
        "1 process x 4 micro-batches": [PYTHON, script, tiny_model_dir, out / "b.pt", "micro_batch_size=2"],
        "2 processes x 2 micro-batches": [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2", script,
                                          tiny_model_dir, out / "c.pt", "micro_batch_size=2"],
    }
    results = {}
    for name, cmd in splits.items():
        run([str(c) for c in cmd], timeout=300)
        results[name] = torch.load(cmd[-2], weights_only=False)
    return results


@pytest.mark.slow
def test_each_split_really_runs_the_micro_batches_it_claims(three_splits):
    counts = {name: r["metrics"]["num_micro_batches"] for name, r in three_splits.items()}
    assert list(counts.values()) == [1, 4, 2]
    # ...and every split saw the whole batch: the same global token count
    assert len({r["metrics"]["train_tokens"] for r in three_splits.values()}) == 1


@pytest.mark.slow
def test_gradients_and_metrics_do_not_depend_on_the_split(three_splits):
    reference, *others = three_splits.values()
    largest = max(g.abs().max().item() for g in reference["grads"].values())
    assert largest > 1e-3  # a real gradient, not zeros
    for other in others:
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(other["grads"][name], grad, atol=1e-6, rtol=1e-4, msg=name)
        for key in ("loss", "grad_norm", "clip_low_fraction", "clip_high_fraction", "approx_kl"):
            assert other["metrics"][key] == pytest.approx(reference["metrics"][key], rel=1e-5, abs=1e-7), key
    # both clips were active, so the clipped branches of Eq. 6 were part of what matched
    assert reference["metrics"]["clip_low_fraction"] > 0 and reference["metrics"]["clip_high_fraction"] > 0


@pytest.mark.slow
def test_updated_weights_do_not_depend_on_the_split(three_splits, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    reference, *others = three_splits.values()
    lr = 1e-3  # tests/dist_rl_train_step.py
    moved = torch.cat([(reference["weights"][n] - initial[n]).abs().flatten() for n in reference["weights"]])
    assert moved.median() > 0.5 * lr  # AdamW's first step moves almost every weight by about lr
    for other in others:
        for name, weight in reference["weights"].items():
            # AdamW's first step is ~lr * g / |g|: a coordinate whose gradient is ~1e-8 turns float noise into a
            # step of a fraction of lr, so weights are compared at 5% of lr; the gradients above are the tight check.
            torch.testing.assert_close(other["weights"][name], weight, atol=0.05 * lr, rtol=0, msg=name)


def test_a_per_micro_batch_mean_would_change_this_batch_far_beyond_the_tolerance(tiny_model_dir):
    """The negative control: the invariance batch is sensitive to the scaling bug the test is there to catch."""
    import random

    from grpo_roc import policy_loss
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from dist_rl_train_step import fixed_batch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    samples = fixed_batch(model.config.vocab_size)
    cfg = rl.RLConfig(model="x", micro_batch_size=2)
    grads = {}
    for mode in ("global", "per_micro_batch"):
        model.zero_grad()
        total = sum(sum(s.loss_mask) for s in samples)
        batches = rl.micro_batches(samples, cfg)
        for batch in batches:
            input_ids, _, mask, advantages, _ = rl.collate(batch, 0, torch.device("cpu"))
            logp = rl.token_logprobs(model, input_ids, 1.0)
            if mode == "global":  # rl.train_step's scaling (in one process)
                loss, _ = policy_loss(logp, logp.detach(), advantages, mask, num_tokens=total)
            else:                 # each micro-batch's own token mean, averaged over micro-batches
                loss, _ = policy_loss(logp, logp.detach(), advantages, mask)
                loss = loss / len(batches)
            loss.backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (grads["global"] - grads["per_micro_batch"]).abs().max() > 100 * 1e-6
