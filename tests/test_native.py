"""The fused C passes (issue 32, item 2) give bitwise the torch path's answers.

* ``_native.select`` / ``count`` equal torch's comparison + ``nonzero`` / ``count_nonzero`` for
  every mode, with NaN, inf, zeros and thresholds that float32 cannot hold (torch rounds them to
  float32 once; so must we);
* ``_native.rth_largest_strided`` equals ``topk(a[::step], r).values.min()``, and hands NaN /
  negative samples back to torch;
* every threshold sparsifier's payloads, decompressed means and residuals over several error-feedback
  steps are bitwise the same with the library as without it (``ADACOMP_NATIVE=0``);
* ``divide_touched`` is bitwise ``div_`` on a sparse sum (duplicates, negative zeros, inf, NaN);
* ``_native.uniform_`` draws torch's ``uniform_`` stream bitwise and leaves the generator in torch's state.

The library must build here: CI has a C compiler, so a missing one is a failure, not a skip.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from adacomp import communicators, compressors, memories
from adacomp.communicators.base import CommEnv, Entry
from adacomp.compressors import _native
from adacomp.compressors._bitpack import pack_bits
from adacomp.compressors.sparse import divide_touched
from adacomp.engine.error_feedback import exchange
from adacomp.engine.metrics import StepStats
from tests._dist import run_workers


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def test_library_builds() -> None:
    assert _native.library() is not None, _native.why_unavailable()


def test_library_builds_in_the_temporary_directory_when_the_cache_is_not_writable(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("ADACOMP_CACHE", str(blocker))  # <file>/native cannot be created
    lib = _native._build()
    a = torch.tensor([0.5, 3.0, float("nan"), 2.0])
    assert int(lib.ac_count_ge(a.data_ptr(), 4, 1.0)) == 2


def magnitudes(n: int, seed: int) -> torch.Tensor:
    a = torch.randn(n, generator=torch.Generator().manual_seed(seed)).abs()
    a[3] = float("nan")
    a[n // 2] = float("inf")
    a[10:200] = 0.0
    a[n - 1] = float("nan")
    return a


@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 4099, 1 << 18])
@pytest.mark.parametrize("mode,op", [("ge", torch.ge), ("gt", torch.gt), ("not_lt", lambda x, t: ~torch.lt(x, t))])
def test_select_and_count_equal_torch(n: int, mode: str, op, avx2_switch: str) -> None:
    """Selection (64-element masks with AVX2, 16 without) and counts equal torch's comparisons."""
    a = magnitudes(max(n, 300), seed=n)[:n].contiguous()
    probe = float(a[min(n - 1, 5)]) if n > 5 else 0.5
    for thr in [0.0, 1e-40, 0.5, probe, probe + 1e-9, probe - 1e-12, 2.5000000001, math.inf, 1.1754943508222875e-38]:
        ref = op(a, thr)
        idx, vals = _native.select(a, thr, mode, expected=0.001)  # a short first guess: the retry path too
        assert torch.equal(idx, torch.nonzero(ref).view(-1)), (mode, thr)
        assert torch.equal(bits(vals), bits(a[ref])), (mode, thr)
        assert _native.count(a, thr, mode) == int(ref.sum())


def _blocky(seed: int) -> torch.Tensor:
    """Signed values whose 64-element blocks pass |x| >= 1 at every count from 0 to 64 (and a NaN),
    the last passing ones in a block the AVX2 loops pack eight lanes at a time (``AC_DENSE_MIN``)."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for passing in [*range(65), 1, 0, 2, 3, 64, 0, 20, 0]:
        b = (torch.rand(64, generator=g) * 0.9)
        b[torch.randperm(64, generator=g)[:passing]] += 1.5
        blocks.append(b * torch.where(torch.rand(64, generator=g) < 0.5, -1.0, 1.0))
    x = torch.cat(blocks + [torch.rand(37, generator=g) * 2])  # a tail the block loop leaves
    x[200] = float("nan")
    return x


@pytest.mark.parametrize("kernel", ["select_abs_ge", "select_abs_not_lt", "select_gt", "add_select", "add_stats",
                                    "sumsq", "momentum", "select_signed32", "add_select_zeroed", "add_stats_zeroed"])
def test_compactions_count_all_and_write_what_fits_at_every_cap(kernel: str, avx2_switch: str) -> None:
    """The C compactions (their first two per 64-block written without a branch, a block with many
    passing packed eight lanes at a time where 64 more fit under ``cap``) return the full count and
    write exactly the first ``cap`` passing positions and values, whatever ``cap``."""
    import ctypes
    lib = _native.library()
    x = _blocky(len(kernel))
    if kernel.endswith("_zeroed"):
        x[64] = -0.0  # at a zeroed position: -0.0 + (+0.0) is +0.0, as after ac_zero_at
    n = x.numel()
    r = _blocky(99) * 0.25
    t = 1.0
    xf, rf = x.nan_to_num(), r.nan_to_num()  # the statistics and moments passes stop at a NaN
    zero, out1, out2 = torch.zeros(n), torch.empty(n), torch.empty(n)
    stats, amax = torch.empty(3), torch.empty(1, dtype=torch.int64)
    sumsq, used = torch.empty(1, dtype=torch.float64), torch.empty(1, dtype=torch.int32)
    p = {k: v.data_ptr() for k, v in dict(x=x, r=r, xf=xf, rf=rf, zero=zero, out1=out1, out2=out2, stats=stats,
                                          amax=amax, sumsq=sumsq, used=used).items()}
    ct = ctypes.c_float(t)
    # the residual's zeroing left to the add (SparseCompressor.defer_residual): blocks with none, one, two
    # (the branch-free ones) and many zeroed positions, the first and last position, the tail's
    zi = torch.tensor(sorted({0, 5, 64, 130, 131, 200, *range(256, 320, 3), 517, n - 30, n - 1}), dtype=torch.int64)
    rz = r.clone().index_fill_(0, zi, 0.0)
    rzf = rz.nan_to_num()
    z = zi.data_ptr()
    cases = {  # kernel -> (its call on (idx, vals, cap), the reference mask, the reference values)
        "select_abs_ge": (lambda i, v, c: lib.ac_select_abs_ge(p["x"], n, ct, i, v, c), x.abs() >= t, x.abs()),
        "select_abs_not_lt": (lambda i, v, c: lib.ac_select_abs_not_lt(p["x"], n, ct, i, v, c), ~(x.abs() < t),
                              x.abs()),
        "select_gt": (lambda i, v, c: lib.ac_select_gt(p["x"], n, ct, i, v, c), x > t, x),
        "add_select": (lambda i, v, c: lib.ac_add_select_abs_not_lt(p["x"], p["r"], p["out1"], n, ct, i, v, c,
                                                                    None, 0),
                       ~((x + r).abs() < t), x + r),
        "add_stats": (lambda i, v, c: lib.ac_add_abs_stats_select(p["xf"], p["rf"], p["out1"], n, p["stats"],
                                                                  p["amax"], ct, 0, i, v, c, None, 0),
                      (xf + rf).abs() >= t, xf + rf),  # the signed sums
        "add_select_zeroed": (lambda i, v, c: lib.ac_add_select_abs_not_lt(p["x"], p["r"], p["out1"], n, ct, i, v,
                                                                           c, z, zi.numel()),
                              ~((x + rz).abs() < t), x + rz),
        "add_stats_zeroed": (lambda i, v, c: lib.ac_add_abs_stats_select(p["xf"], p["rf"], p["out1"], n, p["stats"],
                                                                         p["amax"], ct, 0, i, v, c, z, zi.numel()),
                             (xf + rzf).abs() >= t, xf + rzf),
        "sumsq": (lambda i, v, c: lib.ac_sumsq_select_abs_gt(p["xf"], n, ctypes.c_double(0.0), ct, i, v, c,
                                                             p["sumsq"], 0, p["used"]), xf.abs() > t, xf),
        # DGC's pass with u = 0: u' = 0.9 * 0 + g, v' = r + u'
        "momentum": (lambda i, v, c: lib.ac_momentum_select_abs_ge(p["zero"], p["x"], p["r"], p["out1"], p["out2"], n,
                                                                   ctypes.c_float(0.9), ct, i, v, c, None, 0),
                     (r + (zero * 0.9 + x)).abs() >= t, r + (zero * 0.9 + x)),
        # SIDCo's first stage: int32 positions, the signed values
        "select_signed32": (lambda i, v, c: lib.ac_select_abs_gt_signed32(p["x"], n, ct, i, v, c), x.abs() > t, x),
    }
    call, mask, ref = cases[kernel]
    positions = torch.int32 if kernel.endswith("32") else torch.int64
    want_idx = torch.nonzero(mask).view(-1)
    total = want_idx.numel()
    assert total > 100
    for cap in sorted({0, 1, 2, 3, 63, 64, 65, total - 2, total - 1, total, total + 1, total + 64}):
        idx = torch.full((cap + 16,), -7, dtype=positions)
        vals = torch.full((cap + 16,), -7.0)
        assert call(idx.data_ptr(), vals.data_ptr(), cap) == total, cap
        m = min(cap, total)
        assert torch.equal(idx[:m].long(), want_idx[:m]), cap
        assert torch.equal(bits(vals[:m]), bits(ref[want_idx[:m]])), cap
        # past the count: at most the two fast writes, or a packed block's eight lanes; never at or past cap
        assert bool((idx[m + 8:] == -7).all()) and bool((idx[cap:] == -7).all()), cap
        assert bool((vals[cap:] == -7.0).all()), cap
    if kernel.endswith("_zeroed"):  # the sum written whole, +0.0 of the residual at every zeroed position
        assert torch.equal(bits(out1), bits(ref))


@pytest.mark.parametrize("n", [1, 15, 17, 65, 4099, 1 << 18])
def test_abs_select_and_sample_equal_torch_on_signed_values(n: int, avx2_switch: str) -> None:
    """The prefilters on the signed gradient (Top-k, DGC): ``abs_<mode>`` equals ``<mode>`` on ``|a|``
    with ``|a|`` as the values, and the sampled r-th largest of ``|a[::step]|`` equals torch's on ``a.abs()``
    (-0.0, -inf, NaN, negative denormals included)."""
    g = torch.Generator().manual_seed(n)
    a = torch.randn(max(n, 40), generator=g)[:n].contiguous()
    for i, v in zip(range(0, n, 3), [-0.0, float("-inf"), float("nan"), -1e-42, 0.0, -3.5]):
        a[i] = v
    mag = a.abs()
    for mode, op in [("ge", torch.ge), ("gt", torch.gt), ("not_lt", lambda x, t: ~torch.lt(x, t))]:
        for thr in [0.0, 1e-40, 0.5, 1.0000001, math.inf]:
            ref = op(mag, thr)
            idx, vals = _native.select(a, thr, f"abs_{mode}", expected=0.001)
            assert torch.equal(idx, torch.nonzero(ref).view(-1)), (mode, thr)
            assert torch.equal(bits(vals), bits(mag[ref])), (mode, thr)
            assert _native.count(a, thr, f"abs_{mode}") == int(ref.sum()), (mode, thr)
    clean = torch.randn(max(n, 40), generator=g)[:n].contiguous()
    clean[0] = -0.0
    for step in (1, 3):
        m = clean[::step].numel()
        for r in {1, max(1, m // 80), m}:
            want = float(torch.topk(clean.abs()[::step], r, sorted=False).values.min())
            assert _native.rth_largest_strided(clean, step, r, absolute=True) == want
    assert _native.rth_largest_strided(a, 1, 1, absolute=True) is None or not bool(torch.isnan(a).any())


@pytest.mark.parametrize("n", [7, 65535, 65536, 131071, 1 << 20])
@pytest.mark.parametrize("fraction", [1e-4, 0.0126, 0.3, 1.0])
def test_rth_largest_equals_topk_min(n: int, fraction: float) -> None:
    g = torch.Generator().manual_seed(n)
    for a in (torch.randn(n, generator=g).abs(), torch.zeros(n), torch.randint(0, 4, (n,), generator=g).float()):
        step = max(1, n // (1 << 16))
        s = a[::step]
        r = min(s.numel(), max(1, math.ceil(fraction * s.numel())))
        assert _native.rth_largest_strided(a, step, r) == float(torch.topk(s, r, sorted=False).values.min())
    a = torch.randn(n, generator=g)
    a[0] = -1.0
    assert _native.rth_largest_strided(a, 1, 1) is None  # negative: torch's path
    a = a.abs()
    a[0] = float("nan")
    assert _native.rth_largest_strided(a, 1, 1) is None  # NaN ranks first there


@pytest.mark.parametrize("seed", [0, 7, 2 ** 40 + 3])
def test_uniform_equals_torch_numbers_and_generator_state(seed: int) -> None:
    """QSGD's stream: the C Mersenne Twister gives torch's ``uniform_`` floats bitwise and leaves the
    generator where torch's would, across twists (624 words) and from a fresh or a used state."""
    mine, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for n in (1, 623, 1, 624, 625, 1 << 18, 3, 1249):
        got = torch.full((n,), -1.0)
        assert _native.uniform_(got, mine)
        want = torch.empty(n).uniform_(generator=theirs)
        assert torch.equal(bits(got), bits(want)), n
        assert torch.equal(mine.get_state(), theirs.get_state()), n
    assert float(got.min()) >= 0.0 and float(got.max()) < 1.0
    assert not _native.uniform_(torch.empty(4, dtype=torch.float64), mine)  # not its dtype: torch draws
    assert not _native.uniform_(torch.empty(8)[::2], mine)  # strided
    assert torch.equal(mine.get_state(), theirs.get_state())  # a refusal draws nothing


@pytest.mark.parametrize("seed", [0, 2 ** 40 + 3])
def test_sample_take_draws_torchs_randint_and_gathers(seed: int) -> None:
    """DGC's threshold sample in one C call: the values of ``a`` at ``torch.randint(n, (m,))``'s
    positions, in draw order, and the generator left where torch's randint leaves it, across twists
    and the call's 256-draw chunks, on ranges from 1 to past 2^24; a tensor C cannot read draws nothing."""
    mine, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    for n, m in ((1, 3), (5, 0), (300, 255), (300, 256), (300, 257), (1 << 20, 1249), ((1 << 24) + 7, 5000)):
        a = torch.randn(n, generator=g)
        got = _native.sample_take(a, m, mine)
        assert got is not None, (n, m)
        want = a[torch.randint(n, (m,), generator=theirs)]
        assert torch.equal(bits(got), bits(want)), (n, m)
        assert torch.equal(mine.get_state(), theirs.get_state()), (n, m)
    assert _native.sample_take(torch.randn(8, dtype=torch.float64), 4, mine) is None  # not its dtype
    assert _native.sample_take(torch.randn(16)[::2], 4, mine) is None  # strided
    assert torch.equal(mine.get_state(), theirs.get_state())  # a refusal draws nothing


def test_uniform_discard_draws_torchs_stream_and_leaves_the_generator() -> None:
    """The cost benchmark's ``rng`` pass: n numbers of the stream a chunk at a time into one scratch
    (its last chunk torch's last numbers), the generator itself untouched."""
    gen = torch.Generator().manual_seed(5)
    before = gen.get_state()
    scratch = torch.full((1000,), -1.0)
    assert _native.uniform_discard(gen, 2500, scratch)
    want = torch.empty(2500).uniform_(generator=torch.Generator().manual_seed(5))
    assert torch.equal(bits(scratch[:500]), bits(want[2000:])) and torch.equal(bits(scratch[500:]), bits(want[1500:2000]))
    assert torch.equal(gen.get_state(), before)
    assert not _native.uniform_discard(gen, 10, torch.empty(0))


@pytest.mark.parametrize("size,off0,m", [(100, 0, 1003), (512, 0, 4096), (1 << 20, 3 << 18, 5000), (7, 0, 3)])
def test_qsgd_codes_equal_torch_operations(size: int, off0: int, m: int, avx2_switch: str) -> None:
    """The fused QSGD rounding gives the codes of torch's elementwise sequence: -0.0, zeros, a zero
    bucket (norm 1 stands in), denormals, values at the bucket's norm, levels past 2^23 and infinite
    ones (clamped to s), bucket boundaries inside the block (``off0``: a block that starts inside a
    bucket); a NaN hands the block back to torch."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, generator=g)
    x[0], x[1], x[2] = -0.0, 0.0, 1e-42
    if m > 300:
        x[260], x[261], x[262] = 3e38, -1e20, 2e6  # |v| / norm * s: inf, ~1e22, past 2^23
    x[min(m - 1, 150):min(m, 250)] = 0.0  # with size 100: one bucket all zeros
    nb = (off0 + m + size - 1) // size - off0 // size
    norms = torch.rand(nb, generator=g) * 3 + 0.01
    norms[0] = float(x[:min(m, size - off0 % size)].abs().max()) or 1.0  # some |v| / norm == 1 exactly
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    per = safe[(off0 % size + torch.arange(m)) // size]
    for s in (1, 7, 127):
        rnd = torch.rand(m, generator=g)
        got = torch.full((m,), 255, dtype=torch.uint8)
        assert _native.qsgd_codes(x, rnd, safe, off0 % size, size, s, got)
        a = x.abs().div_(per).mul_(s).add_(rnd).floor_().clamp_(max=s)  # QSGDCompressor._codes_torch's sequence
        assert torch.equal(got, a.copysign_(x).add_(s).to(torch.uint8)), s
    y = x.clone()
    y[m // 2] = float("nan")
    assert not _native.qsgd_codes(y, rnd, safe, off0 % size, size, 7, got)


@pytest.mark.parametrize("method,params", [("qsgd", {"bits": 4}), ("qsgd", {"bits": 2, "bucket_size": 100}),
                                           ("qsgd", {"bits": 2, "bucket_size": 7}), ("qsgd", {"bits": 3}),
                                           ("qsgd", {"bits": 2, "bucket_size": 0}),
                                           ("qsgd", {"bits": 4, "bucket_size": 0}), ("efsignsgd", {})])
@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("n", [10007, 40009])
def test_fused_mean_equals_decompress_sum_divide(method: str, params: dict, world: int, n: int) -> None:
    """The quantisers' fused mean over ranks equals the communicators' generic path bitwise:
    decompress each rank's payload, ``d0 + d1``, ``+= d_r``, ``/ world`` (QSGD's 3-bit codes are left
    to that path). 40009 elements in one bucket take the C path's whole-byte tables."""
    comp = compressors.get(method, **params)
    assert comp.fused_mean
    g = torch.Generator().manual_seed(world)
    sent = [comp.compress(torch.randn(n, generator=g) * (r + 1), "w") for r in range(world)]
    payloads, ctx = [p for p, _ in sent], sent[0][1]
    acc = torch.add(comp.decompress(payloads[0], ctx), comp.decompress(payloads[1], ctx))
    for p in payloads[2:]:
        acc.add_(comp.decompress(p, ctx))
    acc.div_(world)
    out = torch.full((n,), float("nan"))
    assert comp.mean_into(payloads, ctx, out) == (params.get("bits") != 3)
    if params.get("bits") != 3:
        assert torch.equal(bits(out), bits(acc))


THRESHOLD = [("topk", "allgather_fast"), ("gtopk", "allgather"), ("dgc", "allgather"), ("gaussiank", "allgather"),
             ("redsync", "allgather"), ("mstopk", "allgather"), ("sidco", "allgather"), ("adtopk", "allgather_fast"),
             ("qsgd", "allgather_fast"), ("efsignsgd", "allgather_fast"), ("chunktopk", "allgather_fast"),
             ("topk", "alltoall")]
PARAMS = {"qsgd": [{"bits": 4}, {"bits": 2}, {"bits": 3, "bucket_size": 100}], "efsignsgd": [{}],
          "chunktopk": [{"bits": 2, "chunk": 512}, {"bits": 1, "chunk": 100}, {"bits": 4, "chunk": 512}]}


def _run(method: str, comm_name: str, native: bool, backend, params: dict | None = None) -> list[list[torch.Tensor]]:
    """Three error-feedback steps of one method through its communicator over ``backend`` (real
    gloo, two ranks with different gradients), with or without the library."""
    import os
    os.environ["ADACOMP_NATIVE"] = "1" if native else "0"
    comp = compressors.get(method, **(params if params is not None else {"density": 0.01}))
    comm = communicators.get(comm_name)
    memory = memories.get("dgc" if method == "dgc" else "residual")
    g = torch.Generator().manual_seed(7 + backend.rank())
    shapes = [(300, 700), (1 << 17,), (64, 3, 3, 3), (5000,), (1000, 770)]
    seen: list[list[torch.Tensor]] = []
    for step in range(3):
        grads = [torch.randn(s, generator=g) for s in shapes]
        grads[1][:1000] = 0.0  # a ReLU-like run of exact zeros
        entries = [Entry(f"p{i}", memory.compensate(t, f"p{i}", 2, compressor=comp), comp, memory)
                   for i, t in enumerate(grads)]
        means = exchange(comm, entries, CommEnv(backend, StepStats(), step=step, bucket_index=0))
        payloads = [p for e in entries for p in e.payload]
        seen.append(payloads + list(means) + [t.clone() for t in memory.state_dict().get("residuals", {}).values()])
        comp.on_step(step + 1)
    return seen


def _paths_job() -> dict[str, list[str]]:
    """Every case with and without the library on this rank; the differences found, per case."""
    import torch.distributed as dist
    from adacomp.backends.torch_dist import TorchBackend
    dist.init_process_group("gloo")
    backend = TorchBackend()
    out: dict[str, list[str]] = {}
    for method, comm_name in THRESHOLD:
        problems: list[str] = []
        for params in PARAMS.get(method, [None]):
            fast = _run(method, comm_name, True, backend, params)
            slow = _run(method, comm_name, False, backend, params)
            if len(fast) != len(slow):
                problems.append(f"{params}: {len(fast)} vs {len(slow)} steps")
            for step, (step_fast, step_slow) in enumerate(zip(fast, slow)):
                if len(step_fast) != len(step_slow):
                    problems.append(f"{params} step {step}: {len(step_fast)} vs {len(step_slow)} tensors")
                for i, (a, b) in enumerate(zip(step_fast, step_slow)):
                    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a), bits(b)):
                        problems.append(f"{params} step {step} tensor {i} differs")
        out[f"{method}-{comm_name}"] = problems
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def paths() -> list[dict[str, list[str]]]:
    assert _native.library() is not None, _native.why_unavailable()
    return run_workers(_paths_job, 2, timeout=600)


@pytest.mark.parametrize("method,comm_name", THRESHOLD)
def test_sparsifiers_bitwise_equal_with_and_without_the_library(method: str, comm_name: str, paths) -> None:
    """Payloads, averaged results and residuals bitwise the same with the library and without,
    on two real gloo ranks whose gradients differ."""
    for rank, per_case in enumerate(paths):
        assert per_case[f"{method}-{comm_name}"] == [], f"rank {rank}: {per_case[f'{method}-{comm_name}'][:5]}"


@pytest.mark.parametrize("b", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001, 1 << 16])
def test_bit_packing_equals_torch(b: int, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from adacomp.compressors._bitpack import byte_table, unpack_bits, unpack_table
    g = torch.Generator().manual_seed(n + b)
    codes = torch.randint(0, 1 << b, (n,), generator=g, dtype=torch.uint8)
    values = torch.randn(1 << b, generator=g)
    x = torch.randn(n, generator=g)
    if n > 3:
        x[:3] = torch.tensor([float("nan"), -0.0, 0.0])
    got = [pack_bits(codes, b), pack_bits(codes.bool(), 1) if b == 1 else None, _native.pack_nonneg(x)]
    out = torch.empty(n)
    assert _native.decode(pack_bits(codes, b), b, n, values, out) or n == 0
    got_unpacked = unpack_bits(got[0], b, n)
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    ref = [pack_bits(codes, b), pack_bits(codes.bool(), 1) if b == 1 else None, pack_bits(torch.ge(x, 0), 1)]
    for a, r in zip(got, ref):
        assert (a is None and r is None) or torch.equal(a, r)
    assert torch.equal(got_unpacked, codes) and torch.equal(unpack_bits(ref[0], b, n), codes)
    want = torch.empty(n)
    if n:
        unpack_table(ref[0], b, n, byte_table(b, values), want)
        assert torch.equal(bits(out), bits(want))


@pytest.mark.parametrize("world", [2, 3])
def test_divide_touched_is_bitwise_div(world: int) -> None:
    n = 1 << 16
    g = torch.Generator().manual_seed(world)
    idx = torch.randint(0, n, (world * 300,), generator=g)  # duplicates across ranks
    vals = torch.randn(world * 300, generator=g)
    vals[:5] = -0.0
    vals[5] = float("inf")
    vals[6] = float("nan")
    vals[7] = 1e-45  # subnormal
    ref = torch.zeros(n).index_add_(0, idx, vals)
    got = ref.clone()
    ref.div_(world)
    divide_touched(got, idx, world)
    assert torch.equal(bits(ref), bits(got))


@pytest.mark.parametrize("beta", [1.0, 0.9])
@pytest.mark.parametrize("method", ["topk", "gaussiank", "randomk", "qsgd"])
def test_residual_kept_in_place_equals_the_copying_plan(method: str, beta: float) -> None:
    """ResidualMemory told the compressor (the engine does) adds into its spare buffer and zeroes
    the sent coordinates there when the compressor allows it (sparsifiers); the values of the
    compensated tensors, payloads and residuals are bitwise those of the plan that adds into the
    gradient and copies it out (no compressor given)."""
    def run(tell: bool) -> list[torch.Tensor]:
        comp = compressors.get(method, density=0.05) if method != "qsgd" else compressors.get(method)
        mem = memories.get("residual", beta=beta)
        g = torch.Generator().manual_seed(3)
        out: list[torch.Tensor] = []
        for step in range(4):
            grad = torch.randn(40, 500, generator=g)
            x = mem.compensate(grad, "w", 2, compressor=comp if tell else None)
            payload, ctx = comp.compress(x, "w")
            out += [x.clone(), *[p.clone() for p in payload]]
            mem.update(x, "w", comp, payload, ctx)
            out.append(mem.residuals["w"].clone())
            comp.on_step(step + 1)
        return out
    fast, slow = run(True), run(False)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(fast, slow)) and len(fast) == len(slow)


@pytest.mark.parametrize("mode,op", [("ge", torch.ge), ("not_lt", lambda x, t: ~torch.lt(x, t))])
@pytest.mark.parametrize("shape", [(1, 5), (7, 33), (300, 770)])
def test_select_rows_equals_torch(mode: str, op, shape: tuple[int, int]) -> None:
    m, n = shape
    a = magnitudes(m * n + 300, seed=m)[:m * n].view(m, n).contiguous()
    thr = torch.rand(m, generator=torch.Generator().manual_seed(n)) * 2.5
    thr[0] = float("inf")
    if m > 2:
        thr[1], thr[2] = 0.0, float("nan")
    ref = op(a, thr[:, None]).view(-1)
    got = _native.select_rows(a, thr, mode, expected=0.001)
    assert got is not None
    idx, vals, count = got
    assert count == int(ref.sum()) and torch.equal(idx, torch.nonzero(ref).view(-1))
    assert torch.equal(bits(vals), bits(a.view(-1)[ref]))
    idx, vals, count = _native.select_rows(a, thr, mode, expected=0.0, limit=0)
    assert count == int(ref.sum()) and (count <= 1024 or idx.numel() == 0)


@pytest.mark.parametrize("native", [True, False], ids=["c-pass", "torch"])
def test_dgc_memory_reuses_buffers_and_equals_its_formula(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """DGC's momentum correction and masking (u = m u + g, v = v + u, both zeroed where sent) with
    v + u written into the buffer of the round before last: bitwise the formula computed afresh,
    and the tensor handed out two rounds ago is the only one reused."""
    monkeypatch.setenv("ADACOMP_NATIVE", "1" if native else "0")
    mem = memories.get("dgc", momentum=0.9)
    comp = compressors.get("topk", density=0.05)
    g = torch.Generator().manual_seed(5)
    u_ref = v_ref = None
    handed: list[torch.Tensor] = []
    for step in range(5):
        grad = torch.randn(50, 400, generator=g)
        u_ref = grad.clone() if u_ref is None else u_ref * 0.9 + grad
        v_ref = u_ref.clone() if v_ref is None else v_ref + u_ref
        v = mem.compensate(grad.clone(), "w", 2, compressor=comp)
        assert torch.equal(bits(v), bits(v_ref))
        if step >= 2:
            assert v.data_ptr() == handed[-2].data_ptr()  # the buffer of the round before last
        handed.append(v)
        payload, ctx = comp.compress(v, "w")
        mem.update(v, "w", comp, payload, ctx)
        idx = payload[1]
        u_ref.view(-1)[idx] = 0.0
        v_ref.view(-1)[idx] = 0.0
        assert torch.equal(bits(mem.velocity["w"]), bits(u_ref))
        assert torch.equal(bits(mem.accumulated["w"]), bits(v_ref))


@pytest.mark.parametrize("n,m", [((1 << 21) + 7, 40_000), (5000, 30_000), (1 << 16, 100)])
def test_take_grouped_is_the_same_multiset(n: int, m: int) -> None:
    """:func:`_native.take_grouped` reads the values at random positions (repeats, the first and
    the last position, several regions or one) as the same multiset as index_select: the same bits
    once sorted; a position out of range raises as torch's gather does."""
    gen = torch.Generator().manual_seed(n + m)
    x = torch.randn(n, generator=gen)
    x[::97] = -0.0
    idx = torch.cat([torch.randint(n, (m,), generator=gen), torch.tensor([0, n - 1, 0])])
    got, want = _native.take_grouped(x, idx), x.index_select(0, idx)
    assert got.numel() == want.numel()
    assert torch.equal(got.view(torch.int32).sort().values, want.view(torch.int32).sort().values)
    with pytest.raises((IndexError, RuntimeError)):
        _native.take_grouped(x, torch.cat([idx, torch.tensor([n])]))


@pytest.mark.parametrize("n", [64 * 1000 + 37, 63, 4096])
def test_momentum_pass_reads_the_kept_positions_as_zero(n: int, avx2_switch: str) -> None:
    """:func:`_native.momentum_select` with ``zeroed`` gives bitwise the outputs and candidates of
    the same pass after u and v were zeroed there (DGC's masking left to this pass): positions in
    the 64-element blocks and in the tail, adjacent ones, the first and the last, -0.0 in u, v and g
    at and beside them; positions that are not ascending or out of range are refused."""
    gen = torch.Generator().manual_seed(n)
    u, g, v = (torch.randn(n, generator=gen) for _ in range(3))
    at = torch.unique(torch.cat([torch.tensor([0, 1, 2, n - 1]), torch.randint(n, (n // 50 + 1,), generator=gen)]))
    for t in (u, g, v):
        t[at[1::3]] = -0.0
        t[torch.clamp(at + 1, max=n - 1)[::4]] = -0.0
    u0, v0 = u.clone(), v.clone()
    _native.zero_at(u0, at)
    _native.zero_at(v0, at)
    outs = [torch.empty(n) for _ in range(4)]
    want = _native.momentum_select(u0, g, v0, outs[0], outs[1], 0.9, 0.5, 0.2)
    got = _native.momentum_select(u, g, v, outs[2], outs[3], 0.9, 0.5, 0.2, zeroed=at)
    assert want is not None and got is not None
    assert torch.equal(bits(outs[0]), bits(outs[2])) and torch.equal(bits(outs[1]), bits(outs[3]))
    assert torch.equal(got[0], want[0]) and torch.equal(bits(got[1]), bits(want[1]))
    assert _native.ascending_within(at, n)
    assert not _native.ascending_within(at.flip(0), n) and not _native.ascending_within(at, int(at[-1]))
    assert not _native.ascending_within(torch.cat([at[:1], at]), n)  # a repeat


@pytest.mark.parametrize("habit", ["none", "rollback", "state_dict", "rescale", "other_compressor", "topk_memory"])
def test_dgc_masking_left_to_the_next_pass_is_the_immediate_one(habit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DGC memory's masking of the sent coordinates, left to the next compensation's pass (u and v
    read as +0.0 there), gives bitwise the compensated tensors, outputs, u and v of the same run
    with the masking done at every update, through the real allgather; the positions were kept
    and consumed by the pass. A habit in the middle (a rolled-back round, a state_dict read, a
    rescale, a step through another compressor, a sparse compressor without the fused pass) sees
    and keeps the same values."""
    from adacomp.memories import dgc as dgc_memory
    shapes = [(300, 300), (1 << 17) + 3, 4000]
    gen = torch.Generator().manual_seed(17)
    grads = [[torch.randn(s, generator=gen) * (1 + step) for s in shapes] for step in range(6)]
    junk = [torch.randn(s, generator=gen) * 1e3 for s in shapes]
    calls: list[bool] = []
    select = _native.momentum_select

    def counted(*args: Any) -> Any:  # (u, g, v, u_out, v_out, momentum, thr, expected, zeroed)
        calls.append(len(args) > 8 and args[8] is not None)
        return select(*args)
    monkeypatch.setattr(_native, "momentum_select", counted)

    def run(later: bool) -> tuple[list[torch.Tensor], int]:
        monkeypatch.setattr(dgc_memory, "MASK_LATER_MIN", 1 << 16 if later else 1 << 62)
        comp = compressors.get("dgc", density=0.01)
        other = {"other_compressor": compressors.get("dgc", density=0.01),
                 "topk_memory": compressors.get("topk", density=0.05)}.get(habit, comp)
        memory = memories.get("dgc", momentum=0.9)
        seen, kept, _ = _habit_run(memory, comp, other, "allgather", grads, junk, habit, lambda: len(memory._zeroed))
        return seen, kept

    later, kept = run(True)
    consumed = sum(calls)
    now, none_kept = run(False)
    assert kept > 0 and consumed > 0 and none_kept == 0
    assert len(later) == len(now)
    for a, b in zip(later, now):
        assert torch.equal(bits(a), bits(b))


def test_workspace_recycles_many_outputs_of_one_shape() -> None:
    """A model with many tensors of one shape holds all their outputs at once (as gradients); the
    next step must get those buffers back, not fresh allocations, and never one still held."""
    from adacomp.compressors.sparse import RECYCLE_MIN_NUMEL, Workspace
    ws = Workspace()
    n = RECYCLE_MIN_NUMEL
    shape = torch.Size([n])
    first = [ws.zeros(shape, n, torch.float32, torch.device("cpu")) for _ in range(12)]
    ptrs = {t.data_ptr() for t in first}
    assert len(ptrs) == 12  # all held at once: twelve distinct buffers
    del first
    second = [ws.zeros(shape, n, torch.float32, torch.device("cpu")) for _ in range(12)]
    assert {t.data_ptr() for t in second} == ptrs  # released, then every one reused
    third = ws.zeros(shape, n, torch.float32, torch.device("cpu"))
    assert third.data_ptr() not in ptrs  # all twelve still held: a new one


def test_workspace_transfer_buffers_follow_the_size_and_are_never_shared() -> None:
    """Transfer buffers (a bucket's packed payloads, their gather) change size from step to step: a
    free kept buffer that is large enough comes back, a held one (an in-flight collective's, a view
    the caller kept) never does, and a free one too small is replaced, not kept beside the new."""
    from adacomp.compressors.sparse import RECYCLE_MIN_NUMEL, Workspace
    ws, cpu, n = Workspace(), torch.device("cpu"), RECYCLE_MIN_NUMEL
    a = ws.transfer("recv", n, torch.uint8, cpu)
    base = a.data_ptr()
    del a
    b = ws.transfer("recv", n + n // 10, torch.uint8, cpu)  # larger, within the headroom: the same buffer
    assert b.data_ptr() == base and b.numel() == n + n // 10
    c = ws.transfer("recv", n, torch.uint8, cpu)  # b still held: another buffer
    assert c.data_ptr() != base
    del b, c
    d = ws.transfer("recv", 4 * n, torch.uint8, cpu)  # past both: a new one in place of a free one
    assert d.data_ptr() != base and len(ws._outputs[("transfer", "recv", torch.uint8)]) == 2
    assert ws.transfer("send", n, torch.uint8, cpu).data_ptr() != d.data_ptr()  # tags keep apart
    assert ws.transfer("recv", 100, torch.uint8, cpu).numel() == 100  # small: the heap, not the pool
    # the pool's first buffer held, a later one free and too small: that one is replaced (found by
    # identity: comparing the buffers' contents raised once the sizes differed)
    e = ws.transfer("recv", 4 * n, torch.uint8, cpu)  # d still held: a second buffer beside it
    del e
    f = ws.transfer("recv", 8 * n, torch.uint8, cpu)
    pool = ws._outputs[("transfer", "recv", torch.uint8)]
    assert len(pool) == 2 and any(b.data_ptr() == d.data_ptr() for b in pool) and f.numel() == 8 * n


def test_portable_c_paths_equal_the_sse_paths(tmp_path) -> None:
    """Targets without SSE2 (aarch64) compile the scalar loops: built here with ``__SSE2__``
    undefined, they give the same selections, QSGD codes and samples as the SSE2 build."""
    import ctypes
    import subprocess
    src = tmp_path / "portable.c"
    src.write_text(_native._SOURCE)
    so = tmp_path / "portable.so"
    subprocess.run(["cc", *_native._FLAGS, "-U__SSE2__", "-o", str(so), str(src)], check=True)
    portable, sse = _native._load(so), _native.library()
    assert sse is not None
    g = torch.Generator().manual_seed(5)
    a = torch.randn(4099, generator=g)
    a[7], a[100], a[2000] = float("nan"), -0.0, float("-inf")
    for name in ("ac_select_ge", "ac_select_gt", "ac_select_not_lt", "ac_select_abs_not_lt"):
        outs = []
        for lib in (portable, sse):
            idx, vals = torch.empty(4099, dtype=torch.int64), torch.empty(4099)
            c = int(getattr(lib, name)(a.data_ptr(), 4099, 0.5, idx.data_ptr(), vals.data_ptr(), 4099))
            outs.append((idx[:c].clone(), bits(vals[:c].clone())))
        assert all(torch.equal(x, y) for x, y in zip(*outs)), name
    x = torch.randn(1000, generator=g)
    rnd, safe = torch.rand(1000, generator=g), torch.rand(10, generator=g) + 0.5
    codes = [torch.empty(1000, dtype=torch.uint8) for _ in range(2)]
    for lib, out in zip((portable, sse), codes):
        assert lib.ac_qsgd_codes(x.data_ptr(), 1000, rnd.data_ptr(), safe.data_ptr(), 0, 100, ctypes.c_float(7.0),
                                 out.data_ptr()) == 0
    assert torch.equal(codes[0], codes[1])


def _ascending(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randperm(n, generator=g)[:k].sort().values


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 100, 4097, 20000, (1 << 18) + 37])
def test_sparse_mean_is_bitwise_zero_fill_index_add_and_div(world: int, n: int, avx2_switch: str) -> None:
    """The one-pass sparse mean equals zeros + ``index_add_`` of the ranks' payloads concatenated in
    rank order + ``div_``: overlapping positions, -0.0, inf, NaN, subnormals, a divisor that is not
    a power of two, empty payloads, and an output that is not 16-byte aligned; outputs from 2^18
    elements are streamed (AVX2, aligned), with blocks that no payload touches."""
    g = torch.Generator().manual_seed(world * 7 + n)
    idx = [_ascending(n, 0 if r == 1 else max(1, n // (3 + r) if n < 1 << 18 else n // 3000), g)
           for r in range(world)]
    vals = [torch.randn(i.numel(), generator=g) for i in idx]
    for v in vals:
        v[: min(3, v.numel())] = torch.tensor([-0.0, float("inf"), float("nan"), 1e-45, -1e-45][: min(3, v.numel())])
    want = torch.zeros(n).index_add_(0, torch.cat(idx), torch.cat(vals)).div_(world)
    for shift in (0, 1):  # shift 1: out starts 4 bytes into its storage
        out = torch.full((n + shift,), 7.0)[shift:]
        assert _native.sparse_mean(out, idx, vals, world)
        assert torch.equal(bits(out), bits(want))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [100, 4097, 70001, (1 << 18) + 37])
def test_sparse_mean_added_to_the_residual_unwritten(world: int, n: int, avx2_switch: str) -> None:
    """alltoall's second stage in one pass (``sparse_mean_add_select``): the sum written is
    ``sparse_mean`` then ``torch.add`` with the residual, and the candidates are ``add_select``'s of
    it; the sample (``sparse_sample_lines``) is ``sample_lines`` of that sum. Overlapping positions,
    -0.0 in payloads and residual, NaN, a divisor that is not a power of two, an empty payload,
    outputs not 32-byte aligned (not streamed), a capacity guess too short (the pass runs again)."""
    from adacomp.compressors.sparse import SAMPLE_LINE, SAMPLE_SIZE, sample_lines, sample_size
    g = torch.Generator().manual_seed(world * 11 + n)
    idx = [_ascending(n, 0 if r == 1 else max(1, n // 40), g) for r in range(world)]
    vals = [torch.randn(i.numel(), generator=g) for i in idx]
    vals[0][:3] = torch.tensor([-0.0, float("nan"), 1e-45])[: vals[0].numel()]
    r = torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.05)
    r[:5] = -0.0
    mean = torch.empty(n)
    assert _native.sparse_mean(mean, idx, vals, world)
    want = torch.add(mean, r)
    for thr, expected in ((1.0, 0.05), (0.0, 1e-6)):
        want_idx, want_vals = _native.add_select(mean, r, torch.empty(n), thr, expected)
        for shift in (0, 1):
            out = torch.full((n + shift,), 7.0)[shift:]
            got = _native.sparse_mean_add_select(r, out, idx, vals, world, thr, expected)
            assert got is not None and torch.equal(bits(out), bits(want))
            assert torch.equal(got[0], want_idx) and torch.equal(bits(got[1]), bits(want_vals))
    if n > SAMPLE_SIZE:
        lines, m = n // SAMPLE_LINE, SAMPLE_SIZE // SAMPLE_LINE
        got_sample = _native.sparse_sample_lines(r, idx, vals, world, lines, m)
        assert got_sample is not None and torch.equal(bits(got_sample), bits(sample_lines(mean, SAMPLE_SIZE, plus=r)))
        # by default a sample reads at most 1/32 of a tensor's lines (at least 256, at most 1024)
        assert sample_lines(mean, plus=r).numel() == sample_size(n) == min(SAMPLE_SIZE, max(4096, n // 512 * 16))
    spoiled = [i.clone() for i in idx]
    if spoiled[0].numel() > 1:  # positions that do not ascend: refused, nothing written
        spoiled[0][1] = spoiled[0][0]
        out = torch.full((n,), 7.0)
        assert _native.sparse_mean_add_select(r, out, spoiled, vals, world, 1.0) is None
        assert bool((out == 7.0).all())
        assert _native.sparse_sample_lines(r, spoiled, vals, world, max(2, n // 16), 4) is None


@pytest.mark.parametrize("bad", ["descending", "duplicate", "negative", "past_end", "int32", "float64"])
def test_sparse_mean_refuses_what_its_torch_path_must_answer(bad: str) -> None:
    g = torch.Generator().manual_seed(1)
    idx = [_ascending(1000, 50, g), _ascending(1000, 50, g)]
    vals = [torch.randn(50, generator=g), torch.randn(50, generator=g)]
    if bad == "descending":
        idx[1] = idx[1].flip(0)
    elif bad == "duplicate":
        idx[1][10] = idx[1][9]
    elif bad == "negative":
        idx[0][0] = -1
    elif bad == "past_end":
        idx[1][-1] = 1000
    elif bad == "int32":
        idx[0] = idx[0].to(torch.int32)
    else:
        vals[0] = vals[0].double()
    out = torch.full((1000,), 7.0)
    assert not _native.sparse_mean(out, idx, vals, 2)
    if bad in ("descending", "duplicate", "negative", "past_end"):
        assert bool((out == 7.0).all())  # refused before anything was written


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("m,k", [(1, 1), (50, 7), (5000, 4000), (70000, 600), (8388, 84), (1030, 1), (203, 16)])
def test_pick_largest_equals_largest_k_and_gather(m: int, k: int, tied: bool, avx2_switch: str) -> None:
    """The C pick of k candidates equals ``largest_k`` (ties at the k-th magnitude to the lowest
    positions) and the signed values gathered from the tensor, with the AVX2 loops and without; a
    NaN anywhere (first, k-th, last) is left to torch. ``tied``: many ties, so one is cut at the k-th
    (the scalar writing); else distinct magnitudes (the AVX2 writing, 8 candidates a step, then the
    scalar rule for the last slots)."""
    from adacomp.compressors.sparse import largest_k
    g = torch.Generator().manual_seed(m + k)
    flat = torch.randn(3 * m, generator=g)
    if tied:
        flat = flat.round(decimals=1)
    flat[::5] = -flat[::5]
    idx = _ascending(3 * m, m, g)
    mags = flat[idx].abs()
    got = _native.pick_largest(mags, idx, k, flat)
    assert got is not None
    kept = largest_k(idx, mags, k)
    assert torch.equal(got[0], kept) and torch.equal(bits(got[1]), bits(flat.index_select(0, kept)))
    signed = _native.pick_largest(flat[idx], idx, k, None)  # signed candidates: their own values
    assert signed is not None and torch.equal(signed[0], kept) and torch.equal(bits(signed[1]), bits(got[1]))
    whole = _native.pick_largest(flat, None, k, None)  # every position a candidate
    everything = largest_k(torch.arange(flat.numel()), flat.abs(), k)
    assert whole is not None and torch.equal(whole[0], everything)
    assert torch.equal(bits(whole[1]), bits(flat.index_select(0, everything)))
    mags[0] = float("nan")
    assert _native.pick_largest(mags, idx, k, flat) is None
    for at in (0, k, flat.numel() - 1):
        spoiled = flat.clone()
        spoiled[at] = -float("nan")
        assert _native.pick_largest(spoiled, None, k, None) is None
    zeros = torch.zeros(3 * m)  # every magnitude ties (+0 and -0): the lowest k positions
    zeros[1::2] = -0.0
    tied = _native.pick_largest(zeros, None, k, None)
    assert tied is not None and torch.equal(tied[0], torch.arange(k)) and torch.equal(bits(tied[1]), bits(zeros[:k]))


@pytest.mark.parametrize("kind", ["gauss", "ties", "heavy", "mostly_zeros", "all_tied", "nan_off_sample"])
@pytest.mark.parametrize("m,k", [(4096, 41), (32768, 328), (65535, 8191), (100000, 3)])
def test_a_whole_tensor_pick_through_a_sampled_floor_is_the_full_select(kind: str, m: int, k: int, avx2_switch: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole tensor with few kept (k <= m / 8) is picked from what passes a floor sampled at ~3x
    the kept share: the same positions, tie order and values as the radix select over every
    element (ac_pick_largest), and as largest_k. Where the floor keeps too many (all tied, mostly
    zeros) it declines and the full select answers; a NaN the sample missed still goes to torch."""
    from adacomp.compressors.sparse import largest_k
    g = torch.Generator().manual_seed(m + k + len(kind))
    x = torch.randn(m, generator=g)
    if kind == "ties":
        x = x.round(decimals=1)
    elif kind == "heavy":
        x = torch.distributions.StudentT(torch.tensor(1.2)).sample((m,)) * (torch.rand(m, generator=g) + 0.5)
    elif kind == "mostly_zeros":
        x = torch.where(torch.rand(m, generator=g) < 0.97, torch.zeros(m), x)
    elif kind == "all_tied":
        x = torch.full((m,), 0.5) * torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0)
    elif kind == "nan_off_sample":
        x[1] = float("nan")  # the sample reads positions j * m / 512: 0 and m / 512, not 1
    lib = _native.library()
    assert lib is not None
    took: list[int] = []
    orig = _native._pick_filtered
    monkeypatch.setattr(_native, "_pick_filtered", lambda *a: (took.append(orig(*a)), took[-1])[1])
    got = _native.pick_largest(x, None, k, None)
    keys = torch.empty(m, dtype=torch.int32)
    oi, ov = torch.empty(k, dtype=torch.int64), torch.empty(k)
    full = lib.ac_pick_largest(x.data_ptr(), None, m, k, None, keys.data_ptr(), oi.data_ptr(), ov.data_ptr())
    if kind == "nan_off_sample":
        assert got is None and full != 0 and took == [-1]
        return
    assert got is not None and full == 0
    assert torch.equal(got[0], oi) and torch.equal(bits(got[1]), bits(ov))
    assert torch.equal(got[0], largest_k(torch.arange(m), x.abs(), k)) and torch.equal(bits(got[1]), bits(x[got[0]]))
    if kind == "all_tied":  # the floor passes everything: declined
        assert took == [0]
    elif kind != "mostly_zeros":  # (there the floor is +0 or a value, by the sample)
        assert took == [1]


@pytest.mark.parametrize("keys", ["narrow", "span_4095", "span_4096", "span_4097", "zero_to_inf", "equal",
                                  "two_values", "subnormal", "mostly_zeros", "cluster"])
def test_radix_select_over_the_keys_own_range(keys: str, avx2_switch: str) -> None:
    """The r-th largest by a first digit over the keys' own range (their minimum subtracted, at most
    4096 bins) equals torch's, wherever that range ends: a prefilter's candidates just above their
    floor, spans at and around 4096 patterns, 0 to inf, all equal, two values, subnormals; and where
    the keys left after a digit are all one value (mostly zeros; a cluster of one pattern)."""
    from adacomp.compressors.sparse import largest_k
    g = torch.Generator().manual_seed(len(keys))
    base = torch.tensor(4.5).view(torch.int32)
    if keys == "narrow":
        a = 4.5 + torch.rand(20000, generator=g) * 0.7
    elif keys.startswith("span_"):
        a = (base + torch.randint(0, int(keys[5:]) + 1, (9000,), generator=g, dtype=torch.int32)).view(torch.float32)
        a[:2] = torch.stack([base, base + int(keys[5:])]).view(torch.float32)  # both ends of the span
    elif keys == "zero_to_inf":
        a = torch.randn(5000, generator=g).abs()
        a[:2] = torch.tensor([0.0, float("inf")])
    elif keys == "equal":
        a = torch.full((3000,), 2.0)
    elif keys == "two_values":
        a = torch.where(torch.rand(3000, generator=g) < 0.3, 1.0, 3.0)
    elif keys == "mostly_zeros":  # alltoall's second stage samples ~99 % exact zeros: one value left early
        a = torch.zeros(16384)
        a[torch.randperm(16384, generator=g)[:160]] = torch.rand(160, generator=g) + 0.5
    elif keys == "cluster":  # one first-level bin holding two neighbouring patterns, one of them 3000 times
        a = torch.full((3006,), 1.0)
        a[:5] = (torch.tensor(1.0).view(torch.int32) + 1024).view(torch.float32)  # a later digit splits them
        a[5] = 1e30
    else:
        a = torch.randint(1, 100, (3000,), generator=g, dtype=torch.int32).view(torch.float32)
    for r in (1, 2, 47, 49, a.numel() // 3, a.numel() - 1, a.numel()):
        assert _native.rth_largest_strided(a, 1, r) == float(torch.topk(a, r).values.min())
    k = a.numel() * 3 // 4
    got = _native.pick_largest(a, None, k, None)
    assert got is not None
    want = largest_k(torch.arange(a.numel()), a, k)
    assert torch.equal(got[0], want) and torch.equal(bits(got[1]), bits(a[want]))


@pytest.mark.parametrize("m", [0, 1, 64, 65, 300])  # around the write prefetch's distance (ZERO_AHEAD)
def test_zero_at_equals_index_fill(m: int) -> None:
    g = torch.Generator().manual_seed(3)
    out = torch.randn(5000, generator=g)
    for idx in (_ascending(5000, m, g), torch.randperm(5000, generator=g)[:m]):  # any order
        want = out.clone().index_fill_(0, idx, 0)
        assert _native.zero_at(out, idx) and torch.equal(bits(out), bits(want))
    before = out.clone()
    for bad in (torch.tensor([3, 5000]), torch.tensor([3, -1]), torch.cat([torch.arange(200), torch.tensor([5000])])):
        assert not _native.zero_at(out, bad)
        assert torch.equal(bits(out), bits(before))  # nothing written


@pytest.mark.parametrize("m", [0, 1, 64, 65, 300])  # around the write prefetch's distance (ZERO_AHEAD)
@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "into another"])
def test_sub_at_equals_the_subtraction_at_the_positions(m: int, in_place: bool) -> None:
    """Chunk-Top-k's residual: ``out[idx] = t[idx] - vals`` elsewhere ``out`` as it was (``t`` itself
    in place), bitwise torch's; a bad position anywhere writes nothing."""
    g = torch.Generator().manual_seed(5)
    t = torch.randn(5000, generator=g)
    t[:3] = torch.tensor([-0.0, float("nan"), float("inf")])
    idx = torch.randperm(5000, generator=g)[:m]
    vals = torch.randn(m, generator=g)
    out = t.clone() if in_place else torch.randn(5000, generator=g)
    want = out.clone()
    want[idx] = t[idx] - vals
    assert _native.sub_at(out, out if in_place else t, idx, vals) and torch.equal(bits(out), bits(want))
    before = out.clone()
    for bad in (torch.tensor([3, 5000]), torch.tensor([3, -1]), torch.cat([torch.arange(200), torch.tensor([5000])])):
        assert not _native.sub_at(out, t, bad, torch.ones(bad.numel()))
        assert torch.equal(bits(out), bits(before))  # nothing written


@pytest.mark.parametrize("m", [0, 1, 255, 256, 257, 40_000])
def test_take_equals_index_select(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefetched C gather: index_select's bits (NaN, -0.0 and infinities among them) for
    ascending and shuffled positions; torch's gather (and its IndexError) where C does not run."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(100_000, generator=g)
    x[::997] = float("nan")
    x[5::991] = -0.0
    x[7::983] = float("-inf")
    calls = []
    lib = _native.library()
    assert lib is not None
    monkeypatch.setattr(_native, "_lib", _Counting(lib, "ac_take", calls))
    for idx in (_ascending(100_000, m, g), torch.randint(0, 100_000, (m,), generator=g)):
        got = _native.take(x.view(400, 250), idx)
        assert torch.equal(bits(got), bits(x.index_select(0, idx)))
    assert len(calls) == 2  # both from the C gather
    with pytest.raises(IndexError):
        _native.take(x, torch.tensor([0, 100_000] + [1] * m))
    assert len(calls) == 3  # C refused the position, torch raised
    half = x.half()
    assert torch.equal(_native.take(half, idx).view(torch.int16), half.index_select(0, idx).view(torch.int16))  # torch
    assert len(calls) == 3


@pytest.mark.parametrize("n", [0, 5, 64, 65, 20_000])
@pytest.mark.parametrize("strict", [False, True])
def test_pick_pairs_equals_select_and_two_gathers(n: int, strict: bool, avx2_switch: str) -> None:
    """A threshold search's last step on its kept candidates in one C pass: the positions and signed
    values whose |value| passes (> or >=) are those of the abs select of the values and the two
    gathers by it, bit for bit (NaN passing neither, -0.0, infinities, ties at the threshold), at
    every first guess of the output's size."""
    g = torch.Generator().manual_seed(n + strict)
    vals = torch.randn(n, generator=g)
    vals[::13] = 1.0
    vals[1::17] = -1.0
    vals[2::19] = float("nan")
    vals[3::23] = -0.0
    vals[4::29] = float("-inf")
    idx = torch.sort(torch.randperm(10 * n + 1, generator=g)[:n]).values
    at = _native.select(vals, 1.0, "abs_gt" if strict else "abs_ge")[0]
    for expected in (0.0, 0.1, 1.0):
        got = _native.pick_pairs(vals, idx, 1.0, strict, expected)
        assert got is not None
        assert torch.equal(got[0], idx.index_select(0, at)) and torch.equal(bits(got[1]), bits(vals.index_select(0, at)))
        # the same candidates with int32 positions (SIDCo's first stage keeps them so): int64 out, the same pairs
        got32 = _native.pick_pairs32(vals, idx.int(), 1.0, strict, expected)
        assert got32[0].dtype == torch.int64 and torch.equal(got32[0], got[0]) and torch.equal(bits(got32[1]), bits(got[1]))
    assert _native.pick_pairs(vals.double(), idx, 1.0, strict) is None  # torch answers


class _Counting:
    """A library whose ``name`` calls are counted (the others pass through)."""

    def __init__(self, lib, name: str, calls: list) -> None:
        self._lib, self._name, self._calls = lib, name, calls

    def __getattr__(self, attr: str):
        f = getattr(self._lib, attr)
        if attr != self._name:
            return f

        def counted(*args):
            self._calls.append(args)
            return f(*args)
        return counted


@pytest.mark.parametrize("n", [1, 7, 17, 1 << 18, (1 << 18) + 3])
def test_bf16_casts_equal_torch(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16's payload and its decompressed mean are bitwise torch's ``.to`` both ways (round to
    nearest even at both parities, NaN, infinities, subnormals, a tensor past the recycling size)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 1e3
    pats = torch.tensor([0x7FC00000, 0xFFC12345, 0x7F800000, 0x00000001, 0x3F808000, 0x3F818000, 0x807FFFFF],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    x[: min(n, 7)] = pats[: min(n, 7)]
    x[-1] = pats[1]
    comp = compressors.get("bf16")
    payload, ctx = comp.compress(x.clone(), "x")
    assert torch.equal(payload[0].view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(bits(comp.decompress(payload, ctx)), bits(x.to(torch.bfloat16).to(torch.float32)))
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    slow = compressors.get("bf16").compress(x.clone(), "x")[0]
    assert torch.equal(slow[0].view(torch.int16), payload[0].view(torch.int16))


@pytest.mark.skipif(_native.library() is None, reason="no C compiler: the torch path is the only path")
@pytest.mark.parametrize("n", [15, 16, 17, 1 << 16, (1 << 16) + 9])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_bf16_cast_loops_equal_torch_and_the_baseline(n: int, offset: int) -> None:
    """The AVX2 casts (16 / 8 values a step, streamed from 2^16 elements into 32-byte aligned
    outputs) give torch's ``.to`` bits both ways, as the baseline loops do (``ac_avx2_off``): random
    bit patterns (every NaN to 0xffff, ties, subnormals), outputs aligned or not, tails."""
    import ctypes
    switch = ctypes.c_int.in_dll(_native.library(), "ac_avx2_off")
    g = torch.Generator().manual_seed(n + offset)
    x = torch.randint(-(1 << 31), 1 << 31, (n + offset,), generator=g, dtype=torch.int64).to(torch.int32)
    x = x.view(torch.float32)[offset:]
    want = x.to(torch.bfloat16)
    try:
        for off in (0, 1):
            switch.value = off
            h = torch.full((n + offset,), 7.0, dtype=torch.bfloat16)[offset:]
            assert _native.to_bf16(x, h) and torch.equal(h.view(torch.int16), want.view(torch.int16)), off
            f = torch.full((n + offset,), 7.0)[offset:]
            assert _native.from_bf16(want, f) and torch.equal(bits(f), bits(want.to(torch.float32))), off
    finally:
        switch.value = 0


@pytest.mark.parametrize("n", [5, 1 << 14, (1 << 15) + 3])
def test_efsignsgd_residual_equals_decompress_and_subtract(n: int) -> None:
    """EF-SignSGD's one-pass residual equals ``tensor - decompress(payload)`` bitwise, in place or
    not, with NaN, infinities and signed zeros in the tensor."""
    comp = compressors.get("efsignsgd")
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g)
    t[:4] = torch.tensor([-0.0, 0.0, float("inf"), 3.0])[: min(n, 4)]
    payload, ctx = comp.compress(t, "w")
    t[-1] = float("nan")  # after compress: the scale stays finite, the residual carries the NaN
    want = torch.sub(t, comp.decompress(payload, ctx))
    got = comp.residual(t, payload, ctx, torch.empty(n))
    assert torch.equal(bits(got), bits(want))
    same = t.clone()
    assert torch.equal(bits(comp.residual(same, payload, ctx, same)), bits(want))


def test_the_switch_takes_effect_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ADACOMP_NATIVE=0`` set (or removed) while running turns the C passes off (or on) at the next call."""
    assert _native.library() is not None
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    assert _native.library() is None and not _native.usable(torch.ones(3)) and _native.why_unavailable() == "ADACOMP_NATIVE=0"
    monkeypatch.setenv("ADACOMP_NATIVE", "1")
    assert _native.library() is not None
    monkeypatch.delenv("ADACOMP_NATIVE")
    assert _native.usable(torch.ones(3))


def test_sample_lines_spread_over_a_matrix_s_columns() -> None:
    """The sample's lines, one per equal span at a Weyl-sequence fraction of it, ascend and meet many
    columns of a row-major matrix whose row length divides the span's (GPT-2's 768 x 3072 weight, VGG-16's
    4096 x 25088 fc6): each span's first line met 4 and 1 of their columns."""
    from adacomp.compressors.sparse import SAMPLE_LINE, SAMPLE_SIZE, sample_starts
    m = SAMPLE_SIZE // SAMPLE_LINE
    for rows, cols in ((768, 3072), (4096, 25088), (512, 4608)):
        lines = rows * cols // SAMPLE_LINE
        starts = sample_starts(lines, m)
        lo = torch.arange(m) * lines // m
        assert bool((starts[1:] > starts[:-1]).all()) and bool((starts >= lo).all())
        assert bool((starts < torch.arange(1, m + 1) * lines // m).all())  # within its own span
        assert len(set((lo * SAMPLE_LINE % cols).tolist())) <= 4  # what evenly spaced lines met
        assert len(set((starts * SAMPLE_LINE % cols).tolist())) > m // 8
        assert len(set((starts * SAMPLE_LINE // cols).tolist())) > min(rows, m) // 2  # and still many rows

@pytest.mark.parametrize("n", [5000, 16384, 16385, 100000, (1 << 20) + 7])
def test_sample_lines_equal_torch(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C sample (and the sample of a sum, error feedback's g + r before it is written) reads
    the same lines as the torch path and adds them alike."""
    from adacomp.compressors.sparse import sample_lines
    g = torch.Generator().manual_seed(n)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    fast = [sample_lines(a), sample_lines(a, plus=b)]
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    slow = [sample_lines(a), sample_lines(a) + sample_lines(b)]
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(fast, slow))


@pytest.mark.skipif(_native.library() is None, reason="no C compiler: the torch path is the only path")
def test_avx2_loops_equal_the_baseline_loops() -> None:
    """The hand-written AVX2 loops (QSGD's rounding, the 1- and 4-bit code-table means, EF-SignSGD's
    residual) give the baseline loops' bits: both run here (``ac_avx2_off``), on -0.0, NaN,
    denormals and lengths that leave a tail; where the CPU has no AVX2 both are the baseline."""
    import ctypes
    switch = ctypes.c_int.in_dll(_native.library(), "ac_avx2_off")
    g = torch.Generator().manual_seed(3)
    n = 40_009
    x = torch.randn(n, generator=g)
    x[0], x[1], x[2], x[3] = -0.0, 0.0, 1e-42, float("nan")
    rnd, safe = torch.rand(n, generator=g), torch.rand(n // 512 + 1, generator=g) + 0.5
    codes = [torch.randint(0, 256, (n // 2 + 1,), dtype=torch.uint8, generator=g) for _ in range(3)]
    tables4 = [torch.randn((n // 512 + 1) << 4, generator=g) for _ in range(3)]
    tables1 = [torch.tensor([-0.5, 0.75]) * (r + 1) for r in range(3)]
    runs = []
    try:
        for off in (0, 1):
            switch.value = off
            got = [torch.full((n,), 255, dtype=torch.uint8) for _ in range(2)]
            ok = [_native.qsgd_codes(x[4:], rnd[4:], safe, 0, 512, 7, got[0][4:]),
                  _native.qsgd_codes(x, rnd, safe, 0, 512, 7, got[1])]
            outs = [torch.full((n,), 7.0) for _ in range(5)]
            ok += [_native.table_mean(codes[:w], tables4[:w], 4, 512, n, outs[w - 2]) for w in (2, 3)]
            ok += [_native.table_mean(codes[:w], tables1[:w], 1, n, n, outs[w]) for w in (2, 3)]
            ok += [_native.sign_residual(x, codes[0], 0.25, outs[4])]
            runs.append((ok, got, [bits(o) for o in outs]))
    finally:
        switch.value = 0
    (ok_a, got_a, outs_a), (ok_b, got_b, outs_b) = runs
    assert ok_a == ok_b == [True, False, True, True, True, True, True]  # the NaN hands its block back
    assert torch.equal(got_a[0], got_b[0]) and all(torch.equal(a, b) for a, b in zip(outs_a, outs_b))


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 129, 1000, 70_001])
def test_abs_stats_equal_torch(n: int, avx2_switch: str) -> None:
    """One pass gives torch.abs's bits with torch's max, min and argmax of them (the first position
    of a repeated maximum, -0.0 and all-zero tensors included); a NaN hands the answer to torch."""
    g = torch.Generator().manual_seed(n)
    for case in range(4):
        x = torch.randn(n, generator=g)
        if case == 1 and n > 3:  # the maximum twice, negative: the first position counts
            x[n // 2] = -x.abs().max() - 1
            x[n - 1] = x[n // 2]
        if case == 2:
            x.zero_()
            x[0] = -0.0
        if case == 3 and n > 2:
            x[n - 2] = 100.0
        out = torch.full_like(x, 7.0)
        got = _native.abs_stats(x, out)
        a = x.abs()
        assert got is not None and torch.equal(bits(out), bits(a))
        assert (got.max, got.min, got.argmax) == (float(a.max()), float(a.min()), int(a.argmax())), case
        assert _native.abs_stats(x, None) == got  # the statistics alone, |x| not written: the same
    x = torch.randn(max(n, 2), generator=g)
    x[max(n, 2) // 2] = float("nan")
    assert _native.abs_stats(x, torch.empty_like(x)) is None and _native.abs_stats(x, None) is None


def test_magnitudes_fall_back_to_torch_on_nan_and_other_dtypes() -> None:
    from adacomp.compressors.sparse import Magnitudes
    from adacomp.compressors.workspace import Workspace
    for x in [torch.tensor([1.0, -3.0, float("nan"), 3.0]), torch.tensor([1.0, -3.0, 0.5, -3.0], dtype=torch.float64)]:
        m = Magnitudes(x, Workspace())
        a = x.abs().float()
        assert torch.equal(m.a, a) or (torch.isnan(m.a) == torch.isnan(a)).all()
        assert str(m.max()) == str(float(a.max())) and str(m.min()) == str(float(a.min()))
        assert torch.equal(m.argmax(), a.argmax().view(1))


@pytest.mark.parametrize("n", [2, 63, 65, 70_001, 1 << 20])
def test_std_select_equals_torch_std_and_select(n: int, avx2_switch: str) -> None:
    """Gaussian-k's fused read: torch.std's bits (its one-thread sum) and select's abs_gt candidates
    with their signed values; with more threads torch sums in parts, so the fused read declines."""
    g = torch.Generator().manual_seed(n)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for case in range(3):
            x = torch.randn(n, generator=g) * 0.01 + 0.002
            if case == 1:
                x[n // 2], x[0] = float("nan"), -0.0
            if case == 2:
                x[n - 1] = float("-inf")
            mean = float(x.mean())
            got = _native.std_select(x, mean, 0.015, expected=0.001)
            assert got is not None
            std, idx, vals = got
            assert str(std) == str(float(x.std())), case  # NaN compares by its text
            ref = x.abs() > 0.015
            assert torch.equal(idx, torch.nonzero(ref).view(-1)) and torch.equal(bits(vals), bits(x[ref]))
        torch.set_num_threads(2)
        assert _native.std_select(torch.randn(n, generator=g), 0.0, 1.0) is None
    finally:
        torch.set_num_threads(threads)


def test_std_from_lane_sums_is_torchs_or_undecided(one_thread: None) -> None:
    """Gaussian-k's std from the 16-lane sum: torch's float32 on many tensors (large ones included,
    where the two sums differ in their last bits), and undecided for a sum whose std sits on a float32
    rounding boundary (the in-order sum then decides)."""
    g = torch.Generator().manual_seed(7)
    for n in (2, 64, 1000, 70_001, 1 << 20, 3_000_001):
        for _ in range(3 if n > 100_000 else 20):
            x = torch.randn(n, generator=g) * float(torch.rand(1, generator=g)) + 0.01
            mean = float(x.mean())
            got = _native.std_select(x, mean, 1e30)
            assert got is not None and str(got[0]) == str(float(x.std()))
    n = 1001
    lo = torch.tensor(0.1, dtype=torch.float32)
    hi = torch.nextafter(lo, torch.tensor(1.0))
    mid = (float(lo) + float(hi)) / 2  # std exactly between two float32 values
    assert _native.std_if_decided(mid * mid * (n - 1), n) is None
    assert _native.std_if_decided(float(lo) ** 2 * (n - 1), n) == float(lo)
    assert _native.std_if_decided(float("nan"), n) is None and _native.std_if_decided(float("inf"), n) is None


def test_a_passing_native_switch_does_not_stick_to_the_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The once-per-process probes (QSGD's norm lanes and generator, the bf16 rounding) answer "no" under
    ``ADACOMP_NATIVE=0`` without remembering it: once the switch is gone, the C paths are back (a test or
    a caller that set it for a while left QSGD on torch's norms for the rest of the process)."""
    if _native.library() is None:
        pytest.skip(f"no C compiler: {_native._error}")
    for cache in ("_lanes", "_rng_agrees", "_bf16_agrees", "_randint_agrees"):
        monkeypatch.setattr(_native, cache, None)
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    assert _native.norm_lanes() == 0 and not _native._rng_checked() and not _native._bf16_checked()
    assert not _native._randint_checked()
    monkeypatch.delenv("ADACOMP_NATIVE")
    assert _native.norm_lanes() in (8, 16) and _native._rng_checked() and _native._bf16_checked()
    assert _native._randint_checked()


def test_mean_from_sum_is_torchs_division() -> None:
    """torch's mean from a float32 sum (``div_`` by the element count) in Python floats: the same bits
    over many magnitudes (subnormal quotients and overflowing ones), counts above 2^24 that float32
    rounds, signed zeros, infinities and NaN; and the float32 rounding helper's edges."""
    g = torch.Generator().manual_seed(3)
    totals = (torch.randn(400, generator=g) * torch.pow(2.0, torch.randint(-140, 127, (400,), generator=g).float()))
    totals = [_native.f32(float(t)) for t in totals] + [0.0, -0.0, math.inf, -math.inf, math.nan, 3.4028234663852886e38]
    for n in (1, 2, 3, 1000, 65_537, 2_359_296, (1 << 24) + 1, 38_597_377, 123_456_789, 1 << 31):
        for t in totals:
            want = torch.tensor([t], dtype=torch.float32).div_(n)
            got = torch.tensor([_native.mean_from_sum(t, n)], dtype=torch.float32)
            assert torch.equal(bits(got), bits(want)) or (math.isnan(t) and bool(torch.isnan(got))), (t, n)
    assert _native.f32(3.4028235677973366e38) == math.inf and _native.f32(-1e39) == -math.inf
    assert _native.f32(3.4028235e38) == float(torch.tensor(3.4028235e38, dtype=torch.float32))
    assert _native.f32(1e-46) == 0.0 and _native.f32(0.1) == float(torch.tensor(0.1, dtype=torch.float32))


def test_compensation_with_moments_is_torchs_add_sum_std_and_selection(one_thread: None, avx2_switch: str) -> None:
    """Gaussian-k's one-pass compensation (:func:`_native.add_moments_select`): the sum is torch.add's,
    the total torch.sum's, the candidates ``nonzero(|sum| > t)`` with the signed sums (also after a
    short first guess of their number), and the std that :func:`_native.std_from_moments` derives is
    torch.std's or undecided: never another float32. Decided on centred data; undecided where the
    mean dwarfs the spread (the bound then straddles roundings), on a std midway between two float32
    values, and on non-finite sums."""
    g = torch.Generator().manual_seed(11)
    decided = cases = 0
    for n in (64, 1000, 65_537, (1 << 20) + 7, 3_000_001):
        for shift, scale in ((0.0, 1.0), (0.01, 1e-3), (3.0, 0.5), (1e3, 1e-3)):
            x, r = torch.randn(n, generator=g) * scale + shift, torch.randn(n, generator=g) * scale * 0.1
            out = torch.empty(n)
            t = float((x + r).abs().quantile(0.97)) if n <= 1 << 16 else 2.0 * scale + abs(shift)
            got = _native.add_moments_select(x, r, out, t, expected=1e-6 if n == 1000 else 0.03)
            assert got is not None
            want = x + r
            assert torch.equal(bits(out), bits(want)) and str(got.total) == str(float(want.sum()))
            sel = want.abs() > t
            assert torch.equal(got.idx, torch.nonzero(sel).view(-1)) and torch.equal(bits(got.vals), bits(want[sel]))
            mean = _native.mean_from_sum(got.total, n)
            assert mean == float(want.mean())
            std = _native.std_from_moments(got.squares, got.plain, mean, n)
            if std is not None:
                assert str(std) == str(float(want.std())), (n, shift, scale)
            cases += 1
            decided += std is not None
            if shift == 0.0:
                assert std is not None, n
            if shift == 1e3:
                assert std is None, n
            assert _native.std_in_order(want, mean) == float(want.std())
    assert decided >= cases // 2
    n = 1001
    lo = torch.tensor(0.1, dtype=torch.float32)
    mid = (float(lo) + float(torch.nextafter(lo, torch.tensor(1.0)))) / 2
    assert _native.std_from_moments(mid * mid * (n - 1), 0.0, 0.0, n) is None
    assert _native.std_from_moments(float(lo) ** 2 * (n - 1), 0.0, 0.0, n) == float(lo)
    assert _native.std_from_moments(float("nan"), 0.0, 0.0, n) is None
    assert _native.std_from_moments(1.0, float("inf"), 0.0, n) is None
    same = torch.randn(100)
    assert _native.add_moments_select(same, torch.randn(100), same, 1.0) is None  # aliasing: the caller adds


@pytest.mark.parametrize("choice", ["one_call", "chain"])
@pytest.mark.parametrize("way", ["one_read", "miss", "alternating"])
@pytest.mark.parametrize("stages", [2, 3, 5])
def test_sidco_later_stages_give_the_torch_paths_payloads(stages: int, way: str, choice: str,
                                                          monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    """SIDCo-E's later stages each take their count and shifted mean from one C read of the set that
    covers their threshold (the tensor, then what the last stage kept) and keep only what passes where
    the next threshold lay last step; the payload is picked from the last kept set with its positions
    widened: the payloads and residuals under error feedback equal the torch path's bit for bit
    (normal, heavy-tailed, tied and constant steps; the stage count fixed, so every step runs every
    stage). ``miss``: the hints put every floor above the next threshold, whose stage then reads the
    tensor again (the same answers); ``alternating``: every other step keeps the first stage's
    exceedances and reads them per stage (``one_read_stages`` off, as ``cell --toggle`` times it).
    ``one_call``: the stages and the pick in one C call (``_native.sidco_choose``); ``chain``: the
    calls it stands for (``sidco.NativeChoice`` off)."""
    from adacomp import memories
    from adacomp.compressors import sidco
    from adacomp.compressors.sidco import SIDCoCompressor
    monkeypatch.setattr(sidco.NativeChoice, "on", choice == "one_call")
    answered: list[_native.SIDCoChoice | None] = []
    one_call = _native.sidco_choose
    monkeypatch.setattr(_native, "sidco_choose", lambda *a: answered.append(one_call(*a)) or answered[-1])
    g = torch.Generator().manual_seed(40 + stages)
    n = (1 << 17) + 5
    grads = [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1.1, torch.randn(n, generator=g) ** 3,
             torch.randn(n, generator=g).round(), torch.full((n,), 0.5), torch.randn(n, generator=g) * 1e-3]
    fits: list[int] = []
    orig = _native.tail_sum_keep
    monkeypatch.setattr(_native, "tail_sum_keep", lambda *a, **k: fits.append(1) or orig(*a, **k))
    narrow: list[int] = []  # payloads picked from a kept set's int32 positions
    pick32 = _native.pick_pairs32
    monkeypatch.setattr(_native, "pick_pairs32", lambda *a: narrow.append(1) or pick32(*a))
    miss = way == "miss"
    if miss:
        hint = SIDCoCompressor._tail_hint
        monkeypatch.setattr(SIDCoCompressor, "_tail_hint", lambda self, *a: (lambda f: (f[0] + 1e6, *f[1:]))(hint(self, *a)))

    def run() -> list[torch.Tensor]:
        comp, mem = compressors.get("sidco", density=0.01, stages=stages, adaptive=False), memories.get("residual")
        out = []
        for i, x in enumerate(grads):
            comp.one_read_stages = way != "alternating" or i % 2 == 0
            t = mem.compensate(x.clone(), "w", 2, compressor=comp)
            payload, ctx = comp.compress(t, "w")
            out += [t.clone(), *[p.clone() for p in payload]]
            mem.update(t, "w", comp, payload, ctx)
        return out + [mem.residuals["w"].clone()]
    fast = run()
    one_read = len(grads) // 2 if way == "alternating" else len(grads)
    if choice == "chain":
        assert not answered
        assert len(fits) >= (stages - 1) * (one_read - 1) or _native.library() is None  # the one-read stages
        assert bool(narrow) != miss or _native.library() is None  # ran (the constant step may stop after one)
    else:
        got = [a for a in answered if a is not None]
        assert len(got) >= one_read - 1 or _native.library() is None  # (the constant step may stop after one)
        assert all(len(a.stages) == stages - 1 for a in got)
        if miss:  # every floor above the next threshold: nothing kept, each later stage and the pick read the tensor
            assert all(kept == 0 for a in got for _, _, kept in a.stages)
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    slow = run()
    assert all(torch.equal(bits(a) if a.is_floating_point() else a, bits(b) if b.is_floating_point() else b)
               for a, b in zip(fast, slow))


def _sidco_stages_by_torch(a: torch.Tensor, thr: float, lr: float, margins: list[float]) -> tuple[float, list]:
    """SIDCo-E's later stages written with torch alone: per stage the count of |a| > thr, torch's
    float32 mean of the shifted exceedances and the count above the floor thr + margin; thr moved by
    -mean * lr in double, as Python adds."""
    mags, stages = a.abs(), []
    for margin in margins:
        over = mags[mags > thr]
        mean = float((over - thr).mean())
        stages.append((mean, over.numel(), int((mags > thr + margin).sum())))
        thr = thr + -mean * lr
    return thr, stages


@pytest.mark.parametrize("case", ["plain", "levels", "candidates", "floors_miss", "short_room", "one_stage",
                                  "one_stage_candidates", "declines"])
def test_sidco_choose_is_torchs_stages_and_pick(case: str, avx2_switch: str, one_thread: None) -> None:
    """:func:`_native.sidco_choose`: SIDCo-E's later fits and its pick in one C call give torch's
    counts, float32 means (the cascade's levels guessed wrong: ``levels``, then read again), the
    final threshold to the bit in double, and the positions and signed values of |a| above it,
    whether a stage reads the tensor, error feedback's int64 candidates or the last stage's kept
    set, whether the floors keep what the next threshold passes or miss it (then it reads the
    tensor again), and when the first buffers are too small (a second call); it declines (None)
    where fewer than 8 pass a later threshold."""
    if _native.library() is None or not _native.sums_like_torch():
        pytest.skip("no C library (or torch sums on several threads): nothing to compare")
    g = torch.Generator().manual_seed(11)
    n = 200_003
    a = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(2)
    a[5] = -0.0
    later = 0 if case.startswith("one_stage") else 1 if case == "declines" else 2
    ratio = 0.01 ** (1 / 3)
    lr = math.log(ratio)
    m1 = float(a.abs().mean())
    thr0 = -m1 * lr
    margins = [0.5 * -m1 * lr * 0.8] * later if case != "floors_miss" else [1e6] * later
    if case == "declines":
        a = torch.zeros(n)
        a[:5] = 1.0
        m1 = float(a.abs().mean())
        thr0 = -m1 * lr
    expects = [1 << 40] * later if case == "levels" else [int(n * ratio ** (s + 1)) for s in range(later)]
    cands = None
    if case in ("candidates", "one_stage_candidates"):
        floor = 0.5 * thr0
        at = torch.nonzero(a.abs() > floor).view(-1)
        cands = (floor, at, a[at].clone())
    shares = [1e-6 if case == "short_room" else 1.25 * ratio ** (s + 1) for s in range(later)]
    got = _native.sidco_choose(a, cands, thr0, lr, margins, expects, shares, 1e-6 if case == "short_room" else 0.02)
    if case == "declines":
        assert got is None
        return
    assert got is not None
    want_thr, want_stages = _sidco_stages_by_torch(a, thr0, lr, margins)
    assert got.thr == want_thr and got.stages == want_stages
    at = torch.nonzero(a.abs() > want_thr).view(-1)
    assert torch.equal(got.idx, at) and torch.equal(bits(got.vals), bits(a[at]))
    # the passes over the tensor: the first stage's (none where the candidates cover it), the later
    # ones only where a floor missed, the pick's where nothing kept covers it
    reads = {"candidates": 0, "floors_miss": later + 1, "one_stage": 1, "one_stage_candidates": 0}.get(case, 1)
    assert got.reads == reads


@pytest.mark.parametrize("where", ["tensor", "int32", "int64"])
def test_tail_sum_keep_is_torchs_count_sum_and_selection(where: str, avx2_switch: str, one_thread: None) -> None:
    """:func:`_native.tail_sum_keep`: the count of |a| > t, torch's float32 sum of the shifted
    exceedances (their cascade, whose levels depend on the count: a wrong guess gives the same bits)
    and the positions and signed values above the floor, over the tensor or kept candidates with
    int32 / int64 positions; None where fewer than 8 pass or the floor lies below the threshold."""
    g = torch.Generator().manual_seed(3)
    for n in (40, 1000, 65_573, (1 << 20) + 3):
        x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3)
        x[0] = -0.0
        positions = None
        src = x
        if where != "tensor":
            keep = torch.nonzero(x.abs() > 0.01).reshape(-1)
            src = x[keep].contiguous()
            positions = keep.to(torch.int32) if where == "int32" else keep
        for t, f in ((0.01, 0.01), (0.1, 0.3), (0.0, 2.0), (0.2, 0.2000001)):
            mask = src.abs() > t
            count = int(mask.sum())
            for expect in (0, count, 1 << 26):  # the cascade's levels guessed from none, the count, too many
                got = _native.tail_sum_keep(src, t, f, positions, expect, 0.05)
                if count < 8 or not _native.sums_like_torch():
                    assert got is None
                    continue
                assert got is not None and got.passed == count
                assert str(got.total) == str(float((src.abs()[mask] - t).sum()))
                at = torch.nonzero(src.abs() > f).reshape(-1)
                want = at if positions is None else positions.long()[at]
                assert got.idx.dtype == torch.int32 and torch.equal(got.idx.long(), want)
                assert torch.equal(bits(got.vals), bits(src[at]))
    assert _native.tail_sum_keep(x, 0.5, 0.4) is None  # a floor below the threshold


@pytest.mark.parametrize("name", ["gaussiank", "redsync", "mstopk", "sidco"])
def test_fused_search_passes_give_the_torch_paths_payloads(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The magnitudes-with-stats pass (RedSync, MSTop-k, SIDCo) and the moments-with-candidates
    pass (Gaussian-k, one thread) leave every payload as the torch path's: normal, heavy-tailed and
    tied inputs, a tensor whose search selects nothing (the argmax fallback) and one with a NaN."""
    g = torch.Generator().manual_seed(5)
    n = (1 << 17) + 5
    inputs = [torch.randn(n, generator=g), torch.randn(n, generator=g) ** 3, torch.randn(n, generator=g).round(),
              torch.full((n,), 0.5), torch.randn(n, generator=g)]
    inputs[3][77] = -4.0
    inputs[4][123] = float("nan")
    threads = torch.get_num_threads()

    def payloads() -> list[list[torch.Tensor]]:
        comp = compressors.get(name, density=0.01)
        return [list(comp.compress(x.clone(), "w")[0]) for x in inputs]

    try:
        torch.set_num_threads(1)
        fast = payloads()
        monkeypatch.setenv("ADACOMP_NATIVE", "0")
        slow = payloads()
    finally:
        torch.set_num_threads(threads)
    for f, s in zip(fast, slow):
        assert len(f) == len(s) and all(torch.equal(bits(a) if a.is_floating_point() else a,
                                                    bits(b) if b.is_floating_point() else b) for a, b in zip(f, s))


@pytest.mark.parametrize("n", [8, 9, 31, 32, 33, 100, 1000, 4133, 65_573, (1 << 20) + 3])
def test_cascade_sum_and_ef_sign_scale_equal_torch(n: int, avx2_switch: str, one_thread: None) -> None:
    """torch's one-thread float32 sum (its cascade of 8-lane levels) copied in C: the sum, the sum of
    magnitudes, the magnitudes' mean beside the abs pass, and EF-SignSGD's scale with its signs from
    one read, bit for bit (-0.0, values over many magnitudes, every level of the cascade)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(6) * 1e3 - 0.125
    x[0] = -0.0
    if not _native.sums_like_torch():  # another ATen kernel: every caller keeps torch's reduction
        assert _native.cascade_sum(x) is None and _native.abs_mean_signs(x) is None
        return
    assert str(_native.cascade_sum(x)) == str(float(x.sum()))
    assert str(_native.cascade_sum(x, absolute=True)) == str(float(x.abs().sum()))
    for t in (0.0, 0.3, -1.7e-3, 123.456, 0.1 + 1e-12):  # SIDCo's later fits: the shifted exceedances' mean
        assert str(_native.shifted_mean(x, t)) == str(float((x - t).mean()))
        assert str(_native.shifted_mean(x, t, absolute=True)) == str(float((x.abs() - t).mean()))
    got = _native.abs_stats(x, torch.empty_like(x))
    assert got is not None and got.mean == float(x.abs().mean()) and _native.abs_stats(x, None) == got
    fused = _native.abs_mean_signs(x)
    assert fused is not None
    assert torch.equal(bits(fused[0]), bits(x.abs().mean().reshape(1)))
    assert torch.equal(fused[1], pack_bits(torch.ge(x, 0), 1))
    x[n // 2] = float("inf")  # an infinite scale is left to torch
    assert _native.abs_mean_signs(x) is None
    torch.set_num_threads(2)
    assert _native.cascade_sum(x) is None and _native.abs_mean_signs(x) is None
    assert _native.shifted_mean(x, 0.5) is None


def test_efsignsgd_payload_is_the_torch_paths(monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn((1 << 16) + 9, generator=g), torch.randn(300, generator=g) * 1e-3, torch.randn(5, generator=g)]
    fast = [compressors.get("efsignsgd").compress(x, "w")[0] for x in xs]
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    slow = [compressors.get("efsignsgd").compress(x, "w")[0] for x in xs]
    for (fs, fp), (ss, sp) in zip(fast, slow):
        assert torch.equal(bits(fs), bits(ss)) and torch.equal(fp, sp)


@pytest.mark.parametrize("name", ["efsignsgd", "gaussiank", "gaussiank-undecided", "topk", "redsync", "mstopk",
                                  "sidco"])
def test_compensation_that_reads_its_sum_keeps_the_torch_paths_bits(name: str, monkeypatch: pytest.MonkeyPatch,
                                                                    one_thread: None) -> None:
    """Error feedback's compensation written by the compressor's fused pass (EF-SignSGD's scale and
    signs, Gaussian-k's mean, std and search candidates, Top-k's candidates, RedSync's and MSTop-k's
    statistics and search candidates, SIDCo-E's mean, read while the sum is written) gives the payloads
    and residuals of torch's add and the compressor's own passes, step after step (Gaussian-k also
    where the lanes' sums leave the std undecided and a read in torch's order answers)."""
    g = torch.Generator().manual_seed(21)
    grads = [[torch.randn((1 << 17) + 3, generator=g), torch.randn(4000, generator=g)] for _ in range(3)]
    if name.endswith("-undecided"):
        name = name.split("-")[0]
        monkeypatch.setattr(_native, "std_from_moments", lambda *a: None)

    def run() -> list[torch.Tensor]:
        extra = {"stages": 3} if name == "sidco" else {}  # SIDCo: later stages answered from kept candidates
        comp = compressors.get(name, **({} if name == "efsignsgd" else {"density": 0.01, **extra}))
        memory = memories.get("residual")
        seen = []
        for step in grads:
            for i, grad in enumerate(step):
                t = memory.compensate(grad.clone(), f"w{i}", compressor=comp)
                payload, ctx = comp.compress(t, f"w{i}")
                memory.update(t, f"w{i}", comp, list(payload), ctx)
                seen += [p.clone() for p in payload] + [memory.residuals[f"w{i}"].clone()]
        return seen

    fast = run()
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    slow = run()
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert torch.equal(bits(a) if a.is_floating_point() else a, bits(b) if b.is_floating_point() else b)


def _blocked_fma_sums(x: Any, y: Any, block: int) -> Any:
    """Reference of :data:`_native.SEQ_BLOCKS`' order ``block`` for ``x @ y`` (float32 numpy
    arrays), written from its definition: per block an fma chain from +0 (the exact product plus
    the sum in float64, rounded once to float32), the blocks' sums added in order; block 0, one
    chain of rounded products and additions."""
    import numpy as np
    n, m = x.shape
    sizes, rest = [], m
    while rest > 0:
        size = rest if not block or rest <= block else (block if rest > 2 * block else (rest + 1) // 2)
        sizes.append(size)
        rest -= size
    total, k0 = np.zeros((n, y.shape[1]), np.float32), 0
    for b, size in enumerate(sizes):
        acc = np.zeros((n, y.shape[1]), np.float32)
        for k in range(k0, k0 + size):
            if block:
                acc = (x[:, k:k + 1].astype(np.float64) * y[k:k + 1].astype(np.float64) + acc).astype(np.float32)
            else:
                acc = acc + x[:, k:k + 1] * y[k:k + 1]
        total = acc if b == 0 else total + acc
        k0 += size
    return total


@pytest.mark.parametrize("block", [0, 384])
@pytest.mark.parametrize("n,m,r", [(17, 1000, 4), (8, 769, 3), (64, 576, 8), (13, 2048, 2), (9, 147, 5), (3, 384, 1),
                                   (11, 385, 4), (40, 1537, 6), (24, 0, 3)])
def test_low_rank_sums_in_either_order(n: int, m: int, r: int, block: int, avx2_switch: str) -> None:
    """:func:`_native.mm_seq` (sums along the rows) and :func:`_native.mtm_seq` (down the columns)
    give the reference's bits in each order of :data:`_native.SEQ_BLOCKS`: block ends inside and at
    the 8-column groups, the last 768 terms split in two, rows left over, ranks 1-8, no terms, a
    zero row and -0.0 (a sum of -0.0 products stays +0 from the +0 start)."""
    gen = torch.Generator().manual_seed(n * 7919 + m + r)
    mat, q = torch.randn(n, m, generator=gen), torch.randn(m, r, generator=gen)
    if m:
        mat[2] = -0.0
        q[0] = -0.0
    want = bits(torch.from_numpy(_blocked_fma_sums(mat.numpy(), q.numpy(), block)))
    assert torch.equal(bits(_native.mm_seq(mat, q, block)), want)
    assert torch.equal(bits(_native.mtm_seq(mat.t().contiguous(), q, block)), want)  # the same sums, down columns
    with pytest.raises(ValueError, match="block must be one of"):
        _native.mm_seq(mat, q, 256)


@pytest.mark.parametrize("block", [0, 384])
@pytest.mark.parametrize("n,m,r0,r", [(37, 101, 4, 4), (64, 576, 4, 2), (2304, 768, 4, 3), (1001, 2053, 3, 8),
                                      (9, 1100, 8, 1), (16, 8, 9, 5), (600, 2048, 4, 4), (24, 1000, 4, 4)])
def test_owed_compensation_with_product_is_the_two_passes(n: int, m: int, r0: int, r: int, block: int) -> None:
    """``g + (a - P0 Q0^T)`` and its product with Q from one pass (:func:`_native.owed_mm`) are
    bitwise the compensation (:func:`_native.outer_fma_sub` with g) followed by :func:`_native.mm_seq`
    in either summation order: rows and columns left over, block ends inside an 8-column group,
    ranks 1-8, factors of another rank, signed zeros, inf and NaN; the output streamed in whole
    lines where aligned (2304 x 768, 600 x 2048) and stored plainly where not."""
    gen = torch.Generator().manual_seed(n * m + r)
    p0, q0 = torch.randn(n, r0, generator=gen), torch.randn(m, r0, generator=gen)
    a, g, q = torch.randn(n, m, generator=gen), torch.randn(n, m, generator=gen), torch.randn(m, r, generator=gen)
    a.view(-1)[:3] = torch.tensor([-0.0, float("inf"), float("nan")])
    g.view(-1)[:2] = torch.tensor([0.0, -0.0])
    want_out = torch.empty(n, m)
    assert _native.outer_fma_sub(a, p0, q0, want_out, g=g)
    want = _native.mm_seq(want_out, q, block)
    out = torch.empty(n, m)
    got = _native.owed_mm(g, a, p0, q0, out, q, block)
    if got is None:  # no AVX2 + FMA here: the caller runs the two passes
        assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
        return
    assert want is not None and torch.equal(bits(out), bits(want_out)) and torch.equal(bits(got), bits(want))


def _habit_run(memory: Any, comp: Any, other: Any, comm_name: str, grads: list[list[torch.Tensor]],
               junk: list[torch.Tensor], habit: str, pending: Any,
               backend: Any = None) -> tuple[list[torch.Tensor], int, set[int]]:
    """Steps of compensate, exchange (the real communicator on one rank, or on ``backend``'s ranks)
    and update over ``grads``, with ``habit`` after step 2 (``rollback``: a junk round rolled back;
    ``state_dict``: a read of every state tensor; ``rescale``) and ``other`` compressing step 3.
    Returns every compensated tensor and output kept, then the memory's state dicts' tensors; the
    sum of ``pending()`` after each step; the first tensor's compensated buffers from step 2 on."""
    from adacomp.backends.base import LocalBackend
    from adacomp.communicators import get as get_communicator
    from adacomp.communicators.base import CommEnv, Entry
    from adacomp.engine.error_feedback import exchange
    from adacomp.engine.metrics import StepStats
    comm, env = get_communicator(comm_name), CommEnv(backend or LocalBackend(), StepStats())
    world = env.backend.size()
    seen: list[torch.Tensor] = []
    buffers: set[int] = set()
    count = 0

    def one(now: list[torch.Tensor], c: Any = comp, keep: bool = True) -> None:
        nonlocal count
        entries = [Entry(f"w{i}", memory.compensate(grad.clone(), f"w{i}", world, compressor=c,
                                                    pieces=comm.pieces(f"w{i}", grad.numel(), world)), c, memory)
                   for i, grad in enumerate(now)]
        if keep:
            seen.extend(e.tensor.clone() for e in entries)
            buffers.add(entries[0].tensor.data_ptr())
        outs = exchange(comm, entries, env)
        if keep:
            seen.extend(o.clone() for o in outs)
        count += pending()
        c.on_step(getattr(c, "step", 0) + 1)

    for step, now in enumerate(grads):
        one(now, other if step == 3 else comp)
        if step == 2:
            if habit == "rollback":
                snap, state = memory.snapshot(), comp.state_dict()
                one(junk, keep=False)
                memory.restore(snap)
                comp.load_state_dict(state)
            elif habit == "state_dict":
                seen.extend(t for d in memory.state_dict().values() for t in d.values())
            elif habit == "rescale":
                memory.rescale(0.5)
        if step == 1:
            buffers.clear()  # from here on the two buffers per tensor alternate
    seen.extend(t for d in memory.state_dict().values() for t in d.values())
    return seen, count, buffers


DEFERRED = {"efsignsgd": ({}, "allgather", "topk", [(1 << 17) + 3, 4000, 9]),
            "powersgd": ({"rank": 4}, "allreduce", "randomk", [(520, 2056), (256, 300), 4000]),
            "acpsgd": ({"rank": 3}, "allreduce", "randomk", [(520, 2056), (256, 300), 4000]),
            "chunktopk": ({"density": 0.02}, "allgather_fast", "topk", [(520, 2056), (256, 300), 4000]),
            # the sparsifiers' zeroing of the sent coordinates (SparseCompressor.defer_residual), from
            # DEFER_ZEROING_MIN sent positions (6554 of the first tensor; the others written every step)
            "topk": ({"density": 0.05}, "allgather", "randomk", [(1 << 17) + 3, (300, 256), 4000]),
            "sidco": ({"density": 0.05, "stages": 3}, "allgather", "topk", [(1 << 17) + 3, (300, 256), 4000]),
            "redsync": ({"density": 0.05}, "allgather", "topk", [(1 << 17) + 3, (300, 256), 4000]),
            "mstopk": ({"density": 0.05}, "allgather", "topk", [(1 << 17) + 3, (300, 256), 4000])}
"""method -> (parameters, communicator, another compressor it takes, gradient shapes)"""


@pytest.mark.parametrize("habit", ["none", "rollback", "state_dict", "rescale", "other_compressor"])
@pytest.mark.parametrize("method", sorted(DEFERRED))
def test_deferred_residual_is_the_written_one(method: str, habit: str, avx2_switch: str, one_thread: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A residual left to the next compensation (EF-SignSGD's decoded signs, PowerSGD's and
    ACP-SGD's P Q^T, Chunk-Top-k's kept values, subtracted inside that C pass; the sparsifiers' sent
    coordinates, read as +0.0 there; never written) gives bitwise the compensated
    tensors, outputs and residuals of the same run with the residual written every step, through
    the real communicator; after the first steps no buffer is allocated. A habit in the middle (a
    rolled-back round, a state_dict read, a loss-scale change, a step through another compressor)
    sees and keeps the same values. (The C passes themselves are checked against torch's
    operations in the tests above.) PowerSGD's first product comes from that pass too (with AVX2)."""
    params, comm_name, other_name, shapes = DEFERRED[method]
    g = torch.Generator().manual_seed(31)
    grads = [[torch.randn(s, generator=g) * (1 + step) for s in shapes] for step in range(6)]
    junk = [torch.randn(s, generator=g) * 1e3 for s in shapes]

    def run(defer: bool) -> tuple[list[torch.Tensor], int, set[int]]:
        comp = compressors.get(method, **params)
        other = compressors.get(other_name, density=0.1) if habit == "other_compressor" else comp
        if not defer:
            comp.defer_residual = other.defer_residual = lambda *args: None  # the residual written at every update
        memory = memories.get("residual")
        return _habit_run(memory, comp, other, comm_name, grads, junk, habit, lambda: len(memory._owed))

    from adacomp.compressors import _lowrank, powersgd
    fused: list[Any] = []
    exact: list[bool] = []  # per fused-pass attempt: whether the C sums give torch's bits for its layout
    owed_mm, owed_with = _native.owed_mm, powersgd.owed_with_product
    monkeypatch.setattr(_native, "owed_mm", lambda *args: fused.append(owed_mm(*args)) or fused[-1])

    def owed_with_product(g: torch.Tensor, base: torch.Tensor, token: Any, out: torch.Tensor, q: torch.Tensor) -> Any:
        n, m = token.p.shape[0], token.q.shape[0]
        exact.append(bool(_lowrank._EXACT.get(_lowrank._layout("mq", out.view(n, m), q))))
        return owed_with(g, base, token, out, q)
    monkeypatch.setattr(powersgd, "owed_with_product", owed_with_product)
    fast, deferred, buffers = run(True)
    assert deferred > 0  # the residual was left to the next pass
    if method == "powersgd" and avx2_switch == "avx2":
        # round 0's product came from the same pass wherever the C sums were seen to give torch's
        # bits for the layout (in one of SEQ_BLOCKS' orders: torch's kernels on the 2-core EPYC,
        # MKL's AVX-512 sgemm on the Xeon; another BLAS's order makes the pass rightly decline)
        assert exact and len(fused) == sum(exact) and all(p is not None for p in fused)
    assert habit != "none" or len(buffers) == 2
    slow, deferred_slow, _ = run(False)
    assert deferred_slow == 0 and len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert torch.equal(bits(a) if a.is_floating_point() else a, bits(b) if b.is_floating_point() else b)


@pytest.mark.parametrize("kernel", ["add_select", "add_abs_stats", "add_moments_select"])
def test_overflowed_compaction_reads_the_written_sum_not_the_fused_pass_again(kernel: str, avx2_switch: str,
                                                                              one_thread: None,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a fused compensation's candidates outnumber the room its guess made (a sampled floor
    far too low, as on real gradients), the exact count is known and the sum is whole: the
    candidates are taken again from that sum in one read (the signed selects), not by running the
    fused pass again. The same positions, signed values and statistics as a guess with room."""
    n = (1 << 18) + 37
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    lib = _native.library()
    fused = {"add_select": "ac_add_select_abs_not_lt", "add_abs_stats": "ac_add_abs_stats_select",
             "add_moments_select": "ac_add_moments_select"}[kernel]
    calls: list[int] = []
    real = getattr(lib, fused)

    class Counted:  # the CDLL attribute, counted (ctypes function pointers take no new attributes)
        def __call__(self, *args: Any) -> Any:
            calls.append(1)
            return real(*args)
    monkeypatch.setattr(lib, fused, Counted())

    def run(expected: float) -> list[torch.Tensor]:
        out = torch.full((n,), 7.0)
        if kernel == "add_select":
            return [out, *_native.add_select(a, b, out, 0.5, expected)]
        if kernel == "add_abs_stats":
            got = _native.add_abs_stats(a, b, out, 0.5, True, expected)
            assert got.cands is not None and got.stats is not None
            return [out, *got.cands, torch.tensor([got.stats.max, got.stats.min, got.stats.mean or 0.0])]
        m = _native.add_moments_select(a, b, out, 0.5, expected)
        assert m is not None
        return [out, m.idx, m.vals, torch.tensor([m.total, m.squares, m.plain], dtype=torch.float64)]

    roomy = run(1.0)
    assert len(calls) == 1
    short = run(0.01)  # ~62 % pass 0.5: far more than the room for 1.5 %
    assert len(calls) == 2  # the fused pass ran once more, for this call: not again for the overflow
    for x, y in zip(short, roomy):
        assert torch.equal(bits(x), bits(y))
    assert short[1].numel() > 0.5 * n


@pytest.mark.parametrize("n", [5, 8, 100, 4133, 65_573, (1 << 20) + 37])
@pytest.mark.parametrize("strict", [True, False])
def test_compensation_with_search_statistics_is_the_separate_passes(n: int, strict: bool, avx2_switch: str,
                                                                    one_thread: None) -> None:
    """RedSync's and MSTop-k's fused first read (``add_abs_stats``): the sum is torch.add's, the
    statistics are abs_stats' of that sum, the candidates are select's in mode abs_gt / abs_ge (a sum
    exactly at the threshold, -0.0, a shifted output) with the signed sums there; a NaN still writes
    the whole sum."""
    for shift in (0, 1):
        g = torch.Generator().manual_seed(n + shift)
        a, b = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.3
        a[0] = -0.0
        a[n // 3], b[n // 3] = 1.25, 0.25  # a sum of exactly 1.5
        out = torch.full((n + shift,), 7.0)[shift:]
        got = _native.add_abs_stats(a, b, out, 1.5, strict, 0.1)
        s = torch.add(a, b)
        assert got.done and torch.equal(bits(out), bits(s))
        assert got.stats == _native.abs_stats(s, None) and got.stats.max == float(s.abs().max())
        idx, vals = _native.select(s, 1.5, "abs_gt" if strict else "abs_ge", 0.1)
        assert got.cands is not None and torch.equal(got.cands[0], idx) and torch.equal(bits(got.cands[1]), bits(s[idx]))
        assert torch.equal(bits(got.cands[1].abs()), bits(vals))
        assert (n // 3 in idx.tolist()) == (not strict)
        out.fill_(7.0)
        assert _native.add_abs_stats(a, b, out).stats == got.stats  # statistics alone
        a[n // 2] = math.nan
        out.fill_(7.0)
        nan = _native.add_abs_stats(a, b, out, 1.5, strict)
        assert nan.done and nan.stats is None and nan.cands is None and torch.equal(bits(out), bits(torch.add(a, b)))
    assert not _native.add_abs_stats(a, b, a, 1.5).done  # an output over an input: a retry would add twice


@pytest.mark.parametrize("shift", [0, 1])
def test_streamed_outputs_equal_torch(shift: int, avx2_switch: str) -> None:
    """Outputs from 2^20 elements are written with non-temporal stores (AVX2, 32-byte aligned; a
    shifted output takes the plain loop): the compensation add, Top-k's add with its prefilter, DGC's
    momentum correction (and with its candidates), the magnitudes pass, EF-SignSGD's residual and the compensation that sums
    as it writes keep torch's bits."""
    n = (1 << 20) + 37
    g = torch.Generator().manual_seed(shift)
    a, b, c = (torch.randn(n, generator=g) for _ in range(3))
    a[:4] = torch.tensor([-0.0, float("inf"), float("nan"), 1e-42])

    def fresh() -> torch.Tensor:
        return torch.full((n + shift,), 7.0)[shift:]

    out = fresh()
    assert _native.add_into(a, b, out) and torch.equal(bits(out), bits(torch.add(a, b)))
    out = fresh()
    assert _native.add_into(a, b, out, subtract=True) and torch.equal(bits(out), bits(torch.sub(a, b)))
    out = fresh()
    idx, vals = _native.add_select(a, b, out, 1.5, expected=0.2)
    s = torch.add(a, b)
    want = ~torch.lt(s.abs(), 1.5)
    assert torch.equal(bits(out), bits(s)) and torch.equal(idx, torch.nonzero(want).view(-1))
    assert torch.equal(bits(vals), bits(s[want]))
    u_out, v_out = fresh(), fresh()
    assert _native.momentum_accumulate(a, b, c, u_out, v_out, 0.9)
    u_want = torch.mul(a, 0.9).add_(b)
    assert torch.equal(bits(u_out), bits(u_want)) and torch.equal(bits(v_out), bits(torch.add(c, u_want)))
    u_out, v_out = fresh(), fresh()  # with DGC's candidates from the same pass: |v| >= t, NaN never
    got = _native.momentum_select(a, b, c, u_out, v_out, 0.9, 2.0, expected=0.1)
    assert got is not None and torch.equal(bits(u_out), bits(u_want)) and torch.equal(bits(v_out), bits(c + u_want))
    want = torch.ge((c + u_want).abs(), 2.0)
    assert torch.equal(got[0], torch.nonzero(want).view(-1)) and torch.equal(bits(got[1]), bits((c + u_want)[want]))
    x = a.clone()
    x[2] = 3.0  # no NaN: the stats answer
    out = fresh()
    st = _native.abs_stats(x, out)
    assert st is not None and torch.equal(bits(out), bits(x.abs()))
    assert (st.max, st.min, st.argmax) == (float(x.abs().max()), float(x.abs().min()), int(x.abs().argmax()))
    packed = pack_bits(torch.ge(b, 0), 1)
    out = fresh()
    assert _native.sign_residual(a, packed, 0.25, out)
    decoded = torch.where(torch.ge(b, 0), torch.tensor(0.25), torch.tensor(-0.25))
    assert torch.equal(bits(out), bits(torch.sub(a, decoded)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = fresh()
        got = _native.add_cascade(x, b, out)
        assert got is not None and torch.equal(bits(out), bits(torch.add(x, b)))
        if _native.sums_like_torch():
            assert got[0] == float(torch.add(x, b).sum())
    finally:
        torch.set_num_threads(threads)


def test_chunk_selection_with_and_without_the_avx2_compaction() -> None:
    """Chunk-Top-k's floor compaction (64-element AVX2 masks, or 16-element SSE2 ones) selects the
    same positions and values, chunks whose floor passed too few or too many included; both equal
    the canonical per-chunk selection."""
    import ctypes
    g = torch.Generator().manual_seed(4)
    rows, chunk, k = 96, 4096, 82
    a = torch.randn(rows * chunk, generator=g) * torch.linspace(0.1, 3.0, rows).repeat_interleave(chunk)
    a[chunk * 5: chunk * 6] *= 100.0  # a jump: the previous chunk's floor passes everything here
    a[chunk * 9: chunk * 10] *= 0.001  # and nothing here
    a[chunk * 20 + 7] = -0.0
    switch = ctypes.c_int.in_dll(_native.library(), "ac_avx2_off")
    got = []
    try:
        for off in (0, 1):
            switch.value = off
            got.append(_native.chunk_topk(a, rows, chunk, k))
    finally:
        switch.value = 0
    (pa, va), (pb, vb) = got
    assert torch.equal(pa, pb) and torch.equal(bits(va), bits(vb))
    # with error feedback's compensation in the same pass: a = g + r written chunk by chunk, the same
    # selection; a NaN stops the selection (torch answers) but the sum is still written whole
    r = torch.randn(rows * chunk, generator=g)
    out = torch.full_like(a, 7.0)
    fused = _native.chunk_topk(out, rows, chunk, k, add=(a - r, r))
    assert torch.equal(bits(out), bits((a - r) + r)) and fused is not None
    assert torch.equal(fused[0], _native.chunk_topk(out.clone(), rows, chunk, k)[0])
    nan = (a - r).clone()
    nan[chunk * 30 + 1] = math.nan
    out.fill_(7.0)
    assert _native.chunk_topk(out, rows, chunk, k, add=(nan, r)) is None
    assert torch.equal(bits(out), bits(nan + r))
    mags = a.view(rows, chunk).abs()
    for row in range(rows):
        want = largest_k_positions(mags[row], k)
        assert torch.equal(pa[row], want), row
        assert torch.equal(bits(va[row]), bits(a.view(rows, chunk)[row][want]))


def largest_k_positions(m: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of m, ties at the k-th to the lowest positions, ascending (the canonical choice)."""
    kth = torch.topk(m, k).values[-1]
    above = torch.nonzero(m > kth).view(-1)
    ties = torch.nonzero(m == kth).view(-1)[: k - above.numel()]
    return torch.cat([above, ties]).sort().values


@pytest.mark.parametrize("rows,b,r", [(512, 128, 47), (2048, 32, 6), (7, 5, 5), (3, 64, 1), (100, 33, 17),
                                      (300, 64, 64), (50, 65, 9), (40, 12, 1), (30, 128, 40), (20, 129, 7)])
def test_row_kth_equals_torch_topk_min(rows: int, b: int, r: int, avx2_switch: str) -> None:
    """ADTopk's per-row floor in C: the r-th largest of each row, torch's value (ties, an all-tied
    row, zeros, a NaN row), by the branch-free rank count (rows up to 64) and by the quickselect."""
    g = torch.Generator().manual_seed(rows + b)
    a = torch.randn(rows, b, generator=g).abs()
    a[0, :] = a[0, 0]
    a[1, b // 2] = float("nan")
    a[2, :] = 0.0
    if rows > 4:
        a[4, ::2] = 1.0
    got = _native.row_kth(a, r)
    want = torch.topk(a, r, dim=1, sorted=False).values.amin(1)
    assert got is not None and torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok])


@pytest.mark.parametrize("m,n,blocks,r", [(5, 64, 32, 3), (3, 100, 32, 32), (7, 1000, 64, 9), (3, 33, 33, 1),
                                           (4, 3000, 128, 40)])
def test_row_candidates_equal_torch_floor_and_compare(m: int, n: int, blocks: int, r: int, avx2_switch: str) -> None:
    """ADTopk's candidates from one read per row: torch's strided block maxima of |x| (amax), their
    r-th largest (topk), clamped to TINY, infinity on a NaN row, then |x| against it (-0.0,
    infinities, an all-zero row, columns past the last whole block, which still compare)."""
    from adacomp.compressors.sparse import TINY
    g = torch.Generator().manual_seed(m * n + r)
    x = torch.randn(m, n, generator=g)
    x[0, 0], x[0, 1], x[1, 2] = -0.0, float("-inf"), float("nan")
    x[-1] = 0.0
    bs = n // blocks
    bmax = x[:, :bs * blocks].abs().reshape(m, bs, blocks).amax(1)
    floor = torch.topk(bmax, r, dim=1).values.amin(1).clamp_(min=TINY)
    bad = torch.isnan(floor)
    floor.masked_fill_(bad, float("inf"))
    a = x.abs()
    keep = a >= floor[:, None] if n % blocks == 0 else ~(a < floor[:, None])
    want = torch.nonzero(keep.view(-1)).view(-1)
    got = _native.row_candidates(x, r, blocks, TINY, 0.01, limit=m * n)
    assert got is not None
    flat, mag, count, flags = got
    zero = (x == 0).all(1) & (n % blocks == 0)  # flagged 2: an all-zero row, where the blocks cover it
    assert count == want.numel() and torch.equal(flat, want)
    assert torch.equal(flags, torch.where(bad, 1, torch.where(zero, 2, 0)).to(torch.uint8))
    assert torch.equal(mag.view(torch.int32), a.view(-1)[want].view(torch.int32))


@pytest.mark.parametrize("width,size", [(1, 0), (4, 512), (4, 100), (4, 0)])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_large_table_mean_equals_torch_decode_sum_divide(width: int, size: int, world: int, avx2_switch: str) -> None:
    """The code-table mean of outputs large enough to be streamed (from AC_STREAM_MIN elements; two
    ranks with both tables in registers, other power-of-two worlds rank by rank, three ranks and
    buckets not a multiple of 8 through the run loop) equals torch's decode of every rank, sum in
    rank order and division, bit for bit (a tail past the last group of 8 included)."""
    n = (1 << 20) + 13
    size = size or n
    from adacomp.compressors._bitpack import unpack_bits
    g = torch.Generator().manual_seed(width * 10 + world)
    nb = -(-n // size)
    packed = [torch.randint(0, 256, (-(-n * width // 8),), dtype=torch.uint8, generator=g) for _ in range(world)]
    tables = [torch.randn(nb << width, generator=g) for _ in range(world)]
    tables[0][0] = -0.0
    out = torch.full((n,), float("nan"))
    assert _native.table_mean(packed, tables, width, size, n, out)
    bucket = torch.arange(n) // size
    decoded = [t.view(nb, 1 << width)[bucket, unpack_bits(p, width, n).long()] for p, t in zip(packed, tables)]
    want = decoded[0]
    for d in decoded[1:]:
        want = want + d
    assert torch.equal(bits(out), bits(want / world))


@pytest.mark.parametrize("n,m,r", [(512, 4608, 4), (2048, 512, 1), (300, 1025, 8), (7, 1100, 9), (3, 5, 2),
                                   (1030, 1100, 4), (257, 4104, 3), (1024, 2056, 10)])
def test_residual_of_a_product_formed_in_registers(n: int, m: int, r: int, avx2_switch: str) -> None:
    """``a - P Q^T`` with the products formed again and never written equals torch.sub of ``a`` and
    the written product (signed zeros, infinities and NaN in ``a``), and the low-rank helper gives
    the reference path's bits whichever way it takes. With AVX2, wide matrices past 2^20 elements
    take the four-row loop (rows and columns left over, streamed and plain stores, ranks past 8);
    the baseline takes the column chunks."""
    from adacomp.compressors._lowrank import residual_of_product
    from adacomp.compressors.workspace import Workspace
    g = torch.Generator().manual_seed(n + m + r)
    p, q, a = torch.randn(n, r, generator=g), torch.randn(m, r, generator=g), torch.randn(n, m, generator=g)
    a.view(-1)[:3] = torch.tensor([-0.0, float("inf"), float("nan")])
    approx, out = torch.empty(n, m), torch.empty(n, m)
    assert _native.outer_fma(p, q, approx) and _native.outer_fma_sub(a, p, q, out)
    assert torch.equal(bits(out), bits(torch.sub(a, approx)))
    ws = Workspace()
    for _ in range(2):  # the first call of a layout decides; the second takes the fused path where it may
        got = residual_of_product(a, p, q, torch.empty(n, m), ws)
        assert torch.equal(bits(got), bits(torch.sub(a, p @ q.t())))  # the reference: torch's product


def test_sorted_member_is_isin_on_ascending_positions():
    """``sorted_member``: torch.isin of ascending int64 positions by one merge (Ok-Topk's pairs the
    global selection kept); None where either side is not strictly ascending (a merge would answer
    wrongly), and empty sides."""
    from adacomp.compressors import _native
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()})")
    g = torch.Generator().manual_seed(4)
    for n, m in [(1000, 300), (5, 0), (0, 7), (4000, 4000)]:
        a = torch.unique(torch.randint(0, 3 * max(n, 1), (n,), generator=g))
        b = torch.unique(torch.randint(0, 3 * max(m, 1), (m,), generator=g))
        got = _native.sorted_member(a, b)
        assert got is not None and torch.equal(got, torch.isin(a, b))
    assert _native.sorted_member(torch.tensor([3, 1]), torch.tensor([1, 3])) is None
    assert _native.sorted_member(torch.tensor([1, 3]), torch.tensor([3, 3])) is None


def test_merge_sum_is_unique_and_index_add():
    """``merge_sum``: runs of ascending positions (each rank's pairs at an Ok-Topk owner) merged, the
    values at a shared position summed in run order from +0.0: bitwise torch.unique and index_add_
    into zeros (a -0.0 alone sums to +0.0, as there), for 1-4 runs, empty ones among them; None
    where a run is not strictly ascending."""
    from adacomp.compressors import _native
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()})")
    g = torch.Generator().manual_seed(6)
    for sizes in [(700,), (500, 600), (0, 300, 5), (200, 0, 250, 90)]:
        idx = [torch.unique(torch.randint(0, 900, (n,), generator=g)) for n in sizes]
        vals = [torch.randn(i.numel(), generator=g) for i in idx]
        for v in vals:
            v[::7] = -0.0
        got = _native.merge_sum(idx, vals)
        cat_i, cat_v = torch.cat(idx), torch.cat(vals)
        uniq, inv = torch.unique(cat_i, sorted=True, return_inverse=True)
        want = torch.zeros(uniq.numel()).index_add_(0, inv, cat_v)
        assert got is not None and torch.equal(got[0], uniq)
        assert torch.equal(got[1].view(torch.int32), want.view(torch.int32))
    assert _native.merge_sum([torch.tensor([2, 1])], [torch.tensor([1.0, 2.0])]) is None
