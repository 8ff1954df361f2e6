"""DGC memory: momentum correction, momentum-factor masking and local gradient clipping.

Lin et al., "Deep Gradient Compression" (ICLR 2018), §3.2 and §3.3:

* momentum correction (§3.2): accumulate the *velocity* rather than the raw
  gradient, ``u <- m * u + g`` then ``v <- v + u``; ``v`` is what gets compressed and sent, so a
  coordinate sent late carries the momentum it would have had without sparsification;
* momentum-factor masking (§3.3): after sending, ``u`` and ``v`` are zeroed at the sent coordinates so
  stale momentum does not keep pushing them;
* local gradient clipping (§3.2): clip ``g`` before it is accumulated, with the global threshold scaled by
  N^(-1/2) (N = the round's group size, which the engine passes to ``compensate``).

Because momentum is applied here, the wrapped optimizer must run *without* momentum
(``torch.optim.SGD(..., momentum=0)``), as in DGC. The update needs the sent indices: it reads
``payload[1]`` of the public sparse layout ``[values, indices]``, so it works with every sparse
compressor (dgc, topk, gaussiank, ...), not only ``dgc``.

Momentum-factor masking is exact but may be late: where DGC's compressor runs its fused momentum pass,
:meth:`DGCMemory.update` keeps the sent positions and the next compensation's pass reads ``u`` and ``v``
as +0.0 there (the zeroing's write misses cost 34 ms of a 260 ms VGG-16 step on the Xeon); whoever
reads ``velocity`` / ``accumulated`` (state_dict, rescale, regroup, a test) gets them zeroed first.

Deviations: clipping is per tensor (or per fused bucket) on its L2 norm, because a memory sees one
tensor at a time, where DGC clips the whole model's norm; the reference codes (GRACE, ADTopk A.6)
instead clamp elements to an allreduced RMS norm, which needs a collective and is not DGC's rule.
The threshold is a float ``clip_norm`` (0 = off) rather than those codes' boolean
``gradient_clipping``, since DGC clips against a configured norm threshold.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from adacomp.compressors import _native
from adacomp.compressors.workspace import Workspace
from adacomp.memories.base import Memory, Pieces, fits, register, whole_key


def _buffer_like(buf: Tensor | None, like: Tensor) -> Tensor:
    return buf if buf is not None and fits(buf, like) else torch.empty_like(like)


class _Settled:
    """One of the memory's per-name dicts, read or replaced through the public name only after the
    masking left to the next pass is done (:meth:`DGCMemory._settle_all`)."""

    def __init__(self, attr: str, doc: str):
        self.attr, self.__doc__ = attr, doc

    def __get__(self, obj: Any, owner: Any = None) -> dict[str, Tensor]:
        if obj is None:
            return self  # type: ignore[return-value]  # the class attribute itself (documentation)
        obj._settle_all()
        return getattr(obj, self.attr)

    def __set__(self, obj: Any, value: dict[str, Tensor]) -> None:
        obj._settle_all()
        setattr(obj, self.attr, value)


@register("dgc")
class DGCMemory(Memory):
    """``momentum``: DGC's m (0.9). ``clip_norm``: global L2 clipping threshold (0 = no clipping)."""

    def __init__(self, momentum: float = 0.9, clip_norm: float = 0.0):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r} (DGC uses 0.9)")
        if clip_norm < 0.0:
            raise ValueError(f"clip_norm must be >= 0 (0 disables clipping), got {clip_norm!r}")
        self.momentum = float(momentum)
        self.clip_norm = float(clip_norm)
        self._velocity: dict[str, Tensor] = {}  # u: momentum-corrected velocity
        self._accumulated: dict[str, Tensor] = {}  # v: accumulated velocity, what gets sent
        self._zeroed: dict[str, Tensor] = {}  # positions sent last where u and v are still to be zeroed
        self._spare_u: dict[str, Tensor] = {}  # the u and v of the round before: the next round's
        self._spare: dict[str, Tensor] = {}  # u and v are written there (see compensate)
        self._positions = Workspace()  # the kept positions' buffers, reused once nobody holds them

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Objects pickled before the masking could be left to the next pass held the dicts
        under their public names, zeroed already."""
        for old, new in (("velocity", "_velocity"), ("accumulated", "_accumulated")):
            if old in state:
                state[new] = state.pop(old)
        for key in ("_zeroed", "_spare_u", "_spare"):
            state.setdefault(key, {})
        state.setdefault("_positions", Workspace())
        self.__dict__.update(state)

    velocity = _Settled("_velocity", "u per name, masked (a masking left to the next pass is done now).")
    accumulated = _Settled("_accumulated", "v per name, masked (see velocity).")

    def _settle(self, name: str) -> None:
        """Zero u and v at the positions kept for ``name``, in place: a snapshot that refers to
        them holds the same positions, and zeroing twice changes nothing."""
        idx = self._zeroed.pop(name, None)
        if idx is None:
            return
        for t in (self._velocity.get(name), self._accumulated.get(name)):
            if t is not None and not _native.zero_at(t, idx):  # one C loop, else torch's index_fill_
                t.view(-1).index_fill_(0, idx, 0)

    def _settle_all(self) -> None:
        for name in list(self._zeroed):
            self._settle(name)

    def _clip(self, tensor: Tensor, world: int) -> Tensor:
        limit = self.clip_norm / math.sqrt(world)
        norm = float(tensor.float().norm())
        return tensor * (limit / norm) if norm > limit else tensor

    def compensate(self, tensor: Tensor, name: str, world: int = 1, compressor: Any = None,
                   pieces: Pieces | None = None) -> Tensor:
        if self.clip_norm > 0.0:
            tensor = self._clip(tensor, world)
        u, v = self._velocity.get(name), self._accumulated.get(name)
        if u is not None and u.shape != tensor.shape:
            raise ValueError(f"dgc memory for {name!r} has shape {tuple(u.shape)} but the gradient has "
                             f"{tuple(tensor.shape)}; call memory.reset({name!r}) after changing the model")
        # Out of place into the buffers of the round before last, so the stored u and v are never
        # written while a Rollback snapshot refers to them (snapshot() keeps references, no copies)
        # and no model-size tensor is allocated per step.
        spare_u, spare_v = self._spare_u, self._spare
        zeroed = self._zeroed.get(name)
        if u is None:
            self._settle(name)
            u_new = tensor.clone()
            v_new = u_new.clone() if v is None else v + u_new
        else:
            su = _buffer_like(spare_u.pop(name, None), u)
            sv = _buffer_like(spare_v.pop(name, None), v) if v is not None else None
            # one C pass, the same floats as the two torch lines below; DGC's compressor may compact
            # its candidates in it (when it compresses the result whole, under `key`) and read u and
            # v as zeroed at the positions kept by update()
            key = whole_key(name, tensor.numel(), pieces)
            fused = getattr(compressor, "accumulate_into", None) if key is not None else None
            if (v is not None and sv is not None and fused is not None
                    and fused(u, tensor, v, su, sv, self.momentum, key, zeroed=zeroed)):
                self._zeroed.pop(name, None)
                u_new, v_new = su, sv
            else:
                self._settle(name)
                if v is not None and sv is not None and _native.momentum_accumulate(u, tensor, v, su, sv, self.momentum):
                    u_new, v_new = su, sv
                else:
                    u_new = torch.mul(u, self.momentum, out=su).add_(tensor)
                    v_new = u_new.clone() if v is None else torch.add(v, u_new, out=sv)
            spare_u[name] = u
        if v is not None:
            spare_v[name] = v
        self._velocity[name], self._accumulated[name] = u_new, v_new
        return v_new

    def check(self, compressor: Any) -> None:
        if not getattr(compressor, "sparse", False):
            raise ValueError(f"memory 'dgc' masks the sent coordinates and needs a sparse compressor "
                             f"(payload [values, indices]); got compressor {getattr(compressor, 'name', compressor)!r}. "
                             "Use memory 'residual' with this compressor")

    def update(self, tensor: Tensor, name: str, compressor: Any, payload: list[Tensor], ctx: Any) -> None:
        if not getattr(compressor, "sparse", False) or len(payload) < 2:
            got = getattr(compressor, "name", compressor)
            raise ValueError(f"memory 'dgc' masks the sent coordinates and needs a sparse compressor "
                             f"(payload [values, indices]); got compressor {got!r}. "
                             f"Use memory 'residual' with this compressor")
        if name not in self._velocity:
            raise ValueError(f"memory 'dgc' got update({name!r}) without a compensate({name!r}) first")
        self._settle(name)
        idx = payload[1].to(device=tensor.device).long()
        u, v = self._velocity[name], self._accumulated[name]
        if (getattr(compressor, "accumulate_into", None) is not None and u.numel() >= MASK_LATER_MIN
                and _native.usable(u) and _native.usable(v) and _native.ascending_within(idx, u.numel())):
            # left to the next compensation's pass (a copy: the payload's buffer may be reused)
            self._zeroed[name] = self._positions.transfer(name, idx.numel(), torch.int64, idx.device).copy_(idx)
            return
        # in place: both are this round's new tensors (compensate made them; no snapshot refers to them)
        for t in (u, v):
            if not _native.zero_at(t, idx):  # one C loop, else torch's index_fill_
                t.view(-1).index_fill_(0, idx, 0)

    def snapshot(self) -> Any:
        # compensate() writes only spare buffers, update() only this round's new tensors and a
        # settle zeros positions the snapshot holds as zeroed anyway, so references to the stored
        # ones are a faithful snapshot (no model-size copies per round)
        return dict(self._velocity), dict(self._accumulated), dict(self._zeroed)

    def restore(self, snap: Any) -> None:
        self._velocity, self._accumulated = dict(snap[0]), dict(snap[1])
        self._zeroed = dict(snap[2]) if len(snap) > 2 else {}
        self._spare_u, self._spare = {}, {}  # a spare may be a restored tensor now

    def holds(self, name: str) -> bool:
        return name in self._velocity or name in self._accumulated

    def _live(self, pieces: list[tuple[str | None, int, int]]) -> list[dict[str, Tensor]] | None:
        return [self.velocity, self.accumulated]

    def reset(self, name: str | None = None) -> None:
        if name is None:
            self._velocity.clear()
            self._accumulated.clear()
            self._zeroed.clear()
            self._spare_u, self._spare = {}, {}
        else:
            for d in (self._velocity, self._accumulated, self._zeroed, self._spare_u, self._spare):
                d.pop(name, None)

    owed_keys = ("velocity", "accumulated")  # both are per-rank debt (checkpoint resharding averages them)

    def rescale(self, factor: float) -> None:
        self.velocity = {k: v * factor for k, v in self.velocity.items()}
        self.accumulated = {k: v * factor for k, v in self.accumulated.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": {k: v.detach().clone() for k, v in self.velocity.items()},
                "accumulated": {k: v.detach().clone() for k, v in self.accumulated.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._spare_u, self._spare, self._zeroed = {}, {}, {}
        self._velocity = {k: v.clone() for k, v in state.get("velocity", {}).items()}
        self._accumulated = {k: v.clone() for k, v in state.get("accumulated", {}).items()}

    def __repr__(self) -> str:
        return f"DGCMemory(momentum={self.momentum}, clip_norm={self.clip_norm})"


MASK_LATER_MIN = 1 << 16
"""Tensors from this size leave their masking to the next pass (DGC's fused pass starts there too)."""
