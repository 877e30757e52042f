"""Mixed precision: bfloat16 and float16 parameters train with float32 curvature.

The statistics of a half-precision model are accumulated, stored and decomposed in float32 by
default (``curvature_dtype`` / ``inverse_dtype`` choose otherwise); the updates come back in
each parameter's dtype.

* (a) A small MLP and a small transformer in bfloat16 follow the float32 K-FAC loss curve.
* (b) A bfloat16 model's factors are float32 and equal the float32 model's to bfloat16
  precision; factors of exactly representable inputs equal them to float32 precision.
* (c) float16 trains too.
* (d) Dense and convolution layers of every framework train in bfloat16.
* (e) ``curvature_dtype`` / ``inverse_dtype`` are validated and honoured (float64 under x64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax
import models
import zoo

# The bfloat16 runs start from the float32 run's parameters rounded to bfloat16, and the
# float32 runs start from those same rounded values: only the arithmetic differs.


def _cast(tree, dtype):
    return jax.tree_util.tree_map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _rounded(tree, dtype=jnp.bfloat16):
    """``tree`` rounded to ``dtype`` and back to float32: a start both precisions share exactly."""
    return _cast(_cast(tree, dtype), jnp.float32)


def _adaptive_optimizer(loss_fn, **kw):
    return curvax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss_fn), l2_reg=0.0, num_burnin_steps=0, inverse_update_period=1,
        use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True,
        initial_damping=1.0, damping_adaptation_interval=1, **kw,
    )


def _train(loss_fn, params, batch, steps, **kw):
    """The per-step losses of adaptive K-FAC, and the final parameters and state."""
    opt = _adaptive_optimizer(loss_fn, **kw)
    state = opt.init(params, jax.random.PRNGKey(2), batch)
    losses = []
    for i in range(steps):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(10 + i), batch=batch, global_step_int=None)
        losses.append(float(stats["loss"]))
    return np.array(losses), params, state


def _floating_dtypes(tree) -> set[str]:
    return {str(jnp.result_type(x)) for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.floating)}


def _mlp():
    """A tanh MLP classifier (tests/models.py) on labels a linear teacher gives: learnable."""
    params, (x, _) = models.classifier(64, dims=(6, 16, 3))
    labels = jnp.argmax(x @ jax.random.normal(jax.random.PRNGKey(3), (6, 3)), axis=-1)
    return models.softmax_loss, _rounded(params), (_rounded(x), labels)


def _transformer():
    """zoo's transformer block on a deterministic next-token task (test_zoo's)."""
    loss, params, _ = zoo.jax_transformer(jax.random.PRNGKey(0))
    starts = jax.random.randint(jax.random.PRNGKey(1), (16, 1), 0, zoo.VOCAB)
    seq = (starts + 2 * jnp.arange(zoo.T + 1)[None]) % zoo.VOCAB
    return loss, _rounded(params), (seq[:, :-1], seq[:, 1:])


# --- (a) bfloat16 follows the float32 loss curve --------------------------------------------------

# Tolerance: bfloat16 keeps 8 significant bits, a relative rounding of 2^-9 ~ 2e-3 per operation
# (eps = 2^-8 ~ 3.9e-3). Each step rounds the activations, the loss, the gradient and the update,
# and the next step starts from the rounded parameters, so the two runs drift apart by a few eps
# per step. Over 12 steps of a loss that falls by an order of magnitude we allow a relative gap of
# 5% (~13 eps) plus 0.01 absolute (losses near 0.05-0.15, where one eps of the logits moves the
# loss by ~1e-3). Measured: at most 0.8% (MLP) and 3.1% (transformer, step 8) apart.
CURVE_RTOL, CURVE_ATOL, CURVE_STEPS = 0.05, 0.01, 12


@pytest.mark.parametrize("model", [_mlp, _transformer], ids=["mlp", "transformer"])
def test_bfloat16_follows_the_float32_kfac_loss_curve(model):
    loss_fn, params, batch = model()
    ref, _, _ = _train(loss_fn, params, batch, CURVE_STEPS)
    half, p_half, state = _train(loss_fn, _cast(params, jnp.bfloat16), _cast(batch, jnp.bfloat16), CURVE_STEPS)
    print("float32 ", np.round(ref, 4).tolist())
    print("bfloat16", np.round(half, 4).tolist())
    assert np.all(np.isfinite(half))
    assert half[-1] < 0.3 * half[0]  # it trains
    np.testing.assert_allclose(half, ref, rtol=CURVE_RTOL, atol=CURVE_ATOL)
    # The parameters stay bfloat16; the curvature (statistics and cache) is float32.
    assert _floating_dtypes(p_half) == {"bfloat16"}
    assert _floating_dtypes(state.estimator_state) == {"float32"}
    assert _floating_dtypes(state.velocities) == {"bfloat16"}


# --- (b) the factors ------------------------------------------------------------------------------


def _factors(loss_fn, params, batch, **options):
    """The estimator and its state after one (deterministic) update and a cache refresh."""
    est = curvax.BlockDiagonalCurvature(loss_fn, **options)
    state = est.init(jax.random.PRNGKey(0), (params, batch), None, -1)
    n = jax.tree_util.tree_leaves(batch)[0].shape[0]

    @jax.jit
    def update(state):
        state = est.update_curvature_matrix_estimate(
            state, 0.0, 1.0, n, jax.random.PRNGKey(1), (params, batch), estimation_mode="ggn_curvature_prop"
        )
        return est.update_cache(state, 1e-3, None, -1, False)

    return est, update(state)


def _cnn():
    loss, params, batch = zoo.jax_cnn(jax.random.PRNGKey(0))
    return loss, _rounded(params), (_rounded(batch[0]), batch[1])


@pytest.mark.parametrize("model", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_bfloat16_factors_are_float32_and_equal_the_float32_factors(model):
    loss_fn, params, batch = model()
    est32, s32 = _factors(loss_fn, params, batch)
    est16, s16 = _factors(loss_fn, _cast(params, jnp.bfloat16), _cast(batch, jnp.bfloat16))
    assert [type(b) for b in est16.blocks] == [type(b) for b in est32.blocks]
    assert all(b.dtype == jnp.float32 for b in est16.blocks)
    assert _floating_dtypes(s16) == {"float32"}  # statistics and cached inverses
    for i, (b16, b32) in enumerate(zip(s16.blocks_states, s32.blocks_states)):
        for name in ("inputs_factor", "outputs_factor"):
            f16, f32 = np.asarray(getattr(b16, name).value), np.asarray(getattr(b32, name).value)
            if i == 0 and name == "inputs_factor":
                # The first layer's inputs are the batch, exact in bfloat16, and a product of two
                # bfloat16 numbers is exact in float32: accumulated in float32, this factor is
                # the float32 model's up to the order of the sums (bfloat16 sums would be ~3e-3 off).
                np.testing.assert_allclose(f16, f32, rtol=1e-5, atol=1e-6 * np.abs(f32).max())
            else:
                # Activations and output tangents rounded to bfloat16 (relative 2^-9 each, a few
                # roundings deep): 2% of the factor's norm.
                assert np.linalg.norm(f16 - f32) <= 2e-2 * np.linalg.norm(f32), (i, name)


def _scan_loss(p, batch):
    """Three dense layers stacked in a ``lax.scan``: one ``StackedBlock`` wrapping a dense block."""
    x, t = batch
    h, _ = jax.lax.scan(lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None), x, (p["w"], p["b"]))
    y = h @ p["out"]
    curvax.register_squared_error_loss(y, t)
    return 0.5 * jnp.mean(jnp.sum((y - t) ** 2, -1))


def test_wrapped_blocks_of_a_bfloat16_model_follow_the_dtype_options(x64):
    """A ``StackedBlock`` (and the block it wraps) gets float32 statistics for a bfloat16 model,
    and float64 ones when ``curvature_dtype`` asks."""
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {"w": jax.random.normal(k[0], (3, 4, 4)) / 2, "b": jax.random.normal(k[1], (3, 4)) / 10,
              "out": jax.random.normal(k[2], (4, 2))}
    batch = (jax.random.normal(k[3], (5, 4)), jax.random.normal(k[4], (5, 2)))
    params, batch = _cast(params, jnp.bfloat16), _cast(batch, jnp.bfloat16)
    for options, want in (({}, "float32"), ({"curvature_dtype": jnp.float64}, "float64")):
        est, state = _factors(_scan_loss, params, batch, **options)
        stacked = [b for b in est.blocks if type(b).__name__ == "StackedBlock"]
        assert len(stacked) == 1 and stacked[0].inner.dtype == want
        assert _floating_dtypes(state) == {want}


def test_kfac_operator_of_a_bfloat16_model_is_float32():
    loss_fn, params, batch = _mlp()
    k32 = curvax.operators.kfac(loss_fn, params, batch, fisher_type="type-2")
    k16 = curvax.operators.kfac(loss_fn, _cast(params, jnp.bfloat16), _cast(batch, jnp.bfloat16), fisher_type="type-2")
    dense16, dense32 = k16.to_dense(), k32.to_dense()
    assert k16.dtype == jnp.float32 and dense16.dtype == jnp.float32
    assert np.linalg.norm(dense16 - dense32) <= 2e-2 * np.linalg.norm(dense32)
    # Products come back in the parameters' dtype.
    v = _cast(jax.tree_util.tree_map(jnp.ones_like, params), jnp.bfloat16)
    assert _floating_dtypes(k16 @ v) == {"bfloat16"}


# --- (c) float16 ----------------------------------------------------------------------------------


def test_float16_follows_the_float32_kfac_loss_curve():
    """float16 keeps 11 significant bits (eps ~ 1e-3, 4x finer than bfloat16): the curves agree to
    1% relative (~10 eps) plus 2e-3; measured: at most 0.3% apart over 8 steps."""
    loss_fn, params, batch = _mlp()
    params, batch = _rounded(params, jnp.float16), (_rounded(batch[0], jnp.float16), batch[1])
    ref, _, _ = _train(loss_fn, params, batch, 8)
    half, p_half, state = _train(loss_fn, _cast(params, jnp.float16), _cast(batch, jnp.float16), 8)
    assert np.all(np.isfinite(half)) and half[-1] < 0.5 * half[0]
    np.testing.assert_allclose(half, ref, rtol=0.01, atol=2e-3)
    assert _floating_dtypes(p_half) == {"float16"}
    assert _floating_dtypes(state.estimator_state) == {"float32"}


def test_optax_preconditioner_on_float16_parameters():
    loss_fn, params, batch = _mlp()
    half, hbatch = _cast(params, jnp.float16), _cast(batch, jnp.float16)
    tx = curvax.kfac_preconditioner(loss_fn, hbatch, damping=1e-2, estimation_mode="ggn_curvature_prop")
    state = tx.init(half)
    grads = jax.grad(loss_fn)(half, hbatch)
    precon, state = jax.jit(lambda g, s, p: tx.update(g, s, p, batch=hbatch))(grads, state, half)
    assert _floating_dtypes(precon) == {"float16"}
    assert _floating_dtypes(state.estimator_state) == {"float32"}
    # The same direction as float32 K-FAC's (rounded to float16 on the way in and out).
    tx32 = curvax.kfac_preconditioner(loss_fn, batch, damping=1e-2, estimation_mode="ggn_curvature_prop")
    ref, _ = jax.jit(lambda g, s, p: tx32.update(g, s, p, batch=batch))(jax.grad(loss_fn)(params, batch), tx32.init(params), params)
    a, b = ravel_pytree(_cast(precon, jnp.float32))[0], ravel_pytree(ref)[0]
    assert float(jnp.linalg.norm(a - b)) <= 2e-2 * float(jnp.linalg.norm(b))


def test_norm_constraint_keeps_bfloat16_parameters():
    """A fixed learning rate with ``norm_constraint``: the constrained update stays bfloat16."""
    loss_fn, params, batch = _mlp()
    half, hbatch = _cast(params, jnp.bfloat16), _cast(batch, jnp.bfloat16)
    opt = curvax.Optimizer(jax.value_and_grad(loss_fn), l2_reg=0.0, num_burnin_steps=0, norm_constraint=1e-3)
    state = opt.init(half, jax.random.PRNGKey(0), hbatch)
    losses = []
    for i in range(3):
        half, state, stats = opt.step(half, state, jax.random.PRNGKey(i), batch=hbatch, learning_rate=1.0,
                                      momentum=0.0, damping=1e-2, global_step_int=None)
        losses.append(float(stats["loss"]))
    assert _floating_dtypes(half) == {"bfloat16"} and _floating_dtypes(state.velocities) == {"bfloat16"}
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


# --- (d) every framework's dense and convolution layers -------------------------------------------


@pytest.mark.parametrize("framework", list(zoo.BUILDERS["cnn"]))
def test_every_frameworks_dense_and_conv_layers_train_in_bfloat16(framework):
    loss_fn, params, batch = zoo.BUILDERS["cnn"][framework](jax.random.PRNGKey(0))
    params, batch = _cast(params, jnp.bfloat16), _cast(batch, jnp.bfloat16)
    assert zoo.registration(loss_fn, params, batch) == zoo.EXPECTED["cnn"]  # conv and dense found in bfloat16
    losses, p, state = _train(loss_fn, params, batch, 4)
    assert np.all(np.isfinite(losses)) and np.all(np.diff(losses) < 0), losses
    assert _floating_dtypes(p) == {"bfloat16"} and _floating_dtypes(state.estimator_state) == {"float32"}


# --- (e) the dtype options ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["curvature_dtype", "inverse_dtype"])
@pytest.mark.parametrize("value", [jnp.bfloat16, jnp.float16, jnp.int32, "fp32"])
def test_a_bad_dtype_option_is_refused_naming_it(name, value):
    loss_fn, _, batch = _mlp()
    with pytest.raises(ValueError, match=rf"`{name}` must be None.*float32 or float64"):
        curvax.Optimizer(jax.value_and_grad(loss_fn), l2_reg=1e-3, **{name: value})
    with pytest.raises(ValueError, match=rf"`{name}`"):
        curvax.kfac_preconditioner(loss_fn, batch, damping=1e-2, **{name: value})
    with pytest.raises(ValueError, match=rf"`{name}`"):
        curvax.OptaxPreconditioner(loss_fn, damping=1e-2, **{name: value})
    with pytest.raises(ValueError, match=rf"`{name}`"):
        curvax.BlockDiagonalCurvature(loss_fn, **{name: value})


def test_float64_without_x64_is_refused_naming_the_flag():
    loss_fn, _, _ = _mlp()
    with pytest.raises(ValueError, match=r"`curvature_dtype`=float64 needs 64-bit JAX.*jax_enable_x64"):
        curvax.Optimizer(jax.value_and_grad(loss_fn), l2_reg=1e-3, curvature_dtype=jnp.float64)


def test_float64_statistics_and_inverses_when_asked(x64):
    """A float32 model with ``curvature_dtype=float64``: its first factor is ``x^T x / B`` summed in
    float64 (products of float32 numbers are exact in float64: the numpy float64 oracle to 1e-12);
    ``inverse_dtype=float64`` alone keeps float32 statistics and a float64 cache."""
    loss_fn, params, batch = _mlp()
    params, batch = _cast(params, jnp.float32), (_cast(batch[0], jnp.float32), batch[1])
    _, state = _factors(loss_fn, params, batch, curvature_dtype=jnp.float64)
    assert _floating_dtypes(state) == {"float64"}
    x = np.asarray(batch[0], np.float64)
    x1 = np.concatenate([x, np.ones((64, 1))], axis=1)  # the bias column
    np.testing.assert_allclose(np.asarray(state.blocks_states[0].inputs_factor.value), x1.T @ x1 / 64, rtol=1e-12)

    assert _floating_dtypes(curvax.BlockDiagonalCurvature(loss_fn, inverse_dtype="float64").init(
        jax.random.PRNGKey(0), (params, batch), None, -1).blocks_states[0].cache) == {"float64"}
    est, state = _factors(loss_fn, params, batch, inverse_dtype="float64")
    b0 = state.blocks_states[0]
    assert _floating_dtypes(b0.cache) == {"float64"}
    assert _floating_dtypes((b0.inputs_factor, b0.outputs_factor)) == {"float32"}
    g = jax.grad(loss_fn)(params, batch)
    precon = est.multiply_inverse(state, g, 1e-3, False, True)
    assert _floating_dtypes(precon) == {"float32"}  # back in the parameters' dtype


def test_the_optimizer_honours_the_dtype_options(x64):
    """``curvax.Optimizer(curvature_dtype=..., inverse_dtype=...)`` reaches the blocks; a bfloat16
    model with float64 curvature trains."""
    loss_fn, params, batch = _mlp()
    half = (_cast(params, jnp.bfloat16), _cast(batch, jnp.bfloat16))
    losses, p, state = _train(loss_fn, *half, 3, curvature_dtype=jnp.float64, inverse_dtype=jnp.float64)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert _floating_dtypes(state.estimator_state) == {"float64"}
    assert _floating_dtypes(p) == {"bfloat16"}
