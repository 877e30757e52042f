"""The optimizer's persistent state (a pytree), ``curvax.Optimizer.State``.

Its fields and their order are those of saved checkpoints: keep them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OptimizerState:
    """Persistent optimizer state (a pytree).

    velocities: the last update ``theta_t - theta_{t-1}``; estimator_state: the
    curvature blocks; damping: current damping; data_seen: examples processed;
    step_counter: the step number; curvature_updates_skipped: statistics updates dropped
    because they were not finite; updates_skipped: parameter updates skipped because the
    loss, gradient or update was not finite; first_loss: the first finite loss (NaN before),
    the reference of the divergence check.
    """

    velocities: Any
    estimator_state: Any
    damping: jax.Array
    data_seen: jax.Array
    step_counter: jax.Array
    # Ours, with defaults so that kfac-jax's five-field construction still works.
    curvature_updates_skipped: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros([], jnp.int32))
    updates_skipped: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros([], jnp.int32))
    first_loss: jax.Array = dataclasses.field(default_factory=lambda: jnp.asarray(jnp.nan, jnp.float32))


# Its public home (``curvax.optimizer.OptimizerState``, ``curvax.Optimizer.State``), where it
# was defined before the step was split into phases: pickles and documentation name it there.
OptimizerState.__module__ = "curvax.optimizer"


def initial_state(velocities: Any, estimator_state: Any, damping: jax.Array) -> OptimizerState:
    """The state before the first step: counters zero, no first loss yet."""
    return OptimizerState(
        velocities=velocities,
        estimator_state=estimator_state,
        damping=damping,
        # JAX's default integer (int64 under jax_enable_x64), as kfac-jax's: a schedule such
        # as ``lambda n: lr / (1 + n / 1e4)`` then computes in float64 too, not in float32.
        data_seen=jnp.zeros([], int),
        step_counter=jnp.zeros([], int),
        curvature_updates_skipped=jnp.zeros([], jnp.int32),
        updates_skipped=jnp.zeros([], jnp.int32),
        first_loss=jnp.asarray(jnp.nan, jnp.float32),
    )
