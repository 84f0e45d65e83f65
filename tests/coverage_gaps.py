"""The lines of the method files that no run executed, per file and function: what docs/coverage.md
classifies.

    python -m coverage json -o runs/coverage.json   # from .coverage, with its functions
    python tests/coverage_gaps.py [runs/coverage.json] [--source]

--source prints each missed line's text too. Not a test (no test_ prefix): a reading aid, run by
hand.
"""
import json
import sys
from pathlib import Path

FILES = ("rl.py", "rollout.py", "sft.py", "eval.py", "machinery/distributed.py",
         "tools/gpu_check.py")


def main(argv):
    show_source = "--source" in argv
    report = Path(next((a for a in argv if a != "--source"), "runs/coverage.json"))
    measured = json.loads(report.read_text())["files"]
    total = 0
    for name in FILES:
        if name not in measured:
            print(f"{name}: not measured")
            continue
        missing, lines = measured[name]["missing_lines"], Path(name).read_text().splitlines()
        total += len(missing)
        print(f"\n{name}: {len(missing)} of {measured[name]['summary']['num_statements']} "
              "statements not run")
        for function, data in measured[name]["functions"].items():
            if data["missing_lines"]:
                print(f"  {function or '<module>'}: {len(data['missing_lines'])}  "
                      f"{data['missing_lines']}")
            for line in data["missing_lines"] if show_source else []:
                print(f"      {line:5d}  {lines[line - 1].strip()}")
    print(f"\ntotal: {total} statements not run in {', '.join(FILES)}")


if __name__ == "__main__":
    main(sys.argv[1:])
