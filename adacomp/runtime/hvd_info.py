"""Horovod's identity and capability queries for the module API (``import adacomp as hvd``):
``init`` / ``shutdown``, ``rank`` / ``size`` / ``local_*`` / ``cross_*``, and the ``*_built`` /
``*_enabled`` answers for adacomp's transports. Re-exported by :mod:`adacomp.runtime.hvd_api`."""
from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from adacomp.runtime import context


# ------------------------------------------------------------------------------------------------
# Lifecycle and identity
# ------------------------------------------------------------------------------------------------
init = context.init
shutdown = context.shutdown
is_initialized = context.is_initialized


def size() -> int:
    return context.current().size()


def rank() -> int:
    return context.current().rank()


def local_rank() -> int:
    return context.current().local_rank()


def local_size() -> int:
    """Processes on this host (learnt at ``init()``)."""
    return context.topology().local_size


def cross_rank() -> int:
    """This host's position among hosts (rank among processes with the same ``local_rank``)."""
    return context.topology().cross_rank


def cross_size() -> int:
    """Number of hosts (processes that share this ``local_rank``)."""
    return context.topology().cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes."""
    topo = context.topology()
    return topo.local_size * topo.cross_size == size()


# ------------------------------------------------------------------------------------------------
# What this installation can do (the *_built / *_enabled queries answer for adacomp's transports)
# ------------------------------------------------------------------------------------------------
def _backend_name() -> str | None:
    be = context._current  # noqa: SLF001 - a query must not start a context
    return None if be is None else getattr(be, "name", None)


def mpi_built() -> bool:
    """True when the MPI backend can be used here (mpi4py installed)."""
    return importlib.util.find_spec("mpi4py") is not None


def gloo_built() -> bool:
    """True when torch.distributed has gloo (the torch backend's CPU transport)."""
    import torch.distributed as dist
    return bool(dist.is_available() and dist.is_gloo_available())


def nccl_built() -> int:
    """NCCL version as an int (e.g. 21805) when torch has NCCL, else 0 (Horovod's convention)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * 10000 + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return getattr(torch.version, "hip", None) is not None


def mpi_enabled() -> bool:
    """True when the running job talks over MPI (mpirun launch, or Horovod's MPI controller)."""
    name = _backend_name()
    if name == "horovod":
        import horovod.torch as hvd
        return bool(hvd.mpi_enabled())
    return name == "mpi"


def gloo_enabled() -> bool:
    """True when the running job talks over gloo (torch backend, or Horovod's Gloo controller)."""
    name = _backend_name()
    if name == "horovod":
        import horovod.torch as hvd
        return bool(hvd.gloo_enabled())
    return name == "torch"


def mpi_threads_supported() -> bool:
    """Whether MPI was initialised with MPI_THREAD_MULTIPLE. Like Horovod, asking before
    ``init()`` or in a job that does not use MPI is a ValueError."""
    name = _backend_name()
    if name is None:
        raise ValueError("adacomp has not been initialized; use adacomp.init()")
    if name == "horovod":
        import horovod.torch as hvd
        return bool(hvd.mpi_threads_supported())
    if name != "mpi":  # Horovod raises here too when its MPI is not in use
        raise ValueError(f"MPI is not in use (backend {name!r}); launch with mpirun to use the MPI backend")
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's dynamic timeline. Without ``HOROVOD_TIMELINE=DYNAMIC`` a ValueError, as Horovod
    raises; with it, the call is accepted so the script runs on, but adacomp writes no Horovod timeline
    (said once: its per-step record is ``optimizer.last_stats`` / ``history``, and torch.profiler sees
    its collectives). Under the Horovod backend, Horovod's own timeline."""
    if _backend_name() == "horovod":
        import horovod.torch as hvd
        hvd.start_timeline(file_path, mark_cycles)
        return
    if os.environ.get("HOROVOD_TIMELINE") != "DYNAMIC":
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
    warnings.warn(f"adacomp writes no Horovod timeline ({file_path!r} stays unwritten): see optimizer.last_stats / "
                  "history for each step's compression, communication and bytes, or torch.profiler for the "
                  "collectives", RuntimeWarning, stacklevel=2)


def stop_timeline() -> None:
    """Horovod's: ends what :func:`start_timeline` started (nothing to end without Horovod's backend)."""
    if _backend_name() == "horovod":
        import horovod.torch as hvd
        hvd.stop_timeline()
        return
    if os.environ.get("HOROVOD_TIMELINE") != "DYNAMIC":
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
