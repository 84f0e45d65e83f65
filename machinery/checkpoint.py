"""DCP checkpoints: every rank writes step_N.tmp/, rank 0's rename commits step_N/ (the only names
a run reads); resumable at any world size. Where a run starts from."""
import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from transformers import AutoConfig, AutoModelForCausalLM

from machinery.config import ConfigError, resolve
from machinery.data import load_problems
from machinery.engine import check_heads_split
from machinery.exits import fault_point
from machinery.lock import hold_lease
from machinery.model import build_model, check_model_dir

CHECKPOINT_PREFIX = "step_"
COMMITTED = re.compile(r"step_\d{8}")  # never step_N.tmp/: a save not committed, COMPLETE or not


def committed_checkpoints(ckpt_root):
    """The committed checkpoints under ckpt_root, oldest first."""
    ckpt_root = Path(ckpt_root)
    return sorted(p for p in ckpt_root.iterdir() if COMMITTED.fullmatch(p.name)
                  and (p / "COMPLETE").is_file()) if ckpt_root.is_dir() else []


def latest_checkpoint(ckpt_root):
    return (committed_checkpoints(ckpt_root) or [None])[-1]


def checkpoint_step(checkpoint):
    return int(Path(checkpoint).name[len(CHECKPOINT_PREFIX):])


def checkpoint_damage(checkpoint):
    """Why a committed checkpoint cannot be loaded, naming the file, or "": a shard shorter than
    .metadata says (DCP keeps no checksums), or a rank's trainer state that does not load."""
    checkpoint = Path(checkpoint)
    try:
        storage = FileSystemReader(str(checkpoint)).read_metadata().storage_data
        ranks = json.loads((checkpoint / "COMPLETE").read_text()).get("world_size", 1)
    except Exception as e:  # missing, or cut off mid-write: whatever the parser raises
        return f"{checkpoint}/.metadata or COMPLETE: unreadable ({type(e).__name__})"

    for info in storage.values():
        path = checkpoint / info.relative_path
        if not path.is_file() or path.stat().st_size < info.offset + info.length:
            return f"{path}: {'truncated' if path.is_file() else 'missing'}"
    for rank in range(ranks):
        path = checkpoint / f"trainer_state_rank{rank}.pt"
        try:
            torch.load(path, weights_only=False)
        except Exception as e:  # missing, truncated: whatever torch's reader raises
            return f"{path}: unreadable ({type(e).__name__})"
    return ""


def check_fits(checkpoint, model):
    """Refuse a checkpoint of another model before anything loads: .metadata's shapes against the
    model's config.json's (a hub id is checked as the checkpoint loads)."""
    config_file = resolve(model) / "config.json"
    if checkpoint is None or not config_file.is_file():
        return
    saved = {name[len("model."):]: tuple(item.size) for name, item in FileSystemReader(
        str(checkpoint)).read_metadata().state_dict_metadata.items()
        if name.startswith("model.") and hasattr(item, "size")}
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_file.parent))
    shapes = {name: tuple(t.shape) for name, t in expected.state_dict().items()}
    differs = [name for name in sorted(shapes.keys() | saved.keys())
               if shapes.get(name) != saved.get(name)]
    if differs:
        raise ConfigError(f"{checkpoint}: a checkpoint of another model ({differs[0]} differs); "
                          "resume it with its own model, or use another out_dir")


def save_checkpoint(ckpt_root, step, model, optimizer, trainer_state, keep=2, keep_through=0):
    written = write_checkpoint(ckpt_root, step, model, optimizer, trainer_state)
    return commit_checkpoint(written, keep=keep, keep_through=keep_through)


def write_checkpoint(ckpt_root, step, model, optimizer, trainer_state):
    """Model + optimizer (DCP) and each rank's trainer state (step, data position, RNG) into
    step_N.tmp/, fsynced; -> that directory, read by no run until committed. Collective."""
    rank = dist.get_rank()
    tmp = Path(ckpt_root) / f"{CHECKPOINT_PREFIX}{step:08d}.tmp"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "numpy": np.random.get_state()}
    with open(tmp / f"trainer_state_rank{rank}.pt", "wb") as f:
        torch.save({"trainer_state": trainer_state, "rng": rng}, f)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()
    return tmp


def commit_checkpoint(tmp, keep=2, keep_through=0):
    """Rank 0, holding the run's lease, commits step_N.tmp/: COMPLETE (with the world size) and the
    rename, each fsynced; then the newest `keep` after step `keep_through` are kept (older ones:
    earlier settings, run_dir.py). Collective."""
    final = tmp.with_name(tmp.name[:-len(".tmp")])
    fault_point("checkpoint_commit")  # a test's SIGKILL mid-save: every shard written, no commit
    if dist.get_rank() == 0:
        hold_lease(tmp.parent.parent)  # the run directory's, when this process holds it
        with open(tmp / "COMPLETE", "w") as f:
            json.dump({"step": checkpoint_step(final), "time": time.time(),
                       "world_size": dist.get_world_size()}, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_directory(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_directory(final.parent)
        for old in [p for p in committed_checkpoints(final.parent)
                    if checkpoint_step(p) > keep_through][:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _fsync_directory(path):
    fd = os.open(path, os.O_RDONLY)  # its entries (a file's name, a rename), not only the files
    os.fsync(fd)
    os.close(fd)


def remove_unfinished(ckpt_root, rank):
    """Rank 0 deletes (and names) each step_N.tmp/ a dead attempt left: never read, full-size."""
    ckpt_root = Path(ckpt_root)
    if rank != 0 or not ckpt_root.is_dir():
        return
    for tmp in sorted(ckpt_root.glob(f"{CHECKPOINT_PREFIX}*.tmp")):
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"removed {tmp}: a checkpoint whose save did not finish", flush=True)


def load_checkpoint(path, model, optimizer):
    """A checkpoint into the FSDP model and its optimizer, at any world size; -> the trainer_state.
    A rank the saving run lacked takes rank 0's (step, data position: global) and keeps its seeded
    RNG: sampling seeds and RoC's draws never come from these."""
    path = Path(path)
    load_training_state(path, model, optimizer)
    rank_file = path / f"trainer_state_rank{dist.get_rank()}.pt"
    if not rank_file.exists():
        return torch.load(path / "trainer_state_rank0.pt", weights_only=False)["trainer_state"]
    saved = torch.load(rank_file, weights_only=False)
    random.setstate(saved["rng"]["python"])
    torch.set_rng_state(saved["rng"]["torch"])
    np.random.set_state(saved["rng"]["numpy"])
    return saved["trainer_state"]


def load_training_state(path, model, optimizer):
    """A checkpoint's model and optimizer alone, at any world size (rl.py's replay runs on any)."""
    path = Path(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:  # every rank raises it: DCP gathers each rank's failure
        raise ConfigError(f"{path}: failed to load ({str(e).splitlines()[0][:300]}); name an "
                          "older one as resume=") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def requested_checkpoint(resume, ckpt_root):
    """The checkpoint `resume` names: None (never), the newest intact one (auto; each damaged
    newer one passed over with a warning), or the path given, intact, never swapped."""
    if resume == "never":
        return None

    if resume == "auto":
        committed = committed_checkpoints(ckpt_root)
        for checkpoint in reversed(committed):
            damage = checkpoint_damage(checkpoint)
            if not damage:
                return checkpoint
            print(f"WARNING: {damage}: checkpoint {checkpoint.name} passed over for an older one",
                  flush=True)
        if committed:  # never a silent restart from step 0
            raise ConfigError(f"{ckpt_root}: no intact checkpoint to resume from (newest: "
                              f"{checkpoint_damage(committed[-1])}); repair it, or a new out_dir")
        return None

    checkpoint = resolve(resume)
    if not (COMMITTED.fullmatch(checkpoint.name) and (checkpoint / "COMPLETE").is_file()):
        raise ConfigError(f"resume={resume}: not a committed checkpoint (step_N/COMPLETE)")
    damage = checkpoint_damage(checkpoint)
    if damage:
        raise ConfigError(f"resume={resume}: damaged ({damage}); name an intact one as resume=")
    return checkpoint


def start_checkpoint(cfg, checkpoint):
    """(the checkpoint this run starts from or None, whether only its weights are taken), given its
    run directory's (claim_run_dir). init_from counts only while the run has none of its own, and
    is never swapped for an older one (a stage would start from the wrong weights)."""
    initial = checkpoint is None and cfg.resume == "auto" and bool(cfg.init_from)
    if initial:
        source = resolve(cfg.init_from)
        checkpoint = (latest_checkpoint(source) or latest_checkpoint(source / "checkpoints")
                      or source)
        damage = checkpoint_damage(checkpoint)  # no COMPLETE: unreadable
        if damage:
            raise ConfigError(f"init_from={cfg.init_from}: {damage}; name an intact step_N")
        check_fits(checkpoint, cfg.model)
    return checkpoint, initial and not cfg.init_optimizer


def load_weights(checkpoint, model):
    """The fp32 master weights alone, not the bf16 export, so stage 3 starts exactly where stage
    2's optimizer left them (§4.3 resets only the optimizer); at any world size."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(checkpoint))
    set_model_state_dict(model, state["model"])


def resume_run(checkpoint, model, optimizer, run_state, rank, ckpt_root):
    """The step sft.py's run starts at: 0, or `checkpoint`'s, loaded whole; the step alone fixes
    the data position and the lr, so it must come from this very run (run_state)."""
    remove_unfinished(ckpt_root, rank)
    if checkpoint is None:
        return 0
    saved = load_checkpoint(checkpoint, model, optimizer)
    mismatch = {k: (saved.get(k), v) for k, v in run_state.items() if saved.get(k) != v}
    if mismatch:
        raise ConfigError(f"{checkpoint}: the run changed since it was saved: {mismatch}")
    if rank == 0:
        print(f"resumed from {checkpoint} at step {saved['step']}", flush=True)
    return saved["step"]


def load_policy(cfg, device, rank):
    model, _ = build_model(cfg, cfg.model, device, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2))
    return model, optimizer


def restore(cfg, checkpoint, device, rank):
    """(policy, optimizer, run state) rl.py starts from: fresh, init_from's weights, or
    `checkpoint` whole."""
    checkpoint, weights_only = start_checkpoint(cfg, checkpoint)
    remove_unfinished(resolve(cfg.out_dir) / "checkpoints", rank)
    state = {"step": 0, "data_position": 0}
    model, optimizer = load_policy(cfg, device, rank)
    if weights_only:
        load_weights(checkpoint, model)
        if rank == 0:
            print(f"initialised from {checkpoint}: its weights only (init_optimizer=false)",
                  flush=True)
    elif checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer)
        if rank == 0:
            print(f"resumed from {checkpoint}: step {state['step']}, data position "
                  f"{state['data_position']}", flush=True)
    return model, optimizer, state


def check_config(cfg):
    """rl.py's RLConfig.validate after the method's keys: what one key's bounds cannot say."""
    longest = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    for wrong, refusal in (
            (not cfg.model, "model: set the policy to train, e.g. model=out/sft"),
            (not cfg.init_optimizer and not cfg.init_from,
             "init_optimizer=false takes the weights of init_from, which is not set"),
            (cfg.resume not in ("auto", "never") and not resolve(cfg.resume).is_dir(),
             f"resume={cfg.resume}: expected auto, never or a checkpoint directory"),
            (cfg.micro_batch_tokens < longest,
             f"micro_batch_tokens={cfg.micro_batch_tokens} cannot hold one trajectory of "
             f"rollout.max_prompt_tokens + max_response_tokens = {longest}")):
        if wrong:
            raise ConfigError(refusal)
    cfg.rollout.validate()


def check_inputs(cfg, world_size=None, gpus_per_node=None):
    """The inputs checked before a model or an engine loads; LOCAL_WORLD_SIZE read before vLLM's
    CPU platform rewrites it. cfg.world_size is mode=plan's assumption, not a requirement."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        gpus_per_node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus_per_node = gpus_per_node or world_size
    tp = cfg.rollout.tensor_parallel_size
    for ranks, what in ((world_size, "ranks"), (gpus_per_node, "GPUs per node")):
        if ranks % tp:  # an engine across two nodes would all-reduce over the network every token
            raise ConfigError(f"rollout.tensor_parallel_size={tp} must divide the {ranks} {what}")

    if cfg.prompts_per_step < world_size // tp:
        raise ConfigError(f"prompts_per_step={cfg.prompts_per_step} < {world_size // tp} engines")

    model = check_model_dir(cfg.model)
    if resolve(model).is_dir():  # a hub id's config is read as the engine starts
        check_heads_split(model, tp)
    problems = load_problems(cfg.train_data)
    eval_rows = load_problems(cfg.eval_data) if cfg.eval_data else []
    return model, problems, eval_rows


def epoch_plan(cfg, num_problems, start_step):
    """(passes over train_data this run makes, the line train() prints; a warning past 5)."""
    prompts = (cfg.steps - start_step) * cfg.prompts_per_step
    epochs = prompts / num_problems
    line = (f"plan: steps {start_step} -> {cfg.steps} x {cfg.prompts_per_step} prompts = "
            f"{prompts:,} prompts over {num_problems:,} problems of {cfg.train_data}: "
            f"{epochs:.1f} epochs")
    if epochs > 5:  # the paper's stage 1: 300 steps x 512 prompts over 42K problems, 3.7 (§4.2)
        line += f"\nWARNING: {epochs:.1f} passes over the same problems (> 5.0); add problems"

    return epochs, line
