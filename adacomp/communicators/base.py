"""Communicator contract: move the payloads of one fusion bucket and return the mean over ranks.

The engine hands a communicator a bucket (a list of :class:`Entry`, one per parameter, or one
entry for a whole bucket when the compressor's granularity is ``"bucket"``). ``start`` compresses
the entries and launches the collective(s) without waiting; ``finish`` waits, runs any further
rounds (PowerSGD's Q), decompresses and returns, per entry, the **mean over ranks** of what the
ranks sent, in the entry's shape.

Communicators move payloads only: they never touch error-feedback memory. Where what this rank
actually contributed differs from its compressed payload (AR-Topk's broadcast indices, Ok-Topk's
global selection, a multi-round compressor's last mean, the divisible scheme's parts) the
communicator says so with :meth:`Entry.report`; the engine updates the memory from that report
once ``finish`` has returned (:func:`adacomp.engine.error_feedback.settle`).

The optimizer calls ``start`` for buckets in bucket-index order and ``finish`` in the same order on
every rank; a communicator must launch its collectives in an order that depends only on that
schedule and on the bucket contents' *shapes*, never on timing (DESIGN.md, ordering rule).
"""
from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from adacomp.backends.base import Backend
from adacomp.compressors.base import Compressor
from adacomp.memories.base import Memory, Pieces
from adacomp.errors import IncompatibleComponentsError
from adacomp.engine.metrics import StepStats
from adacomp.registry import Registry

@dataclass
class Charge:
    """One error-feedback update the engine owes after ``finish``: ``memory`` keeps ``tensor``
    minus what ``compressor`` reconstructs from ``payload`` (what this rank contributed)."""

    memory: Memory
    tensor: Tensor
    name: str
    compressor: Any
    payload: list[Tensor]
    ctx: Any

    def apply(self) -> None:
        self.memory.update(self.tensor, self.name, self.compressor, self.payload, self.ctx)


@dataclass
class Entry:
    """One tensor travelling through a communicator.

    ``tensor`` is the error-compensated gradient in its original shape; ``payload`` / ``ctx`` are
    filled when it is compressed. The payload travels; ``ctx`` stays on this rank. A communicator
    whose contribution differs from ``payload`` says so with :meth:`report`; one that keeps a
    declared memory of its own adds that memory's update with :meth:`also_charge`. A payload the
    communicator wrote into its collective's own buffer (a cast under ``allreduce`` with no memory
    to update) holds the ranks' mean once ``finish`` has returned.
    """

    name: str
    tensor: Tensor
    compressor: Compressor
    memory: Memory
    payload: list[Tensor] | None = None
    ctx: Any = None
    sent: Charge | None = None
    extra: list[Charge] = field(default_factory=list)
    dest: Tensor | None = None
    """Where the communicator may write this entry's mean instead of a buffer of its own: the raw
    gradient, set by the engine only where nothing reads it after compensation (the compensated
    sum lives in another buffer), as DDP averages into its gradients' own bucket memory. Why: the
    hook then has no copy into DDP's bucket to make (cost_notes item 46), and the optimizer keeps one
    model-size output buffer less."""

    def report(self, compressor: Any, payload: list[Tensor], ctx: Any) -> None:
        """What this rank actually contributed, in place of the compressed payload."""
        self.sent = Charge(self.memory, self.tensor, self.name, compressor, payload, ctx)

    def also_charge(self, charge: Charge) -> None:
        self.extra.append(charge)

    def charges(self) -> list[Charge]:
        """Every memory update this entry owes: its route memory's (by default from the compressed
        payload) and any the communicator added."""
        if self.sent is None:
            assert self.payload is not None, f"{self.name}: the entry was never compressed"
            self.sent = Charge(self.memory, self.tensor, self.name, self.compressor, self.payload, self.ctx)
        return [self.sent, *self.extra]


registry: Registry["Communicator"] = Registry("communicator", "adacomp.communicators")
register = registry.register


@dataclass
class CommEnv:
    """What a communicator may use during one step: the transport, the step counter and the
    step's statistics."""

    backend: Backend
    stats: StepStats
    step: int = 0
    bucket_index: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # average as DDP's reducer does (each rank's buffer times 1 / world, then the sum: bitwise DDP's
    # where the buffer is DDP's bucket, at any world size) instead of Horovod's sum, then divide
    predivide: bool = False


class Communicator:
    """Base class. Subclasses implement :meth:`start` and :meth:`finish` and declare in
    :meth:`check` which compressors they can carry."""

    name: ClassVar[str] = "base"

    def check(self, compressor: Compressor) -> None:
        """Raise :class:`IncompatibleComponentsError` if ``compressor``'s payload cannot travel here."""

    def start(self, entries: list[Entry], env: CommEnv) -> Any:
        """Compress ``entries`` and launch the collective(s); return a pending object."""
        raise NotImplementedError(f"{type(self).__name__} must implement start()")

    def finish(self, pending: Any, env: CommEnv) -> list[Tensor]:
        """Wait for ``pending`` and return the mean over ranks per entry, in each entry's shape."""
        raise NotImplementedError(f"{type(self).__name__} must implement finish()")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"communicator {self.name!r} is stateless but got keys {sorted(state)}")

    def memories(self) -> list[Memory]:
        """Error-feedback memories this communicator keeps itself (the divisible scheme's
        second-stage error). Declared so the engine rolls them back and rescales them with the
        route memories, and checkpoints reshard them by their own rule. A communicator that
        declares memories keeps its whole state in them."""
        return []

    def reshard(self, states: list[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
        """This communicator's state for ``rank`` of ``world`` from every old rank's state (rank
        order): by default old rank ``rank % len(states)``'s (thresholds, bounds: equal on every
        rank). A communicator whose state is a declared memory defers to that memory's rule."""
        return states[rank % len(states)]

    def owed(self, states: list[dict[str, Any]]) -> dict[str, Tensor]:
        """What the ranks' declared memories still owe (see ``Memory.owed``); none by default."""
        return {}

    # Offloading (ByteComp §4.2 Dimension 2, "compress on CPU") -------------------------------
    #: True when ``start`` compresses every entry with :meth:`precompress` before any collective,
    #: so the optimizer may run that stage on its CPU worker thread and call ``start`` later.
    offloadable: ClassVar[bool] = False
    def pieces(self, name: str, numel: int, world: int) -> Pieces | None:
        """How :meth:`compress_one` will compress an entry's flat tensor: ``(key, lo, hi)`` spans,
        each compressed on its own under ``key``; None (the default) for the whole tensor under its
        name. Error feedback hands this to the memory, so a compressor may select while it writes
        the compensated sum (``compensate_into``) of each span it will compress."""
        return None

    def precompress(self, entries: list[Entry], world: int) -> None:
        """Compress every entry not compressed yet. Touches no collective, no memory and no step
        statistics, so it is safe on a worker thread."""
        for e in entries:
            if e.payload is None:
                self.compress_one(e)

    def compress_one(self, e: Entry) -> None:
        e.payload, e.ctx = e.compressor.compress(e.tensor, e.name)

    # Shared helpers ---------------------------------------------------------------------------
    def compress_entries(self, entries: list[Entry], env: CommEnv) -> None:
        """Compress every entry not compressed yet (an offloaded entry already is). Records
        compress time and gain."""
        with env.stats.timing("compress"):
            self.precompress(entries, env.backend.size())
        self.record(entries, env)

    def record(self, entries: list[Entry], env: CommEnv) -> None:
        """Bytes sent, dense bytes and compression gain of compressed ``entries``."""
        for e in entries:
            env.stats.bytes_sent += self.sent_bytes(e)
            env.stats.dense_bytes += e.tensor.numel() * e.tensor.element_size()
            if e.compressor.sparse and env.stats.track_gain:  # gain E||g_c||^2 / E||g_e||^2 (AR-Topk §2-C3)
                env.stats.add_gain_of(self.sent_values(e), e.tensor)

    def sent_bytes(self, e: Entry) -> int:
        """The bytes of what ``e`` sends (its compressed payload)."""
        assert e.payload is not None  # compressed entries carry a payload
        return sum(p.numel() * p.element_size() for p in e.payload)

    def sent_values(self, e: Entry) -> Tensor:
        """A sparse payload's values (the gain's numerator)."""
        assert e.payload is not None
        return e.payload[0]

    @staticmethod
    def incompatible(comm: str, compressor: Compressor, why: str,
                     fits: list[str] | None = None) -> IncompatibleComponentsError:
        """The error a ``check`` raises; ``fits`` defaults to every other communicator that fits."""
        if fits is None:
            fits = [] if _IN_FITTING.get() else [n for n in fitting(compressor) if n != comm]
        return IncompatibleComponentsError(
            "communicator",
            f"compressor {compressor.name!r} cannot use communicator {comm!r}: {why}. "
            f"Communicators that fit: {', '.join(fits)}")


def get(name: str, **params: Any) -> Communicator:
    return registry.get(name, **params)


def names() -> list[str]:
    return registry.names()


_IN_FITTING: ContextVar[bool] = ContextVar("adacomp_in_fitting", default=False)


def fitting(compressor: Compressor) -> list[str]:
    """Names of communicators that accept ``compressor`` (checks called from here do not recurse)."""
    out = []
    token = _IN_FITTING.set(True)
    try:
        for n in names():
            try:
                registry.cls(n)().check(compressor)
            except IncompatibleComponentsError:
                continue
            except TypeError:  # needs constructor arguments; assume it fits
                pass
            out.append(n)
    finally:
        _IN_FITTING.reset(token)
    return out
