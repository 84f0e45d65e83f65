"""Multi-turn rollouts of rStar2-Agent (arXiv 2508.20722, §2.1 and §3.2): the model reasons, calls
the Python tool, reads the result and goes on, until it answers or runs out of turns or tokens.

One trajectory, token in / token out (the context is never re-tokenized):

  prompt    <|im_start|>system ... # Tools <tools>{schema}</tools> ...<|im_end|>
            <|im_start|>user\\n You must put your answer inside <answer> ... {problem}<|im_end|>
            <|im_start|>assistant\\n<reason>                                  (render_prompt)
  turn 1    ... <tool_call>\\n{"name": ..., "arguments": {"code": ..., "input": ...}}\\n</tool_call>
                                                                       (sampled: loss_mask 1)
  tool turn <|im_end|><|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n
            <|im_start|>assistant\\n<reason>                   (render_tool_turn: loss_mask 0)
  turn 2    ... <answer> \\boxed{42} </answer><|im_end|>                 (sampled: loss_mask 1)

The loop (generate) drives the engine's add_request/step itself (machinery/engine.py), so there
is no per-turn barrier: a turn that ends in a tool call goes to the executor at once, the other
trajectories keep decoding, and the continuation re-enters the engine as soon as its result is
back (§3.2). At most K trajectories are in flight per engine, K from the free KV cache; prompts
are claimed from a counter shared by all ranks, so a rank that finishes early takes more work.

How the turn, the tool turn and tool errors differ from the release: docs/design.md (Rollouts);
its baseline: bench/rollout.py.
"""
import dataclasses
import hashlib
import json
import math
import queue
import re
import time
from typing import Literal

from machinery.config import (ConfigError, NonNegativeFloat, NonNegativeInt, PositiveFloat,
                              PositiveFraction, PositiveInt)
from machinery.distributed import claim_counter, regroup
from machinery.prompts import (PromptVariant, check_format_files, load_format, render_prompt,
                               render_tool_turn)
from machinery.sandbox import truncate_middle

TOOL_ERROR_KINDS = ("error", "timeout", "oom", "parse")


@dataclasses.dataclass
class RolloutConfig:
    """The `rollout:` section of rl.py / eval.py configs. Defaults: paper stage 1 (§5.1)."""
    # format
    prompt_variant: PromptVariant = "code"  # "code" (released, <reason>), "paper" (Fig. 3,
                                  # <think>), or "auto": the model's rstar2_format.json
    chat_template: str = ""       # path to a Jinja chat template; "" = the variant's
    tool_schema: str = ""         # path to the tool's JSON schema; "" = the variant's
    use_tool: bool = True         # False: no tools section, a call is plain text (eval ablation)
    # budgets: model and tool tokens share one response budget, as in the release
    max_prompt_tokens: PositiveInt = 2048
    max_response_tokens: PositiveInt = 8192  # stage 1: 8K; stages 2-3: 12K; eval: 30K (§5.1)
    max_turns: PositiveInt = 10   # assistant turns; stage 3: 15, eval: 30
    # sampling (§5.1: 1.0 in training, 0.6 in eval; top_p is not stated, 1.0 in the release)
    temperature: NonNegativeFloat = 1.0
    top_p: PositiveFraction = 1.0
    # tool responses (docs/design.md, the released code's tool I/O and prompt formats)
    max_tool_response_chars: NonNegativeInt = 256  # verl's default cut, head + tail kept; the
                                                   # release's too
    show_execution_time: bool = False   # the release shows it; off keeps reruns token-identical
    # executor (executor.py)
    tool_timeout_s: PositiveFloat = 4.0  # code-judge MAX_EXECUTION_TIME in the release's launch
                                         # commands
    tool_workers: NonNegativeInt = 0  # 0 = the executor's default
    tool_memory_mb: PositiveInt = 1024
    # engine (vLLM, machinery/engine.py)
    dtype: str = "auto"           # the checkpoint's; float32 on CPU for exact log-probs
                                  # (docs/design.md, the CPU stack)
    gpu_memory_utilization: PositiveFraction = 0.5  # GPU: vLLM's share of GPU memory (colocated
                                                    # training)
    cpu_kv_cache_gb: NonNegativeFloat = 0.0  # CPU: KV cache GiB; 0 = what K trajectories of
                                             # context_len need
    tensor_parallel_size: PositiveInt = 1
    enforce_eager: bool = False   # True on CPU (no CUDA graphs to capture)
    max_model_len: NonNegativeInt = 0  # 0 = max_prompt_tokens + max_response_tokens
    enable_prefix_caching: bool = True  # a continuation re-sends its context: a cache lookup
    max_concurrency: NonNegativeInt = 0  # K, trajectories in flight per engine; 0 = from the
                                  # free KV cache, each at its full budget, none preempted (§3.2)
    sleep_level: Literal[1, 2] = 2  # GPU: 2 discards the weights (update_weights rewrites them),
                                  # 1 keeps them in host RAM

    def validate(self):
        """What the field types cannot say: the context holds the budget, the files exist."""
        budget = self.max_prompt_tokens + self.max_response_tokens
        if self.max_model_len and self.max_model_len < budget:
            raise ConfigError(f"rollout.max_model_len={self.max_model_len} cannot hold "
                              f"max_prompt_tokens + max_response_tokens = {budget}")
        check_format_files(self)

    @property
    def context_len(self):
        return self.max_model_len or self.max_prompt_tokens + self.max_response_tokens


@dataclasses.dataclass
class Trajectory:
    """One rollout, token-exact. response_ids (the model's and the tools' tokens after the prompt),
    loss_mask (1 = sampled by the model, 0 = tool and format tokens) and logprobs (the engine's, of
    each sampled token; 0.0 where the mask is 0) are aligned, one entry per response token."""
    problem_index: int
    sample_index: int
    prompt_ids: list
    response_ids: list = dataclasses.field(default_factory=list)
    loss_mask: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    # {code, stdin, status, output}, in order; output: the tool response text the model was shown
    tool_calls: list = dataclasses.field(default_factory=list)
    num_tool_calls: int = 0
    num_tool_errors: int = 0      # calls with status error/timeout/oom/parse (Eq. 4)
    tool_errors_by_kind: dict = dataclasses.field(
        default_factory=lambda: dict.fromkeys(TOOL_ERROR_KINDS, 0))
    num_answer_tags: int = 0      # closed <answer></answer> pairs in model text (Eq. 5)
    num_turns: int = 0            # assistant turns, the first one included (Eq. 5)
    finished: bool = False        # the last turn ended with end-of-turn, no tool call
    truncated: bool = False       # stopped by a limit instead (reward 0, §4.3.1)
    stop_reason: str = ""         # end_of_turn | max_response_tokens | max_turns | tool_overflow
    response_text: str = ""       # the decoded response, tool turns included
    # The model's turns only (loss_mask 1 tokens, decoded per turn): what the reward, answer tags
    # and metrics read; never cut out of response_text, where a tool can print "</tool_response>".
    model_text: str = ""

    @property
    def num_model_tokens(self):
        return sum(self.loss_mask)


# -----------------------------------------------------------------------------
# the tool call and the tool response (§2.1)


class ToolCallError(ValueError):
    """A tool call the model wrote that cannot run. The message is the tool response it reads."""


TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_call(turn_text, tool_name):
    """The Hermes-style call in one assistant turn -> {"code", "stdin"}, or None without a call.

    Malformed calls raise ToolCallError in the released code's wording
    (tests/reference/tool_io_format.txt §2): they go back to the model as its tool response and
    count as tool errors of kind "parse" (§2.1: "the error message is wrapped in <tool_response>
    tags and returned to the model"). A turn that reaches </tool_call> made a call, even without
    the opening tag. Only the first call runs (verl's max_parallel_calls = 1)."""
    match = TOOL_CALL_RE.search(turn_text)
    if match is None:
        if "</tool_call>" in turn_text:
            raise ToolCallError("Failed to decode tool call: </tool_call> without an opening "
                                "<tool_call>")
        return None

    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as e:
        raise ToolCallError(f"Failed to decode tool call: {e}") from None
    if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
        raise ToolCallError('Failed to decode tool call: expected {"name": ..., '
                            '"arguments": {...}}')
    if call["name"] != tool_name:
        raise ToolCallError(f"Error when executing tool: unknown tool {call['name']!r}; "
                            f"the tool is {tool_name!r}")

    args = call["arguments"]
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        raise ToolCallError('Error when executing tool: arguments must be '
                            '{"code": <string>, "input": <string>}')
    # The schema marks "input" required; a missing one means empty stdin, not a wasted turn.
    stdin = args.get("input", "")
    if not isinstance(stdin, str):
        raise ToolCallError('Error when executing tool: "input" must be a string, '
                            f"got {type(stdin).__name__}")
    return {"code": args["code"], "stdin": stdin}


def format_tool_response(result, cfg):
    """The text inside <tool_response> for an executor.ExecResult, cut in the middle."""
    return result.tool_response(max_chars=cfg.max_tool_response_chars,
                                show_time=cfg.show_execution_time)


ANSWER_PAIR_RE = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def count_answer_tags(model_text):
    """Closed <answer>...</answer> pairs in model-written text (a tool's "<answer>" must not
    count), for p_format (Eq. 5); 0 when the tags do not balance, scored as no answer, as in the
    release (calc_format_penalty_weights)."""
    pairs = len(ANSWER_PAIR_RE.findall(model_text))
    if model_text.count("<answer>") != pairs or model_text.count("</answer>") != pairs:
        return 0
    return pairs


# -----------------------------------------------------------------------------
# the rollout loop: no per-turn barrier, K trajectories in flight (§3.2)


_generate_calls = 0  # each call claims from a counter of its own


def generate(engine, executor, tokenizer, problems, n, cfg, seed, step=0, times=None):
    """Roll out n trajectories for each problem. Collective: every rank passes the same `problems`
    (texts or rows with a "problem"), claims them (or parts of their groups) from one counter, and
    -> its [[n Trajectory] per problem] in problem order: each group whole on one rank.
    times["generate"]: this rank's own seconds, before it waits for the others to regroup."""
    global _generate_calls

    if n < 1:
        raise ValueError(f"generate: n must be >= 1, got {n}")
    texts = [p["problem"] if isinstance(p, dict) else p for p in problems]
    if cfg.use_tool and executor is None and engine.is_leader:
        raise ValueError("generate: rollout.use_tool is on but no executor was given")
    _generate_calls += 1
    claim = claim_counter(f"rollout/{_generate_calls}/step{step}")
    budget = cfg.max_prompt_tokens + cfg.max_response_tokens
    if budget > engine.cfg.context_len:
        raise ValueError(f"generate: max_prompt_tokens + max_response_tokens = {budget}"
                         f" exceeds the engine's max_model_len {engine.cfg.context_len}")
    groups, started = [], time.perf_counter()
    if engine.is_leader:
        groups = Rollouts(engine, executor, tokenizer, texts, n, cfg, seed, step, claim).run()
        engine.stop_followers()
    else:  # tensor parallel: this rank replays its group leader's engine calls
        engine.follow()
    if times is not None:
        times["generate"] = time.perf_counter() - started
    return regroup(groups) if n > capacity(engine, cfg) else groups


def capacity(engine, cfg):
    # K from the KV cache, every trajectory at its full budget: none is ever preempted (§3.2).
    return min(engine.max_concurrency(), cfg.max_concurrency or float("inf"))


class Rollouts:
    """One generate() call's trajectories. Each is in exactly one of waiting, running and tooling
    until it ends; running and tooling count towards K: one waiting on its tool holds no KV cache
    now, but its continuation will need room for its whole context again."""
    parts = 0  # the parts a group is claimed in; 0: one per sample if n > K, else 1

    def __init__(self, engine, executor, tokenizer, texts, n, cfg, seed, step, claim):
        self.engine = engine
        self.executor = executor
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.texts = texts  # the problems, in the order every rank passed them
        self.n = n  # samples per problem
        self.claim = claim  # the next index of the counter all ranks share
        self.seed = seed
        self.step = step
        _, _, self.tool_name = load_format(cfg)

        self.end_of_turn = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
        self.call_end = tokenizer.convert_tokens_to_ids("</tool_call>") if cfg.use_tool else None
        if cfg.use_tool and (self.call_end is None or self.call_end == tokenizer.unk_token_id):
            raise ValueError("the tokenizer has no single </tool_call> token; "
                             "the loop stops a turn on that token id")
        self.stop_ids = sorted(self.end_of_turn | ({self.call_end} if cfg.use_tool else set()))
        # Closes a tool-call turn that stopped at </tool_call>, unsampled (docs/design.md, Rollouts)
        self.close_turn = tokenizer.encode("<|im_end|>", add_special_tokens=False)

        self.waiting = []       # trajectories claimed, not yet in the engine
        self.running = {}       # request id -> trajectory in the engine
        self.tooling = {}       # executor future -> (trajectory, call)
        self.results = queue.SimpleQueue()  # tool futures as they complete: no polling
        self.groups = {}        # problem index -> its n trajectories
        self.exhausted = False  # the shared counter has run past the last problem

    def run(self):
        """The event loop -> this rank's [[n Trajectory] per problem] in problem order. One engine
        step decodes one token for every running request; a tool result that arrives meanwhile
        waits at most one step before its continuation is in the engine. No thread touches vLLM
        but this one."""
        self.admit()
        while self.in_flight() or self.waiting or not self.exhausted:
            if self.engine.has_unfinished():
                self.step_engine()
                # Results that came back while the engine stepped re-enter at once: no barrier.
                while not self.results.empty():
                    self.collect(self.results.get())
            elif self.tooling:  # nothing to decode: block on the next tool result, never spin
                self.collect(self.results.get())
            self.admit()
        return [self.groups[i] for i in sorted(self.groups)]

    def in_flight(self):
        return len(self.running) + len(self.tooling)

    def capacity(self):
        return capacity(self.engine, self.cfg)

    def admit(self):
        # A rank claims work only when it has room for it, so a slow rank never hoards prompts it
        # cannot start.
        while self.in_flight() < self.capacity() and (self.waiting or not self.exhausted):
            self.waiting = self.waiting or self.claim_group()
            if self.waiting:
                self.next_turn(self.waiting.pop(0))

    def claim_group(self):
        # n samples stay together (GRPO-RoC selects in a group, §2.2.3); if n > K, each is claimed
        # alone and generate regroups them: else the last claimer runs ceil(n / K) waves alone
        parts = self.parts or (self.n if self.n > capacity(self.engine, self.cfg) else 1)
        size = math.ceil(self.n / parts)
        index, part = divmod(self.claim(), parts)
        self.exhausted = index >= len(self.texts)
        if self.exhausted:
            return []
        claimed = self.new_trajectories(index, range(part * size, min(self.n, part * size + size)))
        self.groups.setdefault(index, []).extend(claimed)
        return claimed

    def new_trajectories(self, index, samples):
        prompt = render_prompt(self.tokenizer, self.texts[index], self.cfg)
        if len(prompt) > self.cfg.max_prompt_tokens:
            raise ValueError(f"problem {index}: the prompt is {len(prompt)} tokens, more "
                             f"than rollout.max_prompt_tokens={self.cfg.max_prompt_tokens}")
        return [Trajectory(index, i, prompt) for i in samples]

    def next_turn(self, traj):
        # One request per assistant turn, seeded per turn: a continuation draws afresh.
        turn = traj.num_turns
        request_id = f"{self.step}-{traj.problem_index}-{traj.sample_index}-{turn}"
        self.running[request_id] = traj
        # The whole context goes back in as tokens (never re-tokenized): the prefix cache serves it.
        seed = request_seed(self.seed, self.step, traj.problem_index, traj.sample_index, turn)
        self.engine.add(request_id, traj.prompt_ids + traj.response_ids,
                        max_tokens=self.cfg.max_response_tokens - len(traj.response_ids),
                        seed=seed, stop_token_ids=self.stop_ids,
                        temperature=self.cfg.temperature, top_p=self.cfg.top_p)

    def end(self, traj, reason):
        # Finished: the last turn ended by itself, answered or not; the rest are truncated and
        # score 0 (§4.3.1).
        traj.finished = reason == "end_of_turn"
        traj.truncated = not traj.finished
        traj.stop_reason = reason
        traj.num_answer_tags = count_answer_tags(traj.model_text)
        traj.response_text = self.tokenizer.decode(traj.response_ids, skip_special_tokens=False)

    def turn_ended(self, traj, token_ids, logprobs):
        traj.response_ids += token_ids
        traj.loss_mask += [1] * len(token_ids)
        traj.logprobs += logprobs
        traj.num_turns += 1

        # Special tokens kept: the parser needs </tool_call>; only this text has answer tags (Eq. 5)
        turn_text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        traj.model_text += turn_text
        last = token_ids[-1] if token_ids else None
        if last in self.end_of_turn:
            return self.end(traj, "end_of_turn")
        if last != self.call_end:  # neither stop token: the request ran out of the shared budget
            return self.end(traj, "max_response_tokens")

        # The turn ends in a tool call. As in the release, the turn limit is checked first.
        if traj.num_turns >= self.cfg.max_turns:
            return self.end(traj, "max_turns")
        # A call that does not parse still counts as a call, and as a failed one: Eq. 4's p_err
        # penalises all three failure modes of §2.1, invalid format included.
        traj.num_tool_calls += 1
        try:
            call = parse_tool_call(turn_text, self.tool_name)
        except ToolCallError as e:
            return self.tool_done(traj, {"code": None, "stdin": None}, "parse",
                                  truncate_middle(str(e), self.cfg.max_tool_response_chars))
        self.run_tool(traj, call)  # to the executor the moment it is parsed (§3.2)

    def run_tool(self, traj, call):
        future = self.executor.submit(call["code"], stdin=call["stdin"])
        self.tooling[future] = (traj, call)
        future.add_done_callback(self.results.put)

    def tool_done(self, traj, call, status, text):
        traj.tool_calls.append({**call, "status": status, "output": text})
        if status != "ok":
            traj.num_tool_errors += 1
            traj.tool_errors_by_kind[status] = traj.tool_errors_by_kind.get(status, 0) + 1
        # What the model reads back, the module docstring's tool turn (loss_mask 0: never trained)
        tool_ids = self.close_turn + render_tool_turn(self.tokenizer, text, self.cfg)
        # A tool turn that would fill the budget ends the trajectory unappended, so the last turn
        # is always the model's (the release's stop rule).
        if len(traj.response_ids) + len(tool_ids) >= self.cfg.max_response_tokens:
            return self.end(traj, "tool_overflow")
        traj.response_ids += tool_ids
        traj.loss_mask += [0] * len(tool_ids)
        traj.logprobs += [0.0] * len(tool_ids)
        self.next_turn(traj)

    def collect(self, future):
        traj, call = self.tooling.pop(future)
        result = future.result()
        self.tool_done(traj, call, result.status, format_tool_response(result, self.cfg))

    def step_engine(self):
        # One engine step: a token for every running request. It reports only the requests whose
        # turn ended (a stop token, or the budget), with the turn's tokens and log-probs.
        for request_id, token_ids, logprobs in self.engine.step():
            self.turn_ended(self.running.pop(request_id), token_ids, logprobs)


def request_seed(seed, step, problem_index, sample_index, turn):
    """The sampling seed of one engine request: vLLM gives a seeded request its own generator, so a
    rerun of a step draws the same tokens whichever rank, batch or order it lands in (bit-exact
    on CPU in fp32)."""
    key = f"{seed}/{step}/{problem_index}/{sample_index}/{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1  # non-negative int64
