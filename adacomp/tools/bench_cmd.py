"""``adacomp bench``: list the benchmarks of :mod:`adacomp.bench`, or run one.

    adacomp bench                          # every benchmark, its one-line summary and launch line
    adacomp bench NAME [args...]           # run adacomp.bench.NAME's main(args)
    adacomp run -np 2 -- adacomp bench dense        # under a launcher (torchrun -m adacomp.bench.dense,
                                                    # mpirun / horovodrun ... adacomp bench dense)

A benchmark is a module of :mod:`adacomp.bench` with a top-level ``main``; its docstring's first
paragraph's first sentence is its summary and its ``LAUNCH`` constant (with the comment beside it) its launch line.
The listing reads the sources and imports no benchmark.
"""
from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple


class Benchmark(NamedTuple):
    name: str
    summary: str
    launch: str
    note: str


def benchmarks() -> dict[str, Benchmark]:
    """Every benchmark module of :mod:`adacomp.bench`, by name (sorted)."""
    import adacomp.bench
    out: dict[str, Benchmark] = {}
    for info in sorted(pkgutil.iter_modules(adacomp.bench.__path__), key=lambda i: i.name):
        path = Path(adacomp.bench.__path__[0]) / f"{info.name}.py"
        if info.ispkg or not path.is_file():
            continue
        source = path.read_text()
        tree = ast.parse(source)
        if not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            continue  # a shared module (common, cost_shapes, cost_passes)
        doc = ast.get_docstring(tree) or ""
        summary = " ".join(doc.split("\n\n")[0].split())
        summary = summary.split(". ", 1)[0].rstrip(".") + "."  # its first sentence
        launch, note = f"adacomp bench {info.name}", ""
        for node in tree.body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "LAUNCH" for t in node.targets)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                launch = node.value.value
                line = source.splitlines()[node.lineno - 1]
                note = line.split("  # ", 1)[1].strip() if "  # " in line else ""
        out[info.name] = Benchmark(info.name, summary, launch, note)
    return out


def listing(found: dict[str, Benchmark]) -> str:
    lines = ["usage: adacomp bench NAME [args...]   (adacomp bench NAME --help: its options)", "",
             "Results files default to docs/results/ under the current directory: run from a checkout, or pass",
             "the benchmark's --out / --out-dir.", "", "benchmarks:"]
    width = max(len(n) for n in found) + 2
    for b in found.values():
        lines += textwrap.wrap(b.summary, 100, initial_indent=f"  {b.name:<{width}}", subsequent_indent=" " * (width + 2))
        lines.append(" " * (width + 2) + "$ " + b.launch + (f"    ({b.note})" if b.note else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    found = benchmarks()
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing(found))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in found:
        print(f"adacomp bench: unknown benchmark {name!r}; valid names: {', '.join(found)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"adacomp.bench.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
