"""Checkpoints that survive a crash mid-write and resume bitwise.

Why per rank: error-feedback residuals, DGC velocities and sampling generators are local to each
rank, so every rank writes its own file (:func:`rank_path`). Why atomic: a job killed while writing
(out of memory, pre-emption, a dead peer's watchdog) must leave the previous checkpoint readable.
The bytes go to a temporary file in the *same* directory (``os.replace`` is atomic only within one
file system), are ``fsync``-ed, renamed over the target, and the directory is ``fsync``-ed so the
rename itself is durable.

Files hold only tensors, numbers, strings, lists and dicts, so they load with
``torch.load(..., weights_only=True)``: opening a checkpoint never runs code from it.

    from adacomp import checkpoint
    path = checkpoint.rank_path("runs/ckpt.pt", adacomp.rank())   # runs/ckpt.rank0.pt
    checkpoint.save(path, model, opt, step=step)                    # every N steps
    ...
    meta = checkpoint.load(path, model, opt)                        # after building model and opt
    start = meta["step"]
"""
from __future__ import annotations

import glob
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1


def rank_path(path: "str | os.PathLike[str]", rank: int) -> Path:
    """``dir/name.pt`` -> ``dir/name.rank{rank}.pt``: one file per rank (residuals are local)."""
    p = Path(path)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.pt'}")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems (or Windows) cannot open a directory: rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_prefix(target: Path) -> str:
    return f".{target.name}."


def atomic_save(obj: Any, path: "str | os.PathLike[str]") -> Path:
    """``torch.save(obj)`` to ``path`` so that readers see the old file or the new one, never half.

    A crash before the rename leaves a hidden ``.<name>.*.tmp`` beside the target; the next
    successful save of the same target removes such leftovers.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=_temp_prefix(target), suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)
    for stale in glob.glob(os.path.join(glob.escape(str(target.parent)), glob.escape(_temp_prefix(target)) + "*.tmp")):
        Path(stale).unlink(missing_ok=True)
    return target


def state(model: torch.nn.Module | None, optimizer: Any, **extra: Any) -> dict[str, Any]:
    """The checkpoint payload: model weights, ``optimizer.state_dict()`` (for a
    :class:`~adacomp.DistributedOptimizer`: the wrapped optimizer plus every compressor, memory,
    communicator and policy state) and the caller's ``extra`` values (step, epoch, ...)."""
    return {"format": FORMAT_VERSION,
            "model": model.state_dict() if model is not None else None,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "extra": dict(extra)}


def save(path: "str | os.PathLike[str]", model: torch.nn.Module | None, optimizer: Any, **extra: Any) -> Path:
    """Atomically write model + optimizer state (+ ``extra``) to ``path``; call between steps."""
    return atomic_save(state(model, optimizer, **extra), path)


def read(path: "str | os.PathLike[str]") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` with ``weights_only=True`` and check its format."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {str(p)!r} does not exist; expected a file written by "
                                "adacomp.checkpoint.save (one per rank: see rank_path)")
    data = torch.load(p, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{str(p)!r} is not an adacomp checkpoint of format {FORMAT_VERSION} (got {got!r}); "
                         "write it with adacomp.checkpoint.save")
    return data


def load(path: "str | os.PathLike[str]", model: torch.nn.Module | None, optimizer: Any) -> dict[str, Any]:
    """Restore ``model`` and ``optimizer`` in place from ``path``; returns the ``extra`` values.

    Build the model and the optimizer with the same config first: the optimizer refuses state for
    components it does not have, naming them."""
    data = read(path)
    if model is not None:
        model.load_state_dict(data["model"])
    if optimizer is not None:
        optimizer.load_state_dict(data["optimizer"])
    return dict(data["extra"])


__all__ = ["FORMAT_VERSION", "atomic_save", "load", "rank_path", "read", "save", "state"]
