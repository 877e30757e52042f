"""Convolution layers: patch moments, KFC/diagonal/full blocks, detection, registration, training."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.flatten_util import ravel_pytree

import curvax
from curvax import blocks, datasets, tags, transforms
from curvax.layers import conv

pytestmark = pytest.mark.usefixtures("x64")


# ----------------------------------------------------------------------------------
# Oracles
# ----------------------------------------------------------------------------------


def dense_patches(x, k, strides, pads, lhs_dil, rhs_dil):
    """Every patch of a channels-last input as rows (offset major, channel minor), by explicit indexing."""
    x = np.asarray(x)
    n, *sp, c = x.shape
    dil = np.zeros((n, *[(s - 1) * d + 1 for s, d in zip(sp, lhs_dil)], c))
    dil[(slice(None), *(slice(None, None, d) for d in lhs_dil))] = x
    xp = np.pad(dil, [(0, 0), *pads, (0, 0)])
    outs = [(xp.shape[1 + i] - (k[i] - 1) * rhs_dil[i] - 1) // strides[i] + 1 for i in range(len(sp))]
    rows = []
    for b in range(n):
        for o in itertools.product(*map(range, outs)):
            offsets = itertools.product(*map(range, k))
            idx = [(b, *(o[i] * strides[i] + a[i] * rhs_dil[i] for i in range(len(sp)))) for a in offsets]
            rows.append(np.concatenate([xp[i] for i in idx]))
    return np.array(rows), (n, *outs)


def conv_fn(spec, bias_shape=None):
    """``y = conv(x, w) (+ b)`` with the bias on the output channel axis."""
    axis = spec.dimension_numbers.out_spec[1]

    def f(params, x):
        y = spec.conv(x, params[0])
        if len(params) == 2:
            shape = [1] * y.ndim
            shape[axis] = -1
            y = y + params[1].reshape(shape)
        return y

    return f


def per_example_grads(f, params, x, dy):
    """(B, dim): gradient of sum(y_n * dy_n) for every example (autodiff of the layer itself)."""

    def one(xn, dyn):
        g = jax.grad(lambda p: jnp.sum(f(p, xn[None]) * dyn[None]))(params)
        return jnp.concatenate([t.ravel() for t in g])

    return jax.jit(jax.vmap(one))(x, dy)


def sds(a):
    return jax.ShapeDtypeStruct(tuple(a.shape), a.dtype)


LAYOUTS = {
    "NHWC": (("NHWC", "HWIO", "NHWC"), lambda cout, cin, k: (*k, cin, cout)),
    "NCHW": (("NCHW", "OIHW", "NCHW"), lambda cout, cin, k: (cout, cin, *k)),
}


def make_layer(seed, layout, batch, spatial, cin, cout, k, bias, groups=1, bias_shape=None, **conv_kwargs):
    """Random conv layer: (eqn, f, params, x, dy, spec)."""
    dn, kshape = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    x_shape = (batch, *spatial, cin) if layout == "NHWC" else (batch, cin, *spatial)
    x = jnp.asarray(rng.standard_normal(x_shape))
    w = jnp.asarray(rng.standard_normal(kshape(cout, cin // groups, k)))
    params = (w,)
    if bias:
        params += (jnp.asarray(rng.standard_normal(bias_shape or (cout,))),)
    spec = conv.resolve_conv_spec(x.shape, w.shape, dimension_numbers=dn, feature_group_count=groups, **conv_kwargs)
    f = conv_fn(spec)
    y = f(params, x)
    dy = jnp.asarray(rng.standard_normal(y.shape))
    eqn = tags.LayerTagEqn(
        primitive=conv.conv2d, outputs=(sds(y),), inputs=(sds(x),), params=tuple(sds(p) for p in params),
        param_indices=tuple(range(len(params))), meta=spec.meta(), name="conv",
    )
    return eqn, f, params, x, dy, spec


def estimate(block_list, x, dy, params, batch_size):
    """[(dense matrix, state)] of each block after one update (one compilation for all)."""

    def run(x, dy, params):
        out = []
        for block in block_list:
            state = block.init(jax.random.PRNGKey(0), None, None, False)
            data = {"inputs": (x,), "outputs": (), "params": params, "outputs_tangent": (dy,), "params_tangent": ()}
            state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch_size)
            out.append((block.to_dense_matrix(state), state))
        return out

    return jax.jit(run)(x, dy, params)


def channels_last(a, layout):
    return a if layout == "NHWC" else jnp.moveaxis(a, 1, -1)


# ----------------------------------------------------------------------------------
# Patch moments
# ----------------------------------------------------------------------------------

PATCH_CONFIGS = [
    # spatial, kernel, strides, padding, lhs_dil, rhs_dil, data_format
    ((5, 6), (2, 3), (1, 1), "VALID", (1, 1), (1, 1), "NHWC"),
    ((6, 5), (3, 2), (2, 1), "SAME", (1, 1), (1, 1), "NCHW"),
    ((5, 5), (2, 2), (1, 2), ((1, 0), (2, 1)), (1, 1), (2, 1), "NHWC"),
    ((4, 4), (2, 2), (1, 1), ((1, 1), (0, 1)), (2, 1), (1, 1), "NCHW"),
    ((7,), (3,), (2,), "SAME", (1,), (1,), "NWC"),
]


@pytest.mark.parametrize("cfg", PATCH_CONFIGS, ids=lambda c: f"{c[6]}-{c[3]}-s{c[2]}-d{c[4]}{c[5]}")
def test_patches_moments_equal_dense_patch_sums(cfg):
    spatial, k, strides, padding, lhs_dil, rhs_dil, fmt = cfg
    rng = np.random.default_rng(len(spatial) + sum(k))
    x = rng.standard_normal((2, *spatial, 3))
    xin = jnp.asarray(x if fmt.endswith("C") else np.moveaxis(x, -1, 1))
    kernel = (1, 3, *k)
    spec = conv.resolve_conv_spec(
        xin.shape, kernel, window_strides=strides, padding=padding, lhs_dilation=lhs_dil, rhs_dilation=rhs_dil,
        dimension_numbers=(fmt, "OI" + fmt[-len(spatial) - 1 : -1] if fmt.endswith("C") else "OI" + fmt[2:], fmt),
    )
    p, out = dense_patches(x, k, strides, spec.padding, lhs_dil, rhs_dil)
    weights = rng.random(out)
    kw = dict(strides=strides, padding=padding, data_format=fmt, inputs_dilation=lhs_dil, kernel_dilation=rhs_dil)
    d = p.shape[1]
    kk = int(np.prod(k))

    wr = weights.reshape(-1, 1)
    full = (p.T @ p).reshape(kk, 3, kk, 3)
    depthwise = np.stack([full[:, c, :, c] for c in range(3)], -1)  # one group per channel: equal channels only
    for fn in (conv.patches_moments, conv.patches_moments_explicit):
        (m, v), (mw, vw), (md, vd) = jax.jit(lambda x, w: (
            fn(x, k, **kw), fn(x, k, weighting_array=w, **kw), fn(x, k, feature_group_count=3, **kw)
        ))(xin, jnp.asarray(weights))
        assert m.shape == (*k, 3, *k, 3) and v.shape == (*k, 3) and md.shape == (*k, *k, 3)
        np.testing.assert_allclose(np.reshape(m, (d, d)), p.T @ p, atol=1e-10)
        np.testing.assert_allclose(np.ravel(v), p.sum(0), atol=1e-10)
        np.testing.assert_allclose(np.reshape(mw, (d, d)), p.T @ (wr * p), atol=1e-10)
        np.testing.assert_allclose(np.ravel(vw), (wr * p).sum(0), atol=1e-10)
        np.testing.assert_allclose(np.reshape(md, (kk, kk, 3)), depthwise, atol=1e-10)
        np.testing.assert_allclose(vd, v, atol=1e-10)
    # A memory bound of kk - 1 offsets per chunk: two chunks, the second padded; looped and unrolled.
    old = blocks.get_max_parallel_elements()
    blocks.set_max_parallel_elements((kk - 1) * p.shape[0] * 3)
    try:
        (mw, vw), (md, _) = jax.jit(lambda x, w: (
            conv.patches_moments(x, k, weighting_array=w, unroll_loop=len(spatial) == 1, **kw),
            conv.patches_moments(x, k, feature_group_count=3, **kw),
        ))(xin, jnp.asarray(weights))
    finally:
        blocks.set_max_parallel_elements(old)
    np.testing.assert_allclose(np.reshape(mw, (d, d)), p.T @ (wr * p), atol=1e-10)
    np.testing.assert_allclose(np.ravel(vw), (wr * p).sum(0), atol=1e-10)
    np.testing.assert_allclose(np.reshape(md, (kk, kk, 3)), depthwise, atol=1e-10)


@pytest.mark.parametrize("cfg", PATCH_CONFIGS + [
    ((4, 5, 3), (2, 1, 2), (1, 2, 1), "SAME", (1, 1, 2), (1, 1, 1), "NDHWC"),
    ((6, 6), (3, 3), (1, 1), ((-1, 2), (0, -1)), (1, 1), (1, 1), "NHWC"),
], ids=lambda c: f"{c[6]}-{c[3]}-s{c[2]}-d{c[4]}{c[5]}")
def test_sliced_patches_are_the_one_hot_convolution_patches(cfg):
    """The KFC block's patches (pad + strided slices) are exactly those of
    ``conv_general_dilated_patches`` (and of the dense indexing oracle, where padding is not
    negative), in the kernel's (offset, channel) order, for every layout and dilation."""
    spatial, k, strides, padding, lhs_dil, rhs_dil, fmt = cfg
    rng = np.random.default_rng(len(spatial) + sum(k))
    x = rng.standard_normal((2, *spatial, 3))
    channels_first = not fmt.endswith("C")
    xin = jnp.asarray(np.moveaxis(x, -1, 1) if channels_first else x)
    sp = fmt[2:] if channels_first else fmt[1:-1]
    spec = conv.resolve_conv_spec(
        xin.shape, (1, 3, *k), window_strides=strides, padding=padding, lhs_dilation=lhs_dil, rhs_dilation=rhs_dil,
        dimension_numbers=(fmt, "OI" + sp, fmt),
    )
    got = jax.jit(lambda a: conv._sliced_patches(a, spec, k))(xin)
    kk = int(np.prod(k))
    old = conv._canonical_out(conv._conv_patches(xin, spec, k), spec)  # features (channel, offset)
    want = np.swapaxes(np.reshape(old, (*old.shape[:-1], 3, kk)), -1, -2)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    if all(lo >= 0 and hi >= 0 for lo, hi in spec.padding):
        p, out = dense_patches(x, k, strides, spec.padding, lhs_dil, rhs_dil)
        np.testing.assert_array_equal(np.reshape(got, (-1, kk * 3)), p)


def test_patches_moments_bad_arguments():
    x = jnp.zeros((2, 5, 5, 3))
    with pytest.raises(ValueError, match="data_format"):
        conv.patches_moments(x, 2, data_format="HWCN")
    with pytest.raises(ValueError, match="feature_group_count"):
        conv.patches_moments(x, 2, feature_group_count=2)
    with pytest.raises(ValueError, match="batch_group_count"):
        conv.patches_moments_explicit(x, 2, batch_group_count=2)
    with pytest.raises(ValueError, match="kernel_spatial_shape"):
        conv.patches_moments(x, (2, 2, 2))
    with pytest.raises(ValueError, match="weighting_array"):
        conv.patches_moments(x, 2, weighting_array=jnp.ones((2, 3)))


# ----------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,bias_shape", [("NHWC", None), ("NCHW", False)])
def test_single_example_single_location_kfc_is_the_exact_fisher_block(layout, bias_shape):
    """One example, one output location: A (x) G equals J^T H J built from jax.jacobian."""
    bias = bias_shape is not False
    eqn, f, params, x, _, spec = make_layer(0, layout, 1, (3, 3), 2, 3, (3, 3), bias, bias_shape=bias_shape or None)
    flat, unravel = ravel_pytree(params)
    jac = jax.jacobian(lambda q: f(unravel(q), x).ravel())(flat)  # (3, dim): one location, 3 channels
    factor = jnp.asarray(np.random.default_rng(3).standard_normal((3, 3)))
    fisher = jac.T @ (factor @ factor.T) @ jac
    # E[dy dy^T] = H = L L^T: feed the columns of L as the cotangents of copies of the example.
    xs = jnp.concatenate([x] * 3)
    dys = factor.T.reshape(3, *f(params, x).shape[1:])
    kinds = (conv.Conv2DTwoKroneckerFactored, conv.Conv2DFull, conv.Conv2DDiagonal)
    (kf, _), (full, _), (diag, _) = estimate([c(eqn, "c") for c in kinds], xs, dys, params, batch_size=1)
    np.testing.assert_allclose(kf, fisher, atol=1e-10)
    np.testing.assert_allclose(full, fisher, atol=1e-10)
    np.testing.assert_allclose(diag, jnp.diag(jnp.diag(fisher)), atol=1e-10)


BLOCK_CONFIGS = [
    dict(layout="NHWC", bias=True, padding="SAME"),
    dict(layout="NCHW", bias=True, padding="VALID", window_strides=(2, 1), lhs_dilation=(1, 2), bias_shape=(4, 1, 1)),
    dict(layout="NHWC", bias=False, padding=((1, 0), (0, 1)), rhs_dilation=(2, 1)),
]


def configured_layer(cfg, seed, batch):
    """A 5x4 two-channel input, four 3x2 filters, configured by one of ``BLOCK_CONFIGS``; plus per-example grads."""
    cfg = dict(cfg)
    layout, bias = cfg.pop("layout"), cfg.pop("bias")
    eqn, f, params, x, dy, spec = make_layer(seed, layout, batch, (5, 4), 2, 4, (3, 2), bias, **cfg)
    return eqn, f, params, x, dy, spec, per_example_grads(f, params, x, dy)


@pytest.mark.parametrize("cfg", BLOCK_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_conv_blocks_match_per_example_definitions(cfg):
    batch, layout, bias = 3, cfg["layout"], cfg["bias"]
    eqn, f, params, x, dy, spec, g = configured_layer(cfg, 1, batch)

    kf = conv.Conv2DTwoKroneckerFactored(eqn, "c")
    diag = conv.Conv2DDiagonal(eqn, "c", max_elements_for_vmap=1)  # one example per chunk
    (f_dense, _), (d_dense, _), (dense, state) = estimate([conv.Conv2DFull(eqn, "c"), diag, kf], x, dy, params, batch)
    np.testing.assert_allclose(f_dense, g.T @ g / batch, atol=1e-10)
    np.testing.assert_allclose(d_dense, jnp.diag(jnp.diag(f_dense)), atol=1e-10)
    p, out = dense_patches(channels_last(x, layout), (3, 2), spec.window_strides, spec.padding,
                           spec.lhs_dilation, spec.rhs_dilation)
    if bias:
        p = np.concatenate([p, np.ones((p.shape[0], 1))], 1)
    a = p.T @ p / p.shape[0]
    dy2 = channels_last(dy, layout).reshape(-1, 4)
    gg = dy2.T @ dy2 / batch
    np.testing.assert_allclose(state.inputs_factor.value, a, atol=1e-10)
    np.testing.assert_allclose(state.outputs_factor.value, gg, atol=1e-10)
    assert kf.num_locations == int(np.prod(out[1:])) and kf.input_size() == 3 * 2 * 2 + bias
    # The dense matrix in parameter order is A (x) G on V = [W as (kh, kw, in) x out; b].
    vec = tuple(jnp.asarray(np.random.default_rng(i).standard_normal(s.shape)) for i, s in enumerate(eqn.params))
    w_hwio = vec[0] if layout == "NHWC" else jnp.transpose(vec[0], (2, 3, 1, 0))
    v = w_hwio.reshape(-1, 4)
    if bias:
        v = jnp.concatenate([v, vec[1].reshape(1, 4)])
    got = kf.array_to_parameters_shaped_list(a @ v @ gg)
    want = dense @ jnp.concatenate([t.ravel() for t in vec])
    np.testing.assert_allclose(jnp.concatenate([t.ravel() for t in got]), want, atol=1e-10)
    np.testing.assert_allclose(kf.parameters_shaped_list_to_array(vec), v)
    # The optimizer's product path agrees with the dense matrix.
    prod = jax.jit(lambda st, v: kf.multiply(st, v, 0.5, exact_power=True, use_cached=False))(state, vec)
    np.testing.assert_allclose(jnp.concatenate([t.ravel() for t in prod]),
                               want + 0.5 * jnp.concatenate([t.ravel() for t in vec]), atol=1e-10)


def tnt_factors(p, dy2, batch, per_location):
    """TNT's factors from patch rows ``p`` (with the bias's 1) and cotangent rows ``dy2`` (same order)."""
    w = np.sum(dy2**2, axis=1)
    s = np.sum(p**2, axis=1)
    if not per_location:  # every location weighed by its example's sums
        w = np.repeat(w.reshape(batch, -1).sum(1), len(w) // batch)
        s = np.repeat(s.reshape(batch, -1).sum(1), len(s) // batch)
    return (p * w[:, None]).T @ p / len(p), (dy2 * s[:, None]).T @ dy2 / len(p)


@pytest.mark.parametrize("per_location", [True, False])
@pytest.mark.parametrize("cfg", BLOCK_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_conv_tnt_matches_its_definition(cfg, per_location):
    """kfac-jax 0.0.8's Conv2DTNT: per-location (or per-example) weighted factors and
    ``C = T (A (x) G) / sqrt(tr A tr G)``, against explicit patches and the layer's cotangents."""
    batch, layout, bias = 3, cfg["layout"], cfg["bias"]
    eqn, f, params, x, dy, spec, _ = configured_layer(cfg, 1, batch)
    block = curvax.Conv2DTNT(eqn, "c", weighting_per_location=per_location)
    ((dense, state),) = estimate([block], x, dy, params, batch)
    p, out = dense_patches(channels_last(x, layout), (3, 2), spec.window_strides, spec.padding,
                           spec.lhs_dilation, spec.rhs_dilation)
    if bias:
        p = np.concatenate([p, np.ones((p.shape[0], 1))], 1)
    a, gg = tnt_factors(p, np.asarray(channels_last(dy, layout)).reshape(-1, 4), batch, per_location)
    np.testing.assert_allclose(state.inputs_factor.value, a, rtol=1e-10)
    np.testing.assert_allclose(state.outputs_factor.value, gg, rtol=1e-10)
    locations = int(np.prod(out[1:]))
    assert block.fixed_scale() == locations
    scale = locations / np.sqrt(np.trace(a) * np.trace(gg))
    vec = tuple(jnp.asarray(np.random.default_rng(i).standard_normal(s.shape)) for i, s in enumerate(eqn.params))
    v = block.parameters_shaped_list_to_array(vec)
    got = block.array_to_parameters_shaped_list(scale * (a @ v @ gg))
    np.testing.assert_allclose(jnp.concatenate([t.ravel() for t in got]),
                               dense @ jnp.concatenate([t.ravel() for t in vec]), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("per_location", [True, False])
def test_conv_tnt_of_one_example_at_one_location_is_its_gradients_outer_product(per_location):
    eqn, f, params, x, dy, _ = make_layer(4, "NCHW", 1, (3, 3), 2, 3, (3, 3), True)
    g = per_example_grads(f, params, x, dy)[0]
    ((dense, _),) = estimate([curvax.Conv2DTNT(eqn, weighting_per_location=per_location)], x, dy, params, 1)
    np.testing.assert_allclose(dense, jnp.outer(g, g), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("chunk_examples", [1, 2])  # 2 of 3 examples: the last chunk is filled with a zero example
def test_conv_tnt_over_chunks_of_examples_equals_one_pass(monkeypatch, chunk_examples):
    cfg = BLOCK_CONFIGS[0]  # SAME padding, with a bias: a zero example still has patches [0; 1]
    eqn, f, params, x, dy, spec, _ = configured_layer(cfg, 2, 3)
    ctor = lambda: [curvax.Conv2DTNT(eqn, "c", weighting_per_location=w) for w in (True, False)]  # noqa: E731
    whole = estimate(ctor(), x, dy, params, 3)
    per_example = (3 * 2 * 2 + 1) * curvax.Conv2DTNT(eqn, "c").num_locations
    monkeypatch.setattr(conv, "_CPU_PATCH_CHUNK_ELEMENTS", chunk_examples * per_example)
    chunked = estimate(ctor(), x, dy, params, 3)
    for (d1, s1), (d2, s2) in zip(whole, chunked):
        np.testing.assert_allclose(s2.inputs_factor.value, s1.inputs_factor.value, rtol=1e-12)
        np.testing.assert_allclose(s2.outputs_factor.value, s1.outputs_factor.value, rtol=1e-12)
        np.testing.assert_allclose(d2, d1, rtol=1e-11, atol=1e-13)


def test_conv_tnt_arguments():
    eqn, *_ = make_layer(0, "NHWC", 2, (4, 4), 2, 3, (2, 2), True)
    assert curvax.Conv2DTNT(eqn).weighting_per_location  # kfac-jax's default
    with pytest.raises(TypeError, match="by keyword"):
        curvax.Conv2DTNT(eqn, False)  # kfac-jax's positional flag: curvax blocks take `name` second
    with pytest.raises(TypeError, match="weighting_per_location"):
        curvax.Conv2DTNT(eqn, "c", weighting_per_location="no")
    grouped, *_ = make_layer(0, "NHWC", 2, (4, 4), 4, 6, (2, 2), True, groups=2)
    with pytest.raises(ValueError, match="feature_group_count"):
        curvax.Conv2DTNT(grouped, "c")
    assert curvax.kfac_api.curvature_blocks.Conv2DTNT is curvax.Conv2DTNT


def test_conv_tnt_drives_the_optimizer():
    """Selected for every conv2d layer by ``layer_tag_to_block_ctor``, it trains a small CNN."""
    loss, params, batch = plain_cnn(jax.random.PRNGKey(0))
    opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=0.0, learning_rate_schedule=lambda s: 0.1,
                           damping_schedule=lambda s: 1e-2, momentum_schedule=lambda s: 0.0,
                           layer_tag_to_block_ctor={"conv2d": curvax.Conv2DTNT}, num_burnin_steps=0)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    assert any(isinstance(b, curvax.Conv2DTNT) for b in opt.estimator.blocks)
    losses = []
    for i in range(6):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=batch)
        losses.append(float(stats["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_grouped_convolution_blocks_and_defaults():
    batch = 3
    eqn, f, params, x, dy, _ = make_layer(2, "NHWC", batch, (4, 4), 4, 6, (2, 2), True, groups=2, padding="SAME")
    g = per_example_grads(f, params, x, dy)
    assert isinstance(blocks.get_default_tag_to_block_ctor("conv2d")(eqn, "c"), conv.ConvGroupedTwoKroneckerFactored)
    (full, _), (diag, _) = estimate([conv.Conv2DFull(eqn, "c"), conv.Conv2DDiagonal(eqn, "c")], x, dy, params, batch)
    np.testing.assert_allclose(full, g.T @ g / batch, atol=1e-10)
    np.testing.assert_allclose(diag, jnp.diag(jnp.diag(full)), atol=1e-10)
    with pytest.raises(ValueError, match="feature_group_count"):
        conv.Conv2DTwoKroneckerFactored(eqn, "c")
    plain, _, params, x, dy, _ = make_layer(2, "NHWC", batch, (4, 4), 4, 6, (2, 2), True)
    assert isinstance(blocks.get_default_tag_to_block_ctor("conv2d")(plain, "c"), conv.Conv2DTwoKroneckerFactored)
    # With one group the grouped block is the plain KFC block.
    (a, _), (b, _) = estimate([conv.ConvGroupedTwoKroneckerFactored(plain, "c"), conv.Conv2DTwoKroneckerFactored(plain, "c")],
                              x, dy, params, batch)
    np.testing.assert_allclose(a, b, atol=1e-12)
    with pytest.raises(ValueError, match="2-D"):
        conv.Conv2DDiagonal(conv1d_eqn(), "c")
    assert isinstance(blocks.get_default_tag_to_block_ctor("conv1d")(conv1d_eqn(), "c"), conv.ConvTwoKroneckerFactored)


@pytest.mark.parametrize("one_location", [True, False])
def test_grouped_kronecker_is_kfc_per_group(one_location):
    """Per-group A_g (x) G_g: the within-group part of the exact Fisher for one example and one location."""
    groups, cin, cout, k = 2, 4, 6, (2, 2)
    batch, spatial = (1, k) if one_location else (3, (4, 3))
    eqn, f, params, x, dy, spec = make_layer(4, "NHWC", batch, spatial, cin, cout, k, True, groups=groups)
    if one_location:
        factor = jnp.asarray(np.random.default_rng(5).standard_normal((cout, cout)))
        x, dy = jnp.concatenate([x] * cout), factor.T.reshape(cout, 1, 1, cout)
    block = conv.ConvGroupedTwoKroneckerFactored(eqn, "c")
    ((dense, state),) = estimate([block], x, dy, params, batch)
    # Group of every parameter entry: the output channel's group (kernel HWIO, then bias).
    out_ch = np.concatenate([np.broadcast_to(np.arange(cout), params[0].shape).ravel(), np.arange(cout)])
    same = (out_ch[:, None] // (cout // groups)) == (out_ch[None, :] // (cout // groups))
    if one_location:
        flat, unravel = ravel_pytree(params)
        jac = jax.jacobian(lambda q: f(unravel(q), x[:1]).ravel())(flat)
        np.testing.assert_allclose(dense, jac.T @ factor @ factor.T @ jac * same, atol=1e-10)
        return
    ci, co = cin // groups, cout // groups
    want = np.zeros_like(np.asarray(dense))
    w_index = np.arange(params[0].size).reshape(params[0].shape)
    for g in range(groups):
        p, _ = dense_patches(x[..., g * ci : (g + 1) * ci], k, (1, 1), spec.padding, (1, 1), (1, 1))
        p = np.concatenate([p, np.ones((p.shape[0], 1))], 1)
        dyg = np.asarray(dy[..., g * co : (g + 1) * co]).reshape(-1, co)
        idx = np.concatenate([w_index[..., g * co : (g + 1) * co].ravel(), params[0].size + np.arange(g * co, (g + 1) * co)])
        want[np.ix_(idx, idx)] = np.kron(p.T @ p / p.shape[0], dyg.T @ dyg / batch)
    np.testing.assert_allclose(dense, want, atol=1e-10)
    # Products, inverses (exact and cached) and eigenvalues agree with the dense matrix.
    vec = tuple(jnp.asarray(np.random.default_rng(i).standard_normal(s.shape)) for i, s in enumerate(eqn.params))
    flat_v = jnp.concatenate([t.ravel() for t in vec])

    def products(state, vec):
        st = block.update_cache(state, 0.3, exact_powers=-1, approx_powers=None, eigenvalues=False)
        return (block.multiply(state, vec, 0.3, True, False), block.multiply_inverse(st, vec, 0.3, True, True),
                block.eigenvalues(state, False))

    prod, inv, eigs = jax.jit(products)(state, vec)
    damped = want + 0.3 * np.eye(len(want))
    np.testing.assert_allclose(jnp.concatenate([t.ravel() for t in prod]), damped @ flat_v, atol=1e-10)
    np.testing.assert_allclose(jnp.concatenate([t.ravel() for t in inv]), np.linalg.solve(damped, flat_v), atol=1e-8)
    np.testing.assert_allclose(np.sort(eigs), np.linalg.eigvalsh(want), atol=1e-10)


def conv1d_eqn():
    x, w = jnp.zeros((2, 6, 3)), jnp.zeros((3, 3, 4))
    spec = conv.resolve_conv_spec(x.shape, w.shape)
    y = jax.eval_shape(spec.conv, x, w)
    return tags.LayerTagEqn(conv.conv1d, (sds(y),), (sds(x),), (sds(w),), (0,), spec.meta(), "c1")


# ----------------------------------------------------------------------------------
# Detection on every framework's CNN (conv + pooling + dense)
# ----------------------------------------------------------------------------------

B, HW, CIN, COUT, NCLS = 2, 6, 1, 3, 4


def _ce(logits, labels):
    curvax.register_softmax_cross_entropy_loss(logits, labels)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def _cnn_batch(channels_first=False, dtype=jnp.float32):
    # The parameters' dtype (flax/haiku keep float32 under x64; a mismatch makes dense layers cast their weights).
    x = np.random.default_rng(0).standard_normal((B, CIN, HW, HW) if channels_first else (B, HW, HW, CIN))
    x = jnp.asarray(x, dtype)
    return x, jnp.arange(B) % NCLS


def plain_cnn(key):
    rng = np.random.default_rng(1)
    f32 = np.float32
    params = {"conv": {"w": jnp.asarray(rng.standard_normal((3, 3, CIN, COUT)), f32), "b": jnp.zeros(COUT, f32)},
              "out": {"w": jnp.asarray(rng.standard_normal((COUT * 9, NCLS)) / 4, f32), "b": jnp.zeros(NCLS, f32)}}

    def loss(p, batch):
        h = lax.conv_general_dilated(batch[0], p["conv"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = jax.nn.relu(h + p["conv"]["b"])
        h = lax.reduce_window(h, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
        return _ce(h.reshape(B, -1) @ p["out"]["w"] + p["out"]["b"], batch[1])

    return loss, params, _cnn_batch()


def linen_cnn(key):
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.avg_pool(nn.relu(nn.Conv(COUT, (3, 3))(x)), (2, 2), (2, 2))
            return nn.Dense(NCLS)(h.reshape(h.shape[0], -1))

    model, batch = CNN(), _cnn_batch()
    return (lambda p, b: _ce(model.apply(p, b[0]), b[1])), model.init(key, batch[0]), batch


def nnx_cnn(key):
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(CIN, COUT, (3, 3), rngs=rngs)
            self.out = nnx.Linear(COUT * 9, NCLS, rngs=rngs)

        def __call__(self, x):
            h = nnx.max_pool(nnx.relu(self.conv(x)), (2, 2), (2, 2))
            return self.out(h.reshape(h.shape[0], -1))

    graphdef, state = nnx.split(CNN(nnx.Rngs(0)))
    return (lambda p, b: _ce(nnx.merge(graphdef, p)(b[0]), b[1])), state, _cnn_batch()


def haiku_cnn(key):
    import haiku as hk

    def forward(x):
        h = jax.nn.relu(hk.Conv2D(COUT, 3)(x))
        h = hk.avg_pool(h, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return hk.Linear(NCLS)(hk.Flatten()(h))

    model, batch = hk.without_apply_rng(hk.transform(forward)), _cnn_batch()
    return (lambda p, b: _ce(model.apply(p, b[0]), b[1])), model.init(key, batch[0]), batch


def equinox_cnn(key):
    import equinox as eqx

    k1, k2 = jax.random.split(key)
    model = eqx.nn.Sequential([
        eqx.nn.Conv2d(CIN, COUT, 3, padding=1, key=k1), eqx.nn.Lambda(jax.nn.relu), eqx.nn.AvgPool2d(2, 2),
        eqx.nn.Lambda(jnp.ravel), eqx.nn.Linear(COUT * 9, NCLS, key=k2),
    ])
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return (lambda p, b: _ce(jax.vmap(eqx.combine(p, static))(b[0]), b[1])), params, _cnn_batch(True, jnp.float64)


FRAMEWORK_CNNS = {"plain_jax": plain_cnn, "flax_linen": linen_cnn, "flax_nnx": nnx_cnn, "haiku": haiku_cnn,
                  "equinox": equinox_cnn}


@pytest.mark.parametrize("framework", sorted(FRAMEWORK_CNNS))
def test_framework_cnn_detects_conv_and_dense(framework):
    loss_fn, params, batch = FRAMEWORK_CNNS[framework](jax.random.PRNGKey(0))
    f = curvax.layer_tags_vjp(loss_fn)
    losses, vjp = f((params, batch))
    data = vjp([(jnp.asarray(np.random.default_rng(1).standard_normal((B, NCLS)), batch[0].dtype),)])
    pj = f.processed_jaxpr.first
    assert sorted(s.pattern for s in pj.layer_sites) == ["conv2d_with_bias", "dense_with_bias"]
    assert sorted(i for s in pj.layer_sites for i in s.param_indices) == list(range(len(jax.tree_util.tree_leaves(params))))
    j = next(i for i, s in enumerate(pj.layer_sites) if s.tag is conv.conv2d)
    eqn, d = pj.layer_tags[j], data[j]
    # The tag's meta reproduces the layer: conv(inputs, w) + b equals the recorded output.
    spec = conv.spec_from_meta(eqn.meta, eqn.inputs[0].shape, eqn.params[0].shape, "test")
    np.testing.assert_allclose(conv_fn(spec)(d["params"], d["inputs"][0]), d["outputs"][0], rtol=1e-5, atol=1e-5)
    assert d["outputs_tangent"][0].shape == d["outputs"][0].shape
    block = blocks.get_default_tag_to_block_ctor(eqn.primitive)(eqn, "c")
    assert isinstance(block, conv.Conv2DTwoKroneckerFactored)
    ((dense, _),) = estimate([block], d["inputs"][0], d["outputs_tangent"][0], d["params"], B)
    assert np.all(np.isfinite(dense)) and float(jnp.trace(dense)) > 0


@pytest.mark.parametrize("n", [1, 3])
def test_conv1d_and_conv3d_are_detected_through_kernel_casts(n):
    x = jnp.ones((2, 3) + (4,) * n, jnp.float32)  # channels first
    w = jnp.ones((2, 3) + (2,) * n, jnp.float64)  # cast to float32 in the model (mixed precision)
    sp = "DHW"[-n:] if n > 1 else "W"
    dn = ("NC" + sp, "OI" + sp, "NC" + sp)

    def loss(p, x):
        y = lax.conv_general_dilated(x, p["w"].astype(jnp.float32), (1,) * n, "VALID", dimension_numbers=dn)
        out = y.reshape(2, -1)
        curvax.register_squared_error_loss(out, jnp.zeros_like(out))
        return jnp.sum(out**2)

    pj = transforms.ProcessedJaxpr.make_from_func(loss, ({"w": w}, x))
    assert [s.pattern for s in pj.layer_sites] == [f"conv{n}d_no_bias"]
    assert isinstance(blocks.get_default_tag_to_block_ctor(f"conv{n}d")(pj.layer_tags[0], "c"), conv.ConvTwoKroneckerFactored)


# ----------------------------------------------------------------------------------
# Manual registration
# ----------------------------------------------------------------------------------


def test_register_conv2d_manual_tag_and_errors():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 5, 5)))
    params = {"w": jnp.asarray(rng.standard_normal((4, 3, 2, 2))), "b": jnp.ones(4)}
    kw = dict(window_strides=(2, 2), padding="SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))

    def loss(p, x):
        y = lax.conv_general_dilated(x, p["w"], **kw) + p["b"][:, None, None]
        y = conv.register_conv2d(y, x, p["w"], p["b"], **kw)
        out = y.reshape(2, -1)
        curvax.register_squared_error_loss(out, jnp.zeros_like(out))
        return jnp.sum(out**2)

    f = curvax.layer_tags_vjp(loss)
    losses, vjp = f((params, x))
    pj = f.processed_jaxpr.first
    (site,) = pj.layer_sites
    assert site.pattern == "manual" and site.tag is conv.conv2d and site.param_indices == (1, 0)
    assert pj.layer_tags[0].meta["padding"] == ((0, 1), (0, 1))
    d = vjp([(jnp.ones(losses[0].parameter_dependants[0].shape),)])[0]
    block = conv.Conv2DFull(pj.layer_tags[0], "c")
    spec = block.conv_spec
    g = per_example_grads(conv_fn(spec), d["params"], d["inputs"][0], d["outputs_tangent"][0])
    ((got, _),) = estimate([block], d["inputs"][0], d["outputs_tangent"][0], d["params"], 2)
    np.testing.assert_allclose(got, g.T @ g / 2, atol=1e-10)

    y = lax.conv_general_dilated(x, params["w"], **kw)
    with pytest.raises(ValueError, match="y has shape"):
        conv.register_conv2d(y[:, :, :2], x, params["w"], **kw)
    with pytest.raises(ValueError, match="padding"):
        conv.register_conv2d(y, x, params["w"], **{**kw, "padding": "FULL"})
    with pytest.raises(TypeError, match="unknown keyword"):
        conv.register_conv2d(y, x, params["w"], stride=2, **kw)
    with pytest.raises(ValueError, match="b must hold"):
        conv.register_conv2d(y, x, params["w"], jnp.ones(3), **kw)
    with pytest.raises(ValueError, match="rank 4"):
        conv.register_conv2d(y, x[0], params["w"], **kw)
    with pytest.raises(ValueError, match="window_strides"):
        conv.register_conv2d(y, x, params["w"], **{**kw, "window_strides": (0, 2)})
    with pytest.raises(ValueError, match="dimension_numbers"):
        conv.register_conv2d(y, x, params["w"], **{**kw, "dimension_numbers": ("NCHW", "XYZW", "NCHW")})


# ----------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------


def test_kfac_trains_a_small_cnn_on_mnist_faster_than_sgd():
    images = datasets.load_mnist_images(16).reshape(16, 28, 28)
    x = jnp.asarray(images.reshape(16, 7, 4, 7, 4).mean((2, 4))[..., None])  # 7x7 averages
    y = jnp.asarray(datasets.load_mnist_labels(16))
    rng = np.random.default_rng(0)
    f32 = np.float32
    params = {"conv": {"w": jnp.asarray(rng.standard_normal((3, 3, 1, 4)) / 3, f32), "b": jnp.zeros(4, f32)},
              "out": {"w": jnp.asarray(rng.standard_normal((100, 10)) / 10, f32), "b": jnp.zeros(10, f32)}}

    def loss(p, batch):
        h = lax.conv_general_dilated(batch[0], p["conv"]["w"], (1, 1), "VALID",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = jnp.tanh(h + p["conv"]["b"]).reshape(batch[0].shape[0], -1)
        return _ce(h @ p["out"]["w"] + p["out"]["b"], batch[1])

    batch, steps = (x, y), 10
    # Damped natural-gradient steps (lr 1, no momentum) with inverses refreshed every step.
    opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=0.0, learning_rate_schedule=lambda s: 1.0,
                           momentum_schedule=lambda s: 0.0, damping_schedule=lambda s: 0.1,
                           num_burnin_steps=0, inverse_update_period=1)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    assert sorted(type(b).__name__ for b in opt._estimator.blocks) == ["Conv2DTwoKroneckerFactored", "DenseTwoKroneckerFactored"]
    p = params
    for i in range(steps):
        p, state, _ = opt.step(p, state, jax.random.PRNGKey(i), batch=batch)
    value = jax.jit(loss)
    kfac_loss = float(value(p, batch))

    sgd_step = jax.jit(lambda q, lr: jax.tree_util.tree_map(lambda a, g: a - lr * g, q, jax.grad(loss)(q, batch)))
    sgd_losses = []
    for lr in (0.3, 1.0, 1.5, 2.0):  # 1.5 is best; 2.0 diverges
        q = params
        for _ in range(steps):
            q = sgd_step(q, lr)
        sgd_losses.append(float(value(q, batch)))
    initial = float(value(params, batch))
    assert min(sgd_losses) < initial and kfac_loss < 0.5 * min(sgd_losses)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("max_elements", [2**23, 200, 720])
def test_kfc_patch_statistics_equal_patches_moments_with_and_without_chunking(layout, max_elements):
    """The KFC block's fast patch Gram (explicit, batch-chunked: 6 chunks of 1 example, or 1 of 4
    and a remainder of 2) equals ``patches_moments``."""
    from curvax.layers import conv as conv_lib

    x = jax.random.normal(jax.random.PRNGKey(5), (6, 5, 5, 3) if layout == "NHWC" else (6, 3, 5, 5))
    dn = (layout, "HWIO", layout)
    spec = conv_lib.resolve_conv_spec(
        x.shape, (2, 2, 3, 4), window_strides=(2, 1), padding="SAME", rhs_dilation=(1, 2), dimension_numbers=dn,
    )
    want_m, want_v = curvax.patches_moments(x, (2, 2), (2, 1), "SAME", None, dn, kernel_dilation=(1, 2))
    old = curvax.blocks.get_max_parallel_elements()
    curvax.blocks.set_max_parallel_elements(max_elements)
    try:
        m, v = conv_lib._patch_gram(x, spec, (2, 2), 3)
    finally:
        curvax.blocks.set_max_parallel_elements(old)
    np.testing.assert_allclose(m, want_m.reshape(12, 12), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(v, want_v.reshape(12), rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------
# EKFAC for convolutions
# ----------------------------------------------------------------------------------


def _ekfac_state(block, x, dy, params, batch_size):
    """Statistics, the eigenbasis of those statistics, then ``s`` measured in that basis."""

    def run(x, dy, params):
        data = {"inputs": (x,), "outputs": (), "params": params, "outputs_tangent": (dy,), "params_tangent": ()}
        state = block.init(jax.random.PRNGKey(0), None, None, False)
        state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch_size)
        state = block.update_cache(state, 0.0, None, None, False)
        state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch_size)
        return block.to_dense_matrix(state), state

    return jax.jit(run)(x, dy, params)


def test_conv_ekfac_equals_kfc_where_kfc_is_exact():
    eqn, f, params, x, dy, _ = make_layer(0, "NHWC", 1, (3, 3), 2, 3, (3, 3), True)
    g = per_example_grads(f, params, x, dy)
    ekfac, _ = _ekfac_state(conv.Conv2DEigenvalueCorrected(eqn, "e"), x, dy, params, 1)
    ((kfc, _),) = estimate([conv.Conv2DTwoKroneckerFactored(eqn, "k")], x, dy, params, 1)
    np.testing.assert_allclose(ekfac, kfc, atol=1e-10)
    np.testing.assert_allclose(ekfac, g.T @ g, atol=1e-10)


@pytest.mark.parametrize("cfg", BLOCK_CONFIGS[:2], ids=lambda c: c["layout"])
def test_conv_ekfac_is_never_further_from_the_fisher_than_kfc(cfg):
    batch = 4
    eqn, f, params, x, dy, _, g = configured_layer(cfg, 5, batch)
    fisher = np.asarray(g.T @ g / batch)
    block = conv.Conv2DEigenvalueCorrected(eqn, "e", max_elements_for_vmap=300)  # several chunks
    ekfac, state = _ekfac_state(block, x, dy, params, batch)
    ((kfc, _),) = estimate([conv.Conv2DTwoKroneckerFactored(eqn, "k")], x, dy, params, batch)
    err_ekfac, err_kfc = np.linalg.norm(ekfac - fisher), np.linalg.norm(kfc - fisher)
    assert err_ekfac < err_kfc
    # s is the Fisher's diagonal in the Kronecker eigenbasis.
    qa, qg = state.cache["inputs_factor_eigen_vectors"], state.cache["outputs_factor_eigen_vectors"]
    cols = [
        np.concatenate([np.ravel(a) for a in block.array_to_parameters_shaped_list(c.reshape(len(qa), len(qg)))])
        for c in np.kron(np.asarray(qa), np.asarray(qg)).T
    ]
    q = np.asarray(cols).T
    np.testing.assert_allclose(np.asarray(block.eigenvalues(state, False)), np.diag(q.T @ fisher @ q), atol=1e-9)
    # Damped inverse products equal the dense inverse.
    vec = tuple(jnp.asarray(np.random.default_rng(9).standard_normal(s)) for s in block.parameters_shapes)
    got = block.multiply_matpower(state, vec, 0.3, -1, exact_power=True, use_cached=False)
    want = np.linalg.solve(np.asarray(ekfac) + 0.3 * np.eye(len(fisher)), np.concatenate([np.ravel(v) for v in vec]))
    np.testing.assert_allclose(np.concatenate([np.ravel(v) for v in got]), want, rtol=1e-8, atol=1e-10)


def test_conv_ekfac_trains_in_the_optimizer():
    loss, params, batch = plain_cnn(jax.random.PRNGKey(0))
    opt = curvax.Optimizer(
        jax.value_and_grad(loss), l2_reg=0.0, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
        use_adaptive_damping=True, initial_damping=1.0, inverse_update_period=1,
        layer_tag_to_block_ctor={"conv2d": curvax.Conv2DEigenvalueCorrected},
    )
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    assert "Conv2DEigenvalueCorrected" in opt.registration_table()
    losses = []
    for i in range(4):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=batch)
        losses.append(float(stats["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
