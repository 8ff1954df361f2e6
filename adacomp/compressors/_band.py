"""Count-band correction of a reused sparsification threshold (Ok-Topk's local and global phases).

A threshold estimated once and reused for ``period`` steps lets the selected count drift with the
gradient's scale (1 %/step growth gives ~4.9x the target count after 32 steps), and with error
feedback the residuals grow while the threshold stays put, so the count can run away (issue 16:
33x k). Two bands around the target ``k`` correct it, decided from the count of the *current*
selection (known exactly; for the global phase it is the same number on every rank):

* soft band ``[SOFT_LOW * k, SOFT_HIGH * k]`` = ``[2k/3, 5k/4]``: outside it the threshold used at
  the next step is multiplied (count too high) or divided (count too low) by ``NUDGE`` = 1.012.
  Band and factor are the ones the Ok-Topk authors' code uses (recorded when adacomp's ``oktopk``
  was first compared with that code, see docs/algorithms.md); the PPoPP'22 paper describes plain
  reuse.
* hard band ``[HARD_LOW * k, HARD_HIGH * k]`` = ``[k/2, 2k]``: outside it the reused threshold is
  thrown away and re-estimated exactly at once (an adacomp choice: it bounds the density to
  0.5x-2x of the target at every step, the acceptance band of issue 16, where the nudge alone
  trails a fast drift such as a growing residual).
"""
from __future__ import annotations

from typing import NamedTuple

SOFT_LOW = 2.0 / 3.0
SOFT_HIGH = 5.0 / 4.0
NUDGE = 1.012
HARD_LOW = 0.5
HARD_HIGH = 2.0


class Verdict(NamedTuple):
    """``reestimate``: drop this selection and estimate exactly now; ``threshold``: the threshold
    to reuse at the next step when the selection is kept."""

    reestimate: bool
    threshold: float


def judge(threshold: float, count: int, k: int) -> Verdict:
    """What to do after a reused ``threshold`` selected ``count`` elements for a target ``k``."""
    if count < HARD_LOW * k or count > HARD_HIGH * k:
        return Verdict(True, threshold)
    if count > SOFT_HIGH * k:
        return Verdict(False, threshold * NUDGE)
    if count < SOFT_LOW * k:
        return Verdict(False, threshold / NUDGE)
    return Verdict(False, threshold)
