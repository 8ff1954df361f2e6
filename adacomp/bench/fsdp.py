"""Step time and gradient bytes of adacomp on FSDP2 (plain reduce-scatter) and HSDP (replicate
dimension) vs native FSDP2 / HSDP, on a small GPT-2-like model over 4 gloo ranks.

    adacomp bench fsdp                          # starts 4 ranks; writes docs/results/fsdp.md

Arms (each its own copy of the same model, the same batches, the arms taking turns block by block):
native FSDP2 over a 1-D mesh of 4; FSDP2 with adacomp's reduce-scatter (Top-k, a bf16 cast); native
HSDP on a 2 x 2 mesh; HSDP with adacomp on the replicate dimension (Top-k). Bytes are per rank per
step: the payload a rank hands to the gradient collectives (adacomp's ``StepStats.bytes_sent``; the
dense gradient for native ones) and what a ring algorithm sends for it (reduce-scatter (W-1)/W M,
all-reduce 2 (W-1)/W M, allgather (W-1) M); adacomp's one-element vote per unit is left out.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any, Callable

import torch

from adacomp.bench.common import RESULTS, alternating_blocks, bench_command, ensure_torch_group, worker_or_spawn, \
    write_result

LAUNCH = "adacomp bench fsdp"  # starts 4 ranks itself (or run it under torchrun --nproc_per_node 4)
TOPK = {"compressor": {"name": "topk", "density": 0.01}, "memory": {"name": "residual"},
        "communicator": {"name": "allgather"}, "min_numel": 1024}
BF16 = {"compressor": {"name": "bf16"}, "communicator": {"name": "allreduce"}, "min_numel": 1024}


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="adacomp bench fsdp", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--np", type=int, default=4, help="ranks to start when not under a launcher (even; default 4)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per arm")
    ap.add_argument("--block", type=int, default=4, help="steps per turn of an arm")
    ap.add_argument("--out", default=f"{RESULTS}/fsdp.md", help="markdown result, relative to the current directory")
    return ap.parse_args(argv)


def _ring(kind: str, payload: float, world: int) -> float:
    return {"rs": (world - 1) / world, "ar": 2 * (world - 1) / world, "ag": float(world - 1)}[kind] * payload


def _worker(args: argparse.Namespace, argv: list[str]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import adacomp
    import adacomp.fsdp
    from adacomp.models.gpt import GPT2Small
    torch.set_num_threads(1)
    adacomp.init()
    ensure_torch_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % 2:
        raise SystemExit(f"adacomp bench fsdp: HSDP's 2 x (W/2) mesh needs an even world size, got {world}")
    flat = init_device_mesh("cpu", (world,))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))

    def build() -> GPT2Small:
        torch.manual_seed(0)
        return GPT2Small(vocab=args.vocab, context=args.seq, width=args.width, layers=args.layers, heads=args.heads,
                         seq=args.seq)

    ref = build()
    dense = 4.0 * sum(p.numel() for p in ref.parameters())  # fp32 gradient bytes of the whole model
    gen = torch.Generator().manual_seed(1000 + rank)
    batch = ref.synthetic_batch(args.batch, gen)
    states: dict[str, Any] = {}

    def arm(name: str, target: Any, cfg: dict[str, Any] | None = None, replicate: bool = False) -> Callable[[], None]:
        net = build()
        for block in net.h:
            fully_shard(block, mesh=target)
        fully_shard(net, mesh=target)
        if cfg is not None:
            states[name] = adacomp.fsdp.register(net, cfg, replicate_group=mesh["replicate"].get_group()
                                                 if replicate else None)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad()
            batch.loss(net).backward()
            opt.step()
        return step

    arms = {"FSDP2 (native reduce-scatter)": arm("fsdp", flat),
            "FSDP2 + adacomp Top-k 1 %": arm("fsdp-topk", flat, TOPK),
            "FSDP2 + adacomp bf16 cast": arm("fsdp-bf16", flat, BF16),
            "HSDP 2 x %d (native)" % (world // 2): arm("hsdp", mesh),
            "HSDP 2 x %d + adacomp Top-k 1 %% (replicate dim)" % (world // 2): arm("hsdp-topk", mesh["shard"], TOPK,
                                                                                 replicate=True)}
    times = alternating_blocks(arms, args.steps, args.block)
    medians = {name: statistics.median(t) for name, t in times.items()}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, medians)
    slowest = {name: max(m[name] for m in everyone) for name in medians}

    def sent(key: str) -> float:
        units = states[key].units.values()
        return float(sum(u.state.last_stats.bytes_sent for u in units if u.state is not None
                         and u.state.last_stats is not None))

    shard, reps = world // 2, 2
    payload = {"fsdp": dense, "fsdp-topk": sent("fsdp-topk"), "fsdp-bf16": sent("fsdp-bf16"),
               "hsdp": dense + dense / shard, "hsdp-topk": dense + sent("hsdp-topk")}
    wire = {"fsdp": _ring("rs", dense, world), "fsdp-topk": _ring("ag", payload["fsdp-topk"], world),
            "fsdp-bf16": _ring("ar", payload["fsdp-bf16"], world),
            "hsdp": _ring("rs", dense, shard) + _ring("ar", dense / shard, reps),
            "hsdp-topk": _ring("rs", dense, shard) + _ring("ag", sent("hsdp-topk"), reps)}
    hsdp_replicate = {"hsdp": _ring("ar", dense / shard, reps), "hsdp-topk": _ring("ag", sent("hsdp-topk"), reps)}
    if rank != 0:
        return
    base = slowest["FSDP2 (native reduce-scatter)"]
    mb = 2.0 ** 20
    lines = [f"GPT-2-like model: {args.layers} blocks, width {args.width}, vocabulary {args.vocab}, sequence "
             f"{args.seq}, batch {args.batch} per rank; {dense / 4 / 1e6:.2f} M parameters ({dense / mb:.2f} MB of fp32 "
             f"gradient); {world} gloo ranks on one machine (localhost TCP, no link cap); fully_shard per block and "
             f"at the root; SGD. Step time: median of {args.steps} steps per arm (arms alternate in blocks of "
             f"{args.block}), the slowest rank's. Bytes: per rank per step (see the module docstring of "
             "adacomp/bench/fsdp.py for the ring model).", "",
             "| arm | step (ms) | vs native FSDP2 | payload (MB) | ring wire bytes (MB) | of which on the replicate "
             "dimension (MB) |", "|---|---|---|---|---|---|"]
    keys = ["fsdp", "fsdp-topk", "fsdp-bf16", "hsdp", "hsdp-topk"]
    for (name, t), key in zip(slowest.items(), keys):
        rep = f"{hsdp_replicate[key] / mb:.3f}" if key in hsdp_replicate else "-"
        lines.append(f"| {name} | {1000 * t:.1f} | {t / base:.2f}x | {payload[key] / mb:.3f} | {wire[key] / mb:.3f} "
                     f"| {rep} |")
    write_result(args.out, "adacomp on FSDP2 and HSDP", lines, bench_command("fsdp", argv))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _args(argv)
    return worker_or_spawn(lambda: _worker(args, argv), args.np, "fsdp", argv)


if __name__ == "__main__":
    raise SystemExit(main())
