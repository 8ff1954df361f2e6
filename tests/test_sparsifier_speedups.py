"""The CPU speed-ups of the sparsifiers keep each method's defining property.

* randomk's sampler (``distinct_uniform``): k distinct indices, equal for equal generators, roughly
  uniform over many draws (chi-square bound), and the randperm path above half density.
* the prefiltered exact top-k equals a full ``torch.topk`` selection (ties and NaN included).
* ``ThresholdCounter`` answers exactly like a full pass, above and below its floor.
* reused buffers never alias what the caller keeps: two consecutive payloads / decompressed outputs
  are distinct storages, and an output the caller still holds is never rewritten.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from adacomp import compressors
from adacomp.compressors.sparse import ThresholdCounter, Workspace, k_for, largest_k, nonzero_1d
from adacomp.compressors.topk import distinct_uniform, topk_indices

SPARSIFIERS = ["topk", "gtopk", "randomk", "mstopk", "dgc", "gaussiank", "redsync", "sidco", "oktopk"]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n,k", [(10, 1), (1000, 10), (1 << 16, 655), (1 << 16, 20000), (5000, 3000), (7, 7)])
def test_randomk_sampler_gives_k_distinct_indices_same_for_equal_generators(n: int, k: int) -> None:
    a, b = distinct_uniform(n, k, gen(3)), distinct_uniform(n, k, gen(3))
    assert torch.equal(a, b)
    assert a.numel() == k and torch.unique(a).numel() == k
    assert int(a.min()) >= 0 and int(a.max()) < n and a.dtype == torch.int64


@pytest.mark.parametrize("short", [False, True])
@pytest.mark.parametrize("n,k", [(10, 3), (1000, 499), (1 << 16, 655), (2_400_000, 24000)])
def test_randomk_sampler_equal_with_and_without_the_library(n: int, k: int, short: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The C bitmap sampler picks the same indices as torch.unique's path, also when the first batch
    of draws is too short (``short``: a first batch of 64 draws, so more are drawn, the same amounts
    from the same generator on both paths)."""
    import adacomp.compressors.topk as topk_module
    if short:
        monkeypatch.setattr(topk_module.math, "log", lambda x: 0.0)
    fast = distinct_uniform(n, k, gen(5))
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    slow = distinct_uniform(n, k, gen(5))
    assert torch.equal(fast, slow) and fast.numel() == k


def test_randomk_sampler_is_uniform() -> None:
    n, k, draws = 50, 5, 4000
    g = gen(11)
    hits = torch.zeros(n)
    for _ in range(draws):
        hits.index_add_(0, distinct_uniform(n, k, g), torch.ones(k))
    expected = draws * k / n
    chi2 = float(((hits - expected) ** 2 / expected).sum())
    assert chi2 < 100.0  # 49 degrees of freedom: p < 1e-5 above ~100
    # pairs are uniform too (a sampler biased toward neighbours would fail): first two coordinates
    pair = sum(int(bool({0, 1} <= set(distinct_uniform(n, k, g).tolist()))) for _ in range(draws))
    p = k * (k - 1) / (n * (n - 1))
    assert abs(pair - draws * p) < 5 * (draws * p * (1 - p)) ** 0.5


def test_randomk_compressor_identical_on_two_copies_and_decompresses() -> None:
    x = torch.randn(1 << 18, generator=gen(1))
    c, d = compressors.get("randomk", density=0.01, seed=4), compressors.get("randomk", density=0.01, seed=4)
    (v1,), ctx1 = c.compress(x, "w")
    (v2,), ctx2 = d.compress(-x, "w")
    assert torch.equal(ctx1.indices, ctx2.indices) and torch.equal(v1, -v2)
    out = c.decompress([v1], ctx1)
    assert torch.equal(out.view(-1)[ctx1.indices], v1) and int(torch.count_nonzero(out)) <= v1.numel()


@pytest.mark.parametrize("case", ["gauss", "ties", "nan", "small", "zeros", "fewnonzero"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.2])
def test_prefiltered_topk_equals_full_topk(case: str, density: float) -> None:
    """Every path gives the canonical top-k (ascending; ties at the k-th magnitude to the lowest
    index; NaN first): the prefilter, the plain path without a workspace, float64, and the same set
    as torch.topk wherever torch's answer is unique."""
    n = 1000 if case == "small" else 1 << 17
    x = torch.randn(n, generator=gen(2))
    if case == "ties":
        x = torch.randint(-4, 5, (n,), generator=gen(2)).float()
    if case == "nan":
        x[[7, 99]] = float("nan")
    if case in ("zeros", "fewnonzero"):  # a ReLU layer's gradient: mostly exact zeros (fewer than k in the second)
        x = x * (torch.rand(n, generator=gen(3)) < (0.3 if case == "zeros" else 0.0005))
    k = max(1, round(density * n))
    got = topk_indices(x, k, Workspace())
    canonical = largest_k(torch.arange(n), x.abs(), k)
    assert torch.equal(got, canonical)
    assert torch.equal(topk_indices(x, k), got) and torch.equal(topk_indices(x.double(), k, Workspace()), got)
    if case not in ("ties", "fewnonzero"):  # elsewhere torch's own choice among ties is unspecified
        assert set(got.tolist()) == set(torch.topk(x.abs(), k, sorted=False).indices.tolist())
    if case == "ties":
        kth = float(torch.topk(x.abs(), k).values.min())
        tied = torch.nonzero(x.abs() == kth).view(-1)
        assert set(got.tolist()) >= set(torch.nonzero(x.abs() > kth).view(-1).tolist())
        assert got[x.abs()[got] == kth].tolist() == tied[:int((x.abs()[got] == kth).sum())].tolist()


@pytest.mark.parametrize("native", [True, False])
def test_topk_payload_does_not_depend_on_the_sample(native: bool, monkeypatch) -> None:
    """The sample only decides how many elements the exact selection looks at: a value that passes
    too few (the retry below it, then the whole tensor) or far too many gives the same payload."""
    from adacomp.compressors import _native as N
    from adacomp.compressors import topk as T
    x = torch.randn(1 << 17, generator=gen(9))
    k = 1300
    want = largest_k(torch.arange(x.numel()), x.abs(), k)
    if not native:
        monkeypatch.setattr(N, "usable", lambda a: False)
    for value in (0.0, 1.0, 3.5, 100.0):
        monkeypatch.setattr(T, "sample_value", lambda a, fraction, absolute=False, v=value: v)
        assert torch.equal(topk_indices(x, k, Workspace()), want)


def test_topk_reads_no_floor_again_that_passed_too_few(monkeypatch) -> None:
    """A compensation whose sampled floor passed fewer than k hands it to the selection: its first
    attempt, from the same sample, would read the tensor again for as few, so it is skipped and only
    the lower attempt reads the tensor (one pass, not two); the payload is the canonical one."""
    from adacomp.compressors import _native as N
    from adacomp.compressors import topk as T
    n, k = 1 << 17, 1311
    g, r = torch.randn(n, generator=gen(4)), torch.randn(n, generator=gen(5))
    x = g + r
    high = float(torch.topk(x.abs(), k // 2).values.min())  # passes k / 2
    monkeypatch.setattr(T, "sampled_value", lambda s, fraction, absolute=False: high)
    floors = iter([high, float(torch.topk(x.abs(), 2 * k).values.min())])  # the same sample, then 4x lower
    monkeypatch.setattr(T, "sample_value", lambda a, fraction, absolute=False: next(floors))
    reads: list[float] = []
    select = N.select
    monkeypatch.setattr(N, "select", lambda a, thr, *args: reads.append(thr) or select(a, thr, *args))
    comp = T.TopkCompressor(k / n)
    assert k_for(n, k / n) == k
    out = torch.empty(n)
    assert comp.compensate_into(g, r, out, "w")
    idx, vals = comp.pick(out, "w")
    assert torch.equal(idx, largest_k(torch.arange(n), x.abs(), k)) and torch.equal(vals, x[idx])
    assert len(reads) == 1 and reads[0] < high
    # a floor that fell short widens the tensor's next target (a speed hint, not state)
    assert comp._target("w", k, n) == pytest.approx(2 * T._expected(k, n)) and comp.state_dict() == {}


@pytest.mark.parametrize("strict", [True, False])
def test_threshold_counter_equals_full_passes(strict: bool) -> None:
    a = torch.randn(1 << 17, generator=gen(5)).abs()
    a[3] = float("nan")
    counter = ThresholdCounter.for_search(a, strict, 0.01, Workspace())
    assert counter.floor is not None
    for thr in [0.0, 0.5, counter.floor, 2.0, 2.5758, 3.0, 10.0]:
        ref = (a > thr) if strict else (a >= thr)
        assert counter.count(thr) == int(ref.sum())
        assert torch.equal(counter.select(thr), torch.nonzero(ref).view(-1))
        assert torch.equal(counter.values(thr), a[ref])
        assert counter.at_least(thr, 100) == (int(ref.sum()) >= 100)


@pytest.mark.parametrize("signed", [False, True])
def test_a_compaction_above_the_kept_floor_narrows_the_kept_set(signed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compact`` at a floor the kept set covers keeps what a fresh compaction of the tensor would
    (positions, values, signed or not) without reading the tensor; below the kept floor it reads it."""
    from adacomp.compressors import _native
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()}): the narrowing runs on the C passes")
    x = torch.randn(1 << 17, generator=gen(12))
    x[7] = 2.5  # a value at the new floor (strict: not kept)
    counter = ThresholdCounter(x if signed else x.abs(), True, Workspace(), absolute=signed)
    kept = torch.nonzero(x.abs() > 1.5).view(-1)
    counter.adopt(1.5, kept, x[kept] if signed else x.abs()[kept], signed=signed)
    reads: list[int] = []
    orig = _native.select
    monkeypatch.setattr(_native, "select", lambda a, *rest: (reads.append(a.numel()), orig(a, *rest))[1])
    counter.compact(2.5, 0.01)
    want = torch.nonzero(x.abs() > 2.5).view(-1)
    assert counter.floor == 2.5 and torch.equal(counter.idx, want) and x.numel() not in reads
    assert torch.equal(counter.vals, x[want] if signed else x.abs()[want])
    assert counter.count(3.0) == int((x.abs() > 3.0).sum())
    counter.compact(1.0, 0.1)  # below the kept floor: a pass over the tensor
    assert x.numel() in reads and torch.equal(counter.idx, torch.nonzero(x.abs() > 1.0).view(-1))


@pytest.mark.parametrize("signed", [False, True])
def test_a_count_below_the_kept_floor_keeps_what_passes_it(signed: bool) -> None:
    """A threshold search's count below its candidates' floor (a sampled floor that passed too few)
    keeps what passes that threshold from the same pass, so the search's later counts above it
    read the candidates alone; counts, selections and signed picks stay torch's. Where more than
    REFLOOR_ROOM times the kept set would pass, only the count comes back."""
    from adacomp.compressors import sparse as S
    x = torch.randn(1 << 18, generator=gen(11))
    counter = ThresholdCounter(x if signed else x.abs(), True, Workspace(), absolute=signed)
    kept = torch.nonzero(x.abs() > 3.0).view(-1)
    counter.adopt(3.0, kept, x[kept] if signed else x.abs()[kept], signed=signed)
    assert counter.count(2.0) == int((x.abs() > 2.0).sum())
    assert counter.floor == 2.0 and counter.vals is not None and counter.vals.numel() == int((x.abs() > 2.0).sum())
    for thr in (2.0, 2.5, 3.5):
        assert counter.covers(thr) and counter.count(thr) == int((x.abs() > thr).sum())
        assert torch.equal(counter.select(thr), torch.nonzero(x.abs() > thr).view(-1))
    got = counter.pick(2.5)
    assert (got is not None) == signed
    if got is not None:
        assert torch.equal(got[1], x[x.abs() > 2.5])  # the signed values, as adopted
    assert counter.count(0.1) == int((x.abs() > 0.1).sum())  # ~92 %: more than the room, counted only
    assert counter.floor == 2.0 and S.REFLOOR_ROOM * counter.vals.numel() < int((x.abs() > 0.1).sum())


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.02, 0.5])
def test_nonzero_1d_equals_torch_nonzero(fraction: float) -> None:
    mask = torch.rand(1 << 15, generator=gen(6)) < fraction
    assert torch.equal(nonzero_1d(mask, fraction), torch.nonzero(mask).view(-1))


@pytest.mark.parametrize("name", SPARSIFIERS)
def test_reused_buffers_never_alias_kept_payloads_or_outputs(name: str) -> None:
    c = compressors.get(name, density=0.01)
    x1 = torch.randn(512, 1024, generator=gen(7))  # above the recycling size
    x2 = torch.randn(512, 1024, generator=gen(8))
    p1, ctx1 = c.compress(x1, "w")
    keep1 = [t.clone() for t in p1]
    p2, ctx2 = c.compress(x2, "w")
    for a in p1:
        for b in p2:
            assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(p1, keep1))  # the second call left the first intact
    out1 = c.decompress(p1, ctx1)
    snapshot = out1.clone()
    out2 = c.decompress(p2, ctx2)  # out1 is still held: must get other memory
    assert out1.untyped_storage().data_ptr() != out2.untyped_storage().data_ptr()
    assert torch.equal(out1, snapshot)
    del out1, out2
    out3 = c.decompress(p1, ctx1)  # nothing held any more: recycled memory, same result
    assert torch.equal(out3, snapshot) and out3.shape == x1.shape


def test_workspace_keeps_state_dict_unchanged() -> None:
    for name in ("dgc", "oktopk", "sidco", "randomk"):
        c = compressors.get(name, density=0.01)
        c.compress(torch.randn(1 << 18, generator=gen(9)), "w")
        assert not any("workspace" in str(key) for key in c.state_dict())


@pytest.mark.parametrize("kind,shape,fuses", [
    ("adtopk", (512, 700), True), ("adtopk", (64, 3, 30, 40), True), ("adtopk", (256, 4096), True),
    ("adtopk", (1 << 18,), False), ("adtopk", (100, 90), False),
    ("chunktopk", (300, 700), True), ("chunktopk", (5 * 4096,), True), ("chunktopk", (3000,), False)])
def test_compensation_and_block_selection_share_one_pass(kind: str, shape: tuple[int, ...], fuses: bool) -> None:
    """Residual memory lets ADTopk write ``g + r`` row by row inside its row-candidates pass (the
    block-max floor path only), and Chunk-Top-k chunk by chunk inside its per-chunk selection
    (``compensate_into``): the compensated tensor, the payloads and the residuals are bitwise those
    of the separate add and selection (also where it declines, and with a partial last chunk)."""
    from adacomp.compressors import _native
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()}): the fused pass needs it")
    grads = [torch.randn(shape, generator=gen(60 + i)) for i in range(4)]
    grads[2].view(-1)[5] = 0.0  # exact zeros and ties in one row
    grads[2].view(-1)[6:40] = 1.5
    _fused_and_separate_agree(lambda: compressors.get(kind, density=0.01), grads, fuses)


def test_oktopk_compensation_selects_at_the_reused_threshold() -> None:
    """Between estimations Ok-Topk's threshold is known before error feedback's add, so the add lists
    ``|g + r| >= thr`` in the same pass (``compensate_into``): the compensated tensors, payloads and
    residuals are bitwise those of the plain add and the selection's own pass, through the count
    band's nudges and a re-estimation (a gradient 3x larger passes more than 2k) and a period's
    estimation step (period 3)."""
    from adacomp.compressors import _native
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()}): the fused pass needs it")
    scales = (1.0, 1.0, 1.1, 3.0, 1.0, 0.9, 1.0)
    grads = [torch.randn(1 << 16, generator=gen(80 + i)) * s for i, s in enumerate(scales)]
    grads[4][100:300] = 0.0  # exact zeros and ties
    grads[4][300:340] = 2.5

    def make() -> Any:
        comp = compressors.get("oktopk", density=0.01, period=3)
        step = iter(range(100))
        compress = comp.compress

        def stepping(t: torch.Tensor, name: str) -> Any:  # the optimizer's on_step before each round
            out = compress(t, name)
            comp.on_step(next(step) + 1)
            return out
        comp.compress = stepping
        return comp
    _fused_and_separate_agree(make, grads, True, kept_at=lambda comp, step: step > 0 and not comp.due("w"))


@pytest.mark.parametrize("method", ["oktopk", "gtopk"])
@pytest.mark.parametrize("sizes", [(5000, 333, 1 << 15, 27503), (1 << 16,) * 2, (0, 64, 65_600, 7)])
def test_bucket_compensation_reads_the_gradients_where_they_lie(method: str, sizes: tuple[int, ...]) -> None:
    """A fusion bucket's compensation from its gradients where they lie (``Memory.compensate_gathered``:
    the compressor's ``compensate_segments``, no flattened copy, the selection from its pass's list)
    gives the compensated tensor, payload and residual of the flattened bucket's plain add and the
    selection's own passes bitwise: Ok-Topk through a re-estimation (more than the
    band passes, then listed from a sampled floor where the band misses again, and where the sample
    misjudged), a step where nothing passes, a NaN among the candidates, a NaN gradient and a period's
    estimation; gTop-k's sampled floor and candidates through the same steps. Pieces of odd lengths
    put the sums at unaligned offsets."""
    from adacomp import memories
    from adacomp.compressors import _native
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()}): the pass over the pieces needs it")
    from adacomp.compressors.sparse import SAMPLE_LINE, sample_size, sample_starts
    n = sum(sizes)
    scales = (1.0, 1.0, 1.1, 3.0, 1e-30, 1e-30, 0.9, 1.0, 1.0, 1.0, 9.0, 27.0, 81.0, 1e-30, 1.0, float("nan"))
    grads = [torch.randn(n, generator=gen(90 + i)) * s for i, s in enumerate(scales)]
    # step 4, after a re-estimation above the band: a fifth of the lines a sample reads are large, so
    # the sample foresees another one (Ok-Topk lists from its floor) but the count stays in the band
    lines = sample_starts(n // SAMPLE_LINE, sample_size(n) // SAMPLE_LINE)[::5]
    grads[4].view(-1)[:n // SAMPLE_LINE * SAMPLE_LINE].view(-1, SAMPLE_LINE)[lines] = 40.0
    grads[6][100:300] = 0.0
    grads[-2][n // 2] = float("nan")  # one NaN among the candidates, then a NaN gradient
    runs, gathered_at = [], []
    for gathered in (True, False):
        comp = compressors.get(method, density=0.01, **({"period": 4} if method == "oktopk" else {}))
        mem = memories.get("residual")
        if not gathered:  # the reference: the flattened bucket, the plain add, the selection's own passes
            comp.compensate_into = lambda *a: False
        out = []
        for step, g in enumerate(grads):
            parts = [p.clone() for p in torch.split(g, list(sizes))]
            t = mem.compensate_gathered(parts, "b", comp) if gathered else None
            if gathered:  # wherever the compressor's own fused pass runs (Ok-Topk: a known threshold)
                # (gTop-k: a finite sampled floor; the NaN gradient's is not)
                ran = not comp.due("b") if method == "oktopk" else step < len(grads) - 1
                assert (t is not None) == (step > 0 and ran)
                gathered_at.append(t is not None)
                assert all(_same(p, q) for p, q in zip(parts, torch.split(g, list(sizes))))  # read only
            if t is None:
                t = mem.compensate(torch.cat(parts), "b", 2, compressor=comp)
            payload, ctx = comp.compress(t, "b")
            comp.on_step(step + 1)
            out.append((t.clone(), [p.clone() for p in payload]))
            mem.update(t, "b", comp, payload, ctx)
        out.append(mem.residuals["b"].clone())
        runs.append(out)
    for a, b in zip(runs[0][:-1], runs[1][:-1]):
        assert _same(a[0], b[0]) and all(_same(x, y) for x, y in zip(a[1], b[1]))
    assert _same(runs[0][-1], runs[1][-1])
    assert sum(gathered_at) >= 5, gathered_at


@pytest.mark.parametrize("sizes", [(5000, 333, 1 << 15, 27503), (0, 17, 1 << 20, 5, 4099), (1 << 18,)])
def test_sample_of_pieces_is_the_sample_of_their_concatenation(sizes: tuple[int, ...]) -> None:
    """gTop-k's floor over a bucket's pieces samples the same lines of the sum as over the
    flattened bucket (``sample_lines_pieces``), lines that straddle two pieces included."""
    from adacomp.compressors import _native
    from adacomp.compressors.sparse import sample_lines, sample_lines_pieces
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()})")
    parts = [torch.randn(k, generator=gen(7 + i)) for i, k in enumerate(sizes)]
    r = torch.randn(sum(sizes), generator=gen(3))
    got = sample_lines_pieces(parts, r)
    assert got is not None and torch.equal(got, sample_lines(torch.cat(parts), plus=r))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaNs in the same places."""
    return a.dtype == b.dtype and a.shape == b.shape and bool((a.view(-1).view(torch.uint8) == b.view(-1).view(torch.uint8)).all()) \
        if a.dtype.is_floating_point else torch.equal(a, b)


def _fused_and_separate_agree(make: Any, grads: list[torch.Tensor], fuses: bool,
                              kept_at: Any = None) -> None:
    """Residual memory through ``make()``'s compressor with its fused compensation (``compensate_into``)
    and with the plain add: the compensated tensors, the payloads and the last residual are bitwise
    equal, and what the fused pass found (where it ran: ``fuses``; ``kept_at(comp, step)``: at which
    steps) the selection took."""
    from adacomp import memories
    runs = []
    for fused in (True, False):
        comp, mem = make(), memories.get("residual")
        if not fused:  # the plain add (no residual left to the pass either), then the selection's own read
            comp.compensate_into = lambda *a: False
            comp.defer_residual = lambda *a: None
        out = []
        for step, g in enumerate(grads):
            runs_now = kept_at(comp, step) if kept_at is not None else step > 0  # step 0: no residual
            t = mem.compensate(g.clone(), "w", 2, compressor=comp)
            assert ("w" in comp._kept()) == (fused and fuses and runs_now)
            payload, ctx = comp.compress(t, "w")
            assert "w" not in comp._kept()  # taken by the selection
            out.append((t.clone(), [p.clone() for p in payload]))
            mem.update(t, "w", comp, payload, ctx)
        out.append(mem.residuals["w"].clone())
        runs.append(out)
    for a, b in zip(runs[0][:-1], runs[1][:-1]):
        assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert torch.equal(runs[0][-1], runs[1][-1])


@pytest.mark.parametrize("hint", ["sampled", "above", "below"])
def test_dgc_momentum_pass_compacts_the_candidates_of_its_selection(hint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DGC memory's momentum correction lets DGC compact its candidates in the same pass
    (``accumulate_into``): the velocities, the payloads, the sampling generator and the memory are
    bitwise those of the separate pass and selection, whatever the floor's hint says (``above``:
    every threshold below it, read whole; ``below``: far more candidates than the guess)."""
    from adacomp import memories
    from adacomp.compressors import _native, dgc
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()}): the fused pass needs it")
    if hint != "sampled":
        monkeypatch.setattr(dgc, "sampled_value", lambda *a, **k: 1e30 if hint == "above" else 1e-30)
    shapes = [(1 << 17,), (300, 700), (5000,)]  # the last is below the fused pass's size
    grads = [[torch.randn(s, generator=gen(40 + 3 * i + j)) for j, s in enumerate(shapes)] for i in range(4)]
    runs = []
    for fused in (True, False):
        comp, mem = compressors.get("dgc", density=0.01), memories.get("dgc")
        if not fused:
            comp.accumulate_into = lambda *a, **k: False
        out = []
        for step, gs in enumerate(grads):
            for j, g in enumerate(gs):
                name = f"w{j}"
                t = mem.compensate(g.clone(), name, 2, compressor=comp)
                if fused and step > 0:
                    assert (name in comp._kept()) == (g.numel() >= dgc.FUSED_MIN_NUMEL)
                payload, ctx = comp.compress(t, name)
                out.append((t.clone(), [p.clone() for p in payload]))
                mem.update(t, name, comp, payload, ctx)
        state = mem.state_dict()
        runs.append((out, {k: {n: v.clone() for n, v in d.items()} for k, d in state.items() if isinstance(d, dict)},
                     comp.state_dict()["generators"]["cpu"].clone()))
    (out_a, mem_a, gen_a), (out_b, mem_b, gen_b) = runs
    for (t_a, p_a), (t_b, p_b) in zip(out_a, out_b):
        assert torch.equal(t_a, t_b) and all(torch.equal(x, y) for x, y in zip(p_a, p_b))
    assert mem_a.keys() == mem_b.keys() and all(torch.equal(mem_a[k][n], mem_b[k][n]) for k in mem_a for n in mem_a[k])
    assert torch.equal(gen_a, gen_b)


@pytest.mark.parametrize("values", ["normal", "scaled_rows", "mostly_zero", "ties", "nan"])
def test_dgc_choice_in_one_call_is_the_chain_of_calls(values: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DGC's choice in one C call (``_native.dgc_choose``: the sampled threshold, the adaptation
    loop, the pick from the momentum pass's candidates or from the tensor, the second top-k) gives
    the payloads, velocities and generator state of the chain of calls it stands for, on tensors with
    and without candidates, values that adapt the threshold (small tensors' 200-value samples), pass
    far more than its first buffers hold (mostly zeros: a threshold of 0), cut ties and send more than
    1.3 k (``ties``) or hold a NaN (where it declines and the chain answers); it answers most choices."""
    from adacomp import memories
    from adacomp.compressors import _native, dgc
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()}): the one call needs it")
    answered = []
    one_call = _native.dgc_choose
    monkeypatch.setattr(_native, "dgc_choose", lambda *a, **k: answered.append(one_call(*a, **k)) or answered[-1])

    def grad(shape: tuple[int, ...], seed: int) -> torch.Tensor:
        g = torch.randn(shape, generator=gen(seed))
        if values == "scaled_rows":
            g.view(-1)[: g.numel() // 3] *= 1000.0
        elif values == "mostly_zero":
            g.view(-1)[torch.rand(g.numel(), generator=gen(seed + 1)) < 0.995] = 0.0
        elif values == "ties":
            g = g.round()
        elif values == "nan" and seed % 2:
            g.view(-1)[seed % g.numel()] = float("nan")
        return g
    # the small ones below the momentum pass's compaction, their 200-value samples often adapting the threshold
    shapes = [(1 << 17,), (3000,), (2500,), (4000,), (1200,), (300, 700)]
    runs = []
    for one in (True, False):
        monkeypatch.setattr(dgc.NativeChoice, "on", one)
        comp, mem = compressors.get("dgc", density=0.01, seed=3), memories.get("dgc")
        out = []
        for step in range(4):
            for j, s in enumerate(shapes):
                t = mem.compensate(grad(s, 10 * step + j), f"w{j}", 2, compressor=comp)
                payload, ctx = comp.compress(t, f"w{j}")
                out.append([p.clone() for p in payload])
                mem.update(t, f"w{j}", comp, payload, ctx)
            comp.on_step(step + 1)
        runs.append((out, {n: v.clone() for n, v in mem.state_dict()["velocity"].items()},
                     comp.state_dict()["generators"]["cpu"].clone()))
    (out_a, vel_a, gen_a), (out_b, vel_b, gen_b) = runs

    def same(x: torch.Tensor, y: torch.Tensor) -> None:  # bitwise, a NaN equal to itself
        assert x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    assert len(out_a) == len(out_b) and all(len(a) == len(b) for a, b in zip(out_a, out_b))
    for a, b in zip(out_a, out_b):
        for x, y in zip(a, b):
            same(x, y)
    assert vel_a.keys() == vel_b.keys()
    for n in vel_a:
        same(vel_a[n], vel_b[n])
    assert torch.equal(gen_a, gen_b)
    assert sum(a is not None for a in answered) >= len(answered) // 2 > 0


@pytest.mark.parametrize("kind", ["topk", "gaussiank", "efsignsgd", "sidco"])
def test_compensation_selects_span_by_span_for_a_communicator_of_parts(kind: str) -> None:
    """A communicator that compresses a tensor in parts (``alltoall``: ``Communicator.pieces``) lets
    the compressor select while it writes each part's sum; a part too small for that gets the plain
    add among parts that take it. The sum, each part's payload and the next residual are bitwise
    those of the plain add followed by each part's own selection."""
    from adacomp import communicators, memories
    from adacomp.compressors import _native
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()}): the fused pass needs it")
    n = (1 << 17) + 3000  # part 0 takes the fused pass, part 1 (3000 elements) is too small for it
    spans = [("w/part0", 0, 1 << 17), ("w/part1", 1 << 17, n)]
    assert communicators.get("alltoall").pieces("w", 10, 3) == [("w/part0", 0, 4), ("w/part1", 4, 7),
                                                                 ("w/part2", 7, 10)]
    grads = [torch.randn(n, generator=gen(30 + i)) for i in range(3)]
    runs = []
    for pieces in (spans, []):  # [] : nobody said how it is compressed, the plain add
        comp = compressors.get(kind, density=0.01) if kind != "efsignsgd" else compressors.get(kind)
        mem = memories.get("residual")
        out = []
        for step, g in enumerate(grads):
            t = mem.compensate(g.clone(), "w", 2, compressor=comp, pieces=pieces)
            if pieces and step > 0 and (kind == "topk" or _native.sums_like_torch()):
                kept = comp._kept()  # EF-SignSGD's and SIDCo's passes have no size limit: part 1 too
                assert "w/part0" in kept and ("w/part1" in kept) == (kind in ("efsignsgd", "sidco"))
            flat = t.reshape(-1)
            parts = [comp.compress(flat[lo:hi], key) for key, lo, hi in spans]
            out.append((t.clone(), [[p.clone() for p in payload] for payload, _ in parts]))
            for (payload, ctx), (key, lo, hi) in zip(parts, spans):
                comp.residual(flat[lo:hi], payload, ctx, flat[lo:hi])  # alltoall's joined residual
            mem.residuals = {"w": t.clone()}
        runs.append(out)
    for (t_a, p_a), (t_b, p_b) in zip(*runs):
        assert torch.equal(t_a, t_b)
        assert all(torch.equal(x, y) for pa, pb in zip(p_a, p_b) for x, y in zip(pa, pb))


def test_topk_compensation_and_prefilter_share_one_pass() -> None:
    """Residual memory lets Top-k write ``g + r`` and collect the prefilter's candidates in the same
    pass (``compensate_into``): the compensated tensor, the payload and the new residual are bitwise
    those of the separate add and selection; a tensor changed in between is selected afresh."""
    from adacomp import memories
    from adacomp.compressors import _native
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()}): the fused pass needs it")
    shape = (512, 700)
    g0, g1 = torch.randn(shape, generator=gen(20)), torch.randn(shape, generator=gen(21))
    _fused_and_separate_agree(lambda: compressors.get("topk", density=0.01), [g0, g1, g0 * 3], True)
    comp, mem = compressors.get("topk", density=0.01), memories.get("residual")
    t = mem.compensate(g0.clone(), "w", compressor=comp)
    payload, ctx = comp.compress(t, "w")
    mem.update(t, "w", comp, payload, ctx)
    t = mem.compensate(g1.clone(), "w", compressor=comp)
    t.mul_(-2.0)  # changed after the fused pass: its candidates no longer describe it
    (vals, idx), _ = comp.compress(t, "w")
    assert torch.equal(idx, topk_indices(t.reshape(-1), idx.numel(), Workspace()))
    mem.update(t, "w", comp, [vals, idx], _)
    # a caller that does not say how the result is compressed gets the plain add: no selection to waste
    comp.__dict__.pop("kept", None)
    want = g1 + mem.residuals["w"]
    assert torch.equal(mem.compensate(g1.clone(), "w", compressor=comp, pieces=[]), want)
    assert "w" not in comp._kept()


@pytest.mark.parametrize("choice", ["one_call", "chain"])
def test_sidco_fits_read_the_candidates_of_its_compensation(choice: str, monkeypatch: pytest.MonkeyPatch,
                                                            one_thread: None) -> None:
    """SIDCo's add keeps the elements passing a sampled floor (a little more than its first fit
    passed last time), and the fit's pass (one stage: the selection; more: the second stage's count,
    shifted sum and compaction) reads those where its threshold lies above that floor: the compensated tensors,
    payloads and residuals are bitwise the plain add's and the fit's own passes', over stage changes
    both ways, a heavy-tailed step, a zero step and ties; and the fused run reads the tensor whole
    on fewer steps. ``one_call``: the later stages and the pick in one C call, which says how many
    of its passes read the tensor; ``chain``: the calls it stands for."""
    from adacomp.compressors import _native, sidco
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()}): the fused pass needs it")
    n = 1 << 18
    seen: list[str] = []  # "run" when a run starts (the fused one first), "full" per pass over the tensor
    monkeypatch.setattr(sidco.NativeChoice, "on", choice == "one_call")
    choose = _native.sidco_choose

    def recorded_choice(a: torch.Tensor, *args: Any) -> Any:
        got = choose(a, *args)
        if got is not None and a.numel() == n:
            seen.extend(["full"] * got.reads)
        return got
    monkeypatch.setattr(_native, "sidco_choose", recorded_choice)
    orig = _native.select

    def recorded(a: torch.Tensor, thr: float, mode: str, expected: float = 1.0):
        if a.numel() == n:
            seen.append("full")
        return orig(a, thr, mode, expected)
    monkeypatch.setattr(_native, "select", recorded)
    orig32 = _native.select_signed32

    def recorded32(a: torch.Tensor, thr: float, expected: float = 1.0):  # the later stages' compaction
        if a.numel() == n:
            seen.append("full")
        return orig32(a, thr, expected)
    monkeypatch.setattr(_native, "select_signed32", recorded32)
    tails = _native.tail_sum_keep

    def recorded_tail(a: torch.Tensor, *args: Any, **kw: Any):  # a later stage's one read
        if a.numel() == n:
            seen.append("full")
        return tails(a, *args, **kw)
    monkeypatch.setattr(_native, "tail_sum_keep", recorded_tail)

    def make() -> Any:
        seen.append("run")
        return compressors.get("sidco", density=0.01, adapt_every=2)
    # adapt_every 2 on normal values: one stage (steps 0-1), two (2-3), then three, whose first fit
    # passes ~20 %, too many to keep (candidates declined: full passes, as the plain path's)
    grads = [torch.randn(n, generator=gen(80 + i)) for i in range(14)]
    grads[5] = grads[5] ** 3  # heavy tails
    grads[2] = grads[2].round()  # ties at every threshold, read from the candidates
    grads[9] = torch.zeros(n)
    _fused_and_separate_agree(make, grads, True)
    fused, plain = "".join(x[0] for x in seen).split("r")[1:]
    # every plain step reads it (a later stage whose floor missed, as on the heavy-tailed step after
    # normal ones, reads it again)
    assert len(plain) >= len(grads) and len(fused) <= len(plain) - 3, (fused, plain)


def test_a_search_whose_candidates_fell_short_widens_the_next_floor(monkeypatch: pytest.MonkeyPatch,
                                                                   one_thread: None) -> None:
    """MSTop-k's bisection searches near k among the candidates error feedback's add kept above a
    sampled floor; where that floor passed fewer, the search counted below it, a pass over the
    tensor. The next add then aims at twice the share (a speed hint, not state), and the payloads
    stay the plain path's (the add without candidates, the search's own passes)."""
    kind = "mstopk"
    import importlib

    from adacomp import memories
    from adacomp.compressors import _native
    from adacomp.compressors import sparse as S
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()}): the fused pass needs it")
    n = 1 << 18
    k = k_for(n, 0.01)
    shares: list[float | None] = []
    orig = S.compensate_with_stats

    def recorded(comp, g, r, out, name, compact=True, share=None, zeroed=None):
        shares.append(share)
        return orig(comp, g, r, out, name, compact, share, zeroed)
    monkeypatch.setattr(importlib.import_module(f"adacomp.compressors.{kind}"), "compensate_with_stats", recorded)
    sampled = S.sampled_value
    wrong: list[float] = []  # a floor the next sample gives instead of its own (a misjudged tail)
    monkeypatch.setattr(S, "sampled_value", lambda *a, **kw: wrong.pop() if wrong else sampled(*a, **kw))
    fused, plain = compressors.get(kind, density=0.01), compressors.get(kind, density=0.01)
    plain.compensate_into = lambda *a: False
    plain.defer_residual = lambda *a: None  # its residual written: no fused pass on the plain side
    mems = [memories.get("residual"), memories.get("residual")]
    for step in range(5):
        g = torch.randn(n, generator=gen(90 + step))
        if step == 1:  # the first compensated step: a floor that passes k / 2
            x = g + mems[0].residuals["w"]
            wrong.append(float(torch.topk(x.abs(), k // 2).values.min()))
        payloads = []
        for comp, mem in zip((fused, plain), mems):
            t = mem.compensate(g.clone(), "w", 2, compressor=comp)
            payload, ctx = comp.compress(t, "w")
            payloads.append([p.clone() for p in payload])
            mem.update(t, "w", comp, payload, ctx)
        assert all(torch.equal(a, b) for a, b in zip(*payloads)), step
    base = S.search_share(0.01, fused.search_factor)
    assert shares[0] == pytest.approx(base) and shares[1] == pytest.approx(2 * base), shares
    assert "widen" not in str(fused.state_dict())
