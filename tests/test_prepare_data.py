"""prepare_data.py: a DAPO-shaped problem set becomes data/'s format, integer answers only, each
problem once, none that is (or is a rewording of) a benchmark problem."""
import json

import pytest

import prepare_data
from machinery.config import ConfigError, load_config
from machinery.data import load_problems


def dapo_row(problem, answer):
    """A DAPO-Math-17k row: the problem inside its instruction prompt, the answer in reward."""
    prompt = f"{prepare_data.DAPO_PREFIX} $Answer (without quotes) where $Answer is the answer " \
             "to the problem.\n\n" \
             f"{problem}\n\n{prepare_data.DAPO_SUFFIX}"
    return {"data_source": "math_dapo", "prompt": [{"content": prompt, "role": "user"}],
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"}}


@pytest.fixture
def dapo_file(tmp_path):
    aime = load_problems("data/aime24.jsonl")[3]["problem"]
    words = aime.split()
    # the tail changed: most 8-grams still shared
    reworded = " ".join(words[:-3] + ["Determine", "this", "value."])
    train = load_problems("data/train_int_mix.jsonl")[0]["problem"]
    rows = [dapo_row("How many primes are below 20?", "8")] * 3 + [  # DAPO repeats its problems
        dapo_row("Compute 7 * 11 + 1, in   $\\LaTeX$.", "078"),
        dapo_row("Find x if 2x = 3.", "\\frac{3}{2}"),
        dapo_row(aime, "1"),
        dapo_row(reworded, "2"),
        dapo_row(train, "3"),
        dapo_row("How many PRIMES are below 20?", "8"),  # the first problem up to case and spaces
        dapo_row("What is 1,000 + 80?", "1,080"),
    ]
    path = tmp_path / "dapo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(*overrides):
    return load_config(prepare_data.PrepareConfig, list(overrides))


def test_a_dapo_set_becomes_integer_problems_without_duplicates_or_benchmark_problems(dapo_file,
                                                                                      tmp_path):
    cfg = config(f"source={dapo_file}", f"out={tmp_path / 'out.jsonl'}", "question_key=prompt",
                 "answer_key=reward_model.ground_truth", "name=dapo",
                 "merge_with=[data/train_int_mix.jsonl]")
    kept, new, dropped = prepare_data.prepare(cfg)
    assert len(kept) == len(load_problems("data/train_int_mix.jsonl"))
    assert new == [
        {"id": "dapo-1", "problem": "How many primes are below 20?", "answer": "8",
         "source": "dapo"},
        {"id": "dapo-4", "problem": "Compute 7 * 11 + 1, in   $\\LaTeX$.", "answer": "78",
         "source": "dapo"},
        {"id": "dapo-10", "problem": "What is 1,000 + 80?", "answer": "1080", "source": "dapo"},
    ]
    assert dropped == {"duplicate": 4, "answer not an integer": 1, "benchmark problem": 1,
                       "8-gram overlap with a benchmark": 1}
    prepare_data.main(cfg)  # a file rl.py reads: merge_with's rows, then the new ones
    assert load_problems(cfg.out) == kept + new


def test_bad_input_names_the_key_or_the_missing_reader(dapo_file, tmp_path):
    for overrides, named in (([f"source={dapo_file}"], "out"), (["out=x.jsonl"], "source"),
                             (["name=a b", "source=s", "out=o"], "name"),
                             (["ngram_fraction=2", "source=s", "out=o"], "'ngram_fraction'")):
        with pytest.raises(ConfigError, match=f"^[^\\n]*{named}"):
            config(*overrides)
    _, new, dropped = prepare_data.prepare(config(f"source={dapo_file}", "out=x.jsonl",
                                                  "question_key=question"))
    assert new == [] and dropped == {"no question at question": 10}
    parquet = tmp_path / "set.parquet"
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:  # not a dependency: the message says what to do
        parquet.write_bytes(b"PAR1")
        with pytest.raises(ConfigError, match=f"source={parquet}: .*pyarrow"):
            prepare_data.prepare(config(f"source={parquet}", "out=x.jsonl"))
    else:
        rows = [json.loads(line) for line in dapo_file.read_text().splitlines()]
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), parquet)
        _, new, _ = prepare_data.prepare(config(f"source={parquet}", "out=x.jsonl",
                                                "question_key=prompt",
                                                "answer_key=reward_model.ground_truth"))
        assert len(new) == 4
