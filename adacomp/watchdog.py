"""Name the rank that died, and never hang on it.

Why: when a peer process dies, gloo fails the pending collective with "Connection closed by peer"
(no rank), MPI just waits, and a rank that is not in a collective at that moment notices nothing.
Launchers (``adacomp run``, torchrun, mpirun) stop the job when a *local* worker dies, but a
worker whose peer vanished on another machine, or whose launcher is gone, must find out by itself.

How: every rank runs one daemon thread that bumps a heartbeat counter ``hb/<rank>`` in a small
``torch.distributed.TCPStore`` hosted by rank 0 (its address travels by one ``broadcast_object`` at
start, so it works with every backend) and reads everyone else's counter. A peer whose counter has
not moved for ``0.6 * timeout_s`` (measured on *this* rank's monotonic clock, so no clock
agreement is needed) is *lost*; a store that stops answering means rank 0 (its host) is lost.

* :func:`guard` wraps communication: a collective error is re-raised as
  :class:`~adacomp.errors.CommunicationError` naming the lost rank (it waits up to
  ``0.6 * timeout_s`` for the dead peer's heartbeat to go stale); other errors pass unchanged.
* If the main thread stays blocked (MPI, or a collective still inside its own timeout), the
  thread prints the same message to stderr and ends the process with :data:`EXIT_CODE` after
  ``0.3 * timeout_s`` more, so every survivor is gone within about ``timeout_s``.
* :func:`stop` (also run at interpreter exit) says goodbye (``bye/<rank>``) so a rank that finishes
  early is not taken for dead; rank 0 keeps the store up until every peer said goodbye or was lost.

The heartbeat says a process is alive, not that it makes progress: a live but stuck peer is caught
by the backend's collective timeout (``timeout_s``) instead.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from adacomp.errors import CommunicationError

EXIT_CODE = 75  # EX_TEMPFAIL: the job may succeed when restarted from its last checkpoint
STALE_FRACTION = 0.6
GRACE_FRACTION = 0.3
# Error texts of transports that mean "a peer went away" (gloo, c10d, MPI via our backend).
_COMM_HINTS = ("connection", "closed by peer", "reset by peer", "broken pipe", "timed out", "timeout",
               "gloo", "socket", "peer", "nccl", "mpi")


@dataclass(frozen=True)
class Lost:
    rank: int
    silent_s: float
    why: str

    def message(self, me: int, timeout_s: float) -> str:
        return (f"rank {self.rank} is lost ({self.why}; no heartbeat for {self.silent_s:.1f} s, limit "
                f"{STALE_FRACTION * timeout_s:.1f} s = {STALE_FRACTION} x timeout_s) - seen by rank {me}. "
                f"Expected every rank to stay alive; check rank {self.rank}'s log (killed? out of memory?) "
                "and restart from the last checkpoint, or raise timeout_s if it was only slow")


def _is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, CommunicationError):
        return True
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError"):
        return True
    return isinstance(exc, RuntimeError) and any(h in str(exc).lower() for h in _COMM_HINTS)


class Watchdog:
    """Heartbeats of every rank; start with :func:`start`, never directly from user code."""

    def __init__(self, backend: Any, timeout_s: float, interval_s: float | None = None):
        from torch.distributed import TCPStore

        self.rank, self.size = backend.rank(), backend.size()
        self.timeout_s = float(timeout_s)
        self.interval_s = interval_s if interval_s is not None else min(1.0, self.timeout_s / 10)
        self.stale_s = STALE_FRACTION * self.timeout_s
        store_timeout = datetime.timedelta(seconds=max(self.timeout_s, 1.0))
        server = None
        if self.rank == 0:
            addr = os.environ.get("ADACOMP_WATCHDOG_ADDR") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
            server = TCPStore(addr, 0, None, True, timeout=store_timeout, wait_for_workers=False)
            where = (addr, server.port)
        else:
            where = None
        addr, port = backend.broadcast_object(where, 0)
        self._server = server  # rank 0 keeps the listening store alive
        self._store = TCPStore(addr, port, None, False, timeout=store_timeout)
        self._store.set(f"hb/{self.rank}", "0")
        backend.barrier()  # every hb key exists before anyone reads them (get() would block)
        self._peers = [r for r in range(self.size) if r != self.rank]
        now = time.monotonic()
        self._seen = {r: ("", now) for r in self._peers}
        self._bye: set[int] = set()
        self._beats = 0
        self._pid = os.getpid()
        self.lost: Lost | None = None
        self.activity = ""  # what the main thread is blocked in, for the exit message (see activity())
        self._stop = threading.Event()
        self._lost_event = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"adacomp-watchdog-{self.rank}", daemon=True)
        self._thread.start()

    # --- the thread ------------------------------------------------------------------------------
    def _tick(self) -> None:
        self._beats += 1
        now = time.monotonic()
        try:
            self._store.set(f"hb/{self.rank}", str(self._beats))
            beats = self._store.multi_get([f"hb/{r}" for r in self._peers])
            byes = [r for r in self._peers if r not in self._bye and self._store.check([f"bye/{r}"])]
        except Exception as exc:  # noqa: BLE001 - the store is rank 0's: it vanished with rank 0
            if 0 not in self._bye:
                silent = now - self._seen.get(0, ("", now))[1] if self.rank != 0 else 0.0
                if silent >= self.stale_s:
                    self._declare(Lost(0, silent, f"its heartbeat store stopped answering: {exc}"))
            return
        self._bye.update(byes)
        for r, b in zip(self._peers, beats):
            value = b.decode() if isinstance(b, bytes) else str(b)
            if value != self._seen[r][0]:
                self._seen[r] = (value, now)
            elif r not in self._bye and now - self._seen[r][1] >= self.stale_s:
                self._declare(Lost(r, now - self._seen[r][1], "its process stopped"))
                return

    def _declare(self, lost: Lost) -> None:
        if self.lost is None:
            self.lost = lost
            self._lost_event.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._tick()
            if self.lost is not None:
                break
        if self.lost is None:
            return
        # Give the main thread the chance to raise the error itself (guard / check); if it is
        # blocked in a collective, end the process so that no survivor hangs.
        if self._stop.wait(GRACE_FRACTION * self.timeout_s):
            return
        doing = f" while this rank was in {self.activity}" if self.activity else ""
        print(f"adacomp watchdog: {self.lost.message(self.rank, self.timeout_s)}{doing}; exiting with code "
              f"{EXIT_CODE}", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)

    # --- the main thread ---------------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`CommunicationError` if a peer is already known to be lost (cheap)."""
        if self.lost is not None:
            raise CommunicationError(self.lost.message(self.rank, self.timeout_s))

    def explain(self, exc: BaseException) -> BaseException:
        """The error to raise for ``exc``: one naming the lost rank when ``exc`` is a communication
        failure and a peer stops heartbeating within ``stale_s``; ``exc`` itself otherwise."""
        if not _is_comm_error(exc) or self._stop.is_set():
            return exc
        self._lost_event.wait(self.stale_s + 2 * self.interval_s)
        if self.lost is None:
            return exc
        err = CommunicationError(f"{self.lost.message(self.rank, self.timeout_s)}. Transport said: {exc}")
        err.lost_rank = self.lost.rank  # type: ignore[attr-defined]
        return err

    def stop(self) -> None:
        """Say goodbye and stop the thread. Rank 0 keeps its store up until every peer said
        goodbye (at most ``timeout_s``) and for two heartbeats at least, so that peers still
        working read its goodbye before the store goes and do not take rank 0 for dead."""
        if self._stop.is_set() or os.getpid() != self._pid:  # a forked child owns no watchdog
            return
        with contextlib.suppress(Exception):
            self._store.set(f"bye/{self.rank}", "1")
        if self.rank == 0 and self.lost is None:
            linger = time.monotonic() + 2 * self.interval_s
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline and self.lost is None:
                with contextlib.suppress(Exception):
                    if self._store.check([f"bye/{r}" for r in self._peers]) and time.monotonic() >= linger:
                        break
                time.sleep(self.interval_s / 2)
        self._stop.set()
        atexit.unregister(self.stop)
        self._thread.join(timeout=2 * self.interval_s + 1)


def start(backend: Any, timeout_s: float = 60.0, interval_s: float | None = None) -> Watchdog | None:
    """Start the watchdog for ``backend`` (collective: every rank calls it) and attach it as
    ``backend.watchdog``; a single process needs none (returns None)."""
    existing = getattr(backend, "watchdog", None)
    if existing is not None:
        return existing
    if backend.size() <= 1:
        return None
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 for the watchdog, got {timeout_s}")
    wd = Watchdog(backend, timeout_s, interval_s)
    backend.watchdog = wd
    atexit.register(wd.stop)  # a script that ends without shutdown() must not look dead to its peers
    return wd


def stop(backend: Any) -> None:
    """Stop ``backend``'s watchdog if it has one (call before the backend's own shutdown)."""
    wd = getattr(backend, "watchdog", None)
    if wd is not None:
        wd.stop()
        backend.watchdog = None


@contextlib.contextmanager
def activity(backend: Any, what: str) -> Iterator[None]:
    """Name what the main thread is doing (e.g. "policy 'bytecomp': the plan decision") so that
    the watchdog's exit message says it, should the process be ended while blocked inside."""
    wd = getattr(backend, "watchdog", None)
    if wd is None:
        yield
        return
    before, wd.activity = wd.activity, what
    try:
        yield
    finally:
        wd.activity = before


@contextlib.contextmanager
def guard(backend: Any) -> Iterator[None]:
    """Re-raise communication failures inside the block as errors naming the lost rank."""
    wd = getattr(backend, "watchdog", None)
    if wd is None:
        yield
        return
    wd.check()
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - re-raised, translated or not
        new = wd.explain(exc)
        if new is exc:
            raise
        raise new from exc


__all__ = ["EXIT_CODE", "Lost", "Watchdog", "activity", "guard", "start", "stop"]
