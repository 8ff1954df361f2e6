"""``adacomp bench``: list the benchmark scripts and the launch line for each."""
from __future__ import annotations

import ast
import pathlib

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


def main(argv: list[str]) -> int:
    if not SCRIPTS.is_dir():
        print("benchmark scripts live in the source tree's scripts/ folder (not installed)")
        return 1
    for path in sorted(SCRIPTS.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        print(f"{path.name:<28} {doc.splitlines()[0] if doc else ''}")
    print("\nlaunch any of them with: adacomp run -np 2 -- python scripts/NAME.py  "
          "(or torchrun / mpirun / horovodrun, see scripts/run_*.sh)")
    return 0
