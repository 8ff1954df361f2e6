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
from adacomp import ddp, fsdp
from adacomp.runtime import checkpoint
from adacomp.runtime import hvd_elastic as elastic
from adacomp.runtime.context import current as backend
from adacomp.errors import (AdacompError, CommunicationError, ConfigError, IncompatibleComponentsError,
                            NonFiniteGradientError, RanksDisagreeError, RankStateError)
from adacomp.runtime.hvd_api import *  # noqa: F401,F403 - Horovod's module-level API (rank, allreduce, ...)
from adacomp.runtime.hvd_api import __all__ as _hvd_api_all
from adacomp.engine.hvd_keywords import (Compression, apply_optimizer_kwargs, global_process_set,
                                         resolve_compression)
from adacomp.engine.optimizer import Average, DistributedOptimizer, InitialWeightsWarning, Sum
from adacomp.runtime.sync import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__version__ = "0.1.0"

__all__ = sorted({"AdacompError", "CommunicationError", "Compression", "Config", "ConfigError",
                  "DistributedOptimizer", "IncompatibleComponentsError", "InitialWeightsWarning", "NonFiniteGradientError", "RanksDisagreeError", "RankStateError",
                  "SyncBatchNorm", "apply_optimizer_kwargs", "backend", "broadcast_object",
                  "broadcast_optimizer_state", "broadcast_parameters", "global_process_set", "load_config",
                  "resolve_compression", "ddp", "fsdp", "checkpoint", "elastic", *_hvd_api_all})
