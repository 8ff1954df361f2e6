"""Training a small model through one of adacomp's per-step front ends in a worker process of
``tests._dist.run_workers`` (gloo group up, ``adacomp.init()`` done): the shared loop of the tests
that compare two runs through every front end (the optimizer, the DDP hook, the outer loop, FSDP2's
reduce-scatter)."""
from __future__ import annotations

from typing import Any

import torch


def train_through(front: str, net: torch.nn.Module, cfg: dict[str, Any], rank: int, batch: int,
                  ddp_kwargs: dict[str, Any] | None = None) -> Any:
    """Five SGD steps of ``net`` (lr 0.1, rank-seeded data; six inner steps of the outer loop,
    which synchronises every second one) through ``front``: "optimizer", "hook" (a DDP model with
    ``ddp_kwargs``), "outer" or "fsdp" (``fully_shard`` on every Linear and the root, each unit's
    reduce-scatter through ``adacomp.fsdp.register``: the compressors see each unit's full
    gradients). Returns the hook's state (``None`` for the others)."""
    import adacomp
    import adacomp.ddp
    from torch.nn.parallel import DistributedDataParallel as DDP
    cfg = dict(cfg)
    model: torch.nn.Module = net
    state = None
    if front == "outer":  # local steps, the pseudo-gradient compressed every second step
        cfg["local_steps"] = {"every": 2}
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    if front == "hook":
        model = DDP(net, **(ddp_kwargs or {}))
        state = adacomp.ddp.register(model, cfg, named_parameters=net.named_parameters())
        opt: Any = torch.optim.SGD(net.parameters(), lr=0.1)
    elif front == "fsdp":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import adacomp.fsdp
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in linears:
            fully_shard(m, mesh=mesh)
        fully_shard(net, mesh=mesh)
        adacomp.fsdp.register(net, cfg)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
    else:
        opt = adacomp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(),
                                           config=cfg)
    inputs, classes = linears[0].in_features, linears[-1].out_features
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(6 if front == "outer" else 5):
        opt.zero_grad()
        x, y = torch.randn(batch, inputs, generator=g), torch.randint(0, classes, (batch,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if front in ("optimizer", "outer"):
        opt.remove_hooks()
    return state


def flat_params(net: torch.nn.Module) -> torch.Tensor:
    """Every parameter, whole (FSDP2's shards gathered), flattened into one tensor."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in net.parameters()])
