"""One communication round, the same for both front ends.

begin -> launch buckets in order -> vote -> finish in order (memories settled) -> roll back or hand
the means over.

:class:`adacomp.engine.step_engine.StepEngine` (the optimizer: gradients from ``p.grad`` hooks,
means written to ``p.grad``) and :class:`adacomp.engine.ddp.HookState` (gradients from DDP's
buckets, means written into them) are thin adapters around :class:`Rounds`: they say where
gradients come from and where the means go; everything that decides *what* a round does
(loss-scale units, which state a round may change and so must be able to undo, the non-finite
vote, the rollback, the error raised) lives here once, so the two front ends cannot drift apart.
"""
from __future__ import annotations

import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from adacomp import devices
from adacomp.backends.base import Backend, Handle
from adacomp.communicators.base import CommEnv
from adacomp.engine import error_feedback
from adacomp.engine.error_feedback import Entry, LossScale, Rollback
from adacomp.engine.metrics import StepStats
from adacomp.engine.optimizer_state import round_components
from adacomp.engine.routes import Bucket, RouteTable
from adacomp.errors import NonFiniteGradientError

NONFINITE_MODES = ("propagate", "skip", "raise")


@dataclass
class RoundState:
    """Everything one round knows; a new object per round, so nothing leaks across rounds.
    The fields after ``order`` are the optimizer adapter's (hooks, accumulation, offload)."""

    stats: StepStats
    env: CommEnv
    active: bool = True  # False: this rank has joined (uneven inputs) and only shadows
    report_active: bool = True  # what the vote says of this rank (the outer loop's last window: sent, not active)
    keep_outputs: bool = False  # hand the means over even for a shadowing rank (the outer loop needs them)
    used: set[str] = field(default_factory=set)  # parameters this rank contributed in this round
    nonfinite: list[str] = field(default_factory=list)  # this rank's parameters with NaN / Inf
    finite_sums: list[tuple[str, Tensor]] = field(default_factory=list)  # accelerator gradients: checked at the vote
    order: list[tuple[Bucket, list[Entry], Any]] = field(default_factory=list)  # launched: bucket, entries, handle
    launched: bool = False
    passes: int = 0  # finished backward passes in this round
    ready: list[int] = field(default_factory=list)  # per bucket: gradients in
    jobs: list[Future | None] = field(default_factory=list)  # per bucket: offloaded compression
    sparse: set[str] = field(default_factory=set)  # parameters whose gradient arrived sparse
    next_launch: int = 0
    callback_queued: bool = False
    comm_begun: bool = False  # the round's first collective was issued (announcement, first-round check)
    announced: bool = False  # hvd.join() already received this round's announcement (adacomp.engine.hvd_join)
    announcement: Any = None  # the announcement's allgather, waited for before the vote


@dataclass
class Vote:
    """The outcome of a round's vote allreduce, identical on every rank."""

    nonfinite: bool
    used_by_any: list[bool]
    active_ranks: list[int]


class Rounds:
    """Runs rounds over one :class:`RouteTable`. ``backend`` is a callable so the DDP hook can
    resolve its process group at the first round; ``extra_state`` lists stateful objects a round
    may change beyond the table's components (the optimizer's policy)."""

    #: run the accelerators' deferred non-finite check on CPU gradients too (tests exercise that path
    #: without a GPU; results are the same, only when the check is read differs)
    defer_on_cpu: ClassVar[bool] = False

    def __init__(self, table: RouteTable, backend: Callable[[], Backend], nonfinite: str, loss_scale: LossScale,
                 extra_state: Callable[[], list[Any]] | None = None, warn_unfollowed_scale: bool = False):
        self.table = table
        self._backend = backend
        self.nonfinite = nonfinite
        self.loss_scale = loss_scale
        self._extra_state = extra_state
        self.rollback = Rollback()
        self.last_vote: Vote | None = None
        # the DDP hook cannot find a GradScaler itself (the optimizer adopts the one calling its step)
        self._warned_scale = not warn_unfollowed_scale

    @property
    def backend(self) -> Backend:
        return self._backend()

    def stateful(self) -> tuple[list[Any], list[Any]]:
        """(memories, other stateful components) a round may change: what a non-finite round
        rolls back. Listed by the route table (every route's memory and communicator, every
        compressor, fused ones included), so nothing a communicator keeps can be missed."""
        memories, others = round_components(self.table)
        if self._extra_state is not None:
            others += self._extra_state()
        return memories, others

    # --- a round ----------------------------------------------------------------------------------
    def begin(self, stats: StepStats, step: int, active: bool = True) -> RoundState:
        st = RoundState(stats, CommEnv(self.backend, stats, step), active=active)
        if active:
            memories, others = self.stateful()
            self.loss_scale.sync(memories, self.table.unique_compressors())
            self.rollback.keep(memories, others)
        return st

    @staticmethod
    def check_finite(st: RoundState, name: str, g: Tensor) -> None:
        """Note ``name`` in ``st.nonfinite`` if ``g`` holds a NaN or Inf.

        On the CPU: a sum is one cheap pass and is NaN/Inf whenever g holds one; a finite but
        overflowing sum is confirmed with the exact test. On an accelerator reading a result back
        waits for the device, and one wait per gradient inside backward stops the host from queueing
        ahead (issue 33: ~0.1 ms per tensor on an H100). There the sum is kept on the device in
        float64, which no sum of float32 / float16 values overflows (so it is non-finite exactly when
        an element is), and all of them are read at once when the round votes."""
        if devices.reads_wait(g) or Rounds.defer_on_cpu:
            st.finite_sums.append((name, g.sum(dtype=torch.float64)))
        elif not torch.isfinite(g.sum()) and not torch.isfinite(g).all():
            st.nonfinite.append(name)

    @staticmethod
    def settle_finite(st: RoundState) -> None:
        """The accelerator gradients' checks, read back with one wait (see :meth:`check_finite`)."""
        if not st.finite_sums:
            return
        bad = (~torch.isfinite(torch.stack([s.to(st.finite_sums[0][1].device) for _, s in st.finite_sums]))).tolist()
        st.nonfinite += [name for (name, _), b in zip(st.finite_sums, bad) if b]
        st.finite_sums.clear()

    def launch(self, st: RoundState, b: Bucket, grads: list[Tensor], used: list[bool] | None = None) -> None:
        """Compensate, compress and start bucket ``b`` (``used[i]`` False: this rank contributes
        zeros for that parameter and leaves its residual alone)."""
        with st.stats.timing("compress"):
            entries = error_feedback.entries(b, grads, self.table.compressors, used, self.backend.size(), dest=True)
        self.start(st, b, entries)

    def start(self, st: RoundState, b: Bucket, entries: list[Entry]) -> None:
        """Start bucket ``b`` from entries already compensated (and maybe compressed off-thread)."""
        st.launched = True
        st.env.bucket_index = b.index
        st.order.append((b, entries, b.communicator.start(entries, st.env)))

    def complete(self, st: RoundState) -> tuple[list[list[Tensor]], Vote] | None:
        """Vote, finish every launched bucket in launch order and settle its error feedback (the
        memories keep what each rank did not contribute), then roll back (a non-finite vote) or
        keep. Returns the means per launched bucket and the vote; None for a rank that only
        shadowed the collectives (joined) and needs no outputs."""
        handle = self._start_vote(st)
        outs: list[list[Tensor]] = []
        for b, entries, pending in st.order:
            st.env.bucket_index = b.index
            t0 = time.perf_counter()
            outs.append(b.communicator.finish(pending, st.env))
            dt = time.perf_counter() - t0
            with st.stats.timing("compress"):
                error_feedback.settle(entries)
            st.stats.bucket_sync_s[b.index] = st.stats.bucket_sync_s.get(b.index, 0.0) + dt
        vote = self._read_vote(handle.wait())
        self.last_vote = vote
        if not st.active and not st.keep_outputs:
            return None
        if vote.nonfinite:
            self.rollback.restore()
            if self.nonfinite == "raise":
                self._raise_nonfinite(st)
            st.stats.extra["nonfinite"] = 1.0
            self._warn_unfollowed_scale()
        self.rollback.clear()
        return outs, vote

    def _warn_unfollowed_scale(self) -> None:
        """A skipped round is what a GradScaler overflow looks like from here; the scaler then lowers
        its scale, and residuals kept in the old units would be off by that factor. Said once."""
        if self.loss_scale.scaler is not None or self._warned_scale:
            return
        if all(m.name == "none" for m in self.stateful()[0]):
            return  # no residuals to be in the wrong units
        self._warned_scale = True
        warnings.warn("adacomp skipped a round with non-finite gradients. If a GradScaler's overflow caused it, the "
                      "scaler now changes its scale and error-feedback residuals stay in the old units unless adacomp "
                      "follows it: pass grad_scaler=<your GradScaler> to adacomp.ddp.hook / adacomp.ddp.register / "
                      "adacomp.DistributedOptimizer (adacomp.integrations.lightning and .accelerate pass the "
                      "framework's)", RuntimeWarning, stacklevel=2)

    # --- the vote ---------------------------------------------------------------------------------
    def _start_vote(self, st: RoundState) -> Handle:
        names = self.table.params
        n, world = len(names), self.backend.size()
        flag = torch.zeros(1 + n + world)
        self.settle_finite(st)
        flag[0] = 1.0 if st.nonfinite else 0.0
        if st.used:
            index = self.table.index_of
            flag[[1 + index[u] for u in st.used]] = 1.0
        if st.active and st.report_active:
            flag[1 + n + self.backend.rank()] = 1.0
        return self.backend.allreduce_async(flag, average=False)

    def _read_vote(self, total: Tensor) -> Vote:
        n = len(self.table.params)
        vals = total.tolist()
        return Vote(vals[0] > 0, [v > 0 for v in vals[1:1 + n]], [r for r, v in enumerate(vals[1 + n:]) if v > 0])

    def _raise_nonfinite(self, st: RoundState) -> None:
        where = self.backend.allgather_object(st.nonfinite[:5])
        bad = {r: names for r, names in enumerate(where) if names}
        raise NonFiniteGradientError(
            "non-finite gradient (NaN or Inf) on " + "; ".join(f"rank {r}: {', '.join(n)}" for r, n in bad.items())
            + ". Every component state was left as before this step. Use loss scaling (torch.amp.GradScaler, "
            "with `nonfinite: propagate`, the default) or lower the learning rate; `nonfinite: skip` drops such steps.")


def per_parameter(b: Bucket, outs: list[Tensor], numels: list[int]) -> list[Tensor]:
    """A fused bucket's one flat mean split back into its parameters' pieces (flat views)."""
    if b.fused_compressor is None:
        return outs
    flat, off, pieces = outs[0].reshape(-1), 0, []
    for k in numels:
        pieces.append(flat[off:off + k])
        off += k
    return pieces


def poisoned(b: Bucket, vote: Vote) -> bool:
    """After a non-finite vote, means that went through a compressor are set to NaN on every rank,
    so GradScaler (or any finite check) sees the same non-finite step everywhere; uncompressed ones
    hold the plain average."""
    return vote.nonfinite and b.route.compressor.name != "none"


__all__ = ["NONFINITE_MODES", "RoundState", "Rounds", "Vote", "per_parameter", "poisoned"]
