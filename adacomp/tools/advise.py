"""``adacomp advise``: which compression method pays on *this* link and model, and by how much.

Three measurements, one prediction per method, a ranked answer:

1. the link: alpha (s) and beta (s/byte) from :class:`adacomp.netmodel.NetworkProbe` between the
   ranks (optionally through :class:`~adacomp.backends.shaped.ShapedBackend` to ask "what if my
   link were 100 Mbit/s");
2. the model: forward time and the backward time of every gradient in the order backward
   produces them (``register_post_accumulate_grad_hook`` stamps), on every rank at once so the
   ranks compete for the cores as they will when training;
3. each method's compression / decompression cost per tensor, with the real shapes and names.

Prediction (:func:`predict`): the model's parameters are cut into DDP-style buckets (reverse
order, 1 MiB first bucket, then ``bucket_mb``), each bucket split by route as adacomp's DDP hook
does (one collective per bucket and route), and :func:`_hook_step` schedules backward, compression
and communication in the order that hook does the work: the training thread computes, and per
bucket exchanges sizes (``allgather`` only; a blocking collective, so it waits for the link),
compresses and launches the first round; one link serves the collectives in order; after backward
every bucket is waited for, its later rounds run (PowerSGD's Q) and it is decompressed, in bucket
order. (ByteComp's timeline, adacomp/policies/timeline.py, has no blocking exchange and runs later
rounds apart from their bucket; the ResNet-50 / VGG-16 sweeps showed DGC's step growing with the
link time as only the blocking exchange explains.) Communication uses the AR-Topk paper's Table I
costs (adacomp/netmodel.py): ring allreduce for dense and additive payloads (one per round:
PowerSGD's P and Q), allgather for the others. Step time = that schedule + forward + optimizer step.

Calibration (:func:`calibrate`, on by default): what the model leaves out (the hook's Python work
per bucket, error feedback's compensation pass, copies into DDP's buckets, the collectives' own CPU
time on the ranks' cores) is measured once per method: a few real DDP steps through adacomp's hook
on the link advise runs on, minus the model's prediction for that link. A positive difference is
added to the method's prediction for every other link, so the model only extrapolates what depends
on alpha and beta; a negative one (the profile overstated the method's work) scales that work down
instead, so that it no longer hides communication the real step exposes on slower links.

Not modelled (so not ranked): communicators other than allreduce / allgather / allgather_fast
(alltoall, AR-Topk's, Ok-Topk's) and adaptive policies (they change the method while training).

Local steps (the DiLoCo family, config key ``local_steps``; :func:`predict_local`, a separate table,
never part of the ranking or the recommendation above): an inner step communicates nothing, and
every H steps the compressed pseudo-gradient (parameters at the last sync minus the local ones) is
averaged once. Per inner step::

    step = compute + fragments * (work_f + max(0, comm_f - overlap_steps * compute)) / H

and never less than the link's busy time per inner step, ``fragments * comm_f / H``. ``compute`` is
forward + backward + optimizer step from the profile; ``work_f`` the method's profiled compression,
later-round and decompression work (calibrated: ``work_scale``, plus a positive ``overhead_s`` once
per H steps, split over the fragments) on 1/fragments of the model, the pseudo-gradient having the gradients' shapes; ``comm_f``
the Table I cost of the collectives of 1/fragments of the method's payload (the route groups of
:func:`predict`'s buckets, each at 1/fragments of its bytes: even fragments). Bytes per inner step =
payload / H; the peak, one sync, = payload / fragments. Fragments (Streaming DiLoCo) keep the
average and cut the peak (with alpha > 0 they pay ``fragments`` times the latency); ``overlap_steps``
hides a fragment's communication (not its compression work, which runs on the training thread)
behind up to that many inner steps of compute. Left out: the pseudo-gradient subtraction and the
outer optimizer step (an elementwise pass over the parameters per sync, i.e. about an optimizer
step / H per inner step).

What this cannot predict (:data:`LOCAL_CAVEAT`, printed with the table): advise predicts time per
inner step and bytes, not how many steps a local-step run needs to reach a target loss. That depends
on H, the outer optimizer, the data and the model (DiLoCo matches synchronous training at H up to
500 on C4 for LLMs; small models and short runs may need more steps), so a local-step speed-up is an
upper bound on the time-to-accuracy gain unless the steps to the target are equal; measure that
with ``adacomp bench time_to_accuracy``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from adacomp import netmodel
from adacomp.config import load
from adacomp.engine.routes import RouteTable
from adacomp.tools.stepclock import ModelFactory, StepMeasure, StepSampler

BASELINE = "bf16"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
METHODS: dict[str, Mapping[str, Any] | str] = {
    "fp32": {"compressor": {"name": "none"}, "communicator": {"name": "allreduce"}},
    # every tensor in bf16, small ones too: what torch's bf16_compress_hook sends
    "bf16": {"compressor": {"name": "bf16"}, "communicator": {"name": "allreduce"}, "min_numel": 0},
    "topk": "topk.yaml", "dgc": "dgc.yaml", "gaussiank": "gaussiank.yaml", "qsgd": "qsgd.yaml",
    "powersgd": "powersgd.yaml", "acpsgd": "acpsgd.yaml", "efsignsgd": "efsignsgd.yaml",
}
"""Built-in candidates: name -> config dict or a file in configs/ (static methods only)."""
LOCAL_METHODS: dict[str, Mapping[str, Any] | str] = {
    # Top-k 2 % of the pseudo-gradient with error feedback, gathered (the local_steps example config)
    "topk2": {"compressor": {"name": "topk", "density": 0.02}, "memory": {"name": "residual"},
              "communicator": {"name": "allgather"}},
}
"""Pseudo-gradient compressors for the local-step table only (never ranked per step)."""
LOCAL_DEFAULT_H = (8, 32, 128)
LOCAL_DEFAULT_METHODS = ("fp32", "bf16", "topk2")
LOCAL_CAVEAT = (
    "advise predicts time per inner step and bytes; it cannot predict how many steps a local-step run "
    "needs to reach a target loss. That depends on H, the outer optimizer, the data and the model (DiLoCo "
    "reports matching synchronous training at H up to 500 on C4 for LLMs, but small models and short runs "
    "may need more steps), so these speed-ups are upper bounds on time-to-accuracy gains unless the steps "
    "to the target are equal. Measure them with `adacomp bench time_to_accuracy`.")
"""Printed with the local-step table: what its numbers do and do not say."""
ALLREDUCE_LIKE = ("allreduce",)
ALLGATHER_LIKE = ("allgather", "allgather_fast")
FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def method_config(method: str) -> dict[str, Any]:
    """The config dict of a built-in method, of ``configs/<method>.yaml`` or of a YAML path."""
    import yaml
    spec = METHODS.get(method, LOCAL_METHODS.get(method, method))
    if isinstance(spec, str):
        path = Path(spec) if Path(spec).is_file() else CONFIGS / (spec if spec.endswith(".yaml") else spec + ".yaml")
        if not path.is_file():
            raise ValueError(f"unknown method {method!r}: not a built-in ({', '.join(METHODS)}) and no file {path}")
        cfg = yaml.safe_load(path.read_text())
    else:
        cfg = dict(spec)
    cfg.pop("train", None)
    return cfg


# --- profiles ----------------------------------------------------------------------------------
@dataclass
class ModelProfile:
    """Gradients in backward order: name, shape, seconds of backward that produced it."""

    names: list[str]
    shapes: list[torch.Size]
    compute_s: list[float]
    forward_s: float
    optimizer_s: float

    @property
    def backward_s(self) -> float:
        return sum(self.compute_s)


def profile_model(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], repeats: int = 5) -> ModelProfile:
    """Median forward, per-gradient backward and SGD-step times over ``repeats`` runs (one warm-up)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    stamps: list[tuple[str, float]] = []
    handles = [p.register_post_accumulate_grad_hook(lambda _p, n=n: stamps.append((n, time.perf_counter())))
               for n, p in params]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    runs: list[tuple[float, float, dict[str, float], list[str]]] = []
    try:
        for r in range(repeats + 1):
            stamps.clear()
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = loss_fn(model)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            prev, per = t1, {}
            for n, t in stamps:
                per[n], prev = t - prev, t
            if r:
                runs.append((t1 - t0, t3 - t2, per, [n for n, _ in stamps]))
    finally:
        for h in handles:
            h.remove()
    order = runs[-1][3]
    shapes = dict((n, p.shape) for n, p in params)
    return ModelProfile(order, [shapes[n] for n in order], [statistics.median(r[2][n] for r in runs) for n in order],
                        statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))


@dataclass
class MethodProfile:
    """Per gradient: route key, communicator, payload bytes, rounds, compress / decompress seconds."""

    method: str
    config: dict[str, Any]
    route: dict[str, str] = field(default_factory=dict)
    communicator: dict[str, str] = field(default_factory=dict)
    payload: dict[str, float] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)
    dense: dict[str, bool] = field(default_factory=dict)
    compress_s: dict[str, float] = field(default_factory=dict)
    decompress_s: dict[str, float] = field(default_factory=dict)
    # multi-round compressors (PowerSGD: P, then Q): each round's share of ``payload`` (default: equal)
    # and the seconds of the later rounds' local work, which runs after backward (see :func:`predict`)
    round_share: dict[str, tuple[float, ...]] = field(default_factory=dict)
    late_s: dict[str, float] = field(default_factory=dict)
    unsupported: str = ""
    overhead_s: float = 0.0  # measured minus modelled step on the calibration link (:func:`calibrate`)
    # the calibration's factor on this method's profiled work (compress, later rounds, decompress):
    # < 1 where the model, with every cost as profiled, is slower than the measured step (:func:`calibrate`)
    work_scale: float = 1.0
    additive_s: float = 0.0  # measured minus modelled with work_scale 1: the additive-only rule's offset


def profile_method(method: str, prof: ModelProfile, repeats: int = 5, budget_s: float = 3.0) -> MethodProfile:
    """Route every gradient as adacomp would, and time its compression with its real shape and name
    (compress + the error-feedback update when the route has memory; decompress of one payload)."""
    cfg = method_config(method)
    out = MethodProfile(method, cfg)
    c = load(cfg)
    if c.policy.name != "static":
        out.unsupported = f"policy {c.policy.name!r} changes the method while training"
        return out
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(s, generator=gen) for n, s in zip(prof.names, prof.shapes)}
    table = RouteTable(c, [(n, torch.zeros(s)) for n, s in zip(prof.names, prof.shapes)])
    share = budget_s / max(1, len(prof.names))
    for n in prof.names:
        route, comp = table.route_of[n], table.compressors[n]
        comm = route.communicator_spec.name
        out.route[n], out.communicator[n] = route.key, comm
        out.rounds[n] = comp.rounds
        out.dense[n] = route.compressor.name == "none"
        out.payload[n] = float(comp.payload_bytes(grads[n].shape, 4))
        if route.compressor.name == "none":
            out.compress_s[n] = out.decompress_s[n] = 0.0
            continue
        if comm not in ALLREDUCE_LIKE + ALLGATHER_LIKE:
            out.unsupported = f"communicator {comm!r} is not modelled"
            return out
        feedback = route.memory_spec.name != "none"
        g = grads[n]
        payload, ctx = comp.compress(g.clone(), n)  # warm-up, and each round's bytes
        sizes = [_nbytes(payload)]
        for r in range(1, comp.rounds):
            payload, ctx = comp.next_round(r, payload, ctx)
            sizes.append(_nbytes(payload))
        total = float(sum(sizes))
        if comp.rounds > 1 and total > 0:
            out.round_share[n] = tuple(b / total for b in sizes)
        cs: list[float] = []
        ls: list[float] = []
        ds: list[float] = []
        start = time.perf_counter()
        while len(cs) < repeats and (not cs or time.perf_counter() - start < share):
            x = g.clone()
            t0 = time.perf_counter()
            payload, ctx = comp.compress(x, n)
            tm = time.perf_counter()
            for r in range(1, comp.rounds):  # the further rounds run locally on this rank's payload
                payload, ctx = comp.next_round(r, payload, ctx)
            t1 = time.perf_counter()
            dec = comp.decompress(payload, ctx)
            if feedback:
                x.sub_(dec.view_as(x))
            t2 = time.perf_counter()
            cs.append(tm - t0)
            ls.append(t1 - tm)
            ds.append(t2 - t1)
        out.compress_s[n], out.decompress_s[n] = statistics.median(cs), statistics.median(ds)
        out.late_s[n] = statistics.median(ls)
    return out


def _nbytes(payload: Any) -> int:
    return int(sum(t.numel() * t.element_size() for t in payload))


# --- prediction --------------------------------------------------------------------------------
@dataclass
class Prediction:
    method: str
    step_s: float
    comm_bytes: float  # payload bytes one rank sends per step
    compress_s: float
    note: str = ""
    overhead_s: float = 0.0  # the calibration's share of step_s
    work_scale: float = 1.0  # the calibration's factor on the method's profiled work


def _groups(prof: ModelProfile, mp: MethodProfile, bucket_mb: float) -> list[list[str]]:
    """DDP's buckets (backward order; a bucket closes once it holds >= 1 MiB for the first, then
    ``bucket_mb``), split by route."""
    buckets: list[list[str]] = [[]]
    size, cap = 0, FIRST_BUCKET_BYTES
    for n, s in zip(prof.names, prof.shapes):  # as torch's bucket assignment: add, then close when full
        buckets[-1].append(n)
        size += 4 * s.numel()
        if size >= cap:
            buckets.append([])
            size, cap = 0, int(bucket_mb * 2**20)
    out = []
    for b in filter(None, buckets):
        keys = list(dict.fromkeys(mp.route[n] for n in b))
        out += [[n for n in b if mp.route[n] == k] for k in keys]
    return out


@dataclass
class _GroupCost:
    """One DDP bucket's route group as the hook handles it (seconds)."""

    compute: float  # backward that makes the bucket ready (the bucket's first group carries it)
    sizes: float  # the blocking element-count exchange of the ``allgather`` communicator (0: none)
    compress: float  # on the training thread, before the first round leaves
    comm: float  # the first round on the link (dense: the plain allreduce)
    late: float  # the later rounds' local work, after backward
    late_comm: list[float]  # the later rounds on the link, one after another
    decompress: float


def _hook_step(groups: list[_GroupCost], vote: float) -> float:
    """Seconds from the start of backward to the last gradient written back, in the order adacomp's
    DDP hook does the work (adacomp/engine/ddp.py). The training thread runs backward, then per
    bucket: the size exchange (blocking: on one link it waits for every collective queued before it),
    compression, and the launch of the first round; the link serves collectives first in, first out.
    The last bucket's hook then queues the non-finite vote and finishes the buckets in order: wait
    for the first round, the later rounds (local work, then each round's collective, waited for) and
    the decompression."""
    dev = link = 0.0
    ends = []
    for g in groups:
        dev += g.compute
        if g.sizes:
            link = dev = max(dev, link) + g.sizes
        dev += g.compress
        link = max(dev, link) + g.comm
        ends.append(link)
    link += vote
    t = dev
    for g, end in zip(groups, ends):
        t = max(t, end) + g.late
        for c in g.late_comm:
            link = t = max(t, link) + c
        t += g.decompress
    return max(t, link)


def predict(prof: ModelProfile, mp: MethodProfile, world: int, alpha: float, beta: float,
            bucket_mb: float = 25.0) -> Prediction:
    """Predicted seconds per training step of method ``mp`` on ``world`` ranks over link (alpha, beta)."""
    if mp.unsupported:
        return Prediction(mp.method, math.nan, math.nan, math.nan, mp.unsupported)
    compute = dict(zip(prof.names, prof.compute_s))
    done: set[str] = set()
    costs: list[_GroupCost] = []
    sent = compress_total = 0.0

    def allreduce(m: float) -> float:
        return netmodel.ring_allreduce(m, world, alpha, beta)
    for names in _groups(prof, mp, bucket_mb):
        # a bucket is ready when its last gradient is: the first route group of it carries the compute
        bucket_compute = sum(compute[n] for n in names) if not done & set(names) else 0.0
        done.update(names)
        first = names[0]
        if mp.dense[first]:
            nbytes = sum(4.0 * prof.shapes[prof.names.index(n)].numel() for n in names)
            costs.append(_GroupCost(bucket_compute, 0.0, 0.0, allreduce(nbytes), 0.0, [], 0.0))
            sent += nbytes
            continue
        rounds = max(mp.rounds[n] for n in names)
        shares = {n: mp.round_share.get(n) or (1.0 / rounds,) * rounds for n in names}
        by_round = [sum(mp.payload[n] * (shares[n][r] if r < len(shares[n]) else 0.0) for n in names)
                    for r in range(rounds)]
        comp = mp.work_scale * sum(mp.compress_s[n] for n in names)
        dec = mp.work_scale * sum(mp.decompress_s[n] for n in names)
        compress_total += comp
        sent += sum(by_round)
        comm = mp.communicator[first]
        if comm in ALLREDUCE_LIKE:  # additive payloads: one allreduce per round, one decompression of the mean
            costs.append(_GroupCost(bucket_compute, 0.0, comp, allreduce(by_round[0]),
                                    mp.work_scale * sum(mp.late_s.get(n, 0.0) for n in names),
                                    [allreduce(b) for b in by_round[1:]],
                                    dec))
        else:  # every rank's payload gathered and decompressed; ``allgather`` first exchanges the sizes
            sizes = netmodel.allgather(8.0 * len(names), world, alpha, beta) if comm == "allgather" else 0.0
            costs.append(_GroupCost(bucket_compute, sizes, comp, netmodel.allgather(by_round[0], world, alpha, beta),
                                    0.0, [], world * dec))
    vote = allreduce(4) if world > 1 else 0.0
    step = _hook_step(costs, vote) + prof.forward_s + prof.optimizer_s + mp.overhead_s
    return Prediction(mp.method, step, sent, compress_total, overhead_s=mp.overhead_s, work_scale=mp.work_scale)


@dataclass
class LocalPrediction:
    """One local-step candidate (:func:`predict_local`): seconds per inner step and bytes one rank sends."""

    method: str  # the pseudo-gradient's compression method
    every: int  # H: inner steps between the syncs of one fragment
    fragments: int = 1
    overlap_steps: int = 0
    step_s: float = math.nan  # per inner step
    compute_s: float = math.nan  # per inner step: forward + backward + optimizer step
    work_s: float = math.nan  # one fragment's sync: compression, later rounds, decompression (+ calibration)
    comm_s: float = math.nan  # one fragment's sync: its collectives on the link
    exposed_s: float = math.nan  # one fragment's sync as charged: work_s + comm_s not hidden by overlap
    bytes_per_step: float = math.nan  # payload / H
    peak_bytes: float = math.nan  # one sync: payload / fragments
    note: str = ""


def _sync_cost(prof: ModelProfile, mp: MethodProfile, world: int, alpha: float, beta: float, bucket_mb: float,
               share: float) -> tuple[float, float, float]:
    """(work s, link s, payload bytes) of one sync of ``share`` of the model: the route groups of
    :func:`predict`'s buckets, each at ``share`` of its bytes and work, one after another (no backward
    to overlap). Dense groups: a ring allreduce; additive payloads: an allreduce per round and one
    decompression; others: the size exchange (``allgather``), an allgather and ``world`` decompressions."""
    work = comm = sent = 0.0
    for names in _groups(prof, mp, bucket_mb):
        first = names[0]
        if mp.dense[first]:
            nbytes = share * sum(4.0 * prof.shapes[prof.names.index(n)].numel() for n in names)
            comm += netmodel.ring_allreduce(nbytes, world, alpha, beta)
            sent += nbytes
            continue
        rounds = max(mp.rounds[n] for n in names)
        shares = {n: mp.round_share.get(n) or (1.0 / rounds,) * rounds for n in names}
        by_round = [share * sum(mp.payload[n] * (shares[n][r] if r < len(shares[n]) else 0.0) for n in names)
                    for r in range(rounds)]
        sent += sum(by_round)
        work += share * mp.work_scale * sum(mp.compress_s[n] + mp.late_s.get(n, 0.0) for n in names)
        dec = share * mp.work_scale * sum(mp.decompress_s[n] for n in names)
        if mp.communicator[first] in ALLREDUCE_LIKE:
            comm += sum(netmodel.ring_allreduce(b, world, alpha, beta) for b in by_round)
            work += dec
        else:
            if mp.communicator[first] == "allgather":
                comm += netmodel.allgather(share * 8.0 * len(names), world, alpha, beta)
            comm += netmodel.allgather(by_round[0], world, alpha, beta)
            work += world * dec
    return work, comm, sent


def predict_local(prof: ModelProfile, mp: MethodProfile, world: int, alpha: float, beta: float, every: int,
                  fragments: int = 1, overlap_steps: int = 0, bucket_mb: float = 25.0) -> LocalPrediction:
    """Predicted seconds per *inner* step of local-step training (every ``every`` = H steps a sync
    of the pseudo-gradient compressed by ``mp``; ``fragments`` staggered syncs of 1/fragments of the
    model each per H steps; each fragment's communication may overlap ``overlap_steps`` inner steps)::

        step = compute + fragments * (work_f + max(0, comm_f - overlap_steps * compute)) / H

    and at least the link's busy time ``fragments * comm_f / H``. Says nothing about the number of
    steps to a target loss (:data:`LOCAL_CAVEAT`)."""
    if every < 1 or fragments < 1 or fragments > every or overlap_steps < 0:
        raise ValueError(f"local steps need H >= fragments >= 1 and overlap_steps >= 0, got H={every}, "
                         f"fragments={fragments}, overlap_steps={overlap_steps}")
    out = LocalPrediction(mp.method, every, fragments, overlap_steps)
    if mp.unsupported:
        out.note = mp.unsupported
        return out
    compute = prof.forward_s + prof.backward_s + prof.optimizer_s
    work, comm, sent = _sync_cost(prof, mp, world, alpha, beta, bucket_mb, 1.0 / fragments)
    work += max(0.0, mp.overhead_s) / fragments  # what calibration found the model leaves out of a step's exchange
    exposed = work + max(0.0, comm - overlap_steps * compute)
    step = max(compute + fragments * exposed / every, fragments * comm / every)
    return replace(out, step_s=step, compute_s=compute, work_s=work, comm_s=comm, exposed_s=exposed,
                   bytes_per_step=fragments * sent / every, peak_bytes=sent)


def local_candidates(prof: ModelProfile, mps: list[MethodProfile], world: int, alpha: float, beta: float,
                     every: list[int], fragments: int = 1, overlap_steps: int = 0,
                     bucket_mb: float = 25.0) -> list[LocalPrediction]:
    """:func:`predict_local` for every H in ``every`` and every method, fastest first (unmodelled last)."""
    preds = [predict_local(prof, mp, world, alpha, beta, h, fragments, overlap_steps, bucket_mb)
             for h in every for mp in mps]
    return sorted(preds, key=lambda p: (p.step_s != p.step_s, p.step_s if p.step_s == p.step_s else 0.0))


def measure_steps(methods: list[str], model_factory: ModelFactory, backend: Any, steps: int = 5, warmup: int = 2,
                  rounds: int = 1) -> dict[str, StepMeasure]:
    """Real training steps of several methods (adacomp's DDP hook on ``backend``), ``rounds``
    interleaved passes of ``steps`` steps each (:class:`~adacomp.tools.stepclock.StepSampler`).
    Collective."""
    sampler = StepSampler(method_config, model_factory, backend, steps, warmup)
    sampler.run(methods, rounds)
    return {m: sampler.result(m) for m in methods}


def calibrate(prof: ModelProfile, mps: list[MethodProfile], backend: Any, est: netmodel.NetEstimate,
              model_factory: ModelFactory,
              steps: int = 5, warmup: int = 2, bucket_mb: float = 25.0, rounds: int = 1) -> dict[str, float]:
    """Fit each modelled method to its measured step on ``backend`` (whose link ``est`` describes;
    :func:`measure_steps`, ``rounds`` interleaved passes); returns the measured step times.
    Collective. Without torch.distributed (mpirun / horovodrun launches) nothing is measured.

    Where the model is faster than the measurement, the difference is work the model leaves out
    (the hook's Python, copies, the collectives' CPU time) and is added as ``overhead_s``, exposed
    on every link. Where the model is *slower*, the profile overstated the method's own work
    (compression timed tensor by tensor): subtracting a constant would keep that inflated work
    hiding communication that in truth shows on slow links (Top-k on ResNet-50 / VGG-16: the model
    gave the same step at 100 Mbit/s and 1 Gbit/s, the measurement 40-50 ms more), so the work is
    scaled down (``work_scale``) until the model meets the measurement; a remainder, if scaling to
    zero is not enough, becomes a negative ``overhead_s`` of at most the profiled compute (:func:`fit`)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    todo = [mp for mp in mps if not mp.unsupported]
    steps_s = measure_steps([mp.method for mp in todo], model_factory, backend, steps, warmup, rounds)
    measured = {}
    for mp in todo:
        measured[mp.method] = steps_s[mp.method].step_s
        fit(prof, mp, measured[mp.method], backend.size(), est.alpha, est.beta, bucket_mb)
    return measured


def fit(prof: ModelProfile, mp: MethodProfile, step_s: float, world: int, alpha: float, beta: float,
        bucket_mb: float = 25.0) -> None:
    """Set ``mp``'s ``overhead_s`` / ``work_scale`` so that :func:`predict` on the link (alpha, beta)
    gives the measured ``step_s`` (the rule: :func:`calibrate`); ``additive_s`` keeps the additive-only
    offset for comparison. A negative remainder cancels at most the profiled compute (forward,
    backward, optimizer): what is left is time on or waiting for the link, which a measurement on one
    link cannot remove from another, so no prediction is negative."""
    def modelled(scale: float) -> float:
        return predict(prof, replace(mp, work_scale=scale, overhead_s=0.0), world, alpha, beta, bucket_mb).step_s
    full = modelled(1.0)
    mp.additive_s = step_s - full
    mp.work_scale, mp.overhead_s = 1.0, mp.additive_s
    if step_s < full and modelled(0.0) < full:  # too slow, and there is work to scale (not a dense method)
        lo, hi = 0.0, 1.0  # the modelled step grows with the scale: bisect for modelled(scale) = step_s
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if modelled(mid) < step_s else (lo, mid)
        mp.work_scale = lo
        mp.overhead_s = step_s - modelled(lo)
    mp.overhead_s = max(mp.overhead_s, -(prof.forward_s + prof.optimizer_s + sum(prof.compute_s)))


def rank_methods(preds: list[Prediction], baseline: str = BASELINE) -> list[tuple[Prediction, float]]:
    """Modelled methods fastest first, each with its predicted speedup over ``baseline``."""
    base = next((p.step_s for p in preds if p.method == baseline), math.nan)
    ok = sorted((p for p in preds if p.step_s == p.step_s), key=lambda p: p.step_s)
    return [(p, base / p.step_s) for p in ok]


# --- the command -------------------------------------------------------------------------------
SMALL_INPUTS: dict[str, Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]] = {
    "cnn": lambda b, g: (torch.rand(b, 1, 8, 8, generator=g), torch.randint(0, 10, (b,), generator=g)),
    "mlp": lambda b, g: (torch.rand(b, 64, generator=g), torch.randint(0, 10, (b,), generator=g)),
    "charlstm": lambda b, g: (torch.randint(0, 96, (b, 64), generator=g), torch.randint(0, 96, (b, 64), generator=g)),
}


def model_and_loss(name: str, batch: int, kwargs: dict[str, int]) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """A model of the registry and a closure computing its loss on one fixed batch."""
    import torch.nn.functional as F
    from adacomp.models import ZOO, build, synthetic_batch
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build(name, **kwargs)
    if name in ZOO:
        data = synthetic_batch(model, batch)
        return model, data.loss
    x, y = SMALL_INPUTS[name](batch, torch.Generator().manual_seed(0))

    def loss(m: nn.Module) -> torch.Tensor:
        out = m(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return model, loss


def parse_kwargs(items: list[str]) -> dict[str, int]:
    out = {}
    for it in items:
        key, sep, val = it.partition("=")
        if not sep or not val.lstrip("-").isdigit():
            raise ValueError(f"--model-arg expects KEY=INTEGER (e.g. image_size=32), got {it!r}")
        out[key] = int(val)
    return out


def shaped(be: Any, bandwidth: str | None, latency: str | None) -> Any:
    """``be`` behind an emulated link (Table I costs, overlapped) when a bandwidth or latency is asked."""
    if not bandwidth and not latency:
        return be
    from adacomp.backends.shaped import ShapedBackend
    from adacomp.units import parse_duration, parse_rate
    beta = 8.0 / parse_rate(bandwidth) if bandwidth else 0.0
    alpha = parse_duration(latency) if latency else 0.0
    return ShapedBackend(be, alpha=alpha, beta=beta, cost="table1")


def slowest(prof: ModelProfile, be: Any) -> ModelProfile:
    """``prof`` scaled to the slowest rank's compute (collective): a step waits for the slowest rank."""
    local = torch.tensor([prof.forward_s + prof.optimizer_s + prof.backward_s], dtype=torch.float64)
    every = be.allgather(local.view(1, -1), sizes=[1] * be.size()).view(-1)
    scale = float(every.max() / every[be.rank()]) if float(every[be.rank()]) > 0 else 1.0
    return ModelProfile(prof.names, prof.shapes, [c * scale for c in prof.compute_s], prof.forward_s * scale,
                        prof.optimizer_s * scale)


def advise(be: Any, model_name: str, methods: list[str], batch: int = 32, kwargs: dict[str, int] | None = None,
           bucket_mb: float = 25.0, repeats: int = 5, calibration_steps: int = 4,
           target: Any = None, calibration_rounds: int = 2, local_every: list[int] | None = None,
           local_methods: list[str] | None = None, fragments: int = 1, overlap_steps: int = 0,
           ) -> tuple[list[tuple[Prediction, float]], netmodel.NetEstimate, ModelProfile, list[Prediction],
                      list[LocalPrediction]]:
    """Probe, profile, calibrate on ``be``'s link and predict for ``target``'s (default: the same
    link) on every rank (collective: call on all ranks). ``calibration_steps`` 0 skips calibration;
    ``calibration_rounds`` interleaved passes over the methods (:func:`measure_steps`). With
    ``local_every`` (H values) the ``local_methods`` (default :data:`LOCAL_DEFAULT_METHODS`) are also
    predicted as local-step candidates (:func:`local_candidates`; profiled and calibrated like the
    others, never ranked per step)."""
    est = netmodel.NetworkProbe(ops=("allreduce", "allgather")).probe(be)
    model, loss = model_and_loss(model_name, batch, kwargs or {})
    be.barrier()
    prof = slowest(profile_model(model, loss, repeats), be)
    local_names = list(dict.fromkeys(local_methods or LOCAL_DEFAULT_METHODS)) if local_every else []
    names = list(dict.fromkeys([*methods, *local_names]))
    profiles = {m: profile_method(m, prof, repeats) for m in names}
    if calibration_steps:
        calibrate(prof, list(profiles.values()), be, est, lambda: model_and_loss(model_name, batch, kwargs or {}),
                  steps=calibration_steps, warmup=2, bucket_mb=bucket_mb, rounds=calibration_rounds)
    if target is not None and target is not be:
        est = netmodel.NetworkProbe(ops=("allreduce", "allgather")).probe(target)
    preds = [predict(prof, profiles[m], be.size(), est.alpha, est.beta, bucket_mb) for m in methods]
    local = local_candidates(prof, [profiles[m] for m in local_names], be.size(), est.alpha, est.beta,
                             list(local_every or []), fragments, overlap_steps, bucket_mb) if local_names else []
    return rank_methods(preds), est, prof, preds, local


def _size(nbytes: float) -> str:
    """Bytes with a binary unit, 3 significant digits (local steps send from bytes to GiB per step)."""
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 999.5:
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    return f"{nbytes:.3g} GiB"


def _local_report(local: list[LocalPrediction], preds: list[Prediction]) -> list[str]:
    """The local-step section: its own table, its speed-up and bytes against bf16 DDP's per-step
    prediction, and what it cannot say (:data:`LOCAL_CAVEAT`)."""
    import textwrap
    base = next((p for p in preds if p.method == BASELINE), None)
    base_s = base.step_s if base is not None else math.nan
    base_b = base.comm_bytes if base is not None else math.nan
    frag, over = (local[0].fragments, local[0].overlap_steps) if local else (1, 0)
    compute = next((p.compute_s for p in local if p.compute_s == p.compute_s), math.nan)
    intro = ("local steps (DiLoCo family; separate from the ranking above, --local-steps 0 to leave out): "
             "an inner step sends nothing; every H steps the compressed pseudo-gradient is averaged once"
             + (f", in {frag} staggered fragments" if frag > 1 else "")
             + (f", its communication overlapping {over} inner step{'s' if over > 1 else ''}" if over else "") + ". "
             f"Inner step = forward + backward + optimizer ({compute * 1e3:.1f} ms) + fragments x (sync work + "
             "communication not hidden by overlap) / H; 'vs bf16' is bf16 DDP's predicted step over the inner "
             "step, 'B vs bf16' the bytes per step over bf16 DDP's, 'peak/sync' the payload of one sync "
             "(one fragment), 'sync ms' its work + communication.")
    lines = ["", *textwrap.wrap(intro, 110),
             "", f"{'rank':<5}{'H':>5}  {'method':<10}{'step ms':>10}{'vs ' + BASELINE:>10}{'bytes/step':>12}"
                 f"{'B vs bf16':>11}{'peak/sync':>12}{'sync ms':>9}{'comm ms':>9}"]
    i = 0
    for p in local:
        if p.step_s != p.step_s:
            lines.append(f"     {p.every:>5}  {p.method:<10}not modelled: {p.note}")
            continue
        i += 1
        lines.append(f"{'L' + str(i):<5}{p.every:>5}  {p.method:<10}{p.step_s * 1e3:>10.2f}{base_s / p.step_s:>9.2f}x"
                     f"{_size(p.bytes_per_step):>12}{p.bytes_per_step / base_b:>10.3g}x{_size(p.peak_bytes):>12}"
                     f"{(p.work_s + p.comm_s) * 1e3:>9.1f}{p.comm_s * 1e3:>9.1f}")
    lines += ["", *textwrap.wrap("caveat: " + LOCAL_CAVEAT, 110)]
    return lines


def _report(ranked: list[tuple[Prediction, float]], preds: list[Prediction], est: netmodel.NetEstimate,
            prof: ModelProfile, args: argparse.Namespace, world: int,
            local: list[LocalPrediction] | None = None) -> str:
    import yaml
    lines = [f"link: alpha {est.alpha * 1e6:.1f} us, bandwidth {est.bandwidth_gbps * 1e3:.1f} Mbit/s "
             f"({world} ranks, probed{' through an emulated ' + (args.bandwidth or '') + ' ' + (args.latency or '') + ' link' if args.bandwidth or args.latency else ''})",
             f"model {args.model}: {sum(s.numel() for s in prof.shapes) / 1e6:.2f}M parameters in {len(prof.names)} "
             f"tensors; forward {prof.forward_s * 1e3:.1f} ms, backward {prof.backward_s * 1e3:.1f} ms (batch {args.batch})",
             "calibration: " + (f"{args.calibration_steps} x {args.calibration_rounds} real DDP steps per method on the "
                                "real link (interleaved passes); 'calib ms' is what the model left out there, "
                                "added to every prediction; 'work x' scales a method's profiled work where the "
                                "profile overstated it" if args.calibration_steps
                                and any(p.overhead_s or p.work_scale != 1.0 for p in preds) else "none (model only)"),
             "", f"{'rank':<5}{'method':<12}{'step ms':>10}{'vs ' + BASELINE:>10}{'MiB/step':>10}{'compress ms':>13}"
                 f"{'calib ms':>10}{'work x':>8}"]
    for i, (p, sp) in enumerate(ranked, 1):
        lines.append(f"{i:<5}{p.method:<12}{p.step_s * 1e3:>10.1f}{sp:>9.2f}x{p.comm_bytes / 2**20:>10.2f}"
                     f"{p.compress_s * 1e3:>13.1f}{p.overhead_s * 1e3:>+10.1f}{p.work_scale:>8.2f}")
    for p in preds:
        if p.note:
            lines.append(f"     {p.method:<12}not ranked: {p.note}")
    if local:  # before the recommendation, which stays the per-step one, and its YAML (the output's tail)
        lines += _local_report(local, preds)
    if ranked:
        best, sp = ranked[0]
        verdict = (f"recommendation: {best.method} (predicted {sp:.2f}x the step rate of bf16 DDP)" if best.method != BASELINE
                   else "recommendation: bf16 DDP; no compression method is predicted to beat it on this link")
        cfg = method_config(best.method)
        cfg.setdefault("policy", {"name": "static"})
        lines += ["", verdict, "", "# ready YAML (adacomp.DistributedOptimizer(config=...) or adacomp.engine.ddp.hook(...))",
                  yaml.safe_dump(cfg, sort_keys=False).rstrip()]
    return "\n".join(lines)


def local_steps_arg(every: list[int], fragments: int = 1, overlap_steps: int = 0) -> list[int]:
    """The H values of ``--local-steps`` (``[0]``: none, the table is left out), checked."""
    if every == [0]:
        return []
    if any(h < 1 for h in every):
        raise ValueError(f"--local-steps expects H >= 1 (or a single 0 for no local-step table), got {every}")
    if fragments < 1 or fragments > min(every):
        raise ValueError(f"--local-fragments must be between 1 and the smallest H ({min(every)}), got {fragments}")
    if overlap_steps < 0:
        raise ValueError(f"--local-overlap-steps must be >= 0, got {overlap_steps}")
    return list(dict.fromkeys(every))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="adacomp advise", description="measure the link, profile a model and rank "
                                 "compression methods by predicted step time against bf16 DDP; local-step (DiLoCo) "
                                 "candidates in a separate table")
    from adacomp.models import MODELS
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
    ap.add_argument("--model-arg", nargs="*", default=[], metavar="KEY=INT", help="e.g. image_size=32 classes=10")
    ap.add_argument("--config", nargs="*", default=[], help="YAML files to rank as well (static policy)")
    ap.add_argument("--methods", nargs="*", default=list(METHODS), help=f"built-ins: {', '.join(METHODS)}")
    ap.add_argument("--np", type=int, default=2, help="local ranks to probe and profile with (no launcher)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calibration-steps", type=int, default=4, help="real DDP steps per method and pass on the "
                    "real link to measure what the model leaves out (0: none)")
    ap.add_argument("--calibration-rounds", type=int, default=2, help="passes over the methods, alternating them "
                    "(a shared machine's drift then hits every method alike)")
    ap.add_argument("--bandwidth", help="emulate this link (e.g. 100mbit) instead of the real one")
    ap.add_argument("--latency", help="emulated latency per message (e.g. 0.5ms)")
    ap.add_argument("--local-steps", nargs="+", type=int, default=list(LOCAL_DEFAULT_H), metavar="H",
                    help="also predict local-step training (DiLoCo family) syncing every H inner steps, in a "
                    "separate table (default: %(default)s; 0: leave the table out)")
    ap.add_argument("--local-methods", nargs="+", default=list(LOCAL_DEFAULT_METHODS), metavar="METHOD",
                    help="pseudo-gradient compression methods for that table (built-ins, topk2 = Top-k 2%% + "
                    "residual on allgather, or YAML files; default: %(default)s)")
    ap.add_argument("--local-fragments", type=int, default=1, help="Streaming DiLoCo: sync 1/F of the "
                    "parameters at a time, F staggered syncs per H steps")
    ap.add_argument("--local-overlap-steps", type=int, default=0, help="inner steps a fragment's sync may "
                    "overlap with its communication")
    args = ap.parse_args(argv)
    methods = list(dict.fromkeys([*args.methods, BASELINE, *args.config]))
    try:
        kwargs = parse_kwargs(args.model_arg)
        local_every = local_steps_arg(args.local_steps, args.local_fragments, args.local_overlap_steps)
        for m in [*methods, *(args.local_methods if local_every else [])]:
            method_config(m)  # bad names fail here, before any process starts
    except ValueError as exc:
        print(f"adacomp advise: error: {exc}", file=sys.stderr)
        return 2
    from adacomp.backends import detect
    if detect() == "local":
        if args.np < 2:
            raise SystemExit("adacomp advise: --np must be >= 2 (the link is measured between ranks)")
        from adacomp.tools.launch import run_local
        return run_local([sys.executable, "-m", "adacomp.tools.cli", "advise", *argv], args.np)
    import adacomp
    real = adacomp.init()
    be = shaped(real, args.bandwidth, args.latency)
    torch.set_num_threads(1)
    # calibrated on the real link (the emulated one would be measured, not predicted), predicted for be's
    ranked, est, prof, preds, local = advise(real, args.model, methods, args.batch, kwargs, args.bucket_mb,
                                             args.repeats, args.calibration_steps, target=be,
                                             calibration_rounds=args.calibration_rounds, local_every=local_every,
                                             local_methods=args.local_methods, fragments=args.local_fragments,
                                             overlap_steps=args.local_overlap_steps)
    if be.rank() == 0:
        print(_report(ranked, preds, est, prof, args, be.size(), local), flush=True)
    be.barrier()
    adacomp.shutdown()
    return 0
