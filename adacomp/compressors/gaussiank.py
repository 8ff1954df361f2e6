"""Gaussian-k: a top-k threshold read off a normal fit instead of a sort.

Shi, Chu, Cheung and See, "Understanding Top-k Sparsification in Distributed Deep Learning"
(arXiv:1911.08772, 2019), the Gaussian_k operator, as summarised in ADTopk §2.2: treat the gradient
as N(mu, sigma^2) and take the threshold from the normal percent-point function so that a fraction
``density`` of the elements lies beyond +-thr, i.e. thr = mu + sigma * Phi^-1(1 - density / 2). The
gradient is not exactly normal (ADTopk §2.2 and §6: heavy tails, e.g. BERT), so the estimate is
corrected by a bounded loop that scales the threshold until the count falls in [2k/3, 4k/3].

Deviations (stated, each chosen to keep the count near k on non-normal tensors):

* The reference codes (ADTopk A.5.5, SIDCo's GaussianKSGD) multiply the threshold by 0.5 / 1.5 at
  every step, which can oscillate between a too-high and a too-low value. Here those factors are
  used only until the target is bracketed; after that each step takes the geometric mean of the
  bracket, which converges. ``max_adjust`` (default 5, the ADTopk library's bound) caps the loop.
* The selection is on ``|g| > thr`` (the reference codes sometimes compared signed values).
* At least one element is always sent (the largest), so a payload is never empty.
* ``truncate`` (default on): never more than the loop's own upper bound, 4k/3 elements (the k'
  largest passing, ties at the k'-th magnitude to the lowest index), so the payload stays a
  threshold cut and a fit the corrections could not rescue cannot flood the network. Shi et al.'s
  code caps every payload at k (``indexes[0:k]``: the first k passing, in index order). Capping
  in-band payloads at k cost accuracy here (DigitsCNN, ``adacomp bench convergence --compressors
  gaussiank --tasks digits --densities 0.01``, seeds 0-3: final loss 0.164 against 0.104 uncapped,
  accuracy 94.9 % against 96.7 %), so the cap binds only where the corrections ran out.
  ``truncate: false`` sends everything that passes, as the ADTopk library does.

Why the cap matters (issue 32): on GPT-2-small's tied embedding (38.6M elements, batch 1) the fit
misses by more than the 1.5^5 that the default five corrections can undo. Without the cap the first
step sends 1.6x k of that tensor and, once error feedback has added residuals, up to ~30x k (the zoo
benchmark's ~1 s rows: 19.9 % of dense bytes where Top-k sends 3.1 %, which was most of Gaussian-k's
step-time gap to DDP there: 1.76x DDP's step; with the cap 3.2 % of dense bytes and 1.17x,
docs/results/zoo_steps.md). ``max_adjust: 10`` alone brings it to 0.89x k at the same cost per step.

Payload ``[values, indices]`` of variable size (at most 4k/3 with ``truncate``); biased: pair with
``residual`` memory.
Communicators: ``allgather``. Stateless.
"""
from __future__ import annotations

import functools
import math
from statistics import NormalDist
from typing import NamedTuple

import torch
from torch import Tensor

from adacomp.compressors import _native
from adacomp.compressors.base import register
from adacomp.compressors.sparse import (BISECT_LEVELS, SEARCH_COMPACT_MIN, SparseCompressor, ThresholdCounter, k_for,
                                        largest_k, sample_lines, sample_value, sampled_value)


CANDIDATE_SAMPLE = 1 << 12
"""Elements of ``g + r`` the compensation samples for its candidates' floor (256 lines of 16; the
prefilters' :data:`~adacomp.compressors.sparse.SAMPLE_SIZE` is four times that). The floor is a
speed hint: the selection is the same whatever it is. It aims at 3x the density (~3k candidates) and
costs a pass more only where it misses by far: below 4k/3 kept (55 % short) a count below it reads
the tensor, above ~4.5k the compaction outgrows its first guess. The (3 x density)-th largest of 4096
values sits ~9 % (one sigma) from its target share, against ~4.5 % for 16K; each line sampled is a
cache miss in g and in r (1024 lines: ~45 us a tensor, then ~18 us for the order statistic)."""


@functools.lru_cache(maxsize=4096)
def _two_sided_z(k: int, n: int) -> float:
    """The standard normal quantile that ``k`` of ``n`` values exceed in magnitude (both tails):
    per tensor shape and density, computed once (a NormalDist and its inverse CDF per call cost a
    few us a tensor, every step)."""
    return NormalDist().inv_cdf(1.0 - 0.5 * k / n)


def adjust(thr: float, too_low: float | None, too_high: float | None, too_many: bool
           ) -> tuple[float, float | None, float | None]:
    """One step of the bounded correction loop (module docstring): up by 1.5x or down by 2x until
    the count has been on both sides, then the geometric mean of the two nearest thresholds.
    Returns the new ``(thr, too_low, too_high)``."""
    if too_many:
        return (thr * 1.5 if too_high is None else math.sqrt(thr * too_high)), thr, too_high
    return (thr * 0.5 if too_low is None else math.sqrt(thr * too_low)), too_low, thr


def adjust_thresholds(thr: float, too_low: float | None, too_high: float | None, levels: int) -> list[float]:
    """Every threshold the adjustment may try in its next ``levels`` steps from this state, computed
    as :func:`adjust` computes them: what :meth:`ThresholdCounter.prefetch` takes."""
    if levels <= 0:
        return []
    out = [thr]
    for too_many in (True, False):
        out += adjust_thresholds(*adjust(thr, too_low, too_high, too_many), levels - 1)
    return out


class _Searched(NamedTuple):
    """What the fused compensation (:func:`_native.add_moments_select`) kept for the search: torch's
    mean, its std where the lanes' sums proved it (None: a read in torch's order answers), and the
    candidates above ``floor``."""
    mean: float
    std: float | None
    floor: float
    idx: Tensor
    vals: Tensor


@register("gaussiank")
class GaussianKCompressor(SparseCompressor):
    """Normal-fit threshold plus a bounded adjustment loop toward ``k = density * numel``.

    ``density``: target fraction sent (ADTopk §6 compares all sparsifiers at 0.01).
    ``max_adjust``: most corrections of the fitted threshold; 0 keeps the raw normal estimate
    (fast, but off by 10x on heavy-tailed tensors at density 0.001).
    ``truncate``: send at most 4k/3 (the loop's upper bound), the largest of those passing.
    """

    batch_counts = False  # one by one was faster on an H100 (SparseCompressor.batch_counts)

    def __init__(self, density: float = 0.01, max_adjust: int = 5, truncate: bool = True):
        super().__init__(density)
        if not isinstance(max_adjust, int) or isinstance(max_adjust, bool) or max_adjust < 0:
            raise ValueError(f"max_adjust must be an int >= 0, got {max_adjust!r}")
        if not isinstance(truncate, bool):
            raise ValueError(f"truncate must be true or false, got {truncate!r}")
        self.max_adjust = max_adjust
        self.truncate = truncate

    def threshold(self, a: Tensor, signed: Tensor, k: int, counter: ThresholdCounter | None = None,
                  moments: tuple[float, float] | None = None) -> float:
        """Threshold on ``|signed|`` expected to pass about ``k`` elements (``counter``: exact counts
        of ``|signed| > thr`` reusing a candidate set; a full pass over ``a`` (``|signed|``, or
        ``signed`` itself for the C passes, which clear the sign as they read) per count without one;
        ``moments``: ``signed``'s mean and std when already known)."""
        count_above = counter.count if counter is not None else (lambda t: int(torch.count_nonzero(signed.abs() > t)))
        n = a.numel()
        if moments is None:
            moments = float(signed.mean()), float(signed.std()) if n > 1 else 0.0
        mean, std = moments
        z = _two_sided_z(k, n) if k < n else 0.0
        thr = mean + std * z
        if not math.isfinite(thr) or thr <= 0.0:  # constant tensor: fall back to its magnitude
            thr = float(signed.abs().max()) * 0.5
        lo, hi = 2.0 * k / 3.0, 4.0 * k / 3.0
        too_low: float | None = None  # thresholds known to pass too many / too few
        too_high: float | None = None
        start = 0
        band = self._band(counter, thr, lo, hi) if counter is not None else None
        if band is not None:  # the loop below in one C call, as far as its counts serve
            assert counter is not None
            counter.reads += band.reads
            if band.done:
                return band.thr
            thr, too_low, too_high, start = band.thr, band.too_low, band.too_high, band.steps
        for step in range(start, self.max_adjust):
            # below the kept floor, a kept set larger than hi decides the step without a pass
            bound = counter.lower_bound(thr) if counter is not None else 0
            if counter is not None and counter.batched and bound <= hi and not counter.known(thr):
                counter.prefetch(adjust_thresholds(thr, too_low, too_high, min(BISECT_LEVELS, self.max_adjust - step)),
                                 self.batch_counts)
            count = bound if bound > hi else count_above(thr)
            if lo <= count <= hi:
                break
            thr, too_low, too_high = adjust(thr, too_low, too_high, count > hi)
        return thr

    def _band(self, counter: ThresholdCounter, thr: float, lo: float, hi: float) -> _native.Band | None:
        """:meth:`threshold`'s loop in C where its counts are C counts read one by one: full passes
        (a tensor under the compaction size), or a signed kept set (the compensation's candidates),
        up to a count below its floor."""
        if counter.full_passes():
            return _native.gauss_band(counter.a, counter.mode, thr, lo, hi, self.max_adjust)
        if (counter.native and not counter.batched and counter.signed and counter.floor is not None
                and counter.vals is not None and not counter.nan_kept and not counter.known_any()):
            return _native.gauss_band(counter.a, counter.mode, thr, lo, hi, self.max_adjust,
                                      (counter.vals, counter.kept_mode, counter.floor))
        return None

    def select(self, flat: Tensor, name: str) -> Tensor:
        return self.choose(flat, name)[0]

    def choose(self, flat: Tensor, name: str) -> tuple[Tensor, Tensor | None]:
        """The selection, with its values where the candidates of the moments' read carry them
        (float32 ``flat``: ``signed`` is ``flat`` itself)."""
        k = k_for(flat.numel(), self._density)
        if k >= flat.numel():
            return torch.arange(flat.numel(), device=flat.device), None
        signed = flat.float()
        # the C passes read |g| with the sign bit cleared, so the magnitudes are never written;
        # elsewhere |g| goes to a reused buffer (one pass, no page faults)
        native = _native.usable(signed)
        a = signed if native else self._workspace().magnitudes(flat)
        cap = (4 * k) // 3
        kept = self._kept().take(name, a)
        if native and isinstance(kept, _Searched) and kept.std is None:
            # the std in torch's order, read once for whichever path answers below
            kept = kept._replace(std=_native.std_in_order(a, kept.mean))
        if native and signed is flat:
            got = self._in_one_call(a, kept, k, cap)
            if got is not None:
                return got
        counter, moments = self._search(a, native, kept)
        thr = self.threshold(a, signed, k, counter, moments)
        got = counter.pick(thr, self._density) if signed is flat else None
        idx, vals = got if got is not None else (counter.select(thr, self._density), None)
        if self.truncate and idx.numel() > cap:
            # the candidates' signed values ranked by magnitude in one C call, the kept ones' values
            # with them (largest_k's set; torch's path on a NaN); a selection without values (a
            # tensor counted whole) gathers them first: ``a`` is ``signed`` where C serves
            if vals is None and native:
                vals = _native.take(a, idx)
            got = _native.pick_largest(vals, idx, cap, None) if vals is not None else None
            idx, vals = got if got is not None else (
                largest_k(idx, vals.abs() if vals is not None else _native.take(a, idx).abs_(), cap), None)
        if not idx.numel():
            return (signed.abs() if native else a).argmax().view(1), None
        return idx, vals

    def _in_one_call(self, a: Tensor, kept: object, k: int, cap: int) -> tuple[Tensor, Tensor | None] | None:
        """:meth:`choose`'s search, selection and cap in one C call where the compensation's pass left
        what it starts from (a tensor counted whole: its mean; a larger one: its moments and
        candidates): the same calls as the path below, without ~20-30 us of Python between them a
        tensor (issue 32: ResNet-50's 76 compressed tensors a step). None where that path answers."""
        n = a.numel()
        z, lo, hi, limit = _two_sided_z(k, n), 2.0 * k / 3.0, 4.0 * k / 3.0, cap if self.truncate else 0
        if isinstance(kept, float) and n < SEARCH_COMPACT_MIN:
            got = _native.gauss_whole(a, kept, z, lo, hi, self.max_adjust, limit)
        elif isinstance(kept, _Searched):
            if kept.std is None:  # choose read it in torch's order; None: more than one thread
                return None
            got = _native.gauss_kept(a, kept.vals, kept.idx, kept.floor, kept.mean, kept.std, z, lo, hi,
                                     self.max_adjust, limit)
        else:
            return None
        if got is None:
            return None
        return got if got[0].numel() else (a.abs().argmax().view(1), None)

    def compensate_into(self, g: Tensor, r: Tensor, out: Tensor, name: str) -> bool:
        """``out = g + r`` (error feedback's compensation, torch.add's bits) with what the search
        reads of ``out`` from the same pass, kept for :meth:`select` of ``out``: its mean, and where
        ``out`` is a buffer of its own, its std (where the lanes' sums prove it) and the candidates
        above a floor sampled from ``g + r`` before the pass (the one :meth:`_search` samples from
        ``out``): then the search reads ``out`` no more. False (nothing written) where no fused pass
        can run: the caller adds."""
        flat, gf, rf = out.reshape(-1), g.reshape(-1), r.reshape(-1)
        n = flat.numel()
        # candidates only from 2^16 elements (a smaller tensor is counted whole, from the caches)
        floor = sampled_value(sample_lines(gf, CANDIDATE_SAMPLE, plus=rf), self._candidate_share(), absolute=True) \
            if n >= 1 << 16 else math.nan
        if math.isfinite(floor):
            got = _native.add_moments_select(gf, rf, flat, floor, self._candidate_share())
            if got is not None:
                mean = _native.mean_from_sum(got.total, n)
                if math.isfinite(mean):
                    std = _native.std_from_moments(got.squares, got.plain, mean, n)
                    self._kept().keep(name, flat, _Searched(mean, std, floor, got.idx, got.vals))
                return True
        summed = _native.add_cascade(gf, rf, flat)
        if summed is None:
            return False
        mean = _native.mean_from_sum(summed[0], n)
        if math.isfinite(mean):
            self._kept().keep(name, flat, mean)
        return True

    def _candidate_share(self) -> float:
        return min(0.25, 3.0 * self._density)  # ThresholdCounter.for_search's target

    def _search(self, a: Tensor, native: bool, kept: object = None
                ) -> tuple[ThresholdCounter, tuple[float, float] | None]:
        """The search's counter (candidates kept from a sampled floor) and, where one C read serves,
        the moments: the std's sum is a chain of dependent adds, so that read compacts the candidates
        beside it for free (torch's std and a separate compaction pass otherwise). ``kept``: what
        the compensation's pass left for ``a`` (its mean, or a :class:`_Searched`)."""
        ws = self._workspace()
        expected = self._candidate_share()
        if isinstance(kept, _Searched) and native:  # the compensation's pass read it all
            std = kept.std if kept.std is not None else _native.std_in_order(a, kept.mean)
            if std is None:
                std = float(a.std())
            counter = ThresholdCounter(a, True, ws, absolute=True)
            counter.adopt(kept.floor, kept.idx, kept.vals, signed=True)
            return counter, (kept.mean, std)
        if native and a.numel() >= 1 << 16:
            mean = kept if isinstance(kept, float) else float(a.mean())
            floor = sample_value(a, expected, absolute=True)
            got = _native.std_select(a, mean, floor, expected) if math.isfinite(floor) else None
            if got is not None:
                std, idx, vals = got
                counter = ThresholdCounter(a, True, ws, absolute=True)
                counter.adopt(floor, idx, vals, signed=True)
                return counter, (mean, std)
        counter = ThresholdCounter.for_search(a, True, self._density, ws, absolute=native)
        if native and isinstance(kept, float):  # the compensation's pass gave the mean: the std in torch's order
            std = _native.std_in_order(a, kept)
            if std is not None:
                return counter, (kept, std)
        return counter, None

    def __repr__(self) -> str:
        return (f"GaussianKCompressor(density={self._density}, max_adjust={self.max_adjust}, "
                f"truncate={self.truncate})")
