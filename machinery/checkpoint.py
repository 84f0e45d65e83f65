"""DCP checkpoints: atomic by rename, resumable at any world size; where a run starts from."""
import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from transformers import AutoConfig, AutoModelForCausalLM

from machinery.config import ConfigError, require_at_least, resolve
from machinery.data import load_problems
from machinery.distributed import ranks_text
from machinery.engine import check_heads_split
from machinery.exits import fault_point
from machinery.model import build_model, check_model_dir

CHECKPOINT_PREFIX = "step_"


def latest_checkpoint(ckpt_root):
    """The newest complete checkpoint directory, or None. A directory gets its final name only after
    every rank has written it (save_checkpoint), so a run killed mid-save leaves a `.tmp` directory
    that is never picked up."""
    ckpt_root = Path(ckpt_root)
    if not ckpt_root.is_dir():
        return None
    done = sorted(p for p in ckpt_root.iterdir()
                  if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
                  and (p / "COMPLETE").exists())
    return done[-1] if done else None


def checkpoint_step(checkpoint):
    return int(Path(checkpoint).name[len(CHECKPOINT_PREFIX):])


def checkpoint_damage(checkpoint):
    """Why a complete checkpoint cannot be loaded, naming the file, or "" if it can: DCP's
    .metadata lists every shard file and the bytes read from it, so a missing or truncated shard
    shows without loading anything (a flipped byte would not: DCP stores no checksums)."""
    checkpoint = Path(checkpoint)
    try:
        storage = FileSystemReader(str(checkpoint)).read_metadata().storage_data
    except Exception as e:  # missing, or cut off mid-pickle: whatever the unpickler raises
        return f"{checkpoint / '.metadata'}: unreadable ({type(e).__name__}: {e})"
    needed = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    missing = sorted(name for name in needed if not (checkpoint / name).is_file())
    if missing:
        # DCP names rank r's shard __{r}_0.distcp: which ranks' writes went elsewhere
        ranks = sorted({int(name.split("_")[2]) for name in missing if name.startswith("__")})
        return (f"{checkpoint / missing[0]}: missing" + (
            f" (the shards of ranks {ranks_text(ranks)}: {len(missing)} of {len(needed)} files)"
            if ranks else ""))
    for name, size in sorted(needed.items()):
        path = checkpoint / name
        if path.stat().st_size < size:
            return f"{path}: truncated ({path.stat().st_size:,} of {size:,} bytes)"
    if not (checkpoint / "trainer_state_rank0.pt").is_file():
        return f"{checkpoint / 'trainer_state_rank0.pt'}: missing"
    return ""


def check_fits(checkpoint, model):
    """Refuse a checkpoint of another model before anything loads: DCP's .metadata holds every
    saved tensor's name and shape, and the model's config.json gives its own (the module built on
    the meta device, no memory). Names the first parameter whose shape differs, or the ones only
    one side has (a model of the same widths with more or fewer layers). A model that is no local
    directory (a hub id) is checked when the checkpoint loads."""
    config_file = resolve(model) / "config.json"
    if checkpoint is None or not config_file.is_file():
        return
    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_file.parent))
    shapes = {name: tuple(t.shape) for name, t in expected.state_dict().items()}
    found = {name[len("model."):]: tuple(item.size) for name, item in saved.items()
             if name.startswith("model.") and hasattr(item, "size")}
    differs = [name for name in shapes if name in found and found[name] != shapes[name]]
    lacks = sorted(set(shapes) - set(found))  # the model's, not in the checkpoint
    extra = sorted(set(found) - set(shapes))
    if not differs and not lacks and not extra:
        return
    if differs:
        what = (f"its {differs[0]} is {list(found[differs[0]])}, where {model} has "
                f"{list(shapes[differs[0]])}")
    elif len(lacks) == len(shapes):
        what = f"it holds none of {model}'s {len(shapes)} parameters"
    else:
        parts = []
        if lacks:
            parts.append(f"{len(lacks)} of {model}'s {len(shapes)} parameters are not in it "
                         f"(first: {lacks[0]})")
        if extra:
            parts.append(f"{len(extra)} of its {len(found)} are not in {model} "
                         f"(first: {extra[0]})")
        what = "; ".join(parts)
    raise ConfigError(f"{checkpoint}: a checkpoint of another model ({what}); it is not damaged. "
                      f"Resume it with the model it was trained from, or train {model} in "
                      "another out_dir")


def intact_checkpoint(ckpt_root, before=None):
    """The newest complete checkpoint under ckpt_root that is not damaged (and older than step
    `before`, if given), with a warning for each damaged one passed over; None, and no warning,
    when none is intact (the caller says so)."""
    ckpt_root = Path(ckpt_root)
    done = sorted(p for p in ckpt_root.iterdir()
                  if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
                  and (p / "COMPLETE").exists()) if ckpt_root.is_dir() else []
    passed = []
    for checkpoint in reversed(done):
        if before is not None and checkpoint_step(checkpoint) >= before:
            continue
        damage = checkpoint_damage(checkpoint)
        if not damage:
            for name, damage in passed:
                print(f"WARNING: checkpoint {name} is damaged: {damage}. Passed over for an older "
                      "one; its steps are trained again (deterministically: the same data and "
                      "seeds), and the damaged one is replaced when that step is saved.",
                      flush=True)
            return checkpoint
        passed.append((checkpoint.name, damage))
    return None


def save_checkpoint(ckpt_root, step, model, optimizer, trainer_state, keep=2, keep_through=0):
    """write_checkpoint, then commit_checkpoint: the checkpoint of `step`, atomic by rename.
    Collective."""
    written = write_checkpoint(ckpt_root, step, model, optimizer, trainer_state)
    return commit_checkpoint(written, keep=keep, keep_through=keep_through)


def write_checkpoint(ckpt_root, step, model, optimizer, trainer_state):
    """Save model + optimizer (sharded, via DCP) and `trainer_state` (step, data position, per-rank
    RNG) into step_N.tmp/ on all ranks; -> that directory, which no resume reads until
    commit_checkpoint names it. Collective. Needs a filesystem every rank sees (multi-node: a
    shared one)."""
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
    torch.save({"trainer_state": trainer_state, "rng": rng}, tmp / f"trainer_state_rank{rank}.pt")
    dist.barrier()
    return tmp


def commit_checkpoint(tmp, keep=2, keep_through=0):
    """The commit point of write_checkpoint's step_N.tmp/: rank 0 marks it COMPLETE and renames it
    step_N/, then keeps the newest `keep` of the checkpoints after step `keep_through` (those at or
    before it were saved under earlier settings: machinery/run_dir.py). Collective."""
    final = tmp.with_name(tmp.name[:-len(".tmp")])
    fault_point("checkpoint_commit")  # a test's SIGKILL mid-save: every shard written, no commit
    if dist.get_rank() == 0:
        (tmp / "COMPLETE").write_text(json.dumps({"step": checkpoint_step(final),
                                                  "time": time.time()}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        old = sorted(p for p in final.parent.iterdir()
                     if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
                     and not p.name.endswith(".tmp") and checkpoint_step(p) > keep_through)[:-keep]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    return final


def remove_unfinished(ckpt_root, rank):
    """Delete the step_N.tmp/ directories an attempt that died mid-save left (on rank 0, at start,
    the run directory claimed): never read, and a step not saved again would keep its (at 14B,
    165 GiB) forever. Names each."""
    ckpt_root = Path(ckpt_root)
    if rank != 0:
        return
    for tmp in sorted(ckpt_root.glob(f"{CHECKPOINT_PREFIX}*.tmp")) if ckpt_root.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"removed {tmp}: a checkpoint whose save did not finish", flush=True)


def load_checkpoint(path, model, optimizer):
    """Load a checkpoint written by save_checkpoint into an already FSDP-wrapped model and its
    optimizer; returns the saved trainer_state. DCP reshards the weights and moments to any world
    size. A rank the saving run had restores its RNG streams; a rank it did not have (a resume on
    more ranks) takes rank 0's trainer_state, which is global (step, data position), and keeps the
    RNG it was seeded with: the sampling seeds come from (seed, step, problem, sample) and RoC's
    draw from (seed, step, position), never from these streams."""
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
    """A checkpoint's model and optimizer alone, not its RNG or trainer state: DCP reads each rank's
    shard whatever the world size that wrote it (rl.py's replay runs on any)."""
    path = Path(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:  # every rank raises it: DCP gathers each rank's failure
        older = intact_checkpoint(path.parent, before=checkpoint_step(path))
        raise ConfigError(f"{path}: failed to load ({str(e).splitlines()[0][:300]}); "
                          + (f"the newest intact one before it: resume={older}" if older
                             else "no intact checkpoint before it")) from None
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def requested_checkpoint(resume, ckpt_root):
    """The checkpoint `resume` names: None (never), the newest intact one under ckpt_root (auto;
    a damaged newer one is passed over with a warning), or the path given, which must be intact:
    asked for by name, it is not swapped for another."""
    if resume == "never":
        return None
    if resume == "auto":
        checkpoint = intact_checkpoint(ckpt_root)
        newest = latest_checkpoint(ckpt_root)
        if checkpoint is None and newest is not None:  # never a silent restart from step 0
            raise ConfigError(
                f"{ckpt_root}: no intact checkpoint to resume from; the newest: "
                f"{checkpoint_damage(newest)}. Every rank writes its own shards into out_dir: on "
                "several nodes, a node-local out_dir keeps each node's shards on that node (a run "
                "on several nodes needs a filesystem every node sees at the same path). Copy the "
                f"missing shards into {newest}, or start a new run: a new out_dir")
        return checkpoint
    checkpoint = resolve(resume)
    if not (checkpoint / "COMPLETE").is_file():
        raise ConfigError(f"{checkpoint}: not a complete checkpoint (no COMPLETE marker); "
                          "expected a step_N directory written by rl.py, or a run directory's "
                          "checkpoints/ folder")
    damage = checkpoint_damage(checkpoint)
    if damage:
        older = intact_checkpoint(checkpoint.parent, before=checkpoint_step(checkpoint))
        raise ConfigError(f"resume={resume}: the checkpoint is damaged: {damage}; "
                          + (f"the newest intact one before it: resume={older}" if older
                             else "no intact one before it"))
    return checkpoint


def start_checkpoint(cfg, checkpoint):
    """(the checkpoint this run starts from or None, whether only its weights are taken), given
    the one its own run directory offers (claim_run_dir). init_from counts only while this run
    has no checkpoint of its own, so a restart resumes the run rather than starting it over."""
    initial = checkpoint is None and cfg.resume == "auto" and bool(cfg.init_from)
    if initial:
        source = resolve(cfg.init_from)
        checkpoint = (latest_checkpoint(source) or latest_checkpoint(source / "checkpoints")
                      or source)
    if checkpoint is not None and not (checkpoint / "COMPLETE").is_file():
        raise ConfigError(f"{checkpoint}: not a complete checkpoint (no COMPLETE marker); "
                          "expected a step_N directory written by rl.py, or a run directory's "
                          "checkpoints/ folder")
    # Another run's checkpoint is never swapped for an older one (as resume=auto does within a
    # run): a stage would silently start from the wrong weights.
    damage = checkpoint_damage(checkpoint) if initial else ""
    if damage:
        raise ConfigError(f"init_from={cfg.init_from}: {checkpoint} is damaged: {damage}; name "
                          "an intact checkpoint (a step_N directory) as init_from")
    if initial:
        check_fits(checkpoint, cfg.model)
    return checkpoint, initial and not cfg.init_optimizer


def load_weights(checkpoint, model):
    """The model's weights alone from a checkpoint of save_checkpoint: the fp32 master weights, not
    the bf16 Hugging Face export, so stage 3 starts from exactly where stage 2's optimizer left them
    (§4.3 resets only the optimizer). DCP reads each rank's shard, whatever the world size that
    wrote it."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(checkpoint))
    set_model_state_dict(model, state["model"])


def resume_run(checkpoint, model, optimizer, run_state, rank, ckpt_root):
    """The step sft.py's run starts at: 0, or `checkpoint`'s (claim_run_dir's choice), with its
    model, optimizer and RNG loaded. The step alone fixes the data position and the lr, so the
    checkpoint must come from this very run (run_state). A dead attempt's .tmp checkpoints under
    ckpt_root go (remove_unfinished)."""
    remove_unfinished(ckpt_root, rank)
    if checkpoint is None:
        return 0
    saved = load_checkpoint(checkpoint, model, optimizer)
    mismatch = {k: (saved.get(k), v) for k, v in run_state.items() if saved.get(k) != v}
    if mismatch:
        raise ConfigError(f"resume from {checkpoint}: the run changed since it was saved (saved, "
                          f"now): {mismatch}; the data order would differ. Use a new out_dir")
    if rank == 0:
        print(f"resumed from {checkpoint} at step {saved['step']}", flush=True)
    return saved["step"]


def load_policy(cfg, device, rank):
    model, _ = build_model(cfg, cfg.model, device, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2))
    return model, optimizer


def restore(cfg, checkpoint, device, rank):
    """(policy, optimizer, run state) this run starts from: fresh, init_from's weights alone, or
    `checkpoint` (claim_run_dir's choice) restored whole (model, optimizer, RNG, step, data
    position). Checkpoints are atomic by rename: a run killed mid-save resumes from the previous
    complete one."""
    checkpoint, weights_only = start_checkpoint(cfg, checkpoint)
    remove_unfinished(resolve(cfg.out_dir) / "checkpoints", rank)
    state = {"step": 0, "data_position": 0}
    model, optimizer = load_policy(cfg, device, rank)
    if weights_only:
        load_weights(checkpoint, model)
        if rank == 0:
            print(f"initialised from {checkpoint}: its weights only, a fresh optimizer from step 0 "
                  "(init_optimizer=false)", flush=True)
    elif checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer)
        if rank == 0:
            print(f"resumed from {checkpoint}: step {state['step']}, data position "
                  f"{state['data_position']}", flush=True)
    return model, optimizer, state


def check_config(cfg):
    """The rest of rl.py's RLConfig.validate, after the method's own keys (rl.py): paths, sizes,
    cadences and resume, each a ConfigError that names the key, before anything is loaded."""
    require_at_least(cfg, 1, "micro_batch_tokens", "save_every", "keep_checkpoints",
                     "eval_samples", "collective_timeout_min")
    require_at_least(cfg, 0, "micro_batch_size", "eval_every", "world_size", "train_threads",
                     "logprob_chunk_tokens", "log_samples", "save_rollouts_every",
                     "keep_rollouts", "untrained_steps_warn")
    if not cfg.model:
        raise ConfigError("model: set the policy to train (an HF directory with its tokenizer), "
                          "e.g. model=out/sft")
    if not cfg.init_optimizer and not cfg.init_from:
        raise ConfigError("init_optimizer=false takes the weights of init_from, which is not set")
    if cfg.resume not in ("auto", "never") and not resolve(cfg.resume).is_dir():
        raise ConfigError(f"resume={cfg.resume!r}: expected auto, never or a checkpoint directory")
    longest = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    if cfg.micro_batch_tokens < longest:
        raise ConfigError(f"micro_batch_tokens={cfg.micro_batch_tokens} cannot hold one trajectory "
                          "of rollout.max_prompt_tokens + rollout.max_response_tokens = "
                          f"{longest} tokens")
    try:
        cfg.rollout.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_inputs(cfg, world_size=None, gpus_per_node=None):
    """Everything that can be wrong with the inputs, before a model or an engine is loaded:
    torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE are read before any process group exists (and
    before vLLM's CPU platform rewrites LOCAL_WORLD_SIZE)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        gpus_per_node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus_per_node = gpus_per_node or world_size
    # cfg.world_size is mode=plan's assumption, not a requirement: a launch of another size runs
    # (machinery.rl_run.start_rl_run prints the plan at the real size: plan.launch_note)
    tp = cfg.rollout.tensor_parallel_size
    if world_size % tp:
        raise ConfigError(f"rollout.tensor_parallel_size={tp} does not divide the {world_size} "
                          "ranks into engines")
    if gpus_per_node % tp:  # vLLM's tensor-parallel all-reduces would cross the network every token
        raise ConfigError(f"rollout.tensor_parallel_size={tp} does not divide the {gpus_per_node} "
                          "GPUs per node (torchrun's --nproc_per_node): an engine would straddle "
                          "two nodes; use a divisor of it")
    engines = world_size // tp
    if cfg.prompts_per_step < engines:
        raise ConfigError(f"prompts_per_step={cfg.prompts_per_step} is fewer than the {engines} "
                          "engines: some would idle")
    model = check_model_dir(cfg.model)
    if resolve(model).is_dir():  # a hub id's config is read as the engine starts
        check_heads_split(model, tp)
    problems = load_problems(cfg.train_data)
    eval_rows = load_problems(cfg.eval_data) if cfg.eval_data else []
    return model, problems, eval_rows


# The paper's stage 1 is 300 steps x 512 prompts over 42K problems: about 3.7 passes (§4.2, §4.3)
EPOCHS_WARN = 5.0


def epoch_plan(cfg, num_problems, start_step):
    """(passes over train_data this run makes, the line train() prints), a warning past
    EPOCHS_WARN."""
    prompts = (cfg.steps - start_step) * cfg.prompts_per_step
    epochs = prompts / num_problems
    line = (f"plan: steps {start_step} -> {cfg.steps} x {cfg.prompts_per_step} prompts = "
            f"{prompts:,} prompts over {num_problems:,} problems of {cfg.train_data}: "
            f"{epochs:.1f} epochs")
    if epochs > EPOCHS_WARN:
        line += (f"\nWARNING: {epochs:.1f} passes over the same problems, above {EPOCHS_WARN}; the "
                 "paper's stage 1 makes 3.7 (300 x 512 prompts over 42K problems). Add problems "
                 "(prepare_data.py, README: the paper's data size) or lower steps or "
                 "prompts_per_step.")
    return epochs, line
