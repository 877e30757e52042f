"""The optimizer steps along the gradient that ``value_and_grad_func`` returns.

Not along the derivative of the traced *value*: there a ``jax.custom_jvp``/``custom_vjp``
rule (FermiNet's VMC gradient, straight-through estimators, clipped gradients) is already
used up, and a hand-written ``value_and_grad_func`` is ignored. kfac-jax steps along the
user's gradient; so must we. Each case compares one fixed-coefficient step with the dense
formula ``theta - lr (C + (damping + l2) I)^-1 g_user`` (C: the curvature the step used, or
an independent dense GGN where K-FAC is exact), and first checks that the derivative of the
same loss without its custom rule is a different vector, so that a step along it would fail.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax
import models
import vmc

KEY = jax.random.PRNGKey(0)
IN, HID, OUT, B = 3, 5, 2, 8
LR, DAMPING, L2 = 0.5, 0.125, 0.0625  # exact in float32: the optimizer casts the coefficients


# --- models in every framework: (apply(params, x), float64 params) -------------------------------


def _float64(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), tree)


def plain_mlp(key: jax.Array) -> tuple[Callable, Any]:
    k0, k1 = jax.random.split(key)
    params = {
        "l0": {"w": jax.random.normal(k0, (IN, HID)) / 2, "b": jnp.full(HID, 0.1)},
        "l1": {"w": jax.random.normal(k1, (HID, OUT)) / 2, "b": jnp.full(OUT, -0.1)},
    }
    return (lambda p, x: jnp.tanh(x @ p["l0"]["w"] + p["l0"]["b"]) @ p["l1"]["w"] + p["l1"]["b"]), _float64(params)


def plain_linear(key: jax.Array) -> tuple[Callable, Any]:
    """One dense layer: with the squared error, K-FAC's block is the exact GGN (= the Hessian)."""
    params = {"w": jax.random.normal(key, (IN, OUT)) / 2, "b": jnp.full(OUT, 0.1)}
    return (lambda p, x: x @ p["w"] + p["b"]), _float64(params)


FRAMEWORKS = {
    "plain_jax": plain_mlp,
    **{f: functools.partial(models.framework_tanh_mlp, f, d_in=IN, d_hid=HID, d_out=OUT) for f in models.TANH_MLP_FRAMEWORKS},
}


def _batch(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (B, IN), jnp.float64), jax.random.normal(ky, (B, OUT), jnp.float64)


def _squared_error(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


def _tree_zeros(tree: Any) -> Any:
    return jax.tree_util.tree_map(jnp.zeros_like, tree)


# --- the ways users hand the optimizer a gradient that is not the value's derivative -------------
#
# Each case returns ``(value_and_grad_func, rule_free_loss)``: ``rule_free_loss`` is the same value
# with the custom rule taken out (``round``'s own derivative, no ``stop_gradient``, no clipping),
# the function whose derivative a step that differentiates the traced value would follow.


def _registered_loss(apply: Callable, quantize: Callable = lambda out: out) -> Callable:
    def loss(p, batch):
        out = apply(p, batch[0])
        curvax.register_squared_error_loss(out, batch[1])
        return _squared_error(quantize(out), batch[1])

    return loss


def plain(apply: Callable) -> tuple[Callable, Callable]:
    """The ordinary case: ``jax.value_and_grad`` of a loss without custom rules."""
    loss = _registered_loss(apply)
    return jax.value_and_grad(loss), loss


def custom_vjp_clipped(apply: Callable) -> tuple[Callable, Callable]:
    """A ``jax.custom_vjp`` loss whose backward pass clips the gradient elementwise."""
    raw = _registered_loss(apply)
    unregistered = lambda p, batch: _squared_error(apply(p, batch[0]), batch[1])

    @jax.custom_vjp
    def loss(p, batch):
        return raw(p, batch)

    def fwd(p, batch):
        return raw(p, batch), (jax.grad(unregistered)(p, batch), batch)

    def bwd(res, ct):
        g, batch = res
        return jax.tree_util.tree_map(lambda a: ct * jnp.clip(a, -0.1, 0.1), g), _tree_zeros(batch)

    loss.defvjp(fwd, bwd)
    return jax.value_and_grad(loss), raw


@jax.custom_jvp
def _round_ste(x: jax.Array) -> jax.Array:
    return jnp.round(x)


_round_ste.defjvp(lambda primals, tangents: (_round_ste(primals[0]), tangents[0]))


def straight_through(apply: Callable) -> tuple[Callable, Callable]:
    """Quantized outputs, ``round`` in the forward pass with the identity as its derivative
    (a ``jax.custom_jvp``); the curvature is registered on the unquantized outputs."""
    loss = _registered_loss(apply, lambda out: _round_ste(4.0 * out) / 4.0)
    return jax.value_and_grad(loss), _registered_loss(apply, lambda out: jnp.round(4.0 * out) / 4.0)


@jax.custom_jvp
def _round_ste_inline(x: jax.Array) -> jax.Array:
    return jnp.round(x)


_round_ste_inline.defjvp(lambda primals, tangents: (jnp.round(primals[0]), tangents[0]))


def straight_through_inline_rule(apply: Callable) -> tuple[Callable, Callable]:
    """As ``straight_through``, with a rule that computes ``jnp.round`` itself rather than calling
    the custom function: differentiating the traced value then meets ``round``'s zero derivative."""
    loss = _registered_loss(apply, lambda out: _round_ste_inline(4.0 * out) / 4.0)
    return jax.value_and_grad(loss), _registered_loss(apply, lambda out: jnp.round(4.0 * out) / 4.0)


def straight_through_stop_gradient(apply: Callable) -> tuple[Callable, Callable]:
    """The same estimator written with ``stop_gradient``: ``out + sg(round(out) - out)``."""
    quantize = lambda out: out + jax.lax.stop_gradient(jnp.round(4.0 * out) / 4.0 - out)
    loss = _registered_loss(apply, quantize)
    return jax.value_and_grad(loss), _registered_loss(apply, lambda out: jnp.round(4.0 * out) / 4.0)


def stop_gradient_weights(apply: Callable) -> tuple[Callable, Callable]:
    """Per-example weights ``l_n / mean(l)`` held constant with ``stop_gradient`` (hard examples count more)."""

    def make(sg: Callable) -> Callable:
        def loss(p, batch):
            out = apply(p, batch[0])
            curvax.register_squared_error_loss(out, batch[1])
            per_example = jnp.sum((out - batch[1]) ** 2, axis=-1)
            return jnp.mean(sg(per_example / jnp.mean(per_example)) * per_example)

        return loss

    return jax.value_and_grad(make(jax.lax.stop_gradient)), make(lambda w: w)


def hand_written(apply: Callable) -> tuple[Callable, Callable]:
    """A hand-written ``value_and_grad_func``: each leaf's gradient normalised to unit norm."""
    loss = _registered_loss(apply)
    value_and_grad = jax.value_and_grad(loss)

    def func(p, batch):
        value, grads = value_and_grad(p, batch)
        return value, jax.tree_util.tree_map(lambda g: g / jnp.linalg.norm(g), grads)

    return func, loss


def hand_written_wraps(apply: Callable) -> tuple[Callable, Callable]:
    """As ``hand_written``, decorated with ``functools.wraps(loss)``: it carries ``__wrapped__ = loss``
    like ``jax.value_and_grad(loss)`` does, yet does not return ``loss``'s gradient."""
    loss = _registered_loss(apply)
    value_and_grad = jax.value_and_grad(loss)

    @functools.wraps(loss)
    def func(p, batch):
        value, grads = value_and_grad(p, batch)
        return value, jax.tree_util.tree_map(lambda g: 3.0 * jnp.tanh(g), grads)

    return func, loss


CUSTOM = {
    "custom_vjp_clipped": custom_vjp_clipped,
    "straight_through": straight_through,
    "straight_through_inline_rule": straight_through_inline_rule,
    "straight_through_stop_gradient": straight_through_stop_gradient,
    "stop_gradient_weights": stop_gradient_weights,
    "hand_written": hand_written,
    "hand_written_wraps": hand_written_wraps,
}


# --- oracles ------------------------------------------------------------------------------------


def flat(tree: Any) -> jax.Array:
    return ravel_pytree(tree)[0]


def one_step(value_and_grad_func: Callable, params: Any, batch: Any) -> tuple[Any, Any, Any, curvax.Optimizer]:
    """One fixed-coefficient step whose curvature is exactly this batch's, inverted exactly."""
    opt = curvax.Optimizer(
        value_and_grad_func, l2_reg=L2, num_burnin_steps=0, curvature_ema=0.0, inverse_update_period=1,
        use_exact_inverses=True, estimation_mode="ggn_exact", include_norms_in_stats=True,
    )
    state = opt.init(params, KEY, batch)
    new_params, state, stats = opt.step(params, state, KEY, batch=batch, learning_rate=LR, momentum=0.0, damping=DAMPING)
    return new_params, state, stats, opt


def dense_step(curvature: jax.Array, grads: Any) -> jax.Array:
    """``-lr (C + (damping + l2) I)^-1 g`` in the flat parameter order."""
    matrix = curvature + (DAMPING + L2) * jnp.eye(curvature.shape[0])
    return -LR * jnp.linalg.solve(matrix, flat(grads))


def assert_step(actual: jax.Array, expected: jax.Array, wrong: jax.Array) -> None:
    """``actual`` equals ``expected``, which is far from ``wrong`` (so the check can tell them apart)."""
    scale = float(jnp.linalg.norm(expected))
    assert float(jnp.linalg.norm(wrong - expected)) > 0.05 * scale, "the oracles coincide: the case tests nothing"
    np.testing.assert_allclose(actual, expected, rtol=1e-8, atol=1e-10 * scale)


# --- 1. variational Monte Carlo: a custom_jvp energy with FermiNet's gradient ---------------------

VMC_RULES = {"calls_the_custom_function": vmc.value_and_grad_func, "inline": vmc.value_and_grad_func_inline_rule}


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("rule", ["calls_the_custom_function", "inline"])
def test_vmc_grad_norm_is_the_norm_of_the_users_gradient(rule):
    """``stats["grad_norm"]`` at step 0 is the norm of the VMC gradient the user's rule gives, not
    of the derivative of the sampled mean local energy (differentiating the primal). The rule
    gets its primal output by calling ``total_energy`` (FermiNet), or by evaluating it inline."""
    value_and_grad_func = VMC_RULES[rule]
    params = vmc.init_params(KEY)
    walkers = vmc.initial_walkers(jax.random.PRNGKey(1), 128)  # the identities hold for any walkers
    (energy, _), user = jax.jit(value_and_grad_func)(params, walkers)
    # The rule is the VMC gradient; the primal's derivative is another vector, of another norm.
    direct = jax.jit(vmc.vmc_gradient)(params, walkers)
    np.testing.assert_allclose(flat(user), flat(direct), rtol=1e-10, atol=1e-12)
    primal = flat(jax.jit(vmc.primal_gradient)(params, walkers))
    user_norm, primal_norm = float(jnp.linalg.norm(flat(user))), float(jnp.linalg.norm(primal))
    assert abs(user_norm - primal_norm) > 0.05 * user_norm

    opt = curvax.Optimizer(
        value_and_grad_func, l2_reg=0.0, value_func_has_aux=True, num_burnin_steps=0, include_norms_in_stats=True
    )
    state = opt.init(params, KEY, walkers)
    _, _, stats = opt.step(params, state, KEY, batch=walkers, learning_rate=0.1, momentum=0.0, damping=1e-3)
    np.testing.assert_allclose(stats["grad_norm"], user_norm, rtol=1e-6)
    np.testing.assert_allclose(stats["loss"], energy, rtol=1e-10)
    variance = jnp.var(jax.jit(vmc.local_energies)(params, walkers))
    np.testing.assert_allclose(stats["aux"]["variance"], variance, rtol=1e-8)


@pytest.mark.parametrize("rule", ["calls_the_custom_function", pytest.param("inline", marks=pytest.mark.slow)])
def test_vmc_finds_the_hydrogen_ground_state_energy(rule):
    """120 K-FAC steps on 256 Metropolis walkers (10 moves per step) reach E = -1/2 Ha within
    5 mHa, with the local energy's variance (zero at the exact ground state) nearly gone.
    (Damping 1e-2: the last layer has one output, so its damped Kronecker block is exactly
    ``g A + d I``, kfac-jax's rule; damping 1e-3 with this learning rate diverges.)
    Stepping along the primal's derivative instead drives the sampled energy below -1/2."""
    value_and_grad_func = VMC_RULES[rule]
    params = vmc.init_params(KEY)
    key = jax.random.PRNGKey(1)
    walkers, _ = vmc.make_mcmc(100)(params, vmc.initial_walkers(key, 256), jax.random.PRNGKey(2))
    mcmc = vmc.make_mcmc(10)
    opt = curvax.Optimizer(value_and_grad_func, l2_reg=0.0, value_func_has_aux=True, num_burnin_steps=0)
    state = opt.init(params, KEY, walkers)
    energies, variances = [], []
    for _ in range(120):
        key, k_mcmc, k_step = jax.random.split(key, 3)
        walkers, _ = mcmc(params, walkers, k_mcmc)
        params, state, stats = opt.step(
            params, state, k_step, batch=walkers, learning_rate=0.3, momentum=0.0, damping=1e-2
        )
        energies.append(float(stats["loss"]))
        variances.append(float(stats["aux"]["variance"]))
    assert abs(np.mean(energies[-20:]) + 0.5) < 0.005, energies[-20:]
    assert np.mean(variances[-20:]) < 0.01, variances[-20:]


# --- 2. custom gradients in every framework: one step is the dense formula with the user's g -----


# Run by default in every framework: a custom VJP, a custom JVP (straight-through) and a
# hand-written value_and_grad_func; every case in plain JAX; the rest slow.
EVERY_FRAMEWORK = ("custom_vjp_clipped", "straight_through", "hand_written")


def _case(framework: str, case: str) -> Any:
    """The cases of ``EVERY_FRAMEWORK`` in every framework and every case in plain JAX by default."""
    default = framework == "plain_jax" or case in EVERY_FRAMEWORK
    return pytest.param(framework, case, id=f"{framework}-{case}", marks=() if default else pytest.mark.slow)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("framework,case", [_case(f, c) for f in FRAMEWORKS for c in CUSTOM])
def test_step_follows_the_users_gradient(framework, case):
    """``delta = -lr (C + (damping + l2) I)^-1 g_user``; C: the block-diagonal curvature of this
    batch that the step used (``curvature_ema=0``, inverses refreshed every step, exact)."""
    apply, params = FRAMEWORKS[framework](KEY)
    batch = _batch(jax.random.PRNGKey(1))
    value_and_grad_func, rule_free_loss = CUSTOM[case](apply)
    value, user = value_and_grad_func(params, batch)
    new_params, state, stats, opt = one_step(value_and_grad_func, params, batch)
    curvature = opt.estimator.to_dense_matrix(state.estimator_state)
    wrong = dense_step(curvature, jax.grad(rule_free_loss)(params, batch))
    assert_step(flat(new_params) - flat(params), dense_step(curvature, user), wrong)
    np.testing.assert_allclose(stats["loss"], value, rtol=1e-12)
    np.testing.assert_allclose(stats["grad_norm"], jnp.linalg.norm(flat(user)), rtol=1e-10)


EXACT_DEFAULT = ("custom_vjp_clipped", "straight_through_inline_rule", "hand_written")


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in EXACT_DEFAULT else pytest.mark.slow) for c in CUSTOM])
def test_step_follows_the_users_gradient_with_an_exact_dense_oracle(case):
    """One dense layer with the squared error: K-FAC's curvature is the exact GGN
    ``(1/B) sum_n J_n^T 2I J_n`` (jax.jacobian), independent of the optimizer's state."""
    apply, params = plain_linear(KEY)
    batch = _batch(jax.random.PRNGKey(1))
    value_and_grad_func, rule_free_loss = CUSTOM[case](apply)
    _, user = value_and_grad_func(params, batch)
    new_params, state, _, opt = one_step(value_and_grad_func, params, batch)
    theta, unravel = ravel_pytree(params)
    jac = jax.jacobian(lambda t: apply(unravel(t), batch[0]))(theta).reshape(B * OUT, -1)
    ggn = 2.0 * jac.T @ jac / B
    np.testing.assert_allclose(opt.estimator.to_dense_matrix(state.estimator_state), ggn, rtol=1e-10, atol=1e-12)
    wrong = dense_step(ggn, jax.grad(rule_free_loss)(params, batch))
    assert_step(flat(new_params) - flat(params), dense_step(ggn, user), wrong)


# --- 3. the ordinary case is unchanged -----------------------------------------------------------


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("framework", [pytest.param(f, marks=() if f == "plain_jax" else pytest.mark.slow) for f in FRAMEWORKS])
def test_ordinary_step_is_the_dense_formula(framework):
    """``jax.value_and_grad(loss)`` without custom rules: the same dense formula, where the user's
    gradient is the loss's derivative."""
    apply, params = FRAMEWORKS[framework](KEY)
    batch = _batch(jax.random.PRNGKey(1))
    value_and_grad_func, loss = plain(apply)
    _, user = value_and_grad_func(params, batch)
    np.testing.assert_allclose(flat(user), flat(jax.grad(loss)(params, batch)), rtol=1e-12)
    new_params, state, _, opt = one_step(value_and_grad_func, params, batch)
    curvature = opt.estimator.to_dense_matrix(state.estimator_state)
    np.testing.assert_allclose(flat(new_params) - flat(params), dense_step(curvature, user), rtol=1e-8, atol=1e-12)


@pytest.mark.usefixtures("x64")
def test_ordinary_step_with_an_exact_dense_oracle():
    """One dense layer, plain ``jax.value_and_grad``: the step is ``-lr (H + (damping + l2) I)^-1 g``
    with H the loss's Hessian (``jax.hessian``), which K-FAC's block equals here."""
    apply, params = plain_linear(KEY)
    batch = _batch(jax.random.PRNGKey(1))
    value_and_grad_func, _ = plain(apply)
    _, user = value_and_grad_func(params, batch)
    new_params, _, _, _ = one_step(value_and_grad_func, params, batch)
    theta, unravel = ravel_pytree(params)
    hessian = jax.hessian(lambda t: _squared_error(apply(unravel(t), batch[0]), batch[1]))(theta)
    np.testing.assert_allclose(flat(new_params) - flat(params), dense_step(hessian, user), rtol=1e-8, atol=1e-12)


@pytest.mark.usefixtures("x64")
def test_shared_gradient_pass_only_where_it_is_the_users_gradient():
    """Where the value's derivative is provably the user's gradient, the step does not pay for a
    second forward and backward pass; where it is not the user's gradient, the pass is not shared."""
    apply, params = plain_mlp(KEY)
    batch = _batch(jax.random.PRNGKey(1))

    def shares(value_and_grad_func: Callable) -> bool:
        opt = curvax.Optimizer(value_and_grad_func, l2_reg=L2, num_burnin_steps=0)
        opt.init(params, KEY, batch)
        return opt.shares_gradient_pass

    assert shares(plain(apply)[0])
    for case in ("custom_vjp_clipped", "straight_through_inline_rule", "hand_written", "hand_written_wraps"):
        assert not shares(CUSTOM[case](apply)[0]), case


def _energy_by_iteration(params: dict[str, Any], walkers: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``vmc``'s primal with the energy refined by a ``lax.while_loop`` (an iterative solver in the
    value code; its fixed point is the mean local energy, reached exactly: ``(m + m) / 2 = m``)."""
    e_l = vmc.local_energies(params, walkers)
    mean = jnp.mean(e_l)
    _, energy = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, 0.5 * (c[1] + mean)), (0, mean))
    return energy, {"local_energy": e_l, "variance": jnp.mean((e_l - energy) ** 2)}


_energy_iterated = jax.custom_jvp(_energy_by_iteration)
_energy_iterated.defjvp(vmc._vmc_rule(_energy_by_iteration))


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_step_never_differentiates_the_value_code_of_a_custom_rule(adaptive):
    """The gradient comes from the user's rule, and the curvature needs only the registered
    loss's input (``log psi``), so the step must not linearize the code that computes the value:
    here a ``while_loop`` (no reverse mode), which made the curvature pass raise although the
    user's ``value_and_grad_func`` runs (kfac-jax 0.0.8 steps). With the same value and rule as
    ``vmc``'s inline-rule loss, the step is that loss's step."""
    iterated = jax.value_and_grad(_energy_iterated, has_aux=True)
    params = vmc.init_params(KEY)
    walkers = vmc.initial_walkers(jax.random.PRNGKey(1), 32)
    (value, _), user = jax.jit(iterated)(params, walkers)
    (ref_value, _), ref_user = jax.jit(vmc.value_and_grad_func_inline_rule)(params, walkers)
    assert value == ref_value
    np.testing.assert_array_equal(flat(user), flat(ref_user))
    with pytest.raises(ValueError, match="Reverse-mode"):  # the value code itself has no transpose
        jax.grad(lambda p: _energy_by_iteration(p, walkers)[0])(params)

    def step(value_and_grad_func: Callable) -> tuple[Any, Any]:
        coefficients = {} if adaptive else {"learning_rate": 0.1, "momentum": 0.0, "damping": 1e-3}
        opt = curvax.Optimizer(
            value_and_grad_func, l2_reg=0.0, value_func_has_aux=True, num_burnin_steps=0,
            use_adaptive_learning_rate=adaptive, use_adaptive_momentum=adaptive, use_adaptive_damping=adaptive,
            initial_damping=1e-3 if adaptive else None,
        )
        state = opt.init(params, KEY, walkers)
        new_params, _, stats = opt.step(params, state, KEY, batch=walkers, **coefficients)
        return new_params, stats

    new_params, stats = step(iterated)
    ref_params, ref_stats = step(vmc.value_and_grad_func_inline_rule)
    assert float(stats["loss"]) == float(value)
    np.testing.assert_allclose(flat(new_params), flat(ref_params), rtol=1e-12, atol=1e-14)
    assert not np.allclose(flat(new_params), flat(params))
    if adaptive:
        np.testing.assert_allclose(stats["learning_rate"], ref_stats["learning_rate"], rtol=1e-10)
