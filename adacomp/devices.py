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


__all__ = ["EMULATE", "reads_wait"]
