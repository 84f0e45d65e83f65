"""eval.py's results directory: samples.jsonl (a line per sample, appended per chunk: the resume
point), generation.json (the settings its samples were made with), config.yaml, summary.json and
summary.md."""
import dataclasses
import json
import os
import re
from pathlib import Path

import torch.distributed as dist

from machinery.config import (ConfigError, atomic_write_text, flatten_config, read_records,
                              save_config)
from machinery.run_dir import ROLLOUT_RESOURCE_FIELDS, hold_lease, take_lock

# Problems per generate() of an evaluation; rl.py's held-out evaluation takes the same chunks, so
# its sampling seeds (seed, chunk, problem, sample) are eval.py's.
CHUNK_PROBLEMS = 64


def generation_settings(model_path, cfg):
    """Everything that decides what a sample is and its grade: finished samples are reused only
    when it matches (benchmarks and limit only add problems)."""
    return {"model": str(Path(model_path).resolve()), "n": cfg.n, "seed": cfg.seed,
            "require_answer_tag": cfg.require_answer_tag,
            # how fast, not what: the resource fields may change between run and resume
            "rollout": {k: v for k, v in dataclasses.asdict(cfg.rollout).items()
                        if k not in ROLLOUT_RESOURCE_FIELDS}}


def open_samples(out_dir, settings, n, resume):
    """The finished problems in out_dir/samples.jsonl: {(benchmark, problem id): its n records};
    {} for a fresh run. A torn line and an unfinished problem's samples are dropped: that problem
    is generated again, whole."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # One writer: two evaluations appending to one samples.jsonl would interleave their lines
    take_lock(out_dir)
    samples_path, settings_path = out_dir / "samples.jsonl", out_dir / "generation.json"
    if not resume or not samples_path.exists():
        # generation.json is written first and only here, so it holds for every record after.
        atomic_write_text(samples_path, "")
        atomic_write_text(settings_path, json.dumps(settings, indent=1))
        return {}

    saved = json.loads(settings_path.read_text()) if settings_path.exists() else None
    if saved != settings:
        old, new = flatten_config(saved or {}), flatten_config(settings)
        changed = ([k for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
                   if saved else ["generation.json is missing"])
        # Not "resume=false": that would delete another experiment's samples to make room.
        raise ConfigError(f"out_dir={out_dir}: other settings ({', '.join(changed)}); use another")

    groups = {}
    for record in read_records(samples_path):  # a line cut off mid-write: dropped, with a warning
        key = (record["benchmark"], record["problem_id"])
        groups.setdefault(key, {})[record["sample_index"]] = record
    finished = {key: [by_index[j] for j in range(n)] for key, by_index in groups.items()
                if sorted(by_index) == list(range(n))}

    # Rewrite only when something was dropped: the common resume leaves the file untouched.
    kept = [json.dumps(r) for records in finished.values() for r in records]
    text = samples_path.read_text(encoding="utf-8", errors="replace")
    if len(kept) != sum(1 for line in text.splitlines() if line.strip()) or (
            text and not text.endswith("\n")):  # the next append would join the last line
        atomic_write_text(samples_path, "".join(line + "\n" for line in kept))
    return finished


def work_left(model_path, problems, cfg, out_dir, rank, world_size):
    """(the finished problems on rank 0: {(benchmark, id): records}, the (benchmark, row) pairs
    left on every rank). Rank 0 alone reads out_dir: no shared filesystem is assumed."""
    finished, refusal = {}, None
    if out_dir is not None and rank == 0:
        try:
            finished = open_samples(out_dir, generation_settings(model_path, cfg), cfg.n,
                                    cfg.resume)
            # only once out_dir took this evaluation: a refused one leaves another's config.yaml
            save_config(cfg, out_dir)
        except ConfigError as e:  # every rank raises it: all stop at once, rank 0 prints it
            refusal = str(e)
        except OSError as e:  # a read-only filesystem, a directory of another user
            refusal = f"out_dir={out_dir}: {e.strerror}: {e.filename}; choose a writable one"

    done = [set(finished), refusal]
    if world_size > 1:
        dist.broadcast_object_list(done, src=0)
    if done[1]:
        raise ConfigError(done[1])

    todo = [(name, row) for name, rows in problems.items() for row in rows
            if (name, row["id"]) not in done[0]]
    if rank == 0:
        total = sum(len(rows) for rows in problems.values())
        resumed = f", {total - len(todo)} already in {out_dir}" if total > len(todo) else ""
        print(f"[eval] {total} problems x {cfg.n} samples{resumed}; {len(todo)} to generate on "
              f"{world_size} rank(s)", flush=True)
    return finished, todo


def gather_records(chunk, records, rank, world_size):
    """Every rank's records of one chunk on rank 0 ([] elsewhere), one per sample, in work-list
    order."""
    if world_size > 1:
        parts = [None] * world_size if rank == 0 else None
        dist.gather_object(records, parts, dst=0)
        if rank != 0:
            return []
        records = [r for part in parts for r in part]
    # The ranks of a tensor-parallel group share an engine, and may all report its samples.
    order = {(name, row["id"]): i for i, (name, row) in enumerate(chunk)}
    unique = {(r["benchmark"], r["problem_id"], r["sample_index"]): r for r in reversed(records)}
    return sorted(unique.values(),
                  key=lambda r: (order[(r["benchmark"], r["problem_id"])], r["sample_index"]))


def append_samples(out_dir, records):
    """Append whole problems to samples.jsonl, then fsync: what is on disk survives a kill."""
    hold_lease(out_dir)  # renewed by the eval's progress; an eval taken over writes no more
    with open(Path(out_dir) / "samples.jsonl", "a", encoding="utf-8") as f:
        # One write: a kill leaves at most one torn last line, which open_samples drops.
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def write_summary(out_dir, model_path, summary):
    """summary.json (every metric) and summary.md (the table), each replaced whole."""
    hold_lease(out_dir)
    atomic_write_text(Path(out_dir) / "summary.json", json.dumps(
        {"model": str(model_path), "benchmarks": summary}, indent=1))
    atomic_write_text(Path(out_dir) / "summary.md", markdown_table(summary) + "\n")


def markdown_table(summary):
    """The per-benchmark table, scores in percent as in the paper's Table 3."""
    def percent(x):
        return "-" if x is None else f"{100 * x:.1f}"

    ks = sorted({int(key.split("@")[1]) for m in summary.values() for key in m
                 if re.fullmatch(r"pass@\d+", key)})
    # pass@1 gets its own column with the spread over runs; of maj@k only the largest k is shown,
    # the rest are in summary.json.
    pass_columns = [k for k in ks if k > 1]
    maj = max(ks) if ks else 1
    header = (["benchmark", "problems", "n", "avg pass@1"] + [f"pass@{k}" for k in pass_columns]
              + [f"maj@{maj}", "response tokens", "tool calls/traj", "tool-error rate",
                 "truncated", "ungraded"])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for name, m in summary.items():
        row = [name, str(m["problems"]), str(m["n"]),
               f"{percent(m['pass@1'])} ± {percent(m['pass@1_std'])}"]
        row += [percent(m.get(f"pass@{k}")) for k in pass_columns]
        row += [percent(m.get(f"maj@{maj}")), f"{m['response_tokens']:.0f}",
                f"{m['tool_calls_per_trajectory']:.2f}", percent(m["tool_error_rate"]),
                percent(m["truncated_rate"]), str(m.get("ungraded", 0))]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def default_out_dir(model_path):
    """runs/eval/<parent>-<name> of the model directory: one per model."""
    model_path = Path(model_path)
    return str(Path("runs/eval") / f"{model_path.parent.name}-{model_path.name}".strip("-"))
