"""ByteComp: hand-computed timelines (Fig. 2 / Fig. 8 style), Alg. 1 / Alg. 2 against brute force,
empirical models, and the policy routing a real optimizer."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from adacomp.bench.adaptive import random_instance
from adacomp.policies.bytecomp import brute_force, decide, decide_device, decide_offload
from adacomp.policies.timeline import (CPU_AG, DEVICE_A2A, DEVICE_AG, NONE, CostModel, EmpiricalTime,
                                       TensorProfile, _simulate_des, _simulate_fast, simulate,
                                       size_grid)


def _unit_model(dev_comp=1.0, cpu_comp=3.0, dec=0.0, world=2):
    """Times in abstract units: communication time = bytes, compression constant per tensor."""
    return CostModel(world, allreduce=lambda M: M, allgather=lambda M: M, alltoall=lambda M: M,
                     compress={"device": lambda M: dev_comp, "cpu": lambda M: cpu_comp},
                     decompress={"device": lambda M: dec, "cpu": lambda M: dec})


T3 = [TensorProfile(f"T{i}", 3, 2, 1) for i in range(3)]  # compute 2, dense comm 3, compressed comm 1


def test_fig2a_baseline_overlap():
    """No compression: T0's comm hides under T1's compute, T2's is fully exposed."""
    tl = simulate(T3, [NONE] * 3, _unit_model(), record=True)
    assert tl.iteration_s == 11
    assert tl.of(0, "comm") == (2, 5) and tl.of(1, "comm") == (5, 8) and tl.of(2, "comm") == (8, 11)
    assert tl.bubbles == []


def test_fig2b_compress_last_tensor_on_device():
    tl = simulate(T3, [NONE, NONE, DEVICE_AG], _unit_model(), record=True)
    assert tl.of(2, "compress") == (6, 7) and tl.of(2, "comm") == (8, 9)
    assert tl.iteration_s == 9


def test_fig2c_compress_all_on_device_delays_computation():
    """Device compression competes with computation: every compute after it shifts (Reason #1)."""
    tl = simulate(T3, [DEVICE_AG] * 3, _unit_model(dev_comp=2), record=True)
    assert [tl.of(i, "compute") for i in range(3)] == [(0, 2), (4, 6), (8, 10)]
    assert tl.iteration_s == 13 > 11
    assert tl.bubbles == [(5, 8), (9, 12)]


def test_fig2d_cpu_compression_queues_on_the_cpu():
    tl = simulate(T3, [CPU_AG] * 3, _unit_model(), record=True)
    assert [tl.of(i, "compress") for i in range(3)] == [(2, 5), (5, 8), (8, 11)]
    assert [tl.of(i, "compute") for i in range(3)] == [(0, 2), (2, 4), (4, 6)]  # device not delayed
    assert tl.iteration_s == 12


def test_fig2e_mixed_strategy_beats_all_others():
    m = _unit_model()
    mixed = simulate(T3, [NONE, CPU_AG, DEVICE_AG], m, record=True)
    # T1 on the CPU 4-7, comm 7-8; T2 on the device 6-7, comm 8-9 (queued behind T1)
    assert mixed.of(1, "compress") == (4, 7) and mixed.of(2, "comm") == (8, 9)
    best, f = brute_force(T3, m)
    assert f == mixed.iteration_s == 9


def test_decompression_after_backward_on_the_device():
    m = _unit_model(dec=0.5, world=2)  # two payloads to decompress: 1 unit
    tl = simulate(T3, [DEVICE_AG, NONE, NONE], m, record=True)
    # compute 0-2, compress 2-3, compute 3-5, 5-7; T0 comm 3-4; decompress waits for backward (7)
    assert tl.of(0, "decompress") == (7, 8)
    assert tl.iteration_s == max(8, tl.of(2, "comm")[1])


def test_fig8_bubble_and_remove():
    """Fig. 8(a): T0's communication ends before T1 is ready: a bubble; T0 gains nothing."""
    T = [TensorProfile("T0", 1, 1, 0.1), TensorProfile("T1", 2, 4, 0.2), TensorProfile("T2", 2, 1, 0.2)]
    m = _unit_model(dev_comp=0.1)
    tl = simulate(T, [NONE] * 3, m, record=True)
    assert tl.of(0, "comm") == (1, 2) and tl.bubbles == [(2, 5)]
    assert tl.iteration_s == 9
    S = decide_device(T, m)
    assert S[0] == NONE  # ruled out by Remove()
    assert simulate(T, S, m).iteration_s <= 9


def test_fig8c_same_size_prefers_the_later_tensor():
    """Two equal tensors: compressing the one closer to ByteComp's output layer (later in backward)
    helps more, and Alg. 1 tries it first."""
    T = [TensorProfile("T0", 1, 1, 0.1), TensorProfile("T1", 3, 1, 0.3), TensorProfile("T2", 3, 1, 0.3)]
    m = _unit_model(dev_comp=0.5)
    f1 = simulate(T, [NONE, DEVICE_AG, NONE], m).iteration_s
    f2 = simulate(T, [NONE, NONE, DEVICE_AG], m).iteration_s
    assert f2 < f1
    assert decide_device(T, m)[2] == DEVICE_AG


def test_divisible_scheme_timeline():
    T = [TensorProfile("T0", 8, 1, 2)]
    m = CostModel(2, allreduce=lambda M: M, allgather=lambda M: M, alltoall=lambda M: M / 2,
                  compress={"device": lambda M: M / 8, "cpu": lambda M: M},
                  decompress={"device": lambda M: M / 16, "cpu": lambda M: M})
    tl = simulate(T, [DEVICE_A2A], m, record=True)
    # compute 0-1, compress(8)=1: 1-2, alltoall(2)=1: 2-3, middle 2*dec(4)+comp(4) = 0.5+0.5: 3-4,
    # allgather(1)=1: 4-5, decompress 2*dec(4)=0.5: 5-5.5
    assert tl.of(0, "comm1") == (2, 3) and tl.of(0, "middle") == (3, 4)
    assert tl.of(0, "comm2") == (4, 5) and tl.of(0, "decompress") == (5, 5.5)


_random_instance = random_instance  # adacomp bench adaptive draws the same timelines


def test_fast_path_equals_event_simulation():
    for seed in range(150):
        T, m = _random_instance(seed, n=random.Random(seed).randint(1, 10))
        S = [random.Random(seed + 7).choice([NONE, DEVICE_AG, CPU_AG]) for _ in T]
        a, b = _simulate_des(T, S, m, False), _simulate_fast(T, S, m)
        assert a.iteration_s == pytest.approx(b.iteration_s, abs=1e-12)
        assert a.bubbles == pytest.approx(b.bubbles) and a.comm_end == pytest.approx(b.comm_end)


def test_decision_close_to_brute_force_on_random_8_tensor_instances():
    """ByteComp (Alg. 1 + Alg. 2 + refine) vs exhaustive search over {none, device, cpu}^8."""
    gaps = []
    for seed in range(16):
        T, m = _random_instance(seed)
        S, pred = decide(T, m)
        _, best = brute_force(T, m)
        assert pred["plan_s"] >= best - 1e-12
        assert pred["plan_s"] <= min(pred["compress_all_s"], pred["compress_none_s"]) + 1e-12
        gaps.append(pred["plan_s"] / best - 1)
    assert max(gaps) <= 0.05, gaps


def test_alg2_is_optimal_offload_given_alg1():
    """Theorem 1: over every subset of device-compressed tensors moved to the CPU."""
    for seed in range(25):
        T, m = _random_instance(100 + seed, n=6)
        rng = random.Random(seed)
        S = [rng.choice([NONE, DEVICE_AG, DEVICE_AG]) for _ in T]
        got = simulate(T, decide_offload(T, m, S), m).iteration_s
        dev = [i for i, o in enumerate(S) if o == DEVICE_AG]
        best = min(simulate(T, [CPU_AG if i in sub else o for i, o in enumerate(S)], m).iteration_s
                   for r in range(len(dev) + 1) for sub in itertools.combinations(dev, r))
        assert got == pytest.approx(best, rel=1e-12)


def test_empirical_time_and_size_grid():
    f = EmpiricalTime([100, 200, 400], [1.0, 2.0, 3.0])
    assert f(150) == 1.5 and f(400) == 3.0 and f(600) == 4.0 and f(50) == 1.0
    assert EmpiricalTime([100], [2.0])(300) == 6.0
    assert size_grid([5, 5, 7]) == [5, 7]
    g = size_grid(list(range(1, 1000)), points=12)
    assert len(g) <= 12 and g[0] == 1 and g[-1] == 999


def test_large_sizes_are_extrapolated_not_timed():
    """Issue 21: sizes above profile_max_numel are replaced by three points up to it, and the
    model's tail beyond the largest point is the least-squares slope of the larger half."""
    assert size_grid([10, 1000, 100_000_000], max_numel=4096) == [10, 1000, 1024, 2048, 4096]
    f = EmpiricalTime([100, 200, 400, 800, 1600], [1.0, 2.0, 3.0, 5.0, 9.0])
    xs, ys = np.array([400, 800, 1600.0]), np.array([3.0, 5.0, 9.0])
    slope = np.polyfit(xs, ys, 1)[0]
    assert f(2600) == pytest.approx(9.0 + slope * 1000)
    from adacomp import compressors
    from adacomp.policies.timeline import fit_times, measure_compressor
    pts = measure_compressor(compressors.get("topk", density=0.01), [4096, 1 << 16], repeats=3, feedback=True)
    assert [p[0] for p in pts] == [4 * 4096, 4 * (1 << 16)] and all(p[1] > 0 and p[2] > 0 for p in pts)
    c, d = fit_times(pts)
    assert c(4 * 100_000_000) >= c(4 * (1 << 16)) > 0


def test_policy_routes_a_real_optimizer():
    import adacomp
    from adacomp.backends.base import LocalBackend
    from adacomp.models import build
    torch.manual_seed(0)
    model = build("cnn")
    cfg = {"compressor": {"name": "topk", "density": 0.01}, "communicator": {"name": "allgather"},
           "fusion": {"bucket_mb": 0},
           "policy": {"name": "bytecomp", "profile_steps": 4, "repeats": 2, "alpha": 1e-3, "beta": 1e-6}}
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), config=cfg,
                                       backend=LocalBackend())
    pol = opt.policy
    assert all(opt.route_of(n).compressor.name == "none" for n in pol.candidates)  # profiling
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    for _ in range(6):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert set(pol.plan) == set(pol.candidates)
    for name, option in pol.plan.items():
        assert opt.route_of(name).compressor.name == ("none" if option == "none" else "topk")
    assert {"plan_s", "compress_all_s", "compress_none_s", "decision_s"} <= set(pol.predicted)
    # 1 world: nothing travels, so compressing never helps
    assert all(o == "none" for o in pol.plan.values())


def test_policy_config_errors():
    from adacomp.policies.bytecomp import ByteCompPolicy
    for kw in ({"profile_steps": 1}, {"repeats": 0}, {"alpha": -1.0}, {"offload": "maybe"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            ByteCompPolicy(**kw)


def _bytecomp_worker(plan_by_index: list[str] | None) -> dict:
    """2 gloo ranks: the policy decides with divisible + offload on a slow modelled network (or a
    hand-written plan covering every option is applied); routes must follow the plan."""
    import adacomp
    from adacomp.models import build
    from tests.test_allgather import plain
    adacomp.init(backend="torch")
    torch.manual_seed(0)
    model = build("mlp", inputs=32, width=128, depth=3)
    cfg = {"compressor": {"name": "topk", "density": 0.05}, "communicator": {"name": "allgather"},
           "fusion": {"bucket_mb": 0}, "min_numel": 1000,
           "policy": {"name": "bytecomp", "profile_steps": 4, "repeats": 2, "alpha": 1e-4, "beta": 1e-7,
                      "divisible": True, "offload": "on"}}
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(), config=cfg)
    pol = opt.policy
    gen = torch.Generator().manual_seed(adacomp.rank())
    x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    steps(5)
    if plan_by_index is not None:
        pol.apply(opt, {n: plan_by_index[i % len(plan_by_index)] for i, n in enumerate(sorted(pol.candidates))})
    routes = {n: (opt.route_of(n).compressor.name, opt.route_of(n).communicator_spec.name, opt.route_of(n).offload)
              for n in pol.candidates}
    steps(4)
    out = {"plan": dict(pol.plan), "routes": routes, "params": plain(dict(model.named_parameters())),
           "offload_s": sum(h.get("offload_s", 0.0) for h in list(opt.history)[-4:])}
    opt.remove_hooks()
    return out


EXPECTED_ROUTE = {"none": ("none", "allreduce", False), "device+allgather": ("topk", "allgather", False),
                  "cpu+allgather": ("topk", "allgather", True), "device+alltoall": ("topk", "alltoall", False),
                  "cpu+alltoall": ("topk", "alltoall", True)}


@pytest.mark.parametrize("plan", [None, ["none", "device+allgather", "cpu+allgather", "device+alltoall",
                                         "cpu+alltoall"]])
def test_policy_applies_divisible_and_offloaded_plans_on_two_ranks(plan):
    from tests._dist import run_workers
    r0, r1 = run_workers(_bytecomp_worker, 2, plan)
    assert r0["plan"] == r1["plan"] and r0["plan"]
    for name, option in r0["plan"].items():
        assert r0["routes"][name] == EXPECTED_ROUTE[option], (name, option)
    if any(o.startswith("cpu") for o in r0["plan"].values()):
        assert r0["offload_s"] > 0
    for n, p in r0["params"].items():
        assert (p == r1["params"][n]).all(), f"ranks differ on {n} after training under plan {r0['plan']}"
