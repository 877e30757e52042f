"""Dense layers with multi-axis kernels (Flax DenseGeneral, attention projections)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax

pytestmark = pytest.mark.usefixtures("x64")
KEY = jax.random.PRNGKey(0)


def heads_model(p, x):
    """x (B, d) -> (B, heads, hd) -> (B, d'): two DenseGeneral-style products with biases."""
    h = jnp.tanh(jnp.einsum("bd,dhk->bhk", x, p["qkv"]["w"]) + p["qkv"]["b"])
    return jnp.einsum("bhk,hko->bo", h, p["out"]["w"]) + p["out"]["b"]


def heads_problem(batch, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    params = {
        "out": {"b": 0.1 * jax.random.normal(ks[0], (3,)), "w": jax.random.normal(ks[1], (2, 2, 3)) / 2},
        "qkv": {"b": 0.1 * jax.random.normal(ks[2], (2, 2)), "w": jax.random.normal(ks[3], (3, 2, 2)) / 2},
    }
    x = jax.random.normal(ks[4], (batch, 3))
    t = jax.random.randint(ks[5], (batch,), 0, 3)

    def loss(p, b):
        logits = heads_model(p, b[0])
        curvax.register_softmax_cross_entropy_loss(logits, b[1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b[1][:, None], axis=1))

    return loss, params, (x, t)


def test_multi_axis_kernels_are_detected_as_dense():
    loss, params, data = heads_problem(4)
    pj = curvax.ProcessedJaxpr.make_from_func(loss, (params, data))
    assert [(s.tag.name, s.pattern) for s in pj.layer_sites] == [("dense", "dense_with_bias")] * 2
    meta = pj.layer_sites[1].meta  # qkv: w (3, 2, 2), contract axis 0
    assert meta["kernel_layout"] == "general"
    assert meta["kernel_in_axes"] == (0,) and meta["kernel_out_axes"] == (1, 2)
    assert pj.layer_sites[0].meta["kernel_in_axes"] == (0, 1)


@pytest.mark.parametrize("ctor", [curvax.DenseTwoKroneckerFactored, curvax.DenseFull, curvax.DenseDiagonal])
def test_multi_axis_kernel_blocks_match_the_exact_fisher_for_one_example(ctor):
    """One example: K-FAC (and Full) equal the exact Fisher block; Diagonal its diagonal."""
    loss, params, data = heads_problem(1)
    est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor={"dense": ctor})
    state = est.init(KEY, (params, data))
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 1, KEY, (params, data), estimation_mode="fisher_exact")
    flat, unravel = ravel_pytree(params)
    logits = lambda f: heads_model(unravel(f), data[0])[0]
    jac = jax.jacobian(logits)(flat)
    prob = jax.nn.softmax(logits(flat))
    fisher = jac.T @ (jnp.diag(prob) - jnp.outer(prob, prob)) @ jac
    got = est.to_dense_matrix(state)
    if ctor is curvax.DenseDiagonal:
        # to_dense_matrix orders parameters as the flat leaves: the same order as ravel_pytree here.
        mask = np.zeros_like(fisher)
        np.fill_diagonal(mask, 1.0)
        fisher = fisher * mask
    else:  # block-diagonal: zero the cross-layer part of the oracle
        n_out = params["out"]["b"].size + params["out"]["w"].size
        fisher = fisher.at[:n_out, n_out:].set(0.0).at[n_out:, :n_out].set(0.0)
    np.testing.assert_allclose(got, fisher, rtol=1e-7, atol=1e-10)


def test_flax_attention_registers_every_projection():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4)(x, x))

    x = jax.random.normal(KEY, (2, 5, 6))
    model = Model()
    params = model.init(KEY, x)

    def loss(p, b):
        y = model.apply(p, b[0])
        curvax.register_squared_error_loss(y, b[1])
        return jnp.sum((y - b[1]) ** 2)

    pj = curvax.ProcessedJaxpr.make_from_func(loss, (params, (x, jnp.zeros((2, 5, 3)))))
    assert [s.pattern for s in pj.layer_sites] == ["dense_with_bias"] * 5
    opt = curvax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0, use_adaptive_learning_rate=True,
        use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1.0, num_burnin_steps=0,
    )
    data = (x, jnp.tanh(x[..., :3]))
    state = opt.init(params, KEY, data)
    losses = []
    for _ in range(5):
        params, state, stats = opt.step(params, state, KEY, batch=data, global_step_int=None)
        losses.append(float(stats["loss"]))
    assert losses[-1] < losses[0]
