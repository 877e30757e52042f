"""kfac-jax 0.0.8's ``norm_to_scale_identity_weight_per_block``: each block's damping times its norm.

The optimizer's preconditioned gradient is checked block by block against dense float64 oracles,
``solve(F_b + lambda * norm_b * I, g_b)``, with ``norm_b`` computed here with NumPy from the
block's own factors (kfac-jax's definition: the product of the factors' norms).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import linalg

pytestmark = pytest.mark.usefixtures("x64")

DAMPING = 0.3
L2 = 0.05
LR = 0.5


def _loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    out = h @ params["w2"] + params["b2"]
    curvax.register_squared_error_loss(out, y)
    return jnp.mean(jnp.sum((out - y) ** 2, -1))


def _setup():
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    params = {
        "w1": jax.random.normal(k[0], (3, 4)), "b1": 0.1 * jax.random.normal(k[1], (4,)),
        "w2": jax.random.normal(k[2], (4, 2)), "b2": 0.1 * jax.random.normal(k[3], (2,)),
    }
    batch = (jax.random.normal(k[4], (8, 3)), jax.random.normal(k[5], (8, 2)))
    return params, batch


def _step(norm, ctor=None, period=1, exact=True, **kwargs):
    """One fixed-coefficient step (momentum 0): ``(params, state, optimizer, batch, new params)``."""
    params, batch = _setup()
    opt = curvax.Optimizer(
        jax.value_and_grad(_loss), L2, num_burnin_steps=0, estimation_mode="ggn_exact",
        inverse_update_period=period, use_exact_inverses=exact, norm_to_scale_identity_weight_per_block=norm,
        layer_tag_to_block_ctor=None if ctor is None else {"dense": ctor}, **kwargs,
    )
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    new, state, _ = opt.step(params, state, jax.random.PRNGKey(2), batch=batch, learning_rate=LR, momentum=0.0,
                             damping=DAMPING)
    return params, state, opt, batch, new


def _np_norm(m, kind):
    """A norm of the PSD matrix ``m`` (a vector: the diagonal), written out in NumPy."""
    m = np.asarray(m)
    m = np.diag(m) if m.ndim == 1 else m
    n = m.shape[0]
    eig = np.linalg.eigvalsh((m + m.T) / 2)
    return {
        "avg_diag": np.trace(m) / n, "trace": np.trace(m), "fro": np.linalg.norm(m, "fro"),
        "avg_fro": np.linalg.norm(m, "fro") / np.sqrt(n), "2_norm": eig.max(), "1_norm": np.abs(m).sum(0).max(),
        "median_diag": np.median(np.diag(m)), "median_eig": np.median(eig), "one_over_dim": 1.0 / n,
    }[kind]


def _factors(block, bstate):
    """The block's factors as NumPy arrays, as kfac-jax's norm reads them."""
    if hasattr(bstate, "inputs_factor"):
        return [np.asarray(bstate.inputs_factor.value), np.asarray(bstate.outputs_factor.value)]
    if hasattr(bstate, "diagonal_factors"):
        return [np.ravel(f.value) for f in bstate.diagonal_factors]
    return [np.asarray(bstate.matrix.value)]


def _precon_by_block(opt, params, new):
    """``(params - new) / lr`` (the preconditioned gradient, momentum 0) split per block, flat."""
    p = jax.tree_util.tree_map(lambda a, b: (a - b) / LR, params, new)
    return [np.concatenate([np.ravel(x) for x in v]) for v in opt.estimator.params_vector_to_blocks_vectors(p)]


def _grad_by_block(opt, params, batch):
    g = jax.grad(_loss)(params, batch)
    return [np.concatenate([np.ravel(x) for x in v]) for v in opt.estimator.params_vector_to_blocks_vectors(g)]


@pytest.mark.parametrize("kind", ["avg_diag", "fro", "2_norm"])
@pytest.mark.parametrize("ctor", [None, curvax.DenseDiagonal, curvax.DenseFull], ids=["kronecker", "diagonal", "full"])
def test_preconditioned_gradient_is_the_dense_solve_with_the_normed_damping(ctor, kind):
    params, state, opt, batch, new = _step(kind, ctor)
    precon = _precon_by_block(opt, params, new)
    grads = _grad_by_block(opt, params, batch)
    for block, bstate, p, g in zip(opt.estimator.blocks, state.estimator_state.blocks_states, precon, grads):
        dense = np.asarray(block.to_dense_matrix(bstate))
        norm = np.prod([_np_norm(f, kind) for f in _factors(block, bstate)])
        np.testing.assert_allclose(float(block.norm(bstate, kind)), norm, rtol=1e-12)
        want = np.linalg.solve(dense + (DAMPING + L2) * norm * np.eye(len(g)), g)
        np.testing.assert_allclose(p, want, rtol=1e-9, atol=1e-12)
        # The norm matters: the plain damping gives another vector.
        assert not np.allclose(p, np.linalg.solve(dense + (DAMPING + L2) * np.eye(len(g)), g), rtol=1e-4)


def _pi_damped_solve(a, g_factor, w, v_matrix):
    """``((A + pi sqrt(w) I) (x) (G + sqrt(w) / pi I))^-1 vec(V)``, pi from the average traces."""
    pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g_factor) / len(g_factor)))
    a_d = a + pi * np.sqrt(w) * np.eye(len(a))
    g_d = g_factor + np.sqrt(w) / pi * np.eye(len(g_factor))
    return np.linalg.solve(a_d, v_matrix) @ np.linalg.inv(g_d)


@pytest.mark.parametrize("period", [1, 2], ids=["from_statistics", "cached_inverse"])
def test_kronecker_pi_damped_inverse_uses_the_normed_damping(period):
    params, state, opt, batch, new = _step("avg_fro", period=period, exact=False)
    p = jax.tree_util.tree_map(lambda a, b: (a - b) / LR, params, new)
    g = jax.grad(_loss)(params, batch)
    for block, bstate, pv, gv in zip(
        opt.estimator.blocks, state.estimator_state.blocks_states,
        opt.estimator.params_vector_to_blocks_vectors(p), opt.estimator.params_vector_to_blocks_vectors(g),
    ):
        a, gf = (np.asarray(f) for f in _factors(block, bstate))
        w = (DAMPING + L2) * _np_norm(a, "avg_fro") * _np_norm(gf, "avg_fro")
        want = _pi_damped_solve(a, gf, w, np.asarray(block.parameters_shaped_list_to_array(gv)))
        np.testing.assert_allclose(np.asarray(block.parameters_shaped_list_to_array(pv)), want, rtol=1e-9, atol=1e-12)


def test_estimator_and_optax_preconditioner_take_the_argument():
    params, batch = _setup()
    pre = curvax.OptaxPreconditioner(
        _loss, l2_reg=L2, damping=DAMPING, estimation_mode="ggn_exact", inverse_update_period=1,
        use_exact_inverses=True, norm_to_scale_identity_weight_per_block="trace",
    )
    state = pre.init((params, batch), jax.random.PRNGKey(0))
    state = pre.maybe_update(state, (params, batch), jax.random.PRNGKey(1))
    grads = jax.grad(_loss)(params, batch)
    est, est_state = pre.estimator, state.estimator_state
    got = pre.apply(grads, state)
    want = est.multiply_inverse(est_state, grads, DAMPING + L2, True, False,
                                norm_to_scale_identity_weight_per_block="trace")
    plain = est.multiply_inverse(est_state, grads, DAMPING + L2, True, False)
    for block, bstate, gv, pv, qv in zip(est.blocks, est_state.blocks_states, est.params_vector_to_blocks_vectors(grads),
                                         est.params_vector_to_blocks_vectors(got), est.params_vector_to_blocks_vectors(plain)):
        dense = np.asarray(block.to_dense_matrix(bstate))
        norm = np.prod([_np_norm(f, "trace") for f in _factors(block, bstate)])
        g = np.concatenate([np.ravel(x) for x in gv])
        flat = lambda v: np.concatenate([np.ravel(x) for x in v])
        np.testing.assert_allclose(flat(pv), np.linalg.solve(dense + (DAMPING + L2) * norm * np.eye(len(g)), g), rtol=1e-9)
        np.testing.assert_allclose(flat(qv), np.linalg.solve(dense + (DAMPING + L2) * np.eye(len(g)), g), rtol=1e-9)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(a, b)
    # multiply_curvature: (C + w n I) v, the same normed damping.
    back = pre.multiply_curvature(got, state)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)


def test_none_and_a_unit_norm_give_bitwise_the_plain_step():
    _, _, _, _, plain = _step(None)
    _, _, _, _, none = _step("none")
    for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(none)):
        np.testing.assert_array_equal(a, b)
    # A scaled identity of scale 1 has every norm but "one_over_dim" and the sums equal to 1:
    # multiplying the damping by exactly 1 changes no bit.
    _, _, _, _, ident = _step(None, curvax.ScaledIdentity)
    for kind in ("avg_diag", "2_norm", "1_norm", "median_eig", "avg_fro"):
        _, _, _, _, normed = _step(kind, curvax.ScaledIdentity)
        for a, b in zip(jax.tree_util.tree_leaves(ident), jax.tree_util.tree_leaves(normed)):
            np.testing.assert_array_equal(a, b)
    _, _, _, _, traced = _step("trace", curvax.ScaledIdentity)  # trace = dim: another step
    assert not np.allclose(traced["w1"], ident["w1"])


def test_the_option_off_adds_nothing_to_the_compiled_product():
    params, batch = _setup()
    est = curvax.BlockDiagonalCurvature(_loss)
    est_state = est.init(jax.random.PRNGKey(0), (params, batch), None, None, False)
    text = lambda **kw: jax.jit(lambda s, v: est.multiply_inverse(s, v, 0.1, False, False, **kw)).lower(est_state, params).as_text()
    assert text() == text(norm_to_scale_identity_weight_per_block=None)
    assert text() == text(norm_to_scale_identity_weight_per_block="none")
    assert text() != text(norm_to_scale_identity_weight_per_block="avg_diag")


@pytest.mark.parametrize("adaptive", ["use_adaptive_learning_rate", "use_adaptive_momentum", "use_adaptive_damping"])
def test_refused_with_adaptive_coefficients(adaptive):
    extra = {"initial_damping": 1.0} if adaptive == "use_adaptive_damping" else {}
    with pytest.raises(ValueError, match=f"norm_to_scale_identity_weight_per_block.*{adaptive}"):
        curvax.Optimizer(jax.value_and_grad(_loss), 0.0, norm_to_scale_identity_weight_per_block="avg_diag",
                         **{adaptive: True}, **extra)
    curvax.Optimizer(jax.value_and_grad(_loss), 0.0, norm_to_scale_identity_weight_per_block="none", **{adaptive: True},
                     **extra)


def test_unknown_norm_names_are_refused_by_name():
    with pytest.raises(ValueError, match="norm_to_scale_identity_weight_per_block.*'spectral'"):
        curvax.Optimizer(jax.value_and_grad(_loss), 0.0, norm_to_scale_identity_weight_per_block="spectral")
    with pytest.raises(ValueError, match="norm_to_scale_identity_weight_per_block"):
        curvax.OptaxPreconditioner(_loss, damping=1.0, norm_to_scale_identity_weight_per_block=2)
    params, batch = _setup()
    est = curvax.BlockDiagonalCurvature(_loss)
    est_state = est.init(jax.random.PRNGKey(0), (params, batch), None, None, False)
    with pytest.raises(ValueError, match="norm_to_scale_identity_weight_per_block"):
        est.multiply_matpower(est_state, params, 0.1, -1, True, False, norm_to_scale_identity_weight_per_block="avg")
    with pytest.raises(ValueError, match="norm_type"):
        est.blocks[0].norm(est_state.blocks_states[0], "frobenius")


@pytest.mark.parametrize("kind", linalg.NORM_TYPES)
def test_psd_matrix_norm_matches_numpy_for_matrices_diagonals_and_scalars(kind):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 7))
    m = x @ x.T / 7
    d = rng.uniform(0.1, 2.0, size=6)
    for value in (m, d, np.array(1.7)):
        want = _np_norm(np.atleast_1d(value), kind)
        np.testing.assert_allclose(float(curvax.utils.psd_matrix_norm(jnp.asarray(value), kind)), want, rtol=1e-12)
    # Block-diagonal factors are normed without forming them.
    blocks = [jnp.asarray(np.stack([m, 2 * m])), jnp.asarray(d[:, None, None])]
    dense = jax.scipy.linalg.block_diag(m, 2 * m, np.diag(d))
    np.testing.assert_allclose(float(linalg.block_diagonal_psd_norm(blocks, kind)), _np_norm(dense, kind), rtol=1e-12)


def test_psd_matrix_norm_keeps_the_old_spellings_and_refuses_others():
    m = jnp.asarray([[2.0, 1.0], [1.0, 3.0]])
    assert float(curvax.utils.psd_matrix_norm(m, "2norm")) == float(curvax.utils.psd_matrix_norm(m, "2_norm"))
    assert float(curvax.utils.psd_matrix_norm(m, "1norm")) == float(curvax.utils.psd_matrix_norm(m, "1_norm")) == 4.0
    with pytest.raises(ValueError, match="norm_type"):
        curvax.utils.psd_matrix_norm(m, "nuclear")
    with pytest.raises(ValueError, match="matrix"):
        curvax.utils.psd_matrix_norm(jnp.ones((2, 3)), "avg_diag")


# --- every block class: kfac-jax's norm against the block's dense matrix -------------------------

# The norms for which the product of the factors' norms is the norm of their Kronecker product.
MULTIPLICATIVE = ("avg_diag", "trace", "fro", "avg_fro", "1_norm", "2_norm", "one_over_dim")


def _dense_norm_oracle(block, bstate, kind):
    """A diagonal block's norm is the product of its parameters' diagonals' norms (kfac-jax's
    definition); any other block's is the norm of its dense matrix (for ``MULTIPLICATIVE`` norms).
    Both times the block's scale, as kfac-jax's ``norm`` (``"one_over_dim"`` reads no values)."""
    scale = float(block.scale(bstate, False))
    dense = np.asarray(block.to_dense_matrix(bstate)) / scale
    if isinstance(block, curvax.blocks.Diagonal):
        pieces = np.split(np.diag(dense), np.cumsum(block.parameters_sizes)[:-1])
        return scale * np.prod([_np_norm(p, kind) for p in pieces])
    return scale * _np_norm(dense, kind)


def _check_block_norms(loss, params, batch, ctors=None, **est_kwargs):
    est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor=ctors, **est_kwargs)
    state = est.init(jax.random.PRNGKey(1), (params, batch), None, None)
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, batch[0].shape[0], jax.random.PRNGKey(2),
                                                 (params, batch), estimation_mode="fisher_exact")
    state = est.update_cache(state, 0.1, None, None, False)  # EKFAC's eigenbasis
    seen = set()
    for block, bstate in zip(est.blocks, state.blocks_states):
        for kind in MULTIPLICATIVE:
            got = np.asarray(block.norm(bstate, kind))
            if isinstance(block, curvax.stacked.StackedBlock):  # one norm per slice, each its own block
                want = [_dense_norm_oracle(block.inner, jax.tree_util.tree_map(lambda x: x[i], bstate), kind)
                        for i in range(block.length)]
                seen.add(type(block.inner).__name__)
            else:
                want = _dense_norm_oracle(block, bstate, kind)
            np.testing.assert_allclose(got, want, rtol=1e-10, err_msg=f"{type(block).__name__} {kind}")
        seen.add(type(block).__name__)
    return seen


def _transformer():
    from models import transformer_params, transformer_scan, xent_loss

    params = transformer_params(jax.random.PRNGKey(0), layers=2, width=4, hidden=5, vocab=6)
    ids = jax.random.randint(jax.random.PRNGKey(1), (3, 4), 0, 6)
    return xent_loss(transformer_scan), params, (ids, jnp.roll(ids, -1, axis=1))


def test_norms_of_the_transformer_blocks_embedding_stacked_scale_and_shift():
    seen = _check_block_norms(*_transformer())
    assert {"EmbeddingKroneckerFactored", "StackedBlock", "ScaleAndShiftDiagonal", "RepeatedDenseKroneckerFactored"} <= seen


@pytest.mark.parametrize("ctor", [
    curvax.DenseEigenvalueCorrected, curvax.DenseTNT, curvax.DenseFull, curvax.DenseDiagonal,
    curvax.RepeatedDenseKroneckerFactored, curvax.ScaledIdentity,
    functools.partial(curvax.DensePartitionedKroneckerFactored, inputs_block_size=2, outputs_block_size=3),
], ids=lambda c: getattr(c, "__name__", None) or c.func.__name__)
def test_norms_of_the_other_dense_blocks(ctor):
    loss, params, batch = _transformer()
    assert _check_block_norms(loss, params, batch, {"dense": ctor})


def _conv_loss(groups):
    def loss(p, batch):
        x, y = batch
        h = jax.lax.conv_general_dilated(x, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                         feature_group_count=groups) + p["b"]
        out = jnp.tanh(h).reshape(x.shape[0], -1) @ p["d"]
        curvax.register_squared_error_loss(out, y)
        return jnp.mean(jnp.sum((out - y) ** 2, -1))

    return loss


@pytest.mark.parametrize("groups", [1, 2])
def test_norms_of_the_conv_blocks(groups):
    k = jax.random.split(jax.random.PRNGKey(3), 5)
    params = {"w": jax.random.normal(k[0], (3, 3, 4 // groups, 4)) / 3, "b": 0.1 * jax.random.normal(k[1], (4,)),
              "d": jax.random.normal(k[2], (4 * 4 * 4, 2)) / 8}
    batch = (jax.random.normal(k[3], (3, 4, 4, 4)), jax.random.normal(k[4], (3, 2)))
    seen = _check_block_norms(_conv_loss(groups), params, batch)
    assert ("ConvGroupedTwoKroneckerFactored" if groups == 2 else "Conv2DTwoKroneckerFactored") in seen
    if groups == 1:
        for ctor in (curvax.Conv2DDiagonal, curvax.Conv2DFull):
            assert _check_block_norms(_conv_loss(1), params, batch, {"conv2d": ctor})


@pytest.mark.parametrize("use_cached", [False, True])
def test_stacked_layers_get_each_slice_its_own_normed_damping(use_cached):
    loss, params, batch = _transformer()
    est = curvax.BlockDiagonalCurvature(loss)
    state = est.init(jax.random.PRNGKey(1), (params, batch), -1, None)
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, batch[0].shape[0], jax.random.PRNGKey(2),
                                                 (params, batch), estimation_mode="fisher_exact")
    kw = {"norm_to_scale_identity_weight_per_block": "avg_diag"}
    state = est.update_cache(state, 0.2, -1, None, False, **kw)
    vec = jax.tree_util.tree_map(lambda p: jax.random.normal(jax.random.PRNGKey(5), p.shape), params)
    out = est.multiply_inverse(state, vec, 0.2, True, use_cached, **kw)
    stacked = 0
    for block, bstate, v, o in zip(est.blocks, state.blocks_states, est.params_vector_to_blocks_vectors(vec),
                                   est.params_vector_to_blocks_vectors(out)):
        if isinstance(block, curvax.stacked.StackedBlock):
            stacked += 1
            pieces = [(block.inner, jax.tree_util.tree_map(lambda x: x[i], bstate), [x[i] for x in v], [x[i] for x in o])
                      for i in range(block.length)]
        else:
            pieces = [(block, bstate, v, o)]
        for b, s, vi, oi in pieces:
            dense = np.asarray(b.to_dense_matrix(s))
            flat = lambda t: np.concatenate([np.ravel(x) for x in t])
            want = np.linalg.solve(dense + 0.2 * _dense_norm_oracle(b, s, "avg_diag") * np.eye(len(dense)), flat(vi))
            np.testing.assert_allclose(flat(oi), want, rtol=1e-9, atol=1e-12)
    assert stacked
