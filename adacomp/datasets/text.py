"""A character-level text corpus that ships inside an installed package (nothing downloads).

Two sources: ``sklearn`` (the default, below) and ``fortunes`` (Debian's ``fortunes`` package,
~2.4 MB, for runs that need more than 43 kB of text; see :func:`_fortunes`).

Why the default corpus: the convergence suite needs a sequence task on real text that every machine with
the project's dependencies already has, byte for byte. scikit-learn installs the reStructuredText
descriptions of its bundled data sets (``sklearn/datasets/descr/*.rst``, ~43 kB of English prose,
tables and citations); concatenated in file-name order they are the corpus. The text (and so the
vocabulary) is fixed by the installed scikit-learn version, which :func:`char_corpus` reports.

:func:`char_sequences` cuts the encoded text into non-overlapping windows of ``seq_len + 1``
characters (input = first ``seq_len``, target = the same shifted by one) and splits the windows
into train / test with a seeded permutation, so every rank gets the same split without touching the
global RNG and no test character is ever inside a training window.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class CharCorpus:
    """The text, its sorted character vocabulary and where it came from."""

    text: str
    vocab: str
    source: str

    def encode(self, text: str) -> Tensor:
        """Characters -> int64 ids (a character outside the vocabulary is a ``KeyError``)."""
        index = {c: i for i, c in enumerate(self.vocab)}
        return torch.tensor([index[c] for c in text], dtype=torch.int64)

    def decode(self, ids: Tensor) -> str:
        return "".join(self.vocab[int(i)] for i in ids.reshape(-1))


def _sklearn_descr() -> tuple[str, str]:
    import sklearn
    from sklearn.datasets import descr  # a package directory of .rst files

    folder = Path(descr.__file__).resolve().parent
    files = sorted(folder.glob("*.rst"))
    if not files:
        raise FileNotFoundError(f"no *.rst files in {folder}; scikit-learn {sklearn.__version__} "
                                "ships none. Fix: pip install 'scikit-learn>=1.0'")
    text = "\n\n".join(f.read_text(encoding="utf-8") for f in files)
    return text, f"scikit-learn {sklearn.__version__} sklearn/datasets/descr/*.rst ({len(files)} files)"


FORTUNES_DIR = "/usr/share/games/fortunes"
FORTUNES_ENV = "ADACOMP_FORTUNES_DIR"
FORTUNES_APT = "fortunes"


def _fortunes() -> tuple[str, str]:
    """Debian's ``fortunes`` package: ~2.4 MB of English quotations, jokes and verse in plain-text
    files separated by ``%`` lines (the ``.dat`` / ``.u8`` files next to them are indexes and links).
    Characters outside printable ASCII, tab and newline become ``?`` so the vocabulary stays small
    (~98 symbols) whatever the package version contains."""
    import os
    import string

    folder = Path(os.environ.get(FORTUNES_ENV) or FORTUNES_DIR)
    files = sorted(f for f in folder.glob("*") if f.is_file() and not f.is_symlink() and f.suffix not in (".dat", ".u8"))
    if not files:
        raise FileNotFoundError(f"no fortune files in {folder}. Fix: apt-get install {FORTUNES_APT} (Debian), or set "
                                f"{FORTUNES_ENV} to a folder of plain-text files")
    keep = set(string.printable) - {"\r", "\x0b", "\x0c"}
    parts = []
    for f in files:
        text = f.read_bytes().decode("utf-8", errors="replace").replace("\n%\n", "\n\n")
        parts.append("".join(c if c in keep else "?" for c in text))
    return "\n\n".join(parts), f"Debian package {FORTUNES_APT}: {folder}/* ({len(files)} files)"


SOURCES = {"sklearn": _sklearn_descr, "fortunes": _fortunes}


def char_corpus(source: str = "sklearn") -> CharCorpus:
    """Load the corpus ``source`` (``sklearn``: the data set descriptions) with its vocabulary."""
    if source not in SOURCES:
        raise ValueError(f"unknown text source {source!r}; valid choices: {', '.join(sorted(SOURCES))}")
    text, where = SOURCES[source]()
    return CharCorpus(text, "".join(sorted(set(text))), where)


def char_sequences(seq_len: int = 64, seed: int = 0, test_fraction: float = 0.1,
                   source: str = "sklearn") -> tuple[Tensor, Tensor, Tensor, Tensor, CharCorpus]:
    """(x_train, y_train, x_test, y_test, corpus); x, y int64 of shape (n, seq_len), y = x shifted by one."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    corpus = char_corpus(source)
    ids = corpus.encode(corpus.text)
    n = (len(ids) - 1) // seq_len
    if n < 2:
        raise ValueError(f"seq_len={seq_len} leaves fewer than 2 windows in a {len(ids)}-character corpus")
    starts = torch.arange(n) * seq_len
    windows = torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])
    perm = torch.tensor(np.random.default_rng(seed).permutation(n))
    n_test = max(1, int(n * test_fraction))
    test, train = windows[perm[:n_test]], windows[perm[n_test:]]
    return train[:, :-1], train[:, 1:], test[:, :-1], test[:, 1:], corpus
