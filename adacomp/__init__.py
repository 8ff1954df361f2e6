"""adacomp: gradient compression for data-parallel PyTorch, Horovod style.

    import adacomp
    adacomp.init()
    opt = adacomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       config="configs/topk.yaml")
    adacomp.broadcast_parameters(model.state_dict(), root_rank=0)
    adacomp.broadcast_optimizer_state(opt, root_rank=0)
"""
from __future__ import annotations

from adacomp.config import Config, load as load_config
from adacomp import ddp
from adacomp.context import current as backend, init, shutdown
from adacomp.errors import (AdacompError, CommunicationError, ConfigError, IncompatibleComponentsError,
                            NonFiniteGradientError)
from adacomp.optimizer import Average, DistributedOptimizer, Sum
from adacomp.sync import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__version__ = "0.1.0"


def rank() -> int:
    """This process's rank in the job."""
    return backend().rank()


def size() -> int:
    """Number of processes in the job."""
    return backend().size()


def local_rank() -> int:
    """Rank among the processes on this machine."""
    return backend().local_rank()


__all__ = ["AdacompError", "Average", "CommunicationError", "Config", "ConfigError", "DistributedOptimizer",
           "IncompatibleComponentsError", "NonFiniteGradientError", "Sum", "backend", "broadcast_object",
           "broadcast_optimizer_state", "broadcast_parameters", "ddp", "init", "load_config", "local_rank", "rank",
           "shutdown", "size"]
