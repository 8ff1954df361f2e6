"""Everyday mistakes with the frameworks get a message that says what happened and what to call
(issue 30), with real processes and the real frameworks."""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

from tests._dist import run_workers
from tests.test_one_round import Front, _config


def _accelerate_prepares_our_optimizer() -> str:
    from accelerate import Accelerator

    import adacomp
    from adacomp.models import DigitsCNN
    acc = Accelerator(cpu=True)
    adacomp.init()
    model = DigitsCNN()
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       config=_config("allgather"))
    model, opt = acc.prepare(model, opt)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    acc.backward(F.cross_entropy(model(x), y))
    try:
        opt.step()
        return "stepped"
    except RuntimeError as exc:
        return str(exc)


def test_accelerate_prepare_of_distributed_optimizer_is_named() -> None:
    for msg in run_workers(_accelerate_prepares_our_optimizer, 2, timeout=300):
        assert "already averages its gradients" in msg and "accelerator.prepare" in msg, msg
        assert "adacomp.integrations.accelerate.register" in msg, msg


def _hook_registered_with_none() -> str:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import adacomp
    from adacomp.models import DigitsCNN
    dist.init_process_group("gloo")
    model = DDP(DigitsCNN())
    _, hook = adacomp.ddp.hook(_config("allgather"))
    model.register_comm_hook(None, hook)
    try:
        F.cross_entropy(model(torch.randn(8, 1, 8, 8)), torch.randint(0, 10, (8,))).backward()
        return "ran"
    except Exception as exc:  # noqa: BLE001 - DDP may wrap the hook's error
        return str(exc)


def test_register_comm_hook_with_none_state_is_named() -> None:
    for msg in run_workers(_hook_registered_with_none, 2, timeout=300):
        assert "adacomp.ddp.hook() returns" in msg and "register_comm_hook(state, hook)" in msg, msg


def _overflow_without_scaler(front: str) -> list[str]:
    import torch.distributed as dist

    from adacomp.backends.torch_dist import TorchBackend
    dist.init_process_group("gloo")
    run = Front(front, _config("allgather"), backend=TorchBackend() if front == "optimizer" else None)
    run.train(0, 2, dist.get_rank())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        g = torch.Generator().manual_seed(7)
        for _ in range(2):  # said once, not per skipped round
            run.step(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g), nan=True)
    run.close()
    return [str(w.message) for w in seen if "grad_scaler" in str(w.message)]


def test_hook_warns_once_when_a_skipped_round_has_no_grad_scaler_to_follow() -> None:
    """The hook cannot find a GradScaler by itself (the optimizer adopts the one calling its step:
    tests/test_amp.py); a skipped round without ``grad_scaler=`` says once what to pass."""
    out: list[Any] = run_workers(_overflow_without_scaler, 2, "hook", timeout=300)
    for msgs in out:
        assert len(msgs) == 1 and "residuals stay in the old units" in msgs[0], msgs


def _hook_uneven_data() -> str:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import adacomp
    from adacomp.models import DigitsCNN
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(DigitsCNN())
    adacomp.ddp.register(model, _config("allgather"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for _ in range(2 if rank == 1 else 20):  # rank 1 runs out of data, no join()
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 1, 8, 8)), torch.randint(0, 10, (8,))).backward()
            opt.step()
        return "finished"
    except adacomp.CommunicationError as exc:
        return str(exc)


def test_hook_points_at_join_when_a_peer_leaves() -> None:
    out = run_workers(_hook_uneven_data, 2, timeout=300)
    assert out[1] == "finished", out
    assert "went away during adacomp's hook round" in out[0] and "ddp_model.join()" in out[0], out[0]
