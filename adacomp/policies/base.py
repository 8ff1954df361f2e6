"""Policies decide, between steps, what to compress, how much, and with which collective.

A policy observes each finished step's :class:`~adacomp.engine.metrics.StepStats` and may change compressor
parameters, communicators or per-layer assignments through the optimizer's public methods. The
same decision must be applied on every rank: decide on rank 0 and broadcast
(``optimizer.backend.broadcast_object``) or compute from allreduced inputs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Protocol

from adacomp.engine.metrics import StepStats
from adacomp import registry as registries

if TYPE_CHECKING:
    from torch import Tensor

    from adacomp.backends.base import Backend
    from adacomp.config import ComponentSpec, Config


class Host(Protocol):
    """What a policy may use of the optimizer it is attached to (DistributedOptimizer implements
    it): read the configuration, parameters, routes and buckets; turn the knobs between steps;
    snapshot / restore for exploration. Nothing else of the optimizer is a policy's business."""

    config: "Config"
    backend: "Backend"
    params: list[tuple[str, "Tensor"]]
    steps: int
    steps_per_epoch: int | None
    backward_passes_per_step: int

    @property
    def buckets(self) -> list[Any]: ...
    def parameter(self, name: str) -> "Tensor": ...
    def compressor_for(self, name: str) -> Any: ...
    def route_of(self, name: str) -> Any: ...
    def bucket_of(self, name: str) -> Any: ...
    def is_fused(self, name: str) -> bool: ...
    def set_communicator(self, bucket_index: int, communicator: Any) -> None: ...
    def observe_gradients(self, fn: Callable[[str, "Tensor"], None]) -> None: ...
    def set_density(self, density: float, names: Iterable[str] | None = None) -> None: ...
    def set_route(self, name: str, compressor: "ComponentSpec | None" = None, memory: "ComponentSpec | None" = None,
                  communicator: "ComponentSpec | None" = None, offload: bool | None = None) -> None: ...
    def snapshot(self) -> dict[str, Any]: ...
    def restore(self, snap: dict[str, Any]) -> None: ...

registry = registries.policies
register = registry.register


class Policy:
    """Base class; ``attach`` runs once when the optimizer is built, ``after_step`` after each step."""

    name: ClassVar[str] = "base"
    #: reads ``StepStats.gain``: the engine measures the compression gain only then (it costs a read
    #: of every compressed tensor)
    reads_gain: ClassVar[bool] = False

    def attach(self, optimizer: "Host") -> None:
        self.optimizer = optimizer

    def after_step(self, optimizer: "Host", stats: StepStats) -> None:
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

    def after_step(self, optimizer: "Host", stats: StepStats) -> None:
        return None
