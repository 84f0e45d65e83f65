"""Model directories: checked, built as an FSDP2-sharded causal LM, exported with their format."""
import contextlib
import os
import shutil
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from machinery.config import ConfigError, resolve
from machinery.distributed import compute_dtype
from machinery.prompts import write_format


# Any one of these lets AutoTokenizer and vLLM load a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path, allow_hub_id=True):
    """The model path, checked before anything slow starts: a local directory with a config and a
    tokenizer, or a hub id (org/name) left to transformers where allow_hub_id (eval.py: not)."""
    local = resolve(path)
    if not local.is_dir():
        hub_id = (len(Path(path).parts) == 2 and not str(path).startswith((".", "/"))
                  and not local.parent.exists())
        if hub_id and allow_hub_id:
            return path
        if hub_id:
            raise ConfigError(f"model={path}: huggingface-cli download {path} --local-dir DIR")
        # what the folder holds: a step or a name mistyped shows beside the real one
        there = (", ".join(sorted(p.name for p in local.parent.iterdir()
                                  if not p.name.startswith("."))[:12]) or "nothing"
                 if local.parent.is_dir() else "nothing; it does not exist")
        raise ConfigError(f"model directory not found: {local} ({local.parent} holds: {there})")

    if not (local / "config.json").is_file():
        raise ConfigError(f"model={path}: {local} has no config.json; not a model directory")
    if not any((local / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"model directory {local} has no tokenizer; save it beside the weights")
    return str(local)


def build_model(cfg, model_path, device, rank):
    """The FSDP2-wrapped policy in fp32 (the master weights), built on the meta device; rank 0 alone
    reads the checkpoint and broadcasts it (one full copy per node), buffers too (RoPE's inv_freq:
    to_empty leaves them uninitialised)."""
    config = AutoConfig.from_pretrained(model_path)
    save_dtype = getattr(config, "dtype", None) or torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation=cfg.attn_implementation)
    if cfg.activation_checkpointing:
        # non-reentrant: it composes with FSDP2's hooks
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    bf16 = compute_dtype(device, cfg.train_dtype) == torch.bfloat16
    # bf16 forward/backward, fp32 gradient reduction and master weights
    mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if bf16 else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    # the root: embeddings, final norm, lm_head (tied or not)
    fully_shard(model, mp_policy=mp_policy)
    model.to_empty(device=device)

    source = (AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32) if rank == 0
              else None)
    full_state = source.state_dict() if rank == 0 else {}
    set_model_state_dict(model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in model.named_buffers():
        if rank == 0:
            buffer.copy_(source.get_buffer(name))
        dist.broadcast(buffer, src=0)
    del source, full_state
    model.train()
    return model, save_dtype


def save_hf_model(model, tokenizer, model_path, out, save_dtype, rank, prompt_format, written_by):
    """The full weights gathered on rank 0 into a Hugging Face directory, renamed into place, with
    prompt_format (template, schema) beside config.json and the template as the tokenizer's own."""
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))

    if rank == 0:
        out = Path(out)
        tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
        shutil.rmtree(tmp, ignore_errors=True)
        model.config.dtype = save_dtype
        model.save_pretrained(tmp, state_dict={k: v.to(save_dtype) for k, v in full_state.items()})

        base_template = tokenizer.chat_template
        tokenizer.chat_template = prompt_format[0] or base_template
        try:
            tokenizer.save_pretrained(tmp)
        finally:  # the caller's tokenizer stays as it was
            tokenizer.chat_template = base_template
        write_format(tmp, *prompt_format, written_by=written_by)
        with contextlib.suppress(OSError):  # the base model's sampling defaults (eos ids)
            GenerationConfig.from_pretrained(model_path).save_pretrained(tmp)

        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)

    dist.barrier()
