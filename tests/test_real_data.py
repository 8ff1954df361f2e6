"""Offline real data: the IDX reader and Fashion-MNIST loader (on small IDX files written here, so
the test needs no apt package), the fortunes text source, the bf16 compressor."""
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from adacomp import compressors
from adacomp.datasets.digits import fashion_mnist, read_idx
from adacomp.datasets.text import char_corpus, char_sequences


def write_idx(path: Path, arr: np.ndarray, code: int = 0x08, compress: bool = True) -> None:
    raw = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


def fake_fmnist(folder: Path, n_train: int = 12, n_test: int = 5, compress: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    data = {"train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
            "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
            "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
            "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8)}
    for stem, arr in data.items():
        write_idx(folder / (stem + (".gz" if compress else "")), arr, compress=compress)
    return data


@pytest.mark.parametrize("compress", [True, False])
def test_read_idx_round_trip(tmp_path: Path, compress: bool) -> None:
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    p = tmp_path / ("a.gz" if compress else "a")
    write_idx(p, a, compress=compress)
    assert np.array_equal(read_idx(str(p)), a)
    f = np.linspace(-1, 1, 6).astype(">f4")  # big-endian float32, type code 0x0D
    write_idx(tmp_path / "f", f, code=0x0D, compress=False)
    assert np.allclose(read_idx(str(tmp_path / "f")), np.linspace(-1, 1, 6))


def test_read_idx_rejects_bad_files(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x02ab")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(str(tmp_path / "x"))
    (tmp_path / "y").write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 5) + b"abc")
    with pytest.raises(ValueError, match=r"shape \(5,\).*has 3"):
        read_idx(str(tmp_path / "y"))


@pytest.mark.parametrize("compress", [True, False])
def test_fashion_mnist_from_a_folder(tmp_path: Path, compress: bool) -> None:
    data = fake_fmnist(tmp_path, compress=compress)
    x, y, xt, yt = fashion_mnist(str(tmp_path))
    assert x.shape == (12, 1, 28, 28) and xt.shape == (5, 1, 28, 28) and x.dtype == torch.float32
    assert torch.equal(y, torch.tensor(data["train-labels-idx1-ubyte"], dtype=torch.int64))
    assert torch.allclose(x[3, 0] * 255, torch.tensor(data["train-images-idx3-ubyte"][3], dtype=torch.float32))
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    x, y, xt, yt = fashion_mnist(str(tmp_path), train_limit=4, test_limit=2)
    assert len(x) == len(y) == 4 and len(xt) == len(yt) == 2


def test_fashion_mnist_env_and_missing_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_fmnist(tmp_path)
    monkeypatch.setenv("ADACOMP_FASHION_MNIST", str(tmp_path))
    assert len(fashion_mnist()[0]) == 12
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist(str(tmp_path / "nowhere"))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"t10k-labels-idx1-ubyte\[.gz\] not found"):
        fashion_mnist(str(tmp_path))


def test_fortunes_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "b").write_text("Second file.\n%\nCaf\u00e9 au lait\n", encoding="utf-8")
    (tmp_path / "a").write_text("First quote.\n%\nAnother one, longer. " * 20, encoding="utf-8")
    (tmp_path / "a.dat").write_bytes(b"\x00\x01index")
    monkeypatch.setenv("ADACOMP_FORTUNES_DIR", str(tmp_path))
    c = char_corpus("fortunes")
    assert c.text.startswith("First quote.\n\nAnother")  # file-name order, % lines become blank lines
    assert "Caf? au lait" in c.text and "index" not in c.text and "%" not in c.text
    assert "fortunes" in c.source and "2 files" in c.source
    x, y, xt, yt, _ = char_sequences(8, source="fortunes")
    assert torch.equal(x[:, 1:], y[:, :-1]) and len(xt) >= 1
    monkeypatch.setenv("ADACOMP_FORTUNES_DIR", str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match="apt-get install fortunes"):
        char_corpus("fortunes")
    with pytest.raises(ValueError, match="valid choices: fortunes, sklearn"):
        char_corpus("gutenberg")


def test_bf16_compressor_matches_torch_rounding() -> None:
    c = compressors.get("bf16")
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    payload, ctx = c.compress(g, "w")
    assert payload[0].dtype == torch.bfloat16 and c.additive
    assert torch.equal(c.decompress(payload, ctx), g.to(torch.bfloat16).to(torch.float32))
    assert c.payload_bytes(g.shape) == 2000 == payload[0].numel() * payload[0].element_size()
