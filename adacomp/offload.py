"""CPU offload of compression (ByteComp §4.2 Dimension 2 / Alg. 2: "compress on CPU").

One job: run a bucket's error compensation and compression on one worker thread, so the
accelerator (or the thread running backward) keeps going. Only compression moves: collectives
are still launched from the backward / ``synchronize()`` thread in bucket-index order
(DESIGN.md, ordering rule), which is why the job returns entries rather than sending them.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from adacomp.backends.base import Backend
from adacomp.communicators.base import Entry
from adacomp.routes import Bucket


class OffloadMixin:
    """The worker thread of :class:`~adacomp.optimizer.DistributedOptimizer`, started lazily on
    the first offloaded bucket. Needs ``backend``, ``_begin_step``, ``_finite_grads`` and
    ``_entries`` from the optimizer."""

    backend: Backend
    _pool: ThreadPoolExecutor | None

    def _submit(self, b: Bucket) -> None:
        """Hand bucket ``b``'s compensation and compression to the CPU worker thread. Gradients
        on an accelerator are copied to pinned host memory first; the collective itself is
        launched later from this thread, in bucket order (:meth:`_launch_ready`)."""
        self._begin_step()
        grads = self._finite_grads(b)
        event = None
        if grads[0].device.type != "cpu":
            host = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True).copy_(g, non_blocking=True) for g in grads]
            event = torch.cuda.Event()
            event.record()
            grads = host
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="adacomp-offload")
        b.job = self._pool.submit(self._offloaded, b, grads, event)

    def _offloaded(self, b: Bucket, grads: list[Tensor], event: Any) -> tuple[list[Entry], float]:
        """Runs on the worker: wait for the host copy, then compensate and compress."""
        if event is not None:
            event.synchronize()
        t0 = time.perf_counter()
        entries = self._entries(b, grads)
        b.communicator.precompress(entries, self.backend.size())
        return entries, time.perf_counter() - t0

    def _stop_offload(self) -> None:
        """Join the worker thread (if one was started); a later offloaded bucket starts a new one."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["OffloadMixin"]
