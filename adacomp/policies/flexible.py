"""Flexible communication (AR-Topk paper §3-D, eq. 4-5): per bucket, AG vs ART-Ring vs ART-Tree.

Every ``probe_every`` calls the policy measures alpha and beta between the ranks
(:class:`adacomp.netmodel.NetworkProbe`; all ranks hold identical numbers), and whenever alpha, beta
or a bucket's density changed it predicts, for each Top-k bucket, the cost of

* ``allgather``: AG of this rank's values + indices (``allgather_fast`` for fixed-size Top-k),
* ``artopk_ring`` (eq. 4a) and ``artopk_tree`` (eq. 4b): broadcast of int32 indices + allreduce,

from the bucket's real byte counts (``M`` dense bytes, ``Mc`` value bytes, index bytes of each
wire format), and installs the cheapest with ``optimizer.set_communicator``. Inputs are identical
on every rank and the computation is deterministic, so every rank makes the same choice without a
broadcast. Every switch is logged and kept in :attr:`switches`.

Ring vs tree is a property of the transport. Where the backend cannot switch its allreduce
algorithm (``Backend.set_allreduce_algorithm`` returns False: gloo, MPI, Horovod, NCCL after its
communicator exists) only the variant it really runs is a candidate (gloo: ring), so predictions
describe what runs. See docs/algorithms.md (AR-Topk, backends).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from adacomp import communicators, netmodel
from adacomp.communicators.base import Communicator
from adacomp.compressors.sparse import k_for
from adacomp.engine.metrics import StepStats
from adacomp.policies.base import Policy, register
from adacomp.policies.rendezvous import Rendezvous

if TYPE_CHECKING:
    from adacomp.engine.optimizer import Bucket
    from adacomp.policies.base import Host

log = logging.getLogger(__name__)
KINDS = tuple(netmodel.COLLECTIVES)
SPARSE_TOPK = ("topk", "gtopk")


@register("flexible")
class FlexiblePolicy(Policy):
    """Switch each Top-k bucket between AG and AR-Topk (ring / tree) by the alpha-beta model.

    ``probe_every``: steps between alpha / beta probes (each costs a few small and 1 MiB collectives;
    the overhead is in :attr:`probe` ``.total_overhead_s``). ``selection``: AR-Topk's rank selection
    (``star`` / ``var``). ``collectives``: comma-separated candidates among
    ``allgather,artopk_ring,artopk_tree``. ``probe_bytes``: size of the large probe message.
    """

    def __init__(self, probe_every: int = 100, selection: str = "star",
                 collectives: str = "allgather,artopk_ring,artopk_tree", probe_bytes: int = 1 << 20):
        kinds = tuple(k.strip() for k in collectives.split(",") if k.strip())
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise ValueError(f"collectives must be a comma-separated subset of {','.join(KINDS)}, got {collectives!r}")
        if selection not in ("star", "var"):
            raise ValueError(f"selection must be 'star' or 'var', got {selection!r}")
        self.probe = netmodel.NetworkProbe(probe_every=probe_every, large_bytes=probe_bytes)
        self.selection = selection
        self.requested = kinds
        self.allowed: tuple[str, ...] = kinds
        self.choice: dict[int, str] = {}
        self.predicted: dict[int, float] = {}
        self.switches: list[dict[str, Any]] = []
        self.records: deque[dict[str, float]] = deque(maxlen=100_000)  # predicted vs measured per step
        self._calls = 0
        self._inputs: tuple | None = None
        self._comms: dict[str, Communicator] = {}

    # -------------------------------------------------------------- setup
    def attach(self, optimizer: "Host") -> None:
        super().attach(optimizer)
        # every rank computes the same choice from the allgathered probe (no rank decides alone, so
        # no rank waits for another's work); the probe's collectives are timed for issue 21's audit
        self.rendezvous = Rendezvous.for_optimizer(optimizer, self.name)
        backend = optimizer.backend
        current = backend.allreduce_algorithm or "ring"  # gloo's allreduce is a ring
        if backend.set_allreduce_algorithm(current):
            self.allowed = self.requested
        else:
            self.allowed = tuple(k for k in self.requested if not k.startswith("artopk_") or k == f"artopk_{current}")
            if self.allowed != self.requested:
                log.info("flexible: backend %r cannot choose its allreduce algorithm; candidates %s",
                         backend.name, ",".join(self.allowed))
        self.update(optimizer, probe=True)

    # -------------------------------------------------------------- cost model per bucket
    def bucket_bytes(self, optimizer: "Host", b: "Bucket", density: float | None = None) -> dict[str, float] | None:
        """``M`` (dense bytes), ``values`` (Mc), index bytes per collective; None if not Top-k."""
        by_name = dict(optimizer.params)
        params = [by_name[n] for n in b.names]
        comp = optimizer.compressor_for(b.names[0])
        if comp.name not in SPARSE_TOPK:
            return None
        d = float(density if density is not None else comp.density())
        item = params[0].element_size()
        tensors = [sum(p.numel() for p in params)] if b.fused_compressor is not None else [p.numel() for p in params]
        ks = [k_for(n, d) for n in tensors]
        values = float(sum(ks) * item)
        return {"M": float(sum(p.numel() for p in params) * item), "values": values,
                "allgather": float(sum(k * 8 for k in ks)),   # int64 indices on the allgather wire
                "artopk": float(sum(k * 4 for k in ks))}      # int32 indices in AR-Topk's broadcast

    def predict(self, sizes: dict[str, float], world: int, alpha: float, beta: float,
                kinds: tuple[str, ...] | None = None) -> tuple[str, float]:
        """Cheapest collective (among ``kinds``, default the allowed ones) and its seconds."""
        M, V = sizes["M"], sizes["values"]
        ratio = {"allgather": sizes["allgather"] / V, "artopk_ring": sizes["artopk"] / V,
                 "artopk_tree": sizes["artopk"] / V}
        return netmodel.best_collective(M, V / M, world, alpha, beta, kinds or self.allowed, ratio)

    def predict_total(self, optimizer: "Host", density: float | None = None,
                      switching: bool = True) -> float:
        """Predicted sync seconds of one step (sum over Top-k buckets) at ``density``."""
        est = self.probe.last
        if est is None:
            return 0.0
        total = 0.0
        for b in optimizer.buckets:
            sizes = self.bucket_bytes(optimizer, b, density)
            if sizes is not None:
                kinds = None if switching else (self.choice.get(b.index, self.allowed[0]),)
                total += self.predict(sizes, optimizer.backend.size(), est.alpha, est.beta, kinds)[1]
        return total

    def sync_predictor(self, optimizer: "Host",
                       switching: bool = True) -> Callable[[np.ndarray], np.ndarray]:
        """:meth:`predict_total` for an array of densities at once, bit for bit the same numbers.

        Why (issue 21): MOO's NSGA-II asks for ~1600 densities per decision and
        :meth:`predict_total` re-reads every bucket each time (seconds on GPT-2's 148 tensors). The
        per-bucket numbers are read once here; the alpha-beta formulas are elementwise, so numpy
        evaluates them in the same order of float operations as the scalar path."""
        est = self.probe.last
        world = optimizer.backend.size()
        plan = []
        for b in optimizer.buckets:
            sizes = self.bucket_bytes(optimizer, b)
            if sizes is None:
                continue
            params = [optimizer.parameter(n) for n in b.names]
            numels = [sum(p.numel() for p in params)] if b.fused_compressor is not None else \
                [p.numel() for p in params]
            kinds = self.allowed if switching else (self.choice.get(b.index, self.allowed[0]),)
            plan.append((np.array(numels, dtype=np.int64)[:, None], float(params[0].element_size()),
                         sizes["M"], [k for k in netmodel.COLLECTIVES if k in kinds]))

        def predict(densities: np.ndarray) -> np.ndarray:
            d = np.asarray(densities, dtype=np.float64)[None, :]
            total = np.zeros(d.shape[1])
            if est is None:
                return total
            for numels, item, M, kinds in plan:
                # k_for, elementwise: round() and rint() both round half to even
                ks = np.minimum(numels, np.maximum(1, np.rint(d * numels).astype(np.int64)))
                sumk = ks.sum(axis=0)
                V = (sumk * int(item)).astype(np.float64)
                ratio = {"allgather": (sumk * 8).astype(np.float64) / V,
                         "artopk_ring": (sumk * 4).astype(np.float64) / V,
                         "artopk_tree": (sumk * 4).astype(np.float64) / V}
                cost = netmodel.costs(M, V / M, world, est.alpha, est.beta, ratio)
                total += np.min(np.stack([cost[k] for k in kinds]), axis=0)
            return total
        return predict

    # -------------------------------------------------------------- switching
    def _communicator(self, kind: str, fixed_size: bool) -> Communicator:
        key = f"{kind}:{fixed_size}"
        if key not in self._comms:
            if kind == "allgather":
                self._comms[key] = communicators.get("allgather_fast" if fixed_size else "allgather")
            else:
                algo = kind.split("_")[1] if self.allowed == self.requested else "auto"
                self._comms[key] = communicators.get("artopk", selection=self.selection, algorithm=algo)
        return self._comms[key]

    def update(self, optimizer: "Host", probe: bool = False) -> None:
        """Probe if due, then re-choose every bucket's collective if any input changed."""
        if probe or self.probe.due(self._calls):
            self.rendezvous.call("network probe", self.probe.probe, optimizer.backend, self._calls)
        est = self.probe.last
        assert est is not None  # due() is true until the first probe sets it
        sizes = {b.index: self.bucket_bytes(optimizer, b) for b in optimizer.buckets}
        inputs = (est.alpha, est.beta, tuple(sorted((i, s["values"]) for i, s in sizes.items() if s)))
        if inputs == self._inputs:
            return
        self._inputs = inputs
        world = optimizer.backend.size()
        for b in optimizer.buckets:
            s = sizes[b.index]
            if s is None:
                continue
            kind, cost = self.predict(s, world, est.alpha, est.beta)
            self.predicted[b.index] = cost
            old = self.choice.get(b.index)
            if kind != old:
                comp = optimizer.compressor_for(b.names[0])
                optimizer.set_communicator(b.index, self._communicator(kind, comp.fixed_size))
                self.choice[b.index] = kind
                rec = {"step": optimizer.steps, "bucket": b.index, "from": old, "to": kind,
                       "alpha": est.alpha, "beta": est.beta, "M": s["M"], "c": s["values"] / s["M"],
                       "predicted_s": cost}
                self.switches.append(rec)
                log.info("flexible: step %d bucket %d %s -> %s (alpha=%.3g s, beta=%.3g s/B, c=%.4g, "
                         "predicted %.3g s)", rec["step"], b.index, old, kind, est.alpha, est.beta, rec["c"], cost)

    def dense_predicted(self, optimizer: "Host") -> float:
        """Ring-allreduce prediction (Table I) of the dense buckets, so a step's total is comparable."""
        est = self.probe.last
        if est is None:
            return 0.0
        by_name = dict(optimizer.params)
        return sum(netmodel.ring_allreduce(sum(by_name[n].numel() * by_name[n].element_size() for n in b.names),
                                           optimizer.backend.size(), est.alpha, est.beta)
                   for b in optimizer.buckets if b.index not in self.predicted)

    def state_dict(self) -> dict[str, Any]:
        """Per-bucket choice, call counter and the last network estimate, so a resumed run keeps
        its collectives instead of re-deciding from a fresh probe."""
        est = self.probe.last
        return {"choice": {int(k): v for k, v in self.choice.items()}, "calls": self._calls,
                "estimate": None if est is None else
                {"alpha": est.alpha, "beta": est.beta, "overhead_s": est.overhead_s, "step": est.step}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self._calls = int(state["calls"])
        if state.get("estimate"):
            self.probe.last = netmodel.NetEstimate(**state["estimate"])
        self.choice = {int(k): v for k, v in state["choice"].items()}
        opt = getattr(self, "optimizer", None)
        if opt is not None:
            for index, kind in self.choice.items():
                comp = opt.compressor_for(opt.buckets[index].names[0])
                opt.set_communicator(index, self._communicator(kind, comp.fixed_size))
        self._inputs = None

    def after_step(self, optimizer: "Host", stats: StepStats) -> None:
        self.records.append({"step": float(stats.step),
                             "predicted_s": sum(self.predicted.values()) + self.dense_predicted(optimizer),
                             "measured_s": stats.comm_s,
                             "alpha": self.probe.last.alpha if self.probe.last else 0.0,
                             "beta": self.probe.last.beta if self.probe.last else 0.0})
        self._calls += 1
        self.update(optimizer)
