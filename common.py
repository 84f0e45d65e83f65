"""What several scripts share: config loading, the data files, distributed setup, checkpoints, metrics.

Nothing here is the method; it is the plumbing that keeps sft.py, rl.py and eval.py short. Every script is run as
`python SCRIPT.py [CONFIG.yaml] [key=value ...]` (dotted keys for nested sections: rollout.max_turns=15), and
load_config() maps that onto its own typed dataclass: a bad key, type or file stops the run with a message naming it.

torch is imported inside the functions that use it, not here: reward.py, plan.py and prepare_data.py import this
file for configs and data, and reward.py's math-verify workers start from it, where torch would cost seconds and memory.
The device seam is here too (init_distributed's backend, compute_dtype, free_cached_memory, cpu_threads): the only
places where CUDA and CPU differ, so the training loops read the same on both.
"""
import dataclasses
import difflib
import gc
import json
import os
import random
import shutil
import sys
import time
import typing
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent


class ConfigError(ValueError):
    """A bad config file, key, value or data row. The message says which."""


# -----------------------------------------------------------------------------
# config: YAML + key=value overrides onto a typed dataclass

def _coerce(value, tp, where):
    """Check `value` against the annotation `tp`; convert the few lossless cases (int -> float, "1e-6" -> float)."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (typing.Any,)
        if isinstance(value, str):  # benchmarks=aime24,aime25 or ks=1,16 on the command line
            value = [yaml.safe_load(v) for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is typing.Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an int, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a float, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # model=123 or a numeric run name
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
    name = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
    raise ConfigError(f"{where}: unsupported config type {name}")


def _line_numbers(text):
    """Map dotted key -> line number in a YAML document, so errors can say file:line."""
    lines = {}

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                lines[key] = key_node.start_mark.line + 1
                walk(value_node, key + ".")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return lines


def _apply(cfg, updates, source, lines, prefix=""):
    """Set the fields of dataclass instance `cfg` from the mapping `updates`, recursing into nested sections."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    hints = typing.get_type_hints(type(cfg))
    for key, value in updates.items():
        dotted = f"{prefix}{key}"
        line = lines.get(dotted)
        where = f"{source}:{line}: '{dotted}'" if line else f"{source}: '{dotted}'"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}: unknown key{hint}; {type(cfg).__name__} has {sorted(fields)}")
        tp = hints[key]
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: is a section ({type(current).__name__}); expected a mapping, got {value!r}")
            _apply(current, value, source, lines, dotted + ".")
        else:
            setattr(cfg, key, _coerce(value, tp, where))


def load_config(cls, argv=None):
    """Build a `cls` dataclass from `[CONFIG.yaml] [key=value ...]` (default: sys.argv[1:]): the dataclass's
    defaults, then the YAML file, then the overrides, parsed as YAML scalars (`lr=1e-6`, `benchmarks=aime24,aime25`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = cls()
    if argv and "=" not in argv[0]:
        path = Path(argv.pop(0))
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        text = path.read_text()
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
        _apply(cfg, data, str(path), _line_numbers(text))
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"command line: bad override {arg!r}; expected key=value (the config file must come first)")
        key, raw = arg.split("=", 1)
        if not key:
            raise ConfigError(f"command line: bad override {arg!r}; the key is empty")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        for part in reversed(key.split(".")):  # rollout.max_turns=15 -> {"rollout": {"max_turns": 15}}
            value = {part: value}
        _apply(cfg, value, "command line", {})
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def save_config(cfg, run_dir):
    """Print the resolved config and save it as run_dir/config.yaml, so every run says what it ran with."""
    text = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    print(f"# {type(cfg).__name__}\n{text}", flush=True)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(run_dir) / "config.yaml", text)


def atomic_write_text(path, text):
    """Write-then-rename, so a reader never sees half a file (a crash leaves the old file intact)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -----------------------------------------------------------------------------
# data: JSONL problem files, validated row by row

# The benchmarks eval.py knows, and the files training may read. Training never reads a benchmark file;
# tests/test_common.py checks that no training problem equals a benchmark problem.
BENCHMARKS = {"aime24": "data/aime24.jsonl", "aime25": "data/aime25.jsonl", "hmmt25": "data/hmmt_feb_2025.jsonl",
              "amc23": "data/amc23.jsonl", "math500": "data/math500.jsonl", "gsm8k": "data/gsm8k_test.jsonl"}
TRAINING_FILES = ["data/train_int_mix.jsonl", "data/math_train.jsonl", "data/math_test4500.jsonl",
                  "data/aime_1983_2023.jsonl", "data/gsm8k_train.jsonl"]


def resolve(path):
    """Relative paths are relative to the repo, so scripts work from any working directory."""
    path = Path(path)
    return path if path.is_absolute() or path.exists() else REPO / path


def load_jsonl(path, required=None):
    """Read a JSONL file; every row must be a JSON object whose `required` keys are non-empty strings. A bad row
    stops with `file:line: reason`: a silently skipped row is a silently changed dataset (a wrong gold, a wrong reward).
    """
    path = resolve(path)
    if not path.is_file():
        raise ConfigError(f"data file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            for key in required or ():
                if key not in row:
                    raise ConfigError(f"{path}:{lineno}: missing key '{key}'")
                if not isinstance(row[key], str) or not row[key].strip():
                    raise ConfigError(f"{path}:{lineno}: '{key}' must be a non-empty string, got {row[key]!r}")
            rows.append(row)
    if not rows:
        raise ConfigError(f"{path}: no rows")
    return rows


def load_problems(path):
    """Math problems: rows with non-empty string id, problem and answer; ids unique within the file."""
    rows = load_jsonl(path, required=("id", "problem", "answer"))
    seen = {}
    for lineno, row in enumerate(rows, 1):
        if row["id"] in seen:
            raise ConfigError(f"{resolve(path)}: duplicate id {row['id']!r} (rows {seen[row['id']]} and {lineno})")
        seen[row["id"]] = lineno
    return rows


def normalize_problem(text):
    """The key under which two problems count as the same: whitespace collapsed."""
    return " ".join(text.split())


# -----------------------------------------------------------------------------
# distributed and device: one code path from `python x.py` on a CPU to torchrun on 8 GPU nodes

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SINGLE_PROCESS_MARKER = "RSTAR2_SINGLE_PROCESS_WORLD"  # "pid:port" of the process that made itself a world of one


def init_distributed():
    """Start torch.distributed and return (rank, world_size, local_rank, device). A plain `python x.py` becomes a
    world of one with torchrun's env variables set, so FSDP2, the TCPStore work counter and vLLM's external_launcher
    take exactly the path they take on 64 GPUs."""
    import torch
    import torch.distributed as dist

    store = None
    # A child process (demo.py's stages, a test's subprocess) inherits the variables a single-process parent set
    # below; taken for torchrun's, they would send it to bind the parent's port (EADDRINUSE, seen in CI). The
    # marker tells them apart: torchrun sets its own MASTER_PORT, so a child of torchrun is never mistaken.
    inherited = os.environ.get(SINGLE_PROCESS_MARKER, "").split(":")
    if len(inherited) == 2 and inherited[0] != str(os.getpid()) and inherited[1] == os.environ.get("MASTER_PORT"):
        for key in (*TORCHRUN_VARIABLES, SINGLE_PROCESS_MARKER):
            os.environ.pop(key, None)
    if "RANK" not in os.environ and not dist.is_initialized():
        # The store binds port 0 itself: asking the OS for a free port and binding it later races with any other
        # process that takes an ephemeral port in between (EADDRINUSE, seen in CI).
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
        os.environ[SINGLE_PROCESS_MARKER] = f"{os.getpid()}:{store.port}"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"  # gloo for the object collectives on CPU tensors, nccl for the rest
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        if store is not None:
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
        else:
            dist.init_process_group(backend=backend)
    return rank, world_size, local_rank, device


def compute_dtype(device, requested="auto"):
    """The dtype of forward/backward and of an exported model: bf16 on GPU, fp32 on CPU, where bf16 is ~4.5x slower
    than fp32 on AVX2 (cpu-stack.md §2). A `requested` train_dtype other than auto wins."""
    import torch

    return getattr(torch, requested if requested != "auto" else "bfloat16" if device.type == "cuda" else "float32")


def free_cached_memory():
    """Give the blocks PyTorch's allocator caches but no tensor uses back to the GPU (a no-op on CPU). vLLM's
    sleep-mode allocator maps its memory outside PyTorch's cache, so it cannot reuse those blocks: after a 14B
    training step some 45-50 GB of them would still be held when the engine wakes."""
    import torch

    gc.collect()  # tensors only a reference cycle still holds
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def cpu_threads(count, device):
    """On CPU, set torch's threads to `count` (0: leave them); returns the previous count. In-process vLLM sets
    torch to 1 thread "for serving" and replaces torch.set_num_threads with a no-op, so this calls the builtin."""
    import torch

    previous = torch.get_num_threads()
    if count and device.type == "cpu":
        torch._C.set_num_threads(count)
    return previous


def seed_everything(seed):
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# -----------------------------------------------------------------------------
# checkpoints: torch.distributed.checkpoint, atomic by rename

CHECKPOINT_PREFIX = "step_"


def latest_checkpoint(ckpt_root):
    """The newest complete checkpoint directory, or None. A directory gets its final name only after every rank has
    written it (save_checkpoint), so a run killed mid-save leaves a `.tmp` directory that is never picked up."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return None
    done = sorted(p for p in ckpt_root.iterdir()
                  if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and (p / "COMPLETE").exists())
    return done[-1] if done else None


def save_checkpoint(ckpt_root, step, model, optimizer, trainer_state, keep=2):
    """Save model + optimizer (sharded, via DCP) and `trainer_state` (step, data position, per-rank RNG) into
    step_N.tmp/ on all ranks; rank 0 renames it to step_N/ after a barrier, the commit point. Needs a filesystem
    every rank sees (multi-node: a shared one)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    final = Path(ckpt_root) / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "numpy": __import__("numpy").random.get_state()}
    torch.save({"trainer_state": trainer_state, "rng": rng}, tmp / f"trainer_state_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (tmp / "COMPLETE").write_text(json.dumps({"step": step, "time": time.time()}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        old = sorted(p for p in Path(ckpt_root).iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
                     and not p.name.endswith(".tmp"))[:-keep]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path, model, optimizer):
    """Load a checkpoint written by save_checkpoint into an already FSDP-wrapped model and its optimizer.
    Restores this rank's RNG streams and returns the saved trainer_state."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank = dist.get_rank()
    rank_file = path / f"trainer_state_rank{rank}.pt"
    if not rank_file.exists():
        raise ConfigError(f"{path}: no {rank_file.name}; was this checkpoint written by a run with a different world size?")
    saved = torch.load(rank_file, weights_only=False)
    random.setstate(saved["rng"]["python"])
    torch.set_rng_state(saved["rng"]["torch"])
    np.random.set_state(saved["rng"]["numpy"])
    return saved["trainer_state"]


# -----------------------------------------------------------------------------
# metrics: one JSON line per step, optional wandb / tensorboard

class MetricsLogger:
    """Appends one JSON object per step to run_dir/metrics.jsonl (rank 0 only); mirrors to wandb/tensorboard
    when asked. On resume, lines past the resumed step are dropped so the file stays one line per step."""

    def __init__(self, run_dir, enabled=True, wandb_project="", tensorboard=False, config=None, resume_step=0):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = self.tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [l for l in self.path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(l + "\n" for l in kept))
        if wandb_project:
            import wandb  # optional: pip install wandb

            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(run_dir), resume="allow")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional: pip install tensorboard

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def log(self, step, metrics):
        if not self.enabled:
            return
        row = {"step": step, **{k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str)) else v)
                                for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb:
            self.wandb.log(row, step=step)
        if self.tb:
            for k, v in row.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self):
        if self.wandb:
            self.wandb.finish()
        if self.tb:
            self.tb.close()
