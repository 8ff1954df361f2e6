"""CUDA (issue 33): every method, the offload path, NCCL and gloo with CUDA tensors, both front ends.

Without a CUDA device every test here skips (CI has none). ``ADACOMP_TEST_CUDA_AS=cpu`` runs the same
tests with "cuda" replaced by the CPU, which checks the tests themselves on a machine without a GPU;
on the GPU machine they run as written (``scripts/gpu_setup.sh`` installs, docs/results/cuda.md has the
run). One GPU: NCCL cannot put two ranks on one device, so the two-process tests use gloo, which moves
CUDA tensors through host memory; NCCL is tested with one process.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import adacomp
from adacomp.backends.base import LocalBackend
from tests._dist import run_workers

DEV = os.environ.get("ADACOMP_TEST_CUDA_AS", "cuda")
pytestmark = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA device (issue 33; run on a GPU machine after scripts/gpu_setup.sh)")
STEPS = 4
NONE: dict[str, Any] = {"compressor": {"name": "none"}, "communicator": {"name": "allreduce"}}
TOPK: dict[str, Any] = {"compressor": {"name": "topk", "density": 0.05}, "memory": {"name": "residual"},
                        "communicator": {"name": "allgather"}, "min_numel": 0}


def model() -> nn.Module:
    """Four layers (Streaming DiLoCo's four fragments), two of 8k-16k elements, so every method
    compresses something."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 64),
                         nn.Tanh(), nn.Linear(64, 10))


def batch(rank: int, step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=g).to(device), torch.randint(0, 10, (16,), generator=g).to(device)


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in m.parameters()])


def method_cfg(method: str) -> tuple[dict[str, Any], int]:
    """A built-in method's config for a short run: policies decide within a few steps, the outer loop
    synchronises every 2 inner steps (Streaming DiLoCo: one step per fragment)."""
    from adacomp.bench.zoo import arm_config
    if method == "none":
        return dict(NONE), 0
    cfg, warm = arm_config(method)
    if "local_steps" in cfg:
        ls = cfg["local_steps"]
        cfg["local_steps"] = {**ls, "every": max(2, int(ls.get("fragments", 1)))}
        warm = 2 * cfg["local_steps"]["every"]
    return cfg, warm


def train(cfg: dict[str, Any] | None, device: str, steps: int, rank: int = 0, backend: Any = None,
          seed: int = 0) -> tuple[nn.Module, list[Any]]:
    """``steps`` SGD steps of :func:`model` on ``device``; ``cfg`` None: plain torch (no adacomp)."""
    m = model().to(device)
    torch.manual_seed(seed)  # only the compressors' own randomness follows this seed
    inner = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    opt: Any = inner if cfg is None else adacomp.DistributedOptimizer(
        inner, m.named_parameters(), config=cfg, backend=backend or LocalBackend())
    stats = []
    for s in range(steps):
        x, y = batch(rank, s, device)
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
        if cfg is not None and opt.last_stats is not None and opt.last_stats.dense_bytes:
            stats.append(opt.last_stats)
    if cfg is not None:
        opt.remove_hooks()
    return m, stats


def rel(a: torch.Tensor, b: torch.Tensor, base: torch.Tensor) -> float:
    """||a - b|| / ||b - base||: how far two runs' updates from ``base`` differ."""
    return float((a - b).norm() / (b - base).norm().clamp_min(1e-30))


SEEDED = {"randomk", "dgc", "qsgd"}
"""Methods drawing from their own generator (seeded alike on every rank and run): the CPU's and the
GPU's generators give different streams, so only the scale of the update can be compared."""
TIMED = {"moo", "bytecomp"}
"""Policies choosing from times measured in this run (MOO's compression time, ByteComp's profile): two
runs may choose different densities, seen as different bytes sent; then only the scale is compared."""
METHODS = ["none", "topk", "gtopk", "adtopk", "adtopk_i", "adtopk_t", "mstopk", "randomk", "dgc", "gaussiank",
           "redsync", "sidco", "oktopk", "qsgd", "efsignsgd", "powersgd", "acpsgd", "artopk", "alltoall", "flexible",
           "moo", "lgreco", "bytecomp", "localsgd", "diloco", "diloco_topk", "streaming_diloco", "sparseloco"]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_on_cuda_like_on_cpu(method: str) -> None:
    """On the device: parameters stay there and finite, the bytes sent are below dense, and a method
    whose result does not depend on random numbers gives the CPU's update (up to the order of floating
    point sums, which may move a coordinate across a Top-k boundary)."""
    cfg, warm = method_cfg(method)
    steps = max(STEPS, warm + 3)
    init = flat(model())
    gpu, stats = train(cfg, DEV, steps)
    assert all(p.device.type == torch.device(DEV).type for p in gpu.parameters())
    g = flat(gpu)
    assert torch.isfinite(g).all() and not torch.equal(g, init), method
    assert stats, f"{method}: no synchronisation recorded"
    sent, dense = sum(s.bytes_sent for s in stats), sum(s.dense_bytes for s in stats)
    if method == "none":
        assert sent == dense
        assert torch.equal(g, flat(train(None, DEV, steps)[0])), "compressor none must equal plain SGD exactly"
        return
    if "local_steps" in cfg:  # the saving is fewer synchronisations, some of them dense
        assert len(stats) < steps and 0 < sent <= dense, (method, len(stats), sent, dense)
    elif method == "bytecomp":  # its profiler sees free communication on one process: dense is its right choice
        assert 0 < sent <= dense, (method, sent, dense)
    else:
        assert 0 < sent < dense, (method, sent, dense)
    cpu_model, cpu_stats = train(cfg, "cpu", steps)
    cpu_a, cpu_b = flat(cpu_model), flat(train(cfg, "cpu", steps, seed=1)[0])
    same_choice = method not in TIMED or [s.bytes_sent for s in stats] == [s.bytes_sent for s in cpu_stats]
    if torch.equal(cpu_a, cpu_b) and method not in SEEDED and same_choice:  # the device must compute the same update
        assert rel(g, cpu_a, init) < 0.05, (method, rel(g, cpu_a, init))
    else:  # random sampling (Random-k, QSGD, DGC's sample, PowerSGD's start, ...) or a timed choice: same scale
        ratio = float((g - init).norm() / (cpu_a - init).norm())
        assert 0.2 < ratio < 5.0, (method, ratio)


def _syncs_per_step(method: str, layers: int) -> int:
    """Host waits for the device in one training step (torch's sync debug mode counts them)."""
    from adacomp.bench.gpu_step import host_waits
    from tests._reads import reads_per_step
    cfg, warm = method_cfg(method)
    return reads_per_step(cfg, warm, layers, DEV, host_waits)


@pytest.mark.parametrize("method", ["none", "bf16", "topk", "powersgd", "efsignsgd"])
def test_host_waits_for_the_device_do_not_grow_with_the_number_of_tensors(method: str) -> None:
    """A wait per gradient stops the host from queueing ahead of the device: the step's waits must be
    a constant (the round's vote), not one per tensor."""
    if DEV != "cuda":
        pytest.skip("counts CUDA synchronisations")
    few, many = _syncs_per_step(method, 4), _syncs_per_step(method, 16)
    assert many <= few, (method, few, many)


@pytest.mark.parametrize("kind", ["mstopk", "redsync", "gaussiank"])
def test_every_way_of_counting_a_batch_selects_the_same_on_the_device(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The threshold searches' batched counts (sorted, bucketed, one by one; thresholds uploaded
    pinned or pageable): the same selection on the device, and batching waits less than counting one
    by one. Pinned uploads wait no more than pageable ones."""
    from adacomp import devices
    from adacomp.bench.gpu_step import host_waits
    from adacomp.compressors import get, sparse
    monkeypatch.setattr(devices, "EMULATE", DEV != "cuda")  # on the CPU check: the device's path
    g = torch.Generator().manual_seed(5)
    flats = [torch.randn(n, generator=g).to(DEV) for n in (5_000, 200_000)]
    flats.append(torch.round(flats[1] * 4) / 4)  # ties at every threshold
    got: dict[tuple[str, bool], list[torch.Tensor]] = {}
    waits: dict[tuple[str, bool], int] = {}
    for way in ("off", "sort", "bucket"):
        for pinned in (True, False):
            monkeypatch.setattr(sparse, "BATCHED_COUNTS", way)
            monkeypatch.setattr(devices, "PINNED_UPLOAD", pinned)
            out: list[torch.Tensor] = []
            if DEV == "cuda":
                waits[way, pinned], _ = host_waits(lambda: out.extend(get(kind, density=0.01).select(f, "w")
                                                                      for f in flats))
            else:
                out = [get(kind, density=0.01).select(f, "w") for f in flats]
            got[way, pinned] = out
    ref = got["off", True]
    for key, out in got.items():
        assert all(torch.equal(a, b) for a, b in zip(out, ref)), key
    if DEV == "cuda":
        fewer = (lambda a, b: a <= b) if kind == "gaussiank" else (lambda a, b: a < b)  # one correction or two here
        assert fewer(waits["sort", True], waits["off", True]) and fewer(waits["bucket", True], waits["off", True]), waits
        assert waits["sort", True] <= waits["sort", False], waits


def test_error_feedback_residual_stays_on_the_device_and_equals_the_cpu_one() -> None:
    from adacomp.memories import get as memory
    from adacomp import compressors
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    out = {}
    for dev in ("cpu", DEV):
        c, mem = compressors.get("topk", density=0.01), memory("residual")
        for step in range(3):
            comp = mem.compensate(x.to(dev) * (step + 1), "w")
            payload, ctx = c.compress(comp, "w")
            mem.update(comp, "w", c, payload, ctx)
        out[dev] = (comp, mem.residuals["w"])
    comp_d, res_d = out[DEV]
    assert comp_d.device.type == res_d.device.type == torch.device(DEV).type
    torch.testing.assert_close(comp_d.cpu(), out["cpu"][0])
    torch.testing.assert_close(res_d.cpu(), out["cpu"][1])
    assert int((res_d != 0).sum()) == res_d.numel() - round(0.01 * res_d.numel())  # what was not sent


def test_offload_compresses_on_the_host_and_gives_the_inline_result() -> None:
    """ByteComp's "compress on CPU": the gradient goes to pinned host memory (ordered by a CUDA event),
    is compensated and compressed on the worker thread, and the averaged result comes back to the
    parameter's device. Same values as compressing on the device: Top-k picks from the same numbers."""
    off = {**TOPK, "layers": [{"match": "*", "offload": True}]}
    inline_m, _ = train(TOPK, DEV, STEPS)
    off_m, stats = train(off, DEV, STEPS)
    assert all(p.device.type == torch.device(DEV).type for p in off_m.parameters())
    assert all(s.extra.get("offload_s", 0.0) > 0 for s in stats), [s.extra for s in stats]
    torch.testing.assert_close(flat(off_m), flat(inline_m), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# torch.distributed: NCCL on one process, gloo with CUDA tensors on two
# ---------------------------------------------------------------------------------------------------
def _ddp_run(device: str, steps: int, cfg: dict[str, Any] | None) -> torch.Tensor:
    """DDP on ``device`` (the default allreduce, or adacomp's hook with ``cfg``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = torch.distributed.get_rank()
    m = model().to(device)
    ddp = DDP(m, device_ids=[0] if device == "cuda" else None, bucket_cap_mb=0.01)
    if cfg is not None:
        state, hook = adacomp.ddp.hook(cfg, named_parameters=m.named_parameters())
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    for s in range(steps):
        x, y = batch(rank, s, device)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return flat(m)


def _front_end_run(front: str, cfg: dict[str, Any], device: str, steps: int) -> torch.Tensor:
    if front == "hook":
        return _ddp_run(device, steps, cfg)
    return flat(train(cfg, device, steps, rank=torch.distributed.get_rank(), backend=adacomp.init())[0])


def _distributed_worker(pg: str) -> dict[str, Any]:
    """What the tests below check, measured on this rank."""
    import torch.distributed as dist
    dev = DEV
    if pg in ("gloo", "nccl"):
        dist.init_process_group(pg)  # adacomp's torch backend takes the group that exists
    be = adacomp.init()
    out: dict[str, Any] = {"rank": be.rank(), "group": str(dist.get_backend())}
    ddp = _ddp_run(dev, STEPS, None)
    for front in ("optimizer", "hook"):
        out[f"none_{front}_equals_ddp"] = torch.equal(_front_end_run(front, NONE, dev, STEPS), ddp)
        gpu = _front_end_run(front, TOPK, dev, STEPS)
        # DDP itself cannot put a CPU model on an NCCL-only group (no CPU backend): the hook's
        # CPU reference is then the optimizer's CPU run, which adacomp stages through the GPU
        cpu = out["topk_cpu"] if front == "hook" and pg == "nccl" else _front_end_run(front, TOPK, "cpu", STEPS)
        out["topk_cpu"] = cpu
        out[f"topk_{front}_rel"] = rel(gpu, cpu, flat(model()))
        out[f"topk_{front}"] = gpu
    local = {"local_steps": {"every": 2, "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}},
             **TOPK, "min_numel": 1024}
    m, stats = train(local, dev, 2 * STEPS, rank=be.rank(), backend=be)
    out["local"] = flat(m)
    out["local_compressed"] = bool(stats) and all(s.bytes_sent < s.dense_bytes for s in stats)
    adacomp.shutdown()
    return out


def _check_distributed(results: list[dict[str, Any]]) -> None:
    for r in results:
        for front in ("optimizer", "hook"):
            assert r[f"none_{front}_equals_ddp"], (r["rank"], front)
            assert r[f"topk_{front}_rel"] < 0.05, (r["rank"], front, r[f"topk_{front}_rel"])
        assert r["local_compressed"], r["rank"]
    for key in ("topk_optimizer", "topk_hook", "local"):  # replicas agree after every synchronisation
        assert all(torch.equal(r[key], results[0][key]) for r in results), key


@pytest.mark.parametrize("pg", ["default", "nccl"])
def test_nccl_one_process_both_front_ends_and_the_outer_loop(pg: str) -> None:
    """``default``: the group adacomp makes (``cpu:gloo,cuda:nccl``); ``nccl``: the user's own
    ``init_process_group("nccl")``, which has no CPU backend, so the vote, counts and the CPU run's
    payloads travel through the GPU."""
    if DEV != "cuda":
        pytest.skip("NCCL needs a CUDA device (ADACOMP_TEST_CUDA_AS=cpu runs the gloo test only)")
    res = run_workers(_distributed_worker, 1, pg, timeout=300)
    assert "nccl" in res[0]["group"], res[0]["group"]
    _check_distributed(res)


def test_gloo_two_processes_with_cuda_tensors_both_front_ends_and_the_outer_loop() -> None:
    res = run_workers(_distributed_worker, 2, "gloo", timeout=300)
    _check_distributed(res)
