"""Bucket planning for tensor fusion: which gradients travel together, and in which order.

Gradients become ready roughly in reverse registration order during backward, so buckets are
filled walking the parameters backwards, one open bucket per *route* (compressor + memory +
communicator), and closed when their byte count reaches the cap. Buckets are then numbered by the
position of their last-arriving parameter, which is the order the optimizer launches them in: a
bucket that fills early is never stuck behind a small bucket that only completes at the end of
backward (e.g. all the biases on the dense route).

Items are counted in the bytes they will send (compressed payload). With ``compressed_buffer``
(ACP-SGD §IV-B) a route's cap is ``bucket_mb`` scaled by that route's compression rate, so a bucket
of rank-4 factors spans as many layers as a dense 25 MB bucket would and communication still
overlaps backward; without it, 25 MB of factors would swallow the whole model into one bucket.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """One parameter as the planner sees it."""

    name: str
    route: str          # key of (compressor, memory, communicator) specs; buckets never mix routes
    nbytes: int         # bytes counted against the cap (dense or compressed)
    kind: str = ""      # dtype and device: buckets never mix them either (as DDP's), one flat buffer each


def plan(items: list[Item], cap_bytes: float | dict[str, float]) -> list[list[str]]:
    """Group ``items`` (in registration order) into buckets, returned in launch order.

    ``cap_bytes`` is one cap or a cap per route; a cap ``<= 0`` puts every parameter in its own bucket.
    """
    caps = cap_bytes if isinstance(cap_bytes, dict) else {it.route: cap_bytes for it in items}
    if all(c <= 0 for c in caps.values()):
        return [[it.name] for it in reversed(items)]
    closed: list[tuple[int, list[str]]] = []  # (position of last item, names)
    open_: dict[tuple[str, str], tuple[list[str], int]] = {}
    for pos, it in enumerate(reversed(items)):
        key = (it.route, it.kind)
        names, size = open_.get(key, ([], 0))
        names.append(it.name)
        size += it.nbytes
        if size >= caps[it.route]:
            closed.append((pos, names))
            open_.pop(key, None)
        else:
            open_[key] = (names, size)
    last_pos = {name: pos for pos, name in enumerate(it.name for it in reversed(items))}
    for names, _ in open_.values():
        closed.append((last_pos[names[-1]], names))
    closed.sort(key=lambda t: t[0])
    return [names for _, names in closed]
