"""Small data sets that need no download, as numpy arrays (shared by the PyTorch and TF examples).

* ``digits``: scikit-learn's bundled 8x8 digits (1797 images), pixels scaled to [0, 1], shape
  (n, 1, 8, 8) -- channels first; TF code transposes.
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


def load(name: str, seed: int = 0) -> Split:
    if name == "digits":
        return load_digits(seed)
    if name == "mnist1d":
        return load_mnist1d()
    raise ValueError(f"dataset: unknown data set {name!r}; accepted: digits, mnist1d")
