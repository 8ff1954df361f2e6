"""Convergence suite: every compressor on two real offline tasks, accuracy vs dense.

Tasks: ``digits`` (scikit-learn's 8x8 digits, DigitsCNN, SGD + momentum) and ``text`` (a
character-level LSTM on scikit-learn's data set descriptions, adacomp.datasets.text; next-character
accuracy, gradients clipped to norm 1 after averaging). Arms: every registered compressor; those with
a ``density`` at 0.01 and 0.1, powersgd / acpsgd at rank 4, qsgd at 4 bits, the rest (none, fp16,
efsignsgd) once; each on the first fitting communicator of allreduce, allgather_fast, allgather,
plus a row on the compressor's own ``default_communicator`` where it has one (oktopk);
memory ``auto`` (residual error feedback for biased compressors). All arms run inside ONE launch:
each worker loops over the arms, building a fresh model (fixed seed) and DistributedOptimizer per arm.

    adacomp bench convergence                                  # spawns 2 workers itself
    adacomp run -np 2 -- adacomp bench convergence             # or torchrun / mpirun / horovodrun
    adacomp bench convergence --np 4 --tasks digits --compressors none topk

Budget: the defaults (2 tasks x 30 arms, 150 steps each) are sized for < 20 min on 2 shared cores.
Writes docs/results/convergence.{md,csv,json} and convergence_<task>.png under the current
directory (``--out-dir``).
"""
from __future__ import annotations

import argparse
import csv
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from adacomp.bench.common import RESULTS, bench_command, last_stats, worker_or_spawn, write_result
from adacomp.tools.stepclock import time_steps

LAUNCH = "adacomp bench convergence"  # spawns --np workers itself, or under any launcher

PREFERRED_COMMS = ("allreduce", "allgather_fast", "allgather")
LAUNCHER_KEYS = ("ADACOMP_BACKEND", "OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "TORCHELASTIC_RUN_ID")  # common.launcher reads them


def arms(names: list[str], densities: list[float], rank: int, bits: int) -> list[dict[str, Any]]:
    """One arm per (compressor, setting), with the first fitting communicator."""
    from adacomp import communicators, compressors
    out = []
    for name in names:
        params = inspect.signature(compressors.registry.cls(name).__init__).parameters
        if "density" in params:
            settings = [{"density": d} for d in densities]
        elif "rank" in params:
            settings = [{"rank": rank}]
        elif "bits" in params:
            settings = [{"bits": bits}]
        else:
            settings = [{}]
        for s in settings:
            fits = communicators.fitting(compressors.get(name, **s))
            comm = next((c for c in PREFERRED_COMMS if c in fits), fits[0] if fits else None)
            if comm is None:
                raise RuntimeError(f"no communicator fits compressor {name!r} with {s}")
            label = name + "".join(f" {k}={v:g}" for k, v in s.items())
            out.append({"label": label, "compressor": name, "params": s, "communicator": comm})
            own = getattr(compressors.registry.cls(name), "default_communicator", None)
            if own and own != comm:  # the method's own communicator too (oktopk: its sparse allreduce)
                out.append({"label": f"{label} +{own}", "compressor": name, "params": s, "communicator": own})
    return out


# ----------------------------------------------------------------------------- tasks
class Task:
    """Data, model factory and evaluation of one task; identical on every rank."""

    def __init__(self, name: str, seed: int):
        self.name = name
        if name == "digits":
            from adacomp.datasets.digits import digits
            from adacomp.models import DigitsCNN
            self.x, self.y, self.xt, self.yt = digits(seed=seed)
            self.factory: Callable[[], torch.nn.Module] = DigitsCNN
            self.lr, self.clip, self.desc = 0.05, 0.0, "DigitsCNN on scikit-learn digits (1437 train / 360 test)"
        elif name == "text":
            from adacomp.datasets.text import char_sequences
            from adacomp.models.charlstm import CharLSTM
            self.x, self.y, self.xt, self.yt, corpus = char_sequences(seq_len=64, seed=seed)
            vocab = len(corpus.vocab)
            self.factory = lambda: CharLSTM(vocab)
            self.lr, self.clip = 1.0, 1.0
            self.desc = (f"CharLSTM (embed 32, hidden 128) on {corpus.source}: {len(corpus.text)} chars, "
                         f"vocab {vocab}, windows of 64 ({len(self.y)} train / {len(self.yt)} test)")
        else:
            raise ValueError(f"unknown task {name!r}; valid choices: digits, text")

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def evaluate(self, model: torch.nn.Module) -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            out = model(self.xt)
            loss = float(self.loss(out, self.yt))
            acc = float((out.argmax(-1) == self.yt).float().mean())
        model.train()
        return acc, loss


def run_arm(task: Task, arm: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Train one arm from the same seed; returns curves and summary (identical models on all ranks)."""
    import adacomp
    from adacomp.datasets.digits import shard
    rank, world = adacomp.rank(), adacomp.size()
    with torch.random.fork_rng(devices=[]):  # seeded init without leaving the global RNG changed
        torch.manual_seed(args.seed)
        model = task.factory()
    cfg = {"compressor": {"name": arm["compressor"], **arm["params"]}, "communicator": {"name": arm["communicator"]}}
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.9),
                                       named_parameters=model.named_parameters(), config=cfg)
    adacomp.broadcast_parameters(model.state_dict(), root_rank=0)
    per_rank = len(task.y) // world
    steps_per_epoch = max(1, per_rank // args.batch)
    curve: list[dict[str, Any]] = []
    stats: list[tuple[float, float, float, float]] = []
    status = "ok"
    acc, loss = task.evaluate(model)
    curve.append({"step": 0, "wall_s": 0.0, "test_acc": acc, "test_loss": loss})
    cur = SimpleNamespace(step=-1, idx=None, j=None, train_s=0.0)

    def next_batch() -> None:
        cur.step += 1
        epoch, s = divmod(cur.step, steps_per_epoch)
        if s == 0:
            cur.idx = shard(len(task.y), rank, world, epoch, args.seed)
        cur.j = cur.idx[s * args.batch:(s + 1) * args.batch]

    def train_step() -> None:
        opt.zero_grad()
        task.loss(model(task.x[cur.j]), task.y[cur.j]).backward()
        opt.synchronize()
        if task.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), task.clip)
        with opt.skip_synchronize():
            opt.step()

    def record(seconds: float) -> None:
        cur.train_s += seconds
        st = last_stats(opt)
        stats.append((st.bytes_sent, st.dense_bytes, st.compress_s, st.comm_s))
        if (cur.step + 1) % args.eval_every == 0 or cur.step + 1 == args.steps:
            acc, loss = task.evaluate(model)
            curve.append({"step": cur.step + 1, "wall_s": cur.train_s, "test_acc": acc, "test_loss": loss})

    try:
        time_steps(train_step, args.steps, sync=next_batch, after=record)
    except adacomp.NonFiniteGradientError:  # raised on every rank alike: record and go on
        status = f"diverged at step {opt.steps}"
    train_s = cur.train_s
    opt.remove_hooks()
    warm = stats[min(5, len(stats) - 1):] if stats else [(0, 0, 0.0, 0.0)]
    med = [statistics.median(v[i] for v in warm) for i in range(4)]
    return {"task": task.name, **arm, "status": status, "steps": len(stats), "wall_s": train_s,
            "final_acc": curve[-1]["test_acc"], "final_loss": curve[-1]["test_loss"],
            "bytes_per_step": med[0], "dense_bytes_per_step": med[1], "compress_ms": 1e3 * med[2],
            "comm_ms": 1e3 * med[3], "step_ms": 1e3 * train_s / max(1, len(stats)), "curve": curve}


def worker(args: argparse.Namespace) -> None:
    import adacomp
    from adacomp import compressors
    adacomp.init()
    torch.set_num_threads(args.threads)
    rank, world = adacomp.rank(), adacomp.size()
    names = args.compressors or compressors.names()
    plan = arms(names, args.densities, args.rank, args.bits)
    if "none" in names:  # dense first: every other arm is compared with it
        plan.sort(key=lambda a: a["compressor"] != "none")
    results, t_all = [], time.perf_counter()
    for task_name in args.tasks:
        task = Task(task_name, args.seed)
        for i, arm in enumerate(plan):
            r = run_arm(task, arm, args)
            results.append(r)
            if rank == 0:
                print(f"[{time.perf_counter() - t_all:6.0f}s] {task_name} {i + 1}/{len(plan)} {arm['label']:<24} "
                      f"{arm['communicator']:<14} acc {100 * r['final_acc']:5.1f}%  loss {r['final_loss']:.3f}  "
                      f"{r['wall_s']:5.1f}s  {r['bytes_per_step'] / 1024:8.1f} KiB/step  {r['status']}", flush=True)
    if rank == 0:
        report(results, {t: Task(t, args.seed).desc for t in args.tasks}, world, args, time.perf_counter() - t_all)
    adacomp.shutdown()


# ----------------------------------------------------------------------------- report
def report(results: list[dict[str, Any]], descs: dict[str, str], world: int, args: argparse.Namespace,
           total_s: float) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dense = {r["task"]: r for r in results if r["compressor"] == "none"}
    fields = ["task", "label", "compressor", "communicator", "status", "steps", "final_acc", "final_loss",
              "acc_vs_dense_pp", "wall_s", "step_ms", "compress_ms", "comm_ms", "bytes_per_step",
              "dense_bytes_per_step", "compression_ratio"]
    rows: list[dict[str, Any]] = []
    for r in results:
        d = dense.get(r["task"])
        rows.append({**{k: r.get(k) for k in fields}, "acc_vs_dense_pp": 100 * (r["final_acc"] - d["final_acc"]) if d else None,
                     "compression_ratio": r["dense_bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else 1.0})
    with open(out / "convergence.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    (out / "convergence.json").write_text(json.dumps(
        {"world": world, "total_s": total_s, "descs": descs, "argv": args.argv, "results": results,
         "launcher_env": {k: os.environ[k] for k in LAUNCHER_KEYS if k in os.environ}}, indent=1))
    lines = [f"{world} workers, {args.steps} steps per arm, batch {args.batch} per worker, seed {args.seed}, "
             f"{args.threads} torch thread(s) per worker; whole run {total_s / 60:.1f} min. Wall time is training "
             "time only (evaluation excluded) on a shared machine, so compare it within this table.",
             "Accuracy is test accuracy after the last step; `vs dense` in percentage points. "
             "bytes/step: median payload bytes one rank sends per step (dense = fp32 allreduce input). "
             "One learning rate per task for every arm (no per-method tuning), so a method with high variance "
             "(e.g. qsgd without error feedback) may need a smaller one.", ""]
    for task in args.tasks:
        lines += [f"## {task}: {descs[task]}", "", f"![{task}](convergence_{task}.png)", "",
                  "| method | communicator | test acc | vs dense | test loss | steps | wall s | KiB/step | ratio | status |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            if row["task"] != task:
                continue
            vs = "" if row["acc_vs_dense_pp"] is None else f"{row['acc_vs_dense_pp']:+.1f}"
            lines.append(f"| {row['label']} | {row['communicator']} | {100 * row['final_acc']:.1f}% | {vs} | "
                         f"{row['final_loss']:.3f} | {row['steps']} | {row['wall_s']:.1f} | "
                         f"{row['bytes_per_step'] / 1024:.1f} | {row['compression_ratio']:.0f}x | {row['status']} |")
        lines += ["", summary([r for r in rows if r["task"] == task]), ""]
        plot(results, task, out / f"convergence_{task}.png")
    write_result(out / "convergence.md", "Convergence: every compressor vs dense on real offline data", lines,
                 args.command)


def summary(rows: list[dict[str, Any]]) -> str:
    """One sentence per task: how many compressed arms stay close to dense, and the worst one."""
    comp = [r for r in rows if r["compressor"] != "none" and r["acc_vs_dense_pp"] is not None]
    if not comp:
        return ""
    close = [r for r in comp if r["acc_vs_dense_pp"] >= -2.0]
    worst = min(comp, key=lambda r: r["acc_vs_dense_pp"])
    best = max(comp, key=lambda r: r["compression_ratio"] if r["acc_vs_dense_pp"] >= -2.0 else 0)
    return (f"{len(close)} of {len(comp)} compressed arms end within 2 percentage points of dense; the most "
            f"compressed of those is {best['label']} ({best['compression_ratio']:.0f}x fewer bytes). Furthest "
            f"from dense: {worst['label']} ({worst['acc_vs_dense_pp']:+.1f} pp).")


def plot(results: list[dict[str, Any]], task: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mine = [r for r in results if r["task"] == task]
    names = sorted({r["compressor"] for r in mine})
    cmap = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    for r in mine:
        color = "black" if r["compressor"] == "none" else cmap(names.index(r["compressor"]) % 20)
        style = "--" if r["params"].get("density") == min((a["params"].get("density", 1) for a in mine), default=1) \
            and "density" in r["params"] else "-"
        xs = [c["step"] for c in r["curve"]]
        ys = [100 * c["test_acc"] for c in r["curve"]]
        axes[0].plot(xs, ys, style, color=color, lw=2.2 if color == "black" else 1.0, label=r["label"])
        axes[1].plot([c["wall_s"] for c in r["curve"]], ys, style, color=color, lw=2.2 if color == "black" else 1.0)
    axes[0].set_xlabel("step"), axes[1].set_xlabel("training wall-clock (s)")
    for ax in axes:
        ax.set_ylabel("test accuracy (%)"), ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="center right", fontsize=7, ncol=1)
    fig.suptitle(f"{task}: test accuracy vs step and vs time (dashed: the lower density)")
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adacomp bench convergence", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2, help="workers to spawn when not started by a launcher (2-4)")
    ap.add_argument("--tasks", nargs="+", default=["digits", "text"], choices=["digits", "text"])
    ap.add_argument("--compressors", nargs="*", help="subset of registered names (default: all)")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.1])
    ap.add_argument("--rank", type=int, default=4, help="low-rank r of powersgd / acpsgd")
    ap.add_argument("--bits", type=int, default=4, help="qsgd bits")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per arm")
    ap.add_argument("--batch", type=int, default=32, help="samples per worker per step")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--out-dir", default=RESULTS, help="relative to the current directory (default: %(default)s)")
    ap.add_argument("--from-json", help="rebuild md / csv / png from a convergence.json without training")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.command = bench_command("convergence", args.argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        run_args = ap.parse_args(saved["argv"])
        run_args.out_dir = args.out_dir
        run_args.argv = saved["argv"]
        run_args.command = bench_command("convergence", saved["argv"])
        # The results file names the launcher that measured them; the environment is put back
        # afterwards so a caller in the same process (tests) keeps its own.
        old_env = dict(os.environ)
        os.environ.update(saved.get("launcher_env", {}))
        try:
            report(saved["results"], saved["descs"], saved["world"], run_args, saved["total_s"])
        finally:
            os.environ.clear()
            os.environ.update(old_env)
        return 0
    return worker_or_spawn(lambda: worker(args), args.np, "convergence", argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
