"""Every rank's compression state inside one framework checkpoint.

Error-feedback residuals, DGC velocities, PowerSGD factors and sampling generators differ per rank,
but Lightning's checkpoints, Accelerate's ``save_state`` and the plain DDP habit ("rank 0 saves")
write one file from rank 0. :class:`PerRank` is the piece such a file can hold: its
``state_dict()`` is *collective* (every rank's state, gathered in rank order) and its
``load_state_dict()`` gives each rank its own entry back, or, when the world size changed, the
state the world-size rule builds from every old rank's (:meth:`ComponentState.reshard`).

    per_rank = adacomp.checkpoint.PerRank(opt_or_hook_state)
    accelerator.register_for_checkpointing(per_rank)     # Accelerate calls state_dict() on every rank
    adacomp.checkpoint.save_per_rank("ckpt/adacomp.pt", opt)   # any trainer: one file, every rank's state
    adacomp.checkpoint.load_per_rank("ckpt/adacomp.pt", opt)

Once wrapped, the holder's own ``state_dict()`` leaves its compression state out (a marker says
where it went), so a framework that loads rank 0's optimizer file on every rank loads only the
torch optimizer part from it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from adacomp.backends import watchdog
from adacomp.errors import RankStateError

FORMAT = "adacomp.PerRank/1"


class PerRank:
    """Collective ``state_dict`` / ``load_state_dict`` over every rank's compression state of
    ``holder`` (an :class:`adacomp.DistributedOptimizer` or a DDP hook state)."""

    def __init__(self, holder: Any):
        for attr in ("adacomp_state_dict", "load_adacomp_state_dict", "io", "backend"):
            if not hasattr(holder, attr):
                raise TypeError(f"PerRank wraps an adacomp.DistributedOptimizer or the state of adacomp.ddp.hook; "
                                f"got {type(holder).__name__} (no {attr!r})")
        self.holder = holder
        holder.io.delegated = True  # the holder's own state_dict now leaves the compression state to us

    def state_dict(self) -> dict[str, Any]:
        """Collective: call it on every rank (frameworks do). A rank whose peers do not come (Accelerate's
        ``save_state`` under ``if accelerator.is_main_process:``) raises after the job's ``timeout_s``
        instead of waiting in the gather while they wait elsewhere."""
        be = self.holder.backend
        _all_arrive(self.holder, be)
        with watchdog.guard(be):  # a rank that died or stopped is named
            ranks = be.allgather_object(self.holder.adacomp_state_dict())
        return {"format": FORMAT, "world": be.size(), "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Not collective: each rank takes its own entry (or its resharded state)."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise RankStateError(f"expected a state written by adacomp.checkpoint.PerRank ({FORMAT}); got "
                                 f"{type(state).__name__} with keys {sorted(state)[:5] if isinstance(state, dict) else []}")
        be = self.holder.backend
        rank, world = be.rank(), be.size()
        ranks = state["ranks"]
        mine = ranks[rank] if len(ranks) == world else self.holder.io.reshard(ranks, world, rank)
        self.holder.load_adacomp_state_dict(mine)


_ARRIVALS = 0  # PerRank gathers this process took part in: their keys in torch's store


def _all_arrive(holder: Any, be: Any) -> None:
    """Every rank of ``be`` reaches this call, within the job's ``timeout_s``, counted in torch's
    rendezvous store (where torch.distributed runs; elsewhere nothing is checked): the gather itself
    would wait for the process group's timeout (30 minutes by default) when a peer waits in another
    collective, alive, so no watchdog sees it."""
    if be.size() < 2 or getattr(be, "name", "") != "torch":
        return
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        store = _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return
    global _ARRIVALS
    _ARRIVALS += 1  # the same count on every rank (the calls are collective), unique within the store
    key = f"adacomp/per_rank/{be.size()}/{_ARRIVALS}"
    came = store.add(key, 1)
    timeout_s = float(getattr(getattr(holder, "config", None), "timeout_s", 60.0) or 60.0)
    deadline = time.monotonic() + timeout_s
    while came < be.size():
        if time.monotonic() > deadline:
            raise RuntimeError(f"adacomp.checkpoint.PerRank.state_dict() is collective, and {be.size() - came} of "
                               f"{be.size()} ranks did not reach it within {timeout_s:g} s (timeout_s). Where adacomp's "
                               "state is registered with a framework, save on every process: e.g. call "
                               "accelerator.save_state(...) on all ranks (it writes from the main process itself), "
                               "not under `if accelerator.is_main_process:`")
        time.sleep(0.01)
        came = store.add(key, 0)


def save_per_rank(path: str | os.PathLike[str], holder: Any) -> Path:
    """Collective: gather every rank's compression state and write it atomically to one file from
    rank 0 in the checkpoint format (a header with the payload's SHA-256, so a flipped bit or a
    truncation is named at load); every rank returns after the write, and a write that failed on
    rank 0 raises on every rank."""
    from adacomp.runtime.checkpoint import atomic_write, encode
    state = PerRank(holder).state_dict()
    be = holder.backend
    error = None
    if be.rank() == 0:
        try:
            atomic_write(encode({"model": None, "optimizer": None, "extra": state}, {"kind": FORMAT}), path)
        except OSError as exc:
            error = f"rank 0 could not write {str(path)!r}: {exc}"
    with watchdog.guard(be):
        error = be.broadcast_object(error, root=0)
    if error:
        raise OSError(error)
    return Path(path)


def load_per_rank(path: str | os.PathLike[str], holder: Any) -> None:
    """Every rank reads the file :func:`save_per_rank` wrote and takes its own state (resharded when
    the world size changed). The file is verified (checksum, length) as a checkpoint is; one written
    by an older adacomp (a plain ``torch.save``) still loads."""
    from adacomp.runtime.checkpoint import MAGIC, CheckpointError, read
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no per-rank compression state at {str(p)!r} (written by "
                                "adacomp.checkpoint.save_per_rank)")
    with open(p, "rb") as fh:
        verified = fh.read(len(MAGIC)) == MAGIC
    if verified:
        state = read(p)["extra"]
    else:
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling error means the same thing here
            raise CheckpointError(f"per-rank compression state {str(p)!r} cannot be read ({type(exc).__name__}: "
                                  f"{exc}); the file is truncated or corrupted") from None
    PerRank(holder).load_state_dict(state)


__all__ = ["PerRank", "load_per_rank", "save_per_rank"]
