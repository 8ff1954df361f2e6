"""Network schedule files (bandwidth and latency per emulated host as a function of step, epoch or
time) and the progress file a trainer writes for them: the format only, shared by the shaped backend
(which applies latency inside a worker) and :mod:`adacomp.netem.schedule` (which applies bandwidth to
the emulated hosts' qdiscs). The format and the reasons for a progress *file* are described there.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from adacomp.errors import ConfigError
from adacomp.units import parse_duration, parse_rate

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
        events.append(Event(float(at), _per_host(raw.get("bandwidth", {}), f"{path}.bandwidth", parse_rate),
                            _per_host(raw.get("latency", {}), f"{path}.latency", parse_duration)))
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
