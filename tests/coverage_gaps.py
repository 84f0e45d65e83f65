"""The lines of the method files that no run executed, per file and function: what docs/coverage.md
classifies.

    python tests/coverage_gaps.py [DATA_FILE ...] [--source]

DATA_FILE: coverage data files (default .coverage), e.g. the CPU suite's (`pytest --cov`,
docs/coverage.md) and tools/gpu_check.py's (`coverage run -m tools.gpu_check`); a line counts as run
if any of them ran it. Each file is read from the path the data recorded, so data from another
checkout is read against that checkout's source. --source prints each missed line's text too. Not a
test (no test_ prefix): a reading aid, run by hand.
"""
import ast
import sys
from pathlib import Path

import coverage

FILES = ("rl.py", "rollout.py", "sft.py", "eval.py", "machinery/distributed.py",
         "tools/gpu_check.py")


def functions_by_line(source):
    """line -> qualified name of the innermost def/class holding it ('<module>' outside any)."""
    owner = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                for line in range(child.lineno, child.end_lineno + 1):
                    owner[line] = name
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return owner


def main(argv):
    show_source = "--source" in argv
    paths = [a for a in argv if a != "--source"] or [".coverage"]
    cov = coverage.Coverage(data_file=paths[0], config_file=False)
    cov.load()
    for extra in paths[1:]:
        data = coverage.CoverageData(extra)
        data.read()
        cov.get_data().update(data)
    files = cov.get_data().measured_files()
    root = next(Path(f).parent for f in files if Path(f).name == "rl.py"
                and Path(f).parent.name != "tests")
    measured = {Path(f).name: f for f in files if Path(f).parent == root and Path(f).name in FILES}
    total = 0
    for name in FILES:
        if name not in measured:
            print(f"{name}: not measured")
            continue
        _, statements, _, missing, _ = cov.analysis2(measured[name])
        source = Path(measured[name]).read_text()
        lines, owner = source.splitlines(), functions_by_line(source)
        total += len(missing)
        print(f"\n{name}: {len(missing)} of {len(statements)} statements not run")
        by_function = {}
        for line in missing:
            by_function.setdefault(owner.get(line, "<module>"), []).append(line)
        for function, missed in by_function.items():
            print(f"  {function}: {len(missed)}  {missed}")
            if show_source:
                for line in missed:
                    print(f"      {line:5d}  {lines[line - 1].strip()}")
    print(f"\ntotal: {total} statements not run in {', '.join(FILES)}")


if __name__ == "__main__":
    main(sys.argv[1:])
