"""Datasets that ship offline inside installed packages (nothing downloads at run time)."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def digits(seed: int = 0, test_fraction: float = 0.2) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), scaled to [0, 1].

    Returns (x_train, y_train, x_test, y_test) with x of shape (n, 1, 8, 8); the split is a
    seeded permutation so every rank sees the same split.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.tensor(np.random.default_rng(seed).permutation(len(y)))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def shard(n: int, rank: int, world: int, epoch: int, seed: int = 0) -> Tensor:
    """This rank's sample indices for one epoch: a seeded shuffle split round-robin, equal sizes
    on every rank (the tail is dropped) so all ranks run the same number of steps."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n, generator=g)
    per = n // world
    return perm[rank * per:(rank + 1) * per]
