"""Soak test: thousands of steps on 4 processes; does memory grow, does anything leak?

    adacomp bench soak                      # starts `adacomp run -np 4` itself
    adacomp run -np 4 -- adacomp bench soak --worker --steps 2000

Each worker trains the digits CNN on real data with every config given (default: top-k sparse
allgather with error feedback, and PowerSGD's two-round allreduce), and records, after a warm-up:

* resident memory (RSS) every ``--every`` steps: growth from the end of the warm-up to the end
  (goal < 5 %) and a least-squares slope;
* live tensors (``gc``) and their unique storage bytes: a leaked communication buffer or handle
  keeps its tensors alive, so counts must not grow;
* pending bucket handles / entries after ``step()`` (must be 0) and the sizes of the optimizer's
  internal containers (residuals, compressor / policy state, history) before and after.

The rank-failure watchdog (adacomp/backends/watchdog.py) runs during the whole soak.

Rank 0 gathers every rank's record and writes ``docs/results/soak.md`` under the current directory
(``--out``). Configs are read relative to the current directory, else from the checkout's configs/.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from adacomp.bench.common import RESULTS, module_command
from adacomp.tools.stepclock import time_steps

LAUNCH = "adacomp bench soak"  # starts `adacomp run -np 4` itself

DEFAULT_CONFIGS = ("configs/topk.yaml", "configs/powersgd.yaml")
SLACK_TENSORS = 2  # live tensor objects allowed above the warm-up count (storage bytes: none)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="adacomp bench soak", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--np", type=int, default=4, help="workers (default 4)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200, help="steps before the baseline sample")
    p.add_argument("--every", type=int, default=50, help="RSS sample period in steps")
    p.add_argument("--config", action="append", help=f"config(s) to soak (default: {', '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--out", default=f"{RESULTS}/soak.md", help="relative to the current directory (default: %(default)s)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def rss_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def live_tensors() -> tuple[int, int]:
    """(number of live tensor objects, bytes of their unique storages)."""
    import warnings

    import torch
    gc.collect()
    n, seen, nbytes = 0, set(), 0
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
    for obj in objects:
        try:
            if isinstance(obj, torch.Tensor):
                n += 1
                st = obj.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    nbytes += st.nbytes()
        except Exception:  # noqa: BLE001 - objects that die while we look at them
            continue
    return n, nbytes


def internals(opt: Any) -> dict[str, int]:
    """Sizes of every container the optimizer keeps between steps."""
    import torch

    def count(obj: Any) -> tuple[int, int]:
        if isinstance(obj, torch.Tensor):
            return 1, obj.numel() * obj.element_size()
        if isinstance(obj, dict):
            obj = list(obj.values())
        if isinstance(obj, (list, tuple)):
            pairs = [count(x) for x in obj]
            return sum(a for a, _ in pairs), sum(b for _, b in pairs)
        return 0, 0
    state = opt.adacomp_state_dict()
    tensors, nbytes = count(state)
    return {"state_tensors": tensors, "state_bytes": nbytes,
            "state_entries": sum(len(v) if isinstance(v, dict) else 1 for v in state["components"].values()),
            **opt.engine.in_flight(),
            "backend_pending": len(getattr(opt.backend, "_pending", [])),
            "history": len(opt.history)}


def soak_one(config_path: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import adacomp
    from adacomp.datasets.digits import digits, shard
    from adacomp.models import DigitsCNN

    rank, world = adacomp.rank(), adacomp.size()
    torch.manual_seed(0)
    model = DigitsCNN()
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                       model.named_parameters(), config=config_path)
    adacomp.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y, _, _ = digits(seed=0)
    batch = 32
    cur = SimpleNamespace(step=0, epoch=0, pos=0, idx=shard(len(y), rank, world, 0), j=None, loss=None)
    samples: list[tuple[int, int]] = []
    base: dict[str, Any] = {}

    def next_batch() -> None:
        cur.step += 1
        if cur.pos + batch > len(cur.idx):
            cur.epoch, cur.pos = cur.epoch + 1, 0
            cur.idx = shard(len(y), rank, world, cur.epoch)
        cur.j = cur.idx[cur.pos:cur.pos + batch]
        cur.pos += batch

    def train_step() -> None:
        opt.zero_grad()
        cur.loss = F.cross_entropy(model(x[cur.j]), y[cur.j])
        cur.loss.backward()
        opt.step()

    def sample(_: float) -> None:
        if cur.step % args.every == 0:
            samples.append((cur.step, rss_bytes()))
        if cur.step == args.warmup:
            base.update({"rss": rss_bytes(), "tensors": live_tensors(), **internals(opt)})

    t_start = time.perf_counter()
    step_s = time_steps(train_step, args.steps, sync=next_batch, after=sample)
    loss = cur.loss
    end = {"rss": rss_bytes(), "tensors": live_tensors(), **internals(opt)}
    opt.remove_hooks()
    after = [(s, r) for s, r in samples if s >= args.warmup]
    slope = 0.0
    if len(after) >= 2:
        ms, mr = statistics.mean(s for s, _ in after), statistics.mean(r for _, r in after)
        var = sum((s - ms) ** 2 for s, _ in after)
        slope = sum((s - ms) * (r - mr) for s, r in after) / var if var else 0.0
    return {"config": config_path, "rank": rank, "base": base, "end": end, "loss": float(loss.detach()),
            "growth": (end["rss"] - base["rss"]) / base["rss"], "slope_b_per_step": slope,
            "max_rss_after_warmup": max(r for _, r in after), "step_ms": 1e3 * statistics.median(step_s),
            "wall_s": time.perf_counter() - t_start}


def report(records: list[dict[str, Any]], args: argparse.Namespace, world: int) -> str:
    import torch
    mib = 2 ** 20
    lines = ["# Soak: memory and leaks over a long run", "",
             f"Produced by: `adacomp bench soak --np {world} --steps {args.steps} --warmup {args.warmup}` "
             f"(launches `adacomp run -np {world}`; gloo on localhost)",
             f"Machine: {os.cpu_count()} cores shared with other jobs, torch {torch.__version__}, "
             f"Python {sys.version.split()[0]}; model: digits CNN, batch 32 per rank, real data.", "",
             f"Growth = RSS at the end / RSS after the {args.warmup}-step warm-up - 1 (goal < 5 %). "
             "Slope: least-squares RSS trend after the warm-up. Live tensors: `gc`-reachable tensor objects "
             "and their unique storage bytes, warm-up -> end (a leaked buffer or handle keeps tensors alive; "
             f"verdict: bytes must not grow, count by at most {SLACK_TENSORS}). "
             "Pending: bucket handles and entries still held after `step()`.", ""]
    verdicts = []
    for cfg in sorted({r["config"] for r in records}):
        rows = sorted((r for r in records if r["config"] == cfg), key=lambda r: r["rank"])
        lines += [f"## `{cfg}`", "",
                  "| rank | RSS warm-up (MiB) | RSS end (MiB) | growth | slope (KiB / 1000 steps) | live tensors | "
                  "tensor bytes (KiB) | state tensors | pending | step (ms, median) | final loss |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            b, e = r["base"], r["end"]
            lines.append(
                f"| {r['rank']} | {b['rss'] / mib:.1f} | {e['rss'] / mib:.1f} | {100 * r['growth']:+.2f} % | "
                f"{r['slope_b_per_step'] * 1000 / 1024:+.1f} | {b['tensors'][0]} -> {e['tensors'][0]} | "
                f"{b['tensors'][1] / 1024:.0f} -> {e['tensors'][1] / 1024:.0f} | "
                f"{b['state_tensors']} -> {e['state_tensors']} | "
                f"{e['pending_handles']} handles, {e['pending_entries']} entries, {e['backend_pending']} backend | "
                f"{r['step_ms']:.1f} | {r['loss']:.2e} |")
        worst = max(r["growth"] for r in rows)
        # A leak grows with the step count; a tensor or two more at the sampling instant (a view of
        # an existing storage, same bytes) is not one.
        leak = any(r["end"]["tensors"][0] > r["base"]["tensors"][0] + SLACK_TENSORS
                   or r["end"]["tensors"][1] > r["base"]["tensors"][1]
                   or r["end"]["state_tensors"] > r["base"]["state_tensors"]
                   or r["end"]["pending_handles"] or r["end"]["pending_entries"] for r in rows)
        ok = worst < 0.05 and not leak
        verdicts.append(ok)
        lines += ["", f"Worst RSS growth {100 * worst:+.2f} % (goal < 5 %); "
                      f"{'no' if not leak else 'a'} growth in live tensors / state / pending handles: "
                      f"**{'PASS' if ok else 'FAIL'}**. Wall time {max(r['wall_s'] for r in rows):.0f} s.", ""]
    lines += [f"Overall: **{'PASS' if all(verdicts) else 'FAIL'}**", ""]
    return "\n".join(lines)


def config_path(name: str) -> Path:
    """``name`` as given if it exists (absolute or relative to the current directory), else in the
    checkout's configs/ (``configs/topk.yaml``)."""
    from adacomp.tools.advise import CONFIGS
    given = Path(name)
    return given if given.exists() else CONFIGS.parent / name


def worker(args: argparse.Namespace) -> int:
    import torch

    import adacomp
    from adacomp.backends import watchdog
    torch.set_num_threads(1)
    backend = adacomp.init()
    watchdog.start(backend, 60.0)  # soaked too: its thread and store run for the whole job
    records = [soak_one(str(config_path(c)), args) for c in args.config]
    for r, c in zip(records, args.config):
        r["config"] = c
    everyone = adacomp.backend().allgather_object(records)
    if adacomp.rank() == 0:
        text = report([r for rank_records in everyone for r in rank_records], args, adacomp.size())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(text)
        print(f"wrote {args.out}")
    watchdog.stop(backend)
    adacomp.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    args.config = args.config or list(DEFAULT_CONFIGS)
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    if args.worker or "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return worker(args)
    from adacomp.tools.launch import run_local
    cmd = [*module_command("soak"), "--worker", "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--every", str(args.every), "--out", args.out]
    for c in args.config:
        cmd += ["--config", c]
    return run_local(cmd, args.np)


if __name__ == "__main__":
    raise SystemExit(main())
