"""Units in configs and command lines: link rates (``"100mbit"``) and durations (``"5ms"``).

In the core layer (docs/architecture.md) because the shaped backend, the network emulator, the
advisor and the scripts all read them.
"""
from __future__ import annotations

import re

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_rate(text: str | int | float) -> int:
    """``"100mbit"`` -> 100_000_000 bit/s. Only bit units: tc reads ``mbps`` as megaBYTES/s."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), "bit"
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m:
            raise ValueError(f"bandwidth: expected a rate like '100mbit' or '1gbit', got {text!r}")
        value, unit = float(m.group(1)), (m.group(2).lower() or "bit")
    if unit.endswith("bps"):
        raise ValueError(f"bandwidth: got {text!r}; tc reads '{unit}' as bytes per second, which is "
                         f"ambiguous here. Fix: write bits, e.g. '100mbit' for 100 Mbit/s")
    if unit not in _RATE_UNITS:
        raise ValueError(f"bandwidth: unknown unit {unit!r} in {text!r}; use one of {sorted(_RATE_UNITS)}")
    bps = int(value * _RATE_UNITS[unit])
    if bps < 8000:
        raise ValueError(f"bandwidth: expected at least 8kbit, got {text!r}")
    return bps


def parse_duration(text: str | int | float) -> float:
    """``"5ms"`` -> 0.005 s; a bare number is seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), "s"
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*", str(text))
        if not m:
            raise ValueError(f"latency: expected a duration like '5ms' or 0.005, got {text!r}")
        value, unit = float(m.group(1)), m.group(2) or "s"
    if value < 0:
        raise ValueError(f"latency: expected >= 0, got {text!r}")
    return value * _TIME_UNITS[unit]


def format_rate(bps: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= scale and bps % scale == 0:
            return f"{bps // scale}{unit}"
    return f"{bps}bit"


__all__ = ["format_rate", "parse_duration", "parse_rate"]
