"""Bit packing for the quantisers (qsgd, efsignsgd): codes of ``bits`` bits, LSB-first bit stream.

Layout (unchanged from the first implementation): code ``i`` occupies stream bits ``[i * bits,
(i + 1) * bits)``, least significant bit first, and stream bit ``p`` is bit ``p % 8`` of byte
``p // 8``; the last byte is zero-padded. Eight codes therefore fill exactly ``bits`` bytes, which is
what every kernel here exploits: a group of 8 codes is one 64-bit word (code ``i`` at bit
``bits * i``) whose low ``bits`` bytes, little-endian, are the packed bytes.

Why this file: the first version expanded every code into ``bits`` separate bytes and summed
8-wide rows (about 20 memory passes over the codes); unpacking gathered an int64 index per byte.
Here packing is a few shifts/ors over whole bytes or 64-bit words, and unpacking writes each code
position with one shift and one mask.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor

from adacomp.compressors import _native

_LITTLE = sys.byteorder == "little"


def packed_bytes(numel: int, bits: int) -> int:
    return -(-numel * bits // 8)


def _groups_of_8(flat: Tensor) -> Tensor:
    """``flat`` (uint8) zero-padded to a multiple of 8 and viewed as (n / 8, 8)."""
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, 8)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack non-negative integers below ``2**bits`` (any integer or bool dtype) into flat uint8."""
    flat = codes.reshape(-1)
    n = flat.numel()
    if bits == 8:
        return flat.to(torch.uint8).clone() if flat.dtype == torch.uint8 else flat.to(torch.uint8)
    nbytes = packed_bytes(n, bits)
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8, device=flat.device)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    elif flat.dtype != torch.uint8:
        flat = flat.to(torch.uint8)
    fast = _native.pack(flat, bits)  # one C pass, the same bytes
    if fast is not None:
        return fast
    g = _groups_of_8(flat)
    if bits == 4:  # two codes per byte: byte j = c[2j] | c[2j+1] << 4
        pairs = g.view(-1, 2)
        return torch.bitwise_left_shift(pairs[:, 1], 4).bitwise_or_(pairs[:, 0])[:nbytes]
    if bits == 1 and _LITTLE:
        # one word = 8 codes, code i in bit 8i; three shift-or folds bring bit 8i to bit i of byte 0
        w = g.clone().view(torch.int64).view(-1)
        tmp = torch.empty_like(w)
        for shift in (7, 14, 28):
            w.bitwise_or_(torch.bitwise_right_shift(w, shift, out=tmp))
        return w.to(torch.uint8)[:nbytes]
    if bits == 2:  # four codes per byte
        quads = g.view(-1, 4)
        out = quads[:, 0].clone()
        for i in (1, 2, 3):
            out.bitwise_or_(torch.bitwise_left_shift(quads[:, i], 2 * i))
        return out[:nbytes]
    # any width: build the 64-bit word of each group of 8 codes and keep its low ``bits`` bytes
    w = torch.empty(g.shape[0], dtype=torch.int64, device=g.device)
    w.copy_(g[:, 0])
    for i in range(1, 8):
        w.bitwise_or_(torch.bitwise_left_shift(g[:, i].to(torch.int64), bits * i))
    by = w.view(torch.uint8).view(-1, 8)
    if not _LITTLE:
        by = by.flip(1)
    return by[:, :bits].reshape(-1)[:nbytes]


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes, as uint8."""
    if bits == 8:
        return packed[:numel]
    fast = _native.unpack(packed, bits, numel)
    if fast is not None:
        return fast
    if 8 % bits == 0:  # one shift (and mask) per code position writes it straight into place
        per = 8 // bits
        m = -(-numel // per)
        out = torch.empty(m, per, dtype=torch.uint8, device=packed.device)
        src = packed[:m]
        for i in range(per):
            torch.bitwise_right_shift(src, bits * i, out=out[:, i])
            if i < per - 1:
                out[:, i].bitwise_and_((1 << bits) - 1)
        return out.view(-1)[:numel]
    ngroups = -(-numel // 8)
    by = torch.zeros(ngroups, 8, dtype=torch.uint8, device=packed.device)
    src = packed[:ngroups * bits]
    full = src.numel() // bits
    by[:full, :bits] = src[:full * bits].view(full, bits)
    if full < ngroups:  # the last group's bytes are cut short in the stream
        rest = src[full * bits:]
        by[full, :rest.numel()] = rest
    if not _LITTLE:
        by = by.flip(1).contiguous()
    w = by.view(torch.int64).view(-1)
    out = torch.empty(ngroups, 8, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    for i in range(8):
        out[:, i] = torch.bitwise_right_shift(w, bits * i).bitwise_and_(mask)
    return out.view(-1)[:numel]


_BYTE_CODES: dict[tuple[int, torch.device], Tensor] = {}


def byte_codes(bits: int, device: torch.device) -> Tensor:
    """(256, 8 / bits) int64: row ``b`` holds the codes packed in byte ``b``, in stream order.
    Made once per width and device (each decode used to rebuild it: five kernels on a GPU)."""
    key = (bits, device)
    codes = _BYTE_CODES.get(key)
    if codes is None:
        shifts = bits * torch.arange(8 // bits, device=device)
        codes = _BYTE_CODES[key] = (torch.arange(256, device=device).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes


def byte_table(bits: int, values: Tensor) -> Tensor:
    """(256, 8 / bits) table: row ``b`` holds ``values[code]`` for the codes packed in byte ``b``,
    in stream order. ``values`` has ``2**bits`` entries (the decoded value of each code)."""
    return values[byte_codes(bits, values.device)]


def unpack_table(packed: Tensor, bits: int, numel: int, table: Tensor, out: Tensor) -> Tensor:
    """Decode the first ``numel`` codes into contiguous ``out`` through a :func:`byte_table`: one
    row lookup per packed byte writes all its codes' values at once (one pass over ``out``, no
    per-position shifts, no uint8 temporary; 3-7x faster than shift-and-mask for 1- and 2-bit codes,
    slower for 4-bit ones, whose rows hold only two values)."""
    per = 8 // bits
    flat = out.view(-1)
    full = numel // per
    if full:
        torch.index_select(table, 0, packed[:full].to(torch.int32), out=flat[:full * per].view(full, per))
    if full * per < numel:  # the last byte's row, indexed on the device (no read-back)
        flat[full * per:numel] = table.index_select(0, packed[full:full + 1].to(torch.int32))[0, :numel - full * per]
    return out


def decode(packed: Tensor, bits: int, numel: int, values: Tensor, out: Tensor) -> Tensor:
    """``values[code]`` for the first ``numel`` codes, written into contiguous ``out``: one C pass
    where the library serves it, else :func:`unpack_table` through a :func:`byte_table`."""
    if not _native.decode(packed, bits, numel, values, out.view(-1)):
        unpack_table(packed, bits, numel, byte_table(bits, values), out)
    return out


def unpack_levels(packed: Tensor, bits: int, numel: int, offset: int, out: Tensor) -> Tensor:
    """``code - offset`` as ``out``'s (float) dtype for the first ``numel`` codes, written into
    ``out``: the quantisers' decode without a float temporary."""
    if out.dtype == torch.float32 and out.is_contiguous() and 8 % bits == 0 and bits < 8:
        levels = torch.arange(1 << bits).sub_(offset).to(torch.float32)  # exact small integers
        if _native.decode(packed, bits, numel, levels, out.view(-1)):
            return out
    if bits > 2 or 8 % bits or not out.is_contiguous():  # 4-bit rows of 2 values: shifts are faster
        return out.copy_(unpack_bits(packed, bits, numel)).sub_(offset)
    levels = torch.arange(1 << bits, device=out.device).sub_(offset).to(out.dtype)  # exact small integers
    return unpack_table(packed, bits, numel, byte_table(bits, levels), out)
