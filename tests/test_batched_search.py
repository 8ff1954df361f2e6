"""The threshold searches' batched counts (``ThresholdCounter.prefetch``, used where each count read
back is a host wait: on a GPU): every searched threshold, and so every selection, is bitwise the
one-by-one search's, with far fewer reads. Run on the CPU with ``adacomp.devices.EMULATE``."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from adacomp import devices
from adacomp.compressors.gaussiank import GaussianKCompressor, adjust, adjust_thresholds
from adacomp.compressors.mstopk import MSTopkCompressor
from adacomp.compressors.redsync import RedSyncCompressor
from adacomp.compressors import registry as _registry, sparse
from adacomp.compressors.sparse import Magnitudes, ThresholdCounter, bisect_thresholds
from adacomp.compressors.workspace import Workspace
from tests._dist import run_workers
from tests._fronts import flat_params, train_through


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for n in (3_000, 70_000, 300_000):  # below and above the 2^16 compaction size
        normal = torch.randn(n, generator=g)
        out += [(f"normal{n}", normal),
                (f"laplace{n}", torch.distributions.Laplace(0.0, 1.0).sample((n,))),
                (f"student{n}", torch.distributions.StudentT(2.0).sample((n,))),
                (f"ties{n}", torch.round(normal * 4) / 4),  # many equal magnitudes at every threshold
                (f"sparse{n}", normal * (torch.rand(n, generator=g) < 0.02))]  # mostly exact zeros
    return out


TENSORS = _tensors()


def get_cls(kind: str) -> Any:
    return _registry.cls(kind)


@pytest.fixture(params=["sort", "bucket"])
def counts_way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way :data:`adacomp.compressors.sparse.BATCHED_COUNTS` counts a batch: the same counts."""
    monkeypatch.setattr(sparse, "BATCHED_COUNTS", request.param)
    return str(request.param)


def _search(kind: str, flat: torch.Tensor, density: float) -> tuple[float, int]:
    """The searched threshold and the counter's reads, as the compressor's select() runs it."""
    ws = Workspace()
    k = max(1, int(flat.numel() * density))
    if kind == "gaussiank":
        c = GaussianKCompressor(density)
        counter = ThresholdCounter.for_search(flat.abs(), True, density, ws)
        return c.threshold(flat.abs(), flat, k, counter), counter.reads
    m = Magnitudes(flat, ws)
    strict = kind == "redsync"
    counter = m.search_counter(strict, density, ws)
    if kind == "mstopk":
        return MSTopkCompressor(density).threshold(m.written() if m.a is not None else flat, k, counter,
                                                   m.max(), m.mean()), counter.reads
    return RedSyncCompressor(density).threshold(m.a if m.a is not None else flat, k, counter,
                                                m.max(), m.mean()), counter.reads


@pytest.mark.parametrize("native", [True, False], ids=["C passes", "torch"])
@pytest.mark.parametrize("kind", ["mstopk", "redsync", "gaussiank"])
def test_batched_search_takes_the_same_path_with_fewer_reads(kind: str, native: bool, counts_way: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADACOMP_NATIVE", "1" if native else "0")
    one_by_one, batched = 0, 0
    for name, flat in TENSORS:
        for density in (0.001, 0.01, 0.1):
            monkeypatch.setattr(devices, "EMULATE", False)
            thr, reads = _search(kind, flat, density)
            monkeypatch.setattr(devices, "EMULATE", True)
            thr_b, reads_b = _search(kind, flat, density)
            assert thr_b == thr, (name, density)
            one_by_one, batched = one_by_one + reads, batched + reads_b
    if kind == "gaussiank":  # five corrections at most: one batch covers them all
        assert batched <= one_by_one
    else:  # 20-25 bisection steps in batches of 8 levels
        assert batched * 2 < one_by_one, (batched, one_by_one)


@pytest.mark.parametrize("kind", ["mstopk", "redsync", "gaussiank"])
def test_batched_selection_is_bitwise(kind: str, counts_way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the compressors' own select() (their Magnitudes read back together, the samples
    ranking a NaN lowest): the same indices."""
    from adacomp.compressors import get
    flat = TENSORS[7][1]
    for batched in (False, True):
        monkeypatch.setattr(devices, "EMULATE", batched)
        got = get(kind, density=0.01).select(flat, "w")
        if not batched:
            ref = got
    assert torch.equal(got, ref)


def test_prefetch_counts_equal_the_comparisons_at_float32_boundaries(counts_way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Thresholds a hair either side of a stored value (doubles that round onto it in float32), -0.0,
    +-inf, and a kept set: ``>=`` and ``>`` counts as torch's comparisons give them."""
    monkeypatch.setattr(devices, "EMULATE", True)
    a = torch.tensor([0.0, -0.0, 1.0, 1.0, 0.1, 2.5, math.inf, 3.0, 0.1], dtype=torch.float32).abs()
    v = float(torch.tensor(0.1, dtype=torch.float32))
    thrs = [0.0, -0.0, v, math.nextafter(v, 1), math.nextafter(v, -1), 0.1, 1.0, 2.9999999999, math.inf, 10.0]
    for strict in (False, True):
        for floor in (None, 0.05):
            counter = ThresholdCounter(a, strict, Workspace())
            if floor is not None:
                counter.compact(floor)
            counter.prefetch(thrs)
            for t in thrs:
                want = int((a > t).sum()) if strict else int((a >= t).sum())
                assert counter.count(t) == want, (strict, floor, t)


def test_a_nan_turns_batching_off_and_counts_stay_exact(counts_way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "EMULATE", True)
    a = torch.tensor([1.0, math.nan, 3.0, 0.5])
    counter = ThresholdCounter(a, False, Workspace())
    counter.prefetch([0.7, 2.0])
    assert not counter.batched and not counter.known(0.7)
    assert counter.count(0.7) == 2 and counter.count(2.0) == 1


def test_the_enumerated_thresholds_are_the_ones_the_searches_compute() -> None:
    """Every path of a bisection / of Gaussian-k's corrections passes only thresholds the
    enumeration listed (the same doubles, so prefetched counts are found)."""
    base, span, levels = 0.37, 1.9, 6
    listed = set(bisect_thresholds(0.0, 1.0, base, span, levels))
    for path in range(1 << levels):
        lo, hi = 0.0, 1.0
        for bit in range(levels):
            mid = 0.5 * (lo + hi)
            assert base + mid * span in listed
            lo, hi = (mid, hi) if path >> bit & 1 else (lo, mid)
    listed = set(adjust_thresholds(0.8, None, None, 5))
    assert len(listed) == 31
    for path in range(1 << 5):
        state: tuple[float, float | None, float | None] = (0.8, None, None)
        for bit in range(5):
            assert state[0] in listed
            state = adjust(*state, bool(path >> bit & 1))


def test_largest_k_with_one_host_wait_is_the_canonical_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ties at the k-th magnitude to the lowest indices, NaN above every number: the device-side
    tie fill picks what the one-by-one path picks."""
    from adacomp.compressors.sparse import largest_k
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        n = int(torch.randint(10, 5000, (1,), generator=g))
        mags = torch.round(torch.rand(n, generator=g) * 8) / 8  # heavy ties
        if trial % 3 == 0:
            mags[torch.randint(n, (3,), generator=g)] = math.nan
        idx = torch.sort(torch.randperm(4 * n, generator=g)[:n]).values
        for k in (1, n // 7 + 1, n // 2, n - 1):
            monkeypatch.setattr(devices, "EMULATE", False)
            ref = largest_k(idx, mags, k)
            monkeypatch.setattr(devices, "EMULATE", True)
            assert torch.equal(largest_k(idx, mags, k), ref), (trial, k)


def _config(method: str) -> dict:
    """The zoo's config of ``method``; Chunk-Top-k (SparseLoCo's compressor, not a zoo arm) on the
    zoo's allgather_fast with residual memory; QSGD with ``rng: counter``; bf16 cast tensor by tensor."""
    from adacomp.bench.zoo import arm_config
    if method in ("chunktopk", "chunktopk_dead"):
        base = arm_config("topk")[0]
        # chunk 512 keeps 10 a chunk: the 8-wide writing of the kept values and decoding of codes run too
        return {**base, "compressor": {"name": "chunktopk", "density": 0.02, "chunk": 512, "bits": 2}, "layers": []}
    if method == "qsgd_counter":  # QSGD's counter-based stream: the C loop against its torch twin
        base = arm_config("qsgd")[0]
        return {**base, "compressor": {**base["compressor"], "rng": "counter"}}
    if method == "bf16":  # one entry per tensor, each cast into its own span of the bucket's buffer
        return {**arm_config(method)[0], "fusion": {"fuse_before_compress": False}}
    if method in ("adtopk_dead", "adtopk_wide"):  # ADTopk on other nets (see _train_both_ways)
        return arm_config("adtopk")[0]
    if method == "adtopk_1d":  # the biases compressed too (the zoo sends them dense): one-row tensors
        return {**arm_config("adtopk")[0], "layers": []}
    if method == "alltoall_small":  # alltoall on a net with a 16K-element layer (see _train_both_ways)
        return arm_config("alltoall")[0]
    if method == "alltoall_deferred":  # past DEFER_ZEROING_MIN sent positions in each 64K part of the 131K layer
        base = arm_config("alltoall")[0]
        return {**base, "compressor": {**base["compressor"], "density": 0.08}}
    if method == "gaussiank_capped":  # no corrections: the normal fit of a half-dead layer passes past the cap
        base = arm_config("gaussiank")[0]
        return {**base, "compressor": {**base["compressor"], "max_adjust": 0}}
    if method == "sidco_stages":  # the stage count SIDCo settles on for normal values, from the first step
        base = arm_config("sidco")[0]
        return {**base, "compressor": {**base["compressor"], "stages": 3, "adaptive": False}}
    if method in ("topk_deferred", "sidco_deferred"):  # past DEFER_ZEROING_MIN sent positions on the 131K layer
        base = arm_config(method.split("_")[0])[0]  # (and on each FSDP rank's half of it)
        return {**base, "compressor": {**base["compressor"], "density": 0.08}}
    return arm_config(method)[0]


def _train_both_ways(method: str, front: str, switch: str) -> bool:
    """On each of 2 gloo ranks (different data): five steps with error feedback through ``front``,
    from one start, once each way: ``switch`` "emulate": the CPU path, then the accelerators' (batched
    counts; torch's ops on both sides); "native": torch's ops, then the fused C passes (error
    feedback's compensation read by the compressor, the C selections and means); "dest": every mean
    in an output of its own, then in the gradient where the engine allows it (and it did)."""
    import torch.distributed as dist

    import adacomp
    dist.init_process_group("gloo")
    adacomp.init()  # the optimizer's backend: the group that exists
    rank = dist.get_rank()

    def net() -> torch.nn.Module:
        torch.manual_seed(0)  # tensors above and below the 2^16 compaction size
        if method == "adtopk_wide":  # rows of 13000: q = 130, more than 128 candidates a row (VGG-16's fc6
            # kind: their order statistics by a radix select, not the AVX2 rank count; cost_notes item 56;
            # a wrong statistic mostly shows as a tie, which torch.topk then answers, so the statistics
            # themselves are checked against a sort in test_adtopk_speed)
            return torch.nn.Sequential(torch.nn.Linear(13000, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))
        if method == "alltoall_small":  # parts of 8192 elements: Top-k's whole-tensor pick from a sampled floor
            return torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64),
                                       torch.nn.Tanh(), torch.nn.Linear(64, 10))
        if method not in ("adtopk_dead", "chunktopk_dead", "gaussiank_capped"):
            return torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10))
        # every other unit of a ReLU layer never fires: all-zero rows in its weight's gradient, as
        # VGG-16's dead units give (ADTopk's all-zero rows, cost_notes item 54; Chunk-Top-k's all-zero
        # chunks, whose k-th is 0 and which keep the candidate floor, item 58)
        body = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        with torch.no_grad():
            body[0].bias[::2] = -1e3
        return body

    def run() -> torch.Tensor:
        trained = net()
        train_through(front, trained, {**_config(method), "min_numel": 0}, rank, 32)
        return flat_params(trained)

    import os
    from adacomp.engine import error_feedback
    devices.EMULATE = False
    given = error_feedback.with_dest
    dests: list[int] = []
    whole: list[int] = []  # whole-tensor picks that must have run (ADTopk's rows, Top-k's floor, Gaussian-k's cap)
    if switch == "native":
        os.environ["ADACOMP_NATIVE"] = "0"
    elif switch == "dest":  # the reference keeps every mean in an output of its own
        error_feedback.with_dest = lambda e, g: e  # type: ignore[assignment]
    ref = run()
    if switch == "native":
        os.environ["ADACOMP_NATIVE"] = "1"
        # the pass that must have run: alltoall's second-stage mean added to the kept error
        # unwritten; DGC's masking and Chunk-Top-k's residual left to the next compensation's pass
        from adacomp.compressors.chunktopk import ChunkTopkCompressor
        from adacomp.compressors.dgc import DGCCompressor
        from adacomp.compressors.sparse import SparseCompressor
        from adacomp.compressors.topk import TopkCompressor
        must = {"topk_deferred": (SparseCompressor, "compensate_owed", lambda a, k: True),
                "alltoall_deferred": (SparseCompressor, "compensate_owed", lambda a, k: True),  # a part's
                "sidco_deferred": (SparseCompressor, "compensate_owed", lambda a, k: True),
                **{"alltoall": (TopkCompressor, "compensate_mean_into", lambda a, k: True),
                "dgc": (DGCCompressor, "accumulate_into", lambda a, k: k.get("zeroed") is not None),
                "chunktopk": (ChunkTopkCompressor, "compensate_owed", lambda a, k: True)}}.get(method)
        if method == "chunktopk_dead":  # the C selection must answer for a tensor holding all-zero chunks
            from adacomp.compressors import _native
            select = _native.chunk_topk

            def chunks_answered(a: torch.Tensor, rows: int, chunk: int, *args: Any, **kw: Any) -> Any:
                got = select(a, rows, chunk, *args, **kw)
                dead = bool((a[:rows * chunk].view(rows, chunk) == 0).all(1).any())
                dests.append(int(got is not None and dead))
                return got
            _native.chunk_topk = chunks_answered  # type: ignore[assignment]
        # ADTopk's one-call selection must answer (with all-zero rows: which zeros a dead row sends
        # cannot change the parameters; test_adtopk_speed checks those columns against torch.topk's)
        if method in ("adtopk", "adtopk_dead", "adtopk_wide"):
            from adacomp.compressors import _native
            finish = _native.row_finish

            def answered(*args: Any, **kw: Any) -> Any:
                got = finish(*args, **kw)
                shown = {"adtopk": True, "adtopk_dead": bool((args[2] == 2).any()),  # an all-zero row
                         "adtopk_wide": args[4] >= 128}[method]  # q >= 128: every row > 128 candidates
                dests.append(int(got is not None and shown))
                return got
            _native.row_finish = answered  # type: ignore[assignment]
        if method == "sidco":  # SIDCo's one-call choice must read the candidates error feedback's add kept
            from adacomp.compressors import _native
            choose = _native.sidco_choose

            def adopted(a: torch.Tensor, cands: Any, *args: Any) -> Any:
                got = choose(a, cands, *args)
                dests.append(int(cands is not None and got is not None))
                return got
            _native.sidco_choose = adopted  # type: ignore[assignment]
        if method == "alltoall_small":  # a whole part picked from its sampled floor; no joined payload built
            from adacomp.communicators.alltoall import _Joined
            from adacomp.compressors import _native
            filtered = _native._pick_filtered

            def floored(*args: Any) -> int:
                got = filtered(*args)
                whole.append(int(got == 1))
                return got
            _native._pick_filtered = floored  # type: ignore[assignment]

            def joined(self: Any) -> Any:
                raise AssertionError("alltoall joined its parts' payloads for a residual memory")
            _Joined.payload = joined  # type: ignore[method-assign]
        if method in ("chunktopk", "redsync", "gaussiank"):  # Chunk-Top-k's payload written by C run by run;
            from adacomp.compressors import _native  # RedSync's and Gaussian-k's small tensors searched in one C call
            wrapped = {"chunktopk": "chunk_encode", "redsync": "bisect_band", "gaussiank": "gauss_band"}[method]
            inner = getattr(_native, wrapped)

            def ran(*args: Any) -> Any:
                got = inner(*args)
                whole.append(int(got is True or (method != "chunktopk" and got is not None)))
                return got
            setattr(_native, wrapped, ran)
        if method == "gaussiank_capped":  # a tensor counted whole, capped: its gathered values ranked in C
            from adacomp.compressors import _native
            take, pick_all = _native.take, _native.pick_largest
            taken: list[Any] = [None]

            def took(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
                taken[0] = take(x, idx)
                return taken[0]

            def capped(mags: torch.Tensor, idx: Any, k: int, flat: Any) -> Any:
                got = pick_all(mags, idx, k, flat)
                whole.append(int(mags is taken[0] and got is not None))
                return got
            _native.take, _native.pick_largest = took, capped  # type: ignore[assignment]
        if method == "dgc":  # DGC's threshold sample drawn and gathered in one C call
            from adacomp.compressors import _native
            take = _native.sample_take

            def sampled(*args: Any, **kw: Any) -> Any:
                got = take(*args, **kw)
                whole.append(int(got is not None))
                return got
            _native.sample_take = sampled  # type: ignore[assignment]
        if method == "sidco_stages":  # both later fits (each one C read of what covers its threshold, keeping
            from adacomp.compressors import _native  # what can pass the next) and the pick in one C call
            chosen = _native.sidco_choose

            def fitted(*args: Any) -> Any:
                got = chosen(*args)
                whole.append(int(got is not None and len(got.stages) == 2))
                dests.append(int(got is not None and got.idx.numel() > 0))
                return got
            _native.sidco_choose = fitted  # type: ignore[assignment]
        if method == "adtopk_1d":  # a one-row tensor (a bias) picked whole in one C call
            from adacomp.compressors import _native
            pick = _native.pick_largest

            def picked(mags: torch.Tensor, idx: Any, k: int, flat: Any) -> Any:
                got = pick(mags, idx, k, flat)
                whole.append(int(idx is None and got is not None))
                return got
            _native.pick_largest = picked  # type: ignore[assignment]
        if must is not None:
            cls, attr, counts = must
            plain = getattr(cls, attr)

            def fused(self: Any, *args: Any, **kw: Any) -> bool:
                done = plain(self, *args, **kw)
                dests.append(int(done and counts(args, kw)))
                return done
            setattr(cls, attr, fused)
    elif switch == "dest":
        def counted(e: Any, g: torch.Tensor) -> Any:
            out = given(e, g)
            dests.append(int(out.dest is not None))
            return out
        error_feedback.with_dest = counted  # type: ignore[assignment]
    else:
        devices.EMULATE = True
    same = torch.equal(run(), ref) and not torch.equal(ref, flat_params(net()))  # and it trained
    error_feedback.with_dest = given  # type: ignore[assignment]
    adacomp.shutdown()
    # the means went into the gradients; the fused passes named above ran
    needs = switch == "dest" or (switch == "native" and method in ("alltoall", "dgc", "chunktopk", "chunktopk_dead",
                                                                   "topk_deferred", "sidco_deferred",
                                                                   "alltoall_deferred",
                                                                   "adtopk", "adtopk_dead", "adtopk_wide", "sidco",
                                                                   "sidco_stages"))
    picks = switch == "native" and method in ("adtopk_1d", "alltoall_small", "gaussiank_capped", "chunktopk", "redsync",
                                              "sidco_stages", "gaussiank", "dgc")
    return same and (sum(dests) > 0 or not needs) and (sum(whole) > 0 or not picks)


WAYS = ([("emulate", m) for m in ["mstopk", "redsync", "gaussiank", "dgc", "sidco", "oktopk", "topk"]]
        + [("emulate-bucket", m) for m in ["mstopk", "gaussiank"]]
        + [("native", m) for m in ["topk", "topk_deferred", "sidco_deferred", "gaussiank", "efsignsgd", "redsync",
                                   "mstopk", "sidco", "sidco_stages",
                                   "adtopk",
                                   "adtopk_1d", "adtopk_dead", "adtopk_wide", "powersgd", "acpsgd", "alltoall",
                                   "alltoall_small", "alltoall_deferred", "gaussiank_capped", "artopk", "dgc", "chunktopk", "chunktopk_dead",
                                   "oktopk", "qsgd",
                                   "qsgd_counter", "bf16"]]
        + [("dest", m) for m in ["topk", "gaussiank", "adtopk", "alltoall", "chunktopk", "dgc"]])


@pytest.mark.parametrize("front", ["optimizer", "hook", "outer", "fsdp"])
@pytest.mark.parametrize("switch,method", WAYS)
def test_training_along_each_fast_path_is_bitwise(switch: str, method: str, front: str) -> None:
    """Every front end (optimizer, DDP hook, the outer loop's compressed pseudo-gradient, FSDP2's
    reduce-scatter per unit), 2 real gloo
    ranks: the same parameters with the GPU's batched counts as without (the torch path on both
    sides, as on a GPU), and with the CPU's fused C passes as with torch's ops (whole small tensors'
    and parts' picks from a sampled floor, with no joined alltoall payload built, Gaussian-k's
    capped whole-counted tensors ranked in C, its small tensors' correction loops run in one C call
    each, and SIDCo's three stages' later fits read from its
    signed kept set and its pick, in one C call, all required to have run; the compensation
    passes that read their sum included, and the residuals left to the next compensation: EF-SignSGD's
    signs, PowerSGD's and ACP-SGD's factors, PowerSGD's first product from that pass, Chunk-Top-k's
    kept values, alltoall's parts' zeroing and DGC's masking, the last three required to have run; bf16's casts
    written straight into the allreduce's bucket buffer); and with every mean written into the
    gradient it averages (``Entry.dest``) as into an output of its own."""
    env = {"ADACOMP_NATIVE": "0"} if switch.startswith("emulate") else {}
    if switch == "emulate-bucket":  # the batches counted by bucketize and a histogram, no sort
        env["ADACOMP_BATCHED_COUNTS"] = "bucket"
    assert run_workers(_train_both_ways, 2, method, front, switch, timeout=300, env=env) == [True, True]


def test_a_count_between_two_equal_prefetched_counts_needs_no_read(counts_way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "EMULATE", True)
    a = torch.tensor([0.5, 1.0, 2.0, 3.0])
    counter = ThresholdCounter(a, False, Workspace())
    counter.prefetch([1.1, 1.9, 2.5])
    reads = counter.reads
    assert counter.known(1.5) and counter.count(1.5) == 2 and counter.reads == reads  # inside (1.1, 1.9)
    assert not counter.known(2.2) and counter.count(2.2) == 1 and counter.reads == reads + 1  # counts 2 vs 1


@pytest.mark.parametrize("kind", ["mstopk", "redsync", "gaussiank"])
def test_auto_batches_only_where_the_compressor_asks(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` (the default): MSTop-k's searches batch their counts, RedSync's and Gaussian-k's
    count one by one (``batch_counts``, measured on an H100); the thresholds are the same."""
    monkeypatch.setattr(devices, "EMULATE", True)
    flat = TENSORS[7][1]
    got = {}
    for way in ("auto", "off", "sort"):
        monkeypatch.setattr(sparse, "BATCHED_COUNTS", way)
        got[way] = _search(kind, flat, 0.01)
    assert got["auto"][0] == got["off"][0] == got["sort"][0]
    batched = get_cls(kind).batch_counts
    assert batched == (kind == "mstopk")
    assert got["auto"][1] == (got["sort"][1] if batched else got["off"][1]), got


def test_batched_counts_off_reads_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "EMULATE", True)
    monkeypatch.setattr(sparse, "BATCHED_COUNTS", "off")
    counter = ThresholdCounter(torch.tensor([0.5, 1.0, 2.0, 3.0]), False, Workspace())
    counter.prefetch([1.1, 1.9, 2.5])
    assert counter.reads == 0 and not counter.known(1.5) and counter.count(1.5) == 2 and counter.reads == 1


def test_an_unknown_batched_counts_way_is_an_error_naming_the_choices() -> None:
    import subprocess
    import sys
    got = subprocess.run([sys.executable, "-c", "import adacomp.compressors.sparse"], capture_output=True, text=True,
                         env={**__import__("os").environ, "ADACOMP_BATCHED_COUNTS": "radix"})
    assert got.returncode != 0 and "ADACOMP_BATCHED_COUNTS='radix'" in got.stderr and "'bucket'" in got.stderr
