"""The two places of the repo: the method at the top level, the machinery beneath it. Arrows point
down only: the package never imports a top-level file, and a script imports no other script
sideways. The method's seven files are its reading path: within their budget, and paragraphed; the
house as a whole holds its line budget (issue 46)."""
import ast
import io
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOP_LEVEL = {p.stem for p in REPO.glob("*.py")}
SCRIPTS = {"rl", "sft", "eval"}  # what two of them share lives in the package
READING_PATH = ("grpo_roc", "rollout", "reward", "executor", "rl", "sft", "eval")

# The house's budget: lines and code lines (non-blank, not comment, not docstring). A ratchet at
# what the house holds now; issue 46's target is machinery 5,800 / 4,000, outside tests
# 12,000 / 8,000, tests 9,500: lower these as cuts land, never raise them.
MACHINERY_LINES, MACHINERY_CODE_LINES = 5_710, 4_030
OUTSIDE_TESTS_LINES, OUTSIDE_TESTS_CODE_LINES = 11_760, 8_015
TESTS_LINES = 9_420
# where no source of the repo lives: the virtual environment, run outputs, caches
NOT_SOURCE = {"tests", "out", "runs", "tmp", "htmlcov"}


def imported_modules(path):
    """The first component of every module a file imports, at any depth (function-level imports
    too)."""
    found = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def wrong_way_imports(package_dir):
    """{file: top-level modules it imports} for the package's files that import the level above."""
    wrong = {}
    for path in sorted(Path(package_dir).glob("*.py")):
        up = imported_modules(path) & TOP_LEVEL
        if up:
            wrong[path.name] = sorted(up)
    return wrong


def test_the_package_never_imports_a_top_level_file():
    assert wrong_way_imports(REPO / "machinery") == {}


def test_a_wrong_way_import_is_caught(tmp_path):
    (tmp_path / "helper.py").write_text("import os\n\n\ndef f():\n"
                                        "    from rollout import generate\n")
    assert wrong_way_imports(tmp_path) == {"helper.py": ["rollout"]}


def test_no_script_imports_another_script():
    for script in sorted(SCRIPTS):
        assert imported_modules(REPO / f"{script}.py") & (SCRIPTS - {script}) == set(), script


def test_the_tools_stand_apart_from_the_method():
    """plan and gpu_check are tools: no file of the method's reading path imports them."""
    for name in READING_PATH:
        assert not imported_modules(REPO / f"{name}.py") & {"tools", "bench", "gpu_check"}, name


def non_blank_lines(text):
    return sum(1 for line in text.splitlines() if line.strip())


def test_the_reading_path_stays_within_its_budget():
    """At most 2,700 non-blank lines and 170K characters over the seven files, rl.py at most 600
    non-blank lines. Blank lines are free: a budget is never met by running paragraphs together
    (the next test); what does not fit moves to machinery/ or tools/."""
    texts = {name: (REPO / f"{name}.py").read_text() for name in READING_PATH}
    assert sum(non_blank_lines(text) for text in texts.values()) <= 2700
    assert sum(len(text) for text in texts.values()) <= 170_000
    assert non_blank_lines(texts["rl"]) <= 600


def unparagraphed_functions(path, longest=25):
    """The functions of `path` of `longest` lines or more whose code (after the docstring) has
    no blank line between its paragraphs."""
    text = Path(path).read_text()
    lines = text.splitlines()
    walls = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.end_lineno - node.lineno + 1 < longest:
            continue
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        code = lines[body[0].lineno - 1:node.end_lineno]
        if all(line.strip() for line in code):
            walls.append(node.name)
    return walls


def test_every_long_function_of_the_reading_path_is_paragraphed():
    for name in READING_PATH:
        assert unparagraphed_functions(REPO / f"{name}.py") == [], name


def test_a_wall_of_code_is_caught(tmp_path):
    wall = "def wall():\n    \"\"\"Doc.\n\n    more.\"\"\"\n" + "    x = 1\n" * 30
    paragraphed = wall + "\n    return x\n"
    (tmp_path / "a.py").write_text(wall + "def short():\n    return 1\n")
    (tmp_path / "b.py").write_text(paragraphed)
    assert unparagraphed_functions(tmp_path / "a.py") == ["wall"]
    assert unparagraphed_functions(tmp_path / "b.py") == []


def code_lines(text):
    """The lines of `text` that hold code: a token other than a comment, and not a docstring (the
    first string statement of a module, class or function)."""
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if ast.get_docstring(node, clean=False) is not None:
                first = node.body[0]
                docstrings.update(range(first.lineno, first.end_lineno + 1))

    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
              tokenize.ENCODING, tokenize.ENDMARKER}
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in layout:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def house_counts(repo):
    """{place: (lines, code lines)} for machinery/, the Python outside tests/, and tests/."""
    places = {"machinery": [], "outside tests": [], "tests": []}
    for path in sorted(Path(repo).rglob("*.py")):
        top = path.relative_to(repo).parts[0]
        if top == "tests":
            places["tests"].append(path)
        elif not top.startswith(".") and top not in NOT_SOURCE:
            places["outside tests"].append(path)
            if top == "machinery":
                places["machinery"].append(path)
    counts = {}
    for place, paths in places.items():
        texts = [path.read_text() for path in paths]
        counts[place] = (sum(len(text.splitlines()) for text in texts),
                         sum(code_lines(text) for text in texts))
    return counts


def test_the_house_stays_within_its_line_budget():
    """Issue 46: what does not fit the reading path must not pile up beneath it. Blank lines and
    comments count in lines, not in code lines; the budget is met by cutting, not by squeezing
    (the paragraph rule holds in machinery/ too)."""
    counts = house_counts(REPO)
    limits = {"machinery": (MACHINERY_LINES, MACHINERY_CODE_LINES),
              "outside tests": (OUTSIDE_TESTS_LINES, OUTSIDE_TESTS_CODE_LINES),
              "tests": (TESTS_LINES, float("inf"))}
    report = "; ".join(f"{place} {lines} lines (<= {limits[place][0]}), {code} code lines"
                       + (f" (<= {limits[place][1]})" if place != "tests" else "")
                       for place, (lines, code) in counts.items())
    print(report)
    assert all(lines <= limits[place][0] and code <= limits[place][1]
               for place, (lines, code) in counts.items()), report


def test_code_lines_leave_out_blanks_comments_and_docstrings(tmp_path):
    (tmp_path / "machinery").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "machinery" / "m.py").write_text(
        '"""Module doc,\ntwo lines."""\n\n# a comment\nX = """not a\ndocstring"""\n\n\n'
        'def f():\n    """Doc."""\n    return X  # why\n')
    (tmp_path / "tests" / "test_m.py").write_text("def test():\n    pass\n")
    (tmp_path / "top.py").write_text("import os\n")
    assert house_counts(tmp_path) == {"machinery": (11, 4), "outside tests": (12, 5),
                                      "tests": (2, 2)}


def test_every_long_function_of_the_machinery_is_paragraphed():
    walls = {path.name: unparagraphed_functions(path)
             for path in sorted((REPO / "machinery").glob("*.py"))}
    assert {name: found for name, found in walls.items() if found} == {}
