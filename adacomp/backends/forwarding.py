"""A Backend that hands every call to an inner backend: the base of wrappers that add behaviour
around collectives (latency shaping, recording) without restating the whole interface."""
from __future__ import annotations

from typing import Any

from torch import Tensor

from adacomp.backends.base import Backend, Handle


class ForwardingBackend(Backend):
    """Forwards everything to ``inner``; subclasses override only what they change."""

    def __init__(self, inner: Backend):
        self.inner = inner
        self.name = getattr(inner, "name", "wrapped")

    def rank(self) -> int:
        return self.inner.rank()

    def size(self) -> int:
        return self.inner.size()

    def local_rank(self) -> int:
        return self.inner.local_rank()

    def allreduce_async(self, tensor: Tensor, average: bool = False) -> Handle:
        return self.inner.allreduce_async(tensor, average)

    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None, out: Tensor | None = None) -> Handle:
        return self.inner.allgather_async(tensor, sizes, out)

    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle:
        return self.inner.broadcast_async(tensor, root)

    def alltoall_async(self, tensor: Tensor, splits: list[int], recv_splits: list[int] | None = None) -> Handle:
        return self.inner.alltoall_async(tensor, splits, recv_splits)

    def alltoall_splits(self, splits: list[int]) -> list[int]:
        return self.inner.alltoall_splits(splits)

    def reduce_async(self, tensor: Tensor, op: str) -> Handle:
        return self.inner.reduce_async(tensor, op)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.inner.broadcast_object(obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.inner.allgather_object(obj)

    def barrier(self) -> None:
        self.inner.barrier()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def subgroup(self, ranks: list[int]) -> Backend | None:
        """The inner backend's sub-group (what the wrapper adds, e.g. latency shaping, stays with
        the whole group)."""
        return self.inner.subgroup(ranks)

    @property
    def allreduce_algorithm(self) -> str | None:
        return self.inner.allreduce_algorithm

    def set_allreduce_algorithm(self, algorithm: str) -> bool:
        return self.inner.set_allreduce_algorithm(algorithm)
