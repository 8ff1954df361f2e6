"""Time to accuracy on real data over emulated links: DDP fp32 / bf16 / PowerSGD vs adacomp's methods.

4 emulated hosts (``adacomp netem``: network namespaces on a bridge, egress capped by tbf, one
worker per host, gloo over the capped links; docs/netem.md) at each bandwidth in ``--bandwidths``.
Two tasks on real data read offline:

* ``fmnist``: a CNN (2 conv + 2 linear, ~0.45M parameters) on Fashion-MNIST (Debian package
  ``dataset-fashion-mnist``) until the test accuracy reaches ``--acc-target``;
* ``text``: a character LSTM on Debian's ``fortunes`` corpus (~2.5 MB) until the test loss
  (nats / character) falls to ``--loss-target``;
* ``lm``: the communication-bound task. A GPT-2-like transformer (``adacomp.models.GPT2Small`` at
  width 384, 7 layers, 6 heads, context 64, character vocabulary: 12.5M parameters) on the same
  fortunes text, AdamW for every arm (DiLoCo's inner optimizer), 4 windows of 64 characters per
  host and step, until the held-out loss (nats / character) falls to ``--lm-target``. The batch is
  small on purpose: bf16 DDP moves ~37 MB per host and step (ring allreduce of 25 MB), ~3 s at
  100 Mbit/s, against ~0.5 s of compute (measured: 3.8 s vs 0.56 s, 85 % communicating; the bar is
  75 %); every run measures that share (compute-only step vs bf16 DDP's step) and reports it.

Arms: ``ddp_fp32``, ``ddp_bf16`` (bf16 hook: torch's own refuses gloo / CPU, adacomp.tools.baselines),
``ddp_powersgd`` (torch's PowerSGD hook), and adacomp's methods from ``configs/<name>.yaml``
under ``adacomp.DistributedOptimizer``, among them the local-step (DiLoCo family) arms ``localsgd``,
``diloco``, ``streaming_diloco``, ``diloco_topk`` and ``sparseloco``, whose H (``local_steps.every``)
is set per task (``--local-every N`` overrides it for all). Every arm starts from the same weights
and sees the same batches. The clock counts training only: evaluation (every ``--eval-every`` steps,
for local-step arms at the first multiple of H at or after it, right after a synchronisation; each
host scores a slice of the test set) is paused out, and the time is the slowest host's.

    adacomp bench time_to_accuracy                   # reduced size, fmnist + text (~13 min on 2 shared cores)
    adacomp bench time_to_accuracy --size medium --tasks lm --merge  # lm: 9 arms, 2 links (~50 min)
    adacomp bench time_to_accuracy --size medium     # every method, all the data, a few epochs (~1-2 h)
    adacomp bench time_to_accuracy --size full       # every method, until convergence (many hours)

Needs root (namespaces); without it the benchmark says so and measures nothing (exit 0). Results go
to docs/results/time_to_accuracy.{md,json,png} under the current directory (``--out-dir``).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from adacomp.bench.common import RESULTS, bench_command, ensure_torch_group, module_command, write_result
from adacomp.models import FashionCNN
from adacomp.netem.jobs import add_role_arguments, run_on_hosts, run_role, split_argv
from adacomp.tools.stepclock import time_steps

LAUNCH = "adacomp bench time_to_accuracy"  # root: starts emulated hosts itself

PREFIX = "actta"
DDP_ARMS = ("ddp_fp32", "ddp_bf16", "ddp_powersgd")
# local-step arms (DiLoCo family, `local_steps` in their config): evaluated right after a synchronisation,
# checked to have synchronised (bytes > 0, fewer than dense DDP), and candidates of the report's verdict
LOCAL_ARMS = ("localsgd", "diloco", "streaming_diloco", "diloco_topk", "sparseloco")
ADACOMP_ARMS = ("topk", "dgc", "gaussiank", "adtopk", "qsgd", "powersgd", "acpsgd", "artopk", "flexible", "moo",
                "lgreco", "bytecomp") + LOCAL_ARMS
TASKS = ("fmnist", "text", "lm")
# H (local_steps.every) per task: ~250-500 steps reach the fmnist / text targets, ~100-200 inner steps the lm one
LOCAL_EVERY = {"fmnist": 16, "text": 16, "lm": 32}
# the lm task's arms (issue 28): DDP fp32 / bf16, the two best per-step methods at 100 Mbit/s in
# docs/results/time_to_accuracy.md (powersgd, artopk), and the local-step family
LM_ARMS = ["ddp_fp32", "ddp_bf16", "powersgd", "artopk", *LOCAL_ARMS]
# the verdict's bar (issue 28): at 100 Mbit/s a local-step arm reaches the target >= 3x sooner than bf16
# DDP with >= 100x fewer bytes per host
BAR_SPEEDUP, BAR_BYTES, BAR_LINK = 3.0, 100.0, "100mbit"
SIZES: dict[str, dict[str, Any]] = {
    # reduced: what `make results` runs on 2 shared cores; full: the experiment
    "reduced": {"arms": ["ddp_fp32", "ddp_bf16", "ddp_powersgd", "topk", "powersgd", "acpsgd", *LOCAL_ARMS],
                "max_seconds": 45.0, "train_limit": 20000, "test_limit": 2000, "text_windows": 8000,
                "text_test": 512,
                "acc_target": 0.78, "loss_target": 2.5,
                # lm: bf16 DDP needs ~60 steps (~4.5 s each at 100 Mbit/s, measured) to 2.9 nats / char
                "lm_arms": LM_ARMS, "lm_max_seconds": 420.0, "lm_windows": None, "lm_test": 512, "lm_target": 2.9},
    # medium: every method on all the data for a few epochs, to targets 2 cores reach within minutes per arm
    "medium": {"arms": list(DDP_ARMS + ADACOMP_ARMS), "max_seconds": 180.0, "train_limit": None, "test_limit": None,
               "text_windows": None, "text_test": 2000, "acc_target": 0.85, "loss_target": 2.2,
               # lm: the reduced size's run (the 9 arms of issue 28, ~50 min at two links); medium adds nothing
               # affordable: every link-bound arm costs minutes of training clock
               "lm_arms": LM_ARMS, "lm_max_seconds": 420.0, "lm_windows": None, "lm_test": 512, "lm_target": 2.9},
    "full": {"arms": list(DDP_ARMS + ADACOMP_ARMS), "max_seconds": 1800.0, "train_limit": None, "test_limit": None,
             "text_windows": None, "text_test": None, "acc_target": 0.90, "loss_target": 1.6,
             "lm_arms": list(DDP_ARMS + ADACOMP_ARMS), "lm_max_seconds": 3600.0, "lm_windows": None, "lm_test": None,
             "lm_target": 2.0},
    # tiny: plumbing only (tests/test_scripts_smoke.py): a 2-layer lm, a few hundred windows, seconds per arm
    "tiny": {"arms": ["ddp_fp32", "ddp_bf16"], "max_seconds": 4.0, "train_limit": 512, "test_limit": 256,
             "text_windows": 256, "text_test": 64, "acc_target": 0.99, "loss_target": 0.1,
             "lm_arms": ["ddp_bf16", "diloco"], "lm_max_seconds": 4.0, "lm_windows": 256, "lm_test": 64,
             "lm_target": 0.1},
}
# the lm model per size: GPT2Small(width, layers, heads), context, per-host batch
LM_MODEL = {"width": 384, "layers": 7, "heads": 6, "context": 64, "batch": 4}
LM_MODEL_TINY = {"width": 32, "layers": 2, "heads": 2, "context": 16, "batch": 4}


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
    optimizer: str = "sgd"  # "sgd" (momentum from the arm's `train:` or 0.9), "adam", "adamw"
    max_seconds: float = 0.0  # training clock limit per arm
    eval_every: int = 25
    local_every: int = 32  # H of the local-step arms
    context: int = 0  # tokens per sample (sequence tasks): tokens = steps x batch x context x hosts
    warmup: int = 0  # linear learning-rate warm-up steps
    arms: tuple[str, ...] = ()
    measure_compute: bool = False  # time the compute-only step (no communication) before the arms


def make_optimizer(task: Task, model: nn.Module, train_cfg: dict[str, Any]) -> torch.optim.Optimizer:
    """The inner optimizer (the only one for DDP arms): SGD with momentum 0.9 for the CNN (0 where the
    method applies it itself: DGC's memory, §3.2), Adam for the LSTM (plain SGD sat on the unigram plateau
    for 100s of steps), AdamW for the transformer (DiLoCo's inner optimizer; GPT-style betas, decay 0.1)."""
    if task.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=task.lr, momentum=train_cfg.get("momentum", 0.9))
    if task.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=task.lr)
    return torch.optim.AdamW(model.parameters(), lr=task.lr, betas=(0.9, 0.95), weight_decay=0.1)


def seq_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def lm_model_spec(size: str) -> dict[str, int]:
    return LM_MODEL_TINY if size == "tiny" else LM_MODEL


def make_tasks(args: argparse.Namespace) -> list[Task]:
    from adacomp.datasets.digits import fashion_mnist
    from adacomp.datasets.text import char_sequences
    from adacomp.models import CharLSTM, GPT2Small
    size = SIZES[args.size]
    tasks = []

    def every(name: str) -> int:
        return args.local_every or LOCAL_EVERY[name]

    if "fmnist" in args.tasks:
        x, y, xt, yt = fashion_mnist(train_limit=args.train_limit, test_limit=args.test_limit)
        tasks.append(Task("fmnist", x, y, xt, yt, FashionCNN, F.cross_entropy, "test accuracy", args.acc_target,
                          True, 0.05, 32, "sgd", args.max_seconds or size["max_seconds"], args.eval_every,
                          every("fmnist"), arms=tuple(args.arms or size["arms"])))
    if "text" in args.tasks:
        x, y, xt, yt, corpus = char_sequences(32, source="fortunes")
        if args.text_windows:
            x, y = x[:args.text_windows], y[:args.text_windows]
        xt, yt = xt[:args.text_test], yt[:args.text_test]  # evaluation wall time: a fixed slice of held-out text
        vocab = len(corpus.vocab)
        tasks.append(Task("text", x, y, xt, yt, lambda: CharLSTM(vocab, 32, 256), seq_loss, "test loss (nats/char)",
                          args.loss_target, False, 3e-3, 32, "adam", args.max_seconds or size["max_seconds"],
                          args.eval_every, every("text"), arms=tuple(args.arms or size["arms"])))
    if "lm" in args.tasks:
        spec = lm_model_spec(args.size)
        x, y, xt, yt, corpus = char_sequences(spec["context"], source="fortunes")
        if size["lm_windows"]:
            x, y = x[:size["lm_windows"]], y[:size["lm_windows"]]
        xt, yt = xt[:size["lm_test"]], yt[:size["lm_test"]]
        vocab = len(corpus.vocab)

        def build_lm() -> nn.Module:
            return GPT2Small(vocab=vocab, context=spec["context"], width=spec["width"], layers=spec["layers"],
                             heads=spec["heads"], seq=spec["context"])
        # evaluation every 5 steps: bf16 DDP needs only ~60 at 100 Mbit/s; lr 1e-3 after a 5-step warm-up
        # (3e-3 diverged once and then sat on the unigram plateau, 2e-3 was slower to leave it)
        tasks.append(Task("lm", x, y, xt, yt, build_lm, seq_loss, "held-out loss (nats/char)", args.lm_target,
                          False, 1e-3, spec["batch"], "adamw", args.max_seconds or size["lm_max_seconds"],
                          args.lm_eval_every, every("lm"), spec["context"], 5, tuple(args.arms or size["lm_arms"]),
                          True))
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
    from adacomp.tools.advise import CONFIGS
    cfg = {} if arm in BASELINES else yaml.safe_load((CONFIGS / f"{arm}.yaml").read_text())
    train_cfg = cfg.pop("train", None) or {}
    local = bool(cfg.get("local_steps"))
    fragments = 1
    if local:
        ls = cfg["local_steps"]
        ls["every"] = task.local_every  # H per task (--local-every overrides all)
        fragments = int(ls.get("fragments", 1))
        if fragments > 1:  # Streaming DiLoCo fragments whole blocks: the CharLSTM has only 3
            from adacomp.outer.loop import blocks
            fragments = ls["fragments"] = min(fragments, len(blocks([n for n, _ in model.named_parameters()])))
    base = make_optimizer(task, model, train_cfg)
    sched = (torch.optim.lr_scheduler.LambdaLR(base, lambda s: min(1.0, (s + 1) / task.warmup)) if task.warmup
             else None)
    opt: Any
    net: nn.Module
    if arm in BASELINES:
        net, opt = ddp_baseline(arm, model), base
    else:
        net, opt = model, adacomp.DistributedOptimizer(base, model.named_parameters(), config=cfg, backend=be)
        opt.steps_per_epoch = len(task.y) // world // task.batch  # lgreco decides once per epoch
    # local-step arms are scored right after a synchronisation (step a multiple of H): in between, every
    # replica holds its own parameters
    eval_every = -(-task.eval_every // task.local_every) * task.local_every if local else task.eval_every
    clock, step, nbytes, syncs, curve, times = 0.0, 0, 0, 0, [], []
    reached: float | None = None
    reached_step: int | None = None
    epoch = 0
    done = False
    while not done and epoch < args.max_epochs:
        idx = shard(len(task.y), rank, world, epoch)
        for i in range(0, len(idx) - task.batch + 1, task.batch):
            b = idx[i:i + task.batch]

            def train_step() -> None:
                opt.zero_grad()
                task.loss(net(task.x[b]), task.y[b]).backward()  # noqa: B023 - called before b changes
                opt.step()
                if sched is not None:
                    sched.step()
            times += time_steps(train_step, 1)  # one step at a time: evaluation may end the arm after any
            clock += times[-1]
            sent = ddp_bytes(arm, model, step) if arm in BASELINES else int(opt.last_stats.bytes_sent)
            nbytes += sent
            syncs += sent > 0
            step += 1
            if step % eval_every == 0:
                t = torch.tensor([clock], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest host's clock
                metric = evaluate(model, task, rank, world)
                curve.append((float(t[0]), step, metric))
                ok = metric >= task.target if task.higher else metric <= task.target
                if ok and reached is None:
                    reached, reached_step = float(t[0]), step
                if ok or float(t[0]) >= task.max_seconds:
                    done = True
                    break
        epoch += 1
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    import statistics
    med = torch.tensor([statistics.median(times) if times else 0.0], dtype=torch.float64)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the slowest host's median step
    params = sum(p.numel() for p in model.parameters())
    row = {"arm": arm, "task": task.name, "time_to_target_s": reached, "final": curve[-1][2] if curve else None,
           "steps": step, "train_s": curve[-1][0] if curve else clock, "mib_per_host": nbytes / 2**20,
           "curve": curve, "epochs": epoch, "metric_name": task.metric_name, "target": task.target,
           "higher": task.higher, "train_images": len(task.y), "params": params, "batch": task.batch,
           "hosts": world, "max_seconds": task.max_seconds, "eval_every": eval_every,
           "step_median_s": float(med[0])}
    if task.context:
        tokens = task.batch * task.context * world  # per step, all hosts
        row.update(context=task.context, tokens=step * tokens,
                   tokens_to_target=reached_step * tokens if reached_step is not None else None)
    if local:
        row.update(local=True, local_every=task.local_every, fragments=fragments, syncs=syncs)
        check_synchronised(arm, row, ddp_bytes("ddp_fp32", model, 0) * step, rank)
    return row


def check_synchronised(arm: str, row: dict[str, Any], dense_bytes: int, rank: int) -> None:
    """The local-step path really ran: the arm synchronised (bytes > 0) and each host sent fewer bytes
    than dense fp32 DDP would have in the same number of steps. Raises otherwise (a local-step config
    that silently ran nothing, or ran the per-step path, must not produce a row)."""
    sent = row["mib_per_host"] * 2**20
    row["dense_mib_same_steps"] = dense_bytes / 2**20
    if sent <= 0:
        raise RuntimeError(f"{arm}: local-step arm sent 0 bytes in {row['steps']} steps (H = "
                           f"{row['local_every']}): no synchronisation happened")
    if sent >= dense_bytes:
        raise RuntimeError(f"{arm}: local-step arm sent {sent / 2**20:.1f} MiB per host in {row['steps']} steps, "
                           f"not fewer than dense fp32 DDP's {dense_bytes / 2**20:.1f} MiB for those steps")
    row["synchronised"] = True
    if rank == 0:
        print(f"  {arm}: {row['syncs']} synchronising steps of {row['steps']} (H = {row['local_every']}), "
              f"{row['mib_per_host']:.2f} MiB/host < dense fp32 DDP's {dense_bytes / 2**20:.1f} MiB "
              f"({dense_bytes / sent:.0f}x fewer)", flush=True)


def measure_compute(task: Task, rank: int, world: int, steps: int = 6, warmup: int = 2) -> float:
    """Compute-only step: the same model, inner optimizer, batch and threads with no communication at all
    (no DDP, no adacomp), run on every host at once as during training (the hosts share the cores); the
    slowest host's median step in seconds."""
    import statistics
    import torch.distributed as dist
    from adacomp.datasets.digits import shard
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = task.build()
    opt = make_optimizer(task, model, {})
    idx = shard(len(task.y), rank, world, 0)
    dist.barrier()
    batches = iter(range(warmup + steps))
    b = idx[:0]

    def next_batch() -> None:
        nonlocal b
        i = next(batches)
        b = idx[i * task.batch:(i + 1) * task.batch]

    def train_step() -> None:
        opt.zero_grad()
        task.loss(model(task.x[b]), task.y[b]).backward()
        opt.step()

    times = time_steps(train_step, steps, warmup, sync=next_batch)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def worker(args: argparse.Namespace) -> None:
    import adacomp
    from adacomp import netmodel
    from adacomp.netem import hosts as netem
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
            compute_s = None
            if task.measure_compute:
                compute_s = measure_compute(task, rank, be.size())
                if rank == 0:
                    n = sum(p.numel() for p in task.build().parameters())
                    print(f"{bw} {task.name}: {n:,} parameters ({n * 2 / 1e6:.1f} MB in bf16), batch {task.batch} x "
                          f"{task.context} tokens per host; compute-only step {compute_s:.3f} s (slowest host, "
                          f"no communication)", flush=True)
            for arm in task.arms:
                r = train_arm(arm, task, be, args)
                r.update(bandwidth=bw, probe_mbit=est.bandwidth_gbps * 1e3, alpha_us=est.alpha * 1e6, size=args.size,
                         command=bench_command("time_to_accuracy", args.argv, drop=("--worker",)))
                if compute_s is not None:
                    r["compute_step_s"] = compute_s
                rows.append(r)
                if rank == 0:
                    tt = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] is not None else "not reached"
                    print(f"{bw} {task.name:<6} {arm:<16} target {tt:<12} final {r['final']:.4f} after {r['steps']} "
                          f"steps / {r['train_s']:.1f} s, {r['mib_per_host']:.1f} MiB/host", flush=True)
                    if compute_s is not None and arm == "ddp_bf16" and r["steps"]:
                        step_s = r["step_median_s"]
                        print(f"{bw} {task.name}: bf16 DDP step {step_s:.3f} s (median; mean "
                              f"{r['train_s'] / r['steps']:.3f} s), compute-only {compute_s:.3f} s: communication "
                              f"share {1 - compute_s / step_s:.1%}", flush=True)
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


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def verdict(sub: list[dict[str, Any]], bw: str) -> str | None:
    """One line for a (task, link): the best local-step arm's speed-up vs bf16 DDP (time to target) and its
    byte reduction (bf16 MiB/host / arm MiB/host, both until the arm stopped), judged against the bar: at
    100 Mbit/s >= 3x sooner with >= 100x fewer bytes per host. Best: the fastest arm that meets the bar,
    else the fastest local-step arm that reached the target. None without local-step rows."""
    local = [r for r in sub if r.get("local") or r["arm"] in LOCAL_ARMS]
    if not local:
        return None
    bf = next((r for r in sub if r["arm"] == "ddp_bf16"), None)
    where = f"at {bw}" + ("" if bw == BAR_LINK else f" (the bar is set at {BAR_LINK}; shown for comparison)")
    if bf is None:
        return f"**Verdict {where}**: no `ddp_bf16` row to compare with."
    reached = [r for r in local if r["time_to_target_s"] is not None]
    if not reached:
        return (f"**Verdict {where}: does not meet** the bar: no local-step arm reached the target "
                f"({', '.join(r['arm'] for r in local)}).")
    # bf16 that did not reach the target: its whole training clock is a lower bound on its time to target
    bf_t, bound = (bf["time_to_target_s"], "") if bf["time_to_target_s"] is not None else (bf["train_s"], ">= ")
    scored = []
    for r in reached:
        speed = bf_t / r["time_to_target_s"]
        fewer = bf["mib_per_host"] / r["mib_per_host"] if r["mib_per_host"] > 0 else float("inf")
        scored.append((speed >= BAR_SPEEDUP and fewer >= BAR_BYTES, speed, fewer, r))
    meets, speed, fewer, best = max(scored, key=lambda t: (t[0], t[1]))
    what = (f"best local-step arm `{best['arm']}` (H = {best.get('local_every', '?')}) reaches the target "
            f"{bound}{speed:.2f}x sooner than bf16 DDP ({best['time_to_target_s']:.1f} s vs "
            f"{'not reached in ' if bound else ''}{bf_t:.1f} s) with {fewer:.0f}x fewer bytes per host "
            f"({best['mib_per_host']:.2f} vs {bf['mib_per_host']:.1f} MiB)")
    if meets:
        how = (f"meets** the bar ({BAR_SPEEDUP:g}x sooner, {BAR_BYTES:g}x fewer bytes): {speed / BAR_SPEEDUP:.2f}x "
               f"and {fewer / BAR_BYTES:.1f}x over it")
    else:
        short = []
        if speed < BAR_SPEEDUP:
            short.append(f"speed-up {speed:.2f}x of the {BAR_SPEEDUP:g}x needed ({speed / BAR_SPEEDUP:.0%} of it)")
        if fewer < BAR_BYTES:
            short.append(f"bytes {fewer:.0f}x of the {BAR_BYTES:g}x needed ({fewer / BAR_BYTES:.0%} of it)")
        how = "does not meet** the bar: " + "; ".join(short)
    return f"**Verdict {where}: {how}. The {what}."


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
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
    lm = next((r for r in rows if r["task"] == "lm"), None)
    limits = {r["task"]: r.get("max_seconds") or args.max_seconds or size["max_seconds"] for r in rows}
    data = ([f"Fashion-MNIST {fm['train_images']} training images"] if fm else []) + \
        ([f"text {tx['train_images']} training windows of Debian's fortunes"] if tx else []) + \
        ([f"lm {lm['train_images']} training windows of {lm.get('context', '?')} characters of the same fortunes "
          f"text ({lm.get('params', 0) / 1e6:.1f}M-parameter transformer)"] if lm else [])
    lines = [f"Size `{args.size}`: {', '.join(data) or 'no rows'}; each arm stops at the target or after "
             + (f"{next(iter(limits.values())):.0f} s" if len(set(limits.values())) == 1 else
                ", ".join(f"{v:.0f} s ({k})" for k, v in limits.items()))
             + " of training clock (`not reached` then). ", ""]
    if args.size == "tiny":
        lines[0] += "Plumbing only (tests): tiny data and model, unreachable targets."
    elif args.size != "full":
        full = SIZES["full"]
        lines[0] += (f"Not the full experiment (`--size full`: all 60,000 images, targets {full['acc_target']} / "
                     f"{full['loss_target']} / {full['lm_target']}, up to {full['max_seconds'] / 60:.0f} min per "
                     "arm: hours per arm on 2 cores); " +
                     ("the reduced size fits `make results`." if args.size == "reduced" else
                      f"`{args.size}` keeps all the data and every method but lower targets "
                      f"({size['acc_target']} / {size['loss_target']} / {size['lm_target']})."))
    commands = list(dict.fromkeys(r["command"] for r in rows if "command" in r))
    if commands:
        lines += ["Rows measured by: " + "; ".join(f"`{c}`" for c in commands) + ". The `vs ddp_bf16` "
                  "columns divide by the table's `ddp_bf16` row, from the latest of these runs that measured it; "
                  "rows measured in that same run (listed after it) compare within one run, earlier rows "
                  "across runs (the machine's noise between runs is a few seconds per arm).", ""]
    lines += [f"{args.hosts} emulated hosts (`adacomp netem`: namespaces + tbf egress cap, gloo over the capped links), "
              "one worker per host; the 4 workers share 2 CPU cores (with other jobs), so compute is slow and noisy. "
              "Clock: training only (evaluation paused out), slowest host. Same initial weights and batches per arm. "
              "`MiB/host`: payload bytes each host put into collectives (DDP: computed from the bucket sizes, "
              "adacomp: measured). `ddp_bf16` is a 3-line hook with the rounding of torch's `bf16_compress_hook` "
              "(which refuses gloo / CPU in torch 2.13); `ddp_powersgd` is torch's own `powerSGD_hook` (rank 1).", "",
              "![time to accuracy](time_to_accuracy.png)", ""]
    if any(r.get("local") for r in rows):
        lines[-2:-2] = ["Local-step arms (`localsgd`, `diloco`, `streaming_diloco`, `diloco_topk`, `sparseloco`: "
                        "`local_steps` in `configs/<arm>.yaml`; `(H=N)` after the name) run H inner steps with no "
                        "communication between synchronisations; they are evaluated right after a synchronisation "
                        "(every H steps), so their time to target is known only to within H steps. Each such row was "
                        "checked after training: it synchronised (bytes > 0) and sent fewer bytes per host than "
                        "dense fp32 DDP would have in its steps.", ""]
    for tname, bw in dict.fromkeys((r["task"], r["bandwidth"]) for r in rows):
        sub = [r for r in rows if r["task"] == tname and r["bandwidth"] == bw]
        bf = next((r for r in sub if r["arm"] == "ddp_bf16"), None)
        s0 = sub[0]
        tokens = any("tokens" in r for r in sub)
        lines += [f"### {tname} at {bw} (probe: {s0['probe_mbit']:.0f} Mbit/s, alpha {s0['alpha_us']:.0f} us); "
                  f"target {s0['metric_name']} {'>=' if s0['higher'] else '<='} {s0['target']}; size "
                  f"`{s0.get('size', args.size)}`, {s0['train_images']} training samples", ""]
        compute = next((r["compute_step_s"] for r in sub if r.get("compute_step_s")), None)
        if compute and bf and bf["steps"]:
            step_s = bf.get("step_median_s") or bf["train_s"] / bf["steps"]
            lines += [f"Communication share of bf16 DDP's step: **{1 - compute / step_s:.0%}** (compute-only step "
                      f"{compute:.3f} s: the same model, AdamW, batch and threads with no communication, all hosts at "
                      f"once, slowest host's median; bf16 DDP step {step_s:.3f} s, slowest host's median, mean "
                      f"{bf['train_s'] / bf['steps']:.3f} s = its training clock / steps); "
                      f"{s0.get('params', 0):,} parameters, {s0.get('batch', '?')} x {s0.get('context', '?')} "
                      f"tokens per host and step.", ""]
        lines += ["| arm | time to target s | vs ddp_bf16 | bytes vs ddp_bf16 | metric at stop | steps | "
                  + ("tokens to target | " if tokens else "") + "epochs | train s | MiB/host |",
                  "|---|---|---|---|---|---|" + ("---|" if tokens else "") + "---|---|---|"]
        for r in sub:
            tt = r["time_to_target_s"]
            rel = _ratio(bf["time_to_target_s"] if bf else None, tt)
            fewer = _ratio(bf["mib_per_host"] if bf else None, r["mib_per_host"])
            label = r["arm"] + (f" (H={r['local_every']}" + (f", {r['fragments']} fragments"
                                                              if r.get("fragments", 1) > 1 else "") + ")"
                                if r.get("local_every") else "")
            tok = ""
            if tokens:
                tok = f"{r['tokens_to_target']:,} | " if r.get("tokens_to_target") is not None else \
                    f"not reached ({r.get('tokens', 0):,} trained) | "
            lines.append(f"| {label} | {f'{tt:.1f}' if tt is not None else 'not reached'} | "
                         f"{f'{rel:.2f}x' if rel else '-'} | {f'{fewer:.1f}x' if fewer else '-'} | "
                         f"{r['final']:.4f} | {r['steps']} | {tok}{r['epochs']} | {r['train_s']:.1f} | "
                         f"{r['mib_per_host']:.2f} |")
        lines.append("")
        v = verdict(sub, bw)
        if v:
            lines += [v, ""]
    lines.append("`vs ddp_bf16` = bf16 time to target / arm time to target (> 1: the arm is faster); `bytes vs "
                 "ddp_bf16` = bf16 MiB/host / arm MiB/host (> 1: the arm sent fewer bytes; both counted until the "
                 "arm stopped, at its target or its time limit); `tokens to target` = steps x batch x context x "
                 "hosts; `epochs`: epochs begun. Verdict: the bar of issue 28 (at "
                 f"{BAR_LINK} a local-step arm reaches the target >= {BAR_SPEEDUP:g}x sooner than bf16 DDP with >= "
                 f"{BAR_BYTES:g}x fewer bytes per host), judged on the fastest local-step arm that meets it, else "
                 "the fastest that reached the target.")
    write_result(out / "time_to_accuracy.md", "Time to accuracy on real data: compression vs DDP fp32 / bf16 "
                 "over emulated links", lines, bench_command("time_to_accuracy", args.argv, drop=("--worker",)),
                 self_launched=True)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # one row of panels per task, one column per link: metric (loss for text / lm) against training wall-clock
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    links = list(dict.fromkeys(r["bandwidth"] for r in rows))
    fig, axes = plt.subplots(len(tasks), len(links), figsize=(5 * len(links), 4 * len(tasks)), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for (tname, bw) in dict.fromkeys((r["task"], r["bandwidth"]) for r in rows):
        ax = axes[tasks.index(tname)][links.index(bw)]
        ax.set_visible(True)
        sub = [r for r in rows if (r["task"], r["bandwidth"]) == (tname, bw)]
        for r in sub:
            if r["curve"]:
                ts, _, ms = zip(*r["curve"])
                local = r.get("local") or r["arm"] in LOCAL_ARMS
                ax.plot(ts, ms, label=r["arm"], lw=2.2 if r["arm"].startswith("ddp") or local else 1.2,
                        ls="-" if r["arm"].startswith("ddp") else "-." if local else "--",
                        marker="." if local else None)
        ax.axhline(sub[0]["target"], color="k", lw=0.7, ls=":")
        ax.set_title(f"{tname} @ {bw}"), ax.set_xlabel("training wall-clock s (slowest host)")
        ax.set_ylabel(sub[0]["metric_name"])
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def drive(args: argparse.Namespace, worker_argv: list[str]) -> int:
    return run_on_hosts(module_command("time_to_accuracy"), args.hosts, args.bandwidths[0], args.prefix, worker_argv, prepare=lambda: make_tasks(argparse.Namespace(**{**vars(args), "tasks": args.tasks})))


def main(argv: list[str] | None = None) -> int:
    own, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser(prog="adacomp bench time_to_accuracy", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="reduced")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bandwidths", nargs="+", default=["100mbit", "1gbit"])
    ap.add_argument("--tasks", nargs="+", default=["fmnist", "text"], choices=list(TASKS),
                    help="lm (the communication-bound transformer) runs only when named")
    ap.add_argument("--arms", nargs="+", choices=list(DDP_ARMS + ADACOMP_ARMS),
                    help="arms for every task (default: the size's list; lm has its own)")
    ap.add_argument("--max-seconds", type=float, help="training clock limit per arm, every task (default: the "
                    "size's, lm its own)")
    ap.add_argument("--max-epochs", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--lm-eval-every", type=int, default=5, help="lm: evaluate every N steps (local-step arms: "
                    "at the first multiple of H at or after it)")
    ap.add_argument("--local-every", type=int, help="H (local_steps.every) of every local-step arm, every task "
                    f"(default per task: {LOCAL_EVERY})")
    ap.add_argument("--acc-target", type=float)
    ap.add_argument("--loss-target", type=float)
    ap.add_argument("--lm-target", type=float, help="lm: held-out loss target, nats / char")
    ap.add_argument("--merge", action="store_true", help="keep the rows of time_to_accuracy.json that this run "
                    "does not re-measure (run tasks / links as separate jobs)")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from time_to_accuracy.json, "
                    "measuring nothing")
    ap.add_argument("--prefix", default=PREFIX)
    ap.add_argument("--out-dir", default=RESULTS, help="relative to the current directory (default: %(default)s)")
    add_role_arguments(ap)
    args = ap.parse_args(own)
    args.argv = own
    size = SIZES[args.size]
    args.acc_target = args.acc_target or size["acc_target"]
    args.loss_target = args.loss_target or size["loss_target"]
    args.lm_target = args.lm_target or size["lm_target"]
    args.train_limit, args.test_limit, args.text_windows = size["train_limit"], size["test_limit"], size["text_windows"]
    args.text_test = size["text_test"]
    if args.report_only:
        args.merge = True
        report([], args)
        return 0
    return run_role(args, rest, lambda: worker(args), lambda: drive(args, own))


if __name__ == "__main__":
    raise SystemExit(main())
