"""Dense path overhead: adacomp (compressor none + allreduce) vs PyTorch DDP, same model, one run.

Launch under any launcher, e.g. ``adacomp run -np 2 -- adacomp bench dense`` (also
torchrun / mpirun / horovodrun: DDP then gets a gloo group of its own). Both arms train the same
~10M-parameter MLP on the same batches; blocks of steps alternate between the arms so machine
noise hits both. Rank 0 prints the ratio and writes docs/results/dense.md (relative to the current
directory: run it from a checkout, or pass ``--out``).
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import adacomp
from adacomp.bench.common import (RESULTS, add_mlp_arguments, alternating_blocks, bench_command, start_mlp_job,
                                  write_result)
from adacomp.models import MLP

LAUNCH = "adacomp run -np 2 -- adacomp bench dense"  # or torchrun / mpirun / horovodrun


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adacomp bench dense", description=(__doc__ or "").split("\n\n")[0])
    add_mlp_arguments(ap, width=2048, depth=3, steps=30)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--out", default=f"{RESULTS}/dense.md", help="markdown result, relative to the current "
                    "directory (default: %(default)s)")
    args = ap.parse_args(argv)
    rank, world, x, y = start_mlp_job(args)
    ours = MLP(args.inputs, args.width, args.depth)
    theirs = MLP(args.inputs, args.width, args.depth)
    theirs.load_state_dict(ours.state_dict())
    nparams = sum(p.numel() for p in ours.parameters())
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.01), ours.named_parameters(),
                                       config={"fusion": {"bucket_mb": args.bucket_mb}})
    ddp = torch.nn.parallel.DistributedDataParallel(theirs, bucket_cap_mb=args.bucket_mb)
    dopt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def step_ours() -> None:
        opt.zero_grad()
        F.cross_entropy(ours(x), y).backward()
        opt.step()

    def step_ddp() -> None:
        dopt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        dopt.step()

    times = alternating_blocks({"ours": step_ours, "ddp": step_ddp}, args.steps, args.block)
    t_ours, t_ddp = times["ours"], times["ddp"]
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
        ], bench_command("dense", argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
