"""Error-feedback memory: ``compensate`` adds what earlier steps did not send, ``update`` stores
what this step did not send. GRACE's split (Memory / Compressor / Communicator), with residuals kept
per tensor name and checkpointable.
"""
from __future__ import annotations

import copy
from typing import Any, ClassVar

from torch import Tensor

from adacomp.registry import Registry

registry: Registry["Memory"] = Registry("memory", "adacomp.memories")
register = registry.register


class Memory:
    """Base class. ``compensate`` is called on the raw gradient before compression; ``update`` after
    compression with the payload this rank contributed (or, for multi-round compressors, the mean
    payload of the last round) and the compressor that made it."""

    name: ClassVar[str] = "base"

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        raise NotImplementedError

    def update(self, tensor: Tensor, name: str, compressor: Any, payload: list[Tensor], ctx: Any) -> None:
        raise NotImplementedError

    def check(self, compressor: Any) -> None:
        """Raise ValueError when this memory cannot work with ``compressor`` (checked when the
        config is loaded and when the optimizer is built, before any collective)."""

    def reset(self, name: str | None = None) -> None:
        """Drop stored state (all names when ``name`` is None), e.g. when a tensor's route changes."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"memory {self.name!r} is stateless but got state keys {sorted(state)}")

    def snapshot(self) -> Any:
        """Everything needed to undo one round (a non-finite step); a copy unless a subclass
        knows it never modifies stored tensors in place."""
        return copy.deepcopy(self.state_dict())

    def restore(self, snap: Any) -> None:
        self.load_state_dict(copy.deepcopy(snap))

    def rescale(self, factor: float) -> None:
        """Multiply stored state by ``factor`` (the loss scale changed; see
        :class:`adacomp.engine.error_feedback.LossScale`). Stateless memories have nothing to do."""
        if self.state_dict():
            raise NotImplementedError(f"memory {self.name!r} keeps state but cannot follow a changing "
                                      "loss scale; implement rescale()")


def get(name: str, **params: Any) -> Memory:
    return registry.get(name, **params)


def names() -> list[str]:
    return registry.names()


@register("none")
class NoneMemory(Memory):
    """No error feedback: what compression drops is lost."""

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        return tensor

    def update(self, tensor: Tensor, name: str, compressor: Any, payload: list[Tensor], ctx: Any) -> None:
        return None


@register("residual")
class ResidualMemory(Memory):
    """Classic error feedback (EF-SGD; ADTopk paper §2.2, GRACE's ResidualMemory).

    compensate: ``g + beta * r``; update: ``r = compensated - decompress(compress(compensated))``.
    ``beta`` scales the residual (1.0 = plain error feedback); ``gamma`` scales the new gradient.
    """

    def __init__(self, beta: float = 1.0, gamma: float = 1.0):
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {gamma}")
        self.beta = float(beta)
        self.gamma = float(gamma)
        self.residuals: dict[str, Tensor] = {}

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        r = self.residuals.get(name)
        if self.gamma != 1.0:
            tensor = tensor * self.gamma
        if r is None:
            return tensor
        if r.shape != tensor.shape:
            raise ValueError(f"residual for {name!r} has shape {tuple(r.shape)} but the gradient has "
                             f"{tuple(tensor.shape)}; call memory.reset({name!r}) after changing the model")
        return tensor + r if self.beta == 1.0 else tensor + self.beta * r

    def update(self, tensor: Tensor, name: str, compressor: Any, payload: list[Tensor], ctx: Any) -> None:
        sent = compressor.decompress(payload, ctx)
        self.residuals[name] = tensor - sent.view_as(tensor)

    def reset(self, name: str | None = None) -> None:
        if name is None:
            self.residuals.clear()
        else:
            self.residuals.pop(name, None)

    def snapshot(self) -> Any:
        # compensate / update never write into a stored residual (update replaces it), so
        # references are a faithful snapshot at no copy cost.
        return dict(self.residuals)

    def restore(self, snap: Any) -> None:
        self.residuals = dict(snap)

    def rescale(self, factor: float) -> None:
        self.residuals = {k: v * factor for k, v in self.residuals.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": {k: v.detach().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}
