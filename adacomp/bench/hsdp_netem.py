"""HSDP over a capped inter-host link: step time, cross-host bytes and time to target of a GPT-2-like
model, FSDP2's own bf16 reduction against adacomp's compression and local steps on the replicate
dimension.

2 emulated hosts (``adacomp netem``: network namespaces on a bridge, each host's egress capped by
tbf) with 2 ranks each: a 2 x 2 mesh, FSDP2 shards inside a host (its ranks talk over the host's
loopback, uncapped) and replicates across hosts (every replicate-dimension byte crosses the capped
link). The task is time_to_accuracy's ``lm``: the 12.5M-parameter transformer on Debian's fortunes,
AdamW with a 5-step warm-up, 4 windows of 64 characters per host and step (2 per rank), until the
held-out loss reaches ``--target`` nats / character. Arms (``--arms``):

* ``hsdp_bf16``: native HSDP (``fully_shard`` over the 2-D mesh) with FSDP2's
  ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``: the baseline, bf16 on the wire;
* ``hsdp_fp32``: native HSDP, fp32 reduction;
* ``hsdp_topk``: FSDP2 over the shard mesh, adacomp Top-k 1 % with residual memory on the replicate
  all-reduce of every shard (``adacomp.fsdp.register(..., replicate_group=)``);
* ``hsdp_diloco`` / ``hsdp_sparseloco``: FSDP2 over the shard mesh, no per-step cross-host traffic;
  every H steps the outer loop of configs/diloco.yaml / sparseloco.yaml on the shards
  (``register(..., optimizer=)``, :mod:`adacomp.engine.fsdp_local`).

Bytes are *measured*: the transmit counter of each host's capped interface (``tx_bytes`` in the
namespace's sysfs) over an arm's training, evaluation paused out, so they include every header and
the clock's and evaluation's tiny all-reduces. The clock counts training only (the slowest rank's).

    adacomp bench hsdp_netem                          # 100mbit, 4 arms, ~25 min on 2 shared cores
    adacomp bench hsdp_netem --size tiny --max-seconds 2   # plumbing (tests)

Needs root; without it nothing is measured (exit 0). Writes docs/results/hsdp_netem.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from adacomp.bench.common import RESULTS, bench_command, ensure_torch_group, module_command, write_result
from adacomp.netem.jobs import add_role_arguments, run_on_hosts, run_role, split_argv

LAUNCH = "adacomp bench hsdp_netem"  # root: starts 2 emulated hosts x 2 ranks itself
PREFIX = "achs"
TOPK = {"compressor": {"name": "topk", "density": 0.01}, "memory": {"name": "residual"},
        "communicator": {"name": "allgather"}, "min_numel": 1024}
ARMS = ("hsdp_bf16", "hsdp_fp32", "hsdp_topk", "hsdp_diloco", "hsdp_sparseloco")
DEFAULT_ARMS = ("hsdp_bf16", "hsdp_topk", "hsdp_diloco", "hsdp_sparseloco")


def _config(arm: str, every: int) -> dict[str, Any] | None:
    """adacomp's config of an arm (None: native HSDP)."""
    import yaml

    from adacomp.tools.advise import CONFIGS
    if arm == "hsdp_topk":
        return dict(TOPK)
    if arm in ("hsdp_diloco", "hsdp_sparseloco"):
        cfg = yaml.safe_load((CONFIGS / f"{arm.split('_', 1)[1]}.yaml").read_text())
        cfg["local_steps"]["every"] = every
        return cfg
    return None


def _tx_bytes(eth: str) -> int:
    """Bytes this rank's host has sent over its capped interface (the namespace's own sysfs)."""
    return int(Path(f"/sys/class/net/{eth}/statistics/tx_bytes").read_text())


def _sent(state: Any) -> int:
    """adacomp's payload of the last step on this rank (0 for native HSDP)."""
    if state is None:
        return 0
    if hasattr(state, "units"):  # per-step compression: one round per FSDP unit
        return sum(int(u.state.last_stats.bytes_sent) for u in state.units.values()
                   if u.state is not None and u.state.last_stats is not None)
    return int(state.last_stats.bytes_sent) if state.last_stats is not None else 0


def train_arm(arm: str, task: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import adacomp.fsdp
    from adacomp.bench.time_to_accuracy import evaluate, make_optimizer
    from adacomp.datasets.digits import shard
    from adacomp.netem import hosts as netem
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts, per_host = world // args.per_host, args.per_host
    mesh = init_device_mesh("cpu", (hosts, per_host), mesh_dim_names=("replicate", "shard"))  # host = rank // per_host
    cfg = _config(arm, task.local_every)
    local = bool(cfg and cfg.get("local_steps"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = task.build()
    native = cfg is None
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if arm == "hsdp_bf16" else MixedPrecisionPolicy()
    target = mesh if native else mesh["shard"]
    for block in model.h:
        fully_shard(block, mesh=target, mp_policy=mp)
    fully_shard(model, mesh=target, mp_policy=mp)
    opt = make_optimizer(task, model, {})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(task.warmup, 1)))
    state = None
    if not native:
        state = adacomp.fsdp.register(model, cfg, replicate_group=mesh["replicate"].get_group(),
                                      optimizer=opt if local else None)
    batch = task.batch // per_host  # the host's windows split over its ranks
    eval_every = -(-task.eval_every // task.local_every) * task.local_every if local else task.eval_every
    eth = netem.interface(args.prefix)
    clock, step, sent, payload, curve, times = 0.0, 0, 0, 0, [], []
    reached: float | None = None
    epoch, done = 0, False
    while not done and epoch < args.max_epochs:
        idx = shard(len(task.y), rank, world, epoch)
        for i in range(0, len(idx) - batch + 1, batch):
            b = idx[i:i + batch]
            dist.barrier()  # the arms' steps start together: a rank's clock is its own step's
            tx0 = _tx_bytes(eth)
            t0 = time.perf_counter()
            opt.zero_grad()
            task.loss(model(task.x[b]), task.y[b]).backward()
            opt.step()
            sched.step()
            times.append(time.perf_counter() - t0)
            clock += times[-1]
            sent += _tx_bytes(eth) - tx0  # the host's, counted by each of its ranks over the same span
            payload += _sent(state)
            step += 1
            if step % eval_every == 0:
                t = torch.tensor([clock], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                metric = evaluate(model, task, rank, world)
                curve.append((float(t[0]), step, metric))
                if metric <= task.target and reached is None:
                    reached = float(t[0])
                if metric <= task.target or float(t[0]) >= task.max_seconds:
                    done = True
                    break
        epoch += 1
    agg = torch.tensor([statistics.median(times), float(sent), float(payload)], dtype=torch.float64)
    dist.all_reduce(agg, op=dist.ReduceOp.MAX)
    params = sum(p.numel() for p in model.parameters())
    row = {"arm": arm, "time_to_target_s": reached, "final": curve[-1][2] if curve else None, "steps": step,
           "train_s": curve[-1][0] if curve else clock, "step_median_s": float(agg[0]),
           "cross_host_mib_per_host": float(agg[1]) / 2**20, "cross_host_kib_per_step": float(agg[1]) / 2**10 / max(step, 1),
           "adacomp_payload_mib_per_rank": float(agg[2]) / 2**20, "curve": curve, "params": params,
           "target": task.target, "eval_every": eval_every, "local_every": task.local_every if local else None,
           "hosts": hosts, "per_host": per_host, "batch_per_host": task.batch, "context": task.context,
           "max_seconds": task.max_seconds}
    if not native and payload <= 0:
        raise RuntimeError(f"{arm}: adacomp sent nothing in {step} steps: the compression path did not run")
    if local and row["cross_host_mib_per_host"] <= 0:
        raise RuntimeError(f"{arm}: no byte crossed the link in {step} steps: no synchronisation happened")
    return row


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import adacomp
    from adacomp.bench.time_to_accuracy import make_tasks
    from adacomp.netem import hosts as netem
    adacomp.init()
    ensure_torch_group()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if dist.get_world_size() % args.per_host:
        raise SystemExit(f"adacomp bench hsdp_netem: {dist.get_world_size()} ranks do not fill hosts of {args.per_host}")
    task = make_tasks(argparse.Namespace(tasks=["lm"], size=args.size, local_every=args.local_every, arms=None,
                                         max_seconds=args.max_seconds, lm_target=args.target,
                                         lm_eval_every=args.eval_every))[0]
    rows = []
    for bw in args.bandwidths:
        if rank == 0:
            netem.set_bandwidth(bw, None, args.prefix)
        dist.barrier()
        for arm in args.arms:
            row = train_arm(arm, task, args)
            row.update(bandwidth=bw, size=args.size, command=bench_command("hsdp_netem", args.argv, drop=("--worker",)))
            rows.append(row)
            if rank == 0:
                tt = f"{row['time_to_target_s']:.1f} s" if row["time_to_target_s"] is not None else "not reached"
                print(f"{bw} {arm:<16} target {tt:<12} final {row['final']:.4f} after {row['steps']} steps / "
                      f"{row['train_s']:.1f} s; step {row['step_median_s']:.3f} s; cross-host "
                      f"{row['cross_host_mib_per_host']:.1f} MiB/host", flush=True)
    if rank == 0:
        report(rows, args)
    dist.barrier()
    adacomp.shutdown()


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hsdp_netem.json").write_text(json.dumps(rows, indent=1))
    first = rows[0]
    lines = [f"GPT-2-like transformer ({first['params'] / 1e6:.2f}M parameters, context {first['context']}) on "
             f"Debian's fortunes text; {first['hosts']} emulated hosts x {first['per_host']} ranks (2-D mesh: FSDP2 "
             f"shards inside a host over its loopback, replicates across hosts over the capped link); "
             f"{first['batch_per_host']} windows per host and step; AdamW; target: held-out loss <= {first['target']} "
             f"nats/char, at most {first['max_seconds']:.0f} s of training per arm. Cross-host bytes: the host "
             "interface's transmit counter (measured, headers included). Step: the slowest rank's median.", ""]
    for bw in dict.fromkeys(r["bandwidth"] for r in rows):
        sub = [r for r in rows if r["bandwidth"] == bw]
        base = next((r for r in sub if r["arm"] == "hsdp_bf16"), sub[0])
        lines += [f"### {bw}", "",
                  f"| arm | step (s), median | mean step (s) | vs {base['arm']} (mean) | cross-host KiB / step / host | "
                  f"bytes vs {base['arm']} | cross-host MiB / host, whole run | time to target (s) | vs {base['arm']} | steps | "
                  "final loss |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sub:
            name = r["arm"] + (f" (H={r['local_every']})" if r["local_every"] else "")
            tt, btt = r["time_to_target_s"], base["time_to_target_s"]
            speed = ("-" if r is base else
                     (f"{btt / tt:.2f}x sooner" if btt >= tt else f"{tt / btt:.2f}x later") if tt and btt else
                     f">= {base['train_s'] / tt:.2f}x sooner" if tt else "not reached")
            mean, bmean = r["train_s"] / max(r["steps"], 1), base["train_s"] / max(base["steps"], 1)
            kib, bkib = r["cross_host_kib_per_step"], base["cross_host_kib_per_step"]
            fewer = "-" if r is base else (f"{bkib / kib:.1f}x fewer" if kib and bkib >= kib else
                                           f"{kib / bkib:.2f}x more" if bkib else "?")
            lines.append(f"| {name} | {r['step_median_s']:.3f} | {mean:.3f} | {mean / bmean:.2f}x | {kib:.0f} | {fewer} | "
                         f"{r['cross_host_mib_per_host']:.1f} | {f'{tt:.1f}' if tt else 'not reached'} | {speed} | {r['steps']} | {r['final']:.3f} |")
        lines.append("")
    plot(rows, out / "hsdp_netem.png")
    lines += ["![held-out loss against training time](hsdp_netem.png)", ""]
    write_result(out / "hsdp_netem.md", "HSDP over a capped inter-host link", lines, first["command"], self_launched=True)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Held-out loss against the training clock, one panel per link, the target dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = list(dict.fromkeys(r["bandwidth"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4), squeeze=False)
    for ax, bw in zip(axes[0], links):
        for r in (r for r in rows if r["bandwidth"] == bw):
            if r["curve"]:
                t, _, m = zip(*r["curve"])
                ax.plot(t, m, marker=".", label=f"{r['arm']} ({r['cross_host_mib_per_host']:.1f} MiB/host)")
        ax.axhline(rows[0]["target"], color="grey", linestyle="--", linewidth=1)
        ax.set(title=f"HSDP, 2 hosts x 2 ranks, {bw}", xlabel="training time (s)", ylabel="held-out loss (nats/char)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    own, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser(prog="adacomp bench hsdp_netem", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--size", choices=["reduced", "tiny"], default="reduced",
                    help="the lm task's size (tiny: a 2-layer model on a few hundred windows, for tests)")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=2, help="ranks per emulated host (the shard dimension)")
    ap.add_argument("--bandwidths", nargs="+", default=["100mbit"])
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(DEFAULT_ARMS))
    ap.add_argument("--max-seconds", type=float, default=300.0, help="training clock limit per arm")
    ap.add_argument("--max-epochs", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=5, help="evaluate every N steps (local-step arms: at the "
                    "first multiple of H at or after it)")
    ap.add_argument("--local-every", type=int, default=32, help="H of the local-step arms")
    ap.add_argument("--target", type=float, help="held-out loss target (default: the lm task's, 2.9)")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from hsdp_netem.json, measuring "
                    "nothing")
    ap.add_argument("--prefix", default=PREFIX)
    ap.add_argument("--out-dir", default=RESULTS, help="relative to the current directory (default: %(default)s)")
    add_role_arguments(ap)
    args = ap.parse_args(own)
    args.argv = own
    if args.report_only:
        report(json.loads((Path(args.out_dir) / "hsdp_netem.json").read_text()), args)
        return 0
    if args.target is None:
        from adacomp.bench.time_to_accuracy import SIZES
        args.target = SIZES[args.size]["lm_target"]
    return run_role(args, rest, lambda: worker(args),
                    lambda: run_on_hosts(module_command("hsdp_netem"), args.hosts, args.bandwidths[0], args.prefix,
                                         own, ranks_per_host=args.per_host))


if __name__ == "__main__":
    raise SystemExit(main())
