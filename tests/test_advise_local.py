"""adacomp advise's local-step (DiLoCo family) candidates: the model's exact arithmetic on hand-made
profiles (sync amortised over H, fragments, overlap), the separate table and its caveat."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from adacomp import netmodel
from adacomp.tools.advise import (LOCAL_CAVEAT, _report, _size,
                                  local_candidates, local_steps_arg, main, method_config, predict, predict_local,
                                  rank_methods)

from tests.test_advise import NAMES, SHAPES, _method, _prof

M = 4.0 * sum(s.numel() for s in SHAPES)  # fp32 bytes of the model: one DDP bucket


def test_sync_is_amortised_over_h() -> None:
    """Inner step = forward + backward + optimizer; the sync (compression work + Table I
    communication of the whole model's payload) once every H steps; bytes = payload / H."""
    N, alpha, beta = 4, 1e-4, 1e-6
    prof = _prof(0.01, forward=0.005, optimizer=0.002)  # compute 37 ms per inner step
    compute = 0.005 + 0.03 + 0.002
    fp32 = predict_local(prof, _method("fp32", 4), N, alpha, beta, every=8)
    assert fp32.compute_s == pytest.approx(compute)
    assert fp32.comm_s == pytest.approx(netmodel.ring_allreduce(M, N, alpha, beta))
    assert fp32.step_s == pytest.approx(compute + netmodel.ring_allreduce(M, N, alpha, beta) / 8)
    assert fp32.bytes_per_step == pytest.approx(M / 8) and fp32.peak_bytes == pytest.approx(M)
    # a sparse payload on allgather: 3 compressions, N decompressions of each tensor's payload, the size exchange
    sp = _method("sparse", 0.08, comm="allgather", compress=0.001, decompress=0.0005)
    got = predict_local(prof, sp, N, alpha, beta, every=32)
    work = 3 * 0.001 + N * 3 * 0.0005
    comm = netmodel.allgather(8.0 * 3, N, alpha, beta) + netmodel.allgather(0.02 * M, N, alpha, beta)
    assert got.work_s == pytest.approx(work) and got.comm_s == pytest.approx(comm)
    assert got.step_s == pytest.approx(compute + (work + comm) / 32)
    assert got.bytes_per_step == pytest.approx(0.02 * M / 32)
    # calibration: the work scaled by work_scale, a positive overhead once per sync, a negative one ignored
    sp.work_scale, sp.overhead_s = 0.5, 0.004
    cal = predict_local(prof, sp, N, alpha, beta, every=32)
    assert cal.step_s == pytest.approx(compute + (0.5 * work + 0.004 + comm) / 32)
    sp.overhead_s = -0.004
    assert predict_local(prof, sp, N, alpha, beta, every=32).step_s == pytest.approx(compute + (0.5 * work + comm) / 32)
    # H = 1, dense, the model in one bucket (nothing for DDP to overlap either): DDP's predicted step
    # less its non-finite vote
    one = predict_local(prof, _method("fp32", 4), N, alpha, beta, every=1)
    ddp = predict(prof, _method("fp32", 4), N, alpha, beta)
    assert one.step_s == pytest.approx(ddp.step_s - netmodel.ring_allreduce(4, N, alpha, beta))


def test_fragments_keep_the_average_and_cut_the_peak() -> None:
    N, beta = 4, 1e-6
    prof, mp = _prof(0.01), _method("sparse", 0.08, comm="allgather_fast", compress=0.002)
    whole = predict_local(prof, mp, N, 0.0, beta, every=32)
    four = predict_local(prof, mp, N, 0.0, beta, every=32, fragments=4)
    assert four.step_s == pytest.approx(whole.step_s, rel=1e-12)  # no latency: the same average
    assert four.bytes_per_step == pytest.approx(whole.bytes_per_step)
    assert four.peak_bytes == pytest.approx(whole.peak_bytes / 4) == pytest.approx(0.02 * M / 4)
    assert four.comm_s == pytest.approx(whole.comm_s / 4) and four.work_s == pytest.approx(whole.work_s / 4)
    # with latency every fragment's collective pays alpha: 3 more allgathers' latency per H steps
    alpha = 1e-3
    whole = predict_local(prof, mp, N, alpha, beta, every=32)
    four = predict_local(prof, mp, N, alpha, beta, every=32, fragments=4)
    assert four.step_s - whole.step_s == pytest.approx(3 * alpha * math.log2(N) / 32)


def test_overlap_hides_communication_up_to_overlap_steps_of_compute() -> None:
    N = 2
    prof = _prof(0.010)  # 30 ms of compute per inner step
    mp = _method("sparse", 0.08, comm="allgather_fast", compress=0.001)  # 3 ms of work per sync
    beta = 0.100 / netmodel.allgather(0.02 * M, N, 0.0, 1.0)  # the sync's allgather: 100 ms
    plain = predict_local(prof, mp, N, 0.0, beta, every=8)
    assert plain.comm_s == pytest.approx(0.100)
    assert plain.step_s == pytest.approx(0.030 + (0.003 + 0.100) / 8)
    two = predict_local(prof, mp, N, 0.0, beta, every=8, overlap_steps=2)  # 60 of the 100 ms hidden
    assert two.exposed_s == pytest.approx(0.003 + 0.040)
    assert two.step_s == pytest.approx(0.030 + (0.003 + 0.040) / 8)
    four = predict_local(prof, mp, N, 0.0, beta, every=8, overlap_steps=4)  # all hidden, the work is not
    assert four.step_s == pytest.approx(0.030 + 0.003 / 8)
    # 4 fragments of 25 ms each, every one hidden behind 4 steps: the link is then the bound,
    # 4 x 25 ms per 8 steps = 12.5 ms < 30 ms of compute, so compute + work shows
    frag = predict_local(prof, mp, N, 0.0, beta, every=8, fragments=4, overlap_steps=4)
    assert frag.step_s == pytest.approx(0.030 + 0.003 / 8)
    # a link 8x slower: 800 ms per sync cannot hide behind 8 x 30 ms of compute; the link bounds the step
    slow = predict_local(prof, mp, N, 0.0, 8 * beta, every=8, fragments=4, overlap_steps=8)
    assert slow.step_s == pytest.approx(4 * 0.200 / 8)
    with pytest.raises(ValueError):
        predict_local(prof, mp, N, 0.0, beta, every=2, fragments=4)


def test_candidates_sorted_and_unsupported_last() -> None:
    N, beta = 4, 1e-6
    bad = _method("oktopk", 0.08)
    bad.unsupported = "communicator 'oktopk' is not modelled"
    got = local_candidates(_prof(0.001), [_method("fp32", 4), _method("bf16", 2), bad], N, 0.0, beta, [8, 32])
    assert [(p.method, p.every) for p in got] == [("bf16", 32), ("fp32", 32), ("bf16", 8), ("fp32", 8),
                                                   ("oktopk", 8), ("oktopk", 32)]
    assert all(math.isnan(p.step_s) and p.note for p in got[-2:])


def test_the_table_is_separate_and_prints_the_caveat() -> None:
    N, beta = 4, 1e-6
    prof = _prof(0.001)
    preds = [predict(prof, _method(m, b), N, 0.0, beta) for m, b in (("fp32", 4), ("bf16", 2))]
    ranked = rank_methods(preds)
    local = local_candidates(prof, [_method("fp32", 4), _method("bf16", 2)], N, 0.0, beta, [8, 32])
    args = argparse.Namespace(bandwidth=None, latency=None, model="mlp", batch=32, calibration_steps=0,
                              calibration_rounds=1)
    est = netmodel.NetEstimate(0.0, beta, 0.0)
    text = _report(ranked, preds, est, prof, args, N, local)
    plain = _report(ranked, preds, est, prof, args, N)
    assert "local steps" not in plain and "local steps (DiLoCo family" in text
    flat = " ".join(text.split())
    assert " ".join(LOCAL_CAVEAT.split()) in flat and "adacomp bench time_to_accuracy" in flat
    assert "upper bounds on time-to-accuracy gains" in flat
    lines = text.splitlines()
    # the per-step rows (digit first, 8 columns) are those of the ranking alone; the YAML stays last
    assert {ln.split()[1] for ln in lines if ln[:1].isdigit() and len(ln.split()) == 8} == {"fp32", "bf16"}
    rows = [ln.split() for ln in lines if ln.startswith("L")]
    assert len(rows) == 4 and rows[0][:3] == ["L1", "32", "bf16"]
    base = next(p for p in preds if p.method == "bf16")
    best = local[0]
    assert float(rows[0][4].rstrip("x")) == pytest.approx(base.step_s / best.step_s, abs=0.006)
    assert float(rows[0][7].rstrip("x")) == pytest.approx(best.bytes_per_step / base.comm_bytes, rel=5e-3)
    assert " ".join(rows[0][5:7]) == _size(best.bytes_per_step) and " ".join(rows[0][8:10]) == _size(best.peak_bytes)
    assert [_size(b) for b in (344, 999.6, 9.6 * 1024, 18.3 * 2**20, 3 * 2**30)] == \
        ["344 B", "0.976 KiB", "9.6 KiB", "18.3 MiB", "3 GiB"]
    # the per-step recommendation and its YAML come after the local table, the YAML last as before
    first_local = next(i for i, ln in enumerate(lines) if ln.startswith("L1"))
    assert first_local < next(i for i, ln in enumerate(lines) if ln.startswith("recommendation: "))
    assert text.endswith(plain.split("# ready YAML", 1)[1])


def test_local_steps_option() -> None:
    assert local_steps_arg([0]) == []
    assert local_steps_arg([8, 32, 8], fragments=4, overlap_steps=1) == [8, 32]
    for every, fragments, overlap in (([-1], 1, 0), ([4], 8, 0), ([8], 1, -1)):
        with pytest.raises(ValueError):
            local_steps_arg(every, fragments, overlap)
    assert method_config("topk2")["compressor"] == {"name": "topk", "density": 0.02}
    # bad values fail before any process starts
    assert main(["--model", "mlp", "--local-steps", "-3"]) == 2
    assert main(["--model", "mlp", "--local-methods", "zstd"]) == 2
