"""chunktopk (SparseLoCo's chunked Top-k with low-bit values): per-chunk selection, the quantizer's
levels, bitwise residuals, exact payload sizes, config checks, and a real 2-process gloo run through
``adacomp.DistributedOptimizer`` on allgather and allgather_fast."""
from __future__ import annotations

import pytest
import torch

import adacomp.config as config
from adacomp import compressors, memories
from adacomp.communicators.allgather import fits
from adacomp.compressors.chunktopk import ChunkTopkCompressor
from adacomp.errors import IncompatibleComponentsError
from tests._dist import run_workers
from tests.test_allgather import gen, own_and_averaged, plain, tensors


def k_of(length: int, density: float) -> int:
    """The rule the compressor documents: max(1, round(density * length)), at most length."""
    return min(length, max(1, int(round(density * length))))


def chunks_of(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]


def levels(bits: int, scale: float) -> torch.Tensor:
    """The 2**b symmetric uniform levels of a chunk, computed here independently (float64)."""
    n = 1 << bits
    j = torch.arange(n, dtype=torch.float64)
    return scale * (2 * j + 1 - n) / (n - 1)


def nbytes(payload: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


SHAPES = [(3000,), (40, 64), (7,), (5, 256), (3, 97)]  # with chunk 256: partial chunks, one smaller than a chunk


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("density", [0.05, 0.3])
def test_each_chunk_keeps_exactly_its_k_largest_magnitudes(shape, density):
    chunk = 256
    x = torch.randn(*shape, generator=gen(sum(shape)))
    c = compressors.get("chunktopk", density=density, chunk=chunk, bits=32)
    payload, ctx = c.compress(x, "w")
    d = c.decompress(payload, ctx)
    assert d.shape == x.shape and d.dtype == x.dtype
    flat, dflat = x.reshape(-1), d.reshape(-1)
    kept = dflat != 0  # randn has no exact zeros
    for lo, hi in chunks_of(flat.numel(), chunk):
        k = k_of(hi - lo, density)
        m = kept[lo:hi]
        assert int(m.sum()) == k, (lo, hi)
        mags = flat[lo:hi].abs()
        if k < hi - lo:
            assert mags[m].min() > mags[~m].max()  # the k largest (continuous data: no ties)
    # bits = 32: the kept values are the tensor's own, bitwise; everything else is zero
    assert torch.equal(dflat[kept], flat[kept])
    assert torch.equal(dflat[~kept], torch.zeros_like(dflat[~kept]))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_kept_values_are_the_nearest_level_of_their_chunk(bits):
    chunk, density = 128, 0.1
    x = torch.randn(9, 100, generator=gen(bits)) * torch.linspace(0.1, 10, 900).view(9, 100)  # chunk scales differ
    ref = compressors.get("chunktopk", density=density, chunk=chunk, bits=32)
    c = compressors.get("chunktopk", density=density, chunk=chunk, bits=bits)
    p32, ctx32 = ref.compress(x, "w")
    payload, ctx = c.compress(x, "w")
    kept = ref.decompress(p32, ctx32).reshape(-1) != 0
    d = c.decompress(payload, ctx).reshape(-1)
    flat = x.reshape(-1)
    for lo, hi in chunks_of(flat.numel(), chunk):
        m = kept[lo:hi]
        v = flat[lo:hi][m].double()
        q = d[lo:hi][m].double()
        assert torch.equal(d[lo:hi][~m], torch.zeros_like(d[lo:hi][~m]))  # same coordinates as bits=32
        scale = float(flat[lo:hi][m].abs().max())
        lv = levels(bits, scale)
        dist_to_levels = (q.unsqueeze(1) - lv).abs().min(dim=1).values
        assert float(dist_to_levels.max()) <= 1e-6 * scale  # every value is one of the chunk's levels
        best = (v.unsqueeze(1) - lv).abs().min(dim=1).values
        assert bool(((v - q).abs() <= best + 1e-6 * scale).all())  # and it is the nearest one
    if bits == 2:
        assert set(torch.unique(payload[0]).tolist()) - {0}  # codes really are packed into the bytes
        assert payload[0].numel() == -(-ctx.kept * 2 // 8)


def test_largest_value_of_a_chunk_is_sent_exactly_and_zero_chunks_stay_zero():
    x = torch.zeros(3, 64)
    x[1] = torch.randn(64, generator=gen(0))
    c = compressors.get("chunktopk", density=0.1, chunk=64, bits=2)
    payload, ctx = c.compress(x, "w")
    d = c.decompress(payload, ctx)
    i = int(x[1].abs().argmax())
    assert d[1, i] == x[1, i]  # the scale's own value sits on the outer level
    assert torch.equal(d[0], torch.zeros(64)) and torch.equal(d[2], torch.zeros(64))


@pytest.mark.parametrize("bits", [2, 32])
def test_residual_is_tensor_minus_decompress_bitwise(bits):
    """Through the residual memory's compensate / update, as the optimizer drives it: the residual
    holds the dropped coordinates and (bits < 32) the quantization error of the kept ones."""
    c = compressors.get("chunktopk", density=0.05, chunk=100, bits=bits)
    mem = memories.get("residual")
    for step in range(3):
        g = torch.randn(7, 50, generator=gen(10 + step))
        comp = mem.compensate(g.clone(), "w")
        payload, ctx = c.compress(comp, "w")
        sent = c.decompress(payload, ctx)
        mem.update(comp, "w", c, payload, ctx)
        assert torch.equal(mem.residuals["w"], comp - sent)
        kept = sent != 0
        if bits == 32:
            assert torch.equal(mem.residuals["w"][kept], torch.zeros(int(kept.sum())))
        else:
            assert bool((mem.residuals["w"][kept] != 0).any())  # quantization error is carried


PAYLOAD_SHAPES = [(1,), (5,), (100,), (4096,), (4097,), (3, 4096), (64, 65), (10000,), (2, 3, 50)]


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 32])
@pytest.mark.parametrize("chunk", [8, 256, 4096])
def test_payload_bytes_is_exact(bits, chunk):
    c = compressors.get("chunktopk", density=0.02, chunk=chunk, bits=bits)
    for shape in PAYLOAD_SHAPES:
        payload, ctx = c.compress(torch.randn(*shape, generator=gen(len(shape))), "w")
        assert nbytes(payload) == c.payload_bytes(torch.Size(shape)), shape
        idx = payload[-1]
        assert idx.dtype == torch.int16 and idx.element_size() == 2 and idx.numel() == ctx.kept
        expected = [torch.float32, torch.int16] if bits == 32 else [torch.uint8, torch.float32, torch.int16]
        assert [t.dtype for t in payload] == expected


def test_payload_size_depends_only_on_the_shape():
    c = compressors.get("chunktopk")
    a, _ = c.compress(torch.randn(3, 5000, generator=gen(1)), "w")
    b, _ = c.compress(torch.zeros(3, 5000), "w")
    assert [t.shape for t in a] == [t.shape for t in b]


def test_bytes_per_kept_value_at_the_defaults():
    c = compressors.get("chunktopk")  # density 0.02, chunk 4096, bits 2
    n_chunks = 1000
    kept = 82 * n_chunks  # round(0.02 * 4096) = 82 per chunk
    total = c.payload_bytes(torch.Size([4096 * n_chunks]))
    assert total == kept * 2 // 8 + 4 * n_chunks + 2 * kept  # codes + scales + int16 indices
    assert total / kept == pytest.approx(188.5 / 82)  # ~2.3 B per kept value ...
    topk_bytes = compressors.get("topk", density=0.02).payload_bytes(torch.Size([4096 * n_chunks]))
    assert topk_bytes / k_of(4096 * n_chunks, 0.02) == 12  # ... vs topk's float32 value + int64 index


def test_positions_above_32767_survive_the_int16_wire():
    """chunk 65536: local positions >= 2**15 travel as their uint16 bit pattern."""
    n = 65536 + 40000
    x = torch.randn(n, generator=gen(3)) * 1e-3
    big = torch.tensor([5, 32767, 32768, 50000, 65535, 65536 + 39999])
    x[big] = torch.arange(1, 7, dtype=torch.float32) * 10
    c = compressors.get("chunktopk", density=1e-5, chunk=65536, bits=32)
    payload, ctx = c.compress(x, "w")
    assert ctx.k_row == 1 and ctx.k_tail == 1
    d = c.decompress(payload, ctx)
    assert torch.nonzero(d).view(-1).tolist() == [65535, 65536 + 39999]
    assert bool((payload[1] < 0).any())  # 65535 went out as -1
    c2 = compressors.get("chunktopk", density=5 / 65536, chunk=65536, bits=32)
    d2 = c2.decompress(*c2.compress(x[:65536].clone(), "w"))
    assert torch.nonzero(d2).view(-1).tolist() == big[:5].tolist()


def test_other_dtypes_and_a_foreign_payload():
    c = compressors.get("chunktopk", density=0.1, chunk=32, bits=4)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        x = torch.randn(10, 10, generator=gen(5)).to(dtype)
        payload, ctx = c.compress(x, "w")
        d = c.decompress(payload, ctx)
        assert d.dtype == dtype and d.shape == x.shape and int((d != 0).sum()) == 3 * 3 + 1  # 3 chunks of 32 keep 3, the last 4 keep 1
    # another rank's payload decodes with this rank's ctx (what allgather does)
    y = torch.randn(10, 10, generator=gen(6))
    py, cy = c.compress(y, "w")
    _, cx = c.compress(torch.randn(10, 10, generator=gen(7)), "w")
    assert torch.equal(c.decompress(py, cx), c.decompress(py, cy))
    with pytest.raises(ValueError, match="same density"):
        c.decompress(py, compressors.get("chunktopk", density=0.5, chunk=32, bits=4).compress(y, "w")[1])


def test_nonfinite_values_propagate():
    x = torch.randn(256, generator=gen(8))
    x[3] = float("nan")
    c = compressors.get("chunktopk", density=0.05, chunk=64, bits=2)
    d = c.decompress(*c.compress(x, "w"))
    assert bool(torch.isnan(d[:64]).any()) and bool(torch.isfinite(d[64:]).all())


@pytest.mark.parametrize("params,match", [({"density": 0.0}, "density"), ({"density": 1.5}, "density"),
                                          ({"chunk": 4}, r"chunk.*\[8, 65536\]"), ({"chunk": 70000}, "chunk"),
                                          ({"chunk": 64.0}, "chunk"), ({"bits": 3}, r"bits.*\[1, 2, 4, 8, 32\]"),
                                          ({"bits": True}, "bits")])
def test_invalid_parameters_are_named(params, match):
    with pytest.raises(ValueError, match=match):
        compressors.get("chunktopk", **params)


def test_flags_config_and_communicators():
    c = compressors.get("chunktopk")
    assert isinstance(c, ChunkTopkCompressor)
    assert (c.sparse, c.additive, c.fixed_size, c.biased, c.rounds) == (False, False, True, True, 1)
    assert fits(c) == ["allgather", "allgather_fast"]
    cfg = config.from_dict({"compressor": {"name": "chunktopk", "density": 0.02, "bits": 2},
                            "memory": {"name": "residual"}, "communicator": {"name": "allgather"}})
    assert cfg.compressor.name == "chunktopk" and cfg.communicator.name == "allgather"
    with pytest.raises(IncompatibleComponentsError, match="allreduce"):
        config.from_dict({"compressor": {"name": "chunktopk", "density": 0.02, "bits": 2},
                          "memory": {"name": "residual"}, "communicator": {"name": "allreduce"}})
    assert config.from_dict({"compressor": "chunktopk"}).communicator.name == "allgather_fast"


# --------------------------------------------------------------------- 2 real processes (gloo)
ROUTES = [({"name": "chunktopk", "density": 0.05, "chunk": 48, "bits": 2}, "allgather_fast"),
          ({"name": "chunktopk", "density": 0.05, "chunk": 48, "bits": 2}, "allgather"),
          ({"name": "chunktopk", "density": 0.1, "chunk": 64, "bits": 1}, "allgather_fast")]
STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # same model on every rank (this child process owns its global RNG)
    # 2048 / 64 / 640 / 10 elements: with chunk 48 every tensor ends in a partial chunk, the last is one
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _worker(routes: list[tuple[dict, str]], steps: int) -> list:
    import adacomp
    import adacomp.backends
    backend = adacomp.backends.create("torch")
    rank = backend.rank()
    out = []
    for comp, comm in routes:
        model = _model()
        cfg = {"backend": "torch", "compressor": comp, "memory": {"name": "residual"},
               "communicator": {"name": comm}, "fusion": {"bucket_mb": 0.0003}, "min_numel": 0}
        opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), config=cfg, backend=backend)
        assert len(opt.buckets) > 1
        rows = []
        for step in range(steps):
            own = own_and_averaged(model, opt, rank, step)
            rows.append((own, {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
        out.append(rows)
    return plain(out)


def test_distributed_optimizer_averages_decompressed_payloads_on_2_ranks():
    """p.grad after backward == mean over ranks of decompress(compress(g_r + residual_r)), bitwise;
    the reference is computed here in one process from each rank's own gradients (one residual
    memory per rank), decoding each rank's payload with the other rank's compressor."""
    res = tensors(run_workers(_worker, 2, ROUTES, STEPS))
    for route, (comp, comm) in enumerate(ROUTES):
        params = {k: v for k, v in comp.items() if k != "name"}
        ref = [compressors.get("chunktopk", **params) for _ in range(2)]
        mems = [memories.get("residual") for _ in range(2)]
        for step in range(STEPS):
            own = [res[r][route][step][0] for r in range(2)]
            for n in own[0]:
                sent = []
                for r in range(2):
                    g = mems[r].compensate(own[r][n].clone(), n)
                    payload, ctx = ref[r].compress(g, n)
                    mems[r].update(g, n, ref[r], payload, ctx)
                    sent.append(ref[1 - r].decompress(payload, ref[1 - r].layout(g.shape, g.dtype)))
                mean = (sent[0] + sent[1]) / 2
                assert int((sent[0] != 0).sum()) > 0 and not torch.equal(sent[0], sent[1])
                for r in range(2):
                    avg = res[r][route][step][1][n]
                    torch.testing.assert_close(avg, mean, rtol=0, atol=0,
                                               msg=lambda m: f"{comm} {comp} step {step} {n} rank {r}: {m}")


@pytest.mark.parametrize("case", ["gauss", "ties", "nan", "zeros"])
def test_chunk_selection_is_canonical_on_every_path(case, monkeypatch):
    """Per chunk: the k largest |x| at ascending positions, ties at the k-th magnitude to the lowest
    positions, NaN above every number; the C selection and torch's path give the same positions and
    values, and the set is torch.topk's wherever that is unique."""
    from adacomp.compressors import _native
    from adacomp.compressors.chunktopk import chunk_select
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 300, generator=g)
    if case == "ties":
        x = torch.randint(-3, 4, (6, 300), generator=g).float()
    if case == "nan":
        x[1, 7] = x[4, 250] = float("nan")
    if case == "zeros":
        x[2] = 0.0
        x[3, :290] = -0.0
    k = 9
    idx, vals = chunk_select(x, k)
    assert idx.shape == (6, k) and bool((idx[:, 1:] > idx[:, :-1]).all())
    assert torch.equal(vals.view(torch.int32), torch.gather(x, 1, idx).view(torch.int32))
    monkeypatch.setattr(_native, "usable", lambda a: False)
    idx_t, vals_t = chunk_select(x, k)
    assert torch.equal(idx, idx_t) and torch.equal(vals.view(torch.int32), vals_t.view(torch.int32))
    mags = torch.where(torch.isnan(x), torch.full_like(x, float("inf")), x.abs())
    kth = torch.topk(mags, k, dim=1).values[:, -1:]
    for r in range(6):
        above = torch.nonzero(mags[r] > kth[r]).view(-1)
        tied = torch.nonzero(mags[r] == kth[r]).view(-1)
        assert idx[r].tolist() == sorted(above.tolist() + tied[:k - above.numel()].tolist())


def test_chunk_selection_floor_guess_paths(monkeypatch):
    """The C selection's floor from the previous chunk (candidates only) and its fallbacks (too
    many candidates, too few, a zero k-th, ties at the floor) give torch's positions and values."""
    from adacomp.compressors import _native
    from adacomp.compressors.chunktopk import chunk_select
    g = torch.Generator().manual_seed(11)
    scale = torch.tensor([1.0] * 8 + [30.0, 30.0, 0.01, 0.01, 1.0, 0.0, 1.0, 1.0] * 2)
    x = torch.randn(scale.numel(), 1024, generator=g) * scale.unsqueeze(1)
    x[14] = torch.randint(-2, 3, (1024,), generator=g).float()  # ties at the k-th
    x[20, ::3] = 0.0
    k = 20
    idx, vals = chunk_select(x, k)
    monkeypatch.setattr(_native, "usable", lambda a: False)
    idx_t, vals_t = chunk_select(x, k)
    assert torch.equal(idx, idx_t) and torch.equal(vals.view(torch.int32), vals_t.view(torch.int32))


REFLOOR_CASES = ["dead", "drop", "jump", "ties", "nan", "subnormal"]


def _refloor_case(case: str, rows: int = 24, chunk: int = 1024, seed: int = 3) -> torch.Tensor:
    """Rows that make the C selection's floor guesses miss (see the test below)."""
    gen_ = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, chunk, generator=gen_)
    if case == "dead":
        x[2:6] = 0.0
        x[4] = -0.0
        x[7] = 0.0
        x[7, ::300] = torch.tensor([1.5, -2.0, 0.25, 3.0])  # 4 nonzero: the k-th is 0
        x[9:12] = 0.0
        x[10, 17] = -1e-3
    elif case in ("drop", "jump"):
        scale = torch.tensor([1.0, 1.0, 1e-4, 1e-4, 1.0, 1e4, 1e4, 1.0] * 3)
        x *= (scale if case == "drop" else 1.0 / scale).unsqueeze(1)
    elif case == "ties":
        x[3:] = torch.randint(-2, 3, (rows - 3, chunk), generator=gen_).float() * 0.5
    elif case == "nan":  # a tiny floor, halved to any nonzero: the NaN among the few nonzero ones
        x[4] *= 1e-37
        x[5:8] = 0.0
        x[6, 40] = float("nan")
    elif case == "subnormal":
        x[4:9] *= 1e-41
        x[6, :500] = 0.0
    return x


@pytest.mark.parametrize("case", REFLOOR_CASES)
def test_chunk_selection_refloored_paths(case, avx2_switch, monkeypatch):
    """Chunks whose floor from the neighbouring chunk misses are scanned again from the caches at a
    better floor (the k-th of the first candidates, half the floor, any nonzero magnitude) before the
    whole chunk's select: dead units' rows (all +-0.0, or fewer than k nonzero), a scale that drops
    or jumps 10^4 between neighbours, ties at the refined floor, a NaN in a chunk of a few nonzeros,
    subnormal magnitudes. Positions and value bits equal torch's path, plain and with the
    compensation inside the scan (``add``)."""
    from adacomp.compressors import _native
    from adacomp.compressors.chunktopk import chunk_select
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()})")
    rows, chunk, k = 24, 1024, 20
    x = _refloor_case(case, rows, chunk)
    idx, vals = chunk_select(x.clone(), k)
    g, r = x * 0.75, x * 0.25  # exact in float32: g + r == x
    out = torch.empty(rows * chunk)
    fused = _native.chunk_topk(out, rows, chunk, k, add=(g.view(-1), r.view(-1)))
    monkeypatch.setattr(_native, "usable", lambda a: False)  # torch's path: the reference
    want_idx, want_vals = chunk_select(x, k)
    assert torch.equal(idx, want_idx) and torch.equal(vals.view(torch.int32), want_vals.view(torch.int32))
    assert torch.equal(out.view(torch.int32), torch.add(g, r).view(-1).view(torch.int32))
    if case == "nan":
        assert fused is None  # the C path declines; torch's answers
        return
    assert fused is not None
    assert torch.equal(fused[0], want_idx) and torch.equal(fused[1].view(torch.int32), want_vals.view(torch.int32))



@pytest.mark.parametrize("hint", ["unknown", "own", "high", "low", "dead", "random"])
@pytest.mark.parametrize("case", REFLOOR_CASES)
def test_chunk_selection_row_hints_change_only_speed(case, hint, avx2_switch, monkeypatch):
    """The per-row floors a tensor's previous call left (``hint``) never change the answer, however
    wrong: unknown (0), the rows' own k-th, 10^3 too high or too low, the zero-k-th marker (1) on live
    rows, random finite bit patterns; each row's hint is overwritten with its k-th magnitude's bits
    (1 for a zero k-th). Then a second call on the rows grown 4x (error feedback's residual growing)
    reads those hints: positions and value bits equal torch's path both times."""
    from adacomp.compressors import _native
    from adacomp.compressors.chunktopk import chunk_select
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()})")
    rows, chunk, k = 24, 1024, 20
    x = _refloor_case(case, rows, chunk)
    mags = torch.where(torch.isnan(x), torch.full_like(x, float("inf")), x.abs())
    own = torch.topk(mags, k, dim=1).values[:, -1].contiguous().view(torch.int32)
    gen_ = torch.Generator().manual_seed(5)
    hints = {"unknown": torch.zeros(rows, dtype=torch.int32), "own": own.clone(),
             "high": (own.view(torch.float32) * 1e3).view(torch.int32),
             "low": (own.view(torch.float32) * 1e-3).view(torch.int32),
             "dead": torch.ones(rows, dtype=torch.int32),
             "random": torch.randint(1, 0x7effffff, (rows,), generator=gen_, dtype=torch.int32)}
    h = hints[hint].clone()
    for step, y in enumerate((x, x * 4.0)):
        g, r = y * 0.75, y * 0.25  # exact in float32: g + r == y
        out = torch.empty(rows * chunk)
        fused = _native.chunk_topk(out, rows, chunk, k, add=(g.view(-1), r.view(-1)), hint=h)
        with monkeypatch.context() as m:
            m.setattr(_native, "usable", lambda a: False)  # torch's path: the reference
            want_idx, want_vals = chunk_select(y, k)
        assert torch.equal(out.view(torch.int32), torch.add(g, r).view(-1).view(torch.int32))
        if case == "nan":
            assert fused is None  # the C path declines; torch's answers
            return
        assert fused is not None, step
        assert torch.equal(fused[0], want_idx) and torch.equal(fused[1].view(torch.int32), want_vals.view(torch.int32))
        kth = torch.gather(y.abs(), 1, want_idx).amin(1).contiguous().view(torch.int32)
        assert torch.equal(h, torch.where(kth == 0, torch.ones_like(kth), kth)), step

@pytest.mark.parametrize("k", [1, 7, 8, 9, 16, 82])
@pytest.mark.parametrize("case", ["gauss", "levels", "signs", "steps"])
def test_candidates_kth_by_bisected_bits_and_vector_writes_equal_torch(case, k, avx2_switch, monkeypatch):
    """The AVX2 candidates' k-th (bits bisected with vector counts, the window moved to the front after
    four bits, the least of exactly k reaching a value) and the vector writing of the kept ones (8
    candidates compacted a step while 8 slots are left, the rest one by one; a tie cut at the k-th
    taking the scalar rule) give torch's positions and value bits: iid values, a few levels (ties
    cut at the k-th), +-x of equal magnitudes, a staircase; k below, at and above one vector. Each
    tensor twice with its rows' hints, so the second call's floors sit just under the k-th."""
    from adacomp.compressors import _native
    from adacomp.compressors.chunktopk import chunk_select
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()})")
    rows, chunk = 12, 4096
    gen_ = torch.Generator().manual_seed(k)
    x = torch.randn(rows, chunk, generator=gen_)
    if case == "levels":
        x = torch.randint(-40, 41, (rows, chunk), generator=gen_).float() * 0.125
    elif case == "signs":
        x = x.abs().mul_(64).round_().div_(64) * torch.where(torch.rand(rows, chunk, generator=gen_) < 0.5, -1.0, 1.0)
    elif case == "steps":
        x = torch.arange(rows * chunk, dtype=torch.float32).view(rows, chunk).remainder_(997).mul_(1e-3) + 1.0
    hint = torch.zeros(rows, dtype=torch.int32)
    for y in (x, x * 1.03):
        got = _native.chunk_topk(y.reshape(-1).clone(), rows, chunk, k, hint=hint)
        with monkeypatch.context() as m:
            m.setattr(_native, "usable", lambda a: False)  # torch's path: the reference
            want_idx, want_vals = chunk_select(y, k)
        assert got is not None
        assert torch.equal(got[0], want_idx) and torch.equal(got[1].view(torch.int32), want_vals.view(torch.int32))


@pytest.mark.parametrize("owed", ["none", "owed"])
@pytest.mark.parametrize("chunk,rows", [(4096, 40), (1000, 90), (100, 700), (300, 9)])
@pytest.mark.parametrize("case", ["gauss", "scales", "nan", "ties"])
def test_compensation_inside_the_chunk_scan_equals_add_then_select(chunk, rows, case, owed, avx2_switch, monkeypatch):
    """The C selection with error feedback's add inside each chunk's scan (``add=(g, r)``: the sums
    written, streamed from 2^16 elements, and the floor's candidates taken from registers) gives the
    bits of torch.add followed by the selection of the sum: the sums, positions and values, on every
    path a chunk can take (a floor that holds; one passing too many after a scale jump, too few
    after a drop, a NaN, ties; chunk sizes off the 64- and 8-element blocks; AVX2 and baseline).
    ``owed``: the last residual's subtractions left to the scan (``r`` read minus the kept values
    at their positions: ~2 % of each chunk, a chunk owing more than 512, the first and last
    position, -0.0 values) give the bits of :func:`_native.sub_at` on ``r`` first; r is not written."""
    from adacomp.compressors import _native
    from adacomp.compressors.chunktopk import chunk_select
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()})")
    gen_ = torch.Generator().manual_seed(chunk + rows)
    g = torch.randn(rows, chunk, generator=gen_)
    r = torch.randn(rows, chunk, generator=gen_) * 0.3
    if case == "scales":  # jumps and drops between neighbouring chunks: both fallbacks
        g *= torch.tensor([1.0, 1.0, 40.0, 40.0, 0.01, 1.0, 0.0, 1.0] * rows)[:rows].unsqueeze(1)
    if case == "nan":
        g[rows // 2, chunk // 3] = float("nan")
    if case == "ties":
        g = torch.randint(-3, 4, (rows, chunk), generator=gen_).float()
        r = torch.zeros(rows, chunk)
    k = max(1, chunk // 50)
    fused_out = torch.empty(rows * chunk)
    n = rows * chunk
    r_read = r
    owes = None
    if owed == "owed":
        pos = torch.unique(torch.cat([torch.tensor([0, n - 1]), torch.randint(n, (n // 50,), generator=gen_),
                                      torch.arange(chunk, chunk + min(chunk, 600))]))
        vals = torch.randn(pos.numel(), generator=gen_)
        vals[::7] = -0.0
        owes = (pos, vals)
        r_read = r.clone()
        assert _native.sub_at(r_read.view(-1), r_read.view(-1), pos, vals)
    r_before = r.clone()
    got = _native.chunk_topk(fused_out, rows, chunk, k, add=(g.view(-1), r.view(-1)), owed=owes)
    assert torch.equal(r.view(torch.int32), r_before.view(torch.int32))
    summed = torch.add(g, r_read)
    assert torch.equal(fused_out.view(torch.int32), summed.view(-1).view(torch.int32))  # the sum, whole
    want = _native.chunk_topk(summed.view(-1).clone(), rows, chunk, k)
    if case == "nan":
        assert got is None and want is None  # torch's path answers
        return
    assert got is not None and want is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))
    monkeypatch.setattr(_native, "usable", lambda a: False)  # torch's path: the reference
    torch_idx, torch_vals = chunk_select(summed, k)
    assert torch.equal(got[0], torch_idx) and torch.equal(got[1].view(torch.int32), torch_vals.view(torch.int32))


@pytest.mark.parametrize("bits,chunk,n", [(2, 4096, 3 * 4096 + 1000), (1, 64, 640), (4, 48, 2048), (8, 100, 1000),
                                          (32, 48, 650), (2, 40000, 90000), (4, 1000, 3500), (1, 700, 2900)])
@pytest.mark.parametrize("case", ["gauss", "negzero", "nan"])
def test_fused_mean_and_residual_match_decompress(bits, chunk, n, case, avx2_switch, monkeypatch):
    """mean_into (one sparse pass over every rank's decoded values; for 1, 2 and 4 bits decoded slab
    by slab inside that C call, ``_native.chunk_mean``) and residual (the kept positions only) give
    the generic path's bits: decompress each, d0 + d1, / world; tensor - decompress. The C decoding
    with AVX2 (8 codes a step where a row keeps 8 or more) and without."""
    from adacomp.compressors import _native
    real, fused = _native.chunk_mean, []
    monkeypatch.setattr(_native, "chunk_mean", lambda *a, **kw: fused.append(real(*a, **kw)) or fused[-1])
    g = torch.Generator().manual_seed(bits * 7 + chunk)
    comp = compressors.get("chunktopk", density=0.05, chunk=chunk, bits=bits)
    ts = [torch.randn(n, generator=g) for _ in range(3)]
    if case == "negzero":  # a chunk of -0.0 on every rank: every kept value is -0.0 there
        for t in ts:
            t[:chunk] = -0.0
    if case == "nan":
        ts[1][5] = float("nan")
    sent = [comp.compress(t, "w") for t in ts]
    ctx = sent[0][1]
    for world in (2, 3):
        dec = [comp.decompress(p, ctx).clone() for p, _ in sent[:world]]
        ref = dec[0] + dec[1]
        for d in dec[2:]:
            ref += d
        ref /= world
        out = torch.full((n,), 7.0)
        if comp.mean_into([p for p, _ in sent[:world]], ctx, out):
            assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), (case, world)
        else:
            assert case == "negzero"  # the only payloads left to the communicator's path
    # the slab-decoding mean answered wherever its bits pack and no scale could decode to -0.0
    assert fused == ([] if bits == 32 else [bits in (1, 2, 4) and case != "negzero"] * 2)
    for t, (p, c) in zip(ts, sent):
        ref = torch.sub(t, comp.decompress(p, c).view_as(t))
        same = t.clone()
        assert comp.residual(same, p, c, same) is same
        other = comp.residual(t, p, c, torch.empty_like(t))
        for got in (same, other):
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_quantizer_c_path_equals_torch(bits, avx2_switch):
    """The C quantizer gives torch's scales and codes: a zero row (scale 0), -0.0, values at
    +-scale, and values whose scaled level lies exactly half-way (round half to even); with the AVX2
    rows (8 values a step, then the row's tail) and the baseline loop."""
    from adacomp.compressors import _native
    from adacomp.compressors.chunktopk import quantize
    g = torch.Generator().manual_seed(bits)
    v = torch.randn(9, 33, generator=g)
    v[2] = 0.0
    v[3, :5] = -0.0
    v[4, 0], v[4, 1] = -v[4].abs().max(), v[4].abs().max()
    top = (1 << bits) - 1
    v[5] = 1.0
    grid = min(top + 1, 32)
    v[5, 1:grid + 1] = torch.arange(grid) * (2.0 / top) - 1.0  # t = j exactly (grid points)
    v[6] = torch.arange(33, dtype=torch.float32) / 32 * 2 - 1 + 1 / (2 * top)  # some t at j + 1/2
    got = _native.chunk_quantize(v, bits)
    assert got is not None
    scales = v.abs().amax(dim=1)
    assert torch.equal(got[0].view(torch.int32), scales.view(torch.int32))
    assert torch.equal(got[1], quantize(v, scales, bits).reshape(-1))
    v[7, 3] = float("nan")
    assert _native.chunk_quantize(v, bits) is None
    v[7, 3] = float("inf")  # inf / inf: left to torch as well
    assert _native.chunk_quantize(v, bits) is None


@pytest.mark.parametrize("bits,chunk,n", [(2, 4096, 3 * 4096 + 1000), (2, 4096, 1000), (2, 256, 1024),
                                          (1, 64, 640 + 35), (4, 48, 2048), (1, 40000, 3 * 40000 + 7),
                                          (2, 100, 100 * 7 + 9), (4, 24, 24 * 5 + 5)])
@pytest.mark.parametrize("case", ["gauss", "zeros", "inf"])
def test_payload_written_in_one_c_call_a_run_equals_torchs_sequence(bits, chunk, n, case, avx2_switch, monkeypatch):
    """The payload from _native.chunk_encode (scales, codes packed from the run's first code on, the
    partial run's codes finishing the byte the full chunks began, int16 positions, their uint16
    pattern above 32767) is byte for byte the torch sequence's (concatenations, chunk_quantize,
    pack_bits, the int16 conversion); an infinity leaves it to torch's path."""
    from adacomp.compressors import _native
    c = compressors.get("chunktopk", density=0.03, chunk=chunk, bits=bits)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + bits))
    if case == "zeros":
        x[:chunk] = 0.0  # a chunk of scale 0 (code 0 throughout)
    if case == "inf":
        x[n // 2] = float("inf")
    calls: list = []
    real = _native.chunk_encode
    monkeypatch.setattr(_native, "chunk_encode", lambda *a: calls.append(real(*a)) or calls[-1])
    got, ctx = c.compress(x, "w")
    runs = [end for end in (ctx.full * chunk if ctx.full else 0, n if ctx.tail else 0) if end]
    if case == "inf":  # the runs before the one holding it are written, that one is refused
        runs = runs[:next(i for i, end in enumerate(runs) if n // 2 < end) + 1]
    assert calls == [True] * (len(runs) - (case == "inf")) + [False] * (case == "inf")
    monkeypatch.setattr(_native, "chunk_encode", lambda *a: False)
    want, _ = c.compress(x, "w")
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.uint8, torch.float32, torch.int16]
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if case != "inf":
        assert torch.equal(c.decompress(got, ctx), c.decompress(want, ctx))


def test_layout_follows_a_changed_density():
    """layout() is kept per shape; a new density (an adaptive policy's) gives the new k per chunk,
    as a fresh compressor's layout, and the payload that size."""
    c = compressors.get("chunktopk", density=0.02, chunk=256, bits=2)
    before = c.layout(torch.Size([1000]))
    c.set_density(0.1)
    fresh = compressors.get("chunktopk", density=0.1, chunk=256, bits=2)
    assert c.layout(torch.Size([1000])) == fresh.layout(torch.Size([1000])) != before
    payload, ctx = c.compress(torch.randn(1000, generator=torch.Generator().manual_seed(0)), "w")
    assert sum(t.numel() * t.element_size() for t in payload) == fresh.payload_bytes(torch.Size([1000]))
