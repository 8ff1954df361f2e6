"""HorovodBackend on real ``horovodrun --gloo -np N`` processes; no mocked collectives.

Skipped when Horovod is not installed (``make horovod`` builds it; ``make test`` does so first).
"""
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


def horovod_missing() -> str | None:
    """Why Horovod cannot run here, or None when it can."""
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch as hvd; assert hvd.gloo_built()"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return ("horovod.torch is not importable (build it with `make horovod`): "
                + (probe.stderr.strip().splitlines() or ["?"])[-1])
    if find_horovodrun() is None:
        return "horovodrun not found next to the interpreter or on PATH; run `make horovod`"
    return None


def find_horovodrun() -> str | None:
    here = Path(sys.executable).parent / "horovodrun"
    return str(here) if here.exists() else shutil.which("horovodrun")


def horovodrun(np: int, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """``horovodrun --gloo -np N python ARGS`` with the repository importable, as any user."""
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [find_horovodrun() or "horovodrun", "--gloo", "-np", str(np), "-H", f"localhost:{np}",
           sys.executable, *args]
    return run_launcher(cmd, str(ROOT), env, timeout)


_MISSING = horovod_missing()
needs_horovod = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


def test_missing_horovod_names_the_make_target() -> None:
    """Without horovod.torch the backend fails at construction (not import) with the install command."""
    code = ("import sys; sys.modules['horovod'] = None; sys.modules['horovod.torch'] = None\n"
            "import adacomp.backends.horovod\n"
            "from adacomp.backends import create\n"
            "try:\n    create('horovod')\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ERR" in proc.stdout and "make horovod" in proc.stdout, proc.stdout


def _check(proc: subprocess.CompletedProcess, marker: str, count: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"horovodrun exited {proc.returncode}\n{out[-4000:]}"
    assert out.count(marker) == count, f"expected {count} x {marker!r}\n{out[-4000:]}"


@needs_horovod
def test_collectives() -> None:
    """allreduce (sum/average, int, fp16/bf16), overlapping handles, allgather with differing
    first dims (sizes given and exchanged, an empty rank), broadcast from every root, objects;
    the worker builds its backend with ``auto``, so this also checks launcher detection."""
    _check(horovodrun(2, str(WORKER), "horovod"), "BACKEND_OK", 2)


@pytest.mark.slow
@needs_horovod
def test_reference_matches_ddp() -> None:
    """Issue 2's reference: adacomp dense (compressor none + allreduce) on the Horovod backend vs
    DDP, 2 processes, same CNN / seeds / shards, 20 steps, one fused bucket and per-tensor buckets."""
    from tests._dist import free_port
    proc = horovodrun(2, str(WORKER), "reference", "horovod", str(free_port()), "25,0", timeout=300)
    _check(proc, "REFERENCE_DIFF", 4)


@needs_horovod
def test_timeout_raises_instead_of_hanging() -> None:
    """A rank that skips a collective makes the others fail with CommunicationError after timeout_s."""
    _check(horovodrun(2, str(WORKER), "timeout", "horovod"), "TIMEOUT_OK", 1)
