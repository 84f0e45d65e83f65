"""Stage-3 data (rStar2-Agent §4.3): sample filter_samples rollouts per problem of filter_source and
keep the problems the policy does not solve every time (the paper: 42K -> 17.3K with 8 samples),
written to train_data, which stage 3 trains on.

    python -m tools.filter_solved configs/stage3.yaml         # or under torchrun: much faster
    torchrun --nproc_per_node=8 -m tools.filter_solved configs/stage3.yaml

The config is rl.py's (the policy in `model`, the rollout settings, prompts_per_step as the chunk
size) plus the filter_* keys below; rollouts, reward and claiming are rl.py's own.
"""
import dataclasses
import json

import torch.distributed as dist
from transformers import AutoTokenizer

from rl import RLConfig, score_groups, start_executor
from rollout import generate
from machinery.checkpoint import check_inputs
from machinery.config import ConfigError, PositiveInt, atomic_write_text, load_config, resolve
from machinery.data import drop_long_prompts
from machinery.distributed import init_distributed, own_groups
from machinery.engine import Engine, configure_vllm_logging
from machinery.exits import rerun_command, run_script


@dataclasses.dataclass
class FilterConfig(RLConfig):
    """rl.py's config for the policy and its rollouts, and what to filter."""
    filter_source: str = "data/train_int_mix.jsonl"  # the problems to filter (stages 1-2's);
                                                     # the kept ones go to train_data
    filter_samples: PositiveInt = 8  # rollouts per problem: "8/8 correct are removed" (§4.3)

    def validate(self):
        super().validate()
        if not self.filter_source:
            raise ConfigError("filter_source: empty; the problems to filter (a JSONL file)")


def filter_solved(cfg):
    """The filter's one pass; returns the kept rows."""
    configure_vllm_logging(cfg.verbose)
    model_path, problems, _ = check_inputs(dataclasses.replace(cfg, train_data=cfg.filter_source,
                                                               eval_data=""))
    rank, world_size, _, _ = init_distributed(cfg.collective_timeout_min)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # Too long to roll out means too long to train on: such problems are not written either.
    problems = drop_long_prompts(problems, tokenizer, cfg.rollout, cfg.filter_source)
    engine = Engine(model_path, cfg.rollout, seed=cfg.seed)
    executor = start_executor(cfg.rollout, engine)
    solved = {}  # one pass in chunks of prompts_per_step, every rank claiming as in training
    for chunk, start in enumerate(range(0, len(problems), cfg.prompts_per_step)):
        rows = problems[start:start + cfg.prompts_per_step]
        groups = generate(engine, executor, tokenizer, [r["problem"] for r in rows],
                          cfg.filter_samples, cfg.rollout, seed=cfg.seed, step=chunk)
        groups = own_groups(groups, len(rows), rank)  # a tensor-parallel group counts it once
        for group, rewards in zip(groups, score_groups(groups, rows)[0]):
            for t, reward in zip(group, rewards):
                key = start + t.problem_index
                solved[key] = solved.get(key, 0) + int(reward > 0)
        if rank == 0:
            print(f"[filter] {min(start + len(rows), len(problems))}/{len(problems)} problems",
                  flush=True)
    parts = [None] * world_size
    dist.all_gather_object(parts, solved)
    solved = {i: c for part in parts for i, c in part.items()}
    # "Problems with 8/8 correct are removed" (§4.3); the rest keep their order and rows
    kept = [row for i, row in enumerate(problems) if solved.get(i, 0) < cfg.filter_samples]
    if rank == 0:
        out = resolve(cfg.train_data)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, "".join(json.dumps(row) + "\n" for row in kept))
        print(f"[filter] kept {len(kept)} of {len(problems)} problems (dropped those solved "
              f"{cfg.filter_samples}/{cfg.filter_samples}) -> {out}", flush=True)
    if executor:
        executor.close()
    engine.close()
    return kept


def interrupt_paragraph(cfg, argv):
    written = cfg.train_data if cfg else "train_data"
    return (f"tools.filter_solved: interrupted; it writes {written} only after the whole pass, "
            f"so it is unchanged. Rerun: {rerun_command('-m tools.filter_solved', argv)}")


if __name__ == "__main__":
    run_script("tools.filter_solved", lambda argv: load_config(FilterConfig, argv, doc=__doc__),
               filter_solved, interrupt_paragraph)
