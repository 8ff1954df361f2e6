"""Issue 31: Horovod's process sets (``add_process_set`` / ``remove_process_set`` / ``ProcessSet`` /
``process_set=`` on every op and on ``DistributedOptimizer``) through ``import adacomp as hvd``, on 3
ranks: next to real ``horovod.torch`` under horovodrun (tests/hvd_sets_worker.py: values and exception
classes equal), the MPI backend under mpirun against computed values, and the torch backend in
plain gloo workers (broadcast_parameters / broadcast_optimizer_state on a set, init(process_sets=))."""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_workers
from tests.test_backend_horovod import _check, horovodrun, needs_horovod
from tests.test_backend_mpi import mpirun

WORKER = "tests/hvd_sets_worker.py"


@needs_horovod
def test_matches_horovod_torch() -> None:
    """Identity, duplicates, every collective on a set of ranks [0, 2] (sync, async, in-place,
    grouped, sparse, gradients), a non-member's ValueError, a mismatch inside the set, an
    overlapping set, DistributedOptimizer(process_set=), removal and id reuse."""
    _check(horovodrun(3, WORKER, timeout=400), "HVD_SETS_OK", 3)


@pytest.mark.slow
def test_mpi_backend() -> None:
    proc = mpirun(3, WORKER, "mpi", timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("HVD_SETS_OK") == 3, proc.stdout[-3000:]


def _broadcast_helpers() -> dict:
    import adacomp as hvd
    odd, even = hvd.ProcessSet([1]), hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[odd, even])  # Horovod's static sets
    r = hvd.rank()
    out: dict = {"ids": (odd.process_set_id, even.process_set_id), "sizes": (odd.size(), even.size())}
    torch.manual_seed(r)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    if even.included():
        hvd.broadcast_parameters(model.state_dict(), root_rank=2, process_set=even)
        hvd.broadcast_optimizer_state(opt, root_rank=2, process_set=even)
        out["object"] = hvd.broadcast_object(f"from {r}", root_rank=2, process_set=even)
        try:
            hvd.broadcast_parameters(model.state_dict(), root_rank=1, process_set=even)
        except ValueError as exc:
            out["bad root"] = str(exc)
    else:
        try:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0, process_set=even)
        except ValueError as exc:
            out["non-member"] = str(exc)
    out["weight"] = model.weight.detach().clone()
    out["state steps"] = sorted(float(s["step"]) for s in opt.state_dict()["state"].values())
    out["gathered"] = hvd.allgather_object(r, process_set=odd if odd.included() else even)
    hvd.shutdown()
    return out


def test_broadcast_helpers_and_static_sets() -> None:
    """init(process_sets=[...]) adds them at start-up; broadcast_parameters / broadcast_optimizer_state
    / broadcast_object take process_set= with a global root (Horovod's broadcast_object does; its
    other two helpers have no process_set in 0.28.1): members get the root's weights, rank 1 keeps
    its own and is refused as a non-member."""
    res = run_workers(_broadcast_helpers, 3, timeout=150)
    assert all(o["ids"] == (1, 2) and o["sizes"] == (1, 2) for o in res)
    assert torch.equal(res[0]["weight"], res[2]["weight"])
    assert not torch.equal(res[1]["weight"], res[2]["weight"])
    torch.manual_seed(1)
    assert torch.equal(res[1]["weight"], torch.nn.Linear(2, 2).weight.detach())
    assert res[0]["object"] == res[2]["object"] == "from 2"
    assert "invalid root rank 1" in res[0]["bad root"]
    assert res[1]["non-member"] == "Broadcast: Rank 1 is not a member of the provided process set."
    assert res[0]["state steps"] == [1.0, 1.0]  # Adam initialised (one zero step), as Horovod does
    assert [o["gathered"] for o in res] == [[0, 2], [1], [0, 2]]


def _errors() -> dict:
    import adacomp as hvd
    hvd.init()
    out = {}
    for label, ranks in (("out of range", [0, 5]), ("repeated", [1, 1]), ("empty", [])):
        try:
            hvd.add_process_set(ranks)
        except ValueError as exc:
            out[label] = str(exc)
    try:
        hvd.allreduce(torch.ones(1), process_set=object())
    except ValueError as exc:
        out["foreign"] = str(exc)
    hvd.shutdown()
    return out


def test_invalid_sets_raise_on_every_rank() -> None:
    res = run_workers(_errors, 2, timeout=120)
    for o in res:
        assert "distinct ranks in [0, 2)" in o["out of range"] and "distinct ranks" in o["repeated"]
        assert "distinct ranks" in o["empty"]
        assert "add_process_set" in o["foreign"]
