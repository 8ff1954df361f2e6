"""Compress + decompress time of every registered sparsifier, as a ratio to a memory-bandwidth floor.

For each size 2^min_exp .. 2^max_exp (elements, viewed as a near-square matrix so ADTopk has rows)
and each density, one Gaussian tensor is compressed and decompressed ``repeats`` times after
``warmup`` calls; the median is divided by the median time of one elementwise pass over the same
tensor into a preallocated buffer (``torch.abs(x, out=buf)``) measured in the same run, so the ratio
says how many memory passes a compressor costs, on this machine, under its current load.

    adacomp bench compressors                       # CPU, 2^14 .. 2^24
    adacomp bench compressors --device cuda --max-exp 25

Writes docs/results/compressors_<device>.csv / .json / .png (under the current directory, or
``--out-dir``) and rebuilds compressors.md there from every device's CSV found (a CUDA run adds its
table beside the CPU one).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import re
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

from adacomp import compressors
from adacomp.bench.common import RESULTS, bench_command
from adacomp.tools.stepclock import time_steps

LAUNCH = "adacomp bench compressors"  # one process

THRESHOLD = ("dgc", "gaussiank", "redsync", "sidco", "oktopk", "mstopk", "adtopk_t")
# Stateful compressors start in a warm-up phase; shorten it so the timings show their steady state.
OVERRIDES = {"adtopk_t": {"sigma": 1}}


def sparsifiers(only: list[str] | None) -> list[str]:
    out = []
    for name in compressors.names():
        if only and name not in only:
            continue
        c = compressors.get(name, **OVERRIDES.get(name, {}))
        if c.rounds == 1 and (c.sparse or c.density() is not None):
            out.append(name)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def paired_medians(fn: Callable[[int], object], floor: Callable[[], object], device: torch.device, warmup: int,
                   repeats: int, budget_s: float) -> tuple[float, float]:
    """Median seconds of ``fn(i)`` and of ``floor()``, timed alternately so both see the same
    machine load; fewer repeats (>= 3) once the cell has used its time budget."""
    for i in range(warmup):
        fn(i)
        floor()
    sync(device)
    tf: list[float] = []
    tc: list[float] = []
    i = warmup
    def floor_synced() -> None:
        floor()
        sync(device)

    def fn_synced() -> None:
        fn(i)
        sync(device)

    while len(tc) < repeats:
        tf += time_steps(floor_synced, 1)
        tc += time_steps(fn_synced, 1)
        i += 1
        if len(tc) >= 3 and sum(tc) > budget_s:
            break
    return statistics.median(tc), statistics.median(tf)


def matrix(numel: int) -> tuple[int, int]:
    e = numel.bit_length() - 1
    return 2 ** (e // 2), 2 ** (e - e // 2)


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    names = sparsifiers(args.compressors)
    rows: list[dict] = []
    for e in args.exps or range(args.min_exp, args.max_exp + 1):
        n = 2 ** e
        x = torch.randn(*matrix(n), generator=gen, device=device)
        buf = torch.empty_like(x)
        for density in args.densities:
            for name in names:
                c = compressors.get(name, density=density, **OVERRIDES.get(name, {}))
                sent: list[int] = []

                def step(i: int, c: compressors.Compressor = c, sent: list[int] = sent) -> None:
                    c.on_step(i)
                    payload, ctx = c.compress(x, "bench")
                    c.decompress(payload, ctx)
                    sent.append(payload[0].numel())
                try:
                    t, floor = paired_medians(step, lambda: torch.abs(x, out=buf), device, args.warmup,
                                              args.repeats, args.budget)
                except Exception as exc:  # noqa: BLE001 - one broken compressor must not stop the table
                    print(f"{name} 2^{e} d={density}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    continue
                rows.append({"compressor": name, "exp": e, "numel": n, "density": density, "time_s": t,
                             "floor_s": floor, "ratio": t / floor,
                             "sent_density": statistics.median(sent) / n})
                print(f"2^{e:<2} d={density:<6} {name:<10} {t * 1e3:9.3f} ms  {t / floor:8.1f}x floor",
                      flush=True)
    return rows


def machine(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"Python {platform.python_version()}")
    if device.type == "cuda":
        info += f", GPU {torch.cuda.get_device_name(device)}"
    try:
        info += f", load average {os.getloadavg()[0]:.1f} at start"
    except OSError:
        pass
    return info


def write_device_files(rows: list[dict], args: argparse.Namespace, meta: dict) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"compressors_{args.device}"
    if args.merge and Path(f"{stem}.csv").exists():  # keep other compressors' rows from an earlier run
        with open(f"{stem}.csv") as fh:
            mine = {r["compressor"] for r in rows}
            rows = [r for r in csv.DictReader(fh) if r["compressor"] not in mine] + rows
        old = json.loads(Path(f"{stem}.json").read_text())
        meta = {**old, "command": f"{old['command']}; then {meta['command']}"}
    with open(f"{stem}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    Path(f"{stem}.json").write_text(json.dumps(meta, indent=1) + "\n")
    plot(rows, args.device, Path(f"{stem}.png"))


def plot(rows: list[dict], device: str, path: Path) -> None:
    """Ratio to the memory pass against size, one panel per density (dashed: threshold methods)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    dens = sorted({float(r["density"]) for r in rows})
    names = sorted({r["compressor"] for r in rows})
    colors = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(dens), figsize=(5 * len(dens), 4), sharey=True, squeeze=False)
    for ax, d in zip(axes[0], dens):
        for j, name in enumerate(names):
            pts = sorted((int(r["numel"]), float(r["ratio"])) for r in rows
                         if r["compressor"] == name and float(r["density"]) == d)
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=name, color=colors(j % 20),
                        ls="--" if name in THRESHOLD else "-")
        ax.axhline(5, color="grey", lw=0.8)
        ax.set(xscale="log", yscale="log", title=f"density {d} ({device})", xlabel="elements")
    axes[0][0].set_ylabel("compress+decompress / memory pass")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def section(device: str, rows: list[dict], meta: dict) -> list[str]:
    exps = sorted({int(r["exp"]) for r in rows})
    names = sorted({r["compressor"] for r in rows})
    lines = [f"## {device.upper()}", "", f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}  ",
             "The memory pass is re-measured beside every cell (alternating calls), so each ratio "
             "compares two timings taken under the same load.  ",
             f"Date: {meta['date']}; median of up to {meta['repeats']} repeats after {meta['warmup']} warm-up calls; "
             f"stateful overrides: {meta['overrides']}", ""]
    load = re.search(r"(\d+) cores.*load average ([0-9.]+)", meta["machine"])
    if load and float(load.group(2)) > int(load.group(1)):
        lines += [f"**Shared machine**: load average {load.group(2)} on {load.group(1)} cores when this ran, so "
                  "single cells are noisy (other processes preempt long calls more than the short memory "
                  "pass); read trends across sizes, and rerun on an idle machine before quoting a cell.", ""]
    lines += [f"![plot](compressors_{device}.png)", ""]
    top = max(exps)
    for d in sorted({float(r["density"]) for r in rows}):
        floors = [float(r["floor_s"]) for r in rows if int(r["exp"]) == top and float(r["density"]) == d]
        lines += [f"### density {d}: time / memory pass (median pass at 2^{top}: "
                  f"{1e3 * statistics.median(floors):.3f} ms)", "",
                  "| compressor | " + " | ".join(f"2^{e}" for e in exps) + f" | ms at 2^{top} | sent at 2^{top} |",
                  "|---" * (len(exps) + 3) + "|"]
        for name in names:
            cell = {int(r["exp"]): r for r in rows if r["compressor"] == name and float(r["density"]) == d}
            ratios = " | ".join(f"{float(cell[e]['ratio']):.1f}" if e in cell else "-" for e in exps)
            last = cell.get(top)
            tail = f"{1e3 * float(last['time_s']):.2f} | {float(last['sent_density']):.4f}" if last else "- | -"
            lines.append(f"| {name} | {ratios} | {tail} |")
        lines.append("")
    lines += goals(rows, top)
    return lines


def goals(rows: list[dict], top: int) -> list[str]:
    at = {(r["compressor"], float(r["density"])): r for r in rows if int(r["exp"]) == top}
    out = [f"### Goals at 2^{top} elements", "",
           "Threshold sparsifiers within 5x of the memory pass (issue 3):", ""]
    for (name, d), r in sorted(at.items()):
        if name in THRESHOLD:
            ok = "meets" if float(r["ratio"]) <= 5 else "misses"
            out.append(f"- {name} at density {d}: {float(r['ratio']):.1f}x ({ok} the 5x goal)")
    out += ["", "ADTopk vs Topk at equal k (paper: 27-51% less compression time on GPU):", ""]
    for (name, d), r in sorted(at.items()):
        if name == "adtopk" and ("topk", d) in at:
            t_ad, t_tk = float(r["time_s"]), float(at[("topk", d)]["time_s"])
            out.append(f"- density {d}: adtopk {1e3 * t_ad:.2f} ms vs topk {1e3 * t_tk:.2f} ms "
                       f"({100 * (1 - t_ad / t_tk):+.0f}% less time; sent {float(r['sent_density']):.4f} vs "
                       f"{float(at[('topk', d)]['sent_density']):.4f})")
    return out + [""]


def rebuild_markdown(out_dir: Path) -> Path:
    lines = ["# Compressor micro-benchmark", "",
             "Generated by `adacomp bench compressors`: compress + decompress time per sparsifier divided by "
             "one elementwise memory pass over the same tensor (`torch.abs(x, out=buf)`), measured in the same "
             "run. A ratio of 1 means the compressor costs one read+write of the gradient. Tensors are Gaussian, "
             "shaped as near-square matrices (ADTopk's rows are the first dimension).", ""]
    for device in ("cpu", "cuda"):
        csv_path = out_dir / f"compressors_{device}.csv"
        if not csv_path.exists():
            continue
        with open(csv_path) as fh:
            rows = list(csv.DictReader(fh))
        meta = json.loads((out_dir / f"compressors_{device}.json").read_text())
        lines += section(device, rows, meta)
    path = out_dir / "compressors.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="adacomp bench compressors", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--min-exp", type=int, default=14)
    p.add_argument("--max-exp", type=int, default=24, help="largest size is 2^MAX_EXP elements (issue: up to 25)")
    p.add_argument("--exps", type=int, nargs="+", help="these exponents only (instead of --min-exp .. --max-exp)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    p.add_argument("--compressors", nargs="*", help="subset of registered names (default: every sparsifier)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: stable ratios on a shared machine; 0: torch's default)")
    p.add_argument("--budget", type=float, default=1.5, help="seconds per cell before cutting repeats (min 3)")
    p.add_argument("--merge", action="store_true",
                   help="replace only the measured compressors' rows in an existing CSV of this device")
    p.add_argument("--out-dir", default=RESULTS, help="relative to the current directory (default: %(default)s)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device visible to torch")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    meta = {"command": bench_command("compressors", argv),
            "machine": machine(torch.device(args.device)),
            "date": datetime.datetime.now().isoformat(timespec="minutes"),
            "repeats": args.repeats, "warmup": args.warmup, "overrides": OVERRIDES}
    rows = run(args)
    if not rows:
        print("no results", file=sys.stderr)
        return 1
    write_device_files(rows, args, meta)
    print(f"wrote {rebuild_markdown(Path(args.out_dir))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
