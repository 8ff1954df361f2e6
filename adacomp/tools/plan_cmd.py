"""``adacomp plan --config X``: profile a model, print ByteComp's per-tensor plan (bytecomp.txt §4).

Profiles the backward pass of the config's built-in model (when each gradient becomes ready) and
the compressor's compress / decompress time per tensor size, models communication with the
alpha-beta model, then prints the option of every tensor and the predicted iteration time of the
plan, of compress-all and of compress-none, and how long the decision took. One process: alpha and
beta come from the command line or the bytecomp policy keys (defaults: 50 us, 10 Gbit/s).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

DEFAULT_ALPHA, DEFAULT_BETA = 50e-6, 8 / 10e9


def profile_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 20,
                     names: list[str] | None = None) -> tuple[dict[str, float], float]:
    """Median time from the start of ``backward()`` to each gradient being ready, and the median
    forward time, over ``steps`` iterations (the first few are dropped as warm-up)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad and (names is None or n in names)]
    samples: dict[str, list[float]] = {n: [] for n, _ in params}
    t_bwd = [0.0]
    hooks = [p.register_post_accumulate_grad_hook(
        lambda p, n=n: samples[n].append(time.perf_counter() - t_bwd[0])) for n, p in params]
    fwd = []
    try:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            t_bwd[0] = time.perf_counter()
            fwd.append(t_bwd[0] - t0)
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
    skip = min(max(1, steps // 5), steps - 1)
    return ({n: statistics.median(v[skip:]) for n, v in samples.items() if v[skip:]},
            statistics.median(fwd[skip:]))


def make_plan(cfg: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, world: int, alpha: float,
              beta: float, steps: int = 20, repeats: int = 20, divisible: bool = False, offload: str = "auto",
              polish: bool = True) -> dict[str, Any]:
    """Profile and decide; returns tensors (backward order), options, predictions, candidates."""
    import adacomp
    from adacomp import compressors
    from adacomp.backends.base import LocalBackend
    from adacomp.policies.bytecomp import decide, uses_feedback
    from adacomp.policies.timeline import TensorProfile, cost_model, profile_compressor, size_grid

    static = dict(cfg.to_dict(), policy={"name": "static"})
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=model.named_parameters(), config=static,
                                       backend=LocalBackend())
    candidates = {n for n, _ in opt.params if opt.route_of(n).compressor.name != "none"}
    opt.remove_hooks()
    ready, forward_s = profile_backward(model, x, y, steps)
    order = sorted(ready, key=lambda n: ready[n])
    params = dict(model.named_parameters())
    comp = compressors.get(cfg.compressor.name, **cfg.compressor.params)
    tensors, prev = [], 0.0
    for n in order:
        p = params[n]
        tensors.append(TensorProfile(n, p.numel() * p.element_size(), ready[n] - prev,
                                     comp.payload_bytes(p.shape, p.element_size())))
        prev = ready[n]
    device = x.device
    grid = size_grid([params[n].numel() for n in candidates])
    fb = uses_feedback(cfg)
    ct, dt = profile_compressor(comp, grid, device, repeats, feedback=fb) if grid else (None, None)
    cct, cdt = (ct, dt) if device.type == "cpu" or not grid else \
        profile_compressor(comp, grid, "cpu", repeats, feedback=fb)
    # no grid: no candidates, so the None profiles are never called
    model_ = cost_model(world, alpha, beta, {"device": ct, "cpu": cct}, {"device": dt, "cpu": cdt}, forward_s)  # type: ignore[dict-item]
    use_offload = offload == "on" or (offload == "auto" and device.type == "cuda")
    cand_idx = {i for i, t in enumerate(tensors) if t.name in candidates}
    S, pred = decide(tensors, model_, divisible, use_offload, cand_idx, polish)
    return {"tensors": tensors, "options": S, "predicted": pred, "candidates": candidates,
            "cost_model": model_, "world": world, "alpha": alpha, "beta": beta}


def render(plan: dict[str, Any]) -> str:
    rows = [f"{'#':>3}  {'tensor':<28} {'MB':>8} {'compute ms':>10}  option"]
    for i, (t, o) in enumerate(zip(plan["tensors"], plan["options"])):
        mark = "" if t.name in plan["candidates"] else "  (not compressible: min_numel / layers)"
        rows.append(f"{i:>3}  {t.name:<28} {t.nbytes / 2**20:>8.3f} {t.compute_s * 1e3:>10.3f}  {o}{mark}")
    p = plan["predicted"]
    rows += ["", f"world {plan['world']}, alpha {plan['alpha'] * 1e6:.1f} us, "
                 f"bandwidth {8e-9 / plan['beta'] if plan['beta'] else float('inf'):.2f} Gbit/s",
             f"predicted iteration time  plan: {p['plan_s'] * 1e3:.3f} ms   compress-all: "
             f"{p['compress_all_s'] * 1e3:.3f} ms   compress-none: {p['compress_none_s'] * 1e3:.3f} ms"]
    extra = [f"{label}: {p[key] * 1e3:.3f} ms" for key, label in
             (("compress_all_alltoall_s", "compress-all (device+alltoall)"),
              ("offload_all_s", "compress-all (cpu+allgather)")) if key in p]
    if extra:
        rows.append("                          " + "   ".join(extra))
    rows.append(f"decision time: {p['decision_s'] * 1e3:.1f} ms")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adacomp plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="YAML config (compressor, layers, min_numel, train.model)")
    ap.add_argument("--world", type=int, help="number of ranks to plan for (default: train.workers)")
    ap.add_argument("--alpha", type=float, help="latency in seconds (default: policy.alpha or 50e-6)")
    ap.add_argument("--beta", type=float, help="seconds per byte (default: policy.beta or 8e-10 = 10 Gbit/s)")
    ap.add_argument("--steps", type=int, default=20, help="profiled iterations (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=20, help="runs per size for compression times")
    ap.add_argument("--divisible", action="store_true", help="also consider alltoall + allgather")
    ap.add_argument("--offload", choices=("auto", "on", "off"), default="auto", help="Alg. 2 CPU offload")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    from adacomp.config import ConfigError, load
    from adacomp.datasets.digits import digits
    from adacomp.models import build
    cfg = load(args.config)
    if args.steps < 2 or args.repeats < 1:
        raise ConfigError("plan", f"--steps must be >= 2 and --repeats >= 1, got {args.steps}, {args.repeats}")
    pol = dict(cfg.policy.params) if cfg.policy.name == "bytecomp" else {}
    alpha = args.alpha if args.alpha is not None else (pol.get("alpha") or DEFAULT_ALPHA)
    beta = args.beta if args.beta is not None else (pol.get("beta") or DEFAULT_BETA)
    torch.manual_seed(cfg.train.seed)
    model = build(cfg.train.model, **({"inputs": 64} if cfg.train.model == "mlp" else {})).to(args.device)
    x, y, _, _ = digits(seed=cfg.train.seed)
    x, y = x[: cfg.train.batch_size].to(args.device), y[: cfg.train.batch_size].to(args.device)
    plan = make_plan(cfg, model, x, y, args.world or cfg.train.workers, alpha, beta, args.steps,
                     args.repeats, args.divisible, args.offload)
    print(render(plan))
    return 0
