"""What plan.py plans, measured on the real rl.py code from tensors and collectives (never RSS):
OUT_DIR/rank{R}.json for tests/test_plan.py.

    [torchrun --standalone --nproc_per_node=2] tests/dist_plan_measure.py MODEL_DIR OUT_DIR [k=v]
"""
import dataclasses
import json
import random
import sys
from pathlib import Path

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rl  # noqa: E402
from tests.instruments import CommMeter, peak_memory, tensor_bytes  # noqa: E402
from machinery.checkpoint import load_policy  # noqa: E402
from machinery.config import load_config  # noqa: E402
from machinery.distributed import full_weights, init_distributed  # noqa: E402
from machinery.exits import end_process_group, leave  # noqa: E402
from machinery.training import TrainSample, last_hidden_states, token_logprobs  # noqa: E402


def full_sample(tokens, vocab, seed):  # a micro-batch of exactly `tokens` tokens
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(16)]
    response = [rng.randrange(3, vocab) for _ in range(tokens - 16)]
    sample = TrainSample(prompt, response, [1] * len(response), advantage=1.0 if seed % 2 else -1.0)
    sample.old_logprobs = [-8.0] * len(response)
    return sample


def main():
    model_dir, out_dir, *overrides = sys.argv[1:]
    rank, world_size, _, device = init_distributed()
    torch.manual_seed(0)
    cfg = load_config(rl.RLConfig, [f"model={model_dir}", "lr=1e-3", "warmup_steps=0", *overrides])
    tokens = cfg.micro_batch_tokens
    model, optimizer = load_policy(cfg, device, rank)
    vocab = model.config.vocab_size
    out = {"world_size": world_size, "master": tensor_bytes(model.parameters())}

    # gradients: one forward/backward, summed over this rank's gradient shards
    input_ids = torch.tensor([full_sample(tokens, vocab, rank).prompt_ids
                              + full_sample(tokens, vocab, rank).response_ids])
    token_logprobs(model, input_ids, 1.0, cfg.logprob_chunk_tokens).sum().backward()
    out["grads"] = tensor_bytes(p.grad for p in model.parameters())
    optimizer.zero_grad(set_to_none=True)

    # saved activations of the decoder: live tensors after a forward that computes no logits, with
    # checkpointing off and on (the same model; HF's switch)
    model.gradient_checkpointing_disable()
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        tracker = FSDPMemTracker(model, optimizer)
        with tracker:
            hidden = last_hidden_states(model, input_ids)
            out[f"saved_checkpointing_{checkpointing}"] = (
                tracker.get_tracker_snapshot("current")[device][_FSDPRefType.ACT])
        del hidden
    if not cfg.activation_checkpointing:
        model.gradient_checkpointing_disable()

    # a first step creates AdamW's moments; the second, measured, is the steady state; of its two
    # micro-batches the second runs with the first one's gradients resident, the plan's case
    samples = [full_sample(tokens, vocab, 100 + rank), full_sample(tokens, vocab, 200 + rank)]
    rl.train_step(model, optimizer, samples, cfg, 0, 0, device)
    out["adam"] = tensor_bytes(t for state in optimizer.state.values() for t in state.values()
                                    if t.dim())
    comm = CommMeter()
    with comm:
        out["train_peak"], _, metrics = peak_memory(
            lambda: rl.train_step(model, optimizer, samples, cfg, 1, 0, device), model, optimizer)
    out["train_micro_batches"] = metrics["num_micro_batches"]
    out["train_received"] = {k: v for k, v in comm.received.items()
                             if k in ("_allgather_base", "_reduce_scatter_base")}

    # the log-probs all at once (logprob_chunk_tokens=0): the head's share of the peak
    unchunked = dataclasses.replace(cfg, logprob_chunk_tokens=0)
    out["train_peak_unchunked"], _, _ = peak_memory(
        lambda: rl.train_step(model, optimizer, samples, unchunked, 2, 0, device), model, optimizer)

    # the weight sync's gather: every tensor as the engine receives it
    dtype = getattr(torch, cfg.rollout.dtype)
    comm = CommMeter()
    with comm, torch.no_grad():
        for _ in full_weights(model, dtype):
            pass
    out["weight_sync_received"] = comm.total()

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # as the scripts end (machinery/exits.py): past the interpreter's teardown, where gloo's
    # worker threads can abort a rank after its work is done
    end_process_group()
    leave(0)
