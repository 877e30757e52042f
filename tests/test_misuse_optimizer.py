"""What a user gets wrong with the optimizer's arguments: each case gives a clear error naming the
argument, or, where the value is only known inside the compiled step, a skipped update whose
stats and log name it. Outcomes are asserted numerically (parameters unchanged, statistics not
absorbed)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
import models


def _nll(params, batch):
    """Softmax cross-entropy through take_along_axis: an out-of-range label gives a NaN loss."""
    x, y = batch
    logits = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    curvax.register_softmax_cross_entropy_loss(logits, y)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1, mode="fill"))


def _opt(**kw):
    args = dict(l2_reg=1e-3, num_burnin_steps=0, inverse_update_period=1)
    args.update(kw)
    return curvax.Optimizer(jax.value_and_grad(_nll), **args)


@pytest.fixture(scope="module")
def data():
    return models.classifier(16, (5, 7, 4))


def test_max_damping_below_min_damping_is_refused():
    with pytest.raises(ValueError, match="`max_damping`.*`min_damping`"):
        _opt(use_adaptive_damping=True, initial_damping=1.0, min_damping=1e-2, max_damping=1e-3,
             learning_rate_schedule=lambda s: 0.1, momentum_schedule=lambda s: 0.0)


@pytest.mark.parametrize("name, value", [("learning_rate", np.nan), ("momentum", np.inf), ("damping", -1.0)])
def test_concrete_coefficients_out_of_range_are_refused(data, name, value):
    params, batch = data
    opt = _opt()
    state = opt.init(params, jax.random.PRNGKey(0), batch)
    kw = dict(learning_rate=0.1, momentum=0.0, damping=1.0)
    kw[name] = value
    with pytest.raises(ValueError, match=f"`{name}`"):
        opt.step(params, state, jax.random.PRNGKey(1), batch=batch, **kw)


def test_schedule_out_of_range_at_step_zero_is_refused():
    with pytest.raises(ValueError, match="`damping_schedule` returned"):
        _opt(damping_schedule=lambda s: -0.5 + 0.0 * s)
    with pytest.raises(ValueError, match="`learning_rate_schedule` returned"):
        _opt(learning_rate_schedule=lambda s: jnp.nan + 0.0 * s)


def test_schedule_leaving_the_range_later_skips_and_names_it(data, caplog):
    params, batch = data
    # Positive at step 0, negative from step 1: only the compiled step can see it.
    opt = _opt(damping_schedule=lambda s: 1.0 - 2.0 * s)
    state = opt.init(params, jax.random.PRNGKey(0), batch)
    p1, state, s0 = opt.step(params, state, jax.random.PRNGKey(1), batch=batch, learning_rate=0.1, momentum=0.0)
    assert not bool(s0["damping_invalid"]) and not bool(s0["update_skipped"])
    with caplog.at_level(logging.WARNING, logger="curvax"):
        p2, state, s1 = opt.step(p1, state, jax.random.PRNGKey(2), batch=batch, learning_rate=0.1, momentum=0.0)
        for i in range(3, 12):  # the report appears once the flags are ready
            p2, state, _ = opt.step(p2, state, jax.random.PRNGKey(i), batch=batch, learning_rate=0.1, momentum=0.0)
        jax.block_until_ready(p2)
        opt.step(p2, state, jax.random.PRNGKey(99), batch=batch, learning_rate=0.1, momentum=0.0)
    assert bool(s1["damping_invalid"]) and bool(s1["update_skipped"])
    assert not bool(s1["learning_rate_invalid"]) and not bool(s1["momentum_invalid"])
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "damping out of range" in caplog.text


def test_traced_learning_rate_nan_is_flagged_by_name(data):
    params, batch = data
    opt = _opt()
    state = opt.init(params, jax.random.PRNGKey(0), batch)

    @jax.jit
    def run(params, state, lr):
        return opt.step(params, state, jax.random.PRNGKey(1), batch=batch, learning_rate=lr, momentum=0.0,
                        damping=1.0, global_step_int=0)

    new_params, _, stats = run(params, state, jnp.float32(jnp.nan))
    assert bool(stats["learning_rate_invalid"]) and bool(stats["update_skipped"])
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(new_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_non_finite_params_at_init_are_named(data):
    params, batch = data
    bad = dict(params, w2=params["w2"].at[1, 2].set(jnp.nan))
    with pytest.raises(ValueError, match=r"`params`.*\['w2'\]"):
        _opt().init(bad, jax.random.PRNGKey(0), batch)


def test_data_iterator_too_short_for_burn_in(data):
    params, batch = data
    opt = _opt(num_burnin_steps=3)
    state = opt.init(params, jax.random.PRNGKey(0), batch)
    with pytest.raises(ValueError, match="`data_iterator` ran out after 2 batch.*num_burnin_steps=3"):
        opt.step(params, state, jax.random.PRNGKey(1), data_iterator=iter([batch, batch]), learning_rate=0.1,
                 momentum=0.0, damping=1.0)
    with pytest.raises(ValueError, match="`data_iterator` is exhausted"):
        opt.step(params, state, jax.random.PRNGKey(1), data_iterator=iter([batch] * 3), learning_rate=0.1,
                 momentum=0.0, damping=1.0)


def test_state_from_another_model_names_state(data):
    params, batch = data
    other_params, other_batch = models.classifier(16, (5, 9, 4))
    other_state = _opt().init(other_params, jax.random.PRNGKey(0), other_batch)
    opt = _opt()
    opt.init(params, jax.random.PRNGKey(0), batch)
    with pytest.raises(ValueError, match=r"`state` leaf .* another model"):
        opt.step(params, other_state, jax.random.PRNGKey(1), batch=batch, learning_rate=0.1, momentum=0.0, damping=1.0)


def test_checks_skipped_for_a_repeated_signature_still_catch_a_changed_call(data):
    """After a good step the structural checks are skipped for arguments of the same structure,
    shapes and dtypes (host time); any change to those still gets the checks' clear errors."""
    params, batch = data
    other_params, other_batch = models.classifier(16, (5, 9, 4))
    other_state = _opt().init(other_params, jax.random.PRNGKey(0), other_batch)
    opt = _opt()
    state = opt.init(params, jax.random.PRNGKey(0), batch)
    kw = dict(learning_rate=0.1, momentum=0.0, damping=1.0)
    params, state, _ = opt.step(params, state, jax.random.PRNGKey(1), batch=batch, **kw)
    params, state, _ = opt.step(params, state, jax.random.PRNGKey(2), batch=batch, **kw)  # the fast path
    with pytest.raises(ValueError, match=r"`state` leaf .* another model"):
        opt.step(params, other_state, jax.random.PRNGKey(1), batch=batch, **kw)
    with pytest.raises(ValueError, match="`params` differ in structure, shapes or dtypes"):
        opt.step(dict(params, w1=params["w1"][:, :3]), state, jax.random.PRNGKey(1), batch=batch, **kw)
    with pytest.raises(ValueError, match="`params` differ in structure, shapes or dtypes"):
        opt.step(dict(params, w1=params["w1"].astype(jnp.float16)), state, jax.random.PRNGKey(1), batch=batch, **kw)
    with pytest.raises(TypeError, match="`rng` must be a JAX PRNG key"):
        opt.step(params, state, jnp.zeros(2, jnp.float32), batch=batch, **kw)
    with pytest.raises(ValueError, match="exactly one of `data_iterator` and `batch`"):
        opt.step(params, state, jax.random.PRNGKey(1), data_iterator=iter([batch]), batch=batch, **kw)
    with pytest.raises(ValueError, match="step needs `learning_rate=`"):
        opt.step(params, state, jax.random.PRNGKey(1), batch=batch, momentum=0.0, damping=1.0)
    assert opt.trace_count == 1


@pytest.mark.parametrize("mode", ["fisher_empirical", "fisher_gradients", "ggn_curvature_prop"])
def test_out_of_range_labels_are_never_absorbed(data, mode):
    params, (x, y) = data
    opt = _opt(estimation_mode=mode)
    state = opt.init(params, jax.random.PRNGKey(0), (x, y))
    p1, s1, stats = opt.step(params, state, jax.random.PRNGKey(1), batch=(x, y), learning_rate=0.1, momentum=0.0,
                             damping=1.0)
    assert not bool(stats["curvature_update_skipped"])
    bad_y = y.at[3].set(11)  # 4 classes
    p2, s2, stats = opt.step(p1, s1, jax.random.PRNGKey(2), batch=(x, bad_y), learning_rate=0.1, momentum=0.0,
                             damping=1.0)
    assert bool(stats["update_skipped"]) and bool(stats["curvature_update_skipped"])
    assert int(s2.curvature_updates_skipped) == 1
    # The statistics are exactly those before the invalid batch (the moving average never saw it).
    for a, b in zip(jax.tree_util.tree_leaves(s1.estimator_state), jax.tree_util.tree_leaves(s2.estimator_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_float64_adaptive_damping_with_given_coefficients(x64):
    # Regression: the quadratic model's change was float64 on adapting steps and float32 (NaN)
    # on the others, and the step failed to compile.
    params, batch = models.classifier(16, (5, 7, 4))
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.float64), params)
    batch = (batch[0].astype(jnp.float64), batch[1])
    opt = curvax.Optimizer(
        jax.value_and_grad(models.softmax_loss), l2_reg=1e-3, use_adaptive_damping=True, initial_damping=1.0,
        damping_adaptation_interval=2, num_burnin_steps=0,
    )
    state = opt.init(params, jax.random.PRNGKey(0), batch)
    rhos = []
    for i in range(4):
        params, state, s = opt.step(params, state, jax.random.PRNGKey(i), batch=batch, learning_rate=0.1, momentum=0.0)
        rhos.append(float(s["rho"]))
    assert np.isnan(rhos[0]) and np.isfinite(rhos[1]) and np.isnan(rhos[2]) and np.isfinite(rhos[3])
    assert float(state.damping) != 1.0  # it adapted
