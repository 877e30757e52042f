"""Preconditioning: products with the damped curvature estimate and its powers.

``precondition`` is the one place that calls the estimator's ``multiply_matpower`` (the
inverse for the update), ``curvature_product`` the one that calls ``multiply``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from curvax import linalg, utils


def block_norm_kwargs(block_norm: str | None) -> dict[str, Any]:
    """The estimator's keyword for kfac-jax 0.0.8's per-block damping norm: none when off, so the
    product is the same call (and program) as without the option."""
    return {} if block_norm is None else {"norm_to_scale_identity_weight_per_block": block_norm}


def precondition(
    estimator: Any, state: Any, vector: Any, identity_weight: Any, exact: bool, use_cached: bool,
    power: float = -1, axis: str | None = None, like: Any = None, distribution: Any = None,
    block_norm: str | None = None,
) -> Any:
    """``(C + identity_weight I)^power vector`` (the inverse by default), ``C`` from ``state``.

    ``exact`` and ``use_cached`` are the estimator's (static). Blocks may hold statistics in a
    wider dtype than the parameters: with ``like`` (a pytree shaped as ``vector``) each leaf is
    cast back to ``like``'s dtype. ``distribution`` (a ``curvax.distributed.Distribution``, or
    None) splits the blocks' products over the devices and shares the results. ``block_norm``
    (a norm name, or None) multiplies each block's damping by the block's norm
    (``norm_to_scale_identity_weight_per_block``).
    """
    extra = {} if distribution is None else {"distribution": distribution}
    extra.update(block_norm_kwargs(block_norm))
    out = estimator.multiply_matpower(state, vector, identity_weight, power, exact, use_cached, axis, **extra)
    if not (use_cached or exact or getattr(distribution, "split_state", False)):
        out = _retry_in_float64(estimator, state, vector, identity_weight, power, out, block_norm)
    if like is None:
        return out
    return jax.tree_util.tree_map(lambda v, p: v.astype(jnp.result_type(p)), out, like)


def _retry_in_float64(
    estimator: Any, state: Any, vector: Any, identity_weight: Any, power: float, out: Any, block_norm: str | None = None
) -> Any:
    """``out``, or, when it is not finite while ``vector`` is, the same product
    computed in float64 on every block (one ``lax.cond`` for the whole product).

    The approximate products solve with each damped factor by a plain Cholesky factorization
    (``curvax.linalg.cholesky_solve``), which fails in float32 when the damping is below the
    factor's rounding. The retry needs float64 linear algebra (``linalg.float64_retry_available``)
    and a whole state on each device: after a distributed product ``out`` is the same on every
    device, so all take the same branch, which works on the local state alone.
    """
    leaves = [x for x in jax.tree_util.tree_leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves or not all(linalg.float64_retry_available(x.dtype) for x in leaves):
        return out
    inputs = [x for x in jax.tree_util.tree_leaves(vector) if jnp.issubdtype(x.dtype, jnp.floating)]
    # (A non-finite state makes the retry non-finite too; the step's guard then skips the update.)
    failed = jnp.logical_and(linalg.sum_is_finite(*inputs), jnp.logical_not(linalg.sum_is_finite(*leaves)))

    def wide(x: Any) -> Any:
        return jnp.asarray(x, jnp.float64) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x

    def in_float64(_: Any) -> Any:
        with jax.enable_x64(True):
            state64, vector64, weight64 = jax.tree_util.tree_map(wide, (state, vector, identity_weight))
            wide_out = estimator.multiply_matpower(
                state64, vector64, weight64, power, False, False, **block_norm_kwargs(block_norm)
            )
        return jax.tree_util.tree_map(lambda w, o: w.astype(o.dtype), wide_out, out)

    return jax.lax.cond(failed, in_float64, lambda _: out, None)


def curvature_product(
    estimator: Any, state: Any, vector: Any, identity_weight: Any, exact: bool, use_cached: bool,
    axis: str | None = None, block_norm: str | None = None,
) -> Any:
    """``(C + identity_weight I) vector``, ``C`` from ``state`` (``block_norm`` as for ``precondition``)."""
    return estimator.multiply(state, vector, identity_weight, exact, use_cached, axis, **block_norm_kwargs(block_norm))


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
