"""Checkpointable state of :class:`~adacomp.engine.optimizer.DistributedOptimizer`.

One job: turn every stateful component (per-parameter and per-bucket compressors, route
memories and communicators, the policy, the routing overrides, the loss-scale units) into plain
data and back, plus the in-memory snapshot / restore that MOO exploration uses.

Keys are stable across ranks, restarts and re-planned buckets: compressors by parameter name
(``compressor/<param>``) or fused-bucket key, memories and communicators by their route's spec
(``memory/<route spec>``; residuals inside are keyed by parameter name). Routing overrides are
saved and applied *first* on load, so a run whose policy rerouted tensors (ByteComp, L-GreCo)
finds the same routes before its component state is put back.
"""
from __future__ import annotations

import copy
import sys
import warnings
from typing import Any, Callable

import torch
from torch import Tensor

from adacomp.engine.error_feedback import LossScale
from adacomp.errors import RankStateError
from adacomp.engine.routes import RouteTable

STATE_KEY = "adacomp"  # the one extra key in the wrapped optimizer's torch state dict
DELEGATED = {"saved_by": "adacomp.checkpoint.PerRank"}  # its value when PerRank holds the compression state


class ComponentState:
    """``state_dict`` / ``load_state_dict`` / ``snapshot`` / ``restore`` over the route table."""

    def __init__(self, inner: torch.optim.Optimizer | None, table: RouteTable, loss_scale: LossScale,
                 policy: Callable[[], Any], steps: Callable[[], int], set_steps: Callable[[int], None],
                 extra: Callable[[], dict[str, Any]] | None = None,
                 owner: Callable[[], tuple[int, int] | None] | None = None):
        self.inner = inner  # None for the DDP hook: DDP users checkpoint their own optimizer
        self._extra = extra
        self.table = table
        self.loss_scale = loss_scale
        self._policy = policy
        self._steps = steps
        self._set_steps = set_steps
        self._owner = owner  # (rank, world) of this process, recorded in and checked against the state
        self.delegated = False  # adacomp.checkpoint.PerRank saves the compression state, not state_dict()

    def components(self, include_policy: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for n, c in self.table.compressors.items():
            out[f"compressor/{n}"] = c
        for b in self.table.buckets:
            if b.fused_compressor is not None:
                out[f"compressor/{b.fused_key}"] = b.fused_compressor
        for key, c in self.table.outside_fused.items():
            out[f"compressor/{key}"] = c
        for key, r in sorted(self.table.routes.items()):
            out[f"memory/{key}"] = r.memory
            out[f"communicator/{key}"] = r.communicator
        if self._extra is not None:
            out.update(self._extra())
        if include_policy and self._policy() is not None:
            out["policy"] = self._policy()
        return out

    def adacomp_state_dict(self, include_policy: bool = True) -> dict[str, Any]:
        out = {"steps": self._steps(), "overrides": self.table.overrides_state(),
               "loss_scale": self.loss_scale.state_dict(),
               "components": {k: c.state_dict() for k, c in self.components(include_policy).items()}}
        owner = self._owner() if self._owner is not None else None
        if owner is not None:
            out["owner"] = {"rank": owner[0], "world": owner[1]}
        return out

    def check_owner(self, state: dict[str, Any]) -> None:
        """Refuse another rank's (or another world size's) state: residuals, DGC velocities and
        sampling generators are per rank, and the DDP habit "rank 0 saves, every rank loads" would
        otherwise give every rank rank 0's (docs/checkpointing.md, "Per-rank state")."""
        saved = state.get("owner")
        mine = self._owner() if self._owner is not None else None
        if not saved or mine is None or (saved["rank"], saved["world"]) == mine:
            return
        rank, world = mine
        how = ("save every rank's state: adacomp.checkpoint.save_set / load_set, or adacomp.checkpoint.PerRank(...) "
               "inside a framework checkpoint (Lightning: adacomp.integrations.lightning.DDPStrategy; Accelerate: "
               "accelerator.register_for_checkpointing(adacomp.checkpoint.PerRank(...))); or delete the "
               f"'{STATE_KEY}' key before loading to start compression state fresh")
        if saved["world"] != world:
            raise RankStateError(f"this compression state was saved by rank {saved['rank']} of a {saved['world']}-rank "
                                 f"job; this job has {world} ranks: the world size changed. Resume with "
                                 "adacomp.checkpoint.load_set (applies the world-size rule to every rank's file) "
                                 f"or PerRank, which reshard; or delete the '{STATE_KEY}' key to start it fresh")
        raise RankStateError(f"rank {rank} of {world} is loading the compression state of rank {saved['rank']} (error "
                             f"feedback residuals, factors and generators are per rank; loading rank "
                             f"{saved['rank']}'s would silently train differently): {how}")

    def load_adacomp_state_dict(self, state: dict[str, Any]) -> None:
        self.check_owner(state)
        overrides = RouteTable.overrides_from_state(state.get("overrides", {}))
        if overrides != self.table.overrides:
            self.table.set_overrides(overrides)
        comps = self.components()
        unknown = sorted(set(state["components"]) - set(comps))
        if unknown:
            raise ValueError(f"checkpoint has state for {unknown[:5]} which this optimizer does not have; "
                             "was it written with a different config or model?")
        for k, c in comps.items():
            if k == "policy" and k not in state["components"]:
                continue  # snapshots leave the policy alone: it is the one exploring
            c.load_state_dict(state["components"].get(k, {}))
        self.loss_scale.load_state_dict(state.get("loss_scale", {}))
        self._set_steps(int(state["steps"]))

    def _owners(self, saved: dict[str, Any]) -> dict[str, Any]:
        """The live component for each saved key, or a fresh one built from the key's route spec
        (a route the table does not have now)."""
        live = self.components()
        return {k: live[k] if k in live else self.table.component_at(k) for k in saved}

    def reshard(self, states: list[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
        """The ``"adacomp"`` state for ``rank`` of ``world`` from every old rank's (rank order):
        each component reshards its own part by its own rule (``reshard(states, world, rank)``:
        memories average what the ranks owe, the divisible scheme's parts are re-cut, the outer
        loop recurses into its fragments); a component without the method takes old rank
        ``rank % W_old``'s state (thresholds, generators, the policy: equal on every rank or
        per-rank seeds)."""
        base = states[rank % len(states)]
        owners = self._owners(base["components"])
        out: dict[str, Any] = {}
        for key, node in base["components"].items():
            rule = getattr(owners[key], "reshard", None)
            out[key] = rule([s["components"].get(key, {}) for s in states], world, rank) if rule else node
        resharded = {**base, "components": out}
        if "owner" in base:
            resharded["owner"] = {"rank": rank, "world": world}
        return resharded

    def owed(self, states: list[dict[str, Any]]) -> dict[str, Tensor]:
        """What the averaged update of the ranks whose ``"adacomp"`` states are given still owes,
        per ``component key/tensor key`` (what :meth:`reshard` keeps; for checks and tests)."""
        owners = self._owners(states[0]["components"])
        out: dict[str, Tensor] = {}
        for key, owner in owners.items():
            rule = getattr(owner, "owed", None)
            if rule is not None:
                for k, t in rule([s["components"].get(key, {}) for s in states]).items():
                    out[f"{key}/{k}"] = t
        return out

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's torch state dict (``state``, ``param_groups``) plus one extra
        key, ``"adacomp"``, with every compressor, memory, communicator and policy state."""
        assert self.inner is not None
        sd = self.inner.state_dict()
        sd[STATE_KEY] = DELEGATED if self.delegated else self.adacomp_state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accepts :meth:`state_dict`'s format, a plain torch optimizer state dict (compression
        state then starts fresh, with a warning) and the older ``{"optimizer", "adacomp"}`` one."""
        if "optimizer" in state_dict and STATE_KEY in state_dict and "param_groups" not in state_dict:
            torch_sd, ours = state_dict["optimizer"], state_dict[STATE_KEY]
        elif "param_groups" in state_dict and "state" in state_dict:
            torch_sd = {k: v for k, v in state_dict.items() if k != STATE_KEY}
            ours = state_dict.get(STATE_KEY)
        else:
            raise ValueError("expected an optimizer state dict (keys 'state' and 'param_groups', plus "
                             f"'{STATE_KEY}' when written by adacomp); got keys {sorted(state_dict)[:6]}")
        assert self.inner is not None
        if ours == DELEGATED:
            self.inner.load_state_dict(torch_sd)
            if not self.delegated:
                warnings.warn("this optimizer state was saved with adacomp.checkpoint.PerRank, which holds the "
                              "compression state: load that too (the residuals start fresh otherwise)", stacklevel=3)
            return
        if ours is not None:
            self.check_owner(ours)  # before anything is applied
        self.inner.load_state_dict(torch_sd)
        if ours is None:
            warnings.warn("loaded a plain torch optimizer state dict: error-feedback residuals, thresholds, "
                          "factors and policy state start fresh", stacklevel=3)
            return
        self.load_adacomp_state_dict(ours)

    def snapshot(self, params: list[tuple[str, Tensor]]) -> dict[str, Any]:
        """An in-memory copy of parameters, optimizer, compressor and memory state (for MOO
        exploration). The policy's own state is not included: restoring must not undo the
        policy's record of what it explored."""
        assert self.inner is not None
        return {"params": {n: p.detach().clone() for n, p in params},
                "state": copy.deepcopy({"optimizer": self.inner.state_dict(),
                                        STATE_KEY: self.adacomp_state_dict(include_policy=False)})}

    def restore(self, params: list[tuple[str, Tensor]], snap: dict[str, Any]) -> None:
        """Put back exactly what :meth:`snapshot` saw (bitwise)."""
        with torch.no_grad():
            for n, p in params:
                p.copy_(snap["params"][n])
        self.load_state_dict(copy.deepcopy(snap["state"]))


def keeps_state(obj: Any) -> bool:
    """True when ``obj``'s class overrides ``state_dict`` (stateless components skip the copy)."""
    from adacomp import policies
    from adacomp.communicators.base import Communicator
    from adacomp.compressors.base import Compressor
    return type(obj).state_dict not in (Compressor.state_dict, Communicator.state_dict, policies.Policy.state_dict)


def round_components(table: RouteTable) -> tuple[list[Any], list[Any]]:
    """(memories, other stateful components) a round over ``table`` may change: what a non-finite
    round rolls back and a loss-scale change rescales. Memories include those communicators
    declare (a communicator that declares memories keeps its whole state in them); components
    that keep no state are left out (nothing to copy)."""
    comms = list({id(r.communicator): r.communicator for r in table.routes.values()}.values())
    memories = list({id(r.memory): r.memory for r in table.routes.values()}.values())
    memories += [m for c in comms for m in c.memories()]
    others: list[Any] = [c for c in table.unique_compressors() if keeps_state(c)]
    others += [c for c in comms if keeps_state(c) and not c.memories()]
    return memories, others



def creating_state_for_dcp() -> bool:
    """Whether torch.distributed.checkpoint is calling ``step()`` to create an optimizer's state
    (``get_state_dict`` on a fresh optimizer: zero gradients at lr 0): not a training step, so no step
    is counted and no window moves. Found a few frames up, as ``_calling_grad_scaler`` finds a
    GradScaler: the only mark that call leaves."""
    frame: Any = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "_init_optim_state" and "checkpoint" in code.co_filename:
            return True
        frame = frame.f_back
    return False

__all__ = ["ComponentState", "STATE_KEY", "keeps_state", "round_components"]
