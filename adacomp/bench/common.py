"""What the benchmarks share: a torch process group under any launcher, the launch of a
benchmark's own workers, the command line a result records, and results files that say how they
were made. The step-timing loop they share is :func:`adacomp.tools.stepclock.time_steps`."""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from adacomp.engine.metrics import StepStats

RESULTS = "docs/results"
"""Default folder of the results files, relative to the current directory (run from a checkout)."""


def ensure_torch_group() -> None:
    """DDP baselines need torch.distributed; under mpirun / horovodrun build a gloo group from the
    launcher's rank variables (MASTER_ADDR/PORT default to localhost:29511)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    import adacomp
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("gloo", rank=adacomp.rank(), world_size=adacomp.size())


def module_command(name: str) -> list[str]:
    """The command that runs benchmark ``name`` in a fresh process (``python -m adacomp.bench.NAME``)."""
    return [sys.executable, "-m", f"adacomp.bench.{name}"]


def bench_command(name: str, argv: Sequence[str] | None, drop: Sequence[str] = ()) -> str:
    """``adacomp bench NAME args`` as the user typed it (``argv`` None: this process's arguments),
    without the internal flags in ``drop`` (``--worker``): what a results file records."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["adacomp bench", name, *(a for a in args if a not in drop)])


def launcher() -> str:
    """The launcher this process was started by ("" when none)."""
    env = os.environ
    return ("adacomp run" if env.get("ADACOMP_BACKEND") == "torch" else
            "mpirun" if "OMPI_COMM_WORLD_RANK" in env else
            "horovodrun" if "HOROVOD_RANK" in env else "torchrun" if "TORCHELASTIC_RUN_ID" in env else "")


def worker_or_spawn(worker: Callable[[], object], np: int, name: str, argv: Sequence[str]) -> int:
    """Benchmarks that launch themselves: under a launcher (torchrun, mpirun, horovodrun, ``adacomp
    run``) run ``worker()`` here; otherwise start ``np`` copies of ``python -m adacomp.bench.NAME
    argv`` with ``adacomp run``."""
    from adacomp.backends import detect
    from adacomp.tools.launch import run_local
    if detect() != "local":
        worker()
        return 0
    return run_local([*module_command(name), *argv], np)


def last_stats(opt: Any) -> StepStats:
    """``opt.last_stats`` of an optimizer that has stepped (raises if it has not)."""
    st: StepStats | None = opt.last_stats
    if st is None:
        raise RuntimeError("the optimizer has no step statistics yet: read them after a step")
    return st


def add_mlp_arguments(ap: argparse.ArgumentParser, width: int, depth: int, steps: int) -> None:
    """The model and schedule options of the benchmarks that time an MLP's arms in alternating blocks."""
    ap.add_argument("--width", type=int, default=width)
    ap.add_argument("--depth", type=int, default=depth)
    ap.add_argument("--inputs", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=steps, help="measured steps per arm")
    ap.add_argument("--block", type=int, default=5, help="steps per alternating block")


def start_mlp_job(args: argparse.Namespace) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """For the options of :func:`add_mlp_arguments`: start adacomp and a torch group (any launcher),
    draw this rank's fixed batch (its own generator) and seed torch with 0 so the models built next
    are identical on every rank. Returns (rank, world, inputs, labels)."""
    import adacomp
    adacomp.init()
    ensure_torch_group()
    rank, world = adacomp.rank(), adacomp.size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.inputs, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    torch.manual_seed(0)
    return rank, world, x, y


def alternating_blocks(arms: Mapping[str, Callable[[], object]], steps: int, block: int,
                       warmup: int = 3) -> dict[str, list[float]]:
    """Each arm's step timed (:func:`~adacomp.tools.stepclock.time_steps`) in blocks of ``block``
    steps, the arms taking turns block by block so machine noise hits all of them, until the first
    arm has ``steps``; every arm's ``warmup`` untimed steps run right before its first block."""
    from adacomp.tools.stepclock import time_steps
    times: dict[str, list[float]] = {name: [] for name in arms}
    first = next(iter(arms))
    while len(times[first]) < steps:
        for name, step in arms.items():
            times[name] += time_steps(step, block, 0 if times[name] else warmup)
    return times


def machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {datetime.date.today().isoformat()}")


def write_result(path: str | Path, title: str, lines: list[str], command: str, self_launched: bool = False) -> None:
    """Write a markdown result headed by the command that produced it (``command``:
    :func:`bench_command`; the launcher, if any, is prefixed unless the benchmark started its
    workers itself: then ``command`` is what the user typed)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    via = "" if self_launched else launcher()
    header = [f"# {title}", "", f"Produced by: `{via + ' ... ' if via else ''}{command}`",
              f"Machine: {machine()}", ""]
    p.write_text("\n".join(header + lines) + "\n")
    print(f"wrote {p}")
