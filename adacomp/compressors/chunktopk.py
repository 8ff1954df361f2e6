"""Chunked Top-k with low-bit values: the compressor of SparseLoCo.

SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
SparseLoCo", Templar AI / Mila, 2025, arXiv:2508.15706: the method section and its algorithm)
sends each replica's pseudo-gradient (the parameter drift after H local steps, DiLoCo family)
through an error-feedback accumulator, keeps the k largest magnitudes inside every fixed-size chunk
of the flattened tensor, quantizes the kept values to 2 bits, and carries what was not sent
(dropped coordinates *and* the quantization error) to the next round. Chunking bounds the index of
a kept value by the chunk size (a short index) and makes the selection a batch of small
independent Top-k problems. Streaming DiLoCo (Douillard et al., 2025, arXiv:2501.18512, its
quantized-communication part) is the related precedent for low-bit outer gradients: it sends them
as 4-bit floats and reports no loss of quality; SparseLoCo adds sparsity on top.

Selection (``n`` elements, ``c = chunk``): the flattened tensor is read as ``floor(n / c)`` full
chunks plus, when ``c`` does not divide ``n``, one last partial chunk of ``m = n mod c`` elements.
A full chunk keeps ``k = max(1, round(density * c))`` coordinates, the partial one
``max(1, round(density * m))`` (never more than it has): the k largest ``|x|`` of that chunk
(no padding, so a position past the tensor's end can never be chosen); ties at the k-th magnitude
go to the lowest positions and a NaN ranks above every number, so the choice depends on the values
only (:func:`chunk_select`: in C, the candidates at or above a floor just below the previous chunk's
k-th magnitude, one radix select among those; where the floor passed too few or too many, the chunk
scanned again from the caches at a better one, and the whole chunk selected only where that fails;
or torch's path; the same bytes).
The payload size therefore depends only on the shape (``fixed_size``: ``allgather_fast`` works).

Values (``b = bits`` < 32): per chunk the scale is ``s = max |kept value|`` (float32), and each kept
value goes to the nearest of the ``2**b`` symmetric uniform levels

    L_j = s * (2 j + 1 - 2**b) / (2**b - 1),   j = 0 .. 2**b - 1

(b = 1: +-s; b = 2: +-s, +-s/3; b = 4: odd multiples of s/15). ``bits = 32`` sends the kept values
as float32, unquantized.

Payload (one entry per tensor; ``K`` = kept values in total, ``R`` = number of chunks):

* ``bits < 32``: ``[codes uint8 (ceil(K * b / 8),), scales float32 (R,), indices int16 (K,)]``;
  codes are the level numbers ``j`` packed LSB-first by :mod:`adacomp.compressors._bitpack`;
* ``bits == 32``: ``[values float32 (K,), indices int16 (K,)]``.

Kept values are ordered chunk by chunk (the partial chunk last), ascending positions inside each
chunk; ``indices`` are positions *inside*
the chunk, 0 .. c - 1, stored in int16: for ``chunk > 32768`` positions above 32767 are stored as
their uint16 bit pattern (``p - 65536``) and read back as ``p & 0xFFFF``. :meth:`payload_bytes` is
exact: ``ceil(K b / 8) + 4 R + 2 K`` (``6 K`` for 32 bits). At the defaults (density 0.02, chunk
4096, 2 bits) a full chunk sends 82 values in 20.5 + 4 + 164 = 188.5 bytes: 2.3 bytes per kept
value (``topk``: 12, a float32 value and an int64 index), 0.046 bytes per element (87x smaller than
float32).

Flags: biased (a deterministic nearest-level quantizer after a Top-k), so ``memory: auto`` picks
``residual``; the residual (``tensor - decompress``, computed at the kept positions only, in place)
carries the quantization error as well. The ranks' mean is one sparse pass over every rank's decoded
values (:meth:`ChunkTopkCompressor.mean_into`), bitwise the communicators' decompress-and-add. Not additive (scales differ per rank and chunk; indices differ), and the
payload is not ``[values, indices]`` over the flat tensor (``sparse = False``): it travels on
``allgather`` or ``allgather_fast``, which decompress every rank's payload with this rank's ctx and
average; ``allreduce`` refuses it. ctx depends only on the shape / dtype / device and the settings.

Where we differ from the reference (SparseLoCo's paper and code):

* Quantizer: ours is the deterministic symmetric uniform grid above, scaled by the chunk's largest
  kept magnitude; the reference code's quantizer is statistical (its range is set in standard
  deviations of the kept values and its levels come from a lookup table). With an even number of
  levels ours has no zero level: a kept exact zero is sent as +-s / (2**b - 1), and error feedback
  returns the difference next round.
* Chunks: ours are contiguous runs of the flattened tensor plus one shorter last chunk; the
  reference code chunks each weight matrix into 2-D blocks, as DeMo does.
* Indices: int16 local positions, 16 bits each; a log2(chunk)-bit code (12 bits at chunk 4096)
  would cut the index bytes by a quarter and is not implemented.
* Error feedback: our ``residual`` memory on whatever the optimizer hands over (a gradient, or a
  pseudo-gradient with local steps); SparseLoCo decays its accumulator by a factor beta before
  adding the new pseudo-gradient, which is ``memory: {name: residual, beta: ...}`` here.
"""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from adacomp import devices
from adacomp.compressors import _native
from adacomp.compressors._bitpack import pack_bits, packed_bytes, unpack_bits
from adacomp.compressors.base import Compressor, Payload, register
from adacomp.compressors.sparse import Workspace, check_density, k_for, nan_as_largest
from adacomp.tensors import flat_of

BITS = (1, 2, 4, 8, 32)
CHUNK_MIN, CHUNK_MAX = 8, 65536
INT16_SPAN = 1 << 15  # local positions at or above this are stored as their uint16 bit pattern


class ChunkCtx(NamedTuple):
    """Local context: the tensor's shape / dtype / device and the chunk layout derived from the
    shape and the (rank-identical) settings, so any rank's payload decodes with it."""

    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device
    chunk: int
    full: int  # number of full chunks
    k_row: int  # kept per full chunk
    tail: int  # length of the last partial chunk (0: none)
    k_tail: int  # kept in the partial chunk
    bits: int

    @property
    def kept(self) -> int:
        return self.full * self.k_row + self.k_tail

    @property
    def chunks(self) -> int:
        return self.full + (1 if self.tail else 0)


def check_chunk(chunk: int) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not CHUNK_MIN <= chunk <= CHUNK_MAX:
        raise ValueError(f"chunk must be an integer in [{CHUNK_MIN}, {CHUNK_MAX}] (elements per chunk; "
                         f"local indices travel as 16 bits), got {chunk!r}; fix: e.g. chunk: 4096")
    return chunk


def check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise ValueError(f"bits must be one of {list(BITS)} (32 = float32 values, unquantized), "
                         f"got {bits!r}; fix: e.g. bits: 2 (SparseLoCo)")
    return bits


_CPU_LEVELS: dict[int, Tensor] = {}


def unit_levels(bits: int, device: torch.device | None = None) -> Tensor:
    """The ``2**bits`` levels for scale 1, ascending: ``(2 j + 1 - 2**b) / (2**b - 1)`` (float32;
    the CPU table is made once per ``bits``: every decode reads it, and callers never write it)."""
    if device is None or torch.device(device).type == "cpu":
        got = _CPU_LEVELS.get(bits)
        if got is None:
            got = _CPU_LEVELS[bits] = _levels(bits, None)
        return got
    return _levels(bits, device)


def _levels(bits: int, device: torch.device | None) -> Tensor:
    n = 1 << bits
    j = torch.arange(n, dtype=torch.float64, device=device)
    return ((2 * j + 1 - n) / (n - 1)).to(torch.float32)


def quantize(values: Tensor, scales: Tensor, bits: int) -> Tensor:
    """Codes (uint8, same shape as ``values`` (rows, k)) of the nearest level of each row's grid
    ``scales[row] * unit_levels(bits)``; a row of scale 0 gets code 0 (its levels are all 0)."""
    top = (1 << bits) - 1
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
    t = values.div(safe).add_(1.0).mul_(top / 2)  # level j sits at t == j
    return t.round_().clamp_(0, top).to(torch.uint8)


def _scales_codes(vals: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Per row of kept values: the scale (max |v|) and the codes (flat), one C pass where it serves."""
    got = _native.chunk_quantize(vals, bits) if vals.device.type == "cpu" else None
    if got is not None:
        return got
    scales = vals.abs().amax(dim=1)
    return scales, quantize(vals, scales, bits).reshape(-1)


def chunk_select(body: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Per row of ``body`` (chunks x c): the positions of the k largest ``|x|`` (int64, ascending;
    ties at the k-th magnitude to the lowest positions; NaN above every number) and their values
    as float32. The payload is thus canonical: it depends on the values only, so the C selection
    (one radix select per chunk, in cache) and torch's path give the same bytes."""
    rows, c = body.shape
    if body.dtype == torch.float32 and _native.usable(body):
        got = _native.chunk_topk(body, rows, c, k)
        if got is not None:
            return got
    mags = body.abs()
    if devices.reads_wait(body):  # one device selection, no host round trip; ties as torch breaks them
        idx = torch.topk(mags, k, dim=1, sorted=False).indices.sort(dim=1).values
    else:
        mags = nan_as_largest(mags)
        kth = torch.topk(mags, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
        keep = mags > kth
        tied = mags == kth
        keep |= tied & (tied.cumsum(1) <= k - keep.sum(1, keepdim=True))
        idx = torch.nonzero(keep)[:, 1].view(rows, k)
    return idx, torch.gather(body, 1, idx).to(torch.float32)


@register("chunktopk")
class ChunkTopkCompressor(Compressor):
    """Chunked Top-k with low-bit values (SparseLoCo, arXiv:2508.15706): the round(density * chunk)
    largest magnitudes of every chunk of the flattened tensor, values quantized to ``bits`` bits with
    a per-chunk scale, int16 positions inside the chunk; biased (use residual memory), fits
    allgather / allgather_fast.

    ``density``: fraction kept in every chunk (SparseLoCo: 1-3 %). ``chunk``: elements per chunk,
    8..65536 (positions travel as int16). ``bits``: 1, 2, 4, 8 (symmetric uniform levels scaled by
    the chunk's largest kept magnitude) or 32 (float32 values). See the module docstring for the
    payload layout and the differences from the reference.
    """

    additive = False
    fixed_size = True
    sparse = False
    rounds = 1
    biased = True
    default_communicator: ClassVar[str] = "allgather_fast"

    def __init__(self, density: float = 0.02, chunk: int = 4096, bits: int = 2):
        self._density = check_density(density)
        self.chunk = check_chunk(chunk)
        self.bits = check_bits(bits)
        self.workspace = Workspace()
        self.row_floors: dict[str, Tensor] = {}  # per tensor: the C selection's per-chunk floors, see _row_floors
        self._layouts: dict[tuple[Any, ...], ChunkCtx] = {}  # layout()'s at this density, by shape, dtype, device

    # ------------------------------------------------------------------ knobs
    def density(self) -> float | None:
        return self._density

    def set_density(self, density: float) -> None:
        self._density = check_density(density)
        self._layouts.clear()  # their k per chunk came from the old density (an adaptive policy's
        # density changes from step to step: keyed by it, the cache would grow without bound)

    # ------------------------------------------------------------------ layout
    def layout(self, shape: torch.Size, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> ChunkCtx:
        """The chunk layout of a tensor of ``shape`` under the current settings (made once per
        shape, dtype, device and settings: every compression and compensation asks for it)."""
        key = (tuple(shape), dtype, str(device), self.chunk, self.bits)  # the density: set_density clears
        got = self._layouts.get(key)
        if got is None:
            size = torch.Size(shape)
            n = int(size.numel())
            full, tail = divmod(n, self.chunk)
            got = self._layouts[key] = ChunkCtx(size, n, dtype, torch.device(device), self.chunk, full,
                                                k_for(self.chunk, self._density), tail,
                                                k_for(tail, self._density) if tail else 0, self.bits)
        return got

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        """Exact bytes of :meth:`compress`'s payload for ``shape`` (``itemsize`` does not matter:
        values travel as codes, or as float32 with ``bits = 32``)."""
        ctx = self.layout(shape)
        k = ctx.kept
        if self.bits == 32:
            return 4 * k + 2 * k
        return packed_bytes(k, self.bits) + 4 * ctx.chunks + 2 * k

    # ------------------------------------------------------------------ compress
    def compensate_into(self, g: Tensor, r: Tensor, out: Tensor, name: str) -> bool:
        """``out = g + r`` (error feedback's compensation, torch.add's bits) with every full chunk's
        selection in the same C pass, each chunk compensated just before it is read, kept for
        :meth:`compress` of ``out`` (the partial chunk gets the plain add). False (nothing written)
        where that pass cannot run: the caller adds."""
        return self._compensate(g, r, out, name, None)

    def _compensate(self, g: Tensor, r: Tensor, out: Tensor, name: str, owed: tuple[Tensor, Tensor] | None) -> bool:
        """:meth:`compensate_into`, with ``r`` read as ``r - value`` at the ``owed`` positions."""
        flat, gf, rf = flat_of(out), flat_of(g), flat_of(r)
        ctx = self.layout(out.shape, out.dtype, out.device)
        if (not ctx.full or not (_native.usable(flat) and _native.usable(gf) and _native.usable(rf))
                or not gf.numel() == rf.numel() == ctx.numel or flat.data_ptr() in (gf.data_ptr(), rf.data_ptr())):
            return False
        body = ctx.full * ctx.chunk
        in_body = owed
        if owed is not None and ctx.tail:  # (without a partial chunk every owed position is in the body)
            split = int(torch.searchsorted(owed[0], body))
            in_body, tail_pos, tail_vals = (owed[0][:split], owed[1][:split]), owed[0][split:], owed[1][split:]
        if ctx.tail:  # first: a torch write bumps the version the kept selection is checked against
            if not _native.add_into(gf[body:], rf[body:], flat[body:]):
                torch.add(gf[body:], rf[body:], out=flat[body:])
            if owed is not None and tail_pos.numel():  # the residual's subtraction, then the add
                flat[tail_pos] = gf[tail_pos] + (rf[tail_pos] - tail_vals)
        whole = not ctx.tail  # the body is the tensor: no views of it
        got = _native.chunk_topk(flat if whole else flat[:body], ctx.full, ctx.chunk, ctx.k_row,
                                 add=(gf, rf) if whole else (gf[:body], rf[:body]), owed=in_body,
                                 hint=self._row_floors(name, ctx.full))
        if got is not None:  # None: a NaN (the sum is written; torch's path selects)
            self._kept().keep(name, flat, got)
        return True

    def _row_floors(self, name: str, rows: int) -> Tensor:
        """Tensor ``name``'s per-chunk k-th magnitudes of the previous step (zeros at first): the C
        selection's candidate floors, a speed hint that never changes a payload, so it is neither
        checkpointed nor shared."""
        got = self.row_floors.get(name)
        if got is None or got.numel() != rows:
            got = self.row_floors[name] = torch.zeros(rows, dtype=torch.int32)
        return got

    def defer_residual(self, tensor: Tensor, payload: Payload, ctx: Any) -> Any:
        """The kept positions and decoded values, where the residual only subtracts them: the next
        compensation's chunk pass reads the stored tensor minus them (:meth:`compensate_owed`)
        instead of :meth:`residual` writing each (a write miss per kept value: GPT-2-small at 2 %,
        2.5M of them, ~27 ms a step on the Xeon)."""
        decoded = self._decoded(payload, ctx) if isinstance(ctx, ChunkCtx) and ctx.kept and ctx.full else None
        if decoded is None or not _native.usable(tensor) or not _native.ascending_within(decoded[0], ctx.numel):
            return None
        pos, vals = decoded
        return pos, vals.clone() if ctx.bits == 32 else vals  # 32 bits: the payload's own buffer

    def owed_residual(self, base: Tensor, token: Any, out: Tensor) -> Tensor:
        return self._subtracted(base, token, out)

    def compensate_owed(self, g: Tensor, base: Tensor, token: Any, out: Tensor, name: str) -> bool:
        """The compensation's chunk pass with the kept values subtracted from ``base`` as it is read."""
        return self._compensate(g, base, out, name, token)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        ctx = self.layout(tensor.shape, tensor.dtype, tensor.device)
        flat = flat_of(tensor)
        kept = self._kept().take(name, flat)  # the full chunks' selection from the compensation's pass
        idx_parts: list[Tensor] = []
        val_parts: list[Tensor] = []
        runs = []
        if ctx.full:
            runs.append((flat[:ctx.full * ctx.chunk].view(ctx.full, ctx.chunk), ctx.k_row))
        if ctx.tail:
            runs.append((flat[ctx.full * ctx.chunk:].view(1, -1), ctx.k_tail))
        for i, (body, k) in enumerate(runs):
            idx, vals = kept if i == 0 and ctx.full and isinstance(kept, tuple) else chunk_select(body, k)
            idx_parts.append(idx)
            val_parts.append(vals)
        if ctx.bits in _native.PACK_BITS and tensor.device.type == "cpu":
            got = self._encoded(idx_parts, val_parts, ctx)
            if got is not None:
                return got, ctx
        local = (torch.cat([i.reshape(-1) for i in idx_parts]) if idx_parts
                 else torch.zeros(0, dtype=torch.int64, device=tensor.device))
        if ctx.chunk > INT16_SPAN:
            local = torch.where(local < INT16_SPAN, local, local - 2 * INT16_SPAN)
        indices = local.to(torch.int16)
        if self.bits == 32:
            values = (torch.cat([v.reshape(-1) for v in val_parts]) if val_parts
                      else torch.zeros(0, dtype=torch.float32, device=tensor.device))
            return [values, indices], ctx
        quantized = [_scales_codes(v, self.bits) for v in val_parts]
        scales = [q[0] for q in quantized]
        codes = [q[1] for q in quantized]
        if codes:
            packed = pack_bits(torch.cat(codes), self.bits)
            scale_t = torch.cat(scales)
        else:
            packed = torch.zeros(0, dtype=torch.uint8, device=tensor.device)
            scale_t = torch.zeros(0, dtype=torch.float32, device=tensor.device)
        return [packed, scale_t, indices], ctx

    @staticmethod
    def _encoded(idx_parts: list[Tensor], val_parts: list[Tensor], ctx: ChunkCtx) -> Payload | None:
        """The payload of the runs' selections written by one C call a run (:func:`_native.chunk_encode`:
        scales, packed codes and int16 positions straight into the payload's tensors), bitwise the
        torch sequence of :meth:`compress` (four concatenations, a conversion, a quantization and a
        packing: ~25 us a tensor, more than the C work on small ones); None where that must run."""
        k = ctx.kept
        packed = torch.empty(packed_bytes(k, ctx.bits), dtype=torch.uint8)
        scales = torch.empty(ctx.chunks, dtype=torch.float32)
        indices = torch.empty(k, dtype=torch.int16)
        first, row = 0, 0
        for idx, vals in zip(idx_parts, val_parts):
            if not _native.chunk_encode(idx, vals, ctx.bits, first, packed, scales[row:], indices):
                return None
            first += idx.numel()
            row += idx.shape[0]
        return [packed, scales, indices]

    # ------------------------------------------------------------------ decompress
    def kept_values(self, payload: Payload, ctx: ChunkCtx) -> Tensor:
        """The dequantized kept values (float32, chunk by chunk) of any rank's payload."""
        k = ctx.kept
        if ctx.bits == 32:
            vals = payload[0].reshape(-1)
            if vals.numel() != k:
                raise ValueError(f"chunktopk payload has {vals.numel()} values but this tensor's layout keeps {k}: "
                                 "every rank must use the same density, chunk and bits")
            return vals
        codes, scales = payload[0].reshape(-1), payload[1].reshape(-1)
        if codes.numel() != packed_bytes(k, ctx.bits) or scales.numel() != ctx.chunks:
            raise ValueError(f"chunktopk payload does not match this tensor's layout (expected "
                             f"{packed_bytes(k, ctx.bits)} code bytes and {ctx.chunks} scales, got "
                             f"{codes.numel()} and {scales.numel()}): every rank must use the same "
                             "density, chunk and bits")
        levels = unit_levels(ctx.bits, codes.device)
        vals = torch.empty(k, dtype=torch.float32, device=codes.device)
        if not (codes.device.type == "cpu" and _native.decode(codes, ctx.bits, k, levels, vals)):  # one C pass
            vals = levels[unpack_bits(codes, ctx.bits, k).to(torch.int64)]
        nf = ctx.full * ctx.k_row
        if ctx.full:
            vals[:nf].view(ctx.full, ctx.k_row).mul_(scales[:ctx.full].unsqueeze(1))
        if ctx.tail:
            vals[nf:].mul_(scales[ctx.full])
        return vals

    def kept_positions(self, indices: Tensor, ctx: ChunkCtx) -> Tensor:
        """Flat positions (int64) of the kept values from the int16 local indices."""
        pos = indices.reshape(-1).to(torch.int64)
        if pos.numel() != ctx.kept:
            raise ValueError(f"chunktopk payload has {pos.numel()} indices but this tensor's layout keeps "
                             f"{ctx.kept}: every rank must use the same density, chunk and bits")
        if ctx.chunk > INT16_SPAN:
            pos.bitwise_and_(0xFFFF)
        nf = ctx.full * ctx.k_row
        if ctx.full:
            base = torch.arange(ctx.full, dtype=torch.int64, device=pos.device).mul_(ctx.chunk)
            pos[:nf].view(ctx.full, ctx.k_row).add_(base.unsqueeze(1))
        if ctx.tail:
            pos[nf:].add_(ctx.full * ctx.chunk)
        return pos

    fused_mean = True
    residual_in_place = True
    """:meth:`residual` changes only the kept coordinates, so error feedback may keep the compensated
    buffer itself as the residual."""

    def _decoded(self, payload: Payload, ctx: ChunkCtx) -> tuple[Tensor, Tensor] | None:
        """Flat positions (int64, ascending) and float32 values of a payload on the CPU, as
        :meth:`decompress` writes them (one C pass where it can); None where the fused paths must
        leave it to torch (another device or dtype, a subclass that decodes its own way, a kept
        -0.0, whose sign a sum from a +0 start would not keep)."""
        if (ctx.dtype != torch.float32 or ctx.device.type != "cpu"
                or type(self).decompress is not ChunkTopkCompressor.decompress):
            return None
        if ctx.bits != 32:
            got = _native.chunk_decode(payload[-1].reshape(-1), payload[0].reshape(-1), ctx.bits,
                                       payload[1].reshape(-1), unit_levels(ctx.bits), ctx.full, ctx.k_row,
                                       ctx.k_tail, ctx.chunk)
            if got is not None:
                return None if got[2] else (got[0], got[1])
        pos = self.kept_positions(payload[-1], ctx)
        vals = self.kept_values(payload, ctx).to(torch.float32)
        if bool(((vals == 0) & torch.signbit(vals)).any()):
            return None
        return pos, vals.contiguous()

    def packed_mean(self) -> str | None:
        return "chunk" if type(self).decompress is ChunkTopkCompressor.decompress else None  # as mean_into

    def mean_into(self, payloads: list[Payload], ctx: Any, out: Tensor) -> bool:
        """Every rank's kept values added into ``out`` in rank order and divided by the world size in
        one C pass (:func:`~adacomp.compressors._native.sparse_mean`): bitwise decompressing each
        (zeros + index_copy_), ``d0 + d1``, ``+= d_r`` and ``/ world``, without a dense tensor per
        rank. A position where every rank kept -0.0 is the only one whose sign could differ, so such
        payloads take the communicator's path."""
        if len(payloads) < 2 or not ctx.kept:
            return False
        if (ctx.bits != 32 and ctx.dtype == torch.float32 and ctx.device.type == "cpu"
                and type(self).decompress is ChunkTopkCompressor.decompress
                and _native.chunk_mean(out.view(-1), [(p[0].reshape(-1), p[1].reshape(-1), p[-1].reshape(-1))
                                                      for p in payloads], ctx.bits, unit_levels(ctx.bits), ctx.full,
                                       ctx.k_row, ctx.k_tail, ctx.chunk, len(payloads))):
            return True  # decoded slab by slab inside the mean's C call: the same bits
        decoded = [self._decoded(p, ctx) for p in payloads]
        if any(d is None for d in decoded):
            return False
        return _native.sparse_mean(out.view(-1), [d[0] for d in decoded if d is not None],
                                   [d[1] for d in decoded if d is not None], len(payloads))

    def residual(self, tensor: Tensor, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        """``tensor - decompress(payload)`` changing only the kept coordinates (elsewhere
        ``x - 0.0 = x``): a copy at most (none when ``out`` is ``tensor``) and one subtraction per
        kept value, bitwise the generic path's."""
        decoded = self._decoded(payload, ctx) if ctx.kept else None
        if decoded is None or not tensor.is_contiguous() or not out.is_contiguous() or tensor.dtype != torch.float32:
            return super().residual(tensor, payload, ctx, out)
        return self._subtracted(tensor, decoded, out)

    @staticmethod
    def _subtracted(tensor: Tensor, decoded: tuple[Tensor, Tensor], out: Tensor) -> Tensor:
        """``out = tensor`` with the decoded values subtracted at their positions."""
        pos, vals = decoded
        if out.data_ptr() != tensor.data_ptr():
            out.copy_(tensor)
        if not _native.sub_at(out.view(-1), out.view(-1), pos, vals):
            out.view(-1).index_copy_(0, pos, out.view(-1).index_select(0, pos).sub_(vals))
        return out

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        out = self._workspace().zeros(torch.Size([ctx.numel]), ctx.numel, ctx.dtype, ctx.device)
        if ctx.kept:
            pos = self.kept_positions(payload[-1], ctx).to(ctx.device)
            out.index_copy_(0, pos, self.kept_values(payload, ctx).to(device=ctx.device, dtype=ctx.dtype))
        return out.view(ctx.shape)

    def __repr__(self) -> str:
        return f"ChunkTopkCompressor(density={self._density}, chunk={self.chunk}, bits={self.bits})"
