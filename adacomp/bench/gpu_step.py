"""One training step on a GPU per method: compression time as a share of backward, error feedback's
extra GPU memory, and how much of the offload path's host compression hides behind backward (issue 33).

One process, one GPU, adacomp's ``LocalBackend`` (world 1, no transport): what a method's step costs
beyond the plain step (``torch.optim.SGD`` alone) is its own work on the device (error feedback,
compress, decompress, the communicator's packing and unpacking), which is what it adds to every rank of a
real job before any byte moves. Backward is timed with CUDA events around ``loss.backward()``; a step is
timed on the host with a device synchronisation at its end. Arms alternate round-robin (``--rounds``) so
clocks and caches treat them alike; every cell is a median over rounds x steps. Local-step methods
(outer loop every ``--every`` inner steps) are timed over whole windows, so their cell is the mean cost
per inner step. Memory: ``torch.cuda.memory_allocated`` held between steps beyond the plain step's
(residuals, outer-loop copies, reused buffers) and the peak beyond the plain step's peak.

    adacomp bench gpu_step                                   # ResNet-50 (batch 64) and GPT-2 small (8 x 1024)
    adacomp bench gpu_step --models gpt2_small --methods topk sparseloco --rounds 1

``--front hook``: the same step through adacomp's DDP communication hook, on a DDP model over NCCL with
one process (world 1: DDP still hands every bucket to the hook); the baseline is plain DDP (its own
allreduce) and PyTorch's bf16 hook runs beside it. ``--sites`` records where each host wait comes from
(the innermost adacomp frame) and the step's heaviest device kernels (torch.profiler), for the fused-kernel
work.

Writes docs/results/gpu_step.{md,json} (``--out-dir``; the hook front end gpu_step_hook.*). Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import collections
import copy
import gc
import os
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from adacomp.bench.common import RESULTS, bench_command, write_result

LAUNCH = "adacomp bench gpu_step"  # one process, one GPU

METHODS = ["bf16", "topk", "adtopk", "adtopk_i", "mstopk", "gaussiank", "dgc", "redsync", "sidco", "oktopk",
           "randomk", "qsgd", "efsignsgd", "powersgd", "acpsgd", "offload", "localsgd", "diloco_topk", "sparseloco"]
BATCH = {"resnet50": 64, "gpt2_small": 8}
MODEL_ARGS: dict[str, dict[str, int]] = {"gpt2_small": {"seq": 1024}}
OFFLOAD = {"compressor": {"name": "topk", "density": 0.01}, "memory": {"name": "residual"},
           "communicator": {"name": "allgather"}, "min_numel": 1024, "layers": [{"match": "*", "offload": True}]}
"""ByteComp's "compress on CPU" (§4.2, Alg. 2) for every tensor: Top-k 1 % with residuals on the host."""


KNOBS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "counts": ("module", "adacomp.compressors.sparse:BATCHED_COUNTS", {v: v for v in ("auto", "sort", "bucket", "off")}),
    "upload": ("module", "adacomp.devices:PINNED_UPLOAD", {"pinned": True, "pageable": False}),
    "fuse": ("config", "fusion.fuse_before_compress", {"1": True, "0": False}),
}
"""What an arm ``method@knob=value[,knob=value]`` changes for its rounds only (an A/B in one process):
a module setting, restored after the round, or a config key."""


def parse_arm(name: str) -> tuple[str, dict[str, Any]]:
    """``"mstopk@counts=off"`` -> ``("mstopk", {"counts": "off"})``; unknown knobs or values name the choices."""
    method, _, spec = name.partition("@")
    knobs: dict[str, Any] = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key not in KNOBS:
            raise ValueError(f"arm {name!r}: unknown knob {key!r}; choose one of {sorted(KNOBS)}")
        if value not in KNOBS[key][2]:
            raise ValueError(f"arm {name!r}: {key}={value!r}; choose one of {sorted(KNOBS[key][2])}")
        knobs[key] = value
    return method, knobs


class _Knobs:
    """Sets an arm's module knobs for the duration of a ``with`` block."""

    def __init__(self, knobs: dict[str, Any]):
        self.knobs = knobs
        self.saved: dict[tuple[Any, str], Any] = {}

    def __enter__(self) -> None:
        import importlib
        for key, value in self.knobs.items():
            kind, where, values = KNOBS[key]
            if kind == "module":
                mod, attr = where.split(":")
                m = importlib.import_module(mod)
                self.saved[(m, attr)] = getattr(m, attr)
                setattr(m, attr, values[value])

    def __exit__(self, *exc: Any) -> None:
        for (m, attr), value in self.saved.items():
            setattr(m, attr, value)


def apply_config_knobs(cfg: dict[str, Any], knobs: dict[str, Any]) -> None:
    for key, value in knobs.items():
        kind, where, values = KNOBS[key]
        if kind == "config":
            *path, last = where.split(".")
            node = cfg
            for p in path:
                node = node.setdefault(p, {})
            node[last] = values[value]


HOOK_SKIP = {"offload", "localsgd", "diloco_topk", "sparseloco"}
"""Not per-step DDP hook methods: offload is the optimizer's host path, local steps the outer loop's."""


class _Device:
    """The few device calls the bench makes; ``cpu`` (a hidden option) runs the same code paths on
    the host so the bench itself can be checked where no GPU is lent."""

    def __init__(self, kind: str):
        self.kind = kind
        self.cuda = kind == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def held(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def name(self) -> str:
        return torch.cuda.get_device_name() if self.cuda else "CPU (bench check only)"

    def sync_debug(self, mode: str) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(mode)

    def autocast(self, amp: bool) -> Any:
        return torch.autocast(self.kind, dtype=torch.bfloat16, enabled=amp)


DEV = _Device("cuda")


def arm_config(method: str, every: int) -> tuple[dict[str, Any], int]:
    from adacomp.bench.zoo import arm_config as zoo_arm
    if method == "offload":
        return json.loads(json.dumps(OFFLOAD)), 0
    cfg, warm = zoo_arm(method)
    if "local_steps" in cfg:
        cfg["local_steps"] = {**cfg["local_steps"], "every": every}
    return cfg, warm


class Arm:
    """One method on the model: its optimizer, built fresh for each round (residuals start empty)."""

    def __init__(self, name: str, model: torch.nn.Module, data: Any, args: argparse.Namespace):
        self.name, self.model, self.data, self.args = name, model, data, args
        self.cfg: dict[str, Any] | None = None
        self.warm = 0
        method, self.knobs = parse_arm(name)
        if method not in ("plain", "bf16_torch"):
            self.cfg, self.warm = arm_config(method, args.every)
            apply_config_knobs(self.cfg, self.knobs)
        self.local = self.cfg is not None and "local_steps" in self.cfg
        self.times: list[float] = []
        self.held: list[int] = []
        self.peak: list[int] = []
        self.offload_s: list[float] = []
        self.ratio: list[float] = []
        self.waits: list[int] = []
        self.sites: collections.Counter[str] = collections.Counter()
        self.kernels: list[dict[str, Any]] = []
        self._state: Any = None

    def _optimizer(self) -> tuple[torch.nn.Module, Any, Callable[[], None]]:
        import adacomp
        from adacomp.backends.base import LocalBackend
        inner = torch.optim.SGD(self.model.parameters(), lr=0.0)
        opt: Any = inner if self.cfg is None else adacomp.DistributedOptimizer(
            inner, self.model.named_parameters(), config=self.cfg, backend=LocalBackend())
        return self.model, opt, (lambda: opt.remove_hooks()) if self.cfg is not None else (lambda: None)

    def _ddp(self) -> tuple[torch.nn.Module, Any, Callable[[], None]]:
        import adacomp
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(copy.deepcopy(self.model), device_ids=[torch.cuda.current_device()] if DEV.cuda else None)
        state: Any = None
        if self.name == "bf16_torch":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif self.cfg is not None:
            state = adacomp.ddp.register(ddp, self.cfg, named_parameters=ddp.module.named_parameters())
        self._state = state
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.0), lambda: None

    def _stats(self, opt: Any) -> Any:
        return getattr(self._state if self._state is not None else opt, "last_stats", None)

    def round(self, base_held: int) -> None:
        with _Knobs(self.knobs):
            self._round(base_held)

    def _round(self, base_held: int) -> None:
        args = self.args
        model, opt, close = self._ddp() if args.front == "hook" else self._optimizer()
        amp = DEV.autocast(args.amp)

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            with amp:
                loss = self.data.loss(model)
            loss.backward()
            opt.step()
            DEV.sync()

        n = args.steps if not self.local else args.every * max(1, args.steps // args.every)
        warm = max(args.warmup, self.warm) if not self.local else 2 * args.every
        for _ in range(warm):
            step()
        DEV.reset_peak()
        t: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            t.append(time.perf_counter() - t0)
            st = self._stats(opt)
            if st is not None:
                if "offload_s" in st.extra:
                    self.offload_s.append(st.extra["offload_s"])
                if st.dense_bytes:
                    self.ratio.append(st.dense_bytes / max(st.bytes_sent, 1))
        self.times.append(statistics.fmean(t) if self.local else statistics.median(t))
        n_waits, sites = host_waits(step)
        self.waits.append(n_waits)
        self.held.append(DEV.held() - base_held)
        self.peak.append(DEV.peak())
        if args.sites and not self.kernels:
            self.sites.update(sites)
            self.kernels = heaviest_kernels(step)
        close()
        self._state = None
        del opt, model
        DEV.release()


def _site() -> str:
    """The innermost adacomp frame of the current stack (``module:line function``), this file's aside."""
    import traceback
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    for fr in reversed(traceback.extract_stack()):
        f = os.path.abspath(fr.filename)
        if f.startswith(root) and f != here:
            return f"{os.path.relpath(f, os.path.dirname(root))}:{fr.lineno} {fr.name}"
    return "(outside adacomp)"


def host_waits(step: Callable[[], None]) -> tuple[int, collections.Counter[str]]:
    """How often one step makes the host wait for the device, and where (:func:`_site` of each).
    On CUDA: torch's sync debug mode (the step's own closing synchronisation included). Elsewhere:
    :func:`emulated_reads`. Waits inside backward stop the host queueing ahead."""
    import warnings
    if not DEV.cuda:
        return emulated_reads(step)
    sites: collections.Counter[str] = collections.Counter()

    def show(message: Any, *a: Any, **k: Any) -> None:
        if "synchroniz" in str(message):
            sites[_site()] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        DEV.sync_debug("warn")
        try:
            step()
        finally:
            DEV.sync_debug("default")
    return sum(sites.values()), sites


READS = frozenset({"_local_scalar_dense", "nonzero", "argwhere", "masked_select", "_unique2", "unique_dim",
                   "unique_consecutive", "bincount", "repeat_interleave"})
"""aten ops that read a result back to the host (``item``, ``float``, ``bool``) or size their output by
the data: on a device, each one a wait."""


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def emulated_reads(step: Callable[[], None]) -> tuple[int, collections.Counter[str]]:
    """The reads of one step that would wait for a device, counted on the host, and where
    (:func:`_site`): the aten ops of :data:`READS` and indexing by a mask (a dispatch mode, which
    backward's hooks run under too), and ``Tensor.tolist`` / ``numpy`` (no aten op on the CPU).
    Run with ``ADACOMP_EMULATE_ACCELERATOR=1 ADACOMP_NATIVE=0`` it counts the accelerators' code
    path on the CPU. An upper bound: reads of tensors that stay on the host on a GPU count too."""
    from torch.utils._python_dispatch import TorchDispatchMode
    sites: collections.Counter[str] = collections.Counter()

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.overloadpacket.__name__
            if name in READS or (name in ("index", "index_put", "index_put_") and _bool_index(args[1])):
                sites[_site()] += 1
            return func(*args, **(kwargs or {}))

    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            sites[_site()] += 1
            return original(self, *a, **k)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        with Reads():
            step()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return sum(sites.values()), sites


def heaviest_kernels(step: Callable[[], None], top: int = 12) -> list[dict[str, Any]]:
    """One step under torch.profiler: the ops with the most device time (self), with their counts."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if DEV.cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        step()
    rows = []
    for ev in prof.key_averages():
        dev = getattr(ev, "self_device_time_total", None)
        if dev is None:
            dev = getattr(ev, "self_cuda_time_total", 0)
        rows.append({"op": ev.key, "count": ev.count, "self_device_us": float(dev or 0),
                     "self_cpu_us": float(ev.self_cpu_time_total)})
    rows.sort(key=lambda r: -r["self_device_us"])
    return rows[:top]


def backward_ms(model: torch.nn.Module, data: Any, amp: bool, n: int) -> float:
    """Median milliseconds of ``loss.backward()`` alone (CUDA events)."""
    out = []
    for i in range(n + 3):
        model.zero_grad(set_to_none=False)
        with DEV.autocast(amp):
            loss = data.loss(model)
        if not DEV.cuda:
            t0 = time.perf_counter()
            loss.backward()
            if i >= 3:
                out.append(1e3 * (time.perf_counter() - t0))
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        loss.backward()
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            out.append(a.elapsed_time(b))
    return statistics.median(out)


def run_model(name: str, args: argparse.Namespace, say: Callable[[str], None]) -> list[dict[str, Any]]:
    from adacomp.models import build, synthetic_batch
    torch.manual_seed(0)
    model = build(name, **{**MODEL_ARGS.get(name, {}), **args.model_args}).to(DEV.kind)
    batch = args.batch or BATCH[name]
    data = synthetic_batch(model, batch, seed=0).to(DEV.kind)
    bwd = backward_ms(model, data, args.amp, 10)
    model.zero_grad(set_to_none=False)
    DEV.sync()
    DEV.release()
    base_held = DEV.held()  # parameters, gradients, the batch
    methods = [m for m in args.methods if parse_arm(m)[0] not in HOOK_SKIP] if args.front == "hook" else args.methods
    baselines = ["plain", "bf16_torch"] if args.front == "hook" and DEV.cuda else ["plain"]  # NCCL only
    arms = {a: Arm(a, model, data, args) for a in [*baselines, *methods]}
    order = list(arms)
    for r in range(args.rounds):
        for a in order[r % len(order):] + order[:r % len(order)]:
            arms[a].round(base_held)
            say(f"{name} round {r + 1}/{args.rounds} {a:<12} {1e3 * arms[a].times[-1]:8.2f} ms/step")
    for a, arm in arms.items():  # the work happened: each method synchronised, and compressed what it claims
        if a in ("plain", "bf16_torch"):
            continue
        if not arm.ratio:
            raise RuntimeError(f"gpu_step: {a} recorded no synchronisation on {name}")
        if not arm.local and parse_arm(a)[0] != "bytecomp" and statistics.median(arm.ratio) <= 1.0:
            raise RuntimeError(f"gpu_step: {a} sent dense bytes on {name} (ratio {statistics.median(arm.ratio):.2f})")
    plain = arms["plain"]
    p_ms = 1e3 * statistics.median(plain.times)
    p_held, p_peak = statistics.median(plain.held), statistics.median(plain.peak)
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for a, arm in arms.items():
        ms = 1e3 * statistics.median(arm.times)
        off = statistics.median(arm.offload_s) * 1e3 if arm.offload_s else None
        extra = ms - p_ms
        rows.append({
            "model": name, "params_m": params / 1e6, "batch": batch, "amp_bf16": args.amp, "method": a,
            "backward_ms": bwd, "step_ms": ms, "plain_step_ms": p_ms, "extra_ms": extra,
            "share_of_backward": extra / bwd, "extra_held_mib": (statistics.median(arm.held) - p_held) / 2 ** 20,
            "extra_peak_mib": (statistics.median(arm.peak) - p_peak) / 2 ** 20,
            "param_mib": params * 4 / 2 ** 20, "compression": statistics.median(arm.ratio) if arm.ratio else None,
            "offload_host_ms": off,
            "offload_hidden": None if off is None else max(0.0, min(1.0, 1.0 - extra / off)),
            "local_every": args.every if arm.local else None, "host_waits": max(arm.waits),
            "rounds_ms": [1e3 * t for t in arm.times], "front": args.front,
            "wait_sites": dict(arm.sites.most_common(12)), "kernels": arm.kernels})
    del model, data, arms
    DEV.release()
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_step_hook" if args.front == "hook" else "gpu_step"
    (out / f"{stem}.json").write_text(json.dumps({"rows": rows, "gpu": DEV.name(),
                                                   "command": args.command}, indent=1))
    front = ("adacomp's DDP hook on a DDP model over NCCL, world 1; `plain` = DDP's own allreduce, `bf16_torch` = "
             "PyTorch's bf16 hook" if args.front == "hook" else "`LocalBackend` (no transport)")
    lines = [f"GPU: {DEV.name()}; one process, {front}, "
             f"{'bf16 autocast' if args.amp else 'fp32'} forward, fp32 gradients, lr 0 (every step the same work); "
             f"{args.rounds} round(s) x ({args.warmup} warm-up + {args.steps} measured steps), arms alternating. "
             "`extra` = method step - plain step (median); `share` = extra / backward; `held` = device memory kept "
             "between steps beyond the plain step's; `peak` = peak beyond the plain step's peak. Local-step methods: "
             f"outer sync every {args.every} inner steps, cost averaged per inner step.", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        mr = [r for r in rows if r["model"] == model]
        r0 = mr[0]
        lines += [f"## {model} ({r0['params_m']:.1f}M parameters, {r0['param_mib']:.0f} MiB fp32; batch {r0['batch']})",
                  "", f"backward {r0['backward_ms']:.1f} ms, plain step {r0['plain_step_ms']:.1f} ms", "",
                  "| method | step ms | extra ms | share of backward | held MiB | peak MiB | compression | waits | offload |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in mr:
            if r["method"] == "plain":
                continue
            off = "" if r["offload_host_ms"] is None else \
                f"host {r['offload_host_ms']:.1f} ms, {100 * r['offload_hidden']:.0f}% hidden"
            comp = "" if r["compression"] is None else f"{r['compression']:.1f}x"
            lines.append(f"| {r['method']} | {r['step_ms']:.1f} | {r['extra_ms']:.1f} | "
                         f"{100 * r['share_of_backward']:.0f}% | {r['extra_held_mib']:.0f} | {r['extra_peak_mib']:.0f} | "
                         f"{comp} | {r['host_waits']} | {off} |")
        lines.append("")
    write_result(out / f"{stem}.md", "One training step on a GPU per method", lines, args.command)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adacomp bench gpu_step", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(BATCH), choices=list(BATCH))
    ap.add_argument("--methods", nargs="+", default=METHODS,
                    help="arms; method@knob=value[,...] runs a method with a setting changed, for an A/B in one "
                         f"process (knobs: {', '.join(f'{k}={{{chr(124).join(v[2])}}}' for k, v in KNOBS.items())})")
    ap.add_argument("--batch", type=int, default=0, help="0: the model's default in BATCH")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=8, help="local-step methods: inner steps per outer sync")
    ap.add_argument("--no-amp", dest="amp", action="store_false", help="fp32 forward (default: bf16 autocast)")
    ap.add_argument("--front", choices=["optimizer", "hook"], default="optimizer",
                    help="hook: adacomp's DDP communication hook on DDP over NCCL (one process)")
    ap.add_argument("--sites", action="store_true",
                    help="record each method's host-wait sites and heaviest kernels in the JSON")
    ap.add_argument("--out-dir", default=RESULTS)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--model-args", type=json.loads, default={}, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for m in args.methods:
        try:
            parse_arm(m)
        except ValueError as e:
            ap.error(str(e))
    global DEV
    DEV = _Device(args.device)
    if DEV.cuda and not torch.cuda.is_available():
        ap.error("needs a CUDA device (no GPU visible to torch)")
    if args.front == "hook" and not torch.distributed.is_initialized():
        import tempfile
        store = tempfile.NamedTemporaryFile(prefix="adacomp_gpu_step_", delete=False).name
        torch.distributed.init_process_group("nccl" if DEV.cuda else "gloo", init_method=f"file://{store}",
                                             rank=0, world_size=1)
    args.command = bench_command("gpu_step", argv)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for m in args.models:
        rows += run_model(m, args, lambda s: print(f"[{time.perf_counter() - t0:6.0f}s] {s}", flush=True))
        report(rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
