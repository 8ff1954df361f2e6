"""Property-based fuzzing of the YAML schema (adacomp/config.py) with hypothesis.

Properties, for any document:
* ``from_dict`` / ``load`` either return a Config or raise ConfigError; no internal exception type
  (KeyError, TypeError, OverflowError, RecursionError, ...) escapes;
* the error's ``.path`` is the dotted path of a key present in the input, or of a key the error
  says is missing (``compressor.name``, ``layers[0].match``, a defaulted ``communicator``);
* the message carries no traceback; nothing touches a transport (no backend is created);
* valid documents load, and equivalent spellings (bare component names, a YAML round trip) give the
  same config hash.
Edge cases that once escaped as other exceptions (huge integers, deep nesting, unreadable files,
unbounded seeds / bucket sizes / candidate counts) are pinned by tests at the end.
"""
from __future__ import annotations

import typing
from typing import Any, Iterator

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from adacomp import communicators, compressors, config, memories, policies
from adacomp.errors import ConfigError

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    derandomize=True)
REGISTRIES = {"compressor": compressors.registry, "memory": memories.registry,
              "communicator": communicators.registry, "policy": policies.registry}
TOP_KEYS = sorted(f.name for f in config.dataclasses.fields(config.Config))
SUB_KEYS = {"fusion": ["bucket_mb", "compressed_buffer", "fuse_before_compress"],
            "train": [f.name for f in config.dataclasses.fields(config.TrainConfig)],
            "layers": ["match", "compressor", "memory", "communicator"]}
ALL_NAMES = sorted({n for r in REGISTRIES.values() for n in r.names()} | {"auto", "gloo", "Topk", ""})


@pytest.fixture(autouse=True)
def no_transport(monkeypatch) -> Iterator[None]:
    """Validation must never start a transport: make every way to start one fail loudly."""
    import torch.distributed as dist

    from adacomp import backends

    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("config validation tried to start a transport")
    monkeypatch.setattr(backends, "create", refuse)
    monkeypatch.setattr(dist, "init_process_group", refuse)
    yield
    assert not dist.is_initialized()


# --- strategies ----------------------------------------------------------------------------------
# Integers are bounded to 64 bits here; unbounded ones are covered by the edge-case tests below.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 64), st.floats(allow_nan=True),
                    st.text(max_size=8), st.sampled_from(ALL_NAMES))
keys = st.one_of(st.sampled_from(TOP_KEYS + [k for v in SUB_KEYS.values() for k in v] + ["name", "density", "rank"]),
                 st.text(max_size=6), st.integers(-3, 3), st.booleans(), st.none())
anything = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                        st.dictionaries(keys, kids, max_size=4)), max_leaves=12)


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy = scalars) -> st.SearchStrategy:
    """``good`` three times in four (``one_of`` would weigh each flattened branch equally)."""
    return st.tuples(st.integers(0, 3), good, bad).map(lambda t: t[1] if t[0] else t[2])


def typed_value(tp: Any) -> st.SearchStrategy:
    """Values of a parameter's annotated type, heavy on the edges, plus the odd wrong type."""
    edge = {int: st.one_of(st.integers(-2 ** 63, 2 ** 64), st.sampled_from([0, 1, -1, 2 ** 31, 2 ** 63])),
            float: st.one_of(st.floats(allow_nan=True), st.sampled_from([0.0, 1.0, -0.0, 1e-300, 1.0000001, 1e300])),
            bool: st.booleans(), str: st.one_of(st.text(max_size=8), st.sampled_from(["rows", "star", "ring", "size"]))}
    return mostly(edge.get(tp, scalars))


# Parameters whose edge values would need huge memory are kept in range here (edge-case tests below):
# fuzz them only with values that cannot take the machine down.
UNSAFE = {("policy", "moo", "factor"): st.sampled_from([1.5, 3.0, 10.0, 1.0, 0.5, -2.0, "3"]),
          ("compressor", "qsgd", "bucket_size"): st.sampled_from([0, 1, 64, 512, -1, "8"])}


@st.composite
def component(draw: Any, kind: str) -> Any:
    reg = REGISTRIES[kind]
    name = draw(st.sampled_from(reg.names() + (["auto"] if kind == "memory" else [])) | st.sampled_from(ALL_NAMES))
    if draw(st.integers(0, 9)) == 0:
        return name  # bare-name shorthand
    spec: dict[Any, Any] = {"name": name}
    if name in reg.names():
        hints = typing.get_type_hints(reg.cls(name).__init__)
        for p in draw(st.lists(st.sampled_from(sorted(reg.params(name)) or ["x"]), max_size=3, unique=True)):
            spec[p] = draw(UNSAFE[(kind, name, p)] if (kind, name, p) in UNSAFE else typed_value(hints.get(p)))
    if draw(st.integers(0, 9)) == 0:
        spec[draw(keys)] = draw(scalars)  # an unknown or duplicated key
    if draw(st.integers(0, 14)) == 0:
        del spec["name"]
    return spec


def field_value(cls: type, name: str) -> st.SearchStrategy:
    """A value for a dataclass field: often valid (its choices / type), sometimes anything."""
    f = {x.name: x for x in config.dataclasses.fields(cls)}[name]
    tp = typing.get_type_hints(cls)[name]
    good = st.sampled_from(f.metadata["choices"]) if "choices" in f.metadata else typed_value(tp)
    return mostly(good)


@st.composite
def section(draw: Any, cls: type) -> Any:
    names = [f.name for f in config.dataclasses.fields(cls)]
    out = {n: draw(field_value(cls, n)) for n in draw(st.lists(st.sampled_from(names), max_size=3, unique=True))}
    if draw(st.integers(0, 7)) == 0:
        out[draw(keys)] = draw(scalars)
    return out if draw(st.integers(0, 9)) else draw(scalars)


@st.composite
def documents(draw: Any) -> Any:
    """Schema-shaped documents: mostly well-typed, with mistakes sprinkled in at every depth."""
    doc: dict[Any, Any] = {}
    for key in draw(st.lists(st.sampled_from(TOP_KEYS), max_size=6, unique=True)):
        if key in REGISTRIES:
            doc[key] = draw(component(key))
        elif key == "fusion":
            doc[key] = draw(section(config.FusionConfig))
        elif key == "train":
            doc[key] = draw(section(config.TrainConfig))
        elif key == "layers":
            doc[key] = draw(st.lists(st.fixed_dictionaries(
                {}, optional={"match": st.text(max_size=4) | scalars, "compressor": component("compressor"),
                              "memory": component("memory"), "communicator": component("communicator")}) | scalars,
                max_size=2) | scalars)
        else:
            doc[key] = draw(field_value(config.Config, key))
    if draw(st.integers(0, 7)) == 0:
        doc[draw(keys)] = draw(anything)
    return doc


# --- the property ----------------------------------------------------------------------------------
def paths(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every key path of ``obj`` spelled the way config.py spells them, mapped to its value."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{prefix}.{k}" if prefix else str(k)
            out[p] = v
            out.update(paths(v, p))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            p = f"{prefix}[{i}]"
            out[p] = v
            out.update(paths(v, p))
    return out


def check(doc: Any) -> config.Config | None:
    try:
        return config.from_dict(doc)
    except ConfigError as exc:
        check_error(exc, doc)
        return None


def check_error(exc: ConfigError, doc: Any) -> None:
    msg = str(exc)
    assert "Traceback" not in msg and msg.strip(), msg
    present = paths(doc)
    if exc.path in present:
        return
    if exc.path == "":
        assert not isinstance(doc, dict), f"document-level error for a mapping: {msg}"
        return
    parent, _, last = exc.path.rpartition(".")
    if "missing" in exc.reason:  # names the key to add, under a key that is there
        assert parent in present, f"path {exc.path!r} names a key under {parent!r}, absent from {doc!r}"
        assert isinstance(present[parent], (dict, str)), exc.path
        return
    if parent in present and isinstance(present[parent], str) and last == "name":
        return  # bare-name shorthand `compressor: topk` was read as {name: topk}
    if isinstance(exc, config.IncompatibleComponentsError) and exc.path.endswith("communicator"):
        return  # the communicator was defaulted (allreduce): this is the key to add
    raise AssertionError(f"error path {exc.path!r} is not a key of the input {doc!r}: {msg}")


@SETTINGS
@given(documents())
def test_schema_shaped_documents_load_or_fail_with_a_path(doc: Any) -> None:
    check(doc)


@SETTINGS
@given(anything)
def test_arbitrary_structures_load_or_fail_with_a_path(doc: Any) -> None:
    check(doc)


VALID = [None, {}, {"compressor": "fp16"},
         {"compressor": {"name": "topk", "density": 0.01}, "communicator": {"name": "allgather"},
          "layers": [{"match": "*.bias", "compressor": {"name": "none"}, "communicator": "allreduce"}],
          "fusion": {"bucket_mb": 0, "compressed_buffer": False}, "nonfinite": "skip", "timeout_s": 5}]


@SETTINGS
@given(st.sampled_from(VALID), st.sampled_from(["backend", "min_numel", "nonfinite", "timeout_s"]),
       st.sampled_from([None, "torch", 0, 7, "skip", 2.5]))
def test_valid_documents_load_and_spellings_agree(base: Any, key: str, value: Any) -> None:
    doc = dict(base or {})
    doc[key] = value
    cfg = check(doc)
    assume(cfg is not None)
    again = config.from_dict(yaml.safe_load(yaml.safe_dump(doc)))
    assert again.hash() == cfg.hash()
    bare = {k: (v["name"] if isinstance(v, dict) and list(v) == ["name"] else v) for k, v in doc.items()}
    assert config.from_dict(bare).hash() == cfg.hash()


def test_every_registry_name_with_defaults_loads_or_names_a_fitting_communicator() -> None:
    for kind, reg in REGISTRIES.items():
        for name in reg.names():
            doc = {kind: {"name": name}}
            if kind == "compressor":
                cls = reg.cls(name)
                doc["communicator"] = "allreduce" if cls.additive else "allgather"
            check(doc)


@SETTINGS
@given(st.text(max_size=40) | st.builds(lambda d: yaml.safe_dump(d), documents()))
def test_yaml_text_loads_or_fails_with_config_error(tmp_path_factory, text: str) -> None:
    path = tmp_path_factory.mktemp("yaml") / "c.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        config.load(str(path))
    except ConfigError as exc:
        assert "Traceback" not in str(exc)


# --- known bugs: each flips to a pass when config.py is fixed (strict) -------------------------------
def _deep(n: int) -> Any:
    v: Any = 1
    for _ in range(n):
        v = [v]
    return v


@pytest.mark.parametrize("doc", [{"fusion": {"bucket_mb": 10 ** 400}}, {"timeout_s": 10 ** 400},
                                 {"compressor": {"name": "topk", "density": 10 ** 400}, "communicator": "allgather"}],
                         ids=["fusion", "timeout", "component"])
def test_huge_integer_for_a_number_is_a_config_error(doc: Any) -> None:
    with pytest.raises(ConfigError) as exc:
        config.from_dict(doc)
    check_error(exc.value, doc)


def test_deeply_nested_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as exc:
        config.from_dict({"fusion": _deep(5000)})
    assert exc.value.path == "fusion"


@pytest.mark.parametrize("content", [b"fusion: " + b"[" * 5000 + b"]" * 5000, b"\xff\xfe\x00 x", None],
                         ids=["deep-yaml", "not-utf8", "directory"])
def test_unreadable_yaml_file_is_a_config_error(tmp_path, content: bytes | None) -> None:
    path = tmp_path / "c.yaml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError):
        config.load(str(path))


@st.composite
def compressor_specs(draw: Any) -> dict[str, Any]:
    """Well-typed parameters at their edges (no wrong types: those are covered above)."""
    reg = compressors.registry
    name = draw(st.sampled_from(reg.names()))
    hints = typing.get_type_hints(reg.cls(name).__init__)
    edge = {int: st.sampled_from([0, 1, 2, 3, 7, 2 ** 20]) | st.integers(-5, 100),  # bigger: see the edge-case tests
            float: st.sampled_from([1e-300, 1e-6, 0.001, 0.5, 1.0, 1.0000001, 1e300]) | st.floats(0, 2),
            bool: st.booleans(), str: st.sampled_from(["rows", "cols", "none", "exponential", "gamma", "x"])}
    spec = {"name": name}
    for p in draw(st.lists(st.sampled_from(sorted(reg.params(name)) or ["density"]), max_size=3, unique=True)):
        if p in hints:
            spec[p] = draw(edge.get(hints[p], st.none()))
        if p == "seed":
            spec[p] = draw(st.sampled_from([0, 1, 2 ** 32]))  # larger: see the edge-case tests
    return spec


def loads_then_compresses(spec: dict[str, Any]) -> bool:
    """False if the spec is refused at load; otherwise it must compress (and decompress)."""
    import torch
    cls = compressors.registry.cls(spec["name"])
    cfg = check({"compressor": spec, "communicator": "allreduce" if cls.additive else "allgather"})
    if cfg is None:
        return False
    comp = compressors.get(cfg.compressor.name, **cfg.compressor.params)
    t = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    payload, ctx = comp.compress(t, "w")
    if comp.rounds == 1:
        assert comp.decompress(payload, ctx).shape == t.shape
    return True


@SETTINGS
@given(compressor_specs())
def test_a_compressor_config_that_loads_can_compress(spec: dict[str, Any]) -> None:
    """Out-of-range values must fail at load time, not at the first step inside a collective."""
    assume(loads_then_compresses(spec))


@pytest.mark.parametrize("name,seed", [("dgc", 2 ** 64), ("qsgd", 2 ** 62)])
def test_out_of_range_seed_fails_at_load(name: str, seed: int) -> None:
    loads_then_compresses({"name": name, "seed": seed})


def test_qsgd_bucket_size_is_bounded_or_clamped() -> None:
    loads_then_compresses({"name": "qsgd", "bucket_size": 2 ** 62})


_MOO_FACTOR = """
import resource, sys
from adacomp import config
from adacomp.errors import ConfigError
# 2 GiB beyond what the imports mapped (a CUDA build of torch maps several GiB of address space)
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2 * 2 ** 30, vm + 2 * 2 ** 30))
try:
    config.from_dict({"policy": {"name": "moo", "factor": 1.0 + 1e-12}})
    print("loaded")
except ConfigError:
    print("config error")
except MemoryError:
    print("MemoryError")
"""


def test_moo_factor_near_one_is_a_config_error() -> None:
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _MOO_FACTOR], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "config error", out.stdout + out.stderr[-500:]
