"""Checkpoints: a run resumed at step s equals the uninterrupted run bitwise at step s + k, for every
stateful method and adaptive policy, on 2 real gloo processes; files load with
``torch.load(weights_only=True)``; a crash mid-write keeps the previous checkpoint.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_workers

ROOT = Path(__file__).resolve().parent.parent
_SPARSE = {"memory": {"name": "residual"}, "communicator": {"name": "allgather"}}
_LOWRANK = {"memory": {"name": "residual"}, "communicator": {"name": "allreduce"}}
# name -> (registry kind, registry name, config). Small thresholds / periods so the state under
# test (thresholds, re-estimation counters, P/Q factors, generators) is live within a few steps.
METHODS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "topk": ("compressor", "topk", {"compressor": {"name": "topk", "density": 0.05}, **_SPARSE}),
    "dgc": ("compressor", "dgc", {"compressor": {"name": "dgc", "density": 0.05, "sample_ratio": 0.1},
                                  "memory": {"name": "dgc", "momentum": 0.9}, "communicator": {"name": "allgather"}}),
    "adtopk_t": ("compressor", "adtopk_t", {"compressor": {"name": "adtopk_t", "density": 0.05, "tau": 2, "sigma": 2,
                                                           "total_iters": 0}, **_SPARSE}),
    "oktopk": ("compressor", "oktopk", {"compressor": {"name": "oktopk", "density": 0.05, "period": 3}, **_SPARSE}),
    "powersgd": ("compressor", "powersgd", {"compressor": {"name": "powersgd", "rank": 2}, **_LOWRANK}),
    "acpsgd": ("compressor", "acpsgd", {"compressor": {"name": "acpsgd", "rank": 2}, **_LOWRANK}),
    # ByteComp's divisible scheme (second-stage residuals live in the communicator) + CPU offload
    "alltoall": ("compressor", "topk", {"compressor": {"name": "topk", "density": 0.05},
                                        "memory": {"name": "residual"}, "communicator": {"name": "alltoall"},
                                        "layers": [{"match": "fc1.weight", "offload": True}]}),
    "moo": ("policy", "moo", {"compressor": {"name": "topk", "density": 0.05}, **_SPARSE,
                              "policy": {"name": "moo", "c_high": 0.1, "c_low": 0.01, "factor": 10.0,
                                         "explore_steps": 2, "check_every": 1000, "probe_every": 1000,
                                         "switching": False, "pop_size": 8, "generations": 3}}),
    "lgreco": ("policy", "lgreco", {"compressor": {"name": "topk", "density": 0.05}, **_SPARSE,
                                    "policy": {"name": "lgreco", "period": 3, "steps": 1000}}),
    # ByteComp reroutes tensors at its decision (step 4 here): overrides are saved and re-applied first
    "bytecomp": ("policy", "bytecomp", {"compressor": {"name": "topk", "density": 0.05}, **_SPARSE,
                                        "policy": {"name": "bytecomp", "profile_steps": 4, "repeats": 2,
                                                   "alpha": 1e-4, "beta": 1e-7}}),
    "flexible": ("policy", "flexible", {"compressor": {"name": "topk", "density": 0.05}, **_SPARSE,
                                        "policy": {"name": "flexible"}}),
}
STEPS_BEFORE, STEPS_AFTER = 7, 4   # moo decides at step 5 (2 candidates x 2 steps); lgreco at 3, 6, 9


def registered(kind: str, name: str) -> bool:
    from adacomp import compressors, policies
    return name in {"compressor": compressors, "policy": policies}[kind].names()


def method_config(method: str, **overrides: Any) -> dict[str, Any]:
    """The method's config with small fusion buckets, so several buckets (and rounds) interleave."""
    return {**METHODS[method][2], "fusion": {"bucket_mb": 0.05}, "min_numel": 512, **overrides}


def train_steps(model: torch.nn.Module, opt: Any, start: int, n: int, rank: int) -> None:
    """Steps ``start .. start+n-1``; the batch depends only on (step, rank), so a resumed run sees
    the same data as the uninterrupted one."""
    for s in range(start, start + n):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randn(16, 1, 8, 8, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from flatten(obj[k], f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def state_diff(a: dict[str, Any], b: dict[str, Any], skip_float_under: tuple[str, ...] = ()) -> list[str]:
    """Keys whose values differ bitwise. Python floats under ``skip_float_under`` are measured
    timings (policies record step / sync seconds) and cannot repeat."""
    fa, fb = dict(flatten(a)), dict(flatten(b))
    out = sorted(set(fa) ^ set(fb))
    for k in sorted(set(fa) & set(fb)):
        x, y = fa[k], fb[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)):
                out.append(k)
        elif isinstance(x, float) and any(k.startswith(p) for p in skip_float_under):
            continue
        elif x != y:
            out.append(k)
    return out


def build(method: str, seed: int, **overrides: Any):
    import adacomp
    from adacomp.models import DigitsCNN
    torch.manual_seed(seed)
    model = DigitsCNN()
    momentum = 0.0 if METHODS[method][2]["memory"]["name"] == "dgc" else 0.9  # memory dgc applies it
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum),
                                       model.named_parameters(), config=method_config(method, **overrides))
    adacomp.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def _resume_job(directory: str, methods: list[str]) -> dict[str, dict[str, Any]]:
    import adacomp
    from adacomp.runtime import checkpoint
    adacomp.init()
    rank = adacomp.rank()
    out: dict[str, dict[str, Any]] = {}
    for method in methods:
        model, opt = build(method, seed=0)
        train_steps(model, opt, 0, STEPS_BEFORE, rank)
        path = checkpoint.rank_path(Path(directory) / f"{method}.pt", rank)
        checkpoint.save(path, model, opt, step=STEPS_BEFORE)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        train_steps(model, opt, STEPS_BEFORE, STEPS_AFTER, rank)          # the uninterrupted run
        opt.remove_hooks()
        model2, opt2 = build(method, seed=1)                              # a fresh process would
        extra = checkpoint.load(path, model2, opt2)
        restored_ok = all(torch.equal(v, model2.state_dict()[k]) for k, v in saved.items())
        train_steps(model2, opt2, int(extra["step"]), STEPS_AFTER, rank)  # the resumed run
        opt2.remove_hooks()
        params = [k for k, v in model.state_dict().items() if not torch.equal(v, model2.state_dict()[k])]
        moved = any(not torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
        out[method] = {"param_diff": params, "restored": restored_ok, "moved": moved,
                       "state_diff": state_diff(opt.state_dict(), opt2.state_dict(),
                                                skip_float_under=("/adacomp/components/policy",)),
                       "steps": (opt.steps, opt2.steps), "file": str(path)}
    adacomp.shutdown()
    return out


@pytest.fixture(scope="module")
def resume_results(tmp_path_factory) -> dict[str, dict[str, Any]]:
    present = [m for m, (kind, name, _) in METHODS.items() if registered(kind, name)]
    directory = tmp_path_factory.mktemp("ckpt")
    per_rank = run_workers(_resume_job, 2, str(directory), present, timeout=600)
    return {m: {"rank0": per_rank[0][m], "rank1": per_rank[1][m]} for m in present}


@pytest.mark.parametrize("method", list(METHODS))
def test_resumed_run_equals_uninterrupted_run_bitwise(method: str, resume_results) -> None:
    kind, name, _ = METHODS[method]
    if not registered(kind, name):
        pytest.skip(f"{kind} {name!r} is not registered yet")
    for rank, r in resume_results[method].items():
        assert r["restored"], f"{rank}: weights differ right after checkpoint.load"
        assert r["moved"], f"{rank}: training did not change the weights; the test would prove nothing"
        assert r["param_diff"] == [], f"{method} {rank}: parameters differ after resuming: {r['param_diff']}"
        assert r["state_diff"] == [], f"{method} {rank}: optimizer state differs after resuming: {r['state_diff']}"
        assert r["steps"][0] == r["steps"][1]
        from adacomp.runtime import checkpoint
        checkpoint.read(r["file"])  # verified; the payload is read with weights_only=True


# --- atomic writes ---------------------------------------------------------------------------
def _tiny() -> tuple[torch.nn.Module, Any]:
    import adacomp
    from adacomp.backends.base import LocalBackend
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       model.named_parameters(), backend=LocalBackend())
    return model, opt


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_failed_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    from adacomp.runtime import checkpoint
    model, opt = _tiny()
    path = tmp_path / "ck.pt"
    checkpoint.save(path, model, opt, step=1)
    before = path.read_bytes()
    with torch.no_grad():
        model.weight.add_(1.0)

    def boom(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint.os, "replace", boom)
    with pytest.raises(OSError, match="No space"):
        checkpoint.save(path, model, opt, step=2)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []
    assert checkpoint.read(path)["extra"] == {"step": 1}


_KILLED_WRITER = """
import os, signal, sys, torch
from adacomp.runtime import checkpoint
from tests.test_checkpoint_resume import _tiny
model, opt = _tiny()
checkpoint.save(sys.argv[1], model, opt, step=1)
with torch.no_grad():
    model.weight.add_(1.0)
checkpoint.os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)  # die before the rename
checkpoint.save(sys.argv[1], model, opt, step=2)
"""


def test_writer_killed_before_rename_keeps_the_previous_checkpoint(tmp_path) -> None:
    from adacomp.runtime import checkpoint
    path = tmp_path / "ck.pt"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert len(_leftovers(tmp_path)) == 1  # the complete-but-unrenamed temporary file
    data = checkpoint.read(path)           # weights_only=True inside
    assert data["extra"] == {"step": 1}
    model, opt = _tiny()
    assert torch.equal(data["model"]["weight"], model.weight.detach())
    checkpoint.save(path, model, opt, step=3)  # the next save clears the leftover
    assert _leftovers(tmp_path) == [] and checkpoint.read(path)["extra"] == {"step": 3}


def test_loading_refuses_foreign_files_clearly(tmp_path) -> None:
    from adacomp.runtime import checkpoint
    torch.save({"weights": torch.zeros(2)}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not an adacomp checkpoint"):
        checkpoint.read(tmp_path / "x.pt")
    with pytest.raises(FileNotFoundError, match="rank_path"):
        checkpoint.read(tmp_path / "missing.pt")
    assert checkpoint.rank_path(tmp_path / "run.pt", 3).name == "run.rank3.pt"
