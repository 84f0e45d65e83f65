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
KV cache, so nothing is evicted and recomputed; prompts are claimed from a counter shared by all ranks, so a
rank that finishes early takes more work.

Paper vs released code (microsoft/rStar @ ecbfb94), and what this file does:
  - the turn: the release samples until <|im_end|> and parses the call from the whole turn; here a turn also
    stops at </tool_call> (nothing the model writes after its call is ever read), and the <|im_end|> that
    closes it is appended unsampled (loss_mask 0), so the tokens equal the release's for a well-formed call.
  - the tool turn follows the release byte for byte, including its missing "\\n" between the assistant's
    <|im_end|> and <|im_start|>user (verl slices the system block off a re-rendered [tool] message).
  - tool errors are counted from the executor's status and the parser, not by grepping for "error".
  - execution time is left out of tool responses by default (show_execution_time), so a rerun of a step is
    token-identical; the release prints it.
  - the load-balanced scheduler of §3.2 is not in the release; this is our reading of it.

Use:   from rollout import RolloutConfig, Engine, generate, render_prompt, render_tool_turn
Run:   python rollout.py model=out/tiny-model n=4            # rollouts on a few arithmetic problems
Bench: python rollout.py mode=bench model=out/tiny-model     # this loop vs a per-turn barrier, same run
Tests: .venv/bin/python -m pytest tests/test_rollout.py -q
"""
import dataclasses
import functools
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent

# The two prompt formats (paper vs release differ in four places, shared/docs/reference/prompt_template_paper_fig3.txt).
# `prompt_variant` switches template and tool schema together; explicit paths override either.
PROMPT_VARIANTS = {
    "code": ("configs/templates/rstar2_code.jinja", "configs/templates/python_code_with_standard_io.json"),
    "paper": ("configs/templates/rstar2_paper.jinja", "configs/templates/execute_python_code_with_standard_io.json"),
}
TOOL_ERROR_KINDS = ("error", "timeout", "oom", "parse")


# -----------------------------------------------------------------------------
# config


@dataclasses.dataclass
class RolloutConfig:
    """The `rollout:` section of rl.py / eval.py configs. Defaults are the paper's stage-1 values (§5.1)."""
    # format
    prompt_variant: str = "code"        # "code" (released, <reason>) or "paper" (Fig. 3, <think>)
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
    gpu_memory_utilization: float = 0.5  # colocated with training; on CPU it is the share of host memory vLLM takes
    tensor_parallel_size: int = 1
    enforce_eager: bool = False         # True on CPU (no CUDA graphs to capture)
    max_model_len: int = 0              # 0 = max_prompt_tokens + max_response_tokens
    enable_prefix_caching: bool = True  # a continuation re-sends the whole context; the cache makes that a lookup
    max_concurrency: int = 0            # K, trajectories in flight per engine; 0 = from the free KV cache (§3.2)
    sleep_level: int = 1                # GPU only: 1 offloads weights to host RAM and drops the KV cache

    def validate(self):
        if self.prompt_variant not in PROMPT_VARIANTS:
            raise ValueError(f"rollout.prompt_variant: {self.prompt_variant!r} is not one of {sorted(PROMPT_VARIANTS)}")
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
        if self.sleep_level not in (1, 2):
            raise ValueError(f"rollout.sleep_level must be 1 or 2, got {self.sleep_level}")
        template_path, schema_path = format_paths(self)
        for name, path in (("chat_template", template_path), ("tool_schema", schema_path)):
            if not path.is_file():
                raise ValueError(f"rollout.{name}: file not found: {path}")

    @property
    def context_len(self):
        return self.max_model_len or self.max_prompt_tokens + self.max_response_tokens


# -----------------------------------------------------------------------------
# the trajectory record


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

    @property
    def num_model_tokens(self):
        return sum(self.loss_mask)


# -----------------------------------------------------------------------------
# format: the prompt, the tool call and the tool turn (§2.1)


def format_paths(cfg):
    template, schema = PROMPT_VARIANTS[cfg.prompt_variant]
    return _resolve(cfg.chat_template or template), _resolve(cfg.tool_schema or schema)


def _resolve(path):
    path = Path(path)
    return path if path.is_absolute() or path.exists() else REPO / path


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


def _render(tokenizer, messages, cfg, add_generation_prompt):
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


def render_tool_turn(tokenizer, tool_text, cfg):
    """Token ids appended after the assistant's <|im_end|> that closes a tool-call turn:
    <|im_start|>user\\n<tool_response>\\n{tool_text}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n + opening tag.

    Rendered by the template itself (a conversation with and without the tool message, the common prefix cut),
    as the release does, so a custom template's tool turn comes out right too. It starts with a special token,
    so tokenizing it alone gives the same ids as tokenizing it in context."""
    question = [{"role": "user", "content": "?"}]
    before = _render(tokenizer, question, cfg, add_generation_prompt=False)
    after = _render(tokenizer, question + [{"role": "tool", "content": tool_text}], cfg, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError(f"chat template {format_paths(cfg)[0]}: rendering a tool message changes the text before it; "
                         "cannot cut out the tool turn")
    return tokenizer.encode(after[len(before):], add_special_tokens=False)


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


def truncate_middle(text, max_chars):
    """Keep the head and the tail: verl's tool_response_truncate_side="middle" (tool_io_format.txt §3).
    The head holds the first printed lines, the tail the last traceback line, which says what went wrong."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


def format_tool_response(result, cfg):
    """The text inside <tool_response> for an executor result, in the release's wording (tool_io_format.txt §3)."""
    lines = ["Tool call success" if result.status == "ok" else "Tool call failure"]
    if result.status != "ok":
        lines.append("reason: " + {"timeout": "worker_timeout", "oom": "memory_limit"}.get(result.status, ""))
    if result.stdout:
        lines.append(f"stdout: {result.stdout}")
    if result.stderr:
        lines.append(f"stderr: {result.stderr}")
    if cfg.show_execution_time:
        lines.append(f"execution time: {result.elapsed_s:.2f}s")
    return truncate_middle("\n".join(lines), cfg.max_tool_response_chars)


ANSWER_OPEN_RE = re.compile(r"<answer>")
ANSWER_CLOSE_RE = re.compile(r"</answer>")
ANSWER_PAIR_RE = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def count_answer_tags(model_text):
    """Closed <answer>...</answer> pairs, for p_format (Eq. 5); 0 when the tags do not balance, which scores the
    same as no answer, as in the release (calc_format_penalty_weights). Pass model-written text only: a tool
    that prints "<answer>" must not count."""
    pairs = len(ANSWER_PAIR_RE.findall(model_text))
    if len(ANSWER_OPEN_RE.findall(model_text)) != pairs or len(ANSWER_CLOSE_RE.findall(model_text)) != pairs:
        return 0
    return pairs
