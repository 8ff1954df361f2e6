"""Local steps on FSDP2 shards (``adacomp.fsdp.register(..., optimizer=opt)``) under two habits, on
2 gloo ranks as 2 replicas x 1 shard: a DCP checkpoint taken mid-run changes nothing (torch's
``get_state_dict`` steps a stateless optimizer once at lr 0: not a local step), and weights loaded
into the model after ``register`` are where the first window starts (the synchronised copies are
taken before the first inner step, as the optimizer's outer loop takes them)."""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch
import torch.nn.functional as F

from tests._dist import run_workers

CFG = {"compressor": {"name": "none"}, "communicator": {"name": "allreduce"}, "min_numel": 0,
       "local_steps": {"every": 3}}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :4].argmax(dim=1)


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _build(load: list[torch.Tensor] | None = None, load_before: bool = True) -> tuple[Any, Any, Any]:
    import adacomp
    from adacomp.engine.fsdp_local import _local
    from tests.fsdp_worker import on_shards
    torch.manual_seed(0)
    net = _net()
    mesh = on_shards(net, (2, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)

    def put() -> None:
        with torch.no_grad():
            for p, w in zip(net.parameters(), load or []):
                _local(p).copy_(w)  # one shard: the local shard is the whole tensor

    if load_before:
        put()
    state = adacomp.fsdp.register(net, CFG, replicate_group=mesh["replicate"].get_group(), optimizer=opt)
    if not load_before:
        put()
    return net, opt, state


def _train(net: Any, opt: Any, state: Any, steps: int, save: tuple[int, str] | None = None) -> tuple[list, int]:
    import torch.distributed as dist
    for s in range(steps):
        x, y = _batch(s, dist.get_rank())
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        if save is not None and s == save[0]:
            state.save_checkpoint(net, opt, save[1])
    out = [p.full_tensor().detach().clone() for p in net.parameters()]
    state.remove()
    return out, state.steps


def _save_worker() -> dict:
    import adacomp
    import torch.distributed as dist
    adacomp.init()
    where = [tempfile.mkdtemp(prefix="adacomp_fsdp_local_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    plain, plain_steps = _train(*_build(), 8)
    saved, saved_steps = _train(*_build(), 8, save=(4, os.path.join(str(where[0]), "ck")))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(str(where[0]), ignore_errors=True)
    return {"same": all(torch.equal(a, b) for a, b in zip(plain, saved)), "steps": (plain_steps, saved_steps)}


def test_a_dcp_checkpoint_mid_run_changes_nothing() -> None:
    for r, res in enumerate(run_workers(_save_worker, 2, timeout=300)):
        assert res["same"] and res["steps"] == (8, 8), (r, res)


def _load_worker() -> bool:
    import adacomp
    adacomp.init()
    torch.manual_seed(7)
    pre = [t.detach().clone() for t in _net().parameters()]
    before, _ = _train(*_build(pre, load_before=True), 3)
    after, _ = _train(*_build(pre, load_before=False), 3)
    return all(torch.equal(a, b) for a, b in zip(before, after))


def test_weights_loaded_after_register_start_the_first_window() -> None:
    assert run_workers(_load_worker, 2, timeout=300) == [True, True]
