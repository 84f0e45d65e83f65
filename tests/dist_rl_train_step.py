"""One rl.train_step on a fixed global batch; writes the updated weights, their gradients and the
step's metrics.

    python tests/dist_rl_train_step.py MODEL_DIR OUT.pt [key=value ...]                  # 1 process
    torchrun --nproc_per_node=2 tests/dist_rl_train_step.py MODEL_DIR OUT.pt [key=value ...]

tests/test_rl.py runs it under several (world size x micro-batch) splits and compares the files: the
update must not depend on how the batch is split. The batch is built from a fixed seed, identical in
every process; rank r trains on a contiguous slice of it, as after rollout balancing.
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


def main():
    model_dir, out_file, *overrides = sys.argv[1:]
    rank, world_size, _, device = init_distributed()
    torch.manual_seed(0)
    # log-probs in chunks of 64 tokens: several per micro-batch, so their recomputation in backward
    # is in the check
    cfg = load_config(rl.RLConfig, [f"model={model_dir}", "lr=1e-3", "warmup_steps=0",
                                    "logprob_chunk_tokens=64", *overrides])
    model, optimizer = load_policy(cfg, device, rank)
    samples = fixed_batch(model.config.vocab_size)
    per_rank = len(samples) // world_size
    mine = samples[rank * per_rank:(rank + 1) * per_rank]
    rl.recompute_logprobs(model, mine, cfg, pad_id=0, device=device, temperature=1.0)
    # Old log-probs a little off the current policy, so that ratios differ from 1 and both clips are
    # exercised. The noise belongs to the sample, not to the rank, so every split sees the same
    # global batch.
    for index, s in enumerate(mine, start=rank * per_rank):
        noise = random.Random(99 + index)
        s.old_logprobs = [lp + noise.uniform(-0.4, 0.4) for lp in s.old_logprobs]
    # train_step frees the gradients right after optimizer.step(), so they are read just before it
    grads = {}
    optimizer.register_step_pre_hook(lambda *_: grads.update(
        {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
         for name, p in model.named_parameters()}))
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
