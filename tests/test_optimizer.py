"""The Optimizer: known behaviour, the quadratic model, damping, input checking."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax
import models

KEY = jax.random.PRNGKey(0)
L2 = 1e-2


def mlp(p, x):
    h = jnp.tanh(x @ p[0]["w"] + p[0]["b"])
    return h @ p[1]["w"] + p[1]["b"]


def init_mlp(key, d_in=4, d_hid=6, d_out=3):
    k1, k2 = jax.random.split(key)
    return [
        {"w": jax.random.normal(k1, (d_in, d_hid)) / 2, "b": jnp.zeros(d_hid)},
        {"w": jax.random.normal(k2, (d_hid, d_out)) / 2, "b": jnp.zeros(d_out)},
    ]


def classification_batch(key, n=16, d_in=4, classes=3):
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (n, d_in)), jax.random.randint(ky, (n,), 0, classes)


def ce_loss(p, batch):
    x, y = batch
    logits = mlp(p, x)
    curvax.register_softmax_cross_entropy_loss(logits, y)
    ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))
    return ce + 0.5 * L2 * curvax.utils.inner_product(p, p)


def exact_ggn(p, batch):
    """Dense (1/B) sum_n J_n^T F_n J_n for the softmax MLP."""
    flat, unravel = ravel_pytree(p)
    x = batch[0]
    jac = jax.vmap(lambda xi: jax.jacobian(lambda f: mlp(unravel(f), xi[None])[0])(flat))(x)
    probs = jax.nn.softmax(mlp(p, x))
    fl = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(probs)
    return jnp.einsum("nkp,nkl,nlq->pq", jac, fl, jac) / x.shape[0]


def make_opt(**kwargs):
    defaults = dict(value_and_grad_func=jax.value_and_grad(ce_loss), l2_reg=L2, num_burnin_steps=0)
    defaults.update(kwargs)
    return curvax.Optimizer(**defaults)


def test_newton_step_solves_linear_least_squares_in_one_step():
    """Single dense layer, squared error: K-FAC with exact inverses is Newton's method."""
    kx, kw, kt = jax.random.split(KEY, 3)
    x = jax.random.normal(kx, (32, 5))
    t = x @ jax.random.normal(kw, (5, 3)) + 0.1 * jax.random.normal(kt, (32, 3))

    def loss(p, b):
        out = b[0] @ p["w"] + p["b"]
        curvax.register_squared_error_loss(out, b[1])
        return jnp.mean(jnp.sum((out - b[1]) ** 2, -1))

    params = {"w": jnp.zeros((5, 3)), "b": jnp.zeros(3)}
    opt = curvax.Optimizer(
        jax.value_and_grad(loss), l2_reg=0.0, estimation_mode="ggn_exact", curvature_ema=0.0,
        inverse_update_period=1, use_exact_inverses=True, num_burnin_steps=0,
    )
    state = opt.init(params, KEY, (x, t))
    params, state, stats = opt.step(params, state, KEY, batch=(x, t), learning_rate=1.0, momentum=0.0, damping=1e-6)
    xa = jnp.concatenate([x, jnp.ones((32, 1))], 1)
    best = jnp.linalg.lstsq(xa, t)[0]
    np.testing.assert_allclose(params["w"], best[:5], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(loss(params, (x, t)), loss({"w": best[:5], "b": best[5]}, (x, t)), rtol=1e-3)


def test_adaptive_learning_rate_and_momentum_minimise_the_exact_quadratic_model():
    """After a step, the update delta is the minimiser of the damped quadratic model
    over span(precond_grad, velocity); since delta and the old velocity span the same
    plane, the model's gradient at delta is orthogonal to both."""
    with jax.enable_x64(True):
        params = init_mlp(KEY)
        batch = classification_batch(jax.random.PRNGKey(1))
        damping = 0.5
        opt = make_opt(use_adaptive_learning_rate=True, use_adaptive_momentum=True, estimation_mode="fisher_exact")
        state = opt.init(params, KEY, batch)
        for i in range(3):
            old_v = state.velocities
            g = jax.grad(ce_loss)(params, batch)
            c = exact_ggn(params, batch) + (L2 + damping) * jnp.eye(ravel_pytree(params)[0].size)
            new_params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=batch, damping=damping)
            delta = ravel_pytree(state.velocities)[0]
            model_grad = c @ delta + ravel_pytree(g)[0]
            for u in ([delta] + ([ravel_pytree(old_v)[0]] if i > 0 else [])):
                assert abs(u @ model_grad) < 1e-4 * jnp.linalg.norm(u) * jnp.linalg.norm(ravel_pytree(g)[0])
            if i == 0:
                assert float(stats["momentum"]) == 0.0
            # The reported model change is the model's value at delta.
            q = 0.5 * delta @ (c - damping * jnp.eye(len(delta))) @ delta + delta @ ravel_pytree(g)[0]
            np.testing.assert_allclose(stats["quad_model_change"], q, rtol=1e-3)
            params = new_params


@pytest.mark.parametrize("adaptive", [(True, True), (True, False), (False, True)])
def test_coefficients_solve_the_dense_two_by_two_model(adaptive):
    """The learning rate and momentum minimise 1/2 w^T (A + (l2 + damping) D) w + b^T w."""
    lr_ad, mom_ad = adaptive
    opt = make_opt(use_adaptive_learning_rate=lr_ad, use_adaptive_momentum=mom_ad)
    rng = np.random.default_rng(0)
    m = rng.normal(size=(2, 2))
    a, d = m @ m.T + 0.1 * np.eye(2), np.array([[2.0, 0.3], [0.3, 1.0]])
    b = rng.normal(size=2)
    damping, lr, mom = 0.7, 0.05, 0.9
    w = np.asarray(opt._solve_coefficients((jnp.asarray(a), jnp.asarray(d), jnp.asarray(b)), damping, lr, mom))
    ad = a + (L2 + damping) * d
    if lr_ad and mom_ad:
        np.testing.assert_allclose(w, -np.linalg.solve(ad, b), rtol=1e-4)
    elif lr_ad:  # momentum fixed: minimise over w0 only
        np.testing.assert_allclose(w, [-(b[0] + ad[0, 1] * mom) / ad[0, 0], mom], rtol=1e-4)
    else:  # learning rate fixed: w0 = -lr
        np.testing.assert_allclose(w, [-lr, -(b[1] - ad[0, 1] * lr) / ad[1, 1]], rtol=1e-4)


def test_damping_follows_the_levenberg_marquardt_rule():
    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(2))
    opt = make_opt(
        use_adaptive_damping=True, initial_damping=1.0, damping_adaptation_interval=3,
        damping_adaptation_decay=0.8, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
    )
    state = opt.init(params, KEY, batch)
    factor = 0.8**3
    moved = 0
    for i in range(12):
        before = float(state.damping)
        new_params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=batch)
        after = float(state.damping)
        if (i + 1) % 3 != 0:
            assert after == before and np.isnan(stats["rho"])
            params = new_params
            continue
        np.testing.assert_allclose(stats["new_loss"], ce_loss(new_params, batch), rtol=1e-5)
        rho = float((stats["new_loss"] - stats["loss"]) / stats["quad_model_change"])
        np.testing.assert_allclose(stats["rho"], rho, rtol=1e-4)
        want = before / factor if rho < 0.25 else before * factor if rho > 0.75 else before
        np.testing.assert_allclose(after, want, rtol=1e-6)
        moved += after != before
        params = new_params
    assert moved >= 1


def test_step_compiles_once_and_schedules_are_used():
    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(3))
    sched = lambda step: 0.1 / (1.0 + step)
    opt = make_opt(learning_rate_schedule=sched, use_adaptive_damping=True, initial_damping=1.0, inverse_update_period=2)
    state = opt.init(params, KEY, batch)
    for i in range(7):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=batch, momentum=0.9 - 0.01 * i)
        np.testing.assert_allclose(stats["learning_rate"], sched(i), rtol=1e-6)
        np.testing.assert_allclose(stats["momentum"], 0.9 - 0.01 * i, rtol=1e-6)
    assert opt.trace_count == 1
    assert int(state.step_counter) == 7 and int(state.data_seen) == 7 * 16


def test_schedules_with_a_data_seen_parameter_get_the_examples_seen_before_the_step():
    """kfac-jax 0.0.8 calls a schedule with ``data_seen=`` when it has a parameter of that
    name; one with a default (``data_seen=0``) would otherwise run silently on its default."""
    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(3))  # 16 examples
    lr = lambda step, data_seen=0: 0.1 / (1.0 + data_seen / 16.0)
    mom = lambda step, *, data_seen: 0.5 * data_seen / (data_seen + 16.0)
    damp = lambda step, data_seen=0: 1.0 / (1.0 + data_seen / 32.0)
    opt = make_opt(learning_rate_schedule=lr, momentum_schedule=mom, damping_schedule=damp,
                   precon_damping_schedule=lambda step, data_seen=0: 2.0 + data_seen / 16.0, include_norms_in_stats=True)
    state = opt.init(params, KEY, batch)
    for i in range(3):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=batch)
        seen = 16.0 * i
        np.testing.assert_allclose(float(stats["learning_rate"]), 0.1 / (1.0 + i), rtol=1e-6)
        np.testing.assert_allclose(float(stats["momentum"]), 0.5 * seen / (seen + 16.0), rtol=1e-6)
        np.testing.assert_allclose(float(stats["damping"]), 1.0 / (1.0 + seen / 32.0), rtol=1e-6)
        np.testing.assert_allclose(float(stats["precon_damping"]), 2.0 + i, rtol=1e-6)


def test_a_float64_run_evaluates_schedules_in_float64():
    """The step counter is JAX's default integer, as kfac-jax's: under ``jax_enable_x64`` a
    schedule ``n -> 0.05 / (1 + n / 1e4)`` (DeepQMC's) gives 0.05 exactly, where an int32
    counter would have made it float32's 0.05000000074505806."""
    with jax.enable_x64(True):
        params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), init_mlp(KEY))
        batch = classification_batch(jax.random.PRNGKey(3))
        batch = (batch[0].astype(jnp.float64), batch[1])
        sched = lambda n: 0.05 / (1 + n / 10000.0)
        opt = make_opt(learning_rate_schedule=sched, damping_schedule=lambda n: 1e-3 / (1 + n / 3.0))
        state = opt.init(params, KEY, batch)
        assert state.step_counter.dtype == jnp.int64 and state.data_seen.dtype == jnp.int64
        for i in range(2):
            params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=batch, momentum=0.0)
            assert stats["learning_rate"].dtype == jnp.float64
            assert float(stats["learning_rate"]) == 0.05 / (1 + i / 10000.0)
            assert float(stats["damping"]) == 1e-3 / (1 + i / 3.0)


def test_norm_constraint_bounds_the_update():
    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(4))
    opt = make_opt(norm_constraint=1e-4)
    state = opt.init(params, KEY, batch)
    g = jax.grad(ce_loss)(params, batch)
    _, state, stats = opt.step(params, state, KEY, batch=batch, learning_rate=1.0, momentum=0.0, damping=1e-3)
    assert float(stats["scaled_grad_norm_sq"]) > 1e-4  # the constraint was active
    # The update's approximate squared Fisher norm lr^2 s^2 <Delta, g> equals the constraint,
    # with delta = -lr * s * Delta, so -<delta, g> = sqrt(c * lr^2 <Delta, g>) at lr = 1.
    want = np.sqrt(1e-4 * float(stats["scaled_grad_norm_sq"]))
    np.testing.assert_allclose(-curvax.utils.inner_product(state.velocities, g), want, rtol=1e-3)


@pytest.mark.parametrize(
    "mode", ["fisher_gradients", "fisher_empirical", "fisher_curvature_prop", "ggn_curvature_prop", "fisher_exact", "ggn_exact"]
)
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_every_estimation_mode_trains(mode, fraction):
    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(5))
    opt = make_opt(estimation_mode=mode, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                   use_adaptive_damping=True, initial_damping=1.0, curvature_batch_fraction=fraction)
    state = opt.init(params, KEY, batch)
    first = None
    for i in range(10):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=batch)
        first = float(stats["loss"]) if first is None else first
    assert float(ce_loss(params, batch)) < 0.7 * first


def test_state_rng_and_aux_are_threaded_through():
    def loss(p, fstate, rng, batch):
        noise = 1e-3 * jax.random.normal(rng, ())
        value = ce_loss(p, batch) + noise
        return value, ({"count": fstate["count"] + 1}, {"noise": noise})

    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(6))
    opt = make_opt(
        value_and_grad_func=jax.value_and_grad(loss, has_aux=True),
        value_func_has_aux=True, value_func_has_state=True, value_func_has_rng=True, include_norms_in_stats=True,
    )
    fstate = {"count": jnp.zeros([], jnp.int32)}
    state = opt.init(params, KEY, batch, fstate)
    for i in range(2):
        params, state, fstate, stats = opt.step(
            params, state, jax.random.PRNGKey(i), batch=batch, func_state=fstate, learning_rate=0.1, momentum=0.0, damping=1.0
        )
    assert int(fstate["count"]) == 2
    assert "noise" in stats["aux"]
    assert {"param_norm", "grad_norm", "precon_grad_norm", "update_norm"} <= set(stats)


@pytest.mark.parametrize("per_param", [False, True])
def test_norm_stats_are_of_the_returned_params_and_precon_damping_is_reported(per_param):
    """kfac-jax 0.0.8's stats: ``param_norm`` is the norm of the parameters the step returns
    (after the update), and ``precon_damping`` is the preconditioner's damping without l2_reg."""
    with jax.enable_x64(True):
        _check_norm_stats(per_param)


def _check_norm_stats(per_param):
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), init_mlp(KEY))
    batch = classification_batch(jax.random.PRNGKey(8))
    opt = make_opt(include_norms_in_stats=True, include_per_param_norms_in_stats=per_param, precon_damping_mult=3.0)
    state = opt.init(params, KEY, batch)
    new_params, state, stats = opt.step(params, state, KEY, batch=batch, learning_rate=0.5, momentum=0.0, damping=0.25)
    flat_new, flat_old = ravel_pytree(new_params)[0], ravel_pytree(params)[0]
    assert float(jnp.linalg.norm(flat_new - flat_old)) > 1e-2  # the update moved them
    np.testing.assert_allclose(float(stats["param_norm"]), float(jnp.linalg.norm(flat_new)), rtol=1e-12)
    np.testing.assert_allclose(float(stats["update_norm"]), float(jnp.linalg.norm(flat_new - flat_old)), rtol=1e-12)
    if per_param:
        np.testing.assert_allclose(float(stats["param_norm(1/w)"]), float(jnp.linalg.norm(new_params[1]["w"])), rtol=1e-12)
    assert float(stats["precon_damping"]) == 0.75


def test_burnin_with_batch_only_warns_once_and_iterator_is_consumed():
    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(7))
    opt = make_opt(num_burnin_steps=3)
    state = opt.init(params, KEY, batch)
    with pytest.warns(UserWarning, match="burn-in"):
        _, state2, _ = opt.step(params, state, KEY, batch=batch, learning_rate=0.1, momentum=0.0, damping=1.0)
    consumed = []

    def it():
        for i in range(10):
            consumed.append(i)
            yield batch

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(params, state, KEY, data_iterator=it(), learning_rate=0.1, momentum=0.0, damping=1.0)
    assert len(consumed) == 4  # 3 burn-in batches and the step's batch


def test_bad_input_gets_clear_errors():
    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(8))

    with pytest.raises(ValueError, match="No loss is registered"):
        opt = curvax.Optimizer(jax.value_and_grad(lambda p, b: jnp.mean(mlp(p, b[0]) ** 2)), l2_reg=0.0)
        opt.init(params, KEY, batch)
    with pytest.raises(ValueError, match="value_func_has_aux=True"):
        make_opt(value_func_has_aux=True).init(params, KEY, batch)
    with pytest.raises(ValueError, match="initial_damping"):
        make_opt(use_adaptive_damping=True)
    with pytest.raises(TypeError, match="multi_device=True needs `pmap_axis_name`"):
        make_opt(multi_device=True, pmap_axis_name="")
    opt = make_opt(use_adaptive_learning_rate=True)
    state = opt.init(params, KEY, batch)
    with pytest.raises(ValueError, match="exactly one of `data_iterator` and `batch`"):
        opt.step(params, state, KEY, momentum=0.0, damping=1.0)
    with pytest.raises(ValueError, match="exactly one of `data_iterator` and `batch`"):
        opt.step(params, state, KEY, batch=batch, data_iterator=iter([batch]), momentum=0.0, damping=1.0)
    with pytest.raises(ValueError, match="`learning_rate` was passed"):
        opt.step(params, state, KEY, batch=batch, learning_rate=0.1, momentum=0.0, damping=1.0)
    with pytest.raises(ValueError, match="needs `damping=`"):
        opt.step(params, state, KEY, batch=batch, momentum=0.0)
    with pytest.raises(ValueError, match="differ in structure"):
        opt.step(params[:1], state, KEY, batch=batch, momentum=0.0, damping=1.0)
    with pytest.raises(ValueError, match="same leading"):
        opt.step(params, state, KEY, batch=(batch[0], batch[1][:3]), momentum=0.0, damping=1.0)
    int_params = jax.tree_util.tree_map(lambda x: x.astype(jnp.int32), params)
    with pytest.raises(TypeError, match="floating"):
        make_opt().init(int_params, KEY, batch)
    with pytest.raises(AttributeError, match="after construction"):
        opt.some_setting = 3


def test_debug_mode_runs_eagerly_and_matches_the_compiled_step():
    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(9))
    outs = []
    for debug in (False, True):
        opt = make_opt(debug=debug)
        state = opt.init(params, KEY, batch)
        hyper = dict(learning_rate=0.3, momentum=0.5, damping=1.0)
        p, state, stats = opt.step(params, state, KEY, batch=batch, **hyper)
        p, state, stats = opt.step(p, state, jax.random.PRNGKey(1), batch=batch, **hyper)
        outs.append((p, float(stats["loss"])))
        assert opt.trace_count == (2 if debug else 1)  # eager: the step body runs each call
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-5), outs[0][0], outs[1][0])
    np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=1e-5)


def test_curvature_update_period_updates_statistics_only_on_its_steps():
    """Period 3: steps 0 and 3 equal an every-step optimizer's step from the same state; steps 1
    and 2 keep the statistics unchanged and precondition with them."""
    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(11))
    kw = dict(estimation_mode="ggn_exact", inverse_update_period=1, curvature_ema=0.8)
    every, periodic = make_opt(**kw), make_opt(curvature_update_period=3, **kw)
    every.init(params, KEY, batch)
    state = periodic.init(params, KEY, batch)
    lr, damping = 0.3, 0.1
    leaves = jax.tree_util.tree_leaves
    for t in range(4):
        p_ref, s_ref, _ = every.step(params, state, KEY, batch=batch, learning_rate=lr, momentum=0.0, damping=damping)
        p_new, s_new, _ = periodic.step(params, state, KEY, batch=batch, learning_rate=lr, momentum=0.0, damping=damping)
        if t % 3 == 0:
            for a, b in zip(leaves(s_new.estimator_state), leaves(s_ref.estimator_state)):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
            jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), p_new, p_ref)
        else:
            for a, b in zip(leaves(s_new.estimator_state), leaves(state.estimator_state)):
                np.testing.assert_array_equal(a, b)
            g = jax.grad(ce_loss)(params, batch)
            precon = periodic.estimator.multiply_matpower(state.estimator_state, g, L2 + damping, -1, False, False)
            want = jax.tree_util.tree_map(lambda p, v: p - lr * v, params, precon)
            jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p_new, want)
            # ...which is not what fresh statistics give.
            assert not np.allclose(ravel_pytree(p_new)[0], ravel_pytree(p_ref)[0], rtol=1e-4)
        params, state = p_new, s_new
    assert int(state.step_counter) == 4 and periodic.trace_count == 1


def test_curvature_update_period_must_be_a_positive_integer():
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="curvature_update_period"):
            make_opt(curvature_update_period=bad)


# --- curvature on a sub-batch (curvature_batch_fraction) -------------------------------------------


def _curvature_subbatch(batch, fraction, step_rng):
    """The sub-batch the optimizer estimates the curvature on for a step with ``step_rng``."""
    k_est = jax.random.split(step_rng)[0]
    return curvax.utils.subsample_batch(batch, fraction, jax.random.fold_in(k_est, 1))


def test_subsample_batch_draws_distinct_rows_of_every_leaf():
    n = 20
    batch = {"x": jnp.arange(n * 3.0).reshape(n, 3), "id": jnp.arange(n), "scale": jnp.asarray(2.0)}
    seen = set()
    for i in range(4):
        sub = curvax.utils.subsample_batch(batch, 0.3, jax.random.PRNGKey(i))
        ids = np.asarray(sub["id"])
        assert ids.shape == (6,)  # ceil(0.3 * 20)
        assert len(set(ids.tolist())) == 6 and np.all(np.diff(ids) > 0) and ids.min() >= 0 and ids.max() < n
        np.testing.assert_array_equal(sub["x"], np.asarray(batch["x"])[ids])  # rows stay aligned across leaves
        assert float(sub["scale"]) == 2.0  # leaves without a batch axis are kept
        seen.add(tuple(ids.tolist()))
    assert len(seen) > 1  # the rows depend on the key
    assert curvax.utils.subsample_batch(batch, 1.0, KEY) is batch
    assert curvax.utils.subsample_batch(batch, 0.999, KEY) is batch  # ceil(19.98) keeps every example
    assert curvax.utils.subsample_batch(batch, 1e-6, KEY)["id"].shape == (1,)  # at least one example
    assert curvax.utils.subsample_batch({"x": jnp.zeros((100, 2))}, 0.07, KEY)["x"].shape == (7, 2)  # not 8
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="fraction"):
            curvax.utils.subsample_batch(batch, bad, KEY)
    with pytest.raises(ValueError, match="same leading"):
        curvax.utils.subsample_batch({"a": jnp.zeros((4, 2)), "b": jnp.zeros((5,))}, 0.5, KEY)


def test_curvature_batch_fraction_estimates_on_a_random_sub_batch():
    """The statistics are those of the sub-batch (a full-batch optimizer stepping on it gives the
    same estimator state, sampled targets included); the gradient and the loss are the whole batch's."""
    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(12), n=16)
    kw = dict(estimation_mode="fisher_gradients", inverse_update_period=1, curvature_ema=0.8)
    sub_opt, full_opt = make_opt(curvature_batch_fraction=0.25, **kw), make_opt(**kw)
    state = sub_opt.init(params, KEY, batch)
    full_opt.init(params, KEY, batch)
    lr, damping = 0.3, 0.1
    leaves = jax.tree_util.tree_leaves
    subsets = set()
    for t in range(3):
        rng = jax.random.PRNGKey(100 + t)
        sub = _curvature_subbatch(batch, 0.25, rng)
        assert sub[0].shape == (4, 4)
        subsets.add(np.asarray(sub[0]).tobytes())
        new_params, new_state, stats = sub_opt.step(params, state, rng, batch=batch, learning_rate=lr, momentum=0.0, damping=damping)
        _, ref_state, _ = full_opt.step(params, state, rng, batch=sub, learning_rate=lr, momentum=0.0, damping=damping)
        for a, b in zip(leaves(new_state.estimator_state), leaves(ref_state.estimator_state)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        # The update preconditions the whole batch's gradient with the sub-batch statistics.
        g = jax.grad(ce_loss)(params, batch)
        precon = sub_opt.estimator.multiply_matpower(new_state.estimator_state, g, L2 + damping, -1, False, False)
        want = jax.tree_util.tree_map(lambda p, v: p - lr * v, params, precon)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), new_params, want)
        np.testing.assert_allclose(stats["loss"], ce_loss(params, batch), rtol=1e-6)
        assert int(stats["data_seen"]) == 16 * (t + 1)
        params, state = new_params, new_state
    assert len(subsets) > 1 and sub_opt.trace_count == 1


def test_curvature_batch_fraction_quadratic_model_uses_the_sub_batch_curvature():
    """Adaptive lr/momentum minimise the damped quadratic model whose curvature is the exact one of
    the sub-batch (normalised by its size) and whose linear term is the whole batch's gradient."""
    with jax.enable_x64(True):
        params = init_mlp(KEY)
        batch = classification_batch(jax.random.PRNGKey(13), n=12)
        damping = 0.5
        opt = make_opt(
            use_adaptive_learning_rate=True, use_adaptive_momentum=True, estimation_mode="fisher_exact",
            curvature_batch_fraction=0.5,
        )
        state = opt.init(params, KEY, batch)
        dim = ravel_pytree(params)[0].size
        for i in range(3):
            rng = jax.random.PRNGKey(i)
            sub = _curvature_subbatch(batch, 0.5, rng)
            assert sub[0].shape[0] == 6
            old_v = state.velocities
            g = ravel_pytree(jax.grad(ce_loss)(params, batch))[0]
            c = exact_ggn(params, sub) + (L2 + damping) * jnp.eye(dim)
            params, state, stats = opt.step(params, state, rng, batch=batch, damping=damping)
            delta = ravel_pytree(state.velocities)[0]
            model_grad = c @ delta + g
            for u in [delta] + ([ravel_pytree(old_v)[0]] if i > 0 else []):
                assert abs(u @ model_grad) < 1e-6 * jnp.linalg.norm(u) * jnp.linalg.norm(g)
            # ...and the whole batch's curvature would not give this minimiser.
            c_full = exact_ggn(params, batch) + (L2 + damping) * jnp.eye(dim)
            assert abs(delta @ (c_full @ delta + g)) > 1e-4 * jnp.linalg.norm(delta) * jnp.linalg.norm(g)


def test_curvature_batch_fraction_in_burn_in():
    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(14), n=16)
    sub_opt, full_opt = make_opt(curvature_batch_fraction=0.5), make_opt()
    state = sub_opt.init(params, KEY, batch)
    full_opt.init(params, KEY, batch)
    rng = jax.random.PRNGKey(7)
    got, _ = sub_opt.burnin(1, params, state, rng, iter([batch]))
    key = jax.random.split(rng)[1]  # burnin's per-step key; its first half seeds the estimator
    sub = curvax.utils.subsample_batch(batch, 0.5, jax.random.fold_in(jax.random.split(key)[0], 1))
    want, _ = full_opt.burnin(1, params, state, rng, iter([sub]))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_curvature_batch_fraction_must_lie_in_zero_one():
    for bad in (0, 0.0, -0.5, 1.5, float("nan"), "0.5", True, None):
        with pytest.raises(ValueError, match="curvature_batch_fraction"):
            make_opt(curvature_batch_fraction=bad)
    make_opt(curvature_batch_fraction=1)  # the whole batch, as by default


def test_a_batch_of_another_size_than_init_steps_like_a_fresh_optimizer():
    """The step traces the function again for a new batch shape (a last, smaller batch)."""
    params = init_mlp(KEY)
    big = classification_batch(jax.random.PRNGKey(15), n=16)
    small = jax.tree_util.tree_map(lambda x: x[:6], big)
    kw = dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True, estimation_mode="ggn_exact")
    opt, fresh = make_opt(**kw), make_opt(**kw)
    state = opt.init(params, KEY, big)
    state_fresh = fresh.init(params, KEY, small)
    p1, s1, st1 = opt.step(params, state, KEY, batch=small, damping=0.3)
    p2, s2, st2 = fresh.step(params, state_fresh, KEY, batch=small, damping=0.3)
    for a, b in zip(jax.tree_util.tree_leaves((p1, s1)), jax.tree_util.tree_leaves((p2, s2))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(st1["loss"], ce_loss(params, small), rtol=1e-6)
    opt.step(p1, s1, KEY, batch=big, damping=0.3)
    assert opt.trace_count == 2  # one program per batch shape


def test_a_batch_whose_trace_finds_other_layers_gets_a_clear_error():
    def loss(p, batch):
        x, y = batch
        h = x @ p[0]["w"] + p[0]["b"]
        if x.shape[0] > 8:  # the model's structure depends on the batch size
            h = jnp.tanh(h)
            logits = h @ p[1]["w"] + p[1]["b"]
        else:
            logits = jnp.tanh(h) @ p[1]["w"]
        curvax.register_softmax_cross_entropy_loss(logits, y)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    params = init_mlp(KEY)
    big = classification_batch(jax.random.PRNGKey(16), n=16)
    opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=L2, num_burnin_steps=0)
    state = opt.init(params, KEY, big)
    small = jax.tree_util.tree_map(lambda x: x[:4], big)
    with pytest.raises(ValueError, match="same model structure"):
        opt.step(params, state, KEY, batch=small, learning_rate=0.1, momentum=0.0, damping=1.0)


def test_curvature_batch_fraction_with_a_model_that_fixes_the_batch_size_gets_a_clear_error():
    def loss(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p[0]["w"] + p[0]["b"]).reshape(16, -1)  # assumes 16 examples
        logits = h @ p[1]["w"] + p[1]["b"]
        curvax.register_softmax_cross_entropy_loss(logits, y)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    params = init_mlp(KEY)
    batch = classification_batch(jax.random.PRNGKey(17), n=16)
    for burnin in (0, 1):
        opt = curvax.Optimizer(
            jax.value_and_grad(loss), l2_reg=L2, num_burnin_steps=burnin, curvature_batch_fraction=0.5
        )
        state = opt.init(params, KEY, batch)
        with pytest.warns(UserWarning, match="burn-in") if burnin else warnings.catch_warnings():
            with pytest.raises(ValueError, match=r"curvature_batch_fraction=0.5: .* sub-batches of 8 examples"):
                opt.step(params, state, KEY, batch=batch, learning_rate=0.1, momentum=0.0, damping=1.0)
    # Without a fraction, a smaller batch fails the same way, with an error that says so.
    opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=L2, num_burnin_steps=0)
    state = opt.init(params, KEY, batch)
    small = jax.tree_util.tree_map(lambda x: x[:8], batch)
    with pytest.raises(ValueError, match=r"Tracing the loss on a batch with leaf shapes \[\(8, 4\), \(8,\)\]"):
        opt.step(params, state, KEY, batch=small, learning_rate=0.1, momentum=0.0, damping=1.0)


def test_init_traces_value_and_grad_func_once():
    """``init`` traces the user's function once: the output check, the estimator (the value's
    trace is read off it) and the gradient proof share that trace. A VMC loss with second
    derivatives takes seconds per trace (DeepQMC's three traces made its init 11 s)."""
    params, batch = models.classifier(8)
    calls = []

    def value_and_grad(p, b):
        calls.append(1)
        return jax.value_and_grad(models.softmax_loss)(p, b)

    opt = curvax.Optimizer(value_and_grad, l2_reg=1e-3, num_burnin_steps=0)
    opt.init(params, jax.random.PRNGKey(0), batch)
    assert len(calls) == 1
    # The estimator's processed trace is the value's: its outputs are the loss alone.
    assert opt.estimator.processed_jaxpr.out_tree.num_leaves == 1


def test_a_value_func_for_the_estimator_is_traced_itself():
    """The value's trace is shared with the estimator only when the estimator traces the value:
    ``value_func_for_estimator`` is traced itself (its statistics are its own;
    ``test_optimizer_v008_args.py`` checks the step's numbers)."""
    params, batch = models.classifier(8)
    calls = []

    def scaled(p, b):
        calls.append(1)
        return 3.0 * models.softmax_loss(p, b)

    opt = curvax.Optimizer(jax.value_and_grad(models.softmax_loss), l2_reg=1e-3, num_burnin_steps=0,
                           value_func_for_estimator=scaled)
    opt.init(params, jax.random.PRNGKey(0), batch)
    assert len(calls) >= 1
