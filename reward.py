"""The reward of rStar2-Agent (arXiv 2508.20722, Eq. 3): 1 if the final \\boxed{} answer equals the
reference, else 0.

  r = 1 if the rollout finished and extract_answer(response) equals gold, else 0: grade_batch for
  a step's batch (the fast path here, the rest deduplicated to math-verify's workers), is_equivalent
  for one pair. No format or tool reward (§2.2.1); a truncated rollout scores 0 (§4.3.1).

A wrong reward silently poisons training and a hung verifier stalls a whole step, so:
  1. extract_answer takes the last \\boxed{...} / \\fbox{...} / \\boxed 5 of the *model's prose*:
     text inside <tool_call> and <tool_response> blocks is skipped, so code that prints
     "\\boxed{42}" earns nothing. require_answer_tag=True also demands the box sit inside the last
     <answer>...</answer>, as the paper's prompt asks; the released code does not require it, and
     neither does the default here.
  2. fast_equivalent decides most pairs in microseconds, in-process: equal after normalising
     notation ("1,080" = "1080", "10,\\!080" = "10080", \\dfrac = \\frac, 90^\\circ = 90, "x=5" =
     "5", \\text{(C)} = "C", units dropped; "32, 349" is a list, not 32349). It says "not equal"
     only for two plain numbers that differ; everything else it cannot call equal goes on. Integer
     answers (the paper's training data, §4.2) never leave it.
  3. The rest goes to math-verify (symbolic equivalence: the library, not a hand-written parser) in
     a pool of worker processes. Each distinct answer is first parsed and evaluated once
     ("3\\sqrt{13}" is a number, far from "10": rejected; "(6,31,-1)" is a tuple, never one number);
     only pairs still open pay for math-verify's verify. Nothing becomes True without math-verify or
     an equal normalised spelling, nothing False without math-verify's verify or parse, or two
     different plain numbers.
  4. Every check has a hard limit in worker CPU time (machinery/verifier.py), so a verdict never
     depends on the machine's load. Out of time or crashed means False; a check that a stuck or
     starved worker never finished is 0, and grade_batch reports it: it is not a wrong answer.

Paper vs released code (microsoft/rStar @ ecbfb94), and what this file does:
  - the release accepts if PRIME's grader OR math-verify accepts; here the fast path OR math-verify.
  - the release scores the whole decoded text, tool output included; here only model prose (1.).
  - the release scores truncated text like any other; here finished=False gives 0 (as the paper).
  - the release verifies remotely in the code sandbox (§3.1); here in local worker processes.
  - an answer in several boxes: math-verify's parse joins every box of the text into one set, so
    "\\boxed{3} and \\boxed{5}" is {3, 5} (equal to neither 3 nor 5) and "\\boxed{1}, \\boxed{2}"
    equals the list "1,2". Here the last box is the answer: 5 in the first case, 2 in the second (a
    list answer must be given in one box, "\\boxed{1, 2}", as the prompt's "final answer ... by the
    \\boxed{} tag" asks).
"""
import functools
import re
from fractions import Fraction

from machinery.verifier import COLLECTION, far_apart, run_in_pool

# Worker CPU seconds per check, all stages together. math-verify's own default is 5 s per stage;
# MATH answers take 1-50 ms, so 5 s only ever binds on pathological input.
DEFAULT_TIMEOUT_S = 5.0
# The longest gold answer in data/*.jsonl is 159 characters (a 3x3 matrix). A "final answer" six
# times longer is not an answer, and parsing it could cost seconds of sympy: 0, unparsed.
MAX_ANSWER_CHARS = 1000

# -----------------------------------------------------------------------------
# The entry point: a batch of decoded responses against their gold answers (rl.py, eval.py)


def grade_batch(responses, golds, finished=True, require_answer_tag=False,
                timeout_s=DEFAULT_TIMEOUT_S):
    """The reward of Eq. 3 for each decoded response against its gold answer, in order: (rewards,
    unfinished), rewards 0.0 / 1.0. finished: one bool for all, or one per response; False
    (truncated) scores 0 (§4.3.1). The fast path runs here; the rest is deduplicated (a group's
    2G rollouts often agree) and verified by the worker pool. unfinished[i]: no verdict (a worker
    stuck or starved past its backstop): 0, yet not wrong."""
    responses, golds = list(responses), list(golds)
    if len(responses) != len(golds):
        raise ValueError(f"grade_batch: {len(responses)} responses but {len(golds)} golds")
    if isinstance(finished, str) or not hasattr(finished, "__len__"):  # one flag for the batch
        finished = [finished] * len(responses)
    finished = list(finished)
    if len(finished) != len(responses):
        raise ValueError(f"grade_batch: {len(responses)} responses but {len(finished)} finished "
                         "flags")

    rewards = [0.0] * len(responses)
    unfinished = [False] * len(responses)
    undecided = {}  # (pred, gold) -> indices waiting for math-verify
    for i, (response, gold, done) in enumerate(zip(responses, golds, finished)):
        if not isinstance(response, str):
            raise TypeError(f"grade_batch: responses[{i}] must be a str, got "
                            f"{type(response).__name__}")
        if isinstance(done, str) or done is None:
            raise TypeError(f"grade_batch: finished[{i}] must be a bool, got {done!r}")
        gold = _check_gold(gold, f"grade_batch: golds[{i}]")
        if not done:  # truncated: kept in the batch with reward 0, not filtered out (§4.3.1)
            continue
        pred = extract_answer(response, require_answer_tag=require_answer_tag)
        if pred is None:  # no final box: 0, like a wrong answer (no format reward, §2.2.1)
            continue
        verdict = fast_equivalent(pred, gold)
        if verdict is None:
            undecided.setdefault((pred, gold), []).append(i)
        elif verdict:
            rewards[i] = 1.0

    # the rest, each distinct (answer, gold) pair once, in math-verify's worker pool
    pairs = list(undecided)
    for pair, verdict, cut in zip(pairs, *_slow_path(pairs, timeout_s)):
        for i in undecided[pair]:
            rewards[i] = float(verdict)
            unfinished[i] = cut
    return rewards, unfinished


def _check_gold(gold, where):
    """The gold answer, unboxed; a clear error for a gold no answer could match (a data error)."""
    if not isinstance(gold, str):
        raise TypeError(f"{where}: gold must be a str, got {type(gold).__name__} {gold!r}")
    depth = 0
    for token in _BRACE_TOKEN.finditer(gold):
        depth += {"{": 1, "}": -1}.get(token.group(), 0)
        if depth < 0:
            break
    if depth:
        raise ValueError(f"{where}: gold answer is malformed, its braces do not balance: "
                         f"{gold[:200]!r}")
    if "\\boxed" in gold or "\\fbox" in gold:
        gold = extract_answer(gold) or ""
    if not gold.strip():
        raise ValueError(f"{where}: gold answer is empty; a data row without an answer cannot be "
                         "scored")
    return gold.strip()


# -----------------------------------------------------------------------------
# One answer against its gold, the same verdict outside a batch (tests, bench/, a REPL)


def is_equivalent(pred, gold, timeout_s=DEFAULT_TIMEOUT_S):
    """Is the answer `pred` the same as `gold`? Both are answers, not responses ("\\frac12", "0.5").

    Takes at most about timeout_s of worker CPU (and a worker's startup on the first call).
    None, empty or over-long preds are False. A boxed pred or gold is unboxed first.
    """
    gold = _check_gold(gold, "is_equivalent")
    if pred is None:  # extract_answer found no usable box
        return False
    if not isinstance(pred, str):
        raise TypeError(f"is_equivalent: pred must be a str or None, got {type(pred).__name__}")
    if "\\boxed" in pred or "\\fbox" in pred:
        pred = extract_answer(pred)
    if not pred or not pred.strip() or len(pred) > MAX_ANSWER_CHARS:
        return False
    verdict = fast_equivalent(pred, gold)
    if verdict is not None:
        return verdict
    return _slow_path([(pred.strip(), gold)], timeout_s)[0][0]


# -----------------------------------------------------------------------------
# Extraction: the last box of the model's own text


def _model_prose(text):
    """`text` minus every <tool_call>...</tool_call> and <tool_response>...</tool_response> block.

    A tag scan cannot be the boundary against the tool: code that prints "</tool_response>" ends the
    block early. So rl.py and eval.py pass only the model's own turns
    (rollout.Trajectory.model_text, cut by the loss mask), and this skip is for the code inside them
    and for whole transcripts without the tokens. An unclosed block runs to the end.
    """
    # Both tags are single tokens of the Qwen tokenizer and survive skip_special_tokens
    # (docs/design.md, the released code's tool I/O): they are in the text rollout.py passes.
    closers = {"<tool_call>": "</tool_call>", "<tool_response>": "</tool_response>"}

    # One scan, each tag re-searched only once passed: linear for a megabyte of unclosed tags.
    next_open = {tag: text.find(tag) for tag in closers}
    kept, pos = [], 0
    while True:
        found = [(at, tag) for tag, at in next_open.items() if at >= 0]
        if not found:
            kept.append(text[pos:])
            return "".join(kept)
        start, tag = min(found)
        kept.append(text[pos:start])
        end = text.find(closers[tag], start + len(tag))
        if end < 0:
            return "".join(kept)
        pos = end + len(closers[tag])
        for other, at in next_open.items():
            if 0 <= at < pos:
                next_open[other] = text.find(other, pos)


# Only braces and backslash escapes matter for matching: \{ and \} are literal braces, and "\\}" is
# a line break followed by a real closing brace, so a backslash always swallows the next character.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)


def _box_content(text, start):
    """The argument of the box command whose name ends at `start`, or None if it is malformed."""
    # Never look further than an answer can be long: a megabyte box costs no more than a short one.
    rest = text[start:start + MAX_ANSWER_CHARS + 2]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        open_at = start + len(rest) - len(stripped)
        depth = 0
        for token in _BRACE_TOKEN.finditer(text, open_at, open_at + MAX_ANSWER_CHARS + 2):
            if token.group() == "{":
                depth += 1
            elif token.group() == "}":
                depth -= 1
                if depth == 0:
                    return text[open_at + 1:token.start()]
        return None  # unbalanced, or longer than MAX_ANSWER_CHARS
    if len(stripped) < len(rest) and stripped:
        # "\boxed 5": TeX takes the next token; MATH solutions use it for single numbers.
        return re.match(r"[^\s$]*", stripped).group()
    return None  # "\boxedx", or the command at the very end


def extract_answer(text, require_answer_tag=False):
    """The content of the last \\boxed{...} (\\fbox{...}, \\boxed 5) in the model's prose, or None.

    Nested braces are matched. The last box is taken even when an earlier one is complete: a final
    box that is empty, unbalanced or over MAX_ANSWER_CHARS means the final answer is malformed, and
    gives None. require_answer_tag: only look inside the last closed <answer>...</answer> (paper
    §2.1 prompt).
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_answer: text must be a str, got {type(text).__name__}")
    prose = _model_prose(text)
    lo, hi = 0, len(prose)
    # The rollout ends with the turn that makes no tool call (§2.1): the final answer is the last.
    if require_answer_tag:
        hi = prose.rfind("</answer>")
        lo = prose.rfind("<answer>", 0, max(hi, 0))
        if hi < 0 or lo < 0:
            return None
        lo += len("<answer>")

    # rfind: a megabyte of "\\boxed{}" spam is one backwards scan, not a parse of each box.
    at, name = max((prose.rfind(cmd, lo, hi), cmd) for cmd in ("\\boxed", "\\fbox"))
    if at < 0:
        return None
    content = _box_content(prose[:hi], at + len(name))
    if content is None or not content.strip():
        return None
    return content.strip()


# -----------------------------------------------------------------------------
# Fast path: normalise the notation, then compare strings or exact numbers

_DELIMITERS = [("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")]
_UNIT_AT_END = re.compile(
    r"\\(?:text|textrm|textbf|mbox|mathrm)\s*\{[^{}]*\}\s*(?:\^\s*\{?\d\}?)?\s*$")
_WHOLE_TEXT = re.compile(r"\\(?:text|textrm|textbf|mbox|mathrm)\s*\{([^{}]*)\}")
# A thousands separator is a bare comma, or MATH's "10,\\!080" / "1{,}000", before exactly three
# digits, decimals allowed ("1,000.99"). A comma followed by a space is a list: math-verify reads
# "32, 349" as {32, 349}, and "1234,567" as {567, 1234}.
_GLUED_SEPARATOR = re.compile(r"(?<=\d)(?:,\\!|\{,\})(?=\d{3}(?!\d))")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_INTEGER = re.compile(r"-?\d+(?:\.0*)?")


@functools.lru_cache(maxsize=1 << 16)  # a gold is normalised once per rollout of its group
def normalize_answer(answer):
    """A canonical spelling of an answer; two spellings of one answer should map to the same string.

    Only notation is touched (the conventions MATH and AIME graders accept); anything mathematical
    is left to math-verify. Used only to decide equality, never shown to math-verify.
    """
    s = answer.strip()
    # Models box math-mode text as often as not: "\\boxed{$\\frac{1}{2}$}".
    for left, right in _DELIMITERS:
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left):len(s) - len(right)].strip()
            break

    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)  # bracket sizing only; not \rightarrow
    s = _GLUED_SEPARATOR.sub(",", s)  # before TeX spacing turns "10,\\!080" into the list "10, 080"
    s = re.sub(r"\\[,;:! ]|\\q?quad(?![a-zA-Z])|~", " ", s)  # TeX spacing, as in "10,\!080"
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\degree(?![a-zA-Z])", "", s)  # 90^\circ = 90

    # MATH golds write "10\\%" and "\\$32" for the numbers 10 and 32 (math-verify also reads "10\\%"
    # as 0.1).
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    # A trailing \text{...} after a number is a unit ("5.4 \text{ cents}", "864 \mbox{ inches}^2");
    # an answer that is only text is unwrapped ("\text{Evelyn}", "\text{(C)}").
    while True:
        without_unit = _UNIT_AT_END.sub("", s)
        if without_unit == s or not re.search(r"\d", without_unit):
            break
        s = without_unit
    if _WHOLE_TEXT.fullmatch(s.strip()):
        s = _WHOLE_TEXT.fullmatch(s.strip()).group(1)

    # Whitespace carries no meaning in TeX math, except that "1 2" must not become "12", and that a
    # space after a comma makes a list ("32, 349"): that one is kept until the thousands check
    # below.
    s = re.sub(r"(?<=[\d,])\s+(?=\d)", " ", s)
    s = re.sub(r"(?<![\d,])\s+|\s+(?![\d])", "", s).strip()
    s = s.rstrip(".")  # a sentence's full stop inside the box: "\\boxed{5.}"

    # "x=5", "x \\approx 11", "\\approx 2.5": MATH accepts the bare value, and math-verify compares
    # the right-hand side of an assignment or an approximation.
    assignment = re.fullmatch(r"(?:[a-zA-Z]=|[a-zA-Z]?\\approx(?![a-zA-Z]))([^=<>]+)", s)
    if assignment:
        s = assignment.group(1).strip()
    choice = re.fullmatch(r"\(([A-Z])\)", s)  # multiple choice "(C)" = "C"
    if choice:
        s = choice.group(1)

    # Only groups of exactly three digits: "1,000" and "1,000.99" are numbers, "1,2" and "3,5,7" are
    # lists.
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r",\s+", ",", s)  # the list "[1, 2)" is spelled as "[1,2)"
    if _INTEGER.fullmatch(s):  # "025" = "25", "27.0" = "27", "-0" = "0"
        s = str(int(s.split(".")[0]))
    return s


_FRACTIONS = [
    re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}"),
    re.compile(r"(-?)\\frac(\d)(\d)"),  # \frac43, \frac 59
    re.compile(r"(-?)\\frac\{(-?\d+)\}(\d)"),  # \frac{270}7
    re.compile(r"(-?)\\frac(\d)\{(-?\d+)\}"),
    re.compile(r"(-?)(-?\d+)/(-?\d+)"),
]


def _as_number(s):
    """(value, exact) for a normalised integer, decimal or integer fraction, else None. exact is
    False for decimals, which math-verify rounds (far_apart)."""
    if re.fullmatch(r"-?\d+", s):
        return Fraction(int(s)), True
    if re.fullmatch(r"-?\d*\.\d+", s):
        return Fraction(s), False
    for pattern in _FRACTIONS:
        m = pattern.fullmatch(s)
        if m and int(m.group(3)) != 0:  # "\\frac{1}{0}" is left to math-verify (which says zoo)
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return (-value if m.group(1) else value), True
    return None


# _math_verify_value of each answer the workers evaluated. Golds recur every epoch, and wrong
# answers recur across rollouts, so each is parsed once per process.
_VALUES = {}


def _plain_number(answer):
    """_as_number of the normalised answer ("\\$16,\\!386.20", "x \\approx 11", "5 \\text{ cm}");
    None for a percent, which math-verify reads both ways ("50\\%" is 50 and 0.5)."""
    if "%" in answer:
        return None
    return _as_number(normalize_answer(answer))


def _value(answer):
    """[re, im] of an answer known to be one number (a plain number, or one the workers evaluated),
    else None."""
    number = _plain_number(answer)
    if number:
        try:
            return [float(number[0]), 0.0]
        except OverflowError:
            return None
    value = _VALUES.get(answer)
    return value if isinstance(value, list) else None


def _differ_by_value(pred, gold):
    """True if what math-verify's parser found proves the answers differ: two numbers far apart
    ("3\\sqrt{13}" vs "10"), or one number against a COLLECTION ("10" vs "(6,31,-1)"). Used by the
    slow path once the workers have evaluated each answer: nothing here guesses from the
    spelling."""
    p_value, g_value = _value(pred), _value(gold)
    if p_value and g_value:
        return far_apart(complex(*p_value), complex(*g_value))
    return bool((p_value and _VALUES.get(gold) == COLLECTION)
                or (g_value and _VALUES.get(pred) == COLLECTION))


def fast_equivalent(pred, gold):
    """True: one answer in two notations (an equal normalised spelling or an equal number). False:
    two plain numbers (_plain_number) that differ exactly (two rationals) or by more than
    math-verify rounds. None (math-verify must look) for every other pair ("10" vs "(6,31,-1)", "32,
    349" vs "32349"), so a shape this file does not know costs a math-verify call, never a wrong 0.
    Audited against math-verify on all pairs of MATH-500 answers and NOTATION_SHAPES: `python -m
    bench.reward audit_all_pairs=true`.
    """
    p, g = normalize_answer(pred), normalize_answer(gold)
    if p and p == g:
        return True
    p_num, g_num = _plain_number(pred), _plain_number(gold)
    if p_num is None or g_num is None:
        return None  # the only "not equal" below is between two plain numbers
    if p_num[0] == g_num[0]:
        return True
    exact = p_num[1] and g_num[1]
    return False if exact or far_apart(p_num[0], g_num[0]) else None


# -----------------------------------------------------------------------------
# The slow path: math-verify in the worker pool, a CPU-time budget per check


def _slow_path(pairs, timeout_s):
    """(verdicts, unfinished) for the (pred, gold) pairs the fast path left open. 1. Each distinct
    answer not known yet is evaluated once (math-verify's parse, then sympy's evalf), with half of
    timeout_s: parsing is most of what a verify costs. 2. Pairs whose values differ
    (_differ_by_value) are False. 3. The rest get math-verify's verify with what step 1 left of
    timeout_s: no pair gets more than timeout_s of worker CPU time in all. Nothing is True without
    verify."""
    # Worth evaluating: every answer not known yet, except "%" answers, which have two readings.
    unknown = sorted({s for pair in pairs for s in pair
                      if s not in _VALUES and _value(s) is None and "%" not in s})
    values, seconds, cut = run_in_pool([("value", s) for s in unknown],
                                       [timeout_s / 2] * len(unknown))
    spent = dict(zip(unknown, seconds))
    cut = {s for s, c in zip(unknown, cut) if c}
    if len(_VALUES) > 100_000:
        _VALUES.clear()
    _VALUES.update((s, v) for s, v, t in zip(unknown, values, seconds) if t != float("inf"))
    unfinished = {(pred, gold) for pred, gold in pairs if pred in cut or gold in cut}

    verdicts = {}
    to_verify, budgets = [], []  # the pairs still open, and the worker CPU each has left
    for pred, gold in pairs:
        budget = timeout_s - spent.get(pred, 0.0) - spent.get(gold, 0.0)
        if budget < 0.1 or _differ_by_value(pred, gold):
            verdicts[pred, gold] = False  # out of time, or proven different
        else:
            to_verify.append((pred, gold))
            budgets.append(budget)

    results, _, cut = run_in_pool([("verify", *pair) for pair in to_verify], budgets)
    verdicts.update(zip(to_verify, map(bool, results)))
    unfinished.update(pair for pair, c in zip(to_verify, cut) if c)
    return [verdicts[pair] for pair in pairs], [pair in unfinished for pair in pairs]
