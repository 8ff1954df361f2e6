"""A Backend wrapper that makes every collective cost at least ``alpha + bytes * beta``.

Why: the ``netem`` qdisc (the usual way to add delay) is not in this kernel, so latency cannot come
from the network; and where namespaces are not available at all, bandwidth cannot either. This
wrapper adds both deterministically around any :class:`~adacomp.backends.base.Backend`, with the
alpha-beta model of the AR-Topk paper (artopk-flexible-communication-moo.txt, Table I): alpha is
latency in seconds, 1/beta is bandwidth, so beta is seconds per byte.

Cost per collective (``cost=``):

* ``flat`` (default): ``alpha + M * beta`` for every collective, ``M`` = bytes this rank sends.
* ``table1``: Table I with ``N`` ranks, log base 2 (the paper does not state the base; trees are
  binary): ring allreduce ``2(N-1)alpha + 2(N-1)/N M beta`` (tree when the inner backend reports
  ``allreduce_algorithm == "tree"``: ``2 log N (alpha + M beta)``), allgather
  ``alpha log N + (N-1) M beta``, broadcast ``log N (alpha + M beta)``. Table I has no alltoall;
  it is charged as a pairwise exchange, ``(N-1) alpha + (N-1)/N M beta`` (N-1 rounds, each moving
  one N-th of the ``M`` bytes this rank holds), the same model as
  :func:`adacomp.policies.timeline.alltoall` uses for ByteComp's divisible scheme.

Timing (``overlap=``):

* ``True`` (default): the delay runs on a virtual link, not in the caller. A collective launched at
  ``t`` occupies the link from ``max(t, end of the previous one)`` for its delay, and its handle's
  ``wait()`` returns no earlier than that end. Compute overlaps the delay as it would overlap a real
  transfer, and back-to-back collectives queue as on one link. The real transfer runs concurrently,
  so a collective takes ``max(real, emulated)``: right when the real transport is loopback.
* ``False``: sleep the delay before launching. Blocks the caller, but adds to the real transfer
  time: use this to add latency on top of bandwidth-capped namespaces (``adacomp netem``).

Alpha and beta may change while training runs: :meth:`set_shape` directly, or a netem schedule
(:mod:`adacomp.netem.schedule`; its ``latency`` and, with ``emulate_bandwidth``, its ``bandwidth``)
followed by progress from :meth:`set_step`, from the step file rank 0 writes with ``report_step``,
or from wall time for ``seconds`` schedules. Results are never changed: only time is added.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Mapping

from torch import Tensor

from adacomp.backends.base import Backend, Handle
from adacomp.backends.forwarding import ForwardingBackend
from adacomp.units import parse_duration, parse_rate
from adacomp.errors import ConfigError
from adacomp.netschedule import SCHEDULE_ENV, STEP_FILE_ENV, Schedule, load_schedule, read_progress

COSTS = ("flat", "table1")
_STEP_FILE_POLL_S = 0.05  # re-read the progress file at most this often


class ShapedBackend(ForwardingBackend):
    """``inner`` with an emulated latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte)."""

    name = "shaped"

    def __init__(self, inner: Backend, alpha: float = 0.0, beta: float = 0.0, cost: str = "flat",
                 overlap: bool = True, schedule: Schedule | None = None, emulate_bandwidth: bool = False,
                 host: int | None = None, step_file: str | None = None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        if cost not in COSTS:
            raise ValueError(f"cost: expected one of {', '.join(COSTS)}, got {cost!r}")
        self.inner, self.cost, self.overlap, self.schedule = inner, cost, overlap, schedule
        self.emulate_bandwidth = emulate_bandwidth
        self.host = inner.rank() if host is None else host
        self.step_file = step_file
        self._clock, self._sleep = clock, sleep
        self.set_shape(alpha, beta)
        self._base = (self.alpha, self.beta)
        self._t0 = clock()
        self._busy_until = 0.0
        self._progress: dict[str, float] = {}
        self._progress_set = False
        self._last_poll = -math.inf
        self.collectives = 0
        self.added_s = 0.0  # emulated seconds charged so far (an upper bound on time actually added)

    # -------------------------------------------------------------- shape control
    def set_shape(self, alpha: float | None = None, beta: float | None = None) -> None:
        """Change latency / inverse bandwidth from the next collective on."""
        if alpha is not None:
            if alpha < 0:
                raise ValueError(f"alpha: expected seconds >= 0, got {alpha}")
            self.alpha = float(alpha)
        if beta is not None:
            if beta < 0:
                raise ValueError(f"beta: expected seconds per byte >= 0, got {beta}")
            self.beta = float(beta)

    def set_step(self, step: int, epoch: int | None = None) -> None:
        """Training progress for ``step`` / ``epoch`` schedules (call it on every rank, or rely on the step file)."""
        self._progress = {"step": float(step)} | ({} if epoch is None else {"epoch": float(epoch)})
        self._progress_set = True

    def _position(self, schedule: Schedule) -> float | None:
        if schedule.unit == "seconds":
            return self._clock() - self._t0
        if not self._progress_set and self.step_file:
            now = self._clock()
            if now - self._last_poll >= _STEP_FILE_POLL_S:
                self._last_poll = now
                got = read_progress(self.step_file) or {}
                self._progress = {k: float(v) for k, v in got.items() if v is not None}
        return self._progress.get(schedule.unit)

    def _follow_schedule(self) -> None:
        if self.schedule is None:
            return
        pos = self._position(self.schedule)
        if pos is None:
            return
        alpha, beta = self._base
        latency = self.schedule.value_at("latency", pos, self.host)
        if latency is not None:
            alpha = latency
        if self.emulate_bandwidth:
            bw = self.schedule.value_at("bandwidth", pos, self.host)
            if bw is not None:
                beta = 8.0 / bw
        self.alpha, self.beta = alpha, beta

    def delay(self, op: str, nbytes: int) -> float:
        """Emulated seconds for collective ``op`` moving ``nbytes`` from this rank."""
        a, b, n = self.alpha, self.beta, self.inner.size()
        if self.cost == "flat":
            return a + nbytes * b
        log_n = math.log2(n) if n > 1 else 0.0
        if op == "allreduce":
            if self.inner.allreduce_algorithm == "tree":
                return 2 * log_n * (a + nbytes * b)
            return 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes * b
        if op == "allgather":
            return a * log_n + (n - 1) * nbytes * b
        if op == "alltoall":  # pairwise exchange; equals adacomp.policies.timeline.alltoall
            return (n - 1) * a + (n - 1) / n * nbytes * b
        return log_n * (a + nbytes * b)  # broadcast, and small control messages

    # -------------------------------------------------------------- timing core
    def _delayed(self, op: str, nbytes: int, launch: Callable[[], Handle]) -> Handle:
        self._follow_schedule()
        d = self.delay(op, nbytes)
        self.collectives += 1
        self.added_s += d
        if not self.overlap:
            self._sleep_until(self._clock() + d)
            return launch()
        finish = max(self._clock(), self._busy_until) + d
        self._busy_until = finish
        handle = launch()

        def wait() -> Tensor:
            out = handle.wait()
            self._sleep_until(finish)
            return out
        return Handle(wait)

    def _sleep_until(self, deadline: float) -> None:
        while (left := deadline - self._clock()) > 0:  # sleep can wake early on some clocks
            self._sleep(left)

    def _blocking(self, op: str, nbytes: int, fn: Callable[[], Any]) -> Any:
        result: list[Any] = []

        def run() -> Any:
            result.append(fn())
        self._delayed(op, nbytes, lambda: Handle(run)).wait()
        return result[0]

    # -------------------------------------------------------------- Backend API (rank, size, ... forward)
    def allreduce_async(self, tensor: Tensor, average: bool = False) -> Handle:
        return self._delayed("allreduce", _nbytes(tensor), lambda: self.inner.allreduce_async(tensor, average))

    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None, out: Tensor | None = None) -> Handle:
        return self._delayed("allgather", _nbytes(tensor), lambda: self.inner.allgather_async(tensor, sizes, out))

    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle:
        return self._delayed("broadcast", _nbytes(tensor), lambda: self.inner.broadcast_async(tensor, root))

    def alltoall_async(self, tensor: Tensor, splits: list[int], recv_splits: list[int] | None = None) -> Handle:
        # M = the whole tensor; under table1 the (N-1)/N factor discounts the block this rank keeps.
        return self._delayed("alltoall", _nbytes(tensor),
                             lambda: self.inner.alltoall_async(tensor, splits, recv_splits))

    def allgather_sizes(self, n: int) -> list[int]:
        return self._blocking("allgather", 8, lambda: self.inner.allgather_sizes(n))

    def alltoall_splits(self, splits: list[int]) -> list[int]:
        return self._blocking("alltoall", 8 * len(splits), lambda: self.inner.alltoall_splits(splits))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self._blocking("broadcast", 0, lambda: self.inner.broadcast_object(obj, root))

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._blocking("allgather", 0, lambda: self.inner.allgather_object(obj))

    def barrier(self) -> None:
        self._blocking("barrier", 0, self.inner.barrier)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _flag(env: Mapping[str, str], key: str, default: bool) -> bool:
    raw = env.get(key)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise ConfigError(key, f"expected 0 or 1, got {raw!r}")


def wrap_from_env(backend: Backend, environ: Mapping[str, str] | None = None) -> Backend:
    """``backend`` wrapped as the launcher asked through environment variables, else unchanged.

    ``ADACOMP_SHAPE_ALPHA`` (``5ms``), ``ADACOMP_SHAPE_BETA`` (s/byte) or ``ADACOMP_SHAPE_BANDWIDTH``
    (``100mbit``), ``ADACOMP_SHAPE_COST`` (flat | table1), ``ADACOMP_SHAPE_OVERLAP`` (1 | 0),
    ``ADACOMP_NETEM_SCHEDULE`` (schedule YAML), ``ADACOMP_SHAPE_EMULATE_BANDWIDTH`` (0 | 1: take the
    schedule's bandwidth as beta), ``ADACOMP_NETEM_HOST`` (this rank's host; default rank),
    ``ADACOMP_NETEM_STEP_FILE`` (progress written by ``report_step``).
    """
    env = os.environ if environ is None else environ
    keys = ("ADACOMP_SHAPE_ALPHA", "ADACOMP_SHAPE_BETA", "ADACOMP_SHAPE_BANDWIDTH", SCHEDULE_ENV)
    if not any(env.get(k) for k in keys):
        return backend

    def parsed(key: str, parse: Callable[[str], float], default: float) -> float:
        try:
            return parse(env[key]) if env.get(key) else default
        except ValueError as exc:
            raise ConfigError(key, str(exc)) from None

    beta = parsed("ADACOMP_SHAPE_BETA", float, 0.0)
    if env.get("ADACOMP_SHAPE_BANDWIDTH"):
        beta = 8.0 / parsed("ADACOMP_SHAPE_BANDWIDTH", parse_rate, 1.0)
    schedule = load_schedule(env[SCHEDULE_ENV]) if env.get(SCHEDULE_ENV) else None
    host = int(parsed("ADACOMP_NETEM_HOST", int, -1))
    try:
        return ShapedBackend(backend, alpha=parsed("ADACOMP_SHAPE_ALPHA", parse_duration, 0.0), beta=beta,
                             cost=env.get("ADACOMP_SHAPE_COST", "flat"),
                             overlap=_flag(env, "ADACOMP_SHAPE_OVERLAP", True), schedule=schedule,
                             emulate_bandwidth=_flag(env, "ADACOMP_SHAPE_EMULATE_BANDWIDTH", False),
                             host=None if host < 0 else host, step_file=env.get(STEP_FILE_ENV) or None)
    except ValueError as exc:
        raise ConfigError("ADACOMP_SHAPE_*", str(exc)) from None
