"""AMP as DDP users write it (issue 30), 2 gloo ranks, an fp16-style GradScaler with one rank's loss
overflowing once:

* ``compressor: none``: both front ends give DDP's parameters and DDP's scale bitwise, with
  ``nonfinite: propagate`` (the default) and ``skip`` alike: every rank's GradScaler sees the
  overflow, skips the step and lowers its scale, as under DDP (docs/reliability.md, "Non-finite
  gradients").
* Top-k with residuals and a scale that changes (overflow, then growth every 2 steps): the optimizer
  stepped by ``scaler.step(opt)`` without ``grad_scaler=`` finds that scaler and gives the bits of
  the run wired with ``grad_scaler=``; residuals follow every scale change.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_workers

OVERFLOW_STEP, STEPS = 2, 8


def _job(front: str, cfg: dict[str, Any], wired: bool) -> tuple[list[torch.Tensor], float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import adacomp
    from adacomp.backends.torch_dist import TorchBackend
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    inner = torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9)
    model: torch.nn.Module = base
    opt: Any = inner
    if front == "ddp":
        model = DDP(base)
    elif front == "hook":
        model = DDP(base)
        adacomp.ddp.register(model, cfg, grad_scaler=scaler if wired else None)
    else:
        opt = adacomp.DistributedOptimizer(inner, base.named_parameters(), config=cfg, backend=TorchBackend(),
                                           grad_scaler=scaler if wired else None)
    for s in range(STEPS):
        g = torch.Generator().manual_seed(100 * s + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if s == OVERFLOW_STEP and rank == 0:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in base.parameters()], scaler.get_scale()


@pytest.mark.parametrize("nonfinite", ["propagate", "skip"])
@pytest.mark.parametrize("front", ["optimizer", "hook"])
def test_dense_overflow_equals_ddp(front: str, nonfinite: str) -> None:
    cfg = {"compressor": {"name": "none"}, "nonfinite": nonfinite}
    ref = run_workers(_job, 2, "ddp", cfg, True, timeout=300)
    out = run_workers(_job, 2, front, cfg, True, timeout=300)
    for (params, scale), (want, want_scale) in zip(out, ref):
        assert scale == want_scale and want_scale != 2.0 ** 10  # the scale moved
        assert all(torch.equal(a, b) for a, b in zip(params, want))


def test_optimizer_finds_the_grad_scaler_that_steps_it() -> None:
    cfg = {"compressor": {"name": "topk", "density": 0.05}, "memory": {"name": "residual"},
           "communicator": {"name": "allgather"}, "min_numel": 256}
    wired = run_workers(_job, 2, "optimizer", cfg, True, timeout=300)
    found = run_workers(_job, 2, "optimizer", cfg, False, timeout=300)
    for (params, scale), (want, want_scale) in zip(found, wired):
        assert scale == want_scale
        assert all(torch.equal(a, b) for a, b in zip(params, want))
