"""Performance refactors keep the numbers: split Gram matrices; the first step with a burn-in."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import linalg


@pytest.mark.parametrize("shape", [(7, 3), (50, 40), (33, 401), (20, 9)])
def test_gram_matches_dense_product(shape):
    x = jax.random.normal(jax.random.PRNGKey(shape[1]), shape)
    got = linalg.gram(x, min_split=8)
    want = np.asarray(x, np.float64).T @ np.asarray(x, np.float64)
    assert got.shape == (shape[1], shape[1])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(linalg.gram(x), got, rtol=1e-5, atol=1e-4)  # default threshold: plain product


def _mlp_loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params[0]["w"] + params[0]["b"])
    logits = h @ params[1]["w"] + params[1]["b"]
    curvax.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], 1)[:, 0])


def _setup(**kw):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = [{"w": jax.random.normal(k1, (6, 8)) / 3, "b": jnp.zeros(8)},
              {"w": jax.random.normal(k2, (8, 4)) / 3, "b": jnp.zeros(4)}]
    batch = (jax.random.normal(k3, (16, 6)), jnp.arange(16) % 4)
    opt = curvax.Optimizer(jax.value_and_grad(_mlp_loss), l2_reg=1e-3, num_burnin_steps=3, **kw)
    return opt, params, batch


def test_first_step_with_burnin_matches_eager_and_compiles_once():
    outs = []
    for debug in (False, True):
        opt, params, batch = _setup(debug=debug)
        state = opt.init(params, jax.random.PRNGKey(1), batch)
        consumed = []

        def data():
            for i in itertools.count():
                consumed.append(i)
                yield batch

        it = data()
        for i in range(2):
            params, state, stats = opt.step(params, state, jax.random.PRNGKey(2 + i), data_iterator=it,
                                            learning_rate=0.1, momentum=0.5, damping=1.0)
        assert len(consumed) == 3 + 2  # the burn-in's batches and the steps'
        if not debug:
            assert opt.trace_count == 1
        outs.append((params, float(stats["loss"])))
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6), outs[0][0], outs[1][0])
    np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=1e-5)


def test_bad_step_arguments_still_raise_with_burnin():
    opt, params, batch = _setup()
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    with pytest.raises(TypeError, match="learning_rate"):
        opt.step(params, state, jax.random.PRNGKey(2), batch=batch, learning_rate="fast", momentum=0.0, damping=1.0)
    with pytest.raises(ValueError, match="`momentum` must be a scalar"):
        opt.step(params, state, jax.random.PRNGKey(2), batch=batch, learning_rate=0.1, momentum=jnp.ones(2), damping=1.0)
