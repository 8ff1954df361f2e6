"""Throughput benchmark on synthetic data, written against Horovod's torch API, offline: the model
(a small ResNet-style CNN) is defined here instead of being downloaded from torchvision.

The only adacomp-specific line is the import; with ``import horovod.torch as hvd`` the script runs
under horovodrun with real Horovod. Any launcher works:

    adacomp run -np 2 -- python examples/pytorch_synthetic_benchmark.py
    torchrun --standalone --nproc_per_node 2 examples/pytorch_synthetic_benchmark.py
    mpirun -np 2 python examples/pytorch_synthetic_benchmark.py
    horovodrun --gloo -np 2 python examples/pytorch_synthetic_benchmark.py
"""
import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import adacomp as hvd


def get_args():
    p = argparse.ArgumentParser(description="offline synthetic benchmark")
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression during allreduce")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--width", type=int, default=32, help="channels of the first stage")
    p.add_argument("--num-warmup-batches", type=int, default=2)
    p.add_argument("--num-batches-per-iter", type=int, default=5)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--use-adasum", action="store_true", help="Adasum reduction (refused by adacomp)")
    p.add_argument("--no-cuda", action="store_true")
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class SmallResNet(nn.Module):
    def __init__(self, width, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1))


def main():
    args = get_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    if args.cuda and hvd.local_size() > torch.cuda.device_count():
        # one GPU per local rank, as in Horovod's example; more processes than GPUs on this host
        # (say two on one GPU) would ask for a device that does not exist, so they train on the CPU
        args.cuda = False
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
    torch.set_num_threads(1)

    model = SmallResNet(args.width)
    # Adasum does not scale the learning rate with the number of workers.
    lr_scaler = hvd.size() if not args.use_adasum else 1
    if args.cuda:
        model.cuda()
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()
    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    gen = torch.Generator().manual_seed(hvd.rank())
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
    target = torch.randint(0, 1000, (args.batch_size,), generator=gen)
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(s):
        if hvd.rank() == 0:
            print(s, flush=True)

    device = "GPU" if args.cuda else "CPU"
    log(f"Model: SmallResNet(width={args.width}), batch size: {args.batch_size}, "
        f"number of {device}s: {hvd.size()}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    img_secs = []
    for it in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{it}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
    total = hvd.allreduce(torch.tensor(img_sec_mean), op=hvd.Sum, name="total_img_sec").item()
    print(f"BENCH_DONE rank={hvd.rank()} size={hvd.size()} total_img_sec={total:.1f}", flush=True)


if __name__ == "__main__":
    main()
