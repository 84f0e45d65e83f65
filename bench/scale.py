"""The two scale fixes machinery/plan.py accounts for, as ratios against a baseline of the same run
(counts, not timings: the machine's load does not enter):

    python -m bench.scale          # ~1 minute on 2 CPU cores, ~2 GiB

1. log-probs: the peak bytes of live tensors (tests/instruments.py's PeakMemory) of
   machinery.training.token_logprobs forward + backward on a one-layer Qwen3 model with the
   151,936-token vocabulary, all at once (the baseline) against chunks; beside each, the plan's.
2. balance: the bytes rank 0 receives from machinery.distributed.balance_by_tokens as the ranks grow
   (its assignment, machinery.distributed.assign_by_tokens, and the plan's pickled sizes; 2 ranks
   are measured in tests/test_plan.py), against all-gathering every trajectory (the old design).
"""
import random

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from machinery import plan
from machinery.distributed import assign_by_tokens
from machinery.training import token_logprobs
from tests.instruments import peak_memory

TOKENS, VOCAB, CHUNKS = 512, 151936, (256, 128, 64)
PER_RANK, RANKS = 128, (2, 8, 32, 128)  # kept trajectories per rank (the paper: 8,192 over 64)


def bench_logprobs():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False),
        dtype=torch.float32)
    shape = plan.ModelShape(hidden=256, intermediate=512, layers=1, heads=4, kv_heads=2,
                            head_dim=64, vocab=VOCAB, tied=False)
    input_ids = torch.randint(0, VOCAB, (1, TOKENS + 1))
    print(f"log-probs of {TOKENS} tokens, vocabulary {VOCAB}: peak above the model and its "
          "gradients (from a micro-batch before)\n"
          f"  {'logprob_chunk_tokens':>22s} {'measured MiB':>13s} {'vs all at once':>15s} "
          f"{'plan MiB':>9s}")
    baseline = None
    for chunk in (0, *CHUNKS):
        def step():  # gradients accumulate into the ones a micro-batch before made
            token_logprobs(model, input_ids, 1.0, chunk).sum().backward()

        model.zero_grad(set_to_none=True)
        step()
        peak, start, _ = peak_memory(step, model)
        baseline = baseline or peak - start
        # the plan's head term, and a chunk's output-projection gradient added to .grad meanwhile
        planned = (plan.logprob_bytes(shape, TOKENS, chunk)
                   + (4 * VOCAB * shape.hidden if chunk and chunk < TOKENS else 0))
        print(f"  {chunk or 'all at once':>22} {(peak - start) / 2**20:13.1f} "
              f"{(peak - start) / baseline:15.3f} {planned / 2**20:9.1f}")


def bench_balance():
    rng = random.Random(0)
    print(f"\nbalance, {PER_RANK} kept trajectories per rank (500-8192 response tokens), bytes "
          f"rank 0 receives:\n  {'ranks':>6s} {'new MiB':>9s} {'new / one share':>16s} "
          f"{'old all-gather MiB':>19s} {'old / new':>10s}")
    for world in RANKS:
        # dynamic claiming: ranks hold different counts
        counts = [max(1, int(rng.gauss(PER_RANK, PER_RANK / 4))) for _ in range(world)]
        keys, owner = [], []
        for rank, count in enumerate(counts):
            for _ in range(count):
                keys.append((256 + rng.randint(500, 8192), len(owner), 0))
                owner.append(rank)
        arrived = [(256, keys[i][0] - 256) for i in assign_by_tokens(keys, world)[0]
                   if owner[i] != 0]
        new = plan.balance_received(world, max(counts), arrived, VOCAB)
        sizes = [plan.pickled_trajectory_bytes(256, key[0] - 256, VOCAB) for key in keys]
        old = sum(size for size, o in zip(sizes, owner) if o != 0)
        print(f"  {world:6d} {new / 2**20:9.2f} {new / (sum(sizes) / world):16.2f} "
              f"{old / 2**20:19.1f} {old / new:10.1f}")


if __name__ == "__main__":
    bench_logprobs()
    bench_balance()
