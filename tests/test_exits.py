"""machinery/exits.py: how every script ends (run_script, leave) and the commands it prints."""
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from machinery import exits

REPO = Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_ranks(mode, extra_env=None):
    """tests/dist_exits.py as 2 ranks, their (returncode, stdout, stderr) by rank."""
    port, procs = free_port(), []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               **(extra_env or {})}
        procs.append(subprocess.Popen([sys.executable, "tests/dist_exits.py", mode], cwd=REPO,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = [p.communicate(timeout=120) for p in procs]
    return [(p.returncode, *output) for p, output in zip(procs, outputs)]


@pytest.mark.slow
def test_two_ranks_end_cleanly_and_a_refusal_is_printed_once():
    """Without leave(), 3 of 27 launches aborted at exit (-6, "terminate called without an active
    exception"), with it 0 of 23: five catch a regression about half the time (docs/design.md)."""
    for _ in range(5):
        ends = launch_two_ranks("finish")
        for rank, (code, out, err) in enumerate(ends):
            assert (code, out, err) == (0, f"rank {rank}: done\n", ""), ends
    (code0, out0, err0), (code1, out1, err1) = launch_two_ranks("refuse")
    assert (code0, code1) == (1, 1) and out0 == out1 == ""
    assert err0 == "dist_exits.py: out_dir=/x: refused on every rank\n" and err1 == ""


@pytest.mark.slow
def test_a_rank_that_raises_ends_every_rank_in_seconds_though_an_exit_handler_hangs():
    """Rank 1 raises while rank 0 waits for it in an all-reduce, and on both an exit handler never
    returns (as vLLM's finalizer can on NCCL): leave() bounds it, so both ranks end."""
    started = time.time()
    (code0, out0, err0), (code1, out1, err1) = launch_two_ranks(
        "raise", {"RSTAR2_FAULTS": "0:1:1:update:raise", "RSTAR2_LEAVE_TIMEOUT_S": "2"})
    seconds = time.time() - started
    assert (code0, code1) == (1, 1) and seconds < 40, (seconds, err0, err1)
    # the raising rank: its traceback (a bug is shown), then the bound
    assert "RuntimeError: RSTAR2_FAULTS: a fault injected at rank 1, step 1, update" in err1
    assert err1.endswith("rank 1: the exit handlers (vLLM's engine shutdown, the workers') were "
                         "still running after 2 s: left without them\n"), err1
    # the rank that lost it: one line naming its rank, step and phase and what comes next
    line, bound = err0.splitlines()
    assert re.fullmatch(r"dist_exits\.py: rank 0 lost another rank in step 1 \(update\) \(gloo: "
                        r"Connection (closed|reset) by peer \[127\.0\.0\.1\]:\d+\): no restart "
                        r"left \(--max-restarts=0\); to resume: \S+python dist_exits\.py raise",
                        line)
    assert bound.startswith("rank 0: the exit handlers") and out0 == ""
    print(f"both ranks ended {seconds:.1f} s after the launch")


def test_leave_bounds_the_exit_handlers_even_when_one_holds_the_interpreter():
    """A hang in Python: leave()'s timer, the exit code; in C holding the GIL: faulthandler, 1."""
    for hang, code, says in (("time.sleep(3600)", 3, "were still running after 1 s"),
                             ("ctypes.PyDLL(None).sleep(3600)", 1, "Timeout (0:00:02)!")):
        script = f"""if True:
            import atexit, ctypes, time
            from machinery import exits
            exits.LEAVE_TIMEOUT_S = 1
            atexit.register(lambda: {hang})
            exits.leave(3)
        """
        started = time.time()
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == code and says in proc.stderr, proc.stderr
        assert time.time() - started < 30


def test_the_fault_injection_strikes_only_its_attempt_rank_step_and_point():
    script = "from machinery import exits; exits.reached('train', 2); " \
             "exits.reached('rollout', 3); print('not killed')"
    for faults, rank, attempt, killed in (("0:1:3:rollout:kill", "1", "0", True),
                                          ("0:1:3:rollout:kill", "0", "0", False),
                                          ("0:1:3:rollout:kill", "1", "1", False),
                                          ("0:1:2:rollout:kill", "1", "0", False)):
        env = {**os.environ, "RSTAR2_FAULTS": faults, "RANK": rank, "TORCHELASTIC_RESTART_COUNT":
               attempt}
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                              text=True, env=env, timeout=60)
        assert (proc.returncode, proc.stdout) == ((-9, "") if killed else (0, "not killed\n"))


def test_a_lost_peer_is_named_from_gloo_s_error_and_the_restart_counted(monkeypatch):
    error = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                         "Connection closed by peer [10.0.0.7]:41234. This is typically caused by "
                         "a remote worker crashing.")
    assert exits.peer_lost(error) == "gloo: Connection closed by peer [10.0.0.7]:41234"
    assert exits.peer_lost(RuntimeError("CUDA out of memory")) == ""
    assert exits.peer_lost(ValueError("Connection reset by peer")) == ""  # not a collective's
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert exits.restart_or_resume("rl.py", []) == (
        "torchrun restarts the job from the newest checkpoint (2 of --max-restarts=3 restarts "
        "left)")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a")
    assert exits.restart_or_resume("rl.py", ["configs/stage1.yaml"]) == (
        "no restart left (--max-restarts=3); to resume: torchrun [the same flags] rl.py "
        "configs/stage1.yaml")


def test_a_signal_that_comes_while_leave_runs_the_exit_handlers_cuts_none_short():
    """torchrun's SIGTERM while a rank leaves: raised in an atexit handler, it skipped the rest."""
    script = """if True:
        import atexit, os, signal, time
        from machinery import exits
        exits.stop_on_signals()
        atexit.register(print, "the handler registered first ran too")
        def signalled():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the signal is delivered now, inside this handler
            print("the handler that got the signal finished")
        atexit.register(signalled)
        exits.leave(3)
    """
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (3, ""), proc.stderr
    assert proc.stdout == ("the handler that got the signal finished\n"
                           "the handler registered first ran too\n")


def test_a_printed_command_names_the_interpreter_as_it_was_run(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    assert (exits.rerun_command("rl.py", ["configs/tiny.yaml", "resume=never", "steps=3"],
                                {"resume": "auto"})
            == ".venv/bin/python rl.py configs/tiny.yaml steps=3 resume=auto")
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")  # outside the working directory
    assert exits.rerun_command("eval.py", ["model=a b"]) == "/usr/bin/python3 eval.py 'model=a b'"


def torchrun_steps(out, restarts, env=None, *args):
    """dist_exits.py's steps on 2 ranks, one agent: (status, output, steps logged, seconds)."""
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", f"--max-restarts={restarts}",
                           "tests/dist_exits.py", "steps", str(out), *args], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=900)
    logged = (out / "steps.txt").read_text().split() if (out / "steps.txt").exists() else []
    return proc.returncode, proc.stdout + proc.stderr, logged, time.time() - started


@pytest.mark.slow
def test_a_stopped_rank_is_found_within_the_heartbeat_and_the_job_restarts_and_finishes(tmp_path):
    """Rank 1 SIGSTOPped in step 3 (a hung kernel runs no Python): rank 0, waiting in its
    all-reduce, exits after the 6 s heartbeat; torchrun restarts the job: every step once."""
    code, output, logged, seconds = torchrun_steps(tmp_path, 1,
                                                   {"RSTAR2_FAULTS": "0:1:3:rollout:stop"})
    assert code == 0 and logged == ["1", "2", "3", "4", "5"], output[-3000:]
    assert re.search(r"dist_exits\.py: rank 0 in step 3 \(rollout\): no rank made progress for "
                     r"6 s \(heartbeat_min\), rank 1 stopped first: torchrun restarts", output)
    print(f"stopped, found, restarted and finished in {seconds:.0f} s")


@pytest.mark.slow
def test_a_crash_that_repeats_at_the_same_step_is_named_once_and_its_prompts_skip(tmp_path):
    """Prompt 21 crashes rank 1 in step 2 on every attempt: the third refuses at its start in one
    line naming step, phase and prompts; the key it names lets the run through."""
    code, output, logged, _ = torchrun_steps(tmp_path, 2, {"CRASHING_PROMPT": "21"})
    assert code != 0 and logged == ["1"], output[-3000:]
    assert output.count("RuntimeError: prompt 21 crashed the verifier") == 2, output[-3000:]
    line = ("dist_exits.py: step 2 failed in its rollout on the last 2 attempts, prompts 20,21 in "
            "flight: skip them with skip_prompts=20,21 (or delete")
    assert output.count(line) == 1, output[-3000:]
    code, output, logged, _ = torchrun_steps(tmp_path, 0, {"CRASHING_PROMPT": "21"},
                                             "skip_prompts=20,21")
    assert code == 0 and logged == ["1", "2", "3", "4", "5"], output[-3000:]


def test_a_failed_attempt_s_records_become_a_failure_and_two_alike_a_refusal(tmp_path):
    def fail(step, phase, prompts):  # what an attempt's ranks leave when one crashes
        for rank in (0, 1):
            (tmp_path / f"rank{rank}.json").write_text(json.dumps(
                {"step": step, "phase": phase, "prompts": prompts[rank::2]}))
    assert exits.crash_loop(tmp_path, []) is None  # a first start
    fail(2, "rollout", [21, 20])
    assert exits.crash_loop(tmp_path, []) is None and not list(tmp_path.glob("rank*"))
    fail(2, "reward", [21, 20])  # the same step, another phase: no loop
    assert exits.crash_loop(tmp_path, []) is None
    fail(2, "reward", [21, 20])
    refusal = exits.crash_loop(tmp_path, [])
    assert "step 2 failed in its reward" in refusal and "skip_prompts=20,21 " in refusal
    assert exits.crash_loop(tmp_path, [20, 21, 7]) is None


def test_a_main_thread_stuck_in_c_with_the_gil_released_is_found_within_the_heartbeat():
    script = ("import time, torch.distributed as dist; from machinery import exits; "
              "exits.watch_progress(dist.TCPStore('127.0.0.1', 0, 1, True), 0, 1, 3, 'x.py'); "
              "time.sleep(60)")  # sleep: a C call that releases the GIL
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "rank 0 stopped first" in proc.stderr, proc.stderr
    assert time.time() - started < 50
