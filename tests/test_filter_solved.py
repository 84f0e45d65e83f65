"""Behaviour of tools/filter_solved.py, stage 3's data (§4.3), through the real engine, tool and
reward on conftest.py's small policy."""
import json

import pytest

from rl_runs import MEMO_PROBLEMS, PYTHON, run


@pytest.mark.slow
def test_filter_drops_only_problems_solved_every_time_and_keeps_the_rest_in_order(sft_policy,
                                                                                  tmp_path):
    """The filter (stage-3 data, §4.3) through the real engine, tool and reward, one sample per
    problem. The policy memorised MEMO_PROBLEMS but answers right only about one sample in eight.
    Each problem appears 16 times under different ids with its true answer, and twice with a gold
    answer no sample can reach (-1): those rows must all be kept, whatever the policy samples, and
    some solvable row must go (none of 64 at 1 in 8 would be 0.875^64 = 2e-4; the engine's seeds
    make the outcome the same on every run of one machine)."""
    solvable = [{**p, "id": f"{p['id']}-{k}"} for k in range(16) for p in MEMO_PROBLEMS]
    unreachable = [{**p, "id": f"{p['id']}-wrong-gold-{k}", "answer": "-1"}
                   for k in range(2) for p in MEMO_PROBLEMS]
    rows = solvable[:32] + unreachable + solvable[32:]  # the kept rows must come back in this order
    source, kept_path = tmp_path / "source.jsonl", tmp_path / "kept.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run([PYTHON, "-m", "tools.filter_solved", "configs/tiny.yaml", f"model={sft_policy}",
               f"filter_source={source}", f"train_data={kept_path}", "filter_samples=1",
               "prompts_per_step=24", "eval_data=", "rollout.max_response_tokens=200"], timeout=600)
    kept = [json.loads(line) for line in kept_path.read_text().splitlines()]
    kept_ids = [r["id"] for r in kept]
    # the source's order, no row twice
    assert kept_ids == [r["id"] for r in rows if r["id"] in set(kept_ids)]
    assert all(r == next(s for s in rows if s["id"] == r["id"]) for r in kept)  # rows unchanged
    assert {r["id"] for r in unreachable} <= set(kept_ids)
    assert len(kept) < len(rows)
    assert f"kept {len(kept)} of {len(rows)} problems" in out.stdout
