"""Shared fixtures: the tiny model (a real Hugging Face model directory, built once per session in
about 5 s), the SFT policy and a saved 2-step RL run."""
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import rl_runs  # noqa: E402  (after the path above)
import tiny  # noqa: E402
from bench import busy_processes  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-model")
    return tiny.build_tiny_model(tiny.TinyConfig(out_dir=str(out), pretrain_steps=0))


@pytest.fixture(scope="session")
def sft_policy(tmp_path_factory):
    """rl_runs.train_sft_policy's policy, trained once for every end-to-end RL test."""
    return rl_runs.train_sft_policy(tmp_path_factory.mktemp("sft"))


@pytest.fixture(scope="session")
def saved_run(sft_policy, tmp_path_factory):
    """A real 2-step run saving rollouts and a checkpoint each step, on MEMO_PROBLEMS three times
    under other ids; args: its config file and overrides (a replay's), started: its time.time()."""
    out = tmp_path_factory.mktemp("saved")
    data = out / "train.jsonl"
    data.write_text("".join(json.dumps({**p, "id": f"{p['id']}-{k}"}) + "\n"
                            for k in range(3) for p in rl_runs.MEMO_PROBLEMS))
    command = rl_runs.rl_command(sft_policy, data, out / "run") + ["save_rollouts_every=1"]
    started = time.time()
    rl_runs.run(command, timeout=900)
    return SimpleNamespace(dir=out / "run", args=command[2:], started=started)


@pytest.fixture
def busy_machine():
    """bench.busy_processes: `with busy_machine(8): ...` grades or runs code on a busy node."""
    return busy_processes
