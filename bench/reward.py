"""Benchmark and audit of reward.py: answers/s and agreement, plain math-verify vs grade_batch, in
one run, on the MATH-500 labeled set and on integer answers (the paper's training case, §4.2):

  python -m bench.reward [workers=2 rounds=3 timeout_s=5 negatives_per_problem=2]
  python -m bench.reward audit_all_pairs=true   # also re-check with verify every pair of MATH-500's
                                                # answers and NOTATION_SHAPES decided without it
tests/test_reward.py uses math500_labeled_set, NOTATION_SHAPES and audit_fast_path from here.
"""
import dataclasses
import itertools
import os
import random
import sys
import time

from math_verify import parse, verify

from machinery.config import NonNegativeInt, PositiveFloat, PositiveInt, load_config
from machinery.data import load_problems
from reward import (DEFAULT_TIMEOUT_S, _differ_by_value, _VALUES, extract_answer, fast_equivalent,
                    grade_batch, normalize_answer)
from machinery.verifier import default_num_workers, run_in_pool, shutdown_pool, start_pool


def math500_labeled_set(path="data/math500.jsonl", negatives_per_problem=2, seed=0):
    """(response, gold, label) triples from MATH-500: each problem's reference `solution` against its
    own `answer` (all must score 1) and the answers of `negatives_per_problem` other problems (a
    seeded shuffle), equal exactly when the two answer strings are."""
    rows = load_problems(path)
    triples = [(row["solution"], row["answer"], True) for row in rows]
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    for k, i in enumerate(order):
        for j in (order[(k + shift) % len(order)] for shift in range(1, negatives_per_problem + 1)):
            triples.append((rows[j]["solution"], rows[i]["answer"],
                            rows[i]["answer"] == rows[j]["answer"]))
    return triples


def integer_set(path="data/train_int_mix.jsonl", problems=500):
    """(response, gold, label) triples for the paper's training case, integer answers (§4.2): four
    rollout-shaped responses per problem, right, off by one, a fraction, and ten times too big (for
    every tenth problem an irrational instead)."""
    triples = []
    for k, row in enumerate(load_problems(path)[:problems]):
        gold = int(row["answer"])
        last = f"{gold}+\\sqrt{{2}}" if k % 10 == 0 else str(10 * gold + 1)
        for answer in (str(gold), str(gold + 1), f"\\frac{{{2 * gold + 1}}}{{2}}", last):
            response = ("<reason>... checked with the tool ...</reason>"
                        f"<answer>\\boxed{{{answer}}}</answer>")
            triples.append((response, row["answer"], answer == str(gold)))
    return triples


@dataclasses.dataclass
class BenchConfig:
    negatives_per_problem: NonNegativeInt = 2
    workers: NonNegativeInt = 0  # 0: default_num_workers()
    timeout_s: PositiveFloat = DEFAULT_TIMEOUT_S
    rounds: PositiveInt = 3  # the machine may be shared: the median of interleaved rounds
    # also re-check what skips verify on all pairs of MATH-500 answers + NOTATION_SHAPES
    audit_all_pairs: bool = False


def bench(cfg):
    """Answers/s and agreement: plain math-verify vs grade_batch. Wall time is what a step waits
    for; CPU time (this process and the workers' checks) what the machine pays, steadier when
    shared."""
    workloads = {
        "MATH-500 labeled set":
            math500_labeled_set(negatives_per_problem=cfg.negatives_per_problem),
        "integer answers (train_int_mix)": integer_set(),
    }
    for workload, triples in workloads.items():
        responses, golds, labels = zip(*triples)
        n = len(triples)
        results = {}  # method -> [(wall s, cpu s, verdicts)] per round
        worker_counts = sorted({cfg.workers or default_num_workers(), 1}, reverse=True)
        methods = [
            ("math-verify: verify(parse(gold), parse(response))", None,
             lambda: [verify(parse("\\boxed{" + g + "}"), parse(r))
                      for r, g in zip(responses, golds)]),
        ] + [(f"grade_batch, {w} worker(s)", w,
              lambda: grade_batch(responses, golds, timeout_s=cfg.timeout_s)[0])
             for w in worker_counts]
        for _ in range(cfg.rounds):
            for name, workers, method in methods:
                pool = None
                if workers:   # a fresh pool and empty caches: no round reuses another's work
                    shutdown_pool()
                    pool = start_pool(workers)
                    normalize_answer.cache_clear()
                _VALUES.clear()
                wall, cpu = time.perf_counter(), time.process_time()
                verdicts = method()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                cpu += pool.worker_cpu_s if pool else 0.0
                results.setdefault(name, []).append((wall, cpu, verdicts))
                if pool:
                    tasks = pool.tasks_run

        shutdown_pool()
        positives = sum(labels)
        _VALUES.clear()
        undecided = sum(fast_equivalent(extract_answer(r) or "", g) is None
                        for r, g in zip(responses, golds))
        print(f"\n{workload}: {n} pairs, {positives} equal; median of {cfg.rounds} round(s); "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n"
              f"the fast path leaves {undecided} pairs open; the workers evaluate "
              f"{tasks['value']} distinct answers, then verify {tasks['verify']} pairs")
        print(f"{'method':52} {'answers/s':>9} {'speedup':>7} {'CPU ms/answer':>13} {'speedup':>7} "
              f"{'equal found':>11} {'false pos':>9}")
        base = None
        for name, runs in results.items():
            wall = sorted(r[0] for r in runs)[len(runs) // 2]
            cpu_ms = 1000 * sorted(r[1] for r in runs)[len(runs) // 2] / n
            verdicts = runs[0][2]
            found = sum(1 for v, label in zip(verdicts, labels) if v and label)
            false_pos = sum(1 for v, label in zip(verdicts, labels) if v and not label)
            base = base or (wall, cpu_ms)
            print(f"{name:52} {n / wall:9.0f} {base[0] / wall:6.1f}x {cpu_ms:13.3f} "
                  f"{base[1] / cpu_ms:6.1f}x {found:>5}/{positives:<5} "
                  f"{false_pos:>4}/{n - positives:<4}")
    if cfg.audit_all_pairs:
        answers = ({row["answer"] for row in load_problems("data/math500.jsonl")}
                   | set(NOTATION_SHAPES))
        started = time.perf_counter()
        decided, wrong = audit_fast_path(answers, cfg.workers or None, max(cfg.timeout_s, 10))
        print(f"\naudit: {decided} of {len(answers) * (len(answers) - 1)} ordered pairs of "
              "distinct answers (MATH-500's and NOTATION_SHAPES) are decided without verify; "
              f"{len(wrong)} disagree with math-verify ({time.perf_counter() - started:.0f} s)")
        for pred, gold, verdict in wrong:
            print(f"  decided {verdict} for pred {pred!r} vs gold {gold!r}")


# Spellings MATH-500's answers do not cover (from third-party grader test suites), audited with them
NOTATION_SHAPES = [
    "32349", "32,349", "32, 349", "32,\\!349", "32,\\ 349",
    "1234,567", "1,234,567", "1, 234, 567", "1234567",
    "1000", "1,000", "1, 000", "1{,}000", "1\\,000", "1000.0", "1,000.0",
    "1000.99", "1,000.99", "1,000.9",
    "11", "11.0", "x\\approx11", "x \\approx 12", "\\approx 11", "x = 11",
    "16386.20", "16386.2", "\\$16,\\!386.20", "\\$16,386.20", "\\$16,\\!386",
    "\\$5.00", "5", "\\$5",
    "10\\%", "0.1", "10", "50\\%", "0.5", "50", "25\\%", "\\frac{1}{4}",
    "90^\\circ", "90", "90^{\\circ}", "\\frac{\\pi}{2}",
    "30^\\circ", "\\frac{\\pi}{6}", "180^\\circ", "\\pi",
    "5 \\text{ cm}", "5\\text{ cm}^2", "6 \\text{ m}",
    "12 \\text{ inches}", "1 \\text{ foot}", "12", "1",
    "3, 5", "35", "1, 2", "1,2", "12", "(1,234)", "1234", "1, 2, 3", "123",
    "5, 5", "[5, 5]", "(5, 5)", "[\\frac12, 0.5]", "(6,31,-1)",
    "\\{1, 2\\}", "[2, 7)", "-\\sqrt{3}", "2",
    "\\{2, \\sqrt{4}\\}", "\\{\\frac12, 0.5\\}", "\\frac{1}{2}",
]


def _decided_without_verify(pred, gold):
    """grade_batch's verdict without verify, given the values known: fast_equivalent's, else False
    for two numbers far apart, else None."""
    verdict = fast_equivalent(pred, gold)
    return False if verdict is None and _differ_by_value(pred, gold) else verdict


def audit_fast_path(answers, workers=None, timeout_s=10.0):
    """Every ordered pair of distinct `answers` decided without verify once every value is known,
    re-checked by verify: (pairs decided, [(pred, gold, verdict) verify decides otherwise])."""
    answers = sorted(set(answers))
    start_pool(workers)
    values, _, _ = run_in_pool([("value", a) for a in answers], [timeout_s] * len(answers))
    _VALUES.update(zip(answers, values))
    decided = [(pred, gold, verdict) for pred, gold in itertools.permutations(answers, 2)
               for verdict in [_decided_without_verify(pred, gold)] if verdict is not None]
    checks, _, _ = run_in_pool([("verify", pred, gold) for pred, gold, _ in decided],
                                [timeout_s] * len(decided))
    return len(decided), [(p, g, v) for (p, g, v), check in zip(decided, checks) if v != check]


if __name__ == "__main__":
    bench(load_config(BenchConfig, sys.argv[1:]))
