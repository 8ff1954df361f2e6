"""Step time of adacomp's DDP communication hook vs plain DDP, DDP's fp16 hook and PyTorch's own
PowerSGD hook, and vs adacomp's DistributedOptimizer with the same configs: one run, alternating arms.

    adacomp run -np 2 -- python scripts/bench_ddp_hook.py      # writes docs/results/ddp_hook.md

Every arm trains its own copy of the same MLP on the same batches; blocks of steps alternate
between arms so machine noise hits all of them; the job's step time is the slowest rank's median.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import ensure_torch_group, write_result  # noqa: E402

import adacomp  # noqa: E402
from adacomp.models import MLP  # noqa: E402

CONFIGS = {
    "powersgd r4": {"compressor": {"name": "powersgd", "rank": 4, "min_compression_rate": 0.0}, "min_numel": 0},
    "topk 1%": {"compressor": {"name": "topk", "density": 0.01}, "communicator": {"name": "allgather"}},
    "acpsgd r4": {"compressor": {"name": "acpsgd", "rank": 4, "min_compression_rate": 0.0}, "min_numel": 0},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--inputs", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="measured steps per arm")
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=100.0,
                    help="one bucket: PyTorch's PowerSGD hook times out on gloo with DDP's default multi-bucket "
                         "layout (its chained per-bucket rounds run in different orders on different ranks)")
    ap.add_argument("--out", default="docs/results/ddp_hook.md")
    args = ap.parse_args()
    adacomp.init()
    ensure_torch_group()
    rank, world = adacomp.rank(), adacomp.size()
    torch.manual_seed(0)
    ref = MLP(args.inputs, args.width, args.depth)
    nparams = sum(p.numel() for p in ref.parameters())
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.inputs, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def copy() -> torch.nn.Module:
        m = MLP(args.inputs, args.width, args.depth)
        m.load_state_dict(ref.state_dict())
        return m

    def timed_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], float]:
        def step() -> float:
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            return time.perf_counter() - t0
        return step

    def ddp_arm(register: Callable[[DDP], None] | None) -> Callable[[], float]:
        model = DDP(copy(), bucket_cap_mb=args.bucket_mb)
        if register is not None:
            register(model)
        return timed_step(model, torch.optim.SGD(model.parameters(), lr=0.01))

    def opt_arm(cfg: dict) -> Callable[[], float]:
        model = copy()
        return timed_step(model, adacomp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
            config={**cfg, "fusion": {"bucket_mb": args.bucket_mb}}))

    def adacomp_hook(cfg: dict) -> Callable[[DDP], None]:
        def register(model: DDP) -> None:
            state, hook = adacomp.ddp.hook(cfg, named_parameters=model.module.named_parameters())
            model.register_comm_hook(state, hook)
        return register

    arms: dict[str, Callable[[], float]] = {
        "DDP": ddp_arm(None),
        "DDP + fp16 hook": ddp_arm(lambda m: m.register_comm_hook(None, default_hooks.fp16_compress_hook)),
        "DDP + PyTorch PowerSGD hook r4": ddp_arm(lambda m: m.register_comm_hook(
            powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                        min_compression_rate=0.0), powerSGD_hook.powerSGD_hook)),
    }
    for name, cfg in CONFIGS.items():
        arms[f"DDP + adacomp hook {name}"] = ddp_arm(adacomp_hook(cfg))
        arms[f"adacomp DistributedOptimizer {name}"] = opt_arm(cfg)
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(3):  # warm-up (PowerSGD hook's dense iterations included)
        for step in arms.values():
            step()
    while len(times["DDP"]) < args.steps:
        for name, step in arms.items():
            times[name] += [step() for _ in range(args.block)]
    med = torch.tensor([statistics.median(times[k]) for k in arms])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if rank == 0:
        base = float(med[0])
        hook_ps = float(med[list(arms).index("DDP + PyTorch PowerSGD hook r4")])
        rows = ["| arm | ms / step | vs DDP | vs PyTorch PowerSGD hook |", "|---|---|---|---|"]
        for i, name in enumerate(arms):
            rows.append(f"| {name} | {1e3 * float(med[i]):.1f} | {float(med[i]) / base:.2f}x | "
                        f"{float(med[i]) / hook_ps:.2f}x |")
            print(rows[-1])
        write_result(args.out, "adacomp as a DDP communication hook: step time", [
            f"Model: MLP {args.inputs}-{'-'.join([str(args.width)] * args.depth)}-10, {nparams / 1e6:.1f}M parameters, "
            f"batch {args.batch}, {world} processes on gloo (loopback, CPU), one {args.bucket_mb:g} MB bucket per arm "
            "(with DDP's default layout, a 1 MB first bucket plus 25 MB ones, PyTorch's PowerSGD hook timed out in "
            "its second round on gloo here, the ordering failure DESIGN.md describes; adacomp's hook finishes rounds in "
            "bucket order and passed 20 repetitions with random per-rank delays on a multi-bucket model).",
            f"Median of {len(times['DDP'])} steps per arm (blocks of {args.block}, arms alternating), slowest rank.",
            "", *rows, "",
            "On loopback the network is fast, so compression can only cost time here; the table shows what the",
            "hook path costs next to the optimizer path (same compressors, same math: tests/test_ddp_hook.py checks",
            "their parameters agree within 1e-6 over 50 steps) and next to PyTorch's own PowerSGD hook.",
        ])


if __name__ == "__main__":
    main()
