"""A two-rank script ending through machinery.exits.run_script, as sft.py, eval.py and rl.py do:

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/dist_exits.py MODE

MODE `finish`: collectives on temporaries (all_gather_object) up to the end, with an FSDP2-style
DeviceMesh holding the default group past destroy_process_group: the exit that aborted
("terminate called without an active exception") without machinery.exits.leave. MODE `refuse`:
the same, then a ConfigError on every rank, as a refusal after the process group started. MODE
`raise`: the same, then rank 1 raises (RSTAR2_FAULTS, at step 1's "update") while rank 0 waits in
an all-reduce, and an exit handler of rank 1 hangs, as vLLM's engine finalizer can in
destroy_process_group on NCCL. Run by tests/test_exits.py.
"""
import atexit
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from machinery.config import ConfigError
from machinery.distributed import init_distributed
from machinery.exits import reached, run_script

MESH = []  # alive to the end, as a script's FSDP2 model holds its mesh


def run(mode):
    init_distributed()
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
    run_script("dist_exits.py", lambda argv: argv[0], run,
               lambda mode, argv: "dist_exits.py: interrupted")
