"""The few exception types adacomp raises for user-facing problems.

Every message follows "expected / got / fix" so the user can act on it without reading our code.
"""
from __future__ import annotations


class AdacompError(Exception):
    """Base class of all adacomp errors."""


class ConfigError(AdacompError, ValueError):
    """An invalid configuration value; ``path`` is the dotted YAML path of the offending key."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.reason = message
        super().__init__(f"{path}: {message}" if path else message)


class IncompatibleComponentsError(ConfigError):
    """A compressor / communicator / memory combination that cannot work together."""


class CommunicationError(AdacompError, RuntimeError):
    """A collective failed, timed out, or ranks disagree (config hash, shapes, names)."""


class RanksDisagreeError(CommunicationError):
    """Every rank took part in an exchange that worked and found that they differ (config, model,
    initial weights): each raises it at once. Not a transport failure, so the watchdog does not
    wait for a rank to be lost before it is raised."""


class NonFiniteGradientError(AdacompError, FloatingPointError):
    """A gradient contains NaN or Inf and ``nonfinite: raise`` is configured."""


class RankStateError(AdacompError, ValueError):
    """Compression state saved by one rank (or world size) loaded by another: residuals and factors
    are per rank, so loading them elsewhere would silently train differently."""
