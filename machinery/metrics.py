"""The metrics log (JSONL, optionally W&B and TensorBoard) and the tool's busy time."""
import contextlib
import importlib.util
import json
import math
import secrets
import statistics
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from machinery.config import ConfigError, atomic_write_text, read_records
from machinery.exits import reached, rerun_command, shown, typed
from machinery.lock import hold_lease


def check_logger_packages(wandb_project, tensorboard):
    """Refuse a logger whose optional package is not installed, before anything loads."""
    for key, wanted, package in (("wandb_project", wandb_project, "wandb"),
                                 ("tensorboard", tensorboard, "tensorboard")):
        if wanted and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{key}: {typed(sys.executable)} -m pip install {package}")


class MetricsLogger:
    """One JSON object per step in run_dir/metrics.jsonl (rank 0 only), mirrored to W&B and
    TensorBoard when asked. On resume metrics.jsonl and TensorBoard drop the steps after the
    resumed one (all of them for a run that starts over) and W&B continues the run whose id
    run_dir/wandb_run_id keeps, so every log holds each step once."""

    def __init__(self, run_dir, enabled=True, wandb_project="", tensorboard=False, config=None,
                 resume_step=0):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = self.tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # a torn last line (a kill mid-write) is dropped, with a warning
            kept = [r for r in read_records(self.path)
                    if resume_step and r.get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        if wandb_project:
            import wandb  # optional; W&B keeps a redone step's first values (no step goes back)

            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(run_dir),
                                    id=wandb_run_id(run_dir), resume="allow")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional

            # purge_step: the events of the steps trained again are dropped on load
            self.tb = SummaryWriter(str(Path(run_dir) / "tb"),
                                    purge_step=resume_step + 1 if resume_step else 0)

    def log(self, step, metrics):
        """One row: the step, `timestamp` (unix seconds; W&B and TensorBoard keep their own) and
        the metrics."""
        if not self.enabled:
            return
        hold_lease(self.path.parent)  # a run whose run.lock was taken over writes no row
        row = {"step": step, "timestamp": time.time(),
               **{k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str)) else v)
                  for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        mirrored = {k: v for k, v in row.items() if k != "timestamp"}
        if self.wandb:
            self.wandb.log(mirrored, step=step)
        if self.tb:
            for k, v in mirrored.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def log_samples(self, step, records):
        """A few of the step's saved-rollout records beside the curves: a W&B table, and
        TensorBoard's text tab (each text an indented code block, which no text can close)."""
        rows = [[", ".join(f"{k} {n}" for k, n in r["tool_errors_by_kind"].items() if n)
                 if c == "errors_by_kind" else r[c] for c in SAMPLE_COLUMNS] for r in records]
        if self.wandb and rows:
            import wandb  # optional, as in __init__

            self.wandb.log({"samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)},
                           step=step)
        if self.tb and rows:
            self.tb.add_text("samples", "\n\n".join(
                " · ".join(f"{c} {v}" for c, v in zip(SAMPLE_COLUMNS, row[:-1]))
                + "\n\n" + textwrap.indent(row[-1], "    ", lambda line: True) for row in rows),
                step)

    def close(self):
        if self.wandb:
            self.wandb.finish()
        if self.tb:
            self.tb.close()


# the fields of tools.trajectories' page that fit a table row, the text last
SAMPLE_COLUMNS = ("id", "sample_index", "reward", "selected", "advantage", "penalty",
                  "num_tool_calls", "num_tool_errors", "errors_by_kind", "response_tokens",
                  "stop_reason", "response_text")


def wandb_run_id(run_dir):
    """The W&B run id of this run directory, made at its first start and kept in it."""
    path = Path(run_dir) / "wandb_run_id"
    if not path.is_file() or not path.read_text().strip():
        atomic_write_text(path, secrets.token_hex(4) + "\n")
    return path.read_text().strip()


class TimedExecutor:
    """The executor, adding up the seconds its calls run: the tool's load (calls overlap
    decoding)."""

    def __init__(self, executor):
        self.executor, self.busy_s, self.close = executor, 0.0, executor.close

    def submit(self, code, stdin=""):
        future = self.executor.submit(code, stdin=stdin)
        future.add_done_callback(self._count)
        return future

    def _count(self, future):
        if future.exception() is None:
            # float += under the GIL: the callbacks' threads cannot tear it
            self.busy_s += future.result().elapsed_s


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al.
    2021, Eq. 1), exact in Python's integers; c / n for k = 1."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def trajectory_record(t, correct, answer, ungraded=False):
    """One graded trajectory's numbers, as eval.py writes them per sample and sample_metrics
    averages them. ungraded: the verifier reached no verdict, so correct=False is not wrong."""
    return {"answer": answer, "correct": correct, "ungraded": ungraded, "finished": t.finished,
            "truncated": t.truncated, "stop_reason": t.stop_reason,
            "response_tokens": len(t.response_ids), "model_tokens": t.num_model_tokens,
            "num_turns": t.num_turns, "num_tool_calls": t.num_tool_calls,
            "num_tool_errors": t.num_tool_errors, "num_answer_tags": t.num_answer_tags,
            "tool_errors_by_kind": {k: v for k, v in t.tool_errors_by_kind.items() if v}}


def sample_metrics(samples):
    """Means over trajectory_record dicts: lengths, tool use and errors, answers, truncation."""
    metrics = {"response_tokens": statistics.fmean(r["response_tokens"] for r in samples),
               "model_tokens": statistics.fmean(r["model_tokens"] for r in samples)}

    calls = sum(r["num_tool_calls"] for r in samples)
    errors = sum(r["num_tool_errors"] for r in samples)
    metrics["tool_calls_per_trajectory"] = calls / len(samples)
    # pooled over calls: a trajectory with 20 calls weighs 20 times one with 1
    metrics["tool_error_rate"] = errors / calls if calls else None

    correct = [r for r in samples if r["correct"]]
    correct_calls = sum(r["num_tool_calls"] for r in correct)
    # Fig. 4 tracks this one: GRPO-RoC should drive tool errors out of the trajectories it rewards.
    metrics["tool_error_rate_in_correct"] = (sum(r["num_tool_errors"] for r in correct)
                                             / correct_calls if correct_calls else None)

    by_kind = Counter()
    for r in samples:
        by_kind.update(r["tool_errors_by_kind"])
    metrics["tool_errors_by_kind"] = dict(sorted(by_kind.items()))

    # A low answer rate with a high truncated rate means the budget is too small for the model, not
    # that it is wrong; the stage-1 "clip ratio" (about 10%, §4.3) is this number during training.
    metrics["answer_rate"] = statistics.fmean(r["answer"] is not None for r in samples)
    metrics["truncated_rate"] = statistics.fmean(bool(r["truncated"]) for r in samples)

    # a count: any at all means the grading, not the model, moved the accuracy
    metrics["ungraded"] = sum(bool(r.get("ungraded")) for r in samples)
    metrics["turns"] = statistics.fmean(r["num_turns"] for r in samples)
    return metrics


@contextlib.contextmanager
def timed(times, key):
    """times[key] = the seconds the `with` block took, the phase `key` names (exits.reached)."""
    reached(key.removeprefix("time/"))
    started = time.perf_counter()
    yield
    times[key] = time.perf_counter() - started


def step_metrics(records, num_groups):
    """The step's numbers over every rank's select_samples records; None, not 0, where there is
    nothing to average ("no correct trajectory called the tool" is not "no errors")."""
    n = len(records)

    def mean(key, rows=records):
        return sum(r[key] for r in rows) / len(rows) if rows else None

    def ratio(a, b):
        return a / b if b else None

    calls = sum(r["tool_calls"] for r in records)
    correct = [r for r in records if r["reward"] > 0]
    positives = [r for r in correct if not r["all_equal"]]
    by_kind = Counter()
    for r in records:
        by_kind.update(r["errors_by_kind"])
    return {
        "accuracy": mean("reward"),  # the mean 0/1 reward of everything sampled
        "selected_reward_mean": mean("reward", [r for r in records if r["selected"]]),
        "all_equal_group_fraction": sum(r["all_equal"] for r in records) / max(n, 1),
        "trajectories": n, "selected": sum(r["selected"] for r in records), "groups": num_groups,
        "tool_calls_per_trajectory": calls / max(n, 1),
        # a policy that drops the tool shows here
        "tool_call_rate": sum(r["tool_calls"] > 0 for r in records) / max(n, 1),
        "tool_error_ratio": ratio(sum(r["tool_errors"] for r in records), calls),
        # Fig. 4: failed calls per call, pooled over the trajectories that got the answer right
        "tool_error_ratio_in_correct": ratio(sum(r["tool_errors"] for r in correct),
                                             sum(r["tool_calls"] for r in correct)),
        "parse_failure_rate": ratio(sum(r["parse_errors"] for r in records), calls),
        "format_penalty": mean("format_penalty"),
        # RoC at work: the kept positives should have a lower penalty than all positives
        "roc_penalty_positives": mean("penalty", positives),
        "roc_penalty_kept_positives": mean("penalty", [r for r in positives if r["selected"]]),
        "response_tokens": mean("response_tokens"),
        "response_tokens_max": max((r["response_tokens"] for r in records), default=0),
        "model_tokens": mean("model_tokens"), "turns": mean("turns"),
        "truncation_ratio": mean("truncated"),
        # trajectories the verifier reached no verdict on (reward 0, not wrong): see sample_metrics
        "ungraded": sum(bool(r.get("ungraded")) for r in records),
        **{f"tool_errors/{kind}": count for kind, count in sorted(by_kind.items())},
    }


def global_metrics(per_batch, world_size):
    """Every micro-batch's loss metrics on this rank -> the batch's over all ranks: summed over
    micro-batches (each divided by the rank's token share) and averaged over ranks; *_max by max."""
    keys = sorted(k for k in per_batch[0] if not k.endswith("_max"))
    max_keys = sorted(k for k in per_batch[0] if k.endswith("_max"))
    packed = torch.stack([sum(torch.as_tensor(m[k], dtype=torch.float32) for m in per_batch)
                          for k in keys])
    largest = torch.stack([max(torch.as_tensor(m[k], dtype=torch.float32) for m in per_batch)
                           for k in max_keys])
    dist.all_reduce(packed)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return {**{k: float(v) / world_size for k, v in zip(keys, packed)},
            **{k: float(v) for k, v in zip(max_keys, largest)}}


def gather_step_metrics(local, learner, step, logprob_gap_warn):
    """rl.py's step 8: the step's metrics on rank 0 ({} elsewhere) from every rank's `local`
    numbers and the `learner`'s. time/PHASE is the slowest rank's (the others wait for it)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if rank != 0:
        return {}

    row = step_metrics([r for part in gathered for r in part["records"]],
                       sum(p["groups"] for p in gathered))
    row.update(learner)
    row.update({f"time/{key}": max(p["times"][key] for p in gathered) for key in local["times"]})

    # the straggler: how long the fastest rank's rollouts waited for the slowest's (time/generate
    # overlaps time/rollout); the collective timeout must stay above it (docs/gpu.md, Several nodes)
    row["time/rollout_idle"] = row["time/generate"] - min(p["times"]["generate"] for p in gathered)
    for key in local["traffic"]:  # the busiest rank's
        row[f"bytes/{key}"] = max(part["traffic"].get(key, 0) for part in gathered)

    row["rollout_tokens_per_s"] = (sum(p["rollout_tokens"] for p in gathered)
                                   / max(row["time/rollout"], 1e-9))
    # prompt + response tokens through the trainer (the update, and any old log-prob pass)
    row["train_tokens_per_s"] = (sum(p["trained_tokens"] for p in gathered)
                                 / max(row["time/train"] + row["time/old_logprobs"], 1e-9))
    if row["logprob_gap_mean"] > logprob_gap_warn:  # the engine is not sampling from the policy
        print(f"\n{'!' * 100}\nWARNING step {step}: logprob_gap_mean "
              f"{row['logprob_gap_mean']:.4f} > logprob_gap_warn={logprob_gap_warn}: the engine is "
              "not sampling from the trained policy: check the weight sync, the temperature and "
              "the chat template\n" + "!" * 100, flush=True)
    return row


def held_out_metrics(records, num_problems, samples_per_problem):
    """rl.py's eval/ metrics from {(problem, sample): trajectory_record}, as eval.py's."""
    correct = [sum(records[p, s]["correct"] for s in range(samples_per_problem))
               for p in range(num_problems)]
    summary = {"pass@1": statistics.fmean(pass_at_k(samples_per_problem, c, 1) for c in correct),
               **sample_metrics(list(records.values()))}
    keys = ("pass@1", "tool_calls_per_trajectory", "tool_error_rate", "tool_error_rate_in_correct",
            "answer_rate", "response_tokens", "ungraded")
    return {f"eval/{k}": summary[k] for k in keys if summary.get(k) is not None}


def print_held_out(metrics, rank, when):
    """One console line for a held-out evaluation (rank 0)."""
    if rank != 0:
        return
    in_correct = metrics.get("eval/tool_error_rate_in_correct")
    ungraded = metrics.get("eval/ungraded")  # no verdict: scored 0, yet not wrong
    print(f"held-out {when}: pass@1 {metrics['eval/pass@1']:.3f}, tool-error ratio in correct "
          f"{'-' if in_correct is None else f'{in_correct:.3f}'}"
          + (f", {ungraded} ungraded" if ungraded else "") + f" ({metrics['time/eval']:.0f} s)",
          flush=True)


def progress_fields(metrics):
    """rl.py's progress bar: accuracy, tool-error ratio in correct, sync gap, rollout speed."""
    in_correct = metrics["tool_error_ratio_in_correct"]
    return {"acc": f"{metrics['accuracy']:.3f}",
            "err_ok": "-" if in_correct is None else f"{in_correct:.3f}",
            "gap": f"{metrics['logprob_gap_mean']:.1e}",
            "tok_s": f"{metrics['rollout_tokens_per_s']:.0f}"}


def print_rl_written(out_dir, hf_dir, ckpt_root, untrained, device):
    """rl.py's last lines: what it wrote, and the evaluation to run next."""
    if untrained:
        print(f"WARNING: {untrained} of the run's steps trained on nothing "
              "(skipped_updates in metrics.jsonl)", flush=True)
    # configs/eval_tiny.yaml on CPU: configs/eval.yaml's 30K-token budget is for a GPU
    eval_config = "configs/eval.yaml" if device.type == "cuda" else "configs/eval_tiny.yaml"
    print(f"rl.py: wrote {shown(hf_dir)} (the trained policy, a Hugging Face directory), "
          f"{shown(out_dir / 'metrics.jsonl')} (a row per step) and {shown(ckpt_root)} "
          f"(resumable)\nnext: {rerun_command('eval.py', [eval_config, f'model={shown(hf_dir)}'])}",
          flush=True)


def warn_untrained(streak, metrics, every):
    """A loud warning when `streak` steps in a row trained on nothing (§2.2.3), at `every` steps
    and each doubling after, with the last step's reason."""
    times = streak // every if every else 0
    if not times or streak % every or times & (times - 1):  # N x a power of two only
        return

    groups, why = metrics["groups"], "no kept trajectory had a model-written token"
    if metrics["all_equal_group_fraction"] == 1.0:
        right = round(metrics["accuracy"] * groups)  # all-equal groups: accuracy = all-1 groups
        why = (f"{groups - right} of {groups} groups got reward 0 on every rollout, {right} got "
               "reward 1 on every rollout: filter_all_equal drops them (no advantage, Eq. 7)")
        if right in (0, groups):
            why += (". All rewards are 1: too easy (tools.filter_solved)" if right else
                    ". All rewards are 0: too hard, the answer format, the tool or "
                    f"max_response_tokens (truncation_ratio {metrics['truncation_ratio']:.2f})")
    text = textwrap.fill(f"WARNING: {streak} steps in a row trained on nothing (skipped_updates in "
                         f"metrics.jsonl): {why}.", 100, break_on_hyphens=False)
    print(f"\n{'!' * 100}\n{text}\n{'!' * 100}", flush=True)


def print_sft_data(examples, dropped, total_steps, cfg, world_size, accumulation):
    """sft.py's data line: conversations kept and dropped, tokens, and the steps' batch split."""
    print(f"data: {len(examples)} conversations ({dropped} longer than {cfg.max_seq_len} "
          f"tokens dropped), {sum(len(ids) for ids, _ in examples)} tokens, "
          f"{sum(sum(mask) for _, mask in examples)} trained | {total_steps} steps of "
          f"{cfg.global_batch_size} = {world_size} ranks x {accumulation} micro-batches x "
          f"{cfg.micro_batch_size}", flush=True)


def print_sft_written(out_dir, device):
    """What the run wrote, and the next command (configs/tiny.yaml on CPU, stage 1 on a GPU)."""
    rl_config = "configs/stage1.yaml" if device.type == "cuda" else "configs/tiny.yaml"
    model = f"model={shown(out_dir / 'final')}"
    print(f"sft.py: wrote {shown(out_dir / 'final')} (the model, a Hugging Face directory) and "
          f"{shown(out_dir / 'metrics.jsonl')}\n"
          f"next: {rerun_command('rl.py', [rl_config, model])}", flush=True)
