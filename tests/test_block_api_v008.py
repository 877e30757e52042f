"""Both kfac-jax API generations of blocks and estimators, and tag variants choosing blocks.

Blocks written for the documented API (dict data, ``pmap_axis_name``) and for the released
v0.0.8 (``LayerVjpData``, ``identity_weight``) must both be called correctly, whichever
generation the caller uses; a layer registered with ``variant=`` must get the block
registered for that variant. Oracles: the Kronecker factors of a dense layer,
``A = X^T X / B`` and ``G = dY^T dY / B``, computed directly from the layer's data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import blocks, estimators, preconditioner
from dense_blocks import (
    B, CALLS, D_IN, D_OUT, DOC_INPUT_SCALE, KEY, DocBlock, V008Block, dense_problem, layer_data, oracle_factors,
    update_in_generation,
)

pytestmark = pytest.mark.usefixtures("x64")


def _estimate(loss, params, batch, v008_call, **kwargs):
    est = curvax.BlockDiagonalCurvature(loss, **kwargs)
    state = est.init(KEY, (params, batch), None, None, False)
    return est, update_in_generation(est, state, params, batch, v008_call)


@pytest.mark.parametrize("v008_call", [False, True])
def test_builtin_block_either_call_order(v008_call):
    loss, params, batch = dense_problem()
    est, state = _estimate(loss, params, batch, v008_call)
    a, g = oracle_factors(batch)
    (s,) = state.blocks_states
    np.testing.assert_allclose(s.inputs_factor.value, a, rtol=1e-10)
    np.testing.assert_allclose(s.outputs_factor.value, g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("v008_call", [False, True])
def test_v008_style_override_is_called_and_changes_statistics(v008_call):
    loss, params, batch = dense_problem()
    CALLS.clear()
    est, state = _estimate(loss, params, batch, v008_call, layer_tag_to_block_ctor={"dense": V008Block})
    assert isinstance(est.blocks[0], V008Block)
    assert CALLS and all(c[0] == "v008" and c[1] == "LayerVjpData" for c in CALLS)
    # The v0.0.8 estimator call hands its identity_weight through; the documented one has none.
    assert all(float(c[2]) == (0.25 if v008_call else 0.0) for c in CALLS)
    a, g = oracle_factors(batch)
    (s,) = state.blocks_states
    np.testing.assert_allclose(s.inputs_factor.value, a, rtol=1e-10)
    np.testing.assert_allclose(s.outputs_factor.value, 4.0 * g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("v008_call", [False, True])
def test_documented_style_override_is_called_and_changes_statistics(v008_call):
    loss, params, batch = dense_problem()
    CALLS.clear()
    est, state = _estimate(loss, params, batch, v008_call, layer_tag_to_block_ctor={"dense": DocBlock})
    assert CALLS and all(c[0] == "doc" and c[1] == "dict" for c in CALLS)
    a, g = oracle_factors(batch)
    (s,) = state.blocks_states
    np.testing.assert_allclose(s.inputs_factor.value, a * np.outer(DOC_INPUT_SCALE, DOC_INPUT_SCALE), rtol=1e-10)
    np.testing.assert_allclose(s.outputs_factor.value, g, rtol=1e-10, atol=1e-12)


def test_direct_block_calls_in_both_orders_and_formats():
    eqn, data, vjp, a, g = layer_data()
    for cls, g_scale in ((blocks.DenseTwoKroneckerFactored, 1.0), (V008Block, 4.0)):
        block = blocks.construct_block(cls, eqn, "layer")
        s0 = block.init(KEY, None, None, False)
        for call in (
            lambda s: block.update_curvature_matrix_estimate(s, data, 0.0, 1.0, B),  # documented, dict
            lambda s: block.update_curvature_matrix_estimate(s, data, 0.0, 1.0, B, None),  # documented + axis name
            lambda s: block.update_curvature_matrix_estimate(s, vjp, 0.0, 1.0, 0.1, B),  # v0.0.8 positional
            lambda s: block.update_curvature_matrix_estimate(s, vjp, 0.0, 1.0, identity_weight=0.1, batch_size=B),
        ):
            s1 = jax.jit(call)(s0)
            np.testing.assert_allclose(s1.inputs_factor.value, a, rtol=1e-10)
            np.testing.assert_allclose(s1.outputs_factor.value, g_scale * g, rtol=1e-10)


def test_unreadable_calls_and_overrides_raise():
    eqn, data, _, _, _ = layer_data()
    block = blocks.DenseTwoKroneckerFactored(eqn, "layer")
    s0 = block.init(KEY, None, None, False)
    with pytest.raises(TypeError, match="neither kfac-jax signature"):
        block.update_curvature_matrix_estimate(s0, data, 0.0, 1.0, B, "axis", 3)
    with pytest.raises(TypeError, match="neither kfac-jax signature"):
        block.update_curvature_matrix_estimate(s0, data, 0.0, 1.0, identity_weight=0.0, pmap_axis_name=None, batch_size=B)
    # (self, *args) alone is a forwarder (tests/test_generations_forwarding.py); naming an argument
    # of one generation's tail and taking the rest as *args is ambiguous.
    with pytest.raises(TypeError, match="cannot say which kfac-jax generation"):

        class Opaque(blocks.DenseTwoKroneckerFactored):
            def update_curvature_matrix_estimate(self, state, batch_size, *args):
                return state

    loss, params, batch = dense_problem()
    est = curvax.BlockDiagonalCurvature(loss)
    state = est.init(KEY, (params, batch), None, None, False)
    with pytest.raises(TypeError, match="neither kfac-jax signature"):  # func_args where the rng belongs
        est.update_curvature_matrix_estimate(state, 0.0, 1.0, B, (params, batch), KEY)


class V008Ctor(blocks.DenseFull):
    """A v0.0.8-style constructor: the equation only, plus its own option."""

    def __init__(self, layer_tag_eq, scale=1.0):
        super().__init__(layer_tag_eq)
        self.extra_scale = scale


def test_v008_constructor_without_name():
    loss, params, batch = dense_problem()
    est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor={"dense": V008Ctor})
    est.init(KEY, (params, batch), None, None, False)
    (block,) = est.blocks
    assert isinstance(block, V008Ctor) and block.extra_scale == 1.0  # `name` never lands in `scale`
    assert block.name == est.processed_jaxpr.layer_tags[0].name


class VariantBlock(V008Block):
    """The block registered for the variant (G scaled by 4, to tell it from the dense block's)."""


def test_variant_chooses_block_from_table_and_defaults():
    loss, params, batch = dense_problem(variant="my_variant")
    a, g = oracle_factors(batch)
    # layer_tag_to_block_ctor keyed by the variant.
    est, state = _estimate(loss, params, batch, True, layer_tag_to_block_ctor={"my_variant": VariantBlock})
    assert isinstance(est.blocks[0], VariantBlock)
    np.testing.assert_allclose(state.blocks_states[0].inputs_factor.value, a, rtol=1e-10)
    np.testing.assert_allclose(state.blocks_states[0].outputs_factor.value, 4.0 * g, rtol=1e-10, atol=1e-12)
    # The variant's entry wins over the tag's.
    est, _ = _estimate(loss, params, batch, True, layer_tag_to_block_ctor={"dense": blocks.DenseFull, "my_variant": VariantBlock})
    assert isinstance(est.blocks[0], VariantBlock)
    # Without an entry for the variant: the dense tag's block.
    est, state = _estimate(loss, params, batch, True)
    assert type(est.blocks[0]) is blocks.DenseTwoKroneckerFactored
    np.testing.assert_allclose(state.blocks_states[0].outputs_factor.value, g, rtol=1e-10, atol=1e-12)
    # set_default_tag_to_block_ctor with the variant's name.
    assert blocks.find_default_tag_to_block_ctor("my_variant") is None
    try:
        curvax.set_default_tag_to_block_ctor("my_variant", VariantBlock)
        est, _ = _estimate(loss, params, batch, True)
        assert isinstance(est.blocks[0], VariantBlock)
    finally:
        blocks._DEFAULT_TAG_TO_BLOCK_CTOR.pop("my_variant", None)
    # kfac-jax's built-in variant default.
    loss_r, params_r, batch_r = dense_problem(variant="repeated_dense")
    est, _ = _estimate(loss_r, params_r, batch_r, True)
    assert type(est.blocks[0]) is blocks.RepeatedDenseKroneckerFactored


class QmcLikeBlock(blocks.KroneckerFactored):
    """FermiNet's ``QmcBlockedDense`` pattern: a 4-D weight ``(k, m, j, n)``, ``y = einsum(bijk,kmjn->bijmn)``,
    one ``(k x k)`` and one ``(mn x mn)`` factor per ``j``."""

    def input_size(self) -> int:
        raise NotImplementedError()

    def output_size(self) -> int:
        raise NotImplementedError()

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new, identity_weight, batch_size):
        del identity_weight
        [x] = estimation_data.primals.inputs
        [dy] = estimation_data.tangents.outputs
        norm = x.shape[0] * x.shape[1]
        dy = dy.reshape(dy.shape[:-2] + (-1,))
        state.inputs_factor.update(jnp.einsum("bijk,bijl->jkl", x, x) / norm, ema_old, ema_new)
        state.outputs_factor.update(jnp.einsum("bijk,bijl->jkl", dy, dy) / norm, ema_old, ema_new)
        return state

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        k, m, j, n = self.parameters_shapes[0]
        return blocks.KroneckerFactored.State(
            cache={},
            inputs_factor=blocks.WeightedMovingAverage.zeros((j, k, k), self.dtype),
            outputs_factor=blocks.WeightedMovingAverage.zeros((j, m * n, m * n), self.dtype),
        )


def test_4d_weight_variant_gets_its_block():
    bsz, i, j, k, m, n = 3, 2, 4, 3, 2, 2
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
    w = jax.random.normal(k1, (k, m, j, n))
    x = jax.random.normal(k2, (bsz, i, j, k))
    t = jax.random.normal(k3, (bsz, i * j * m * n))

    def loss(p, batch):
        xb, tb = batch
        y = jnp.einsum("bijk,kmjn->bijmn", xb, p)
        y = curvax.register_dense(y, xb, p, variant="qmc", type="full")  # kfac-jax accepts any shapes here
        out = y.reshape(bsz, -1)
        curvax.register_squared_error_loss(out, tb)
        return jnp.mean(jnp.sum((out - tb) ** 2, axis=-1))

    with pytest.raises(ValueError, match="2-D"):  # the plain dense tag still checks its shapes
        jax.make_jaxpr(lambda p: curvax.register_dense(jnp.einsum("bijk,kmjn->bijmn", x, p), x, p))(w)
    est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor={"qmc": QmcLikeBlock})
    state = est.init(KEY, (w, (x, t)), None, None, False)
    assert isinstance(est.blocks[0], QmcLikeBlock)
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 0.0, bsz, KEY, (w, (x, t)), "ggn_exact")
    want_a = jnp.einsum("bijk,bijl->jkl", x, x) / (bsz * i)
    np.testing.assert_allclose(state.blocks_states[0].inputs_factor.value, want_a, rtol=1e-10)
    # ggn_exact with M = 2 I: sum over the 2 * i*j*m*n columns of dy dy^T is 2 I per example and position.
    want_g = 2.0 * jnp.broadcast_to(jnp.eye(m * n), (j, m * n, m * n))
    np.testing.assert_allclose(state.blocks_states[0].outputs_factor.value, want_g, rtol=1e-10, atol=1e-12)


def test_estimator_v008_members():
    assert curvax.CurvatureEstimator[estimators.StateType] is not None
    loss, params, batch = dense_problem()
    est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor={"dense": blocks.DenseFull})
    state = est.init(KEY, (params, batch), None, None, False)
    state = est.update_curvature_matrix_estimate(
        state=state, ema_old=0.0, ema_new=1.0, identity_weight=0.0, batch_size=B, rng=KEY,
        func_args=(params, batch), estimation_mode="ggn_exact",
    )
    synced = jax.jit(lambda s: est.sync(s, pmap_axis_name="i"))(state)  # outside a pmap: unchanged
    for x, y in zip(jax.tree_util.tree_leaves(synced), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(x, y)
    leaves = jax.tree_util.tree_leaves(params)  # ("b", "w")
    assert est.param_order == (0, 1)
    (blk,) = est.to_diagonal_block_dense_matrix(state)
    # The block in canonical (leaf) order, against the exact GGN of the flat (b, w) vector.
    flat = jnp.concatenate([l.ravel() for l in leaves])

    def model(f, xn):
        b, w = f[:D_OUT], f[D_OUT:].reshape(D_IN, D_OUT)
        return xn @ w + b

    jac = jax.vmap(lambda xn: jax.jacobian(model)(flat, xn))(batch[0])
    np.testing.assert_allclose(blk, 2.0 * jnp.einsum("bij,bik->jk", jac, jac) / B, rtol=1e-10, atol=1e-12)
    exact = curvax.ExplicitExactCurvature(loss, param_order=est.param_order)
    st = exact.init(KEY, (params, batch), None, None, False)
    st = exact.update_curvature_matrix_estimate(st, 0.0, 1.0, 0.0, B, KEY, (params, batch), "ggn_exact")
    np.testing.assert_allclose(exact.to_dense_matrix(st), blk, rtol=1e-10, atol=1e-12)


def test_optax_preconditioner_v008():
    loss, params, batch = dense_problem()
    damping = 0.3
    pre = preconditioner.OptaxPreconditioner(
        loss, damping=damping, curvature_ema=0.0, estimation_mode="ggn_exact", inverse_update_period=1,
        layer_tag_to_block_ctor={"dense": blocks.DenseFull}, pmap_axis_name="i",
    )
    state = pre.init((params, batch), KEY)
    state = jax.jit(lambda s: pre.maybe_update(s, (params, batch), KEY))(state)
    (blk,) = pre.estimator.to_diagonal_block_dense_matrix(state.estimator_state)
    v = jax.tree_util.tree_map(lambda p: jnp.ones_like(p), params)
    flat_v = jnp.concatenate([l.ravel() for l in jax.tree_util.tree_leaves(v)])
    out = pre.apply(v, state)
    flat_out = jnp.concatenate([l.ravel() for l in jax.tree_util.tree_leaves(out)])
    np.testing.assert_allclose(flat_out, jnp.linalg.solve(blk + damping * jnp.eye(blk.shape[0]), flat_v), rtol=1e-9)
    back = pre.multiply_curvature(out, state)
    for x, y in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(v)):
        np.testing.assert_allclose(x, y, rtol=1e-9)
    tx = pre.as_gradient_transform()
    upd, _ = tx.update(v, tx.init(params), params, precond_state=state)
    for x, y in zip(jax.tree_util.tree_leaves(upd), jax.tree_util.tree_leaves(out)):
        np.testing.assert_allclose(x, y, rtol=1e-12)
    assert int(pre.increment_count(state).count) == 1
    with pytest.raises(ValueError, match="exactly one of `damping` and `damping_schedule`"):
        preconditioner.OptaxPreconditioner(loss)
