"""adacomp's compressors on HSDP's replicate dimension (FSDP2, ``fully_shard``).

    mesh = init_device_mesh("cpu", (hosts, per_host), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks: fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = adacomp.fsdp.register(model, "configs/topk.yaml", replicate_group=mesh["replicate"].get_group())

Why the replicate dimension: HSDP shards parameters inside a host (fast links) and replicates them
across hosts (the slow link), where every step all-reduces each shard's gradient. That all-reduce is
what compression should shrink. FSDP2 hands each unit's reduce-scatter output (this rank's shard of
the gradient, averaged over the shard group) to ``set_all_reduce_hook`` when it runs over a 1-D shard
mesh; :func:`register` installs a hook that averages it over ``replicate_group`` through adacomp's
round (the same begin -> launch -> vote -> finish -> rollback code as the optimizer and the DDP hook),
in place. With ``compressor: none`` this is exactly native HSDP's all-reduce (the same sums and
divisions: tests/test_fsdp.py checks bitwise equality with ``fully_shard`` over a 2-D mesh).

Each FSDP unit is one flat tensor to the round (its shard: the error-feedback state is sharded
like the parameters, each rank keeping the residual of the shard it owns), keyed by the unit's
module name. ``state_dict()`` is this rank's (as for the DDP hook); ``dcp_state_dict()`` puts it
under a rank key for ``torch.distributed.checkpoint`` (resume is bitwise: tests/test_fsdp.py). Not
yet: compression of the reduce-scatter itself (plain FSDP2), a DCP resume on another world size,
local steps on sharded parameters.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from adacomp.backends.base import Backend
from adacomp.config import Config, load
from adacomp.engine.ddp import HookState
from adacomp.errors import ConfigError


class _Shard:
    """The bucket interface :class:`HookState` reads, over one FSDP unit's reduce-scatter output: one
    "parameter" (a stand-in tensor of the shard's shape, so the unit has a stable name) whose
    gradient is the shard; the means are written back into it."""

    def __init__(self, key: Tensor, grad: Tensor):
        self.key, self.grad = key, grad

    def index(self) -> int:
        return 0

    def parameters(self) -> list[Tensor]:
        return [self.key]

    def gradients(self) -> list[Tensor]:
        return [self.grad]

    def buffer(self) -> Tensor:
        return self.grad

    def is_last(self) -> bool:
        return True


class _Unit:
    """One FSDP unit's hook: its round state is built at the first backward, when the shard's size
    is known."""

    def __init__(self, owner: "ReplicaState", name: str):
        self.owner, self.name = owner, name
        self.state: HookState | None = None
        self.key: Tensor | None = None

    def build(self, shard: Tensor) -> HookState:
        self.key = torch.empty(shard.shape, dtype=shard.dtype, requires_grad=True)  # a "parameter" to the route table
        self.state = HookState(self.owner.config, [(self.name, self.key)], backend=self.owner.backend,
                               grad_scaler=self.owner.grad_scaler,
                               process_group=self.owner.group if self.owner.backend is None else None)
        pending = self.owner.pending.pop(self.name, None)
        if pending is not None:
            self.state.load_state_dict(pending)
        return self.state

    def __call__(self, shard: Tensor) -> None:
        state = self.state if self.state is not None else self.build(shard)
        assert self.key is not None
        if shard.shape != self.key.shape:
            raise RuntimeError(f"FSDP unit {self.name!r}: its reduce-scatter output changed shape "
                               f"({tuple(self.key.shape)} -> {tuple(shard.shape)}); one adacomp.fsdp state per model")
        state(_Shard(self.key, shard))


class ReplicaState:
    """Every FSDP unit's round over the replicate group; ``state_dict()`` / ``load_state_dict()``
    hold each unit's residuals and compressor state (this rank's: per-rank, as for the DDP hook)."""

    def __init__(self, config: Any, replicate_group: Any, backend: Backend | None = None, grad_scaler: Any = None):
        self.config: Config = load(config)
        self.group, self.backend, self.grad_scaler = replicate_group, backend, grad_scaler
        self.units: dict[str, _Unit] = {}
        self.pending: dict[str, dict[str, Any]] = {}  # loaded before a unit's first backward

    @property
    def steps(self) -> int:
        """Rounds completed by the first unit (every unit completes one per backward)."""
        built = [u.state.steps for u in self.units.values() if u.state is not None]
        return built[0] if built else 0

    def state_dict(self) -> dict[str, Any]:
        out = {name: u.state.state_dict() for name, u in self.units.items() if u.state is not None}
        return {"units": {**self.pending, **out}}

    def dcp_state_dict(self) -> dict[str, Any]:
        """This rank's state under a key of its own, for ``torch.distributed.checkpoint``: DCP writes
        a plain (non-DTensor) entry once, from one rank, when every rank has the same key; residuals
        differ per rank (per shard and per replica), so each rank's go under ``rank<r>``. Load with
        :meth:`load_dcp_state_dict` after ``dcp.load`` into a :meth:`dcp_state_dict` template (the
        same world size and mesh; another world size is not supported yet)."""
        return {f"rank{torch.distributed.get_rank()}": self.state_dict()}

    def load_dcp_state_dict(self, state: dict[str, Any]) -> None:
        key = f"rank{torch.distributed.get_rank()}"
        if key not in state:
            raise ValueError(f"adacomp.fsdp: the checkpoint holds {sorted(state)}, not this rank's {key!r}: was it "
                             "written by a job with another world size?")
        self.load_state_dict(state[key])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, unit_state in state["units"].items():
            if name not in self.units:
                raise ValueError(f"adacomp.fsdp state has unit {name!r}, which this model does not have; units: "
                                 f"{sorted(self.units)}")
            unit = self.units[name]
            if unit.state is None:
                self.pending[name] = unit_state
            else:
                unit.state.load_state_dict(unit_state)


def register(model: torch.nn.Module, config: Any = None, *, replicate_group: Any, backend: Backend | None = None,
             grad_scaler: Any = None) -> ReplicaState:
    """Install adacomp's round as the all-reduce hook of every FSDP unit in ``model`` (FSDP2 over a
    1-D shard mesh), averaging each shard over ``replicate_group`` (HSDP's replicate dimension)."""
    from torch.distributed.fsdp import FSDPModule
    if replicate_group is None:
        raise ConfigError("replicate_group", "adacomp.fsdp compresses HSDP's replicate dimension: pass the "
                                             "replicate group (mesh['replicate'].get_group()); compressing plain "
                                             "FSDP2's reduce-scatter is not supported yet")
    state = ReplicaState(config, replicate_group, backend, grad_scaler)
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            if getattr(module, "_adacomp_fsdp", None) is not None:
                raise RuntimeError(f"FSDP unit {name or '<root>'!r} already has an adacomp.fsdp hook")
            unit = _Unit(state, name or "<root>")
            state.units[unit.name] = unit
            module.set_all_reduce_hook(unit)
            setattr(module, "_adacomp_fsdp", unit)  # marks the unit: one adacomp.fsdp state per model
    if not state.units:
        raise ValueError("adacomp.fsdp.register: no FSDP unit in the model; call fully_shard(...) first")
    return state


__all__ = ["ReplicaState", "register"]
