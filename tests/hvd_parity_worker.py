"""Issue 31: Horovod's own torch-test behaviours, adacomp next to ``horovod.torch`` (tests/test_hvd_parity.py).

Under ``horovodrun --gloo -np 2`` (no argument): adacomp on the torch backend, then re-initialised on
the Horovod backend, each check run against ``horovod.torch`` on the same inputs. Under ``mpirun``
(argument ``mpi``): adacomp's MPI backend against results computed here from every rank's inputs.
Prints ``HVD_PARITY_OK <checks>`` per rank when everything matched, else the mismatches, exit 1.

Parts: every dtype Horovod's tests loop over through every raw collective (``dtypes``); requests that
differ across ranks raise the same class on every rank and the job goes on (``mismatches``);
gradients through every differentiable collective (``gradients``).
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

try:
    import horovod.torch as hvd
except ImportError:  # the MPI mode runs without Horovod
    hvd = None

import adacomp
from tests.hvd_api_worker import CHECKS, FAILURES, _builtin_base, horovod_world, report, same

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
          torch.float64, torch.bool]


def _run(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return "err", exc


def compare(label: str, ours: Callable[[], Any], theirs: Callable[[], Any] | None, reference: Any = None,
            superset: bool = False) -> None:
    """adacomp against Horovod (when ``theirs`` is given) and against ``reference`` (when not None).
    Horovod failing with "not supported" where ``superset`` is set is fine if adacomp gives the
    reference: adacomp carries dtypes Horovod's CPU build refuses. Otherwise both must raise the
    same builtin exception class, or agree on the value."""
    CHECKS[0] += 1
    ka, a = _run(ours)
    if theirs is None:
        if ka != "ok" or not same(a, reference):
            FAILURES.append(f"{label}: adacomp {ka} {a!r} vs expected {reference!r}")
        return
    kb, b = _run(theirs)
    if kb == "err" and superset and "not supported" in str(b):
        if ka != "ok" or not same(a, reference):
            FAILURES.append(f"{label}: Horovod refuses ({b}); adacomp {ka} {a!r} vs expected {reference!r}")
    elif ka != kb:
        FAILURES.append(f"{label}: adacomp {ka} {a!r} vs horovod {kb} {b!r}")
    elif ka == "err" and not isinstance(a, _builtin_base(b)):
        FAILURES.append(f"{label}: adacomp raised {type(a).__name__}({a}) vs horovod {type(b).__name__}({b})")
    elif ka == "ok" and not (same(a, b) and (reference is None or same(a, reference))):
        FAILURES.append(f"{label}: adacomp {a!r} vs horovod {b!r} (expected {reference!r})")


def _value(rank: int, dtype: torch.dtype, rows: int = 4) -> torch.Tensor:
    """Small values (sums and products of two ranks stay exact in every dtype)."""
    return (torch.arange(rows * 2).reshape(rows, 2) % 3 + rank).to(dtype)


def _bool_refused() -> None:
    raise ValueError("Horovod 0.28.1: Tensor type torch.BoolTensor is not supported")


def dtypes(rank: int, world: int) -> None:
    """allgather, broadcast (both forms), alltoall, reducescatter and allreduce (every op) for every
    dtype of Horovod's tests, results in the caller's dtype."""
    for dt in DTYPES:
        every = [_value(r, dt) for r in range(world)]
        wide = torch.stack([e.double() for e in every])
        mine = every[rank]
        bigger = _value(rank, dt, rows=rank + 1)  # allgather with first dims differing per rank
        cases: dict[str, tuple[Callable[[Any], Any], Any]] = {
            "allgather": (lambda m: m.allgather(mine), torch.cat(every)),
            "allgather differing rows": (lambda m: m.allgather(bigger),
                                         torch.cat([_value(r, dt, rows=r + 1) for r in range(world)])),
            "broadcast": (lambda m: m.broadcast(mine, world - 1), every[-1]),
            "broadcast_": (lambda m: m.broadcast_(mine.clone(), world - 1), every[-1]),
            "alltoall": (lambda m: m.alltoall(mine), torch.cat([e.chunk(world)[rank] for e in every])),
        }
        reductions = {"Sum": wide.sum(0), "Min": wide.amin(0), "Max": wide.amax(0), "Product": wide.prod(0),
                      "Average": (wide.sum(0) / world).trunc() if not dt.is_floating_point else wide.sum(0) / world}
        for op, want in reductions.items():
            expect = None if dt == torch.bool else want.to(dt)
            cases[f"allreduce op={op}"] = (lambda m, op=op: m.allreduce(mine, op=getattr(m, op)), expect)
        rs = wide.sum(0).chunk(world)[rank]
        cases["reducescatter Sum"] = (lambda m: m.reducescatter(mine, op=m.Sum),
                                      None if dt == torch.bool else rs.to(dt))
        for label, (call, want) in cases.items():
            if want is None:  # bool reductions: Horovod raises ValueError, so does adacomp
                compare(f"{label} {dt}", lambda: call(adacomp), (lambda: call(hvd)) if hvd else _bool_refused)
                continue
            if hvd is None:
                compare(f"{label} {dt}", lambda: call(adacomp), None, want)
            else:
                compare(f"{label} {dt}", lambda: call(adacomp), lambda: call(hvd), want, superset=True)


def _mismatch_cases(r: int) -> dict[str, Callable[[Any], Any]]:
    """Horovod's *_error tests: each rank asks for something else (rank r in a 2-rank job)."""
    f32, f64, i32 = torch.float32, torch.float64, torch.int32
    return {
        "allreduce shape": lambda m: m.allreduce(torch.zeros(3 + r)),
        "allreduce rank": lambda m: m.allreduce(torch.zeros(2, 2) if r else torch.zeros(4)),
        "allreduce dtype": lambda m: m.allreduce(torch.zeros(3, dtype=f32 if r else f64)),
        "allreduce op": lambda m: m.allreduce(torch.zeros(3), op=m.Sum if r else m.Max),
        "allreduce prescale": lambda m: m.allreduce(torch.zeros(3), prescale_factor=1.0 + r),
        "allreduce_async_ shape": lambda m: m.synchronize(m.allreduce_async_(torch.zeros(3 + r))),
        "grouped_allreduce shape": lambda m: m.grouped_allreduce([torch.zeros(2), torch.zeros(3 + r)]),
        "allgather trailing dims": lambda m: m.allgather(torch.zeros(2, 2 + r)),
        "allgather rank": lambda m: m.allgather(torch.zeros(2, 2) if r else torch.zeros(2, 2, 1)),
        "allgather dtype": lambda m: m.allgather(torch.zeros(3, dtype=f32 if r else i32)),
        "broadcast root": lambda m: m.broadcast(torch.zeros(3), r),
        "broadcast shape": lambda m: m.broadcast(torch.zeros(3 + r), 0),
        "broadcast_ dtype": lambda m: m.broadcast_(torch.zeros(3, dtype=f32 if r else i32), 0),
        "alltoall dtype": lambda m: m.alltoall(torch.zeros(4, dtype=f32 if r else i32)),
        "alltoall trailing dims": lambda m: m.alltoall(torch.zeros(4, 1 + r)),
        "reducescatter shape": lambda m: m.reducescatter(torch.zeros(4 + 2 * r)),
        "reducescatter dtype": lambda m: m.reducescatter(torch.zeros(4, dtype=f32 if r else f64)),
    }


def mismatches(rank: int, world: int) -> None:
    """Same exception class as Horovod on every rank, a message naming the ranks, and the next
    collective works (Horovod's coordinator; gloo alone aborts the process)."""
    for label, call in _mismatch_cases(rank).items():
        if label == "allreduce prescale" and adacomp.backend().name == "horovod":
            continue  # adacomp scales around Horovod's sum, so Horovod's coordinator never sees the factors (docs/horovod.md)
        compare(f"mismatch {label}", lambda: call(adacomp), (lambda: call(hvd)) if hvd else _mismatch_raised)
        CHECKS[0] += 1
        try:
            call(adacomp)
            FAILURES.append(f"mismatch {label}: no error")
        except adacomp.HorovodInternalError as exc:  # Horovod backend: Horovod's coordinator found it
            if adacomp.backend().name != "horovod" and not (
                    isinstance(exc, adacomp.MismatchError) and "ranks [0]" in str(exc) and "ranks [1]" in str(exc)):
                FAILURES.append(f"mismatch {label}: not a MismatchError naming the ranks: {exc!r}")
        compare(f"after mismatch {label}", lambda: adacomp.allreduce(torch.ones(2), op=adacomp.Sum), None,
                torch.full((2,), float(world)))

    def duplicate(m: Any) -> Any:
        first = m.allreduce_async(torch.ones(3), name="duplicate_name")
        try:
            m.allreduce_async(torch.ones(3), name="duplicate_name")
        finally:
            m.synchronize(first)
    compare("duplicate name in flight", lambda: duplicate(adacomp), (lambda: duplicate(hvd)) if hvd else _dup_raised)
    def name_per_kind(m: Any) -> Any:
        """Horovod keys ops by kind and name: an allgather and a broadcast may share an allreduce's name."""
        handles = [m.allreduce_async(torch.ones(2), name="shared", op=m.Sum),
                   m.allgather_async(torch.ones(1, 2), name="shared"),
                   m.broadcast_async(torch.ones(2), root_rank=0, name="shared")]
        return [m.synchronize(h) for h in handles]
    compare("one name in flight per kind", lambda: name_per_kind(adacomp), (lambda: name_per_kind(hvd)) if hvd else None,
            [torch.full((2,), float(world)), torch.ones(world, 2), torch.ones(2)])

    def reuse_after_poll(m: Any) -> Any:
        first = m.allreduce_async(torch.ones(2), name="polled", op=m.Sum)
        while not m.poll(first):
            pass
        second = m.allreduce_async(torch.ones(2), name="polled", op=m.Sum)
        return m.synchronize(second), m.synchronize(first)
    compare("name free once polled done", lambda: reuse_after_poll(adacomp),
            (lambda: reuse_after_poll(hvd)) if hvd else None, (torch.full((2,), float(world)),) * 2)
    compare("name free after synchronize", lambda: [m.synchronize(m.allreduce_async(torch.ones(1), name="again"))
                                                    for m in (adacomp, adacomp)][1], None, torch.ones(1))


def _mismatch_raised() -> None:
    raise RuntimeError("Horovod 0.28.1 raises HorovodInternalError (a RuntimeError) for a mismatch")


def _dup_raised() -> None:
    raise ValueError("Horovod 0.28.1 raises ValueError for a second op with a name in flight")


def _grad_of(rank: int, shape: tuple[int, ...], forward: Callable[[torch.Tensor], Any]) -> Any:
    """``w.grad`` after backpropagating a rank-dependent weighting of ``forward(w)`` (float64)."""
    g = torch.Generator().manual_seed(7 + rank)
    w = torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
    outs = forward(w)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    loss = sum((o * (torch.arange(o.numel(), dtype=o.dtype).reshape(o.shape) + 1 + rank)).sum() for o in outs)
    loss.backward()
    return w.grad


def gradients(rank: int, world: int) -> None:
    """Horovod's *_grad tests: the gradient through each collective, compared with horovod.torch's."""
    splits = [1, 3] if rank == 0 else [2, 1]
    cases: dict[str, tuple[tuple[int, ...], Callable[[Any, torch.Tensor], Any]]] = {
        "allreduce Average": ((5, 3), lambda m, w: m.allreduce(w * w)),
        "allreduce Sum scaled": ((5, 3), lambda m, w: m.allreduce(w, op=m.Sum, prescale_factor=2.0, postscale_factor=0.5)),
        "allreduce Max": ((4,), lambda m, w: m.allreduce(w, op=m.Max)),
        "grouped_allreduce Sum": ((3, 2), lambda m, w: m.grouped_allreduce([w, w * 3], op=m.Sum)),
        "grouped_allreduce Average": ((3, 2), lambda m, w: m.grouped_allreduce([w, w.sin()])),
        "allgather differing rows": ((rank + 2, 3), lambda m, w: m.allgather(w)),
        "broadcast root 1": ((4, 2), lambda m, w: m.broadcast(w * 2, 1)),
        "broadcast root 0": ((4,), lambda m, w: m.broadcast(w, 0)),
        "alltoall splits": ((4, 2) if rank == 0 else (3, 2), lambda m, w: m.alltoall(w, splits=splits)[0]),
        "alltoall equal": ((4, 2), lambda m, w: m.alltoall(w)),
        "reducescatter Average": ((5, 2), lambda m, w: m.reducescatter(w)),
        "reducescatter Sum scaled": ((4, 3), lambda m, w: m.reducescatter(w, op=m.Sum, prescale_factor=2.0,
                                                                          postscale_factor=0.25)),
    }
    cases.update({
        "grouped_allgather": ((rank + 1, 2), lambda m, w: m.grouped_allgather([w, w * w])),
        "grouped_reducescatter Sum": ((5, 2), lambda m, w: m.grouped_reducescatter([w, w[1:] * 2], op=m.Sum)),
    })
    for label, (shape, fwd) in cases.items():
        if hvd is None:  # MPI mode: a grad must exist and be finite (values are compared under horovodrun)
            compare(f"grad {label}", lambda: bool(torch.isfinite(_grad_of(rank, shape, lambda w: fwd(adacomp, w))).all()),
                    None, True)
            continue
        compare(f"grad {label}", lambda: _grad_of(rank, shape, lambda w: fwd(adacomp, w)),
                lambda: _grad_of(rank, shape, lambda w: fwd(hvd, w)))


def grouped(rank: int, world: int) -> None:
    """grouped_allgather / grouped_reducescatter (and their async forms): values against horovod.torch's."""
    every = [[torch.arange(6.).reshape(3, 2) * (r + 1), torch.arange(r + 1.) + 10 * r] for r in range(world)]
    mine = every[rank]
    gathered = [torch.cat([e[i] for e in every]) for i in range(2)]
    summed = torch.stack([e[0] for e in every]).sum(0)
    rows = [3 // world + (1 if r < 3 % world else 0) for r in range(world)]
    first = sum(rows[:rank])
    scattered = [summed[first:first + rows[rank]], (summed * 2)[first:first + rows[rank]] / world]
    theirs = (lambda call: (lambda: call(hvd))) if hvd else (lambda call: None)
    for label, call, want in [
        ("grouped_allgather", lambda m: m.grouped_allgather(mine), gathered),
        ("grouped_allgather_async", lambda m: m.synchronize(m.grouped_allgather_async(mine, name="ga")), gathered),
        ("grouped_reducescatter", lambda m: m.grouped_reducescatter([mine[0], mine[0] * 2], op=m.Sum)[:1],
         scattered[:1]),
        ("grouped_reducescatter_async Average", lambda m: m.synchronize(
            m.grouped_reducescatter_async([mine[0] * 2], name="grs"))[0], scattered[1]),
        ("grouped_allgather mismatch", lambda m: m.grouped_allgather([mine[0], torch.zeros(2, 1 + rank)]), None),
    ]:
        if want is None:
            compare(label, lambda: call(adacomp), theirs(call) or _mismatch_raised)
        else:
            compare(label, lambda: call(adacomp), theirs(call), want)


def sparse(rank: int, world: int) -> None:
    """sparse_allreduce_async: entries of every rank (differing counts, a shared index) as
    horovod.torch gives them, densified."""
    def entries(r: int) -> torch.Tensor:
        idx = torch.tensor([[0, 2, 3][: r + 2], [1, 0, 2][: r + 2]])
        return torch.sparse_coo_tensor(idx, torch.arange(r + 2.) + 1 + r, (4, 3))
    want = sum(entries(r).to_dense() for r in range(world))
    for op, scale in (("Average", world), ("Sum", 1)):
        def call(m: Any, op: str = op) -> Any:
            return m.sparse_allreduce_async(entries(rank), name=f"sparse.{op}", op=getattr(m, op))().to_dense()
        compare(f"sparse_allreduce_async {op}", lambda: call(adacomp), (lambda: call(hvd)) if hvd else None,
                want / scale)


def checks(rank: int, world: int) -> None:
    dtypes(rank, world)
    mismatches(rank, world)
    gradients(rank, world)
    grouped(rank, world)
    sparse(rank, world)


def main() -> int:
    global hvd
    if sys.argv[1:] == ["mpi"]:
        hvd = None  # importable here, but compared only under horovodrun
        adacomp.init("mpi")
        rank = adacomp.rank()
        checks(rank, adacomp.size())
        adacomp.shutdown()
    else:
        rank = horovod_world()
        for backend in ("torch", "horovod"):
            adacomp.init(backend)
            checks(rank, hvd.size())
            adacomp.shutdown()
    return report("HVD_PARITY_OK", rank)


if __name__ == "__main__":
    sys.exit(main())
