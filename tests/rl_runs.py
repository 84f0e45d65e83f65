"""What the end-to-end tests share: one launcher for scripts and torchrun (`run`, `run_at_once`),
a policy small enough to train in seconds that still calls the tool and answers, and rl.py's
command for it (conftest.py's sft_policy and saved_run fixtures build on these)."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import tiny

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]

# Four problems with small numbers: a 0.2M-parameter model memorises their transcripts in 120 SFT
# steps (~35 s of CPU) and then samples right and wrong answers at temperature 1, so RL groups have
# mixed rewards and really train.
MEMO_PROBLEMS = [{"id": f"memo-{i}", "problem": f"Compute {a} * {b} + {c}.",
                  "answer": str(a * b + c)}
                 for i, (a, b, c) in enumerate([(3, 4, 5), (6, 7, 8), (2, 9, 1), (5, 5, 5)])]


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (simulated nodes, bare ranks)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def finish(command, proc, timeout):
    """(CompletedProcess, whether it ran late): past `timeout` seconds its session is killed."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        late = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        late = True
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr), late


def run_at_once(commands, envs=None, timeout=600, check=True, cwd=REPO, during=None):
    """Start every command (an argv) at once, as one launcher per simulated node or rank; their
    CompletedProcess (text). `envs`: extra variables per command; `cwd`: one directory or one per
    command; `during(procs)` runs while they do (a fault to inject, a condition to wait on). Each
    runs in its own session: past `timeout` seconds it is killed with all it started and fails
    the test; with `check`, so does a non-zero exit (the tails of both streams shown)."""
    commands = [[str(part) for part in command] for command in commands]
    cwds = cwd if isinstance(cwd, list) else [cwd] * len(commands)
    procs = [subprocess.Popen(command, cwd=cwds[i], text=True, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                   **(envs[i] if envs else {})})
             for i, command in enumerate(commands)]

    # One reader thread per command: ranks that wait on each other must not block on a full pipe
    # while the test reads another's.
    with ThreadPoolExecutor(len(procs)) as readers:
        try:
            ends = readers.map(finish, commands, procs, [timeout] * len(procs))
            if during:
                during(procs)
            ends = list(ends)
        except BaseException:  # a failed `during`, a Ctrl-C: their sessions would outlive them
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            raise

    for result, late in ends:
        if late or (check and result.returncode != 0):
            why = f"ran past {timeout} s" if late else f"exit {result.returncode}"
            pytest.fail(f"{' '.join(result.args)}: {why}\n--- stdout\n{result.stdout[-3000:]}\n"
                        f"--- stderr\n{result.stderr[-5000:]}")
    return [result for result, _ in ends]


def run(command, env=None, timeout=600, check=True, cwd=REPO):
    """`run_at_once` for one command: its CompletedProcess."""
    return run_at_once([command], [env or {}], timeout, check, cwd)[0]


def train_sft_policy(work):
    """A small policy that calls the tool and answers, sometimes right: tiny.py's architecture at
    hidden 64 x 2 layers, after sft.py on transcripts of MEMO_PROBLEMS (run through the real
    executor)."""
    model = tiny.build_tiny_model(tiny.TinyConfig(out_dir=str(work / "model"), hidden_size=64,
                                                  intermediate_size=128, num_hidden_layers=2,
                                                  num_attention_heads=1, num_key_value_heads=1,
                                                  pretrain_steps=0))
    rows = tiny.make_sft_transcripts(MEMO_PROBLEMS * 40, error_fraction=0.0, seed=0)
    (work / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run([PYTHON, "sft.py", "configs/sft_tiny.yaml", f"model={model}", f"data={work / 'sft.jsonl'}",
         f"out_dir={work / 'run'}", "global_batch_size=8", "epochs=6", "lr=1e-2", "save_every=0",
         "train_threads=1"],
        timeout=900)
    return work / "run" / "final"


def rl_command(policy, data, out_dir):
    return [PYTHON, "rl.py", "configs/tiny.yaml", f"model={policy}", f"train_data={data}",
            "eval_data=", f"out_dir={out_dir}", "steps=2", "prompts_per_step=4", "save_every=1",
            "rollout.max_response_tokens=200", "train_threads=1"]
