"""Elementwise compressors (bf16, fp16) compress each fusion bucket as one flattened tensor unless
``fusion.fuse_before_compress: false``: one call per bucket instead of one per tensor (on an H100
the per-tensor casts added 1.3-3x the fused ones' time to a step, docs/results/cuda.md), and the same bits,
since every output element depends on its own input element only. Real gloo ranks, every front end."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from adacomp.backends.base import LocalBackend
from adacomp.config import load
from adacomp.engine.routes import fuses_before_compress
from tests._dist import run_workers
from tests._fronts import flat_params, train_through


@pytest.mark.parametrize("compressor,setting,fused", [
    ("bf16", None, True), ("fp16", None, True), ("bf16", False, False), ("topk", None, False),
    ("topk", True, True), ("none", None, False), ("none", True, False), ("gtopk", False, True)])
def test_which_routes_fuse(compressor: str, setting: bool | None, fused: bool) -> None:
    fusion = {} if setting is None else {"fuse_before_compress": setting}
    comm = "allreduce" if compressor in ("bf16", "fp16", "none") else "allgather"
    cfg = load({"compressor": {"name": compressor}, "communicator": {"name": comm}, "fusion": fusion})
    assert fuses_before_compress(cfg, compressor) is fused


def test_the_optimizer_fuses_bf16_buckets_by_default() -> None:
    import adacomp
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    for fusion, fused in (({}, True), ({"fuse_before_compress": False}, False)):
        opt = adacomp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(),
                                           config={"compressor": {"name": "bf16"}, "min_numel": 0, "fusion": fusion},
                                           backend=LocalBackend())
        net(torch.randn(2, 16)).sum().backward()
        opt.step()
        assert all(opt.is_fused(n) is fused for n, _ in net.named_parameters()), fusion
        opt.remove_hooks()


def _train(compressor: str, memory: str, front: str) -> bool:
    """Two gloo ranks, different data: five steps (six inner steps of the outer loop) through
    ``front`` with the bucket fused (the default) and with ``fuse_before_compress: false`` (under
    FSDP2 each unit's weight and bias are one entry, or two). With
    residuals through the hook this also checks that DDP's rebuilt buckets (after step one, other
    members in another order) take over the first buckets' residuals, which then leave the memory."""
    import torch.distributed as dist

    import adacomp
    dist.init_process_group("gloo")
    adacomp.init()
    rank = dist.get_rank()

    def run(fusion: dict[str, Any]) -> torch.Tensor:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 10))
        cfg: dict[str, Any] = {"compressor": {"name": compressor}, "memory": {"name": memory},
                               "communicator": {"name": "allreduce"}, "min_numel": 0,
                               "fusion": {"bucket_mb": 0.01, **fusion}}  # two buckets
        state = train_through(front, net, cfg, rank, 16, {"bucket_cap_mb": 0.01})
        if state is not None and memory != "none" and not fusion:  # DDP's first buckets gave their state on
            mem = next(iter(state.table.routes.values())).memory
            held = set(mem.state_dict()["residuals"])
            assert held == set(state._members) and len(held) >= 1, (held, state._members)
        return flat_params(net)

    fused, apart = run({}), run({"fuse_before_compress": False})
    torch.manual_seed(0)
    start = flat_params(torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 10)))
    adacomp.shutdown()
    return bool(torch.equal(fused, apart) and not torch.equal(fused, start))


@pytest.mark.parametrize("front", ["optimizer", "hook", "outer", "fsdp"])
@pytest.mark.parametrize("compressor,memory", [("bf16", "none"), ("fp16", "residual")])
def test_fused_casts_train_bitwise_as_per_tensor_casts(compressor: str, memory: str, front: str) -> None:
    assert run_workers(_train, 2, compressor, memory, front, timeout=300) == [True, True]


@pytest.mark.parametrize("memory,way", [("residual", "live"), ("residual", "state_dict"), ("dgc", "live")])
def test_regroup_gathers_the_members_slices_and_leaves_a_snapshot_alone(memory: str, way: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP's rebuilt bucket [b, c, a] from the first buckets [a, b] and [c]: each member's slice, zeros
    for a member nobody held; a snapshot taken before still restores the old layout."""
    from adacomp.memories import get
    mem = get(memory)
    if way == "state_dict":  # the generic path a memory without live dicts takes
        monkeypatch.setattr(type(mem), "_live", lambda self, pieces: None)
    sections = ("velocity", "accumulated") if memory == "dgc" else ("residuals",)
    old = {"ab": torch.arange(5.0), "c": torch.arange(10.0, 13.0)}  # a: 0-1, b: 2-4; c: 10-12
    mem.load_state_dict({s: {k: v * (i + 1) for k, v in old.items()} for i, s in enumerate(sections)})
    snap = mem.snapshot()
    assert mem.holds("ab") and not mem.holds("bca")
    mem.regroup("bca", [("ab", 2, 3), ("c", 0, 3), ("ab", 0, 2), (None, 0, 2)])
    state = mem.state_dict()
    for i, s in enumerate(sections):
        want = torch.tensor([2.0, 3, 4, 10, 11, 12, 0, 1, 0, 0]) * (i + 1)
        assert torch.equal(state[s]["bca"], want), (s, state[s]["bca"])
    mem.restore(snap)
    assert not mem.holds("bca") and mem.holds("ab") and mem.holds("c")


def _resume_through_the_hook() -> bool:
    """Six hook steps of fp16 with residuals (fused by default) against three, the hook's state and
    the parameters saved, a fresh DDP model and hook loading them, and three more: the same
    parameters (the resumed DDP regroups its buckets again after its first step)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import adacomp
    import adacomp.ddp
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = {"compressor": {"name": "fp16"}, "memory": {"name": "residual"}, "communicator": {"name": "allreduce"},
           "min_numel": 0, "fusion": {"bucket_mb": 0.01}}

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 10))

    def steps(m: torch.nn.Module, state: Any, n: int, start: int) -> Any:
        ddp = DDP(m, bucket_cap_mb=0.01)
        hook = adacomp.ddp.register(ddp, cfg, named_parameters=m.named_parameters())
        if state is not None:
            hook.load_state_dict(state)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for s in range(start, start + n):
            g = torch.Generator().manual_seed(100 * rank + s)
            opt.zero_grad()
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        return hook.state_dict()

    whole = net()
    steps(whole, None, 6, 0)
    half = net()
    saved = steps(half, None, 3, 0)
    assert saved["fused_members"], saved.keys()
    again = net()
    again.load_state_dict(half.state_dict())
    steps(again, saved, 3, 3)
    return bool(torch.equal(flat_params(again), flat_params(whole)))


def test_a_resumed_hook_regroups_its_fused_buckets_as_the_uninterrupted_one() -> None:
    assert run_workers(_resume_through_the_hook, 2, timeout=300) == [True, True]


def _placed_worker(strided: bool) -> dict[str, Any]:
    """Two gloo ranks, one bucket of bf16 entries of odd sizes (spans at unaligned offsets) through
    the allreduce communicator, with the C casts (each payload written into the bucket's buffer)
    and with torch's casts and concatenation; ``strided``: one entry is a transposed view, which the
    C cast declines, so the whole bucket takes the usual path."""
    import os

    import adacomp.backends
    from adacomp import communicators, compressors, memories
    from adacomp.communicators.base import CommEnv, Entry
    from adacomp.engine.metrics import StepStats
    backend = adacomp.backends.create("torch")
    g = torch.Generator().manual_seed(7 + backend.rank())
    xs = [torch.randn(n, generator=g) * 100 for n in (70_001, 3, 17, 65_539)]
    if strided:
        xs[2] = torch.randn(17, 5, generator=g).t()
    out: dict[str, Any] = {}
    for native in ("1", "0"):
        os.environ["ADACOMP_NATIVE"] = native
        comm, comp = communicators.get("allreduce"), compressors.get("bf16")
        entries = [Entry(f"t{i}", x.clone(), comp, memories.get("none")) for i, x in enumerate(xs)]
        env = CommEnv(backend, StepStats(), 0)
        pending = comm.start(entries, env)
        buf = comm._buffers[(0, 0)]
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
        out[f"placed{native}"] = [lo <= e.payload[0].data_ptr() < hi for e in entries]
        out[f"means{native}"] = comm.finish(pending, env)
        out[f"sent{native}"] = env.stats.bytes_sent
    os.environ["ADACOMP_NATIVE"] = "1"
    return out


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "one-strided-entry"])
def test_casts_written_into_the_allreduce_buffer_average_as_torch_does(strided: bool) -> None:
    """bf16 under ``allreduce`` with no memory: the C casts write the payloads straight into the
    bucket's buffer (no concatenation), and the ranks' means are bitwise those of torch's casts
    and concatenation; where one entry cannot be cast in C, no entry is placed and the means are
    the same."""
    results = run_workers(_placed_worker, 2, strided, timeout=120)
    for res in results:
        assert res["placed1"] == [not strided] * 4 and res["placed0"] == [False] * 4
        assert res["sent1"] == res["sent0"] == 2 * (70_001 + 3 + (85 if strided else 17) + 65_539)
        for a, b, other in zip(res["means1"], res["means0"], results[0]["means1"]):  # and the ranks agree
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)) and torch.equal(a, other)
