"""Routes and buckets: which compressor / memory / communicator each parameter uses, and how
parameters are grouped into fusion buckets.

Split out of ``optimizer.py`` so the rules that *decide* a parameter's path (``layers`` globs,
``min_numel``, per-parameter overrides, ``memory: auto``) live apart from the code that *moves*
gradients. :class:`RouteTable` is an object the optimizer owns (composition): the step engine
reads its buckets, policies turn its knobs through the optimizer's host protocol.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from torch import Tensor

from adacomp import communicators, compressors, memories
from adacomp.engine import fusion
from adacomp.communicators.base import Communicator
from adacomp.compressors.base import Compressor
from adacomp.compressors.sparse import Workspace
from adacomp.config import ComponentSpec, Config, check_offload
from adacomp.errors import ConfigError, IncompatibleComponentsError
from adacomp.memories.base import Memory

_NONE = ComponentSpec("none")
_ALLREDUCE = ComponentSpec("allreduce")
Specs = tuple[ComponentSpec, ComponentSpec, ComponentSpec, bool]


def fuses_before_compress(config: Config, compressor: str) -> bool:
    """Whether a bucket of ``compressor``'s route is compressed as one flattened tensor: bucket
    granularity always; the others where ``fusion.fuse_before_compress`` says so, and, left unset,
    the elementwise ones (same bits either way). ``none`` leaves fusing to its communicator."""
    cls = compressors.registry.cls(compressor)
    if cls.granularity == "bucket":
        return True
    fuse = config.fusion.fuse_before_compress
    return compressor != "none" and (cls.elementwise if fuse is None else fuse)


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
    fused_key: str = ""  # memory / state key when fused
    workspace: Workspace = field(default_factory=Workspace, repr=False, compare=False)  # the fused flat buffer


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


class RouteTable:
    """Which compressor / memory / communicator each parameter uses, and the fusion buckets.

    One job: the tables and the knobs policies turn (density, communicator, per-parameter route).
    It never moves a gradient; the step engine reads ``buckets`` / ``bucket_of`` each round.
    Routing overrides (``set_route``) are kept in ``overrides`` and saved with the optimizer's
    state, so a resumed run re-applies them *before* component state is loaded.
    """

    def __init__(self, config: Config, params: list[tuple[str, Tensor]]):
        self.config = config
        self.params = params
        self.overrides: dict[str, dict[str, Any]] = {}
        self.routes: dict[str, Route] = {}
        self.route_of: dict[str, Route] = {}
        self.compressors: dict[str, Compressor] = {}
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[str, Bucket] = {}
        # compressors of fused buckets the table did not plan (the DDP hook's: DDP owns its buckets)
        self.outside_fused: dict[str, Compressor] = {}
        self._index: dict[str, int] = {}
        self.build()

    def spec_for(self, name: str, numel: int) -> Specs:
        return resolve_spec(self.config, self.overrides, name, numel)

    def build(self) -> None:
        """(Re)build routes, per-parameter compressors and buckets; keeps the memories and
        compressors of parameters whose route did not change."""
        old_routes, old_comps, old_route_of = self.routes, self.compressors, self.route_of
        routes: dict[str, Route] = {}
        route_of: dict[str, Route] = {}
        comps: dict[str, Compressor] = {}
        items: list[fusion.Item] = []
        dense_by_route: dict[str, int] = {}
        sent_by_route: dict[str, int] = {}
        for name, p in self.params:
            key, route = self._route(name, p, routes, old_routes)
            route_of[name] = route
            prev, prev_route = old_comps.get(name), old_route_of.get(name)
            if prev is not None and prev_route is not None and prev_route.key == key:
                comps[name] = prev
            else:
                comps[name] = compressors.get(route.compressor.name, **route.compressor.params)
                route.memory.reset(name)
                if prev_route is not None and prev_route.key != key:
                    prev_route.memory.reset(name)
            self._check(name, route, comps[name])
            dense = p.numel() * p.element_size()
            sent = comps[name].payload_bytes(p.shape, p.element_size())
            items.append(fusion.Item(name, key, sent, f"{p.dtype}/{p.device}"))
            dense_by_route[key] = dense_by_route.get(key, 0) + dense
            sent_by_route[key] = sent_by_route.get(key, 0) + sent
        self.routes, self.route_of, self.compressors = routes, route_of, comps
        old_fused = {b.fused_key: b.fused_compressor for b in self.buckets if b.fused_compressor is not None}
        self._plan_buckets(items, dense_by_route, sent_by_route, old_fused)

    def _route(self, name: str, p: Tensor, routes: dict[str, Route],
               old_routes: dict[str, Route]) -> tuple[str, Route]:
        """The route of one parameter: reused from ``routes`` / ``old_routes`` when its specs
        match, otherwise built (its memory and communicator are shared by every parameter
        with the same specs). Registers it in ``routes``."""
        comp, mem, comm, offload = self.spec_for(name, p.numel())
        if offload:
            try:
                check_offload(comp, comm, "offload")
            except ConfigError as exc:
                raise IncompatibleComponentsError(f"parameter {name}", exc.reason) from None
        key = spec_key(comp, mem, comm) + ("+offload" if offload else "")
        route = routes.get(key) or old_routes.get(key)
        if route is None:
            route = Route(key, comp, memories.get(mem.name, **mem.params),
                          communicators.get(comm.name, **comm.params), mem, comm, offload)
        routes[key] = route
        return key, route

    @staticmethod
    def component_at(key: str) -> Memory | Communicator | None:
        """A fresh memory or communicator for a saved component key (``memory/<route spec>``,
        ``communicator/<route spec>``): a route this table does not have now, e.g. in a checkpoint
        written after a policy re-routed tensors. None for any other key."""
        kind, _, spec = key.partition("/")
        if kind not in ("memory", "communicator"):
            return None
        try:
            _, mem, comm = json.loads(spec.removesuffix("+offload"))
        except ValueError:
            return None
        d = dict(mem if kind == "memory" else comm)
        name = d.pop("name")
        return memories.get(name, **d) if kind == "memory" else communicators.get(name, **d)

    @staticmethod
    def _check(name: str, route: Route, compressor: Compressor) -> None:
        try:
            route.communicator.check(compressor)
            route.memory.check(compressor)
        except IncompatibleComponentsError as exc:
            raise IncompatibleComponentsError(f"parameter {name}", exc.reason) from None
        except ValueError as exc:
            raise IncompatibleComponentsError(f"parameter {name}", str(exc)) from None

    def ensure(self, name: str, p: Tensor) -> Route:
        """Route a parameter first seen after construction, without planning buckets (the DDP
        hook meets parameters bucket by bucket; DDP owns the buckets there)."""
        if name not in self.route_of:
            _, route = self._route(name, p, self.routes, {})
            comp = compressors.get(route.compressor.name, **route.compressor.params)
            self._check(name, route, comp)
            self.route_of[name], self.compressors[name] = route, comp
            self.params.append((name, p))
        return self.route_of[name]

    def _plan_buckets(self, items: list[fusion.Item], dense_by_route: dict[str, int],
                      sent_by_route: dict[str, int], old_fused: dict[str, Compressor]) -> None:
        """Group parameters into buckets; with ``compressed_buffer`` a route's cap is scaled by
        its compression rate (ACP-SGD §IV-B) so compressed buckets span as many layers. A fused
        bucket is keyed by its route and members, so its compressor and residual survive a
        re-plan that leaves it unchanged and start fresh when its members change."""
        cap = self.config.fusion.bucket_mb * 2 ** 20
        caps = {k: cap * (sent_by_route[k] / dense_by_route[k] if self.config.fusion.compressed_buffer
                          and dense_by_route[k] else 1.0) for k in dense_by_route}
        plan = fusion.plan(items, caps)
        buckets: list[Bucket] = []
        bucket_of: dict[str, Bucket] = {}
        live_keys: dict[int, set[str]] = {}
        for i, names in enumerate(plan):
            route = self.route_of[names[0]]
            b = Bucket(i, names, route, route.communicator)
            if fuses_before_compress(self.config, route.compressor.name):
                b.fused_key = fused_key(route.key, names)
                b.fused_compressor = old_fused.get(b.fused_key) or compressors.get(
                    route.compressor.name, **route.compressor.params)
                live_keys.setdefault(id(route.memory), set()).add(b.fused_key)
            buckets.append(b)
            for n in names:
                bucket_of[n] = b
        for old in self.buckets:  # residuals of fused buckets that no longer exist
            if old.fused_compressor is not None and old.fused_key not in live_keys.get(id(old.route.memory), set()):
                old.route.memory.reset(old.fused_key)
        self.buckets, self.bucket_of = buckets, bucket_of

    # --- lookups ---------------------------------------------------------------------------------
    def compressor_for(self, name: str) -> Compressor:
        """The compressor instance that handles parameter ``name`` (or its bucket when fused)."""
        b = self.bucket_of[name]
        return b.fused_compressor or self.compressors[name]

    def is_fused(self, name: str) -> bool:
        """True when ``name``'s gradient is compressed as part of its flattened bucket."""
        return self.bucket_of[name].fused_compressor is not None

    @property
    def index_of(self) -> dict[str, int]:
        """Each parameter's position in ``params`` (the vote's layout; ``params`` only grows)."""
        if len(self._index) != len(self.params):
            self._index = {n: i for i, (n, _) in enumerate(self.params)}
        return self._index

    def unique_compressors(self) -> list[Compressor]:
        seen: dict[int, Compressor] = {}
        for c in list(self.compressors.values()) + [b.fused_compressor for b in self.buckets
                                                    if b.fused_compressor is not None] \
                + list(self.outside_fused.values()):
            seen.setdefault(id(c), c)
        return list(seen.values())

    # --- knobs for policies ----------------------------------------------------------------------
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
        """Override one parameter's route (buckets are re-planned)."""
        if name not in {n for n, _ in self.params}:
            raise KeyError(f"set_route: no parameter named {name!r}")
        over = self.overrides.setdefault(name, {})
        for key, spec in (("compressor", compressor), ("memory", memory), ("communicator", communicator),
                          ("offload", offload)):
            if spec is not None:
                over[key] = spec
        self.build()

    def set_overrides(self, overrides: dict[str, dict[str, Any]]) -> None:
        """Replace every override at once (checkpoint restore) and rebuild."""
        self.overrides = {n: dict(o) for n, o in overrides.items()}
        self.build()

    def overrides_state(self) -> dict[str, dict[str, Any]]:
        """Overrides as plain data (specs as dicts) for a checkpoint."""
        return {n: {k: (v.as_dict() if isinstance(v, ComponentSpec) else v) for k, v in o.items()}
                for n, o in self.overrides.items()}

    @staticmethod
    def overrides_from_state(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for n, o in state.items():
            out[n] = {k: (ComponentSpec(v["name"], {a: b for a, b in v.items() if a != "name"}) if isinstance(v, dict) else v) for k, v in o.items()}
        return out


def fused_key(route_key: str, names: list[str]) -> str:
    """Stable memory / state key of a fused bucket: its members, independent of bucket order."""
    digest = hashlib.sha1(json.dumps([route_key, names]).encode()).hexdigest()[:12]
    return f"bucket:{names[0]}:{len(names)}:{digest}"


__all__ = ["Bucket", "Route", "RouteTable", "fused_key", "resolve_spec", "spec_key"]
