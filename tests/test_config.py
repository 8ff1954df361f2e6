"""Config validation: each kind of mistake fails with the dotted key path and the valid choices."""
from __future__ import annotations

import pytest

from adacomp.config import Config, load
from adacomp.errors import ConfigError, IncompatibleComponentsError


def err(data) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        load(data)
    return exc.value


def test_defaults_are_dense_allreduce() -> None:
    cfg = load(None)
    assert isinstance(cfg, Config)
    assert (cfg.compressor.name, cfg.communicator.name, cfg.fusion.bucket_mb) == ("none", "allreduce", 25.0)


def test_unknown_top_level_key_names_the_key_and_valid_keys() -> None:
    e = err({"compresor": {"name": "topk"}})
    assert e.path == "compresor" and "compressor" in str(e)


def test_unknown_nested_key() -> None:
    e = err({"fusion": {"bucket_MB": 3}})
    assert e.path == "fusion.bucket_MB" and "bucket_mb" in str(e)


def test_wrong_type() -> None:
    e = err({"fusion": {"bucket_mb": "big"}})
    assert e.path == "fusion.bucket_mb" and "number" in str(e)
    e = err({"fusion": {"compressed_buffer": 1}})
    assert e.path == "fusion.compressed_buffer"


def test_out_of_range_values() -> None:
    assert err({"fusion": {"bucket_mb": -1}}).path == "fusion.bucket_mb"
    assert err({"min_numel": -5}).path == "min_numel"
    e = err({"compressor": {"name": "topk", "density": 1.5}, "communicator": {"name": "allgather"}})
    assert e.path == "compressor" and "density" in str(e)


def test_unknown_registry_name_lists_choices() -> None:
    e = err({"compressor": {"name": "topkk"}})
    assert e.path == "compressor.name" and "topk" in str(e) and "none" in str(e)
    e = err({"backend": "gloo"})
    assert e.path == "backend" and "torch" in str(e)


def test_unknown_component_parameter() -> None:
    e = err({"compressor": {"name": "topk", "ratio": 0.1}, "communicator": {"name": "allgather"}})
    assert e.path == "compressor.ratio" and "density" in str(e)


def test_component_parameter_type_is_checked() -> None:
    e = err({"compressor": {"name": "topk", "density": "0.1"}, "communicator": {"name": "allgather"}})
    assert e.path == "compressor.density"


def test_sparse_payload_on_allreduce_is_refused_with_fitting_communicators() -> None:
    with pytest.raises(IncompatibleComponentsError) as exc:
        load({"compressor": {"name": "topk", "density": 0.01}, "communicator": {"name": "allreduce"}})
    assert "allgather" in str(exc.value)


def test_layers_override_is_validated_with_index_in_path() -> None:
    e = err({"layers": [{"match": "*.bias", "compressor": {"name": "nope"}}]})
    assert e.path == "layers[0].compressor.name"
    e = err({"layers": [{"compressor": {"name": "none"}}]})
    assert e.path == "layers[0].match"
    e = err({"layers": {"match": "x"}})
    assert e.path == "layers"


def test_yaml_file_errors_name_the_file(tmp_path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("compressor: {name: topk\n")
    e = err(str(p))
    assert "not valid YAML" in str(e)
    p.write_text("fusion: {bucket_mb: x}\n")
    e = err(str(p))
    assert e.path == "fusion.bucket_mb" and "bad.yaml" in str(e)
    assert "does not exist" in str(err(str(tmp_path / "missing.yaml")))


def test_hash_is_stable_and_sensitive() -> None:
    a = load({"compressor": {"name": "fp16"}})
    b = load({"compressor": {"name": "fp16"}})
    c = load({"compressor": {"name": "none"}})
    assert a.hash() == b.hash() != c.hash()


def test_every_shipped_config_loads() -> None:
    import pathlib
    for path in sorted(pathlib.Path(__file__).resolve().parent.parent.joinpath("configs").glob("*.yaml")):
        load(str(path))


def test_dgc_memory_with_dense_compressor_is_refused() -> None:
    with pytest.raises(IncompatibleComponentsError) as exc:
        load({"compressor": {"name": "fp16"}, "memory": {"name": "dgc"}})
    assert exc.value.path == "memory" and "residual" in str(exc.value)
