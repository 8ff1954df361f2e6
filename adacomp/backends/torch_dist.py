"""torch.distributed backend: gloo for CPU tensors, NCCL for CUDA tensors, env:// rendezvous.

Started by torchrun or ``adacomp run`` (both set MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE /
LOCAL_RANK). ``timeout_s`` bounds every collective, so a dead peer surfaces as an error instead
of a hang.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from adacomp.backends.base import Backend, Handle, check_alltoall, check_splits


# alltoall only moves bytes, so a dtype the transport lacks (gloo and NCCL have no int16) travels
# as a same-width dtype it has; the view is exact and free.
_ALLTOALL_BITS = {torch.int16: torch.float16}


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


def _elastic_store(timeout: datetime.timedelta) -> tuple[Any, int, int]:
    """Under ``torchrun --max-restarts N`` the workers of every restart attempt share the agent's
    store; the process group's keys of a failed attempt are still there and the new group's gloo
    ``connectFullMesh`` may read them and fail. Prefixing the keys with
    ``TORCHELASTIC_RESTART_COUNT`` gives each attempt its own namespace. ``(None, -1, -1)``
    outside torchelastic (plain env:// is then used)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None, -1, -1
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"adacomp/attempt{int(attempt)}/", store), rank, world


class TorchBackend(Backend):
    """torch.distributed with the default process group (created here unless one exists)."""

    name = "torch"

    def __init__(self, timeout_s: float = 60.0):
        self._owns_group = False
        if not dist.is_initialized():
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
            if missing:
                raise RuntimeError(
                    f"backend 'torch' needs the env:// rendezvous variables {missing}; launch with "
                    "`torchrun --nproc_per_node N script.py` or `adacomp run -np N -- python script.py`")
            pg_backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            timeout = datetime.timedelta(seconds=timeout_s)
            store, rank, world = _elastic_store(timeout)
            if store is None:
                dist.init_process_group(pg_backend, timeout=timeout)
            else:
                dist.init_process_group(pg_backend, store=store, rank=rank, world_size=world, timeout=timeout)
            self._owns_group = True
        self._rank = dist.get_rank()
        self._size = dist.get_world_size()
        self._local_rank = int(os.environ.get("LOCAL_RANK", self._rank))

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def local_rank(self) -> int:
        return self._local_rank

    def allreduce_async(self, tensor: Tensor, average: bool = False) -> Handle:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
        size = self._size

        def wait() -> Tensor:
            work.wait()
            if average and size > 1:
                if tensor.is_floating_point():
                    tensor.div_(size)
                else:
                    tensor.floor_divide_(size)
            return tensor
        return Handle(wait)

    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None) -> Handle:
        if sizes is None:
            sizes = self.allgather_sizes(int(tensor.shape[0]))
        if len(sizes) != self._size:
            raise ValueError(f"sizes has {len(sizes)} entries for a world of {self._size}")
        rows = max(sizes)
        padded = _pad_rows(tensor.contiguous(), rows)
        outs = [torch.empty_like(padded) for _ in range(self._size)]
        work = dist.all_gather(outs, padded, async_op=True)

        def wait() -> Tensor:
            work.wait()
            if all(s == rows for s in sizes):
                return torch.cat(outs)
            return torch.cat([o[:s] for o, s in zip(outs, sizes)])
        return Handle(wait)

    def allgather_sizes(self, n: int) -> list[int]:
        t = torch.tensor([n], dtype=torch.int64)
        outs = [torch.empty_like(t) for _ in range(self._size)]
        dist.all_gather(outs, t)
        return [int(o.item()) for o in outs]

    def alltoall_async(self, tensor: Tensor, splits: list[int], recv_splits: list[int] | None = None) -> Handle:
        """``dist.all_to_all_single`` with explicit split sizes (gloo on CPU, NCCL on CUDA)."""
        counts, recv = check_alltoall(tensor, splits, recv_splits, self._size)
        if recv is None:
            recv = self.alltoall_splits(counts)
        send = tensor.detach().contiguous()
        out = torch.empty((sum(recv),) + tuple(send.shape[1:]), dtype=send.dtype, device=send.device)
        bits = _ALLTOALL_BITS.get(send.dtype)
        work = dist.all_to_all_single(out.view(bits) if bits else out, send.view(bits) if bits else send,
                                      output_split_sizes=recv, input_split_sizes=counts, async_op=True)

        def wait() -> Tensor:
            work.wait()
            return out
        return Handle(wait)

    def alltoall_splits(self, splits: list[int]) -> list[int]:
        # CPU counts: gloo serves CPU tensors in the "cpu:gloo,cuda:nccl" group (as allgather_sizes).
        send = torch.tensor(check_splits(splits, self._size, "alltoall splits"), dtype=torch.int64)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return [int(x) for x in recv.tolist()]

    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle:
        work = dist.broadcast(tensor, src=root, async_op=True)

        def wait() -> Tensor:
            work.wait()
            return tensor
        return Handle(wait)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        box = [obj if self._rank == root else None]
        dist.broadcast_object_list(box, src=root)
        return box[0]

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def shutdown(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
