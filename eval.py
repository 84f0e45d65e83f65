"""Evaluate a checkpoint the paper's way: average pass@1 over n samples per problem (rStar2-Agent §5.1).

    python eval.py configs/eval.yaml model=PATH benchmarks=aime24,aime25 n=16         # one process, one engine
    torchrun --nproc_per_node=8 eval.py configs/eval.yaml model=PATH                  # one node, 8 engines
    torchrun --nnodes=8 --nproc_per_node=8 --node_rank=R --master_addr=HOST --master_port=29500 \\
        eval.py configs/eval.yaml model=PATH                                          # 8 nodes
    python eval.py configs/eval_tiny.yaml model=out/tiny-model                        # CPU: tiny model, arithmetic
    python eval.py configs/eval.yaml model=PATH rollout.use_tool=false                # no tool: plain CoT

Every problem gets n samples from the agent loop training uses (rollout.py: reason, call the Python tool, read
the result, go on, within max_turns and one token budget), graded by reward.py. Per benchmark it reports
  - avg pass@1: the mean over problems of (correct samples / n), the paper's headline number (Table 3),
  - pass@k: the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, "Evaluating LLMs trained on code"),
  - maj@k: is the majority answer of the first k samples correct (self-consistency),
  - mean response tokens (Table 4), tool calls per trajectory and the tool-error rate (Fig. 4's quantity),
as a Markdown table on stdout and in out_dir/summary.md, plus out_dir/summary.json and out_dir/samples.jsonl
(one line per sample: prompt, response, extracted answer, correct, counts). samples.jsonl is also the resume
point: rerun the same command and only the problems it lacks are generated.

Benchmarks: the names in common.BENCHMARKS (aime24, aime25, hmmt25, amc23, math500, gsm8k), `arith` (the tiny
demo's held-out arithmetic, tiny.make_arithmetic_problems(split="test")), or a path to a problems JSONL.
A checkpoint is measured in the format it was trained with (rollout.FORMAT_FILE, saved by sft.py and rl.py; read by
rollout.prompt_variant=auto, the default); a directory without one (the released rStar2-Agent-14B) gets the paper's
prompt. An explicit prompt_variant=code|paper, chat_template or tool_schema wins, with a warning when it differs.

Protocol vs the released eval scripts (rstar2-method.md §8.1): the paper samples at temperature 0.6 with up to
30 turns; the released aime_eval.sh leaves temperature unset (verl's default: greedy) and allows 5 turns.
configs/eval.yaml follows the paper. demo.py and rl.py call evaluate() in-process, with their own engine.
"""
import dataclasses
import difflib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist
from transformers import AutoTokenizer

import tiny  # the demo's task, for the generated `arith` benchmark
from machinery.data import BENCHMARKS, load_problems
from machinery.config import atomic_write_text, ConfigError, load_config, resolve, save_config
from machinery.distributed import init_distributed
from executor import Executor
from reward import extract_answer, fast_equivalent, score_batch  # stdlib only at import; math-verify loads in its workers
from machinery.prompts import AUTO_VARIANT, apply_model_format, render_prompt
from machinery.engine import configure_vllm_logging, Engine
from rollout import generate, RolloutConfig
from machinery.metrics import pass_at_k, sample_metrics, trajectory_record

# Benchmarks that are not files: `arith` is generated on the fly, so the demo and eval agree on it by seed.
GENERATED_BENCHMARKS = ("arith",)


# -----------------------------------------------------------------------------
# config

def _paper_rollout():
    """The agent loop as the paper evaluates it (§5.1): 16 samples at temperature 0.6, up to 30K tokens and 30
    turns. 30720 = 30 x 1024, the released eval scripts' max_response_length. The format: the model's own."""
    return RolloutConfig(prompt_variant=AUTO_VARIANT, temperature=0.6, max_response_tokens=30720, max_turns=30)


@dataclasses.dataclass
class EvalConfig:
    model: str = ""                    # a local Hugging Face directory (weights + tokenizer)
    benchmarks: list[str] = dataclasses.field(default_factory=lambda: ["aime24", "aime25", "hmmt25", "math500"])
    limit: int = 0                     # first `limit` problems of each benchmark (0 = all); cheap smoke runs
    n: int = 16                        # samples per problem (paper §5.1: 16)
    ks: list[int] = dataclasses.field(default_factory=list)  # pass@k / maj@k; empty = 1, 2, 4, ... up to n, and n
    seed: int = 0                      # request seeds derive from (seed, chunk, problem, sample): a rerun reproduces
    out_dir: str = "runs/eval"
    resume: bool = True                # reuse the finished problems in out_dir/samples.jsonl
    chunk_problems: int = 64           # problems per generation call; samples.jsonl is appended after each one
    require_answer_tag: bool = False   # grade only a \boxed{} inside <answer>...</answer> (reward.py)
    reward_timeout_s: float = 5.0      # per-answer math-verify deadline
    arith_problems: int = 100          # size of the `arith` benchmark
    arith_seed: int = 0
    verbose: bool = False              # all of vLLM's logging; default: its warnings (VLLM_LOGGING_LEVEL wins)
    rollout: RolloutConfig = dataclasses.field(default_factory=_paper_rollout)

    def validate(self):
        if not self.model:
            raise ConfigError("model is required: python eval.py configs/eval.yaml model=PATH")
        if not self.benchmarks:
            raise ConfigError(f"benchmarks is empty; choose from {available_benchmarks()}")
        if self.n < 1:
            raise ConfigError(f"n must be >= 1, got {self.n}")
        for k in self.ks:
            if not 1 <= k <= self.n:
                raise ConfigError(f"ks: pass@{k} needs 1 <= k <= n = {self.n}")
        if self.limit < 0:
            raise ConfigError(f"limit must be >= 0 (0 = every problem), got {self.limit}")
        if self.arith_problems < 1:
            raise ConfigError(f"arith_problems must be >= 1, got {self.arith_problems}")
        if self.chunk_problems < 1:
            raise ConfigError(f"chunk_problems must be >= 1, got {self.chunk_problems}")
        self.rollout.validate()


def default_ks(n):
    """1, 2, 4, ... up to n, and n itself: the usual pass@k curve, ending at the full-sample number."""
    # Powers of two because pass@k is roughly linear in log k; n itself because maj@n is the vote over all.
    ks = [2 ** i for i in range(n.bit_length()) if 2 ** i <= n]
    return ks if ks[-1] == n else ks + [n]


# -----------------------------------------------------------------------------
# metrics: pass@k, majority vote, the per-benchmark summary

def majority_vote(answers):
    """Index of the sample whose answer wins a plurality vote (None does not vote; None if nobody votes). Answers
    vote together when reward.fast_equivalent calls them equal ("1,080" = "1080"); math-verify per pair would cost
    more than generating. A tie goes to the answer seen first; the returned sample's `correct` is the vote's."""
    clusters = []  # [representative answer, index of its first sample, votes]
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        # Compare with each cluster's first answer only: k <= n answers, a handful of clusters, microseconds.
        for cluster in clusters:
            if fast_equivalent(answer, cluster[0]) is True:
                cluster[2] += 1
                break
        else:
            clusters.append([answer, i, 1])
    if not clusters:
        return None
    return max(clusters, key=lambda cluster: (cluster[2], -cluster[1]))[1]


def summarize(groups, ks):
    """Metrics of one benchmark from its sample records, grouped by problem: groups[p] = the n records of
    problem p in sample order. Records are dicts as written to samples.jsonl (see sample_records)."""
    if not groups:
        raise ValueError("summarize: no problems")
    n = len(groups[0])
    if any(len(group) != n for group in groups):
        counts = sorted({len(group) for group in groups})
        raise ValueError(f"summarize: every problem needs the same number of samples, got {counts}")
    samples = [record for group in groups for record in group]
    num_correct = [sum(bool(r["correct"]) for r in group) for group in groups]
    metrics = {"problems": len(groups), "n": n}
    # Per problem first, then the mean over problems: every problem weighs the same, as in Table 3.
    # pass@1 here is the paper's "average pass@1 over 16 samples" (§5.1).
    for k in ks:
        metrics[f"pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in num_correct)
    # The paper's number is a mean over n samples; its spread across the n "runs" (sample j of every problem)
    # says how much one run of AIME (30 problems: one problem = 3.3 points) can move.
    per_run = [statistics.fmean(bool(group[j]["correct"]) for group in groups) for j in range(n)]
    metrics["pass@1_std"] = statistics.pstdev(per_run)
    for k in ks:
        # maj@k on the first k samples: samples are i.i.d., so this is an unbiased (if noisier) estimate.
        votes = []
        for group in groups:
            # A truncated sample does not vote: it scored 0 whatever its text holds (§4.3.1), and a half-written
            # box is not an answer the model gave.
            winner = majority_vote([r["answer"] if r["finished"] else None for r in group[:k]])
            votes.append(winner is not None and bool(group[winner]["correct"]))
        metrics[f"maj@{k}"] = statistics.fmean(votes)
    metrics.update(sample_metrics(samples))
    return metrics


def markdown_table(summary):
    """The per-benchmark table, scores in percent as in the paper's Table 3."""
    def percent(x):
        return "-" if x is None else f"{100 * x:.1f}"

    ks = sorted({int(key.split("@")[1]) for m in summary.values() for key in m if re.fullmatch(r"pass@\d+", key)})
    # pass@1 gets its own column with the spread over runs; of maj@k only the largest k is shown, the rest
    # are in summary.json.
    pass_columns = [k for k in ks if k > 1]
    maj = max(ks) if ks else 1
    header = (["benchmark", "problems", "n", "avg pass@1"] + [f"pass@{k}" for k in pass_columns]
              + [f"maj@{maj}", "response tokens", "tool calls/traj", "tool-error rate", "truncated"])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for name, m in summary.items():
        row = [name, str(m["problems"]), str(m["n"]), f"{percent(m['pass@1'])} ± {percent(m['pass@1_std'])}"]
        row += [percent(m.get(f"pass@{k}")) for k in pass_columns]
        row += [percent(m.get(f"maj@{maj}")), f"{m['response_tokens']:.0f}", f"{m['tool_calls_per_trajectory']:.2f}",
                percent(m["tool_error_rate"]), percent(m["truncated_rate"])]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# benchmarks: names, generated sets and files, with errors that list the choices

def available_benchmarks():
    return ", ".join(list(BENCHMARKS) + list(GENERATED_BENCHMARKS)) + ", or a path to a problems .jsonl"


def load_benchmarks(cfg):
    """{benchmark name: problem rows} in the order asked, each cut to the first cfg.limit problems."""
    selected = {}
    for entry in cfg.benchmarks:
        path = resolve(entry)
        # A known name wins over a file of that name in the working directory: "aime24" always means the same set.
        if entry in BENCHMARKS:
            name, rows = entry, load_problems(BENCHMARKS[entry])
        elif entry == "arith":
            # split="test" has its own random stream (tiny.py seeds by split): the demo trains on split="train".
            name, rows = entry, tiny.make_arithmetic_problems(cfg.arith_problems, cfg.arith_seed, split="test")
        elif entry.endswith(".jsonl") or path.is_file():
            # Named by the file's stem, the key of its samples in samples.jsonl and of its row in the table.
            name, rows = Path(entry).stem, load_problems(entry)  # load_problems says file:line on a bad row
        else:
            close = difflib.get_close_matches(entry, list(BENCHMARKS) + list(GENERATED_BENCHMARKS), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown benchmark '{entry}'{hint}; available: {available_benchmarks()}")
        if name in selected:
            raise ConfigError(f"benchmark '{name}' is listed twice in benchmarks={cfg.benchmarks}")
        # The first `limit` problems, not a random subset: a smoke run and its resume see the same problems.
        selected[name] = rows[: cfg.limit] if cfg.limit else rows
    return selected


def check_model_dir(model_path):
    """Fail before the engine starts (about 30 s on CPU, minutes for a 14B model) if the path cannot work."""
    path = Path(model_path)
    if not path.is_dir():
        raise ConfigError(f"model directory not found: {path} (eval.py reads a local Hugging Face directory; "
                          "download a hub model first, e.g. huggingface-cli download NAME --local-dir DIR)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a Hugging Face model directory: it has no config.json")
    # A checkpoint saved by a trainer that did not save the tokenizer is the usual case; any one of these
    # files (fast tokenizer, sentencepiece, BPE vocab) lets AutoTokenizer and vLLM load one.
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "vocab.json")
    if not any((path / f).is_file() for f in tokenizer_files):
        raise ConfigError(f"model directory {path} has no tokenizer (none of {', '.join(tokenizer_files)}); "
                          "copy the tokenizer files of the model it was trained from into it")


# -----------------------------------------------------------------------------
# samples.jsonl: one line per sample, appended per chunk; the resume point

def generation_settings(model_path, cfg):
    """Everything that decides what a sample is. Finished samples are reused only when this matches: a resumed
    run with another temperature, prompt or model would mix two experiments in one number."""
    # Grading settings are in too: samples.jsonl stores the verdict, so another grader needs fresh records.
    # benchmarks and limit are not: adding a benchmark or raising limit only adds problems to the file.
    settings = {"model": str(Path(model_path).resolve()), "n": cfg.n, "seed": cfg.seed,
                "require_answer_tag": cfg.require_answer_tag}
    rollout = dataclasses.asdict(cfg.rollout)
    for name in ROLLOUT_RESOURCE_FIELDS:  # how fast, not what: free to change between a run and its resume
        rollout.pop(name, None)
    settings["rollout"] = rollout
    return settings


# RolloutConfig fields that change speed or memory, never what a sample is.
ROLLOUT_RESOURCE_FIELDS = ("gpu_memory_utilization", "cpu_kv_cache_gb", "tensor_parallel_size", "enforce_eager",
                           "enable_prefix_caching", "max_concurrency", "sleep_level", "tool_workers")


def open_samples(out_dir, settings, n, resume):
    """The finished problems in out_dir/samples.jsonl: {(benchmark, problem id): its n records}; {} for a fresh run.
    A line cut off by a kill and the samples of an unfinished problem are dropped, so that problem is generated again,
    whole: its n samples come from one call with the usual seeds, never a mix of two runs."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples_path, settings_path = out_dir / "samples.jsonl", out_dir / "generation.json"
    if not resume or not samples_path.exists():
        # generation.json is written first and only here, so every record in the file was made under it.
        atomic_write_text(samples_path, "")
        atomic_write_text(settings_path, json.dumps(settings, indent=1))
        return {}
    saved = json.loads(settings_path.read_text()) if settings_path.exists() else None
    if saved != settings:
        changed = sorted(_diff_keys(saved, settings)) if saved else ["generation.json is missing"]
        raise ConfigError(f"{out_dir} holds samples made with other settings ({', '.join(changed)}); "
                          "use another out_dir, or resume=false to start over")
    lines = samples_path.read_text(encoding="utf-8").split("\n")
    groups = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):  # the last line, cut off mid-write
                continue
            raise ConfigError(f"{samples_path}:{lineno}: not valid JSON; fix or delete the file") from None
        groups.setdefault((record["benchmark"], record["problem_id"]), {})[record["sample_index"]] = record
    finished = {key: [by_index[j] for j in range(n)] for key, by_index in groups.items()
                if sorted(by_index) == list(range(n))}
    # Rewrite only when something was dropped; the common resume (nothing lost) leaves the file untouched.
    kept = [json.dumps(r) for records in finished.values() for r in records]
    if len(kept) != sum(1 for line in lines if line.strip()):
        atomic_write_text(samples_path, "".join(line + "\n" for line in kept))
    return finished


def _diff_keys(a, b, prefix=""):
    for key in set(a) | set(b):
        if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            yield from _diff_keys(a[key], b[key], f"{prefix}{key}.")
        elif a.get(key) != b.get(key):
            yield f"{prefix}{key}"


def append_samples(out_dir, records):
    """Append whole problems to samples.jsonl, then fsync: what is on disk survives a kill."""
    with open(Path(out_dir) / "samples.jsonl", "a", encoding="utf-8") as f:
        # One write: a kill leaves at most one torn last line, which open_samples drops.
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


# -----------------------------------------------------------------------------
# generation and grading

def sample_records(chunk, trajectories, tokenizer, cfg, rank=0):
    """Grade trajectories (reward.py, Eq. 3: a truncated one scores 0) and turn them into samples.jsonl lines.
    chunk[i] = (benchmark, problem row) of the trajectories whose problem_index is i."""
    # The same reward as training (Eq. 3), on the model's own turns (Trajectory.model_text, from the loss mask): a
    # \boxed{} the tool printed earns nothing, and finished=False (a budget or turn limit hit) is 0. The record
    # keeps the whole transcript for reading.
    golds = [chunk[t.problem_index][1]["answer"] for t in trajectories]
    rewards = score_batch([t.model_text for t in trajectories], golds, [t.finished for t in trajectories],
                          require_answer_tag=cfg.require_answer_tag, timeout_s=cfg.reward_timeout_s)
    prompts = {}  # one decode per problem, not per sample
    records = []
    for t, reward in zip(trajectories, rewards):
        name, row = chunk[t.problem_index]
        if t.problem_index not in prompts:
            prompts[t.problem_index] = tokenizer.decode(t.prompt_ids)
        # Small fields first and the long texts last, so `head samples.jsonl` is readable.
        answer = extract_answer(t.model_text, require_answer_tag=cfg.require_answer_tag)
        records.append({"benchmark": name, "problem_id": row["id"], "sample_index": t.sample_index,
                        "gold": row["answer"], **trajectory_record(t, reward == 1.0, answer), "rank": rank,
                        "prompt": prompts[t.problem_index], "response": t.response_text})
    return records


def check_prompt_lengths(todo, tokenizer, rollout_cfg):
    """Every prompt must fit rollout.max_prompt_tokens; found out here, not an hour into the run."""
    too_long = [(name, row["id"], n) for name, row in todo
                if (n := len(render_prompt(tokenizer, row["problem"], rollout_cfg))) > rollout_cfg.max_prompt_tokens]
    if too_long:
        listed = ", ".join(f"{name}/{pid} ({n} tokens)" for name, pid, n in too_long[:5])
        raise ConfigError(f"{len(too_long)} prompt(s) exceed rollout.max_prompt_tokens="
                          f"{rollout_cfg.max_prompt_tokens}: {listed}{', ...' if len(too_long) > 5 else ''}; raise it")


def check_engine(engine, rollout_cfg):
    """An engine passed in (rl.py's) was built for its own max_model_len; the eval's sequences must fit it.
    Sampling settings need no check: generate() sends temperature and top_p with every request."""
    built = getattr(engine, "cfg", None)
    if built is not None and built.context_len < rollout_cfg.context_len:
        raise ConfigError(f"the engine passed to evaluate holds {built.context_len} tokens per sequence, the eval "
                          f"needs max_prompt_tokens + max_response_tokens = {rollout_cfg.context_len}")


def work_left(model_path, problems, cfg, out_dir, rank, world_size):
    """(the finished problems, on rank 0: {(benchmark, id): records}, the (benchmark, row) pairs still to generate,
    the same on every rank). Rank 0 alone reads out_dir (no shared filesystem is assumed); every rank needs only the
    finished keys, to agree on the work that is left."""
    finished = {}
    if out_dir is not None and rank == 0:
        finished = open_samples(out_dir, generation_settings(model_path, cfg), cfg.n, cfg.resume)
    done = [set(finished)]
    if world_size > 1:
        dist.broadcast_object_list(done, src=0)
    todo = [(name, row) for name, rows in problems.items() for row in rows if (name, row["id"]) not in done[0]]
    if rank == 0:
        total = sum(len(rows) for rows in problems.values())
        resumed = f", {total - len(todo)} already in {out_dir}" if total > len(todo) else ""
        print(f"[eval] {total} problems x {cfg.n} samples{resumed}; {len(todo)} to generate on {world_size} rank(s)",
              flush=True)
    return finished, todo


def start_rollout(model_path, todo, cfg, engine, executor, tokenizer, owned):
    """(engine, executor, tokenizer): the ones passed in, the missing ones built (and added to `owned`, for the caller
    to close), after checking that every prompt and sequence fits."""
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    check_prompt_lengths(todo, tokenizer, cfg.rollout)
    # One engine per rank (tensor_parallel_size ranks share one): no server, the ranks are vLLM's workers.
    if engine is None:
        engine = Engine(model_path, cfg.rollout, seed=cfg.seed)
        owned.append(engine)
    check_engine(engine, cfg.rollout)
    if executor is None and cfg.rollout.use_tool:
        # The node's cores are shared by its ranks; each rank's executor takes its share, not all of them.
        per_rank = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        executor = Executor(workers=cfg.rollout.tool_workers or per_rank, timeout_s=cfg.rollout.tool_timeout_s,
                            memory_mb=cfg.rollout.tool_memory_mb)
        owned.append(executor)
    return engine, executor, tokenizer


def gather_records(chunk, records, rank, world_size):
    """Every rank's records of one chunk on rank 0 ([] elsewhere), one per sample, whole problems in work-list order
    so the file reads like the benchmark. Rank 0 alone writes: one file, no locking, no shared filesystem."""
    if world_size > 1:
        parts = [None] * world_size if rank == 0 else None
        dist.gather_object(records, parts, dst=0)
        records = [r for part in parts for r in part] if rank == 0 else []
    if rank != 0:
        return records
    # The ranks of a tensor-parallel group share an engine, and may all report its samples.
    order = {(name, row["id"]): i for i, (name, row) in enumerate(chunk)}
    unique = {(r["benchmark"], r["problem_id"], r["sample_index"]): r for r in reversed(records)}
    return sorted(unique.values(), key=lambda r: (order[(r["benchmark"], r["problem_id"])], r["sample_index"]))


def evaluate(model_path, problems, cfg, engine=None, executor=None, tokenizer=None, out_dir=None):
    """Sample, grade and summarise: {benchmark: metrics} (see summarize), the same on every rank. problems:
    {benchmark: rows with id/problem/answer} (a list is named "problems"). engine / executor / tokenizer: a caller's
    own (rl.py's engine holds weights not on disk), else built from model_path and cfg.rollout. out_dir: where the
    results go and the run resumes from; None keeps all in memory (live weights must not resume from other weights').
    Under torchrun every rank calls this, claims problems, grades its own samples; rank 0 gathers and writes."""
    if isinstance(problems, list):
        problems = {"problems": problems}
    check_model_dir(model_path)
    if cfg.rollout.prompt_variant == AUTO_VARIANT:  # main() has resolved it already; an in-process caller may not
        cfg = dataclasses.replace(cfg, rollout=apply_model_format(cfg.rollout, model_path))
    # A world of one outside torchrun (common.init_distributed), so the collectives below are the only path.
    rank, world_size, _, _ = init_distributed()
    ks = cfg.ks or default_ks(cfg.n)
    finished, todo = work_left(model_path, problems, cfg, out_dir, rank, world_size)
    owned = []  # what this call builds, it also closes
    # Nothing left (a finished run rerun, e.g. to reprint the table): no tokenizer, engine or executor is started.
    if todo:
        engine, executor, tokenizer = start_rollout(model_path, todo, cfg, engine, executor, tokenizer, owned)
    try:
        started, generated_tokens = time.time(), 0
        for step, start in enumerate(range(0, len(todo), cfg.chunk_problems)):
            chunk = todo[start:start + cfg.chunk_problems]
            # A chunk is one collective generate(): the ranks claim its problems from the shared counter, so a rank
            # done early takes more (§3.2). Bigger chunks idle less at their tail; smaller ones lose less to a kill.
            # step numbers the chunk, so the per-request seeds (seed, step, problem, sample) never repeat.
            groups = generate(engine, executor, tokenizer, [row["problem"] for _, row in chunk], cfg.n, cfg.rollout,
                              seed=cfg.seed, step=step)
            trajectories = [t for group in groups for t in group]  # this rank's problems, n samples each
            # Each rank grades its own samples (its own reward pool), so grading scales with the ranks too.
            records = gather_records(chunk, sample_records(chunk, trajectories, tokenizer, cfg, rank), rank, world_size)
            if rank == 0:
                generated_tokens += sum(r["response_tokens"] for r in records)
                if out_dir is not None:
                    append_samples(out_dir, records)
                for r in records:
                    finished.setdefault((r["benchmark"], r["problem_id"]), []).append(r)
                elapsed = time.time() - started
                print(f"[eval] {start + len(chunk)}/{len(todo)} problems, {elapsed:.0f} s, "
                      f"{generated_tokens / max(elapsed, 1e-9):.0f} response tokens/s", flush=True)
        summary = [None]
        if rank == 0:
            # Over every problem asked for, resumed ones included: the numbers never depend on interruptions.
            summary[0] = {name: summarize([finished[(name, row["id"])] for row in rows], ks)
                          for name, rows in problems.items()}
            if out_dir is not None:
                atomic_write_text(Path(out_dir) / "summary.json", json.dumps(
                    {"model": str(model_path), "benchmarks": summary[0]}, indent=1))
                atomic_write_text(Path(out_dir) / "summary.md", markdown_table(summary[0]) + "\n")
        if world_size > 1:
            dist.broadcast_object_list(summary, src=0)
    finally:
        # Last: closing an engine under external_launcher also tears down torch.distributed's default group.
        for thing in owned:
            thing.close()
    return summary[0]


# -----------------------------------------------------------------------------
# command line

def main(argv=None):
    try:  # bad input stops here, before any engine starts, with one line that names the problem
        cfg = load_config(EvalConfig, argv)
        cfg.model = str(resolve(cfg.model))  # relative to the repo, like every path in a config
        check_model_dir(cfg.model)
        cfg.rollout = apply_model_format(cfg.rollout, cfg.model)  # before save_config: config.yaml says what ran
        problems = load_benchmarks(cfg)
    except (ConfigError, ValueError) as e:
        sys.exit(f"eval.py: {e}")
    configure_vllm_logging(cfg.verbose)
    rank, _, _, _ = init_distributed()
    if rank == 0:  # the resolved config next to the results, so summary.json always says what produced it
        save_config(cfg, cfg.out_dir)
    try:
        summary = evaluate(cfg.model, problems, cfg, out_dir=cfg.out_dir)
    except ConfigError as e:  # e.g. out_dir holds samples of other settings (torchrun then stops the other ranks)
        sys.exit(f"eval.py: {e}")
    if rank == 0:  # every rank holds the summary; one prints it
        print(f"\n{cfg.model}\n" + markdown_table(summary), flush=True)
        print(f"[eval] wrote {Path(cfg.out_dir) / 'summary.json'}, summary.md and samples.jsonl", flush=True)


if __name__ == "__main__":  # the guard matters: vLLM's engine may spawn processes that re-import this file
    main()
