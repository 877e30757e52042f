"""Uses of a curvature operator: influence functions and Optimal Brain Surgeon pruning.

Both need ``(K + damping I)^-1`` applied to a few vectors, which every curvax operator gives
through ``K.inverse(damping, exact=...)`` (closed form, block by block, for ``from_estimator``
operators; the dense inverse for the exact operators up to ``DENSE_FALLBACK_LIMIT`` parameters)
or, matrix-free, through conjugate gradients (``method="cg"``, ``curvax.operators.solve``).

* ``influence_scores``: ``-g_test^T (K + damping I)^-1 g_i`` for every training example ``i``
  (Koh & Liang, 2017): the first-order change of the test loss when example ``i`` is up-weighted
  by ``epsilon`` is ``epsilon * score_i``, so removing it (``epsilon = -1/n``) changes the test
  loss by about ``-score_i / n``. One inverse product (of the test gradient) serves all examples.
* ``obs_saliencies`` / ``obs_update``: Optimal Brain Surgeon (Hassibi & Stork, 1993): removing
  weight ``q`` costs ``w_q^2 / (2 [(K + damping I)^-1]_qq)`` under the quadratic model, and the
  best compensating update is ``-w_q / [(K + damping I)^-1]_qq (K + damping I)^-1 e_q``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from curvax.operators.base import CurvatureOperator, check_damping

Array = jax.Array

INVERSE_METHODS = ("inverse", "cg")
"""``method`` values of ``influence_scores``: the operator's own inverse, or conjugate gradients."""


def _check_operator(operator: Any, name: str = "operator") -> CurvatureOperator:
    if not isinstance(operator, CurvatureOperator):
        raise TypeError(f"`{name}` must be a curvax.operators.CurvatureOperator, got {type(operator).__name__}.")
    return operator


def _as_flat(operator: CurvatureOperator, v: Any, name: str) -> Array:
    """A parameter pytree or flat vector as a flat vector of length ``operator.dim``."""
    if operator.space.matches(v):
        return operator.space.flatten(v)
    if hasattr(v, "shape") and tuple(np.shape(v)) == (operator.dim,):
        return jnp.asarray(v)
    raise ValueError(
        f"`{name}` must be a parameter pytree {operator.space.treedef} with leaf shapes {list(operator.space.shapes)} "
        f"or a flat array of shape ({operator.dim},), got {jax.tree_util.tree_structure(v)} with leaf shapes "
        f"{[np.shape(x) for x in jax.tree_util.tree_leaves(v)]}."
    )


def per_example_gradients(loss_fn: Callable[..., Any], params: Any, batch: Any, batch_axis: int = 0) -> Any:
    """The gradient of ``loss_fn(params, example)`` for every example of ``batch`` (``vmap(grad)``).

    ``loss_fn`` takes one example (``batch`` with its ``batch_axis`` removed from every leaf)
    and returns a scalar. Returns a parameter pytree whose leaves have a leading axis of size
    ``n`` (the number of examples): the per-example gradients ``influence_scores`` expects.
    """
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable as loss_fn(params, example), got {type(loss_fn).__name__}.")
    sizes = {np.shape(x)[batch_axis] for x in jax.tree_util.tree_leaves(batch) if np.ndim(x) > batch_axis}
    if len(sizes) != 1:
        raise ValueError(f"`batch` leaves must share one size along `batch_axis`={batch_axis}, got sizes {sorted(sizes)}.")
    return jax.vmap(jax.grad(loss_fn), in_axes=(None, batch_axis))(params, batch)


def _flat_rows(operator: CurvatureOperator, grads: Any) -> Array:
    """Per-example gradients (pytree with a leading example axis, or an ``(n, dim)`` array) as ``(n, dim)``."""
    if hasattr(grads, "shape") and np.ndim(grads) == 2 and np.shape(grads)[1] == operator.dim:
        return jnp.asarray(grads)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    shapes = tuple(tuple(np.shape(x)[1:]) for x in leaves)
    ns = {np.shape(x)[0] for x in leaves if np.ndim(x) >= 1}
    if treedef != operator.space.treedef or shapes != operator.space.shapes or len(ns) != 1:
        raise ValueError(
            f"`train_grads` must be the parameters' pytree {operator.space.treedef} with a leading example axis on every "
            f"leaf (leaf shapes (n, *{list(operator.space.shapes)})), or an array of shape (n, {operator.dim}); got "
            f"{treedef} with leaf shapes {[np.shape(x) for x in leaves]}."
        )
    n = ns.pop()
    return jnp.concatenate([jnp.reshape(x, (n, -1)).astype(operator.dtype) for x in leaves], axis=1)


def inverse_product(
    operator: CurvatureOperator, vector: Any, damping: Any = 0.0, method: str = "inverse", exact: bool = True,
    **solve_kwargs: Any,
) -> Array:
    """``(K + damping I)^-1 v`` as a flat vector (``method`` in ``INVERSE_METHODS``).

    ``"inverse"`` applies ``K.inverse(damping, exact=exact)`` (``exact=False``: the pi-adjusted
    K-FAC inverse); ``"cg"`` solves by conjugate gradients (``curvax.operators.solve``, needs
    ``lineax``; ``solve_kwargs`` go to it).
    """
    _check_operator(operator)
    if method not in INVERSE_METHODS:
        raise ValueError(f"`method` must be one of {list(INVERSE_METHODS)}, got {method!r}.")
    if not isinstance(damping, tuple):
        damping = check_damping(damping)
    flat = _as_flat(operator, vector, "vector")
    if method == "cg":
        from curvax.operators.interop import solve

        return solve(operator, flat, damping=damping, **solve_kwargs)
    return operator.inverse(damping, exact=exact) @ flat


def influence_scores(
    operator: CurvatureOperator, train_grads: Any, test_grad: Any, damping: Any = 0.0, method: str = "inverse",
    exact: bool = True, **solve_kwargs: Any,
) -> Array:
    """Influence of every training example on a test point: ``-g_test^T (K + damping I)^-1 g_i``.

    ``operator`` is ``K`` (any curvax operator: ``from_estimator``, ``ggn``, ``fisher``, ``hessian``,
    sums ...); ``train_grads`` the per-example training gradients (``per_example_gradients``: a
    parameter pytree with a leading example axis, or an ``(n, dim)`` array); ``test_grad`` the test
    loss gradient (a parameter pytree or a flat vector). One product with ``(K + damping I)^-T``
    (of ``g_test``) then one ``(n, dim) @ (dim,)`` product give all ``n`` scores; nothing of size
    ``dim x dim`` is built unless the operator is dense. ``method``/``exact``/``solve_kwargs``: as
    in ``inverse_product``. Returns an ``(n,)`` array; removing example ``i`` changes the test loss
    by about ``-score_i / n`` (the mean training loss over ``n`` examples).
    """
    _check_operator(operator)
    rows = _flat_rows(operator, train_grads)
    op_t = operator if operator.is_symmetric else operator.T
    s = inverse_product(op_t, test_grad, damping, method, exact, **solve_kwargs)
    return -(rows @ s)


def obs_saliencies(operator: CurvatureOperator, params: Any, damping: Any = 0.0, exact: bool = True) -> Any:
    """Optimal Brain Surgeon saliencies ``w_q^2 / (2 [(K + damping I)^-1]_qq)``, as a parameter pytree.

    The increase of the quadratic model of the loss when weight ``q`` is set to zero and the other
    weights are updated optimally (``obs_update``). The inverse diagonal comes from
    ``K.inverse(damping, exact=exact).diagonal()``: closed form per block for ``from_estimator``
    operators (Kronecker blocks through their factors' eigendecompositions), dense for others.
    Prune the weights with the smallest saliencies.
    """
    _check_operator(operator)
    w = _as_flat(operator, params, "params")
    inv_diag = operator.inverse(damping, exact=exact).diagonal()
    return operator.space.unflatten(w**2 / (2 * inv_diag))


def obs_update(operator: CurvatureOperator, params: Any, q: int, damping: Any = 0.0, exact: bool = True) -> Any:
    """The Optimal Brain Surgeon update removing weight ``q``: ``-w_q / [(K+dI)^-1]_qq (K+dI)^-1 e_q``.

    ``q`` indexes the flat parameter vector (leaves in pytree order, each in C order; as
    ``operator.space.flatten``). Returns the update as a parameter pytree: ``params + update``
    has weight ``q`` exactly zero and minimises the quadratic model among such weights. Uses one
    product of the inverse (``K.inverse(damping, exact=exact)``) with ``e_q``.
    """
    _check_operator(operator)
    if isinstance(q, bool) or not isinstance(q, (int, np.integer)) or not 0 <= int(q) < operator.dim:
        raise ValueError(f"`q` must be an integer index in [0, {operator.dim}), got {q!r}.")
    w = _as_flat(operator, params, "params")
    col = operator.inverse(damping, exact=exact) @ jax.nn.one_hot(int(q), operator.dim, dtype=w.dtype)
    return operator.space.unflatten(-(w[int(q)] / col[int(q)]) * col)
