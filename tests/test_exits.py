"""machinery/exits.py: how every script ends (run_script, leave) and the commands it prints."""
import json
import re
import sys
import time

import pytest
from rl_runs import PYTHON, TORCHRUN, free_port, run, run_at_once

from machinery import exits


def launch_two_ranks(*modes, env=None):
    """tests/dist_exits.py as 2 bare ranks per mode, every pair at once: CompletedProcess by rank,
    pair after pair."""
    ranks = []
    for mode in modes:
        port = free_port()
        ranks += [(mode, {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                          "OMP_NUM_THREADS": "1", **(env or {})}) for rank in (0, 1)]
    return run_at_once([[PYTHON, "tests/dist_exits.py", mode] for mode, _ in ranks],
                       [rank_env for _, rank_env in ranks], timeout=120, check=False)


@pytest.mark.slow
def test_two_ranks_end_cleanly_and_a_refusal_is_printed_once():
    """Without leave(), 3 of 27 launches aborted at exit (-6, "terminate called without an active
    exception"), with it 0 of 23: five catch a regression about half the time (docs/design.md)."""
    *finished, refused0, refused1 = launch_two_ranks(*["finish"] * 5, "refuse")
    for i, end in enumerate(finished):
        assert (end.returncode, end.stdout, end.stderr) == (0, f"rank {i % 2}: done\n", ""), end
    assert (refused0.returncode, refused1.returncode) == (1, 1)
    assert refused0.stdout == refused1.stdout == refused1.stderr == ""
    assert refused0.stderr == "dist_exits.py: out_dir=/x: refused on every rank\n"


@pytest.mark.slow
def test_a_rank_that_raises_ends_every_rank_in_seconds_though_an_exit_handler_hangs():
    """Rank 1 raises while rank 0 waits for it in an all-reduce, and on both an exit handler never
    returns (as vLLM's finalizer can on NCCL): leave() bounds it, so both ranks end."""
    started = time.time()
    lost, raised = launch_two_ranks(
        "raise", env={"RSTAR2_FAULTS": "0:1:1:update:raise", "RSTAR2_LEAVE_TIMEOUT_S": "2"})
    seconds = time.time() - started
    assert (lost.returncode, raised.returncode) == (1, 1) and seconds < 40, (seconds, lost, raised)
    # the raising rank: its traceback (a bug is shown), then the bound
    assert "RuntimeError: RSTAR2_FAULTS: rank 1, step 1, update" in raised.stderr
    assert raised.stderr.endswith("were still running after 2 s: left without them\n")
    # the rank that lost it: one line naming its rank, step and phase and what comes next
    line, bound = lost.stderr.splitlines()
    assert re.match(r"dist_exits\.py: rank 0 lost another rank in step 1 \(update\) \(gloo: "
                    r"Connection (closed|reset) by peer .*no restart left", line)
    assert bound.startswith("rank 0: the exit handlers") and lost.stdout == ""


def test_leave_bounds_the_exit_handlers_even_when_one_holds_the_interpreter():
    """A hang in Python: leave()'s timer, the exit code; in C holding the GIL: faulthandler, 1."""
    script = """if True:
        import atexit, ctypes, sys, time
        from machinery import exits
        exits.LEAVE_TIMEOUT_S = 1
        atexit.register(lambda: eval(sys.argv[1]))
        exits.leave(3)
    """
    started = time.time()
    in_python, in_c = run_at_once([[PYTHON, "-c", script, hang] for hang in (
        "time.sleep(3600)", "ctypes.PyDLL(None).sleep(3600)")], timeout=60, check=False)
    assert in_python.returncode == 3 and "still running after 1 s" in in_python.stderr
    assert in_c.returncode == 1 and "Timeout (0:00:02)!" in in_c.stderr, in_c.stderr
    assert time.time() - started < 30


def test_the_fault_injection_strikes_only_its_attempt_rank_step_and_point():
    script = "from machinery import exits; exits.reached('train', 2); " \
             "exits.reached('rollout', 3); print('not killed')"
    cases = (("0:1:3:rollout:kill", "1", "0"), ("0:1:3:rollout:kill", "0", "0"),
             ("0:1:3:rollout:kill", "1", "1"), ("0:1:2:rollout:kill", "1", "0"))
    ends = run_at_once([[PYTHON, "-c", script]] * 4, [
        {"RSTAR2_FAULTS": faults, "RANK": rank, "TORCHELASTIC_RESTART_COUNT": attempt}
        for faults, rank, attempt in cases], timeout=60, check=False)
    assert [(end.returncode, end.stdout) for end in ends] == [(-9, "")] + [(0, "not killed\n")] * 3


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
        "torchrun restarts the job (2 of --max-restarts=3 left)")
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
    proc = run([PYTHON, "-c", script], timeout=60, check=False)
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


def steps_job(out, restarts, *args):
    """dist_exits.py's steps on 2 ranks under one agent, into `out`."""
    out.mkdir(exist_ok=True)
    return TORCHRUN + ["--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}",
                       "tests/dist_exits.py", "steps", out, *args]


def steps_logged(out):
    return (out / "steps.txt").read_text().split() if (out / "steps.txt").exists() else []


@pytest.mark.slow
def test_a_stopped_rank_is_found_by_the_heartbeat_and_a_repeated_crash_is_named_then_skipped(
        tmp_path):
    """Two jobs at once. Rank 1 SIGSTOPped in step 3 (a hung kernel): rank 0 exits after the 6 s
    heartbeat, torchrun restarts, every step once. Prompt 21 crashes rank 1 in step 2 every time:
    the third start refuses in one line; the skip_prompts it names lets the run through."""
    stopped, crashed = run_at_once(
        [steps_job(tmp_path / "stop", 1), steps_job(tmp_path / "crash", 2)],
        [{"OMP_NUM_THREADS": "1", "RSTAR2_FAULTS": "0:1:3:rollout:stop"},
         {"OMP_NUM_THREADS": "1", "CRASHING_PROMPT": "21"}], timeout=900, check=False)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 0 and steps_logged(tmp_path / "stop") == list("12345"), output
    assert re.search(r"rank 0 in step 3 \(rollout\): no rank made progress for 6 s "
                     r"\(heartbeat_min\), rank 1 stopped first", output)
    output = crashed.stdout + crashed.stderr
    assert crashed.returncode != 0 and steps_logged(tmp_path / "crash") == ["1"], output
    assert output.count("RuntimeError: prompt 21 crashed the verifier") == 2, output
    assert output.count("step 2 failed in its rollout on the last 2 attempts") == 1, output
    assert "skip_prompts=20,21" in output
    run(steps_job(tmp_path / "crash", 0, "skip_prompts=20,21"),
        {"OMP_NUM_THREADS": "1", "CRASHING_PROMPT": "21"}, timeout=900)
    assert steps_logged(tmp_path / "crash") == list("12345")


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
    assert "step 2 failed in its reward" in refusal and refusal.endswith("skip_prompts=20,21")
    assert exits.crash_loop(tmp_path, [20, 21, 7]) is None


def test_a_main_thread_stuck_in_c_with_the_gil_released_is_found_within_the_heartbeat():
    script = ("import time, torch.distributed as dist; from machinery import exits; "
              "exits.watch_progress(dist.TCPStore('127.0.0.1', 0, 1, True), 0, 1, 3, 'x.py'); "
              "time.sleep(60)")  # sleep: a C call that releases the GIL
    started = time.time()
    proc = run([PYTHON, "-c", script], timeout=120, check=False)
    assert proc.returncode == 1 and "rank 0 stopped first" in proc.stderr, proc.stderr
    assert time.time() - started < 50
