"""Lightning and Accelerate on CPU through adacomp's integrations, against a hand-written DDP loop on
the same batches (tests/frameworks_worker.py, 2 ranks under torchrun): for none / topk / powersgd /
acpsgd / dgc with an fp16 GradScaler and one injected overflow, the framework's parameters equal the
hand-written loop's on every rank, and a checkpoint / resume through the framework's own API
(Lightning's ``save_checkpoint`` + ``fit(ckpt_path=)``, Accelerate's ``save_state`` / ``load_state``)
equals the uninterrupted run on every rank."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import free_port

ROOT = Path(__file__).resolve().parent.parent
METHODS = ["none", "topk", "powersgd", "acpsgd", "dgc"]


def _launch(framework: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "tests" / "frameworks_worker.py"), "--framework", framework, "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert res.stdout.count(f"FRAMEWORK_DONE {framework}") == 2, res.stdout[-2000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("frameworks")
    for framework in ("ddp", "lightning", "accelerate"):
        _launch(framework, out)
    return out


def _load(out: Path, framework: str, method: str, run: str, rank: int) -> dict:
    return torch.load(out / f"{framework}-{method}-{run}.rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
@pytest.mark.parametrize("method", METHODS)
def test_framework_equals_hand_written_ddp_and_resumes_exactly(runs: Path, framework: str, method: str) -> None:
    for rank in (0, 1):
        ref = _load(runs, "ddp", method, "full", rank)
        full = _load(runs, framework, method, "full", rank)
        resumed = _load(runs, framework, method, "resumed", rank)
        # 6 batches, one skipped by the GradScaler overflow on every rank: 5 compressed rounds
        assert ref["steps"] == full["steps"] == resumed["steps"] == 5, (ref["steps"], full["steps"], resumed["steps"])
        for name, want in ref["params"].items():
            assert torch.isfinite(want).all()
            assert torch.equal(full["params"][name], want), f"rank {rank} {name}: {framework} != hand-written DDP"
            assert torch.equal(resumed["params"][name], want), f"rank {rank} {name}: resumed != uninterrupted"


def test_lightning_fits_again_from_its_checkpoint_and_validate_leaves_no_state_behind(runs: Path) -> None:
    """The same Trainer fitting again from the checkpoint it wrote takes that checkpoint's compression
    state (a new hook for the new fit); ``validate(ckpt_path=)`` before a fresh fit leaves none for it."""
    for rank in (0, 1):
        full = _load(runs, "lightning", "topk", "full", rank)
        habits = _load(runs, "lightning", "topk", "habits", rank)
        for run in ("again", "validated"):
            assert habits[run]["steps"] == full["steps"], (rank, run, habits[run]["steps"])
            for name, want in full["params"].items():
                assert torch.equal(habits[run]["params"][name], want), f"rank {rank} {run} {name}"


def test_accelerate_save_state_on_the_main_process_alone_raises_instead_of_hanging(runs: Path) -> None:
    assert "save on every process" in _load(runs, "accelerate", "topk", "habits", 0)
    assert _load(runs, "accelerate", "topk", "habits", 1) == "no error"
