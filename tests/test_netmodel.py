"""alpha-beta cost model (AR-Topk paper Table I, eq. 4-5) and the online alpha / beta probe."""
from __future__ import annotations

import itertools
import math

import pytest

from adacomp import netmodel as nm
from tests._dist import run_workers

# M = 1 MB, N = 8 (log2 N = 3), alpha = 1 ms, beta = 1 ns/byte (1 GB/s); values worked by hand.
M, N, A, B = 1e6, 8, 1e-3, 1e-9


@pytest.mark.parametrize("fn,expected", [
    (nm.ps, 2e-3 + 2 * 7 * 1e-3),                     # 2a + 2(N-1)Mb
    (nm.ring_allreduce, 14e-3 + 2 * 7 / 8 * 1e-3),   # 2(N-1)a + 2(N-1)/N Mb
    (nm.tree_allreduce, 6e-3 + 6e-3),                # 2a log N + 2 log N Mb
    (nm.broadcast, 3e-3 + 3e-3),                     # a log N + log N Mb
    (nm.allgather, 3e-3 + 7e-3),                     # a log N + (N-1) Mb
])
def test_table_one(fn, expected: float) -> None:
    assert fn(M, N, A, B) == pytest.approx(expected, rel=1e-12)


def test_eq4_and_sparse_allgather() -> None:
    c = 0.1  # Mc = 1e5 bytes -> Mc beta = 1e-4 s
    assert nm.allgather_sparse(M, c, N, A, B) == pytest.approx(3e-3 + 2 * 1e-4 * 7)
    assert nm.artopk_ring(M, c, N, A, B) == pytest.approx(A * (14 + 3) + 1e-4 * (14 / 8 + 3))  # 4a
    assert nm.artopk_tree(M, c, N, A, B) == pytest.approx(3 * A * 3 + 3 * 1e-4 * 3)          # 4b
    # int64 indices with fp32 values: the index bytes double
    assert nm.allgather_sparse(M, c, N, A, B, idx_ratio=2.0) == pytest.approx(3e-3 + 3 * 1e-4 * 7)
    assert nm.best_collective(M, c, N, A, B) == ("allgather", pytest.approx(3e-3 + 1.4e-3))
    assert nm.best_collective(M, c, N, A, B, allowed=("artopk_ring", "artopk_tree"))[0] == "artopk_tree"


def test_single_rank_costs_nothing() -> None:
    assert nm.costs(M, 0.1, 1, A, B) == {"allgather": 0.0, "artopk_ring": 0.0, "artopk_tree": 0.0}


GRID = itertools.product(
    [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 5e-2],             # alpha (s)
    [1 / 1e6, 1 / 1e8, 1 / 1.25e9, 1 / 1e10, 1 / 1e11],  # beta (s / byte)
    [1e3, 1e5, 4.5e7, 1e9],                           # M (bytes)
    [2, 3, 4, 5, 8, 16, 64, 256],                     # N
    [0.1, 0.033, 0.011, 0.004, 0.001],                # c
)


def test_eq5_predicates_match_direct_cost_comparison() -> None:
    checked = 0
    for alpha, beta, m, n, c in GRID:
        t = nm.costs(m, c, n, alpha, beta)
        for pred, fast, slow in ((nm.ring_over_tree, "artopk_ring", "artopk_tree"),
                                 (nm.ring_over_ag, "artopk_ring", "allgather"),
                                 (nm.tree_over_ag, "artopk_tree", "allgather")):
            if math.isclose(t[fast], t[slow], rel_tol=1e-9):
                continue  # exact ties: both sides are right
            assert pred(m, c, n, alpha, beta) == (t[fast] < t[slow]), (pred.__name__, alpha, beta, m, n, c)
            checked += 1
    assert checked > 10000


@pytest.mark.parametrize("n", [3, 4, 8, 64])
def test_eq5_paper_form(n: int) -> None:
    """The paper's alpha/beta < coefficient * Mc form equals the multiplied-out predicate."""
    m, c, beta = 1e7, 0.01, 1e-9
    for coef, pred in ((nm.coefficient_5a(n), nm.ring_over_tree), (nm.coefficient_5b(n), nm.ring_over_ag),
                       (nm.coefficient_5c(n), nm.tree_over_ag)):
        edge = coef * m * c * beta  # alpha at the switching point
        if edge > 0:
            assert pred(m, c, n, 0.9 * edge, beta) and not pred(m, c, n, 1.1 * edge, beta)
    assert nm.coefficient_5a(2) == math.inf  # N = 2: ring and tree latencies are equal, ring wins


def test_fit_recovers_alpha_beta_from_model_timings() -> None:
    alpha, beta, n = 2e-4, 3e-9, 4
    rows, times = [], []
    for fn, size in itertools.product((nm.ring_allreduce, nm.broadcast), (8, 1 << 20)):
        rows.append((fn(size, n, 1.0, 0.0), fn(size, n, 0.0, 1.0)))
        times.append(fn(size, n, alpha, beta))
    a, b = nm.fit_alpha_beta(rows, times)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_probe_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="probe_every"):
        nm.NetworkProbe(probe_every=0)
    with pytest.raises(ValueError, match="ops"):
        nm.NetworkProbe(ops=("alltoall",))


def _probe_worker() -> list[float]:
    import adacomp
    backend = adacomp.init("torch")
    probe = nm.NetworkProbe(probe_every=5, repeats=2)
    got = [probe.maybe_probe(backend, s) for s in range(7)]
    est = probe.last
    return [est.alpha, est.beta, est.overhead_s, float(sum(g is not None for g in got)), probe.total_overhead_s]


def test_probe_agrees_across_ranks() -> None:
    res = run_workers(_probe_worker, 2)
    assert res[0][:2] == res[1][:2], "every rank must hold the same alpha and beta"
    alpha, beta, overhead, probes, total = res[0]
    assert alpha >= 0 and beta >= 0 and alpha + beta > 0
    assert probes == 2  # steps 0 and 5
    assert 0 < overhead <= total
