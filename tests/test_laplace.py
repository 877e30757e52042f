"""``curvax.laplace``: log-determinants, posterior samples and the Laplace evidence.

Oracles: the estimator's dense matrix (``to_dense_matrix``) with ``jnp.linalg``; and Bayesian
linear regression, where the Laplace approximation with the exact GGN is exact, so the evidence
must equal ``log N(y; 0, X X^T / alpha + variance I)`` computed directly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import laplace

pytestmark = pytest.mark.usefixtures("x64")


def _mlp_loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = (h @ params["w2"]) * params["temperature"]  # a scale layer: a diagonal block
    curvax.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(-jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 3), axis=-1))


def _mlp_curvature(block: str = "kronecker") -> tuple[Any, Any, Any]:
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (4, 5)) / 2, "b1": 0.1 * jnp.ones(5),
        "w2": jax.random.normal(k[1], (5, 3)) / 2, "temperature": jnp.asarray(1.3),
    }
    batch = (jax.random.normal(k[2], (40, 4)), jax.random.randint(k[3], (40,), 0, 3))
    ctors = {"dense": curvax.DenseEigenvalueCorrected} if block == "ekfac" else None
    est = curvax.BlockDiagonalCurvature(_mlp_loss, layer_tag_to_block_ctor=ctors)
    state = est.init(jax.random.PRNGKey(1), (params, batch), None, None)
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 40, jax.random.PRNGKey(2), (params, batch),
                                                 estimation_mode="fisher_exact")
    return est, state, params


@pytest.mark.parametrize("block", ["kronecker", "ekfac"])
def test_log_determinant_equals_the_dense_one(block):
    est, state, _ = _mlp_curvature(block)
    dense = est.to_dense_matrix(state)
    n = dense.shape[0]
    dense_block = "DenseEigenvalueCorrected" if block == "ekfac" else "DenseTwoKroneckerFactored"
    assert [type(b).__name__ for b in est.blocks] == [dense_block, "ScaleAndShiftDiagonal", dense_block]
    for weight, scale in [(0.1, 1.0), (2.0, 40.0), (1e-3, 7.0)]:
        _, want = jnp.linalg.slogdet(scale * dense + weight * jnp.eye(n))
        got = laplace.log_determinant(est, state, weight, scale=scale)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_inverse_square_root_behind_sample_is_exact():
    """``sample`` maps noise through ``(s C + w I)^{-1/2}``; its square must be the inverse."""
    est, state, params = _mlp_curvature()
    dense = est.to_dense_matrix(state)
    n = dense.shape[0]
    weight, scale = 0.3, 20.0
    leaves, treedef = jax.tree_util.tree_flatten(params)
    sizes = [int(np.prod(np.shape(x))) for x in leaves]

    def as_tree(v: jax.Array) -> Any:
        parts = jnp.split(v, np.cumsum(sizes)[:-1])
        return jax.tree_util.tree_unflatten(treedef, [p.reshape(np.shape(x)) for p, x in zip(parts, leaves)])

    def root(v: jax.Array) -> jax.Array:
        out = est.multiply_matpower(state, as_tree(v), weight / scale, -0.5, True, False)
        return jnp.concatenate([jnp.ravel(x) for x in jax.tree_util.tree_leaves(out)]) * scale**-0.5

    m = jax.vmap(root, in_axes=1, out_axes=1)(jnp.eye(n))
    np.testing.assert_allclose(m, m.T, atol=1e-10)
    np.testing.assert_allclose(m @ m.T, jnp.linalg.inv(scale * dense + weight * jnp.eye(n)), rtol=1e-8, atol=1e-10)


def test_samples_have_the_posterior_covariance():
    est, state, params = _mlp_curvature()
    dense = est.to_dense_matrix(state)
    n = dense.shape[0]
    weight, scale = 0.5, 10.0
    draws = laplace.sample(est, state, jax.random.PRNGKey(3), weight, scale=scale, num_samples=40000)
    assert jax.tree_util.tree_structure(draws) == jax.tree_util.tree_structure(params)
    for d, p in zip(jax.tree_util.tree_leaves(draws), jax.tree_util.tree_leaves(params)):
        assert d.shape == (40000, *np.shape(p))
    flat = jnp.concatenate([d.reshape(40000, -1) for d in jax.tree_util.tree_leaves(draws)], axis=1)
    cov = flat.T @ flat / 40000
    want = jnp.linalg.inv(scale * dense + weight * jnp.eye(n))
    # Monte Carlo: entries within ~4 standard errors of sqrt(S_ii S_jj / 40000).
    tol = 4 * jnp.sqrt(jnp.outer(jnp.diag(want), jnp.diag(want)) / 40000) + 1e-12
    assert bool(jnp.all(jnp.abs(cov - want) < tol))
    one = laplace.sample(est, state, jax.random.PRNGKey(3), weight, scale=scale)
    again = laplace.sample(est, state, jax.random.PRNGKey(3), weight, scale=scale)
    for a, b in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(a, b)


def test_evidence_is_exact_for_bayesian_linear_regression():
    n, d, k, alpha = 30, 4, 2, 0.7
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    x = jax.random.normal(keys[0], (n, d))
    y = x @ jax.random.normal(keys[1], (d, k)) + 0.5 * jax.random.normal(keys[2], (n, k))

    def loss(params, batch):
        xb, yb = batch
        pred = xb @ params["w"]
        curvax.register_squared_error_loss(pred, yb)  # -log N(y; pred, 0.5 I) without its constant
        return jnp.mean(jnp.sum((pred - yb) ** 2, axis=-1))

    # The MAP under the N(0, I / alpha) prior: (2 X^T X + alpha I) w = 2 X^T y.
    w_map = jnp.linalg.solve(2 * x.T @ x + alpha * jnp.eye(d), 2 * x.T @ y)
    params = {"w": w_map}
    est = curvax.BlockDiagonalCurvature(loss)
    state = est.init(jax.random.PRNGKey(0), (params, (x, y)), None, None)
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, n, jax.random.PRNGKey(1), (params, (x, y)),
                                                 estimation_mode="ggn_exact")
    mean_nll = jnp.mean(jnp.sum((x @ w_map - y) ** 2, axis=-1)) + k * 0.5 * jnp.log(jnp.pi)
    got = laplace.log_marginal_likelihood(est, state, params, mean_nll, n, alpha)

    cov = x @ x.T / alpha + 0.5 * jnp.eye(n)
    _, logdet = jnp.linalg.slogdet(cov)
    want = sum(
        -0.5 * (y[:, j] @ jnp.linalg.solve(cov, y[:, j]) + logdet + n * jnp.log(2 * jnp.pi)) for j in range(k)
    )
    np.testing.assert_allclose(got, want, rtol=1e-10)
    # And the evidence prefers a prior precision near the data's scale to far-off ones.
    values = [float(laplace.log_marginal_likelihood(est, state, params, mean_nll, n, a)) for a in (1e-4, alpha)]
    assert values[1] > values[0]


def test_bad_input_names_the_argument():
    est, state, params = _mlp_curvature()
    with pytest.raises(ValueError, match="identity_weight"):
        laplace.log_determinant(est, state, 0.0)
    with pytest.raises(ValueError, match="scale"):
        laplace.sample(est, state, jax.random.PRNGKey(0), 1.0, scale=-1.0)
    with pytest.raises(ValueError, match="num_samples"):
        laplace.sample(est, state, jax.random.PRNGKey(0), 1.0, num_samples=0)
    with pytest.raises(ValueError, match="num_data"):
        laplace.log_marginal_likelihood(est, state, params, 0.1, 0, 1.0)
    with pytest.raises(ValueError, match="prior_precision"):
        laplace.log_marginal_likelihood(est, state, params, 0.1, 10, float("nan"))
    with pytest.raises(ValueError, match="params"):
        laplace.log_marginal_likelihood(est, state, {"w1": params["w1"]}, 0.1, 10, 1.0)
    with pytest.raises(TypeError, match="estimator"):
        laplace.log_determinant("not an estimator", state, 1.0)
    with pytest.raises(ValueError, match="init"):
        laplace.log_determinant(curvax.BlockDiagonalCurvature(_mlp_loss), state, 1.0)


def _diag_oracle(est: Any, state: Any, weight: float, scale: float) -> jax.Array:
    dense = est.to_dense_matrix(state)
    return jnp.diag(jnp.linalg.inv(scale * dense + weight * jnp.eye(dense.shape[0])))


def _flat(tree: Any) -> jax.Array:
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


@pytest.mark.parametrize("block", ["DenseTwoKroneckerFactored", "DenseEigenvalueCorrected", "DenseFull",
                                   "DenseDiagonal", "DenseTNT"])
def test_marginal_variances_equal_the_dense_inverse_diagonal(block):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (4, 5)) / 2, "b1": 0.1 * jnp.ones(5),
        "w2": jax.random.normal(k[1], (5, 3)) / 2, "temperature": jnp.asarray(1.3),
    }
    batch = (jax.random.normal(k[2], (40, 4)), jax.random.randint(k[3], (40,), 0, 3))
    est = curvax.BlockDiagonalCurvature(_mlp_loss, layer_tag_to_block_ctor={"dense": getattr(curvax, block)})
    state = est.init(jax.random.PRNGKey(1), (params, batch), None, None)
    for i in range(2):  # two updates: EKFAC's scalings then differ from K-FAC's eigenvalues
        state = est.update_curvature_matrix_estimate(state, 0.5, 1.0, 40, jax.random.PRNGKey(2 + i),
                                                     (params, batch), estimation_mode="fisher_gradients")
        state = est.update_cache(state, 0.1, None, None, False)  # EKFAC: a fresh eigenbasis
    assert type(est.blocks[0]).__name__ == block
    for weight, scale in [(0.1, 1.0), (2.0, 40.0)]:
        got = laplace.marginal_variances(est, state, weight, scale=scale)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)
        np.testing.assert_allclose(_flat(got), _diag_oracle(est, state, weight, scale), rtol=1e-9, atol=1e-12)


def test_marginal_variances_of_stacked_and_embedding_blocks():
    def loss(params, batch):
        ids, y = batch
        h = jnp.take(params["table"], ids, axis=0).sum(axis=1)

        def layer(h, wb):
            return jnp.tanh(h @ wb[0] + wb[1]), None

        h, _ = jax.lax.scan(layer, h, (params["ws"], params["bs"]))
        logits = h @ params["out"]
        curvax.register_softmax_cross_entropy_loss(logits, y)
        return jnp.mean(-jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 3), axis=-1))

    k = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {"table": jax.random.normal(k[0], (9, 4)), "ws": jax.random.normal(k[1], (2, 4, 4)) / 2,
              "bs": jnp.zeros((2, 4)), "out": jax.random.normal(k[2], (4, 3))}
    batch = (jax.random.randint(k[3], (30, 3), 0, 9), jax.random.randint(k[4], (30,), 0, 3))
    est = curvax.BlockDiagonalCurvature(loss)
    state = est.init(jax.random.PRNGKey(1), (params, batch), None, None)
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 30, jax.random.PRNGKey(2), (params, batch),
                                                 estimation_mode="fisher_exact")
    kinds = sorted(type(b).__name__ for b in est.blocks)
    assert kinds == ["DenseTwoKroneckerFactored", "EmbeddingKroneckerFactored", "StackedBlock"], kinds
    got = laplace.marginal_variances(est, state, 0.3, scale=30.0)
    np.testing.assert_allclose(_flat(got), _diag_oracle(est, state, 0.3, 30.0), rtol=1e-9, atol=1e-12)


def test_blocks_without_a_closed_form_stop_at_the_dense_limit(monkeypatch):
    from curvax import blocks

    est, state, _ = _mlp_curvature()
    monkeypatch.setattr(blocks, "DENSE_INVERSE_DIAGONAL_LIMIT", 4)
    embedding_like = blocks.CurvatureBlock._inverse_diagonal_unscaled  # the dense fallback
    with pytest.raises(NotImplementedError, match="limit of 4 parameters"):
        embedding_like(est.blocks[0], state.blocks_states[0], 1.0)
