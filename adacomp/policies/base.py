"""Policies decide, between steps, what to compress, how much, and with which collective.

A policy observes each finished step's :class:`~adacomp.metrics.StepStats` and may change compressor
parameters, communicators or per-layer assignments through the optimizer's public methods. The
same decision must be applied on every rank: decide on rank 0 and broadcast
(``optimizer.backend.broadcast_object``) or compute from allreduced inputs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from adacomp.metrics import StepStats
from adacomp.registry import Registry

if TYPE_CHECKING:
    from adacomp.optimizer import DistributedOptimizer

registry: Registry["Policy"] = Registry("policy", "adacomp.policies")
register = registry.register


class Policy:
    """Base class; ``attach`` runs once when the optimizer is built, ``after_step`` after each step."""

    name: ClassVar[str] = "base"

    def attach(self, optimizer: "DistributedOptimizer") -> None:
        self.optimizer = optimizer

    def after_step(self, optimizer: "DistributedOptimizer", stats: StepStats) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"policy {self.name!r} is stateless but got keys {sorted(state)}")


def get(name: str, **params: Any) -> Policy:
    return registry.get(name, **params)


def names() -> list[str]:
    return registry.names()


@register("static")
class StaticPolicy(Policy):
    """The configuration as written, for the whole run."""

    def after_step(self, optimizer: "DistributedOptimizer", stats: StepStats) -> None:
        return None
