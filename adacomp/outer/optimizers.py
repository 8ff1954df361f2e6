"""Outer optimizers: what the averaged pseudo-gradient does to the synchronised parameters.

DiLoCo (Douillard et al., 2023, Algorithm 1 line 12) treats the average over workers of
Delta = theta_sync - theta_local as a gradient for an outer optimizer; its best choice is Nesterov
momentum (lr 0.7, momentum 0.9, §3 and Table 2 of the paper). ``sgd`` with lr 1 and momentum 0 makes
the new parameters the plain average of the workers' (Local SGD / FedAvg). Each builds a
``torch.optim.SGD`` over the synchronised copies, so its state is torch's own ``momentum_buffer``.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from adacomp.outer import register


class OuterOptimizer:
    """Base: ``lr`` and ``momentum`` are checked here; :meth:`build` makes the torch optimizer."""

    name: ClassVar[str] = "base"
    nesterov: ClassVar[bool] = False

    def __init__(self, lr: float, momentum: float):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if self.nesterov and momentum == 0.0:
            raise ValueError("nesterov needs momentum > 0; use {name: sgd} for plain averaging")
        self.lr = float(lr)
        self.momentum = float(momentum)

    def build(self, params: list[Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lr={self.lr}, momentum={self.momentum})"


@register("nesterov")
class NesterovOuter(OuterOptimizer):
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (defaults lr 0.7, momentum 0.9)."""

    nesterov = True

    def __init__(self, lr: float = 0.7, momentum: float = 0.9):
        super().__init__(lr, momentum)


@register("sgd")
class SGDOuter(OuterOptimizer):
    """Plain outer SGD; lr 1, momentum 0 (the defaults) is Local SGD's parameter averaging."""

    def __init__(self, lr: float = 1.0, momentum: float = 0.0):
        super().__init__(lr, momentum)
