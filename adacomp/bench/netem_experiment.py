"""Emulated-network experiment: 4 hosts at 100 Mbit/s and at 1 Gbit/s per host, dense vs compressed.

One command brings the hosts up (Linux namespaces on a bridge, egress capped by tbf, docs/netem.md),
runs every arm at every bandwidth inside ONE launch (rank r in host r; rank 0 changes the cap
between phases with ``netem.set_bandwidth``), and always brings the hosts down, also on failure or
Ctrl-C. Needs root; otherwise it says so and exits 0 without measuring.

    adacomp bench netem_experiment                       # 4 hosts, 100mbit then 1gbit
    adacomp bench netem_experiment --bandwidths 20mbit --arms dense artopk

Results go to docs/results/netem.{md,csv,png} under the current directory (``--out-dir``).

Arms: dense (none + allreduce), topk 1% + allgather, topk 1% + alltoall, Ok-Topk 1% on its sparse
allreduce (oktopk + oktopk), AR-Topk (configs/artopk.yaml), ACP-SGD
(configs/acpsgd.yaml), flexible (configs/flexible.yaml) and moo (configs/moo.yaml, exploration
shortened to ``--moo-explore-steps`` real steps per candidate; measured after it finished).

Cost model check: at each bandwidth alpha and beta are measured once with
``adacomp.netmodel.NetworkProbe`` (allreduce / broadcast / allgather at 8 B and 1 MiB). Every
collective an arm issues is recorded (op, bytes) by a pass-through backend, and its predicted sync
time is the sum of the AR-Topk paper's Table I costs of those collectives. It is compared with the
measured communication time of the step (``last_stats(opt).comm_s``: time in collectives or waiting
on them that backward did not hide). The optimizer's one-float non-finite check is not timed by the
optimizer, so it is left out of the prediction as well.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from adacomp.backends.base import Backend, Handle
from adacomp.backends.forwarding import ForwardingBackend
from adacomp.bench.common import RESULTS, bench_command, last_stats, module_command, write_result
from adacomp.netem.jobs import add_role_arguments, run_on_hosts, run_role, split_argv
from adacomp.tools.stepclock import time_steps

LAUNCH = "adacomp bench netem_experiment"  # root: starts emulated hosts itself

PREFIX = "acx"  # not the user's default "acn" nor the tests' "acnt": never touches their hosts
ARMS: dict[str, dict[str, Any] | str] = {
    "dense": {"compressor": {"name": "none"}, "communicator": {"name": "allreduce"}},
    "topk_allgather": {"compressor": {"name": "topk", "density": 0.01}, "memory": {"name": "residual"},
                       "communicator": {"name": "allgather"}},
    # ByteComp's divisible scheme: each rank receives ~2 payloads per tensor instead of N-1
    "topk_alltoall": {"compressor": {"name": "topk", "density": 0.01}, "memory": {"name": "residual"},
                      "communicator": {"name": "alltoall"}},
    # Ok-Topk's sparse allreduce: each rank receives ~k pairs instead of (N-1) k
    "oktopk": {"compressor": {"name": "oktopk", "density": 0.01}, "memory": {"name": "residual"},
               "communicator": {"name": "oktopk"}},
    "artopk": "configs/artopk.yaml",
    "acpsgd": "configs/acpsgd.yaml",
    "flexible": "configs/flexible.yaml",
    "moo": "configs/moo.yaml",
}


class RecordingBackend(ForwardingBackend):
    """Passes every call to ``inner`` and records (op, bytes per rank) of each tensor collective."""

    name = "recording"

    def __init__(self, inner: Backend):
        super().__init__(inner)
        self.name = "recording"
        self.events: list[tuple[str, float]] = []

    def allreduce_async(self, tensor: torch.Tensor, average: bool = False) -> Handle:
        self.events.append(("allreduce", float(tensor.numel() * tensor.element_size())))
        return self.inner.allreduce_async(tensor, average)

    def allreduce(self, tensor: torch.Tensor, average: bool = False) -> torch.Tensor:
        if tensor.numel() == 1:  # the optimizer's untimed non-finite flag (see the module docstring)
            return self.inner.allreduce(tensor, average)
        return self.allreduce_async(tensor, average).wait()

    def allgather_async(self, tensor: torch.Tensor, sizes: list[int] | None = None,
                        out: torch.Tensor | None = None) -> Handle:
        row = tensor.numel() // max(1, tensor.shape[0]) if tensor.dim() else 1
        n = sum(sizes) / len(sizes) * row if sizes else tensor.numel()  # mean bytes per rank
        self.events.append(("allgather", float(n * tensor.element_size())))
        return self.inner.allgather_async(tensor, sizes, out)

    def alltoall_async(self, tensor: torch.Tensor, splits: list[int],
                       recv_splits: list[int] | None = None) -> Handle:
        self.events.append(("alltoall", float(tensor.numel() * tensor.element_size())))
        return self.inner.alltoall_async(tensor, splits, recv_splits)

    def broadcast_async(self, tensor: torch.Tensor, root: int = 0) -> Handle:
        self.events.append(("broadcast", float(tensor.numel() * tensor.element_size())))
        return self.inner.broadcast_async(tensor, root)


def predict(events: list[tuple[str, float]], N: int, alpha: float, beta: float) -> float:
    """Table I seconds of the recorded collectives (allreduce as ring: gloo's algorithm)."""
    from adacomp import netmodel
    from adacomp.policies.timeline import alltoall
    cost = {"allreduce": netmodel.ring_allreduce, "allgather": netmodel.allgather, "broadcast": netmodel.broadcast,
            "alltoall": alltoall}
    return sum(cost[op](nb, N, alpha, beta) for op, nb in events)


def replay(be: Backend, events: list[tuple[str, float]], repeats: int = 3) -> float:
    """Seconds to run ``events`` back to back right after a barrier (median of ``repeats``): the
    same collectives as a training step, without the compute skew between ranks."""
    # Ragged collectives (oktopk's alltoall) move different bytes per rank: replay every event at the
    # mean over the ranks, so all ranks agree on each buffer's size and on the alltoall splits.
    per_rank = be.allgather_object([nb for _, nb in events])
    sizes = [sum(col) / len(col) for col in zip(*per_rank)]
    bufs: list[torch.Tensor] = []

    def prepare() -> None:
        bufs[:] = [torch.zeros(max(1, int(nb) // 4)) for nb in sizes]
        be.barrier()

    def run_events() -> None:
        for (op, _), buf in zip(events, bufs):
            if op == "allreduce":
                be.allreduce(buf, average=True)
            elif op == "allgather":
                be.allgather(buf, sizes=[buf.numel()] * be.size())
            elif op == "alltoall":  # the same bytes, spread evenly over the ranks
                n, w = buf.numel(), be.size()
                splits = [n // w + (1 if r < n % w else 0) for r in range(w)]
                be.alltoall(buf, splits, recv_splits=[splits[be.rank()]] * w)
            else:
                be.broadcast(buf, root=0)

    return statistics.median(time_steps(run_events, repeats, sync=prepare))


def arm_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import yaml
    spec = ARMS[name]
    from adacomp.tools.advise import CONFIGS
    cfg: dict[str, Any] = (yaml.safe_load((CONFIGS / Path(spec).name).read_text()) if isinstance(spec, str)
                           else dict(spec))
    if name == "moo":
        cfg["policy"] = {**cfg["policy"], "explore_steps": args.moo_explore_steps}
    return cfg


def run_arm(name: str, be: Backend, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor,
            alpha: float, beta: float) -> dict[str, Any]:
    import adacomp
    from adacomp.models import MLP
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MLP(args.inputs, args.width, 1)
    rec = RecordingBackend(be)
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                       config=arm_config(name, args), backend=rec)
    pol: Any = opt.policy  # the policy's own attributes (plan, density, ...)
    limit = args.warmup + (6 * args.moo_explore_steps + 10 if name == "moo" else 0)
    rows: list[tuple[float, ...]] = []
    events: list[tuple[str, float]] = []
    i = 0

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    while len(rows) < args.steps:  # warm-up until the policy settled: one timed step at a time
        rec.events = []
        (dt,) = time_steps(step, 1)
        settled = not getattr(pol, "exploring", False) and (name != "moo" or bool(pol.results))
        if i >= args.warmup and (settled or i >= limit):
            st = last_stats(opt)
            rows.append((dt, st.comm_s, st.compress_s, float(st.bytes_sent), predict(rec.events, be.size(), alpha, beta)))
            events = list(rec.events)
        i += 1
    extra = ""
    if name in ("flexible", "moo"):
        flex = pol if name == "flexible" else pol.flex
        extra = ",".join(sorted(set(flex.choice.values()))) or "-"
        if name == "moo":
            extra += f" c={pol.density:.4g}"
    opt.remove_hooks()
    med = [statistics.median(r[k] for r in rows) for k in range(5)]
    return {"step_s": med[0], "comm_s": med[1], "compress_s": med[2], "bytes": med[3], "pred_s": med[4],
            "replay_s": replay(be, events), "warm_steps": i - len(rows), "note": extra}


def worker(args: argparse.Namespace) -> None:
    import adacomp
    from adacomp import netmodel
    from adacomp.netem import hosts as netem
    be = adacomp.init()
    torch.set_num_threads(1)
    rank, world = be.rank(), be.size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.inputs, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    rows = []
    for bw in args.bandwidths:
        if rank == 0:
            netem.set_bandwidth(bw, None, args.prefix)
        be.barrier()
        est = netmodel.NetworkProbe(ops=("allreduce", "broadcast", "allgather")).probe(be)
        if rank == 0:
            print(f"{bw}: alpha {1e6 * est.alpha:.0f} us, 1/beta {est.bandwidth_gbps * 1e3:.0f} Mbit/s", flush=True)
        for name in args.arms:
            r = run_arm(name, be, args, x, y, est.alpha, est.beta)
            keys = ("step_s", "comm_s", "compress_s", "bytes", "pred_s", "replay_s")
            mine = torch.tensor([r[k] for k in keys], dtype=torch.float64)
            every = be.allgather(mine.view(1, -1), sizes=[1] * world).view(world, -1)
            slow = every[int(every[:, 0].argmax())]
            row = {"bandwidth": bw, "arm": name, "step_ms": 1e3 * float(slow[0]), "comm_ms": 1e3 * float(slow[1]),
                   "compress_ms": 1e3 * float(slow[2]), "kib_per_step": float(every[:, 3].mean()) / 1024,
                   "pred_comm_ms": 1e3 * float(every[:, 4].max()), "replay_ms": 1e3 * float(every[:, 5].max()),
                   "alpha_us": 1e6 * est.alpha, "probe_mbit": est.bandwidth_gbps * 1e3, "note": r["note"]}
            rows.append(row)
            if rank == 0:
                print(f"  {name:<15} step {row['step_ms']:8.1f} ms  comm {row['comm_ms']:8.1f} ms  predicted "
                      f"{row['pred_comm_ms']:8.1f} ms  replayed {row['replay_ms']:8.1f} ms  "
                      f"{row['kib_per_step']:8.1f} KiB  {row['note']}", flush=True)
    if rank == 0:
        report(rows, args, world)
    be.barrier()
    adacomp.shutdown()


def _error_pct(predicted: float, measured: float) -> float:
    return 100 * (predicted - measured) / measured if measured > 0 else float("nan")


def report(rows: list[dict[str, Any]], args: argparse.Namespace, world: int) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for bw in args.bandwidths:
        dense = next((r for r in rows if r["bandwidth"] == bw and r["arm"] == "dense"), None)
        for r in rows:
            if r["bandwidth"] == bw:
                r["speedup"] = dense["step_ms"] / r["step_ms"] if dense else float("nan")
                r["pred_error_pct"] = _error_pct(r["pred_comm_ms"], r["comm_ms"])
                r["replay_error_pct"] = _error_pct(r["pred_comm_ms"], r["replay_ms"])
    fields = ["bandwidth", "arm", "step_ms", "speedup", "comm_ms", "pred_comm_ms", "pred_error_pct", "replay_ms",
              "replay_error_pct", "compress_ms",
              "kib_per_step", "alpha_us", "probe_mbit", "note"]
    with open(out / "netem.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in fields})
    plot(rows, args.bandwidths, out / "netem.png")
    nparams = args.inputs * args.width + args.width + args.width * 10 + 10
    lines = [f"{world} emulated hosts (network namespaces on a bridge, egress of each capped with tbf; one worker "
             f"per host; gloo over the emulated links). MLP {args.inputs}-{args.width}-10 ({nparams / 1e6:.2f}M "
             f"parameters, {4 * nparams / 2**20:.1f} MiB of fp32 gradients), batch {args.batch}, median of "
             f"{args.steps} steps after warm-up, slowest host. 4 workers share 2 CPU cores, so compute is slow "
             "and noisy; the network part is what this table is about.",
             "Speedup = dense step time / arm step time at the same bandwidth. Predicted comm = Table I cost "
             "(adacomp.netmodel) of every collective the arm issued, with alpha / beta probed at that "
             "bandwidth; error = (predicted - measured) / measured. Two measurements: `comm` is the step's own "
             "communication time (in or waiting on collectives, not hidden by backward), which also contains "
             "waiting for the slowest rank to arrive (4 workers on 2 shared cores; AR-Topk's broadcast also waits "
             "for the root's Top-k); `replayed` runs the same collectives of one step back to back after a barrier, "
             "i.e. the network part alone, which is what the alpha-beta model describes.", "",
             "![netem](netem.png)", "",
             "| bandwidth | arm | step ms | speedup | comm ms | replayed ms | predicted ms | error vs comm | "
             "error vs replayed | KiB/step | probe: alpha us, Mbit/s | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bandwidth']} | {r['arm']} | {r['step_ms']:.1f} | {r['speedup']:.2f}x | {r['comm_ms']:.1f} | "
                     f"{r['replay_ms']:.1f} | {r['pred_comm_ms']:.1f} | {r['pred_error_pct']:+.0f}% | "
                     f"{r['replay_error_pct']:+.0f}% | {r['kib_per_step']:.0f} | "
                     f"{r['alpha_us']:.0f}, {r['probe_mbit']:.0f} | {r['note']} |")
    errs = [abs(r["pred_error_pct"]) for r in rows if r["pred_error_pct"] == r["pred_error_pct"]]
    rerrs = [abs(r["replay_error_pct"]) for r in rows if r["replay_error_pct"] == r["replay_error_pct"]]
    if errs and rerrs:
        lines += ["", f"Median |prediction error|: {statistics.median(rerrs):.0f}% against the replayed collectives, "
                  f"{statistics.median(errs):.0f}% against the in-step communication time."]
    # The header names the one command that did all this (not the per-host worker command line).
    write_result(out / "netem.md", "Emulated network: compression vs dense at 100 Mbit/s and 1 Gbit/s", lines,
                 bench_command("netem_experiment", args.argv, drop=("--worker",)),
                 self_launched=True)


def plot(rows: list[dict[str, Any]], bandwidths: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(bandwidths)
    for j, bw in enumerate(bandwidths):
        sub = {r["arm"]: r for r in rows if r["bandwidth"] == bw}
        xs = [i + j * width for i in range(len(arms))]
        axes[0].bar(xs, [sub[a]["step_ms"] if a in sub else 0 for a in arms], width, label=f"{bw} step", alpha=0.5)
        axes[0].bar(xs, [sub[a]["comm_ms"] if a in sub else 0 for a in arms], width * 0.5, label=f"{bw} comm")
        for x_, a in zip(xs, arms):
            if a in sub:
                axes[0].text(x_, sub[a]["step_ms"], f"{sub[a]['speedup']:.1f}x", ha="center", va="bottom", fontsize=7)
        c = axes[1].scatter([sub[a]["replay_ms"] for a in sub], [sub[a]["pred_comm_ms"] for a in sub],
                            label=f"{bw} replayed").get_facecolor()
        axes[1].scatter([sub[a]["comm_ms"] for a in sub], [sub[a]["pred_comm_ms"] for a in sub], facecolors="none",
                        edgecolors=c, label=f"{bw} in-step comm")
        for a in sub:
            axes[1].annotate(a, (sub[a]["replay_ms"], sub[a]["pred_comm_ms"]), fontsize=6)
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(arms))], arms, rotation=20, fontsize=8)
    axes[0].set_yscale("log"), axes[0].set_ylabel("ms per step (label: speedup over dense)"), axes[0].legend(fontsize=7)
    vals = [r[k] for r in rows for k in ("comm_ms", "replay_ms", "pred_comm_ms") if r[k] > 0]
    lim = [min(vals) * 0.5, max(vals) * 2]
    axes[1].plot(lim, lim, "k--", lw=0.8)
    axes[1].set_xscale("log"), axes[1].set_yscale("log")
    axes[1].set_xlabel("measured ms"), axes[1].set_ylabel("Table I prediction ms"), axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def drive(args: argparse.Namespace, worker_argv: list[str]) -> int:
    return run_on_hosts(module_command("netem_experiment"), args.hosts, args.bandwidths[0], args.prefix, worker_argv)


def main(argv: list[str] | None = None) -> int:
    own, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser(prog="adacomp bench netem_experiment", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bandwidths", nargs="+", default=["100mbit", "1gbit"])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--inputs", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="measured steps per arm and bandwidth")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--moo-explore-steps", type=int, default=3, help="moo: real steps per candidate density")
    ap.add_argument("--prefix", default=PREFIX, help="name prefix of the emulated hosts")
    ap.add_argument("--out-dir", default=RESULTS, help="relative to the current directory (default: %(default)s)")
    add_role_arguments(ap)
    args = ap.parse_args(own)
    args.argv = own
    return run_role(args, rest, lambda: worker(args), lambda: drive(args, own))


if __name__ == "__main__":
    raise SystemExit(main())
