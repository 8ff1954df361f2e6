"""``from adacomp.ddp import hook``: adacomp's compression as a PyTorch DDP communication hook
(the implementation is :mod:`adacomp.engine.ddp`)."""
from adacomp.engine.ddp import HookState, hook, register

__all__ = ["HookState", "hook", "register"]
