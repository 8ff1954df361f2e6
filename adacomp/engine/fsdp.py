"""adacomp's compressors on FSDP2 (``fully_shard``): HSDP's replicate dimension, or plain FSDP2's
reduce-scatter.

    # HSDP: shard inside a host, replicate across hosts; compress the replicate all-reduce
    mesh = init_device_mesh("cpu", (hosts, per_host), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks: fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = adacomp.fsdp.register(model, "configs/topk.yaml", replicate_group=mesh["replicate"].get_group())

    # plain FSDP2 over a 1-D mesh: compress the reduce-scatter
    state = adacomp.fsdp.register(model, "configs/topk.yaml")

Why the replicate dimension: HSDP shards parameters inside a host (fast links) and replicates them
across hosts (the slow link), where every step all-reduces each shard's gradient. FSDP2 hands each
unit's reduce-scatter output to ``set_all_reduce_hook`` when it runs over a 1-D shard mesh; the hook
averages it over ``replicate_group`` through adacomp's round (the optimizer's and the DDP hook's
begin -> launch -> vote -> finish -> rollback), in place. The round sees each parameter's rows of
the shard (so low-rank compressors have matrices to factor), and error feedback is sharded like the
parameters. ``compressor: none`` is native HSDP bitwise.

Plain FSDP2: a compressed payload cannot be summed piecewise by a reduce-scatter, so each unit's
reduce-scatter (``set_custom_reduce_scatter``) sends every rank's *full* gradient through the round
over the shard group (per parameter, with its model name and full shape: the DDP hook's routes,
compressors and residuals; a sparsifier with ``allgather`` is allgather-then-reduce, a cast or
quantiser with ``allreduce`` is dense) and each rank keeps its own rows of the mean. The cost, said
plainly: the residual is of the full gradient on every rank (error feedback costs what it costs under
DDP, ``W`` times a shard), and the mean is computed in full on every rank. A unit whose parameters
all route to ``compressor: none`` runs FSDP2's own reduce-scatter (bitwise native).

``state_dict()`` is this rank's (as for the DDP hook). ``dcp_state_dict()`` puts it under a rank
key with the layout for ``torch.distributed.checkpoint``; ``load_dcp(checkpoint_id)`` reads every
saved rank's entry and loads this rank's: bitwise on the same world size, by the world-size rule of
:mod:`adacomp.checkpoint_reshard` on another world size or mesh (plain FSDP2: the old ranks' mean;
HSDP: each old replica's shards joined, the replicas averaged, cut into the new mesh's shards).
Tests: tests/test_fsdp.py (HSDP, 4 ranks), tests/test_fsdp_scatter.py (plain FSDP2, 2 and 3 ranks).
Local steps (``local_steps`` in the config): :mod:`adacomp.engine.fsdp_local`. Not yet: a compressed reduce-scatter that moves only each owner's
part (alltoall of compressed parts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from adacomp import backends
from adacomp.backends.base import Backend
from adacomp.config import Config, load
from adacomp.engine import agreement
from adacomp.engine.ddp import HookState
from adacomp.engine.fsdp_local import OuterState, register_local_steps
from adacomp.errors import ConfigError


class _Unit:
    """One FSDP unit's hook: its round state is built at the first backward, when the shard's size
    is known. The round sees the shard as one tensor per parameter, named as in the model and shaped
    ``(rows of this shard, *the parameter's other dims)`` (views into the flat output, FSDP2's
    padding rows included), so routes, ``min_numel``, low-rank compressors and residual names are
    per parameter as under DDP; a unit without a known layout is one flat tensor."""

    def __init__(self, owner: "ReplicaState", name: str, pieces: "list[_Piece] | None" = None):
        self.owner, self.name, self.pieces = owner, name, pieces or []
        self.state: HookState | None = None
        self.keys: list[Tensor] = []
        self.numel = -1

    def views(self, shard: Tensor) -> list[Tensor]:
        if not self.pieces:
            return [shard]
        out = []
        for pc in self.pieces:
            part = shard[pc.offset:pc.offset + pc.chunk]
            out.append(part.view(-1, *pc.shape[1:]) if len(pc.shape) > 1 else part)
        return out

    def build(self, shard: Tensor) -> HookState:
        if self.pieces and sum(pc.chunk for pc in self.pieces) != shard.numel():
            raise RuntimeError(f"FSDP unit {self.name!r}: its reduce-scatter output has {shard.numel()} elements, "
                               f"its parameters' padded shards {sum(pc.chunk for pc in self.pieces)}")
        names = [pc.name for pc in self.pieces] or [self.name]
        # stand-ins of each view's shape for the route table (no storage: a 0-dim tensor expanded)
        self.keys = [torch.zeros((), dtype=shard.dtype).expand(v.shape).requires_grad_() for v in self.views(shard)]
        self.numel = shard.numel()
        self.state = HookState(self.owner.config, list(zip(names, self.keys)), backend=self.owner.backend,
                               grad_scaler=self.owner.grad_scaler,
                               process_group=self.owner.group if self.owner.backend is None else None, agree=False,
                               ddp=False)
        pending = self.owner.pending.pop(self.name, None)
        if pending is not None:
            self.state.load_state_dict(pending)
        return self.state

    def __call__(self, shard: Tensor) -> None:
        state = self.state if self.state is not None else self.build(shard)
        if shard.numel() != self.numel:
            raise RuntimeError(f"FSDP unit {self.name!r}: its reduce-scatter output changed size "
                               f"({self.numel} -> {shard.numel()}); one adacomp.fsdp state per model")
        state(_Gradients(self.keys, self.views(shard)))  # the means are written into the views: the shard


class ReplicaState:
    """Every FSDP unit's round over the replicate group; ``state_dict()`` / ``load_state_dict()``
    hold each unit's residuals and compressor state (this rank's: per-rank, as for the DDP hook)."""

    kind = "hsdp"

    def __init__(self, config: Any, replicate_group: Any, backend: Backend | None = None, grad_scaler: Any = None):
        self.config: Config = load(config)
        self.group, self.backend, self.grad_scaler = replicate_group, backend, grad_scaler
        self.world = torch.distributed.get_world_size(replicate_group)
        self.shard = torch.distributed.get_world_size() // self.world  # the shard mesh's size
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
        """This rank's state for ``torch.distributed.checkpoint`` (see :func:`_dcp_state_dict`); resume
        with :meth:`load_dcp`."""
        return _dcp_state_dict(self)

    def load_dcp(self, checkpoint_id: Any, key: str = "adacomp") -> None:
        _load_dcp(self, checkpoint_id, key)

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



# --- plain FSDP2: compression on the reduce-scatter ---------------------------------------------------

@dataclass
class _Piece:
    """One parameter's place in an FSDP unit's reduce-scatter input: FSDP2 lays the input out as
    ``[world, row]``, row r the concatenation of every parameter's r-th dim-0 chunk (padded)."""

    name: str
    shape: torch.Size  # the full (unsharded) shape
    offset: int  # into a row
    chunk: int  # numel of one rank's padded chunk


class _Gradients:
    """The bucket interface :class:`HookState` reads, over a unit's full gradients (one per
    parameter, rebuilt from the reduce-scatter input); the means are written back into them."""

    def __init__(self, keys: list[Tensor], grads: list[Tensor]):
        self.keys, self.grads = keys, grads

    def index(self) -> int:
        return 0

    def parameters(self) -> list[Tensor]:
        return self.keys

    def gradients(self) -> list[Tensor]:
        return self.grads

    def buffer(self) -> Tensor:
        return self.grads[0]

    def is_last(self) -> bool:
        return True


def _native_reduce_scatter() -> Any:
    """torch.distributed's single-tensor reduce-scatter: ``reduce_scatter_single`` since the rename in
    pytorch/pytorch#186123 (torch 2.13 here; the old name is its alias), ``reduce_scatter_tensor`` only
    before it (the lent GPU's torch 2.11, where every adacomp FSDP2 test failed on this name)."""
    import torch.distributed as dist
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _param_groups(module: Any) -> list[Any]:
    """A unit's FSDP param groups: a list in torch 2.13 (``_fsdp_param_groups``; per-parameter
    meshes can make several), one optional ``_fsdp_param_group`` in older releases."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        return [] if one is None else [one]
    return list(groups)


def _reduce_scatter_base() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    return ReduceScatter


class _Scatter:
    """One FSDP unit's reduce-scatter (FSDP2's ``set_custom_reduce_scatter``): every rank's full
    gradient goes through adacomp's round over the shard group (per parameter, with its model name
    and full shape, so routes, compressors and residuals are the DDP path's), and each rank keeps
    the rows of the mean it owns. A unit whose parameters all route to ``compressor: none`` runs
    FSDP2's own ``reduce_scatter_single``: bitwise native, and half the bytes of an all-reduce."""

    def __init__(self, owner: "ScatterState", name: str, pieces: list[_Piece], dtype: torch.dtype):
        self.owner, self.name, self.pieces = owner, name, pieces
        # stand-ins of the full shape for the route table (no storage: a 0-dim tensor expanded)
        self.keys = [torch.zeros((), dtype=dtype).expand(pc.shape).requires_grad_() for pc in pieces]
        self.state = HookState(owner.config, [(pc.name, k) for pc, k in zip(pieces, self.keys)],
                               backend=owner.backend, grad_scaler=owner.grad_scaler,
                               process_group=owner.group if owner.backend is None else None, agree=False,
                               ddp=False)
        self.native = all(self.state.table.route_of[pc.name].compressor.name == "none" for pc in pieces)
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        import torch.distributed as dist
        self.calls += 1
        if self.native:
            return _native_reduce_scatter()(output_tensor, input_tensor, group=group, op=op, async_op=async_op)
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise RuntimeError(f"adacomp.fsdp (FSDP unit {self.name!r}): FSDP2 asked for reduce op {op!r}; adacomp "
                               "averages (AVG) or sums (SUM) only, so set_reduce_scatter_divide_factor / "
                               "set_gradient_divide_factor cannot be combined with compression")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if world != self.owner.world:
            raise RuntimeError(f"adacomp.fsdp (FSDP unit {self.name!r}): reduce-scatter over {world} ranks, but the "
                               f"state was registered for the unit's {self.owner.world}-rank shard mesh")
        rows = input_tensor.view(world, -1)
        grads = [rows[:, pc.offset:pc.offset + pc.chunk].reshape(-1, *pc.shape[1:])[:pc.shape[0]].contiguous()
                 for pc in self.pieces]
        self.state(_Gradients(self.keys, grads))  # the means replace grads, in place
        for pc, g in zip(self.pieces, grads):
            per_row = g[0].numel() if g.dim() > 0 and g.shape[0] else 1
            n_rows = pc.chunk // per_row
            lo, hi = min(rank * n_rows, pc.shape[0]), min((rank + 1) * n_rows, pc.shape[0])
            dst = output_tensor[pc.offset:pc.offset + pc.chunk]
            n = (hi - lo) * per_row
            if n:
                dst[:n].copy_(g.reshape(pc.shape[0], -1)[lo:hi].reshape(-1))
            dst[n:].zero_()  # FSDP2's padding rows: the reduce-scatter of zeros
            if op == dist.ReduceOp.SUM:  # FSDP2 divides afterwards (fp16 reduce dtype)
                dst.mul_(world)
        return None


class ScatterState:
    """Every FSDP unit's compressed reduce-scatter (plain FSDP2). ``state_dict()`` holds each
    unit's residuals and compressor state: per rank, and *full size* (the residual of what this rank
    compressed, its whole local gradient), so error feedback costs what it costs under DDP, not a
    shard's worth."""

    kind = "fsdp"

    def __init__(self, config: Any, group: Any, world: int, backend: Backend | None = None, grad_scaler: Any = None):
        self.config: Config = load(config)
        self.group, self.world, self.backend, self.grad_scaler = group, world, backend, grad_scaler
        self.units: dict[str, _Scatter] = {}

    @property
    def steps(self) -> int:
        """Rounds completed by the first compressed unit (0 when every unit is native)."""
        built = [u.state.steps for u in self.units.values() if not u.native]
        return built[0] if built else 0

    def state_dict(self) -> dict[str, Any]:
        return {"units": {name: u.state.state_dict() for name, u in self.units.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, unit_state in state["units"].items():
            if name not in self.units:
                raise ValueError(f"adacomp.fsdp state has unit {name!r}, which this model does not have; units: "
                                 f"{sorted(self.units)}")
            self.units[name].state.load_state_dict(unit_state)

    def reshard(self, states: list[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
        """This rank's state from every old rank's (rank order) for a job of ``world`` ranks: each
        unit by the world-size rule of adacomp.checkpoint_reshard (residuals: the mean over the old
        ranks, so what the averaged update owes is kept)."""
        return {"units": {name: u.state.io.reshard([s["units"].get(name, {"components": {}}) for s in states],
                                                    world, rank)
                          for name, u in self.units.items() if name in states[0]["units"]}}

    def dcp_state_dict(self) -> dict[str, Any]:
        return _dcp_state_dict(self)

    def load_dcp(self, checkpoint_id: Any, key: str = "adacomp") -> None:
        _load_dcp(self, checkpoint_id, key)


def _dcp_state_dict(state: Any) -> dict[str, Any]:
    """This rank's state under ``rank<r>`` (DCP writes a plain entry once, from one rank, when every
    rank has the same key; residuals differ per rank), and the layout it was saved with (equal on
    every rank: written once) so a resume on another world size is recognised."""
    import torch.distributed as dist
    layout = {"kind": state.kind, "world": dist.get_world_size(), "group": int(state.world),
              "shard": int(getattr(state, "shard", state.world)),
              "pieces": {name: [[pc.name, list(pc.shape)] for pc in u.pieces] for name, u in state.units.items()}}
    return {f"rank{dist.get_rank()}": state.state_dict(), "layout": layout}


def _load_dcp(state: Any, checkpoint_id: Any, key: str) -> None:
    """Read every old rank's entry under ``key`` of a DCP checkpoint (not a template: a fresh state
    has no residuals yet, and a template would silently load none) and load this rank's; on another
    world size, plain FSDP2's full-size residuals are resharded by the world-size rule, HSDP's
    (sharded by the old mesh) by :func:`_reshard_hsdp`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    saved = _load_state_dict_from_keys({key}, checkpoint_id=checkpoint_id)[key]
    layout = saved.get("layout")
    if layout is None:
        raise ValueError(f"adacomp.fsdp: the checkpoint's {key!r} entry has no layout: was it written by "
                         "state.dcp_state_dict()?")
    world, rank = dist.get_world_size(), dist.get_rank()
    if layout["kind"] != state.kind:
        raise ValueError(f"adacomp.fsdp: the checkpoint holds {layout['kind']} state (register(..., "
                         f"replicate_group=...) {'with' if layout['kind'] == 'hsdp' else 'without'} a replicate group); "
                         f"this model's state is {state.kind}")
    if layout["world"] == world and layout["group"] == state.world:
        state.load_state_dict(saved[f"rank{rank}"])
        return
    if state.kind == "hsdp":
        state.load_state_dict(_reshard_hsdp(state, saved, layout))
        return
    olds = [saved[f"rank{r}"] for r in range(layout["world"])]
    state.load_state_dict(state.reshard(olds, world, rank))


def _rows(shape: list[int], shards: int) -> tuple[int, int]:
    """(rows per shard, elements per row) of a parameter under FSDP2's dim-0 sharding with padding."""
    per_row = 1
    for d in shape[1:]:
        per_row *= d
    return -(-shape[0] // shards), per_row


def _unshard(flats: list[Tensor], shapes: list[list[int]]) -> Tensor:
    """Every parameter's full values, concatenated, from the ``len(flats)`` shards of a unit's flat
    reduce-scatter output (each shard: every parameter's padded rows, in order)."""
    out, offset = [], 0
    for shape in shapes:
        rows, per_row = _rows(shape, len(flats))
        n = rows * per_row
        out.append(torch.cat([f[offset:offset + n] for f in flats])[:shape[0] * per_row])
        offset += n
    return torch.cat(out)


def _shard_of(full: Tensor, shapes: list[list[int]], shards: int, index: int) -> Tensor:
    """Shard ``index`` of ``shards`` of a unit's flat layout, from every parameter's full values."""
    out, offset = [], 0
    for shape in shapes:
        rows, per_row = _rows(shape, shards)
        n = shape[0] * per_row
        padded = torch.zeros(rows * shards * per_row, dtype=full.dtype)
        padded[:n] = full[offset:offset + n]
        out.append(padded[index * rows * per_row:(index + 1) * rows * per_row])
        offset += n
    return torch.cat(out)


def _reshard_hsdp(state: "ReplicaState", saved: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    """This rank's HSDP state from a checkpoint of another mesh (``init_device_mesh(..., (R, S))``:
    rank ``r * S + s`` is replica r, shard s). Residuals are per shard and per replica: every
    replica's shards are joined into the unit's full residual, the replicas averaged (the world-size
    rule: the averaged update owes the same), and this rank takes its shard of the new layout; the
    rest (compressor state, steps) comes from old rank ``rank % W_old``."""
    import torch.distributed as dist
    from adacomp.engine.routes import RouteTable
    old_r, old_s = layout["group"], layout["shard"]
    rank = dist.get_rank()
    new_s, my_s, my_r = state.shard, dist.get_rank() % state.shard, dist.get_rank(state.group)
    base = saved[f"rank{rank % layout['world']}"]
    units: dict[str, Any] = {}
    for name, ust in base["units"].items():
        mine = [[pc.name, list(pc.shape)] for pc in state.units[name].pieces] if name in state.units else None
        if mine != layout["pieces"].get(name):
            raise ValueError(f"adacomp.fsdp: FSDP unit {name!r} holds {mine} here but {layout['pieces'].get(name)} in "
                             "the checkpoint; resharding HSDP state needs the same units and parameters")
        shapes = [shape for _, shape in layout["pieces"][name]]
        shape_of = {pname: shape for pname, shape in layout["pieces"][name]}
        comps = dict(ust["components"])
        for key, cstate in comps.items():
            memory = RouteTable.component_at(key)
            for owed in getattr(memory, "owed_keys", ()) if key.startswith("memory/") else ():
                new = dict(cstate.get(owed, {}))
                for tname, like in new.items():
                    # a parameter's residual (rows of its shard), or a unit's flat one (no layout known)
                    tshapes = [shape_of[tname]] if tname in shape_of else shapes
                    fulls = []
                    for r in range(old_r):
                        flats = [saved[f"rank{r * old_s + s}"]["units"][name]["components"].get(key, {}).get(owed, {})
                                 .get(tname, torch.zeros_like(like)).reshape(-1) for s in range(old_s)]
                        fulls.append(_unshard(flats, tshapes))
                    flat = _shard_of(sum(fulls) / old_r, tshapes, new_s, my_s)
                    new[tname] = flat.view(-1, *tshapes[0][1:]) if tname in shape_of and len(tshapes[0]) > 1 else flat
                cstate = {**cstate, owed: new}
            comps[key] = cstate
        units[name] = {**ust, "components": comps}
        if "owner" in ust:
            units[name]["owner"] = {"rank": my_r, "world": state.world}
    return {"units": units}


def _pieces(module: Any, names: dict[int, str], world: int) -> tuple[list[_Piece], torch.dtype]:
    """The layout of a unit's reduce-scatter input, from its FSDP parameters (FSDP2 keeps them on
    its param group; there is no public accessor in torch 2.13)."""
    from torch.distributed.tensor import Shard
    groups = _param_groups(module)
    if not groups:  # a unit whose parameters all belong to inner units (a root wrapper)
        return [], torch.float32
    if len(groups) != 1:
        raise ValueError("adacomp.fsdp: a unit with several param groups (shard_placement_fn with per-parameter "
                         "meshes) has no single reduce-scatter to compress")
    out, offset, dtype = [], 0, torch.float32
    for fp in groups[0].fsdp_params:
        if fp.fsdp_placement != Shard(0):
            raise ValueError(f"adacomp.fsdp: parameter {names.get(id(fp.sharded_param), '?')!r} is sharded on "
                             f"{fp.fsdp_placement}; compression supports Shard(0) (fully_shard's default) only")
        chunk = fp.padded_sharded_param_size.numel()
        out.append(_Piece(names[id(fp.sharded_param)], torch.Size(fp.sharded_param.shape), offset, chunk))
        offset, dtype = offset + chunk, fp.sharded_param.dtype
    return out, dtype


def register(model: torch.nn.Module, config: Any = None, *, replicate_group: Any = None,
             backend: Backend | None = None, grad_scaler: Any = None,
             optimizer: torch.optim.Optimizer | None = None) -> "ReplicaState | ScatterState | OuterState":
    """Compress every FSDP unit of ``model``'s gradient reduction with adacomp's round.

    * ``replicate_group`` given (HSDP: FSDP2 over the 1-D shard mesh, replicas across it): each
      shard is averaged over the replicate group from FSDP2's all-reduce hook; residuals are sharded.
    * no ``replicate_group`` (plain FSDP2 over a 1-D mesh): each unit's reduce-scatter is replaced
      through ``set_custom_reduce_scatter`` (docs.pytorch.org, ``FSDPModule``); full-size residuals.
    * a config with ``local_steps`` (and ``replicate_group``, ``optimizer``): no per-step hook; the
      outer loop synchronises the shards across replicas every H optimizer steps
      (:mod:`adacomp.engine.fsdp_local`).
    """
    from torch.distributed.fsdp import FSDPModule
    config = load(config)  # an invalid config fails here, on every rank, before any collective
    units = [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("adacomp.fsdp.register: no FSDP unit in the model; call fully_shard(...) first")
    for name, module in units:
        if getattr(module, "_adacomp_fsdp", None) is not None:
            raise RuntimeError(f"FSDP unit {name!r} already has an adacomp.fsdp hook")
    # every rank the same config and model, once here (the units' hook states do not check each):
    # over ``backend`` where given, else the whole world, before any collective of a round
    checker = backend if backend is not None else backends.create("torch", timeout_s=config.timeout_s)
    agreement.check(checker, agreement.fingerprint(config, [(n, p) for n, p in model.named_parameters()
                                                            if p.requires_grad]))
    if config.local_steps is not None:
        if grad_scaler is not None:
            raise ConfigError("local_steps", "a GradScaler with local steps on FSDP2 is not supported yet; FSDP2 "
                                             "trains in bf16 (MixedPrecisionPolicy) without one")
        out = register_local_steps(model, config, replicate_group, optimizer, backend)
        for name, module in units:
            setattr(module, "_adacomp_fsdp", out)
        return out
    if replicate_group is not None:
        rstate = ReplicaState(config, replicate_group, backend, grad_scaler)
        names = {id(p): n for n, p in model.named_parameters()}
        for name, module in units:
            unit = _Unit(rstate, name, _pieces(module, names, rstate.shard)[0])
            rstate.units[name] = unit
            module.set_all_reduce_hook(unit)
            setattr(module, "_adacomp_fsdp", unit)  # marks the unit: one adacomp.fsdp state per model
        return rstate
    names = {id(p): n for n, p in model.named_parameters()}
    meshes = {p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")}
    if len(meshes) != 1 or next(iter(meshes)).ndim != 1:
        raise ValueError(f"adacomp.fsdp.register without replicate_group compresses plain FSDP2's reduce-scatter over "
                         f"one 1-D mesh; this model's parameters are on {len(meshes)} mesh(es) "
                         f"{[m.ndim for m in meshes]}-D. For HSDP pass fully_shard the shard mesh and "
                         "replicate_group=mesh['replicate'].get_group()")
    mesh = next(iter(meshes))
    sstate = ScatterState(config, mesh.get_group(), mesh.size(), backend, grad_scaler)
    for name, module in units:
        pieces, dtype = _pieces(module, names, mesh.size())
        if not pieces:
            continue
        comm = _Scatter(sstate, name, pieces, dtype)
        sstate.units[name] = comm
        module.set_custom_reduce_scatter(comm)  # type: ignore[arg-type]
        setattr(module, "_adacomp_fsdp", comm)
    return sstate


__all__ = ["OuterState", "ReplicaState", "ScatterState", "register"]
