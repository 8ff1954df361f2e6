"""Test selection: every test in a module that starts processes (real collectives over gloo / MPI /
Horovod, launchers, subprocesses) is marked ``slow``, so ``make test-fast`` (``-m "not slow"``)
runs the single-process tests only. ``make test`` runs everything. Marked here, by what a module
does, so a new multi-process test cannot be forgotten."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

SPAWNS = ("run_workers(", "subprocess", "mp.spawn", "multiprocessing", "torchrun", "mpirun", "horovodrun",
          "Popen(")

_seen: dict[Path, bool] = {}


def spawns(path: Path) -> bool:
    if path not in _seen:
        text = path.read_text(encoding="utf-8")
        _seen[path] = any(token in text for token in SPAWNS)
    return _seen[path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if spawns(Path(str(item.fspath))):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """``ADACOMP_FAIL_LOG=file``: each failure's report appended to ``file`` as it happens (with
    xdist, on the controller), so a run cut off by a time limit (a lent GPU's lease) keeps the
    tracebacks pytest would only print at the end."""
    path = os.environ.get("ADACOMP_FAIL_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture
def one_thread():
    """torch sums on one thread here (with more it splits a sum, and the C cascade declines)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["avx2", "baseline"])
def avx2_switch(request):
    """Runs a test with the hand-written AVX2 loops, then with the baseline loops (the same where
    the CPU has no AVX2)."""
    import ctypes

    from adacomp.compressors import _native
    switch = ctypes.c_int.in_dll(_native.library(), "ac_avx2_off")
    switch.value = int(request.param == "baseline")
    yield request.param
    switch.value = 0
