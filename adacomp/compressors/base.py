"""Compressor contract and the registry every gradient compressor plugs into.

A compressor turns one tensor into a *payload* (a list of tensors that travels between ranks) and a
*ctx* (stays local). It never calls a collective: the communicator moves payloads, and for methods
with several communication rounds (PowerSGD's P then Q) the communicator drives the rounds through
:meth:`Compressor.next_round`.

Rules every implementation follows:

* ``ctx`` may depend only on the tensor's shape / dtype / device and on state that is identical on
  every rank, because a communicator may decompress *another* rank's payload with this rank's ctx
  (allgather).
* Sparse compressors (``sparse = True``) return ``payload == [values, indices]`` with indices into the
  flattened tensor; ``decompress`` scatters into zeros.
* Per-tensor state (thresholds, factors, counters) is keyed by the tensor name and exposed through
  :meth:`state_dict` / :meth:`load_state_dict` so a resumed run equals an uninterrupted one.
* Random compressors own a ``torch.Generator``; the global RNG is never touched.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from adacomp.compressors import _native
from adacomp.compressors.workspace import Kept, Workspace
from adacomp.registry import Registry

registry: Registry["Compressor"] = Registry("compressor", "adacomp.compressors")
register = registry.register

Payload = list[Tensor]


class Compressor:
    """Base class: subclasses set the capability flags and implement compress / decompress.

    Capability flags (class data, checked when the optimizer is built):

    * ``additive``: payloads of all ranks may be summed element-wise (allreduce-compatible).
    * ``fixed_size``: payload sizes depend only on the tensor shape, never on its values
      (``allgather_fast`` needs this).
    * ``sparse``: payload is ``[values, indices]``.
    * ``rounds``: number of communication rounds (PowerSGD has 2).
    * ``biased``: E[decompress(compress(g))] != g; ``memory: auto`` then picks ``residual`` error
      feedback (unbiased ones such as qsgd get no memory by default).
    * ``granularity``: ``"tensor"`` compresses each parameter's gradient, ``"bucket"`` compresses the
      flattened gradient of a whole fusion bucket (gtopk, oktopk: one selection over many layers).
    * ``elementwise``: each output element depends on its input element only (the casts), so
      compressing a bucket's flattened gradient gives the same bits as compressing each tensor;
      ``fusion.fuse_before_compress`` left unset then fuses (one call per bucket, not per tensor: on
      an H100 the per-tensor casts added 1.3-3x the fused ones' time to a step, docs/results/cuda.md).
    """

    name: ClassVar[str] = "base"
    additive: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True
    sparse: ClassVar[bool] = False
    rounds: ClassVar[int] = 1
    biased: ClassVar[bool] = True
    granularity: ClassVar[str] = "tensor"
    elementwise: ClassVar[bool] = False

    def _workspace(self) -> Workspace:
        """Recycled scratch and output buffers (:class:`Workspace`; CPU): a fresh multi-MB tensor
        per call costs more in page faults than most passes over it. Created on first use, so
        subclasses that skip ``__init__`` and unpickled compressors get one too; never state."""
        ws = self.__dict__.get("workspace")
        if ws is None:
            ws = self.workspace = Workspace()
        return ws

    def _kept(self) -> Kept:
        """What a fused compensation pass found for the next call on a tensor (:class:`Kept`);
        created on first use like the workspace, never state."""
        kept = self.__dict__.get("kept")
        if kept is None:
            kept = self.kept = Kept()
        return kept

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement compress()")

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement decompress()")

    fused_mean: ClassVar[bool] = False
    """True when :meth:`mean_into` may serve (communicators then offer it an output buffer)."""

    def packed_mean(self) -> str | None:
        """The payload layout whose mean over ranks ``allgather.aggregate_gathered`` may take for a
        whole bucket in one C call, reading the gathered bytes in place, bitwise :meth:`mean_into`
        (``"signs"``: a float32 scale and 1-bit signs decoded to -scale / +scale; ``"qsgd"``: float32
        bucket norms and packed codes decoded to (norm / s) * (code - s); ``"chunk"``: Chunk-Top-k's
        codes, per-chunk scales and int16 positions); None (the
        default): one entry at a time. Sparse payloads are batched by their own rule."""
        return None

    def mean_into(self, payloads: list[Payload], ctx: Any, out: Tensor) -> bool:
        """Optional fused aggregation for communicators that gather payloads which cannot be summed:
        write into flat ``out`` (the tensor's numel, float32) the mean over ranks of
        ``decompress(p, ctx)``, bitwise the communicators' own ``d0 + d1``, ``+= d_r``, ``/ world``
        (two or more payloads); return False (the default) to leave it to them."""
        return False

    def residual(self, tensor: Tensor, payload: Payload, ctx: Any, out: Tensor) -> Tensor:
        """``out = tensor - decompress(payload, ctx)``: what this rank did not send. Error feedback
        writes it into a buffer it keeps, so no model-size tensor is allocated per step; a
        compressor that can say it without decompressing (a sparsifier) overrides this."""
        approx = self.decompress(payload, ctx).view_as(tensor)
        if _native.add_into(tensor, approx, out, subtract=True):  # the same floats; large buffers streamed
            return out
        return torch.sub(tensor, approx, out=out)

    def defer_residual(self, tensor: Tensor, payload: Payload, ctx: Any) -> Any:
        """A token standing for ``residual(tensor, payload, ctx)`` where :meth:`compensate_owed` will
        add it to the next gradient within its own pass: error feedback then keeps ``tensor`` (its
        own buffer) and the token instead of writing the residual, one pass over the model fewer per
        step. The token must not share memory that anything rewrites (copy small factors). Default
        None: :meth:`residual` writes it now."""
        return None

    def owed_residual(self, base: Tensor, token: Any, out: Tensor) -> Tensor:
        """Write the residual a :meth:`defer_residual` token stands for into ``out`` (bitwise what
        :meth:`residual` would have written then): a reader of the residual needs it as a tensor."""
        raise NotImplementedError(f"{type(self).__name__} defers no residual")

    def compensate_owed(self, g: Tensor, base: Tensor, token: Any, out: Tensor, name: str) -> bool:
        """``out = g + owed_residual(base, token)``, bitwise the residual's operations followed by
        torch's add, without the residual written; the compressor may read what it needs of the sum
        in the same pass, as in ``compensate_into``. False (nothing written) where it cannot: the
        memory writes the residual then."""
        return False

    def next_round(self, round_index: int, mean_payload: Payload, ctx: Any) -> tuple[Payload, Any]:
        """Multi-round methods: given the mean over ranks of round ``round_index - 1``'s payload,
        return this rank's payload (and updated ctx) for round ``round_index``. After the last round
        the communicator calls ``decompress(mean_payload, ctx)``."""
        raise NotImplementedError(f"{type(self).__name__} has a single communication round")

    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        """Expected bytes this rank sends for a tensor of ``shape`` (dense element size
        ``itemsize``); sizes fusion buckets by compressed bytes (ACP-SGD §IV-B) and feeds the cost
        model. Sparse payloads count values and indices."""
        return int(torch.Size(shape).numel()) * itemsize

    def density(self) -> float | None:
        """Target fraction of elements sent (sparsifiers); None when not meaningful."""
        return None

    def set_density(self, density: float) -> None:
        """Change the target density between steps (policies: moo, lgreco)."""
        raise ValueError(f"compressor {self.name!r} has no density to set")

    def on_step(self, step: int) -> None:
        """Called once after every optimizer step with the number of completed steps. Compressors
        whose behaviour depends on the iteration (interleaving, threshold reuse) override it."""

    def rescale(self, factor: float) -> None:
        """The loss scale changed by ``factor`` (:class:`adacomp.engine.error_feedback.LossScale`).
        Nothing to do for compressors whose state is scale-free (counters, seeds, directions);
        one that keeps a gradient-unit value across steps (a reused threshold) overrides this."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"compressor {self.name!r} is stateless but got state keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def get(name: str, **params: Any) -> Compressor:
    return registry.get(name, **params)


def names() -> list[str]:
    return registry.names()


@register("none")
class NoneCompressor(Compressor):
    """Identity: the dense baseline. The payload is the tensor itself."""

    additive = True
    biased = False

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        return [tensor], None

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        return payload[0]


class CastCompressor(Compressor):
    """Cast to a 16-bit float type for transport and back: additive (payloads sum under allreduce),
    2x smaller. Subclasses name the wire type."""

    additive = True
    biased = False
    elementwise = True
    wire_dtype: ClassVar[torch.dtype] = torch.float16

    def compress(self, tensor: Tensor, name: str) -> tuple[Payload, Any]:
        if self.wire_dtype == torch.bfloat16 and _native.usable(tensor):  # (no allocation where C cannot run)
            out = self._workspace().output(tensor.shape, tensor.numel(), torch.bfloat16, tensor.device)
            got = self._cast_into(tensor, out.view(-1))
            if got is not None:
                return got
        return [tensor.to(self.wire_dtype)], tensor.dtype

    def compress_into(self, tensor: Tensor, out: Tensor) -> tuple[Payload, Any] | None:
        """:meth:`compress` with the payload written into ``out`` (flat, the wire dtype, the
        tensor's numel: a communicator's bucket buffer, so it needs no concatenation), the same
        bits; None (nothing written) where only :meth:`compress` can, a subclass's own
        :meth:`compress` included."""
        return self._cast_into(tensor, out) if type(self).compress is CastCompressor.compress else None

    def _cast_into(self, tensor: Tensor, out: Tensor) -> tuple[Payload, Any] | None:
        """The C cast of ``tensor`` into flat ``out`` as the payload (in the tensor's shape)."""
        if (self.wire_dtype == torch.bfloat16 and _native.usable(tensor) and out.numel() == tensor.numel()
                and _native.to_bf16(tensor.view(-1), out)):
            return [out.view(tensor.shape)], tensor.dtype
        return None

    def decompress(self, payload: Payload, ctx: Any) -> Tensor:
        x = payload[0]
        if x.dtype == torch.bfloat16 and ctx == torch.float32 and x.is_contiguous() and x.device.type == "cpu":
            out = self._workspace().output(x.shape, x.numel(), torch.float32, x.device)
            if _native.from_bf16(x.view(-1), out.view(-1)):
                return out
        return x.to(ctx)


    def payload_bytes(self, shape: torch.Size, itemsize: int = 4) -> int:
        return int(torch.Size(shape).numel()) * 2


@register("fp16")
class FP16Compressor(CastCompressor):
    """Cast to half precision for transport (Horovod's ``Compression.fp16``); additive, 2x smaller."""

    wire_dtype = torch.float16
