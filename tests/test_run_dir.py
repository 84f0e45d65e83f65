"""A run directory holds one run (machinery/run_dir.py and lock.py), through the real scripts:
each test is what a user did to a run's directory (a rerun with other settings or fewer steps,
continue_with_changes, a second writer, a holder on another host or stalled, a resume into another
model, a torn row, a kill inside the commit, a damaged checkpoint), and what happens now.

Run: .venv/bin/python -m pytest tests/test_run_dir.py -q    (-m "not slow": the sft.py half, ~20 s)
"""
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time

import pytest
import rl_runs
import test_sft  # tests/ is on sys.path (pytest's rootdir-relative import)
import yaml
from rl_runs import PYTHON, REPO, run_at_once
from test_sft import chat_rows

import rl
import sft
import tiny
from machinery import lock
from machinery.checkpoint import checkpoint_damage, latest_checkpoint, requested_checkpoint
from machinery.config import ConfigError, load_config, read_records
from machinery.distributed import init_distributed
from machinery.lock import LOCK_NAME, release_lock, take_lock
from machinery.metrics import wandb_run_id
from machinery.results import open_samples
from machinery.run_dir import read_history

WORKER = "tests/dist_checkpoint.py"  # the real processes of the lease and commit


def snapshot(run_dir):
    """Every file under run_dir but the lock (a refused run takes it, then empties it) with its
    bytes and modification time: equal snapshots mean nothing was written."""
    return {str(p.relative_to(run_dir)): (hashlib.sha1(p.read_bytes()).hexdigest(),
                                          p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def steps_of(ckpt_root):
    return sorted(int(p.name.split("_")[1]) for p in ckpt_root.iterdir() if p.is_dir())


# -----------------------------------------------------------------------------
# sft.py, in process (a run of 2 steps is ~2 s)

@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("run-dir-sft") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(16)))
    return path


def run_sft(tiny_model_dir, data, out_dir, **overrides):
    """test_sft's tiny run, 2 steps with a checkpoint after each (one kept)."""
    settings = {"max_steps": 2, "save_every": 1, "keep_checkpoints": 1,
                "warmup_ratio": sft.SFTConfig.warmup_ratio}
    return test_sft.run_sft(tiny_model_dir, data, out_dir, **{**settings, **overrides})


def test_sft_continue_with_changes_is_recorded_and_rotation_keeps_the_earlier_checkpoints(
        tmp_path, tiny_model_dir, sft_data):
    run_sft(tiny_model_dir, sft_data, tmp_path, max_steps=4, save_every=2, keep_checkpoints=2)
    shutil.rmtree(tmp_path / "final")  # as if killed after step 2's checkpoint: 2 and 4 are left
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")
    run_sft(tiny_model_dir, sft_data, tmp_path, max_steps=4, save_every=1, keep_checkpoints=1,
            grad_clip=0.5, continue_with_changes=True)
    # keep_checkpoints=1 keeps one of this run's (4), and step 2, saved under the old settings
    assert steps_of(tmp_path / "checkpoints") == [2, 4]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["grad_clip"] == 0.5
    events = read_history(tmp_path)
    assert [(e["event"], e["at_step"]) for e in events] == [
        ("new", 0), ("finished", 4), ("continued_with_changes", 2), ("finished", 4)]
    assert events[2]["changes"]["grad_clip"] == [1.0, 0.5]
    assert events[2]["config"]["grad_clip"] == 0.5


def test_sft_a_refused_or_failed_resume_leaves_the_run_directory_as_it_was(
        tmp_path, tiny_model_dir, sft_data):
    """Into a model with one more layer (every shape matches, the set does not): refused by name
    before anything loads. With data that changed the run: the load refuses it. Both leave
    config.yaml and the history byte for byte as they were."""
    run = tmp_path / "run"
    run_sft(tiny_model_dir, sft_data, run, keep_checkpoints=2)
    shutil.rmtree(run / "final")  # as if killed after step 2: a rerun resumes
    before = snapshot(run)
    deeper = tiny.build_tiny_model(tiny.TinyConfig(out_dir=str(tmp_path / "deeper"),
                                                   pretrain_steps=0, num_hidden_layers=3))
    with pytest.raises(ConfigError, match="another model .model.layers.2.input_layernorm"):
        run_sft(deeper, sft_data, run, keep_checkpoints=2, continue_with_changes=True)
    assert snapshot(run) == before
    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(24)))
    with pytest.raises(ConfigError, match="the run changed since it was saved"):
        run_sft(tiny_model_dir, more, run, keep_checkpoints=2, continue_with_changes=True)
    assert snapshot(run) == before


def test_sft_a_torn_row_and_a_kill_inside_the_commit_resume_from_the_last_committed_step(
        tmp_path, tiny_model_dir, sft_data, capsys):
    """Killed while writing step 2's row, and inside its commit (COMPLETE written, the rename not
    made): the resume drops the half row with one warning naming the file, never reads the .tmp
    (it removes it), resumes from step 1 and redoes step 2."""
    run_sft(tiny_model_dir, sft_data, tmp_path, keep_checkpoints=2)
    shutil.rmtree(tmp_path / "final")
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step_00000002").rename(checkpoints / "step_00000002.tmp")
    assert (checkpoints / "step_00000002.tmp" / "COMPLETE").is_file()
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text(rows[0] + "\n" + rows[1][:40])
    capsys.readouterr()
    run_sft(tiny_model_dir, sft_data, tmp_path, keep_checkpoints=2)
    out = capsys.readouterr().out
    assert out.count("its end is torn") == 1 and str(tmp_path / "metrics.jsonl") in out
    assert f"resumed from {checkpoints / 'step_00000001'} at step 1" in out
    assert f"removed {checkpoints / 'step_00000002.tmp'}" in out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000001", "step_00000002"]
    resumed = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in resumed] == [1, 2] and resumed[0] == rows[0]
    assert [e["event"] for e in read_history(tmp_path)] == ["new", "finished", "resumed",
                                                            "finished"]


def test_sft_an_out_dir_that_cannot_be_a_directory_is_refused_in_one_line(
        tmp_path, tiny_model_dir, sft_data):
    """A file where out_dir or one of its parents should be, a name too long, a symlink loop:
    one line each, nothing made."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for out_dir, reason in ((tmp_path / "file", "File exists"),
                            (tmp_path / "file" / "run", "Not a directory"),
                            (tmp_path / ("x" * 300) / "run", "File name too long"),
                            (tmp_path / "loop" / "run", "Too many levels of symbolic links")):
        with pytest.raises(ConfigError, match=f"^out_dir={out_dir}: .*{reason}[^\n]*$"):
            run_sft(tiny_model_dir, sft_data, out_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "loop"]


def test_the_w_and_b_run_id_is_kept_in_the_run_directory(tmp_path):
    """Every start continues one W&B run (wandb.init(id=..., resume="allow")): the id it is given."""
    first = wandb_run_id(tmp_path)
    assert re.fullmatch("[0-9a-f]{8}", first) and wandb_run_id(tmp_path) == first
    assert (tmp_path / "wandb_run_id").read_text() == first + "\n"
    (tmp_path / "other").mkdir()
    assert wandb_run_id(tmp_path / "other") != first  # another run directory, another W&B run


# -----------------------------------------------------------------------------
# rl.py: one real run as the fixture; refusals through rl.train in process, runs as `python rl.py`

RL_ARGS = ["eval_data=", "steps=2", "prompts_per_step=2", "save_every=1", "keep_checkpoints=2",
           "rollout.max_response_tokens=64", "rollout.max_turns=1", "micro_batch_tokens=1024",
           "train_threads=1"]


def rl_args(model, data, out_dir, *overrides):
    return ["configs/tiny.yaml", f"model={model}", f"train_data={data}", f"out_dir={out_dir}",
            *RL_ARGS, *overrides]


def rl_process(args, check=True):
    return rl_runs.run([rl_runs.PYTHON, "rl.py", *args], check=check)


@pytest.fixture(scope="module")
def finished_rl(tiny_model_dir, tmp_path_factory):
    """(model, data, a finished 2-step run directory with checkpoints 1 and 2): the demo's state."""
    work = tmp_path_factory.mktemp("run-dir-rl")
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n"
                            for r in tiny.make_arithmetic_problems(8, 0, split="train")))
    rl_process(rl_args(tiny_model_dir, data, work / "run"))
    return tiny_model_dir, data, work / "run"


def copy_run(finished_rl, tmp_path):
    model, data, run = finished_rl
    shutil.copytree(run, tmp_path / "run", copy_function=shutil.copy2)
    return model, data, tmp_path / "run"


def train_in_process(model, data, out_dir, *overrides):
    init_distributed()  # a gloo world of one, as `python rl.py` makes
    return rl.train(load_config(rl.RLConfig, rl_args(model, data, out_dir, *overrides)))


@pytest.mark.slow
def test_rl_a_checkpoint_of_another_model_is_refused_in_one_line_before_any_model_loads(
        finished_rl, tmp_path):
    """Into a wider, deeper model: named as another model's; nothing created or changed."""
    _, data, run = copy_run(finished_rl, tmp_path)
    wide = tiny.build_tiny_model(tiny.TinyConfig(out_dir=str(tmp_path / "wide"), pretrain_steps=0,
                                                 hidden_size=192, num_hidden_layers=3))
    before = snapshot(run)
    checkpoint = run / "checkpoints" / "step_00000002"
    for proc in run_at_once([[PYTHON, "rl.py", *rl_args(wide, data, out_dir, *overrides)]
                             for out_dir, overrides in ((tmp_path / "new" / "run",
                                                         [f"resume={checkpoint}"]),
                                                        (run, ["continue_with_changes=true"]))],
                            check=False):
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
        assert proc.stderr.startswith(f"rl.py: {checkpoint}: a checkpoint of another model (")
        assert "Loading weights" not in proc.stdout
    assert not (tmp_path / "new").exists() and snapshot(run) == before


@pytest.mark.slow
def test_rl_a_rerun_with_other_settings_writes_nothing_and_continue_with_changes_is_recorded(
        finished_rl, tmp_path):
    """Other settings, resume=never: refused, nothing written; fewer steps: nothing to do (a
    resume may change steps). continue_with_changes: recorded; rotation keeps the old run's."""
    model, data, run = copy_run(finished_rl, tmp_path)
    before = snapshot(run)
    with pytest.raises(ConfigError) as refused:  # another experiment into the demo's out_dir
        train_in_process(model, data, run, "steps=3", "positive_rule=topk", "lr=1e-4")
    message = str(refused.value)
    assert "positive_rule: 'sample' -> 'topk'" in message and "lr: 0.0002 -> 0.0001" in message
    assert "steps:" not in message and "\n" not in message
    assert train_in_process(model, data, run, "steps=1") == {}  # already at step 2
    with pytest.raises(ConfigError, match="^resume=never: .*checkpoints, hf_step_2, metrics"):
        train_in_process(model, data, run, "resume=never")
    assert snapshot(run) == before and (run / LOCK_NAME).read_text() == ""  # released by each
    rl_process(rl_args(model, data, run, "steps=3", "positive_rule=topk", "keep_checkpoints=1",
                       "continue_with_changes=true"))
    # keep_checkpoints=1 rotates this run's own checkpoints only: 1 and 2 came from the sample rule
    assert steps_of(run / "checkpoints") == [1, 2, 3]
    assert yaml.safe_load((run / "config.yaml").read_text())["positive_rule"] == "topk"
    events = read_history(run)
    assert [(e["event"], e["at_step"]) for e in events] == [
        ("new", 0), ("finished", 2), ("continued_with_changes", 2), ("finished", 3)]
    changes = {k: v for k, v in events[2]["changes"].items() if k != "out_dir"}  # copied here
    assert changes == {"keep_checkpoints": [2, 1], "positive_rule": ["sample", "topk"],
                       "steps": [2, 3], "continue_with_changes": [False, True]}
    assert events[0]["config"]["positive_rule"] == "sample"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()] == [1, 2, 3]


@pytest.mark.slow
def test_rl_a_damaged_checkpoint_is_named_and_the_newest_intact_one_used(finished_rl, tmp_path,
                                                                        capsys):
    model, data, run = copy_run(finished_rl, tmp_path)
    shard = run / "checkpoints" / "step_00000002" / "__0_0.distcp"
    with open(shard, "r+b") as f:  # COMPLETE is there; the shard was cut short
        f.truncate(shard.stat().st_size // 2)
    # asked for by name, it is not swapped for another: the exact resume= of the intact one
    with pytest.raises(ConfigError) as refused:
        train_in_process(model, data, run, "steps=3", f"resume={shard.parent}")
    assert str(refused.value).startswith(f"resume={shard.parent}: damaged ({shard}: truncated)")
    # another run's checkpoint as init_from: named, never swapped for an older one
    with pytest.raises(ConfigError, match=f"^init_from=.*: {shard}: truncated"):
        train_in_process(model, data, tmp_path / "next", f"init_from={run}")
    # resume=auto: a warning naming the file, then step 1's checkpoint, steps 2 and 3 trained
    proc = rl_process(rl_args(model, data, run, "steps=3"))
    assert f"WARNING: {shard}: truncated" in proc.stdout
    assert "resumed from" in proc.stdout and "step_00000001: step 1" in proc.stdout
    assert checkpoint_damage(shard.parent) == ""  # step 2 saved again, whole
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()] == [1, 2, 3]


def test_a_second_writer_is_stopped_and_a_killed_ones_lock_taken_over(tmp_path, capsys):
    """The one-writer lock every script's out_dir takes (here eval.py's, in results.open_samples):
    a second writer is refused naming the holder; a SIGKILLed holder's lock is taken over."""
    holder = subprocess.Popen(
        [PYTHON, "-c", ("import sys, time; from machinery.run_dir import take_lock; "
         "take_lock(sys.argv[1]); print('locked', flush=True); time.sleep(600)"), str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ConfigError, match=f"in use by pid {holder.pid} on "):
            open_samples(tmp_path, {"model": "m"}, 1, resume=True)
        assert not (tmp_path / "samples.jsonl").exists()
    finally:
        holder.kill()  # SIGKILL: its text stays in the lock
        holder.wait()
    capsys.readouterr()
    assert open_samples(tmp_path, {"model": "m"}, 1, resume=True) == {}
    assert f"taking over from pid {holder.pid}" in capsys.readouterr().out


def other_host(renewed, pid=4242):
    """A lock's text as a run on another node writes it (lease renewed at `renewed`)."""
    return json.dumps({"pid": pid, "host": "other-node", "since": "2026-12-06 23:00:00 UTC",
                       "renewed": renewed}) + "\n"


def test_a_lease_of_another_host_is_taken_over_once_expired_and_a_live_one_refused(
        tmp_path, capsys, monkeypatch):
    """Where flock is node-local (Lustre localflock, NFS local_lock=flock), the holder's lease in
    the lock's text says whether it still runs. Lease times of a second here, 5 minutes in a run."""
    for name, seconds in (("LEASE_S", 0.6), ("LEASE_POLL_S", 0.05), ("SETTLE_S", 0.05)):
        monkeypatch.setattr(lock, name, seconds)
    path = tmp_path / LOCK_NAME
    # expired long ago (a node lost an hour back): taken over at once, in one line naming it
    path.write_text(other_host(time.time() - 3600))
    take_lock(tmp_path)
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: taking over from pid 4242 on other-node")
    assert out.count("\n") == 1
    assert json.loads(path.read_text())["pid"] == os.getpid()
    release_lock(tmp_path)
    # renewed just now, then never again (the node was lost a moment ago): the start waits the
    # lease out, then takes over
    path.write_text(other_host(time.time()))
    started = time.monotonic()
    take_lock(tmp_path)
    assert 0.5 < time.monotonic() - started < 5
    assert "taking over from pid 4242 on other-node" in capsys.readouterr().out
    release_lock(tmp_path)
    # a live holder renews its lease while the start waits: refused, its text left as it was
    stop = threading.Event()

    def renew(fd):  # the other node's renewals (in place, as its holder writes them)
        while not stop.wait(0.05):
            lock._write_holder(fd, json.loads(other_host(time.time())))

    path.write_text(other_host(time.time()))
    fd = os.open(path, os.O_RDWR)
    renewer = threading.Thread(target=renew, args=(fd,))
    renewer.start()
    try:
        with pytest.raises(ConfigError, match="in use by pid 4242 on other-node .* renewed its "
                           "lease"):
            take_lock(tmp_path)
    finally:
        stop.set()
        renewer.join()
        os.close(fd)
    assert json.loads(path.read_text())["host"] == "other-node"


def test_a_holder_that_stops_making_progress_loses_its_lease_and_never_commits_after(
        tmp_path, monkeypatch):
    """A real holder on node-a saves step 1, then its main loop stops (no thread renews for it):
    node-b takes over once the lease (1 s here) expires, and the old holder, woken, neither logs
    nor commits step 2: it stops, naming the new holder."""
    holder = subprocess.Popen([PYTHON, WORKER, "hold", str(tmp_path)], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "saved 1\n"
        monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
        for name, seconds in (("LEASE_S", 1.0), ("LEASE_POLL_S", 0.05), ("SETTLE_S", 0.1)):
            monkeypatch.setattr(lock, name, seconds)
        started = time.monotonic()
        take_lock(tmp_path)  # the requeue on node-b
        assert time.monotonic() - started < 5
        holder.stdin.write("go\n")
        holder.stdin.flush()
        _, err = holder.communicate(timeout=120)
    finally:
        holder.kill()
        release_lock(tmp_path)
    assert holder.returncode == 1
    assert f"{tmp_path / LOCK_NAME}: taken over by pid {os.getpid()} on node-b" in err
    assert [row["step"] for row in read_records(tmp_path / "metrics.jsonl")] == [1]
    assert latest_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step_00000001"


def test_a_commit_cut_short_and_a_truncated_rank_state_fall_back_to_the_last_good_checkpoint(
        tmp_path, capsys):
    """Step 3 killed between COMPLETE and the rename (a .tmp holding COMPLETE), step 2 with rank
    1's trainer state cut short: resume=auto takes step 1, with one warning naming the file;
    resume= refuses the .tmp."""
    root = tmp_path / "checkpoints"
    run_at_once([[PYTHON, WORKER, "write", root, rank] for rank in (0, 1)], timeout=300)
    (root / "step_00000003").rename(root / "step_00000003.tmp")
    state = root / "step_00000002" / "trainer_state_rank1.pt"
    with open(state, "r+b") as f:
        f.truncate(state.stat().st_size // 2)
    capsys.readouterr()
    assert requested_checkpoint("auto", root) == root / "step_00000001"
    warnings = capsys.readouterr().out.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(f"WARNING: {state}: ")
    assert latest_checkpoint(root) == root / "step_00000002"  # committed names only
    with pytest.raises(ConfigError, match=f"^resume={root / 'step_00000003.tmp'}: "):
        requested_checkpoint(str(root / "step_00000003.tmp"), root)
