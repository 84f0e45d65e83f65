"""Arms of an RL ablation compared in one command: each arm is rl.py with its own key=value
overrides, run for every seed (or printed as launch lines); then one PNG of their curves (mean and
seed min..max per arm) and a markdown table of last-third means +- std over seeds.

    python -m tools.compare arms="roc,grpo algorithm=grpo" seeds=0,1 args=steps=20
    python -m tools.compare arms="roc,shortest positive_rule=shortest" launch=print   # a cluster's
    python -m tools.compare runs=runs/ablation/roc-seed0,runs/ablation/grpo-seed0     # finished
    python -m tools.compare runs=runs/tiny-rl plot=runs/tiny-rl/curves.png           # one run

A run directory's arm is its name without -seedN (or NAME=DIR); its seed, its config.yaml's.
demo.py ablation=true writes assets/ablation.png / .md with the same write_comparison.
"""
import concurrent.futures
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

from machinery.config import (REPO, ConfigError, PositiveInt, atomic_write_text, load_config,
                              read_records, read_saved_config, resolve)

# The panels of the PNG and the columns of the last-third table: (metrics.jsonl key, title).
CURVES = (("accuracy", "train reward (accuracy, T=1.0)"),
          ("eval/pass@1", "held-out accuracy"),
          ("tool_error_ratio_in_correct", "tool-error ratio in correct (Fig. 4)"),
          ("response_tokens", "response tokens"),
          ("entropy", "entropy of the trained tokens"),
          ("grad_norm", "grad norm (before clipping)"),
          ("time/step", "seconds per step"))
PERCENT = ("accuracy", "eval/pass@1", "tool_error_ratio_in_correct")
RATIO = "tool_error_ratio_in_correct"


@dataclasses.dataclass
class CompareConfig:
    rl_config: str = "configs/tiny.yaml"  # every arm's rl.py config
    arms: list[str] = dataclasses.field(default_factory=list)  # "NAME key=value ...", one an arm
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0])  # seeds=0 or seeds=0,1
    args: list[str] = dataclasses.field(default_factory=list)  # key=value for every arm
    out_dir: str = "runs/compare"  # arm NAME's seed N runs in OUT_DIR/NAME-seedN
    parallel: PositiveInt = 2     # rl.py runs at once (on CPU each decodes on one core)
    launch: Literal["run", "print"] = "run"  # print: the rl.py command lines, nothing run
    runs: list[str] = dataclasses.field(default_factory=list)  # finished runs: DIR or NAME=DIR
    reference: str = ""           # the arm the others are compared with; "": the first
    smooth: PositiveInt = 3       # the plot's trailing mean over steps (the table is not smoothed)
    plot: str = ""                # the PNG, its table as .md and numbers as .json next to it;
                                  # "": OUT_DIR/compare.png

    def validate(self):
        if not self.arms and not self.runs:
            raise ConfigError("arms or runs: give the arms to run or the run directories")
        if not self.seeds:
            raise ConfigError("seeds: empty; seeds=0 or seeds=0,1")


# -----------------------------------------------------------------------------
# the runs: launched, or found

def arm_jobs(cfg):
    """{(arm, seed): (out_dir, rl.py arguments)} from cfg.arms."""
    jobs = {}
    for spec in cfg.arms:
        name, *overrides = spec.split()
        bad = [o for o in overrides if "=" not in o]
        if bad or "/" in name or "=" in name:
            raise ConfigError(f"arms: {spec!r}: expected NAME key=value ...")
        for seed in cfg.seeds:
            out_dir = f"{cfg.out_dir}/{name}-seed{seed}"
            jobs[name, seed] = (out_dir, [cfg.rl_config, *cfg.args, *overrides, f"seed={seed}",
                                          f"out_dir={out_dir}"])
    return jobs


def check_arms(cfg, jobs):
    """Every arm's rl.py config checked before the first trains; an arm's key that cannot act at
    its settings is said."""
    from rl import RLConfig  # torch and the engine's adapter, ~4 s: only a comparison of arms
    for (name, seed), (_, args) in jobs.items():
        try:  # the config file as rl.py finds it, from the repo root
            arm = load_config(RLConfig, [str(resolve(args[0])), *args[1:]])
        except ConfigError as e:
            raise ConfigError(f"arm {name}: {e}") from None
        if seed == cfg.seeds[0]:  # on stderr: launch=print's stdout is the launch lines alone
            for line in arm.inert_keys():
                print(f"tools.compare: arm {name}: {line}", file=sys.stderr, flush=True)


def run_arms(cfg):
    """Every (arm, seed) as its own rl.py process, cfg.parallel at a time, logging to
    OUT_DIR/NAME-seedN.log (a finished run resumes to nothing); the timing for the table."""
    jobs, load_before, started = arm_jobs(cfg), os.getloadavg(), time.time()

    def one(out_dir, args):
        log = resolve(f"{out_dir}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"$ python rl.py {shlex.join(args)} > {log}", flush=True)
        with open(log, "w") as out:
            code = subprocess.call([sys.executable, "rl.py", *args], cwd=REPO, stdout=out,
                                   stderr=subprocess.STDOUT)
        if code != 0:
            raise SystemExit(f"tools.compare: rl.py {shlex.join(args)} failed ({code}); see {log}")

    with concurrent.futures.ThreadPoolExecutor(cfg.parallel) as pool:
        for future in [pool.submit(one, *job) for job in jobs.values()]:
            future.result()
    return {"seconds": time.time() - started, "parallel": cfg.parallel,
            "load_average_before": load_before, "load_average_after": os.getloadavg()}


def find_runs(paths):
    """{(arm, seed): run directory} for finished run directories, DIR or NAME=DIR."""
    runs = {}
    for spec in paths:
        name, _, path = spec.rpartition("=")
        run_dir = resolve(path)
        if not (run_dir / "metrics.jsonl").is_file():
            raise ConfigError(f"runs: {run_dir}: no metrics.jsonl (not an rl.py run directory)")
        config = read_saved_config(run_dir) or {}
        runs[name or re.sub(r"-seed\d+$", "", run_dir.name), config.get("seed", 0)] = run_dir
    return runs


def read_metrics(run_dir):
    return read_records(Path(run_dir) / "metrics.jsonl")


# -----------------------------------------------------------------------------
# numbers over seeds

def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def seed_spread(values):
    """Mean, sample standard deviation, min and max over seeds (None values left out)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "seeds": 0}
    m = sum(values) / len(values)
    std = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return {"mean": m, "std": std, "min": min(values), "max": max(values), "seeds": len(values)}


def train_rows(metrics):
    return [m for m in metrics if "accuracy" in m]


def evals(metrics):
    """(step, eval metrics) for every row of metrics.jsonl that has a held-out evaluation."""
    return [(m["step"], m) for m in metrics if "eval/pass@1" in m]


def last_third(metrics, key, steps):
    """The mean of a per-step number over the last third of the steps."""
    return mean([m.get(key) for m in train_rows(metrics) if m["step"] > steps - max(1, steps // 3)])


def at_step(metrics, key, step):
    return next((m.get(key) for m in train_rows(metrics) if m["step"] == step), None)


def trained_alike(rows, reference_rows):
    """Whether two runs took the same updates: every step's loss and gradient norm equal, and at
    least one logged."""
    def updates(rows):
        return [(m["step"], m.get("loss"), m.get("grad_norm")) for m in train_rows(rows)]

    return updates(rows) == updates(reference_rows) and any(
        loss is not None for _, loss, _ in updates(rows))


def summarize(runs, reference, final_trajectories=0, timing=None):
    """runs {(arm, seed): metrics rows} -> per arm: rollouts sampled / trained per step, accuracy
    and Fig. 4's tool-error ratio in correct trajectories at step 1, the last step and over the
    last third, the held-out numbers after the last step, every CURVES key's last third; whether
    the reference's ratio is below each other arm's by more than the seed spread, and which arms
    trained exactly like the reference."""
    arms = list(dict.fromkeys(arm for arm, _ in runs))
    steps = max((m["step"] for rows in runs.values() for m in train_rows(rows)), default=0)
    seeds = sorted({seed for _, seed in runs})
    summary = {"steps": steps, "seeds": seeds, "reference": reference, "timing": timing,
               "final_trajectories": final_trajectories, "arms": {}, "below": {},
               "trained_like_reference": [
                   name for name in arms if name != reference and all(
                       (reference, seed) in runs and trained_alike(rows, runs[reference, seed])
                       for (arm, seed), rows in runs.items() if arm == name)]}
    for name in arms:
        per_seed = [rows for (arm, _), rows in runs.items() if arm == name]
        arm = {"rollouts_per_step": max((m["trajectories"] for rows in per_seed
                                         for m in train_rows(rows)), default=0),
               "trained_per_step": mean([m["selected"] for rows in per_seed
                                         for m in train_rows(rows)])}
        for key in ("accuracy", "tool_error_ratio_in_correct"):
            arm[f"{key}_first_step"] = seed_spread([at_step(rows, key, 1) for rows in per_seed])
            arm[f"{key}_last_step"] = seed_spread([at_step(rows, key, steps) for rows in per_seed])
        finals = [points[-1][1] if (points := evals(rows)) and points[-1][0] == steps else {}
                  for rows in per_seed]
        arm["final_accuracy"] = seed_spread([m.get("eval/pass@1") for m in finals])
        arm["final_tool_error_ratio_in_correct"] = seed_spread(
            [m.get("eval/tool_error_rate_in_correct") for m in finals])
        arm["last_third"] = {key: seed_spread([last_third(rows, key, steps) for rows in per_seed])
                             for key, _ in CURVES if key != "eval/pass@1"}
        arm["last_third"]["eval/pass@1"] = arm["final_accuracy"]
        summary["arms"][name] = arm
    # The reference's ratio below another arm's by more than the larger std, at the last step (the
    # final policy's where there is one) and over the last third.
    ref = summary["arms"][reference]
    last = ("final_tool_error_ratio_in_correct"
            if ref["final_tool_error_ratio_in_correct"]["mean"] is not None
            else "tool_error_ratio_in_correct_last_step")
    summary["last_step_measure"] = last
    for name in arms:
        if name == reference:
            continue
        summary["below"][name] = {}
        for where in ("last_step", "last_third"):
            a, b = ((ref[last], summary["arms"][name][last]) if where == "last_step" else
                    (ref["last_third"][RATIO], summary["arms"][name]["last_third"][RATIO]))
            summary["below"][name][where] = None if a["mean"] is None or b["mean"] is None else {
                "ours": a["mean"], "theirs": b["mean"], "margin": b["mean"] - a["mean"],
                "spread": max(a["std"], b["std"]),
                "holds": b["mean"] - a["mean"] > max(a["std"], b["std"]),
                "ranges_disjoint": a["max"] < b["min"]}
    return summary


# -----------------------------------------------------------------------------
# the table (markdown) and the plot

def pct(s):
    return "n/a" if s["mean"] is None else f"{s['mean']:.1%} ± {s['std']:.1%}"


def number(s, key):
    if s["mean"] is None:
        return "n/a"
    return pct(s) if key in PERCENT else f"{s['mean']:.4g} ± {s['std']:.2g}"


def overlap(a, b):
    if a["mean"] is None or b["mean"] is None:
        return "n/a"
    if min(a["seeds"], b["seeds"]) < 2:
        return "1 seed: no range"
    return "disjoint" if a["max"] < b["min"] or b["max"] < a["min"] else "overlap"


def table_lines(summary, source):
    """The markdown of a summary; `source`: how the runs were made (the header's last words)."""
    steps, seeds, timing, ref = (summary["steps"], summary["seeds"], summary["timing"],
                                 summary["reference"])
    header = (f"{len(summary['arms'])} arms, {steps} steps, seeds {seeds}; mean ± standard "
              "deviation over seeds. Training numbers over every sampled trajectory at T=1.0; last "
              f"third = steps {steps - max(1, steps // 3) + 1}-{steps}. {source}")
    if timing:
        header += (f": {timing['seconds']:.0f} s for the runs ({timing.get('parallel', 1)} at a "
                   f"time), load average {timing['load_average_before'][0]:.1f} before, "
                   f"{timing['load_average_after'][0]:.1f} after.")
    lines = [header, "",
             "| arm | rollouts sampled / trained per step | train accuracy, step 1 "
             "| train accuracy, last third | tool-error ratio in correct, step 1 "
             "| at the last step's batch | over the last third |",
             "|---|---|---|---|---|---|---|"]
    for name, arm in summary["arms"].items():
        lines.append(f"| {name} | {arm['rollouts_per_step']} / {arm['trained_per_step']:.0f} "
                     f"| {pct(arm['accuracy_first_step'])} | {pct(arm['last_third']['accuracy'])} "
                     f"| {pct(arm['tool_error_ratio_in_correct_first_step'])} "
                     f"| {pct(arm['tool_error_ratio_in_correct_last_step'])} "
                     f"| {pct(arm['last_third'][RATIO])} |")
    finals = {name: arm for name, arm in summary["arms"].items()
              if arm["final_accuracy"]["mean"] is not None}
    if finals:
        count = summary["final_trajectories"]
        lines += ["", f"The policy after step {steps}, on the held-out problems at the training "
                      "temperature" + (f" ({count} trajectories per seed):" if count else ":"),
                  "", "| arm | held-out accuracy | tool-error ratio in correct trajectories |",
                  "|---|---|---|"]
        for name, arm in finals.items():
            lines.append(f"| {name} | {pct(arm['final_accuracy'])} "
                         f"| {pct(arm['final_tool_error_ratio_in_correct'])} |")
    # every curve's last third (held out: after the last step), and the seed ranges against ref
    lines += ["", f"Last third of every curve (held-out accuracy: after step {steps}); seed "
                  f"ranges against {ref}'s:", "",
              "| arm | " + " | ".join(title for _, title in CURVES) + " |",
              "|---|" + "---|" * len(CURVES)]
    for name, arm in summary["arms"].items():
        cells = [number(arm["last_third"][key], key) for key, _ in CURVES]
        if name != ref:
            cells = [f"{c} ({overlap(arm['last_third'][k], summary['arms'][ref]['last_third'][k])})"
                     for c, (k, _) in zip(cells, CURVES)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for name in summary.get("trained_like_reference", []):
        lines.append(f"- arm {name}: no key acted at these settings: every step's loss and "
                     f"gradient norm equal {ref}'s, in every seed (it trained exactly like {ref})")
    at_last = ("at the last step (the final policy, held out)"
               if summary["last_step_measure"].startswith("final")
               else "at the last step (its training batch)")
    for name, result in summary["below"].items():
        for where, r in result.items():
            label = at_last if where == "last_step" else "over the last third"
            if r is None:
                lines.append(f"- {ref} vs {name}, {label}: no correct trajectory with a tool "
                             "call in some arm")
                continue
            points = f"{abs(r['margin']) * 100:.1f}"  # percentage points, which way they go
            side = ("equal to" if points == "0.0" else
                    f"{points} points {'below' if r['margin'] > 0 else 'above'}")
            verdict = (f"below by more than the spread: {'yes' if r['holds'] else 'NO'}; seed "
                       f"ranges {'disjoint' if r['ranges_disjoint'] else 'overlap'}")
            if len(summary["seeds"]) < 2:
                verdict = "one seed: no spread to judge it by"
            lines.append(f"- tool-error ratio in correct trajectories {label}: {ref} "
                         f"{r['ours']:.1%}, {side} {name}'s {r['theirs']:.1%} (seed spread, "
                         f"the larger std: {r['spread'] * 100:.1f} points): {verdict}")
    return lines


def smooth(values, window):
    """Trailing moving average over `window` steps, skipping steps with nothing to measure."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else None)
    return out


def plot_curves(runs, path, window, title, alike=None):
    """One panel per CURVES key: per arm the seed mean (each seed smoothed over `window` steps) and,
    shaded, the seed min..max; held-out accuracy unsmoothed. alike: {arm: the reference it trained
    exactly like}, said in the legend."""
    # matplotlib (~1 s) only here: the launch lines and --help do not wait for it
    import matplotlib
    matplotlib.use("Agg")  # no display on a server; before pyplot is imported
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    arms = list(dict.fromkeys(arm for arm, _ in runs))
    fig, axes = plt.subplots(2, 4, figsize=(17, 7))
    for ax, (key, label) in zip(axes.flat, CURVES):
        for color, name in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], arms):
            per_seed = [rows for (arm, _), rows in runs.items() if arm == name]
            if key == "eval/pass@1":
                xs = sorted({step for rows in per_seed for step, _ in evals(rows)})
                curves = [[dict(evals(rows)).get(x, {}).get(key) for x in xs] for rows in per_seed]
            else:
                xs = sorted({m["step"] for rows in per_seed for m in train_rows(rows)})
                curves = [smooth([at_step(rows, key, x) for x in xs], window) for rows in per_seed]
            stats = [seed_spread([c[i] for c in curves]) for i in range(len(xs))]
            points = [(x, s) for x, s in zip(xs, stats) if s["mean"] is not None]
            if not points:
                continue
            xs, stats = [x for x, _ in points], [s for _, s in points]
            ax.plot(xs, [s["mean"] for s in stats], color=color, lw=2,
                    marker="o" if key == "eval/pass@1" else None,
                    label=f"{name} ({len(per_seed)} seed{'s' * (len(per_seed) > 1)})"
                    + (f" = {alike[name]}: no key acted" if name in (alike or {}) else ""))
            ax.fill_between(xs, [s["min"] for s in stats], [s["max"] for s in stats],
                            color=color, alpha=0.15)
        ax.set(xlabel="RL step", title=label)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    axes.flat[-1].axis("off")
    axes.flat[-1].legend(*axes.flat[0].get_legend_handles_labels(), loc="center", fontsize=9)
    fig.suptitle(f"{title}; mean over seeds, shaded: seed min..max; {window}-step trailing mean",
                 fontsize=9)
    fig.tight_layout()
    path = resolve(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_comparison(runs, plot, reference, source, title, window, final_trajectories=0,
                     timing=None):
    """The PNG at `plot`, its summary as .json and table as .md next to it; the table's lines."""
    summary = summarize(runs, reference, final_trajectories, timing)
    path = plot_curves(runs, plot, window, title,
                       dict.fromkeys(summary["trained_like_reference"], reference))
    atomic_write_text(path.with_suffix(".json"), json.dumps(summary, indent=1) + "\n")
    lines = table_lines(summary, source)
    atomic_write_text(path.with_suffix(".md"), "\n".join(lines) + "\n")
    return lines


def compare(cfg):
    timing = None
    if cfg.arms:
        jobs = arm_jobs(cfg)
        check_arms(cfg, jobs)
        if cfg.launch == "print":  # one line per run, for the cluster's scheduler
            for out_dir, args in jobs.values():
                print(f"torchrun --nproc_per_node=8 rl.py {shlex.join(args)}")
            return None
        timing = run_arms(cfg)
        dirs = {key: resolve(out_dir) for key, (out_dir, _) in jobs.items()}
    else:
        dirs = find_runs(cfg.runs)
    runs = {key: read_metrics(d) for key, d in dirs.items()}
    reference = cfg.reference or next(iter(runs))[0]
    if reference not in {arm for arm, _ in runs}:
        raise ConfigError(f"reference={reference!r}: not one of the arms "
                          f"{sorted({arm for arm, _ in runs})}")
    plot = cfg.plot or f"{cfg.out_dir}/compare.png"
    command = shlex.join(["python", "-m", "tools.compare", *sys.argv[1:]])
    lines = write_comparison(runs, plot, reference, f"`{command}`", ", ".join(
        dict.fromkeys(arm for arm, _ in runs)), cfg.smooth, timing=timing)
    print("\n".join(lines) + f"\n\ntools.compare: wrote {resolve(plot)} and its table and numbers "
          "next to it (.md, .json)", flush=True)
    return lines


if __name__ == "__main__":
    try:
        compare(load_config(CompareConfig, sys.argv[1:], doc=__doc__))
    except ConfigError as e:
        sys.exit(f"tools.compare: {e}")
