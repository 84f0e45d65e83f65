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
import hashlib
import json
import queue
import re


from machinery.sandbox import truncate_middle
from machinery.config import resolve
from machinery.distributed import _claim_counter
from machinery.prompts import AUTO_VARIANT, format_paths, load_format, PROMPT_VARIANTS, render_prompt, render_tool_turn

TOOL_ERROR_KINDS = ("error", "timeout", "oom", "parse")
ADMISSION_RULES = ("budget", "expected")  # RolloutConfig.admission


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
            paths = [(name, resolve(getattr(self, name))) for name in ("chat_template", "tool_schema")
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


# -----------------------------------------------------------------------------
# the engine: every vLLM call lives here, so a vLLM upgrade touches one place; on CPU its KV cache is sized from
# the config


# -----------------------------------------------------------------------------
# the rollout loop: no per-turn barrier (§3.2)


def request_seed(seed, step, problem_index, sample_index, turn):
    """The sampling seed of one engine request: vLLM gives a seeded request its own generator, so a rerun of a step
    draws the same tokens whichever rank, batch or order it lands in (bit-exact on CPU fp32; the resume test)."""
    key = f"{seed}/{step}/{problem_index}/{sample_index}/{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1  # a non-negative int64


_generate_calls = 0


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


# -----------------------------------------------------------------------------
# command line: a look at some rollouts (the loop's benchmark is python -m bench.rollout)


