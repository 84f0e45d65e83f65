"""machinery/choices.py: the letter a final answer names, in the formats models write it; the
options shuffled by (seed, question id); GPQA's CSV and the choices JSONL read, and wrong files
refused in one line."""
import csv
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from machinery.choices import (GPQA_COLUMNS, chosen_letter, choice_problem, is_choice_file,
                               load_choices, read_gpqa_csv)
from machinery.config import REPO, ConfigError
from machinery.data import SCIENCE_BENCHMARKS

OPTIONS = ["1 N", "2 N", "3 N", "4 N"]


# the letter of the final answer

@pytest.mark.parametrize("response", [
    r"The net force is 3 N, so \boxed{C}.",
    r"\boxed{(C)}",
    r"$\boxed{\text{C}}$",
    r"\boxed{ c }",
    r"\boxed{C) 3 N}",
    r"\boxed{3 N}",                         # the option's text
    r"\boxed{3}",                           # the start of exactly one option's text
    r"\[ \boxed{\mathrm{C}} \]",
    "<answer> \\boxed{C} </answer>",
    "<answer>C</answer>",
    "<answer>(C) 3 N</answer>",
    "Answer: C",
    "answer: c",
    "Answer - C",
    "**Answer:** C",
    "**Final Answer: C**",
    "Final answer: option C",
    "The answer is C because the forces add.",
    "The correct answer is (C).",
    "The best choice is C.",
    "The answer is 3 N.",
    'The JSON: {"answer": "C"}',
    "I choose C.",
    "I would go with option C.",
    "C is correct.",
    "(C) is the right answer.",
    "Option C is the best answer here.",
    "Reasoning...\n\nC",
    "Reasoning...\n(C)",
    "Reasoning...\n**C**",
    "Reasoning...\nC) 3 N",
    "Reasoning...\n3 N",
    "Reasoning...\nTherefore, (C).",
    "Reasoning...\n#### C",
    "### Final Answer\n\n**C**",
    r"\textbf{Answer:} C",
    "Answer:\nC",
    "Answer: \\(C\\)",
    "The answer is: 3 N (option C).",
    "Therefore C is the answer.",
    "I'd say C.",
    "Final Answer: The final answer is C. I hope it is correct.",
    "Answer：C",
    "Answer: {C}",
])
def test_every_common_answer_format_names_its_letter(response):
    assert chosen_letter(response, OPTIONS) == "C"


@pytest.mark.parametrize("response, letter", [
    # the statement written last is the final answer
    (r"\boxed{A}... wait, the forces add. \boxed{C}", "C"),
    (r"The answer is A. No: recomputing, Answer: \boxed{B}", "B"),
    (r"\boxed{D}" + "\nAnswer: B", "B"),
    ("If the answer were A we would see 1 N. It is not. The answer is D.", "D"),
    # "is a bit", "is not", "to this": sentences about an answer, not answers
    ("The answer is a bit subtle. The answer is not A. The answer to this is D.", "D"),
    # the tool's code and replies are not the model's answer
    ("<tool_call>\nprint('Answer: A')\n</tool_call>\n<tool_response>\nAnswer: A\n"
     "</tool_response>\nSo the answer is B.", "B"),
    # "I only" is an option's text, not the letter I
    ("Answer: II only", "B"),
])
def test_the_final_statement_wins_and_prose_is_not_taken_for_a_letter(response, letter):
    options = ["I only", "II only", "I and II", "neither"] if "only" in response else OPTIONS
    assert chosen_letter(response, options) == letter


@pytest.mark.parametrize("response", [
    r"\boxed{A or C}",
    r"\boxed{A, C}",
    r"\boxed{E}",                                  # past the last of four options
    r"\boxed{5 N}",                                # no option's text
    "Answer: A and C",
    "The answer is (B) or (D).",
    r"\boxed{C} ... on reflection the answer is either A or B.",
    "I am not sure.",
    "",
    "The answer is a matter of debate.",
    "<tool_call>\nprint('Answer: C')\n</tool_call>",
])
def test_an_answer_naming_no_single_valid_option_is_refused(response):
    assert chosen_letter(response, OPTIONS) is None


def test_a_box_whose_content_is_another_number_is_not_matched_to_a_longer_option():
    # "1" begins "1 N" only, not "10 N": the option must start with it at a word boundary
    assert chosen_letter(r"\boxed{1}", ["10 N", "1 N", "100 N"]) == "B"
    assert chosen_letter(r"\boxed{10}", ["10 N", "1 N", "100 N"]) == "A"
    # two options begin with "2": no single option named
    assert chosen_letter(r"\boxed{2}", ["2 N", "2 kg", "3 N"]) is None


# shuffling

def test_the_order_is_drawn_from_seed_and_id_and_the_gold_letter_follows_the_correct_option():
    options = ["right", "wrong 1", "wrong 2", "wrong 3"]
    row = choice_problem("q7", "Which?", options, seed=3)
    assert row == choice_problem("q7", "Which?", options, seed=3)  # reproducible
    assert sorted(row["options"]) == sorted(options)
    assert row["options"][ord(row["answer"]) - ord("A")] == "right"
    assert [options[i] for i in row["option_order"]] == row["options"]
    assert row["shuffle_seed"] == 3
    assert f"({row['answer']}) right\n" in row["problem"] + "\n"
    assert row["problem"].startswith("Which?\n\n(A) ")
    assert "(A, B, C or D)" in row["problem"] and "\\boxed{}" in row["problem"]
    # Over seeds, every position holds the correct option: no letter is always right.
    golds = Counter(choice_problem("q7", "Which?", options, seed=s)["answer"] for s in range(200))
    assert set(golds) == set("ABCD") and min(golds.values()) > 25


def test_a_question_keeps_its_order_whatever_the_file_order_slice_or_process(tmp_path):
    rows = [json.loads(line) for line in
            (REPO / SCIENCE_BENCHMARKS["mmlu_science"]).read_text().splitlines()]
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows[:20])))
    by_id = {r["id"]: r for r in load_choices(reordered, seed=0)}
    for row in load_choices(SCIENCE_BENCHMARKS["mmlu_science"], seed=0)[:20]:
        assert by_id[row["id"]] == row
    # The draw is string-seeded (SHA-512), not hash()-seeded: the same in a process with another
    # PYTHONHASHSEED.
    here = choice_problem("q", "?", list("abcd"), seed=0)["option_order"]
    code = ("from machinery.choices import choice_problem; "
            "print(choice_problem('q', '?', list('abcd'), seed=0)['option_order'])")
    there = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True).stdout
    assert there.strip() == str(here)
    other_seed = load_choices(reordered, seed=1)
    assert [r["option_order"] for r in other_seed] != [by_id[r["id"]]["option_order"]
                                                        for r in other_seed]


def test_the_bundled_science_set_loads_whole_with_golds_spread_over_the_letters():
    path = SCIENCE_BENCHMARKS["mmlu_science"]
    assert is_choice_file(path) and not is_choice_file(REPO / "data/aime24.jsonl")
    rows = load_choices(path, seed=0)
    assert len(rows) == 346 and len({r["id"] for r in rows}) == 346
    assert all(len(r["options"]) == 4 for r in rows)
    letters = Counter(r["answer"] for r in rows)
    assert set(letters) == set("ABCD") and min(letters.values()) > 50
    assert "mmlu_college_science.jsonl" in (REPO / "data/SOURCES.md").read_text()


# GPQA's CSV and the JSONL: what is read, and what is refused

def write_gpqa(path, rows, columns=("Pre-Revision Question",) + GPQA_COLUMNS + ("Record ID",)):
    with open(path, "w", encoding="utf-8-sig", newline="") as f:  # a spreadsheet's BOM
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


GPQA_ROW = {"Pre-Revision Question": "old", "Question": "Which particle\nis charged?",
            "Correct Answer": "electron", "Incorrect Answer 1": "neutron",
            "Incorrect Answer 2": "photon", "Incorrect Answer 3": "neutrino",
            "Record ID": "recABC"}


def test_gpqa_csv_reads_the_official_columns_and_the_record_id(tmp_path):
    path = write_gpqa(tmp_path / "gpqa_diamond.csv",
                      [GPQA_ROW, {**GPQA_ROW, "Record ID": "", "Question": "Second?"}])
    assert is_choice_file(path)
    assert read_gpqa_csv(path) == [
        ("recABC", "Which particle\nis charged?", ["electron", "neutron", "photon", "neutrino"]),
        ("gpqa_diamond-1", "Second?", ["electron", "neutron", "photon", "neutrino"])]
    row = load_choices(path, seed=0)[0]
    assert row["options"][ord(row["answer"]) - ord("A")] == "electron"
    assert row["problem"].startswith("Which particle\nis charged?\n\n(A) ")


def write_choices(path, row):
    good = {"id": "ok", "question": "q", "choices": ["x", "y"], "answer": "B"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")


# Each refusal: (the file's name, what writes it, what the one line names after the file's path)
CHOICE_REFUSALS = [
    ("mine.csv", lambda path: write_gpqa(path, [GPQA_ROW], columns=GPQA_COLUMNS[:3]),
     ["'Incorrect Answer 2'", "gpqa_diamond.csv"]),
    ("gpqa_diamond.csv", lambda path: path.write_text(""), ["'Question'"]),
    # line 4: the header, the first row over two lines (its question holds a newline), then it
    ("gpqa_diamond.csv", lambda path: write_gpqa(path, [GPQA_ROW, {**GPQA_ROW,
                                                                    "Incorrect Answer 3": " "}]),
     [":4: ", "Incorrect Answer 3"]),
    ("missing.csv", lambda path: None, ["huggingface.co/datasets/Idavidrein/gpqa"]),
    ("mine.jsonl", lambda path: write_choices(path, {"id": "a", "question": "q",
                                                     "choices": ["x"], "answer": "A"}),
     ["question 'a'", "'choices'"]),
    ("mine.jsonl", lambda path: write_choices(path, {"id": "a", "question": "q",
                                                     "choices": ["x", "y"], "answer": "C"}),
     ["question 'a'", "'answer'"]),
    ("mine.jsonl", lambda path: write_choices(path, {"id": "a", "question": "q",
                                                     "choices": ["x", "y"], "answer": 0}),
     [":2: ", "'answer'"]),
    ("mine.jsonl", lambda path: write_choices(path, {"id": "ok", "question": "q",
                                                     "choices": ["x", "y"], "answer": "A"}),
     ["'ok'"]),
]


@pytest.mark.parametrize("name, write, named", CHOICE_REFUSALS)
def test_a_bad_choice_file_is_refused_in_one_line_naming_the_file_and_the_part(tmp_path, name,
                                                                               write, named):
    path = tmp_path / name
    write(path)
    with pytest.raises(ConfigError) as refused:
        load_choices(path, seed=0)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert all(part in message for part in named), message


def test_degenerate_responses_are_still_read_to_their_final_answer():
    # RL samples loop: thousands of unclosed tags, cues or boxes must neither hang nor mislead.
    assert chosen_letter("<answer>" * 5000 + "Answer: B", OPTIONS) == "B"
    assert chosen_letter("</answer>" * 5000 + "<answer>(D)</answer>", OPTIONS) == "D"
    assert chosen_letter("the answer is " * 5000 + r"\boxed{D}", OPTIONS) == "D"
    assert chosen_letter("\\boxed{" * 5000 + "C", OPTIONS) is None
