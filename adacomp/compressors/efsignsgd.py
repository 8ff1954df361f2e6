"""EF-SignSGD: scaled sign compression (Karimireddy et al., 2019, Alg. 1), the 1-bit quantiser of
the ByteComp evaluation (bytecomp.txt §5.1)."""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from adacomp import devices
from adacomp.compressors.base import Compressor, Payload, register
from adacomp.compressors import _native
from adacomp.compressors._bitpack import decode, pack_bits


class SignCtx(NamedTuple):
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device


@register("efsignsgd")
class EFSignSGDCompressor(Compressor):
    """``C(p) = (||p||_1 / d) * sign(p)``: every element becomes its sign, scaled by the mean
    absolute value, so the compressed vector has the same l1 norm as the input.

    Biased: the paper's guarantee needs error feedback, so configure ``memory: {name: residual}``
    (the ``p = g + e`` / ``e = p - C(p)`` of Alg. 1 is exactly adacomp's residual memory).
    Payload: ``[scale (float32, 1 element), signs (uint8, 8 per byte, 1 = non-negative)]``, about
    32x smaller than fp32. Not additive (per-rank scales): use the ``allgather`` communicator.
    """

    additive = False
    fused_mean = True
    fixed_size = True
    residual_in_place = True
    """:meth:`residual` is elementwise, so it may overwrite its input: error feedback compensates
    into a buffer of its own (the gradient stays raw) and keeps it, which lets the residual be
    deferred to the next compensation (:meth:`defer_residual`)."""

    def compensate_into(self, g: Tensor, r: Tensor, out: Tensor, name: str) -> bool:
        """``out = g + r`` (error feedback's compensation, torch.add's bits) with the scale and signs
        of ``out`` from the same pass, kept for :meth:`compress` of ``out``: the compressor reads
        nothing more. False (nothing written) where the fused pass cannot run: the caller adds."""
        return self._keep(_native.add_cascade(g.reshape(-1), r.reshape(-1), out.reshape(-1), absolute=True,
                                              signs=True), out, name)

    def _keep(self, got: tuple[float, Tensor | None] | None, out: Tensor, name: str) -> bool:
        """Keep the scale and signs a fused compensation found for :meth:`compress` of ``out``."""
        if got is None:
            return False
        total, packed = got
        scale = _native.mean_from_sum(total, out.numel())  # torch's mean from its sum
        if packed is not None and math.isfinite(scale):  # else compress asks torch (a NaN's bits)
            self._kept().keep(name, out.reshape(-1), [torch.full((1,), scale, dtype=torch.float32), packed])
        return True

    def _c_residual(self, tensor: Tensor, payload: Payload, ctx: Any, out: Tensor) -> bool:
        """Whether :meth:`residual` takes its C pass (:func:`_native.sign_residual`'s bits)."""
        c: SignCtx = ctx
        scale = payload[0]
        return (type(self).decompress is EFSignSGDCompressor.decompress and c.dtype == torch.float32
                and scale.dtype == torch.float32 and not devices.reads_wait(scale) and tensor.is_contiguous()
                and out.is_contiguous())

    def defer_residual(self, tensor: Tensor, payload: Payload, ctx: Any) -> Any:
        """Keep ``p`` and the signs, subtract ``p - decoded`` inside the next compensation's pass
        (:meth:`compensate_owed`): residual's own read and write of the model are saved. Only where
        both the residual and that pass run in C (the same subtraction either way). The payload's
        tensors are this step's own (never recycled)."""
        if (isinstance(ctx, SignCtx) and len(payload) == 2 and self._c_residual(tensor, payload, ctx, tensor)
                and tensor.numel() == ctx.numel >= 8 and _native.usable(tensor) and _native.sums_like_torch()):
            return (payload, ctx)
        return None

    def owed_residual(self, base: Tensor, token: Any, out: Tensor) -> Tensor:
        return self.residual(base, token[0], token[1], out)

    def compensate_owed(self, g: Tensor, base: Tensor, token: Any, out: Tensor, name: str) -> bool:
        """``out = g + (base - decoded signs)`` with this step's scale and signs from the same pass."""
        scale, packed = token[0]
        got = _native.add_cascade(g.reshape(-1), base.reshape(-1), out.reshape(-1), absolute=True, signs=True,
                                  owed=(packed, float(scale)))
        return self._keep(got, out, name)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        """|p| and the sign mask go to reused scratch (no page faults on fresh multi-MB tensors);
        the scale is the same ``mean`` of the same float32 |p| as before."""
        flat = tensor.reshape(-1)
        kept = self._kept().take(name, flat)  # from the compensation's pass, else one C read, torch's bits
        fused = kept if isinstance(kept, list) else _native.abs_mean_signs(flat)
        if fused is not None:
            return list(fused), SignCtx(tensor.shape, flat.numel(), tensor.dtype, tensor.device)
        ws = self._workspace()
        scale = ws.magnitudes(flat).mean().reshape(1)
        signs = _native.pack_nonneg(flat)  # one C read; the same bits as the mask below
        if signs is None:
            signs = pack_bits(torch.ge(flat, 0, out=ws.scratch("mask", flat.numel(), torch.bool, flat.device)), 1)
        return [scale, signs], SignCtx(tensor.shape, flat.numel(), tensor.dtype, tensor.device)

    def packed_mean(self) -> str | None:
        return "signs" if type(self).decompress is EFSignSGDCompressor.decompress else None  # a subclass decodes its own way

    def mean_into(self, payloads: list[Payload], ctx: Any, out: Tensor) -> bool:
        """Every rank's decoded signs (-scale / +scale) summed in rank order and divided by the
        world size in one C pass over ``out``, bitwise :meth:`decompress` of each, ``d0 + d1``,
        ``+= d_r``, ``/ world``."""
        c: SignCtx = ctx
        if (len(payloads) < 2 or c.dtype != torch.float32 or c.device.type != "cpu"
                or type(self).decompress is not EFSignSGDCompressor.decompress):  # a subclass decodes its own way
            return False
        tables = [torch.cat([-p[0].float(), p[0].float()]) for p in payloads]  # decompress's values
        return _native.table_mean([p[1] for p in payloads], tables, 1, c.numel, c.numel, out)

    def residual(self, tensor: Tensor, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        """``tensor - decompress(payload)`` in one C pass (no decoded tensor written and read back),
        bitwise the generic path's."""
        scale, packed = payload
        if (self._c_residual(tensor, payload, ctx, out)
                and _native.sign_residual(tensor.view(-1), packed, float(scale), out.view(-1))):
            return out
        return super().residual(tensor, payload, ctx, out)

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        """Each bit becomes -s or +s, exactly ``(2 bit - 1) * s`` in float32, by a byte-table lookup."""
        scale, packed = payload
        c: SignCtx = ctx
        s = scale.to(c.device).float()
        out = self._workspace().output(torch.Size([c.numel]), c.numel, torch.float32, c.device)
        values = torch.cat([-s, s])  # bit 0 -> -s, bit 1 -> +s: the same floats as (2 bit - 1) s
        decode(packed.to(c.device), 1, c.numel, values, out)
        return out.to(c.dtype).view(c.shape)

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        return 4 + -(-int(torch.Size(shape).numel()) // 8)
