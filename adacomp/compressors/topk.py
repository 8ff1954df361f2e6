"""Layer-wise Top-k, Random-k and bucket-wise global Top-k sparsifiers.

* ``topk`` (ADTopk paper §2.2 "traditional Top-k"; AR-Topk §2-C "LWTopk"): the k largest |g| of
  the flattened tensor, k = max(1, round(density * numel)). Exactly k elements, so the payload size
  depends only on the shape (``fixed_size``): fits ``allgather`` and ``allgather_fast``.
* ``randomk`` (GRACE's Random-k): k coordinates drawn from a generator seeded identically on every
  rank, so all ranks pick the same coordinates and the payload is just the values (indices stay in
  ctx). The values of all ranks can be summed: fits ``allreduce`` as well as the allgathers.
* ``gtopk``: exact Top-k over a whole fusion bucket (granularity ``"bucket"``): one selection across
  many layers, so layers with large gradients get more of the budget. Deviation: Shi et al.'s gTop-k
  also re-selects the global k *after* a tree merge across workers; here the merge is the plain
  sparse sum of ``allgather`` (each rank keeps its own k).

All three are biased (unsent coordinates are dropped): pair them with ``residual`` memory.
"""
from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import torch
from torch import Tensor

from adacomp.compressors.base import Compressor, Payload, register
from adacomp.compressors.sparse import SparseCompressor, SparseCtx, check_density, k_for, scatter


def topk_indices(flat: Tensor, k: int) -> Tensor:
    """Indices of the k largest magnitudes of a 1-D tensor (unsorted; one global selection)."""
    if k >= flat.numel():
        return torch.arange(flat.numel(), device=flat.device)
    return torch.topk(flat.abs(), k, sorted=False).indices


@register("topk")
class TopkCompressor(SparseCompressor):
    """Exact layer-wise Top-k by magnitude.

    ``density``: fraction of elements sent (0.001-0.01 in the ADTopk / AR-Topk evaluations).
    Payload ``[values (k,), indices (k,) int64]``.
    """

    fixed_size = True

    def __init__(self, density: float = 0.01):
        super().__init__(density)

    def select(self, flat: Tensor, name: str) -> Tensor:
        return topk_indices(flat, k_for(flat.numel(), self._density))


@register("gtopk")
class GTopkCompressor(TopkCompressor):
    """Top-k over the flattened gradient of a whole fusion bucket (one selection, many layers).

    The optimizer hands it one entry per bucket; ``density`` applies to the bucket's total size.
    """

    granularity = "bucket"

    def __init__(self, density: float = 0.01):
        super().__init__(density)


class RandomkCtx(NamedTuple):
    """Random-k keeps the chosen coordinates locally: every rank drew the same ones."""

    sparse: SparseCtx
    indices: Tensor


@register("randomk")
class RandomkCompressor(Compressor):
    """k uniformly random coordinates, identical on every rank (payload ``[values]``).

    The coordinates come from a private ``torch.Generator`` seeded from ``(seed, tensor name,
    step, calls since the last step)``; ``step`` is set by :meth:`on_step`, so the choice changes
    every iteration and is reproducible after a restore. The global RNG is never touched (GRACE's
    Random-k reseeds it, which also changes dropout and data order).
    """

    additive = True
    fixed_size = True
    sparse = False

    def __init__(self, density: float = 0.01, seed: int = 0):
        self._density = check_density(density)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.seed = seed
        self._step = 0
        self._calls: dict[str, int] = {}

    def density(self) -> float | None:
        return self._density

    def set_density(self, density: float) -> None:
        self._density = check_density(density)

    def _generator(self, name: str, device: torch.device) -> torch.Generator:
        calls = self._calls.get(name, 0)
        self._calls[name] = calls + 1
        key = f"{self.seed}:{name}:{self._step}:{calls}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = k_for(n, self._density)
        gen = self._generator(name, flat.device)
        idx = torch.randperm(n, generator=gen, device=flat.device)[:k]
        ctx = RandomkCtx(SparseCtx(tensor.shape, n, tensor.dtype, tensor.device), idx)
        return [flat[idx]], ctx

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        return scatter(payload[0], ctx.indices, ctx.sparse)

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        return k_for(int(torch.Size(shape).numel()), self._density) * itemsize

    def on_step(self, step: int) -> None:
        self._step = int(step)
        self._calls.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "calls": dict(self._calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state.get("step", 0))
        self._calls = {str(k): int(v) for k, v in state.get("calls", {}).items()}

    def __repr__(self) -> str:
        return f"RandomkCompressor(density={self._density}, seed={self.seed})"
