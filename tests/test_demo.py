"""demo.py's stage records: a stage's result is reused only while what made it is unchanged (its
script and the repo modules it imports, config, args, data, the stages before it), a change reruns
it and names what changed, and a result with no record is reused only with a plain word about it."""
import os
import time

import pytest

import demo
from machinery.config import REPO


def test_a_stage_runs_the_repo_modules_its_script_imports_and_no_others():
    rl_files = {str(p.relative_to(REPO)) for p in demo.code_files("rl.py")}
    assert {"rl.py", "grpo_roc.py", "rollout.py", "reward.py", "executor.py",
            "machinery/engine.py", "machinery/checkpoint.py", "machinery/__init__.py"} <= rl_files
    # editing the evaluation or the demo does not make a training result stale
    assert not {"eval.py", "demo.py", "sft.py"} & rl_files


@pytest.fixture
def records(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "STAGES_DIR", str(tmp_path / "stages"))
    return tmp_path


def test_a_stage_is_reused_while_its_inputs_are_unchanged_and_rerun_when_one_changes(records,
                                                                                    capsys):
    config = records / "sft.yaml"
    config.write_text((REPO / "configs/sft_tiny.yaml").read_text())
    output = records / "run"
    inputs = demo.stage_inputs("sft.py", [config], ["lr=1"])
    assert inputs["sft.py"] and inputs["machinery/conversations.py"] and inputs[str(config)]
    assert "configs/templates/rstar2_code.jinja" in inputs and "torch" in inputs

    # first time: nothing to reuse; the record says so until the stage finishes
    assert not demo.reuse_stage("sft", output, inputs, fresh=False, complete=False)
    output.mkdir()
    (output / "final").mkdir()
    demo.stage_done("sft")
    assert demo.read_stage("sft")["done"] is True
    capsys.readouterr()

    # the same inputs: reused, and it says from when and how to rerun
    assert demo.reuse_stage("sft", output, demo.stage_inputs("sft.py", [config], ["lr=1"]),
                            fresh=False, complete=True)
    said = capsys.readouterr().out
    assert f"reusing {output}" in said and time.strftime("%Y-%m-%d") in said
    assert "fresh=true" in said

    # the config changed: the stage reruns into a clean directory, naming what changed
    config.write_text(config.read_text() + "\n# an edit\n")
    changed = demo.stage_inputs("sft.py", [config], ["lr=1"])
    assert not demo.reuse_stage("sft", output, changed, fresh=False, complete=True)
    said = capsys.readouterr().out
    assert f"rerunning sft: {config} changed" in said
    assert not output.exists() and demo.read_stage("sft")["done"] is False

    # fresh=true reruns whatever the record says
    demo.stage_done("sft")
    assert not demo.reuse_stage("sft", output, changed, fresh=True, complete=True)


def test_a_cut_off_stage_resumes_and_a_stage_after_a_rerun_one_reruns(records, capsys):
    output = records / "rl"
    sft_inputs = demo.stage_inputs("sft.py", ["configs/sft_tiny.yaml"])
    demo.reuse_stage("sft", records / "sft", sft_inputs, fresh=False, complete=False)
    demo.stage_done("sft")
    inputs = demo.stage_inputs("rl.py", ["configs/tiny.yaml"], upstream=["sft"])
    assert not demo.reuse_stage("rl", output, inputs, fresh=False, complete=False)
    output.mkdir()
    (output / "checkpoints").mkdir()  # cut off before its end: not done
    # the same inputs again: run, but into the same directory, so rl.py resumes
    assert not demo.reuse_stage("rl", output, inputs, fresh=False, complete=False)
    assert (output / "checkpoints").is_dir()
    # the SFT stage's inputs changed: the RL stage's input "stage sft" changes with them
    demo.reuse_stage("sft", records / "sft", {**sft_inputs, "args": "other"}, fresh=False,
                     complete=True)
    after = demo.stage_inputs("rl.py", ["configs/tiny.yaml"], upstream=["sft"])
    assert after["stage sft"] != inputs["stage sft"]
    assert not demo.reuse_stage("rl", output, after, fresh=False, complete=True)
    assert "rerunning rl: stage sft changed" in capsys.readouterr().out


def test_a_result_without_a_record_is_reused_only_with_its_date_and_how_to_rerun(records, capsys):
    output = records / "made-by-hand"
    output.mkdir()
    os.utime(output, (0, 0))
    assert demo.reuse_stage("rl", output, {"rl.py": "x"}, fresh=False, complete=True)
    said = capsys.readouterr().out
    assert "from 1970-01-01" in said and "no record of what made it" in said
    assert not demo.stage_record("rl").exists()  # reused as it is: nothing recorded for it
