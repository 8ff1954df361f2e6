"""Horovod's ``pytorch_mnist_elastic.py`` pattern (elastic state, sampler, periodic commit) on offline
synthetic data; the only adacomp-specific line is the import.

    torchrun --standalone --nproc_per_node 2 --max-restarts 1 examples/pytorch_elastic.py
    horovodrun --gloo -np 2 --min-np 1 --host-discovery-script ... python examples/pytorch_elastic.py

Under torchrun a worker that dies makes the agent restart every worker; ``state.commit()`` persisted
the state, so the restarted job continues from the last commit (epoch, batch, sampler position,
model and optimizer). ``--kill-rank R --kill-after-commit K`` makes rank R exit once, on the first
attempt, one batch after its K-th commit (mid-epoch), to show that.
"""
import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data

import adacomp as hvd


def get_args():
    p = argparse.ArgumentParser(description="elastic training example")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-size", type=int, default=96)
    p.add_argument("--batches-per-commit", type=int, default=3)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-after-commit", type=int, default=2)
    p.add_argument("--log-dir", default="", help="per-rank JSON lines of every batch and commit")
    return p.parse_args()


def synthetic(n):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, 16, generator=gen)
    y = (x[:, :8].sum(1) > 0).long()
    return torch.utils.data.TensorDataset(x, y, torch.arange(n))


def main():
    args = get_args()
    hvd.init()
    torch.manual_seed(args.seed)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(os.path.join(args.log_dir, f"rank{hvd.rank()}.jsonl"), "a") if args.log_dir else None

    def record(**kw):
        if log:
            log.write(json.dumps(dict(attempt=attempt, rank=hvd.rank(), **kw)) + "\n")
            log.flush()

    dataset = synthetic(args.train_size)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    lr_scaler = hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    commits = {"n": 0}

    @hvd.elastic.run
    def train(state):
        record(event="start", epoch=state.epoch, batch=state.batch)
        while state.epoch < args.epochs:
            model.train()
            for i, (data, target, idx) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(state.model(data), target)
                loss.backward()
                optimizer.step()
                state.train_sampler.record_batch(i, args.batch_size)
                state.batch += 1
                record(event="batch", epoch=state.epoch, batch=state.batch, idx=idx.tolist())
                if (hvd.rank() == args.kill_rank and attempt == 0
                        and commits["n"] == args.kill_after_commit):
                    record(event="kill", epoch=state.epoch, batch=state.batch)
                    os._exit(1)
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
                    commits["n"] += 1
                    record(event="commit", epoch=state.epoch, batch=state.batch)
            state.epoch += 1
            state.batch = 0
            state.train_sampler.set_epoch(state.epoch)
            state.commit()
            commits["n"] += 1
            record(event="commit", epoch=state.epoch, batch=state.batch)

    def on_state_reset():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=sampler, epoch=0, batch=0)
    state.register_reset_callbacks([on_state_reset])
    train(state)
    if args.log_dir:
        torch.save(model.state_dict(), os.path.join(args.log_dir, f"final_rank{hvd.rank()}.pt"))
    backend = hvd.backend().name if hasattr(hvd, "backend") else "horovod"  # adacomp's transport
    print(f"ELASTIC_DONE rank={hvd.rank()} size={hvd.size()} epoch={state.epoch} backend={backend}", flush=True)


if __name__ == "__main__":
    main()
