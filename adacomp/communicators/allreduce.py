"""Allreduce communicator: one fused allreduce (mean) per bucket and per round.

Carries additive payloads only (dense, fp16, randomk with a shared seed, PowerSGD / ACP-SGD
factors). Multi-round compressors get each round's mean payload through ``next_round``; rounds are
run in ``finish`` in bucket order so every rank issues the same sequence of collectives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from adacomp.backends.base import Handle
from adacomp.communicators.base import CommEnv, Communicator, Entry, register
from adacomp.communicators.fuse import buffer, flatten, unflatten
from adacomp.compressors.base import CastCompressor, Compressor
from adacomp.memories.base import NoneMemory


@dataclass
class _Pending:
    entries: list[Entry]
    handle: Handle
    layout: list
    counts: list[int]
    round_index: int = 0


@register("allreduce")
class AllreduceCommunicator(Communicator):
    """Sum-then-average of additive payloads with a single fused buffer per round."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, Tensor] = {}

    def check(self, compressor: Compressor) -> None:
        if not compressor.additive:
            raise self.incompatible("allreduce", compressor,
                                    "its payloads cannot be summed element-wise across ranks")

    def _launch(self, entries: list[Entry], env: CommEnv, round_index: int) -> _Pending:
        tensors = [p for e in entries for p in e.payload]  # type: ignore[union-attr]
        counts = [len(e.payload) for e in entries]  # type: ignore[arg-type]
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise TypeError(f"allreduce payloads of one bucket must share a dtype, got {sorted(map(str, dtypes))}")
        with env.stats.timing("comm"):
            buf, layout = flatten(tensors, self._buffers, (env.bucket_index, round_index))
            world = env.backend.size()
            if env.predivide and world > 1 and buf.is_floating_point():
                buf.mul_(1.0 / world)  # DDP's scaling: a double scalar, each rank's float rounded once
                handle = env.backend.allreduce_async(buf, average=False)
            else:
                handle = env.backend.allreduce_async(buf, average=True)
        return _Pending(entries, handle, layout, counts, round_index)

    def start(self, entries: list[Entry], env: CommEnv) -> Any:
        with env.stats.timing("compress"):
            self._compress_into_buffer(entries, env)
        self.compress_entries(entries, env)
        return self._launch(entries, env, 0)

    def _compress_into_buffer(self, entries: list[Entry], env: CommEnv) -> None:
        """A cast (bf16) writes every entry's payload straight into the bucket's buffer, where
        :func:`flatten` then finds them: no concatenation, a read and a write of the payload bytes
        less (cost_notes item 45). Only where no memory reads the payload afterwards (the allreduce
        averages the buffer in place) and nothing is compressed yet (an offloaded bucket is);
        otherwise, or where the cast declines, every entry is compressed as usual."""
        if not entries or not all(e.payload is None and isinstance(e.compressor, CastCompressor)
                                  and type(e.memory) is NoneMemory for e in entries):  # (a subclass may read it)
            return
        ref = entries[0].tensor
        wire = {e.compressor.wire_dtype for e in entries if isinstance(e.compressor, CastCompressor)}
        if len(wire) != 1 or any(e.tensor.device != ref.device for e in entries):
            return
        buf = buffer(self._buffers, (env.bucket_index, 0), sum(e.tensor.numel() for e in entries), wire.pop(),
                     ref.device)
        done, off = [], 0
        for e in entries:
            n = e.tensor.numel()
            got = e.compressor.compress_into(e.tensor, buf[off:off + n])  # type: ignore[attr-defined]
            if got is None:
                return
            done.append(got)
            off += n
        for e, (payload, ctx) in zip(entries, done):
            e.payload, e.ctx = payload, ctx

    def finish(self, pending: Any, env: CommEnv) -> list[Tensor]:
        p: _Pending = pending
        while True:
            with env.stats.timing("comm"):
                buf = p.handle.wait()
            parts = unflatten(buf, p.layout)
            means, off = [], 0
            for c in p.counts:
                means.append(parts[off:off + c])
                off += c
            nxt = p.round_index + 1
            if all(nxt >= e.compressor.rounds for e in p.entries):
                break
            with env.stats.timing("compress"):
                for e, mean in zip(p.entries, means):
                    e.payload, e.ctx = e.compressor.next_round(nxt, mean, e.ctx)
            for e in p.entries:
                assert e.payload is not None  # set by next_round above
                env.stats.bytes_sent += sum(t.numel() * t.element_size() for t in e.payload)
            p = self._launch(p.entries, env, nxt)
        out = []
        with env.stats.timing("compress"):
            for e, mean in zip(p.entries, means):
                if e.compressor.rounds > 1:  # the residual is measured against what every rank applies
                    e.report(e.compressor, mean, e.ctx)
                out.append(e.compressor.decompress(mean, e.ctx).view(e.tensor.shape))
        return out
