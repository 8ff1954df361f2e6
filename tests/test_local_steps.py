"""Local steps with a compressed outer synchronisation (DiLoCo / Streaming DiLoCo; adacomp.outer).

Every distributed check runs real gloo processes. The reference for ``every: 1`` is real DDP; for
``every > 1`` it is :func:`simulate`, a one-process replay of the algorithm over all ranks' batches
written from the papers' equations (DiLoCo Alg. 1; Streaming DiLoCo §2.2-2.3), not from our code.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_workers
from tests.parity import MLP, batch

WORLD = 2
TOPK = {"compressor": {"name": "topk", "density": 0.1}, "memory": {"name": "residual"},
        "communicator": {"name": "allgather"}, "min_numel": 0}
NONE = {"compressor": {"name": "none"}, "communicator": {"name": "allreduce"}, "min_numel": 0}


def _cfg(base: dict, **ls: Any) -> dict:
    return {**copy.deepcopy(base), "local_steps": ls}


def _inner(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if kind == "momentum" else 0.0)


# --------------------------------------------------------------------------------------------------
# the one-process reference
# --------------------------------------------------------------------------------------------------
def _topk_roundtrip(t: torch.Tensor, density: float) -> torch.Tensor:
    """What Top-k sends of ``t``: its k = round(density n) largest magnitudes, zeros elsewhere."""
    flat = t.reshape(-1)
    k = min(flat.numel(), max(1, int(round(density * flat.numel()))))
    out = torch.zeros_like(flat)
    idx = torch.topk(flat.abs(), k).indices
    out[idx] = flat[idx]
    return out.view_as(t)


def simulate(cfg: dict, steps: int, inner: str = "sgd", world: int = WORLD) -> dict[str, Any]:
    """Replay every rank of the outer loop in one process: the parameters each rank ends with,
    the synchronised copy and the residuals."""
    ls = cfg["local_steps"]
    H, P, tau = ls["every"], ls.get("fragments", 1), ls.get("overlap_steps", 0)
    alpha = ls.get("mixing", 0.5)
    oo = {"name": "nesterov", **ls.get("outer_optimizer", {})}
    lr = oo.get("lr", 0.7 if oo["name"] == "nesterov" else 1.0)
    mom = oo.get("momentum", 0.9 if oo["name"] == "nesterov" else 0.0)
    topk = cfg["compressor"]["name"] == "topk"
    torch.manual_seed(0)
    init = MLP()
    models = [copy.deepcopy(init) for _ in range(world)]
    opts = [_inner(m, inner) for m in models]
    names = [n for n, _ in init.named_parameters()]
    # fragments of the MLP: blocks fc1, fc2, fc3 taken strided (Streaming DiLoCo §2.2)
    blocks = [[f"fc{i}.weight", f"fc{i}.bias"] for i in (1, 2, 3)]
    frags = [[n for b in blocks[f::P] for n in b] for f in range(P)]
    offs = [((f + 1) * H // P) % H for f in range(P)]
    synced = {n: torch.nn.Parameter(p.detach().clone(), requires_grad=False) for n, p in init.named_parameters()}
    outer = [torch.optim.SGD([synced[n] for n in fr], lr=lr, momentum=mom, nesterov=oo["name"] == "nesterov")
             for fr in frags]
    resid = [{n: torch.zeros_like(synced[n]) for n in names} for _ in range(world)]
    pending: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
    for t in range(1, steps + 1):
        for r in range(world):
            x, y = batch(r, t - 1)
            opts[r].zero_grad()
            F.cross_entropy(models[r](x), y).backward()
            opts[r].step()
        for f, fr in enumerate(frags):
            if t % H == offs[f]:
                avg = {}
                for n in fr:
                    acc = torch.zeros_like(synced[n])
                    for r in range(world):
                        d = synced[n].detach() - dict(models[r].named_parameters())[n].detach()
                        if topk:
                            d = d + resid[r][n]
                            sent = _topk_roundtrip(d, cfg["compressor"]["density"])
                            resid[r][n] = d - sent
                            d = sent
                        acc += d
                    avg[n] = acc / world
                pending[f] = (t, avg)
        for f in sorted(pending, key=lambda f: pending[f][0]):
            t0, avg = pending[f]
            if t0 + tau > t:
                continue
            for n in frags[f]:
                synced[n].grad = avg[n]
            outer[f].step()
            for r in range(world):
                params = dict(models[r].named_parameters())
                with torch.no_grad():
                    for n in frags[f]:
                        if tau == 0:
                            params[n].copy_(synced[n])
                        else:
                            params[n].mul_(alpha).add_(synced[n], alpha=1 - alpha)
            del pending[f]
    return {"params": [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models],
            "synced": {n: s.detach().clone() for n, s in synced.items()}, "residuals": resid}


# --------------------------------------------------------------------------------------------------
# workers
# --------------------------------------------------------------------------------------------------
def _train(cfg: dict | None, steps: int, inner: str = "sgd", start: int = 0, model: Any = None,
           opt: Any = None) -> tuple[Any, Any, list[int]]:
    import adacomp
    from adacomp.tools.baselines import ddp_baseline  # noqa: F401 - import check only
    rank = adacomp.rank()
    if model is None:
        torch.manual_seed(0)
        model = MLP()
    if opt is None:
        if cfg is None:
            from torch.nn.parallel import DistributedDataParallel as DDP
            net = DDP(model)
            opt = _inner(model, inner)
            opt._net = net  # type: ignore[attr-defined]
        else:
            opt = adacomp.DistributedOptimizer(_inner(model, inner), model.named_parameters(), config=cfg)
    net = getattr(opt, "_net", model)
    sent = []
    for t in range(start, start + steps):
        x, y = batch(rank, t)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        sent.append(int(opt.last_stats.bytes_sent) if cfg is not None else 0)
    return model, opt, sent


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _residuals(opt: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for fr in opt.outer.fragments:
        for r in fr.table.routes.values():
            out.update({n: t.clone() for n, t in getattr(r.memory, "residuals", {}).items()})
    return out


def _run_worker(cfg: dict | None, steps: int, inner: str) -> dict:
    import adacomp
    adacomp.init()
    model, opt, sent = _train(cfg, steps, inner)
    out = {"params": _params(model), "sent": sent}
    if cfg is not None:
        out["synced"] = {n: s.detach().clone() for fr in opt.outer.fragments for n, s in zip(fr.names, fr.synced)}
        opt.outer.settle()  # a round still in flight (overlap) charges its memory when it finishes
        out["residuals"] = _residuals(opt)
    return out


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **kw: Any) -> None:
    assert set(a) == set(b)
    for n in a:
        torch.testing.assert_close(a[n], b[n], msg=lambda m, n=n: f"{n}: {m}", **kw)


# --------------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------------
def test_every_step_with_averaging_outer_sgd_equals_ddp() -> None:
    """every 1, outer SGD lr 1 momentum 0, no compression, plain SGD inside: the outer loop takes
    exactly DDP's steps (theta - mean_r(theta - theta_r) = theta - lr mean_r g_r), so the
    parameters equal real DDP's up to the rounding of the subtraction."""
    cfg = _cfg(NONE, every=1, outer_optimizer={"name": "sgd", "lr": 1.0, "momentum": 0.0})
    ddp = run_workers(_run_worker, WORLD, None, 6, "sgd")
    ours = run_workers(_run_worker, WORLD, cfg, 6, "sgd")
    for r in range(WORLD):
        _assert_close(ours[r]["params"], ddp[0]["params"], rtol=0, atol=1e-6)
        assert all(s > 0 for s in ours[r]["sent"])  # every step synchronised


CASES = {
    "diloco": (_cfg(NONE, every=4), "momentum"),
    "diloco_topk_residual": (_cfg(TOPK, every=4), "sgd"),
    "streaming_overlap": (_cfg(TOPK, every=4, fragments=2, overlap_steps=1, mixing=0.5), "adamw"),
    "localsgd_sequential": (_cfg(NONE, every=3, fragments=3, fragment_pattern="sequential",
                                 outer_optimizer={"name": "sgd"}), "sgd"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_equals_a_one_process_simulation(case: str) -> None:
    cfg, inner = CASES[case]
    steps = 10
    ref = simulate(cfg, steps, inner)
    ours = run_workers(_run_worker, WORLD, cfg, steps, inner)
    for r in range(WORLD):
        _assert_close(ours[r]["params"], ref["params"][r], rtol=1e-5, atol=1e-6)
        _assert_close(ours[r]["synced"], ref["synced"], rtol=1e-5, atol=1e-6)
        if cfg["compressor"]["name"] == "topk":
            _assert_close(ours[r]["residuals"], ref["residuals"][r], rtol=1e-5, atol=1e-6)
        sent = ours[r]["sent"]
        assert sum(1 for s in sent if s > 0) >= 2, sent  # synchronisations happened
        if cfg["local_steps"].get("fragments", 1) == 1:
            assert sum(1 for s in sent if s == 0) >= steps // 2, sent  # and most steps sent nothing
        else:  # one fragment at a time: no round carries the whole model
            dense = sum(p.numel() * 4 for p in MLP().parameters())
            assert max(sent) < dense, sent


def _resume_worker(cfg: dict, split: int, total: int, inner: str) -> tuple[bool, bool]:
    """Train ``total`` steps straight, and ``split`` steps + checkpoint + fresh objects + the rest."""
    import io

    import adacomp
    adacomp.init()
    straight, _, _ = _train(cfg, total, inner)
    model, opt, _ = _train(cfg, split, inner)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    model2 = MLP()
    model2.load_state_dict(ck["model"])
    opt2 = adacomp.DistributedOptimizer(_inner(model2, inner), model2.named_parameters(), config=cfg)
    opt2.load_state_dict(ck["opt"])
    resumed, _, _ = _train(cfg, total - split, inner, start=split, model=model2, opt=opt2)
    a, b = _params(straight), _params(resumed)
    return all(torch.equal(a[n], b[n]) for n in a), opt2.steps == total


@pytest.mark.parametrize("split,case", [(4, "diloco_topk_residual"), (6, "diloco_topk_residual"),
                                        (5, "streaming_overlap")])
def test_resume_mid_window_or_at_a_sync_is_bitwise(split: int, case: str) -> None:
    """4: right after a sync; 6: mid-window; 5 with overlap: a round in flight at the checkpoint."""
    cfg, inner = CASES[case]
    for same, steps_ok in run_workers(_resume_worker, WORLD, cfg, split, 11, inner):
        assert same and steps_ok


def _setup(cfg: dict, inner: str = "sgd") -> tuple[int, MLP, Any]:
    """(rank, model from seed 0, its wrapped optimizer) in a worker whose process group is up."""
    import adacomp
    torch.manual_seed(0)
    model = MLP()
    return adacomp.rank(), model, adacomp.DistributedOptimizer(_inner(model, inner), model.named_parameters(),
                                                               config=cfg)


def _join_worker(cfg: dict) -> dict:
    import adacomp
    adacomp.init()
    rank, model, opt = _setup(cfg)
    with opt.join():
        for t in range(5 + 6 * rank):  # rank 0 has 5 batches, rank 1 has 11
            x, y = batch(rank, t)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return {"params": _params(model), "steps": opt.steps}


@pytest.mark.parametrize("case", ["diloco_topk_residual", "streaming_overlap"])
def test_join_with_uneven_inputs_ends_identical_without_hanging(case: str) -> None:
    cfg = CASES[case][0]
    res = run_workers(_join_worker, WORLD, cfg, timeout=60)
    _assert_close(res[0]["params"], res[1]["params"], rtol=0, atol=0)
    assert res[0]["steps"] == res[1]["steps"] >= 11


def _empty_rank_join_worker(cfg: dict) -> dict:
    """Rank 0 has no batch at all; the ranks built their models from different seeds and the script
    broadcasts after building the optimizer (Horovod's habit): the deferred weights check and the
    synchronised copies must still meet the other rank's first-step collectives."""
    import adacomp
    adacomp.init()
    rank = adacomp.rank()
    torch.manual_seed(rank)
    model = MLP()
    opt = adacomp.DistributedOptimizer(_inner(model, "sgd"), model.named_parameters(), config=cfg)
    adacomp.broadcast_parameters(model.state_dict(), root_rank=0)
    with opt.join():
        for t in range(5 * rank):
            x, y = batch(rank, t)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return {"params": _params(model), "steps": opt.steps}


def test_join_with_a_rank_that_has_no_batch_after_a_late_broadcast() -> None:
    res = run_workers(_empty_rank_join_worker, WORLD, _cfg(NONE, every=2), timeout=120)
    _assert_close(res[0]["params"], res[1]["params"], rtol=0, atol=0)
    assert res[0]["steps"] == res[1]["steps"] >= 5


def _dcp_worker(cfg: dict, at: int) -> dict:
    """torch.distributed.checkpoint's ``get_state_dict(model, opt)`` (before training: ``at`` -1, or
    after step ``at``) steps a stateless optimizer once at lr 0 to create its state: no local step."""
    import adacomp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    adacomp.init()
    rank, model, opt = _setup(cfg)
    if at == -1:
        get_state_dict(model, opt)
    for t in range(10):
        x, y = batch(rank, t)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if t == at:
            get_state_dict(model, opt)
    return {"params": _params(model), "steps": opt.steps}


@pytest.mark.parametrize("at", [-1, 4])
def test_dcp_state_dict_is_not_a_local_step(at: int) -> None:
    cfg = _cfg(NONE, every=4)
    plain = run_workers(_dcp_worker, WORLD, cfg, None, timeout=120)
    got = run_workers(_dcp_worker, WORLD, cfg, at, timeout=120)
    for r in range(WORLD):
        _assert_close(got[r]["params"], plain[r]["params"], rtol=0, atol=0)
        assert got[r]["steps"] == plain[r]["steps"] == 10


def _amp_worker(cfg: dict, overflow: bool) -> dict:
    """Power-of-two GradScaler: without an overflow it changes nothing (bitwise); an overflow on
    one rank skips that rank's inner update only and no rank loses its place in the schedule."""
    import adacomp
    adacomp.init()
    out = {}
    for use_scaler in (False, True):
        rank, model, opt = _setup(cfg)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, enabled=use_scaler)
        for t in range(9):
            x, y = batch(rank, t)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if overflow and use_scaler and rank == 1 and t == 2:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.unscale_(opt) if t % 2 else None  # both habits: explicit unscale_ (clipping) or not
            scaler.step(opt)
            scaler.update()
        out[use_scaler] = (_params(model), opt.steps, opt.skipped_steps)
    return out


@pytest.mark.parametrize("overflow", [False, True])
def test_gradscaler_changes_nothing_and_a_local_overflow_keeps_the_schedule(overflow: bool) -> None:
    cfg = CASES["diloco_topk_residual"][0]
    res = run_workers(_amp_worker, WORLD, cfg, overflow, timeout=60)
    for r, out in enumerate(res):
        plain, scaled = out[False], out[True]
        assert scaled[1] == plain[1] == 9  # every rank counted 9 steps: same synchronisations
        if not overflow:
            _assert_close(scaled[0], plain[0], rtol=0, atol=0)
            assert scaled[2] == 0
        else:
            assert scaled[2] == (1 if r == 1 else 0)


def _nonfinite_worker(cfg: dict) -> dict:
    import adacomp
    from adacomp.errors import NonFiniteGradientError
    adacomp.init()
    rank, model, opt = _setup(cfg)
    raised = False
    try:
        for t in range(8):
            x, y = batch(rank, t)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if t == 5 and rank == 0:
                with torch.no_grad():
                    model.fc2.weight[0, 0] = float("nan")  # a diverged local copy
            opt.step()
            if t == 3:
                at_sync = _params(model)
    except NonFiniteGradientError:
        raised = True
    synced = {n: s.detach().clone() for fr in opt.outer.fragments for n, s in zip(fr.names, fr.synced)}
    return {"raised": raised, "params": _params(model), "synced": synced, "at_sync": at_sync,
            "skipped": opt.outer.skipped_syncs}


@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_nonfinite_pseudo_gradient_drops_the_window_or_raises_on_every_rank(mode: str) -> None:
    cfg = {**CASES["diloco_topk_residual"][0], "nonfinite": mode}
    res = run_workers(_nonfinite_worker, WORLD, cfg, timeout=60)
    if mode == "raise":
        assert all(r["raised"] for r in res)
        return
    for r in res:
        assert r["skipped"] == 1 and not r["raised"]
        # the window 5..8 was dropped: every rank is back at the synchronised copy of step 4
        _assert_close(r["params"], res[0]["at_sync"], rtol=0, atol=0)
        _assert_close(r["synced"], res[0]["at_sync"], rtol=0, atol=0)


def test_bad_combinations_fail_before_any_collective_naming_the_key() -> None:
    import adacomp
    from adacomp.config import from_dict
    from adacomp.errors import ConfigError
    with pytest.raises(ConfigError, match="policy.name"):
        from_dict(_cfg({"policy": {"name": "flexible"}}, every=4))
    with pytest.raises(ConfigError, match="local_steps.fragments"):
        from_dict(_cfg(NONE, every=2, fragments=3))
    with pytest.raises(ConfigError, match="local_steps.overlap_steps"):
        from_dict(_cfg(NONE, every=4, overlap_steps=4))
    with pytest.raises(ConfigError, match="local_steps.outer_optimizer.name.*nesterov, sgd"):
        from_dict(_cfg(NONE, every=4, outer_optimizer={"name": "adam"}))
    with pytest.raises(ConfigError, match="local_steps.mixing"):
        from_dict(_cfg(NONE, every=4, mixing=1.5))
    model = MLP()
    with pytest.raises(ConfigError, match="local_steps"):
        adacomp.ddp.hook(_cfg(TOPK, every=4), named_parameters=model.named_parameters())


def test_fragments_cut_whole_blocks_strided_or_balanced() -> None:
    from adacomp.outer.loop import blocks, offsets, partition
    params = [(f"blocks.{i}.{w}", torch.zeros(10 * (i + 1))) for i in range(4) for w in ("a", "b")]
    params = [("emb.weight", torch.zeros(5))] + params + [("head.weight", torch.zeros(5))]
    assert [len(b) for b in blocks([n for n, _ in params])] == [1, 2, 2, 2, 2, 1]
    strided = partition(params, 2, "strided")
    assert strided[0] == ["emb.weight", "blocks.1.a", "blocks.1.b", "blocks.3.a", "blocks.3.b"]
    seq = partition(params, 2, "sequential")
    assert seq[0] + seq[1] == [n for n, _ in params] and all(seq)
    assert offsets(32, 1) == [0] and offsets(32, 4) == [8, 16, 24, 0]


def _gloo_local_digest() -> str:
    import adacomp
    from tests.backend_worker import local_steps_digest
    adacomp.init(backend="torch")
    return local_steps_digest()


def test_local_steps_give_the_same_bits_on_gloo_mpi_and_horovod() -> None:
    """The outer loop through real mpirun / horovodrun launches: every rank and backend ends with
    bit-identical parameters after a closing outer_sync()."""
    from tests.test_backend_horovod import _MISSING, horovodrun
    from tests.test_backend_mpi import WORKER, mpirun
    from tests.test_divisible import _launched_digests
    gloo = set(run_workers(_gloo_local_digest, WORLD))
    assert len(gloo) == 1
    assert _launched_digests(mpirun(WORLD, str(WORKER), "local", "mpi", timeout=180), "local") == gloo
    if _MISSING is None:
        assert _launched_digests(horovodrun(WORLD, str(WORKER), "local", "horovod", timeout=180), "local") == gloo


def _every_compressor_worker(names: list[str]) -> dict:
    """Each compressor on the pseudo-gradient with a communicator that fits it: a few windows run,
    rounds send fewer bytes than dense, and a closing outer_sync() leaves every rank identical."""
    import adacomp
    from adacomp import compressors
    adacomp.init()
    out = {}
    for name in names:
        cls = compressors.registry.cls(name)
        comm = getattr(cls, "default_communicator", None) or ("allreduce" if cls.additive else "allgather")
        params = {"density": 0.2} if "density" in compressors.registry.params(name) else {}
        if name in ("powersgd", "acpsgd"):
            params = {"rank": 2, "min_compression_rate": 0.0}
        cfg = {"compressor": {"name": name, **params}, "communicator": {"name": comm}, "min_numel": 0,
               "local_steps": {"every": 2, "fragments": 2}}
        rank, model, opt = _setup(cfg)
        sent, dense = 0, 0
        for t in range(6):
            x, y = batch(rank, t)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sent += opt.last_stats.bytes_sent
            dense += opt.last_stats.dense_bytes
        opt.outer_sync()
        digest = adacomp.runtime.context.current().allgather_object(
            [float(p.detach().double().sum()) for p in model.parameters()])
        out[name] = {"sent": sent, "dense": dense, "identical": all(d == digest[0] for d in digest),
                     "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}
    return out


def test_every_compressor_works_on_the_pseudo_gradient() -> None:
    from adacomp import compressors
    names = [n for n in compressors.names()]
    res = run_workers(_every_compressor_worker, WORLD, names, timeout=240)
    for name in names:
        r = res[0][name]
        assert r["identical"] and r["finite"], (name, r)
        assert r["sent"] > 0, (name, r)
        if name != "none":
            assert r["sent"] < r["dense"], (name, r)


def _habits_worker(cfg: dict) -> dict:
    """Accumulation two ways (``no_sync`` and ``backward_passes_per_step``) and clipping after
    backward inside the outer loop: purely local habits, so both accumulations give the same bits
    and a clip that never binds changes nothing; syncs still happen."""
    import adacomp
    adacomp.init()
    out = {}
    rank = adacomp.rank()
    for how in ("no_sync", "passes", "plain_clip"):
        torch.manual_seed(0)
        model = MLP()
        opt = adacomp.DistributedOptimizer(_inner(model, "sgd"), model.named_parameters(), config=cfg,
                                           backward_passes_per_step=2 if how == "passes" else 1)
        sent = 0
        for t in range(8):
            x, y = batch(rank, t)
            opt.zero_grad()
            if how == "plain_clip":
                F.cross_entropy(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
            else:
                ctx = opt.no_sync() if how == "no_sync" else contextlib.nullcontext()
                with ctx:
                    F.cross_entropy(model(x[:4]), y[:4]).mul(0.5).backward()
                F.cross_entropy(model(x[4:]), y[4:]).mul(0.5).backward()
            opt.step()
            sent += opt.last_stats.bytes_sent
        out[how] = (_params(model), sent)
    return out


def test_accumulation_and_clipping_inside_the_outer_loop() -> None:
    res = run_workers(_habits_worker, WORLD, CASES["diloco_topk_residual"][0], timeout=60)
    for out in res:
        _assert_close(out["no_sync"][0], out["passes"][0], rtol=0, atol=0)
        _assert_close(out["no_sync"][0], out["plain_clip"][0], rtol=1e-5, atol=1e-6)  # two halves = one batch
        assert all(sent > 0 for _, sent in out.values())
