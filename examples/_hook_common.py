"""Shared by the framework examples: the two compression configs and a small synthetic task."""
from __future__ import annotations

import torch
from torch import nn

CONFIGS = {
    "topk": {"compressor": {"name": "topk", "density": 0.05}, "communicator": {"name": "allgather"},
             "min_numel": 256},
    "powersgd": {"compressor": {"name": "powersgd", "rank": 2}, "min_numel": 256},
}


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))


def dataset(n: int = 512) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    y = (x[:, :4].argmax(dim=1))  # learnable: the index of the largest of the first 4 features
    return torch.utils.data.TensorDataset(x, y)
