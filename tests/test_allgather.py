"""allgather / allgather_fast on real gloo: every rank ends with the mean over ranks of each rank's
decompressed payload (2 and 4 processes, driven through Entry / CommEnv and through the optimizer)."""
from __future__ import annotations

import pytest
import torch

from adacomp import communicators, compressors, memories
from adacomp.communicators.allgather import fits, layout, pack, unpack
from tests._dist import run_workers

SHAPES = [(20, 30), (257,), (8, 3, 5, 5)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def plain(obj):
    """Tensors -> numpy arrays for the trip back to the parent: torch.multiprocessing would share
    tensors through file descriptors that vanish when the worker exits before the parent reads."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(o) for o in obj)
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def tensors(obj):
    """Inverse of :func:`plain`."""
    import numpy as np
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors(o) for o in obj)
    if isinstance(obj, dict):
        return {k: tensors(v) for k, v in obj.items()}
    return obj


def available(specs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Drop compressors another module has not registered (yet)."""
    names = set(compressors.names())
    return [s for s in specs if s[0] in names]


def _comm_worker(plan: list[tuple[str, list[tuple[str, dict]]]], steps: int) -> list:
    import adacomp.backends
    from adacomp.communicators.base import CommEnv, Entry
    from adacomp.engine.metrics import StepStats
    backend = adacomp.backends.create("torch")
    rank = backend.rank()
    out = []
    for comm_name, specs in plan:
        comm = communicators.get(comm_name)
        for name, params in specs:
            c = compressors.get(name, **params)
            comm.check(c)
            for step in range(steps):
                c.on_step(step)
                # rank 1 shrinks its second-step gradients: threshold methods then send fewer (or 0)
                scale = 1e-3 if (rank == 1 and step == 1) else 1.0 + rank
                xs = [torch.randn(*s, generator=gen(1000 * rank + 10 * step + i)) * scale
                      for i, s in enumerate(SHAPES)]
                entries = [Entry(f"t{i}", x, c, memories.get("none")) for i, x in enumerate(xs)]
                env = CommEnv(backend, StepStats(), step)
                res = comm.finish(comm.start(entries, env), env)
                local = [c.decompress(e.payload, e.ctx).reshape(e.tensor.shape) for e in entries]
                sizes = [e.payload[0].numel() for e in entries]
                out.append((comm_name, name, step, local, res, sizes))
    return plain(out)


def check_means(results: list[list]) -> dict[str, set]:
    """Assert each rank's result equals the mean of all ranks' local decompressions; return the
    payload sizes seen per compressor (to show ranks did send different sizes)."""
    world = len(results)
    sizes: dict[str, set] = {}
    for rows in zip(*results):
        comm_name, name, step = rows[0][:3]
        for i in range(len(SHAPES)):
            mean = sum(r[3][i] for r in rows) / world
            for r in rows:
                assert r[4][i].shape == SHAPES[i]
                torch.testing.assert_close(r[4][i], mean, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{comm_name}/{name} step {step} entry {i}: {m}")
        sizes.setdefault(name, set()).update(tuple(r[5]) for r in rows)
    return sizes


ALLGATHER = [("topk", {"density": 0.05}), ("mstopk", {"density": 0.05}), ("adtopk", {"density": 0.05, "split": "dim1"}),
             ("adtopk_t", {"density": 0.05, "sigma": 2, "interleave": False}), ("randomk", {"density": 0.05}),
             ("qsgd", {}), ("efsignsgd", {})]
FAST = [("topk", {"density": 0.05}), ("gtopk", {"density": 0.02}), ("adtopk", {"density": 0.05}),
        ("adtopk_i", {"density": 0.05}), ("randomk", {"density": 0.05}), ("qsgd", {}), ("efsignsgd", {})]


def test_allgather_and_fast_give_the_mean_on_2_ranks():
    plan = [("allgather", available(ALLGATHER)), ("allgather_fast", available(FAST))]
    sizes = check_means(tensors(run_workers(_comm_worker, 2, plan, 2)))
    assert len(sizes["adtopk_t"]) > 1  # ranks sent different k (threshold reuse) ...
    assert any(0 in s for s in sizes["adtopk_t"])  # ... and a rank may send nothing at all


def test_allgather_and_fast_give_the_mean_on_4_ranks():
    plan = [("allgather", available([ALLGATHER[1], ALLGATHER[5]])), ("allgather_fast", available([FAST[2], FAST[6]]))]
    check_means(tensors(run_workers(_comm_worker, 4, plan, 1)))


def test_pack_unpack_roundtrip_keeps_dtypes_and_alignment():
    ts = [torch.randn(3, 5), torch.arange(7), torch.tensor(2.5, dtype=torch.float64), torch.ones(5, dtype=torch.uint8),
          torch.randn(4).half()]
    segs, total = layout(ts)
    assert total % 8 == 0 and all(s.offset % 8 == 0 for s in segs)
    for a, b in zip(ts, unpack(pack(ts, segs, total, torch.device("cpu")), segs)):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("world", [1, 3])
def test_aggregate_gathered_in_one_c_call_is_bitwise_the_per_entry_path(world: int, monkeypatch) -> None:
    """A bucket's sparse means and EF-SignSGD means, each from one C call over the gathered bytes (and
    its payloads packed by one C copy), equal bit for bit the per-entry paths: Top-k entries of
    several sizes, one whose positions a rank sent descending (refused by C, averaged by torch), QSGD
    entries, EF-SignSGD entries (one of 1000 elements: a partial sign byte), a rank
    that sent nothing, and ranks whose layouts differ (the variable-size allgather)."""
    from adacomp.communicators import allgather as ag
    from adacomp.communicators.base import Entry
    from adacomp.compressors.workspace import Workspace
    topk, qsgd, signs = compressors.get("topk", density=0.05), compressors.get("qsgd"), compressors.get("efsignsgd")
    qsgd2 = compressors.get("qsgd", bits=4, bucket_size=100)
    chunk2, chunk4 = (compressors.get("chunktopk", density=0.05, chunk=256, bits=b) for b in (2, 4))
    chunk8 = compressors.get("chunktopk", density=0.05, chunk=256, bits=8)  # no packed decode: per entry
    shapes = [(40, 30), (5000,), (300,), (1 << 18,), (1000,), (64, 64), (1037,),
              (1000,), (16, 32), (100,), (300,), (700,), (600,)]
    which = [topk, topk, qsgd, topk, signs, signs, qsgd2, chunk2, chunk2, chunk4, chunk2, chunk8, chunk2]
    zeroed = {2, 10}  # one rank sends zeros: a QSGD bucket of norm 0; Chunk-Top-k scales of 0 (C refuses)
    ranks = []
    for r in range(world):
        xs = [torch.randn(*sh, generator=gen(10 * r + i)) * (0 if r == world - 1 and i in zeroed else 1)
              for i, sh in enumerate(shapes)]
        es = [Entry(f"t{i}", x, which[i], memories.get("none")) for i, x in enumerate(xs)]
        for e in es:
            e.payload, e.ctx = e.compressor.compress(e.tensor, e.name)
        if r == world - 1:  # descending positions (with their values): C refuses, torch still adds them
            es[1].payload = [es[1].payload[0].flip(0), es[1].payload[1].flip(0)]
        ranks.append(es)
    counts = [len(e.payload) for e in ranks[0]]
    bufs, segs = [], []
    for es in ranks:
        ts = [q for e in es for q in e.payload]
        sg, total = layout(ts)
        bufs.append(pack(ts, sg, total, torch.device("cpu")))
        segs.append(sg)
    gathered = torch.cat(bufs)
    starts = [sum(b.numel() for b in bufs[:r]) for r in range(world)]
    calls: list = []
    real, real_signs, real_q = ag._native.sparse_means_packed, ag._native.sign_means_packed, ag._native.qsgd_means_packed
    real_c = ag._native.chunk_means_packed
    monkeypatch.setattr(ag._native, "sparse_means_packed", lambda *a: calls.append(real(*a)) or calls[-1])
    monkeypatch.setattr(ag._native, "sign_means_packed", lambda *a: calls.append(real_signs(*a)) or calls[-1])
    monkeypatch.setattr(ag._native, "qsgd_means_packed", lambda *a: calls.append(("q", real_q(*a))) or calls[-1][1])
    monkeypatch.setattr(ag._native, "chunk_means_packed", lambda *a: calls.append(("c", real_c(*a))) or calls[-1][1])
    got = ag.aggregate_gathered(ranks[0], counts, gathered, segs, starts, Workspace())
    # one call for the three Top-k entries (C refused the descending one), one for the two EF-SignSGD
    # entries, one for the two QSGD ones (one bucket, and buckets of 100 with a partial
    # last one; a rank that sent zeros), one for the 2- and 4-bit Chunk-Top-k entries (full chunks and
    # a partial one, full chunks only, a partial chunk only; C refuses the one with zero scales; 8 bits
    # are not taken); a world of one averages one entry at a time, as mean_into does
    assert calls == [[True, False, True]] + ([("q", True), True, ("c", [True, True, True, False, True])]
                                             if world > 1 else [])
    want = ag.aggregate_gathered(ranks[0], counts, gathered, segs, starts, None)  # no workspace: torch per entry
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    monkeypatch.setattr(ag._native, "copy_many", lambda *a: False)  # torch's slice copies
    for es, b in zip(ranks, bufs):
        ts = [q for e in es for q in e.payload]
        sg, total = layout(ts)
        assert torch.equal(pack(ts, sg, total, torch.device("cpu")), b)


def _gloo_gathers() -> int:
    from adacomp.backends.torch_dist import TorchBackend
    from tests.backend_worker import check_allgather, check_allgather_into
    b = TorchBackend(timeout_s=60)
    check_allgather(b, b.rank(), b.size())
    check_allgather_into(b, b.rank(), b.size())
    return b.rank()


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_allgather_and_gathering_into_the_callers_buffer(world: int) -> None:
    """The torch backend's allgather (varying rows, empty ranks, half types) and its ``out`` buffer,
    as MPI and Horovod run them under mpirun / horovodrun (tests/backend_worker.py)."""
    assert sorted(run_workers(_gloo_gathers, world, timeout=120)) == list(range(world))


def test_what_fits_is_named():
    assert fits(compressors.get("topk")) == ["allgather", "allgather_fast"]
    assert fits(compressors.get("mstopk")) == ["allgather"]
    assert fits(compressors.get("randomk")) == ["allreduce", "allgather", "allgather_fast"]
    if "powersgd" in compressors.names():
        with pytest.raises(ValueError, match="allreduce"):
            communicators.get("allgather").check(compressors.get("powersgd"))


def _optimizer_worker(routes: list[tuple[dict, str]], steps: int) -> list:
    import adacomp.backends
    backend = adacomp.backends.create("torch")
    return [plain(_train(backend, comp, comm, steps)) for comp, comm in routes]


def own_and_averaged(model, opt, rank: int, step: int) -> dict:
    """One backward through ``opt`` on this rank's batch of ``step``; returns this rank's own
    gradients (autograd.grad fires no accumulate-grad hook, so nothing is averaged there) while
    ``p.grad`` receives the averaged ones."""
    x = torch.randn(16, 32, generator=gen(100 * rank + step))
    y = torch.randint(0, 10, (16,), generator=gen(100 * rank + step))
    opt.zero_grad()
    names, params = zip(*model.named_parameters())
    own = dict(zip(names, torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return own


def _train(backend, comp: dict, comm: str, steps: int) -> list:
    import adacomp
    torch.manual_seed(0)  # same model on every rank (this child process owns its global RNG)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    rank = backend.rank()
    cfg = {"backend": "torch", "compressor": comp, "memory": {"name": "residual"},
           "communicator": {"name": comm}, "fusion": {"bucket_mb": 0.0003}, "min_numel": 0}
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), config=cfg, backend=backend)
    assert len(opt.buckets) > 1
    ref_comp = {n: compressors.get(comp["name"], **{k: v for k, v in comp.items() if k != "name"})
                for n, _ in model.named_parameters()}
    ref_mem = memories.get("residual")
    out = []
    for step in range(steps):
        own = own_and_averaged(model, opt, rank, step)
        local = {}
        for n, p in model.named_parameters():  # what this rank sends, recomputed independently
            g = ref_mem.compensate(own[n].clone(), n)
            payload, ctx = ref_comp[n].compress(g, n)
            ref_mem.update(g, n, ref_comp[n], payload, ctx)
            local[n] = ref_comp[n].decompress(payload, ctx).reshape(p.shape)
        opt.synchronize()
        out.append((local, {n: p.grad.clone() for n, p in model.named_parameters()}))
        with opt.skip_synchronize():
            opt.step()
        for c in ref_comp.values():
            c.on_step(step + 1)
    return out


ROUTES = [({"name": "topk", "density": 0.05}, "allgather_fast"),
          ({"name": "adtopk_t", "density": 0.05, "sigma": 2, "tau": 2}, "allgather")]


def test_through_distributed_optimizer_2_ranks():
    """After ``synchronize()`` each p.grad is the mean of what the ranks sent (multi-bucket model,
    residual memory, 4 steps so adtopk_t goes through warm-up, reuse and re-estimation)."""
    res = tensors(run_workers(_optimizer_worker, 2, ROUTES, 4))
    for route in range(len(ROUTES)):
        for step in range(4):
            (l0, g0), (l1, g1) = res[0][route][step], res[1][route][step]
            for n in l0:
                mean = (l0[n] + l1[n]) / 2
                torch.testing.assert_close(g0[n], mean, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(g1[n], mean, rtol=1e-5, atol=1e-6)


def _no_wait_worker(signal: str, buckets: int) -> list:
    """Rank 0 starts bucket 0 and only then lets rank 1 begin: ``allgather.start`` must return
    without the other ranks' counts (the old blocking count exchange deadlocked here)."""
    import os
    import time

    import adacomp.backends
    from adacomp.communicators.base import CommEnv, Entry
    from adacomp.engine.metrics import StepStats
    backend = adacomp.backends.create("torch")
    rank = backend.rank()
    comm, c = communicators.get("allgather"), compressors.get("gaussiank", density=0.05)
    env = CommEnv(backend, StepStats(), 0)
    entries = [[Entry(f"b{b}t{i}", torch.randn(*s, generator=gen(100 * rank + 10 * b + i)) * (1 + rank + b),
                      c, memories.get("none")) for i, s in enumerate(SHAPES)] for b in range(buckets)]
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(signal):
            assert time.monotonic() < deadline, "rank 0's start(bucket 0) waited for rank 1"
            time.sleep(0.01)
    pendings = [comm.start(entries[0], env)]
    if rank == 0:
        open(signal, "w").close()
    pendings += [comm.start(es, env) for es in entries[1:]]
    means = [comm.finish(p, env) for p in pendings]
    local = [[c.decompress(e.payload, e.ctx).reshape(e.tensor.shape) for e in es] for es in entries]
    sizes = [[e.payload[0].numel() for e in es] for es in entries]
    return plain([local, means, sizes])


def test_allgather_start_does_not_wait_for_the_other_ranks(tmp_path):
    """The count exchange is asynchronous: a rank's ``start`` returns before its peers have reached
    the bucket, and the queued data gathers still give every bucket the exact mean."""
    (l0, m0, s0), (l1, m1, s1) = tensors(run_workers(_no_wait_worker, 2, str(tmp_path / "started"), 3, timeout=120))
    assert s0 != s1  # the ranks sent different sizes, so the counts were needed
    for b in range(3):
        for i in range(len(SHAPES)):
            mean = (l0[b][i] + l1[b][i]) / 2
            assert torch.equal(m0[b][i], m1[b][i])
            torch.testing.assert_close(m0[b][i], mean, rtol=1e-6, atol=1e-7)
