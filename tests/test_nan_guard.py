"""No silent failure: non-finite batches, diverging losses, degenerate damping, empty batches.

* A batch with one NaN example is skipped whole (parameters and curvature statistics keep
  their values, both counted in the state and reported in the stats and the "curvax" log);
  the following clean batches train as if it had never come. The same for the Optax path.
* A NaN loss whose gradient is finite (out-of-range labels) follows the same rule.
* A finite loss that blows up is reported (``loss_diverged`` and a log line).
* Negative damping is refused; zero damping only with ``l2_reg > 0``.
* An empty batch is refused with a clear error (half precision trains: tests/test_mixed_precision.py).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from xla_env import child_env

import curvax
from curvax import estimators

import models
from models import plain_jax


def _leaves_finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree)
               if jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def _poisoned(batch):
    x, y = batch
    return x.at[1, 0].set(jnp.nan), y


def _optimizer(loss_fn, **kw):
    args = dict(l2_reg=1e-3, num_burnin_steps=0, inverse_update_period=2)
    args.update(kw)
    return curvax.Optimizer(jax.value_and_grad(loss_fn), **args)


HYPER = dict(learning_rate=0.1, momentum=0.5, damping=1e-2)


def _initialized():
    """``(opt, params, state, batch)``: the plain MLP's optimizer (``_optimizer``), initialized on its batch."""
    loss_fn, params, batch = plain_jax(jax.random.PRNGKey(0))
    opt = _optimizer(loss_fn)
    return opt, params, opt.init(params, jax.random.PRNGKey(1), batch), batch


def test_a_nan_example_skips_the_step_and_the_statistics_update_and_training_continues(caplog):
    opt, params, state, batch = _initialized()
    caplog.set_level(logging.WARNING, logger="curvax")

    params, state, stats = opt.step(params, state, jax.random.PRNGKey(2), batch=batch, **HYPER)
    assert not bool(stats["curvature_update_skipped"]) and not bool(stats["update_skipped"])
    before_params, before_stats = params, state.estimator_state

    params, state, stats = opt.step(params, state, jax.random.PRNGKey(3), batch=_poisoned(batch), **HYPER)
    assert bool(stats["update_skipped"]) and bool(stats["curvature_update_skipped"])
    assert int(stats["updates_skipped"]) == 1 and int(stats["curvature_updates_skipped"]) == 1
    # Nothing moved: parameters and statistics are exactly those before the bad batch (the
    # inverse cache refreshed on this step, from the kept statistics).
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(before_params)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(estimators._statistics_leaves(state.estimator_state.blocks_states[0]),
                    estimators._statistics_leaves(before_stats.blocks_states[0])):
        np.testing.assert_array_equal(a, b)
    assert _leaves_finite(state)  # what a checkpoint would save
    jax.block_until_ready(stats)

    losses = []
    for i in range(6):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(10 + i), batch=batch, **HYPER)
        assert not bool(stats["update_skipped"]) and not bool(stats["curvature_update_skipped"])
        losses.append(float(stats["loss"]))
    assert losses[-1] < 0.8 * losses[0]
    assert int(stats["updates_skipped"]) == 1 and int(stats["curvature_updates_skipped"]) == 1
    assert _leaves_finite(state) and _leaves_finite(params)
    lines = [r.getMessage() for r in caplog.records if r.name == "curvax"]
    assert any("step 2" in l and "update skipped" in l and "statistics update skipped" in l for l in lines), lines


def test_a_nan_batch_in_the_burn_in_is_dropped_and_counted():
    loss_fn, params, batch = plain_jax(jax.random.PRNGKey(0))
    opt = _optimizer(loss_fn, num_burnin_steps=3)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    batches = iter([batch, _poisoned(batch), batch, batch])
    params, state, stats = opt.step(params, state, jax.random.PRNGKey(2), data_iterator=batches, **HYPER)
    assert int(stats["curvature_updates_skipped"]) == 1 and not bool(stats["update_skipped"])
    assert _leaves_finite(state)


def test_a_nan_loss_with_a_finite_gradient_is_skipped_like_a_nan_batch():
    """Out-of-range labels make ``take_along_axis`` fill NaN: the loss is NaN, its gradient finite."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {"w": jax.random.normal(k1, (4, 3)), "b": jnp.zeros(3)}
    x = jax.random.normal(k2, (8, 4))
    labels = jnp.arange(8) % 3

    def loss_fn(p, batch):
        x, y = batch
        logits = x @ p["w"] + p["b"]
        curvax.register_softmax_cross_entropy_loss(logits, y)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    bad = (x, labels.at[0].set(7))
    value, grads = jax.value_and_grad(loss_fn)(params, bad)
    assert bool(jnp.isnan(value)) and _leaves_finite(grads)  # the premise
    opt = _optimizer(loss_fn)
    state = opt.init(params, jax.random.PRNGKey(1), (x, labels))
    new_params, state, stats = opt.step(params, state, jax.random.PRNGKey(2), batch=bad, **HYPER)
    assert bool(stats["update_skipped"]) and int(stats["updates_skipped"]) == 1
    for a, b in zip(jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)
    new_params, state, stats = opt.step(new_params, state, jax.random.PRNGKey(3), batch=(x, labels), **HYPER)
    assert not bool(stats["update_skipped"]) and _leaves_finite(new_params)


def test_a_blown_up_loss_is_reported_in_the_stats_and_the_log(caplog):
    opt, params, state, batch = _initialized()
    caplog.set_level(logging.WARNING, logger="curvax")
    params, state, stats = opt.step(params, state, jax.random.PRNGKey(2), batch=batch, **HYPER)
    assert not bool(stats["loss_diverged"])
    first = float(stats["loss"])
    x, y = batch
    huge = (x, y * 1e4)  # a loss ~1e8 times the first one
    params, state, stats = opt.step(params, state, jax.random.PRNGKey(3), batch=huge, **HYPER)
    assert float(stats["loss"]) > curvax.optimizer.DIVERGENCE_FACTOR * max(first, 1.0)
    assert bool(stats["loss_diverged"]) and not bool(stats["update_skipped"])
    jax.block_until_ready(stats)
    opt.step(params, state, jax.random.PRNGKey(4), batch=batch, **HYPER)
    lines = [r.getMessage() for r in caplog.records if r.name == "curvax"]
    assert any("step 2" in l and "diverging" in l for l in lines), lines


def test_step_inside_the_users_own_jit_gives_the_same_step():
    # The host-side report must not read traced stats (kfac-jax users wrap ``step`` in jit too).
    opt, params, state, batch = _initialized()
    jitted = jax.jit(lambda p, s, r, b: opt.step(p, s, r, batch=b, **HYPER))
    p1, _, stats1 = jitted(params, state, jax.random.PRNGKey(2), _poisoned(batch))
    p2, _, stats2 = opt.step(params, state, jax.random.PRNGKey(2), batch=_poisoned(batch), **HYPER)
    assert bool(stats1["update_skipped"]) and bool(stats2["update_skipped"])
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p2)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_optax_path_statistics_never_absorb_a_nan_batch():
    loss_fn, params, batch = plain_jax(jax.random.PRNGKey(0))
    tx = optax.chain(curvax.kfac_preconditioner(loss_fn, batch, damping=1e-2, l2_reg=1e-3, inverse_update_period=2),
                     optax.sgd(0.1, momentum=0.5))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, b):
        loss, grads = jax.value_and_grad(loss_fn)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params, batch=b)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, _ = step(params, opt_state, batch)
    kept = opt_state[0].estimator_state
    params, opt_state, _ = step(params, opt_state, _poisoned(batch))
    assert int(opt_state[0].curvature_updates_skipped) == 1
    for a, b in zip(estimators._statistics_leaves(opt_state[0].estimator_state.blocks_states[0]),
                    estimators._statistics_leaves(kept.blocks_states[0])):
        np.testing.assert_array_equal(a, b)
    assert _leaves_finite(opt_state[0]) and _leaves_finite(params)
    losses = []
    for _ in range(6):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0]
    assert int(opt_state[0].curvature_updates_skipped) == 1 and _leaves_finite(opt_state)


def test_finite_statistics_pass_the_guard_bit_for_bit():
    loss_fn, params, batch = plain_jax(jax.random.PRNGKey(0))
    est = curvax.BlockDiagonalCurvature(loss_fn)
    s0 = est.init(jax.random.PRNGKey(1), (params, batch))
    s1 = est.update_curvature_matrix_estimate(s0, 0.9, 1.0, 4, jax.random.PRNGKey(2), (params, batch))
    kept, skipped = estimators.keep_finite_statistics(s0, s1)
    assert not bool(skipped)
    for a, b in zip(jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves(s1)):
        np.testing.assert_array_equal(a, b)


# --- damping, empty batches, dtypes ----------------------------------------------------------


def test_negative_damping_is_refused_everywhere_and_zero_only_without_l2_reg():
    loss_fn, params, batch = plain_jax(jax.random.PRNGKey(0))
    vg = jax.value_and_grad(loss_fn)
    with pytest.raises(ValueError, match="`initial_damping`"):
        curvax.Optimizer(vg, l2_reg=0.0, use_adaptive_damping=True, initial_damping=-1.0)
    with pytest.raises(ValueError, match="`initial_damping`=0 with l2_reg=0"):
        curvax.Optimizer(vg, l2_reg=0.0, use_adaptive_damping=True, initial_damping=0.0)
    with pytest.raises(ValueError, match="`damping`"):
        curvax.kfac_preconditioner(loss_fn, batch, damping=-1e-3)
    with pytest.raises(ValueError, match="`damping`=0 with l2_reg=0"):
        curvax.kfac_preconditioner(loss_fn, batch, damping=0.0)
    curvax.kfac_preconditioner(loss_fn, batch, damping=0.0, l2_reg=1e-3)  # defined: l2_reg damps

    opt = _optimizer(loss_fn, l2_reg=0.0)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    for bad, match in ((-1e-2, "`damping` must be a finite number >= 0"), (0.0, "`damping`=0 with l2_reg=0"),
                       (float("nan"), "`damping`")):
        with pytest.raises(ValueError, match=match):
            opt.step(params, state, jax.random.PRNGKey(2), batch=batch, learning_rate=0.1, momentum=0.0, damping=bad)

    # Zero damping with l2_reg > 0 is the identity weight l2_reg: updates are taken.
    opt = _optimizer(loss_fn, l2_reg=1e-2)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    _, _, stats = opt.step(params, state, jax.random.PRNGKey(2), batch=batch, learning_rate=0.1, momentum=0.0, damping=0.0)
    assert not bool(stats["update_skipped"])


def test_kfac_jax_optax_preconditioner_takes_zero_damping_with_a_warning():
    """kfac-jax's own tests build ``OptaxPreconditioner(damping=0.0)`` just to compute curvature."""
    loss_fn, params, batch = plain_jax(jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="`damping`"):
        curvax.OptaxPreconditioner(loss_fn, damping=-1.0)
    with pytest.warns(UserWarning, match="`damping`=0 with l2_reg=0"):
        pre = curvax.OptaxPreconditioner(loss_fn, damping=0.0, l2_reg=0.0, curvature_ema=0.0)
    state = pre.init((params, batch), jax.random.PRNGKey(1))
    state = pre.maybe_update_estimator_curvature(state, (params, batch), jax.random.PRNGKey(2), sync=False)
    dense = pre.estimator.to_dense_matrix(state.estimator_state)
    assert np.all(np.isfinite(np.asarray(dense))) and float(jnp.abs(dense).max()) > 0


def test_kfac_jax_optax_preconditioner_drops_and_counts_a_nan_batch():
    loss_fn, params, batch = plain_jax(jax.random.PRNGKey(0))
    pre = curvax.OptaxPreconditioner(loss_fn, damping=1e-2, l2_reg=1e-3, inverse_update_period=1)
    state = pre.init((params, batch), jax.random.PRNGKey(1))
    state = pre.maybe_update(state, (params, batch), jax.random.PRNGKey(2))
    assert int(state.curvature_updates_skipped) == 0
    before = jax.tree_util.tree_leaves(state.estimator_state)
    bad = pre.maybe_update(state, (params, _poisoned(batch)), jax.random.PRNGKey(3))
    assert int(bad.curvature_updates_skipped) == 1
    for a, b in zip(jax.tree_util.tree_leaves(bad.estimator_state), before):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    good = pre.maybe_update(pre.increment_count(bad), (params, batch), jax.random.PRNGKey(4))
    assert int(good.curvature_updates_skipped) == 1 and int(good.count) == 1
    assert _leaves_finite(good.estimator_state)
    # kfac-jax's two-field state (built by hand) still works; nothing is counted in it
    legacy = curvax.OptaxPreconditionState(state.count, state.estimator_state)
    assert pre.maybe_update(legacy, (params, _poisoned(batch)), jax.random.PRNGKey(3)).curvature_updates_skipped is None


def test_an_empty_batch_is_refused_naming_the_batch():
    loss_fn, params, batch = plain_jax(jax.random.PRNGKey(0))
    empty = jax.tree_util.tree_map(lambda a: a[:0], batch)
    opt = _optimizer(loss_fn)
    with pytest.raises(ValueError, match=r"`batch` is empty \(batch size 0\)"):
        opt.init(params, jax.random.PRNGKey(1), empty)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    with pytest.raises(ValueError, match=r"`batch` is empty"):
        opt.step(params, state, jax.random.PRNGKey(2), batch=empty, **HYPER)
    with pytest.raises(ValueError, match=r"`example_batch` is empty"):
        curvax.kfac_preconditioner(loss_fn, empty, damping=1e-3)
    est = curvax.BlockDiagonalCurvature(loss_fn)
    s = est.init(jax.random.PRNGKey(1), (params, batch))
    with pytest.raises(ValueError, match="`batch_size` must be positive"):
        est.update_curvature_matrix_estimate(s, 0.9, 1.0, 0, jax.random.PRNGKey(2), (params, batch))


# --- several devices: one device's NaN example, one decision everywhere --------------------------

_CHILD = r'''
import os, json
import xla_env
xla_env.request_devices(4)
import jax, jax.numpy as jnp, numpy as np
import curvax, models

params, batch = models.classifier(32)
rep = curvax.utils.replicate_all_local_devices
split = lambda b: jax.tree_util.tree_map(lambda a: a.reshape((4, -1) + a.shape[1:]), b)
x, y = batch
bad = split((x.at[9, 0].set(jnp.nan), y))  # example 9: on device 1 only
good = split(batch)
out = {}

opt = curvax.Optimizer(jax.value_and_grad(models.softmax_loss), l2_reg=1e-3, num_burnin_steps=0,
                       inverse_update_period=1, multi_device=True, pmap_axis_name="d")
p = rep(params)
state = opt.init(p, rep(jax.random.PRNGKey(0)), good)
hyper = {k: rep(jnp.asarray(v)) for k, v in dict(learning_rate=0.1, momentum=0.5, damping=1e-2).items()}
keys = lambda i: jax.random.split(jax.random.PRNGKey(i), 4)
p, state, s0 = opt.step(p, state, keys(1), batch=good, **hyper)
p, state, s1 = opt.step(p, state, keys(2), batch=bad, **hyper)
p, state, s2 = opt.step(p, state, keys(3), batch=good, **hyper)
out["skipped"] = np.asarray(s1["update_skipped"]).tolist()
out["curvature_skipped"] = np.asarray(s1["curvature_update_skipped"]).tolist()
out["after"] = np.asarray(s2["update_skipped"]).tolist() + np.asarray(s2["curvature_update_skipped"]).tolist()
leaves = [np.asarray(l) for l in jax.tree_util.tree_leaves((p, state))]
out["finite"] = all(bool(np.all(np.isfinite(l))) for l in leaves if l.dtype.kind == "f")
out["same_on_devices"] = all(bool(np.all(l == l[:1])) for l in leaves)

# kfac-jax's OptaxPreconditioner without syncing: each device's statistics are its own, and
# the guard's decision is still taken for all devices together.
pre = curvax.OptaxPreconditioner(models.softmax_loss, l2_reg=1e-3, damping=1e-2, inverse_update_period=1,
                                 pmap_axis_name="d")
st = jax.pmap(lambda p, b: pre.init((p, b), jax.random.PRNGKey(0)), axis_name="d")(rep(params), good)
upd = jax.pmap(lambda s, p, b: pre.maybe_update_estimator_curvature(s, (p, b), jax.random.PRNGKey(1), sync=False),
               axis_name="d")
new = upd(st, rep(params), bad)
changed = [[bool(np.any(np.asarray(a)[d] != np.asarray(b)[d])) for d in range(4)]
           for a, b in zip(jax.tree_util.tree_leaves(new.estimator_state), jax.tree_util.tree_leaves(st.estimator_state))]
out["optax_changed_per_device"] = [any(c[d] for c in changed) for d in range(4)]
print(json.dumps(out))
'''


@pytest.mark.slow  # a subprocess with four CPU devices compiling pmapped steps
def test_a_nan_example_on_one_device_is_skipped_on_every_device():
    import json
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=Path(__file__).parent,
                          env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["skipped"] == [True] * 4 and r["curvature_skipped"] == [True] * 4
    assert r["after"] == [False] * 8
    assert r["finite"] and r["same_on_devices"]
    assert r["optax_changed_per_device"] == [False] * 4  # device 1's NaN drops every device's update


@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan, 3.0e38])
def test_statistics_finiteness_test_is_exact_under_jit(bad):
    """``statistics_are_finite`` decides from ``sum(x * 0)``: every non-finite entry must make it
    False, in any leaf, under ``jit`` (XLA must not fold ``x * 0`` to 0), and no finite entry may,
    even the largest float32 ones (whose plain sum would overflow)."""
    est = curvax.BlockDiagonalCurvature(models.softmax_loss)
    params, batch = models.classifier(8)
    state = est.init(jax.random.PRNGKey(0), (params, batch), None, None, False)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    stats = [i for i, x in enumerate(leaves) if getattr(x, "ndim", 0) == 2]
    assert stats
    if bad is not None:
        i = stats[-1]
        leaves[i] = leaves[i].at[0, -1].set(bad)
        if bad == 3.0e38:  # many huge finite entries in every matrix
            leaves = [x.at[...].set(3.0e38) if getattr(x, "ndim", 0) == 2 else x for x in leaves]
    got = jax.jit(estimators.statistics_are_finite)(jax.tree_util.tree_unflatten(treedef, leaves))
    assert bool(got) == (bad is None or np.isfinite(bad))


def test_init_refuses_parameters_with_a_nan_naming_the_leaf():
    """``init`` counts the non-finite entries of the first bad leaf (tree order) and names it;
    integer leaves and traced parameters are not read (the multi-process case, leaves on other
    processes' devices: tests/test_sharding.py)."""
    from curvax.step import config

    params = {"a": np.ones((2, 3)), "b": np.array([1.0, np.inf, np.nan]), "c": np.array([np.nan]), "n": np.arange(3)}
    with pytest.raises(ValueError, match=r"hold 2 non-finite value\(s\) in \['b'\]"):
        config.check_finite_params(params)
    config.check_finite_params({"a": params["a"], "n": params["n"]})
    jax.jit(lambda p: config.check_finite_params(p) or 0)(params)  # traced: unchecked
    loss_fn, good, batch = plain_jax(jax.random.PRNGKey(0))
    bad = jax.tree_util.tree_map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), good)
    with pytest.raises(ValueError, match="`params` given to init hold 1 non-finite"):
        _optimizer(loss_fn).init(bad, jax.random.PRNGKey(1), batch)


def _failing_cholesky(monkeypatch, fail_in: tuple) -> list:
    """``jax.scipy.linalg.cho_factor`` returning NaN for inputs of the dtypes in ``fail_in``
    (a float32 factorization that broke down); returns the dtypes it was called with."""
    real = jax.scipy.linalg.cho_factor
    seen = []

    def fake(a, *args, **kwargs):
        seen.append(jnp.dtype(a.dtype))
        c, lower = real(a, *args, **kwargs)
        return (c * jnp.nan if jnp.dtype(a.dtype) in fail_in else c), lower

    monkeypatch.setattr(jax.scipy.linalg, "cho_factor", fake)
    return seen


def _one_step_solving_every_step(**hyper):
    """Parameters after one step of the plain MLP with ``inverse_update_period=1`` (the damped
    factors are solved with on every step, not inverted), and the step's stats."""
    loss_fn, params, batch = plain_jax(jax.random.PRNGKey(0))
    opt = _optimizer(loss_fn, inverse_update_period=1)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    new_params, _, stats = opt.step(params, state, jax.random.PRNGKey(2), batch=batch, **hyper)
    return new_params, stats


def test_a_float32_factor_solve_that_breaks_down_is_redone_in_float64(monkeypatch):
    """The solves with the damped factors are plain Cholesky solves; when one gives non-finite
    values in a float32 program, the whole preconditioned gradient is recomputed in float64
    (one branch for all blocks): the same update as when nothing failed, nothing skipped."""
    with jax.enable_x64(False):
        want, _ = _one_step_solving_every_step(**HYPER)
        seen = _failing_cholesky(monkeypatch, (jnp.dtype(jnp.float32),))
        got, stats = _one_step_solving_every_step(**HYPER)
    assert jnp.dtype(jnp.float64) in seen and jnp.dtype(jnp.float32) in seen
    assert not bool(stats["update_skipped"]) and int(stats["updates_skipped"]) == 0
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_factor_solve_that_fails_in_float64_too_skips_the_update_and_counts_it(monkeypatch):
    """No NaN reaches the parameters: the update is skipped and counted (and logged, as every
    skip: ``test_a_nan_example_skips_the_step...``)."""
    with jax.enable_x64(False):
        _, params, _ = plain_jax(jax.random.PRNGKey(0))
        _failing_cholesky(monkeypatch, (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)))
        got, stats = _one_step_solving_every_step(**HYPER)
    assert bool(stats["update_skipped"]) and int(stats["updates_skipped"]) == 1
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)
