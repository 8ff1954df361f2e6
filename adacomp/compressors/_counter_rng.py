"""A counter-based uniform stream for stochastic rounding (QSGD's ``rng: counter``).

Why: QSGD needs one uniform number per element. torch's generator is a Mersenne Twister, serial
state that costs ~0.4 ns a number even in the package's AVX2 loop: on a machine whose memory pass
takes ~0.2 ns an element, the numbers alone are twice the memory floor (docs/results/cost_notes.md
item 35). A counter-based stream (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC'11: the i-th number is a keyed hash of i) has no state to advance, so it vectorises and fuses
into the quantiser's pass; resuming needs only the per-tensor call count.

Number i of a call keyed (k0, k1): ``h = mix((lo32(i) + k0) ^ (k1 + hi32(i) * 0x9E3779B9))`` with
``mix`` the "lowbias32" integer hash (a bijection of 32-bit words with low avalanche bias), uniform
``(h >> 8) * 2^-24`` (24 bits, exact in float32). The key of a call is a SplitMix64 hash of (seed,
tensor name, call count): every rank derives the same key for the same tensor and step, as every
rank shares torch's seeded stream today. Over calls an element's hash input is uniform, so its
number is exactly uniform on the 2^-24 grid: QSGD's rounding stays unbiased (Lemma 3.1). One
``mix`` round, not two: the AVX2 loop is bound by its 32-bit multiplies (0.29 against 0.46 ns a
number on an AMD EPYC here, where the Mersenne Twister's loop takes ~0.4); within a call the
numbers pass a 256-bin uniformity and a lag-1 correlation test (tests/test_quant.py). The C loop
(``_native.ctr_uniform_``, fused into ``ac_qsgd_compress``) and the torch twin here give the same
bits, so CUDA tensors and ``ADACOMP_NATIVE=0`` draw the same numbers.
"""
from __future__ import annotations

import zlib

import torch
from torch import Tensor

from adacomp.compressors import _native

_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def key(seed: int, name: str, call: int) -> tuple[int, int]:
    """The (k0, k1) of one compress call: distinct per seed, tensor name and call count."""
    h = _splitmix64(_splitmix64(_splitmix64(seed) ^ zlib.crc32(name.encode())) ^ call)
    return h & _M32, h >> 32


def _mix(x: Tensor) -> Tensor:
    """lowbias32 on int64 tensors holding 32-bit values (products wrap mod 2^64; the mask keeps
    the low 32 bits, which is uint32 arithmetic)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_torch_(out: Tensor, k: tuple[int, int], start: int) -> Tensor:
    """The stream's numbers of positions ``start ..`` into 1-D float32 ``out`` with torch ops (any
    device): the C loop's bits."""
    i = torch.arange(start, start + out.numel(), dtype=torch.int64, device=out.device)
    lo, hi = i & _M32, i >> 32
    h = _mix(((lo + k[0]) & _M32) ^ ((k[1] + hi * 0x9E3779B9) & _M32))
    return out.copy_((h >> 8).to(torch.float32).mul_(1.0 / 16777216.0))


def uniform_(out: Tensor, k: tuple[int, int], start: int) -> Tensor:
    """:func:`uniform_torch_`, by the C loop where it serves ``out``."""
    if not _native.ctr_uniform_(out, k, start):
        uniform_torch_(out, k, start)
    return out


__all__ = ["key", "uniform_", "uniform_torch_"]
