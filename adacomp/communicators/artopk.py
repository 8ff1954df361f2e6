"""AR-Topk (Tyagi & Swany, §3-A/B, Alg. 1): Top-k that an allreduce can carry.

One rank's Top-k *indices* are broadcast; every rank takes its own error-compensated values at
those indices, keeps the rest as residual, and the values are averaged with one allreduce. The sum
is meaningful because every rank contributes values at the same coordinates.

Per step and per bucket (all entries of the bucket are fused into one broadcast and one allreduce):

1. pick the broadcasting rank: ``star`` = ``step mod N`` (Alg. 1 line 8); ``var`` = argmax over
   ranks of ``||g_(i,r)||^2``, the squared norm of each rank's own Top-k values, exchanged with one
   allgather of N floats (lines 10-13; ties go to the lowest rank);
2. that rank runs the compressor's Top-k and broadcasts the indices (line 14); the other ranks know
   the count from ``k = max(1, round(density * numel))``;
3. each rank gathers ``G[idx]`` (line 15) and reports ``[G[idx], idx]`` as its contribution, from
   which the engine's memory update stores ``G - scatter(G[idx])`` (line 16, the residual identity);
4. one allreduce (mean) of the values (line 17); ``finish`` scatters the mean into zeros.

``start`` *blocks* on the broadcast (values cannot be gathered before the indices arrive), so with
wait-free back-propagation the broadcast of bucket b is not overlapped with the backward pass of
the buckets after it; only the allreduce runs in the background. Indices travel as int32 (int64
only for tensors over 2^31 elements), so index bytes equal fp32 value bytes as in eq. 4a/4b.

The paper applies Top-k to the fused whole-model gradient: set ``fusion.fuse_before_compress:
true`` (one Top-k per bucket) and a large ``fusion.bucket_mb`` (one bucket = the whole model).

``algorithm`` (``auto`` / ``ring`` / ``tree``) is the allreduce algorithm AR-Topk asks the backend
for (ART-Ring / ART-Tree, §3-D). Backends that cannot switch (gloo, MPI, Horovod; NCCL only at
communicator creation) keep their own algorithm and a warning says so once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from adacomp.backends.base import Backend, Handle
from adacomp.communicators.base import CommEnv, Communicator, Entry, register
from adacomp.compressors.base import Compressor
from adacomp.compressors.sparse import SparseCtx, k_for

log = logging.getLogger(__name__)

SELECTIONS = ("star", "var")
ALGORITHMS = ("auto", "ring", "tree")
CARRIES = ("topk", "gtopk")


@dataclass
class _Pending:
    entries: list[Entry]
    handle: Handle
    counts: list[int]
    indices: list[Tensor]
    root: int


def select_root(selection: str, step: int, world: int, norm_sq: float | None, backend: Backend) -> int:
    """Alg. 1 lines 7-13: the rank whose indices are broadcast this step (same on every rank)."""
    if selection == "star" or world == 1:
        return step % world
    local = torch.tensor([[float(norm_sq or 0.0)]], dtype=torch.float64)
    every = backend.allgather(local, sizes=[1] * world).view(-1)
    return int(torch.argmax(every))  # first maximum: ties go to the lowest rank


def _others_that_fit(compressor: Compressor) -> list[str]:
    """``fitting()`` minus artopk, without re-entering this check (fitting calls every check)."""
    from adacomp.communicators.base import registry
    from adacomp.errors import IncompatibleComponentsError
    fits = []
    for n in registry.names():
        if n == "artopk":
            continue
        try:
            registry.cls(n)().check(compressor)
        except IncompatibleComponentsError:
            continue
        except TypeError:  # needs constructor arguments: assume it fits
            pass
        fits.append(n)
    return fits


@register("artopk")
class ARTopkCommunicator(Communicator):
    """Broadcast one rank's Top-k indices, allreduce every rank's values there (STAR / VAR-Topk).

    ``selection``: ``star`` (round robin, the paper's better choice on small clusters) or ``var``
    (largest Top-k norm; one extra allgather of N floats). ``algorithm``: allreduce algorithm to
    request (``auto`` leaves the backend's choice). Carries ``topk`` / ``gtopk`` with error feedback
    (``residual`` memory): what the selected indices miss stays in the residual.
    """

    def __init__(self, selection: str = "star", algorithm: str = "auto"):
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {list(SELECTIONS)}, got {selection!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}")
        self.selection = selection
        self.algorithm = algorithm
        self._warned = False

    def check(self, compressor: Compressor) -> None:
        if compressor.name not in CARRIES:
            raise self.incompatible(
                "artopk", compressor,
                f"AR-Topk broadcasts Top-k indices and needs a Top-k compressor ({', '.join(CARRIES)})",
                _others_that_fit(compressor))

    def _apply_algorithm(self, backend: Backend) -> None:
        if self.algorithm == "auto" or backend.allreduce_algorithm == self.algorithm:
            return
        if not backend.set_allreduce_algorithm(self.algorithm) and not self._warned:
            self._warned = True
            log.warning("artopk: backend %r cannot switch its allreduce to %r; it keeps its own "
                        "algorithm (%s). See docs/algorithms.md (AR-Topk, backends).",
                        backend.name, self.algorithm, backend.allreduce_algorithm or "ring for gloo")

    def start(self, entries: list[Entry], env: CommEnv) -> Any:
        backend = env.backend
        world, me = backend.size(), backend.rank()
        self._apply_algorithm(backend)
        # check() admits only Top-k compressors, whose density() is a float
        counts = [k_for(e.tensor.numel(), float(cast(float, e.compressor.density()))) for e in entries]
        big = any(e.tensor.numel() >= 2 ** 31 for e in entries)
        idx_dtype = torch.int64 if big else torch.int32
        device = entries[0].tensor.device
        own: list[Tensor] | None = None

        with env.stats.timing("compress"):
            if self.selection == "var" or (world == 1 or env.step % world == me):
                own = [e.compressor.compress(e.tensor, e.name)[0][1] for e in entries]
                for e, i, k in zip(entries, own, counts):
                    if i.numel() != k:
                        raise ValueError(f"artopk: compressor {e.compressor!r} returned {i.numel()} indices "
                                         f"for {e.name!r}, expected k = max(1, round(density * numel)) = {k}")
            norm_sq = None
            if self.selection == "var" and own is not None:
                norm_sq = sum(float(e.tensor.reshape(-1)[i].float().square().sum())
                              for e, i in zip(entries, own))
        with env.stats.timing("comm"):
            root = select_root(self.selection, env.step, world, norm_sq, backend)
            if me == root and own is not None:
                buf = torch.cat([i.to(idx_dtype) for i in own])
            else:
                buf = torch.empty(sum(counts), dtype=idx_dtype, device=device)
            with env.stats.timing("artopk_bcast_s"):
                backend.broadcast(buf, root=root)  # blocking: the values need the indices
        env.stats.extra[f"artopk_root_b{env.bucket_index}"] = float(root)

        values, indices, off = [], [], 0
        with env.stats.timing("compress"):
            # int64 from here on (one small conversion per bucket): the one-pass C scatter of decompress and
            # the C zeroing of the residual take int64 positions; with int32 both fell back to torch's
            # zero fill + index_add_ (VGG-16: 33 ms of finish against the allgather's 18 ms)
            wide = buf.to(torch.int64)
            for e, k in zip(entries, counts):
                idx = wide[off:off + k]
                off += k
                flat = e.tensor.reshape(-1)
                v = flat.index_select(0, idx)
                e.payload = [v, idx]
                e.ctx = SparseCtx(e.tensor.shape, flat.numel(), e.tensor.dtype, e.tensor.device)
                values.append(v)
                indices.append(idx)
                env.stats.add_gain_of(v, flat)
        dtypes = {v.dtype for v in values}
        if len(dtypes) != 1:
            raise TypeError(f"artopk fuses one bucket's values into one allreduce; they must share a dtype, "
                            f"got {sorted(map(str, dtypes))}. Put tensors of other dtypes in another bucket.")
        env.stats.bytes_sent += sum(v.numel() * v.element_size() for v in values)
        if me == root:  # the broadcast's payload is this rank's contribution
            env.stats.bytes_sent += buf.numel() * buf.element_size()
        env.stats.dense_bytes += sum(e.tensor.numel() * e.tensor.element_size() for e in entries)
        with env.stats.timing("comm"):
            fused = torch.cat(values) if len(values) > 1 else values[0].clone()
            handle = backend.allreduce_async(fused, average=True)
        return _Pending(entries, handle, counts, indices, root)

    def finish(self, pending: Any, env: CommEnv) -> list[Tensor]:
        p: _Pending = pending
        with env.stats.timing("comm"):
            mean = p.handle.wait()
        out, off = [], 0
        with env.stats.timing("compress"):
            for e, k, idx in zip(p.entries, p.counts, p.indices):
                out.append(e.compressor.decompress([mean[off:off + k], idx], e.ctx).view(e.tensor.shape))
                off += k
        return out

    def __repr__(self) -> str:
        return f"ARTopkCommunicator(selection={self.selection!r}, algorithm={self.algorithm!r})"
