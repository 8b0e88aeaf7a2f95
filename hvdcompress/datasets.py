"""Small data sets that need no download, as numpy arrays (shared by the PyTorch and TF examples).

* ``digits``: scikit-learn's bundled 8x8 digits (1797 images), pixels scaled to [0, 1], shape
  (n, 1, 8, 8) -- channels first; TF code transposes.
* ``stdlib_text``: a character-level language-modelling corpus every machine has offline: the
  source of the Python standard library's top-level modules (``*.py`` in the ``stdlib`` directory,
  by file name), as ASCII bytes (others become ``?``); the last 10% is the test text. It depends
  on the Python version, which a result therefore states.
* ``mnist1d``: the MNIST-1D benchmark (Greydanus, 2020) generated procedurally by the ``mnist1d``
  package (its ``make_dataset``, never its download URL), shape (n, 1, 40); cached as .npz under
  ``~/.cache/hvdcompress`` because generating 10k samples takes a few seconds.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np


class Split(NamedTuple):
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def cache_dir() -> str:
    path = os.environ.get("HVDCOMPRESS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hvdcompress"))
    os.makedirs(path, exist_ok=True)
    return path


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> Split:
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    d = sk_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    y = d.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return Split(x_tr, y_tr, x_te, y_te)


def load_mnist1d(num_samples: int = 10_000, seed: int = 42) -> Split:
    """MNIST-1D with ``num_samples`` samples (80% train), generated offline and cached."""
    path = os.path.join(cache_dir(), f"mnist1d-{num_samples}-{seed}.npz")
    if not os.path.exists(path):
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples, args.seed = num_samples, seed
        data = make_dataset(args)
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, x=data["x"], y=data["y"], x_test=data["x_test"], y_test=data["y_test"])
        os.replace(tmp, path)  # atomic: concurrent workers never read a half-written file
    with np.load(path) as f:
        return Split(f["x"].astype(np.float32)[:, None], f["y"].astype(np.int64),
                     f["x_test"].astype(np.float32)[:, None], f["y_test"].astype(np.int64))


class Text(NamedTuple):
    train: np.ndarray  # uint8 codes < 128
    test: np.ndarray
    source: str


def load_stdlib_text(max_bytes: int = 2_000_000, test_fraction: float = 0.1) -> Text:
    """The standard library's top-level ``*.py`` files, sorted by name, concatenated, at most
    ``max_bytes`` bytes, ASCII (bytes >= 128 become ``?``); the last ``test_fraction`` is the test
    text."""
    import sysconfig
    import sys

    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    raw = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8).copy()
    if raw.size < 1000:
        raise ValueError(f"stdlib_text: found only {raw.size} bytes of Python source under {root}")
    raw[raw >= 128] = ord("?")
    cut = int(raw.size * (1.0 - test_fraction))
    return Text(raw[:cut], raw[cut:], f"Python {sys.version.split()[0]} stdlib, {raw.size} bytes from {root}")


def load(name: str, seed: int = 0) -> Split:
    if name == "digits":
        return load_digits(seed)
    if name == "mnist1d":
        return load_mnist1d()
    raise ValueError(f"dataset: unknown data set {name!r}; accepted: digits, mnist1d")
