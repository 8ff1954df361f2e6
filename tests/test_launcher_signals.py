"""``adacomp run`` forwards SIGHUP / SIGTERM / SIGINT to its workers, and its workers die with it
even when it is SIGKILLed (parent-death signal): no orphan keeps a core busy. Real processes; the
marker in each worker's command line finds them in /proc."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.test_rank_failure import _assert_no_orphans, _env, _with_marker

ROOT = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 120
# A worker that reports its signal and exits like a process killed by it would; the marker is argv[1].
WORKER = ("import os, signal, sys, time\n"
          "def on(sig, _f):\n"
          "    print(f'worker got {signal.Signals(sig).name}', flush=True)\n"
          "    signal.signal(sig, signal.SIG_DFL); os.kill(os.getpid(), sig)\n"
          "for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):\n"
          "    signal.signal(s, on)\n"
          "print('worker ready', flush=True)\n"
          "time.sleep(600)\n")


def _launch(np: int) -> tuple[subprocess.Popen, str]:
    marker = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "adacomp.tools.cli", "run", "-np", str(np), "--", sys.executable, "-c", WORKER, marker]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    seen = 0
    deadline = time.monotonic() + HANG_GUARD_S
    while seen < np and time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen += "worker ready" in line
    if seen < np:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("workers did not start")
    return proc, marker


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_and_nothing_is_left(sig: signal.Signals) -> None:
    proc, marker = _launch(2)
    assert len(_with_marker(marker)) >= 2
    os.kill(proc.pid, sig)  # only the launcher: the workers live in their own sessions
    try:
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert f"got {sig.name}; forwarding it to the workers" in out, out
    assert out.count(f"worker got {sig.name}") == 2, out
    assert proc.returncode == 128 + sig, out
    _assert_no_orphans(marker)


def test_workers_die_with_a_sigkilled_adacomp_run() -> None:
    proc, marker = _launch(2)
    workers = _with_marker(marker)
    assert len(workers) >= 2
    os.kill(proc.pid, signal.SIGKILL)  # no handler runs: only the kernel's parent-death signal helps
    proc.wait(timeout=HANG_GUARD_S)
    _assert_no_orphans(marker)
