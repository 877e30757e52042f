"""The statistics update: folding a batch into the curvature's moving averages.

Every path (the optimizer's step and burn-in, the Optax transformations, the ferminet-alpha
burn-in) ends the same way: the new statistics are averaged over the pmap devices (``sync``)
and kept only if every one of them is finite (one scalar decides, the same on every device);
a non-finite batch's update is dropped whole and reported as skipped, for the counters of
``curvax.step.guard``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from curvax import estimators
from curvax.step.forward import CurvatureView


def settle(estimator: Any, old: Any, new: Any, axis: str | None, sync: Any = True, valid: Any = True) -> tuple[Any, jax.Array]:
    """``(state, skipped)``: ``new`` averaged over the pmap ``axis`` (when ``sync``, a bool or a
    traced boolean) and kept if finite and ``valid``, else ``old`` with ``skipped`` True.

    ``valid`` must be the same on every device. Statistics averaged on every step are the same
    on every device too, so their finiteness is decided without another collective; otherwise
    the devices agree through one (``keep_finite_statistics``)."""
    if isinstance(sync, bool):
        new = estimator.sync(new, axis) if sync else new
    else:
        new = jax.lax.cond(sync, lambda s: estimator.sync(s, axis), lambda s: s, new)
    return estimators.keep_finite_statistics(old, new, None if sync is True else axis, valid)


def update_from_args(
    estimator: Any, state: Any, ema_old: Any, ema_new: Any, batch_size: Any, rng: jax.Array,
    func_args: Sequence[Any], axis: str | None = None, mode: str | None = None, identity_weight: Any = None,
    sync: Any = True,
) -> tuple[Any, jax.Array]:
    """``(state, skipped)`` after folding in the batch of ``func_args`` (its own forward pass).

    ``ema_old``/``ema_new`` weigh the old average and the new estimate (see the estimator's
    ``update_curvature_matrix_estimate``); ``mode`` None is the estimator's default mode;
    ``identity_weight`` reaches blocks whose update takes one (kfac-jax 0.0.8's), when given.
    """
    extra = {} if identity_weight is None else {"identity_weight": identity_weight}
    new = estimator.update_curvature_matrix_estimate(  # by keyword: either kfac-jax generation's estimator
        state=state, ema_old=ema_old, ema_new=ema_new, batch_size=batch_size, rng=rng, func_args=func_args,
        pmap_axis_name=axis, estimation_mode=mode, **extra,
    )
    return settle(estimator, state, new, axis, sync)


def update_from_view(
    estimator: Any, state: Any, view: CurvatureView, rng: jax.Array, mode: str, ema: Any, axis: str | None,
    valid: Any = True,
) -> tuple[Any, jax.Array]:
    """``(state, skipped)`` after folding in the batch of a linearized pass (the step's own);
    dropped like a non-finite update unless ``valid`` (the batch's loss is finite)."""
    new = estimator._update_from_cotangents(
        state, view.losses, view.data_for, rng, mode, ema, 1.0, view.batch_size, axis
    )
    return settle(estimator, state, new, axis, valid=valid)


def periodic(step: jax.Array, period: int, update: Callable[[Any], tuple[Any, jax.Array]], state: Any) -> tuple[Any, jax.Array]:
    """``update(state)`` on steps that are multiples of ``period`` (every step for 1).

    Off-period steps return ``(state, False)`` and skip the update's work entirely (a
    conditional runs only its taken branch).
    """
    if period == 1:
        return update(state)
    return jax.lax.cond(step % period == 0, update, lambda s: (s, jnp.asarray(False)), state)


def loss_is_finite(loss: jax.Array, axis: str | None) -> jax.Array:
    """Whether the batch's loss is finite on every pmap device (one scalar, the same everywhere)."""
    finite = jnp.isfinite(loss)
    if axis is not None:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis) > 0
    return finite

