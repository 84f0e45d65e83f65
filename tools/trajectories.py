"""A run's saved trajectories as one offline HTML page: per prompt the whole group (2G), each
trajectory's text, tool calls and outputs, reward, tool errors, RoC's choice and why, its
advantage; filters and a search box that need no server; several runs side by side.

    python -m tools.trajectories runs/tiny-rl                     # the newest saved step
    python -m tools.trajectories runs/tiny-rl step=all            # every saved step
    python -m tools.trajectories runs/arm-roc runs/arm-grpo step=6 out=/tmp/arms.html

It reads what rl.py saved (save_rollouts_every) and metrics.jsonl, and writes one file, by default
RUN/trajectories.html. Reading the page: docs/design.md (The trajectories page).
"""
import dataclasses
import gzip
import json
import time
import zlib
from pathlib import Path

from grpo_roc import PENALTY_OFFSET, filter_groups, roc_penalty
from reward import extract_answer
from machinery.config import (ConfigError, NonNegativeInt, atomic_write_text, load_config,
                              read_records, resolve)
from machinery.exits import run_script, shown
from machinery.saved_rollouts import chosen_steps, rank_files, step_dir, step_meta

TEMPLATE = Path(__file__).with_name("trajectories.html")
# The saved fields a page shows; the token lists (prompt_ids, response_ids, loss_mask, logprobs)
# are for tools.replay and stay out of the page, as they are most of a saved step's bytes.
SHOWN_FIELDS = ("sample_index", "reward", "selected", "advantage", "penalty", "response_tokens",
                "num_tool_calls", "num_tool_errors", "num_turns", "stop_reason", "truncated",
                "response_text", "tool_calls")
TOKENS_KEY = ', "prompt_ids": '
METRIC_KEYS = ("accuracy", "tool_error_ratio_in_correct", "selected", "trajectories", "groups",
               "roc_penalty_positives", "roc_penalty_kept_positives", "loss", "time/step")


@dataclasses.dataclass
class PageConfig:
    """The page's keys; the run directories come first on the command line."""
    runs: str = ""        # run directories, comma-separated (or first, space-separated)
    step: str = "0"       # the saved step(s): N, N,M,... or all; 0 = the newest
    # prompts (groups) per step on the page, 0 = all; at the paper's 512 x 32 a step is ~0.5 GB
    # of text, more than a browser holds, so the page shows the first ones and says so
    groups: NonNegativeInt = 64
    out: str = ""         # the page; "" = RUN/trajectories.html of the first run

    def validate(self):
        if not self.runs:
            raise ConfigError("runs: no run directory; python -m tools.trajectories RUN [RUN ...]")


def parse(argv):
    runs = []
    while argv and "=" not in argv[0] and not argv[0].startswith("-"):
        runs.append(argv.pop(0))
    return load_config(PageConfig, [f"runs={','.join(runs)}"] * bool(runs) + argv, doc=__doc__)


def read_groups(run_dir, step, enough):
    """(step.json, {position: [records sorted by sample_index]}) of one saved step, the rank
    files read until enough(groups); a torn or damaged file is refused."""
    folder, groups = step_dir(run_dir, step), {}
    meta = step_meta(folder)
    for path in rank_files(folder, meta):
        if enough(groups):
            break
        try:
            with gzip.open(path, "rt", encoding="utf-8") as lines:
                for line in lines:
                    # the token lists come last in a record (saved_rollouts.TRAJECTORY_FIELDS) and
                    # are most of its bytes: parsed only up to them; inside a JSON string a quote
                    # is escaped, so this text is the key
                    record = json.loads(line.split(TOKENS_KEY, 1)[0] + "}")
                    groups.setdefault(record["position"], []).append(
                        {**{k: record[k] for k in SHOWN_FIELDS}, "id": record["id"],
                         "problem": record["problem_text"], "gold": record["answer"],
                         "errors_by_kind": {k: v for k, v in
                                            record["tool_errors_by_kind"].items() if v},
                         "answer_read": extract_answer(record["model_text"]),
                         "split": penalty_parts(record, meta["config"])})
        except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError,
                KeyError) as e:
            raise ConfigError(f"{path}: torn or damaged ({type(e).__name__}: {e}); rerun the "
                              "step or view another") from None
    for group in groups.values():
        group.sort(key=lambda r: r["sample_index"])
    return meta, groups


def penalty_parts(record, config):
    """(p_err, p_format) of Eq. 4-5 from the saved counts, as rl.py computed the penalty."""
    counts = (record["num_tool_calls"], record["num_tool_errors"], record["num_answer_tags"],
              max(record["num_turns"], 1))
    return [roc_penalty(*counts, config["roc_error_ratio"], False),
            roc_penalty(*counts, False, config["roc_answer_format"])]


def reasons(group, config):
    """Why each trajectory of a group was kept or dropped, by the run's rule
    (grpo_roc.select_group), from the saved fields only."""
    keep, rule = config["group_size"], config["positive_rule"]
    kept_groups, _ = filter_groups([[r["reward"] for r in group]])
    if not kept_groups and config["filter_all_equal"]:
        return ["the group's rewards are all equal: no advantage (Eq. 7), group dropped"] * len(
            group)
    if config["algorithm"] == "grpo" or len(group) <= keep:
        return [f"{config['algorithm']}: all {len(group)} of the group kept"] * len(group)
    positives = [r for r in group if r["reward"] > 0]
    negatives = [r for r in group if r["reward"] <= 0]
    weights = sum(1 / (r["penalty"] + PENALTY_OFFSET) for r in positives)
    out = []
    for r in group:
        side = positives if r["reward"] > 0 else negatives
        count = f"{sum(s['selected'] for s in side)} of {len(side)}"
        if r["reward"] <= 0:
            out.append(f"negative: {count} negatives kept, drawn uniformly")
        elif rule == "sample":
            out.append(f"positive: {count} positives kept, drawn by weight 1/(p + "
                       f"{PENALTY_OFFSET}); this one's first-draw chance "
                       f"{1 / (r['penalty'] + PENALTY_OFFSET) / weights:.2f}")
        elif rule == "topk":
            out.append(f"positive: {count} positives kept, the lowest p (ties: the first)")
        else:
            out.append(f"positive: {count} positives kept by rule {rule!r}")
    return out


def step_page(runs, step, limit):
    """The index entry of one step (its runs' metrics and rules, the groups' summaries) and the
    groups' data: a list per group, a cell per run (None where a run lacks the prompt)."""
    first_meta, first = read_groups(runs[0], step, lambda g: limit and len(g) >= limit)
    positions = sorted(first)[:limit or None]
    columns = [(first_meta, first)] + [
        read_groups(run, step, lambda g: all(p in g for p in positions)) for run in runs[1:]]
    index = {"step": step, "runs": [], "groups": []}
    total = first_meta["config"]["prompts_per_step"]
    if len(positions) < total:
        index["cut"] = (f"{len(positions)} of {total} groups shown (groups={limit}; "
                        "groups=0 shows all)")
    for run, (meta, _) in zip(runs, columns):
        row = next((m for m in read_records(run / "metrics.jsonl") if m.get("step") == step), {})
        config = meta["config"]
        index["runs"].append({"name": shown(run), "metrics": {k: row.get(k) for k in METRIC_KEYS},
                              "rule": f"algorithm={config['algorithm']}, positive_rule="
                                      f"{config['positive_rule']}, G={config['group_size']} of "
                                      f"{meta['rollouts_per_prompt']} sampled"})
    data = []
    for position in positions:
        cells = []
        for meta, groups in columns:
            group = groups.get(position)
            if group:
                for record, why in zip(group, reasons(group, meta["config"])):
                    record["reason"] = why
            cells.append(group)
        head = first[position][0]
        index["groups"].append({"position": position, "id": head["id"],
                                "problem": head["problem"], "gold": head["gold"],
                                "cells": [summary(c) for c in cells]})
        data.append(cells)
    return index, data


def summary(group):
    if not group:
        return None
    return {"n": len(group), "correct": sum(r["reward"] > 0 for r in group),
            "kept": sum(r["selected"] for r in group),
            "errors": sum(r["num_tool_errors"] > 0 for r in group)}


def embedded(element_id, value):
    """A JSON script block no text can end or turn into markup: <, > and & as JSON escapes."""
    text = (json.dumps(value, ensure_ascii=False).replace("&", "\\u0026")
            .replace("<", "\\u003c").replace(">", "\\u003e"))
    return f'<script type="application/json" id="{element_id}">{text}</script>\n'


def write_page(cfg):
    """Write the page (atomically); its path and the seconds it took."""
    started = time.perf_counter()
    runs = [resolve(run) for run in cfg.runs.split(",")]
    for run in runs:
        if not run.is_dir():
            raise ConfigError(f"{run}: not a run directory")
    steps = chosen_steps(runs[0], cfg.step, "step")
    blocks, index = [], {"runs": [shown(run) for run in runs], "steps": []}
    for step in steps:
        entry, data = step_page(runs, step, cfg.groups)
        index["steps"].append(entry)
        blocks += [embedded(f"g{step}_{k}", cells) for k, cells in enumerate(data)]
    out = resolve(cfg.out) if cfg.out else runs[0] / "trajectories.html"
    page = TEMPLATE.read_text().replace("<!--DATA-->", embedded("index", index) + "".join(blocks))
    atomic_write_text(out, page)
    seconds = time.perf_counter() - started
    print(f"tools.trajectories: wrote {shown(out)} ({len(page.encode()) / 1e6:.1f} MB, steps "
          f"{', '.join(map(str, steps))}, {seconds:.1f} s); open it in a browser", flush=True)
    return out, seconds


if __name__ == "__main__":
    run_script("tools.trajectories", parse, write_page,
               lambda cfg, argv: "tools.trajectories: interrupted")  # the page: whole or none
