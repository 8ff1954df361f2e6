"""Per-rank compression state cannot be silently mixed up (issue 30), through both front ends.

* The DDP habit "rank 0 saves ``state_dict()``, every rank loads that file": rank 0 resumes, every
  other rank is refused with a :class:`adacomp.RankStateError` that names both ranks and says what to
  call, before anything is applied (its state stays bitwise as it was).
* ``save_per_rank`` / ``load_per_rank`` (one file, from any trainer) give each rank its own state back.
* :class:`adacomp.checkpoint.PerRank` in that same one file (its ``state_dict()`` gathers every rank's
  state; each rank loads its own) resumes bitwise equal to the uninterrupted run on every rank.
* A state from another world size is refused with the world-size message (PerRank and checkpoint sets
  reshard instead).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_workers
from tests.test_checkpoint_resume import flatten, state_diff
from tests.test_one_round import FRONT_ENDS, Front, _config

BEFORE, AFTER = 3, 3


def _holder(run: Front) -> Any:
    return run.hook if run.hook is not None else run.opt


def _job(front: str, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    import adacomp
    from adacomp.backends.torch_dist import TorchBackend
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    backend = TorchBackend() if front == "optimizer" else None
    cfg = _config("allgather")
    out: dict[str, Any] = {}

    full = Front(front, cfg, backend=backend)
    full.train(0, BEFORE + AFTER, rank)
    final = full.state()
    full.close()

    run = Front(front, cfg, backend=backend)
    run.train(0, BEFORE, rank)
    holder = _holder(run)
    # the DDP habit: rank 0 saves, every rank loads
    habit = Path(tmp) / "habit.pt"
    sd = holder.state_dict()
    if rank == 0:
        torch.save(sd, habit)
    dist.barrier()
    before = run.state()
    try:
        holder.load_state_dict(torch.load(habit, weights_only=False))
        out["habit"] = "loaded"
    except adacomp.RankStateError as exc:
        out["habit"] = str(exc)
    out["habit_changed"] = state_diff(before, run.state())
    # a state from another world size
    other = torch.load(habit, weights_only=False)
    (other["adacomp"] if front == "optimizer" else other)["owner"] = {"rank": 0, "world": 4}
    try:
        holder.load_state_dict(other)
        out["world"] = "loaded"
    except adacomp.RankStateError as exc:
        out["world"] = str(exc)
    # PerRank in the one file rank 0 writes
    sidecar = adacomp.checkpoint.save_per_rank(Path(tmp) / "sidecar.pt", holder)  # collective, one file
    mine = holder.adacomp_state_dict()
    per = adacomp.checkpoint.PerRank(holder).state_dict()  # collective
    torch_opt = (run.opt if run.hook is not None else run.opt).state_dict()
    one_file = Path(tmp) / "per_rank.pt"
    if rank == 0:
        torch.save({"per_rank": per, "opt": torch_opt, "model": run.base.state_dict()}, one_file)
    dist.barrier()
    run.close()
    saved = torch.load(one_file, weights_only=False)
    resumed = Front(front, cfg, backend=backend)
    resumed.base.load_state_dict(saved["model"])
    wrapper = adacomp.checkpoint.PerRank(_holder(resumed))
    resumed.opt.load_state_dict(saved["opt"])
    wrapper.load_state_dict(saved["per_rank"])
    other = Front(front, cfg, backend=backend)  # the sidecar file, from any trainer
    adacomp.checkpoint.load_per_rank(sidecar, _holder(other))
    out["sidecar_diff"] = state_diff(mine, _holder(other).adacomp_state_dict())
    other.close()
    resumed.train(BEFORE, AFTER, rank)
    after = resumed.state()
    resumed.close()
    out["resume_diff"] = state_diff(final, after)  # parameters, inner optimizer and compression state
    out["residual_keys"] = sum("residuals" in k for k, _ in flatten(final["adacomp"]))
    dist.barrier()
    return out


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_rank0_saves_every_rank_loads_is_refused_and_per_rank_resumes(front: str, tmp_path: Path) -> None:
    r0, r1 = run_workers(_job, 2, front, str(tmp_path), timeout=600)
    assert r0["habit"] == "loaded" and r0["habit_changed"] == []
    assert "rank 1 of 2 is loading the compression state of rank 0" in r1["habit"], r1["habit"]
    assert "PerRank" in r1["habit"] and "save_set" in r1["habit"], r1["habit"]
    assert r1["habit_changed"] == [], "a refused load must not change anything"
    for r in (r0, r1):
        assert "world size changed" in r["world"] and "4-rank job" in r["world"], r["world"]
        assert r["resume_diff"] == [], r["resume_diff"]
        assert r["sidecar_diff"] == [], r["sidecar_diff"]
        assert r["residual_keys"] > 0


def _load_on_two(path: str) -> str:
    import torch.distributed as dist

    import adacomp
    from adacomp.backends.torch_dist import TorchBackend
    from adacomp.models import DigitsCNN
    dist.init_process_group("gloo")
    model = DigitsCNN()
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       config=_config("allgather"), backend=TorchBackend())
    try:
        adacomp.checkpoint.load(adacomp.checkpoint.rank_path(path, dist.get_rank()), model, opt)
        return "loaded"
    except adacomp.checkpoint.CheckpointError as exc:
        return str(exc)
    finally:
        opt.remove_hooks()


def test_one_rank_checkpoint_on_two_ranks_says_the_world_size_changed(tmp_path: Path) -> None:
    import adacomp
    from adacomp.backends.base import LocalBackend
    from adacomp.models import DigitsCNN
    model = DigitsCNN()
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       config=_config("allgather"), backend=LocalBackend())
    path = tmp_path / "ckpt.pt"
    adacomp.checkpoint.save(adacomp.checkpoint.rank_path(path, 0), model, opt, step=1, rank=0, world_size=1)
    opt.remove_hooks()
    for msg in run_workers(_load_on_two, 2, str(path), timeout=300):
        assert "written by a 1-rank job" in msg and "has 2 ranks" in msg and "load_set" in msg, msg
