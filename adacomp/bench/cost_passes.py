"""The package's fused C passes, timed pass by pass against another version's library in one process.

A cost cell (``adacomp bench cost cell``) moves by ~10 % from run to run on a shared machine, more
than a kernel change is worth. Here both libraries, this checkout's and the one built from another
version's C (``--against``: a git revision of this repository or a path to a ``_native.py``), are
loaded side by side and alternate round by round over the same arrays, so both see the same machine.
Each pass runs over every tensor of a zoo model's gradient shapes with at least 2^16 elements, each
tensor its own arrays (they stream from memory as in a step; iid normal values), and must answer
(a pass that declined would time nothing). Printed per pass and model: the median over ``--rounds``
of each round's best of three, in ms over the model, and after / before. The passes use the C
functions as the compressors call them; only the library differs, and the two must give the same
bits on the first tensor (results and written output) or the run stops: a speed-up never changes a
result.
"""
from __future__ import annotations

import argparse
import ast
import ctypes
import json
import math
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from adacomp.bench.cost_shapes import MODELS, model_shapes

MIN_NUMEL = 1 << 16  # below this the passes are cached and the selections take other paths
THRESHOLD = 2.7  # |x| of iid N(0, 1.25) sums above it: ~1.6 %, a Top-k prefilter's share
SECOND_THRESHOLD = 1.2  # |r| of the residual r ~ N(0, 0.25) above it: ~1.6 %, the same share
CHUNK, CHUNK_K = 4096, 82  # Chunk-Top-k's defaults (density 0.02)


@dataclass
class Arrays:
    """One tensor's inputs and output; what other passes need is made on first use (``extra``)."""

    shape: tuple[int, ...]
    g: Tensor
    r: Tensor
    out: Tensor
    extra: dict[str, Tensor] = field(default_factory=dict)  # what other passes read or write, made on first use

    @property
    def n(self) -> int:
        return self.g.numel()

    def buffer(self, key: str, numel: int, dtype: torch.dtype) -> Tensor:
        got = self.extra.get(key)
        if got is None:
            got = self.extra[key] = torch.empty(numel, dtype=dtype)
        return got


def _rows(a: Arrays) -> Any:
    """ADTopk's row pass with the add, over the tensor as (first dim, the rest)."""
    from adacomp.compressors import _native
    m = a.shape[0]
    cols = a.n // m
    blocks = min(32, cols)
    return _native.row_candidates(a.out.view(m, cols), max(1, blocks // 8), blocks, 1e-30, 0.02, 1 << 40,
                                  add=(a.g.view(m, cols), a.r.view(m, cols)), signed=True)


def _qsgd(a: Arrays) -> bool:
    """QSGD's coding pass (4 bits, buckets of 512, ``rng: counter``) with its bucket norms."""
    from adacomp.compressors import _native
    size, nb = 512, -(-a.n // 512)
    return _native.qsgd_compress(a.g, nb * size, a.buffer("safe", nb, torch.float32), size, 15, 4, None,
                                 a.buffer("codes", -(-a.n * 4 // 8), torch.uint8),
                                 norms=a.buffer("norms", nb, torch.float32), key=(12345, 678))


def _from_bf16(a: Arrays) -> bool:
    """bf16's decoding pass (the gradient rounded to bfloat16, widened back)."""
    from adacomp.compressors import _native
    src = a.extra.get("bf16_in")
    if src is None:
        src = a.extra["bf16_in"] = a.g.to(torch.bfloat16)
    return _native.from_bf16(src, a.out)


def _factors(a: Arrays, rank: int = 4) -> tuple[int, int, Tensor, Tensor, Tensor]:
    """The tensor as a (first dim, the rest) matrix and rank-``rank`` factors P0, Q0 and Q for it
    (made once, seeded)."""
    rows = a.shape[0]
    cols = a.n // rows
    if "p0" not in a.extra:
        gen = torch.Generator().manual_seed(1)
        a.extra.update(p0=torch.randn(rows, rank, generator=gen), q0=torch.randn(cols, rank, generator=gen),
                       q=torch.randn(cols, rank, generator=gen))
    return rows, cols, a.extra["p0"], a.extra["q0"], a.extra["q"]


def _owed_mm(a: Arrays) -> Any:
    """PowerSGD's compensation with its residual owed and its first product, in one pass."""
    from adacomp.compressors import _native
    rows, cols, p0, q0, q = _factors(a)
    return _native.owed_mm(a.g.view(rows, cols), a.r.view(rows, cols), p0, q0, a.out.view(rows, cols), q)


def _outer_sub(a: Arrays) -> bool:
    """ACP-SGD's residual of a low-rank step, added to the next gradient (``g + (a - P Q^T)``)."""
    from adacomp.compressors import _native
    rows, cols, p0, q0, _ = _factors(a)
    return _native.outer_fma_sub(a.r.view(rows, cols), p0, q0, a.out.view(rows, cols), g=a.g.view(rows, cols))


def _momentum(a: Arrays) -> Any:
    """DGC's momentum correction with its candidates (u, v: seeded values made once)."""
    from adacomp.compressors import _native
    if "u" not in a.extra:
        gen = torch.Generator().manual_seed(2)
        a.extra.update(u=torch.randn(a.n, generator=gen), v=torch.randn(a.n, generator=gen))
    return _native.momentum_select(a.extra["u"], a.g, a.extra["v"], a.buffer("u_out", a.n, torch.float32), a.out,
                                   0.9, 4.0, 0.02)


def _payloads(a: Arrays) -> tuple[list[Tensor], list[Tensor]]:
    """Two ranks' sparse payloads of a tensor (1 % each, ascending positions; seeded, made once): what
    a world of two's mean reads."""
    if "sm_idx0" not in a.extra:
        gen = torch.Generator().manual_seed(3)
        k = max(1, a.n // 100)
        for rank in range(2):
            a.extra[f"sm_idx{rank}"] = torch.randperm(a.n, generator=gen)[:k].sort().values
            a.extra[f"sm_vals{rank}"] = torch.randn(k, generator=gen)
    return [a.extra["sm_idx0"], a.extra["sm_idx1"]], [a.extra["sm_vals0"], a.extra["sm_vals1"]]


def _sparse_mean(a: Arrays) -> bool:
    """The ranks' dense mean (every sparsifier's aggregation; streamed from 2^16 elements)."""
    from adacomp.compressors import _native
    idx, vals = _payloads(a)
    return _native.sparse_mean(a.out, idx, vals, 2)


def _sparse_mean_add_select(a: Arrays) -> Any:
    """alltoall's second stage: the ranks' mean added to the kept error unwritten, with the candidates."""
    from adacomp.compressors import _native
    idx, vals = _payloads(a)
    return _native.sparse_mean_add_select(a.r, a.out, idx, vals, 2, SECOND_THRESHOLD, 0.02)


def _row_stats(a: Arrays) -> Any:
    """ADTopk's per-row order statistics of its candidates (q = 1 % of a row; ~1.4 q + 2 candidates
    a row, the row's first magnitudes)."""
    from adacomp.compressors import _native
    rows = a.shape[0]
    cols = a.n // rows
    q = max(1, cols // 100)
    per = min(cols, 14 * q // 10 + 2)
    if "rs_rows" not in a.extra:
        a.extra["rs_mag"] = a.g.view(rows, cols)[:, :per].abs().contiguous().view(-1)
        a.extra["rs_rows"] = torch.arange(rows).repeat_interleave(per)
    return _native.row_order_stats(a.extra["rs_mag"], a.extra["rs_rows"], rows, q, per)


def _passes() -> dict[str, Callable[[Arrays], Any]]:
    """Pass name -> a call that returns something truthy where the C pass ran."""
    from adacomp.compressors import _native
    return {
        "add_select": lambda a: _native.add_select(a.g, a.r, a.out, THRESHOLD, 0.02),
        "add_abs_stats": lambda a: _native.add_abs_stats(a.g, a.r, a.out, THRESHOLD, True, 0.02).done,
        "add_moments_select": lambda a: _native.add_moments_select(a.g, a.r, a.out, THRESHOLD, 0.02),
        "chunk_scan": lambda a: _native.chunk_topk(a.out, a.n // CHUNK, CHUNK, CHUNK_K, add=(a.g, a.r)),
        "row_candidates": _rows,
        "row_order_stats": _row_stats,
        "select": lambda a: _native.select(a.g, THRESHOLD, "abs_ge", 0.02),
        "add": lambda a: _native.add_into(a.g, a.r, a.out),
        "momentum_select": _momentum,
        "add_cascade": lambda a: _native.add_cascade(a.g, a.r, a.out, absolute=True, signs=True),
        "to_bf16": lambda a: _native.to_bf16(a.g, a.buffer("bf16", a.n, torch.bfloat16)),
        "from_bf16": _from_bf16,
        "qsgd": _qsgd,
        "owed_mm": _owed_mm,
        "outer_fma_sub": _outer_sub,
        "sparse_mean": _sparse_mean,
        "sparse_mean_add_select": _sparse_mean_add_select,
    }


def source_of(module_text: str) -> str:
    """The C text (``_SOURCE``) of a ``_native.py``'s text."""
    for node in ast.parse(module_text).body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_SOURCE" for t in node.targets)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return node.value.value
    raise ValueError("no module-level _SOURCE string in the given _native.py")


def against_library(spec: str) -> ctypes.CDLL:
    """The library of ``spec``: a path to a ``_native.py``, or a git revision of this repository."""
    from adacomp.compressors import _native
    path = Path(spec)
    if path.is_file():
        text = path.read_text()
    else:
        root = Path(_native.__file__).resolve().parents[2]
        proc = subprocess.run(["git", "show", f"{spec}:adacomp/compressors/_native.py"], cwd=root,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise ValueError(f"--against {spec!r}: neither a file nor a revision of {root} "
                             f"({proc.stderr.strip()[:200]})")
        text = proc.stdout
    try:
        return _native._build(source_of(text))
    except AttributeError as exc:  # _load declares a function the other version does not define
        raise ValueError(f"--against {spec!r}: its C lacks a function this version declares ({exc}); "
                         "compare versions with the same C functions") from exc


def arrays_for(model: str) -> list[Arrays]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _, shape in model_shapes(model):
        n = math.prod(shape)
        if n < MIN_NUMEL:
            continue
        out.append(Arrays(tuple(shape), torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.5,
                          torch.empty(n)))
    return out


def _snapshot(x: Any) -> Any:
    """``x`` with its tensors copied (a pass's results may be views of reused scratch)."""
    if isinstance(x, Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return [_snapshot(y) for y in x]
    return x


def _same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def time_pass(fn: Callable[[Arrays], Any], arrays: list[Arrays], libs: dict[str, ctypes.CDLL],
              rounds: int) -> dict[str, float]:
    """Median over ``rounds`` of each library's best of three passes over ``arrays``, in seconds; the
    libraries alternate, their order flipped every round. First every library must run the pass on
    every tensor, and give the same bits (results and written output) on the first one."""
    from adacomp.compressors import _native
    names = list(libs)
    saved = _native._lib
    times: dict[str, list[float]] = {k: [] for k in names}
    try:
        seen: list[Any] = []
        for name in names:  # each must run the pass (and warms its pages)
            _native._lib = libs[name]
            for i, a in enumerate(arrays):
                got = fn(a)
                if not (got if isinstance(got, bool) else got is not None):
                    raise RuntimeError(f"the pass declined on a tensor of shape {a.shape} with the {name} library")
                if i == 0:
                    seen.append(_snapshot([got, a.out, *a.extra.values()]))
            if not _same_bits(seen[0], seen[-1]):
                raise RuntimeError(f"the {names[0]} and {name} libraries' results differ (shape {arrays[0].shape})")
        for rnd in range(rounds):
            for name in (names if rnd % 2 == 0 else names[::-1]):
                _native._lib = libs[name]
                best = math.inf
                for _ in range(3):
                    t0 = time.perf_counter()
                    for a in arrays:
                        fn(a)
                    best = min(best, time.perf_counter() - t0)
                times[name].append(best)
    finally:
        _native._lib = saved
    return {k: statistics.median(v) for k, v in times.items()}


def passes(args: argparse.Namespace) -> None:
    from adacomp.compressors import _native
    torch.set_num_threads(args.threads)
    table = _passes()
    chosen = args.passes.split(",") if args.passes else list(table)
    unknown = sorted(set(chosen) - set(table))
    if unknown:
        raise SystemExit(f"--passes: unknown {unknown}; valid: {sorted(table)}")
    bad = [m for m in args.models.split(",") if m not in MODELS and not (m.startswith("split") and m[5:].isdigit())]
    if bad:
        raise SystemExit(f"--models: unknown {bad}; valid: {sorted(MODELS)} or split<count>")
    mine = _native.library()
    if mine is None:
        raise SystemExit(f"the C library is unavailable here: {_native.why_unavailable()}")
    try:
        libs = {"before": against_library(args.against), "after": mine}
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    rows: list[dict[str, Any]] = []
    lines = [f"before = {args.against}, after = this checkout; ms over the model's tensors of >= 2^16 elements",
             "", "| pass | model | before ms | after ms | after / before |", "|---|---|---:|---:|---:|"]
    for model in args.models.split(","):
        arrays = arrays_for(model)
        for name in chosen:
            got = time_pass(table[name], arrays, libs, args.rounds)
            rows.append({"pass": name, "model": model, "before_s": got["before"], "after_s": got["after"],
                         "tensors": len(arrays)})
            lines.append(f"| {name} | {model} | {1e3 * got['before']:.2f} | {1e3 * got['after']:.2f} | "
                         f"{got['after'] / got['before']:.3f} |")
            print(lines[-1], flush=True)
        del arrays
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"against": args.against, "command": args.command, "rows": rows},
                                              indent=1))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("passes", help="the fused C passes, this library against another version's (see cost_passes)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="a git revision of this repository or a path to a _native.py")
    p.add_argument("--models", default="resnet50,gpt2_small",
                   help="comma-separated zoo models (or split<count>) whose tensor shapes are used")
    p.add_argument("--passes", default="", help=f"comma-separated (default: all of {', '.join(_passes())})")
    p.add_argument("--rounds", type=int, default=4, help="alternations of the two libraries (the median is kept)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the C passes run on one)")
    p.add_argument("--json", help="write the rows here too")
