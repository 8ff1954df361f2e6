"""Gradient shape lists of the architectures the cost table covers (no model code needed), and a
two-rank mirror backend that lets one process run a communicator's full compress / exchange /
aggregate path as rank 0 of a world of two whose peer sent the same bytes.

Why shapes instead of the model zoo: compression cost depends only on the tensor shapes, and the
benchmark must run on the code of any branch (``PYTHONPATH=/work/main`` measures "before").
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import Tensor

from adacomp.backends.base import Backend, Handle, gather_into
from adacomp.backends.forwarding import ForwardingBackend


def resnet50() -> list[tuple[str, tuple[int, ...]]]:
    """torchvision-style ResNet-50 (v1.5): 161 tensors, 25.6M parameters."""
    out: list[tuple[str, tuple[int, ...]]] = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)),
                                              ("bn1.bias", (64,))]
    cin = 64
    for li, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), 1):
        for b in range(blocks):
            p = f"layer{li}.{b}"
            for ci, (co, ci_, k) in enumerate(((width, cin, 1), (width, width, 3), (4 * width, width, 1)), 1):
                out += [(f"{p}.conv{ci}.weight", (co, ci_, k, k)), (f"{p}.bn{ci}.weight", (co,)),
                        (f"{p}.bn{ci}.bias", (co,))]
            if b == 0:
                out += [(f"{p}.downsample.0.weight", (4 * width, cin, 1, 1)),
                        (f"{p}.downsample.1.weight", (4 * width,)), (f"{p}.downsample.1.bias", (4 * width,))]
            cin = 4 * width
    return out + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def vgg16() -> list[tuple[str, tuple[int, ...]]]:
    """VGG-16 (no batch norm): 32 tensors, 138M parameters; fc6 is 4096 x 25088."""
    out, cin, i = [], 3, 0
    for c in (64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0):
        if c:
            out += [(f"features.{i}.weight", (c, cin, 3, 3)), (f"features.{i}.bias", (c,))]
            cin = c
        i += 1
    for j, (o, n) in enumerate(((4096, 25088), (4096, 4096), (1000, 4096))):
        out += [(f"classifier.{3 * j}.weight", (o, n)), (f"classifier.{3 * j}.bias", (o,))]
    return out


def gpt2_small() -> list[tuple[str, tuple[int, ...]]]:
    """GPT-2-small-like, tied embeddings: 148 tensors, 124M parameters."""
    d = 768
    out: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (50257, 768)), ("wpe.weight", (1024, 768))]
    for b in range(12):
        p = f"h.{b}"
        out += [(f"{p}.ln_1.weight", (d,)), (f"{p}.ln_1.bias", (d,)),
                (f"{p}.attn.c_attn.weight", (d, 3 * d)), (f"{p}.attn.c_attn.bias", (3 * d,)),
                (f"{p}.attn.c_proj.weight", (d, d)), (f"{p}.attn.c_proj.bias", (d,)),
                (f"{p}.ln_2.weight", (d,)), (f"{p}.ln_2.bias", (d,)),
                (f"{p}.mlp.c_fc.weight", (d, 4 * d)), (f"{p}.mlp.c_fc.bias", (4 * d,)),
                (f"{p}.mlp.c_proj.weight", (4 * d, d)), (f"{p}.mlp.c_proj.bias", (d,))]
    return out + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def lstm_lm() -> list[tuple[str, tuple[int, ...]]]:
    """2-layer LSTM language model (PTB-medium sizes: vocab 10k, 650 units): 11 tensors, 19.8M."""
    v, h = 10000, 650
    out: list[tuple[str, tuple[int, ...]]] = [("encoder.weight", (v, h))]
    for layer in range(2):
        out += [(f"rnn.weight_ih_l{layer}", (4 * h, h)), (f"rnn.weight_hh_l{layer}", (4 * h, h)),
                (f"rnn.bias_ih_l{layer}", (4 * h,)), (f"rnn.bias_hh_l{layer}", (4 * h,))]
    return out + [("decoder.weight", (v, h)), ("decoder.bias", (v,))]


def equal_split(total: int, count: int) -> list[tuple[str, tuple[int, ...]]]:
    """``count`` 2-D tensors of (about) ``total / count`` elements each (overhead vs tensor count)."""
    per = max(1, total // count)
    rows = 1 << max(0, (per.bit_length() - 1) // 2)
    return [(f"t{i}", (rows, max(1, per // rows))) for i in range(count)]


SPLIT_TOTAL = 1 << 23  # elements of the tensor-count sweep (models ``split<count>``)


def model_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """A zoo model's gradient shapes (:data:`MODELS`), or ``split<count>``: :data:`SPLIT_TOTAL`
    elements in ``count`` equal tensors."""
    if model.startswith("split"):
        return equal_split(SPLIT_TOTAL, int(model[5:]))
    return MODELS[model]()


MODELS = {"resnet50": resnet50, "vgg16": vgg16, "gpt2_small": gpt2_small, "lstm_lm": lstm_lm}


class MirrorBackend(Backend):
    """Rank 0 of a world of ``world`` ranks whose peers send exactly what this rank sends.

    A benchmarking aid only (never used by tests): it gives a single process the payload sizes and
    aggregation work of a real multi-rank step without a second process competing for the cores.
    Broadcasts keep this rank's buffer, so callers must make this rank the root (AR-Topk: even steps).
    """

    name = "mirror"

    def __init__(self, world: int = 2):
        self.world = world

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self.world

    def local_rank(self) -> int:
        return 0

    def allreduce_async(self, tensor: Tensor, average: bool = False) -> Handle:
        # in place, as a real allreduce returns its result: a fresh buffer per call would charge the
        # method page faults that no collective costs (the peers' equal payloads average to this one)
        return Handle.completed(tensor if average else tensor.mul_(self.world))

    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None, out: Tensor | None = None) -> Handle:
        into = gather_into(out, tensor, self.world * tensor.shape[0]) if tensor.dim() else None
        if into is not None:  # where the real backends gather into the caller's buffer (torch, mpi)
            return Handle.completed(torch.cat([tensor] * self.world, out=into))
        return Handle.completed(torch.cat([tensor] * self.world))

    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle:
        return Handle.completed(tensor)

    def alltoall_async(self, tensor: Tensor, splits: list[int], recv_splits: list[int] | None = None) -> Handle:
        mine = tensor[:splits[0]]  # what rank 0 sends itself is what every peer sends rank 0
        return Handle.completed(torch.cat([mine] * self.world))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.world

    def barrier(self) -> None:
        return None


class CollectiveClock(ForwardingBackend):
    """A real backend whose collectives' time (each call, and the wait on its handle) adds up in
    ``seconds``. A benchmarking aid: a cost cell with real peers (``adacomp.bench.cost.PEERS``)
    reports its step without it, as the mirror's collectives cost nothing, so that the cell measures
    compression, decompression and error feedback alone (the wait for a slower peer is in it too)."""

    def __init__(self, inner: Backend):
        super().__init__(inner)
        self.seconds = 0.0

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def _handle(self, h: Handle) -> Handle:
        return Handle(lambda: self._timed(h.wait))

    def allreduce_async(self, tensor: Tensor, average: bool = False) -> Handle:
        return self._handle(self._timed(self.inner.allreduce_async, tensor, average))

    def allgather_async(self, tensor: Tensor, sizes: list[int] | None = None, out: Tensor | None = None) -> Handle:
        return self._handle(self._timed(self.inner.allgather_async, tensor, sizes, out))

    def broadcast_async(self, tensor: Tensor, root: int = 0) -> Handle:
        return self._handle(self._timed(self.inner.broadcast_async, tensor, root))

    def alltoall_async(self, tensor: Tensor, splits: list[int], recv_splits: list[int] | None = None) -> Handle:
        return self._handle(self._timed(self.inner.alltoall_async, tensor, splits, recv_splits))

    def reduce_async(self, tensor: Tensor, op: str) -> Handle:
        return self._handle(self._timed(self.inner.reduce_async, tensor, op))

    def alltoall_splits(self, splits: list[int]) -> list[int]:
        return list(self._timed(self.inner.alltoall_splits, splits))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self._timed(self.inner.broadcast_object, obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        return list(self._timed(self.inner.allgather_object, obj))
