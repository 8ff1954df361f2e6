"""PowerSGD and ACP-SGD (ACP-SGD paper Alg. 1-2) as pure math.

A world of N ranks is simulated in one process by averaging payloads by hand, in the order the
``allreduce`` communicator uses (compress, single-round memory update, mean, next rounds, multi-round
memory update, decompress). Real collectives are in tests/test_lowrank_dist.py.
"""
from __future__ import annotations

import io

import pytest
import torch

from adacomp import compressors, memories
from adacomp.backends.base import LocalBackend
from adacomp.communicators.allreduce import AllreduceCommunicator
from adacomp.communicators.base import CommEnv, Entry
from adacomp.engine.error_feedback import exchange
from adacomp.compressors._lowrank import orthogonalize
from adacomp.engine.metrics import StepStats

N, M_COLS, R = 64, 48, 4


def step(comps, mems, grads: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """One synchronous step of ``len(comps)`` simulated ranks; returns each rank's output per name."""
    world = len(comps)
    names = list(grads[0])
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for name in names:
        comp = [m.compensate(g[name].clone(), name) for m, g in zip(mems, grads)]
        res = [c.compress(x, name) for c, x in zip(comps, comp)]
        payloads, ctxs = [p for p, _ in res], [c for _, c in res]
        rounds = comps[0].rounds
        if rounds == 1:
            for m, x, c, p, cx in zip(mems, comp, comps, payloads, ctxs):
                m.update(x, name, c, p, cx)
        mean = [sum(ps) / world for ps in zip(*payloads)]
        for r in range(1, rounds):
            res = [c.next_round(r, [t.clone() for t in mean], cx) for c, cx in zip(comps, ctxs)]
            payloads, ctxs = [p for p, _ in res], [c for _, c in res]
            mean = [sum(ps) / world for ps in zip(*payloads)]
        for rank, (m, x, c, cx) in enumerate(zip(mems, comp, comps, ctxs)):
            mine = [t.clone() for t in mean]  # each rank has its own copy of the reduced buffer
            if rounds > 1:
                m.update(x, name, c, mine, cx)
            out[rank][name] = c.decompress(mine, cx)
    for c in comps:
        c.on_step(c.step + 1)
    return out


def make(name: str, world: int, memory: str = "residual", **params):
    return ([compressors.get(name, **params) for _ in range(world)],
            [memories.get(memory) for _ in range(world)])


def low_rank_pair(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randn(n, R, generator=g) for n in (N, M_COLS, M_COLS))
    return a @ b.t(), a @ c.t()  # M of rank R, and a disagreement D in the same column space


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm())


# Recovery of a rank-r matrix ------------------------------------------------------------------
def test_powersgd_recovers_rank_r_matrix_after_first_step():
    m, d = low_rank_pair()
    comps, mems = make("powersgd", 2)
    for _ in range(4):  # ranks disagree (M + D, M - D); their mean M has rank r
        outs = step(comps, mems, [{"w": m + d}, {"w": m - d}])
        assert rel(outs[0]["w"], m) < 1e-4
        assert torch.equal(outs[0]["w"], outs[1]["w"])


def test_acpsgd_recovers_rank_r_matrix_after_warm_start_step():
    """Alg. 1: step 1 projects on a random Q_hat; from step 2 on P_hat / Q_hat span M's spaces."""
    m, d = low_rank_pair()
    comps, mems = make("acpsgd", 2, memory="none")
    errs = [rel(step(comps, mems, [{"w": m + d}, {"w": m - d}])[0]["w"], m) for _ in range(6)]
    assert errs[0] > 0.5
    assert max(errs[1:]) < 1e-4


def test_acpsgd_with_error_feedback_delivers_rank_r_matrix_on_average():
    """Alg. 2: the residual re-sends what step 1 missed, so the running mean of outputs tends to M
    (the EF identity bounds its error by ||E_T|| / T) while single steps are still catching up."""
    m, d = low_rank_pair()
    comps, mems = make("acpsgd", 2)
    total = torch.zeros_like(m)
    for t in range(1, 41):
        total += step(comps, mems, [{"w": m + d}, {"w": m - d}])[0]["w"]
    assert rel(total / 40, m) < 0.02


# Error feedback -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_error_feedback_identity(name):
    """sum_t out_t + mean_i E_i,T == sum_t mean_i M_i,t: nothing is lost, only delayed."""
    g = torch.Generator().manual_seed(1)
    comps, mems = make(name, 2)
    sent = torch.zeros(N, M_COLS, dtype=torch.float64)
    given = torch.zeros_like(sent)
    for _ in range(7):
        grads = [{"w": torch.randn(N, M_COLS, generator=g, dtype=torch.float64)} for _ in range(2)]
        given += (grads[0]["w"] + grads[1]["w"]) / 2
        sent += step(comps, mems, grads)[0]["w"]
    residual = (mems[0].residuals["w"] + mems[1].residuals["w"]) / 2
    torch.testing.assert_close(sent + residual, given)


def test_acpsgd_error_uses_local_approximation_before_aggregation():
    """Alg. 2 lines 5-6: E_t = M_t + E_{t-1} - P_t Q_hat^T with this rank's own P_t."""
    g = torch.Generator().manual_seed(2)
    comps, mems = make("acpsgd", 2)
    grads = [{"w": torch.randn(N, M_COLS, generator=g)} for _ in range(2)]
    q_hat = orthogonalize(comps[0].initial_factor("w", "q", M_COLS, R, grads[0]["w"]))
    step(comps, mems, grads)
    for rank in range(2):
        local = grads[rank]["w"] @ q_hat
        torch.testing.assert_close(mems[rank].residuals["w"], grads[rank]["w"] - local @ q_hat.t())


def test_powersgd_error_is_compensated_minus_global_approximation():
    g = torch.Generator().manual_seed(3)
    comps, mems = make("powersgd", 2)
    grads = [{"w": torch.randn(N, M_COLS, generator=g)} for _ in range(2)]
    outs = step(comps, mems, grads)
    for rank in range(2):
        torch.testing.assert_close(mems[rank].residuals["w"], grads[rank]["w"] - outs[rank]["w"])


# Alternation, bypass, payload sizes ---------------------------------------------------------------
def test_acpsgd_alternates_p_and_q_after_start_iter():
    comp = compressors.get("acpsgd", start_iter=2)
    kinds = []
    for t in range(7):
        payload, ctx = comp.compress(torch.randn(N, M_COLS), "w")
        kinds.append(ctx.kind)
        assert len(payload) == 1
        expected = {"dense": (N, M_COLS), "p": (N, R), "q": (M_COLS, R)}[ctx.kind]
        assert tuple(payload[0].shape) == expected
        comp.decompress(payload, ctx)
        comp.on_step(t + 1)
    assert kinds == ["dense", "dense", "p", "q", "p", "q", "p"]


def test_powersgd_start_iter_sends_dense_in_two_rounds():
    comps, mems = make("powersgd", 2, start_iter=1)
    grads = [{"w": torch.randn(N, M_COLS)} for _ in range(2)]
    outs = step(comps, mems, grads)
    torch.testing.assert_close(outs[0]["w"], (grads[0]["w"] + grads[1]["w"]) / 2)
    payload, ctx = comps[0].compress(torch.randn(N, M_COLS), "w")
    assert tuple(payload[0].shape) == (N, R)


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
@pytest.mark.parametrize("shape,compressed", [((100,), False), ((), False), ((4, 4), False),
                                              ((9, 8), False), ((64, 48), True), ((16, 3, 3, 3), True)])
def test_bypass_rule(name, shape, compressed):
    """Vectors, scalars and matrices with (n + m) r * 2 >= n m travel dense (hook's rule)."""
    comp = compressors.get(name)
    assert comp.compresses(torch.Size(shape)) is compressed
    t = torch.randn(shape)
    payload, ctx = comp.compress(t, "x")
    if not compressed:
        assert payload[0].numel() == t.numel()
        assert comp.payload_bytes(torch.Size(shape)) == 4 * t.numel()
    else:
        assert payload[0].numel() < t.numel()
        assert comp.payload_bytes(torch.Size(shape)) < 4 * t.numel()


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_bypassed_tensors_average_exactly(name):
    comps, mems = make(name, 2)
    grads = [{"b": torch.randn(7), "s": torch.randn(3, 3)} for _ in range(2)]
    outs = step(comps, mems, grads)
    for k in ("b", "s"):
        torch.testing.assert_close(outs[0][k], (grads[0][k] + grads[1][k]) / 2)


def test_min_compression_rate_zero_compresses_small_matrices_exactly():
    comps, mems = make("powersgd", 1, min_compression_rate=0)
    t = torch.randn(4, 4)
    assert comps[0].compresses(t.shape)
    torch.testing.assert_close(step(comps, mems, [{"w": t}])[0]["w"], t)  # r = min(4, n, m) = 4


def test_payload_bytes_are_factor_sizes():
    shape = torch.Size([N, M_COLS])
    assert compressors.get("powersgd").payload_bytes(shape) == (N + M_COLS) * R * 4
    assert compressors.get("acpsgd").payload_bytes(shape) == (N + M_COLS) * R * 4 // 2
    assert compressors.get("powersgd", rank=1000).payload_bytes(shape) == N * M_COLS * 4


# Determinism, orthogonalisation, validation ----------------------------------------------------
def test_initial_factors_identical_across_instances_and_global_rng_untouched():
    before = torch.get_rng_state()
    a, b = compressors.get("powersgd", seed=5), compressors.get("powersgd", seed=5)
    like = torch.zeros(1)
    b.initial_factor("other", "q", 10, 2, like)  # a different first-seen order must not matter
    torch.testing.assert_close(a.initial_factor("w", "q", 10, 2, like), b.initial_factor("w", "q", 10, 2, like))
    assert not torch.equal(a.initial_factor("w", "q", 10, 2, like),
                           compressors.get("powersgd", seed=6).initial_factor("w", "q", 10, 2, like))
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("r", [1, 2, 4])
def test_orthogonalize_gives_orthonormal_columns_and_no_nan_for_zero_columns(r):
    x = torch.randn(30, r, dtype=torch.float64)
    q = orthogonalize(x)
    torch.testing.assert_close(q.t() @ q, torch.eye(r, dtype=torch.float64))
    assert torch.isfinite(orthogonalize(torch.zeros(30, r))).all()
    assert orthogonalize(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_zero_gradient_stays_finite_at_rank_one(name):
    comps, mems = make(name, 2, rank=1)
    for _ in range(3):
        outs = step(comps, mems, [{"w": torch.zeros(N, M_COLS)} for _ in range(2)])
        assert torch.isfinite(outs[0]["w"]).all()


@pytest.mark.parametrize("params,key", [({"rank": 0}, "rank"), ({"rank": 2.5}, "rank"),
                                        ({"min_compression_rate": -1}, "min_compression_rate"),
                                        ({"start_iter": -1}, "start_iter"),
                                        ({"orthogonalization_epsilon": -1.0}, "orthogonalization_epsilon")])
@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_invalid_parameters_name_the_parameter(name, params, key):
    with pytest.raises(ValueError, match=key):
        compressors.get(name, **params)


def test_registered_and_allreduce_compatible():
    assert {"powersgd", "acpsgd"} <= set(compressors.names())
    for name in ("powersgd", "acpsgd"):
        AllreduceCommunicator().check(compressors.get(name))


# State ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_state_round_trip_resumes_bitwise(name):
    g = torch.Generator().manual_seed(4)
    grads = [[{"w": torch.randn(N, M_COLS, generator=g), "b": torch.randn(5, generator=g)}
              for _ in range(2)] for _ in range(6)]
    comps, mems = make(name, 2)
    reference = [step(comps, mems, gs)[0] for gs in grads]

    comps, mems = make(name, 2)
    for gs in grads[:3]:
        step(comps, mems, gs)
    buf = io.BytesIO()
    torch.save([[c.state_dict() for c in comps], [m.state_dict() for m in mems]], buf)
    buf.seek(0)
    cstates, mstates = torch.load(buf, weights_only=True)
    comps, mems = make(name, 2)
    for c, s in zip(comps, cstates):
        c.load_state_dict(s)
    for m, s in zip(mems, mstates):
        m.load_state_dict(s)
    for t, gs in enumerate(grads[3:], start=3):
        out = step(comps, mems, gs)[0]
        for k in out:
            assert torch.equal(out[k], reference[t][k]), (t, k)


# Through the allreduce communicator (a world of one) --------------------------------------------
@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_allreduce_communicator_drives_rounds_with_mixed_and_dense_only_buckets(name):
    comp, mem = compressors.get(name, min_compression_rate=0), memories.get("residual")
    comm = AllreduceCommunicator()
    env = CommEnv(LocalBackend(), StepStats())
    g = torch.Generator().manual_seed(5)
    ref_c, ref_m = make(name, 1, min_compression_rate=0)
    for _ in range(3):
        grads = {"w": torch.randn(N, M_COLS, generator=g), "b": torch.randn(5, generator=g),
                 "c": torch.randn(3, generator=g)}
        buckets = [["w", "b"], ["c"]]  # the second bucket holds only a dense tensor
        outs = {}
        for names in buckets:
            entries = [Entry(n, mem.compensate(grads[n].clone(), n), comp, mem) for n in names]
            outs.update(zip(names, exchange(comm, entries, env)))
        comp.on_step(comp.step + 1)
        expected = step(ref_c, ref_m, [grads])[0]
        for k in grads:
            torch.testing.assert_close(outs[k], expected[k])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("shape,r", [((3072, 768), 4), ((768, 3072), 2), ((300, 70), 8), ((1000, 33), 3),
                                     ((512, 4608), 1), ((600, 300), 8), ((2000, 100), 5)])
def test_factor_products_are_torchs_bits(shape, r, avx2_switch):
    """``M^T P`` and ``M Q`` in one C read of M (or ``M^T P`` by columns), and ``P Q^T`` by the C fma
    chains or in row blocks (the speed paths) give exactly torch's ``matrix.t() @ p``,
    ``matrix @ q`` and ``p @ q.t()`` bit for bit (signed zeros of zero rows included; P and Q as QR
    returns them, column-major), on the call that decides a layout and on the ones after; a held
    output is never rewritten by the next product."""
    from adacomp.compressors import _lowrank as L
    from adacomp.compressors.sparse import Workspace
    g = torch.Generator().manual_seed(sum(shape) + r)
    ws = Workspace()
    held, decided = [], []
    for i in range(3):
        m = torch.randn(*shape, generator=g)
        p = torch.randn(shape[0], r, generator=g)
        if i == 2:
            p = torch.linalg.qr(p, mode="reduced").Q  # column-major, as PowerSGD's P_hat
        p[3] = -0.0  # a dead unit's row
        q = torch.randn(shape[1], r, generator=g)
        m[5] = 0.0  # a row of M that had no gradient
        got = L.transposed_product(m, p)
        assert got.is_contiguous() and torch.equal(got, m.t() @ p)
        qq = torch.linalg.qr(q, mode="reduced").Q if i == 2 else -q
        assert torch.equal(_bits(L.product(m, qq)), _bits(m @ qq))
        if i < 2:  # a row-major Q is decided on its first product (QR's column-major one is never tried)
            decided.append(L._EXACT.get(L._layout("mq", m, qq)))
        out = L.outer_product(p, q, ws)
        assert torch.equal(_bits(out), _bits(p @ q.t()))
        held.append((out, out.clone()))
    assert all(torch.equal(a, b) for a, b in held)
    assert r < 2 or L._EXACT.get(L._layout("tp", m, p)) is not None  # decided here, either way (r 1: torch's mv)
    assert r < 2 or None not in decided


@pytest.mark.parametrize("shape", [(64, 576), (1000, 2048), (300, 70), (40, 769)])
def test_factor_product_takes_the_order_torch_formed(shape, monkeypatch):
    """A layout's first product tries the summation orders of :data:`_native.SEQ_BLOCKS` in turn and
    keeps the first that gave torch's bits (one chain on the EPYC, MKL's 384-term blocks on an
    AVX-512 Xeon); where none did, torch's product stays. Later products take the kept order. An
    all-zero matrix, which every order reproduces, decides nothing; operands the C sums do not
    serve (rank 9) decide on their first call."""
    from adacomp.compressors import _lowrank as L
    from adacomp.compressors import _native
    monkeypatch.setattr(L, "_EXACT", {})
    monkeypatch.setattr(L, "_ORDER", {})
    g = torch.Generator().manual_seed(shape[1])
    m, q, p = torch.randn(*shape, generator=g), torch.randn(shape[1], 4, generator=g), torch.randn(shape[0], 3, generator=g)
    for tag, fast, torch_form, ours in (("mq", _native.mm_seq, lambda: m @ q, lambda: L.product(m, q)),
                                         ("tp", _native.mtm_seq, lambda: m.t() @ p, lambda: L.transposed_product(m, p))):
        other = q if tag == "mq" else p
        key = L._layout(tag, m, other)
        saved = m.clone()
        m.zero_()  # every order gives +0: no decision
        ours()
        assert L._EXACT.get(key) is None
        m.copy_(saved)
        want = torch_form()
        matching = [b for b in _native.SEQ_BLOCKS if torch.equal(_bits(fast(m, other, b)), _bits(want))]
        for _ in range(2):  # the deciding call, then one that takes the decision
            assert torch.equal(_bits(ours()), _bits(want))
        assert L._EXACT[key] == bool(matching)
        assert L._ORDER.get(key) == (matching[0] if matching else None)
    wide = torch.randn(shape[1], 9, generator=g)  # rank 9: no C sums, torch's product in every order
    L.product(m, wide)
    assert L._EXACT[L._layout("mq", m, wide)] is True  # decided on the first call, not re-decided on each


def test_factor_product_layout_judged_different_uses_torch(monkeypatch):
    """A layout where the fast form did not give torch's bits (another BLAS) keeps torch's product;
    a non-finite first input decides nothing."""
    from adacomp.compressors import _lowrank as L
    m, p = torch.randn(500, 40), torch.randn(500, 4)
    monkeypatch.setattr(L, "_EXACT", {L._layout("tp", m, p): False})
    calls = []
    monkeypatch.setattr(torch, "mv", lambda *a, **k: calls.append(1))
    assert torch.equal(L.transposed_product(m, p), m.t() @ p) and not calls
    monkeypatch.undo()
    bad = m.clone()
    bad[3, 5] = float("nan")
    monkeypatch.setattr(L, "_EXACT", {})
    L.transposed_product(bad, p)
    assert L._EXACT == {}
