"""Behaviour of tools/compare.py on synthetic run directories (metrics.jsonl, config.yaml): the
table's hand-computed last-third means and stds over seeds, range overlaps and the reference's
claims; the PNG; arms as rl.py launch lines; demo.py ablation=true through the same code."""
import json

import pytest
import yaml

import demo
from machinery.config import ConfigError, load_config
from tools.compare import (CompareConfig, arm_jobs, compare, find_runs, summarize,
                           write_comparison)

STEPS = 6  # the last third: steps 5 and 6


def fake_run(path, seed, accuracy, error_ratio, held_out=None, loss=None):
    """A run directory whose steps 1-4 read 0 and steps 5-6 `accuracy` and `error_ratio`, held out
    after the last step; with `loss`, step N's loss is loss + N / 100."""
    path.mkdir(parents=True)
    rows = []
    for step in range(1, STEPS + 1):
        late = step > 4
        rows.append({"step": step, "accuracy": accuracy if late else 0.0, "trajectories": 64,
                     "selected": 32, "tool_error_ratio_in_correct": error_ratio if late else 0.0,
                     "response_tokens": 100.0 + step, "entropy": 0.5, "grad_norm": 1.0 + seed,
                     "time/step": 10.0, **({} if loss is None else {"loss": loss + step / 100})})
    if held_out is not None:
        rows[-1].update({"eval/pass@1": held_out, "eval/tool_error_rate_in_correct": error_ratio})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(yaml.safe_dump({"seed": seed}))
    return path


@pytest.fixture
def two_arms(tmp_path):
    """Arm roc (the reference) and arm grpo, two seeds each."""
    return [str(fake_run(tmp_path / "roc-seed0", 0, 0.6, 0.1, held_out=0.70)),
            str(fake_run(tmp_path / "roc-seed1", 1, 0.8, 0.2, held_out=0.80)),
            str(fake_run(tmp_path / "grpo-seed0", 0, 0.3, 0.3, held_out=0.50)),
            str(fake_run(tmp_path / "grpo-seed1", 1, 0.4, 0.6, held_out=0.60))]


def test_the_table_holds_the_last_third_means_and_std_over_seeds_and_the_range_overlap(two_arms,
                                                                                         tmp_path):
    lines = compare(load_config(CompareConfig, [f"runs={','.join(two_arms)}",
                                                f"plot={tmp_path / 'out' / 'cmp.png'}"]))
    table = "\n".join(lines)
    # std over seeds is the sample one: |0.6 - 0.8| / sqrt(2) = 14.1%
    assert ("| roc | 64 / 32 | 0.0% ± 0.0% | 70.0% ± 14.1% | 0.0% ± 0.0% | 15.0% ± 7.1% "
            "| 15.0% ± 7.1% |") in table
    assert "| grpo | 64 / 32 | 0.0% ± 0.0% | 35.0% ± 7.1% |" in table
    assert "| roc | 75.0% ± 7.1% | 15.0% ± 7.1% |" in table        # held out after step 6
    # the every-curve table: grpo's ranges against roc's (grad norm 1 and 2 in both: overlap)
    assert "| grpo | 35.0% ± 7.1% (disjoint) | 55.0% ± 7.1% (disjoint) |" in table
    assert "| 1.5 ± 0.71 (overlap) |" in table
    # roc's ratio below grpo's: by 30 points against the larger std, 21.2; ranges 0.1-0.2 vs
    # 0.3-0.6
    assert ("- tool-error ratio in correct trajectories over the last third: roc 15.0%, 30.0 "
            "points below grpo's 45.0% (seed spread, the larger std: 21.2 points): below by more "
            "than the spread: yes; seed ranges disjoint") in table
    assert "no key acted" not in table
    out = tmp_path / "out"
    assert (out / "cmp.png").stat().st_size > 10_000
    assert (out / "cmp.md").read_text() == table + "\n"
    assert json.loads((out / "cmp.json").read_text())["arms"]["roc"]["last_third"]["accuracy"][
        "mean"] == pytest.approx(0.7)


def test_the_demo_s_ablation_writes_this_very_table(two_arms, tmp_path):
    """demo.py ablation=true hands its runs to the same write_comparison: for the same run
    directories its table is the script's, all but the header's command."""
    assert demo.write_comparison is write_comparison
    script = compare(load_config(CompareConfig, [f"runs={','.join(two_arms)}",
                                                 f"plot={tmp_path / 'a.png'}"]))
    runs = {key: demo.read_metrics(path) for key, path in find_runs(two_arms).items()}
    lines = write_comparison(runs, tmp_path / "b.png", "roc", "`python demo.py ablation=true`",
                             "tiny", 3)
    assert lines[1:] == script[1:] and "`python demo.py ablation=true`" in lines[0]


def test_one_run_gets_its_own_curves(tmp_path):
    run = fake_run(tmp_path / "tiny-rl", 0, 0.7, 0.1)
    lines = compare(load_config(CompareConfig, [f"runs={run}", f"plot={tmp_path / 'c.png'}"]))
    assert (tmp_path / "c.png").stat().st_size > 10_000
    assert any(line.startswith("| tiny-rl | 70.0% ± 0.0% |") for line in lines)
    assert summarize({("tiny-rl", 0): demo.read_metrics(run)}, "tiny-rl")["below"] == {}


def test_arms_become_one_rl_py_run_per_seed_or_their_launch_lines(capsys):
    cfg = load_config(CompareConfig, ["arms=roc,short positive_rule=shortest", "seeds=0,1",
                                      "args=steps=3", "out_dir=runs/x", "launch=print"])
    jobs = arm_jobs(cfg)
    assert jobs["short", 1] == ("runs/x/short-seed1", ["configs/tiny.yaml", "steps=3",
                                                       "positive_rule=shortest", "seed=1",
                                                       "out_dir=runs/x/short-seed1"])
    assert compare(cfg) is None
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[-1].endswith("seed=1 out_dir=runs/x/short-seed1")


@pytest.mark.parametrize("args, message", [
    ([], "arms or runs: give the arms to run"),
    (["runs=nowhere"], "runs: .*nowhere: no metrics.jsonl"),
    (["arms=roc,bad algorithm"], "arms: 'bad algorithm': expected NAME key=value"),
])
def test_bad_input_is_one_line_naming_it(args, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        compare(load_config(CompareConfig, [*args, f"plot={tmp_path / 'x.png'}"]))


def test_demo_s_ablation_hands_its_nine_runs_to_write_comparison(tmp_path, monkeypatch):
    """demo.ablation's own code around the shared table: its arms and seeds go in, GRPO-RoC is the
    reference, the held-out count is test_problems x ablation_final_samples. The stages are
    stood in for by fixed metrics (what rl.py would have written)."""
    def fake_train_rl(cfg, out_dir, args, log=None):
        seed = int(next(a for a in args if a.startswith("seed=")).split("=")[1])
        error = {"roc": 0.05, "grpo": 0.2, "grpo2g": 0.1}[out_dir.split("/")[-1].split("-")[0]]
        path = fake_run(tmp_path / out_dir.replace("/", "_"), seed, 0.7, error + 0.01 * seed,
                        held_out=0.7)
        return demo.read_metrics(path), 1.0

    monkeypatch.setattr(demo, "prepare", lambda cfg: {})
    monkeypatch.setattr(demo, "train_rl", fake_train_rl)
    cfg = load_config(demo.DemoConfig, ["ablation=true", f"plot={tmp_path / 'ablation.png'}",
                                        "ablation_steps=6"])
    lines = demo.ablation(cfg)
    assert (tmp_path / "ablation.png").is_file() and (tmp_path / "ablation.md").is_file()
    assert [line.split(" |")[0] for line in lines[4:7]] == ["| GRPO", "| GRPO-RoC",
                                                            "| GRPO, 2G kept"]
    assert "(400 trajectories per seed)" in "\n".join(lines)
    assert ("- tool-error ratio in correct trajectories over the last third: GRPO-RoC 6.0%, "
            "15.0 points below GRPO's 21.0% (seed spread, the larger std: 1.0 points): below by "
            "more than the spread: yes; seed ranges disjoint") in lines


def test_the_direction_of_a_difference_is_said_in_words(tmp_path):
    """An arm whose ratio is below the reference's: "above", never a "below" by a negative
    number."""
    runs = [fake_run(tmp_path / "roc-seed0", 0, 0.6, 0.30), fake_run(tmp_path / "low-seed0", 0,
                                                                      0.6, 0.28)]
    lines = compare(load_config(CompareConfig, [f"runs={','.join(map(str, runs))}",
                                                f"plot={tmp_path / 'd.png'}"]))
    assert ("- tool-error ratio in correct trajectories over the last third: roc 30.0%, 2.0 "
            "points above low's 28.0% (seed spread, the larger std: 0.0 points): one seed: no "
            "spread to judge it by") in lines
    assert not any("by -" in line or "by +" in line for line in lines)


def test_an_arm_that_trained_exactly_like_the_reference_is_said_to_and_no_other(tmp_path):
    """Every step's loss and gradient norm equal the reference's in every seed: no key of the arm
    acted. A different loss at one seed, or no loss logged at all, is not that."""
    runs = []
    for seed in (0, 1):
        runs += [fake_run(tmp_path / f"roc-seed{seed}", seed, 0.6, 0.1, loss=0.5),
                 fake_run(tmp_path / f"gspo-seed{seed}", seed, 0.6, 0.1, loss=0.5),
                 fake_run(tmp_path / f"drgrpo-seed{seed}", seed, 0.6, 0.1, loss=0.5 + seed),
                 fake_run(tmp_path / f"unlogged-seed{seed}", seed, 0.6, 0.1)]
    lines = compare(load_config(CompareConfig, [f"runs={','.join(map(str, runs))}",
                                                f"plot={tmp_path / 'e.png'}"]))
    said = [line for line in lines if "no key acted" in line]
    assert said == ["- arm gspo: no key acted at these settings: every step's loss and gradient "
                    "norm equal roc's, in every seed (it trained exactly like roc)"]
    assert json.loads((tmp_path / "e.json").read_text())["trained_like_reference"] == ["gspo"]


def test_a_typo_in_any_arm_stops_the_comparison_before_anything_runs(tmp_path):
    out = tmp_path / "arms"
    with pytest.raises(ConfigError, match=r"arm gspo: command line: 'ratio_levl': unknown key "
                                          r"\(did you mean 'ratio_level'\?\)"):
        compare(load_config(CompareConfig, ["arms=roc,gspo ratio_levl=sequence", "seeds=0",
                                            "args=steps=1", f"out_dir={out}"]))
    assert not out.exists()  # no arm ran, not even the first
    with pytest.raises(ConfigError, match="arm big: prompts_per_step=8 does not divide into "
                                          "mini_batches=3"):
        compare(load_config(CompareConfig, ["arms=roc,big mini_batches=3", f"out_dir={out}"]))


def test_an_arm_key_that_cannot_act_is_said_beside_the_launch_lines(capsys):
    """ratio_level=sequence alone, at one optimizer step per batch, would train exactly like the
    reference: said on stderr, once per arm; stdout keeps only the launch lines."""
    compare(load_config(CompareConfig, ["arms=roc,gspo ratio_level=sequence,gspo4 "
                                        "ratio_level=sequence mini_batches=4", "seeds=0,1",
                                        "launch=print"]))
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 6 and all(line.startswith("torchrun") for line in
                                              out.splitlines())
    assert err.splitlines() == ["tools.compare: arm gspo: ratio_level=sequence cannot act at "
                                "mini_batches=1 and no token_* rollout_correction "
                                "(docs/design.md)"]
