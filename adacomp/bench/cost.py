"""Cost of every compression method on real architectures' gradient shapes (issue 17, item 3).

Per model (ResNet-50, VGG-16, GPT-2-small-like, 2-layer LSTM LM) and method, one process per cell
runs the method's full per-step path as rank 0 of a world of two whose peer sent the same bytes
(``adacomp.bench.cost_shapes.MirrorBackend``: compensate, compress, memory update, exchange, aggregate /
decompress; no second process competes for the cores): fusion buckets of 25 MB, tensors under
1024 elements dense, as the optimizer's defaults route them. It records

* compression time per step (median of ``--steps`` after ``--warmup`` untimed steps, :data:`WARMUP`) and its share of one
  backward pass of the model (the zoo in ``adacomp.models``, batch given in the table);
* extra memory held after the step (residuals, scratch buffers, recycled outputs: every tensor
  reachable from the compressor, memory and communicator objects) and the peak-RSS growth during
  the steps, both as a share of the model's gradient bytes;
* bytes this rank sends per step as a share of a dense allreduce's;
* the same step time for 10 / 100 / 1000 equal tensors of the same total size.

"Before" numbers come from the same command run against another checkout that has this benchmark
(each cell runs in a fresh ``python -m adacomp.bench.cost cell`` process, so the ``adacomp`` on
``PYTHONPATH`` is the code measured):

    PYTHONPATH=/path/to/old python -m adacomp.bench.cost run --json /tmp/before.json --methods qsgd,efsignsgd,adtopk,artopk
    adacomp bench cost run --json /tmp/after.json
    adacomp bench cost backward --json /tmp/backward.json
    adacomp bench cost report --before /tmp/before.json --after /tmp/after.json \\
        --backward /tmp/backward.json --out docs/results/cost.md

A kernel change is better judged pass by pass, both libraries in one process (``cost_passes``):

    adacomp bench cost passes --against <git revision or _native.py> --models resnet50,gpt2_small

and where a cell's step goes (the C passes against the Python calls), by perf samples of its timed
steps alone (``cost_profile``):

    adacomp bench cost profile --model resnet50 --method chunktopk --steps 100
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from adacomp.bench import cost_passes, cost_profile
from adacomp.bench.common import RESULTS, bench_command, module_command, write_result
from adacomp.bench.cost_shapes import SPLIT_TOTAL, model_shapes
from adacomp.tools.stepclock import time_steps

LAUNCH = "adacomp bench cost run --json /tmp/cost.json"  # one fresh process per cell; then `backward` and `report`

# method -> (compressor, params, communicator, memory)
METHODS: dict[str, tuple[str, dict, str, str]] = {
    "qsgd": ("qsgd", {"bits": 4}, "allgather_fast", "none"),
    "qsgd_counter": ("qsgd", {"bits": 4, "rng": "counter"}, "allgather_fast", "none"),
    "efsignsgd": ("efsignsgd", {}, "allgather_fast", "residual"),
    "topk": ("topk", {"density": 0.01}, "allgather_fast", "residual"),
    "adtopk": ("adtopk", {"density": 0.01}, "allgather_fast", "residual"),
    "artopk": ("topk", {"density": 0.01}, "artopk", "residual"),
    "sidco": ("sidco", {"density": 0.01}, "allgather", "residual"),
    "alltoall": ("topk", {"density": 0.01}, "alltoall", "residual"),
    "oktopk": ("oktopk", {"density": 0.01}, "oktopk", "residual"),
    "gtopk": ("gtopk", {"density": 0.01}, "allgather", "residual"),
    "mstopk": ("mstopk", {"density": 0.01}, "allgather", "residual"),
    "randomk": ("randomk", {"density": 0.01}, "allreduce", "residual"),
    "dgc": ("dgc", {"density": 0.01}, "allgather", "dgc"),
    "gaussiank": ("gaussiank", {"density": 0.01}, "allgather", "residual"),
    "redsync": ("redsync", {"density": 0.01}, "allgather", "residual"),
    "chunktopk": ("chunktopk", {"density": 0.02, "bits": 2}, "allgather_fast", "residual"),
    "bf16": ("bf16", {}, "allreduce", "none"),
    "powersgd": ("powersgd", {"rank": 4}, "allreduce", "residual"),
    "acpsgd": ("acpsgd", {"rank": 4}, "allreduce", "residual"),
}
MODELS = ("resnet50", "gpt2_small", "vgg16", "lstm_lm")
PEERS = frozenset({"oktopk"})
"""Methods whose exchange a mirror of this rank cannot answer: Ok-Topk's owner of a region sums what
the other ranks selected there and the final allgather brings the other owners' regions. Their cells
run on two local processes (``adacomp run``'s launch: gloo on loopback, one thread each), both ranks
timing the same steps, floors and minima with a barrier before each (so the floor shares the step's
two-process load on the memory), rank 0 reporting. The step then includes the collectives over
loopback, whose time (each call and the wait on its handle, the wait for the slower rank included)
is taken out of it (``collective_s``), as the mirror's collectives cost nothing."""

# The passes over every gradient that a method's data flow cannot avoid, whatever the code: its
# "minimum", timed in the same cell as the step and the floor. ``ef``: error feedback's compensation
# (read the gradient and the residual, write their sum or the next residual); ``write``: the dense
# averaged gradient handed back (DDP's contract); ``read``: one more read of the gradient-sized data
# (Gaussian-k's standard deviation needs the mean first, torch.std's two passes; low-rank methods
# read the compensated matrix for both products); ``rw``: a read and a write (DGC keeps velocity
# and momentum: it reads u, g, v and writes u, v). QSGD and bf16 carry no residual: one read (norm
# and codes fused) and the output's write. ``rng``: one uniform number per element from torch's
# generator (QSGD's stochastic rounding; its payload is bitwise torch's path, so the stream is
# torch's Mersenne Twister, drawn by the package's AVX2 generator into a cache-resident scratch: the
# numbers' cost without their write; ``qsgd_counter``, QSGD with ``rng: counter``, has no such
# pass). ``sample``: DGC's threshold sample, 1 % of the tensor at uniformly random positions (DGC
# §5: 0.1-1 %), drawn by torch's generator and gathered: loads that miss the caches wherever they
# land. SIDCo's ``read``: its first stage's threshold is a multiple of the mean of |g + r|, known only
# once error feedback's add has read the whole tensor, so selecting against it reads the tensor again,
# unless the add keeps a superset from a sampled floor; with the stage count adapted (three on normal
# values, WARMUP) the first stage passes ~22 %, and writing that many candidates costs about the read
# (cost_notes item 62: kept only up to 15 %; 30 % measured 1.5x slower on ResNet-50, item 76), as
# Gaussian-k's threshold needs its mean and std. ``/2``: over half of every tensor (alltoall's second
# stage: each of the two ranks averages its half, adds that half's error and recompresses it).
SAMPLE_RATIO = 0.01  # DGC's default sample_ratio (the ``sample`` pass)
RNG_CHUNK = 1 << 16  # the ``rng`` pass's scratch: 256 KB, resident in L2 while it is refilled

MINIMUM: dict[str, tuple[str, ...]] = {
    **{m: ("ef", "write") for m in ("efsignsgd", "topk", "adtopk", "artopk", "gtopk",
                                    "mstopk", "randomk", "redsync", "chunktopk", "oktopk")},
    "alltoall": ("ef", "write", "ef/2", "write/2"),
    "gaussiank": ("ef", "read", "write"),
    "sidco": ("ef", "read", "write"),  # its adapted stages' first threshold needs the sum's mean: see above
    "dgc": ("ef", "rw", "write", "sample"),
    "qsgd": ("read", "write", "rng"),
    "qsgd_counter": ("read", "write"),  # its numbers are arithmetic inside the fused pass
    "bf16": ("read", "write"),
    "powersgd": ("ef", "read", "write"),
    "acpsgd": ("ef", "read", "write"),
}
# ``--grads model``: the gradients of the zoo model's own backward passes on its synthetic batches
# (adacomp.models; weights from seed 0, batch b from seed b), GRADIENT_SETS of them, the steps
# cycling through them. Why: the threshold searches and the prefilters' sampled floors are exact
# whatever the values, but how much they read depends on the values' distribution, which iid
# normal gradients (the default, ``randn``) flatter: real ones are heavy-tailed and vary by row.
GRADIENT_SETS = 2
GRADIENT_BATCH = {"resnet50": 8, "gpt2_small": 4, "vgg16": 4, "lstm_lm": 20}  # as BATCHES (at batch 1 a
# linear layer's gradient is an outer product of two vectors: rank one, a pathological input)
BUCKET_BYTES = 25 * 2 ** 20
MIN_NUMEL = 1024
WARMUP = 30
"""Untimed steps before a cell's timed ones. At least 2: error feedback's second buffer is first
written on the second step (its page faults cost up to 20x a step). 30, because the adaptive methods
change what they do over their first steps: SIDCo moves its stage count one step a window of
``adapt_every`` = 5 calls, so after 2 steps it measured its first window's one-stage fit, which on iid
values sent a tenth of its target (ResNet-50 2.3x the floor; from 3 stages on, after 2-3 windows,
5.4-6.0x, cost_notes item 76). The non-adaptive methods measure the same after 2 or 20 (within the
runs' noise); Gaussian-k's and RedSync's counts drift with error feedback's residual for hundreds of
steps, which no fixed warm-up settles."""
WARMUP_MIN = 2
GRADS = ("randn", "model")
GRADS_HELP = ("the gradients' values: iid normal (randn) or the zoo model's own from backward passes on its "
              "synthetic batches (model; see model_gradients)")


def _shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    return model_shapes(model)


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


def _buckets(shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[list[list[tuple[str, tuple[int, ...]]]], int]:
    """Reverse order (backward order), 25 MB buckets; small tensors stay dense (their bytes returned)."""
    out: list[list[tuple[str, tuple[int, ...]]]] = []
    cur: list[tuple[str, tuple[int, ...]]] = []
    size, dense = 0, 0
    for name, shape in reversed(shapes):
        numel = _numel(shape)
        if numel < MIN_NUMEL:
            dense += 4 * numel
            continue
        cur.append((name, shape))
        size += 4 * numel
        if size >= BUCKET_BYTES:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out, dense


def _held_bytes(*objs: Any) -> int:
    """Bytes of distinct tensor storages reachable from ``objs`` (dicts, lists, attributes)."""
    seen_obj: set[int] = set()
    storages: dict[int, int] = {}

    def walk(o: Any, depth: int) -> None:
        if depth > 6 or id(o) in seen_obj:
            return
        seen_obj.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif isinstance(o, (list, tuple, set)):
            for v in o:
                walk(v, depth + 1)
        elif hasattr(o, "__dict__") and not isinstance(o, type) and type(o).__module__.startswith("adacomp"):
            walk(vars(o), depth + 1)

    for o in objs:
        walk(o, 0)
    return sum(storages.values())


def model_gradients(model: str, sets: int = GRADIENT_SETS) -> list[dict[str, torch.Tensor]]:
    """``sets`` gradients of the zoo model ``model``, each from one backward pass on its synthetic
    batch, named and shaped as :func:`_shapes` lists them (a weight the zoo stores transposed, as
    GPT-2's ``Conv1D`` layers against ``nn.Linear``, is transposed to that layout)."""
    from adacomp.models import build
    from adacomp.models.synthetic import synthetic_batch
    shapes = _shapes(model)
    torch.manual_seed(0)
    net = build(model)
    params = list(net.parameters())
    if len(params) != len(shapes):
        raise ValueError(f"zoo model {model!r} has {len(params)} parameters, its cost shapes {len(shapes)}")
    out = []
    for b in range(sets):
        batch = synthetic_batch(net, GRADIENT_BATCH.get(model, 1), seed=b)
        net.zero_grad(set_to_none=True)
        batch.loss_fn(net(batch.inputs), batch.targets).backward()
        grads = {}
        for (name, shape), p in zip(shapes, params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if tuple(g.shape) != tuple(shape):
                if g.dim() != 2 or tuple(g.t().shape) != tuple(shape):
                    raise ValueError(f"{model} parameter {name}: gradient {tuple(g.shape)} does not fit {shape}")
                g = g.t()
            grads[name] = g.detach().contiguous().clone()
        out.append(grads)
    return out


def cell(model: str, method: str, steps: int, grads_from: str = "randn", grads_file: str | None = None,
         sizes: tuple[int, int] | None = None,
         around: Callable[[Callable[[], None]], Callable[[], None]] | None = None, warmup: int = WARMUP) -> dict:
    """One (model, method) measurement in this process (a method of :data:`PEERS`: this rank's, in a
    job of two started by a launcher). ``grads_from``: ``randn`` (iid normal gradients) or ``model``
    (:func:`model_gradients`, read from ``grads_file`` when given). ``sizes = (lo, hi)``: only the
    model's tensors of lo <= numel < hi. ``around``: wraps each timed step (not the warm-up, floor or
    minimum passes), e.g. to sample it alone (:mod:`adacomp.bench.cost_profile`). ``warmup``: untimed
    steps first (:data:`WARMUP`)."""
    if warmup < WARMUP_MIN:
        raise ValueError(f"warmup must be >= {WARMUP_MIN} (error feedback's second buffer is first written on "
                         f"the second step), got {warmup!r}")
    from adacomp import communicators, compressors, memories
    from adacomp.backends import create, detect
    from adacomp.backends.base import Backend
    from adacomp.bench.cost_shapes import CollectiveClock, MirrorBackend
    from adacomp.communicators.base import CommEnv, Entry
    from adacomp.engine.error_feedback import compensate_bucket, exchange, with_dest
    from adacomp.engine.metrics import StepStats

    cname, cparams, comm_name, mem_name = METHODS[method]
    comp = compressors.get(cname, **cparams)
    comm = communicators.get(comm_name)
    memory = memories.get(mem_name)
    shapes = _shapes(model)
    if sizes is not None:
        shapes = [(n, s) for n, s in shapes if sizes[0] <= _numel(s) < sizes[1]]
        if not any(_numel(s) >= MIN_NUMEL for _, s in shapes):
            raise ValueError(f"cost cell {model}: no tensor of {sizes[0]} <= numel < {sizes[1]} "
                             f"(and >= {MIN_NUMEL}, the compressed ones)")
    buckets, dense_small = _buckets(shapes)
    gen = torch.Generator().manual_seed(0)
    if grads_from == "model":
        sets = torch.load(grads_file) if grads_file else model_gradients(model)
        used = {n for b in buckets for n, _ in b}
        sets = [{n: g for n, g in one.items() if n in used} for one in sets]
    elif grads_from == "randn":
        sets = [{n: torch.randn(s, generator=gen) for b in buckets for n, s in b}]
    else:
        raise ValueError(f"grads_from must be 'randn' or 'model', got {grads_from!r}")
    grads = sets[0]
    model_bytes = sum(4 * g.numel() for g in grads.values()) + dense_small
    clock: CollectiveClock | None = None
    if method in PEERS:
        if detect() == "local":
            raise RuntimeError(f"cost cell {model}/{method}: its exchange needs real peers; run it with "
                               f"`adacomp bench cost cell`, which starts two processes")
        clock = CollectiveClock(create())
        if clock.size() != 2:
            raise RuntimeError(f"cost cell {model}/{method}: a world of 2 measures it, got {clock.size()}")
        backend: Backend = clock
        barrier: Callable[[], None] | None = clock.inner.barrier
    else:
        backend, barrier = MirrorBackend(2), None
    # the memory floor: one read and one write of every gradient (abs into a buffer of its own),
    # allocated before the baseline so the resident-set figures count the method's memory only
    floor_out = {n: torch.empty_like(g) for n, g in grads.items()}
    spare = {n: torch.empty_like(g) for n, g in grads.items()}  # the minimum's second output
    passes = _minimum_passes(MINIMUM[method])

    def floor_pass() -> None:
        for n, g in grads.items():
            torch.abs(g, out=floor_out[n])

    def minimum_pass() -> None:
        for n, g in grads.items():
            for one in passes:
                one(g, floor_out[n], spare[n])

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cur = SimpleNamespace(step=-1, stats=StepStats(), outs=[], fresh={})
    # a bucket-granularity compressor (Ok-Topk, gTop-k) selects over its whole bucket: the engine
    # compensates the bucket from its gradients where they lie where it can, else flattens them into a
    # buffer it reuses (error_feedback.compensate_bucket), and hands each parameter its piece of the
    # flat mean as its new gradient, a view (StepEngine._write: no copy); the cell does the same,
    # holding the mean until the next step as the gradients would
    fused = comp.granularity == "bucket"
    flats = [torch.empty(sum(grads[n].numel() for n, _ in b)) for b in buckets] if fused else []

    def prepare() -> None:
        if barrier is not None:
            barrier()
        cur.step += 1
        cur.stats = StepStats()
        cur.outs = []  # the previous step's means are released, as zero_grad(set_to_none) releases grads
        # backward's new gradients (error feedback adds into them)
        cur.fresh = {n: g.clone() for n, g in sets[cur.step % len(sets)].items()}

    def one_step() -> None:
        for bi, b in enumerate(buckets):
            # AR-Topk: even steps make this rank the root (it runs Top-k); see MirrorBackend
            env = CommEnv(backend, cur.stats, step=2 * cur.step, bucket_index=bi)
            if fused:
                key, gs = f"bucket{bi}", [cur.fresh[n] for n, _ in b]
                summed = compensate_bucket(memory, key, gs, backend.size(), comp,
                                           comm.pieces(key, flats[bi].numel(), backend.size()),
                                           lambda: torch.cat([g.reshape(-1) for g in gs], out=flats[bi]))
                entry = Entry(key, summed, comp, memory)
                (mean,) = exchange(comm, [entry], env)
                cur.outs.append(mean)
                continue
            # the engine's entries: the raw gradient takes the mean where nothing reads it again
            entries = [with_dest(Entry(n, memory.compensate(cur.fresh[n], n, backend.size(), compressor=comp,
                                                            pieces=comm.pieces(n, cur.fresh[n].numel(), backend.size())),
                                       comp, memory), cur.fresh[n]) for n, _ in b]
            cur.outs += exchange(comm, entries, env)
        comp.on_step(cur.step + 1)

    time_steps(one_step, 0, warmup, sync=prepare)  # see WARMUP
    time_steps(floor_pass, 0, 1, sync=barrier)
    time_steps(minimum_pass, 0, 1, sync=barrier)
    times: list[float] = []
    floors: list[float] = []
    minima: list[float] = []
    collective: list[float] = []  # PEERS: each timed step's seconds in collectives, taken out of it
    timed = one_step if around is None else around(one_step)
    for _ in range(steps):  # alternating, so all three see the same machine load
        before = clock.seconds if clock is not None else 0.0
        (took,) = time_steps(timed, 1, sync=prepare)
        collective.append(clock.seconds - before if clock is not None else 0.0)
        times.append(took - collective[-1])
        floors += time_steps(floor_pass, 1, sync=barrier)
        minima += time_steps(minimum_pass, 1, sync=barrier)
    sent, dense = cur.stats.bytes_sent, cur.stats.dense_bytes  # the last step's
    if not 0 < sent < dense:  # a cost of a path that compressed nothing would measure the wrong thing
        raise RuntimeError(f"cost cell {model}/{method}: sent {sent} bytes of {dense} dense")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from adacomp.compressors import _native
    held = _held_bytes(comp, memory, comm, vars(_native._SCRATCH))  # with the per-thread pools (compaction, keys)
    del cur
    return {"model": model, "method": method, "tensors": len(shapes), "numel": model_bytes // 4,
            "step_s": statistics.median(times), "steps_s": times, "floor_s": statistics.median(floors),
            "floors_s": floors, "minimum_s": statistics.median(minima), "minima_s": minima,
            "minimum": list(MINIMUM[method]), "model_bytes": model_bytes,
            "held_bytes": held, "rss_extra_bytes": max(0, peak - base_rss),
            "bytes_ratio": (sent + dense_small) / max(1, dense + dense_small), "threads": torch.get_num_threads(),
            "grads": grads_from, "processes": backend.size() if method in PEERS else 1, "rank": backend.rank(),
            "collective_s": statistics.median(collective), "fused_buckets": fused, "warmup": warmup}


WARMUP_HELP = f"untimed steps before the timed ones (>= {WARMUP_MIN}; default: %(default)s, see WARMUP)"


def warmup_arg(text: str) -> int:
    """``--warmup``: an int of at least :data:`WARMUP_MIN`, else argparse's usage error."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < WARMUP_MIN:
        raise argparse.ArgumentTypeError(f"--warmup takes an integer >= {WARMUP_MIN} (error feedback's second "
                                         f"buffer is first written on the second step), got {text!r}")
    return n


def peer_cell(argv: list[str]) -> dict:
    """The cell subcommand ``argv`` run on two local processes (a method of :data:`PEERS`): rank 0's
    result. Why not the mirror: see :data:`PEERS`."""
    import io
    from adacomp.tools.launch import run_local
    out = io.StringIO()
    rc = run_local([*module_command("cost"), *argv], 2, out=out)
    lines = out.getvalue().splitlines()
    found = [line[len("[0] "):] for line in lines if line.startswith("[0] {")]
    if rc or not found:
        raise RuntimeError(f"cost {' '.join(argv)} on two processes failed (exit {rc}):\n" + "\n".join(lines[-30:]))
    return dict(json.loads(found[-1]))


def floors(args: argparse.Namespace) -> None:
    """How well Top-k's sampled floor guesses, on a model's own gradients: with error feedback over
    ``--steps`` batches (density 1 %), per tensor of >= 2^16 elements and step after the first, how
    many elements pass the floor sampled for Top-k's candidate target, over k (below 1: the
    selection reads the tensor again), for the sample's lines at each span's first line (before)
    and at the Weyl-sequence offsets (now, ``sample_starts``). The quantiles of those ratios."""
    from adacomp.compressors.sparse import SAMPLE_LINE, k_for, sample_size, sample_starts, sampled_value
    from adacomp.compressors.topk import _expected
    torch.set_num_threads(args.threads)

    def sample(x: torch.Tensor, spread: bool) -> torch.Tensor:
        lines, m = x.numel() // SAMPLE_LINE, sample_size(x.numel()) // SAMPLE_LINE
        at = sample_starts(lines, m) if spread else torch.arange(m) * lines // m
        return x[:lines * SAMPLE_LINE].view(lines, SAMPLE_LINE).index_select(0, at).view(-1)

    for model in args.models.split(","):
        sets = model_gradients(model, args.steps)
        residual: dict[str, torch.Tensor] = {}
        ratios: dict[bool, list[float]] = {False: [], True: []}
        for step, grads in enumerate(sets):
            for name, g in grads.items():
                if g.numel() < 1 << 16:
                    continue
                x = g.reshape(-1) + residual.get(name, torch.zeros(g.numel()))
                a, k = x.abs(), k_for(x.numel(), 0.01)
                if step:
                    for spread in (False, True):
                        floor = sampled_value(sample(x, spread), _expected(k, x.numel()), absolute=True)
                        ratios[spread].append(int((a >= floor).sum()) / k)
                x[torch.topk(a, k, sorted=False).indices] = 0.0
                residual[name] = x
        for spread in (False, True):
            r = torch.tensor(ratios[spread])
            q = [float(v) for v in r.quantile(torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0]))]
            print(f"{model:11s} {'Weyl offsets' if spread else 'first lines':12s} passed / k over {r.numel()} "
                  f"tensor-steps: min {q[0]:.2f} p10 {q[1]:.2f} median {q[2]:.2f} p90 {q[3]:.2f} max {q[4]:.2f}; "
                  f"below k {int((r < 1).sum())}, above 3 k {int((r > 3).sum())}", flush=True)


def _minimum_passes(names: tuple[str, ...]) -> list[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]]:
    """The passes of :data:`MINIMUM` as calls on (gradient, a buffer, another buffer), each the
    fastest this package has for it: error feedback's add and the dense write with the streaming
    stores the methods use, the read as one C count."""
    import math

    from adacomp.compressors import _native
    no_idx, no_vals = torch.empty(0, dtype=torch.int64), torch.empty(0)

    def ef(g: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> None:
        if not _native.add_into(g, r, out):
            torch.add(g, r, out=out)

    def write(g: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> None:
        if not _native.sparse_mean(out.view(-1), [no_idx], [no_vals], 1):  # zeros, streamed
            out.zero_()

    def read(g: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> None:
        if _native.usable(g):
            _native.count(g.view(-1), math.inf, "ge")
        else:
            float(g.sum())

    def rw(g: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> None:
        torch.abs(r, out=r)  # the floor's own pass, on another tensor

    gen = torch.Generator().manual_seed(0)
    scratch = torch.empty(RNG_CHUNK)

    def rng(g: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> None:
        n = g.numel()
        if not _native.uniform_discard(gen, n, scratch):
            for lo in range(0, n, RNG_CHUNK):
                scratch[:min(RNG_CHUNK, n - lo)].uniform_(generator=gen)

    def sample(g: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> None:
        flat = g.view(-1)
        pick = torch.randint(flat.numel(), (math.ceil(flat.numel() * SAMPLE_RATIO),), generator=gen)
        _native.take(flat, pick)

    table = {"ef": ef, "write": write, "read": read, "rw": rw, "rng": rng, "sample": sample}

    def half(one: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]) -> Callable[..., Any]:
        def run(g: torch.Tensor, r: torch.Tensor, out: torch.Tensor) -> None:
            h = g.numel() // 2
            one(g.view(-1)[:h], r.view(-1)[:h], out.view(-1)[:h])
        return run

    return [half(table[n[:-2]]) if n.endswith("/2") else table[n] for n in names]


def run(args: argparse.Namespace) -> None:
    rows: list[dict] = []
    if Path(args.json).exists() and args.resume:
        rows = json.loads(Path(args.json).read_text())["rows"]
    done = {(r["model"], r["method"]) for r in rows}
    models = args.models.split(",") + [f"split{c}" for c in args.counts.split(",") if c]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    todo = [(m, x) for m in models for x in args.methods.split(",") if (m, x) not in done]
    t0 = time.monotonic()
    saved: dict[str, str] = {}  # model -> its gradients' file (``--grads model``: one backward per set per run)
    tmp = tempfile.TemporaryDirectory(prefix="adacomp-cost-") if args.grads == "model" else None
    for n, (model, method) in enumerate(todo, 1):
        cmd = [*module_command("cost"), "cell", "--model", model, "--method", method, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--grads", args.grads]
        if tmp is not None and not model.startswith("split"):
            if model not in saved:
                saved[model] = f"{tmp.name}/{model}.pt"
                torch.save(model_gradients(model), saved[model])
            cmd += ["--grads-file", saved[model]]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if res.returncode:
            print(f"{model} {method}: failed\n{res.stderr[-2000:]}", file=sys.stderr)
            continue
        row = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append(row)
        spent = time.monotonic() - t0  # a full run takes the better part of an hour: say how far it is
        print(f"[{n}/{len(todo)} {spent / 60:.1f} min, ~{spent / n * (len(todo) - n) / 60:.0f} min left] "
              f"{model:11s} {method:12s} {1e3 * row['step_s']:9.1f} ms/step  held {row['held_bytes'] / 2**20:8.1f} MiB  "
              f"rss+ {row['rss_extra_bytes'] / 2**20:8.1f} MiB  bytes {row['bytes_ratio']:.3f}", flush=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "load": os.getloadavg()[0], "code": _code()}, indent=1))


def _code() -> str:
    import adacomp
    return str(Path(adacomp.__file__).resolve().parents[1])


# zoo model -> (its batch for the backward timing, description of the batch)
BATCHES: dict[str, tuple[Callable[[], Any], str]] = {
    "resnet50": (lambda: torch.randn(8, 3, 224, 224), "8 x 3 x 224 x 224"),
    "vgg16": (lambda: torch.randn(4, 3, 224, 224), "4 x 3 x 224 x 224"),
    "gpt2_small": (lambda: torch.randint(0, 50257, (4, 128)), "4 x 128 tokens"),
    "lstm_lm": (lambda: torch.randint(0, 10000, (20, 35)), "20 x 35 tokens"),
}


def backward_seconds(name: str, repeats: int = 2) -> tuple[float, int, str]:
    """Fastest of ``repeats`` backward passes of zoo model ``name`` (after one warm-up; the forward
    pass is not timed), its parameter count, the batch."""
    from adacomp.models import build
    batch, desc = BATCHES[name]
    torch.manual_seed(0)
    model, x = build(name), batch()
    cur = SimpleNamespace(loss=None)

    def forward() -> None:
        model.zero_grad(set_to_none=True)
        cur.loss = model(x).float().square().mean()

    best = min(time_steps(lambda: cur.loss.backward(), repeats, 1, sync=forward))
    return best, sum(p.numel() for p in model.parameters()), desc


def backward(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    out = {}
    for model in args.models.split(","):
        t, params, batch = backward_seconds(model)
        out[model] = {"backward_s": t, "params": params, "batch": batch, "threads": args.threads}
        print(f"{model:11s} backward {t:.3f} s  ({params / 1e6:.1f}M params, batch {batch})", flush=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x < 10 else f"{100 * x:.0f}%"


def report(args: argparse.Namespace) -> None:
    after = json.loads(Path(args.after).read_text())
    before = json.loads(Path(args.before).read_text()) if args.before else {"rows": []}
    bw = json.loads(Path(args.backward).read_text())
    a = {(r["model"], r["method"]): r for r in after["rows"]}
    b = {(r["model"], r["method"]): r for r in before["rows"]}
    methods = [m for m in METHODS if any(k[1] == m for k in a)]
    lines = [
        f"One process, {after['rows'][0]['threads']} thread(s) (what `adacomp run` gives each of 2 workers on 2 cores), "
        "each cell a fresh process: the method's whole per-step path (error-feedback compensate, compress, memory "
        "update, payload exchange, aggregation and decompression of both ranks' payloads) as rank 0 of a world of "
        "two whose peer sent the same bytes (`adacomp/bench/cost_shapes.py` MirrorBackend; no second process competes "
        "for the cores). 25 MB buckets; tensors under 1024 elements dense (counted in the bytes). "
        "Median of the steps after two warm-up steps (the runs predate `--warmup`). AR-Topk is measured on its root rank (the one running Top-k; "
        "the other ranks only gather values), so its figure is the per-step maximum.",
        "",
        f"\"Before\" = the code at commit 0a8e961 (main when this branch started), run by the same script "
        f"(`PYTHONPATH=<that checkout>`); load average during the runs: before {before.get('load', 0):.1f}, "
        f"after {after.get('load', 0):.1f} on a shared 2-core machine, so single cells carry noise of tens of percent.",
        "",
        "Columns: **ms/step** compression time per step (wall clock); **% of backward** that time over one "
        "backward pass of the model at the batch given (the share halves when the batch doubles); **held** "
        "tensors the compressor, memory and communicator keep between steps (residuals, scratch, recycled "
        "outputs) over the model's gradient bytes, before -> after (after includes the recycled buffers the "
        "returned means live in: in training they are `p.grad`, replacing the gradients' own storage); "
        "**peak RSS+** growth of the peak resident set during the steps over the same, before -> after; "
        "**bytes** this rank sends per step over a dense allreduce's. Wall-clock cells on this machine "
        "moved by up to 2x between identical reruns (e.g. ResNet-50 adtopk, same code: 0.7-2.2 s/step): "
        "read the large factors (qsgd, efsignsgd, the tie cases) and the CPU-time table in the notes, not "
        "single-cell differences of tens of percent.",
        ""]
    for model in MODELS:
        if not any(k[0] == model for k in a):
            continue
        info = bw.get(model, {})
        bws = info.get("backward_s")
        lines += [f"## {model} ({a[(model, methods[0])]['tensors'] if (model, methods[0]) in a else '?'} tensors, "
                  f"{info.get('params', 0) / 1e6:.1f}M parameters; backward {1e3 * bws:.0f} ms at batch "
                  f"{info.get('batch')})" if bws else f"## {model}", "",
                  "| method | ms/step before | ms/step after | % of backward before | % of backward after | held | peak RSS+ | bytes |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for m in methods:
            r = a.get((model, m))
            if r is None:
                continue
            o = b.get((model, m))
            ms_before = f"{1e3 * o['step_s']:.0f}" if o else ""
            share_before = _pct(o["step_s"] / bws) if o and bws else ""
            share_after = _pct(r["step_s"] / bws) if bws else ""
            def mem(key: str, o: dict[str, Any] | None = o, r: dict[str, Any] = r) -> str:
                old = f"{_pct(o[key] / o['model_bytes'])} -> " if o else ""
                return old + _pct(r[key] / r["model_bytes"])
            lines.append(f"| {m} | {ms_before} | {1e3 * r['step_s']:.0f} | {share_before} | {share_after} | "
                         f"{mem('held_bytes')} | {mem('rss_extra_bytes')} | {r['bytes_ratio']:.3f} |")
        lines.append("")
    counts = sorted({int(k[0][5:]) for k in a if k[0].startswith("split")})
    if counts:
        lines += [f"## Overhead vs number of tensors ({SPLIT_TOTAL / 2 ** 20:.0f} Mi elements in total, equal tensors)",
                  "", "ms per step, before -> after.", "",
                  "| method | " + " | ".join(f"{c} tensors" for c in counts) + " |",
                  "|---|" + "---:|" * len(counts)]
        for m in methods:
            cells = []
            for c in counts:
                r, o = a.get((f"split{c}", m)), b.get((f"split{c}", m))
                old = f"{1e3 * o['step_s']:.0f} -> " if o else ""
                cells.append(old + (f"{1e3 * r['step_s']:.0f}" if r else ""))
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    if args.notes:
        lines += ["", Path(args.notes).read_text().rstrip()]
    write_result(args.out, "Compression cost per method and model", lines, args.command)


GOAL = {"powersgd": 5.0, "acpsgd": 5.0}
"""Issue 32's goal in memory floors: 3 for sparsifiers and quantisers, 5 for low-rank methods."""


def _floor_rows(path: str) -> dict[tuple[str, str], dict]:
    return {(r["model"], r["method"]): r for r in json.loads(Path(path).read_text())["rows"] if "floor_s" in r}


def _ratio(row: dict) -> float:
    return row["step_s"] / row["floor_s"]


def _median_rows(paths: list[str]) -> tuple[dict[tuple[str, str], dict], dict[tuple[str, str], list[float]]]:
    """Per cell, the row of the median step / floor over the runs in ``paths`` (cells move by up to
    ~40 % between runs on this machine, so one run decides little), and every run's ratio."""
    runs = [_floor_rows(p) for p in paths]
    rows, ratios = {}, {}
    for key in dict.fromkeys(k for run in runs for k in run):
        cells = sorted((run[key] for run in runs if key in run), key=_ratio)
        rows[key], ratios[key] = cells[(len(cells) - 1) // 2], [_ratio(c) for c in cells]
    return rows, ratios


def _warmup_text(rows: Any) -> str:
    """The untimed steps before the timed ones, as the rows recorded them (rows from before
    :data:`WARMUP` existed ran 2)."""
    by: dict[int, set[str]] = {}
    for r in rows:
        by.setdefault(int(r.get("warmup", WARMUP_MIN)), set()).add(r["method"])
    if len(by) == 1:
        return f"The timed steps follow {next(iter(by))} untimed ones."
    most = max(by, key=lambda w: len(by[w]))
    others = "; ".join(f"{w} for {', '.join(sorted(by[w]))}" for w in sorted(by) if w != most)
    return f"The timed steps follow {most} untimed ones ({others}; see `WARMUP` in adacomp/bench/cost.py)."


def report_floor(args: argparse.Namespace) -> None:
    """docs/results/compress_floor.md: each cell's step over its memory floor, measured in the same
    cell; with ``--before``, the same ratio of an earlier run beside it. ``--after`` may name several
    runs (comma-separated): each cell then shows the median run's figures and the range. ``--previous``
    (runs, comma-separated): the median ratio of another checkout measured in the same session, so
    that a change of the machine's state between two days is not read as a change of the code."""
    paths = [p for p in args.after.split(",") if p]
    after = json.loads(Path(paths[0]).read_text())
    rows, ratios = _median_rows(paths)
    before = _floor_rows(args.before) if args.before else {}
    previous = _median_rows([p for p in args.previous.split(",") if p])[0] if args.previous else {}
    methods = [m for m in METHODS if any(k[1] == m for k in rows)]
    models = [m for m in MODELS if any(k[0] == m for k in rows)]
    models += sorted({k[0] for k in rows} - set(models))  # e.g. the equal-split sizes
    per_model = ((["before x floor"] if before else []) + (["previous x floor"] if previous else [])
                 + ["ms/step", "floor ms", "x floor", "minimum x floor"])
    lines = [
        f"One process, {after['rows'][0]['threads']} thread(s), each cell a fresh process running the method's whole "
        "per-step path on the model's gradient shapes as rank 0 of a world of two (compensate, compress, memory update, "
        "exchange, aggregate and decompress both ranks' payloads; `adacomp bench cost`). **Floor** = one read and "
        "one write of every gradient (`torch.abs(g, out=buf)` per tensor), timed alternately with the step in the "
        "same cell, so both see the same load (load average at the end of the run: "
        f"{after.get('load', 0):.1f}). **x floor** = median step / median floor; goal (issue 32) <= 3x for "
        "sparsifiers and quantisers, <= 5x for low-rank. Error feedback alone reads the gradient and the residual "
        "and writes both back, so the goal asks for fused single passes. **minimum x floor**: the passes the "
        "method's data flow cannot avoid (`MINIMUM` in adacomp/bench/cost.py: error feedback's add, the dense "
        "averaged gradient's write, the extra reads of Gaussian-k's, SIDCo's (its adapted stages) and the low-rank "
        "methods' second passes, DGC's "
        "velocity and random sample, QSGD's uniform numbers from torch's generator) timed the same way with the fastest kernels this package has, over the floor (below 1x where its "
        "streamed writes beat the floor's plain stores, which read each line first): where it is near or above the "
        "goal, the goal cannot be met by any implementation of that data flow on this machine. "
        + _warmup_text(rows.values())
        + (f" Each cell is the median of {len(paths)} runs of the same command (by x floor; its range in "
           "brackets)." if len(paths) > 1 else "")
        + (f" **before x floor**: the same ratio from `{args.before}` (its own floors)." if before else "")
        + (f" **previous x floor**: the median ratio of `{args.previous}`, another checkout's runs of the same "
           "command in the same session (its own floors)." if previous else "")
        + (" Gradients: " + ("the zoo models' own, from backward passes on their synthetic batches "
                             f"(`--grads model`, {GRADIENT_SETS} batches, the steps cycling through them)"
                             if after["rows"][0].get("grads") == "model" else "iid normal values (`--grads randn`)")
           + "."), "",
        "| method | " + " | ".join(f"{m} {c}" for m in models for c in per_model) + " | goal |",
        "|---|" + "---:|" * (len(per_model) * len(models)) + "---:|"]
    for meth in methods:
        cells = []
        for model in models:
            r, b = rows.get((model, meth)), before.get((model, meth))
            if before:
                cells.append(f"{_ratio(b):.1f}x" if b else "")
            if previous:
                cells.append(f"{_ratio(previous[(model, meth)]):.1f}x" if (model, meth) in previous else "")
            if r is None:
                cells += ["", "", "", ""]
                continue
            x = _ratio(r)
            mark = "" if x <= GOAL.get(meth, 3.0) else " ✗"
            spread = ratios[(model, meth)]
            span = f" ({spread[0]:.1f}-{spread[-1]:.1f})" if len(spread) > 1 else ""
            least = f"{r['minimum_s'] / r['floor_s']:.1f}x" if "minimum_s" in r else ""
            cells += [f"{1e3 * r['step_s']:.0f}", f"{1e3 * r['floor_s']:.1f}", f"{x:.1f}x{mark}{span}", least]
        lines.append(f"| {meth} | " + " | ".join(cells) + f" | {GOAL.get(meth, 3.0):.0f}x |")
    if args.note:
        lines += ["", args.note]
    lines += ["", "✗ = above the goal. Tensors under 1024 elements go dense and are outside both the step and the floor."]
    fused_rows = sorted({k[1] for k, r in rows.items() if r.get("fused_buckets")})
    if fused_rows:
        lines += ["", f"{', '.join(fused_rows)}: bucket granularity (one selection over each 25 MB fusion bucket), so "
                  "their cells run each bucket as the engine does: compensated from its gradients where they lie "
                  "(error_feedback.compensate_bucket; flattened into a reused buffer where that path declines), "
                  "the mean's pieces handed over as the gradients (views, no copy back, as in the optimizer's step)."]
    if any(k[1] in PEERS for k in rows):
        lines += ["", f"{', '.join(sorted(PEERS & {k[1] for k in rows}))}: its exchange needs real peers (an owner sums "
                  "the regions the other ranks send it), so its cells ran on two processes (gloo on loopback, one "
                  "thread each, a barrier before every timed step, floor and minimum): rank 0's step without the "
                  "time in its collectives (their calls and waits over loopback, the wait for the other rank "
                  "included: `collective_s` in the JSON), and its floor shares the memory with the other rank's, "
                  "as the step does."]
    write_result(args.out, "Compression cost against the memory floor", lines, args.command)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adacomp bench cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cell")
    c.add_argument("--model", required=True)
    c.add_argument("--method", required=True, choices=sorted(METHODS))
    c.add_argument("--steps", type=int, default=2)
    c.add_argument("--warmup", type=warmup_arg, default=WARMUP, help=WARMUP_HELP)
    c.add_argument("--grads", choices=GRADS, default="randn", help=GRADS_HELP)
    c.add_argument("--grads-file", help="model_gradients() saved by `run` (else computed here)")
    c.add_argument("--sizes", type=cost_profile.sizes_arg, help="LO:HI, only the tensors of LO <= numel < HI")
    c.add_argument("--perf-control", help=argparse.SUPPRESS)  # CTL,ACK fifos of `profile`'s perf record
    c.add_argument("--calls", action="store_true",
                   help="also time each C call of the timed steps (cost_profile.CallClock): c_calls_s, c_calls")
    c.add_argument("--toggle", metavar="MODULE:NAME.ATTR",
                   help="alternate a boolean switch of the code over the timed steps (cost_profile.Toggle): "
                        "on_s, off_s, on_x_floor, off_x_floor")
    c.add_argument("--cells", type=int, metavar="N",
                   help="with --toggle: N pairs of whole cells in this process, the switch on then off, instead "
                        "of alternating steps (a switch whose effect spans steps; cost_profile.Toggle.cells): "
                        "on_s, off_s, on_p10_s, off_p10_s, on_x_floor, off_x_floor, on_cells_x_floor, off_cells_x_floor")
    c.add_argument("--against", metavar="REV",
                   help="alternate this checkout's C library and one built from another version's _native.py "
                        "(a git revision or a path) over the timed steps (cost_profile.Against): on_s, off_s, "
                        "on_x_floor, off_x_floor, on = this checkout")
    c.add_argument("--ops", action="store_true",
                   help="count the aten ops each timed step dispatches, by op and by calling line "
                        "(cost_profile.OpCounter; the steps' times then mean nothing): aten_ops, aten_ops_by, aten_ops_at")
    r = sub.add_parser("run")
    r.add_argument("--json", required=True)
    r.add_argument("--models", default=",".join(MODELS))
    r.add_argument("--methods", default=",".join(METHODS))
    r.add_argument("--counts", default="10,100,1000")
    r.add_argument("--steps", type=int, default=2)
    r.add_argument("--warmup", type=warmup_arg, default=WARMUP, help=WARMUP_HELP)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--timeout", type=int, default=900)
    r.add_argument("--resume", action="store_true", help="keep the cells already in --json")
    r.add_argument("--grads", choices=GRADS, default="randn", help=GRADS_HELP)
    fl = sub.add_parser("floors", help="Top-k's sampled floor on the models' own gradients (see floors())")
    fl.add_argument("--models", default="resnet50,gpt2_small,vgg16")
    fl.add_argument("--steps", type=int, default=6, help="batches (error feedback carries across them)")
    fl.add_argument("--threads", type=int, default=2)
    w = sub.add_parser("backward")
    w.add_argument("--json", required=True)
    w.add_argument("--models", default=",".join(MODELS))
    w.add_argument("--threads", type=int, default=1)
    f = sub.add_parser("report-floor", help="write compress_floor.md from a run's JSON")
    f.add_argument("--after", required=True, help="a run's JSON, or several comma-separated (each cell: their median)")
    f.add_argument("--before", help="an earlier run's JSON: its ratio goes beside each model's")
    f.add_argument("--previous", help="runs of another checkout from the same session (comma-separated JSONs): "
                                      "their median ratio goes beside each model's")
    f.add_argument("--out", default=f"{RESULTS}/compress_floor.md")
    f.add_argument("--note", default="", help="a paragraph on the run's conditions")
    cost_passes.add_parser(sub)
    cost_profile.add_parser(sub, sorted(METHODS), sorted(PEERS), warmup_arg, WARMUP, WARMUP_HELP)
    p = sub.add_parser("report")
    p.add_argument("--after", required=True)
    p.add_argument("--before")
    p.add_argument("--backward", required=True)
    p.add_argument("--out", default=f"{RESULTS}/cost.md", help="relative to the current directory (default: %(default)s)")
    p.add_argument("--notes", default="", help="markdown file appended to the report (causes found)")
    args = ap.parse_args(argv)
    args.command = bench_command("cost", argv)
    if args.cmd == "cell":
        import torch
        from adacomp.backends import detect
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if args.method in PEERS and detect() == "local":
            print(json.dumps(peer_cell(list(sys.argv[1:] if argv is None else argv))))
            return 0
        if args.perf_control and args.calls:
            raise SystemExit("adacomp bench cost cell: --calls times the C calls itself; run it without perf")
        if args.toggle and args.against:
            raise SystemExit("adacomp bench cost cell: --toggle and --against each alternate the steps; give one")
        if args.against and (args.calls or args.perf_control):
            raise SystemExit("adacomp bench cost cell: --against times the steps alone; run it without --calls or perf")
        if args.toggle and (args.calls or args.perf_control):
            raise SystemExit("adacomp bench cost cell: --toggle times the steps alone; run it without --calls or perf")
        if args.cells is not None and (not args.toggle or args.cells < 1):
            raise SystemExit("adacomp bench cost cell: --cells N (N >= 1) alternates whole cells of a --toggle switch")
        if args.ops and (args.calls or args.perf_control or args.toggle or args.against):
            raise SystemExit("adacomp bench cost cell: --ops counts the steps' aten ops and slows them; "
                             "run it without --calls, --toggle, --against or perf")
        toggle: cost_profile.Toggle | cost_profile.Against | None = (
            cost_profile.Toggle(args.toggle) if args.toggle else
            cost_profile.Against(args.against) if args.against else None)
        ops = cost_profile.OpCounter() if args.ops else None
        around = (cost_profile.sampled if args.perf_control else toggle.around if toggle is not None
                  else ops.around if ops is not None else None)
        if args.perf_control:
            cost_profile.connect(args.perf_control)
        clock = cost_profile.CallClock() if args.calls else None
        if args.cells is not None:
            assert isinstance(toggle, cost_profile.Toggle)
            print(json.dumps(toggle.cells(args.cells, lambda: cell(args.model, args.method, args.steps, args.grads,
                                                                   args.grads_file, args.sizes, None, args.warmup))))
            return 0
        try:
            got = cell(args.model, args.method, args.steps, args.grads, args.grads_file, args.sizes,
                       clock.around if clock is not None else around, args.warmup)
        finally:
            if clock is not None:
                clock.close()
        if clock is not None:
            got.update(clock.report())
        if toggle is not None:
            got.update(toggle.report(got))
        if ops is not None:
            got.update(ops.report())
        if args.method not in PEERS or got["rank"] == 0:
            print(json.dumps(got))
    else:
        {"run": run, "backward": backward, "report": report, "report-floor": report_floor,
         "floors": floors, "passes": cost_passes.passes, "profile": cost_profile.profile}[args.cmd](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
