"""The forward-only mode (FOOF, Benzing 2022): A from the inputs, identity gradient factor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax

pytestmark = pytest.mark.usefixtures("x64")
KEY = jax.random.PRNGKey(0)


def problem(batch=6, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    params = {
        "l0": {"b": jnp.zeros(4), "w": jax.random.normal(ks[0], (3, 4))},
        "l1": {"w": jax.random.normal(ks[1], (4, 2))},
        "s": jnp.ones(2),
    }
    x = jax.random.normal(ks[2], (batch, 3))
    t = jax.random.normal(ks[3], (batch, 2))

    def loss(p, b):
        h = jnp.tanh(b[0] @ p["l0"]["w"] + p["l0"]["b"])
        y = (h @ p["l1"]["w"]) * jnp.sum(p["s"])  # "s": no layer pattern, generic block
        curvax.register_squared_error_loss(y, b[1])
        return jnp.sum((y - b[1]) ** 2) / b[0].shape[0]

    return loss, params, (x, t)


def test_forward_only_factors_are_input_moments_and_identity():
    loss, params, data = problem()
    x = data[0]
    est = curvax.BlockDiagonalCurvature(loss)
    state = est.init(KEY, (params, data))
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, x.shape[0], KEY, (params, data), estimation_mode="forward_only")
    names = [type(b).__name__ for b in est.blocks]
    assert names == ["DenseTwoKroneckerFactored", "DenseTwoKroneckerFactored", "NaiveDiagonal"]
    s0, s1, s2 = state.blocks_states
    x1 = jnp.concatenate([x, jnp.ones((x.shape[0], 1))], axis=1)
    np.testing.assert_allclose(s0.inputs_factor.value, x1.T @ x1 / x.shape[0], rtol=1e-10)
    h = jnp.tanh(x @ params["l0"]["w"] + params["l0"]["b"])
    np.testing.assert_allclose(s1.inputs_factor.value, h.T @ h / x.shape[0], rtol=1e-10)
    np.testing.assert_array_equal(s0.outputs_factor.value, np.eye(4))
    np.testing.assert_array_equal(s1.outputs_factor.value, np.eye(2))
    assert float(jnp.abs(est.blocks[2].to_dense_matrix(s2)).max()) == 0.0


def test_forward_only_exact_inverse_is_foof_update():
    """With exact inverses the preconditioned gradient of a layer is (A + λI)^-1 G_W."""
    loss, params, data = problem()
    est = curvax.BlockDiagonalCurvature(loss)
    state = est.init(KEY, (params, data), exact_powers_to_cache=-1)
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 6, KEY, (params, data), estimation_mode="forward_only")
    lam = 0.1
    state = est.update_cache(state, lam, exact_powers=-1, approx_powers=None, eigenvalues=False)
    grads = jax.grad(loss)(params, data)
    out = est.multiply_matpower(state, grads, lam, -1, exact_power=True, use_cached=True)
    h = jnp.tanh(data[0] @ params["l0"]["w"] + params["l0"]["b"])
    a = h.T @ h / 6
    np.testing.assert_allclose(out["l1"]["w"], jnp.linalg.solve(a + lam * jnp.eye(4), grads["l1"]["w"]), rtol=1e-8)


def test_optimizer_runs_forward_only_and_reduces_the_loss():
    loss, params, data = problem(batch=32)
    opt = curvax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0, estimation_mode="forward_only",
        learning_rate_schedule=lambda step: 0.05, momentum_schedule=lambda step: 0.0,
        damping_schedule=lambda step: 1.0, inverse_update_period=1, num_burnin_steps=0,
    )
    state = opt.init(params, KEY, data)
    losses = []
    for _ in range(10):
        params, state, stats = opt.step(params, state, KEY, batch=data, global_step_int=None)
        losses.append(float(stats["loss"]))
    assert losses[-1] < 0.5 * losses[0]


def test_forward_only_rejects_blocks_that_need_gradients():
    loss, params, data = problem()
    est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor={"dense": curvax.DenseFull})
    state = est.init(KEY, (params, data))
    with pytest.raises(ValueError, match="forward_only.*DenseFull"):
        est.update_curvature_matrix_estimate(state, 0.0, 1.0, 6, KEY, (params, data), estimation_mode="forward_only")
