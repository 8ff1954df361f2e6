"""Horovod's module-level torch API on adacomp's backends, so ``import adacomp as hvd`` runs a
Horovod script unchanged under ``adacomp run``, torchrun, mpirun or horovodrun.

Identity and capability queries live in :mod:`adacomp.runtime.hvd_info`, the cross-rank checks in
:mod:`adacomp.runtime.hvd_check`; both are re-exported here. Semantics follow ``horovod.torch`` 0.28
(tests/test_hvd_api.py and tests/test_hvd_parity.py compare both on the same inputs):
``allreduce`` averages by default and returns a new tensor, ``allreduce_`` works in place, the
``*_async`` forms return a handle for :func:`poll` / :func:`synchronize`, and ``prescale_factor``
/ ``postscale_factor`` multiply before / after the reduction.

Differences, and why:

* ``name=`` is not used for matching: adacomp's transports (gloo, MPI) match collectives by
  *order*, so every rank must issue them in the same order (DESIGN.md). Names are compared across
  ranks with the rest of the request (:mod:`adacomp.runtime.hvd_check`), so an op issued in another
  order under other names raises instead of mixing tensors; a name already in flight is refused.
* ``join()`` follows Horovod: a joined rank answers the others' module-API allreduces and
  ``DistributedOptimizer`` rounds with zeros until every rank has joined (it rides on the cross-rank
  check, and optimizer rounds announce themselves the same way: :mod:`adacomp.engine.hvd_join`).
* ``process_set=``: sets made by :func:`add_process_set` (:mod:`adacomp.runtime.hvd_sets`) map onto
  sub-groups of the running backend (torch, MPI); roots stay global ranks, as in Horovod.
* ``Adasum`` is refused (see :data:`ADASUM_HINT`).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from adacomp.runtime import context
from adacomp.runtime.hvd_info import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,  # noqa: F401
                                      gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size,
                                      mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
                                      shutdown, size, start_timeline, stop_timeline)
from adacomp.runtime.hvd_check import HorovodInternalError, MismatchError, agree, claim, release, request
from adacomp.runtime import hvd_check
from adacomp.engine import hvd_join
from adacomp.backends.base import Handle
from adacomp.errors import CommunicationError
from adacomp.engine.hvd_keywords import (ADASUM_HINT, Adasum, Average, Compression, Max, Min, Product,  # noqa: F401
                                         ProcessSet, RemovedProcessSetError, Sum, global_process_set, is_global,
                                         process_set_backend)
from adacomp.runtime.hvd_sets import add_process_set, init, remove_process_set  # noqa: F401,F811
from adacomp.backends.base import Backend

_OPS = (Average, Sum, Min, Max, Product)


class ScalarTensorError(ValueError, IndexError):
    """A 0-d tensor where rows are needed (Horovod raises IndexError there; ValueError reads better)."""


# ------------------------------------------------------------------------------------------------
# Handles
# ------------------------------------------------------------------------------------------------
class AsyncHandle:
    """What the ``*_async`` functions return; pass it to :func:`poll` or :func:`synchronize`."""

    def __init__(self, handle: Handle, finish: Callable[[Any], Any] = lambda out: out,
                 on_done: Callable[[], None] = lambda: None):
        self._handle = handle
        self._finish = finish
        self._on_done = on_done  # frees the op's name (see hvd_check.claim)
        self._synchronized = False

    def poll(self) -> bool:
        done = self._handle.poll()
        if done:  # Horovod frees a name once its op has completed
            self._on_done()
        return done

    def synchronize(self) -> Any:
        if self._synchronized:  # Horovod forgets a handle once synchronized
            return None
        self._synchronized = True
        try:
            return self._finish(self._handle.wait())
        except CommunicationError:
            raise
        except RuntimeError as exc:
            raise HorovodInternalError(str(exc)) from exc
        finally:
            self._on_done()


def poll(handle: AsyncHandle) -> bool:
    """True when :func:`synchronize` on ``handle`` would return without blocking."""
    _check_handle(handle)
    return handle.poll()


def synchronize(handle: AsyncHandle) -> Any:
    """Wait for ``handle`` and return its result (None if it was already synchronized)."""
    _check_handle(handle)
    return handle.synchronize()


def _check_handle(handle: Any) -> None:
    if not isinstance(handle, AsyncHandle):
        raise TypeError(f"expected a handle returned by an adacomp *_async function, got {type(handle).__name__}")


def _set(process_set: Any, what: str) -> Backend:
    """The transport of ``process_set`` (the process's backend for the global set); Horovod's
    ValueError ("Rank r is not a member of the provided process set") on a non-member."""
    return process_set_backend(process_set, what)


def _launch(be: Backend, name: str | None, requests: list[dict[str, Any]],
            start: Callable[[], AsyncHandle]) -> AsyncHandle:
    """Horovod's order of checks: this rank's arguments were validated by the caller; then the
    name (refused at once while in flight), then every rank's request (:func:`hvd_check.agree`:
    a mismatch raises on every rank of the set ``be`` before any data moves), then the collective."""
    # Horovod keys an op by "<kind>.<name>" (GetOpName), so one name may be in flight once per kind
    key = None if name is None else f"{requests[0]['op'] if requests else 'op'}.{name}"
    claim(be, key)
    try:
        agree(be, requests)
        handle = start()
    except BaseException:
        release(be, key)
        raise
    handle._on_done = lambda: release(be, key)
    return handle


# ------------------------------------------------------------------------------------------------
# Allreduce family
# ------------------------------------------------------------------------------------------------
def _resolve_op(op: Any, average: bool | None) -> str:
    """Horovod's rules: ``op`` wins, ``average`` is the deprecated spelling, mixing them is an error."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average; pass only one of them (op=adacomp.Average "
                         "or adacomp.Sum)")
    if op is None:
        op = Average if average is None or average else Sum
    if op == Adasum:
        raise NotImplementedError(ADASUM_HINT)
    if op not in _OPS:
        raise ValueError(f"unknown reduction op {op!r}; valid choices: adacomp.Average, Sum, Min, Max, Product")
    return op


def _check_tensor(tensor: Any, what: str) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: tensor is required to be contiguous; call .contiguous() first")


def _scale(t: Tensor, factor: float) -> None:
    """``t *= factor`` in place; integers are scaled in float64 and truncated toward zero, which is
    what Horovod does to integer tensors (so ``Average`` of ints rounds toward zero)."""
    if factor == 1.0:
        return
    if t.is_floating_point() or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_((t.double() * factor).trunc())


def _check_reducible(tensor: Tensor) -> None:
    if tensor.dtype == torch.bool:  # Horovod has no bool reductions either
        raise ValueError("a bool tensor cannot be allreduced; cast it first (e.g. t.to(torch.uint8))")


def _reduce_into(be: Backend, work: Tensor, op: str, prescale: float, postscale: float,
                 result: Tensor | None = None) -> AsyncHandle:
    """Start reducing ``work`` in place across the ranks of ``be``; the handle's result is ``result``
    (the caller's tensor object, of which ``work`` is the ``.data``) or ``work``."""
    _check_reducible(work)
    _scale(work, prescale)
    with torch.no_grad():
        handle = be.allreduce_async(work, average=False) if op in (Average, Sum) else be.reduce_async(work, op)
    post = postscale / be.size() if op == Average else postscale

    def finish(out: Tensor) -> Tensor:
        _scale(work, post)
        return work if result is None else result
    return AsyncHandle(handle, finish)


def allreduce_async(tensor: Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> AsyncHandle:
    """Start an out-of-place allreduce; ``synchronize(handle)`` returns the reduced copy."""
    op = _resolve_op(op, average)
    _check_tensor(tensor, "allreduce_async")
    be = _set(process_set, "Allreduce")
    _check_reducible(tensor)
    return _launch(be, name, [_allreduce_request(tensor, name, op, prescale_factor, postscale_factor)],
                   lambda: _reduce_into(be, tensor.detach().clone(), op, prescale_factor, postscale_factor))


def _allreduce_request(tensor: Tensor, name: str | None, op: str, prescale: float, postscale: float) -> dict[str, Any]:
    return request("allreduce", tensor, name, op=op, factors=(prescale, postscale))


def allreduce_async_(tensor: Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> AsyncHandle:
    """Start an in-place allreduce of ``tensor``."""
    op = _resolve_op(op, average)
    _check_tensor(tensor, "allreduce_async_")
    be = _set(process_set, "Allreduce")
    _check_reducible(tensor)
    return _launch(be, name, [_allreduce_request(tensor, name, op, prescale_factor, postscale_factor)],
                   lambda: _reduce_into(be, tensor.data, op, prescale_factor, postscale_factor, result=tensor))


def _differentiable(*tensors: Tensor) -> bool:
    """Horovod's collectives are autograd functions; ours take that path only when a gradient can
    flow (same values either way, without the autograd bookkeeping otherwise)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _Allreduce(torch.autograd.Function):
    """Horovod's rule: the gradient is allreduced with the same op and factors (every rank must
    then run backward through it)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, op: str, prescale: float, postscale: float,  # type: ignore[override]
                name: str | None, process_set: Any) -> Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale, postscale, process_set))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        op, prescale, postscale, process_set = ctx.args
        return (synchronize(allreduce_async(grad.contiguous(), None, None, op, prescale, postscale, process_set)),
                None, None, None, None, None)


def allreduce(tensor: Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> Tensor:
    """Average (default) or ``op``-reduce ``tensor`` over all ranks; returns a new tensor.
    ``compression`` (``adacomp.Compression.fp16``) casts for the transfer, as Horovod does.
    Differentiable (Horovod's rule: the gradient is allreduced with the same op and factors)."""
    op = _resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    if _differentiable(compressed):
        _check_tensor(compressed, "allreduce")
        _set(process_set, "Allreduce")
        out = _Allreduce.apply(compressed, op, prescale_factor, postscale_factor, name, process_set)
    else:
        out = synchronize(allreduce_async(compressed, None, name, op, prescale_factor, postscale_factor,
                                          process_set))
    return compression.decompress(out, ctx)


def allreduce_(tensor: Tensor, average: bool | None = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> Tensor:
    """In-place allreduce; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def grouped_allreduce_async(tensors: Sequence[Tensor], average: bool | None = None, name: str | None = None,
                            op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> AsyncHandle:
    """Start allreducing every tensor of ``tensors`` (out of place); the result is a list."""
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor, process_set, inplace=False)


def grouped_allreduce_async_(tensors: Sequence[Tensor], average: bool | None = None, name: str | None = None,
                             op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> AsyncHandle:
    return _grouped(tensors, average, name, op, prescale_factor, postscale_factor, process_set, inplace=True)


def _grouped(tensors: Sequence[Tensor], average: bool | None, name: str | None, op: Any, prescale: float,
             postscale: float, process_set: Any, inplace: bool) -> AsyncHandle:
    """One cross-rank check for the whole group, then one allreduce per tensor."""
    op = _resolve_op(op, average)
    be = _set(process_set, "Allreduce")
    for t in tensors:
        _check_tensor(t, "grouped_allreduce")
        _check_reducible(t)
    names = _member_names(name, len(tensors))

    def start() -> AsyncHandle:
        return _group([_reduce_into(be, t.data, op, prescale, postscale, result=t) if inplace
                       else _reduce_into(be, t.detach().clone(), op, prescale, postscale) for t in tensors])
    return _launch(be, name, [_allreduce_request(t, n, op, prescale, postscale) for t, n in zip(tensors, names)], start)


def grouped_allreduce(tensors: Sequence[Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set) -> list[Tensor]:
    """Allreduce a list of tensors (one call for the group); returns new tensors. Differentiable:
    the gradients are grouped-allreduced with the same op and factors (Horovod's rule)."""
    pairs = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in pairs]
    if _differentiable(*compressed):
        _set(process_set, "Allreduce")
        outs = list(_GroupedAllreduce.apply(_resolve_op(op, average), prescale_factor, postscale_factor, name,
                                            process_set, *compressed))
    else:
        outs = synchronize(grouped_allreduce_async(compressed, average, name, op, prescale_factor,
                                                   postscale_factor, process_set))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: str, prescale: float, postscale: float, name: str | None,  # type: ignore[override]
                process_set: Any, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_allreduce_async(tensors, None, name, op, prescale, postscale, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:  # type: ignore[override]
        op, prescale, postscale, process_set = ctx.args
        reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], None, None, op, prescale,
                                                      postscale, process_set))
        return (None, None, None, None, None, *reduced)


def grouped_allreduce_(tensors: Sequence[Tensor], average: bool | None = None, name: str | None = None,
                       op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def _group(handles: list[AsyncHandle]) -> AsyncHandle:
    def wait() -> Any:
        return [h.synchronize() for h in handles]
    return AsyncHandle(Handle(wait, lambda: all(h.poll() for h in handles)))


# ------------------------------------------------------------------------------------------------
# Allgather, broadcast, alltoall, reducescatter
# ------------------------------------------------------------------------------------------------
def allgather_async(tensor: Tensor, name: str | None = None, process_set: Any = global_process_set) -> AsyncHandle:
    """Start concatenating every rank's ``tensor`` along dim 0 (first dims may differ)."""
    be = _check_allgather(tensor, process_set)
    return _launch(be, name, [request("allgather", tensor, name, first_dim_free=True)],
                   lambda: AsyncHandle(be.allgather_async(tensor.detach())))


def _check_allgather(tensor: Tensor, process_set: Any) -> Backend:
    _check_tensor(tensor, "allgather_async")
    be = _set(process_set, "Allgather")
    if tensor.dim() == 0:
        raise ScalarTensorError("allgather needs a tensor with at least one dimension (rows along dim 0); "
                                "use tensor.reshape(1)")
    return be


def _member_names(name: str | None, n: int) -> list[str | None]:
    """Names of a group's members: ``name.i`` (None stays None)."""
    return [None if name is None else f"{name}.{i}" for i in range(n)]


def grouped_allgather_async(tensors: Sequence[Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> AsyncHandle:
    """Start allgathering every tensor of ``tensors`` (one cross-rank check for the group)."""
    be = _set(process_set, "Allgather")
    for t in tensors:
        _check_allgather(t, process_set)
    requests = [request("allgather", t, n, first_dim_free=True) for t, n in zip(tensors, _member_names(name, len(tensors)))]
    return _launch(be, name, requests, lambda: _group([AsyncHandle(be.allgather_async(t.detach())) for t in tensors]))


def grouped_allgather(tensors: Sequence[Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[Tensor]:
    """:func:`allgather` of each tensor; differentiable with the same rule (each member's gradient
    is what a lone allgather's would be, as in Horovod's grouped version)."""
    if _differentiable(*tensors):
        return [allgather(t, n, process_set) for t, n in zip(tensors, _member_names(name, len(tensors)))]
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def allgather(tensor: Tensor, name: str | None = None, process_set: Any = global_process_set) -> Tensor:
    """Every rank's ``tensor`` concatenated along dim 0. Differentiable (Horovod's rule: the
    gradient is averaged over ranks and each rank keeps the rows it contributed)."""
    if _differentiable(tensor):
        _set(process_set, "Allgather")
        return _Allgather.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, name: str | None, process_set: Any) -> Tensor:  # type: ignore[override]
        ctx.rows = int(tensor.shape[0]) if tensor.dim() else 0
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        ps = ctx.process_set
        reduced = synchronize(allreduce_async(grad.contiguous(), op=Average, process_set=ps))
        rows = synchronize(allgather_async(torch.tensor([ctx.rows], dtype=torch.int32), process_set=ps)).tolist()
        first = sum(rows[:_set(ps, "Allgather").rank()])
        return reduced.narrow(0, first, ctx.rows), None, None


def sparse_allreduce_async(tensor: Tensor, name: str | None, op: Any, process_set: Any = global_process_set
                           ) -> Callable[[], Tensor]:
    """Horovod's sparse allreduce: every rank's entries of the sparse COO ``tensor`` are allgathered
    (indices and values, two allgathers), so the result holds all of them, uncoalesced (duplicate
    indices add up when coalesced or densified); ``op=Average`` divides the values by the world size,
    any other op keeps the sum. Returns a function (Horovod's handle) that waits and gives the result."""
    if not (isinstance(tensor, Tensor) and tensor.layout == torch.sparse_coo):
        raise TypeError(f"sparse_allreduce_async expects a sparse COO tensor, got "
                        f"{getattr(tensor, 'layout', type(tensor).__name__)}; use allreduce_async for dense tensors")
    world = _set(process_set, "Allgather").size()
    indices = allgather_async(tensor._indices().t().contiguous(), None if name is None else f"{name}.indices",
                              process_set)
    values = allgather_async(tensor._values().contiguous(), None if name is None else f"{name}.values", process_set)

    def handle() -> Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / world
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.size())
    return handle


def _set_root(root_rank: int, process_set: Any) -> int:
    """``root_rank`` (a global rank, as in Horovod) as a rank of ``process_set``'s transport."""
    n = size()
    if not isinstance(root_rank, int) or not 0 <= root_rank < n:
        raise ValueError(f"root_rank must be a rank in [0, {n}), got {root_rank!r}")
    if is_global(process_set):
        return root_rank
    ranks = process_set.ranks or []
    if root_rank not in ranks:
        raise ValueError(f"broadcast received invalid root rank {root_rank} for provided process set {process_set}")
    return ranks.index(root_rank)


def broadcast_async_(tensor: Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> AsyncHandle:
    """Start overwriting ``tensor`` in place with ``root_rank``'s value."""
    _check_tensor(tensor, "broadcast_async_")
    be = _set(process_set, "Broadcast")
    root = _set_root(root_rank, process_set)

    def start() -> AsyncHandle:
        with torch.no_grad():
            return AsyncHandle(be.broadcast_async(tensor.data, root=root), lambda _out: tensor)
    return _launch(be, name, [request("broadcast", tensor, name, root=root_rank)], start)


def broadcast_async(tensor: Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> AsyncHandle:
    """Out-of-place broadcast: the result is a new tensor, ``tensor`` is left alone."""
    _check_tensor(tensor, "broadcast_async")
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast(tensor: Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> Tensor:
    """``root_rank``'s ``tensor`` on every rank (a new tensor). Differentiable (Horovod's rule: the
    gradient is averaged over ranks on the root, zero elsewhere)."""
    if _differentiable(tensor):
        _set(process_set, "Broadcast")
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, root_rank: int, name: str | None,  # type: ignore[override]
                process_set: Any) -> Tensor:
        ctx.root, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        reduced = synchronize(allreduce_async(grad.contiguous(), op=Average, process_set=ctx.process_set))
        if rank() != ctx.root:
            reduced.zero_()
        return reduced, None, None, None


def broadcast_(tensor: Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> Tensor:
    synchronize(broadcast_async_(tensor, root_rank, name, process_set))
    return tensor


def _splits_list(tensor: Tensor, splits: Any, n: int) -> list[int]:
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension (rows along dim 0)")
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"alltoall without splits divides dim 0 ({tensor.shape[0]} rows) equally among "
                             f"{n} ranks, which needs a multiple of {n}; pass splits=[rows per rank]")
        return [tensor.shape[0] // n] * n
    values = splits.tolist() if isinstance(splits, Tensor) else list(splits)
    return [int(v) for v in values]


def alltoall_async(tensor: Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> AsyncHandle:
    """Start sending rows ``splits[j]`` of ``tensor`` to rank j (equal shares without ``splits``).
    The result is ``(output, received_splits)`` (int32 rows from each rank)."""
    _check_tensor(tensor, "alltoall_async")
    be = _set(process_set, "Alltoall")
    counts = _splits_list(tensor, splits, be.size())
    from adacomp.backends.base import check_alltoall
    check_alltoall(tensor, counts, None, be.size())

    def start() -> AsyncHandle:
        received = be.alltoall_splits(counts)
        handle = be.alltoall_async(tensor.detach(), counts, recv_splits=received)
        return AsyncHandle(handle, lambda out: (out, torch.tensor(received, dtype=torch.int32)))
    return _launch(be, name, [request("alltoall", tensor, name, first_dim_free=True)], start)


def alltoall(tensor: Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Horovod's return convention: ``output`` alone without ``splits``, else ``(output, received_splits)``.
    Differentiable (Horovod's rule: the gradient goes back by an alltoall with the received splits)."""
    if _differentiable(tensor):
        _set(process_set, "Alltoall")
        out, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return out if splits is None else (out, received)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, splits: Any, name: str | None,  # type: ignore[override]
                process_set: Any) -> Any:
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _received: Any) -> Any:  # type: ignore[override]
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, process_set=ctx.process_set))
        return back, None, None, None


def _scatter_rows(n_rows: int, world: int) -> list[int]:
    """Rows each rank receives from reducescatter: equal shares, the first ranks take one extra."""
    base, extra = divmod(n_rows, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def reducescatter_async(tensor: Tensor, name: str | None = None, op: Any = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> AsyncHandle:
    """Start reducing ``tensor`` over ranks and keep this rank's block of rows (dim 0)."""
    return _reducescatter([tensor], name, op, process_set, prescale_factor, postscale_factor, single=True)


def grouped_reducescatter_async(tensors: Sequence[Tensor], name: str | None = None, op: Any = Average,
                                process_set: Any = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> AsyncHandle:
    """Start a reducescatter of every tensor of ``tensors`` (one cross-rank check for the group);
    the result is a list."""
    return _reducescatter(tensors, name, op, process_set, prescale_factor, postscale_factor, single=False)


def _reducescatter(tensors: Sequence[Tensor], name: str | None, op: Any, process_set: Any, prescale_factor: float,
                   postscale_factor: float, single: bool) -> AsyncHandle:
    if op not in (Average, Sum):  # Horovod fails the same way, from its background thread
        raise HorovodInternalError(f"reducescatter supports op=adacomp.Average or Sum, got {op!r}")
    for tensor in tensors:
        _check_tensor(tensor, "reducescatter_async")
        if tensor.dim() == 0:
            raise ValueError("reducescatter needs a tensor with at least one dimension (rows along dim 0)")
        _check_reducible(tensor)
    be = _set(process_set, "Reducescatter")

    def mine(tensor: Tensor) -> slice:
        rows = _scatter_rows(int(tensor.shape[0]), be.size())
        first = sum(rows[:be.rank()])
        return slice(first, first + rows[be.rank()])

    def one(tensor: Tensor) -> AsyncHandle:
        reduced, keep = _reduce_into(be, tensor.detach().clone(), op, prescale_factor, postscale_factor), mine(tensor)
        return AsyncHandle(reduced._handle, lambda out: reduced._finish(out)[keep].clone())

    def start() -> AsyncHandle:
        return one(tensors[0]) if single else _group([one(t) for t in tensors])
    names = [name] if single else _member_names(name, len(tensors))
    return _launch(be, name, [request("reducescatter", t, n, op=op, factors=(prescale_factor, postscale_factor))
                          for t, n in zip(tensors, names)], start)


def grouped_reducescatter(tensors: Sequence[Tensor], name: str | None = None, compression: Any = Compression.none,
                          op: Any = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Tensor]:
    """:func:`reducescatter` of each tensor; differentiable with the same rule."""
    if _differentiable(*tensors):
        return [reducescatter(t, n, compression, op, process_set, prescale_factor, postscale_factor)
                for t, n in zip(tensors, _member_names(name, len(tensors)))]
    pairs = [compression.compress(t) for t in tensors]
    outs = synchronize(grouped_reducescatter_async([c for c, _ in pairs], name, op, process_set, prescale_factor,
                                                   postscale_factor))
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def reducescatter(tensor: Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: Any = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Tensor:
    """Reduce ``tensor`` over ranks and keep this rank's rows. Differentiable (Horovod's rule: the
    gradient, times the world size for ``Sum`` and times both factors, is allgathered)."""
    compressed, ctx = compression.compress(tensor)
    if _differentiable(compressed):
        _set(process_set, "Reducescatter")
        out = _Reducescatter.apply(compressed, op, prescale_factor, postscale_factor, name, process_set)
    else:
        out = synchronize(reducescatter_async(compressed, name, op, process_set, prescale_factor, postscale_factor))
    return compression.decompress(out, ctx)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, op: Any, prescale: float, postscale: float,  # type: ignore[override]
                name: str | None, process_set: Any) -> Tensor:
        ctx.factor = (_set(process_set, "Reducescatter").size() if op == Sum else 1) * prescale * postscale
        ctx.process_set = process_set
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor=prescale,
                                               postscale_factor=postscale))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        scaled = grad * ctx.factor if ctx.factor != 1 else grad.contiguous()
        return synchronize(allgather_async(scaled.contiguous(), process_set=ctx.process_set)), None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# Objects, barrier, join
# ------------------------------------------------------------------------------------------------
def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list[Any]:
    """Every rank's pickle-able ``obj``, in rank order (of ``process_set``: Horovod 0.28.1's
    ``allgather_object`` has no ``process_set``; adacomp takes one)."""
    return _set(process_set, "Allgather").allgather_object(obj)


def barrier(process_set: Any = global_process_set) -> None:
    _set(process_set, "Barrier").barrier()


def join(device: int = -1) -> int:
    """Horovod's join: this rank has no more data. Until every rank has joined it answers the other
    ranks' module-API allreduces (every op, grouped, async, in place) with zeros, so their ``Average``
    still divides by the whole world as in Horovod; an allgather / broadcast / alltoall /
    reducescatter issued meanwhile raises Horovod's HorovodInternalError ("... is not supported
    with Join") on the ranks that issued it. Returns the rank that joined last (the highest of
    those that joined in the last round), on every rank.

    ``DistributedOptimizer``'s rounds are answered too: each announces its optimizer with the check's
    one-int64 allgather (:mod:`adacomp.engine.hvd_join`) and a joined rank runs a shadow round of it
    (zeros in every bucket). It rides on the cross-rank check (:mod:`adacomp.runtime.hvd_check`):
    with ``ADACOMP_MISMATCH_CHECK_DISABLE=1`` it is a barrier that returns the last rank to arrive by
    the clock. Under horovodrun it is Horovod's own ``join`` (docs/horovod.md)."""
    be = context.current()
    if be.size() == 1:
        return 0
    if getattr(be, "name", "") == "horovod":
        while not hasattr(be, "join") and hasattr(be, "inner"):  # a wrapper (latency shaping, watchdog)
            be = be.inner  # type: ignore[attr-defined]
        return int(be.join(device))  # type: ignore[attr-defined]
    if not hvd_check.enabled():
        arrivals = be.allgather_object(time.time())
        return max(range(len(arrivals)), key=lambda r: (arrivals[r], r))
    code = hvd_check.JOINED_NOW
    while True:
        codes = hvd_check.exchange(be, code)
        live = hvd_check.active(codes)
        if not live:
            fresh = [r for r, c in enumerate(codes) if c == hvd_check.JOINED_NOW]
            return max(fresh) if fresh else be.size() - 1
        code = hvd_check.JOINED
        rounds = [hvd_check.round_id(codes[r]) for r in live]
        if any(k is not None for k in rounds):  # DistributedOptimizer rounds (adacomp.engine.hvd_join)
            first = rounds[0]
            if first is not None and all(k == first for k in rounds):
                hvd_join.lookup(first).answer_round()  # zeros in every bucket, the same collectives
            continue  # otherwise the active ranks disagree (those in a module op raise MismatchError)
        everyone = be.allgather_object(None)  # the active ranks' requests (hvd_check.agree's second step)
        first = everyone[live[0]]
        if any(codes[r] != codes[live[0]] for r in live) or any(req["op"] != "allreduce" for req in first):
            continue  # the active ranks raise (mismatch, or an op Horovod's join does not serve)
        zeros = [torch.zeros(req["shape"], dtype=getattr(torch, req["dtype"])) for req in first]
        handles = [_reduce_into(be, z, req["reduction"], *req["factors"]) for z, req in zip(zeros, first)]
        for h in handles:
            h.synchronize()


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """Batch norm with statistics over all ranks: torch's ``SyncBatchNorm`` on the torch backend's
    process group. Other backends have no process group for it, so construction fails there with
    the alternative to use (``horovod.torch.SyncBatchNorm`` under horovodrun)."""

    def __init__(self, *args: Any, **kwargs: Any):
        be = context.current()
        name = getattr(be, "name", "")
        if be.size() > 1 and name != "torch":
            alt = ("horovod.torch.SyncBatchNorm" if name == "horovod"
                   else "the torch backend (launch with `adacomp run` or torchrun)")
            raise RuntimeError(f"adacomp.SyncBatchNorm needs the torch backend's process group; the running backend "
                               f"is {name!r}. Use {alt}, or torch.nn.BatchNorm (per-rank statistics)")
        super().__init__(*args, **kwargs)


__all__ = ["Adasum", "AsyncHandle", "ProcessSet", "RemovedProcessSetError", "add_process_set", "remove_process_set", "Average", "HorovodInternalError", "Max", "Min", "MismatchError", "Product", "Sum",
           "SyncBatchNorm", "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
           "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
           "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
           "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
           "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
           "reducescatter", "reducescatter_async", "rocm_built", "shutdown", "size", "sparse_allreduce_async",
           "start_timeline", "stop_timeline", "synchronize"]
