"""Measure what plan.py plans, on the real rl.py code: per-rank memory of each phase and the bytes
each collective receives; writes OUT_DIR/rank{R}.json for tests/test_plan.py to compare with the
plan.

    python tests/dist_plan_measure.py MODEL_DIR OUT_DIR [key=value ...]                  # 1 process
    torchrun --standalone --nproc_per_node=2 tests/dist_plan_measure.py MODEL_DIR OUT_DIR
        [key=value ...]

Memory is counted from tensors, never from the process (RSS depends on what the process already
holds): state bytes summed over the local shards, saved activations from torch's FSDPMemTracker,
peaks from PeakMemory and bytes from CommMeter below (bench/scale.py uses them too).
"""
import dataclasses
import json
import random
import sys
import weakref
from pathlib import Path

import torch
from torch.distributed import ProcessGroup
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rl  # noqa: E402
from machinery.checkpoint import load_policy  # noqa: E402
from machinery.config import load_config  # noqa: E402
from machinery.distributed import balance_by_tokens, full_weights, init_distributed  # noqa: E402
from machinery.exits import end_process_group, leave  # noqa: E402
from machinery.training import TrainSample, last_hidden_states, token_logprobs  # noqa: E402


class CommMeter(TorchDispatchMode):
    """Counts, per collective, the bytes this rank receives: every c10d op goes through the
    dispatcher (FSDP2's all-gathers and reduce-scatters, full_tensor(), the object collectives' byte
    tensors), so a dispatch mode sees them all. Received = the logical volume: for an all-gather the
    output less this rank's input, for a reduce-scatter the input less this rank's output, for an
    all-reduce (W-1)/W of the tensor twice (ring), for a broadcast the tensor on every rank but the
    source."""

    def __init__(self):
        super().__init__()
        self.received, self.calls = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":  # DTensor's full_tensor() and redistributions
            name = func.__name__.split(".")[0]
            size = lambda t: t.numel() * t.element_size()  # noqa: E731
            received = {"all_gather_into_tensor": lambda: size(out) - size(args[0]),
                        "reduce_scatter_tensor": lambda: size(args[0]) - size(out)
                        }.get(name, lambda: 0)()
            self.received[name] = self.received.get(name, 0) + received
            self.calls[name] = self.calls.get(name, 0) + 1
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0].rstrip("_")
            self.received[name] = self.received.get(name, 0) + self._received(name, args)
            self.calls[name] = self.calls.get(name, 0) + 1
        return out

    @staticmethod
    def _received(name, args):
        def nbytes(x):
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            return sum(nbytes(y) for y in x) if isinstance(x, (list, tuple)) else 0

        group = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        group = ProcessGroup.unbox(group) if group is not None else None
        world = group.size() if group is not None else 1
        if world == 1:
            return 0
        if name in ("_allgather_base", "allgather", "allgather_into_tensor_coalesced"):
            # the object collectives gather byte tensors padded to the largest
            return nbytes(args[0]) - nbytes(args[1])
        if name in ("_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced"):
            return nbytes(args[1]) - nbytes(args[0])
        if name == "allreduce":
            return int(2 * nbytes(args[0]) * (world - 1) / world)
        if name == "broadcast":
            return 0 if group.rank() == args[2] else nbytes(args[0])
        # output, input, group, output split sizes (rows from each rank), input splits
        if name == "alltoall_base":
            out, splits = args[0], list(args[3])
            row = out[0].numel() * out.element_size() if out.dim() and len(out) else 0
            return ((sum(splits) - splits[group.rank()]) * row if splits
                    else nbytes(out) * (world - 1) // world)
        return nbytes(args[0])

    def total(self):
        return sum(self.received.values())


class PeakMemory(TorchDispatchMode):
    """The most bytes of live tensors while it is active: every storage an op creates or touches is
    followed by a weak reference until it dies, plus the storages of `tracked` (modules' parameters,
    buffers and gradients, optimizers' state, tensors) that exist before. Resizes are followed too
    (FSDP2 frees a gathered layer by resizing its storage to 0). A count of tensors, so it does not
    depend on what the process held before; the same design as torch.distributed._tools.mem_tracker,
    whose MemTracker refuses several forwards of one model (micro-batches). On a GPU,
    torch.cuda.max_memory_allocated measures the same thing (tools/gpu_check.py)."""

    def __init__(self, *tracked):
        super().__init__()
        self.sizes, self.current, self.peak = {}, 0, 0
        for obj in tracked:
            tensors = (list(obj.parameters()) + list(obj.buffers())
                       + [p.grad for p in obj.parameters()]
                       if isinstance(obj, torch.nn.Module) else
                       [t for state in obj.state.values() for t in state.values()]
                       if isinstance(obj, torch.optim.Optimizer) else [obj])
            for t in tensors:
                self._follow(t)
        self.start = self.current

    def _follow(self, t):
        if not isinstance(t, torch.Tensor):
            return
        for storage in get_untyped_storages(t):
            key = id(storage)
            if key in self.sizes:
                continue
            self.sizes[key] = (weakref.ref(storage, lambda _, key=key: self._free(key)),
                               storage.nbytes())
            self._grow(storage.nbytes())

    def _free(self, key):
        self._grow(-self.sizes.pop(key)[1])

    def _grow(self, delta):
        self.current += delta
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor first turns into ops on local shards, which are counted
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves((out, args, kwargs)):
            self._follow(t)
        return out

    def __enter__(self):
        resize, meter = torch.UntypedStorage.resize_, self

        def resized(storage, size):
            resize(storage, size)
            entry = meter.sizes.get(id(storage))
            if entry is not None and entry[0]() is storage and entry[1] != storage.nbytes():
                meter.sizes[id(storage)] = (entry[0], storage.nbytes())
                meter._grow(storage.nbytes() - entry[1])

        self._resize, torch.UntypedStorage.resize_ = resize, resized
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


def peak_memory(fn, *tracked):
    """(peak bytes of live tensors while fn() runs, bytes at its start, fn's result)."""
    meter = PeakMemory(*tracked)
    with meter:
        result = fn()
    return meter.peak, meter.start, result


def tensor_bytes(tensors):
    """Bytes of the distinct storages behind `tensors` (local shards for DTensors)."""
    seen = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def full_sample(tokens, vocab, seed):
    """One trajectory of exactly `tokens` tokens: a micro-batch at micro_batch_tokens, no
    padding."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(16)]
    response = [rng.randrange(3, vocab) for _ in range(tokens - 16)]
    sample = TrainSample(prompt, response, [1] * len(response), advantage=1.0 if seed % 2 else -1.0)
    sample.old_logprobs = [-8.0] * len(response)
    return sample


def peak_and_comm(model, optimizer, fn):
    comm = CommMeter()
    with comm:
        peak, _, result = peak_memory(fn, model, optimizer)
    return peak, comm, result


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
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        tracker = FSDPMemTracker(model, optimizer)
        with tracker:
            hidden = last_hidden_states(model, input_ids)
            out[f"saved_checkpointing_{checkpointing}"] = (
                tracker.get_tracker_snapshot("current")[device][_FSDPRefType.ACT])
        del hidden
    if not cfg.activation_checkpointing:
        model.gradient_checkpointing_disable()

    # the training step: a first one creates AdamW's moments, the second is the steady state
    # that is measured
    # two micro-batches: the second runs with the first one's gradients resident, the plan's case
    samples = [full_sample(tokens, vocab, 100 + rank), full_sample(tokens, vocab, 200 + rank)]
    rl.train_step(model, optimizer, samples, cfg, 0, 0, device)
    out["adam"] = tensor_bytes(t for state in optimizer.state.values() for t in state.values()
                                    if t.dim())
    out["train_peak"], comm, metrics = peak_and_comm(
        model, optimizer, lambda: rl.train_step(model, optimizer, samples, cfg, 1, 0, device))
    out["train_micro_batches"] = metrics["num_micro_batches"]
    out["train_received"] = {k: v for k, v in comm.received.items()
                             if k in ("_allgather_base", "_reduce_scatter_base")}

    # the same step with the log-probs computed all at once (logprob_chunk_tokens=0): the head's
    # share of the peak
    unchunked = dataclasses.replace(cfg, logprob_chunk_tokens=0)
    out["train_peak_unchunked"], _, _ = peak_and_comm(
        model, optimizer, lambda: rl.train_step(model, optimizer, samples, unchunked, 2, 0, device))

    # the weight sync's gather: every tensor as the engine receives it
    dtype = getattr(torch, cfg.rollout.dtype) if cfg.rollout.dtype != "auto" else torch.float32
    comm = CommMeter()
    with comm, torch.no_grad():
        for _ in full_weights(model, dtype):
            pass
    out["weight_sync_received"] = comm.total()

    # the balance: rank 0 holds most trajectories, so some must move; what arrives is counted
    rng = random.Random(7 + rank)
    mine = [TrainSample([rng.randrange(3, vocab) for _ in range(8)],
                        [rng.randrange(3, vocab) for _ in range(n)],
                        [1] * n, 0.5, engine_logprobs=[-rng.random() for _ in range(n)],
                        problem_index=i, sample_index=rank)
            for i, n in enumerate([40, 300, 120, 90, 60, 200] if rank == 0 else [50])]
    comm = CommMeter()
    with comm:
        kept, traffic = balance_by_tokens(mine)
    arrived = [s for s in kept if s.sample_index != rank]
    out.update(balance_received=comm.received, balance_traffic=traffic,
               balance_arrived=[(len(s.prompt_ids), len(s.response_ids)) for s in arrived],
               vocab=vocab)
    counts = torch.tensor([len(mine)])
    torch.distributed.all_reduce(counts)
    out["balance_trajectories"] = int(counts)
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
