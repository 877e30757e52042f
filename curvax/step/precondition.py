"""Preconditioning: products with the damped curvature estimate and its powers.

``precondition`` is the one place that calls the estimator's ``multiply_matpower`` (the
inverse for the update), ``curvature_product`` the one that calls ``multiply``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from curvax import utils


def precondition(
    estimator: Any, state: Any, vector: Any, identity_weight: Any, exact: bool, use_cached: bool,
    power: float = -1, axis: str | None = None, like: Any = None, distribution: Any = None,
) -> Any:
    """``(C + identity_weight I)^power vector`` (the inverse by default), ``C`` from ``state``.

    ``exact`` and ``use_cached`` are the estimator's (static). Blocks may hold statistics in a
    wider dtype than the parameters: with ``like`` (a pytree shaped as ``vector``) each leaf is
    cast back to ``like``'s dtype. ``distribution`` (a ``curvax.distributed.Distribution``, or
    None) splits the blocks' products over the devices and shares the results.
    """
    extra = {} if distribution is None else {"distribution": distribution}
    out = estimator.multiply_matpower(state, vector, identity_weight, power, exact, use_cached, axis, **extra)
    if like is None:
        return out
    return jax.tree_util.tree_map(lambda v, p: v.astype(jnp.result_type(p)), out, like)


def curvature_product(
    estimator: Any, state: Any, vector: Any, identity_weight: Any, exact: bool, use_cached: bool,
    axis: str | None = None,
) -> Any:
    """``(C + identity_weight I) vector``, ``C`` from ``state``."""
    return estimator.multiply(state, vector, identity_weight, exact, use_cached, axis)


def constrain_norm(
    precon: Any, grads: Any, constraint: Any, scale: Any = None, floor: float | None = 1e-30
) -> tuple[Any, jax.Array]:
    """``(precon * factor, scaled_sq)``: the norm constraint on a preconditioned gradient.

    ``scaled_sq = scale**2 * precon^T grads`` (``scale`` the learning rate, None for 1) is the
    squared norm of the step in the damped curvature; ``factor = min(1, sqrt(constraint /
    scaled_sq))`` (``scaled_sq`` at least ``floor`` when given) scales it down to ``constraint``.
    """
    scaled_sq = utils.inner_product(precon, grads)
    if scale is not None:
        scaled_sq = scale**2 * scaled_sq
    denominator = scaled_sq if floor is None else jnp.maximum(scaled_sq, floor)
    factor = jnp.minimum(1.0, jnp.sqrt(constraint / denominator))
    # Half-precision leaves keep their dtype (the float32 factor would promote them to float32).
    half = lambda y: utils.widen_half(y) is not y
    scaled = jax.tree_util.tree_map(lambda x, y: x.astype(y.dtype) if half(y) else x, utils.scalar_mul(precon, factor), precon)
    return scaled, scaled_sq
