"""L-GreCo's DP at the paper's operating point (issue 32): budget = the total error of the default
assignment (l-greco.txt §3 "The Error Bound", Alg. 1 line 2), on random instances, against brute
force.

"Within the discretisation" means, with u = budget / D (§4, D = ``steps``) and the default d:
the solver returns a least-size plan among those with
``sum_l ceil((error(l, c_l) - error(l, d_l)) / u) <= floor((budget - error(d)) / u)`` (equal to a
brute-force search over that discretised problem); so its real error <= budget, it never sends
more than the default (t = 0 in every layer of the default), and every plan that changes k layers
and has real error <= budget - k u is among the candidates (size <= the brute-force optimum over
those). Before issue 32 errors were rounded up from zero, the default no longer fitted its own
budget, and the DP returned a larger plan than the default on 4 of these 30 instances (seeds 7, 11, 23,
25: e.g. 48.4 vs 41.5 size units) and missed the discretised optimum on 7."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from adacomp.policies.lgreco import solve

SEEDS = range(30)


def _instance(seed: int) -> tuple[np.ndarray, np.ndarray, list[int], int]:
    """Monotone like real compressors (more bytes, less error); some layers tiny next to others."""
    rng = np.random.default_rng(seed)
    L, C = int(rng.integers(2, 7)), int(rng.integers(2, 6))
    size = np.sort(rng.random((L, C)) * 50, axis=1)
    err = np.sort(rng.random((L, C)) * 10, axis=1)[:, ::-1] * rng.choice([1e-3, 1.0], size=(L, 1))
    return np.ascontiguousarray(err), size, rng.integers(0, C, L).tolist(), int(rng.choice([20, 997, 10_000]))


def _plans(L: int, C: int) -> np.ndarray:
    return np.array(list(itertools.product(range(C), repeat=L)))


def _total(m: np.ndarray, plans: np.ndarray) -> np.ndarray:
    return m[np.arange(m.shape[0]), plans].sum(axis=1)


@pytest.mark.parametrize("seed", SEEDS)
def test_default_error_budget_equals_brute_force_and_never_loses_to_the_default(seed: int) -> None:
    err, size, d, steps = _instance(seed)
    L, C = err.shape
    budget = float(err[np.arange(L), d].sum())          # the paper's operating point (alpha = 1)
    pick = solve(err, size, budget, steps, default=d)
    got_size, got_err = size[np.arange(L), pick].sum(), err[np.arange(L), pick].sum()
    assert got_err <= budget * (1 + 1e-12)
    assert got_size <= size[np.arange(L), d].sum() + 1e-9

    plans = _plans(L, C)
    u = budget / steps
    ticks = np.ceil((err - err[np.arange(L), d][:, None]) / u)     # the discretised problem
    fits = _total(ticks, plans) <= math.floor((budget - err[np.arange(L), d].sum()) / u)
    assert got_size == pytest.approx(_total(size, plans)[fits].min(), rel=1e-12)

    real_err, real_size = _total(err, plans), _total(size, plans)
    assert got_size >= real_size[real_err <= budget * (1 + 1e-12)].min() - 1e-9   # no better than exact
    changed = (plans != np.array(d)).sum(axis=1)
    near = real_err <= budget - changed * u                      # found despite the rounding
    assert got_size <= real_size[near].min() + 1e-9


def test_the_default_is_kept_when_nothing_smaller_fits() -> None:
    """Every other choice is larger or less accurate: the answer is the default, also at D = 1."""
    err = np.array([[3.0, 1.0, 0.5], [2.0, 0.7, 0.1]])
    size = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    for steps in (1, 7, 10_000):
        assert solve(err, size, 1.7, steps, default=[1, 1]) == [1, 1]
    # without the default as origin, 1.0 and 0.7 round up past the budget at D = 7 (the old answer)
    assert size[[0, 1], solve(err, size, 1.7, 7)].sum() > 4.0


def test_budget_above_the_default_still_finds_cheaper_plans() -> None:
    err = np.array([[3.0, 1.0, 0.5], [2.0, 0.7, 0.1]])
    size = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    assert solve(err, size, 3.7, 10, default=[1, 1]) == [1, 0]   # alpha > 1: 1.0 + 2.0 <= 3.7
    assert solve(err, size, 0.6, 10, default=[1, 1]) == [2, 2]   # alpha < 1: only 0.5 + 0.1 fits


def test_default_must_name_one_choice_per_layer() -> None:
    err = np.ones((2, 3))
    for bad in ([0], [0, 3], [-1, 0], [0.5, 1]):
        with pytest.raises(ValueError, match="default must hold one choice index"):
            solve(err, err, 2.0, default=bad)
