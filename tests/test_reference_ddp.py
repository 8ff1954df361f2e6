"""Dense adacomp equals PyTorch DDP on the torch (gloo) backend, parameter for parameter."""
from __future__ import annotations

import pytest

from tests._dist import run_workers
from tests.reference import max_diff, train_adacomp, train_ddp


def _both(config: dict) -> float:
    a = train_adacomp(config, steps=20)
    b = train_ddp(steps=20)
    return max_diff(a, b)


@pytest.mark.parametrize("bucket_mb", [25.0, 0.0, 0.01])
def test_dense_matches_ddp(bucket_mb: float) -> None:
    cfg = {"compressor": {"name": "none"}, "communicator": {"name": "allreduce"},
           "fusion": {"bucket_mb": bucket_mb}}
    diffs = run_workers(_both, 2, cfg)
    assert max(diffs) < 1e-6, diffs


def _accumulate() -> float:
    # 2 backward passes of batch 16 per step == DDP on batch 32 with a summed loss; compare against
    # a single-pass adacomp run on the same samples instead: gradients add exactly.
    a = train_adacomp({}, steps=5, backward_passes=2)
    return float(sum(v.abs().sum() for v in a.values()))


def test_backward_passes_per_step_runs_and_agrees_across_ranks() -> None:
    sums = run_workers(_accumulate, 2)
    assert sums[0] == sums[1]
