"""One interface over torch.distributed, MPI and Horovod.

Everything above this layer (communicators, policies, the optimizer) speaks only these methods, so a
new transport is one new file. Async methods return a :class:`Handle` whose ``wait()`` gives the
result; handles must be waited in the order they were created (gloo and MPI match collectives by
order, see DESIGN.md "every rank issues the same collectives in the same order").
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable

import torch
from torch import Tensor


class Handle:
    """Result of an async collective. ``wait()`` blocks and returns the output tensor."""

    def __init__(self, wait_fn: Callable[[], Tensor]):
        self._wait_fn = wait_fn
        self._result: Tensor | None = None
        self._done = False

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
    * ``allgather_async(t, sizes)``: concatenation along dim 0 of every rank's ``t``; first dims may
      differ per rank. When ``sizes`` (first dim of each rank) is given the size exchange is skipped.
    * ``broadcast_async(t, root)``: in place.
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
    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None) -> Handle: ...

    @abstractmethod
    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle: ...

    @abstractmethod
    def broadcast_object(self, obj: Any, root: int = 0) -> Any: ...

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]: ...

    @abstractmethod
    def barrier(self) -> None: ...

    def shutdown(self) -> None:
        """Release the transport; safe to call twice."""

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

    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None) -> Handle:
        return Handle.completed(tensor)

    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle:
        return Handle.completed(tensor)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None


def timed_wait(handle: Handle) -> tuple[Tensor, float]:
    """Wait on ``handle`` and return (result, seconds spent waiting)."""
    t0 = time.perf_counter()
    out = handle.wait()
    return out, time.perf_counter() - t0
