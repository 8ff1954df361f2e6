"""Checkpoints under faults, with real launchers and processes (worker: tests/ckpt_worker.py):

* a full disk on one rank and a read-only file system fail on every rank with the path and the
  cause, and the previous set stays the one that loads;
* SIGTERM to one worker (or a signal to ``adacomp run``, forwarded) makes all ranks agree at the
  next step boundary, write one consistent set and exit with PREEMPTED_EXIT_CODE;
* ``torchrun --max-restarts 3``: a worker killed in three consecutive attempts, each restart
  resuming from the last set, ends bitwise equal to an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests._dist import run_launcher

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "ckpt_worker.py")
HANG_GUARD_S = 240  # only so that a broken build fails instead of hanging CI


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "ADACOMP_BACKEND",
              "ADACOMP_JOB_TOKEN", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(k, None)
    return env


def _adacomp_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "adacomp.tools.cli", "run", "-np", "2", "--", sys.executable, WORKER, *args]


# --- write failures ----------------------------------------------------------------------------
def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs `unshare -rm` (user + mount namespaces) for a real "
                                                   "full / read-only tmpfs")
def test_full_disk_and_read_only_file_system_keep_the_previous_set(tmp_path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    ckpt = mnt / "ckpt"
    script = (f"mount -t tmpfs -o size=1m tmpfs {mnt} && exec " +
              " ".join(_adacomp_run("write-faults", "--dir", str(ckpt), "--mount", str(mnt))))
    proc = run_launcher(["unshare", "-rm", "sh", "-c", script], cwd=str(ROOT), env=_env(), timeout=HANG_GUARD_S,
                        merge_stderr=True)
    out = proc.stdout
    assert proc.returncode == 0, out
    lines = [json.loads(m) for m in re.findall(r"^\[\d\] (\{.*\})$", out, re.M)]
    got = {(d["rank"], d["what"]): d["outcome"] for d in lines}
    assert got[(0, "first")] == got[(1, "first")] == "ok", out
    for r in (0, 1):
        full = got[(r, "full")]
        assert "CheckpointWriteError" in full and "step 2" in full and "rank 1:" in full, full
        assert "the disk is full" in full and "ENOSPC" in full and "rank1.pt" in full, full
        assert "previous set step-0000000001" in full, full
        ro = got[(r, "readonly")]
        assert "CheckpointWriteError" in ro and "read-only" in ro and "EROFS" in ro and str(ckpt) in ro, ro
        assert got[(r, "load")] == 1, out


# --- pre-emption ------------------------------------------------------------------------------
def _start(cmd: list[str]) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    return proc, []


def _read_until(proc: subprocess.Popen, lines: list[str], pattern: str) -> re.Match:
    """Read the launcher's output until ``pattern`` appears (a hang guard fails the test)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"never saw {pattern!r}:\n{''.join(lines)}")


def _finish(proc: subprocess.Popen, lines: list[str]) -> tuple[int, str]:
    try:
        rest, _ = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
    return proc.returncode, "".join(lines) + rest


def _assert_consistent_set(ckpt: Path, out: str) -> int:
    from adacomp.runtime import checkpoint
    sdir = checkpoint.latest(ckpt)
    assert sdir is not None, out
    headers = [checkpoint.read(sdir / f"rank{r}.pt")["header"] for r in (0, 1)]  # checksums verified
    assert {h["step"] for h in headers} == {headers[0]["step"]} and {h["set"] for h in headers} == {headers[0]["set"]}
    assert [h["rank"] for h in headers] == [0, 1] and {h["world_size"] for h in headers} == {2}
    steps = {int(s) for s in re.findall(r"preempted after step (\d+)", out)}
    assert steps == {headers[0]["step"]}, out  # every rank stopped after the same step
    return headers[0]["step"]


def test_sigterm_to_one_worker_gives_one_consistent_set_and_a_clean_exit(tmp_path) -> None:
    from adacomp.runtime import checkpoint
    ckpt = tmp_path / "ckpt"
    proc, lines = _start(_adacomp_run("preempt", "--dir", str(ckpt)))
    pid = int(_read_until(proc, lines, r"\[1\] rank 1 pid (\d+) starts")[1])
    _read_until(proc, lines, r"\[1\] rank 1 step 3\b")
    os.kill(pid, signal.SIGTERM)  # rank 1 only: rank 0 learns it at the next step boundary
    code, out = _finish(proc, lines)
    assert code == checkpoint.PREEMPTED_EXIT_CODE, out
    assert "rank 1 preempted" in out and "signal SIGTERM" in out and "rank 0 preempted" in out, out
    assert "another rank's" in out, out  # rank 0 got no signal itself
    step = _assert_consistent_set(ckpt, out)
    # and the set resumes: a new job starts from that step (stopped again by a forwarded SIGUSR1)
    proc, lines = _start(_adacomp_run("preempt", "--dir", str(ckpt)))
    pid = int(_read_until(proc, lines, rf"\[0\] rank 0 pid (\d+) starts at step {step}\b")[1])
    _read_until(proc, lines, rf"\[0\] rank 0 step {step + 2}\b")
    os.kill(pid, signal.SIGUSR1)  # the other default signal, this time to rank 0
    code, out = _finish(proc, lines)
    assert code == checkpoint.PREEMPTED_EXIT_CODE, out
    assert _assert_consistent_set(ckpt, out) > step


def test_a_signal_to_adacomp_run_is_forwarded_and_preempts_the_job(tmp_path) -> None:
    from adacomp.runtime import checkpoint
    ckpt = tmp_path / "ckpt"
    proc, lines = _start(_adacomp_run("preempt", "--dir", str(ckpt), "--signals", "SIGHUP"))
    _read_until(proc, lines, r"\[1\] rank 1 step 2\b")
    os.kill(proc.pid, signal.SIGHUP)  # e.g. the ssh session of `adacomp run` dropped
    code, out = _finish(proc, lines)
    assert "got SIGHUP; forwarding it to the workers" in out, out
    assert code == checkpoint.PREEMPTED_EXIT_CODE, out
    assert "signal SIGHUP" in out, out
    _assert_consistent_set(ckpt, out)


# --- elastic restarts ---------------------------------------------------------------------------
def _torchrun(args: list[str], restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--max-restarts", str(restarts), "--monitor-interval", "0.2", WORKER, *args]


def test_three_torchrun_restarts_resume_bitwise(tmp_path) -> None:
    runs = {}
    for name, kills in (("killed", 3), ("uninterrupted", 0)):
        d = tmp_path / name
        d.mkdir()
        proc = run_launcher(_torchrun(["elastic", "--dir", str(d / "ckpt"), "--out", str(d), "--steps", "17",
                                       "--every", "4", "--kills", str(kills), "--marker", uuid.uuid4().hex],
                                      restarts=3), cwd=str(ROOT), env=_env(), timeout=HANG_GUARD_S,
                            merge_stderr=True)
        assert proc.returncode == 0, proc.stdout[-6000:]
        attempts = [tuple(map(int, ln.split())) for ln in (d / "attempts.txt").read_text().split("\n") if ln]
        finals = [(d / f"final.rank{r}.txt").read_text() for r in (0, 1)]
        runs[name] = (attempts, finals, proc.stdout)
    attempts, finals, out = runs["killed"]
    assert out.count("SIGKILLs itself") == 3, out[-6000:]
    # attempt c resumes from the set written just before attempt c - 1 was killed
    assert attempts == [(0, 0), (1, 4), (2, 8), (3, 12)], (attempts, out[-6000:])
    assert runs["uninterrupted"][0] == [(0, 0)]
    assert finals == runs["uninterrupted"][1], "the restarted run differs from the uninterrupted one"


def test_adacomp_train_resumes_from_its_checkpoint_set(tmp_path) -> None:
    """``adacomp train --checkpoint DIR``: a 2-epoch run continues where the 1-epoch run ended."""
    from adacomp.runtime import checkpoint
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    steps = []
    for epochs in (1, 2):
        proc = run_launcher([sys.executable, "-m", "adacomp.tools.cli", "train", "--workers", "2", "--epochs", str(epochs),
                             "--out", str(out), "--checkpoint", str(ckpt), "--checkpoint-every", "7"],
                            cwd=str(ROOT), env=_env(), timeout=HANG_GUARD_S, merge_stderr=True)
        assert proc.returncode == 0, proc.stdout[-4000:]
        steps.append(json.loads((out / "metrics.json").read_text())["steps"])
        assert checkpoint.read_header(checkpoint.latest(ckpt) / "rank1.pt")["step"] == steps[0] * epochs
    assert steps[1] == steps[0]  # the second run trained only the second epoch
