"""RedSync: a threshold searched on the segment between mean(|g|) and max(|g|).

Fang et al., "RedSync: Reducing synchronization bandwidth for distributed deep learning training
system" (JPDC 2019), threshold binary search selection, as summarised in ADTopk §2.2: with
``thr(r) = mean|g| + r * (max|g| - mean|g|)``, binary-search the ratio r in [0, 1] until the number
of elements above thr(r) lies in [k, 2k) (the paper's acceptance band), or the step budget is spent.

Deviations:

* The reference codes (ADTopk A.5.6, SIDCo, Ok-Topk) stop when the ratio interval is narrower than
  0.2, i.e. after at most 3 halvings, which cannot reach the needed ratio when the tail is long (a
  Student-t gradient needs r ~ 0.01 because max|g| is far out). Here the search stops on the band or
  after ``max_steps`` halvings (default 20, ratio resolution 1e-6).
* The reference codes raise the threshold whenever n >= k/2, also for k/2 <= n < k, which moves
  away from the target; here any n < k lowers the threshold.
* When even thr = mean|g| passes fewer than k elements (densities above ~0.3), the search interval
  is extended down to thr = 0 instead of returning too few elements.
* If the band is never hit, the threshold whose count was closest to k (in ratio) is used.
* At least one element is always sent.

Payload ``[values, indices]`` of variable size; biased: pair with ``residual`` memory.
Communicators: ``allgather``. Stateless.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from adacomp.compressors import _native
from adacomp.compressors.base import register
from adacomp.compressors.sparse import (BISECT_LEVELS, LazyBest, Magnitudes, SparseCompressor, ThresholdCounter,
                                        bisect_thresholds, compensate_with_stats, k_for)


@register("redsync")
class RedSyncCompressor(SparseCompressor):
    """Binary search of the mean-to-max ratio until the count is in [k, 2k).

    ``density``: target fraction sent (ADTopk §6 setting 0.01).
    ``max_steps``: most halvings of the search interval (each one is a pass over the tensor).
    """

    compensate_into = compensate_with_stats  # |g|'s statistics read while error feedback writes g

    def defers_zeroing(self, tensor: Tensor) -> bool:
        return True

    def compensate_zeroed(self, g: Tensor, r: Tensor, out: Tensor, name: str, zeroed: Tensor) -> bool:
        return compensate_with_stats(self, g, r, out, name, zeroed=zeroed)
    search_strict = True  # its counts are of |g| > thr
    batch_counts = False  # one by one was faster on an H100 (SparseCompressor.batch_counts)
    # a threshold below the candidate floor is skipped once the kept set reaches 2k, and the search ends
    # in [k, 2k): candidates at 2.5 k cover it with the sampled floor's noise to spare (2.25 k began to
    # cost full counts on GPT-2-small; 3 k: ~4 % slower)
    search_factor = 2.5

    def __init__(self, density: float = 0.01, max_steps: int = 20):
        super().__init__(density)
        if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        self.max_steps = max_steps

    def threshold(self, a: Tensor, k: int, counter: ThresholdCounter | None = None,
                  top: float | None = None, mean: float | None = None) -> float:
        """A threshold on ``a = |g|`` passing between k and 2k elements when the budget allows
        (``counter``: exact counts of ``a > thr`` from a kept candidate set; ``top``, ``mean``: max(a)
        and mean(a) if known)."""
        if counter is None:
            counter = ThresholdCounter(a, True, self._workspace())
        mean = float(a.mean()) if mean is None else mean
        top = float(a.max()) if top is None else top
        base, span = mean, top - mean
        levels = min(BISECT_LEVELS, self.max_steps)
        if counter.batched:  # the count at the mean and either search's first levels: one host wait
            counter.prefetch([mean, *bisect_thresholds(0.0, 1.0, base, span, levels),
                              *bisect_thresholds(0.0, 1.0, 0.0, mean, levels)], self.batch_counts)
        # a threshold below the kept floor whose count is known to reach 2k moves the search up
        # without a pass; its error is only needed if no later threshold lands in [k, 2k)
        seen = LazyBest(counter, lambda count: abs(math.log(max(count, 1) / k)))
        # where every count is a full pass, the count at the mean and the loop below in one C call
        got = (_native.bisect_band(counter.a, counter.mode, k, mean, top, self.max_steps)
               if counter.full_passes() else None)
        if got is not None:
            thrs, counts, found = got
            counter.reads += len(counts) + 1
            if found:
                return thrs[-1]
            for thr, count in zip(thrs, counts):
                seen.add(thr, count)
            return seen.best(thrs[0])
        if not counter.at_least(mean, k):  # search [0, mean] instead (see deviations)
            base, span = 0.0, mean
        lo, hi = 0.0, 1.0
        for step in range(self.max_steps):
            mid = 0.5 * (lo + hi)
            thr = base + mid * span
            bound = counter.lower_bound(thr)
            if bound >= 2 * k:
                seen.add(thr, None, bound)
                lo = mid
                continue
            if counter.batched and not counter.known(thr):
                counter.prefetch(bisect_thresholds(lo, hi, base, span, min(BISECT_LEVELS, self.max_steps - step)),
                                 self.batch_counts)
            count = counter.count(thr)
            if k <= count < 2 * k:
                return thr
            seen.add(thr, count)
            if count < k:
                hi = mid
            else:
                lo = mid
        return seen.best(base)

    def select(self, flat: Tensor, name: str) -> Tensor:
        return self.choose(flat, name)[0]

    def choose(self, flat: Tensor, name: str) -> tuple[Tensor, Tensor | None]:
        """The selection, with its values where the search's candidates carry them (the
        compensation's pass kept the signed sums: :meth:`ThresholdCounter.pick`)."""
        k = k_for(flat.numel(), self._density)
        if k >= flat.numel():
            return torch.arange(flat.numel(), device=flat.device), None
        # |g|'s max and mean in one read; the counts then read g itself (|g| is not written) where C serves
        mag = Magnitudes(flat, self._workspace(), write=False, known=self._kept().take(name, flat))
        counter = mag.search_counter(self.search_strict, self._density, self._workspace(), self.search_factor)
        a = mag.a if mag.a is not None else flat  # (threshold reads only the counter, max and mean given)
        thr = self.threshold(a, k, counter, mag.max(), mag.mean())
        got = counter.pick(thr, self._density)
        if got is not None and got[0].numel():
            return got
        idx = counter.select(thr, self._density)
        return (idx, None) if idx.numel() else (mag.argmax(), None)

    def __repr__(self) -> str:
        return f"RedSyncCompressor(density={self._density}, max_steps={self.max_steps})"
