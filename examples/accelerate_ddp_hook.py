"""Hugging Face Accelerate: adacomp's compression as DDP's communication hook.

    torchrun --nproc_per_node 2 examples/accelerate_ddp_hook.py --method powersgd

Accelerate's `DistributedDataParallelKwargs(comm_hook=...)` takes only PyTorch's built-in hooks, so
``adacomp.integrations.accelerate.register`` puts the hook on the prepared (DDP-wrapped) model, makes
it follow ``accelerator.scaler`` and registers every rank's compression state for ``save_state`` /
``load_state``. bf16 autocast and `accelerator.accumulate` (DDP's no_sync) included. Exits non-zero
if nothing was compressed.
"""
from __future__ import annotations

import argparse
import gc

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from adacomp.integrations.accelerate import register
from _hook_common import CONFIGS, dataset, net


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", choices=sorted(CONFIGS), default="topk")
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=32, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = register(accelerator, model, CONFIGS[args.method])
    for _ in range(args.epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
    loss = accelerator.reduce(loss.detach(), reduction="mean")
    if state.steps == 0:
        raise SystemExit(f"adacomp's hook compressed nothing (0 steps): the {args.method} run was plain DDP")
    if accelerator.is_main_process:
        print(f"trained with adacomp {args.method} hook: final loss {float(loss):.4f}, {state.steps} compressed steps")
    # Release the model and the process group while the interpreter is alive, as torch's DDP docs
    # ask: a gloo worker thread that drops the last allreduce's tensors during finalisation needs the
    # GIL and aborts the process after training finished (adacomp's backend also pauses at exit for
    # this; docs/reliability.md, section 4).
    del model, opt, loader, state, loss
    accelerator.free_memory()
    torch.distributed.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
