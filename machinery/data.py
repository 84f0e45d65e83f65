"""Problem files: JSONL rows with a problem and an answer, the benchmarks and the training sets in
data/, prompts too long for the budget dropped up front."""
import json
import os
from machinery.config import ConfigError, resolve
from machinery.prompts import render_prompt
from machinery.model import check_model_dir


# The benchmarks eval.py knows, and the files training may read. Training never reads a benchmark file;
# tests/test_common.py checks that no training problem equals a benchmark problem.
BENCHMARKS = {"aime24": "data/aime24.jsonl", "aime25": "data/aime25.jsonl", "hmmt25": "data/hmmt_feb_2025.jsonl",
              "amc23": "data/amc23.jsonl", "math500": "data/math500.jsonl", "gsm8k": "data/gsm8k_test.jsonl"}


TRAINING_FILES = ["data/train_int_mix.jsonl", "data/math_train.jsonl", "data/math_test4500.jsonl",
                  "data/aime_1983_2023.jsonl", "data/gsm8k_train.jsonl"]


def load_jsonl(path, required=None):
    """Read a JSONL file; every row must be a JSON object whose `required` keys are non-empty strings. A bad row
    stops with `file:line: reason`: a silently skipped row is a silently changed dataset (a wrong gold, a wrong reward).
    """
    path = resolve(path)
    if not path.is_file():
        raise ConfigError(f"data file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for key in required or ():
                if key not in row:
                    raise ConfigError(f"{path}:{lineno}: missing key '{key}'")
                if not isinstance(row[key], str) or not row[key].strip():
                    raise ConfigError(f"{path}:{lineno}: '{key}' must be a non-empty string, got {row[key]!r}")
            rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: no rows")
    return rows


def load_problems(path):
    """Math problems: rows with non-empty string id, problem and answer; ids unique within the file."""
    rows = load_jsonl(path, required=("id", "problem", "answer"))
    seen = {}
    for lineno, row in enumerate(rows, 1):
        if row["id"] in seen:
            raise ConfigError(f"{resolve(path)}: duplicate id {row['id']!r} (rows {seen[row['id']]} and {lineno})")
        seen[row["id"]] = lineno
    return rows


def normalize_problem(text):
    """The key under which two problems count as the same: whitespace collapsed."""
    return " ".join(text.split())


def drop_long_prompts(rows, tokenizer, rollout_cfg, name):
    """Problems whose rendered prompt fits rollout.max_prompt_tokens (the rStar verl fork filters long prompts the
    same way); a longer one would stop the run when its step comes, so it is dropped up front and counted."""
    kept = [r for r in rows if len(render_prompt(tokenizer, r["problem"], rollout_cfg)) <= rollout_cfg.max_prompt_tokens]
    if len(kept) < len(rows):
        print(f"{name}: dropped {len(rows) - len(kept)} of {len(rows)} problems whose prompt is longer than "
              f"rollout.max_prompt_tokens={rollout_cfg.max_prompt_tokens}", flush=True)
    if not kept:
        raise ConfigError(f"{name}: no problem fits rollout.max_prompt_tokens={rollout_cfg.max_prompt_tokens}")
    return kept


def check_inputs(cfg, world_size=None):
    """Everything that can be wrong with the inputs, before a model or an engine is loaded:
    torchrun's WORLD_SIZE is read before any process group exists."""
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if cfg.world_size and cfg.world_size != world_size:
        raise ConfigError(f"world_size={cfg.world_size}: this config is written for "
                          f"{cfg.world_size} ranks but was launched on {world_size}; change "
                          "torchrun's --nnodes/--nproc_per_node, or world_size=0")
    tp = cfg.rollout.tensor_parallel_size
    if world_size % tp:
        raise ConfigError(f"rollout.tensor_parallel_size={tp} does not divide the {world_size} "
                          "ranks into engines")
    engines = world_size // tp
    if cfg.mode == "train" and cfg.prompts_per_step < engines:
        raise ConfigError(f"prompts_per_step={cfg.prompts_per_step} is fewer than the {engines} "
                          "engines: some would idle")
    model = check_model_dir(cfg.model)
    problems = load_problems(cfg.filter_source if cfg.mode == "filter" else cfg.train_data)
    eval_rows = load_problems(cfg.eval_data) if cfg.eval_data and cfg.mode == "train" else []
    return model, problems, eval_rows


# The paper's stage 1 is 300 steps x 512 prompts over 42K problems: about 3.7 passes (§4.2, §4.3)
EPOCHS_WARN = 5.0


def epoch_plan(cfg, num_problems, start_step):
    """(passes over train_data this run makes, the line train() prints), a warning past EPOCHS_WARN."""
    prompts = (cfg.steps - start_step) * cfg.prompts_per_step
    epochs = prompts / num_problems
    line = (f"plan: steps {start_step} -> {cfg.steps} x {cfg.prompts_per_step} prompts = "
            f"{prompts:,} prompts over {num_problems:,} problems of {cfg.train_data}: "
            f"{epochs:.1f} epochs")
    if epochs > EPOCHS_WARN:
        line += (f"\nWARNING: {epochs:.1f} passes over the same problems, above {EPOCHS_WARN}; the "
                 "paper's stage 1 makes 3.7 (300 x 512 prompts over 42K problems). Add problems "
                 "(prepare_data.py, README: the paper's data size) or lower steps or "
                 "prompts_per_step.")
    return epochs, line
