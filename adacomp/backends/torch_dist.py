"""torch.distributed backend: gloo for CPU tensors, NCCL for CUDA tensors, env:// rendezvous.

Started by torchrun or ``adacomp run`` (both set MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE /
LOCAL_RANK). ``timeout_s`` bounds every collective, so a dead peer surfaces as an error instead
of a hang.
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from adacomp.backends.base import Backend, Handle, check_alltoall, check_splits, gather_into


# gloo and NCCL have no int16. Collectives that only move bytes (allgather, broadcast, alltoall)
# carry it as a same-width dtype they have (the view is exact and free); reductions widen a copy
# to int32 and narrow the result back (two's-complement wrap-around, as a native int16 sum would).
_BITS = {torch.int16: torch.float16}
_WIDEN = {torch.int16: torch.int32}


def _bits(t: Tensor) -> Tensor:
    bits = _BITS.get(t.dtype)
    return t.view(bits) if bits else t
_REDUCE_OPS = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}


_GENERATION = "ADACOMP_TORCH_GENERATION"


def _agent_store() -> bool:
    """torchrun (elastic) hosts the rendezvous store in its agent, not in rank 0."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _free_port() -> int:
    """A port that is free on this host now (rank 0 hosts the rendezvous store)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


def _elastic_store(timeout: datetime.timedelta, generation: int) -> tuple[Any, int, int]:
    """Under torchrun the rendezvous store lives in the agent and outlives our process groups:
    the workers of every restart attempt (``--max-restarts N``) and every ``shutdown()`` /
    ``init()`` generation share it, and a new group's gloo ``connectFullMesh`` may read the old
    group's keys and fail. Prefixing the keys with ``TORCHELASTIC_RESTART_COUNT`` and the
    generation gives each group its own namespace. ``(None, -1, -1)`` outside torchelastic
    (plain env:// is then used)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None and not (_agent_store() and generation):
        return None, -1, -1
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"adacomp/attempt{int(attempt or 0)}/gen{generation}/", store), rank, world


def gloo_worker_states() -> list[str]:
    """The scheduler state (``R`` runnable, ``S`` sleeping, ...) of each gloo worker thread of this
    process, from Linux /proc (elsewhere: none)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    states = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name, _, rest = stat.rpartition(")")
        if name.endswith("(pt_gloo_runloop") and rest.split():
            states.append(rest.split()[0])
    return states


def _let_gloo_workers_settle(max_wait_s: float = 1.0) -> None:
    """Release the GIL for a moment at interpreter exit. A gloo worker thread drops its reference
    to a finished collective only after the caller's wait() returned; if that is the last reference
    to a tensor Python already let go of, the worker needs the GIL. When the interpreter is already
    finalising, taking the GIL ends the thread inside a C++ destructor and the process aborts
    ("terminate called without an active exception") after all its work is done: 5 of 20 two-rank
    runs of three allreduces and an exit did (0 of 70 with this). Destroying the group does not
    cure it: once a torch.optim optimizer exists torch keeps a reference, so the workers are not
    joined. A worker waiting for the GIL gets it during the first pause; one the scheduler has not
    run yet (a loaded machine) is waited for while it is runnable, up to ``max_wait_s``."""
    deadline = time.monotonic() + max_wait_s
    time.sleep(0.05)
    while "R" in gloo_worker_states() and time.monotonic() < deadline:
        time.sleep(0.01)


_SETTLE_REGISTERED = False


def _settle_at_exit() -> None:
    global _SETTLE_REGISTERED
    if not _SETTLE_REGISTERED:
        atexit.register(_let_gloo_workers_settle)
        _SETTLE_REGISTERED = True


PG_BACKENDS = ("gloo", "nccl", "cpu:gloo,cuda:nccl")


def process_group_backend(env: Any) -> str:
    """The process group's transports: gloo for CPU tensors, plus NCCL for CUDA tensors when every
    local rank can have a GPU of its own (``LOCAL_WORLD_SIZE`` <= visible GPUs). NCCL refuses two
    ranks on one device, and a group that offers it sends even ``barrier()`` through it, so more
    local ranks than GPUs get gloo alone (gloo moves CUDA tensors through host memory).
    ``ADACOMP_TORCH_BACKEND`` (one of :data:`PG_BACKENDS`) overrides."""
    forced = env.get("ADACOMP_TORCH_BACKEND")
    if forced:
        if forced not in PG_BACKENDS:
            raise ValueError(f"ADACOMP_TORCH_BACKEND={forced!r}: valid choices: {', '.join(PG_BACKENDS)}")
        return forced
    if not torch.cuda.is_available():
        return "gloo"
    local = int(env.get("LOCAL_WORLD_SIZE", "1"))
    return "cpu:gloo,cuda:nccl" if local <= torch.cuda.device_count() else "gloo"


class TorchBackend(Backend):
    """torch.distributed with the default process group (created here unless one exists), or
    with ``group``: an existing sub-group (``dist.new_group``; a DDP model's ``process_group``).
    Ranks and roots are then the group's, as in Horovod's process sets."""

    name = "torch"

    def __init__(self, timeout_s: float = 60.0, group: Any = None):
        self._owns_group = False
        self._owns_subgroup = False  # a group made by subgroup(): destroyed by shutdown()
        self._timeout_s = float(timeout_s)
        self._group = group
        if group is not None and not dist.is_initialized():
            raise RuntimeError("backend 'torch' got a process group but torch.distributed is not initialised")
        if not dist.is_initialized():
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
            if missing:
                raise RuntimeError(
                    f"backend 'torch' needs the env:// rendezvous variables {missing}; launch with "
                    "`torchrun --nproc_per_node N script.py` or `adacomp run -np N -- python script.py`")
            pg_backend = process_group_backend(os.environ)
            timeout = datetime.timedelta(seconds=timeout_s)
            store, rank, world = _elastic_store(timeout, int(os.environ.get(_GENERATION, "0")))
            if store is None:
                dist.init_process_group(pg_backend, timeout=timeout)
            else:
                dist.init_process_group(pg_backend, store=store, rank=rank, world_size=world, timeout=timeout)
            self._owns_group = True
        _settle_at_exit()
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        if self._rank < 0:
            raise ValueError("backend 'torch': this process is not a member of the process group it was given")
        self._local_rank = int(os.environ.get("LOCAL_RANK", self._rank))
        self._cpu_served: bool | None = None  # does the group have a backend for CPU tensors?
        self._next_port: int | None = None
        if self._owns_group and self._size > 1 and not _agent_store():
            # shutdown() then init() (Horovod allows it) must not meet rank 0's previous rendezvous
            # store, which may still listen on MASTER_PORT while a faster rank reconnects. So every
            # group agrees now on the port its successor will use (shutdown() installs it).
            box: list[Any] = [_free_port() if self._rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            self._next_port = int(box[0])

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def local_rank(self) -> int:
        return self._local_rank

    def _device(self, t: Tensor) -> torch.device:
        """Where ``t``'s collective runs: its own device, unless it is a CPU tensor and the group has
        no CPU backend (``init_process_group("nccl")`` serves CUDA tensors only). adacomp's vote,
        counts and CPU-side payloads then go through the current CUDA device, as NCCL's own object
        collectives do."""
        if t.device.type != "cpu":
            return t.device
        if self._cpu_served is None:
            from torch.distributed import distributed_c10d as c10d
            pg = self._group if self._group is not None else c10d._get_default_group()
            backend_for = getattr(pg, "_get_backend", None)  # absent: a torch that cannot say; assume served
            try:
                self._cpu_served = backend_for is None or backend_for(torch.device("cpu")) is not None
            except RuntimeError:  # "No backend type associated with device type cpu"
                self._cpu_served = False
        if self._cpu_served:
            return t.device
        return torch.device("cuda", torch.cuda.current_device())

    def _staged(self, t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """``t`` on its collective's device (and widened to ``dtype``); ``t`` itself when neither changes."""
        return t.to(device=self._device(t), dtype=dtype or t.dtype)

    def allreduce_async(self, tensor: Tensor, average: bool = False) -> Handle:
        wide = _WIDEN.get(tensor.dtype)
        buf = self._staged(tensor, wide)
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        size = self._size

        def wait() -> Tensor:
            work.wait()
            if average and size > 1:
                if buf.is_floating_point():
                    buf.div_(size)
                else:
                    buf.floor_divide_(size)
            if buf is not tensor:
                tensor.copy_(buf)
            return tensor
        return Handle(wait, work.is_completed)

    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None, out: Tensor | None = None) -> Handle:
        if sizes is None:
            sizes = self.allgather_sizes(int(tensor.shape[0]))
        if len(sizes) != self._size:
            raise ValueError(f"sizes has {len(sizes)} entries for a world of {self._size}")
        rows = max(sizes)
        staged = self._staged(tensor.contiguous())
        equal = all(s == rows for s in sizes) and staged.device == tensor.device and staged.dtype not in _BITS
        into = gather_into(out, staged, rows * self._size) if equal else None
        if into is not None:  # one gather straight into the caller's buffer
            dest: Tensor = into
            direct = dist.all_gather_into_tensor(dest, staged, group=self._group, async_op=True)

            def wait_into() -> Tensor:
                direct.wait()
                return dest
            return Handle(wait_into, direct.is_completed)
        padded = _bits(_pad_rows(staged, rows))
        outs = [torch.empty_like(padded) for _ in range(self._size)]
        work = dist.all_gather(outs, padded, group=self._group, async_op=True)

        def wait() -> Tensor:
            work.wait()
            if all(s == rows for s in sizes):
                out = torch.cat(outs).view(tensor.dtype)
            else:
                out = torch.cat([o[:s] for o, s in zip(outs, sizes)]).view(tensor.dtype)
            return out.to(tensor.device)
        return Handle(wait, work.is_completed)

    def allgather_sizes(self, n: int) -> list[int]:
        t = self._staged(torch.tensor([n], dtype=torch.int64))
        outs = [torch.empty_like(t) for _ in range(self._size)]
        dist.all_gather(outs, t, group=self._group)
        return [int(o.item()) for o in outs]

    def alltoall_async(self, tensor: Tensor, splits: list[int], recv_splits: list[int] | None = None) -> Handle:
        """``dist.all_to_all_single`` with explicit split sizes (gloo on CPU, NCCL on CUDA)."""
        counts, recv = check_alltoall(tensor, splits, recv_splits, self._size)
        if recv is None:
            recv = self.alltoall_splits(counts)
        send = self._staged(tensor.detach().contiguous())
        out = torch.empty((sum(recv),) + tuple(send.shape[1:]), dtype=send.dtype, device=send.device)
        work = dist.all_to_all_single(_bits(out), _bits(send),
                                      output_split_sizes=recv, input_split_sizes=counts, group=self._group,
                                      async_op=True)

        def wait() -> Tensor:
            work.wait()
            return out.to(tensor.device)
        return Handle(wait, work.is_completed)

    def alltoall_splits(self, splits: list[int]) -> list[int]:
        # CPU counts: gloo serves them in the "cpu:gloo,cuda:nccl" group; an NCCL-only group via _staged.
        send = self._staged(torch.tensor(check_splits(splits, self._size, "alltoall splits"), dtype=torch.int64))
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self._group)
        return [int(x) for x in recv.tolist()]

    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle:
        buf = self._staged(tensor)
        work = dist.broadcast(_bits(buf), src=self._global(root), group=self._group, async_op=True)

        def wait() -> Tensor:
            work.wait()
            if buf is not tensor:
                tensor.copy_(buf)
            return tensor
        return Handle(wait, work.is_completed)

    def reduce_async(self, tensor: Tensor, op: str) -> Handle:
        """Native MIN / MAX / PRODUCT reductions (the generic version gathers every rank's copy)."""
        if op not in _REDUCE_OPS:
            return super().reduce_async(tensor, op)  # the generic version names the valid ops
        buf = self._staged(tensor, _WIDEN.get(tensor.dtype))
        work = dist.all_reduce(buf, op=_REDUCE_OPS[op], group=self._group, async_op=True)

        def wait() -> Tensor:
            work.wait()
            if buf is not tensor:
                tensor.copy_(buf)
            return tensor
        return Handle(wait, work.is_completed)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        box = [obj if self._rank == root else None]
        dist.broadcast_object_list(box, src=self._global(root), group=self._group)
        return box[0]

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def subgroup(self, ranks: list[int]) -> Backend | None:
        """``dist.new_group`` over ``ranks`` (this backend's ranks): every rank of the default group
        takes part in creating it, as torch requires and Horovod's ``add_process_set`` does."""
        group = dist.new_group([self._global(r) for r in ranks],
                               timeout=datetime.timedelta(seconds=self._timeout_s))
        if self._rank not in ranks:
            return None
        sub = TorchBackend(self._timeout_s, group=group)
        sub._local_rank = self._local_rank
        sub._owns_subgroup = True
        return sub

    def _global(self, rank: int) -> int:
        """A rank of this backend's group as torch's global rank (what ``src=`` takes)."""
        return rank if self._group is None else dist.get_global_rank(self._group, rank)

    def shutdown(self) -> None:
        if self._owns_subgroup and dist.is_initialized():
            self._owns_subgroup = False
            dist.destroy_process_group(self._group)
            return
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
            if self._next_port is not None:
                os.environ["MASTER_PORT"] = str(self._next_port)
            # The next group of this process is one generation later (the same on every rank,
            # since every rank calls init / shutdown alike); the environment is where env://
            # rendezvous state lives anyway.
            os.environ[_GENERATION] = str(int(os.environ.get(_GENERATION, "0")) + 1)
