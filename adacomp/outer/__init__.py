"""Local steps with a compressed outer synchronisation: the DiLoCo family (docs/algorithms.md).

``registry`` holds the outer optimizers (``nesterov``, ``sgd``; :mod:`adacomp.outer.optimizers`);
:class:`adacomp.outer.loop.OuterLoop` runs the synchronisations for
:class:`~adacomp.engine.optimizer.DistributedOptimizer` when a config has ``local_steps``.
"""
from __future__ import annotations

from typing import Any

from adacomp import registry as registries

registry = registries.outer_optimizers
register = registry.register


def get(name: str, **params: Any) -> Any:
    return registry.get(name, **params)


def names() -> list[str]:
    return registry.names()
