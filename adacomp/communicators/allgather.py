"""Allgather and AllgatherFast communicators (ADTopk paper §5, "communication and aggregation module").

Both move the payloads of a whole bucket as ONE byte buffer (every payload tensor reinterpreted as
``uint8`` and packed at 8-byte aligned offsets), so a bucket costs one data collective whatever
its number of tensors. After the gather every rank holds every rank's payloads and aggregates:

* sparse payloads ``[values, indices]``: the values of all ranks are added at their indices into
  one zero buffer per entry (memory traffic O(numel + world * k) instead of decompressing
  ``world`` dense tensors), then divided by the world size. Where every rank's indices ascend (the
  canonical sparsifiers' payloads) one C pass does this block by block while the block sits in L1
  (one write of the output); otherwise one ``index_add_`` and a division of the touched coordinates;
* other payloads (quantizers such as qsgd / efsignsgd that cannot be summed): ``decompress`` of
  each rank's payload with this rank's ctx, summed, divided by the world size.

``allgather`` lets ranks send different sizes (threshold sparsifiers): the per-tensor element
counts of the bucket are exchanged first in one small allgather; the data gather is launched once
those counts are in, at the next bucket's ``start`` or the first ``finish`` (a latency, not a
bandwidth cost, and not one that stops backward). ``allgather_fast`` (the paper's
AllgatherFast) serves fixed-size compressors only: every rank's buffer has this rank's layout, so
there is no size exchange, and the gathered buffer is read as a (world, bytes) matrix whose column
ranges are the per-tensor payloads of all ranks at once (no per-rank split step).

Deviation from the authors' code: their allgather sends each payload tensor in its own collective
and their AllgatherFast also gathers dense tensors; here dense tensors belong on ``allreduce``
(the optimizer routes them by ``min_numel`` / ``layers``), and one collective serves a bucket.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, cast

import torch
from torch import Tensor

from adacomp.backends.base import Backend, Handle
from adacomp.communicators.base import CommEnv, Communicator, Entry, register
from adacomp.compressors import _native
from adacomp.compressors.base import Compressor
from adacomp.compressors.chunktopk import unit_levels
from adacomp.compressors.sparse import Workspace, divide_touched

ALIGN = 8  # bytes; every segment starts at a multiple of the largest element size


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Segment(NamedTuple):
    """Where one payload tensor sits in a packed byte buffer. (A NamedTuple: one is made per
    payload tensor and rank every round, and a frozen dataclass's ``__init__`` costs ~3x more.)"""

    offset: int
    numel: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # this rank's shape; other ranks may differ in dim 0

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def shape_for(self, numel: int) -> tuple[int, ...]:
        if len(self.shape) == 0:
            return ()
        if len(self.shape) == 1:
            return (numel,)
        return (-1, *self.shape[1:])


def layout(tensors: list[Tensor], numels: list[int] | None = None) -> tuple[list[Segment], int]:
    """Segments for ``tensors`` (or for another rank's ``numels`` of the same dtypes) and the
    total padded size in bytes."""
    segs, off = [], 0
    for i, t in enumerate(tensors):
        n = t.numel() if numels is None else int(numels[i])
        dtype = t.dtype
        segs.append(Segment(off, n, dtype, tuple(t.shape)))
        off += -(-n * dtype.itemsize // ALIGN) * ALIGN  # _padded, inline: per payload tensor and rank
    return segs, off


def pack(tensors: list[Tensor], segs: list[Segment], total: int, device: torch.device,
         ws: Workspace | None = None) -> Tensor:
    """``tensors``' bytes at their segments' offsets of one buffer whose padding is zero. On the CPU
    one C call copies them all and zeroes the rest (a slice assignment per tensor cost ~5 us each),
    into ``ws``'s reused send buffer where given (:meth:`Workspace.transfer`)."""
    sent = [(t, s) for t, s in zip(tensors, segs) if s.numel]
    if device.type == "cpu":
        buf = (torch.empty(total, dtype=torch.uint8) if ws is None
               else ws.transfer("send", total, torch.uint8, device))
        if _native.copy_many(buf, [t for t, _ in sent], [s.offset for _, s in sent]):
            return buf
    buf = torch.zeros(total, dtype=torch.uint8, device=device)
    for t, s in sent:
        buf[s.offset:s.offset + s.nbytes] = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return buf


def unpack(buf: Tensor, segs: list[Segment]) -> list[Tensor]:
    return [_payload_view(buf, 0, s) for s in segs]


def _mean_sparse(e: Entry, vals: list[Tensor], idx: list[Tensor], world: int, ws: Workspace | None = None) -> Tensor:
    """All ranks' values (``vals[r]`` at ``idx[r]``) added into one zero buffer, divided by the world
    size. Where every payload is float32 at strictly ascending positions (the canonical sparsifiers'),
    one C pass writes the whole output in order (no zero fill, scatter or gather passes); bitwise
    the same as the torch path below."""
    n = e.tensor.numel()
    vals = [v.reshape(-1) for v in vals]
    idx = [i.reshape(-1) for i in idx]
    if ws is not None and e.tensor.dtype == torch.float32 and e.tensor.device.type == "cpu":
        out = dest_or_output(e, ws).view(-1)
        if _native.sparse_mean(out, idx, vals, world):
            return out.view(e.tensor.shape)
        del out
    acc = (torch.zeros(n, dtype=e.tensor.dtype, device=e.tensor.device) if ws is None
           else ws.zeros(torch.Size([n]), n, e.tensor.dtype, e.tensor.device))
    flat_idx = torch.cat(idx).to(torch.int64)
    acc.index_add_(0, flat_idx, torch.cat(vals).to(e.tensor.dtype))
    return divide_touched(acc, flat_idx, world).view(e.tensor.shape)


def _mean_decompressed(e: Entry, payloads: list[list[Tensor]], ws: Workspace | None = None) -> Tensor:
    """Payloads that cannot be summed: decompress each rank's with this rank's ctx, then average.
    The sum goes into a reused buffer (``d0 + d1`` first, then in place): a fresh multi-MB tensor per
    rank costs more in page faults than the decode itself."""
    n = e.tensor.numel()
    if len(payloads) == 1 or ws is None:
        acc = cast(Tensor, sum(e.compressor.decompress(p, e.ctx).reshape(-1) for p in payloads))
        return (acc / len(payloads)).view(e.tensor.shape)
    if e.compressor.fused_mean and e.tensor.dtype == torch.float32:  # decode and average in one pass
        acc = dest_or_output(e, ws).view(-1)
        if e.compressor.mean_into(payloads, e.ctx, acc):
            return acc.view(e.tensor.shape)
        del acc
    first = e.compressor.decompress(payloads[0], e.ctx).reshape(-1)
    acc = ws.output(torch.Size([n]), n, torch.result_type(first, first), e.tensor.device)
    torch.add(first, e.compressor.decompress(payloads[1], e.ctx).reshape(-1), out=acc)
    del first
    for p in payloads[2:]:
        acc.add_(e.compressor.decompress(p, e.ctx).reshape(-1))
    return acc.div_(len(payloads)).view(e.tensor.shape)


def _payload_view(gathered: Tensor, at: int, seg: Segment) -> Tensor:
    got = gathered[at + seg.offset:at + seg.offset + seg.nbytes].view(seg.dtype)
    return got if len(seg.shape) == 1 else got.reshape(seg.shape_for(seg.numel))  # 1-D: the view is it


def _sparse_batch(e: Entry, segs: list[list[Segment]], j: int) -> bool:
    """Whether one C call may average entry ``e`` (first segment ``j``) as sparse values + positions."""
    return (e.compressor.sparse and segs[0][j].dtype == torch.float32 and segs[0][j + 1].dtype == torch.int64
            and e.tensor.dtype == torch.float32 and all(s[j].numel == s[j + 1].numel for s in segs))


def _signs_batch(e: Entry, segs: list[list[Segment]], j: int) -> bool:
    """Whether one C call may average entry ``e`` as EF-SignSGD's scale + packed signs."""
    n = e.tensor.numel()
    return (len(segs) >= 2 and e.compressor.packed_mean() == "signs" and e.tensor.dtype == torch.float32
            and getattr(e.ctx, "dtype", None) == torch.float32 and getattr(e.ctx, "numel", None) == n
            and all(s[j].dtype == torch.float32 and s[j].numel == 1 and s[j + 1].dtype == torch.uint8
                    and s[j + 1].numel * 8 >= n for s in segs))


def _offsets(first: list[int], q: int, segs: list[list[Segment]], starts: list[int]) -> list[int]:
    """Byte offsets in the gathered buffer of segment ``q`` of each entry (first segment ``first[i]``),
    entry-major then rank: the layout the packed C means read."""
    return [starts[r] + segs[r][j + q].offset for j in first for r in range(len(segs))]


def _qsgd_batch(e: Entry, segs: list[list[Segment]], j: int) -> bool:
    """Whether one C call may average entry ``e`` as QSGD's bucket norms + packed codes."""
    c = e.ctx
    if not (len(segs) >= 2 and e.compressor.packed_mean() == "qsgd" and e.tensor.dtype == torch.float32
            and getattr(c, "dtype", None) == torch.float32 and getattr(c, "numel", None) == e.tensor.numel()):
        return False
    nb = -(-c.numel // c.bucket_size)
    return all(s[j].dtype == torch.float32 and s[j].numel == nb and s[j + 1].dtype == torch.uint8
               and s[j + 1].numel * 8 >= c.numel * c.bits for s in segs)


def _sparse_means(gathered: Tensor, outs: list[Tensor], entries: list[Entry], first: list[int],
                  segs: list[list[Segment]], starts: list[int]) -> list[bool]:
    numels = [segs[r][j].numel for j in first for r in range(len(segs))]
    done = _native.sparse_means_packed(gathered, outs, _offsets(first, 1, segs, starts),
                                       _offsets(first, 0, segs, starts), numels, len(segs))
    return done if done is not None else [False] * len(outs)


def _sign_means(gathered: Tensor, outs: list[Tensor], entries: list[Entry], first: list[int],
                segs: list[list[Segment]], starts: list[int]) -> list[bool]:
    done = _native.sign_means_packed(gathered, outs, _offsets(first, 0, segs, starts), _offsets(first, 1, segs, starts))
    return [done] * len(outs)


def _qsgd_means(gathered: Tensor, outs: list[Tensor], entries: list[Entry], first: list[int],
                segs: list[list[Segment]], starts: list[int]) -> list[bool]:
    ctxs = [e.ctx for e in entries]
    done = _native.qsgd_means_packed(gathered, outs, _offsets(first, 0, segs, starts), _offsets(first, 1, segs, starts),
                                     [c.bucket_size for c in ctxs], [c.bits for c in ctxs], [c.s for c in ctxs])
    return [done] * len(outs)


def _chunk_batch(e: Entry, segs: list[list[Segment]], j: int) -> bool:
    """Whether one C call may average entry ``e`` as Chunk-Top-k's codes, scales and int16 positions."""
    c = e.ctx
    if not (len(segs) >= 2 and e.compressor.packed_mean() == "chunk" and e.tensor.dtype == torch.float32
            and getattr(c, "dtype", None) == torch.float32 and getattr(c, "numel", None) == e.tensor.numel()
            and c.kept and c.bits in _native.PACK_BITS):
        return False
    return all(s[j].dtype == torch.uint8 and s[j].numel * 8 >= c.kept * c.bits and s[j + 1].dtype == torch.float32
               and s[j + 1].numel >= c.chunks and s[j + 2].dtype == torch.int16 and s[j + 2].numel == c.kept
               for s in segs)


def _chunk_means(gathered: Tensor, outs: list[Tensor], entries: list[Entry], first: list[int],
                 segs: list[list[Segment]], starts: list[int]) -> list[bool]:
    ctxs = [e.ctx for e in entries]
    done = _native.chunk_means_packed(
        gathered, outs, _offsets(first, 0, segs, starts), _offsets(first, 1, segs, starts),
        _offsets(first, 2, segs, starts), [(c.bits, unit_levels(c.bits), c.full, c.k_row, c.k_tail, c.chunk) for c in ctxs])
    return done if done is not None else [False] * len(outs)


# payload layouts one C call averages for a whole bucket: (segments per entry, which entries it takes, the call)
_PACKED_MEANS: dict[str, tuple[int, Callable[[Entry, list[list[Segment]], int], bool],
                               Callable[[Tensor, list[Tensor], list[Entry], list[int], list[list[Segment]], list[int]],
                                        list[bool]]]] = {
    "sparse": (2, _sparse_batch, _sparse_means), "signs": (2, _signs_batch, _sign_means),
    "qsgd": (2, _qsgd_batch, _qsgd_means), "chunk": (3, _chunk_batch, _chunk_means)}


def aggregate_gathered(entries: list[Entry], counts: list[int], gathered: Tensor, segs: list[list[Segment]],
                       starts: list[int], ws: Workspace | None = None) -> list[Tensor]:
    """Every entry's mean over the ranks, from the payloads where they lie in the gathered bytes:
    rank r's buffer starts at byte ``starts[r]`` in ``segs[r]``'s layout, entry i owning ``counts[i]``
    segments. Entries of a layout in :data:`_PACKED_MEANS` (canonical sparse payloads: float32 values
    and as many int64 positions; EF-SignSGD's scale and signs; QSGD's bucket norms and codes) on the CPU are averaged by one C call
    per layout for the whole bucket, reading the bytes in place (no views per tensor and rank: those
    and the per-entry calls cost ~20-35 us a tensor, more than the C work on ResNet-50's small
    tensors); the rest, and any the C pass refuses, from views of the bytes: sparse ones by
    :func:`_mean_sparse`, the others by :func:`_mean_decompressed`. Bitwise the same either way."""
    world = len(segs)
    out: list[Tensor | None] = [None] * len(entries)
    batches: dict[str, list[tuple[int, int]]] = {}
    j = 0
    for i, (e, c) in enumerate(zip(entries, counts)):
        if ws is not None and e.tensor.device.type == "cpu":
            kind = next((k for k, (n, takes, _) in _PACKED_MEANS.items() if n == c and takes(e, segs, j)), None)
            if kind is not None:
                batches.setdefault(kind, []).append((i, j))
        j += c
    for kind, items in batches.items():
        assert ws is not None
        # in the entries' own shapes (the C calls read data_ptr and numel only): no view per entry;
        # into the raw gradient where the engine allows it (Entry.dest)
        outs = [dest_or_output(entries[i], ws) for i, _ in items]
        done = _PACKED_MEANS[kind][2](gathered, outs, [entries[i] for i, _ in items], [j for _, j in items], segs, starts)
        for (i, _), o, ok in zip(items, outs, done):
            if ok:
                out[i] = o
        del outs
    j = 0
    for i, (e, c) in enumerate(zip(entries, counts)):
        if out[i] is None:
            per_rank = [[_payload_view(gathered, starts[r], segs[r][j + q]) for q in range(c)] for r in range(world)]
            out[i] = (_mean_sparse(e, [p[0] for p in per_rank], [p[1] for p in per_rank], world, ws)
                      if e.compressor.sparse else _mean_decompressed(e, per_rank, ws))
        j += c
    return cast(list[Tensor], out)


def dest_or_output(e: Entry, ws: Workspace) -> Tensor:
    """Where entry ``e``'s float32 mean is written whole: its :attr:`~Entry.dest`, or a recycled
    output of ``ws``. A writer that gives up part-way leaves the dest partly written, which is
    harmless: nothing reads the raw gradient after compensation (the fallback writes elsewhere)."""
    t = e.tensor
    if e.dest is not None and e.dest.numel() == t.numel():
        return e.dest.view(t.shape)
    return ws.output(t.shape, t.numel(), torch.float32, t.device)


def _split_counts(flat: list[Tensor], counts: list[int]) -> list[list[Tensor]]:
    res, off = [], 0
    for c in counts:
        res.append(flat[off:off + c])
        off += c
    return res


def _workspace(comm: Communicator) -> Workspace:
    """The communicator's reused aggregation outputs (created lazily: registry-built instances and
    unpickled ones alike)."""
    ws = comm.__dict__.get("workspace")
    if ws is None:
        ws = comm.workspace = Workspace()  # type: ignore[attr-defined]
    return ws


def why_not(communicator: str, compressor: Compressor) -> str | None:
    """Why ``communicator`` (``allgather`` / ``allgather_fast``) cannot carry ``compressor``."""
    if compressor.rounds != 1:
        return f"it needs {compressor.rounds} communication rounds of summed payloads"
    if communicator == "allgather_fast" and not compressor.fixed_size:
        return ("its payload size depends on the gradient values, so ranks cannot know each "
                "other's sizes without an exchange")
    return None


def fits(compressor: Compressor) -> list[str]:
    """Communicators for ``compressor`` from the capability flags (``additive`` -> allreduce).
    Computed here rather than with ``communicators.fitting`` because that calls every ``check``,
    and a check that calls ``fitting`` again never terminates."""
    out = ["allreduce"] if compressor.additive else []
    return out + [n for n in ("allgather", "allgather_fast") if why_not(n, compressor) is None]


def _check(communicator: str, compressor: Compressor) -> None:
    reason = why_not(communicator, compressor)
    if reason is not None:
        raise Communicator.incompatible(communicator, compressor, reason,
                                        [n for n in fits(compressor) if n != communicator])


def exchange_counts(tensors: list[Tensor], backend: Backend) -> Handle:
    """Launch the small allgather of ``tensors``' element counts (ranks may send different sizes)."""
    mine = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    return backend.allgather_async(mine, sizes=[len(tensors)] * backend.size())


def launch_gather(tensors: list[Tensor], buf: Tensor, numels: Handle, backend: Backend,
                  ws: Workspace | None = None) -> tuple[Handle, list[list[Segment]], list[int]]:
    """Wait for the count exchange ``numels`` and launch the allgather of ``buf`` (``tensors``
    packed by :func:`pack` in this rank's layout). Returns the handle, every rank's segments and
    every rank's byte total (for :func:`aggregate_gathered`)."""
    return gather_known(tensors, buf, numels.wait().view(backend.size(), -1).tolist(), backend, ws)


def gather_known(tensors: list[Tensor], buf: Tensor, counts: list[list[int]], backend: Backend,
                 ws: Workspace | None = None) -> tuple[Handle, list[list[Segment]], list[int]]:
    """Launch the allgather of ``buf`` (``tensors`` packed in this rank's layout) when every
    rank's element counts are known (``counts[r]``: rank r's, per tensor), into ``ws``'s reused
    receive buffer where given."""
    segs, totals = [], []
    for r in range(backend.size()):
        s, tot = layout(tensors, counts[r])
        segs.append(s)
        totals.append(tot)
    if max(totals) == 0:
        return Handle.completed(buf), segs, totals
    out = None if ws is None else ws.transfer("recv", sum(totals), buf.dtype, buf.device)
    return backend.allgather_async(buf, sizes=totals, out=out), segs, totals


def gather_payloads(tensors: list[Tensor], backend: Backend,
                    device: torch.device) -> tuple[Handle, list[list[Segment]], list[int]]:
    """Launch the allgather of ``tensors`` packed into one byte buffer, after a small blocking
    exchange of their element counts (see :func:`launch_gather`)."""
    segs, total = layout(tensors)
    return launch_gather(tensors, pack(tensors, segs, total, device), exchange_counts(tensors, backend), backend)


@dataclass
class _Pending:
    entries: list[Entry]
    counts: list[int]
    handle: Handle | None  # None: the data gather waits for its count exchange (``allgather``)
    segs: list[list[Segment]]  # per rank
    totals: list[int]  # bytes per rank
    tensors: list[Tensor] = field(default_factory=list)
    packed: Tensor | None = None
    numels: Handle | None = None


@register("allgather")
class AllgatherCommunicator(Communicator):
    """Gather every rank's payloads (sizes may differ per rank), aggregate locally, average.

    Fits every single-round compressor; the one for variable-size sparsifiers (dgc, gaussiank,
    redsync, sidco, mstopk, adtopk_t). Cost per bucket: one small allgather of element counts,
    then one allgather of the packed payload bytes.

    The data gather needs every rank's counts, so it cannot start with the count exchange. Waiting
    for the counts inside ``start`` made each bucket wait, inside backward, for the slowest rank to
    reach the same bucket (issue 32; GPT-2-small's step time at batch 1 did not move measurably,
    within the +-10 % between launches). Instead ``start``
    launches its count exchange and queues the bucket; the next ``start`` of the same round (or the
    first ``finish``) launches the queued buckets' data gathers in queue order, by which time their
    counts have had a bucket's time to arrive. The queue lives in the round's :class:`CommEnv`, and
    which collective comes next depends only on the start / finish schedule, which every rank
    shares (the ordering rule).
    """

    offloadable = True

    def check(self, compressor: Compressor) -> None:
        _check("allgather", compressor)

    def _queue(self, env: CommEnv) -> list[_Pending]:
        return env.extra.setdefault(f"allgather.queued.{id(self)}", [])

    def _launch_queued(self, env: CommEnv) -> None:
        queue = self._queue(env)
        for q in queue:
            assert q.packed is not None and q.numels is not None  # set by start()
            q.handle, q.segs, q.totals = launch_gather(q.tensors, q.packed, q.numels, env.backend, _workspace(self))
            q.packed = q.numels = None
            q.tensors = []
        queue.clear()

    def start(self, entries: list[Entry], env: CommEnv) -> Any:
        self.compress_entries(entries, env)
        tensors = [p for e in entries for p in e.payload]  # type: ignore[union-attr]
        counts = [len(e.payload) for e in entries]  # type: ignore[arg-type]
        with env.stats.timing("comm"):
            self._launch_queued(env)  # earlier buckets first: their count exchanges are older
            segs, total = layout(tensors)
            # copied now: payload buffers may be reused later
            packed = pack(tensors, segs, total, entries[0].tensor.device, _workspace(self))
            pending = _Pending(entries, counts, None, [], [], tensors, packed, exchange_counts(tensors, env.backend))
        self._queue(env).append(pending)
        return pending

    def finish(self, pending: Any, env: CommEnv) -> list[Tensor]:
        p: _Pending = pending
        with env.stats.timing("comm"):
            if p.handle is None:
                self._launch_queued(env)
            assert p.handle is not None
            gathered = p.handle.wait()
        with env.stats.timing("compress"):
            starts = [sum(p.totals[:r]) for r in range(len(p.totals))]
            return aggregate_gathered(p.entries, p.counts, gathered, p.segs, starts, _workspace(self))


@register("allgather_fast")
class AllgatherFastCommunicator(Communicator):
    """AllgatherFast (ADTopk §5): fixed-size payloads, one allgather of known size per bucket.

    No size exchange and no per-rank split: the gathered bytes are viewed as a (world, bytes)
    matrix and each payload tensor of all ranks is one column range of it. Refuses compressors
    whose payload size depends on the data (threshold sparsifiers): use ``allgather`` for those.
    """

    offloadable = True

    def check(self, compressor: Compressor) -> None:
        _check("allgather_fast", compressor)

    def start(self, entries: list[Entry], env: CommEnv) -> Any:
        self.compress_entries(entries, env)
        tensors = [p for e in entries for p in e.payload]  # type: ignore[union-attr]
        counts = [len(e.payload) for e in entries]  # type: ignore[arg-type]
        world = env.backend.size()
        with env.stats.timing("comm"):
            segs, total = layout(tensors)
            ws = _workspace(self)
            buf = pack(tensors, segs, total, entries[0].tensor.device, ws)
            handle = (env.backend.allgather_async(buf, sizes=[total] * world,
                                                  out=ws.transfer("recv", world * total, buf.dtype, buf.device))
                      if total else Handle.completed(buf))
        return _Pending(entries, counts, handle, [segs], [total] * world)

    def finish(self, pending: Any, env: CommEnv) -> list[Tensor]:
        p: _Pending = pending
        world, total, segs = len(p.totals), p.totals[0], p.segs[0]
        assert p.handle is not None  # launched in start (fixed sizes need no count exchange)
        with env.stats.timing("comm"):
            gathered = p.handle.wait()
        with env.stats.timing("compress"):  # every rank's buffer has this rank's layout
            return aggregate_gathered(p.entries, p.counts, gathered, [segs] * world,
                                      [r * total for r in range(world)], _workspace(self))
