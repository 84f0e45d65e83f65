"""Multiple-choice science benchmarks for eval.py (GPQA-Diamond, §5.1): GPQA's CSV or a JSONL of
{"id", "question", "choices", "answer": a letter}; options shuffled by a recorded seed, and the
letter read from the model's final answer."""
import bisect
import csv
import json
import random
import re
import string

from machinery.config import ConfigError, resolve
from machinery.data import load_jsonl

GPQA_COLUMNS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                "Incorrect Answer 3")

GPQA_HOWTO = ("GPQA-Diamond is gated, so it is not in data/: accept its terms at "
              "huggingface.co/datasets/Idavidrein/gpqa, download gpqa_diamond.csv and pass "
              "benchmarks=PATH/gpqa_diamond.csv")

LETTERS = string.ascii_uppercase

# The user turn after the question and its options; the chat template around it already asks for
# the final answer in \boxed{} (configs/templates/).
INSTRUCTION = "Give the letter of the correct option ({}) as your final answer, in \\boxed{{}}."


# Reading: each file into (id, question, [correct, other options...])

def is_choice_file(path):
    """A GPQA CSV, or a JSONL whose first row has "choices"."""
    path = resolve(path)
    if path.suffix != ".jsonl" or not path.is_file():
        return path.suffix == ".csv"
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict) and "choices" in json.loads(first)
    except json.JSONDecodeError:

        return False  # load_problems says which line is broken



def read_gpqa_csv(path):
    """[(id, question, [correct answer, incorrect 1, 2, 3])] from GPQA's CSV."""
    path = resolve(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; {GPQA_HOWTO}")
    with open(path, encoding="utf-8-sig", newline="") as f:  # utf-8-sig: a spreadsheet's BOM
        reader = csv.DictReader(f)
        missing = [c for c in GPQA_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(f"{path}: not GPQA's CSV, no column {missing[0]!r}; {GPQA_HOWTO}")
        problems, first_line = [], 2
        for row in reader:  # a quoted field may span lines: say the line the row starts on
            empty = [c for c in GPQA_COLUMNS if not (row[c] or "").strip()]
            if empty:
                raise ConfigError(f"{path}:{first_line}: empty {', '.join(empty)}")
            first_line = reader.line_num + 1
            qid = (row.get("Record ID") or "").strip() or f"{path.stem}-{len(problems)}"
            problems.append((qid, row["Question"].strip(),
                             [row[c].strip() for c in GPQA_COLUMNS[1:]]))
    return problems


def read_choices_jsonl(path):
    """[(id, question, [correct option, the others in file order])] from a choices JSONL."""
    problems = []
    for row in load_jsonl(path, required=("id", "question", "answer")):  # file:line on a bad row
        choices, where = row.get("choices"), f"{resolve(path)}: question {row['id']!r}"
        if (not isinstance(choices, list) or len(choices) < 2
                or not all(isinstance(c, str) and c.strip() for c in choices)):
            raise ConfigError(f"{where}: 'choices' must be two or more non-empty strings")
        if row["answer"] not in LETTERS[:len(choices)]:
            raise ConfigError(f"{where}: 'answer' must be a letter A-{LETTERS[len(choices) - 1]}")
        correct = LETTERS.index(row["answer"])
        problems.append((row["id"], row["question"].strip(), [choices[correct].strip()]
                         + [c.strip() for i, c in enumerate(choices) if i != correct]))
    return problems


# The question as the model sees it: options shuffled by (seed, question id)

def choice_problem(qid, question, options, seed):
    """A problem row from options (options[0] correct), shuffled by (seed, id) alone: a resumed or
    sliced run shows it as the full run did. option_order[i]: the source index of letter i."""
    order = list(range(len(options)))
    random.Random(f"{seed}:{qid}").shuffle(order)  # str seeds hash with SHA-512: stable anywhere
    shown = [options[i] for i in order]
    letters = LETTERS[:len(shown)]
    listed = "\n".join(f"({letter}) {text}" for letter, text in zip(letters, shown))
    names = ", ".join(letters[:-1]) + f" or {letters[-1]}"
    return {"id": qid, "problem": f"{question}\n\n{listed}\n\n{INSTRUCTION.format(names)}",
            "answer": letters[order.index(0)], "options": shown, "option_order": order,
            "shuffle_seed": seed}


def load_choices(path, seed):
    """Problem rows (choice_problem) from a GPQA CSV or a choices JSONL; ids must be unique."""
    read = read_gpqa_csv if resolve(path).suffix == ".csv" else read_choices_jsonl
    rows, seen = [], set()
    for qid, question, options in read(path):
        if qid in seen:
            raise ConfigError(f"{resolve(path)}: duplicate id {qid!r}")
        seen.add(qid)
        rows.append(choice_problem(qid, question, options, seed))
    return rows

# Grading: the letter the final answer names

# The model's own prose: the code it sent to the tool and the tool's replies are not its answer.
_TOOL_BLOCKS = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)|<tool_response>.*?"
                          r"(?:</tool_response>|\Z)", re.DOTALL)
# Up to three levels of braces: \boxed{\text{(C) } 2\,\mathrm{eV}}.
_BRACED = r"\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}"
_BOX = re.compile(r"\\(?:boxed|fbox)\s*" + _BRACED)
# The longest answer read after a cue: a sentence, or an option's text (GPQA's run to ~400 chars).
MAX_STATEMENT_CHARS = 1000
# Only the last cues are read: the final answer is among them, and a response looping on "the
# answer" thousands of times costs milliseconds, not seconds.
MAX_CUES = 64
_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|textit|mathrm|mathbf|mbox|emph|boxed)\s*"
                      r"\{([^{}]*)\}")
# A sentence that states the answer; what follows it is read as an answer.
_CUE = re.compile(r"(?:(?:final|correct|right|best)\s+)?(?<![</\w])answer\b"
                  r"(?:\s+to\s+(?:this|the)(?:\s+(?:question|problem))?)?[\"']?"
                  r"|(?:correct|right|best|final|my)\s+(?:option|choice|letter|pick)\b"
                  r"|\bI(?:\s+would|\s+will|'d|'ll)?\s+(?:choose|pick|select|say|go\s+with)\b",
                  re.IGNORECASE)
_CUE_LINK = re.compile(r"\s*(?:is|would\s+be|will\s+be|should\s+be|must\s+be|[:：=\-–])?\s*"
                       r"(?:either\s+)?"
                       r"(?:(?:option|choice|letter)\b)?\s*[:\"'`}*]*\s*", re.IGNORECASE)
# "C is correct", "(C) is the right answer", "Option C is the best choice".
_LETTER_IS_RIGHT = re.compile(r"(?:(?i:option|choice)\s+)?[(\[]?\b([A-Z])\b[)\]]?\s+"
                              r"(?i:is\s+(?:the\s+)?(?:correct|right|best|answer)\b)")
# Several letters joined: "A and C", "A, C", "(B) or (D)": an answer naming no single option.
_SEVERAL = re.compile(r"[(\[]?[A-Za-z][)\]]?\s*(?:,|/|&|\band\b|\bor\b)\s*[(\[]?[A-Za-z]"
                      r"(?:[)\]]|\b(?![a-z]))")
_END = r"(?=$|[\s.,;:!?)\]\"'`*])"
# The ways an answer names a letter, most explicit first.
_LETTER_FORMS = [re.compile(r"[(\[{]?([A-Za-z])[)\]}]?[.:]?$"),            # C, (C), C., [c], {C}
                 re.compile(r"[(\[{]([A-Za-z])[)\]}]" + _END),             # (C) 2mc^2
                 re.compile(r"([A-Z])[.):]" + _END),                       # C) 2mc^2, C. 2mc^2
                 re.compile(r"(?i:option|choice|letter)\s*[(\[]?([A-Za-z])[)\]]?" + _END)]
# After "the answer is": "C because ...", "c."; not "a bit", not "I think".
_LETTER_AFTER_CUE = re.compile(r"([A-Z])" + _END + r"|([a-z])(?=$|[.,;:!?)\]\"'`*])")


def _clean(text):
    """LaTeX text wrappers unwrapped, math dollars and Markdown emphasis dropped, spaces joined."""
    for _ in range(3):
        text = _WRAPPER.sub(r"\1", text)
    text = re.sub(r"\\[(\[)\]]|\$|\*\*|__|\\[,;!]", " ", text)
    return " ".join(text.split()).lstrip("#> ")  # a Markdown heading or quote: "#### C"



def _option_named(text, options):
    """The index of the option `text` names: its text, the text and more ("2 eV, since"; the
    longest such option), or the start of exactly one option ("2" of "2 eV"); else None."""
    said, *texts = [_clean(t).strip(" .\"'`").lower() for t in [text, *options]]
    if not said:
        return None
    starts = [(len(o), i) for i, o in enumerate(texts)
              if said == o or (o and said.startswith(o) and not said[len(o)].isalnum())]
    if starts:
        return max(starts)[1]
    begun = [i for i, o in enumerate(texts) if o.startswith(said) and not o[len(said)].isalnum()]
    return begun[0] if len(begun) == 1 else None


def _read_choice(text, options, after_cue=False):
    """The letter `text` names, "" if it is an answer naming no single valid option (two letters,
    a letter past the last option), None if it is not an answer at all."""
    text = _clean(text)
    letters = LETTERS[:len(options)]
    if _SEVERAL.match(text):
        return ""
    for form in _LETTER_FORMS:
        found = form.match(text)
        if found:
            return found.group(1).upper() if found.group(1).upper() in letters else ""
    named = _option_named(text, options)
    if named is not None:
        return letters[named]
    found = _LETTER_AFTER_CUE.match(text) if after_cue else None
    letter = found and (found.group(1) or found.group(2)).upper()
    return letter if letter and letter in letters else None


def chosen_letter(text, options):
    """The option letter of the model's final answer, or None (none, or no single valid option:
    read, not guessed). From its prose, tool calls left out; the statement written last wins
    (docs/design.md: the forms read)."""
    prose = _TOOL_BLOCKS.sub(" ", text)
    valid = LETTERS[:len(options)]
    statements = []  # (position, letter, or "" for an answer that names no single option)
    for box in _BOX.finditer(prose):
        statements.append((box.start(), _read_choice(box.group(1), options) or ""))

    # <answer>...</answer>: each closing tag with the last opening before it; one scan each way,
    # so a megabyte of unclosed tags costs what reading it does.
    opens = [tag.end() for tag in re.finditer("<answer>", prose)]
    for close in re.finditer("</answer>", prose):
        at = bisect.bisect_right(opens, close.start()) - 1
        inside = prose[opens[at]:close.start()] if at >= 0 else ""
        if at >= 0 and not _BOX.search(inside):
            statements.append((opens[at], _read_choice(inside, options) or ""))

    for cue in list(_CUE.finditer(prose))[-MAX_CUES:]:
        rest = prose[cue.end():cue.end() + MAX_STATEMENT_CHARS]
        rest = rest[_CUE_LINK.match(rest).end():]
        sentence = re.split(r"\n|(?<=[.!?])\s", rest, maxsplit=1)[0]
        statements.append((cue.start(), _read_choice(sentence, options, after_cue=True)))
    for right in _LETTER_IS_RIGHT.finditer(prose):
        if right.group(1) in valid:  # "X is the answer" of a compound X is no option's letter
            statements.append((right.start(), right.group(1)))

    lines = [line for line in prose.splitlines() if line.strip()]
    if lines:
        last = _read_choice(lines[-1], options)
        bracketed = set(re.findall(r"\(([A-Z])\)", lines[-1])) & set(valid)
        if last is None and len(bracketed) == 1:
            last = bracketed.pop()
        statements.append((prose.rfind(lines[-1]), last))

    statements = [(at, letter) for at, letter in statements if letter is not None]
    if not statements:
        return None
    return max(statements, key=lambda statement: statement[0])[1] or None
