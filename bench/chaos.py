"""Chaos run of rl.py on simulated nodes (one torchrun agent each on 127.0.0.1, 1 rank, c10d,
elastic --nnodes=N-1:N, docs/gpu.md's launch lines): faults drawn at random moments, several per
run, the run repeated; against one uninterrupted run of the same config:

    python -m bench.chaos configs/tiny.yaml model=PATH train_data=PATH eval_data= steps=6 \
        prompts_per_step=4 save_every=2 rollout.max_response_tokens=200 \
        [chaos_runs=2] [chaos_faults=3] [chaos_nodes=3] [chaos_kinds=worker,node,hang] \
        [chaos_seed=0] [any rl.py key=value]

A fault strikes a random node within chaos_window_s of an attempt's start: "worker", its rank
SIGKILLed (a GPU off the bus); "node", its agent and rank SIGKILLed (a lost node: the job goes on
with N-1 nodes, and a fresh agent rejoins chaos_rejoin_s later); "hang", its rank SIGSTOPped (found
at the collective timeout, short here, or by rl.py's heartbeat where it has one). Reported per
run: exits, faults, steps each made the run redo, attempts, minutes lost per fault, every step
logged once, the numbers against the uninterrupted run's, any .tmp left (docs/benchmarks.md).
Needs an SFT'd policy (model=): the untrained tiny model trains on nothing.
"""
import dataclasses
import json
import os
import random
import signal
import socket
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
    chaos_runs: int = 2           # runs, each struck chaos_faults times
    chaos_faults: int = 3         # faults per run (and each agent's --max-restarts)
    chaos_nodes: int = 3          # simulated nodes; the job goes on with one fewer
    chaos_kinds: str = "worker,node,hang"  # the faults drawn from, uniformly
    # a fault comes this many seconds at most after its attempt's ranks start; 0: half the
    # uninterrupted run's (a draw past the run's end strikes nothing)
    chaos_window_s: float = 0.0
    chaos_rejoin_s: float = 60.0  # a lost node's agent comes back this long after
    chaos_seed: int = 0


class Job:
    """One run: a rendezvous store of its own and one torchrun agent per simulated node."""

    def __init__(self, nodes, rl_argv, out_dir, max_restarts):
        self.out_dir, self.logs = out_dir, []
        port = free_port()
        self.store = subprocess.Popen([sys.executable, "-m", "machinery.distributed", str(port)],
                                      cwd=REPO, stdout=subprocess.PIPE, text=True)
        self.store.stdout.readline()  # "listens on": the agents can come
        self.command = [sys.executable, "-m", "torch.distributed.run",
                        f"--nnodes={max(1, nodes - 1)}:{nodes}", "--nproc_per_node=1",
                        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                        "--rdzv-conf=is_host=false", "--rdzv-id=chaos",
                        f"--max-restarts={max_restarts}", "rl.py", *rl_argv, f"out_dir={out_dir}"]
        self.agents = [self.start_agent() for _ in range(nodes)]

    def start_agent(self):
        log = self.out_dir.parent / f"{self.out_dir.name}-agent-{len(self.logs)}.log"
        self.logs.append(log)
        return subprocess.Popen(self.command, cwd=REPO, stdout=log.open("w"),
                                stderr=subprocess.STDOUT,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false",
                                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})

    def live(self):
        return [a for a in self.agents if a.poll() is None]

    def running(self):  # while an agent that was not killed runs
        return any(a.poll() is None for a in self.agents if not getattr(a, "lost", False))

    def wait(self):
        while self.running():
            time.sleep(1)
        self.store.terminate()
        return [a.wait() for a in self.agents if not getattr(a, "lost", False)]

    def output(self):
        return "".join(log.read_text() for log in self.logs)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_of(agent):
    """The agent's rank process (its child that runs rl.py), or None between attempts."""
    found = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True,
                           text=True).stdout.split()
    for pid in map(int, found):
        try:
            if b"rl.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            pass
    return None


def read_rows(out_dir):
    path, rows = out_dir / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


def strike(job, chaos, rng, faults):
    """chaos.chaos_faults times: wait for an attempt's workers on every live agent, then strike one
    node at a random moment; append (kind, seconds into the attempt, steps redone) to `faults`."""
    seen, kinds = set(), chaos.chaos_kinds.split(",")
    for _ in range(chaos.chaos_faults):
        while job.running():  # the next attempt's workers
            pids = {a: worker_of(a) for a in job.live()}
            if all(pids.values()) and not seen & set(pids.values()):
                break
            time.sleep(0.2)
        else:
            return
        seen |= set(pids.values())
        delay = rng.uniform(0, chaos.chaos_window_s)
        time.sleep(delay)
        whole = len(job.live()) == chaos.chaos_nodes  # a node lost only while all are there
        kind = rng.choice([k for k in kinds if k != "node" or whole] or ["worker"])
        agent = rng.choice(list(pids))
        saved = latest_checkpoint(job.out_dir / "checkpoints")
        saved = checkpoint_step(saved) if saved else 0
        redone = max(0, max((r["step"] for r in read_rows(job.out_dir)), default=0) - saved)
        if not job.running():
            return
        try:
            if kind == "node":
                agent.lost = True
                agent.kill()
                threading.Timer(chaos.chaos_rejoin_s,
                                lambda: job.running() and job.agents.append(job.start_agent())
                                ).start()
            os.kill(pids[agent], signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
        except ProcessLookupError:  # it ended by itself (a step's end, the run's end)
            continue
        faults.append({"kind": kind, "after_s": round(delay, 1), "redone": redone})


def compared(reference, rows):
    """The keys where rows differ from the reference run's (time/, rates, timestamps and the
    balance's bytes aside; floats within fp32 noise), or [] if none."""
    differ = []
    for a, b in zip(reference, rows):
        for key in sorted(set(a) | set(b)):
            x, y = a.get(key), b.get(key)
            if (x != y and not key.startswith(("time/", "bytes/balance_", "timestamp"))
                    and not key.endswith("_per_s")
                    and not (isinstance(x, float) and isinstance(y, float)
                             and abs(x - y) <= 1e-6 + 1e-5 * abs(x))):
                differ.append(f"step {a.get('step')} {key}")
    return differ


def main(argv):
    chaos = load_config(ChaosConfig, [a for a in argv if a.startswith("chaos_")])
    rl_argv = [a for a in argv if not a.startswith("chaos_")]
    # one thread (a machine's own count moves the update's sums); a hang found at a short timeout
    rl_argv += [f"{key}={value}" for key, value in (("train_threads", 1),
                ("collective_timeout_min", 3)) if not any(a.startswith(f"{key}=") for a in argv)]
    rng = random.Random(chaos.chaos_seed)
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    started = time.time()
    reference = Job(chaos.chaos_nodes, rl_argv, work / "reference", 0)
    if any(reference.wait()):
        sys.exit(f"bench.chaos: the uninterrupted run failed:\n{reference.output()[-3000:]}")
    reference_s = time.time() - started
    print(f"uninterrupted run: {reference_s:.0f} s", flush=True)
    chaos.chaos_window_s = chaos.chaos_window_s or 0.5 * reference_s
    reference_rows = read_rows(work / "reference")
    summary = []
    for run in range(chaos.chaos_runs):
        faults, started = [], time.time()
        job = Job(chaos.chaos_nodes, rl_argv, work / f"run-{run}", chaos.chaos_faults)
        striker = threading.Thread(target=strike, args=(job, chaos, rng, faults))
        striker.start()
        codes = job.wait()
        striker.join()
        seconds, out_dir, output = time.time() - started, job.out_dir, job.output()
        rows = read_rows(out_dir)
        result = {"run": run, "exits": codes, "seconds": round(seconds), "faults": faults,
                  "attempts": output.count("plan: steps"),
                  "minutes_lost_per_fault": round((seconds - reference_s) / 60
                                                  / max(1, len(faults)), 1),
                  "steps_once": [r["step"] for r in rows] == [r["step"] for r in reference_rows],
                  "differ": compared(reference_rows, rows),
                  "tmp_left": [p.name for p in (out_dir / "checkpoints").glob("*.tmp")]}
        summary.append(result)
        print(json.dumps(result), flush=True)
        if any(codes):
            print(output[-3000:], flush=True)
    faults = [f for r in summary for f in r["faults"]]
    finished = sum(not any(r["exits"]) and r["steps_once"] and not r["differ"]
                   and not r["tmp_left"] for r in summary)
    print(f"{len(summary)} runs, {len(faults)} faults ("
          + ", ".join(f"{k} {sum(f['kind'] == k for f in faults)}"
                      for k in chaos.chaos_kinds.split(",")) + f"), {finished} finished with every "
          "step once, the uninterrupted run's numbers and no .tmp left; steps redone per fault: "
          f"{[f['redone'] for f in faults]}; minutes lost per fault: "
          f"{[r['minutes_lost_per_fault'] for r in summary]}", flush=True)
    print(f"(run directories and logs in {work})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
