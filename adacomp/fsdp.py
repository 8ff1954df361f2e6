"""``from adacomp.fsdp import register``: adacomp's compression on HSDP's replicate dimension
(FSDP2; the implementation is :mod:`adacomp.engine.fsdp`)."""
from adacomp.engine.fsdp import ReplicaState, register

__all__ = ["ReplicaState", "register"]
