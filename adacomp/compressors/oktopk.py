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

from typing import Any, ClassVar

import torch
from torch import Tensor

from adacomp.compressors import _native
from adacomp.compressors._band import HARD_HIGH, judge
from adacomp.compressors.base import register
from adacomp.compressors.sparse import SparseCompressor, ThresholdCounter, k_for
from adacomp.compressors.topk import topk_indices


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
        feedback's add ``out = g + r`` lists the positions of ``|out| >= thr`` (the selection, as
        :meth:`select` makes it) and the first position of the largest magnitude from the same pass,
        kept for :meth:`select`: |g| is neither written nor read again. False (the caller adds) at an
        estimation step, or where the C pass cannot run."""
        thr = self._threshold.get(name)
        if thr is None or self.due(name) or out.dtype != torch.float32:
            return False
        flat = out.reshape(-1)
        k = k_for(flat.numel(), self._density)
        if k >= flat.numel():
            return False
        # room for the count band's top (HARD_HIGH k): above it the step re-estimates, so a larger
        # selection is counted, not listed (early in training the residual grows past it)
        got = _native.add_abs_stats(g.reshape(-1), r.reshape(-1), flat, thr, strict=False, upto=int(HARD_HIGH * k))
        if got.done and got.stats is not None and got.passed >= 0:
            self._kept().keep(name, flat, (got.cands[0] if got.cands is not None else None, got.passed,
                                           got.stats.argmax))
        return got.done

    def compensate_segments(self, gs: list[Tensor], r: Tensor, out: Tensor, name: str) -> bool:
        """:meth:`compensate_into` of ``g = torch.cat(gs)`` (a fusion bucket's gradients) read where the
        pieces lie, so the engine makes no flattened copy of the bucket (a read and a write of it):
        the same sums, the same list, kept the same way. False (nothing written) where it would
        decline, or the C pass cannot run."""
        thr = self._threshold.get(name)
        if thr is None or self.due(name) or out.dtype != torch.float32:
            return False
        flat = out.reshape(-1)
        k = k_for(flat.numel(), self._density)
        if k >= flat.numel():
            return False
        got = _native.add_select_segments([g.reshape(-1) for g in gs], r.reshape(-1), flat, thr, ordered=True,
                                          upto=int(HARD_HIGH * k))
        if got is None:
            return False
        # with a NaN sum compensate_into keeps nothing and the selection counts |sum| >= thr itself,
        # which a NaN fails: the list here, where no NaN passes either
        if isinstance(got, int):
            self._kept().keep(name, flat, (None, got, -1))  # above the band: re-estimated, no list read
            return True
        idx, _ = got
        first_max = -1
        if not idx.numel():  # nothing passed: the selection falls back to the first largest magnitude
            stats = _native.abs_stats(flat, None)
            first_max = stats.argmax if stats is not None else int(flat.abs().argmax())
        self._kept().keep(name, flat, (idx, idx.numel(), first_max))
        return True

    def select(self, flat: Tensor, name: str) -> Tensor:
        k = k_for(flat.numel(), self._density)
        if k >= flat.numel():
            return torch.arange(flat.numel(), device=flat.device)
        ws = self._workspace()
        if not self.due(name):
            known = self._kept().take(name, flat)  # the compensation's pass selected (or counted) already
            a: Tensor | None = None
            idx: Tensor | None = None
            if isinstance(known, tuple):
                idx, count, first_max = known
            else:
                a = ws.magnitudes(flat)  # |g| in a reused buffer: one pass, no page faults
                idx = ThresholdCounter(a, strict=False, workspace=ws).select(self._threshold[name], self._density)
                count = idx.numel()
            verdict = judge(self._threshold[name], count, k)
            if not verdict.reestimate and idx is not None:
                self._threshold[name] = verdict.threshold
                if idx.numel():
                    return idx
                return a.argmax().view(1) if a is not None else torch.tensor([first_max], dtype=torch.int64)
        idx = topk_indices(flat.float(), k, ws)  # exactly the k largest at an estimation step
        kth = flat.index_select(0, idx).abs() if flat.dtype == torch.float32 else ws.magnitudes(flat).index_select(0, idx)
        self._threshold[name] = float(kth.min())  # |the k selected| only: no pass over the tensor
        self._estimated_at[name] = self._step
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "threshold": dict(self._threshold), "estimated_at": dict(self._estimated_at)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state.get("step", 0))
        self._threshold = {k: float(v) for k, v in state.get("threshold", {}).items()}
        self._estimated_at = {k: int(v) for k, v in state.get("estimated_at", {}).items()}

    def __repr__(self) -> str:
        return f"OkTopkCompressor(density={self._density}, period={self.period})"
