"""adacomp's Horovod API (``import adacomp as hvd``): compared with real ``horovod.torch`` on the
same inputs in one horovodrun launch, checked against locally computed results on the torch
backend (gloo, 2 processes) and under mpirun, and its keyword validation in one process."""
from __future__ import annotations

import warnings

import pytest
import torch

import adacomp
from adacomp.errors import ConfigError
from tests._dist import run_workers
from tests.test_backend_horovod import _check, horovodrun, needs_horovod
from tests.test_backend_mpi import mpirun

WORKER = "tests/hvd_api_worker.py"


@needs_horovod
def test_matches_horovod_torch() -> None:
    """Every API function, adacomp vs horovod.torch, same inputs; adacomp first on the torch backend,
    then (after shutdown) on the Horovod backend. Same values, same exception classes for misuse."""
    _check(horovodrun(2, WORKER, timeout=300), "HVD_API_OK", 2)


def _selfcheck() -> int:
    from tests.hvd_api_worker import selfcheck
    return selfcheck()


def test_torch_backend_results_and_reinit() -> None:
    """Results against values computed from every rank's inputs; shutdown() then init() again."""
    assert run_workers(_selfcheck, 2, timeout=240) == [32, 32]


@pytest.mark.slow
def test_mpi_backend_results_and_reinit() -> None:
    proc = mpirun(2, WORKER, "selfcheck", timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("HVD_SELFCHECK_OK 32") == 2, proc.stdout[-3000:]


@pytest.mark.slow
def test_torchrun_results_and_reinit() -> None:
    """torchrun keeps the rendezvous store in its agent: init() after shutdown() must still meet."""
    import os
    import sys

    from tests._dist import run_launcher
    from tests.backend_worker import FOREIGN_ENV
    from tests.test_backend_horovod import ROOT
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = run_launcher([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         WORKER, "selfcheck"], str(ROOT), env, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("HVD_SELFCHECK_OK 32") == 2, proc.stdout[-3000:]


def _cfg(**kw):
    return adacomp.load_config(kw or None)


def test_compression_maps_onto_the_registry() -> None:
    assert adacomp.resolve_compression(_cfg(), adacomp.Compression.none) == _cfg()
    fp16 = adacomp.resolve_compression(_cfg(), adacomp.Compression.fp16)
    assert fp16.compressor.name == "fp16" and fp16.min_numel == 0
    assert adacomp.resolve_compression(_cfg(), "fp16") == fp16  # a registry name works too
    with pytest.raises(ConfigError, match="both compression='fp16'.*'topk'"):
        adacomp.resolve_compression(_cfg(compressor={"name": "topk", "density": 0.1}, communicator="allgather"),
                                    adacomp.Compression.fp16)
    with pytest.raises(ValueError, match="Compression.none or adacomp.Compression.fp16"):
        adacomp.resolve_compression(_cfg(), object())
    t = torch.randn(5, dtype=torch.float64)
    c, ctx = adacomp.Compression.fp16.compress(t)
    assert c.dtype == torch.float16 and adacomp.Compression.fp16.decompress(c, ctx).dtype == torch.float64
    i = torch.arange(3)
    assert adacomp.Compression.fp16.compress(i)[0] is i


def test_optimizer_keywords() -> None:
    """Horovod's DistributedOptimizer keywords: mapped, or refused naming the alternative."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))

    def make(**kw):
        return adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), **kw)
    opt = make(compression=adacomp.Compression.fp16)
    assert {opt.route_of(n).compressor.name for n, _ in model.named_parameters()} == {"fp16"}
    opt.remove_hooks()
    # Horovod's positional order: (optimizer, named_parameters, compression, backward_passes_per_step, op,
    # gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set)
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       adacomp.Compression.fp16, 2, adacomp.Average, 1.0, 0, None, True,
                                       adacomp.global_process_set)
    assert {opt.route_of(n).compressor.name for n, _ in model.named_parameters()} == {"fp16"}
    assert opt.backward_passes_per_step == 2 and opt.engine.options.sparse_as_dense
    opt.remove_hooks()
    layers = torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False) for _ in range(4)])
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=0.1),
                                       named_parameters=layers.named_parameters(), groups=2)
    assert [b.names for b in opt.buckets] == [["3.weight", "2.weight"], ["1.weight", "0.weight"]]
    opt.remove_hooks()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make(num_groups=3).remove_hooks()
    assert any(issubclass(w.category, DeprecationWarning) and "groups" in str(w.message) for w in seen)
    make(sparse_as_dense=True).remove_hooks()
    with pytest.raises(NotImplementedError, match="Adasum.*op=adacomp.Average"):
        make(op=adacomp.Adasum)
    with pytest.raises(ValueError, match="process_set.*not an adacomp process set.*add_process_set"):
        make(process_set=object())
    with pytest.raises(ValueError, match="has not been added"):
        make(process_set=adacomp.ProcessSet([0]))
    make(process_set=adacomp.global_process_set).remove_hooks()
    with pytest.raises(ValueError, match="groups as explicit lists.*fusion.bucket_mb"):
        make(groups=[[model[0].weight]])
    with pytest.raises(ValueError, match="sparse_as_dense must be True or False"):
        make(sparse_as_dense="yes")
    with pytest.raises(ConfigError, match="both compression"):
        adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), config={"compressor": "qsgd", "communicator": "allgather"},
                                     compression=adacomp.Compression.fp16)


def test_queries_before_and_after_init() -> None:
    adacomp.init("local")
    try:
        assert adacomp.is_initialized() and (adacomp.size(), adacomp.local_size(), adacomp.cross_size()) == (1, 1, 1)
        assert adacomp.gloo_built() is True and adacomp.mpi_enabled() is False and adacomp.ddl_built() is False
        with pytest.raises(ValueError, match="MPI is not in use"):
            adacomp.mpi_threads_supported()
        with pytest.raises(TypeError, match="handle"):
            adacomp.synchronize(3)
        bn = adacomp.SyncBatchNorm(4)  # a world of one: torch's SyncBatchNorm falls back to batch norm
        assert isinstance(bn, torch.nn.SyncBatchNorm) and bn(torch.randn(3, 4)).shape == (3, 4)
    finally:
        adacomp.shutdown()
    assert not adacomp.is_initialized()
    with pytest.raises(ValueError, match="not been initialized"):
        adacomp.mpi_threads_supported()


def test_broadcast_parameters_refuses_other_inputs() -> None:
    with pytest.raises(ValueError, match="invalid params of type Tensor"):
        adacomp.broadcast_parameters(torch.zeros(3))
    with pytest.raises(ValueError, match="cannot broadcast torch.optim.LBFGS"):
        adacomp.broadcast_optimizer_state(torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))]))
