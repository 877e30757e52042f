"""Where the optimizer's state lives when the parameters span several devices.

curvax runs on several devices, and several hosts, through ``jax.sharding`` alone: shard the
batch over a mesh axis, replicate (or shard) the parameters, and XLA partitions the jitted
step, turning the sums over the batch (gradients, Kronecker factors, the quadratic model) into
all-reduces. One decision is left to curvax: where the state goes. The velocities follow the
parameters; the curvature statistics, the damping and the counters are replicated on the
parameters' mesh. Pinning these shardings in ``init``, the burn-in and the step keeps every
step's inputs placed alike, so the step compiles once.

kfac-jax's own ``pmap`` mode (``Optimizer(multi_device=True)``, every input with a leading
device axis) is supported too, for code written against it; the helpers at the end serve it.
"""

from __future__ import annotations

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
    any context.
    """

    def leaf(x: Any) -> Any:
        x = x[index]
        try:  # a concrete array on this process's devices (a tracer has no sharding to read)
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
