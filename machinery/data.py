"""Problem files: JSONL rows with a problem and an answer; the benchmarks and training sets in
data/; prompts too long for the budget dropped up front."""
import numpy as np

from machinery.config import ConfigError, read_records, resolve
from machinery.prompts import render_prompt

# The benchmarks eval.py knows, and the files training may read: no training problem is a benchmark
# problem (tests/test_common.py).
BENCHMARKS = {"aime24": "data/aime24.jsonl", "aime25": "data/aime25.jsonl",
              "hmmt25": "data/hmmt_feb_2025.jsonl", "amc23": "data/amc23.jsonl",
              "math500": "data/math500.jsonl", "gsm8k": "data/gsm8k_test.jsonl"}

# Multiple-choice sets in data/ (machinery/choices.py); GPQA-Diamond is gated: given by its path.
SCIENCE_BENCHMARKS = {"mmlu_science": "data/mmlu_college_science.jsonl"}

TRAINING_FILES = ["data/train_int_mix.jsonl", "data/math_train.jsonl", "data/math_test4500.jsonl",
                  "data/aime_1983_2023.jsonl", "data/gsm8k_train.jsonl"]


def load_jsonl(path, required=()):
    """The rows of a JSONL file, JSON objects whose `required` keys are non-empty strings; any bad
    row, the last too, stops with file:line (a skipped one would silently change the dataset)."""
    path = resolve(path)
    if not path.is_file():
        raise ConfigError(f"data file not found: {path}")
    rows = read_records(path, required, torn_tail=False)
    if not rows:
        raise ConfigError(f"{path}: no rows")
    return rows


def load_problems(path):
    """Math problems: rows with a non-empty string id, problem and answer; ids unique."""
    rows, seen = load_jsonl(path, required=("id", "problem", "answer")), set()
    for row in rows:
        if row["id"] in seen:
            raise ConfigError(f"{resolve(path)}: duplicate id {row['id']!r}")
        seen.add(row["id"])
    return rows


def drop_long_prompts(rows, tokenizer, rollout_cfg, name):
    """The problems whose prompt fits rollout.max_prompt_tokens, the rest dropped and counted up
    front (as the rStar verl fork filters)."""
    kept = [r for r in rows
            if len(render_prompt(tokenizer, r["problem"], rollout_cfg))
            <= rollout_cfg.max_prompt_tokens]
    if len(kept) < len(rows):
        print(f"{name}: dropped {len(rows) - len(kept)} of {len(rows)} problems whose prompt is "
              f"longer than rollout.max_prompt_tokens={rollout_cfg.max_prompt_tokens}", flush=True)
    if not kept:
        raise ConfigError(f"{name}: no problem fits "
                          f"rollout.max_prompt_tokens={rollout_cfg.max_prompt_tokens}")
    return kept


def prompt_indices(num_problems, seed, start, count):
    """Indices of `count` problems from absolute position `start` of an endless stream, a fresh
    permutation per epoch from the seed: a resumed run reads what the uninterrupted one would."""
    out, position = [], start
    while len(out) < count:
        epoch, offset = divmod(position, num_problems)
        order = np.random.default_rng([seed, epoch]).permutation(num_problems)
        take = min(count - len(out), num_problems - offset)
        out.extend(int(i) for i in order[offset:offset + take])
        position += take
    return out


def check_prompt_lengths(todo, tokenizer, rollout_cfg):
    """Every prompt must fit rollout.max_prompt_tokens; found out here, not an hour into the run."""
    limit = rollout_cfg.max_prompt_tokens
    too_long = [f"{name}/{row['id']} ({n} tokens)" for name, row in todo
                if (n := len(render_prompt(tokenizer, row["problem"], rollout_cfg))) > limit]
    if too_long:
        raise ConfigError(f"{len(too_long)} prompt(s) exceed rollout.max_prompt_tokens={limit}: "
                          f"{', '.join(too_long[:5])}; raise it")
