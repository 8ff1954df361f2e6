"""Shared reference workload: the same small CNN, seeds and data shards trained with adacomp and
with PyTorch DDP, so any backend's dense path can be compared parameter by parameter."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from adacomp.datasets.digits import digits, shard
from adacomp.models import DigitsCNN


def _batches(rank: int, world: int, steps: int, batch: int = 16):
    x, y, _, _ = digits(seed=0)
    idx = shard(len(y), rank, world, epoch=0, seed=0)
    for s in range(steps):
        j = idx[(s * batch) % (len(idx) - batch):][:batch]
        yield x[j], y[j]


def train_adacomp(config: Any, steps: int = 20, lr: float = 0.05, backward_passes: int = 1) -> dict[str, torch.Tensor]:
    """Train with adacomp.DistributedOptimizer under whatever backend adacomp.init() picks."""
    import adacomp
    adacomp.init()
    torch.manual_seed(0)
    model = DigitsCNN()
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                       named_parameters=model.named_parameters(), config=config,
                                       backward_passes_per_step=backward_passes)
    adacomp.broadcast_parameters(model.state_dict(), root_rank=0)
    adacomp.broadcast_optimizer_state(opt, root_rank=0)
    it = _batches(adacomp.rank(), adacomp.size(), steps * backward_passes)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(backward_passes):
            x, y = next(it)
            F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_ddp(steps: int = 20, lr: float = 0.05) -> dict[str, torch.Tensor]:
    """The same run with torch DistributedDataParallel (needs an initialised process group)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(DigitsCNN())
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in _batches(dist.get_rank(), dist.get_world_size(), steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
