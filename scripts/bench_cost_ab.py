#!/usr/bin/env python
"""Single-tensor CPU time (``time.process_time``, 1 thread, fastest of 4 calls) of compress and
decompress: the before/after table in the notes of docs/results/cost.md. CPU time is steadier than
wall time on a shared machine (preemption does not count). Run once per checkout:

    PYTHONPATH=<checkout> python scripts/bench_cost_ab.py
"""
from __future__ import annotations

import json
import time

import torch

import adacomp.compressors as C

CASES = (((4096, 4096), ("qsgd", "efsignsgd", "adtopk", "topk")), ((4096, 25088), ("adtopk", "topk")))


def cpu_ms(fn, repeats: int = 4) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return 1e3 * best


def main() -> None:
    torch.set_num_threads(1)
    out: dict[str, object] = {}
    for shape, names in CASES:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        buf = torch.empty_like(x)
        out[f"pass {shape}"] = cpu_ms(lambda: torch.abs(x, out=buf))
        for name in names:
            c = C.get(name) if name in ("qsgd", "efsignsgd") else C.get(name, density=0.01)
            p, ctx = c.compress(x, "a")
            out[f"{name} {shape}"] = (cpu_ms(lambda: c.compress(x, "a")), cpu_ms(lambda: c.decompress(p, ctx)))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
