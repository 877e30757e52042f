"""Learning rate and momentum: fixed, scheduled, or minimising the quadratic model.

The update is ``delta = w0 * precon + w1 * velocity`` (``w0 = -learning_rate``, ``w1 =
momentum``). The quadratic model of the loss change along ``span(v_i)`` is ``(A, D, b)`` with
``A_ij = v_i^T C v_j`` (``C`` the exact Fisher/GGN or the estimate), ``D_ij = v_i^T v_j`` and
``b_i = g^T v_i``; with the damping ``lambda`` and ``l2_reg`` it predicts ``1/2 w^T (A +
(l2_reg + lambda) D) w + b^T w``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from curvax import utils
from curvax.step.config import StepConfig, call_schedule
from curvax.step.precondition import curvature_product

QuadModel = tuple  # (A, D, b), see the module docstring


def fixed(learning_rate: Any, momentum: Any) -> jax.Array:
    """The coefficients ``(w0, w1) = (-learning_rate, momentum)`` of given values."""
    return jnp.stack([-learning_rate, momentum])


def schedule_value(schedule: Callable[..., Any] | None, given: jax.Array, step: jax.Array, data_seen: jax.Array) -> jax.Array:
    """The schedule's value at ``step`` (``config.call_schedule``: with ``data_seen`` where the
    schedule takes it), in ``utils.coefficient_dtype()``; the ``given`` value when there is none."""
    if schedule is None:
        return given
    return jnp.asarray(call_schedule(schedule, step, data_seen), utils.coefficient_dtype())


def exact_quad_model(
    deps_jvp: Callable[[Any], Any], losses: Sequence[Any], vectors: Sequence[Any], grads: Any, batch_size: Any,
    kind: str, axis: str | None = None,
) -> QuadModel:
    """``(A, D, b)`` with the exact curvature of a linearized pass (``curvax.step.forward``).

    ``kind`` is ``"ggn"`` or ``"fisher"`` (each loss's ``multiply_<kind>``); ``A`` is the mean
    over the batch's ``batch_size`` examples, averaged over the pmap ``axis`` when given.
    """
    jvs = [deps_jvp(v) for v in vectors]
    n = len(vectors)
    rows = []
    for i in range(n):
        row = []
        for j in range(n):
            total = 0.0
            for li, loss in enumerate(losses):
                prod = getattr(loss, f"multiply_{kind}")(jvs[j][li])
                total = total + sum(jnp.sum(utils.widen_half(a) * utils.widen_half(b)) for a, b in zip(jvs[i][li], prod))
            row.append(total / batch_size)
        rows.append(row)
    a = jnp.array(rows)
    a = utils.pmean_if_pmap(a, axis)  # multi_device: each device saw its share of the batch
    return a, utils.matrix_of_inner_products(vectors), utils.vector_of_inner_products(grads, vectors)


def approx_quad_model(estimator: Any, estimator_state: Any, vectors: Sequence[Any], grads: Any) -> QuadModel:
    """``(A, D, b)`` with the (undamped) block-diagonal estimate in ``estimator_state`` as ``C``."""
    cvs = [curvature_product(estimator, estimator_state, v, 0.0, True, False) for v in vectors]
    a = jnp.array([[utils.inner_product(vi, cj) for cj in cvs] for vi in vectors])
    return a, utils.matrix_of_inner_products(vectors), utils.vector_of_inner_products(grads, vectors)


def _safe_divide(num: jax.Array, den: jax.Array) -> jax.Array:
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def solve(
    quad: QuadModel, l2_reg: float, damping: Any, learning_rate: Any, momentum: Any, adaptive_lr: bool,
    adaptive_momentum: bool,
) -> jax.Array:
    """``(w0, w1)`` minimising the damped model over the adaptive coefficients, the others given.

    Both adaptive: the 2x2 solve (``w1 = 0`` when the model is degenerate, e.g. the first step's
    zero velocity). One adaptive: a scalar minimisation with the other fixed (``w0 =
    -learning_rate``, ``w1 = momentum``); a non-positive curvature gives 0.
    """
    a, d, b = quad
    ad = a + (l2_reg + damping) * d
    if adaptive_lr and adaptive_momentum:
        w0_only = _safe_divide(-b[0], ad[0, 0])
        det = ad[0, 0] * ad[1, 1] - ad[0, 1] * ad[1, 0]
        w_full = jnp.stack([(-b[0] * ad[1, 1] + b[1] * ad[0, 1]), (-b[1] * ad[0, 0] + b[0] * ad[1, 0])])
        w_full = w_full / jnp.where(det > 0, det, 1.0)
        use_full = (d[1, 1] > 0) & (det > 0)
        return jnp.where(use_full, w_full, jnp.stack([w0_only, 0.0]))
    if adaptive_lr:
        w1 = momentum
        return jnp.stack([_safe_divide(-(b[0] + ad[1, 0] * w1), ad[0, 0]), w1])
    w0 = -learning_rate
    return jnp.stack([w0, _safe_divide(-(b[1] + ad[0, 1] * w0), ad[1, 1])])


def model_change(quad: QuadModel, coeffs: jax.Array, l2_reg: float, damping: Any, include_damping: bool) -> jax.Array:
    """The change of loss the model predicts for ``coeffs``: the ``l2_reg`` term always, the
    damping term ``damping/2 |delta|^2`` only with ``include_damping``."""
    a, d, b = quad
    a_hat = a + l2_reg * d + (damping * d if include_damping else 0.0)
    return 0.5 * coeffs @ a_hat @ coeffs + coeffs @ b


def choose(
    cfg: StepConfig, learning_rate: Any, momentum: Any, damping: Any, exact_model: Callable[[], QuadModel],
    approx_model: Callable[[], QuadModel], damping_due: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``(coeffs, quad_change)`` of a step.

    With an adaptive learning rate or momentum the exact model (``exact_model()``) chooses them
    and gives the predicted change; otherwise the coefficients are the given ones and the change
    is computed only where adaptive damping needs it (``damping_due``), from the exact model
    with ``always_use_exact_qmodel_for_damping_adjustment``, else from ``approx_model()``;
    NaN elsewhere.
    """
    nan = jnp.asarray(jnp.nan, jnp.float32)
    change = lambda quad, coeffs: model_change(quad, coeffs, cfg.l2_reg, damping, cfg.include_damping_in_quad_change)
    if cfg.adaptive_coefficients:
        quad = exact_model()
        coeffs = solve(quad, cfg.l2_reg, damping, learning_rate, momentum, cfg.adaptive_lr, cfg.adaptive_momentum)
        return coeffs, change(quad, coeffs)
    coeffs = fixed(learning_rate, momentum)
    if not cfg.adaptive_damping:
        return coeffs, nan
    model = exact_model if cfg.always_exact_qmodel else approx_model
    predicted = lambda: change(model(), coeffs)
    # NaN off the adapting steps, in the model's dtype (float64 when the data are float64).
    off = lambda: jnp.full((), jnp.nan, jax.eval_shape(predicted).dtype)
    return coeffs, jax.lax.cond(damping_due, predicted, off)
