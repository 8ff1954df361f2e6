"""Error-feedback memory: ``compensate`` adds what earlier steps did not send, ``update`` stores
what this step did not send. GRACE's split (Memory / Compressor / Communicator), with residuals kept
per tensor name and checkpointable.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import torch
from torch import Tensor

from adacomp.compressors import _native
from adacomp.registry import Registry
from adacomp.tensors import flat_of, flat_view

registry: Registry["Memory"] = Registry("memory", "adacomp.memories")
register = registry.register


Pieces = Sequence[tuple[str, int, int]]
"""``(key, lo, hi)``: flat spans of a compensated tensor that its compressor compresses one by one,
each under ``key`` (``Communicator.pieces``; ``alltoall``'s parts). An empty sequence: unknown."""


def whole_key(name: str, numel: int, pieces: Pieces | None) -> str | None:
    """The key under which the compressor compresses the whole tensor, or None when it compresses
    parts of it (or nobody said)."""
    if pieces is None:
        return name
    if len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][2] == numel:
        return pieces[0][0]
    return None


def compensate_fused(compressor: Any, g: Tensor, r: Tensor, out: Tensor, name: str,
                     pieces: Pieces | None) -> bool:
    """``out = g + r`` written by the compressor's ``compensate_into`` (which may select while it
    writes), over the whole tensor or span by span (``pieces``); False, nothing written, where it
    declines everywhere. A span it declines among spans it takes gets the same add here (in C, so
    the spans it took keep their version: their kept selections stay valid)."""
    fused = getattr(compressor, "compensate_into", None)
    if fused is None:
        return False
    key = whole_key(name, out.numel(), pieces)
    if key is not None:
        return bool(fused(g, r, out, key))
    if not pieces:
        return False
    gf, rf, of = flat_of(g), flat_of(r), flat_view(out)
    took = [hi > lo and bool(fused(gf[lo:hi], rf[lo:hi], of[lo:hi], key)) for key, lo, hi in pieces]
    if not any(took):
        return False
    for (_, lo, hi), done in zip(pieces, took):
        if not done and hi > lo and not _native.add_into(gf[lo:hi], rf[lo:hi], of[lo:hi]):
            torch.add(gf[lo:hi], rf[lo:hi], out=of[lo:hi])
    return True


class Memory:
    """Base class. ``compensate`` is called on the raw gradient before compression; ``update`` after
    compression with the payload this rank contributed (or, for multi-round compressors, the mean
    payload of the last round) and the compressor that made it."""

    name: ClassVar[str] = "base"
    payload_blind: ClassVar[bool] = False
    """Whether :meth:`update` reads the payload only through its compressor (``residual``,
    ``defer_residual``), never itself: a communicator whose compressor stands for several
    (``alltoall``'s parts) then need not join their payloads into one per step."""

    def compensate(self, tensor: Tensor, name: str, world: int = 1, compressor: Any = None,
                   pieces: Pieces | None = None) -> Tensor:
        """The gradient to compress. May write into ``tensor``: the engine hands over this round's
        gradient, which the averaged one replaces afterwards (a caller that needs ``tensor``
        unchanged passes a copy). ``world``: the size of the group this round averages over (the
        engine passes it; a memory never reads a process-wide context). ``compressor``: the one
        that will compress the result, when the caller knows it (lets a memory pick a cheaper
        buffer plan for it; the result's values never depend on it). ``pieces``: how that compressor
        compresses the result (None: whole, under ``name``; see :data:`Pieces`), so that it may
        select while the sum is written, span by span. Callers use the returned
        tensor, which need not be ``tensor``, and hand it to :meth:`update`, which may keep it as
        state and rewrite it (no model-size copy per step): a caller that needs the compensated
        values after ``update`` copies them first."""
        raise NotImplementedError

    def compensate_gathered(self, grads: list[Tensor], name: str, compressor: Any = None,
                            pieces: Pieces | None = None) -> Tensor | None:
        """:meth:`compensate` of the concatenation of ``grads`` (a fusion bucket's gradients, in
        order) written from the pieces where they lie, so the caller makes no flattened copy; None
        where this memory or ``compressor`` cannot (the caller flattens and calls :meth:`compensate`)."""
        return None

    def update(self, tensor: Tensor, name: str, compressor: Any, payload: list[Tensor], ctx: Any) -> None:
        raise NotImplementedError

    def check(self, compressor: Any) -> None:
        """Raise ValueError when this memory cannot work with ``compressor`` (checked when the
        config is loaded and when the optimizer is built, before any collective)."""

    def reset(self, name: str | None = None) -> None:
        """Drop stored state (all names when ``name`` is None), e.g. when a tensor's route changes."""

    def holds(self, name: str) -> bool:
        """Whether state is kept under ``name`` (without settling or copying it)."""
        return False

    def regroup(self, name: str, pieces: list[tuple[str | None, int, int]]) -> None:
        """Give the fused bucket ``name`` the state its members had in other buckets: ``pieces``,
        in the new bucket's order, are ``(old key, offset, numel)`` slices of those buckets' flat
        state (``None``: a member with none, zeros). DDP regroups its buckets after the first step,
        and each member's error must carry on as it would unfused. Old keys stay (a rolled-back
        round may need them) until the caller resets them."""
        live = self._live(pieces)
        if live is not None:  # the stored dicts themselves: no copy of the other buckets
            _gather(live, name, pieces)
            return
        state = self.state_dict()
        _gather([state.setdefault(section, {}) for section in self.owed_keys], name, pieces)
        self.load_state_dict(state)

    def _live(self, pieces: list[tuple[str | None, int, int]]) -> list[dict[str, Tensor]] | None:
        """The dicts of :data:`owed_keys` as stored, ready for :meth:`regroup` to add a key to
        (a snapshot holds copies of them); None: go through ``state_dict``."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"memory {self.name!r} is stateless but got state keys {sorted(state)}")

    def snapshot(self) -> Any:
        """Everything needed to undo one round (a non-finite step); a copy unless a subclass
        knows it never modifies stored tensors in place."""
        return copy.deepcopy(self.state_dict())

    def restore(self, snap: Any) -> None:
        self.load_state_dict(copy.deepcopy(snap))

    #: the keys of :meth:`state_dict` holding per-name tensors the averaged update still owes
    owed_keys: ClassVar[tuple[str, ...]] = ()

    def reshard(self, states: list[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
        """This memory's state for ``rank`` of ``world`` from every old rank's state (rank order),
        on resuming with another number of ranks (:mod:`adacomp.checkpoint_reshard`).

        A rank's memory holds what *its* compression has not sent, so the averaged update of
        ``W_old`` ranks still owes ``(1/W_old) * sum_r e_r``. Every new rank gets that mean (a
        name missing on a rank counts as zero): ``(1/W_new) * sum_s e'_s`` is then the same debt,
        and every rank starts from the same memory. Keys outside ``owed_keys`` come from old rank
        ``rank % W_old``."""
        out = dict(states[rank % len(states)])
        for key in self.owed_keys:
            out[key] = {name: _mean(f"{self.name}/{key}/{name}", [s.get(key, {}).get(name) for s in states])
                        for name in _names(states, key)}
        return out

    def owed(self, states: list[dict[str, Any]]) -> dict[str, Tensor]:
        """What the averaged update of the ranks whose ``states`` are given still owes, per
        ``key/name`` (checks and tests: :meth:`reshard` must keep it)."""
        out: dict[str, Tensor] = {}
        for key in self.owed_keys:
            for name in _names(states, key):
                ts = [s.get(key, {}).get(name) for s in states]
                out[f"{key}/{name}"] = sum((t.to(torch.float64) for t in ts if t is not None),
                                           torch.zeros((), dtype=torch.float64)) / len(states)
        return out

    def rescale(self, factor: float) -> None:
        """Multiply stored state by ``factor`` (the loss scale changed; see
        :class:`adacomp.engine.error_feedback.LossScale`). Stateless memories have nothing to do."""
        if self.state_dict():
            raise NotImplementedError(f"memory {self.name!r} keeps state but cannot follow a changing "
                                      "loss scale; implement rescale()")


class OwedSpans(NamedTuple):
    """What a stand-in compressor's ``defer_residual`` returns for a tensor whose spans its
    ``compressor`` compressed one by one (``alltoall``'s parts): that compressor's own token per
    ``(lo, hi)`` span of the flat tensor (None for an empty span). The memory then owes the residual
    to ``compressor``, span by span (:class:`Owed`)."""

    compressor: Any
    spans: tuple[tuple[int, int], ...]
    tokens: tuple[Any, ...]


@dataclass(frozen=True)
class Owed:
    """A residual not yet written: what ``compressor.owed_residual(base, token)`` writes, of the base
    tensor :class:`ResidualMemory` stores under the same name (``Compressor.defer_residual``). The
    compressor adds it inside the next compensation's pass (``compensate_owed``); anything else
    that reads the residual has it written first. ``spans``: the residual is owed span by span of
    the flat tensor, ``token`` holding the compressor's token of each (:class:`OwedSpans`)."""

    compressor: Any
    token: Any
    spans: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def of(cls, compressor: Any, token: Any) -> "Owed":
        """What ``compressor.defer_residual`` returned (``token``), owed to whom its next compensation
        will hand: ``compressor``, or the compressor of the spans for an :class:`OwedSpans`."""
        if isinstance(token, OwedSpans):
            return cls(token.compressor, token.tokens, token.spans)
        return cls(compressor, token)

    def takes(self, compressor: Any, key: str | None, pieces: Pieces | None) -> bool:
        """Whether :meth:`compensate` may run for a compensation by ``compressor`` of the tensor
        compressed whole under ``key``, or in ``pieces``: the same compressor and the same spans."""
        if self.compressor is not compressor:
            return False
        if self.spans is None:
            return key is not None
        return pieces is not None and tuple((lo, hi) for _, lo, hi in pieces) == self.spans

    def write(self, base: Tensor, out: Tensor) -> Tensor:
        """The residual into ``out`` (a tensor like ``base``, not ``base`` itself)."""
        if self.spans is None:
            return self.compressor.owed_residual(base, self.token, out)
        bf, of = flat_of(base), flat_view(out)
        for (lo, hi), token in zip(self.spans, self.token):
            if hi > lo:
                self.compressor.owed_residual(bf[lo:hi], token, of[lo:hi])
        return out

    def compensate(self, g: Tensor, base: Tensor, out: Tensor, key: str | None, pieces: Pieces | None) -> bool:
        """``out = g + residual`` with the residual subtracted inside the compressor's compensation
        pass (``compensate_owed``), whole or span by span (:meth:`takes` said it may); False, nothing
        written, where the compressor declines everywhere. A span it declines among spans it takes
        gets its residual written into ``out`` and ``g`` added there (the same values; the spans it
        took keep their selections)."""
        if self.spans is None:
            assert key is not None  # takes() checked it
            return bool(self.compressor.compensate_owed(g, base, self.token, out, key))
        assert pieces is not None  # takes() checked it
        gf, bf, of = flat_of(g), flat_of(base), flat_view(out)
        took = [hi > lo and bool(self.compressor.compensate_owed(gf[lo:hi], bf[lo:hi], token, of[lo:hi], k))
                for (k, lo, hi), token in zip(pieces, self.token)]
        if not any(took):
            return False
        for (_, lo, hi), token, done in zip(pieces, self.token, took):
            if not done and hi > lo:
                self.compressor.owed_residual(bf[lo:hi], token, of[lo:hi])
                torch.add(gf[lo:hi], of[lo:hi], out=of[lo:hi])
        return True


class Snapshot(NamedTuple):
    """:meth:`ResidualMemory.snapshot`: references to the stored tensors (residuals, or the bases
    of deferred ones) and the deferred residuals."""

    stored: dict[str, Tensor]
    owed: dict[str, Owed]


def _gather(sections: list[dict[str, Tensor]], name: str, pieces: list[tuple[str | None, int, int]]) -> None:
    """:meth:`Memory.regroup` on each per-key dict: ``name`` = the pieces' slices concatenated."""
    for per_key in sections:
        parts = [None if old is None or old not in per_key else per_key[old].reshape(-1)[off:off + n]
                 for old, off, n in pieces]
        like = next((p for p in parts if p is not None), None)
        if like is not None:
            per_key[name] = torch.cat([like.new_zeros(n) if p is None else p for p, (_, _, n) in zip(parts, pieces)])


def fits(buf: Tensor | None, like: Tensor) -> bool:
    """``buf`` can stand in for a tensor like ``like`` (same shape, dtype and device)."""
    return (buf is not None and buf.shape == like.shape and buf.dtype == like.dtype
            and buf.device == like.device)


def _names(states: list[dict[str, Any]], key: str) -> list[str]:
    return sorted({n for s in states for n in s.get(key, {})})


def _mean(what: str, tensors: list[Tensor | None]) -> Tensor:
    present = [t for t in tensors if t is not None]
    shapes = {tuple(t.shape) for t in present}
    if len(shapes) != 1:
        raise ValueError(f"cannot resume {what} on another world size: its shape differs across the "
                         f"old ranks ({sorted(shapes)}); expected one shape per tensor name")
    acc = torch.zeros_like(present[0], dtype=torch.float64)
    for t in present:
        acc += t.to(torch.float64)
    return (acc / len(tensors)).to(present[0].dtype)


def get(name: str, **params: Any) -> Memory:
    return registry.get(name, **params)


def names() -> list[str]:
    return registry.names()


@register("none")
class NoneMemory(Memory):
    """No error feedback: what compression drops is lost."""

    payload_blind = True

    def compensate(self, tensor: Tensor, name: str, world: int = 1, compressor: Any = None,
                   pieces: Pieces | None = None) -> Tensor:
        return tensor

    def update(self, tensor: Tensor, name: str, compressor: Any, payload: list[Tensor], ctx: Any) -> None:
        return None


@register("residual")
class ResidualMemory(Memory):
    """Classic error feedback (EF-SGD; ADTopk paper §2.2, GRACE's ResidualMemory).

    compensate: ``g + beta * r``; update: ``r = compensated - decompress(compress(compensated))``.
    Resumed on another world size, every rank gets the mean residual (:meth:`Memory.reshard`).
    ``beta`` scales the residual (1.0 = plain error feedback); ``gamma`` scales the new gradient.

    No model-size tensor is allocated per step: ``update`` writes the new residual into the buffer
    that held the residual of the round before (two buffers per tensor, alternating). The residual
    stored now is never written, so a snapshot holding references stays valid (:meth:`snapshot`).
    ``compensate`` adds the residual into the gradient it is given (the engine hands over this
    round's gradient, which is replaced by the averaged one afterwards); for a compressor whose
    ``residual`` may write over its input (``residual_in_place``: the sparsifiers, which only zero
    the sent coordinates) it adds into that spare buffer instead, and ``update`` zeroes the sent
    coordinates there: the same values, without copying the whole compensated tensor (a read and a
    write of the model per step). A compressor with ``compensate_into(g, r, out, name)`` (Top-k,
    Gaussian-k, EF-SignSGD) may write that sum itself (into the spare buffer, or into the gradient)
    and read what it needs of it in the same pass; the values are the same add's.
    """

    owed_keys = ("residuals",)
    payload_blind = True  # update hands the payload to the compressor's residual / defer_residual only
    defers: ClassVar[bool] = True
    """Whether :meth:`update` may leave a residual owed to the next compensation's pass
    (``Compressor.defer_residual``): a speed path, the results are the same either way; the switch
    of ``adacomp bench cost cell --toggle adacomp.memories.base:ResidualMemory.defers --cells N``."""

    def __init__(self, beta: float = 1.0, gamma: float = 1.0):
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {gamma}")
        self.beta = float(beta)
        self.gamma = float(gamma)
        self._stored: dict[str, Tensor] = {}  # the residual, or the base of a deferred one (_owed)
        self._owed: dict[str, Owed] = {}
        self._spare: dict[str, Tensor] = {}  # the other buffer of each pair: next update writes it

    @property
    def residuals(self) -> dict[str, Tensor]:
        """Every residual as a tensor, per name: a deferred one is written now (into a new tensor;
        its base stays as a snapshot may hold it)."""
        for name in list(self._owed):
            self._settle(name)
        return self._stored

    @residuals.setter
    def residuals(self, value: dict[str, Tensor]) -> None:
        self._stored = value
        self._owed = {}

    def _settle(self, name: str) -> Tensor:
        """Write the residual deferred for ``name`` (see :class:`Owed`) into a new tensor."""
        owed = self._owed.pop(name)
        base = self._stored[name]
        self._stored[name] = owed.write(base, torch.empty_like(base))
        return self._stored[name]

    def compensate(self, tensor: Tensor, name: str, world: int = 1, compressor: Any = None,
                   pieces: Pieces | None = None) -> Tensor:
        r = self._stored.get(name)
        if self.gamma != 1.0:
            tensor.mul_(self.gamma)
        if r is None:
            return tensor
        if r.shape != tensor.shape:
            raise ValueError(f"residual for {name!r} has shape {tuple(r.shape)} but the gradient has "
                             f"{tuple(tensor.shape)}; call memory.reset({name!r}) after changing the model")
        in_place = getattr(compressor, "residual_in_place", False)
        owed = self._owed.get(name)
        key = whole_key(name, tensor.numel(), pieces)
        if owed is not None and not (in_place and self.beta == 1.0 and owed.takes(compressor, key, pieces)):
            r, owed = self._settle(name), None
        if in_place:
            # the same add as below, into the buffer update() will keep (see the class docstring);
            # ``tensor`` stays the raw gradient on every step, first ones and resumed ones included,
            # so whoever reads it later (L-GreCo's accumulators) sees the same thing on every path
            kept = self._spare.get(name)
            spare = kept if kept is not None and fits(kept, tensor) and kept is not r else torch.empty_like(tensor)
            self._spare[name] = spare
            if owed is not None:  # the residual's subtraction inside the compensation's pass
                if owed.compensate(tensor, r, spare, key, pieces):
                    return spare
                r = self._settle(name)
            if self.beta != 1.0:
                return torch.add(tensor, r, alpha=self.beta, out=spare)
            # a compressor may write the sum itself and select from it in the same pass (Top-k)
            if compensate_fused(compressor, tensor, r, spare, name, pieces):
                return spare
            if _native.add_into(tensor, r, spare):  # the same add; large buffers written without a read
                return spare
            return torch.add(tensor, r, out=spare)
        if self.beta == 1.0:
            # a compressor may read what it needs of the sum while it is written (EF-SignSGD's scale)
            if compensate_fused(compressor, tensor, r, tensor, name, pieces):
                return tensor
            return tensor.add_(r)
        return tensor.add_(r, alpha=self.beta)

    def compensate_gathered(self, grads: list[Tensor], name: str, compressor: Any = None,
                            pieces: Pieces | None = None) -> Tensor | None:
        # the in-place route of compensate() (sum into the spare buffer), by the compressor's pass
        # over the pieces (compensate_segments): the same adds and the same selection
        fused = getattr(compressor, "compensate_segments", None)
        numel = sum(g.numel() for g in grads)
        key = whole_key(name, numel, pieces)
        if fused is None or key is None:
            return None
        return self.compensate_with(name, numel, compressor, lambda r, out: bool(fused(grads, r, out, key)))

    def compensate_with(self, name: str, numel: int, compressor: Any,
                        write: Callable[[Tensor, Tensor], bool]) -> Tensor | None:
        """The compensated tensor of ``name`` written by ``write(r, out)`` (``out = gradient + r``
        for a gradient the caller never materialises: the divisible scheme's second stage adds the
        ranks' sparse mean straight from their payloads) into the buffer :meth:`update` keeps,
        where :meth:`compensate` would add into that buffer: a stored residual of ``numel``
        elements and no deferred one, ``beta = gamma = 1``, a compressor whose residual may
        overwrite its input. None where it would not, or ``write`` declined: the caller writes the
        gradient and calls :meth:`compensate`."""
        r = self._stored.get(name)
        if (r is None or r.numel() != numel or name in self._owed or self.beta != 1.0 or self.gamma != 1.0
                or not getattr(compressor, "residual_in_place", False)):
            return None
        kept = self._spare.get(name)
        spare = kept if kept is not None and fits(kept, r) and kept is not r else torch.empty_like(r)
        self._spare[name] = spare
        return spare if write(r, spare) else None

    def update(self, tensor: Tensor, name: str, compressor: Any, payload: list[Tensor], ctx: Any) -> None:
        out = self._spare.pop(name, None)
        self._owed.pop(name, None)
        if out is not None and out is tensor and getattr(compressor, "residual_in_place", False):
            # compensate() wrote into the spare buffer: the residual is made there in place, or
            # left to the next compensation's pass where the compressor can subtract it there
            defer = self._deferrable(compressor)
            token = defer(tensor, payload, ctx) if defer is not None else None
            if token is not None:
                self._owed[name] = Owed.of(compressor, token)
            else:
                compressor.residual(tensor, payload, ctx, out)
        else:
            if (not fits(out, tensor)
                    or out.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()):  # type: ignore[union-attr]
                out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            assert out is not None
            compressor.residual(tensor, payload, ctx, out)
        old = self._stored.get(name)
        self._stored[name] = out
        if old is not None and old.shape == out.shape:
            self._spare[name] = old

    def _deferrable(self, compressor: Any) -> Callable[[Tensor, list[Tensor], Any], Any] | None:
        """The compressor's ``defer_residual``, where this memory's next compensation takes a residual
        left owed (:meth:`compensate`)."""
        return getattr(compressor, "defer_residual", None) if self.defers else None

    def holds(self, name: str) -> bool:
        return name in self._stored or name in self._owed

    def _live(self, pieces: list[tuple[str | None, int, int]]) -> list[dict[str, Tensor]] | None:
        for old in {old for old, _, _ in pieces if old is not None and old in self._owed}:
            self._settle(old)  # into a new tensor: a snapshot's references stay as they were
        return [self._stored]

    def reset(self, name: str | None = None) -> None:
        if name is None:
            self._stored.clear()
            self._owed.clear()
            self._spare.clear()
        else:
            self._stored.pop(name, None)
            self._owed.pop(name, None)
            self._spare.pop(name, None)

    def snapshot(self) -> Any:
        # update never writes a stored residual or the base of a deferred one (it writes the spare
        # buffer), so references are a faithful snapshot at no copy cost.
        return Snapshot(dict(self._stored), dict(self._owed))

    def restore(self, snap: Any) -> None:
        self._stored, self._owed = dict(snap.stored), dict(snap.owed)
        self._spare.clear()  # a spare may be a restored residual now

    def rescale(self, factor: float) -> None:
        self.residuals = {k: v * factor for k, v in self.residuals.items()}
        self._spare.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.detach().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}
        self._spare.clear()
