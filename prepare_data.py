"""Turn a problem set into data/'s training format: integer answers only, deduplicated,
decontaminated.

    python prepare_data.py source=dapo-math-17k.parquet question_key=prompt \\
        answer_key=reward_model.ground_truth name=dapo merge_with=data/train_int_mix.jsonl \\
        out=data/train_int_mix_dapo.jsonl      # DAPO-Math-17k added
    python prepare_data.py source=mine.jsonl question_key=question answer_key=answer name=mine \\
        out=data/mine.jsonl

The rules (data/SOURCES.md's, which built train_int_mix.jsonl): an answer must be an integer,
written canonically ("025" -> "25", "1,080" -> "1080"); the first of duplicate problems (the same
normalized text as an earlier row or a merge_with problem) is kept; a problem that is a benchmark's
(machinery.data.BENCHMARKS), or shares at least ngram_fraction of its word 8-grams with one, is
dropped. Keys are dotted paths into a row; a question stored as chat messages is its last user
message, DAPO's instruction wrapper removed. Parquet input needs pyarrow (not in requirements.txt).
Why and how to reach the paper's 42K problems: docs/gpu.md.

Tests: .venv/bin/python -m pytest tests/test_prepare_data.py -q
"""
import dataclasses
import json
import re
import sys
from collections import Counter, defaultdict

from machinery.data import BENCHMARKS, load_jsonl, load_problems
from machinery.config import atomic_write_text, ConfigError, Fraction, load_config, resolve

NGRAM = 8
# DAPO-Math-17k's prompt around each problem (BytedTsinghua-SIA/DAPO-Math-17k, the release's
# training data)
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer:")
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'
INTEGER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.0*)?")


@dataclasses.dataclass
class PrepareConfig:
    source: str = ""                     # the problem set: .jsonl or .parquet
    out: str = ""                        # where the data/-format JSONL goes
    name: str = "extra"                  # the rows' source field and id prefix
    question_key: str = "problem"        # dotted path to the question (a string, or chat messages)
    answer_key: str = "answer"           # dotted path to the integer answer
    # data/-format files written first, unchanged
    merge_with: list[str] = dataclasses.field(default_factory=list)
    ngram_fraction: Fraction = 0.8       # a problem sharing this much of its word 8-grams with a
                                         # benchmark is dropped

    def validate(self):
        if not self.source or not self.out:
            raise ConfigError(f"{'out' if self.source else 'source'}: not set; python "
                              "prepare_data.py source=FILE out=data/NAME.jsonl")
        if not re.fullmatch(r"[\w.-]+", self.name):
            raise ConfigError(f"name={self.name!r}: letters, digits, '.', '-' and '_' only "
                              "(it prefixes every id)")


def normalize(text):
    """The key under which two problems are the same (data/SOURCES.md): lower-cased, whitespace
    and $ removed."""
    return re.sub(r"[\s$]", "", text.lower())


def ngrams(text):
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + NGRAM]) for i in range(len(words) - NGRAM + 1)}


def canonical_integer(answer):
    """The answer as data/ writes integers, or None if it is not one."""
    text = re.sub(r"[\s$]", "", str(answer))
    if isinstance(answer, bool) or not INTEGER.fullmatch(text):
        return None
    return str(int(text.split(".")[0].replace(",", "")))


def question_text(value):
    """The question itself: the last user message of a chat, without DAPO's instruction wrapper."""
    if isinstance(value, list):
        users = [m.get("content") for m in value
                 if isinstance(m, dict) and m.get("role") == "user"]
        value = users[-1] if users else None
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text.startswith(DAPO_PREFIX) and "\n\n" in text:
        text = text.split("\n\n", 1)[1]
    if text.endswith(DAPO_SUFFIX):
        text = text[:-len(DAPO_SUFFIX)]
    return text.strip() or None


def lookup(row, dotted):
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def read_rows(path, keys):
    """The rows of a JSONL or parquet file as dicts (for parquet, only the top-level columns of
    `keys`)."""
    path = resolve(path)
    if not path.is_file():
        raise ConfigError(f"source={path}: no such file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet  # optional: only parquet input needs it
        except ImportError:
            raise ConfigError(f"source={path}: reading parquet needs pyarrow "
                              "(pip install pyarrow), or convert the file to JSONL first") from None
        columns = sorted({key.split(".")[0] for key in keys})
        missing = [c for c in columns if c not in pyarrow.parquet.read_schema(path).names]
        if missing:
            raise ConfigError(f"source={path}: no column {missing[0]!r}; "
                              "set question_key / answer_key")
        return pyarrow.parquet.read_table(path, columns=columns).to_pylist()
    return load_jsonl(path)


def prepare(cfg):
    """-> (merge_with's rows, the new rows, Counter of the source's rows dropped and why)."""
    kept_rows = [row for path in cfg.merge_with for row in load_problems(path)]
    seen = {normalize(row["problem"]) for row in kept_rows}
    benchmarks = [row["problem"] for path in BENCHMARKS.values() for row in load_problems(path)]
    benchmark_texts = {normalize(text) for text in benchmarks}
    benchmark_grams = [ngrams(text) for text in benchmarks]
    index = defaultdict(set)  # 8-gram -> the benchmark problems that contain it
    for b, grams in enumerate(benchmark_grams):
        for gram in grams:
            index[gram].add(b)
    dropped = Counter()
    new_rows = []
    for number, row in enumerate(read_rows(cfg.source, (cfg.question_key, cfg.answer_key)), 1):
        problem = question_text(lookup(row, cfg.question_key))
        if problem is None:
            dropped[f"no question at {cfg.question_key}"] += 1
            continue
        answer = canonical_integer(lookup(row, cfg.answer_key))
        if answer is None:
            dropped["answer not an integer"] += 1
            continue
        key = normalize(problem)
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        if key in benchmark_texts:
            dropped["benchmark problem"] += 1
            continue
        grams = ngrams(problem)
        shared = Counter(b for gram in grams for b in index.get(gram, ()))
        if any(count >= max(cfg.ngram_fraction * min(len(grams), len(benchmark_grams[b])), 1)
               for b, count in shared.items()):
            dropped["8-gram overlap with a benchmark"] += 1
            continue
        new_rows.append({"id": f"{cfg.name}-{number}", "problem": problem, "answer": answer,
                         "source": cfg.name})
    ids = {row["id"] for row in kept_rows}
    clash = next((row["id"] for row in new_rows if row["id"] in ids), None)
    if clash:
        raise ConfigError(f"name={cfg.name}: id {clash!r} is already in merge_with; "
                          "choose another name")
    return kept_rows, new_rows, dropped


def main(cfg):
    kept_rows, new_rows, dropped = prepare(cfg)
    out = resolve(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(json.dumps(row) + "\n" for row in kept_rows + new_rows))
    print(f"{out}: {len(kept_rows) + len(new_rows)} problems ({len(kept_rows)} from merge_with, "
          f"{len(new_rows)} new from {cfg.source})")
    for reason, count in dropped.most_common():
        print(f"  dropped {count}: {reason}")
    print(f"next: python rl.py configs/stage1.yaml train_data={cfg.out}   (the paper's stage 1 on "
          "these problems; add model=... for your SFT policy)")


if __name__ == "__main__":
    try:
        main(load_config(PrepareConfig, sys.argv[1:], doc=__doc__))
    except ConfigError as e:
        sys.exit(f"prepare_data.py: {e}")
