"""The tiny CPU demo: the whole rStar2-Agent pipeline on a 0.76M-parameter model that learns to use
a Python tool.

    python demo.py                  # tiny model -> SFT transcripts -> sft.py -> rl.py (GRPO-RoC)
                                    # -> before/after table
    python demo.py ablation=true    # GRPO vs GRPO-RoC vs GRPO with 2G kept, 3 seeds ->
                                    # assets/ablation.png (+ .json/.md)
    python demo.py verbose=true     # with all of vLLM's logging (default: its warnings only)

The task is multi-digit arithmetic ("Compute 4821 * 67 - 905."): a 2-layer, 128-wide model cannot
multiply 4-digit numbers in its head, but it can learn to write the expression as code, call the
tool, and copy the printed result into \\boxed{}. sft.py teaches the format from generated
transcripts (in some the code prints the result and then fails, and the answer is read from the
failed call); rl.py then trains with GRPO-RoC on rewards alone, and the held-out accuracy (real vLLM
engine, real sandboxed tool, 0/1 reward on the boxed answer) is measured before the first step and
after the last.

Each stage is the README's own command, run as a subprocess and printed, so the demo is also a
transcript of how to run the pieces by hand:
    python tiny.py                          -> out/tiny-model, out/tiny-sft.jsonl
    (this file)                             -> out/tiny-rl-train.jsonl, out/tiny-rl-test.jsonl
    python sft.py configs/sft_tiny.yaml     -> runs/tiny-sft/final
    python rl.py configs/tiny.yaml          -> runs/tiny-rl/metrics.jsonl, runs/tiny-rl/hf_step_N
A stage whose result exists is reused while what made it is unchanged: its script and every repo
module it imports, the prompt templates, its config file and key=value args, the data it reads, the
stages before it and the torch/transformers/vllm versions (stage_inputs; recorded in
runs/demo-stages/). A change reruns that stage and the ones after it, and says which files changed;
a reused stage says so with its date. fresh=true reruns all. rl_args / sft_args pass key=value
overrides through, e.g. `python demo.py rl_args=steps=30,lr=1e-4`.

The ablation follows the paper's comparison (Fig. 4 and 9), with the same seeds, prompts and steps
in every arm: plain GRPO samples G rollouts per prompt and trains on all; GRPO-RoC samples 2G and
keeps G (twice the rollout compute); the equal-compute control, plain GRPO with 2G sampled and all
kept, separates the effect of choosing positives from the effect of sampling more. The number it is
about is Fig. 4's tool-error ratio in correct trajectories: failed calls / calls over the
trajectories that got the answer right.
"""
import ast
import concurrent.futures
import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from machinery.config import REPO, atomic_write_text, ConfigError, load_config, resolve
from machinery.exits import exit_status, interrupted, rerun_command, shown, stop_on_signals

# tiny.py and rollout.py (torch, transformers: ~4 s) and matplotlib are imported where a stage uses
# them: demo.py itself runs no model, and --help or a config error should not wait for them.


@dataclasses.dataclass
class DemoConfig:
    ablation: bool = False
    fresh: bool = False                      # rerun every stage even if its output exists
    train_problems: int = 2000               # RL prompts (split "train": disjoint from the SFT and
                                             # held-out problems)
    test_problems: int = 100                 # held-out problems (split "test", the same set as
                                             # eval.py's `arith`)
    data_seed: int = 0
    sft_config: str = "configs/sft_tiny.yaml"
    rl_config: str = "configs/tiny.yaml"
    sft_args: list[str] = dataclasses.field(default_factory=list)   # extra key=value for sft.py
    rl_args: list[str] = dataclasses.field(default_factory=list)    # extra key=value for rl.py
                                                                    # (both arms)
    verbose: bool = False                    # all of vLLM's logging in rl.py (default: its warnings
                                             # only)
    # ablation
    ablation_dir: str = "runs/ablation"
    ablation_steps: int = 20
    ablation_seeds: list[int] = dataclasses.field(default_factory=lambda: [0, 1, 2])
    # The last step's policy, measured on the held-out problems with this many samples each at the
    # training temperature: one training batch (8 prompts) is too few correct trajectories to read a
    # ratio from (0 = off).
    ablation_final_samples: int = 4
    ablation_parallel: int = 2               # rl.py runs at once: each uses one core for its engine
                                             # and training
    ablation_smooth: int = 3                 # the plot's trailing mean over steps (the table is not
                                             # smoothed)
    plot: str = "assets/ablation.png"        # the numbers go next to it as .json and .md

    def validate(self):
        if self.train_problems < 1 or self.test_problems < 1 or self.ablation_steps < 1:
            raise ConfigError("train_problems, test_problems and ablation_steps must be >= 1")
        if self.ablation_smooth < 1:
            raise ConfigError("ablation_smooth must be >= 1 (1 = no smoothing), "
                              f"got {self.ablation_smooth}")
        if not self.ablation_seeds:
            raise ConfigError("ablation_seeds is empty")
        if self.ablation_parallel < 1 or self.ablation_final_samples < 0:
            raise ConfigError("ablation_parallel must be >= 1 and ablation_final_samples >= 0, "
                              f"got {self.ablation_parallel} and {self.ablation_final_samples}")
        for name in ("sft_config", "rl_config"):
            if not resolve(getattr(self, name)).is_file():
                raise ConfigError(f"{name}: file not found: {getattr(self, name)}")


RUNNING = set()  # the stages' processes now running, for an interrupt to wait on


def run(cmd, log=None):
    """Run one stage as its README command, echoing it; stop the demo if it fails. With `log`, its
    output goes to that file instead of the terminal (runs side by side would interleave their
    progress bars)."""
    # A fresh process per stage: each script starts its own torch.distributed world and vLLM engine,
    # exactly as when run by hand, and nothing (threads, engines, process groups) leaks from one
    # stage into the next.
    print(f"\n$ {rerun_command(cmd[0], cmd[1:])}" + (f" > {log}" if log else ""), flush=True)
    started = time.time()
    out = None
    if log:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "w")
    proc = subprocess.Popen([sys.executable, *cmd], cwd=REPO, stdout=out,
                            stderr=subprocess.STDOUT if out else None)
    RUNNING.add(proc)
    try:
        proc.wait()
    except KeyboardInterrupt:  # the stage has the signal too (stop_on_signals): it ends itself
        proc.wait()
        raise
    finally:
        RUNNING.discard(proc)
        if out:
            out.close()
    if interrupted():
        sys.exit(exit_status())
    if proc.returncode != 0:
        sys.exit(f"demo.py: `{' '.join(cmd)}` failed with exit code {proc.returncode}" +
                 (f"; its output: {log}" if log else ""))
    return time.time() - started


def config_value(config_path, key):
    return yaml.safe_load(resolve(config_path).read_text()).get(key)


# -----------------------------------------------------------------------------
# reuse a stage's result only while what made it is unchanged

STAGES_DIR = "runs/demo-stages"  # one record per stage: what its result was made from, and when
PACKAGES = ("torch", "transformers", "vllm")


def code_files(script):
    """The repo's Python files `script` runs: it and every repo module it imports, transitively
    (read with ast, nothing imported). Editing eval.py does not make rl.py's result stale."""
    todo, seen = [resolve(script).resolve()], set()
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:  # a.b runs a/__init__.py, then a/b.py or a/b/__init__.py
                parts = name.split(".")
                todo += [REPO.joinpath(*parts[:i], "__init__.py") for i in range(1, len(parts) + 1)]
                todo.append(REPO.joinpath(*parts).with_suffix(".py"))
    return sorted(seen)


def file_digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def stage_inputs(script, configs=(), args=(), data=(), upstream=()):
    """{what: sha256} of everything a stage's result depends on: the script and the repo modules it
    runs (code_files), the prompt templates, its config files, its key=value args, the data files
    it reads, the records of the stages before it, and the torch/transformers/vllm versions."""
    files = [*code_files(script), *sorted(resolve("configs/templates").resolve().iterdir()),
             *(resolve(f).resolve() for f in [*configs, *data])]
    inputs = {str(f.relative_to(REPO)) if f.is_relative_to(REPO) else str(f): file_digest(f)
              for f in files}
    inputs["args"] = hashlib.sha256(json.dumps(list(args)).encode()).hexdigest()
    for name in upstream:
        inputs[f"stage {name}"] = hashlib.sha256(json.dumps(
            read_stage(name).get("inputs")).encode()).hexdigest()
    for package in PACKAGES:
        try:
            inputs[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            inputs[package] = None
    return inputs


def stage_record(name):
    return resolve(STAGES_DIR) / f"{name}.json"


def read_stage(name):
    path = stage_record(name)
    return json.loads(path.read_text()) if path.is_file() else {}


def reuse_stage(name, output, inputs, fresh, complete):
    """Whether stage `name`'s result at `output` (complete: finished, not cut off) can be reused;
    says so either way. A changed input reruns the stage into a clean `output` (the demo's own
    result, replaced); an unchanged one resumes a cut-off run. A result with no record (made by
    hand, or before the demo kept records) is reused as it is, with its date and how to rerun."""
    record, output = read_stage(name), resolve(output)
    when = datetime.datetime.fromtimestamp(record.get("time") or (
        output.stat().st_mtime if output.exists() else time.time())).strftime("%Y-%m-%d %H:%M")
    if not fresh and complete and record.get("inputs") == inputs and record.get("done"):
        print(f"demo.py: reusing {shown(output)} ({name}, made {when}): its code, config and "
              "inputs are unchanged; fresh=true reruns every stage", flush=True)
        return True
    if not fresh and complete and not record:
        print(f"demo.py: reusing {shown(output)} ({name}) as it is, from {when}: there is no "
              f"record of what made it ({shown(stage_record(name))}); fresh=true reruns every "
              "stage", flush=True)
        return True
    if fresh or (record and record.get("inputs") != inputs):
        if record and not fresh:
            changed = sorted(k for k in {*inputs, *record["inputs"]}
                             if inputs.get(k) != record["inputs"].get(k))
            print(f"demo.py: rerunning {name}: {', '.join(changed)} changed since its result of "
                  f"{when}" + (f" (replacing {shown(output)})" if output.exists() else ""),
                  flush=True)
        shutil.rmtree(output, ignore_errors=True)
        if output.is_file():
            output.unlink()
    stage_record(name).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(stage_record(name), json.dumps({"inputs": inputs, "time": time.time(),
                                                      "done": False}, indent=1))
    return False


def stage_done(name):
    """The record of a stage that finished: its result may be reused from now on."""
    atomic_write_text(stage_record(name), json.dumps({**read_stage(name), "done": True}, indent=1))


# -----------------------------------------------------------------------------
# stages 1-3: the tiny model, its SFT transcripts, the RL data, SFT

def prepare(cfg):
    """Everything before RL; returns {stage: seconds} for the stages that ran."""
    import tiny  # torch and transformers: only here (see the imports)

    times = {}
    # The paths are the scripts' own defaults, so `python rl.py configs/tiny.yaml` works afterwards
    # by itself.
    model_dir, sft_data = resolve(tiny.TinyConfig.out_dir), resolve(tiny.TinyConfig.sft_data)
    if not reuse_stage("tiny", model_dir, stage_inputs("tiny.py"), cfg.fresh,
                       (model_dir / "config.json").is_file() and sft_data.is_file()):
        times["tiny model + SFT transcripts"] = run(["tiny.py"])
        stage_done("tiny")
    # The RL prompts and the held-out set, where configs/tiny.yaml expects them. Different splits of
    # the generator (tiny.make_arithmetic_problems): none of them is an SFT transcript's problem.
    # Generated in well under a second: rewritten whenever they differ from the file.
    for key, split, count in (("train_data", "train", cfg.train_problems),
                              ("eval_data", "test", cfg.test_problems)):
        path = resolve(config_value(cfg.rl_config, key))
        rows = tiny.make_arithmetic_problems(count, cfg.data_seed, split=split)
        text = "".join(json.dumps(r) + "\n" for r in rows)
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, text)
            print(f"wrote {count} {split} problems -> {path}", flush=True)
    sft_dir = resolve(config_value(cfg.sft_config, "out_dir"))
    inputs = stage_inputs("sft.py", [cfg.sft_config], cfg.sft_args, upstream=["tiny"])
    if not reuse_stage("sft", sft_dir, inputs, cfg.fresh,
                       (sft_dir / "final" / "config.json").is_file()):
        times["sft"] = run(["sft.py", cfg.sft_config, *cfg.sft_args])
        stage_done("sft")
    return times


def read_metrics(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return ([json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if path.is_file() else [])


def train_rl(cfg, out_dir, args, log=None):
    """rl.py into out_dir, unless its result is there and still current (reuse_stage; a cut-off
    run resumes); returns its per-step metrics and its seconds (0 when reused)."""
    name = "rl" if out_dir == config_value(cfg.rl_config, "out_dir") else out_dir.replace("/", "-")
    overrides = [f"out_dir={out_dir}", *cfg.rl_args, *args]
    data = [config_value(cfg.rl_config, key) for key in ("train_data", "eval_data")]
    inputs = stage_inputs("rl.py", [cfg.rl_config], overrides, [d for d in data if d],
                          upstream=["sft"])
    if reuse_stage(name, out_dir, inputs, cfg.fresh,
                   any(resolve(out_dir).glob("hf_step_*/config.json"))):
        return read_metrics(resolve(out_dir)), 0.0
    verbose = ["verbose=true"] if cfg.verbose else []  # logging only: not an input
    seconds = run(["rl.py", cfg.rl_config, *verbose, *overrides], log=log)
    stage_done(name)
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
    # rl.py evaluates the held-out set before its first step and after its last, through its own
    # engine and tool: the same loop, sampling temperature and grader as training, so the two rows
    # differ only in the weights.
    points = evals(metrics)
    if len(points) < 2:
        sys.exit(f"demo.py: {out_dir}/metrics.jsonl has no before/after evaluation "
                 "(is eval_data set?)")
    (before_step, before), (after_step, after) = points[0], points[-1]
    rows = [("held-out accuracy (pass@1)", "eval/pass@1", "{:.1%}"),
            ("tool calls per trajectory", "eval/tool_calls_per_trajectory", "{:.2f}"),
            ("tool-error ratio in correct trajectories", "eval/tool_error_rate_in_correct",
             "{:.1%}"),
            ("answer rate", "eval/answer_rate", "{:.1%}"),
            ("response tokens", "eval/response_tokens", "{:.0f}")]
    lines = [f"| {'held-out arithmetic (' + str(cfg.test_problems) + ' problems)':<42} "
             f"| {'after SFT (step ' + str(before_step) + ')':>20} "
             f"| {'after RL (step ' + str(after_step) + ')':>20} |",
             f"|{'-' * 44}|{'-' * 22}|{'-' * 22}|"]
    for label, key, fmt in rows:
        cell = lambda m: fmt.format(m[key]) if m.get(key) is not None else "n/a"  # noqa: E731
        lines.append(f"| {label:<42} | {cell(before):>20} | {cell(after):>20} |")
    print("\n" + "\n".join(lines))
    print("\ntime: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
          + f"; total {time.time() - started:.0f} s")
    model = shown(resolve(out_dir) / f"hf_step_{after_step}")
    print(f"demo.py: the trained model is {model} (a Hugging Face directory); every step's numbers "
          f"are in {shown(resolve(out_dir) / 'metrics.jsonl')}\n"
          f"next: {rerun_command('eval.py', ['configs/eval_tiny.yaml', f'model={model}'])}",
          flush=True)
    return before, after


# -----------------------------------------------------------------------------
# the ablation: plain GRPO vs GRPO-RoC, and plain GRPO at RoC's rollout budget

def ablation_arms(cfg):
    """arm -> (run-directory name, rl.py overrides). Only the algorithm and the group size differ;
    seeds, prompts (the data order depends only on the seed) and steps are the same in every arm."""
    group = config_value(cfg.rl_config, "group_size")
    return {
        # G sampled, all kept (Fig. 9's baseline)
        "GRPO": ("grpo", ["algorithm=grpo", f"group_size={group}"]),
        # 2G sampled, RoC keeps G (§2.2.3)
        "GRPO-RoC": ("roc", ["algorithm=roc", f"group_size={group}"]),
        # RoC's rollout compute without its choice: 2G sampled and all trained on. RoC beating this
        # arm too means the effect comes from which positives are kept, not from sampling more.
        "GRPO, 2G kept": ("grpo2g", ["algorithm=grpo", f"group_size={2 * group}"]),
    }


def ablation(cfg):
    from rollout import RolloutConfig  # torch: only here (see the imports)

    prepare(cfg)
    arms = ablation_arms(cfg)
    temperature = (config_value(cfg.rl_config, "rollout") or {}).get("temperature",
                                                                     RolloutConfig.temperature)
    # rl.py's held-out evaluation, after the last step only, at T of training
    if cfg.ablation_final_samples:
        final = ["eval_at_start=false", "eval_every=0",
                 f"eval_samples={cfg.ablation_final_samples}", f"eval_temperature={temperature}"]
    else:
        final = ["eval_data="]
    jobs = {(name, seed): (f"{cfg.ablation_dir}/{slug}-seed{seed}",
                           [*overrides, f"seed={seed}", f"steps={cfg.ablation_steps}", *final,
                            f"save_every={cfg.ablation_steps}"])
            for name, (slug, overrides) in arms.items() for seed in cfg.ablation_seeds}
    load_before, started = os.getloadavg(), time.time()
    # Runs are independent processes (own engine, tool workers, process group on its own port); on
    # CPU each decodes on one torch thread (machinery.engine.set_cpu_engine_threads) and trains on
    # torch's own count (train_threads=0). Every number they produce is fixed by its seed; only the
    # seconds depend on what runs beside them.
    log = ((lambda out_dir: f"{resolve(out_dir)}.log") if cfg.ablation_parallel > 1
           else (lambda out_dir: None))
    with concurrent.futures.ThreadPoolExecutor(cfg.ablation_parallel) as pool:
        futures = {key: pool.submit(train_rl, cfg, out_dir, args, log(out_dir))
                   for key, (out_dir, args) in jobs.items()}
        results = {key: future.result() for key, future in futures.items()}
    runs = {key: metrics for key, (metrics, _) in results.items()}
    timing = {"seconds": time.time() - started, "parallel": cfg.ablation_parallel,
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "seconds_per_run": {f"{name} seed {seed}": s
                                  for (name, seed), (_, s) in results.items()}}
    summary = summarize_ablation(runs, arms, cfg, timing)
    plot_ablation(runs, arms, cfg)
    path = shown(resolve(cfg.plot))
    print(f"demo.py: wrote {path}, its numbers in {path.removesuffix('.png')}.json and .md, and "
          f"each run in {shown(resolve(cfg.ablation_dir))}/ARM-seedN", flush=True)
    return summary


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def seed_spread(values):
    """Mean, sample standard deviation, min and max over seeds (None: a seed with nothing to
    measure)."""
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "seeds": 0}
    m = sum(values) / len(values)
    std = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return {"mean": m, "std": std, "min": min(values), "max": max(values), "seeds": len(values)}


def train_rows(metrics):
    return [m for m in metrics if "accuracy" in m]


def last_third(metrics, key, steps):
    """The mean of a per-step number over the last third of the steps (the paper's curves are read
    at the end)."""
    return mean([m[key] for m in train_rows(metrics) if m["step"] > steps - max(1, steps // 3)])


def at_step(metrics, key, step):
    return next((m[key] for m in train_rows(metrics) if m["step"] == step), None)


def summarize_ablation(runs, arms, cfg, timing):
    """Per arm and step: seed mean and spread of the training accuracy and of Fig. 4's tool-error
    ratio in correct trajectories (failed calls / calls, over every sampled trajectory with reward
    1); the last step and the last third per seed; and whether RoC's ratio is below each GRPO arm's
    by more than the spread across seeds."""
    steps, seeds = cfg.ablation_steps, cfg.ablation_seeds
    keys = ("accuracy", "tool_error_ratio_in_correct")
    summary = {"steps": steps, "seeds": seeds, "timing": timing, "arms": {}, "roc_below": {}}
    for name in arms:
        per_seed = [runs[(name, s)] for s in seeds]
        arm = {"rollouts_per_step": max((m["trajectories"] for metrics in per_seed
                                         for m in train_rows(metrics)), default=0),
               "trained_per_step": mean([m["selected"] for metrics in per_seed
                                         for m in train_rows(metrics)]),
               "per_step": {key: [seed_spread([at_step(metrics, key, step) for metrics in per_seed])
                                  for step in range(1, steps + 1)] for key in keys}}
        for key in keys:
            arm[f"{key}_first_step"] = seed_spread([at_step(metrics, key, 1)
                                                    for metrics in per_seed])
            arm[f"{key}_last_step"] = seed_spread([at_step(metrics, key, steps)
                                                   for metrics in per_seed])
            arm[f"{key}_last_third"] = seed_spread([last_third(metrics, key, steps)
                                                    for metrics in per_seed])
        # The policy after the last step on the held-out problems (ablation_final_samples each,
        # training temperature): the same quantity as the training batches', from several times as
        # many trajectories.
        finals = [points[-1][1] if (points := evals(metrics)) and points[-1][0] == steps else {}
                  for metrics in per_seed]
        arm["final_accuracy"] = seed_spread([m.get("eval/pass@1") for m in finals])
        arm["final_tool_error_ratio_in_correct"] = seed_spread(
            [m.get("eval/tool_error_rate_in_correct") for m in finals])
        arm["final_trajectories"] = (cfg.test_problems * cfg.ablation_final_samples if any(finals)
                                     else 0)
        summary["arms"][name] = arm
    # The bar: RoC's ratio below the baseline's by more than the seed spread (the larger of
    # the two arms' standard deviations over seeds), at the last step (the final policy's
    # measurement where there is one) and over the last third of the training steps.
    roc = summary["arms"]["GRPO-RoC"]
    last = "final_tool_error_ratio_in_correct" \
        if roc["final_tool_error_ratio_in_correct"]["mean"] is not None \
        else "tool_error_ratio_in_correct_last_step"
    summary["last_step_measure"] = last
    for name in arms:
        if name == "GRPO-RoC":
            continue
        other = summary["arms"][name]
        summary["roc_below"][name] = {}
        for where in ("last_step", "last_third"):
            key = last if where == "last_step" else "tool_error_ratio_in_correct_last_third"
            a, b = roc[key], other[key]
            if a["mean"] is None or b["mean"] is None:
                summary["roc_below"][name][where] = None
                continue
            margin, spread = b["mean"] - a["mean"], max(a["std"], b["std"])
            summary["roc_below"][name][where] = {"margin": margin, "spread": spread,
                                                 "holds": margin > spread,
                                                 "ranges_disjoint": a["max"] < b["min"]}
    path = resolve(cfg.plot).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(summary, indent=1) + "\n")
    lines = ablation_table(summary)
    atomic_write_text(path.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n" + "\n".join(lines), flush=True)
    return summary


def ablation_table(summary):
    pct = lambda s: ("n/a" if s["mean"] is None  # noqa: E731
                     else f"{s['mean']:.1%} ± {s['std']:.1%}")
    steps, seeds, timing = summary["steps"], summary["seeds"], summary["timing"]
    lines = [f"Ablation: {steps} steps, seeds {seeds}; mean ± standard deviation over seeds. "
             "Training numbers over every sampled trajectory at T=1.0; last third = steps "
             f"{steps - max(1, steps // 3) + 1}-{steps}. `python demo.py ablation=true`: "
             f"{timing['seconds']:.0f} s for the runs ({timing.get('parallel', 1)} at a time), "
             f"load average {timing['load_average_before'][0]:.1f} before, "
             f"{timing['load_average_after'][0]:.1f} after.", "",
             "| arm | rollouts sampled / trained per step | train accuracy, step 1 "
             "| train accuracy, last third | tool-error ratio in correct, step 1 "
             "| at the last step's batch | over the last third |",
             "|---|---|---|---|---|---|---|"]
    for name, arm in summary["arms"].items():
        lines.append(f"| {name} | {arm['rollouts_per_step']} / {arm['trained_per_step']:.0f} "
                     f"| {pct(arm['accuracy_first_step'])} | {pct(arm['accuracy_last_third'])} "
                     f"| {pct(arm['tool_error_ratio_in_correct_first_step'])} "
                     f"| {pct(arm['tool_error_ratio_in_correct_last_step'])} "
                     f"| {pct(arm['tool_error_ratio_in_correct_last_third'])} |")
    finals = {name: arm for name, arm in summary["arms"].items()
              if arm["final_accuracy"]["mean"] is not None}
    if finals:
        lines += ["", f"The policy after step {steps}, on the held-out problems at the training "
                      f"temperature ({max(a['final_trajectories'] for a in finals.values())} "
                      "trajectories per seed):", "",
                  "| arm | held-out accuracy | tool-error ratio in correct trajectories |",
                  "|---|---|---|"]
        for name, arm in finals.items():
            lines.append(f"| {name} | {pct(arm['final_accuracy'])} "
                         f"| {pct(arm['final_tool_error_ratio_in_correct'])} |")
    lines.append("")
    at_last = ("at the last step (the final policy, held out)"
               if summary.get("last_step_measure", "").startswith("final")
               else "at the last step (its training batch)")
    for name, result in summary["roc_below"].items():
        for where, r in result.items():
            label = at_last if where == "last_step" else "over the last third"
            if r is None:
                lines.append(f"- RoC vs {name}, {label}: no correct trajectory with a tool call in "
                             "some arm")
                continue
            verdict = "holds" if r["holds"] else "does NOT hold"
            lines.append(f"- RoC's tool-error ratio in correct trajectories below {name}'s "
                         f"{label}: by {r['margin']:+.1%} against a seed spread (larger std) of "
                         f"{r['spread']:.1%}: {verdict}; "
                         f"seed ranges {'disjoint' if r['ranges_disjoint'] else 'overlap'}")
    return lines


def smooth(values, window):
    """Trailing moving average over `window` steps, skipping steps with nothing to measure."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else None)
    return out


def plot_ablation(runs, arms, cfg):
    import matplotlib  # only the ablation plots (see the imports)

    matplotlib.use("Agg")  # no display on a server; before pyplot is imported
    import matplotlib.pyplot as plt

    # Left: training accuracy; right: the paper's Fig. 4 quantity, which RoC's choice of positives
    # is meant to push down. Per arm the seed mean and, shaded, the seed min..max, each seed first
    # smoothed over `ablation_smooth` steps (8 prompts a step are noisy; the table's numbers are not
    # smoothed).
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"GRPO": "tab:blue", "GRPO-RoC": "tab:red", "GRPO, 2G kept": "tab:green"}
    steps = list(range(1, cfg.ablation_steps + 1))
    for ax, key, title in zip(axes, ("accuracy", "tool_error_ratio_in_correct"),
                              ("Training accuracy (T=1.0)",
                               "Tool-error ratio in correct trajectories (Fig. 4)")):
        for name in arms:
            curves = [smooth([at_step(runs[(name, s)], key, step) for step in steps],
                             cfg.ablation_smooth)
                      for s in cfg.ablation_seeds]
            stats = [seed_spread([c[i] for c in curves]) for i in range(len(steps))]
            xs = [x for x, s in zip(steps, stats) if s["mean"] is not None]
            stats = [s for s in stats if s["mean"] is not None]
            ax.plot(xs, [s["mean"] for s in stats], color=colors.get(name), lw=2,
                    label=f"{name} ({len(cfg.ablation_seeds)} seeds, mean)")
            ax.fill_between(xs, [s["min"] for s in stats], [s["max"] for s in stats],
                            color=colors.get(name), alpha=0.15)
        ax.set(xlabel="RL step", title=title,
               ylabel="reward" if key == "accuracy" else "failed calls / calls")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"tiny model: plain GRPO vs GRPO-RoC vs GRPO with 2G kept, {cfg.ablation_steps} "
                 f"steps; shaded: seed min..max; {cfg.ablation_smooth}-step trailing mean "
                 "(python demo.py ablation=true)", fontsize=8)
    fig.tight_layout()
    path = resolve(cfg.plot)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    stop_on_signals(forward_to=RUNNING)
    try:
        config = load_config(DemoConfig, sys.argv[1:], doc=__doc__)
    except ConfigError as e:
        sys.exit(f"demo.py: {e}")
    try:
        ablation(config) if config.ablation else demo(config)
    except (KeyboardInterrupt, SystemExit):
        if not interrupted():
            raise
        # The stages got the signal too and ended themselves, each with its own paragraph
        command = shlex.join(["python", "demo.py", *sys.argv[1:]])
        print(f"demo.py: interrupted. `{command}` goes on: finished stages are reused, an "
              "interrupted rl.py resumes from its last checkpoint", flush=True)
        sys.exit(exit_status())
