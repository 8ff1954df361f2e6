"""Horovod backend: ``horovod.torch`` collectives under ``horovodrun``.

Install with ``make horovod`` (scripts/build_horovod.sh): Horovod 0.28.1 must be built from source
with C++17 to compile against current PyTorch (DESIGN.md "Horovod on current PyTorch"). Launch with
``horovodrun --gloo -np N python script.py``.

Design notes (why it looks like this):

* **Names.** Horovod matches collectives across ranks by *name*, not by order, and refuses two
  outstanding ops with one name. Each op gets ``adacomp.<n>`` from a per-backend counter; since
  every rank issues the same collectives in the same order (DESIGN.md), ``n`` agrees across ranks.
  The cost: a never-repeating name misses Horovod's response cache, so each op is negotiated by
  the coordinator (a few microseconds with the Gloo controller).
* **Sum / average.** Floating tensors use ``hvd.Sum`` / ``hvd.Average`` in place. Integer averages
  are summed and floor-divided here, as in the torch backend, because Horovod's average scales
  integers with a float factor.
* **bfloat16.** Horovod 0.28.1 has no bfloat16 type. Allreduce upcasts a copy to float32 and
  rounds back on ``wait()``; allgather / broadcast move the bits through an ``int16`` view (exact).
  Likewise bool moves as ``uint8``, and reductions of uint8 / int8 / int16 (which Horovod's CPU
  allreduce refuses) run on an int32 copy, so every dtype works in the caller's dtype.
* **Differing first dims** are native to ``hvd.allgather``; ``sizes`` is only checked, never needed.
  Likewise ``hvd.alltoall`` exchanges row counts itself: ``recv_splits`` is only checked.
* **CUDA tensors** need a Horovod built with GPU operations (``HOROVOD_GPU_OPERATIONS=NCCL``);
  ``make horovod`` builds the CPU / Gloo flavour the project's machines can run.
* **Timeout.** Horovod has no per-operation timeout; ``timeout_s`` is honoured for tensor
  collectives by polling ``hvd.poll`` and raising :class:`~adacomp.errors.CommunicationError` at
  the deadline (the op is abandoned; exit the process). Object collectives and ``barrier`` block in
  Horovod without a deadline. ``timeout_s <= 0`` always uses the blocking ``hvd.synchronize``.
"""
from __future__ import annotations

import itertools
import pickle
import time
from typing import Any, Callable

import torch
from torch import Tensor

from adacomp.backends.base import Backend, Handle, check_alltoall
from adacomp.errors import CommunicationError

_BITS_VIEW = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}
# Horovod's CPU allreduce refuses 8- and 16-bit integers ("Tensor type ... is not supported"):
# reductions widen a copy to int32 and narrow the result back (wrap-around, as a native sum would).
_WIDEN = {torch.uint8: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32}


def _import_horovod() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise RuntimeError(
            f"backend 'horovod' needs horovod.torch, which is not importable ({exc}); build and "
            "install it with `make horovod` (Horovod 0.28.1 patched for C++17, Gloo controller); "
            "if torch was upgraded since, rebuild with `HOROVOD_FORCE=1 make horovod`") from exc
    return hvd


class HorovodBackend(Backend):
    """horovod.torch transport; calls ``hvd.init()`` unless Horovod is already initialised."""

    name = "horovod"

    def __init__(self, timeout_s: float = 60.0, process_set: Any = None):
        self._hvd = _import_horovod()
        self._timeout_s = float(timeout_s)
        self._owns_init = False
        self._ps = process_set  # a Horovod process set (subgroup()); None: every rank
        if process_set is None and not self._hvd.is_initialized():
            self._hvd.init()
            self._owns_init = True
        self._counter = itertools.count()
        self._prefix = "adacomp" if process_set is None else f"adacomp.ps{process_set.process_set_id}"
        self._joins = 0
        # Cached: identity stays readable after shutdown(), as with the other backends.
        self._local_rank = self._hvd.local_rank()
        if process_set is None:
            self._rank, self._size = self._hvd.rank(), self._hvd.size()
        else:
            self._size = len(process_set.ranks)
            self._rank = process_set.ranks.index(self._hvd.rank()) if self._hvd.rank() in process_set.ranks else -1

    def _set(self) -> dict[str, Any]:
        """The ``process_set=`` keyword of Horovod's ops (empty on the global set)."""
        return {} if self._ps is None else {"process_set": self._ps}

    def _root(self, root: int) -> int:
        """A rank of this backend as Horovod's root (a global rank, also for process sets)."""
        return root if self._ps is None else int(self._ps.ranks[root])

    def subgroup(self, ranks: list[int]) -> Backend | None:
        """Horovod's own process set over ``ranks`` (``hvd.add_process_set``, collective; Horovod
        needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` for it). Every rank gets a backend, because
        removing the set (``shutdown()``) is collective in Horovod too; only members may use it."""
        if self._ps is not None:
            raise NotImplementedError("process sets of a process set are not supported")
        try:
            ps = self._hvd.add_process_set([int(r) for r in ranks])
        except ValueError as exc:
            if "HOROVOD_DYNAMIC_PROCESS_SETS" in str(exc):
                raise ValueError(f"{exc} (Horovod's rule; adacomp's other backends do not need it)") from exc
            raise
        return HorovodBackend(self._timeout_s, process_set=ps)

    def join(self, device: int = -1) -> int:
        """Horovod's ``join``. The ranks issued different numbers of ops before it (the joined ones
        fewer), so the name sequence restarts under a fresh prefix, the same on every rank."""
        last = int(self._hvd.join(device))
        self._joins += 1
        self._prefix = f"{self._prefix.split('.j')[0]}.j{self._joins}"
        self._counter = itertools.count()
        return last

    def _name(self, op: str) -> str:
        """One name sequence for every kind of op: ranks that issue different ops at the same point
        meet under one name, so Horovod's coordinator reports the mismatch instead of stalling."""
        return f"{self._prefix}.{next(self._counter)}"

    # ----------------------------------------------------------------------------- identity
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def local_rank(self) -> int:
        return self._local_rank

    # ------------------------------------------------------------------------------ helpers
    def _sync(self, handle: Any, what: str) -> Tensor:
        """``hvd.synchronize`` bounded by ``timeout_s`` (see module docstring, "Timeout")."""
        hvd = self._hvd
        if self._timeout_s > 0 and not hvd.poll(handle):
            start = time.monotonic()
            while not hvd.poll(handle):
                waited = time.monotonic() - start
                if waited > self._timeout_s:
                    raise CommunicationError(
                        f"Horovod {what} on rank {self.rank()} did not complete within {self._timeout_s:g}s; "
                        "expected every rank to issue the same collectives in the same order. A peer "
                        "is stuck, dead or issued a different collective; raise timeout_s if it is slow")
                # Horovod's background thread does the work; back off so polling stays cheap.
                time.sleep(min(1e-3, max(1e-5, waited / 20)))
        return hvd.synchronize(handle)

    def _handle(self, handle: Any, what: str, finish: Callable[[Tensor], Tensor]) -> Handle:
        return Handle(lambda: finish(self._sync(handle, what)), lambda: self._hvd.poll(handle))

    # -------------------------------------------------------------------------- collectives
    def allreduce_async(self, tensor: Tensor, average: bool = False) -> Handle:
        hvd = self._hvd
        wide = torch.float32 if tensor.dtype == torch.bfloat16 else _WIDEN.get(tensor.dtype)
        upcast = wide is not None
        work = tensor.detach().to(wide) if wide else tensor.detach()
        floating = work.is_floating_point()
        op = hvd.Average if average and floating else hvd.Sum
        handle = hvd.allreduce_async_(work, name=self._name("allreduce"), op=op, **self._set())
        size = self.size()

        def finish(out: Tensor) -> Tensor:
            if average and not floating and size > 1:
                out.floor_divide_(size)
            if upcast:
                tensor.copy_(out)
            return tensor
        return self._handle(handle, "allreduce", finish)

    def reduce_async(self, tensor: Tensor, op: str) -> Handle:
        """Horovod's native ``Min`` / ``Max`` / ``Product`` (bfloat16 falls back to the generic path)."""
        native = {"min": "Min", "max": "Max", "product": "Product"}.get(op)
        if native is None or tensor.dtype == torch.bfloat16:
            return super().reduce_async(tensor, op)
        wide = _WIDEN.get(tensor.dtype)
        work = tensor.detach().to(wide) if wide else tensor.detach()
        handle = self._hvd.allreduce_async_(work, name=self._name(op), op=getattr(self._hvd, native), **self._set())

        def finish(out: Tensor) -> Tensor:
            if wide:
                tensor.copy_(out)
            return tensor
        return self._handle(handle, op, finish)

    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None, out: Tensor | None = None) -> Handle:
        if sizes is not None and (len(sizes) != self.size() or sizes[self.rank()] != tensor.shape[0]):
            raise ValueError(f"sizes={sizes} does not match a world of {self.size()} with "
                             f"{tensor.shape[0]} rows on rank {self.rank()}; pass the true first dims or None")
        bits = _BITS_VIEW.get(tensor.dtype)
        send = tensor.detach().contiguous()
        handle = self._hvd.allgather_async(send.view(bits) if bits else send, name=self._name("allgather"),
                                           **self._set())
        return self._handle(handle, "allgather", lambda out: out.view(tensor.dtype) if bits else out)

    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle:
        if not 0 <= root < self.size():
            raise ValueError(f"root must be a rank in [0, {self.size()}), got {root}")
        bits = _BITS_VIEW.get(tensor.dtype)
        work = tensor.detach()
        handle = self._hvd.broadcast_async_(work.view(bits) if bits else work, root_rank=self._root(root),
                                            name=self._name("broadcast"), **self._set())
        return self._handle(handle, "broadcast", lambda _out: tensor)

    def alltoall_async(self, tensor: Tensor, splits: list[int], recv_splits: list[int] | None = None) -> Handle:
        """``hvd.alltoall_async`` with explicit splits. Horovod exchanges the counts itself, so
        ``recv_splits`` saves nothing here; when given it is checked against what arrived."""
        counts, recv = check_alltoall(tensor, splits, recv_splits, self.size())
        bits = _BITS_VIEW.get(tensor.dtype)
        send = tensor.detach().contiguous()
        handle = self._hvd.alltoall_async(send.view(bits) if bits else send,
                                          splits=torch.tensor(counts, dtype=torch.int32),
                                          name=self._name("alltoall"), **self._set())
        rank = self.rank()

        def finish(result: Any) -> Tensor:
            # Horovod 0.28 returns (output, received_splits); older releases the output alone.
            out, got = result if isinstance(result, tuple) else (result, None)
            if recv is not None and got is not None and [int(x) for x in got.tolist()] != recv:
                raise ValueError(f"alltoall recv_splits on rank {rank}: expected {recv} (as passed), but the "
                                 f"ranks sent {got.tolist()} rows; pass the true counts or recv_splits=None")
            return out.view(tensor.dtype) if bits else out
        return self._handle(handle, "alltoall", finish)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self._hvd.broadcast_object(obj, root_rank=self._root(root), name=self._name("broadcast_object"),
                                          **self._set())

    def allgather_object(self, obj: Any) -> list[Any]:
        if self._ps is None:
            return self._hvd.allgather_object(obj, name=self._name("allgather_object"))
        # Horovod 0.28.1's allgather_object has no process_set: pickled bytes through allgather
        blob = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [int(n) for n in self.allgather(torch.tensor([blob.numel()], dtype=torch.int64)).tolist()]
        data, offsets = self.allgather(blob).numpy().tobytes(), [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        return [pickle.loads(data[a:b]) for a, b in zip(offsets, offsets[1:])]

    def barrier(self) -> None:
        if hasattr(self._hvd, "barrier"):
            self._hvd.barrier(**self._set())
        else:  # older Horovod: a one-element allreduce has the same synchronising effect
            self.allreduce(torch.zeros(1))

    def shutdown(self) -> None:
        """Shut Horovod down only if this backend started it (a process set's backend removes its
        set, collectively); safe to call twice."""
        if self._ps is not None:
            ps, self._ps = self._ps, None
            if self._hvd.is_initialized():
                self._hvd.remove_process_set(ps)
            return
        if self._owns_init and self._hvd.is_initialized():
            self._hvd.shutdown()
        self._owns_init = False
