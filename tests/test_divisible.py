"""ByteComp's divisible scheme (communicator ``alltoall``: alltoall, average + recompress one part,
allgather) on real gloo processes, against a single-process simulation of every rank; and the
optimizer's CPU offload worker (``offload: true`` / ``set_route(offload=True)``), which must give
bitwise the same training as compressing inline."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from adacomp import communicators, compressors, memories
from adacomp.communicators.alltoall import _Joined, _Part, bounds
from adacomp.config import ComponentSpec, load
from adacomp.errors import ConfigError, IncompatibleComponentsError
from tests._dist import run_workers
from tests.test_allgather import plain, tensors

SHAPES = [(40, 25), (7,), (3, 2)]  # (3, 2) has fewer elements than 8 ranks would need


def _grad(rank: int, step: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + i)
    return torch.randn(*SHAPES[i], generator=g) * (1.0 + rank)


def test_bounds_cover_every_element_once() -> None:
    for n in (0, 1, 5, 7, 100, 101):
        for world in (1, 2, 3, 8):
            spans = bounds(n, world)
            assert len(spans) == world and spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert max(h - lo for lo, h in spans) - min(h - lo for lo, h in spans) <= 1


@pytest.mark.parametrize("name,params", [("topk", {"density": 0.1}), ("qsgd", {"bits": 4})])
def test_joined_parts_decompress_like_one_tensor(name: str, params: dict) -> None:
    """What memory.update sees: the parts' decompressions side by side, sparse indices global."""
    comp = compressors.get(name, **params)
    x = torch.randn(10, 9, generator=torch.Generator().manual_seed(0))
    spans = bounds(x.numel(), 4)
    parts = [_Part(*comp.compress(x.reshape(-1)[lo:hi], f"p{j}")) for j, (lo, hi) in enumerate(spans)]
    joined = _Joined(comp, parts, spans, x)
    want = torch.cat([comp.decompress(p.payload, p.ctx).reshape(-1) for p in parts]).view_as(x)
    assert torch.equal(joined.decompress(), want)
    if comp.sparse:
        vals, idx = joined.payload()
        assert torch.equal(torch.zeros(x.numel()).index_put_((idx,), vals).view_as(x), want)


@pytest.mark.parametrize("memory,joins", [("residual", False), ("none", False), ("dgc", True)])
def test_the_joined_payload_is_built_only_for_a_memory_that_reads_it(memory: str, joins: bool) -> None:
    """A memory that reads the payload only through the compressor (``payload_blind``: residual,
    none) gets the parts' own tensors, no concatenation; DGC's (it masks the sent indices) the
    joined payload. The step's bytes and gain are the joined payload's either way."""
    from adacomp.communicators.base import Entry
    from adacomp.engine.metrics import StepStats
    comm = communicators.get("alltoall")
    comp = compressors.get("topk", density=0.1)
    x = torch.randn(10, 9, generator=torch.Generator().manual_seed(1))
    e = Entry("w", x, comp, memories.get(memory))
    comm.precompress([e], 4)
    joined = e.ctx
    assert isinstance(joined, _Joined) and e.payload is not None
    if joins:
        assert e.payload is joined.payload()
    else:
        assert joined._joined is None  # nothing concatenated
        assert [t.data_ptr() for t in e.payload] == [t.data_ptr() for p in joined.parts for t in p.payload]
    want = sum(t.numel() * t.element_size() for t in joined.payload())
    for track in (False, True):
        stats = StepStats()
        stats.track_gain = track
        comm.record([e], SimpleNamespace(stats=stats))
        assert stats.bytes_sent == want and stats.dense_bytes == 4 * x.numel()
        if track:
            ref = StepStats()
            ref.track_gain = True
            ref.add_gain_of(joined.payload()[0], x)
            assert stats.gain == ref.gain


def simulate(world: int, steps: int, name: str, params: dict, feedback: bool) -> list[list[torch.Tensor]]:
    """Every rank's view of the divisible scheme, computed in one process: stage-1 residual memory
    per rank, stage-2 residual per (tensor, part) at the part's owner. Returns the mean per step."""
    comp = [compressors.get(name, **params) for _ in range(world)]
    res1: dict[tuple[int, int], torch.Tensor] = {}
    res2: dict[tuple[int, int], torch.Tensor] = {}
    out = []
    for step in range(steps):
        step_out = []
        for i in range(len(SHAPES)):
            spans = bounds(_grad(0, 0, i).numel(), world)
            sent = []  # sent[r][j]: rank r's decompressed part j
            for r in range(world):
                g = _grad(r, step, i).reshape(-1)
                g = g + res1.get((r, i), 0)
                parts = []
                for j, (lo, hi) in enumerate(spans):
                    if hi == lo:
                        parts.append(g[lo:hi].clone())
                        continue
                    p, c = comp[r].compress(g[lo:hi], f"t{i}/part{j}")
                    parts.append(comp[r].decompress(p, c).reshape(-1))
                res1[(r, i)] = g - torch.cat(parts)
                sent.append(parts)
            full = []
            for j, (lo, hi) in enumerate(spans):
                if hi == lo:
                    continue
                avg = sum(sent[r][j] for r in range(world)) / world
                if feedback:
                    avg = avg + res2.get((j, i), 0)
                p, c = comp[j].compress(avg, f"t{i}/agg{j}")
                back = comp[j].decompress(p, c).reshape(-1)
                res2[(j, i)] = avg - back
                full.append(back)
            step_out.append(torch.cat(full).view(SHAPES[i]))
        out.append(step_out)
    return out


def _divisible_worker(name: str, params: dict, feedback: bool, steps: int) -> list:
    import adacomp.backends
    from adacomp.communicators.base import CommEnv, Entry
    from adacomp.engine.error_feedback import exchange
    from adacomp.engine.metrics import StepStats
    backend = adacomp.backends.create("torch")
    comm = communicators.get("alltoall", feedback=feedback)
    comp, mem = compressors.get(name, **params), memories.get("residual")
    comm.check(comp)
    out = []
    for step in range(steps):
        entries = [Entry(f"t{i}", mem.compensate(_grad(backend.rank(), step, i), f"t{i}"), comp, mem)
                   for i in range(len(SHAPES))]
        env = CommEnv(backend, StepStats(), step)
        out.append(exchange(comm, entries, env))
    return plain(out)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name,params,feedback", [("topk", {"density": 0.2}, True),
                                                  ("topk", {"density": 0.2}, False),
                                                  ("efsignsgd", {}, True),
                                                  ("gaussiank", {"density": 0.2}, True)])
def test_alltoall_matches_simulation(world: int, name: str, params: dict, feedback: bool) -> None:
    got = [tensors(r) for r in run_workers(_divisible_worker, world, name, params, feedback, 3)]
    want = simulate(world, 3, name, params, feedback)
    for step in range(3):
        for i in range(len(SHAPES)):
            for r in range(world):
                assert got[r][step][i].shape == want[step][i].shape
                assert torch.allclose(got[r][step][i], want[step][i], atol=1e-5, rtol=1e-5), (r, step, i)


def test_alltoall_lossless_compressor_gives_exact_mean() -> None:
    got = [tensors(r) for r in run_workers(_divisible_worker, 3, "topk", {"density": 1.0}, True, 1)]
    for i in range(len(SHAPES)):
        mean = sum(_grad(r, 0, i) for r in range(3)) / 3
        for r in range(3):
            assert torch.allclose(got[r][0][i], mean, atol=1e-6)


PARTS_DEFERRED = {"topk": {"density": 0.05}, "efsignsgd": {}, "chunktopk": {"density": 0.02}}
"""method -> parameters, of the compressors whose residual alltoall's parts leave owed"""


def _deferred_parts_worker(method: str, habit: str) -> list:
    import adacomp.backends
    from tests.test_native import _habit_run
    backend = adacomp.backends.create("torch")
    g = torch.Generator().manual_seed(31 + backend.rank())
    # Top-k: parts of 131K elements send 6554 positions each at 5 % (DEFER_ZEROING_MIN), an uneven
    # split; the others' parts send fewer and write their residuals. EF-SignSGD, Chunk-Top-k: every
    # part defers
    shapes = [(1 << 18) + 3, (300, 256), 4000]
    grads = [[torch.randn(s, generator=g) * (1 + step) for s in shapes] for step in range(6)]
    junk = [torch.randn(s, generator=g) * 1e3 for s in shapes]
    out: list = []
    for defer in (True, False):
        comp = compressors.get(method, **PARTS_DEFERRED[method])
        other = compressors.get("randomk", density=0.1) if habit == "other_compressor" else comp
        if not defer:
            comp.defer_residual = lambda *args: None  # every part's residual written at every update
        elif habit == "one_part_declines":  # the owed residual written into that part's span, then added
            take = comp.compensate_owed
            comp.compensate_owed = lambda g, base, token, o, key: not key.endswith("part1") and take(g, base, token, o, key)
        memory = memories.get("residual")
        seen, owed, _ = _habit_run(memory, comp, other, "alltoall", grads, junk, habit,
                                   lambda: sum(o.spans is not None for o in memory._owed.values()), backend=backend)
        out += [seen, owed]
    return out


@pytest.mark.parametrize("habit", ["none", "rollback", "state_dict", "rescale", "other_compressor",
                                   "one_part_declines"])
@pytest.mark.parametrize("method", sorted(PARTS_DEFERRED))
def test_parts_residuals_left_to_the_next_compensation_are_the_written_ones(method: str, habit: str) -> None:
    """Top-k, EF-SignSGD and Chunk-Top-k through alltoall on two gloo ranks: each part's residual
    (Top-k's zeroing of its sent positions, EF-SignSGD's decoded signs, Chunk-Top-k's kept values) left
    to the next compensation's pass, part by part under the parts' keys (``_Joined.defer_residual``),
    gives bitwise the compensated tensors, means and residuals of the same run with every part's
    residual written at each update, a habit in the middle included (a rolled-back round, a
    state_dict read, a loss-scale change, a step through another compressor), and where the pass
    declines one part and takes the other."""
    from tests.test_native import bits
    for fast, owed, slow, owed_slow in run_workers(_deferred_parts_worker, 2, method, habit):
        assert owed > 0 and owed_slow == 0 and len(fast) == len(slow)
        for a, b in zip(fast, slow):
            assert torch.equal(bits(a), bits(b))


def test_alltoall_refuses_multi_round_compressors() -> None:
    with pytest.raises(IncompatibleComponentsError, match="rounds"):
        communicators.get("alltoall").check(compressors.get("powersgd"))


def test_alltoall_state_roundtrip() -> None:
    """The second-stage error is a declared memory: saved, loaded (also under the older per-part
    keys), listed for the engine and resharded by its own rule (parts concatenated and re-cut)."""
    comm = communicators.get("alltoall")
    assert comm.memories() == [comm.second]
    comm.second.residuals["w"] = torch.ones(3)
    other = communicators.get("alltoall")
    other.load_state_dict(comm.state_dict())
    assert torch.equal(other.second.residuals["w"], torch.ones(3))
    other.load_state_dict({"residuals": {"w/part1": torch.zeros(2)}})  # written before the memory was declared
    assert torch.equal(other.second.residuals["w"], torch.zeros(2))
    with pytest.raises(ValueError, match="unknown state keys"):
        other.load_state_dict({"bogus": 1})
    old = [{"residuals": {"w": torch.arange(3.0) + 3 * r}} for r in range(2)]
    three = [comm.reshard(old, 3, s)["residuals"]["w"] for s in range(3)]
    assert torch.equal(torch.cat(three), torch.arange(6.0)) and [t.numel() for t in three] == [2, 2, 2]


# --- offload: compression on the CPU worker thread ----------------------------------------------
def test_offload_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"layers\[0\]\.offload.*allgather"):
        load({"compressor": {"name": "randomk"}, "communicator": {"name": "allreduce"},
              "layers": [{"match": "*", "offload": True}]})
    with pytest.raises(ConfigError, match=r"layers\[0\]\.offload.*needs a compressor"):
        load({"layers": [{"match": "*", "offload": True}]})
    cfg = load({"compressor": {"name": "topk"}, "communicator": {"name": "allgather"},
                "layers": [{"match": "fc*", "offload": True}]})
    assert cfg.layers[0].offload


def _train_worker(layers: list, routes: dict, steps: int) -> dict:
    import adacomp
    from tests._dist import train_random_steps
    adacomp.init(backend="torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 10))
    cfg = {"compressor": {"name": "topk", "density": 0.05}, "communicator": {"name": "allgather"},
           "fusion": {"bucket_mb": 0.005}, "min_numel": 100, "layers": layers}
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), config=cfg)
    for n, r in routes.items():
        opt.set_route(n, ComponentSpec("topk", {"density": 0.05}), ComponentSpec("residual"),
                      ComponentSpec(r["comm"]), offload=r["offload"])
    train_random_steps(model, opt, steps, 32, 10, seed=1)
    offloaded = sum(s.get("offload_s", 0.0) > 0 for s in opt.history)
    state = opt.state_dict()["adacomp"]["components"]
    opt.remove_hooks()
    return {"params": plain({n: p for n, p in model.named_parameters()}), "offloaded_steps": offloaded,
            "buckets": len(opt.buckets), "state_keys": sorted(state)}


def test_offload_is_bitwise_identical_to_inline_compression() -> None:
    steps = 6
    inline = run_workers(_train_worker, 2, [], {}, steps)
    off = run_workers(_train_worker, 2, [{"match": "0.weight", "offload": True}, {"match": "4.weight", "offload": True}],
                      {}, steps)
    assert off[0]["buckets"] > 2 and off[0]["offloaded_steps"] == steps
    for a, b in zip(inline, off):
        for n, p in a["params"].items():
            assert (p == b["params"][n]).all(), n


def test_mixed_routes_alltoall_offloaded_and_inline_train_in_step() -> None:
    """Every option of a ByteComp plan at once: dense, device+allgather, cpu+allgather,
    device+alltoall, cpu+alltoall; ranks stay identical and the run matches an inline twin."""
    routes = {"0.weight": {"comm": "alltoall", "offload": True}, "2.weight": {"comm": "alltoall", "offload": False},
              "4.weight": {"comm": "allgather", "offload": True}}
    inline = {n: {**r, "offload": False} for n, r in routes.items()}
    got = run_workers(_train_worker, 2, [], routes, 5)
    twin = run_workers(_train_worker, 2, [], inline, 5)
    assert got[0]["offloaded_steps"] == 5
    for n, p in got[0]["params"].items():
        assert (p == got[1]["params"][n]).all(), f"ranks differ on {n}"
        assert (p == twin[0]["params"][n]).all(), f"offloaded run differs from inline on {n}"


# --- the same run on every backend ---------------------------------------------------------------
def _gloo_digest() -> str:
    import adacomp
    from tests.backend_worker import divisible_digest
    adacomp.init(backend="torch")
    return divisible_digest()


def _launched_digests(proc, which: str = "divisible") -> set[str]:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return {line.split()[-1] for line in out.splitlines() if f"{which.upper()}_DIGEST" in line}


def test_divisible_and_offload_give_the_same_bits_on_gloo_mpi_and_horovod() -> None:
    """alltoall + offload through real mpirun / horovodrun launches: every rank, every backend,
    bit-identical parameters (each rank averages the same values in rank order)."""
    from tests.test_backend_horovod import _MISSING, horovodrun
    from tests.test_backend_mpi import WORKER, mpirun
    gloo = set(run_workers(_gloo_digest, 2))
    assert len(gloo) == 1
    assert _launched_digests(mpirun(2, str(WORKER), "divisible", "mpi", timeout=180)) == gloo
    if _MISSING is None:
        assert _launched_digests(horovodrun(2, str(WORKER), "divisible", "horovod", timeout=180)) == gloo
