"""End-to-end throughput: samples/s per compressor x communicator, with the step split into
compute / compress / communicate, on a ~6M-parameter MLP or a zoo model (``--model resnet50 |
vgg16 | gpt2_small | lstm_lm``: adacomp.models, synthetic batches).

Every valid (compressor, communicator) pair is measured: pairs are formed from the registries and
kept when ``adacomp.config.load`` accepts them (an impossible pair raises
IncompatibleComponentsError at config time). Compressors with a ``density`` use ``--density``,
powersgd / acpsgd rank 4, qsgd 4 bits. All arms run inside one launch, each with a fresh model and
DistributedOptimizer; data are fixed random batches (throughput does not depend on their values).

    adacomp bench throughput                        # spawns --np 2 workers itself
    adacomp bench throughput --model gpt2_small --batch 2 --compressors none topk
    adacomp run -np 4 -- adacomp bench throughput   # or torchrun / mpirun / horovodrun

The world size is the launcher's. Rows of other world sizes already in throughput.csv are kept, so
running at 2 and then at 4 workers gives one table and one figure with both (make_results.sh does).
Results go to docs/results/ under the current directory (``--out-dir``).
A zoo model writes throughput_<model>.{csv,md,png} so the MLP tables are left alone.
Time split (from ``opt.last_stats``): compress = compress + decompress + error feedback; communicate
= time in collectives or waiting for them (what backward did not hide); compute = the rest.
"""
from __future__ import annotations

import argparse
import csv
import inspect
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from adacomp.bench.common import RESULTS, bench_command, last_stats, worker_or_spawn, write_result
from adacomp.tools.stepclock import time_steps

LAUNCH = "adacomp bench throughput"  # spawns --np workers itself, or under any launcher

FIELDS = ["world", "backend", "compressor", "setting", "communicator", "samples_per_s", "step_ms", "compute_ms",
          "compress_ms", "comm_ms", "bytes_per_step", "dense_bytes_per_step", "params", "batch", "steps", "command"]


def command_line(world: int, command: str) -> str:
    """How this run was launched, for the table of its world size (rows of several runs share a file)."""
    env = os.environ
    launcher = (f"torchrun --nproc_per_node {world}" if "TORCHELASTIC_RUN_ID" in env else
                f"adacomp run -np {world} --" if env.get("ADACOMP_BACKEND") == "torch" else
                f"mpirun -np {world}" if "OMPI_COMM_WORLD_RANK" in env else
                f"horovodrun -np {world}" if "HOROVOD_RANK" in env else f"({world} workers)")
    return f"{launcher} {command}".strip()


def setting_for(name: str, density: float) -> dict[str, Any]:
    from adacomp import compressors
    params = inspect.signature(compressors.registry.cls(name).__init__).parameters
    if "density" in params:
        return {"density": density}
    if "rank" in params:
        return {"rank": 4}
    if "bits" in params:
        return {"bits": 4}
    return {}


def valid_pairs(names: list[str], comms: list[str], density: float) -> list[dict[str, Any]]:
    """Every (compressor, communicator) that config validation accepts."""
    from adacomp.config import load
    from adacomp.errors import IncompatibleComponentsError
    out = []
    for name in names:
        s = setting_for(name, density)
        for comm in comms:
            cfg = {"compressor": {"name": name, **s}, "communicator": {"name": comm}}
            try:
                load(cfg)
            except IncompatibleComponentsError:
                continue
            out.append({"compressor": name, "setting": " ".join(f"{k}={v:g}" for k, v in s.items()), "config": cfg})
    return out


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The benchmarked model, identical on every rank (seed 0, without touching the global RNG)."""
    from adacomp.models import build
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if args.model == "mlp":
            return build("mlp", inputs=args.inputs, width=args.width, depth=args.depth)
        if args.model in ("resnet50", "vgg16"):
            return build(args.model, image_size=args.image_size)
        return build(args.model)


def batch_for(model: torch.nn.Module, args: argparse.Namespace, rank: int) -> Any:
    """This rank's fixed batch (values do not matter for throughput)."""
    from adacomp.models import Synthetic, synthetic_batch
    if args.model == "mlp":
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch, args.inputs, generator=g)
        return Synthetic(x, torch.randint(0, 10, (args.batch,), generator=g), F.cross_entropy)
    return synthetic_batch(model, args.batch, seed=rank)


def measure(pair: dict[str, Any], args: argparse.Namespace, rank: int) -> list[float]:
    """Median [step, compress, comm, bytes, dense bytes] seconds / bytes of this rank."""
    import adacomp
    model = build_model(args)
    data = batch_for(model, args, rank)
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                       config=pair["config"])
    stats: list[tuple[float, float, int, int]] = []

    def step() -> None:
        opt.zero_grad()
        data.loss(model).backward()
        opt.step()

    def record(_: float) -> None:
        st = last_stats(opt)
        stats.append((st.compress_s, st.comm_s, st.bytes_sent, st.dense_bytes))

    times = time_steps(step, args.steps, args.warmup, after=record)
    opt.remove_hooks()
    return [statistics.median(times), *(statistics.median(float(r[k]) for r in stats) for k in range(4))]


def worker(args: argparse.Namespace) -> None:
    import adacomp
    from adacomp import communicators, compressors
    be = adacomp.init()
    torch.set_num_threads(args.threads)
    rank, world = adacomp.rank(), adacomp.size()
    pairs = valid_pairs(args.compressors or compressors.names(), args.communicators or communicators.names(),
                        args.density)
    nparams = sum(p.numel() for p in build_model(args).parameters())
    rows, t_all = [], time.perf_counter()
    for i, pair in enumerate(pairs):
        mine = torch.tensor(measure(pair, args, rank), dtype=torch.float64)
        every = be.allgather(mine.view(1, -1), sizes=[1] * world).view(world, -1)
        slow = every[int(every[:, 0].argmax())]  # the job moves at its slowest rank's pace
        step, comp, comm = float(slow[0]), float(slow[1]), float(slow[2])
        row = {"world": world, "backend": be.name, "compressor": pair["compressor"], "setting": pair["setting"],
               "communicator": pair["config"]["communicator"]["name"], "samples_per_s": world * args.batch / step,
               "step_ms": 1e3 * step, "compute_ms": 1e3 * max(0.0, step - comp - comm), "compress_ms": 1e3 * comp,
               "comm_ms": 1e3 * comm, "bytes_per_step": float(every[:, 3].mean()),
               "dense_bytes_per_step": float(every[:, 4].mean()), "params": nparams, "batch": args.batch,
               "steps": args.steps, "command": command_line(world, args.command)}
        rows.append(row)
        if rank == 0:
            print(f"[{time.perf_counter() - t_all:5.0f}s] {i + 1}/{len(pairs)} {row['compressor']:<10} "
                  f"{row['setting']:<13} {row['communicator']:<15} {row['samples_per_s']:8.1f} samples/s  "
                  f"step {row['step_ms']:7.1f} ms = compute {row['compute_ms']:6.1f} + compress "
                  f"{row['compress_ms']:6.1f} + comm {row['comm_ms']:6.1f}", flush=True)
    if rank == 0:
        report(rows, args)
    be.barrier()
    adacomp.shutdown()


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Merge with rows of other world sizes in the CSV, then rewrite md and png from all of them."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "throughput" if args.model == "mlp" else f"throughput_{args.model}"
    csv_path = out / f"{stem}.csv"
    worlds = {r["world"] for r in rows}
    keep = []
    if csv_path.exists():
        with open(csv_path, newline="") as fh:
            keep = [r for r in csv.DictReader(fh) if int(r["world"]) not in worlds
                    and (not rows or r.get("params") == str(rows[0]["params"]))]
    allrows = [{k: (float(v) if k.endswith(("_ms", "_s", "_step")) else int(v) if k in ("world", "params", "batch", "steps")
                    else v) for k, v in r.items()} for r in keep] + rows
    allrows.sort(key=lambda r: (r["world"], r["compressor"] != "none", r["compressor"], r["communicator"]))
    with open(csv_path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        for r in allrows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    if not allrows:
        raise SystemExit(f"--report-only: no rows in {csv_path}")
    plot(allrows, out / f"{stem}.png")
    what = (f"MLP {args.inputs}-{'-'.join([str(args.width)] * args.depth)}-10" if args.model == "mlp" else
            f"{args.model} (adacomp.models, synthetic batches"
            + (f", {args.image_size}x{args.image_size} images)" if args.model in ("resnet50", "vgg16") else ")"))
    lines = [f"{what} ({allrows[0]['params'] / 1e6:.1f}M "
             f"parameters), batch {args.batch} per worker, median of {args.steps} steps after {args.warmup} "
             f"warm-up, slowest rank; density {args.density:g} where a compressor has one, rank 4 (powersgd, "
             "acpsgd), 4 bits (qsgd). Every (compressor, communicator) pair that config validation accepts.",
             "compute = step - compress - communicate; communicate is the time backward did not hide. "
             "On 2 cores, 4 workers oversubscribe the CPU: compare rows within one world size.",
             "The transport is gloo over loopback with no bandwidth cap, so communication is nearly free and "
             "compression mostly adds time here; docs/results/netem.md runs the main methods over capped links. "
             f"The machine is shared (load average {os.getloadavg()[0]:.1f} when this was written), so compress "
             "and compute times are inflated and noisy.",
             "Each world size's table is kept in throughput.csv and names the command that measured it.", "",
             f"![throughput]({stem}.png)", ""]
    for world in sorted({r["world"] for r in allrows}):
        sub = [r for r in allrows if r["world"] == world]
        dense = next((r for r in sub if r["compressor"] == "none" and r["communicator"] == "allreduce"), None)
        lines += [f"## {world} workers (backend {sub[0]['backend']})", "", f"Command: `{sub[0].get('command') or '?'}`", "",
                  "| compressor | setting | communicator | samples/s | vs dense | step ms | compute | compress | "
                  "communicate | KiB sent/step | ratio |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sub:
            vs = f"{r['samples_per_s'] / dense['samples_per_s']:.2f}x" if dense else ""
            ratio = r["dense_bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else 1.0
            lines.append(f"| {r['compressor']} | {r['setting']} | {r['communicator']} | {r['samples_per_s']:.1f} | {vs} "
                         f"| {r['step_ms']:.1f} | {r['compute_ms']:.1f} | {r['compress_ms']:.1f} | {r['comm_ms']:.1f} "
                         f"| {r['bytes_per_step'] / 1024:.0f} | {ratio:.0f}x |")
        lines.append("")
    write_result(out / f"{stem}.md", "Throughput per compressor x communicator x world size", lines, args.command)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    worlds = sorted({r["world"] for r in rows})
    n = max(len([r for r in rows if r["world"] == w]) for w in worlds)
    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 0.28 * n + 1.5), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        sub = [r for r in rows if r["world"] == world]
        labels = [f"{r['compressor']} {r['setting']} / {r['communicator']}".replace("  ", " ") for r in sub]
        left = [0.0] * len(sub)
        for key, color in (("compute_ms", "#4c72b0"), ("compress_ms", "#dd8452"), ("comm_ms", "#55a868")):
            vals = [r[key] for r in sub]
            ax.barh(range(len(sub)), vals, left=left, color=color, label=key.replace("_ms", ""))
            left = [a + b for a, b in zip(left, vals)]
        for i, r in enumerate(sub):
            ax.text(left[i], i, f" {r['samples_per_s']:.0f}/s", va="center", fontsize=6)
        ax.set_yticks(range(len(sub)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (slowest rank); label: samples/s")
        ax.set_title(f"{world} workers")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adacomp bench throughput", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2, help="workers to spawn when not started by a launcher")
    from adacomp.models import ZOO
    ap.add_argument("--model", default="mlp", choices=["mlp", *sorted(ZOO)], help="mlp (sized by --inputs/--width/--depth) "
                    "or a zoo model: resnet50, vgg16, gpt2_small, lstm_lm")
    ap.add_argument("--image-size", type=int, default=64, help="resnet50 / vgg16 input resolution (224 in the papers)")
    ap.add_argument("--inputs", type=int, default=1024)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per arm")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--compressors", nargs="*", help="subset (default: every registered compressor)")
    ap.add_argument("--communicators", nargs="*", help="subset (default: every registered communicator)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--out-dir", default=RESULTS, help="relative to the current directory (default: %(default)s)")
    ap.add_argument("--report-only", action="store_true", help="rebuild md / png from throughput.csv, no runs")
    args = ap.parse_args(argv)
    args.command = bench_command("throughput", argv)
    if args.report_only:
        report([], args)
        return 0
    return worker_or_spawn(lambda: worker(args), args.np, "throughput", argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
