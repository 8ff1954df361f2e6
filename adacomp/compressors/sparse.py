"""Shared pieces of every sparsifier: payload ``[values, indices]`` over the flattened tensor, and
the CPU speed tools they share (scratch buffers, recycled dense outputs, exact threshold counts).

Why the tools: on CPU a fresh 64 MiB tensor costs ~5 memory passes in page faults, so |g|, masks
and decompressed outputs are reused (``Workspace``), and threshold searches count on a compacted
candidate set instead of re-reading the whole tensor (``ThresholdCounter``). None of them changes a
result: they only decide which memory is reused and which elements are re-read.
"""
from __future__ import annotations

import bisect
import math
import os
from typing import Any, Callable, ClassVar, NamedTuple

import torch
from torch import Tensor

from adacomp import devices
from adacomp.compressors import _native
from adacomp.compressors.base import Compressor, Payload
from adacomp.compressors.workspace import RECYCLE_MIN_NUMEL, Workspace
from adacomp.tensors import flat_of, same_elements


class SparseCtx(NamedTuple):
    """Local context of a sparse payload: enough to rebuild a dense tensor of any rank's payload."""

    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device


def check_density(density: float) -> float:
    if not isinstance(density, (int, float)) or isinstance(density, bool) or not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return float(density)


def k_for(numel: int, density: float) -> int:
    """Number of elements a density keeps: ``max(1, round(density * numel))`` (never above numel)."""
    return min(numel, max(1, int(round(density * numel))))


TINY = torch.finfo(torch.float32).tiny
"""Smallest normal float32: the lowest candidate floor of the prefiltered selections, so exact zeros
(most of a ReLU layer's gradient) never qualify; a selection short of candidates takes its exact path."""
def scatter(values: Tensor, indices: Tensor, ctx: SparseCtx, workspace: Workspace | None = None) -> Tensor:
    """A dense tensor of zeros with ``values`` added at ``indices``: where the indices ascend (every
    built-in payload) one C pass writes it block by block (:func:`_native.sparse_mean` of one rank,
    divisor 1: bitwise zeros + ``index_add_``)."""
    if workspace is not None and ctx.dtype == torch.float32 and ctx.device.type == "cpu":
        out = workspace.output(torch.Size([ctx.numel]), ctx.numel, ctx.dtype, ctx.device)
        if _native.sparse_mean(out, [indices.reshape(-1)], [values.reshape(-1)], 1):
            return out.view(ctx.shape)
        del out
    if workspace is None:
        out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=ctx.device)
    else:
        out = workspace.zeros(torch.Size([ctx.numel]), ctx.numel, ctx.dtype, ctx.device)
    out.index_add_(0, indices.to(torch.int64), values.to(ctx.dtype))
    return out.view(ctx.shape)


SPARSE_DIV_RATIO = 16
"""A sparse sum is divided at its touched coordinates only when they are at most 1 / this of the
tensor: a gather + scatter costs ~10x more per element than a dense pass."""


SEARCH_FACTOR = 3.0
"""A threshold search's candidates are what a sampled floor passes at this multiple of its density."""
WIDEN_MAX = 8.0  # the most a tensor's candidate target grows after its floors fell short (SparseCompressor._passed)
SEARCH_COMPACT_MIN = 1 << 16
"""Tensors from this many elements are compacted before a search (smaller ones are counted whole)."""
REFLOOR_ROOM = 8  # a count below the kept floor keeps what passes where this many times the kept set does


def search_share(density: float, factor: float = SEARCH_FACTOR) -> float:
    """The share of a tensor a search's candidate floor aims to keep (at most a quarter)."""
    return min(0.25, factor * density)


def divide_touched(acc: Tensor, indices: Tensor, divisor: int) -> Tensor:
    """``acc.div_(divisor)`` for an ``acc`` that is +0.0 outside ``indices`` (a zero buffer that
    sparse payloads were added into), bitwise: 0.0 / d = +0.0, and each touched coordinate gets the
    same correctly rounded quotient. On CPU, when few coordinates are touched, only those are read
    and written (duplicates carry equal quotients), saving a read and a write of the whole tensor."""
    flat = acc.view(-1)
    idx = indices.reshape(-1)
    if flat.device.type != "cpu" or idx.numel() * SPARSE_DIV_RATIO > flat.numel():
        return acc.div_(divisor)
    idx = idx.to(torch.int64)
    flat.index_copy_(0, idx, flat.index_select(0, idx).div_(divisor))
    return acc


def sparse_residual(tensor: Tensor, indices: Tensor, out: Tensor) -> Tensor:
    """``tensor`` with the sent coordinates zeroed, into ``out``: bitwise ``tensor - scatter(values)``
    when the values are ``tensor``'s own at distinct ``indices`` (x - x = +0.0, x - 0.0 = x), in one
    copy instead of a zero fill, a scatter and a subtraction (none where ``out`` is ``tensor``'s own
    elements, as error feedback's in-place residual hands them: torch would skip it too, after a
    dispatch)."""
    if not same_elements(out, tensor):
        out.copy_(tensor)
    if not _native.zero_at(out, indices):
        out.view(-1).index_fill_(0, indices.to(device=out.device, dtype=torch.int64), 0)
    return out


def nonzero_1d(mask: Tensor, expected: float = 1.0) -> Tensor:
    """``torch.nonzero(mask).view(-1)`` for a contiguous 1-D bool mask, same order. When few are set
    (``expected`` fraction <= 1/32) whole 8-byte words are scanned first: torch's CPU nonzero costs
    about 1 ns per element, and most words of a sparse mask are zero."""
    n = mask.numel()
    if devices.reads_wait(mask) or expected > 1 / 32 or n % 8 or n < 4096:
        return torch.nonzero(mask).view(-1)
    words = torch.nonzero(mask.view(torch.int64)).view(-1)
    rc = torch.nonzero(mask.view(-1, 8).index_select(0, words))
    return words.index_select(0, rc[:, 0]) * 8 + rc[:, 1]  # index_select: 4x faster than words[...]


NATIVE_KTH_MIN = 1 << 11  # below this torch.topk is as fast as the C radix select and its call


def nan_as_largest(mags: Tensor) -> Tensor:
    """``mags`` with NaN as +inf (a copy only when there is one): the canonical top-k ranks a NaN
    above every number, as torch.topk does, while the comparisons that cut at the k-th magnitude
    need an ordered value."""
    if bool(torch.isnan(mags).any()):
        return torch.where(torch.isnan(mags), torch.full_like(mags, math.inf), mags)
    return mags


def largest_k(idx: Tensor, mags: Tensor, k: int) -> Tensor:
    """The entries of ascending ``idx`` whose magnitudes ``mags`` are the k largest, still ascending.

    The canonical top-k every sparsifier payload uses: ties at the k-th magnitude go to the lowest
    indices and a NaN ranks above every number (as torch.topk ranks it), so the answer depends
    only on the values, never on how a selection was computed (a prefilter, a sample, a device)."""
    if idx.numel() <= k:
        return idx
    if devices.reads_wait(mags):  # the same set with one host wait (the final index)
        m = torch.where(torch.isnan(mags), math.inf, mags)
        kth_t = torch.topk(m, k, sorted=False).values.min()
        keep_t, ties = m > kth_t, m == kth_t
        keep_t |= ties & (torch.cumsum(ties, 0) <= k - keep_t.sum())  # the lowest-index ties
        return idx[keep_t]
    kth = _native.rth_largest_strided(mags, 1, k) if mags.numel() >= NATIVE_KTH_MIN and _native.usable(mags) else None
    if kth is None:  # torch answers (a NaN, no C library, another device)
        mags = nan_as_largest(mags)
        kth = float(torch.topk(mags, k, sorted=False).values.min())
    keep = mags > kth
    short = k - int(keep.sum())
    if short > 0:
        keep[torch.nonzero(mags == kth).view(-1)[:short]] = True
    return idx[keep]


def largest_k_values(idx: Tensor, mags: Tensor, k: int, flat: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`largest_k` of candidates ``idx`` into ``flat`` (magnitudes ``mags``) and the signed
    values ``flat`` holds there: a payload. One C call where it serves, else torch's path."""
    if idx.numel() >= k:
        got = _native.pick_largest(mags, idx, k, flat)
        if got is not None:
            return got
    kept = largest_k(idx, mags, k)
    return kept, _native.take(flat, kept)


BATCHED_COUNTS = os.environ.get("ADACOMP_BATCHED_COUNTS", "auto")
"""How :meth:`ThresholdCounter.prefetch` counts a batch where reads wait (``ADACOMP_BATCHED_COUNTS``):
``sort`` (the set sorted once, a ``searchsorted`` per batch), ``bucket`` (a ``bucketize`` and a
histogram per batch, no sort), ``off`` (every count read back on its own), or ``auto``: ``sort``
for the compressors whose ``batch_counts`` is set, else ``off``. Same counts every way."""

BISECT_LEVELS = 8
"""Levels of a bisection's subtree :func:`bisect_thresholds` prefetches in one batch (255 thresholds)."""

SAMPLE_LINE = 16
"""float32 elements per 64-byte cache line: the sample reads whole lines, so it costs the lines
it reads and not, as one element per line would, every line of a tensor under ~1M elements."""
SAMPLE_SIZE = 1 << 14  # elements per sample: 1024 lines, a radix select over 16K keys
SAMPLE_SHARE = 32  # a sample reads at most 1/32 of a tensor's lines ...
SAMPLE_MIN = 1 << 12  # ... but at least 256 lines


def sample_size(n: int) -> int:
    """Elements a prefilter's sample of an ``n``-element tensor reads: :data:`SAMPLE_SIZE`, or
    1/:data:`SAMPLE_SHARE` of the tensor where that is smaller (at least :data:`SAMPLE_MIN`). The
    lines lie far apart, each a cache miss: 1024 of them were a quarter of a 2^16-element tensor."""
    return min(SAMPLE_SIZE, max(SAMPLE_MIN, n // (SAMPLE_SHARE * SAMPLE_LINE) * SAMPLE_LINE))


def sample_value(a: Tensor, fraction: float, size: int | None = None, absolute: bool = False) -> float:
    """Value exceeded by about ``fraction`` of a sample of 1-D contiguous ``a`` (``absolute``: of
    ``|a|``). A speed hint only: every caller's answer is exact whatever it returns.

    The sample is ``size / SAMPLE_LINE`` runs of :data:`SAMPLE_LINE` consecutive elements spread
    over ``a`` (``size`` by default :func:`sample_size`; :func:`sample_starts`; all of ``a`` when it
    is no larger than ``size``): one read of
    that many cache lines, where a strided sample touches every line of any tensor under
    ``16 * size`` elements."""
    return sampled_value(sample_lines(a, size), fraction, absolute)


def sample_starts(lines: int, m: int, device: torch.device | None = None) -> Tensor:
    """The ``m`` lines (of ``lines``) a sample reads, ascending: one in each of m equal spans, at the
    fraction of the span a Weyl sequence gives (j / golden ratio, mod 1, in 32-bit fixed point; the
    C sample's ``sample_line``). Why not each span's first line: equal spans alias with a matrix's
    rows, so the sample met the same few columns of every row it hit (GPT-2's 768 x 3072 weights: 4;
    VGG-16's fc6: 1), and on VGG-16's own gradients a floor sampled there passed 0.22-14.6 times
    Top-k's target, 1.06-2.28 times with these lines (`adacomp bench cost floors`, cost_notes item 53)."""
    j = torch.arange(m, dtype=torch.int64, device=device)
    lo = j * lines // m
    frac = (j * 2654435769) % (1 << 32)
    return lo + (frac * ((j + 1) * lines // m - lo)) // (1 << 32)


def sample_lines(a: Tensor, size: int | None = None, plus: Tensor | None = None,
                 zeroed: Tensor | None = None) -> Tensor:
    """The elements :func:`sample_value` reads (a copy, or ``a`` itself when it is that small);
    ``plus``: of ``a + plus`` (the same positions of both, added), e.g. error feedback's sum before
    it is written; ``zeroed``: ascending positions where ``plus`` counts as +0.0 (the residual's
    zeroing left to that sum's pass)."""
    n = a.numel()
    size = sample_size(n) if size is None else size
    lines = n // SAMPLE_LINE
    if zeroed is not None and plus is not None and zeroed.numel():
        if n > size and lines >= 2:
            got = _native.sample_lines(a, plus, lines, max(1, size // SAMPLE_LINE), zeroed)
            if got is not None:
                return got
        plus = plus.reshape(-1).clone().index_fill_(0, zeroed, 0.0).view_as(plus)  # torch's way: a copy
    if n <= size or lines < 2:
        return a if plus is None else a + plus
    m = max(1, size // SAMPLE_LINE)
    got = _native.sample_lines(a, plus, lines, m)  # one C call: no index tensors, no separate add
    if got is not None:
        return got
    if plus is not None:
        return sample_lines(a, size) + sample_lines(plus, size)
    pick = sample_starts(lines, m, a.device)
    return a[:lines * SAMPLE_LINE].view(lines, SAMPLE_LINE).index_select(0, pick).view(-1)


def sample_lines_pieces(gs: list[Tensor], plus: Tensor) -> Tensor | None:
    """:func:`sample_lines` of ``torch.cat(gs)`` with ``plus`` (default size: the same elements), the
    pieces read where they lie; None where that sample is the whole tensor or the C pass cannot run."""
    n = plus.numel()
    size = sample_size(n)
    lines = n // SAMPLE_LINE
    if n <= size or lines < 2:
        return None
    return _native.sample_lines_segments(gs, plus, lines, max(1, size // SAMPLE_LINE))


def sampled_value(s: Tensor, fraction: float, absolute: bool = False) -> float:
    """The value exceeded by about ``fraction`` of the sample ``s`` (see :func:`sample_value`)."""
    r = min(s.numel(), max(1, math.ceil(fraction * s.numel())))
    if _native.usable(s):  # one radix select on the sample (same value; torch's path on NaN / negatives)
        value = _native.rth_largest_strided(s, 1, r, absolute)
        if value is not None:
            return value
    v = s.abs() if absolute else s
    if devices.reads_wait(v):  # one host wait: a NaN ranks lowest (a hint may come out -inf)
        return float(torch.topk(torch.nan_to_num(v, nan=-math.inf, posinf=math.inf, neginf=-math.inf), r, sorted=False).values.min())
    v = v[~torch.isnan(v)]  # a NaN in the sample says nothing about where the numbers lie
    if v.numel() == 0:
        return math.nan
    return float(torch.topk(v, min(r, v.numel()), sorted=False).values.min())


def bisect_thresholds(left: float, right: float, base: float, span: float, levels: int) -> list[float]:
    """The thresholds ``base + mid * span`` a bisection of ``[left, right]`` (``mid`` the interval's
    midpoint, halved either way) may visit in its next ``levels`` steps, computed as the search
    computes them (the midpoints are dyadic, so exact): what :meth:`ThresholdCounter.prefetch` takes."""
    out: list[float] = []
    frontier = [(left, right)]
    for _ in range(max(0, levels)):
        nxt = []
        for lo, hi in frontier:
            mid = 0.5 * (lo + hi)
            out.append(base + mid * span)
            nxt += [(lo, mid), (mid, hi)]
        frontier = nxt
    return out


class Magnitudes:
    """``|flat|`` (float32, in the workspace's reused buffer) with its max, min, argmax and mean, which
    a threshold search asks for: one C pass where it serves (the reductions come with the abs pass,
    bitwise torch's), torch's reductions on demand elsewhere (no compiler, a NaN, other dtypes, a
    sum torch splits across threads)."""

    def __init__(self, flat: Tensor, workspace: Workspace, write: bool = True, known: object = None):
        """``write=False``: where the C pass serves, |flat| is not written (``a`` is None) and a
        search counts on ``flat`` with absolute answers (:meth:`search_counter`): one write of the
        tensor less. ``known``: what :func:`compensate_with_stats` found for ``flat`` (the same
        statistics, from the pass that wrote it), which then needs no read of its own."""
        self.flat = flat
        self._together: list[float] | None = None
        fast = flat.dtype == torch.float32 and flat.numel() and _native.usable(flat)
        self._known = known if isinstance(known, KnownMagnitudes) else None
        if fast and not write:
            stats = self._known.stats if self._known is not None else _native.abs_stats(flat, None)
            if stats is not None and stats.mean is not None:
                self._stats: _native.AbsStats | None = stats
                self.a: Tensor | None = None
                return
        a = workspace.scratch("abs", flat.numel(), torch.float32, flat.device)
        self._stats = _native.abs_stats(flat, a) if fast and _native.usable(a) else None
        self.a = a if self._stats is not None else workspace.magnitudes(flat)

    def search_counter(self, strict: bool, density: float, workspace: Workspace,
                       factor: float = SEARCH_FACTOR) -> "ThresholdCounter":
        """:meth:`ThresholdCounter.for_search` on the magnitudes: on ``a``, or on ``flat`` with
        absolute answers where ``a`` was not written."""
        if self.a is None:
            cands = self.candidates(strict)
            if cands is not None:  # for_search's compaction, done (at whatever share: the same answers)
                counter = ThresholdCounter(self.flat, strict, workspace, absolute=True)
                counter.adopt(*cands, signed=True)  # compensate_with_stats keeps the signed sums
                return counter
            return ThresholdCounter.for_search(self.flat, strict, density, workspace, factor, absolute=True)
        return ThresholdCounter.for_search(self.a, strict, density, workspace, factor)

    def candidates(self, strict: bool) -> tuple[float, Tensor, Tensor] | None:
        """The floor, positions and signed values :func:`compensate_with_stats` kept while writing
        ``flat`` (compared ``> floor`` if ``strict``, else ``>=``), for an absolute counter on ``flat``
        to adopt; None where there are none."""
        k = self._known
        if self.a is not None or k is None or k.cands is None or k.strict != strict:
            return None
        return (k.floor, *k.cands)

    def judge(self, comp: "SparseCompressor", name: str, need: int) -> None:
        """Tell ``comp`` how many candidates its compensation's floor passed for ``name`` against the
        ``need`` its search counts near (:meth:`SparseCompressor._passed`: the next floor's share)."""
        k = self._known
        if k is not None and k.cands is not None:
            comp._passed(name, k.cands[0].numel(), need)

    def written(self) -> Tensor:
        """``a``, which the default ``write=True`` always holds."""
        assert self.a is not None  # the stats are known whenever a was not written
        return self.a

    def _read_together(self) -> list[float] | None:
        """max, min and mean read back at once where each read is a host wait
        (:func:`adacomp.devices.reads_wait`; the same reductions, so the same values as one by one)."""
        a = self.written()
        if not devices.reads_wait(a):
            return None
        if self._together is None:
            self._together = torch.stack([a.max(), a.min(), a.mean()]).tolist()
        return self._together

    def max(self) -> float:
        if self._stats is not None:
            return self._stats.max
        both = self._read_together()
        return both[0] if both is not None else float(self.written().max())

    def min(self) -> float:
        if self._stats is not None:
            return self._stats.min
        both = self._read_together()
        return both[1] if both is not None else float(self.written().min())

    def mean(self) -> float:
        if self._stats is not None and self._stats.mean is not None:
            return self._stats.mean
        both = self._read_together()
        return both[2] if both is not None else float(self.written().mean())

    def argmax(self) -> Tensor:
        """The first position of the largest magnitude, as a one-element int64 tensor."""
        if self._stats is not None:
            return torch.tensor([self._stats.argmax], dtype=torch.int64)
        return self.written().argmax().view(1)


class LazyBest:
    """The best threshold of a search whose error of a count is monotone in the count above the
    target, with counts of thresholds below a counter's floor left uncounted where the search's
    next move does not need them (:meth:`ThresholdCounter.lower_bound` decides it): such a count
    is taken only if its error's lower bound could still beat the others. Picks what the eager
    loop would (the earliest of the smallest errors)."""

    def __init__(self, counter: "ThresholdCounter", error: Any):
        self.counter, self.error = counter, error
        self.seen: list[tuple[float, float | None, int]] = []  # (threshold, error or None, lower bound)

    def add(self, thr: float, count: int | None, bound: int = 0) -> None:
        self.seen.append((thr, None if count is None else self.error(count), bound))

    def best(self, default: float) -> float:
        known = [e for _, e, _ in self.seen if e is not None]
        floor = min(known) if known else math.inf
        best_thr, best_err = default, math.inf
        for thr, err, bound in self.seen:
            if err is None:
                if self.error(bound) > floor:  # its count is >= bound: it cannot win
                    continue
                err = self.error(self.counter.count(thr))
            if err < best_err:
                best_thr, best_err = thr, err
        return best_thr


class KnownMagnitudes(NamedTuple):
    """What :func:`compensate_with_stats` learnt of a compensated tensor's magnitudes while writing it:
    the statistics and, where :meth:`ThresholdCounter.for_search` would compact, the candidates it
    would keep (``floor``, ``cands``) for a search of that strictness and expected share."""
    stats: _native.AbsStats
    floor: float
    cands: tuple[Tensor, Tensor] | None  # positions and signed values
    strict: bool
    expected: float


def compensate_with_stats(comp: Any, g: Tensor, r: Tensor, out: Tensor, name: str, compact: bool = True,
                          share: float | None = None, zeroed: Tensor | None = None) -> bool:
    """``compensate_into`` of the searches that read |g|'s max, min and mean first and then count
    from candidates (RedSync, MSTop-k, SIDCo; ``comp.search_strict``: whether they count ``> thr``):
    ``out = g + r`` (error feedback's compensation, torch.add's bits) with those statistics and
    :meth:`ThresholdCounter.for_search`'s compaction from the same pass (its sampled floor taken
    from ``g + r`` at the same positions before the sum is written; aimed at ``share`` of the
    tensor where given, else at :func:`search_share`), kept for the :class:`Magnitudes` of ``out``:
    two reads of the tensor less (one with ``compact`` False: the statistics alone). ``zeroed``: the
    positions where ``r`` counts as +0.0 (:meth:`SparseCompressor.compensate_owed`; the sampled floor,
    a speed hint, reads ``r`` as it lies). False (nothing written) where the C pass cannot run: the
    caller adds."""
    flat, gf, rf = flat_of(out), flat_of(g), flat_of(r)
    density = comp.density() or 1.0
    expected = search_share(density, comp.search_factor) if share is None else share
    floor = math.nan
    if compact and flat.numel() >= SEARCH_COMPACT_MIN and _native.usable(gf) and _native.usable(rf):
        floor = sampled_value(sample_lines(gf, plus=rf, zeroed=zeroed), expected, absolute=True)
    got = _native.add_abs_stats(gf, rf, flat, floor, comp.search_strict, expected, zeroed)
    if got.done and got.stats is not None and got.stats.mean is not None:
        comp._kept().keep(name, flat, KnownMagnitudes(got.stats, floor, got.cands, comp.search_strict, expected))
    return got.done


class ThresholdCounter:
    """Exact ``count`` / ``select`` of ``a > thr`` (``strict``) or ``a >= thr`` for many thresholds.

    After ``compact(floor)`` the elements passing ``floor`` (and their indices) are kept, and any
    threshold >= floor is answered from them: thresholds are compared in float32 like torch compares
    a float32 tensor with a Python float, so the set passing thr is a subset of the one passing floor
    and the answers are the same as a full pass. Lower thresholds fall back to a full pass.
    """

    def __init__(self, a: Tensor, strict: bool, workspace: Workspace, absolute: bool = False):
        """``absolute``: ``a`` holds signed values and every answer is for ``|a|`` (the fused C passes
        clear the sign bit as they read, so no magnitudes are written); only where they serve."""
        self.a, self.strict = a, strict
        self._workspace = workspace
        self._mask: Tensor | None = None
        self.native = _native.usable(a)  # one fused C pass per full read (bitwise the same answers)
        if absolute and not self.native:
            raise ValueError("ThresholdCounter(absolute=True) needs the fused C passes (_native.usable(a))")
        self.prefix = "abs_" if absolute else ""
        self.mode = self.prefix + ("gt" if strict else "ge")
        self.floor: float | None = None
        self._idx: Tensor | None = None
        self._idx32: Tensor | None = None  # the kept positions as int32 (compact(signed=True))
        self.vals: Tensor | None = None
        self.signed = False  # the kept values are the signed elements (adopt(signed=True)), not magnitudes
        self.nan_kept = False  # the kept set holds NaNs too (compact(keep_nan=True))
        self._kept_counter: Callable[[float], int] | None = None  # over ``vals``, bound by adopt()
        self._full_counter: Callable[[float], int] | None = None  # over ``a``, bound on first use
        # float32 only: torch compares other floating dtypes with a scalar in their op-math type
        self.batched = devices.reads_wait(a) and a.dtype == torch.float32
        self._counts: dict[float, int] = {}  # prefetched counts by threshold
        self._known: list[float] = []  # their thresholds, ascending
        self.reads = 0  # counts read back one by one or in a batch: a host wait each on a GPU
        self._sorted: dict[str, Tensor] = {}  # ascending kept values / a, for prefetch's searchsorted

    @property
    def idx(self) -> Tensor | None:
        """The kept positions (ascending int64); of a set kept with int32 positions, widened on first
        use (:meth:`pick` and the counts never need them)."""
        if self._idx is None and self._idx32 is not None:
            self._idx = self._idx32.to(torch.int64)
        return self._idx

    @idx.setter
    def idx(self, idx: Tensor | None) -> None:
        self._idx, self._idx32 = idx, None

    @property
    def mask(self) -> Tensor:
        """The full-size bool scratch of torch's comparisons, reserved on first use: the fused C
        passes never need it (one byte per element held per compressor otherwise)."""
        if self._mask is None:
            self._mask = self._workspace.scratch("mask", self.a.numel(), torch.bool, self.a.device)
        return self._mask

    def _cmp(self, x: Tensor, thr: float, out: Tensor | None = None) -> Tensor:
        if out is None:
            return torch.gt(x, thr) if self.strict else torch.ge(x, thr)
        return torch.gt(x, thr, out=out) if self.strict else torch.ge(x, thr, out=out)

    @property
    def kept_mode(self) -> str:
        """The comparison on the kept values, which are magnitudes already when ``absolute`` (unless
        they were adopted signed)."""
        return ("abs_" if self.signed else "") + ("gt" if self.strict else "ge")

    def _kept_magnitudes(self) -> Tensor:
        """The kept values as the counts compare them (torch's paths)."""
        assert self.vals is not None
        return self.vals.abs() if self.signed else self.vals

    def covers(self, thr: float) -> bool:
        return self.floor is not None and thr >= self.floor

    def full_passes(self) -> bool:
        """Whether every count is a C pass over the whole of ``a`` (no kept set, nothing prefetched):
        a whole search may then run in one C call (:func:`_native.bisect_band`), the same counts."""
        return self.native and self.floor is None and self.vals is None and not self.batched and not self._counts

    def compact(self, floor: float, expected: float = 1.0, keep_nan: bool = False, signed: bool = False) -> None:
        """Keep the elements passing ``floor``; ``keep_nan`` also keeps NaNs (for callers that must
        see them, as torch.topk ranks NaN first), after which only ``vals`` / ``idx`` are valid.
        ``signed``: an ``absolute`` counter keeps the elements themselves (:meth:`adopt`'s), so
        :meth:`pick` gives a payload's values from them instead of a gather over ``a``."""
        if not math.isfinite(floor):
            return
        if (self.covers(floor) and not (keep_nan or self.nan_kept) and self.native and self.vals is not None
                and self.idx is not None and _native.usable(self.vals)):
            # what passes ``floor`` passes the kept floor too: narrowed from the kept set, no pass over ``a``
            share = self._kept_share(expected)
            pairs = _native.pick_pairs(self.vals, self.idx, floor, self.strict, share) if self.signed else None
            if pairs is not None:  # positions and signed values in one pass, no gathers
                self.adopt(floor, *pairs, signed=True)
                return
            at = self._kept_at(floor, expected)
            self.adopt(floor, self.idx.index_select(0, at), self.vals.index_select(0, at), signed=self.signed)
            return
        self.nan_kept = keep_nan
        if self.native:
            keep_signs = signed and bool(self.prefix) and not keep_nan
            narrow = _native.select_signed32(self.a, floor, expected) if keep_signs and self.strict else None
            if narrow is not None:  # int32 positions: a third fewer bytes written (~22 % kept by SIDCo)
                self.adopt(floor, *narrow, signed=True)
                return
            mode = self.prefix + "not_lt" if keep_nan else self.mode + ("_signed" if keep_signs else "")
            self.adopt(floor, *_native.select(self.a, floor, mode, expected), signed=keep_signs)
            return
        if keep_nan:
            mask = torch.logical_not(torch.lt(self.a, floor, out=self.mask), out=self.mask)
        else:
            mask = self._cmp(self.a, floor, out=self.mask)
        idx = nonzero_1d(mask, expected)
        self.adopt(floor, idx, self.a.index_select(0, idx))

    def adopt(self, floor: float, idx: Tensor, vals: Tensor, signed: bool = False) -> None:
        """Keep a candidate set a fused pass compacted at ``floor`` (what :meth:`compact` would keep);
        its counts go through a function bound here once (searches count dozens of thresholds).
        ``signed``: ``vals`` are the elements themselves (an ``absolute`` counter compares their
        magnitudes), so :meth:`pick` gives a payload's values without a gather over ``a``. ``idx``
        int32 (:meth:`compact`'s signed set): kept so, widened only where asked (see :attr:`idx`)."""
        self.signed = signed and self.prefix == "abs_" and self.native
        if signed and not self.signed:
            raise ValueError("ThresholdCounter.adopt(signed=True) needs an absolute counter on the fused C passes")
        self.idx, self.vals, self.floor = (None if idx.dtype == torch.int32 else idx), vals, floor
        if idx.dtype == torch.int32:
            self._idx32 = idx
        self._kept_counter = _native.counter(vals, self.kept_mode) if self.native else None
        self._sorted.pop("kept", None)

    def prefetch(self, thrs: list[float], default: bool = True) -> None:
        """Count ``thrs`` in one batch where a read-back is a host wait (:func:`adacomp.devices.reads_wait`):
        over the kept values (or, before any compaction, ``a``) by the :data:`BATCHED_COUNTS` way, all
        read back together. The counts are exact (the same float32 comparisons as :meth:`count`),
        so a search that prefetches the thresholds it may visit takes the same path. Thresholds
        below the kept floor, and sets holding a NaN, stay with :meth:`count`. ``default``: whether
        to batch when :data:`BATCHED_COUNTS` is ``auto`` (the caller's ``batch_counts``)."""
        way = BATCHED_COUNTS if BATCHED_COUNTS != "auto" else "sort" if default else "off"
        if not self.batched or way == "off":
            return
        todo = sorted(set(t for t in thrs if t not in self._counts and math.isfinite(t)))
        if self.floor is not None:
            todo = [t for t in todo if self.covers(t)]
            key, src = "kept", self._kept_magnitudes()
            if self.nan_kept:
                return
        else:
            key, src = "full", self.a.abs() if self.prefix else self.a
        if not todo or src is None:
            return
        q = devices.upload(todo, src.dtype, src.device)  # ascending; rounded as torch rounds a scalar
        got = _BATCH_COUNTS[way](self, key, src.reshape(-1), q).tolist()  # the one host wait
        self.reads += 1
        if got[-1]:  # a NaN passes no comparison but would pass a sorted bound: count one by one
            self.batched = False
            return
        # torch rounds each threshold to float32: two close ones may be one value (same count)
        self._counts.update(zip(todo, got[:-1]))
        self._known = sorted(self._counts)

    def _sorted_counts(self, key: str, src: Tensor, q: Tensor) -> Tensor:
        """``src`` sorted once per set (kept for the search's later batches), one ``searchsorted``:
        the counts passing each of ``q``, then whether ``src`` holds a NaN (it sorts last)."""
        ordered = self._sorted.get(key)
        if ordered is None:
            ordered = self._sorted[key] = torch.sort(src).values
        n = ordered.numel()
        below = torch.searchsorted(ordered, q, right=self.strict)  # elements not passing each threshold
        nan_last = torch.isnan(ordered[-1:]).to(below.dtype) if n else below.new_zeros(1)
        return torch.cat([n - below, nan_last])

    def _bucket_counts(self, key: str, src: Tensor, q: Tensor) -> Tensor:
        """No sort: each element's number of thresholds passed (``bucketize`` against the ascending
        ``q``), a histogram of those, and its suffix sums: the counts passing each of ``q``, then
        ``src``'s NaN count. Passes over ``src``, where the sort reorders it."""
        passed = torch.bucketize(src, q, right=not self.strict)  # strict: q[j] < x; else q[j] <= x
        t = q.numel()
        hist = torch.zeros(t + 1, dtype=torch.int64, device=src.device)
        hist.index_add_(0, passed, torch.ones(1, dtype=torch.int64, device=src.device).expand(passed.numel()))
        passing = hist.flip(0).cumsum(0).flip(0)[1:]  # passing q[j] = passed more than j thresholds
        return torch.cat([passing, torch.isnan(src).sum().reshape(1)])

    def known_any(self) -> bool:
        """Whether :meth:`prefetch` counted anything (counts then may come without a read)."""
        return bool(self._counts)

    def known(self, thr: float) -> bool:
        """Whether :meth:`prefetch` already counted ``thr``."""
        return self._inferred(thr) is not None

    def _inferred(self, thr: float) -> int | None:
        """A prefetched count, or one the prefetched counts decide: counts fall as the threshold
        rises (float32 rounding is monotone too), so a threshold between two counted ones with
        equal counts has that count. Deep in a bisection the interval lies inside one gap between
        elements and every later step is answered so, without a read."""
        got = self._counts.get(thr)
        if got is not None or not self._known or math.isnan(thr):
            return got
        i = bisect.bisect_left(self._known, thr)
        if 0 < i < len(self._known):
            lo, hi = self._counts[self._known[i - 1]], self._counts[self._known[i]]
            if lo == hi:
                return lo
        return None

    def count(self, thr: float) -> int:
        known = self._inferred(thr)
        if known is not None:
            return known
        self.reads += 1
        if self.covers(thr):
            assert self.vals is not None  # set with floor by compact()
            if self._kept_counter is not None:  # (bound to the kept values' own mode)
                return self._kept_counter(thr)
            return int(torch.count_nonzero(self._cmp(self._kept_magnitudes(), thr)))
        if self.native:
            got = self._refloor(thr)
            if got is not None:
                return got
            if self._full_counter is None:
                self._full_counter = _native.counter(self.a, self.mode)
            assert self._full_counter is not None  # native: a is usable, so the counter binds
            return self._full_counter(thr)
        return int(torch.count_nonzero(self._cmp(self.a, thr, out=self.mask)))

    def _refloor(self, thr: float) -> int | None:
        """A count below the kept floor: the pass that counts keeps what passes ``thr`` as the new
        candidate set (floor ``thr``) where at most REFLOOR_ROOM times the old set passes, so the
        search's later counts above ``thr`` read those alone; the count either way. None where
        there is no kept set to widen (the plain count then). Why: a sampled floor that passes
        fewer than the search's target leaves every count near the answer below it, a pass over
        the tensor each (MSTop-k's bisection on VGG-16's own gradients: ~270 passes a step)."""
        if self.floor is None or self.vals is None or self.nan_kept or not math.isfinite(thr):
            return None
        mode = self.mode + ("_signed" if self.signed else "")
        cap = min(self.a.numel(), max(REFLOOR_ROOM * self.vals.numel(), 1 << 16))
        got = _native.select_upto(self.a, thr, mode, cap)
        if isinstance(got, int):
            return got
        self.adopt(thr, *got, signed=self.signed)
        return got[0].numel()

    def lower_bound(self, thr: float) -> int:
        """A number the count at ``thr`` is known to reach without a pass: the kept set's size where
        ``thr`` is at or below the floor (everything kept passes ``thr`` too), else 0."""
        if self.floor is not None and thr <= self.floor and self.vals is not None and not self.nan_kept:
            return self.vals.numel()
        return 0

    def at_least(self, thr: float, m: int) -> bool:
        """``count(thr) >= m``, without a pass when thr <= floor and the kept set already has m."""
        if self.floor is not None and thr <= self.floor and self.vals is not None and self.vals.numel() >= m:
            return True
        return self.count(thr) >= m

    def select(self, thr: float, expected: float = 1.0) -> Tensor:
        """Ascending flat indices passing ``thr`` (a fresh tensor, as ``torch.nonzero`` returns)."""
        if self.covers(thr):
            assert self.idx is not None and self.vals is not None  # set with floor by compact()
            if self.native and _native.usable(self.vals):  # one C pass over the kept values, no bool mask
                return self.idx.index_select(0, self._kept_at(thr, expected))
            return self.idx[self._cmp(self._kept_magnitudes(), thr)]
        if self.native:
            return _native.select(self.a, thr, self.mode, expected)[0]
        return nonzero_1d(self._cmp(self.a, thr, out=self.mask), expected)

    def pick(self, thr: float, expected: float = 1.0) -> tuple[Tensor, Tensor] | None:
        """:meth:`select` with the signed values there, from the kept set where it was adopted signed
        and covers ``thr`` (a gather over candidates in cache instead of one over the tensor, which its
        compensation streamed past the caches), or from one pass over ``a`` where every count is a
        full pass over its signed values (a tensor below the compaction size: the positions and the
        values together, not select's positions and then a gather); None otherwise (the caller gathers)."""
        if self.prefix and self.full_passes() and self.a.numel() < SEARCH_COMPACT_MIN:
            whole = _native.select_upto(self.a, thr, self.mode + "_signed", self.a.numel())
            assert not isinstance(whole, int)  # at most all of a passes
            return whole
        if not (self.signed and self.covers(thr)):
            return None
        share = self._kept_share(expected)
        if self._idx is None and self._idx32 is not None and self.vals is not None and not self.nan_kept:
            return _native.pick_pairs32(self.vals, self._idx32, thr, self.strict, share)
        assert self.idx is not None and self.vals is not None  # adopted
        got = _native.pick_pairs(self.vals, self.idx, thr, self.strict, share)  # one pass, no gathers
        if got is not None:
            return got
        at = self._kept_at(thr, expected)
        return self.idx.index_select(0, at), _native.take(self.vals, at)

    def _kept_share(self, expected: float) -> float:
        """``expected`` (a share of ``a``) as a share of the kept set: an output's first size guess."""
        assert self.vals is not None
        return min(1.0, expected * self.a.numel() / max(1, self.vals.numel()))

    def _kept_at(self, thr: float, expected: float) -> Tensor:
        """Positions among the kept values passing ``thr`` (one C pass; ``expected``: the share of
        ``a`` the caller expects, rescaled to the kept set for the output's first guess)."""
        assert self.vals is not None
        share = self._kept_share(expected)
        return _native.select(self.vals, thr, self.kept_mode, share)[0]

    @classmethod
    def for_search(cls, a: Tensor, strict: bool, density: float, workspace: Workspace,
                   factor: float = SEARCH_FACTOR, absolute: bool = False) -> "ThresholdCounter":
        """A counter for a threshold search aiming at ``density``: compacted (on tensors of >= 2^16
        elements) at a value a sample (:func:`sample_value`) says about ``factor * density`` (<= 1/4) passes, so
        the search's counts near its target re-read only those elements. ``absolute``: as the
        constructor's (``a`` signed, every answer about ``|a|``)."""
        counter = cls(a, strict, workspace, absolute=absolute)
        if a.numel() >= SEARCH_COMPACT_MIN:
            expected = search_share(density, factor)
            counter.compact(sample_value(a, expected, absolute=absolute), expected)
        return counter

    def shifted_mean(self, thr: float, expected: float = 1.0) -> tuple[int, float]:
        """How many elements pass ``thr`` and ``float((values(thr) - thr).mean())`` bitwise (NaN
        where fewer than 2 pass): at the kept floor itself one C read of the kept set (their
        magnitudes where kept signed), no shifted copy and no copy of the set. ``expected``: the
        share of the kept set that passes, about (:meth:`values`)."""
        if thr == self.floor and self.vals is not None and not self.nan_kept:  # all of them pass it
            got = _native.shifted_mean(self.vals, thr, absolute=self.signed)
            if got is not None:
                return self.vals.numel(), got
        tail = self.values(thr, expected)
        if tail.numel() < 2:
            return tail.numel(), math.nan
        got = _native.shifted_mean(tail, thr)
        return tail.numel(), got if got is not None else float((tail - thr).mean())

    def shifted_mean_keep(self, thr: float, floor: float, expect: int = 0,
                          expected: float = 1.0) -> tuple[int, float] | None:
        """:meth:`shifted_mean` at ``thr`` and :meth:`compact` at ``floor`` (``>= thr``) from one read
        of the kept set where it covers ``thr`` (else of ``a``) and nothing written but what passes
        ``floor``: the count passing ``thr`` and ``float((values(thr) - thr).mean())`` bitwise, then
        only the elements ``floor`` passes are kept (signed). Why: SIDCo-E's later stages compacted
        every exceedance of the first threshold (~22 % of the tensor at three stages), read them for
        the second fit, selected again for the third and read pairs for its pick; where the next
        threshold is expected (``floor``, from the last step) the kept set shrinks to what can still
        pass. ``expect``: about how many pass ``thr`` (the sum's levels; a wrong guess costs a second
        read); ``expected``: the share of ``a`` passing ``floor``, about. None (nothing read) where
        the C pass does not serve: an absolute, strict counter without NaNs kept, at least 8 passing."""
        if not (self.native and self.prefix and self.strict and not self.nan_kept):
            return None
        positions: Tensor | None = None
        src, share = self.a, expected
        if self.covers(thr) and self.vals is not None:
            if not self.signed:
                return None
            src, share = self.vals, self._kept_share(expected)
            positions = self._idx32 if self._idx32 is not None else self._idx
        got = _native.tail_sum_keep(src, thr, floor, positions, expect, share)
        if got is None:
            return None
        self.adopt(floor, got.idx, got.vals, signed=True)
        return got.passed, _native.mean_from_sum(got.total, got.passed)

    def values(self, thr: float, expected: float = 1.0) -> Tensor:
        """The elements of ``a`` passing ``thr`` (magnitudes where ``absolute``), in index order: fresh,
        or, at the kept floor itself, the kept magnitudes (all of them pass it; not to be written).
        Why: SIDCo's second stage fits every exceedance of the first stage's threshold, which is the
        floor it compacted at; copying them (~22 % of the tensor, three stages) cost ~10 % of its step.
        ``expected``: the share of the kept set (or of ``a``) about passing: the output's first size
        (a guess of all of it wrote buffers of the whole set's size and copied the answer out)."""
        if self.covers(thr):
            assert self.vals is not None  # set with floor by compact()
            if thr == self.floor and not self.signed and not self.nan_kept:
                return self.vals
            if self.native and _native.usable(self.vals):
                return _native.select(self.vals, thr, self.kept_mode, expected)[1]  # magnitudes in either mode
            kept = self._kept_magnitudes()
            return kept[self._cmp(kept, thr)]
        if self.native:
            return _native.select(self.a, thr, self.mode, expected)[1]
        return self.a[self._cmp(self.a, thr, out=self.mask)]


DEFER_ZEROING_MIN = 1 << 12
"""Fewest sent positions whose zeroing :meth:`SparseCompressor.defer_residual` leaves to the next
compensation: below, the write misses it saves (~11 ns a position) weigh less than what reading the
positions there costs (a galloped walk beside the floor's sample lines, ~30 us a tensor; the lanes'
masks in the add). ResNet-50's Top-k, tensors of 64K-512K elements: 8.2 / 8.5 / 9.0 ms a step deferred
against 8.1 / 8.3 / 8.6 written; from 512K: 29.5 / 30.1 / 31.6 against 30.8 / 30.9 / 30.7 ms."""


class SparseCompressor(Compressor):
    """Base of all sparsifiers: subclasses implement :meth:`select` returning flat indices.

    Sparse payloads are biased: pair them with ``residual`` (or ``dgc``) memory.
    Indices are int64 on the wire (int32 would halve index bytes; kept int64 for tensors >2^31).
    """

    sparse = True
    additive = False
    fixed_size = False
    exact_values: ClassVar[bool] = True
    """Payload values are the tensor's own at distinct indices and ``decompress`` scatters them
    (every built-in sparsifier); :meth:`residual` then zeroes the sent coordinates instead of
    decompressing. A subclass that rescales or re-encodes values sets it False."""
    residual_in_place: ClassVar[bool] = True
    """:meth:`residual` may write ``out`` over ``tensor`` itself (it zeroes the sent coordinates, or
    subtracts a freshly decompressed tensor): error-feedback memory then keeps the compensated
    buffer as the residual instead of copying it (:class:`~adacomp.memories.base.ResidualMemory`)."""
    batch_counts: ClassVar[bool] = True
    """Where reads wait (a GPU), a threshold search counts the thresholds it may visit in batches
    (:meth:`ThresholdCounter.prefetch`) unless ``ADACOMP_BATCHED_COUNTS`` says otherwise. Measured on
    an H100 (docs/results/cuda.md, fourth lease): it pays for MSTop-k's long bisections and loses
    for RedSync's and Gaussian-k's short searches, whose waits cost less than the batch's launches."""
    search_factor: ClassVar[float] = SEARCH_FACTOR
    """A threshold search's candidate floor aims at this multiple of the density
    (:func:`search_share`). The counts are exact whatever it is; a threshold below the floor is
    counted over the whole tensor, so a search that ends next to k takes less (MSTop-k's closest
    count: 1.5; RedSync's [k, 2k): 2.5) and one whose corrections may range widely keeps the default."""

    def __init__(self, density: float = 0.01):
        self._density = check_density(density)
        self.workspace = Workspace()

    def density(self) -> float | None:
        return self._density

    def set_density(self, density: float) -> None:
        self._density = check_density(density)

    def _widened(self, name: str, share: float) -> float:
        """``share`` (a fused pass's candidate target) times ``name``'s widening (:meth:`_passed`), at most 1."""
        return min(1.0, share * self.__dict__.get("widen", {}).get(name, 1.0))

    def _passed(self, name: str, count: int, need: int) -> None:
        """How many candidates the fused pass's sampled floor passed for ``name`` (the selection
        needs ``need`` of them). A speed hint, never state: a layer whose sample misjudges its tail
        (a few large rows) falls short on most steps, each a pass over the tensor more, so its target
        doubles after each shortfall (up to WIDEN_MAX) and shrinks back while more than twice
        ``need`` pass."""
        widen = self.__dict__.setdefault("widen", {})
        w = widen.get(name, 1.0)
        if count < need:
            widen[name] = min(WIDEN_MAX, 2.0 * w)
        elif w > 1.0 and count > 2 * need:
            widen[name] = max(1.0, 0.8 * w)

    def select(self, flat: Tensor, name: str) -> Tensor:
        """Indices (into ``flat``) of the elements to send."""
        raise NotImplementedError(f"{type(self).__name__} must implement select()")

    def choose(self, flat: Tensor, name: str) -> tuple[Tensor, Tensor | None]:
        """:meth:`select`'s indices and, where the selection has them at hand, ``flat``'s values
        there (None: :meth:`pick` gathers them)."""
        return self.select(flat, name), None

    def pick(self, flat: Tensor, name: str) -> tuple[Tensor, Tensor]:
        """The payload's indices and ``flat``'s values there, gathered where :meth:`choose` did not
        give them."""
        idx, vals = self.choose(flat, name)
        return idx, vals if vals is not None else _native.take(flat, idx)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        flat = flat_of(tensor)
        idx, vals = self.pick(flat, name)
        ctx = SparseCtx(tensor.shape, flat.numel(), tensor.dtype, tensor.device)
        return [vals, idx], ctx

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        return scatter(payload[0], payload[1], ctx, self._workspace())

    def residual(self, tensor: Tensor, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        if self.exact_values and payload[0].dtype == tensor.dtype:
            return sparse_residual(tensor, payload[1], out)
        return super().residual(tensor, payload, ctx, out)

    def compensate_zeroed(self, g: Tensor, r: Tensor, out: Tensor, name: str, zeroed: Tensor) -> bool:
        """``compensate_into`` with ``r`` read as +0.0 at the ascending positions ``zeroed`` (the
        residual's zeroing of the coordinates sent last, left to this pass); False (nothing written)
        where it cannot. A subclass whose fused compensation takes ``zeroed`` overrides this and
        :meth:`defers_zeroing`."""
        return False

    def defers_zeroing(self, tensor: Tensor) -> bool:
        """Whether :meth:`compensate_zeroed` runs on the next gradient of ``tensor``'s shape (so
        :meth:`defer_residual` may leave the residual's zeroing to it; where it then declines, the
        memory writes the residual into a new tensor: correct, but a page-faulting allocation)."""
        return False

    def defer_residual(self, tensor: Tensor, payload: Payload, ctx: Any) -> Any:
        """The sent positions, where the residual only zeroes them (:meth:`residual`'s case) and the
        next compensation's pass can read the stored sum as +0.0 there (:meth:`compensate_zeroed`):
        each zeroed position written now is a write miss on a tensor the add streamed out of the cache
        (SIDCo's VGG-16 cell: 16 ms, 0.18 memory floors a step). The token is the payload's own index
        tensor, which nothing rewrites (a pooled buffer is reused only once nobody holds it)."""
        if not (len(payload) == 2 and payload[1].numel() >= DEFER_ZEROING_MIN and self.defers_zeroing(tensor)
                and self.exact_values and isinstance(ctx, SparseCtx) and payload[0].dtype == tensor.dtype
                and ctx.numel == tensor.numel() and _native.usable(tensor)):
            return None
        idx = payload[1]
        return idx if idx.dim() == 1 and _native.ascending_within(idx, tensor.numel()) else None

    def owed_residual(self, base: Tensor, token: Any, out: Tensor) -> Tensor:
        return sparse_residual(base, token, out)

    def compensate_owed(self, g: Tensor, base: Tensor, token: Any, out: Tensor, name: str) -> bool:
        return self.compensate_zeroed(g, base, out, name, token)

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        return k_for(int(torch.Size(shape).numel()), self._density) * (itemsize + 8)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(density={self._density})"


_BATCH_COUNTS: dict[str, Callable[[ThresholdCounter, str, Tensor, Tensor], Tensor]] = {
    "sort": ThresholdCounter._sorted_counts, "bucket": ThresholdCounter._bucket_counts}
if BATCHED_COUNTS not in ("auto", *_BATCH_COUNTS, "off"):
    raise ValueError(f"ADACOMP_BATCHED_COUNTS={BATCHED_COUNTS!r}: choose one of {['auto', *_BATCH_COUNTS, 'off']}")
