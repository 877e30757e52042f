"""The shipped MNIST files load, are intact and are checked."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from curvax import datasets


def test_images_and_labels_load():
    x = datasets.load_mnist_images(500)
    y = datasets.load_mnist_labels(500)
    assert x.shape == (500, 784) and x.dtype == np.float32
    assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() == 1.0
    assert y.shape == (500,) and set(np.unique(y)) <= set(range(10)) and len(np.unique(y)) == 10
    assert datasets.load_mnist_images().shape == (10_000, 784)


def test_corrupted_or_missing_files_are_reported(tmp_path):
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        shutil.copy(datasets._data_dir() / name, tmp_path / name)
    raw = bytearray((tmp_path / "t10k-images-idx3-ubyte.gz").read_bytes())
    raw[100] ^= 0xFF
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="corrupted"):
        datasets.load_mnist_images(10, directory=tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        datasets.load_mnist_labels(10, directory=tmp_path)
    with pytest.raises(ValueError, match="num_images"):
        datasets.load_mnist_images(0)
