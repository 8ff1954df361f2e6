"""YAML -> validated dataclasses, with errors that name the dotted key path and the valid choices.

Every component's ``__init__`` signature is the single source of its parameter names, types and
defaults: the validator reads it through the registry, checks types, then builds the component once
so range checks in constructors surface as :class:`ConfigError` before any collective runs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import reprlib
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from adacomp.errors import ConfigError, IncompatibleComponentsError

BACKENDS = ("auto", "torch", "mpi", "horovod", "local")
NONFINITE = ("propagate", "skip", "raise")
INITIAL_WEIGHTS = ("warn", "raise")


@dataclass(frozen=True)
class ComponentSpec:
    """A registry name plus constructor parameters, e.g. ``{name: topk, density: 0.01}``."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, **dict(self.params)}


@dataclass
class FusionConfig:
    """Tensor fusion. ``bucket_mb`` 0 sends every tensor on its own. With ``compressed_buffer`` the
    limit is scaled by the compression rate (ACP-SGD §IV-B), so compressed buckets span as many
    layers as dense ones and keep overlapping backward; otherwise compressed bytes count against
    ``bucket_mb`` (fewer, larger collectives). ``fuse_before_compress`` compresses each bucket's
    flattened gradient as one tensor; unset, only where that changes no bit (elementwise
    compressors: the casts), ``false`` never."""

    bucket_mb: float = field(default=25.0, metadata={"min": 0.0})
    compressed_buffer: bool = True
    fuse_before_compress: bool | None = None


@dataclass
class LayerOverride:
    """Per-parameter override; the first entry whose ``match`` (fnmatch) fits a name wins."""

    match: str = ""
    compressor: ComponentSpec | None = None
    memory: ComponentSpec | None = None
    communicator: ComponentSpec | None = None
    #: compress these tensors on a CPU worker thread, in parallel with backward (ByteComp's
    #: "compress on CPU"); needs an offloadable communicator: allgather, allgather_fast, alltoall
    offload: bool = False


@dataclass
class TrainConfig:
    """The built-in job of ``adacomp train`` (a small CNN on scikit-learn's digits by default)."""

    dataset: str = field(default="digits", metadata={"choices": ("digits",)})
    model: str = field(default="cnn", metadata={"choices": ("cnn", "mlp")})
    workers: int = field(default=2, metadata={"min": 1})
    epochs: int = field(default=5, metadata={"min": 1})
    batch_size: int = field(default=32, metadata={"min": 1})
    lr: float = field(default=0.05, metadata={"min": 0.0})
    momentum: float = field(default=0.9, metadata={"min": 0.0})
    seed: int = 0
    out_dir: str = "runs/quickstart"
    log_every: int = field(default=10, metadata={"min": 1})


@dataclass
class LocalStepsConfig:
    """Local steps with a compressed outer synchronisation (the DiLoCo family; docs/algorithms.md).

    Every ``every`` optimizer steps the pseudo-gradient (parameters at the last synchronisation minus
    the local ones) goes through the configured compressor, memory and communicator, and the outer
    optimizer applies the average (DiLoCo Algorithm 1). ``fragments`` > 1 synchronises one fragment
    of the model at a time, fragment f after the steps t with t mod every = (f + 1) every / fragments
    (Streaming DiLoCo §2.2); ``overlap_steps`` lets a fragment's collectives run during that many
    further inner steps, after which the outer result is mixed into the local parameters with weight
    ``1 - mixing`` (Streaming DiLoCo §2.3, its alpha)."""

    every: int = field(default=32, metadata={"min": 1})
    outer_optimizer: ComponentSpec = field(default_factory=lambda: ComponentSpec("nesterov"))
    fragments: int = field(default=1, metadata={"min": 1})
    overlap_steps: int = field(default=0, metadata={"min": 0})
    mixing: float = field(default=0.5, metadata={"min": 0.0})
    #: how parameters are cut into fragments: ``strided`` (block i goes to fragment i mod fragments,
    #: Streaming DiLoCo's better pattern) or ``sequential`` (contiguous, balanced by size)
    fragment_pattern: str = field(default="strided", metadata={"choices": ("strided", "sequential")})


@dataclass
class Config:
    """The whole run. See docs/config.md for every key."""

    backend: str = field(default="auto", metadata={"choices": BACKENDS})
    compressor: ComponentSpec = field(default_factory=lambda: ComponentSpec("none"))
    memory: ComponentSpec = field(default_factory=lambda: ComponentSpec("auto"))
    communicator: ComponentSpec = field(default_factory=lambda: ComponentSpec("allreduce"))
    fusion: FusionConfig = field(default_factory=FusionConfig)
    policy: ComponentSpec = field(default_factory=lambda: ComponentSpec("static"))
    layers: list[LayerOverride] = field(default_factory=list)
    min_numel: int = field(default=1024, metadata={"min": 0})
    nonfinite: str = field(default="propagate", metadata={"choices": NONFINITE})
    #: ranks whose weights still differ at the first backward: ``warn`` (Horovod runs such scripts) or ``raise``
    initial_weights: str = field(default="warn", metadata={"choices": INITIAL_WEIGHTS})
    timeout_s: float = field(default=60.0, metadata={"min": 0.1})
    #: absent: every step communicates (the per-step path); present: the outer loop
    local_steps: LocalStepsConfig | None = None
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def hash(self) -> str:
        """Stable hash of the resolved config; compared across ranks at init. ``train.out_dir``
        is excluded because ranks may legitimately log to different places."""
        d = self.to_dict()
        d.get("train", {}).pop("out_dir", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, ComponentSpec):
        return obj.as_dict()
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_to_plain(x) for x in obj]
    return obj


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------
def _show(value: Any) -> str:
    """A short, bounded repr for messages: deep or huge values must not recurse or flood."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 3, 60, 60, 40
    return r.repr(value)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def check_scalar(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against a plain annotation (int, float, bool, str, Optional[...])."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return check_scalar(value, a, path)
            except ConfigError as exc:
                errors.append(exc.reason)
        raise ConfigError(path, f"expected one of {[_type_name(a) for a in args]}, got {_show(value)}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {_show(value)} ({type(value).__name__})")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {_show(value)} ({type(value).__name__})")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {_show(value)} ({type(value).__name__})")
        try:
            f = float(value)
        except OverflowError:
            raise ConfigError(path, f"expected a finite number, got an integer of {len(str(value))} digits") from None
        if f != f or f in (float("inf"), float("-inf")):
            raise ConfigError(path, f"expected a finite number, got {_show(value)}")
        return f
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {_show(value)} ({type(value).__name__})")
        return value
    return value  # un-annotated or complex: the constructor checks it


def _registry(kind: str):
    from adacomp import communicators, compressors, memories, registry
    return {"compressor": compressors.registry, "memory": memories.registry,
            "communicator": communicators.registry, "policy": registry.policies,
            "outer_optimizer": registry.outer_optimizers}[kind]


def parse_component(value: Any, kind: str, path: str) -> ComponentSpec:
    """Validate ``{name: ..., **params}`` (or a bare name) against the ``kind`` registry."""
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"expected a mapping like {{name: ...}} or a {kind} name, got {_show(value)}")
    if "name" not in value:
        raise ConfigError(f"{path}.name", f"missing; valid {kind} names: {', '.join(_choices(kind))}")
    name = value["name"]
    if not isinstance(name, str):
        raise ConfigError(f"{path}.name", f"expected a string, got {_show(name)}")
    if kind == "memory" and name == "auto":
        if len(value) > 1:
            raise ConfigError(path, "memory 'auto' takes no parameters; name a memory to set them")
        return ComponentSpec("auto")
    reg = _registry(kind)
    if name not in reg.names():
        raise ConfigError(f"{path}.name", f"unknown {kind} {_show(name)}; valid choices: {', '.join(_choices(kind))}")
    sig = reg.params(name)
    params: dict[str, Any] = {}
    for key, v in value.items():
        if key == "name":
            continue
        if not isinstance(key, str) or key not in sig:
            valid = ", ".join(sorted(sig)) or "(none)"
            raise ConfigError(f"{path}.{key}", f"unknown parameter of {kind} {_show(name)}; valid parameters: {valid}")
        ann = sig[key].annotation
        if isinstance(ann, str):  # from __future__ annotations
            try:
                ann = typing.get_type_hints(reg.cls(name).__init__)[key]
            except Exception:  # noqa: BLE001 - unresolvable hint: leave it to the constructor
                ann = inspect.Parameter.empty
        params[key] = check_scalar(v, ann, f"{path}.{key}") if ann is not inspect.Parameter.empty else v
    try:
        reg.get(name, **params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(path, f"invalid parameters for {kind} {_show(name)}: {exc}") from None
    return ComponentSpec(name, params)


def _choices(kind: str) -> list[str]:
    names = _registry(kind).names()
    return ["auto", *names] if kind == "memory" else names


def _parse_dataclass(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in fields:
            raise ConfigError(sub, f"unknown key; valid keys: {', '.join(sorted(fields))}")
        tp = hints[key]
        meta = fields[key].metadata
        if tp is ComponentSpec or tp == (ComponentSpec | None):
            kwargs[key] = None if value is None and tp != ComponentSpec else parse_component(value, key, sub)
        elif dataclasses.is_dataclass(tp):
            kwargs[key] = _parse_dataclass(typing.cast(type, tp), value, sub)
        elif _optional_dataclass(tp) is not None:
            kwargs[key] = None if value is None else _parse_dataclass(_optional_dataclass(tp), value, sub)
        elif typing.get_origin(tp) is list:
            (item_tp,) = typing.get_args(tp)
            if not isinstance(value, list):
                raise ConfigError(sub, f"expected a list, got {_show(value)}")
            kwargs[key] = [_parse_dataclass(item_tp, v, f"{sub}[{i}]") for i, v in enumerate(value)]
        else:
            v = check_scalar(value, tp, sub)
            if "choices" in meta and v not in meta["choices"]:
                raise ConfigError(sub, f"expected one of {list(meta['choices'])}, got {_show(v)}")
            if "min" in meta and v < meta["min"]:
                raise ConfigError(sub, f"must be >= {meta['min']}, got {_show(v)}")
            kwargs[key] = v
    return cls(**kwargs)


def _optional_dataclass(tp: Any) -> Any:
    """``X`` for an annotation ``X | None`` whose ``X`` is a dataclass, else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) == 1 and type(None) in typing.get_args(tp) and dataclasses.is_dataclass(args[0]) \
            and args[0] is not ComponentSpec:
        return args[0]
    return None


def _check_local_steps(cfg: Config) -> None:
    """What the outer loop cannot do, refused before any collective, naming the key."""
    ls = cfg.local_steps
    if ls is None:
        return
    if ls.mixing > 1.0:
        raise ConfigError("local_steps.mixing", f"must be in [0, 1] (Streaming DiLoCo's alpha), got {ls.mixing}")
    if ls.fragments > ls.every:
        raise ConfigError("local_steps.fragments", f"must be <= local_steps.every ({ls.every}): each fragment "
                                                   f"needs its own step in the window, got {ls.fragments}")
    if ls.overlap_steps >= ls.every:
        raise ConfigError("local_steps.overlap_steps", f"must be < local_steps.every ({ls.every}): a fragment's "
                                                       f"sync must land before its next one, got {ls.overlap_steps}")
    if cfg.policy.name != "static":
        raise ConfigError("policy.name", f"policy {cfg.policy.name!r} re-plans compression every step from "
                                         "per-step measurements; with local_steps only 'static' applies")
    for i, layer in enumerate(cfg.layers):
        if layer.offload:
            raise ConfigError(f"layers[{i}].offload", "offload overlaps compression with backward; with "
                                                      "local_steps nothing is sent during backward")


def _check_layers(cfg: Config) -> None:
    for i, layer in enumerate(cfg.layers):
        if not layer.match:
            raise ConfigError(f"layers[{i}].match", "missing; give an fnmatch pattern such as '*.bias'")


def check_pair(compressor_spec: ComponentSpec, communicator_spec: ComponentSpec, path: str,
               memory_spec: ComponentSpec | None = None, memory_path: str = "memory") -> None:
    """Refuse a compressor whose payload the communicator (or memory) cannot handle, naming what fits."""
    from adacomp import communicators, compressors, memories
    comp = compressors.get(compressor_spec.name, **compressor_spec.params)
    comm = communicators.get(communicator_spec.name, **communicator_spec.params)
    try:
        comm.check(comp)
    except IncompatibleComponentsError as exc:
        raise IncompatibleComponentsError(path, exc.reason) from None
    if memory_spec is not None and memory_spec.name != "auto":
        try:
            memories.get(memory_spec.name, **memory_spec.params).check(comp)
        except ValueError as exc:
            raise IncompatibleComponentsError(memory_path, str(exc)) from None


def from_dict(data: Any) -> Config:
    """Validate a parsed YAML document and return the :class:`Config`."""
    if data is None:
        data = {}
    cfg = _parse_dataclass(Config, data, "")
    _check_layers(cfg)
    _check_local_steps(cfg)
    _default_communicators(cfg, data)
    check_pair(cfg.compressor, cfg.communicator, "communicator", cfg.memory, "memory")
    for i, layer in enumerate(cfg.layers):
        check_pair(layer.compressor or cfg.compressor, layer.communicator or cfg.communicator,
                   f"layers[{i}].communicator", layer.memory or cfg.memory, f"layers[{i}].memory")
        if layer.offload:
            check_offload(layer.compressor or cfg.compressor, layer.communicator or cfg.communicator,
                          f"layers[{i}].offload")
    return cfg


def _default_communicator(compressor: ComponentSpec) -> ComponentSpec | None:
    """The communicator a compressor class names as its own (``default_communicator``), if any."""
    from adacomp import compressors
    name = getattr(compressors.registry.cls(compressor.name), "default_communicator", None)
    return ComponentSpec(name) if name else None


def _default_communicators(cfg: Config, data: Any) -> None:
    """Where the config names no communicator, use the compressor's own (``oktopk`` -> its sparse
    allreduce) instead of ``allreduce``; an explicit ``communicator`` always wins."""
    if isinstance(data, Mapping) and "communicator" not in data:
        cfg.communicator = _default_communicator(cfg.compressor) or cfg.communicator
    for layer in cfg.layers:
        if layer.compressor is not None and layer.communicator is None:
            layer.communicator = _default_communicator(layer.compressor)


def check_offload(compressor_spec: ComponentSpec, communicator_spec: ComponentSpec, path: str) -> None:
    """Offloading compresses on a worker thread before the collective: the route must compress, and
    its communicator must separate compression from launching (``Communicator.offloadable``)."""
    from adacomp import communicators
    if compressor_spec.name == "none":
        raise ConfigError(path, "offload needs a compressor; this route sends dense gradients")
    if not communicators.registry.cls(communicator_spec.name).offloadable:
        fits = [n for n in communicators.names() if communicators.registry.cls(n).offloadable]
        raise ConfigError(path, f"communicator {communicator_spec.name!r} compresses while it communicates, "
                                f"so it cannot be offloaded; offloadable communicators: {', '.join(fits)}")


def load(source: "str | os.PathLike[str] | Mapping[str, Any] | Config | None") -> Config:
    """Load a config from a YAML path, a dict, an existing :class:`Config` or None (defaults)."""
    if isinstance(source, Config):
        return source
    if source is None or isinstance(source, Mapping):
        return from_dict(source)
    path = os.fspath(source)
    if not os.path.exists(path):
        raise ConfigError("", f"config file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError("", f"{path} is not valid YAML: {str(exc)[:300]}") from None
    except OSError as exc:
        raise ConfigError("", f"cannot read config file {path!r}: {exc.strerror or exc}") from None
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise type(exc)(exc.path, f"{exc.reason} (in {path})") from None
