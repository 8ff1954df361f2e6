"""adacomp advise: the prediction (pure, exact on hand-made profiles), the profiles of a real model
and config, and the command end to end on 2 real ranks over an emulated 100 Mbit/s link."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from adacomp import netmodel
from adacomp.tools.advise import (MethodProfile, ModelProfile, method_config, predict, profile_method, profile_model,
                            rank_methods)

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [torch.Size([64, 32]), torch.Size([64]), torch.Size([10, 64])]
NAMES = ["fc2.weight", "fc2.bias", "fc1.weight"]


def _prof(compute: float = 0.0, forward: float = 0.0, optimizer: float = 0.0) -> ModelProfile:
    return ModelProfile(NAMES, SHAPES, [compute] * 3, forward_s=forward, optimizer_s=optimizer)


def _method(name: str, payload_per_elem: float, comm: str = "allreduce", rounds: int = 1,
            compress: float = 0.0, decompress: float = 0.0) -> MethodProfile:
    mp = MethodProfile(name, {})
    for n, s in zip(NAMES, SHAPES):
        dense = payload_per_elem == 4
        mp.route[n] = "none" if dense else name
        mp.communicator[n] = comm
        mp.payload[n] = payload_per_elem * s.numel()
        mp.rounds[n], mp.dense[n] = rounds, dense
        mp.compress_s[n], mp.decompress_s[n] = (0.0, 0.0) if dense else (compress, decompress)
    return mp


def test_prediction_is_table_one_when_only_bytes_cost() -> None:
    N, beta = 4, 1e-6
    M = 4.0 * sum(s.numel() for s in SHAPES)
    vote = netmodel.ring_allreduce(4, N, 0.0, beta)
    fp32 = predict(_prof(), _method("fp32", 4), N, 0.0, beta)
    bf16 = predict(_prof(), _method("bf16", 2), N, 0.0, beta)
    assert math.isclose(fp32.step_s, netmodel.ring_allreduce(M, N, 0.0, beta) + vote, rel_tol=1e-6)
    assert math.isclose(bf16.step_s, netmodel.ring_allreduce(M / 2, N, 0.0, beta) + vote, rel_tol=1e-6)
    assert math.isclose(fp32.comm_bytes, M) and math.isclose(bf16.comm_bytes, M / 2, rel_tol=1e-6)
    ag = predict(_prof(), _method("sparse", 0.08, comm="allgather_fast"), N, 0.0, beta)
    assert math.isclose(ag.step_s, netmodel.allgather(0.02 * M, N, 0.0, beta) + vote, rel_tol=1e-6)


def test_rounds_latency_compression_and_overlap() -> None:
    N, alpha = 2, 1e-3
    one = predict(_prof(), _method("a", 1, rounds=1), N, alpha, 0.0)
    two = predict(_prof(), _method("b", 1, rounds=2), N, alpha, 0.0)
    assert math.isclose(two.step_s - one.step_s, 2 * (N - 1) * alpha, rel_tol=1e-6)  # one more allreduce
    slow = predict(_prof(), _method("c", 1, compress=0.01), N, alpha, 0.0)
    assert math.isclose(slow.step_s - one.step_s, 3 * 0.01, rel_tol=1e-6)  # 3 tensors, compression on the stream
    # compute 10 ms per tensor, comm 1 s, one bucket: the allreduce starts when backward ends
    busy = predict(_prof(0.01), _method("fp32", 4), N, 0.0, 1.0 / (4.0 * sum(s.numel() for s in SHAPES)))
    assert 1.0 + 0.03 - 1e-6 <= busy.step_s <= 1.03 + 0.01


def test_later_rounds_wait_for_the_end_of_backward() -> None:
    """adacomp's hook starts PowerSGD's second round (Q) only once the last bucket is in: round 0 of
    every bucket overlaps backward, the later rounds come after it, one bucket after another."""
    names, shape = ["c.weight", "b.weight", "a.weight"], torch.Size([512, 1024])  # 2 MiB: a bucket each
    prof = ModelProfile(names, [shape] * 3, [0.010] * 3, forward_s=0.0, optimizer_s=0.0)
    N = 2
    beta = 0.005 / 1000.0  # 1000 payload bytes per tensor move in 5 ms

    def method(rounds: int) -> MethodProfile:
        mp = MethodProfile(f"r{rounds}", {})
        for n in names:
            mp.route[n], mp.communicator[n], mp.payload[n] = "m", "allreduce", 1000.0
            mp.rounds[n], mp.dense[n], mp.compress_s[n], mp.decompress_s[n] = rounds, False, 0.0, 0.0
        return mp
    one = predict(prof, method(1), N, 0.0, beta, bucket_mb=1.0)
    two = predict(prof, method(2), N, 0.0, beta, bucket_mb=1.0)  # half the bytes in each round
    vote = netmodel.ring_allreduce(4, N, 0.0, beta)
    assert math.isclose(one.step_s, 0.030 + 0.005 + vote, rel_tol=1e-6)  # only the last bucket's comm shows
    assert math.isclose(two.step_s, 0.030 + 0.0025 + 3 * 0.0025 + vote, rel_tol=1e-6)  # + every bucket's Q
    assert math.isclose(one.comm_bytes, two.comm_bytes)
    skewed = method(2)
    for n in names:
        skewed.round_share[n], skewed.late_s[n] = (0.2, 0.8), 0.001  # measured shares and Q's local work
    got = predict(prof, skewed, N, 0.0, beta, bucket_mb=1.0)
    # the first bucket's Q work (1 ms) runs while the last bucket's P (1 ms) is still on the link;
    # each Q allreduce (4 ms) then waits for the link, and the next bucket's Q work waits for it
    assert math.isclose(got.step_s, 0.030 + 0.001 + vote + 3 * 0.004 + 2 * 0.001, rel_tol=1e-6)


def test_ranking_speedups_and_unsupported() -> None:
    N, beta = 4, 1e-6
    preds = [predict(_prof(), _method(m, b), N, 0.0, beta) for m, b in (("fp32", 4), ("bf16", 2), ("quarter", 1))]
    bad = _method("oktopk", 0.08)
    bad.unsupported = "communicator 'oktopk' is not modelled"
    preds.append(predict(_prof(), bad, N, 0.0, beta))
    ranked = rank_methods(preds)
    assert [p.method for p, _ in ranked] == ["quarter", "bf16", "fp32"]
    speed = {p.method: s for p, s in ranked}
    assert speed["bf16"] == 1.0 and speed["quarter"] > 1.0 > speed["fp32"]
    assert math.isnan(preds[-1].step_s) and preds[-1].note


def test_profiles_of_a_real_model_and_config() -> None:
    from adacomp.tools.advise import model_and_loss
    model, loss = model_and_loss("mlp", 16, {"width": 64})
    prof = profile_model(model, loss, repeats=2)
    assert prof.names[0] == "net.5.bias" or prof.names[0].startswith("net.5")  # backward: last layer first
    assert sorted(prof.names) == sorted(n for n, _ in model.named_parameters())
    assert all(c >= 0 for c in prof.compute_s) and prof.forward_s > 0
    mp = profile_method("topk", prof, repeats=1)
    assert mp.dense["net.1.bias"] and not mp.dense["net.3.weight"]  # configs/topk.yaml: biases dense
    assert mp.payload["net.3.weight"] < 4 * 64 * 64 and mp.communicator["net.3.weight"] == "allgather_fast"
    assert profile_method("moo", prof).unsupported.startswith("policy 'moo'")
    with pytest.raises(ValueError, match="not a built-in .*fp32, bf16"):
        method_config("zstd")


def test_advise_command_end_to_end() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "adacomp.tools.cli", "advise", "--model", "cnn", "--np", "2", "--repeats", "1",
           "--methods", "fp32", "topk", "--bandwidth", "100mbit", "--latency", "100us",
           "--calibration-steps", "3", "--calibration-rounds", "1"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = [line.split("] ", 1)[1] if line.startswith("[0] ") else line for line in r.stdout.splitlines()]
    rows = {ln.split()[1]: ln.split() for ln in out if ln[:1].isdigit() and len(ln.split()) == 8}
    assert set(rows) == {"fp32", "bf16", "topk"}
    mib = {m: float(v[4]) for m, v in rows.items()}
    assert mib["bf16"] == pytest.approx(mib["fp32"] / 2, abs=0.011)  # bytes are exact, printed to 0.01
    assert any(ln.startswith("recommendation: ") for ln in out)
    text = "\n".join(out[out.index("# ready YAML (adacomp.DistributedOptimizer(config=...) or adacomp.engine.ddp.hook(...))") + 1:])
    from adacomp.config import load
    assert load(yaml.safe_load(text)).policy.name == "static"
    assert "emulated 100mbit 100us link" in r.stdout
    assert any(ln.startswith("calibration: 3 x 1 real DDP steps per method") for ln in out)
    bad = subprocess.run(cmd[:4] + ["--model", "cnn", "--methods", "zstd"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "unknown method 'zstd'" in bad.stderr


def test_calibration_overhead_is_added_to_every_prediction() -> None:
    """What calibration measured on one link (measured - modelled step) shifts every link's prediction."""
    N = 2
    mp = _method("q", 1, compress=0.001)
    plain = [predict(_prof(0.001), mp, N, a, b).step_s for a, b in ((1e-4, 1e-9), (1e-3, 1e-7))]
    mp.overhead_s = 0.02
    shifted = [predict(_prof(0.001), mp, N, a, b) for a, b in ((1e-4, 1e-9), (1e-3, 1e-7))]
    assert [p.step_s - q for p, q in zip(shifted, plain)] == pytest.approx([0.02, 0.02])
    assert all(p.overhead_s == 0.02 for p in shifted)


def test_calibration_scales_overstated_work_and_adds_what_the_model_left_out() -> None:
    """Three 2 MiB buckets (a bucket each), 10 ms of backward and 30 ms of profiled compression per
    bucket; 40 ms per bucket on the slow link. Measured 60 ms on a free link where the model gives
    120 ms: the profile overstated the compression, and it is scaled by 1/3 rather than 60 ms being
    taken off every link, which on the slow link would predict less than the link is busy (100 ms
    for 3 x 40 ms of transfers). A model that is too fast instead gets the difference added."""
    from adacomp.tools.advise import fit
    names, shape = ["c.weight", "b.weight", "a.weight"], torch.Size([512, 1024])
    prof = ModelProfile(names, [shape] * 3, [0.010] * 3, forward_s=0.0, optimizer_s=0.0)
    mp = MethodProfile("sparse", {})
    for n in names:
        mp.route[n], mp.communicator[n], mp.payload[n], mp.rounds[n], mp.dense[n] = "s", "allgather_fast", 1000.0, 1, False
        mp.compress_s[n], mp.decompress_s[n] = 0.030, 0.0
    N, slow = 2, 0.040 / 1000.0
    assert predict(prof, mp, N, 0.0, 0.0, bucket_mb=1.0).step_s == pytest.approx(0.120)
    fit(prof, mp, 0.060, N, 0.0, 0.0, bucket_mb=1.0)
    assert mp.work_scale == pytest.approx(1 / 3, rel=1e-6) and mp.overhead_s == pytest.approx(0.0, abs=1e-9)
    assert mp.additive_s == pytest.approx(-0.060)
    assert predict(prof, mp, N, 0.0, 0.0, bucket_mb=1.0).step_s == pytest.approx(0.060)  # the calibration link: as measured
    vote = netmodel.ring_allreduce(4, N, 0.0, slow)
    # slow link: 10 ms backward + 10 ms compression, then the three transfers back to back
    assert predict(prof, mp, N, 0.0, slow, bucket_mb=1.0).step_s == pytest.approx(0.020 + 3 * 0.040 + vote)
    fit(prof, mp, 0.150, N, 0.0, 0.0, bucket_mb=1.0)  # the model is 30 ms too fast: added, on every link
    # (slow link: the third bucket is compressed at 120 ms, its transfer ends at 160)
    assert mp.work_scale == 1.0 and mp.overhead_s == pytest.approx(0.030) == mp.additive_s
    assert predict(prof, mp, N, 0.0, slow, bucket_mb=1.0).step_s == pytest.approx(0.040 + 3 * 0.040 + vote + 0.030)
    fit(prof, mp, 0.020, N, 0.0, 0.0, bucket_mb=1.0)  # faster than backward alone (30 ms): no work left, the rest subtracted
    assert mp.work_scale == pytest.approx(0.0, abs=1e-9) and mp.overhead_s == pytest.approx(-0.010)
    dense = _method("fp32", 4)  # no work of its own to scale: the difference is subtracted
    fit(_prof(0.010), dense, 0.020, N, 0.0, 0.0)
    assert dense.work_scale == 1.0 and dense.overhead_s == pytest.approx(-0.010) == dense.additive_s
    # a measurement below the modelled link time (a noisy probe of the calibration link): the remainder
    # cancels the compute and no more, so no link gets a negative prediction (CI, session 8: -6.8 ms)
    fit(prof, mp, 0.001, N, 0.0, slow, bucket_mb=1.0)
    assert mp.work_scale == pytest.approx(0.0, abs=1e-9) and mp.overhead_s == pytest.approx(-0.030)
    assert predict(prof, mp, N, 0.0, 0.0, bucket_mb=1.0).step_s == pytest.approx(0.0, abs=1e-12)  # a free link: nothing left
    assert predict(prof, mp, N, 0.0, slow / 10, bucket_mb=1.0).step_s > 0
    # slow link: the first bucket's 10 ms of backward, three transfers back to back, less the 30 ms of compute
    assert predict(prof, mp, N, 0.0, slow, bucket_mb=1.0).step_s == pytest.approx(0.010 + 3 * 0.040 + vote - 0.030)


def test_step_measure_spread_is_the_gap_between_passes() -> None:
    from adacomp.tools.stepclock import StepMeasure
    m = StepMeasure(0.011, 1024.0, (0.010, 0.012, 0.011))
    step_s, sent, passes = m  # unpacks like the (seconds, bytes, passes) it is
    assert (step_s, sent, len(passes)) == (0.011, 1024.0, 3) and m.spread == pytest.approx(0.001 / 0.011)  # sd 1 ms, mean 11 ms
    assert StepMeasure(0.01, 0.0, (0.01,)).spread == 0.0


def test_the_size_exchange_of_allgather_blocks_the_training_thread() -> None:
    """``allgather`` exchanges element counts with a blocking collective before each bucket's payload:
    on one link it waits for every payload queued before it, so the next bucket's compression
    cannot overlap the previous bucket's transfer; ``allgather_fast`` (fixed sizes) has no such wait."""
    names, shape = ["c.weight", "b.weight", "a.weight"], torch.Size([512, 1024])  # 2 MiB: a bucket each
    prof = ModelProfile(names, [shape] * 3, [0.010] * 3, forward_s=0.0, optimizer_s=0.0)
    N, beta = 2, 0.020 / 1000.0  # 1000 payload bytes per rank: 20 ms on the link

    def method(comm: str) -> MethodProfile:
        mp = MethodProfile(comm, {})
        for n in names:
            mp.route[n], mp.communicator[n], mp.payload[n] = "m", comm, 1000.0
            mp.rounds[n], mp.dense[n], mp.compress_s[n], mp.decompress_s[n] = 1, False, 0.010, 0.0
        return mp
    vote = netmodel.ring_allreduce(4, N, 0.0, beta)
    sizes = netmodel.allgather(8.0, N, 0.0, beta)
    fast = predict(prof, method("allgather_fast"), N, 0.0, beta, bucket_mb=1.0)
    # backward 10 + compress 10 per bucket: payloads leave at 20, 40, 60 ms and the link ends at 80
    assert math.isclose(fast.step_s, 0.080 + vote, rel_tol=1e-6)
    blocking = predict(prof, method("allgather"), N, 0.0, beta, bucket_mb=1.0)
    # bucket 2's sizes wait for bucket 1's payload (40 ms), bucket 3's for bucket 2's (70 + sizes)
    assert math.isclose(blocking.step_s, 0.100 + 3 * sizes + vote, rel_tol=1e-6)
