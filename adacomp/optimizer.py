"""DistributedOptimizer: Horovod's one-line wrap, with a compressor, memory and communicator per route.

Communication starts inside backward: a hook on every parameter fires once its gradient is
accumulated (wait-free back-propagation); when every gradient of a fusion bucket is ready, the
bucket's communicator compresses (after error-feedback compensation) and launches its collective
without waiting. ``step()`` calls :meth:`synchronize`, which finishes buckets in order, writes the
mean gradient into ``p.grad`` and then runs the wrapped optimizer.

Buckets are launched strictly in bucket-index order on every rank (a ready bucket waits for its
predecessors), so gloo / MPI / NCCL see the same sequence of collectives everywhere even if hooks
fire in a different order (DESIGN.md, ordering rule).
"""
from __future__ import annotations

import contextlib
import copy
from concurrent.futures import Future, ThreadPoolExecutor
import fnmatch
import hashlib
import json
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor

from adacomp import communicators, compressors, context, fusion, memories, policies, watchdog
from adacomp.backends.base import Backend
from adacomp.communicators.base import CommEnv, Communicator, Entry
from adacomp.compressors.base import Compressor
from adacomp.config import ComponentSpec, Config, check_offload, load
from adacomp.errors import CommunicationError, ConfigError, IncompatibleComponentsError, NonFiniteGradientError
from adacomp.memories.base import Memory
from adacomp.metrics import StepStats

Average = "average"
Sum = "sum"
_NONE = ComponentSpec("none")
_ALLREDUCE = ComponentSpec("allreduce")


@dataclass
class Route:
    """How one parameter's gradient travels: specs plus the live memory / communicator."""

    key: str
    compressor: ComponentSpec
    memory: Memory
    communicator: Communicator
    memory_spec: ComponentSpec
    communicator_spec: ComponentSpec
    offload: bool = False  # compress on the CPU worker thread (ByteComp "compress on CPU")


@dataclass
class Bucket:
    """A fusion bucket; ``index`` is its launch position, identical on every rank."""

    index: int
    names: list[str]
    route: Route
    communicator: Communicator
    fused_compressor: Compressor | None = None  # set when compressing the flattened bucket
    ready: int = 0
    pending: Any = None
    entries: list[Entry] = field(default_factory=list)
    job: Future | None = None  # offloaded compression in flight


def _spec_key(*specs: ComponentSpec) -> str:
    return json.dumps([s.as_dict() for s in specs], sort_keys=True, default=str)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so gradients are compressed and averaged across ranks.

    Arguments follow Horovod's: ``named_parameters`` (unique names, used for per-layer rules and
    state keys), ``backward_passes_per_step`` (local accumulation before communicating),
    ``op`` (``adacomp.Average`` or ``adacomp.Sum``), ``gradient_predivide_factor`` (accepted for
    Horovod compatibility; communicators already average, so it does not change the result),
    plus ``config`` (YAML path, dict or :class:`~adacomp.config.Config`) and ``backend``.

    Call ``synchronize()`` yourself to touch averaged gradients before the update, e.g. clipping::

        loss.backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 config: Any = None, backward_passes_per_step: int = 1, op: str = Average,
                 gradient_predivide_factor: float = 1.0, backend: Backend | None = None):
        # Deliberately not calling Optimizer.__init__: we share the inner optimizer's groups/state.
        self.inner = optimizer
        self.defaults = optimizer.defaults
        self.config: Config = load(config)
        if op not in (Average, Sum):
            raise ValueError(f"op must be adacomp.Average or adacomp.Sum, got {op!r}")
        if gradient_predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.backward_passes_per_step = backward_passes_per_step
        self.backend = backend if backend is not None else context.current()
        self.params = self._name_parameters(optimizer, named_parameters)
        self._param_by_name = dict(self.params)
        self.steps = 0
        self.steps_per_epoch: int | None = None  # set by training loops that know it (lgreco's period)
        self.skipped_steps = 0
        self._skip_this_step = False
        self._pre_state: dict[str, Any] = {}
        self.last_stats: StepStats | None = None
        self.history: deque[dict[str, float]] = deque(maxlen=1000)
        self._overrides: dict[str, dict[str, Any]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._check_consistency()
        self._build_routes()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(n))
                       for n, p in self.params]
        if any(r.memory.name == "dgc" for r in self._routes.values()) and \
                any(g.get("momentum", 0) for g in optimizer.param_groups):
            warnings.warn("memory 'dgc' applies momentum itself (DGC §3.2); the wrapped optimizer should "
                          "use momentum=0, otherwise momentum is applied twice", stacklevel=2)
        self.policy = policies.get(self.config.policy.name, **self.config.policy.params)
        self._reset_step()
        self.policy.attach(self)

    # --- torch.optim.Optimizer surface (shared with the wrapped optimizer) -----------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer holds live communication state; pickle state_dict() instead")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.inner!r}, buckets={len(self.buckets)}, backend={self.backend!r})"

    # --- construction -----------------------------------------------------------------------------
    @staticmethod
    def _name_parameters(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None) -> list[tuple[str, Tensor]]:
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        if named_parameters is None:
            return [(f"param.{i}", p) for i, p in enumerate(opt_params) if p.requires_grad]
        named = list(named_parameters)
        if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                             "usually model.named_parameters()")
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {dups}")
        ids = {id(p) for _, p in named}
        missing = [i for i, p in enumerate(opt_params) if id(p) not in ids]
        if missing:
            raise ValueError("named_parameters was given, but optimizer parameters at positions "
                             f"{missing} are not in it; pass model.named_parameters() of the whole model")
        opt_ids = {id(p) for p in opt_params}
        return [(n, p) for n, p in named if id(p) in opt_ids and p.requires_grad]

    def _check_consistency(self) -> None:
        """Every rank must hold the same config and the same parameters; say who differs."""
        shapes = [(n, list(p.shape)) for n, p in self.params]
        mine = {"config": self.config.hash(),
                "params": hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16],
                "names": [n for n, _ in self.params][:2000], "shapes": shapes[:2000]}
        everyone = self.backend.allgather_object(mine)
        ref = everyone[0]
        for what in ("config", "params"):
            bad = [r for r, d in enumerate(everyone) if d[what] != ref[what]]
            if bad:
                detail = ""
                if what == "params":
                    other = everyone[bad[0]]
                    diff = [f"{a} vs {b}" for a, b in zip(ref["shapes"], other["shapes"]) if a != b][:3]
                    if len(ref["shapes"]) != len(other["shapes"]):
                        diff.insert(0, f"{len(ref['shapes'])} vs {len(other['shapes'])} parameters")
                    detail = f"; first differences (rank 0 vs rank {bad[0]}): {diff}"
                raise CommunicationError(
                    f"ranks {bad} have a different {'configuration' if what == 'config' else 'model (parameter names/shapes)'} "
                    f"than rank 0{detail}. Every rank must run the same config file and model.")

    def _spec_for(self, name: str, numel: int) -> tuple[ComponentSpec, ComponentSpec, ComponentSpec, bool]:
        cfg = self.config
        comp, mem, comm = cfg.compressor, cfg.memory, cfg.communicator
        offload, matched = False, False
        for layer in cfg.layers:
            if fnmatch.fnmatchcase(name, layer.match):
                comp = layer.compressor or comp
                mem = layer.memory or mem
                comm = layer.communicator or comm
                offload = layer.offload
                matched = True
                break
        if not matched and numel < cfg.min_numel:
            comp, mem, comm = _NONE, _NONE, _ALLREDUCE
        over = self._overrides.get(name, {})
        comp, mem, comm = over.get("compressor", comp), over.get("memory", mem), over.get("communicator", comm)
        offload = bool(over.get("offload", offload))
        if mem.name == "auto":
            cls = compressors.registry.cls(comp.name)
            mem = ComponentSpec("residual" if cls.biased else "none")
        return comp, mem, comm, offload

    def _build_routes(self) -> None:
        """(Re)build routes, per-parameter compressors and buckets; keeps memories of unchanged routes."""
        old_routes = getattr(self, "_routes", {})
        old_comps = getattr(self, "_compressors", {})
        self._routes: dict[str, Route] = {}
        self._route_of: dict[str, Route] = {}
        self._compressors: dict[str, Compressor] = {}
        items: list[fusion.Item] = []
        dense_by_route: dict[str, int] = {}
        sent_by_route: dict[str, int] = {}
        for name, p in self.params:
            comp, mem, comm, offload = self._spec_for(name, p.numel())
            if offload:
                try:
                    check_offload(comp, comm, "offload")
                except ConfigError as exc:
                    raise IncompatibleComponentsError(f"parameter {name}", exc.reason) from None
            key = _spec_key(comp, mem, comm) + ("+offload" if offload else "")
            route = self._routes.get(key) or old_routes.get(key)
            if route is None:
                route = Route(key, comp, memories.get(mem.name, **mem.params),
                              communicators.get(comm.name, **comm.params), mem, comm, offload)
            self._routes[key] = route
            self._route_of[name] = route
            prev = old_comps.get(name)
            prev_route = getattr(self, "_prev_route_of", {}).get(name)
            if prev is not None and prev_route is not None and prev_route.key == key:
                self._compressors[name] = prev
            else:
                self._compressors[name] = compressors.get(comp.name, **comp.params)
                route.memory.reset(name)
            try:
                route.communicator.check(self._compressors[name])
                route.memory.check(self._compressors[name])
            except IncompatibleComponentsError as exc:
                raise IncompatibleComponentsError(f"parameter {name}", exc.reason) from None
            except ValueError as exc:
                raise IncompatibleComponentsError(f"parameter {name}", str(exc)) from None
            dense = p.numel() * p.element_size()
            sent = self._compressors[name].payload_bytes(p.shape, p.element_size())
            items.append(fusion.Item(name, key, sent))
            dense_by_route[key] = dense_by_route.get(key, 0) + dense
            sent_by_route[key] = sent_by_route.get(key, 0) + sent
        self._prev_route_of = dict(self._route_of)
        cap = self.config.fusion.bucket_mb * 2 ** 20
        caps = {k: cap * (sent_by_route[k] / dense_by_route[k] if self.config.fusion.compressed_buffer
                          and dense_by_route[k] else 1.0) for k in dense_by_route}
        plan = fusion.plan(items, caps)
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[str, Bucket] = {}
        for i, names in enumerate(plan):
            route = self._route_of[names[0]]
            b = Bucket(i, names, route, route.communicator)
            comp_cls = compressors.registry.cls(route.compressor.name)
            if comp_cls.granularity == "bucket" or (self.config.fusion.fuse_before_compress
                                                    and route.compressor.name != "none"):
                b.fused_compressor = compressors.get(route.compressor.name, **route.compressor.params)
            self.buckets.append(b)
            for n in names:
                self._bucket_of[n] = b
        self._dirty = False

    # --- public knobs for policies ---------------------------------------------------------------
    def compressor_for(self, name: str) -> Compressor:
        """The compressor instance that handles parameter ``name`` (or its bucket when fused)."""
        b = self._bucket_of[name]
        return b.fused_compressor or self._compressors[name]

    def route_of(self, name: str) -> Route:
        return self._route_of[name]

    def is_fused(self, name: str) -> bool:
        """True when ``name``'s gradient is compressed as part of its flattened bucket."""
        return self._bucket_of[name].fused_compressor is not None

    def parameter(self, name: str) -> Tensor:
        return self._param_by_name[name]

    def bucket_of(self, name: str) -> Bucket:
        return self._bucket_of[name]

    def set_communicator(self, bucket_index: int, communicator: Communicator) -> None:
        """Use ``communicator`` for one bucket from the next step on (all ranks must do the same)."""
        b = self.buckets[bucket_index]
        for n in b.names:
            communicator.check(self.compressor_for(n))
        b.communicator = communicator

    def set_density(self, density: float, names: Iterable[str] | None = None) -> None:
        """Set the target density of every compressed parameter (or of ``names``)."""
        targets = list(names) if names is not None else [n for n, _ in self.params]
        seen: set[int] = set()
        for n in targets:
            c = self.compressor_for(n)
            if id(c) in seen or c.density() is None:
                continue
            seen.add(id(c))
            c.set_density(density)

    def set_route(self, name: str, compressor: ComponentSpec | None = None,
                  memory: ComponentSpec | None = None, communicator: ComponentSpec | None = None,
                  offload: bool | None = None) -> None:
        """Override one parameter's route from the next step on (buckets are re-planned).
        ``offload``: compress on the CPU worker thread (needs an offloadable communicator)."""
        if self._launched_any:
            raise RuntimeError("set_route() must be called between steps, not during backward")
        over = self._overrides.setdefault(name, {})
        for key, spec in (("compressor", compressor), ("memory", memory), ("communicator", communicator),
                          ("offload", offload)):
            if spec is not None:
                over[key] = spec
        self._build_routes()

    # --- hooks and launching ------------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._passes: dict[str, int] = {n: 0 for n, _ in self.params}
        for b in self.buckets:
            if b.job is not None:  # an aborted step: let the worker finish before state is reused
                b.job.exception()
            b.ready, b.pending, b.entries, b.job = 0, None, [], None
        self._next_launch = 0
        self._launched_any = False
        self._step_started = False
        self._synchronized = False
        self._should_sync = True
        self._nonfinite: list[str] = []
        self._skip_this_step = False
        self._stats = StepStats(step=self.steps)
        self._env = CommEnv(self.backend, self._stats, self.steps)

    def _make_hook(self, name: str):
        def hook(p: Tensor) -> None:
            self._on_grad(name, p)
        return hook

    def _begin_step(self) -> None:
        if not self._step_started:
            self._step_started = True
            if self.config.nonfinite == "skip":
                # `skip` must leave residuals / thresholds / factors / policy accumulators as they
                # were before this step's first hook: keep a copy (the price of this mode).
                self._pre_state = copy.deepcopy(self.adacomp_state_dict())

    def _on_grad(self, name: str, p: Tensor) -> None:
        self._begin_step()
        if self._synchronized:
            raise RuntimeError(
                "a gradient was computed after synchronize() and before step(); call step() "
                "(inside `with opt.skip_synchronize():`) before the next backward")
        self._passes[name] += 1
        if self._passes[name] > self.backward_passes_per_step:
            raise RuntimeError(
                f"gradients of {name!r} were computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before step(); increase "
                "backward_passes_per_step to accumulate gradients locally")
        if self._passes[name] < self.backward_passes_per_step:
            return
        b = self._bucket_of[name]
        b.ready += 1
        if b.ready == len(b.names):
            if b.route.offload:
                self._submit(b)
            with watchdog.guard(self.backend):
                self._launch_ready()

    def _launch_ready(self, block: bool = False) -> None:
        """Launch ready buckets in index order; an offloaded bucket whose compression is still
        running stops the walk unless ``block`` (then it is waited for)."""
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if b.ready != len(b.names) or (b.job is not None and not block and not b.job.done()):
                return
            self._launch(b)
            self._next_launch += 1

    def _grad(self, name: str) -> Tensor:
        p = self._param_by_name[name]
        if p.grad is None:  # unused parameter: contribute zeros so every rank sends the same shapes
            p.grad = torch.zeros_like(p)
        return p.grad

    def _finite_grads(self, b: Bucket) -> list[Tensor]:
        grads = [self._grad(n) for n in b.names]
        for n, g in zip(b.names, grads):
            # A sum is one cheap pass and is NaN/Inf whenever g holds one; a finite-but-overflowing
            # sum is confirmed with the exact (slower) test before anything is reported.
            if not torch.isfinite(g.sum()) and not torch.isfinite(g).all():
                self._nonfinite.append(n)
        return grads

    def _entries(self, b: Bucket, grads: list[Tensor]) -> list[Entry]:
        """Error-compensated entries of bucket ``b`` (one per parameter, or one fused)."""
        mem = b.route.memory
        if b.fused_compressor is not None:
            flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
            key = f"bucket{b.index}"
            return [Entry(key, mem.compensate(flat, key), b.fused_compressor, mem)]
        return [Entry(n, mem.compensate(g, n), self._compressors[n], mem) for n, g in zip(b.names, grads)]

    # --- offloaded compression (ByteComp §4.2 Dimension 2 / Alg. 2: "compress on CPU") ------------
    def _submit(self, b: Bucket) -> None:
        """Hand bucket ``b``'s compensation and compression to the CPU worker thread. Gradients
        on an accelerator are copied to pinned host memory first; the collective itself is
        launched later from this thread, in bucket order (:meth:`_launch_ready`)."""
        self._begin_step()
        grads = self._finite_grads(b)
        event = None
        if grads[0].device.type != "cpu":
            host = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True).copy_(g, non_blocking=True) for g in grads]
            event = torch.cuda.Event()
            event.record()
            grads = host
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="adacomp-offload")
        b.job = self._pool.submit(self._offloaded, b, grads, event)

    def _offloaded(self, b: Bucket, grads: list[Tensor], event: Any) -> tuple[list[Entry], float]:
        if event is not None:
            event.synchronize()
        t0 = time.perf_counter()
        entries = self._entries(b, grads)
        b.communicator.precompress(entries, self.backend.size())
        return entries, time.perf_counter() - t0

    def _launch(self, b: Bucket) -> None:
        self._begin_step()  # launched from synchronize() without any hook
        self._launched_any = True
        self._env.bucket_index = b.index
        if b.job is not None:
            b.entries, dt = b.job.result()  # re-raises a failure of the worker here
            b.job = None
            self._stats.extra["offload_s"] = self._stats.extra.get("offload_s", 0.0) + dt
        else:
            grads = self._finite_grads(b)
            with self._stats.timing("compress"):
                b.entries = self._entries(b, grads)
        b.pending = b.communicator.start(b.entries, self._env)

    # --- synchronize / step -------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every bucket and write the averaged gradients into ``p.grad``."""
        if self._synchronized:
            return
        with watchdog.guard(self.backend):  # a dead peer surfaces as an error naming its rank
            self._synchronize()

    def _synchronize(self) -> None:
        if not self._launched_any and all(v == 0 for v in self._passes.values()):
            # step() without backward: nothing to send (Horovod also allows it).
            self._synchronized = True
            return
        incomplete = [n for n, c in self._passes.items() if 0 < c < self.backward_passes_per_step]
        if incomplete:
            raise RuntimeError(
                f"step() called after {self._passes[incomplete[0]]} of backward_passes_per_step="
                f"{self.backward_passes_per_step} backward passes; run the remaining passes first")
        for b in self.buckets[self._next_launch:]:  # parameters without gradients count as ready
            if b.ready != len(b.names):
                b.ready = len(b.names)
                if b.route.offload:
                    self._submit(b)
        self._launch_ready(block=True)
        scale = float(self.backend.size()) if self.op == Sum else 1.0
        for b in self.buckets:
            self._env.bucket_index = b.index
            t0 = time.perf_counter()
            outs = b.communicator.finish(b.pending, self._env)
            self._stats.bucket_sync_s[b.index] = time.perf_counter() - t0
            self._write_grads(b, outs, scale)
            b.pending, b.entries = None, []
        self._check_nonfinite()
        self._synchronized = True

    def _write_grads(self, b: Bucket, outs: list[Tensor], scale: float) -> None:
        """Install the averaged gradients. Results are handed over as ``p.grad`` (no copy) when
        dtype and device match, as DDP's ``gradient_as_bucket_view`` does: for the dense path they
        are views of the fusion buffer, so the next backward can even accumulate in place and the
        next flatten is skipped. Otherwise they are copied into the existing gradient."""
        if b.fused_compressor is not None:
            flat, off = outs[0].reshape(-1), 0
            outs = []
            for n in b.names:
                numel = self._param_by_name[n].numel()
                outs.append(flat[off:off + numel])
                off += numel
        for n, out in zip(b.names, outs):
            p = self._param_by_name[n]
            g = p.grad
            if out.data_ptr() != g.data_ptr():  # type: ignore[union-attr]
                if out.dtype == g.dtype and out.device == g.device and out.is_contiguous():  # type: ignore[union-attr]
                    p.grad = g = out.view(g.shape)  # type: ignore[union-attr]
                else:
                    g.copy_(out.reshape(g.shape))  # type: ignore[union-attr]
            if scale != 1.0:
                g.mul_(scale)  # type: ignore[union-attr]

    def _check_nonfinite(self) -> None:
        """All ranks learn whether any rank saw a non-finite gradient (one tiny allreduce)."""
        flag = torch.tensor([1.0 if self._nonfinite else 0.0])
        if float(self.backend.allreduce(flag)) == 0.0:
            return
        where = self.backend.allgather_object(self._nonfinite[:5])
        bad = {r: names for r, names in enumerate(where) if names}
        if self.config.nonfinite == "skip":
            self.skipped_steps += 1
            self.load_adacomp_state_dict(self._pre_state)  # also resets the step's bookkeeping
            self._skip_this_step = True
            self._synchronized = True
        else:
            self._reset_step()
            raise NonFiniteGradientError(
                "non-finite gradient (NaN or Inf) on " + "; ".join(f"rank {r}: {', '.join(n)}" for r, n in bad.items())
                + ". Lower the learning rate or use loss scaling; set `nonfinite: skip` to drop such steps.")

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not call ``synchronize()`` (you already did)."""
        self._should_sync = False
        try:
            yield
        finally:
            self._should_sync = True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self._should_sync:
            self.synchronize()
        elif not self._synchronized and self._launched_any:
            raise RuntimeError("step() inside skip_synchronize() requires an explicit synchronize() first")
        if self._skip_this_step:  # every rank saw the flag: drop the update, keep all state
            self._reset_step()
            return None
        loss = self.inner.step(closure)
        self._finish_step()
        return loss

    def _finish_step(self) -> None:
        stats = self._stats
        self.last_stats = stats
        self.history.append(stats.as_dict())
        self.steps += 1
        seen: set[int] = set()
        for c in list(self._compressors.values()) + [b.fused_compressor for b in self.buckets if b.fused_compressor]:
            if id(c) not in seen:
                seen.add(id(c))
                c.on_step(self.steps)
        self._reset_step()
        self.policy.after_step(self, stats)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._launched_any and not self._synchronized:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); this would race with communication. Call zero_grad() before backward.")
        self.inner.zero_grad(set_to_none=set_to_none)

    # --- state ------------------------------------------------------------------------------------
    def _components(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for n, c in self._compressors.items():
            out[f"compressor/{n}"] = c
        for b in self.buckets:
            if b.fused_compressor is not None:
                out[f"compressor/bucket{b.index}"] = b.fused_compressor
        for i, r in enumerate(sorted(self._routes)):
            out[f"memory/{i}"] = self._routes[r].memory
            out[f"communicator/{i}"] = self._routes[r].communicator
        out["policy"] = self.policy
        return out

    def adacomp_state_dict(self, include_policy: bool = True) -> dict[str, Any]:
        return {"steps": self.steps,
                "components": {k: c.state_dict() for k, c in self._components().items()
                               if include_policy or k != "policy"}}

    def load_adacomp_state_dict(self, state: dict[str, Any]) -> None:
        comps = self._components()
        unknown = sorted(set(state["components"]) - set(comps))
        if unknown:
            raise ValueError(f"checkpoint has state for {unknown[:5]} which this optimizer does not have; "
                             "was it written with a different config or model?")
        for k, c in comps.items():
            if k == "policy" and k not in state["components"]:
                continue  # snapshots leave the policy alone: it is the one exploring
            c.load_state_dict(state["components"].get(k, {}))
        self.steps = int(state["steps"])
        self._reset_step()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Wrapped optimizer state plus every compressor, memory, communicator and policy state."""
        return {"optimizer": self.inner.state_dict(), "adacomp": self.adacomp_state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        if "optimizer" not in state_dict or "adacomp" not in state_dict:
            raise ValueError("expected a DistributedOptimizer.state_dict() with keys 'optimizer' and 'adacomp'")
        self.inner.load_state_dict(state_dict["optimizer"])
        self.load_adacomp_state_dict(state_dict["adacomp"])

    def snapshot(self) -> dict[str, Any]:
        """An in-memory copy of parameters, optimizer, compressor and memory state (for MOO
        exploration). The policy's own state is not included: restoring must not undo the
        policy's record of what it explored."""
        return {"params": {n: p.detach().clone() for n, p in self.params},
                "state": copy.deepcopy({"optimizer": self.inner.state_dict(),
                                        "adacomp": self.adacomp_state_dict(include_policy=False)})}

    def restore(self, snap: dict[str, Any]) -> None:
        """Put back exactly what :meth:`snapshot` saw (bitwise)."""
        with torch.no_grad():
            for n, p in self.params:
                p.copy_(snap["params"][n])
        self.load_state_dict(copy.deepcopy(snap["state"]))

    def remove_hooks(self) -> None:
        """Detach from the model and stop the offload worker (if one was started)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


__all__ = ["Average", "Sum", "DistributedOptimizer", "ConfigError"]
