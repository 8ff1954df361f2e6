"""Single-tensor CPU time (``time.process_time``, 1 thread, fastest of 4 calls) of compress and
decompress: the before/after table in the notes of docs/results/cost.md. CPU time is steadier than
wall time on a shared machine (preemption does not count). Run once per checkout:

    PYTHONPATH=<checkout> python -m adacomp.bench.cost_ab      # or: adacomp bench cost_ab
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

import adacomp.compressors as C
from adacomp.tools.stepclock import time_steps

LAUNCH = "adacomp bench cost_ab"  # one process; run once per checkout

CASES = (((4096, 4096), ("qsgd", "efsignsgd", "adtopk", "topk")), ((4096, 25088), ("adtopk", "topk")))


def cpu_ms(fn: Callable[[], object], repeats: int = 4) -> float:
    """Fastest CPU time of ``repeats`` calls after one warm-up call, in ms."""
    return 1e3 * min(time_steps(fn, repeats, 1, clock=time.process_time))


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="adacomp bench cost_ab", description=(__doc__ or "").split("\n\n")[0]).parse_args(argv)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
