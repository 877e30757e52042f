"""BlockDiagonalCurvature against dense oracles built with jax.jacobian.

Convention under test: the loss is the batch mean of per-example losses, and
the estimated matrix is the curvature of that mean, (1/B) sum_n J_n^T M_n J_n.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax

KEY = jax.random.PRNGKey(0)


pytestmark = pytest.mark.usefixtures("x64")


def softmax_fisher(logits):
    p = jax.nn.softmax(logits)
    return jnp.diag(p) - jnp.outer(p, p)


def dense_layer(p, x):
    return x @ p["w"] + p["b"]


def deep_linear(p, x):
    for layer in p:
        x = x @ layer["w"] + layer["b"]
    return x


def make_softmax_problem(batch, d_in=3, d_out=4, seed=0):
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    params = {"w": jax.random.normal(k1, (d_in, d_out)), "b": jax.random.normal(k2, (d_out,))}
    x = jax.random.normal(k3, (batch, d_in))
    y = jax.random.randint(k4, (batch,), 0, d_out)

    def loss(p, b):
        logits = dense_layer(p, b[0])
        curvax.register_softmax_cross_entropy_loss(logits, b[1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b[1][:, None], axis=1))

    return loss, params, (x, y)


def exact_matrix(model, params, x, loss_matrix):
    """(1/B) sum_n J_n^T M(z_n) J_n with J_n the Jacobian of the n-th output."""
    flat, unravel = ravel_pytree(params)
    mats = []
    for n in range(x.shape[0]):
        z = lambda f: model(unravel(f), x[n : n + 1])[0]
        jac = jax.jacobian(z)(flat)
        mats.append(jac.T @ loss_matrix(z(flat)) @ jac)
    return sum(mats) / len(mats)


def estimate(loss, params, batch, mode, **kwargs):
    est = curvax.BlockDiagonalCurvature(loss, **kwargs)
    state = est.init(KEY, (params, batch))
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, batch[0].shape[0], KEY, (params, batch), estimation_mode=mode)
    return est, state


@pytest.mark.parametrize("mode", ["fisher_exact", "ggn_exact"])
def test_kfac_equals_exact_fisher_for_one_example(mode):
    loss, params, batch = make_softmax_problem(batch=1)
    est, state = estimate(loss, params, batch, mode)
    assert [type(b).__name__ for b in est.blocks] == ["DenseTwoKroneckerFactored"]
    want = exact_matrix(dense_layer, params, batch[0], softmax_fisher)
    np.testing.assert_allclose(est.to_dense_matrix(state), want, rtol=1e-6, atol=1e-10)


def test_full_block_is_the_exact_mean_fisher_over_a_batch():
    loss, params, batch = make_softmax_problem(batch=6)
    est, state = estimate(loss, params, batch, "fisher_exact", layer_tag_to_block_ctor={"dense": curvax.DenseFull})
    want = exact_matrix(dense_layer, params, batch[0], softmax_fisher)
    np.testing.assert_allclose(est.to_dense_matrix(state), want, rtol=1e-6, atol=1e-10)


def test_kronecker_equals_full_for_deep_linear_network_with_squared_error():
    """The "KF == full block" case, over batches of different sizes."""
    keys = jax.random.split(KEY, 8)
    params = [
        {"w": jax.random.normal(keys[0], (3, 4)), "b": jax.random.normal(keys[1], (4,))},
        {"w": jax.random.normal(keys[2], (4, 2)), "b": jax.random.normal(keys[3], (2,))},
    ]

    def loss(p, b):
        out = deep_linear(p, b[0])
        curvax.register_squared_error_loss(out, b[1])
        return jnp.mean(jnp.sum((out - b[1]) ** 2, -1))

    for bs in (1, 5, 9):
        batch = (jax.random.normal(keys[4], (bs, 3)), jax.random.normal(keys[5], (bs, 2)))
        est_kf, st_kf = estimate(loss, params, batch, "ggn_exact")
        est_full, st_full = estimate(loss, params, batch, "ggn_exact", layer_tag_to_block_ctor={"dense": curvax.DenseFull})
        kf, full = est_kf.to_dense_matrix(st_kf), est_full.to_dense_matrix(st_full)
        np.testing.assert_allclose(kf, full, rtol=1e-6, atol=1e-9)
        # And the full blocks are the diagonal blocks of the exact GGN (2 * J^T J for squared error).
        exact = exact_matrix(deep_linear, params, batch[0], lambda z: 2.0 * jnp.eye(z.shape[-1]))
        mask = np.asarray(full) != 0
        np.testing.assert_allclose(np.where(mask, exact, 0.0), full, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("mode", ["fisher_gradients", "fisher_curvature_prop", "ggn_curvature_prop"])
def test_stochastic_modes_converge_to_the_exact_fisher(mode):
    """Repeating one example N times: the K-FAC estimate converges to its exact Fisher."""
    loss, params, batch = make_softmax_problem(batch=1, seed=3)
    n = 20000
    big = (jnp.repeat(batch[0], n, axis=0), jnp.repeat(batch[1], n, axis=0))
    est, state = estimate(loss, params, big, mode)
    want = exact_matrix(dense_layer, params, batch[0], softmax_fisher)
    got = est.to_dense_matrix(state)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_empirical_fisher_is_mean_of_per_example_gradient_outer_products():
    loss, params, batch = make_softmax_problem(batch=5)
    est, state = estimate(loss, params, batch, "fisher_empirical", layer_tag_to_block_ctor={"dense": curvax.DenseFull})
    flat, unravel = ravel_pytree(params)
    per_example = jax.vmap(lambda x, y: jax.grad(lambda f: loss(unravel(f), (x[None], y[None])))(flat))(*batch)
    want = per_example.T @ per_example / batch[0].shape[0]
    np.testing.assert_allclose(est.to_dense_matrix(state), want, rtol=1e-6, atol=1e-10)


def test_generic_parameters_get_a_diagonal_block():
    loss, params, batch = make_softmax_problem(batch=3)
    est, state = estimate(loss, params, batch, "fisher_exact", register_only_generic=True)
    assert [type(b).__name__ for b in est.blocks] == ["NaiveDiagonal", "NaiveDiagonal"]
    dense = est.to_dense_matrix(state)
    np.testing.assert_allclose(dense, np.diag(np.diag(dense)))


def test_multiply_matpower_matches_dense_matrix_functions():
    loss, params, batch = make_softmax_problem(batch=4)
    est, state = estimate(loss, params, batch, "fisher_exact")
    dense = np.asarray(est.to_dense_matrix(state))
    flat, unravel = ravel_pytree(params)
    v = jax.random.normal(KEY, flat.shape)
    lam = 0.3
    m = dense + lam * np.eye(len(flat))
    got = ravel_pytree(est.multiply(state, unravel(v), lam, True, False))[0]
    np.testing.assert_allclose(got, m @ v, rtol=1e-6)
    got = ravel_pytree(est.multiply_inverse(state, unravel(v), lam, True, False))[0]
    np.testing.assert_allclose(got, np.linalg.solve(m, v), rtol=1e-6)
    np.testing.assert_allclose(np.sort(est.eigenvalues(state, False)), np.linalg.eigvalsh(dense), atol=1e-8)


def test_bad_inputs_are_reported_clearly():
    loss, params, batch = make_softmax_problem(batch=2)
    with pytest.raises(ValueError, match="estimation_mode"):
        curvax.BlockDiagonalCurvature(loss, default_estimation_mode="fisher_magic")
    est, state = estimate(loss, params, batch, "fisher_exact")
    with pytest.raises(ValueError, match="structure of the parameters"):
        est.multiply(state, {"w": params["w"]}, 0.1, True, False)
    with pytest.raises(ValueError, match="shape"):
        est.multiply(state, {"w": params["w"], "b": jnp.ones(7)}, 0.1, True, False)

    def no_targets(p, b):
        logits = dense_layer(p, b[0])
        curvax.register_softmax_cross_entropy_loss(logits)
        return jnp.mean(logits)

    est2 = curvax.BlockDiagonalCurvature(no_targets)
    st2 = est2.init(KEY, (params, batch))
    with pytest.raises(ValueError, match="targets"):
        est2.update_curvature_matrix_estimate(st2, 0.0, 1.0, 2, KEY, (params, batch), estimation_mode="fisher_empirical")
