"""The two places of the repo: the method at the top level, the machinery beneath it. Arrows point
down only: the package never imports a top-level file, and a script imports no other script
sideways. The method's seven files are its reading path: within their budget, and paragraphed."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOP_LEVEL = {p.stem for p in REPO.glob("*.py")}
SCRIPTS = {"rl", "sft", "eval"}  # what two of them share lives in the package
READING_PATH = ("grpo_roc", "rollout", "reward", "executor", "rl", "sft", "eval")


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
