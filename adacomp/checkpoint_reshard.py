"""Resume a checkpoint set on another world size: the rule for per-rank error-feedback state.

Why a rule is needed: error feedback keeps, on every rank ``r``, what compression has not sent yet
(the residual ``e_r``; DGC's memory keeps two such tensors, the velocity ``u_r`` and the
accumulated velocity ``v_r``, DGC paper Sec. 3.2 / Alg. 1 lines 8-14). The *averaged* update of a
world of ``W`` ranks still owes ``(1/W) * sum_r e_r``. Dropping ranks' residuals (2 -> 1) loses
part of that debt; copying rank 0's residual to every rank (the DDP habit of one file for all)
replaces it by ``e_0``.

The rule (:func:`reshard`), for ``W_old`` ranks resumed on ``W_new``:

* **error-feedback memory** (any ``{"residuals": {name: Tensor}}`` and DGC's ``{"velocity",
  "accumulated"}`` found under ``state["adacomp"]["components"]``, outside a communicator): every
  new rank gets the mean over the old ranks, ``e'_s = (1/W_old) * sum_r e_r`` (a name missing on a
  rank counts as zero). Then ``(1/W_new) * sum_s e'_s = (1/W_old) * sum_r e_r``: what the averaged
  update still owes -- the sum of residuals per averaged worker -- is kept exactly (up to float
  rounding), and every rank starts from the same memory.
* **partitioned communicator residuals** (a ``{"residuals": ...}`` under a key with
  ``communicator`` in it: ByteComp's divisible scheme keeps, on rank ``r``, the second-stage error
  of part ``r`` of the averaged tensor, ByteComp Sec. 4.2 / Fig. 4): the old parts are concatenated
  in rank order and split again into ``W_new`` parts (``alltoall.bounds``), so each coordinate's
  residual moves to its new owner unchanged.
* everything else (model, wrapped optimizer, compressor generators and thresholds, policy) comes
  from old rank ``s % W_old``; those are equal on every rank or only seed per-rank randomness.
"""
from __future__ import annotations

from typing import Any, Callable, cast

import torch
from torch import Tensor

_MEMORY_KEYS = (frozenset({"residuals"}), frozenset({"velocity", "accumulated"}))


def _tensor_maps(node: dict[str, Any]) -> list[str]:
    """The keys of ``node`` that hold per-name error-feedback tensors, or [] if it is not a memory."""
    keys = frozenset(k for k, v in node.items() if isinstance(v, dict))
    for shape in _MEMORY_KEYS:
        if shape <= keys and all(isinstance(t, Tensor) for k in shape for t in node[k].values()):
            return sorted(shape)
    return []


def _mean(path: str, tensors: list[Tensor | None], w_old: int, _w_new: int, _s: int) -> Tensor:
    present = [t for t in tensors if t is not None]
    shapes = {tuple(t.shape) for t in present}
    if len(shapes) != 1:
        raise ValueError(f"cannot resume {path} on another world size: its shape differs across the "
                         f"old ranks ({sorted(shapes)}); expected one shape per tensor name")
    acc = torch.zeros_like(present[0], dtype=torch.float64)
    for t in present:
        acc += t.to(torch.float64)
    return (acc / w_old).to(present[0].dtype)


def _repartition(path: str, tensors: list[Tensor | None], _w_old: int, w_new: int, s: int) -> Tensor:
    from adacomp.communicators.alltoall import bounds
    if any(t is None for t in tensors):
        missing = [r for r, t in enumerate(tensors) if t is None]
        raise ValueError(f"cannot resume {path} on another world size: old ranks {missing} have no part of it")
    flat = torch.cat([t.reshape(-1) for t in cast("list[Tensor]", tensors)])  # none is None (checked above)
    lo, hi = bounds(flat.numel(), w_new)[s]
    return flat[lo:hi].clone()


def _rule_for(path: str) -> Callable[..., Tensor]:
    """Communicator residuals are parts of the averaged tensor; memory residuals are per rank."""
    return _repartition if "communicator" in path else _mean


def _merge(path: str, nodes: list[Any], w_old: int, w_new: int, s: int) -> Any:
    """``nodes[r]`` is the same place in old rank r's state; returns the node for new rank ``s``."""
    base = nodes[s % w_old]
    if not isinstance(base, dict):
        return base
    maps = _tensor_maps(base)
    out: dict[Any, Any] = {}
    for k, v in base.items():
        child = [n.get(k) if isinstance(n, dict) else None for n in nodes]
        if k in maps:
            rule = _rule_for(path)
            names = sorted({name for c in child if isinstance(c, dict) for name in c})
            out[k] = {name: rule(f"{path}/{k}/{name}", [c.get(name) if isinstance(c, dict) else None for c in child],
                                 w_old, w_new, s) for name in names}
        else:
            out[k] = _merge(f"{path}/{k}", child, w_old, w_new, s)
    return out


def reshard(states: list[dict[str, Any]], world_size: int, rank: int) -> dict[str, Any]:
    """The optimizer state for ``rank`` of ``world_size`` from the states of every old rank (in
    rank order), by the rule in the module docstring. ``states[r]`` is old rank r's
    ``DistributedOptimizer.state_dict()`` (wrapped optimizer keys plus ``"adacomp"``)."""
    if not states:
        raise ValueError("reshard needs the state of at least one old rank")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    w_old = len(states)
    base = states[rank % w_old]
    out = dict(base)
    ada = [s.get("adacomp") if isinstance(s, dict) else None for s in states]
    mine = ada[rank % w_old]
    if isinstance(mine, dict) and "components" in mine:
        comps = [a.get("components", {}) if isinstance(a, dict) else {} for a in ada]
        out["adacomp"] = {**mine,
                          "components": _merge("adacomp/components", comps, w_old, world_size, rank)}
    return out


def owed(states: list[dict[str, Any]]) -> dict[str, Tensor]:
    """``(1/W) * sum_r e_r`` per error-feedback tensor (path -> tensor): what :func:`reshard` keeps.
    For checks and tests; communicator parts are concatenated instead of averaged."""
    out: dict[str, Tensor] = {}
    w = len(states)

    def walk(path: str, nodes: list[Any]) -> None:
        base = nodes[0]
        if not isinstance(base, dict):
            return
        maps = _tensor_maps(base)
        for k in base:
            child = [n.get(k) if isinstance(n, dict) else None for n in nodes]
            if k in maps:
                for name in sorted({x for c in child if isinstance(c, dict) for x in c}):
                    ts = [c.get(name) if isinstance(c, dict) else None for c in child]
                    key = f"{path}/{k}/{name}"
                    if "communicator" in path:
                        out[key] = torch.cat([t.reshape(-1) for t in ts if t is not None])
                    else:
                        out[key] = sum((t.to(torch.float64) for t in ts if t is not None),
                                       torch.zeros((), dtype=torch.float64)) / w
            else:
                walk(f"{path}/{k}", child)
    walk("adacomp/components", [s.get("adacomp", {}).get("components", {}) for s in states])
    return out


__all__ = ["owed", "reshard"]
