"""Non-reasoning SFT (rStar2-Agent, arXiv 2508.20722 §4.1): teach a base model the chat and
tool-call format before RL.

    python sft.py configs/sft_tiny.yaml                 # 1 CPU process: the tiny demo's SFT stage
    torchrun --nproc_per_node=8 sft.py configs/sft.yaml model=Qwen/Qwen3-14B-Base data=PATH.jsonl
    torchrun --nnodes=N --node_rank=$NODE_RANK --nproc_per_node=8 --master_addr=$MASTER_ADDR \\
        --master_port=29500 sft.py configs/sft.yaml data=PATH.jsonl                 # N nodes

Data: chat JSONL, one conversation per line, tokenized exactly as a rollout produces it
(render_conversation):
    {"messages": [{"role": "user", "content": PROBLEM}, {"role": "assistant", "content": TURN_1},
                  {"role": "tool", "content": TOOL_TEXT}, {"role": "assistant", "content": TURN_2}],
     "tools": [...]}
roles system/user/assistant/tool; an assistant `content` is exactly what the model writes after the
template's generation prompt (for the rStar2 template: after `<|im_start|>assistant\\n<reason>`),
tool calls included as text. `tools` (optional) overrides the config's tool schema for that row,
as function-calling datasets carry their own.

What one step does:
    1. a global batch of `global_batch_size` conversations (the paper's 128), per-epoch shuffle;
    2. sorted by length into micro-batches (little padding), dealt round-robin to the ranks,
       `global_batch_size / (world_size * micro_batch_size)` accumulation steps each; share_prefix
       packs a micro-batch whose conversations share a long prompt into one row, that prompt once;
    3. loss = cross-entropy on the tokens the model writes (assistant turns and their <|im_end|>),
       summed, divided by the number of such tokens in the WHOLE global batch, so every token
       weighs the same however the batch is split across micro-batches and ranks (the
       per-micro-batch mean is the classic gradient-accumulation bug);
    4. AdamW step, lr warm-up then cosine decay (§4.1: 4% warm-up, cosine, lr 5e-6, 3 epochs).

Training is FSDP2 from 1 CPU process to N GPUs, fp32 master weights, bf16 compute on GPU. A killed
run resumes with `resume=auto` at the same data position. The result is a Hugging Face directory
`out_dir/final` (safetensors + config + tokenizer + the prompt format it was trained in).

Paper vs this file: the paper's SFT data (ToolACE, APIGen-MT, Glaive, Magicoder as function calls,
Tulu-3, Nemotron chat; 222K examples) is not released; bring your own JSONL. §4.1 states no
sequence length, prompt masking or packing: here the loss is on assistant tokens only, and
conversations longer than `max_seq_len` are dropped (and counted), never truncated, since a cut
transcript would teach an unfinished answer. AdamW betas/weight decay and grad clip are not stated
either: HF Trainer's defaults (0.9, 0.999, 0.0) and clip 1.0.

Bench: docs/benchmarks.md, SFT (share_prefix vs the padded batch, figures and their commit)
Tests: .venv/bin/python -m pytest tests/test_sft.py -q
"""
import dataclasses
import math
import random
import time
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoTokenizer

from machinery.checkpoint import latest_checkpoint, resume_run, save_checkpoint
from machinery.config import ConfigError, load_config, resolve
from machinery.conversations import (IGNORE, chat_text, check_context, check_conversation,
                                     check_turn, collate_conversations, collate_shared_prefix,
                                     end_of_turn_ids, prompt_format, read_template, read_tools,
                                     shared_prefix_length)
from machinery.data import load_jsonl
from machinery.distributed import (check_same_settings, check_shared_paths, init_distributed,
                                   seed_everything)
from machinery.exits import run_script, training_interrupted
from machinery.metrics import MetricsLogger, print_sft_data, print_sft_written
from machinery.model import build_model, check_model_dir, save_hf_model
from machinery.prompts import DATA_PLACEHOLDER, encode_rendered
from machinery.run_dir import claim_run_dir, finish_run_dir, record_start
from machinery.threads import choose_threads


# -----------------------------------------------------------------------------
# config: defaults are the paper's SFT recipe (§4.1) where it gives one

@dataclasses.dataclass
class SFTConfig:
    model: str = ""               # HF directory (or hub id) of the base model, with its tokenizer
    data: str = ""                # chat JSONL (format in the docstring)
    out_dir: str = "runs/sft"     # config.yaml, metrics.jsonl, checkpoints/, final/ (HF directory)
    chat_template: str = ""       # Jinja file; "chatml": ChatML with tools; "": the tokenizer's own
    tool_schema: str = ""         # JSON file with one tool schema (or a list); "": no tools
    max_seq_len: int = 4096       # longer conversations are dropped (counted), not truncated
    seed: int = 0
    collective_timeout_min: int = 120  # torchrun: how long a rank waits for the slowest
    # optimisation (§4.1: 3 epochs, lr 5e-6, 4% warm-up, cosine, batch 128)
    epochs: int = 3
    max_steps: int = 0            # stop after this many steps; 0 = all epochs. The lr spans the run
    global_batch_size: int = 128  # conversations per optimizer step, all ranks together
    micro_batch_size: int = 4     # conversations per forward/backward on one rank
    lr: float = 5e-6
    min_lr_ratio: float = 0.0     # cosine decays to lr * min_lr_ratio
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0        # max global grad norm; 0 = no clipping (the norm is logged)
    # memory / speed knobs; none of them changes the maths (tests/test_sft.py checks micro-batching)
    train_dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    activation_checkpointing: bool = False
    share_prefix: bool = True     # a micro-batch's common prompt once (exact; ~2x on the tiny demo)
    attn_implementation: str = "sdpa"  # or flash_attention_2 on GPU, if installed
    train_threads: int = 0        # CPU only: torch threads; 0: the free cores, machinery/threads.py
    # checkpoints and logs
    save_every: int = 0           # DCP checkpoint every N steps and at the end; 0 = final/ only
    keep_checkpoints: int = 2
    resume: str = "auto"          # auto: newest intact one in out_dir/checkpoints; never; PATH
    # true: resume this out_dir's run with changed settings (config_history.yaml records them);
    # false: a change of a key outside KEYS_A_RESUME_MAY_CHANGE is refused
    continue_with_changes: bool = False
    log_every: int = 1
    wandb_project: str = ""
    tensorboard: bool = False

    def validate(self):
        """Errors that can be found before loading anything."""
        if not self.model:
            raise ConfigError("model: set the base model (an HF directory with its tokenizer), "
                              "e.g. model=out/tiny-model")
        if not self.data:
            raise ConfigError("data: set the chat JSONL to train on, e.g. data=out/tiny-sft.jsonl "
                              "(python tiny.py writes it)")

        for name in ("max_seq_len", "epochs", "global_batch_size", "micro_batch_size",
                     "keep_checkpoints", "log_every", "collective_timeout_min"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("max_steps", "save_every", "train_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"global_batch_size={self.global_batch_size} is not a multiple of "
                              f"micro_batch_size={self.micro_batch_size}")

        if not self.lr > 0:
            raise ConfigError(f"lr={self.lr}: must be > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio={self.warmup_ratio}: must be in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")

        for name in ("chat_template", "tool_schema", "data"):
            path = getattr(self, name)
            if path and path != "chatml" and not resolve(path).is_file():
                raise ConfigError(f"{name}: file not found: {path}")
        if self.share_prefix and self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError(f"share_prefix=true needs a custom attention mask, which "
                              f"attn_implementation={self.attn_implementation} does not take; "
                              "use sdpa or share_prefix=false")
        if self.resume not in ("auto", "never") and not resolve(self.resume).is_dir():
            raise ConfigError(f"resume={self.resume!r}: expected auto, never or a checkpoint "
                              "directory")


# Keys that do not change what is trained: a rerun into the same out_dir may change them. Any other
# key changed is another run (machinery/run_dir.py); epochs and max_steps count, as they set the lr
# schedule.
KEYS_A_RESUME_MAY_CHANGE = {
    "out_dir", "collective_timeout_min", "save_every", "keep_checkpoints", "resume",
    "continue_with_changes", "log_every",
    "wandb_project", "tensorboard", "train_threads", "micro_batch_size", "activation_checkpointing",
    "share_prefix"}


def check_world(cfg, world_size):
    """The batch must split evenly into micro-batches on every rank: FSDP runs collectives in every
    forward and backward, so all ranks must take the same number of accumulation steps."""
    per_step = world_size * cfg.micro_batch_size
    if cfg.global_batch_size % per_step:
        raise ConfigError(f"global_batch_size={cfg.global_batch_size} is not a multiple of "
                          f"world_size ({world_size}) x micro_batch_size ({cfg.micro_batch_size}) "
                          f"= {per_step}; change one of them")
    return cfg.global_batch_size // per_step


# -----------------------------------------------------------------------------
# data: chat JSONL -> token ids + loss mask, as the rollout builds a trajectory, so SFT teaches what
# RL samples

def render_conversation(tokenizer, messages, tools, chat_template, where="conversation"):
    """(input_ids, loss_mask) of one conversation, segment by segment as a rollout produces it:

        context  the template's text up to and including the generation prompt          loss 0
        turn     tokenizer(assistant content) + <|im_end|>, what the policy samples      loss 1
        context  the template's text from after that turn to the next generation prompt  loss 0
        ...

    Each context is the template's own rendering cut at the previous end (so any chat template
    works), minus the text the template puts after <|im_end|> (a "\\n"): a rollout stops at
    <|im_end|> and appends the next turn at once. Segments are tokenized separately, as the engine
    returns sampled tokens and the loop appends tool turns. Tool messages are data, as in
    rollout.render_tool_turn: a "<|im_end|>" that a tool printed stays text (loss 0)."""
    tool_texts = [m["content"] for m in messages if m["role"] == "tool"]
    # The template renders placeholders for the tool contents, so its own text can be told from
    # the tool's.
    shown = [{**m, "content": DATA_PLACEHOLDER} if m["role"] == "tool" else m for m in messages]
    end_of_turn = end_of_turn_ids(tokenizer)
    input_ids, loss_mask = [], []
    covered = ""  # the rendered text (placeholders for tool contents) the segments so far cover
    tools_covered = 0  # tool contents in it

    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = chat_text(tokenizer, shown[:k], tools, chat_template, add_generation_prompt=True)
        check_context(tokenizer, messages, k, prompt, covered, tools, chat_template, where)
        tools_before = sum(m["role"] == "tool" for m in messages[:k])
        fixed = prompt[len(covered):].split(DATA_PLACEHOLDER)
        context = encode_rendered(tokenizer, fixed, tool_texts[tools_covered:tools_before])
        turn = tokenizer.encode(message["content"], add_special_tokens=False) + end_of_turn
        input_ids += context + turn
        loss_mask += [0] * len(context) + [1] * len(turn)
        covered = chat_text(tokenizer, shown[:k + 1], tools, chat_template,
                            add_generation_prompt=False)
        tools_covered = tools_before
        check_turn(covered, prompt + message["content"], k, where)
    return input_ids, loss_mask


def load_conversations(cfg, tokenizer):
    """Validate and tokenize every row of cfg.data. Returns (examples, dropped): examples are
    (input_ids, loss_mask) in file order; `dropped` counts the conversations over max_seq_len."""
    path = resolve(cfg.data)
    rows = load_jsonl(path)
    # load_jsonl skips blank lines; map rows back to line numbers so every error can say file:line
    line_numbers = [n for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                    if line.strip()]
    chat_template = read_template(cfg.chat_template)
    if chat_template is None and not tokenizer.chat_template:
        raise ConfigError(f"model {cfg.model}: the tokenizer has no chat template; "
                          "set chat_template=PATH")
    default_tools = read_tools(cfg.tool_schema)

    examples, dropped = [], 0
    for row, line in zip(rows, line_numbers):
        where = f"{path}:{line}"
        check_conversation(row, where)
        ids, mask = render_conversation(tokenizer, row["messages"], row.get("tools", default_tools),
                                        chat_template, where)
        if len(ids) > cfg.max_seq_len:
            dropped += 1
            continue
        examples.append((ids, mask))

    if len(examples) < cfg.global_batch_size:
        raise ConfigError(f"{path}: {len(examples)} conversations fit max_seq_len="
                          f"{cfg.max_seq_len} ({dropped} longer ones dropped), fewer than one "
                          f"global batch of {cfg.global_batch_size}")
    return examples, dropped


# -----------------------------------------------------------------------------
# batches: the order is a function of (seed, step) alone, so a resumed run reads what the
# uninterrupted one would

def global_batch(num_examples, batch_size, seed, step):
    """Indices of the conversations in optimizer step `step`: a fresh permutation per epoch, the
    tail that does not fill a batch is left out of that epoch (every step sees batch_size)."""
    steps_per_epoch = num_examples // batch_size
    epoch, position = divmod(step, steps_per_epoch)
    order = random.Random(f"sft-{seed}-{epoch}").sample(range(num_examples), num_examples)
    return order[position * batch_size:(position + 1) * batch_size]


def rank_micro_batches(indices, lengths, micro_batch_size, rank, world_size):
    """This rank's micro-batches of one global batch: sorted by length so each micro-batch pads
    little (length bucketing), then dealt round-robin so every rank gets a similar token load and
    the same count."""
    by_length = sorted(indices, key=lambda i: (-lengths[i], i))
    micro = [by_length[i:i + micro_batch_size] for i in range(0, len(by_length), micro_batch_size)]
    return micro[rank::world_size]


def micro_batch_inputs(micro, pad_id, share_prefix, device):
    """Model inputs and labels of one micro-batch, packed around its shared prompt if that pays."""
    prefix_length = shared_prefix_length(micro) if share_prefix else 0
    inputs, labels = (collate_shared_prefix(micro, prefix_length) if prefix_length
                      else collate_conversations(micro, pad_id))
    return {k: v.to(device) for k, v in inputs.items()}, labels.to(device)


# -----------------------------------------------------------------------------
# the loss and the schedule

def micro_batch_loss_sum(model, inputs, labels):
    """Summed next-token cross-entropy over the labelled positions. Logits are computed only at
    positions that predict a trained token (logits_to_keep): with a 150K vocabulary the full
    [B, T, V] logits dominate memory, and a long shared prompt predicts nothing we train."""
    keep = (labels != IGNORE).any(dim=0).nonzero().squeeze(1)  # positions needed by any row
    logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits
    return F.cross_entropy(logits.float().flatten(0, 1), labels[:, keep].flatten(),
                           ignore_index=IGNORE, reduction="sum")


def accumulate_gradients(model, examples, lengths, batch, cfg, pad_id, device, rank, world_size):
    """Steps 2-3 of the docstring: forward and backward over this rank's micro-batches of the global
    `batch`. Returns (this rank's summed loss, its conversation tokens, the trained tokens of the
    whole global batch)."""
    # the token mean's denominator; every rank knows it
    num_loss_tokens = sum(sum(examples[i][1][1:]) for i in batch)
    loss_sum = torch.zeros((), device=device)
    num_tokens = 0
    for indices in rank_micro_batches(batch, lengths, cfg.micro_batch_size, rank, world_size):
        micro = [examples[i] for i in indices]
        inputs, labels = micro_batch_inputs(micro, pad_id, cfg.share_prefix, device)
        micro_loss = micro_batch_loss_sum(model, inputs, labels)
        # FSDP averages gradients over ranks; this rank's sum over the global count is already its
        # share of the global mean, so scale by world_size to make the reduced gradient exactly
        # d(global token mean)
        (micro_loss * world_size / num_loss_tokens).backward()
        loss_sum += micro_loss.detach()
        num_tokens += sum(lengths[i] for i in indices)  # conversation tokens, shared or not
    return loss_sum, num_tokens, num_loss_tokens


def cosine_lr_at(step, total_steps, cfg):
    """Linear warm-up over the first warmup_ratio of the steps (starting at lr / warmup, not 0, so
    step 0 trains), then cosine decay to lr * min_lr_ratio at the last step (§4.1)."""
    warmup = math.ceil(cfg.warmup_ratio * total_steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


# -----------------------------------------------------------------------------
# the training loop

def sft_step(model, optimizer, examples, lengths, step, total_steps, cfg, pad_id, device, rank,
             world_size):
    """One optimizer step (steps 1-4 of the docstring); returns its metrics, summed over ranks."""
    started = time.perf_counter()
    lr = cosine_lr_at(step, total_steps, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    batch = global_batch(len(examples), cfg.global_batch_size, cfg.seed, step)
    loss_sum, num_tokens, num_loss_tokens = accumulate_gradients(
        model, examples, lengths, batch, cfg, pad_id, device, rank, world_size)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    totals = torch.tensor([loss_sum.item(), num_tokens], dtype=torch.float64)
    dist.all_reduce(totals)
    elapsed = time.perf_counter() - started
    return {"loss": totals[0].item() / num_loss_tokens, "lr": lr, "grad_norm": grad_norm.item(),
            "epoch": step / (len(examples) // cfg.global_batch_size),
            "loss_tokens": num_loss_tokens, "tokens": int(totals[1]),
            "tokens_per_s": totals[1].item() / elapsed, "time/step": elapsed}


def train(cfg):
    """Run SFT as configured; returns (model, tokenizer): the trained FSDP model, for the tests."""
    rank, world_size, _, device = init_distributed(cfg.collective_timeout_min)
    check_same_settings(cfg, rank, world_size)
    check_shared_paths(cfg.out_dir, [cfg.model, cfg.data, cfg.chat_template, cfg.tool_schema],
                       rank, world_size)
    accumulation = check_world(cfg, world_size)
    model_path = check_model_dir(cfg.model)
    cfg = choose_threads(cfg, device, rank)  # train_threads=0 -> a number: the settings line
    seed_everything(cfg.seed)
    out_dir = resolve(cfg.out_dir)

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # padding is never attended to nor trained on; any id works if the tokenizer names no pad token
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    examples, dropped = load_conversations(cfg, tokenizer)
    lengths = [len(ids) for ids, _ in examples]
    total_steps = cfg.epochs * (len(examples) // cfg.global_batch_size)
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    run_dir = claim_run_dir(cfg, out_dir, KEYS_A_RESUME_MAY_CHANGE, total_steps, "final", rank)
    if run_dir is None:
        return None, tokenizer
    if rank == 0:
        print_sft_data(examples, dropped, total_steps, cfg, world_size, accumulation)

    model, save_dtype = build_model(cfg, model_path, device, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2))
    # What fixes the data order: a checkpoint of another order is refused. The schedule's length
    # (total_steps) may change with continue_with_changes=true: the lr follows the new one.
    run_state = {"num_examples": len(examples), "global_batch_size": cfg.global_batch_size,
                 "seed": cfg.seed}
    ckpt_root = out_dir / "checkpoints"
    start_step = resume_run(run_dir.checkpoint, model, optimizer, run_state, rank, ckpt_root)
    record_start(run_dir, cfg)  # config.yaml once the checkpoint loaded
    logger = MetricsLogger(out_dir, enabled=rank == 0, wandb_project=cfg.wandb_project,
                           tensorboard=cfg.tensorboard, config=dataclasses.asdict(cfg),
                           resume_step=start_step)

    progress = tqdm(total=total_steps, initial=start_step, desc="sft", disable=rank != 0,
                    dynamic_ncols=True)
    for step in range(start_step, total_steps):
        metrics = sft_step(model, optimizer, examples, lengths, step, total_steps, cfg, pad_id,
                           device, rank, world_size)
        if (step + 1) % cfg.log_every == 0 or step + 1 == total_steps:
            logger.log(step + 1, metrics)
        progress.update(1)
        progress.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                             tok_s=f"{metrics['tokens_per_s']:.0f}")
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < total_steps:
            save_checkpoint(ckpt_root, step + 1, model, optimizer, {**run_state, "step": step + 1},
                            keep=cfg.keep_checkpoints, keep_through=run_dir.keep_through)

    progress.close()
    logger.close()
    if cfg.save_every and start_step < total_steps:  # so a finished run's rerun resumes at its end
        save_checkpoint(ckpt_root, total_steps, model, optimizer,
                        {**run_state, "step": total_steps}, keep=cfg.keep_checkpoints,
                        keep_through=run_dir.keep_through)

    save_hf_model(model, tokenizer, model_path, out_dir / "final", save_dtype, rank,
                  prompt_format(cfg, tokenizer), "sft.py")
    finish_run_dir(run_dir, total_steps)
    if rank == 0:
        print_sft_written(out_dir, device)
    return model, tokenizer


def interrupt_paragraph(cfg, argv):
    """What rank 0 prints when Ctrl-C or SIGTERM stops sft.py (cfg: None before it is read)."""
    if cfg is None:
        return "sft.py: interrupted"
    out_dir = resolve(cfg.out_dir)
    return training_interrupted("sft.py", argv, out_dir, latest_checkpoint(out_dir / "checkpoints"),
                                None, cfg.save_every, cfg.resume)


if __name__ == "__main__":
    run_script("sft.py", lambda argv: load_config(SFTConfig, argv, doc=__doc__), train,
               interrupt_paragraph)
