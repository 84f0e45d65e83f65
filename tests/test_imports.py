"""The two places of the repo: the method at the top level, the machinery beneath it. Arrows point
down only: the package never imports a top-level file, and a script imports no other script
sideways."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOP_LEVEL = {p.stem for p in REPO.glob("*.py")}
SCRIPTS = {"rl", "sft", "eval"}  # what two of them share lives in the package


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
    for name in ("grpo_roc", "rollout", "reward", "executor", "rl", "sft", "eval"):
        assert not imported_modules(REPO / f"{name}.py") & {"tools", "bench", "gpu_check"}, name
