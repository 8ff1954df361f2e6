"""L-GreCo: layer-wise compression parameters by dynamic programming under an error budget
(Markov et al., l-greco.txt §3-4, Alg. 1).

Every ``period`` steps after ``warmup``, rank 0 compresses the gradients accumulated since the last
decision with every candidate parameter of every layer (no error feedback, throw-away compressor
copies so the live state is untouched), measures ``error(l, c) = ||g - decompress(compress(g))||^2``
and ``size(l, c)`` (payload bytes), and solves

    minimise sum_l size(l, c_l)  s.t.  sum_l error(l, c_l) <= E_max            (§3, Formula 3)

with ``E_max = alpha * total error of the uniform default parameter``. The assignment is broadcast
and written into the per-parameter compressors (``set_density`` / ``set_rank`` / ``set_bits``).
"""
from __future__ import annotations

import copy
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch import Tensor

from adacomp.compressors.base import Compressor
from adacomp.compressors.sparse import k_for
from adacomp.engine.metrics import StepStats
from adacomp.policies.base import Policy, register
from adacomp.policies.rendezvous import Rendezvous

if TYPE_CHECKING:
    from adacomp.policies.base import Host

log = logging.getLogger(__name__)


def solve(errors: Any, sizes: Any, budget: float, steps: int = 10000,
          default: Sequence[int] | None = None) -> list[int]:
    """Alg. 1 (lines 6-31): one choice index per layer minimising total size subject to
    total *discretised* error <= ``budget``.

    ``default`` is Alg. 1's "static default compression parameters to improve" (one choice per
    layer; the policy passes the uniform assignment, whose error is the budget, §3 "The Error
    Bound"). Errors are measured **from** it and rounded up, so the problem solved exactly is

        minimise sum_l size(l, c_l)  s.t.  sum_l t(l, c_l) <= T,
        t(l, c) = ceil((error(l, c) - error(l, d_l)) / u),  T = floor((budget - sum_l error(l, d_l)) / u)

    with ``u = budget / steps`` (§4: steps of ``E_max / D``, D = 10000). What "within the
    discretisation" means: (1) the real total error of the answer never exceeds ``budget``
    (each t over-counts); (2) the default itself has t = 0 in every layer, so at budget = its own
    error (the paper's operating point) it stays feasible and the answer never sends more than it
    (issue 32: rounding absolute errors up pushed the default past the budget, and on 4 of the
    30 instances of tests/test_lgreco_default.py the DP returned a larger plan); (3) a plan that
    changes k layers from the default is found whenever its real error is <= ``budget - k u``.
    Without ``default`` the origin is zero error in every layer (absolute errors rounded up, the
    answers of the earlier DP).

    ``DP[l, b]`` is the least size of layers ``0..l`` with discretised error ``b`` (counted from
    the least t of each layer, so the table is at most ``steps + 1`` wide); ties go to the smaller
    error. Raises ValueError when no assignment fits (the caller keeps its current one). When
    rounding makes the DP infeasible although the least-error assignment fits the budget (a tie
    such as budget == minimum total error), that assignment is returned. O(L * C * steps) time.
    """
    err = np.asarray(errors, dtype=np.float64)
    size = np.asarray(sizes, dtype=np.float64)
    if err.ndim != 2 or err.shape != size.shape or err.shape[0] == 0 or err.shape[1] == 0:
        raise ValueError(f"errors and sizes must be non-empty L x C arrays of one shape, got "
                         f"{err.shape} and {size.shape}")
    if budget < 0 or not np.isfinite(budget):
        raise ValueError(f"budget must be a finite number >= 0, got {budget}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    L, C = err.shape
    err = np.maximum(err, 0.0)
    ticks, cap = _discretise(err, budget, steps, _default_index(default, L, C))
    if cap < 0:
        return _infeasible(err, size, budget)
    width = cap + 1
    dp = np.full(width, np.inf)
    choice = np.full((L, width), -1, dtype=np.int32)
    for c in range(C):                                   # Alg. 1 lines 9-12
        e = ticks[0, c]
        if e < width and size[0, c] < dp[e]:
            dp[e], choice[0, e] = size[0, c], c
    for layer in range(1, L):                            # lines 14-24, vectorised over e_i
        new = np.full(width, np.inf)
        row = choice[layer]
        for c in _distinct_ticks(ticks[layer], size[layer], width):
            e = int(ticks[layer, c])
            cand = dp[: width - e] + size[layer, c]      # in place on views (issue 21: no full-
            better = cand < new[e:]                      # width temporaries, no boolean gathers)
            np.copyto(new[e:], cand, where=better)
            np.copyto(row[e:], c, where=better)
        dp = new
    if not np.isfinite(dp).any():
        return _infeasible(err, size, budget)
    b = int(np.argmin(dp))                              # line 25: first (smallest error) minimum
    out = [0] * L
    for layer in range(L - 1, -1, -1):                   # lines 27-30
        c = int(choice[layer, b])
        out[layer] = c
        b -= int(ticks[layer, c])
    return out


def _infeasible(err: np.ndarray, size: np.ndarray, budget: float) -> list[int]:
    fallback = _most_accurate(err, size, budget)
    if fallback is not None:
        return fallback
    raise ValueError(f"no assignment has total error <= budget {budget:g}; the smallest possible "
                     f"total error is {err.min(axis=1).sum():g}")


def _default_index(default: Sequence[int] | None, L: int, C: int) -> np.ndarray | None:
    if default is None:
        return None
    idx = np.asarray(default)
    if idx.shape != (L,) or not np.issubdtype(idx.dtype, np.integer) or idx.min() < 0 or idx.max() >= C:
        raise ValueError(f"default must hold one choice index in [0, {C}) per layer ({L}), "
                         f"got {list(default)}")
    return idx


def _discretise(err: np.ndarray, budget: float, steps: int,
                default: np.ndarray | None) -> tuple[np.ndarray, int]:
    """(t - min_c t per layer, T - sum of those minima): :func:`solve`'s discretised errors and
    budget, shifted so that every layer's least t is 0. Entries above the budget read ``T + 1``.
    The 1e-9 units absorb float noise: an error equal to k units is k units, and a budget equal
    to the default's error (summed in another order) leaves a slack of 0 units, not -1."""
    L = err.shape[0]
    if budget == 0:  # only error-free choices fit; the default's error is then 0 too
        return np.where(err > 0, 1, 0).astype(np.int64), 0
    unit = budget / steps
    base = err[np.arange(L), default] if default is not None else np.zeros(L)
    with np.errstate(over="ignore", invalid="ignore"):
        ticks = np.ceil((err - base[:, None]) / unit - 1e-9)
    ticks = np.where(np.isfinite(ticks), ticks, np.inf)
    low = ticks.min(axis=1)
    room = math.floor((budget - float(base.sum())) / unit + 1e-9) - float(low.sum())
    if not np.isfinite(room) or room < 0:
        return ticks, -1
    cap = int(min(room, steps))    # <= steps anyway: each layer's least t >= -error(l, d_l) / u
    shifted = np.minimum(ticks - low[:, None], cap + 1)
    return shifted.astype(np.int64), cap


def _distinct_ticks(ticks: np.ndarray, size: np.ndarray, width: int) -> list[int]:
    """Per discretised error below ``width``, the choice of least size (first on ties), in index
    order. Why: small layers often round all ~100 candidates to one or two ticks, and choices of
    one tick differ only by a constant, so only the smallest can win a DP cell; skipping the rest
    leaves every DP value as it was (a choice differs only where two sizes of one tick tie after
    rounding the sum, which integer byte sizes never do)."""
    best: dict[int, int] = {}
    for c, e in enumerate(ticks.tolist()):
        if e < width and (e not in best or size[c] < size[best[e]]):
            best[e] = c
    return sorted(best.values())


def _most_accurate(err: np.ndarray, size: np.ndarray, budget: float) -> list[int] | None:
    """The least-error choice per layer (ties: smaller size) when its real total error fits the
    budget. Rounding every layer's error *up* can push that total past ``steps`` ticks although it
    equals the budget (e.g. budget = the uniform default's error, the most accurate in every
    layer), so the DP alone would wrongly call it infeasible. The relative 1e-12 absorbs the
    order in which the caller summed the same errors."""
    best = err.min(axis=1, keepdims=True)
    if float(best.sum()) > budget * (1.0 + 1e-12):
        return None
    masked = np.where(err <= best, size, np.inf)
    return [int(c) for c in np.argmin(masked, axis=1)]


# --- the knob each compressor family exposes ------------------------------------------------------
def knob_of(comp: Compressor) -> str | None:
    """``bits`` (qsgd), ``rank`` (powersgd / acpsgd), ``density`` (sparsifiers) or None."""
    if callable(getattr(comp, "set_bits", None)):
        return "bits"
    if callable(getattr(comp, "set_rank", None)):
        return "rank"
    if comp.density() is not None:
        return "density"
    return None


def get_knob(comp: Compressor, kind: str) -> float:
    return {"bits": lambda: comp.bits, "rank": lambda: comp.rank,  # type: ignore[attr-defined]
            "density": comp.density}[kind]()


def set_knob(comp: Compressor, kind: str, value: float) -> None:
    if kind == "bits":
        comp.set_bits(int(value))  # type: ignore[attr-defined]
    elif kind == "rank":
        comp.set_rank(int(value))  # type: ignore[attr-defined]
    else:
        comp.set_density(float(value))


def candidates(kind: str, default: float, low: float = 0.0, high: float = 0.0, step: float = 0.0) -> list[float]:
    """§5 "Parameter ranges": bits / ranks in [D/2, 2D] step 1, densities in [D/10, 10D] step D/10,
    each bound and the step overridable (0 keeps the paper's value). Always contains ``default``."""
    if kind == "density":
        lo, hi, st = low or default / 10, high or min(1.0, default * 10), step or default / 10
        vals = [round(float(v), 12) for v in np.arange(lo, hi + st / 2, st) if 0 < v <= 1]
    else:
        lo, hi, st = low or max(1, int(default) // 2), high or int(default) * 2, step or 1
        vals = [float(v) for v in range(int(lo), int(hi) + 1, max(1, int(st)))]
        if kind == "bits":
            vals = [v for v in vals if 2 <= v <= 8]
    if not any(abs(v - default) < 1e-12 for v in vals):
        vals.append(float(default))
    return sorted(set(vals))


def simulate_error(comp: Compressor, kind: str, value: float, grad: Tensor, name: str,
                   iters: int = 1) -> tuple[float, int]:
    """(``||g - decompress(compress(g))||^2``, payload bytes) for ``comp`` set to ``value``, on a
    copy (the live compressor's state is not touched) and as a world of one: the "mean" of each
    round is this payload. ``iters`` > 1 repeats compress/decompress on the same gradient, i.e.
    power iterations for low-rank methods (the authors' code runs 5 from a random start)."""
    sim = copy.deepcopy(comp)
    set_knob(sim, kind, value)
    if hasattr(sim, "start_iter"):
        sim.start_iter = 0  # the error of the rank is wanted, not of the dense warm-up
    step = int(getattr(sim, "step", 0))
    out = grad
    for i in range(iters):
        payload, ctx = sim.compress(grad, name)
        for r in range(1, sim.rounds):
            payload, ctx = sim.next_round(r, [t.clone() for t in payload], ctx)
        out = sim.decompress([t.clone() for t in payload], ctx)
        sim.on_step(step + i + 1)
    err = float((grad.float() - out.float().view_as(grad)).square().sum())
    return err, int(sim.payload_bytes(grad.shape, grad.element_size()))


SAMPLE = 1 << 16  # magnitudes sampled to place the selection threshold of a large layer
CHUNK = 1 << 20   # elements squared per pass: a reused 4 MiB buffer stays in cache, no page faults


def topk_tails(grad: Tensor, ks: list[int]) -> dict[int, float]:
    """``{k: sum of the squares of grad outside its k largest magnitudes}``, exact, in float64.

    Why not one sort (issue 21): sorting a 38M-element layer takes seconds, yet only the sums at
    the ~100 candidate k are needed. A random sample places a threshold that keeps a few percent
    more than ``max(ks)`` elements; one chunked pass squares the layer and compacts those (zeros
    never: they add nothing), and only they are sorted (numpy's vectorised float32 sort: faster
    here than ``torch.sort`` and than a multi-pivot ``numpy.partition``); sums between the
    ``len - k`` positions give every tail. Every element left out is <= every element kept, so the
    tails are those of a full sort up to float rounding. Should the sample overestimate the
    threshold (fewer than ``max(ks)`` kept), a second pass keeps all non-zeros: slower, same sums.
    Off-CPU tensors are sorted on their device (fast there).
    """
    flat = grad.detach().reshape(-1)
    n = flat.numel()
    kmax = max((k for k in ks if k < n), default=0)   # keeping everything leaves nothing out
    if kmax == 0:
        return {k: 0.0 for k in ks}
    if flat.device.type != "cpu":
        sq = flat.float().square().sort().values.double()        # ascending
        prefix = torch.cat([sq.new_zeros(1), sq.cumsum(0)])       # prefix[p] = sum of sq[:p]
        return {k: float(prefix[max(n - k, 0)]) for k in ks}
    thr = 0.0
    if n > SAMPLE and kmax < n:
        gen = torch.Generator().manual_seed(n)  # own generator: the global RNG stream is the user's
        sample = flat[torch.randint(0, n, (SAMPLE,), generator=gen)].float().square()
        q = kmax / n
        rank = min(SAMPLE, int(math.ceil(SAMPLE * q + 5.0 * math.sqrt(SAMPLE * q * (1 - q)))) + 1)
        thr = float(sample.topk(rank, sorted=False).values.min())
    vals, total = _kept_squares(flat, thr)
    if thr > 0 and vals.size < kmax:
        thr = 0.0
        vals, total = _kept_squares(flat, thr)
    vals.sort()
    c = vals.size
    # the mass left out: nothing when every non-zero was kept, else total minus kept (float64;
    # the rounding is ~1e-16 of the total, far below L-GreCo's discretisation unit)
    rest = 0.0 if thr == 0 else max(total - float(np.sum(vals, dtype=np.float64)), 0.0)
    starts = sorted({0} | {c - k for k in ks if 0 < k <= c}) if c else []
    below: dict[int, float] = {}
    if starts:
        # float64 segment sums; cast first: reduceat(dtype=float64) casts element by element, ~20x slower
        seg = np.add.reduceat(vals.astype(np.float64), starts)      # seg[j]: vals[s_j : s_(j+1)]
        below = dict(zip(starts, np.concatenate(([0.0], np.cumsum(seg)[:-1])).tolist()))
    # k > c only when every non-zero was kept: nothing is left out
    return {k: 0.0 if k >= n else rest + (below[c - k] if k <= c else 0.0) for k in ks}


def _kept_squares(flat: Tensor, thr: float) -> tuple[np.ndarray, float]:
    """(squares >= ``thr`` (> 0 when ``thr`` is 0), float64 sum of all squares), in one pass of
    ``CHUNK``-sized pieces through one reused buffer."""
    n = flat.numel()
    buf = torch.empty(min(n, CHUNK), dtype=torch.float32)
    kept, total = [], 0.0
    for start in range(0, n, CHUNK):
        piece = flat[start:start + CHUNK]
        sq = torch.square(piece.float(), out=buf[:piece.numel()]).numpy()
        total += float(np.sum(sq, dtype=np.float64))
        kept.append(sq[sq >= thr] if thr > 0 else sq[sq > 0])   # a copy: buf is overwritten next
    return (np.concatenate(kept) if kept else np.zeros(0, dtype=np.float32)), total


def topk_errors(comp: Compressor, densities: list[float], grad: Tensor) -> tuple[list[float], list[int]]:
    """Exact Top-k errors for every density: the error of keeping the k largest magnitudes is the
    sum of the remaining squares (same numbers as :func:`simulate_error`; :func:`topk_tails` says
    how they are found without sorting the layer)."""
    n = grad.numel()
    ks = [k_for(n, d) for d in densities]
    tails = topk_tails(grad, ks)
    sim = copy.copy(comp)  # only the density differs; a deep copy would clone its scratch buffers
    errs, sizes = [], []
    for d, k in zip(densities, ks):
        sim.set_density(d)
        errs.append(tails[k] if k < n else 0.0)
        sizes.append(int(sim.payload_bytes(grad.shape, grad.element_size())))
    return errs, sizes


@register("lgreco")
class LGreCoPolicy(Policy):
    """Layer-wise adaptive compression (Alg. 1) for topk-like, low-rank and qsgd compressors.

    * ``period``: steps between decisions; 0 = one epoch (``optimizer.steps_per_epoch`` when the
      training loop sets it, else the authors' ``adjust_freq`` of 100, with a warning).
    * ``warmup``: steps before the first decision (the paper uses the LR warm-up length).
    * ``alpha``: budget factor, ``E_max = alpha * error(uniform)`` (the code's ``adjust_alpha``, 1).
    * ``steps``: error discretisation D (10000, §4).
    * ``low`` / ``high`` / ``step``: candidate range override (0 = §5 defaults around D).
    * ``objective``: ``size`` (Formula 3) or ``time`` ("Optimizing for Time": size x per-bucket
      seconds-per-byte fitted from measured bucket sync times).
    * ``power_iters``: compress/decompress repetitions when simulating low-rank errors (code: 5).
    """

    def __init__(self, period: int = 0, warmup: int = 0, alpha: float = 1.0, steps: int = 10000,
                 low: float = 0.0, high: float = 0.0, step: float = 0.0, objective: str = "size",
                 power_iters: int = 5):
        for pname, v, lo in (("period", period, 0), ("warmup", warmup, 0), ("steps", steps, 1),
                             ("power_iters", power_iters, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{pname} must be an integer >= {lo}, got {v!r}")
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0 (budget = alpha x uniform error), got {alpha!r}")
        if min(low, high, step) < 0 or (high and low and high < low):
            raise ValueError(f"need 0 <= low <= high and step >= 0, got low={low}, high={high}, step={step}")
        if objective not in ("size", "time"):
            raise ValueError(f"objective must be 'size' or 'time', got {objective!r}")
        self.period, self.warmup, self.alpha, self.steps = period, warmup, float(alpha), steps
        self.low, self.high, self.step, self.objective = float(low), float(high), float(step), objective
        self.power_iters = power_iters
        self.layers: list[tuple[str, str, float]] = []      # (name, knob, uniform default)
        self.assignment: dict[str, float] = {}
        self.history: list[dict[str, float]] = []
        self._acc: dict[str, Tensor] = {}
        self._passes: dict[str, int] = {}
        self._sync: dict[int, list[float]] = {}

    # --- wiring -------------------------------------------------------------------------------------
    def attach(self, optimizer: "Host") -> None:
        super().attach(optimizer)
        self.rendezvous = Rendezvous.for_optimizer(optimizer, self.name)
        self.layers = []
        for name, p in optimizer.params:
            comp = optimizer.compressor_for(name)
            kind = knob_of(comp)
            if kind is None or (callable(getattr(comp, "compresses", None)) and not comp.compresses(p.shape)):
                continue
            if optimizer.is_fused(name):
                raise ValueError("policy lgreco sets one parameter per layer, but fusion.fuse_before_compress "
                                 "compresses whole buckets; set fusion.fuse_before_compress: false")
            self.layers.append((name, kind, float(get_knob(comp, kind))))
        if not self.layers:
            raise ValueError("policy lgreco found no layer whose compressor has a density, rank or bits "
                             "to adapt; use e.g. compressor: {name: topk} / powersgd / acpsgd / qsgd")
        if optimizer.backend.rank() == 0:  # only the deciding rank keeps accumulators (§4)
            for name, _, _ in self.layers:
                self._passes[name] = 0
            optimizer.observe_gradients(self._observe)

    def _observe(self, name: str, grad: Tensor) -> None:
        """The local gradient as backward produced it, before error feedback compensates it (§4
        accumulates raw gradients): the optimizer calls this ahead of its own work on ``name``."""
        if name not in self._passes:
            return
        self._passes[name] += 1
        if self._passes[name] % self.optimizer.backward_passes_per_step == 0:
            g = grad.detach()
            acc = self._acc.get(name)
            self._acc[name] = g.clone() if acc is None else acc.add_(g)

    def _period(self, optimizer: "Host") -> int:
        if self.period:
            return self.period
        per_epoch = getattr(optimizer, "steps_per_epoch", None)
        if per_epoch:
            return int(per_epoch)
        if not getattr(self, "_warned", False):
            log.warning("lgreco: period 0 means one epoch, but the optimizer has no steps_per_epoch; "
                        "using 100 steps (set policy.period to your steps per epoch)")
            self._warned = True
        return 100

    # --- the decision -----------------------------------------------------------------------------
    def after_step(self, optimizer: "Host", stats: StepStats) -> None:
        for b, t in stats.bucket_sync_s.items():
            self._sync.setdefault(b, []).append(t)
        s = optimizer.steps
        if s < max(self.warmup, 1) or (s - self.warmup) % self._period(optimizer) != 0:
            return
        # rank 0 decides on a helper thread while the others wait in short progress broadcasts:
        # the error simulations of a 100M-element layer outlast a collective timeout (issue 21)
        result = self.rendezvous.decide("the per-layer assignment", lambda: self.decide(optimizer))
        self.apply(optimizer, result["assignment"])
        self.history.append({k: v for k, v in result.items() if k != "assignment"})
        self._acc.clear()
        self._sync.clear()

    def bucket_cost(self, optimizer: "Host") -> dict[str, float]:
        """Per-layer T(l): mean sync seconds of its bucket per payload byte of that bucket."""
        per_layer = {name: 1.0 for name, _, _ in self.layers}
        if self.objective != "time" or not self._sync:
            return per_layer
        coef = {}
        for b in optimizer.buckets:
            nbytes = sum(optimizer.compressor_for(n).payload_bytes(optimizer.parameter(n).shape)
                         for n in b.names)
            times = self._sync.get(b.index)
            if times and nbytes:
                coef[b.index] = float(np.mean(times)) / nbytes
        if not coef or max(coef.values()) <= 0:
            return per_layer
        floor = 0.01 * max(coef.values())  # a hidden bucket still costs a little: keep size relevant
        for name in per_layer:
            per_layer[name] = max(coef.get(optimizer.bucket_of(name).index, floor), floor)
        return per_layer

    def decide(self, optimizer: "Host") -> dict[str, Any]:
        t0 = time.perf_counter()
        names = [n for n, _, _ in self.layers if n in self._acc]
        if not names:
            return {"assignment": {}, "step": optimizer.steps}
        cost = self.bucket_cost(optimizer)
        rows_err, rows_size, rows_obj, cands, uniform_idx = [], [], [], [], []
        for name, kind, default in self.layers:
            if name not in self._acc:
                continue
            comp = optimizer.compressor_for(name)
            vals = candidates(kind, default, self.low, self.high, self.step)
            es: Sequence[float]
            ss: Sequence[int]
            if comp.name == "topk":
                es, ss = topk_errors(comp, vals, self._acc[name])
            else:
                iters = self.power_iters if kind == "rank" else 1
                es, ss = zip(*(simulate_error(comp, kind, v, self._acc[name], name, iters) for v in vals))
            rows_err.append(list(es))
            rows_size.append([float(x) for x in ss])
            rows_obj.append([x * cost[name] for x in ss])
            cands.append(vals)
            uniform_idx.append(vals.index(min(vals, key=lambda v: abs(v - default))))
        t_err = time.perf_counter() - t0
        err, size = np.array(rows_err), np.array(rows_size)
        uni = [err[i, j] for i, j in enumerate(uniform_idx)]
        budget = self.alpha * float(np.sum(uni))
        try:  # errors counted from the uniform assignment: it stays feasible at alpha >= 1 (issue 32)
            pick = solve(err, np.array(rows_obj), budget, self.steps, default=uniform_idx)
        except ValueError:
            pick = list(uniform_idx)
        dense = sum(optimizer.parameter(n).numel() * optimizer.parameter(n).element_size() for n in names)
        return {"assignment": {n: cands[i][j] for i, (n, j) in enumerate(zip(names, pick))},
                "step": optimizer.steps, "budget": budget,
                "error": float(sum(err[i, j] for i, j in enumerate(pick))), "uniform_error": float(sum(uni)),
                "bytes": float(sum(size[i, j] for i, j in enumerate(pick))),
                "uniform_bytes": float(sum(size[i, j] for i, j in enumerate(uniform_idx))),
                "dense_bytes": float(dense), "error_s": t_err, "decision_s": time.perf_counter() - t0}

    def apply(self, optimizer: "Host", assignment: dict[str, float]) -> None:
        kinds = {n: k for n, k, _ in self.layers}
        for name, value in assignment.items():
            set_knob(optimizer.compressor_for(name), kinds[name], value)
        self.assignment.update(assignment)

    # --- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"assignment": dict(self.assignment), "history": list(self.history),
                "acc": {k: v.clone() for k, v in self._acc.items()}, "passes": dict(self._passes),
                "sync": {k: list(v) for k, v in self._sync.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = list(state.get("history", []))
        self._acc = {k: v.clone() for k, v in state.get("acc", {}).items()}
        self._passes.update(state.get("passes", {}))
        self._sync = {int(k): list(v) for k, v in state.get("sync", {}).items()}
        self.assignment = {}
        if state.get("assignment") and hasattr(self, "optimizer"):
            self.apply(self.optimizer, state["assignment"])

