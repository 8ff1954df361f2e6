"""Pack many tensors into one flat buffer per dtype and back: one collective per bucket."""
from __future__ import annotations

import torch
from torch import Tensor


def flatten(tensors: list[Tensor], cache: dict | None = None,
            key: object = None) -> tuple[Tensor, list[tuple[torch.Size, int]]]:
    """Concatenate ``tensors`` (one dtype) into a flat buffer; return it and the layout.

    With ``cache`` the buffer for ``key`` is reused across steps: a fresh multi-MB allocation
    every step costs page faults that are a large share of a CPU step (measured in
    ``adacomp bench dense``). The caller must be done with the previous step's buffer.
    """
    layout = [(t.shape, t.numel()) for t in tensors]
    total = sum(n for _, n in layout)
    ref = tensors[0]
    buf = None
    if cache is not None:
        buf = buffer(cache, key, total, ref.dtype, ref.device)
    if buf is None:
        if len(tensors) == 1:
            return ref.reshape(-1).clone(), layout
        return torch.cat([t.reshape(-1) for t in tensors]), layout
    if not _are_views_of(tensors, buf):  # gradients written back as views need no copy (see optimizer)
        _pack(tensors, buf)
    return buf, layout


def _pack(tensors: list[Tensor], buf: Tensor) -> None:
    """``torch.cat(tensors, out=buf)``, also where some of them lie in ``buf`` already: last round's
    averaged gradients handed back as views of it, beside a parameter no rank used whose zeros do not
    (Horovod scripts that keep gradients between steps); torch refuses a cat whose output overlaps its
    inputs. Those in their own slot stay; others in ``buf`` are copied out first."""
    storage = buf.untyped_storage().data_ptr()
    if all(t.untyped_storage().data_ptr() != storage for t in tensors):
        torch.cat([t.reshape(-1) for t in tensors], out=buf)
        return
    slots = buf.split([t.numel() for t in tensors])
    sources = [t if t.untyped_storage().data_ptr() != storage or (t.is_contiguous() and t.data_ptr() == s.data_ptr())
               else t.clone() for t, s in zip(tensors, slots)]
    for t, s in zip(sources, slots):
        if t.data_ptr() != s.data_ptr():
            s.copy_(t.reshape(-1))


def buffer(cache: dict, key: object, total: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The flat buffer :func:`flatten` packs ``key``'s tensors into (reused while its size, dtype and
    device stay), e.g. for payloads written straight into it."""
    buf = cache.get(key)
    if buf is None or buf.numel() != total or buf.dtype != dtype or buf.device != device:
        buf = torch.empty(total, dtype=dtype, device=device)
        cache[key] = buf
    return buf


def _are_views_of(tensors: list[Tensor], buf: Tensor) -> bool:
    """True when ``tensors`` already lie in ``buf`` back to back, in order (e.g. the optimizer left
    last step's averaged gradients there and backward accumulated into them in place)."""
    base, size, off = buf.data_ptr(), buf.element_size(), 0
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() != base + off * size:
            return False
        off += t.numel()
    return True


def unflatten(buf: Tensor, layout: list[tuple[torch.Size, int]]) -> list[Tensor]:
    out, off = [], 0
    for shape, n in layout:
        out.append(buf[off:off + n].view(shape))
        off += n
    return out
