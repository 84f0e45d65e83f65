"""Config loading, data validation and the train/benchmark split (common.py)."""
import dataclasses
import json
import re
import subprocess
import sys
import typing
from typing import Annotated

import pytest
from annotated_types import Interval

from machinery.data import BENCHMARKS, TRAINING_FILES, load_jsonl, load_problems
from machinery.config import (REPO, ConfigError, PositiveInt, config_help, config_summary,
                              load_config)
from machinery.metrics import warn_untrained


@dataclasses.dataclass
class Section:
    max_turns: int = 10
    temperature: float = 1.0


@dataclasses.dataclass
class Demo:
    model: str = "out/tiny-model"
    lr: float = 1e-6
    use_tool: bool = True
    benchmarks: list[str] = dataclasses.field(default_factory=lambda: ["aime24"])
    ks: list[int] = dataclasses.field(default_factory=lambda: [1])
    run_name: str | None = None
    rollout: Section = dataclasses.field(default_factory=Section)


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- config ----------------------------------------------------------------------------------------

def test_defaults_yaml_then_overrides_in_that_order(tmp_path):
    path = write(tmp_path, "lr: 2.0e-6\nrollout:\n  max_turns: 15\n")
    cfg = load_config(Demo, [path, "rollout.temperature=0.6", "lr=1e-5", "benchmarks=aime24,aime25",
                             "use_tool=false", "ks=1,16"])
    assert cfg.rollout.max_turns == 15 and cfg.rollout.temperature == 0.6
    # YAML reads "1e-5" as a string; the float field converts it
    assert cfg.lr == 1e-5 and isinstance(cfg.lr, float)
    assert cfg.benchmarks == ["aime24", "aime25"] and cfg.use_tool is False and cfg.ks == [1, 16]
    with pytest.raises(ConfigError, match=r"'ks'\[1\]: expected an int"):
        load_config(Demo, ["ks=1,x"])
    assert load_config(Demo, []) == Demo()  # no file: the embedded defaults


def test_a_single_value_for_a_list_key_is_a_list_of_one(tmp_path):
    assert load_config(Demo, ["ks=16", "benchmarks=aime25"]).ks == [16]
    assert load_config(Demo, [write(tmp_path, "ks: 4\nbenchmarks: aime24\n")]).ks == [4]
    assert load_config(Demo, ["ks=[1, 16]"]).ks == [1, 16] and load_config(Demo, ["ks="]).ks == []
    with pytest.raises(ConfigError, match=r"'ks'\[0\]: expected an int, got float 1.5"):
        load_config(Demo, ["ks=1.5"])
    with pytest.raises(ConfigError, match="'ks': expected a list, got dict"):
        load_config(Demo, ["ks={a: 1}"])


@dataclasses.dataclass
class Choices:
    correction: typing.Literal["none", "tis"] = "none"
    dtype: typing.Literal["auto", "float32"] = "auto"
    name: str = ""
    epochs: PositiveInt = 1
    warmup_ratio: Annotated[float, Interval(ge=0, lt=1)] = 0.0  # a fraction
    rollout: Section = dataclasses.field(default_factory=Section)


# Each refusal: (YAML text or None, overrides, what the one line must name: file:line, key, value).
REFUSALS = [
    ("lr: 1.0e-6\nrollout:\n  max_turn: 3\n", [], ["c.yaml:3", "'rollout.max_turn'",
                                                   "did you mean 'rollout.max_turns'"]),
    (None, ["lrr=1"], ["command line: 'lrr'", "did you mean 'lr'"]),
    ("rollout:\n  max_turns: ten\n", [], ["c.yaml:2", "'rollout.max_turns'", "'ten'"]),
    (None, ["use_tool=maybe"], ["'use_tool'", "maybe"]),
    (None, ["rollout=3"], ["'rollout'", "section"]),
    (None, ["lr=1", "lr"], ["command line", "'lr'"]),
    (None, ["=1"], ["command line", "'=1'"]),
    (None, ["nope.yaml"], ["nope.yaml"]),
    ("- 1\n- 2\n", [], ["c.yaml", "mapping"]),
    ("lr: [1\n", [], ["c.yaml", "YAML"]),
]
BOUND_REFUSALS = [  # on Choices: bounds and Literals, declared on the field
    ("epochs: 0\n", [], ["c.yaml:1", "'epochs'", ">= 1", "0"]),
    (None, ["warmup_ratio=1"], ["'warmup_ratio'", ">= 0 and < 1", "1.0"]),
    ("correction: off\n", [], ["c.yaml:1", "'correction'", "'off'", "['none', 'tis']"]),
    (None, ["dtype=no"], ["'dtype'", "'no'", "['auto', 'float32']"]),
    (None, ["name=yes"], ["'name'", "quote it"]),
    (None, ["correction=tiss"], ["'correction'", "'tiss'"]),
]


@pytest.mark.parametrize("cls, text, overrides, named", [(Demo, *case) for case in REFUSALS]
                         + [(Choices, *case) for case in BOUND_REFUSALS])
def test_a_bad_key_or_value_is_refused_in_one_line_naming_it(tmp_path, cls, text, overrides,
                                                              named):
    argv = ([write(tmp_path, text)] if text is not None else []) + overrides
    with pytest.raises(ConfigError) as refusal:
        load_config(cls, argv)
    message = str(refusal.value)
    assert "\n" not in message and all(part in message for part in named), message


def test_bounds_and_quoted_words_pass_when_they_hold():
    cfg = load_config(Choices, ['name="yes"', "correction=tis", "epochs=3", "warmup_ratio=0.5"])
    assert cfg == Choices("tis", "auto", "yes", 3, 0.5)


@pytest.mark.parametrize("script, args, line", [
    ("tiny.py", ["hiden_size=3"], "tiny.py: command line: 'hiden_size': unknown key (did you mean"),
    ("sft.py", ["configs/sft_tiny.yaml", "epochs=0"], "sft.py: command line: 'epochs'")])
def test_a_script_fails_at_once_with_one_line_not_a_traceback(script, args, line):
    proc = subprocess.run([sys.executable, script, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.startswith(line), proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1


@dataclasses.dataclass
class Documented:
    model: str = ""           # the policy to train
    # the method
    group_size: int = 16      # G, rollouts per
                              # prompt
    lr: float = 1e-6
    rollout: Section = dataclasses.field(default_factory=Section)

    def validate(self):
        if not self.model:
            raise ConfigError("model: set the policy")


def test_help_lists_every_key_with_its_default_its_comment_and_its_heading():
    text = config_help(Documented, "The summary.\n\n    python x.py c.yaml   # run\n\nMore.")
    lines = text.splitlines()
    assert lines[0].startswith("usage: python ") and "[key=value ...]" in lines[0]
    assert "The summary." in text and "python x.py c.yaml   # run" in text and "More." not in text
    assert re.search(r"^  model = '' +the policy to train$", text, re.M)
    # a comment continued on the next line is one comment; a comment line of its own heads a field
    assert re.search(r"^  group_size = 16 +G, rollouts per prompt$", text, re.M)
    assert lines.index("  # the method") + 1 == lines.index(next(
        line for line in lines if line.startswith("  group_size")))
    assert "  lr = 1.0e-06" in lines and "  rollout.max_turns = 10" in lines
    bounded = config_help(Choices)  # a bound or a Literal's choices before the comment
    assert re.search(r"^  epochs = 1 +\[>= 1\]$", bounded, re.M)
    assert re.search(r"^  warmup_ratio = 0.0 +\[>= 0, < 1\] a fraction$", bounded, re.M)
    assert re.search(r"^  dtype = auto +\[auto \| float32\]$", bounded, re.M)


def test_help_and_a_bare_command_line_print_the_usage(capsys):
    with pytest.raises(SystemExit) as stop:
        load_config(Documented, ["c.yaml", "--help"])
    assert stop.value.code == 0 and "group_size = 16" in capsys.readouterr().out
    # nothing given and the defaults cannot run: the error, then what the script takes
    with pytest.raises(ConfigError, match=r"(?s)model: set the policy.*usage: .*group_size = 16"):
        load_config(Documented, [])
    with pytest.raises(ConfigError, match=r"^model: set the policy$"):  # given something: the error
        load_config(Documented, ["lr=1"])


def test_the_summary_names_only_what_differs_from_the_defaults():
    cfg = load_config(Documented, ["model=m", "rollout.temperature=0.6"])
    summary = config_summary(cfg, "runs/x/config.yaml")
    assert "2 settings differ" in summary and "runs/x/config.yaml" in summary
    assert "model=m" in summary and "rollout.temperature=0.6" in summary and "lr=" not in summary


@pytest.mark.parametrize("script, flag, key", [
    ("rl.py", "--help", "  group_size = 16"), ("sft.py", "--help", "  lr = 5.0e-06"),
    ("eval.py", "--help", "  rollout.temperature = 0.6"), ("demo.py", "--help", "  fresh = false"),
    ("tiny.py", "--help", "  head_dim = 64"), ("prepare_data.py", "-h", "  source = ")])
def test_every_script_answers_help_with_its_usage_and_keys(script, flag, key):
    proc = subprocess.run([sys.executable, script, flag], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: python {script} [CONFIG.yaml] [key=value ...]")
    assert key in proc.stdout and "Traceback" not in proc.stderr


# -- data ------------------------------------------------------------------------------------------

def test_loader_reports_file_and_line_of_a_bad_row(tmp_path):
    good = {"id": "a", "problem": "1+1?", "answer": "2"}
    cases = {
        "{not json\n": "c.jsonl:2: not valid JSON",
        '["a list"]\n': "c.jsonl:2: not a JSON object",
        json.dumps({"id": "b", "problem": "x"}) + "\n":
            "c.jsonl:2: 'answer' must be a non-empty string",
        json.dumps({"id": "b", "problem": "x", "answer": 3}) + "\n":
            "c.jsonl:2: 'answer' must be a non-empty string",
        json.dumps({"id": "b", "problem": "x", "answer": "  "}) + "\n":
            "c.jsonl:2: 'answer' must be a non-empty string",
        json.dumps(good) + "\n": "duplicate id 'a'",
    }
    for bad_line, message in cases.items():
        path = write(tmp_path, json.dumps(good) + "\n" + bad_line, "c.jsonl")
        with pytest.raises(ConfigError, match=message):
            load_problems(path)
    with pytest.raises(ConfigError, match="data file not found"):
        load_problems(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="no rows"):
        load_jsonl(write(tmp_path, "\n", "empty.jsonl"))


def test_every_shipped_data_file_is_valid():
    counts = {name: len(load_problems(path)) for name, path in BENCHMARKS.items()}
    assert counts == {"aime24": 30, "aime25": 30, "hmmt25": 30, "amc23": 40, "math500": 500,
                      "gsm8k": 1319}
    for path in TRAINING_FILES:
        assert len(load_problems(path)) > 900


def test_training_files_hold_no_benchmark_problem():
    """Exact match after whitespace normalization (the 8-gram decontamination is in
    data/SOURCES.md). aime_1983_2023 marks its 5 known MATH-500 duplicates with overlaps_eval; they
    must never be used."""
    bench = {" ".join(r["problem"].split()) for path in BENCHMARKS.values()
             for r in load_problems(path)}
    for path in TRAINING_FILES:
        clean = [r for r in load_problems(path) if not r.get("overlaps_eval")]
        leaked = [r["id"] for r in clean if " ".join(r["problem"].split()) in bench]
        assert leaked == [], f"{path} contains benchmark problems: {leaked[:5]}"
    marked = [r["id"] for r in load_problems("data/aime_1983_2023.jsonl") if r.get("overlaps_eval")]
    assert len(marked) == 5


def test_a_child_of_a_single_process_world_starts_its_own_and_torchrun_children_keep_theirs(
        tmp_path):
    """A script that called init_distributed() as a plain process (RANK & co. now in its env) and
    starts another script: the child makes its own world of one on its own port; under torchrun the
    launcher's world wins."""
    child = tmp_path / "child.py"
    child.write_text(
        f"import os, sys; sys.path.insert(0, {str(REPO)!r})\n"
        "from machinery.distributed import init_distributed\n"
        "import torch.distributed as dist\n"
        "rank, world, _, _ = init_distributed()\n"
        # One file per process: two torchrun children printing to one pipe interleave
        # ('childchild 1 2 ...').
        f"open(os.path.join({str(tmp_path)!r}, f'child-{{os.getpid()}}.txt'), 'w').write("
        "f\"{os.environ.get('LOCAL_WORLD_SIZE')} {rank} {world} {os.environ['MASTER_PORT']}\")\n"
        "dist.barrier(); dist.destroy_process_group()\n")
    parent = (
        f"import os, subprocess, sys; sys.path.insert(0, {str(REPO)!r})\n"
        "from machinery.distributed import init_distributed\n"
        "init_distributed()\n"
        "print('parent', os.environ['MASTER_PORT'], flush=True)\n"
        f"subprocess.run([sys.executable, {str(child)!r}], check=True)\n"
        "subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', "
        f"'--nproc_per_node=2', {str(child)!r}], check=True)\n")
    proc = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parent_port = re.search(r"parent (\d+)", proc.stdout).group(1)
    children = [tuple(f.read_text().split()) for f in tmp_path.glob("child-*.txt")]
    assert len(children) == 3, proc.stdout + proc.stderr[-3000:]
    # torchrun's children run with LOCAL_WORLD_SIZE=2; the plain child made its world of one
    # (LOCAL_WORLD_SIZE=1)
    (plain,) = [c[1:] for c in children if c[0] == "1"]
    torchrun = [c[1:] for c in children if c[0] == "2"]
    assert plain[:2] == ("0", "1") and plain[2] != parent_port
    assert sorted(c[:2] for c in torchrun) == [("0", "2"), ("1", "2")]
    assert {c[2] for c in torchrun} != {parent_port}


def test_the_untrained_warning_says_why_and_repeats_at_each_doubling(capsys):
    solved = dict(groups=4, all_equal_group_fraction=1.0, accuracy=1.0, truncation_ratio=0.0)
    warned = []
    for streak in range(1, 26):
        warn_untrained(streak, solved, 3)
        if capsys.readouterr().out:
            warned.append(streak)
    assert warned == [3, 6, 12, 24]
    warn_untrained(3, solved, 3)
    assert "All rewards are 1" in capsys.readouterr().out
    warn_untrained(3, {**solved, "accuracy": 0.25}, 3)  # some groups all 0, some all 1
    said = " ".join(capsys.readouterr().out.split())
    assert "3 of 4 groups got reward 0" in said and "All rewards" not in said
    warn_untrained(3, solved, 0)  # untrained_steps_warn=0: never
    assert capsys.readouterr().out == ""
