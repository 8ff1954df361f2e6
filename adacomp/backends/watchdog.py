"""Name the rank that died, and never hang on it.

Why: when a peer process dies, gloo fails the pending collective with "Connection closed by peer"
(no rank), MPI just waits, and a rank that is not in a collective at that moment notices nothing.
Launchers (``adacomp run``, torchrun, mpirun) stop the job when a *local* worker dies, but a
worker whose peer vanished on another machine, or whose launcher is gone, must find out by itself.

How: every rank runs one daemon thread that bumps a heartbeat counter in a small
``torch.distributed.TCPStore`` hosted by rank 0 (its address travels by one ``broadcast_object`` at
start, so it works with every backend) and reads everyone else's. A peer whose counter has not
moved for ``timeout_s`` (measured on *this* rank's monotonic clock, so no clock agreement is
needed) is *lost*; a store that stops answering means rank 0 is lost (its process, when the store
refuses connections) or this rank lost its connection to it (when the store times out).

Privacy: the store listens on the job's master address only (``ADACOMP_WATCHDOG_ADDR`` or
``MASTER_ADDR``; a socket bound there is handed to the store), and every key lives under a prefix
derived from a per-job secret, with each value signed by an HMAC of that secret: ``adacomp run``
puts it in ``ADACOMP_JOB_TOKEN``; without it rank 0 draws one and sends it over the job's own
process group. Someone who reaches the port but lacks the secret can neither hide a dead rank
nor fake a lost one.

* :func:`guard` wraps communication: a collective error is re-raised as
  :class:`~adacomp.errors.CommunicationError` naming the lost rank (it waits up to ``timeout_s``
  for the dead peer's heartbeat to go stale) -- or, when every heartbeat is fresh, naming the
  rank that is alive but stuck (its count of guarded calls stopped behind the others').
* If the main thread stays blocked (MPI, or a collective still inside its own timeout), the
  thread prints the same message to stderr and ends the process with :data:`EXIT_CODE` after
  ``0.3 * timeout_s`` more -- unless the lost rank's heartbeat came back meanwhile: a freeze
  shorter than ``timeout_s`` (SIGSTOP, a swapping host) never ends the job, and a rank whose own
  thread was frozen re-baselines its view instead of declaring everyone lost.
* :func:`stop` (also run at interpreter exit) says goodbye (``bye/<rank>``) so a rank that finishes
  early is not taken for dead; rank 0 keeps the store up until every peer said goodbye or was lost.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import hmac
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from adacomp.errors import CommunicationError, RanksDisagreeError

EXIT_CODE = 75  # EX_TEMPFAIL: the job may succeed when restarted from its last checkpoint
STALE_FRACTION = 1.0  # a freeze shorter than timeout_s must never end the job
GRACE_FRACTION = 0.3
TOKEN_ENV = "ADACOMP_JOB_TOKEN"
# Error texts of transports that mean "a peer went away" (gloo, c10d, MPI via our backend).
_COMM_HINTS = ("connection", "closed by peer", "reset by peer", "broken pipe", "timed out", "timeout",
               "gloo", "socket", "peer", "nccl", "mpi")
# Store errors that mean "nobody listens there any more" (the host is up, the process is gone).
_REFUSED_HINTS = ("connection refused", "connection reset", "broken pipe", "closed by peer", "econnrefused")


@dataclass(frozen=True)
class Lost:
    rank: int
    silent_s: float
    why: str
    final: bool = False  # its process is known to be gone (same host): it cannot come back

    def message(self, me: int, timeout_s: float) -> str:
        return (f"rank {self.rank} is lost ({self.why}; no heartbeat for {self.silent_s:.1f} s, limit "
                f"{STALE_FRACTION * timeout_s:.1f} s = {STALE_FRACTION} x timeout_s) - seen by rank {me}. "
                f"Expected every rank to stay alive; check rank {self.rank}'s log (killed? out of memory? "
                "network?) and restart from the last checkpoint, or raise timeout_s if it was only slow")


def is_comm_error(exc: BaseException) -> bool:
    """True for the errors transports raise when a peer went away (gloo, c10d, MPI via our backends);
    not for a verdict every rank reached together (:class:`RanksDisagreeError`): explaining that one
    waited for a lost rank that never comes (~80 s with the default timeout)."""
    if isinstance(exc, RanksDisagreeError):
        return False
    if isinstance(exc, CommunicationError):
        return True
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError"):
        return True
    return isinstance(exc, RuntimeError) and any(h in str(exc).lower() for h in _COMM_HINTS)


def _listen_socket(addr: str) -> socket.socket:
    """A listening TCP socket on ``addr`` (the job's master address) only, on a free port: the
    TCPStore server otherwise listens on every interface."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.bind(sockaddr)
    sock.listen(128)
    return sock


class _Signer:
    """Keys under a prefix only the job knows; values carry an HMAC so forged ones are ignored."""

    def __init__(self, token: str):
        self._key = hashlib.sha256(f"adacomp-watchdog:{token}".encode()).digest()
        self.prefix = "wd-" + hmac.new(self._key, b"prefix", hashlib.sha256).hexdigest()[:32] + "/"

    def key(self, name: str) -> str:
        return self.prefix + name

    def sign(self, name: str, value: str) -> str:
        return value + "." + hmac.new(self._key, f"{name}={value}".encode(), hashlib.sha256).hexdigest()[:32]

    def verify(self, name: str, raw: Any) -> str | None:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        value, _, mac = text.rpartition(".")
        good = hmac.new(self._key, f"{name}={value}".encode(), hashlib.sha256).hexdigest()[:32]
        return value if hmac.compare_digest(mac, good) else None


class Watchdog:
    """Heartbeats of every rank; start with :func:`start`, never directly from user code."""

    def __init__(self, backend: Any, timeout_s: float, interval_s: float | None = None):
        from torch.distributed import TCPStore

        self.rank, self.size = backend.rank(), backend.size()
        self.timeout_s = float(timeout_s)
        self.interval_s = interval_s if interval_s is not None else min(1.0, self.timeout_s / 10)
        self.stale_s = STALE_FRACTION * self.timeout_s
        store_timeout = datetime.timedelta(seconds=max(self.timeout_s, 1.0))
        server = listener = None
        env_token = os.environ.get(TOKEN_ENV) or None
        if self.rank == 0:
            addr = os.environ.get("ADACOMP_WATCHDOG_ADDR") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
            listener = _listen_socket(addr)
            port = listener.getsockname()[1]
            server = TCPStore(addr, port, None, True, timeout=store_timeout, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
            # The launcher's token stays in the environment; a drawn one goes over the process group.
            where = (addr, port, None if env_token else secrets.token_hex(16),
                     hashlib.sha256((env_token or "").encode()).hexdigest())
        else:
            where = None
        addr, port, drawn, fingerprint = backend.broadcast_object(where, 0)
        if drawn is None and hashlib.sha256((env_token or "").encode()).hexdigest() != fingerprint:
            raise CommunicationError(f"rank {self.rank}'s {TOKEN_ENV} differs from rank 0's; expected every rank "
                                     "of the job to get the same one from its launcher")
        self._sign = _Signer(drawn or env_token or "")
        self.address = (addr, port)
        self._listener, self._server = listener, server  # rank 0 keeps the listening store alive
        self._store = TCPStore(addr, port, None, False, timeout=store_timeout)
        self.progress = 0  # guarded communication calls of the main thread (see guard)
        self.call_since: float | None = None  # when the main thread entered the guarded call it is in
        self._put("hb", self.rank, "0:0")
        self._put("who", self.rank, f"{socket.gethostname()}:{os.getpid()}")
        backend.barrier()  # every hb key exists before anyone reads them (get() would block)
        self._peers = [r for r in range(self.size) if r != self.rank]
        # peers on this host, by pid: a process that is gone is known to be dead at once (a frozen
        # one still exists), so a killed local rank need not wait out the freeze tolerance
        self._local_pid: dict[int, int] = {}
        for r, raw in zip(self._peers, self._store.multi_get([self._sign.key(f"who/{r}") for r in self._peers])):
            host, _, pid = (self._sign.verify(f"who/{r}", raw) or "").rpartition(":")
            if host == socket.gethostname() and pid.isdigit():
                self._local_pid[r] = int(pid)
        now = time.monotonic()
        self._seen = {r: ("", now) for r in self._peers}
        self._moved = {r: (-1, now) for r in self._peers}  # last progress count and when it changed
        self._last_tick = self._last_ok = now
        self._inflight_since: float | None = None
        self._io_error: BaseException | None = None
        self._snapshot: tuple[int, list[Any], list[int]] = (0, [], [])
        self._judged = 0
        self._bye: set[int] = set()
        self._bye_at = 0.0  # when this rank first saw a peer's goodbye
        self._beats = 0
        self._pid = os.getpid()
        self.lost: Lost | None = None
        self.activity = ""  # what the main thread is blocked in, for the exit message (see activity())
        self._stop = threading.Event()
        self._lost_event = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"adacomp-watchdog-{self.rank}", daemon=True)
        self._io_thread = threading.Thread(target=self._io, name=f"adacomp-watchdog-io-{self.rank}", daemon=True)
        self._io_thread.start()
        self._thread.start()

    def _put(self, kind: str, rank: int, value: str) -> None:
        name = f"{kind}/{rank}"
        self._store.set(self._sign.key(name), self._sign.sign(name, value))

    # --- the threads -----------------------------------------------------------------------------
    # Two daemon threads: one talks to the store (a call to a host that stopped answering may block
    # for good), the other judges from what it last heard and when, so a hung call is itself news.
    def _io(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._io_once()

    def _io_once(self) -> None:
        self._beats += 1
        self._inflight_since = time.monotonic()
        try:
            self._put("hb", self.rank, f"{self._beats}:{self.progress}")
            beats = self._store.multi_get([self._sign.key(f"hb/{r}") for r in self._peers])
            byes = [r for r in self._peers if r not in self._bye and self._store.check([self._sign.key(f"bye/{r}")])
                    and self._sign.verify(f"bye/{r}", self._store.get(self._sign.key(f"bye/{r}"))) is not None]
        except Exception as exc:  # noqa: BLE001 - the store is rank 0's
            self._io_error = exc
        else:
            self._io_error = None
            self._snapshot = (self._snapshot[0] + 1, beats, byes)
            self._last_ok = time.monotonic()
        finally:
            self._inflight_since = None

    def _tick(self) -> None:
        try:
            self._judge()
        finally:
            self._last_tick = time.monotonic()

    def _judge(self) -> None:
        now = time.monotonic()
        if now - self._last_tick > max(self.stale_s / 2, 3 * self.interval_s):
            # This process was frozen (SIGSTOP, swap) between two ticks: its view is old, not its
            # peers' heartbeats.
            self._seen = {r: (v, now) for r, (v, _) in self._seen.items()}
            self._moved = {r: (p, now) for r, (p, _) in self._moved.items()}
            self._last_ok = now
            if self._inflight_since is not None:
                self._inflight_since = now
        gone = self._gone(now)
        if gone is not None:
            self._declare(gone)
            return
        if 0 not in self._bye and self.rank != 0:
            since = self._inflight_since
            if since is not None and now - since >= self.stale_s:
                where = f"{self.address[0]}:{self.address[1]}"
                self._declare(Lost(0, now - self._last_ok,
                                   f"this rank lost its connection to rank 0's heartbeat store at {where}: a call "
                                   f"got no answer for {now - since:.1f} s (a network outage, or rank 0's host "
                                   "or process froze)"))
                return
            if self._io_error is not None and now - self._last_ok >= self.stale_s:
                self._declare(Lost(0, now - self._last_ok, self._store_failure(self._io_error)))
                return
        seq, beats, byes = self._snapshot
        if seq == self._judged:
            return
        self._judged = seq
        if byes and not self._bye:
            self._bye_at = now
        self._bye.update(byes)
        for r, b in zip(self._peers, beats):
            value = self._sign.verify(f"hb/{r}", b)
            if value is None:  # a forged or damaged value: ignored, the rank's clock keeps running
                value = self._seen[r][0]
            if value != self._seen[r][0]:
                self._seen[r] = (value, now)
                progress = int(value.partition(":")[2] or 0)
                if progress != self._moved[r][0]:
                    self._moved[r] = (progress, now)
                if self.lost is not None and self.lost.rank == r:  # it came back before the deadline
                    self.lost = None
                    self._lost_event.clear()
            elif r not in self._bye and now - self._seen[r][1] >= self.stale_s:
                self._declare(Lost(r, now - self._seen[r][1],
                                   "its heartbeat stopped: the process died or froze, or its network "
                                   "connection was lost"))
                return

    def _gone(self, now: float) -> Lost | None:
        """A local peer whose heartbeat is late by three beats and whose process no longer exists
        (or is a zombie): dead for certain, whatever timeout_s says. A goodbye, read every beat,
        would have arrived before its heartbeat went quiet."""
        for r, pid in self._local_pid.items():
            if r in self._bye or now - self._seen[r][1] < 3 * self.interval_s:
                continue
            if _process_gone(pid):
                return Lost(r, now - self._seen[r][1], f"its process (pid {pid} on this host) exited without "
                            "saying goodbye: it was killed (SIGKILL, the out-of-memory killer) or crashed", final=True)
        return None

    def finished_message(self, ranks: list[int]) -> str:
        who = ", ".join(f"rank {r}" for r in ranks)
        return (f"{who} finished and left the job (said goodbye) while rank {self.rank} was still in a collective "
                f"- seen by rank {self.rank}. Its data ran out first: every rank must enter the same collectives. "
                "Wrap the training loop in `with opt.join():` (adacomp.DistributedOptimizer) or `with model.join():` "
                "(DDP) so that ranks which run out shadow the others, or give every rank the same number of "
                "batches (DistributedSampler(..., drop_last=True))")

    def _store_failure(self, exc: BaseException) -> str:
        text = str(exc).lower()
        where = f"{self.address[0]}:{self.address[1]}"
        if any(h in text for h in _REFUSED_HINTS):
            return f"its process stopped: its heartbeat store at {where} refuses connections ({exc})"
        return (f"this rank lost its connection to rank 0's heartbeat store at {where} ({exc}); a network "
                "outage, or rank 0's host is gone")

    def _declare(self, lost: Lost) -> None:
        if self.lost is None:
            self.lost = lost
            self._lost_event.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._tick()
            since = self.call_since
            if self.lost is None and self._bye and since is not None and \
                    time.monotonic() - max(since, self._bye_at) >= self.stale_s:
                # blocked in a collective a finished peer will never enter (a transport that waits, MPI)
                print(f"adacomp watchdog: {self.finished_message(sorted(self._bye))}; exiting with code {EXIT_CODE}",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_CODE)
            if self.lost is None:
                continue
            # Give the main thread the chance to raise the error itself (guard / check), and the
            # lost rank the chance to come back (not a process known to be gone); if neither
            # happens, end the process so that no survivor hangs in a collective.
            grace_end = time.monotonic() + (2 * self.interval_s if self.lost.final else GRACE_FRACTION * self.timeout_s)
            while self.lost is not None and time.monotonic() < grace_end:
                if self._stop.wait(self.interval_s):
                    return
                self._tick()
            lost = self.lost
            if lost is None:
                continue
            doing = f" while this rank was in {self.activity}" if self.activity else ""
            print(f"adacomp watchdog: {lost.message(self.rank, self.timeout_s)}{doing}; exiting with code "
                  f"{EXIT_CODE}", file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)

    # --- the main thread ---------------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`CommunicationError` if a peer is already known to be lost (cheap)."""
        lost = self.lost
        if lost is not None:
            raise CommunicationError(lost.message(self.rank, self.timeout_s))

    def stuck(self) -> list[tuple[int, int, float]]:
        """Peers alive by heartbeat whose guarded-call count is behind this rank's and has not
        changed for ``stale_s / 2``: ``(rank, its count, seconds since it last changed)``."""
        now = time.monotonic()
        return [(r, p, now - t) for r, (p, t) in sorted(self._moved.items())
                if r not in self._bye and 0 <= p < self.progress and now - self._seen[r][1] < self.stale_s
                and now - t >= self.stale_s / 2]  # not merely one heartbeat behind

    def explain(self, exc: BaseException) -> BaseException:
        """The error to raise for ``exc``: one naming the lost rank when ``exc`` is a communication
        failure and a peer stops heartbeating within ``stale_s``, or naming the live but stuck
        rank when every heartbeat stays fresh; ``exc`` itself otherwise."""
        if not is_comm_error(exc) or self._stop.is_set():
            return exc
        # A peer that finished (said goodbye) closes its connections as it exits: its goodbye is
        # read within a beat or two, so look for it first, then wait for a lost heartbeat.
        # A store call that hangs on a silent host takes up to timeout_s itself before it fails.
        deadline = time.monotonic() + self.stale_s + GRACE_FRACTION * self.timeout_s + 2 * self.interval_s
        finished_by = time.monotonic() + 3 * self.interval_s
        while not self._lost_event.is_set() and not self._bye and time.monotonic() < finished_by:
            self._lost_event.wait(self.interval_s / 4)
        if self.lost is None and self._bye:
            err = CommunicationError(f"{self.finished_message(sorted(self._bye))}. Transport said: {exc}")
            err.finished_ranks = sorted(self._bye)  # type: ignore[attr-defined]
            return err
        self._lost_event.wait(max(0.0, deadline - time.monotonic()))
        lost = self.lost
        if lost is not None:
            err = CommunicationError(f"{lost.message(self.rank, self.timeout_s)}. Transport said: {exc}")
            err.lost_rank = lost.rank  # type: ignore[attr-defined]
            return err
        stuck = self.stuck()
        if not stuck:
            return exc
        names = ", ".join(f"rank {r} (at call {p}, unchanged for {s:.1f} s)" for r, p, s in stuck)
        err = CommunicationError(f"{names} alive (heartbeat fresh) but stuck: its main thread stopped "
                                 f"communicating while rank {self.rank} is at call {self.progress} - seen by rank "
                                 f"{self.rank}. Expected every rank to reach the same collective; look for a "
                                 f"deadlock, an endless loop or a rank-dependent branch there. Transport said: {exc}")
        err.stuck_ranks = [r for r, _, _ in stuck]  # type: ignore[attr-defined]
        return err

    def stop(self) -> None:
        """Say goodbye and stop the thread. Rank 0 keeps its store up until every peer said
        goodbye (at most ``timeout_s``), so that peers still working read its goodbye before the
        store goes and do not take rank 0 for dead. Once every peer said it, none is working: a
        peer sets its stop flag right after its goodbye, so its heartbeat thread takes a store
        that went for the end, not for a lost rank 0."""
        if self._stop.is_set() or os.getpid() != self._pid:  # a forked child owns no watchdog
            return
        if self.lost is None:  # with a silent store the goodbye could block for good
            with contextlib.suppress(Exception):
                self._put("bye", self.rank, "1")
        if self.rank == 0 and self.lost is None:
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline and self.lost is None:
                with contextlib.suppress(Exception):
                    if self._store.check([self._sign.key(f"bye/{r}") for r in self._peers]):
                        break
                time.sleep(self.interval_s / 2)
        self._stop.set()
        atexit.unregister(self.stop)
        self._thread.join(timeout=2 * self.interval_s + 1)
        # The I/O thread may be inside a store call (C++, GIL released). If the interpreter finalises
        # while it is, the thread is ended by pthread_exit when it takes the GIL back, inside a C++
        # destructor: std::terminate ("terminate called without an active exception"). So wait for
        # the call in flight; a healthy store answers in milliseconds, a lost one is not waited for.
        self._io_thread.join(timeout=2 * self.interval_s + 1 if self.lost is not None
                             else max(2 * self.interval_s + 1, min(self.timeout_s, 10.0)))


def _process_gone(pid: int) -> bool:
    """True if ``pid`` no longer runs on this host (absent, or a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


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
    wd.progress += 1  # the main thread reached another collective (read by stuck-rank detection)
    outer = wd.call_since is None
    if outer:
        wd.call_since = time.monotonic()
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - re-raised, translated or not
        new = wd.explain(exc)
        if new is exc:
            raise
        raise new from exc
    finally:
        if outer:
            wd.call_since = None


__all__ = ["EXIT_CODE", "Lost", "Watchdog", "activity", "guard", "is_comm_error", "start", "stop"]
