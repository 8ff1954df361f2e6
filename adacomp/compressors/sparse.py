"""Shared pieces of every sparsifier: payload ``[values, indices]`` over the flattened tensor."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from adacomp.compressors.base import Compressor, Payload


class SparseCtx(NamedTuple):
    """Local context of a sparse payload: enough to rebuild a dense tensor of any rank's payload."""

    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device


def check_density(density: float) -> float:
    if not isinstance(density, (int, float)) or isinstance(density, bool) or not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return float(density)


def k_for(numel: int, density: float) -> int:
    """Number of elements a density keeps: ``max(1, round(density * numel))`` (never above numel)."""
    return min(numel, max(1, int(round(density * numel))))


def scatter(values: Tensor, indices: Tensor, ctx: SparseCtx) -> Tensor:
    out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=ctx.device)
    out.index_add_(0, indices.to(torch.int64), values.to(ctx.dtype))
    return out.view(ctx.shape)


class SparseCompressor(Compressor):
    """Base of all sparsifiers: subclasses implement :meth:`select` returning flat indices.

    Sparse payloads are biased: pair them with ``residual`` (or ``dgc``) memory.
    Indices are int64 on the wire (int32 would halve index bytes; kept int64 for tensors >2^31).
    """

    sparse = True
    additive = False
    fixed_size = False

    def __init__(self, density: float = 0.01):
        self._density = check_density(density)

    def density(self) -> float | None:
        return self._density

    def set_density(self, density: float) -> None:
        self._density = check_density(density)

    def select(self, flat: Tensor, name: str) -> Tensor:
        """Indices (into ``flat``) of the elements to send."""
        raise NotImplementedError(f"{type(self).__name__} must implement select()")

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        idx = self.select(flat, name)
        ctx = SparseCtx(tensor.shape, flat.numel(), tensor.dtype, tensor.device)
        return [flat[idx], idx], ctx

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        return scatter(payload[0], payload[1], ctx)

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        return k_for(int(torch.Size(shape).numel()), self._density) * (itemsize + 8)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(density={self._density})"
