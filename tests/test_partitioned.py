"""Partitioned (block-diagonal) and diagonal Kronecker factors for huge layers, against dense oracles.

``DensePartitionedKroneckerFactored`` keeps the diagonal blocks of ``DenseTwoKroneckerFactored``'s
factors; every product is checked against dense float64 matrices built from the plain block's
factors masked to those blocks. The factor budget of the estimator and the optimizer chooses it
exactly for layers whose factor exceeds the budget, and the registration table says why.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import blocks, estimators, partitioned
from curvax import operators as ops
from curvax.partitioned import DensePartitionedKroneckerFactored, FactorLayout
from test_blocks import dense_data, dense_eqn, flat, random_vector, to_v, updated_state

LAM = 0.3


def _mask(side: int, block: int) -> np.ndarray:
    """1 on the diagonal blocks of ``FactorLayout(side, block)``, 0 elsewhere (built from its groups)."""
    m = np.zeros((side, side))
    for start, count, size in FactorLayout(side, block).groups:
        for k in range(count):
            lo = start + k * size
            m[lo : lo + size, lo : lo + size] = 1
    return m


def _factors(state) -> tuple[np.ndarray, np.ndarray]:
    """The plain block's symmetrized factors."""
    a, g = (np.asarray(f.value) for f in (state.inputs_factor, state.outputs_factor))
    return (a + a.T) / 2, (g + g.T) / 2


def _vec_to_params(block, vec_v: np.ndarray, layout: str, bias: bool) -> np.ndarray:
    """A vector over ``vec(V)`` (V = [W_io; b]) in the block's flat parameter order."""
    v = vec_v.reshape(block.input_size(), block.output_size())
    w = v[:-1] if bias else v
    parts = [w if layout == "io" else w.T] + ([v[-1]] if bias else [])
    return np.concatenate([np.ravel(p) for p in parts])


# ----------------------------------------------------------------------------------
# Layouts and the budget rule (no arrays)
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("side,block", [(50257, 1323), (10, 3), (7, 7), (7, 100), (9, 1), (8193, 8191)])
def test_layout_covers_the_factor_with_bounded_nearly_equal_blocks(side, block):
    layout = FactorLayout(side, block)
    sizes = [b for _, c, b in layout.groups for _ in range(c)]
    assert sum(sizes) == side and max(sizes) <= min(block, side) and max(sizes) - min(sizes) <= 1
    assert layout.num_blocks == -(-side // min(block, side)) and len(layout.groups) <= 2
    starts = [s for s, _, _ in layout.groups]
    assert starts[0] == 0 and all(s == p + c * b for s, (p, c, b) in zip(starts[1:], layout.groups))
    assert layout.is_whole == (block >= side) and layout.is_diagonal == (block == 1)


def test_language_model_head_under_the_default_budget():
    # 768 -> 50257 with a bias, float32: A is 769 x 769 (2.3 MB, whole), G 50257 x 50257 (9.4 GiB).
    eqn = tags_eqn(768, 50257, jnp.float32)
    block = DensePartitionedKroneckerFactored(eqn, "head")
    assert block.inputs_layout.is_whole and block.inputs_layout.side == 769
    lg = block.outputs_layout
    assert (lg.num_blocks, lg.largest) == (38, 1323) and lg.nbytes(4) <= curvax.DEFAULT_FACTOR_BUDGET
    assert block.budget_note == (
        "outputs factor 50257\u00b2 x 4 B = 9.41 GiB > budget 256 MiB: partitioned into 38 blocks of <= 1323 "
        "(254 MiB; the largest blocks within the budget)"
    )
    # The automatic choice replaces only the default block, and only when a factor is over budget.
    ctor = partitioned.ctor_within_budget(blocks.DenseTwoKroneckerFactored, eqn, "head", curvax.DEFAULT_FACTOR_BUDGET, "partition")
    assert isinstance(blocks.construct_block(ctor, eqn, "head"), DensePartitionedKroneckerFactored)
    small = tags_eqn(768, 8192, jnp.float32)  # 8192^2 x 4 B = 256 MiB fits exactly
    assert partitioned.ctor_within_budget(blocks.DenseTwoKroneckerFactored, small, "l", curvax.DEFAULT_FACTOR_BUDGET, "partition") is blocks.DenseTwoKroneckerFactored
    assert partitioned.ctor_within_budget(blocks.DenseTwoKroneckerFactored, eqn, "head", None, "partition") is blocks.DenseTwoKroneckerFactored
    # Diagonal on request; and when not even blocks of side 2 fit.
    diag = DensePartitionedKroneckerFactored(eqn, "head", oversized_factor="diagonal")
    assert diag.outputs_layout.is_diagonal and diag.budget_note.endswith("diagonal (196 KiB; oversized_factor='diagonal')")
    budget = 50257 * 4 + 1  # G: not even blocks of side 2 fit; A (769^2 x 4 B) over it too: blocks of <= 65
    tiny = DensePartitionedKroneckerFactored(eqn, "head", factor_budget=budget)
    assert tiny.outputs_layout.is_diagonal and tiny.inputs_layout.largest <= 65 < 2 * tiny.inputs_layout.largest
    assert tiny.inputs_layout.nbytes(4) <= budget and tiny.outputs_layout.nbytes(4) <= budget
    assert "outputs factor 50257\u00b2 x 4 B = 9.41 GiB > budget 196 KiB: diagonal (196 KiB; not even blocks of side 2 fit the budget)" in tiny.budget_note


def test_partition_caps_the_block_side_where_the_budget_allows_larger_blocks():
    # 768 -> 16384, float32: G is 1 GiB; 256 MiB would allow blocks of 4096, the cap keeps them <= 2048,
    # so the refresh (sum of block sides cubed) is 4x smaller and still linear in the side.
    eqn = tags_eqn(768, 16384, jnp.float32)
    block = DensePartitionedKroneckerFactored(eqn, "wide")
    lg = block.outputs_layout
    assert (lg.num_blocks, lg.largest) == (8, partitioned.MAX_BLOCK_SIDE) == (8, 2048)
    assert block.budget_note == (
        "outputs factor 16384\u00b2 x 4 B = 1 GiB > budget 256 MiB: partitioned into 8 blocks of <= 2048 "
        "(128 MiB; block side capped at MAX_BLOCK_SIDE=2048 to bound the refresh)"
    )
    # Exactly at the cap the budget still decides: 2048 x side x 4 B fits a budget of that size.
    assert partitioned.plan_factor(16384, 4, 2048 * 16384 * 4, "partition")[0] == 2048
    assert partitioned.plan_factor(16384, 4, 2047 * 16384 * 4 + 3, "partition")[0] == 2047
    # An explicit block side is taken as given, above the cap too.
    assert partitioned.plan_factor(16384, 4, 2**28, 4096) == (
        4096, "16384\u00b2 x 4 B = 1 GiB > budget 256 MiB: partitioned into 4 blocks of <= 4096 (256 MiB; oversized_factor=4096)"
    )


def test_state_and_every_intermediate_scale_with_the_partition():
    # Trace (no computation) the statistics update, the cache refresh and the products of the
    # 768 -> 50257 head: no array anywhere comes near the 9.4 GiB factor. The largest are a
    # group of blocks (<= the budget) and its float64 copy in the retry branch that runs only
    # when a float32 eigh/Cholesky fails (twice that); the state holds 254 MiB for G.
    eqn = tags_eqn(768, 50257, jnp.float32, batch=8)
    block = DensePartitionedKroneckerFactored(eqn, "head")
    data = {"inputs": (jnp.zeros((8, 768)),), "outputs_tangent": (jnp.zeros((8, 50257)),)}
    vec = tuple(jnp.zeros(s) for s in block.parameters_shapes)

    def run(rng):
        state = block.init(rng, [-1], -1, True)
        state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, 8)
        state = block.update_cache(state, LAM, [-1], -1, True)
        return state, block.multiply_inverse(state, vec, LAM, False, True), block.multiply_inverse(state, vec, LAM, True, True)

    jaxpr = jax.make_jaxpr(run)(jax.random.PRNGKey(0))
    sizes = [int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in _all_vars(jaxpr.jaxpr)]
    assert max(sizes) <= 2 * curvax.DEFAULT_FACTOR_BUDGET < 50257**2 * 4 / 15
    state_shapes = jax.eval_shape(run, jax.random.PRNGKey(0))[0]
    g_bytes = sum(x.value.size * 4 for x in state_shapes.outputs_factor)
    assert g_bytes == block.outputs_layout.nbytes(4) < 50257**2 * 4 / 30


def _lapack_calls(num_blocks_side: int) -> list[tuple[str, tuple[int, ...]]]:
    """(target, matrix shape) of every LAPACK custom call in the compiled CPU refresh (exact
    eigenvectors, eigenvalues and the approximate inverse) of a 5 -> 198 layer whose ``G`` is in
    blocks of side <= ``num_blocks_side``."""
    block = DensePartitionedKroneckerFactored(tags_eqn(5, 198, jnp.float32), "l", outputs_block_size=num_blocks_side)

    def refresh(rng):
        return block.update_cache(block.init(rng, [-1], [-1], True), LAM, [-1], [-1], True)

    text = jax.jit(refresh).lower(jax.random.PRNGKey(0)).compile().as_text()
    calls = []
    for line in text.splitlines():
        target = re.search(r'custom_call_target="(lapack_\w+)"', line)
        if target:
            shape = re.search(r"= \(?[a-z]+\d+\[([\d,]*)\]", line).group(1)
            calls.append((target.group(1), tuple(int(d) for d in shape.split(","))))
    return calls


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU program's LAPACK calls")
def test_refresh_program_does_not_grow_with_the_blocks_and_never_batches_lapack_on_cpu():
    # G of side 198 in 4 blocks (2 of 50, 2 of 49) or 16 (6 of 13, 10 of 12): two groups either way.
    four, sixteen = FactorLayout(198, 50), FactorLayout(198, 13)
    assert (four.num_blocks, len(four.groups), sixteen.num_blocks, len(sixteen.groups)) == (4, 2, 16, 2)
    calls4, calls16 = _lapack_calls(50), _lapack_calls(13)
    targets = lambda calls: sorted(t for t, _ in calls)
    # The same calls, one per group and kind (plus the whole A's), whatever the number of blocks ...
    assert targets(calls4) == targets(calls16)
    assert sum("potrf" in t for t in targets(calls16)) == 3 and sum("syevd" in t for t in targets(calls16)) >= 3
    # ... and each on one matrix: jaxlib 0.10 spreads a batched LAPACK call over the intra-op pool
    # and waits for it, and two at once deadlocked a 768 -> 50257 head's refresh on 2 cores.
    assert {shape for _, shape in calls16 if shape[0] != 6} == {(13, 13), (12, 12)}
    assert all(len(shape) == 2 for _, shape in calls4 + calls16)


def _all_vars(jaxpr):
    """Every variable a jaxpr and its sub-jaxprs (jit, cond branches ...) define."""
    for eqn in jaxpr.eqns:
        yield from eqn.outvars
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_vars(sub)


def tags_eqn(d_in, d_out, dtype, batch=4):
    params = (jax.ShapeDtypeStruct((d_in, d_out), dtype), jax.ShapeDtypeStruct((d_out,), dtype))
    return curvax.LayerTagEqn(
        primitive=curvax.tags.dense, outputs=(jax.ShapeDtypeStruct((batch, d_out), dtype),),
        inputs=(jax.ShapeDtypeStruct((batch, d_in), dtype),), params=params, param_indices=(0, 1),
        meta={"kernel_layout": "io"}, name="head",
    )


# ----------------------------------------------------------------------------------
# Dense oracles (float64)
# ----------------------------------------------------------------------------------

CASES = [  # layout, bias, extra axes, inputs block, outputs block
    ("io", True, (), 4, 3),
    ("oi", False, (), 2, 1),
    ("io", False, (3,), 1, 4),
    ("oi", True, (2,), 3, 7),
]


def _pair(layout, bias, extra, bi, bo, d_in=5, d_out=7, batch=6):
    eqn = dense_eqn(d_in, d_out, batch=batch, extra=extra, bias=bias, layout=layout)
    datas = [dense_data(s, d_in, d_out, bias, layout, batch, extra)[0] for s in (11, 12)]
    plain = blocks.DenseTwoKroneckerFactored(eqn, "l")
    part = DensePartitionedKroneckerFactored(eqn, "l", inputs_block_size=bi, outputs_block_size=bo)
    return plain, part, datas, batch


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("layout,bias,extra,bi,bo", CASES)
def test_factors_are_the_diagonal_blocks_of_the_plain_factors(layout, bias, extra, bi, bo):
    plain, part, datas, batch = _pair(layout, bias, extra, bi, bo)

    @jax.jit
    def run(datas):
        sp, sq = updated_state(plain, datas, batch), updated_state(part, datas, batch)
        return sp, [partitioned._to_dense(tuple(f.value for f in fs)) for fs in (sq.inputs_factor, sq.outputs_factor)], part.to_dense_matrix(sq)

    sp, (got_a, got_g), dense = run(datas)
    a, g = _factors(sp)
    np.testing.assert_allclose(got_a, a * _mask(len(a), bi), atol=1e-13)
    np.testing.assert_allclose(got_g, g * _mask(len(g), bo), atol=1e-13)
    # The dense matrix is (blockdiag A) (x) (blockdiag G), acting on the parameters.
    dense = np.asarray(dense)
    v = random_vector(part)
    want = (a * _mask(len(a), bi)) @ np.asarray(to_v(v, layout, bias)) @ (g * _mask(len(g), bo))
    np.testing.assert_allclose(dense @ np.asarray(flat(v)), _vec_to_params(part, want.ravel(), layout, bias), atol=1e-12)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("layout,bias,extra,bi,bo", CASES)
def test_products_match_the_dense_block_diagonal_kronecker_product(layout, bias, extra, bi, bo):
    plain, part, datas, batch = _pair(layout, bias, extra, bi, bo)
    a, g = _factors(jax.jit(lambda d: updated_state(plain, d, batch))(datas))
    a_b, g_b = a * _mask(len(a), bi), g * _mask(len(g), bo)
    perm = lambda m: np.stack([_vec_to_params(part, c, layout, bias) for c in np.stack([_vec_to_params(part, r, layout, bias) for r in m]).T])
    dense = perm(np.kron(a_b, g_b))  # rows and columns in parameter order
    eye = np.eye(len(dense))
    v = random_vector(part)
    fv = np.asarray(flat(v))


    @jax.jit  # one compilation for every product below
    def run(datas):
        state = updated_state(part, datas, batch, dict(exact_powers_to_cache=[-1, -0.5], approx_powers_to_cache=-1, cache_eigenvalues=True))
        cached = part.update_cache(state, LAM, [-1, -0.5], -1, True)
        return {
            "exact": [part.multiply_matpower(state, v, LAM, p, True, False) for p in (1, -1, -0.5)],
            "cached_exact": [part.multiply_matpower(cached, v, LAM, p, True, True) for p in (-1, -0.5)],
            "approx_inv": [part.multiply_inverse(state, v, LAM, False, False), part.multiply_inverse(cached, v, 100.0, False, True)],
            "approx_mul": part.multiply(state, v, LAM, False, False),
            "approx_half": part.multiply_matpower(state, v, LAM, -0.5, False, False),
            "eigenvalues": [part.eigenvalues(state, False), part.eigenvalues(cached, True)],
            "inverse_diagonal": part.inverse_diagonal(state, LAM),
        }

    out = run(datas)
    s, q = np.linalg.eigh(dense + LAM * eye)
    for p, got in zip((1, -1, -0.5), out["exact"]):
        np.testing.assert_allclose(flat(got), (q * s**p) @ q.T @ fv, rtol=1e-9, atol=1e-12)
    for p, got in zip((-1, -0.5), out["cached_exact"]):
        np.testing.assert_allclose(flat(got), (q * s**p) @ q.T @ fv, rtol=1e-9, atol=1e-12)
    # The approximate inverse: pi-adjusted damping of the block-diagonal factors, as the plain
    # block's (pi from their traces, which the block diagonals share with the whole factors).
    pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
    a_d = a_b + pi * np.sqrt(LAM) * np.eye(len(a))
    g_d = g_b + np.sqrt(LAM) / pi * np.eye(len(g))
    vv = np.asarray(to_v(v, layout, bias)).ravel()
    want_inv = np.linalg.solve(np.kron(a_d, g_d), vv)
    for got in out["approx_inv"]:  # the cache keeps the damping it was built with
        np.testing.assert_allclose(np.asarray(to_v(got, layout, bias)).ravel(), want_inv, rtol=1e-9)
    np.testing.assert_allclose(np.asarray(to_v(out["approx_mul"], layout, bias)).ravel(), np.kron(a_d, g_d) @ vv, rtol=1e-9)
    sd, qd = np.linalg.eigh(np.kron(a_d, g_d))
    np.testing.assert_allclose(np.asarray(to_v(out["approx_half"], layout, bias)).ravel(), (qd * sd**-0.5) @ qd.T @ vv, rtol=1e-9)
    # Eigenvalues and the diagonal of the inverse.
    for got in out["eigenvalues"]:
        np.testing.assert_allclose(np.sort(got), np.linalg.eigvalsh(dense), atol=1e-12)
    np.testing.assert_allclose(flat(out["inverse_diagonal"]), np.diag(np.linalg.inv(dense + LAM * eye)), rtol=1e-9)


@pytest.mark.usefixtures("x64")
def test_forward_only_mode_makes_the_partitioned_outputs_factor_the_identity():
    plain, part, datas, batch = _pair("io", True, (), 4, 3)
    state = jax.jit(lambda d: updated_state(part, d, batch))(datas)
    foof = estimators._forward_only_state(part, state)  # what estimation_mode="forward_only" applies
    np.testing.assert_array_equal(partitioned._to_dense(tuple(f.value for f in foof.outputs_factor)), np.eye(7))
    for new, old in zip(foof.inputs_factor, state.inputs_factor):
        np.testing.assert_array_equal(new.value, old.value)


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("layout,bias,extra", [("io", True, ()), ("oi", False, (3,))])
def test_one_partition_equals_the_plain_block(layout, bias, extra):
    plain, part, datas, batch = _pair(layout, bias, extra, 10**6, 10**6)
    assert part.is_plain and part.budget_note is None
    kw = dict(exact_powers_to_cache=[-1, -0.5], approx_powers_to_cache=-1, cache_eigenvalues=True)
    v = random_vector(part)
    products = [(p, exact, cached) for p, exact in [(1, True), (-1, True), (-0.5, True), (1, False), (-1, False), (-0.5, False)]
                for cached in (False, True) if not cached or (exact and p != 1) or (not exact and p == -1)]

    def run(block, datas):
        state = updated_state(block, datas, batch, kw)
        cached = block.update_cache(state, LAM, [-1, -0.5], -1, True)
        return {
            "factors": (state.inputs_factor, state.outputs_factor), "dense": block.to_dense_matrix(state),
            "products": [block.multiply_matpower(cached if c else state, v, LAM, p, e, c) for p, e, c in products],
            "eigenvalues": jnp.sort(block.eigenvalues(cached, True)), "inverse_diagonal": block.inverse_diagonal(state, LAM),
        }

    got, want = jax.jit(run, static_argnums=0)(part, datas), jax.jit(run, static_argnums=0)(plain, datas)
    np.testing.assert_allclose(got["factors"][0][0].value[0], want["factors"][0].value, atol=1e-12)
    np.testing.assert_allclose(got["factors"][1][0].value[0], want["factors"][1].value, atol=1e-12)
    np.testing.assert_allclose(got["dense"], want["dense"], atol=1e-12)
    for x, y in zip(got["products"], want["products"]):
        np.testing.assert_allclose(flat(x), flat(y), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got["eigenvalues"], want["eigenvalues"], atol=1e-12)
    np.testing.assert_allclose(flat(got["inverse_diagonal"]), flat(want["inverse_diagonal"]), rtol=1e-12)


def test_bad_options_raise_clear_errors():
    eqn = dense_eqn(3, 4)
    for bad, err in [(0, ValueError), (-5, ValueError), (1.5, TypeError), (True, TypeError), ("1GB", TypeError)]:
        with pytest.raises(err, match="factor_budget"):
            DensePartitionedKroneckerFactored(eqn, "l", factor_budget=bad)
        with pytest.raises(err, match="factor_budget"):
            estimators.BlockDiagonalCurvature(lambda p, b: 0.0, factor_budget=bad)
        with pytest.raises(err, match="factor_budget"):
            curvax.Optimizer(lambda p, b: (0.0, p), l2_reg=0.0, factor_budget=bad)
    for bad in ("blocks", 0, -2, True, 2.0):
        with pytest.raises(ValueError, match="oversized_factor"):
            estimators.BlockDiagonalCurvature(lambda p, b: 0.0, oversized_factor=bad)
        with pytest.raises(ValueError, match="oversized_factor"):
            curvax.Optimizer(lambda p, b: (0.0, p), l2_reg=0.0, oversized_factor=bad)
    with pytest.raises(ValueError, match="inputs_block_size"):
        DensePartitionedKroneckerFactored(eqn, "l", inputs_block_size=0)
    with pytest.raises(ValueError, match="outputs_block_size"):
        DensePartitionedKroneckerFactored(eqn, "l", outputs_block_size=2.5)
    block = DensePartitionedKroneckerFactored(eqn, "l", outputs_block_size=2)
    with pytest.raises(NotImplementedError, match="power -1"):
        block.init(jax.random.PRNGKey(0), None, -0.5, False)


# ----------------------------------------------------------------------------------
# The budget in the estimator, the optimizer and the operators
# ----------------------------------------------------------------------------------

D_IN, HID, D_OUT, BATCH = 6, 10, 30, 8


def _mlp(key=jax.random.PRNGKey(0)):
    k = jax.random.split(key, 4)
    params = {"l0": {"w": jax.random.normal(k[0], (D_IN, HID)) / 2, "b": jnp.zeros(HID)},
              "l1": {"w": jax.random.normal(k[1], (HID, D_OUT)) / 3, "b": jnp.zeros(D_OUT)}}
    batch = (jax.random.normal(k[2], (BATCH, D_IN)), jax.random.randint(k[3], (BATCH,), 0, D_OUT))

    def loss(p, b):
        logits = jnp.tanh(b[0] @ p["l0"]["w"] + p["l0"]["b"]) @ p["l1"]["w"] + p["l1"]["b"]
        curvax.register_softmax_cross_entropy_loss(logits, b[1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b[1][:, None], axis=1))

    return loss, params, batch


@pytest.mark.parametrize("budget", [None, 30 * 30 * 4, 30 * 30 * 4 - 1, 10 * 10 * 4 - 1])
def test_budget_chooses_the_partitioned_block_exactly_when_a_factor_exceeds_it(budget):
    # float32 factors: layer 0 has A 7x7 (196 B), G 10x10 (400 B); layer 1 A 11x11 (484 B), G 30x30 (3600 B).
    loss, params, batch = _mlp()
    est = estimators.BlockDiagonalCurvature(loss, factor_budget=budget)
    est.finalize((params, batch))
    sides = [(7, 10), (11, 30)]
    for block, note, (sa, sg) in zip(est.blocks, est.block_notes, sides):
        over = budget is not None and max(sa, sg) ** 2 * 4 > budget
        assert isinstance(block, DensePartitionedKroneckerFactored if over else blocks.DenseTwoKroneckerFactored)
        assert (note is not None) == over
        if over:
            for layout, side in ((block.inputs_layout, sa), (block.outputs_layout, sg)):
                assert layout.is_whole == (side * side * 4 <= budget)
                assert layout.is_whole or layout.nbytes(4) <= budget
    if budget == 30 * 30 * 4 - 1:
        assert est.block_notes[1] == (
            "outputs factor 30\u00b2 x 4 B = 3.52 KiB > budget 3.51 KiB: partitioned into 2 blocks of <= 15 (1.76 KiB; "
            "the largest blocks within the budget)"
        )


def test_registration_table_names_partitioned_layers_and_why():
    loss, params, batch = _mlp()
    opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=0.0, learning_rate_schedule=lambda t: 0.1,
                           momentum_schedule=lambda t: 0.0, damping_schedule=lambda t: 1e-2, factor_budget=1000)
    opt.init(params, jax.random.PRNGKey(0), batch)
    rows = {line.split()[0].rstrip(","): line for line in opt.registration_table().splitlines()[1:]}
    assert rows["l0/w"].endswith("-> DenseTwoKroneckerFactored")
    assert "-> DensePartitionedKroneckerFactored  [outputs factor 30\u00b2 x 4 B = 3.52 KiB > budget 1000 B: partitioned into 4 blocks of <= 8" in rows["l1/w"]
    # A Kronecker block the user chose is kept, and the table says it is over budget.
    est = estimators.BlockDiagonalCurvature(loss, factor_budget=1000, layer_tag_to_block_ctor={"dense": blocks.DenseTwoKroneckerFactoredReduce})
    est.finalize((params, batch))
    assert all(type(b) is blocks.DenseTwoKroneckerFactoredReduce for b in est.blocks)
    assert est.block_notes[0] is None and est.block_notes[1].startswith("outputs factor 30\u00b2 x 4 B = 3.52 KiB > budget 1000 B, kept whole")


def _train(opt, params, batch, steps=4):
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    losses = []
    for i in range(steps):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(2 + i), batch=batch)
        losses.append(float(stats["loss"]))
    return np.asarray(losses)


def test_optimizer_with_a_tiny_budget_trains_and_matches_the_explicit_choice():
    loss, params, batch = _mlp()
    kw = dict(l2_reg=0.0, use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True,
              initial_damping=1.0, inverse_update_period=2, num_burnin_steps=1)
    auto = curvax.Optimizer(jax.value_and_grad(loss), factor_budget=500, **kw)  # G of layer 1: 3600 B > 500
    auto_losses = _train(auto, params, batch)
    assert np.all(np.isfinite(auto_losses)) and auto_losses[-1] < auto_losses[0]
    assert [type(b) for b in auto._estimator.blocks] == [blocks.DenseTwoKroneckerFactored, DensePartitionedKroneckerFactored]
    explicit = curvax.Optimizer(
        jax.value_and_grad(loss), factor_budget=None,
        layer_tag_to_block_ctor={"dense": functools.partial(DensePartitionedKroneckerFactored, factor_budget=500)}, **kw,
    )
    np.testing.assert_allclose(_train(explicit, params, batch), auto_losses, rtol=1e-5)


@pytest.mark.usefixtures("x64")
def test_operators_work_block_by_block_with_a_partitioned_block():
    loss, params, batch = _mlp()
    params, batch = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64) if x.dtype == jnp.float32 else x, (params, batch))
    est = estimators.BlockDiagonalCurvature(loss, factor_budget=8 * 30 * 8)  # float64: G in blocks of <= 8
    state = est.init(jax.random.PRNGKey(0), (params, batch))
    update = lambda s, args: est.update_curvature_matrix_estimate(s, 0.0, 1.0, BATCH, jax.random.PRNGKey(1), args)
    state = jax.jit(update)(state, (params, batch))
    assert isinstance(est.blocks[1], DensePartitionedKroneckerFactored) and est.blocks[1].outputs_layout.num_blocks == 4
    dense = np.asarray(jax.jit(est.to_dense_matrix)(state))
    K = ops.from_estimator(est, state)
    np.testing.assert_allclose(K.to_dense(), dense, atol=1e-12)
    eye = np.eye(len(dense))
    v = np.random.default_rng(0).standard_normal(len(dense))
    np.testing.assert_allclose(K.inverse(LAM) @ jnp.asarray(v), np.linalg.solve(dense + LAM * eye, v), rtol=1e-8)
    np.testing.assert_allclose(K.trace(), np.trace(dense), rtol=1e-10)
    np.testing.assert_allclose(K.logdet(LAM), np.linalg.slogdet(dense + LAM * eye)[1], rtol=1e-10)
    np.testing.assert_allclose(K.inverse(LAM).diagonal(), np.diag(np.linalg.inv(dense + LAM * eye)), rtol=1e-8)
    # The factored (approximate) inverse inverts a partitioned block exactly, like other non-Kronecker blocks.
    approx = K.inverse(LAM, exact=False) @ jnp.asarray(v)
    assert np.all(np.isfinite(np.asarray(approx)))


@pytest.mark.usefixtures("x64")
def test_map_decompositions_equals_the_batched_call_and_never_batches_lapack_on_cpu():
    # Slices of a pytree in, a pytree out, float64: the same numbers as the batched (vmapped) call.
    x = jax.random.normal(jax.random.PRNGKey(3), (5, 7, 7), jnp.float64)
    m = x @ jnp.swapaxes(x, -1, -2) + 0.1 * jnp.eye(7)
    scale = jnp.arange(1.0, 6.0)

    def fn(mi, si):
        s, q = curvax.linalg.safe_psd_eigh(mi * si)
        return {"inv": curvax.linalg.psd_inv(mi), "values": s, "vectors": q}

    got = jax.jit(lambda a, b: curvax.linalg.map_decompositions(fn, a, b))(m, scale)
    want = jax.vmap(fn)(m, scale)
    np.testing.assert_allclose(got["inv"], np.linalg.inv(np.asarray(m)), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(got["values"], want["values"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.abs(got["vectors"]), np.abs(want["vectors"]), atol=1e-10)
    one = curvax.linalg.map_decompositions(fn, m[:1], scale[:1])
    np.testing.assert_allclose(one["inv"], got["inv"][:1], rtol=1e-12)
    if jax.default_backend() == "cpu":
        text = jax.jit(lambda a, b: curvax.linalg.map_decompositions(fn, a, b)).lower(m, scale).compile().as_text()
        shapes = re.findall(r'= \(?f64\[([\d,]*)\][^\n]*custom_call_target="lapack_d(?:potrf|syevd)', text)
        assert shapes and set(shapes) == {"7,7"}
