"""ByteComp's timeline of one iteration (bytecomp.txt §3.1 Fig. 2, §4.3 "Expressing interactions").

Given per-tensor backward computation times, sizes, a compression option per tensor and empirical
time models, :func:`simulate` derives when every computation, compression, communication and
decompression runs, and so the iteration time F(S) of strategy S (§4.4.1) and the communication
bubbles of Property #1.

Resources and rules (flat communication, §4.2 "Dimension 3"):

* ``device``: one serial stream. Backward computations run in order; device compression and
  decompression share the stream, so they delay later computations (Reason #1: "GPU compression
  competes for compute resources with tensor computation").
* ``cpu``: one serial worker running offloaded compression in parallel with the device.
* ``net``: one FIFO communication queue (collectives of a process group run one at a time).
* Each resource runs its ready tasks first-come first-served; at equal ready times backward-phase
  work goes before decompression, then the tensor that is earlier in backward (smaller index)
  goes first, so a tensor's compression precedes the next tensor's computation (compression is launched
  as soon as the gradient exists).
* With ``decompress_after_backward`` (adacomp's optimizer: buckets are finished in ``synchronize``)
  a decompression also waits for the end of the backward pass.

Options per tensor (§4.2, flat communication): no compression (allreduce), or compression on the
device / the CPU with the indivisible scheme (allgather) or the divisible scheme (alltoall, then
decompress-aggregate-recompress of one 1/N part, then allgather), Table 2 / Fig. 3-4.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from adacomp import netmodel
from adacomp.compressors.base import Compressor

TimeFn = Callable[[float], float]


# --- empirical models (§4.3) -------------------------------------------------------------------
class EmpiricalTime:
    """Seconds as a function of dense bytes: piecewise-linear through measured points, linear
    extrapolation beyond them (§4.3: profiled times are "almost constant across runs")."""

    def __init__(self, sizes: Sequence[float], seconds: Sequence[float]):
        order = np.argsort(sizes)
        self.x = np.asarray(sizes, dtype=float)[order]
        self.y = np.maximum(np.asarray(seconds, dtype=float)[order], 0.0)
        if self.x.size == 0:
            raise ValueError("EmpiricalTime needs at least one measured size")
        self._cache: dict[float, float] = {}

    def __call__(self, nbytes: float) -> float:
        hit = self._cache.get(nbytes)
        if hit is not None:
            return hit
        x, y = self.x, self.y
        if x.size == 1:
            v = float(y[0] * nbytes / x[0]) if x[0] > 0 else float(y[0])
        elif nbytes > x[-1]:
            v = float(y[-1] + self.tail_slope() * (nbytes - x[-1]))
        else:
            v = float(np.interp(nbytes, x, y))
        self._cache[nbytes] = v
        return v

    def tail_slope(self) -> float:
        """Seconds per byte beyond the largest measured size: least squares over the larger half of
        the points (at least two), so one noisy point does not set the cost of a 100M-element tensor."""
        k = max(2, (self.x.size + 1) // 2)
        x, y = self.x[-k:], self.y[-k:]
        xc = x - x.mean()
        denom = float(np.dot(xc, xc))
        return max(float(np.dot(xc, y - y.mean())) / denom, 0.0) if denom > 0 else 0.0


def alltoall(M: float, N: int, alpha: float, beta: float) -> float:
    """Pairwise-exchange alltoall of ``M`` bytes per rank: ``(N-1) alpha + (N-1)/N M beta``
    (adacomp.netmodel has no alltoall; same alpha-beta conventions as its Table I)."""
    return (N - 1) * alpha + (N - 1) / N * M * beta


def cost_model(world: int, alpha: float, beta: float, compress: dict[str, Callable[[float], float]],
               decompress: dict[str, Callable[[float], float]], forward_s: float = 0.0) -> CostModel:
    """Communication from :mod:`adacomp.netmodel` (ring allreduce, allgather) plus the profiles."""
    return CostModel(world, lambda M: netmodel.ring_allreduce(M, world, alpha, beta),
                     lambda M: netmodel.allgather(M, world, alpha, beta),
                     lambda M: alltoall(M, world, alpha, beta), compress, decompress, forward_s)


Point = tuple[float, float, float]   # (dense bytes, compress seconds, decompress seconds)


def measure_compressor(comp: Compressor, numels: Sequence[int], device: torch.device | str = "cpu",
                       repeats: int = 100, dtype: torch.dtype = torch.float32, feedback: bool = False,
                       budget_s: float = math.inf) -> list[Point]:
    """Timed compress / decompress per size, averaged over up to ``repeats`` runs (§4.3 runs 100).

    Decompression is timed per payload (the simulator multiplies by the number of payloads).
    ``feedback`` counts the error-feedback update (``g - decompress(compress(g))``, what residual
    memory does after every compression) as part of compression. ``budget_s`` bounds the whole
    measurement (adacomp's deviation, issue 21): each size gets an equal share and stops repeating
    once its share is spent (always one timed run), so a few large sizes cannot take minutes."""
    out: list[Point] = []
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sizes = sorted(set(int(x) for x in numels))
    share = budget_s / max(len(sizes), 1)
    for n in sizes:
        g = torch.randn(n, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
        start = time.perf_counter()
        payload, ctx = comp.compress(g, "profile")  # warm-up (allocations, first-call costs)
        comp.decompress(payload, ctx)
        sync()
        c = d = 0.0
        runs = 0
        while runs < repeats and (runs == 0 or time.perf_counter() - start < share):
            t0 = time.perf_counter()
            payload, ctx = comp.compress(g, "profile")
            if feedback:
                g.sub(comp.decompress(payload, ctx).view_as(g))
            sync()
            t1 = time.perf_counter()
            comp.decompress(payload, ctx)
            sync()
            c, d, runs = c + t1 - t0, d + time.perf_counter() - t1, runs + 1
        out.append((float(n * g.element_size()), c / runs, d / runs))
    return out


def fit_times(points: Sequence[Point]) -> tuple[EmpiricalTime, EmpiricalTime]:
    """(compress, decompress) models through measured points (piecewise linear, a least-squares
    linear tail beyond the largest: see :class:`EmpiricalTime`)."""
    pts = sorted(points)
    return (EmpiricalTime([p[0] for p in pts], [p[1] for p in pts]),
            EmpiricalTime([p[0] for p in pts], [p[2] for p in pts]))


def profile_compressor(comp: Compressor, numels: Sequence[int], device: torch.device | str = "cpu",
                       repeats: int = 100, dtype: torch.dtype = torch.float32, feedback: bool = False,
                       budget_s: float = math.inf) -> tuple[EmpiricalTime, EmpiricalTime]:
    """(compress, decompress) time models from :func:`measure_compressor` (§4.3)."""
    return fit_times(measure_compressor(comp, numels, device, repeats, dtype, feedback, budget_s))


def size_grid(numels: Sequence[int], points: int = 12, max_numel: int | None = None) -> list[int]:
    """At most ``points`` sizes spanning ``numels`` (log-spaced), to profile instead of every size.

    With ``max_numel``, sizes above it are not measured: ``max_numel`` itself and two smaller
    points stand in for them, and :class:`EmpiricalTime`'s linear tail extrapolates (compression
    cost is close to linear in size at that scale; timing one 100M-element Top-k 100 times on a CPU
    takes minutes, issue 21)."""
    distinct = sorted(set(int(n) for n in numels if n > 0))
    if max_numel is not None and distinct and distinct[-1] > max_numel:
        distinct = sorted({n for n in distinct if n <= max_numel} | {max_numel, max_numel // 2, max_numel // 4})
    if len(distinct) <= points:
        return distinct
    idx = np.unique(np.round(np.geomspace(1, len(distinct), points)).astype(int) - 1)
    return [distinct[i] for i in idx]


# --- the timeline ------------------------------------------------------------------------------
class Option(NamedTuple):
    """One tensor's compression option: ``where`` in {None, "device", "cpu"}, ``scheme`` in
    {"allreduce", "allgather", "alltoall"}."""

    where: str | None = None
    scheme: str = "allreduce"

    @property
    def compressed(self) -> bool:
        return self.where is not None

    def __str__(self) -> str:
        return "none" if self.where is None else f"{self.where}+{self.scheme}"


NONE = Option()
DEVICE_AG, DEVICE_A2A = Option("device", "allgather"), Option("device", "alltoall")
CPU_AG, CPU_A2A = Option("cpu", "allgather"), Option("cpu", "alltoall")
ALL_OPTIONS = (NONE, DEVICE_AG, DEVICE_A2A, CPU_AG, CPU_A2A)


@dataclass(frozen=True)
class TensorProfile:
    """One gradient tensor, in backward order: index 0 is ready first. ByteComp calls the *last*
    layer of backward propagation the "output layer" (§4.4.2), so a larger index is closer to it."""

    name: str
    nbytes: float            # dense bytes
    compute_s: float         # its backward computation time on the device
    compressed_bytes: float  # payload bytes per rank when compressed


@dataclass
class CostModel:
    """Empirical time models (§4.3): communication from the alpha-beta model, compression and
    decompression per dense tensor size and per resource (``"device"`` / ``"cpu"``)."""

    world: int
    allreduce: TimeFn
    allgather: TimeFn   # seconds for an allgather of M bytes per rank
    alltoall: TimeFn    # seconds for an alltoall where every rank holds M bytes
    compress: dict[str, TimeFn]
    decompress: dict[str, TimeFn]
    forward_s: float = 0.0
    decompress_after_backward: bool = True


@dataclass
class Timeline:
    """Result of :func:`simulate`: ``iteration_s`` = F(S); ``tasks`` (resource, tensor index,
    kind, start, end); ``bubbles`` (start, end) gaps of the communication queue."""

    iteration_s: float
    tasks: list[tuple[str, int, str, float, float]] = field(default_factory=list)
    bubbles: list[tuple[float, float]] = field(default_factory=list)
    comm_end: list[float] = field(default_factory=list)  # per tensor: when its last comm ends

    def of(self, index: int, kind: str) -> tuple[float, float]:
        for _, i, k, s, e in self.tasks:
            if i == index and k == kind:
                return s, e
        raise KeyError((index, kind))


_KIND_ORDER = {"compute": 0, "compress": 1, "comm": 2, "comm1": 2, "middle": 3, "comm2": 4, "decompress": 5}
_EPS = 1e-12


def _build(tensors: Sequence[TensorProfile], options: Sequence[Option], m: CostModel):
    """Task list: (resource, tensor, kind, duration, deps)."""
    tasks: list[tuple[str, int, str, float, list[int]]] = []
    N = m.world
    last_compute = -1
    decomp: list[int] = []
    for i, (t, o) in enumerate(zip(tensors, options)):
        tasks.append(("device", i, "compute", t.compute_s, [last_compute] if last_compute >= 0 else []))
        last_compute = len(tasks) - 1
        if not o.compressed:
            tasks.append(("net", i, "comm", m.allreduce(t.nbytes), [last_compute]))
            continue
        res = o.where
        assert res is not None  # o.compressed
        tasks.append((res, i, "compress", m.compress[res](t.nbytes), [last_compute]))
        if o.scheme == "allgather":
            tasks.append(("net", i, "comm", m.allgather(t.compressed_bytes), [len(tasks) - 1]))
            dec = N * m.decompress[res](t.nbytes)
        elif o.scheme == "alltoall":
            part = t.nbytes / N
            tasks.append(("net", i, "comm1", m.alltoall(t.compressed_bytes), [len(tasks) - 1]))
            mid = N * m.decompress[res](part) + m.compress[res](part)
            tasks.append((res, i, "middle", mid, [len(tasks) - 1]))
            tasks.append(("net", i, "comm2", m.allgather(t.compressed_bytes / N), [len(tasks) - 1]))
            dec = N * m.decompress[res](part)
        else:
            raise ValueError(f"unknown scheme {o.scheme!r} for a compressed tensor; "
                             "expected 'allgather' (indivisible) or 'alltoall' (divisible)")
        tasks.append((res, i, "decompress", dec, [len(tasks) - 1]))
        decomp.append(len(tasks) - 1)
    if m.decompress_after_backward:
        for d in decomp:
            tasks[d][4].append(last_compute)
    return tasks


def simulate(tensors: Sequence[TensorProfile], options: Sequence[Option], model: CostModel,
             record: bool = False) -> Timeline:
    """F(S) and the bubbles of strategy ``options``. ``record`` keeps every task's interval.

    Indivisible strategies with decompression after backward take a linear-time path (the
    resources then depend on each other in one direction only: device -> cpu -> net -> decompress);
    everything else runs the general discrete-event simulation. Both give identical timelines."""
    if len(tensors) != len(options):
        raise ValueError(f"need one option per tensor: {len(tensors)} tensors, {len(options)} options")
    if not record and model.decompress_after_backward and all(o.scheme != "alltoall" for o in options):
        return _simulate_fast(tensors, options, model)
    return _simulate_des(tensors, options, model, record)


def _bubbles(net: list[tuple[float, float]]) -> list[tuple[float, float]]:
    net.sort()
    return [(a[1], b[0]) for a, b in zip(net, net[1:]) if b[0] - a[1] > _EPS]


def _simulate_fast(tensors: Sequence[TensorProfile], options: Sequence[Option], m: CostModel) -> Timeline:
    N = m.world
    dev = cpu = 0.0
    ready: list[tuple[float, int]] = []        # comm ready time per tensor
    durations: list[float] = []
    backward_end = 0.0
    for i, (t, o) in enumerate(zip(tensors, options)):
        dev += t.compute_s
        backward_end = dev
        if not o.compressed:
            ready.append((dev, i))
            durations.append(m.allreduce(t.nbytes))
            continue
        if o.where == "device":
            dev += m.compress["device"](t.nbytes)
            ready.append((dev, i))
        else:
            cpu = max(cpu, dev) + m.compress["cpu"](t.nbytes)
            ready.append((cpu, i))
        durations.append(m.allgather(t.compressed_bytes))
    net_free, comm_end, net = 0.0, [0.0] * len(tensors), []
    for r, i in sorted(ready):
        s = max(r, net_free)
        net_free = comm_end[i] = s + durations[i]
        net.append((s, net_free))
    end = max(dev, cpu, net_free)
    for res in ("device", "cpu"):
        free = dev if res == "device" else cpu
        todo = sorted((max(comm_end[i], backward_end), i) for i, o in enumerate(options) if o.where == res)
        for r, i in todo:
            free = max(free, r) + N * m.decompress[res](tensors[i].nbytes)
        end = max(end, free)
    return Timeline(end + m.forward_s, bubbles=_bubbles(net), comm_end=comm_end)


def _simulate_des(tensors: Sequence[TensorProfile], options: Sequence[Option], model: CostModel,
                  record: bool) -> Timeline:
    """Discrete-event simulation of one iteration; O(T log T) for T tasks."""
    tasks = _build(tensors, options, model)
    n = len(tasks)
    waiting = [len(d) for *_, d in tasks]
    children: list[list[int]] = [[] for _ in range(n)]
    for k, (*_, deps) in enumerate(tasks):
        for d in deps:
            children[d].append(k)
    ready_at = [0.0] * n
    queues: dict[str, list] = {"device": [], "cpu": [], "net": []}
    busy_until = {"device": 0.0, "cpu": 0.0, "net": 0.0}
    busy = {"device": False, "cpu": False, "net": False}
    events: list[tuple[float, int]] = []  # (finish time, task)
    finish = [0.0] * n
    start = [0.0] * n

    def push_ready(k: int, t: float) -> None:
        res, i, kind, _, _ = tasks[k]
        ready_at[k] = t
        heapq.heappush(queues[res], (t, kind == "decompress", i, _KIND_ORDER[kind], k))

    def try_start(res: str, now: float) -> None:
        if busy[res] or not queues[res]:
            return
        k = heapq.heappop(queues[res])[-1]
        s = max(now, busy_until[res])
        start[k], finish[k] = s, s + tasks[k][3]
        busy[res], busy_until[res] = True, finish[k]
        heapq.heappush(events, (finish[k], k))

    for k in range(n):
        if waiting[k] == 0:
            push_ready(k, 0.0)
    for res in queues:
        try_start(res, 0.0)
    while events:
        now = events[0][0]
        freed = set()
        while events and events[0][0] <= now + _EPS:   # all completions at this instant first
            _, k = heapq.heappop(events)
            res = tasks[k][0]
            busy[res] = False
            freed.add(res)
            for c in children[k]:
                waiting[c] -= 1
                if waiting[c] == 0:
                    push_ready(c, max(finish[d] for d in tasks[c][4]))
                    freed.add(tasks[c][0])
        for res in ("device", "cpu", "net"):
            if res in freed:
                try_start(res, now)
    end = max(finish) if n else 0.0
    tl = Timeline(end + model.forward_s)
    comm_end = [0.0] * len(tensors)
    net = []
    for k, (res, i, kind, _, _) in enumerate(tasks):
        if res == "net":
            net.append((start[k], finish[k]))
            comm_end[i] = max(comm_end[i], finish[k])
        if record:
            tl.tasks.append((res, i, kind, start[k], finish[k]))
    tl.bubbles = _bubbles(net)
    tl.comm_end = comm_end
    return tl
