"""The rollout tail at the paper's scale: whole-group claims against claims of parts of a group
when 2G > K (rollout.py: single samples), simulated by machinery/tail.py with rollout.Rollouts'
own admit():

    python -m bench.tail                     # stages 1-3, H100, H200 and MI300X, TP 1; ~10 s
    python -m bench.tail gpus=H100-80GB tensor_parallel_size=2 world_size=64

For each stage config and GPU: K as mode=plan computes it (machinery.plan.engine_memory), 512
prompts x 2G = 32 samples over world / TP engines at plan_decode_tok_s per sequence, in three cases
(every response at the budget; lengths U[0.2, 1] x budget; those lengths with one node at half
speed). Printed per rule: the slowest engine's rollout phase (the step waits for it), the fastest
engine's wait for it (the tail), and the share of all engines' time spent waiting; the ratios are
against whole-group claims in the same run. A simulation of claiming order and decode time, not a
timing: it does not depend on the machine's load.

The rules compared (rollout.Rollouts' own claim_group, with its `parts` per group set):
  whole     a problem's 2G samples are claimed together and stay on one engine (rollout.py before
            this benchmark); when 2G > K the last claimer runs them in ceil(2G / K) waves alone.
  parts     ceil(2G / K) parts of at most K samples: each group on few engines.
  samples   rollout.py: one sample per claim when 2G > K. Where 2G <= K, both are one part, the
            whole rule exactly (the tiny demo's path). rollout.generate regroups split groups
            before selection (machinery.distributed.regroup), so GRPO-RoC selects in whole groups.
"""
import dataclasses
import sys

from machinery import plan
from machinery.config import REPO, load_config
from machinery.tail import rollout_tails
from rl import RLConfig
from rollout import Rollouts, capacity

STAGES = ("configs/stage1.yaml", "configs/stage2.yaml", "configs/stage3.yaml")


@dataclasses.dataclass
class BenchConfig:
    gpus: str = "H100-80GB,H200,MI300X"  # names of machinery.plan.GPUS
    world_size: int = 64
    tensor_parallel_size: int = 1
    gpus_per_node: int = 8
    decode_tok_s: float = 40.0      # plan_decode_tok_s: tokens/s of one sequence


class WholeGroups(Rollouts):
    parts = 1


class PartsOfK(Rollouts):
    @property
    def parts(self):
        return -(-self.n // capacity(self.engine, self.cfg))


RULES = {"whole": WholeGroups, "parts": PartsOfK, "samples": Rollouts}


def bench(config):
    names = config.gpus.split(",")
    unknown = [n for n in names if n not in plan.GPUS]
    if unknown:
        sys.exit(f"bench.tail: gpus={','.join(unknown)}: not one of {', '.join(plan.GPUS)}")
    tp = config.tensor_parallel_size
    engines, per_node = config.world_size // tp, max(1, config.gpus_per_node // tp)
    print(f"{config.world_size} ranks, tensor_parallel_size={tp}: {engines} engines, {per_node} "
          f"per node; {config.decode_tok_s} tokens/s per sequence. Minutes; x = against 'whole'")
    shape = plan.ModelShape.from_config(REPO / "configs/models/Qwen3-14B-Base.json")
    for stage in STAGES:
        cfg = load_config(RLConfig, [stage, f"rollout.tensor_parallel_size={tp}"])
        n, budget = cfg.rollouts_per_prompt, cfg.rollout.max_response_tokens
        for gpu in names:
            k = plan.engine_memory(shape, cfg.rollout, plan.GPUS[gpu])["K"]
            print(f"\n{stage} on {gpu}: K = {k}, 2G = {n}, {cfg.prompts_per_step} prompts, "
                  f"budget {budget} tokens")
            print(f"  {'case':12s}{'rule':9s}{'phase':>8s}{'x':>7s}{'tail':>8s}{'x':>7s}"
                  f"{'waiting %':>11s}")
            results = {rule: rollout_tails(cls, engines, k, cfg.prompts_per_step, n, budget,
                                           config.decode_tok_s, per_node)
                       for rule, cls in RULES.items()}
            for case in results["whole"]:
                base = results["whole"][case]
                for rule, result in results.items():
                    r = result[case]
                    ratio = lambda key: (f"{r[key] / base[key]:7.2f}" if base[key]  # noqa: E731
                                         else f"{'-':>7s}")
                    print(f"  {case:12s}{rule:9s}{r['phase'] / 60:8.1f}{ratio('phase')}"
                          f"{r['tail'] / 60:8.1f}{ratio('tail')}{100 * r['idle']:11.1f}")


if __name__ == "__main__":
    bench(load_config(BenchConfig, sys.argv[1:]))
