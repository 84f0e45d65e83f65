"""Benchmarks, one per method file they measure, each run from the repo root as a module
(`python -m bench.executor`, `bench.reward`, `bench.rollout`, `bench.rl`, `bench.scale`;
docs/benchmarks.md lists their commands and figures). Each prints its ratios against
a baseline measured in the same run. The method files never import from here; tests may (the
scripted policy, the labeled answer sets, busy_processes).
"""
import contextlib
import os
import signal
import subprocess
import sys
import time


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


def count_engine_steps(engine):
    """Count vLLM's own steps (LLMEngine.step, which plain LLM.generate calls too) and the seconds
    inside them, on an Engine; `del engine.engine.step` undoes it (the wrapper holds a reference
    to vLLM's engine, which close() must free)."""
    engine.steps, engine.in_vllm_s, vllm_step = 0, 0.0, engine.engine.step

    def counted_step():
        engine.steps += 1
        started = time.perf_counter()
        try:
            return vllm_step()
        finally:
            engine.in_vllm_s += time.perf_counter() - started

    engine.engine.step = counted_step


def timed(engine, run):
    """{result: run()'s, seconds, CPU seconds of the process (every thread, OpenMP's spinning
    included) and of this thread (where the loop and the in-process engine run), engine steps and
    the seconds inside them, and vLLM's counters (Engine.counters)}. A busy machine stretches the
    seconds far more than the CPU seconds."""
    engine.steps, engine.in_vllm_s, before = 0, 0.0, engine.counters()
    started, cpu, thread_cpu = time.perf_counter(), time.process_time(), time.thread_time()
    result = run()
    measured = {"result": result, "seconds": time.perf_counter() - started,
                "cpu_s": time.process_time() - cpu, "thread_cpu_s": time.thread_time() - thread_cpu,
                "steps": engine.steps, "in_vllm_s": engine.in_vllm_s}
    return measured | {k: v - before[k] for k, v in engine.counters().items()}


def print_markdown(title, columns, rows):
    """A table for docs/benchmarks.md, under a line saying what ran and the load at the end."""
    print(f"\n{title}; load average {os.getloadavg()[0]:.1f} at the end")
    print("| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
