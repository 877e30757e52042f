"""Where the optimizer's state lives when the parameters span several devices.

curvax runs on several devices, and several hosts, through ``jax.sharding`` alone: shard the
batch over a mesh axis, replicate (or shard) the parameters, and XLA partitions the jitted
step, turning the sums over the batch (gradients, Kronecker factors, the quadratic model) into
all-reduces. One decision is left to curvax: where the state goes. The velocities follow the
parameters; the damping and the counters are replicated on the parameters' mesh. The curvature
state (Kronecker factors, cached inverses and eigenbases) is replicated too, unless the
parameters are themselves sharded (FSDP-style) or the user asks for it
(``Optimizer(shard_curvature_state=True)``): then each large matrix is split along one axis over
the mesh's devices (``curvature_shardings``), so each device stores ~1/N of it and XLA gathers
what a computation needs. Pinning these shardings in ``init``, the burn-in and the step keeps
every step's inputs placed alike, so the step compiles once.

kfac-jax's own ``pmap`` mode (``Optimizer(multi_device=True)``, every input with a leading
device axis) is supported too, for code written against it; the helpers at the end serve it.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def params_mesh(params: Any) -> Mesh | None:
    """The mesh of ``params`` if every leaf is a ``NamedSharding`` array on one mesh of several devices."""
    leaves = jax.tree_util.tree_leaves(params)
    shardings = [getattr(leaf, "sharding", None) for leaf in leaves]
    if not shardings or not all(isinstance(s, NamedSharding) for s in shardings):
        return None
    mesh = shardings[0].mesh
    if mesh.size <= 1 or any(s.mesh != mesh for s in shardings):
        return None
    return mesh


# Curvature-state leaves smaller than this many elements stay replicated: splitting them saves
# little memory and costs a collective each (4096 elements: a 64 x 64 matrix, 16 KiB in float32).
SHARD_MIN_ELEMENTS = 4096


def params_sharded(params: Any) -> bool:
    """Whether some leaf of ``params`` is split over its devices (not a full copy on each)."""
    for leaf in jax.tree_util.tree_leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and not sharding.is_fully_replicated:
            return True
    return False


def shards_curvature(option: bool | None, params: Any) -> bool:
    """Whether the curvature state is sharded: ``option`` when given (``shard_curvature_state``),
    else (None) exactly when the parameters are sharded on their mesh."""
    return params_sharded(params) if option is None else bool(option)


def split_spec(shape: tuple[int, ...], mesh: Mesh, min_elements: int = SHARD_MIN_ELEMENTS) -> PartitionSpec:
    """How one curvature-state leaf of ``shape`` is split over ``mesh``.

    Matrices (and stacks of them) of at least ``min_elements`` elements are split along one axis
    over the mesh axes whose sizes multiply to the largest divisor of that axis's length (all
    of them when it divides: 1/N per device); on ties the earlier axis wins. Anything
    smaller, any vector or scalar, and a matrix no mesh axis divides stay replicated.
    """
    if len(shape) < 2 or math.prod(shape) < min_elements:
        return PartitionSpec()
    names = tuple(mesh.axis_names)
    best: tuple[int, int, tuple[str, ...]] = (1, 0, ())  # (devices, dimension, mesh axes)
    for r in range(len(names), 0, -1):
        for axes in itertools.combinations(names, r):
            size = math.prod(mesh.shape[a] for a in axes)
            for dim, length in enumerate(shape):
                if size > best[0] and length % size == 0:
                    best = (size, dim, axes)
    size, dim, axes = best
    if size <= 1:
        return PartitionSpec()
    entry = axes[0] if len(axes) == 1 else axes
    return PartitionSpec(*([None] * dim), entry)


def curvature_shardings(tree: Any, mesh: Mesh, min_elements: int = SHARD_MIN_ELEMENTS) -> Any:
    """A ``NamedSharding`` on ``mesh`` for every array leaf of ``tree`` (arrays or
    ``jax.ShapeDtypeStruct``s): ``split_spec`` of its shape."""
    return jax.tree_util.tree_map(lambda x: NamedSharding(mesh, split_spec(tuple(x.shape), mesh, min_elements)), tree)


def bytes_per_device(tree: Any, shardings: Any = None) -> int:
    """The bytes one device stores for ``tree``'s array leaves: each leaf's shard, by ``shardings``
    (a tree of shardings matching ``tree``, or a prefix of it) or by the leaves' own; a leaf with
    neither counts whole."""
    leaves = jax.tree_util.tree_leaves(tree)
    if shardings is None:
        places = [getattr(x, "sharding", None) for x in leaves]
    else:
        places = jax.tree_util.tree_leaves(
            jax.tree_util.tree_map(lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub), shardings, tree,
                                   is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
        )
    total = 0
    for x, place in zip(leaves, places):
        shape = tuple(x.shape) if place is None else tuple(place.shard_shape(tuple(x.shape)))
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return int(total)


def replicated(mesh: Mesh) -> NamedSharding:
    """A copy on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def constrain(tree: Any, shardings: Any) -> Any:
    """``tree`` placed by ``shardings`` (a prefix of its structure), or as it is when that is None."""
    if shardings is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, shardings)


# --- kfac-jax's pmap mode (``Optimizer(multi_device=True)``) ---------------------------------
#
# There every array the user passes carries a leading device axis, and the optimizer runs its
# own ``jax.pmap`` over it, averaging every batch quantity over the axis with ``lax.pmean``.


def check_device_axis(trees: dict[str, Any], num_devices: int) -> None:
    """Raises a clear error unless every array leaf of every named tree has leading size ``num_devices``.

    ``trees`` maps argument names to their values (``None`` values are skipped).
    """
    for name, tree in trees.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            shape = np.shape(leaf)
            if not shape or shape[0] != num_devices:
                got = f"shape {tuple(shape)}" if shape else "a scalar"
                fix = {
                    "rng": "pass one key per device, e.g. jax.random.split(key, n)",
                    "batch": "reshape each leaf to (n, examples per device, ...)",
                }.get(name, "replicate it with curvax.utils.replicate_all_local_devices")
                raise ValueError(
                    f"multi_device=True: every array in `{name}` needs a leading device axis of size "
                    f"n = {num_devices} (jax.local_device_count()); {name}{jax.tree_util.keystr(path)} "
                    f"has {got}: {fix}."
                )


def device_slice(tree: Any, index: int = 0) -> Any:
    """The slice ``index`` of every leaf's leading (device) axis."""
    return jax.tree_util.tree_map(lambda x: x[index], tree)


def unplaced_slice(tree: Any, index: int = 0) -> Any:
    """``device_slice(tree, index)`` with every array leaf copied onto one device, out of any mesh.

    ``init`` traces the loss on one device's slice outside the pmap, and the step re-evaluates
    that trace inside it. Since JAX lowers ``pmap`` through ``shard_map`` (0.9 by default, always
    from 0.10), the arrays a pmap returns carry a mesh over the pmap axis (``Auto`` axis types),
    and so do their slices; a trace of them records that mesh in its avals and in the
    ``sharding`` parameters of its equations, which then clash with the ``Manual`` mesh of the
    same axis inside the pmapped step (``Mesh for all inputs should be equal`` from ``scan``,
    ``cond``, ...). So do leaves placed on a mesh of another axis name (e.g. by
    ``utils.replicate_all_local_devices``). A copy on one device carries no mesh: its trace fits
    any context. The copy is read off the shard that holds the slice, through the host: indexing
    the array would compile two small programs per leaf and shape (a second or more on a model
    of many leaves).
    """

    def leaf(x: Any) -> Any:
        try:  # a concrete array on this process's devices (a tracer has no shards to read)
            local = isinstance(x, jax.Array) and x.is_fully_addressable and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
            shards = x.addressable_shards if local else []
        except Exception:
            shards = []
        for s in shards:
            start, stop, _ = (s.index[0] if s.index else slice(None)).indices(x.shape[0])
            if start <= index < stop:
                return jax.device_put(np.asarray(s.data)[index - start], jax.sharding.SingleDeviceSharding(s.device))
        x = x[index]
        try:
            local = isinstance(x, jax.Array) and x.is_fully_addressable
            devices = sorted(x.sharding.device_set, key=lambda d: d.id) if local else []
        except Exception:
            devices = []
        return jax.device_put(x, jax.sharding.SingleDeviceSharding(devices[0])) if devices else x

    return jax.tree_util.tree_map(leaf, tree)


def split_keys(rng: jax.Array, num: int, per_device: bool) -> tuple[jax.Array, ...]:
    """``jax.random.split(rng, num)``, or that for each device's key when ``per_device``."""
    if not per_device:
        return tuple(jax.random.split(rng, num))
    keys = jax.vmap(lambda k: jax.random.split(k, num))(rng)
    return tuple(keys[:, i] for i in range(num))


def local_shapes(tree: Any) -> Any:
    """Shapes and dtypes of one device's slice of ``tree`` (leading axis dropped), without slicing."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)), tree)


def device_scalar(x: Any, num_devices: int, name: str) -> jax.Array:
    """A float32 scalar, or one per device, as an array of shape ``(num_devices,)`` for ``pmap``."""
    try:
        arr = jnp.asarray(x, jax.dtypes.canonicalize_dtype(jnp.float64))
    except (TypeError, ValueError) as e:
        raise TypeError(f"`{name}` must be a number, got {type(x).__name__}.") from e
    if arr.shape not in ((), (num_devices,)):
        raise ValueError(
            f"multi_device=True: `{name}` must be a scalar or have shape ({num_devices},) (one value per "
            f"device), got shape {arr.shape}."
        )
    return jnp.broadcast_to(arr, (num_devices,))


class CompiledPmap:
    """A ``jax.pmap``-ed function called through its compiled programs, one per call signature.

    Where JAX implements ``pmap`` as a jitted ``shard_map`` (JAX 0.10, and 0.9 unless
    ``jax_pmap_shmap_merge`` is off), every call of the pmapped function re-derives its axes,
    donations and mesh in Python (0.2–0.4 ms on a CPU: a large share of a small model's step).
    The compiled program's own call is JAX's C++ dispatch. The caller supplies a key that
    identifies the arguments' structure, shapes and dtypes (None: call the pmap itself, e.g. for
    traced arguments). With several processes, or JAX's legacy pmap (its dispatch is already
    compiled), the pmap is always called.
    """

    MAX_PROGRAMS = 8  # signatures kept; the oldest is dropped beyond

    def __init__(self, pmapped: Any) -> None:
        self.pmapped = pmapped
        self._programs: dict[Any, Any] = {}

    @staticmethod
    def direct_calls() -> bool:
        """Whether calling the compiled program is faster than the pmap and means the same."""
        return jax.process_count() == 1 and bool(jax.config.values.get("jax_pmap_shmap_merge", True))

    def __call__(self, key: Any, *args: Any) -> Any:
        if key is None or not self.direct_calls():
            return self.pmapped(*args)
        program = self._programs.get(key)
        if program is None:
            if len(self._programs) >= self.MAX_PROGRAMS:
                self._programs.pop(next(iter(self._programs)))
            program = self._programs[key] = self.pmapped.lower(*args).compile()
        return program(*args)
