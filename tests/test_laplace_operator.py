"""``curvax.laplace.posterior``: the Laplace posterior of a curvature operator against the dense
posterior covariance ``(N K + alpha I)^-1`` on a small float64 model (K-FAC and exact GGN)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax
from curvax import laplace
from curvax import operators as ops

pytestmark = pytest.mark.usefixtures("x64")


def _loss(params: Any, batch: Any) -> jax.Array:
    x, y = batch
    logits = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] * params["temperature"]
    curvax.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(-jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 3), axis=-1))


@functools.lru_cache(maxsize=None)
def _problem() -> tuple:
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k[0], (4, 5)) / 2, "b1": 0.1 * jnp.ones(5),
              "w2": jax.random.normal(k[1], (5, 3)) / 2, "temperature": jnp.asarray(1.3)}
    batch = (jax.random.normal(k[2], (40, 4)), jax.random.randint(k[3], (40,), 0, 3))
    est = curvax.BlockDiagonalCurvature(_loss)
    state = est.init(jax.random.PRNGKey(1), (params, batch), None, None)
    state = jax.jit(lambda s: est.update_curvature_matrix_estimate(
        s, 0.0, 1.0, 40, jax.random.PRNGKey(2), (params, batch), estimation_mode="fisher_exact"))(state)
    return est, state, params, batch


def _posterior_quantities(post: Any, key: jax.Array) -> dict:
    return {"cov": post.covariance().to_dense(), "root": post.covariance_sqrt().to_dense(),
            "prec": post.precision().to_dense(), "logdet": post.log_determinant(),
            "var": ravel_pytree(post.marginal_variances())[0], "one": ravel_pytree(post.sample(key))[0],
            "many": jax.vmap(lambda t: ravel_pytree(t)[0])(post.sample(key, 3)), "lml": post.log_marginal_likelihood(0.7)}


@pytest.mark.parametrize("kind", ["kfac", "ggn"])
def test_posterior_of_an_operator_equals_the_dense_posterior(kind):
    est, state, params, batch = _problem()
    if kind == "kfac":
        K = ops.from_estimator(est, state)  # its to_dense() is est.to_dense_matrix(state) (test_operators)
    else:
        K = ops.ggn(_loss, params, batch)
    dense = np.asarray(K.to_dense())
    n, alpha = 500, 0.3
    post = laplace.posterior(K, params, num_data=n, prior_precision=alpha)
    key = jax.random.PRNGKey(5)
    got = jax.jit(_posterior_quantities)(post, key)
    flat, _ = ravel_pytree(params)
    dim = flat.size
    h = n * dense + alpha * np.eye(dim)
    cov = np.linalg.inv(h)
    np.testing.assert_allclose(got["prec"], h, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(got["cov"], cov, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(got["root"] @ got["root"].T, cov, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(got["root"], got["root"].T, atol=1e-12)  # the symmetric root
    np.testing.assert_allclose(got["logdet"], np.linalg.slogdet(h)[1], rtol=1e-10)
    np.testing.assert_allclose(got["var"], np.diag(cov), rtol=1e-8)
    # samples: mean + H^-1/2 z with z the documented standard normal draws
    z = np.asarray(jax.random.normal(key, (dim,)))
    np.testing.assert_allclose(got["one"], flat + got["root"] @ z, rtol=1e-10, atol=1e-12)
    zs = np.asarray(jax.random.normal(key, (dim, 3)))
    np.testing.assert_allclose(got["many"], (flat[:, None] + got["root"] @ zs).T, rtol=1e-10, atol=1e-12)
    want_lml = -n * 0.7 + 0.5 * dim * np.log(alpha) - 0.5 * alpha * float(flat @ flat) - 0.5 * np.linalg.slogdet(h)[1]
    np.testing.assert_allclose(got["lml"], want_lml, rtol=1e-10)
    if kind == "kfac":  # the same numbers as the estimator-based functions
        np.testing.assert_allclose(got["lml"], laplace.log_marginal_likelihood(est, state, params, 0.7, n, alpha), rtol=1e-10)
        np.testing.assert_allclose(got["logdet"], laplace.log_determinant(est, state, alpha, scale=n), rtol=1e-10)


def test_posterior_prior_precision_gradient_and_bad_input():
    est, state, params, _ = _problem()
    K = ops.from_estimator(est, state)
    dense = np.asarray(K.to_dense())
    ev = np.linalg.eigvalsh(dense)
    n = 500

    def lml(log_alpha: jax.Array) -> jax.Array:
        return laplace.posterior(K, params, n, jnp.exp(log_alpha)).log_marginal_likelihood(0.7)

    # d/d log(alpha) of the evidence: dim/2 - alpha |theta|^2 / 2 - alpha/2 tr((N C + alpha I)^-1)
    a = 0.3
    flat = ravel_pytree(params)[0]
    want = 0.5 * len(ev) - 0.5 * a * float(flat @ flat) - 0.5 * a * np.sum(1 / (n * ev + a))
    np.testing.assert_allclose(jax.grad(lml)(jnp.log(a)), want, rtol=1e-8)
    with pytest.raises(TypeError, match="`curvature`"):
        laplace.posterior(est, params, n, 1.0)
    with pytest.raises(ValueError, match="`params`"):
        laplace.posterior(K, {"w1": params["w1"]}, n, 1.0)
    with pytest.raises(ValueError, match="`num_data`"):
        laplace.posterior(K, params, 0, 1.0)
    with pytest.raises(ValueError, match="`prior_precision`"):
        laplace.posterior(K, params, n, -1.0)
    with pytest.raises(ValueError, match="`num_samples`"):
        laplace.posterior(K, params, n, 1.0).sample(jax.random.PRNGKey(0), 0)
