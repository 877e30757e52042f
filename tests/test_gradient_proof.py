"""curvax.gradients: the optimizer shares its own gradient only when it provably equals the user's.

The cases that once returned a wrong gradient without a word are here: a ``custom_jvp`` loss
whose rule registers the loss and masks the gradient (DeepQMC's pattern), where JAX's
linearization leaves only the rule's primal computation in curvax's copy of the loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import curvax


def _logpsi(params, x):
    return (jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"])[..., 0]


def _local_energy(params, x):
    return 0.5 * jnp.sum(x**2, -1) + _logpsi(params, x) ** 2  # depends on the parameters


@jax.custom_jvp
def _masked_vmc_loss(params, batch):
    e = _local_energy(params, batch)
    return jnp.mean(e), e


@_masked_vmc_loss.defjvp
def _masked_vmc_loss_jvp(primals, tangents):
    params, batch = primals
    e = _local_energy(params, batch)
    lp, lp_t = jax.jvp(lambda p: _logpsi(p, batch), (params,), (tangents[0],))
    curvax.register_normal_predictive_distribution(lp[:, None])  # the loss tag lives in the rule only
    mask = jnp.abs(e - jnp.median(e)) < 2.0
    t = 2 * jnp.mean(jnp.where(mask, e - e.mean(), 0.0) * lp_t)
    return (jnp.mean(e), e), (t, e)


def _params_and_batch():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k[0], (3, 8)), "b1": jnp.zeros(8), "w2": jax.random.normal(k[1], (8, 1))}
    return params, jax.random.normal(k[2], (64, 3))


def _norm(tree):
    return float(jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(tree))))


def test_custom_rule_with_the_loss_tag_inside_is_not_shared():
    params, batch = _params_and_batch()
    vg = jax.value_and_grad(_masked_vmc_loss, has_aux=True)
    user = _norm(vg(params, batch)[1])
    primal = _norm(jax.grad(lambda p: jnp.mean(_local_energy(p, batch)))(params))
    assert abs(user - primal) > 0.1 * user  # the two candidate gradients differ: the test can tell
    opt = curvax.Optimizer(vg, l2_reg=0.0, value_func_has_aux=True, include_norms_in_stats=True,
                           estimation_mode="fisher_exact", inverse_update_period=1, num_burnin_steps=0)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    assert not opt.shares_gradient_pass and "custom_jvp" in opt.gradient_source_reason
    _, _, stats = opt.step(params, state, jax.random.PRNGKey(2), batch=batch, learning_rate=0.01, momentum=0.0,
                           damping=1e-3)
    np.testing.assert_allclose(float(stats["grad_norm"]), user, rtol=1e-6)


def test_plain_value_and_grad_is_shared_and_hand_written_is_not():
    params, batch = _params_and_batch()

    def loss(p, x):
        lp = _logpsi(p, x)
        curvax.register_normal_predictive_distribution(lp[:, None])
        return jnp.mean(jax.nn.relu(lp) ** 2) + jnp.mean(jax.lax.stop_gradient(lp) * lp)

    for vag, shared in ((jax.value_and_grad(loss), True), (lambda p, x: jax.value_and_grad(loss)(p, x), False)):
        opt = curvax.Optimizer(vag, l2_reg=0.0, include_norms_in_stats=True, num_burnin_steps=0)
        state = opt.init(params, jax.random.PRNGKey(1), batch)
        assert opt.shares_gradient_pass is shared, opt.gradient_source_reason
        _, _, stats = opt.step(params, state, jax.random.PRNGKey(2), batch=batch, learning_rate=0.01, momentum=0.0,
                               damping=1e-3)
        np.testing.assert_allclose(float(stats["grad_norm"]), _norm(vag(params, batch)[1]), rtol=1e-6)
