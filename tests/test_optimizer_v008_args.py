"""kfac-jax 0.0.8's extra Optimizer arguments: the implemented ones act, the others refuse clearly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax


def _loss(params, batch):
    x, y = batch
    out = jnp.tanh(x @ params["w1"]) @ params["w2"]
    curvax.register_squared_error_loss(out, y)
    return jnp.mean(jnp.sum((out - y) ** 2, -1))


def _setup():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k[0], (3, 4)), "w2": jax.random.normal(k[1], (4, 2))}
    batch = (jax.random.normal(k[2], (8, 3)), jax.random.normal(k[3], (8, 2)))
    return params, batch


def _one_step(damping, **kwargs):
    params, batch = _setup()
    opt = curvax.Optimizer(jax.value_and_grad(_loss), 0.0, num_burnin_steps=0, estimation_mode="ggn_curvature_prop",
                           inverse_update_period=1, **kwargs)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    new, _, stats = opt.step(params, state, jax.random.PRNGKey(2), batch=batch, learning_rate=0.1, momentum=0.0,
                             damping=damping)
    return new, stats


def test_precon_damping_mult_and_schedule_set_the_preconditioner_damping():
    ref, _ = _one_step(3.0)
    for got, _ in (_one_step(1.5, precon_damping_mult=2.0), _one_step(0.01, precon_damping_schedule=lambda step: 3.0)):
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    other, stats = _one_step(1.5)  # the multiplier matters: damping 1.5 alone is another step
    assert not np.allclose(other["w1"], ref["w1"])
    assert float(stats["damping"]) == 1.5


def test_value_func_for_estimator_feeds_the_curvature_only():
    # The estimator's function has another output scale: the statistics change, the gradient does not.
    def scaled(params, batch):
        x, y = batch
        out = jnp.tanh(x @ params["w1"]) @ params["w2"]
        curvax.register_squared_error_loss(out, y, weight=4.0)
        return 4.0 * jnp.mean(jnp.sum((out - y) ** 2, -1))

    plain, s1 = _one_step(1.0, include_norms_in_stats=True)
    other, s2 = _one_step(1.0, include_norms_in_stats=True, value_func_for_estimator=scaled)
    np.testing.assert_allclose(s1["grad_norm"], s2["grad_norm"], rtol=1e-6)
    assert not np.allclose(plain["w1"], other["w1"])


@pytest.mark.parametrize(
    "name, value",
    [("use_step_rejection", True), ("precon_power", -0.5), ("num_estimator_samples", 2),
     ("include_registered_loss_in_stats", True), ("regularized_parameters_path_exclusions", curvax.HAIKU_BIASES)],
)
def test_unimplemented_v008_arguments_refuse_by_name(name, value):
    with pytest.raises(NotImplementedError, match=name):
        curvax.Optimizer(jax.value_and_grad(_loss), 0.0, **{name: value})


def test_v008_defaults_are_accepted():
    curvax.Optimizer(jax.value_and_grad(_loss), 0.0, use_step_rejection=False, precon_power=-1.0,
                     num_estimator_samples=1, include_registered_loss_in_stats=False, use_automatic_registration=True)
