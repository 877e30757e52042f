"""The non-finite guard, its counters, the divergence check, and their report on the host.

A non-finite preconditioned gradient (singular curvature with zero damping), coefficient or
loss (a NaN example, out-of-range labels, whose gradient may still be finite) must not reach
the parameters: the update is skipped (parameters unchanged, velocity reset to zero) and
counted. Non-finite statistics are dropped by ``curvax.step.statistics`` and counted here too.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from curvax import utils

logger = logging.getLogger("curvax")

# A finite loss this many times larger in magnitude than the first finite loss (or than 1) is
# reported as diverging (``stats["loss_diverged"]`` and a warning in the "curvax" log).
DIVERGENCE_FACTOR = 1e3
# How many steps' reports may wait for their device results before the oldest is waited for.
REPORT_BACKLOG = 8


def update_is_finite(precon: Any, grads: Any, coeffs: jax.Array, loss: jax.Array) -> jax.Array:
    """One scalar: the preconditioned gradient (through ``precon^T grads``), the coefficients
    and the loss are all finite."""
    return jnp.isfinite(utils.inner_product(precon, grads)) & jnp.all(jnp.isfinite(coeffs)) & jnp.isfinite(loss)


def guarded_update(finite: jax.Array, coeffs: jax.Array, precon: Any, velocities: Any) -> tuple[jax.Array, Any]:
    """``(coeffs, delta)`` with ``delta = coeffs[0] * precon + coeffs[1] * velocities``; both
    zero unless ``finite``. Each leaf keeps its dtype (the coefficients may be wider than
    float32 weights when the data are float64)."""
    coeffs = jnp.where(finite, coeffs, 0.0)

    def combine(ops: tuple) -> Any:
        c, p, v = ops
        return jax.tree_util.tree_map(lambda a, b: (c[0] * a + c[1] * b).astype(jnp.result_type(a)), p, v)

    # A conditional rather than a select per leaf: see ``curvax.estimators.keep_finite_statistics``.
    zeros = lambda ops: jax.tree_util.tree_map(lambda a: jnp.zeros(jnp.shape(a), jnp.result_type(a)), ops[1])
    return coeffs, jax.lax.cond(finite, combine, zeros, (coeffs, precon, velocities))


def zero_unless_finite(precon: Any, updates: Any) -> Any:
    """``precon``, or zeros when ``precon^T updates`` is not finite (the Optax path's guard)."""
    finite = jnp.isfinite(utils.inner_product(precon, updates))
    return jax.lax.cond(finite, lambda p: p, lambda p: jax.tree_util.tree_map(jnp.zeros_like, p), precon)


def count(counter: Any, skipped: jax.Array) -> Any:
    """A running count of skips plus this one (``counter`` None: not counted, stays None)."""
    if counter is None:
        return None
    return counter + skipped.astype(jnp.int32)


def divergence(first_loss: jax.Array, loss: Any) -> tuple[jax.Array, jax.Array]:
    """``(first_loss, diverged)``: the first finite loss so far (NaN before) and whether ``loss``
    is finite but more than ``DIVERGENCE_FACTOR`` times its magnitude (at least 1). A report only."""
    loss32 = jnp.asarray(loss, jnp.float32)
    first_loss = jnp.where(jnp.isnan(first_loss) & jnp.isfinite(loss32), loss32, first_loss)
    diverged = jnp.isfinite(loss32) & (
        jnp.abs(loss32) > DIVERGENCE_FACTOR * jnp.maximum(jnp.abs(jnp.nan_to_num(first_loss)), 1.0)
    )
    return first_loss, diverged


# The stats a report reads: the step and its loss, then the flags ``flags_word`` packs.
REPORT_KEYS = (
    "step", "loss", "update_skipped", "curvature_update_skipped", "loss_diverged", "learning_rate_invalid",
    "momentum_invalid", "damping_invalid",
)


def flags_word(stats: Mapping[str, Any]) -> jax.Array:
    """The report's flags (``REPORT_KEYS[2:]``) as the bits of one int32, computed in the step so
    that the host reads one number per step, not six (each read is a device transfer)."""
    word = jnp.zeros((), jnp.int32)
    for bit, key in enumerate(REPORT_KEYS[2:]):
        if key in stats:
            word = word | (jnp.asarray(stats[key]).astype(jnp.int32) << bit)
    return word


class Reporter:
    """Logs a warning for each step whose update or statistics were skipped, or whose loss diverged.

    Host-side. The flags are read only once computed (``jax.Array.is_ready``), so reporting
    never waits for the device: a step's line appears at a later call (at most
    ``REPORT_BACKLOG`` steps later, when the oldest is waited for). Given the step's
    ``flags_word``, a step reads that one number, and the rest only when a flag is set.
    """

    KEYS = REPORT_KEYS

    def __init__(self) -> None:
        self._pending: collections.deque = collections.deque()

    def __call__(self, stats: Mapping[str, Any], flags: Any = None) -> None:
        """Queues ``stats`` (a step's stats dict; ``flags``: its ``flags_word``, if computed) and
        logs every queued step whose flags are ready."""
        values = tuple(stats.get(k, False) for k in self.KEYS)
        watched = values if flags is None else (flags,)
        if any(isinstance(a, jax.core.Tracer) for a in watched):
            return  # ``step`` traced inside the user's own jit: there is nothing to read on the host
        self._pending.append((watched, values, flags))
        while self._pending:
            watched, values, flags = self._pending[0]
            if len(self._pending) <= REPORT_BACKLOG and not all(
                not hasattr(a, "is_ready") or a.is_ready() for a in watched
            ):
                break
            self._pending.popleft()
            if flags is not None and not np.asarray(flags).reshape(-1)[0]:
                continue  # nothing to report: the other values are not read
            self._log(*(np.asarray(a).reshape(-1)[0] for a in values))

    @staticmethod
    def _log(
        step: Any, loss: Any, skipped: Any, curv_skipped: Any, diverged: Any, bad_lr: Any = False, bad_mom: Any = False,
        bad_damp: Any = False,
    ) -> None:
        invalid = [name for flag, name in ((bad_lr, "learning_rate"), (bad_mom, "momentum"), (bad_damp, "damping")) if flag]
        why = (
            f"{', '.join(invalid)} out of range (not finite{', or negative damping' if bad_damp else ''})"
            if invalid else "non-finite loss, gradient or update"
        )
        what = [
            text for flag, text in (
                (skipped, f"update skipped ({why}; parameters unchanged)"),
                (curv_skipped, "curvature statistics update skipped (non-finite or invalid batch; previous statistics kept)"),
                (diverged, f"loss diverging (more than {DIVERGENCE_FACTOR:g}x the first loss)"),
            ) if flag
        ]
        if what:
            logger.warning("curvax step %d (loss %s): %s.", int(step), float(loss), "; ".join(what))
