"""Collective micro-benchmark: allreduce / allgather / broadcast / alltoall time vs message size.

Fits alpha (latency) and beta (seconds per byte) to the measurements with the AR-Topk paper's
Table I models (adacomp.netmodel; alltoall: the pairwise-exchange model ByteComp's timeline uses,
adacomp.policies.timeline.alltoall) and prints each measurement beside the model's prediction.
Launch: ``adacomp run -np 2 -- adacomp bench collectives`` (or torchrun / mpirun / horovodrun; the
backend follows the launcher). Writes docs/results/collectives.{md,csv,png} under the current
directory (``--out``).
"""
from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path
from typing import Any

import torch

import adacomp
from adacomp import netmodel
from adacomp.bench.common import RESULTS, bench_command, write_result
from adacomp.policies.timeline import alltoall
from adacomp.tools.stepclock import time_steps

LAUNCH = "adacomp run -np 2 -- adacomp bench collectives"  # or torchrun / mpirun / horovodrun

MODELS = {"allreduce": netmodel.ring_allreduce, "allgather": netmodel.allgather, "broadcast": netmodel.broadcast,
          "alltoall": alltoall}


def gbps(beta: float) -> str:
    return f"{8e-9 / beta:.2f}" if beta > 0 else "inf"


def time_op(be: Any, op: str, nbytes: int, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``op`` after 2 warm-up calls, each on a fresh buffer
    after a barrier (slowest rank)."""
    n = max(1, nbytes // 4)
    t = torch.ones(n)
    buf = [t]

    def prepare() -> None:
        buf[0] = t.clone()
        be.barrier()

    def call() -> None:
        if op == "allreduce":
            be.allreduce(buf[0])
        elif op == "allgather":
            be.allgather(buf[0], sizes=[n] * be.size())
        elif op == "alltoall":  # the message spread evenly over the ranks, as a divisible scheme does
            w = be.size()
            splits = [n // w + (1 if r < n % w else 0) for r in range(w)]
            be.alltoall(buf[0], splits, recv_splits=[splits[be.rank()]] * w)
        else:
            be.broadcast(buf[0], root=0)

    samples = time_steps(call, repeats, 2, sync=prepare)
    local = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    return float(be.allgather(local, sizes=[1] * be.size()).max())  # the slowest rank ends it


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adacomp bench collectives", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--min-pow", type=int, default=4, help="smallest message 2^k bytes")
    ap.add_argument("--max-pow", type=int, default=24, help="largest message 2^k bytes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=f"{RESULTS}/collectives", help="results stem (.md, .csv, .png), relative "
                    "to the current directory (default: %(default)s)")
    args = ap.parse_args(argv)
    args.command = bench_command("collectives", argv)
    adacomp.init()
    be = adacomp.backend()
    N = be.size()
    sizes = [2 ** k for k in range(args.min_pow, args.max_pow + 1, 2)]
    rows = []
    for op in MODELS:
        for nb in sizes:
            rows.append((op, nb, time_op(be, op, nb, args.repeats)))
    if be.rank() == 0:
        report(rows, N, be.name, args)
    be.barrier()
    adacomp.shutdown()
    return 0


def report(rows: list, N: int, backend_name: str, args: argparse.Namespace) -> None:
    fit_rows = [(MODELS[op](nb, N, 1.0, 0.0), MODELS[op](nb, N, 0.0, 1.0)) for op, nb, _ in rows]
    alpha, beta = netmodel.fit_alpha_beta(fit_rows, [t for _, _, t in rows])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["op", "bytes", "measured_s", "predicted_s", "error_pct"])
        table = []
        for op, nb, t in rows:
            pred = MODELS[op](nb, N, alpha, beta)
            err = 100 * (pred - t) / t
            w.writerow([op, nb, f"{t:.6g}", f"{pred:.6g}", f"{err:.1f}"])
            table.append(f"| {op} | {nb} | {1e3 * t:.3f} | {1e3 * pred:.3f} | {err:+.0f}% |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op, color in zip(MODELS, ("C0", "C1", "C2", "C3")):
        xs = [nb for o, nb, _ in rows if o == op]
        ax.loglog(xs, [t for o, _, t in rows if o == op], "o", color=color, label=f"{op} measured")
        ax.loglog(xs, [MODELS[op](nb, N, alpha, beta) for nb in xs], "-", color=color, alpha=0.6,
                  label=f"{op} model")
    ax.set_xlabel("message bytes per rank"), ax.set_ylabel("seconds"), ax.legend(fontsize=8)
    ax.set_title(f"{backend_name} backend, {N} ranks: alpha={1e6 * alpha:.1f} us, 1/beta={gbps(beta)} Gbit/s")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    med_err = statistics.median(abs(100 * (MODELS[o](nb, N, alpha, beta) - t) / t) for o, nb, t in rows)
    print(f"alpha = {1e6 * alpha:.1f} us, beta = {beta:.3e} s/B ({gbps(beta)} Gbit/s); "
          f"median |prediction error| {med_err:.0f}%")
    write_result(str(out.with_suffix(".md")), "Collectives vs the alpha-beta model", [
        f"Backend `{backend_name}`, {N} ranks. Median of {args.repeats} timed calls per point (slowest rank).",
        f"Fitted over all points: alpha = {1e6 * alpha:.1f} us, beta = {beta:.3e} s/byte "
        f"({gbps(beta)} Gbit/s). Median |prediction error| {med_err:.0f}%.",
        "", "![collectives](collectives.png)", "",
        "| op | bytes | measured ms | model ms | model error |", "|---|---|---|---|---|", *table], args.command)


if __name__ == "__main__":
    raise SystemExit(main())
