"""The multi-process test harness itself (tests/_dist.py): a rank that dies in native code is named,
with its Python stack, instead of only its peers' "connection reset"."""
from __future__ import annotations

import pytest

from tests._dist import run_workers


def _abort_on_rank0() -> None:
    import os

    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        os.abort()  # what glibc does on a corrupted heap
    dist.all_reduce(torch.ones(1))  # rank 1 waits for the dead peer


def _stacks_on_a_crash() -> bool:
    import faulthandler
    return faulthandler.is_enabled()


def test_a_rank_ended_by_a_signal_is_named() -> None:
    with pytest.raises(AssertionError) as failed:
        run_workers(_abort_on_rank0, 2, timeout=120)
    assert "rank 0: died from signal SIGABRT" in str(failed.value)
    assert "rank 1:" in str(failed.value)  # the peer's own error, as before


def test_every_worker_prints_its_python_stacks_on_a_crash() -> None:
    """faulthandler in every worker: its stacks go to the worker's stderr, which the forkserver's
    workers share with the test session (pytest shows them with the failing test)."""
    assert run_workers(_stacks_on_a_crash, 2, timeout=120) == [True, True]


def test_the_plain_torch_reproduction_of_gloos_sparse_crash_runs() -> None:
    """scripts/gloo_sparse_thread_repro.py (docs/reliability.md, "Known issues") trains and reports
    its count: two short cycles here, with the TCPStore thread (the crash itself is ~1 in 12,500)."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "gloo_sparse_thread_repro.py"
    proc = subprocess.run([sys.executable, str(script), "--launches", "1", "--cycles", "2", "--thread", "store"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "launch 0: ok" in proc.stdout and "thread=store embedding=sparse: 2 cycles in" in proc.stdout, proc.stdout
