"""The DDP baselines (adacomp.tools.baselines) on 2 real gloo ranks: the bf16 hook rounds to bfloat16
and averages; fp32 is exact; torch's PowerSGD hook runs; bad names are refused."""
from __future__ import annotations

import pytest
import torch

from tests._dist import run_workers


def _grads(name: str) -> dict[str, torch.Tensor]:
    import os
    import torch.distributed as dist
    import torch.nn.functional as F
    from adacomp.tools.baselines import ddp_baseline
    # a CPU model: on a GPU host torch's PowerSGD hook would synchronise CUDA on a CPU device
    # (check_powersgd_device); hiding the GPU before CUDA starts keeps the run what CI runs
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = ddp_baseline(name, model)
    g = torch.Generator().manual_seed(dist.get_rank())
    out = {}
    for step in range(3):  # PowerSGD compresses from step 2 on
        ddp.zero_grad()
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        F.cross_entropy(ddp(x), y).backward()
        local = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        out.update({f"local.{n}": t for (n, _), t in zip(model.named_parameters(), local)})
    return out


def _mean_local(res: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    return (res[0][f"local.{name}"] + res[1][f"local.{name}"]) / 2


def test_fp32_is_the_exact_mean_and_bf16_is_rounded() -> None:
    fp32 = run_workers(_grads, 2, "ddp_fp32", timeout=120)
    bf16 = run_workers(_grads, 2, "ddp_bf16", timeout=120)
    for n in ("0.weight", "2.weight", "2.bias"):
        exact = _mean_local(fp32, n)
        assert torch.allclose(fp32[0][n], exact, atol=1e-6) and torch.equal(fp32[0][n], fp32[1][n])
        got = bf16[0][n]
        assert torch.equal(got, bf16[1][n])
        assert torch.equal(got.to(torch.bfloat16).float(), got)  # every value is a bfloat16 number
        assert torch.allclose(got, _mean_local(bf16, n), rtol=2e-2, atol=1e-3)
    assert not torch.equal(bf16[0]["0.weight"], _mean_local(bf16, "0.weight"))  # rounding happened


def test_powersgd_hook_runs_and_agrees_across_ranks() -> None:
    res = run_workers(_grads, 2, "ddp_powersgd", timeout=120)
    for n in ("0.weight", "2.weight"):
        assert torch.equal(res[0][n], res[1][n])
        assert int(torch.linalg.matrix_rank(res[0][n])) == 1  # rank-1 P Q^T, not the dense mean
        assert int(torch.linalg.matrix_rank(_mean_local(res, n))) > 1


def test_powersgd_baseline_of_a_cpu_model_on_a_gpu_host_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from adacomp.tools.baselines import check_powersgd_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        check_powersgd_device(torch.nn.Linear(2, 2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_powersgd_device(torch.nn.Linear(2, 2))


def test_unknown_baseline() -> None:
    from adacomp.tools.baselines import ddp_baseline
    with pytest.raises(ValueError, match="valid choices: ddp_fp32, ddp_bf16, ddp_powersgd"):
        ddp_baseline("ddp_fp8", torch.nn.Linear(2, 2))
