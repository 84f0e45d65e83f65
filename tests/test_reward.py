"""reward.py: what the reward accepts, what it rejects, and that no input can hang or crash it;
real math-verify in real worker processes, on the real data files."""
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from math_verify import parse, verify

import machinery.sandbox
import reward
from bench.reward import NOTATION_SHAPES, audit_fast_path, math500_labeled_set
from machinery.verifier import shutdown_pool, start_pool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -----------------------------------------------------------------------------
# extract_answer: the last box of the model's own text


@pytest.mark.parametrize("text, answer", [
    ("so the answer is $\\boxed{42}$.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are not grouping
    ("first \\boxed{1}, then finally \\boxed{2}", "2"),  # the last box wins
    ("\\fbox{7}", "7"),
    ("hence $\\boxed 5$.", "5"),  # TeX's one-token argument, used in MATH solutions
    ("\\boxed{ \\text{(C)} }", "\\text{(C)}"),
    ("\\boxed{" + "{" * 300 + "5" + "}" * 300 + "}", "{" * 300 + "5" + "}" * 300),
])
def test_extract_answer_takes_the_last_box(text, answer):
    assert reward.extract_answer(text) == answer


@pytest.mark.parametrize("text", [
    "no box at all: 42",
    "\\boxed{}",
    "\\boxed{   }",
    "\\boxed{3} but then \\boxed{}",  # the final answer is empty; an earlier box does not count
    "\\boxed{3} but then \\boxed{4",  # the final box never closes
    "\\boxed",
    "\\boxedx",
    "\\boxed{" + "1" * (reward.MAX_ANSWER_CHARS + 1) + "}",  # longer than any answer
])
def test_extract_answer_is_none_without_a_usable_final_box(text):
    assert reward.extract_answer(text) is None


def test_boxes_in_tool_calls_and_tool_outputs_are_not_the_models_answer():
    tool_turn = ('<tool_call>\n{"name": "python_code_with_standard_io", "arguments": '
                 '{"code": "print(\\"\\\\\\\\boxed{7}\\")", "input": ""}}\n</tool_call>\n'
                 'user\n<tool_response>\nTool call success\nstdout: \\boxed{7}\n</tool_response>\n')
    assert reward.extract_answer("<reason>try</reason>" + tool_turn) is None
    assert reward.extract_answer("<reason>so</reason><answer>\\boxed{3}</answer>"
                                 + tool_turn) == "3"
    assert reward.extract_answer(tool_turn
                                 + "<reason>so</reason><answer>\\boxed{5}</answer>") == "5"
    # An unclosed block (a truncated tool output) runs to the end of the text.
    assert reward.extract_answer("\\boxed{1} <tool_response>stdout: \\boxed{9}") == "1"


def test_require_answer_tag_only_reads_the_last_answer_block():
    text = "<reason>maybe \\boxed{1}</reason><answer>\\boxed{2}</answer>"
    assert reward.extract_answer(text, require_answer_tag=True) == "2"
    assert reward.extract_answer("<reason>\\boxed{2}</reason>", require_answer_tag=True) is None
    assert reward.extract_answer("<reason>\\boxed{2}</reason>") == "2"
    # never closed
    assert reward.extract_answer("<answer>\\boxed{2}", require_answer_tag=True) is None
    assert reward.extract_answer("<answer>\\boxed{2}</answer> then \\boxed{3}",
                                 require_answer_tag=True) == "2"
    fake = "<tool_response><answer>\\boxed{9}</answer></tool_response>"
    assert reward.extract_answer(fake, require_answer_tag=True) is None


# -----------------------------------------------------------------------------
# is_equivalent: hand-written cases, with the path that decides them

FAST_PATH_EQUAL = [  # notation only: decided in microseconds, math-verify never runs
    ("1,080", "1080"), ("10,\\!080", "10080"), ("025", "25"), ("27.0", "27"), ("-0", "0"),
    ("\\dfrac{3}{4}", "\\frac34"), ("\\tfrac{1}{2}", "0.5"), ("1/2", "\\frac{1}{2}"),
    ("0.5", "\\frac 12"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("90", "90^\\circ"), ("90^{\\circ}", "90"), ("10", "10\\%"), ("\\$32,\\!348", "32348"),
    ("5.4", "5.4 \\text{ cents}"), ("864", "864 \\mbox{ inches}^2"),
    ("x=5", "5"), ("5", "x = 5"), ("y=2x+3", "2x+3"), ("C", "\\text{(C)}"), ("(C)", "C"),
    ("\\textbf{(C)}", "C"),
    ("Evelyn", "\\text{Evelyn}"), ("$\\frac{14}{3}$", "\\frac{14}{3}"),
    ("2 \\sqrt{5}", "2\\sqrt{5}"),
    ("[1, 2)", "[1,2)"), ("(-\\infty, 0]", "(-\\infty,0]"),
    ("-2+7 i", "-2 + 7i"),  # plain math-verify says False: it reads only the spaced i as imaginary
]
MATH_VERIFY_EQUAL = [  # mathematics: the fast path leaves these to math-verify
    ("\\frac{\\sqrt 2}{2}", "\\sqrt{2}/2"), ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("2\\sqrt{2}", "\\sqrt{8}"), ("(x+1)^2", "x^2+2x+1"), ("0.333333", "\\frac{1}{3}"),
    ("\\{2, 1\\}", "\\{1, 2\\}"), ("-2, 1", "1,-2"), ("7, 5, 3", "3, 5, 7"),
    ("[0.5, 2)", "[\\frac{1}{2}, 2)"), ("(-\\infty, \\sqrt{4}]", "(-\\infty,2]"),
    ("1\\frac{4}{5}", "\\frac{9}{5}"),
    ("\\begin{pmatrix} 1/2 \\\\ 2 \\end{pmatrix}",
     "\\begin{pmatrix} \\frac12 \\\\ 2 \\end{pmatrix}"),
    ("0.1", "10\\%"), ("\\frac{1}{2}", "50\\%"),
]
NOT_EQUAL = [  # near misses that must fail
    ("0.51", "\\frac{1}{2}"), ("0.33", "\\frac{1}{3}"), ("1081", "1,080"), ("12", "1,2"),
    ("-5", "5"),
    ("\\frac{3}{2}", "\\frac{2}{3}"), ("\\frac{\\sqrt 3}{2}", "\\frac{\\sqrt 2}{2}"),
    ("2\\sqrt{3}", "\\sqrt{8}"),
    ("3.14159", "\\pi"), ("\\pi", "3"), ("(1,2)", "[1,2]"), ("(1,2]", "(1,2)"), ("(2,1)", "(1,2)"),
    ("x^2+2x", "(x+1)^2"), ("x=4", "3"), ("y=5", "x=6"), ("B", "\\text{(C)}"), ("C", "3"),
    ("\\begin{pmatrix} 1 \\\\ 3 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("(6,31,-1)", "10"), ("x^3+3x-6", "11"), ("3\\sqrt{13}", "10"), ("1,2,3", "1,2"), ("10", "100"),
    ("1 2", "12"), ("\\frac{1}{0}", "0"),
]


@pytest.mark.parametrize("pred, gold", FAST_PATH_EQUAL)
def test_fast_path_accepts_notation_variants(pred, gold):
    assert reward.fast_equivalent(pred, gold) is True
    assert reward.is_equivalent(pred, gold) is True


@pytest.mark.parametrize("pred, gold", MATH_VERIFY_EQUAL)
def test_math_verify_accepts_equal_mathematics(pred, gold):
    assert reward.fast_equivalent(pred, gold) is None  # not notation: the fast path does not guess
    assert reward.is_equivalent(pred, gold) is True


@pytest.mark.parametrize("pred, gold", NOT_EQUAL)
def test_near_misses_are_rejected(pred, gold):
    assert reward.is_equivalent(pred, gold) is False


# Shapes from third-party grader test suites, as (gold, pred, what plain math-verify 0.9.0 says):
# the project must agree on every one.
MATH_VERIFY_SHAPES = [
    # thousands separators: a bare comma, MATH's ",\!" or "{,}", before exactly three digits,
    # decimals allowed
    ("1000.0", "1,000.0", True), ("1,000.0", "1000.0", True), ("1000.99", "1,000.99", True),
    ("1,000.99", "1000.99", True), ("1234.5", "1,234.5", True), ("12345.678", "12,345.678", True),
    ("1234567.89", "1,234,567.89", True), ("1000000", "1,000,000", True), ("-1234", "-1,234", True),
    ("1000", "1{,}000", True), ("1000.5", "1{,}000.5", True), ("10080", "10,\\!080", True),
    ("1000", "1\\,000", False), ("1234567", "1234,567", False), ("1000", "1,0000", False),
    ("100000", "1,000,00", False), ("1000.9", "1,000.99", False), ("1,000.9", "1000.99", False),
    # a comma followed by a space (or a TeX space) separates the elements of a list
    ("32349", "32, 349", False), ("32, 349", "32349", False), ("1000", "1, 000", False),
    ("10080", "10, 080", False), ("10080", "10,\\ 080", False), ("1,234,567", "1, 234, 567", False),
    ("123", "1, 2, 3", False), ("35", "3, 5", False), ("3,5", "3, 5", True),
    ("1,2,3", "1, 2, 3", True),
    # one number against a list: a set of one element is that number, a tuple of two is not
    ("5", "5, 5", True), ("5", "[5, 5]", True), ("\\frac{1}{2}", "[\\frac12, 0.5]", True),
    ("5", "(5, 5)", False),
    ("10", "(6,31,-1)", False), ("-\\sqrt{3}", "\\{1, 2\\}", False), ("2", "[2, 7)", False),
    ("2", "\\{2, \\sqrt{4}\\}", True), ("\\frac{1}{2}", "\\{\\frac12, 0.5\\}", True),
    # approximations: the value on the right of \approx
    ("11", "x\\approx11", True), ("x\\approx11", "11", True), ("x\\approx 11.5", "11.5", True),
    ("12", "x \\approx 12.0", True), ("0.5", "\\approx 0.50", True), ("\\approx 11", "11", True),
    ("11", "x \\approx 12", False),
    # money, MATH style
    ("16386.20", "\\$16,\\!386.20", True), ("\\$16,\\!386.20", "16386.20", True),
    ("16386.20", "\\$16,386.20", True),
    ("16386.2", "16,386.2 \\text{ dollars}", True), ("5", "\\$5.00", True), ("\\$5", "5", True),
    ("1000", "\\$1,000", True), ("16386", "\\$16,\\!386.20", False), ("\\$5", "6", False),
    # percent: math-verify reads "25\\%" as 25 and as 0.25
    ("10\\%", "10", True), ("10\\%", "0.1", True), ("25\\%", "\\frac{1}{4}", True),
    ("25\\%", "0.25", True),
    ("50", "50\\%", True), ("25\\%", "26", False), ("25\\%", "0.26", False),
    # degrees: the number of degrees, not radians
    ("90^\\circ", "90", True), ("90", "90^{\\circ}", True), ("91", "90^\\circ", False),
    ("\\frac{\\pi}{2}", "90^\\circ", False), ("\\pi", "180^\\circ", False),
    # units: dropped after a number
    ("5 \\text{ cm}", "5", True), ("3 \\text{ m}^2", "3", True),
    ("1000", "1,000 \\text{ cm}", True),
    ("3 \\text{ m}^2", "4", False), ("12 \\text{ inches}", "1 \\text{ foot}", False),
]


@pytest.mark.parametrize("gold, pred, expected", MATH_VERIFY_SHAPES)
def test_project_agrees_with_plain_math_verify(gold, pred, expected):
    # Plain math-verify on the two answers, boxed so that its parser extracts exactly that answer.
    assert verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}")) is expected
    assert reward.is_equivalent(pred, gold) is expected
    assert reward_of(f"<answer>so \\boxed{{{pred}}}</answer>", gold) == float(expected)


def test_fast_path_says_not_equal_only_for_two_plain_numbers():
    # what keeps the fast path from missing a shape it does not know: any other pair is deferred
    answers = sorted({a for gold, pred, _ in MATH_VERIFY_SHAPES for a in (gold, pred)}
                     | set(NOTATION_SHAPES)
                     | {a for pair in FAST_PATH_EQUAL + MATH_VERIFY_EQUAL + NOT_EQUAL
                        for a in pair})
    rejected = [(p, g) for p in answers for g in answers if reward.fast_equivalent(p, g) is False]
    assert len(rejected) > 1000
    assert [(p, g) for p, g in rejected if reward._plain_number(p) is None
            or reward._plain_number(g) is None] == []


def test_audit_finds_no_disagreement_with_math_verify_on_notation_shapes():
    """What skips verify agrees with verify (all pairs of MATH-500's answers too: `python -m
    bench.reward audit_all_pairs=true`)."""
    decided, wrong = audit_fast_path(NOTATION_SHAPES)
    assert decided > 1000
    assert wrong == []


# Several boxes: only the last one counts here; math-verify 0.9.0 joins every box of the text into
# one set (docs/design.md, "Reward": a list answer goes in one box).
@pytest.mark.parametrize("response, gold, ours, math_verify", [
    ("The answer is \\boxed{3} and \\boxed{5}", "5", 1.0, False),
    ("The answer is \\boxed{3} and \\boxed{5}", "3", 0.0, False),
    ("The answers are \\boxed{1}, \\boxed{2}", "1,2", 0.0, True),
    ("The answers are \\boxed{1}, \\boxed{2}", "2", 1.0, False),
    ("The answers are \\boxed{1, 2}", "1,2", 1.0, True),
])
def test_an_answer_in_several_boxes_is_its_last_box(response, gold, ours, math_verify):
    assert reward_of(response, gold) == ours
    assert verify(parse("\\boxed{" + gold + "}"), parse(response)) is math_verify


@pytest.mark.parametrize("pred", [None, "", "   ", "\\boxed{}",
                                  "x" * (reward.MAX_ANSWER_CHARS + 1)])
def test_empty_missing_or_overlong_answers_are_never_equal(pred):
    assert reward.is_equivalent(pred, "3") is False


@pytest.mark.parametrize("gold, problem", [(g, "empty") for g in ["", "   ", "\\boxed{}"]] + [
    (g, "malformed") for g in ["\\boxed{3", "\\frac{1}{2", "3}", "\\boxed{\\frac{1}{2}"]])
def test_an_empty_or_unbalanced_gold_is_a_data_error(gold, problem):
    with pytest.raises(ValueError, match=f"gold answer is {problem}"):
        reward.is_equivalent("3", gold)
    with pytest.raises(ValueError, match=rf"golds\[0\].*{problem}"):
        reward.grade_batch(["\\boxed{3}"], [gold])[0]


# -----------------------------------------------------------------------------
# grade_batch: the reward rl.py and eval.py use


def reward_of(response, gold, finished=True, require_answer_tag=False):
    """One decoded response's reward, through grade_batch (reward.py's one entry point)."""
    return reward.grade_batch([response], [gold], [finished], require_answer_tag)[0][0]


def test_the_reward_is_binary_and_zero_for_truncated_rollouts():
    response = "<reason>2+2</reason><answer>\\boxed{4}</answer>"
    assert (reward_of(response, "4"), reward_of(response, "5")) == (1.0, 0.0)
    assert reward_of(response, "4", finished=False) == 0.0  # paper §4.3.1
    assert reward_of("\\boxed{4}", "4", require_answer_tag=True) == 0.0


def test_grade_batch_keeps_order_and_takes_one_or_many_finished_flags():
    responses = ["\\boxed{1}", "\\boxed{\\frac{\\sqrt 2}{2}}", "\\boxed{3}", "no box",
                 "\\boxed{x=5}"]
    golds = ["1", "\\sqrt{2}/2", "4", "1", "5"]
    assert reward.grade_batch(responses, golds)[0] == [1.0, 1.0, 0.0, 0.0, 1.0]
    rewards, _ = reward.grade_batch(responses, golds, finished=[True, False, True, True, True])
    assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert reward.grade_batch(responses, golds, finished=False)[0] == [0.0] * 5
    assert reward.grade_batch([], [])[0] == []


def test_grade_batch_verifies_each_distinct_pair_once():
    # A group's 2G rollouts often give the same answer; math-verify should see it once.
    pool = start_pool()
    before = pool.tasks_run["verify"]
    rewards = reward.grade_batch(["so \\boxed{(x+1)^2}"] * 32, ["x^2+2x+1"] * 32)[0]
    assert rewards == [1.0] * 32
    assert pool.tasks_run["verify"] - before == 1


def test_grade_batch_is_safe_to_call_from_several_threads():
    # eval.py or rl.py may grade from a thread pool; batches then take turns on the shared workers
    responses, golds, expected = zip(("\\boxed{\\frac{\\sqrt 2}{2}}", "\\sqrt{2}/2", 1.0),
                                     ("\\boxed{2\\sqrt{3}}", "\\sqrt{8}", 0.0),
                                     ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
                                     ("\\boxed{x^2+1}", "(x+1)^2", 0.0))
    with ThreadPoolExecutor(4) as threads:
        results = list(threads.map(lambda _: reward.grade_batch(responses, golds)[0], range(4)))
    assert results == [list(expected)] * 4


@pytest.mark.parametrize("call, error, message", [
    (lambda: reward.grade_batch(["a", "b"], ["1"]), ValueError, "2 responses but 1 golds"),
    (lambda: reward.grade_batch(["a"], ["1"], finished=[True, True]), ValueError,
     "1 responses but 2 finished flags"),
    (lambda: reward.grade_batch([None], ["1"]), TypeError, r"responses\[0\] must be a str"),
    (lambda: reward.grade_batch(["a"], [3]), TypeError, "gold must be a str"),
    (lambda: reward.grade_batch(["a"], ["1"], finished=["yes"]), TypeError,
     r"finished\[0\] must be a bool"),
    (lambda: reward.is_equivalent(3, "3"), TypeError, "pred must be a str or None"),
    (lambda: reward.extract_answer(42), TypeError, "must be a str"),
])
def test_bad_input_gets_an_error_that_names_it(call, error, message):
    with pytest.raises(error, match=message):
        call()


# -----------------------------------------------------------------------------
# Correctness on the data


def test_every_gold_answer_in_the_data_boxed_is_equivalent_to_itself():
    golds = sorted({json.loads(line)["answer"]
                    for path in glob.glob(os.path.join(REPO, "data/*.jsonl"))
                    for line in open(path, encoding="utf-8") if line.strip()})
    assert len(golds) > 4000
    responses = [f"<reason>...</reason><answer>\\boxed{{{gold}}}</answer>" for gold in golds]
    rewards = reward.grade_batch(responses, golds, require_answer_tag=True)[0]
    assert [g for g, r in zip(golds, rewards) if r != 1.0] == []


# Misses of grade_batch on the MATH-500 labeled set, with the reason: none (plain math-verify has
# none either, `python -m bench.reward`).
LABELED_SET_MISSES = {}


def test_math500_labeled_set_is_scored_exactly():
    triples = math500_labeled_set(os.path.join(REPO, "data/math500.jsonl"), negatives_per_problem=2)
    responses, golds, labels = zip(*triples)
    assert len(triples) == 1500 and sum(labels) == 510
    rewards = reward.grade_batch(responses, golds)[0]
    misses = {(reward.extract_answer(r), g): label
              for r, g, label, got in zip(responses, golds, labels, rewards)
              if bool(got) != label}
    assert misses == LABELED_SET_MISSES


# -----------------------------------------------------------------------------
# No input hangs or crashes the caller

HOSTILE = {
    "power tower": "\\boxed{9^{9^{9^{9}}}}",
    "huge factorial": "\\boxed{(10^{10})!}",
    "huge power": "\\boxed{123456789^{123456789}}",
    "deep fractions": "\\boxed{" + "\\frac{1}{" * 60 + "2" + "}" * 60 + "}",
    "deep roots": "\\boxed{" + "\\sqrt{" * 100 + "2" + "}" * 100 + "}",
    "10k nested braces": "\\boxed{" + "{" * 10_000 + "5" + "}" * 10_000 + "}",
    "a megabyte of text": "x" * 1_000_000 + " \\boxed{\\sqrt{3}}",
    "a megabyte box": "\\boxed{" + "1+" * 500_000 + "1}",
    "boxed spam": "\\boxed{}" * 100_000,
    "unclosed tags": "<tool_response>" * 50_000 + "\\boxed{2}",
    "binary junk": "\\boxed{\x00\udcff\\\\}}}{{{",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input_scores_zero_within_the_time_limit(name):
    # bounded by the workers' CPU time, whatever the load (a big-int power stuck in C code dies of
    # RLIMIT_CPU); out of time is a verdict (0), not "unfinished"
    timeout_s = 3.0
    pool = start_pool()
    reward.is_equivalent("\\sqrt{8}", "2\\sqrt{2}")  # the workers' start is not the check's time
    cpu_before, started = pool.worker_cpu_s, time.monotonic()
    rewards, unfinished = reward.grade_batch([HOSTILE[name]], ["\\sqrt{2}"], timeout_s=timeout_s)
    elapsed = time.monotonic() - started
    assert rewards == [0.0] and unfinished == [False]
    cpu = pool.worker_cpu_s - cpu_before
    assert cpu < timeout_s + 0.5, f"{name} took {cpu:.1f} s of CPU"
    assert elapsed < machinery.sandbox.STRETCH_CAP * timeout_s, f"{name}: {elapsed:.1f} s"


# Correct answers that cost math-verify up to a few tenths of a second of CPU in a fresh worker.
# With a wall-clock deadline, each of these kinds came back False on a 2-core machine at load 15-21.
EXPENSIVE_CORRECT = [
    ("\\begin{pmatrix} \\frac{1}{2} & -\\frac{3}{4} \\\\ \\frac{5}{6} & \\frac{7}{8} "
     "\\end{pmatrix}",
     "\\begin{pmatrix} \\frac{2}{4} & -0.75 \\\\ \\frac{10}{12} & \\frac{14}{16} \\end{pmatrix}"),
    ("\\begin{pmatrix} \\frac{1}{3} & \\frac{2}{5} & -\\frac{1}{7} \\\\ \\frac{4}{9} & 0 & "
     "\\frac{3}{11} \\\\ -\\frac{5}{13} & \\frac{6}{17} & 1 \\end{pmatrix}",
     "\\begin{pmatrix} \\frac{2}{6} & \\frac{4}{10} & -\\frac{2}{14} \\\\ \\frac{8}{18} & 0 & "
     "\\frac{6}{22} \\\\ -\\frac{10}{26} & \\frac{12}{34} & \\frac{3}{3} \\end{pmatrix}"),
    ("F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}", "F_n = \\sum_{k=0}^{n-1} F_{n-k-1} F_k"),
    ("\\frac{1}{1+\\frac{1}{1+\\frac{1}{1+\\frac{1}{2}}}}", "\\frac{5}{8}"),
    ("\\frac{1}{\\frac{1}{x}+\\frac{1}{y}}", "\\frac{xy}{x+y}"),
    ("\\frac{\\frac{\\sqrt{3}}{2}}{1+\\frac{1}{2}}", "\\frac{\\sqrt{3}}{3}"),
]


def grade_with_a_fresh_worker(responses, golds, timeout_s, busy=None):
    """grade_batch on a new idle-started worker, graded while `busy` holds: (rewards, unfinished,
    the worker's CPU seconds)."""
    shutdown_pool()
    reward._VALUES.clear()
    pool = start_pool(1)   # ready when it returns
    cpu_before = pool.worker_cpu_s
    with busy or contextlib.nullcontext():
        rewards, unfinished = reward.grade_batch(responses, golds, timeout_s=timeout_s)
    return rewards, unfinished, pool.worker_cpu_s - cpu_before


def test_a_verdict_does_not_depend_on_the_load(busy_machine):
    # the budget is CPU time: beside eight busy processes on 2 cores every answer keeps its verdict
    responses = [f"\\boxed{{{pred}}}" for pred, _ in EXPENSIVE_CORRECT]
    golds = [gold for _, gold in EXPENSIVE_CORRECT]
    timeout_s = 3.0  # the F_n sum takes 0.5-1.2 s of CPU idle, by the core it runs on
    idle = grade_with_a_fresh_worker(responses, golds, timeout_s)
    busy = grade_with_a_fresh_worker(responses, golds, timeout_s, busy=busy_machine(8))
    for rewards, unfinished, cpu in (idle, busy):
        assert rewards == [1.0] * len(responses) and unfinished == [False] * len(responses)
        assert cpu < timeout_s  # all of them together, less than one pair's budget


def test_a_stopped_worker_is_reaped_by_the_backstop_and_its_check_reported_unfinished(monkeypatch):
    # a stopped worker uses no CPU: only the wall-clock backstop ends its check, with no verdict
    monkeypatch.setattr(machinery.sandbox, "STRETCH_CAP", 2)  # 2 x (0.5 + 1.25) + 0.5 s
    monkeypatch.setattr(machinery.sandbox, "BACKSTOP_GRACE_S", 0.5)
    pool = start_pool()
    # the pool is up, and both answers' values are known: only the verify runs below
    assert reward.is_equivalent("(x+1)^2", "x^2+2x+1") is True
    kills = pool.kills
    stopped = [w.proc.pid for w in pool.workers]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        # true, but never graded
        rewards, unfinished = reward.grade_batch(["\\boxed{(x+1)^2}", "\\boxed{7}"],
                                                 ["x^2+2x+1", "7"], timeout_s=0.5)
        assert rewards == [0.0, 1.0] and unfinished == [True, False]
        assert 1.4 < time.monotonic() - started < 6.0
        assert pool.kills == kills + 1
    finally:
        for pid in stopped:
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGCONT)
    assert reward.is_equivalent("(x+1)^2", "x^2+2x+1") is True  # the others, or the fresh worker


def test_an_idle_worker_killed_from_outside_costs_no_check():
    """A worker dead while idle is replaced before it gets a check: the true verdict."""
    pool = start_pool()
    reward.is_equivalent("\\sqrt{8}", "2\\sqrt{2}")  # the pool is up, every worker idle
    for worker in pool.workers:
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait()
    assert reward.is_equivalent("(x+1)^2", "x^2+2x+1") is True


def test_workers_that_cannot_start_raise_a_clear_error(monkeypatch):
    shutdown_pool()
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="failed to start"):
        reward.is_equivalent("\\sqrt{8}", "2\\sqrt{2}")
    monkeypatch.undo()
    shutdown_pool()
    assert reward.is_equivalent("\\sqrt{8}", "2\\sqrt{2}") is True


def test_shutdown_leaves_no_worker_behind():
    pool = start_pool()
    pids = [w.proc.pid for w in pool.workers]
    shutdown_pool()
    for pid in pids:
        assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0


def test_workers_die_with_their_parent():
    # a trainer killed with SIGKILL runs no cleanup: its workers see EOF on their pipe
    code = ("import reward, sys; from machinery.verifier import start_pool; pool = start_pool(1); "
            "reward.is_equivalent('\\\\sqrt{8}', '2\\\\sqrt{2}');"
            "print(pool.workers[0].proc.pid, flush=True); import time; time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    worker_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{worker_pid}") and \
            "Z" not in open(f"/proc/{worker_pid}/stat").read().split()[2]:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{worker_pid}") or \
        "Z" in open(f"/proc/{worker_pid}/stat").read().split()[2]
