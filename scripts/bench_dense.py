"""Dense path overhead: adacomp (compressor none + allreduce) vs PyTorch DDP, same model, one run.

Launch under any launcher, e.g. ``adacomp run -np 2 -- python scripts/bench_dense.py`` (also
torchrun / mpirun / horovodrun: DDP then gets a gloo group of its own). Both arms train the same
~10M-parameter MLP on the same batches; blocks of steps alternate between the arms so machine
noise hits both. Rank 0 prints the ratio and writes docs/results/dense.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import ensure_torch_group, write_result  # noqa: E402

import adacomp  # noqa: E402
from adacomp.models import MLP  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--inputs", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30, help="measured steps per arm")
    ap.add_argument("--block", type=int, default=5, help="steps per alternating block")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--out", default="docs/results/dense.md")
    args = ap.parse_args()

    adacomp.init()
    ensure_torch_group()
    rank, world = adacomp.rank(), adacomp.size()
    torch.manual_seed(0)
    ours = MLP(args.inputs, args.width, args.depth)
    theirs = MLP(args.inputs, args.width, args.depth)
    theirs.load_state_dict(ours.state_dict())
    nparams = sum(p.numel() for p in ours.parameters())
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.01), ours.named_parameters(),
                                       config={"fusion": {"bucket_mb": args.bucket_mb}})
    ddp = torch.nn.parallel.DistributedDataParallel(theirs, bucket_cap_mb=args.bucket_mb)
    dopt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.inputs, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def step_ours() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(ours(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    def step_ddp() -> float:
        t0 = time.perf_counter()
        dopt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        dopt.step()
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up both
        step_ours(), step_ddp()
    t_ours, t_ddp = [], []
    while len(t_ours) < args.steps:
        t_ours += [step_ours() for _ in range(args.block)]
        t_ddp += [step_ddp() for _ in range(args.block)]
    # Per-step time of the job = the slowest rank.
    med = torch.tensor([statistics.median(t_ours), statistics.median(t_ddp)])
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    same = max(float((a - b).detach().abs().max()) for a, b in zip(ours.parameters(), theirs.parameters()))
    if rank == 0:
        ratio = float(med[0] / med[1])
        print(f"adacomp dense {1e3 * med[0]:.1f} ms/step, DDP {1e3 * med[1]:.1f} ms/step, ratio {ratio:.3f} "
              f"(goal <= 1.05); max |param diff| {same:.2e}")
        write_result(args.out, "Dense path vs PyTorch DDP", [
            f"Model: MLP {args.inputs}-{'-'.join([str(args.width)] * args.depth)}-10, {nparams / 1e6:.1f}M parameters, "
            f"batch {args.batch}, {world} processes, backend {adacomp.backend().name}, bucket {args.bucket_mb} MB.",
            f"Median of {len(t_ours)} steps per arm (blocks of {args.block} alternating), slowest rank.",
            "",
            "| arm | ms / step | ratio to DDP |", "|---|---|---|",
            f"| PyTorch DDP | {1e3 * med[1]:.1f} | 1.000 |",
            f"| adacomp dense (none + allreduce) | {1e3 * med[0]:.1f} | {ratio:.3f} |",
            "", f"Goal: adacomp <= 1.05x DDP. Parameters of the two arms after training differ by at most {same:.1e}.",
        ])


if __name__ == "__main__":
    main()
