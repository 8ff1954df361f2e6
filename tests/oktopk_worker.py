"""Worker for tests/test_oktopk_backends.py: a few steps of ``oktopk`` (compressor and, by
default, its sparse-allreduce communicator) on the backend the launcher selects; prints
``OKTOPK_DIGEST rank=<r> <hex>`` of the parameters. Every rank reduces and averages in rank order,
so the bits are the same on gloo, MPI and Horovod."""
from __future__ import annotations

import sys

import torch


def digest() -> str:
    import adacomp
    from tests._dist import params_digest, train_random_steps
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    cfg = {"compressor": {"name": "oktopk", "density": 0.05, "period": 2}, "memory": "residual",
           "min_numel": 0, "fusion": {"bucket_mb": 0.004}}
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), config=cfg)
    train_random_steps(model, opt, 5, 32, 10, 100 + adacomp.rank())
    opt.remove_hooks()
    return params_digest(model)


def run(backend: str) -> str:
    import adacomp
    adacomp.init(backend=backend)
    try:
        d = digest()
        everyone = adacomp.runtime.context.current().allgather_object(d)
        if len(set(everyone)) != 1:
            raise AssertionError(f"ranks ended with different parameters: {everyone}")
        print(f"OKTOPK_DIGEST rank={adacomp.rank()} {d}", flush=True)
        return d
    finally:
        adacomp.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(sys.argv[1])
