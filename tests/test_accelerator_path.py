"""tests/test_cuda.py on the CPU along the accelerators' code path: ``ADACOMP_TEST_CUDA_AS=cpu``
puts its "device" on the CPU, ``ADACOMP_EMULATE_ACCELERATOR=1`` takes the paths a GPU takes (batched
counts, deferred checks, device selections: ``adacomp.devices``) and ``ADACOMP_NATIVE=0`` leaves the
C passes, which serve CPU memory only, out. So every CI run trains every built-in method through the
code a GPU runs, where no GPU is lent (the NCCL test skips, saying why)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_cuda_tests_pass_on_the_emulated_accelerator_path() -> None:
    env = {**os.environ, "ADACOMP_TEST_CUDA_AS": "cpu", "ADACOMP_EMULATE_ACCELERATOR": "1", "ADACOMP_NATIVE": "0",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("ADACOMP_FAIL_LOG", None)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and " failed" not in res.stdout, res.stdout[-2000:]
