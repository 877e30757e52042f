"""``RepeatedDenseKroneckerFactored``: KFAC-expand over positions, with padded positions masked out.

Padding is a position whose output cotangent is zero (a masked loss). The block
on a padded batch must equal the plain dense block on the same batch without
the padding, and equal the plain block when nothing is padded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import blocks, tags

pytestmark = pytest.mark.usefixtures("x64")
B, T, KEEP, DIN, DOUT = 3, 5, 3, 4, 2


def eqn(t, bias=True):
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float64)
    params = (s(DIN, DOUT), s(DOUT)) if bias else (s(DIN, DOUT),)
    return tags.LayerTagEqn(
        primitive=tags.dense, outputs=(s(B, t, DOUT),), inputs=(s(B, t, DIN),), params=params,
        param_indices=tuple(range(len(params))), meta={}, name="d",
    )


def dense_after_update(block, x, dy, powers=False):
    state = block.init(jax.random.PRNGKey(0), -1 if powers else None, -1 if powers else None, False)
    data = {"inputs": (x,), "outputs_tangent": (dy,)}
    state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, B)
    return state, block.to_dense_matrix(state)


@pytest.mark.parametrize("bias", [True, False])
def test_without_padding_equals_the_dense_block(bias):
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    x, dy = jax.random.normal(k1, (B, T, DIN)), jax.random.normal(k2, (B, T, DOUT))
    _, rep = dense_after_update(blocks.RepeatedDenseKroneckerFactored(eqn(T, bias), "r"), x, dy)
    _, plain = dense_after_update(blocks.DenseTwoKroneckerFactored(eqn(T, bias), "p"), x, dy)
    np.testing.assert_allclose(rep, plain, rtol=1e-12)


def test_padding_is_masked_out():
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    x, dy = jax.random.normal(k1, (B, T, DIN)), jax.random.normal(k2, (B, T, DOUT))
    dy_padded = dy.at[:, KEEP:].set(0.0)  # the last positions are padding; their inputs are not zero
    block = blocks.RepeatedDenseKroneckerFactored(eqn(T), "r")
    state, rep = dense_after_update(block, x, dy_padded)
    _, plain = dense_after_update(blocks.DenseTwoKroneckerFactored(eqn(KEEP), "p"), x[:, :KEEP], dy[:, :KEEP])
    np.testing.assert_allclose(rep, plain, rtol=1e-12)
    np.testing.assert_allclose(state.average_repeats.value, KEEP)
    # Without masking the padded inputs pollute A.
    _, unmasked = dense_after_update(blocks.RepeatedDenseKroneckerFactored(eqn(T), "u", use_masking=False), x, dy_padded)
    assert np.abs(unmasked - plain).max() > 1e-3
    # Cached and uncached damped inverses agree with the dense matrix (the 1/R scale included).
    state = block.update_cache(state, 0.3, exact_powers=-1, approx_powers=(), eigenvalues=False)
    v = (jax.random.normal(k1, (DIN, DOUT)), jax.random.normal(k2, (DOUT,)))
    want = np.linalg.solve(np.asarray(rep) + 0.3 * np.eye(len(rep)), np.concatenate([np.ravel(a) for a in v]))
    for cached in (False, True):
        got = block.multiply_matpower(state, v, 0.3, -1, exact_power=True, use_cached=cached)
        np.testing.assert_allclose(np.concatenate([np.ravel(a) for a in got]), want, rtol=1e-9)


def test_masked_sequence_loss_in_the_estimator_equals_the_unpadded_model():
    """Softmax cross-entropy with a mask over padded positions == the model on the unpadded sequences."""
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    params = {"w": jax.random.normal(k[0], (DIN, 6)) / 2, "b": jnp.zeros(6)}
    x = jax.random.normal(k[1], (B, T, DIN))
    labels = jax.random.randint(k[2], (B, T), 0, 6)
    mask = jnp.arange(T)[None, :] < KEEP

    def loss(p, batch):
        xs, ys, m = batch
        logits = xs @ p["w"] + p["b"]
        curvax.register_softmax_cross_entropy_loss(logits, ys, mask=m)
        return 0.0

    def estimate(data, ctor):
        est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor={"dense": ctor})
        st = est.init(jax.random.PRNGKey(0), (params, data))
        st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, B, jax.random.PRNGKey(4), (params, data),
                                                  estimation_mode="ggn_exact")
        return est.to_dense_matrix(st)

    padded = estimate((x, labels, jnp.broadcast_to(mask, (B, T))), curvax.RepeatedDenseKroneckerFactored)
    unpadded = estimate((x[:, :KEEP], labels[:, :KEEP], jnp.ones((B, KEEP), bool)), curvax.DenseTwoKroneckerFactored)
    np.testing.assert_allclose(padded, unpadded, rtol=1e-10, atol=1e-12)
    plain_padded = estimate((x, labels, jnp.broadcast_to(mask, (B, T))), curvax.DenseTwoKroneckerFactored)
    assert np.abs(plain_padded - unpadded).max() > 1e-3  # the plain block counts the padding in A


def test_detection_gives_a_dense_layer_over_extra_axes_the_repeated_block():
    """kfac-jax 0.0.8's graph matcher makes ``x @ w + b`` with ``x`` of shape ``(B, T, d)`` its
    ``repeated_dense`` variant, whose default block masks padding; so does curvax's detection.
    With the default blocks the padded, masked batch gives the unpadded model's curvature."""
    k = jax.random.split(jax.random.PRNGKey(5), 3)
    params = {"w": jax.random.normal(k[0], (DIN, 6)) / 2, "b": jnp.zeros(6)}
    x = jax.random.normal(k[1], (B, T, DIN))
    labels = jax.random.randint(k[2], (B, T), 0, 6)
    mask = jnp.broadcast_to(jnp.arange(T)[None, :] < KEEP, (B, T))

    def loss(p, batch):
        xs, ys, m = batch
        logits = xs @ p["w"] + p["b"]
        curvax.register_softmax_cross_entropy_loss(logits, ys, mask=m)
        return 0.0

    def estimate(data):
        est = curvax.BlockDiagonalCurvature(loss)
        st = est.init(jax.random.PRNGKey(0), (params, data))
        st = est.update_curvature_matrix_estimate(st, 0.0, 1.0, B, jax.random.PRNGKey(4), (params, data),
                                                  estimation_mode="ggn_exact")
        return est, est.to_dense_matrix(st)

    est, padded = estimate((x, labels, mask))
    assert [type(b) for b in est.blocks] == [curvax.RepeatedDenseKroneckerFactored]
    _, unpadded = estimate((x[:, :KEEP], labels[:, :KEEP], jnp.ones((B, KEEP), bool)))
    np.testing.assert_allclose(padded, unpadded, rtol=1e-10, atol=1e-12)
