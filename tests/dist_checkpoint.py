"""Workers of tests/test_run_dir.py's checkpoint and lease tests, each a real process:

    python tests/dist_checkpoint.py write ROOT RANK   one of two gloo ranks: steps 1-3 saved
    python tests/dist_checkpoint.py hold RUN          a run on node-a holding RUN's lease
"""
import fcntl
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from machinery import lock
from machinery.checkpoint import save_checkpoint
from machinery.metrics import MetricsLogger


def write(root, rank):
    """Rank `rank` of two saves steps 1, 2 and 3: DCP shards and each rank's trainer state."""
    dist.init_process_group("gloo", init_method=f"file://{root}.store", rank=rank, world_size=2)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2, 3):
        save_checkpoint(root, step, model, optimizer, {"step": step}, keep=3)


def hold(run):
    """A run on node-a (a lease of 1 s): its row and checkpoint of step 1, then of step 2, each
    once a line comes on stdin (its main loop waits in between, as in a hung collective). Its
    flock is let go at once: on Lustre's localflock it reaches no other node."""
    socket.gethostname = lambda: "node-a"
    lock.LEASE_S, lock.LEASE_RENEW_S, lock.LEASE_MARGIN_S, lock.SETTLE_S = 1.0, 0.1, 0.2, 0.1
    dist.init_process_group("gloo", init_method=f"file://{run}/.store", rank=0, world_size=1)
    lock.take_lock(run)
    fcntl.flock(next(iter(lock._HELD.values()))[0], fcntl.LOCK_UN)
    model = torch.nn.Linear(4, 4)
    optimizer, logger = torch.optim.AdamW(model.parameters()), MetricsLogger(run)
    for step in (1, 2):
        sys.stdin.readline()
        logger.log(step, {"loss": 1.0})
        save_checkpoint(f"{run}/checkpoints", step, model, optimizer, {"step": step})
        print("saved", step, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], int(sys.argv[3]))
    else:
        hold(sys.argv[2])
