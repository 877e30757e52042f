"""Convolutions with an explicit ``precision`` (or ``preferred_element_type``) are supported.

A traced convolution carries its precision as an ``(lhs, rhs)`` pair, which patch
extraction cannot take as is. In float64 every precision computes the same numbers,
so the Kronecker factors must equal those of the same layer without one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import curvax
from curvax.layers import conv

pytestmark = pytest.mark.usefixtures("x64")

KEY = jax.random.PRNGKey(0)
P = lax.Precision
PRECISIONS = [None, P.DEFAULT, P.HIGH, P.HIGHEST, (P.HIGHEST, P.DEFAULT), "highest", lax.DotAlgorithmPreset.F64_F64_F64]
B, HW, CIN, COUT, CLASSES = 3, 5, 2, 3, 3


def _batch() -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(KEY)
    return jax.random.normal(kx, (B, HW, HW, CIN)), jax.random.randint(ky, (B,), 0, CLASSES)


def _haiku(precision: Any) -> tuple[Callable, Any]:
    import haiku as hk

    def fn(x):
        h = jnp.tanh(hk.Conv2D(COUT, 3)(x, precision=precision))
        return hk.Linear(CLASSES)(h.reshape(h.shape[0], -1))

    model = hk.without_apply_rng(hk.transform(fn))
    return model.apply, model.init(KEY, _batch()[0])


def _linen(precision: Any, **conv_kwargs: Any) -> tuple[Callable, Any]:
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Conv(COUT, (3, 3), precision=precision, **conv_kwargs)(x))
            return nn.Dense(CLASSES)(h.reshape(h.shape[0], -1))

    model = CNN()
    return model.apply, model.init(KEY, _batch()[0])


FRAMEWORKS = {"haiku": _haiku, "flax_linen": _linen}


def _loss(apply: Callable) -> Callable:
    def loss(p, b):
        logits = apply(p, b[0])
        curvax.register_softmax_cross_entropy_loss(logits, b[1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b[1][:, None], axis=-1))

    return loss


def _factors(apply: Callable, params: Any) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Per block: its kind and its exact-GGN Kronecker factors (A, G)."""
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), params)
    args = (params, _batch())
    est = curvax.BlockDiagonalCurvature(_loss(apply))
    state = est.init(KEY, args)
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, B, KEY, args, estimation_mode="ggn_exact")
    return [
        (type(b).__name__, np.asarray(s.inputs_factor.value), np.asarray(s.outputs_factor.value))
        for b, s in zip(est.blocks, state.blocks_states)
    ]


@functools.lru_cache(maxsize=None)
def _reference(framework: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    return _factors(*FRAMEWORKS[framework](None))


def _assert_same_factors(got: list, want: list) -> None:
    assert [k for k, _, _ in got] == [k for k, _, _ in want]
    assert got[0][0] == "Conv2DTwoKroneckerFactored"
    for (_, a, g), (_, a0, g0) in zip(got, want):
        np.testing.assert_allclose(a, a0, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(g, g0, rtol=1e-12, atol=1e-14)


# Every precision for Haiku; for Flax (the same traced conv) the pair and HIGHEST by default, the rest slow.
_CASES = [
    pytest.param(f, p, id=f"{f}-{p}", marks=() if f == "haiku" or p in (P.HIGHEST, (P.HIGHEST, P.DEFAULT)) else pytest.mark.slow)
    for f in FRAMEWORKS for p in PRECISIONS[1:]
]


@pytest.mark.parametrize("framework,precision", _CASES)
def test_conv_precision_gives_the_factors_of_the_default(framework, precision):
    apply, params = FRAMEWORKS[framework](precision)
    conv_eqns = [e for e in jax.make_jaxpr(apply)(params, _batch()[0]).jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
    assert conv_eqns and conv_eqns[0].params["precision"] is not None  # the precision reaches the traced conv
    _assert_same_factors(_factors(apply, params), _reference(framework))


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_optimizer_init_and_step_with_a_conv_precision(framework):
    apply, params = FRAMEWORKS[framework]((P.HIGHEST, P.HIGH))
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), params)
    opt = curvax.Optimizer(
        jax.value_and_grad(_loss(apply)), l2_reg=0.0, use_adaptive_learning_rate=True,
        use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1.0,
    )
    state = opt.init(params, KEY, _batch())
    new_params, _, stats = opt.step(params, state, KEY, batch=_batch(), global_step_int=0)
    assert np.isfinite(float(stats["loss"]))
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(params)))


def test_preferred_element_type_gives_the_factors_of_the_default():
    """Flax's ``conv_general_dilated`` hook reaches ``preferred_element_type`` (and a precision)."""
    hook = functools.partial(lax.conv_general_dilated, preferred_element_type=jnp.float64)
    apply, params = _linen(P.HIGHEST, conv_general_dilated=hook)
    _assert_same_factors(_factors(apply, params), _reference("flax_linen"))


@pytest.mark.parametrize("precision", [None, P.HIGHEST, (P.HIGHEST, P.DEFAULT), "highest", lax.DotAlgorithmPreset.F64_F64_F64], ids=str)
def test_patches_moments_take_any_precision(precision):
    x = jax.random.normal(KEY, (2, 5, 5, 2))
    want = conv.patches_moments_explicit(x, (3, 3), padding="SAME")
    for fn in (conv.patches_moments_explicit, conv.patches_moments):
        got = fn(x, (3, 3), padding="SAME", precision=precision)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
