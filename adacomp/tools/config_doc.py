"""Generate docs/config.md from the schema itself, so the reference cannot drift from the code.

``python -m adacomp.tools.config_doc > docs/config.md``; tests/test_config_doc.py checks the committed
file equals what this module produces.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing

from adacomp import config as C

KEY_DOCS: dict[str, str] = {
    "backend": "Transport. `auto` follows the launcher (torchrun / `adacomp run` -> torch, mpirun -> mpi, horovodrun -> horovod, none -> local).",
    "compressor": "Default compressor for every parameter (registry name + parameters).",
    "memory": "Error-feedback memory. `auto`: `residual` for biased compressors, `none` otherwise.",
    "communicator": "How payloads travel; must fit the compressor (checked at load time). When omitted: the compressor's own communicator where it names one (`oktopk` -> `oktopk`), else `allreduce`.",
    "fusion": "Tensor fusion.",
    "fusion.bucket_mb": "Bucket size in MiB; 0 sends each tensor on its own.",
    "fusion.compressed_buffer": "Scale the bucket size by each route's compression rate (ACP-SGD §IV-B): compressed buckets span as many layers as dense ones, keeping overlap with backward. `false`: compressed bytes count against `bucket_mb`.",
    "fusion.fuse_before_compress": "Compress each bucket's flattened gradient as one tensor (global selection per bucket). Unset: only elementwise compressors (bf16, fp16), whose bits do not change; false: never.",
    "policy": "Adaptive policy deciding compression between steps.",
    "layers": "Per-parameter overrides; the first entry whose `match` (fnmatch on the parameter name) fits wins.",
    "layers[].match": "fnmatch pattern on parameter names, e.g. `*.bias`.",
    "layers[].compressor": "Compressor for matching parameters.",
    "layers[].memory": "Memory for matching parameters.",
    "layers[].communicator": "Communicator for matching parameters.",
    "layers[].offload": "Compress matching parameters on a CPU worker thread in parallel with backward (ByteComp's \"compress on CPU\"); needs `allgather`, `allgather_fast` or `alltoall`.",
    "min_numel": "Parameters with fewer elements go uncompressed on allreduce (unless a `layers` rule matches).",
    "nonfinite": "NaN/Inf gradient on any rank. Every mode first restores all residuals, thresholds, factors and policy state to what they were before the step, on every rank. `propagate` (default, what torch.amp.GradScaler needs): compressed gradients become NaN on every rank, uncompressed ones hold the plain average (as under DDP), so GradScaler skips the step everywhere; `skip`: `step()` drops the update on every rank; `raise`: NonFiniteGradientError on every rank naming parameter and rank.",
    "initial_weights": "Ranks whose weights still differ from rank 0's at the first backward (checked with one small allgather of a fingerprint; Horovod scripts broadcast after building the optimizer). `warn` (default: Horovod runs such scripts, and some build per-rank weights on purpose): a warning on every rank naming the ranks and `adacomp.broadcast_parameters(model.state_dict(), root_rank=0)`; `raise`: `RanksDisagreeError` (a `CommunicationError`) on every rank with the same text. With `local_steps` it is always an error (no Horovod script runs local steps, and the outer loop would start each rank's synchronised copy from its own weights).",
    "timeout_s": "Seconds a collective may wait before the run fails (dead peer).",
    "local_steps": "Absent: every step communicates. Present: local steps with a compressed outer synchronisation (DiLoCo family, docs/algorithms.md): backward and the inner `step()` send nothing; every `every` steps the pseudo-gradient (synchronised minus local parameters) goes through `compressor` / `memory` / `communicator` and the outer optimizer applies the average. Not with the DDP hook, adaptive policies or `offload`.",
    "local_steps.every": "H, inner steps between synchronisations (DiLoCo: up to 500). 1 synchronises after every step (with outer `sgd`, lr 1, no compression: DDP's parameters).",
    "local_steps.outer_optimizer": "What the averaged pseudo-gradient does: `nesterov` (DiLoCo: lr 0.7, momentum 0.9) or `sgd` (lr 1, momentum 0: Local SGD's averaging).",
    "local_steps.fragments": "P > 1: Streaming DiLoCo, fragment f of the model is synchronised after the steps t with t mod every = (f + 1) every / P, so a synchronisation carries 1/P of the model.",
    "local_steps.overlap_steps": "Inner steps a fragment's collectives may run behind before the outer result is applied (Streaming DiLoCo's tau); must be < `every`.",
    "local_steps.mixing": "Streaming DiLoCo's alpha in [0, 1]: with overlap, local = alpha * local + (1 - alpha) * synchronised when a fragment's result lands (no overlap: the local copy is replaced).",
    "local_steps.fragment_pattern": "`strided`: block i (a name's prefix up to its first number, e.g. `blocks.3`) goes to fragment i mod P (Streaming DiLoCo's better pattern); `sequential`: contiguous blocks balanced by size.",
    "train": "The built-in job of `adacomp train`.",
    "train.dataset": "Dataset shipped offline inside a package.",
    "train.model": "Model for the built-in job.",
    "train.workers": "Local workers `adacomp train` starts when not under a launcher.",
    "train.epochs": "Epochs over the training split.",
    "train.batch_size": "Per-worker batch size.",
    "train.lr": "SGD learning rate.",
    "train.momentum": "SGD momentum.",
    "train.seed": "Seed of model init, data split and shuffling.",
    "train.out_dir": "Where metrics.json and training.png go.",
    "train.log_every": "Progress-bar loss refresh period (steps).",
}


def _type(tp: typing.Any) -> str:
    if tp is C.ComponentSpec or tp == (C.ComponentSpec | None):
        return "component" + (" or null" if tp is not C.ComponentSpec else "")
    if C._optional_dataclass(tp) is not None:
        return "section or null"
    s = getattr(tp, "__name__", None) or str(tp)
    return {"FusionConfig": "section", "TrainConfig": "section", "list": "list"}.get(s, s)


def _fields(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "")  # type: ignore[misc]
        if isinstance(default, C.ComponentSpec):
            default = f"{{name: {default.name}}}"
        elif dataclasses.is_dataclass(default):
            default = "(section)"
        elif isinstance(default, list):
            default = "[]"
        meta = f.metadata
        allowed = ", ".join(map(str, meta["choices"])) if "choices" in meta else (
            f">= {meta['min']}" if "min" in meta else "")
        rows.append((path, _type(tp), f"`{default}`" if default != "" else "", allowed))
        if dataclasses.is_dataclass(tp) and tp is not C.ComponentSpec:
            rows += _fields(typing.cast(type, tp), path + ".")
        elif C._optional_dataclass(tp) is not None:
            rows += _fields(C._optional_dataclass(tp), path + ".")
        elif typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp)
            rows += _fields(item, path + "[].")
    return rows


PLURAL = {"compressor": "Compressors", "memory": "Memories", "communicator": "Communicators", "policy": "Policies",
          "outer_optimizer": "Outer optimizers (`local_steps.outer_optimizer`)"}


def _components(kind: str) -> list[str]:
    reg = C._registry(kind)
    out = [f"### {PLURAL[kind]}", ""]
    for name in reg.names():
        cls = reg.cls(name)
        doc = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
        params = reg.params(name)
        ps = ", ".join(f"`{k}`={p.default!r}" if p.default is not inspect.Parameter.empty else f"`{k}` (required)"
                       for k, p in params.items()) or "none"
        out.append(f"- **`{name}`** — {doc} Parameters: {ps}.")
    return out + [""]


def render() -> str:
    lines = ["# Configuration reference", "",
             "Generated by `python -m adacomp.tools.config_doc` from the schema in `adacomp/config.py` and the",
             "constructors of the registered components; `tests/test_config_doc.py` fails if this file is stale.",
             "", "## Keys", "", "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for path, tp, default, allowed in _fields(C.Config, ""):
        lines.append(f"| `{path}` | {tp} | {default} | {allowed} | {KEY_DOCS.get(path, '')} |")
    lines += ["", "## Components", "",
              "A component is written `{name: NAME, PARAM: VALUE, ...}` (or just `NAME`); parameters",
              "and their defaults are the component constructor's.", ""]
    for kind in ("compressor", "memory", "communicator", "policy", "outer_optimizer"):
        lines += _components(kind)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
