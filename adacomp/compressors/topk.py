"""Layer-wise Top-k, Random-k and bucket-wise global Top-k sparsifiers.

* ``topk`` (ADTopk paper §2.2 "traditional Top-k"; AR-Topk §2-C "LWTopk"): the k largest |g| of
  the flattened tensor, k = max(1, round(density * numel)). Exactly k elements, so the payload size
  depends only on the shape (``fixed_size``): fits ``allgather`` and ``allgather_fast``.
* ``randomk`` (GRACE's Random-k): k coordinates drawn from a generator seeded identically on every
  rank, so all ranks pick the same coordinates and the payload is just the values (indices stay in
  ctx). The values of all ranks can be summed: fits ``allreduce`` as well as the allgathers.
* ``gtopk``: exact Top-k over a whole fusion bucket (granularity ``"bucket"``): one selection across
  many layers, so layers with large gradients get more of the budget. Deviation: Shi et al.'s gTop-k
  also re-selects the global k *after* a tree merge across workers; here the merge is the plain
  sparse sum of ``allgather`` (each rank keeps its own k).

All three are biased (unsent coordinates are dropped): pair them with ``residual`` memory.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from adacomp import devices
from adacomp.compressors import _native
from adacomp.compressors.base import Compressor, Payload, register
from adacomp.compressors.sparse import (SAMPLE_LINE, SAMPLE_SIZE, TINY, SparseCompressor, SparseCtx, ThresholdCounter,
                                        Workspace, check_density, k_for, largest_k, largest_k_values, sample_lines,
                                        sample_lines_pieces, sample_size, sample_value, sampled_value, scatter,
                                        sparse_residual)
from adacomp.tensors import flat_of

PREFILTER_MIN_NUMEL = 1 << 16  # below this a plain torch.topk is as fast as the prefilter
GPU_PREFILTER_MIN_NUMEL = 1 << 25
"""On a GPU (H100, docs/results/cuda.md) torch.topk alone took 0.17-0.54 ms up to 2^24 elements against the
prefilter's 0.61-0.89 ms, and 1.6-7.8 ms at 2^26-2^28 against the prefilter's 1.1-6.7 ms."""


def topk_indices(flat: Tensor, k: int, workspace: Workspace | None = None, below: float | None = None) -> Tensor:
    """Indices of the k largest magnitudes of a 1-D tensor, ascending (:func:`largest_k`'s canonical
    top-k: ties at the k-th magnitude to the lowest indices, NaN above every number).

    With a ``workspace`` (and k <= n / 4) the selection runs on a prefiltered candidate set: the
    elements at or above a value that a sample says about 1.5 k + 32 elements pass (a second, lower
    value when fewer than k pass; the whole tensor after that). Every path returns the same indices
    in the same order, so a payload never depends on the sample (tests/test_sparsifier_speedups.py).
    ``below``: a floor already seen to pass fewer than k (a fused compensation's, from the same
    sample): an attempt whose floor is not below it is skipped, not read again.
    """
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device)
    if (workspace is None or n < PREFILTER_MIN_NUMEL or 4 * k > n or flat.dtype == torch.float64
            or (devices.reads_wait(flat) and n < GPU_PREFILTER_MIN_NUMEL)):
        # float64 stays exact: the workspace's float32 magnitudes could create ties at the k-th value.
        # On a GPU torch.topk is one radix selection on the device, while the prefilter reads its
        # candidate count back (the host waits for the device): below GPU_PREFILTER_MIN_NUMEL that
        # wait costs more than the smaller selection saves.
        return _full_topk(flat.abs(), k)
    # floor above 0: exact zeros (ReLU layers' gradients are mostly zeros) never become candidates
    expected = _expected(k, n)
    a: Tensor | None = None
    for attempt in (expected, min(1.0, 4 * expected)):
        idx: Tensor | None = None
        vals: Tensor | None = None
        if _native.usable(flat):
            # the sample and the compaction read |flat| with the sign bit cleared, as torch.abs does:
            # the same floor, candidates and values, without writing the magnitudes (one pass less)
            floor = max(sample_value(flat, attempt, absolute=True), TINY)
            if below is not None and floor >= below:
                continue  # it would pass no more than the floor that passed fewer than k
            if math.isfinite(floor):
                idx, vals = _native.select(flat, floor, "abs_not_lt", attempt)
        else:
            if a is None:
                a = workspace.magnitudes(flat)
            counter = ThresholdCounter(a, strict=False, workspace=workspace)
            counter.compact(max(sample_value(a, attempt), TINY), attempt, keep_nan=True)
            idx, vals = counter.idx, counter.vals
        if vals is not None and vals.numel() >= k:
            assert idx is not None  # set with vals
            got = _native.pick_largest(vals, idx, k, None) if a is None else None  # largest_k's set in one C call
            return got[0] if got is not None else largest_k(idx, vals, k)
    return _full_topk(workspace.magnitudes(flat) if a is None else a, k)


def _expected(k: int, n: int) -> float:
    """The prefilter's target share of candidates: about 1.5 k + 32 (plus a few sigma of sampling
    noise) of n (1.25 k before cost_notes item 53: on the models' own gradients a sampled floor can
    pass somewhat fewer than its target, and a floor passing fewer than k costs a pass over the
    tensor and a selection among several times k candidates, 20 % more candidates a few percent of
    one pass)."""
    return min(1.0, (1.5 * k + 32 + 8 * math.sqrt(k)) / n)


def prefilters(flat: Tensor, k: int) -> bool:
    """Whether :func:`topk_indices` (given a workspace) runs the C prefilter on ``flat``."""
    n = flat.numel()
    return k < n and n >= PREFILTER_MIN_NUMEL and 4 * k <= n and _native.usable(flat)


class Candidates(NamedTuple):
    """The prefilter's candidates of one compensated tensor, found while it was written
    (:meth:`TopkCompressor.compensate_into`; kept in the compressor's :class:`Kept`, valid while
    the tensor is unchanged since). ``vals`` are the signed values (ranked by magnitude)."""

    idx: Tensor
    vals: Tensor
    floor: float = math.nan  # what they passed (its magnitude): where fewer than k, a lower one is needed


def _full_topk(mags: Tensor, k: int) -> Tensor:
    """:func:`largest_k` over every element (``mags``: the magnitudes of the whole tensor)."""
    if devices.reads_wait(mags):  # one device selection, no host round trip; ties as torch breaks them
        return torch.topk(mags, k, sorted=False).indices.sort().values
    return largest_k(torch.arange(mags.numel()), mags, k)


@register("topk")
class TopkCompressor(SparseCompressor):
    """Exact layer-wise Top-k by magnitude.

    ``density``: fraction of elements sent (0.001-0.01 in the ADTopk / AR-Topk evaluations).
    Payload ``[values (k,), indices (k,) int64]``.
    """

    fixed_size = True

    def __init__(self, density: float = 0.01):
        super().__init__(density)

    def compensate_into(self, g: Tensor, r: Tensor, out: Tensor, name: str) -> bool:
        """``out = g + r`` (error feedback's compensation, bitwise ``torch.add``) with the Top-k
        prefilter's compaction in the same pass, kept for :meth:`select` of ``out``: one read of the
        compensated tensor less. The floor comes from the same sample of ``g + r`` that
        :func:`topk_indices` would read from ``out``, so the candidates, and the payload, are the
        same. False (nothing written) where the prefilter would not run: the caller adds."""
        return self.compensate_segments([g], r, out, name)

    def defers_zeroing(self, tensor: Tensor) -> bool:
        flat = tensor.reshape(-1)
        return prefilters(flat, k_for(flat.numel(), self._density))  # what compensate_segments needs

    def compensate_zeroed(self, g: Tensor, r: Tensor, out: Tensor, name: str, zeroed: Tensor) -> bool:
        return self.compensate_segments([g], r, out, name, zeroed)

    def compensate_segments(self, gs: list[Tensor], r: Tensor, out: Tensor, name: str,
                            zeroed: Tensor | None = None) -> bool:
        """:meth:`compensate_into` of ``g = torch.cat(gs)`` (a fusion bucket's gradients: gTop-k) read
        where the pieces lie, so the engine makes no flattened copy of the bucket (a read and a write
        of it): the same sample, floor, sums and candidates. False (nothing written) where it would
        decline, or a C pass cannot run. ``zeroed`` (one piece only): ascending positions where ``r``
        counts as +0.0 (:meth:`compensate_zeroed`)."""
        flat, rf = flat_of(out), flat_of(r)
        n = flat.numel()
        k = k_for(n, self._density)
        if not (prefilters(flat, k) and _native.usable(r) and r.numel() == n):
            return False
        expected = self._target(name, k, n)
        pieces = [flat_of(g) for g in gs]
        one = pieces[0] if len(pieces) == 1 and _native.usable(pieces[0]) and pieces[0].numel() == n else None
        if zeroed is not None and (one is None or flat.data_ptr() == rf.data_ptr()):
            return False
        # one tensor: the plain passes (no segment tables to build, ~5 us a call on 150-tensor models)
        sample = sample_lines(one, plus=rf, zeroed=zeroed) if one is not None else sample_lines_pieces(pieces, rf)
        if sample is None:
            return False
        floor = max(sampled_value(sample, expected, absolute=True), TINY)
        if not math.isfinite(floor):
            return False
        got = _native.add_select(one, rf, flat, floor, expected, zeroed) if one is not None else \
            _native.add_select_segments(pieces, rf, flat, floor, expected)
        if got is None:
            return False
        idx, vals = got
        self._passed(name, vals.numel(), k)
        self._kept().keep(name, flat, Candidates(idx, vals, floor))
        return True

    def _target(self, name: str, k: int, n: int) -> float:
        """The fused pass's candidate share for ``name``: :func:`_expected`, widened for a tensor whose
        sampled floor recently passed fewer than k (:meth:`~adacomp.compressors.sparse.SparseCompressor._passed`)."""
        return self._widened(name, _expected(k, n))

    def compensate_mean_into(self, idx: list[Tensor], vals: list[Tensor], divisor: int, r: Tensor, out: Tensor,
                             name: str) -> bool:
        """:meth:`compensate_into` where the gradient is the ranks' sparse mean of ``vals`` at ``idx``
        (what :func:`~adacomp.compressors._native.sparse_mean` would write; the divisible scheme's
        second stage) and is never written itself: ``out = mean + r`` and the prefilter's candidates
        in one pass, the floor from the same sample of ``mean + r``. False (nothing written) where
        :meth:`compensate_into` would decline or the C pass cannot run: the caller writes the mean."""
        flat, rf = flat_of(out), flat_of(r)
        n = flat.numel()
        k = k_for(n, self._density)
        if not (prefilters(flat, k) and _native.usable(r) and r.numel() == n and n > SAMPLE_SIZE):
            return False
        expected = self._target(name, k, n)
        sample = _native.sparse_sample_lines(rf, idx, vals, divisor, n // SAMPLE_LINE,
                                             sample_size(n) // SAMPLE_LINE)
        if sample is None:
            return False
        floor = max(sampled_value(sample, expected, absolute=True), TINY)
        if not math.isfinite(floor):
            return False
        got = _native.sparse_mean_add_select(rf, flat, idx, vals, divisor, floor, expected)
        if got is None:
            return False
        self._passed(name, got[1].numel(), k)
        self._kept().keep(name, flat, Candidates(*got, floor))
        return True

    def _prepared(self, flat: Tensor, name: str, k: int) -> tuple[Candidates | None, float | None]:
        """The candidates :meth:`compensate_into` found for ``flat``, if ``flat`` is unchanged since
        and they hold k (what :func:`topk_indices`' first attempt would find); else None and the
        floor that passed fewer than k, if that was it (for :func:`topk_indices`' ``below``)."""
        c = self._kept().take(name, flat)
        if not (isinstance(c, Candidates) and prefilters(flat, k)):
            return None, None
        if c.vals.numel() >= k:
            return c, None
        return None, c.floor if math.isfinite(c.floor) else None

    def select(self, flat: Tensor, name: str) -> Tensor:
        k = k_for(flat.numel(), self._density)
        c, below = self._prepared(flat, name, k)
        return largest_k(c.idx, c.vals.abs(), k) if c is not None else topk_indices(flat, k, self._workspace(), below)

    def pick(self, flat: Tensor, name: str) -> tuple[Tensor, Tensor]:
        k = k_for(flat.numel(), self._density)
        c, below = self._prepared(flat, name, k)
        if c is not None:  # the candidates carry their signed values: no gather from flat
            got = _native.pick_largest(c.vals, c.idx, k, None)
            if got is not None:
                return got
            return largest_k_values(c.idx, c.vals.abs(), k, flat)
        if k < flat.numel() and not prefilters(flat, k) and flat.device.type == "cpu":
            got = _native.pick_largest(flat, None, k, None)  # the whole (small) tensor in one C call
            if got is not None:
                return got
        idx = topk_indices(flat, k, self._workspace(), below)
        return idx, _native.take(flat, idx)


@register("gtopk")
class GTopkCompressor(TopkCompressor):
    """Top-k over the flattened gradient of a whole fusion bucket (one selection, many layers).

    The optimizer hands it one entry per bucket; ``density`` applies to the bucket's total size.
    """

    granularity = "bucket"

    def __init__(self, density: float = 0.01):
        super().__init__(density)

    def defers_zeroing(self, tensor: Tensor) -> bool:
        # a bucket is compensated from its gradients where they lie (compensate_segments through
        # ResidualMemory.compensate_with), which reads a written residual
        return False


RANDPERM_DENSITY = 0.5  # above this a full permutation is cheaper than drawing with rejection


def distinct_uniform(n: int, k: int, gen: torch.Generator) -> Tensor:
    """k distinct indices of ``range(n)``, a uniformly random k-subset, ascending (int64).

    Why not ``randperm(n)[:k]``: it writes and shuffles all n indices (~0.5 s at n = 2^24). Here
    i.i.d. uniform draws are taken in batches and the first k *distinct* values in draw order are
    kept (sequential sampling without replacement, so every k-subset is equally likely); the draw
    count is sized so one batch almost always suffices: m = n ln(n / (n - k)) * 1.05 + 64. The
    result depends only on the generator, so ranks with equal generators pick equal indices. Above
    ``RANDPERM_DENSITY`` (where rejection would redraw a lot) ``randperm`` is used.
    """
    device = gen.device
    if k >= n:
        return torch.arange(n, device=device)
    if k > RANDPERM_DENSITY * n:
        return torch.randperm(n, generator=gen, device=device)[:k].sort().values
    m = int(n * math.log(n / (n - k)) * 1.05) + 64
    draws = torch.randint(n, (m,), generator=gen, device=device)
    while (found := _native.first_distinct(draws, n, k)) is not None:  # one bitmap pass instead of a sort
        picked, distinct = found
        if distinct >= k:
            return picked
        more = max(64, int((k - distinct) * n / max(1, n - distinct) * 1.05) + 64)
        draws = torch.cat([draws, torch.randint(n, (more,), generator=gen, device=device)])
    while True:
        uniq, inverse = torch.unique(draws, sorted=True, return_inverse=True)
        if uniq.numel() >= k:
            break
        more = max(64, int((k - uniq.numel()) * n / max(1, n - uniq.numel()) * 1.05) + 64)
        draws = torch.cat([draws, torch.randint(n, (more,), generator=gen, device=device)])
    if uniq.numel() == k:
        return uniq
    # first draw position of each distinct value (all different); keep the k values that appeared
    # first, ascending: a fixed-size selection, so no second read-back on a device
    first = torch.full((uniq.numel(),), draws.numel(), dtype=torch.int64, device=device)
    first.scatter_reduce_(0, inverse, torch.arange(draws.numel(), device=device), reduce="amin")
    earliest = torch.topk(first, k, largest=False, sorted=False).indices
    return uniq.index_select(0, earliest.sort().values)


class RandomkCtx(NamedTuple):
    """Random-k keeps the chosen coordinates locally: every rank drew the same ones."""

    sparse: SparseCtx
    indices: Tensor


@register("randomk")
class RandomkCompressor(Compressor):
    """k uniformly random coordinates, identical on every rank (payload ``[values]``).

    The coordinates come from a private ``torch.Generator`` seeded from ``(seed, tensor name,
    step, calls since the last step)``; ``step`` is set by :meth:`on_step`, so the choice changes
    every iteration and is reproducible after a restore. The global RNG is never touched (GRACE's
    Random-k reseeds it, which also changes dropout and data order).
    """

    additive = True
    fixed_size = True
    sparse = False

    def __init__(self, density: float = 0.01, seed: int = 0):
        self._density = check_density(density)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.seed = seed
        self._step = 0
        self._calls: dict[str, int] = {}

    def density(self) -> float | None:
        return self._density

    def set_density(self, density: float) -> None:
        self._density = check_density(density)

    def _generator(self, name: str, device: torch.device) -> torch.Generator:
        calls = self._calls.get(name, 0)
        self._calls[name] = calls + 1
        key = f"{self.seed}:{name}:{self._step}:{calls}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = k_for(n, self._density)
        idx = distinct_uniform(n, k, self._generator(name, flat.device))
        ctx = RandomkCtx(SparseCtx(tensor.shape, n, tensor.dtype, tensor.device), idx)
        return [_native.take(flat, idx)], ctx

    residual_in_place = True
    """:meth:`residual` zeroes the sent coordinates (as a sparsifier's does), so error feedback may
    keep the compensated buffer itself as the residual."""

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        return scatter(payload[0], ctx.indices, ctx.sparse, self._workspace())

    def residual(self, tensor: Tensor, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        """The sent values are the tensor's own, so the residual is the tensor with those coordinates
        zeroed (:func:`sparse_residual`: one copy at most, no decompressed tensor and subtraction)."""
        if payload[0].dtype == tensor.dtype:
            return sparse_residual(tensor, ctx.indices, out)
        return super().residual(tensor, payload, ctx, out)

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        return k_for(int(torch.Size(shape).numel()), self._density) * itemsize

    def on_step(self, step: int) -> None:
        self._step = int(step)
        self._calls.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "calls": dict(self._calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state.get("step", 0))
        self._calls = {str(k): int(v) for k, v in state.get("calls", {}).items()}

    def __repr__(self) -> str:
        return f"RandomkCompressor(density={self._density}, seed={self.seed})"
