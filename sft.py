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

Training is FSDP2 from 1 CPU process to N GPUs; a killed run resumes with `resume=auto` at the
same data position; the result is a Hugging Face directory `out_dir/final` (with the prompt format
it was trained in). A step, the loss's normalisation and where this file departs from §4.1:
docs/design.md (SFT).

Bench: docs/benchmarks.md, SFT (share_prefix vs the padded batch, figures and their commit)
Tests: .venv/bin/python -m pytest tests/test_sft.py -q
"""
import dataclasses
import math
import random
import time
from types import SimpleNamespace
from typing import Annotated, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from annotated_types import Interval
from tqdm import tqdm
from transformers import AutoTokenizer

from machinery.checkpoint import latest_checkpoint, resume_run, save_checkpoint
from machinery.config import (ConfigError, Fraction, NonNegativeInt, PositiveFloat, PositiveInt,
                              load_config, resolve)
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
    max_seq_len: PositiveInt = 4096  # longer conversations are dropped (counted), not truncated
    seed: int = 0
    collective_timeout_min: PositiveInt = 120  # torchrun: how long a rank waits for the slowest
    # optimisation (§4.1: 3 epochs, lr 5e-6, 4% warm-up, cosine, batch 128)
    epochs: PositiveInt = 3
    max_steps: NonNegativeInt = 0  # stop after this many steps; 0 = all epochs; the lr spans
                                   # the run
    global_batch_size: PositiveInt = 128  # conversations per optimizer step, all ranks together
    micro_batch_size: PositiveInt = 4  # conversations per forward/backward on one rank
    lr: PositiveFloat = 5e-6
    min_lr_ratio: Fraction = 0.0  # cosine decays to lr * min_lr_ratio
    warmup_ratio: Annotated[float, Interval(ge=0, lt=1)] = 0.04
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0        # max global grad norm; 0 = no clipping (the norm is logged)
    # memory / speed knobs; none of them changes the maths (tests/test_sft.py checks micro-batching)
    train_dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    activation_checkpointing: bool = False
    share_prefix: bool = True     # a micro-batch's common prompt once (exact; ~2x on the tiny demo)
    attn_implementation: str = "sdpa"  # or flash_attention_2 on GPU, if installed
    train_threads: NonNegativeInt = 0  # CPU only: torch threads; 0: the free cores
                                       # (machinery/threads.py)
    # checkpoints and logs
    save_every: NonNegativeInt = 0  # DCP checkpoint every N steps and at the end; 0 = final/ only
    keep_checkpoints: PositiveInt = 2
    resume: str = "auto"          # auto: newest intact one in out_dir/checkpoints; never; PATH
    # true: resume this out_dir's run with changed settings (history.jsonl records them);
    # false: a change of a key outside KEYS_A_RESUME_MAY_CHANGE is refused
    continue_with_changes: bool = False
    log_every: PositiveInt = 1
    wandb_project: str = ""
    tensorboard: bool = False

    def validate(self):
        """What the field types cannot say, found before anything loads."""
        if not self.model or not self.data:
            missing = "model" if not self.model else "data"
            raise ConfigError(f"{missing}: not set; e.g. model=out/tiny-model "
                              "data=out/tiny-sft.jsonl (python tiny.py writes both)")
        for name in ("chat_template", "tool_schema", "data"):
            path = getattr(self, name)
            if path and path != "chatml" and not resolve(path).is_file():
                raise ConfigError(f"{name}={path}: file not found")
        if self.share_prefix and self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError(f"share_prefix=true: attn_implementation="
                              f"{self.attn_implementation} takes no custom mask; use sdpa or "
                              "share_prefix=false")
        if self.resume not in ("auto", "never") and not resolve(self.resume).is_dir():
            raise ConfigError(f"resume={self.resume}: expected auto, never or a checkpoint "
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
    the template's text up to a generation prompt (loss 0), the assistant content + <|im_end|>
    (loss 1), the template's text from there to the next generation prompt (loss 0), ... Each
    context is the template's own rendering cut at the previous end, minus what it puts after
    <|im_end|> (a rollout appends the next turn at once); tool messages are data, as in
    rollout.render_tool_turn: a "<|im_end|>" a tool printed stays text."""
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
    """Forward and backward over this rank's micro-batches of the global
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
    """One optimizer step (docs/design.md, SFT); returns its metrics, summed over ranks."""
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
    run = start_run(cfg)
    if run.run_dir is None:  # out_dir's run is already at its last step
        return None, run.tokenizer

    progress = tqdm(total=run.total_steps, initial=run.start_step, desc="sft",
                    disable=run.rank != 0, dynamic_ncols=True)
    for step in range(run.start_step, run.total_steps):
        metrics = sft_step(run.model, run.optimizer, run.examples, run.lengths, step,
                           run.total_steps, run.cfg, run.pad_id, run.device, run.rank,
                           run.world_size)
        log_and_checkpoint(run, step, metrics)
        progress.update(1)
        progress.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                             tok_s=f"{metrics['tokens_per_s']:.0f}")
    progress.close()

    finish_run(run)
    return run.model, run.tokenizer


def start_run(cfg):
    """What the run holds across its steps: the world, the tokenized data, the run directory
    (None when out_dir's run is done), and the model, optimizer, logger resumed at start_step."""
    rank, world_size, _, device = init_distributed(cfg.collective_timeout_min)
    check_same_settings(cfg, rank, world_size)
    check_shared_paths(cfg.out_dir, [cfg.model, cfg.data, cfg.chat_template, cfg.tool_schema],
                       rank, world_size)
    accumulation = check_world(cfg, world_size)
    model_path = check_model_dir(cfg.model)
    cfg = choose_threads(cfg, device, rank)  # train_threads=0 -> a number: the settings line
    seed_everything(cfg.seed)
    run = SimpleNamespace(cfg=cfg, rank=rank, world_size=world_size, device=device,
                          out_dir=resolve(cfg.out_dir), model_path=model_path)

    run.tokenizer = AutoTokenizer.from_pretrained(model_path)
    # padding is never attended to nor trained on; any id works if the tokenizer names no pad token
    run.pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    run.examples, dropped = load_conversations(cfg, run.tokenizer)
    run.lengths = [len(ids) for ids, _ in run.examples]
    run.total_steps = cfg.epochs * (len(run.examples) // cfg.global_batch_size)
    if cfg.max_steps:
        run.total_steps = min(run.total_steps, cfg.max_steps)
    run.run_dir = claim_run_dir(cfg, run.out_dir, KEYS_A_RESUME_MAY_CHANGE, run.total_steps,
                                "final", rank)
    if run.run_dir is None:
        return run
    if rank == 0:
        print_sft_data(run.examples, dropped, run.total_steps, cfg, world_size, accumulation)

    run.model, run.save_dtype = build_model(cfg, model_path, device, rank)
    run.optimizer = torch.optim.AdamW(run.model.parameters(), lr=cfg.lr,
                                      weight_decay=cfg.weight_decay,
                                      betas=(cfg.adam_beta1, cfg.adam_beta2))
    # What fixes the data order: a checkpoint of another order is refused. The schedule's length
    # (total_steps) may change with continue_with_changes=true: the lr follows the new one.
    run.state = {"num_examples": len(run.examples), "global_batch_size": cfg.global_batch_size,
                 "seed": cfg.seed}
    run.checkpoints = run.out_dir / "checkpoints"
    run.start_step = resume_run(run.run_dir.checkpoint, run.model, run.optimizer, run.state, rank,
                                run.checkpoints)
    record_start(run.run_dir, cfg)  # config.yaml once the checkpoint loaded
    run.logger = MetricsLogger(run.out_dir, enabled=rank == 0, wandb_project=cfg.wandb_project,
                               tensorboard=cfg.tensorboard, config=dataclasses.asdict(cfg),
                               resume_step=run.start_step)
    return run


def log_and_checkpoint(run, step, metrics):
    """The step's metrics every log_every steps and at the last; a checkpoint every save_every."""
    cfg, done = run.cfg, step + 1
    if done % cfg.log_every == 0 or done == run.total_steps:
        run.logger.log(done, metrics)
    if cfg.save_every and done % cfg.save_every == 0 and done < run.total_steps:
        save_checkpoint(run.checkpoints, done, run.model, run.optimizer,
                        {**run.state, "step": done}, keep=cfg.keep_checkpoints,
                        keep_through=run.run_dir.keep_through)


def finish_run(run):
    """The last checkpoint (a finished run's rerun resumes at its end), then out_dir/final."""
    cfg = run.cfg
    run.logger.close()
    if cfg.save_every and run.start_step < run.total_steps:
        save_checkpoint(run.checkpoints, run.total_steps, run.model, run.optimizer,
                        {**run.state, "step": run.total_steps}, keep=cfg.keep_checkpoints,
                        keep_through=run.run_dir.keep_through)
    save_hf_model(run.model, run.tokenizer, run.model_path, run.out_dir / "final", run.save_dtype,
                  run.rank, prompt_format(cfg, run.tokenizer), "sft.py")
    finish_run_dir(run.run_dir, run.total_steps)
    if run.rank == 0:
        print_sft_written(run.out_dir, run.device)


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
