"""Saving and loading ``(params, state)`` with the checks that a plain ``np.savez`` skips.

Any array store can hold curvax's pytrees; these two functions add what a resumed run needs to be
trusted: the file is named in every error (a truncated or foreign file says so), the loaded
arrays must match the structure, shapes and dtypes of a freshly initialised tree, and a
non-finite value is refused at load time. A NaN Kronecker factor would otherwise turn that
layer's preconditioner into damping alone from the next inverse refresh on, without a word.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_MANIFEST = "__curvax_manifest__"
_FORMAT = 1
# Leaves that are legitimately NaN: the optimizer's divergence reference before the first finite
# loss (`OptimizerState.first_loss`).
_MAY_BE_NAN = ("first_loss",)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read, or whose contents do not fit the tree asked for."""


def _leaf_names(tree: Any) -> list[str]:
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(path) or "<root>" for path, _ in paths]


def save(path: str | os.PathLike, tree: Any) -> None:
    """Write every array leaf of ``tree`` (e.g. ``(params, state)``) to the ``.npz`` file ``path``.

    The file also records each leaf's path, shape and dtype, so ``load`` can say which leaf does
    not fit. Leaves are fetched to the host (on several devices: one replica of each).
    """
    leaves = jax.tree_util.tree_leaves(tree)
    names = _leaf_names(tree)
    arrays = {f"leaf{i:05d}": np.asarray(leaf) for i, leaf in enumerate(leaves)}
    manifest = {
        "format": _FORMAT,
        "leaves": [{"path": n, "shape": list(a.shape), "dtype": str(a.dtype)} for n, a in zip(names, arrays.values())],
    }
    arrays[_MANIFEST] = np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def load(path: str | os.PathLike, like: Any, *, allow_non_finite: bool = False) -> Any:
    """The arrays saved by ``save`` in ``path``, in the structure of ``like``.

    ``like`` is a tree of the expected structure (e.g. ``(params, optimizer.init(...))``; only its
    structure, shapes and dtypes are used). Raises ``CheckpointError`` naming the file and the
    leaf when the file is unreadable, holds another number of leaves, a leaf of another shape or
    dtype, or a non-finite value (unless ``allow_non_finite=True``; the optimizer's
    ``first_loss`` may always be NaN).
    """
    where = os.fspath(path)
    try:
        with np.load(where, allow_pickle=False) as f:
            files = set(f.files)
            if _MANIFEST not in files:
                raise CheckpointError(
                    f"checkpoint {where!r} was not written by curvax.checkpoint.save (no manifest); "
                    "save it with curvax.checkpoint.save(path, tree)."
                )
            manifest = json.loads(bytes(f[_MANIFEST]).decode())
            count = len(manifest["leaves"])
            arrays = [f[f"leaf{i:05d}"] for i in range(count)]
    except CheckpointError:
        raise
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {where!r} does not exist.") from e
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {where!r} could not be read ({type(e).__name__}: {e}); the file is truncated, "
            "corrupt or not a curvax checkpoint."
        ) from e

    like_leaves, treedef = jax.tree_util.tree_flatten(like)
    names = _leaf_names(like)
    if len(like_leaves) != len(arrays):
        raise CheckpointError(
            f"checkpoint {where!r} holds {len(arrays)} arrays but `like` has {len(like_leaves)} leaves: it was "
            "saved from another model or optimizer configuration."
        )
    for name, saved, want, array in zip(names, manifest["leaves"], like_leaves, arrays):
        want_shape = tuple(np.shape(want))
        if tuple(array.shape) != want_shape:
            raise CheckpointError(
                f"checkpoint {where!r}: leaf {name} has shape {tuple(array.shape)} (saved as {saved['path']}), "
                f"expected {want_shape}: it was saved from another model or optimizer configuration."
            )
        want_dtype = jnp.result_type(want)
        if array.dtype != want_dtype:
            raise CheckpointError(
                f"checkpoint {where!r}: leaf {name} has dtype {array.dtype}, expected {want_dtype}."
            )
        if not allow_non_finite and np.issubdtype(array.dtype, np.inexact) and not np.all(np.isfinite(array)):
            if not any(name.endswith(f".{field}") for field in _MAY_BE_NAN):
                bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
                raise CheckpointError(
                    f"checkpoint {where!r}: leaf {name} holds {bad} non-finite value(s); refusing to load it "
                    "(a non-finite curvature factor would silently reduce that layer's preconditioner to "
                    "damping alone). Pass allow_non_finite=True to inspect such a file."
                )
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in arrays])
