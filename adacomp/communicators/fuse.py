"""Pack many tensors into one flat buffer per dtype and back: one collective per bucket."""
from __future__ import annotations

import torch
from torch import Tensor


def flatten(tensors: list[Tensor]) -> tuple[Tensor, list[tuple[torch.Size, int]]]:
    """Concatenate ``tensors`` (one dtype) into a flat buffer; return it and the layout."""
    layout = [(t.shape, t.numel()) for t in tensors]
    if len(tensors) == 1:
        return tensors[0].reshape(-1).clone() if not tensors[0].is_contiguous() else tensors[0].reshape(-1), layout
    return torch.cat([t.reshape(-1) for t in tensors]), layout


def unflatten(buf: Tensor, layout: list[tuple[torch.Size, int]]) -> list[Tensor]:
    out, off = [], 0
    for shape, n in layout:
        out.append(buf[off:off + n].view(shape))
        off += n
    return out
