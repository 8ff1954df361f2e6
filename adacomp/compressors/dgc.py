"""DGC: top-k threshold estimated on a random sample, exact top-k only when too many pass.

Lin, Han, Mao, Wang and Dally, "Deep Gradient Compression" (ICLR 2018), as summarised in ADTopk
§2.2. §3.1 (Algorithm 1) sends the elements of the accumulated gradient above the threshold of the
top ``density`` fraction; §5 (system performance) estimates that threshold by a top-k on a random
sample of 0.1%-1% of the elements and, when far more elements than k pass it, computes a precise
threshold among the already-selected candidates (the "second top-k"). §3.3 warm-up training
decays the density exponentially over the first epochs (75%, 93.75%, ... sparsity).

Bounds and names follow the first author's public code (synxlin/deep-gradient-compression):
``compress_upper_bound`` 1.3 (more than 1.3k candidates -> exact top-k among them, so exactly k are
sent), ``compress_lower_bound`` 0.8 (fewer than 0.8k -> threshold x0.8, at most
``max_adaptation_iters`` = 10 times), and at least ``ceil(2 / density)`` samples so the sampled
top-k holds two or more elements.

Deviations: samples are drawn uniformly with replacement from this compressor's own generator
(the public code uses a strided sample with a random start from Python's global RNG); between k
and 1.3k candidates all are sent (the public code keeps the first k in index order, which drops
large elements arbitrarily); warm-up is counted in optimizer steps (``warmup_steps``, split into
the paper's 4 warm-up epochs) because a compressor does not know the epoch length.

Pair with memory ``dgc`` (momentum correction §3.2, momentum-factor masking §3.3) and an inner
optimizer *without* momentum, or with ``residual``. Payload ``[values, indices]`` of variable size.
Communicators: ``allgather``.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from adacomp.compressors.base import register
from adacomp.compressors import _native
from adacomp.compressors.sparse import (TINY, SparseCompressor, ThresholdCounter, k_for, largest_k, sample_lines,
                                        sampled_value, search_share)
from adacomp.tensors import flat_of

FUSED_MIN_NUMEL = 1 << 16  # below this the separate selection pass costs no more than the fused one's sampling
HINT_SAMPLE = 1 << 12  # elements of the line sample that places the fused pass's floor


class Candidates(NamedTuple):
    """What :meth:`DGCCompressor.accumulate_into` compacted while it wrote the accumulated velocity:
    positions of ``|v| >= floor`` (what ``ThresholdCounter.compact(floor)`` keeps) and the signed v
    there (the payload's values)."""

    floor: float
    idx: Tensor
    vals: Tensor

WARMUP_EPOCHS = 4  # DGC §3.3: sparsity 75% -> 99.9% over the first four epochs


class NativeChoice:
    """Switch of :meth:`DGCCompressor.choose`'s one C call (``_native.dgc_choose``); off, the chain
    of calls it stands for runs (the same answers: tests and ``bench cost cell --toggle`` flip it)."""
    on = True


@register("dgc")
class DGCCompressor(SparseCompressor):
    """Sampled threshold with a second exact selection; own ``torch.Generator`` per device.

    ``density``: target fraction sent (DGC reports 99.9% sparsity = 0.001; ADTopk §6 compares at
    0.01). ``sample_ratio``: fraction of elements sampled (DGC §5: 0.001-0.01). ``warmup_steps``:
    steps of exponential density warm-up (0 = off). ``seed``: sampling generator seed.
    """

    def __init__(self, density: float = 0.01, sample_ratio: float = 0.01, compress_upper_bound: float = 1.3,
                 compress_lower_bound: float = 0.8, max_adaptation_iters: int = 10, warmup_steps: int = 0,
                 seed: int = 0):
        super().__init__(density)
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1] (DGC samples 0.001-0.01), got {sample_ratio!r}")
        if compress_upper_bound < 1.0:
            raise ValueError(f"compress_upper_bound must be >= 1, got {compress_upper_bound!r}")
        if not 0.0 < compress_lower_bound <= 1.0:
            raise ValueError(f"compress_lower_bound must be in (0, 1], got {compress_lower_bound!r}")
        if max_adaptation_iters < 0:
            raise ValueError(f"max_adaptation_iters must be >= 0, got {max_adaptation_iters!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
        self.sample_ratio = float(sample_ratio)
        self.compress_upper_bound = float(compress_upper_bound)
        self.compress_lower_bound = float(compress_lower_bound)
        self.max_adaptation_iters = int(max_adaptation_iters)
        self.warmup_steps = int(warmup_steps)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        self.seed = int(seed)
        self._step = 0
        self._generators: dict[str, torch.Generator] = {}
        self._pending_states: dict[str, Tensor] = {}

    # ----------------------------------------------------------------------------------------
    def current_density(self) -> float:
        """Target density of this step: during warm-up density^((p+1)/5) in phase p of 4."""
        if self._step >= self.warmup_steps:
            return self._density
        phase = self._step * WARMUP_EPOCHS // self.warmup_steps
        return max(self._density, self._density ** ((phase + 1) / (WARMUP_EPOCHS + 1)))

    def on_step(self, step: int) -> None:
        self._step = int(step)

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        return k_for(int(torch.Size(shape).numel()), self.current_density()) * (itemsize + 8)

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            if key in self._pending_states:
                gen.set_state(self._pending_states.pop(key))
            self._generators[key] = gen
        return gen

    def accumulate_into(self, u: Tensor, g: Tensor, v: Tensor, u_out: Tensor, v_out: Tensor, momentum: float,
                        name: str, zeroed: Tensor | None = None) -> bool:
        """DGC memory's momentum correction (``u_out = u * momentum + g``, ``v_out = v + u_out``: torch's
        floats) with the candidates of the coming selection from the same pass, kept for
        :meth:`select` of ``v_out``: one read of the tensor less. Their floor, a value that about
        3x the density passes in a line sample of the new ``v``, is a speed hint only (the selection's
        threshold is DGC's own sampled one; below the floor it reads ``v_out`` whole). ``zeroed``:
        ascending positions where ``u`` and ``v`` count as +0.0 (the memory's masking of the last
        sent coordinates, left to this pass). False (nothing written) where the fused pass cannot
        run: the memory runs its own."""
        flat = flat_of(v_out)
        n = flat.numel()
        density = self.current_density()
        if n < FUSED_MIN_NUMEL or k_for(n, density) >= n:
            return False
        expected = search_share(density)
        uf, gf, vf = flat_of(u), flat_of(g), flat_of(v)
        # the new v, about, at 256 lines of each input (the floor aims at 3x the density, so its
        # noise hardly matters; Top-k's 1024 lines cost more than the read this pass saves here)
        sample = sample_lines(vf, HINT_SAMPLE, plus=gf).add_(sample_lines(uf, HINT_SAMPLE), alpha=momentum)
        floor = max(sampled_value(sample, expected, absolute=True), TINY)
        if not math.isfinite(floor):
            return False
        got = _native.momentum_select(uf, gf, vf, flat_of(u_out), flat, momentum, floor, expected, zeroed)
        if got is None:
            return False
        self._kept().keep(name, flat, Candidates(floor, *got))
        return True

    def _sample_sizes(self, n: int, density: float) -> tuple[int, int]:
        """How many elements the threshold samples (DGC §5: ``sample_ratio`` of them, at least enough
        for two above it) and the rank of the threshold among them."""
        samples = min(n, max(math.ceil(n * self.sample_ratio), math.ceil(2.0 / density)))
        return samples, min(samples, max(1, math.ceil(samples * density)))

    def threshold(self, a: Tensor, density: float, absolute: bool = False) -> float:
        """The k_s-th largest magnitude of a uniform sample (k_s = ceil(samples * density)); ``a``
        holds magnitudes, or signed values when ``absolute``."""
        n = a.numel()
        samples, k_s = self._sample_sizes(n, density)
        if samples < n:
            gen = self._generator(a.device)
            # the same draws and values in one C call (no position tensor; the loads prefetched)
            sample = _native.sample_take(a, samples, gen)
            if sample is None:
                pick = torch.randint(n, (samples,), generator=gen, device=a.device)
                # a[pick]'s values, read region by region (an order of their own: the threshold is an
                # order statistic of the multiset); torch's gather where C does not serve
                sample = _native.take_grouped(a, pick)
        else:
            sample = a
        if absolute and _native.usable(sample):  # one radix select in C: the same k_s-th largest |x|
            value = _native.rth_largest_strided(sample, 1, k_s, absolute=True)
            if value is not None:  # None on a NaN: torch's answer below
                return value
        if absolute:
            sample = sample.abs()
        return float(torch.topk(sample, k_s, sorted=False).values.min())

    def select(self, flat: Tensor, name: str) -> Tensor:
        return self.choose(flat, name)[0]

    def choose(self, flat: Tensor, name: str) -> tuple[Tensor, Tensor | None]:
        """The selection, with its values where the momentum pass's candidates or the second top-k's
        gather carry them."""
        density = self.current_density()
        k = k_for(flat.numel(), density)
        if k >= flat.numel():
            return torch.arange(flat.numel(), device=flat.device), None
        ws = self._workspace()
        kept = self._kept().take(name, flat)
        # the C passes read |g| with the sign bit cleared (as torch.abs does), so the magnitudes are
        # never written; elsewhere |g| goes to a reused buffer (one pass, no page faults)
        absolute = _native.usable(flat)
        if absolute and NativeChoice.on:  # the whole choice below in one C call, the same answers
            samples, k_s = self._sample_sizes(flat.numel(), density)
            got = _native.dgc_choose(flat, self._generator(flat.device) if samples < flat.numel() else None,
                                     samples, k_s, (kept.floor, kept.idx, kept.vals) if isinstance(kept, Candidates)
                                     else None, k, self.compress_lower_bound, self.compress_upper_bound,
                                     self.max_adaptation_iters)
            if got is not None:
                return got
        a = flat if absolute else ws.magnitudes(flat)
        thr = self.threshold(a, density, absolute)
        counter = ThresholdCounter(a, strict=False, workspace=ws, absolute=absolute)
        if isinstance(kept, Candidates) and absolute:  # the momentum pass's compaction: the same answers
            counter.adopt(kept.floor, kept.idx, kept.vals, signed=True)

        def chosen(t: float, share: float) -> tuple[Tensor, Tensor | None]:
            got = counter.pick(t, share)
            return got if got is not None else (counter.select(t, share), None)
        idx, vals = chosen(thr, density)
        for _ in range(self.max_adaptation_iters):
            if idx.numel() >= self.compress_lower_bound * k:
                break
            thr *= self.compress_lower_bound
            idx, vals = chosen(thr, density / self.compress_lower_bound)
        if idx.numel() > self.compress_upper_bound * k:  # the second, exact top-k among candidates
            cand = vals if vals is not None else _native.take(a, idx)  # signed where absolute
            got = _native.pick_largest(cand, idx, k, None) if absolute else None  # one C call, |cand| ranked
            # (absolute: a is flat, so the picked candidates' own values are the payload's)
            idx, vals = got if got is not None else (largest_k(idx, cand.abs() if absolute else cand, k), None)
        if not idx.numel():
            return (a.abs() if absolute else a).argmax().view(1), None
        return idx, vals

    # ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        states = dict(self._pending_states)
        states.update({k: g.get_state() for k, g in self._generators.items()})
        return {"step": self._step, "generators": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step = int(state.get("step", 0))
        self._generators.clear()
        self._pending_states = {k: v.clone() for k, v in state.get("generators", {}).items()}

    def __repr__(self) -> str:
        return (f"DGCCompressor(density={self._density}, sample_ratio={self.sample_ratio}, "
                f"warmup_steps={self.warmup_steps})")
