"""DistributedOptimizer: Horovod's one-line wrap, with a compressor, memory and communicator per route.

Communication starts inside backward: a hook on every parameter fires once its gradient is
accumulated (wait-free back-propagation); when every gradient of a fusion bucket is ready, the
bucket's communicator compresses (after error-feedback compensation) and launches its collective
without waiting. ``step()`` calls :meth:`synchronize`, which finishes buckets in order, writes the
mean gradient into ``p.grad`` and then runs the wrapped optimizer.

Buckets are launched strictly in bucket-index order on every rank (a ready bucket waits for its
predecessors), so gloo / MPI / NCCL see the same sequence of collectives everywhere even if hooks
fire in a different order (DESIGN.md, ordering rule).

The class is assembled from modules with one job each: :mod:`adacomp.routes` (routes, buckets
and the knobs policies turn), :mod:`adacomp.grad_hooks` (hooks and in-order launches),
:mod:`adacomp.offload` (the CPU compression worker) and :mod:`adacomp.optimizer_state`
(checkpoints and snapshots). This file keeps construction, ``synchronize`` and ``step``.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
import warnings
from collections import deque
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from adacomp import context, policies, watchdog
from adacomp.backends.base import Backend
from adacomp.communicators.base import CommEnv
from adacomp.config import Config, load
from adacomp.errors import CommunicationError, ConfigError, NonFiniteGradientError
from adacomp.grad_hooks import HookMixin
from adacomp.metrics import StepStats
from adacomp.optimizer_state import StateMixin
from adacomp.routes import Bucket, Route, RoutingMixin

Average = "average"
Sum = "sum"


class DistributedOptimizer(RoutingMixin, HookMixin, StateMixin, torch.optim.Optimizer):
    """Wrap ``optimizer`` so gradients are compressed and averaged across ranks.

    Arguments follow Horovod's: ``named_parameters`` (unique names, used for per-layer rules and
    state keys), ``backward_passes_per_step`` (local accumulation before communicating),
    ``op`` (``adacomp.Average`` or ``adacomp.Sum``), ``gradient_predivide_factor`` (accepted for
    Horovod compatibility; communicators already average, so it does not change the result),
    plus ``config`` (YAML path, dict or :class:`~adacomp.config.Config`) and ``backend``.

    Call ``synchronize()`` yourself to touch averaged gradients before the update, e.g. clipping::

        loss.backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 config: Any = None, backward_passes_per_step: int = 1, op: str = Average,
                 gradient_predivide_factor: float = 1.0, backend: Backend | None = None,
                 compression: Any = None, sparse_as_dense: bool = False, groups: Any = None,  # horovod kwargs
                 num_groups: int = 0, process_set: Any = None):  # horovod kwargs
        # Deliberately not calling Optimizer.__init__: we share the inner optimizer's groups/state.
        self.inner = optimizer
        self.defaults = optimizer.defaults
        self.config: Config = load(config)
        from adacomp.hvd_compat import apply_optimizer_kwargs  # horovod kwargs
        self.config = apply_optimizer_kwargs(  # horovod kwargs
            self.config, [p for g in optimizer.param_groups for p in g["params"]], compression=compression,
            sparse_as_dense=sparse_as_dense, groups=groups, num_groups=num_groups, op=op, process_set=process_set)
        if op not in (Average, Sum):
            raise ValueError(f"op must be adacomp.Average or adacomp.Sum, got {op!r}")
        if gradient_predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.backward_passes_per_step = backward_passes_per_step
        self.backend = backend if backend is not None else context.current()
        self.params = self._name_parameters(optimizer, named_parameters)
        self._param_by_name = dict(self.params)
        self.steps = 0
        self.steps_per_epoch: int | None = None  # set by training loops that know it (lgreco's period)
        self.skipped_steps = 0
        self._skip_this_step = False
        self._pre_state: dict[str, Any] = {}
        self.last_stats: StepStats | None = None
        self.history: deque[dict[str, float]] = deque(maxlen=1000)
        self._overrides: dict[str, dict[str, Any]] = {}
        self._pool = None  # offload worker thread, started on first use (adacomp.offload)
        self._check_consistency()
        self._build_routes()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(n))
                       for n, p in self.params]
        if any(r.memory.name == "dgc" for r in self._routes.values()) and \
                any(g.get("momentum", 0) for g in optimizer.param_groups):
            warnings.warn("memory 'dgc' applies momentum itself (DGC §3.2); the wrapped optimizer should "
                          "use momentum=0, otherwise momentum is applied twice", stacklevel=2)
        self.policy = policies.get(self.config.policy.name, **self.config.policy.params)
        self._reset_step()
        self.policy.attach(self)

    # --- torch.optim.Optimizer surface (shared with the wrapped optimizer) -----------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer holds live communication state; pickle state_dict() instead")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.inner!r}, buckets={len(self.buckets)}, backend={self.backend!r})"

    # --- construction -----------------------------------------------------------------------------
    @staticmethod
    def _name_parameters(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None) -> list[tuple[str, Tensor]]:
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        if named_parameters is None:
            return [(f"param.{i}", p) for i, p in enumerate(opt_params) if p.requires_grad]
        named = list(named_parameters)
        if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                             "usually model.named_parameters()")
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {dups}")
        ids = {id(p) for _, p in named}
        missing = [i for i, p in enumerate(opt_params) if id(p) not in ids]
        if missing:
            raise ValueError("named_parameters was given, but optimizer parameters at positions "
                             f"{missing} are not in it; pass model.named_parameters() of the whole model")
        opt_ids = {id(p) for p in opt_params}
        return [(n, p) for n, p in named if id(p) in opt_ids and p.requires_grad]

    def _check_consistency(self) -> None:
        """Every rank must hold the same config and the same parameters; say who differs."""
        shapes = [(n, list(p.shape)) for n, p in self.params]
        mine = {"config": self.config.hash(),
                "params": hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16],
                "names": [n for n, _ in self.params][:2000], "shapes": shapes[:2000]}
        everyone = self.backend.allgather_object(mine)
        ref = everyone[0]
        for what in ("config", "params"):
            bad = [r for r, d in enumerate(everyone) if d[what] != ref[what]]
            if bad:
                detail = ""
                if what == "params":
                    other = everyone[bad[0]]
                    diff = [f"{a} vs {b}" for a, b in zip(ref["shapes"], other["shapes"]) if a != b][:3]
                    if len(ref["shapes"]) != len(other["shapes"]):
                        diff.insert(0, f"{len(ref['shapes'])} vs {len(other['shapes'])} parameters")
                    detail = f"; first differences (rank 0 vs rank {bad[0]}): {diff}"
                raise CommunicationError(
                    f"ranks {bad} have a different {'configuration' if what == 'config' else 'model (parameter names/shapes)'} "
                    f"than rank 0{detail}. Every rank must run the same config file and model.")

    # --- lookups (route / bucket lookups live in adacomp.routes) ---------------------------------
    def parameter(self, name: str) -> Tensor:
        return self._param_by_name[name]

    # --- per-step bookkeeping ---------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._passes: dict[str, int] = {n: 0 for n, _ in self.params}
        for b in self.buckets:
            if b.job is not None:  # an aborted step: let the worker finish before state is reused
                b.job.exception()
            b.ready, b.pending, b.entries, b.job = 0, None, [], None
        self._next_launch = 0
        self._launched_any = False
        self._step_started = False
        self._synchronized = False
        self._should_sync = True
        self._nonfinite: list[str] = []
        self._skip_this_step = False
        self._stats = StepStats(step=self.steps)
        self._env = CommEnv(self.backend, self._stats, self.steps)

    # --- synchronize / step -------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every bucket and write the averaged gradients into ``p.grad``."""
        if self._synchronized:
            return
        with watchdog.guard(self.backend):  # a dead peer surfaces as an error naming its rank
            self._synchronize()

    def _synchronize(self) -> None:
        if not self._launched_any and all(v == 0 for v in self._passes.values()):
            # step() without backward: nothing to send (Horovod also allows it).
            self._synchronized = True
            return
        incomplete = [n for n, c in self._passes.items() if 0 < c < self.backward_passes_per_step]
        if incomplete:
            raise RuntimeError(
                f"step() called after {self._passes[incomplete[0]]} of backward_passes_per_step="
                f"{self.backward_passes_per_step} backward passes; run the remaining passes first")
        for b in self.buckets[self._next_launch:]:  # parameters without gradients count as ready
            if b.ready != len(b.names):
                b.ready = len(b.names)
                if b.route.offload:
                    self._submit(b)
        self._launch_ready(block=True)
        scale = float(self.backend.size()) if self.op == Sum else 1.0
        for b in self.buckets:
            self._env.bucket_index = b.index
            t0 = time.perf_counter()
            outs = b.communicator.finish(b.pending, self._env)
            self._stats.bucket_sync_s[b.index] = time.perf_counter() - t0
            self._write_grads(b, outs, scale)
            b.pending, b.entries = None, []
        self._check_nonfinite()
        self._synchronized = True

    def _write_grads(self, b: Bucket, outs: list[Tensor], scale: float) -> None:
        """Install the averaged gradients. Results are handed over as ``p.grad`` (no copy) when
        dtype and device match, as DDP's ``gradient_as_bucket_view`` does: for the dense path they
        are views of the fusion buffer, so the next backward can even accumulate in place and the
        next flatten is skipped. Otherwise they are copied into the existing gradient."""
        if b.fused_compressor is not None:
            flat, off = outs[0].reshape(-1), 0
            outs = []
            for n in b.names:
                numel = self._param_by_name[n].numel()
                outs.append(flat[off:off + numel])
                off += numel
        for n, out in zip(b.names, outs):
            p = self._param_by_name[n]
            g = p.grad
            if out.data_ptr() != g.data_ptr():  # type: ignore[union-attr]
                if out.dtype == g.dtype and out.device == g.device and out.is_contiguous():  # type: ignore[union-attr]
                    p.grad = g = out.view(g.shape)  # type: ignore[union-attr]
                else:
                    g.copy_(out.reshape(g.shape))  # type: ignore[union-attr]
            if scale != 1.0:
                g.mul_(scale)  # type: ignore[union-attr]

    def _check_nonfinite(self) -> None:
        """All ranks learn whether any rank saw a non-finite gradient (one tiny allreduce)."""
        flag = torch.tensor([1.0 if self._nonfinite else 0.0])
        if float(self.backend.allreduce(flag)) == 0.0:
            return
        where = self.backend.allgather_object(self._nonfinite[:5])
        bad = {r: names for r, names in enumerate(where) if names}
        if self.config.nonfinite == "skip":
            self.skipped_steps += 1
            self.load_adacomp_state_dict(self._pre_state)  # also resets the step's bookkeeping
            self._skip_this_step = True
            self._synchronized = True
        else:
            self._reset_step()
            raise NonFiniteGradientError(
                "non-finite gradient (NaN or Inf) on " + "; ".join(f"rank {r}: {', '.join(n)}" for r, n in bad.items())
                + ". Lower the learning rate or use loss scaling; set `nonfinite: skip` to drop such steps.")

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not call ``synchronize()`` (you already did)."""
        self._should_sync = False
        try:
            yield
        finally:
            self._should_sync = True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self._should_sync:
            self.synchronize()
        elif not self._synchronized and self._launched_any:
            raise RuntimeError("step() inside skip_synchronize() requires an explicit synchronize() first")
        if self._skip_this_step:  # every rank saw the flag: drop the update, keep all state
            self._reset_step()
            return None
        loss = self.inner.step(closure)
        self._finish_step()
        return loss

    def _finish_step(self) -> None:
        stats = self._stats
        self.last_stats = stats
        self.history.append(stats.as_dict())
        self.steps += 1
        seen: set[int] = set()
        for c in list(self._compressors.values()) + [b.fused_compressor for b in self.buckets if b.fused_compressor]:
            if id(c) not in seen:
                seen.add(id(c))
                c.on_step(self.steps)
        self._reset_step()
        self.policy.after_step(self, stats)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._launched_any and not self._synchronized:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); this would race with communication. Call zero_grad() before backward.")
        self.inner.zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        """Detach from the model and stop the offload worker (if one was started)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._stop_offload()


__all__ = ["Average", "Sum", "DistributedOptimizer", "Route", "Bucket", "ConfigError"]
