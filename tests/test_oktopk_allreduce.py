"""Ok-Topk's sparse allreduce (communicators/oktopk.py) on real gloo ranks: the aggregate equals a
one-process simulation of the algorithm, traffic per step stays ~k (not P x k), error feedback
conserves what was dropped, and ``oktopk`` is the compressor's default communicator."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from adacomp import communicators, compressors, config
from tests._dist import run_workers
from tests.test_allgather import plain, tensors

SHAPES = [(100, 200), (10000,), (50, 50)]
DENSITY = 0.01
K = sum(max(1, round(DENSITY * torch.Size(s).numel())) for s in SHAPES)


def grad(rank: int, step: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + i)
    return torch.randn(*SHAPES[i], generator=g, dtype=torch.float64) * (1.0 + 0.3 * rank)


def _worker(comp: dict, comm: dict, steps: int) -> list:
    import adacomp.backends
    from adacomp import memories
    from adacomp.communicators.base import CommEnv, Entry
    from adacomp.engine.error_feedback import exchange
    from adacomp.engine.metrics import StepStats
    backend = adacomp.backends.create("torch")
    rank = backend.rank()
    c = compressors.get(comp["name"], **{k: v for k, v in comp.items() if k != "name"})
    com = communicators.get(comm["name"], **{k: v for k, v in comm.items() if k != "name"})
    com.check(c)
    mem = memories.get("residual")
    out = []
    for step in range(steps):
        c.on_step(step)
        accs = [mem.compensate(grad(rank, step, i), f"t{i}").clone() for i in range(len(SHAPES))]
        entries = [Entry(f"t{i}", a, c, mem) for i, a in enumerate(accs)]
        env = CommEnv(backend, StepStats(), step)
        res = exchange(com, entries, env)
        resid = [mem.residuals[f"t{i}"].clone() for i in range(len(SHAPES))]
        out.append((accs, res, resid, dict(env.stats.extra)))
    return plain(out)


def simulate(world: int, steps: int) -> list[list[torch.Tensor]]:
    """Ok-Topk with exact local top-k and an exact global top-k every step, in one process:
    local top-k of each compensated gradient, sum over ranks, global top-k of the sum over the
    union, mean; each rank keeps as residual its compensated values outside (local ∩ global)."""
    offs = [0]
    for s in SHAPES:
        offs.append(offs[-1] + torch.Size(s).numel())
    resid = [torch.zeros(offs[-1], dtype=torch.float64) for _ in range(world)]
    outs = []
    for step in range(steps):
        accs = [torch.cat([grad(r, step, i).reshape(-1) for i in range(len(SHAPES))]) + resid[r]
                for r in range(world)]
        sels = []
        for a in accs:
            sel = [torch.topk(a[offs[i]:offs[i + 1]].abs(), max(1, round(DENSITY * (offs[i + 1] - offs[i])))).indices
                   + offs[i] for i in range(len(SHAPES))]
            sels.append(torch.cat(sel))
        total = torch.zeros(offs[-1], dtype=torch.float64)
        union = torch.zeros(offs[-1], dtype=torch.bool)
        for a, s in zip(accs, sels):
            total[s] += a[s]
            union[s] = True
        cand = union.nonzero().view(-1)
        thr = torch.topk(total[cand].abs(), min(K, cand.numel())).values.min()
        chosen = cand[total[cand].abs() >= thr]
        mean = torch.zeros(offs[-1], dtype=torch.float64)
        mean[chosen] = total[chosen] / world
        outs.append([mean[offs[i]:offs[i + 1]].view(SHAPES[i]) for i in range(len(SHAPES))])
        keep = torch.zeros(offs[-1], dtype=torch.bool)
        keep[chosen] = True
        for r in range(world):
            used = torch.zeros(offs[-1], dtype=torch.bool)
            used[sels[r]] = True
            resid[r] = torch.where(used & keep, torch.zeros_like(accs[r]), accs[r])
    return outs


@pytest.mark.parametrize("world", [2, 4])
def test_aggregate_equals_one_process_simulation(world):
    steps = 3
    res = tensors(run_workers(_worker, world, {"name": "topk", "density": DENSITY},
                              {"name": "oktopk", "period": 1, "rebalance": 2}, steps))
    sim = simulate(world, steps)
    for step in range(steps):
        for r in range(world):
            for i in range(len(SHAPES)):
                torch.testing.assert_close(res[r][step][1][i], sim[step][i], rtol=1e-12, atol=1e-12,
                                           msg=lambda m: f"rank {r} step {step} entry {i}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_traffic_is_about_k_not_p_times_k(world):
    """oktopk compressor (reused local threshold) + oktopk communicator vs + allgather: elements a
    rank receives per step and non-zeros of the aggregate. Also checks error-feedback conservation:
    sum over ranks of the residuals + P x the aggregate = sum of the compensated gradients."""
    steps = 4
    ok = tensors(run_workers(_worker, world, {"name": "oktopk", "density": DENSITY},
                             {"name": "oktopk", "period": 32}, steps))
    ag = tensors(run_workers(_worker, world, {"name": "oktopk", "density": DENSITY}, {"name": "allgather"}, steps))
    recv_steps: list[float] = []
    for step in range(steps):
        nnz = sum(int(torch.count_nonzero(t)) for t in ok[0][step][1])
        nnz_ag = sum(int(torch.count_nonzero(t)) for t in ag[0][step][1])
        assert 0.5 * K <= nnz <= 2 * K, (step, nnz, K)
        assert nnz == ok[0][step][3]["oktopk_nnz"]
        if world == 4:
            assert nnz_ag > 3 * K  # the union of 4 local selections
        for r in range(world):
            recv = ok[r][step][3]["oktopk_recv_elems"]
            # step 0 adds the first global estimation (~2k magnitudes); allgather on 4 ranks: 3k pairs
            assert recv <= (3.1 if step == 0 else 2.5) * K, (r, step, recv, K)
        if step > 0:  # after the first estimation
            recv_steps.append(sum(ok[r][step][3]["oktopk_recv_elems"] for r in range(world)) / world)
        for i in range(len(SHAPES)):
            lhs = sum(ok[r][step][2][i] for r in range(world)) + world * ok[0][step][1][i]
            rhs = sum(ok[r][step][0][i] for r in range(world))
            torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)
            for r in range(1, world):
                torch.testing.assert_close(ok[r][step][1][i], ok[0][step][1][i], rtol=0, atol=0)
    assert sum(recv_steps) / len(recv_steps) <= 2.2 * K, (recv_steps, K)


def test_oktopk_is_its_own_default_communicator():
    cfg = config.load({"compressor": {"name": "oktopk", "density": 0.01}, "memory": "residual"})
    assert cfg.communicator.name == "oktopk"
    cfg = config.load({"compressor": "oktopk", "communicator": "allgather"})
    assert cfg.communicator.name == "allgather"
    cfg = config.load({"compressor": "topk", "communicator": "allgather",
                       "layers": [{"match": "fc*", "compressor": "oktopk"}]})
    assert cfg.layers[0].communicator.name == "oktopk"
    assert "oktopk" in communicators.fitting(compressors.get("dgc"))
    with pytest.raises(ValueError, match="oktopk"):
        communicators.get("oktopk").check(compressors.get("qsgd"))
    with pytest.raises(ValueError, match="period"):
        communicators.get("oktopk", period=0)


def _train_worker(steps: int) -> list:
    import adacomp
    import adacomp.backends
    backend = adacomp.backends.create("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    cfg = {"backend": "torch", "compressor": {"name": "oktopk", "density": 0.02, "period": 4},
           "memory": "residual", "min_numel": 0}
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), config=cfg, backend=backend)
    g = torch.Generator().manual_seed(backend.rank())
    losses = []
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    state = opt.state_dict()
    return plain(([p.detach().clone() for p in model.parameters()], losses, sorted(state)))


def test_through_distributed_optimizer_models_stay_identical():
    res = tensors(run_workers(_train_worker, 2, 6))
    for a, b in zip(res[0][0], res[1][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _bucket_worker(front: str, method: str) -> list:
    """Five steps of ``method`` (a fused bucket) through ``front`` (tests._fronts), with the bucket's
    compensation read from the gradients where they lie and with the flattened copy: the parameters
    of both, and how often the first path ran."""
    import torch.distributed as dist

    import adacomp
    from adacomp.memories.base import ResidualMemory
    from tests._fronts import train_through
    dist.init_process_group("gloo")
    adacomp.init()
    rank = dist.get_rank()
    comp: dict[str, Any] = {"name": method, "density": 0.02, **({"period": 4} if method == "oktopk" else {})}
    cfg = {"compressor": comp, "memory": "residual", "min_numel": 0, "fusion": {"bucket_mb": 0.5},
           "communicator": "oktopk" if method == "oktopk" else "allgather"}
    out, ran = [], [0]
    real = ResidualMemory.compensate_gathered

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        got = real(self, *a, **k)
        ran[0] += got is not None
        return got
    for gathered in (True, False):
        ResidualMemory.compensate_gathered = counted if gathered else (lambda self, *a, **k: None)  # type: ignore
        torch.manual_seed(0)
        # buckets (and FSDP units) of several tensors, over gTop-k's prefilter size (2^16 elements)
        net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 192),
                                  torch.nn.ReLU(), torch.nn.Linear(192, 10))
        hook = train_through(front, net, cfg, rank, 32, {"bucket_cap_mb": 0.5})
        out.append(([p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                     for p in net.parameters()], hook.adacomp_state_dict() if hook is not None else {}))
    ResidualMemory.compensate_gathered = real  # type: ignore[method-assign]
    adacomp.shutdown()
    return plain((out, ran[0]))


@pytest.mark.parametrize("method", ["oktopk", "gtopk"])
@pytest.mark.parametrize("front", ["optimizer", "hook", "outer", "fsdp"])
def test_bucket_compensation_from_the_gradients_changes_nothing(front: str, method: str) -> None:
    """The fused bucket's compensation written from the gradients where they lie (no flattened
    copy: ``Memory.compensate_gathered``) gives the flattened path's parameters bitwise, through
    every front end, on every rank (and the hook's component state); and it ran."""
    from tests.test_checkpoint_resume import state_diff
    for (a, b), ran in tensors(run_workers(_bucket_worker, 2, front, method, timeout=300)):
        assert ran > 0
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        assert not state_diff(a[1], b[1])
