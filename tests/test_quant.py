"""QSGD and EF-SignSGD: unbiasedness, payload layout and sizes, bit packing, error feedback."""
from __future__ import annotations

import pytest
import torch

import adacomp.compressors as C
import adacomp.memories.base as M
from adacomp.compressors.qsgd import pack_bits, unpack_bits
from tests._dist import run_workers, train_random_steps


def _payload_bytes(payload):
    return sum(t.numel() * t.element_size() for t in payload)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (1003,), generator=g)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-1003 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, 1003), codes)


@pytest.mark.parametrize("rng", ["torch", "counter"])
@pytest.mark.parametrize("bits,bucket", [(4, 512), (2, 0), (8, 64), (3, 100)])
def test_qsgd_unbiased(bits, bucket, rng):
    """Mean of many decompressions approaches the input (QSGD Lemma 3.1 (i)), whichever stream
    draws the rounding's uniforms."""
    x = torch.randn(300, generator=torch.Generator().manual_seed(1))
    q = C.get("qsgd", bits=bits, bucket_size=bucket, seed=3, rng=rng)
    n = 2000
    acc = torch.zeros_like(x)
    for _ in range(n):
        p, ctx = q.compress(x, "w")
        acc += q.decompress(p, ctx)
    mean = acc / n
    # per-element std of Q is at most norm/s; the mean of n draws shrinks it by sqrt(n)
    s = (1 << (bits - 1)) - 1
    bound = 5 * x.norm() / s / n ** 0.5 if bucket == 0 else 5 * x.abs().max() * 3 / s / n ** 0.5 * (bucket ** 0.5)
    assert (mean - x).abs().max() < bound
    assert (mean - x).norm() / x.norm() < 0.1


def test_qsgd_payload_layout_and_size():
    x = torch.randn(7, 300)
    for bits in range(2, 9):
        q = C.get("qsgd", bits=bits)
        p, ctx = q.compress(x, "w")
        assert [t.dtype for t in p] == [torch.float32, torch.uint8]
        assert _payload_bytes(p) == q.payload_bytes(x.shape)
        y = q.decompress(p, ctx)
        assert y.shape == x.shape and y.dtype == x.dtype
    assert C.get("qsgd", bits=4).payload_bytes(torch.Size([2100])) < 2100 * 4 / 7.5  # ~7.8x


def test_qsgd_levels_exact_and_zero():
    q = C.get("qsgd", bits=8, bucket_size=0)
    x = torch.tensor([0.0, 0.0, 0.0])
    p, ctx = q.compress(x, "z")
    assert torch.equal(q.decompress(p, ctx), x)
    # an element equal to the norm sits exactly on the top level: no rounding noise
    x = torch.tensor([0.0, 3.0, 0.0])
    p, ctx = q.compress(x, "e")
    assert torch.allclose(q.decompress(p, ctx), x)


def test_qsgd_error_decreases_with_bits_and_set_bits():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    q = C.get("qsgd", bits=2)
    errs = []
    for b in range(2, 9):
        q.set_bits(b)
        assert q.get_bits() == b and q.s == (1 << (b - 1)) - 1
        p, ctx = q.compress(x, "w")
        errs.append(float((q.decompress(p, ctx) - x).square().sum()))
    assert errs == sorted(errs, reverse=True)


def test_qsgd_decompress_other_ranks_payload_and_bf16():
    """Allgather decompresses another rank's payload with this rank's ctx."""
    a, b = C.get("qsgd", seed=1), C.get("qsgd", seed=2)
    x, y = torch.randn(1000), torch.randn(1000) * 5
    pa, ca = a.compress(x, "w")
    pb, _ = b.compress(y, "w")
    ya = a.decompress(pb, ca)
    yb = b.decompress(pb, ca)
    assert torch.equal(ya, yb)
    h = torch.randn(100).to(torch.bfloat16)
    p, c = a.compress(h, "h")
    assert a.decompress(p, c).dtype == torch.bfloat16


def test_qsgd_state_dict_resumes_identically():
    x = torch.randn(500)
    q1 = C.get("qsgd", seed=5)
    q1.compress(x, "w")
    st = q1.state_dict()
    q2 = C.get("qsgd", seed=99)
    q2.load_state_dict(st)
    assert torch.equal(q1.compress(x, "w")[0][1], q2.compress(x, "w")[0][1])


@pytest.mark.parametrize("kw", [{"bits": 1}, {"bits": 9}, {"bits": 2.5}, {"s": -1}, {"bucket_size": -3}])
def test_qsgd_bad_params(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        C.get("qsgd", **kw)


def test_qsgd_flags():
    cls = C.registry.cls("qsgd")
    assert cls.additive is False and cls.fixed_size is True and cls.sparse is False and cls.biased is False
    assert C.registry.cls("efsignsgd").biased is True


def test_efsignsgd_payload_scale_and_signs():
    x = torch.tensor([[1.0, -2.0, 3.0], [-4.0, 0.0, 6.0]])
    e = C.get("efsignsgd")
    p, ctx = e.compress(x, "w")
    assert [t.dtype for t in p] == [torch.float32, torch.uint8] and p[1].numel() == 1
    assert _payload_bytes(p) == e.payload_bytes(x.shape)
    y = e.decompress(p, ctx)
    assert torch.allclose(y, 16.0 / 6 * torch.tensor([[1.0, -1, 1], [-1, 1, 1]]))
    assert torch.isclose(y.abs().sum(), x.abs().sum())  # l1 norm preserved


def test_efsignsgd_error_feedback_sends_everything_eventually():
    """With residual memory the sum of what was sent tracks the sum of gradients (EF-SGD)."""
    g = torch.Generator().manual_seed(0)
    e, mem = C.get("efsignsgd"), M.get("residual")
    grads = [torch.randn(64, generator=g) for _ in range(200)]
    sent = torch.zeros(64)
    for grad in grads:
        comp = mem.compensate(grad.clone(), "w")
        p, ctx = e.compress(comp, "w")
        mem.update(comp, "w", e, p, ctx)
        sent += e.decompress(p, ctx)
    total = torch.stack(grads).sum(0)
    # the difference is exactly the final residual, which stays bounded
    assert torch.allclose(total - sent, mem.residuals["w"], atol=1e-4)
    assert mem.residuals["w"].norm() < 0.2 * total.norm()


def _quant_worker(specs: list[dict]) -> list[list[float]]:
    """Train a small model with each compressor on real gloo ranks; return the final parameters."""
    import adacomp
    from adacomp.models import build
    adacomp.init("torch")
    out = []
    for spec in specs:
        torch.manual_seed(0)
        model = build("mlp", inputs=64, width=32, depth=1)
        opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), config=spec)
        train_random_steps(model, opt, steps=5, inputs=64, classes=10, seed=adacomp.rank())
        assert opt.last_stats.compression_ratio > 4
        out.append([float(p.detach().sum()) for p in model.parameters()])
        opt.remove_hooks()
    return out


def test_quantizers_on_two_gloo_ranks_keep_replicas_identical():
    specs = [{"compressor": {"name": "qsgd", "bits": 4}, "communicator": {"name": "allgather_fast"},
              "memory": {"name": "none"}, "min_numel": 100},
             {"compressor": {"name": "efsignsgd"}, "communicator": {"name": "allgather"},
              "memory": {"name": "residual"}, "min_numel": 100}]
    a, b = run_workers(_quant_worker, 2, specs)
    for pa, pb in zip(a, b):
        assert pa == pytest.approx(pb, abs=1e-6)


# --- QSGD's counter-based stream (rng: counter, adacomp.compressors._counter_rng) ----------------
def test_counter_stream_c_loop_equals_torch_twin():
    """The C loop and the torch twin draw the same bits, across a 2^32 position boundary too, so
    CUDA tensors and ADACOMP_NATIVE=0 quantise as the fused CPU pass does."""
    from adacomp.compressors import _counter_rng as R, _native
    if _native.library() is None:
        pytest.skip(f"no C library: {_native.why_unavailable()}")
    k = R.key(7, "layer.weight", 11)
    for start in (0, 13, (1 << 32) - 1000):
        a, b = torch.empty(4099), torch.empty(4099)
        assert _native.ctr_uniform_(a, k, start)
        R.uniform_torch_(b, k, start)
        assert torch.equal(a, b), start


@pytest.mark.parametrize("bits,bucket,n", [(4, 512, 70_001), (2, 0, 5000), (8, 64, 4096), (3, 100, 1003)])
def test_qsgd_counter_payload_same_with_and_without_the_c_library(bits, bucket, n, monkeypatch):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    fused = C.get("qsgd", bits=bits, bucket_size=bucket, rng="counter")
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    plain = C.get("qsgd", bits=bits, bucket_size=bucket, rng="counter")
    for step in range(2):  # the call count moves the key: the second payload differs from the first
        p_plain, _ = plain.compress(x, "w")
        monkeypatch.setenv("ADACOMP_NATIVE", "1")
        p_fused, _ = fused.compress(x, "w")
        monkeypatch.setenv("ADACOMP_NATIVE", "0")
        assert all(torch.equal(a, b) for a, b in zip(p_fused, p_plain)), step


def test_counter_stream_is_uniform_and_keyed():
    """2^20 numbers: each of 256 bins within 5 sigma of its expected count, lag-1 correlation ~0,
    24-bit resolution; different names, calls and seeds give different streams."""
    from adacomp.compressors import _counter_rng as R
    n, bins = 1 << 20, 256
    u = R.uniform_(torch.empty(n), R.key(0, "w", 0), 0)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.bincount((u * bins).long(), minlength=bins).double()
    expect = n / bins
    assert float((counts - expect).abs().max()) < 5 * expect ** 0.5
    c = torch.corrcoef(torch.stack([u[:-1], u[1:]]).double())[0, 1]
    assert abs(float(c)) < 5 / n ** 0.5
    assert torch.equal(u * 16777216, (u * 16777216).floor())  # whole multiples of 2^-24
    keys = {R.key(0, "w", 0), R.key(0, "w", 1), R.key(0, "v", 0), R.key(1, "w", 0)}
    assert len(keys) == 4


def test_qsgd_counter_resumes_from_state_dict():
    """The stream's only state is the per-tensor call count: a restored compressor continues with
    the payload the original would have sent; a fresh one would repeat the first."""
    x = torch.randn(3000, generator=torch.Generator().manual_seed(5))
    a = C.get("qsgd", rng="counter", seed=2)
    first, _ = a.compress(x, "w")
    st = a.state_dict()
    nxt, _ = a.compress(x, "w")
    b = C.get("qsgd", rng="counter", seed=2)
    b.load_state_dict(st)
    again, _ = b.compress(x, "w")
    assert torch.equal(nxt[1], again[1]) and not torch.equal(first[1], nxt[1])


def test_qsgd_rng_choice_is_checked():
    with pytest.raises(ValueError, match=r"rng must be one of \['torch', 'counter'\]"):
        C.get("qsgd", rng="philox")
