"""The tiny CPU world: a Qwen3-architecture causal LM small enough to train on 2 cores, a tokenizer
trained locally in seconds (no download), and the synthetic arithmetic task the CPU demo learns.

    python tiny.py      # writes out/tiny-model (config, weights, tokenizer) and
                        # out/tiny-sft.jsonl (the demo's SFT transcripts)
    python tiny.py configs/tiny_model.yaml out_dir=/tmp/m hidden_size=256 sft_data=""

The output is an ordinary Hugging Face directory, loaded as Qwen3-14B is: every script runs one code
path for the tiny model and the real one.
"""
import dataclasses
import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

from machinery.config import REPO, atomic_write_text, Fraction, load_config
from machinery.data import load_jsonl
from machinery.exits import rerun_command, run_script
from executor import Executor
from rollout import format_tool_response, RolloutConfig

# Tokens the rStar2 format needs as single tokens (paper §2.1; in the Qwen3 tokenizer these are
# added tokens). The tool-call tokens are *not* special, as in Qwen3, so they survive
# decode(skip_special_tokens=True).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
               "</think>"]

# Qwen2/3's pre-tokenizer regex. Training the BPE behind it matters: transformers' Qwen2Tokenizer
# swaps in this pre-tokenizer on load, so a BPE trained behind plain ByteLevel() would encode
# differently after a reload (docs/design.md, the CPU stack). It also splits numbers into single
# digits, which the arithmetic task needs.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass
class TinyConfig:
    out_dir: str = "out/tiny-model"
    seed: int = 0
    # tokenizer
    vocab_size: int = 2048           # BPE merges are learned up to this size (+ added tokens)
    corpus_problems: int = 3000      # training problems in the BPE corpus: real text tokenizes well
    # model: Qwen3 layout. head_dim 64 because vLLM's CPU attention kernels support it
    # (docs/design.md, the CPU stack)
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    # pretraining (pretrain_base_model): a real base model's ability to copy numbers
    pretrain_steps: int = 300        # 0 = leave the weights at their random init (the tests do)
    pretrain_batch_size: int = 32
    pretrain_lr: float = 6e-3
    # the demo's SFT transcripts (make_sft_transcripts); "" = do not write them
    sft_data: str = "out/tiny-sft.jsonl"
    sft_examples: int = 2000
    sft_error_fraction: Fraction = 0.4  # share of transcripts whose code fails (BUGS)


# -----------------------------------------------------------------------------
# the arithmetic task: a tool is needed (a 2-layer, 128-wide model cannot multiply 4-digit numbers),
# and a tiny model can learn to write the code and copy the result, so RL has something to improve.

def make_arithmetic_problems(n, seed, split="train"):
    """Rows {id, problem, answer} like the data/ files. Different seeds give different problems.

    Every operand has a fixed width (4, 2 and 3 digits) and every result has 6 digits, so the digits
    the model copies always sit at the same distance from their source: that is what lets a 2-layer
    model learn to copy within the demo's budget (see pretrain_base_model)."""
    rng = random.Random(f"arith-{split}-{seed}")
    rows = []
    for i in range(n):
        a, b, c = rng.randint(2000, 9000), rng.randint(51, 99), rng.randint(100, 999)
        text, value = [(f"{a} * {b} + {c}", a * b + c), (f"{a} * {b} - {c}", a * b - c),
                       (f"({a} + {c}) * {b}", (a + c) * b)][rng.randrange(3)]
        rows.append({"id": f"arith-{split}-{i}", "problem": f"Compute {text}.",
                     "answer": str(value)})
    return rows


# -----------------------------------------------------------------------------
# the demo's SFT transcripts: the paper's SFT teaches format, not reasoning (§4.1), and so do these.
# RL starts from a model that calls the tool and boxes an answer, but still miscopies digits and
# sometimes writes bad code.

TOOL_NAME = "python_code_with_standard_io"
# The failed call the SFT data teaches, and RL then has to unlearn: code that prints the result and
# then ends with a stray `exit(1)`. The real sandbox reports a failure and still shows the stdout,
# so the model can take its answer from a failed call, as the paper's model often does (§2.2.3).
# Every copy sits where it sits in a clean transcript (the failure text comes before the printed
# number), so a failed call costs little reward and plain GRPO has little reason to drop it; the
# designs measured and not adopted: docs/tiny-task.md.
BUGS = (
    lambda expression: f"print({expression})\nexit(1)",
)


def make_sft_transcripts(problems, error_fraction=0.3, seed=0):
    """Chat rows {"messages": [...]} for sft.py, one per problem {problem, answer}:

        assistant  I will compute it with Python. </reason> <tool_call> print(EXPR) </tool_call>
        tool       Tool call success / stdout: N
                   (with the bug: Tool call failure / reason: / stdout: N)
        assistant  The result is N. </reason> <answer> \\boxed{N} </answer>

    In a share `error_fraction` the call has a bug (BUGS) and the answer is taken from the failed
    call: correct trajectories with failed calls in them, which GRPO-RoC trains on less (§2.2.3).
    Every tool text is the real executor's, rendered as the rollout renders it (no execution time,
    so reruns write identical files). Assistant contents start after the template's `<reason>`.
    """
    rng = random.Random(f"sft-transcripts-{seed}")
    plans = []  # per problem: its expression and the code it runs
    for row in problems:
        expression = row["problem"][len("Compute "):-1]
        buggy = rng.choice(BUGS)(expression) if rng.random() < error_fraction else None
        plans.append((expression, buggy or f"print({expression})"))
    with Executor(workers=2) as executor:
        results = executor.map([code for _, code in plans])
    rows = []
    for row, (expression, code), result in zip(problems, plans, results):
        value = result.stdout.strip()  # the sandbox's own answer (test_tiny checks it is right)
        # the Hermes-style call the rStar2 prompt asks for (§2.1), with empty stdin
        call = json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": ""}})
        messages = [{"role": "user", "content": row["problem"]},
                    {"role": "assistant",
                     "content": f" I will compute {expression} with Python. </reason>\n"
                                f"<tool_call>\n{call}\n</tool_call>"},
                    {"role": "tool", "content": format_tool_response(result, RolloutConfig())},
                    {"role": "assistant", "content": f" The result is {value}. </reason>\n"
                                                     f"<answer> \\boxed{{{value}}} </answer>"}]
        rows.append({"messages": messages})
    return rows


def write_sft_transcripts(cfg):
    """cfg.sft_examples transcripts of split "sft" (not RL's or eval's) -> cfg.sft_data (JSONL)."""
    problems = make_arithmetic_problems(cfg.sft_examples, cfg.seed, split="sft")
    rows = make_sft_transcripts(problems, cfg.sft_error_fraction, cfg.seed)
    path = Path(cfg.sft_data)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    with_errors = sum(row["messages"][2]["content"].startswith("Tool call failure") for row in rows)
    print(f"sft transcripts: {len(rows)} ({with_errors} with a failed call) -> {path}")
    return path


# -----------------------------------------------------------------------------
# pretraining: the tiny stand-in for what Qwen3-14B-Base knows before SFT, the ability to copy
# digits, which sft.py alone behind the long rStar2 system prompt never taught (docs/tiny-task.md,
# pretraining).

def pretraining_documents(rows, tokenizer, error_fraction=0.3, seed=0):
    """The SFT transcripts of `rows` (make_sft_transcripts: real tool outputs, a share with a failed
    call) rendered as plain ChatML without the system prompt and tool schema, each assistant turn
    opening with the `<reason>` the rStar2 template adds. The copies sit at the same token distances
    as in the rStar2 transcripts, which is what lets the skill carry over to SFT."""
    docs = []
    for transcript in make_sft_transcripts(rows, error_fraction, seed):
        messages = [{**m, "content": "<reason>" + m["content"]} if m["role"] == "assistant" else m
                    for m in transcript["messages"]]
        docs.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return docs


def pretrain_base_model(model, tokenizer, cfg):
    """Next-token prediction on pretraining_documents, every token trained; AdamW, 20 warm-up steps,
    then constant lr. Problems come from their own split ("pretrain"), never an SFT, RL or held-out
    one."""
    if cfg.pretrain_steps == 0:
        return []
    rows = make_arithmetic_problems(cfg.pretrain_steps * cfg.pretrain_batch_size, cfg.seed,
                                    split="pretrain")
    # No failed calls here: they delayed the copying (docs/tiny-task.md, pretraining)
    docs = pretraining_documents(rows, tokenizer, error_fraction=0.0, seed=cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr, weight_decay=0.0)
    losses = []
    model.train()
    progress = tqdm(range(cfg.pretrain_steps), desc="pretrain", dynamic_ncols=True)
    for step in progress:
        batch = tokenizer(docs[step * cfg.pretrain_batch_size:(step + 1) * cfg.pretrain_batch_size],
                          padding=True, return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        logits = model(**batch).logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        for group in optimizer.param_groups:
            group["lr"] = cfg.pretrain_lr * min(1.0, (step + 1) / 20)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        progress.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


# -----------------------------------------------------------------------------
# tokenizer

def tokenizer_corpus(cfg):
    """The BPE's text: the rStar2 prompt templates and tool schemas (the long system prompt becomes
    a few hundred tokens), sample tool turns and arithmetic, and real training problems."""
    # The rStar2 files only, read whole: the merges are a function of every byte of them, so an
    # edit to one retrains another tokenizer and moves the demo's numbers; with chatml.jinja in
    # the corpus too the copying did not emerge (docs/tiny-task.md).
    templates = REPO / "configs" / "templates"
    files = sorted(templates.glob("rstar2_*.jinja")) + sorted(templates.glob("*.json"))
    texts = [p.read_text() for p in files] * 20
    for row in make_arithmetic_problems(2000, cfg.seed, "tokenizer"):
        code = row["problem"][len("Compute "):-1]
        texts.append(f'{row["problem"]} <reason> I will compute it with Python. </reason>\n'
                     '<tool_call>\n{"name": "python_code_with_standard_io", "arguments": '
                     f'{{"code": "print({code})", "input": ""}}}}\n</tool_call>\n'
                     f'Tool call success\nstdout: {row["answer"]}\n\nexecution time: 0.01s\n'
                     'Tool call failure\nreason: \nstderr: Traceback (most recent call last):\n'
                     'NameError: name \'x\' is not defined\n'
                     f'<reason> The result is {row["answer"]}. </reason>\n'
                     f'<answer> \\boxed{{{row["answer"]}}} </answer>')
    rows = load_jsonl("data/math_train.jsonl", required=("problem",))[: cfg.corpus_problems]
    texts += [r["problem"] for r in rows]
    return texts


def build_tokenizer(cfg):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=SPECIAL_TOKENS,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tokenizer_corpus(cfg), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    # plain Qwen-style ChatML with tools, for generic chat (sft.py's "chatml"); the rStar2 prompt is
    # chosen by config (rollout.py)
    hf.chat_template = (REPO / "configs/templates/chatml.jinja").read_text()
    hf.model_max_length = cfg.max_position_embeddings
    return hf


# -----------------------------------------------------------------------------
# model

def random_model(cfg, tokenizer):
    """A randomly initialised Qwen3-layout causal LM of cfg's shape for this tokenizer."""
    torch.manual_seed(cfg.seed)
    # padded like real checkpoints; ids past len(tokenizer) are never sampled in practice
    vocab = (len(tokenizer) + 63) // 64 * 64
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def build_tiny_model(cfg):
    """Build and save the tiny model + tokenizer; returns the output directory."""
    out = Path(cfg.out_dir)
    tokenizer = build_tokenizer(cfg)
    model = random_model(cfg, tokenizer)
    losses = pretrain_base_model(model, tokenizer, cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)  # makes the directory
    tokenizer.save_pretrained(out)
    (out / "tiny_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    parameters = sum(p.numel() for p in model.parameters())
    pretrained = (f", pretrained {len(losses)} steps (loss {losses[0]:.2f} -> {losses[-1]:.2f})"
                  if losses else "")
    print(f"tiny model: {parameters / 1e6:.2f}M parameters, vocab {len(tokenizer)}{pretrained} "
          f"-> {out}")
    return out


def main(config):
    build_tiny_model(config)
    if config.sft_data:
        write_sft_transcripts(config)
        sft = ["configs/sft_tiny.yaml", f"model={config.out_dir}", f"data={config.sft_data}"]
        print(f"next: {rerun_command('sft.py', sft)}", flush=True)


if __name__ == "__main__":
    run_script("tiny.py", lambda argv: load_config(TinyConfig, argv, doc=__doc__), main,
               lambda config, argv: f"tiny.py: interrupted. Rerun: "
                                    f"{rerun_command('tiny.py', argv)}")
