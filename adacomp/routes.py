"""Routes and buckets: which compressor / memory / communicator each parameter uses, and how
parameters are grouped into fusion buckets.

Split out of ``optimizer.py`` so the rules that *decide* a parameter's path (``layers`` globs,
``min_numel``, per-parameter overrides, ``memory: auto``) live apart from the code that *moves*
gradients. :class:`RoutingMixin` keeps its tables as attributes of the optimizer
(``_routes``, ``_route_of``, ``_compressors``, ``buckets``, ``_bucket_of``, ``_prev_route_of``,
``_overrides``) because policies and tests read them there.
"""
from __future__ import annotations

import fnmatch
import json
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterable

from torch import Tensor

from adacomp import communicators, compressors, fusion, memories
from adacomp.communicators.base import Communicator, Entry
from adacomp.compressors.base import Compressor
from adacomp.config import ComponentSpec, Config, check_offload
from adacomp.errors import ConfigError, IncompatibleComponentsError
from adacomp.memories.base import Memory

_NONE = ComponentSpec("none")
_ALLREDUCE = ComponentSpec("allreduce")
Specs = tuple[ComponentSpec, ComponentSpec, ComponentSpec, bool]


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


def spec_key(*specs: ComponentSpec) -> str:
    """A stable text key for a spec tuple: equal specs share one route (and its memory)."""
    return json.dumps([s.as_dict() for s in specs], sort_keys=True, default=str)


def resolve_spec(config: Config, overrides: dict[str, Any], name: str, numel: int) -> Specs:
    """(compressor, memory, communicator, offload) for one parameter. Precedence: an override
    from :meth:`RoutingMixin.set_route`, then the first matching ``layers`` glob, then the
    top-level specs; unmatched tensors below ``min_numel`` go uncompressed on allreduce (their
    bytes are negligible, so compressing them only adds work)."""
    comp, mem, comm = config.compressor, config.memory, config.communicator
    offload, matched = False, False
    for layer in config.layers:
        if fnmatch.fnmatchcase(name, layer.match):
            comp = layer.compressor or comp
            mem = layer.memory or mem
            comm = layer.communicator or comm
            offload = layer.offload
            matched = True
            break
    if not matched and numel < config.min_numel:
        comp, mem, comm = _NONE, _NONE, _ALLREDUCE
    over = overrides.get(name, {})
    comp, mem, comm = over.get("compressor", comp), over.get("memory", mem), over.get("communicator", comm)
    offload = bool(over.get("offload", offload))
    if mem.name == "auto":
        cls = compressors.registry.cls(comp.name)
        mem = ComponentSpec("residual" if cls.biased else "none")
    return comp, mem, comm, offload


class RoutingMixin:
    """Route / bucket tables of :class:`~adacomp.optimizer.DistributedOptimizer` and the knobs
    policies turn (density, communicator, per-parameter route). Needs ``config``, ``params``,
    ``_overrides`` and ``_launched_any`` from the optimizer."""

    config: Config
    params: list[tuple[str, Tensor]]
    _overrides: dict[str, dict[str, Any]]
    _launched_any: bool

    def _spec_for(self, name: str, numel: int) -> Specs:
        return resolve_spec(self.config, self._overrides, name, numel)

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
            key = spec_key(comp, mem, comm) + ("+offload" if offload else "")
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
        self._plan_buckets(items, dense_by_route, sent_by_route)

    def _plan_buckets(self, items: list[fusion.Item], dense_by_route: dict[str, int],
                      sent_by_route: dict[str, int]) -> None:
        """Group parameters into buckets; with ``compressed_buffer`` a route's cap is scaled by
        its compression rate (ACP-SGD §IV-B) so compressed buckets span as many layers."""
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


__all__ = ["Bucket", "Route", "RoutingMixin", "resolve_spec", "spec_key"]
