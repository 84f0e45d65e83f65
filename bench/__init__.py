"""Benchmarks, one per method file they measure; run each from the repo root as a module:

    python -m bench.executor                 # the tool: calls/s and CPU per call vs `python -c`
                                             # and the fork floor
    python -m bench.executor mode=soak       # the tool under a hostile mix: zombies, strays, fds,
                                             # memory
    python -m bench.reward                   # grade_batch vs plain math-verify
                                             # (audit_all_pairs=true: the fast path)
    python -m bench.rollout model=PATH       # the rollout loop vs plain LLM.generate, barrier vs
                                             # none
    python -m bench.rl configs/tiny.yaml     # rl.py's rollout phase inside real RL steps vs
                                             # plain LLM.generate of the same requests
    python -m bench.scale                    # chunked log-prob peak; the balance's bytes per rank
                                             # as ranks grow

Each prints its ratios against a baseline measured in the same run. The figures are in
docs/benchmarks.md. The method files never import from here; tests may (the scripted policy, the
labeled answer sets, busy_processes).
"""
import contextlib
import os
import signal
import subprocess
import sys


@contextlib.contextmanager
def busy_processes(count):
    """`count` busy-looping processes for the block's duration, as other users' work is: outside
    the caller's process tree (started through a shell that exits at once; machinery/threads.py
    counts its own tree as free), each in a session of its own (the kernel's autogroups share the
    CPU between sessions first, so loops in the caller's session would only compete with it)."""
    loop = f"{sys.executable} -c 'while True: pass' </dev/null >/dev/null 2>&1"
    shell = subprocess.run(["sh", "-c", f"for i in $(seq {count}); do setsid {loop} & "
                            "echo $!; done"], capture_output=True, text=True, check=True)
    pids = [int(pid) for pid in shell.stdout.split()]
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
