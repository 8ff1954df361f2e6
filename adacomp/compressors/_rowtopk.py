"""Per-row top-k for ADTopk (adtopk.py, §4.1 "multiple local sortings"): the plain batched
``torch.topk`` per row, and a CPU fast path that returns the same index set with fewer passes over
the tensor (a per-row candidate floor from block maxima, one compare pass, one integer sort of the
candidates; rows with NaN or a tie at the cut go back to ``torch.topk``). Kept apart from the
compressors so adtopk.py holds the algorithms of the paper and this file the selection kernels.
"""
from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple, overload

import torch
from torch import Tensor

from adacomp import devices
from adacomp.compressors import _native
from adacomp.compressors.sparse import TINY, Workspace, nonzero_1d

# CPU fast paths (same selections, fewer passes) for float dtypes whose |x| is exact in float32.
FAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Below 2^14 elements the per-row torch.topk beats fast_row_topk's C calls (CPU, 1 thread, density
# 1 %, with the candidates from the compensation's pass and the selection from them in one C call,
# _native.row_finish: (256, 64) 96 vs 130 us, (64, 576) 220 vs 145, (1024, 256) 1220 vs 500; over
# ResNet-50's tensors of 2^10-2^20 elements 20.0 -> 13.6 ms a step; before row_finish the ~30 torch
# calls it replaced set the limit at 2^17, 2^19 with q < 4).
ROW_MIN_NUMEL = 1 << 14
# Strided / contiguous block counts per row, as multiples of the per-row need (see fast_row_topk).
GATHER_BLOCKS, GATHER_RATIO, MASK_RATIO = 64, 8, 1.5


CANDIDATE_LIMIT = 1 / 8  # candidates above this share of the tensor: plain torch.topk is faster


def matrix_shape(shape: torch.Size, split: str) -> tuple[int, int, int]:
    """(M, N, R) of the M x N view: R > 1 only for ``dim1`` on tensors with more than 2 dims
    (R trailing elements are interleaved between consecutive dim-1 entries)."""
    numel = int(torch.Size(shape).numel())
    if len(shape) < 2 or numel == 0:
        return 1, numel, 1
    if split == "rows":
        return int(shape[0]), numel // int(shape[0]), 1
    s1 = int(shape[1])
    return numel // s1, s1, numel // (int(shape[0]) * s1)


def row_topk(mag: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(rows, cols) of the selected entries of the (M, N) matrix ``mag``: q = k // M (>= 1) per row,
    plus one more in the r = k mod M rows with the largest next candidate."""
    m, _ = mag.shape
    q, r = divmod(k, m)
    if q == 0:
        q, r = 1, 0
    ar = torch.arange(m, device=mag.device)
    if r == 0:
        cols = torch.topk(mag, q, dim=1, sorted=False).indices
        return ar.repeat_interleave(q), cols.reshape(-1)
    vals, cols = torch.topk(mag, q + 1, dim=1, sorted=True)
    extra = torch.topk(vals[:, q], r, sorted=False).indices
    rows = torch.cat([ar.repeat_interleave(q), extra])
    return rows, torch.cat([cols[:, :q].reshape(-1), cols[extra, q]])


def fast_eligible(tensor: Tensor) -> bool:
    """The CPU speed-ups apply (CUDA keeps the plain torch.topk calls; float64 would round in |x|)."""
    return not devices.reads_wait(tensor) and tensor.dtype in FAST_DTYPES


class Candidates(NamedTuple):
    """Per row, a superset of its top q + 1 whose every member beats every non-member of the row:
    flat indices (ascending within a row), their |x| in float32 (the signed x where ``signed``: the
    payload's values then come from here), their rows (None: flat // n), the rows (M,) left to
    torch.topk because a NaN was seen (torch.topk ranks NaN first) or, where ``flags`` is given
    (:func:`_native.row_candidates`' per row: 1 a NaN, 2 all zero), the row is all zero."""

    flat: Tensor
    mag: Tensor
    row: Tensor | None
    bad: Tensor
    signed: bool = False
    flags: Tensor | None = None


class RowPick(NamedTuple):
    """:func:`fast_row_topk`'s answer: the ascending flat indices, how many rows torch.topk answered,
    and the selected elements' values where the candidates carried them (else None: gather them)."""

    idx: Tensor
    exact: int
    vals: Tensor | None = None


def _floor(bmax: Tensor, q1: int) -> tuple[Tensor, Tensor]:
    """q1-th largest of each row's disjoint block maxima: <= the row's own q1-th largest |x|."""
    floor = _native.row_kth(bmax, q1)  # one C call; torch's per-row topk cost ~10 ns per block maximum
    if floor is None:
        floor = torch.topk(bmax, q1, dim=1, sorted=False).values.amin(1)
    bad = torch.isnan(floor)
    # A row with fewer than q1 non-zero blocks has floor 0, and ">= 0" would make every element a
    # candidate (VGG-16's fc6 gradient is ~73 % exact zeros: ReLU inputs): 40x slower. Any floor
    # works as long as a row short of q1 candidates takes the exact path, so zeros never qualify.
    floor.clamp_(min=TINY)
    return floor.masked_fill_(bad, math.inf), bad


def _too_many(candidates: int, numel: int) -> bool:
    """The block-max floor filtered too little (rows whose large values crowd into a few columns, as
    in a low-rank weight gradient; many ties): sorting that many costs more than torch.topk on
    every row, which the caller then runs."""
    return candidates > CANDIDATE_LIMIT * numel


def _by_blocks(x: Tensor, m: int, n: int, q1: int, blocks: int) -> Candidates | None:
    """Contiguous rows (split ``rows``), small q: block maxima from amax / amin (two read-only
    passes, no |x| pass), then only the blocks whose maximum reaches the floor are re-read."""
    bs = n // blocks
    v = x.reshape(m, blocks, bs)
    bmax = torch.maximum(v.amax(2), v.amin(2).neg_()).float()  # NaN propagates
    floor, bad = _floor(bmax, q1)
    hit = torch.nonzero(bmax >= floor[:, None])
    if _too_many(hit.shape[0] * bs, m * n):
        return None
    blk = hit[:, 0] * blocks + hit[:, 1]
    g = x.reshape(m * blocks, bs).index_select(0, blk).abs().float()
    at = torch.nonzero((g >= floor.index_select(0, hit[:, 0])[:, None]).view(-1)).view(-1)
    return Candidates(blk.index_select(0, at // bs) * bs + at % bs, g.view(-1).index_select(0, at),
                      hit[:, 0].index_select(0, at // bs), bad)


def _by_row_maxima(x: Tensor, q1: int, blocks: int,
                   add: tuple[Tensor, Tensor] | None = None) -> Candidates | None | Literal[False]:
    """Contiguous rows of float32 on CPU in one C read of ``x`` and no |x| written: per row, while it
    is in cache, the strided blocks' maxima of |x|, their q1-th largest as the floor (:func:`_floor`'s
    value), and the compare of |x| with it. False where C cannot run (the torch path answers;
    nothing written). ``add = (g, r)``: each row of ``x = g + r`` written first (see
    :func:`_native.row_candidates`)."""
    m, n = x.shape
    got = _native.row_candidates(x, q1, blocks, TINY, min(1.0, 1.6 * q1 / n), limit=int(CANDIDATE_LIMIT * m * n),
                                 add=add, signed=True)
    if got is None:
        return False
    flat, vals, count, flags = got
    if _too_many(count, m * n):
        return None
    return Candidates(flat, vals, None, flags != 0, signed=True, flags=flags)


def _by_mask(tensor: Tensor, m: int, n: int, rr: int, q1: int, blocks: int, ws: Workspace) -> Candidates | None:
    """Any split, any q: |x| into scratch, block maxima over the first ``blocks * (n // blocks)``
    columns (contiguous blocks where they are long enough to reduce fast, else strided), one
    compare pass against the per-row floor."""
    s0, bs = m // rr, n // blocks
    if rr == 1:
        c = _by_row_maxima(tensor.reshape(m, n), q1, blocks)
        if c is not False:
            return c
    a = ws.magnitudes(tensor.reshape(-1))
    a3 = a.view(s0, n, rr)
    if rr == 1 and bs * blocks == n and bs >= 32:
        bmax = a.view(m, blocks, bs).amax(2)
    else:
        bmax = a3[:, :bs * blocks].reshape(s0, bs, blocks, rr).amax(1).transpose(1, 2).reshape(m, blocks)
    floor, bad = _floor(bmax, q1)
    if rr == 1 and floor.dtype == torch.float32:  # one C pass per row: the same set, same order
        got = _native.select_rows(a.view(m, n), floor.reshape(m), "ge" if bs * blocks == n else "not_lt",
                                  min(1.0, 1.6 * q1 / n), limit=int(CANDIDATE_LIMIT * m * n))
        if got is not None:
            flat, mag, count = got
            if _too_many(count, m * n):
                return None
            return Candidates(flat, mag, flat // n, bad)
    mask = ws.scratch("mask", a.numel(), torch.bool, a.device).view(s0, n, rr)
    # rr == 1: compare as (M, N) so the inner loop runs along the row (an (M, N, 1) broadcast runs
    # TensorIterator's inner loop over one element: ~2x slower, same result)
    am, mm, fl = (a.view(m, n), mask.view(m, n), floor.view(m, 1)) if rr == 1 else (a3, mask, floor.view(s0, 1, rr))
    if bs * blocks == n:  # a NaN anywhere made its row's floor NaN (now inf): a plain >= is safe
        torch.ge(am, fl, out=mm)
    else:
        torch.logical_not(torch.lt(am, fl, out=mm), out=mm)  # keeps NaN
    if _too_many(int(torch.count_nonzero(mask)), m * n):
        return None
    flat = nonzero_1d(mask.view(-1), min(1.0, 1.6 * q1 / n))
    row = flat // n if rr == 1 else flat // (n * rr) * rr + flat % rr
    return Candidates(flat, a.index_select(0, flat), row, bad)


def _exact_rows(x3: Tensor, rows: Tensor, q: int, r: int) -> tuple[Tensor | None, Tensor]:
    """:func:`row_topk`'s torch.topk calls on just ``rows`` (same per-row answers, ties included):
    ((q+1)-th magnitude or None when r = 0, columns (sorted by magnitude when r > 0))."""
    rr = x3.shape[2]
    if rows.numel() == 0:
        return x3.new_empty(0).abs(), rows.new_empty((0, q + (r > 0)))
    sub = x3[rows // rr, :, rows % rr].abs()
    if r == 0:
        return None, torch.topk(sub, q, dim=1, sorted=False).indices
    vals, cols = torch.topk(sub, q + 1, dim=1, sorted=True)
    return vals[:, q], cols


class _Plan(NamedTuple):
    """How :func:`fast_row_topk` finds a tensor's candidates: per-row need q (+1 in r rows), q1 = q + 1,
    and the block counts of the contiguous (``gather``) and strided (``blocks``) floors."""

    q: int
    r: int
    q1: int
    gather: int
    blocks: int


def _plan(m: int, n: int, k: int) -> _Plan | None:
    """None where the plain per-row torch.topk is as fast (see ROW_MIN_NUMEL)."""
    q, r = divmod(k, m)
    if q == 0:
        q, r = 1, 0
    q1 = q + 1
    if m * n < ROW_MIN_NUMEL:
        return None
    gather = max(GATHER_BLOCKS, 1 << math.ceil(math.log2(GATHER_RATIO * q1)))
    blocks = max(32, 1 << math.ceil(math.log2(MASK_RATIO * (q + 2))))
    return _Plan(q, r, q1, gather, blocks)


def _gathers(plan: _Plan, n: int, rr: int) -> bool:
    """Whether the candidates come from contiguous blocks (:func:`_by_blocks`)."""
    return rr == 1 and n % plan.gather == 0 and n // plan.gather >= 32


@functools.lru_cache(maxsize=256)
def _zero_row_cols(n: int, q: int, r: int) -> Tensor:
    """The columns :func:`row_topk`'s torch.topk keeps in a row of n equal magnitudes (a dead unit's
    all-zero weight row): those of a row taking q, ascending, then (r > 0) those of a row taking
    q + 1, ascending (r > 0: the first q, and all q + 1, of its sorted topk of q + 1). They depend
    on n, q and r > 0 only (torch's CPU topk on equal values: a heap over the first k, then its
    sort), so one call on a row of zeros answers every such row: on VGG-16's own gradients about
    half the rows of fc6 / fc7 and of the last conv layers, which went to torch.topk one by one
    (~500 ms a step)."""
    _, cols = _exact_rows(torch.zeros(1, n, 1, dtype=torch.float32), torch.zeros(1, dtype=torch.int64), q, r)
    parts = [cols[0, :q]] + ([cols[0, :q + 1]] if r else [])
    return torch.cat([torch.sort(c).values for c in parts]).contiguous()


def compensated_candidates(g: Tensor, r: Tensor, out: Tensor, m: int, n: int, rr: int,
                           k: int) -> Candidates | bool:
    """Error feedback's compensation ``out = g + r`` (torch.add's bits) with the candidates
    :func:`fast_row_topk` takes from :func:`_by_row_maxima`, in one C pass, each row compensated
    just before it is read. False where that path would not run (nothing written); True where the
    sum is written but the candidates are too many (fast_row_topk answers None again then)."""
    plan = _plan(m, n, k)
    if plan is None or rr != 1 or _gathers(plan, n, rr) or 2 * plan.blocks > n:
        return False
    c = _by_row_maxima(out.view(m, n), plan.q1, plan.blocks, add=(g.reshape(m, n), r.reshape(m, n)))
    return True if c is None else c


def fast_row_topk(tensor: Tensor, m: int, n: int, rr: int, k: int, ws: Workspace,
                  known: Candidates | None = None) -> RowPick | None:
    """The flat indices :func:`row_topk` selects on |tensor| (same set), ascending (what the
    all-gather's one-pass sparse mean takes), and how many rows fell back to its torch.topk; None
    where the plain per-row torch.topk is as fast.

    Why it is exact. Per row, the (q+1)-th largest of B disjoint block maxima is <= the row's
    (q+1)-th largest |x|, so the elements at or above it (candidates) hold the row's top q + 1 and
    beat all others. One integer sort of (row, |x| bits) ranks every row's candidates and gives its
    v[q-1], v[q], v[q+1] (descending, exact): where the gap a row needs is strict (v[q-1] > v[q]
    for q elements, v[q] > v[q+1] for q + 1), its selection is unique and the top of its sorted run
    is it. Rows with NaN or a tie at that gap take :func:`row_topk`'s own torch.topk call on just
    those rows (torch.topk treats rows independently), and the r remainder rows come from the same
    torch.topk over the exact v[q], so torch's tie choices are kept everywhere.

    Cost at 2^24 elements: one |x| pass (none for small q), one block-max pass, one compare pass
    (none for small q) and work on ~1.2-1.6 k candidates, against torch.topk's ~9 ns per element.
    ``known``: what :func:`compensated_candidates` found for ``tensor`` (unchanged since).
    """
    plan = _plan(m, n, k)
    if plan is None:
        return None
    q, r, q1 = plan.q, plan.r, plan.q1
    if known is not None:
        c: Candidates | None = known
    elif _gathers(plan, n, rr):
        c = _by_blocks(tensor.reshape(m, n), m, n, q1, plan.gather)
    elif 2 * plan.blocks <= n:
        c = _by_mask(tensor, m, n, rr, q1, plan.blocks, ws)
    else:
        return None
    if c is None:
        return None
    if rr == 1 and tensor.dtype == torch.float32:  # the usual case in one C call (ties, NaN: below)
        zero = c.flags is not None
        done = _native.row_finish(c.mag, c.flat, c.flags if c.flags is not None else c.bad, m, q, r, n,
                                  signed=c.signed, x=tensor if zero else None,
                                  zero_cols=_zero_row_cols(n, q, r) if zero else None)
        if done is not None and done.tied is None:
            return RowPick(done.idx, 0, done.vals)
        if done is not None:  # rows tied at their cut: torch.topk's own choice, spliced in ascending
            assert done.tied is not None
            rows_b = torch.nonzero(done.tied).view(-1)
            more = done.tied.index_select(0, rows_b) == 2
            _, cols_b = _exact_rows(tensor.reshape(m, n, 1), rows_b, q, r)
            back = torch.cat([(rows_b * n).repeat_interleave(q) + cols_b[:, :q].reshape(-1),
                              rows_b[more] * n + (cols_b[more, q] if r else cols_b[:0, 0])])
            if done.vals is None:
                return RowPick(merge_ascending(done.idx, back), int(rows_b.numel()))
            # the tied rows' values gathered alone (a few rows), not the whole payload's
            idx, vals = merge_ascending(done.idx, back, done.vals, tensor.reshape(-1).index_select(0, back))
            return RowPick(idx, int(rows_b.numel()), vals)
    cmag = c.mag.abs() if c.signed else c.mag
    crow = c.row if c.row is not None else c.flat // n
    # v[q+1], v[q], v[q-1] (0-based, descending) of each row's candidates, -1 where it has too few:
    # three quickselects per row in C where the candidates come grouped by row (with the rows' counts
    # and NaN flags from the same walk), else one integer (radix) sort of them all by (row, |x|)
    # (float bits of x >= 0 are monotone)
    stats = _native.row_order_stats(cmag, crow, m, q, n) if rr == 1 else None
    bad = c.bad
    if stats is not None:
        counts = stats.counts
        bad |= stats.nan
    else:
        counts = torch.bincount(crow, minlength=m)
        nan = torch.isnan(cmag)
        if bool(nan.any()):
            bad[crow[nan]] = True
    bad |= counts < q1
    good = ~bad
    if stats is not None:
        v_q1, v_q, v_q0 = stats.stats.unbind(1)
    else:
        order = torch.sort((crow << 32) | (cmag.view(torch.int32) & 0x7FFFFFFF).to(torch.int64)).indices
        mag = torch.cat([cmag.index_select(0, order), cmag.new_full((1,), -1.0)])  # [-1] pads short rows
        end = torch.cumsum(counts, 0)
        last = c.flat.numel()
        v_q1, v_q, v_q0 = (mag.index_select(0, torch.where(counts >= q + 1 + j, end - q - 1 - j, last))
                           for j in (1, 0, -1))
    x3 = tensor.reshape(m // rr, n, rr)
    rows_a = torch.nonzero(bad).view(-1)
    vq_a, cols_a = _exact_rows(x3, rows_a, q, r)
    extra = torch.zeros(m, dtype=torch.bool, device=tensor.device)
    if r:
        assert vq_a is not None  # _exact_rows returns the (q+1)-th magnitudes when r > 0
        vq = v_q.to(tensor.dtype)
        vq[rows_a] = vq_a
        extra[torch.topk(vq, r, sorted=False).indices] = True
    tied = good & torch.where(extra, v_q <= v_q1, v_q0 <= v_q)
    rows_b = torch.nonzero(tied).view(-1)
    _, cols_b = _exact_rows(x3, rows_b, q, r)
    # each chosen row's largest q (+1) are its candidates at or above its q-th ((q+1)-th) largest, a
    # value no other of its candidates reaches (the strict gap above); read in the candidates' own
    # ascending order, so the payload comes out ascending without a gather by rank
    chose = good & ~tied  # (a magnitude of inf would pass any threshold: the rows are masked apart)
    row_thr = torch.where(extra, v_q, v_q0)
    chosen = _native.row_chosen(cmag, c.flat, crow, row_thr, chose)
    if chosen is None:
        chosen = c.flat[chose.index_select(0, crow) & (cmag >= row_thr.index_select(0, crow))]
    exact = int(rows_a.numel() + rows_b.numel())
    if not exact:  # every row chosen from its candidates, nothing to splice in
        return RowPick(chosen, 0)
    rows_x, cols_x = torch.cat([rows_a, rows_b]), torch.cat([cols_a, cols_b])
    more = extra[rows_x]
    rows_x, cols_x = (torch.cat([rows_x.repeat_interleave(q), rows_x[more]]),
                      torch.cat([cols_x[:, :q].reshape(-1), cols_x[more, q] if r else cols_x[:0, 0]]))
    back = (rows_x // rr) * (n * rr) + cols_x * rr + rows_x % rr
    if back.numel():  # rows torch.topk answered: merged into ascending order
        chosen = merge_ascending(chosen, back)
    return RowPick(chosen, exact)


# Above this many runs of ``extra`` between consecutive members of ``ordered`` the slices'
# concatenation costs more than one sort of the union.
MERGE_RUNS = 64


@overload
def merge_ascending(ordered: Tensor, extra: Tensor) -> Tensor: ...


@overload
def merge_ascending(ordered: Tensor, extra: Tensor, ordered_vals: Tensor, extra_vals: Tensor) -> tuple[Tensor, Tensor]: ...


def merge_ascending(ordered: Tensor, extra: Tensor, ordered_vals: Tensor | None = None,
                    extra_vals: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """``torch.sort(torch.cat([ordered, extra])).values`` for an ascending ``ordered`` and a few
    ``extra`` values none of which is in it: ``extra`` sorted alone, then spliced in where
    ``searchsorted`` puts it. The indices of a row that torch.topk answered are one run (rows
    contiguous in memory, none of its indices among ``ordered``), so a tied row costs one copy of
    the payload instead of a sort of it (VGG-16's fc6: ~1M indices, 50 ms). With ``ordered_vals``
    and ``extra_vals`` (one per index), also those values in the merged order."""
    extra, order = torch.sort(extra)
    at = torch.searchsorted(ordered, extra)
    cuts = torch.nonzero(at[1:] != at[:-1]).view(-1) + 1
    if cuts.numel() >= MERGE_RUNS:
        merged, perm = torch.sort(torch.cat([ordered, extra]))

        def spliced(a: Tensor, b: Tensor) -> Tensor:
            return torch.cat([a, b]).index_select(0, perm)
    else:
        starts = [0] + cuts.tolist()
        ends = starts[1:] + [extra.numel()]
        pos = at.index_select(0, torch.tensor(starts, dtype=torch.long, device=at.device)).tolist()

        def spliced(a: Tensor, b: Tensor) -> Tensor:  # b's runs put into a where extra's went
            parts, prev = [], 0
            for lo, hi, p in zip(starts, ends, pos):
                parts += [a[prev:p], b[lo:hi]]
                prev = p
            parts.append(a[prev:])
            return torch.cat(parts)
        merged = spliced(ordered, extra)
    if ordered_vals is None or extra_vals is None:
        return merged
    return merged, spliced(ordered_vals, extra_vals.index_select(0, order))
