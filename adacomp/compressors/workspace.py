"""Recycled CPU buffers: scratch that never leaves its owner, and dense outputs handed out again only
once nobody holds them. Why: on CPU a fresh 64 MiB tensor costs ~5 memory passes in page faults."""
from __future__ import annotations

import torch
from torch import Tensor

RECYCLE_MIN_NUMEL = 1 << 18  # below ~1 MiB the allocator reuses heap memory without page faults


def _storage_users(t: Tensor) -> int | None:
    """Tensors sharing ``t``'s storage (``t`` itself included), or None where torch cannot tell."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    return int(use_count(t.untyped_storage()._cdata)) - 1  # minus the temporary storage object


class Workspace:
    """Per-compressor (or per-communicator) memory reused across calls; not state (never in
    ``state_dict``).

    ``scratch`` buffers never leave their owner. ``zeros`` / ``output`` hand out a dense output as a
    *view* of a kept buffer and reuse that buffer only once no other tensor shares its storage, so an
    output the caller still holds (a gradient, a list of decompressed tensors) is never rewritten.
    ``POOL`` buffers are kept per shape and dtype: an output installed as ``p.grad`` and held until
    the next step leaves the other one free. Only CPU outputs of >= ``RECYCLE_MIN_NUMEL`` elements
    are recycled (CUDA has a caching allocator).
    """

    POOL = 2
    POOL_MAX = 256
    """A key's pool grows past ``POOL`` while every buffer in it is held (a model has many tensors of
    one shape, e.g. GPT-2's 24 of 768 x 3072 elements, all installed as gradients at once), up to
    this many; before, the pool evicted a held buffer and every such output was a fresh allocation
    (page faults on each multi-MB tensor, each step)."""

    def __init__(self) -> None:
        self._scratch: dict[tuple, Tensor] = {}
        self._outputs: dict[tuple, list[Tensor]] = {}

    def scratch(self, tag: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        key = (tag, dtype, str(device))
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[key] = buf
        return buf[:numel]

    def _recycled(self, key: tuple, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, bool]:
        """A kept buffer nobody else holds (True) or a fresh one, kept while the pool has room."""
        pool = self._outputs.setdefault(key, [])
        for buf in pool:
            if _storage_users(buf) == 1:
                return buf, True
        buf = torch.empty(numel, dtype=dtype, device=device)
        if _storage_users(buf) is not None:
            if len(pool) >= self.POOL_MAX:
                pool.pop(0)
            pool.append(buf)  # every kept buffer is in use: keep this one too (see POOL_MAX)
        return buf, False

    def zeros(self, shape: torch.Size, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        if device.type != "cpu" or numel < RECYCLE_MIN_NUMEL:
            return torch.zeros(shape, dtype=dtype, device=device)
        buf, _ = self._recycled((numel, dtype), numel, dtype, device)
        return buf.zero_().view(shape)

    def output(self, shape: torch.Size, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised dense output with :meth:`zeros`' recycling rule (for callers that
        overwrite every element, e.g. a quantiser's decode)."""
        if device.type != "cpu" or numel < RECYCLE_MIN_NUMEL:
            return torch.empty(shape, dtype=dtype, device=device)
        buf, _ = self._recycled(("empty", numel, dtype), numel, dtype, device)
        return buf.view(shape)

    def transfer(self, tag: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised flat buffer of ``numel`` elements for a transfer whose size changes from
        call to call (a bucket's packed payloads, their gather), with :meth:`zeros`' recycling rule:
        a kept buffer of at least ``numel`` elements that nobody else holds (in-flight collectives
        and the caller's views hold theirs), else a fresh one with 1/8 headroom, kept in place of a
        free one too small or beside the busy ones (up to ``POOL_MAX``). Why: the fresh multi-MB
        buffers of each step page-faulted on alternate steps (glibc returns and re-maps them):
        VGG-16's Top-k spent ~20 ms of a ~70 ms step in those faults every other step."""
        if device.type != "cpu" or numel < RECYCLE_MIN_NUMEL:
            return torch.empty(numel, dtype=dtype, device=device)
        pool = self._outputs.setdefault(("transfer", tag, dtype), [])
        free = [b for b in pool if _storage_users(b) == 1]
        fits_ = [b for b in free if b.numel() >= numel]
        if fits_:
            return min(fits_, key=Tensor.numel)[:numel]
        buf = torch.empty(numel + numel // 8, dtype=dtype, device=device)
        if _storage_users(buf) is not None:
            if free:  # too small for what comes now; by identity (list.remove would compare tensors)
                pool[:] = [b for b in pool if b is not free[0]]
            elif len(pool) >= self.POOL_MAX:
                pool.pop(0)
            pool.append(buf)
        return buf[:numel]

    def magnitudes(self, flat: Tensor) -> Tensor:
        """|flat| as float32 in a scratch buffer (one pass, no allocation after the first call)."""
        a = self.scratch("abs", flat.numel(), torch.float32, flat.device)
        if flat.dtype == torch.float32:
            return torch.abs(flat, out=a)
        return a.copy_(flat).abs_()


class Kept:
    """What a fused pass learnt about a tensor while writing it (error feedback's compensation:
    Top-k's candidates, EF-SignSGD's scale and signs, Gaussian-k's mean), held per tensor name for
    the compressor's next call on that tensor. :meth:`take` gives it back only if the tensor is the
    one that pass wrote and unchanged since (same storage, size and version counter); not state."""

    def __init__(self) -> None:
        self._by_name: dict[str, tuple[int, int, int, object]] = {}

    def keep(self, name: str, tensor: Tensor, value: object) -> None:
        self._by_name[name] = (tensor.data_ptr(), tensor.numel(), tensor._version, value)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def take(self, name: str, tensor: Tensor) -> object | None:
        got = self._by_name.pop(name, None)
        if got is None or got[:3] != (tensor.data_ptr(), tensor.numel(), tensor._version):
            return None
        return got[3]
