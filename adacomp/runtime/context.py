"""The process's distributed context: which backend ``adacomp.init()`` started.

Horovod users call ``init()`` once and then ``rank()`` / ``size()`` anywhere, so one context object
per process is unavoidable; it is created only by ``init()`` and torn down by ``shutdown()``.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from adacomp import backends
from adacomp.backends.base import Backend

_current: Backend | None = None


class NotInitializedError(ValueError, RuntimeError):
    """Asked for the backend under a launcher before ``init()``. Horovod raises ValueError from
    ``rank()`` / ``DistributedOptimizer`` and HorovodInternalError (a RuntimeError) from its
    collectives there; this is both, so either ``except`` catches it."""


@dataclass(frozen=True)
class Topology:
    """Where this process sits, in Horovod's terms: ``local_size`` processes share its host;
    ``cross_size`` processes share its ``local_rank`` (one per host in a homogeneous job) and
    ``cross_rank`` is its position among them. Learnt once at ``init()`` (one small allgather),
    so asking later is local and never a collective that only one rank enters."""

    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1


_topology: Topology = Topology()


def _discover(be: Backend) -> Topology:
    if be.size() <= 1:
        return Topology()
    seats = be.allgather_object((socket.gethostname(), be.local_rank()))
    host, local = seats[be.rank()]
    peers = [r for r, (_, lr) in enumerate(seats) if lr == local]
    return Topology(sum(1 for h, _ in seats if h == host), peers.index(be.rank()), len(peers))


def init(backend: str = "auto", config: Any = None, timeout_s: float | None = None) -> Backend:
    """Start the transport (idempotent). ``backend='auto'`` follows the launcher (torchrun /
    ``adacomp run`` -> torch, mpirun -> mpi, horovodrun -> horovod, none -> a single process).
    ``config`` (path, dict or Config) supplies ``backend`` and ``timeout_s`` when given."""
    global _current, _topology
    if _current is not None:
        return _current
    if config is not None:
        from adacomp.config import load
        cfg = load(config)
        if backend == "auto":
            backend = cfg.backend
        if timeout_s is None:
            timeout_s = cfg.timeout_s
    name = backends.detect() if backend == "auto" else backend
    kwargs = {} if name == "local" else {"timeout_s": 60.0 if timeout_s is None else timeout_s}
    from adacomp.backends.shaped import wrap_from_env
    # ADACOMP_SHAPE_* / ADACOMP_NETEM_SCHEDULE add emulated latency (docs/netem.md); otherwise a no-op.
    _current = wrap_from_env(backends.create(name, **kwargs))
    _topology = _discover(_current)
    if _current.size() > 1:  # heartbeats name a rank that dies instead of hanging on it
        from adacomp.backends import watchdog
        watchdog.start(_current, kwargs.get("timeout_s", 60.0))
    return _current


def current() -> Backend:
    """The running backend; starts a single-process one if ``init()`` was never called and no
    launcher environment is present, otherwise asks for ``init()``."""
    if _current is None:
        if backends.detect() == "local":
            return init("local")
        raise NotInitializedError("adacomp has not been initialized; use adacomp.init() (adacomp.init() has not "
                                  "been called; call it once at the start of the script)")
    return _current


backends.provide_process_backend(current)


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()`` (Horovod's ``hvd.is_initialized``)."""
    return _current is not None


def topology() -> Topology:
    """This process's :class:`Topology` (starts a single-process context like :func:`current`)."""
    current()
    return _topology


def shutdown() -> None:
    """Stop the watchdog and release the transport; ``init()`` may be called again afterwards."""
    global _current, _topology
    if _current is not None:
        from adacomp.backends import watchdog
        watchdog.stop(_current)
        _current.shutdown()
        _current = None
        _topology = Topology()
