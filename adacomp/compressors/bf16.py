"""bf16 transport: the rounding of PyTorch's ``bf16_compress_hook`` as an adacomp compressor.

Why: the cheap baseline every compression claim has to beat is DDP with bf16 gradients (2x fewer
bytes, no measurable accuracy cost). PyTorch's hook refuses gloo / CPU ("BF16 all reduce
communication hook required CUDA 11+ and NCCL 2.10+", torch 2.13), so adacomp carries the same
rounding itself: cast to bfloat16 for the allreduce, cast back after. gloo reduces bf16 natively.
One difference in order: torch divides by the world size before the bf16 sum; adacomp's allreduce
averages after it (same bytes, rounding differs in the last bit).
"""
from __future__ import annotations

import torch

from adacomp.compressors.base import CastCompressor, register


@register("bf16")
class BF16Compressor(CastCompressor):
    """Cast to bfloat16 for transport; additive (allreduce), 2x smaller, unbiased enough for no memory."""

    wire_dtype = torch.bfloat16
