"""Start-of-training synchronisation: make every rank begin from rank ``root_rank``'s state.

Inputs and effects follow Horovod's ``broadcast_parameters`` / ``broadcast_optimizer_state`` /
``broadcast_object`` so Horovod scripts keep working after ``import adacomp as hvd``.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

from adacomp.runtime import context
from adacomp.backends.base import Backend, broadcast_tensors
from adacomp.engine.hvd_keywords import ProcessSet, is_global, process_set_backend

Params = Mapping[str, Tensor] | Iterable[tuple[str, Tensor]] | Iterable[Tensor]


def _as_tensor_list(params: Params) -> list[Tensor]:
    """Tensors of a state_dict (sorted by name, as Horovod does), of ``named_parameters()`` or of a
    plain parameter list (both in the given order, which must be the same on every rank)."""
    if isinstance(params, Mapping):
        items = [v for _, v in sorted(params.items(), key=lambda kv: kv[0])]
    elif isinstance(params, (Tensor, str, bytes)) or not isinstance(params, Iterable):
        raise ValueError(f"invalid params of type {type(params).__name__}: expected a state_dict, "
                         "model.named_parameters() or a list of tensors such as list(model.parameters())")
    else:
        items = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
    bad = [type(t).__name__ for t in items if not isinstance(t, Tensor)]
    if bad and not isinstance(params, Mapping):
        raise ValueError(f"broadcast_parameters expects tensors (or (name, tensor) pairs), got {bad[:3]}")
    return [t for t in items if isinstance(t, Tensor)]


def _resolve(backend: Backend | None, process_set: Any, root_rank: int) -> tuple[Backend, int]:
    """The transport and the root as its rank: ``backend`` as given, else ``process_set``'s (the
    process's backend for the global set; ``root_rank`` is a global rank, as in Horovod). A process
    set where the backend goes is Horovod's positional order (``broadcast_object(obj, root_rank, name,
    process_set)``)."""
    if isinstance(backend, ProcessSet) and process_set is None:
        backend, process_set = None, backend
    if backend is not None or is_global(process_set):
        return backend or context.current(), root_rank
    be = process_set_backend(process_set, "Broadcast")
    if root_rank not in (process_set.ranks or []):
        raise ValueError(f"broadcast received invalid root rank {root_rank} for provided process set {process_set}")
    return be, process_set.ranks.index(root_rank)


def broadcast_parameters(params: Params, root_rank: int = 0, backend: Backend | None = None,
                         process_set: Any = None) -> None:
    """Overwrite ``params`` in place with root's values: a state_dict, ``named_parameters()`` or a
    list of tensors (``list(model.parameters())``), the three inputs Horovod accepts.
    ``process_set`` (an adacomp addition; Horovod 0.28.1's has none) limits it to a set's members.

    Tensors are fused per dtype into one broadcast each, so a model costs a few collectives.
    """
    be, root = _resolve(backend, process_set, root_rank)
    broadcast_tensors(be, _as_tensor_list(params), root)


def _sparse_param_ids(model: torch.nn.Module | None) -> set[int]:
    if model is None:
        return set()
    return {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.sparse
            for p in m.parameters()}


def initialise_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None) -> None:
    """Give a fresh optimizer its state (Adam's moments, momentum buffers) as Horovod does: zero
    gradients for every trainable parameter, then one step of the plain torch optimizer. The zero
    step leaves parameters unchanged unless the optimizer decays weights, and then equally on every
    rank. Gradients stay zero tensors afterwards (not None), as under Horovod."""
    sparse = _sparse_param_ids(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    optimizer.step()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: torch.nn.Module | None = None, backend: Backend | None = None,
                              process_set: Any = None) -> None:
    """Give every rank root's optimizer state (moments, momentum buffers, step counts and the
    hyper-parameters of every param group). A fresh optimizer is first initialised with
    :func:`initialise_state`, so a newly created Adam has state on every rank; ``model`` marks
    sparse embeddings, as in Horovod.

    For a :class:`~adacomp.DistributedOptimizer` only the wrapped optimizer's state is sent:
    error-feedback residuals are per rank by design. ``process_set``: as in :func:`broadcast_parameters`.
    """
    be, root_rank = _resolve(backend, process_set, root_rank)
    inner = getattr(optimizer, "inner", optimizer)
    if isinstance(inner, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (its state is not per parameter); "
                         "broadcast the model with broadcast_parameters and let each rank start L-BFGS fresh")
    if not inner.state_dict()["state"]:
        initialise_state(inner, model)
    state = be.broadcast_object(inner.state_dict() if be.rank() == root_rank else None, root=root_rank)
    inner.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, backend: Backend | None = None,
                     process_set: Any = None) -> Any:
    """Pickle-able ``obj`` from root to every rank. ``name`` is accepted for Horovod compatibility
    (collectives are matched by order here, not by name)."""
    be, root = _resolve(backend, process_set, root_rank)
    return be.broadcast_object(obj, root=root)
