"""One interface over torch.distributed, MPI and Horovod.

Everything above this layer (communicators, policies, the optimizer) speaks only these methods, so a
new transport is one new file. Async methods return a :class:`Handle` whose ``wait()`` gives the
result; handles must be waited in the order they were created (gloo and MPI match collectives by
order, see DESIGN.md "every rank issues the same collectives in the same order").
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

import torch
from torch import Tensor


class Handle:
    """Result of an async collective. ``wait()`` blocks and returns the output tensor.

    ``poll()`` answers "would ``wait()`` return without blocking?" (Horovod's ``hvd.poll``). A
    transport that can ask without blocking passes ``poll_fn``; without one, ``poll()`` completes
    the operation first, so a ``while not poll(h)`` loop always ends and never sees a wrong answer.
    """

    def __init__(self, wait_fn: Callable[[], Tensor], poll_fn: Callable[[], bool] | None = None):
        self._wait_fn = wait_fn
        self._poll_fn = poll_fn
        self._result: Tensor | None = None
        self._done = False

    def poll(self) -> bool:
        if self._done:
            return True
        if self._poll_fn is None:
            self.wait()
            return True
        return bool(self._poll_fn())

    def wait(self) -> Tensor:
        if not self._done:
            self._result = self._wait_fn()
            self._done = True
        return self._result  # type: ignore[return-value]

    @classmethod
    def completed(cls, value: Tensor) -> "Handle":
        h = cls(lambda: value)
        h.wait()
        return h


class Backend(ABC):
    """Collectives used by adacomp. All tensor arguments are contiguous.

    * ``allreduce_async(t, average)``: element-wise sum (or mean) over ranks; may work in place.
    * ``allgather_async(t, sizes, out)``: concatenation along dim 0 of every rank's ``t``; first dims
      may differ per rank. When ``sizes`` (first dim of each rank) is given the size exchange is
      skipped. ``out`` (optional): a contiguous buffer of ``t``'s dtype and device, with at least the
      gathered element count, that the backend may gather into and return a view of (a caller
      reusing its receive buffer saves a fresh allocation's page faults each step); callers use the
      returned tensor, whether or not it lives in ``out``.
    * ``broadcast_async(t, root)``: in place.
    * ``alltoall_async(t, splits, recv_splits)``: personalised exchange along dim 0. Rows
      ``t[off_j : off_j + splits[j]]`` go to rank j; the result concatenates, in rank order, the rows
      every rank sent here. ``recv_splits`` (rows coming from each rank) skips the count exchange;
      ``alltoall_splits(splits)`` is that exchange on its own. Zero rows are fine anywhere. Used by
      ByteComp's divisible scheme (bytecomp.txt, Fig. 4: alltoall, then allgather).
    * ``allreduce_algorithm``: which allreduce algorithm the transport may be asked to use
      (``ring`` / ``tree``); backends that cannot choose report ``None`` (see docs/algorithms.md).
    """

    name: str = "base"

    @abstractmethod
    def rank(self) -> int: ...

    @abstractmethod
    def size(self) -> int: ...

    @abstractmethod
    def local_rank(self) -> int: ...

    @abstractmethod
    def allreduce_async(self, tensor: Tensor, average: bool = False) -> Handle: ...

    @abstractmethod
    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None, out: Tensor | None = None) -> Handle: ...

    @abstractmethod
    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle: ...

    @abstractmethod
    def alltoall_async(self, tensor: Tensor, splits: list[int], recv_splits: list[int] | None = None) -> Handle:
        """Personalised exchange along dim 0: rows ``tensor[off_j : off_j + splits[j]]`` go to rank j;
        the result is the concatenation, in rank order, of the rows every rank sent to this rank
        (shape ``(sum(recv_splits), *tensor.shape[1:])``, same dtype, on tensor's device).
        ``recv_splits`` (rows coming from each rank) skips the count exchange when the caller knows
        it; when None the backend exchanges counts first (one small int64 alltoall, or the
        transport's native variable alltoall). Arguments are checked with :func:`check_alltoall`
        before any collective starts. ``recv_splits`` must be the true counts: Horovod checks it
        (ValueError on ``wait()``); gloo / MPI trust it, and a wrong value fails in the transport
        (or times out), so pass None when unsure."""

    def reduce_async(self, tensor: Tensor, op: str) -> Handle:
        """Element-wise ``op`` (``min``, ``max`` or ``product``) over ranks, in place; the result
        is also what ``wait()`` returns. This generic version gathers every rank's copy (world x
        the bytes of an allreduce) and reduces locally; transports with a native reduction
        override it. Used by the Horovod-style module API, not by gradient communication."""
        reducer = REDUCERS.get(op)
        if reducer is None:
            raise ValueError(f"reduce op {op!r} is not supported; valid choices: {', '.join(sorted(REDUCERS))}")
        gathered = self.allgather_async(tensor.detach().reshape(1, -1), sizes=[1] * self.size())

        def wait() -> Tensor:
            rows = gathered.wait()
            with torch.no_grad():
                tensor.copy_(reducer(rows).reshape(tensor.shape))
            return tensor
        return Handle(wait)

    @abstractmethod
    def broadcast_object(self, obj: Any, root: int = 0) -> Any: ...

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]: ...

    @abstractmethod
    def barrier(self) -> None: ...

    def shutdown(self) -> None:
        """Release the transport; safe to call twice."""

    def subgroup(self, ranks: list[int]) -> "Backend | None":
        """A backend over ``ranks`` (sorted ranks of this backend) for its members; on the other ranks
        None, or a backend only for ``shutdown()`` (where releasing the group is collective, as with
        Horovod's process sets). Collective: every rank of this backend calls it, with the same
        ranks, in the same order as its other collectives."""
        raise NotImplementedError(f"backend {self.name!r} has no sub-groups (process sets); use the torch backend "
                                  "(adacomp run / torchrun) or the MPI backend (mpirun)")

    # Convenience wrappers: blocking versions of the async calls.
    def allreduce(self, tensor: Tensor, average: bool = False) -> Tensor:
        return self.allreduce_async(tensor, average).wait()

    def allgather(self, tensor: Tensor, sizes: list[int] | None = None) -> Tensor:
        return self.allgather_async(tensor, sizes).wait()

    def broadcast(self, tensor: Tensor, root: int = 0) -> Tensor:
        return self.broadcast_async(tensor, root).wait()

    def allgather_sizes(self, n: int) -> list[int]:
        """First-dimension sizes of every rank (one small allgather)."""
        t = torch.tensor([n], dtype=torch.int64)
        return [int(x) for x in self.allgather(t, sizes=[1] * self.size()).tolist()]

    def alltoall(self, tensor: Tensor, splits: list[int], recv_splits: list[int] | None = None) -> Tensor:
        return self.alltoall_async(tensor, splits, recv_splits).wait()

    def alltoall_splits(self, splits: list[int]) -> list[int]:
        """Rows each rank will send me, given the rows I send each rank (one small int64 alltoall)."""
        n = self.size()
        counts = check_splits(splits, n, "alltoall splits")
        t = torch.tensor(counts, dtype=torch.int64)
        return [int(x) for x in self.alltoall(t, [1] * n, recv_splits=[1] * n).tolist()]

    @property
    def allreduce_algorithm(self) -> str | None:
        return None

    def set_allreduce_algorithm(self, algorithm: str) -> bool:
        """Ask for ``ring`` or ``tree``; returns False when the transport cannot honour it."""
        return False

    def __repr__(self) -> str:
        try:
            return f"{type(self).__name__}(rank={self.rank()}, size={self.size()})"
        except Exception:  # noqa: BLE001 - repr must never raise
            return f"{type(self).__name__}(uninitialised)"


class LocalBackend(Backend):
    """A world of one process: every collective is the identity. Used by single-process runs and
    by pure-math tests; never a stand-in for a multi-process collective."""

    name = "local"

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def local_rank(self) -> int:
        return 0

    def allreduce_async(self, tensor: Tensor, average: bool = False) -> Handle:
        return Handle.completed(tensor)

    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None, out: Tensor | None = None) -> Handle:
        return Handle.completed(tensor)

    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle:
        return Handle.completed(tensor)

    def alltoall_async(self, tensor: Tensor, splits: list[int], recv_splits: list[int] | None = None) -> Handle:
        check_alltoall(tensor, splits, recv_splits, 1)  # world of one: splits == [rows], all stay here
        return Handle.completed(tensor)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None

    def subgroup(self, ranks: list[int]) -> "Backend | None":
        if list(ranks) != [0]:
            raise ValueError(f"ranks {ranks} are not ranks of a one-process job (only [0])")
        return self


# Element-wise reductions over the ranks' rows of a (world, n) tensor, for Backend.reduce_async.
REDUCERS: dict[str, Callable[[Tensor], Tensor]] = {
    "min": lambda rows: rows.amin(dim=0),
    "max": lambda rows: rows.amax(dim=0),
    "product": lambda rows: rows.prod(dim=0, dtype=rows.dtype),
}


def broadcast_tensors(backend: Backend, tensors: Sequence[Tensor], root: int = 0) -> None:
    """Overwrite ``tensors`` in place with ``root``'s values, fused per dtype into one broadcast each
    (a model costs a few collectives). Every rank passes the same tensors in the same order."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        backend.broadcast(flat, root=root)
        off = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()


def check_splits(splits: Sequence[int], world: int, what: str) -> list[int]:
    """``splits`` as a list of ``world`` non-negative ints, or ValueError saying what was expected."""
    try:
        counts = [int(s) for s in splits]
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected a list of {world} row counts (ints), got {splits!r}") from None
    if len(counts) != world:
        raise ValueError(f"{what}: expected one row count per rank ({world} entries), got {len(counts)}: "
                         f"{counts}; pass [rows for rank 0, rows for rank 1, ...]")
    if any(c < 0 for c in counts):
        raise ValueError(f"{what}: expected row counts >= 0, got {counts}")
    return counts


def gather_into(out: Tensor | None, like: Tensor, rows: int) -> Tensor | None:
    """``out``'s first ``rows`` rows shaped as ``like``'s rows, where ``out`` can hold a gather of
    ``like`` (:meth:`Backend.allgather_async`'s ``out``); None where it cannot."""
    if out is None or out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        return None
    row = like[0].numel() if like.dim() else 1
    if like.dim() == 0 or out.numel() < rows * row:
        return None
    return out.view(-1)[:rows * row].view((rows,) + tuple(like.shape[1:]))


def check_alltoall(tensor: Tensor, splits: Sequence[int], recv_splits: Sequence[int] | None,
                   world: int) -> tuple[list[int], list[int] | None]:
    """Validate ``alltoall_async`` arguments before any collective starts (a bad call on one rank
    must not leave the others blocked in a half-issued exchange). Returns the normalised lists."""
    if tensor.dim() == 0:
        raise ValueError("alltoall: expected a tensor with at least one dimension (rows along dim 0), "
                         "got a 0-d tensor; use tensor.reshape(1)")
    counts = check_splits(splits, world, "alltoall splits")
    if sum(counts) != tensor.shape[0]:
        raise ValueError(f"alltoall splits: expected row counts summing to tensor.shape[0]={tensor.shape[0]}, "
                         f"got {counts} (sum {sum(counts)}); every row must go to exactly one rank")
    recv = None if recv_splits is None else check_splits(recv_splits, world, "alltoall recv_splits")
    if world == 1 and recv is not None and recv != counts:
        raise ValueError(f"alltoall recv_splits: a world of one receives what it sends, expected {counts}, "
                         f"got {recv}")
    return counts, recv


def split_offsets(counts: Sequence[int]) -> list[int]:
    """Start of each block in a concatenation of blocks of ``counts`` (exclusive prefix sum)."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def timed_wait(handle: Handle) -> tuple[Tensor, float]:
    """Wait on ``handle`` and return (result, seconds spent waiting)."""
    t0 = time.perf_counter()
    out = handle.wait()
    return out, time.perf_counter() - t0
