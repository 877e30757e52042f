"""``curvax.operators.influence``: influence scores and Optimal Brain Surgeon against dense float64
oracles on a small MLP, and the leave-one-out identity of a linear least-squares model."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
import models
from curvax import operators as ops

pytestmark = pytest.mark.usefixtures("x64")


def _apply(p: Any, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _nll(logits: jax.Array, y: jax.Array) -> jax.Array:
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], axis=-1)[..., 0]


def _loss(p: Any, batch: Any) -> jax.Array:
    logits = _apply(p, batch[0])
    curvax.register_softmax_cross_entropy_loss(logits, batch[1])
    return jnp.mean(_nll(logits, batch[1]))


def _example_loss(p: Any, example: Any) -> jax.Array:
    return _nll(_apply(p, example[0]), example[1])


@functools.lru_cache(maxsize=None)
def _problem() -> tuple:
    p, batch = models.tanh_mlp_problem((3, 4, 2), 10, (0.5, 1.0))
    est, state = models.fisher_exact_estimate(_loss, p, batch)
    return p, batch, {"kfac": ops.from_estimator(est, state), "ggn": ops.ggn(_loss, p, batch)}


def _flat(tree: Any) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


def test_per_example_gradients_are_the_jacobian_of_the_per_example_losses():
    p, batch, _ = _problem()
    grads = ops.per_example_gradients(_example_loss, p, batch)
    jac = jax.jacobian(lambda q: jax.vmap(_example_loss, in_axes=(None, 0))(q, batch))(p)
    for g, j in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(jac)):
        np.testing.assert_allclose(g, j, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="batch_axis"):
        ops.per_example_gradients(_example_loss, p, (batch[0], batch[1][:3]))


@pytest.mark.parametrize("kind", ["kfac", "ggn"])
def test_influence_scores_equal_the_dense_formula(kind):
    p, batch, operators = _problem()
    K = operators[kind]
    grads = ops.per_example_gradients(_example_loss, p, batch)
    g_test = jax.grad(_example_loss)(p, (jnp.array([0.3, -1.0, 0.5]), jnp.array(1)))
    rows = np.stack([_flat(jax.tree_util.tree_map(lambda x, i=i: x[i], grads)) for i in range(10)])
    dense = np.asarray(K.to_dense())
    for lam in (1e-3, 0.7):
        want = -rows @ np.linalg.solve(dense + lam * np.eye(K.dim), _flat(g_test))
        got = ops.influence_scores(K, grads, g_test, damping=lam)
        assert got.shape == (10,)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    # flat inputs give the same scores; CG matches the closed form
    np.testing.assert_allclose(ops.influence_scores(K, jnp.asarray(rows), _flat(g_test), lam), want, rtol=1e-9, atol=1e-12)
    cg = ops.influence_scores(K, grads, g_test, damping=0.7, method="cg", rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(cg, want, rtol=1e-7, atol=1e-10)


def test_influence_of_least_squares_is_the_first_order_leave_one_out_change():
    """For ``L(w) = mean_i (x_i^T w + b - y_i)^2`` the exact GGN is the Hessian ``H``; removing example
    ``i`` moves the minimiser by ``dw_i = A^-1 z_i r_i / (1 - h_i)`` (Sherman-Morrison, ``A = Z^T Z``,
    ``z_i = (1, x_i)``, ``h_i = z_i^T A^-1 z_i``), whose first-order part ``A^-1 z_i r_i = H^-1 g_i / n``.
    So ``g_test^T dw_i (1 - h_i) = -score_i / n`` exactly, with the scores at ``damping -> 0``."""
    n, d = 12, 3
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((n, d)), rng.standard_normal((n, 1))

    def loss(p: Any, batch: Any) -> jax.Array:
        pred = batch[0] @ p["w"] + p["b"]
        curvax.register_squared_error_loss(pred, batch[1])
        return jnp.mean(jnp.sum((pred - batch[1]) ** 2, axis=-1))

    def fit(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
        z = np.hstack([np.ones((len(xs), 1)), xs])
        return np.linalg.lstsq(z, ys, rcond=None)[0][:, 0]

    theta = fit(x, y)
    p = {"b": jnp.asarray(theta[:1]), "w": jnp.asarray(theta[1:, None])}  # flat order: b, w
    batch = (jnp.asarray(x), jnp.asarray(y))
    K = ops.ggn(loss, p, batch)
    h_dense = jax.hessian(lambda t: loss({"b": t[:1], "w": t[1:, None]}, batch))(jnp.asarray(theta))
    np.testing.assert_allclose(K.to_dense(), h_dense, rtol=1e-12, atol=1e-12)  # GGN == Hessian here

    grads = ops.per_example_gradients(lambda q, e: loss(q, (e[0][None], e[1][None])), p, batch)
    x_test, y_test = rng.standard_normal((1, d)), rng.standard_normal((1, 1))
    g_test = jax.grad(loss)(p, (jnp.asarray(x_test), jnp.asarray(y_test)))
    scores = np.asarray(ops.influence_scores(K, grads, g_test, damping=0.0))

    z = np.hstack([np.ones((n, 1)), x])
    lev = np.einsum("ij,jk,ik->i", z, np.linalg.inv(z.T @ z), z)
    shifts = np.stack([fit(np.delete(x, i, 0), np.delete(y, i, 0)) - theta for i in range(n)])
    np.testing.assert_allclose(shifts @ _flat(g_test) * (1 - lev), -scores / n, rtol=1e-8, atol=1e-12)
    # the tiny-damping limit
    np.testing.assert_allclose(ops.influence_scores(K, grads, g_test, damping=1e-10), scores, rtol=1e-6)


@pytest.mark.parametrize("kind", ["kfac", "ggn"])
def test_obs_saliencies_and_update_equal_the_dense_formulas(kind):
    p, _, operators = _problem()
    K = operators[kind]
    w = _flat(p)
    lam = 1e-2
    m = np.asarray(K.to_dense()) + lam * np.eye(K.dim)
    inv = np.linalg.inv(m)
    sal = ops.obs_saliencies(K, p, damping=lam)
    assert jax.tree_util.tree_structure(sal) == jax.tree_util.tree_structure(p)
    np.testing.assert_allclose(_flat(sal), w**2 / (2 * np.diag(inv)), rtol=1e-9)
    for q in (0, 13, K.dim - 1):
        upd = ops.obs_update(K, p, q, damping=lam)
        delta = _flat(upd)
        np.testing.assert_allclose(delta, -w[q] / inv[q, q] * inv[:, q], rtol=1e-9, atol=1e-12)
        assert abs(w[q] + delta[q]) < 1e-12  # weight q is removed
        # the quadratic model's increase is the saliency
        np.testing.assert_allclose(0.5 * delta @ m @ delta, _flat(sal)[q], rtol=1e-9)


def test_obs_pi_adjusted_inverse_diagonal_matches_its_dense_matrix():
    p, _, operators = _problem()
    K = operators["kfac"]
    inv = np.asarray(K.inverse(0.1, exact=False).to_dense())
    np.testing.assert_allclose(_flat(ops.obs_saliencies(K, p, 0.1, exact=False)), _flat(p) ** 2 / (2 * np.diag(inv)), rtol=1e-9)


def test_bad_input_errors_name_the_argument():
    p, batch, operators = _problem()
    K = operators["kfac"]
    grads = ops.per_example_gradients(_example_loss, p, batch)
    with pytest.raises(TypeError, match="`operator`"):
        ops.influence_scores(np.eye(3), grads, p)
    with pytest.raises(ValueError, match="`train_grads`"):
        ops.influence_scores(K, p, p, damping=0.1)  # no example axis
    with pytest.raises(ValueError, match="`vector`"):
        ops.influence_scores(K, grads, jnp.ones(5), damping=0.1)
    with pytest.raises(ValueError, match="`method`"):
        ops.influence_scores(K, grads, p, damping=0.1, method="lu")
    with pytest.raises(ValueError, match="`damping`"):
        ops.influence_scores(K, grads, p, damping=-1.0)
    with pytest.raises(ValueError, match="`q`"):
        ops.obs_update(K, p, K.dim, damping=0.1)
    with pytest.raises(ValueError, match="`params`"):
        ops.obs_saliencies(K, {"w": jnp.ones(3)}, damping=0.1)
