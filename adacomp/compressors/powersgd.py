"""PowerSGD (Vogels et al. 2019; ACP-SGD paper Alg. 1, left): one power-iteration step per
optimizer step, two communication rounds driven by the communicator.

Round 0: ``P = M Q_{t-1}``, allreduce (mean). Round 1 (:meth:`next_round`): ``P_hat = orth(P_mean)``,
``Q = M^T P_hat``, allreduce (mean). Then ``decompress([Q_mean]) = P_hat Q_mean^T``, which the
``residual`` memory subtracts from the compensated gradient (error feedback ``M - P_hat Q_mean^T``,
as in PowerSGD and PyTorch's hook), and ``Q_mean`` is kept for the next step (warm start / reuse).

Payload: one dense factor per round, so it is additive and fits the ``allreduce`` communicator.
Biased: pair it with ``residual`` memory. Sent per matrix and step: ``(n + m) r`` elements.

Differences from PyTorch's ``powerSGD_hook`` (all stated so results can be compared):

* ``Q_{t-1}`` is reused as is (Alg. 1); the hook orthogonalises it first. Both give the same
  ``P_hat`` in exact arithmetic because ``orth(M Q) = orth(M Q R^{-1})``.
* Tensors that are not compressed (vectors, matrices failing ``min_compression_rate``, everything
  during ``start_iter``) send their dense values in round 0 and an empty tensor in round 1, so every
  bucket runs the same two rounds on every rank. Their error feedback is, as in the hook,
  ``local - mean``: a zero-mean term that never changes the averaged gradient.
* ``start_iter`` defaults to 0 (the hook's ``start_powerSGD_iter`` is 1000 and must be > 1 only
  because of DDP's bucket rebuild, which adacomp does not have).
* Initial ``Q`` is drawn per tensor from a generator seeded by ``(seed, name)``, not a shared stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from adacomp.compressors._lowrank import (LowRankCompressor, as_matrix_shape, orthogonalize, outer_product,
                                          owed_with_product, product, transposed_product)
from adacomp.compressors.base import Payload, register


@dataclass
class PowerSGDCtx:
    """Local state of one tensor during one step. ``p_hat`` / ``dense_mean`` come from aggregated
    values, so they are identical on every rank (the base-class rule for ctx)."""

    name: str
    shape: torch.Size
    dense: bool
    matrix: Tensor | None = None       # compensated gradient as n x m (round 1 needs it)
    p_hat: Tensor | None = None        # orth(P_mean), set in round 1
    dense_mean: Tensor | None = None   # uncompressed tensors: round 0's mean
    approx: tuple[Tensor, Tensor] | None = None  # (Q_mean, P_hat Q_mean^T): memory + output share it


@register("powersgd")
class PowerSGDCompressor(LowRankCompressor):
    """PowerSGD with warm start. Parameters: see :class:`LowRankCompressor` (``rank`` 4,
    ``min_compression_rate`` 2, ``start_iter`` 0, ``orthogonalization_epsilon`` 0, ``seed`` 0).
    Tuning: rank 1-4 for CNNs (PowerSGD paper), higher for transformers; raise ``start_iter`` to
    the LR warm-up length if early training is unstable."""

    rounds = 2

    def __init__(self, rank: int = 4, min_compression_rate: float = 2.0, start_iter: int = 0,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0):
        super().__init__(rank, min_compression_rate, start_iter, orthogonalization_epsilon, seed)
        self.q: dict[str, Tensor] = {}

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        if self.warming_up() or not self.compresses(tensor.shape):
            # a copy: the communicator may reduce in place, and memory still needs ``tensor``
            return [tensor.reshape(-1).clone()], PowerSGDCtx(name, tensor.shape, dense=True)
        n, m = as_matrix_shape(tensor.shape)
        r = self.matrix_rank(tensor.shape)
        matrix = tensor.reshape(n, m)
        q = self.q.get(name)
        if q is None or tuple(q.shape) != (m, r):
            q = self.initial_factor(name, "q", m, r, tensor)
        kept = self._kept().take(name, matrix)  # round 0's product from the compensation's pass
        p = kept if isinstance(kept, Tensor) else product(matrix, q.to(device=tensor.device, dtype=tensor.dtype))
        return [p], PowerSGDCtx(name, tensor.shape, dense=False, matrix=matrix)

    def compensate_owed(self, g: Tensor, base: Tensor, token: Any, out: Tensor, name: str) -> bool:
        """The owed compensation with round 0's ``P = M Q`` from the same pass (kept for
        :meth:`compress`), where ``Q`` is the warm start :meth:`compress` will take."""
        q = self.q.get(name)
        if (q is not None and not self.warming_up() and self.compresses(g.shape)
                and tuple(q.shape) == (token.q.shape[0], self.matrix_rank(g.shape))):
            p = owed_with_product(g, base, token, out, q)
            if p is not None:
                self._kept().keep(name, out.view(token.p.shape[0], token.q.shape[0]), p)
                return True
        return super().compensate_owed(g, base, token, out, name)

    def next_round(self, round_index: int, mean_payload: Payload, ctx: Any) -> tuple[Payload, Any]:
        if round_index != 1:
            raise ValueError(f"powersgd has rounds 0 and 1, got next_round({round_index})")
        c: PowerSGDCtx = ctx
        if c.dense:
            c.dense_mean = mean_payload[0]
            return [mean_payload[0].new_empty(0)], c
        c.p_hat = orthogonalize(mean_payload[0], self.orthogonalization_epsilon)
        q = transposed_product(c.matrix, c.p_hat)  # type: ignore[arg-type]
        c.matrix = None  # round 1 was its last use; do not keep the gradient alive through ctx
        return [q], c

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        c: PowerSGDCtx = ctx
        if c.dense:
            if c.dense_mean is None:
                raise ValueError("powersgd: decompress before round 1; the communicator must run "
                                 f"both rounds ({self.rounds}) before decompressing")
            return c.dense_mean.view(c.shape)
        if c.p_hat is None:
            raise ValueError("powersgd: decompress before round 1 (P_hat unknown); run next_round first")
        q = payload[0]
        if c.approx is not None and c.approx[0] is q:  # memory.update and the output use the same mean
            return c.approx[1]
        self.q[c.name] = q.detach().clone()  # Q_{t-1} of the next step (warm start)
        out = outer_product(c.p_hat, q, self._workspace()).view(c.shape)
        c.approx = (q, out)
        return out

    def _residual_factors(self, payload: Payload, ctx: Any) -> tuple[Tensor, Tensor] | None:
        """(P_hat, Q_mean): the residual is against the mean approximation every rank applies."""
        c: PowerSGDCtx = ctx
        if not isinstance(c, PowerSGDCtx) or c.dense or c.p_hat is None or len(payload) != 1:
            return None
        return c.p_hat, payload[0]

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        if not self.compresses(shape):
            return int(torch.Size(shape).numel()) * itemsize
        n, m = as_matrix_shape(shape)
        return (n + m) * self.matrix_rank(shape) * itemsize

    def state_dict(self) -> dict[str, Any]:
        return {**self._base_state(), "q": {k: v.detach().clone() for k, v in self.q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
        self.q = {k: v.clone() for k, v in state.get("q", {}).items()}
