"""The ``stats`` dict of ``curvax.Optimizer.step`` (its keys are documented on the class)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from curvax import utils


class StepOutcome(NamedTuple):
    """What a step computed that its stats report (see ``curvax.Optimizer``'s docstring)."""

    step: jax.Array
    batch_size: Any
    data_seen: jax.Array
    loss: jax.Array
    new_loss: jax.Array
    coeffs: jax.Array
    damping: jax.Array
    rho: jax.Array
    quad_change: jax.Array
    update_skipped: jax.Array
    updates_skipped: jax.Array
    curvature_update_skipped: jax.Array
    curvature_updates_skipped: jax.Array
    loss_diverged: jax.Array
    precon_damping: jax.Array


def step_stats(out: StepOutcome) -> dict[str, Any]:
    """The keys every step returns."""
    return {
        "step": out.step,
        "batch_size": jnp.asarray(out.batch_size, jnp.int32),
        "data_seen": out.data_seen,
        "loss": out.loss,
        "new_loss": out.new_loss,
        "learning_rate": -out.coeffs[0],
        "momentum": out.coeffs[1],
        "damping": jnp.asarray(out.damping, utils.coefficient_dtype()),
        "precon_damping": jnp.asarray(out.precon_damping, utils.coefficient_dtype()),
        "rho": out.rho,
        "quad_model_change": out.quad_change,
        "update_skipped": out.update_skipped,  # loss, gradient or update not finite: params unchanged
        "updates_skipped": out.updates_skipped,  # running count of skipped updates
        "curvature_update_skipped": out.curvature_update_skipped,  # statistics not finite: old ones kept
        "curvature_updates_skipped": out.curvature_updates_skipped,  # running count (burn-in included)
        "loss_diverged": out.loss_diverged,  # finite loss > DIVERGENCE_FACTOR * max(|first finite loss|, 1)
    }


def norm_stats(params: Any, grads: Any, precon: Any, delta: Any, per_param: bool) -> dict[str, jax.Array]:
    """Euclidean norms of the parameters (those the step returns, updated), gradient,
    preconditioned gradient and update: global ones, or per leaf (``<name>_norm(<path>)``) with
    ``per_param``."""
    if not per_param:
        return {
            "param_norm": utils.norm(params),
            "grad_norm": utils.norm(grads),
            "precon_grad_norm": utils.norm(precon),
            "update_norm": utils.norm(delta),
        }
    out = {}
    leaves = jax.tree_util.tree_leaves
    for path, g, pg, u, w in zip(
        utils.param_paths(params), leaves(grads), leaves(precon), leaves(delta), leaves(params),
    ):
        out[f"param_norm({path})"] = jnp.linalg.norm(w)
        out[f"grad_norm({path})"] = jnp.linalg.norm(g)
        out[f"precon_grad_norm({path})"] = jnp.linalg.norm(pg)
        out[f"update_norm({path})"] = jnp.linalg.norm(u)
    return out
