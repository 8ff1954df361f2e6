"""Per-step measurements: where the time went and how many bytes moved.

Communicators and the optimizer add to one :class:`StepStats` per step; policies and the training
loop read finished records instead of reaching into component internals.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor


@dataclass
class StepStats:
    """Counters of one optimizer step on this rank.

    ``compress_s``: compress + decompress + memory time; ``comm_s``: time inside collectives and
    waiting on them (what the step could not overlap); ``bytes_sent``: payload bytes this rank
    contributed; ``dense_bytes``: bytes a dense allreduce of the same gradients would send;
    ``bucket_sync_s``: wait time per bucket index (policies fit cost models on it);
    ``gain_num`` / ``gain_den``: sums of ||g_c||^2 and ||g_e||^2 (compression gain, AR-Topk §2-C3),
    measured only with ``track_gain``: the denominator reads every compressed tensor once more (half
    a memory pass per sparsifier step), so the engine asks for it only where its policy reads the
    gain (``Policy.reads_gain``: MOO).
    """

    step: int = 0
    compress_s: float = 0.0
    comm_s: float = 0.0
    bytes_sent: int = 0
    dense_bytes: int = 0
    bucket_sync_s: dict[int, float] = field(default_factory=dict)
    gain_num: float | Tensor = 0.0  # 0-dim device tensors until read (see add_gain)
    gain_den: float | Tensor = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    track_gain: bool = False

    @contextmanager
    def timing(self, what: str) -> Iterator[None]:
        """``with stats.timing("compress"):`` adds the elapsed time to ``compress_s`` (or ``comm_s``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            if what == "compress":
                self.compress_s += dt
            elif what == "comm":
                self.comm_s += dt
            else:
                self.extra[what] = self.extra.get(what, 0.0) + dt

    def add(self, other: "StepStats") -> None:
        """Add another record's counters to this one (several rounds in one step: the outer loop's
        fragments)."""
        self.compress_s += other.compress_s
        self.comm_s += other.comm_s
        self.bytes_sent += other.bytes_sent
        self.dense_bytes += other.dense_bytes
        self.add_gain(other.gain_num, other.gain_den)
        for k, v in other.extra.items():
            self.extra[k] = self.extra.get(k, 0.0) + v

    def add_gain(self, compressed_sq: float | Tensor, full_sq: float | Tensor) -> None:
        """Add one tensor's squared norms. Tensors stay on their device and are summed there: reading
        each back would make the host wait for the device once per tensor; :attr:`gain` reads once."""
        self.gain_num = self.gain_num + compressed_sq
        self.gain_den = self.gain_den + full_sq

    def add_gain_of(self, compressed: Tensor, full: Tensor) -> None:
        """Add one tensor's squared norms (what it sent, what it had to send) when ``track_gain``."""
        if self.track_gain:
            self.add_gain(square_sum(compressed), square_sum(full))

    @property
    def gain(self) -> float | None:
        """E||g_c||^2 / E||g_e||^2 over this step's compressed tensors (None if nothing compressed)."""
        num, den = float(self.gain_num), float(self.gain_den)
        if isinstance(self.gain_num, Tensor) or isinstance(self.gain_den, Tensor):
            self.gain_num, self.gain_den = num, den  # read once
        return num / den if den > 0 else None

    @property
    def compression_ratio(self) -> float:
        """Dense bytes / bytes sent (1.0 for the dense path)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else 1.0

    def as_dict(self) -> dict[str, float]:
        d = {"step": self.step, "compress_s": self.compress_s, "comm_s": self.comm_s,
             "bytes_sent": self.bytes_sent, "dense_bytes": self.dense_bytes,
             "compression_ratio": self.compression_ratio}
        if self.gain is not None:
            d["gain"] = self.gain
        d.update(self.extra)
        return d


def square_sum(t: Tensor) -> Tensor | float:
    """``sum(t ** 2)`` in one read (a dot product) without the two full-size temporaries of
    ``t.float().square().sum()``; only feeds statistics (the compression gain). A 0-dim tensor on
    ``t``'s device: :class:`StepStats` reads it when the gain is asked for, not per tensor (on an
    accelerator each read waits for the device)."""
    flat = t.reshape(-1)
    if flat.dtype != torch.float32 and flat.dtype != torch.float64:
        flat = flat.float()
    return torch.dot(flat, flat) if flat.numel() else 0.0
