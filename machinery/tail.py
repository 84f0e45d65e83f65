"""The rollout phase at scale, simulated with rollout.py's own admission rule: how long the
slowest engine decodes and how long the others wait for it (the tail); mode=plan prints it,
docs/benchmarks.md compares claiming rules with it. rollout.Rollouts' admit(), claim_group() and
capacity() run unchanged; a trajectory ends at its length over a decode rate, in one event queue
for all engines. Not simulated: tool calls, prefill, a rate that changes with the load."""
import heapq
import itertools
import random
from types import SimpleNamespace


def simulate(rollouts_class, engines, k, problems, n, seconds, speed=None):
    """Finish second of every engine in one rollout phase: `engines` engines of K slots each claim
    `problems` problems of n samples from one counter; seconds(problem, sample) is a trajectory's
    decode time at full speed, speed(engine) a factor (1 = full speed)."""
    return [finished for finished, _ in claims(rollouts_class, engines, k, problems, n, seconds,
                                               speed)]


def claims(rollouts_class, engines, k, problems, n, seconds, speed=None):
    """simulate's phase, per engine: (its finish second, {problem: [samples it ran]}), the parts
    of each group it would hand to rollout.generate's regroup."""
    counter, events, clock = itertools.count(), [], [0.0]

    class Simulated(rollouts_class):
        def __init__(self, index):  # only what admit, claim_group and capacity read
            self.index, self.texts, self.n = index, range(problems), n
            self.engine = SimpleNamespace(max_concurrency=lambda: k)
            self.cfg = SimpleNamespace(max_concurrency=0)
            self.claim = lambda: next(counter)
            self.waiting, self.running, self.tooling, self.groups = [], {}, {}, {}
            self.exhausted, self.finished = False, 0.0

        def new_trajectories(self, index, samples):
            return [(index, i) for i in samples]

        def next_turn(self, traj):
            self.running[traj] = traj
            rate = speed(self.index) if speed else 1.0
            heapq.heappush(events, (clock[0] + seconds(*traj) / rate, self.index, traj))

    ranks = [Simulated(e) for e in range(engines)]
    for r in ranks:
        r.admit()
    while events:
        clock[0], e, traj = heapq.heappop(events)
        del ranks[e].running[traj]
        ranks[e].finished = clock[0]
        ranks[e].admit()
    return [(r.finished, r.groups) for r in ranks]


def spread_lengths(problems, n, longest, shortest_share=0.2, seed=0):
    """Response lengths drawn uniformly from [shortest_share, 1] x longest, one per trajectory
    (a fixed seed: the same table for every rule compared)."""
    rng = random.Random(seed)
    return [[int(longest * rng.uniform(shortest_share, 1.0)) for _ in range(n)]
            for _ in range(problems)]


def tail(finished):
    """(phase: the slowest engine's seconds, tail: the fastest engine's wait for it, idle: the share
    of all engines' time spent waiting after their last trajectory)."""
    phase = max(finished)
    return dict(phase=phase, tail=phase - min(finished),
                idle=sum(phase - f for f in finished) / (phase * len(finished)) if phase else 0.0)


def rollout_tails(rollouts_class, engines, k, problems, n, response_tokens, tok_s,
                  engines_per_node):
    """mode=plan's three cases: every response at `response_tokens`, spread lengths, and spread
    lengths with one node's engines at half speed."""
    lengths = spread_lengths(problems, n, response_tokens)
    slow = engines - engines_per_node  # the last node's engines
    cases = {"full": (lambda p, s: response_tokens / tok_s, None),
             "spread": (lambda p, s: lengths[p][s] / tok_s, None),
             "slow node": (lambda p, s: lengths[p][s] / tok_s,
                           lambda e: 0.5 if e >= slow else 1.0)}
    return {name: tail(simulate(rollouts_class, engines, k, problems, n, seconds, speed))
            for name, (seconds, speed) in cases.items()}
