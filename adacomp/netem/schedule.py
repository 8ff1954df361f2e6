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

Progress for ``step`` / ``epoch`` schedules comes from the trainer: it calls :func:`report_step`
(a no-op unless ``ADACOMP_NETEM_STEP_FILE`` is set), which atomically rewrites a tiny JSON file
``{"step": s, "epoch": e}`` that the controller polls. A file, not a socket, because the trainer
runs inside a namespace and the controller outside it, and the file system is shared.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from adacomp.netem import hosts as netem
from adacomp.errors import ConfigError

STEP_FILE_ENV = "ADACOMP_NETEM_STEP_FILE"
SCHEDULE_ENV = "ADACOMP_NETEM_SCHEDULE"
UNITS = ("step", "epoch", "seconds")


@dataclass(frozen=True)
class Event:
    """From position ``at`` on: ``bandwidth`` in bit/s and ``latency`` in seconds, keyed by host
    index, ``None`` meaning every host not named explicitly."""

    at: float
    bandwidth: dict[int | None, int] = field(default_factory=dict)
    latency: dict[int | None, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Schedule:
    unit: str
    events: tuple[Event, ...]

    def value_at(self, kind: str, position: float, host: int) -> float | None:
        """The ``bandwidth`` or ``latency`` in force for ``host`` at ``position`` (None: never set)."""
        value = None
        for ev in self.events:
            if ev.at > position:
                break
            per_host = getattr(ev, kind)
            if host in per_host:
                value = per_host[host]
            elif None in per_host:
                value = per_host[None]
        return value


def _per_host(raw: Any, path: str, parse: Callable[[Any], Any]) -> dict[int | None, Any]:
    items = raw.items() if isinstance(raw, dict) else [("all", raw)]
    out: dict[int | None, Any] = {}
    for key, value in items:
        if key == "all":
            host = None
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            host = key
        else:
            raise ConfigError(f"{path}.{key}", "expected a host index >= 0 or 'all'")
        try:
            out[host] = parse(value)
        except ValueError as exc:
            raise ConfigError(f"{path}.{key}" if isinstance(raw, dict) else path, str(exc)) from None
    return out


def parse_schedule(data: Any, source: str = "schedule") -> Schedule:
    """Validate a schedule mapping; errors name the dotted path of the bad key."""
    if not isinstance(data, dict):
        raise ConfigError(source, f"expected a mapping with 'unit' and 'events', got {type(data).__name__}")
    unknown = set(data) - {"unit", "events"}
    if unknown:
        raise ConfigError(f"{source}.{sorted(unknown)[0]}", "unknown key; allowed: unit, events")
    unit = data.get("unit", "step")
    if unit not in UNITS:
        raise ConfigError(f"{source}.unit", f"expected one of {', '.join(UNITS)}, got {unit!r}")
    raw_events = data.get("events")
    if not isinstance(raw_events, list) or not raw_events:
        raise ConfigError(f"{source}.events", "expected a non-empty list of {at, bandwidth, latency}")
    events = []
    for n, raw in enumerate(raw_events):
        path = f"{source}.events[{n}]"
        if not isinstance(raw, dict):
            raise ConfigError(path, f"expected a mapping, got {raw!r}")
        bad = set(raw) - {"at", "bandwidth", "latency"}
        if bad:
            raise ConfigError(f"{path}.{sorted(bad)[0]}", "unknown key; allowed: at, bandwidth, latency")
        at = raw.get("at")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or at < 0:
            raise ConfigError(f"{path}.at", f"expected a number >= 0, got {at!r}")
        if "bandwidth" not in raw and "latency" not in raw:
            raise ConfigError(path, "expected 'bandwidth' and/or 'latency'")
        events.append(Event(float(at), _per_host(raw.get("bandwidth", {}), f"{path}.bandwidth", netem.parse_rate),
                            _per_host(raw.get("latency", {}), f"{path}.latency", netem.parse_duration)))
    events.sort(key=lambda e: e.at)  # stable: equal positions keep file order
    return Schedule(unit, tuple(events))


def load_schedule(path: str | os.PathLike) -> Schedule:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read schedule file ({exc})") from None
    return parse_schedule(data, source=str(path))


# ---------------------------------------------------------------- progress reporting
def report_step(step: int, epoch: int | None = None, path: str | None = None) -> None:
    """Publish training progress for step / epoch schedules; no-op when no step file is configured.

    Call it once per step from one rank (rank 0). The write is atomic (temp file + rename), so the
    controller never reads half a file.
    """
    path = path or os.environ.get(STEP_FILE_ENV)
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"step": int(step), "epoch": None if epoch is None else int(epoch)}, f)
    os.replace(tmp, path)


def read_progress(path: str) -> dict[str, int | None] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


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
