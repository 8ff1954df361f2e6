"""The accelerators' code path on the CPU (``adacomp.devices.EMULATE``, torch path): how often one
step reads a result back to the host, which on a GPU is a wait for the device each time. A method
whose reads grow with the number of tensors stalls the host inside backward (issue 33: the H100's
sync counts, docs/results/cuda.md). Counted by ``adacomp.bench.gpu_step.emulated_reads``."""
from __future__ import annotations

import pytest
import torch

from adacomp import devices
from adacomp.bench.gpu_step import emulated_reads
from adacomp.bench.zoo import arm_config
from tests._reads import reads_per_step

CONSTANT = ["fp32", "bf16", "topk", "adtopk", "adtopk_i", "powersgd", "acpsgd", "qsgd", "efsignsgd", "artopk",
            "alltoall", "oktopk"]
"""Methods whose step reads back a fixed number of times, whatever the number of tensors."""
PER_TENSOR = {"mstopk": 5, "gaussiank": 8, "redsync": 6, "sidco": 4, "dgc": 4, "randomk": 1}
"""The threshold searches and Random-k's draws: at most this many reads per compressed tensor
(Gaussian-k and RedSync count one by one: on an H100 their batched counts cost more than the waits
they saved, ``SparseCompressor.batch_counts``; with batching they read 5 and 4). SIDCo is counted
after the zoo's warm-up for it, with the three stages it settles on for normal values: each stage's
mean is a read, then the selection's size (3 in its one-stage first window)."""


@pytest.fixture
def accelerator_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "EMULATE", True)
    monkeypatch.setenv("ADACOMP_NATIVE", "0")  # the C passes serve CPU memory only


def _reads(method: str, layers: int) -> int:
    cfg, warm = arm_config(method)
    return reads_per_step({**cfg, "min_numel": 0}, warm, layers, "cpu", emulated_reads)


@pytest.mark.parametrize("method", CONSTANT)
def test_reads_per_step_do_not_grow_with_the_number_of_tensors(method: str, accelerator_path: None) -> None:
    few, many = _reads(method, 4), _reads(method, 16)
    assert many == few and many <= 5, (method, few, many)


@pytest.mark.parametrize("method", sorted(PER_TENSOR))
def test_threshold_searches_read_a_few_times_per_tensor(method: str, accelerator_path: None) -> None:
    few, many = _reads(method, 4), _reads(method, 16)
    per_tensor = (many - few) / 12
    assert 0 < per_tensor <= PER_TENSOR[method], (method, few, many)


def test_the_counter_sees_reads_in_backward_hooks_and_tolist() -> None:
    net = torch.nn.Linear(4, 4)

    def hook(p: torch.Tensor) -> None:
        assert p.grad is not None
        float(p.grad.sum())  # 1
        p.grad[p.grad > 0]  # 2: a mask index
        torch.nonzero(p.grad)  # 3
        p.grad.tolist()  # 4
        p.grad[torch.tensor([0, 1])]  # an index tensor: no read

    handle = net.weight.register_post_accumulate_grad_hook(hook)
    n, sites = emulated_reads(lambda: net(torch.randn(2, 4)).sum().backward())
    handle.remove()
    assert n == 4 and list(sites) == ["(outside adacomp)"]
