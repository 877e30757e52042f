"""K-FAC-reduce for convolutions (``ConvTwoKroneckerFactoredReduce``, ``ops.kfac(kfac_approx="reduce")``).

A convolution followed by global average pooling, a linear read-out and a squared error is
linear in the convolution's parameters, and the pooled output's cotangent does not depend on the
example: its Gauss-Newton block (= the loss's Hessian in those parameters, ``jax.hessian``) is
exactly ``(1/B) sum_n [pbar_n; 1][pbar_n; 1]^T (x) sum_c s_c s_c^T``, i.e. K-FAC-reduce, for any
batch size; KFC (expand) is not exact there. Checked for 1-D and 2-D convolutions, strides,
padding, layouts, with and without bias.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.flatten_util import ravel_pytree

import curvax
from curvax import operators as ops

pytestmark = pytest.mark.usefixtures("x64")

CASES = {
    # name: (input shape, kernel shape, dimension numbers, strides, padding, bias)
    "2d NHWC same": ((5, 5, 2), (3, 3, 2, 3), ("NHWC", "HWIO", "NHWC"), (1, 1), "SAME", True),
    "2d NHWC stride 2 valid, no bias": ((6, 6, 2), (2, 2, 2, 3), ("NHWC", "HWIO", "NHWC"), (2, 2), "VALID", False),
    "1d NCH stride 2": ((2, 7), (3, 2, 3), ("NCH", "OIH", "NCH"), (2,), "SAME", True),
}


def _problem(name: str, batch: int):
    in_shape, k_shape, dn, strides, padding, bias = CASES[name]
    rng = np.random.default_rng(0)
    c_out = k_shape[dn[1].index("O")]
    conv = {"w": jnp.asarray(rng.standard_normal(k_shape) / 2)}
    if bias:
        conv["b"] = jnp.asarray(0.1 * rng.standard_normal(c_out))
    params = {"conv": conv, "out": {"w": jnp.asarray(rng.standard_normal((c_out, 4)) / 2)}}
    x = jnp.asarray(rng.standard_normal((batch, *in_shape)))
    y = jnp.asarray(rng.standard_normal((batch, 4)))
    out_channel_axis = dn[2].index("C")
    spatial = tuple(i for i in range(1, len(dn[2])) if i != out_channel_axis)

    def predict(p, x):
        h = lax.conv_general_dilated(x, p["conv"]["w"], strides, padding, dimension_numbers=dn)
        if "b" in p["conv"]:
            shape = [1] * h.ndim
            shape[out_channel_axis] = c_out
            h = h + p["conv"]["b"].reshape(shape)
        return jnp.mean(h, axis=spatial) @ p["out"]["w"]  # global average pooling, linear read-out

    def loss(p, batch):
        out = predict(p, batch[0])
        curvax.register_squared_error_loss(out, batch[1])
        return jnp.mean(jnp.sum((out - batch[1]) ** 2, axis=-1))  # the registered loss: ||out - y||^2

    return loss, params, (x, y)


def _conv_block(matrix: np.ndarray, params) -> np.ndarray:
    n = ravel_pytree(params["conv"])[0].size  # "conv" leaves come first in the flat order
    return np.asarray(matrix)[:n, :n]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_kfac_reduce_equals_the_exact_block_after_global_pooling(name, batch):
    loss, params, data = _problem(name, batch)
    flat, unravel = ravel_pytree(params)
    hess = jax.hessian(lambda f: loss(unravel(f), data))(flat)  # the model is linear in the conv parameters
    exact = _conv_block(hess, params)
    reduce_ = _conv_block(ops.kfac(loss, params, data, fisher_type="type-2", kfac_approx="reduce",
                                   separate_weight_and_bias=False).to_dense(), params)
    expand = _conv_block(ops.kfac(loss, params, data, fisher_type="type-2", kfac_approx="expand",
                                  separate_weight_and_bias=False).to_dense(), params)
    np.testing.assert_allclose(reduce_, exact, rtol=1e-10, atol=1e-12 * np.abs(exact).max())
    assert np.abs(expand - exact).max() > 1e-3 * np.abs(exact).max()  # KFC is not exact here


def test_reduce_block_through_the_estimator_and_separate_weight_and_bias():
    loss, params, data = _problem("2d NHWC same", 3)
    est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor={"conv2d": curvax.ConvTwoKroneckerFactoredReduce})
    state = est.init(jax.random.PRNGKey(0), (params, data), None, None)
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 3, jax.random.PRNGKey(1), (params, data),
                                                 estimation_mode="fisher_exact")
    via_estimator = _conv_block(est.to_dense_matrix(state), params)
    via_kfac = _conv_block(ops.kfac(loss, params, data, fisher_type="type-2", kfac_approx="reduce",
                                    separate_weight_and_bias=False).to_dense(), params)
    np.testing.assert_allclose(via_estimator, via_kfac, rtol=1e-12, atol=1e-14)
    # separate weight and bias: the (bias, weight) cross block vanishes, the diagonal blocks stay
    sep = _conv_block(ops.kfac(loss, params, data, fisher_type="type-2", kfac_approx="reduce").to_dense(), params)
    nb = params["conv"]["b"].size  # leaves in order: b, w
    np.testing.assert_allclose(sep[:nb, nb:], 0.0, atol=1e-14)
    np.testing.assert_allclose(sep[nb:, nb:], via_kfac[nb:, nb:], rtol=1e-12, atol=1e-14)


def test_reduce_refuses_a_grouped_convolution_by_name():
    rng = np.random.default_rng(1)
    p = {"w": jnp.asarray(rng.standard_normal((2, 2, 1, 4))), "r": jnp.asarray(rng.standard_normal((4, 2)))}

    def loss(p, batch):
        h = lax.conv_general_dilated(batch[0], p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                     feature_group_count=2)
        out = jnp.mean(h, axis=(1, 2)) @ p["r"]
        curvax.register_squared_error_loss(out, batch[1])
        return jnp.mean(jnp.sum((out - batch[1]) ** 2, axis=-1))  # the registered loss: ||out - y||^2

    data = (jnp.ones((2, 3, 3, 2)), jnp.zeros((2, 2)))
    with pytest.raises(NotImplementedError, match="grouped convolution"):
        ops.kfac(loss, p, data, kfac_approx="reduce")
