"""Curvature blocks checked against their dense definitions (float64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import extension_guide
from curvax import blocks, linalg, tags
from layer_eqns import dense_eqn, generic_eqn

pytestmark = pytest.mark.usefixtures("x64")


# ----------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------


def dense_data(seed, d_in, d_out, bias=True, layout="io", batch=4, extra=()):
    """Random x, dy and parameters, with per-example gradients computed by autodiff."""
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(k[0], (batch, *extra, d_in))
    dy = jax.random.normal(k[1], (batch, *extra, d_out))
    w_shape = (d_in, d_out) if layout == "io" else (d_out, d_in)
    params = (jax.random.normal(k[2], w_shape),)
    if bias:
        params += (jax.random.normal(k[3], (d_out,)),)

    def contrib(p, xn, dyn):
        w = p[0] if layout == "io" else p[0].T
        y = xn @ w + (p[1] if bias else 0.0)
        return jnp.sum(y * dyn)

    per_example = jax.vmap(jax.grad(contrib), in_axes=(None, 0, 0))(params, x, dy)
    g = jnp.concatenate([t.reshape(batch, -1) for t in per_example], axis=1)  # (B, dim)
    data = {
        "inputs": (x,),
        "outputs": (x @ (params[0] if layout == "io" else params[0].T),),
        "params": params,
        "outputs_tangent": (dy,),
        "params_tangent": tuple(jnp.sum(t, axis=0) for t in per_example),
    }
    return data, g


def flat(vec):
    return jnp.concatenate([jnp.ravel(v) for v in vec])


def random_vector(block, seed=7):
    keys = jax.random.split(jax.random.PRNGKey(seed), block.number_of_parameters)
    return tuple(jax.random.normal(k, s) for k, s in zip(keys, block.parameters_shapes))


def to_v(vec, layout, bias):
    """Test-side arrangement of a (w, b) vector as V = [W_io; b^T]."""
    w = vec[0] if layout == "io" else vec[0].T
    return jnp.concatenate([w, vec[1][None]], 0) if bias else w


def dense_power(m, power):
    s, q = np.linalg.eigh(np.asarray(m))
    return (q * s**power) @ q.T


def updated_state(block, datas, batch, init_kwargs=None):
    state = block.init(jax.random.PRNGKey(0), **(init_kwargs or dict(
        exact_powers_to_cache=None, approx_powers_to_cache=None, cache_eigenvalues=False)))
    for i, d in enumerate(datas):
        state = block.update_curvature_matrix_estimate(state, d, 0.9 if i else 0.0, 1.0, batch)
    return state


# ----------------------------------------------------------------------------------
# WeightedMovingAverage
# ----------------------------------------------------------------------------------


def test_weighted_moving_average_semantics():
    wma = blocks.WeightedMovingAverage.zeros((2,), jnp.float64)
    assert float(wma.weight) == 0.0 and wma.value.shape == (2,)
    v1, v2 = jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])
    assert wma.update(v1, 0.9, 1.0) is None  # in place
    np.testing.assert_allclose(wma.value, v1)  # first update replaces the zero value
    np.testing.assert_allclose(wma.weight, 1.0)
    wma.update(v2, 0.9, 1.0)
    np.testing.assert_allclose(wma.weight, 1.9)
    np.testing.assert_allclose(wma.value, (0.9 * v1 + v2) / 1.9)
    np.testing.assert_allclose(wma.raw_value, 0.9 * v1 + v2)
    # ema_old = ema_new = 1 is the plain average.
    avg = blocks.WeightedMovingAverage.zeros((2,), jnp.float64)
    for v in (v1, v2, 2 * v1):
        avg.update(v, 1.0, 1.0)
    np.testing.assert_allclose(avg.value, (v1 + v2 + 2 * v1) / 3)
    # Zero total weight leaves the value alone instead of dividing by zero.
    empty = blocks.WeightedMovingAverage.zeros((2,), jnp.float64)
    empty.update(v1, 1.0, 0.0)
    assert np.all(np.isfinite(empty.value))
    # It is a pytree and works under jit; dtype is preserved.
    f = jax.jit(lambda w, x: (w.update(x, 0.5, 1.0), w)[1])
    out = f(blocks.WeightedMovingAverage.zeros((2,), jnp.float32), v1)
    assert out.value.dtype == jnp.float32 and out.weight.dtype == jnp.float32
    with pytest.raises(ValueError, match="shape"):
        wma.update(jnp.zeros(3), 0.9, 1.0)


# ----------------------------------------------------------------------------------
# Dense blocks vs per-example definitions
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,bias", [("io", True), ("oi", False)])
def test_single_example_kronecker_is_exact_fisher(layout, bias):
    eqn = dense_eqn(3, 2, 1, bias=bias, layout=layout)
    data, g = dense_data(0, 3, 2, bias, layout, batch=1)
    for block in (blocks.DenseTwoKroneckerFactored(eqn, "l"), blocks.DenseFull(eqn, "l")):
        state = updated_state(block, [data], 1)
        np.testing.assert_allclose(block.to_dense_matrix(state), jnp.outer(g[0], g[0]), atol=1e-12)
    block = blocks.DenseDiagonal(eqn, "l")
    np.testing.assert_allclose(block.to_dense_matrix(updated_state(block, [data], 1)), jnp.diag(g[0] ** 2), atol=1e-12)


@pytest.mark.parametrize(
    "layout,bias,extra", [("io", True, ()), ("oi", False, ()), ("io", False, (3,)), ("oi", True, (3,))]
)
def test_dense_blocks_match_definitions(layout, bias, extra):
    batch, d_in, d_out = 5, 3, 2
    eqn = dense_eqn(d_in, d_out, batch, extra, bias, layout)
    data, g = dense_data(1, d_in, d_out, bias, layout, batch, extra)

    full = blocks.DenseFull(eqn, "l")
    f_dense = full.to_dense_matrix(updated_state(full, [data], batch))
    np.testing.assert_allclose(f_dense, g.T @ g / batch, atol=1e-12)

    diag = blocks.DenseDiagonal(eqn, "l")
    np.testing.assert_allclose(diag.to_dense_matrix(updated_state(diag, [data], batch)), jnp.diag(jnp.diag(f_dense)), atol=1e-12)

    kf = blocks.DenseTwoKroneckerFactored(eqn, "l")
    state = updated_state(kf, [data], batch)
    x = data["inputs"][0].reshape(-1, d_in)
    dy = data["outputs_tangent"][0].reshape(-1, d_out)
    if bias:
        x = jnp.concatenate([x, jnp.ones((x.shape[0], 1))], 1)
    a, gg = x.T @ x / x.shape[0], dy.T @ dy / batch
    np.testing.assert_allclose(state.inputs_factor.value, a, atol=1e-12)
    np.testing.assert_allclose(state.outputs_factor.value, gg, atol=1e-12)
    assert kf.input_size() == d_in + bias and kf.output_size() == d_out and kf.has_bias == bias
    # Dense matrix in parameter order: its product with v equals A V G, read back in parameter order.
    v = random_vector(kf)
    dense = kf.to_dense_matrix(state)
    got = dense @ flat(v)
    av_g = a @ to_v(v, layout, bias) @ gg
    np.testing.assert_allclose(to_v(_unflat(kf, got), layout, bias), av_g, atol=1e-12)
    np.testing.assert_allclose(jnp.sort(jnp.linalg.eigvalsh(dense)), jnp.sort(kf.eigenvalues(state, False)), atol=1e-10)
    np.testing.assert_allclose(
        kf.eigenvalues(state, False), jnp.outer(jnp.linalg.eigvalsh(a), jnp.linalg.eigvalsh(gg)).ravel(), atol=1e-10
    )


def _unflat(block, vec):
    sizes = np.cumsum(block.parameters_sizes)[:-1]
    return tuple(p.reshape(s) for p, s in zip(jnp.split(vec, sizes), block.parameters_shapes))


def test_moving_average_of_dense_estimates():
    eqn = dense_eqn(3, 2, 4)
    d1, g1 = dense_data(1, 3, 2, True, "io", 4)
    d2, g2 = dense_data(2, 3, 2, True, "io", 4)
    full = blocks.DenseFull(eqn, "l")
    state = updated_state(full, [d1, d2], 4)
    want = (0.9 * g1.T @ g1 / 4 + g2.T @ g2 / 4) / 1.9
    np.testing.assert_allclose(full.to_dense_matrix(state), want, atol=1e-12)


# ----------------------------------------------------------------------------------
# Matrix functions
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,bias", [("io", True), ("oi", True), ("oi", False)])
def test_kronecker_powers(layout, bias):
    batch, lam = 4, 0.3
    eqn = dense_eqn(3, 2, batch, bias=bias, layout=layout)
    block = blocks.DenseTwoKroneckerFactored(eqn, "l")
    datas = [dense_data(s, 3, 2, bias, layout, batch)[0] for s in (3, 4)]
    v = random_vector(block)

    @jax.jit  # one compilation for every product below
    def run(datas):
        state = updated_state(block, datas, batch, dict(
            exact_powers_to_cache=[-1, -0.5], approx_powers_to_cache=-1, cache_eigenvalues=True))
        cached = block.update_cache(state, lam, [-1, -0.5], -1, True)
        out = {
            "state": state, "cached": cached, "dense": block.to_dense_matrix(state),
            "exact": [block.multiply_matpower(state, v, lam, p, True, False) for p in (1, -1, -0.5)],
            "exact_inv": block.multiply_inverse(state, v, lam, True, False),
            "approx_inv": block.multiply_inverse(state, v, lam, False, False),
            "approx_mul": block.multiply(state, v, lam, False, False),
            "cached_exact": [[block.multiply_matpower(c, v, lam2, p, True, c is cached) for c in (cached, state)]
                             for p in (-1, -0.5) for lam2 in (lam, 2.5)],
            "cached_approx_inv": [block.multiply_inverse(cached, v, w, False, True) for w in (lam, 100.0)],
            "cached_eigenvalues": block.eigenvalues(cached, True),
        }
        return out

    out = run(datas)
    state, cached, dense = out["state"], out["cached"], out["dense"]
    eye = jnp.eye(block.dim)

    # Exact powers: matrix functions of M + lam I.
    for p, got in zip((1, -1, -0.5), out["exact"]):
        np.testing.assert_allclose(flat(got), dense_power(dense + lam * eye, p) @ flat(v), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(flat(out["exact_inv"]), jnp.linalg.solve(dense + lam * eye, flat(v)), rtol=1e-9)

    # Approximate: pi-adjusted damped factors.
    a, g = state.inputs_factor.value, state.outputs_factor.value
    pi = jnp.sqrt((jnp.trace(a) / a.shape[0]) / (jnp.trace(g) / g.shape[0]))
    a_d = a + pi * jnp.sqrt(lam) * jnp.eye(a.shape[0])
    g_d = g + jnp.sqrt(lam) / pi * jnp.eye(g.shape[0])
    vv = to_v(v, layout, bias).ravel()
    np.testing.assert_allclose(to_v(out["approx_inv"], layout, bias).ravel(), jnp.linalg.solve(jnp.kron(a_d, g_d), vv), rtol=1e-9)
    np.testing.assert_allclose(to_v(out["approx_mul"], layout, bias).ravel(), jnp.kron(a_d, g_d) @ vv, rtol=1e-9)

    # Cached == uncached. Exact powers use the call-time damping (eigenvectors are damping free).
    assert cached.cache["-1"]["identity_weight"] == lam
    for from_cache, direct in out["cached_exact"]:
        np.testing.assert_allclose(flat(from_cache), flat(direct), rtol=1e-9)
    # The approximate cache keeps the damping it was built with.
    for got in out["cached_approx_inv"]:
        np.testing.assert_allclose(flat(got), flat(out["approx_inv"]), rtol=1e-9)
    np.testing.assert_allclose(jnp.sort(out["cached_eigenvalues"]), jnp.linalg.eigvalsh(dense), atol=1e-10)
    # update_cache returns a new state; the original's cache is untouched.
    np.testing.assert_allclose(state.cache["-1"]["inputs_factor"], jnp.eye(block.input_size()))


@pytest.mark.parametrize("d_in,d_out,bias", [(3, 1, True), (1, 2, False), (1, 1, False)])
def test_one_wide_factor_makes_the_approximate_inverse_exact(d_in, d_out, bias):
    """With a 1 x 1 factor the damped Kronecker product ``A (x) g + d I`` is exactly
    ``(A + d/g I) (x) g``: the approximate inverse, cached or not, equals the exact damped
    inverse (kfac-jax 0.0.8 gives scalar factors no damping and the other factor all of it)."""
    batch, lam = 5, 0.3
    eqn = dense_eqn(d_in, d_out, batch, bias=bias)
    block = blocks.DenseTwoKroneckerFactored(eqn, "l")
    datas = [dense_data(s, d_in, d_out, bias, "io", batch)[0] for s in (3, 4)]
    v = random_vector(block)
    state = updated_state(block, datas, batch, dict(exact_powers_to_cache=None, approx_powers_to_cache=-1,
                                                    cache_eigenvalues=False))
    cached = block.update_cache(state, lam, None, -1, False)
    dense = block.to_dense_matrix(state)
    want = jnp.linalg.solve(dense + lam * jnp.eye(block.dim), flat(v))
    np.testing.assert_allclose(flat(block.multiply_inverse(state, v, lam, False, False)), want, rtol=1e-9)
    np.testing.assert_allclose(flat(block.multiply_inverse(cached, v, lam, False, True)), want, rtol=1e-9)
    np.testing.assert_allclose(flat(block.multiply(state, v, lam, False, False)),
                               (dense + lam * jnp.eye(block.dim)) @ flat(v), rtol=1e-9)


def test_full_powers_and_cache_modes():
    batch, lam = 4, 0.2
    eqn = generic_eqn((2, 3), (2,))
    block = blocks.NaiveFull(eqn, "g")
    keys = jax.random.split(jax.random.PRNGKey(5), 6)
    datas = [{"params_tangent": (jax.random.normal(keys[i], (2, 3)), jax.random.normal(keys[i + 3], (2,)))} for i in range(3)]
    state = updated_state(block, datas, batch)
    gs = [flat(d["params_tangent"]) for d in datas]
    m = gs[0][:, None] * gs[0][None] / batch
    w = 1.0
    for gi in gs[1:]:
        m, w = (0.9 * w * m + jnp.outer(gi, gi) / batch) / (0.9 * w + 1), 0.9 * w + 1
    np.testing.assert_allclose(block.to_dense_matrix(state), m, atol=1e-12)
    v = random_vector(block)
    eye = jnp.eye(block.dim)
    for p in (1, -1, -0.5):
        for exact in (True, False):
            np.testing.assert_allclose(
                flat(block.multiply_matpower(state, v, lam, p, exact, False)),
                dense_power(m + lam * eye, p) @ flat(v), rtol=1e-8, atol=1e-12,
            )
    np.testing.assert_allclose(jnp.sort(block.eigenvalues(state, False)), jnp.linalg.eigvalsh(m), atol=1e-10)
    assert block.parameters_list_to_single_vector(v).shape == (block.dim,)
    np.testing.assert_allclose(flat(block.single_vector_to_parameters_list(flat(v))), flat(v))

    # Few approximate powers: one matrix per power; many: eigen-decomposition.
    for threshold, powers in ((5, [-1, -0.5]), (1, [-1, -0.5])):
        b = blocks.NaiveFull(eqn, "g", eigen_decomposition_threshold=threshold)
        st = b.init(jax.random.PRNGKey(0), -1, powers, False)
        assert ("-1" in st.cache) == (threshold == 5)
        assert ("eigen_vectors" in st.cache)
        for d in datas:
            st = b.update_curvature_matrix_estimate(st, d, 0.9, 1.0, batch)
        st = b.update_cache(st, lam, -1, powers, False)
        for p in (-1, -0.5):
            np.testing.assert_allclose(
                flat(b.multiply_matpower(st, v, lam, p, False, True)), dense_power(m + lam * eye, p) @ flat(v), rtol=1e-8
            )
        np.testing.assert_allclose(
            flat(b.multiply_inverse(st, v, 3.0, True, True)), jnp.linalg.solve(m + 3.0 * eye, flat(v)), rtol=1e-8
        )


def test_naive_and_dense_diagonal():
    batch, lam = 3, 0.1
    eqn = generic_eqn((4,), (2, 2))
    block = blocks.NaiveDiagonal(eqn, "g")
    t = (jnp.arange(4.0) - 1.5, jnp.array([[1.0, -2.0], [0.5, 3.0]]))
    state = updated_state(block, [{"params_tangent": t}], batch, dict(
        exact_powers_to_cache=-1, approx_powers_to_cache=-1, cache_eigenvalues=True))
    d = flat(t) ** 2 / batch
    np.testing.assert_allclose(block.to_dense_matrix(state), jnp.diag(d))
    v = random_vector(block)
    for p in (1, -1, -0.5):
        for exact in (True, False):
            np.testing.assert_allclose(flat(block.multiply_matpower(state, v, lam, p, exact, False)), (d + lam) ** p * flat(v))
    cached = block.update_cache(state, lam, -1, -1, True)
    np.testing.assert_allclose(
        flat(block.multiply_inverse(cached, v, 2.0, False, True)), flat(block.multiply_inverse(state, v, 2.0, False, False))
    )
    np.testing.assert_allclose(block.eigenvalues(cached, True), d)


def test_scaled_identity():
    eqn = generic_eqn((3,), (2,))
    block = blocks.ScaledIdentity(eqn, "s", scale=2.0)
    state = block.init(jax.random.PRNGKey(0), -1, -1, True)
    state = block.update_curvature_matrix_estimate(state, {}, 0.9, 1.0, 4)
    v = random_vector(block)
    np.testing.assert_allclose(flat(block.multiply_inverse(state, v, 0.5, False, True)), flat(v) / 2.5)
    np.testing.assert_allclose(flat(block.multiply(state, v, 0.5, True, False)), flat(v) * 2.5)
    np.testing.assert_allclose(block.to_dense_matrix(state), 2 * jnp.eye(5))
    np.testing.assert_allclose(block.eigenvalues(state, False), 2 * jnp.ones(5))


@pytest.mark.parametrize("fixed,dep", [(3.0, 1.0), (1.0, 2.0), (3.0, 0.5)])
def test_scales_are_consistent(fixed, dep):
    class Scaled(blocks.DenseTwoKroneckerFactored):
        def fixed_scale(self):
            return fixed

        def state_dependent_scale(self, state):
            return jnp.asarray(dep) * jnp.ones_like(state.inputs_factor.weight)

    batch, lam = 4, 0.3
    eqn = dense_eqn(3, 2, batch)
    data, _ = dense_data(2, 3, 2, True, "io", batch)
    plain, scaled = blocks.DenseTwoKroneckerFactored(eqn, "l"), Scaled(eqn, "l")
    kw = dict(exact_powers_to_cache=-1, approx_powers_to_cache=-1, cache_eigenvalues=True)
    s0, s1 = updated_state(plain, [data], batch, kw), updated_state(scaled, [data], batch, kw)
    np.testing.assert_allclose(scaled.to_dense_matrix(s1), fixed * dep * plain.to_dense_matrix(s0), rtol=1e-12)
    dense = scaled.to_dense_matrix(s1)
    v = random_vector(scaled)
    want = jnp.linalg.solve(dense + lam * jnp.eye(dense.shape[0]), flat(v))
    c1 = scaled.update_cache(s1, lam, -1, -1, True)
    np.testing.assert_allclose(flat(scaled.multiply_inverse(s1, v, lam, True, False)), want, rtol=1e-9)
    np.testing.assert_allclose(flat(scaled.multiply_inverse(c1, v, lam, True, True)), want, rtol=1e-9)
    np.testing.assert_allclose(
        flat(scaled.multiply_inverse(c1, v, lam, False, True)), flat(scaled.multiply_inverse(s1, v, lam, False, False)), rtol=1e-9
    )
    np.testing.assert_allclose(jnp.sort(scaled.eigenvalues(c1, True)), jnp.linalg.eigvalsh(dense), atol=1e-10)


# ----------------------------------------------------------------------------------
# jit / control flow
# ----------------------------------------------------------------------------------


def test_jit_fori_loop_and_cond_keep_structure():
    batch, lam = 4, 0.3
    eqn = dense_eqn(3, 2, batch, layout="oi")
    data, _ = dense_data(3, 3, 2, True, "oi", batch)
    block = blocks.DenseTwoKroneckerFactored(eqn, "l")
    state0 = block.init(jax.random.PRNGKey(0), -1, -1, False)
    v = random_vector(block)

    @jax.jit
    def step(state, k):
        state = jax.lax.fori_loop(
            0, 3, lambda i, s: block.update_curvature_matrix_estimate(s, data, jnp.where(i == 0, 0.0, 1.0), 1.0 / 3, batch), state
        )
        state = jax.lax.cond(k % 2 == 0, lambda s: block.update_cache(s, lam, -1, -1, False), lambda s: s, state)
        return state, block.multiply_inverse(state, v, lam, True, True), block.multiply_inverse(state, v, lam, False, True)

    state, exact, approx = step(state0, 0)
    ref = updated_state(block, [data], batch)
    np.testing.assert_allclose(block.to_dense_matrix(state), block.to_dense_matrix(ref), rtol=1e-12)
    np.testing.assert_allclose(flat(exact), flat(block.multiply_inverse(ref, v, lam, True, False)), rtol=1e-9)
    np.testing.assert_allclose(flat(approx), flat(block.multiply_inverse(ref, v, lam, False, False)), rtol=1e-9)
    # The input state was not mutated by the (non-jitted) updates either.
    updated_state(block, [data], batch)
    assert float(state0.inputs_factor.weight) == 0.0


# ----------------------------------------------------------------------------------
# The extension guide's custom block
# ----------------------------------------------------------------------------------


def test_extension_guide_custom_block():
    batch, lam = 4, 0.2
    eqn = dense_eqn(3, 2, batch)
    data, _ = dense_data(4, 3, 2, True, "io", batch)
    custom = extension_guide.DenseTwoKroneckerFactored(eqn, "custom")
    builtin = blocks.DenseTwoKroneckerFactored(eqn, "builtin")
    sc = custom.init(jax.random.PRNGKey(0), None, -1, False)
    sc = custom.update_curvature_matrix_estimate(sc, data, 0.0, 1.0, batch, None)
    sb = updated_state(builtin, [data], batch)
    v = random_vector(custom)
    for exact in (True, False):
        np.testing.assert_allclose(
            flat(custom.multiply_inverse(sc, v, lam, exact, False)), flat(builtin.multiply_inverse(sb, v, lam, exact, False)), rtol=1e-10
        )
    sc = custom.update_cache(sc, lam, None, -1, False)
    np.testing.assert_allclose(
        flat(custom.multiply_inverse(sc, v, lam, False, True)), flat(builtin.multiply_inverse(sb, v, lam, False, False)), rtol=1e-10
    )
    # It also runs under jit.
    f = jax.jit(lambda s: custom.update_curvature_matrix_estimate(s, data, 0.9, 1.0, batch, None))
    np.testing.assert_allclose(f(sc).inputs_factor.value, sb.inputs_factor.value, rtol=1e-12)


# ----------------------------------------------------------------------------------
# Defaults and errors
# ----------------------------------------------------------------------------------


def test_defaults():
    assert blocks.get_default_tag_to_block_ctor("dense") is blocks.DenseTwoKroneckerFactored
    assert blocks.get_default_tag_to_block_ctor(tags.generic) is blocks.NaiveDiagonal
    assert blocks.get_default_tag_to_block_ctor("dense_tag") is blocks.DenseTwoKroneckerFactored
    blocks.set_default_tag_to_block_ctor("my_layer", blocks.NaiveFull)
    try:
        assert blocks.get_default_tag_to_block_ctor("my_layer") is blocks.NaiveFull
    finally:
        blocks._DEFAULT_TAG_TO_BLOCK_CTOR.pop("my_layer")
    with pytest.raises(ValueError, match="known tags.*dense.*generic"):
        blocks.get_default_tag_to_block_ctor("conv9d")
    assert blocks.get_default_eigen_decomposition_threshold() == 5
    blocks.set_default_eigen_decomposition_threshold(2)
    try:
        assert blocks.NaiveFull(generic_eqn((2,)), "g").eigen_decomposition_threshold == 2
    finally:
        blocks.set_default_eigen_decomposition_threshold(5)
    assert blocks.KroneckerFactored is blocks.TwoKroneckerFactored


def test_block_properties():
    eqn = dense_eqn(3, 2, 4, layout="oi")
    eqn = tags.LayerTagEqn(eqn.primitive, eqn.outputs, eqn.inputs, eqn.params, (7, 2), eqn.meta, eqn.name)
    block = blocks.DenseTwoKroneckerFactored(eqn, "l")
    assert block.name == "l" and block.layer_tag_primitive is tags.dense
    assert block.parameters_shapes == ((2, 3), (2,)) and block.dim == 8 and block.number_of_parameters == 2
    assert block.inputs_shapes == ((4, 3),) and block.outputs_shapes == ((4, 2),)
    assert block.parameters_canonical_order == (1, 0)
    assert block.layer_tag_extra_params == {"kernel_layout": "oi"}
    assert block.parameter_variables == eqn.params


def test_errors():
    eqn = dense_eqn(3, 2, 4)
    block = blocks.DenseTwoKroneckerFactored(eqn, "l")
    with pytest.raises(NotImplementedError, match="-0.5"):
        block.init(jax.random.PRNGKey(0), None, [-1, -0.5], False)
    state = block.init(jax.random.PRNGKey(0), None, None, False)
    with pytest.raises(NotImplementedError, match="2"):
        block.update_cache(state, 0.1, None, 2, False)
    v = random_vector(block)
    with pytest.raises(ValueError, match="shapes"):
        block.multiply(state, (v[0].T, v[1]), 0.1, True, False)
    with pytest.raises(ValueError, match="2 parameters"):
        block.multiply(state, (v[0],), 0.1, True, False)
    with pytest.raises(TypeError, match="tuple"):
        block.multiply(state, v[0], 0.1, True, False)
    with pytest.raises(ValueError, match="not in the cache"):
        block.multiply_inverse(state, v, 0.1, True, True)
    with pytest.raises(ValueError, match="not in the cache"):
        block.multiply_inverse(state, v, 0.1, False, True)
    with pytest.raises(ValueError, match="not in the cache"):
        block.eigenvalues(state, True)
    with pytest.raises(TypeError, match="power"):
        block.multiply_matpower(state, v, 0.1, "inverse", True, False)
    with pytest.raises(ValueError, match="kernel_layout"):
        bad = tags.LayerTagEqn(eqn.primitive, eqn.outputs, eqn.inputs, eqn.params, (0, 1), {"kernel_layout": "xy"}, "l")
        blocks.DenseFull(bad, "l")
    with pytest.raises(ValueError, match="features"):
        x = jnp.zeros((4, 5))
        block.update_curvature_matrix_estimate(state, {"inputs": (x,), "outputs_tangent": (jnp.zeros((4, 2)),)}, 0.0, 1.0, 4)


def test_psd_inv_inverts_damped_factors_and_flags_indefinite_input():
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.PRNGKey(0), (30, 40), jnp.float64)
        m = x.T @ x / 30 + 0.1 * jnp.eye(40)  # rank-deficient statistics plus damping
        inv = jax.jit(linalg.psd_inv)(m)
        np.testing.assert_allclose(inv @ m, np.eye(40), atol=1e-9)
        np.testing.assert_array_equal(inv, inv.T)
    # Not positive definite: non-finite values, which make the optimizer skip the update.
    assert not np.all(np.isfinite(linalg.psd_inv(jnp.diag(jnp.array([1.0, -1.0, 2.0])))))


def test_linalg_helpers():
    m = jnp.array([[2.0, 1.0], [1.0, 2.0]])
    np.testing.assert_allclose(linalg.psd_inv(m), jnp.linalg.inv(m), rtol=1e-12)
    # A singular matrix makes Cholesky produce NaNs; the solve falls back to the diagonal, never NaN.
    sing = jnp.array([[1.0, 1.0], [1.0, 1.0]])
    out = jax.jit(linalg.psd_solve)(sing, jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(out, jnp.array([1.0, 2.0]), rtol=1e-10)
    s, q = linalg.safe_psd_eigh(jnp.array([[1.0, 0.0], [0.0, -1e-12]]))
    assert np.all(np.asarray(s) >= 0)
    a_d, g_d = linalg.pi_adjusted_factors(jnp.zeros((2, 2)), jnp.eye(3), 4.0)
    np.testing.assert_allclose(a_d, 2 * jnp.eye(2))
    np.testing.assert_allclose(g_d, 2 * jnp.eye(3))


def test_full_eigen_decomposition_threshold_counts_approximate_powers():
    """More approximate powers than the threshold: one eigendecomposition; otherwise one matrix per power."""
    batch, lam = 4, 0.3
    eqn = generic_eqn((2, 3), (2,))
    keys = jax.random.split(jax.random.PRNGKey(8), 2)
    data = {"params_tangent": (jax.random.normal(keys[0], (2, 3)), jax.random.normal(keys[1], (2,)))}
    powers = (-1, -0.5)
    v = random_vector(blocks.NaiveFull(eqn, "g"))
    results = {}
    for threshold in (len(powers), len(powers) - 1):  # at the threshold, and just above it
        block = blocks.NaiveFull(eqn, "g", eigen_decomposition_threshold=threshold)
        state = block.init(jax.random.PRNGKey(0), None, powers, False)
        state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch)
        state = block.update_cache(state, lam, None, powers, False)
        per_power = threshold >= len(powers)
        assert ("-1" in state.cache and "-0.5" in state.cache) == per_power
        assert ("eigen_vectors" in state.cache) == (not per_power)
        m = block.to_dense_matrix(state)
        for p in powers:
            got = flat(block.multiply_matpower(state, v, lam, p, False, True))
            np.testing.assert_allclose(got, dense_power(m + lam * jnp.eye(block.dim), p) @ flat(v), rtol=1e-9)
            results.setdefault(p, []).append(got)
    for p in powers:
        np.testing.assert_allclose(results[p][0], results[p][1], rtol=1e-9)


def _random_psd(seed, n, dtype):
    a = jax.random.normal(jax.random.PRNGKey(seed), (n, n))
    return (a @ a.T + 0.5 * jnp.eye(n)).astype(dtype)


def test_eigh_and_cholesky_retry_in_float64_inside_a_float32_program(monkeypatch):
    real_eigh, real_eigvalsh, real_cho = jnp.linalg.eigh, jnp.linalg.eigvalsh, jax.scipy.linalg.cho_factor
    seen = []

    def failing_in_float32(real):
        def fake(a, *args, **kwargs):
            seen.append(jnp.dtype(a.dtype))
            out = real(a, *args, **kwargs)
            if a.dtype != jnp.float32:
                return out
            return jax.tree_util.tree_map(lambda o: o * jnp.nan if isinstance(o, jax.Array) else o, out)
        return fake

    monkeypatch.setattr(jnp.linalg, "eigh", failing_in_float32(real_eigh))
    monkeypatch.setattr(jnp.linalg, "eigvalsh", failing_in_float32(real_eigvalsh))
    monkeypatch.setattr(jax.scipy.linalg, "cho_factor", failing_in_float32(real_cho))
    m64 = _random_psd(0, 4, jnp.float64)
    b64 = jnp.arange(4.0)
    with jax.enable_x64(False):  # a user's float32 program: x64 is off globally
        m, b = jnp.asarray(np.asarray(m64), jnp.float32), jnp.asarray(np.asarray(b64), jnp.float32)
        s, q = jax.jit(lambda x: linalg.safe_psd_eigh(x))(m)
        ev = jax.jit(lambda x: linalg.safe_eigvalsh(x))(m)
        x = jax.jit(lambda x, y: linalg.psd_solve(x, y))(m, b)
    assert s.dtype == q.dtype == ev.dtype == x.dtype == jnp.float32
    assert jnp.dtype(jnp.float64) in seen
    np.testing.assert_allclose((q * s) @ q.T, m64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ev, np.linalg.eigvalsh(np.asarray(m64)), rtol=1e-5)
    # The float64 solve, not the diagonal (Jacobi) fallback.
    np.testing.assert_allclose(x, np.linalg.solve(np.asarray(m64), np.asarray(b64)), rtol=1e-5)


def test_eigh_falls_back_to_svd_without_a_wider_dtype(monkeypatch):
    real_eigh = jnp.linalg.eigh
    monkeypatch.setattr(jnp.linalg, "eigh", lambda a, *args, **kw: tuple(o * jnp.nan for o in real_eigh(a, *args, **kw)))
    assert not linalg.float64_retry_available(jnp.float64)
    m = _random_psd(1, 4, jnp.float64)
    s, q = jax.jit(lambda x: linalg.safe_psd_eigh(x))(m)
    np.testing.assert_allclose((q * s) @ q.T, m, rtol=1e-10)
    np.testing.assert_allclose(jnp.sort(s), np.linalg.eigvalsh(np.asarray(m)), rtol=1e-10)


def test_psd_helpers_symmetrize_and_clip():
    q = jnp.linalg.qr(jax.random.normal(jax.random.PRNGKey(2), (3, 3)))[0]
    psd = (q * jnp.array([2.0, 1.0, -1e-9])) @ q.T  # PSD up to round-off: a tiny negative eigenvalue
    skew = 1e-3 * jnp.array([[0.0, 1.0, 2.0], [-1.0, 0.0, 3.0], [-2.0, -3.0, 0.0]])
    s, vecs = linalg.safe_psd_eigh(psd + skew)  # the skew part is ignored
    np.testing.assert_allclose(jnp.sort(s), [0.0, 1.0, 2.0], atol=1e-12)
    assert float(jnp.min(s)) == 0.0
    np.testing.assert_allclose((vecs * s) @ vecs.T, psd, atol=2e-9)
    ev = linalg.safe_eigvalsh(psd + skew)
    assert float(jnp.min(ev)) == 0.0
    np.testing.assert_allclose(jnp.sort(ev), [0.0, 1.0, 2.0], atol=1e-12)
