"""``adacomp train --config configs/quickstart.yaml``: the built-in job.

Trains a small CNN on scikit-learn's digits (ships offline with the package) on N local workers
with the configured compression, shows a progress bar, then prints a table (accuracy, loss, step
time split into compute / compress / communicate, bytes sent per step, effective compression
ratio) and writes ``metrics.json`` and ``training.png`` into ``train.out_dir``.

Run outside a launcher it starts its own workers through ``adacomp run``; under torchrun, mpirun
or horovodrun it is one worker of that job.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="adacomp train", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    p.add_argument("--workers", type=int, help="override train.workers")
    p.add_argument("--epochs", type=int, help="override train.epochs")
    p.add_argument("--out", help="override train.out_dir")
    p.add_argument("--checkpoint", help="checkpoint set directory: resume from its latest set, save there on "
                                        "SIGTERM / SIGUSR1 (then exit 76) and every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoint sets (0: only on signal)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _config(args: argparse.Namespace):
    from adacomp.config import ConfigError, load
    cfg = load(args.config)
    over = {k: v for k, v in (("workers", args.workers), ("epochs", args.epochs), ("out_dir", args.out)) if v is not None}
    if over.get("workers", 1) < 1 or over.get("epochs", 1) < 1:
        raise ConfigError("train", "--workers and --epochs must be >= 1")
    cfg.train = dataclasses.replace(cfg.train, **over)
    return cfg


def _evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        out = model(x)
        loss = float(F.cross_entropy(out, y))
        acc = float((out.argmax(1) == y).float().mean())
    model.train()
    return acc, loss


def run_worker(cfg: Any, ckpt_dir: str | None = None, ckpt_every: int = 0) -> dict[str, Any]:
    """One worker's training loop; returns the metrics (rank 0 also writes them). With ``ckpt_dir``
    it resumes from the latest checkpoint set there and, on a pre-emption signal, writes one set
    at the next step boundary on every rank and exits with ``PREEMPTED_EXIT_CODE``."""
    import adacomp
    from adacomp.runtime import checkpoint
    from adacomp.datasets.digits import digits, shard
    from adacomp.models import build
    from adacomp.netem.schedule import report_step

    tc = cfg.train
    adacomp.init(config=cfg)
    rank, world = adacomp.rank(), adacomp.size()
    torch.manual_seed(tc.seed)
    model = build(tc.model, **({"inputs": 64} if tc.model == "mlp" else {}))
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=tc.lr, momentum=tc.momentum),
                                       named_parameters=model.named_parameters(), config=cfg)
    adacomp.broadcast_parameters(model.state_dict(), root_rank=0)
    adacomp.broadcast_optimizer_state(opt, root_rank=0)
    x, y, xt, yt = digits(seed=tc.seed)
    per_rank = len(y) // world
    steps_per_epoch = max(1, per_rank // tc.batch_size)
    total = steps_per_epoch * tc.epochs
    opt.steps_per_epoch = steps_per_epoch  # policies whose period is "one epoch" (lgreco) read it
    start = 0
    preempt = None
    if ckpt_dir:
        extra = checkpoint.load_set(ckpt_dir, model, opt)
        start = int(extra["step"]) if extra else 0
        preempt = checkpoint.Preemption()
    bar = None
    if rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=total, initial=start, desc=f"train {cfg.compressor.name}/{cfg.communicator.name} x{world}",
                   unit="step", file=sys.stdout, mininterval=0.5, dynamic_ncols=False, ncols=100)
    records: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    t_start = time.perf_counter()
    for epoch in range(tc.epochs):
        if (epoch + 1) * steps_per_epoch <= start:
            continue  # finished before the checkpoint set was written
        idx = shard(len(y), rank, world, epoch, tc.seed)
        for s in range(steps_per_epoch):
            done = epoch * steps_per_epoch + s  # global steps finished before this one
            if done < start:
                continue  # resumed: the data order is a function of (epoch, seed), so skipping is exact
            j = idx[s * tc.batch_size:(s + 1) * tc.batch_size]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(model(x[j]), y[j])
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t0
            st = opt.last_stats
            assert st is not None  # set by opt.step()
            rec = {"step": len(records), "loss": float(loss.detach()), "step_s": dt, "compress_s": st.compress_s,
                   "comm_s": st.comm_s, "compute_s": max(0.0, dt - st.compress_s - st.comm_s),
                   "bytes_sent": st.bytes_sent, "dense_bytes": st.dense_bytes,
                   "wall_s": time.perf_counter() - t_start}
            records.append(rec)
            if rank == 0:
                report_step(opt.steps, epoch)  # drives step-based netem schedules; no-op otherwise
            if bar is not None:
                bar.update(1)
                if len(records) % tc.log_every == 0:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}")
            if preempt is not None:
                assert ckpt_dir is not None  # preempt is set only with ckpt_dir
                if preempt.should_stop():
                    checkpoint.save_set(ckpt_dir, model, opt, step=done + 1)
                    if rank == 0:
                        print(f"\npre-empted: checkpoint set for step {done + 1} in {ckpt_dir}; rerun the same "
                              f"command to resume", flush=True)
                    adacomp.shutdown()
                    raise SystemExit(checkpoint.PREEMPTED_EXIT_CODE)
                if ckpt_every and (done + 1) % ckpt_every == 0:
                    checkpoint.save_set(ckpt_dir, model, opt, step=done + 1)
        acc, tloss = _evaluate(model, xt, yt)
        evals.append({"epoch": epoch + 1, "step": len(records), "test_acc": acc, "test_loss": tloss})
    if bar is not None:
        bar.close()
    if preempt is not None:
        assert ckpt_dir is not None  # preempt is set only with ckpt_dir
        preempt.close()
        if records:  # the finished run is a set too: a later, longer run continues from it
            checkpoint.save_set(ckpt_dir, model, opt, step=total)
    if not records:
        raise RuntimeError(f"nothing to train: the checkpoint set in {ckpt_dir} is already at step {start} of {total}")
    metrics = summarise(cfg, records, evals, world)
    if rank == 0:
        out = Path(tc.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        plot(metrics, out / "training.png")
        print(table(metrics))
        print(f"\nwrote {out / 'metrics.json'} and {out / 'training.png'}")
    adacomp.shutdown()
    return metrics


def summarise(cfg: Any, records: list[dict[str, float]], evals: list[dict[str, float]], world: int) -> dict[str, Any]:
    warm = records[min(5, len(records) - 1):]  # skip the first steps (allocation, first contact)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in warm)
    sent = med("bytes_sent")
    dense = med("dense_bytes")
    return {
        "config": cfg.to_dict(), "world_size": world, "steps": len(records),
        "final_test_acc": evals[-1]["test_acc"], "final_test_loss": evals[-1]["test_loss"],
        "final_train_loss": statistics.mean(r["loss"] for r in records[-10:]),
        "step_ms": 1e3 * med("step_s"), "compute_ms": 1e3 * med("compute_s"),
        "compress_ms": 1e3 * med("compress_s"), "comm_ms": 1e3 * med("comm_s"),
        "bytes_per_step": sent, "dense_bytes_per_step": dense,
        "compression_ratio": dense / sent if sent else 1.0,
        "wall_s": records[-1]["wall_s"], "records": records, "evals": evals,
    }


def table(m: dict[str, Any]) -> str:
    c = m["config"]
    rows = [
        ("method", f"{c['compressor']['name']} + {c['communicator']['name']} (memory {c['memory']['name']})"),
        ("workers", str(m["world_size"])),
        ("steps", str(m["steps"])),
        ("test accuracy", f"{100 * m['final_test_acc']:.2f} %"),
        ("test loss", f"{m['final_test_loss']:.4f}"),
        ("train loss (last 10 steps)", f"{m['final_train_loss']:.4f}"),
        ("step time (median)", f"{m['step_ms']:.2f} ms"),
        ("  compute", f"{m['compute_ms']:.2f} ms"),
        ("  compress", f"{m['compress_ms']:.2f} ms"),
        ("  communicate", f"{m['comm_ms']:.2f} ms"),
        ("bytes sent per step", f"{m['bytes_per_step'] / 1024:.1f} KiB (dense {m['dense_bytes_per_step'] / 1024:.1f} KiB)"),
        ("effective compression ratio", f"{m['compression_ratio']:.1f}x"),
        ("wall time", f"{m['wall_s']:.1f} s"),
    ]
    w = max(len(k) for k, _ in rows)
    line = "+" + "-" * (w + 2) + "+" + "-" * 52 + "+"
    body = [f"| {k:<{w}} | {v:<50} |" for k, v in rows]
    return "\n".join([line, *body, line])


def plot(m: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec, ev = m["records"], m["evals"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot([r["step"] for r in rec], [r["loss"] for r in rec], lw=0.8, label="train loss (rank 0)")
    axes[0].set_xlabel("step"), axes[0].set_ylabel("loss"), axes[0].set_yscale("log"), axes[0].legend()
    axes[1].plot([e["step"] for e in ev], [100 * e["test_acc"] for e in ev], marker="o")
    axes[1].set_xlabel("step"), axes[1].set_ylabel("test accuracy (%)"), axes[1].grid(alpha=0.3)
    parts = {"compute": m["compute_ms"], "compress": m["compress_ms"], "communicate": m["comm_ms"]}
    axes[2].bar(list(parts), list(parts.values()), color=["#4c72b0", "#dd8452", "#55a868"])
    axes[2].set_ylabel("median ms per step")
    c = m["config"]
    fig.suptitle(f"{c['compressor']['name']} + {c['communicator']['name']}, {m['world_size']} workers, "
                 f"{m['compression_ratio']:.1f}x fewer bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cfg = _config(args)
    from adacomp.backends import detect
    if args.checkpoint_every < 0:
        raise SystemExit(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.worker or detect() != "local" or cfg.train.workers == 1:
        run_worker(cfg, args.checkpoint, args.checkpoint_every)
        return 0
    from adacomp.tools.launch import run_local
    cmd = [sys.executable, "-m", "adacomp.tools.train", "--worker", "--config", os.path.abspath(args.config),
           "--workers", str(cfg.train.workers), "--epochs", str(cfg.train.epochs), "--out", cfg.train.out_dir]
    if args.checkpoint:
        cmd += ["--checkpoint", os.path.abspath(args.checkpoint), "--checkpoint-every", str(args.checkpoint_every)]
    return run_local(cmd, cfg.train.workers)


if __name__ == "__main__":
    raise SystemExit(main())
