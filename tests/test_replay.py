"""Behaviour of tools/replay.py: a saved step of a real rl.py run (conftest.py's saved_run) replayed
offline gives the live step's kept set, advantages, loss and gradient norm; under other weights or
another correction it gives another; from the command line it compares and writes nothing.
(Reading saved files back into Trajectory objects: tests/test_rl.py's saved-rollouts test.)"""
import json
import shutil
import subprocess

import pytest

from rl_runs import PYTHON, REPO, run
from machinery.config import load_config
from machinery.saved_rollouts import read_rollouts
from tools.replay import ReplayConfig, replay


@pytest.mark.slow
def test_a_replayed_step_reproduces_the_live_steps_kept_set_advantages_and_loss(saved_run):
    """A replay reruns selection, advantages and the update on the saved trajectories, with the
    weights that sampled them: the initial policy for step 1, checkpoints/step_1 for step 2 (a
    policy one real update away). Both give the live step's kept trajectories, their advantages,
    its loss and its gradient norm. With one optimizer step per RL step the ratio of Eq. 6 is 1, so
    the loss's value is minus the token-mean advantage under any weights: the gradient is what the
    weights decide, and under the wrong ones (the initial policy for step 2) it is another."""
    live = [json.loads(line) for line in (saved_run.dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["selected"] > 0 for m in live)  # both steps trained: the loss is not trivial
    for number in (1, 2):
        cfg = load_config(ReplayConfig, [*saved_run.args, f"replay_step={number}"])
        replayed = replay(cfg)
        _, _, records = read_rollouts(saved_run.dir, number)
        assert replayed.kept == {(r["position"], r["sample_index"]): r["advantage"]
                                 for r in records if r["selected"]}
        for key in ("selected", "train_tokens", "loss", "grad_norm", "clip_high_fraction",
                    "logprob_gap_mean", "entropy", "rollout_corr/log_ratio_mean"):
            assert replayed.metrics[key] == pytest.approx(live[number - 1][key], rel=1e-5,
                                                          abs=1e-7), (number, key)
    # the negative control: step 2 under the initial policy, not the weights that sampled it
    wrong = replay(load_config(ReplayConfig, [*saved_run.args, "replay_step=2",
                                                f"replay_weights={cfg.model}"]))
    assert wrong.kept == replayed.kept
    assert abs(wrong.metrics["grad_norm"] / live[1]["grad_norm"] - 1) > 1e-3
    # another correction setting on the same data: MIS with a bound inside the CPU engine's 1e-6
    # gap drops some of the very tokens the live step trained on
    masked = replay(load_config(ReplayConfig, [*saved_run.args, "replay_step=2",
                                                 "rollout_correction=token_mis",
                                                 "rollout_is_threshold=1.000001"]))
    assert masked.kept == replayed.kept and 0 < masked.metrics["rollout_corr/masked_fraction"] < 1
    assert abs(masked.metrics["grad_norm"] / live[1]["grad_norm"] - 1) > 1e-3
    assert wrong.metrics["logprob_gap_mean"] > 100 * live[1]["logprob_gap_mean"]


@pytest.mark.slow
def test_replay_from_the_command_line_compares_and_says_which_weights_are_missing(saved_run,
                                                                                  tmp_path):
    """The command a forker types: another RoC rule on the saved step, printed beside the live
    numbers, nothing written into the run. Without the checkpoint that sampled a step, the error
    says which one is missing and which saved steps do replay."""
    before = {p: p.stat().st_mtime_ns for p in saved_run.dir.rglob("*") if p.is_file()}
    out = run([PYTHON, "-m", "tools.replay", *saved_run.args, "positive_rule=topk",
               "replay_update_effect=true"], timeout=300).stdout
    assert "replay of step 2" in out
    assert "changed from the live run: positive_rule: sample -> topk\n" in out
    assert "checkpoints/step_00000001 (the weights that sampled it)" in out
    assert "replay/logprob_change_positives" in out and "replayed on 1 rank(s): load" in out
    assert {p: p.stat().st_mtime_ns for p in saved_run.dir.rglob("*") if p.is_file()} == before
    # the rollouts alone, without the run's checkpoints
    shutil.copytree(saved_run.dir / "rollouts", tmp_path / "rollouts")
    args = [a if not a.startswith("out_dir=") else f"out_dir={tmp_path}" for a in saved_run.args]
    proc = subprocess.run([PYTHON, "-m", "tools.replay", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert ("replay of step 2: its rollouts were sampled by the weights after step 1" in proc.stderr
            and "Saved steps that replay exactly: 1;" in proc.stderr)
