"""Ok-Topk's sparse allreduce (Li & Hoefler, PPoPP'22; summarised in ADTopk §2.2 and §6).

The point of Ok-Topk is that the aggregate of P local top-k selections is itself sparsified before
it is replicated, so every rank receives about k elements instead of P x k. Per step and per bucket
(all entries of a bucket share one index space: entry i occupies ``[off_i, off_i + numel_i)``):

1. **local selection**: every rank runs the entry's sparsifier (``oktopk``'s reused local
   threshold, or any other sparsifier) on its error-compensated gradient;
2. **split and reduce**: the index space is cut into P contiguous regions, region j is owned by
   rank j; one alltoall sends each rank's selected (value, index) pairs to the owners, and owner j
   sums what it received (a sparse sum: no dense buffer);
3. **global threshold**: owners keep the reduced values whose magnitude passes one global
   threshold. It is estimated (the k-th largest reduced magnitude over all regions: each owner
   contributes its top ``min(u_j, 2k/P)`` magnitudes to one allgather, which is exact while no
   region holds more than twice its share of the global top-k) every ``period`` steps
   and reused in between, with the count-band correction of :mod:`adacomp.compressors._band`
   decided on the global count (the same number on every rank, so every rank takes the same
   branch). Outside the hard band [k/2, 2k] the threshold is re-chosen *by counts*: each owner
   counts its values at 33 multiples (0.25x-4x) of the reused threshold, one allgather of those
   counts, and the multiple nearest k is used at once (the magnitudes estimation only when no
   multiple lands in the band);
4. **allgather** of the owners' selections (about k pairs in all), averaged over ranks.

Regions are **balanced**: every ``rebalance`` steps each rank proposes the P-1 boundaries that cut
its own selection into equal counts, and one allreduce averages the proposals (so an owner gets
about k/P pairs from each rank, not a dense region's worth). Between re-balancings the regions are
kept.

**Error feedback for both stages.** Ok-Topk keeps in the residual every error-compensated value
the global result did not use: a rank reports as its contribution only its local pairs
whose index made the global selection, so what the local stage dropped *and* what the global
threshold dropped at its indices stays in its residual (sum over ranks of what is applied plus
the residuals equals the sum of the compensated gradients).

Collective order per bucket, identical on every rank (it depends only on the step, the bucket
shapes and counts every rank knows): [re-balancing allreduce], count alltoall, data alltoall,
[estimation allgather], count allgather, [hard band: grid-count allgather, or estimation
allgather + count allgather], data allgather. ``start`` blocks on the small count alltoall;
everything after the data alltoall runs in ``finish``. ``stats.extra["oktopk_recv_elems"]``
counts the gradient elements (pairs and magnitudes) a rank receives from the others; the small
count exchanges are not included.

Deviations: regions are re-balanced by averaging boundary proposals (the paper balances on the
owners' counts); the paper's destination rotation to avoid endpoint congestion is left to the
backend's alltoall; a global estimation moves about 2k magnitudes (values only) every
``period`` steps and whenever the global count leaves [k/2, 2k].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from adacomp.backends.base import Backend
from adacomp.communicators.allgather import _workspace, dest_or_output, layout, pack, unpack
from adacomp.communicators.base import CommEnv, Communicator, Entry, register
from adacomp.compressors import _native
from adacomp.compressors._band import HARD_HIGH, HARD_LOW, judge
from adacomp.compressors.base import Compressor
from adacomp.compressors.sparse import divide_touched, k_for
from adacomp.compressors.workspace import Workspace

#: an owner contributes at most ESTIMATE_SHARE * k / P magnitudes to a global estimation (adacomp's
#: choice: 2 keeps the estimate exact under balanced regions while moving ~2k values, not P x k)
ESTIMATE_SHARE = 2.0
#: multiples of a reused global threshold counted when the global count leaves [k/2, 2k]:
#: 2^(j/8) for j = -16..16, i.e. 0.25x-4x in steps of ~9 % (adacomp's choice: 33 counts per owner
#: instead of ~2k magnitudes, and fine enough to land near k)
GRID = tuple(2.0 ** (j / 8) for j in range(-16, 17))


def equal_bounds(numel: int, world: int) -> list[int]:
    """P + 1 boundaries of P contiguous regions of (nearly) equal size."""
    base, extra = divmod(numel, world)
    out = [0]
    for j in range(world):
        out.append(out[-1] + base + (1 if j < extra else 0))
    return out


def proposal(sorted_idx: Tensor, numel: int, world: int) -> list[float]:
    """The P - 1 inner boundaries that cut this rank's (ascending) selection into equal counts."""
    n = sorted_idx.numel()
    if n == 0:
        return [float(b) for b in equal_bounds(numel, world)[1:-1]]
    return [float(sorted_idx[min(n - 1, (j * n) // world)]) for j in range(1, world)]


def balanced_bounds(mean_proposal: list[float], numel: int) -> list[int]:
    """Averaged proposals rounded into monotone boundaries ``0 = b_0 <= ... <= b_P = numel``."""
    out, last = [0], 0
    for x in mean_proposal:
        last = min(numel, max(last, int(round(x))))
        out.append(last)
    return out + [numel]


def sparse_sum(idx: Tensor, vals: Tensor, runs: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """Sum of the values sharing an index: ascending unique indices and their sums. ``runs``: the
    lengths of ascending runs ``idx`` is made of (each rank's pairs), merged in C where they serve."""
    if runs is not None and len(runs) > 1:
        got = _native.merge_sum(list(idx.split(runs)), list(vals.split(runs)))
        if got is not None:
            return got
    uniq, inv = torch.unique(idx, sorted=True, return_inverse=True)
    return uniq, torch.zeros(uniq.numel(), dtype=vals.dtype, device=vals.device).index_add_(0, inv, vals)


def sparse_sum_runs(idx: list[Tensor], vals: list[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`sparse_sum` of the ascending runs ``idx`` / ``vals`` (each rank's pairs), without joining
    them first where the C merge serves."""
    if len(idx) > 1:
        got = _native.merge_sum(idx, vals)
        if got is not None:
            return got
    return sparse_sum(_joined(idx), _joined(vals))


def _joined(parts: list[Tensor]) -> Tensor:
    """``torch.cat(parts)``, or the one part itself (read only): no copy of a one-entry bucket."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def kth_largest(mags: Tensor, k: int) -> float:
    """The k-th largest of ``mags`` (the smallest of them all when there are fewer than k)."""
    if mags.numel() == 0:
        return float("inf")
    return float(torch.topk(mags, min(k, mags.numel()), sorted=False).values.min())


@dataclass
class _Pending:
    entries: list[Entry]
    key: str
    k: int
    offsets: list[int]
    idx: Tensor            # this rank's selected global indices, ascending (int64)
    vals: Tensor           # their values
    perm: Tensor | None    # position of each sorted pair in the concatenated payloads (None: in order)
    bounds: list[int]
    handle: Any
    recv_counts: list[int]
    idx_dtype: torch.dtype


@register("oktopk")
class OkTopkCommunicator(Communicator):
    """Ok-Topk's sparse allreduce: split and reduce on balanced regions, global threshold,
    allgather of about k pairs. ``period``: steps between exact global threshold estimations
    (Ok-Topk's tau', 32 as the local threshold); ``rebalance``: steps between region re-balancings
    (Ok-Topk's tau; 32 here, an adacomp choice). Carries any sparsifier (``[values, indices]``)."""

    def __init__(self, period: int = 32, rebalance: int = 32):
        for key, v in (("period", period), ("rebalance", rebalance)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"oktopk communicator: {key} must be an int >= 1, got {v!r}")
        self.period, self.rebalance = period, rebalance
        self.bounds: dict[str, list[int]] = {}
        self.rebalanced_at: dict[str, int] = {}
        self.threshold: dict[str, float] = {}
        self.estimated_at: dict[str, int] = {}
        self.estimated_k: dict[str, int] = {}

    def check(self, compressor: Compressor) -> None:
        if not compressor.sparse or compressor.rounds != 1:
            raise self.incompatible("oktopk", compressor,
                                    "Ok-Topk's sparse allreduce sums [values, indices] payloads of a sparsifier")

    # --- stage 1 ------------------------------------------------------------------------------
    def start(self, entries: list[Entry], env: CommEnv) -> Any:
        backend = env.backend
        world = backend.size()
        dtypes = {e.tensor.dtype for e in entries}
        if len(dtypes) != 1:
            raise TypeError(f"oktopk reduces one bucket in one index space; its tensors must share a dtype, "
                            f"got {sorted(map(str, dtypes))}. Put tensors of other dtypes in another bucket.")
        device = entries[0].tensor.device
        with env.stats.timing("compress"):
            offsets, numel, k = [], 0, 0
            idx_parts, val_parts = [], []
            for e in entries:
                e.payload, e.ctx = e.compressor.compress(e.tensor, e.name)
                offsets.append(numel)
                pidx = e.payload[1].reshape(-1).to(torch.int64)
                idx_parts.append(pidx + numel if numel else pidx)  # read only from here: no copy needed
                val_parts.append(e.payload[0].reshape(-1).to(e.tensor.dtype))
                env.stats.add_gain_of(e.payload[0], e.tensor)
                numel += e.tensor.numel()
                k += k_for(e.tensor.numel(), float(e.compressor.density() or 1.0))
            idx, perm = _joined(idx_parts), None
            vals = _joined(val_parts)
            if not _native.ascending_within(idx, numel):  # sparsifiers list positions ascending: no sort then
                idx, perm = torch.sort(idx)
                vals = vals.index_select(0, perm)
        key = entries[0].name
        bounds = self._bounds(key, numel, idx, backend, env.step)
        idx_dtype = torch.int32 if numel < 2 ** 31 else torch.int64
        with env.stats.timing("comm"):
            cuts = torch.searchsorted(idx, torch.tensor(bounds, dtype=torch.int64, device=idx.device)).tolist()
            send_counts = [cuts[j + 1] - cuts[j] for j in range(world)]
            recv_counts = backend.alltoall_splits(send_counts)
            per_dest = [[vals[cuts[j]:cuts[j + 1]], (idx[cuts[j]:cuts[j + 1]] - bounds[j]).to(idx_dtype)]
                        for j in range(world)]
            send = [layout(p) for p in per_dest]
            buf = torch.cat([pack(p, s, tot, device) for p, (s, tot) in zip(per_dest, send)])
            recv_bytes = [layout(per_dest[0], [c, c])[1] for c in recv_counts]
            handle = backend.alltoall_async(buf, [tot for _, tot in send], recv_bytes)
        me = backend.rank()
        itemsize = vals.element_size() + torch.tensor([], dtype=idx_dtype).element_size()
        env.stats.bytes_sent += (idx.numel() - send_counts[me]) * itemsize
        env.stats.dense_bytes += sum(e.tensor.numel() * e.tensor.element_size() for e in entries)
        env.stats.extra["oktopk_recv_elems"] = env.stats.extra.get("oktopk_recv_elems", 0.0) + float(
            sum(recv_counts) - recv_counts[me])
        return _Pending(entries, key, k, offsets, idx, vals, perm, bounds, handle, recv_counts, idx_dtype)

    def _bounds(self, key: str, numel: int, idx: Tensor, backend: Backend, step: int) -> list[int]:
        """This bucket's regions, re-balanced every ``rebalance`` steps (one small allreduce)."""
        world = backend.size()
        old = self.bounds.get(key)
        last = self.rebalanced_at.get(key)
        if (old is not None and len(old) == world + 1 and old[-1] == numel and last is not None
                and 0 <= step - last < self.rebalance):
            return old
        if world == 1:
            bounds = [0, numel]
        else:
            mine = torch.tensor(proposal(idx, numel, world), dtype=torch.float64)
            total = backend.allreduce(mine, average=False)
            bounds = balanced_bounds([float(x) / world for x in total.tolist()], numel)
        self.bounds[key], self.rebalanced_at[key] = bounds, step
        return bounds

    # --- stages 2 to 4 ------------------------------------------------------------------------
    def finish(self, pending: Any, env: CommEnv) -> list[Tensor]:
        p: _Pending = pending
        backend = env.backend
        world, me = backend.size(), backend.rank()
        with env.stats.timing("comm"):
            received = p.handle.wait()
        with env.stats.timing("compress"):
            segs_idx, segs_val, off = [], [], 0
            for c in p.recv_counts:
                segs, tot = layout([p.vals, torch.empty(0, dtype=p.idx_dtype)], [c, c])
                v, i = unpack(received[off:off + tot], segs)
                segs_val.append(v)
                segs_idx.append(i.to(torch.int64, copy=True).add_(p.bounds[me]))
                off += tot
            ridx, rvals = sparse_sum_runs(segs_idx, segs_val)
            mags = rvals.abs()
        with env.stats.timing("comm"):
            sel, counts = self._global_select(p.key, p.k, mags, backend, env)
            at = sel.nonzero().view(-1)  # then gathers: half a boolean index's time
            gidx, gvals = ridx.index_select(0, at), rvals.index_select(0, at)
            tensors = [gvals, gidx.to(p.idx_dtype)]
            layouts = [layout(tensors, [c, c]) for c in counts]
            buf = pack(tensors, layouts[me][0], layouts[me][1], gvals.device)
            gathered = backend.allgather_async(buf, sizes=[tot for _, tot in layouts]).wait() if max(counts) else buf
        env.stats.bytes_sent += gvals.numel() * (gvals.element_size() + tensors[1].element_size())
        extra = env.stats.extra
        extra["oktopk_recv_elems"] = extra.get("oktopk_recv_elems", 0.0) + float(sum(counts) - counts[me])
        extra["oktopk_nnz"] = extra.get("oktopk_nnz", 0.0) + float(sum(counts))
        extra["oktopk_k"] = extra.get("oktopk_k", 0.0) + float(p.k)
        with env.stats.timing("compress"):
            all_idx, all_vals, off = [], [], 0
            for c, (s, tot) in zip(counts, layouts):
                v, i = unpack(gathered[off:off + tot], s)
                all_vals.append(v)
                all_idx.append(i)
                off += tot
            # ascending: regions are ordered; the positions widened to int64 as they are joined
            g_idx = torch.cat(all_idx, out=torch.empty(sum(counts), dtype=torch.int64, device=gvals.device)) \
                if len(all_idx) > 1 else all_idx[0].to(torch.int64)
            g_vals = _joined(all_vals)
            self._report_kept(p, g_idx)
            return self._means(p, g_idx, g_vals, world, _workspace(self))

    def _global_select(self, key: str, k: int, mags: Tensor, backend: Backend,
                       env: CommEnv) -> tuple[Tensor, list[int]]:
        """This owner's reduced values passing the global threshold, and every owner's count."""
        fresh = self._due(key, k, env.step)
        if fresh:
            self._estimate(key, k, mags, backend, env)
        sel, counts = self._count(key, mags, backend)
        if not fresh:
            verdict = judge(self.threshold[key], sum(counts), k)
            if verdict.reestimate:
                env.stats.extra["oktopk_reestimated"] = env.stats.extra.get("oktopk_reestimated", 0.0) + 1.0
                found = self._regrid(key, k, mags, backend)
                if found is not None:
                    return found
                self._estimate(key, k, mags, backend, env)
                sel, counts = self._count(key, mags, backend)
            else:
                self.threshold[key] = verdict.threshold
        return sel, counts

    def _due(self, key: str, k: int, step: int) -> bool:
        last = self.estimated_at.get(key)
        return (last is None or self.estimated_k.get(key) != k or step - last >= self.period
                or step < last or key not in self.threshold)

    def _estimate(self, key: str, k: int, mags: Tensor, backend: Backend, env: CommEnv) -> None:
        """Global k-th largest from each owner's top ``min(u_j, ceil(ESTIMATE_SHARE * k / P))``
        magnitudes: exact while no region holds more than twice its share of the global top-k
        (balanced regions), a lower threshold otherwise, which the count band then corrects."""
        m = min(mags.numel(), math.ceil(ESTIMATE_SHARE * k / backend.size()))
        top = torch.topk(mags, m, sorted=False).values if m else mags[:0]
        everyone = backend.allgather(top.contiguous())
        extra = env.stats.extra
        extra["oktopk_recv_elems"] = extra.get("oktopk_recv_elems", 0.0) + float(everyone.numel() - top.numel())
        env.stats.bytes_sent += top.numel() * top.element_size()
        self.threshold[key] = kth_largest(everyone, k)
        self.estimated_at[key], self.estimated_k[key] = env.step, k

    def _regrid(self, key: str, k: int, mags: Tensor, backend: Backend) -> tuple[Tensor, list[int]] | None:
        """Re-estimation by counts: every owner counts its reduced values at ``GRID`` multiples of
        the reused threshold, one allgather of those P x len(GRID) counts gives every rank the
        same table, and the multiple whose total is nearest k (in ratio) inside [k/2, 2k] becomes
        the threshold. None when no multiple lands in the band (then the magnitudes estimation)."""
        base = self.threshold[key]
        cands = [base * r for r in GRID]
        mine = torch.tensor([int(torch.count_nonzero(torch.ge(mags, c))) for c in cands], dtype=torch.int64)
        table = backend.allgather(mine.view(1, -1), sizes=[1] * backend.size()).view(backend.size(), -1)
        totals = table.sum(0).tolist()
        best, score = None, math.inf
        for j, total in enumerate(totals):
            if HARD_LOW * k <= total <= HARD_HIGH * k and abs(math.log(max(total, 1) / k)) < score:
                best, score = j, abs(math.log(max(total, 1) / k))
        if best is None:
            return None
        self.threshold[key] = cands[best]
        return torch.ge(mags, cands[best]), [int(c) for c in table[:, best].tolist()]

    def _count(self, key: str, mags: Tensor, backend: Backend) -> tuple[Tensor, list[int]]:
        sel = torch.ge(mags, self.threshold[key])
        mine = torch.tensor([int(torch.count_nonzero(sel))], dtype=torch.int64)
        counts = backend.allgather(mine, sizes=[1] * backend.size()).view(-1).tolist()
        return sel, [int(c) for c in counts]

    @staticmethod
    def _report_kept(p: _Pending, g_idx: Tensor) -> None:
        """Report this rank's pairs whose index the global selection kept: the residual the
        engine stores keeps every compensated value the aggregate did not use (both stages' drops)."""
        kept = _native.sorted_member(p.idx, g_idx)  # both ascending: one merge
        if kept is None:
            kept = torch.isin(p.idx, g_idx)
        kept_unsorted = kept
        if p.perm is not None:
            kept_unsorted = torch.empty_like(kept)
            kept_unsorted[p.perm] = kept
        start = 0
        for e in p.entries:
            n = e.payload[0].numel()  # type: ignore[index]
            at = kept_unsorted[start:start + n].nonzero().view(-1)  # then two gathers: half a mask index's time
            start += n
            vals, idx = e.payload[0].reshape(-1), e.payload[1].reshape(-1)  # type: ignore[index]
            e.report(e.compressor, [vals.index_select(0, at), idx.index_select(0, at)], e.ctx)

    @staticmethod
    def _means(p: _Pending, g_idx: Tensor, g_vals: Tensor, world: int, ws: Workspace) -> list[Tensor]:
        """Each entry's mean of the kept pairs, written whole into its :attr:`~Entry.dest` or a
        recycled output (a fresh model-size tensor a step cost GPT-2-small ~60 ms of page faults)."""
        out = []
        cuts = torch.searchsorted(g_idx, torch.tensor(p.offsets + [2 ** 62], dtype=torch.int64,
                                                  device=g_idx.device)).tolist()
        for i, e in enumerate(p.entries):
            lo, hi = cuts[i], cuts[i + 1]
            idx = g_idx[lo:hi] - p.offsets[i]
            acc = (dest_or_output(e, ws).view(-1) if e.tensor.dtype == torch.float32
                   else torch.empty(e.tensor.numel(), dtype=e.tensor.dtype, device=e.tensor.device))
            if not _native.sparse_mean(acc, [idx], [g_vals[lo:hi]], world):  # zeros, add, divide: one C write
                acc.zero_().index_add_(0, idx, g_vals[lo:hi].to(acc.dtype))
                divide_touched(acc, idx, world)
            out.append(acc.view(e.tensor.shape))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"bounds": {k: list(v) for k, v in self.bounds.items()},
                "rebalanced_at": dict(self.rebalanced_at), "threshold": dict(self.threshold),
                "estimated_at": dict(self.estimated_at), "estimated_k": dict(self.estimated_k)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        known = {"bounds", "rebalanced_at", "threshold", "estimated_at", "estimated_k"}
        unknown = sorted(set(state) - known)
        if unknown:
            raise ValueError(f"communicator 'oktopk' got unknown state keys {unknown}; known: {sorted(known)}")
        self.bounds = {k: [int(x) for x in v] for k, v in state.get("bounds", {}).items()}
        self.rebalanced_at = {k: int(v) for k, v in state.get("rebalanced_at", {}).items()}
        self.threshold = {k: float(v) for k, v in state.get("threshold", {}).items()}
        self.estimated_at = {k: int(v) for k, v in state.get("estimated_at", {}).items()}
        self.estimated_k = {k: int(v) for k, v in state.get("estimated_k", {}).items()}

    def __repr__(self) -> str:
        return f"OkTopkCommunicator(period={self.period}, rebalance={self.rebalance})"
