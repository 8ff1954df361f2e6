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


CONFIGS = [None, {"compressor": {"name": "topk", "density": 0.25}, "communicator": {"name": "allgather"},
                  "min_numel": 0},
           {"compressor": {"name": "powersgd", "rank": 1}, "min_numel": 0}]


def _uneven_optimizer() -> dict:
    """Rank 0 trains on 3 batches, rank 1 on 1, then both call the module's join() (no ``opt.join()``):
    the joined rank answers the optimizer's rounds, whatever the route (allreduce, allgather of top-k
    pairs, PowerSGD's two rounds), with a metric allreduce between the steps."""
    import adacomp as hvd
    hvd.init()
    r = hvd.rank()
    out: dict = {}
    for i, cfg in enumerate(CONFIGS):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), config=cfg,
                                       named_parameters=model.named_parameters())
        g = torch.Generator().manual_seed(10 + r)
        batches = [torch.randn(6, 4, generator=g) for _ in range(3 if r == 0 else 1)]
        grads = []
        for x in batches:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            hvd.allreduce(torch.ones(1), name=f"metric {i} {len(grads)}")
        out[f"join {i}"] = hvd.join()
        out[f"params {i}"] = [p.detach().clone() for p in model.parameters()]
        out[f"grads {i}"] = grads
        out[f"steps {i}"] = opt.steps
    hvd.shutdown()
    return out


def test_join_serves_distributed_optimizer() -> None:
    res = run_workers(_uneven_optimizer, 2, timeout=180)
    for i in range(len(CONFIGS)):
        assert [o[f"join {i}"] for o in res] == [0, 0]  # rank 0 joined last
        assert [o[f"steps {i}"] for o in res] == [3, 3]  # the joined rank counted the steps it answered
    # plain averaging: rank 1's zeros still count in the average (Horovod divides by the world size)
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    g0 = torch.Generator().manual_seed(10)
    g1 = torch.Generator().manual_seed(11)
    xs0 = [torch.randn(6, 4, generator=g0) for _ in range(3)]
    xs1 = [torch.randn(6, 4, generator=g1)]
    for step, x in enumerate(xs0):
        grads = []
        for batch in [x] + ([xs1[0]] if step == 0 else []):
            ref.zero_grad()
            ref(batch).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        with torch.no_grad():
            for k, p in enumerate(ref.parameters()):
                p -= 0.5 * sum(gr[k] for gr in grads) / 2
    for got, want in zip(res[0]["params 0"], ref.parameters()):
        assert torch.allclose(got, want, atol=1e-6)
