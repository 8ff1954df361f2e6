"""Horovod's ``join()`` serving ``DistributedOptimizer``'s gradient rounds (issue 31).

Horovod's coordinator negotiates every op, so a rank inside ``hvd.join()`` learns of each allreduce
the other ranks start (the module's and the optimizer's alike) and answers it with zeros. adacomp's
transports match collectives by order, so a joined rank must know *which* collectives come next.
The module API learns it from its cross-rank check (one int64 allgather per op,
:mod:`adacomp.runtime.hvd_check`); the optimizer's rounds announce themselves the same way: when
a round's communication begins, every rank allgathers one int64 (asynchronously, waited for when
the round completes), its *round code*, which names the optimizer (its construction index, the
same on every rank). A rank in ``hvd.join()`` receives that code instead of a module request and
runs a shadow round of that optimizer (zeros in every bucket, residuals untouched, the same
collectives), so the active ranks' average still divides by the world size, as Horovod's does.

The codes share one int64 space with the module check's request digests: join codes and round
codes occupy the lowest values, which a digest never takes (see ``hvd_check._digest``).
"""
from __future__ import annotations

import itertools
import os
import weakref
from typing import Any

import torch

from adacomp.backends.base import Backend, Handle

DISABLE_ENV = "ADACOMP_MISMATCH_CHECK_DISABLE"

JOINED_NOW = -(2 ** 63)      # a rank's first exchange inside join() (so the last rank to join is known)
JOINED = -(2 ** 63) + 1      # a later exchange of a joined rank
ROUND_BASE = -(2 ** 63) + 2  # ROUND_BASE + k: optimizer k begins a round
ROUND_IDS = 2 ** 20
RESERVED_END = ROUND_BASE + ROUND_IDS  # codes below this are never request digests
JOIN_CODES = (JOINED_NOW, JOINED)


def enabled() -> bool:
    """The cross-rank check (and with it join's answers) is on unless ``ADACOMP_MISMATCH_CHECK_DISABLE``."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


def round_code(k: int) -> int:
    return ROUND_BASE + k % ROUND_IDS


def round_id(code: int) -> int | None:
    """The optimizer a round code names, None for any other code."""
    return code - ROUND_BASE if ROUND_BASE <= code < RESERVED_END else None


_OPTIMIZERS: "dict[int, weakref.ref[Any]]" = {}
_IDS = itertools.count()


def register(optimizer: Any) -> int:
    """A construction index for ``optimizer`` (the same on every rank running the same script)."""
    k = next(_IDS) % ROUND_IDS
    _OPTIMIZERS[k] = weakref.ref(optimizer)
    return k


def lookup(k: int) -> Any:
    ref = _OPTIMIZERS.get(k)
    opt = ref() if ref is not None else None
    if opt is None:
        raise RuntimeError(f"join: the other ranks stepped DistributedOptimizer #{k}, which this rank no longer "
                           "has; every rank must keep the same optimizers alive")
    return opt


def announce(backend: Backend, code: int) -> Handle:
    """A round's announcement: one int64 per rank, allgathered (the module check's first step)."""
    return backend.allgather_async(torch.tensor([code], dtype=torch.int64), sizes=[1] * backend.size())


__all__ = ["DISABLE_ENV", "JOINED", "JOINED_NOW", "JOIN_CODES", "RESERVED_END", "ROUND_BASE", "announce",
           "enabled", "lookup", "register", "round_code", "round_id"]
