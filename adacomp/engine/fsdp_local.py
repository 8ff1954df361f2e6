"""Local steps on sharded parameters: DiLoCo-family outer synchronisation across HSDP's replicas.

    mesh = init_device_mesh("cpu", (hosts, per_host), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks: fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.AdamW(model.parameters())
    state = adacomp.fsdp.register(model, "configs/diloco.yaml", replicate_group=mesh["replicate"].get_group(),
                                  optimizer=opt)

Each host (one replica: the ranks of one shard group) trains with FSDP2 over its own fast links and
sends nothing across hosts for ``local_steps.every`` (H) steps; then every rank computes the
pseudo-gradient of *its shard* (theta - theta_r, DiLoCo Algorithm 1 line 10), the configured
compressor / memory / communicator average it over the replicate group (the ranks holding the same
shard on the other hosts) and the outer optimizer updates the synchronised shard (line 12). The
machinery is the DDP path's :class:`~adacomp.outer.loop.OuterLoop` (fragments, overlap, error
feedback, uneven-data drain) over each parameter's local shard: the error-feedback residual and the
outer momentum are sharded like the parameters (1/shard of the model per rank).

FSDP2 itself must not all-reduce across replicas: shard over the 1-D shard mesh, not the 2-D HSDP
mesh (checked). The outer loop runs after every ``optimizer.step()`` (a step post-hook); at
construction the shards are broadcast from the first replica, as DDP syncs its parameters.
``compressor: none`` with outer SGD (lr 1, momentum 0) is Local SGD: after a synchronisation the
full model equals the average of the hosts' models (tests/test_fsdp.py, against a one-process
simulation of the hosts).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from adacomp import backends
from adacomp.backends.base import Backend
from adacomp.config import Config
from adacomp.engine.metrics import StepStats
from adacomp.engine.optimizer_state import creating_state_for_dcp
from adacomp.errors import ConfigError
from adacomp.outer.loop import OuterLoop


def _local(p: Tensor) -> Tensor:
    """The tensor FSDP2's sharded parameter keeps this rank's rows in (in-place writes reach the
    parameter; a plain tensor is its own shard)."""
    from torch.distributed.tensor import DTensor
    if isinstance(p, DTensor):
        with torch.no_grad():
            return p.to_local()
    return p


class OuterState:
    """The outer loop over this rank's shards, driven by the optimizer's steps.
    ``state_dict()`` is this rank's (synchronised shards, outer optimizer, residuals)."""

    kind = "hsdp-local-steps"

    def __init__(self, model: torch.nn.Module, config: Config, replicate_group: Any, optimizer: torch.optim.Optimizer,
                 backend: Backend | None = None):
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor
        self.config, self.group = config, replicate_group
        self.world = dist.get_world_size(replicate_group)
        meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
        if any(m.ndim != 1 for m in meshes):
            raise ValueError("adacomp.fsdp.register with local_steps: FSDP2 must shard over the 1-D shard mesh "
                             "(fully_shard(..., mesh=mesh['shard'])); over the 2-D HSDP mesh it would all-reduce "
                             "across replicas every step, which local steps exist to avoid")
        self.backend = backend if backend is not None else backends.create("torch", timeout_s=config.timeout_s,
                                                                          group=replicate_group)
        self.model = model
        params = [(name, _local(p)) for name, p in model.named_parameters()]
        first = dist.get_global_rank(replicate_group, 0)
        for _, t in params:  # start equal, as DDP does at construction
            dist.broadcast(t, src=first, group=replicate_group)
        self.outer = OuterLoop(config, params, self.backend)
        self.steps = 0
        self._loading = False  # torch's get_state_dict may step a fresh optimizer once: not a training step
        self.last_stats: StepStats | None = None
        self.history: list[dict[str, Any]] = []
        # the synchronised copies are taken before the first inner step, from the model as the script
        # left it then (weights loaded after register() included), as the optimizer's outer loop does
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._on_step)]

    def _counts(self) -> bool:
        """Whether the optimizer's step in progress is a training step (not torch's checkpoint
        creating the optimizer's state, which steps a fresh one once at lr 0)."""
        return not self._loading and not creating_state_for_dcp()

    def _before_step(self, *_: Any) -> None:
        if self._counts() and not self.outer.started:
            self._refresh()
            self.outer.start()

    def _on_step(self, *_: Any) -> None:
        if self._counts():
            self.after_step()

    def after_step(self) -> StepStats:
        """One inner step done: the synchronisations due after it (every rank, same step count)."""
        self.steps += 1
        self._refresh()
        stats = self.outer.after_step(self.steps)
        self.last_stats = stats
        self.history.append(stats.as_dict())
        return stats

    def _refresh(self) -> None:
        """Point the fragments at the parameters' current local shards: FSDP2 may give a sharded
        parameter new storage (``load_state_dict`` / ``set_state_dict`` does), and the outer step
        must write where the model reads."""
        by_name = {name: _local(p) for name, p in self.model.named_parameters()}
        for fr in self.outer.fragments:
            fr.local = [by_name[n] for n in fr.names]

    def outer_sync(self) -> None:
        """End the window now on every rank (before evaluating or saving the final model): all
        replicas continue from the same shards."""
        self._refresh()
        if not self.outer.started:
            self.outer.start()
        self.outer.flush(self.steps)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state["outer"])
        self.steps = int(state["steps"])

    def dcp_state_dict(self) -> dict[str, Any]:
        """This rank's state under ``rank<r>`` for ``torch.distributed.checkpoint`` (shards differ
        per rank) and the layout, so :meth:`load_dcp` refuses another mesh."""
        import torch.distributed as dist
        return {f"rank{dist.get_rank()}": self.state_dict(),
                "layout": {"kind": self.kind, "world": dist.get_world_size(), "group": self.world}}

    def save_checkpoint(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id: Any) -> None:
        """A DCP checkpoint of the model, the inner optimizer and this state. Inside a window the
        replicas' models and inner optimizer states differ, and DCP writes a shard that several ranks
        hold once; so each replica's go under its own key (``replica<i>``)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({self._replica(): {"model": msd, "optim": osd}, "adacomp": self.dcp_state_dict()},
                 checkpoint_id=checkpoint_id)

    def load_checkpoint(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint_id: Any) -> None:
        """Resume what :meth:`save_checkpoint` wrote, on the same mesh: bitwise."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        self._loading = True
        try:
            msd, osd = get_state_dict(model, optimizer)
            dcp.load({self._replica(): {"model": msd, "optim": osd}}, checkpoint_id=checkpoint_id)
            set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)  # loaded in place
        finally:
            self._loading = False
        self.load_dcp(checkpoint_id)

    def _replica(self) -> str:
        import torch.distributed as dist
        return f"replica{dist.get_group_rank(self.group, dist.get_rank())}"

    def load_dcp(self, checkpoint_id: Any, key: str = "adacomp") -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
        saved = _load_state_dict_from_keys({key}, checkpoint_id=checkpoint_id)[key]
        layout = saved.get("layout", {})
        if layout.get("kind") != self.kind:
            raise ValueError(f"adacomp.fsdp: the checkpoint {checkpoint_id!s} holds {layout.get('kind')!r} state under "
                             f"{key!r}; this model's is {self.kind!r} (register(..., optimizer=...) with local_steps)")
        if (layout["world"], layout["group"]) != (dist.get_world_size(), self.world):
            raise ValueError(f"adacomp.fsdp: the checkpoint {checkpoint_id!s} was written by {layout['world']} ranks "
                             f"({layout['group']} replicas); local steps on sharded parameters resume on the same "
                             f"mesh only, this job has {dist.get_world_size()} ranks ({self.world} replicas)")
        self.load_state_dict(saved[f"rank{dist.get_rank()}"])


def register_local_steps(model: torch.nn.Module, config: Config, replicate_group: Any,
                         optimizer: torch.optim.Optimizer | None, backend: Backend | None = None) -> OuterState:
    if replicate_group is None:
        raise ConfigError("local_steps", "local steps on FSDP2 synchronise across HSDP's replicas: pass "
                                         "replicate_group=mesh['replicate'].get_group() (plain FSDP2 reduce-scatters "
                                         "every step by construction)")
    if optimizer is None:
        raise ConfigError("local_steps", "the outer loop runs after each inner optimizer step: pass "
                                         "adacomp.fsdp.register(..., optimizer=your_optimizer)")
    return OuterState(model, config, replicate_group, optimizer, backend)


__all__ = ["OuterState", "register_local_steps"]
