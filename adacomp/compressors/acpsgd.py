"""ACP-SGD, alternate compressed PowerSGD (Zhang et al.; ACP-SGD paper Alg. 1 right, Alg. 2).

One factor per step and one allreduce per step, so the communication is additive and non-blocking
like dense S-SGD and can start from the gradient hook (WFBP, §IV-B):

* P-steps (the 1st, 3rd, ... compressed step): ``Q_hat = orth(Q_{t-1})``, payload
  ``P = (M + E) Q_hat``; the step's gradient is ``P_mean Q_hat^T``.
* Q-steps (2nd, 4th, ...): ``P_hat = orth(P_{t-1})``, payload ``Q = (M + E)^T P_hat``; the
  gradient is ``P_hat Q_mean^T``.

``M + E`` is what the memory hands in (``residual`` memory = Alg. 2's E, zero at start). The error is
updated with the *local* approximation before aggregation (Alg. 2 lines 6 / 11): the communicator
updates single-round memory with this rank's own payload, and :meth:`decompress` rebuilds
``P Q_hat^T`` / ``P_hat Q^T`` from whichever payload it gets and the stored other factor, which is
identical on every rank. The aggregated factor is kept as ``P_{t-1}`` / ``Q_{t-1}`` for the next
step (reuse). Sent per matrix and step: ``n r`` or ``m r`` elements, half of PowerSGD's.

Differences from the authors' code (lzhangbv/acpsgd), each deliberate:

* Initial P_0, Q_0 come from a generator seeded by ``(seed, name)``; the authors' code draws them
  from the unseeded global RNG (replicas disagree unless the caller seeds it).
* Tensors failing ``min_compression_rate`` also travel dense (the authors compress every matrix);
  set ``min_compression_rate: 0`` to match them. Vectors always travel dense, as there.
* Factors are averaged (the communicator's mean) instead of summed; orthogonalisation is scale free
  and ``P Q^T`` then needs no division by the world size.
* ``start_iter`` dense warm-up steps (default 0, as in the paper).

Fits ``allreduce`` only: the aggregated factor is recognised as the payload that is not the tensor
this rank sent, which holds for a communicator that decompresses only the mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from adacomp.compressors._lowrank import (LowRankCompressor, as_matrix_shape, orthogonalize, outer_product,
                                          product, residual_of_product, transposed_product)
from adacomp.compressors.base import Payload, register


@dataclass
class ACPSGDCtx:
    """``kind``: ``"p"`` (sent P; ``other`` = Q_hat), ``"q"`` (sent Q; ``other`` = P_hat) or
    ``"dense"``. ``other`` comes from aggregated factors, so it is identical on every rank."""

    name: str
    shape: torch.Size
    kind: str
    other: Tensor | None = None
    sent: Tensor | None = None


@register("acpsgd")
class ACPSGDCompressor(LowRankCompressor):
    """ACP-SGD with error feedback and reuse. Parameters: see :class:`LowRankCompressor`
    (``rank`` 4 as in §V, ``min_compression_rate`` 2, ``start_iter`` 0,
    ``orthogonalization_epsilon`` 0, ``seed`` 0). Pair with ``residual`` memory (Alg. 2; Fig. 7
    shows it does not converge well without) and ``fusion.compressed_buffer: true`` (§IV-B)."""

    rounds = 1

    def __init__(self, rank: int = 4, min_compression_rate: float = 2.0, start_iter: int = 0,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0):
        super().__init__(rank, min_compression_rate, start_iter, orthogonalization_epsilon, seed)
        self.p: dict[str, Tensor] = {}  # P_{t-1}: aggregated P after a P-step, P_hat after a Q-step
        self.q: dict[str, Tensor] = {}  # Q_{t-1}: aggregated Q after a Q-step, Q_hat after a P-step

    def p_step(self) -> bool:
        """Whether the coming step sends P (odd compressed steps of Alg. 2, counted from start_iter)."""
        return (self.step - self.start_iter) % 2 == 0

    def _previous(self, store: dict[str, Tensor], name: str, which: str, rows: int, r: int,
                  like: Tensor) -> Tensor:
        f = store.get(name)
        if f is None or tuple(f.shape) != (rows, r):
            f = self.initial_factor(name, which, rows, r, like)
        return f.to(device=like.device, dtype=like.dtype)

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        if self.warming_up() or not self.compresses(tensor.shape):
            return [tensor], ACPSGDCtx(name, tensor.shape, "dense")
        n, m = as_matrix_shape(tensor.shape)
        r = self.matrix_rank(tensor.shape)
        matrix = tensor.reshape(n, m)
        eps = self.orthogonalization_epsilon
        if self.p_step():
            q_hat = orthogonalize(self._previous(self.q, name, "q", m, r, tensor), eps)
            sent = product(matrix, q_hat)
            self.q[name], self.p[name] = q_hat, sent  # sent P stands in until the mean arrives
            return [sent], ACPSGDCtx(name, tensor.shape, "p", q_hat, sent)
        p_hat = orthogonalize(self._previous(self.p, name, "p", n, r, tensor), eps)
        sent = transposed_product(matrix, p_hat)
        self.p[name], self.q[name] = p_hat, sent
        return [sent], ACPSGDCtx(name, tensor.shape, "q", p_hat, sent)

    def _factors(self, payload: Payload, ctx: ACPSGDCtx) -> tuple[Tensor, Tensor]:
        """(P, Q) of the approximation ``payload`` stands for; a mean over ranks is kept for the
        next step (Alg. 2 lines 4 / 9)."""
        f = payload[0]
        if f is not ctx.sent:
            (self.p if ctx.kind == "p" else self.q)[ctx.name] = f.detach().clone()
        assert ctx.other is not None  # set for "p" and "q" contexts
        return (f, ctx.other) if ctx.kind == "p" else (ctx.other, f)

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        c: ACPSGDCtx = ctx
        if c.kind == "dense":
            return payload[0].view(c.shape)
        return outer_product(*self._factors(payload, c), self._workspace()).view(c.shape)

    def residual(self, tensor: Tensor, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        """``tensor - P Q^T`` of this rank's own factor (error feedback, Alg. 2) with the products
        formed in registers and never written where that gives the written product's bits."""
        c: ACPSGDCtx = ctx
        if c.kind == "dense" or not (tensor.is_contiguous() and out.is_contiguous()):
            return super().residual(tensor, payload, ctx, out)
        n, m = as_matrix_shape(c.shape)
        p, q = self._factors(payload, c)
        residual_of_product(tensor.reshape(n, m), p, q, out.view(n, m), self._workspace())
        return out

    def _residual_factors(self, payload: Payload, ctx: Any) -> tuple[Tensor, Tensor] | None:
        """(P, Q) of this rank's own factor, as :meth:`residual` takes them."""
        c: ACPSGDCtx = ctx
        if not isinstance(c, ACPSGDCtx) or c.kind == "dense":
            return None
        return self._factors(payload, c)

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        """Bytes per step averaged over a P-step and a Q-step: ``(n + m) r / 2`` elements, so one
        fusion plan serves both kinds of step (the paper plans P and Q buffers separately, §IV-B)."""
        if not self.compresses(shape):
            return int(torch.Size(shape).numel()) * itemsize
        n, m = as_matrix_shape(shape)
        return (n + m) * self.matrix_rank(shape) * itemsize // 2

    def state_dict(self) -> dict[str, Any]:
        return {**self._base_state(),
                "p": {k: v.detach().clone() for k, v in self.p.items()},
                "q": {k: v.detach().clone() for k, v in self.q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_base_state(state)
        self.p = {k: v.clone() for k, v in state.get("p", {}).items()}
        self.q = {k: v.clone() for k, v in state.get("q", {}).items()}
