"""The error-feedback cycle, in one place: compensate -> compress -> update.

* :func:`entries` compensates a bucket's gradients with what earlier steps did not send
  (``memory.compensate``) and wraps them as communicator entries;
* the communicator compresses and moves them, and reports what this rank actually contributed
  (:meth:`~adacomp.communicators.base.Entry.charges`);
* :func:`settle` updates every memory from that report once the bucket's ``finish`` has returned
  (for multi-round compressors the report is the last round's mean, so that must wait for
  ``finish``). Communicators never touch a memory;
* :class:`Rollback` keeps the state a round may change (memories, compressors, policy) so a
  non-finite round can be undone bitwise on every rank;
* :class:`LossScale` keeps residuals in the units of the current loss scale: when a
  ``GradScaler``'s scale changes, stored residuals are multiplied by the ratio once, so error
  feedback carries the same unscaled amount as a run without loss scaling (with power-of-two
  scales the multiplication is exact).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
from torch import Tensor

from adacomp.communicators.base import Entry
from adacomp.compressors.base import Compressor
from adacomp.memories.base import Memory, NoneMemory

if TYPE_CHECKING:
    from adacomp.engine.routes import Bucket

_NO_MEMORY = NoneMemory()


def entries(b: "Bucket", grads: list[Tensor], compressors: dict[str, Compressor],
            used: list[bool] | None, world: int, dest: bool = False) -> list[Entry]:
    """Error-compensated entries of bucket ``b`` (one per parameter, or one fused entry).

    ``used[i]`` False marks a parameter this rank did not use in the round: it contributes
    zeros and its residual is left alone (a rank that did not touch a parameter owes it nothing
    new). A joined rank (uneven inputs) passes all False and sends only zeros. ``world``: the
    round's group size (DGC's clipping threshold depends on it), never read from a global. ``dest``:
    the caller's gradients may take their means (:func:`with_dest`): the engine's own ones, not the
    offload worker's pinned copies."""
    mem = b.route.memory
    if b.fused_compressor is not None:
        if used is not None and not any(used):
            return [Entry(b.fused_key, _flatten(b, grads), b.fused_compressor, _NO_MEMORY)]
        pieces = b.communicator.pieces(b.fused_key, sum(g.numel() for g in grads), world)
        return [Entry(b.fused_key, compensate_bucket(mem, b.fused_key, grads, world, b.fused_compressor, pieces,
                                                     lambda: _flatten(b, grads)), b.fused_compressor, mem)]
    out = []
    for i, (n, g) in enumerate(zip(b.names, grads)):
        m = mem if used is None or used[i] else _NO_MEMORY
        e = Entry(n, m.compensate(g, n, world, compressor=compressors[n],
                                  pieces=b.communicator.pieces(n, g.numel(), world)),
                  compressors[n], m)
        out.append(with_dest(e, g) if dest else e)
    return out


def compensate_bucket(mem: Memory, key: str, grads: list[Tensor], world: int, compressor: Compressor,
                      pieces: Any, flatten: Callable[[], Tensor]) -> Tensor:
    """A fused bucket's compensated gradient: written from the gradients where they lie where the
    memory and compressor can (``Memory.compensate_gathered``), else the compensation of
    ``flatten()``, their concatenation: that copy is a read and a write of the whole bucket."""
    summed = mem.compensate_gathered(grads, key, compressor, pieces) if len(grads) > 1 else None
    return summed if summed is not None else mem.compensate(flatten(), key, world, compressor=compressor,
                                                            pieces=pieces)


def with_dest(e: Entry, g: Tensor) -> Entry:
    """``e`` with the raw gradient ``g`` as the place for its mean (:attr:`Entry.dest`) where the
    compensation left ``g`` as it was and kept its sum elsewhere (error feedback into a spare
    buffer), so nothing reads ``g`` again: contiguous float32 of the entry's size, on the CPU."""
    t = e.tensor
    if (not g.is_sparse and g.dtype == torch.float32 and g.device.type == "cpu" and g.is_contiguous()
            and g.numel() == t.numel() and t.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()):
        e.dest = g
    return e


def _flatten(b: "Bucket", grads: list[Tensor]) -> Tensor:
    """The bucket's gradients as one flat tensor, concatenated into a buffer the bucket reuses once
    nothing else holds it (a fresh model-size tensor per step costs more in page faults than the copy)."""
    if len(grads) == 1:
        return grads[0].reshape(-1)
    g0 = grads[0]
    if any(g.dtype != g0.dtype or g.device != g0.device for g in grads):
        return torch.cat([g.reshape(-1) for g in grads])
    n = sum(g.numel() for g in grads)
    return torch.cat([g.reshape(-1) for g in grads], out=b.workspace.output(torch.Size([n]), n, g0.dtype, g0.device))


def settle(entries: list[Entry]) -> None:
    """Error feedback for one finished bucket: each memory keeps what its rank did not contribute
    (``tensor`` minus what the reported payload reconstructs)."""
    for e in entries:
        for charge in e.charges():
            charge.apply()


def exchange(communicator: Any, entries: list[Entry], env: Any) -> list[Tensor]:
    """One bucket through ``communicator`` outside a round (tools, benchmarks, component tests):
    start, finish, settle. Returns the means."""
    out = communicator.finish(communicator.start(entries, env), env)
    settle(entries)
    return out


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Rollback:
    """State a round may change, kept so a non-finite round leaves everything bitwise as it was.

    Memories provide a cheap ``snapshot()`` (references to tensors they replace rather than
    modify); compressors and the policy are small or rare enough to copy."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, Any, Callable[[Any, Any], None]]] = []

    def keep(self, memories: list[Memory], others: list[_Stateful]) -> None:
        self._saved = [(m, m.snapshot(), lambda obj, s: obj.restore(s)) for m in memories]
        self._saved += [(o, copy.deepcopy(o.state_dict()), lambda obj, s: obj.load_state_dict(copy.deepcopy(s)))
                        for o in others]

    def restore(self) -> None:
        for obj, saved, put in self._saved:
            put(obj, saved)

    def clear(self) -> None:
        self._saved = []


class LossScale:
    """Follows a ``torch.amp.GradScaler`` so residuals stay right when its scale changes.

    Gradients arrive multiplied by the scale ``s``; residuals are kept in the same units. At the
    start of a round, if ``s`` differs from the scale the residuals were stored under, every
    memory (and compressor keeping gradient-unit state) is multiplied by ``s_new / s_old``."""

    def __init__(self, scaler: Any = None):
        self.scaler = scaler
        self.units: float | None = None  # the scale stored residuals are expressed in

    def current(self) -> float:
        if self.scaler is None or not self.scaler.is_enabled():
            return 1.0
        return float(self.scaler.get_scale())

    def sync(self, memories: list[Memory], compressors: list[Compressor]) -> None:
        if self.scaler is None:
            return
        s = self.current()
        if self.units is not None and s != self.units:
            ratio = s / self.units
            for m in memories:
                m.rescale(ratio)
            for c in compressors:
                c.rescale(ratio)
        self.units = s

    def adopt(self, scaler: Any) -> None:
        """Follow ``scaler`` from now on, found calling ``optimizer.step`` (``scaler.step(opt)``)
        without having been passed: this round's residuals are in its current scale."""
        self.scaler = scaler
        self.units = self.current()

    def state_dict(self) -> dict[str, Any]:
        return {"units": self.units}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.units = state.get("units")


__all__ = ["Entry", "LossScale", "Rollback", "entries", "exchange", "settle", "with_dest"]
