"""MOO compression-ratio choice (AR-Topk §3-E): candidates, Pareto choice, exploration restore."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from adacomp import policies
from adacomp.policies.moo import candidate_densities, choose_density
from tests._dist import run_workers

CANDS = candidate_densities()


def test_candidates_are_the_papers() -> None:
    assert [round(c, 3) for c in CANDS] == [0.1, 0.033, 0.011, 0.004, 0.001]


def _dominated(f: np.ndarray, grid: np.ndarray, tol: float = 1e-3) -> bool:
    """Some grid point is better in every objective by more than ``tol`` (relative to the span)."""
    span = np.maximum(grid.max(axis=0) - grid.min(axis=0), 1e-12)
    return bool(np.any(np.all(grid <= f - tol * span, axis=1)))


@pytest.mark.parametrize("shape", ["tradeoff", "bump", "one_winner"])
def test_choice_lies_on_the_pareto_front(shape: str) -> None:
    cs = np.array(CANDS)
    t_comp = list(1e-3 + 2e-3 * cs)                 # compression time grows with c
    inv_gain = list(1.0 / (1.0 - np.exp(-40 * cs)))  # gain grows with c, so 1/gain falls
    if shape == "one_winner":                        # every objective prefers the largest c
        t_comp = [1e-3] * len(cs)

        def t_sync(c: float) -> float:
            return 0.01
    elif shape == "bump":                            # a dominated region in the middle
        def t_sync(c: float) -> float:
            return 0.02 * c + 0.01 * np.exp(-((np.log10(c) + 2) ** 2) / 0.05)
    else:
        def t_sync(c: float) -> float:
            return 1e-3 + 0.05 * c
    c_opt, X, F = choose_density(list(cs), t_comp, inv_gain, t_sync, pop_size=40, generations=40)
    assert CANDS[-1] <= c_opt <= CANDS[0]
    grid_c = np.logspace(np.log10(CANDS[-1]), np.log10(CANDS[0]), 2001)
    xs = np.log10(cs[::-1])

    def objectives(c: float) -> np.ndarray:
        return np.array([np.interp(np.log10(c), xs, t_comp[::-1]), t_sync(c),
                         np.interp(np.log10(c), xs, inv_gain[::-1])])
    grid = np.stack([objectives(c) for c in grid_c])
    assert not _dominated(objectives(c_opt), grid), (shape, c_opt)
    if shape == "one_winner":
        assert c_opt == pytest.approx(CANDS[0], rel=1e-3)
    if shape == "bump":  # the bump's peak (c = 0.01) is dominated by c slightly below it
        assert not 0.007 < c_opt < 0.014


def test_rejects_bad_range() -> None:
    with pytest.raises(ValueError, match="c_low"):
        policies.get("moo", c_low=0.2, c_high=0.1)


EXPLORE = 2


def _state(opt) -> dict:
    mem = {n: opt.route_of(n).memory.state_dict() for n, _ in opt.params}
    return {"params": [p.detach().numpy().copy() for _, p in opt.params],
            "optim": {k: v["momentum_buffer"].numpy().copy() for k, v in opt.inner.state_dict()["state"].items()},
            "residuals": {n: {k: v.numpy().copy() for k, v in s.get("residuals", {}).items()} for n, s in mem.items()}}


def _moo_worker() -> dict:
    import adacomp
    backend = adacomp.init("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    cfg = {"compressor": {"name": "topk", "density": 0.1}, "memory": {"name": "residual"},
           "communicator": {"name": "artopk"}, "min_numel": 1000,
           "fusion": {"bucket_mb": 25, "fuse_before_compress": True},
           "policy": {"name": "moo", "explore_steps": EXPLORE, "c_high": 0.1, "c_low": 0.001, "factor": 10.0,
                      "pop_size": 16, "generations": 10, "probe_every": 1000}}
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       named_parameters=model.named_parameters(), config=cfg, backend=backend)
    gen = torch.Generator().manual_seed(backend.rank())
    pol = opt.policy

    def step() -> None:
        x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # after this step the policy snapshots and starts exploring
    assert pol.exploring
    before = _state(opt)
    seen = []
    mid = None
    for i in range(EXPLORE * len(pol.candidates)):
        seen.append(opt.compressor_for(opt.params[0][0]).density())
        step()
        if i == 0:  # a checkpoint in the middle of the first candidate's trial
            mid = copy.deepcopy(opt.state_dict())
    assert not pol.exploring
    # resumed from mid-exploration: the trial goes on where it was and ends at the same snapshot
    results = [r["c"] for r in pol.results]
    opt.load_state_dict(mid)
    resumed = {"exploring": pol.exploring, "candidate": pol._cand, "measured": len(pol._acc),
               "density": opt.compressor_for(opt.params[0][0]).density()}
    while pol.exploring:
        step()
    resumed.update(results=[r["c"] for r in pol.results], same_snapshot=_same(before["params"], _state(opt)["params"]))
    # MOO reads the compression gain, so the engine measures it (it does not for other policies)
    assert opt.last_stats.gain is not None and 0.0 < opt.last_stats.gain < 1.0
    after = _state(opt)
    return {"before": before, "after": after, "seen": seen, "candidates": pol.candidates,
            "density": opt.compressor_for(opt.params[0][0]).density(), "decisions": pol.decisions,
            "results": pol.results, "steps": opt.steps, "resumed": resumed, "explored": results}


def _same(a, b) -> bool:
    """Bitwise equality of nested dicts / lists of arrays."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_exploration_restores_bitwise_and_ranks_agree() -> None:
    r0, r1 = run_workers(_moo_worker, 2)
    for r in (r0, r1):
        assert r["seen"] == [c for c in r["candidates"] for _ in range(EXPLORE)]
        for key in ("params", "optim", "residuals"):
            assert _same(r["before"][key], r["after"][key]), key
        assert r["before"]["optim"] and any(r["before"]["residuals"].values())  # something was compared
        assert r["steps"] == 1  # the optimizer's counter is restored too
        assert len(r["results"]) == len(r["candidates"])
        assert r["resumed"] == {"exploring": True, "candidate": 0, "measured": 1, "density": r["candidates"][0],
                                "results": r["explored"], "same_snapshot": True}, r["resumed"]
    assert r0["density"] == r1["density"]  # every rank applies rank 0's choice
    assert r0["decisions"][-1]["c"] == r0["density"]
    assert r0["candidates"][-1] <= r0["density"] <= r0["candidates"][0]


# --- issue 21: the batched t_sync gives the same numbers, so the same decision -------------------
def test_batched_t_sync_makes_the_same_choice() -> None:
    cs = np.array(CANDS)
    t_comp = list(1e-3 + 2e-3 * cs)
    inv_gain = list(1.0 / (1.0 - np.exp(-40 * cs)))

    def t_sync(c: float) -> float:
        return 0.02 * c + 0.01 * np.exp(-((np.log10(c) + 2) ** 2) / 0.05)

    def batch(c: np.ndarray) -> np.ndarray:
        return 0.02 * c + 0.01 * np.exp(-((np.log10(c) + 2) ** 2) / 0.05)

    one = choose_density(list(cs), t_comp, inv_gain, t_sync, pop_size=20, generations=15)
    many = choose_density(list(cs), t_comp, inv_gain, t_sync, pop_size=20, generations=15, t_sync_batch=batch)
    assert one[0] == many[0]
    assert np.array_equal(one[1], many[1]) and np.array_equal(one[2], many[2])


def _predictor_worker() -> list[dict]:
    import adacomp
    backend = adacomp.init("torch")
    out = []
    for fuse in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48),
                                    torch.nn.ReLU(), torch.nn.Linear(48, 4))
        cfg = {"compressor": {"name": "topk", "density": 0.05}, "communicator": {"name": "allgather"},
               "min_numel": 100, "fusion": {"bucket_mb": 0.004, "fuse_before_compress": fuse},
               "policy": {"name": "flexible", "probe_every": 1000, "probe_bytes": 16384}}
        opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                           named_parameters=model.named_parameters(), config=cfg, backend=backend)
        flex = opt.policy
        flex.probe.last = flex.probe.last.__class__(alpha=3e-5, beta=2e-9, overhead_s=0.0, step=0)
        cs = np.concatenate([np.logspace(-3, -1, 37), [0.5 / 3072, 1.5 / 3072, 1.0]])  # rounding halves too
        for switching in (True, False):
            batch = flex.sync_predictor(opt, switching)(cs)
            scalar = np.array([flex.predict_total(opt, float(c), switching) for c in cs])
            out.append({"fuse": fuse, "switching": switching, "buckets": len(opt.buckets),
                        "same": bool(np.array_equal(batch, scalar)), "positive": bool((scalar > 0).all())})
        opt.remove_hooks()
    return out


def test_sync_predictor_equals_predict_total_bitwise() -> None:
    """Real 2-rank world (N = 2 makes the alpha-beta terms non-zero), fused and per-tensor buckets."""
    for rank in run_workers(_predictor_worker, 2):
        assert len(rank) == 4
        for r in rank:
            assert r["same"] and r["positive"], r
        assert rank[0]["buckets"] > 1
