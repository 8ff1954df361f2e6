"""``from adacomp.fsdp import register``: adacomp's compression on FSDP2, HSDP's replicate dimension,
plain FSDP2's reduce-scatter, or local steps across HSDP's replicas (the implementation is :mod:`adacomp.engine.fsdp`)."""
from adacomp.engine.fsdp import OuterState, ReplicaState, ScatterState, register

__all__ = ["OuterState", "ReplicaState", "ScatterState", "register"]
