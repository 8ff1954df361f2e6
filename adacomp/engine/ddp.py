"""adacomp's compressors as a PyTorch DDP communication hook.

    state, hook = adacomp.ddp.hook("configs/topk.yaml", named_parameters=model.named_parameters())
    ddp_model.register_comm_hook(state, hook)

The same YAML, compressors, memories and communicators as :class:`adacomp.DistributedOptimizer`,
on DDP's buckets: works wherever a DDP model is (plain DDP, Lightning's
``DDPStrategy(ddp_comm_hook=hook, ddp_comm_state=state)``, Accelerate's prepared model).

How a round goes (one backward):

* DDP calls the hook once per bucket, in bucket-index order on every rank. The hook splits the
  bucket's parameters by route, compensates them with their residuals and starts each route's
  first collective (``communicator.start``), and returns a future that is not set yet;
* the hook of the *last* bucket finishes every bucket in index order (further rounds of
  PowerSGD / ACP-SGD / AR-Topk happen here, so every rank issues them in the same order whatever
  order DDP's futures would complete in: the failure mode of PyTorch's own PowerSGD hook on
  multi-bucket gloo models), votes on non-finite gradients, writes the means into the buckets and
  sets every future. DDP waits on the futures only after backward, so nothing blocks early.

Error feedback is keyed by parameter name (``named_parameters``; otherwise ``param<k>`` in order
of first appearance, identical on every rank), so it survives DDP rebuilding its buckets after
the first iteration. ``state.state_dict()`` / ``load_state_dict()`` hold every residual,
threshold and factor for checkpoints. Adaptive policies need the optimizer's host protocol and
are refused here (use ``adacomp.DistributedOptimizer`` for them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from adacomp import backends, compressors
from adacomp.backends.base import Backend
from adacomp.config import Config, load
from adacomp.backends import watchdog
from adacomp.errors import CommunicationError, ConfigError, NonFiniteGradientError
from adacomp.engine import agreement
from adacomp.engine.error_feedback import LossScale
from adacomp.engine.metrics import StepStats
from adacomp.engine.optimizer_state import ComponentState
from adacomp.engine.round import RoundState, Rounds, per_parameter, poisoned
from adacomp.engine.routes import Bucket, RouteTable, fused_key, fuses_before_compress


@dataclass
class _Group:
    """The parameters of one DDP bucket that share a route: one communicator call."""

    bucket: Bucket
    grads: list[Tensor]


@dataclass
class _Waiting:
    """A DDP bucket whose future is set when the round completes."""

    groups: list[_Group]
    buffer: Tensor
    future: torch.futures.Future
    sparse_dim: int | None = None  # a sparse gradient's bucket: its dense mean goes back sparse


class HookState:
    """The DDP hook's front end to :class:`~adacomp.engine.round.Rounds`: DDP's buckets split by
    route, launched as DDP hands them over, completed at the last one, means written back into
    DDP's buffers. Everything a round decides (rollback, the vote, loss-scale units) is the same
    code as the optimizer's."""

    def __init__(self, config: Any = None, named_parameters: Iterable[tuple[str, Tensor]] | None = None,
                 backend: Backend | None = None, grad_scaler: Any = None, process_group: Any = None,
                 agree: bool = True, ddp: bool = True):
        self.config: Config = load(config)
        if self.config.policy.name != "static":
            raise ConfigError("policy.name", f"policy {self.config.policy.name!r} needs adacomp.DistributedOptimizer "
                                             "(it re-plans routes and buckets between steps); the DDP hook runs "
                                             "policy 'static' only")
        if self.config.local_steps is not None:
            raise ConfigError("local_steps", "a DDP communication hook runs inside every backward, so it cannot "
                                             "skip steps; local steps need adacomp.DistributedOptimizer (remove "
                                             "local_steps to use the hook)")
        if any(layer.offload for layer in self.config.layers):
            raise ConfigError("layers[].offload", "offload is not available in the DDP hook (DDP calls the hook "
                                                  "on its own thread); use adacomp.DistributedOptimizer")
        if backend is not None and process_group is not None:
            raise ValueError("adacomp.ddp.hook: pass either backend or process_group, not both")
        named = list(named_parameters or [])
        self._names = {id(p): n for n, p in named}
        # compared across ranks at the first hook call, before any collective of a round (``agree``
        # False: a caller with many states over one group, FSDP's units, does not pay it per state)
        self._agreement: dict[str, Any] | None = agreement.fingerprint(
            self.config, [(n, p) for n, p in named if p.requires_grad]) if agree else None
        # the parameters of the model this state serves: named ones, else those of the first round
        self._model: set[int] | None = set(self._names) if named else None
        self._backend = backend
        self._group = process_group
        # ``ddp``: the buckets are DDP's. Then which parameters this rank's backward passes reached since
        # the last round (ids) is followed: DDP hands a parameter it did not reach (find_unused_parameters)
        # as zeros in its bucket, and the round must leave its residual alone and its gradient as DDP
        # would, as the optimizer's does; and a call outside backward is DDP's Join shadowing. FSDP's
        # units (stand-in parameters, called by FSDP) pass False: every gradient handed over is used.
        self._ddp = ddp
        self._reached: set[int] = set()
        self._tracked: set[int] = set()
        self._reach_hooks: list[Any] = []
        for _, p in named:
            self._track(p)
        self.table = RouteTable(self.config, [])
        for n, p in named:  # routes up front, so a checkpoint can be loaded before the first step
            if p.requires_grad:
                self.table.ensure(n, p)
        self._fused_state: dict[str, Any] = {}  # loaded before its DDP bucket was first seen
        # members (name, numel) of each fused bucket this state has seen, in flat order: DDP
        # regroups its buckets after the first step, and a new bucket takes its members' state
        self._members: dict[str, list[tuple[str, int]]] = {}
        self.loss_scale = LossScale(grad_scaler)
        self.rounds = Rounds(self.table, lambda: self.backend, self.config.nonfinite, self.loss_scale,
                             warn_unfollowed_scale=True)
        self.steps = 0
        self._round: RoundState | None = None
        self._waiting: list[_Waiting] = []
        self.last_stats: StepStats | None = None
        self.io = ComponentState(None, self.table, self.loss_scale, lambda: None, lambda: self.steps,
                                 self._set_steps, owner=self._owner)

    # --- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        out = self.io.adacomp_state_dict(include_policy=False)
        if self._members:  # a resumed hook's first (DDP's unbuilt) buckets regroup from these
            out["fused_members"] = {k: [[n, c] for n, c in m] for k, m in self._members.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back residuals, thresholds and factors. Needs ``named_parameters`` at ``hook()``
        (routes exist before the first step); fused-bucket compressors get theirs when DDP first
        hands over their bucket."""
        if not self.table.params:
            raise ValueError("adacomp.ddp.hook(..., named_parameters=model.named_parameters()) is needed to load "
                             "hook state before the first step")
        self.io.check_owner(state)  # before anything is applied
        comps = dict(state["components"])
        fused = {k: comps.pop(k) for k in list(comps) if k.startswith("compressor/bucket:")}
        for k in [k for k in fused if k.removeprefix("compressor/") in self.table.outside_fused]:
            self.table.outside_fused[k.removeprefix("compressor/")].load_state_dict(fused.pop(k))
        self.io.load_adacomp_state_dict({**state, "components": comps})
        self._fused_state = {k.removeprefix("compressor/"): v for k, v in fused.items()}
        self._members = {k: [(str(n), int(c)) for n, c in m] for k, m in state.get("fused_members", {}).items()}

    # the names adacomp.checkpoint.PerRank and DistributedOptimizer use for the compression state
    adacomp_state_dict = state_dict
    load_adacomp_state_dict = load_state_dict

    def _set_steps(self, steps: int) -> None:
        self.steps = steps

    def _owner(self) -> tuple[int, int] | None:
        """(rank, world) once the process group exists (Lightning / Accelerate create it after the
        state), else None: nothing to record or check yet."""
        if self._backend is None and not torch.distributed.is_initialized():
            return None
        return self.backend.rank(), self.backend.size()

    @property
    def backend(self) -> Backend:
        """Resolved at the first hook call: Lightning / Accelerate create the process group after
        the hook state is built. ``process_group`` (DDP's, via :func:`register`) selects a sub-group."""
        if self._backend is None:
            self._backend = backends.create("torch", timeout_s=self.config.timeout_s, group=self._group)
        return self._backend

    # --- the hook --------------------------------------------------------------------------------
    def _track(self, p: Tensor) -> None:
        """Note when backward reaches ``p`` (its gradient accumulated: before DDP marks it ready). A
        parameter met untracked (no ``named_parameters``, or frozen at construction) counts as reached
        in that round."""
        if not self._ddp or id(p) in self._tracked or not p.requires_grad:
            return
        self._tracked.add(id(p))
        self._reach_hooks.append(p.register_post_accumulate_grad_hook(lambda q: self._reached.add(id(q))))

    def _used(self, p: Tensor) -> bool:
        return id(p) in self._reached or id(p) not in self._tracked

    def name_of(self, p: Tensor) -> str:
        name = self._names.get(id(p))
        if name is None:
            if self._model is not None:
                raise RuntimeError(
                    "this adacomp hook state met a parameter of another model: one state per DDP model "
                    "(its step counter, residuals and rounds belong to one model). Create one "
                    "adacomp.ddp.hook(...) per DDP model")
            name = self._names[id(p)] = f"param{len(self._names)}"
        return name

    def _groups(self, index: int, params: list[Tensor], grads: list[Tensor]) -> list[_Group]:
        by_route: dict[str, tuple[list[str], list[Tensor]]] = {}
        for p, g in zip(params, grads):
            name = self.name_of(p)
            route = self.table.ensure(name, p)
            names, gs = by_route.setdefault(route.key, ([], []))
            names.append(name)
            gs.append(g)
        out = []
        fused = self.table.outside_fused
        for key, (names, gs) in by_route.items():
            route = self.table.routes[key]
            b = Bucket(index, names, route, route.communicator)
            if fuses_before_compress(self.config, route.compressor.name):
                b.fused_key = fused_key(key, names)
                if b.fused_key not in self._members:
                    self._members[b.fused_key] = [(n, g.numel()) for n, g in zip(names, gs)]
                if not route.memory.holds(b.fused_key):
                    self._regroup(route.memory, b.fused_key)
                if b.fused_key not in fused:
                    c = compressors.get(route.compressor.name, **route.compressor.params)
                    if b.fused_key in self._fused_state:
                        c.load_state_dict(self._fused_state.pop(b.fused_key))
                    fused[b.fused_key] = c
                b.fused_compressor = fused[b.fused_key]
            out.append(_Group(b, gs))
        return out

    def _regroup(self, memory: Any, key: str) -> None:
        """``key``'s state from the slices its members hold in other fused buckets (DDP's rebuilt
        buckets group and order the parameters differently from its first ones)."""
        where: dict[str, tuple[str, int, int]] = {}
        for other, members in self._members.items():
            if other != key and memory.holds(other):
                off = 0
                for n, numel in members:
                    where.setdefault(n, (other, off, numel))
                    off += numel
        pieces = [(where[n][0], where[n][1], numel) if n in where and where[n][2] == numel else (None, 0, numel)
                  for n, numel in self._members[key]]
        if any(old is not None for old, _, _ in pieces):
            memory.regroup(key, pieces)

    def _drop_unused_buckets(self, used: set[str]) -> None:
        """After a round that stood: the fused buckets it did not use (DDP's first-step buckets)
        leave every memory and their compressors go; their members' state lives on in ``used``."""
        for key in [k for k in self._members if k not in used]:
            for route in self.table.routes.values():
                route.memory.reset(key)
            self.table.outside_fused.pop(key, None)
            del self._members[key]

    def __call__(self, bucket: Any) -> torch.futures.Future:
        try:
            return self._hook(bucket)
        except Exception as exc:  # noqa: BLE001 - re-raised, translated when a peer went away
            if not watchdog.is_comm_error(exc) or isinstance(exc, CommunicationError):
                raise
            raise CommunicationError(
                f"a peer of this DDP model's process group went away during adacomp's hook round ({exc}). "
                "If one rank ran out of data and finished its loop, every rank must enter the same backward "
                "passes: wrap the training loop in `with ddp_model.join():` (or give every rank the same number "
                "of batches, DistributedSampler(..., drop_last=True)); otherwise the launcher's log names the "
                "rank that died") from exc

    def _hook(self, bucket: Any) -> torch.futures.Future:
        if self._agreement is not None:  # once: the process group exists by the first backward
            agreement.check(self.backend, self._agreement)
            self._agreement = None
        if self._round is None:
            # DDP's Join calls the hook outside backward on a rank that ran out of data, with zeros in
            # every bucket: it shadows the others' round as the optimizer's join() does (zeros sent,
            # residuals untouched, no means written)
            self._round = self.rounds.begin(StepStats(step=self.steps), self.steps,
                                            active=not self._ddp or _in_backward())
            self._round.env.predivide = self._ddp  # DDP's averaging order: its `none` buckets bitwise at any world
        st = self._round
        params, grads, buffer = list(bucket.parameters()), list(bucket.gradients()), bucket.buffer()
        sparse_dim = None
        if buffer.is_sparse:
            # DDP's bucket of one sparse gradient (nn.Embedding(sparse=True)): gradients() is empty
            # and buffer() is the gradient. It travels dense, as through the optimizer (Horovod's
            # sparse_as_dense), and goes back sparse, the layout DDP's own sparse allreduce returns.
            sparse_dim, grads = buffer.sparse_dim(), [buffer.to_dense()]
        if len(grads) != len(params):
            raise RuntimeError(f"DDP bucket {bucket.index()} hands {len(params)} parameters but {len(grads)} "
                               "gradients to adacomp's hook; expected one gradient per parameter")
        groups = self._groups(bucket.index(), params, grads)
        used_names = {self.name_of(p) for p in params if st.active and self._used(p)}
        for p in params:
            self._track(p)
        for grp in groups:
            used = [n in used_names for n in grp.bucket.names]
            for n, g, u in zip(grp.bucket.names, grp.grads, used):
                if u:
                    Rounds.check_finite(st, n, g)
                    st.used.add(n)
            self.rounds.launch(st, grp.bucket, grp.grads, None if all(used) else used)
        fut: torch.futures.Future = torch.futures.Future()
        self._waiting.append(_Waiting(groups, buffer, fut, sparse_dim))
        if bucket.is_last():
            self._complete(st)
        return fut

    def _complete(self, st: RoundState) -> None:
        waiting, self._waiting, self._round = self._waiting, [], None
        if self._model is None:
            self._model = set(self._names)  # the first round defines the model this state serves
        self._reached.clear()  # the next round's backward passes start now
        try:
            result = self.rounds.complete(st)
        except NonFiniteGradientError as exc:  # `nonfinite: raise`: every rank raises, state rolled back
            for w in waiting:
                for grp in w.groups:
                    for g in grp.grads:
                        g.fill_(float("nan"))
                _settle(w)
            if not self._ddp:
                raise
            _raise_after_backward(exc)
            return
        self.last_stats = st.stats
        if result is None:  # this rank joined: it shadowed the round; the others count the step
            for w in waiting:
                _settle(w)
            vote = self.rounds.last_vote
            if vote is not None and not vote.nonfinite:
                self._count_step()
            return
        outs, vote = result
        index = self.table.index_of
        it = iter(outs)
        for w in waiting:
            for grp in w.groups:
                means = per_parameter(grp.bucket, next(it), [g.numel() for g in grp.grads])
                poison = poisoned(grp.bucket, vote)
                for n, g, out in zip(grp.bucket.names, grp.grads, means):
                    if not vote.used_by_any[index[n]]:
                        continue  # no rank reached it: DDP leaves its zeros and its gradient as they were
                    if out.data_ptr() != g.data_ptr():  # the mean may have been written there (Entry.dest)
                        g.copy_(out.view(g.shape))  # grads are views of DDP's bucket buffer
                    if poison:
                        g.fill_(float("nan"))
            _settle(w)
        if vote.nonfinite:
            return  # rolled back: the optimizer skips this step (GradScaler, or `nonfinite: skip`)
        self._drop_unused_buckets({g.bucket.fused_key for w in waiting for g in w.groups if g.bucket.fused_key})
        self._count_step()

    def _count_step(self) -> None:
        """A round stood: one step for the compressors (per communication round, as PyTorch's PowerSGD
        hook counts its iterations; with DDP's ``no_sync`` that is one per optimizer step)."""
        self.steps += 1
        for c in self.table.unique_compressors():
            c.on_step(self.steps)


def _settle(w: _Waiting) -> None:
    """Hand DDP its bucket: the buffer the means were written into (a sparse gradient's bucket: its
    dense mean made sparse again)."""
    w.future.set_result(w.buffer if w.sparse_dim is None else w.groups[0].grads[0].to_sparse(w.sparse_dim))


def _in_backward() -> bool:
    """Whether autograd is running a backward pass in this thread: DDP calls the hook from its
    reducer inside backward, and from its Join hook (a joined rank's shadow round) outside it."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is None or current() != -1


def _raise_after_backward(exc: Exception) -> None:
    """Raise ``exc`` out of the user's ``backward()`` once DDP has finished its own end of backward.
    Raised inside the hook it would leave DDP's reducer mid-iteration and every later backward fails
    DDP's internal assert; a callback queued from a callback runs after DDP's finalisation, which DDP
    queued when its last bucket became ready."""
    if not _in_backward():
        raise exc
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]

    def reraise() -> None:
        raise exc

    engine.queue_callback(lambda: engine.queue_callback(reraise))


def register(ddp_model: Any, config: Any = None, grad_scaler: Any = None,
             named_parameters: Iterable[tuple[str, Tensor]] | None = None) -> HookState:
    """Register adacomp's hook on ``ddp_model`` over the model's own process group (as DDP's
    ``register_comm_hook`` with PyTorch's hooks); returns the state for checkpoints.
    ``named_parameters``: default the wrapped module's; a framework that wraps the user's module
    again passes the user's own names (state keys and name-seeded factors then match it)."""
    module = getattr(ddp_model, "module", ddp_model)
    named = module.named_parameters() if named_parameters is None else named_parameters
    state = HookState(config, named, grad_scaler=grad_scaler,
                      process_group=getattr(ddp_model, "process_group", None))
    ddp_model.register_comm_hook(state, _call)
    return state


def hook(config: Any = None, named_parameters: Iterable[tuple[str, Tensor]] | None = None,
         backend: Backend | None = None, grad_scaler: Any = None, process_group: Any = None
         ) -> tuple[HookState, Callable[[HookState, Any], torch.futures.Future]]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    ``config``: the same YAML / dict as for :class:`adacomp.DistributedOptimizer` (policy
    ``static``). ``named_parameters``: the model's, for readable and stable state keys.
    ``grad_scaler``: a ``torch.amp.GradScaler`` whose scale the residuals should follow.
    With ``nonfinite: skip`` / ``propagate`` a non-finite round leaves every residual as it was and
    hands DDP NaN gradients so GradScaler skips the step on every rank; such a round does not count
    as a step (PowerSGD / ACP-SGD alternation and schedules stay where they were).
    ``process_group``: the group to average over when the DDP model was built with
    ``DDP(..., process_group=pg)`` (default: the whole world); :func:`register` reads it from the
    model."""
    state = HookState(config, named_parameters, backend, grad_scaler, process_group)
    return state, _call


def _call(state, bucket):  # type: ignore[no-untyped-def]
    # DDP inspects this signature (bucket annotated dist.GradBucket, or not at all); with
    # postponed annotations a string would fail its check, so the hook is left unannotated.
    if not isinstance(state, HookState):
        raise TypeError(f"adacomp's DDP hook got state {state!r}: register it with the state adacomp.ddp.hook() returns, "
                        "`state, hook = adacomp.ddp.hook(config, named_parameters=model.named_parameters()); "
                        "ddp_model.register_comm_hook(state, hook)`, or call adacomp.ddp.register(ddp_model, config)")
    return state(bucket)


__all__ = ["HookState", "hook", "register"]
