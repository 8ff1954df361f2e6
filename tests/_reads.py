"""One training step of a stack of Linear(128, 128) layers through adacomp's optimizer, counted by
a read counter (torch's CUDA sync debug mode or the emulated one, ``adacomp.bench.gpu_step``): the
shared setup of the host-wait tests (tests/test_cuda.py on a GPU, tests/test_host_reads.py anywhere)."""
from __future__ import annotations

from typing import Any, Callable

import torch

import adacomp
from adacomp.backends.base import LocalBackend


def reads_per_step(cfg: dict[str, Any], warm: int, layers: int, device: str,
                   counter: Callable[[Callable[[], None]], tuple[int, Any]]) -> int:
    """``counter``'s count of one step after ``warm + 2`` steps (the method's steady state)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(layers)]).to(device)
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), net.named_parameters(),
                                       config=cfg, backend=LocalBackend())
    x = torch.randn(8, 128, device=device)

    def step() -> None:
        opt.zero_grad()
        net(x).square().mean().backward()  # the gradient hooks run in here
        opt.step()

    for _ in range(warm + 2):
        step()
    n, _ = counter(step)
    opt.remove_hooks()
    return n
