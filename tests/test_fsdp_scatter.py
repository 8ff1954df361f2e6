"""adacomp on plain FSDP2's reduce-scatter (issue 34), 2 gloo ranks (3 for the resume on another
world size): ``adacomp.fsdp.register(model, cfg)`` without a replicate group installs a custom
reduce-scatter (``set_custom_reduce_scatter``) on every FSDP unit.

* ``compressor: none`` gives plain FSDP2's parameters bitwise (the unit runs FSDP2's own
  reduce-scatter through the custom comm).
* A compressor gives the parameters the same compressor gives through adacomp's DDP hook on the
  same batches (every rank's full gradient goes through the same round; only summation order may
  differ), for a sparsifier, a low-rank method and a dense cast.
* With FSDP2's bf16 / fp16 MixedPrecisionPolicy and clipping: ``none`` is native bitwise, a
  lossless cast through the round lands within rounding (fp16 takes FSDP2's SUM op).
* A DCP checkpoint of the error-feedback state resumes on another world size by the world-size
  rule (each new rank's residual is the mean of the old ranks'); HSDP's on another mesh is joined
  per replica, averaged and cut into the new mesh's shards.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_workers

STEPS = 5
CONFIGS: dict[str, dict[str, Any]] = {
    "topk": {"compressor": {"name": "topk", "density": 0.05}, "memory": {"name": "residual"},
             "communicator": {"name": "allgather"}, "min_numel": 0},
    "powersgd": {"compressor": {"name": "powersgd", "rank": 2, "min_compression_rate": 0.0}, "min_numel": 0},
    "bf16": {"compressor": {"name": "bf16"}, "communicator": {"name": "allreduce"}, "min_numel": 0},
}


def _model() -> torch.nn.Module:
    """The last layer has 5 rows: dim 0 does not divide by 2 or 3 ranks, so FSDP2 pads it."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 5))


def _shard(net: torch.nn.Module, reduce_dtype: torch.dtype | None = None) -> Any:
    """fully_shard per Linear and at the root; ``reduce_dtype``: FSDP2's MixedPrecisionPolicy with
    parameters and reduction in that dtype."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=reduce_dtype, reduce_dtype=reduce_dtype) if reduce_dtype else MixedPrecisionPolicy()
    for m in net:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(net, mesh=mesh, mp_policy=mp)
    return mesh


def _steps(net: torch.nn.Module, opt: Any, steps: range, clip: bool = False) -> list[float]:
    import torch.nn.functional as F
    rank, losses = torch.distributed.get_rank(), []
    for s in steps:
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), x[:, :5].argmax(dim=1))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _full(net: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in net.parameters()]


def _run(arm: str, cfg: dict[str, Any] | None, reduce_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """One arm on this rank: ``fsdp-native`` (FSDP2 alone), ``fsdp`` (FSDP2 with adacomp's
    reduce-scatter) or ``ddp`` (DDP with adacomp's hook), the same model, batches and optimizer;
    with ``reduce_dtype``, FSDP2's mixed precision and gradient clipping on the DTensor gradients."""
    import adacomp
    net = _model()
    out: dict[str, Any] = {}
    if arm == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model: Any = DDP(net)
        hook_state = adacomp.ddp.register(model, cfg)
    else:
        _shard(net, reduce_dtype)
        model = net
        if arm == "fsdp":
            state = adacomp.fsdp.register(net, cfg)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    out["losses"] = _steps(model, opt, range(STEPS), clip=reduce_dtype is not None)
    out["params"] = _full(net)
    if arm == "fsdp":
        out["calls"] = {n: u.calls for n, u in state.units.items()}
        out["native"] = {n: u.native for n, u in state.units.items()}
        out["steps"] = state.steps
        stats = [u.state.last_stats for u in state.units.values() if u.state.last_stats is not None]
        out["sent"], out["dense"] = sum(s.bytes_sent for s in stats), sum(s.dense_bytes for s in stats)
    if arm == "ddp":
        out["steps"] = hook_state.steps
    return out


def _parity_worker(name: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    if name == "none":
        return {"native": _run("fsdp-native", None), "fsdp": _run("fsdp", {"compressor": {"name": "none"}})}
    return {"ddp": _run("ddp", CONFIGS[name]), "fsdp": _run("fsdp", CONFIGS[name])}


def test_none_equals_plain_fsdp2_bitwise() -> None:
    for rank, res in enumerate(run_workers(_parity_worker, 2, "none", timeout=300)):
        ours, native = res["fsdp"], res["native"]
        assert set(ours["calls"]) == {"0", "2", "4"} and all(ours["native"].values())
        assert all(c == STEPS for c in ours["calls"].values()), ours["calls"]  # the custom comm ran every step
        assert ours["losses"] == native["losses"], rank
        assert all(torch.equal(a, b) for a, b in zip(ours["params"], native["params"])), rank


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compressed_fsdp2_equals_the_ddp_hook(name: str) -> None:
    """The same compressor, memory and communicator on every parameter's full gradient: the mean
    is the same math, so FSDP2 and DDP agree to float rounding (summation order in the collectives)."""
    results = run_workers(_parity_worker, 2, name, timeout=300)
    for rank, res in enumerate(results):
        fsdp, ddp = res["fsdp"], res["ddp"]
        assert fsdp["steps"] == ddp["steps"] == STEPS
        assert not any(fsdp["native"].values())
        assert 0 < fsdp["sent"] < fsdp["dense"], (fsdp["sent"], fsdp["dense"])
        for a, b in zip(fsdp["params"], ddp["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(fsdp["params"], results[0]["fsdp"]["params"]))  # ranks agree
    untouched = _model()
    assert any(not torch.equal(a, b.detach()) for a, b in zip(results[0]["fsdp"]["params"], untouched.parameters()))


def _precision_worker(dtype: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rd = getattr(torch, dtype)
    cast = {"compressor": {"name": {"bfloat16": "bf16", "float16": "fp16"}[dtype]}, "communicator": {"name": "allreduce"}, "min_numel": 0}
    return {"native": _run("fsdp-native", None, rd), "none": _run("fsdp", {"compressor": {"name": "none"}}, rd),
            "cast": _run("fsdp", cast, rd)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_and_clipping(dtype: str) -> None:
    """FSDP2's MixedPrecisionPolicy (parameters and reduction in ``dtype``) and clip_grad_norm_ on the
    DTensor gradients: ``none`` is native bitwise; a cast to the reduce dtype itself (lossless) goes
    through adacomp's round and lands within rounding of native. With float16 FSDP2 asks for a SUM
    (it divides before and after, against overflow): the SUM branch of the custom reduce-scatter."""
    for rank, res in enumerate(run_workers(_precision_worker, 2, dtype, timeout=300)):
        native, none, cast = res["native"], res["none"], res["cast"]
        assert all(torch.equal(a, b) for a, b in zip(none["params"], native["params"])), rank
        assert not any(cast["native"].values()) and cast["steps"] == STEPS
        for a, b in zip(cast["params"], native["params"]):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def _residuals(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every residual tensor of a ScatterState.state_dict(), by unit / component / key."""
    out = {}
    for unit, us in state["units"].items():
        for comp, cs in us["components"].items():
            if comp.startswith("memory/"):
                for k, t in cs.items():
                    if isinstance(t, torch.Tensor):
                        out[f"{unit}/{k}"] = t
                    elif isinstance(t, dict):
                        out.update({f"{unit}/{k}/{kk}": v for kk, v in t.items() if isinstance(v, torch.Tensor)})
    return out


def _topk_fsdp() -> tuple[Any, Any, torch.optim.Optimizer]:
    """This process's gloo group, the model under plain FSDP2 with adacomp's Top-k, its SGD."""
    import adacomp
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    net = _model()
    _shard(net)
    state = adacomp.fsdp.register(net, CONFIGS["topk"])
    return net, state, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def _save_worker(ckpt: str) -> dict[str, Any]:
    """3 Top-k steps under plain FSDP2 on this world, a DCP checkpoint (model, optimizer, adacomp)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net, state, opt = _topk_fsdp()
    _steps(net, opt, range(3))
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd, "adacomp": state.dcp_state_dict()}, checkpoint_id=ckpt)
    return {"residuals": _residuals(state.state_dict()), "params": _full(net)}


def _resume_worker(ckpt: str) -> dict[str, Any]:
    """A fresh FSDP2 model on another world size resumes from the checkpoint, then trains 2 steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    net, state, opt = _topk_fsdp()
    msd, osd = get_state_dict(net, opt)
    template = {"model": msd, "optim": osd}
    dcp.load(template, checkpoint_id=ckpt)
    set_state_dict(net, opt, model_state_dict=template["model"], optim_state_dict=template["optim"])
    state.load_dcp(ckpt)
    out: dict[str, Any] = {"residuals": _residuals(state.state_dict()), "params": _full(net)}
    out["losses"] = _steps(net, opt, range(3, 5))
    out["steps"] = state.steps
    return out


def test_dcp_resume_on_another_world_size_applies_the_world_size_rule(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "dcp")
    saved = run_workers(_save_worker, 2, ckpt, timeout=300)
    resumed = run_workers(_resume_worker, 3, ckpt, timeout=300)
    keys = set(saved[0]["residuals"])
    assert keys and all(set(s["residuals"]) == keys for s in saved)
    for rank, res in enumerate(resumed):
        assert set(res["residuals"]) == keys, rank
        for k in keys:  # every new rank owes the mean of what the old ranks owed
            mean = (saved[0]["residuals"][k] + saved[1]["residuals"][k]) / 2
            torch.testing.assert_close(res["residuals"][k], mean, rtol=1e-6, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(res["params"], saved[0]["params"])), rank
        assert res["steps"] == 3 + 2 and all(torch.isfinite(torch.tensor(res["losses"])))


def _hsdp_worker(ckpt: str, replicas: int) -> dict[str, Any]:
    """HSDP on 2 ranks as ``replicas`` x (2 / replicas): 2 Top-k steps and a save on a 2 x 1 mesh
    (each rank a replica holding the whole shard), or a resume on 1 x 2 (one replica, two shards)
    and one more step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import adacomp
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    net = _model()
    mesh = init_device_mesh("cpu", (replicas, 2 // replicas), mesh_dim_names=("replicate", "shard"))
    fully_shard(net, mesh=mesh["shard"])
    state = adacomp.fsdp.register(net, CONFIGS["topk"], replicate_group=mesh["replicate"].get_group())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if replicas == 2:
        _steps(net, opt, range(2))
        dcp.save({"adacomp": state.dcp_state_dict()}, checkpoint_id=ckpt)
    else:
        state.load_dcp(ckpt)
    out = {"residuals": _residuals(state.state_dict())}
    if replicas == 1:
        out["losses"] = _steps(net, opt, range(2, 3))
        out["steps"] = state.steps
    return out


def test_hsdp_resume_on_another_mesh_reshards_the_residuals(tmp_path: Path) -> None:
    """Saved on a 2 x 1 mesh (two replicas, each residual a whole parameter's), resumed on 1 x 2:
    each new rank's residual of a parameter is its FSDP2 shard (torch.chunk rows, zero padding) of the
    replicas' mean."""
    ckpt = str(tmp_path / "dcp")
    saved = run_workers(_hsdp_worker, 2, ckpt, 2, timeout=300)
    resumed = run_workers(_hsdp_worker, 2, ckpt, 1, timeout=300)
    shapes = {name: p.shape for name, p in _model().named_parameters()}
    keys = set(saved[0]["residuals"])
    assert {k.rsplit("/", 1)[-1] for k in keys} == set(shapes)  # one residual per parameter, by its model name
    for s, res in enumerate(resumed):
        assert set(res["residuals"]) == keys
        for key in keys:
            shape = shapes[key.rsplit("/", 1)[-1]]
            mean = (saved[0]["residuals"][key] + saved[1]["residuals"][key]) / 2  # whole parameters on 2 x 1
            rows = -(-shape[0] // 2)
            chunk = torch.chunk(mean.view(shape), 2, dim=0)[s]
            expect = torch.cat([chunk, torch.zeros(rows - chunk.shape[0], *shape[1:])])
            torch.testing.assert_close(res["residuals"][key], expect.view(res["residuals"][key].shape), rtol=0, atol=0)
        assert res["steps"] == 2 + 1 and all(torch.isfinite(torch.tensor(res["losses"])))


def _bad_config_worker() -> list[str]:
    """An unknown compressor; a native HSDP model (2-D mesh) registered without a replicate group;
    local steps without a replicate group, and without the optimizer they follow."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import adacomp
    torch.distributed.init_process_group("gloo")
    net, hsdp = _model(), _model()
    _shard(net)
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
    out = []
    local = {"compressor": {"name": "none"}, "local_steps": {"every": 4}}
    mesh2 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    cases: list[tuple[torch.nn.Module, Any, dict[str, Any]]] = [
        (net, {"compressor": {"name": "no-such"}}, {}), (hsdp, CONFIGS["topk"], {}),
        (net, local, {}),  # local steps without a replicate group
        (net, local, {"replicate_group": mesh2["replicate"].get_group()})]  # ... or without the optimizer
    for model, cfg, kw in cases:
        try:
            adacomp.fsdp.register(model, cfg, **kw)
            out.append("accepted")
        except Exception as exc:  # noqa: BLE001 - the message is the result
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_invalid_config_fails_before_any_collective() -> None:
    """Both ranks raise at register (no collective ran: a rank that passed would hang its peer)."""
    for unknown, two_d, no_group, no_optimizer in run_workers(_bad_config_worker, 2, timeout=120):
        assert unknown.startswith("ConfigError") and "compressor" in unknown and "no-such" in unknown, unknown
        assert "topk" in unknown, unknown  # the valid choices
        assert two_d.startswith("ValueError") and "replicate_group" in two_d and "1-D" in two_d, two_d
        assert no_group.startswith("ConfigError") and "local_steps" in no_group and "replicate_group" in no_group
        assert no_optimizer.startswith("ConfigError") and "optimizer=" in no_optimizer, no_optimizer


def test_bench_fsdp_writes_every_arm(tmp_path: Path) -> None:
    """``adacomp bench fsdp`` at a tiny size (4 ranks it starts itself): the plumbing, not the
    numbers; Top-k's payload is far below the dense gradient, the bf16 cast's about half of it."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "fsdp.md"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-m", "adacomp.tools.cli", "bench", "fsdp", "--layers", "1", "--width", "64",
                           "--vocab", "512", "--steps", "2", "--block", "2", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r[0].strip() for r in rows][0] == "FSDP2 (native reduce-scatter)" and len(rows) == 5
    payload = {r[0].strip(): float(r[3]) for r in rows}
    dense = payload["FSDP2 (native reduce-scatter)"]
    assert payload["FSDP2 + adacomp Top-k 1 %"] < dense / 10
    assert 0.45 * dense < payload["FSDP2 + adacomp bf16 cast"] < 0.6 * dense  # tensors under min_numel stay fp32


def test_param_groups_read_both_layouts_of_fsdp2_state() -> None:
    """torch 2.13 keeps a unit's param groups in a list (``_fsdp_param_groups``); torch 2.11 (the lent
    GPU's) in one optional ``_fsdp_param_group``. The unit layout reads either."""
    from types import SimpleNamespace

    from adacomp.engine.fsdp import _param_groups

    def unit(**state: object) -> SimpleNamespace:
        return SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))

    assert _param_groups(unit(_fsdp_param_groups=["a", "b"])) == ["a", "b"]
    assert _param_groups(unit(_fsdp_param_group="a")) == ["a"]
    assert _param_groups(unit(_fsdp_param_group=None)) == []
