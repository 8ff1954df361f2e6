"""Decide on one rank without leaving the others blocked in one long collective (issue 21).

Why: adaptive policies decide on rank 0 and broadcast the result (cross-rank determinism). While
rank 0 works, every other rank sits in the broadcast's receive; once that outlasts the backend's
collective timeout, gloo fails it ("Timed out waiting ... for recv operation") and the job dies,
naming nothing. :meth:`Rendezvous.decide` runs the decision on a helper thread of the root and,
every ``interval_s`` (a small fraction of the collective timeout), broadcasts a progress note; the
other ranks loop over these short broadcasts until the result (or the root's error) arrives, so no
single collective waits longer than about ``interval_s``, however long the decision takes.

Every collective a policy makes through :meth:`Rendezvous.call` is timed, so ``waits`` /
``max_wait_s`` state the longest time this rank spent inside one collective (what tests assert and
docs/results/adaptive.md reports), and a failure is re-raised as a
:class:`~adacomp.errors.CommunicationError` that names the policy and what it was doing.
"""
from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from adacomp.backends import watchdog
from adacomp.errors import CommunicationError

if TYPE_CHECKING:
    from adacomp.policies.base import Host

T = TypeVar("T")
PROGRESS_FRACTION = 0.05   # of the collective timeout: one progress broadcast at least this often
MAX_INTERVAL_S = 2.0       # ... and at least every 2 s (a quick decision should not wait long)
MIN_INTERVAL_S = 0.02


def progress_interval(timeout_s: float) -> float:
    """Seconds between progress broadcasts for a collective timeout of ``timeout_s``."""
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, PROGRESS_FRACTION * timeout_s))


@dataclass
class Rendezvous:
    """The collectives of one policy, timed; ``decide`` keeps waiting ranks' collectives short.

    ``waits``: (what, seconds) for every collective call this rank made through this object;
    ``decision_s``: the root's time in the last :meth:`decide` (every rank learns it);
    ``rounds``: progress broadcasts of the last decision.
    """

    backend: Any
    policy: str
    timeout_s: float = 60.0
    interval_s: float = field(default=0.0)
    waits: list[tuple[str, float]] = field(default_factory=list)
    decision_s: float = 0.0
    rounds: int = 0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.interval_s:
            self.interval_s = progress_interval(self.timeout_s)

    @classmethod
    def for_optimizer(cls, optimizer: "Host", policy: str) -> "Rendezvous":
        """The watchdog's timeout when one runs (it is the backend's), else the config's ``timeout_s``."""
        wd = getattr(optimizer.backend, "watchdog", None)
        timeout = getattr(wd, "timeout_s", None) or optimizer.config.timeout_s
        return cls(optimizer.backend, policy, float(timeout))

    @property
    def max_wait_s(self) -> float:
        """The longest time this rank spent inside one collective call."""
        return max((w for _, w in self.waits), default=0.0)

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run the collective ``fn(*args, **kwargs)``, timed; a failure names the policy."""
        t0 = time.perf_counter()
        try:
            with watchdog.activity(self.backend, f"policy {self.policy!r}: {what}"):
                return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with the policy's context
            raise self._error(what, time.perf_counter() - t0, exc) from exc
        finally:
            self.waits.append((what, time.perf_counter() - t0))

    def _error(self, what: str, waited: float, exc: BaseException) -> CommunicationError:
        wd = getattr(self.backend, "watchdog", None)
        said = wd.explain(exc) if wd is not None else exc
        return CommunicationError(
            f"policy {self.policy!r}: {what} failed on rank {self.backend.rank()} after {waited:.1f} s in one "
            f"collective (collective timeout {self.timeout_s:g} s; the deciding rank sends progress every "
            f"{self.interval_s:.2g} s, so a longer wait means it stopped answering or died). Check the "
            f"other ranks' logs; raise timeout_s if they were only slow. Transport said: {said}")

    def decide(self, what: str, fn: Callable[[], T], root: int = 0) -> T:
        """``fn()`` on ``root``, its result on every rank (every rank must call this)."""
        be = self.backend
        self.rounds = 0
        if be.size() == 1:
            t0 = time.perf_counter()
            out = fn()
            self.decision_s = time.perf_counter() - t0
            return out
        if be.rank() != root:
            while True:
                msg = self.call(what, be.broadcast_object, None, root)
                if msg[0] == "progress":
                    self.rounds += 1
                    continue
                self.decision_s = float(msg[2])
                if msg[0] == "error":
                    raise RuntimeError(f"policy {self.policy!r}: rank {root} failed during {what}:\n{msg[1]}")
                return msg[1]
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["out"] = fn()
            except BaseException:  # noqa: BLE001 - reported to every rank below
                box["error"] = traceback.format_exc()

        t0 = time.perf_counter()
        thread = threading.Thread(target=work, name=f"adacomp-{self.policy}-decision", daemon=True)
        thread.start()
        while True:
            thread.join(self.interval_s)
            if not thread.is_alive():
                break
            self.rounds += 1
            self.call(what, be.broadcast_object, ("progress", self.rounds, time.perf_counter() - t0), root)
        self.decision_s = time.perf_counter() - t0
        if "error" in box:
            self.call(what, be.broadcast_object, ("error", box["error"], self.decision_s), root)
            raise RuntimeError(f"policy {self.policy!r}: {what} failed on rank {root}:\n{box['error']}")
        self.call(what, be.broadcast_object, ("done", box["out"], self.decision_s), root)
        return box["out"]
