"""``from adacomp.fsdp import register``: adacomp's compression on FSDP2, HSDP's replicate dimension
or plain FSDP2's reduce-scatter (the implementation is :mod:`adacomp.engine.fsdp`)."""
from adacomp.engine.fsdp import ReplicaState, ScatterState, register

__all__ = ["ReplicaState", "ScatterState", "register"]
