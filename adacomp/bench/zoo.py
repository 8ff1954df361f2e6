"""Step time of every method against PyTorch DDP on the model zoo at full size (issue 17).

One launch, two (or more) processes on loopback: per model, the arms alternate round-robin
(PyTorch DDP, then each method from ``configs/<method>.yaml``), every round builds a fresh
``DistributedOptimizer`` (or DDP wrapper) on the same model, runs warm-up steps (policies: until
their decision is made) and then measured steps. Step time = median over the measured steps of all
rounds, slowest rank; ratio = that over DDP's from the same run. ``compress`` is the share of the
step the optimizer spent compressing, decompressing and in error feedback (``opt.last_stats``).
lr is 0: every step does the same work, so arms are comparable however many steps they ran.

    adacomp run -np 2 -- adacomp bench zoo                      # all four zoo models
    adacomp bench zoo --models resnet50 --methods topk qsgd    # spawns 2 workers itself

Results go to docs/results/zoo_steps.{md,json} under the current directory (``--out-dir``).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from adacomp.bench.common import RESULTS, bench_command, ensure_torch_group, worker_or_spawn, write_result
from adacomp.tools.stepclock import time_steps

LAUNCH = "adacomp bench zoo"  # spawns --np workers itself, or under any launcher

METHODS = ["topk", "adtopk", "gaussiank", "dgc", "redsync", "sidco", "oktopk", "qsgd", "efsignsgd", "powersgd",
           "acpsgd", "artopk", "alltoall", "flexible", "moo", "lgreco", "bytecomp"]
# policies decide within a few steps here (the YAML defaults are for long runs: 100 profiled steps, ...);
# SIDCo adapts its stage count one step a window of 5 calls: after 2 steps it runs its first window's
# one-stage fit, not the stages it settles on (adacomp.bench.cost.WARMUP)
POLICY_OVERRIDES: dict[str, tuple[dict[str, Any], int]] = {
    "bytecomp": ({"profile_steps": 3, "repeats": 5}, 5),
    "lgreco": ({"warmup": 2, "period": 100000}, 4),
    "moo": ({"explore_steps": 1}, 8),
    "flexible": ({}, 2),
    "sidco": ({}, 16),
}
BATCH = {"resnet50": 16, "vgg16": 8, "gpt2_small": 8, "lstm_lm": 32}
"""Per-rank batch: large enough that backward is not dwarfed by per-call overhead on 1 thread."""
BEFORE = {  # issue 17's table (its run, before this work): step time / DDP
    "gpt2_small": {"qsgd": 9.5, "efsignsgd": 5.7, "artopk": 4.6, "moo": 4.0, "flexible": 2.9, "sidco": 2.1,
                   "alltoall": 2.1, "topk": 1.8},
    "vgg16": {"adtopk": 16.0, "qsgd": 12.2, "moo": 7.6, "efsignsgd": 6.5, "artopk": 6.5, "flexible": 6.3,
              "alltoall": 5.4, "lgreco": 5.1, "topk": 3.9},
    "lstm_lm": {"qsgd": 3.6, "adtopk": 3.4, "moo": 2.4},
    "resnet50": {"qsgd": 3.7, "flexible": 1.5, "artopk": 1.5, "lgreco": 1.5},
}


MAY_SEND_DENSE = {"bytecomp"}
"""Policies that may decide to send every tensor dense (ByteComp does where the network is fast,
as loopback is); every other arm must send fewer bytes than a dense allreduce."""


def arm_config(method: str) -> tuple[dict[str, Any], int]:
    """The method's config and how many warm-up steps it needs before its steady state."""
    from adacomp.tools.advise import method_config
    cfg = method_config(method)
    extra, warm = POLICY_OVERRIDES.get(method, ({}, 0))
    if extra:
        cfg["policy"] = {**cfg.get("policy", {}), **extra}
    return cfg, warm


def run_arm(method: str, model: torch.nn.Module, data: Any, args: argparse.Namespace) -> list[float]:
    """[median step s, median compress s, median bytes sent / dense bytes] of this rank for one
    round of ``method``."""
    import adacomp
    from torch.nn.parallel import DistributedDataParallel as DDP
    if method == "ddp":
        net: torch.nn.Module = DDP(model)
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.0)
        warm = args.warmup
    else:
        cfg, need = arm_config(method)
        net = model
        opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(),
                                           config=cfg)
        warm = max(args.warmup, need)
    comp: list[float] = []
    sent: list[float] = []

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        data.loss(net).backward()
        opt.step()

    def record(_: float) -> None:
        st = getattr(opt, "last_stats", None)
        comp.append(st.compress_s if st is not None else 0.0)
        sent.append(st.bytes_sent / st.dense_bytes if st is not None and st.dense_bytes else 1.0)

    times = time_steps(step, args.steps, warm, sync=torch.distributed.barrier, after=record)
    if method != "ddp":
        opt.remove_hooks()
    del opt, net
    gc.collect()
    return [statistics.median(times), statistics.median(comp), statistics.median(sent)]


def worker(args: argparse.Namespace) -> None:
    import adacomp
    from adacomp.models import build, synthetic_batch
    be = adacomp.init()
    ensure_torch_group()
    torch.set_num_threads(args.threads)
    rank, world = be.rank(), be.size()
    arms = ["ddp", *args.methods]
    rows: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for mname in args.models:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = build(mname)
        batch = args.batch or BATCH[mname]
        data = synthetic_batch(model, batch, seed=rank)
        got: dict[str, list[list[float]]] = {a: [] for a in arms}
        sent: dict[str, list[float]] = {a: [] for a in arms}
        for r in range(args.rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]  # rotate so no arm always follows the same one
            for a in order:
                mine = torch.tensor(run_arm(a, model, data, args), dtype=torch.float64)
                every = be.allgather(mine.view(1, -1), sizes=[1] * world).view(world, -1)
                got[a].append(every[int(every[:, 0].argmax())].tolist()[:2])  # the job moves at its slowest rank's pace
                sent[a].append(float(every[:, 2].max()))
                if rank == 0:
                    print(f"[{time.perf_counter() - t_all:6.0f}s] {mname} round {r + 1}/{args.rounds} {a:<10} "
                          f"{1e3 * got[a][-1][0]:9.1f} ms/step (compress {1e3 * got[a][-1][1]:8.1f} ms)", flush=True)
        ddp_s = statistics.median(s for s, _ in got["ddp"])
        nparams = sum(p.numel() for p in model.parameters())
        for a in arms:
            step = statistics.median(s for s, _ in got[a])
            comp = statistics.median(c for _, c in got[a])
            rows.append({"model": mname, "params_m": nparams / 1e6, "tensors": len(list(model.parameters())),
                         "batch": batch, "method": a, "step_ms": 1e3 * step, "ratio": step / ddp_s,
                         "compress_share": comp / step, "rounds_ms": [1e3 * s for s, _ in got[a]],
                         "bytes_ratio": max(sent[a]),
                         "before_ratio": BEFORE.get(mname, {}).get(a), "rounds": args.rounds,
                         "warmup": args.warmup if a == "ddp" else max(args.warmup, arm_config(a)[1]),
                         "steps": args.steps,
                         "command": args.command})
        del model, data
        gc.collect()
    if rank == 0:
        report(rows, args, world)
    be.barrier()
    adacomp.shutdown()
    idle = [f"{r['model']}/{r['method']}" for r in rows
            if r["method"] != "ddp" and r["method"] not in MAY_SEND_DENSE and r["bytes_ratio"] >= 1.0]
    if idle:  # a step time of a method that compressed nothing measures the wrong thing
        raise RuntimeError(f"zoo: {', '.join(idle)} sent no fewer bytes than a dense allreduce")


def report(rows: list[dict[str, Any]], args: argparse.Namespace, world: int) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    old = {}
    path = out / "zoo_steps.json"
    if path.exists() and args.merge:
        old = {_key(r): r for r in json.loads(path.read_text())["rows"]}
    old.update({_key(r): r for r in rows})
    every = list(old.values())
    path.write_text(json.dumps({"rows": every, "world": world}, indent=1))
    rows = [r for r in every if r.get("batch") == BATCH.get(r["model"])]  # the default (large) batches
    short = [r for r in every if r.get("batch") != BATCH.get(r["model"])]
    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    bar = {"resnet50": 1.25, "gpt2_small": 1.25, "vgg16": 1.5}
    lines = [f"{world} processes on one machine (gloo on loopback, {args.threads} thread each); per model one "
             "launch in which the arms alternate round-robin (order rotated each round), each round a fresh "
             "optimizer on the same model, warm-up steps (policies: until decided) then measured steps, lr 0 "
             "(rounds / warm-up / measured steps per model below). Cell: step time / PyTorch DDP's in the same run "
             "(median over rounds and steps, slowest rank), then the share of the step spent compressing (compress + "
             "decompress + error feedback). Issue 17's bar: <= 1.25x DDP on ResNet-50 and GPT-2, <= 1.5x on VGG-16. "
             "\"before\" = issue 17's own table (its run on the code before this work).", "",
             "| method | " + " | ".join(f"{m} before | {m} now" for m in models) + " |",
             "|---|" + "---:|---:|" * len(models)]
    for a in methods:
        cells = []
        for m in models:
            r = next((r for r in rows if r["model"] == m and r["method"] == a), None)
            b = BEFORE.get(m, {}).get(a)
            cells.append(f"{b:.1f}x" if b else "")
            if r is None:
                cells.append("")
            elif a == "ddp":
                cells.append(f"{r['step_ms']:.0f} ms")
            else:
                flag = " ✗" if m in bar and r["ratio"] > bar[m] else ""
                cells.append(f"{r['ratio']:.2f}x ({100 * r['compress_share']:.0f}%){flag}")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    lines += ["", "Models: " + ", ".join(
        f"{m} ({next(r for r in rows if r['model'] == m)['params_m']:.1f}M parameters, "
        f"{next(r for r in rows if r['model'] == m)['tensors']} tensors, batch "
        f"{next(r for r in rows if r['model'] == m)['batch']} per rank, {_schedule(rows, m)})" for m in models) +
        ". ✗ = above the bar.", "",
        "Reading it: on loopback gloo's dense allreduce of 100-550 MB itself costs CPU time on the same two cores, "
        "which a method's smaller payload saves; that is how a compressed step can beat DDP here. Launch-to-launch "
        "noise is about +-10 % (DDP's GPT-2 step was 6.85 s and 7.58 s in two launches), so read ratios within "
        "0.9-1.1x as 'no cost'. The compress share is of the whole step; backward is roughly half to two thirds of "
        "a step here.", "",
        "Per-round step times (ms) are in zoo_steps.json (`rounds_ms`). Commands (each launch writes its rows; "
        "`--merge` keeps the others, `--report-only` rewrites this file from the JSON):", ""]
    lines += [f"    {c}" for c in dict.fromkeys(r.get("command", "?") for r in rows)]
    if short:
        lines += ["", *_short_table(short)]
    write_result(out / "zoo_steps.md", "Step time vs PyTorch DDP on the model zoo (2 processes, loopback)", lines,
                 args.command)


def _key(r: dict[str, Any]) -> tuple[str, str, int]:
    return r["model"], r["method"], int(r.get("batch") or BATCH.get(r["model"], 0))


SHORT_BAR = {"resnet50": 1.25, "gpt2_small": 1.25}  # issue 32, at batches where a step is about a second


def _short_table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows measured at small batches (a ~1 s step on one thread), where backward no longer
    hides the compressor: issue 32's bar is <= 1.25x DDP on ResNet-50 and GPT-2-small."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = ["## At batches where one step takes about a second", "",
             "The same benchmark with a per-rank batch sized for a ~1 s step on one thread (`--batch`), so backward "
             "no longer hides the compressor. Issue 32's bar: <= 1.25x DDP on ResNet-50 and GPT-2-small. Cell: step "
             "time / DDP's in the same launch (compress share of the step, and where recorded the bytes this rank "
             "sent as a share of a dense allreduce's, the most of any rank and round: 'B'); the ddp row gives the "
             "range of DDP's step over the launches (commands below). At density 1 % a sparsifier's values "
             "and int64 indices are about 3 % of dense bytes; a 'B' well above that is the method's own "
             "selection sending more than its target, not compression cost.", "",
             "| method | " + " | ".join(f"{m} (batch {next(r['batch'] for r in rows if r['model'] == m)})"
                                       for m in models) + " |",
             "|---|" + "---:|" * len(models)]
    for a in methods:
        cells = []
        for m in models:
            r = next((r for r in rows if r["model"] == m and r["method"] == a), None)
            if r is None:
                cells.append("")
            elif a == "ddp":  # each launch measured its own DDP reference
                refs = [x["step_ms"] / x["ratio"] for x in rows if x["model"] == m and x["method"] != "ddp"]
                lo, hi = min(refs, default=r["step_ms"]), max(refs, default=r["step_ms"])
                cells.append(f"{lo:.0f} ms" if hi - lo < 0.5 else f"{lo:.0f}-{hi:.0f} ms")
            else:
                flag = " ✗" if m in SHORT_BAR and r["ratio"] > SHORT_BAR[m] else ""
                cells.append(f"{r['ratio']:.2f}x ({100 * r['compress_share']:.0f}%{_sent(r)}){flag}")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    over = {m: [r["method"] for r in rows if r["model"] == m and r["method"] != "ddp"
                and m in SHORT_BAR and r["ratio"] > SHORT_BAR[m]] for m in models}
    lines += ["", "Above the bar: " + "; ".join(f"{m}: {', '.join(v) if v else 'none'}" for m, v in over.items()
                                               if m in SHORT_BAR) + "."]
    lines += ["", "Schedules: " + ", ".join(f"{m}: {_schedule(rows, m)}" for m in models) + ". Commands:", ""]
    lines += [f"    {c}" for c in dict.fromkeys(r.get("command", "?") for r in rows)]
    return lines


def _sent(r: dict[str, Any]) -> str:
    """The row's bytes sent as a share of dense (rows measured before it was recorded have none)."""
    b = r.get("bytes_ratio")
    return "" if b is None else f", {100 * b:.3g}% B"


def _schedule(rows: list[dict[str, Any]], model: str) -> str:
    mine = [r for r in rows if r["model"] == model]
    r = next((r for r in mine if r["method"] == "ddp"), mine[0])
    longer = "".join(f"; {x['method']}: {x['warmup']} warm-up" for x in mine
                     if x.get("warmup", r.get("warmup")) != r.get("warmup"))  # an arm that settles later (sidco)
    return (f"{r.get('rounds', '?')} round(s) x ({r.get('warmup', '?')} warm-up + {r.get('steps', '?')} "
            f"measured steps{longer})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adacomp bench zoo", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2, help="workers to spawn when not started by a launcher")
    ap.add_argument("--models", nargs="+", default=["resnet50", "gpt2_small", "vgg16", "lstm_lm"])
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--batch", type=int, default=0, help="per-rank batch (0: the model's default in BATCH)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2, help="error feedback and recycled outputs alternate two "
                    "buffers: the first two steps pay their page faults")
    ap.add_argument("--steps", type=int, default=2, help="measured steps per arm and round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--merge", action="store_true", help="keep rows of other models / methods in zoo_steps.json")
    ap.add_argument("--out-dir", default=RESULTS, help="relative to the current directory (default: %(default)s)")
    ap.add_argument("--report-only", action="store_true", help="rewrite zoo_steps.md from zoo_steps.json")
    args = ap.parse_args(argv)
    args.command = bench_command("zoo", argv)
    if args.report_only:
        data = json.loads((Path(args.out_dir) / "zoo_steps.json").read_text())
        args.merge = True
        report([], args, data["world"])
        return 0
    return worker_or_spawn(lambda: worker(args), args.np, "zoo", argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
