"""ADTopk, ADTopk-i and ADTopk-t (Ming et al., HPDC'24, "ADTopk: All-Dimension Top-k Compression").

* ``adtopk`` (§4.1, matrix-based sparsification + multiple local sortings): view the gradient as an
  M x N matrix and take the largest ``k // M`` magnitudes of every row (at least one), each row
  sorted on its own, so no row ("dimension") is missing from the update.
* ``adtopk_i`` (§4.2, Alg. 1): ADTopk and traditional Top-k interleaved, one per iteration, the same
  choice for all layers within an iteration.
* ``adtopk_t`` (§4.3, Alg. 2): Alg. 1 whose Top-k iterations run ``ThresholdTopk``: warm-up with
  exact Top-k, then reuse the k-th largest magnitude as a threshold, re-estimated every tau
  iterations with tau adapted from the threshold's drift, and ADTopk in the last quarter of
  training once the threshold is stable.

Which rows (``split``). The paper leaves M "determined by the neural network layer" and calls the
rows channels / attention heads. ``split="rows"`` (default) uses M = shape[0] (output channels of a
conv, output neurons of a linear layer, one row per head-sized slice of the leading dimension).
``split="dim1"`` follows the authors' code (their ``adtopk.py``): one row per fiber along dim 1
(M = numel / shape[1]; for a conv, every (out, kh, kw) position selects over the input channels).
With ``dim1`` small fan-in layers go nearly dense (ResNet conv1 (64, 3, 7, 7) sends 1/3 of its
elements at any density); with ``rows`` the same layer sends max(k, 64).

Keeping the total at k. With k = q*M + r, every row gives q and the r rows whose (q+1)-th largest
magnitude is biggest give one more, so exactly k elements are sent when k >= M. When k < M every
row still gives one (the paper's "at least one"), so M are sent: :meth:`ADTopkCompressor.
effective_density` reports that, and ``compression_stats()`` the last value per tensor. The
authors' code uses k_row = max(1, floor(shape[1] * density)), which rounds the total down.

Speed on CPU (same results). Per-row torch.topk costs ~9 ns per element on CPU, so float tensors
from 2^14 elements go through :func:`fast_row_topk` (a per-row candidate floor from block maxima,
one compare pass that also writes error feedback's sum and keeps the candidates' signed values, the
selection from those in one C call, torch.topk kept for NaN / tied rows; a dead unit's all-zero
row takes the columns torch.topk takes on a row of equal values); traditional Top-k
uses the prefiltered :func:`~adacomp.compressors.topk.topk_indices`; ADTopk-t's threshold reuse
compares |x| in a scratch buffer and reads the mask word by word. Every one of them returns the
same index set as the plain calls (tested against them, ties and NaN included); CUDA tensors and
float64 keep the plain calls. Index order may differ (payloads are scattered, order-free); the fast
row path's is ascending, which the all-gather's C mean reads in one pass.

All three are biased: pair with ``residual`` memory. ``adtopk`` / ``adtopk_i`` payload sizes depend
only on the shape and the (shared) step: ``allgather_fast`` fits; ``adtopk_t``'s threshold phase is
variable-size: use ``allgather``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from adacomp import devices
from adacomp.compressors import _native
from adacomp.compressors.base import Payload, register
from adacomp.compressors._rowtopk import (Candidates, compensated_candidates, fast_eligible, fast_row_topk,
                                          matrix_shape, row_topk)
from adacomp.compressors.sparse import SparseCompressor, SparseCtx, k_for, nonzero_1d
from adacomp.compressors.topk import prefilters, topk_indices

SPLITS = ("rows", "dim1")


@register("adtopk")
class ADTopkCompressor(SparseCompressor):
    """All-dimension Top-k (§4.1): the largest ``k // M`` of every row of the M x N view.

    ``density``: target fraction (paper: 0.001-0.05, default 0.01). ``split``: ``rows`` (M =
    shape[0], default) or ``dim1`` (authors' code, fibers along dim 1). 1-D tensors are one row,
    i.e. plain Top-k.
    """

    fixed_size = True
    fast_cpu = True  # False: the plain torch calls everywhere (the reference the fast paths equal)

    def __init__(self, density: float = 0.01, split: str = "rows"):
        super().__init__(density)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.split = split
        self.last_density: dict[str, float] = {}

    def effective_density(self, shape: torch.Size) -> float:
        """Fraction actually sent for ``shape``: max(k, M) / numel."""
        numel = int(torch.Size(shape).numel())
        m, _, _ = matrix_shape(torch.Size(shape), self.split)
        return min(numel, max(k_for(numel, self._density), m)) / max(1, numel)

    def compression_stats(self) -> dict[str, float]:
        """Effective density of the last compression of every tensor name."""
        return dict(self.last_density)

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        numel = int(torch.Size(shape).numel())
        return round(self.effective_density(shape) * numel) * (itemsize + 8)

    def compensate_into(self, g: Tensor, r: Tensor, out: Tensor, name: str) -> bool:
        """``out = g + r`` (error feedback's compensation, torch.add's bits) with the fast rows'
        candidates from the same pass, each row compensated just before its block maxima and compare
        read it (:func:`compensated_candidates`), kept for :meth:`adtopk_indices` of ``out``. False
        (nothing written) where that path would not run: the caller adds. Only where every call
        selects all-dimension (the -i / -t variants may take plain Top-k instead)."""
        if type(self).indices is not ADTopkCompressor.indices or not (self.fast_cpu and fast_eligible(out)):
            return False
        m, n, rr = matrix_shape(out.shape, self.split)
        k = k_for(out.numel(), self._density)
        if m == 1 or k >= out.numel() or not (_native.usable(g) and _native.usable(r) and _native.usable(out)):
            return False
        got = compensated_candidates(g, r, out, m, n, rr, k)
        if isinstance(got, Candidates):
            self._kept().keep(name, out.reshape(-1), got)
        return got is not False

    def adtopk_indices(self, tensor: Tensor, name: str | None = None) -> Tensor:
        """Flat indices chosen by all-dimension Top-k (``name``: the tensor's, for what its
        compensation's pass found)."""
        return self.adtopk_pick(tensor, name)[0]

    def adtopk_pick(self, tensor: Tensor, name: str | None = None) -> tuple[Tensor, Tensor | None]:
        """:meth:`adtopk_indices` and, where the fast rows' candidates carried them (float32), the
        chosen elements' values (the payload's, with no gather from the tensor); else None."""
        numel = tensor.numel()
        m, n, rr = matrix_shape(tensor.shape, self.split)
        k = k_for(numel, self._density)
        known = self._kept().take(name, tensor.reshape(-1)) if name is not None else None
        if m == 1:
            flat = tensor.reshape(-1)
            if (self.fast_cpu and fast_eligible(tensor) and k < numel and not prefilters(flat, k)
                    and flat.device.type == "cpu"):
                whole = _native.pick_largest(flat, None, k, None)  # a small 1-D tensor whole in one C call
                if whole is not None:  # (None on a NaN: torch's path below)
                    return whole
            return self.topk(tensor, k), None
        if self.fast_cpu and fast_eligible(tensor) and k < numel:
            got = fast_row_topk(tensor, m, n, rr, k, self._workspace(),
                                known if isinstance(known, Candidates) else None)
            if got is not None:
                return got.idx, got.vals
        if rr == 1:
            rows, cols = row_topk(tensor.reshape(m, n).abs(), k)
            return rows * n + cols, None
        s0 = int(tensor.shape[0])
        fibers = tensor.reshape(s0, n, rr).transpose(1, 2).abs().reshape(m, n)
        rows, cols = row_topk(fibers, k)
        return (rows // rr) * (n * rr) + cols * rr + rows % rr, None

    def topk(self, tensor: Tensor, k: int) -> Tensor:
        """Traditional Top-k of the flattened tensor; prefiltered on CPU (same set as torch.topk)."""
        fast = self.fast_cpu and fast_eligible(tensor)
        return topk_indices(tensor.reshape(-1), k, self._workspace() if fast else None)

    def indices(self, tensor: Tensor, name: str) -> Tensor:
        return self.adtopk_indices(tensor, name)

    def select(self, flat: Tensor, name: str) -> Tensor:
        return self.indices(flat, name)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        if type(self).indices is ADTopkCompressor.indices:
            idx, vals = self.adtopk_pick(tensor, name)
        else:
            idx, vals = self.indices(tensor, name), None
        self.last_density[name] = idx.numel() / max(1, flat.numel())
        if vals is None:
            vals = _native.take(flat, idx)
        return [vals, idx], SparseCtx(tensor.shape, flat.numel(), tensor.dtype, tensor.device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(density={self._density}, split={self.split!r})"


@register("adtopk_i")
class ADTopkICompressor(ADTopkCompressor):
    """ADTopk-i (§4.2, Alg. 1): ADTopk on iterations 1, 3, 5, ... and traditional Top-k on 2, 4, ...

    Alg. 1 starts with isAllDimension = True and flips it after each call; the paper then asks for
    the same choice across all layers of an iteration, so the choice is taken from the step count
    (:meth:`on_step`), not from per-tensor call counts. The authors' code always uses ADTopk for
    layers named ``*fc*``; that name rule is left to the YAML ``layers`` overrides.
    """

    def __init__(self, density: float = 0.01, split: str = "rows"):
        super().__init__(density, split)
        self._step = 0

    def all_dimension(self) -> bool:
        """isAllDimension of Alg. 1 for the current iteration."""
        return self._step % 2 == 0

    def indices(self, tensor: Tensor, name: str) -> Tensor:
        if self.all_dimension():
            return self.adtopk_indices(tensor)
        return self.topk(tensor, k_for(tensor.numel(), self._density))

    def on_step(self, step: int) -> None:
        self._step = int(step)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state.get("step", 0))


@dataclass
class ThresholdState:
    """Alg. 2's per-layer variables. ``since``: ThresholdTopk calls since the last exact estimate
    (the estimate counts as 1); ``stable``: the last re-estimate moved the threshold by < epsilon."""

    tau: int
    thr_reuse: float = -1.0
    eps: float = 0.0
    since: int = 0
    stable: bool = False


# Actions of ADTopk-t, one per compress call (see ADTopkTCompressor.decide).
INTERLEAVE, WARMUP, LATE, REESTIMATE, REUSE = "adtopk", "warmup", "late", "reestimate", "reuse"


@register("adtopk_t")
class ADTopkTCompressor(ADTopkCompressor):
    """ADTopk-t (§4.3, Alg. 2): ADTopk interleaved with ``ThresholdTopk`` (§5).

    Per call, with t = completed steps + 1 (Alg. 1's t > 0), :meth:`decide` picks one action:

    1. ``adtopk``: t odd and ``interleave`` (Alg. 1; ThresholdTopk replaces TradTopk, §5).
    2. ``warmup``: t < ``sigma`` (15): exact Top-k; thr_reuse = min |values|, epsilon = thr / 10.
    3. ``late``: t > ``total_iters`` * 3/4 and the layer's threshold is stable: ADTopk.
    4. ``reestimate``: ``tau`` ThresholdTopk calls since the last estimate: exact Top-k,
       thr = min |values|, epsilon = thr / 10; |thr - thr_reuse| < epsilon: tau + 1 (stable);
       > 2 epsilon: tau - 1 (not below ``tau_min``); thr_reuse = thr.
    5. ``reuse``: send every |g| > thr_reuse (variable size).

    Deviations, stated: Alg. 2 line 5 tests ``thr_reuse < 10 * epsilon``, but lines 10 and 16 set
    epsilon = thr / 10 and thr_reuse = thr together, so the literal test compares a number with
    itself; §4.3 step 2 says ADTopk is used "when the threshold change is small", and the authors'
    code keeps a per-layer flag set by the tau + 1 branch: that flag is ``stable`` here. Line 7's
    ``(t - 1) % tau == 0`` is a countdown here (re-estimate after tau calls), equal while tau is
    fixed and without the irregular gaps of a modulus whose tau changes. tau is kept per layer
    (the threshold is per layer). ``total_iters = 0`` (unknown T) disables the late rule.
    """

    fixed_size = False

    def __init__(self, density: float = 0.01, split: str = "rows", tau: int = 5, sigma: int = 15,
                 total_iters: int = 0, interleave: bool = True, tau_min: int = 1):
        super().__init__(density, split)
        for pname, val, low in (("tau", tau, 1), ("sigma", sigma, 0), ("total_iters", total_iters, 0),
                                ("tau_min", tau_min, 1)):
            if not isinstance(val, int) or isinstance(val, bool) or val < low:
                raise ValueError(f"{pname} must be an int >= {low}, got {val!r}")
        if tau < tau_min:
            raise ValueError(f"tau ({tau}) must be >= tau_min ({tau_min})")
        self.tau, self.sigma, self.total_iters = tau, sigma, total_iters
        self.interleave, self.tau_min = bool(interleave), tau_min
        self._step = 0
        self.layers: dict[str, ThresholdState] = {}
        self.last_action: dict[str, str] = {}

    def on_step(self, step: int) -> None:
        self._step = int(step)

    def decide(self, t: int, st: ThresholdState) -> str:
        """Alg. 1 + Alg. 2 branch for iteration ``t`` (1-based) and layer state ``st``."""
        if self.interleave and t % 2 == 1:
            return INTERLEAVE
        if t < self.sigma:
            return WARMUP
        if self.total_iters > 0 and t > self.total_iters * 3 / 4 and st.stable:
            return LATE
        if st.thr_reuse < 0 or st.since >= st.tau:
            return REESTIMATE
        return REUSE

    def _estimate(self, tensor: Tensor, st: ThresholdState, adapt: bool) -> Tensor:
        flat = tensor.reshape(-1)
        idx = self.topk(tensor, k_for(flat.numel(), self._density))
        thr = float(flat[idx].abs().min())
        eps = thr / 10.0
        if adapt and st.thr_reuse >= 0:
            diff = abs(thr - st.thr_reuse)
            st.stable = diff < eps
            if diff < eps:
                st.tau += 1
            elif diff > 2 * eps:
                st.tau = max(self.tau_min, st.tau - 1)
        st.thr_reuse, st.eps, st.since = thr, eps, 1
        return idx

    def indices(self, tensor: Tensor, name: str) -> Tensor:
        st = self.layers.get(name)
        if st is None:
            st = self.layers[name] = ThresholdState(tau=self.tau)
        action = self.decide(self._step + 1, st)
        self.last_action[name] = action
        if action in (INTERLEAVE, LATE):
            return self.adtopk_indices(tensor)
        if action in (WARMUP, REESTIMATE):
            return self._estimate(tensor, st, adapt=action == REESTIMATE)
        st.since += 1
        return self._above(tensor.reshape(-1), st.thr_reuse)

    def _above(self, flat: Tensor, thr: float) -> Tensor:
        """Ascending indices of |flat| > thr. On CPU float32 |flat| and the mask go to scratch and
        the mask is read word by word (same float32 compare as the plain expression); other dtypes
        keep the plain expression, which compares in their own precision."""
        if not self.fast_cpu or devices.reads_wait(flat) or flat.dtype != torch.float32:
            return torch.nonzero(flat.abs() > thr).view(-1)
        ws = self._workspace()
        mask = torch.gt(ws.magnitudes(flat), thr, out=ws.scratch("mask", flat.numel(), torch.bool, flat.device))
        return nonzero_1d(mask, min(1.0, 2 * self._density))

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "layers": {n: asdict(s) for n, s in self.layers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state.get("step", 0))
        self.layers = {str(n): ThresholdState(**s) for n, s in state.get("layers", {}).items()}

    def __repr__(self) -> str:
        return (f"ADTopkTCompressor(density={self._density}, split={self.split!r}, tau={self.tau}, "
                f"sigma={self.sigma}, total_iters={self.total_iters}, interleave={self.interleave})")
