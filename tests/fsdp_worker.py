"""Run under torchrun with 4 ranks (a 2 x 2 mesh: replicate x shard): HSDP through FSDP2's native
2-D mesh, or FSDP2 over the shard dimension with adacomp's round on the replicate dimension.
Every rank writes OUT/<arm>.rank<r>.pt: the full parameters, the per-step losses, adacomp's steps
and bytes, and the residual norm of its shards (tests/test_fsdp.py compares)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

ARMS: dict[str, dict[str, Any] | None] = {
    "native": None,
    "none": {"compressor": {"name": "none"}},
    "topk": {"compressor": {"name": "topk", "density": 0.05}, "memory": {"name": "residual"},
             "communicator": {"name": "allgather"}, "min_numel": 0},
}
STEPS = 6


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 4))


def run(arm: str, habits: bool = False) -> dict[str, Any]:
    """``habits``: FSDP2's MixedPrecisionPolicy (bf16 parameters and reduction) and gradient clipping
    on the DTensor gradients, as users of sharded training write them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import adacomp
    rank = dist.get_rank()
    net = model()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    target = mesh if arm == "native" else mesh["shard"]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if habits else MixedPrecisionPolicy()
    for m in net:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=target, mp_policy=mp)
    fully_shard(net, mesh=target, mp_policy=mp)
    state = None
    if arm != "native":
        state = adacomp.fsdp.register(net, ARMS[arm], replicate_group=mesh["replicate"].get_group())
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for s in range(STEPS):
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randn(16, 32, generator=g)
        y = x[:, :4].argmax(dim=1)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        if habits:
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        losses.append(float(loss.detach()))
    out: dict[str, Any] = {"params": [p.full_tensor().detach().clone() for p in net.parameters()], "losses": losses}
    if state is not None:
        out["adacomp"] = state.state_dict()
        units = state.state_dict()["units"]
        out["steps"] = state.steps
        out["residual_norm"] = sum(float(t.norm()) for u in units.values() for key, t in _tensors(u) if "residual" in key)
        out["sent"] = sum(u.state.last_stats.bytes_sent for u in state.units.values()
                          if u.state is not None and u.state.last_stats is not None)
        out["dense"] = sum(u.state.last_stats.dense_bytes for u in state.units.values()
                           if u.state is not None and u.state.last_stats is not None)
    return out


def _tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _tensors(v, f"{prefix}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in _tensors(v, f"{prefix}[{i}]")]
    return []


def resume(arm: str, ckpt: str) -> dict[str, Any]:
    """3 steps, a DCP checkpoint (model and optimizer via get_state_dict, adacomp's per-rank state),
    a fresh model loaded from it, 3 more steps: the final parameters and adacomp state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import adacomp

    def build() -> tuple[torch.nn.Module, Any, Any]:
        net = model()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for m in net:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh["shard"])
        fully_shard(net, mesh=mesh["shard"])
        state = adacomp.fsdp.register(net, ARMS[arm], replicate_group=mesh["replicate"].get_group())
        return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), state

    def train(net: torch.nn.Module, opt: Any, steps: range) -> None:
        rank = dist.get_rank()
        for s in steps:
            g = torch.Generator().manual_seed(100 * s + rank)
            x = torch.randn(16, 32, generator=g)
            opt.zero_grad()
            F.cross_entropy(net(x), x[:, :4].argmax(dim=1)).backward()
            opt.step()

    net, opt, state = build()
    train(net, opt, range(3))
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd, "adacomp": state.dcp_state_dict()}, checkpoint_id=ckpt)
    net2, opt2, state2 = build()
    msd2, osd2 = get_state_dict(net2, opt2)
    template = {"model": msd2, "optim": osd2}
    dcp.load(template, checkpoint_id=ckpt)
    set_state_dict(net2, opt2, model_state_dict=template["model"], optim_state_dict=template["optim"])
    state2.load_dcp(ckpt)  # every rank's entry read from the checkpoint: a fresh state has no residuals to template
    train(net2, opt2, range(3, STEPS))
    return {"params": [p.full_tensor().detach().clone() for p in net2.parameters()], "adacomp": state2.state_dict()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for arm in ARMS:
        torch.save(run(arm), Path(args.out) / f"{arm}.rank{dist.get_rank()}.pt")
        torch.save(run(arm, habits=True), Path(args.out) / f"{arm}-habits.rank{dist.get_rank()}.pt")
    ckpt = [str(Path(args.out) / "dcp") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(ckpt, src=0)
    torch.save(resume("topk", str(ckpt[0])), Path(args.out) / f"topk-resumed.rank{dist.get_rank()}.pt")
    print(f"FSDP_DONE rank={dist.get_rank()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
