"""One round behind both front ends (docs/architecture.md, "One round"): the optimizer and the DDP
hook run the same begin -> launch -> vote -> finish -> rollback code, so a bad round is undone the
same way whichever front end a user picked. Real gloo processes throughout.

* a NaN on one rank, for every communicator (allgather, alltoall with its second-stage residuals,
  oktopk, artopk, allreduce with PowerSGD / ACP-SGD / Random-k / bf16, allgather_fast with QSGD /
  EF-SignSGD, allgather with the threshold searches RedSync / MSTop-k / Gaussian-k / ADTopk):
  every component state bitwise as before the
  round, the step not counted, and the run continues exactly as the run that skipped that batch;
* a GradScaler overflow with ACP-SGD (whose P/Q alternation follows the step count) changes
  nothing compared with the run that skipped that batch, in both front ends;
* the hook on a 2-rank sub-group of 4 ranks (``DDP(process_group=...)``, no ``adacomp.init()``,
  DGC memory with clipping, which needs the group's size) equals the optimizer on that sub-group.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_workers
from tests.test_checkpoint_resume import flatten, state_diff

FRONT_ENDS = ("optimizer", "hook")
_SPARSE = {"compressor": {"name": "topk", "density": 0.05}, "memory": {"name": "residual"}}
COMMUNICATORS: dict[str, dict[str, Any]] = {
    "allgather": {**_SPARSE, "communicator": {"name": "allgather"}},
    "alltoall": {**_SPARSE, "communicator": {"name": "alltoall"}},
    "oktopk": {"compressor": {"name": "oktopk", "density": 0.05, "period": 2}, "memory": {"name": "residual"},
               "communicator": {"name": "oktopk"}},
    "artopk": {**_SPARSE, "communicator": {"name": "artopk"}},
    "powersgd": {"compressor": {"name": "powersgd", "rank": 2}, "memory": {"name": "residual"},
                 "communicator": {"name": "allreduce"}},
    "acpsgd": {"compressor": {"name": "acpsgd", "rank": 2}, "memory": {"name": "residual"},
               "communicator": {"name": "allreduce"}},
    "dgc": {"compressor": {"name": "dgc", "density": 0.05, "sample_ratio": 1.0}, "memory": {"name": "dgc"},
            "communicator": {"name": "allgather"}},
    # QSGD's C random stream, rounding and fused mean over ranks (Compressor.mean_into)
    "qsgd": {"compressor": {"name": "qsgd", "bits": 4}, "memory": {"name": "residual"},
             "communicator": {"name": "allgather_fast"}},
    # its counter-based stream: the per-tensor call counts are the state a bad round must not move
    "qsgd_counter": {"compressor": {"name": "qsgd", "bits": 4, "rng": "counter"}, "memory": {"name": "none"},
                     "communicator": {"name": "allgather_fast"}},
    # the C paths of issue 32's later work: EF-SignSGD's code-table mean and one-pass residual,
    # Random-k's in-place residual and bitmap sample, bf16's C casts (with residual memory, so there is state)
    "efsignsgd": {"compressor": {"name": "efsignsgd"}, "memory": {"name": "residual"},
                  "communicator": {"name": "allgather_fast"}},
    "randomk": {"compressor": {"name": "randomk", "density": 0.05}, "memory": {"name": "residual"},
                "communicator": {"name": "allreduce"}},
    "bf16": {"compressor": {"name": "bf16"}, "memory": {"name": "residual"}, "communicator": {"name": "allreduce"}},
    # Chunk-Top-k's C selection, in-place residual at the kept positions and fused sparse mean
    "chunktopk": {"compressor": {"name": "chunktopk", "density": 0.05, "chunk": 64, "bits": 2},
                  "memory": {"name": "residual"}, "communicator": {"name": "allgather_fast"}},
    # the threshold searches' C paths: |g|'s statistics without writing it and counts / selections
    # on g (RedSync, MSTop-k), the std from lane sums (Gaussian-k), ADTopk's per-row candidates
    "redsync": {"compressor": {"name": "redsync", "density": 0.05}, "memory": {"name": "residual"},
                "communicator": {"name": "allgather"}},
    "mstopk": {"compressor": {"name": "mstopk", "density": 0.05}, "memory": {"name": "residual"},
               "communicator": {"name": "allgather"}},
    "gaussiank": {"compressor": {"name": "gaussiank", "density": 0.05}, "memory": {"name": "residual"},
                  "communicator": {"name": "allgather"}},
    "adtopk": {"compressor": {"name": "adtopk", "density": 0.05}, "memory": {"name": "residual"},
               "communicator": {"name": "allgather"}},
}
# state that must really be there, so "unchanged" is not vacuous
EXPECT = {"allgather": "residuals", "alltoall": "alltoall\"}]/residuals", "oktopk": "threshold", "artopk": "residuals",
          "powersgd": "/q/", "acpsgd": "/p/", "dgc": "velocity", "qsgd": "residuals", "qsgd_counter": "calls", "efsignsgd": "residuals",
          "randomk": "residuals", "bf16": "residuals", "chunktopk": "residuals", "redsync": "residuals",
          "mstopk": "residuals", "gaussiank": "residuals", "adtopk": "residuals"}
NAN_RANK, NAN_PARAM = 1, "fc1.weight"
BEFORE, AFTER = 3, 3


def _config(comm: str, **over: Any) -> dict[str, Any]:
    return {**COMMUNICATORS[comm], "fusion": {"bucket_mb": 0.05}, "min_numel": 512, "nonfinite": "skip", **over}


class Front:
    """One model trained through one front end; ``state()`` is everything a round may change."""

    def __init__(self, front: str, cfg: dict[str, Any], backend: Any = None, group: Any = None,
                 scaler: Any = None):
        import adacomp
        from adacomp.models import DigitsCNN
        torch.manual_seed(0)
        self.front, self.scaler = front, scaler
        self.base = DigitsCNN()
        momentum = 0.0 if cfg["memory"]["name"] == "dgc" else 0.9  # memory dgc applies momentum itself
        inner = torch.optim.SGD(self.base.parameters(), lr=0.05, momentum=momentum)
        if front == "optimizer":
            self.model: torch.nn.Module = self.base
            self.opt: Any = adacomp.DistributedOptimizer(inner, self.base.named_parameters(), config=cfg,
                                                         backend=backend, grad_scaler=scaler)
            self.hook: Any = None
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.model = DDP(self.base, bucket_cap_mb=0.05, process_group=group)
            self.hook = adacomp.ddp.register(self.model, cfg, grad_scaler=scaler)
            self.opt = inner

    def step(self, x: torch.Tensor, y: torch.Tensor, nan: bool = False) -> None:
        p = dict(self.base.named_parameters())[NAN_PARAM]
        handle = p.register_hook(lambda g: torch.full_like(g, float("inf") if self.scaler else float("nan"))) \
            if nan else None
        try:
            self.opt.zero_grad()
            loss = F.cross_entropy(self.model(x), y)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                loss.backward()
                finite = all(torch.isfinite(q.grad).all() for q in self.base.parameters() if q.grad is not None)
                if self.front == "optimizer" or finite:  # the hook's user skips as GradScaler would
                    self.opt.step()
        finally:
            if handle is not None:
                handle.remove()

    def train(self, start: int, n: int, rank: int) -> None:
        for s in range(start, start + n):
            g = torch.Generator().manual_seed(1000 * s + rank)
            self.step(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g))

    def steps(self) -> int:
        return self.hook.steps if self.hook is not None else self.opt.steps

    def state(self) -> dict[str, Any]:
        comp = (self.hook if self.hook is not None else self.opt).adacomp_state_dict()
        inner = (self.opt.inner if self.hook is None else self.opt).state_dict()
        return copy.deepcopy({"adacomp": comp, "inner": inner,
                              "params": {k: v.clone() for k, v in self.base.state_dict().items()}})

    def close(self) -> None:
        if self.hook is None:
            self.opt.remove_hooks()


def _rollback_job(front: str, defer: bool = False) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist
    from adacomp.engine.round import Rounds
    Rounds.defer_on_cpu = defer  # the accelerators' check: float64 sums kept, read once at the vote
    dist.init_process_group("gloo")  # the hook needs no adacomp.init(); the optimizer gets the backend
    from adacomp.backends.torch_dist import TorchBackend
    rank = dist.get_rank()
    backend = TorchBackend() if front == "optimizer" else None
    out: dict[str, dict[str, Any]] = {}
    for comm in COMMUNICATORS:
        run = Front(front, _config(comm), backend=backend)
        run.train(0, BEFORE, rank)
        before, steps = run.state(), run.steps()
        g = torch.Generator().manual_seed(999_999 + rank)
        run.step(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g),
                 nan=rank == NAN_RANK)
        after = run.state()
        res = {"steps": (steps, run.steps()), "state_diff": state_diff(before, after),
               "keys": " ".join(k for k, _ in flatten(before["adacomp"]))}
        run.train(BEFORE, AFTER, rank)
        final = run.state()
        run.close()
        clean = Front(front, _config(comm), backend=backend)
        clean.train(0, BEFORE + AFTER, rank)
        res["vs_clean_run"] = state_diff(clean.state(), final)
        clean.close()
        out[comm] = res
    return out


@pytest.fixture(scope="module", params=[(f, d) for d in (False, True) for f in FRONT_ENDS],
                ids=lambda p: f"{p[0]}-{'deferred-check' if p[1] else 'per-gradient-check'}")
def rollback(request: Any) -> tuple[str, list[dict[str, Any]]]:
    """Each front end with the non-finite check as the CPU runs it and as an accelerator runs it
    (``Rounds.defer_on_cpu``: sums kept on the device, read once at the vote)."""
    front, defer = request.param
    return front, run_workers(_rollback_job, 2, front, defer, timeout=600)


@pytest.mark.parametrize("comm", list(COMMUNICATORS))
def test_nonfinite_round_leaves_every_state_and_continues_as_the_clean_run(rollback, comm: str) -> None:
    front, per_rank = rollback
    for rank, results in enumerate(per_rank):
        r = results[comm]
        assert r["steps"][0] == r["steps"][1] == BEFORE, f"{front} {comm} rank {rank}: steps {r['steps']}"
        assert r["state_diff"] == [], f"{front} {comm} rank {rank}: the bad round changed {r['state_diff'][:5]}"
        assert r["vs_clean_run"] == [], f"{front} {comm} rank {rank}: differs from the clean run: " \
                                        f"{r['vs_clean_run'][:5]}"
        assert EXPECT[comm] in r["keys"], f"{front} {comm}: no state containing {EXPECT[comm]!r}: {r['keys'][:300]}"


def _overflow_job(front: str) -> dict[str, Any]:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    from adacomp.backends.torch_dist import TorchBackend
    rank = dist.get_rank()
    backend = TorchBackend() if front == "optimizer" else None
    cfg = _config("acpsgd", nonfinite="propagate")

    def make() -> Front:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=10_000)
        return Front(front, cfg, backend=backend, scaler=scaler)
    run = make()
    run.train(0, BEFORE, rank)
    g = torch.Generator().manual_seed(999_999 + rank)
    run.step(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g), nan=rank == NAN_RANK)
    scale_after_overflow = run.scaler.get_scale()
    run.train(BEFORE, AFTER, rank)
    clean = make()
    clean.train(0, BEFORE + AFTER, rank)
    res = {"steps": (run.steps(), clean.steps()), "scales": (scale_after_overflow, clean.scaler.get_scale()),
           "params": state_diff(clean.state()["params"], run.state()["params"])}
    run.close()
    clean.close()
    return res


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_grad_scaler_overflow_does_not_move_acpsgd_alternation(front: str) -> None:
    for rank, r in enumerate(run_workers(_overflow_job, 2, front, timeout=300)):
        assert r["scales"][0] == 2.0 ** 11 and r["scales"][1] == 2.0 ** 12, r  # the overflow really happened
        assert r["steps"][0] == r["steps"][1] == BEFORE + AFTER, f"{front} rank {rank}: {r['steps']}"
        assert r["params"] == [], f"{front} rank {rank}: the overflowed step changed the result: {r['params']}"


def _subgroup_job() -> dict[str, Any]:
    import torch.distributed as dist
    dist.init_process_group("gloo")  # no adacomp.init() anywhere in this job
    from adacomp.backends.torch_dist import TorchBackend
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    out: dict[str, Any] = {}
    for name, cfg in (("topk", _config("allgather")),
                      ("dgc_clip", _config("dgc", memory={"name": "dgc", "clip_norm": 0.5}))):
        params = {}
        for front in FRONT_ENDS:
            run = Front(front, cfg, backend=TorchBackend(group=mine) if front == "optimizer" else None, group=mine)
            run.train(0, 4, rank)
            params[front] = run.state()["params"]
            run.close()
        a, b = params["hook"], params["optimizer"]
        out[name] = {"max_rel": max(float((a[k] - b[k]).norm() / (b[k].norm() + 1e-30)) for k in a),
                     "params": {k: v for k, v in a.items()}}
    return out


def test_hook_on_a_subgroup_equals_the_optimizer_and_needs_no_init() -> None:
    per_rank = run_workers(_subgroup_job, 4, timeout=600)
    for name in ("topk", "dgc_clip"):
        for rank, r in enumerate(per_rank):
            assert r[name]["max_rel"] <= 1e-6, (name, rank, r[name]["max_rel"])
        p = [r[name]["params"] for r in per_rank]
        same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
        assert same(p[0], p[1]) and same(p[2], p[3]), f"{name}: ranks of one sub-group differ"
        assert not same(p[0], p[2]), f"{name}: the two sub-groups averaged together (different data, same weights)"


def _shared_state_job() -> str:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    import adacomp
    from torch.nn.parallel import DistributedDataParallel as DDP
    state, hook = adacomp.ddp.hook(_config("allgather"))
    models = [DDP(torch.nn.Linear(8, 8)), DDP(torch.nn.Linear(8, 8))]
    for m in models:
        m.register_comm_hook(state, hook)
    try:
        for m in models:
            m(torch.randn(4, 8)).sum().backward()
        return "no error"
    except RuntimeError as exc:
        return str(exc)


def test_one_hook_state_for_two_models_is_refused() -> None:
    for msg in run_workers(_shared_state_job, 2, timeout=120):
        assert "one state per DDP model" in msg, msg
