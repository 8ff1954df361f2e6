"""Horovod's coordinator checks for the module API (``import adacomp as hvd``): ranks that disagree on
a collective raise on every rank instead of aborting the process, and a name already in flight is
refused at once (issue 31).

Horovod's coordinator compares every rank's request (name, dtype, shape, reduction op, scale factors,
root) before it runs an op, and answers a mismatch with ``HorovodInternalError`` (a RuntimeError) on
every rank; the job goes on. gloo and MPI have no such step: a shape mismatch aborts the process
(gloo: SIGABRT), a dtype or root mismatch returns garbage or hangs. So before each raw collective,
:func:`agree` allgathers one int64 per rank, a digest of the request. Equal digests (the normal case)
cost that one small collective; different digests (every rank sees the same gathered digests, so
every rank takes this path) are followed by an allgather of the requests themselves to say which
ranks differ and how, and :class:`MismatchError` is raised on every rank before any data moves.

On the Horovod backend the check is left to Horovod's own coordinator, which compares the same
fields and raises ``HorovodInternalError`` (its message says "one rank" instead of naming the
ranks); adding ours there would double the negotiation. It does not see the user's names (the
backend names ops itself) nor prescale / postscale factors (applied by adacomp around Horovod's sum).

``ADACOMP_MISMATCH_CHECK_DISABLE=1`` (named like Horovod's ``HOROVOD_STALL_CHECK_DISABLE``; set it
on every rank or none) skips the check: mismatches then fail in the transport as before.
"""
from __future__ import annotations

import hashlib
import json
import weakref
from typing import Any, Sequence

import torch
from torch import Tensor

from adacomp.backends.base import Backend
from adacomp.engine.hvd_join import DISABLE_ENV, JOIN_CODES, JOINED, JOINED_NOW, RESERVED_END, enabled, round_id  # noqa: F401
from adacomp.errors import CommunicationError


class HorovodInternalError(CommunicationError):
    """A collective failed in the transport, or the ranks disagreed on it (Horovod's name for it)."""


class MismatchError(HorovodInternalError):
    """Ranks asked for different collectives (shape, dtype, op, root, name): raised on every rank."""


def request(kind: str, tensor: Tensor, name: str | None, *, first_dim_free: bool = False, op: Any = None,
            factors: tuple[float, float] | None = None, root: int | None = None) -> dict[str, Any]:
    """What a rank asks for, in the fields Horovod's coordinator compares. ``first_dim_free``:
    allgather / alltoall, whose first dims may differ per rank (only the rank and trailing dims
    must agree)."""
    shape = list(tensor.shape)
    req: dict[str, Any] = {"op": kind, "name": name, "dtype": str(tensor.dtype).replace("torch.", ""),
                           "shape": ["*", *shape[1:]] if first_dim_free and shape else shape}
    if op is not None:
        req["reduction"] = str(op)
    if factors is not None:
        req["factors"] = [float(f) for f in factors]
    if root is not None:
        req["root"] = root
    return req


# What a rank inside ``join()`` sends instead of a request digest (Horovod's join: it answers the
# other ranks' allreduces with zeros until every rank has joined), and what a DistributedOptimizer
# round announces (adacomp.engine.hvd_join): the lowest int64 values, which no request digest takes.
_JOIN_CODES = JOIN_CODES


def _digest(requests: Sequence[dict[str, Any]]) -> int:
    blob = json.dumps(list(requests), sort_keys=True).encode()
    digest = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little", signed=True)
    return digest + (RESERVED_END - JOINED_NOW) if digest < RESERVED_END else digest


def exchange(backend: Backend, code: int) -> list[int]:
    """The one small allgather of the check: every rank's digest (or join code)."""
    gathered = backend.allgather(torch.tensor([code], dtype=torch.int64), sizes=[1] * backend.size())
    return [int(x) for x in gathered.tolist()]


def active(codes: Sequence[int]) -> list[int]:
    return [r for r, c in enumerate(codes) if c not in _JOIN_CODES]


def agree(backend: Backend, requests: Sequence[dict[str, Any]]) -> None:
    """Raise :class:`MismatchError` on every rank unless every rank made the same ``requests``
    (one small allgather; nothing when the check is disabled or the world is one process).

    Ranks inside ``join()`` send a join code instead: then every rank allgathers the requests, so the
    joined ranks can answer an allreduce with zeros (Horovod's join); any other collective raises
    Horovod's error on the ranks that issued it ("... is not supported with Join")."""
    if backend.size() == 1 or not enabled() or getattr(backend, "name", "") == "horovod":
        return  # under horovodrun Horovod's coordinator compares the same fields before every op
    digest = _digest(requests)
    codes = exchange(backend, digest)
    if all(c == digest for c in codes):
        return
    stepping = [r for r in active(codes) if round_id(codes[r]) is not None]
    if stepping:  # those ranks run an optimizer round and do not take the second step below
        raise MismatchError(f"Mismatched collectives: ranks {stepping} started a DistributedOptimizer round (gradient "
                            f"allreduce) while this rank called {requests[0]['op'] if requests else 'a collective'}. "
                            "Every rank must call the same collectives in the same order")
    # every rank is here: the codes are the same everywhere, so every rank takes this path
    everyone = backend.allgather_object(list(requests))
    live = active(codes)
    if any(codes[r] != digest for r in live):
        raise MismatchError(describe([everyone[r] for r in live], live))
    unsupported = sorted({req["op"] for req in requests if req["op"] != "allreduce"})
    if unsupported:
        raise HorovodInternalError(f"{unsupported[0].capitalize()} is not supported with Join at this time "
                                   f"(ranks {[r for r in range(len(codes)) if r not in live]} called join())")


_FIELDS = (("op", "collectives"), ("name", "names"), ("dtype", "data types"), ("shape", "tensor shapes"),
           ("reduction", "reduction ops"), ("factors", "prescale / postscale factors"), ("root", "root ranks"))


def describe(everyone: list[list[dict[str, Any]]], ranks: Sequence[int] | None = None) -> str:
    """Horovod's wording ("Mismatched ALLREDUCE tensor shapes: ...") naming each rank's value.
    ``ranks``: the rank of each entry of ``everyone`` (default: its position)."""
    ids = list(range(len(everyone))) if ranks is None else list(ranks)
    counts = {len(reqs) for reqs in everyone}
    if len(counts) > 1:
        per = ", ".join(f"rank {ids[r]}: {len(reqs)}" for r, reqs in enumerate(everyone))
        return f"Mismatched number of tensors in a grouped collective ({per}); every rank must pass the same list"
    n = counts.pop()
    for i in range(n):
        reqs = [rank_reqs[i] for rank_reqs in everyone]
        for key, what in _FIELDS:
            values = [r.get(key) for r in reqs]
            if any(v != values[0] for v in values):
                kind = reqs[0]["op"].upper() if key != "op" else ""
                by_value: dict[str, list[int]] = {}
                for rank, v in enumerate(values):
                    by_value.setdefault(json.dumps(v), []).append(ids[rank])
                said = "; ".join(f"ranks {ranks} sent {v}" for v, ranks in by_value.items())
                where = f" (tensor {i} of the group)" if n > 1 else ""
                return (f"Mismatched {kind + ' ' if kind else ''}{what}{where}: {said}. Every rank must call "
                        f"the same collectives in the same order with the same arguments (first dims may "
                        f"differ only in allgather / alltoall)")
    return "Mismatched collective requests across ranks"  # digests differ only on a hash collision of equal requests


# Names of async ops not yet synchronized, per backend (Horovod refuses a second op with a name in flight).
_IN_FLIGHT: "weakref.WeakKeyDictionary[Backend, set[str]]" = weakref.WeakKeyDictionary()


def claim(backend: Backend, name: str | None) -> None:
    """Refuse ``name`` (the op key "<kind>.<name>", as Horovod's GetOpName) while another op of that key
    is in flight (Horovod's ValueError, at once)."""
    if name is None:
        return
    names = _IN_FLIGHT.setdefault(backend, set())
    if name in names:
        kind, _, plain = name.partition(".")
        raise ValueError(f"Requested {kind} on a tensor with the same name ({plain!r}) as another {kind} "
                         "that is still in flight; synchronize() the first handle or use a different name")
    names.add(name)


def release(backend: Backend, name: str | None) -> None:
    if name is not None:
        _IN_FLIGHT.get(backend, set()).discard(name)
