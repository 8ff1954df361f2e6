"""Backward side of a step: gradient hooks, and bucket launches in bucket-index order.

A hook on every parameter fires once its gradient is accumulated (wait-free back-propagation);
when every gradient of a bucket has counted, ready buckets are launched strictly in index order
(a ready bucket waits for its predecessors), so every rank issues the same sequence of
collectives even when hooks fire in a different order (DESIGN.md, ordering rule).
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import Tensor

from adacomp import watchdog
from adacomp.backends.base import Backend
from adacomp.communicators.base import CommEnv, Entry
from adacomp.compressors.base import Compressor
from adacomp.config import Config
from adacomp.metrics import StepStats
from adacomp.offload import OffloadMixin
from adacomp.routes import Bucket


class HookMixin(OffloadMixin):
    """Hooks and launches of :class:`~adacomp.optimizer.DistributedOptimizer`. Needs the per-step
    bookkeeping that the optimizer's ``_reset_step`` creates, the route tables and
    ``adacomp_state_dict``."""

    config: Config
    backend: Backend
    backward_passes_per_step: int
    buckets: list[Bucket]
    _bucket_of: dict[str, Bucket]
    _compressors: dict[str, Compressor]
    _param_by_name: dict[str, Tensor]
    _passes: dict[str, int]
    _nonfinite: list[str]
    _next_launch: int
    _launched_any: bool
    _step_started: bool
    _synchronized: bool
    _pre_state: dict[str, Any]
    _stats: StepStats
    _env: CommEnv

    def _make_hook(self, name: str) -> Callable[[Tensor], None]:
        def hook(p: Tensor) -> None:
            self._on_grad(name, p)
        return hook

    def _begin_step(self) -> None:
        if not self._step_started:
            self._step_started = True
            if self.config.nonfinite == "skip":
                # `skip` must leave residuals / thresholds / factors / policy accumulators as they
                # were before this step's first hook: keep a copy (the price of this mode).
                self._pre_state = copy.deepcopy(self.adacomp_state_dict())

    def _on_grad(self, name: str, p: Tensor) -> None:
        self._begin_step()
        if self._synchronized:
            raise RuntimeError(
                "a gradient was computed after synchronize() and before step(); call step() "
                "(inside `with opt.skip_synchronize():`) before the next backward")
        self._passes[name] += 1
        if self._passes[name] > self.backward_passes_per_step:
            raise RuntimeError(
                f"gradients of {name!r} were computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before step(); increase "
                "backward_passes_per_step to accumulate gradients locally")
        if self._passes[name] < self.backward_passes_per_step:
            return
        b = self._bucket_of[name]
        b.ready += 1
        if b.ready == len(b.names):
            if b.route.offload:
                self._submit(b)
            with watchdog.guard(self.backend):
                self._launch_ready()

    def _launch_ready(self, block: bool = False) -> None:
        """Launch ready buckets in index order; an offloaded bucket whose compression is still
        running stops the walk unless ``block`` (then it is waited for)."""
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if b.ready != len(b.names) or (b.job is not None and not block and not b.job.done()):
                return
            self._launch(b)
            self._next_launch += 1

    def _grad(self, name: str) -> Tensor:
        p = self._param_by_name[name]
        if p.grad is None:  # unused parameter: contribute zeros so every rank sends the same shapes
            p.grad = torch.zeros_like(p)
        return p.grad

    def _finite_grads(self, b: Bucket) -> list[Tensor]:
        grads = [self._grad(n) for n in b.names]
        for n, g in zip(b.names, grads):
            # A sum is one cheap pass and is NaN/Inf whenever g holds one; a finite-but-overflowing
            # sum is confirmed with the exact (slower) test before anything is reported.
            if not torch.isfinite(g.sum()) and not torch.isfinite(g).all():
                self._nonfinite.append(n)
        return grads

    def _entries(self, b: Bucket, grads: list[Tensor]) -> list[Entry]:
        """Error-compensated entries of bucket ``b`` (one per parameter, or one fused)."""
        mem = b.route.memory
        if b.fused_compressor is not None:
            flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
            key = f"bucket{b.index}"
            return [Entry(key, mem.compensate(flat, key), b.fused_compressor, mem)]
        return [Entry(n, mem.compensate(g, n), self._compressors[n], mem) for n, g in zip(b.names, grads)]

    def _launch(self, b: Bucket) -> None:
        self._begin_step()  # launched from synchronize() without any hook
        self._launched_any = True
        self._env.bucket_index = b.index
        if b.job is not None:
            b.entries, dt = b.job.result()  # re-raises a failure of the worker here
            b.job = None
            self._stats.extra["offload_s"] = self._stats.extra.get("offload_s", 0.0) + dt
        else:
            grads = self._finite_grads(b)
            with self._stats.timing("compress"):
                b.entries = self._entries(b, grads)
        b.pending = b.communicator.start(b.entries, self._env)


__all__ = ["HookMixin"]
