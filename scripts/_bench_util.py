"""Small helpers shared by the benchmark scripts: a torch process group under any launcher and
results files that say how they were made."""
from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import torch


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


def machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {datetime.date.today().isoformat()}")


def write_result(path: str, title: str, lines: list[str]) -> None:
    """Write a markdown result with the exact command line that produced it."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    cmd = " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    launcher = "adacomp run" if os.environ.get("ADACOMP_BACKEND") == "torch" else (
        "mpirun" if "OMPI_COMM_WORLD_RANK" in os.environ else
        "horovodrun" if "HOROVOD_RANK" in os.environ else "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "")
    header = [f"# {title}", "", f"Produced by: `{launcher + ' ... ' if launcher else ''}python {cmd}`",
              f"Machine: {machine()}", ""]
    p.write_text("\n".join(header + lines) + "\n")
    print(f"wrote {p}")
