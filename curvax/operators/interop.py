"""``lineax`` interop: curvature operators as ``lineax.AbstractLinearOperator``s, and CG solves.

``lineax`` is an optional extra (``pip install curvax[lineax]``): the operators need nothing from it,
and it is imported only when these functions are called. The pattern for an exact-curvature
solve preconditioned by K-FAC::

    G = curvax.operators.ggn(loss, params, batch)               # matrix-free, exact
    P = curvax.operators.from_estimator(est, state).inverse(d, exact=False)
    x = curvax.operators.solve(G, b, damping=d, preconditioner=P)   # (G + d I) x = b by CG
"""

from __future__ import annotations

from typing import Any

import math

import jax
import jax.numpy as jnp
import numpy as np

from curvax.operators.base import CurvatureOperator, check_damping, is_concrete, is_static_zero


def default_tolerance(dtype: Any) -> float:
    """``solve``'s default ``rtol`` and ``atol`` for an operator of ``dtype``.

    ``1e-10`` in float64; ``sqrt(eps)`` in lower precisions (float32: ``3.45e-4``, bfloat16 /
    float16: ``0.088`` / ``0.031``). CG's residual stalls a few ulps above ``eps``: a tolerance
    near or below ``eps`` (float32's ``1.2e-7``, so ``1e-10``) is never met and ends in lineax's
    "non-finite output" error; ``sqrt(eps)`` leaves a wide margin above the stall.
    """
    eps = float(jnp.finfo(dtype).eps)
    return 1e-10 if eps <= float(np.finfo(np.float64).eps) else math.sqrt(eps)


def _check_tolerance(value: Any, name: str, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"`{name}` must be a non-negative float, got {value!r}.")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"`{name}` must be a finite number >= 0, got {v!r}.")
    return v


def _lineax() -> Any:
    try:
        import lineax
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("curvax.operators.to_lineax needs lineax: `pip install curvax[lineax]` (or `pip install lineax`).") from e
    return lineax


def to_lineax(operator: CurvatureOperator, flat: bool = False) -> Any:
    """``operator`` as a ``lineax.FunctionLinearOperator`` (tagged symmetric / PSD when it is).

    ``flat=False`` acts on parameter pytrees (lineax handles pytrees), ``flat=True`` on flat vectors.
    """
    lx = _lineax()
    if not isinstance(operator, CurvatureOperator):
        raise TypeError(f"`operator` must be a curvax.operators.CurvatureOperator, got {type(operator).__name__}.")
    if flat:
        structure = jax.ShapeDtypeStruct((operator.dim,), operator.dtype)
        fn = operator._matvec_flat
    else:
        structure = operator.space.template()
        fn = operator._matvec_tree
    tags = []
    if operator.is_symmetric:
        tags.append(lx.symmetric_tag)
        if operator.is_psd:
            tags.append(lx.positive_semidefinite_tag)
    return lx.FunctionLinearOperator(fn, structure, tags=tuple(tags))


def solve(
    operator: CurvatureOperator, vector: Any, damping: Any = 0.0, preconditioner: CurvatureOperator | None = None,
    rtol: float | None = None, atol: float | None = None, max_steps: int | None = None, return_stats: bool = False,
) -> Any:
    """``(K + damping I)^-1 vector`` by conjugate gradients (``lineax.CG``), matrix-free.

    ``vector`` is a parameter pytree or a flat vector (the result has the same form). A
    ``preconditioner`` approximates ``(K + damping I)^-1`` (e.g. a K-FAC ``inverse(exact=False)``).
    ``rtol``/``atol``: lineax's stopping rule, ``|r_i| <= atol + rtol |b_i|`` for the residual
    ``r``; by default ``default_tolerance(K.dtype)`` (``1e-10`` in float64, ``sqrt(eps)`` =
    ``3.45e-4`` in float32). With ``return_stats`` also returns lineax's statistics
    (``num_steps``). When the values are concrete (not under ``jit``) and CG fails (a tolerance
    below what the dtype reaches, or ``max_steps``), a ``RuntimeError`` names ``rtol``/``max_steps``.
    """
    lx = _lineax()
    if not isinstance(operator, CurvatureOperator):
        raise TypeError(f"`operator` must be a curvax.operators.CurvatureOperator, got {type(operator).__name__}.")
    default = default_tolerance(operator.dtype)
    rtol = _check_tolerance(rtol, "rtol", default)
    atol = _check_tolerance(atol, "atol", default)
    if preconditioner is not None and not isinstance(preconditioner, CurvatureOperator):
        raise TypeError(f"`preconditioner` must be a curvax.operators.CurvatureOperator, got {type(preconditioner).__name__}.")
    if preconditioner is not None and preconditioner.space != operator.space:
        raise ValueError("`preconditioner` acts on other parameters than `operator`.")
    d = check_damping(damping)
    op = operator if is_static_zero(d) else operator.damped(d)
    if not (op.is_symmetric and op.is_psd):
        raise ValueError("`operator` (+ damping) must be symmetric positive semi-definite for CG; the Hessian is not.")
    flat = not operator.space.matches(vector)
    if flat and tuple(getattr(vector, "shape", ())) != (operator.dim,):
        raise ValueError(
            f"`vector` must be a parameter pytree {operator.space.treedef} or a flat array of shape ({operator.dim},), "
            f"got {jax.tree_util.tree_structure(vector)} with shapes {[getattr(x, 'shape', None) for x in jax.tree_util.tree_leaves(vector)]}."
        )
    options = {}
    if preconditioner is not None:
        options["preconditioner"] = to_lineax(preconditioner, flat=flat)
    solver = lx.CG(rtol=rtol, atol=atol, max_steps=max_steps)
    concrete = is_concrete((op, vector, preconditioner))
    sol = lx.linear_solve(to_lineax(op, flat=flat), vector, solver=solver, options=options, throw=not concrete)
    if concrete and sol.result != lx.RESULTS.successful:
        why = lx.RESULTS[sol.result].strip().split(". ")[0]
        raise RuntimeError(
            f"CG did not converge ({why}) with `rtol`={rtol:g}, `atol`={atol:g} in "
            f"{jnp.dtype(operator.dtype).name}, `max_steps`={max_steps}: the tolerance may be below what the dtype "
            f"reaches (default_tolerance gives {default:g}), or the system too ill-conditioned; pass a larger `rtol`/`atol`, "
            "`damping` or `max_steps`, or a `preconditioner`."
        )
    return (sol.value, sol.stats) if return_stats else sol.value
