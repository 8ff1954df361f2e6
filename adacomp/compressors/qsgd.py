"""QSGD: stochastic quantisation to ``s`` levels of the bucket norm (Alistarh et al., 2017).

Used as the quantisation family of L-GreCo (l-greco.txt §5: "quantization using QSGD", default
4 bits, search range [D/2, 2D] bits).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from adacomp.compressors.base import Compressor, Payload, register


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack non-negative integers below ``2**bits`` (any integer or bool dtype) into flat uint8.

    Bit-plane packing, LSB first: every code becomes ``bits`` bits and the bit stream is cut into
    bytes. Works for any ``bits`` in [1, 8] (3-, 5-, 7-bit codes included) with vector ops only.
    """
    flat = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return flat.clone()
    if bits == 1:
        stream = flat
    else:
        shifts = torch.arange(bits, device=flat.device, dtype=torch.uint8)
        stream = ((flat.unsqueeze(1) >> shifts) & 1).reshape(-1)
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = torch.tensor([1 << i for i in range(8)], device=flat.device, dtype=torch.uint8)
    return (stream.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _bit_table(device: torch.device) -> Tensor:
    """(256, 8) uint8: the bits of every byte value, LSB first (one gather unpacks a byte)."""
    return ((torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes, as uint8."""
    if bits == 8:
        return packed[:numel]
    stream = _bit_table(packed.device)[packed.long()].reshape(-1)[: numel * bits]
    if bits == 1:
        return stream
    shifts = torch.arange(bits, device=packed.device, dtype=torch.uint8)
    return (stream.view(numel, bits) << shifts).sum(dim=1, dtype=torch.uint8)


def check_bits(bits: int, low: int = 2) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not low <= bits <= 8:
        raise ValueError(f"bits must be an integer in [{low}, 8], got {bits!r}; "
                         "fix: choose e.g. bits: 4 (the L-GreCo default)")
    return bits


class QuantCtx(NamedTuple):
    """Local context: shape and the (rank-identical) quantisation settings."""

    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device
    bits: int
    s: int
    bucket_size: int


@register("qsgd")
class QSGDCompressor(Compressor):
    """QSGD (Alistarh et al., 2017, §3.1): ``Q_s(v_i) = ||v|| * sign(v_i) * xi_i(v, s)`` where
    ``xi_i`` rounds ``s * |v_i| / ||v||`` stochastically to one of its two neighbouring integers, so
    ``E[Q_s(v)] = v`` (unbiased; no error feedback needed, ``residual`` memory is optional).

    * ``bits``: bits per coordinate, sign included; ``s = 2**(bits - 1) - 1`` levels (4 bits -> s = 7,
      the L-GreCo default). ``s`` overrides the level count when > 0 (then ``bits`` is derived).
    * ``bucket_size``: the norm is taken per bucket of this many consecutive elements (QSGD §5
      quantises buckets of d = 512 elements; 0 = one norm for the whole tensor). Smaller buckets
      mean lower variance and more norm overhead (4 bytes per bucket).
    * ``seed``: the owned generator's seed (every rank uses the same seed; rounding noise is
      therefore correlated across ranks, which keeps each rank's estimate unbiased).

    Payload: ``[norms (float32, one per bucket), codes (uint8, bits-per-element packed)]`` where a
    code is ``sign * level + s``. Not additive (levels are scaled by per-rank norms): use the
    ``allgather`` communicator. Fixed size: the payload depends only on the tensor shape.
    """

    additive = False
    fixed_size = True
    biased = False  # memory: auto -> none

    def __init__(self, bits: int = 4, s: int = 0, bucket_size: int = 512, seed: int = 0):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0 or s > 127:
            raise ValueError(f"s must be an integer in [1, 127] (or 0 to derive it from bits), got {s!r}")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 0:
            raise ValueError(f"bucket_size must be an integer >= 0 (0 = whole tensor), got {bucket_size!r}")
        self.bits = check_bits(bits) if s == 0 else max(2, (2 * s).bit_length())
        self.s = s if s > 0 else (1 << (self.bits - 1)) - 1
        if bucket_size > 2 ** 24:
            raise ValueError(f"bucket_size must be <= 2**24 elements (QSGD uses 512), got {bucket_size}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 40:
            raise ValueError(f"seed must be an integer in [0, 2**40), got {seed!r}")
        self.bucket_size = bucket_size
        self.seed = int(seed)
        self._gens: dict[str, torch.Generator] = {}

    # ----- knobs for policies (L-GreCo) -----------------------------------------------------
    def set_bits(self, bits: int) -> None:
        """Change the bit width between steps (L-GreCo assigns bits per layer)."""
        self.bits = check_bits(int(bits))
        self.s = (1 << (self.bits - 1)) - 1

    def get_bits(self) -> int:
        return self.bits

    def _gen(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._gens:
            g = torch.Generator(device=device)
            # offset so that seed 0 does not replay the stream of a user's torch.manual_seed(0)
            g.manual_seed(0x51D5 + 1_000_003 * self.seed)
            self._gens[key] = g
        return self._gens[key]

    def _buckets(self, numel: int) -> int:
        size = min(self.bucket_size, numel) if self.bucket_size else numel
        return max(1, -(-numel // max(size, 1)))

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        flat = tensor.reshape(-1).float()
        n = flat.numel()
        size = min(self.bucket_size, n) if self.bucket_size else n  # a bucket never exceeds the tensor
        size = max(size, 1)
        nb = self._buckets(n)
        padded = torch.zeros(nb * size, dtype=torch.float32, device=flat.device)
        padded[:n] = flat
        rows = padded.view(nb, size)
        norms = rows.norm(dim=1)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        scaled = rows.abs() / safe.unsqueeze(1) * self.s              # in [0, s]
        rnd = torch.rand(scaled.shape, generator=self._gen(flat.device), device=flat.device)
        level = scaled.add_(rnd).floor_().clamp_(max=self.s)     # floor(x + U) rounds x up w.p. frac(x)
        codes = (torch.where(rows < 0, -level, level).reshape(-1)[:n] + self.s).to(torch.uint8)
        ctx = QuantCtx(tensor.shape, n, tensor.dtype, tensor.device, self.bits, self.s, size)
        return [norms, pack_bits(codes, self.bits)], ctx

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        norms, packed = payload
        c: QuantCtx = ctx
        s = c.s
        levels = unpack_bits(packed.to(c.device), c.bits, c.numel).float().sub_(s)
        nb = norms.numel()
        padded = torch.zeros(nb * c.bucket_size, dtype=torch.float32, device=c.device)
        padded[: c.numel] = levels
        out = (padded.view(nb, c.bucket_size) * (norms.to(c.device).float() / s).unsqueeze(1)).reshape(-1)
        return out[: c.numel].to(c.dtype).view(c.shape)

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        n = int(torch.Size(shape).numel())
        return 4 * self._buckets(n) + -(-n * self.bits // 8)

    def state_dict(self) -> dict[str, Any]:
        return {"generators": {k: g.get_state() for k, g in self._gens.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, st in state.get("generators", {}).items():
            self._gen(torch.device(key)).set_state(st)

    def __repr__(self) -> str:
        return f"QSGDCompressor(bits={self.bits}, s={self.s}, bucket_size={self.bucket_size})"
