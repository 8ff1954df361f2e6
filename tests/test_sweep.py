"""``adacomp bench sweep`` (adacomp/bench/sweep.py): the summary (speedups over bf16, top-3 agreement) on hand-made rows, and one
tiny end-to-end sweep on 2 real ranks over a shaped link."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sweep():  # type: ignore[no-untyped-def]
    from adacomp.bench import sweep
    return sweep


def test_summary_speedups_and_ranking_agreement() -> None:
    rows = [{"model": "m", "bandwidth": "1gbit", "method": m, "step_ms": s, "pred_ms": p}
            for m, s, p in (("fp32", 200, 210), ("bf16", 100, 120), ("topk", 50, 40), ("qsgd", 80, 130),
                            ("dgc", 90, 100))]
    agree = _sweep().summarise(rows)
    by = {r["method"]: r for r in rows}
    assert by["bf16"]["speedup"] == 1.0 and by["topk"]["speedup"] == 2.0 and by["fp32"]["speedup"] == 0.5
    assert by["topk"]["error_pct"] == pytest.approx(-20.0) and by["bf16"]["pred_speedup"] == 1.0
    (a,) = agree
    assert a["measured_top3"] == ["topk", "qsgd", "dgc"] and a["predicted_top3"] == ["topk", "dgc", "bf16"]
    assert not a["same_set"] and not a["same_order"] and a["best_measured"] == a["best_predicted"] == "topk"


def test_order_within_noise_tolerates_only_gaps_inside_the_measured_spread() -> None:
    def cell(d: float) -> list[dict[str, object]]:
        # advise ranks a before b (40 < 45 ms) but b measured 4% faster; c is far behind both. Six passes
        # alternate +-d around each median: a relative pass-to-pass deviation of about 1.1 d
        return [{"model": "m", "bandwidth": "1gbit", "method": m, "step_ms": s, "pred_ms": p,
                 "pass_ms": [s * (1 - d), s * (1 + d)] * 3}
                for m, s, p in (("a", 52.0, 40.0), ("b", 50.0, 45.0), ("c", 90.0, 95.0), ("bf16", 100.0, 100.0))]
    sweep = _sweep()
    (loose,) = sweep.summarise(cell(0.05))  # the same arm moved 5% between passes: a 4% gap is noise
    assert not loose["same_order"] and loose["within_noise"]
    (tight,) = sweep.summarise(cell(0.01))  # passes agree to 1%: the 4% inversion is real
    assert not tight["same_order"] and not tight["within_noise"]
    rows = cell(0.5)
    rows[2]["step_ms"], rows[2]["pass_ms"] = 20.0, [10.0, 30.0] * 3  # c, ranked third by advise, measured 2.6x
    # faster than a: 2.6 standard errors of the difference even with passes +-50 % apart
    (far,) = sweep.summarise(rows)
    assert not far["within_noise"]


def test_tiny_sweep_end_to_end(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "adacomp.tools.cli", "bench", "sweep", "--models", "lstm_lm", "--bandwidths", "10gbit", "--methods", "fp32",
           "bf16", "--steps", "1", "--warmup", "1", "--repeats", "1", "--batch", "2", "--rounds", "2",
           "--calibration-steps", "1", "--calibration-rounds", "2", "--resolve", "2", "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert {row["method"] for row in data["rows"]} == {"fp32", "bf16"}
    fp32, bf16 = sorted(data["rows"], key=lambda row: row["method"] != "fp32")
    assert bf16["mib"] == pytest.approx(fp32["mib"] / 2, rel=1e-3)  # bytes through the hook are exact
    assert fp32["pred_ms"] > 0 and data["agreement"][0]["model"] == "lstm_lm"
    assert fp32["spread_pct"] >= 0 and "within_noise" in data["agreement"][0]
    # 2 passes, then up to 2 more over both arms while their order is inside the noise (both or neither)
    passes = [len(row["pass_ms"]) for row in data["rows"]]
    assert passes[0] == passes[1] and 2 <= passes[0] <= 4
    from adacomp.tools.stepclock import StepMeasure
    if passes[0] < 4:  # stopped early: the measurements must be resolved
        a, b = (StepMeasure(row["step_ms"], 0.0, tuple(row["pass_ms"])) for row in data["rows"])
        assert abs(a.gap_in_se(b)) >= 2.0
    md = (tmp_path / "sweep.md").read_text()
    assert "in each of 2 passes over the arms" in md and f"{2 * (passes[0] - 2)} extra passes in all" in md and "1 x 2 real steps per method" in md
    assert "Produced by: `adacomp run ... adacomp bench sweep --models lstm_lm" in md
    assert "REDUCED SIZE" in md and "| 10gbit |" in md and (tmp_path / "sweep.png").stat().st_size > 0
