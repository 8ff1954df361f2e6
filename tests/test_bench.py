"""``adacomp bench``: the listing and its errors, end-to-end smoke tests of the benchmarks
(adacomp/bench) at tiny sizes, plus the text corpus and CharLSTM.

Each benchmark runs as a user would run it (``adacomp run -np 2 -- adacomp bench NAME``; the netem
experiment drives its own hosts and needs root), from a directory that is not the checkout, and
must write its results files into a temporary directory. Sizes are tiny: these check the plumbing,
not the numbers.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests._netns import needs_netns

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 600  # only against a hung run; no test here measures time


BENCH = [sys.executable, "-m", "adacomp.tools.cli", "bench"]  # `adacomp bench`


def _run(args: list[str], cwd: Path, expect: int = 0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == expect, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _launch(name: str, *args: str, cwd: Path) -> str:
    """``adacomp run -np 2 -- adacomp bench NAME args`` in ``cwd``."""
    return _run([sys.executable, "-m", "adacomp.tools.cli", "run", "-np", "2", "--", *BENCH, name, *args], cwd).stdout


def test_bench_lists_every_benchmark_module_with_its_launch_line(tmp_path):
    from adacomp.tools.bench_cmd import benchmarks
    modules = {p.stem for p in (ROOT / "adacomp" / "bench").glob("*.py")} - {"__init__", "common", "cost_shapes", "cost_passes",
                                                                          "cost_profile"}
    found = benchmarks()
    assert set(found) == modules and len(modules) >= 18
    out = _run(BENCH, tmp_path).stdout  # the installed command, outside the checkout
    for name, b in found.items():
        assert f"  {name} " in out and f"$ {b.launch}" in out and b.summary.endswith(".")
        assert b.launch.startswith(("adacomp bench " + name, "adacomp run -np 2 -- adacomp bench " + name)), b.launch
    assert "$ adacomp run -np 2 -- adacomp bench dense" in out and "docs/results/ under the current directory" in out


def test_bench_unknown_name_exits_2_with_the_valid_names(tmp_path):
    proc = _run([*BENCH, "no_such_bench"], tmp_path, expect=2)
    assert "unknown benchmark 'no_such_bench'" in proc.stderr
    assert "valid names: adaptive, adaptive_network, collectives" in proc.stderr and "zoo" in proc.stderr


def test_nothing_in_the_package_runs_from_the_source_tree():
    """No benchmark script paths (they moved into adacomp/bench) and no sys.path hacks."""
    import re
    for path in (ROOT / "adacomp").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"scripts/\w+\.py", text) and "sys.path.insert" not in text, path


def test_python_m_runs_a_benchmark(tmp_path):
    """``python -m adacomp.bench.NAME`` is the same entry point (here: --help, measuring nothing)."""
    proc = _run([sys.executable, "-m", "adacomp.bench.dense", "--help"], tmp_path)
    assert "adacomp bench dense" in proc.stdout and "relative to the current directory" in proc.stdout


def test_dense_under_the_launcher(tmp_path):
    """The dense-path benchmark times both arms with the shared loop and records the command typed."""
    out = _launch("dense", "--inputs", "16", "--width", "32", "--depth", "1", "--steps", "2", "--block", "1",
                  "--out", "res/dense.md", cwd=tmp_path)
    assert "ratio" in out and "max |param diff| 0.00e+00" in out
    md = (tmp_path / "res" / "dense.md").read_text()
    assert "Produced by: `adacomp run ... adacomp bench dense --inputs 16" in md and "Median of 2 steps per arm" in md


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


def test_convergence_bench(tmp_path):
    out = _launch("convergence", "--compressors", "none", "topk", "--densities", "0.1", "--steps", "3",
                  "--eval-every", "2", "--out-dir", str(tmp_path), cwd=tmp_path)
    assert "text 2/2" in out
    for name in ("convergence.md", "convergence.csv", "convergence.json", "convergence_digits.png", "convergence_text.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    md = (tmp_path / "convergence.md").read_text()
    assert "| topk density=0.1 | allgather_fast |" in md
    assert "Produced by: `adacomp run ... adacomp bench convergence --compressors none topk" in md
    rebuilt = tmp_path / "again"  # tables and plots rebuild from the saved curves, in-process
    from adacomp.bench import convergence
    assert convergence.main(["--from-json", str(tmp_path / "convergence.json"), "--out-dir", str(rebuilt)]) == 0
    again = (rebuilt / "convergence.md").read_text()
    assert again.count("| topk density=0.1 |") == 2
    assert "Produced by: `adacomp run ... adacomp bench convergence --compressors none topk" in again


def test_throughput_bench(tmp_path):
    _launch("throughput", "--inputs", "32", "--width", "64", "--steps", "1", "--warmup", "1",
            "--compressors", "none", "topk", "--out-dir", str(tmp_path), cwd=tmp_path)
    rows = (tmp_path / "throughput.csv").read_text().splitlines()
    # none fits allreduce / allgather / allgather_fast / alltoall, topk fits allgather /
    # allgather_fast / alltoall / artopk / oktopk
    assert len(rows) == 1 + 9, rows
    assert (tmp_path / "throughput.png").stat().st_size > 0
    md = (tmp_path / "throughput.md").read_text()
    assert "## 2 workers" in md and "Command: `adacomp run -np 2 -- adacomp bench throughput --inputs 32" in md


def test_throughput_bench_zoo_model(tmp_path):
    _launch("throughput", "--model", "lstm_lm", "--batch", "1", "--steps", "1", "--warmup", "1",
            "--compressors", "none", "--communicators", "allreduce", "--out-dir", str(tmp_path), cwd=tmp_path)
    md = (tmp_path / "throughput_lstm_lm.md").read_text()
    assert "lstm_lm (adacomp.models" in md and "| none |  | allreduce |" in md
    assert not (tmp_path / "throughput.csv").exists()  # the MLP tables are left alone


@needs_netns
def test_netem_experiment_bench(tmp_path):
    out = _run([*BENCH, "netem_experiment", "--hosts", "2", "--bandwidths", "200mbit",
                "--arms", "dense", "topk_allgather", "--steps", "2", "--warmup", "1", "--inputs", "32",
                "--width", "64", "--prefix", "acxt", "--out-dir", str(tmp_path)], tmp_path).stdout
    assert "netem down" in out
    md = (tmp_path / "netem.md").read_text()
    assert "| 200mbit | topk_allgather |" in md and "Produced by: `adacomp bench netem_experiment --hosts 2" in md
    assert (tmp_path / "netem.png").stat().st_size > 0
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "acxt-" not in left


def test_zoo_bench(tmp_path):
    """Full-size zoo model, real DDP arm and one method alternating in one launch; ratio to DDP reported."""
    import json
    out = _launch("zoo", "--models", "lstm_lm", "--methods", "topk", "--batch", "2", "--warmup", "1",
                  "--steps", "1", "--rounds", "2", "--out-dir", str(tmp_path), cwd=tmp_path)
    assert "lstm_lm round 2/2" in out
    rows = {r["method"]: r for r in json.loads((tmp_path / "zoo_steps.json").read_text())["rows"]}
    assert set(rows) == {"ddp", "topk"} and rows["ddp"]["ratio"] == 1.0 and len(rows["topk"]["rounds_ms"]) == 2
    assert rows["ddp"]["bytes_ratio"] == 1.0 and 0.0 < rows["topk"]["bytes_ratio"] < 0.1  # the method compressed
    md = (tmp_path / "zoo_steps.md").read_text()
    assert "| topk |" in md and "    adacomp bench zoo --models lstm_lm" in md


def _tta_module():  # type: ignore[no-untyped-def]
    from adacomp.bench import time_to_accuracy
    return time_to_accuracy


def test_time_to_accuracy_verdict():
    """The report's per-(task, link) verdict: best local-step arm vs bf16 DDP against the issue-28 bar
    (at 100 Mbit/s >= 3x sooner with >= 100x fewer bytes per host)."""
    tta = _tta_module()

    def row(arm, t, mib, **kw):
        return {"arm": arm, "time_to_target_s": t, "mib_per_host": mib, "train_s": t or 420.0, **kw}
    bf = row("ddp_bf16", 300.0, 1000.0)
    meets = tta.verdict([bf, row("diloco", 150.0, 50.0, local=True, local_every=32),
                         row("sparseloco", 90.0, 5.0, local=True, local_every=32)], "100mbit")
    assert "meets** the bar" in meets and "`sparseloco` (H = 32)" in meets and "3.33x sooner" in meets
    assert "200x fewer bytes" in meets
    # the fastest arm (diloco) misses the byte bar, sparseloco misses the speed bar: judged on the fastest
    short = tta.verdict([bf, row("diloco", 60.0, 50.0, local=True), row("sparseloco", 200.0, 5.0, local=True)],
                        "100mbit")
    assert "does not meet** the bar" in short and "`diloco`" in short and "bytes 20x of the 100x needed" in short
    assert "speed-up" not in short.split("The best")[0]  # 5x sooner: the speed bar is met
    none = tta.verdict([bf, row("localsgd", None, 9.0, local=True)], "1gbit")
    assert "no local-step arm reached the target" in none and "bar is set at 100mbit" in none
    lower = tta.verdict([row("ddp_bf16", None, 1000.0), row("diloco", 100.0, 1.0, local=True)], "100mbit")
    assert ">= 4.20x sooner" in lower  # bf16 never reached it: its 420 s of training are a lower bound
    assert tta.verdict([bf], "100mbit") is None


def _tiny_fortunes(tmp_path):
    """A few KB of text standing in for Debian's fortunes (ADACOMP_FORTUNES_DIR)."""
    text = tmp_path / "fortunes"
    text.mkdir()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbled boxes".split()
    (text / "tiny").write_text("\n%\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(9))
                                            for i in range(400)) + "\n")
    return text


@needs_netns
def test_hsdp_netem_tiny(tmp_path):
    """``adacomp bench hsdp_netem`` end to end at the tiny size: 2 emulated hosts x 2 ranks; every arm
    trained, bytes measured on the capped interfaces; Top-k's per-step cross-host bytes below FSDP2's
    bf16 reduction, DiLoCo's local steps synchronised (bytes crossed, steps a multiple of H)."""
    import json
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), ADACOMP_FORTUNES_DIR=str(_tiny_fortunes(tmp_path)))
    proc = subprocess.run([*BENCH, "hsdp_netem", "--size", "tiny", "--max-seconds", "1", "--local-every", "4",
                           "--arms", "hsdp_bf16", "hsdp_topk", "hsdp_diloco", "--bandwidths", "1gbit",
                           "--prefix", "achz", "--out-dir", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = {r["arm"]: r for r in json.loads((out / "hsdp_netem.json").read_text())}
    assert set(rows) == {"hsdp_bf16", "hsdp_topk", "hsdp_diloco"}
    assert all(r["steps"] > 0 and r["cross_host_kib_per_step"] > 0 for r in rows.values())
    assert rows["hsdp_topk"]["adacomp_payload_mib_per_rank"] > 0
    assert rows["hsdp_topk"]["cross_host_kib_per_step"] < rows["hsdp_bf16"]["cross_host_kib_per_step"]
    assert rows["hsdp_diloco"]["steps"] % 4 == 0 and rows["hsdp_diloco"]["adacomp_payload_mib_per_rank"] > 0
    md = (out / "hsdp_netem.md").read_text()
    assert "| hsdp_diloco (H=4) |" in md and "Produced by: `adacomp bench hsdp_netem --size tiny" in md
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "achz-" not in left


@needs_netns
def test_time_to_accuracy_lm_tiny(tmp_path):
    """The lm task end to end at the tiny size (a 2-layer transformer on a few KB of text standing in for
    Debian's fortunes): compute-only step and comm share, a DDP arm and a local-step arm (checked to have
    synchronised), the tokens and bytes columns and the verdict in the report."""
    import json
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), ADACOMP_FORTUNES_DIR=str(_tiny_fortunes(tmp_path)))
    proc = subprocess.run([*BENCH, "time_to_accuracy", "--size", "tiny", "--tasks", "lm",
                           "--hosts", "2", "--bandwidths", "1gbit", "--max-seconds", "1", "--local-every", "4",
                           "--prefix", "acty", "--out-dir", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "communication share" in proc.stdout and "synchronising steps" in proc.stdout
    rows = {r["arm"]: r for r in json.loads((out / "time_to_accuracy.json").read_text())}
    assert set(rows) == {"ddp_bf16", "diloco"}
    assert rows["diloco"]["synchronised"] and 0 < rows["diloco"]["mib_per_host"] < rows["diloco"]["dense_mib_same_steps"]
    assert rows["diloco"]["steps"] % 4 == 0 and rows["ddp_bf16"]["compute_step_s"] > 0
    md = (out / "time_to_accuracy.md").read_text()
    assert "Communication share of bf16 DDP's step" in md and "| diloco (H=4) |" in md
    assert "tokens to target" in md and "bytes vs ddp_bf16" in md and "**Verdict at 1gbit" in md
    assert "Produced by: `adacomp bench time_to_accuracy --size tiny --tasks lm" in md
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "acty-" not in left


def test_cost_floor_report_before_and_after(tmp_path):
    """``adacomp bench cost run`` measures each cell's memory floor beside its step, and
    ``report-floor --before`` puts an earlier run's ratio beside the new one (equal-split shapes,
    one step: plumbing, not numbers)."""
    out = _run([*BENCH, "cost", "run", "--json", "a.json", "--models", "split10", "--methods",
                "topk,qsgd,qsgd_counter,oktopk", "--counts", "", "--steps", "1", "--warmup", "2"], tmp_path).stdout
    assert "[1/4 " in out and "[4/4 " in out and "min left]" in out  # progress on a run of ~50 minutes
    import json
    rows = json.loads((tmp_path / "a.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {"topk", "qsgd", "qsgd_counter", "oktopk"}
    assert all(r["floor_s"] > 0 and r["step_s"] > 0 and 0 < r["bytes_ratio"] < 1 for r in rows)
    # Ok-Topk's owners need real peers: its cell ran on two processes, rank 0 reporting
    assert [(r["method"], r["processes"], r["rank"]) for r in rows if r["processes"] != 1] == [("oktopk", 2, 0)]
    assert all((r["collective_s"] > 0) == (r["method"] == "oktopk") for r in rows)  # its collectives, timed apart
    # bucket granularity: one selection over each flattened bucket, as the engine runs it
    assert [r["method"] for r in rows if r["fused_buckets"]] == ["oktopk"]
    # the data-flow minimum, timed beside them: error feedback's add and the output's write for Top-k
    # (more than the floor's one read and one write), one read, the write and the uniform numbers
    # (torch's generator) for QSGD
    from adacomp.bench import cost
    assert set(cost.MINIMUM) == set(cost.METHODS)  # every method has its minimum
    by = {r["method"]: r for r in rows}
    assert by["topk"]["minimum"] == ["ef", "write"] and by["qsgd"]["minimum"] == ["read", "write", "rng"]
    assert by["qsgd_counter"]["minimum"] == ["read", "write"]  # rng: counter has no generator pass
    assert all(r["minimum_s"] > 0 for r in rows)
    _run([*BENCH, "cost", "report-floor", "--after", "a.json", "--before", "a.json", "--out", "floor.md"], tmp_path)
    md = (tmp_path / "floor.md").read_text()
    assert "split10 before x floor" in md and "split10 x floor" in md and "| topk |" in md and "| qsgd |" in md
    assert "split10 minimum x floor" in md and "The timed steps follow 2 untimed ones." in md
    assert all(r["warmup"] == 2 for r in rows)
    assert "| oktopk |" in md and "oktopk: its exchange needs real peers" in md
    assert "oktopk: bucket granularity" in md
    # several runs: each cell the median run's figures with the range (made-up ratios 1, 2, 4 per cell)
    for i, scale in enumerate((1.0, 2.0, 4.0)):
        (tmp_path / f"r{i}.json").write_text(json.dumps({"rows": [
            {**r, "step_s": r["floor_s"] * scale * (2.0 if r["method"] == "qsgd" else 1.0)} for r in rows]}))
    _run([*BENCH, "cost", "report-floor", "--after", "r2.json,r0.json,r1.json", "--out", "median.md"], tmp_path)
    md = (tmp_path / "median.md").read_text()
    assert "median of 3 runs" in md
    assert "| topk |" in md and "2.0x (1.0-4.0)" in md and "4.0x ✗ (2.0-8.0)" in md
    # another checkout's runs of the same session: their median ratio in a column of its own
    _run([*BENCH, "cost", "report-floor", "--after", "r0.json", "--previous", "r2.json,r0.json,r1.json",
          "--out", "previous.md"], tmp_path)
    md = (tmp_path / "previous.md").read_text()
    assert "split10 previous x floor" in md and "before x floor" not in md
    topk = next(line for line in md.splitlines() if line.startswith("| topk |")).split(" | ")
    assert topk[1] == "2.0x" and topk[4] == "1.0x"  # previous: the median of 1, 2, 4; after: r0's



def test_cost_passes_against_another_library(tmp_path):
    """``cost passes`` loads this checkout's C library and one built from another ``_native.py`` side
    by side and times each fused pass with both in one process (here a copy whose prefetch distance
    differs: another library, the same bits). A library whose pass gives other bits is refused, and so
    is an ``--against`` that is neither a file nor a revision."""
    import json
    src = (ROOT / "adacomp" / "compressors" / "_native.py").read_text()
    assert src.count("#define AC_AHEAD_BYTES 4096") == 1
    (tmp_path / "other.py").write_text(src.replace("#define AC_AHEAD_BYTES 4096", "#define AC_AHEAD_BYTES 1024"))
    out = _run([*BENCH, "cost", "passes", "--against", "other.py", "--models", "split10", "--rounds", "1",
                "--passes", "add_select,chunk_scan,row_candidates,sparse_mean,sparse_mean_add_select", "--json",
                "p.json"], tmp_path).stdout
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [r["pass"] for r in rows] == ["add_select", "chunk_scan", "row_candidates", "sparse_mean",
                                         "sparse_mean_add_select"]
    assert all(r["before_s"] > 0 and r["after_s"] > 0 and r["tensors"] == 10 for r in rows)
    assert "| add_select | split10 |" in out and "after / before" in out
    wrong = ("rv = _mm256_andnot_ps(lanes_of((unsigned)(zero >> (8 * q)) & 0xffu), rv);\n"
             "            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(g + i + 8 * q), rv);")
    assert src.count(wrong) == 1  # add_select_avx2's sums, made differences in the broken copy
    (tmp_path / "broken.py").write_text(src.replace(wrong, wrong.replace("_mm256_add_ps", "_mm256_sub_ps")))
    bad = subprocess.run([*BENCH, "cost", "passes", "--against", "broken.py", "--models", "split10", "--rounds", "1",
                          "--passes", "add_select"], cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode != 0 and "results differ" in bad.stderr
    bad = subprocess.run([*BENCH, "cost", "passes", "--against", "no-such-revision", "--models", "split10"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert bad.returncode != 0 and "neither a file nor a revision" in bad.stderr

PERF_REPORT = """# Samples: 14K of event 'cpu-clock:pppH'
#
# Overhead  Shared Object
# ........  ..........................
#
    45.92%  adacomp_native_b4f5498547f67407.so
    26.39%  libpython3.11.so.1.0
    14.42%  libtorch_cpu.so
     4.51%  libc.so.6
     4.07%  libtorch_python.so
     2.12%  libc10.so
     0.88%  ld-linux-x86-64.so.2
     0.77%  _ctypes.cpython-311-x86_64-linux-gnu.so
     0.56%  [kernel.kallsyms]
     0.36%  libgomp.so.1
"""


def test_cost_cells_are_timed_after_the_adaptive_methods_settle():
    """A cell's timed steps follow ``--warmup`` untimed ones (WARMUP by default, recorded in the row):
    after 2, SIDCo was still in its first adaptation window, a one-stage fit sending a fraction of its
    target, so its cell timed a step it does not take once its stage count has adapted. Fewer than 2
    (error feedback's second buffer not yet written) is refused before any step, naming the option;
    the floor report says how many each row ran."""
    from adacomp.bench import cost
    early = cost.cell("resnet50", "sidco", 1, sizes=(65536, 1 << 18), warmup=2)
    settled = cost.cell("resnet50", "sidco", 1, sizes=(65536, 1 << 18))
    assert early["warmup"] == 2 and settled["warmup"] == cost.WARMUP >= 15  # three windows of 5 calls
    assert settled["bytes_ratio"] > 5 * early["bytes_ratio"]  # normal values: 1 stage sends ~10x too few
    with pytest.raises(ValueError, match="warmup must be >= 2"):
        cost.cell("resnet50", "topk", 1, sizes=(65536, 1 << 18), warmup=1)
    bad = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", "topk", "--warmup", "1"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         timeout=HANG_GUARD_S)
    assert bad.returncode == 2 and "--warmup takes an integer >= 2" in bad.stderr
    rows = [{"method": "topk"}, {"method": "sidco", "warmup": 30}, {"method": "dgc"}]  # old rows: 2
    assert cost._warmup_text(rows) == ("The timed steps follow 2 untimed ones (30 for sidco; see `WARMUP` in "
                                       "adacomp/bench/cost.py).")


def test_cost_profile_groups_perf_samples_and_the_cell_samples_its_timed_steps_alone(tmp_path):
    """``cost profile``'s pieces that need no perf: a ``perf report`` by shared object summed into
    the package's C passes, the interpreter, torch, libc and the kernel; ``--sizes`` bounds; and
    the cell's ``around`` wrapping each timed step only (what perf's events are enabled for), over
    the tensors of the sizes asked."""
    import argparse
    from adacomp.bench import cost, cost_profile
    got = dict(cost_profile.grouped(cost_profile.shares(PERF_REPORT)))
    assert got["native C passes"] == 45.92 and got["Python interpreter"] == 26.39
    assert abs(got["torch"] - (14.42 + 4.07 + 2.12)) < 1e-9 and abs(got["libc, allocator, loader"] - 6.16) < 1e-9
    assert got["kernel"] == 0.56 and got["other"] == 0.36
    assert cost_profile.sizes_arg("65536:262144") == (65536, 262144) and cost_profile.sizes_arg(":1024")[0] == 0
    for bad in ("65536", "9:3", "a:b", "-1:5"):
        with pytest.raises(argparse.ArgumentTypeError, match="LO:HI"):
            cost_profile.sizes_arg(bad)
    wrapped: list[int] = []

    def around(step):
        def run():
            wrapped.append(1)
            step()
        return run
    r = cost.cell("resnet50", "topk", 3, sizes=(65536, 1 << 18), around=around)
    assert len(wrapped) == 3 and r["tensors"] == 13 and 0 < r["bytes_ratio"] < 1
    with pytest.raises(ValueError, match="no tensor of"):
        cost.cell("resnet50", "topk", 1, sizes=(1, 1000))
    if shutil.which("perf") is not None:  # the whole command where this machine has perf
        out = subprocess.run([*BENCH, "cost", "profile", "--model", "resnet50", "--method", "topk", "--steps", "3",
                              "--sizes", "65536:262144", "--top", "5"], cwd=tmp_path, capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=HANG_GUARD_S)
        if out.returncode == 0:
            assert "x floor" in out.stdout and "native C passes" in out.stdout
        else:  # a kernel that forbids perf's events to this user: the message says so
            assert "perf_event_paranoid" in out.stderr


def test_cost_cell_calls_times_the_c_calls_of_the_timed_steps_alone(tmp_path):
    """``cell --calls`` (and ``profile --calls``, printed): each C entry point the timed steps call,
    its seconds and calls a step (the C passes' share of the step; the warm-up's and the floor passes' calls are not counted: Top-k
    on 13 tensors calls its compensation pass 13 times a step, the floor's passes none); the
    library's entry points are its own again afterwards; perf's control and --calls exclude each
    other."""
    from adacomp.bench import cost_profile
    from adacomp.compressors import _native
    before = _native.library().ac_add_select_abs_not_lt
    out = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", "topk", "--steps", "3",
                          "--sizes", "65536:262144", "--calls"], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    calls = got["c_calls"]
    assert calls["ac_add_select_abs_not_lt"][1] == got["tensors"] == 13
    assert "ac_add" not in calls and "ac_count_abs_gt" not in calls  # the floor's and minimum's passes
    assert 0 < got["c_calls_s"] < 3 * got["step_s"]
    assert abs(got["c_calls_s"] - sum(s for s, _ in calls.values())) < 1e-12
    clock = cost_profile.CallClock()
    assert _native.library().ac_add_select_abs_not_lt is not before
    clock.close()
    assert _native.library().ac_add_select_abs_not_lt is before
    bad = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", "topk", "--calls",
                          "--perf-control", "a,b"], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=HANG_GUARD_S)
    assert bad.returncode != 0 and "without perf" in bad.stderr
    # the same split printed by `profile --calls`, which needs no perf
    shown = subprocess.run([*BENCH, "cost", "profile", "--model", "resnet50", "--method", "topk", "--steps", "2",
                            "--sizes", "65536:262144", "--calls", "--top", "3"], cwd=tmp_path, capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=HANG_GUARD_S)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "its C calls" in shown.stdout and "floors" in shown.stdout and "ac_add_select_abs_not_lt" in shown.stdout


@pytest.mark.parametrize("method", ["topk", "alltoall"])
def test_cost_cell_ops_counts_the_same_aten_ops_on_every_run(method, tmp_path):
    """``cell --ops``: the aten ops each timed step dispatches, by op and by the package's calling
    line, and the Python calls, counts that two runs agree on exactly (what a change of the
    per-tensor glue can be measured by on a noisy machine); the flat views of adacomp.tensors
    dispatch fewer, and --ops is refused beside the timing modes."""
    from adacomp.bench import cost_profile
    from adacomp.bench.cost import cell
    from adacomp.tensors import Dispatch

    def counted(skip: bool) -> dict:
        counter = cost_profile.OpCounter()
        Dispatch.skip_no_ops = skip
        try:
            got = cell("resnet50", method, 2, sizes=(65536, 262144), around=counter.around, warmup=2)
        finally:
            Dispatch.skip_no_ops = True
        assert got["bytes_ratio"] < 0.1  # it compressed
        return counter.report()

    first, again, off = counted(True), counted(True), counted(False)
    assert first == again and first["aten_ops"] == sum(first["aten_ops_by"].values()) > 0
    assert first["python_calls"] > first["aten_ops"] and first["builtin_calls"] > 0  # the odd step's calls
    assert off["aten_ops"] > first["aten_ops"]
    sites = first["aten_ops_at"]
    assert 0 < len(sites) <= cost_profile.OpCounter.SITES
    assert all(k.split()[0] in first["aten_ops_by"] and ".py:" in k and "bench/" not in k and "tensors.py" not in k
               for k in sites)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", method, "--steps", "2",
                          "--warmup", "2", "--sizes", "65536:262144", "--ops"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["aten_ops"] == first["aten_ops"]
    bad = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", method, "--ops", "--calls"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert bad.returncode != 0 and "--ops" in bad.stderr


def test_cost_cell_against_alternates_two_c_libraries_over_the_timed_steps(tmp_path):
    """``cell --against REV|PATH``: the timed steps run this checkout's C library and another
    version's in turn (here a copy whose prefetch distance differs: the same bits), the package's own
    put back afterwards; each way's median step and step over floor are reported; a revision that does
    not exist, or --against beside --calls or --toggle, is refused."""
    from adacomp.bench import cost_profile
    from adacomp.compressors import _native
    src = (ROOT / "adacomp" / "compressors" / "_native.py").read_text()
    assert src.count("#define AC_AHEAD_BYTES 4096") == 1
    (tmp_path / "other.py").write_text(src.replace("#define AC_AHEAD_BYTES 4096", "#define AC_AHEAD_BYTES 1024"))
    mine = _native.library()
    against = cost_profile.Against(str(tmp_path / "other.py"))
    seen: list[object] = []
    step = against.around(lambda: seen.append(_native._lib))
    for _ in range(3):
        step()
    assert seen == [mine, against.libs[1], mine] and against.libs[1] is not mine and _native._lib is mine
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", "topk", "--steps", "4",
                          "--warmup", "2", "--sizes", "65536:262144", "--against", "other.py"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["against"] == "other.py" and got["on_s"] > 0 and got["off_s"] > 0 and got["bytes_ratio"] < 0.1
    for extra in (["--calls"], ["--toggle", "adacomp.compressors.sidco:SIDCoCompressor.one_read_stages"]):
        bad = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", "topk", "--against",
                              "other.py", *extra], cwd=tmp_path, capture_output=True, text=True, env=env,
                             timeout=HANG_GUARD_S)
        assert bad.returncode != 0 and "--against" in bad.stderr
    bad = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", "topk", "--against",
                          "no-such-revision"], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=HANG_GUARD_S)
    assert bad.returncode != 0 and "neither a file nor a revision" in bad.stderr


def test_cost_cell_toggle_alternates_a_switch_over_the_timed_steps(tmp_path):
    """``cell --toggle MODULE:NAME.ATTR``: the timed steps run with the switch on and off in turn
    (restored after each), and the cell reports each way's median step and median step over the
    floor timed beside it; a spec that names no boolean, or beside --calls, is refused."""
    from adacomp.bench import cost_profile
    from adacomp.compressors.sidco import SIDCoCompressor
    toggle = cost_profile.Toggle("adacomp.compressors.sidco:SIDCoCompressor.one_read_stages")
    seen: list[bool] = []
    step = toggle.around(lambda: seen.append(SIDCoCompressor.one_read_stages))
    for _ in range(5):
        step()
    assert seen == [True, False, True, False, True] and SIDCoCompressor.one_read_stages is True
    got = toggle.report({"steps_s": [2.0, 4.0, 2.0, 6.0], "floors_s": [1.0, 1.0, 2.0, 2.0]})
    assert (got["on_s"], got["off_s"], got["on_x_floor"], got["off_x_floor"]) == (2.0, 5.0, 1.5, 3.5)
    with pytest.raises(SystemExit, match="not a boolean"):
        cost_profile.Toggle("adacomp.compressors.sidco:SIDCoCompressor.stages_for")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", "sidco", "--steps", "4",
                          "--warmup", "12", "--sizes", "65536:262144", "--toggle",
                          "adacomp.compressors.sidco:SIDCoCompressor.one_read_stages"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["toggle"].endswith("one_read_stages") and got["on_s"] > 0 and got["off_s"] > 0
    assert got["on_x_floor"] > 0 and got["off_x_floor"] > 0 and got["bytes_ratio"] < 0.1  # it compressed
    bad = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", "sidco", "--calls", "--toggle",
                          "adacomp.compressors.sidco:SIDCoCompressor.one_read_stages"], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert bad.returncode != 0 and "--toggle" in bad.stderr


def test_cost_cell_toggle_cells_alternates_whole_cells(tmp_path):
    """``cell --toggle SPEC --cells N``: N pairs of whole cells, the switch on in the first of each and
    off in the second (restored after each), each way's medians over its cells' steps; alltoall's
    residuals left owed then written (the switch ``ResidualMemory.defers``) through the command;
    without --toggle it is refused."""
    from adacomp.bench import cost_profile
    from adacomp.memories.base import ResidualMemory
    toggle = cost_profile.Toggle("adacomp.memories.base:ResidualMemory.defers")
    seen: list[bool] = []
    cells = iter([{"steps_s": [2.0, 4.0], "floors_s": [1.0, 1.0]}, {"steps_s": [6.0, 8.0], "floors_s": [2.0, 2.0]},
                  {"steps_s": [2.0, 2.0], "floors_s": [1.0, 2.0]}, {"steps_s": [8.0, 8.0], "floors_s": [2.0, 4.0]}])

    def one() -> dict:
        seen.append(ResidualMemory.defers)
        return next(cells)
    got = toggle.cells(2, one)
    assert seen == [True, False, True, False] and ResidualMemory.defers is True
    assert (got["on_s"], got["off_s"], got["on_p10_s"], got["off_p10_s"]) == (2.0, 8.0, 2.0, 6.0)
    assert got["on_cells_x_floor"] == [3.0, 1.5] and got["off_cells_x_floor"] == [3.5, 3.0]
    assert (got["on_x_floor"], got["off_x_floor"]) == (2.0, 3.5) and got["cells"] == 2
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", "alltoall", "--steps", "2",
                          "--warmup", "2", "--sizes", "2000000:3000000", "--toggle",
                          "adacomp.memories.base:ResidualMemory.defers", "--cells", "1"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cells"] == 1 and got["on_s"] > 0 and got["off_s"] > 0 and got["bytes_ratio"] < 0.1
    bad = subprocess.run([*BENCH, "cost", "cell", "--model", "resnet50", "--method", "alltoall", "--cells", "2"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert bad.returncode != 0 and "--cells" in bad.stderr


def test_cost_cells_on_the_models_own_gradients(tmp_path):
    """``--grads model``: each cell's gradients come from the zoo model's backward passes, laid out
    as the cost shapes name them (GPT-2's linear weights transposed to the Conv1D layout), one set
    per synthetic batch; ``run`` computes them once per model for its cells."""
    from adacomp.bench import cost
    from adacomp.models import build
    from adacomp.models.synthetic import synthetic_batch
    sets = cost.model_gradients("gpt2_small", 2)
    shapes = cost._shapes("gpt2_small")
    assert len(sets) == 2 and [tuple(g.shape) for g in sets[0].values()] == [tuple(s) for _, s in shapes]
    torch.manual_seed(0)
    net = build("gpt2_small")
    batch = synthetic_batch(net, cost.GRADIENT_BATCH["gpt2_small"], seed=1)
    batch.loss_fn(net(batch.inputs), batch.targets).backward()
    for (name, shape), p in zip(shapes, net.parameters()):
        want = p.grad if tuple(p.grad.shape) == tuple(shape) else p.grad.t()
        assert torch.equal(sets[1][name], want), name
    assert any(tuple(p.shape) != tuple(s) for (_, s), p in zip(shapes, net.parameters()))  # some were transposed
    assert not torch.equal(sets[0]["h.0.attn.c_attn.weight"], sets[1]["h.0.attn.c_attn.weight"])
    _run([*BENCH, "cost", "run", "--json", "m.json", "--models", "lstm_lm", "--methods", "topk", "--counts", "",
          "--steps", "1", "--grads", "model"], tmp_path)
    import json
    (row,) = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert row["grads"] == "model" and 0 < row["bytes_ratio"] < 1 and row["step_s"] > 0
    _run([*BENCH, "cost", "report-floor", "--after", "m.json", "--out", "floor.md"], tmp_path)
    assert "the zoo models' own" in (tmp_path / "floor.md").read_text()
    # how well Top-k's sampled floor guesses there, for both line placements
    out = _run([*BENCH, "cost", "floors", "--models", "lstm_lm", "--steps", "2", "--threads", "1"], tmp_path).stdout
    assert "lstm_lm     first lines  passed / k over" in out and "lstm_lm     Weyl offsets passed / k over" in out


def test_zoo_report_puts_small_batch_rows_in_their_own_table(tmp_path):
    """Rows at a model's default batch fill the main table; rows at another batch (issue 32's ~1 s
    steps) get their own table with the bar and the list of methods above it."""
    from types import SimpleNamespace
    from adacomp.bench import zoo

    def row(model: str, method: str, batch: int, ratio: float) -> dict:
        return {"model": model, "params_m": 1.0, "tensors": 3, "batch": batch, "method": method,
                "step_ms": 100.0 * ratio, "ratio": ratio, "compress_share": 0.1, "rounds_ms": [100.0 * ratio],
                "rounds": 1, "warmup": 1, "steps": 1, "command": f"cmd {model} {batch}"}
    rows = [row("resnet50", "ddp", 16, 1.0), row("resnet50", "topk", 16, 1.1),
            row("resnet50", "ddp", 2, 1.0), row("resnet50", "topk", 2, 1.3), row("resnet50", "qsgd", 2, 1.2)]
    rows[-1]["bytes_ratio"] = 0.125
    rows.append({**row("resnet50", "sidco", 2, 0.9), "warmup": 16})  # an arm that settles later (its stages adapt)
    args = SimpleNamespace(out_dir=str(tmp_path), merge=False, threads=1, command="adacomp bench zoo --report-only")
    zoo.report(rows, args, 2)
    md = (tmp_path / "zoo_steps.md").read_text()
    main, short = md.split("## At batches where one step takes about a second")
    assert "| topk |  | 1.10x (10%) |" in main and "1.30x" not in main
    assert "resnet50 (batch 2)" in short and "| topk | 1.30x (10%) ✗ |" in short and "| qsgd | 1.20x (10%, 12.5% B) |" in short
    assert "Above the bar: resnet50: topk." in short and "cmd resnet50 2" in short
    assert "resnet50: 1 round(s) x (1 warm-up + 1 measured steps; sidco: 16 warm-up)" in short
    assert zoo.arm_config("sidco")[1] >= 15  # three adaptation windows of 5 calls


def test_gpu_step_arms_with_knobs_on_the_devices_path(tmp_path, monkeypatch):
    """``adacomp bench gpu_step`` (its CPU check of the GPU's code path): ``method@knob=value`` arms
    run in one process beside the method, the knob changes what it claims (counting one by one
    reads back more often; fusion compresses whole buckets), and an unknown knob names the choices."""
    import json
    from adacomp import devices
    from adacomp.bench import gpu_step
    from adacomp.compressors import sparse
    monkeypatch.setattr(devices, "EMULATE", True)
    monkeypatch.setenv("ADACOMP_NATIVE", "0")
    small = json.dumps({"image_size": 32, "classes": 10, "blocks": [1, 1, 1, 1]})
    assert gpu_step.main(["--device", "cpu", "--models", "resnet50", "--batch", "2", "--model-args", small,
                          "--methods", "mstopk", "mstopk@counts=off,upload=pageable", "mstopk@counts=bucket",
                          "topk@fuse=1", "--rounds", "1", "--warmup", "1", "--steps", "1",
                          "--out-dir", str(tmp_path)]) == 0
    assert sparse.BATCHED_COUNTS == "auto" and devices.PINNED_UPLOAD  # restored after each arm
    rows = {r["method"]: r for r in json.loads((tmp_path / "gpu_step.json").read_text())["rows"]}
    assert set(rows) == {"plain", "mstopk", "mstopk@counts=off,upload=pageable", "mstopk@counts=bucket", "topk@fuse=1"}
    assert rows["mstopk@counts=off,upload=pageable"]["host_waits"] > 2 * rows["mstopk"]["host_waits"] > 0
    assert rows["mstopk@counts=bucket"]["host_waits"] == rows["mstopk"]["host_waits"]
    assert all(r["compression"] > 1 for m, r in rows.items() if m != "plain")
    with pytest.raises(SystemExit):
        gpu_step.main(["--device", "cpu", "--methods", "topk@counts=radix"])
    assert gpu_step.parse_arm("topk@fuse=1,counts=off") == ("topk", {"fuse": "1", "counts": "off"})
    with pytest.raises(ValueError, match="choose one of"):
        gpu_step.parse_arm("topk@speed=max")
