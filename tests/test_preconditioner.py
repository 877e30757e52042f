"""``kfac_preconditioner``: K-FAC as an Optax gradient transformation.

Chained with ``optax.sgd(lr, momentum=m)`` it must take the steps of ``curvax.Optimizer`` with
that fixed learning rate, momentum and damping: both compute ``-lr (C + d I)^{-1} g + m delta``
from the same statistics. It must also work inside a user's ``jax.jit``, keep its own random
keys, follow a damping schedule and reject bad input with errors that name the argument.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import curvax
import models

LR, MOMENTUM, DAMPING, L2, EMA = 0.3, 0.5, 0.05, 1e-3, 0.9


_loss = models.softmax_loss


def _data(n: int = 24) -> tuple[dict[str, jax.Array], tuple[jax.Array, jax.Array]]:
    return models.classifier(n, (5, 7, 4))


@pytest.mark.parametrize("mode", ["fisher_gradients", "fisher_empirical"])
def test_chained_with_sgd_it_takes_the_optimizers_fixed_steps(mode):
    params, batch = _data()
    opt = curvax.Optimizer(jax.value_and_grad(_loss), l2_reg=L2, num_burnin_steps=0, inverse_update_period=2,
                           curvature_ema=EMA, estimation_mode=mode)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    tx = optax.chain(
        curvax.kfac_preconditioner(_loss, batch, DAMPING, l2_reg=L2, curvature_ema=EMA, inverse_update_period=2,
                                   estimation_mode=mode),
        optax.sgd(LR, momentum=MOMENTUM),
    )
    p_opt, p_tx = params, params
    tx_state = tx.init(params)
    for i in range(5):
        key = jax.random.PRNGKey(10 + i)
        p_opt, state, _ = opt.step(p_opt, state, key, batch=batch, learning_rate=LR, momentum=MOMENTUM, damping=DAMPING)
        grads = jax.grad(_loss)(p_tx, batch)
        # The optimizer draws its curvature key as the first half of the step's key.
        updates, tx_state = tx.update(grads, tx_state, p_tx, batch=batch, rng=jax.random.split(key)[0])
        p_tx = optax.apply_updates(p_tx, updates)
        for name in params:
            np.testing.assert_allclose(p_tx[name], p_opt[name], rtol=2e-5, atol=2e-6, err_msg=f"step {i} {name}")
    assert int(tx_state[0].count) == 5
    # Not the plain gradient step: the preconditioning changed the direction.
    plain = optax.apply_updates(params, jax.tree_util.tree_map(lambda g: -LR * g, jax.grad(_loss)(params, batch)))
    first = optax.apply_updates(params, tx.update(jax.grad(_loss)(params, batch), tx.init(params), params, batch=batch)[0])
    assert max(float(jnp.max(jnp.abs(first[k] - plain[k]))) for k in params) > 1e-3


def test_inside_a_jitted_train_step_with_its_own_keys():
    params, batch = _data(32)
    tx = optax.chain(curvax.kfac_preconditioner(_loss, batch, 1e-2, inverse_update_period=3), optax.sgd(0.5))
    traces = []

    @jax.jit
    def train_step(params, opt_state, batch):
        traces.append(1)
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(params)
    keys, losses = [], []
    for _ in range(8):
        keys.append(np.asarray(opt_state[0].rng_key))
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
    assert len(traces) == 1
    assert losses[-1] < 0.7 * losses[0]
    assert len({k.tobytes() for k in keys}) == len(keys)  # a fresh key for every update


def test_damping_schedule_is_evaluated_at_the_count():
    params, batch = _data()
    grads = jax.grad(_loss)(params, batch)
    const = curvax.kfac_preconditioner(_loss, batch, 0.1, inverse_update_period=1)
    sched = curvax.kfac_preconditioner(_loss, batch, lambda count: 0.1 * (count + 1), inverse_update_period=1)
    s_const, s_sched = const.init(params), sched.init(params)
    u_const, s_const = const.update(grads, s_const, params, batch=batch)
    u_sched, s_sched = sched.update(grads, s_sched, params, batch=batch)
    # Count 0: the schedule gives 0.1, the constant's damping; count 1: 0.2, more damping, a shorter update.
    for k in params:
        np.testing.assert_allclose(u_sched[k], u_const[k], rtol=1e-6)
    u_const, _ = const.update(grads, s_const, params, batch=batch)
    u_sched, _ = sched.update(grads, s_sched, params, batch=batch)
    assert float(curvax.utils.norm(u_sched)) < float(curvax.utils.norm(u_const))


def test_bad_input_names_the_argument():
    params, batch = _data()
    with pytest.raises(ValueError, match="damping"):
        curvax.kfac_preconditioner(_loss, batch, -1.0)
    with pytest.raises(ValueError, match="inverse_update_period"):
        curvax.kfac_preconditioner(_loss, batch, 0.1, inverse_update_period=0)
    with pytest.raises(ValueError, match="curvature_ema"):
        curvax.kfac_preconditioner(_loss, batch, 0.1, curvature_ema=1.0)
    with pytest.raises(ValueError, match=r"`damping` must be a number in \[0, inf\), got True"):
        curvax.kfac_preconditioner(_loss, batch, True)
    with pytest.raises(ValueError, match="`inverse_update_period` must be an integer >= 1, got 2.0"):
        curvax.kfac_preconditioner(_loss, batch, 0.1, inverse_update_period=2.0)
    with pytest.raises(ValueError, match="l2_reg"):
        curvax.kfac_preconditioner(_loss, batch, 0.1, l2_reg=-1.0)
    with pytest.raises(ValueError, match="estimation_mode"):
        curvax.kfac_preconditioner(_loss, batch, 0.1, estimation_mode="fisher")
    with pytest.raises(TypeError, match="loss_fn"):
        curvax.kfac_preconditioner("loss", batch, 0.1)
    with pytest.raises(TypeError, match="`mesh` must be a jax.sharding.Mesh"):
        curvax.kfac_preconditioner(_loss, batch, 0.1, mesh=jax.devices())
    # A one-device mesh splits nothing: the same numbers as no mesh.
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    g = jax.grad(_loss)(params, batch)
    t_none, t_one = curvax.kfac_preconditioner(_loss, batch, 0.1), curvax.kfac_preconditioner(_loss, batch, 0.1, mesh=one)
    u_none, _ = t_none.update(g, t_none.init(params), params, batch=batch)
    u_one, _ = t_one.update(g, t_one.init(params), params, batch=batch)
    for a, b in zip(jax.tree_util.tree_leaves(u_none), jax.tree_util.tree_leaves(u_one)):
        np.testing.assert_array_equal(a, b)
    tx = curvax.kfac_preconditioner(_loss, batch, 0.1)
    state = tx.init(params)
    grads = jax.grad(_loss)(params, batch)
    with pytest.raises(ValueError, match="batch"):
        tx.update(grads, state, params)
    with pytest.raises(ValueError, match="params"):
        tx.update(grads, state, batch=batch)
    with pytest.raises(ValueError, match="structure"):
        tx.update({"w1": grads["w1"]}, state, params, batch=batch)
    with pytest.raises(ValueError, match="batch"):
        tx.update(grads, state, params, batch=(batch[0], batch[1][:5]))
    other = {**params, "w2": jnp.zeros((7, 3)), "b2": jnp.zeros(3)}
    with pytest.raises(ValueError, match="`params` passed to update differ"):
        tx.update(grads, state, other, batch=batch)
    with pytest.raises(ValueError, match="`params` passed to init differ"):
        tx.init(other)
    with pytest.raises(RuntimeError, match="init"):
        curvax.kfac_preconditioner(_loss, batch, 0.1).update(grads, state, params, batch=batch)


def test_no_registered_loss_is_a_clear_error():
    params, batch = _data()
    tx = curvax.kfac_preconditioner(lambda p, b: jnp.sum(b[0] @ p["w1"]), batch, 0.1)
    with pytest.raises(ValueError, match="loss"):
        tx.init(params)


@pytest.mark.parametrize("framework", ["plain_jax", "flax_linen", "flax_nnx", "haiku", "equinox"])
def test_each_frameworks_cnn_trains_through_optax(framework):
    import zoo

    loss, params, batch = zoo.BUILDERS["cnn"][framework](jax.random.PRNGKey(0))
    pre = curvax.kfac_preconditioner(loss, batch, 1e-2, inverse_update_period=2)
    tx = optax.chain(pre, optax.sgd(0.2))

    @jax.jit
    def train_step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = tx.init(params)
    # The conv and dense layers got Kronecker blocks, not the generic fallback.
    kinds = [type(b).__qualname__ for b in opt_state[0].estimator_state.blocks_states]
    assert len(kinds) == 2 and all("Kronecker" in k for k in kinds), kinds
    losses = []
    for _ in range(5):
        params, opt_state, value = train_step(params, opt_state, batch)
        losses.append(float(value))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
