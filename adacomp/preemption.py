"""Coordinated pre-emption: a signal on any rank becomes one consistent checkpoint set and a clean exit.

Why not save in the signal handler: signals reach ranks at different moments (or only one rank),
so per-rank handlers write files of different steps -- a set that must not be resumed. Here the
handler only sets a flag; the training loop polls :meth:`Preemption.should_stop` at every step
boundary, which allreduces the flag (one int per step), so all ranks learn of it after the same
step, write one set with :func:`adacomp.runtime.checkpoint.save_set` and exit with
:data:`PREEMPTED_EXIT_CODE`::

    with checkpoint.Preemption() as pre:                    # SIGTERM, SIGUSR1 by default
        for step in range(start, total):
            train_one_step()
            if pre.should_stop():
                checkpoint.save_set(ckpt_dir, model, opt, step=step + 1)
                raise SystemExit(checkpoint.PREEMPTED_EXIT_CODE)
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Iterable

import torch

# Distinct from 0 (done), 75 (watchdog: a rank was lost) and 128+N (killed by signal N): schedulers
# and `adacomp run` can tell "stopped on request, resume me" from a failure.
PREEMPTED_EXIT_CODE = 76
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


def _signal(name: str | int) -> signal.Signals:
    if isinstance(name, int):
        return signal.Signals(name)
    key = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
    valid = sorted(s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP))
    if key not in valid:
        raise ValueError(f"pre-emption signal {name!r} is not a catchable signal; valid: {', '.join(valid)}")
    return signal.Signals[key]


class Preemption:
    """Signal handlers that only raise a flag, and a collective check of that flag at step boundaries.

    Install from the main thread (Python's rule for signal handlers). ``backend``: defaults to the
    running adacomp backend. :meth:`close` (or leaving the ``with`` block) restores the old handlers."""

    def __init__(self, signals: Iterable[str | int] = DEFAULT_SIGNALS, backend: Any = None):
        self.signals = [_signal(s) for s in signals]
        if not self.signals:
            raise ValueError(f"give at least one signal, e.g. {list(DEFAULT_SIGNALS)}")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Preemption must be created in the main thread (Python installs signal "
                               "handlers only there)")
        self._backend = backend
        self.received: signal.Signals | None = None  # the first signal this rank got
        self.stopping = False  # set once should_stop() returned True on every rank
        self._old = {s: signal.signal(s, self._on_signal) for s in self.signals}

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        """This rank got one of the signals (local; no collective)."""
        return self.received is not None

    def should_stop(self) -> bool:
        """Collective (every rank calls it after the same step): True on every rank iff any rank
        got a signal. Call it between steps, never inside one."""
        from adacomp.runtime import context
        from adacomp.backends import watchdog
        backend = self._backend or context.current()
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int64)
        if backend.size() > 1:
            with watchdog.guard(backend):
                flag = backend.allreduce(flag)
        self.stopping = bool(int(flag.item()) > 0)
        return self.stopping

    def close(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def __enter__(self) -> "Preemption":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DEFAULT_SIGNALS", "PREEMPTED_EXIT_CODE", "Preemption"]
