"""Threshold sparsifiers (DGC, Gaussian-k, RedSync, SIDCo, Ok-Topk, MSTopk) and the DGC memory.

The defining property of a threshold sparsifier is that it sends about k = density * numel
elements without sorting: each must land within 0.5x-2x of the target on Gaussian, Laplace and
Student-t(3) tensors of 1e6 elements after its warm-up, and what it sends must be a threshold cut
(nothing kept back is larger than anything sent).
"""
from __future__ import annotations

import io
import itertools
import math

import pytest
import torch

from adacomp import compressors, memories

N = 1_000_000
DENSITIES = [0.001, 0.01, 0.1]
KINDS = ["gaussian", "laplace", "student_t3"]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample(kind: str, n: int, seed: int) -> torch.Tensor:
    """Heavy- and light-tailed test tensors from our own generator (the global RNG is not used)."""
    g = gen(seed)
    if kind == "gaussian":
        return torch.randn(n, generator=g)
    if kind == "laplace":  # difference of two unit exponentials
        return torch.log1p(-torch.rand(n, generator=g)) - torch.log1p(-torch.rand(n, generator=g))
    z = torch.randn(n, generator=g)  # Student-t with 3 degrees of freedom: z / sqrt(chi2_3 / 3)
    return z / (torch.randn(3, n, generator=g).square().sum(0) / 3).sqrt()


@pytest.fixture(scope="module")
def tensors() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per kind: a warm-up tensor and a fresh draw of the same distribution to measure on."""
    return {k: (sample(k, N, 1 + i), sample(k, N, 11 + i)) for i, k in enumerate(KINDS)}


# name -> (registry name, extra parameters, warm-up calls). SIDCo adapts its stage count every
# `adapt_every` calls; 1 keeps the warm-up short (the default 5 only slows it down).
SPARSIFIERS = {
    "dgc": ("dgc", {}, 1),
    "gaussiank": ("gaussiank", {}, 0),
    "redsync": ("redsync", {}, 0),
    "sidco_exponential": ("sidco", {"distribution": "exponential", "adapt_every": 1}, 6),
    "sidco_gpareto": ("sidco", {"distribution": "gpareto", "adapt_every": 1}, 6),
    "sidco_gamma": ("sidco", {"distribution": "gamma", "adapt_every": 1}, 6),
    "oktopk": ("oktopk", {"period": 32}, 1),  # estimated on the warm-up tensor, reused on the next
    "mstopk": ("mstopk", {}, 0),
}


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("label", sorted(SPARSIFIERS))
def test_lands_near_target_density(label, kind, density, tensors):
    name, params, warmup = SPARSIFIERS[label]
    if name not in compressors.names():
        pytest.skip(f"compressor {name!r} is not registered yet")
    c = compressors.get(name, density=density, **params)
    warm, x = tensors[kind]
    for step in range(warmup):
        c.compress(warm, "w")
        c.on_step(step + 1)
    (values, idx), ctx = c.compress(x, "w")
    ratio = idx.numel() / (density * N)
    assert 0.5 <= ratio <= 2.0, f"{label} on {kind} at {density}: sent {ratio:.3f}x the target"
    assert torch.equal(values, x[idx])
    sent = torch.zeros(N, dtype=torch.bool)
    sent[idx] = True
    assert x.abs()[sent].min() >= x.abs()[~sent].max()  # a threshold cut, not an arbitrary subset


# ------------------------------------------------------------------------------------------------
# Ok-Topk: threshold reuse between re-estimations, checkpointed
# ------------------------------------------------------------------------------------------------
def test_oktopk_reuses_threshold_between_estimations():
    x = torch.randn(20_000, generator=gen(3))
    c = compressors.get("oktopk", density=0.01, period=4)
    assert c.granularity == "bucket"
    (_, idx), _ = c.compress(x, "bucket0")
    assert idx.numel() == 200  # estimation step: the exact top-k
    thr = c.threshold("bucket0")
    assert thr == pytest.approx(float(x.abs().topk(200).values.min()))
    for step in (1, 2, 3):  # reuse: 1.07x the gradient passes 1.4k-1.7k, inside the hard band [k/2, 2k]
        c.on_step(step)
        used = c.threshold("bucket0")
        (_, idx), _ = c.compress(1.07 * x, "bucket0")
        assert torch.equal(idx, torch.nonzero((1.07 * x).abs() >= used).view(-1))
        assert 250 < idx.numel() <= 400, idx.numel()
        # above 5k/4: the count band nudges the next step's threshold (compressors/_band.py)
        assert c.threshold("bucket0") == pytest.approx(thr * 1.012 ** step)
    c.on_step(4)  # period elapsed: re-estimated on the new data
    (_, idx), _ = c.compress(2 * x, "bucket0")
    assert idx.numel() == 200 and c.threshold("bucket0") == pytest.approx(float((2 * x).abs().topk(200).values.min()))
    c.on_step(5)  # a doubled gradient at a reused threshold passes > 2k: re-estimated at once
    (_, idx), _ = c.compress(4 * x, "bucket0")
    assert idx.numel() == 200 and c.threshold("bucket0") == pytest.approx(float((4 * x).abs().topk(200).values.min()))


def test_oktopk_resumes_from_state_dict():
    xs = [torch.randn(5000, generator=gen(40 + i)) * (1 + i) for i in range(6)]
    a, b = compressors.get("oktopk", density=0.02, period=3), None
    out_a, out_b = [], []
    for step, x in enumerate(xs):
        if step == 2:
            buf = io.BytesIO()
            torch.save(a.state_dict(), buf)
            buf.seek(0)
            b = compressors.get("oktopk", density=0.02, period=3)
            b.load_state_dict(torch.load(buf, weights_only=True))
        out_a.append(a.compress(x, "b")[0][1])
        a.on_step(step + 1)
        if b is not None:
            out_b.append(b.compress(x, "b")[0][1])
            b.on_step(step + 1)
    assert all(torch.equal(p, q) for p, q in zip(out_a[2:], out_b))


# ------------------------------------------------------------------------------------------------
# DGC compressor
# ------------------------------------------------------------------------------------------------
def test_dgc_owns_its_generator_and_is_reproducible():
    x = torch.randn(100_000, generator=gen(5))
    before = torch.get_rng_state()
    a, b = compressors.get("dgc", density=0.001, seed=7), compressors.get("dgc", density=0.001, seed=7)
    assert torch.equal(a.compress(x, "w")[0][1], b.compress(x, "w")[0][1])
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is untouched
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    c = compressors.get("dgc", density=0.001, seed=99)
    c.load_state_dict(torch.load(buf, weights_only=True))
    for _ in range(3):
        assert torch.equal(a.compress(x, "w")[0][1], c.compress(x, "w")[0][1])


def test_dgc_second_selection_trims_to_exactly_k():
    x = torch.ones(50_000)  # every sample ties: the sampled threshold passes everything
    x[:10] = 5.0
    (values, idx), _ = compressors.get("dgc", density=0.01).compress(x, "w")
    assert idx.numel() == 500 and set(range(10)) <= set(idx.tolist())


def test_dgc_warmup_decays_density_exponentially():
    c = compressors.get("dgc", density=0.001, warmup_steps=8)
    seen = []
    for step in range(10):
        c.on_step(step)
        seen.append(c.current_density())
    expected = [0.001 ** (p / 5) for p in (1, 1, 2, 2, 3, 3, 4, 4)] + [0.001, 0.001]
    assert seen == pytest.approx(expected)


# ------------------------------------------------------------------------------------------------
# DGC memory: momentum correction and momentum-factor masking (DGC §3.2)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compressor", ["dgc", "topk"])
def test_dgc_memory_corrects_and_masks_momentum(compressor):
    mem = memories.get("dgc", momentum=0.9)
    c = compressors.get(compressor, density=0.05)
    u = torch.zeros(40, 50)
    v = torch.zeros(40, 50)
    for step in range(4):
        g = torch.randn(40, 50, generator=gen(20 + step))
        u = 0.9 * u + g
        v = v + u
        comp = mem.compensate(g, "w")
        torch.testing.assert_close(comp, v)
        payload, ctx = c.compress(comp, "w")
        kept = comp.clone()  # update() may keep the compensated tensor as its state (no copy per step)
        mem.update(comp, "w", c, payload, ctx)
        comp = kept
        idx = payload[1]
        assert idx.numel() > 0
        # what was not sent stays accumulated: sent + remaining == compensated, exactly
        assert torch.equal(c.decompress(payload, ctx) + mem.accumulated["w"], comp)
        u.view(-1)[idx] = 0.0
        v.view(-1)[idx] = 0.0
        assert not mem.velocity["w"].view(-1)[idx].any() and not mem.accumulated["w"].view(-1)[idx].any()
        torch.testing.assert_close(mem.velocity["w"], u)
        torch.testing.assert_close(mem.accumulated["w"], v)
        c.on_step(step + 1)


def test_dgc_memory_clips_locally_and_checkpoints():
    mem = memories.get("dgc", clip_norm=1.0)
    out = mem.compensate(100 * torch.randn(1000, generator=gen(1)), "w")
    assert float(out.norm()) <= 1.0 + 1e-5  # one process: threshold / sqrt(1)
    buf = io.BytesIO()
    torch.save(mem.state_dict(), buf)
    buf.seek(0)
    other = memories.get("dgc", clip_norm=1.0)
    other.load_state_dict(torch.load(buf, weights_only=True))
    g = torch.randn(1000, generator=gen(2))
    assert torch.equal(mem.compensate(g, "w"), other.compensate(g, "w"))


def test_dgc_memory_refuses_dense_payloads():
    mem, c = memories.get("dgc"), compressors.get("none")
    g = torch.randn(10)
    comp = mem.compensate(g, "w")
    payload, ctx = c.compress(comp, "w")
    with pytest.raises(ValueError, match="sparse compressor"):
        mem.update(comp, "w", c, payload, ctx)


# ------------------------------------------------------------------------------------------------
# SIDCo fits and stage adaptation
# ------------------------------------------------------------------------------------------------
def test_sidco_quantiles_match_scipy():
    from scipy import stats

    from adacomp.compressors import sidco
    a = sample("laplace", 200_000, 8).abs()
    mu, var = float(a.mean()), float(a.var())
    assert sidco.exponential_quantile(a, 0.01) == pytest.approx(stats.expon.isf(0.01, scale=mu))
    xi, scale = 0.5 * (1 - mu * mu / var), 0.5 * mu * (mu * mu / var + 1)
    assert sidco.gpareto_quantile(a, 0.01) == pytest.approx(stats.genpareto.isf(0.01, xi, scale=scale), rel=1e-4)
    s = math.log(mu) - float(torch.log(a + 1e-12).mean())
    shape = (3 - s + math.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
    assert sidco.gamma_quantile(a, 0.01) == pytest.approx(stats.gamma.isf(0.01, shape, scale=mu / shape), rel=1e-4)


def test_sidco_exponential_is_exact_on_laplace_in_one_stage():
    x = sample("laplace", 200_000, 9)
    c = compressors.get("sidco", density=0.01, stages=1, adaptive=False)
    (_, idx), _ = c.compress(x, "w")
    assert 0.9 <= idx.numel() / 2000 <= 1.1


def test_sidco_adapts_stages_per_tensor_and_resumes():
    light, heavy = sample("gaussian", 100_000, 12), sample("student_t3", 100_000, 13)
    c = compressors.get("sidco", density=0.001, adapt_every=1)
    for _ in range(8):
        c.compress(light, "light")
        c.compress(heavy, "heavy")
    assert c.stages_for("light") > 1 and c.stages_for("heavy") > 1
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)
    buf.seek(0)
    d = compressors.get("sidco", density=0.001, adapt_every=1)
    d.load_state_dict(torch.load(buf, weights_only=True))
    assert d.stages_for("light") == c.stages_for("light")
    assert torch.equal(c.compress(heavy, "heavy")[0][1], d.compress(heavy, "heavy")[0][1])


def test_gaussiank_caps_at_the_band_with_the_largest():
    """Where the normal fit passes far more than k (a sparse, heavy-tailed tensor with no corrections
    left), ``truncate`` sends the loop's upper bound 4k/3: the largest of those passing, ascending,
    still a threshold cut; ``truncate: false`` sends all of them. Ties at the cut go to the lowest
    indices."""
    g = gen(7)
    n, density = 200_000, 0.01
    k = round(n * density)
    x = torch.where(torch.rand(n, generator=g) < 0.1, torch.randn(n, generator=g), torch.zeros(n))
    (vals, idx), _ = compressors.get("gaussiank", density=density, max_adjust=0).compress(x, "x")
    (_, every), _ = compressors.get("gaussiank", density=density, max_adjust=0, truncate=False).compress(x, "x")
    assert every.numel() > 3 * k  # the fit alone passes ~4k here
    assert idx.numel() == 4 * k // 3 and torch.equal(vals, x[idx]) and bool((idx[1:] > idx[:-1]).all())
    assert bool(torch.isin(idx, every).all())
    sent = torch.zeros(n, dtype=torch.bool)
    sent[idx] = True
    assert x.abs()[sent].min() >= x.abs()[~sent].max()
    from adacomp.compressors.sparse import largest_k
    mags = torch.tensor([1.0, 3.0, 1.0, 2.0, 1.0, 1.0, 3.0])  # k = 4: both 3s, the 2, then the first tied 1
    assert largest_k(torch.arange(10, 17), mags, 4).tolist() == [10, 11, 13, 16]


@pytest.mark.parametrize("ties", [False, True])
def test_gaussiank_caps_a_tensor_counted_whole_in_one_c_pick(ties: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the compaction's size a tensor is counted whole, so its selection has no values; the
    cap then gathers them and ranks them in one C call: the same payload, bit for bit, as torch's
    path (ADACOMP_NATIVE=0: largest_k over the gathered magnitudes, ties to the lowest positions)."""
    from adacomp.compressors import _native
    g = gen(11)
    n = 20_000
    x = torch.where(torch.rand(n, generator=g) < 0.1, torch.randn(n, generator=g), torch.zeros(n))
    if ties:
        x = x.round(decimals=1)
    picks: list[bool] = []
    orig = _native.pick_largest
    monkeypatch.setattr(_native, "pick_largest", lambda v, i, k, f: (picks.append(v is not None), orig(v, i, k, f))[1])
    (vals, idx), _ = compressors.get("gaussiank", density=0.01, max_adjust=0).compress(x.clone(), "x")
    assert picks == [True] and idx.numel() == 4 * round(n * 0.01) // 3
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    (want_vals, want_idx), _ = compressors.get("gaussiank", density=0.01, max_adjust=0).compress(x.clone(), "x")
    assert torch.equal(idx, want_idx) and torch.equal(vals.view(torch.int32), want_vals.view(torch.int32))


# ------------------------------------------------------------------------------------------------
# Edge cases shared by all of them, parameter checks, configs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dgc", "gaussiank", "redsync", "sidco", "oktopk"])
def test_never_empty_and_dense_at_density_one(name):
    (values, idx), ctx = compressors.get(name, density=0.01).compress(torch.zeros(3000), "z")
    assert idx.numel() >= 1
    x = torch.randn(7, 9, generator=gen(4))
    payload, ctx = compressors.get(name, density=1.0).compress(x, "w")
    assert torch.equal(compressors.get(name).decompress(payload, ctx), x)


@pytest.mark.parametrize("name,kwargs,param", [
    ("dgc", {"sample_ratio": 0.0}, "sample_ratio"), ("dgc", {"warmup_steps": -1}, "warmup_steps"),
    ("gaussiank", {"max_adjust": -1}, "max_adjust"), ("gaussiank", {"truncate": "yes"}, "truncate"),
    ("redsync", {"max_steps": 0}, "max_steps"),
    ("sidco", {"distribution": "cauchy"}, "distribution"), ("sidco", {"stages": 0}, "stages"),
    ("oktopk", {"period": 0}, "period"), ("oktopk", {"density": 1.5}, "density"),
])
def test_bad_parameters_name_themselves(name, kwargs, param):
    with pytest.raises(ValueError, match=param):
        compressors.get(name, **kwargs)


@pytest.mark.parametrize("kwargs,param", [({"momentum": 1.0}, "momentum"), ({"clip_norm": -1.0}, "clip_norm")])
def test_bad_dgc_memory_parameters_name_themselves(kwargs, param):
    with pytest.raises(ValueError, match=param):
        memories.get("dgc", **kwargs)


@pytest.mark.parametrize("name", ["dgc", "gaussiank", "redsync", "sidco", "oktopk"])
def test_config_loads(name):
    import os

    from adacomp.config import load
    cfg = load(os.path.join(os.path.dirname(__file__), "..", "configs", f"{name}.yaml"))
    assert cfg.compressor.name == name
    assert cfg.communicator.name == "allgather"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("label", sorted(SPARSIFIERS))
def test_cuda_tensors_stay_on_device(label):
    name, params, warmup = SPARSIFIERS[label]
    if name not in compressors.names():
        pytest.skip(f"compressor {name!r} is not registered yet")
    x = sample("student_t3", N, 21).cuda()
    c = compressors.get(name, density=0.01, **params)
    for step in range(warmup):
        c.compress(x, "w")
        c.on_step(step + 1)
    (values, idx), ctx = c.compress(x, "w")
    assert idx.is_cuda and values.is_cuda
    assert 0.5 <= idx.numel() / (0.01 * N) <= 2.0
    assert c.decompress([values, idx], ctx).is_cuda


# ------------------------------------------------------------------------------------------------
# Through the DistributedOptimizer on 2 real gloo processes
# ------------------------------------------------------------------------------------------------
DIST_METHODS = {  # compressor -> (memory, inner SGD momentum): DGC's memory carries the momentum
    "dgc": ("dgc", 0.0), "gaussiank": ("residual", 0.9), "redsync": ("residual", 0.9),
    "sidco": ("residual", 0.9), "oktopk": ("residual", 0.9),
}


def _train_worker(steps: int) -> dict:
    import torch.nn.functional as F
    from torch import nn

    import adacomp
    adacomp.init()
    out = {}
    for name, (memory, momentum) in DIST_METHODS.items():
        torch.manual_seed(0)  # same initial weights on every rank
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 10))
        cfg = {"compressor": {"name": name, "density": 0.05}, "memory": {"name": memory},
               "communicator": {"name": "allgather"}, "min_numel": 0,
               "fusion": {"bucket_mb": 0.03, "compressed_buffer": True}}
        opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum),
                                           named_parameters=model.named_parameters(), config=cfg)
        grads = []
        for s in range(steps):
            g = torch.Generator().manual_seed(100 * s + adacomp.rank())
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            assert torch.isfinite(flat).all() and flat.count_nonzero() > 0, name
            grads.append(flat.numpy().tobytes())  # plain bytes: tensors would travel as shared fds
        fused = [b.fused_compressor for b in opt.buckets if b.fused_compressor is not None]
        out[name] = {"grads": grads, "buckets": len(opt.buckets), "fused": len(fused),
                     "state": [c.state_dict() for c in fused]}
    return out


def test_trains_through_the_optimizer_on_two_ranks():
    from tests._dist import run_workers
    steps = 4
    ranks = run_workers(_train_worker, 2, steps)
    for name in DIST_METHODS:
        a, b = ranks[0][name], ranks[1][name]
        assert a["buckets"] >= 2, f"{name}: the model should span several fusion buckets"
        for s in range(steps):  # every rank applies the same averaged sparse gradient
            assert a["grads"][s] == b["grads"][s], f"{name} step {s}"
    ok = ranks[0]["oktopk"]  # one threshold per fusion bucket, estimated at step 0, reused at the last step;
    assert ok["fused"] == ok["buckets"]  # re-estimated in between when the count left [k/2, 2k] (_band.py)
    assert all(st["step"] == steps and set(st["estimated_at"]) == set(st["threshold"])
               and all(0 <= v < steps - 1 for v in st["estimated_at"].values()) for st in ok["state"])


def _eager_redsync(c, a, k, counter, top, mean):
    """RedSync's loop with every count taken (the reference the lazy search must equal)."""
    import math
    base, span = mean, top - mean
    if not counter.at_least(mean, k):
        base, span = 0.0, mean
    lo, hi, best_thr, best_err = 0.0, 1.0, base, math.inf
    for _ in range(c.max_steps):
        mid = 0.5 * (lo + hi)
        thr = base + mid * span
        count = counter.count(thr)
        if k <= count < 2 * k:
            return thr
        err = abs(math.log(max(count, 1) / k))
        if err < best_err:
            best_thr, best_err = thr, err
        hi, lo = (mid, lo) if count < k else (hi, mid)
    return best_thr


def _eager_mstopk(c, mag, k, counter, hi_val, mean):
    lo_val = mean if counter.at_least(mean, k) else 0.0
    span, left, right, best_thr, best_err = hi_val - lo_val, 0.0, 1.0, hi_val, None
    for _ in range(c.search_rounds):
        ratio = 0.5 * (left + right)
        thr = lo_val + ratio * span
        nnz = counter.count(thr)
        err = abs(nnz - k)
        if best_err is None or err < best_err:
            best_thr, best_err = thr, err
        if nnz == k:
            break
        right, left = (ratio, left) if nnz < k else (right, ratio)
    return best_thr


@pytest.mark.parametrize("name,steps", [("redsync", 20), ("redsync", 2), ("redsync", 1), ("mstopk", 25), ("mstopk", 3),
                                        ("mstopk", 1)])
def test_lazy_counts_below_the_floor_give_the_eager_threshold(name: str, steps: int) -> None:
    """RedSync and MSTop-k skip a count below the kept floor when its size already decides the
    search's move; the threshold is the eager loop's, also when the search runs out of steps and
    such a threshold might be the best (few steps), on normal, heavy-tailed and tied magnitudes."""
    from adacomp.compressors.sparse import ThresholdCounter
    from adacomp.compressors.workspace import Workspace
    g = torch.Generator().manual_seed(steps)
    kw = {"max_steps": steps} if name == "redsync" else {"rounds": steps}
    comp = compressors.get(name, density=0.01, **kw)
    for t, x in enumerate([torch.randn(1 << 17, generator=g), torch.randn(1 << 17, generator=g) ** 5,
                           torch.randn(1 << 17, generator=g).round(), torch.rand(1 << 17, generator=g) + 3.0]):
        a = x.abs()
        k = max(1, int(0.01 * a.numel()))
        # the compressor's own candidate share, the default and one at k (most counts below the
        # floor): exact counts, so one threshold whatever the share
        found: dict[float, set[float]] = {}
        for density, factor in itertools.product((0.01, 0.0005, 0.2), {comp.search_factor, 3.0, 1.0}):
            fresh = lambda: ThresholdCounter.for_search(a, name == "redsync", density, Workspace(),  # noqa: E731
                                                        factor)
            top, mean = float(a.max()), float(a.mean())
            if name == "redsync":
                got = comp.threshold(a, k, fresh(), top, mean)
                want = _eager_redsync(comp, a, k, fresh(), top, mean)
            else:
                got = comp.threshold(a, k, fresh(), top, mean)
                want = _eager_mstopk(comp, a, k, fresh(), top, mean)
            assert got == want, (t, density, factor)
            found.setdefault(density, set()).add(got)
        assert all(len(v) == 1 for v in found.values()), found


@pytest.mark.parametrize("steps", [20, 3, 1])
@pytest.mark.parametrize("absolute", [True, False])
def test_redsync_search_over_full_counts_in_one_c_call_is_the_loops(steps: int, absolute: bool, monkeypatch) -> None:
    """Below the compaction size every count of RedSync's search is a full pass, and the whole
    bisection runs in one C call (_native.bisect_band): the threshold is the eager loop's and the
    Python loop's, when the band is hit, when the steps run out (the best of them), where even the
    mean passes fewer than k (the [0, mean] segment), on normal, heavy-tailed, tied, mostly zero and
    constant magnitudes, counted on |g| or on g with absolute answers."""
    from adacomp.compressors import _native
    from adacomp.compressors.sparse import ThresholdCounter
    from adacomp.compressors.workspace import Workspace
    g = torch.Generator().manual_seed(steps)
    comp = compressors.get("redsync", density=0.01, max_steps=steps)
    calls: list = []
    real = _native.bisect_band
    monkeypatch.setattr(_native, "bisect_band", lambda *a: calls.append(real(*a)) or calls[-1])
    xs = [torch.randn(5000, generator=g), torch.randn(40000, generator=g) ** 5, torch.randn(1024, generator=g).round(),
          torch.randn(3000, generator=g) * (torch.rand(3000, generator=g) < 0.05), torch.full((2048,), -0.5)]
    for t, x in enumerate(xs):
        a = x.abs()
        at_mean = int((a > float(a.mean())).sum())  # k where the mean passes exactly k: its segment
        for k in (1, max(1, int(0.01 * x.numel())), int(0.45 * x.numel()), max(1, at_mean)):
            counter = lambda: ThresholdCounter(x if absolute else a, True, Workspace(), absolute=absolute)  # noqa: E731
            top, mean = float(a.max()), float(a.mean())
            before = len(calls)
            got = comp.threshold(a, k, counter(), top, mean)
            assert len(calls) == before + 1 and calls[-1] is not None
            assert got == _eager_redsync(comp, a, k, counter(), top, mean), (t, k)
            with monkeypatch.context() as m:
                m.setattr(_native, "bisect_band", lambda *a: None)
                assert got == comp.threshold(a, k, counter(), top, mean), (t, k)
    assert any(not found for _, _, found in calls) and any(found for _, _, found in calls)


@pytest.mark.parametrize("max_adjust", [0, 1, 2, 5, 12])
def test_gaussiank_loop_over_full_counts_in_one_c_call_is_the_loops(max_adjust: int, monkeypatch) -> None:
    """Below the compaction size every count of Gaussian-k's correction loop is a full pass, and the
    whole loop runs in one C call (_native.gauss_band): the threshold and the number of counts are
    the Python loop's, whether a count lands in [2k/3, 4k/3] at once, after brackets, or the
    corrections run out (up or down first), on normal, heavy-tailed, tied, mostly zero, constant
    and non-finite tensors."""
    from adacomp.compressors import _native
    from adacomp.compressors.sparse import ThresholdCounter
    from adacomp.compressors.workspace import Workspace
    g = torch.Generator().manual_seed(max_adjust)
    comp = compressors.get("gaussiank", density=0.01, max_adjust=max_adjust)
    calls: list = []
    real = _native.gauss_band
    monkeypatch.setattr(_native, "gauss_band", lambda *a: calls.append(real(*a)) or calls[-1])
    big = torch.randn(8000, generator=g)
    big[:3] = 1e4  # a few huge values: the fit's std overshoots, too few pass, corrections go down
    xs = [torch.randn(5000, generator=g), torch.randn(40000, generator=g) ** 5, torch.randn(1024, generator=g).round(),
          torch.randn(3000, generator=g) * (torch.rand(3000, generator=g) < 0.05), torch.full((2048,), -0.5), big,
          torch.cat([torch.randn(2000, generator=g), torch.tensor([float("inf")])])]
    ran = 0
    for t, x in enumerate(xs):
        for k in (1, max(1, int(0.01 * x.numel())), int(0.3 * x.numel())):
            counter = ThresholdCounter(x, True, Workspace(), absolute=True)
            before = len(calls)
            got = comp.threshold(x, x, k, counter)
            ran += len(calls) > before and calls[-1] is not None
            with monkeypatch.context() as m:
                m.setattr(_native, "gauss_band", lambda *a: None)
                loop = ThresholdCounter(x, True, Workspace(), absolute=True)
                want = comp.threshold(x, x, k, loop)
            assert got == want or (math.isnan(got) and math.isnan(want)), (t, k)
            assert counter.reads == loop.reads, (t, k)
    assert ran == (0 if max_adjust == 0 else 3 * len(xs))
    if max_adjust:  # a count on either edge of the band stops the loop (k = 30: [20, 40])
        ramp = torch.arange(1.0, 1001.0)
        for thr in (960.5, 980.5):
            assert real(ramp, "abs_gt", thr, 20.0, 40.0, max_adjust) == (thr, None, None, 1, 1, True)
        stepped = real(ramp, "abs_gt", 959.5, 20.0, 40.0, max_adjust)  # 41 pass: corrected upward
        assert stepped.thr != 959.5 and stepped.too_low == 959.5 and (stepped.steps > 1 or max_adjust == 1)


@pytest.mark.parametrize("max_adjust,truncate", [(0, True), (1, True), (5, True), (5, False), (12, True)])
def test_gaussiank_choice_in_one_c_call_is_the_calls_one_by_one(max_adjust: int, truncate: bool, one_thread: None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where error feedback's compensation left what the search starts from, Gaussian-k's choice
    (threshold, correction loop, selection, cap) is one C call: below the compaction size from the
    mean, with the std in torch's order (_native.gauss_whole), above it from the moments and the
    candidates kept above a sampled floor (_native.gauss_kept). Over three steps with residuals the
    payloads and residuals are those of the same calls made one by one from Python, bit for bit, on
    normal, heavy-tailed, tied, mostly zero, constant and non-finite tensors of both sizes."""
    from adacomp.compressors import _native
    g = gen(40 + max_adjust)
    big = torch.randn(8000, generator=g)
    big[:3] = 1e4
    xs = [torch.randn(5000, generator=g), torch.randn(40000, generator=g) ** 5, torch.randn(1024, generator=g).round(),
          torch.randn(3000, generator=g) * (torch.rand(3000, generator=g) < 0.05), torch.full((2048,), -0.5), big,
          torch.randn(60000, generator=g), torch.cat([torch.randn(2000, generator=g), torch.tensor([float("inf")])]),
          torch.cat([torch.randn(2000, generator=g), torch.tensor([float("nan")])]),
          torch.randn(200000, generator=g), torch.randn(100000, generator=g) ** 5,
          torch.randn(150000, generator=g) * (torch.rand(150000, generator=g) < 0.05),
          torch.randn(70000, generator=g).round(), torch.full((80000,), 0.25)]
    served: list[tuple[str, bool]] = []
    for fn in ("gauss_whole", "gauss_kept"):
        monkeypatch.setattr(_native, fn, lambda *a, _f=getattr(_native, fn), _n=fn: (
            lambda r: served.append((_n, r is not None)) or r)(_f(*a)))

    def run(fast: bool) -> list[tuple[torch.Tensor, ...]]:
        out: list[tuple[torch.Tensor, ...]] = []
        with monkeypatch.context() as m:
            if not fast:
                m.setattr(_native, "gauss_whole", lambda *a: None)
                m.setattr(_native, "gauss_kept", lambda *a: None)
            comp = compressors.get("gaussiank", density=0.01, max_adjust=max_adjust, truncate=truncate)
            mem = memories.get("residual")
            for step in range(3):
                for t, x in enumerate(xs):
                    c = mem.compensate(x * (1.0 + 0.25 * step), f"x{t}", compressor=comp)
                    payload, ctx = comp.compress(c, f"x{t}")
                    mem.update(c, f"x{t}", comp, payload, ctx)
                    out.append((payload[0].view(torch.int32), payload[1], mem.residuals[f"x{t}"].view(torch.int32)))
        return out

    fast = run(True)
    # from the second step (the first has no residual, so no compensation); a constant tensor's
    # threshold below the compaction size is not positive, and the non-finite ones keep nothing:
    # the Python way
    whole = [ok for fn, ok in served if fn == "gauss_whole"]
    kept = [ok for fn, ok in served if fn == "gauss_kept"]
    assert whole == 2 * [True, True, True, True, False, True, True]
    assert len(kept) == 2 * 5 and any(kept), kept  # (a loop that ends below the floor: the Python way)
    slow = run(False)
    for t, (a, b) in enumerate(zip(fast, slow)):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), t


@pytest.mark.parametrize("max_adjust", [1, 5, 12])
def test_gaussiank_loop_over_a_kept_set_in_one_c_call_is_the_loops(max_adjust: int, monkeypatch) -> None:
    """With the compensation's signed candidates kept above a floor, Gaussian-k's loop counts them in
    one C call from the floor up, takes the kept set's size at or below the floor where that exceeds
    4k/3 (no read), and hands a count below the floor back to the counter (which widens its set):
    the thresholds and reads are the Python loop's at every floor, above, near and below the answer."""
    from adacomp.compressors import _native
    from adacomp.compressors.sparse import ThresholdCounter
    from adacomp.compressors.workspace import Workspace
    g = torch.Generator().manual_seed(max_adjust)
    comp = compressors.get("gaussiank", density=0.01, max_adjust=max_adjust)
    calls: list = []
    real = _native.gauss_band
    monkeypatch.setattr(_native, "gauss_band", lambda *a: calls.append(real(*a)) or calls[-1])
    xs = [torch.randn(70000, generator=g), torch.randn(70000, generator=g) ** 3,
          torch.randn(70000, generator=g) * (torch.rand(70000, generator=g) < 0.1)]
    handed_back = 0
    for t, x in enumerate(xs):
        mags = x.abs()
        for k in (7, 700, 7000):
            for share in (0.002, 0.01, 0.03, 0.2):  # floors above, near and below the answer
                floor = float(torch.quantile(mags[:20000], 1 - share))

                def counter() -> ThresholdCounter:
                    c = ThresholdCounter(x, True, Workspace(), absolute=True)
                    at = torch.nonzero(mags > floor).view(-1)
                    c.adopt(floor, at, x[at], signed=True)
                    return c
                used = counter()
                before = len(calls)
                got = comp.threshold(x, x, k, used)
                assert len(calls) == before + 1 and calls[-1] is not None
                handed_back += not calls[-1].done
                with monkeypatch.context() as m:
                    m.setattr(_native, "gauss_band", lambda *a: None)
                    loop = counter()
                    assert got == comp.threshold(x, x, k, loop), (t, k, share)
                assert used.reads == loop.reads and used.floor == loop.floor, (t, k, share)
    assert handed_back > 0


@pytest.mark.parametrize("name", ["redsync", "mstopk", "gaussiank"])
def test_a_tensor_counted_whole_picks_positions_and_values_in_one_pass(name: str, monkeypatch, one_thread) -> None:
    """Below the compaction size the searches count on g itself with absolute answers, and the kept
    positions come with their signed values from one C pass (select_upto's signed modes) instead of
    select's positions and a gather: the payload is the torch path's (ADACOMP_NATIVE=0), on normal,
    heavy-tailed, tied and mostly zero tensors."""
    from adacomp.compressors import _native
    calls: list[str] = []
    real = _native.select_upto
    monkeypatch.setattr(_native, "select_upto", lambda a, thr, mode, cap: calls.append(mode) or real(a, thr, mode, cap))
    g = gen(3)
    xs = [torch.randn(1024, generator=g), sample("laplace", 5000, 4), torch.randn(30000, generator=g).mul(3).round(),
          torch.randn(3000, generator=g) * (torch.rand(3000, generator=g) < 0.05), sample("student_t3", 60000, 5)]
    for x in xs:
        got, _ = compressors.get(name, density=0.01).compress(x.clone(), "w")
        with monkeypatch.context() as m:
            m.setenv("ADACOMP_NATIVE", "0")
            want, _ = compressors.get(name, density=0.01).compress(x.clone(), "w")
        assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
    assert calls and all(m.endswith("_signed") for m in calls)


def test_gaussiank_skips_counts_the_kept_set_decides() -> None:
    """Gaussian-k's corrections take the kept set's size for a threshold below its floor when that
    size already exceeds the band (the step is the same); the threshold equals the search that
    counts every time, on normal, heavy-tailed, light-tailed and shifted inputs."""
    from adacomp.compressors.sparse import ThresholdCounter
    from adacomp.compressors.workspace import Workspace
    g = torch.Generator().manual_seed(9)
    comp = compressors.get("gaussiank", density=0.01)
    for x in [torch.randn(1 << 17, generator=g), torch.randn(1 << 17, generator=g) ** 3,
              torch.rand(1 << 17, generator=g) - 0.5, torch.randn(1 << 17, generator=g) + 2.0]:
        k = max(1, int(0.01 * x.numel()))
        for density in (0.01, 0.1):
            counter = ThresholdCounter.for_search(x.abs(), True, density, Workspace())
            assert comp.threshold(x.abs(), x, k, counter) == comp.threshold(x.abs(), x, k, None)


@pytest.mark.parametrize("name", ["redsync", "mstopk", "gaussiank", "dgc"])
def test_payload_values_come_from_the_signed_candidates(name: str, monkeypatch, one_thread) -> None:
    """Where a fused pass kept the search's candidates with their signed values (error feedback's
    for RedSync and MSTop-k, the moments' read for Gaussian-k, which runs on uncompensated steps
    too, DGC's momentum correction), the payload's values come from them (no gather over the tensor) and are the tensor's own
    values at the payload's positions, bit for bit: on normal and tied data, over steps."""
    from adacomp.compressors import _native
    from adacomp.compressors.sparse import ThresholdCounter
    if _native.library() is None:
        pytest.skip("no C compiler: the candidates come from the torch path, which gathers")
    picked: list[bool] = []
    orig = ThresholdCounter.pick

    def counted(self, thr, expected=1.0):
        got = orig(self, thr, expected)
        picked.append(got is not None)
        return got
    monkeypatch.setattr(ThresholdCounter, "pick", counted)
    # Gaussian-k's choice from the compensation's candidates in one C call picks from them too
    real_kept = _native.gauss_kept
    monkeypatch.setattr(_native, "gauss_kept", lambda *a: (lambda r: picked.append(r is not None) or r)(real_kept(*a)))
    # and DGC's in one C call (``_native.dgc_choose``) from the momentum pass's candidates, when it has them
    real_choice = _native.dgc_choose
    monkeypatch.setattr(_native, "dgc_choose", lambda *a: (lambda r: picked.append(r is not None and a[4] is not None)
                                                           or r)(real_choice(*a)))
    comp, mem = compressors.get(name, density=0.01), memories.get("dgc" if name == "dgc" else "residual")
    twin = compressors.get(name, density=0.01)  # selects on copies, without candidates (DGC: same draws)
    g = torch.Generator().manual_seed(5)
    from_candidates = []
    for step in range(4):
        grad = torch.randn(1 << 17, generator=g)
        if step == 2:
            grad = grad.round()  # many ties at the threshold
        flat = mem.compensate(grad, "w", 1, compressor=comp)
        snapshot = flat.clone()
        picked.clear()
        payload, ctx = comp.compress(flat, "w")
        from_candidates.append(picked == [True])
        vals, idx = payload
        assert torch.equal(vals.view(torch.int32), snapshot[idx].view(torch.int32)), step
        assert torch.equal(idx, twin.select(snapshot.clone(), "w")), step  # the plain path's selection
        mem.update(flat, "w", comp, payload, ctx)
    # RedSync, MSTop-k and DGC from the first compensated step on
    assert from_candidates == [name == "gaussiank", True, True, True], from_candidates
