"""MNIST-shaped training written against Horovod's torch API, offline: 28x28 synthetic digits
(a fixed random prototype per class plus noise) and a small CNN defined here.

The only adacomp-specific line is the import; with ``import horovod.torch as hvd`` the script runs
under horovodrun with real Horovod. Any launcher works:

    adacomp run -np 2 -- python examples/pytorch_mnist.py
    torchrun --standalone --nproc_per_node 2 examples/pytorch_mnist.py
    mpirun -np 2 python examples/pytorch_mnist.py
    horovodrun --gloo -np 2 python examples/pytorch_mnist.py
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data
import torch.utils.data.distributed

import adacomp as hvd


def get_args():
    p = argparse.ArgumentParser(description="offline MNIST-like example")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--test-batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-size", type=int, default=4096, help="synthetic training images")
    p.add_argument("--test-size", type=int, default=1024, help="synthetic test images")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression during allreduce")
    p.add_argument("--use-adasum", action="store_true", help="Adasum reduction (refused by adacomp)")
    p.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    p.add_argument("--no-cuda", action="store_true")
    return p.parse_args()


def synthetic_digits(n, seed):
    """``n`` 1x28x28 images in 10 classes: a class prototype (same on every rank) plus noise."""
    protos = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    images = protos[labels] + 0.8 * torch.randn(n, 1, 28, 28, generator=gen)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=5)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=5)
        self.drop = nn.Dropout2d(0.1)
        self.fc1 = nn.Linear(256, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main():
    args = get_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    if args.cuda and hvd.local_size() > torch.cuda.device_count():
        # one GPU per local rank, as in Horovod's example; more processes than GPUs on this host
        # (say two on one GPU) would ask for a device that does not exist, so they train on the CPU
        args.cuda = False
    torch.manual_seed(args.seed)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_set = synthetic_digits(args.train_size, seed=1)
    test_set = synthetic_digits(args.test_size, seed=2)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_set, num_replicas=hvd.size(),
                                                                    rank=hvd.rank())
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_set, num_replicas=hvd.size(),
                                                                   rank=hvd.rank(), shuffle=False)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    # Adasum does not scale the learning rate with the number of workers.
    lr_scaler = hvd.size() if not args.use_adasum else 1
    if args.cuda:
        model.cuda()
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]\tLoss: {loss.item():.6f}")

        model.eval()
        test_loss, test_accuracy = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                if args.cuda:
                    data, target = data.cuda(), target.cuda()
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                test_accuracy += output.argmax(dim=1).eq(target).float().sum().item()
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"Test set (epoch {epoch}): Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%")
    print(f"MNIST_DONE rank={hvd.rank()} size={hvd.size()} loss={test_loss:.6f} accuracy={test_accuracy:.4f}",
          flush=True)


if __name__ == "__main__":
    main()
