"""rl.py's run set up (rl.py adds the tool's executor: the package never imports a top-level file)
and put away, its policy written as a Hugging Face directory."""
import dataclasses
from types import SimpleNamespace

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from machinery import checkpoint, metrics, plan, run_dir
from machinery.config import ConfigError, resolve
from machinery.data import drop_long_prompts
from machinery.distributed import (check_same_settings, check_shared_paths, compute_dtype,
                                   init_distributed)
from machinery.engine import Engine
from machinery.exits import WHERE, crash_loop, forget_where, watch_progress
from machinery.model import save_hf_model
from machinery.prompts import load_format
from machinery.threads import choose_threads, decode_threads


def start_rl_run(cfg, keys_a_resume_may_change):
    """The run's state as a namespace; None when out_dir's run is already at `steps`."""
    model_path, problems, eval_rows = checkpoint.check_inputs(cfg)
    rank, world_size, _, device = init_distributed(cfg.collective_timeout_min)
    check_same_settings(cfg, rank, world_size)  # one run: rank 0's settings on every rank
    if rank == 0 and (note := plan.launch_note(cfg, world_size)):  # not the plan's size: it runs
        print(note, flush=True)
    check_shared_paths(cfg.out_dir, [model_path, cfg.train_data, cfg.eval_data, cfg.init_from],
                       rank, world_size)  # every node must see the run where rank 0 does
    cfg = choose_threads(cfg, device, rank)  # train_threads=0 -> a number: the settings line
    run = SimpleNamespace(cfg=cfg, model_path=model_path, rank=rank, world_size=world_size,
                          device=device, out_dir=resolve(cfg.out_dir))
    run.ckpt_root = run.out_dir / "checkpoints"
    run.dir = run_dir.claim_run_dir(cfg, run.out_dir, keys_a_resume_may_change, cfg.steps,
                                    "hf_step_{step}", rank)
    if run.dir is None:
        return None
    box = [crash_loop(run.out_dir / "in_flight", cfg.skip_prompts) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # rank 0 reads and moves the records: one decision
    if box[0]:
        raise ConfigError(box[0])
    WHERE["record"] = run.out_dir / "in_flight" / f"rank{rank}.json"

    run.tokenizer = tokenizer = AutoTokenizer.from_pretrained(model_path)
    run.pad_id = (tokenizer.eos_token_id if tokenizer.pad_token_id is None
                  else tokenizer.pad_token_id)
    run.problems = drop_long_prompts(problems, tokenizer, cfg.rollout, cfg.train_data)
    run.eval_rows = (drop_long_prompts(eval_rows, tokenizer, cfg.rollout, cfg.eval_data)
                     if eval_rows else [])

    run.model, run.optimizer, run.state = checkpoint.restore(cfg, run.dir.checkpoint, device, rank)
    run_dir.record_start(run.dir, cfg)  # config.yaml and the history once the checkpoint loaded
    if rank == 0:
        print(checkpoint.epoch_plan(cfg, len(run.problems), run.state["step"])[1], flush=True)
        for line in cfg.inert_keys():  # an ablation arm that would train exactly like the paper's
            print(f"rl.py: {line}", flush=True)
    run.logger = metrics.MetricsLogger(run.out_dir, enabled=rank == 0,
                                       wandb_project=cfg.wandb_project,
                                       tensorboard=cfg.tensorboard, config=dataclasses.asdict(cfg),
                                       resume_step=run.state["step"])

    run.engine = Engine(model_path, cfg.rollout, seed=cfg.seed,
                        decode_threads=decode_threads(cfg.rollout, cfg.train_threads),
                        collective_timeout_min=cfg.collective_timeout_min)
    run.watch = None  # from here on a step's phases are short: a stall is a hang
    if world_size > 1 and cfg.heartbeat_min:
        run.watch = watch_progress(dist.distributed_c10d._get_default_store(), rank, world_size,
                                   cfg.heartbeat_min * 60, "rl.py")
    dtype = cfg.rollout.dtype  # the engine's: the weights are cast to it before they are gathered
    run.weight_dtype = (getattr(torch, dtype) if dtype in ("float32", "bfloat16", "float16")
                        else torch.float32)
    return run


def finish_rl_run(run, untrained):
    """The policy in the engine's dtype (fp32 stays in the DCP checkpoint); everything closed."""
    if run.watch:
        run.watch.set()  # the end's saves and shutdown may take long on every rank at once
    forget_where()
    run.logger.close()
    hf_dir = run.out_dir / f"hf_step_{run.state['step']}"
    save_hf_model(run.model, run.tokenizer, run.model_path, hf_dir, compute_dtype(run.device),
                  run.rank, load_format(run.cfg.rollout)[:2], "rl.py")
    if run.executor:
        run.executor.close()
    run.engine.close()
    run_dir.finish_run_dir(run.dir, run.state["step"])
    if run.rank == 0:
        metrics.print_rl_written(run.out_dir, hf_dir, run.ckpt_root, untrained, run.device)

