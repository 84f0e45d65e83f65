"""The rollout phase at the paper's scale, simulated by machinery/tail.py with rollout.Rollouts' own
admit() and claim_group() at each stage config's K (machinery.plan.engine_memory); a simulation of
claims, not a timing, so the machine's load does not enter.

    python -m bench.tail                                  # the tail per claiming rule; ~10 s
    python -m bench.tail part=regroup gpus=H100-80GB,H200 # who owns a split group; ~7 s

part=tail: the slowest engine's phase, the fastest one's wait for it (the tail), the engines' time
waiting, per claiming rule and case (machinery.tail.rollout_tails), against whole-group claims:
whole (a problem's 2G samples together), parts (of at most K), samples (rollout.py: one at a time
when 2G > K). part=regroup: where 2G > K, per rank the groups it owns (grades, selects, saves) and
the bytes it receives in regroup's all_to_all, under the lowest rank holding a part (the rule
before) and machinery.distributed.regroup_owner (problem index % world).
"""
import dataclasses
import statistics
import sys

from machinery import plan
from machinery.config import REPO, ConfigError, load_config
from machinery.distributed import regroup_owner
from machinery.tail import claims, rollout_tails, spread_lengths
from rl import RLConfig
from rollout import Rollouts, capacity

STAGES = ("configs/stage1.yaml", "configs/stage2.yaml", "configs/stage3.yaml")


@dataclasses.dataclass
class BenchConfig:
    part: str = "tail"              # tail | regroup
    gpus: str = "H100-80GB,H200,MI300X"  # names of machinery.plan.GPUS
    world_size: int = 64
    tensor_parallel_size: int = 1
    gpus_per_node: int = 8
    decode_tok_s: float = 40.0      # plan_decode_tok_s: tokens/s of one sequence

    def validate(self):
        if self.part not in ("tail", "regroup") or set(self.gpus.split(",")) - set(plan.GPUS):
            raise ConfigError(f"part={self.part}, gpus={self.gpus}: expected part tail or regroup "
                             f"and gpus of {', '.join(plan.GPUS)}")


class WholeGroups(Rollouts):
    parts = 1


class PartsOfK(Rollouts):
    @property
    def parts(self):
        return -(-self.n // capacity(self.engine, self.cfg))


def compare_rules(config, cfg, k, engines, per_node):
    n, budget = cfg.rollouts_per_prompt, cfg.rollout.max_response_tokens
    results = {rule: rollout_tails(cls, engines, k, cfg.prompts_per_step, n, budget,
                                   config.decode_tok_s, per_node)
               for rule, cls in {"whole": WholeGroups, "parts": PartsOfK,
                                 "samples": Rollouts}.items()}
    print(f"  {'case':12s}{'rule':9s}{'phase':>8s}{'x':>7s}{'tail':>8s}{'x':>7s}{'waiting %':>11s}")
    for case, base in results["whole"].items():
        for rule, result in results.items():
            r = result[case]
            ratios = [f"{r[key] / base[key]:7.2f}" if base[key] else f"{'-':>7s}"
                      for key in ("phase", "tail")]
            print(f"  {case:12s}{rule:9s}{r['phase'] / 60:8.1f}{ratios[0]}{r['tail'] / 60:8.1f}"
                  f"{ratios[1]}{100 * r['idle']:11.1f}")


def compare_owners(config, cfg, k, shape):
    n, budget, problems = (cfg.rollouts_per_prompt, cfg.rollout.max_response_tokens,
                           cfg.prompts_per_step)
    if n <= k:  # rollout.generate regroups only when a group is larger than K
        print("  2G <= K: whole groups are claimed, each stays where it ran (no regroup)")
        return
    world, size = config.world_size, plan.pickled_trajectory_bytes(
        cfg.rollout.max_prompt_tokens, budget, shape.vocab)
    lengths = spread_lengths(problems, n, budget)
    holders = {}  # problem -> {rank: samples of it held there}
    for rank, (_, groups) in enumerate(claims(Rollouts, world, k, problems, n,
                                              lambda p, s: lengths[p][s] / config.decode_tok_s)):
        for problem, samples in groups.items():
            holders.setdefault(problem, {})[rank] = len(samples)
    print(f"  {size / 1e3:.0f} KB a trajectory; a group's parts on "
          f"{statistics.fmean(map(len, holders.values())):.1f} ranks on average\n"
          f"  {'rule':17s}{'groups: rank 0':>15s}{'max':>6s}{'min':>6s}{'node 0':>8s}"
          f"{'MiB: rank 0':>13s}{'max':>8s}{'mean':>8s}")
    for rule, owner in {"lowest holder": lambda p: min(holders[p]),
                        "problem % world": lambda p: regroup_owner(p, world)}.items():
        groups, mib = [0] * world, [0.0] * world
        for problem, held in holders.items():
            groups[owner(problem)] += 1
            mib[owner(problem)] += size * sum(c for r, c in held.items() if r != owner(problem))
        mib = [b / 2**20 for b in mib]
        print(f"  {rule:17s}{groups[0]:15d}{max(groups):6d}{min(groups):6d}"
              f"{sum(groups[:config.gpus_per_node]):8d}{mib[0]:13.1f}{max(mib):8.1f}"
              f"{statistics.fmean(mib):8.1f}")


def bench(config):
    tp = config.tensor_parallel_size
    engines, per_node = config.world_size // tp, max(1, config.gpus_per_node // tp)
    print(f"{config.world_size} ranks, tensor_parallel_size={tp}: {engines} engines, {per_node} "
          f"per node; {config.decode_tok_s} tokens/s per sequence; minutes, x = against 'whole'")
    shape = plan.ModelShape.from_config(REPO / "configs/models/Qwen3-14B-Base.json")
    for stage in STAGES:
        cfg = load_config(RLConfig, [stage, f"rollout.tensor_parallel_size={tp}"])
        for gpu in config.gpus.split(","):
            k = plan.engine_memory(shape, cfg.rollout, plan.GPUS[gpu])["K"]
            print(f"\n{stage} on {gpu}: K = {k}, 2G = {cfg.rollouts_per_prompt}, "
                  f"{cfg.prompts_per_step} prompts, budget {cfg.rollout.max_response_tokens} "
                  "tokens")
            if config.part == "tail":
                compare_rules(config, cfg, k, engines, per_node)
            else:
                compare_owners(config, cfg, k, shape)


if __name__ == "__main__":
    bench(load_config(BenchConfig, sys.argv[1:]))
