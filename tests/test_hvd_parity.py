"""Issue 31: behaviours of Horovod 0.28.1's own torch tests, run through ``import adacomp as hvd``
next to real ``horovod.torch`` on 2 ranks (tests/hvd_parity_worker.py): results and exception
classes equal, on the torch and Horovod backends; the MPI backend against locally computed results."""
from __future__ import annotations

import pytest

from tests.test_backend_horovod import _check, horovodrun, needs_horovod
from tests.test_backend_mpi import mpirun

WORKER = "tests/hvd_parity_worker.py"


@needs_horovod
def test_matches_horovod_torch() -> None:
    """Every dtype through every raw collective; 17 cross-rank mismatches (same exception class on
    every rank, the next collective works) and a duplicate name in flight; gradients through the six
    differentiable collectives. adacomp on the torch and on the Horovod backend."""
    _check(horovodrun(2, WORKER, timeout=300), "HVD_PARITY_OK", 2)


@pytest.mark.slow
def test_mpi_backend() -> None:
    proc = mpirun(2, WORKER, "mpi", timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("HVD_PARITY_OK") == 2, proc.stdout[-3000:]
