"""The MNIST test images shipped with curvax (for the demo, benchmarks and tests).

The 10,000 images of the MNIST test set (IDX format, gzip) live in
``curvax/data/mnist`` with their license note (CC BY-SA 3.0). Files are checked
against their SHA-256 digests before use.
"""

from __future__ import annotations

import gzip
import hashlib
from importlib import resources
from pathlib import Path

import numpy as np

_FILES = {
    "images": ("t10k-images-idx3-ubyte.gz", "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6", 2051),
    "labels": ("t10k-labels-idx1-ubyte.gz", "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6", 2049),
}
NUM_EXAMPLES = 10_000


def _data_dir() -> Path:
    return Path(str(resources.files("curvax") / "data" / "mnist"))


def _read_idx(kind: str, directory: Path | None = None) -> np.ndarray:
    name, digest, magic = _FILES[kind]
    path = (directory or _data_dir()) / name
    if not path.exists():
        raise FileNotFoundError(f"MNIST file {path} is missing; reinstall curvax (it ships the MNIST test set).")
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != digest:
        raise ValueError(f"MNIST file {path} is corrupted: its SHA-256 digest does not match the published file.")
    data = gzip.decompress(raw)
    header = 16 if kind == "images" else 8
    values = np.frombuffer(data[:header], dtype=">i4")
    if values[0] != magic or values[1] != NUM_EXAMPLES:
        raise ValueError(f"MNIST file {path} has an unexpected header {values.tolist()}.")
    arr = np.frombuffer(data[header:], dtype=np.uint8)
    return arr.reshape(NUM_EXAMPLES, 28 * 28) if kind == "images" else arr


def _check_count(num: int | None) -> int:
    if num is None:
        return NUM_EXAMPLES
    if not isinstance(num, (int, np.integer)) or not 1 <= num <= NUM_EXAMPLES:
        raise ValueError(f"num_images must be an integer in [1, {NUM_EXAMPLES}], got {num!r}.")
    return int(num)


def load_mnist_images(num_images: int | None = None, directory: Path | None = None) -> np.ndarray:
    """The first ``num_images`` test images as float32 in [0, 1], shape ``(N, 784)``."""
    n = _check_count(num_images)
    return _read_idx("images", directory)[:n].astype(np.float32) / 255.0


def load_mnist_labels(num_labels: int | None = None, directory: Path | None = None) -> np.ndarray:
    """The first ``num_labels`` test labels (int32 in 0..9)."""
    n = _check_count(num_labels)
    return _read_idx("labels", directory)[:n].astype(np.int32)
