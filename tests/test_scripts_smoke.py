"""End-to-end smoke tests of the result scripts at tiny sizes, plus the text corpus and CharLSTM.

Each script runs as a user would run it (``adacomp run -np 2 -- python scripts/X.py``; the netem
experiment drives its own hosts and needs root) and must write its results files into a temporary
directory. Sizes are tiny: these check the plumbing, not the numbers.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 600  # only against a hung run; no test here measures time


def _run(args: list[str]) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _launch(script: str, *args: str) -> str:
    return _run([sys.executable, "-m", "adacomp.tools.cli", "run", "-np", "2", "--",
                 sys.executable, f"scripts/{script}", *args])


def test_char_corpus_split_is_seeded_and_disjoint():
    from adacomp.datasets.text import char_corpus, char_sequences
    x, y, xt, yt, corpus = char_sequences(seq_len=32, seed=3)
    x2, _, xt2, _, _ = char_sequences(seq_len=32, seed=3)
    assert torch.equal(x, x2) and torch.equal(xt, xt2)
    assert x.shape[1] == 32 and torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert corpus.decode(corpus.encode("Iris")) == "Iris" and len(corpus.vocab) == len(set(char_corpus().text))
    ids = corpus.encode(corpus.text)  # train + test partition the non-overlapping windows
    every = Counter(tuple(ids[s:s + 32].tolist()) for s in range(0, (len(ids) - 1) // 32 * 32, 32))
    assert Counter(tuple(r.tolist()) for r in torch.cat([x, xt])) == every
    with pytest.raises(ValueError, match="unknown text source"):
        char_corpus("nope")


def test_charlstm_shapes_and_validation():
    from adacomp.models.charlstm import CharLSTM
    m = CharLSTM(vocab=20, embed=8, hidden=16)
    assert m(torch.zeros(3, 5, dtype=torch.int64)).shape == (3, 5, 20)
    with pytest.raises(ValueError, match="hidden"):
        CharLSTM(hidden=0)


def test_convergence_script(tmp_path):
    out = _launch("convergence.py", "--compressors", "none", "topk", "--densities", "0.1", "--steps", "3",
                  "--eval-every", "2", "--out-dir", str(tmp_path))
    assert "text 2/2" in out
    for name in ("convergence.md", "convergence.csv", "convergence.json", "convergence_digits.png", "convergence_text.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    md = (tmp_path / "convergence.md").read_text()
    assert "| topk density=0.1 | allgather_fast |" in md and "Produced by" in md
    rebuilt = tmp_path / "again"  # tables and plots rebuild from the saved curves, in-process
    spec = importlib.util.spec_from_file_location("convergence_script", ROOT / "scripts" / "convergence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = sys.argv
    try:
        assert module.main(["--from-json", str(tmp_path / "convergence.json"), "--out-dir", str(rebuilt)]) == 0
    finally:
        sys.argv = argv
    assert (rebuilt / "convergence.md").read_text().count("| topk density=0.1 |") == 2


def test_throughput_script(tmp_path):
    _launch("bench_throughput.py", "--inputs", "32", "--width", "64", "--steps", "1", "--warmup", "1",
            "--compressors", "none", "topk", "--out-dir", str(tmp_path))
    rows = (tmp_path / "throughput.csv").read_text().splitlines()
    # none fits allreduce / allgather / allgather_fast / alltoall, topk fits allgather /
    # allgather_fast / alltoall / artopk / oktopk
    assert len(rows) == 1 + 9, rows
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert "## 2 workers" in (tmp_path / "throughput.md").read_text()


def test_throughput_script_zoo_model(tmp_path):
    _launch("bench_throughput.py", "--model", "lstm_lm", "--batch", "1", "--steps", "1", "--warmup", "1",
            "--compressors", "none", "--communicators", "allreduce", "--out-dir", str(tmp_path))
    md = (tmp_path / "throughput_lstm_lm.md").read_text()
    assert "lstm_lm (adacomp.models" in md and "| none |  | allreduce |" in md
    assert not (tmp_path / "throughput.csv").exists()  # the MLP tables are left alone


@pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (network namespaces, tc)")
def test_netem_experiment_script(tmp_path):
    out = _run([sys.executable, "scripts/netem_experiment.py", "--hosts", "2", "--bandwidths", "200mbit",
                "--arms", "dense", "topk_allgather", "--steps", "2", "--warmup", "1", "--inputs", "32",
                "--width", "64", "--prefix", "acxt", "--out-dir", str(tmp_path)])
    assert "netem down" in out
    assert "| 200mbit | topk_allgather |" in (tmp_path / "netem.md").read_text()
    assert (tmp_path / "netem.png").stat().st_size > 0
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "acxt-" not in left


def test_bench_zoo_script(tmp_path):
    """Full-size zoo model, real DDP arm and one method alternating in one launch; ratio to DDP reported."""
    import json
    out = _launch("bench_zoo.py", "--models", "lstm_lm", "--methods", "topk", "--batch", "2", "--warmup", "1",
                  "--steps", "1", "--rounds", "2", "--out-dir", str(tmp_path))
    assert "lstm_lm round 2/2" in out
    rows = {r["method"]: r for r in json.loads((tmp_path / "zoo_steps.json").read_text())["rows"]}
    assert set(rows) == {"ddp", "topk"} and rows["ddp"]["ratio"] == 1.0 and len(rows["topk"]["rounds_ms"]) == 2
    md = (tmp_path / "zoo_steps.md").read_text()
    assert "| topk |" in md and "python scripts/bench_zoo.py --models lstm_lm" in md
