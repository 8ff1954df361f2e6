"""The CPU fast paths of ADTopk / ADTopk-i / ADTopk-t select exactly what the plain calls select.

* ``fast_row_topk`` equals a straightforward per-row ``torch.topk`` selection (written out here),
  index set for index set, on Gaussian, heavy-tailed, tied, NaN / inf, fp16 / bf16 and mostly-zero
  data, for ``rows`` and ``dim1`` splits and every candidate strategy (block gather, mask, and
  the C row maxima with the compare on |x|).
* the three compressors give the same payloads and state as copies with the fast paths switched
  off, over consecutive calls (ADTopk-t's warm-up, re-estimation and threshold reuse included).
* payloads are fresh: a later call never rewrites or shares the storage of an earlier payload.
"""
from __future__ import annotations

import pytest
import torch

import adacomp.compressors._rowtopk as rowtopk
import adacomp.compressors.adtopk as adtopk
from adacomp import compressors
from adacomp.compressors.sparse import Workspace


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make(kind: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    n = torch.Size(shape).numel()
    g = gen(seed)
    x = torch.randn(n, generator=g)
    if kind == "t3":  # heavy tails: Student t with 3 degrees of freedom
        x = x / ((torch.randn(3, n, generator=g) ** 2).sum(0) / 3).sqrt()
    elif kind == "ties":
        x = torch.randint(-4, 5, (n,), generator=g).float()
    elif kind == "nan":
        x[torch.randint(n, (max(1, n // 4000),), generator=g)] = float("nan")
        x[torch.randint(n, (max(1, n // 4000),), generator=g)] = float("inf")
    elif kind == "rowscale":  # rows of very different scale (the case ADTopk is for)
        x = (x.view(shape[0], -1) * torch.exp(3 * torch.randn(shape[0], 1, generator=g))).reshape(-1)
    elif kind == "sparse":
        x = x * (torch.rand(n, generator=g) < 0.002)
    elif kind == "zerocols":  # a ReLU layer's weight gradient: ~75 % of the columns exactly zero
        cols = torch.Size(shape)[1:].numel()
        x = (x.view(shape[0], cols) * (torch.rand(cols, generator=g) < 0.25)).reshape(-1)
    elif kind == "grid":  # values on a grid of 1/256: a few rows tie at their cut, most do not
        x = (x * 256).round() / 256
    elif kind == "deadrows":  # dead units: about half the rows all zero (+0 and -0), as VGG-16's fc6
        x = x.view(shape[0], -1)
        x[torch.rand(shape[0], generator=g) < 0.5] = 0.0
        x[::3][x[::3] == 0] = -0.0
        x = x.reshape(-1)
    elif kind == "fp16":
        x = x.half()
    elif kind == "bf16":
        x = (x * 4).round().bfloat16()  # coarse: many ties
    return x.view(shape)


def plain_row_selection(x: torch.Tensor, split: str, density: float) -> set[int]:
    """ADTopk written out: k // M largest |x| per row (at least one), one more in the k mod M rows
    whose next magnitude is largest, each with torch.topk on the materialised (M, N) matrix."""
    m, n, rr = adtopk.matrix_shape(x.shape, split)
    k = max(1, round(density * x.numel()))
    ids = torch.arange(x.numel()).view(m // rr, n, rr).transpose(1, 2).reshape(m, n)
    mag = x.reshape(m // rr, n, rr).transpose(1, 2).reshape(m, n).abs()
    q, r = divmod(k, m)
    if q == 0:
        q, r = 1, 0
    if r == 0:
        cols = torch.topk(mag, q, dim=1, sorted=False).indices
        return set(ids.gather(1, cols).reshape(-1).tolist())
    vals, cols = torch.topk(mag, q + 1, dim=1, sorted=True)
    extra = torch.topk(vals[:, q], r, sorted=False).indices
    chosen = set(ids.gather(1, cols[:, :q]).reshape(-1).tolist())
    return chosen | set(ids[extra, cols[extra, q]].tolist())


CASES = [  # (shape, split, density): block gather (long rows, small q) and mask (others)
    ((64, 4096), "rows", 0.001), ((64, 4096), "rows", 0.01), ((300, 700), "rows", 0.05),
    ((512, 512), "rows", 0.1), ((48, 64, 3, 3), "dim1", 0.02), ((32, 96, 5, 5), "rows", 0.01),
    ((128, 2048, 1, 1), "dim1", 0.002),
]


@pytest.mark.parametrize("kind", ["gauss", "t3", "ties", "nan", "rowscale", "sparse", "zerocols", "deadrows", "grid",
                                  "fp16", "bf16"])
@pytest.mark.parametrize("shape,split,density", CASES)
def test_fast_row_topk_equals_plain_per_row_topk(monkeypatch, kind, shape, split, density):
    monkeypatch.setattr(rowtopk, "ROW_MIN_NUMEL", 0)  # small tensors keep the tests fast
    x = make(kind, shape, seed=len(kind) * 1000 + sum(shape))
    m, n, rr = adtopk.matrix_shape(x.shape, split)
    k = max(1, round(density * x.numel()))
    got = adtopk.fast_row_topk(x, m, n, rr, k, Workspace())
    if got is None:  # more than 1/8 of the tensor ties at the floor: the caller runs the plain torch.topk
        assert kind in ("ties", "bf16")
        return
    idx, fallback_rows = got.idx, got.exact
    assert idx.dtype == torch.int64 and idx.unique().numel() == idx.numel() == max(k, m)
    assert set(idx.tolist()) == plain_row_selection(x, split, density)
    assert bool((idx[1:] > idx[:-1]).all())  # ascending: the C sparse mean takes such payloads in one pass
    if kind in ("gauss", "t3", "rowscale"):  # (fp16 rows of 4096 tie now and then)
        assert fallback_rows == 0  # no ties at the row boundaries: the fast path chose everything
    if kind in ("ties", "nan"):
        assert fallback_rows > 0  # ... and here torch.topk's tie / NaN choices were kept


@pytest.mark.parametrize("kind", ["gauss", "ties", "nan", "zerocols", "fp16"])
def test_row_order_statistics_in_c_give_the_sorts_selection(monkeypatch, kind):
    """Each row's v[q-1], v[q], v[q+1] by quickselects in C (candidates grouped by row) give the same
    indices, in the same order, with the same fallback rows as the integer sort of all candidates."""
    monkeypatch.setattr(rowtopk, "ROW_MIN_NUMEL", 0)
    from adacomp.compressors import _native
    monkeypatch.setattr(_native, "row_finish", lambda *a, **kw: None)  # the sequence it replaces, here
    real, used = _native.row_order_stats, []
    for shape, split, density in CASES:
        x = make(kind, shape, seed=len(kind) * 1000 + sum(shape))
        m, n, rr = adtopk.matrix_shape(x.shape, split)
        k = max(1, round(density * x.numel()))
        monkeypatch.setattr(_native, "row_order_stats", lambda *a: used.append(1) or real(*a))
        fast = adtopk.fast_row_topk(x, m, n, rr, k, Workspace())
        monkeypatch.setattr(_native, "row_order_stats", lambda *a: None)
        sort = adtopk.fast_row_topk(x, m, n, rr, k, Workspace())
        assert (fast is None) == (sort is None)
        if fast is not None:
            assert torch.equal(fast[0], sort[0]) and fast[1] == sort[1], (shape, split, density)
    assert used or kind == "ties"  # the C path ran (with that many ties every case declines before it)


@pytest.mark.parametrize("kind", ["gauss", "t3", "ties", "nan", "rowscale", "sparse", "zerocols", "deadrows", "grid"])
def test_selection_from_the_candidates_in_one_c_call_equals_the_torch_sequence(monkeypatch, kind, avx2_switch):
    """_native.row_finish (each row's order statistics, the r rows taking one more, the kept
    candidates) returns the indices the torch sequence after it returns, in the same order, and
    declines (None: that sequence answers) wherever a row needs torch.topk's own choice."""
    monkeypatch.setattr(rowtopk, "ROW_MIN_NUMEL", 0)
    from adacomp.compressors import _native
    real, answered, tied, signed_tied = _native.row_finish, [], [], []

    def counted(*a, **kw):
        got = real(*a, **kw)
        answered.append(got is not None)
        tied.append(got is not None and got.tied is not None)
        return got

    for shape, split, density in CASES + [((1024, 256), "rows", 0.01), ((64, 576), "rows", 0.01)]:
        x = make(kind, shape, seed=len(kind) * 1000 + sum(shape))
        m, n, rr = adtopk.matrix_shape(x.shape, split)
        k = max(1, round(density * x.numel()))
        monkeypatch.setattr(_native, "row_finish", counted)
        fast = adtopk.fast_row_topk(x, m, n, rr, k, Workspace())
        monkeypatch.setattr(_native, "row_finish", lambda *a, **kw: None)
        slow = adtopk.fast_row_topk(x, m, n, rr, k, Workspace())
        assert (fast is None) == (slow is None)
        if fast is not None:
            assert torch.equal(fast.idx, slow.idx), (shape, split, density)
            # the all-zero rows torch.topk answered one by one come from one pattern in the C call
            assert fast.exact == slow.exact or (kind == "deadrows" and fast.exact < slow.exact)
            if fast.vals is not None:  # the signed candidates' values: the payload's, bit for bit
                assert torch.equal(fast.vals.view(torch.int32), x.reshape(-1)[fast.idx].view(torch.int32))
            if answered and answered[-1] and fast.exact == 0:
                assert set(fast.idx.tolist()) == plain_row_selection(x, split, density)
        # the candidates error feedback's pass finds carry their signed values: the payload's values
        # come from them, and a tied row's from the tensor, spliced in with its indices
        out = torch.empty_like(x)
        known = rowtopk.compensated_candidates(x, torch.zeros_like(x), out, m, n, rr, k) if rr == 1 else False
        if isinstance(known, rowtopk.Candidates) and slow is not None:
            monkeypatch.setattr(_native, "row_finish", counted)
            pick = adtopk.fast_row_topk(out, m, n, rr, k, Workspace(), known=known)
            if pick is not None:  # x + 0.0 only turns -0.0 into +0.0: the same magnitudes, the same picks
                assert torch.equal(pick.idx, slow.idx)
                if pick.vals is not None:  # (None where the torch sequence answered: a NaN row)
                    assert torch.equal(pick.vals.view(torch.int32), out.reshape(-1)[pick.idx].view(torch.int32))
                signed_tied.append(pick.exact > 0 and pick.vals is not None)
    if kind == "grid":  # the tied rows' values spliced in, not the whole payload gathered
        assert True in signed_tied
    if kind in ("gauss", "t3", "rowscale"):
        assert answered and all(answered)  # no ties, no NaN: the one call chose every tensor
    if kind == "deadrows":  # all-zero rows answered where the candidates came from row_candidates
        assert True in answered
    if kind == "grid":  # rows tied at their cut left to torch.topk, the rest chosen in the call
        assert all(answered) and True in tied
    if kind == "nan":
        assert False in answered  # a NaN row goes back to torch.topk


@pytest.mark.parametrize("q", [1, 6, 40, 130, 251])
def test_row_order_statistics_kernel_against_a_sort(q, avx2_switch):
    """ac_row_order_stats' three ranks per row (the (q+2)-th, (q+1)-th and q-th largest magnitude, -1
    where the row has fewer) equal a descending sort of each row's magnitude bits: rows of 1 to 400
    candidates (the AVX2 rank count up to 128; above, one quickselect and the next two ranks from the
    smallest of its front: VGG-16's fc6 has q = 251 and ~350 candidates a row), ties, zeros, inf and
    NaN."""
    from adacomp.compressors import _native
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()})")
    g = gen(q)
    lens = [1, 2, 3, 7, 8, 9, 15, 16, 17, q, q + 1, q + 2, q + 3, 63, 64, 65, 127, 128, 129, 200, 300, 350, 400]
    rows = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lens)])
    mag = torch.randn(rows.numel(), generator=g).abs()
    mag[::5] = torch.randint(0, 3, (mag[::5].numel(),), generator=g).float()  # ties and zeros
    mag[7] = float("inf")
    mag[40] = float("nan")
    got = _native.row_order_stats(mag, rows, len(lens), q, 400)
    assert got is not None
    for i, n in enumerate(lens):
        bits = mag[rows == i].view(torch.int32).sort(descending=True).values  # |x| orders as its bits
        want = [bits[q + 1 - j].item() if 1 <= q + 2 - j <= n else None for j in range(3)]
        have = got.stats[i].view(torch.int32).tolist()
        for j in range(3):
            if want[j] is None:
                assert got.stats[i, j].item() == -1.0, (i, n, j)
            else:
                assert have[j] == want[j], (i, n, j)
        assert got.counts[i].item() == n and bool(got.nan[i]) == bool(torch.isnan(mag[rows == i]).any())


@pytest.mark.parametrize("m,n,blocks", [(200, 768, 32), (90, 3072, 64), (150, 700, 32), (70, 1000, 128), (40, 9, 8)])
def test_row_candidates_with_the_compensation_inside_equal_the_separate_add(m, n, blocks, avx2_switch):
    """_native.row_candidates with error feedback's add inside its row pass (``add=(g, r)``: each row
    summed, streamed and its block maxima taken in one AVX2 loop where the row is 32-byte aligned)
    gives the separate torch.add's sums and, from them, the same floors, candidates, count and NaN
    rows as the call on the summed tensor: rows aligned and not (n % 8), blocks of 8 to 128 lanes."""
    from adacomp.compressors import _native
    if _native.library() is None:
        pytest.skip(f"no C library here ({_native.why_unavailable()})")
    g_ = gen(m + n)
    grad = torch.randn(m, n, generator=g_) * torch.exp(torch.randn(m, 1, generator=g_))
    res = torch.randn(m, n, generator=g_) * 0.1
    grad[3, n // 2] = float("nan")
    q1 = max(1, n // 90)
    fused = torch.empty(m, n)
    got = _native.row_candidates(fused, q1, blocks, 1e-30, 0.05, limit=m * n, add=(grad, res))
    summed = torch.add(grad, res)
    want = _native.row_candidates(summed.clone(), q1, blocks, 1e-30, 0.05, limit=m * n)
    assert got is not None and want is not None
    assert torch.equal(fused.view(torch.int32), summed.view(torch.int32))
    assert got[2] == want[2] > 0 and torch.equal(got[0], want[0]) and torch.equal(got[3], want[3])
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32)) and bool(got[3][3])


def test_both_candidate_strategies_are_used(monkeypatch):
    monkeypatch.setattr(rowtopk, "ROW_MIN_NUMEL", 0)
    used = []
    for fname in ("_by_blocks", "_by_mask", "_by_row_maxima"):
        fn = getattr(rowtopk, fname)
        monkeypatch.setattr(rowtopk, fname, lambda *a, _f=fn, _n=fname, **kw: used.append(_n) or _f(*a, **kw))
    for shape, split, density in CASES:
        x = make("gauss", shape, 1)
        m, n, rr = adtopk.matrix_shape(x.shape, split)
        adtopk.fast_row_topk(x, m, n, rr, max(1, round(density * x.numel())), Workspace())
    assert {"_by_blocks", "_by_mask", "_by_row_maxima"} <= set(used)


def plain(name: str, **kw):
    """The same compressor with every CPU fast path switched off (the plain torch calls)."""
    c = compressors.get(name, **kw)
    c.fast_cpu = False
    return c


def payload_set(payload) -> dict[int, int]:
    vals, idx = payload
    bits = vals.float().view(torch.int32).tolist()  # bitwise: NaN compares equal to itself here
    return dict(zip(idx.tolist(), bits))


def assert_same_topk(fast: dict[int, int], slow: dict[int, int], where) -> None:
    """Equal selections, except which of the elements tied at the k-th magnitude were kept:
    torch.topk leaves that choice unspecified and the fast path keeps the lowest indices."""
    if fast == slow:
        return
    assert len(fast) == len(slow), where
    mag = lambda bits: abs(torch.tensor(bits, dtype=torch.int32).view(torch.float32).item())  # noqa: E731
    assert all(fast[i] == slow[i] for i in fast.keys() & slow.keys()), where
    kth = min(mag(b) for b in slow.values())
    only = [fast[i] for i in fast.keys() - slow.keys()] + [slow[i] for i in slow.keys() - fast.keys()]
    assert all(mag(b) == kth for b in only), (where, kth, [mag(b) for b in only])
    assert min(mag(b) for b in fast.values()) == kth, where


@pytest.mark.parametrize("kind", ["gauss", "ties", "nan", "fp16"])
@pytest.mark.parametrize("name,extra", [("adtopk", {}), ("adtopk", {"split": "dim1"}), ("adtopk_i", {}),
                                        ("adtopk_t", {"sigma": 3, "tau": 2, "total_iters": 12}),
                                        ("adtopk_t", {"sigma": 2, "tau": 1, "interleave": False})])
def test_compressors_equal_their_plain_twins_over_steps(monkeypatch, kind, name, extra):
    monkeypatch.setattr(rowtopk, "ROW_MIN_NUMEL", 0)
    fast, slow = compressors.get(name, density=0.01, **extra), plain(name, density=0.01, **extra)
    base = make(kind, (96, 2048), 5)
    for step in range(12):
        scale = [1.0, 1.0, 1.03, 2.0, 1.0, 0.5][step % 6]
        noise = 0.0 if kind == "ties" else 0.01  # ties stay exact ties from step to step
        x = (base.float() * scale + noise * make("gauss", (96, 2048), 100 + step)).to(base.dtype)
        for c in (fast, slow):
            c.on_step(step)
        for lname in ("a", "b"):
            pf, _ = fast.compress(x, lname)
            ps, _ = slow.compress(x, lname)
            assert_same_topk(payload_set(pf), payload_set(ps), (step, lname))
        assert repr(fast.state_dict()) == repr(slow.state_dict())  # repr: NaN thresholds equal too
        assert getattr(fast, "last_action", None) == getattr(slow, "last_action", None)


@pytest.mark.parametrize("name", ["adtopk", "adtopk_i", "adtopk_t"])
def test_consecutive_payloads_are_fresh(name):
    """Scratch buffers are reused inside the compressor; payloads and outputs never are."""
    c = compressors.get(name, density=0.01, **({"sigma": 1} if name == "adtopk_t" else {}))
    x1 = torch.randn(512, 1024, generator=gen(7))  # 2^19: the fast paths are on
    x2 = torch.randn(512, 1024, generator=gen(8))
    outs = []
    for step in range(4):  # covers ADTopk and Top-k (adtopk_i), ADTopk and reuse (adtopk_t)
        c.on_step(step)
        p1, ctx1 = c.compress(x1, "w")
        keep = [t.clone() for t in p1]
        p2, _ = c.compress(x2, "w")
        for a in p1:
            for b in p2:
                assert a.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        assert all(torch.equal(a, b) for a, b in zip(p1, keep))
        out = c.decompress(p1, ctx1)
        assert torch.equal(out.reshape(-1)[p1[1]], p1[0])
        outs.append(out)
    assert len({o.untyped_storage().data_ptr() for o in outs}) == len(outs)  # held outputs not reused
    assert not any("workspace" in str(key) for key in c.state_dict())


def test_large_tensor_takes_the_fast_path_through_the_compressor(monkeypatch):
    """At the default size gate (no patching) the compressor's answer comes from fast_row_topk."""
    calls = []
    orig = adtopk.fast_row_topk
    monkeypatch.setattr(adtopk, "fast_row_topk", lambda *a: calls.append(orig(*a)) or calls[-1])
    x = make("t3", (1024, 2048), 3)
    (vals, idx), _ = compressors.get("adtopk", density=0.001).compress(x, "w")
    assert calls and calls[0] is not None and calls[0][1] == 0
    assert set(idx.tolist()) == plain_row_selection(x, "rows", 0.001)
    assert torch.equal(vals, x.reshape(-1)[idx])


@pytest.mark.parametrize("runs", [1, 3, rowtopk.MERGE_RUNS + 5])
def test_merge_ascending_is_the_sort_of_the_union(runs):
    """Tied rows' indices spliced into the fast path's ascending payload: the sort of the union,
    with extra runs at the start, in between and at the end (and past MERGE_RUNS, the sort itself);
    with values beside the indices, those values in the same order."""
    g = gen(runs)
    pool = torch.randperm(100_000, generator=g)
    ordered = torch.sort(pool[:5000]).values
    extra = pool[5000:5000 + 40 * runs]
    for case in (ordered, ordered[:0], ordered[:1]):
        for more in (extra, extra[:1], torch.cat([extra, torch.tensor([100_001, 100_002])])):
            got = rowtopk.merge_ascending(case, more)
            assert torch.equal(got, torch.sort(torch.cat([case, more])).values)
            union = torch.cat([case, more])
            idx, vals = rowtopk.merge_ascending(case, more, -case.double(), -more.double())
            assert torch.equal(idx, got) and torch.equal(vals, -got.double())  # each value with its index
    # one tied row of a rows-split matrix: its indices are one run inside the payload
    row = torch.arange(30_000, 30_200)
    kept = ordered[(ordered < 30_000) | (ordered >= 30_200)]
    assert torch.equal(rowtopk.merge_ascending(kept, row.flip(0)), torch.sort(torch.cat([kept, row])).values)


@pytest.mark.parametrize("n", [1024, 2048, 5000, 1 << 17])
@pytest.mark.parametrize("kind", ["gauss", "ties", "nan"])
def test_a_one_dimensional_tensor_is_picked_whole_canonically(n: int, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ADTopk's one-row tensors (ResNet-50's 1024-2048-element norm parameters) below the
    prefilter's size are picked whole in one C call with their values: the canonical top-k
    (largest |x|, ties to the lowest positions, a NaN first) and the tensor's own values, as the
    prefiltered path and torch's give; 2^17 elements take the prefilter, the same set."""
    from adacomp.compressors import _native
    from adacomp.compressors.sparse import largest_k
    whole: list[int] = []
    orig = _native.pick_largest
    monkeypatch.setattr(_native, "pick_largest",
                        lambda mags, idx, k, flat: (whole.append(mags.numel()) if idx is None else None,
                                                    orig(mags, idx, k, flat))[1])
    x = make("gauss", (n,), 7)
    if kind == "ties":
        x = x.round()
    if kind == "nan":
        x[n // 3] = float("nan")
    c = compressors.get("adtopk", density=0.01)
    (vals, idx), _ = c.compress(x.clone(), "w")
    k = max(1, round(0.01 * n))
    mags = torch.where(torch.isnan(x), torch.full_like(x, float("inf")), x.abs())
    want = largest_k(torch.arange(n), mags, k)
    assert torch.equal(idx, want)
    assert torch.equal(vals.view(torch.int32), x[want].view(torch.int32))
    assert_same_topk(payload_set([vals, idx]), payload_set(plain("adtopk", density=0.01).compress(x.clone(), "w")[0]), n)
    assert (n in whole) == (n < 1 << 16 and _native.library() is not None)
