"""Datasets that ship offline inside installed packages (nothing downloads at run time)."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def digits(seed: int = 0, test_fraction: float = 0.2) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), scaled to [0, 1].

    Returns (x_train, y_train, x_test, y_test) with x of shape (n, 1, 8, 8); the split is a
    seeded permutation so every rank sees the same split.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.tensor(np.random.default_rng(seed).permutation(len(y)))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def shard(n: int, rank: int, world: int, epoch: int, seed: int = 0) -> Tensor:
    """This rank's sample indices for one epoch: a seeded shuffle split round-robin, equal sizes
    on every rank (the tail is dropped) so all ranks run the same number of steps."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n, generator=g)
    per = n // world
    return perm[rank * per:(rank + 1) * per]


# --- Fashion-MNIST from Debian's package (read from disk, never downloaded) -------------------------
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_ENV = "ADACOMP_FASHION_MNIST"
FASHION_MNIST_APT = "dataset-fashion-mnist"
_IDX_DTYPES: dict[int, type[np.generic] | np.dtype[np.generic]] = {
    0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str) -> np.ndarray:
    """One IDX file (LeCun's MNIST format; ``.gz`` or raw): 2 zero bytes, a type code, the number of
    dimensions, one big-endian uint32 per dimension, then the data row-major."""
    import gzip
    from pathlib import Path

    p = Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{p}: not an IDX file (header {raw[:4].hex()}; expected 00 00 <type> <ndim> with type "
                         f"in {', '.join(hex(t) for t in _IDX_DTYPES)})")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    start = 4 + 4 * ndim
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - start != need:
        raise ValueError(f"{p}: IDX header says shape {shape} ({need} data bytes) but the file has "
                         f"{len(raw) - start}")
    return np.frombuffer(raw, dtype=dtype, offset=start).reshape(shape).astype(dtype.newbyteorder("="))


def _idx_file(folder: str, stem: str) -> str:
    from pathlib import Path

    for name in (f"{stem}.gz", stem):
        if (Path(folder) / name).is_file():
            return str(Path(folder) / name)
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem}[.gz] not found in {folder}. Fix: apt-get install {FASHION_MNIST_APT} "
        f"(Debian's package puts the IDX files in {FASHION_MNIST_DIR}), or set {FASHION_MNIST_ENV} to a folder "
        "holding train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte")


def fashion_mnist(folder: str | None = None, train_limit: int | None = None,
                  test_limit: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fashion-MNIST (60,000 train + 10,000 test 28x28 grey images, 10 classes), scaled to [0, 1].

    Read from ``folder`` (default: ``$ADACOMP_FASHION_MNIST`` or Debian's ``/usr/share/datasets/
    fashion-mnist``). Returns (x_train, y_train, x_test, y_test), x of shape (n, 1, 28, 28); the
    official train / test split. ``*_limit`` keep the first n of each (reduced runs)."""
    import os

    folder = folder or os.environ.get(FASHION_MNIST_ENV) or FASHION_MNIST_DIR
    out = []
    for split in ("train", "t10k"):
        x = read_idx(_idx_file(folder, f"{split}-images-idx3-ubyte"))
        y = read_idx(_idx_file(folder, f"{split}-labels-idx1-ubyte"))
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{folder}: {split} images {x.shape} and labels {y.shape} do not match "
                             "(expected (n, rows, cols) and (n,))")
        limit = train_limit if split == "train" else test_limit
        x, y = x[:limit], y[:limit]
        out += [torch.tensor(x, dtype=torch.float32).unsqueeze(1) / 255.0, torch.tensor(y, dtype=torch.int64)]
    return out[0], out[1], out[2], out[3]
