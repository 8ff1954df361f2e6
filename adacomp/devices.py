"""Which tensors live where reading a result back makes the host wait.

On an accelerator, ``float(t)``, ``.item()``, ``.tolist()``, ``nonzero`` and boolean indexing wait
for the device to finish everything queued before them; inside backward that stops the host
queueing kernels ahead (issue 33: ~0.1 ms per wait on an H100, hundreds per step in the threshold
searches). The code paths that avoid such reads (deferred checks, batched counts, device-side tie
fills) are taken where :func:`reads_wait` says so.

``ADACOMP_EMULATE_ACCELERATOR=1`` (or :data:`EMULATE` set in-process) takes those paths on the CPU
too, so the accelerators' code runs, and its reads can be counted, where no GPU is lent (with
``ADACOMP_NATIVE=0`` for the torch path the accelerators use).
"""
from __future__ import annotations

import os

import torch

EMULATE = os.environ.get("ADACOMP_EMULATE_ACCELERATOR", "0") not in ("", "0")
"""Take the accelerators' code paths for CPU tensors too (tests, ``adacomp bench gpu_step --device cpu``)."""


def reads_wait(t: torch.Tensor | torch.device) -> bool:
    """Whether reading a result of ``t`` (a tensor or a device) back to the host waits for a device."""
    device = t if isinstance(t, torch.device) else t.device
    return device.type != "cpu" or EMULATE


PINNED_UPLOAD = True
""":func:`upload` stages through pinned memory (``False``: torch's pageable copy, for an A/B)."""


def upload(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without a host wait: ``torch.tensor(..., device=)``
    copies from pageable memory, which waits for the stream (lease 3 counted 223 of MSTop-k's 661
    waits there); a pinned staging copy queues instead (torch's pinned allocator keeps the block
    until the copy has run)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda" or not PINNED_UPLOAD:
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


__all__ = ["EMULATE", "reads_wait", "upload"]
