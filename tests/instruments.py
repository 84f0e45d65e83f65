"""The bytes this rank receives in every collective, and the peak bytes of live tensors, counted
from tensors, never from RSS (tests/dist_plan_measure.py, bench/scale.py)."""
import weakref

import torch
from torch.distributed import ProcessGroup
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class CommMeter(TorchDispatchMode):
    """Bytes this rank receives per collective, the logical volume: every c10d op (FSDP2's,
    full_tensor(), the object collectives' byte tensors) goes through the dispatcher."""

    def __init__(self):
        super().__init__()
        self.received = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":  # DTensor's full_tensor() and redistributions
            name = func.__name__.split(".")[0]
            size = lambda t: t.numel() * t.element_size()  # noqa: E731
            received = {"all_gather_into_tensor": lambda: size(out) - size(args[0]),
                        "reduce_scatter_tensor": lambda: size(args[0]) - size(out)
                        }.get(name, lambda: 0)()
            self.received[name] = self.received.get(name, 0) + received
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0].rstrip("_")
            self.received[name] = self.received.get(name, 0) + self._received(name, args)
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
        if name == "allreduce":  # a ring: (W-1)/W of the tensor twice
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
    """The most bytes of live tensors while active: each storage an op creates or touches, followed
    by a weak reference until it dies, and resized (FSDP2 frees a gathered layer by resizing it to
    0), plus those of `tracked` (modules, optimizers, tensors). torch's own MemTracker refuses
    several forwards of one model (micro-batches)."""

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
