"""Timing real DDP training steps of several compression methods on one shared machine.

Used by ``adacomp advise`` (its calibration) and ``adacomp bench sweep`` (the measurements advise
is checked against). :func:`time_steps` is the one step-timing loop of the tools and every
benchmark in :mod:`adacomp.bench`. Two facts of a shared machine shape it:

* it drifts by more than the gap between close methods, so methods are timed in *interleaved
  passes* (every method once per pass), and each pass's median is kept: their spread is this
  machine's run-to-run noise (:attr:`StepMeasure.spread`);
* a fixed number of passes either wastes time on methods far apart or cannot order close ones, so
  :class:`StepSampler` keeps every sample and :func:`resolve_close` adds passes only for the
  methods whose measured order is still inside the noise (:func:`close_methods`), chosen from the
  measurements alone.

All functions that take a ``backend`` are collective: call them on every rank with the same
arguments. Decisions use slowest-rank figures that every rank receives alike, so the ranks never
disagree on what to run next.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

ModelFactory = Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]
"""A fresh model and a closure computing its loss on one fixed batch."""


class StepMeasure(NamedTuple):
    """One method's measured step: median seconds (slowest rank) over every pass, mean payload bytes
    per step, and each pass's own median (their spread is the run-to-run noise of this machine)."""

    step_s: float
    sent: float
    pass_s: tuple[float, ...]

    @property
    def spread(self) -> float:
        """Relative standard deviation of the passes' medians: how far two runs of the same arm on
        this machine land apart (0 for a single pass)."""
        if len(self.pass_s) < 2:
            return 0.0
        return statistics.stdev(self.pass_s) / statistics.fmean(self.pass_s)

    @property
    def se(self) -> float:
        """Standard error of the median step (seconds): the passes' standard deviation over the square
        root of their number (0 for a single pass)."""
        if len(self.pass_s) < 2:
            return 0.0
        return statistics.stdev(self.pass_s) / math.sqrt(len(self.pass_s))

    def gap_in_se(self, other: "StepMeasure") -> float:
        """How many standard errors of the difference ``other`` is slower than this one (negative:
        faster). Antisymmetric (``a.gap_in_se(b) == -b.gap_in_se(a)``), so which of two arms is asked
        never changes whether their order counts as resolved. Two single-pass arms have no noise
        estimate: any gap counts as resolved (inf)."""
        diff = other.step_s - self.step_s
        se = math.hypot(self.se, other.se)
        if se == 0.0:
            return math.copysign(math.inf, diff) if diff else 0.0
        return diff / se


def time_steps(step: Callable[[], object], steps: int, warmup: int = 0, *, sync: Callable[[], object] | None = None,
               after: Callable[[float], object] | None = None, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """The one step-timing loop: ``warmup`` untimed calls of ``step``, then ``steps`` timed ones;
    returns the seconds of each timed call.

    ``sync`` (a barrier, a device synchronisation) runs before every call, warm-up included, outside
    the timed span; ``after(seconds)`` runs after every *timed* call, also outside it (read the
    step's stats there). ``clock`` is ``time.perf_counter`` (wall time) unless the caller wants e.g.
    ``time.process_time``."""
    times: list[float] = []
    for i in range(warmup + steps):
        if sync is not None:
            sync()
        t0 = clock()
        step()
        dt = clock() - t0
        if i >= warmup:
            times.append(dt)
            if after is not None:
                after(dt)
    return times


def step_samples(config: dict[str, Any], model: nn.Module, loss: Callable[[nn.Module], torch.Tensor], backend: Any,
                 steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """This rank's seconds and payload bytes of each of ``steps`` real training steps after
    ``warmup``: ``model`` wrapped in PyTorch DDP whose buckets go through adacomp's hook with
    ``config`` on ``backend`` (needs torch.distributed's default group). lr 0: every step does the
    same work, and ``model`` is left as it was."""
    import adacomp.engine.ddp
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model)
    state, hook = adacomp.engine.ddp.hook(config, named_parameters=model.named_parameters(), backend=backend)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    sent: list[float] = []

    def step() -> None:
        opt.zero_grad()
        loss(ddp).backward()
        opt.step()

    times = time_steps(step, steps, warmup, sync=backend.barrier,
                       after=lambda _: sent.append(float(state.last_stats.bytes_sent if state.last_stats else 0)))
    return times, sent


def slowest_median(backend: Any, times: list[float], sent: list[float]) -> tuple[float, float]:
    """(slowest rank's median step seconds, mean over ranks of the median payload bytes)."""
    mine = torch.tensor([statistics.median(times), statistics.median(sent)], dtype=torch.float64)
    every = backend.allgather(mine.view(1, -1), sizes=[1] * backend.size()).view(backend.size(), -1)
    return float(every[:, 0].max()), float(every[:, 1].mean())


class StepSampler:
    """Every sample of every pass so far, per method; :meth:`run` adds passes, :meth:`result` reads
    the medians over all of them. A fresh model per pass keeps one model in memory at a time; a
    method's first pass has ``warmup`` warm-up steps, later ones 1."""

    def __init__(self, config_of: Callable[[str], dict[str, Any]], model_factory: ModelFactory, backend: Any,
                 steps: int = 5, warmup: int = 2) -> None:
        self.config_of, self.model_factory, self.backend = config_of, model_factory, backend
        self.steps, self.warmup = steps, warmup
        self._times: dict[str, list[float]] = {}
        self._sent: dict[str, list[float]] = {}
        self._passes: dict[str, list[float]] = {}

    def run(self, methods: list[str], rounds: int = 1) -> None:
        """``rounds`` passes over ``methods``, alternating (drift spreads over all of them)."""
        for _ in range(rounds):
            for m in methods:
                warm = self.warmup if m not in self._passes else min(self.warmup, 1)
                model, loss = self.model_factory()
                t, s = step_samples(self.config_of(m), model, loss, self.backend, self.steps, warm)
                del model, loss
                gc.collect()  # the previous arm's DDP reducer and hook state go before the next arm is timed
                self._times.setdefault(m, []).extend(t)
                self._sent.setdefault(m, []).extend(s)
                self._passes.setdefault(m, []).append(slowest_median(self.backend, t, s)[0])

    def result(self, method: str) -> StepMeasure:
        """Median over every sample of ``method`` so far (slowest rank), with its passes' medians."""
        return StepMeasure(*slowest_median(self.backend, self._times[method], self._sent[method]),
                           tuple(self._passes[method]))


def close_pairs(measured: dict[str, StepMeasure], top: int = 4, z: float = 2.0) -> list[tuple[str, str, float]]:
    """Adjacent pairs among the ``top`` fastest whose order is not yet resolved, as (faster, slower,
    gap in standard errors): the slower is less than ``z`` standard errors slower
    (:meth:`StepMeasure.gap_in_se`). Fastest first."""
    order = sorted(measured, key=lambda m: measured[m].step_s)[:top]
    gaps = [(a, b, measured[a].gap_in_se(measured[b])) for a, b in zip(order, order[1:])]
    return [(a, b, g) for a, b, g in gaps if g < z]


def close_methods(measured: dict[str, StepMeasure], top: int = 4, z: float = 2.0) -> list[str]:
    """Methods among the ``top`` fastest whose order against a neighbour is not yet resolved
    (:func:`close_pairs`). Fastest first."""
    close = {m for a, b, _ in close_pairs(measured, top, z) for m in (a, b)}
    return [m for m in sorted(measured, key=lambda m: measured[m].step_s) if m in close]


def resolve_close(sampler: StepSampler, methods: list[str], max_passes: int, top: int = 4,
                  z: float = 2.0) -> dict[str, StepMeasure]:
    """Up to ``max_passes`` more passes, each over the methods :func:`close_methods` still finds
    unresolved among the measured ``top``; returns every method's measure. Which methods get more
    passes depends on the measurements only, so it cannot favour any prediction."""
    measured = {m: sampler.result(m) for m in methods}
    for _ in range(max_passes):
        close = close_methods(measured, top, z)
        if not close:
            break
        sampler.run(close)
        measured.update({m: sampler.result(m) for m in close})
    return measured
