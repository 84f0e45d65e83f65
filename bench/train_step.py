"""Seconds of rl.py's steps 6-7 on one fixed batch, as ratios against the separate old-log-prob pass
measured in the same run:

    python -m bench.train_step                 # the CPU demo's model shape and batch, ~1 minute
    python -m bench.train_step repeats=9 threads=2

separate  rl.recompute_logprobs (a no-grad pass) and then rl.train_step on the old log-probs it
          wrote: what rl.py did before, and still does with mini_batches > 1;
shared    rl.train_step alone, the old log-probs from its own forward (mini_batches = 1);
entropy   machinery.training.token_logprobs forward + backward with and without with_entropy: the
          cost of logging the entropy.
Random weights of configs/tiny.yaml's model shape (tiny.TinyConfig), trajectories of the demo's
length (a ~430-token system prompt, ~140 response tokens); one thread unless threads= says
(rl.py's train_threads; python -m bench.threads compares the counts). The paths alternate,
`repeats` times each, in one process, and the medians are compared, in wall and in CPU seconds:
load moves the wall seconds (the load average is printed), the CPU seconds much less.
"""
import dataclasses
import os
import random
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

import rl
from machinery.config import load_config
from machinery.distributed import init_distributed
from machinery.training import TrainSample, token_logprobs
from tiny import TinyConfig


@dataclasses.dataclass
class BenchConfig:
    repeats: int = 5
    threads: int = 1            # torch threads (rl.py's train_threads)
    samples: int = 16           # kept trajectories of one step (the demo: 8 prompts x G = 4, about
                                # half of the groups all-equal)
    prompt_tokens: int = 430
    response_tokens: int = 140
    vocab: int = 2100           # the tiny tokenizer's 2048 merges and its added tokens


def batch(cfg, rng):
    samples = []
    for i in range(cfg.samples):
        n = cfg.response_tokens + rng.randint(-60, 60)
        samples.append(TrainSample([rng.randrange(cfg.vocab) for _ in range(cfg.prompt_tokens)],
                                   [rng.randrange(cfg.vocab) for _ in range(n)], [1] * n,
                                   [1.0, -1.0][i % 2],
                                   engine_logprobs=[-rng.random() for _ in range(n)]))
    return samples


def seconds(run):
    """(wall seconds, CPU seconds of this process): on a loaded machine the CPU seconds, which
    do not count the time spent waiting for a core, are the steadier measure of the work."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def tiny_model(cfg):
    """Random weights (seed 0) of configs/tiny.yaml's model shape, fp32, and its AdamW."""
    t = TinyConfig()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=cfg.vocab, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim), dtype=torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-9)


def main(cfg):
    load = os.getloadavg()
    torch.set_num_threads(cfg.threads)
    init_distributed()
    model, optimizer = tiny_model(cfg)
    rl_cfg = load_config(rl.RLConfig, ["configs/tiny.yaml"])
    samples = batch(cfg, random.Random(0))

    def separate():
        fresh = [dataclasses.replace(s) for s in samples]
        rl.recompute_logprobs(model, fresh, rl_cfg, 0, torch.device("cpu"))
        rl.train_step(model, optimizer, fresh, rl_cfg, 100, 0, torch.device("cpu"))

    def shared():
        fresh = [dataclasses.replace(s) for s in samples]
        rl.train_step(model, optimizer, fresh, rl_cfg, 100, 0, torch.device("cpu"))

    input_ids = torch.randint(0, cfg.vocab, (cfg.samples // 2, cfg.prompt_tokens
                                             + cfg.response_tokens))

    def logprobs(with_entropy):
        model.zero_grad(set_to_none=True)
        out = token_logprobs(model, input_ids, 1.0, rl_cfg.logprob_chunk_tokens, with_entropy)
        (out[0] if with_entropy else out).sum().backward()

    runs = {"separate": separate, "shared": shared,
            "log-probs": lambda: logprobs(False), "log-probs + entropy": lambda: logprobs(True)}
    for run in runs.values():  # once each before measuring: allocator, thread pools
        run()
    times = {name: [] for name in runs}
    for _ in range(cfg.repeats):
        for name, run in runs.items():
            times[name].append(seconds(run))
    median = {name: [statistics.median(v[k] for v in values) for k in (0, 1)]
              for name, values in times.items()}
    print(f"load average before and after: {load}, {os.getloadavg()}; {cfg.threads} thread(s), "
          f"{cfg.samples} trajectories of ~{cfg.prompt_tokens + cfg.response_tokens} tokens, "
          f"median of {cfg.repeats}")
    print(f"  {'':48s}{'wall s':>8s}{'ratio':>8s}{'CPU s':>8s}{'ratio':>8s}")
    rows = [("steps 6-7, separate old-log-prob pass (before)", "separate", "separate"),
            ("steps 6-7, old log-probs from the update", "shared", "separate"),
            ("token_logprobs forward + backward", "log-probs", "log-probs"),
            ("the same with the entropy", "log-probs + entropy", "log-probs")]
    for label, name, baseline in rows:
        (wall, cpu), (wall0, cpu0) = median[name], median[baseline]
        print(f"  {label:48s}{wall:8.3f}{wall / wall0:8.3f}{cpu:8.3f}{cpu / cpu0:8.3f}")
    torch.distributed.destroy_process_group()
    return median


if __name__ == "__main__":
    main(load_config(BenchConfig, sys.argv[1:]))
