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
    # low-rank on the shards: each parameter's rows of this shard as a matrix
    "powersgd": {"compressor": {"name": "powersgd", "rank": 2}, "memory": {"name": "residual"},
                 "communicator": {"name": "allreduce"}, "min_numel": 0},
}
STEPS = 6
# local steps on the shards (H = 3: two synchronisations in STEPS), each checked against a one-process
# simulation of the two hosts (tests/test_fsdp.py)
LOCAL: dict[str, dict[str, Any]] = {
    "localsgd": {"compressor": {"name": "none"},
                 "local_steps": {"every": 3, "outer_optimizer": {"name": "sgd", "lr": 1.0, "momentum": 0.0}}},
    "diloco": {"compressor": {"name": "none"},
               "local_steps": {"every": 3, "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}}},
    "diloco-topk": {"compressor": {"name": "topk", "density": 0.05}, "memory": {"name": "residual"},
                    "communicator": {"name": "allgather"}, "min_numel": 0,
                    "local_steps": {"every": 3, "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}}},
}


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :4].argmax(dim=1)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 4))


def on_shards(net: torch.nn.Module, shape: tuple[int, int]) -> Any:
    """``net``'s Linear layers, then ``net``, under FSDP2 over the shard dimension of a (replicate,
    shard) CPU mesh of ``shape``; returns the mesh."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    for m in net:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    return mesh


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
        x, y = batch(s, rank)
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


def build_on_shards(arm: str) -> tuple[torch.nn.Module, Any, Any]:
    """FSDP2 over the shard dimension, adacomp on the replicate one: per step (``ARMS``) or local
    steps (``LOCAL``, which follow the optimizer)."""
    import adacomp
    net = model()
    mesh = on_shards(net, (2, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    local = LOCAL.get(arm)
    state = adacomp.fsdp.register(net, local or ARMS[arm], replicate_group=mesh["replicate"].get_group(),
                                  optimizer=opt if local else None)
    return net, opt, state


def run_local(arm: str) -> dict[str, Any]:
    """FSDP2 over the shard dimension only (a host trains alone), adacomp's outer loop across the
    replicas every H steps; the full parameters after each step."""
    rank = dist.get_rank()
    net, opt, state = build_on_shards(arm)
    trace, sent, dense = [], 0, 0
    for s in range(STEPS):
        x, y = batch(s, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        trace.append([p.full_tensor().detach().clone() for p in net.parameters()])
        assert state.last_stats is not None
        sent, dense = sent + state.last_stats.bytes_sent, dense + state.last_stats.dense_bytes
    return {"trace": trace, "steps": state.steps, "sent": sent, "dense": dense, "adacomp": state.state_dict()}


def simulate_local(arm: str) -> list[list[torch.Tensor]]:
    """The same training in one process: host h (ranks 2h, 2h + 1: one shard group) takes SGD steps
    on the mean of its two ranks' losses (what FSDP2's averaged reduce-scatter gives), and every H
    steps the outer step of the average pseudo-gradient (uncompressed arms only)."""
    cfg = LOCAL[arm]["local_steps"]
    outer = cfg["outer_optimizer"]
    hosts = [model() for _ in range(2)]
    opts = [torch.optim.SGD(h.parameters(), lr=0.05, momentum=0.9) for h in hosts]
    synced = [p.detach().clone() for p in hosts[0].parameters()]
    outer_opt = torch.optim.SGD(synced, lr=outer["lr"], momentum=outer["momentum"],
                                nesterov=outer["name"] == "nesterov")
    trace = []
    for s in range(STEPS):
        for h, (net, opt) in enumerate(zip(hosts, opts)):
            opt.zero_grad()
            losses = [F.cross_entropy(net(x), y) for x, y in (batch(s, 2 * h), batch(s, 2 * h + 1))]
            ((losses[0] + losses[1]) / 2).backward()
            opt.step()
        if (s + 1) % cfg["every"] == 0:
            with torch.no_grad():
                for i, theta in enumerate(synced):
                    local = [list(h.parameters())[i] for h in hosts]
                    theta.grad = sum(theta - p for p in local) / len(local)
                outer_opt.step()
                for h in hosts:
                    for p, theta in zip(h.parameters(), synced):
                        p.copy_(theta)
        trace.append([p.detach().clone() for p in hosts[rank_host()].parameters()])
    return trace


def rank_host() -> int:
    return dist.get_rank() // 2


def _tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, dict):
        return [kv for k, v in obj.items() for kv in _tensors(v, f"{prefix}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in _tensors(v, f"{prefix}[{i}]")]
    return []


def resume(arm: str, ckpt: str, at: int = 3) -> dict[str, Any]:
    """``at`` steps, a DCP checkpoint (model and optimizer via get_state_dict, adacomp's per-rank state),
    a fresh model loaded from it, the remaining steps: the final parameters and adacomp state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


    def build() -> tuple[torch.nn.Module, Any, Any]:
        return build_on_shards(arm)

    def train(net: torch.nn.Module, opt: Any, steps: range) -> None:
        rank = dist.get_rank()
        for s in steps:
            x, y = batch(s, rank)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()

    net, opt, state = build()
    train(net, opt, range(at))
    if arm in LOCAL:  # the replicas differ inside a window: each saves its own model and optimizer
        state.save_checkpoint(net, opt, ckpt)
        net2, opt2, state2 = build()
        state2.load_checkpoint(net2, opt2, ckpt)
        train(net2, opt2, range(at, STEPS))
        return {"params": [p.full_tensor().detach().clone() for p in net2.parameters()], "adacomp": state2.state_dict()}
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd, "adacomp": state.dcp_state_dict()}, checkpoint_id=ckpt)
    net2, opt2, state2 = build()
    msd2, osd2 = get_state_dict(net2, opt2)
    template = {"model": msd2, "optim": osd2}
    dcp.load(template, checkpoint_id=ckpt)
    set_state_dict(net2, opt2, model_state_dict=template["model"], optim_state_dict=template["optim"])
    state2.load_dcp(ckpt)  # every rank's entry read from the checkpoint: a fresh state has no residuals to template
    train(net2, opt2, range(at, STEPS))
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
    for arm in LOCAL:
        out = run_local(arm)
        out["simulated"] = simulate_local(arm)
        torch.save(out, Path(args.out) / f"{arm}.rank{dist.get_rank()}.pt")
    ckpt = [str(Path(args.out) / "dcp") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(ckpt, src=0)
    torch.save(resume("topk", str(ckpt[0])), Path(args.out) / f"topk-resumed.rank{dist.get_rank()}.pt")
    # local steps: the checkpoint inside a window (step 4 of 6, H = 3)
    torch.save(resume("diloco-topk", str(ckpt[0]) + "-local", at=4),
               Path(args.out) / f"diloco-topk-resumed.rank{dist.get_rank()}.pt")
    print(f"FSDP_DONE rank={dist.get_rank()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
