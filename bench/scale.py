"""Benchmark of the two scale fixes machinery/plan.py accounts for, as ratios against a baseline
measured in the same run:

    python -m bench.scale                      # both parts, ~1 minute on 2 CPU cores, ~2 GiB
    python -m bench.scale part=logprobs        # or part=balance

1. log-probs: peak bytes of live tensors (plan.PeakMemory) of machinery.training.token_logprobs
   forward + backward on a Qwen3-shaped model with the 151,936-token vocabulary (random weights,
   one decoder layer), all at once (logprob_chunk_tokens=0, the baseline) against chunks; beside
   each, plan.logprob_bytes' prediction.
2. balance: bytes received per rank by machinery.distributed.balance_by_tokens as the number of
   ranks grows, at a fixed 128 trajectories per rank, against all-gathering every trajectory (the
   old design). Simulated for many ranks (the same assignment arithmetic,
   machinery.distributed.assign_by_tokens, and plan.pickled_trajectory_bytes for what moves), and
   measured for real on 1 and 2 ranks (torchrun, every c10d collective counted by plan.CommMeter).
Counts, not timings: they do not depend on the machine's load.
"""
import dataclasses
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen3Config

from machinery import plan
from machinery.config import REPO, load_config
from machinery.distributed import init_distributed
from machinery.distributed import assign_by_tokens, balance_by_tokens
from machinery.training import token_logprobs
from machinery.training import TrainSample


@dataclasses.dataclass
class BenchConfig:
    part: str = "all"                      # all | logprobs | balance | balance_worker (internal:
                                           # one torchrun rank)
    tokens: int = 512                      # log-probs: tokens in the micro-batch
    chunks: list = dataclasses.field(default_factory=lambda: [256, 128, 64])
    vocab: int = 151936
    per_rank: int = 128                    # balance: kept trajectories per rank (the paper: 8,192
                                           # over 64 GPUs)
    ranks: list = dataclasses.field(default_factory=lambda: [2, 8, 32, 128])
    real_per_rank: int = 32                # balance, measured: trajectories per rank (shorter, so
                                           # it runs in seconds)
    out: str = ""                          # balance_worker: where rank 0 writes its counts

    def validate(self):
        if self.part not in ("all", "logprobs", "balance", "balance_worker"):
            raise ValueError(f"part={self.part!r}: expected all, logprobs or balance")


def bench_logprobs(cfg):
    config = Qwen3Config(vocab_size=cfg.vocab, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shape = plan.ModelShape(hidden=256, intermediate=512, layers=1, heads=4, kv_heads=2,
                            head_dim=64, vocab=cfg.vocab, tied=False)
    input_ids = torch.randint(0, cfg.vocab, (1, cfg.tokens + 1))

    # gradients accumulate in place into the ones the warm-up step made, as over micro-batches
    def step(chunk):
        token_logprobs(model, input_ids, 1.0, chunk).sum().backward()

    rows = []
    for chunk in [0] + list(cfg.chunks):
        model.zero_grad(set_to_none=True)
        # once before measuring: the weight gradients exist, as from a micro-batch before
        step(chunk)
        peak, start, _ = plan.peak_memory(lambda: step(chunk), model)
        # the plan's head term, plus the output projection's gradient of a chunk, added to .grad
        # meanwhile
        head_grad = 4 * cfg.vocab * shape.hidden if chunk and chunk < cfg.tokens else 0
        rows.append((chunk, peak - start, plan.logprob_bytes(shape, cfg.tokens, chunk) + head_grad))
    baseline = rows[0][1]
    print(f"\nlog-probs of {cfg.tokens} tokens, vocabulary {cfg.vocab}: peak above the model and "
          "its gradients (from a micro-batch before)")
    print(f"  {'logprob_chunk_tokens':>22s} {'measured MiB':>13s} {'vs all at once':>15s} "
          f"{'plan MiB':>9s}")
    for chunk, measured, planned in rows:
        print(f"  {chunk or 'all at once':>22} {measured / 2**20:13.1f} "
              f"{measured / baseline:15.3f} {planned / 2**20:9.1f}")
    return rows


def simulated_balance(cfg, world, rng):
    """Bytes rank 0 receives: keys + the pickled trajectories assigned to it from elsewhere; and
    the old all-gather."""
    # dynamic claiming
    counts = [max(1, int(rng.gauss(cfg.per_rank, cfg.per_rank / 4))) for _ in range(world)]
    keys, owner = [], []
    for r, n in enumerate(counts):
        for i in range(n):
            response = rng.randint(500, 8192)
            keys.append((256 + response, len(owner), 0))
            owner.append(r)
    shares = assign_by_tokens(keys, world)
    arrived = [(256, keys[i][0] - 256) for i in shares[0] if owner[i] != 0]
    new = plan.balance_received(world, max(counts), arrived, cfg.vocab)
    sizes = [plan.pickled_trajectory_bytes(256, k[0] - 256, cfg.vocab) for k in keys]
    old = sum(size for size, o in zip(sizes, owner) if o != 0)
    return new, old, sum(sizes) / world


def trajectories(rank, count, vocab):
    rng = random.Random(rank)
    out = []
    for i in range(count):
        n = rng.randint(100, 2000)
        out.append(TrainSample([rng.randrange(vocab) for _ in range(64)],
                               [rng.randrange(vocab) for _ in range(n)], [1] * n, 0.5,
                               engine_logprobs=[-rng.random() for _ in range(n)],
                               problem_index=rank * count + i))
    return out


def balance_worker(cfg):
    """One torchrun rank: received bytes of balance_by_tokens and of the old all-gather of every
    trajectory."""
    rank, world, _, _ = init_distributed()
    # rank 0 claimed more
    mine = trajectories(rank, cfg.real_per_rank * (2 if rank == 0 else 1), cfg.vocab)
    new, old = plan.CommMeter(), plan.CommMeter()
    with new:
        balance_by_tokens(mine)
    with old:
        dist.all_gather_object([None] * world, mine)
    if rank == 0:
        Path(cfg.out).write_text(json.dumps(dict(new=new.total(), old=old.total(),
                                                 pickled_mine=len(pickle.dumps(mine)))))
    dist.barrier()
    dist.destroy_process_group()


def bench_balance(cfg):
    rng = random.Random(0)
    print(f"\nbalance, {cfg.per_rank} kept trajectories per rank (500-8192 response tokens), "
          "bytes rank 0 receives:")
    print(f"  {'ranks':>6s} {'new MiB':>9s} {'new / one share':>16s} {'old all-gather MiB':>19s} "
          f"{'old / new':>10s}")
    for world in cfg.ranks:
        new, old, share = simulated_balance(cfg, world, rng)
        print(f"  {world:6d} {new / 2**20:9.2f} {new / share:16.2f} {old / 2**20:19.1f} "
              f"{old / new:10.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "balance.json"
        # -m from the repo root, as this file is run: the worker imports the machinery package
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", "-m", "bench.scale", "part=balance_worker",
                        f"out={out}", f"real_per_rank={cfg.real_per_rank}"],
                       check=True, cwd=REPO, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                       capture_output=True)
        real = json.loads(out.read_text())
    print(f"  measured on 2 ranks (rank 0 holds {2 * cfg.real_per_rank}, "
          f"rank 1 {cfg.real_per_rank}): balance_by_tokens {real['new'] / 2**20:.2f} MiB, "
          f"all-gather of every trajectory {real['old'] / 2**20:.2f} MiB "
          f"({real['old'] / max(real['new'], 1):.1f}x); on 1 rank both are 0 (nothing leaves the "
          "process)")
    return real


if __name__ == "__main__":
    config = load_config(BenchConfig, sys.argv[1:])
    if config.part == "balance_worker":
        balance_worker(config)
    else:
        if config.part in ("all", "logprobs"):
            bench_logprobs(config)
        if config.part in ("all", "balance"):
            bench_balance(config)
