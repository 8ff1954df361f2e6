"""Horovod's optimizer-side surface mapped onto adacomp: ``Compression``, the extra
``DistributedOptimizer`` keywords and process sets (``SyncBatchNorm`` needs the running backend and
lives with the module API in :mod:`adacomp.runtime.hvd_api`).

Each Horovod keyword either maps onto the config (``compression`` -> the compressor registry,
``groups`` -> fusion buckets) or is refused with an error that names what to use instead, so a
Horovod script never silently trains differently from what it asked for.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable

import torch
from torch import Tensor

from adacomp.backends import process_backend
from adacomp.backends.base import Backend
from adacomp.config import Config, from_dict
from adacomp.errors import ConfigError

Average = "average"
Sum = "sum"
Min = "min"
Max = "max"
Product = "product"
Adasum = "adasum"
ADASUM_HINT = ("op=Adasum is not implemented by adacomp; use op=adacomp.Average (Horovod's default), "
               "and a compressor from the config (e.g. compressor: {name: topk}) to save bandwidth")


# ------------------------------------------------------------------------------------------------
# Compression: Horovod's two built-in compressors, each naming the registry entry it maps onto
# ------------------------------------------------------------------------------------------------
class NoneCompressor:
    """No compression (Horovod's default)."""

    registry_name = "none"

    @staticmethod
    def compress(tensor: Tensor) -> tuple[Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Tensor, ctx: Any) -> Tensor:
        return tensor


class FP16Compressor:
    """Floating tensors travel as float16 and come back in their own dtype; others unchanged.
    In the optimizer this is the registry's ``fp16`` compressor."""

    registry_name = "fp16"

    @staticmethod
    def compress(tensor: Tensor) -> tuple[Tensor, Any]:
        return (tensor.to(torch.float16) if tensor.is_floating_point() else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor: Tensor, ctx: Any) -> Tensor:
        return tensor.to(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression:
    """``adacomp.Compression.none`` / ``.fp16``, as ``hvd.Compression``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def _compression_name(compression: Any) -> str:
    name = getattr(compression, "registry_name", None)
    if isinstance(compression, str):
        name = compression
    if name is None:
        raise ValueError(f"compression={compression!r} is not supported; use adacomp.Compression.none or "
                         "adacomp.Compression.fp16, or name any compressor in the config "
                         "(compressor: {name: topk, density: 0.01})")
    return name


def resolve_compression(config: Config, compression: Any) -> Config:
    """The config with Horovod's ``compression=`` applied. ``Compression.none`` changes nothing;
    ``fp16`` (or a registry name) becomes the top-level compressor for every tensor (``min_numel``
    0, as Horovod compresses all gradients). Naming a compressor in both places is an error."""
    if compression is None:
        return config
    name = _compression_name(compression)
    if name == "none":
        return config
    if config.compressor.name != "none":
        raise ConfigError("compressor", f"both compression={name!r} (DistributedOptimizer keyword) and the "
                                        f"config's compressor {config.compressor.name!r} name a compressor; "
                                        "keep one of them")
    data = config.to_dict()
    data["compressor"] = {"name": name}
    data["min_numel"] = 0
    return from_dict(data)


# ------------------------------------------------------------------------------------------------
# Process sets
# ------------------------------------------------------------------------------------------------
class RemovedProcessSetError(ValueError, TypeError):
    """An op on a process set that was removed (or never added). Horovod 0.28.1 fails there with a
    TypeError from its C++ binding (the set's id is None); a ValueError names the problem better,
    so this is both."""


class ProcessSet:
    """Horovod's ``hvd.ProcessSet``: a sorted list of global ranks that run collectives together.

    Create it with ``adacomp.add_process_set(ranks)`` (collective: every rank calls it with the same
    ranks; :mod:`adacomp.runtime.hvd_sets`), pass it as ``process_set=`` to any collective, to
    ``DistributedOptimizer`` and to the ``broadcast_*`` helpers; only its members may call ops on it.
    ``rank()`` is the rank inside the set (a ValueError on a non-member, as in Horovod), ``size()``
    its size, ``included()`` whether this process belongs to it; ``rank()`` / ``size()`` are None
    until the set is added and after it is removed. Roots (``broadcast(root_rank=)``) stay global
    ranks, as in Horovod."""

    process_set_id: int | None = None
    ranks: list[int] | None = None

    def __init__(self, ranks: Iterable[int]):
        try:
            ranks = sorted(ranks)
        except TypeError:
            raise ValueError("ProcessSet should be initialized with a list of process ranks") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks (ints)")
        self.ranks = list(ranks)
        self._backend: Backend | None = None  # set by add_process_set on members

    def _world_rank(self) -> int:
        return process_backend().rank()

    def size(self) -> int | None:
        if self.process_set_id is None or self.ranks is None:
            return None
        return len(self.ranks)

    def rank(self) -> int | None:
        if self.process_set_id is None or self.ranks is None:
            return None
        me = self._world_rank()
        if me not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        if self.ranks is None:
            return None
        return self._world_rank() in self.ranks

    def backend(self, what: str = "Collective") -> Backend:
        """The transport of this set for a member; Horovod's ValueError for a non-member."""
        if self.process_set_id is None:
            raise RemovedProcessSetError(f"{what}: process set {self} has not been added (adacomp.add_process_set) "
                                         "or was removed")
        if not self.included() or self._backend is None:
            raise ValueError(f"{what}: Rank {self._world_rank()} is not a member of the provided process set.")
        return self._backend

    def _invalidate(self) -> None:
        self.process_set_id = None
        self._backend = None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank (id 0): the default of every op; its transport is the process's backend."""

    def __init__(self) -> None:
        super().__init__([])
        self.process_set_id = 0

    @property  # type: ignore[override]
    def ranks(self) -> list[int]:  # noqa: D401 - every rank of the running job
        return list(range(process_backend().size()))

    @ranks.setter
    def ranks(self, value: Any) -> None:
        pass

    def backend(self, what: str = "Collective") -> Backend:
        return process_backend()

    def rank(self) -> int:
        return process_backend().rank()

    def size(self) -> int:
        return process_backend().size()

    def included(self) -> bool:
        return True

    def _invalidate(self) -> None:  # never removed
        pass

    def __repr__(self) -> str:
        return "adacomp.global_process_set"


global_process_set = _GlobalProcessSet()


def is_global(process_set: Any) -> bool:
    return (process_set is None or process_set is global_process_set
            or getattr(process_set, "process_set_id", None) == 0)  # horovod.torch.global_process_set too


def process_set_backend(process_set: Any, what: str = "Collective") -> Backend:
    """The transport that ``process_set`` communicates over (the process's backend for the global
    set); a ValueError for a non-member or anything that is not an adacomp process set."""
    if is_global(process_set):
        return process_backend()
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set={process_set!r} is not an adacomp process set: create one with "
                         "adacomp.add_process_set(ranks) (a horovod.torch ProcessSet does not work here)")
    return process_set.backend(what)


def check_process_set(process_set: Any) -> None:
    """A valid process set (global or added); raises like :func:`process_set_backend` otherwise.
    Non-members are not refused here (the optimizer of a non-member just steps locally)."""
    if is_global(process_set):
        return
    if not isinstance(process_set, ProcessSet):
        process_set_backend(process_set)
    elif process_set.process_set_id is None:
        process_set.backend()


# ------------------------------------------------------------------------------------------------
# DistributedOptimizer keywords
# ------------------------------------------------------------------------------------------------
def _groups_to_bucket_mb(groups: int, params: list[Tensor]) -> float:
    """Fusion cap that yields about ``groups`` buckets of the dense gradient bytes."""
    total = sum(p.numel() * p.element_size() for p in params)
    return max(total / groups, 1.0) / 2 ** 20


def apply_optimizer_kwargs(config: Config, params: Iterable[Tensor], *, compression: Any = None,
                           sparse_as_dense: bool = False, groups: Any = None, num_groups: int = 0,
                           op: Any = Average, process_set: Any = global_process_set) -> Config:
    """Validate Horovod's extra ``DistributedOptimizer`` keywords and return the config they imply.

    * ``compression``: see :func:`resolve_compression`.
    * ``groups`` (int): about that many fusion buckets, via ``fusion.bucket_mb``; ``num_groups``
      is its deprecated spelling (Horovod warns the same way). Explicit tensor lists are refused.
    * ``sparse_as_dense``: must be a bool. adacomp sends every gradient densely, which is what
      ``True`` asks for; sparse gradients themselves are not supported either way.
    * ``op=Adasum`` is refused with the alternative to use; ``process_set`` must be the global set or
      one made by ``adacomp.add_process_set`` (the optimizer then averages over that set).
    """
    if op == Adasum:
        raise NotImplementedError(ADASUM_HINT)
    check_process_set(process_set)
    if not isinstance(sparse_as_dense, bool):
        raise ValueError(f"sparse_as_dense must be True or False, got {sparse_as_dense!r}")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    config = resolve_compression(config, compression)
    if groups is None or groups == 0:
        return config
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
        if isinstance(groups, (list, tuple)):
            raise ValueError("groups as explicit lists of tensors is not supported by adacomp; pass groups=<number "
                             "of groups> or set fusion.bucket_mb in the config (tensors of one bucket travel "
                             "together)")
        raise ValueError(f"groups should be a non-negative integer or a list of lists of torch.Tensor, got {groups!r}")
    fusion = dataclasses.replace(config.fusion, bucket_mb=_groups_to_bucket_mb(groups, list(params)),
                                 compressed_buffer=False)
    return dataclasses.replace(config, fusion=fusion)


__all__ = ["ADASUM_HINT", "Adasum", "Average", "Compression", "FP16Compressor", "Max", "Min", "NoneCompressor",
           "ProcessSet", "Product", "RemovedProcessSetError", "Sum", "apply_optimizer_kwargs", "check_process_set",
           "global_process_set", "is_global", "process_set_backend",
           "resolve_compression"]
