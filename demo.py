"""The tiny CPU demo: the whole rStar2-Agent pipeline on a 0.76M-parameter model that learns to use
a Python tool (docs/tiny-task.md: the task's design and its numbers).

    python demo.py                  # tiny model, SFT, RL (GRPO-RoC): the before/after table
    python demo.py ablation=true    # GRPO vs GRPO-RoC vs GRPO with 2G kept -> assets/ablation.png

Each stage is the README's own command, run as a subprocess and printed, so the demo is also a
transcript of how to run the pieces by hand:
    python tiny.py                          -> out/tiny-model, out/tiny-sft.jsonl
    (this file)                             -> out/tiny-rl-train.jsonl, out/tiny-rl-test.jsonl
    python sft.py configs/sft_tiny.yaml     -> runs/tiny-sft/final
    python rl.py configs/tiny.yaml          -> runs/tiny-rl/metrics.jsonl, runs/tiny-rl/hf_step_N
A stage whose result exists is reused while what made it is unchanged (stage_inputs; recorded in
runs/demo-stages/); a change reruns that stage and the ones after it, and says which files changed.
fresh=true reruns all. rl_args / sft_args pass key=value overrides through, e.g.
`python demo.py rl_args=steps=30,lr=1e-4`. The ablation's arms (Fig. 4 and 9): see ablation().
"""
import ast
import concurrent.futures
import contextlib
import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from machinery.config import REPO, atomic_write_text, ConfigError, load_config, PositiveInt, resolve
from machinery.exits import exit_status, interrupted, rerun_command, shown, stop_on_signals
from tools.compare import evals, read_metrics, write_comparison

# tiny.py and rollout.py (torch, transformers: ~4 s) are imported where a stage uses them (and
# matplotlib where tools.compare plots): demo.py itself runs no model, and --help or a config error
# should not wait for them.


@dataclasses.dataclass
class DemoConfig:
    ablation: bool = False
    fresh: bool = False                      # rerun every stage even if its output exists
    # RL prompts (split "train": disjoint from the SFT and held-out problems)
    train_problems: PositiveInt = 2000
    test_problems: PositiveInt = 100         # held-out (split "test", eval.py's `arith` set)
    data_seed: int = 0
    sft_config: str = "configs/sft_tiny.yaml"
    rl_config: str = "configs/tiny.yaml"
    sft_args: list[str] = dataclasses.field(default_factory=list)   # extra key=value for sft.py
    rl_args: list[str] = dataclasses.field(default_factory=list)    # ... for rl.py (both arms)
    # ablation
    ablation_dir: str = "runs/ablation"
    ablation_steps: PositiveInt = 20
    ablation_seeds: list[int] = dataclasses.field(default_factory=lambda: [0, 1, 2])
    # The last step's policy, measured on the held-out problems with this many samples each at the
    # training temperature: one training batch (8 prompts) is too few correct trajectories to read a
    # ratio from.
    ablation_final_samples: PositiveInt = 4
    # rl.py runs at once, each training on its share of the cores (1 thread on 2 cores)
    ablation_parallel: PositiveInt = 2
    ablation_smooth: PositiveInt = 3         # the plot's trailing mean over steps (not the table's)
    plot: str = "assets/ablation.png"        # the numbers go next to it as .json and .md

    def validate(self):
        if not self.ablation_seeds:
            raise ConfigError("ablation_seeds: empty; give at least one seed, e.g. [0]")
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
    if log:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") if log else contextlib.nullcontext() as out:
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


def stage_inputs(script, configs=(), args=(), data=(), upstream=()):
    """{what: sha256} of everything a stage's result depends on: the script and the repo modules it
    runs (code_files), the prompt templates, its config files, its key=value args, the data files
    it reads, the records of the stages before it, and the torch/transformers/vllm versions."""
    files = [*code_files(script), *sorted(resolve("configs/templates").resolve().iterdir()),
             *(resolve(f).resolve() for f in [*configs, *data] if f)]
    inputs = {str(f.relative_to(REPO) if f.is_relative_to(REPO) else f):
              hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    inputs["args"] = hashlib.sha256(json.dumps(list(args)).encode()).hexdigest()
    for name in upstream:
        inputs[f"stage {name}"] = hashlib.sha256(json.dumps(
            read_stage(name).get("inputs")).encode()).hexdigest()
    for package in ("torch", "transformers", "vllm"):
        try:  # vLLM's CPU wheel is installed under another distribution name
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
    if not fresh and complete and (not record or record["inputs"] == inputs and record["done"]):
        print(f"demo.py: reusing {shown(output)} ({name}, from {when}): " + (
            "unchanged" if record else "as it is, no record of what made it")
            + "; fresh=true reruns every stage", flush=True)
        return True
    if fresh or (record and record["inputs"] != inputs):
        if record and not fresh:
            changed = sorted(k for k in {*inputs, *record["inputs"]}
                             if inputs.get(k) != record["inputs"].get(k))
            print(f"demo.py: rerunning {name}: {', '.join(changed)} changed since {when}",
                  flush=True)
        shutil.rmtree(output, ignore_errors=True)
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


def train_rl(cfg, out_dir, args, log=None):
    """rl.py into out_dir, unless its result is there and still current (reuse_stage; a cut-off
    run resumes); returns its per-step metrics and its seconds (0 when reused)."""
    name = "rl" if out_dir == config_value(cfg.rl_config, "out_dir") else out_dir.replace("/", "-")
    overrides = [f"out_dir={out_dir}", *cfg.rl_args, *args]
    data = [config_value(cfg.rl_config, key) for key in ("train_data", "eval_data")]
    inputs = stage_inputs("rl.py", [cfg.rl_config], overrides, data, upstream=["sft"])
    if reuse_stage(name, out_dir, inputs, cfg.fresh,
                   any(resolve(out_dir).glob("hf_step_*/config.json"))):
        return read_metrics(resolve(out_dir)), 0.0
    seconds = run(["rl.py", cfg.rl_config, *overrides], log=log)
    stage_done(name)
    return read_metrics(resolve(out_dir)), seconds


# -----------------------------------------------------------------------------
# the demo: before/after table

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
        sys.exit(f"demo.py: {out_dir}/metrics.jsonl: no before/after evaluation (eval_data unset?)")
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
    run, model = shown(resolve(out_dir)), shown(resolve(out_dir) / f"hf_step_{after_step}")
    print(f"demo.py: the trained model is {model} (a Hugging Face directory); every step's numbers "
          f"are in {run}/metrics.jsonl; the saved trajectories as a page: "
          f"{rerun_command('-m tools.trajectories', [run, 'step=all'])}\nnext: "
          + rerun_command('eval.py', ['configs/eval_tiny.yaml', f'model={model}']), flush=True)
    return before, after


# -----------------------------------------------------------------------------
# the ablation: plain GRPO vs GRPO-RoC, and plain GRPO at RoC's rollout budget

def ablation(cfg):
    from rollout import RolloutConfig  # torch: only here (see the imports)

    prepare(cfg)
    # Only the algorithm and the group size differ; seeds, prompts (the data order depends only on
    # the seed) and steps are the same in every arm. arm -> (run-directory name, rl.py overrides)
    group = config_value(cfg.rl_config, "group_size")
    arms = {
        # G sampled, all kept (Fig. 9's baseline)
        "GRPO": ("grpo", ["algorithm=grpo", f"group_size={group}"]),
        # 2G sampled, RoC keeps G (§2.2.3)
        "GRPO-RoC": ("roc", ["algorithm=roc", f"group_size={group}"]),
        # RoC's rollout compute without its choice: 2G sampled and all trained on. RoC beating this
        # arm too means the effect comes from which positives are kept, not from sampling more.
        "GRPO, 2G kept": ("grpo2g", ["algorithm=grpo", f"group_size={2 * group}"]),
    }
    temperature = (config_value(cfg.rl_config, "rollout") or {}).get("temperature",
                                                                     RolloutConfig.temperature)
    # rl.py's held-out evaluation, after the last step only, at T of training
    final = ["eval_at_start=false", "eval_every=0", f"eval_samples={cfg.ablation_final_samples}",
             f"eval_temperature={temperature}"]
    # Runs are independent processes (own engine, tool workers, process group on its own port),
    # ablation_parallel at a time: each trains on its share of the cores, named here rather than
    # left to machinery/threads.py, which would count the other runs' work at the moment each
    # starts. So every number a run produces is fixed by its seed and this machine's core count;
    # only the seconds depend on what runs beside it.
    threads = f"train_threads={max(1, len(os.sched_getaffinity(0)) // cfg.ablation_parallel)}"
    jobs = {(name, seed): (f"{cfg.ablation_dir}/{slug}-seed{seed}",
                           [*overrides, f"seed={seed}", f"steps={cfg.ablation_steps}", *final,
                            f"save_every={cfg.ablation_steps}", threads])
            for name, (slug, overrides) in arms.items() for seed in cfg.ablation_seeds}
    load_before, started = os.getloadavg(), time.time()
    with concurrent.futures.ThreadPoolExecutor(cfg.ablation_parallel) as pool:
        # side by side, each run's progress bars go to its own log
        futures = {key: pool.submit(train_rl, cfg, out_dir, args, f"{resolve(out_dir)}.log"
                                    if cfg.ablation_parallel > 1 else None)
                   for key, (out_dir, args) in jobs.items()}
        results = {key: future.result() for key, future in futures.items()}
    timing = {"seconds": time.time() - started, "parallel": cfg.ablation_parallel,
              "load_average_before": load_before, "load_average_after": os.getloadavg()}
    # the table and plot of tools/compare.py, which compares any arms' run directories this way
    lines = write_comparison(
        {key: metrics for key, (metrics, _) in results.items()}, cfg.plot, "GRPO-RoC",
        "`python demo.py ablation=true`", "tiny model: plain GRPO vs GRPO-RoC vs GRPO with 2G kept",
        cfg.ablation_smooth,
        final_trajectories=cfg.test_problems * cfg.ablation_final_samples, timing=timing)
    print("\n" + "\n".join(lines), flush=True)
    path = shown(resolve(cfg.plot))
    print(f"demo.py: wrote {path}, its numbers in {path.removesuffix('.png')}.json and .md, and "
          f"each run in {shown(resolve(cfg.ablation_dir))}/ARM-seedN", flush=True)
    return lines


if __name__ == "__main__":
    stop_on_signals(forward_to=RUNNING)
    try:
        config = load_config(DemoConfig, sys.argv[1:], doc=__doc__)
        ablation(config) if config.ablation else demo(config)
    except ConfigError as e:
        sys.exit(f"demo.py: {e}")
    except (KeyboardInterrupt, SystemExit):
        if not interrupted():
            raise
        # The stages got the signal too and ended themselves, each with its own paragraph
        print(f"demo.py: interrupted. `{rerun_command('demo.py', sys.argv[1:])}` goes on: "
              "finished stages are reused, rl.py resumes from its last checkpoint", flush=True)
        sys.exit(exit_status())
