"""torchrun check of rollout.balance_by_tokens: the split it computes from the gathered keys is the
split of all the trajectories (rollout.split_by_tokens, as every rank computed it when the
trajectories themselves were gathered), and the bytes a rank receives are exactly the pickled
trajectories that change rank, nothing else.

    torchrun --standalone --nproc_per_node=2 tests/dist_balance.py

Rank 0 holds most of the work, as after dynamic prompt claiming on a fast rank. No model, no engine.
Exits non-zero on any failure; prints one summary line per rank. Run by
tests/test_rollout.py::test_torchrun_balance_moves_only_
the_trajectories_that_change_rank.
"""
import os
import pickle
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist

import rollout
from machinery.distributed import balance_by_tokens, init_distributed, split_by_tokens
from machinery.exits import end_process_group, leave


def trajectories_of(rank, count):
    rng = random.Random(rank)
    out = []
    for i in range(count):
        response = rng.randint(20, 400)
        t = rollout.Trajectory(rank * 100 + i // 2, i % 2, [1] * rng.randint(5, 30),
                               [2] * response, [1] * response, [-0.5] * response)
        # a trajectory carries its text too: it weighs what it weighs in training
        t.response_text = "x" * response
        out.append(t)
    return out


def check(mine, rank, world_size):
    # the reference: every trajectory everywhere (the old all-gather), split the same way on every
    # rank
    parts = [None] * world_size
    dist.all_gather_object(parts, mine)
    expected = split_by_tokens([t for part in parts for t in part], world_size)[rank]
    share, traffic = balance_by_tokens(mine)
    assert share == expected, (f"rank {rank}: the share differs from split_by_tokens over all "
                               "trajectories")
    # what must have arrived: from each other rank, its trajectories in this share, in its order,
    # pickled
    keys = {(t.problem_index, t.sample_index) for t in share}
    moved = [[t for t in part if (t.problem_index, t.sample_index) in keys] for part in parts]
    expected_bytes = sum(len(pickle.dumps(batch)) for source, batch in enumerate(moved)
                         if source != rank and batch)
    assert traffic["received_bytes"] == expected_bytes, (rank, traffic, expected_bytes)
    gathered_before = sum(len(pickle.dumps(part)) for source, part in enumerate(parts)
                          if source != rank)
    return share, traffic, gathered_before


def main():
    rank, world_size, _, _ = init_distributed()
    mine = trajectories_of(rank, 24 if rank == 0 else 4)
    share, traffic, gathered_before = check(mine, rank, world_size)
    received = [None] * world_size
    dist.all_gather_object(received, traffic["received_bytes"])
    assert sum(received) > 0, received
    # The balanced shares balanced again: nothing changes rank, so nothing but the keys moves.
    again, still = check(share, rank, world_size)[:2]
    assert again == share and still["received_bytes"] == 0, still
    print(f"rank {rank}: balanced {len(mine)} -> {len(share)} trajectories, received "
          f"{traffic['received_bytes']} bytes + "
          f"{traffic['keys_bytes']} of keys (gathering all: {gathered_before}); rebalanced: "
          f"{still['received_bytes']} + {still['keys_bytes']}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # as the scripts end (machinery/exits.py): past the interpreter's teardown, where gloo's
    # worker threads can abort a rank after its work is done
    end_process_group()
    leave(0)
