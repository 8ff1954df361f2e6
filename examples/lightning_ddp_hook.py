"""Lightning: adacomp's compression as DDP's communication hook, through adacomp's DDPStrategy.

    torchrun --nproc_per_node 2 examples/lightning_ddp_hook.py --method topk

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers hooks on CUDA only (on CPU it silently
trains plain DDP); ``adacomp.integrations.lightning.DDPStrategy`` registers on every device, follows
the precision plugin's GradScaler and keeps every rank's compression state in Lightning's checkpoints.
bf16 mixed precision and gradient accumulation (Lightning uses DDP's no_sync) included. Exits non-zero
if nothing was compressed.
"""
from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F

from adacomp.integrations.lightning import DDPStrategy
from _hook_common import CONFIGS, dataset, net


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", choices=sorted(CONFIGS), default="topk")
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Classifier()
    strategy = DDPStrategy(config=CONFIGS[args.method])
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=args.epochs, precision="bf16-mixed",
                        accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, strategy=strategy)
    trainer.fit(model, torch.utils.data.DataLoader(dataset(), batch_size=32, shuffle=True))
    loss = float(trainer.callback_metrics["loss"])
    steps = strategy.adacomp_state.steps if strategy.adacomp_state is not None else 0
    if steps == 0:
        raise SystemExit(f"adacomp's hook compressed nothing (0 steps): the {args.method} run was plain DDP")
    if trainer.global_rank == 0:
        print(f"trained with adacomp {args.method} hook: final loss {loss:.4f}, {steps} compressed steps")


if __name__ == "__main__":
    main()
