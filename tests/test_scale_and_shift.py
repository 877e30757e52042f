"""Scale-and-shift layers: blocks against the exact per-example Fisher, detection in every framework."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import blocks, tags, transforms
from curvax.layers import scale_and_shift as ss

pytestmark = pytest.mark.usefixtures("x64")

B, T, D = 4, 3, 5


def sds(shape):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.float64)


def eqn(has_scale, has_shift, x_shapes, p_shape=(D,), out=(B, T, D)):
    params = tuple(sds(p_shape) for _ in range(int(has_scale) + int(has_shift)))
    return tags.LayerTagEqn(
        primitive=ss.scale_and_shift if len(x_shapes) == 1 else ss.scale_and_shift_product,
        outputs=(sds(out),), inputs=tuple(sds(s) for s in x_shapes), params=params,
        param_indices=tuple(range(len(params))), meta={"has_scale": has_scale, "has_shift": has_shift}, name="ln",
    )


def fitted(block, data):
    state = block.init(jax.random.PRNGKey(0), None, None, False)
    return block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, B)


def per_example_fisher(layer, params, xs, dy):
    """(1/B) J^T J with J the Jacobian of the per-example contributions sum(y_n * dy_n)."""
    def contributions(p):
        return jnp.sum(layer(p, xs) * dy, axis=tuple(range(1, dy.ndim)))

    jac = jax.jacobian(contributions)(params)
    j = jnp.concatenate([a.reshape(B, -1) for a in jax.tree_util.tree_leaves(jac)], axis=1)
    return j.T @ j / B


ONE, TWO = [(B, T, D)], [(B, T, 1), (B, T, D)]  # x_hat given as one array or as two factors


@pytest.mark.parametrize(
    "has_scale,has_shift,x_shapes,p_shape",
    [(True, True, ONE, (D,)), (True, True, TWO, (D,)), (True, False, TWO, (D,)), (False, True, ONE, (D,)),
     (True, True, ONE, (T, D))],
)
def test_blocks_equal_exact_per_example_fisher(has_scale, has_shift, x_shapes, p_shape):
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    xs = tuple(jax.random.normal(k, s) for k, s in zip(keys, x_shapes))
    dy = jax.random.normal(keys[3], (B, T, D))

    def layer(p, xs):
        x_hat = xs[0] if len(xs) == 1 else xs[0] * xs[1]
        y = x_hat * p[0] if has_scale else x_hat
        return y + p[-1] if has_shift else y

    params = tuple(jax.random.normal(k, p_shape) for k in jax.random.split(keys[4], int(has_scale) + int(has_shift)))
    want = per_example_fisher(layer, params, xs, dy)
    data = {"inputs": xs, "outputs_tangent": (dy,), "params": params}
    e = eqn(has_scale, has_shift, x_shapes, p_shape)
    full, diag = ss.ScaleAndShiftFull(e, "ln"), ss.ScaleAndShiftDiagonal(e, "ln")
    assert (diag.has_scale, diag.has_shift) == (has_scale, has_shift)
    f_dense = full.to_dense_matrix(fitted(full, data))
    np.testing.assert_allclose(f_dense, want, atol=1e-12)
    np.testing.assert_allclose(diag.to_dense_matrix(fitted(diag, data)), jnp.diag(jnp.diag(want)), atol=1e-12)


def test_block_rejects_inconsistent_parameters():
    bad = tags.LayerTagEqn(
        primitive=ss.scale_and_shift, outputs=(sds((B, D)),), inputs=(sds((B, D)),), params=(sds((D,)),),
        param_indices=(0,), meta={"has_scale": True, "has_shift": True}, name="bad",
    )
    with pytest.raises(ValueError, match="needs 2 parameter"):
        ss.ScaleAndShiftDiagonal(bad, "bad")
    assert blocks.get_default_tag_to_block_ctor("scale_and_shift") is ss.ScaleAndShiftDiagonal


# ----------------------------------------------------------------------------------
# Detection in every framework
# ----------------------------------------------------------------------------------


def _linen(norm):
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(jnp.tanh({"ln": nn.LayerNorm, "rms": nn.RMSNorm}[norm]()(nn.Dense(D)(x))))

    p = M().init(jax.random.PRNGKey(0), jnp.ones((B, T, 3)))
    return M().apply, p, ("LayerNorm_0" if norm == "ln" else "RMSNorm_0",)


def _nnx(norm):
    from flax import nnx

    class M(nnx.Module):
        def __init__(self, rngs):
            self.l0, self.l1 = nnx.Linear(3, D, rngs=rngs), nnx.Linear(D, 2, rngs=rngs)
            self.norm = {"ln": nnx.LayerNorm, "rms": nnx.RMSNorm}[norm](D, rngs=rngs)

        def __call__(self, x):
            return self.l1(jnp.tanh(self.norm(self.l0(x))))

    g, st = nnx.split(M(nnx.Rngs(0)))
    return (lambda p, x: nnx.merge(g, p)(x)), st, ("norm",)


def _haiku(norm):
    import haiku as hk

    def f(x):
        n = hk.LayerNorm(-1, True, True) if norm == "ln" else hk.RMSNorm(-1)
        return hk.Linear(2)(jnp.tanh(n(hk.Linear(D)(x))))

    t = hk.without_apply_rng(hk.transform(f))
    return t.apply, t.init(jax.random.PRNGKey(0), jnp.ones((B, T, 3))), ("layer_norm" if norm == "ln" else "rms_norm",)


def _equinox(norm):
    import equinox as eqx

    k = jax.random.split(jax.random.PRNGKey(0))
    n = eqx.nn.LayerNorm(D) if norm == "ln" else eqx.nn.RMSNorm(D)
    model = (eqx.nn.Linear(3, D, key=k[0]), n, eqx.nn.Linear(D, 2, key=k[1]))
    p, static = eqx.partition(model, eqx.is_inexact_array)

    def apply(p, x):
        l0, nm, l1 = eqx.combine(p, static)
        return jax.vmap(jax.vmap(lambda v: l1(jnp.tanh(nm(l0(v))))))(x)

    return apply, p, ("1/",)


def _linen_batchnorm(_):
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.BatchNorm(use_running_average=True)(nn.Dense(D)(x)))

    v = M().init(jax.random.PRNGKey(0), jnp.ones((B, T, 3)))
    stats = v["batch_stats"]
    return (lambda p, x: M().apply({"params": p, "batch_stats": stats}, x)), v["params"], ("BatchNorm_0",)


FRAMEWORKS = {"flax_linen": _linen, "flax_nnx": _nnx, "haiku": _haiku, "equinox": _equinox}
CASES = [(f, n) for f in sorted(FRAMEWORKS) for n in ("ln", "rms")] + [("linen_batchnorm", "bn")]


def _build(framework, norm):
    maker = _linen_batchnorm if framework == "linen_batchnorm" else FRAMEWORKS[framework]
    apply, params, norm_path = maker(norm)
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
    kx, ky = jax.random.split(jax.random.PRNGKey(3))
    batch = (jax.random.normal(kx, (B, T, 3)), jax.random.normal(ky, (B, T, 2)))

    def loss(p, b):
        out = apply(p, b[0])
        curvax.register_squared_error_loss(out, b[1])
        return jnp.mean((out - b[1]) ** 2)

    return apply, loss, params, batch, norm_path


@pytest.mark.parametrize("framework,norm", CASES)
def test_norm_affine_is_detected_and_its_data_gives_the_exact_fisher(framework, norm):
    apply, loss, params, batch, norm_path = _build(framework, norm)
    f = curvax.layer_tags_vjp(loss)
    losses, vjp = f((params, batch))
    pj = f.processed_jaxpr.first
    paths = curvax.utils.param_paths(params)
    sites = [s for s in pj.layer_sites if s.tag.name == "scale_and_shift"]
    assert len(sites) == 1
    site = sites[0]
    names = [paths[i] for i in site.param_indices]
    assert all(norm_path[0] in n for n in names)
    # Exactly the normalisation's parameters, scale first: equinox RMSNorm has a shift, the others not.
    want_n = 1 if norm == "rms" and framework != "equinox" else 2
    assert len(names) == want_n and site.meta["has_scale"] and site.meta["has_shift"] == (want_n == 2)
    # Both dense layers stay dense layers with their biases.
    assert sorted(s.pattern for s in pj.layer_sites if s is not site) == ["dense_with_bias", "dense_with_bias"]

    # The block fed with curvax's layer data equals (1/B) J^T J of the exact per-example gradients.
    cot = jax.random.normal(jax.random.PRNGKey(4), losses[0].parameter_dependants[0].shape)
    data = vjp([(cot,)])[pj.layer_sites.index(site)]
    block = ss.ScaleAndShiftFull(pj.layer_tags[pj.layer_sites.index(site)], "norm")
    got = block.to_dense_matrix(fitted(block, data))
    flat, tree = jax.tree_util.tree_flatten(params)

    def contributions(norm_params):
        leaves = list(flat)
        for i, v in zip(site.param_indices, norm_params):
            leaves[i] = v
        out = apply(jax.tree_util.tree_unflatten(tree, leaves), batch[0])
        return jnp.sum(out * cot, axis=(1, 2))

    jac = jax.jacobian(contributions)(tuple(flat[i] for i in site.param_indices))
    j = jnp.concatenate([a.reshape(B, -1) for a in jac], axis=1)
    np.testing.assert_allclose(got, j.T @ j / B, rtol=1e-9, atol=1e-12)


def test_feature_axis_other_than_last_and_skipping():
    """A per-channel affine on axis 1 (NCHW style) is found and its data moved features-last."""
    def apply(p, x):
        return x * p["s"].reshape(1, -1, 1) + p["b"].reshape(1, -1, 1)

    def loss(p, b):
        out = apply(p, b[0])
        curvax.register_squared_error_loss(out, b[1])
        return jnp.mean((out - b[1]) ** 2)

    params = {"b": jnp.arange(3.0), "s": 1 + jnp.arange(3.0)}
    kx, ky = jax.random.split(jax.random.PRNGKey(5))
    batch = (jax.random.normal(kx, (B, 3, 2)), jax.random.normal(ky, (B, 3, 2)))
    f = curvax.layer_tags_vjp(loss)
    losses, vjp = f((params, batch))
    (site,) = f.processed_jaxpr.first.layer_sites
    assert site.pattern == "scale_and_shift_both" and site.meta["output_feature_axis"] == 1
    assert site.param_indices == (1, 0)  # scale ("s") first, then shift ("b")
    cot = jax.random.normal(jax.random.PRNGKey(6), (B, 3, 2))
    (data,) = vjp([(cot,)])
    block = ss.ScaleAndShiftFull(f.processed_jaxpr.first.layer_tags[0], "cn")
    jac = jax.jacobian(lambda s, b: jnp.sum(apply({"s": s, "b": b}, batch[0]) * cot, axis=(1, 2)), argnums=(0, 1))(
        params["s"], params["b"]
    )
    j = jnp.concatenate(jac, axis=1)
    np.testing.assert_allclose(block.to_dense_matrix(fitted(block, data)), j.T @ j / B, atol=1e-12)
    pj = transforms.ProcessedJaxpr.make_from_func(loss, (params, batch), patterns_to_skip=("scale_and_shift",))
    assert [s.pattern for s in pj.layer_sites] == ["generic", "generic"]


# ----------------------------------------------------------------------------------
# Manual registration
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("legacy", [False, True])
def test_manual_registration(legacy):
    def loss(p, b):
        x = b[0]
        y = x * p["scale"] + p["shift"]
        if legacy:
            y = ss.register_scale_and_shift(y, [x, p["scale"], p["shift"]], True, True)
        else:
            y = ss.register_scale_and_shift(y, x, scale=p["scale"], shift=p["shift"])
        curvax.register_squared_error_loss(y, b[1])
        return jnp.mean((y - b[1]) ** 2)

    params = {"scale": jnp.ones(D), "shift": jnp.zeros(D)}
    batch = (jnp.ones((B, D)), jnp.zeros((B, D)))
    pj = transforms.ProcessedJaxpr.make_from_func(loss, (params, batch))
    (site,) = pj.layer_sites
    assert site.pattern == "manual" and site.tag is ss.scale_and_shift
    assert site.param_indices == (0, 1) and site.meta["has_scale"] and site.meta["has_shift"]
    est = curvax.BlockDiagonalCurvature(loss)
    est.init(jax.random.PRNGKey(0), (params, batch))
    assert [type(b).__name__ for b in est.blocks] == ["ScaleAndShiftDiagonal"]


def test_manual_registration_rejects_bad_input():
    x, s = jnp.ones((B, D)), jnp.ones(D)
    with pytest.raises(ValueError, match="at least one"):
        ss.register_scale_and_shift(x, x)
    with pytest.raises(ValueError, match="`scale` of shape"):
        ss.register_scale_and_shift(x, x, scale=jnp.ones(D + 1))
    with pytest.raises(ValueError, match="does not broadcast"):
        ss.register_scale_and_shift(x, jnp.ones((B + 1, D)), scale=s)
    with pytest.raises(TypeError, match="must be bools"):
        ss.register_scale_and_shift(x, [x, s], s, None)
    with pytest.raises(ValueError, match="parameter"):
        ss.register_scale_and_shift(x, [x], True, False)


def test_auto_register_tags_binds_the_two_factor_form():
    """flax's ``(x - mean) * (rsqrt(var) * scale) + bias`` is tagged with both factors as inputs."""
    def loss(p, b):
        xc = b[0] - jnp.mean(b[0], -1, keepdims=True)
        out = xc * (jax.lax.rsqrt(jnp.mean(xc**2, -1, keepdims=True) + 1e-5) * p["scale"]) + p["bias"]
        curvax.register_squared_error_loss(out, b[1])
        return jnp.mean((out - b[1]) ** 2)

    value = lambda p, b: jax.value_and_grad(loss)(p, b)[0]
    params = {"bias": jnp.zeros(D), "scale": jnp.ones(D)}
    batch = (jax.random.normal(jax.random.PRNGKey(9), (B, D)), jnp.zeros((B, D)))
    tagged = curvax.auto_register_tags(value, (params, batch), compute_only_loss_tags=False)
    eqns = [e for e in jax.make_jaxpr(tagged)(params, batch).jaxpr.eqns if e.primitive.name == "scale_and_shift"]
    assert len(eqns) == 1 and eqns[0].primitive is ss.scale_and_shift_product
    assert len(eqns[0].invars) == 5  # output, two input factors, scale, shift
    np.testing.assert_allclose(tagged(params, batch), value(params, batch), rtol=1e-12)
