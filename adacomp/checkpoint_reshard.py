"""Resume a checkpoint set on another world size: the rule for per-rank error-feedback state.

Why a rule is needed: error feedback keeps, on every rank ``r``, what compression has not sent yet
(the residual ``e_r``; DGC's memory keeps two such tensors, the velocity ``u_r`` and the
accumulated velocity ``v_r``, DGC paper Sec. 3.2 / Alg. 1 lines 8-14). The *averaged* update of a
world of ``W`` ranks still owes ``(1/W) * sum_r e_r``. Dropping ranks' residuals (2 -> 1) loses
part of that debt; copying rank 0's residual to every rank (the DDP habit of one file for all)
replaces it by ``e_0``.

Each component knows its own rule, and :func:`reshard` asks it (``reshard(states, world,
rank)`` on the live object, or on one built from a saved route's spec), for ``W_old`` ranks
resumed on ``W_new``:

* **error-feedback memories** (``Memory.reshard``): every new rank gets the mean over the old
  ranks, ``e'_s = (1/W_old) * sum_r e_r`` (a name missing on a rank counts as zero). Then
  ``(1/W_new) * sum_s e'_s = (1/W_old) * sum_r e_r``: what the averaged update still owes is
  kept exactly (up to float rounding), and every rank starts from the same memory.
* **the divisible scheme's second-stage error** (the memory the ``alltoall`` communicator
  declares, :class:`adacomp.memories.parts.PartResidualMemory`): rank ``r`` keeps the error of
  part ``r`` of the averaged tensor (ByteComp Sec. 4.2 / Fig. 4), so the old parts are
  concatenated in rank order and cut again into ``W_new`` parts; each coordinate's residual moves
  to its new owner unchanged.
* **the outer loop** recurses into each fragment's components.
* everything else (model, wrapped optimizer, compressor generators and thresholds, policy) comes
  from old rank ``s % W_old``; those are equal on every rank or only seed per-rank randomness.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

STATE_KEY = "adacomp"


def _io(owner: Any) -> Any:
    io = getattr(owner, "io", None)
    if io is None or not hasattr(io, "reshard"):
        raise ValueError(f"resharding adacomp state needs the live adacomp.DistributedOptimizer (its components "
                         f"know their rules); got {type(owner).__name__}")
    return io


def reshard(states: list[dict[str, Any]], world_size: int, rank: int, owner: Any) -> dict[str, Any]:
    """The optimizer state for ``rank`` of ``world_size`` from the states of every old rank (in
    rank order), by the rules in the module docstring. ``states[r]`` is old rank r's
    ``DistributedOptimizer.state_dict()`` (wrapped optimizer keys plus ``"adacomp"``); ``owner``
    is the optimizer the state will be loaded into."""
    if not states:
        raise ValueError("reshard needs the state of at least one old rank")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    out = dict(states[rank % len(states)])
    if isinstance(out.get(STATE_KEY), dict) and "components" in out[STATE_KEY]:
        out[STATE_KEY] = _io(owner).reshard([s[STATE_KEY] for s in states], world_size, rank)
    return out


def owed(states: list[dict[str, Any]], owner: Any) -> dict[str, Tensor]:
    """What the averaged update of the ranks whose optimizer ``states`` are given still owes, per
    component and tensor (what :func:`reshard` keeps; for checks and tests)."""
    return _io(owner).owed([s[STATE_KEY] for s in states])


__all__ = ["owed", "reshard"]
