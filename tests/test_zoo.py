"""Every model in every framework registers the same layers (tests/zoo.py)."""

from __future__ import annotations

import jax
import pytest

import zoo

CASES = [(m, f) for m, fs in zoo.BUILDERS.items() for f in fs]


@pytest.mark.parametrize("model,framework", CASES, ids=[f"{m}-{f}" for m, f in CASES])
def test_each_framework_registers_the_expected_layers(model, framework):
    loss, params, batch = zoo.BUILDERS[model][framework](jax.random.PRNGKey(0))
    assert zoo.registration(loss, params, batch) == zoo.EXPECTED[model]


def test_kfac_trains_the_transformer_faster_per_step_than_sgd():
    """Next-token prediction on a deterministic sequence: 10 adaptive K-FAC steps end lower than
    10 steps of SGD at the best of several learning rates (larger ones diverge)."""
    import jax.numpy as jnp

    import curvax

    loss, params0, _ = zoo.jax_transformer(jax.random.PRNGKey(0))
    starts = jax.random.randint(jax.random.PRNGKey(1), (16, 1), 0, zoo.VOCAB)
    seq = (starts + 2 * jnp.arange(zoo.T + 1)[None]) % zoo.VOCAB
    batch = (seq[:, :-1], seq[:, 1:])
    value_and_grad = jax.jit(jax.value_and_grad(loss))

    def sgd(lr):
        p = params0
        for _ in range(10):
            _, g = value_and_grad(p, batch)
            p = jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g)
        return float(value_and_grad(p, batch)[0])

    best_sgd = min(v for v in (sgd(lr) for lr in (0.03, 0.1, 0.2, 0.3)) if v == v)
    opt = curvax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0, num_burnin_steps=0, inverse_update_period=1,
        use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1.0,
    )
    p, state = params0, opt.init(params0, jax.random.PRNGKey(2), batch)
    for i in range(10):
        p, state, _ = opt.step(p, state, jax.random.PRNGKey(i), batch=batch, global_step_int=None)
    assert float(value_and_grad(p, batch)[0]) < 0.5 * best_sgd
