"""Checkpoint sets: every rank loads the same step of the same set or every rank fails, naming
files, ranks and steps; damaged files are refused with the path and the cause; a set resumes on
another world size (4 -> 2 -> 1 -> 2) keeping what the averaged update still owes. Real gloo
processes throughout (tests/_dist.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_workers
from tests.test_checkpoint_resume import _tiny, train_steps

TOPK = {"compressor": {"name": "topk", "density": 0.05}, "memory": {"name": "residual"},
        "communicator": {"name": "allgather"}, "min_numel": 512}
DGC = {"compressor": {"name": "dgc", "density": 0.05, "sample_ratio": 0.1}, "memory": {"name": "dgc", "momentum": 0.9},
       "communicator": {"name": "allgather"}, "min_numel": 512}
ALLTOALL = {**TOPK, "communicator": {"name": "alltoall"}}  # its second-stage error is a declared memory
CONFIGS = {"topk": TOPK, "dgc": DGC, "alltoall": ALLTOALL}


def _build(cfg: dict[str, Any]):
    import adacomp
    from adacomp.models import DigitsCNN
    torch.manual_seed(0)
    model = DigitsCNN()
    momentum = 0.0 if cfg["memory"]["name"] == "dgc" else 0.9
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum),
                                       model.named_parameters(), config=cfg)
    adacomp.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def _error(fn, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test inspects type and text
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# --- sets of 2 ranks ---------------------------------------------------------------------------
def _mixed_steps_job(directory: str) -> dict[str, str]:
    """The per-rank save-on-signal habit: rank 0's file is of step 10, rank 1's of step 20."""
    import adacomp
    from adacomp.runtime import checkpoint
    adacomp.init()
    rank = adacomp.rank()
    model, opt = _build(TOPK)
    train_steps(model, opt, 0, 2, rank)
    path = checkpoint.rank_path(Path(directory) / "mixed.pt", rank)
    checkpoint.save(path, model, opt, step=10 if rank == 0 else 20)
    out = {"mixed": _error(checkpoint.load, path, model, opt)}
    # the DDP habit: every rank loads rank 0's file
    opt.backend.barrier()
    out["rank0_file"] = _error(checkpoint.load, checkpoint.rank_path(Path(directory) / "mixed.pt", 0), model, opt)
    # a proper set, then one flipped bit in rank 1's file
    sdir = checkpoint.save_set(Path(directory) / "set", model, opt, step=30)
    opt.backend.barrier()
    if rank == 0:
        p = sdir / "rank1.pt"
        raw = bytearray(p.read_bytes())
        raw[-100] ^= 0x04
        p.write_bytes(bytes(raw))
    opt.backend.barrier()
    out["flipped"] = _error(checkpoint.load_set, Path(directory) / "set", model, opt)
    out["rank1_file"] = str(sdir / "rank1.pt")
    adacomp.shutdown()
    return out


def test_mixed_steps_other_ranks_files_and_flipped_bits_are_refused_on_every_rank(tmp_path) -> None:
    per_rank = run_workers(_mixed_steps_job, 2, str(tmp_path), timeout=240)
    for r in per_rank:
        msg = r["mixed"]
        assert msg.startswith("CheckpointError") and "different steps" in msg, msg
        assert "rank 0:" in msg and "step 10" in msg and "rank 1:" in msg and "step 20" in msg, msg
        assert "mixed.rank0.pt" in msg and "mixed.rank1.pt" in msg, msg
        assert "CheckpointError" in r["rank0_file"] and "rank 1: " in r["rank0_file"], r["rank0_file"]
        assert "is rank 0's file but rank 1 loads it" in r["rank0_file"], r["rank0_file"]
        assert "CheckpointError" in r["flipped"] and "rank 1:" in r["flipped"], r["flipped"]
        assert r["rank1_file"] in r["flipped"] and "corrupted" in r["flipped"], r["flipped"]


# --- damaged single files ----------------------------------------------------------------------
def test_damaged_files_are_refused_naming_the_path_and_the_cause(tmp_path) -> None:
    from adacomp.runtime import checkpoint
    model, opt = _tiny()
    good = checkpoint.save(tmp_path / "good.pt", model, opt, step=3)
    raw = good.read_bytes()
    cases = {"empty.pt": (b"", "is empty"), "truncated.pt": (raw[: len(raw) - 40], "truncated"),
             "junk.pt": (b"\x00garbage" * 50, "is not an adacomp checkpoint"),
             "cut_header.pt": (raw[:30], "damaged header"),
             "flipped.pt": (raw[:-10] + bytes([raw[-10] ^ 1]) + raw[-9:], "corrupted")}
    for name, (data, cause) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(checkpoint.CheckpointError) as info:
            checkpoint.read(tmp_path / name)
        assert str(tmp_path / name) in str(info.value) and cause in str(info.value), str(info.value)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")  # the wrong kind of file
    with pytest.raises(checkpoint.CheckpointError, match="plain torch.save file"):
        checkpoint.read(tmp_path / "plain.pt")
    assert checkpoint.read(good)["header"]["step"] == 3


def test_a_set_is_published_only_when_complete_and_old_sets_are_pruned(tmp_path) -> None:
    from adacomp.runtime import checkpoint
    model, opt = _tiny()
    assert checkpoint.load_set(tmp_path, model, opt) is None  # nothing yet: start from scratch
    for step in (1, 2, 3):
        checkpoint.save_set(tmp_path, model, opt, step=step, keep=2, epoch=step * 10)
    assert sorted(p.name.split("-")[1] for p in tmp_path.glob("step-*")) == ["0000000002", "0000000003"]
    extra = checkpoint.load_set(tmp_path, model, opt)
    assert extra == {"step": 3, "epoch": 30}
    checkpoint.latest(tmp_path).joinpath("manifest.json").unlink()  # a set whose manifest is gone
    with pytest.raises(checkpoint.CheckpointError, match="latest"):
        checkpoint.load_set(tmp_path, model, opt)


def test_failed_saves_leave_the_previous_set_and_no_partial_one(tmp_path, monkeypatch) -> None:
    """An extra value load_set could not read back is refused before anything is written; a save into
    a path that is a file names the write error; a disk that fills when ``latest`` is flipped leaves no
    manifest-only set behind (the next pruning would count it and drop the last good fallback)."""
    import numpy as np
    from adacomp.runtime import checkpoint
    model, opt = _tiny()
    checkpoint.save_set(tmp_path, model, opt, step=1)
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"extra value loss=float64 would not load back"):
        checkpoint.save_set(tmp_path, model, opt, step=2, loss=np.float64(0.5))
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("x")
    with pytest.raises(checkpoint.CheckpointWriteError, match="Not a directory"):
        checkpoint.save_set(a_file, model, opt, step=2)
    real = checkpoint.atomic_write

    def full_at_latest(data: bytes, path: Any) -> Path:
        if Path(path).name == checkpoint.LATEST:
            raise checkpoint.CheckpointWriteError(28, f"could not write checkpoint {str(path)!r}: No space left")
        return real(data, path)
    monkeypatch.setattr(checkpoint, "atomic_write", full_at_latest)
    with pytest.raises(checkpoint.CheckpointWriteError, match="No space left"):
        checkpoint.save_set(tmp_path, model, opt, step=3)
    monkeypatch.setattr(checkpoint, "atomic_write", real)
    assert [p.name.split("-")[1] for p in sorted(tmp_path.glob("step-*"))] == ["0000000001"]
    checkpoint.save_set(tmp_path, model, opt, step=4, keep=2)
    assert [p.name.split("-")[1] for p in sorted(tmp_path.glob("step-*"))] == ["0000000001", "0000000004"]
    assert checkpoint.load_set(tmp_path, model, opt) == {"step": 4}


def test_per_rank_files_are_verified(tmp_path) -> None:
    """save_per_rank writes the checkpoint format: a flipped bit or a cut file is named at load."""
    from adacomp.runtime import checkpoint
    model, opt = _tiny()
    path = checkpoint.save_per_rank(tmp_path / "adacomp.pt", opt)
    raw = path.read_bytes()
    checkpoint.load_per_rank(path, opt)
    for name, data, cause in (("flipped.pt", raw[:-10] + bytes([raw[-10] ^ 1]) + raw[-9:], "corrupted"),
                              ("cut.pt", raw[: len(raw) // 2], "truncated")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(checkpoint.CheckpointError, match=cause) as info:
            checkpoint.load_per_rank(tmp_path / name, opt)
        assert str(tmp_path / name) in str(info.value)


# --- another world size ------------------------------------------------------------------------
def _world_job(plan: list[tuple[str | None, str | None, int]]) -> list[dict[str, dict[str, Any]]]:
    """For each ``(src, dst, steps)`` and method: build a fresh model and optimizer, load
    ``src/<method>`` (any world size) if given, train ``steps``, save a set of this world size in
    ``dst/<method>`` if given; returns the optimizer state right after loading and at the end."""
    import copy

    import adacomp
    from adacomp.runtime import checkpoint
    adacomp.init()
    rank = adacomp.rank()
    results = []
    for src, dst, steps in plan:
        out: dict[str, dict[str, Any]] = {}
        for method, cfg in CONFIGS.items():
            model, opt = _build(cfg)
            loaded, step = None, 0
            if src is not None:
                extra = checkpoint.load_set(Path(src) / method, model, opt)
                step = int(extra["step"])
                loaded = copy.deepcopy(opt.state_dict())  # torch's state_dict shares live buffers
            train_steps(model, opt, step, steps, 100 + rank)
            if dst is not None:
                checkpoint.save_set(Path(dst) / method, model, opt, step=step + steps)
            out[method] = {"loaded": loaded, "saved": copy.deepcopy(opt.state_dict()), "step": step}
            opt.remove_hooks()
        results.append(out)
    adacomp.shutdown()
    return results


def _owner(method: str) -> Any:
    """An optimizer of ``method``'s config: its components know their resharding rules."""
    import adacomp
    adacomp.init()
    try:
        return _build(CONFIGS[method])[1]
    finally:
        adacomp.shutdown()


def _assert_owed_equal(before: list[dict[str, Any]], after: list[dict[str, Any]], what: str, owner: Any) -> None:
    from adacomp.runtime.checkpoint import owed
    a, b = owed(before, owner), owed(after, owner)
    assert a and set(a) == set(b), (what, sorted(a), sorted(b))
    nonzero = False
    for k in a:
        nonzero |= bool(a[k].abs().sum() > 0)
        torch.testing.assert_close(b[k].to(torch.float64), a[k].to(torch.float64), rtol=1e-6, atol=1e-7,
                                   msg=lambda m, k=k: f"{what}: {k}: {m}")
    assert nonzero, f"{what}: every residual is zero; the test would prove nothing"


def _wrapped(state: dict[str, Any]) -> dict[str, Any]:
    """The wrapped optimizer's part of a DistributedOptimizer state (all but "adacomp")."""
    return {k: v for k, v in state.items() if k != "adacomp"}


def test_resume_on_another_world_size_keeps_what_the_averaged_update_owes(tmp_path) -> None:
    """4 -> 2, 1 -> 2 (two gloo processes), 2 -> 1 (this process, the local backend)."""
    from tests.test_checkpoint_resume import state_diff
    four, two, one = (str(tmp_path / n) for n in ("w4", "w2", "w1"))
    w1 = _world_job([(None, one, 2)])                                              # this process
    w4 = [r[0] for r in run_workers(_world_job, 4, [(None, four, 3)], timeout=300)]
    w2 = run_workers(_world_job, 2, [(four, two, 2), (one, None, 0)], timeout=300)  # 4 -> 2, 1 -> 2
    back = _world_job([(two, None, 0)])                                            # 2 -> 1
    chains = ((w4, [r[0] for r in w2], "4 -> 2"), ([w1[0]], [r[1] for r in w2], "1 -> 2"),
              ([r[0] for r in w2], [back[0]], "2 -> 1"))
    from adacomp.runtime.checkpoint import owed
    for m in CONFIGS:
        owner = _owner(m)
        if m == "alltoall":  # parts of the averaged tensor: every rank holds a different one
            assert any("communicator/" in k for k in owed([r[m]["saved"] for r in w4], owner))
        for old, new, what in chains:
            _assert_owed_equal([r[m]["saved"] for r in old], [r[m]["loaded"] for r in new], f"{m} {what}", owner)
            # every new rank starts from the same state (but its own part of the averaged tensor),
            # and the wrapped optimizer's is carried over
            for r in new:
                if m != "alltoall":  # the owner record names each rank, as it must
                    assert [k for k in state_diff(r[m]["loaded"], new[0][m]["loaded"])
                            if k != "/adacomp/owner/rank"] == [], (m, what)
                assert state_diff(_wrapped(r[m]["loaded"]), _wrapped(old[0][m]["saved"])) == [], (m, what)
        assert [r[0][m]["step"] for r in w2] == [3, 3] and [r[1][m]["step"] for r in w2] == [2, 2]
        assert back[0][m]["step"] == 5


LOCAL = {"local_steps": {"every": 4, "outer_optimizer": {"name": "sgd", "lr": 1.0, "momentum": 0.0}},
         "compressor": {"name": "none"}, "memory": {"name": "none"}, "communicator": {"name": "allreduce"}}


def _local_save_job(directory: str) -> dict[str, torch.Tensor]:
    """Local steps, saved inside a window (synchronised at step 4, steps 5-6 local: replicas differ)."""
    import adacomp
    from adacomp.runtime import checkpoint
    adacomp.init()
    model, opt = _build(LOCAL)
    train_steps(model, opt, 0, 6, adacomp.rank())
    checkpoint.save_set(directory, model, opt, step=6)
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    adacomp.shutdown()
    return out


def _local_load_job(directory: str) -> dict[str, torch.Tensor]:
    import adacomp
    from adacomp.runtime import checkpoint
    adacomp.init()
    model, opt = _build(LOCAL)
    checkpoint.load_set(directory, model, opt)
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    adacomp.shutdown()
    return out


def test_resume_inside_a_local_steps_window_on_fewer_ranks_keeps_every_replica(tmp_path) -> None:
    """2 -> 1 inside a window: the new rank starts from the replicas' mean (what the pending
    synchronisation averages), not from old rank 0's weights alone."""
    old = run_workers(_local_save_job, 2, str(tmp_path), timeout=300)
    assert any(not torch.equal(old[0][n], old[1][n]) for n in old[0])  # the replicas differ
    (new,) = run_workers(_local_load_job, 1, str(tmp_path), timeout=300)
    for n in new:
        want = ((old[0][n].double() + old[1][n].double()) / 2).float()
        assert torch.equal(new[n], want), n


def test_reshard_asks_each_component_for_its_rule() -> None:
    """Route memory residuals averaged, the alltoall's declared memory re-cut, compressor state and
    the wrapped optimizer's from old rank s % W, a route the optimizer does not have now built
    from its saved spec: every rule is the component's own method, no key path is matched."""
    from adacomp.runtime.checkpoint import reshard
    owner = _owner("alltoall")
    live = owner.io.components()
    mem = next(k for k in live if k.startswith("memory/") and "alltoall" in k)
    comm = mem.replace("memory/", "communicator/", 1)
    other = next(k for k in live if k.startswith("memory/") and k != mem).replace('"allreduce"', '"alltoall"')
    old = [{"state": {"r": r}, "adacomp": {"steps": 5, "components": {
        mem: {"residuals": {"w": torch.full((3,), float(r + 1))}},
        comm: {"residuals": {"w": torch.arange(3.0) + 3 * r}},
        other.replace("memory/", "communicator/", 1): {"residuals": {"v": torch.arange(2.0) + 2 * r}},
        "compressor/fc1.weight": {"seen": r}}}} for r in range(2)]
    one = reshard(old, 1, 0, owner)["adacomp"]["components"]
    assert torch.equal(one[mem]["residuals"]["w"], torch.full((3,), 1.5))
    assert torch.equal(one[comm]["residuals"]["w"], torch.arange(6.0))
    assert torch.equal(one[other.replace("memory/", "communicator/", 1)]["residuals"]["v"], torch.arange(4.0))
    three = [reshard(old, 3, s, owner) for s in range(3)]
    assert [t["state"]["r"] for t in three] == [0, 1, 0]
    assert [t["adacomp"]["components"]["compressor/fc1.weight"]["seen"] for t in three] == [0, 1, 0]
    parts = [t["adacomp"]["components"][comm]["residuals"]["w"] for t in three]
    assert torch.equal(torch.cat(parts), torch.arange(6.0)) and [p.numel() for p in parts] == [2, 2, 2]
    with pytest.raises(ValueError, match="DistributedOptimizer"):
        reshard(old, 1, 0, torch.optim.SGD([torch.zeros(1)], lr=0.1))
