"""Training habits give DDP's parameters exactly (``compressor: none``), and for compressed configs
the same result as that config without the habit. Every test runs real DDP and adacomp side by side
in the same 2 gloo processes (tests/parity.py holds the worker code)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_workers
from tests.parity import COMPRESSED, FRONT_ENDS, MLP, NONE, Run, equal, init, max_rel, rank

STEPS = 6
OVERFLOW_STEP = 3  # rank 1's loss becomes inf at this step


# --- AMP ------------------------------------------------------------------------------------------
def _amp_run(cfg: dict | None, dtype: torch.dtype | None, scaler_on: bool, overflow: bool,
             skip_overflow_step: bool = False) -> tuple[dict, list]:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2, enabled=scaler_on)
    run = Run(cfg, grad_scaler=scaler if cfg is not None else None)
    unchanged = []
    for s in range(STEPS):
        if skip_overflow_step and s == OVERFLOW_STEP:
            continue
        run.opt.zero_grad()
        before = copy.deepcopy(run.opt.adacomp_state_dict()) if cfg is not None and s == OVERFLOW_STEP else None
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = run.loss(rank(), s)
        if overflow and s == OVERFLOW_STEP and rank() == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if before is not None:  # the non-finite round left every component state as it was
            after = run.opt.adacomp_state_dict()
            unchanged.append(_same_state(before, after))
        scaler.step(run.opt)
        scaler.update()
    return run.params(), unchanged


def _same_state(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


def _amp_worker(dtype_name: str) -> dict:
    init()
    dtype = getattr(torch, dtype_name)
    out: dict = {}
    ddp, _ = _amp_run(None, dtype, True, True)
    ours, unchanged = _amp_run(NONE, dtype, True, True)
    out["none"] = (equal(ddp, ours), all(unchanged) and len(unchanged) == 1)
    for name, cfg in COMPRESSED.items():
        # loss scaling (scale moving up and down, one overflow) vs no scaler and no overflow step
        scaled, unchanged = _amp_run(cfg, None, True, True)
        plain, _ = _amp_run(cfg, None, False, False, skip_overflow_step=True)
        out[name] = (max_rel(scaled, plain), all(unchanged) and len(unchanged) == 1)
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_amp_gradscaler_with_overflow_on_one_rank(dtype: str) -> None:
    for r, res in enumerate(run_workers(_amp_worker, 2, dtype, timeout=600)):
        assert res["none"] == (True, True), (r, res["none"])
        for name in COMPRESSED:
            rel, unchanged = res[name]
            assert unchanged, (r, name, "a non-finite round changed component state")
            # topk / dgc are bitwise (power-of-two scales are exact); the low-rank methods'
            # orthogonalisation divides by norms, exact too with epsilon 0
            assert rel == 0.0, (r, name, rel)


# --- clipping, schedulers, optimizers ---------------------------------------------------------------
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
}


def _clip_sched_run(cfg: dict | None, make_opt, max_norm: float) -> tuple[dict, list[float]]:
    run = Run(cfg, make_opt=make_opt)
    sched = torch.optim.lr_scheduler.StepLR(run.opt, step_size=2, gamma=0.5)
    norms = []
    for s in range(STEPS):
        run.opt.zero_grad()
        run.loss(rank(), s).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_norm)))
        run.opt.step()
        sched.step()
    return run.params(), norms


def _applied_norm_run(cfg: dict, max_norm: float) -> list[float]:
    """Plain SGD: the applied update / lr is the gradient the optimizer used."""
    run = Run(cfg, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1))
    applied = []
    for s in range(STEPS):
        run.opt.zero_grad()
        run.loss(rank(), s).backward()
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), max_norm)
        before = [p.detach().clone() for p in run.model.parameters()]
        run.opt.step()
        applied.append(float(torch.sqrt(sum(((b - p.detach()) / 0.1).square().sum()
                                            for b, p in zip(before, run.model.parameters())))))
    return applied


def _clip_worker() -> dict:
    init()
    out: dict = {}
    for name, make in OPTIMIZERS.items():
        ddp, dn = _clip_sched_run(None, make, 0.05)
        ours, on = _clip_sched_run(NONE, make, 0.05)
        out[name] = (equal(ddp, ours), dn == on)
    for name, cfg in COMPRESSED.items():
        out["applied_" + name] = max(_applied_norm_run(cfg, 0.05))
    return out


def test_clipping_after_backward_schedulers_and_optimizers_match_ddp() -> None:
    for r, res in enumerate(run_workers(_clip_worker, 2, timeout=600)):
        for name in OPTIMIZERS:
            assert res[name] == (True, True), (r, name, res[name])
        for name in COMPRESSED:  # clipping acted on the averaged gradient that was applied
            assert res["applied_" + name] <= 0.05 * (1 + 1e-4), (r, name, res["applied_" + name])


# --- parameters: unused, frozen, tied, add_param_group ---------------------------------------------
def _params_run(cfg: dict | None, front: str = "optimizer") -> tuple[dict, bool, bool]:
    run = Run(cfg, model_kw={"tied": True, "branch": True}, front=front)
    frozen_at = None
    for s in range(STEPS):
        if s == 3:  # freeze a layer mid-training (on every rank)
            run.base.fc1.weight.requires_grad_(False)
            frozen_at = run.base.fc1.weight.detach().clone()
        run.opt.zero_grad()
        # the branch on rank 0 only, on no rank, on rank 1 only, ...: locally and globally unused
        run.loss(rank(), s, use_branch=(s + rank()) % 3 == 0).backward()
        run.opt.step()
    never_none = run.base.never.weight.grad is None and run.base.never.bias.grad is None
    frozen_kept = frozen_at is not None and torch.equal(frozen_at, run.base.fc1.weight.detach())
    return run.params(), never_none, frozen_kept


def _add_group_run(cfg: dict | None, front: str = "optimizer") -> dict:
    run = Run(cfg, opt_params=lambda m: list(m.fc1.parameters()), front=front).train(range(2))
    run.opt.add_param_group({"params": list(run.base.fc2.parameters()) + list(run.base.fc3.parameters()), "lr": 0.05})
    return run.train(range(2, STEPS)).params()


def _params_worker(front: str) -> dict:
    init()
    ddp, ddp_none, ddp_frozen = _params_run(None)
    ours, ours_none, ours_frozen = _params_run(NONE, front)
    out = {"unused": (equal(ddp, ours), ours_none, ours_frozen, ddp_none),
           "add_group": equal(_add_group_run(None), _add_group_run(NONE, front))}
    for name, cfg in COMPRESSED.items():
        got, none_kept, frozen_kept = _params_run(cfg, front)
        # through the hook, a parameter this rank (or no rank) reached keeps its residual and gradient
        # as through the optimizer
        vs_opt = max_rel(got, _params_run(cfg)[0]) if front == "hook" else 0.0
        out[name] = (none_kept, frozen_kept, vs_opt <= 1e-6)
    return out


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_unused_frozen_tied_parameters_and_add_param_group_match_ddp(front: str) -> None:
    for r, res in enumerate(run_workers(_params_worker, 2, front, timeout=600)):
        same, never_none, frozen_kept, ddp_never_none = res["unused"]
        assert same and never_none and frozen_kept, (front, r, res["unused"])
        assert ddp_never_none  # DDP leaves globally unused parameters' grad None too
        assert res["add_group"], (front, r)
        for name in COMPRESSED:
            assert res[name] == (True, True, True), (front, r, name, res[name])


def _kept_grads_run(cfg: dict | None, front: str = "optimizer") -> dict:
    """``zero_grad(set_to_none=False)`` (gradients kept between steps, zeroed in place) with a branch
    some ranks skip and a layer no rank uses: the optimizer's averaged gradients are views of its
    bucket buffer, the unused parameters' zeros are not."""
    run = Run(cfg, model_kw={"branch": True}, front=front)
    for s in range(STEPS):
        run.opt.zero_grad(set_to_none=False)
        run.loss(rank(), s, use_branch=(s + rank()) % 3 == 0).backward()
        run.opt.step()
    return run.params()


def _kept_grads_worker(front: str) -> bool:
    init()
    one_bucket = {**NONE, "fusion": {"bucket_mb": 25}}  # used and unused parameters in one buffer
    return equal(_kept_grads_run(None), _kept_grads_run(one_bucket, front))


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_gradients_kept_between_steps_with_unused_parameters_match_ddp(front: str) -> None:
    assert run_workers(_kept_grads_worker, 2, front, timeout=300) == [True, True]


# --- accumulation: no_sync and backward_passes_per_step ---------------------------------------------
def _accum_run(cfg: dict | None, how: str, front: str = "optimizer") -> dict:
    passes = {"backward_passes_per_step": 2} if how == "passes" else {}
    run = Run(cfg, front=front, **passes) if cfg is not None else Run(cfg)
    for s in range(STEPS):
        run.opt.zero_grad()
        if how == "no_sync":
            with run.no_sync():
                run.loss(rank(), 2 * s).backward()
        else:
            run.loss(rank(), 2 * s).backward()
        run.loss(rank(), 2 * s + 1).backward()
        run.opt.step()
    return run.params()


def _accum_worker(front: str) -> dict:
    """The optimizer: DDP's no_sync and Horovod's backward_passes_per_step give the same result; the
    hook: DDP's no_sync gives the optimizer's (backward_passes_per_step is the optimizer's keyword)."""
    init()
    ddp = _accum_run(None, "no_sync")
    ours = _accum_run(NONE, "no_sync", front)
    out: dict = {"none": equal(ddp, ours)}
    if front == "optimizer":
        out["none_passes"] = equal(ddp, _accum_run(NONE, "passes"))
    for name, cfg in COMPRESSED.items():
        out[name] = max_rel(_accum_run(cfg, "no_sync", front),
                            _accum_run(cfg, "passes" if front == "optimizer" else "no_sync"))
    return out


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_accumulation_with_no_sync_and_backward_passes_match_ddp(front: str) -> None:
    for r, res in enumerate(run_workers(_accum_worker, 2, front, timeout=600)):
        assert res["none"] and res.get("none_passes", True), (front, r, res)
        for name in COMPRESSED:  # the optimizer's two ways bitwise; the hook within float rounding of it
            assert res[name] <= (0.0 if front == "optimizer" else 1e-6), (front, r, name, res[name])


# --- uneven inputs: join --------------------------------------------------------------------------
def _join_run(cfg: dict | None, front: str = "optimizer") -> dict:
    run = Run(cfg, front=front)
    n = 5 if rank() == 0 else 3
    with run.join():
        for s in range(n):
            run.opt.zero_grad()
            run.loss(rank(), s).backward()
            run.opt.step()
    return run.params()


def _join_worker(front: str) -> dict:
    init()
    out: dict = {"none": equal(_join_run(None), _join_run(NONE, front))}
    for name, cfg in COMPRESSED.items():
        out[name] = _join_run(cfg, front)
        if front == "hook":  # the joined rank shadows with zeros and keeps its residuals, as join() does
            out[name + "_vs_optimizer"] = max_rel(out[name], _join_run(cfg))
    return out


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_uneven_inputs_with_join_match_ddp_and_never_hang(front: str) -> None:
    res = run_workers(_join_worker, 2, front, timeout=600)
    for r in range(2):
        assert res[r]["none"], (front, r)
    for name in COMPRESSED:  # every rank ends with the last joiner's parameters
        assert equal(res[0][name], res[1][name]), (front, name)
        if front == "hook":
            assert res[0][name + "_vs_optimizer"] <= 1e-6, (name, res[0][name + "_vs_optimizer"])


# --- torch.distributed.checkpoint's state dict before the first step ---------------------------------
def _dcp_run(cfg: dict | None, habit: bool) -> tuple[dict, int]:
    """A step-0 ``get_state_dict(model, opt)`` (DCP creates the optimizer's state with one ``step()``
    over zero gradients at lr 0), then six steps; SGD with momentum, no weight decay."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    run = Run(cfg, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    if habit:
        get_state_dict(run.base, run.opt)
    run.train(range(STEPS))
    return run.params(), getattr(run.opt, "steps", STEPS)


def _dcp_worker() -> dict:
    init()
    ddp, _ = _dcp_run(None, True)
    none, _ = _dcp_run(NONE, True)
    # ACP-SGD alternates P and Q by step count: a counted DCP step would flip every later one
    acp, acp_steps = _dcp_run(COMPRESSED["acpsgd"], True)
    plain, _ = _dcp_run(COMPRESSED["acpsgd"], False)
    return {"none": equal(ddp, none), "acpsgd": max_rel(acp, plain), "steps": acp_steps}


def test_dcp_state_dict_before_training_changes_nothing() -> None:
    for r, res in enumerate(run_workers(_dcp_worker, 2, timeout=300)):
        assert res["none"] and res["acpsgd"] == 0.0 and res["steps"] == STEPS, (r, res)


# --- three ranks: DDP's averaging order ------------------------------------------------------------
def _world3_worker() -> bool:
    init()
    return equal(Run(None).train(range(STEPS)).params(), Run(NONE, front="hook").train(range(STEPS)).params())


def test_hook_none_is_ddp_bitwise_on_three_ranks() -> None:
    """DDP multiplies each rank's bucket by 1/world before the sum; at a world size that is not a power
    of two the order shows in the last bit, so the hook averages in DDP's order (the optimizer keeps
    Horovod's sum-then-divide and its own buckets: within rounding of DDP there)."""
    for r, same in enumerate(run_workers(_world3_worker, 3, timeout=300)):
        assert same, r


# --- `nonfinite: raise`: caught, and training goes on -----------------------------------------------
def _raise_run(front: str, bad: bool) -> tuple[list[str], dict]:
    """Top-k with ``nonfinite: raise``; with ``bad``, rank 1's loss is inf at step 2, the user catches
    the error and trains on (step 2's batch dropped on every rank), else step 2 is left out."""
    run = Run({**COMPRESSED["topk"], "nonfinite": "raise"}, front=front)
    errors = []
    for s in range(5):
        if s == 2 and not bad:
            continue
        run.opt.zero_grad()
        loss = run.loss(rank(), s)
        if s == 2 and rank() == 1:
            loss = loss * float("inf")
        try:
            loss.backward()
            run.opt.step()
        except Exception as exc:  # noqa: BLE001 - the test reports what was raised
            errors.append(type(exc).__name__)
    return errors, run.params()


def _raise_worker(front: str) -> dict:
    init()
    errors, got = _raise_run(front, bad=True)
    return {"errors": errors, "same": equal(got, _raise_run(front, bad=False)[1])}


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_nonfinite_raise_is_caught_and_training_goes_on(front: str) -> None:
    """Every rank raises NonFiniteGradientError once (through the hook: out of ``backward()``, after
    DDP finished its own end of backward, so the DDP model still trains) and the run then equals one
    that never saw the bad batch."""
    for r, res in enumerate(run_workers(_raise_worker, 2, front, timeout=300)):
        assert res["errors"] == ["NonFiniteGradientError"], (front, r, res)
        assert res["same"], (front, r)


# --- sparse embeddings, torch.compile -------------------------------------------------------------
def _plain_run(cfg: dict | None, model_kw: dict | None = None, compile_backend: str | None = None) -> dict:
    return Run(cfg, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1), model_kw=model_kw,
               compile_backend=compile_backend).train(range(STEPS)).params()


def _sparse_ddp_worker() -> dict:
    """DDP's reference with the sparse embedding, in processes of plain torch.distributed."""
    dist.init_process_group("gloo")
    return _plain_run(None, {"embedding": True})


def _sparse_ddp_reference() -> list[dict]:
    """DDP's sparse allreduce on gloo itself crashes now and then (SIGSEGV / heap corruption in
    backward, about once in 10,000 short runs, also in plain torch: docs/reliability.md, "Known
    issues"); adacomp densifies sparse gradients and never calls it. So this reference, and only
    it, runs once more when a rank of it died from a signal."""
    try:
        return run_workers(_sparse_ddp_worker, 2, timeout=600)
    except AssertionError as exc:
        if "died from signal" not in str(exc):
            raise
        warnings.warn(f"DDP's sparse reference crashed (torch's known gloo crash), ran it again: {exc}")
        return run_workers(_sparse_ddp_worker, 2, timeout=600)


def _sparse_run(front: str, cfg: dict) -> dict:
    """The sparse embedding trained through ``front`` (through the hook, DDP's sparse bucket hands
    the hook no gradients, only its sparse buffer)."""
    run = Run(cfg, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1), model_kw={"embedding": True}, front=front)
    params = run.train(range(STEPS)).params()
    assert run.base.emb.weight.grad.is_sparse  # handed back as DDP's sparse allreduce hands it
    return params


def _sparse_worker(front: str) -> dict:
    init()
    out = {"none": _sparse_run(front, NONE)}
    if front == "hook":  # compressed, the hook's sparse bucket equals the optimizer's densified gradient
        out["topk"] = max_rel(_sparse_run("hook", COMPRESSED["topk"]), _sparse_run("optimizer", COMPRESSED["topk"]))
    return out


@pytest.fixture(scope="module")
def sparse_ddp() -> list[dict]:
    return _sparse_ddp_reference()


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_sparse_embeddings_match_ddp(front: str, sparse_ddp: list[dict]) -> None:
    for r, res in enumerate(run_workers(_sparse_worker, 2, front, timeout=600)):
        assert equal(res["none"], sparse_ddp[r]), (front, r)
        if front == "hook":
            assert res["topk"] <= 1e-6, (r, res["topk"])


def _compile_worker() -> dict:
    init()
    out = {"compile": equal(_plain_run(None), _plain_run(NONE, compile_backend="aot_eager"))}
    for name in ("topk", "powersgd"):
        out[name] = equal(_plain_run(COMPRESSED[name]), _plain_run(COMPRESSED[name], compile_backend="aot_eager"))
    return out


def test_torch_compile_matches_ddp() -> None:
    for r, res in enumerate(run_workers(_compile_worker, 2, timeout=600)):
        assert res["compile"], r
        assert res["topk"] and res["powersgd"], (r, res)


# --- checkpoint / resume with rerouted tensors -----------------------------------------------------
def _resume_worker(cfg: dict) -> tuple[bool, bool]:
    init()
    from adacomp.config import ComponentSpec

    def train(run: Run, steps: range) -> None:
        for s in steps:
            if s == 1:  # what a policy does between steps (ByteComp / L-GreCo reroute tensors)
                run.opt.set_route("fc2.weight", compressor=ComponentSpec("none"), memory=ComponentSpec("none"),
                                  communicator=ComponentSpec("allreduce"))
            run.opt.zero_grad()
            run.loss(rank(), s).backward()
            run.opt.step()

    full = Run(cfg)
    train(full, range(STEPS))
    first = Run(cfg)
    train(first, range(3))
    ckpt = copy.deepcopy({"model": first.base.state_dict(), "opt": first.opt.state_dict()})
    resumed = Run(cfg)
    resumed.base.load_state_dict(ckpt["model"])
    resumed.opt.load_state_dict(ckpt["opt"])
    train(resumed, range(3, STEPS))
    plain = torch.optim.SGD(MLP().parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:  # a plain torch checkpoint loads with a warning
        warnings.simplefilter("always")
        resumed.opt.load_state_dict(plain.state_dict())
    return equal(full.params(), resumed.params()), any("plain torch" in str(w.message) for w in caught)


@pytest.mark.parametrize("method", ["topk", "powersgd", "efsignsgd"])
def test_resume_of_a_rerouted_run_is_bitwise(method: str) -> None:
    for r, (same, warned) in enumerate(run_workers(_resume_worker, 2, COMPRESSED[method], timeout=600)):
        assert same, r
        assert warned, r
