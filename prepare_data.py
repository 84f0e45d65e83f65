"""A problem set in data/'s training format: integer answers only, deduplicated, decontaminated.

    python prepare_data.py source=dapo-math-17k.parquet question_key=prompt \\
        answer_key=reward_model.ground_truth name=dapo merge_with=data/train_int_mix.jsonl \\
        out=data/train_int_mix_dapo.jsonl      # DAPO-Math-17k added
    python prepare_data.py source=mine.jsonl question_key=question answer_key=answer name=mine \\
        out=data/mine.jsonl

The rules (data/SOURCES.md's, which built train_int_mix.jsonl): an answer must be an integer,
written canonically ("025" -> "25", "1,080" -> "1080"); the first of duplicate problems (the same
normalized text as an earlier row or a merge_with problem) is kept; a problem that is a benchmark's
(machinery.data.BENCHMARKS), or shares at least ngram_fraction of its word 8-grams with one, is
dropped. Keys are dotted paths into a row; a chat question is its last user message, DAPO's
wrapper removed. Parquet needs pyarrow (not in requirements.txt). The paper's 42K: docs/gpu.md.
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
    return text.removesuffix(DAPO_SUFFIX).strip() or None


def lookup(row, dotted):
    for part in dotted.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


def read_rows(path):
    """The rows of a JSONL or parquet file as dicts."""
    path = resolve(path)
    if not path.is_file():
        raise ConfigError(f"source={path}: no such file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet  # optional: only parquet input needs it
        except ImportError:
            raise ConfigError(f"source={path}: reading parquet needs pyarrow "
                              "(pip install pyarrow), or convert the file to JSONL first") from None
        return pyarrow.parquet.read_table(path).to_pylist()
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
    def overlaps(problem):  # shares ngram_fraction of its word 8-grams with a benchmark problem
        grams = ngrams(problem)
        shared = Counter(b for gram in grams for b in index.get(gram, ()))
        return any(count >= max(cfg.ngram_fraction * min(len(grams), len(benchmark_grams[b])), 1)
                   for b, count in shared.items())

    dropped, new_rows = Counter(), []
    for number, row in enumerate(read_rows(cfg.source), 1):
        problem = question_text(lookup(row, cfg.question_key))
        answer = canonical_integer(lookup(row, cfg.answer_key))
        key = normalize(problem) if problem else None
        reason = (f"no question at {cfg.question_key}" if key is None
                  else "answer not an integer" if answer is None
                  else "duplicate" if key in seen
                  else "benchmark problem" if key in benchmark_texts
                  else "8-gram overlap with a benchmark" if overlaps(problem) else None)
        if key is not None and answer is not None:
            seen.add(key)  # the first of duplicates counts, whatever drops it after that
        if reason:
            dropped[reason] += 1
        else:
            new_rows.append({"id": f"{cfg.name}-{number}", "problem": problem, "answer": answer,
                             "source": cfg.name})
    clash = {row["id"] for row in kept_rows} & {row["id"] for row in new_rows}
    if clash:
        raise ConfigError(f"name={cfg.name}: id {min(clash)!r} is already in merge_with; "
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
    print(f"next: python rl.py configs/stage1.yaml train_data={cfg.out} model=YOUR_SFT_MODEL")


if __name__ == "__main__":
    try:
        main(load_config(PrepareConfig, sys.argv[1:], doc=__doc__))
    except ConfigError as e:
        sys.exit(f"prepare_data.py: {e}")
