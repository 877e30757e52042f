"""Haiku's ``BatchNorm`` is a scale-and-shift layer, whatever parameters it creates.

Haiku stores ``scale`` and ``offset`` with shape ``(1, C)`` (a leading 1 lined up with the
batch axis). Detection must treat them like Flax's ``(C,)`` parameters, and the block's
statistics must be per-example: with an exact estimation mode the diagonal block equals
the diagonal of the exact Gauss-Newton matrix (a dense oracle built from exact products),
because the outputs depend on ``scale``/``offset`` example by example.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import transforms

pytestmark = pytest.mark.usefixtures("x64")


def _problem(create_scale: bool, create_offset: bool, conv: bool):
    def net(x):
        h = hk.Conv2D(3, 2)(x) if conv else hk.Linear(3)(x)
        h = hk.BatchNorm(create_scale=create_scale, create_offset=create_offset, decay_rate=0.9)(h, True)
        h = jnp.tanh(h).reshape(h.shape[0], -1)
        return hk.Linear(2)(h)

    model = hk.transform_with_state(net)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k1, (6, 4, 4, 2) if conv else (6, 4), jnp.float64)
    y = jax.random.normal(k2, (6, 2), jnp.float64)
    params, state = model.init(k3, x)
    # Non-trivial scale and offset values, so that every term of the statistics matters.
    params = jax.tree_util.tree_map(lambda p: p + 0.3 * jax.random.normal(k3, p.shape, p.dtype), params)

    def loss(p, batch):
        out, _ = model.apply(p, state, None, batch[0])
        curvax.register_squared_error_loss(out, batch[1])
        return jnp.mean(jnp.sum((out - batch[1]) ** 2, -1))

    return loss, params, (x, y)


CASES = [(True, True, False), (True, False, False), (False, True, False), (True, True, True)]


@pytest.mark.parametrize("create_scale,create_offset,conv", CASES)
def test_haiku_batchnorm_is_one_scale_and_shift_block_with_the_exact_ggn_diagonal(create_scale, create_offset, conv):
    loss, params, batch = _problem(create_scale, create_offset, conv)
    pj = transforms.ProcessedJaxpr.make_from_func(loss, (params, batch))
    names = ["scale"] * create_scale + ["offset"] * create_offset
    expected = {True: {True: "scale_and_shift_both", False: "scale_only"}, False: {True: "shift_only"}}
    leaves = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    bn = [s for s in pj.layer_sites if any("batch_norm" in leaves[i] for i in s.param_indices)]
    assert len(bn) == 1, pj.registration_table(params)
    assert bn[0].pattern == expected[create_scale][create_offset]
    assert sorted(leaves[i].split("'")[-2] for i in bn[0].param_indices) == sorted(names)
    assert all(s.pattern != "generic" for s in pj.layer_sites), pj.registration_table(params)

    est = curvax.BlockDiagonalCurvature(loss, default_estimation_mode="ggn_exact")
    state = est.init(jax.random.PRNGKey(1), (params, batch))

    @jax.jit  # one compiled program: op-by-op evaluation of the exact mode's loop is slow
    def block_diagonal(state):
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, batch[0].shape[0], jax.random.PRNGKey(2), (params, batch))
        return jnp.diag(est.to_dense_matrix(state))  # leaf order, like ravel_pytree of a dict

    # Oracle: the diagonal of the exact GGN of the mean loss, one unit vector at a time.
    exact = curvax.ImplicitExactCurvature(loss)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    ggn = jax.jit(jax.vmap(lambda e: jax.flatten_util.ravel_pytree(exact.multiply_ggn((params, batch), unravel(e)))[0]))(
        jnp.eye(flat.size, dtype=flat.dtype)
    )
    oracle = unravel(jnp.diag(ggn))
    got = unravel(block_diagonal(state))
    for name in ("scale", "offset"):
        if name in params["batch_norm"]:
            np.testing.assert_allclose(got["batch_norm"][name], oracle["batch_norm"][name], rtol=1e-9, atol=1e-12)
