"""Plain-torch reproduction: DDP's sparse allreduce on gloo next to another thread of the process.

Two gloo ranks on localhost train an MLP with ``nn.Embedding(sparse=True)`` under DDP (SGD, 7 steps,
then a clone of the state dict), ``--cycles`` times a launch, ``--launches`` times. ``--thread``
adds what else the process runs while it does: nothing, a Python thread that wakes every
millisecond (``sleeper``), or one that also calls a ``TCPStore`` every millisecond (``store``, the
kind of work adacomp's watchdog does once a second). ``--dense`` makes the embedding dense.
A launch fails when a rank dies from a signal (heap corruption, SIGSEGV) or the two hang.
No adacomp code runs here; docs/reliability.md ("Known issues") has the measured rates.

    python scripts/gloo_sparse_thread_repro.py --launches 100 --cycles 100 --thread store
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import socket
import threading
import time
from typing import Any


def _side_thread(kind: str, rank: int, stop: threading.Event) -> Any:
    import torch.distributed as dist
    if kind == "none":
        return None
    if kind == "sleeper":
        def sleeper() -> None:
            while not stop.wait(0.001):
                sum(range(100))
        threading.Thread(target=sleeper, daemon=True).start()
        return None
    timeout = datetime.timedelta(seconds=60)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False) if rank == 0 else None
    port = [server.port if server is not None else None]
    dist.broadcast_object_list(port, 0)
    client = dist.TCPStore("127.0.0.1", port[0], None, False, timeout=timeout)
    client.set(f"hb/{rank}", "0")
    dist.barrier()

    def beat() -> None:
        n = 0
        while not stop.wait(0.001):
            n += 1
            try:
                client.set(f"hb/{rank}", str(n))
                client.multi_get([f"hb/{1 - rank}"])
            except Exception:  # noqa: BLE001 - the peer's store went at exit
                return
    threading.Thread(target=beat, daemon=True).start()
    return server, client


def _worker(rank: int, port: int, cycles: int, kind: str, dense: bool) -> None:
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    stop = threading.Event()
    keep = _side_thread(kind, rank, stop)

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 12, sparse=not dense)
            self.fc1, self.fc2, self.fc3 = nn.Linear(12, 64), nn.Linear(64, 64), nn.Linear(64, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(self.emb(x).mean(dim=1))))))

    for _ in range(cycles):
        torch.manual_seed(0)
        base = MLP()
        model = DDP(base)
        opt = torch.optim.SGD(base.parameters(), lr=0.1)
        for step in range(7):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randint(0, 50, (8, 3), generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        {k: v.detach().clone() for k, v in base.state_dict().items()}
    stop.set()
    dist.barrier()
    del keep
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--thread", choices=["none", "sleeper", "store"], default="store")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a launch counts as hung")
    args = ap.parse_args()
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    crashed = hung = 0
    t0 = time.time()
    for i in range(args.launches):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=_worker, args=(r, port, args.cycles, args.thread, args.dense)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.time() + args.timeout
        for p in procs:
            p.join(max(0.0, deadline - time.time()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        codes = [p.exitcode for p in procs]
        if alive:
            hung += 1
        elif any(c != 0 for c in codes):
            crashed += 1
        state = "hung" if alive else ("ok" if all(c == 0 for c in codes) else f"failed, exit codes {codes}")
        print(f"launch {i}: {state}", flush=True)
    print(f"thread={args.thread} embedding={'dense' if args.dense else 'sparse'}: {args.launches * args.cycles} "
          f"cycles in {time.time() - t0:.0f} s, {crashed} launches crashed, {hung} hung", flush=True)


if __name__ == "__main__":
    main()
