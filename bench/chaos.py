"""rl.py on simulated nodes (a torchrun agent each, 1 rank, elastic --nnodes=N-1:N as docs/gpu.md
launches) struck by faults at random moments, against an uninterrupted run (docs/benchmarks.md);
from the repo's root, model= an SFT'd policy (the untrained tiny model trains on nothing):

    python -m bench.chaos configs/tiny.yaml model=PATH train_data=PATH eval_data= steps=6 \
        prompts_per_step=4 save_every=2 rollout.max_response_tokens=200 [any rl.py key=value] \
        [chaos_runs=2 chaos_faults=3 chaos_nodes=3 chaos_kinds=worker,node,hang chaos_seed=0]"""
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
from machinery.config import load_config, read_records


@dataclasses.dataclass
class ChaosConfig:
    chaos_runs: int = 2           # runs, each struck chaos_faults times
    chaos_faults: int = 3         # faults per run (and each agent's --max-restarts)
    chaos_nodes: int = 3          # simulated nodes; the job goes on with one fewer
    # drawn uniformly: a rank SIGKILLed (a GPU lost), its agent too (a node lost), SIGSTOPped (hung)
    chaos_kinds: str = "worker,node,hang"
    chaos_window_s: float = 0.0   # a fault within this of an attempt's start; 0: half the run's
    chaos_rejoin_s: float = 60.0  # a lost node's agent comes back this long after
    chaos_seed: int = 0


class Job:
    """One run: a rendezvous store of its own and one torchrun agent per simulated node."""

    def __init__(self, nodes, rl_argv, out_dir, max_restarts):
        self.out_dir, self.logs = out_dir, []
        self.store = subprocess.Popen([sys.executable, "-m", "machinery.distributed", "0"],
                                      stdout=subprocess.PIPE, text=True)
        port = self.store.stdout.readline().rsplit(":", 1)[1].strip()  # "listens on HOST:PORT"
        self.command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                        f"--nnodes={max(1, nodes - 1)}:{nodes}", f"--max-restarts={max_restarts}",
                        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                        "--rdzv-conf=is_host=false", "--rdzv-id=chaos", "rl.py", *rl_argv,
                        f"out_dir={out_dir}"]
        self.agents = [self.start_agent() for _ in range(nodes)]

    def start_agent(self):
        self.logs.append(self.out_dir.parent / f"{self.out_dir.name}-agent-{len(self.logs)}.log")
        return subprocess.Popen(self.command, stdout=self.logs[-1].open("w"),
                                stderr=subprocess.STDOUT)

    def live(self):  # the agents running, a killed node's not among them
        return [a for a in self.agents if a.poll() is None and not getattr(a, "lost", False)]

    def wait(self):
        while self.live():
            time.sleep(1)
        self.store.terminate()
        return [a.wait() for a in self.agents if not getattr(a, "lost", False)]


def worker_of(agent):
    """The agent's rank process (its child that runs rl.py), or None between attempts."""
    children = subprocess.run(["pgrep", "-P", str(agent.pid), "-f", "rl.py"], capture_output=True,
                              text=True).stdout.split()
    return int(children[0]) if children else None


def strike(job, chaos, rng, faults):
    """chaos_faults times: once an attempt's workers run, strike one at a random moment."""
    seen, kinds = set(), chaos.chaos_kinds.split(",")
    for _ in range(chaos.chaos_faults):
        while job.live():  # the next attempt's workers
            pids = {a: worker_of(a) for a in job.live()}
            if all(pids.values()) and not seen & set(pids.values()):
                break
            time.sleep(0.2)
        else:
            return

        seen |= set(pids.values())
        time.sleep(delay := rng.uniform(0, chaos.chaos_window_s))
        whole = len(job.live()) == chaos.chaos_nodes  # a node lost only while all are there
        kind = rng.choice([k for k in kinds if k != "node" or whole] or ["worker"])
        agent = rng.choice(list(pids))
        saved = latest_checkpoint(job.out_dir / "checkpoints")
        logged = max((r["step"] for r in read_records(job.out_dir / "metrics.jsonl")), default=0)
        redone = max(0, logged - (checkpoint_step(saved) if saved else 0))
        if not job.live():
            return
        try:
            if kind == "node":
                agent.lost = True
                agent.kill()
                threading.Timer(chaos.chaos_rejoin_s,
                                lambda: job.live() and job.agents.append(job.start_agent())).start()
            os.kill(pids[agent], signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
        except ProcessLookupError:  # it ended by itself (a step's end, the run's end)
            continue
        faults.append({"kind": kind, "after_s": round(delay, 1), "redone": redone})


def compared(reference, rows):
    """Where rows differ from the reference's: times, rates, the balance's bytes aside."""
    return [f"step {a.get('step')} {key}" for a, b in zip(reference, rows)
            for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key) and not key.endswith("_per_s")
            and not key.startswith(("time/", "bytes/balance_", "timestamp"))
            and not (isinstance(a.get(key), float) and isinstance(b.get(key), float)
                     and abs(a[key] - b[key]) <= 1e-6 + 1e-5 * abs(a[key]))]


def main(argv):
    chaos = load_config(ChaosConfig, [a for a in argv if a.startswith("chaos_")])
    # one thread (the count moves the update's sums), a hang found soon; argv's own keys come last
    config, *rl_argv = [a for a in argv if not a.startswith("chaos_")]
    rl_argv = [config, "train_threads=1", "collective_timeout_min=3", *rl_argv]
    os.environ.update(TOKENIZERS_PARALLELISM="false", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    rng, work = random.Random(chaos.chaos_seed), Path(tempfile.mkdtemp(prefix="chaos-"))
    started = time.time()
    if any(Job(chaos.chaos_nodes, rl_argv, work / "reference", 0).wait()):
        sys.exit(f"bench.chaos: the uninterrupted run failed (logs in {work})")
    reference_s = time.time() - started
    print(f"uninterrupted run: {reference_s:.0f} s (logs in {work})", flush=True)
    chaos.chaos_window_s = chaos.chaos_window_s or 0.5 * reference_s
    reference = read_records(work / "reference" / "metrics.jsonl")

    for run in range(chaos.chaos_runs):
        faults, started = [], time.time()
        job = Job(chaos.chaos_nodes, rl_argv, work / f"run-{run}", chaos.chaos_faults)
        striker = threading.Thread(target=strike, args=(job, chaos, rng, faults))
        striker.start()
        codes = job.wait()
        striker.join()
        rows, seconds = read_records(job.out_dir / "metrics.jsonl"), time.time() - started
        print(json.dumps({
            "run": run, "exits": codes, "seconds": round(seconds), "faults": faults,
            "attempts": sum(log.read_text().count("plan: steps") for log in job.logs),
            "minutes_lost_per_fault": round((seconds - reference_s) / 60 / max(1, len(faults)), 1),
            "steps_once": [r["step"] for r in rows] == [r["step"] for r in reference],
            "differ": compared(reference, rows),
            "tmp_left": [p.name for p in (job.out_dir / "checkpoints").glob("*.tmp")]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
