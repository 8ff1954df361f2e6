"""adacomp's compression in Accelerate: one call after ``accelerator.prepare``.

    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = adacomp.integrations.accelerate.register(accelerator, model, "configs/topk.yaml")
    ...
    accelerator.save_state("ckpt")     # every rank's compression state included
    accelerator.load_state("ckpt")     # each rank gets its own back

:func:`register` puts adacomp's hook on the prepared DDP model (over its process group), makes it
follow ``accelerator.scaler`` (or the ``grad_scaler`` you use yourself), and registers
:class:`adacomp.checkpoint.PerRank` for checkpointing: Accelerate calls its ``state_dict()`` on
every rank when saving (the gather) and writes rank 0's copy, which holds every rank's state. So
call ``save_state`` on every process, as Accelerate's DDP examples do: under ``if
accelerator.is_main_process:`` the main process raises after the config's ``timeout_s`` (the other
ranks never join the gather) instead of waiting for the process group's half-hour timeout.
"""
from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

from adacomp.engine.ddp import HookState
from adacomp.engine.ddp import register as register_hook
from adacomp.runtime.per_rank import PerRank


def register(accelerator: Any, model: Any, config: Any = None, grad_scaler: Any = None) -> HookState:
    """Register the hook on ``model`` (the object ``accelerator.prepare`` returned) and its state for
    ``save_state`` / ``load_state``; returns the hook state. Call it before the first backward."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"adacomp.integrations.accelerate.register needs the DDP model accelerator.prepare(model) "
                        f"returns in a multi-process run; got {type(model).__name__} (one process, or not prepared: "
                        "nothing to compress)")
    scaler = grad_scaler if grad_scaler is not None else getattr(accelerator, "scaler", None)
    state = register_hook(model, config, grad_scaler=scaler)
    accelerator.register_for_checkpointing(PerRank(state))
    return state


__all__ = ["register"]
