"""ByteComp's divisible scheme: alltoall, then allgather (bytecomp.txt §4.2 Dimension 3, Fig. 4,
Table 2 "Alltoall/Allgather").

Every rank owns one of ``N`` contiguous parts of each tensor (rank ``j`` owns part ``j``):

1. each rank compresses every part of its (error-compensated) gradient and sends part ``j`` to
   rank ``j`` (one alltoall per bucket, after a small blocking exchange of element counts);
2. rank ``j`` decompresses the ``N`` copies of its part it received, averages them and compresses
   the average again (the "second compression" of Fig. 4);
3. one allgather per bucket moves every rank's compressed average; each rank decompresses the
   ``N`` parts into the full mean gradient.

Compared with the indivisible scheme (``allgather``: every rank receives ``N`` whole payloads)
a rank receives about ``2 x`` one payload instead of ``N``, for two more compression passes on a
``1/N`` part (§3.1 Reason #2 discusses this trade; :mod:`adacomp.policies.timeline` models it).

Choices the paper leaves open, stated here:

* **Partition, then compress.** Fig. 4 compresses a tensor and then partitions it; a quantizer's
  payload (qsgd, efsignsgd) cannot be cut into independently decodable parts, so each part is
  compressed on its own (for sparsifiers this keeps ``k`` per part instead of per tensor).
* **Error feedback on both compressions.** The first compression feeds the configured memory
  (residual / dgc) exactly like ``allgather``. With ``feedback: true`` (default) rank ``j`` also
  keeps the error of its second compression of part ``j`` and adds it to the next step's average,
  as DoubleSqueeze (Tang et al., 2019) does on its server side; ``false`` drops that error. That
  error lives in a declared memory (:class:`~adacomp.memories.parts.PartResidualMemory`): the
  engine updates it with the route memories after ``finish``, rolls it back and rescales it with
  them, and checkpoints reshard it by its own rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from adacomp.communicators.allgather import (Segment, _payload_view, _sparse_batch, _sparse_means, _split_counts,
                                             _workspace, dest_or_output, gather_known, gather_payloads, layout, pack,
                                             unpack)
from adacomp.communicators.base import Charge, CommEnv, Communicator, Entry, register
from adacomp.compressors import _native
from adacomp.compressors.base import Compressor
from adacomp.compressors.sparse import divide_touched
from adacomp.compressors.topk import PREFILTER_MIN_NUMEL
from adacomp.memories.base import Memory, OwedSpans
from adacomp.memories.parts import PartResidualMemory, bounds
from adacomp.tensors import flat_of, flat_view


@dataclass
class _Part:
    payload: list[Tensor]
    ctx: Any


def _compress(comp: Compressor, t: Tensor, name: str) -> _Part:
    if t.numel() == 0:  # more ranks than elements: an empty part travels as nothing
        return _Part([], None)
    payload, ctx = comp.compress(t, name)
    return _Part(list(payload), ctx)


def _decompress_into(out: Tensor, comp: Compressor, payload: list[Tensor], ctx: Any) -> None:
    if out.numel() == 0:
        return
    if comp.sparse:  # scatter straight into the slice: no dense temporary per part
        if not _native.sparse_mean(out, [payload[1].reshape(-1)], [payload[0].reshape(-1)], 1):  # one C pass
            out.zero_().index_add_(0, payload[1].reshape(-1).to(torch.int64), payload[0].reshape(-1).to(out.dtype))
    else:
        out.copy_(comp.decompress(payload, ctx).reshape(-1))


def _sparse_parts_into(gathered: Tensor, outs: list[Tensor], entries: list[Entry], segs: list[list[Segment]],
                       totals: list[int]) -> list[list[bool]]:
    """Every rank's recompressed part of every entry (canonical sparse payloads: float32 values and
    as many ascending int64 positions) written into its span of the entry's output by one C call
    reading the gathered bytes in place; per rank and entry, whether it was (the rest: views and
    :func:`_decompress_into`, bitwise the same). Why one call: per part the views, checks and call
    cost ~20 us, more than the C work on ResNet-50's small tensors."""
    world = len(segs)
    written = [[False] * len(entries) for _ in range(world)]
    parts: list[Tensor] = []
    where: list[tuple[int, int]] = []
    idx_off: list[int] = []
    val_off: list[int] = []
    numels: list[int] = []
    start = 0
    for r in range(world):
        j = 0
        for i, e in enumerate(entries):
            c = len(e.ctx.parts[r].payload)
            lo, hi = e.ctx.spans[r]
            if c == 2 and hi > lo and e.tensor.dtype == torch.float32 and outs[i].device.type == "cpu":
                vs, ix = segs[r][j], segs[r][j + 1]
                if e.compressor.sparse and vs.dtype == torch.float32 and ix.dtype == torch.int64 \
                        and vs.numel == ix.numel:
                    parts.append(outs[i][lo:hi])
                    where.append((r, i))
                    idx_off.append(start + ix.offset)
                    val_off.append(start + vs.offset)
                    numels.append(vs.numel)
            j += c
        start += totals[r]
    if parts:
        done = _native.sparse_means_packed(gathered, parts, idx_off, val_off, numels, 1)
        for (r, i), ok in zip(where, done or []):
            written[r][i] = ok
    return written


class _Joined:
    """The parts of one tensor seen as one compression: what the route memory's update and the
    step's statistics expect (``decompress`` gives the whole tensor; sparse payloads use global indices)."""

    def __init__(self, comp: Compressor, parts: list[_Part], spans: list[tuple[int, int]], like: Tensor):
        self.comp, self.parts, self.spans, self.like = comp, parts, spans, like
        self.name, self.sparse = comp.name, comp.sparse
        # each part's residual may overwrite its own span, as the compressor's may (residual memory
        # then keeps the compensated buffer instead of allocating a new one each step)
        self.residual_in_place = bool(getattr(comp, "residual_in_place", False))
        self._joined: list[Tensor] | None = None

    def payload(self) -> list[Tensor]:
        """The parts' payloads as one (sparse: values, then global int64 indices); built once."""
        if self._joined is None:
            if not self.sparse:
                self._joined = self.pieces()
            else:
                live = [(p, lo) for p, (lo, hi) in zip(self.parts, self.spans) if hi > lo]
                vals = torch.cat([p.payload[0].reshape(-1) for p, _ in live])
                idx = torch.cat([p.payload[1].reshape(-1).to(torch.int64) + lo for p, lo in live])
                self._joined = [vals, idx]
        return self._joined

    def pieces(self) -> list[Tensor]:
        """Every part's payload tensors, as they travel (no copy)."""
        return [t for p in self.parts for t in p.payload]

    def nbytes(self) -> int:
        """The bytes of :meth:`payload`, without building it."""
        if not self.sparse:
            return sum(t.numel() * t.element_size() for t in self.pieces())
        live = [p for p, (lo, hi) in zip(self.parts, self.spans) if hi > lo]
        return sum(p.payload[0].numel() * p.payload[0].element_size() + p.payload[1].numel() * 8 for p in live)

    def decompress(self, payload: Any = None, ctx: Any = None) -> Tensor:
        out = torch.empty(self.like.numel(), dtype=self.like.dtype, device=self.like.device)
        for p, (lo, hi) in zip(self.parts, self.spans):
            _decompress_into(out[lo:hi], self.comp, p.payload, p.ctx)
        return out.view(self.like.shape)

    def residual(self, tensor: Tensor, payload: Any, ctx: Any, out: Tensor) -> Tensor:
        """What error feedback keeps: each part's own residual, written into its span of ``out``."""
        flat, dst = flat_of(tensor), flat_view(out)
        for p, (lo, hi) in zip(self.parts, self.spans):
            if hi > lo:
                self.comp.residual(flat[lo:hi], p.payload, p.ctx, dst[lo:hi])
        return out

    def defer_residual(self, tensor: Tensor, payload: Any, ctx: Any) -> OwedSpans | None:
        """Every part's residual left to the next compensation (the compressor's ``defer_residual``
        of each part: a sparsifier's zeroing of the sent positions, EF-SignSGD's decoded signs,
        Chunk-Top-k's kept values), which compensates part by part under the same keys (``pieces``);
        None unless every non-empty part's is. Why: Top-k's parts wrote their zeroings right after the
        compensation streamed them out, a write miss a position (GPT-2-small's and VGG-16's cells
        1-19 % faster without, cost_notes item 88)."""
        defer = getattr(self.comp, "defer_residual", None)
        if defer is None:
            return None
        flat = flat_of(tensor)
        tokens = []
        for p, (lo, hi) in zip(self.parts, self.spans):
            token = defer(flat[lo:hi], p.payload, p.ctx) if hi > lo else None
            if token is None and hi > lo:
                return None
            tokens.append(token)
        return OwedSpans(self.comp, tuple(self.spans), tuple(tokens))


@dataclass
class _Pending:
    entries: list[Entry]
    handle: Any
    recv_segs: list[list]       # per source rank: segments of the payload of my part
    recv_totals: list[int]
    fixed: bool = False  # every payload's size follows from its part's shape: no count exchanges


def _numels(tensors: list[Tensor]) -> list[int]:
    return [t.numel() for t in tensors]


@register("alltoall")
class AlltoallCommunicator(Communicator):
    """Divisible scheme (ByteComp Fig. 4): alltoall of compressed parts, average and recompress
    one part per rank, allgather of the recompressed parts. ``feedback``: keep the error of the
    second compression (see module docstring)."""

    offloadable = True

    def __init__(self, feedback: bool = True):
        self.feedback = bool(feedback)
        self.second = PartResidualMemory()

    def check(self, compressor: Compressor) -> None:
        if compressor.rounds != 1:
            raise self.incompatible("alltoall", compressor,
                                    f"it needs {compressor.rounds} communication rounds of summed payloads")

    def sent_bytes(self, e: Entry) -> int:
        return int(e.ctx.nbytes())  # the joined payload's, which e.payload may not hold (compress_one)

    def sent_values(self, e: Entry) -> Tensor:
        return e.ctx.payload()[0]

    def pieces(self, name: str, numel: int, world: int) -> list[tuple[str, int, int]]:
        """Part ``j`` of every tensor is compressed on its own under ``name/part{j}``."""
        return [(f"{name}/part{j}", lo, hi) for j, (lo, hi) in enumerate(bounds(numel, world))]

    # --- stage 1: compress every part (may run on the offload worker: no collective here) -----
    def compress_one(self, e: Entry) -> None:
        flat = flat_of(e.tensor)
        pieces = self.pieces(e.name, flat.numel(), self._world)
        parts = [_compress(e.compressor, flat[lo:hi], key) for key, lo, hi in pieces]
        spans = [(lo, hi) for _, lo, hi in pieces]
        joined = _Joined(e.compressor, parts, spans, e.tensor)
        # the joined payload (two model-wide concatenations) only for a memory that reads it:
        # VGG-16's 1.4M selected pairs cost ~11 ms a step to join (cost_notes item 65)
        e.payload, e.ctx = (joined.pieces() if e.memory.payload_blind else joined.payload()), joined
        e.report(joined, e.payload, None)

    def precompress(self, entries: list[Entry], world: int) -> None:
        self._world = world
        for e in entries:
            if e.payload is None:
                self.compress_one(e)

    def start(self, entries: list[Entry], env: CommEnv) -> Any:
        backend = env.backend
        world, me = backend.size(), backend.rank()
        with env.stats.timing("compress"):
            self.precompress(entries, world)
        self.record(entries, env)
        per_dest = [[t for e in entries for t in e.ctx.parts[j].payload] for j in range(world)]
        with env.stats.timing("comm"):
            fixed = all(e.compressor.fixed_size for e in entries)
            if fixed:  # rank r's part `me` has my part `me`'s shape, so its payload has my payload's sizes
                got_rows = [_numels(per_dest[me])] * world
            else:  # element counts of every payload tensor, rank j learns what each rank sends it
                counts = torch.tensor([n for ts in per_dest for n in _numels(ts)], dtype=torch.int64)
                got = backend.alltoall(counts, [len(ts) for ts in per_dest], [len(per_dest[me])] * world)
                got_rows = got.view(world, -1).tolist() if per_dest[me] else [[] for _ in range(world)]
            send_segs = [layout(ts) for ts in per_dest]
            buf = torch.cat([pack(ts, s, tot, entries[0].tensor.device) for ts, (s, tot) in zip(per_dest, send_segs)])
            recv = [layout(per_dest[me], got_rows[r]) for r in range(world)]
            handle = backend.alltoall_async(buf, [tot for _, tot in send_segs], [tot for _, tot in recv])
        return _Pending(entries, handle, [s for s, _ in recv], [tot for _, tot in recv], fixed)

    # --- stage 2 and 3: average my part, recompress, allgather --------------------------------
    def finish(self, pending: Any, env: CommEnv) -> list[Tensor]:
        p: _Pending = pending
        backend = env.backend
        world, me = backend.size(), backend.rank()
        with env.stats.timing("comm"):
            received = p.handle.wait()
        mine_counts = [len(e.ctx.parts[me].payload) for e in p.entries]
        with env.stats.timing("compress"):
            starts = [sum(p.recv_totals[:r]) for r in range(world)]
            firsts = [sum(mine_counts[:i]) for i in range(len(p.entries))]
            fused = {i for i, e in enumerate(p.entries) if self._fuses(e, me)}
            means = self._packed_means(received, p, mine_counts, starts, me, skip=fused)

            def copies(i: int) -> list[list[Tensor]]:  # views of every rank's payload of my part of entry i
                return [[_payload_view(received, starts[r], p.recv_segs[r][firsts[i] + q])
                         for q in range(mine_counts[i])] for r in range(world)]

            second = [self._second(e, copies(i) if means[i] is None else [], me, world, mean=means[i])
                      for i, e in enumerate(p.entries)]
        tensors = [t for part in second for t in part.payload]
        with env.stats.timing("comm"):
            if p.fixed:  # rank r recompressed its part r: my first-stage part r's sizes
                numels = [[n for e in p.entries for n in _numels(e.ctx.parts[r].payload)] for r in range(world)]
                mine, total = layout(tensors)
                handle, segs, totals = gather_known(tensors, pack(tensors, mine, total, p.entries[0].tensor.device),
                                                    numels, backend)
            else:
                handle, segs, totals = gather_payloads(tensors, backend, p.entries[0].tensor.device)
            gathered = handle.wait()
        env.stats.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        with env.stats.timing("compress"):
            ws = _workspace(self)  # recycled outputs: fresh multi-MB tensors cost page faults every step
            outs = [dest_or_output(e, ws).view(-1) if e.tensor.dtype == torch.float32 else
                    ws.output(torch.Size([e.tensor.numel()]), e.tensor.numel(), e.tensor.dtype, e.tensor.device)
                    for e in p.entries]
            written = _sparse_parts_into(gathered, outs, p.entries, segs, totals)
            off = 0
            for r, (rsegs, tot) in enumerate(zip(segs, totals)):
                if all(written[r]):
                    off += tot
                    continue
                counts = [len(e.ctx.parts[r].payload) for e in p.entries]
                for i, payload in enumerate(_split_counts(unpack(gathered[off:off + tot], rsegs), counts)):
                    if not written[r][i]:
                        e = p.entries[i]
                        lo, hi = e.ctx.spans[r]
                        _decompress_into(outs[i][lo:hi], e.compressor, payload, e.ctx.parts[r].ctx)
                off += tot
        return [o.view(e.tensor.shape) for o, e in zip(outs, p.entries)]

    def _fuses(self, e: Entry, me: int) -> bool:
        """Whether :meth:`_second` may add the received copies of entry ``e``'s part to the kept
        error without writing their mean first (:meth:`~adacomp.compressors.topk.TopkCompressor.compensate_mean_into`):
        feedback on, a compressor that can, a part large enough for its prefilter, a kept error."""
        lo, hi = e.ctx.spans[me]
        return (self.feedback and e.compressor.sparse and hasattr(e.compressor, "compensate_mean_into")
                and e.tensor.dtype == torch.float32 and e.tensor.device.type == "cpu"
                and hi - lo >= PREFILTER_MIN_NUMEL and self.second.holds(e.name))

    def _packed_means(self, received: Tensor, p: _Pending, counts: list[int], starts: list[int], me: int,
                      skip: set[int]) -> list[Tensor | None]:
        """The mean of every entry's received copies of my part (but those in ``skip``), for the
        canonical sparse payloads averaged by one C call for the whole bucket where the bytes lie
        (rank r's from byte ``starts[r]``; :func:`_sparse_means`); None for the entries left to
        :meth:`_second` (bitwise the same)."""
        out: list[Tensor | None] = [None] * len(p.entries)
        ws = _workspace(self)
        items, j = [], 0
        for i, (e, c) in enumerate(zip(p.entries, counts)):
            lo, hi = e.ctx.spans[me]
            if i not in skip and c == 2 and hi > lo and e.tensor.device.type == "cpu" and _sparse_batch(e, p.recv_segs, j):
                items.append((i, j, hi - lo))
            j += c
        if not items:
            return out
        accs = [ws.output(torch.Size([n]), n, torch.float32, received.device) for _, _, n in items]
        done = _sparse_means(received, accs, [p.entries[i] for i, _, _ in items], [j for _, j, _ in items],
                             p.recv_segs, starts)
        for (i, _, _), acc, ok in zip(items, accs, done):
            if ok:
                out[i] = acc
        return out

    def _second(self, e: Entry, copies: list[list[Tensor]], me: int, world: int, mean: Tensor | None = None) -> _Part:
        """Average the ``world`` received copies of my part (or take their ``mean``, already
        averaged), add the kept error, recompress."""
        lo, hi = e.ctx.spans[me]
        if hi == lo:
            return _Part([], None)
        ctx = e.ctx.parts[me].ctx
        # a recycled buffer (Workspace's rule: reused only once nothing holds it): a fresh part-size
        # tensor per step costs page faults on every multi-MB part
        key = f"{e.name}/agg{me}"
        if mean is None and copies and self._fuses(e, me):  # the mean added to the kept error unwritten
            at = [flat_of(c[1]) for c in copies]
            values = [flat_of(c[0]) for c in copies]
            comp = e.compressor
            into: Any = getattr(comp, "compensate_mean_into")
            summed = self.second.compensate_with(e.name, hi - lo, comp,
                                                 lambda r, out: bool(into(at, values, world, r, out, key)))
            if summed is not None:
                part = _compress(comp, summed, key)
                e.also_charge(Charge(self.second, summed, e.name, comp, part.payload, part.ctx))
                return part
        ws = _workspace(self)
        if mean is not None:
            acc, copies_left = mean, []
        elif e.compressor.sparse:  # every rank's copy in one C pass (ascending indices), else torch below
            acc = ws.output(torch.Size([hi - lo]), hi - lo, e.tensor.dtype, e.tensor.device)
            if not _native.sparse_mean(acc, [c[1].reshape(-1) for c in copies], [c[0].reshape(-1) for c in copies],
                                       world):
                acc.zero_()
                copies_left = copies
            else:
                copies_left = []
        else:
            acc = ws.zeros(torch.Size([hi - lo]), hi - lo, e.tensor.dtype, e.tensor.device)
            copies_left = copies
        tmp = None if e.compressor.sparse else torch.empty_like(acc)
        touched: list[Tensor] = []
        for payload in copies_left:
            if tmp is None:  # sparse: add every rank's values at their indices, no dense temporary
                idx = payload[1].reshape(-1).to(torch.int64)
                acc.index_add_(0, idx, payload[0].reshape(-1).to(acc.dtype))
                touched.append(idx)
            else:
                _decompress_into(tmp, e.compressor, payload, ctx)
                acc.add_(tmp)
        if e.compressor.sparse and touched:
            divide_touched(acc, torch.cat(touched), world)
        elif copies_left:
            acc.div_(world)
        if self.feedback:  # kept under the tensor's name; compressed whole under `key`
            acc = self.second.compensate(acc, e.name, world, compressor=e.compressor, pieces=[(key, 0, acc.numel())])
        part = _compress(e.compressor, acc, key)
        if self.feedback:  # the engine stores acc minus what the recompressed part reconstructs
            e.also_charge(Charge(self.second, acc, e.name, e.compressor, part.payload, part.ctx))
        return part

    def memories(self) -> list[Memory]:
        return [self.second]

    def reshard(self, states: list[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
        return self.second.reshard(states, world, rank)

    def owed(self, states: list[dict[str, Any]]) -> dict[str, Tensor]:
        return self.second.owed(states)

    def state_dict(self) -> dict[str, Any]:
        return self.second.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - {"residuals"})
        if unknown:
            raise ValueError(f"communicator 'alltoall' got unknown state keys {unknown}")
        self.second.load_state_dict(state)
