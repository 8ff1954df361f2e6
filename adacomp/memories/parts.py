"""The divisible scheme's second-stage error: a residual per tensor for the part this rank owns.

ByteComp's alltoall/allgather scheme (bytecomp.txt §4.2 Dimension 3, Fig. 4) makes rank ``j``
compress the average of part ``j`` of every tensor a second time; with feedback, rank ``j`` keeps
that compression's error and adds it to the next step's average of the same part (as DoubleSqueeze
keeps its server-side error). Unlike a route memory, these residuals are *parts of the averaged
tensor*, not per-rank debts: resumed on another world size they are concatenated in rank order and
cut again (:meth:`PartResidualMemory.reshard`), so each coordinate's residual moves to its new
owner unchanged.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch import Tensor

from adacomp.memories.base import ResidualMemory

_LEGACY_KEY = re.compile(r"/part\d+$")  # checkpoints before the memory was declared keyed parts by rank


def bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """Contiguous parts as ``torch.tensor_split``: the first ``numel % world`` parts get one more."""
    base, extra = divmod(numel, world)
    out, lo = [], 0
    for j in range(world):
        hi = lo + base + (1 if j < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


class PartResidualMemory(ResidualMemory):
    """Residual of this rank's part of each tensor (keyed by the tensor's name). Not in the
    memory registry: the ``alltoall`` communicator declares it (``Communicator.memories``)."""

    name = "parts"

    def _deferrable(self, compressor: Any) -> Callable[[Tensor, list[Tensor], Any], Any] | None:
        # the second stage compensates through compensate_with (the ranks' sparse mean added unwritten,
        # TopkCompressor.compensate_mean_into), which reads a written residual: a sparsifier's zeroing
        # left owed costs that fused pass about what the zeroing's write misses cost (tried in cost_notes
        # item 88: its passes reading r as +0.0 at the owed positions, no change a cell could see)
        if getattr(compressor, "sparse", False):
            return None
        return super()._deferrable(compressor)

    def reshard(self, states: list[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
        parts = [s.get("residuals", {}) for s in states]
        out: dict[str, Tensor] = {}
        for name in sorted({n for p in parts for n in p}):
            # a rank owning an empty part (more ranks than elements) stored nothing for it
            flat = torch.cat([p[name].reshape(-1) for p in parts if name in p])
            lo, hi = bounds(flat.numel(), world)[rank]
            out[name] = flat[lo:hi].clone()
        return {"residuals": out}

    def owed(self, states: list[dict[str, Any]]) -> dict[str, Tensor]:
        parts = [s.get("residuals", {}) for s in states]
        return {f"residuals/{name}": torch.cat([p[name].reshape(-1).to(torch.float64) for p in parts if name in p])
                for name in sorted({n for p in parts for n in p})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        res = state.get("residuals", {})
        super().load_state_dict({"residuals": {_LEGACY_KEY.sub("", k): v for k, v in res.items()}})


__all__ = ["PartResidualMemory", "bounds"]
