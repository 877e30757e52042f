"""The phases of a step (``curvax.step``), each on its own, against direct computations."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from curvax.step import coefficients, config, damping, guard, precondition, refresh, statistics, value_function


def _cfg(**overrides) -> config.StepConfig:
    """A ``StepConfig`` of ``curvax.Optimizer``'s defaults (adaptive damping on), with overrides."""
    args = dict(
        l2_reg=1e-3, use_adaptive_learning_rate=False, learning_rate_schedule=None, use_adaptive_momentum=False,
        momentum_schedule=None, use_adaptive_damping=True, damping_schedule=None, initial_damping=1.0,
        min_damping=1e-8, max_damping=math.inf, include_damping_in_quad_change=False,
        damping_adaptation_interval=5, damping_adaptation_decay=0.9, damping_lower_threshold=0.25,
        damping_upper_threshold=0.75, always_use_exact_qmodel_for_damping_adjustment=False, norm_constraint=None,
        num_burnin_steps=10, estimation_mode="fisher_gradients", curvature_ema=0.95, inverse_update_period=5,
        inverse_update_staggered=False, curvature_update_period=1, curvature_batch_fraction=1.0,
        use_exact_inverses=False, precon_damping_mult=1.0, precon_damping_schedule=None,
    )
    args.update(overrides)
    return config.optimizer_config(args)


def _quad(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    m = rng.normal(size=(2, 2))
    a = m @ m.T + 0.1 * np.eye(2)
    d = np.array([[2.0, 0.3], [0.3, 1.0]])
    return a, d, rng.normal(size=2)


# --- coefficients ---------------------------------------------------------------------------


@pytest.mark.parametrize("adaptive", [(True, True), (True, False), (False, True)])
def test_quadratic_model_solve_matches_numpy(adaptive):
    """The coefficients minimise 1/2 w^T (A + (l2 + damping) D) w + b^T w over the adaptive ones."""
    a, d, b = _quad()
    l2, lam, lr, mom = 1e-3, 0.7, 0.05, 0.9
    w = np.asarray(coefficients.solve((jnp.asarray(a), jnp.asarray(d), jnp.asarray(b)), l2, lam, lr, mom, *adaptive))
    ad = a + (l2 + lam) * d
    if adaptive == (True, True):
        expected = -np.linalg.solve(ad, b)
    elif adaptive[0]:  # momentum fixed: minimise over w0
        expected = [-(b[0] + ad[0, 1] * mom) / ad[0, 0], mom]
    else:  # learning rate fixed: minimise over w1
        expected = [-lr, -(b[1] - ad[0, 1] * lr) / ad[1, 1]]
    np.testing.assert_allclose(w, expected, rtol=1e-5)


def test_quadratic_model_solve_without_velocity_takes_no_momentum():
    """The first step's velocity is zero (D_11 = 0): the momentum is 0, the rate the 1-D minimiser."""
    a, d, b = _quad(1)
    a[1, :] = a[:, 1] = 0.0
    d[1, :] = d[:, 1] = 0.0
    b[1] = 0.0
    w = np.asarray(coefficients.solve((jnp.asarray(a), jnp.asarray(d), jnp.asarray(b)), 0.0, 0.5, 0.0, 0.0, True, True))
    np.testing.assert_allclose(w, [-b[0] / (a[0, 0] + 0.5 * d[0, 0]), 0.0], rtol=1e-6)


@pytest.mark.parametrize("include_damping", [False, True])
def test_model_change_is_the_quadratic_form(include_damping):
    a, d, b = _quad(2)
    w = np.array([-0.3, 0.6])
    got = coefficients.model_change((a, d, b), jnp.asarray(w), 0.01, 0.5, include_damping)
    a_hat = a + 0.01 * d + (0.5 * d if include_damping else 0.0)
    np.testing.assert_allclose(got, 0.5 * w @ a_hat @ w + w @ b, rtol=1e-6)


def test_fixed_coefficients_and_schedules():
    np.testing.assert_array_equal(coefficients.fixed(jnp.float32(0.1), jnp.float32(0.9)), np.float32([-0.1, 0.9]))
    given = jnp.float32(3.0)
    assert coefficients.schedule_value(None, given, jnp.int32(4), jnp.int32(64)) is given
    assert float(coefficients.schedule_value(lambda s: 2.0 * s, given, jnp.int32(4), jnp.int32(64))) == 8.0
    # A schedule with a ``data_seen`` parameter gets the examples seen (kfac-jax 0.0.8).
    by_data = lambda s, data_seen: s + data_seen / 64.0
    assert float(coefficients.schedule_value(by_data, given, jnp.int32(4), jnp.int32(64))) == 5.0


def test_choose_without_adaptive_damping_reports_no_model_change():
    cfg = _cfg(use_adaptive_damping=False)
    never = lambda: pytest.fail("no quadratic model is needed")
    coeffs, change = coefficients.choose(cfg, 0.1, 0.5, 1.0, never, never, jnp.asarray(True))
    np.testing.assert_allclose(coeffs, [-0.1, 0.5])
    assert np.isnan(change)


# --- damping ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "new_loss, expected",
    [(0.5, 1.0 * 0.9**5), (0.75, 1.0), (0.99, 1.0 / 0.9**5), (math.nan, 1.0 / 0.9**5)],
    ids=["good-model", "middle", "bad-model", "non-finite"],
)
def test_levenberg_marquardt_rule(new_loss, expected):
    """rho = (new - old) / predicted: above 0.75 lowers the damping, below 0.25 (or not finite) raises it."""
    cfg = _cfg()
    out = damping.levenberg_marquardt(cfg, jnp.float32(1.0), jnp.float32(new_loss), jnp.float32(1.0), jnp.float32(-0.5))
    np.testing.assert_allclose(out.damping, expected, rtol=1e-6)
    if math.isnan(new_loss):
        assert float(out.rho) == -100.0
    else:
        np.testing.assert_allclose(out.rho, (new_loss - 1.0) / -0.5, rtol=1e-6)


def test_damping_is_clipped_and_adapted_only_when_due():
    cfg = _cfg(min_damping=0.95, max_damping=1.05)
    low = damping.levenberg_marquardt(cfg, jnp.float32(1.0), jnp.float32(0.0), jnp.float32(1.0), jnp.float32(-1.0))
    assert float(low.damping) == pytest.approx(0.95)
    assert [bool(damping.due(cfg, jnp.int32(i))) for i in range(6)] == [False, False, False, False, True, False]
    kept = damping.adapt(cfg, jnp.asarray(False), lambda: jnp.float32(0.0), jnp.float32(1.0), jnp.float32(-1.0), jnp.float32(1.0))
    assert float(kept.damping) == 1.0 and np.isnan(kept.rho) and np.isnan(kept.new_loss)


def test_preconditioner_damping():
    step, seen = jnp.int32(0), jnp.int32(0)
    cfg = _cfg(use_adaptive_damping=False, precon_damping_mult=2.0)
    precon = damping.precon_damping(cfg, jnp.float32(0.5), step, seen)
    assert float(precon) == pytest.approx(1.0)
    assert float(damping.identity_weight(cfg, precon)) == pytest.approx(1e-3 + 1.0)
    cfg = _cfg(use_adaptive_damping=False, precon_damping_schedule=lambda s: 0.25)
    precon = damping.precon_damping(cfg, jnp.float32(0.5), step, seen)
    assert float(damping.identity_weight(cfg, precon)) == pytest.approx(1e-3 + 0.25)
    assert float(damping.step_damping(cfg, jnp.float32(9.0), jnp.float32(0.5), step, seen)) == 0.5
    assert float(damping.step_damping(_cfg(), jnp.float32(9.0), jnp.float32(0.5), step, seen)) == 9.0


# --- the guard and its counters ---------------------------------------------------------------


def test_guard_skips_non_finite_updates_and_counts_them():
    precon = {"w": jnp.array([1.0, 2.0])}
    velocity = {"w": jnp.array([0.5, 0.5])}
    grads = {"w": jnp.array([1.0, 1.0])}
    coeffs = jnp.array([-0.1, 0.9])
    finite = guard.update_is_finite(precon, grads, coeffs, jnp.float32(1.0))
    c, delta = guard.guarded_update(finite, coeffs, precon, velocity)
    np.testing.assert_allclose(delta["w"], -0.1 * np.array([1.0, 2.0]) + 0.9 * 0.5, rtol=1e-6)
    for bad in (
        dict(precon={"w": jnp.array([jnp.nan, 2.0])}), dict(loss=jnp.float32(jnp.inf)), dict(coeffs=jnp.array([jnp.nan, 0.0])),
    ):
        args = dict(precon=precon, grads=grads, coeffs=coeffs, loss=jnp.float32(1.0)) | bad
        finite = guard.update_is_finite(**args)
        assert not bool(finite)
        c, delta = guard.guarded_update(finite, args["coeffs"], args["precon"], velocity)
        np.testing.assert_array_equal(c, [0.0, 0.0])
        np.testing.assert_array_equal(delta["w"], [0.0, 0.0])
    counter = jnp.zeros([], jnp.int32)
    for skipped in (True, False, True):
        counter = guard.count(counter, jnp.asarray(skipped))
    assert int(counter) == 2 and counter.dtype == jnp.int32
    assert guard.count(None, jnp.asarray(True)) is None
    zeroed = guard.zero_unless_finite({"w": jnp.array([jnp.inf, 1.0])}, grads)
    np.testing.assert_array_equal(zeroed["w"], [0.0, 0.0])


def test_divergence_check_keeps_the_first_finite_loss():
    first = jnp.float32(jnp.nan)
    first, diverged = guard.divergence(first, jnp.float32(jnp.nan))
    assert np.isnan(first) and not bool(diverged)
    first, diverged = guard.divergence(first, jnp.float32(2.0))
    assert float(first) == 2.0 and not bool(diverged)
    first, diverged = guard.divergence(first, jnp.float32(2.0 * guard.DIVERGENCE_FACTOR + 1.0))
    assert float(first) == 2.0 and bool(diverged)


def test_reporter_logs_skipped_steps(caplog):
    report = guard.Reporter()
    flag = lambda b: jnp.asarray(b)
    with caplog.at_level(logging.WARNING, logger="curvax"):
        report({"step": jnp.int32(3), "loss": jnp.float32(1.5), "update_skipped": flag(True),
                "curvature_update_skipped": flag(False), "loss_diverged": flag(False)})
        jax.block_until_ready(jnp.zeros(()))
        for _ in range(guard.REPORT_BACKLOG + 1):  # later steps flush the first at the latest
            report({"step": jnp.int32(4), "loss": jnp.float32(1.0), "update_skipped": flag(False),
                    "curvature_update_skipped": flag(False), "loss_diverged": flag(False)})
    assert any("curvax step 3" in r.getMessage() and "update skipped" in r.getMessage() for r in caplog.records)
    assert not any("curvax step 4" in r.getMessage() for r in caplog.records)


class _Unreadable:
    """A ready device value whose reading fails: the report must not read it."""

    def is_ready(self) -> bool:
        return True

    def __array__(self, *args, **kwargs):
        raise AssertionError("read although no flag was set")


def test_flags_word_packs_each_reported_flag_in_its_own_bit():
    keys = guard.REPORT_KEYS[2:]
    for i, key in enumerate(keys):
        stats = {k: jnp.asarray(k == key) for k in keys}
        assert int(guard.flags_word(stats)) == 1 << i, key
    assert int(guard.flags_word({k: jnp.asarray(False) for k in keys})) == 0
    assert int(guard.flags_word({})) == 0  # a stat the step does not report is not flagged


def test_reporter_reads_only_the_flags_word_of_a_step_with_nothing_to_report(caplog):
    report = guard.Reporter()
    with caplog.at_level(logging.WARNING, logger="curvax"):
        for _ in range(guard.REPORT_BACKLOG + 2):
            report({k: _Unreadable() for k in guard.REPORT_KEYS}, jnp.int32(0))
        flagged = {"step": jnp.int32(7), "loss": jnp.float32(2.0), "update_skipped": jnp.asarray(False),
                   "curvature_update_skipped": jnp.asarray(True), "loss_diverged": jnp.asarray(False)}
        report(flagged, guard.flags_word(flagged))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "curvax step 7" in messages[0] and "curvature statistics update skipped" in messages[0]


# --- statistics ------------------------------------------------------------------------------


class _FakeEstimator:
    """Records the calls the phases make (``sync``, ``update_cache``)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def sync(self, state, axis):
        self.calls.append(f"sync({axis})")
        return state

    def update_cache(self, state, identity_weight, exact, approx, eigenvalues):
        self.calls.append(f"update_cache({exact}, {approx})")
        return jax.tree_util.tree_map(lambda x: x + identity_weight, state)


def test_statistics_keep_finite_updates_bit_for_bit_and_drop_others():
    from curvax import estimators

    est = _FakeEstimator()
    old = estimators.BlockDiagonalState((jnp.array([1.0, 2.0]),))
    new = estimators.BlockDiagonalState((jnp.array([1.5, 2.5]),))
    kept, skipped = statistics.settle(est, old, new, None)
    np.testing.assert_array_equal(kept.blocks_states[0], new.blocks_states[0])
    assert not bool(skipped) and est.calls == ["sync(None)"]
    bad = estimators.BlockDiagonalState((jnp.array([jnp.nan, 2.5]),))
    kept, skipped = statistics.settle(est, old, bad, None, sync=False)
    np.testing.assert_array_equal(kept.blocks_states[0], old.blocks_states[0])
    assert bool(skipped) and est.calls == ["sync(None)"]


def test_periodic_statistics_update():
    update = lambda s: (s + 1.0, jnp.asarray(False))
    assert float(statistics.periodic(jnp.int32(3), 1, update, jnp.float32(0.0))[0]) == 1.0
    assert float(statistics.periodic(jnp.int32(3), 2, update, jnp.float32(0.0))[0]) == 0.0
    assert float(statistics.periodic(jnp.int32(4), 2, update, jnp.float32(0.0))[0]) == 1.0


# --- refresh and preconditioning -------------------------------------------------------------


def test_refresh_schedule():
    assert refresh.cache_powers(1, False) == (None, None)
    assert refresh.cache_powers(5, False) == (None, -1)
    assert refresh.cache_powers(5, True) == (-1, None)
    est = _FakeEstimator()
    state = jnp.float32(0.0)
    assert float(refresh.refresh(est, state, jnp.int32(7), 1, 1.0, None, None)) == 1.0  # every step, no cond
    assert float(refresh.refresh(est, state, jnp.int32(7), 5, 1.0, None, -1)) == 0.0
    assert float(refresh.refresh(est, state, jnp.int32(10), 5, 1.0, None, -1)) == 1.0
    assert refresh.refresh_when(est, state, False, 1.0, None, -1) is state
    assert est.calls[0] == "update_cache(None, None)" and set(est.calls[1:]) == {"update_cache(None, -1)"}


@pytest.mark.parametrize("floor", [1e-30, None])
def test_norm_constraint(floor):
    precon = {"w": jnp.array([3.0, 4.0])}
    grads = {"w": jnp.array([1.0, 2.0])}
    lr = 0.5
    scaled, sq = precondition.constrain_norm(precon, grads, 0.5, scale=lr, floor=floor)
    expected_sq = lr**2 * 11.0
    np.testing.assert_allclose(sq, expected_sq, rtol=1e-6)
    np.testing.assert_allclose(scaled["w"], np.array([3.0, 4.0]) * math.sqrt(0.5 / expected_sq), rtol=1e-6)
    unchanged, _ = precondition.constrain_norm(precon, grads, 100.0, floor=floor)
    np.testing.assert_allclose(unchanged["w"], [3.0, 4.0])


# --- the value function and the step's arguments -------------------------------------------------


def test_value_function_contract():
    f = value_function.ValueFunction(lambda *a: None, has_aux=True, has_state=True, has_rng=True)
    assert f.make_args("p", "s", "r", "b") == ("p", "s", "r", "b")
    assert f.split_outputs((1.0, ("state", "aux"))) == (1.0, "state", "aux")
    assert f.signature() == "(params, func_state, rng, batch)"
    g = value_function.ValueFunction(jax.value_and_grad(lambda p, b: jnp.sum(p * b)), False, False, False)
    assert g.make_args("p", "s", "r", "b") == ("p", "b")
    g.check_outputs((jnp.ones(2), jnp.ones(2)))
    bad = value_function.ValueFunction(g.value_and_grad_func, has_aux=True, has_state=False, has_rng=False)
    with pytest.raises(ValueError, match=r"must be \(loss, aux\)"):
        bad.check_outputs((jnp.ones(2), jnp.ones(2)))


def test_step_coefficient_arguments():
    cfg = _cfg(use_adaptive_damping=False, momentum_schedule=lambda s: 0.9)
    config.check_step_coefficients(cfg, 0.1, None, 1.0)
    with pytest.raises(ValueError, match="`learning_rate=`"):
        config.check_step_coefficients(cfg, None, None, 1.0)
    with pytest.raises(ValueError, match="momentum_schedule"):
        config.check_step_coefficients(cfg, 0.1, 0.5, 1.0)
    with pytest.raises(ValueError, match="use_adaptive_damping"):
        config.check_step_coefficients(_cfg(), 0.1, 0.5, 1.0)
    assert config.scalar_arg(None, "momentum").dtype == jnp.float32
    with pytest.raises(ValueError, match="scalar"):
        config.scalar_arg([1.0, 2.0], "momentum")


# --- program size ----------------------------------------------------------------------------


def _optimized_size(fn, *args) -> int:
    """Instructions of ``jax.jit(fn)``'s program after XLA's optimizations."""
    return sum(" = " in line for line in jax.jit(fn).lower(*args).compile().as_text().splitlines())


@pytest.mark.parametrize("phase", ["guarded_update", "keep_finite_statistics"])
def test_a_flag_over_all_leaves_keeps_the_program_linear_in_the_leaves(phase):
    """A flag reduced over every leaf and used on every leaf (the update's and the statistics'
    finiteness) goes through a conditional: with a select per leaf XLA copied the whole
    reduction into each leaf's fusion, a program quadratic in the number of leaves (FermiNet's
    Psiformer step: 35k instructions, most of its compile time)."""
    from curvax import estimators

    def run(n: int) -> int:
        leaves = [jnp.full((4, 3 + i % 4), 0.5) for i in range(n)]
        if phase == "guarded_update":
            fn = lambda p, c: guard.guarded_update(guard.update_is_finite(p, p, c, c[0]), c, p, p)[1]
        else:
            fn = lambda p, c: estimators.keep_finite_statistics(p, [x * c[0] for x in p])[0]
        return _optimized_size(fn, leaves, jnp.ones(2))

    small, large = run(12), run(36)
    assert large / small < 4.5, (small, large)  # linear: ~3; with a select per leaf: ~9


def test_a_users_gradient_leaves_the_values_own_equations_out_of_the_curvature_pass(monkeypatch):
    """When the gradient comes from ``value_and_grad_func`` (not proven shared), curvax's own pass
    evaluates only what the registered loss and the layers need: an equation used by the loss's
    value alone (the ``cumsum``) is not evaluated (FermiNet's local energy, whose second
    derivatives doubled the step's tracing time)."""
    import curvax
    from curvax import _compat

    def loss(params, batch):
        x, y = batch
        out = x @ params["w"]
        curvax.register_squared_error_loss(out, y)
        return 0.5 * jnp.mean((out - y) ** 2) + 1e-3 * jnp.sum(jnp.cumsum(params["w"][:, 0]))

    params = {"w": jnp.ones((4, 2)) / 4}
    batch = (jnp.ones((8, 4)), jnp.zeros((8, 2)))
    # A hand-written value_and_grad_func: its gradient is not proven to be the traced value's.
    value_and_grad = lambda p, b: jax.value_and_grad(loss)(p, b)
    opt = curvax.Optimizer(value_and_grad, l2_reg=1e-3, num_burnin_steps=0, inverse_update_period=1)
    state = opt.init(params, jax.random.PRNGKey(0), batch)
    assert not opt._program.shares_gradient
    seen = []
    real = _compat.eval_equation
    monkeypatch.setattr(_compat, "eval_equation", lambda eqn, invals: seen.append(eqn.primitive.name) or real(eqn, invals))
    opt.step(params, state, jax.random.PRNGKey(1), batch=batch, learning_rate=0.1, momentum=0.0, damping=0.1)
    assert "dot_general" in seen and "cumsum" not in seen, sorted(set(seen))
