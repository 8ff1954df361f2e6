"""topk / gtopk / randomk / mstopk: each compressor's defining property, error feedback, configs."""
from __future__ import annotations

import io
import os

import pytest
import torch

from adacomp import communicators, compressors, memories
from adacomp.compressors.sparse import k_for
from tests._dist import run_workers
from tests.test_allgather import plain, tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def heavy_tailed(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    """Gaussian, Laplace or Student-t (df=3) samples from a private generator."""
    g = gen(seed)
    if kind == "gaussian":
        return torch.randn(n, generator=g)
    if kind == "laplace":
        u = torch.rand(n, generator=g).clamp_min(1e-12)
        sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        return -torch.log(u) * sign
    z = torch.randn(n, generator=g)
    chi2 = torch.randn(3, n, generator=g).square().sum(0)
    return z / torch.sqrt(chi2 / 3)


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("shape", [(1000,), (37, 29), (8, 3, 5, 5)])
def test_topk_returns_exactly_the_k_largest(density, shape):
    x = torch.randn(*shape, generator=gen(1))
    c = compressors.get("topk", density=density)
    (vals, idx), ctx = c.compress(x, "w")
    k = max(1, round(density * x.numel()))
    assert idx.numel() == k == k_for(x.numel(), density)
    mags = x.reshape(-1).abs()
    assert torch.equal(vals, x.reshape(-1)[idx])  # signed values
    assert set(idx.tolist()) == set(torch.argsort(mags, descending=True)[:k].tolist())
    out = c.decompress([vals, idx], ctx)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert int((out != 0).sum()) == k


def test_gtopk_is_bucket_granular_topk():
    assert compressors.registry.cls("gtopk").granularity == "bucket"
    flat = torch.randn(5000, generator=gen(2))
    a, _ = compressors.get("gtopk", density=0.02).compress(flat, "bucket0")
    b, _ = compressors.get("topk", density=0.02).compress(flat, "bucket0")
    assert set(a[1].tolist()) == set(b[1].tolist())


def test_randomk_is_deterministic_per_step_and_keeps_global_rng():
    x = torch.randn(4000, generator=gen(3))
    c1, c2 = compressors.get("randomk", density=0.05, seed=7), compressors.get("randomk", density=0.05, seed=7)
    rng = torch.get_rng_state()
    (v1,), ctx1 = c1.compress(x, "w")
    (v2,), ctx2 = c2.compress(-x, "w")
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(ctx1.indices, ctx2.indices) and torch.equal(v1, -v2)
    assert ctx1.indices.unique().numel() == v1.numel() == 200
    c1.on_step(1)
    _, ctx3 = c1.compress(x, "w")
    assert not torch.equal(ctx3.indices, ctx1.indices)
    _, ctx4 = c1.compress(x, "other")
    assert not torch.equal(ctx4.indices, ctx3.indices)


def test_randomk_state_roundtrip_with_weights_only_load():
    c = compressors.get("randomk", density=0.1, seed=1)
    x = torch.randn(1000, generator=gen(4))
    c.on_step(5)
    c.compress(x, "w")
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)
    buf.seek(0)
    d = compressors.get("randomk", density=0.1, seed=1)
    d.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(c.compress(x, "w")[1].indices, d.compress(x, "w")[1].indices)


@pytest.mark.parametrize("kind", ["gaussian", "laplace", "student_t"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_mstopk_lands_near_target_density(kind, density):
    x = heavy_tailed(kind, 1_000_000, seed=5)
    c = compressors.get("mstopk", density=density)
    (vals, idx), _ = c.compress(x, "w")
    ratio = idx.numel() / (density * x.numel())
    assert 0.5 <= ratio <= 2.0, ratio
    # a threshold: everything sent is at least as large as everything kept back
    mask = torch.zeros(x.numel(), dtype=torch.bool)
    mask[idx] = True
    assert x.abs()[mask].min() >= x.abs()[~mask].max()


def test_mstopk_handles_ties_and_dense_targets():
    c = compressors.get("mstopk", density=0.01)
    (vals, idx), _ = c.compress(torch.zeros(1000), "z")
    assert idx.numel() == 10
    (vals, idx), _ = compressors.get("mstopk", density=0.9).compress(torch.randn(10000, generator=gen(6)), "w")
    assert 0.5 <= idx.numel() / 9000 <= 2.0
    with pytest.raises(ValueError, match="rounds"):
        compressors.get("mstopk", rounds=0)


@pytest.mark.parametrize("name", ["topk", "gtopk", "randomk", "mstopk"])
def test_error_feedback_identity_is_exact(name):
    mem, c = memories.get("residual"), compressors.get(name, density=0.05)
    for step in range(3):
        g = torch.randn(30, 40, generator=gen(10 + step))
        comp = mem.compensate(g, "w")
        payload, ctx = c.compress(comp, "w")
        mem.update(comp, "w", c, payload, ctx)
        sent = c.decompress(payload, ctx)
        assert torch.equal(sent + mem.residuals["w"], comp)
        c.on_step(step + 1)


def test_pairings_are_refused_with_what_fits():
    from adacomp.errors import IncompatibleComponentsError
    with pytest.raises(IncompatibleComponentsError, match="Communicators that fit: allgather"):
        communicators.get("allgather_fast").check(compressors.get("mstopk"))
    for name in ("topk", "gtopk", "randomk"):
        communicators.get("allgather_fast").check(compressors.get(name))
    assert compressors.get("randomk").additive and not compressors.get("topk").additive


@pytest.mark.parametrize("method", ["topk", "randomk", "gtopk", "mstopk", "adtopk", "adtopk_i", "adtopk_t"])
def test_method_configs_load(method):
    from adacomp.config import load
    cfg = load(os.path.join(ROOT, "configs", f"{method}.yaml"))
    assert cfg.compressor.name == method
    assert cfg.memory.name == "residual"  # every sparsifier runs with error feedback


def _randomk_worker(seed: int) -> list:
    import adacomp.backends
    from adacomp.communicators.base import CommEnv, Entry
    from adacomp.engine.metrics import StepStats
    backend = adacomp.backends.create("torch")
    rank, world = backend.rank(), backend.size()
    c = compressors.get("randomk", density=0.1, seed=seed)
    out = []
    for step in range(2):
        x = torch.randn(50, 20, generator=gen(100 * rank + step))
        entry = Entry("layer.weight", x, c, memories.get("none"))
        comm = communicators.get("allreduce")
        env = CommEnv(backend, StepStats(), step)
        res = comm.finish(comm.start([entry], env), env)[0]
        ours = c.decompress(entry.payload, entry.ctx)
        idx = backend.allgather(entry.ctx.indices.clone(), sizes=[entry.ctx.indices.numel()] * world)
        out.append((entry.ctx.indices, idx.view(world, -1), ours, res))
        c.on_step(step + 1)
    return plain(out)


def test_randomk_payloads_agree_across_ranks_gloo():
    res = tensors(run_workers(_randomk_worker, 2, 3))
    for step in range(2):
        (i0, all0, d0, r0), (i1, _, d1, r1) = res[0][step], res[1][step]
        assert torch.equal(all0[0], all0[1]) and torch.equal(i0, i1)
        torch.testing.assert_close(r0, (d0 + d1) / 2)
        torch.testing.assert_close(r1, r0)
    assert not torch.equal(res[0][0][0], res[0][1][0])  # new coordinates each step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["topk", "gtopk", "randomk", "mstopk", "adtopk", "adtopk_i", "adtopk_t"])
def test_compressors_stay_on_the_input_device(name):
    x = torch.randn(64, 100, device="cuda")
    c = compressors.get(name, density=0.05)
    for step in range(3):
        c.on_step(step)
        payload, ctx = c.compress(x, "w")
        assert all(p.device == x.device for p in payload)
        out = c.decompress(payload, ctx)
        assert out.device == x.device and out.shape == x.shape
