"""adacomp's compression in Lightning: a ``DDPStrategy`` that registers the hook on every device.

    from adacomp.integrations.lightning import DDPStrategy
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(config="configs/topk.yaml"))

What Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` does not: it registers comm hooks only when
the root device is CUDA (on CPU it silently trains plain DDP); here the hook is registered on any
device. The hook follows the precision plugin's GradScaler (``16-mixed``), so residuals stay in the
scaler's units without extra wiring. Every rank's compression state goes into Lightning's checkpoint
(``checkpoint["adacomp"]``, gathered when Lightning saves: it calls ``save_checkpoint`` on every rank)
and each rank takes its own back on ``fit(ckpt_path=...)``; a changed world size applies the
world-size rule (:meth:`adacomp.checkpoint.PerRank.load_state_dict`). Each ``fit`` registers its own
hook, so a Trainer fitting again from a checkpoint takes that checkpoint's state; ``validate`` /
``test`` / ``predict`` with a ``ckpt_path`` leave the compression state alone (they never wrap the
model in DDP).
"""
from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from adacomp.engine.ddp import HookState, register
from adacomp.runtime.per_rank import PerRank

CHECKPOINT_KEY = "adacomp"


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` with adacomp's hook (``config``: the same YAML / dict as for
    :class:`adacomp.DistributedOptimizer`); every other keyword is Lightning's. ``grad_scaler``:
    ``"auto"`` (the precision plugin's scaler, if any), ``None`` or a scaler."""

    strategy_name = "adacomp_ddp"

    def __init__(self, config: Any = None, *, grad_scaler: Any = "auto", **kwargs: Any):
        if "ddp_comm_hook" in kwargs or "ddp_comm_state" in kwargs:
            raise ValueError("adacomp.integrations.lightning.DDPStrategy registers adacomp's hook itself; pass "
                             "config=... instead of ddp_comm_hook / ddp_comm_state")
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(**kwargs)
        self.adacomp_config = config
        self._scaler = grad_scaler
        self.adacomp_state: HookState | None = None
        self._pending: dict[str, Any] | None = None  # loaded before this fit's hook existed
        self._hooked = False  # this fit's hook is registered (a Trainer may fit again: a new hook then)

    def _register_ddp_hooks(self) -> None:
        scaler = getattr(self.precision_plugin, "scaler", None) if self._scaler == "auto" else self._scaler
        # the LightningModule's own names (not Lightning's wrapper's): state keys and name-seeded
        # factors match the user's module, as in a hand-written DDP loop over it
        assert self.lightning_module is not None
        self.adacomp_state = register(self.model, self.adacomp_config, grad_scaler=scaler,
                                      named_parameters=self.lightning_module.named_parameters())
        self._hooked = True
        if self._pending is not None:
            PerRank(self.adacomp_state).load_state_dict(self._pending)
            self._pending = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.adacomp_state is not None:  # every rank is here (Trainer.save_checkpoint): gather
            checkpoint[CHECKPOINT_KEY] = PerRank(self.adacomp_state).state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None and self._fitting():
            if self._hooked and self.adacomp_state is not None:
                PerRank(self.adacomp_state).load_state_dict(state)
            else:
                self._pending = state  # Lightning restores before it wraps the model: apply at registration
        return checkpoint

    def _fitting(self) -> bool:
        """Whether the checkpoint is loaded for training: ``validate`` / ``test`` / ``predict`` with a
        ``ckpt_path`` never wrap the model in DDP, and their compression state must not wait for the
        next ``fit`` (which starts fresh unless it is given a checkpoint itself)."""
        trainer = getattr(self.lightning_module, "trainer", None) if self.lightning_module is not None else None
        state = getattr(trainer, "state", None)
        return state is None or state.fn in (None, TrainerFn.FITTING)

    def teardown(self) -> None:
        """The fit is over: its hook goes with it (a later ``fit`` on this Trainer registers a new one
        and takes its checkpoint's state, not this one's)."""
        self._hooked = False
        self._pending = None
        super().teardown()


__all__ = ["CHECKPOINT_KEY", "DDPStrategy"]
