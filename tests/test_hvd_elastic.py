"""``hvd.elastic`` under ``torchrun --max-restarts 1``: examples/pytorch_elastic.py (Horovod's
``pytorch_mnist_elastic.py`` pattern) on 2 ranks, rank 1 exits once mid-epoch one batch after a
commit. torchrun restarts both workers as fresh processes; the job must finish, continue from the
last commit (counters, sampler position, model, optimizer), process no batch twice after it, and end
with the same parameters on both ranks, equal to an uninterrupted run's. Real processes, gloo."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.test_backend_horovod import find_horovodrun, needs_horovod

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "pytorch_elastic.py"
BATCH, TRAIN, COMMIT_EVERY = 4, 96, 3  # 12 batches per rank per epoch, commits at 3, 6, 9, 12


def _torchrun(tmp: Path, *extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "OMPI_", "PMI"))}
    env.update(OMP_NUM_THREADS="1", ADACOMP_ELASTIC_DIR=str(tmp / "state"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.2", str(SCRIPT), "--batch-size", str(BATCH),
           "--train-size", str(TRAIN), "--batches-per-commit", str(COMMIT_EVERY), "--epochs", "2",
           "--log-dir", str(tmp), *extra]
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("ELASTIC_DONE") == 2, out[-4000:]
    return out


def _events(tmp: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp / f"rank{rank}.jsonl").read_text().splitlines()]


def _final(tmp: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(tmp / f"final_rank{rank}.pt")


def test_killed_worker_resumes_from_last_commit(tmp_path: Path) -> None:
    killed, plain = tmp_path / "killed", tmp_path / "plain"
    killed.mkdir()
    plain.mkdir()
    _torchrun(killed, "--kill-rank", "1", "--kill-after-commit", "2")
    _torchrun(plain)

    ev1 = _events(killed, 1)
    kill = [e for e in ev1 if e["event"] == "kill"]
    assert len(kill) == 1 and kill[0]["attempt"] == 0 and (kill[0]["epoch"], kill[0]["batch"]) == (0, 7)
    for rank in (0, 1):
        ev = _events(killed, rank)
        first = [e for e in ev if e["attempt"] == 0]
        second = [e for e in ev if e["attempt"] == 1]
        last_commit = [e for e in first if e["event"] == "commit"][-1]
        assert (last_commit["epoch"], last_commit["batch"]) == (0, 6)
        # the restarted workers start from the commit, not from 0 and not from the lost batch 7
        start = second[0]
        assert start["event"] == "start" and (start["epoch"], start["batch"]) == (0, 6), start
        # after the commit every (epoch, batch) once, in order, through to the end
        steps = [(e["epoch"], e["batch"]) for e in second if e["event"] == "batch"]
        assert steps == [(0, b) for b in range(7, 13)] + [(1, b) for b in range(1, 13)], steps
        # samples: those committed before the kill plus those after it are the epoch, none twice
        before = [i for e in first if e["event"] == "batch" and e["batch"] <= 6 for i in e["idx"]]
        after = [i for e in second if e["event"] == "batch" and e["epoch"] == 0 for i in e["idx"]]
        assert not set(before) & set(after) and len(before) + len(after) == TRAIN // 2
        # and the samples match the uninterrupted run's, batch for batch
        ref = {(e["epoch"], e["batch"]): e["idx"] for e in _events(plain, rank) if e["event"] == "batch"}
        for e in first + second:
            if e["event"] == "batch":
                assert e["idx"] == ref[(e["epoch"], e["batch"])], e
    # the ranks' indices of epoch 0 (both attempts, up to and after the commit) cover the data once
    seen = [i for r in (0, 1) for e in _events(killed, r) if e["event"] == "batch" and e["epoch"] == 0
            and (e["attempt"] == 1 or e["batch"] <= 6) for i in e["idx"]]
    assert sorted(seen) == list(range(TRAIN))

    final0, final1, ref0 = _final(killed, 0), _final(killed, 1), _final(plain, 0)
    for k in final0:
        assert torch.equal(final0[k], final1[k]), k
        assert torch.allclose(final0[k], ref0[k], atol=1e-6), k


@needs_horovod
def test_horovodrun_delegates_to_horovods_loop(tmp_path: Path) -> None:
    """Under horovodrun (the Horovod backend) ``run`` is Horovod's ``run_fn`` driving adacomp's state
    objects: the example trains to the end, the commits stay in memory (no torchrun run id, no
    ``ADACOMP_ELASTIC_DIR``) and both ranks agree. Horovod's *elastic* mode (host discovery) is not
    run here: on this machine it hangs at start-up for a plain ``horovod.torch`` script too."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC", "MASTER_", "OMPI_", "PMI", "ADACOMP_ELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    cmd = [find_horovodrun() or "horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, str(SCRIPT),
           "--batch-size", str(BATCH), "--train-size", str(TRAIN), "--epochs", "1", "--log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("ELASTIC_DONE") == 2 and out.count("backend=horovod") == 2, out[-4000:]
    steps = [(e["epoch"], e["batch"]) for e in _events(tmp_path, 0) if e["event"] == "batch"]
    assert steps == [(0, b) for b in range(1, 13)]
    final0, final1 = _final(tmp_path, 0), _final(tmp_path, 1)
    assert all(torch.equal(final0[k], final1[k]) for k in final0)
