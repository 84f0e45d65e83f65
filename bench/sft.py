"""Benchmark of sft.py's share_prefix: forward + backward over the first global batch's
micro-batches, as padded batches and with the shared prompt encoded once, alternating, in this one
run.

    python -m bench.sft configs/sft_tiny.yaml [key=value ...]     # needs out/tiny-model,
                                                                  # out/tiny-sft.jsonl (tiny.py)

The config is sft.py's (SFTConfig). Prints conversation tokens/s of each, their ratio, and how far
apart the two losses are (they should agree: share_prefix is exact).
"""
import sys
import time

import torch.distributed as dist
from transformers import AutoTokenizer

from machinery.config import ConfigError, load_config
from machinery.distributed import init_distributed, seed_everything
from sft import (check_world, global_batch, load_conversations, micro_batch_inputs,
                 micro_batch_loss_sum, rank_micro_batches, SFTConfig)
from machinery.model import build_model, check_model_dir
from machinery.threads import choose_threads


def bench(cfg, repeats=3):
    """Best of `repeats` timed rounds of each, after one untimed warm-up round."""
    rank, world_size, _, device = init_distributed()
    check_world(cfg, world_size)
    model_path = check_model_dir(cfg.model)
    cfg = choose_threads(cfg, device, rank)  # sft.py's count
    seed_everything(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    examples, _ = load_conversations(cfg, tokenizer)
    lengths = [len(ids) for ids, _ in examples]
    model, _ = build_model(cfg, model_path, device, rank)
    batch = global_batch(len(examples), cfg.global_batch_size, cfg.seed, 0)
    micro_batches = [[examples[i] for i in indices]
                     for indices in rank_micro_batches(batch, lengths, cfg.micro_batch_size, rank,
                                                       world_size)]
    tokens = sum(len(ids) for micro in micro_batches for ids, _ in micro)
    seconds, losses = {False: [], True: []}, {False: 0.0, True: 0.0}
    for repeat in range(repeats + 1):  # the first round warms up and is not timed
        for share in (False, True):
            started = time.perf_counter()
            total = 0.0
            for micro in micro_batches:
                loss = micro_batch_loss_sum(model, *micro_batch_inputs(micro, 0, share, device))
                loss.backward()
                total += loss.item()
            model.zero_grad(set_to_none=True)
            if repeat:
                seconds[share].append(time.perf_counter() - started)
            losses[share] = total
    if rank == 0:
        base, shared = min(seconds[False]), min(seconds[True])
        print(f"{len(micro_batches)} micro-batches of {cfg.micro_batch_size}, {tokens} "
              f"conversation tokens; best of {repeats}, forward + backward:")
        print(f"  padded batch   {tokens / base:8.0f} tokens/s  ({base:.2f} s)")
        print(f"  shared prefix  {tokens / shared:8.0f} tokens/s  ({shared:.2f} s)   "
              f"{base / shared:.2f}x")
        print(f"  loss: {losses[False]:.4f} vs {losses[True]:.4f} (relative difference "
              f"{abs(losses[False] - losses[True]) / losses[False]:.1e})")


if __name__ == "__main__":
    try:
        bench(load_config(SFTConfig, sys.argv[1:]))
    except ConfigError as e:
        sys.exit(f"bench/sft.py: {e}")
    dist.destroy_process_group()
