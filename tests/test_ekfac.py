"""EKFAC (eigenvalue-corrected K-FAC) checked against per-example-gradient Fishers (float64)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import blocks
from layer_eqns import dense_eqn

pytestmark = pytest.mark.usefixtures("x64")

KEY = jax.random.PRNGKey(0)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _mlp_layer_data(seed, batch, extra, d_in=3, d_hid=4, d_out=2):
    """First-layer statistics of a tanh MLP, and its exact per-example (empirical) Fisher block.

    Each example is ``x_n`` of shape ``(*extra, d_in)`` with loss ``sum |f(x_n) - y_n|^2 / 2``
    (summed over positions). ``dy`` is obtained with a zero perturbation of the first
    layer's output; the Fisher from ``jax.grad`` of each example's loss.
    """
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(k[0], (batch, *extra, d_in))
    y = jax.random.normal(k[1], (batch, *extra, d_out))
    w0, b0 = jax.random.normal(k[2], (d_in, d_hid)), 0.3 * jax.random.normal(k[3], (d_hid,))
    w1 = jax.random.normal(k[4], (d_hid, d_out))

    def loss_n(w0, b0, eps, xn, yn):
        z = xn @ w0 + b0 + eps
        return 0.5 * jnp.sum((jnp.tanh(z) @ w1 - yn) ** 2)

    gw, gb, dy = jax.vmap(jax.grad(loss_n, argnums=(0, 1, 2)), in_axes=(None, None, 0, 0, 0))(
        w0, b0, jnp.zeros((batch, *extra, d_hid)), x, y
    )
    g = jnp.concatenate([gw.reshape(batch, -1), gb.reshape(batch, -1)], axis=1)
    data = {"inputs": (x,), "outputs": (x @ w0 + b0,), "params": (w0, b0), "outputs_tangent": (dy,),
            "params_tangent": (jnp.sum(gw, 0), jnp.sum(gb, 0))}
    return data, g.T @ g / batch


def mlp_layer_data(seed, batch, extra=()):
    data, fisher = _mlp_layer_data(seed, batch, extra)
    return dense_eqn(3, 4, batch, extra), data, fisher


@functools.partial(jax.jit, static_argnums=(0, 2))
def ekfac_state_and_dense(block, data, batch):
    """Statistics, basis from those statistics, then ``s`` measured in that basis; and its dense matrix."""
    state = block.init(KEY, None, None, False)
    state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch)
    state = block.update_cache(state, 0.0, None, None, False)
    state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch)
    return state, block.to_dense_matrix(state)


@functools.partial(jax.jit, static_argnums=(0, 2))
def kfac_dense(block, data, batch):
    state = block.update_curvature_matrix_estimate(block.init(KEY, None, None, False), data, 0.0, 1.0, batch)
    return block.to_dense_matrix(state)


def random_vector(block, seed=3):
    keys = jax.random.split(jax.random.PRNGKey(seed), block.number_of_parameters)
    return tuple(jax.random.normal(k, s) for k, s in zip(keys, block.parameters_shapes))


def flat(vec):
    return jnp.concatenate([jnp.ravel(v) for v in vec])


def basis_in_parameter_order(block, qa, qg):
    """The columns of ``Q_A (x) Q_G`` (vectors on ``vec(V)``) rewritten in parameter order."""
    cols = [
        np.concatenate([np.ravel(a) for a in block.array_to_parameters_shaped_list(c.reshape(len(qa), len(qg)))])
        for c in np.kron(np.asarray(qa), np.asarray(qg)).T
    ]
    return np.asarray(cols).T


@pytest.mark.parametrize("layout,bias", [("io", True), ("oi", False)])
def test_single_example_equals_kfac_and_exact_fisher(layout, bias):
    eqn = dense_eqn(3, 2, 1, bias=bias, layout=layout)
    k1, k2 = jax.random.split(KEY)
    x, dy = jax.random.normal(k1, (1, 3)), jax.random.normal(k2, (1, 2))
    gw = x.T @ dy if layout == "io" else dy.T @ x
    g = jnp.concatenate([gw.ravel()] + ([dy.ravel()] if bias else []))
    data = {"inputs": (x,), "outputs_tangent": (dy,)}
    block = blocks.DenseEigenvalueCorrected(eqn, "e")
    _, dense = ekfac_state_and_dense(block, data, 1)
    np.testing.assert_allclose(dense, kfac_dense(blocks.DenseTwoKroneckerFactored(eqn, "k"), data, 1), atol=1e-12)
    np.testing.assert_allclose(dense, jnp.outer(g, g), atol=1e-12)


@pytest.mark.parametrize("extra", [(), (3,)])
def test_never_further_from_fisher_than_kfac(extra):
    eqn = dense_eqn(3, 4, 6, extra)
    block = blocks.DenseEigenvalueCorrected(eqn, "e")
    kfac = blocks.DenseTwoKroneckerFactored(eqn, "k")
    for seed in range(4):
        _, data, fisher = mlp_layer_data(seed, batch=6, extra=extra)
        state, ekfac = ekfac_state_and_dense(block, data, 6)
        err_ekfac = np.linalg.norm(ekfac - fisher)
        err_kfac = np.linalg.norm(kfac_dense(kfac, data, 6) - fisher)
        assert err_ekfac <= err_kfac * (1 + 1e-10), (seed, err_ekfac, err_kfac)
        assert err_ekfac < err_kfac  # random data: the correction strictly helps
        # s is the Fisher's diagonal in the Kronecker eigenbasis: the residual has a zero diagonal there.
        qa = state.cache["inputs_factor_eigen_vectors"]
        qg = state.cache["outputs_factor_eigen_vectors"]
        q_params = basis_in_parameter_order(block, qa, qg)
        np.testing.assert_allclose(q_params.T @ q_params, np.eye(block.dim), atol=1e-10)
        np.testing.assert_allclose(np.diag(q_params.T @ (fisher - ekfac) @ q_params), 0, atol=1e-10)
        np.testing.assert_allclose(block.eigenvalues(state, False), np.diag(q_params.T @ fisher @ q_params),
                                   atol=1e-10)


def test_before_first_basis_is_the_diagonal_fisher_and_refresh_projects():
    eqn, data, fisher = mlp_layer_data(11, batch=5)
    block = blocks.DenseEigenvalueCorrected(eqn, "e")

    @jax.jit
    def run(data):
        state = block.update_curvature_matrix_estimate(block.init(KEY, None, None, False), data, 0.0, 1.0, 5)
        new_state = block.update_cache(state, 0.0, None, None, False)
        return state, new_state, block.to_dense_matrix(state), block.eigenvalues(new_state, True)

    state, new_state, old, eigenvalues = run(data)
    np.testing.assert_allclose(old, np.diag(np.diag(fisher)), atol=1e-12)
    np.testing.assert_allclose(state.cache["inputs_factor_eigen_vectors"], jnp.eye(4))  # identity until refreshed
    q_params = basis_in_parameter_order(
        block, new_state.cache["inputs_factor_eigen_vectors"], new_state.cache["outputs_factor_eigen_vectors"]
    )
    # The carried-over s is the old estimate's diagonal in the new basis; the weight is kept.
    np.testing.assert_allclose(eigenvalues, np.diag(q_params.T @ np.asarray(old) @ q_params), atol=1e-12)
    np.testing.assert_allclose(new_state.eigenvalue_correction.weight, state.eigenvalue_correction.weight)
    assert not np.allclose(new_state.cache["inputs_factor_eigen_vectors"], jnp.eye(4))


def test_powers_match_dense_matrix_powers():
    eqn, data, _ = mlp_layer_data(5, batch=6, extra=(2,))
    block = blocks.DenseEigenvalueCorrected(eqn, "e")
    vec, w = random_vector(block), 0.3
    combos = [(p, exact, cached) for p in (1, -1, -0.5) for exact, cached in [(True, True), (False, False), (True, False)]]

    @jax.jit
    def run(data):
        state = block.init(KEY, -1, -1, True)
        state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, 6)
        state = block.update_cache(state, 0.1, -1, -1, True)
        state = block.update_curvature_matrix_estimate(state, data, 0.5, 1.0, 6)
        products = [block.multiply_matpower(state, vec, w, *c) for c in combos]
        return block.to_dense_matrix(state), block.eigenvalues(state, True), products

    dense, eigenvalues, products = run(data)
    dense = np.asarray(dense)
    np.testing.assert_allclose(np.sort(eigenvalues), np.linalg.eigvalsh(dense), atol=1e-10)
    s, q = np.linalg.eigh(dense + w * np.eye(block.dim))
    for (power, exact, cached), got in zip(combos, products):
        want = (q * s**power) @ q.T @ np.asarray(flat(vec))
        np.testing.assert_allclose(flat(got), want, rtol=1e-9, atol=1e-12, err_msg=f"{power} {exact} {cached}")


def test_optimizer_with_ekfac_blocks_reduces_the_loss():
    kx, ky, k0, k1 = jax.random.split(KEY, 4)
    x, y = jax.random.normal(kx, (16, 4)), jax.random.randint(ky, (16,), 0, 3)
    params = [{"w": jax.random.normal(k0, (4, 6)) / 2, "b": jnp.zeros(6)},
              {"w": jax.random.normal(k1, (6, 3)) / 2, "b": jnp.zeros(3)}]

    def loss(p, batch):
        h = jnp.tanh(batch[0] @ p[0]["w"] + p[0]["b"])
        logits = h @ p[1]["w"] + p[1]["b"]
        curvax.register_softmax_cross_entropy_loss(logits, batch[1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], axis=1))

    opt = curvax.Optimizer(
        jax.value_and_grad(loss), l2_reg=1e-3, num_burnin_steps=0, inverse_update_period=2,
        layer_tag_to_block_ctor={"dense": blocks.DenseEigenvalueCorrected},
    )
    state = opt.init(params, KEY, (x, y))
    assert {type(b) for b in opt.estimator.blocks} == {blocks.DenseEigenvalueCorrected}
    first = float(loss(params, (x, y)))
    for i in range(8):
        params, state, _ = opt.step(params, state, jax.random.PRNGKey(i), batch=(x, y),
                                    learning_rate=0.3, momentum=0.0, damping=1e-2)
    last = float(loss(params, (x, y)))
    assert np.isfinite(last) and last < 0.8 * first, (first, last)


def test_errors():
    eqn = dense_eqn(3, 2, 4)
    block = blocks.DenseEigenvalueCorrected(eqn, "e")
    state = block.init(KEY, None, None, False)
    with pytest.raises(ValueError, match="outputs_tangent"):
        block.update_curvature_matrix_estimate(
            state, {"inputs": (jnp.zeros((4, 3)),), "outputs_tangent": (jnp.zeros((4, 5)),)}, 0.0, 1.0, 4)
    state.cache = None
    with pytest.raises(ValueError, match="eigenbasis"):
        block.multiply(state, random_vector(block), 0.1, True, True)


def test_optimizer_refreshes_the_ekfac_basis_when_inverses_are_not_cached():
    """With inverse_update_period=1 the optimizer still calls update_cache, so EKFAC gets its basis."""

    def loss(p, b):
        y = jnp.tanh(b[0] @ p["w1"]) @ p["w2"]
        curvax.register_squared_error_loss(y, b[1])
        return jnp.sum((y - b[1]) ** 2) / b[0].shape[0]

    k = jax.random.split(jax.random.PRNGKey(3), 4)
    params = {"w1": jax.random.normal(k[0], (3, 4)), "w2": jax.random.normal(k[1], (4, 2))}
    data = (jax.random.normal(k[2], (8, 3)), jax.random.normal(k[3], (8, 2)))
    opt = curvax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0, inverse_update_period=1, num_burnin_steps=0,
        layer_tag_to_block_ctor={"dense": curvax.DenseEigenvalueCorrected},
        learning_rate_schedule=lambda s: 0.1, momentum_schedule=lambda s: 0.0, damping_schedule=lambda s: 1.0,
    )
    state = opt.init(params, jax.random.PRNGKey(0), data)
    params, state, _ = opt.step(params, state, jax.random.PRNGKey(1), batch=data, global_step_int=None)
    cache = state.estimator_state.blocks_states[0].cache
    q = cache["inputs_factor_eigen_vectors"]
    assert not np.allclose(np.asarray(q), np.eye(q.shape[0]))
    np.testing.assert_allclose(np.asarray(q.T @ q), np.eye(q.shape[0]), atol=1e-8)
