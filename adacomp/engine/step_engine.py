"""The step engine: from gradient hooks to averaged ``p.grad``, with DDP's contract.

One gradient's path (docs/architecture.md draws it):

1. a post-accumulate-grad hook on the parameter fires inside backward (:meth:`StepEngine._on_grad`);
   the first hook of a backward pass queues :meth:`StepEngine._on_backward_end` on the autograd
   engine, as DDP's reducer does;
2. when every gradient of its fusion bucket is in, buckets are launched strictly in bucket-index
   order (:meth:`StepEngine._launch_ready`): :func:`adacomp.engine.error_feedback.entries` compensates,
   the communicator compresses and starts its collective;
3. at the end of the last backward pass of a round the callback launches what is left (buckets
   of parameters nobody used), one small *vote* allreduce (non-finite flag, which parameters any
   rank used, which ranks are still active under ``join``), finishes every bucket in order,
   settles error feedback from what each communicator reports this rank contributed
   (:func:`adacomp.engine.error_feedback.settle`) and writes the averaged gradients
   (:meth:`StepEngine._finish_round`).

So when ``loss.backward()`` returns, every parameter's ``.grad`` holds the average, and
``optimizer.step()`` only steps. A *round* is the backward passes up to one communication:
``backward_passes_per_step`` passes, or the passes outside ``no_sync()`` blocks. All per-round
bookkeeping lives in one :class:`RoundState`, replaced as a whole each round.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from adacomp.backends import watchdog
from adacomp.backends.base import Backend
from adacomp.engine import hvd_join
from adacomp.engine.error_feedback import LossScale
from adacomp.engine.metrics import StepStats
from adacomp.engine.offload import OffloadWorker
from adacomp.engine.round import NONFINITE_MODES, RoundState, Rounds, Vote, per_parameter, poisoned
from adacomp.engine.routes import Bucket, RouteTable

_OWNER = "_adacomp_engine"  # on an engine's gradient hook: a weak reference to the engine


@dataclass(frozen=True)
class EngineOptions:
    """``backward_passes_per_step`` (passes per round), ``sum`` (op=Sum instead of Average),
    ``nonfinite`` (see :data:`NONFINITE_MODES` and docs/config.md), ``sparse_as_dense``. Sparse
    gradients always travel dense; without ``sparse_as_dense`` they are handed back sparse.
    ``track_gain``: measure the compression gain in each step's statistics (the policy reads it)."""

    backward_passes_per_step: int = 1
    sum: bool = False
    nonfinite: str = "propagate"
    sparse_as_dense: bool = False  # Horovod's flag: hand sparse gradients back dense
    track_gain: bool = False


class StepEngine:
    """The optimizer's front end to :class:`~adacomp.engine.round.Rounds`: gradient hooks, local
    accumulation, buckets launched in index order as they fill (or offloaded), ``p.grad`` written."""

    def __init__(self, table: RouteTable, backend: Backend, options: EngineOptions, loss_scale: LossScale,
                 extra_state: Callable[[], list[Any]] | None = None,
                 on_first_round: Callable[[], None] | None = None):
        self.table = table
        self.backend = backend
        self.options = options
        self.loss_scale = loss_scale
        self.rounds = Rounds(table, lambda: backend, options.nonfinite, loss_scale, extra_state)
        self._on_first_round = on_first_round
        self.offload = OffloadWorker()
        self.state: RoundState | None = None
        self.step_stats: StepStats = StepStats(step=0, track_gain=options.track_gain)
        self.step_index = 0
        self.synced = False  # gradients hold a finished round's averages
        self.skip_update = False  # nonfinite: skip voted this step
        self.no_sync_depth = 0
        self.joined = False  # inside join(): this rank has no more data
        # rounds announce themselves under this id, so a rank in hvd.join() can answer them (hvd_join)
        self.announce_id: int | None = None
        self._param = dict(table.params)
        self._hooks: list[Any] = []
        # called with (name, local gradient) as backward produces it, before anything is compensated
        # or sent (policies that read raw gradients, L-GreCo §4); detach() drops them with the hooks
        self.observers: list[Callable[[str, Tensor], None]] = []

    @property
    def last_vote(self) -> Vote | None:
        return self.rounds.last_vote

    # --- hooks ------------------------------------------------------------------------------------
    def attach(self, params: list[tuple[str, Tensor]]) -> None:
        shared = []
        for n, p in params:
            hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
            if any(getattr(h, _OWNER, lambda: None)() not in (None, self) for h in hooks.values()):
                shared.append(n)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(n)))
        if shared:
            listed = ", ".join(shared[:3]) + (", ..." if len(shared) > 3 else "")
            warnings.warn(f"adacomp: {len(shared)} parameter(s) ({listed}) are already attached to another "
                          "DistributedOptimizer whose hooks are still registered: both will average their "
                          "gradients in every backward (twice the traffic; compressed twice). Call "
                          "old_optimizer.remove_hooks() before wrapping the parameters again",
                          RuntimeWarning, stacklevel=3)

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.observers = []
        self.offload.stop()

    def reindex(self) -> None:
        """The parameter list grew (``add_param_group``)."""
        self._param = dict(self.table.params)

    def _make_hook(self, name: str) -> Callable[[Tensor], None]:
        def hook(p: Tensor) -> None:
            self._on_grad(name)
        setattr(hook, _OWNER, weakref.ref(self))  # whose hook it is (attach's check)
        return hook

    def _on_grad(self, name: str) -> None:
        if self.observers:
            g = self._param[name].grad
            if g is not None:
                for fn in self.observers:
                    fn(name, g)
        st = self.state or self._begin_round()
        self.synced = False
        st.used.add(name)
        if not st.callback_queued:
            st.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if self.no_sync_depth or st.passes + 1 < self.options.backward_passes_per_step:
            return  # local accumulation; this pass does not communicate
        b = self.table.bucket_of[name]
        st.ready[b.index] += 1
        if st.ready[b.index] == len(b.names):
            with watchdog.guard(self.backend):
                if b.route.offload:
                    self._submit(st, b)
                self._launch_ready(st)

    def _on_backward_end(self) -> None:
        st = self.state
        if st is None:
            return
        st.callback_queued = False
        if self.no_sync_depth:
            return
        st.passes += 1
        if st.passes >= self.options.backward_passes_per_step:
            self.finish()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; the first one outside communicates."""
        self.no_sync_depth += 1
        try:
            yield
        finally:
            self.no_sync_depth -= 1

    # --- a round ----------------------------------------------------------------------------------
    def _begin_round(self, active: bool = True) -> RoundState:
        n = len(self.table.buckets)
        st = self.rounds.begin(self.step_stats, self.step_index, active)
        st.ready, st.jobs = [0] * n, [None] * n
        self.state = st
        return st

    def _comm_begins(self, st: RoundState) -> None:
        """Before the round's first collective, once: its announcement (an async one-int64 allgather
        that tells a rank inside ``hvd.join()`` which optimizer's round follows, see
        :mod:`adacomp.engine.hvd_join`), then the first round's weights check; both at the same point
        on every rank, a joined rank's shadow round included."""
        if st.comm_begun:
            return
        st.comm_begun = True
        if self.announce_id is not None and not st.announced:
            code = hvd_join.round_code(self.announce_id) if st.active else hvd_join.JOINED
            st.announcement = hvd_join.announce(self.backend, code)
        if self._on_first_round is not None:  # one collective, at the same point on every rank
            check, self._on_first_round = self._on_first_round, None
            check()

    def _grads(self, st: RoundState, b: Bucket) -> tuple[list[Tensor], list[bool]]:
        """This rank's gradients of bucket ``b`` (zeros for parameters it did not use) and which
        it used; sparse gradients are densified (Horovod's ``sparse_as_dense``)."""
        grads: list[Tensor] = []
        used: list[bool] = []
        for n in b.names:
            p = self._param[n]
            g = p.grad
            u = st.active and n in st.used and g is not None
            if g is None or not u:
                g = torch.zeros_like(p)
            else:
                if g.is_sparse:
                    st.sparse.add(n)
                    g = g.to_dense()
                Rounds.check_finite(st, n, g)
            grads.append(g)
            used.append(u)
        return grads, used

    def _submit(self, st: RoundState, b: Bucket) -> None:
        grads, used = self._grads(st, b)
        st.jobs[b.index] = self.offload.submit(b, grads, self.table.compressors, used, self.backend.size())

    def _launch_ready(self, st: RoundState, block: bool = False) -> None:
        """Launch ready buckets in index order; an offloaded bucket whose compression is still
        running stops the walk unless ``block`` (then it is waited for)."""
        buckets = self.table.buckets
        while st.next_launch < len(buckets):
            b = buckets[st.next_launch]
            job = st.jobs[b.index]
            if st.ready[b.index] != len(b.names) or (job is not None and not block and not job.done()):
                return
            self._launch(st, b)
            st.next_launch += 1

    def _launch(self, st: RoundState, b: Bucket) -> None:
        self._comm_begins(st)
        job = st.jobs[b.index]
        if job is not None:
            entries, dt = job.result()  # re-raises a failure of the worker here
            st.jobs[b.index] = None
            st.stats.extra["offload_s"] = st.stats.extra.get("offload_s", 0.0) + dt
            self.rounds.start(st, b, entries)
        else:
            grads, used = self._grads(st, b)
            self.rounds.launch(st, b, grads, None if all(used) else used)

    def finish(self) -> None:
        """Finish the round in flight (if any): launch what is left, vote, finish every bucket in
        order, write the averaged gradients. Called at the end of backward, or by ``step()`` /
        ``synchronize()`` after fewer passes than ``backward_passes_per_step`` (Horovod)."""
        st = self.state
        if st is None:
            return
        with watchdog.guard(self.backend):
            try:
                self._finish_round(st)
            finally:
                self.state = None

    def _finish_round(self, st: RoundState) -> None:
        self._comm_begins(st)
        for b in self.table.buckets[st.next_launch:]:  # parameters nobody used count as ready
            if st.ready[b.index] != len(b.names):
                st.ready[b.index] = len(b.names)
                if b.route.offload:
                    self._submit(st, b)
        self._launch_ready(st, block=True)
        if st.announcement is not None:  # launched before the buckets: long done
            st.announcement.wait()
            st.announcement = None
        result = self.rounds.complete(st)
        if result is None:
            return  # a joined rank only shadowed the collectives
        outs, vote = result
        self.skip_update = vote.nonfinite and self.options.nonfinite == "skip"
        for (b, _, _), bucket_outs in zip(st.order, outs):
            self._write(st, b, bucket_outs, vote)
        self.synced = True

    # --- writing gradients ------------------------------------------------------------------------
    def _write(self, st: RoundState, b: Bucket, outs: list[Tensor], vote: Vote) -> None:
        """Install the averaged gradients, as DDP does: a parameter no rank used keeps its
        ``.grad`` (None stays None); results are handed over without a copy when dtype and device
        match (DDP's ``gradient_as_bucket_view``). After a non-finite vote, gradients that went
        through a compressor are set to NaN on every rank, so GradScaler (or any finite check)
        sees the same non-finite step everywhere; uncompressed ones hold the plain average."""
        outs = per_parameter(b, outs, [self._param[n].numel() for n in b.names])
        poison = poisoned(b, vote)
        scale = float(self.backend.size()) if self.options.sum else 1.0
        for n, out in zip(b.names, outs):
            if not vote.used_by_any[self.table.index_of[n]]:
                continue
            p = self._param[n]
            g = p.grad
            out = out.view(p.shape)
            if n in st.sparse and not self.options.sparse_as_dense:
                p.grad = out.to(p.dtype).to_sparse(g.sparse_dim())  # type: ignore[union-attr]
                g = None
            elif g is None or g.is_sparse:
                p.grad = out if (out.dtype == p.dtype and out.device == p.device and out.is_contiguous()) \
                    else out.to(device=p.device, dtype=p.dtype).clone()
            elif out.data_ptr() != g.data_ptr():
                if out.dtype == g.dtype and out.device == g.device and out.is_contiguous():
                    p.grad = out
                else:
                    g.copy_(out)
            g = p.grad
            if poison:
                g.fill_(float("nan"))  # type: ignore[union-attr]
            elif scale != 1.0:
                g.mul_(scale)  # type: ignore[union-attr]

    # --- step boundaries --------------------------------------------------------------------------
    def end_step(self, steps: int) -> StepStats:
        """The optimizer stepped (or skipped): start a fresh statistics record."""
        stats = self.step_stats
        self.step_index = steps
        self.step_stats = StepStats(step=steps, track_gain=self.options.track_gain)
        self.synced = False
        self.skip_update = False
        return stats

    def shadow_round(self, announced: bool = False) -> Vote:
        """One round of a rank that has joined: zeros in every bucket, residuals untouched,
        the same collectives as the active ranks' round. ``announced``: ``hvd.join()`` has already
        received the round's announcement (so it is not sent again)."""
        if self.state is not None:
            raise RuntimeError("join: this rank left its training loop in the middle of a step "
                               "(a backward without its step); finish the step before leaving the join block")
        st = self._begin_round(active=False)
        st.announced = announced
        for b in self.table.buckets:
            st.ready[b.index] = len(b.names)
        self.finish()
        assert self.last_vote is not None
        return self.last_vote

    def launch_all(self, contribute: bool = True, report_active: bool = True) -> None:
        """Start a round over every parameter's current ``.grad`` now, outside backward; ``finish()``
        completes it. The outer loop's synchronisation: the pseudo-gradient sits in ``.grad`` of the
        synchronised copies. ``contribute`` False sends zeros and leaves memories alone (a rank that
        has no more data, as in :meth:`shadow_round`) but still receives the average;
        ``report_active`` False tells the vote that this rank has left its training loop."""
        if self.state is not None:
            raise RuntimeError("a round is already in flight on this engine")
        with watchdog.guard(self.backend):
            st = self._begin_round(active=contribute)
            st.report_active, st.keep_outputs = report_active, True
            if contribute:
                st.used = set(self._param)
            for b in self.table.buckets:
                st.ready[b.index] = len(b.names)
                if b.route.offload and contribute:
                    self._submit(st, b)
            self._launch_ready(st, block=True)

    def in_flight(self) -> dict[str, int]:
        """Handles and offload jobs of the round in flight (0 between rounds), for soak tests."""
        st = self.state
        if st is None:
            return {"pending_handles": 0, "jobs": 0}
        return {"pending_handles": len(st.order), "jobs": sum(j is not None for j in st.jobs)}


__all__ = ["EngineOptions", "NONFINITE_MODES", "RoundState", "StepEngine", "Vote"]
