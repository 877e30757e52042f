"""Traced programs are only run at the shapes they were traced with.

Frameworks bake sizes into the traced equations (Haiku broadcasts a dense bias to
``(batch, out)``), so a program traced on a batch of B and re-run on one example
silently computes something else. These tests compare the exact estimators, which
work example by example, with dense ``jax.jacobian``/``jax.hessian`` oracles in every
framework and at several batch sizes, and check that evaluating a program at other
shapes raises.
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
from curvax.tags import LossTag

pytestmark = pytest.mark.usefixtures("x64")

KEY = jax.random.PRNGKey(0)
IN, HID, OUT = 3, 4, 2
HW, CH, CLASSES = 5, 2, 3


def _f64(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), tree)


# --- models: apply(params, x) and float64 parameters ----------------------------------


def _plain_jax() -> tuple[Callable, Any]:
    k1, k2, k3 = jax.random.split(KEY, 3)
    params = {"w0": jax.random.normal(k1, (IN, HID)) / 2, "b0": jax.random.normal(k3, (HID,)) / 4,
              "w1": jax.random.normal(k2, (HID, OUT)) / 2, "b1": jnp.zeros(OUT)}
    return (lambda p, x: jnp.tanh(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"]), params


def _haiku_conv() -> tuple[Callable, Any]:
    import haiku as hk

    def fn(x):
        h = jnp.tanh(hk.Conv2D(CH, 3)(x))
        return hk.Linear(CLASSES)(h.reshape(h.shape[0], -1))

    model = hk.without_apply_rng(hk.transform(fn))
    return model.apply, model.init(KEY, jnp.zeros((1, HW, HW, 1)))


def _flax_linen_conv() -> tuple[Callable, Any]:
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Conv(CH, (3, 3))(x))
            return nn.Dense(CLASSES)(h.reshape(h.shape[0], -1))

    model = CNN()
    return model.apply, model.init(KEY, jnp.zeros((1, HW, HW, 1)))


MLPS = {"plain_jax": _plain_jax,
        **{f: functools.partial(models.framework_tanh_mlp, f, KEY, IN, HID, OUT) for f in models.TANH_MLP_FRAMEWORKS}}
CONVS = {"haiku_conv": _haiku_conv, "flax_linen_conv": _flax_linen_conv}


def _sq_loss(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


def _xent(logits: jax.Array, y: jax.Array) -> jax.Array:
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1))


@functools.lru_cache(maxsize=None)
def _built(name: str) -> tuple[Callable, Any]:
    return {**MLPS, **CONVS}[name]()


def problem(name: str, n: int) -> tuple[Callable, Callable, Callable, Any, Any]:
    """``(loss_fn, apply, loss_of_outputs, params, batch)`` for a batch of ``n`` examples."""
    apply, params = _built(name)
    params = _f64(params)
    kx, ky = jax.random.split(jax.random.fold_in(KEY, n))
    if name in CONVS:
        batch = (jax.random.normal(kx, (n, HW, HW, 1)), jax.random.randint(ky, (n,), 0, CLASSES))
        loss_of_outputs = _xent
        register = curvax.register_softmax_cross_entropy_loss
    else:
        batch = (jax.random.normal(kx, (n, IN)), jax.random.normal(ky, (n, OUT)))
        loss_of_outputs = _sq_loss
        register = curvax.register_squared_error_loss

    def loss_fn(p, b):
        out = apply(p, b[0])
        register(out, b[1])
        return loss_of_outputs(out, b[1])

    return loss_fn, apply, loss_of_outputs, params, batch


def dense_ggn(apply: Callable, loss_of_outputs: Callable, params: Any, batch: Any) -> np.ndarray:
    """``J^T H J``: J the Jacobian of all outputs w.r.t. the flat parameters, H the loss's Hessian in the outputs.

    For the mean loss this is ``(1/B) sum_n J_n^T M_n J_n``; for these losses the GGN equals the Fisher.
    """
    flat, unravel = ravel_pytree(params)

    @jax.jit
    def ggn(flat: jax.Array, batch: Any) -> jax.Array:
        out = apply(unravel(flat), batch[0])
        jac = jax.jacobian(lambda f: apply(unravel(f), batch[0]).reshape(-1))(flat)
        hess = jax.hessian(lambda o: loss_of_outputs(o.reshape(out.shape), batch[1]))(out.reshape(-1))
        return jac.T @ hess @ jac

    return np.asarray(ggn(flat, batch))


ALL = list(MLPS) + list(CONVS)


def _cases(names: Any, sizes: Any, fast: Any) -> list[Any]:
    """``(name, n)`` cases; those not in ``fast`` are marked slow (the default run stays short)."""
    return [pytest.param(a, n, marks=() if (a, n) in fast else pytest.mark.slow) for a in names for n in sizes]


# Every framework at every size (the README's claim: batch sizes 1, 3 and 8 in each).
_EXPLICIT_FAST = {(a, n) for a in ALL for n in (1, 3, 8)}


@pytest.mark.parametrize("name,n", _cases(ALL, (1, 3, 8), _EXPLICIT_FAST))
def test_explicit_exact_equals_dense_ggn(name, n):
    loss_fn, apply, loss_of_outputs, params, batch = problem(name, n)
    oracle = dense_ggn(apply, loss_of_outputs, params, batch)
    est = curvax.ExplicitExactCurvature(loss_fn)
    state = est.init(KEY, (params, batch))
    flat, unravel = ravel_pytree(params)
    v = jax.random.normal(KEY, flat.shape)
    # The two modes share the per-example loop; the Fisher (equal to the GGN for these losses) once.
    for mode in ("ggn_exact", "fisher_exact") if n == 3 else ("ggn_exact",):
        s = est.update_curvature_matrix_estimate(state, 0.0, 1.0, n, KEY, (params, batch), estimation_mode=mode)
        np.testing.assert_allclose(est.to_dense_matrix(s), oracle, rtol=1e-9, atol=1e-12)
    got = ravel_pytree(est.multiply(s, unravel(v), 0.0, True, False))[0]
    np.testing.assert_allclose(got, oracle @ v, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name,n", _cases(("haiku", "flax_nnx", "haiku_conv"), (1, 3, 8), {("haiku", 8), ("haiku_conv", 3)}))
def test_implicit_exact_equals_dense_ggn(name, n):
    loss_fn, apply, loss_of_outputs, params, batch = problem(name, n)
    oracle = dense_ggn(apply, loss_of_outputs, params, batch)
    imp = curvax.ImplicitExactCurvature(loss_fn)
    flat, unravel = ravel_pytree(params)
    v = jax.random.normal(KEY, flat.shape)
    for mv in (imp.multiply_ggn, imp.multiply_fisher):
        np.testing.assert_allclose(ravel_pytree(mv((params, batch), unravel(v)))[0], oracle @ v, rtol=1e-9, atol=1e-12)


def test_a_program_refuses_inputs_of_other_shapes():
    """The evaluator checks the inputs' shapes: a trace at B=8 run on 3 examples raises, it does not compute."""
    loss_fn, _, _, params, batch = problem("haiku", 8)
    pj = curvax.ProcessedJaxpr.make_from_func(loss_fn, (params, batch))
    _, _, _, _, small = problem("haiku", 3)
    p, o = pj.split_args((params, small))
    with pytest.raises(ValueError, match=r"traced with shape \(8, 3\)"):
        pj.evaluate(p, o)
    with pytest.raises(ValueError, match="dtype"):
        pj.evaluate(p, [x.astype(jnp.float32) for x in pj.split_args((params, batch))[1]])


def test_explicit_exact_with_a_fixed_batch_size_model_is_a_clear_error():
    w = jnp.ones((3, 2))

    def loss_fn(p, b):
        out = (b[0] @ p).reshape(4, 2)  # assumes 4 examples
        curvax.register_squared_error_loss(out, b[1])
        return _sq_loss(out, b[1])

    batch = (jnp.ones((4, 3)), jnp.zeros((4, 2)))
    est = curvax.ExplicitExactCurvature(loss_fn)
    state = est.init(KEY, (w, batch))
    with pytest.raises(ValueError, match="one example at a time"):
        est.update_curvature_matrix_estimate(state, 0.0, 1.0, 4, KEY, (w, batch))


@pytest.mark.parametrize(
    "name,compute_only_loss_tags",
    _cases(("plain_jax", "haiku", "flax_linen", "haiku_conv"), (True, False), {("haiku", True), ("haiku", False), ("haiku_conv", False)}),
)
def test_auto_register_tags_round_trip(name, compute_only_loss_tags):
    """The tagged function, given to an estimator without auto-registration, has the same curvature."""
    loss_fn, apply, _, params, batch = problem(name, 8)
    tagged = curvax.auto_register_tags(loss_fn, (params, batch), compute_only_loss_tags=compute_only_loss_tags)
    eqns = jax.make_jaxpr(tagged)(params, batch).jaxpr.eqns
    assert any(isinstance(e.primitive, LossTag) for e in eqns)
    # At another batch size the tagged function is traced again: its values are the function's.
    _, _, _, _, small = problem(name, 3)
    want = [apply(params, small[0])] if compute_only_loss_tags else loss_fn(params, small)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12), tagged(params, small), want)
    mats, kinds = [], []
    for f, auto in ((loss_fn, True), (tagged, False)):
        est = curvax.BlockDiagonalCurvature(f, auto_register_tags=auto)
        state = est.init(KEY, (params, batch))
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 8, KEY, (params, batch), estimation_mode="ggn_exact")
        mats.append(np.asarray(est.to_dense_matrix(state)))
        kinds.append([type(b).__name__ for b in est.blocks])
    assert kinds[0] == kinds[1] and "Diagonal" not in str(kinds[1])
    np.testing.assert_allclose(mats[1], mats[0], rtol=1e-12, atol=1e-14)


def test_optimizer_curvature_sub_batch_of_a_haiku_model():
    """``curvature_batch_fraction`` traces the sub-batch anew: its statistics are those of an optimizer
    stepping on that sub-batch (a trace of the whole batch would be wrong by a batch-size factor)."""
    loss_fn, _, _, params, batch = problem("haiku", 8)
    kw = dict(value_and_grad_func=jax.value_and_grad(loss_fn), l2_reg=0.0, estimation_mode="ggn_exact",
              inverse_update_period=1, num_burnin_steps=0)
    sub_opt, full_opt = curvax.Optimizer(curvature_batch_fraction=0.5, **kw), curvax.Optimizer(**kw)
    state = sub_opt.init(params, KEY, batch)
    full_opt.init(params, KEY, batch)
    rng = jax.random.PRNGKey(3)
    sub = curvax.utils.subsample_batch(batch, 0.5, jax.random.fold_in(jax.random.split(rng)[0], 1))
    assert sub[0].shape == (4, IN)
    step = dict(learning_rate=0.1, momentum=0.0, damping=0.1)
    _, got, _ = sub_opt.step(params, state, rng, batch=batch, **step)
    _, want, _ = full_opt.step(params, state, rng, batch=sub, **step)
    for a, b in zip(jax.tree_util.tree_leaves(got.estimator_state), jax.tree_util.tree_leaves(want.estimator_state)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
