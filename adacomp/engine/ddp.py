"""adacomp's compressors as a PyTorch DDP communication hook.

    state, hook = adacomp.ddp.hook("configs/topk.yaml", named_parameters=model.named_parameters())
    ddp_model.register_comm_hook(state, hook)

The same YAML, compressors, memories and communicators as :class:`adacomp.DistributedOptimizer`,
on DDP's buckets: works wherever a DDP model is (plain DDP, Lightning's
``DDPStrategy(ddp_comm_hook=hook, ddp_comm_state=state)``, Accelerate's prepared model).

How a round goes (one backward):

* DDP calls the hook once per bucket, in bucket-index order on every rank. The hook splits the
  bucket's parameters by route, compensates them with their residuals and starts each route's
  first collective (``communicator.start``), and returns a future that is not set yet;
* the hook of the *last* bucket finishes every bucket in index order (further rounds of
  PowerSGD / ACP-SGD / AR-Topk happen here, so every rank issues them in the same order whatever
  order DDP's futures would complete in: the failure mode of PyTorch's own PowerSGD hook on
  multi-bucket gloo models), votes on non-finite gradients, writes the means into the buckets and
  sets every future. DDP waits on the futures only after backward, so nothing blocks early.

Error feedback is keyed by parameter name (``named_parameters``; otherwise ``param<k>`` in order
of first appearance, identical on every rank), so it survives DDP rebuilding its buckets after
the first iteration. ``state.state_dict()`` / ``load_state_dict()`` hold every residual,
threshold and factor for checkpoints. Adaptive policies need the optimizer's host protocol and
are refused here (use ``adacomp.DistributedOptimizer`` for them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from adacomp import backends, compressors
from adacomp.engine import error_feedback
from adacomp.backends.base import Backend
from adacomp.communicators.base import CommEnv
from adacomp.compressors.base import Compressor
from adacomp.config import Config, load
from adacomp.errors import ConfigError, NonFiniteGradientError
from adacomp.engine.error_feedback import LossScale, Rollback
from adacomp.engine.metrics import StepStats
from adacomp.engine.optimizer_state import ComponentState
from adacomp.engine.routes import Bucket, RouteTable, fused_key


@dataclass
class _Group:
    """The parameters of one DDP bucket that share a route: one communicator call."""

    bucket: Bucket
    grads: list[Tensor]
    pending: Any = None


@dataclass
class _Round:
    stats: StepStats
    env: CommEnv
    groups: list[tuple[list[_Group], Tensor, torch.futures.Future]] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)


class HookState:
    """Everything the hook keeps across steps: routes, compressors, memories, the round."""

    def __init__(self, config: Any = None, named_parameters: Iterable[tuple[str, Tensor]] | None = None,
                 backend: Backend | None = None, grad_scaler: Any = None):
        self.config: Config = load(config)
        if self.config.policy.name != "static":
            raise ConfigError("policy.name", f"policy {self.config.policy.name!r} needs adacomp.DistributedOptimizer "
                                             "(it re-plans routes and buckets between steps); the DDP hook runs "
                                             "policy 'static' only")
        if self.config.local_steps is not None:
            raise ConfigError("local_steps", "a DDP communication hook runs inside every backward, so it cannot "
                                             "skip steps; local steps need adacomp.DistributedOptimizer (remove "
                                             "local_steps to use the hook)")
        if any(layer.offload for layer in self.config.layers):
            raise ConfigError("layers[].offload", "offload is not available in the DDP hook (DDP calls the hook "
                                                  "on its own thread); use adacomp.DistributedOptimizer")
        named = list(named_parameters or [])
        self._names = {id(p): n for n, p in named}
        self._backend = backend
        self.table = RouteTable(self.config, [])
        for n, p in named:  # routes up front, so a checkpoint can be loaded before the first step
            if p.requires_grad:
                self.table.ensure(n, p)
        self._fused_state: dict[str, Any] = {}  # loaded before its DDP bucket was first seen
        self.loss_scale = LossScale(grad_scaler)
        self.rollback = Rollback()
        self.steps = 0
        self._fused: dict[str, Compressor] = {}
        self._round: _Round | None = None
        self.last_stats: StepStats | None = None
        self.io = ComponentState(None, self.table, self.loss_scale, lambda: None, lambda: self.steps,
                                 self._set_steps, extra=lambda: {f"compressor/{k}": c for k, c in self._fused.items()})

    # --- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.io.adacomp_state_dict(include_policy=False)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back residuals, thresholds and factors. Needs ``named_parameters`` at ``hook()``
        (routes exist before the first step); fused-bucket compressors get theirs when DDP first
        hands over their bucket."""
        if not self.table.params:
            raise ValueError("adacomp.ddp.hook(..., named_parameters=model.named_parameters()) is needed to load "
                             "hook state before the first step")
        comps = dict(state["components"])
        fused = {k: comps.pop(k) for k in list(comps) if k.startswith("compressor/bucket:")}
        self.io.load_adacomp_state_dict({**state, "components": comps})
        self._fused_state = {k.removeprefix("compressor/"): v for k, v in fused.items()}

    def _set_steps(self, steps: int) -> None:
        self.steps = steps

    @property
    def backend(self) -> Backend:
        """Resolved at the first hook call: Lightning / Accelerate create the process group after
        the hook state is built."""
        if self._backend is None:
            self._backend = backends.create("torch", timeout_s=self.config.timeout_s)
        return self._backend

    # --- the hook --------------------------------------------------------------------------------
    def name_of(self, p: Tensor) -> str:
        name = self._names.get(id(p))
        if name is None:
            name = self._names[id(p)] = f"param{len(self._names)}"
        return name

    def _groups(self, index: int, params: list[Tensor], grads: list[Tensor]) -> list[_Group]:
        by_route: dict[str, tuple[list[str], list[Tensor]]] = {}
        for p, g in zip(params, grads):
            name = self.name_of(p)
            route = self.table.ensure(name, p)
            names, gs = by_route.setdefault(route.key, ([], []))
            names.append(name)
            gs.append(g)
        out = []
        for key, (names, gs) in by_route.items():
            route = self.table.routes[key]
            b = Bucket(index, names, route, route.communicator)
            if compressors.registry.cls(route.compressor.name).granularity == "bucket" or \
                    (self.config.fusion.fuse_before_compress and route.compressor.name != "none"):
                b.fused_key = fused_key(key, names)
                if b.fused_key not in self._fused:
                    c = compressors.get(route.compressor.name, **route.compressor.params)
                    if b.fused_key in self._fused_state:
                        c.load_state_dict(self._fused_state.pop(b.fused_key))
                    self._fused[b.fused_key] = c
                b.fused_compressor = self._fused[b.fused_key]
            out.append(_Group(b, gs))
        return out

    def _begin(self) -> _Round:
        stats = StepStats(step=self.steps)
        memories = list({id(r.memory): r.memory for r in self.table.routes.values()}.values())
        comps = self.table.unique_compressors() + list(self._fused.values())
        self.loss_scale.sync(memories, comps)
        self.rollback.keep(memories, [c for c in comps if type(c).state_dict is not Compressor.state_dict])
        return _Round(stats, CommEnv(self.backend, stats, self.steps))

    def __call__(self, bucket: Any) -> torch.futures.Future:
        rnd = self._round or self._begin()
        self._round = rnd
        grads = list(bucket.gradients())
        groups = self._groups(bucket.index(), list(bucket.parameters()), grads)
        for grp in groups:
            for n, g in zip(grp.bucket.names, grp.grads):
                if not torch.isfinite(g.sum()) and not torch.isfinite(g).all():
                    rnd.nonfinite.append(n)
            rnd.env.bucket_index = grp.bucket.index
            with rnd.stats.timing("compress"):
                entries = error_feedback.entries(grp.bucket, grp.grads, self.table.compressors)
            grp.pending = grp.bucket.communicator.start(entries, rnd.env)
        fut: torch.futures.Future = torch.futures.Future()
        rnd.groups.append((groups, bucket.buffer(), fut))
        if bucket.is_last():
            self._round = None
            self._finish(rnd)
        return fut

    def _finish(self, rnd: _Round) -> None:
        flag = self.backend.allreduce_async(torch.tensor([1.0 if rnd.nonfinite else 0.0]), average=False)
        results = []
        for groups, _, _ in rnd.groups:
            for grp in groups:
                rnd.env.bucket_index = grp.bucket.index
                results.append(grp.bucket.communicator.finish(grp.pending, rnd.env))
        nonfinite = float(flag.wait()[0]) > 0
        if nonfinite:
            self.rollback.restore()
            if self.config.nonfinite == "raise":
                raise NonFiniteGradientError("non-finite gradient (NaN or Inf) on " + ", ".join(rnd.nonfinite[:5] or
                                             ["another rank"]) + "; every compression state was left as it was")
        self.rollback.clear()
        it = iter(results)
        for groups, buffer, fut in rnd.groups:
            for grp in groups:
                outs = next(it)
                if grp.bucket.fused_compressor is not None:
                    flat, off, outs = outs[0].reshape(-1), 0, []
                    for g in grp.grads:
                        outs.append(flat[off:off + g.numel()])
                        off += g.numel()
                poison = nonfinite and grp.bucket.route.compressor.name != "none"
                for g, out in zip(grp.grads, outs):
                    g.copy_(out.view(g.shape))  # grads are views of DDP's bucket buffer
                    if poison:
                        g.fill_(float("nan"))
            fut.set_result(buffer)
        self.steps += 1
        self.last_stats = rnd.stats
        for c in self.table.unique_compressors() + list(self._fused.values()):
            c.on_step(self.steps)


def hook(config: Any = None, named_parameters: Iterable[tuple[str, Tensor]] | None = None,
         backend: Backend | None = None, grad_scaler: Any = None
         ) -> tuple[HookState, Callable[[HookState, Any], torch.futures.Future]]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    ``config``: the same YAML / dict as for :class:`adacomp.DistributedOptimizer` (policy
    ``static``). ``named_parameters``: the model's, for readable and stable state keys.
    ``grad_scaler``: a ``torch.amp.GradScaler`` whose scale the residuals should follow.
    With ``nonfinite: skip`` / ``propagate`` a non-finite round leaves every residual as it was and
    hands DDP NaN gradients so GradScaler skips the step on every rank."""
    state = HookState(config, named_parameters, backend, grad_scaler)
    return state, _call


def _call(state, bucket):  # type: ignore[no-untyped-def]
    # DDP inspects this signature (bucket annotated dist.GradBucket, or not at all); with
    # postponed annotations a string would fail its check, so the hook is left unannotated.
    return state(bucket)


__all__ = ["HookState", "hook"]
