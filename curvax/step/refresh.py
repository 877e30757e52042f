"""The inverse refresh: recomputing the blocks' cached (damped) inverses or eigenbases.

``refresh_cache`` is the one place that calls the estimator's ``update_cache``; the schedules
(periodic, every step, staggered over the period) are built on it.
"""

from __future__ import annotations

from typing import Any

import jax

from curvax.step.precondition import block_norm_kwargs


def cache_powers(period: int, use_exact_inverses: bool) -> tuple[Any, Any]:
    """``(exact_powers, approx_powers)`` to cache: the inverse, exact or approximate, when
    refreshed every ``period > 1`` steps; nothing with 1 (powers come from the statistics)."""
    if period == 1:
        return None, None
    return (-1, None) if use_exact_inverses else (None, -1)


def refresh_cache(
    estimator: Any, state: Any, identity_weight: Any, exact_powers: Any, approx_powers: Any, distribution: Any = None,
    block_norm: str | None = None,
) -> Any:
    """Every block's cache recomputed from its statistics, with ``identity_weight`` as damping.

    ``distribution`` (a ``curvax.distributed.Distribution``, or None) splits the blocks' work
    over the devices and shares the results. ``block_norm`` (a norm name, or None) multiplies
    each block's damping by its norm (``norm_to_scale_identity_weight_per_block``)."""
    extra = {} if distribution is None else {"distribution": distribution}
    extra.update(block_norm_kwargs(block_norm))
    return estimator.update_cache(state, identity_weight, exact_powers, approx_powers, False, **extra)


def refresh_when(
    estimator: Any, state: Any, due: Any, identity_weight: Any, exact_powers: Any, approx_powers: Any,
    distribution: Any = None, block_norm: str | None = None,
) -> Any:
    """``refresh_cache`` when ``due`` (a Python bool, or a traced boolean: a ``lax.cond``)."""
    if due is True:
        return refresh_cache(estimator, state, identity_weight, exact_powers, approx_powers, distribution, block_norm)
    if due is False:
        return state
    return jax.lax.cond(
        due, lambda s: refresh_cache(estimator, s, identity_weight, exact_powers, approx_powers, distribution, block_norm),
        lambda s: s, state,
    )


def refresh(
    estimator: Any, state: Any, step: jax.Array, period: int, identity_weight: Any, exact_powers: Any,
    approx_powers: Any, staggered: bool = False, distribution: Any = None, block_norm: str | None = None,
) -> Any:
    """The refresh due at ``step``: every block at multiples of ``period`` (every step for 1),
    or with ``staggered`` each block at its own phase of the period (``refresh_phases``)."""
    if staggered:
        # One compiled step serves every phase; each block's refresh sits in its own conditional.
        return estimator.update_cache_staggered(
            state, step, period, identity_weight, exact_powers, approx_powers, False, **block_norm_kwargs(block_norm)
        )
    due = True if period == 1 else step % period == 0
    return refresh_when(estimator, state, due, identity_weight, exact_powers, approx_powers, distribution, block_norm)
