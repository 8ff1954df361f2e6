"""Run under torchrun (2 ranks): the same training through a hand-written DDP loop, through
Lightning (``adacomp.integrations.lightning.DDPStrategy``) or Accelerate
(``adacomp.integrations.accelerate.register``), with an fp16 GradScaler and one injected overflow,
uninterrupted and with a mid-run checkpoint / resume through the framework's own API.

Every rank writes ``OUT/<framework>-<method>-<run>.rank<r>.pt``: its final parameters (by name
without the framework's prefix) and the hook's step count. ``tests/test_frameworks.py`` compares.

``run(method, epochs, ...)`` trains ``epochs`` (Lightning: up to ``epochs.stop``, continuing from its
checkpoint's epoch). Schedule: 2 epochs of 3 steps (96 samples, batch 16 per rank, no shuffling, so every run sees the
same batches in the same order); the checkpoint is taken after epoch 0; rank 0's loss is inf at
epoch 0, batch 1 (GradScaler skips that step on both ranks and halves its scale).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import adacomp

CONFIGS: dict[str, dict[str, Any]] = {
    "none": {"compressor": {"name": "none"}},
    "topk": {"compressor": {"name": "topk", "density": 0.05}, "communicator": {"name": "allgather"},
             "memory": {"name": "residual"}, "min_numel": 256},
    "powersgd": {"compressor": {"name": "powersgd", "rank": 2}, "min_numel": 256},
    "acpsgd": {"compressor": {"name": "acpsgd", "rank": 2}, "min_numel": 256},
    "dgc": {"compressor": {"name": "dgc", "density": 0.05, "seed": 0}, "memory": {"name": "dgc", "momentum": 0.9},
            "communicator": {"name": "allgather"}, "min_numel": 256},
}
STEPS_PER_EPOCH, EPOCHS, BATCH = 3, 2, 16
INJECT = (0, 1)  # (epoch, batch): rank 0's loss becomes inf
INIT_SCALE = 2.0 ** 12


def layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


class Net(nn.Module):
    """The user's module: parameter names ``net.*`` in every framework (the hook seeds PowerSGD's and
    ACP-SGD's initial factors by name, so the names must be the user's, not a wrapper's)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = layers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def net() -> nn.Module:
    return Net()


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS_PER_EPOCH * BATCH * 2, 32, generator=g)
    data = TensorDataset(x, x[:, :4].argmax(dim=1))
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, num_replicas=int(os.environ["WORLD_SIZE"]),
                                                                  rank=int(os.environ["RANK"]), shuffle=False))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epoch: int, batch: int) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        loss = F.cross_entropy(model(x).float(), y)
    if (epoch, batch) == INJECT and dist.get_rank() == 0:
        loss = loss * float("inf")
    return loss


def scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --- hand-written DDP ----------------------------------------------------------------------------
def run_ddp(method: str, epochs: range, ckpt: Path | None = None, resume: Path | None = None) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    base = net()
    model = DDP(base)
    sc = scaler()
    state = adacomp.ddp.register(model, CONFIGS[method], grad_scaler=sc)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if resume is not None:
        saved = torch.load(resume, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sc.load_state_dict(saved["scaler"])
        adacomp.checkpoint.PerRank(state).load_state_dict(saved["adacomp"])
    data = loader()
    for epoch in epochs:
        for b, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            sc.scale(loss_of(model, x, y, epoch, b)).backward()
            sc.step(opt)
            sc.update()
    if ckpt is not None:
        payload = {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": sc.state_dict(),
                   "adacomp": adacomp.checkpoint.PerRank(state).state_dict()}
        if dist.get_rank() == 0:
            torch.save(payload, ckpt)
        dist.barrier()
    return {"params": params(base), "steps": state.steps}


# --- Lightning -----------------------------------------------------------------------------------
def _lightning(method: str, max_epochs: int) -> tuple[Any, Any, Any]:
    """(module, strategy, trainer) for ``method``: 16-mixed with the shared scaler, no logging."""
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from adacomp.integrations.lightning import DDPStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = layers()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            # Lightning's plugin autocasts already; loss_of's own autocast is the same region
            return loss_of(self.net, x, y, self.current_epoch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    strategy = DDPStrategy(config=CONFIGS[method])
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=max_epochs,
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler())], use_distributed_sampler=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    return Module(), strategy, trainer


def run_lightning(method: str, epochs: range, ckpt: Path | None = None, resume: Path | None = None) -> dict[str, Any]:
    module, strategy, trainer = _lightning(method, epochs.stop)
    trainer.fit(module, loader(), ckpt_path=str(resume) if resume is not None else None)
    if ckpt is not None:
        trainer.save_checkpoint(str(ckpt))
    assert strategy.adacomp_state is not None
    return {"params": params(module), "steps": strategy.adacomp_state.steps}


# --- Accelerate ----------------------------------------------------------------------------------
def run_accelerate(method: str, epochs: range, ckpt: Path | None = None, resume: Path | None = None) -> dict[str, Any]:
    from accelerate import Accelerator

    from adacomp.integrations.accelerate import register

    acc = Accelerator(cpu=True)
    base = net()
    opt = torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(base, opt)
    sc = scaler()
    state = register(acc, model, CONFIGS[method], grad_scaler=sc)
    acc.register_for_checkpointing(sc)
    if resume is not None:
        acc.load_state(str(resume))
    data = loader()
    for epoch in epochs:
        for b, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            acc.backward(sc.scale(loss_of(model, x, y, epoch, b)))
            sc.step(opt)
            sc.update()
    if ckpt is not None:
        acc.save_state(str(ckpt))
    out = {"params": params(base), "steps": state.steps}
    acc.free_memory()
    return out


def lightning_habits(method: str, where: Path) -> dict[str, Any]:
    """One Trainer fits one epoch, saves, and fits again from its own checkpoint (``again``); another
    validates from that checkpoint and then fits a fresh module (``validated``: the checkpoint's
    compression state must not carry into that fit)."""
    module, strategy, trainer = _lightning(method, 1)
    trainer.fit(module, loader())
    ckpt = where / "again.ckpt"
    trainer.save_checkpoint(str(ckpt))
    trainer.fit_loop.max_epochs = EPOCHS
    trainer.fit(module, loader(), ckpt_path=str(ckpt))
    again = {"params": params(module), "steps": strategy.adacomp_state.steps}
    checked, strategy, trainer = _lightning(method, EPOCHS)
    trainer.validate(checked, loader(), ckpt_path=str(ckpt), verbose=False)
    fresh = _lightning(method, EPOCHS)[0]
    trainer.fit(fresh, loader())
    return {"again": again, "validated": {"params": params(fresh), "steps": strategy.adacomp_state.steps}}


def accelerate_main_only_save(method: str, where: Path) -> str:
    """``save_state`` under ``if accelerator.is_main_process:`` with adacomp's state registered: the
    main process's error (the gather of every rank's state cannot happen), not a hang."""
    from accelerate import Accelerator

    from adacomp.integrations.accelerate import register

    acc = Accelerator(cpu=True)
    base = net()
    model, opt = acc.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1))
    register(acc, model, {**CONFIGS[method], "timeout_s": 3.0})
    x, y = next(iter(loader()))
    acc.backward(F.cross_entropy(model(x), y))
    opt.step()
    error = "no error"
    if acc.is_main_process:
        try:
            acc.save_state(str(where / "main_only"))
        except RuntimeError as exc:
            error = str(exc)
    acc.wait_for_everyone()
    acc.free_memory()
    return error


RUNNERS = {"ddp": run_ddp, "lightning": run_lightning, "accelerate": run_accelerate}
HABITS = {"lightning": lightning_habits, "accelerate": accelerate_main_only_save}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=sorted(RUNNERS), required=True)
    ap.add_argument("--methods", nargs="+", default=sorted(CONFIGS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not dist.is_initialized() and args.framework != "lightning":
        dist.init_process_group("gloo")
    run = RUNNERS[args.framework]
    out = Path(args.out)
    for method in args.methods:
        full = run(method, range(EPOCHS))
        rank = dist.get_rank()
        torch.save(full, out / f"{args.framework}-{method}-full.rank{rank}.pt")
        if args.framework == "ddp":
            continue
        # a shared path on every rank: the temporary directory of rank 0, broadcast
        name = [tempfile.mkdtemp(dir=out) if rank == 0 else None]
        dist.broadcast_object_list(name, src=0)
        ckpt = Path(name[0]) / ("ckpt.ckpt" if args.framework == "lightning" else "state")
        run(method, range(1), ckpt=ckpt)
        resumed = run(method, range(1, EPOCHS), resume=ckpt)
        torch.save(resumed, out / f"{args.framework}-{method}-resumed.rank{rank}.pt")
        if method == "topk":
            torch.save(HABITS[args.framework](method, ckpt.parent),
                       out / f"{args.framework}-{method}-habits.rank{rank}.pt")
    print(f"FRAMEWORK_DONE {args.framework} rank={dist.get_rank()}", flush=True)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
