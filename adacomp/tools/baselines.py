"""The DDP baselines every compression result is compared with: fp32, bf16 and PowerSGD hooks.

``ddp_baseline(name, model)`` wraps ``model`` in ``DistributedDataParallel`` with:

* ``ddp_fp32``: no hook (DDP's own fp32 allreduce);
* ``ddp_bf16``: :func:`bf16_hook`, the rounding of PyTorch's ``bf16_compress_hook``. Torch's hook
  refuses gloo / CPU in torch 2.13 ("required CUDA 11+ and NCCL 2.10+"), so this is the same three
  lines (divide by the world size, cast to bfloat16, allreduce, cast back) without the device check;
* ``ddp_powersgd``: PyTorch's own ``powerSGD_hook`` (rank 1 by default, error feedback, warm start),
  ``start_powerSGD_iter`` = 2 so compression starts at once in short runs.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def bf16_hook(process_group, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: allreduce the bucket in bfloat16 (2 bytes per element), mean in fp32 after.
    Unannotated on purpose: DDP inspects the signature, and postponed annotations are strings."""
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer()
    half = buf.div(dist.get_world_size(group)).to(torch.bfloat16)
    fut = dist.all_reduce(half, group=group, async_op=True).get_future()

    def back(f):  # type: ignore[no-untyped-def]
        buf.copy_(f.value()[0])
        return buf
    return fut.then(back)


def _fp32(model: nn.Module) -> DistributedDataParallel:
    return DistributedDataParallel(model)


def _bf16(model: nn.Module) -> DistributedDataParallel:
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, bf16_hook)
    return ddp


def check_powersgd_device(model: nn.Module) -> None:
    """PyTorch's ``powerSGD_hook`` calls ``torch.cuda.synchronize(<bucket's device>)`` whenever CUDA
    is available (powerSGD_hook.py, both decompress callbacks), which raises for a CPU bucket: on a
    GPU host a CPU model under that hook fails at its first compressed step. Say so up front."""
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "cpu" and torch.cuda.is_available():
        raise RuntimeError("PyTorch's powerSGD_hook synchronises CUDA on the bucket's device whenever CUDA is "
                           "available, which fails for a CPU model; train this baseline on the GPU, or hide the "
                           "GPU from the process (CUDA_VISIBLE_DEVICES=)")


def _powersgd(model: nn.Module, rank: int = 1) -> DistributedDataParallel:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
    check_powersgd_device(model)
    # one bucket: torch's PowerSGD hook on several gloo buckets can issue its rounds in different
    # orders on different ranks (see adacomp/engine/ddp.py); a single bucket avoids that
    ddp = DistributedDataParallel(model, bucket_cap_mb=1024)
    state = P.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                            min_compression_rate=2, use_error_feedback=True, warm_start=True)
    ddp.register_comm_hook(state, P.powerSGD_hook)
    return ddp


BASELINES: dict[str, Callable[[nn.Module], DistributedDataParallel]] = {
    "ddp_fp32": _fp32, "ddp_bf16": _bf16, "ddp_powersgd": _powersgd}


def ddp_baseline(name: str, model: nn.Module) -> DistributedDataParallel:
    """``model`` under DDP with baseline ``name`` (needs an initialised torch process group)."""
    if name not in BASELINES:
        raise ValueError(f"unknown DDP baseline {name!r}; valid choices: {', '.join(BASELINES)}")
    return BASELINES[name](model)


__all__ = ["BASELINES", "bf16_hook", "check_powersgd_device", "ddp_baseline"]
