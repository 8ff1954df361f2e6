"""adacomp on HSDP's replicate dimension (issue 34, first part), 4 gloo ranks under torchrun as a
2 x 2 mesh (tests/fsdp_worker.py): FSDP2 over the shard dimension with adacomp's round as the
all-reduce hook.

* ``compressor: none`` gives native HSDP's parameters (``fully_shard`` over the 2-D mesh) bitwise,
  also with bf16 MixedPrecisionPolicy and gradient clipping.
* A DCP checkpoint (model, optimizer, adacomp's per-rank state) resumes bitwise.
* Top-k with residual memory on the replicate dimension: every round compressed, fewer bytes than
  the dense shard, residuals kept per shard, and every rank ends with the same full parameters
  (both replicas applied the same average).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           str(ROOT / "tests" / "fsdp_worker.py"), "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert res.stdout.count("FSDP_DONE") == 4, res.stdout[-2000:]
    return out


def _load(out: Path, arm: str, rank: int) -> dict:
    return torch.load(out / f"{arm}.rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize("habits", ["", "-habits"], ids=["plain", "bf16-mixed-precision-and-clipping"])
def test_none_on_the_replicate_dimension_equals_native_hsdp(runs: Path, habits: str) -> None:
    """Also with FSDP2's MixedPrecisionPolicy (bf16 parameters and reduction: the hook sees bf16
    shards) and clip_grad_norm_ on the DTensor gradients."""
    for rank in range(4):
        native, ours = _load(runs, "native" + habits, rank), _load(runs, "none" + habits, rank)
        assert ours["steps"] == 6 and ours["sent"] == ours["dense"] > 0
        assert all(torch.equal(a, b) for a, b in zip(ours["params"], native["params"])), f"rank {rank}"


@pytest.mark.parametrize("method", ["topk", "powersgd"])
@pytest.mark.parametrize("habits", ["", "-habits"], ids=["plain", "bf16-mixed-precision-and-clipping"])
def test_compression_on_the_replicate_dimension_and_replicas_agree(runs: Path, habits: str, method: str) -> None:
    """Top-k, and PowerSGD on each parameter's rows of the shard (the round sees one tensor per
    parameter, not the unit's flat shard, so low-rank compressors apply)."""
    first = _load(runs, method + habits, 0)
    for rank in range(4):
        run = _load(runs, method + habits, rank)
        assert run["steps"] == 6
        # Top-k 5 %: values and indices over 6x below dense in fp32, about 4x with bf16; PowerSGD rank 2 far below
        assert 0 < run["sent"] < run["dense"] / 3, (run["sent"], run["dense"])
        assert run["residual_norm"] > 0
        assert all(torch.isfinite(p).all() for p in run["params"])
        assert all(torch.equal(a, b) for a, b in zip(run["params"], first["params"])), f"rank {rank}"
    native = _load(runs, "native" + habits, 0)
    assert any(not torch.equal(a, b) for a, b in zip(first["params"], native["params"]))  # it really compressed


def test_dcp_save_and_resume_is_bitwise(runs: Path) -> None:
    """3 steps, torch.distributed.checkpoint save (FSDP2 model and optimizer through get_state_dict,
    adacomp's per-rank state under rank keys), a fresh model loaded, 3 more: the parameters and every
    residual equal the uninterrupted run on every rank."""
    from tests.test_checkpoint_resume import state_diff
    for rank in range(4):
        full, resumed = _load(runs, "topk", rank), _load(runs, "topk-resumed", rank)
        assert all(torch.equal(a, b) for a, b in zip(full["params"], resumed["params"])), f"rank {rank}"
        assert state_diff(full["adacomp"], resumed["adacomp"]) == [], f"rank {rank}"


@pytest.mark.parametrize("arm", ["localsgd", "diloco"])
def test_local_steps_on_shards_equal_a_simulation_of_the_hosts(runs: Path, arm: str) -> None:
    """Local SGD (outer SGD lr 1) and DiLoCo (outer Nesterov 0.7 / 0.9), H = 3, uncompressed: after
    every step each rank's full model equals its host's in a one-process simulation (the hosts
    train apart between synchronisations and agree right after them)."""
    for rank in range(4):
        run = _load(runs, arm, rank)
        assert run["steps"] == 6 and run["sent"] > 0
        for step, (ours, sim) in enumerate(zip(run["trace"], run["simulated"])):
            for a, b in zip(ours, sim):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}")
    # the hosts really drifted apart inside a window and met at the synchronisation (step index 2, 5)
    host0, host1 = _load(runs, arm, 0)["trace"], _load(runs, arm, 2)["trace"]
    assert any(not torch.equal(a, b) for a, b in zip(host0[1], host1[1]))
    assert all(torch.equal(a, b) for a, b in zip(host0[5], host1[5]))


def test_local_steps_with_topk_compress_the_shards_and_resume_bitwise(runs: Path) -> None:
    """DiLoCo + Top-k 5 % with residual memory on the shards: the pseudo-gradients go compressed
    (bytes well below dense), residuals are kept per shard, every rank ends with the same model;
    a DCP checkpoint inside a window (step 4 of 6) resumes bitwise."""
    from tests.test_checkpoint_resume import state_diff
    first = _load(runs, "diloco-topk", 0)["trace"][-1]
    sim = _load(runs, "diloco", 0)["trace"][-1]
    assert any(not torch.equal(a, b) for a, b in zip(first, sim))  # it really compressed
    for rank in range(4):
        run = _load(runs, "diloco-topk", rank)
        assert run["steps"] == 6 and 0 < run["sent"] < run["dense"] / 3, (run["sent"], run["dense"])
        assert all(torch.equal(a, b) for a, b in zip(run["trace"][-1], first)), f"rank {rank}"
        resumed = _load(runs, "diloco-topk-resumed", rank)
        assert all(torch.equal(a, b) for a, b in zip(run["trace"][-1], resumed["params"])), f"rank {rank}"
        assert state_diff(run["adacomp"], resumed["adacomp"]) == [], f"rank {rank}"
