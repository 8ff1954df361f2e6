"""SIDCo: thresholds from sparsity-inducing distributions fitted in several stages.

Abdelmoniem, Elzanaty, Alouini and Canini, "An Efficient Statistical-based Gradient Compression
Technique for Distributed Training Systems" (MLSys 2021), as summarised in ADTopk §2.2 ("fits some
sparsity-inducing distributions ... multi-stage fitting"). With a = |g|:

* single stage: fit a distribution to a and take the quantile whose upper tail has mass delta:
  exponential (MLE scale mu = mean a): eta = -mu ln delta; generalised Pareto (moments: mean mu,
  variance s^2, kappa = (mu^2/s^2 - 1)/2, scale = mu (mu^2/s^2 + 1)/2): eta = scale (1 - delta^kappa)
  / kappa; gamma (approximate MLE of the shape from s = ln mean a - mean ln a): eta = upper-tail
  quantile via the regularised incomplete gamma inverse (the error-compensated variant of the
  authors' code; scipy).
* multi-stage: split delta = prod of M equal per-stage ratios delta^(1/M); stage m fits the
  exceedances of stage m-1 shifted by the previous threshold (peaks over threshold) and adds its
  quantile. ``gamma`` fits the first stage only and uses generalised Pareto for the exceedances,
  the paper's SIDCo-GP, because exceedances over a high threshold are generalised-Pareto.
* adaptive stages: every ``adapt_every`` (Q = 5 in the authors' code) calls the mean log ratio of
  achieved to target count is checked; outside +-``tolerance`` (0.2) the number of stages moves one
  step, within [1, ceil(log delta / log 0.5)] as in the authors' code. The paper's Algorithm 1
  starts from ``stages`` (1 in the authors' run scripts).

Deviations: the adaptive state is kept per tensor name (the authors' code shares one class-level
counter across layers). The direction of a stage change is read from the errors measured at
neighbouring stage counts, and the count stays put when the target lies between two counts,
because more stages *raise* the count for light tails (Gaussian under an exponential fit) and
*lower* it for heavy ones (Student-t): a fixed direction cycles, as measured in
tests/test_threshold_sparsifiers.py; the first stage uses delta^(1/M), not the authors' code's fixed
first ratio 0.25; fits run on |g| without dividing by ||g||_2 (all three fits are scale
equivariant, so the selection is the same). At least one element is always sent.

Payload ``[values, indices]`` of variable size; biased: pair with ``residual``. Communicators:
``allgather``.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from adacomp.compressors import _native
from adacomp.compressors.base import register
from adacomp.compressors.sparse import (Magnitudes, SparseCompressor, ThresholdCounter, compensate_with_stats, k_for,
                                        search_share)

_EPS = 1e-12
STALE_WINDOWS = 10  # a stage count's measured error is forgotten after this many windows
CANDIDATES_MAX = 0.15  # the largest share error feedback's add keeps as candidates for the fits
TAIL_MARGIN = 0.8  # a later fit keeps what passes this share of the way to where the next threshold lay last step


def _mean(x: Tensor, mean: float | None) -> float:
    return float(x.mean()) if mean is None else mean


def exponential_quantile(x: Tensor, ratio: float, mean: float | None = None) -> float:
    """``mean``: ``float(x.mean())`` when the caller has it already (from the magnitudes pass)."""
    return -_mean(x, mean) * math.log(ratio)


def gpareto_quantile(x: Tensor, ratio: float, mean: float | None = None) -> float:
    mu, var = _mean(x, mean), float(x.var()) if x.numel() > 1 else 0.0
    if var <= 0.0 or mu <= 0.0:
        return -mu * math.log(ratio)
    q = mu * mu / var
    kappa, scale = 0.5 * (q - 1.0), 0.5 * mu * (q + 1.0)
    if abs(kappa) < 1e-6:  # the exponential limit
        return -scale * math.log(ratio)
    return scale * (1.0 - ratio ** kappa) / kappa


def gamma_quantile(x: Tensor, ratio: float, mean: float | None = None) -> float:
    try:
        from scipy.special import gammaincinv
    except ImportError as exc:  # pragma: no cover - scipy ships with scikit-learn
        raise ImportError("sidco with distribution='gamma' needs scipy: pip install scipy") from exc
    mu = _mean(x, mean)
    s = math.log(max(mu, _EPS)) - float(torch.log(x + _EPS).mean())
    if s <= 0.0 or mu <= 0.0:
        return exponential_quantile(x, ratio, mu)
    shape = (3.0 - s + math.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)
    return mu / shape * float(gammaincinv(shape, 1.0 - ratio))


Quantile = Callable[..., float]
"""``(x, ratio, mean=None) -> threshold``: ``mean`` is ``float(x.mean())`` when already known."""
# distribution -> (first-stage fit, later-stage fit on the exceedances)
FITS: dict[str, tuple[Quantile, Quantile]] = {
    "exponential": (exponential_quantile, exponential_quantile),
    "gpareto": (gpareto_quantile, gpareto_quantile),
    "gamma": (gamma_quantile, gpareto_quantile),
}


class NativeChoice:
    """Switch of :meth:`SIDCoCompressor.choose`'s one C call (``_native.sidco_choose``); off, the chain
    of calls it stands for runs (the same answers: tests and ``bench cost cell --toggle`` flip it)."""
    on = True


@register("sidco")
class SIDCoCompressor(SparseCompressor):
    """Multi-stage distribution fitting (SIDCo-E / -P / -GP) with adaptive stage count.

    ``density``: target ratio delta (ADTopk §6 setting 0.01; SIDCo's scripts use 0.001).
    ``distribution``: ``exponential`` (SIDCo-E), ``gpareto`` (SIDCo-P) or ``gamma`` (SIDCo-GP).
    ``stages``: initial number of fitting stages M (at most ceil(log2(1 / density))).
    ``adaptive``: adapt M (paper Alg. 1).
    ``adapt_every``: calls per adaptation window (Q). ``tolerance``: accepted relative error.
    """

    def __init__(self, density: float = 0.01, distribution: str = "exponential", stages: int = 1,
                 adaptive: bool = True, adapt_every: int = 5, tolerance: float = 0.2):
        super().__init__(density)
        if distribution not in FITS:
            raise ValueError(f"distribution must be one of {sorted(FITS)}, got {distribution!r}")
        if not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages must be an int >= 1, got {stages!r}")
        if adapt_every < 1:
            raise ValueError(f"adapt_every must be >= 1, got {adapt_every!r}")
        if not 0.0 < tolerance < 1.0:
            raise ValueError(f"tolerance must be in (0, 1), got {tolerance!r}")
        self.distribution = distribution
        self.stages = stages
        self.adaptive = bool(adaptive)
        self.adapt_every = int(adapt_every)
        self.tolerance = float(tolerance)
        # per tensor name: stages, running window sum / count, window index, {stages: [error, window]}
        self._state: dict[str, dict[str, Any]] = {}
        # per tensor name: its last fit's stages and the shares its first stage and its selection passed, hints of
        # the next step's sizes (not state: a wrong guess costs a pass, never another answer; on
        # real gradients the one-stage fit's first window passes up to ~10x the density)
        self._fit_shares: dict[str, tuple[int, float, float]] = {}
        # per tensor name: its last fit's stages, per later stage (shifted mean / first fit's mean,
        # count passing, count kept), and the count passing its first threshold (hints, not state)
        self._tails: dict[str, tuple[int, list[tuple[float, int, int]], int]] = {}

    def max_stages(self) -> int:
        """Upper bound on stages, ceil(log2(1 / density)) as in the authors' code."""
        return max(1, math.ceil(math.log(self._density) / math.log(0.5)))

    def set_density(self, density: float) -> None:
        super().set_density(density)
        for st in self._state.values():  # errors measured at the old target no longer apply
            st.update(sum=0.0, n=0, seen={}, stages=min(st["stages"], self.max_stages()))
        self._tails.clear()

    def threshold(self, a: Tensor, stages: int, counter: ThresholdCounter | None = None,
                  mean: float | None = None, name: str | None = None) -> float:
        """``mean``: ``float(a.mean())`` when already known (the first stage's fit reads it).
        ``name``: the tensor's, whose last fit's later stages (:attr:`_tails`) say where each next
        threshold is expected, so SIDCo-E's later fits keep only what can pass it
        (:meth:`ThresholdCounter.shifted_mean_keep`; a wrong guess costs a pass, never another answer)."""
        first, later = FITS[self.distribution]
        ratio = self._density ** (1.0 / stages)
        thr = first(a, ratio, mean)
        m1 = mean if mean is not None else 0.0  # the first fit's mean (SIDCo-E's), which scales the hints
        tails = (self.one_read_stages and counter is not None and later is exponential_quantile and counter.native
                 and bool(counter.prefix))
        if counter is not None and stages > 1 and not tails:
            # keep the first stage's exceedances (signed, where the counter reads |g| from g): the later
            # stages' thresholds and the final selection with its values are answered from them
            # instead of passes over the whole tensor and a gather of the payload's values
            counter.compact(thr, ratio, signed=True)
        last = self._tails.get(name) if name is not None else None
        hints = last[1] if last is not None and last[0] == stages else []
        seen: list[tuple[float, int, int]] = []
        passed = -1  # how many passed the first threshold (-1: not counted)
        for s in range(stages - 1):
            if counter is not None and later is exponential_quantile:  # the fit reads only their shifted mean
                got = None
                if tails:
                    margin, expect, share = self._tail_hint(a.numel(), ratio, m1, s, hints)
                    got = counter.shifted_mean_keep(thr, thr + margin, expect, share)
                count, mean = got if got is not None else counter.shifted_mean(thr, ratio)
                passed = count if s == 0 else passed
                if count < 2:
                    break
                kept = counter.vals.numel() if counter.vals is not None else 0
                seen.append((mean / m1 if m1 > 0 else 0.0, count, kept))
                thr = thr + exponential_quantile(a, ratio, mean)
                continue
            tail = counter.values(thr) if counter is not None else a[a > thr]
            passed = tail.numel() if s == 0 else passed
            if tail.numel() < 2:
                break
            thr = thr + later(tail - thr, ratio)
        if name is not None:  # (the other way's kept sets say nothing of this one's: its hints stay)
            self._tails[name] = (stages, seen, passed) if tails or last is None else (*last[:2], passed)
        return thr

    def _tail_hint(self, n: int, ratio: float, m1: float, s: int,
                   hints: list[tuple[float, int, int]]) -> tuple[float, int, float]:
        """Later stage ``s``'s floor as its distance above the stage's threshold (``TAIL_MARGIN`` of
        the last step's distance to the next threshold, as a multiple of the first fit's mean ``m1``;
        0 without one), the count expected to pass the threshold and the share of the tensor
        expected to pass the floor."""
        if s < len(hints):
            rho, count, kept = hints[s]
            step = -math.log(ratio) * rho * m1
            if step > 0.0 and math.isfinite(step):
                return TAIL_MARGIN * step, count, 1.25 * kept / n
        return 0.0, int(n * ratio ** (s + 1)), 1.25 * ratio ** (s + 1)

    def _slope(self, seen: dict[int, list[float]], s: int) -> int:
        """+1 if more stages pass more elements here, -1 if fewer; from the nearest other stage count
        measured recently (+1, the light-tail case, before any comparison exists)."""
        others = [j for j in seen if j != s]
        if not others:
            return 1
        j = min(others, key=lambda o: (abs(o - s), o))
        d = (seen[j][0] - seen[s][0]) * (j - s)
        return 1 if d >= 0 else -1

    def _adapt(self, st: dict[str, Any], count: int, k: int) -> None:
        st["sum"] += math.log(max(count, 1) / k)
        st["n"] += 1
        if st["n"] < self.adapt_every:
            return
        err = st["sum"] / st["n"]
        st["sum"], st["n"] = 0.0, 0
        st["window"] += 1
        s, seen = int(st["stages"]), st["seen"]
        seen[s] = [err, st["window"]]
        for j in [j for j, (_, w) in seen.items() if st["window"] - w > STALE_WINDOWS]:
            del seen[j]
        if abs(err) <= math.log1p(self.tolerance):
            return
        slope = self._slope(seen, s)
        nxt = s + (slope if err < 0 else -slope)  # too few elements -> the way that adds elements
        if not 1 <= nxt <= self.max_stages():
            nxt = 2 * s - nxt  # at a bound: the untried other side, if any
            if not 1 <= nxt <= self.max_stages() or nxt in seen:
                return
        other = seen.get(nxt)
        if other is not None and other[0] * err < 0 and abs(other[0]) >= abs(err):
            return  # the target lies between s and nxt and s is the closer one
        st["stages"] = nxt

    search_strict = True  # its counts are of |g| > thr
    one_read_stages = True
    """SIDCo-E's later stages each in one read (:meth:`ThresholdCounter.shifted_mean_keep`); False: the
    first stage's exceedances kept and read per stage, the way without the C passes (the same answers;
    ``adacomp bench cost cell --toggle`` times both)."""

    def compensate_into(self, g: Tensor, r: Tensor, out: Tensor, name: str) -> bool:
        """SIDCo-E's first fit reads only |g|'s mean: error feedback's add gives it (and max, argmax)
        from the same pass (:func:`compensate_with_stats`), and |g| is never written. The add also
        keeps the elements passing a sampled floor aimed at a little more than the share the
        tensor's first fit passed last time (:meth:`_share`), so the fit's pass (the selection, or
        the later stages' compaction) reads those instead of the tensor where its threshold lies
        above that floor (a full pass otherwise, as without them: the same answers). The other fits
        read |g| whole (its variance, its logarithms): the caller adds."""
        return self._compensate(g, r, out, name, None)

    def _compensate(self, g: Tensor, r: Tensor, out: Tensor, name: str, zeroed: Tensor | None) -> bool:
        if self.distribution != "exponential":
            return False
        share = self._share(name)
        return compensate_with_stats(self, g, r, out, name, compact=share is not None, share=share, zeroed=zeroed)

    def defers_zeroing(self, tensor: Tensor) -> bool:
        return self.distribution == "exponential"

    def compensate_zeroed(self, g: Tensor, r: Tensor, out: Tensor, name: str, zeroed: Tensor) -> bool:
        return self._compensate(g, r, out, name, zeroed)

    def _share(self, name: str) -> float | None:
        """The share of tensor ``name`` the add keeps as candidates: 1.25 times what its first fit
        passed last time (before any, or with another number of stages since: ``density ** (1 /
        stages)``, what the fit aims at), at least
        :func:`search_share` of the density (a fit's threshold moves between steps); None where that exceeds
        :data:`CANDIDATES_MAX` (writing the candidates would cost about the read they save)."""
        st = self._state.get(name)
        stages = int(st["stages"]) if st is not None else min(self.stages, self.max_stages())
        passed = self._fit_shares.get(name)
        first = 1.25 * passed[1] if passed is not None and passed[0] == stages else self._density ** (1 / stages)
        share = max(search_share(self._density, self.search_factor), first)
        return share if share <= CANDIDATES_MAX else None

    def select(self, flat: Tensor, name: str) -> Tensor:
        return self.choose(flat, name)[0]

    def choose(self, flat: Tensor, name: str) -> tuple[Tensor, Tensor | None]:
        """The selection, with its values where the kept candidates carry them signed."""
        k = k_for(flat.numel(), self._density)
        if k >= flat.numel():
            return torch.arange(flat.numel(), device=flat.device), None
        ws = self._workspace()
        # SIDCo-E reads the mean of |g| and then counts: on g itself with absolute answers where the C
        # passes serve (|g| not written); the other fits read |g| whole, written in a reused buffer
        mag = Magnitudes(flat, ws, write=self.distribution != "exponential", known=self._kept().take(name, flat))
        st = self._state.setdefault(name, {"stages": min(self.stages, self.max_stages()), "sum": 0.0, "n": 0,
                                           "window": 0, "seen": {}})
        stages = int(st["stages"])
        last = self._fit_shares.get(name, (0, 0.0, 0.0))[2]
        share = max(self._density, 1.25 * last)  # a guess of its size: a short one costs a pass
        got = self._one_call(flat, name, mag, stages, share)
        vals: Tensor | None
        if got is not None:
            idx, vals = got.idx, got.vals
        else:
            a = mag.a if mag.a is not None else flat
            counter = ThresholdCounter(a, True, ws, absolute=mag.a is None)  # scratch mask; stages' thresholds vary
            cands = mag.candidates(strict=True)
            if cands is not None:  # the add's candidates: a threshold above their floor reads them alone
                counter.adopt(*cands, signed=True)
            thr = self.threshold(a, stages, counter, mag.mean(), name)
            picked = counter.pick(thr, share)
            idx, vals = picked if picked is not None else (counter.select(thr, share), None)
        n = flat.numel()
        # the first fit's pass: what passed its threshold, else (one stage) the selection itself
        passed = self._tails[name][2]
        kept = passed if stages > 1 and passed >= 0 else idx.numel()
        self._fit_shares[name] = (stages, kept / n, idx.numel() / n)
        if self.adaptive:
            self._adapt(st, idx.numel(), k)
        return (idx, vals) if idx.numel() else (mag.argmax(), None)

    def _one_call(self, flat: Tensor, name: str, mag: Magnitudes, stages: int,
                  share: float) -> _native.SIDCoChoice | None:
        """SIDCo-E's :meth:`threshold` and pick in one C call (:func:`_native.sidco_choose`), with its
        hints for the next step kept as :meth:`threshold` keeps them; None where the chain runs
        (:class:`NativeChoice` off, other fits, |g| written, a case the C leaves to it)."""
        if not (NativeChoice.on and mag.a is None and self.one_read_stages and self.distribution == "exponential"):
            return None
        n, m1 = flat.numel(), mag.mean()
        ratio = self._density ** (1.0 / stages)
        last = self._tails.get(name)
        hints = last[1] if last is not None and last[0] == stages else []
        plan = [self._tail_hint(n, ratio, m1, s, hints) for s in range(stages - 1)]
        got = _native.sidco_choose(flat, mag.candidates(strict=True), exponential_quantile(flat, ratio, m1),
                                   math.log(ratio), [p[0] for p in plan], [p[1] for p in plan],
                                   [p[2] for p in plan], share)
        if got is not None:
            seen = [(mean / m1 if m1 > 0 else 0.0, count, kept) for mean, count, kept in got.stages]
            self._tails[name] = (stages, seen, seen[0][1] if seen else -1)
        return got

    def stages_for(self, name: str) -> int:
        """Current number of fitting stages of tensor ``name`` (``stages`` before its first call)."""
        return int(self._state[name]["stages"]) if name in self._state else self.stages

    def state_dict(self) -> dict[str, Any]:
        return {"per_tensor": {n: {**st, "seen": {j: list(v) for j, v in st["seen"].items()}}
                               for n, st in self._state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = {n: {"stages": int(st["stages"]), "sum": float(st["sum"]), "n": int(st["n"]),
                           "window": int(st["window"]),
                           "seen": {int(j): [float(v[0]), int(v[1])] for j, v in st["seen"].items()}}
                       for n, st in state.get("per_tensor", {}).items()}

    def __repr__(self) -> str:
        return (f"SIDCoCompressor(density={self._density}, distribution={self.distribution!r}, "
                f"stages={self.stages}, adaptive={self.adaptive})")
