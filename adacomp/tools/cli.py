"""The ``adacomp`` command: ``run``, ``train``, ``netem``, ``plan``, ``bench``.

Each subcommand lives in its own module with ``main(argv) -> int``; this file only dispatches.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("adacomp.tools.launch", "start N local workers (or hand over to mpirun / horovodrun)"),
    "train": ("adacomp.tools.train", "train the built-in job from a config (default: configs/quickstart.yaml)"),
    "netem": ("adacomp.tools.netem_cmd", "emulate N hosts with capped bandwidth (root): up | set | down | status"),
    "plan": ("adacomp.tools.plan_cmd", "profile a model and print ByteComp's per-tensor compression plan"),
    "bench": ("adacomp.tools.bench_cmd", "list the benchmarks (adacomp.bench) or run one: adacomp bench NAME [args]"),
    "advise": ("adacomp.tools.advise", "probe the link, profile a model, rank methods against bf16 DDP (+ YAML)"),
}


def usage() -> str:
    lines = ["usage: adacomp <command> [args]", "", "commands:"]
    lines += [f"  {name:<7} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`adacomp <command> --help` for the command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"adacomp: unknown command {cmd!r}; valid commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = COMMANDS[cmd][0]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        print(f"adacomp: command {cmd!r} is not available in this build", file=sys.stderr)
        return 2
    from adacomp.errors import AdacompError
    try:
        return int(mod.main(rest) or 0)
    except AdacompError as exc:
        print(f"adacomp {cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
