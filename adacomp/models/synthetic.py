"""Synthetic batches for the model zoo: benchmarks and policy tests need realistic gradient shapes,
not real data, so every zoo model describes its own input and target and the loss that joins them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Synthetic:
    """One batch: ``inputs`` for ``model(inputs)``, ``targets`` and the ``loss_fn(output, targets)``."""

    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: LossFn

    def loss(self, model: nn.Module) -> torch.Tensor:
        """Forward pass and loss, ready for ``backward()``."""
        return self.loss_fn(model(self.inputs), self.targets)

    def to(self, device: torch.device | str) -> "Synthetic":
        return Synthetic(self.inputs.to(device), self.targets.to(device), self.loss_fn)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over (batch, seq, vocab) logits and (batch, seq) targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def images(batch: int, channels: int, size: int, classes: int, generator: torch.Generator) -> Synthetic:
    """Gaussian images with uniform labels (image classifiers)."""
    x = torch.randn(batch, channels, size, size, generator=generator)
    y = torch.randint(0, classes, (batch,), generator=generator)
    return Synthetic(x, y, F.cross_entropy)


def tokens(batch: int, seq: int, vocab: int, generator: torch.Generator) -> Synthetic:
    """Uniform token ids; the target is the sequence shifted by one (language models)."""
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return Synthetic(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), token_loss)


def synthetic_batch(model: nn.Module, batch: int, seed: int = 0) -> Synthetic:
    """A batch of ``batch`` samples for ``model`` (a zoo model: it has ``synthetic_batch``)."""
    make = getattr(model, "synthetic_batch", None)
    if make is None:
        raise TypeError(f"{type(model).__name__} has no synthetic_batch(); the zoo models "
                        "(adacomp.models.ZOO) define one")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return make(batch, torch.Generator().manual_seed(seed))
