"""Chaos run of rl.py under `torchrun --max-restarts`: a random rank SIGKILLed at a random moment,
several times during one run, the run repeated; against one uninterrupted run of the same config:

    python -m bench.chaos configs/tiny.yaml model=PATH train_data=PATH eval_data= steps=6 \
        prompts_per_step=4 save_every=2 rollout.max_response_tokens=200 \
        [chaos_runs=3] [chaos_kills=3] [chaos_ranks=2] [chaos_seed=0] [any rl.py key=value]

A kill is SIGKILL (no handler, no atexit: as a GPU falling off the bus or a lost node would end the
rank), sent from outside to one of torchrun's workers chosen at random, at a moment drawn uniformly
between 0 and chaos_window_s seconds after that attempt's workers started (engine start, rollouts,
updates and saves alike; by default 80% of the uninterrupted run's time). torchrun must restart the
job each time (--max-restarts=chaos_kills) and the run must end by itself. Per run: the launcher's
exit code, the kills (a kill drawn after the run ended is none), the steps each kill made the run
redo (the steps logged past the newest checkpoint when it struck: at most save_every), the
attempts, whether metrics.jsonl holds every step exactly once, whether every row equals the
uninterrupted run's in every key but the times, rates and bytes/balance_* (which rank claims which
prompt is a race by design, paper §3.2), and whether a .tmp checkpoint was left. Needs an SFT'd
policy (model=): the untrained tiny model trains on nothing.
"""
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from machinery.checkpoint import checkpoint_step, latest_checkpoint
from machinery.config import load_config

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class ChaosConfig:
    chaos_runs: int = 3           # runs, each killed chaos_kills times
    chaos_kills: int = 3          # kills per run (and torchrun's --max-restarts)
    chaos_ranks: int = 2          # torchrun --nproc_per_node
    # a kill comes this many seconds at most after its attempt's ranks start; 0: 80% of the
    # uninterrupted run's seconds (start-up, steps and saves alike)
    chaos_window_s: float = 0.0
    chaos_seed: int = 0


def launch(ranks, rl_argv, out_dir, max_restarts):
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={ranks}", f"--max-restarts={max_restarts}", "rl.py", *rl_argv,
         f"out_dir={out_dir}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


def workers(launcher):
    """torchrun's rank processes: its children that run rl.py."""
    found = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                           text=True).stdout.split()
    out = []
    for pid in map(int, found):
        try:
            if b"rl.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
        except OSError:
            pass
    return sorted(out)


def rank_of(pid):
    """A worker's RANK, from the environment torchrun started it with."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)


def logged_steps(out_dir):
    path = out_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            pass  # a line being written
    return steps


def kill_randomly(launcher, out_dir, chaos, rng, kills):
    """chaos.chaos_kills times: wait for an attempt's workers, then SIGKILL one of them at a random
    moment; append (rank's pid, seconds into the attempt, steps redone) to `kills`."""
    seen = set()
    for _ in range(chaos.chaos_kills):
        while launcher.poll() is None:  # the next attempt's workers
            pids = workers(launcher)
            if len(pids) == chaos.chaos_ranks and not seen & set(pids):
                break
            time.sleep(0.2)
        else:
            return
        seen |= set(pids)
        delay = rng.uniform(0, chaos.chaos_window_s)
        time.sleep(delay)
        if launcher.poll() is not None:
            return
        victim = rng.choice(pids)
        rank = rank_of(victim)
        saved = latest_checkpoint(out_dir / "checkpoints")
        saved = checkpoint_step(saved) if saved else 0
        done = max(logged_steps(out_dir), default=0)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:  # it ended by itself (a step's end, the run's end)
            continue
        kills.append({"rank": rank, "after_s": round(delay, 1),
                      "redone": max(0, done - saved)})


def compared(reference, rows):
    """The keys where rows differ from the reference run's (time/, rates, timestamps and the
    balance's bytes aside), or [] if none."""
    def same(row):
        return {k: v for k, v in row.items()
                if not k.startswith(("time/", "bytes/balance_")) and not k.endswith("_per_s")
                and k != "timestamp"}
    differ = []
    for a, b in zip(reference, rows):
        a, b = same(a), same(b)
        for key in sorted(set(a) | set(b)):
            x, y = a.get(key), b.get(key)
            close = (isinstance(x, float) and isinstance(y, float)
                     and abs(x - y) <= 1e-6 + 1e-5 * abs(x))
            if x != y and not close:
                differ.append(f"step {a.get('step')} {key}")
    return differ


def read_rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def main(argv):
    ours = [a for a in argv if a.startswith("chaos_")]
    chaos = load_config(ChaosConfig, ours)
    rl_argv = [a for a in argv if not a.startswith("chaos_")]
    if not any(a.startswith("train_threads=") for a in rl_argv):
        # the machine's choice (train_threads=0) may differ between the runs compared, and the
        # update's sums with it in the 7th digit
        rl_argv.append("train_threads=1")
    rng = random.Random(chaos.chaos_seed)
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    started = time.time()
    reference = launch(chaos.chaos_ranks, rl_argv, work / "reference", 0)
    output = reference.communicate()[0]
    if reference.returncode != 0:
        sys.exit(f"bench.chaos: the uninterrupted run failed:\n{output[-3000:]}")
    print(f"uninterrupted run: {time.time() - started:.0f} s", flush=True)
    if not chaos.chaos_window_s:
        chaos.chaos_window_s = 0.8 * (time.time() - started)
    reference_rows = read_rows(work / "reference")
    summary = []
    for run in range(chaos.chaos_runs):
        out_dir, kills = work / f"run-{run}", []
        started = time.time()
        launcher = launch(chaos.chaos_ranks, rl_argv, out_dir, chaos.chaos_kills)
        killer = threading.Thread(target=kill_randomly,
                                  args=(launcher, out_dir, chaos, rng, kills))
        killer.start()
        output = launcher.communicate()[0]
        killer.join()
        (work / f"run-{run}.log").write_text(output)  # the ranks' last lines, torchrun's report
        steps = logged_steps(out_dir)
        rows = read_rows(out_dir) if (out_dir / "metrics.jsonl").is_file() else []
        result = {"run": run, "exit": launcher.returncode, "seconds": round(time.time() - started),
                  "kills": kills, "attempts": 1 + output.count("failed (exitcode"),
                  "steps_once": steps == list(range(1, len(reference_rows) + 1)),
                  "differ": compared(reference_rows, rows),
                  "tmp_left": [p.name for p in (out_dir / "checkpoints").glob("*.tmp")]}
        summary.append(result)
        print(json.dumps(result), flush=True)
        if launcher.returncode != 0:
            print(output[-3000:], flush=True)
    kills = [k for r in summary for k in r["kills"]]
    finished = sum(r["exit"] == 0 and r["steps_once"] and not r["differ"] and not r["tmp_left"]
                   for r in summary)
    print(f"{len(summary)} runs, {len(kills)} kills, {finished} finished with every step once, "
          f"the uninterrupted run's numbers and no .tmp left; steps redone per kill: "
          f"{[k['redone'] for k in kills]} (max {max((k['redone'] for k in kills), default=0)})",
          flush=True)
    print(f"(run directories in {work})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
