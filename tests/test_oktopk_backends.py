"""Ok-Topk's sparse allreduce on gloo (torch), MPI (mpirun) and Horovod (horovodrun): the same
parameters, bit for bit, after 5 steps on 2 ranks (threshold estimation, reuse and re-balancing)."""
from __future__ import annotations

import re

import pytest

from tests._dist import run_workers
from tests.oktopk_worker import run
from tests.test_backend_horovod import horovodrun, needs_horovod
from tests.test_backend_mpi import mpirun

WORKER = "tests/oktopk_worker.py"


def _digests(out: str) -> list[str]:
    return re.findall(r"OKTOPK_DIGEST rank=\d+ ([0-9a-f]+)", out)


@pytest.fixture(scope="module")
def gloo_digest() -> str:
    ds = run_workers(run, 2, "torch")
    assert len(set(ds)) == 1
    return ds[0]


def test_mpi_matches_gloo(gloo_digest: str) -> None:
    proc = mpirun(2, WORKER, "mpi")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert _digests(out) == [gloo_digest] * 2, out[-4000:]


@needs_horovod
def test_horovod_matches_gloo(gloo_digest: str) -> None:
    proc = horovodrun(2, WORKER, "horovod")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert _digests(out) == [gloo_digest] * 2, out[-4000:]
