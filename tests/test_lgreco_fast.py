"""L-GreCo's fast decision pieces (issue 21) against the slow definitions they replace: top-k
tails from a sampled threshold vs a full sort, and the pruned in-place DP vs the plain loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from adacomp.compressors.sparse import k_for
from adacomp.policies.lgreco import SAMPLE, solve, topk_errors, topk_tails


def _sorted_tails(g: torch.Tensor, ks: list[int]) -> dict[int, float]:
    sq = g.double().reshape(-1).square().sort(descending=True).values
    return {k: float(sq[k:].sum()) for k in ks}


def _ks(n: int) -> list[int]:
    return sorted({k_for(n, d) for d in np.arange(0.001, 0.1001, 0.001)} | {n})


def _adversarial(n: int) -> torch.Tensor:
    """Large exactly where the threshold sample looks (same recipe as topk_tails), small elsewhere,
    so the sampled threshold keeps too few elements and the all-non-zeros pass must run."""
    g = torch.full((n,), 0.5)
    idx = torch.randint(0, n, (SAMPLE,), generator=torch.Generator().manual_seed(n))
    g[idx] = 3.0
    return g


CASES = {
    "small": lambda r: torch.randn(1000, generator=r),
    "tiny": lambda r: torch.randn(5, generator=r),
    "zeros": lambda r: torch.zeros(700),
    "dense_above_sample": lambda r: torch.randn(300_000, generator=r) * torch.rand(300_000, generator=r) ** 3,
    "mostly_zero_rows": lambda r: torch.randn(2000, 200, generator=r) * (torch.rand(2000, 1, generator=r) < 0.01),
    "ties": lambda r: torch.randint(-2, 3, (200_000,), generator=r).float(),
    "constant": lambda r: torch.ones(100_000),
    "half": lambda r: torch.randn(150_000, generator=r).half(),
    "fallback": lambda r: _adversarial(1 << 21),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tails_equal_a_full_sort(case: str) -> None:
    g = CASES[case](torch.Generator().manual_seed(7))
    ks = _ks(g.numel())
    got, want = topk_tails(g, ks), _sorted_tails(g.float(), ks)
    scale = max(want[ks[0]], 1e-30)
    assert set(got) == set(ks)
    for k in ks:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9 * scale), (case, k)
    assert got[g.numel()] == 0.0


def test_topk_errors_leave_the_compressor_and_rng_alone() -> None:
    import adacomp.compressors as C
    comp = C.get("topk", density=0.02)
    g = torch.randn(400, 500, generator=torch.Generator().manual_seed(1))
    state = torch.random.get_rng_state()
    errs, sizes = topk_errors(comp, [0.001, 0.02, 0.1, 1.0], g)
    assert torch.equal(state, torch.random.get_rng_state())  # the sample uses its own generator
    assert comp.density() == 0.02
    assert errs == sorted(errs, reverse=True) and errs[-1] == 0.0
    assert sizes == [k_for(g.numel(), d) * 12 for d in (0.001, 0.02, 0.1, 1.0)]


def _plain_dp(err: np.ndarray, size: np.ndarray, budget: float, steps: int) -> list[int] | None:
    """The DP before issue 21 (every choice, full-width temporaries), for identity checks."""
    L, C = err.shape
    unit = budget / steps
    ticks = np.minimum(np.ceil(err / unit - 1e-9), steps + 1).astype(np.int64)
    width = steps + 1
    dp = np.full(width, np.inf)
    choice = np.full((L, width), -1)
    for c in range(C):
        e = ticks[0, c]
        if e < width and size[0, c] < dp[e]:
            dp[e], choice[0, e] = size[0, c], c
    for layer in range(1, L):
        new = np.full(width, np.inf)
        for c in range(C):
            e = ticks[layer, c]
            if e >= width:
                continue
            cand = np.full(width, np.inf)
            cand[e:] = dp[: width - e] + size[layer, c]
            better = cand < new
            new[better] = cand[better]
            choice[layer, better] = c
        dp = new
    if not np.isfinite(dp).any():
        return None
    b = int(np.argmin(dp))
    out = [0] * L
    for layer in range(L - 1, -1, -1):
        out[layer] = int(choice[layer, b])
        b -= int(ticks[layer, out[layer]])
    return out


@pytest.mark.parametrize("seed", range(12))
def test_pruned_dp_picks_what_the_plain_dp_picks(seed: int) -> None:
    """Many choices share a discretised error (small layers) and sizes repeat: same picks."""
    rng = np.random.default_rng(seed)
    L, C = int(rng.integers(2, 12)), int(rng.integers(2, 30))
    scale = rng.choice([1e-3, 1.0, 30.0], size=(L, 1))                 # some layers round to 1-2 ticks
    err = np.sort(rng.random((L, C)), axis=1)[:, ::-1] * scale
    size = np.sort(rng.integers(1, 50, (L, C)), axis=1).astype(float)  # integer bytes, with repeats
    if seed % 2:
        size = size * rng.random((L, 1))                               # the time objective: floats
    steps = int(rng.choice([50, 997, 10_000]))
    budget = float(err[np.arange(L), rng.integers(0, C, L)].sum())
    budget *= 1.0 + L / steps    # room for rounding every layer up: the plain DP finds an answer
    want = _plain_dp(err, size, budget, steps)
    assert want is not None
    assert solve(err, size, budget, steps) == want
