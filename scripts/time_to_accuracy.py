#!/usr/bin/env python
"""Time to accuracy on real data over emulated links: DDP fp32 / bf16 / PowerSGD vs adacomp's methods.

4 emulated hosts (``adacomp netem``: network namespaces on a bridge, egress capped by tbf, one
worker per host, gloo over the capped links; docs/netem.md) at each bandwidth in ``--bandwidths``.
Two tasks on real data read offline:

* ``fmnist``: a CNN (2 conv + 2 linear, ~0.45M parameters) on Fashion-MNIST (Debian package
  ``dataset-fashion-mnist``) until the test accuracy reaches ``--acc-target``;
* ``text``: a character LSTM on Debian's ``fortunes`` corpus (~2.5 MB) until the test loss
  (nats / character) falls to ``--loss-target``.

Arms: ``ddp_fp32``, ``ddp_bf16`` (bf16 hook: torch's own refuses gloo / CPU, adacomp.tools.baselines),
``ddp_powersgd`` (torch's PowerSGD hook), and adacomp's methods from ``configs/<name>.yaml``
under ``adacomp.DistributedOptimizer``. Every arm starts from the same weights and sees the same
batches. The clock counts training only: evaluation (every ``--eval-every`` steps, each host
scores a slice of the test set) is paused out, and the time is the slowest host's.

    python scripts/time_to_accuracy.py                   # reduced size (~13 min on 2 shared cores)
    python scripts/time_to_accuracy.py --size medium     # every method, all the data, a few epochs (~1-2 h)
    python scripts/time_to_accuracy.py --size full       # every method, until convergence (many hours)

Needs root (namespaces); without it the script says so and measures nothing (exit 0).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PREFIX = "actta"
DDP_ARMS = ("ddp_fp32", "ddp_bf16", "ddp_powersgd")
ADACOMP_ARMS = ("topk", "dgc", "gaussiank", "adtopk", "qsgd", "powersgd", "acpsgd", "artopk", "flexible", "moo",
                "lgreco", "bytecomp")
SIZES: dict[str, dict[str, Any]] = {
    # reduced: what `make results` runs on 2 shared cores; full: the experiment
    "reduced": {"arms": ["ddp_fp32", "ddp_bf16", "ddp_powersgd", "topk", "powersgd", "acpsgd"],
                "max_seconds": 45.0, "train_limit": 20000, "test_limit": 2000, "text_windows": 8000,
                "text_test": 512,
                "acc_target": 0.78, "loss_target": 2.5},
    # medium: every method on all the data for a few epochs, to targets 2 cores reach within minutes per arm
    "medium": {"arms": list(DDP_ARMS + ADACOMP_ARMS), "max_seconds": 180.0, "train_limit": None, "test_limit": None,
               "text_windows": None, "text_test": 2000, "acc_target": 0.85, "loss_target": 2.2},
    "full": {"arms": list(DDP_ARMS + ADACOMP_ARMS), "max_seconds": 1800.0, "train_limit": None, "test_limit": None,
             "text_windows": None, "text_test": None, "acc_target": 0.90, "loss_target": 1.6},
}


class FashionCNN(nn.Module):
    """conv 5x5 (32) - pool - conv 5x5 (64) - pool - fc 128 - fc 10 for 28x28 images (~0.45M parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


@dataclass
class Task:
    """Data, model and metric of one task. ``higher``: the metric must rise to the target (accuracy)."""

    name: str
    x: torch.Tensor
    y: torch.Tensor
    xt: torch.Tensor
    yt: torch.Tensor
    build: Callable[[], nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metric_name: str
    target: float
    higher: bool
    lr: float
    batch: int


def seq_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make_tasks(args: argparse.Namespace) -> list[Task]:
    from adacomp.datasets.digits import fashion_mnist
    from adacomp.datasets.text import char_sequences
    from adacomp.models import CharLSTM
    tasks = []
    if "fmnist" in args.tasks:
        x, y, xt, yt = fashion_mnist(train_limit=args.train_limit, test_limit=args.test_limit)
        tasks.append(Task("fmnist", x, y, xt, yt, FashionCNN, F.cross_entropy, "test accuracy", args.acc_target,
                          True, 0.05, 32))
    if "text" in args.tasks:
        x, y, xt, yt, corpus = char_sequences(32, source="fortunes")
        if args.text_windows:
            x, y = x[:args.text_windows], y[:args.text_windows]
        xt, yt = xt[:args.text_test], yt[:args.text_test]  # evaluation wall time: a fixed slice of held-out text
        vocab = len(corpus.vocab)
        tasks.append(Task("text", x, y, xt, yt, lambda: CharLSTM(vocab, 32, 256), seq_loss, "test loss (nats/char)",
                          args.loss_target, False, 3e-3, 32))
    return tasks


def evaluate(model: nn.Module, task: Task, rank: int, world: int) -> float:
    """Metric over the whole test set, each host scoring every world-th sample (one small allreduce)."""
    import torch.distributed as dist
    model.eval()
    with torch.no_grad():
        xt, yt = task.xt[rank::world], task.yt[rank::world]
        s = torch.zeros(3, dtype=torch.float64)
        for i in range(0, len(xt), 500):
            out = model(xt[i:i + 500])
            s[0] += float((out.argmax(-1) == yt[i:i + 500]).sum()) if task.higher else \
                float(seq_loss(out, yt[i:i + 500])) * yt[i:i + 500].numel()
            s[1] += yt[i:i + 500].numel()
    model.train()
    dist.all_reduce(s)
    return float(s[0] / s[1])


def ddp_bytes(name: str, model: nn.Module, step: int) -> int:
    """Payload bytes one host puts into the collectives per step for a DDP baseline (not measured by
    DDP): fp32 4 B / element, bf16 2 B; PowerSGD rank 1: (rows + cols) x 4 B per matrix that it
    compresses (torch's rule: (n + m) r < n m / 2), the rest dense, and dense for the first 2 steps."""
    total = 0
    for p in model.parameters():
        n = p.numel()
        if name == "ddp_bf16":
            total += 2 * n
        elif name == "ddp_powersgd" and step >= 2 and p.dim() > 1:
            rows = p.shape[0]
            cols = n // rows
            total += 4 * (rows + cols) if (rows + cols) * 2 < rows * cols else 4 * n
        else:
            total += 4 * n
    return total


def train_arm(arm: str, task: Task, be: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    import yaml
    import adacomp
    from adacomp.tools.baselines import BASELINES, ddp_baseline
    from adacomp.datasets.digits import shard
    rank, world = be.rank(), be.size()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = task.build()
    cfg = {} if arm in BASELINES else yaml.safe_load((ROOT / "configs" / f"{arm}.yaml").read_text())
    train_cfg = cfg.pop("train", None) or {}
    # SGD with momentum 0.9 for the CNN (0 where the method applies it itself: DGC's memory, §3.2); Adam for
    # the LSTM (plain SGD sat on the unigram plateau for 100s of steps)
    base = (torch.optim.SGD(model.parameters(), lr=task.lr, momentum=train_cfg.get("momentum", 0.9)) if task.higher
            else torch.optim.Adam(model.parameters(), lr=task.lr))
    opt: Any
    if arm in BASELINES:
        net, opt = ddp_baseline(arm, model), base
    else:
        net, opt = model, adacomp.DistributedOptimizer(base, model.named_parameters(), config=cfg, backend=be)
        opt.steps_per_epoch = len(task.y) // world // task.batch  # lgreco decides once per epoch
    clock, step, nbytes, curve = 0.0, 0, 0, []
    reached: float | None = None
    epoch = 0
    done = False
    while not done and epoch < args.max_epochs:
        idx = shard(len(task.y), rank, world, epoch)
        for i in range(0, len(idx) - task.batch + 1, task.batch):
            b = idx[i:i + task.batch]
            t0 = time.perf_counter()
            opt.zero_grad()
            task.loss(net(task.x[b]), task.y[b]).backward()
            opt.step()
            clock += time.perf_counter() - t0
            nbytes += ddp_bytes(arm, model, step) if arm in BASELINES else int(opt.last_stats.bytes_sent)
            step += 1
            if step % args.eval_every == 0:
                t = torch.tensor([clock], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest host's clock
                metric = evaluate(model, task, rank, world)
                curve.append((float(t[0]), step, metric))
                ok = metric >= task.target if task.higher else metric <= task.target
                if ok and reached is None:
                    reached = float(t[0])
                if ok or float(t[0]) >= args.max_seconds:
                    done = True
                    break
        epoch += 1
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return {"arm": arm, "task": task.name, "time_to_target_s": reached, "final": curve[-1][2] if curve else None,
            "steps": step, "train_s": curve[-1][0] if curve else clock, "mib_per_host": nbytes / 2**20,
            "curve": curve, "epochs": epoch, "metric_name": task.metric_name, "target": task.target,
            "higher": task.higher, "train_images": len(task.y)}


def worker(args: argparse.Namespace) -> None:
    import adacomp
    from adacomp import netmodel
    from adacomp.netem import hosts as netem
    from _bench_util import ensure_torch_group
    be = adacomp.init()
    ensure_torch_group()
    torch.set_num_threads(1)
    rank = be.rank()
    tasks = make_tasks(args)
    rows = []
    for bw in args.bandwidths:
        if rank == 0:
            netem.set_bandwidth(bw, None, args.prefix)
        be.barrier()
        est = netmodel.NetworkProbe(ops=("allreduce", "broadcast")).probe(be)
        for task in tasks:
            for arm in args.arms:
                r = train_arm(arm, task, be, args)
                r.update(bandwidth=bw, probe_mbit=est.bandwidth_gbps * 1e3, alpha_us=est.alpha * 1e6, size=args.size,
                         command=" ".join(["python", os.path.relpath(__file__, ROOT),
                                           *[a for a in sys.argv[1:] if a != "--worker"]]))
                rows.append(r)
                if rank == 0:
                    tt = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] is not None else "not reached"
                    print(f"{bw} {task.name:<6} {arm:<13} target {tt:<12} final {r['final']:.4f} after {r['steps']} "
                          f"steps / {r['train_s']:.1f} s, {r['mib_per_host']:.1f} MiB/host", flush=True)
    if rank == 0:
        report(rows, args)
    be.barrier()
    adacomp.shutdown()


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with every (task, bandwidth, arm) that ``new`` measured replaced: tasks and links can be
    run as separate jobs (``--merge``) and reported together."""
    key = lambda r: (r["task"], r["bandwidth"], r["arm"])  # noqa: E731
    fresh = {key(r) for r in new}
    return [r for r in old if key(r) not in fresh] + new


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from _bench_util import write_result
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "time_to_accuracy.json"
    if args.merge and path.exists():
        rows = merge_rows([r for r in json.loads(path.read_text()) if "target" in r], rows)
    path.write_text(json.dumps(rows, indent=1))
    plot(rows, out / "time_to_accuracy.png")
    size = SIZES[args.size]
    fm = next((r for r in rows if r["task"] == "fmnist"), None)
    tx = next((r for r in rows if r["task"] == "text"), None)
    lines = [f"Size `{args.size}`: Fashion-MNIST {fm['train_images'] if fm else '-'} training images, text "
             f"{tx['train_images'] if tx else '-'} training windows of Debian's fortunes; each arm "
             f"stops at the target or after {args.max_seconds:.0f} s of training clock (`not reached` then). ", ""]
    if args.size != "full":
        full = SIZES["full"]
        lines[0] += (f"Not the full experiment (`--size full`: all 60,000 images, targets {full['acc_target']} / "
                     f"{full['loss_target']}, up to {full['max_seconds'] / 60:.0f} min per arm: hours per arm on 2 "
                     "cores); " + ("the reduced size fits `make results`." if args.size == "reduced" else
                                   f"`{args.size}` keeps all the data and every method but lower targets "
                                   f"({size['acc_target']} / {size['loss_target']})."))
    commands = list(dict.fromkeys(r["command"] for r in rows if "command" in r))
    if commands:
        lines += ["Rows measured by: " + "; ".join(f"`{c}`" for c in commands) + ".", ""]
    lines += [f"{args.hosts} emulated hosts (`adacomp netem`: namespaces + tbf egress cap, gloo over the capped links), "
              "one worker per host; the 4 workers share 2 CPU cores (with other jobs), so compute is slow and noisy. "
              "Clock: training only (evaluation paused out), slowest host. Same initial weights and batches per arm. "
              "`MiB/host`: payload bytes each host put into collectives (DDP: computed from the bucket sizes, "
              "adacomp: measured). `ddp_bf16` is a 3-line hook with the rounding of torch's `bf16_compress_hook` "
              "(which refuses gloo / CPU in torch 2.13); `ddp_powersgd` is torch's own `powerSGD_hook` (rank 1).", "",
              "![time to accuracy](time_to_accuracy.png)", ""]
    for tname, bw in dict.fromkeys((r["task"], r["bandwidth"]) for r in rows):
        sub = [r for r in rows if r["task"] == tname and r["bandwidth"] == bw]
        bf = next((r for r in sub if r["arm"] == "ddp_bf16"), None)
        s0 = sub[0]
        lines += [f"### {tname} at {bw} (probe: {s0['probe_mbit']:.0f} Mbit/s, alpha {s0['alpha_us']:.0f} us); "
                  f"target {s0['metric_name']} {'>=' if s0['higher'] else '<='} {s0['target']}; size "
                  f"`{s0.get('size', args.size)}`, {s0['train_images']} training samples", "",
                  "| arm | time to target s | vs ddp_bf16 | metric at stop | steps | epochs | train s | MiB/host |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sub:
            tt = r["time_to_target_s"]
            rel = f"{bf['time_to_target_s'] / tt:.2f}x" if bf and bf["time_to_target_s"] and tt else "-"
            lines.append(f"| {r['arm']} | {f'{tt:.1f}' if tt is not None else 'not reached'} | {rel} | "
                         f"{r['final']:.4f} | {r['steps']} | {r['epochs']} | {r['train_s']:.1f} | "
                         f"{r['mib_per_host']:.1f} |")
        lines.append("")
    lines.append("`vs ddp_bf16` = bf16 time to target / arm time to target (> 1: the arm is faster); `epochs`: "
                 "epochs begun.")
    sys.argv = [os.path.relpath(__file__)] + [a for a in sys.argv[1:] if a != "--worker"]
    os.environ.pop("ADACOMP_BACKEND", None)
    write_result(str(out / "time_to_accuracy.md"), "Time to accuracy on real data: compression vs DDP fp32 / bf16 "
                 "over emulated links", lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = list(dict.fromkeys((r["task"], r["bandwidth"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (tname, bw) in zip(axes[0], panels):
        sub = [r for r in rows if (r["task"], r["bandwidth"]) == (tname, bw)]
        for r in sub:
            if r["curve"]:
                ts, _, ms = zip(*r["curve"])
                ax.plot(ts, ms, label=r["arm"], lw=2.2 if r["arm"].startswith("ddp") else 1.2,
                        ls="-" if r["arm"].startswith("ddp") else "--")
        ax.axhline(sub[0]["target"], color="k", lw=0.7, ls=":")
        ax.set_title(f"{tname} @ {bw}"), ax.set_xlabel("training wall-clock s (slowest host)")
        ax.set_ylabel(sub[0]["metric_name"])
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def drive(args: argparse.Namespace, worker_argv: list[str]) -> int:
    from adacomp.netem.jobs import run_on_hosts
    return run_on_hosts(__file__, args.hosts, args.bandwidths[0], args.prefix, worker_argv, prepare=lambda: make_tasks(argparse.Namespace(**{**vars(args), "tasks": args.tasks})))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="reduced")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bandwidths", nargs="+", default=["100mbit", "1gbit"])
    ap.add_argument("--tasks", nargs="+", default=["fmnist", "text"], choices=["fmnist", "text"])
    ap.add_argument("--arms", nargs="+", choices=list(DDP_ARMS + ADACOMP_ARMS))
    ap.add_argument("--max-seconds", type=float, help="training clock limit per arm")
    ap.add_argument("--max-epochs", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--acc-target", type=float)
    ap.add_argument("--loss-target", type=float)
    ap.add_argument("--merge", action="store_true", help="keep the rows of time_to_accuracy.json that this run "
                    "does not re-measure (run tasks / links as separate jobs)")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from time_to_accuracy.json, "
                    "measuring nothing")
    ap.add_argument("--prefix", default=PREFIX)
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--in-host", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--master-addr", help=argparse.SUPPRESS)
    args = ap.parse_args(own)
    size = SIZES[args.size]
    args.arms = args.arms or size["arms"]
    args.max_seconds = args.max_seconds or size["max_seconds"]
    args.acc_target = args.acc_target or size["acc_target"]
    args.loss_target = args.loss_target or size["loss_target"]
    args.train_limit, args.test_limit, args.text_windows = size["train_limit"], size["test_limit"], size["text_windows"]
    args.text_test = size["text_test"]
    if args.report_only:
        args.merge = True
        report([], args)
        return 0
    if args.in_host:
        from adacomp.netem.jobs import exec_in_host
        return exec_in_host(args.hosts, args.master_addr, args.prefix, rest)
    if args.worker:
        worker(args)
        return 0
    return drive(args, own)


if __name__ == "__main__":
    raise SystemExit(main())
