"""Behaviour of tools/replay.py: a saved step of a real rl.py run (conftest.py's saved_run) replayed
offline gives the live step's kept set, advantages, loss and gradient norm; under other weights or
another correction it gives another; from the command line it compares and writes nothing.
(Reading saved files back into Trajectory objects: tests/test_rl.py's saved-rollouts test.)"""
import dataclasses
import json
import shutil
import subprocess

import pytest
import torch

from rl_runs import PYTHON, REPO, run
from machinery.checkpoint import load_policy, save_checkpoint
from machinery.config import ConfigError, load_config
from machinery.distributed import init_distributed
from machinery.saved_rollouts import (STEP_FILE, chosen_steps, kept_statistics, not_replayable,
                                      read_rollouts, replayable, saved_steps, step_dir,
                                      write_rollouts)
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
    assert "kept/positives/response_tokens" in out and "kept/overlap_with_live" in out
    assert {p: p.stat().st_mtime_ns for p in saved_run.dir.rglob("*") if p.is_file()} == before
    # the rollouts alone, without the run's checkpoints
    shutil.copytree(saved_run.dir / "rollouts", tmp_path / "rollouts")
    args = [a if not a.startswith("out_dir=") else f"out_dir={tmp_path}" for a in saved_run.args]
    proc = subprocess.run([PYTHON, "-m", "tools.replay", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    refusal = proc.stderr.splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "checkpoints/step_00000001: missing" in refusal and "replay_step=1 " in refusal


def test_kept_statistics_are_each_side_s_means_and_its_pooled_tool_error_ratio():
    saved = dict(selected=True, reward=1.0)  # a saved record's names, then select_samples'
    records = [{**saved, "response_tokens": 10, "num_tool_calls": 3, "num_tool_errors": 1,
                "penalty": 0.5, "tool_calls": [{"code": "print(1)"}] * 3},
               {**saved, "response_tokens": 30, "num_tool_calls": 1, "num_tool_errors": 1,
                "penalty": 1.5},
               {**saved, "selected": False, "response_tokens": 99, "num_tool_calls": 9,
                "num_tool_errors": 9, "penalty": 2.0},
               dict(selected=True, reward=0.0, response_tokens=50, tool_calls=0, tool_errors=0,
                    penalty=0.0)]
    assert kept_statistics(records) == {
        "kept/positives/response_tokens": 20.0, "kept/positives/tool_calls": 2.0,
        "kept/positives/tool_error_ratio": 2 / 4, "kept/positives/penalty": 1.0,
        "kept/negatives/response_tokens": 50.0, "kept/negatives/tool_calls": 0.0,
        "kept/negatives/tool_error_ratio": None, "kept/negatives/penalty": 0.0}


def test_replay_step_is_one_step_several_or_every_saved_one(tmp_path):
    for n in (1, 6, 11):
        step_dir(tmp_path, n).mkdir(parents=True)
        (step_dir(tmp_path, n) / STEP_FILE).write_text("{}")
    step_dir(tmp_path, 16).mkdir()  # no step.json: cut off while saving, never read
    assert chosen_steps(tmp_path, "all", "replay_step") == [1, 6, 11]
    assert chosen_steps(tmp_path, "0", "replay_step") == [11]
    assert chosen_steps(tmp_path, "6,11", "replay_step") == [6, 11]
    # of steps 1, 6, 11 only 1 (the run's start) and 11 (checkpoints/step_10 kept) replay exactly
    (tmp_path / "checkpoints" / "step_00000010").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000010" / "COMPLETE").write_text("")
    (tmp_path / "checkpoints" / "step_00000005").mkdir()  # no COMPLETE: cut off while saving
    assert replayable(tmp_path, [1, 6, 11]) == [1, 11]
    for value, named in (("last", "replay_step='last'"), ("16", "replay_step=16")):
        with pytest.raises(ConfigError, match=named):
            chosen_steps(tmp_path, value, "replay_step")
    with pytest.raises(ConfigError, match="elsewhere/rollouts"):
        chosen_steps(tmp_path / "elsewhere", "all", "replay_step")


@pytest.mark.parametrize("keep", [4, 2])
def test_the_save_says_which_saved_steps_will_not_replay_as_rotation_then_leaves_them(
        keep, tiny_model_dir, tmp_path):
    """configs/tiny.yaml (the demo's run) keeps every checkpoint a saved step needs, so
    all four replay; with keep_checkpoints=2 the save's line names the steps whose
    checkpoints rotation then really removes."""
    init_distributed()
    cfg = load_config(ReplayConfig, ["configs/tiny.yaml", f"model={tiny_model_dir}",
                                     f"out_dir={tmp_path}", f"keep_checkpoints={keep}"])
    model, optimizer = load_policy(cfg, torch.device("cpu"), 0)
    for step in range(cfg.steps):  # rl_step's saves, in its order
        if step % cfg.save_rollouts_every == 0:
            write_rollouts(tmp_path, step + 1, [], {})
        if (step + 1) % cfg.save_every == 0:
            save_checkpoint(tmp_path / "checkpoints", step + 1, model, optimizer, {},
                            keep=cfg.keep_checkpoints)
    saved = saved_steps(tmp_path)
    assert saved == [1, 6, 11, 16]
    said = [n for n in saved if not_replayable(cfg, n)]
    assert replayable(tmp_path, saved) == [n for n in saved if n not in said]
    assert said == ([] if keep == 4 else [6, 11])
    if keep == 2:
        assert not_replayable(cfg, 6) == ("keep_checkpoints=2 removes checkpoints/step_5 before "
                                          "step 20 (keep_checkpoints=4 keeps it)")
    assert not_replayable(dataclasses.replace(cfg, save_rollouts_every=3), 4) == (
        "no checkpoint is saved after step 3 (save_every=5)")
