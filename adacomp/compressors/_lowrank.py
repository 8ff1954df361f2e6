"""Shared pieces of the low-rank compressors ``powersgd`` and ``acpsgd`` (ACP-SGD paper, Alg. 1-2).

Both view a gradient as a matrix ``M`` of shape ``(shape[0], -1)`` (a conv weight
``[out, in, kh, kw]`` becomes ``out x in*kh*kw``, as in PowerSGD and PyTorch's hook) and approximate
it by ``P Q^T`` with ``P: n x r`` and ``Q: m x r``. What they share lives here: the bypass rule, the
orthogonalisation, the seeded initial factors and the step counter.
"""
from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import torch
from torch import Tensor

from adacomp.compressors import _native
from adacomp.compressors.base import Compressor, Payload
from adacomp.compressors.workspace import Workspace


def as_matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """``(n, m)`` of the matrix view ``(shape[0], -1)``; ``(numel, 1)`` for scalars and vectors."""
    shape = torch.Size(shape)
    if len(shape) < 2:
        return int(shape.numel()), 1
    return int(shape[0]), int(shape.numel() // max(shape[0], 1))


ROW_BLOCK = 256
"""Rows of ``P Q^T`` written per product: a block of the output stays in cache while it is
written (GPT-2-small's 50257 x 768 embedding: 34 ms in one product, 18 ms in blocks, same bits)."""

OUTER_MIN_NUMEL = 1 << 16
"""Smaller ``P Q^T`` products stay one torch call (the workspace and the per-layout check cost more)."""

_EXACT: dict[tuple, bool] = {}
"""Per product layout (shapes, strides, alignment, dtype, threads): whether the faster formulation
gave torch's own bits when it was first met (None: not decided yet)."""

_ORDER: dict[tuple, int] = {}
"""Per layout judged exact: the summation order (:data:`_native.SEQ_BLOCKS`) that gave torch's bits."""


def _same_bits(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _exact_or_reference(key: tuple, fast: Any, reference: Any, inputs: tuple[Tensor, ...],
                        orders: tuple[int, ...] = (0,)) -> Tensor:
    """``fast(order)`` where it was seen to give ``reference()``'s bits for this layout, else
    ``reference()``. The first call of a layout runs the reference and each candidate order, and
    decides where none or exactly one gives its bits (a non-finite input, or one that several
    orders reproduce, decides nothing): the BLAS kernel torch picks, and so its summation order,
    depends on the machine (one chain on the EPYC, MKL's 384-term blocks of fma chains on an
    AVX-512 Xeon), so the equality is checked where it runs rather than assumed."""
    ok = _EXACT.get(key)
    if ok:
        return fast(_ORDER.get(key, 0))
    out = reference()
    if ok is None and all(bool(torch.isfinite(t).all()) for t in inputs):
        matching = [order for order in orders if _same_bits(fast(order), out)]
        if len(matching) <= 1:  # several: an input that tells the orders apart decides (an all-zero M does not)
            if matching:
                _ORDER[key] = matching[0]  # before _EXACT: another thread that sees True reads the order
            _EXACT[key] = bool(matching)
    return out


def _orders(matrix: Tensor, f: Tensor) -> tuple[int, ...]:
    """The orders a product's first call tries: all of :data:`_native.SEQ_BLOCKS` where the C sums
    serve, else one (the fallback is torch's product in every order: several matching would leave
    the layout undecided, re-deciding on every call)."""
    return _native.SEQ_BLOCKS if _native.seq_serves(matrix, f) else (0,)


def _layout(tag: str, *ts: Tensor) -> tuple:
    """The key of a product's decision: its inputs' layout, the thread count and whether the C
    library serves (the fast path is another kernel without it)."""
    return (tag, torch.get_num_threads(), _native.library() is not None) + tuple(
        (tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % 64) for t in ts)


def transposed_product(matrix: Tensor, f: Tensor) -> Tensor:
    """``matrix.t() @ f`` (``M^T P``: Q in PowerSGD's round 1, ACP-SGD's Q step), bitwise.

    On CPU torch.mv forms each column of the product as a sum from +0 down the columns of M, product
    then addition, in row order; :func:`_native.mtm_seq` forms all r columns that way in one read of
    M (GPT-2-small's embedding at r 4: 4.1 -> 0.9 memory floors), else one matrix-vector product
    per column (r reads of M; still 5-10x faster than the (T, N) kernel torch picks for a narrow
    right-hand side). Checked per layout (:func:`_exact_or_reference`)."""
    if matrix.device.type != "cpu" or matrix.dim() != 2 or f.dim() != 2 or f.shape[1] < 2:
        return matrix.t() @ f

    def by_columns(order: int) -> Tensor:
        fast = _native.mtm_seq(matrix, f, order)
        if fast is not None:
            return fast
        mt = matrix.t()
        rows = torch.empty(f.shape[1], matrix.shape[1], dtype=torch.result_type(matrix, f))
        for j in range(f.shape[1]):
            torch.mv(mt, f[:, j].contiguous(), out=rows[j])
        return rows.t().contiguous()

    return _exact_or_reference(_layout("tp", matrix, f), by_columns, lambda: matrix.t() @ f, (matrix, f),
                               _orders(matrix, f))


def product(matrix: Tensor, q: Tensor) -> Tensor:
    """``matrix @ q`` (``M Q``: P in PowerSGD's round 0, ACP-SGD's P step), bitwise: on CPU by
    :func:`_native.mm_seq` (each output a sum from +0 along the row, product then addition, as
    torch's matmul formed it for a narrow Q: one read of M, 4-8x faster), where that was seen to
    give torch's bits for the layout (:func:`_exact_or_reference`)."""
    if matrix.device.type != "cpu" or matrix.dim() != 2 or q.dim() != 2 or q.shape[1] < 2 or not q.is_contiguous():
        return matrix @ q  # (a column-major Q, as QR returns it, takes another torch kernel: never the same bits)

    def by_rows(order: int) -> Tensor:
        fast = _native.mm_seq(matrix, q, order)
        return fast if fast is not None else matrix @ q

    return _exact_or_reference(_layout("mq", matrix, q), by_rows, lambda: matrix @ q, (matrix, q), _orders(matrix, q))


def outer_product(p: Tensor, q: Tensor, workspace: Workspace) -> Tensor:
    """``p @ q.t()`` (the rank-r approximation ``P Q^T``), bitwise, into a recycled output (no page
    faults on a fresh model-size tensor each step; :class:`~adacomp.compressors.workspace.Workspace`'s
    rule): by the C fma chains of :func:`_native.outer_fma` (MKL's own order on x86 with FMA), else
    in blocks of :data:`ROW_BLOCK` rows. Checked per layout."""
    n, m = p.shape[0], q.shape[0]
    if p.device.type != "cpu" or n * m < OUTER_MIN_NUMEL:
        return p @ q.t()

    def blocked(_order: int) -> Tensor:  # one order: MKL's fma chain over the rank
        out = workspace.output(torch.Size([n, m]), n * m, torch.result_type(p, q), p.device)
        if _native.outer_fma(p, q, out):  # one C pass at write speed (MKL's fma chain; ~2x the blocks)
            return out
        qt = q.t()
        for i in range(0, n, ROW_BLOCK):
            torch.mm(p[i:i + ROW_BLOCK], qt, out=out[i:i + ROW_BLOCK])
        return out

    return _exact_or_reference(_layout("pq", p, q), blocked, lambda: p @ q.t(), (p, q))


FUSED_SUB_MAX_RANK = 8
"""Where :func:`residual_of_product` forms the products in registers: ranks it unrolls (every width:
wide matrices past the caches, VGG-16's fc6 with 25088 columns, take C's four-row loop, 0.28 ns per
element against 0.49 through the written product)."""


def fuses_residual(p: Tensor, q: Tensor) -> bool:
    """Whether :func:`outer_product` of ``p``, ``q`` takes the C fma chains (seen to give torch's
    bits for this layout), so the residual can form the products again in registers."""
    return (p.device.type == "cpu" and p.shape[0] * q.shape[0] >= OUTER_MIN_NUMEL and p.shape[1] <= FUSED_SUB_MAX_RANK
            and bool(_EXACT.get(_layout("pq", p, q))))


def residual_of_product(a: Tensor, p: Tensor, q: Tensor, out: Tensor, workspace: Workspace) -> Tensor:
    """``out = a - p @ q.t()``, bitwise ``torch.sub(a, outer_product(p, q, workspace), out=out)``:
    where :func:`outer_product` takes the C fma chains for this layout (seen to give torch's bits),
    the products are formed again in registers and never written (error feedback of a rank-r
    approximation that is not needed otherwise: one write and one read of the model less)."""
    if fuses_residual(p, q) and _native.outer_fma_sub(a, p, q, out):
        return out
    return torch.sub(a, outer_product(p, q, workspace), out=out)


def owed_with_product(g: Tensor, base: Tensor, token: "FactorsOwed", out: Tensor, q: Tensor) -> Tensor | None:
    """``out = g + (base - P Q^T)`` (the owed residual, as ``compensate_owed``) and, from the same
    pass, ``product(out, q)`` where that product takes the C sums for this layout (seen to give
    torch's bits): the compensated matrix is not read again for the first product. None (nothing
    written) where it cannot: the caller compensates and multiplies apart."""
    n, m = token.p.shape[0], token.q.shape[0]
    matrix = out.view(n, m)
    if (q.dim() != 2 or q.shape[0] != m or q.shape[1] < 2 or not q.is_contiguous() or g.numel() != n * m
            or not g.is_contiguous()):
        return None
    key = _layout("mq", matrix, q)
    if not _EXACT.get(key):
        return None
    return _native.owed_mm(g.view(n, m), base.view(n, m), token.p, token.q, matrix, q, _ORDER.get(key, 0))


class FactorsOwed(NamedTuple):
    """A low-rank residual ``base - p @ q.t()`` left to the next compensation (copies of the factors:
    the originals may be views of a communication buffer)."""

    p: Tensor
    q: Tensor


def orthogonalize(x: Tensor, epsilon: float = 0.0) -> Tensor:
    """Orthonormal basis of the columns of ``x`` (``n x r``), returned as a new tensor.

    Rank <= 2 uses Gram-Schmidt (cheaper than a QR call; PyTorch's hook makes the same choice) with
    ``col / (norm + epsilon)``; with ``epsilon == 0`` an all-zero column stays zero instead of
    becoming NaN (the hook would give NaN there).
    Larger ranks use reduced QR (``torch.linalg.qr``, §IV-C), which never divides by a norm.
    Half-precision inputs are orthogonalised in float32 (QR has no half kernels) and cast back.
    """
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if work.shape[1] <= 2:
        cols: list[Tensor] = []
        for i in range(work.shape[1]):
            c = work[:, i].clone()
            for prev in cols:
                c -= torch.dot(prev, c) * prev
            norm = torch.linalg.vector_norm(c)
            # epsilon 0 (the hook's default) still must not turn an all-zero column into NaN
            c = c / (norm + epsilon) if epsilon > 0 else c / norm.clamp_min(torch.finfo(c.dtype).tiny)
            cols.append(c)
        out = torch.stack(cols, dim=1)
    else:
        out = torch.linalg.qr(work, mode="reduced").Q
    return out.to(x.dtype)


def name_seed(seed: int, name: str) -> int:
    """Seed of a tensor's initial factors: depends on the compressor's ``seed`` and the tensor name
    only (crc32, stable across processes unlike ``hash``), so every rank draws the same factors
    whatever order tensors are first seen in, and per-parameter compressor instances agree too."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (2 ** 63 - 1)


class LowRankCompressor(Compressor):
    """Base of ``powersgd`` and ``acpsgd``: parameters, bypass rule, factors, step counter.

    Parameters (names follow the ACP-SGD paper / PyTorch's ``PowerSGDState``):

    * ``rank``: the approximation rank r (paper default 4); clamped to ``min(n, m)`` per tensor.
    * ``min_compression_rate``: compress an ``n x m`` matrix only if ``(n + m) r * rate < n m``
      (PyTorch hook, default 2); other tensors, and all 0-/1-D tensors, travel dense.
    * ``start_iter``: number of initial steps that send every tensor dense (the hook's
      ``start_powerSGD_iter``; its default 1000 is not ours: neither paper has a dense warm-up,
      so the default is 0).
    * ``orthogonalization_epsilon``: guard added to column norms in Gram-Schmidt (rank <= 2).
    * ``seed``: seeds the compressor's own generator for the initial random factors.
    """

    additive = True
    fixed_size = True
    sparse = False
    residual_in_place = True
    """The residual is elementwise in the compensated tensor, so it may overwrite it: error feedback
    compensates into a buffer of its own and keeps it, which lets the residual be left to the next
    compensation (:meth:`defer_residual`)."""

    def _residual_factors(self, payload: Payload, ctx: Any) -> tuple[Tensor, Tensor] | None:
        """(P, Q) with ``residual = tensor - P Q^T`` for this payload, or None (a dense tensor)."""
        return None

    def defer_residual(self, tensor: Tensor, payload: Payload, ctx: Any) -> Any:
        """Keep the compensated matrix and copies of the factors; the next compensation subtracts
        ``P Q^T`` formed in registers (the fma chains the written product has, then torch's add):
        the residual's read and write of the model are saved. Only where that chain is the
        product's own (:func:`fuses_residual`)."""
        factors = self._residual_factors(payload, ctx)
        if factors is None or not _native.usable(tensor):
            return None
        p, q = factors
        if p.shape[0] * q.shape[0] != tensor.numel() or not fuses_residual(p, q):
            return None
        return FactorsOwed(p.detach().contiguous().clone(), q.detach().contiguous().clone())

    def owed_residual(self, base: Tensor, token: Any, out: Tensor) -> Tensor:
        """The chains themselves (they were the product's bits when deferred; the copies' layout is
        another key), torch's product only where the library is gone since."""
        n, m = token.p.shape[0], token.q.shape[0]
        if not _native.outer_fma_sub(base.view(n, m), token.p, token.q, out.view(n, m)):
            residual_of_product(base.view(n, m), token.p, token.q, out.view(n, m), self._workspace())
        return out

    def compensate_owed(self, g: Tensor, base: Tensor, token: Any, out: Tensor, name: str) -> bool:
        """``out = g + (base - P Q^T)`` in one C pass (:func:`_native.outer_fma_sub` with ``g``)."""
        n, m = token.p.shape[0], token.q.shape[0]
        if g.numel() != n * m or not g.is_contiguous():
            return False
        return _native.outer_fma_sub(base.view(n, m), token.p, token.q, out.view(n, m), g=g.view(n, m))

    def __init__(self, rank: int = 4, min_compression_rate: float = 2.0, start_iter: int = 0,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0):
        self.rank = self._check_rank(rank)
        if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)) \
                or min_compression_rate < 0:
            raise ValueError(f"min_compression_rate must be a number >= 0, got {min_compression_rate!r}; "
                             "use 2 (PyTorch's default) or 0 to compress every matrix")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}")
        if not isinstance(orthogonalization_epsilon, (int, float)) or orthogonalization_epsilon < 0:
            raise ValueError(f"orthogonalization_epsilon must be >= 0, got {orthogonalization_epsilon!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.min_compression_rate = float(min_compression_rate)
        self.start_iter = int(start_iter)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.seed = int(seed)
        self.step = 0  # completed optimizer steps (on_step)
        self._gen = torch.Generator(device="cpu")

    @staticmethod
    def _check_rank(rank: Any) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {rank!r}; PowerSGD / ACP-SGD use 1-4 for "
                             "CNNs and 32+ for large transformers")
        return rank

    # Which tensors are compressed ---------------------------------------------------------------
    def matrix_rank(self, shape: torch.Size) -> int:
        n, m = as_matrix_shape(shape)
        return min(self.rank, n, m)

    def compresses(self, shape: torch.Size) -> bool:
        """True when a tensor of ``shape`` is sent as factors (shape rule only, warm-up aside)."""
        if len(torch.Size(shape)) < 2:
            return False
        n, m = as_matrix_shape(shape)
        return (n + m) * self.matrix_rank(shape) * self.min_compression_rate < n * m

    def warming_up(self) -> bool:
        return self.step < self.start_iter

    def set_rank(self, rank: int) -> None:
        """Change r between steps (per-layer rank policies); factors of the old rank are redrawn."""
        self.rank = self._check_rank(rank)

    # Factors --------------------------------------------------------------------------------------
    def initial_factor(self, name: str, which: str, rows: int, r: int, like: Tensor) -> Tensor:
        """i.i.d. standard normal ``rows x r`` factor (Alg. 2: P_0, Q_0 ~ N(0, 1)), identical on all
        ranks; drawn on CPU from the compressor's own generator, then moved to ``like``'s device."""
        self._gen.manual_seed(name_seed(self.seed, f"{name}/{which}"))
        out = torch.randn(rows, r, generator=self._gen, dtype=torch.float32)
        return out.to(device=like.device, dtype=like.dtype)

    def on_step(self, step: int) -> None:
        self.step = int(step)

    def _base_state(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "seed": self.seed}

    def _load_base_state(self, state: dict[str, Any]) -> None:
        self.step = int(state.get("step", 0))
        self.rank = self._check_rank(int(state.get("rank", self.rank)))
        self.seed = int(state.get("seed", self.seed))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, min_compression_rate={self.min_compression_rate}, "
                f"start_iter={self.start_iter}, seed={self.seed})")
