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

import jax

from curvax.operators.base import CurvatureOperator, check_damping, is_static_zero


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
    rtol: float = 1e-10, atol: float = 1e-10, max_steps: int | None = None, return_stats: bool = False,
) -> Any:
    """``(K + damping I)^-1 vector`` by conjugate gradients (``lineax.CG``), matrix-free.

    ``vector`` is a parameter pytree or a flat vector (the result has the same form). A
    ``preconditioner`` approximates ``(K + damping I)^-1`` (e.g. a K-FAC ``inverse(exact=False)``).
    With ``return_stats`` also returns lineax's statistics (``num_steps``).
    """
    lx = _lineax()
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
    sol = lx.linear_solve(to_lineax(op, flat=flat), vector, solver=solver, options=options)
    return (sol.value, sol.stats) if return_stats else sol.value
