"""The tiny CPU demo: the whole rStar2-Agent pipeline on a 0.76M-parameter model that learns to use a Python tool.

    python demo.py                  # tiny model -> SFT transcripts -> sft.py -> rl.py (GRPO-RoC) -> before/after table
    python demo.py ablation=true    # plain GRPO vs GRPO-RoC, same seeds and steps -> assets/ablation.png (+ .json/.md)

The task is multi-digit arithmetic ("Compute 4821 * 67 - 905."): a 2-layer, 128-wide model cannot multiply 4-digit
numbers in its head, but it can learn to write the expression as code, call the tool, and copy the printed result
into \\boxed{}. sft.py teaches the format from generated transcripts (some with a failed call, its traceback and a
fixed retry); rl.py then trains with GRPO-RoC on rewards alone, and the held-out accuracy (real vLLM engine, real
sandboxed tool, 0/1 reward on the boxed answer) is measured before the first step and after the last.

Each stage is the README's own command, run as a subprocess and printed, so the demo is also a transcript of how to
run the pieces by hand:
    python tiny.py                          -> out/tiny-model, out/tiny-sft.jsonl
    (this file)                             -> out/tiny-rl-train.jsonl, out/tiny-rl-test.jsonl
    python sft.py configs/sft_tiny.yaml     -> runs/tiny-sft/final
    python rl.py configs/tiny.yaml          -> runs/tiny-rl/metrics.jsonl, runs/tiny-rl/hf_step_N
A stage whose output exists is skipped (fresh=true reruns all). rl_args / sft_args pass key=value overrides through,
e.g. `python demo.py rl_args=steps=30,lr=1e-4`.

The ablation follows the paper's comparison (Fig. 4 and 9): both arms train on G rollouts per prompt with the same
seeds, prompts and steps; GRPO-RoC samples 2G and keeps G (so it spends twice the rollout compute), plain GRPO
samples G and keeps them all.
"""
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import matplotlib
import yaml

import tiny
from common import REPO, ConfigError, atomic_write_text, load_config, load_jsonl, resolve

matplotlib.use("Agg")  # no display on a server; before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402


@dataclasses.dataclass
class DemoConfig:
    ablation: bool = False
    fresh: bool = False                      # rerun every stage even if its output exists
    train_problems: int = 2000               # RL prompts (split "train": disjoint from the SFT and held-out problems)
    test_problems: int = 100                 # held-out problems (split "test", the same set as eval.py's `arith`)
    data_seed: int = 0
    sft_config: str = "configs/sft_tiny.yaml"
    rl_config: str = "configs/tiny.yaml"
    sft_args: list[str] = dataclasses.field(default_factory=list)   # extra key=value for sft.py
    rl_args: list[str] = dataclasses.field(default_factory=list)    # extra key=value for rl.py (both arms)
    # ablation
    ablation_dir: str = "runs/ablation"
    ablation_steps: int = 30
    ablation_seeds: list[int] = dataclasses.field(default_factory=lambda: [0, 1])
    ablation_eval_every: int = 15
    plot: str = "assets/ablation.png"        # the numbers go next to it as .json and .md

    def validate(self):
        if self.train_problems < 1 or self.test_problems < 1 or self.ablation_steps < 1:
            raise ConfigError("train_problems, test_problems and ablation_steps must be >= 1")
        if not self.ablation_seeds:
            raise ConfigError("ablation_seeds is empty")
        for name in ("sft_config", "rl_config"):
            if not resolve(getattr(self, name)).is_file():
                raise ConfigError(f"{name}: file not found: {getattr(self, name)}")


def run(cmd):
    """Run one stage as its README command, echoing it; stop the demo if it fails."""
    # A fresh process per stage: each script starts its own torch.distributed world and vLLM engine, exactly as
    # when run by hand, and nothing (threads, engines, process groups) leaks from one stage into the next.
    print(f"\n$ {' '.join(cmd)}", flush=True)
    started = time.time()
    proc = subprocess.run([sys.executable, *cmd], cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"demo.py: `{' '.join(cmd)}` failed with exit code {proc.returncode}")
    return time.time() - started


def config_value(config_path, key):
    return yaml.safe_load(resolve(config_path).read_text()).get(key)


# -----------------------------------------------------------------------------
# stages 1-3: the tiny model, its SFT transcripts, the RL data, SFT

def prepare(cfg):
    """Everything before RL; returns {stage: seconds} for the stages that ran."""
    times = {}
    # The paths are the scripts' own defaults, so `python rl.py configs/tiny.yaml` works afterwards by itself.
    model_dir, sft_data = resolve(tiny.TinyConfig.out_dir), resolve(tiny.TinyConfig.sft_data)
    if cfg.fresh or not (model_dir / "config.json").is_file() or not sft_data.is_file():
        times["tiny model + SFT transcripts"] = run(["tiny.py"])
    # The RL prompts and the held-out set, where configs/tiny.yaml expects them. Different splits of the generator
    # (tiny.make_arithmetic_problems): none of them is an SFT transcript's problem.
    for key, split, count in (("train_data", "train", cfg.train_problems), ("eval_data", "test", cfg.test_problems)):
        path = resolve(config_value(cfg.rl_config, key))
        if cfg.fresh or not path.is_file() or len(load_jsonl(path)) != count:
            rows = tiny.make_arithmetic_problems(count, cfg.data_seed, split=split)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
            print(f"wrote {count} {split} problems -> {path}", flush=True)
    sft_final = resolve(config_value(cfg.sft_config, "out_dir")) / "final"
    if cfg.fresh or not (sft_final / "config.json").is_file():
        if cfg.fresh:
            shutil.rmtree(sft_final.parent, ignore_errors=True)
        times["sft"] = run(["sft.py", cfg.sft_config, *cfg.sft_args])
    return times


def read_metrics(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def train_rl(cfg, out_dir, args):
    """rl.py into out_dir (resumed if it is there, unless fresh); returns its per-step metrics."""
    if cfg.fresh:
        shutil.rmtree(resolve(out_dir), ignore_errors=True)
    seconds = run(["rl.py", cfg.rl_config, f"out_dir={out_dir}", *cfg.rl_args, *args])
    return read_metrics(resolve(out_dir)), seconds


# -----------------------------------------------------------------------------
# the demo: before/after table

def evals(metrics):
    """(step, eval metrics) for every row of metrics.jsonl that has a held-out evaluation."""
    return [(m["step"], m) for m in metrics if "eval/pass@1" in m]


def demo(cfg):
    started = time.time()
    times = prepare(cfg)
    out_dir = config_value(cfg.rl_config, "out_dir")
    metrics, times["rl"] = train_rl(cfg, out_dir, [])
    # rl.py evaluates the held-out set before its first step and after its last, through its own engine and tool:
    # the same loop, sampling temperature and grader as training, so the two rows differ only in the weights.
    points = evals(metrics)
    if len(points) < 2:
        sys.exit(f"demo.py: {out_dir}/metrics.jsonl has no before/after evaluation (is eval_data set?)")
    (before_step, before), (after_step, after) = points[0], points[-1]
    rows = [("held-out accuracy (pass@1)", "eval/pass@1", "{:.1%}"),
            ("tool calls per trajectory", "eval/tool_calls_per_trajectory", "{:.2f}"),
            ("tool-error ratio in correct trajectories", "eval/tool_error_rate_in_correct", "{:.1%}"),
            ("answer rate", "eval/answer_rate", "{:.1%}"),
            ("response tokens", "eval/response_tokens", "{:.0f}")]
    lines = [f"| {'held-out arithmetic (' + str(cfg.test_problems) + ' problems)':<42} | {'after SFT (step ' + str(before_step) + ')':>20} "
             f"| {'after RL (step ' + str(after_step) + ')':>20} |", f"|{'-' * 44}|{'-' * 22}|{'-' * 22}|"]
    for label, key, fmt in rows:
        cell = lambda m: fmt.format(m[key]) if m.get(key) is not None else "n/a"  # noqa: E731
        lines.append(f"| {label:<42} | {cell(before):>20} | {cell(after):>20} |")
    print("\n" + "\n".join(lines))
    print(f"\ntime: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()) + f"; total {time.time() - started:.0f} s")
    return before, after


# -----------------------------------------------------------------------------
# the ablation: plain GRPO vs GRPO-RoC

def ablation(cfg):
    prepare(cfg)
    arms = {"GRPO": "grpo", "GRPO-RoC": "roc"}
    runs = {}
    # Same config, seeds, prompts (the data order depends only on the seed) and steps; only `algorithm` differs.
    for name, algorithm in arms.items():
        for seed in cfg.ablation_seeds:
            out_dir = f"{cfg.ablation_dir}/{algorithm}-seed{seed}"
            runs[(name, seed)], _ = train_rl(cfg, out_dir, [
                f"algorithm={algorithm}", f"seed={seed}", f"steps={cfg.ablation_steps}",
                f"eval_every={cfg.ablation_eval_every}", "save_every=10"])
    summary = summarize_ablation(runs, arms, cfg)
    plot_ablation(runs, arms, cfg, summary)
    return summary


def smooth(values, window=5):
    """Trailing moving average: the per-step training numbers of 8 prompts are noisy."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else None)
    return out


def summarize_ablation(runs, arms, cfg):
    """Per arm: held-out pass@1 at each evaluation and the training numbers over the last 10 steps, seed-averaged."""
    summary = {"steps": cfg.ablation_steps, "seeds": cfg.ablation_seeds, "arms": {}}
    for name in arms:
        seeds = [runs[(name, s)] for s in cfg.ablation_seeds]
        eval_steps = sorted({step for metrics in seeds for step, _ in evals(metrics)})
        pass1 = {step: mean([m["eval/pass@1"] for metrics in seeds for s, m in evals(metrics) if s == step])
                 for step in eval_steps}
        err = {step: mean([m.get("eval/tool_error_rate_in_correct") for metrics in seeds for s, m in evals(metrics)
                           if s == step]) for step in eval_steps}
        last = [m for metrics in seeds for m in metrics if m["step"] > cfg.ablation_steps - 10 and "accuracy" in m]
        summary["arms"][name] = {
            "eval_pass@1": pass1, "eval_tool_error_ratio_in_correct": err,
            "train_accuracy_last10": mean([m["accuracy"] for m in last]),
            "train_tool_error_ratio_in_correct_last10": mean([m["tool_error_ratio_in_correct"] for m in last]),
            "train_tool_calls_per_trajectory_last10": mean([m["tool_calls_per_trajectory"] for m in last]),
            "rollouts_per_step": max((m["trajectories"] for metrics in seeds for m in metrics if "trajectories" in m), default=0),
        }
    path = resolve(cfg.plot).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(summary, indent=1) + "\n")
    lines = [f"Ablation: {cfg.ablation_steps} steps, seeds {cfg.ablation_seeds} (means over seeds); "
             f"`python demo.py ablation=true`", "",
             "| arm | rollouts/step | held-out pass@1 (first -> last eval) | held-out tool-error ratio in correct (first -> last) "
             "| train accuracy, last 10 steps | train tool-error ratio in correct, last 10 steps |",
             "|---|---|---|---|---|---|"]
    for name, s in summary["arms"].items():
        first, final = min(s["eval_pass@1"]), max(s["eval_pass@1"])
        fmt = lambda v: "n/a" if v is None else f"{v:.1%}"  # noqa: E731
        lines.append(f"| {name} | {s['rollouts_per_step']} | {fmt(s['eval_pass@1'][first])} -> {fmt(s['eval_pass@1'][final])} "
                     f"| {fmt(s['eval_tool_error_ratio_in_correct'][first])} -> {fmt(s['eval_tool_error_ratio_in_correct'][final])} "
                     f"| {fmt(s['train_accuracy_last10'])} | {fmt(s['train_tool_error_ratio_in_correct_last10'])} |")
    atomic_write_text(path.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n" + "\n".join(lines), flush=True)
    return summary


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def plot_ablation(runs, arms, cfg, summary):
    # Left: accuracy (the noisy per-step training accuracy, smoothed, and the held-out evaluations); right: the
    # paper's Fig. 4 quantity, which RoC's selection of positives is meant to push down.
    fig, (acc_ax, err_ax) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"GRPO": "tab:blue", "GRPO-RoC": "tab:red"}
    for name in arms:
        for i, seed in enumerate(cfg.ablation_seeds):
            metrics = [m for m in runs[(name, seed)] if "accuracy" in m]
            steps = [m["step"] for m in metrics]
            label = f"{name} (train, {len(cfg.ablation_seeds)} seeds, 5-step mean)" if i == 0 else None
            acc_ax.plot(steps, smooth([m["accuracy"] for m in metrics]), color=colors[name], alpha=0.35, lw=1, label=label)
            err_ax.plot(steps, smooth([m["tool_error_ratio_in_correct"] for m in metrics]), color=colors[name],
                        alpha=0.6, lw=1.2,
                        label=f"{name} (seed-wise, 5-step mean)" if i == 0 else None)
        held_out = summary["arms"][name]["eval_pass@1"]
        acc_ax.plot(list(held_out), list(held_out.values()), "o-", color=colors[name], lw=2,
                    label=f"{name} held-out pass@1 (seed mean)")
    acc_ax.set(xlabel="RL step", ylabel="accuracy", title="Accuracy on arithmetic")
    err_ax.set(xlabel="RL step", ylabel="failed calls / calls", title="Tool-error ratio in correct trajectories (Fig. 4)")
    for ax in (acc_ax, err_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"tiny model, plain GRPO vs GRPO-RoC, {cfg.ablation_steps} steps (python demo.py ablation=true)", fontsize=9)
    fig.tight_layout()
    path = resolve(cfg.plot)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    try:
        config = load_config(DemoConfig, sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"demo.py: {e}")
    ablation(config) if config.ablation else demo(config)
