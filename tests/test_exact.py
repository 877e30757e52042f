"""ExplicitExactCurvature and ImplicitExactCurvature against dense jax.jacobian/jax.hessian oracles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax

KEY = jax.random.PRNGKey(0)


pytestmark = pytest.mark.usefixtures("x64")


def model(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def problem(n=4):
    ks = jax.random.split(KEY, 5)
    params = {"w1": jax.random.normal(ks[0], (3, 4)), "b1": jax.random.normal(ks[1], (4,)), "w2": jax.random.normal(ks[2], (4, 3))}
    batch = (jax.random.normal(ks[3], (n, 3)), jax.random.randint(ks[4], (n,), 0, 3))

    def loss(p, b):
        logits = model(p, b[0])
        curvax.register_softmax_cross_entropy_loss(logits, b[1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b[1][:, None], axis=1))

    return loss, params, batch


def dense_ggn(params, x):
    flat, unravel = ravel_pytree(params)
    jac = jax.vmap(lambda xi: jax.jacobian(lambda f: model(unravel(f), xi[None])[0])(flat))(x)
    p = jax.nn.softmax(model(params, x))
    fl = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(p)
    return jnp.einsum("nkp,nkl,nlq->pq", jac, fl, jac) / x.shape[0]


def test_implicit_products_equal_dense_matrices():
    loss, params, batch = problem()
    imp = curvax.ImplicitExactCurvature(loss)
    flat, unravel = ravel_pytree(params)
    v = jax.random.normal(KEY, flat.shape)
    args = (params, batch)
    g = dense_ggn(params, batch[0])
    for mv in (imp.multiply_ggn, imp.multiply_fisher):
        np.testing.assert_allclose(ravel_pytree(mv(args, unravel(v)))[0], g @ v, rtol=1e-8)
    # Factor products: C v = factor(factor_transpose(v)).
    ft = imp.multiply_ggn_factor_transpose(args, unravel(v))
    np.testing.assert_allclose(ravel_pytree(imp.multiply_ggn_factor(args, ft))[0], g @ v, rtol=1e-8)
    # Hessian of the mean registered loss.
    hess = jax.hessian(lambda f: loss(unravel(f), batch))(flat)
    np.testing.assert_allclose(ravel_pytree(imp.multiply_hessian(args, unravel(v)))[0], hess @ v, rtol=1e-8)
    shapes, bs = imp.get_loss_inner_vector_shapes_and_batch_size(args, "ggn")
    assert shapes == ((4, 3),) and bs == 4
    assert imp.get_loss_input_shapes_and_batch_size(args) == (((((4, 3),),)), 4)


@pytest.mark.parametrize("mode", ["ggn_exact", "fisher_exact"])
def test_explicit_exact_equals_dense_matrix(mode):
    loss, params, batch = problem()
    est = curvax.ExplicitExactCurvature(loss)
    state = est.init(KEY, (params, batch))
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 4, KEY, (params, batch), estimation_mode=mode)
    np.testing.assert_allclose(est.to_dense_matrix(state), dense_ggn(params, batch[0]), rtol=1e-8, atol=1e-12)
    flat, unravel = ravel_pytree(params)
    v = jax.random.normal(KEY, flat.shape)
    got = ravel_pytree(est.multiply_inverse(state, unravel(v), 0.5, True, False))[0]
    np.testing.assert_allclose(got, np.linalg.solve(dense_ggn(params, batch[0]) + 0.5 * np.eye(len(v)), v), rtol=1e-6)
