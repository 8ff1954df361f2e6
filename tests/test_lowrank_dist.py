"""PowerSGD and ACP-SGD through adacomp.DistributedOptimizer on real gloo processes.

Checks the ordering rule of DESIGN.md for multi-round compressors (PowerSGD's P then Q) on models
that span several fusion buckets, run many times in one process group: PyTorch's PowerSGD hook
aborts there with "collective mismatch" on gloo, adacomp must not.
"""
from __future__ import annotations

import io
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._dist import run_workers

METHODS = ("powersgd", "acpsgd")


def _model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank (no broadcast needed)
    return nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))


def _config(name: str, bucket_mb: float = 0.0005) -> dict:
    # min_numel 0: biases reach the low-rank compressor too and exercise its dense bypass
    return {"compressor": {"name": name, "rank": 4}, "memory": {"name": "residual"},
            "communicator": {"name": "allreduce"}, "min_numel": 0,
            "fusion": {"bucket_mb": bucket_mb, "compressed_buffer": True}}


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 40, generator=g), torch.randint(0, 10, (16,), generator=g)


def _dense_mean_grads(model: nn.Module, world: int, step: int) -> list[torch.Tensor]:
    """The plain average of every rank's gradient, recomputed locally on a copy of the model."""
    ref = [torch.zeros_like(p) for p in model.parameters()]
    clone = _model()
    clone.load_state_dict(model.state_dict())
    for r in range(world):
        clone.zero_grad()
        x, y = _batch(r, step)
        F.cross_entropy(clone(x), y).backward()
        for acc, p in zip(ref, clone.parameters()):
            acc += p.grad / world
    return ref


def _make(name: str, model: nn.Module, **cfg):
    import adacomp
    return adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        named_parameters=model.named_parameters(), config=_config(name, **cfg))


def _synced_grads(steps: int) -> dict[str, list]:
    """Per method and step, this rank's averaged gradients after synchronize(); checks the bypassed
    biases equal the dense mean and the compressed weights have rank <= 4."""
    import adacomp
    adacomp.init()
    out: dict[str, list] = {}
    for name in METHODS:
        model = _model()
        opt = _make(name, model)
        assert len(opt.buckets) >= 3, len(opt.buckets)
        flat = []
        for s in range(steps):
            dense = _dense_mean_grads(model, adacomp.size(), s)
            opt.zero_grad()
            x, y = _batch(adacomp.rank(), s)
            F.cross_entropy(model(x), y).backward()
            opt.synchronize()
            for (pname, p), d in zip(model.named_parameters(), dense):
                if p.dim() == 1:
                    torch.testing.assert_close(p.grad, d, rtol=1e-5, atol=1e-6)
                else:
                    assert int(torch.linalg.matrix_rank(p.grad)) <= 4, pname
            # numpy: tensors sent back through the queue would live in the worker's shared memory
            flat.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy())
            with opt.skip_synchronize():
                opt.step()
        opt.remove_hooks()
        out[name] = flat
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_all_ranks_hold_identical_gradients(world: int) -> None:
    results = run_workers(_synced_grads, world, 4, timeout=300)
    for name in METHODS:
        for s in range(4):
            for r in range(1, world):
                assert (results[0][name][s] == results[r][name][s]).all(), (name, s, r)


class _Jitter:
    """Random per-rank delays inside backward, so gradient hooks fire in varying orders/times."""

    def __init__(self, rank: int):
        self.rng = random.Random(rank)

    def __call__(self, module: nn.Module, grad_in: object, grad_out: object) -> None:
        import time
        time.sleep(self.rng.random() * 0.002)


def _repeated(reps: int, steps: int) -> list[float]:
    import adacomp
    adacomp.init()
    checks = []
    jitter = _Jitter(adacomp.rank())
    for rep in range(reps):
        for name in METHODS:
            model = _model()
            handles = [m.register_full_backward_hook(jitter) for m in model if isinstance(m, nn.Linear)]
            opt = _make(name, model, bucket_mb=0.0002 * (1 + rep % 3))
            assert len(opt.buckets) >= 3
            for s in range(steps):
                opt.zero_grad()
                x, y = _batch(adacomp.rank(), rep * steps + s)
                F.cross_entropy(model(x), y).backward()
                opt.step()
            opt.remove_hooks()
            for h in handles:
                h.remove()
            checks.append(float(sum(p.double().sum() for p in model.parameters())))
    return checks


def test_multi_bucket_models_repeatedly_without_collective_mismatch() -> None:
    results = run_workers(_repeated, 2, 20, 3, timeout=300)
    assert results[0] == results[1]  # parameters stayed identical on both ranks in every run


def _resume() -> dict[str, bool]:
    import adacomp
    adacomp.init()
    rank = adacomp.rank()

    def train(model, opt, first: int, last: int) -> None:
        for s in range(first, last):
            opt.zero_grad()
            x, y = _batch(rank, s)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    same = {}
    for name in METHODS:
        model = _model()
        opt = _make(name, model)
        train(model, opt, 0, 7)
        reference = [p.detach().clone() for p in model.parameters()]
        opt.remove_hooks()

        model = _model()
        opt = _make(name, model)
        train(model, opt, 0, 3)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        opt.remove_hooks()
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
        model = _model()
        model.load_state_dict(ckpt["model"])
        opt = _make(name, model)
        opt.load_state_dict(ckpt["opt"])
        train(model, opt, 3, 7)
        opt.remove_hooks()
        same[name] = all(torch.equal(a, b) for a, b in zip(reference, model.parameters()))
    return same


def test_checkpoint_resume_is_bitwise_equal() -> None:
    for per_rank in run_workers(_resume, 2, timeout=300):
        assert per_rank == {name: True for name in METHODS}
