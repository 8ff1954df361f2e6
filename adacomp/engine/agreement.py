"""Every rank must run the same config and model: one small allgather before the first collective
that depends on them, so a mismatch is a clear :class:`RanksDisagreeError` naming the ranks instead
of a hang or silently different payloads. Shared by both front ends (the optimizer at construction,
the DDP hook at its first call, once the process group exists)."""
from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

from torch import Tensor

from adacomp.backends.base import Backend
from adacomp.config import Config
from adacomp.errors import RanksDisagreeError

_SHAPES_SHOWN = 2000  # names / shapes sent along for the message (a digest decides)


def fingerprint(config: Config, params: Sequence[tuple[str, Tensor]], **extra: Any) -> dict[str, Any]:
    """What a rank sends: its config's hash, a digest of its parameters' names and shapes (and the
    first of them, to name a difference), and ``extra`` entries the caller compares itself."""
    shapes = [(n, list(p.shape)) for n, p in params]
    return {"config": config.hash(),
            "params": hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16],
            "shapes": shapes[:_SHAPES_SHOWN], **extra}


def check(backend: Backend, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Allgather every rank's :func:`fingerprint`; raise on every rank alike where a config or the
    parameters differ from rank 0's. Returns everyone's fingerprints."""
    everyone: list[dict[str, Any]] = backend.allgather_object(mine)
    ref = everyone[0]
    for what in ("config", "params"):
        bad = [r for r, d in enumerate(everyone) if d[what] != ref[what]]
        if not bad:
            continue
        detail = ""
        if what == "params":
            other = everyone[bad[0]]
            diff = [f"{a} vs {b}" for a, b in zip(ref["shapes"], other["shapes"]) if a != b][:3]
            if len(ref["shapes"]) != len(other["shapes"]):
                diff.insert(0, f"{len(ref['shapes'])} vs {len(other['shapes'])} parameters")
            detail = f"; first differences (rank 0 vs rank {bad[0]}): {diff}"
        kind = "configuration" if what == "config" else "model (parameter names/shapes)"
        raise RanksDisagreeError(f"ranks {bad} have a different {kind} than rank 0{detail}. "
                                 "Every rank must run the same config file and model.")
    return everyone


__all__ = ["check", "fingerprint"]
