"""AR-Topk (Alg. 1) on real gloo processes: the aggregate, STAR / VAR rank selection, residuals."""
from __future__ import annotations

import pytest
import torch

from adacomp import communicators, compressors
from adacomp.errors import IncompatibleComponentsError
from tests._dist import run_workers, train_random_steps

SHAPES = {"w": (8, 10), "b": (37,)}
DENSITY = 0.1
STEPS = 5


def to_numpy(obj):
    """Tensors do not survive the result queue once the worker exits; send arrays instead."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_numpy(v) for v in obj]
    return obj


def to_torch(obj):
    import numpy as np
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: to_torch(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_torch(v) for v in obj]
    return obj


def grad_of(rank: int, step: int, name: str) -> torch.Tensor:
    """Rank- and step-dependent gradients; the scale rotates so VAR's winner changes per step."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + len(name))
    scale = 1.0 + 3.0 * ((rank + 2 * step) % 3)
    return scale * torch.randn(SHAPES[name], generator=g)


def _artopk_worker(selections: list[str]) -> dict:
    import adacomp
    from adacomp import memories
    from adacomp.communicators.base import CommEnv, Entry
    from adacomp.engine.error_feedback import exchange
    from adacomp.engine.metrics import StepStats

    backend = adacomp.init("torch")
    out: dict = {}
    for sel in selections:
        comm = communicators.get("artopk", selection=sel)
        mem = memories.get("residual")
        comps = {n: compressors.get("topk", density=DENSITY) for n in SHAPES}
        rec = []
        for step in range(STEPS):
            entries = [Entry(n, mem.compensate(grad_of(backend.rank(), step, n), n), comps[n], mem)
                       for n in SHAPES]
            G = {e.name: e.tensor.clone() for e in entries}
            stats = StepStats(step=step, track_gain=True)
            env = CommEnv(backend, stats, step=step, bucket_index=3)
            res = exchange(comm, entries, env)
            rec.append({"G": G, "out": {e.name: r.clone() for e, r in zip(entries, res)},
                        "residual": {n: mem.residuals[n].clone() for n in SHAPES},
                        "root": int(stats.extra["artopk_root_b3"]), "gain": stats.gain,
                        "bytes": stats.bytes_sent})
        out[sel] = rec
    return to_numpy(out)


def _topk_idx(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    k = max(1, round(DENSITY * flat.numel()))
    return torch.topk(flat.abs(), k).indices


def _check(results: list[dict], world: int) -> None:
    for sel in ("star", "var"):
        for step in range(STEPS):
            recs = [results[r][sel][step] for r in range(world)]
            roots = {rec["root"] for rec in recs}
            assert len(roots) == 1, f"ranks disagree on the broadcasting rank: {roots}"
            root = roots.pop()
            if sel == "star":
                assert root == step % world  # round robin
            else:  # VAR: largest squared norm of each rank's own top-k values
                norms = [sum(float(rec["G"][n].reshape(-1)[_topk_idx(rec["G"][n])].square().sum())
                             for n in SHAPES) for rec in recs]
                assert root == max(range(world), key=lambda r: norms[r])
            for n in SHAPES:
                idx = _topk_idx(recs[root]["G"][n])
                mask = torch.zeros(recs[0]["G"][n].numel(), dtype=torch.bool)
                mask[idx] = True
                mask = mask.view(SHAPES[n])
                expected = sum(torch.where(mask, rec["G"][n], 0.0) for rec in recs) / world
                for rec in recs:
                    torch.testing.assert_close(rec["out"][n], expected)
                    # residual identity (Alg. 1 line 16): G - G restricted to the broadcast indices
                    torch.testing.assert_close(rec["residual"][n], torch.where(mask, 0.0, rec["G"][n]))
            for r, rec in enumerate(recs):
                vals = sum(max(1, round(DENSITY * torch.Size(s).numel())) for s in SHAPES.values()) * 4
                assert rec["bytes"] == vals * (2 if r == root else 1)
                assert 0.0 < rec["gain"] <= 1.0


def _world2_worker() -> dict:
    """Everything the 2-process tests need, in one spawn (process start-up dominates the cost)."""
    out = {"artopk": _artopk_worker(["star", "var"])}
    for selection, fuse in (("star", True), ("var", False)):
        out[f"opt-{selection}-{fuse}"] = _optimizer_worker(selection, fuse)
    return out


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return to_torch(run_workers(_world2_worker, 2))


def test_artopk_mean_over_selected_indices_2(world2: list[dict]) -> None:
    _check([r["artopk"] for r in world2], 2)


def test_artopk_mean_over_selected_indices_4() -> None:
    results = to_torch(run_workers(_artopk_worker, 4, ["star", "var"]))
    _check(results, 4)
    assert {results[0]["star"][s]["root"] for s in range(STEPS)} == {0, 1, 2, 3}  # STAR rotates


def test_artopk_refuses_other_compressors() -> None:
    comm = communicators.get("artopk")
    comm.check(compressors.get("topk", density=0.1))
    with pytest.raises(IncompatibleComponentsError, match="Communicators that fit"):
        comm.check(compressors.get("none"))
    with pytest.raises(ValueError, match="selection"):
        communicators.get("artopk", selection="round_robin")


def _optimizer_worker(selection: str, fuse: bool) -> list[torch.Tensor]:
    import adacomp
    torch.manual_seed(0)  # same init on every rank (tests own the process)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    cfg = {"compressor": {"name": "topk", "density": 0.05}, "memory": {"name": "residual"},
           "communicator": {"name": "artopk", "selection": selection}, "min_numel": 0,
           "fusion": {"bucket_mb": 0.0005, "compressed_buffer": True, "fuse_before_compress": fuse}}
    adacomp.init()
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), config=cfg)
    assert len(opt.buckets) > 1, "the test needs several buckets"
    train_random_steps(model, opt, steps=6, inputs=20, classes=3, seed=adacomp.rank())
    return to_numpy([p.detach() for p in model.parameters()])


@pytest.mark.parametrize("selection,fuse", [("star", True), ("var", False)])
def test_artopk_through_optimizer_multi_bucket(world2: list[dict], selection: str, fuse: bool) -> None:
    params = [r[f"opt-{selection}-{fuse}"] for r in world2]
    for a, b in zip(params[0], params[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # replicas stay identical
