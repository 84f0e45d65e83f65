"""One rl.train_step on a fixed global batch; writes the updated weights, their gradients and the
step's metrics.

    python tests/dist_rl_train_step.py MODEL_DIR OUT.pt [key=value ...]                  # 1 process
    torchrun --nproc_per_node=2 tests/dist_rl_train_step.py MODEL_DIR OUT.pt [key=value ...]
    python tests/dist_rl_train_step.py MODEL_DIR OUT.pt old_logprobs=both [key=value ...]

tests/test_rl.py runs it under several (world size x micro-batch) splits and compares the files: the
update must not depend on how the batch is split. The batch is built from a fixed seed, identical in
every process; rank r trains on a contiguous slice of it, as after rollout balancing. Its engine
log-probs are the trainer's plus noise, so the rollout-correction metrics measure a real gap.
old_logprobs=both: no noise on the old log-probs; one step with them from rl.recompute_logprobs'
pass and one, from the same initial weights, with them from the update's own forward (what rl.py
does with mini_batches=1), for each rollout_correction setting; writes both steps' gradients and
metrics.
"""
import random
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rl  # noqa: E402
from machinery.distributed import init_distributed
from machinery.config import load_config
from machinery.distributed import full_weights
from machinery.checkpoint import load_policy
from machinery.training import TrainSample
from machinery.exits import end_process_group, leave

# Eight trajectories of very different lengths and tool-token masks: a per-micro-batch token mean
# would weigh them differently depending on the split, so a scaling bug moves the gradient far past
# float noise.
NUM_SAMPLES = 8


def fixed_batch(vocab_size):
    rng = random.Random(1234)
    samples = []
    for i in range(NUM_SAMPLES):
        prompt_len = rng.randint(4, 12)
        response_len = rng.choice([3, 5, 40, 90]) + i
        prompt = [rng.randrange(3, vocab_size) for _ in range(prompt_len)]
        response = [rng.randrange(3, vocab_size) for _ in range(response_len)]
        # a block of "tool output" in the middle of longer responses: loss mask 0 there
        mask = [0 if (response_len > 20 and 10 <= j < 20) else 1 for j in range(response_len)]
        advantage = [1.2, -0.8, 0.5, -1.5][i % 4]
        samples.append(TrainSample(prompt, response, mask, advantage, problem_index=i))
    return samples


def engine_logprobs(samples, first_index):
    """The engine's log-probs: the trainer's (old_logprobs) plus noise of the sample (not rank)."""
    for index, s in enumerate(samples, start=first_index):
        noise = random.Random(77 + index)
        s.engine_logprobs = [lp + noise.uniform(-0.3, 0.3) for lp in s.old_logprobs]


def gradients_before_the_step(model, optimizer):
    """train_step frees the gradients right after optimizer.step(): they are read just before it."""
    grads = {}
    optimizer.register_step_pre_hook(lambda *_: grads.update(
        {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
         for name, p in model.named_parameters()}))
    return grads


def this_ranks_batch(model_dir, overrides, rank, world_size, device):
    """(cfg, the policy, its optimizer, this rank's share of the fixed batch with old and engine
    log-probs, the share's size), from seed 0. Log-probs in chunks of 64 tokens: several per
    micro-batch, so their recomputation in backward is in the check."""
    torch.manual_seed(0)
    cfg = load_config(rl.RLConfig, [f"model={model_dir}", "lr=1e-3", "warmup_steps=0",
                                    "logprob_chunk_tokens=64", *overrides])
    model, optimizer = load_policy(cfg, device, rank)
    samples = fixed_batch(model.config.vocab_size)
    per_rank = len(samples) // world_size
    mine = samples[rank * per_rank:(rank + 1) * per_rank]
    rl.recompute_logprobs(model, mine, cfg, pad_id=0, device=device)
    engine_logprobs(mine, rank * per_rank)
    return cfg, model, optimizer, mine, per_rank


def shared_and_recomputed(model_dir, out_file, overrides, rank, world_size, device):
    """old_logprobs=both: the update with a separate old-log-prob pass and with the shared forward,
    from the same weights, under each rollout correction."""
    results = {}
    for correction in ("none", "token_tis"):
        for path in ("recompute", "shared"):
            cfg, model, optimizer, mine, _ = this_ranks_batch(
                model_dir, ["rollout_is_threshold=1.2", f"rollout_correction={correction}",
                            *overrides], rank, world_size, device)
            if path == "shared":
                recomputed = [s.old_logprobs for s in mine]
                for s in mine:
                    s.old_logprobs = None
            grads = gradients_before_the_step(model, optimizer)
            metrics = rl.train_step(model, optimizer, mine, cfg, step=0, pad_id=0, device=device)
            filled = (None if path == "recompute"
                      else max(abs(a - b) for s, old in zip(mine, recomputed)
                               for a, b in zip(s.old_logprobs, old)))
            results[correction, path] = {"grads": grads, "metrics": metrics,
                                         "gap": rl.logprob_gap(mine), "filled_vs_pass": filled}
    if rank == 0:
        torch.save(results, out_file)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main():
    model_dir, out_file, *overrides = sys.argv[1:]
    rank, world_size, _, device = init_distributed()
    if "old_logprobs=both" in overrides:
        overrides.remove("old_logprobs=both")
        return shared_and_recomputed(model_dir, out_file, overrides, rank, world_size, device)
    cfg, model, optimizer, mine, per_rank = this_ranks_batch(model_dir, overrides, rank,
                                                             world_size, device)
    # Old log-probs a little off the current policy, so that ratios differ from 1 and both clips are
    # exercised. The noise belongs to the sample, not to the rank, so every split sees the same
    # global batch.
    for index, s in enumerate(mine, start=rank * per_rank):
        noise = random.Random(99 + index)
        s.old_logprobs = [lp + noise.uniform(-0.4, 0.4) for lp in s.old_logprobs]
    grads = gradients_before_the_step(model, optimizer)
    metrics = rl.train_step(model, optimizer, mine, cfg, step=0, pad_id=0, device=device)
    # what the rollout would hold
    grads_left = [name for name, p in model.named_parameters() if p.grad is not None]
    # the weight sync in fp32 and in bf16, with what each all-gather really moved (the profiler's
    # record of the collectives' tensor arguments, independent of rl.full_weights' own count)
    sync = {}
    for dtype in (torch.float32, torch.bfloat16):
        traffic = {}
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
            sent = {name: t.clone() for name, t in full_weights(model, dtype, traffic)}
        gathers = [(e.name(), [d for d in e.dtypes() if d not in ("", "Scalar", "ScalarList")])
                   for e in profiler.profiler.kineto_results.events()
                   if "gather" in e.name().lower() and "::" in e.name()]
        sync[str(dtype)] = {"weights": sent,
                            "gathered_bytes": traffic["weight_sync_gathered_bytes"],
                            "gathers": gathers}
    weights = sync["torch.float32"]["weights"]
    # the bucketed gather rebuilds exactly what DTensor's own gather does
    for name, p in model.named_parameters():
        assert torch.equal(weights[name], p.full_tensor()), name
    if rank == 0:
        torch.save({"weights": weights, "grads": grads, "metrics": metrics,
                    "grads_left": grads_left, "sync": sync,
                    "num_params": len(list(model.named_parameters())),
                    "param_bytes": sum(p.numel() * 4 for p in model.parameters())}, out_file)
    # A rank that leaves with the gloo group alive aborts in its threads' teardown ("terminate
    # called without an active exception"), and torchrun then kills the other rank, perhaps
    # mid-save: wait for rank 0, then end it.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # as the scripts end (machinery/exits.py): past the interpreter's teardown, where gloo's
    # worker threads can abort a rank after its work is done
    end_process_group()
    leave(0)
