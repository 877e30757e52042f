"""The damping: this step's, the preconditioner's, and its Levenberg-Marquardt adaptation.

Adaptive damping compares the loss change an update actually produced with the quadratic
model's prediction (the reduction ratio ``rho``) every ``damping_adaptation_interval`` steps,
and multiplies the damping by ``decay ** interval`` (``rho`` above the upper threshold) or
divides it by that (``rho`` below the lower one), within ``[min_damping, max_damping]``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from curvax import utils
from curvax.step.coefficients import schedule_value
from curvax.step.config import StepConfig


class DampingUpdate(NamedTuple):
    """The adaptation's outcome: the loss after the update (NaN when not computed), ``rho``
    (NaN when not adapting, -100 when not finite) and the next step's damping."""

    new_loss: jax.Array
    rho: jax.Array
    damping: jax.Array


def step_damping(cfg: StepConfig, state_damping: jax.Array, given: jax.Array, step: jax.Array, data_seen: jax.Array) -> jax.Array:
    """This step's damping: the state's (adaptive), the schedule's, or the ``given`` one."""
    if cfg.adaptive_damping:
        return state_damping
    return schedule_value(cfg.damping_schedule, given, step, data_seen)


def precon_damping(cfg: StepConfig, damping: jax.Array, step: jax.Array, data_seen: jax.Array) -> jax.Array:
    """The preconditioner's damping (the ``precon_damping`` stat): its own schedule (kfac-jax
    0.0.8), or the damping times ``precon_damping_mult`` (1 by default: the damping itself)."""
    if cfg.precon_damping_schedule is not None:
        return schedule_value(cfg.precon_damping_schedule, damping, step, data_seen)
    return damping * cfg.precon_damping_mult


def identity_weight(cfg: StepConfig, precon: jax.Array) -> jax.Array:
    """The weight of the identity added to the curvature: ``l2_reg`` plus ``precon``, the
    preconditioner's damping (``precon_damping``)."""
    return cfg.l2_reg + precon


def decay_factor(cfg: StepConfig) -> float:
    """The factor of one adaptation: ``damping_adaptation_decay ** damping_adaptation_interval``."""
    return cfg.damping_decay**cfg.damping_interval


def due(cfg: StepConfig, step_counter: jax.Array) -> jax.Array:
    """Whether the step starting at ``step_counter`` adapts the damping (the next counter is a
    multiple of the interval, with adaptive damping on)."""
    return cfg.adaptive_damping & ((step_counter + 1) % cfg.damping_interval == 0)


def levenberg_marquardt(cfg: StepConfig, damping: jax.Array, new_loss: jax.Array, loss: jax.Array, quad_change: jax.Array) -> DampingUpdate:
    """The adapted damping from the reduction ratio ``(new_loss - loss) / quad_change``."""
    rho = (utils.widen_half(new_loss) - utils.widen_half(loss)) / quad_change
    rho = jnp.where(jnp.isfinite(rho), rho, -100.0)
    factor = decay_factor(cfg)
    lower, upper = cfg.lower_threshold, cfg.upper_threshold
    d = jnp.where(rho < lower, damping / factor, jnp.where(rho > upper, damping * factor, damping))
    d = jnp.clip(d, cfg.min_damping, cfg.max_damping)
    f = utils.coefficient_dtype()
    return DampingUpdate(new_loss.astype(f), rho.astype(f), d.astype(f))


def adapt(
    cfg: StepConfig, is_due: jax.Array, new_loss_fn: Callable[[], jax.Array], loss: jax.Array,
    quad_change: jax.Array, damping: jax.Array,
) -> DampingUpdate:
    """The damping phase: on due steps (``is_due``) evaluates ``new_loss_fn()`` (the loss at the
    updated parameters, one more forward pass) and adapts; the damping is unchanged otherwise."""
    nan = jnp.asarray(jnp.nan, utils.coefficient_dtype())
    if not cfg.adaptive_damping:
        return DampingUpdate(nan, nan, damping)
    return DampingUpdate(*jax.lax.cond(
        is_due,
        lambda: tuple(levenberg_marquardt(cfg, damping, new_loss_fn(), loss, quad_change)),
        lambda: (nan, nan, jnp.asarray(damping, utils.coefficient_dtype())),
    ))
