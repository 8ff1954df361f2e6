"""QSGD: stochastic quantisation to ``s`` levels of the bucket norm (Alistarh et al., 2017).

Used as the quantisation family of L-GreCo (l-greco.txt §5: "quantization using QSGD", default
4 bits, search range [D/2, 2D] bits).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from adacomp.compressors import _counter_rng, _native
from adacomp.compressors._bitpack import pack_bits, packed_bytes, unpack_bits, unpack_levels
from adacomp.compressors.base import Compressor, Payload, register

__all__ = ["QSGDCompressor", "QuantCtx", "check_bits", "pack_bits", "unpack_bits"]

# Elements quantised per block and thread: every elementwise step of a block runs on data still in
# L2 cache, so the quantiser reads the gradient once from memory (a multiple of the bucket size is
# used). Scaled by the thread count so each parallel op still gives every thread this much work.
CHUNK = 1 << 18


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
    * ``rng``: where the rounding's uniforms come from. ``torch`` (default): torch's generator,
      one stream for all tensors in call order (payloads bitwise those of earlier releases).
      ``counter``: a counter-based stream (:mod:`adacomp.compressors._counter_rng`), each number a
      hash of (seed, tensor name, call count, position): the same distribution and unbiasedness,
      other bits, and no serial generator in the quantiser's pass (cost_notes item 37).

    Payload: ``[norms (float32, one per bucket), codes (uint8, bits-per-element packed)]`` where a
    code is ``sign * level + s``. Not additive (levels are scaled by per-rank norms): use the
    ``allgather`` communicator. Fixed size: the payload depends only on the tensor shape.
    """

    additive = False
    fixed_size = True
    biased = False  # memory: auto -> none
    fused_mean = True

    RNGS = ("torch", "counter")

    def __init__(self, bits: int = 4, s: int = 0, bucket_size: int = 512, seed: int = 0, rng: str = "torch"):
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
        if rng not in self.RNGS:
            raise ValueError(f"rng must be one of {list(self.RNGS)}, got {rng!r}; 'torch' keeps torch's generator "
                             "(the default), 'counter' draws a faster counter-based stream")
        self.bucket_size = bucket_size
        self.seed = int(seed)
        self.rng = rng
        self._gens: dict[str, torch.Generator] = {}
        self._calls: dict[str, int] = {}  # rng counter: compress calls per tensor name (the key's count)

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

    def _norms(self, src: Tensor, n: int, size: int, nb: int) -> Tensor:
        """Per-bucket l2 norms, each the norm of its zero-padded bucket of ``size`` elements: the
        whole buckets straight from ``src`` (no padded copy), the last partial one padded alone."""
        full = n // size
        if full == nb:
            return src.view(nb, size).norm(dim=1)
        tail = torch.zeros(1, size, dtype=torch.float32, device=src.device)
        tail[0, :n - full * size] = src[full * size:]
        if full == 0:
            return tail.norm(dim=1)
        return torch.cat([src[:full * size].view(full, size).norm(dim=1), tail.norm(dim=1)])

    @staticmethod
    def _blocks(size: int, nb: int, chunk: int) -> list[tuple[int, int, int]]:
        """(lo, hi, first bucket) of the blocks: whole buckets per block (block starts a multiple
        of 8 elements, so each block packs to whole bytes) or, for buckets above CHUNK, pieces of
        one bucket."""
        total = nb * size
        if size <= chunk:
            unit = size * 8 // math.gcd(size, 8)
            step = max(unit, chunk // unit * unit)
            return [(lo, min(lo + step, total), lo // size) for lo in range(0, total, step)]
        return [(lo, min(lo + chunk, (b + 1) * size), b) for b in range(nb) for lo in range(b * size, (b + 1) * size, chunk)]

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        """Quantise block by block (one read of the gradient, every elementwise step in cache):
        ``code = s + sign(v) * floor(s |v| / ||bucket|| + U)``, the same operations, order and random
        stream as the whole-tensor expression with ``torch.rand(nb * size)`` (uniform_ fills in order)."""
        src = tensor.reshape(-1)
        if src.dtype != torch.float32:
            src = src.float()
        n = src.numel()
        size = max(min(self.bucket_size, n) if self.bucket_size else n, 1)  # a bucket never exceeds the tensor
        nb = self._buckets(n)
        gen, key = None, None
        if self.rng == "counter":
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            key = _counter_rng.key(self.seed, name, call)
        else:
            gen = self._gen(src.device)
        ws = self._workspace()
        nbytes = packed_bytes(n, self.bits)
        packed = ws.output(torch.Size([nbytes]), nbytes, torch.uint8, src.device)  # recycled once nobody holds it
        ctx = QuantCtx(tensor.shape, n, tensor.dtype, tensor.device, self.bits, self.s, size)
        if src.device.type == "cpu":
            norms = torch.empty(nb)
            if _native.qsgd_compress(src, nb * size, ws.scratch("safe", nb, torch.float32, src.device), size,
                                     self.s, self.bits, gen, packed, norms=norms, key=key):
                return [norms, packed], ctx  # one C loop over L1 tiles: norms, uniforms, codes, packing
        norms = self._norms(src, n, size, nb)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        if _native.qsgd_compress(src, nb * size, safe, size, self.s, self.bits, gen, packed, key=key):
            return [norms, packed], ctx  # the same loop with torch's norms
        chunk = CHUNK * max(1, torch.get_num_threads())
        blocks = self._blocks(size, nb, chunk)
        width = max(hi - lo for lo, hi, _ in blocks)
        a_buf = ws.scratch("a", width, torch.float32, src.device)
        r_buf = ws.scratch("rnd", width, torch.float32, src.device)
        aligned = all(lo % 8 == 0 for lo, _, _ in blocks)
        codes_all = None if aligned else torch.empty(n, dtype=torch.uint8, device=src.device)
        c_buf = ws.scratch("codes", width, torch.uint8, src.device)
        for lo, hi, first in blocks:
            m = max(0, min(hi, n) - lo)  # real elements; the rest is the last bucket's zero padding
            a, rnd = a_buf[:hi - lo], r_buf[:hi - lo]
            x = src[lo:lo + m]
            if gen is None:
                _counter_rng.uniform_(rnd, key, lo)  # type: ignore[arg-type]  # rng: counter
            elif not _native.uniform_(rnd, gen):  # the same stream in one C loop, torch's where it cannot
                rnd.uniform_(generator=gen)
            if not m:
                continue
            codes = c_buf[:m] if aligned else codes_all[lo:lo + m]  # type: ignore[index]
            if not _native.qsgd_codes(x, rnd, safe[first:], lo - first * size, size, self.s, codes):
                self._codes_torch(x, a, rnd, safe, lo, hi, first, size, chunk, m, codes)
            if aligned:
                b0 = lo * self.bits // 8
                dst = packed[b0:b0 + packed_bytes(m, self.bits)]
                if _native.pack(codes, self.bits, out=dst) is None:  # straight into the payload
                    dst.copy_(pack_bits(codes, self.bits))
        if not aligned:
            packed = pack_bits(codes_all, self.bits)  # type: ignore[arg-type]
        return [norms, packed], ctx

    def _codes_torch(self, x: Tensor, a: Tensor, rnd: Tensor, safe: Tensor, lo: int, hi: int, first: int,
                     size: int, chunk: int, m: int, codes: Tensor) -> None:
        """One block's codes with torch's elementwise operations (the reference the C pass equals;
        ``a``: scratch of the block's width, ``rnd``: the block's uniforms, already drawn)."""
        torch.abs(x, out=a[:m])
        a[m:].zero_()
        if size <= chunk:
            a.view(-1, size).div_(safe[first:first + (hi - lo) // size].unsqueeze(1))
        else:
            a.div_(safe[first])
        a.mul_(self.s)
        a.add_(rnd).floor_().clamp_(max=self.s)  # floor(x + U) rounds x up w.p. frac(x)
        # -level where v < 0 (copysign maps v = -0.0 to level -0.0: the same code s)
        codes.copy_(a[:m].copysign_(x).add_(self.s))

    def packed_mean(self) -> str | None:
        return "qsgd" if type(self).decompress is QSGDCompressor.decompress else None  # a subclass decodes its own way

    def mean_into(self, payloads: list[Payload], ctx: Any, out: Tensor) -> bool:
        """Every rank's ``(code - s) * (norm / s)`` summed in rank order and divided by the world
        size in one C pass over ``out`` (bitwise :meth:`decompress` of each, ``d0 + d1``, ``+= d_r``,
        ``/ world``); one decoded tensor per rank and three more passes otherwise."""
        c: QuantCtx = ctx
        if (len(payloads) < 2 or c.dtype != torch.float32 or c.device.type != "cpu"
                or type(self).decompress is not QSGDCompressor.decompress):  # a subclass decodes its own way
            return False
        levels = torch.arange(1 << c.bits).sub_(c.s).to(torch.float32)  # exact small integers
        # each rank's decoded value of every code per bucket: level * (norm / s), decompress's products
        tables = [(p[0].float() / c.s).unsqueeze(1) * levels for p in payloads]
        return _native.table_mean([p[1] for p in payloads], tables, c.bits, c.bucket_size, c.numel, out)

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        """``(code - s) * (norm / s)`` per bucket, decoded into a reused output buffer."""
        norms, packed = payload
        c: QuantCtx = ctx
        s, size, n = c.s, c.bucket_size, c.numel
        levels = self._workspace().output(torch.Size([n]), n, torch.float32, c.device)
        unpack_levels(packed.to(c.device), c.bits, n, s, levels)
        unit = norms.to(c.device).float() / s
        full = n // size
        if full:
            levels[:full * size].view(full, size).mul_(unit[:full].unsqueeze(1))
        if full * size < n:
            levels[full * size:].mul_(unit[full])
        return levels.to(c.dtype).view(c.shape)

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        n = int(torch.Size(shape).numel())
        return 4 * self._buckets(n) + -(-n * self.bits // 8)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"generators": {k: g.get_state() for k, g in self._gens.items()}}
        if self.rng == "counter":
            out["calls"] = dict(self._calls)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, st in state.get("generators", {}).items():
            self._gen(torch.device(key)).set_state(st)
        if self.rng == "counter":
            self._calls = {str(k): int(v) for k, v in state.get("calls", {}).items()}

    def __repr__(self) -> str:
        rng = "" if self.rng == "torch" else f", rng={self.rng!r}"
        return f"QSGDCompressor(bits={self.bits}, s={self.s}, bucket_size={self.bucket_size}{rng})"
