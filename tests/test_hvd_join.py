"""Issue 31: Horovod's ``join()`` (a joined rank answers the others' allreduces with zeros until every
rank has joined; returns the rank that joined last) through ``import adacomp as hvd``: against real
``horovod.torch`` on 3 ranks (tests/hvd_join_worker.py), and on plain gloo workers."""
from __future__ import annotations

import torch

from tests._dist import run_workers
from tests.test_backend_horovod import _check, horovodrun, needs_horovod


@needs_horovod
def test_matches_horovod_torch() -> None:
    """Ranks join at different points; values, exception classes and join's answer equal to
    Horovod's, on adacomp's torch and Horovod backends."""
    _check(horovodrun(3, "tests/hvd_join_worker.py", timeout=300), "HVD_JOIN_OK", 3)


def _uneven() -> dict:
    import adacomp as hvd
    hvd.init()
    r = hvd.rank()
    out: dict = {}
    for step in range(3 - r):  # rank 0: 3 steps, rank 1: 2 (uneven data, as join is meant for)
        out[f"step {step}"] = hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum)
    if r == 0:
        try:
            hvd.alltoall(torch.ones(2))
        except hvd.HorovodInternalError as exc:
            out["alltoall"] = str(exc)
        out["mismatch-free after"] = hvd.allreduce(torch.ones(1))
    out["join"] = hvd.join()
    out["after join"] = hvd.allreduce(torch.ones(1), op=hvd.Sum)  # everyone is active again
    hvd.shutdown()
    return out


def test_joined_rank_contributes_zeros() -> None:
    res = run_workers(_uneven, 2, timeout=120)
    assert torch.equal(res[0]["step 0"], torch.full((2,), 3.0)) and torch.equal(res[1]["step 1"], torch.full((2,), 3.0))
    assert torch.equal(res[0]["step 2"], torch.full((2,), 1.0))  # rank 1 joined: its share is zero
    assert "Alltoall is not supported with Join" in res[0]["alltoall"]
    assert torch.equal(res[0]["mismatch-free after"], torch.full((1,), 0.5))  # Average still divides by 2
    assert [o["join"] for o in res] == [0, 0]
    assert all(torch.equal(o["after join"], torch.full((1,), 2.0)) for o in res)
