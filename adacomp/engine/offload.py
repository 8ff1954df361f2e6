"""CPU offload of compression (ByteComp §4.2 Dimension 2 / Alg. 2: "compress on CPU").

One job: run a bucket's error compensation and compression on one worker thread, so the
accelerator (or the thread running backward) keeps going. Only compression moves: collectives
are still launched by the step engine in bucket-index order (DESIGN.md, ordering rule), which is
why a job returns entries rather than sending them.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from adacomp.engine import error_feedback
from adacomp.compressors.base import Compressor
from adacomp.engine.error_feedback import Entry
from adacomp.engine.routes import Bucket


class OffloadWorker:
    """One worker thread, started on the first offloaded bucket."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, b: Bucket, grads: list[Tensor], compressors: dict[str, Compressor],
               used: list[bool] | None, world: int) -> Future:
        """Compensate and compress bucket ``b`` on the worker. Gradients on an accelerator are
        copied to pinned host memory first (the copy is ordered by a CUDA event)."""
        event = None
        if grads[0].device.type != "cpu":
            grads = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True).copy_(g, non_blocking=True)
                     for g in grads]
            event = torch.cuda.Event()
            event.record()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="adacomp-offload")
        return self._pool.submit(self._run, b, grads, compressors, used, world, event)

    @staticmethod
    def _run(b: Bucket, grads: list[Tensor], compressors: dict[str, Compressor], used: list[bool] | None,
             world: int, event: Any) -> tuple[list[Entry], float]:
        if event is not None:
            event.synchronize()
        t0 = time.perf_counter()
        entries = error_feedback.entries(b, grads, compressors, used, world)
        b.communicator.precompress(entries, world)
        return entries, time.perf_counter() - t0

    def stop(self) -> None:
        """Join the worker thread (if one was started); a later offloaded bucket starts a new one."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["OffloadWorker"]
