"""machinery/threads.py: each CPU phase's torch threads when the config leaves them to the run (the
cores this rank may use, those of them free at the start, one left to the tool beside the decode),
train_threads and OMP_NUM_THREADS above the rule, the measurement of what is free, and the count a
run chose kept in its config.yaml (which a replay reads).

The suite's end-to-end runs (tests/rl_runs.py, test_run_dir's rl.py runs, test_sft's run_sft and
refusals) pin train_threads=1: they compare numbers bit for bit, and the rule's count would follow
the load of the moment. python -m bench.threads measures the rule's speed.

Run: .venv/bin/python -m pytest tests/test_threads.py -q
"""
import json
import os

import pytest
import torch
import yaml

import rl
import test_sft
from machinery import threads
from machinery.threads import (choose_threads, decode_threads, idle_cores, recorded_train_threads,
                               threads_for)

CPU = torch.device("cpu")


@pytest.mark.parametrize("case, expected", [
    # (train_threads, use_tool, cores, ranks on the node, idle cores, OMP_NUM_THREADS)
    ((0, True, 2, 1, 2.0, None), (2, 1)),    # a free 2-core machine: the tool keeps a core
    ((0, False, 2, 1, 2.0, None), (2, 2)),   # no tool: the decode takes both
    ((0, True, 2, 1, 1.75, None), (2, 1)),   # a light neighbour: still free
    ((0, True, 2, 1, 1.6, None), (1, 1)),    # one core 60% idle is not free
    ((0, True, 2, 1, 0.0, None), (1, 1)),    # busy: one thread waits on no one
    ((0, True, 8, 2, 16.0, None), (8, 7)),   # 2 ranks on 16 free cores: 8 each
    ((0, True, 8, 2, 6.0, None), (3, 2)),    # ... on 6 free: 3 each
    ((0, True, 4, 1, None, None), (1, 1)),   # no /proc/stat: the count that never waits
    ((0, False, 1, 2, None, None), (1, 1)),  # a share of 1 core: nothing to measure
    ((3, True, 2, 1, 0.0, None), (3, 1)),    # train_threads: the update's; the decode fits cores
    ((3, False, 2, 1, 0.0, None), (3, 2)),
    ((0, True, 2, 1, 2.0, 1), (1, 1)),       # OMP_NUM_THREADS (torchrun's 1): both counts
    ((2, True, 8, 1, 8.0, 4), (2, 4)),       # ... and train_threads still the update's
])
def test_the_update_takes_the_free_cores_of_the_ranks_share_and_the_decode_leaves_the_tool_one(
        case, expected):
    chosen = threads_for(*case)
    assert (chosen.update, chosen.decode) == expected
    assert chosen.why


def test_busy_processes_on_every_core_leave_no_core_idle(busy_machine):
    cores = len(os.sched_getaffinity(0))
    assert 0.0 <= idle_cores(0.1) <= cores + 0.01
    with busy_machine(2 * cores):
        idle_cores(0.2)  # the loops start
        assert idle_cores(0.2) < 0.5


@pytest.fixture
def two_free_cores(monkeypatch):
    """A rank with 2 cores of its own, both free; torch's count put back afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores_per_rank", lambda: 2)
    monkeypatch.setattr(threads, "RANKS_ON_NODE", 1)
    monkeypatch.setattr(threads, "idle_cores", lambda: 2.0)
    before = torch.get_num_threads()
    yield
    torch._C.set_num_threads(before)


def not_measured():
    raise AssertionError("measured although the count did not depend on it")


def test_a_start_resolves_train_threads_0_prints_one_line_and_measures_only_when_needed(
        two_free_cores, monkeypatch, capsys):
    cfg = choose_threads(rl.RLConfig(model="x"), CPU, rank=0)
    assert cfg.train_threads == 2 and torch.get_num_threads() == 2
    assert decode_threads(cfg.rollout, cfg.train_threads) == 1
    assert capsys.readouterr().out == (
        "threads: update 2, decode 1 (the rule: 2.0 of 2 cores idle over 0.5 s; the tool workers "
        "keep a core beside the decode); config.yaml: train_threads=2\n")
    monkeypatch.setattr(threads, "idle_cores", not_measured)
    assert choose_threads(rl.RLConfig(model="x", train_threads=1), CPU, rank=1).train_threads == 1
    assert capsys.readouterr().out == ""  # rank 0 prints it
    assert decode_threads(rl.RLConfig().rollout) == 1  # the tool on 2 cores: 1 whatever is free
    gpu = rl.RLConfig(model="x")
    assert choose_threads(gpu, torch.device("cuda", 0), rank=0) is gpu
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert decode_threads(rl.RLConfig().rollout) == 2


def test_the_count_a_run_chose_is_in_its_config_yaml(two_free_cores, monkeypatch, tmp_path,
                                                    tiny_model_dir):
    """What a resume or rerun passes as train_threads to sum in the same order (one of the two
    cores free: 1 thread, which a loaded machine also runs fast)."""
    monkeypatch.setattr(threads, "idle_cores", lambda: 1.0)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in test_sft.chat_rows(8)))
    test_sft.run_sft(tiny_model_dir, data, tmp_path / "run", max_steps=1, train_threads=0)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train_threads"] == 1
    assert recorded_train_threads(tmp_path / "run") == 1  # what tools/replay.py trains on
    assert recorded_train_threads(tmp_path) == 0  # no run there
