"""adacomp.tools.stepclock: the one step-timing loop (:func:`time_steps`), when two measured methods
count as ordered, and the extra passes that :func:`resolve_close` spends only on the fastest methods
still inside the noise."""
from __future__ import annotations

import math
import statistics
from typing import Any

import pytest

from adacomp.tools.stepclock import StepMeasure, close_methods, resolve_close, time_steps


def test_time_steps_times_only_the_step_after_the_warm_up() -> None:
    """A fake clock: each step takes 1 + its index, sync and after cost 100 outside the timed span."""
    now = [0.0]
    log: list[str] = []
    calls = [0]

    def step() -> None:
        calls[0] += 1
        now[0] += calls[0]
        log.append("step")

    def sync() -> None:
        now[0] += 100
        log.append("sync")

    seen: list[float] = []

    def after(seconds: float) -> None:
        now[0] += 100
        seen.append(seconds)

    times = time_steps(step, 3, 2, sync=sync, after=after, clock=lambda: now[0])
    assert times == [3.0, 4.0, 5.0] and seen == times  # warm-up steps 1 and 2 are not returned
    assert log == ["sync", "step"] * 5  # the barrier before every step, warm-up included
    assert time_steps(step, 0, 1) == [] and calls[0] == 6


def _m(step: float, d: float, n: int = 6) -> StepMeasure:
    """``n`` passes alternating +-d (relative) around ``step``."""
    return StepMeasure(step, 0.0, tuple(step * (1 + d * (-1) ** i) for i in range(n)))


def test_gap_in_standard_errors() -> None:
    a, b = _m(100.0, 0.05), _m(104.0, 0.05)
    se = math.hypot(a.se, b.se)
    assert a.se == pytest.approx(statistics.stdev(a.pass_s) / math.sqrt(6))
    assert a.gap_in_se(b) == pytest.approx(4.0 / se) and b.gap_in_se(a) < 0  # b is the slower one
    assert b.gap_in_se(a) == pytest.approx(-a.gap_in_se(b))  # antisymmetric: the order's verdict is one
    assert a.gap_in_se(_m(104.0, 0.05, n=24)) > a.gap_in_se(b)  # more passes: a smaller standard error
    one = StepMeasure(1.0, 0.0, (1.0,))
    assert one.gap_in_se(StepMeasure(1.1, 0.0, (1.1,))) == math.inf  # no noise estimate: taken as resolved


def test_close_methods_are_the_unresolved_neighbours_among_the_fastest() -> None:
    measured = {"a": _m(50.0, 0.01), "b": _m(60.0, 0.05), "c": _m(61.0, 0.05), "d": _m(90.0, 0.01),
                "e": _m(91.0, 0.01)}
    assert close_methods(measured, top=4) == ["b", "c"]  # a and d are clear of their neighbours
    assert close_methods(measured, top=5) == ["b", "c", "d", "e"]  # d / e: 1% apart, 1% noise
    assert close_methods({"a": _m(50.0, 0.001), "b": _m(60.0, 0.001)}) == []


class _Sampler:
    """Deterministic stand-in for the measuring loop (no collectives involved in the decision):
    every pass of a method lands at its true time +-d, alternating."""

    def __init__(self, true: dict[str, tuple[float, float]], passes: int) -> None:
        self.true = true
        self.passes: dict[str, list[float]] = {m: [] for m in true}
        self.runs: list[list[str]] = []
        for _ in range(passes):
            self.run(list(true))
        self.runs.clear()

    def run(self, methods: list[str], rounds: int = 1) -> None:
        for _ in range(rounds):
            self.runs.append(list(methods))
            for m in methods:
                t, d = self.true[m]
                self.passes[m].append(t * (1 + d * (-1) ** len(self.passes[m])))

    def result(self, m: str) -> StepMeasure:
        p = sorted(self.passes[m])
        return StepMeasure((p[(len(p) - 1) // 2] + p[len(p) // 2]) / 2, 0.0, tuple(self.passes[m]))


def test_resolve_close_adds_passes_only_to_close_methods_until_separated() -> None:
    # b and c are 3% apart with 5% pass-to-pass noise: 6 passes leave them within 2 standard errors
    s: Any = _Sampler({"a": (50.0, 0.01), "b": (60.0, 0.05), "c": (61.8, 0.05), "d": (120.0, 0.01)}, passes=6)
    out = resolve_close(s, ["a", "b", "c", "d"], max_passes=40)
    assert s.runs and all(r == ["b", "c"] for r in s.runs)  # a and d were never re-run
    assert out["b"].gap_in_se(out["c"]) >= 2.0 and len(out["a"].pass_s) == 6
    assert len(out["b"].pass_s) == 6 + len(s.runs) < 6 + 40


def test_resolve_close_stops_at_its_budget_on_a_true_tie() -> None:
    s: Any = _Sampler({"a": (50.0, 0.05), "b": (50.0, 0.05), "bf16": (100.0, 0.01)}, passes=4)
    out = resolve_close(s, ["a", "b", "bf16"], max_passes=3)
    assert len(s.runs) == 3 and len(out["a"].pass_s) == len(out["b"].pass_s) == 7 and len(out["bf16"].pass_s) == 4
    assert resolve_close(s, ["a", "b", "bf16"], max_passes=0)["a"] == out["a"]
