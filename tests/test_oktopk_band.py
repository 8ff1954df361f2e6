"""Count-band correction of oktopk's reused threshold (compressors/_band.py): the density stays
within 0.5x-2x of the target while the gradient's scale grows 1 % per step (issue 16: plain reuse
reaches 4.9x before the next estimation) and while error-feedback residuals grow."""
from __future__ import annotations

import torch

from adacomp import compressors, memories
from adacomp.compressors._band import HARD_HIGH, HARD_LOW, NUDGE, judge

N, DENSITY, STEPS = 100_000, 0.01, 40
K = round(N * DENSITY)


def densities(memory: str) -> list[float]:
    comp = compressors.get("oktopk", density=DENSITY, period=32)
    mem = memories.get(memory)
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(STEPS):
        comp.on_step(step)
        x = mem.compensate(torch.randn(N, generator=g) * 1.01 ** step, "w")
        payload, ctx = comp.compress(x, "w")
        mem.update(x, "w", comp, payload, ctx)
        out.append(payload[0].numel() / N)
    return out


def test_density_within_band_for_a_gradient_growing_one_percent_per_step():
    d = densities("none")
    assert all(HARD_LOW * DENSITY <= x <= HARD_HIGH * DENSITY for x in d), d
    assert max(d) > 1.05 * DENSITY  # the threshold was reused (not re-estimated every step)


def test_density_within_band_with_growing_residuals():
    d = densities("residual")
    assert all(HARD_LOW * DENSITY <= x <= HARD_HIGH * DENSITY for x in d), d


def test_judge_bands():
    assert judge(1.0, K, K) == (False, 1.0)
    assert judge(1.0, int(1.3 * K), K) == (False, NUDGE)
    assert judge(1.0, int(0.6 * K), K) == (False, 1.0 / NUDGE)
    assert judge(1.0, 2 * K + 1, K).reestimate and judge(1.0, K // 2 - 1, K).reestimate
