"""Ok-Topk: one threshold for the fused gradient of all layers, re-estimated every ``period`` steps.

Li and Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning" (PPoPP 2022), as
summarised in ADTopk §2.2: a single threshold over the gradients of all layers (global, not
layer-wise, sparsification: ``granularity = "bucket"``, so the optimizer hands this compressor the
flattened gradient of a whole fusion bucket), estimated as the exact k-th largest magnitude and
*reused* in the iterations between two estimations because the gradient distribution changes
slowly. ``period`` = 32 is the re-estimation interval of the authors' VGG / LSTM scripts (128 for
BERT).

Ok-Topk's *global* phase (split the index space into balanced regions reduced on their owners,
a global threshold, an allgather of about k values) needs collectives, which a compressor never
calls: it lives in the ``oktopk`` communicator (:mod:`adacomp.communicators.oktopk`), this
compressor's default. With ``allgather`` instead, the ranks' local selections are summed and the
aggregate holds up to P * k non-zeros.

Count-band correction (:mod:`adacomp.compressors._band`): after a reused threshold selects ``c``
elements, ``c`` outside [2k/3, 5k/4] nudges the next step's threshold by x1.012 (the authors'
code), and ``c`` outside [k/2, 2k] re-estimates at once (exact top-k this step), so the density
stays within 0.5x-2x of the target when the gradient's scale or the residual drifts. The authors'
dense warm-up iterations are left out. At least one element is always sent.

State (``state_dict``): the step counter, and per bucket name its threshold and the step of its
last estimation. Payload ``[values, indices]`` of variable size; biased: pair with ``residual``.
Communicators: ``oktopk`` (default), ``allgather``.
"""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from adacomp.compressors import _native
from adacomp.compressors._band import HARD_HIGH, judge
from adacomp.compressors.base import register
from adacomp.compressors.sparse import (TINY, SparseCompressor, ThresholdCounter, k_for, largest_k,
                                        sample_lines_pieces, sampled_value)
from adacomp.compressors.topk import _expected, topk_indices


@register("oktopk")
class OkTopkCompressor(SparseCompressor):
    """Global threshold reuse. ``density``: target fraction (ADTopk §6: 0.01). ``period``: steps
    between exact re-estimations (Ok-Topk's tau', 32); 1 makes it an exact top-k every step."""

    granularity: ClassVar[str] = "bucket"
    #: used when the config names no communicator (config.from_dict)
    default_communicator: ClassVar[str] = "oktopk"

    def __init__(self, density: float = 0.01, period: int = 32):
        super().__init__(density)
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(f"period must be an int >= 1, got {period!r}")
        self.period = period
        self._step = 0
        self._threshold: dict[str, float] = {}
        self._estimated_at: dict[str, int] = {}

    def on_step(self, step: int) -> None:
        self._step = int(step)

    def due(self, name: str) -> bool:
        """True when ``name``'s threshold must be (re-)estimated at the current step."""
        last = self._estimated_at.get(name)
        return last is None or self._step - last >= self.period or self._step < last

    def threshold(self, name: str) -> float | None:
        return self._threshold.get(name)

    def set_density(self, density: float) -> None:
        super().set_density(density)
        self._estimated_at.clear()  # a new k needs a new threshold at the next call

    def compensate_into(self, g: Tensor, r: Tensor, out: Tensor, name: str) -> bool:
        """Between two estimations the threshold is known before the compensation, so error
        feedback's add ``out = g + r`` counts ``|out| >= thr`` (the selection's size, which the count
        band judges) and lists the selection, or, where the band will re-estimate, enough of the
        largest for the exact top-k (:class:`Known`), kept for :meth:`select`: |g| is neither written
        nor read again. False (the caller adds) at an estimation step, or where the C pass cannot run."""
        return self.compensate_segments([g], r, out, name)

    def compensate_segments(self, gs: list[Tensor], r: Tensor, out: Tensor, name: str) -> bool:
        """:meth:`compensate_into` of ``g = torch.cat(gs)`` (a fusion bucket's gradients) read where the
        pieces lie, so the engine makes no flattened copy of the bucket (a read and a write of it).
        False (nothing written) where it would decline, or the C pass cannot run."""
        thr = self._threshold.get(name)
        if thr is None or self.due(name) or out.dtype != torch.float32:
            return False
        flat, rf = out.reshape(-1), r.reshape(-1)
        n = flat.numel()
        k = k_for(n, self._density)
        if k >= n:
            return False
        pieces = [g.reshape(-1) for g in gs]
        # room for twice the count band's top (HARD_HIGH k): a selection that passes more than the top
        # re-estimates, and while it is listed whole the exact top-k comes from the list (no second
        # pass). Where the last call on this tensor missed the band (early in training the residual
        # grows past the reused threshold), a sample of the sum says how many will pass: far above
        # the band the list starts at the sample's floor for ~1.5 k, below k at the lower of that
        # floor and the threshold
        floor, cap = thr, int(2 * HARD_HIGH * k)
        if name in self._hot():
            sample = sample_lines_pieces(pieces, rf)
            if sample is not None:
                share = _expected(k, n)
                expect = float((sample.abs() >= thr).sum()) / sample.numel() * n
                at = max(sampled_value(sample, share, absolute=True), TINY)
                if expect > 3 * k:
                    floor = max(thr, at)
                elif expect < k:
                    floor = min(thr, at)
                cap = max(cap, int(2 * share * n))
        got = _native.add_count_select(pieces, rf, flat, thr, floor, cap)
        if got is None:
            return False
        if not got.nan:  # with a NaN the selection counts |x| >= thr itself, which a NaN fails, as the list does
            self._kept().keep(name, flat, Known(got.idx, got.vals, got.counted, floor))
        return True

    def _hot(self) -> set[str]:
        """Tensors whose last selection missed the band: a speed hint, never state."""
        return self.__dict__.setdefault("hot", set())

    def select(self, flat: Tensor, name: str) -> Tensor:
        return self.choose(flat, name)[0]

    def choose(self, flat: Tensor, name: str) -> tuple[Tensor, Tensor | None]:
        """The selection, with its values where the compensation's list holds them (no gather)."""
        k = k_for(flat.numel(), self._density)
        if k >= flat.numel():
            return torch.arange(flat.numel(), device=flat.device), None
        ws = self._workspace()
        if not self.due(name):
            thr = self._threshold[name]
            known = self._kept().take(name, flat)  # the compensation's pass counted, and listed
            if not isinstance(known, Known):
                a = ws.magnitudes(flat)  # |g| in a reused buffer: one pass, no page faults
                idx = ThresholdCounter(a, strict=False, workspace=ws).select(thr, self._density)
                known = Known(idx, None, idx.numel(), thr)
            verdict = judge(thr, known.counted, k)
            (self._hot().add if verdict.reestimate else self._hot().discard)(name)
            chosen = known.top(k) if verdict.reestimate else known.at(thr)
            if chosen is not None:
                if verdict.reestimate:  # the exact top-k, as the estimation below finds it
                    self._estimate(flat, name, *chosen)
                else:
                    self._threshold[name] = verdict.threshold
                if chosen[0].numel():
                    return chosen
                return _first_max(flat).view(1), None
            if not verdict.reestimate:  # listed from a floor above the threshold: the selection's own pass
                idx = ThresholdCounter(ws.magnitudes(flat), strict=False, workspace=ws).select(thr, self._density)
                self._threshold[name] = verdict.threshold
                return (idx if idx.numel() else _first_max(flat).view(1)), None
        idx = topk_indices(flat.float(), k, ws)  # exactly the k largest at an estimation step
        self._estimate(flat, name, idx, None)
        return idx, None

    def _estimate(self, flat: Tensor, name: str, idx: Tensor, vals: Tensor | None) -> None:
        """The threshold of an estimation step: the smallest |value| of the k selected (``vals``:
        their values, where at hand), no pass over the tensor."""
        if vals is None:
            vals = flat.index_select(0, idx) if flat.dtype == torch.float32 else \
                self._workspace().magnitudes(flat).index_select(0, idx)
        self._threshold[name] = float(vals.abs().min())
        self._estimated_at[name] = self._step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "threshold": dict(self._threshold), "estimated_at": dict(self._estimated_at)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state.get("step", 0))
        self._threshold = {k: float(v) for k, v in state.get("threshold", {}).items()}
        self._estimated_at = {k: int(v) for k, v in state.get("estimated_at", {}).items()}

    def __repr__(self) -> str:
        return f"OkTopkCompressor(density={self._density}, period={self.period})"


class Known(NamedTuple):
    """What Ok-Topk's compensation pass found of a compensated tensor (kept until its selection):
    how many ``|x| >= thr`` (``counted``), and the positions (ascending) and signed values of every
    ``|x| >= floor`` (``idx`` None where more than the room passed). NaN-free: with a NaN nothing is
    kept."""

    idx: Tensor | None
    vals: Tensor | None
    counted: int
    floor: float

    def at(self, thr: float) -> tuple[Tensor, Tensor | None] | None:
        """The selection ``|x| >= thr`` and its values (None: not listed), where the list holds it."""
        if self.idx is None or self.floor > thr:
            return None
        if self.floor == thr or self.vals is None:
            return self.idx, self.vals
        keep = self.vals.abs() >= thr
        return self.idx[keep], self.vals[keep]

    def top(self, k: int) -> tuple[Tensor, Tensor] | None:
        """The exact top-k and its values (:func:`topk_indices`'s set: every ``|x| >= floor`` is
        listed, and k of them at least, so the k-th magnitude and its ties are among them), where the
        list holds it."""
        if self.idx is None or self.vals is None or self.idx.numel() < k:
            return None
        got = _native.pick_largest(self.vals, self.idx, k, None)
        if got is not None:
            return got
        idx = largest_k(self.idx, self.vals, k)
        return idx, self.vals[torch.searchsorted(self.idx, idx)]


def _first_max(flat: Tensor) -> Tensor:
    """The first position of the largest magnitude: what a selection that passed nothing sends."""
    stats = _native.abs_stats(flat, None) if _native.usable(flat) and flat.numel() else None
    return torch.tensor(stats.argmax) if stats is not None else flat.abs().argmax()
