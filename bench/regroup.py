"""Who owns a regrouped group: the lowest rank holding a part of it (rollout.py before this
benchmark) against machinery.distributed.regroup_owner (problem index % world), at the stage
configs' K on GPUs where 2G > K, so that rollout.py claims a group's samples one at a time:

    python -m bench.regroup                  # stages 1-3 on H100-80GB, 64 ranks, TP 1; ~10 s
    python -m bench.regroup gpus=H100-80GB,H200 world_size=64

rollout.Rollouts' own admit() and claim_group() are driven by machinery.tail.claims (the claim
order a cluster would see: one counter, every engine's trajectory ends in one event queue), with
lengths U[0.2, 1] x the budget. From the parts each rank holds, each rule gives per rank: the groups
it owns (it grades, selects and saves them: rl.py's steps 3-4) and the bytes it receives in
regroup's all_to_all (the trajectories of its groups held elsewhere, at mode=plan's pickled size of
a full-length trajectory, machinery.plan.pickled_trajectory_bytes). A simulation of claims, not a
timing: the machine's load does not enter. The owner changes no number of the step (regroup's
docstring; tests/test_distributed.py compares 1 rank, 2 ranks and 2 nodes)."""
import dataclasses
import statistics
import sys

from machinery import plan
from machinery.config import REPO, load_config
from machinery.distributed import regroup_owner
from machinery.tail import claims, spread_lengths
from rl import RLConfig
from rollout import Rollouts

STAGES = ("configs/stage1.yaml", "configs/stage2.yaml", "configs/stage3.yaml")


@dataclasses.dataclass
class BenchConfig:
    gpus: str = "H100-80GB"          # names of machinery.plan.GPUS
    world_size: int = 64
    gpus_per_node: int = 8
    decode_tok_s: float = 40.0       # plan_decode_tok_s: tokens/s of one sequence


def lowest_holder(holders, problem, world_size):
    """The rule before: the lowest rank that holds part of the group."""
    return min(holders[problem])


def by_problem_index(holders, problem, world_size):
    return regroup_owner(problem, world_size)


RULES = {"lowest holder": lowest_holder, "problem % world": by_problem_index}


def ownership(parts, rule, world_size, trajectory_bytes):
    """parts[rank] = {problem: samples held there} -> (groups owned, bytes received) per rank."""
    holders = {}
    for rank, groups in enumerate(parts):
        for problem, samples in groups.items():
            holders.setdefault(problem, {})[rank] = len(samples)
    groups, received = [0] * world_size, [0] * world_size
    for problem, held in holders.items():
        owner = rule(holders, problem, world_size)
        groups[owner] += 1
        received[owner] += trajectory_bytes * sum(c for r, c in held.items() if r != owner)
    return groups, received, holders


def bench(config):
    names = config.gpus.split(",")
    unknown = [n for n in names if n not in plan.GPUS]
    if unknown:
        sys.exit(f"bench.regroup: gpus={','.join(unknown)}: not one of {', '.join(plan.GPUS)}")
    world, per_node = config.world_size, config.gpus_per_node
    shape = plan.ModelShape.from_config(REPO / "configs/models/Qwen3-14B-Base.json")
    print(f"{world} ranks (TP 1), {per_node} per node, {config.decode_tok_s} tokens/s per "
          "sequence, lengths U[0.2, 1] x budget; MiB = what a rank receives in regroup")
    for stage in STAGES:
        cfg = load_config(RLConfig, [stage, "rollout.tensor_parallel_size=1"])
        n, budget, problems = (cfg.rollouts_per_prompt, cfg.rollout.max_response_tokens,
                               cfg.prompts_per_step)
        size = plan.pickled_trajectory_bytes(cfg.rollout.max_prompt_tokens, budget, shape.vocab)
        lengths = spread_lengths(problems, n, budget)
        for gpu in names:
            k = plan.engine_memory(shape, cfg.rollout, plan.GPUS[gpu])["K"]
            parts = [groups for _, groups in claims(
                Rollouts, world, k, problems, n,
                lambda p, s: lengths[p][s] / config.decode_tok_s)]
            print(f"\n{stage} on {gpu}: K = {k}, 2G = {n}, {problems} groups over {world} ranks; "
                  f"{size / 1e3:.0f} KB a trajectory")
            if n <= k:  # rollout.generate regroups only when a group is larger than K
                print("  2G <= K: whole groups are claimed, each stays where it ran (no regroup)")
                continue
            print(f"  {'rule':17s}{'groups: rank 0':>15s}{'max':>6s}{'min':>6s}{'node 0':>8s}"
                  f"{'MiB: rank 0':>13s}{'max':>8s}{'mean':>8s}{'rank 0 grades %':>17s}")
            for rule, owner in RULES.items():
                groups, received, holders = ownership(parts, owner, world, size)
                mib = [b / 2**20 for b in received]
                print(f"  {rule:17s}{groups[0]:15d}{max(groups):6d}{min(groups):6d}"
                      f"{sum(groups[:per_node]):8d}{mib[0]:13.1f}{max(mib):8.1f}"
                      f"{statistics.fmean(mib):8.1f}{100 * groups[0] / problems:17.1f}")
            spans = [len(h) for h in holders.values()]
            print(f"  a group's parts on {statistics.fmean(spans):.1f} ranks on average "
                  f"(at most {max(spans)})")


if __name__ == "__main__":
    bench(load_config(BenchConfig, sys.argv[1:]))
