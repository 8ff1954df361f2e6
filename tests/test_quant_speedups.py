"""The fast quantiser paths (blockwise QSGD, word-wide bit packing, recycled decode outputs and
aggregation buffers) return exactly what the plain whole-tensor expressions return."""
from __future__ import annotations

import pytest
import torch

import adacomp.compressors as C
from adacomp.communicators.allgather import _mean_decompressed
from adacomp.communicators.base import Entry
from adacomp.compressors import qsgd as qsgd_mod
from adacomp.compressors._bitpack import pack_bits, unpack_bits
from adacomp.compressors.sparse import Workspace
import adacomp.memories.base as M


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def plain_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Bit-plane reference: every code becomes ``bits`` bits, LSB first, cut into bytes."""
    flat = codes.reshape(-1).to(torch.uint8)
    stream = ((flat.unsqueeze(1) >> torch.arange(bits, dtype=torch.uint8)) & 1).reshape(-1)
    stream = torch.cat([stream, stream.new_zeros((-stream.numel()) % 8)])
    return (stream.view(-1, 8).long() << torch.arange(8)).sum(dim=1).to(torch.uint8)


def plain_qsgd(x: torch.Tensor, bits: int, bucket: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """QSGD over the whole zero-padded tensor in one expression (the first implementation)."""
    s = (1 << (bits - 1)) - 1
    flat = x.reshape(-1).float()
    n = flat.numel()
    size = max(min(bucket, n) if bucket else n, 1)
    nb = -(-n // size)
    padded = torch.zeros(nb * size)
    padded[:n] = flat
    rows = padded.view(nb, size)
    norms = rows.norm(dim=1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    level = (rows.abs() / safe.unsqueeze(1) * s + torch.rand(rows.shape, generator=g)).floor_().clamp_(max=s)
    codes = (torch.where(rows < 0, -level, level).reshape(-1)[:n] + s).to(torch.uint8)
    return norms, plain_pack(codes, bits)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1003, 70001])
def test_pack_matches_bit_plane_reference(bits: int, n: int) -> None:
    codes = torch.randint(0, 1 << bits, (n,), generator=gen(n + bits))
    packed = pack_bits(codes, bits)
    assert torch.equal(packed, plain_pack(codes, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes.to(torch.uint8))


@pytest.mark.parametrize("shape,bits,bucket", [
    ((1000,), 4, 512), ((7, 300), 2, 512), ((3, 100003), 3, 100), ((513,), 8, 0), ((2100,), 5, 0),
    ((300, 1000), 4, 70000), ((40, 41), 7, 1), (((1 << 19) + 5,), 4, 512),
])
@pytest.mark.parametrize("path", ["tiles", "tiles_torch_norms", "blocks"])
def test_blockwise_qsgd_equals_whole_tensor_expression(shape, bits, bucket, path, monkeypatch, avx2_switch) -> None:
    """QSGD's C tile loop (uniforms, codes and packing per L1 tile; bits 2, 4, 8; the bucket norms
    in the same loop where the bucket is a multiple of torch's vector width, torch's otherwise or
    with ``path == "tiles_torch_norms"``) and its block loop (every other case, or ``path ==
    "blocks"``) all give the whole-tensor expression's norms and packed codes, and leave the
    generator where it leaves it."""
    monkeypatch.setattr(qsgd_mod, "CHUNK", 4096)  # many blocks, buckets above and below a block
    if path == "blocks":
        monkeypatch.setattr(qsgd_mod._native, "qsgd_compress", lambda *a, **k: False)
    if path == "tiles_torch_norms":
        monkeypatch.setattr(qsgd_mod._native, "norm_lanes", lambda: 0)
    x = torch.randn(shape, generator=gen(1))
    x.view(-1)[::97] = 0.0
    x.view(-1)[1::101] = -0.0
    q = C.get("qsgd", bits=bits, bucket_size=bucket, seed=4)
    ref_gen = gen(0x51D5 + 1_000_003 * 4)
    for _ in range(2):  # the generator advances by the same amount as the reference's
        (norms, packed), ctx = q.compress(x, "w")
        want_norms, want_packed = plain_qsgd(x, bits, bucket, ref_gen)
        assert torch.equal(norms, want_norms) and torch.equal(packed, want_packed)
        s = q.s
        levels = unpack_bits(packed, bits, x.numel()).float().sub_(s)
        size = ctx.bucket_size
        padded = torch.zeros(norms.numel() * size)
        padded[:x.numel()] = levels
        want = (padded.view(-1, size) * (norms / s).unsqueeze(1)).reshape(-1)[:x.numel()].view(shape)
        assert torch.equal(q.decompress([norms, packed], ctx), want)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_qsgd_tile_loop_refuses_a_nan_without_drawing(bits: int) -> None:
    """A NaN stops the C tile loop before it moves the generator: the block loop then draws the
    same numbers, so the next tensor's codes equal those of a compressor that never tried the tiles."""
    x = torch.randn(5000, generator=gen(2))
    y = x.clone()
    y[4321] = float("nan")
    tiled, plain = C.get("qsgd", bits=bits, seed=1), C.get("qsgd", bits=bits, seed=1)
    tiled.compress(y, "w")
    saved = qsgd_mod._native.qsgd_compress
    try:
        qsgd_mod._native.qsgd_compress = lambda *a, **k: False
        plain.compress(y, "w")
    finally:
        qsgd_mod._native.qsgd_compress = saved
    a, b = tiled.compress(x, "w")[0], plain.compress(x, "w")[0]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(tiled._gen(x.device).get_state(), plain._gen(x.device).get_state())


def test_bucket_norms_equal_torch_norms() -> None:
    """The C bucket norms (QSGD's fused loop) equal torch's ``view(-1, size).norm(dim=1)`` bitwise on
    this torch (its AVX2 or AVX-512 kernel: found, not assumed away), at every scale, with a partial
    zero-padded last bucket, infinities and a bucket of zeros, and on a GPT-2-sized matrix."""
    from adacomp.compressors import _native
    lib, lanes = _native.library(), _native.norm_lanes()
    if lib is None:
        pytest.skip(f"no C compiler: {_native._error}")
    assert lanes in (8, 16), "torch's float32 norm order is no longer the one ac_bucket_norms reproduces"
    g = gen(7)
    cases = [(torch.randn(768 * 3072, generator=g), 512), (torch.randn(70000 * 3 + 5, generator=g) * 1e-20, 70000),
             (torch.rand(1000 * 64 + 17, generator=g) * 3e18, 64), (torch.randn(4096, generator=g), 16)]
    cases[3][0][100] = float("inf")
    cases[3][0][200:216] = 0.0
    for x, size in cases:
        nb = -(-x.numel() // size)
        padded = torch.zeros(nb * size)
        padded[:x.numel()] = x
        got = torch.empty(nb)
        assert lib.ac_bucket_norms(x.data_ptr(), x.numel(), size, lanes, got.data_ptr()) == 0
        assert torch.equal(got, padded.view(nb, size).norm(dim=1))
    assert lib.ac_bucket_norms(x.data_ptr(), x.numel(), 12, lanes, got.data_ptr()) == -1  # not whole vectors


def test_efsignsgd_equals_plain_expressions() -> None:
    e = C.get("efsignsgd")
    x = torch.randn(512, 1031, generator=gen(2))
    x.view(-1)[::13] = -0.0
    (scale, packed), ctx = e.compress(x, "w")
    flat = x.reshape(-1)
    assert torch.equal(scale, flat.abs().mean().reshape(1))
    assert torch.equal(packed, plain_pack((flat >= 0).to(torch.uint8), 1))
    bits = unpack_bits(packed, 1, flat.numel())
    assert torch.equal(e.decompress([scale, packed], ctx), ((bits.float() * 2.0 - 1.0) * scale).view(x.shape))


@pytest.mark.parametrize("name", ["qsgd", "efsignsgd"])
def test_recycled_decode_outputs_never_alias_held_ones(name: str) -> None:
    c = C.get(name)
    x1, x2 = torch.randn(600, 1000, generator=gen(3)), torch.randn(600, 1000, generator=gen(4))
    p1, ctx1 = c.compress(x1, "a")
    p2, ctx2 = c.compress(x2, "b")
    out1 = c.decompress(p1, ctx1)
    snap = out1.clone()
    out2 = c.decompress(p2, ctx2)
    out3 = c.decompress(p2, ctx2)  # out1 and out2 held: a third buffer
    ptrs = {t.untyped_storage().data_ptr() for t in (out1, out2, out3)}
    assert len(ptrs) == 3 and torch.equal(out1, snap) and torch.equal(out2, out3)
    del out2, out3
    assert torch.equal(c.decompress(p1, ctx1), snap)


@pytest.mark.parametrize("world", [2, 3])
def test_aggregation_into_reused_buffer_equals_plain_sum(world: int) -> None:
    c = C.get("qsgd", bits=4)
    x = [torch.randn(700, 500, generator=gen(10 + r)) for r in range(world)]
    payloads = [c.compress(t, "w")[0] for t in x]
    ctx = c.compress(x[0], "w")[1]
    e = Entry("w", x[0], c, M.get("none"), None, ctx)
    want = sum(c.decompress(p, ctx).reshape(-1) for p in payloads) / world
    ws = Workspace()
    first = _mean_decompressed(e, payloads, ws)
    assert torch.equal(first.reshape(-1), want)
    second = _mean_decompressed(e, payloads, ws)  # ``first`` still held: other memory, same values
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert torch.equal(first, second)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 7, 8, 13, 4099])
def test_table_decode_equals_shift_and_mask(bits: int, n: int) -> None:
    """unpack_levels' byte-table lookup gives the same floats as unpacking codes then subtracting."""
    from adacomp.compressors._bitpack import unpack_levels
    codes = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(n))
    packed = pack_bits(codes, bits)
    offset = (1 << bits) // 2
    out = torch.full((n,), float("nan"))
    unpack_levels(packed, bits, n, offset, out)
    assert torch.equal(out, unpack_bits(packed, bits, n).float() - offset)
