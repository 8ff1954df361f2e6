"""Worker code for the DDP-parity suite (tests/test_ddp_parity.py).

One :class:`Run` trains a small model either under PyTorch ``DistributedDataParallel`` (``cfg is
None``) or with ``adacomp.DistributedOptimizer`` (``cfg`` a config dict), with the same seeds and
per-rank batches, so a training habit can be applied to both and the parameters compared.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

COMPRESSED = {
    "topk": {"compressor": {"name": "topk", "density": 0.1}, "communicator": {"name": "allgather"}, "min_numel": 0},
    "powersgd": {"compressor": {"name": "powersgd", "rank": 2, "min_compression_rate": 0.0}, "min_numel": 0},
    # its choice in one C call (compensation's mean, std in torch's order, correction loop, cap)
    "gaussiank": {"compressor": {"name": "gaussiank", "density": 0.1}, "communicator": {"name": "allgather"},
                  "min_numel": 0},
    "dgc": {"compressor": {"name": "dgc", "density": 0.1, "sample_ratio": 1.0}, "memory": {"name": "dgc"},
            "communicator": {"name": "allgather"}, "min_numel": 0},
    "acpsgd": {"compressor": {"name": "acpsgd", "rank": 2, "min_compression_rate": 0.0}, "min_numel": 0},
    # its residual is left to the next compensation's pass (memories.base.Owed) on these small tensors too
    "efsignsgd": {"compressor": {"name": "efsignsgd"}, "memory": {"name": "residual"},
                  "communicator": {"name": "allgather"}, "min_numel": 0},
    # a cast compresses each bucket as one flat tensor by default (Compressor.elementwise), with residuals
    "bf16": {"compressor": {"name": "bf16"}, "memory": {"name": "residual"}, "communicator": {"name": "allreduce"},
             "min_numel": 0},
    # bf16's default (no memory): the casts write the payloads straight into the allreduce's buffer
    "bf16_none": {"compressor": {"name": "bf16"}, "memory": {"name": "none"}, "communicator": {"name": "allreduce"},
                  "min_numel": 0},
}
NONE = {"compressor": {"name": "none"}, "communicator": {"name": "allreduce"}, "fusion": {"bucket_mb": 0.004}}


class MLP(nn.Module):
    """Three layers (the middle one ~4k elements) plus optional extras for the parameter habits."""

    def __init__(self, tied: bool = False, branch: bool = False, embedding: bool = False):
        super().__init__()
        self.emb = nn.Embedding(50, 12, sparse=True) if embedding else None
        self.fc1 = nn.Linear(12, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 4)
        self.branch = nn.Linear(64, 64) if branch else None
        self.never = nn.Linear(64, 64) if branch else None  # in the model, never used
        self.tied = tied
        if tied:
            self.fc2b = nn.Linear(64, 64)
            self.fc2b.weight = self.fc2.weight  # one Parameter used twice

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x).mean(dim=1)
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        if self.tied:
            h = torch.tanh(self.fc2b(h))
        if use_branch and self.branch is not None:
            h = h + torch.tanh(self.branch(h))
        return self.fc3(h)


def batch(rank: int, step: int, embedding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, 50, (8, 3), generator=g) if embedding else torch.randn(8, 12, generator=g)
    return x, torch.randint(0, 4, (8,), generator=g)


FRONT_ENDS = ("optimizer", "hook")


class Run:
    """A model and optimizer under DDP (``cfg is None``) or adacomp (``cfg``) through ``front``:
    ``adacomp.DistributedOptimizer``, or adacomp's hook on DDP (DDP's own ``no_sync`` and ``Join``)."""

    def __init__(self, cfg: dict | None, make_opt: Callable[[list], torch.optim.Optimizer] | None = None,
                 opt_params: Callable[[nn.Module], list] | None = None, grad_scaler: Any = None,
                 model_kw: dict | None = None, compile_backend: str | None = None, front: str = "optimizer",
                 **adacomp_kw: Any):
        import adacomp
        torch.manual_seed(0)
        self.base = MLP(**(model_kw or {}))
        self.ddp = cfg is None or front == "hook"  # the model is DDP's, the optimizer plain
        make_opt = make_opt or (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3))
        params = opt_params(self.base) if opt_params else list(self.base.parameters())
        if self.ddp:
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.model: nn.Module = DDP(self.base, find_unused_parameters=bool(model_kw and model_kw.get("branch")))
            self.opt = make_opt(params)
            if cfg is not None:
                state, hook = adacomp.ddp.hook(cfg, named_parameters=self.base.named_parameters(),
                                               grad_scaler=grad_scaler)
                self.model.register_comm_hook(state, hook)
        else:
            self.model = self.base
            named = {id(p): n for n, p in self.base.named_parameters()}
            flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
            self.opt = adacomp.DistributedOptimizer(make_opt(params), [(named[id(p)], p) for p in flat],
                                                    config=cfg, grad_scaler=grad_scaler, **adacomp_kw)
        if compile_backend:
            self.model = torch.compile(self.model, backend=compile_backend)

    @property
    def wrapper(self) -> Any:
        return self.opt

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.model.no_sync() if self.ddp else self.opt.no_sync()  # type: ignore[operator]

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        if self.ddp:
            from torch.distributed.algorithms.join import Join
            with Join([self.model]):
                yield
        else:
            with self.opt.join():
                yield

    def loss(self, rank: int, step: int, **kw: Any) -> torch.Tensor:
        x, y = batch(rank, step, embedding=self.base.emb is not None)
        return F.cross_entropy(self.model(x, **kw), y)

    def train(self, steps: Iterator[int] | range) -> "Run":
        """One plain step per index: zero_grad, backward on batch (rank, step), step."""
        for s in steps:
            self.opt.zero_grad()
            self.loss(rank(), s).backward()
            self.opt.step()
        return self

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.base.state_dict().items()}


def rank() -> int:
    return dist.get_rank()


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).norm() / (b[k].norm() + 1e-30)) for k in a)


def init() -> None:
    import adacomp
    adacomp.init()


__all__ = ["COMPRESSED", "FRONT_ENDS", "MLP", "NONE", "Run", "batch", "equal", "init", "max_rel", "rank"]
