"""tests/test_exits.py's ranks, ending through machinery.exits.run_script as the scripts do:
`RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/dist_exits.py MODE`.
finish: collectives, and a DeviceMesh holding the group past its destroy; refuse: then a ConfigError
on every rank; raise: then rank 1 raises (RSTAR2_FAULTS) while rank 0 waits in an all-reduce, and
an exit handler hangs. `steps OUT [skip_prompts=A,B]` under torchrun: five steps kept as rl.py keeps
them (crash_loop, WHERE, a 6 s heartbeat), resumed from OUT/steps.txt; CRASHING_PROMPT crashes
rank 1 as a prompt can crash the verifier.
"""
import atexit
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from machinery.config import ConfigError
from machinery.distributed import init_distributed
from machinery.exits import WHERE, crash_loop, forget_where, reached, run_script, watch_progress

MESH = []  # alive to the end, as a script's FSDP2 model holds its mesh


def steps(out, skip_prompts):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    box = [crash_loop(out / "in_flight", skip_prompts) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ConfigError(box[0])
    WHERE["record"] = out / "in_flight" / f"rank{rank}.json"
    watch_progress(dist.distributed_c10d._get_default_store(), rank, world_size, 6, "dist_exits.py")
    log = out / "steps.txt"
    for step in range(len(log.read_text().split()) + 1 if log.exists() else 1, 6):
        WHERE["prompts"] = [p for p in (10 * step, 10 * step + 1) if p not in skip_prompts]
        reached("rollout", step=step)  # RSTAR2_FAULTS may stop rank 1 here
        if rank == 1 and int(os.environ.get("CRASHING_PROMPT", -1)) in WHERE["prompts"]:
            raise RuntimeError("prompt 21 crashed the verifier")
        time.sleep(0.5)
        dist.all_reduce(torch.ones(1))
        if rank == 0:
            with open(log, "a") as steps_done:
                steps_done.write(f"{step}\n")
        dist.barrier()
    forget_where()


def run(mode):
    init_distributed()
    if mode[0] == "steps":
        return steps(Path(mode[1]), [int(p) for arg in mode[2:] for p in arg[13:].split(",")])
    MESH.append(init_device_mesh("cpu", (dist.get_world_size(),)))
    for i in range(30):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"rank": dist.get_rank(), "i": i})
    for _ in range(10):
        dist.all_reduce(torch.ones(1000))
    dist.broadcast_object_list([dist.get_rank()], src=0)  # the last collective, as run_dir's
    if mode == "refuse":
        raise ConfigError("out_dir=/x: refused on every rank")
    if mode == "raise":
        atexit.register(time.sleep, 3600)  # a destroy that never returns
        reached("update", step=1)  # rank 1 raises here
        dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1
    print(f"rank {dist.get_rank()}: done", flush=True)


if __name__ == "__main__":
    run_script("dist_exits.py", lambda argv: argv[0] if len(argv) == 1 else argv, run,
               lambda mode, argv: "dist_exits.py: interrupted")
