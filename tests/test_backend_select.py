"""Backend selection from the launcher's environment, and clear errors for missing transports."""
from __future__ import annotations

import pytest

from adacomp import backends


@pytest.mark.parametrize("env,expected", [
    ({}, "local"),
    ({"RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "torch"),          # torchrun / adacomp run
    ({"OMPI_COMM_WORLD_RANK": "0"}, "mpi"),                        # mpirun (Open MPI)
    ({"PMI_RANK": "0"}, "mpi"),                                    # mpirun (MPICH)
    ({"HOROVOD_RANK": "0", "OMPI_COMM_WORLD_RANK": "0"}, "horovod"),
    ({"HOROVOD_RANK": "0", "ADACOMP_BACKEND": "torch", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "torch"),  # adacomp run
])
def test_detect_follows_the_launcher(env, expected) -> None:
    assert backends.detect(env) == expected


def test_unknown_backend_lists_choices() -> None:
    with pytest.raises(ValueError, match="valid choices: auto, horovod, local, mpi, torch"):
        backends.create("nccl")


def test_unavailable_backend_names_the_install_command(monkeypatch) -> None:
    monkeypatch.setitem(backends._BACKENDS, "horovod", ("adacomp_no_such_module", "X", "make horovod"))
    with pytest.raises(RuntimeError, match="make horovod"):
        backends.create("horovod")


def test_torch_backend_without_rendezvous_says_how_to_launch(monkeypatch) -> None:
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        backends.create("torch")


@pytest.mark.parametrize("gpus,local,expected", [
    (0, 2, "gloo"), (1, 1, "cpu:gloo,cuda:nccl"), (1, 2, "gloo"), (8, 8, "cpu:gloo,cuda:nccl")])
def test_nccl_only_when_every_local_rank_has_a_gpu(monkeypatch, gpus, local, expected) -> None:
    import torch
    from adacomp.backends.torch_dist import process_group_backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert process_group_backend({"LOCAL_WORLD_SIZE": str(local)}) == expected
    assert process_group_backend({"ADACOMP_TORCH_BACKEND": "gloo", "LOCAL_WORLD_SIZE": "1"}) == "gloo"
    with pytest.raises(ValueError, match="ADACOMP_TORCH_BACKEND='mpi': valid choices: gloo, nccl"):
        process_group_backend({"ADACOMP_TORCH_BACKEND": "mpi"})


def test_adacomp_run_exports_horovodrun_variables() -> None:
    """Horovod's own tests compare hvd.rank() / hvd.size() with HOROVOD_RANK / HOROVOD_SIZE (what
    horovodrun exports); ``adacomp run`` exports them too, and the backend stays the torch one."""
    from adacomp.tools.launch import worker_env
    env = worker_env(1, 2, 12345)
    assert {k: env[k] for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                                "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")} == \
        {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
         "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"}
    assert backends.detect(env) == "torch"
