"""ByteComp: which tensors to compress, where, and with which scheme (bytecomp.txt §4).

Pure parts: empirical time models (§4.3), Alg. 1 (device compression decisions, §4.4.2: sort by
size then closeness to the output layer, drop uncompressed tensors sent before bubbles, best option
per tensor by simulated iteration time), Alg. 2 (CPU offload, Lemma 1 / Theorem 1) and a brute
force for checking. The timeline itself is :mod:`adacomp.policies.timeline`. The policy
(:class:`ByteCompPolicy`) profiles a few uncompressed steps, decides on rank 0, broadcasts the plan
and routes every tensor through the optimizer: dense on ``allreduce``, compressed on the indivisible
scheme (``allgather``) or the divisible one (``alltoall``, then ``allgather``), compressed inline or
on the optimizer's CPU worker thread (``offload``).
"""
from __future__ import annotations

import itertools
import math
import time
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from torch import Tensor

from adacomp.config import ComponentSpec
from adacomp.engine.metrics import StepStats
from adacomp.policies.base import Policy, register
from adacomp.policies.timeline import (ALL_OPTIONS, CPU_A2A, CPU_AG, DEVICE_A2A, DEVICE_AG, NONE, CostModel,
                                       Option, Point, TensorProfile, cost_model, fit_times, measure_compressor,
                                       simulate, size_grid)
from adacomp.policies.rendezvous import Rendezvous

if TYPE_CHECKING:
    from adacomp.policies.base import Host


# --- Alg. 1: device compression decisions -------------------------------------------------------
def _remove(tensors: Sequence[TensorProfile], S: list[Option], model: CostModel, removed: set[int]) -> float:
    """Remove() (Alg. 1 line 12-13, Property #1): uncompressed tensors whose communication ends
    before a bubble gain nothing from compression. Returns F(S) of the simulated timeline."""
    tl = simulate(tensors, S, model)
    if tl.bubbles:
        last_gap = tl.bubbles[-1][0]
        removed.update(i for i, o in enumerate(S) if not o.compressed and tl.comm_end[i] <= last_gap + 1e-15)
    return tl.iteration_s


def decide_device(tensors: Sequence[TensorProfile], model: CostModel,
                  options: Sequence[Option] = (DEVICE_AG,), candidates: set[int] | None = None) -> list[Option]:
    """Alg. 1. ``candidates``: tensor indices that may be compressed (others stay uncompressed)."""
    S = [NONE] * len(tensors)
    cand = set(range(len(tensors))) if candidates is None else set(candidates)
    # line 2-3: descending size; within a size, closest to the "output layer" first. ByteComp's
    # output layer is "the last layer during backward propagation" (§4.4.2 Property #2), i.e. the
    # largest backward index here.
    order = sorted(cand, key=lambda i: (-tensors[i].nbytes, -i))
    removed: set[int] = set()
    best_f = _remove(tensors, S, model, removed)
    for idx in order:
        if idx in removed:
            continue
        for opt in options:                                   # GetBestOption, lines 14-21
            trial = list(S)
            trial[idx] = opt
            f = simulate(tensors, trial, model).iteration_s
            if f < best_f - 1e-15:
                best_f, S = f, trial
        best_f = _remove(tensors, S, model, removed)         # line 8
    return S


# --- Alg. 2: CPU offload (Lemma 1, Theorem 1) ---------------------------------------------------
def decide_offload(tensors: Sequence[TensorProfile], model: CostModel, S: Sequence[Option],
                   max_combinations: int = 200_000) -> list[Option]:
    """Alg. 2: group device-compressed tensors by (size, option); by Lemma 1 only how many of each
    group go to the CPU matters, and those are the ones farthest from the output layer (earliest in
    backward). Enumerates
    every U = (u_1..u_d), O(prod(|G_i| + 1)) simulations (Theorem 1); above ``max_combinations``
    it falls back to coordinate descent over the u_i (stated deviation, keeps decisions fast)."""
    groups: dict[tuple[float, Option], list[int]] = {}
    for i, o in enumerate(S):
        if o.where == "device":
            groups.setdefault((tensors[i].nbytes, o), []).append(i)
    if not groups:
        return list(S)
    # farthest from the output layer (= the last layer of backward, Property #2) first: the
    # tensors ready earliest, whose CPU compression has the most computation left to overlap
    members = [sorted(g) for g in groups.values()]
    to_cpu = {DEVICE_AG: CPU_AG, DEVICE_A2A: CPU_A2A}

    def strategy(U: Sequence[int]) -> list[Option]:
        out = list(S)
        for g, u in zip(members, U):
            for i in g[:u]:
                out[i] = to_cpu[out[i]]
        return out

    total = int(np.prod([len(g) + 1 for g in members], dtype=float))
    if total <= max_combinations:
        best = min(itertools.product(*[range(len(g) + 1) for g in members]),
                   key=lambda U: simulate(tensors, strategy(U), model).iteration_s)
        return strategy(best)
    U = [0] * len(members)
    best_f = simulate(tensors, strategy(U), model).iteration_s
    improved = True
    while improved:
        improved = False
        for gi, g in enumerate(members):
            for u in range(len(g) + 1):
                trial = U[:gi] + [u] + U[gi + 1:]
                f = simulate(tensors, strategy(trial), model).iteration_s
                if f < best_f - 1e-15:
                    best_f, U, improved = f, trial, True
    return strategy(U)


def refine(tensors: Sequence[TensorProfile], model: CostModel, S: Sequence[Option],
           options: Sequence[Option], candidates: set[int] | None = None, sweeps: int = 2,
           deadline: float = math.inf) -> list[Option]:
    """adacomp's addition after Alg. 2 (not in the paper): up to ``sweeps`` passes that try every
    option on one tensor at a time (Alg. 1's order) and keep any that lowers F(S). It can revisit
    Alg. 1's early choices and put on the CPU a tensor Alg. 1 left dense; it never makes F worse.
    It stops early at ``deadline`` (a ``time.perf_counter()`` value): the polish is optional work
    and must not push the decision past the paper's range (issue 21)."""
    S = list(S)
    f = simulate(tensors, S, model).iteration_s
    cand = range(len(tensors)) if candidates is None else candidates
    order = sorted(cand, key=lambda i: (-tensors[i].nbytes, -i))
    for _ in range(sweeps):
        improved = False
        for i in order:
            if time.perf_counter() > deadline:
                return S
            for o in options:
                if o == S[i]:
                    continue
                trial = S[:i] + [o] + S[i + 1:]
                g = simulate(tensors, trial, model).iteration_s
                if g < f - 1e-15:
                    f, S, improved = g, trial, True
        if not improved:
            break
    return S


def decide(tensors: Sequence[TensorProfile], model: CostModel, divisible: bool = False, offload: bool = True,
           candidates: set[int] | None = None, polish: bool = True,
           polish_budget_s: float = math.inf) -> tuple[list[Option], dict[str, float]]:
    """Alg. 1, then Alg. 2 when ``offload``; with ``polish`` (adacomp's addition) the result and a
    compress-all start are each improved by :func:`refine` (each within half of
    ``polish_budget_s``) and the better one kept. Returns the strategy and the predicted iteration
    times of it, compress-all (device) and compress-none."""
    t0 = time.perf_counter()
    dev_opts = (DEVICE_AG, DEVICE_A2A) if divisible else (DEVICE_AG,)
    S = decide_device(tensors, model, dev_opts, candidates)
    if offload:
        S = decide_offload(tensors, model, S)
    cand = set(range(len(tensors))) if candidates is None else set(candidates)
    every = [DEVICE_AG if i in cand else NONE for i in range(len(tensors))]
    if polish:
        cpu_opts = (CPU_AG, CPU_A2A) if divisible else (CPU_AG,)
        opts = (NONE, *dev_opts, *(cpu_opts if offload else ()))
        # refine Alg. 2's answer, and also refine a second start (compress-all): Alg. 1's
        # largest-first greedy can lock in a big tensor whose compression only pays alone
        half = polish_budget_s / 2
        starts = [refine(tensors, model, S, opts, candidates, deadline=time.perf_counter() + half),
                  refine(tensors, model, every, opts, candidates, deadline=time.perf_counter() + half)]
        S = min(starts, key=lambda s: simulate(tensors, s, model).iteration_s)
    dt = time.perf_counter() - t0
    out = {"plan_s": simulate(tensors, S, model).iteration_s,
           "compress_all_s": simulate(tensors, every, model).iteration_s,
           "compress_none_s": simulate(tensors, [NONE] * len(tensors), model).iteration_s,
           "decision_s": dt}
    for flag, key, opt in ((divisible, "compress_all_alltoall_s", DEVICE_A2A), (offload, "offload_all_s", CPU_AG)):
        if flag:  # the other uniform strategies the options allow, for comparison with the plan
            out[key] = simulate(tensors, [opt if i in cand else NONE for i in range(len(tensors))], model).iteration_s
    return S, out


def brute_force(tensors: Sequence[TensorProfile], model: CostModel,
                options: Sequence[Option] = (NONE, DEVICE_AG, CPU_AG)) -> tuple[list[Option], float]:
    """The best strategy by enumerating every combination, O(|options|^N): tests only."""
    best = min(itertools.product(options, repeat=len(tensors)),
               key=lambda S: simulate(tensors, S, model).iteration_s)
    return list(best), simulate(tensors, best, model).iteration_s


OPTION_NAMES = {str(o): o for o in ALL_OPTIONS}


def uses_feedback(cfg: Any) -> bool:
    """Whether compressed tensors get error feedback (residual / dgc memory, or ``auto`` with a
    biased compressor): its update is one more decompression per step, counted in compression."""
    from adacomp import compressors
    mem = cfg.memory.name
    if mem == "auto":
        return bool(compressors.registry.cls(cfg.compressor.name).biased)
    return mem != "none"


@register("bytecomp")
class ByteCompPolicy(Policy):
    """Per-tensor compression plan from profiled timelines (§4), applied through optimizer routes.

    The first ``profile_steps`` steps run uncompressed (§4.3: traces "without GC") while hooks
    record when each gradient becomes ready; then every rank shares its trace, alpha / beta are
    measured with :class:`adacomp.netmodel.NetworkProbe` (unless given), the ranks profile the
    compressor on a few sizes (each rank a share of them, up to ``repeats`` runs per size, §4.3)
    and share the points, rank 0 fits the time models, runs :func:`decide` and broadcasts the
    plan while the other ranks wait in short progress broadcasts (:mod:`adacomp.policies.rendezvous`).
    Compressed tensors use the configured compressor and memory; the indivisible scheme uses the
    configured communicator when it can be offloaded (``allgather`` / ``allgather_fast``), else
    ``allgather``; the others go dense on allreduce. Options map to routes as:

    ``none`` -> allreduce, dense; ``device+allgather`` -> indivisible, compressed in the backward
    hook; ``device+alltoall`` -> communicator ``alltoall`` (Fig. 4); ``cpu+*`` -> the same with
    ``offload`` (compressed on the optimizer's CPU worker thread, in parallel with backward).

    * ``divisible``: also consider alltoall + allgather (Fig. 4).
    * ``offload``: ``auto`` runs Alg. 2 only when gradients live on a GPU (on a CPU-only run the
      "device" is the CPU and the worker thread competes with it for the same cores); ``on`` /
      ``off`` force it.
    * ``polish``: run :func:`refine` after Alg. 2 (adacomp's addition), for at most
      ``polish_budget_s`` seconds.
    * ``profile_budget_s``: seconds each rank may spend timing compression (its share of the
      sizes); ``profile_max_numel``: larger tensors are not timed but extrapolated from the fitted
      model (§4.3 times every size 100 times: minutes for a 100M-element tensor on a CPU, issue 21).

    ``rendezvous.max_wait_s`` is the longest this rank waited in one collective of the decision,
    ``rendezvous.decision_s`` rank 0's decision time, ``profile_s`` the compression profiling time,
    ``overhead_s`` the whole one-off cost of the deciding step (traces, probe, profile, decision).
    """

    def __init__(self, profile_steps: int = 100, repeats: int = 100, alpha: float = 0.0, beta: float = 0.0,
                 divisible: bool = False, offload: str = "auto", polish: bool = True,
                 polish_budget_s: float = 0.5, profile_budget_s: float = 2.0, profile_max_numel: int = 1 << 22):
        if isinstance(profile_steps, bool) or not isinstance(profile_steps, int) or profile_steps < 2:
            raise ValueError(f"profile_steps must be an integer >= 2, got {profile_steps!r}")
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
        if alpha < 0 or beta < 0:
            raise ValueError(f"alpha and beta must be >= 0 (0 = measure), got alpha={alpha}, beta={beta}")
        if offload not in ("auto", "on", "off"):
            raise ValueError(f"offload must be 'auto', 'on' or 'off', got {offload!r}")
        for key, v in (("polish_budget_s", polish_budget_s), ("profile_budget_s", profile_budget_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{key} must be a number of seconds > 0, got {v!r}")
        if isinstance(profile_max_numel, bool) or not isinstance(profile_max_numel, int) or profile_max_numel < 1024:
            raise ValueError(f"profile_max_numel must be an integer >= 1024, got {profile_max_numel!r}")
        self.polish_budget_s, self.profile_budget_s = float(polish_budget_s), float(profile_budget_s)
        self.profile_max_numel = profile_max_numel
        self.profile_s = self.overhead_s = 0.0
        self.profile_steps, self.repeats, self.alpha, self.beta = profile_steps, repeats, float(alpha), float(beta)
        self.divisible, self.offload, self.polish = bool(divisible), offload, bool(polish)
        self.plan: dict[str, str] = {}
        self.predicted: dict[str, float] = {}
        self._ready: dict[str, list[float]] = {}
        self._step_end: list[float] = []
        self._handles: list[Any] = []

    def attach(self, optimizer: "Host") -> None:
        super().attach(optimizer)
        self.rendezvous = Rendezvous.for_optimizer(optimizer, self.name)
        cfg = optimizer.config
        from adacomp import communicators, compressors
        comm = cfg.communicator
        if not communicators.registry.cls(comm.name).offloadable or comm.name == "alltoall":
            comm = ComponentSpec("allgather")
        self.schemes = {"allgather": comm, "alltoall": ComponentSpec("alltoall")}
        sample = compressors.get(cfg.compressor.name, **cfg.compressor.params)
        for name in ("allgather", "alltoall") if self.divisible else ("allgather",):
            communicators.get(self.schemes[name].name, **self.schemes[name].params).check(sample)
        self.compressed_spec = (cfg.compressor, cfg.memory)
        self.candidates = [n for n, _ in optimizer.params if optimizer.route_of(n).compressor.name != "none"]
        if not self.candidates:
            raise ValueError("policy bytecomp found no compressed tensor to decide on; set a compressor "
                             "(e.g. {name: topk}) and check min_numel / layers")
        for n in self.candidates:  # profile without compression
            optimizer.set_route(n, ComponentSpec("none"), ComponentSpec("none"), ComponentSpec("allreduce"))
        for n, p in optimizer.params:
            self._ready[n] = []
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(n)))
        self._step_end.append(time.perf_counter())

    def _make_hook(self, name: str):
        def hook(p: Tensor) -> None:
            if self.optimizer.steps < self.profile_steps:
                self._ready[name].append(time.perf_counter() - self._step_end[-1])
        return hook

    def profile(self) -> dict[str, Any]:
        """This rank's trace: mean ready offset of every tensor since the previous step's end."""
        skip = max(1, self.profile_steps // 5)   # early steps pay one-off allocations / imports
        return {n: float(np.median(v[skip:])) for n, v in self._ready.items() if v[skip:]}

    def tensors(self, ready: dict[str, float]) -> tuple[list[TensorProfile], float]:
        """Backward-ordered profiles; the first tensor's compute time is the mean of the others and
        the rest of the first offset is counted as forward time."""
        opt = self.optimizer
        order = sorted(ready, key=lambda n: ready[n])
        deltas = [ready[b] - ready[a] for a, b in zip(order, order[1:])]
        first = float(np.mean(deltas)) if deltas else 0.0
        comp = opt.config.compressor
        from adacomp import compressors
        sample = compressors.get(comp.name, **comp.params)
        out = []
        for k, n in enumerate(order):
            p = opt.parameter(n)
            out.append(TensorProfile(n, p.numel() * p.element_size(), first if k == 0 else deltas[k - 1],
                                     sample.payload_bytes(p.shape, p.element_size())))
        return out, max(0.0, ready[order[0]] - first) if order else 0.0

    def after_step(self, optimizer: "Host", stats: StepStats) -> None:
        if optimizer.steps > self.profile_steps:
            return
        self._step_end.append(time.perf_counter())
        if optimizer.steps != self.profile_steps:
            return
        backend, rv = optimizer.backend, self.rendezvous
        start = time.perf_counter()
        traces = rv.call("sharing ready-time traces", backend.allgather_object, self.profile())
        ready = {n: float(np.mean([t[n] for t in traces if n in t])) for n in traces[0]}
        alpha, beta = self.alpha, self.beta
        if not (alpha or beta) and backend.size() > 1:
            from adacomp.netmodel import NetworkProbe
            est = rv.call("network probe", NetworkProbe().probe, backend, optimizer.steps)
            alpha, beta = est.alpha, est.beta
        t0 = time.perf_counter()
        points = self.profile_share(backend.rank(), backend.size())
        if backend.size() > 1:
            every = rv.call("sharing compression profiles", backend.allgather_object, points)
            points = {res: [p for share in every for p in share.get(res, [])] for res in points}
        self.profile_s = time.perf_counter() - t0
        result = rv.decide("the plan decision", lambda: self.decide_from(ready, alpha, beta, backend.size(), points))
        self.apply(optimizer, result["plan"])
        self.overhead_s = time.perf_counter() - start  # the decision step's one-off cost on this rank
        self.predicted = {**result["predicted"], "profile_s": self.profile_s, "overhead_s": self.overhead_s,
                          "max_wait_s": rv.max_wait_s}
        for h in self._handles:
            h.remove()
        self._handles = []

    def _device(self) -> Any:
        return self.optimizer.params[0][1].device

    def profile_share(self, rank: int, world: int) -> dict[str, list[Point]]:
        """This rank's share of the compression profile: the (resource, size) jobs ``rank::world``
        (sizes ascending, so every rank gets a similar mix), each resource within
        ``profile_budget_s`` split by its share of the jobs."""
        opt = self.optimizer
        device = self._device()
        resources = ("device",) if device.type == "cpu" else ("device", "cpu")
        numels = [opt.parameter(n).numel() for n in self.candidates]
        grid = size_grid(numels, max_numel=self.profile_max_numel)
        jobs = [(res, n) for res in resources for n in grid]
        mine = jobs[rank::world]
        from adacomp import compressors
        comp = opt.config.compressor
        fb = uses_feedback(opt.config)
        out: dict[str, list[Point]] = {res: [] for res in resources}
        for res in resources:
            sizes = [n for r, n in mine if r == res]
            if sizes:
                out[res] = measure_compressor(compressors.get(comp.name, **comp.params), sizes,
                                              device if res == "device" else "cpu", self.repeats, feedback=fb,
                                              budget_s=self.profile_budget_s * len(sizes) / len(mine))
        return out

    def decide_from(self, ready: dict[str, float], alpha: float, beta: float, world: int,
                    points: dict[str, list[Point]] | None = None) -> dict[str, Any]:
        """The plan from traces, the network model and compression profile ``points`` (measured
        here on one rank when not given)."""
        tensors, forward_s = self.tensors(ready)
        device = self._device()
        if points is None:
            points = self.profile_share(0, 1)
        ctime, dtime = fit_times(points["device"])
        cctime, cdtime = fit_times(points["cpu"]) if "cpu" in points else (ctime, dtime)
        model = cost_model(world, alpha, beta, {"device": ctime, "cpu": cctime},
                           {"device": dtime, "cpu": cdtime}, forward_s)
        offload = self.offload == "on" or (self.offload == "auto" and device.type == "cuda")
        cand = {i for i, t in enumerate(tensors) if t.name in self.candidates}
        S, predicted = decide(tensors, model, self.divisible, offload, cand, self.polish, self.polish_budget_s)
        return {"plan": {t.name: str(o) for t, o in zip(tensors, S) if t.name in self.candidates},
                "predicted": {**predicted, "alpha": alpha, "beta": beta}}

    def apply(self, optimizer: "Host", plan: dict[str, str]) -> None:
        """Route every planned tensor as its option says (see the class docstring)."""
        comp, mem = self.compressed_spec
        for name, option in plan.items():
            o = OPTION_NAMES[option]
            if o.compressed:
                optimizer.set_route(name, comp, mem, self.schemes[o.scheme], offload=o.where == "cpu")
            else:
                optimizer.set_route(name, ComponentSpec("none"), ComponentSpec("none"), ComponentSpec("allreduce"),
                                    offload=False)
        self.plan = dict(plan)

    def state_dict(self) -> dict[str, Any]:
        return {"plan": dict(self.plan), "predicted": dict(self.predicted)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.predicted = dict(state.get("predicted", {}))
        if state.get("plan") and hasattr(self, "optimizer"):
            self.apply(self.optimizer, state["plan"])
