"""ShapedBackend: every collective takes at least its emulated alpha + M*beta, results unchanged.

Distributed checks use 2 real gloo processes; only lower bounds on time are asserted (the added
delay is a deterministic sleep, so lower bounds are safe on a loaded machine; upper bounds are not).
Pure bookkeeping (cost formulas, schedules, env parsing) uses a fake clock, no sleeping at all.
"""
from __future__ import annotations

import time

import pytest
import torch

from adacomp.backends.base import LocalBackend
from adacomp.backends.shaped import ShapedBackend, wrap_from_env
from adacomp.errors import ConfigError
from adacomp.netem.schedule import parse_schedule, report_step
from tests._dist import run_workers

ALPHA = 0.03
BETA = 2e-7  # s/byte: 40 kB -> 8 ms


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _shaped_collectives(overlap: bool) -> dict:
    from adacomp.backends.torch_dist import TorchBackend
    inner = TorchBackend(timeout_s=60)
    rank = inner.rank()
    shaped = ShapedBackend(inner, alpha=ALPHA, beta=BETA, overlap=overlap)
    x = torch.arange(10_000, dtype=torch.float32) * (rank + 1)  # 40 kB
    times, same = {}, {}

    ref = inner.allreduce(x.clone())
    out, times["allreduce"] = _timed(lambda: shaped.allreduce(x.clone()))
    same["allreduce"] = torch.equal(out, ref)
    ref = inner.allgather(x[: 100 + rank].clone())
    out, times["allgather"] = _timed(lambda: shaped.allgather(x[: 100 + rank].clone()))
    same["allgather"] = torch.equal(out, ref)
    ref = inner.broadcast(x.clone(), root=1)
    out, times["broadcast"] = _timed(lambda: shaped.broadcast(x.clone(), root=1))
    same["broadcast"] = torch.equal(out, ref)
    out, times["broadcast_object"] = _timed(lambda: shaped.broadcast_object({"r": rank}, root=0))
    same["broadcast_object"] = out == {"r": 0}
    out, times["allgather_object"] = _timed(lambda: shaped.allgather_object(rank))
    same["allgather_object"] = out == [0, 1]
    _, times["barrier"] = _timed(shaped.barrier)

    # Two collectives in flight queue on the one emulated link: waiting both costs >= 2 delays.
    def two() -> bool:
        h1, h2 = shaped.allreduce_async(x.clone()), shaped.allreduce_async(x.clone() * 2)
        return torch.equal(h1.wait() * 2, h2.wait())
    same["two_async"], times["two_async"] = _timed(two)

    # A schedule changes alpha between steps; table1 cost charges ring allreduce 2(N-1)alpha.
    sched = parse_schedule({"unit": "step", "events": [{"at": 0, "latency": "10ms"}, {"at": 5, "latency": "60ms"}]})
    shaped2 = ShapedBackend(inner, schedule=sched, cost="table1", overlap=overlap)
    shaped2.set_step(0)
    _, times["sched_step0"] = _timed(lambda: shaped2.allreduce(x.clone()))
    shaped2.set_step(5)
    _, times["sched_step5"] = _timed(lambda: shaped2.allreduce(x.clone()))
    return {"times": times, "same": same, "alpha_after": shaped2.alpha, "collectives": shaped.collectives}


@pytest.mark.parametrize("overlap", [True, False])
def test_collectives_take_at_least_the_emulated_cost_and_results_are_unchanged(overlap):
    nbytes = 10_000 * 4
    for res in run_workers(_shaped_collectives, 2, overlap, timeout=120):
        t, same = res["times"], res["same"]
        assert all(same.values()), same
        assert t["allreduce"] >= ALPHA + nbytes * BETA
        assert t["broadcast"] >= ALPHA + nbytes * BETA
        assert t["allgather"] >= ALPHA + 100 * 4 * BETA
        for op in ("broadcast_object", "allgather_object", "barrier"):
            assert t[op] >= ALPHA, op
        assert t["two_async"] >= 2 * (ALPHA + nbytes * BETA)
        # table1, N=2 ring allreduce: 2(N-1)alpha = 2 alpha (beta = 0 here)
        assert t["sched_step0"] >= 2 * 0.010
        assert t["sched_step5"] >= 2 * 0.060
        assert res["alpha_after"] == pytest.approx(0.060)


# ---------------------------------------------------------------- single process, fake clock
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def _fake(**kw) -> tuple[ShapedBackend, FakeClock]:
    clock = FakeClock()
    return ShapedBackend(LocalBackend(), clock=clock, sleep=clock.sleep, **kw), clock


def test_overlap_lets_compute_hide_the_delay_and_queues_collectives():
    b, clock = _fake(alpha=0.01, beta=1e-6)
    h = b.allreduce_async(torch.zeros(250))  # 1000 bytes -> 0.011 s
    clock.now += 0.05  # "compute" longer than the delay
    h.wait()
    assert clock.slept == []
    h1, h2 = b.allreduce_async(torch.zeros(250)), b.allreduce_async(torch.zeros(250))
    h1.wait()
    h2.wait()
    assert clock.now == pytest.approx(0.05 + 2 * 0.011)
    assert b.added_s == pytest.approx(3 * 0.011)


def test_blocking_mode_sleeps_before_launch():
    b, clock = _fake(alpha=0.02, overlap=False)
    b.broadcast_async(torch.zeros(4))
    assert clock.now == pytest.approx(0.02)


class _Eight(LocalBackend):
    """Reports a world of 8 so the Table I formulas can be checked; runs no collective."""

    def size(self) -> int:
        return 8


def test_table1_costs():
    b, _ = _fake(alpha=1.0, beta=0.5, cost="table1")
    assert b.delay("allreduce", 10) == 0.0  # world of 1: no network in Table I
    b = ShapedBackend(_Eight(), alpha=1.0, beta=0.5, cost="table1")
    assert b.delay("allreduce", 8) == pytest.approx(2 * 7 * 1.0 + 2 * 7 / 8 * 8 * 0.5)
    assert b.delay("allgather", 8) == pytest.approx(3 * 1.0 + 7 * 8 * 0.5)
    assert b.delay("broadcast", 8) == pytest.approx(3 * (1.0 + 8 * 0.5))


def test_schedule_by_seconds_and_bandwidth_emulation():
    sched = parse_schedule({"unit": "seconds", "events": [
        {"at": 0, "bandwidth": "100mbit", "latency": "1ms"},
        {"at": 10, "bandwidth": {0: "20mbit", "all": "1gbit"}, "latency": {1: "50ms"}}]})
    b, clock = _fake(schedule=sched, emulate_bandwidth=True, host=0)
    b.barrier()
    assert (b.alpha, b.beta) == (pytest.approx(0.001), pytest.approx(8 / 100e6))
    clock.now = 11.0
    b.barrier()
    assert (b.alpha, b.beta) == (pytest.approx(0.001), pytest.approx(8 / 20e6))


def test_schedule_follows_the_step_file(tmp_path):
    step_file = str(tmp_path / "step.json")
    sched = parse_schedule({"unit": "epoch", "events": [{"at": 0, "latency": "1ms"}, {"at": 2, "latency": "9ms"}]})
    b, clock = _fake(schedule=sched, step_file=step_file)
    b.barrier()
    assert b.alpha == 0.0  # no progress reported yet: base alpha
    report_step(40, epoch=2, path=step_file)
    clock.now += 1.0
    b.barrier()
    assert b.alpha == pytest.approx(0.009)


def test_wrap_from_env():
    base = LocalBackend()
    assert wrap_from_env(base, {}) is base
    b = wrap_from_env(base, {"ADACOMP_SHAPE_ALPHA": "5ms", "ADACOMP_SHAPE_BANDWIDTH": "1gbit",
                             "ADACOMP_SHAPE_OVERLAP": "0", "ADACOMP_SHAPE_COST": "table1"})
    assert isinstance(b, ShapedBackend)
    assert (b.alpha, b.beta, b.overlap, b.cost) == (0.005, 8e-9, False, "table1")
    with pytest.raises(ConfigError, match="ADACOMP_SHAPE_ALPHA"):
        wrap_from_env(base, {"ADACOMP_SHAPE_ALPHA": "fast"})
    with pytest.raises(ConfigError, match="ADACOMP_SHAPE_BANDWIDTH.*100mbit"):
        wrap_from_env(base, {"ADACOMP_SHAPE_BANDWIDTH": "100mbps"})
    with pytest.raises(ConfigError, match="cost"):
        wrap_from_env(base, {"ADACOMP_SHAPE_ALPHA": "1ms", "ADACOMP_SHAPE_COST": "exact"})


def test_invalid_parameters_name_themselves():
    with pytest.raises(ValueError, match="alpha"):
        ShapedBackend(LocalBackend(), alpha=-1.0)
    with pytest.raises(ValueError, match="beta"):
        ShapedBackend(LocalBackend(), beta=-1.0)
