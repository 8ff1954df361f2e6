"""Compression ratio as a multi-objective problem (AR-Topk paper §3-E, eq. 6), with pymoo NSGA-II.

Candidates ``c_high, c_high/f, ...`` down to ``c_low`` (defaults 0.1, 0.033, 0.011, 0.004, 0.001).
**Exploration runs over the next real training steps**, because a policy cannot drive the user's
loop: at a step boundary the policy takes ``optimizer.snapshot()`` (parameters, optimizer state,
residuals, compressor state; in memory), sets candidate 1 for the next ``explore_steps`` steps,
records its mean compression gain, compression time and sync time, ``restore()``s the snapshot,
moves to candidate 2, and so on; after the last candidate it restores once more, chooses
``c_optimal`` and training continues from the snapshot. The batches seen while exploring do not
train the final model (the paper's authors explore on held-out batches for the same effect).

Choice (rank 0, broadcast to all): NSGA-II over ``x = log10 c`` in ``[c_low, c_high]`` minimising
``(t_comp(c), t_sync(c), 1/gain(c))``. ``t_comp`` and ``1/gain`` interpolate the measurements
piecewise-linearly in ``log c``; ``t_sync`` is the alpha-beta prediction of the cheapest allowed
collective at the current probed alpha, beta (§3-D), so a network change re-optimises without
re-exploring. From the final Pareto set the point nearest the ideal point after normalising each
objective to [0, 1] over that set is taken (the compromise / knee solution; ties: larger c).

Triggers, checked every ``check_every`` steps: re-explore when the mean gain of the last window
moved by ``gain_threshold`` (10 %) relative to the previous window (not before ``cooldown`` steps
after a decision); re-optimise (and re-choose collectives) when alpha or beta moved by
``net_threshold`` relative to the values of the last decision (``|new-old| / max(new, old)``).
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Callable

from adacomp.engine.metrics import StepStats
from adacomp.policies.base import Policy, register
from adacomp.policies.rendezvous import Rendezvous
from adacomp.policies.flexible import FlexiblePolicy

if TYPE_CHECKING:
    from adacomp.policies.base import Host

log = logging.getLogger(__name__)


def candidate_densities(c_high: float = 0.1, c_low: float = 0.001, factor: float = 3.0) -> list[float]:
    """``c_high / factor**i`` for ``i < round(log_factor(c_high / c_low))``, then ``c_low``."""
    n = max(1, round(math.log(c_high / c_low) / math.log(factor)))
    return [c_high / factor ** i for i in range(n)] + [c_low]


def _pymoo():
    try:
        from pymoo.algorithms.moo.nsga2 import NSGA2
        from pymoo.core.problem import Problem
        from pymoo.optimize import minimize
    except ImportError as exc:  # pragma: no cover - pymoo is a declared dependency
        raise ImportError("policy 'moo' needs pymoo: pip install pymoo") from exc
    return NSGA2, Problem, minimize


def knee_index(F: Any, X: Any) -> int:
    """Row of ``F`` nearest the ideal point after per-objective min-max normalisation."""
    import numpy as np
    F = np.asarray(F, dtype=float)
    span = F.max(axis=0) - F.min(axis=0)
    norm = (F - F.min(axis=0)) / np.where(span > 0, span, 1.0)
    dist = np.sqrt((norm ** 2).sum(axis=1))
    order = sorted(range(len(F)), key=lambda i: (round(float(dist[i]), 12), -float(X[i][0])))
    return order[0]


def choose_density(densities: list[float], t_comp: list[float], inv_gain: list[float],
                   t_sync: Callable[[float], float], pop_size: int = 40, generations: int = 40,
                   seed: int = 1, t_sync_batch: Callable[[Any], Any] | None = None) -> tuple[float, Any, Any]:
    """NSGA-II over log10(c); returns ``(c_optimal, pareto X, pareto F)``. ``t_sync_batch``, when
    given, maps an array of densities to the array of ``t_sync`` values in one call (the same
    numbers, without a Python call per individual: issue 21)."""
    import numpy as np
    NSGA2, Problem, minimize = _pymoo()
    order = sorted(range(len(densities)), key=lambda i: densities[i])
    xs = np.log10([densities[i] for i in order])
    tc = np.asarray([t_comp[i] for i in order], dtype=float)
    ig = np.asarray([inv_gain[i] for i in order], dtype=float)

    class _CR(Problem):  # type: ignore[valid-type, misc]  # pymoo's Problem, imported lazily
        def __init__(self) -> None:
            super().__init__(n_var=1, n_obj=3, xl=np.array([xs[0]]), xu=np.array([xs[-1]]))

        def _evaluate(self, X: Any, out: dict, *args: Any, **kwargs: Any) -> None:
            x = X[:, 0]
            cs = [10.0 ** v for v in x]  # Python's pow, as before: numpy's may differ in the last bit
            ts = np.asarray(t_sync_batch(np.array(cs)), dtype=float) if t_sync_batch is not None \
                else np.array([t_sync(c) for c in cs])
            out["F"] = np.stack([np.interp(x, xs, tc), ts, np.interp(x, xs, ig)], axis=1)

    res = minimize(_CR(), NSGA2(pop_size=pop_size), ("n_gen", generations), seed=seed, verbose=False)
    X, F = np.atleast_2d(res.X), np.atleast_2d(res.F)
    i = knee_index(F, X)
    c = float(min(max(10.0 ** X[i, 0], densities[order[0]]), densities[order[-1]]))
    return c, X, F


def _moved(new: float, old: float) -> float:
    top = max(abs(new), abs(old))
    return abs(new - old) / top if top > 0 else 0.0


@register("moo")
class MOOPolicy(Policy):
    """Adaptive compression ratio (§3-E) with the flexible collective choice (§3-D) inside.

    ``c_high`` / ``c_low`` / ``factor``: candidate densities. ``explore_steps``: real steps per
    candidate (10). ``gain_threshold``: relative gain change that re-explores (0.1).
    ``net_threshold``: relative alpha / beta change that re-optimises (0.5). ``check_every``: steps
    between trigger checks (one small broadcast each). ``cooldown``: steps after a decision before
    the gain trigger may fire. ``probe_every`` / ``probe_bytes``: alpha / beta probe period and size. ``switching``: let the
    cost model switch AG / AR-Topk per bucket (False: keep the configured communicator).
    ``pop_size`` / ``generations`` / ``seed``: NSGA-II.
    """

    reads_gain = True  # the 1/gain objective and the gain trigger

    def __init__(self, c_high: float = 0.1, c_low: float = 0.001, factor: float = 3.0, explore_steps: int = 10,
                 gain_threshold: float = 0.1, net_threshold: float = 0.5, check_every: int = 10,
                 cooldown: int = 50, probe_every: int = 100, probe_bytes: int = 1 << 20, switching: bool = True,
                 selection: str = "star",
                 pop_size: int = 40, generations: int = 40, seed: int = 1):
        if not 0 < c_low < c_high <= 1:
            raise ValueError(f"need 0 < c_low < c_high <= 1, got c_low={c_low}, c_high={c_high}")
        if factor <= 1:
            raise ValueError(f"factor must be > 1, got {factor}")
        if math.log(c_high / c_low) / math.log(factor) > 50:
            raise ValueError(f"factor {factor} gives more than 50 candidate densities between c_low={c_low} and "
                             f"c_high={c_high}; use a larger factor (the paper uses 3)")
        for name, v in (("explore_steps", explore_steps), ("check_every", check_every),
                        ("pop_size", pop_size), ("generations", generations)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if gain_threshold <= 0 or net_threshold <= 0:
            raise ValueError(f"gain_threshold and net_threshold must be > 0, got {gain_threshold}, {net_threshold}")
        self.candidates = candidate_densities(c_high, c_low, factor)
        self.explore_steps, self.check_every, self.cooldown = explore_steps, check_every, max(0, cooldown)
        self.gain_threshold, self.net_threshold = gain_threshold, net_threshold
        self.nsga = {"pop_size": pop_size, "generations": generations, "seed": seed}
        self.switching = switching
        self.flex = FlexiblePolicy(probe_every=probe_every, selection=selection, probe_bytes=probe_bytes)
        self.density: float | None = None
        self.results: list[dict[str, float]] = []
        self.decisions: list[dict[str, Any]] = []
        self._snap: dict | None = None
        self._cand = -1
        self._acc: list[tuple[float, float, float]] = []
        self._window: list[float] = []
        self._prev_gain: float | None = None
        self._since = 0
        self._ref_net: tuple[float, float] | None = None
        self._restoring = False
        self._calls = 0

    @property
    def exploring(self) -> bool:
        return self._snap is not None

    def attach(self, optimizer: "Host") -> None:
        super().attach(optimizer)
        self.rendezvous = Rendezvous.for_optimizer(optimizer, self.name)
        if self.switching:
            self.flex.attach(optimizer)
        else:
            self.flex.optimizer = optimizer
            self.flex.probe.probe(optimizer.backend, 0)

    # -------------------------------------------------------------- per step
    def after_step(self, optimizer: "Host", stats: StepStats) -> None:
        if self.switching:
            self.flex.after_step(optimizer, stats)
        else:  # no switching: keep probing for t_sync predictions (own counter: restore rewinds steps)
            self._calls += 1
            self.flex.probe.maybe_probe(optimizer.backend, self._calls)
        if self._snap is not None:
            self._explore_step(optimizer, stats)
            return
        if not self.results:  # first step boundary: explore (not at attach: params may be broadcast later)
            self._start_exploration(optimizer)
            return
        if stats.gain is not None:
            self._window.append(stats.gain)
        self._since += 1
        if self._since % self.check_every:
            return
        msg = self.rendezvous.decide("the trigger check", lambda: self._triggers(optimizer))
        if msg and msg["action"] == "explore":
            self._start_exploration(optimizer)
        elif msg and msg["action"] == "reoptimise":
            self._apply(optimizer, msg["c"], "network")

    def _triggers(self, optimizer: "Host") -> dict[str, Any] | None:
        est = self.flex.probe.last
        if est is not None and self._ref_net is not None and \
                max(_moved(est.alpha, self._ref_net[0]), _moved(est.beta, self._ref_net[1])) >= self.net_threshold:
            return {"action": "reoptimise", "c": self._optimise(optimizer)}
        if not self._window:
            return None
        g = sum(self._window) / len(self._window)
        self._window = []
        prev, self._prev_gain = self._prev_gain, g
        if prev and self._since >= self.cooldown and abs(g - prev) / prev >= self.gain_threshold:
            return {"action": "explore"}
        return None

    # -------------------------------------------------------------- exploration
    def _set(self, optimizer: "Host", c: float) -> None:
        optimizer.set_density(c)
        self.density = c
        if self.switching:
            self.flex.update(optimizer)

    def _start_exploration(self, optimizer: "Host") -> None:
        self._snap = optimizer.snapshot()
        self.results, self._cand, self._acc = [], 0, []
        self._set(optimizer, self.candidates[0])

    def _restore(self, optimizer: "Host") -> None:
        self._restoring = True  # restore() reloads policy state too: keep our progress
        try:
            optimizer.restore(self._snap)  # type: ignore[arg-type]
        finally:
            self._restoring = False

    def _explore_step(self, optimizer: "Host", stats: StepStats) -> None:
        self._acc.append((stats.gain if stats.gain is not None else 1.0, stats.compress_s, stats.comm_s))
        if len(self._acc) < self.explore_steps:
            return
        n = len(self._acc)
        c = self.candidates[self._cand]
        self.results.append({"c": c, "gain": sum(a[0] for a in self._acc) / n,
                             "t_comp": sum(a[1] for a in self._acc) / n, "t_sync": sum(a[2] for a in self._acc) / n,
                             "t_sync_predicted": self.flex.predict_total(optimizer, c, self.switching)})
        self._restore(optimizer)
        self._cand += 1
        self._acc = []
        if self._cand < len(self.candidates):
            self._set(optimizer, self.candidates[self._cand])
            return
        self._snap = None
        # NSGA-II runs on rank 0 while the others wait in short progress broadcasts (issue 21)
        self._apply(optimizer, self.rendezvous.decide("the density optimisation", lambda: self._optimise(optimizer)),
                    "exploration")

    def _optimise(self, optimizer: "Host") -> float:
        r = self.results
        c, _, F = choose_density([x["c"] for x in r], [x["t_comp"] for x in r],
                                 [1.0 / max(x["gain"], 1e-12) for x in r],
                                 lambda d: self.flex.predict_total(optimizer, d, self.switching),
                                 t_sync_batch=self.flex.sync_predictor(optimizer, self.switching), **self.nsga)
        self._front_size = len(F)
        return c

    def _apply(self, optimizer: "Host", c: float, reason: str) -> None:
        self._set(optimizer, float(c))
        est = self.flex.probe.last
        self._ref_net = (est.alpha, est.beta) if est else None
        self._window, self._prev_gain, self._since = [], None, 0
        self.decisions.append({"step": optimizer.steps, "c": float(c), "reason": reason,
                               "alpha": est.alpha if est else 0.0, "beta": est.beta if est else 0.0})
        log.info("moo: step %d density %.4g (%s)", optimizer.steps, c, reason)

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything the next steps read: the density and results, an exploration in progress (its
        snapshot, the candidate being tried, what it measured so far) and the triggers' counters, so a
        run saved at any step resumes as the run it was saved from."""
        return {"density": self.density, "results": [dict(x) for x in self.results],
                "decisions": [dict(d) for d in self.decisions], "snapshot": self._snap, "candidate": self._cand,
                "measured": [list(a) for a in self._acc], "window": list(self._window),
                "prev_gain": self._prev_gain, "since": self._since,
                "ref_net": list(self._ref_net) if self._ref_net is not None else None, "calls": self._calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._restoring or not state:
            return
        self.results = [dict(x) for x in state.get("results", [])]
        self.decisions = [dict(d) for d in state.get("decisions", [])]
        self._snap = state.get("snapshot")
        self._cand = int(state.get("candidate", -1))
        self._acc = [(float(a[0]), float(a[1]), float(a[2])) for a in state.get("measured", [])]
        self._window = [float(g) for g in state.get("window", [])]
        prev = state.get("prev_gain")
        self._prev_gain = float(prev) if prev is not None else None
        self._since = int(state.get("since", 0))
        ref = state.get("ref_net")
        self._ref_net = (float(ref[0]), float(ref[1])) if ref is not None else None
        self._calls = int(state.get("calls", 0))
        if state.get("density") is not None:
            self._set(self.optimizer, float(state["density"]))
