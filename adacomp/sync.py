"""Start-of-training synchronisation: make every rank begin from rank ``root_rank``'s state."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

from adacomp import context
from adacomp.backends.base import Backend


def broadcast_parameters(params: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], root_rank: int = 0,
                         backend: Backend | None = None) -> None:
    """Overwrite ``params`` (a state_dict or named_parameters) in place with root's values.

    Tensors are fused per dtype into one broadcast each, so a model costs a few collectives.
    """
    be = backend or context.current()
    items = sorted(params.items() if isinstance(params, Mapping) else list(params), key=lambda kv: kv[0])
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for _, t in items:
        if isinstance(t, Tensor):
            by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        tensors = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        be.broadcast(flat, root=root_rank)
        off = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              backend: Backend | None = None) -> None:
    """Give every rank root's optimizer state (momentum buffers, step counts, hyper-parameters).

    For a :class:`~adacomp.DistributedOptimizer` only the wrapped optimizer's state is sent:
    error-feedback residuals are per rank by design.
    """
    be = backend or context.current()
    inner = getattr(optimizer, "inner", optimizer)
    state = be.broadcast_object(inner.state_dict() if be.rank() == root_rank else None, root=root_rank)
    inner.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, backend: Backend | None = None) -> Any:
    """Pickle-able ``obj`` from root to every rank."""
    return (backend or context.current()).broadcast_object(obj, root=root_rank)
