"""Chat conversations for sft.py: rows, format files, the checks that a chat template cuts into
rollout segments, and conversations packed into model inputs."""
import json

import torch

from machinery.config import ConfigError, resolve
from machinery.prompts import DATA_PLACEHOLDER

ROLES = ("system", "user", "assistant", "tool")
# The token that ends an assistant turn, where the rollout stops: ChatML's, not tokenizer.eos_token
# (<|endoftext|> in base checkpoints such as Qwen3-14B-Base).
END_OF_TURN = "<|im_end|>"
IGNORE = -100  # label of a position that predicts nothing we train


# rows and format files

def check_conversation(row, where):
    """Raise ConfigError naming the row and message if `row` is no conversation sft.py trains on."""
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: expected a non-empty list under 'messages'")

    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else message
        if not isinstance(message, dict) or role not in ROLES:
            raise ConfigError(f"{where}: message {i}: role {role!r:.80} is not in {list(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str) or (role == "assistant" and not content):
            raise ConfigError(f"{where}: message {i} ({role}): 'content' must be a string, "
                              f"non-empty for the assistant, got {content!r:.80}")

    first, last = messages[0]["role"], messages[-1]["role"]
    if first not in ("system", "user") or last != "assistant":  # a turn after it trains nothing
        raise ConfigError(f"{where}: runs {first!r} to {last!r}; want system/user to assistant")

    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise ConfigError(f"{where}: 'tools' must be a list of JSON tool schemas")


def read_template(path):
    """The Jinja text of chat_template; "chatml": configs/templates/chatml.jinja (Qwen's, tools)."""
    if path == "chatml":
        path = "configs/templates/chatml.jinja"
    return resolve(path).read_text() if path else None


def read_tools(path):
    if not path:
        return None
    try:
        schema = json.loads(resolve(path).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"tool_schema {path}: not valid JSON ({e})") from None
    return schema if isinstance(schema, list) else [schema]


def prompt_format(cfg, tokenizer):
    """(template text, tool schema or None) for the saved model directory: a schema only when the
    config gives exactly one."""
    tools = read_tools(cfg.tool_schema)
    template = read_template(cfg.chat_template) or tokenizer.chat_template
    return template, tools[0] if tools and len(tools) == 1 else None


# rendering: a chat template's text, and the checks that it cuts into rollout segments

def chat_text(tokenizer, messages, tools, chat_template, add_generation_prompt):
    """The template's text of `messages` (the tokenizer's own template if chat_template is None)."""
    return tokenizer.apply_chat_template(messages, tools=tools or None,
                                         chat_template=chat_template or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def end_of_turn_ids(tokenizer):
    """[END_OF_TURN's id]; without it as one token a turn cannot end as it does in rollout.py."""
    ids = tokenizer.encode(END_OF_TURN, add_special_tokens=False)
    if len(ids) != 1:
        raise ConfigError(f"the tokenizer has no single {END_OF_TURN} token; use a ChatML one")
    return ids


def check_context(tokenizer, messages, k, prompt, covered, tools, chat_template, where):
    """`prompt` (the text up to assistant message k, tool contents as DATA_PLACEHOLDER) must extend
    what the earlier segments `covered`, each tool message in it once and verbatim."""
    tool_texts = [m["content"] for m in messages[:k] if m["role"] == "tool"]
    parts = prompt.split(DATA_PLACEHOLDER)
    if not prompt.startswith(covered) or len(parts) != len(tool_texts) + 1 or chat_text(
            tokenizer, messages[:k], tools, chat_template, add_generation_prompt=True) != "".join(
                part + text for part, text in zip(parts, tool_texts + [""])):
        raise ConfigError(f"{where}: the chat template renders message {k}'s context otherwise")



def check_turn(covered, written, k, where):
    """The text through assistant message k must start with `written` (the generation prompt + the
    content) + END_OF_TURN, or SFT would train on text the model never sees at rollout time."""
    if not covered.startswith(written + END_OF_TURN):
        raise ConfigError(f"{where}: the chat template rewrites assistant message {k}")


# packing: a micro-batch of (input_ids, loss_mask) into model inputs and labels

def collate_conversations(examples, pad_id):
    """Right-padded [B, T] model inputs, and labels[b, t] = the token position t must predict
    (t + 1), or IGNORE."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention_mask[row, :len(ids)] = 1
        labels[row, :len(ids) - 1] = torch.tensor(
            [t if m else IGNORE for t, m in zip(ids[1:], mask[1:])])
    return {"input_ids": input_ids, "attention_mask": attention_mask}, labels


def shared_prefix_length(examples, min_saving=0.5):
    """How many leading tokens all conversations of a micro-batch share before their first trained
    token (the system prompt, tool schemas and user prefix: 406 of ~580 tokens per tiny-demo
    transcript). 0 unless encoding that prefix once would save at least `min_saving` of the
    micro-batch's tokens."""
    if len(examples) < 2:
        return 0
    first = examples[0][0]
    # the token at `length` must not be a target
    limit = min(mask.index(1) for _, mask in examples) - 1
    length = 0
    while length < limit and all(ids[length] == first[length] for ids, _ in examples):
        length += 1
    saved = length * (len(examples) - 1)
    return length if saved >= min_saving * sum(len(ids) for ids, _ in examples) else 0


def collate_shared_prefix(examples, prefix_length):
    """The micro-batch as ONE row: the shared prefix once, then each conversation's remainder
    attending to the prefix and itself, with its own positions: the padded batch's loss and
    gradients (to rounding; tests/test_sft.py) for less compute."""
    tokens, positions = list(examples[0][0][:prefix_length]), list(range(prefix_length))
    segments = [-1] * prefix_length
    labels = [IGNORE] * prefix_length  # the prefix predicts only untrained tokens
    for index, (ids, mask) in enumerate(examples):
        tokens += ids[prefix_length:]
        positions += range(prefix_length, len(ids))
        segments += [index] * (len(ids) - prefix_length)
        labels += [t if m else IGNORE
                   for t, m in zip(ids[prefix_length + 1:], mask[prefix_length + 1:])] + [IGNORE]
    segment = torch.tensor(segments)
    causal = torch.ones(len(tokens), len(tokens), dtype=torch.bool).tril()
    visible = causal & ((segment[None, :] == -1) | (segment[None, :] == segment[:, None]))
    inputs = {"input_ids": torch.tensor([tokens]), "position_ids": torch.tensor([positions]),
              "attention_mask": visible[None, None]}  # a 4D mask is used as is (True = may attend)
    return inputs, torch.tensor([labels])
