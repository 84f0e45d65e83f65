"""machinery/threads.py: each CPU phase's torch threads when the config leaves them to the run,
the measurement of what is free, and the count kept in config.yaml. The suite's end-to-end runs pin
train_threads=1: they compare numbers bit for bit, and the rule's count follows the load."""
import json
import os

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

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
    ((0, True, 4, 1, None, None), (1, 1)),   # no CPU counters: the count that never waits
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
    with busy_machine(2 * cores):   # outside this process's tree, as a neighbour's work is
        idle_cores(0.2)  # the loops start
        assert idle_cores(0.2) < 0.5


def readings(idle_s, own_s, window_s=0.5, cores=2):
    """cpu_seconds' two readings around a window in which the cores idled idle_s seconds in all and
    this process's tree spent own_s."""
    return iter([(100.0, 1000.0, 10.0), (100.0 + idle_s, 1000.0 + cores * window_s, 10.0 + own_s)])


@pytest.mark.parametrize("idle_s, own_s, update", [
    (1.0, 0.0, 2),    # an idle machine
    (0.25, 0.75, 2),  # an idle machine while the run starts its workers: its own, so still free
    (0.0, 1.0, 2),    # ... and the start-up took both cores: the same decision
    (0.5, 0.0, 1),    # a neighbour kept one core busy
    (0.0, 0.0, 1),    # busy neighbours on both
])
def test_the_rule_reads_the_others_load_not_the_runs_own_start_up(monkeypatch, idle_s, own_s,
                                                                  update):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    monkeypatch.setattr(threads, "cpu_seconds", readings(idle_s, own_s).__next__)
    chosen = threads_for(0, True, 2, 1, idle_cores())
    assert chosen.update == update


def test_one_and_two_update_threads_give_the_same_gradients(tiny_model_dir):
    """The rule's decision moves the speed, not the numbers: the update on 1 and on 2 threads sums
    in the same order here (docs/benchmarks.md, "Threads", for what a larger model moves)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokens = torch.randint(0, model.config.vocab_size, (4, 48),
                           generator=torch.Generator().manual_seed(0))
    before, gradients = torch.get_num_threads(), []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            model.zero_grad()
            model(input_ids=tokens, labels=tokens).loss.backward()
            gradients.append([p.grad.clone() for p in model.parameters()])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*gradients))


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
    line = capsys.readouterr().out
    assert line.startswith("threads: update 2, decode 1") and "train_threads=2" in line
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
