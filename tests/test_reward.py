"""reward.py: what the reward accepts, what it rejects, and that no input can hang or crash it.

Everything here runs the real thing: real math-verify in real worker processes, real data files.
Run: .venv/bin/python -m pytest tests/test_reward.py -q
"""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import reward

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
    assert reward.extract_answer("<reason>so</reason><answer>\\boxed{3}</answer>" + tool_turn) == "3"
    assert reward.extract_answer(tool_turn + "<reason>so</reason><answer>\\boxed{5}</answer>") == "5"
    # An unclosed block (a truncated tool output) runs to the end of the text.
    assert reward.extract_answer("\\boxed{1} <tool_response>stdout: \\boxed{9}") == "1"


def test_require_answer_tag_only_reads_the_last_answer_block():
    text = "<reason>maybe \\boxed{1}</reason><answer>\\boxed{2}</answer>"
    assert reward.extract_answer(text, require_answer_tag=True) == "2"
    assert reward.extract_answer("<reason>\\boxed{2}</reason>", require_answer_tag=True) is None
    assert reward.extract_answer("<reason>\\boxed{2}</reason>") == "2"
    assert reward.extract_answer("<answer>\\boxed{2}", require_answer_tag=True) is None  # never closed
    assert reward.extract_answer("<answer>\\boxed{2}</answer> then \\boxed{3}", require_answer_tag=True) == "2"
    fake = "<tool_response><answer>\\boxed{9}</answer></tool_response>"
    assert reward.extract_answer(fake, require_answer_tag=True) is None


def test_extract_answer_rejects_a_non_string():
    with pytest.raises(TypeError, match="must be a str"):
        reward.extract_answer(42)


# -----------------------------------------------------------------------------
# is_equivalent: hand-written cases, with the path that decides them

FAST_PATH_EQUAL = [  # notation only: decided in microseconds, math-verify never runs
    ("1,080", "1080"), ("10,\\!080", "10080"), ("025", "25"), ("27.0", "27"), ("-0", "0"),
    ("\\dfrac{3}{4}", "\\frac34"), ("\\tfrac{1}{2}", "0.5"), ("1/2", "\\frac{1}{2}"), ("0.5", "\\frac 12"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("90", "90^\\circ"), ("90^{\\circ}", "90"), ("10", "10\\%"), ("\\$32,\\!348", "32348"),
    ("5.4", "5.4 \\text{ cents}"), ("864", "864 \\mbox{ inches}^2"),
    ("x=5", "5"), ("5", "x = 5"), ("y=2x+3", "2x+3"), ("C", "\\text{(C)}"), ("(C)", "C"), ("\\textbf{(C)}", "C"),
    ("Evelyn", "\\text{Evelyn}"), ("$\\frac{14}{3}$", "\\frac{14}{3}"), ("2 \\sqrt{5}", "2\\sqrt{5}"),
    ("[1, 2)", "[1,2)"), ("(-\\infty, 0]", "(-\\infty,0]"),
    ("-2+7 i", "-2 + 7i"),  # plain math-verify says False: it reads only the spaced i as imaginary
]
MATH_VERIFY_EQUAL = [  # mathematics: the fast path leaves these to math-verify
    ("\\frac{\\sqrt 2}{2}", "\\sqrt{2}/2"), ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("2\\sqrt{2}", "\\sqrt{8}"), ("(x+1)^2", "x^2+2x+1"), ("0.333333", "\\frac{1}{3}"),
    ("\\{2, 1\\}", "\\{1, 2\\}"), ("-2, 1", "1,-2"), ("7, 5, 3", "3, 5, 7"),
    ("[0.5, 2)", "[\\frac{1}{2}, 2)"), ("(-\\infty, \\sqrt{4}]", "(-\\infty,2]"), ("1\\frac{4}{5}", "\\frac{9}{5}"),
    ("\\begin{pmatrix} 1/2 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} \\frac12 \\\\ 2 \\end{pmatrix}"),
    ("0.1", "10\\%"), ("\\frac{1}{2}", "50\\%"),
]
NOT_EQUAL = [  # near misses that must fail
    ("0.51", "\\frac{1}{2}"), ("0.33", "\\frac{1}{3}"), ("1081", "1,080"), ("12", "1,2"), ("-5", "5"),
    ("\\frac{3}{2}", "\\frac{2}{3}"), ("\\frac{\\sqrt 3}{2}", "\\frac{\\sqrt 2}{2}"), ("2\\sqrt{3}", "\\sqrt{8}"),
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


@pytest.mark.parametrize("pred", [None, "", "   ", "\\boxed{}", "x" * (reward.MAX_ANSWER_CHARS + 1)])
def test_empty_missing_or_overlong_answers_are_never_equal(pred):
    assert reward.is_equivalent(pred, "3") is False


@pytest.mark.parametrize("gold", ["", "   ", "\\boxed{}"])
def test_an_empty_gold_is_a_data_error(gold):
    with pytest.raises(ValueError, match="gold answer is empty"):
        reward.is_equivalent("3", gold)
    with pytest.raises(ValueError, match=r"golds\[0\].*empty"):
        reward.score_batch(["\\boxed{3}"], [gold])


# -----------------------------------------------------------------------------
# compute_reward / score_batch: the reward rl.py and eval.py use


def test_compute_reward_is_binary_and_zero_for_truncated_rollouts():
    response = "<reason>2+2</reason><answer>\\boxed{4}</answer>"
    assert reward.compute_reward(response, "4") == 1.0
    assert reward.compute_reward(response, "5") == 0.0
    assert reward.compute_reward(response, "4", finished=False) == 0.0  # paper §4.3.1
    assert reward.compute_reward("<reason>it is 4</reason>", "4") == 0.0  # no box, no reward
    assert reward.compute_reward("\\boxed{4}", "4", require_answer_tag=True) == 0.0


def test_score_batch_keeps_order_and_takes_one_or_many_finished_flags():
    responses = ["\\boxed{1}", "\\boxed{\\frac{\\sqrt 2}{2}}", "\\boxed{3}", "no box", "\\boxed{x=5}"]
    golds = ["1", "\\sqrt{2}/2", "4", "1", "5"]
    assert reward.score_batch(responses, golds) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert reward.score_batch(responses, golds, finished=[True, False, True, True, True]) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert reward.score_batch(responses, golds, finished=False) == [0.0] * 5
    assert reward.score_batch([], []) == []


def test_score_batch_verifies_each_distinct_pair_once():
    # A group's 2G rollouts often give the same answer; math-verify should see it once.
    pool = reward.start_pool()
    before = pool.tasks_run["verify"]
    rewards = reward.score_batch(["so \\boxed{(x+1)^2}"] * 32, ["x^2+2x+1"] * 32)
    assert rewards == [1.0] * 32
    assert pool.tasks_run["verify"] - before == 1


def test_score_batch_is_safe_to_call_from_several_threads():
    # eval.py or rl.py may grade from a thread pool; batches then take turns on the shared workers.
    import threading

    pairs = [("\\boxed{\\frac{\\sqrt 2}{2}}", "\\sqrt{2}/2", 1.0), ("\\boxed{2\\sqrt{3}}", "\\sqrt{8}", 0.0),
             ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0), ("\\boxed{x^2+1}", "(x+1)^2", 0.0)]
    results = {}

    def grade(k):
        results[k] = reward.score_batch([p[0] for p in pairs], [p[1] for p in pairs])

    threads = [threading.Thread(target=grade, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {k: [p[2] for p in pairs] for k in range(4)}


@pytest.mark.parametrize("call, error, message", [
    (lambda: reward.score_batch(["a", "b"], ["1"]), ValueError, "2 responses but 1 golds"),
    (lambda: reward.score_batch(["a"], ["1"], finished=[True, True]), ValueError, "1 responses but 2 finished flags"),
    (lambda: reward.score_batch([None], ["1"]), TypeError, r"responses\[0\] must be a str"),
    (lambda: reward.score_batch(["a"], [3]), TypeError, "gold must be a str"),
    (lambda: reward.score_batch(["a"], ["1"], finished=["yes"]), TypeError, r"finished\[0\] must be a bool"),
    (lambda: reward.is_equivalent(3, "3"), TypeError, "pred must be a str or None"),
])
def test_bad_input_gets_an_error_that_names_it(call, error, message):
    with pytest.raises(error, match=message):
        call()


# -----------------------------------------------------------------------------
# Correctness on the data


def test_every_gold_answer_in_the_data_boxed_is_equivalent_to_itself():
    golds = sorted({json.loads(line)["answer"] for path in glob.glob(os.path.join(REPO, "data/*.jsonl"))
                    for line in open(path, encoding="utf-8") if line.strip()})
    assert len(golds) > 4000
    responses = [f"<reason>...</reason><answer>\\boxed{{{gold}}}</answer>" for gold in golds]
    rewards = reward.score_batch(responses, golds, require_answer_tag=True)
    assert [g for g, r in zip(golds, rewards) if r != 1.0] == []


def test_math_verify_itself_accepts_every_benchmark_gold_against_itself():
    # The fast path accepts identical strings without looking; this checks the slow path would too.
    paths = ["aime24", "aime25", "amc23", "hmmt_feb_2025", "math500"]
    golds = sorted({json.loads(line)["answer"] for p in paths
                    for line in open(os.path.join(REPO, f"data/{p}.jsonl"), encoding="utf-8")})
    golds = [g for g in golds if not g.lstrip("-").isdigit()]
    results, _ = reward._run_in_pool([("verify", g, g) for g in golds], [10.0] * len(golds))
    # Misses, with the reason (math-verify 0.9.0): none.
    assert [g for g, ok in zip(golds, results) if not ok] == []


# Misses of score_batch on the MATH-500 labeled set, with the reason: none. 500/500 positives, 0/1000
# false positives (and 10/10 truly equal cross pairs accepted). Plain math-verify also scores it perfectly
# (`python reward.py --bench`), so neither side has a miss to list.
LABELED_SET_MISSES = {}


def test_math500_labeled_set_is_scored_exactly():
    triples = reward.math500_labeled_set(os.path.join(REPO, "data/math500.jsonl"), negatives_per_problem=2)
    responses, golds, labels = zip(*triples)
    assert len(triples) == 1500 and sum(labels) == 510
    rewards = reward.score_batch(responses, golds)
    misses = {(reward.extract_answer(r), g): label for r, g, label, got in zip(responses, golds, labels, rewards)
              if bool(got) != label}
    assert misses == LABELED_SET_MISSES


def test_what_skips_verify_agrees_with_verify_on_the_labeled_set():
    # The fast path and the value check decide most pairs without math-verify's verify; on every such
    # pair of the labeled set, verify must say the same. (`--bench audit_all_pairs=true` does this for
    # all 90,000 ordered pairs of distinct MATH-500 answers.)
    triples = reward.math500_labeled_set(os.path.join(REPO, "data/math500.jsonl"), negatives_per_problem=2)
    responses, golds, _ = zip(*triples)
    reward.score_batch(responses, golds, timeout_s=10)  # fills in the values of the answers it needs
    decided = {}
    for response, gold in zip(responses, golds):
        pred = reward.extract_answer(response)
        if re.fullmatch(r"-?\d+", reward.normalize_answer(pred)) and re.fullmatch(r"-?\d+", reward.normalize_answer(gold)):
            continue  # two integers: compared exactly, nothing for math-verify to add
        verdict = reward.fast_equivalent(pred, gold)  # now with every needed value known
        if verdict is not None:
            decided[pred, gold] = verdict
    assert len(decided) > 400
    checks, _ = reward._run_in_pool([("verify", p, g) for p, g in decided], [10.0] * len(decided))
    assert [pair for pair, check in zip(decided, checks) if decided[pair] != check] == []


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
    timeout_s = 3.0
    started = time.monotonic()
    rewards = reward.score_batch([HOSTILE[name]], ["\\sqrt{2}"], timeout_s=timeout_s)
    elapsed = time.monotonic() - started
    assert rewards == [0.0]
    assert elapsed < timeout_s + 1.0, f"{name} took {elapsed:.1f} s"


def test_a_stuck_worker_is_killed_at_the_deadline_and_replaced():
    # A worker inside one C call (a huge big-int power) cannot run its alarm handler; SIGSTOP makes every
    # worker just as unresponsive, so only the parent's kill can end the check.
    pool = reward.start_pool()
    reward.is_equivalent("\\sqrt{8}", "2\\sqrt{2}")  # the pool is up
    kills = pool.kills
    stopped = [w["proc"].pid for w in pool.workers]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert reward.is_equivalent("(x+1)^2", "x^2+2x+1", timeout_s=1.0) is False  # true, but out of time
        assert time.monotonic() - started < 1.5
        assert pool.kills == kills + 1
    finally:
        for pid in stopped:
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGCONT)
    assert reward.is_equivalent("(x+1)^2", "x^2+2x+1") is True  # the others, or the fresh worker


def test_workers_that_cannot_start_raise_a_clear_error(monkeypatch):
    reward.shutdown_pool()
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(RuntimeError, match="workers fail to start"):
        reward.is_equivalent("\\sqrt{8}", "2\\sqrt{2}")
    monkeypatch.undo()
    reward.shutdown_pool()
    assert reward.is_equivalent("\\sqrt{8}", "2\\sqrt{2}") is True


def test_shutdown_leaves_no_worker_behind():
    pool = reward.start_pool()
    pids = [w["proc"].pid for w in pool.workers]
    reward.shutdown_pool()
    for pid in pids:
        assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0


def test_workers_die_with_their_parent():
    # A trainer killed with SIGKILL runs no cleanup; PR_SET_PDEATHSIG must still take its workers down.
    code = ("import reward, sys; pool = reward.start_pool(1); reward.is_equivalent('\\\\sqrt{8}', '2\\\\sqrt{2}');"
            "print(pool.workers[0]['proc'].pid, flush=True); import time; time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    worker_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{worker_pid}") and \
            "Z" not in open(f"/proc/{worker_pid}/stat").read().split()[2]:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{worker_pid}") or "Z" in open(f"/proc/{worker_pid}/stat").read().split()[2]
