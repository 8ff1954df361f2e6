"""ADTopk / ADTopk-i / ADTopk-t (HPDC'24 §4): rows never missing, interleaving, Alg. 2 transitions."""
from __future__ import annotations

import io

import pytest
import torch

from adacomp import communicators, compressors, memories
from adacomp.compressors.adtopk import LATE, REESTIMATE, REUSE, WARMUP, matrix_shape
from adacomp.errors import IncompatibleComponentsError


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rows_of(shape, split):
    """(M, N) row view of a 0..numel-1 index tensor, for checking selections row by row."""
    m, n, rr = matrix_shape(torch.Size(shape), split)
    ids = torch.arange(torch.Size(shape).numel())
    if rr == 1:
        return ids.view(m, n)
    return ids.view(shape[0], n, rr).transpose(1, 2).reshape(m, n)


@pytest.mark.parametrize("split", ["rows", "dim1"])
@pytest.mark.parametrize("shape,density", [((16, 40), 0.1), ((16, 40), 0.01), ((8, 6, 3, 3), 0.05),
                                           ((8, 6, 3, 3), 0.5), ((32, 7), 0.3), ((500,), 0.02)])
def test_adtopk_takes_the_largest_of_every_row(split, shape, density):
    x = torch.randn(*shape, generator=gen(1))
    c = compressors.get("adtopk", density=density, split=split)
    (vals, idx), ctx = c.compress(x, "w")
    flat = x.reshape(-1)
    assert torch.equal(vals, flat[idx]) and idx.unique().numel() == idx.numel()
    sent = torch.zeros(flat.numel(), dtype=torch.bool)
    sent[idx] = True
    grid = rows_of(shape, split)
    m = grid.shape[0]
    k = max(1, round(density * flat.numel()))
    assert idx.numel() == max(k, m)  # exactly k when k >= M, else one per row
    per_row = sent[grid].sum(1)
    assert int(per_row.min()) >= 1  # no row is missing
    assert int(per_row.max() - per_row.min()) <= 1  # k // M each, remainder spread one by one
    for r in range(m):  # the chosen ones of a row are its largest
        row_sent, row_mag = sent[grid[r]], flat.abs()[grid[r]]
        if row_sent.all() or not row_sent.any():
            continue
        assert row_mag[row_sent].min() >= row_mag[~row_sent].max()
    assert c.compression_stats()["w"] == pytest.approx(c.effective_density(x.shape))
    assert torch.equal(c.decompress([vals, idx], ctx).reshape(-1)[idx], vals)


def test_adtopk_remainder_goes_to_rows_with_largest_next_candidate():
    x = torch.zeros(4, 10)
    x[:, 0] = 10.0
    x[2, 1], x[0, 1], x[1, 1], x[3, 1] = 9.0, 8.0, 1.0, 2.0
    (vals, idx), _ = compressors.get("adtopk", density=0.15).compress(x, "w")  # k = 6 = 4 * 1 + 2
    assert sorted(idx.tolist()) == [0, 1, 10, 20, 21, 30]


def test_adtopk_misses_no_row_where_topk_does():
    x = torch.randn(64, 64, generator=gen(2)) * 0.01
    x[:4] *= 1000  # a few rows hold all large gradients
    t, _ = compressors.get("topk", density=0.01).compress(x, "w")
    a, _ = compressors.get("adtopk", density=0.01).compress(x, "w")
    assert (t[1] // 64).unique().numel() <= 4  # dimension missing (§3.1, Observation #1)
    assert (a[1] // 64).unique().numel() == 64


def test_split_rows_vs_authors_dim1_on_small_fan_in():
    """ResNet conv1: the authors' fibers along dim 1 send a third of the layer; rows keeps k."""
    shape = torch.Size((64, 3, 7, 7))
    assert compressors.get("adtopk", density=0.01, split="dim1").effective_density(shape) == pytest.approx(1 / 3)
    assert compressors.get("adtopk", density=0.01, split="rows").effective_density(shape) == pytest.approx(
        round(0.01 * shape.numel()) / shape.numel())
    with pytest.raises(ValueError, match="split"):
        compressors.get("adtopk", split="columns")


def test_adtopk_i_alternates_all_layers_together():
    c = compressors.get("adtopk_i", density=0.02)
    ad = compressors.get("adtopk", density=0.02)
    tk = compressors.get("topk", density=0.02)
    layers = {"a": torch.randn(50, 20, generator=gen(3)), "b": torch.randn(40, 30, generator=gen(4))}
    for lay in layers.values():
        lay[:2] *= 100  # make Top-k and ADTopk choose differently
    for step in range(6):
        c.on_step(step)
        for name, x in layers.items():
            got = set(c.compress(x, name)[0][1].tolist())
            ref = ad if step % 2 == 0 else tk  # Alg. 1 starts with isAllDimension = True
            assert got == set(ref.compress(x, name)[0][1].tolist()), (step, name)
            assert got != set((tk if step % 2 == 0 else ad).compress(x, name)[0][1].tolist())
    state = c.state_dict()
    d = compressors.get("adtopk_i", density=0.02)
    d.load_state_dict(state)
    assert d.all_dimension() == c.all_dimension()


def scripted(scale: float) -> torch.Tensor:
    """Magnitudes scale * (1..100) with alternating signs: at density 0.1 the k-th largest is 91 * scale."""
    mags = torch.arange(1, 101, dtype=torch.float32) * scale
    signs = torch.tensor([1.0, -1.0]).repeat(50)
    return (mags * signs).view(10, 10)


# (t, scale, expected action, tau after, stable after, number of elements sent)
ALG2_SCRIPT = [
    (1, 1.0, WARMUP, 2, False, 10),     # t < sigma: exact Top-k, thr_reuse = 91
    (2, 1.0, WARMUP, 2, False, 10),
    (3, 1.0, REUSE, 2, False, 9),       # |g| > 91: 92..100
    (4, 1.0, REESTIMATE, 3, True, 10),  # |91 - 91| < eps: tau + 1
    (5, 1.0, REUSE, 3, True, 9),
    (6, 2.0, REUSE, 3, True, 55),       # gradients doubled, old threshold reused: 46..100
    (7, 2.0, REESTIMATE, 2, False, 10),  # |182 - 91| > 2 eps = 36.4: tau - 1
    (8, 2.3, REUSE, 2, False, 21),      # 2.3 * m > 182: m >= 80
    (9, 2.3, REESTIMATE, 2, False, 10),  # |209.3 - 182| in [eps, 2 eps]: tau unchanged
    (10, 2.3, REUSE, 2, False, 9),
    (11, 2.3, REESTIMATE, 3, True, 10),
    (12, 2.3, REUSE, 3, True, 9),       # not late yet: t = 12 is not > 16 * 3/4
    (13, 2.3, LATE, 3, True, 10),       # t > T * 3/4 and stable: ADTopk (one per row)
    (14, 5.0, LATE, 3, True, 10),
]


def test_adtopk_t_follows_alg2_on_a_scripted_sequence():
    c = compressors.get("adtopk_t", density=0.1, tau=2, sigma=3, total_iters=16, interleave=False)
    for t, scale, action, tau, stable, count in ALG2_SCRIPT:
        c.on_step(t - 1)
        x = scripted(scale)
        (vals, idx), _ = c.compress(x, "w")
        st = c.layers["w"]
        assert (c.last_action["w"], st.tau, st.stable, idx.numel()) == (action, tau, stable, count), t
        if action == REUSE:
            assert torch.equal(torch.sort(idx).values, torch.nonzero(x.reshape(-1).abs() > st.thr_reuse).view(-1))
        if action in (WARMUP, REESTIMATE):
            assert st.thr_reuse == pytest.approx(91 * scale) and st.eps == pytest.approx(9.1 * scale)
        if action == LATE:
            assert ((idx // 10).unique().numel()) == 10


def test_adtopk_t_interleaves_and_floors_tau():
    c = compressors.get("adtopk_t", density=0.1, tau=1, sigma=3, interleave=True)
    actions = []
    taus = []
    for t, scale in zip(range(1, 11), [1, 1, 1, 1, 1, 3, 1, 9, 1, 1]):
        c.on_step(t - 1)
        c.compress(scripted(scale), "w")
        actions.append(c.last_action["w"])
        taus.append(c.layers["w"].tau)
    # odd t: ADTopk (Alg. 1); even t: Alg. 2, whose counters only see the even calls
    assert actions == ["adtopk", WARMUP, "adtopk", REESTIMATE, "adtopk", REUSE, "adtopk", REESTIMATE,
                       "adtopk", REESTIMATE]
    assert taus == [1, 1, 1, 2, 2, 2, 2, 1, 1, 1]  # big jumps lower tau, never below tau_min = 1


def test_adtopk_t_state_roundtrip_continues_identically():
    kw = dict(density=0.1, tau=2, sigma=3, total_iters=16, interleave=False)
    a = compressors.get("adtopk_t", **kw)
    for t, scale, *_ in ALG2_SCRIPT[:7]:
        a.on_step(t - 1)
        a.compress(scripted(scale), "w")
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = compressors.get("adtopk_t", **kw)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for t, scale, *_ in ALG2_SCRIPT[7:]:
        outs = []
        for c in (a, b):
            c.on_step(t - 1)
            outs.append(c.compress(scripted(scale), "w")[0][1])
        assert torch.equal(outs[0], outs[1]) and a.last_action == b.last_action


@pytest.mark.parametrize("name", ["adtopk", "adtopk_i", "adtopk_t"])
def test_error_feedback_identity_is_exact(name):
    extra = {"sigma": 2} if name == "adtopk_t" else {}
    mem, c = memories.get("residual"), compressors.get(name, density=0.05, **extra)
    for step in range(6):
        c.on_step(step)
        g = torch.randn(30, 40, generator=gen(10 + step))
        comp = mem.compensate(g, "w")
        payload, ctx = c.compress(comp, "w")
        mem.update(comp, "w", c, payload, ctx)
        assert torch.equal(c.decompress(payload, ctx) + mem.residuals["w"], comp)


def test_fixed_size_flags_match_communicators():
    fast = communicators.get("allgather_fast")
    fast.check(compressors.get("adtopk"))
    fast.check(compressors.get("adtopk_i"))
    with pytest.raises(IncompatibleComponentsError, match="allgather"):
        fast.check(compressors.get("adtopk_t"))
    communicators.get("allgather").check(compressors.get("adtopk_t"))
    with pytest.raises(ValueError, match="tau"):
        compressors.get("adtopk_t", tau=0)
