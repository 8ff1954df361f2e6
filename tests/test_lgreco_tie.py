"""L-GreCo's solver when the budget equals the least possible total error (issue 16): rounding
every layer's error up must not turn that exact tie into "no assignment fits"."""
from __future__ import annotations

import numpy as np
import pytest

from adacomp.policies.lgreco import solve


def test_budget_equal_to_minimum_error_returns_the_most_accurate_choice():
    rng = np.random.default_rng(3)
    L, C = 12, 5
    errors = rng.uniform(0.1, 1.0, (L, C))
    errors[:, 0] = rng.uniform(0.01, 0.05, L)        # choice 0 (the uniform default) is the most accurate
    sizes = rng.uniform(1.0, 2.0, (L, C))
    sizes[:, 0] = 10.0                               # ... and the largest
    budget = float(errors[:, 0].sum())               # the smallest total error there is
    assert solve(errors, sizes, budget) == [0] * L
    assert solve(errors, sizes, budget, steps=7) == [0] * L


def test_tie_prefers_the_smaller_of_equally_accurate_choices():
    errors = np.array([[0.3, 0.3, 0.9], [0.7, 0.2, 0.2]])
    sizes = np.array([[5.0, 4.0, 1.0], [1.0, 3.0, 2.0]])
    assert solve(errors, sizes, 0.5, steps=3) == [1, 2]


def test_budget_below_minimum_error_still_raises():
    errors = np.array([[0.3, 0.4], [0.2, 0.5]])
    with pytest.raises(ValueError, match="smallest possible total error is 0.5"):
        solve(errors, np.ones((2, 2)), 0.4999)
