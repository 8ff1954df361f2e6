"""Checkpointable state of :class:`~adacomp.optimizer.DistributedOptimizer`.

One job: turn every stateful component (per-parameter and per-bucket compressors, route
memories and communicators, the policy) into a ``state_dict`` and back, plus the in-memory
snapshot / restore that MOO exploration uses (DESIGN.md: algorithm state is an object with
``state_dict()``, like PyTorch's ``PowerSGDState``).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from adacomp.compressors.base import Compressor
from adacomp.routes import Bucket, Route

if TYPE_CHECKING:
    from adacomp.policies.base import Policy


class StateMixin:
    """``state_dict`` / ``load_state_dict`` / ``snapshot`` / ``restore``. Needs ``inner``,
    ``params``, ``steps``, ``policy``, the route tables and ``_reset_step`` from the optimizer."""

    inner: torch.optim.Optimizer
    params: list[tuple[str, Tensor]]
    steps: int
    policy: Policy
    buckets: list[Bucket]
    _routes: dict[str, Route]
    _compressors: dict[str, Compressor]

    def _components(self) -> dict[str, Any]:
        """Stateful components by stable key; routes are numbered in sorted key order so the
        numbering is the same on every rank and across restarts with the same config."""
        out: dict[str, Any] = {}
        for n, c in self._compressors.items():
            out[f"compressor/{n}"] = c
        for b in self.buckets:
            if b.fused_compressor is not None:
                out[f"compressor/bucket{b.index}"] = b.fused_compressor
        for i, r in enumerate(sorted(self._routes)):
            out[f"memory/{i}"] = self._routes[r].memory
            out[f"communicator/{i}"] = self._routes[r].communicator
        out["policy"] = self.policy
        return out

    def adacomp_state_dict(self, include_policy: bool = True) -> dict[str, Any]:
        return {"steps": self.steps,
                "components": {k: c.state_dict() for k, c in self._components().items()
                               if include_policy or k != "policy"}}

    def load_adacomp_state_dict(self, state: dict[str, Any]) -> None:
        comps = self._components()
        unknown = sorted(set(state["components"]) - set(comps))
        if unknown:
            raise ValueError(f"checkpoint has state for {unknown[:5]} which this optimizer does not have; "
                             "was it written with a different config or model?")
        for k, c in comps.items():
            if k == "policy" and k not in state["components"]:
                continue  # snapshots leave the policy alone: it is the one exploring
            c.load_state_dict(state["components"].get(k, {}))
        self.steps = int(state["steps"])
        self._reset_step()

    def state_dict(self) -> dict[str, Any]:
        """Wrapped optimizer state plus every compressor, memory, communicator and policy state."""
        return {"optimizer": self.inner.state_dict(), "adacomp": self.adacomp_state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "optimizer" not in state_dict or "adacomp" not in state_dict:
            raise ValueError("expected a DistributedOptimizer.state_dict() with keys 'optimizer' and 'adacomp'")
        self.inner.load_state_dict(state_dict["optimizer"])
        self.load_adacomp_state_dict(state_dict["adacomp"])

    def snapshot(self) -> dict[str, Any]:
        """An in-memory copy of parameters, optimizer, compressor and memory state (for MOO
        exploration). The policy's own state is not included: restoring must not undo the
        policy's record of what it explored."""
        return {"params": {n: p.detach().clone() for n, p in self.params},
                "state": copy.deepcopy({"optimizer": self.inner.state_dict(),
                                        "adacomp": self.adacomp_state_dict(include_policy=False)})}

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back exactly what :meth:`snapshot` saw (bitwise)."""
        with torch.no_grad():
            for n, p in self.params:
                p.copy_(snap["params"][n])
        self.load_state_dict(copy.deepcopy(snap["state"]))


__all__ = ["StateMixin"]
