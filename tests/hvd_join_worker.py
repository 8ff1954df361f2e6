"""Issue 31: Horovod's ``join()`` through ``import adacomp as hvd`` next to ``horovod.torch`` under
``horovodrun --gloo -np 3`` (tests/test_hvd_join.py): rank 2 joins at once, rank 1 after one
allreduce, rank 0 goes on alone; the joined ranks answer allreduces (every op, factors, grouped,
async, in place, integers) with zeros, other collectives raise the same class on the active rank,
and every rank gets the same last-joined rank. Then uneven data through ``DistributedOptimizer``
(rank r has 3 - r batches, a module allreduce after each step, then ``join()``): the joined ranks
answer the optimizer's gradient rounds with zeros, so every rank ends with Horovod's parameters.
adacomp on the torch backend, then on the Horovod backend. Prints ``HVD_JOIN_OK <checks>`` per rank when everything matched."""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import horovod.torch as hvd

import adacomp
from tests.hvd_api_worker import CHECKS, FAILURES, horovod_world, report
from tests.hvd_parity_worker import compare


def scenario(m: Any, rank: int) -> list[tuple[str, Callable[[], Any]]]:
    """What each rank does with module ``m``; returns labelled results to compare."""
    out: list[tuple[str, Any]] = []

    def run(label: str, fn: Callable[[], Any]) -> None:
        try:
            out.append((label, ("ok", fn())))
        except Exception as exc:  # noqa: BLE001 - compared by class below
            out.append((label, ("err", exc)))
    if rank == 2:
        run("join", m.join)
        return out
    run("Average of two active ranks", lambda: m.allreduce(torch.full((3,), float(rank + 1))))
    if rank == 1:
        run("join", m.join)
        return out
    run("Average", lambda: m.allreduce(torch.full((3,), 6.0)))
    run("Sum", lambda: m.allreduce(torch.full((3,), 4.0), op=m.Sum))
    run("int Average", lambda: m.allreduce(torch.full((3,), 5), op=m.Average))
    run("Max", lambda: m.allreduce(torch.full((2,), -4.0), op=m.Max))
    run("Min", lambda: m.allreduce(torch.full((2,), 4.0), op=m.Min))
    run("factors", lambda: m.allreduce(torch.full((2,), 4.0), op=m.Sum, prescale_factor=2.0, postscale_factor=3.0))
    run("grouped", lambda: m.grouped_allreduce([torch.ones(2), torch.ones(3, 2)]))
    run("allreduce_ async", lambda: m.synchronize(m.allreduce_async_(torch.full((2,), 3.0), op=m.Sum)))
    run("allgather", lambda: m.allgather(torch.ones(2, 1)))
    run("broadcast", lambda: m.broadcast(torch.ones(2), 0))
    run("after refused ops", lambda: m.allreduce(torch.ones(2), op=m.Sum))
    run("join", m.join)
    return out


TRAINING = [("default", {}), ("fp16", {"compression": "fp16"}), ("Sum", {"op": "Sum"}),
            ("predivide", {"gradient_predivide_factor": 2.0}), ("two passes", {"backward_passes_per_step": 2})]


def training(m: Any, rank: int, size: int) -> list[tuple[str, Callable[[], Any]]]:
    """Uneven data: rank r trains on ``size - r`` batches, then joins; the parameters it ends with."""
    import torch.nn.functional as F
    out: list[tuple[str, Any]] = []
    for label, kw in TRAINING:
        kwargs = dict(kw)
        if "compression" in kwargs:
            kwargs["compression"] = m.Compression.fp16
        if "op" in kwargs:
            kwargs["op"] = getattr(m, kwargs["op"])
        passes = kwargs.get("backward_passes_per_step", 1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = m.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=model.named_parameters(), **kwargs)
        g = torch.Generator().manual_seed(100 + rank)
        losses = []
        for step in range(size - rank):
            opt.zero_grad()
            for _ in range(passes):
                x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
                F.mse_loss(model(x), y).backward()
            opt.step()
            # a metric between the steps (named: Horovod numbers unnamed ops per rank, which diverge here)
            losses.append(m.allreduce(torch.tensor([float(rank)]), op=m.Sum, name=f"{label} metric {step}"))
        out.append((f"{label}: metrics", ("ok", losses)))
        try:
            out.append((f"{label}: join", ("ok", m.join())))
        except Exception as exc:  # noqa: BLE001 - compared by class
            out.append((f"{label}: join", ("err", exc)))
        out.append((f"{label}: parameters", ("ok", [p.detach().clone() for p in model.parameters()])))
        out.append((f"{label}: after join", ("ok", m.allreduce(torch.ones(2), op=m.Sum, name=f"{label} after"))))
    return out


def before_init() -> list[tuple[str, Any]]:
    """Horovod 0.28.1 before ``init()`` (under a launcher): ValueError from DistributedOptimizer and
    rank(), HorovodInternalError (a RuntimeError) from collectives and broadcast_parameters."""
    model = torch.nn.Linear(2, 2)
    return [
        ("DistributedOptimizer before init", lambda m: m.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())),
        ("rank before init", lambda m: m.rank()),
        ("allreduce before init", lambda m: m.allreduce(torch.ones(1))),
        ("broadcast_parameters before init", lambda m: m.broadcast_parameters(model.state_dict(), root_rank=0)),
    ]


def main() -> int:
    for label, call in before_init():
        compare(label, lambda: call(adacomp), lambda: call(hvd))
    rank = horovod_world()
    theirs = scenario(hvd, rank) + training(hvd, rank, hvd.size())
    for backend in ("torch", "horovod"):
        adacomp.init(backend)
        ours = scenario(adacomp, rank) + training(adacomp, rank, adacomp.size())
        CHECKS[0] += 1
        if [label for label, _ in ours] != [label for label, _ in theirs]:
            FAILURES.append(f"{backend}: steps differ {ours} vs {theirs}")
        for (label, (ka, a)), (_, (kb, b)) in zip(ours, theirs):
            if label == "fp16: parameters" and ka == kb == "ok":  # half-precision sums: Horovod's fusion
                CHECKS[0] += 1                                    # timing changes the last bits
                if not all(torch.allclose(x, y, rtol=0, atol=2e-3) for x, y in zip(a, b)):
                    FAILURES.append(f"{backend} rank {rank} {label}: adacomp {a} vs horovod {b}")
                continue
            compare(f"{backend} rank {rank} {label}", lambda: _replay(ka, a), lambda: _replay(kb, b))
        adacomp.shutdown()
    return report("HVD_JOIN_OK", rank)


def _replay(kind: str, value: Any) -> Any:
    if kind == "err":
        raise value
    return value


if __name__ == "__main__":
    sys.exit(main())
