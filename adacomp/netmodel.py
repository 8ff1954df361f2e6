"""The alpha-beta communication cost model of the AR-Topk paper, and an online probe of alpha, beta.

Units everywhere: ``M`` bytes, ``alpha`` seconds (latency per message), ``beta`` seconds per byte
(1 / bandwidth), ``c`` density (fraction of elements kept), ``N`` ranks. ``log`` is ``log2``: the
paper writes log(N) for binary-tree / recursive-doubling collectives, whose depth is log2(N).

* Table I (§2-A2): :func:`ps`, :func:`ring_allreduce`, :func:`tree_allreduce`, :func:`broadcast`,
  :func:`allgather`.
* §3-D: :func:`allgather_sparse` (AG of values + indices, ``2Mc`` bytes), eq. 4a
  :func:`artopk_ring`, eq. 4b :func:`artopk_tree`, eq. 5a-5c :func:`ring_over_tree`,
  :func:`ring_over_ag`, :func:`tree_over_ag`.
* :class:`NetworkProbe` measures alpha, beta between the ranks at run time (the paper uses iperf /
  traceroute in a background process; adacomp times the collectives it really uses).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from adacomp.backends.base import Backend


def _log(n: int) -> float:
    if n < 1:
        raise ValueError(f"N must be >= 1 ranks, got {n}")
    return math.log2(n)


# Table I -------------------------------------------------------------------------------------
def ps(M: float, N: int, alpha: float, beta: float) -> float:
    """Parameter server (star): ``2 alpha + 2 (N-1) M beta``."""
    return 2 * alpha + 2 * (N - 1) * M * beta


def ring_allreduce(M: float, N: int, alpha: float, beta: float) -> float:
    """Ring allreduce: ``2 (N-1) alpha + 2 (N-1)/N M beta`` (bandwidth-optimal)."""
    return 2 * (N - 1) * alpha + 2 * (N - 1) / N * M * beta


def tree_allreduce(M: float, N: int, alpha: float, beta: float) -> float:
    """Tree allreduce: ``2 alpha log N + 2 log N M beta``."""
    lg = _log(N)
    return 2 * alpha * lg + 2 * lg * M * beta


def broadcast(M: float, N: int, alpha: float, beta: float) -> float:
    """Broadcast (binomial tree): ``alpha log N + log N M beta``."""
    lg = _log(N)
    return alpha * lg + lg * M * beta


def allgather(M: float, N: int, alpha: float, beta: float) -> float:
    """Allgather of ``M`` bytes per rank: ``alpha log N + (N-1) M beta``."""
    return alpha * _log(N) + (N - 1) * M * beta


# §3-D: sparse collectives ---------------------------------------------------------------------
def allgather_sparse(M: float, c: float, N: int, alpha: float, beta: float, idx_ratio: float = 1.0) -> float:
    """AG of ``Mc`` value bytes plus ``idx_ratio * Mc`` index bytes per rank.

    ``idx_ratio`` = index bytes per value byte: 1 is the paper's ``2Mc`` (int32 indices with fp32
    values, ``alpha log N + 2 Mc beta (N-1)``); 2 for int64 indices with fp32 values."""
    return allgather((1.0 + idx_ratio) * M * c, N, alpha, beta)


def artopk_ring(M: float, c: float, N: int, alpha: float, beta: float, idx_ratio: float = 1.0) -> float:
    """Eq. 4a: broadcast of the indices + ring allreduce of the values,
    ``alpha [2(N-1) + log N] + Mc beta [2(N-1)/N + log N]`` when ``idx_ratio == 1``."""
    return broadcast(idx_ratio * M * c, N, alpha, beta) + ring_allreduce(M * c, N, alpha, beta)


def artopk_tree(M: float, c: float, N: int, alpha: float, beta: float, idx_ratio: float = 1.0) -> float:
    """Eq. 4b: broadcast of the indices + tree allreduce, ``3 alpha log N + 3 Mc beta log N``."""
    return broadcast(idx_ratio * M * c, N, alpha, beta) + tree_allreduce(M * c, N, alpha, beta)


COLLECTIVES = {"allgather": allgather_sparse, "artopk_ring": artopk_ring, "artopk_tree": artopk_tree}
"""Sparse-collective cost functions by name, in tie-break order (first wins on equal cost)."""


def costs(M: float, c: float, N: int, alpha: float, beta: float,
          idx_ratio: dict[str, float] | None = None) -> dict[str, float]:
    """Predicted seconds of every sparse collective; ``idx_ratio`` per collective (default 1)."""
    r = idx_ratio or {}
    return {k: f(M, c, N, alpha, beta, r.get(k, 1.0)) for k, f in COLLECTIVES.items()}


def best_collective(M: float, c: float, N: int, alpha: float, beta: float,
                    allowed: tuple[str, ...] = tuple(COLLECTIVES),
                    idx_ratio: dict[str, float] | None = None) -> tuple[str, float]:
    """The cheapest collective among ``allowed`` and its predicted seconds (ties: table order)."""
    all_costs = costs(M, c, N, alpha, beta, idx_ratio)
    name = min((k for k in COLLECTIVES if k in allowed), key=lambda k: all_costs[k])
    return name, all_costs[name]


# Eq. 5: switching predicates ------------------------------------------------------------------
# The paper writes each rule as alpha/beta < coefficient(N) * Mc. Dividing by the coefficient's
# denominator is only valid when it is positive (N - 1 - log N is 0 at N = 2), so each predicate is
# evaluated in the equivalent multiplied-out form; coefficient_5a() gives the paper's form.
def coefficient_5a(N: int) -> float:
    """Eq. 5a right-hand side divided by Mc; ``inf`` where ``N - 1 = log N`` (N <= 2: ring always wins)."""
    lg, den = _log(N), N - 1 - _log(N)
    return (lg - (N - 1) / N) / den if den > 0 else math.inf


def coefficient_5b(N: int) -> float:
    """Eq. 5b: ``1 - 1/N - log N / (2(N-1))``."""
    return 1 - 1 / N - _log(N) / (2 * (N - 1))


def coefficient_5c(N: int) -> float:
    """Eq. 5c: ``(N-1)/log N - 3/2``."""
    return (N - 1) / _log(N) - 1.5


def ring_over_tree(M: float, c: float, N: int, alpha: float, beta: float) -> bool:
    """Eq. 5a: ART-Ring is cheaper than ART-Tree, i.e. ``alpha (N-1-log N) < Mc beta (log N - (N-1)/N)``."""
    lg = _log(N)
    return alpha * (N - 1 - lg) < M * c * beta * (lg - (N - 1) / N)


def ring_over_ag(M: float, c: float, N: int, alpha: float, beta: float) -> bool:
    """Eq. 5b: ART-Ring beats AG, ``alpha / beta < (1 - 1/N - log N / (2(N-1))) Mc``."""
    return alpha * 2 * (N - 1) < M * c * beta * (2 * (N - 1) - 2 * (N - 1) / N - _log(N))


def tree_over_ag(M: float, c: float, N: int, alpha: float, beta: float) -> bool:
    """Eq. 5c: ART-Tree beats AG, ``alpha / beta < ((N-1)/log N - 3/2) Mc``."""
    lg = _log(N)
    return alpha * 2 * lg < M * c * beta * (2 * (N - 1) - 3 * lg)


# Online probing -------------------------------------------------------------------------------
@dataclass(frozen=True)
class NetEstimate:
    """alpha (s), beta (s/byte) agreed by all ranks; ``overhead_s`` is what the probe cost."""

    alpha: float
    beta: float
    overhead_s: float
    step: int = 0

    @property
    def bandwidth_gbps(self) -> float:
        return 8e-9 / self.beta if self.beta > 0 else math.inf


_MODELS = {"allreduce": ring_allreduce, "broadcast": broadcast, "allgather": allgather}


class NetworkProbe:
    """Estimates alpha and beta from timed small and large collectives over a real Backend.

    Each probe times every op in ``ops`` at ``small_bytes`` and ``large_bytes`` (median of
    ``repeats`` after one warm-up), takes for each measurement the *maximum over ranks* (a collective
    ends when its slowest rank does; an allgather of the timings makes every rank hold identical
    numbers), and fits ``t = a alpha + b beta`` with the Table I coefficients of each op by
    non-negative relative least squares. The allreduce is modelled as ring (gloo's algorithm).
    """

    def __init__(self, probe_every: int = 100, small_bytes: int = 8, large_bytes: int = 1 << 20,
                 repeats: int = 3, ops: tuple[str, ...] = ("allreduce", "broadcast")):
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1 step, got {probe_every}")
        if not 4 <= small_bytes < large_bytes:
            raise ValueError(f"need 4 <= small_bytes < large_bytes, got {small_bytes}, {large_bytes}")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        bad = [o for o in ops if o not in _MODELS]
        if bad or not ops:
            raise ValueError(f"ops must be a non-empty subset of {sorted(_MODELS)}, got {list(ops)}")
        self.probe_every, self.small_bytes, self.large_bytes = probe_every, small_bytes, large_bytes
        self.repeats, self.ops = repeats, tuple(ops)
        self.last: NetEstimate | None = None
        self.total_overhead_s = 0.0
        self.history: list[NetEstimate] = []

    def due(self, step: int) -> bool:
        """Probe on the first call and then every ``probe_every`` steps (same answer on all ranks)."""
        return self.last is None or step - self.last.step >= self.probe_every

    def _time(self, backend: Backend, op: str, nbytes: int) -> float:
        t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        samples = []
        for i in range(self.repeats + 1):
            buf = t.clone()
            t0 = time.perf_counter()
            if op == "allreduce":
                backend.allreduce(buf)
            elif op == "broadcast":
                backend.broadcast(buf, root=0)
            else:
                backend.allgather(buf, sizes=[buf.numel()] * backend.size())
            if i:  # the first call warms buffers and connections up
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def probe(self, backend: Backend, step: int = 0) -> NetEstimate:
        """Run the timed collectives (every rank must call this at the same point)."""
        t0 = time.perf_counter()
        N = backend.size()
        plan = [(op, nb) for op in self.ops for nb in (self.small_bytes, self.large_bytes)]
        local = torch.tensor([self._time(backend, op, nb) for op, nb in plan], dtype=torch.float64)
        every = backend.allgather(local.view(1, -1), sizes=[1] * N).view(N, -1)
        times = every.max(dim=0).values.tolist()
        rows = [(_MODELS[op](4 * (nb // 4 or 1), N, 1.0, 0.0), _MODELS[op](4 * (nb // 4 or 1), N, 0.0, 1.0))
                for op, nb in plan]
        alpha, beta = fit_alpha_beta(rows, times)
        est = NetEstimate(alpha, beta, time.perf_counter() - t0, step)
        self.last = est
        self.total_overhead_s += est.overhead_s
        self.history.append(est)
        return est

    def maybe_probe(self, backend: Backend, step: int) -> NetEstimate | None:
        return self.probe(backend, step) if self.due(step) else None


def fit_alpha_beta(rows: list[tuple[float, float]], times: list[float]) -> tuple[float, float]:
    """Non-negative least squares of ``t_i = a_i alpha + b_i beta`` in relative error (each row is
    divided by ``t_i`` so microsecond and millisecond timings weigh the same).

    Plain Python floats on purpose: the 2x2 normal equations give bit-identical results on every
    rank for identical inputs (a BLAS least-squares call was seen to differ in the last bit)."""
    if all(a == 0 and b == 0 for a, b in rows):  # a world of one: nothing travels
        return 0.0, 0.0
    A = [(a / max(t, 1e-12), b / max(t, 1e-12)) for (a, b), t in zip(rows, times)]
    saa = sum(a * a for a, _ in A)
    sbb = sum(b * b for _, b in A)
    sab = sum(a * b for a, b in A)
    sa, sb = sum(a for a, _ in A), sum(b for _, b in A)  # A^T y with y = 1
    candidates = [(sa / saa if saa > 0 else 0.0, 0.0), (0.0, sb / sbb if sbb > 0 else 0.0)]
    det = saa * sbb - sab * sab
    if det > 1e-12 * saa * sbb:
        x = ((sbb * sa - sab * sb) / det, (saa * sb - sab * sa) / det)
        if x[0] >= 0 and x[1] >= 0:
            candidates.insert(0, x)

    def err(x: tuple[float, float]) -> float:
        return sum((a * x[0] + b * x[1] - 1.0) ** 2 for a, b in A)
    return min(candidates, key=err)
