"""Flat views of tensors without a dispatcher call where the tensor is flat already.

A ``reshape(-1)`` / ``view(-1)`` of a 1-D tensor returns an alias of the same elements, but it is
still an aten view op (~1.5 us warm, more after a pass has evicted the interpreter's data). The
per-tensor path makes several a compressed tensor, and the divisible scheme's parts made ~1000 of
them a ResNet-50 step (docs/results/cost_notes.md item 85). These helpers return the 1-D tensor
itself: the same storage, offset, size and stride, so no caller can tell but by object identity.
"""
from __future__ import annotations

from torch import Tensor


class Dispatch:
    """``skip_no_ops``: leave out the dispatches that change nothing (on by default; off only to time
    them, in one process: ``adacomp bench cost cell --toggle adacomp.tensors:Dispatch.skip_no_ops``)."""

    skip_no_ops = True


def flat_of(t: Tensor) -> Tensor:
    """``t.reshape(-1)`` (a copy only where reshape copies), or ``t`` itself when it is 1-D."""
    return t if t.dim() == 1 and Dispatch.skip_no_ops else t.reshape(-1)


def flat_view(t: Tensor) -> Tensor:
    """``t.view(-1)`` (which raises where no view exists), or ``t`` itself when it is 1-D."""
    return t if t.dim() == 1 and Dispatch.skip_no_ops else t.view(-1)


def same_elements(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of the very same elements (where ``a.copy_(b)`` is a no-op,
    which torch finds only after a dispatch)."""
    return (Dispatch.skip_no_ops and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


__all__ = ["Dispatch", "flat_of", "flat_view", "same_elements"]
