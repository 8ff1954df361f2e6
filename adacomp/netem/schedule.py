"""Network schedules: bandwidth (and latency) per emulated host as a function of step, epoch or time.

The AR-Topk paper changes alpha and 1/beta per epoch range while training runs (Section IV, Fig. 6,
configurations C1 / C2). A schedule file says the same thing in YAML::

    unit: epoch                 # step | epoch | seconds
    events:
      - {at: 0,  bandwidth: 1gbit, latency: 1ms}          # every host
      - {at: 12, bandwidth: {0: 100mbit, all: 1gbit}}     # host 0 slower; "all" = the others
      - {at: 24, latency: 50ms}

Bandwidth is applied to the namespaces' ``tbf`` qdiscs by :class:`ScheduleController` (a thread, or
``adacomp netem schedule FILE`` as a process). Latency cannot be applied by the kernel here (no
``netem`` qdisc), so workers read it through :class:`adacomp.backends.shaped.ShapedBackend`.

The file format lives in the core module :mod:`adacomp.netschedule` (re-exported here). Progress for
``step`` / ``epoch`` schedules comes from the trainer: it calls :func:`report_step`
(a no-op unless ``ADACOMP_NETEM_STEP_FILE`` is set), which atomically rewrites a tiny JSON file
``{"step": s, "epoch": e}`` that the controller polls. A file, not a socket, because the trainer
runs inside a namespace and the controller outside it, and the file system is shared.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

from adacomp.errors import ConfigError
from adacomp.netem import hosts as netem
from adacomp.netschedule import (SCHEDULE_ENV, STEP_FILE_ENV, UNITS, Event, Schedule, load_schedule,  # noqa: F401
                                 parse_schedule, read_progress, report_step)


# ---------------------------------------------------------------- controller
def _apply_tc(event: Event, prefix: str) -> None:
    if None in event.bandwidth:  # "all" first, explicit hosts override it
        netem.set_bandwidth(event.bandwidth[None], None, prefix)
    for host, bps in event.bandwidth.items():
        if host is not None:
            netem.set_bandwidth(bps, host, prefix)


class ScheduleController:
    """Applies a schedule's bandwidth events in order as progress passes each event's ``at``.

    ``apply(event)`` defaults to changing the namespaces' tbf rates; ``tick()`` does one poll and
    is what the background thread repeats every ``poll_s`` seconds. The thread ends when every
    event has been applied, on :meth:`stop`, or when applying fails (e.g. ``netem down`` removed
    the hosts); the failure is kept in ``error``.
    """

    def __init__(self, schedule: Schedule, prefix: str = netem.DEFAULT_PREFIX, step_file: str | None = None,
                 poll_s: float = 0.1, apply: Callable[[Event], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if schedule.unit != "seconds" and not (step_file or os.environ.get(STEP_FILE_ENV)):
            raise ConfigError("schedule.unit", f"a '{schedule.unit}' schedule needs a step file; set "
                              f"{STEP_FILE_ENV} or pass step_file, and call report_step() in the trainer")
        self.schedule, self.prefix, self.poll_s, self.clock = schedule, prefix, poll_s, clock
        self.step_file = step_file or os.environ.get(STEP_FILE_ENV)
        self._apply = apply or (lambda ev: _apply_tc(ev, prefix))
        self._next = 0
        self._t0 = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.applied: list[Event] = []
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._next >= len(self.schedule.events)

    def position(self) -> float | None:
        if self.schedule.unit == "seconds":
            return self.clock() - self._t0
        progress = read_progress(self.step_file) if self.step_file else None
        value = progress.get(self.schedule.unit) if progress else None
        return None if value is None else float(value)

    def tick(self) -> int:
        pos, n = self.position(), 0
        while pos is not None and not self.done and self.schedule.events[self._next].at <= pos:
            ev = self.schedule.events[self._next]
            if ev.bandwidth:
                self._apply(ev)
            self.applied.append(ev)
            self._next += 1
            n += 1
        return n

    def _loop(self) -> None:
        try:
            while not self._stop.is_set() and not self.done:
                self.tick()
                self._stop.wait(self.poll_s)
        except BaseException as exc:  # noqa: BLE001 - reported through .error, thread must not die noisily
            self.error = exc

    def start(self) -> "ScheduleController":
        self._t0 = self.clock()
        self._thread = threading.Thread(target=self._loop, name="adacomp-netem-schedule", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
