"""Evaluate a checkpoint the paper's way: average pass@1 over n samples per problem (§5.1).

    python eval.py configs/eval.yaml model=PATH benchmarks=aime24,aime25 n=16   # one engine
    torchrun --nproc_per_node=8 eval.py configs/eval.yaml model=PATH            # 8 engines
    torchrun --nnodes=8 --nproc_per_node=8 --node_rank=R --master_addr=HOST \\
        --master_port=29500 eval.py configs/eval.yaml model=PATH                # 8 nodes
    python eval.py configs/eval_tiny.yaml model=out/tiny-model                  # CPU, tiny model
    python eval.py configs/eval.yaml model=PATH rollout.use_tool=false          # plain CoT

Every problem gets n samples from the agent loop training uses (rollout.py), graded by reward.py.
Per benchmark: avg pass@1 (Table 3), unbiased pass@k, maj@k, response tokens, tool calls and
tool errors, ungraded samples; a Markdown table (stdout, out_dir/summary.md), summary.json, and
samples.jsonl per sample, the resume point: a rerun generates only the problems it lacks.

Benchmarks: machinery/data.py's BENCHMARKS, `arith` (the tiny demo's held-out arithmetic), a
problems JSONL, or science multiple choice (GPQA-Diamond, §5.1: `mmlu_science` bundled, your own
gpqa_diamond.csv, or a choices JSONL; machinery/choices.py). A checkpoint is measured in the
format it was trained with (rollout.prompt_variant=auto), a directory without one in the paper's.
The paper's protocol and the release's differences: docs/design.md (Evaluation).
"""
import dataclasses
import difflib
import statistics
import time
from pathlib import Path

import torch.distributed as dist
from transformers import AutoTokenizer

import tiny  # the demo's task, for the generated `arith` benchmark
from executor import Executor
from machinery.choices import GPQA_HOWTO, chosen_letter, is_choice_file, load_choices
from machinery.config import ConfigError, NonNegativeInt, PositiveInt, load_config, resolve
from machinery.data import BENCHMARKS, SCIENCE_BENCHMARKS, check_prompt_lengths, load_problems
from machinery.distributed import cores_per_rank, init_distributed
from machinery.engine import check_engine, configure_vllm_logging, Engine
from machinery.exits import RECEIVED, rerun_command, run_script, shown
from machinery.metrics import pass_at_k, sample_metrics, trajectory_record
from machinery.model import check_model_dir
from machinery.prompts import AUTO_VARIANT, apply_model_format
from machinery.results import (CHUNK_PROBLEMS, append_samples, default_out_dir, gather_records,
                               markdown_table, work_left, write_summary)
# reward.py imports only the stdlib; math-verify loads in its worker processes
from reward import extract_answer, fast_equivalent, grade_batch
from rollout import generate, RolloutConfig

# Not files: `arith` is generated on the fly, so the demo and eval agree on it by seed.
GENERATED_BENCHMARKS = ("arith",)


# -----------------------------------------------------------------------------
# config

def _paper_rollout():
    """The agent loop as the paper evaluates it (§5.1): temperature 0.6, up to 30K tokens and 30
    turns; 30720 = 30 x 1024, the released eval scripts' max_response_length. The format: the
    model's own."""
    return RolloutConfig(prompt_variant=AUTO_VARIANT, temperature=0.6,
                         max_response_tokens=30720, max_turns=30)


@dataclasses.dataclass
class EvalConfig:
    model: str = ""                  # a local Hugging Face directory (weights + tokenizer)
    benchmarks: list[str] = dataclasses.field(
        default_factory=lambda: ["aime24", "aime25", "hmmt25", "math500"])
    limit: NonNegativeInt = 0        # first `limit` problems of each benchmark (0 = all)
    n: PositiveInt = 16              # samples per problem (paper §5.1: 16)
    ks: list[PositiveInt] = dataclasses.field(default_factory=list)  # pass@k, maj@k;
                                     # [] = default_ks
    seed: int = 0                    # request seeds (seed, chunk, problem, sample); option order
    collective_timeout_min: PositiveInt = 120  # torchrun: how long a rank waits for the slowest
    out_dir: str = ""                # "" = runs/eval/<model's folder>-<model>: one per model
    resume: bool = True              # reuse the finished problems in out_dir/samples.jsonl
    chunk_problems: PositiveInt = CHUNK_PROBLEMS  # problems per generate(); samples.jsonl
                                     # grows after each
    require_answer_tag: bool = False  # grade only a \boxed{} inside <answer>...</answer>
    reward_timeout_s: float = 5.0    # per-answer math-verify budget, in worker CPU seconds
    arith_problems: PositiveInt = 100  # size of the `arith` benchmark
    arith_seed: int = 0
    verbose: bool = False            # all of vLLM's logging; default: its warnings
    rollout: RolloutConfig = dataclasses.field(default_factory=_paper_rollout)

    def validate(self):
        """What the field types cannot say."""
        if not self.model:
            raise ConfigError("model: not set; python eval.py configs/eval.yaml model=PATH")
        if not self.benchmarks:
            raise ConfigError(f"benchmarks: empty; choose from {available_benchmarks()}")
        if any(k > self.n for k in self.ks):
            raise ConfigError(f"ks={self.ks}: pass@k needs k <= n = {self.n}")
        self.rollout.validate()


def default_ks(n):
    """1, 2, 4, ... up to n, and n: the usual pass@k curve, ending at the full-sample number."""
    # Powers of two because pass@k is roughly linear in log k; n because maj@n votes over all.
    ks = [2 ** i for i in range(n.bit_length()) if 2 ** i <= n]
    return ks if ks[-1] == n else ks + [n]


# -----------------------------------------------------------------------------
# benchmarks: names, generated sets and files, with errors that list the choices

def available_benchmarks():
    names = list(BENCHMARKS) + list(GENERATED_BENCHMARKS) + list(SCIENCE_BENCHMARKS)
    return ", ".join(names) + ", or a path to a problems .jsonl or gpqa_diamond.csv"


def load_benchmarks(cfg):
    """{benchmark name: problem rows} in the order asked, each cut to its first cfg.limit."""
    selected = {}
    for entry in cfg.benchmarks:
        path = resolve(entry)
        # A known name wins over a file of that name in the working directory: "aime24" is
        # always one set.
        if entry in BENCHMARKS:
            name, rows = entry, load_problems(BENCHMARKS[entry])
        elif entry == "arith":
            # split="test" has its own random stream (tiny.py seeds by split); the demo trains
            # on split="train".
            name = entry
            rows = tiny.make_arithmetic_problems(cfg.arith_problems, cfg.arith_seed, split="test")
        elif entry in SCIENCE_BENCHMARKS or is_choice_file(path):
            # Multiple choice: the options in an order drawn from (seed, question id).
            name = entry if entry in SCIENCE_BENCHMARKS else Path(entry).stem
            rows = load_choices(SCIENCE_BENCHMARKS.get(entry, entry), cfg.seed)
        elif entry.endswith(".jsonl") or path.is_file():
            # Named by the file's stem: the key of its samples and of its row in the table.
            name, rows = Path(entry).stem, load_problems(entry)  # says file:line on a bad row
        elif entry == "gpqa_diamond":
            raise ConfigError(GPQA_HOWTO)
        else:
            known = list(BENCHMARKS) + list(GENERATED_BENCHMARKS) + list(SCIENCE_BENCHMARKS)
            close = difflib.get_close_matches(entry, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown benchmark '{entry}'{hint}; "
                              f"available: {available_benchmarks()}")

        if name in selected:
            raise ConfigError(f"benchmark '{name}' is listed twice in benchmarks={cfg.benchmarks}")
        # The first `limit` problems, not a random subset: a run and its resume see the same.
        selected[name] = rows[: cfg.limit] if cfg.limit else rows
    return selected


# -----------------------------------------------------------------------------
# generation and grading

def sample_records(chunk, trajectories, tokenizer, cfg, rank=0):
    """Grade trajectories and turn them into samples.jsonl lines. chunk[i] = (benchmark, problem
    row) of the trajectories whose problem_index is i."""
    # The same reward as training (Eq. 3), on the model's own turns (Trajectory.model_text, from
    # the loss mask): a \boxed{} the tool printed earns nothing, and finished=False (a budget or
    # turn limit hit) is 0. The record keeps the whole transcript for reading.
    math = [t for t in trajectories if "options" not in chunk[t.problem_index][1]]
    rewards, ungraded = grade_batch([t.model_text for t in math],
                                    [chunk[t.problem_index][1]["answer"] for t in math],
                                    [t.finished for t in math],
                                    require_answer_tag=cfg.require_answer_tag,
                                    timeout_s=cfg.reward_timeout_s)
    math_verdicts = iter(zip(rewards, ungraded))  # in trajectory order, as `math` is

    prompts = {}  # one decode per problem, not per sample
    records = []
    for t in trajectories:
        name, row = chunk[t.problem_index]
        if t.problem_index not in prompts:
            prompts[t.problem_index] = tokenizer.decode(t.prompt_ids)

        if "options" in row:  # multiple choice: right if the final answer names the gold letter
            answer = chosen_letter(t.model_text, row["options"])
            correct, cut = t.finished and answer == row["answer"], False
        else:
            answer = extract_answer(t.model_text, require_answer_tag=cfg.require_answer_tag)
            reward, cut = next(math_verdicts)
            correct = reward == 1.0

        # Small fields first and the long texts last, so `head samples.jsonl` is readable.
        shuffle = {k: row[k] for k in ("shuffle_seed", "option_order", "options") if k in row}
        records.append({"benchmark": name, "problem_id": row["id"], "sample_index": t.sample_index,
                        "gold": row["answer"], **trajectory_record(t, correct, answer, cut),
                        **shuffle, "rank": rank, "prompt": prompts[t.problem_index],
                        "response": t.response_text})
    return records


def start_rollout(model_path, todo, cfg, engine, executor, tokenizer, owned):
    """(engine, executor, tokenizer): the ones passed in, the missing ones built (and added to
    `owned`, for the caller to close), after checking that every prompt and sequence fits."""
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    check_prompt_lengths(todo, tokenizer, cfg.rollout)
    # One engine per rank (tensor_parallel_size ranks share one): no server, ranks are workers.
    if engine is None:
        engine = Engine(model_path, cfg.rollout, seed=cfg.seed)
        owned.append(engine)
    check_engine(engine, cfg.rollout)
    if executor is None and cfg.rollout.use_tool:
        executor = Executor(workers=cfg.rollout.tool_workers or cores_per_rank(),
                            timeout_s=cfg.rollout.tool_timeout_s,
                            memory_mb=cfg.rollout.tool_memory_mb)
        owned.append(executor)
    return engine, executor, tokenizer


# -----------------------------------------------------------------------------
# the summary: pass@k, majority vote, the per-benchmark metrics

def majority_vote(answers):
    """Index of the sample whose answer wins a plurality vote (None does not vote; None if nobody
    votes). Answers vote together when reward.fast_equivalent calls them equal ("1,080" = "1080");
    math-verify per pair would cost more than generating. A tie goes to the answer seen first."""
    clusters = []  # [representative answer, index of its first sample, votes]
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        # Compare with each cluster's first answer only: k <= n answers, a handful of clusters.
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
    """Metrics of one benchmark from its sample records (as in samples.jsonl), grouped by
    problem: groups[p] = the n records of problem p in sample order."""
    if not groups:
        raise ValueError("summarize: no problems")
    n = len(groups[0])
    if any(len(group) != n for group in groups):
        counts = sorted({len(group) for group in groups})
        raise ValueError(f"summarize: every problem needs the same number of samples, got {counts}")

    samples = [record for group in groups for record in group]
    num_correct = [sum(bool(r["correct"]) for r in group) for group in groups]
    metrics = {"domain": "science" if "options" in groups[0][0] else "math",
               "problems": len(groups), "n": n}

    # Per problem first, then the mean over problems: every problem weighs the same, as in
    # Table 3. pass@1 here is the paper's "average pass@1 over 16 samples" (§5.1).
    for k in ks:
        metrics[f"pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in num_correct)

    # The paper's number is a mean over n samples; its spread across the n "runs" (sample j of
    # every problem) says how much one run of AIME (30 problems: one = 3.3 points) can move.
    per_run = [statistics.fmean(bool(group[j]["correct"]) for group in groups) for j in range(n)]
    metrics["pass@1_std"] = statistics.pstdev(per_run)
    for k in ks:
        # maj@k on the first k samples: i.i.d., so an unbiased (if noisier) estimate.
        votes = []
        for group in groups:
            # A truncated sample does not vote: it scored 0 whatever its text holds (§4.3.1),
            # and a half-written box is not an answer the model gave.
            winner = majority_vote([r["answer"] if r["finished"] else None for r in group[:k]])
            votes.append(winner is not None and bool(group[winner]["correct"]))
        metrics[f"maj@{k}"] = statistics.fmean(votes)

    metrics.update(sample_metrics(samples))
    return metrics


# -----------------------------------------------------------------------------
# the loop

def evaluate(model_path, problems, cfg, engine=None, executor=None, tokenizer=None, out_dir=None):
    """Sample, grade and summarise: {benchmark: metrics} (see summarize), the same on every rank.
    problems: {benchmark: rows with id/problem/answer} (a list is named "problems"). engine,
    executor, tokenizer: a caller's own, else built from model_path and cfg.rollout. out_dir:
    where the results go and the run resumes from; None keeps all in memory. Under torchrun
    every rank calls this, claims problems, grades its own samples; rank 0 gathers and writes."""
    if isinstance(problems, list):
        problems = {"problems": problems}
    check_model_dir(model_path, allow_hub_id=False)
    if cfg.rollout.prompt_variant == AUTO_VARIANT:  # main() resolved it; a caller may not have
        cfg = dataclasses.replace(cfg, rollout=apply_model_format(cfg.rollout, model_path))

    # A world of one outside torchrun, so the collectives below are the only path.
    rank, world_size, _, _ = init_distributed(cfg.collective_timeout_min)
    ks = cfg.ks or default_ks(cfg.n)
    finished, todo = work_left(model_path, problems, cfg, out_dir, rank, world_size)
    owned = []  # what this call builds, it also closes
    # Nothing left (a finished run rerun, e.g. to reprint the table): nothing is started.
    if todo:
        engine, executor, tokenizer = start_rollout(model_path, todo, cfg, engine, executor,
                                                    tokenizer, owned)

    try:
        started, generated_tokens = time.time(), 0
        for step, start in enumerate(range(0, len(todo), cfg.chunk_problems)):
            chunk = todo[start:start + cfg.chunk_problems]
            # A chunk is one collective generate(): the ranks claim its problems from the shared
            # counter, so a rank done early takes more (§3.2). Bigger chunks idle less at their
            # tail; smaller ones lose less to a kill. step numbers the chunk, so the per-request
            # seeds (seed, step, problem, sample) never repeat.
            groups = generate(engine, executor, tokenizer, [row["problem"] for _, row in chunk],
                              cfg.n, cfg.rollout, seed=cfg.seed, step=step)
            trajectories = [t for group in groups for t in group]  # this rank's problems
            # Each rank grades its own samples (its own reward pool): grading scales with ranks.
            records = sample_records(chunk, trajectories, tokenizer, cfg, rank)
            records = gather_records(chunk, records, rank, world_size)
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
            # Over every problem asked for, resumed ones included: interruptions change nothing.
            summary[0] = {name: summarize([finished[(name, row["id"])] for row in rows], ks)
                          for name, rows in problems.items()}
            if out_dir is not None:
                write_summary(out_dir, model_path, summary[0])
        if world_size > 1:
            dist.broadcast_object_list(summary, src=0)
    finally:
        # Last: closing an engine (external_launcher) tears down torch.distributed's default group.
        for thing in owned:
            thing.close()
    return summary[0]


# -----------------------------------------------------------------------------
# command line

def interrupt_paragraph(cfg, argv):
    """What rank 0 prints when Ctrl-C or SIGTERM stops eval.py: samples.jsonl keeps every finished
    chunk, and the same command generates only the rest."""
    if cfg is None:
        return "eval.py: interrupted"
    samples = Path(resolve(cfg.out_dir)) / "samples.jsonl"
    lines = sum(1 for line in open(samples) if line.strip()) if samples.is_file() else 0
    return (f"eval.py: interrupted by {', '.join(RECEIVED) or 'SIGINT'}; {shown(samples)} keeps "
            f"the {lines // cfg.n} problems finished so far (x {cfg.n} samples), written every "
            f"chunk_problems={cfg.chunk_problems}.\nTo resume (resume=true generates only the "
            f"rest): {rerun_command('eval.py', argv, {} if cfg.resume else {'resume': 'true'})}")


def parse(argv):
    """The config, its model's prompt format and its benchmarks' names checked: bad input stops
    here, before any engine starts, in one line."""
    try:
        cfg = load_config(EvalConfig, argv, doc=__doc__)
        # Relative to the repo, like every path in a config.
        cfg.model = check_model_dir(cfg.model, allow_hub_id=False)
        cfg.out_dir = cfg.out_dir or default_out_dir(cfg.model)
        # Before the evaluation writes config.yaml, so it says what ran.
        cfg.rollout = apply_model_format(cfg.rollout, cfg.model)
    except ValueError as e:  # a prompt format or tool schema that does not read
        raise ConfigError(str(e)) from None
    return cfg


def main(cfg):
    try:
        problems = load_benchmarks(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    configure_vllm_logging(cfg.verbose)
    rank, _, _, _ = init_distributed(cfg.collective_timeout_min)
    # a ConfigError here (out_dir holds samples of other settings) comes before any engine starts
    summary = evaluate(cfg.model, problems, cfg, out_dir=cfg.out_dir)
    if rank == 0:  # every rank holds the summary; one prints it
        print(f"\n{cfg.model}\n" + markdown_table(summary), flush=True)
        out = shown(resolve(cfg.out_dir))
        print(f"eval.py: wrote {out}/summary.md (this table), {out}/summary.json and "
              f"{out}/samples.jsonl (every sample, with its transcript)", flush=True)


if __name__ == "__main__":  # vLLM's engine may spawn processes that re-import this file
    run_script("eval.py", parse, main, interrupt_paragraph)
