"""Where the optimizer's state lives when the parameters span several devices.

curvax runs on several devices, and several hosts, through ``jax.sharding`` alone: shard the
batch over a mesh axis, replicate (or shard) the parameters, and XLA partitions the jitted
step, turning the sums over the batch (gradients, Kronecker factors, the quadratic model) into
all-reduces. One decision is left to curvax: where the state goes. The velocities follow the
parameters; the curvature statistics, the damping and the counters are replicated on the
parameters' mesh. Pinning these shardings in ``init``, the burn-in and the step keeps every
step's inputs placed alike, so the step compiles once.
"""

from __future__ import annotations

from typing import Any

import jax
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
