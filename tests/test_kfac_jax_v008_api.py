"""The released kfac-jax v0.0.8 names (``import curvax as kfac_jax``) against oracles.

Module namespaces (``curvax.tracer``, ``curvax.loss_functions`` ...), the v0.0.8
tracer generation, ``curvax.utils``'s kfac-jax helpers and the tag adapters.
"""

from __future__ import annotations

import functools
import importlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax

pytestmark = pytest.mark.usefixtures("x64")
KEY = jax.random.PRNGKey(3)


def _model(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return h @ p["w2"]


def _setup():
    ks = jax.random.split(KEY, 5)
    params = {
        "w1": jax.random.normal(ks[0], (3, 4)),
        "b1": jax.random.normal(ks[1], (4,)),
        "w2": jax.random.normal(ks[2], (4, 2)),
    }
    batch = (jax.random.normal(ks[3], (5, 3)), jax.random.normal(ks[4], (5, 2)))

    def loss(p, b):
        out = _model(p, b[0])
        curvax.register_squared_error_loss(out, b[1])  # its loss: sum of squared errors
        return jnp.sum((out - b[1]) ** 2)

    return loss, params, batch


# --- module names ------------------------------------------------------------------

V008_MODULES = (
    "loss_functions", "layers_and_loss_tags", "curvature_blocks", "curvature_estimator",
    "tracer", "patches_second_moment", "tag_graph_matcher", "optimizer", "utils",
)


@pytest.mark.parametrize("name", V008_MODULES)
def test_v008_modules_are_attributes_and_importable(name):
    mod = importlib.import_module(f"curvax.{name}")
    assert getattr(curvax, name) is mod is sys.modules[f"curvax.{name}"]


def test_namespaces_reexport_the_same_objects():
    """One implementation, several names: the namespaces hold curvax's own objects."""
    assert curvax.loss_functions.LossFunction is curvax.LossFunction
    assert curvax.loss_functions.register_squared_error_loss is curvax.register_squared_error_loss
    assert curvax.curvature_blocks.DenseTwoKroneckerFactored is curvax.DenseTwoKroneckerFactored
    assert curvax.curvature_blocks.Conv2DDiagonal is curvax.Conv2DDiagonal
    assert curvax.curvature_estimator.BlockDiagonalCurvature is curvax.BlockDiagonalCurvature
    assert curvax.layers_and_loss_tags.LayerTag is curvax.LayerTag
    assert curvax.patches_second_moment.patches_moments is curvax.patches_moments
    assert curvax.tracer.ProcessedJaxpr is curvax.ProcessedJaxpr
    assert curvax.LayerVjpData is curvax.tracer.LayerVjpData
    assert curvax.LayerData is curvax.layers_and_loss_tags.LayerData
    assert curvax.utils.WeightedMovingAverage is curvax.WeightedMovingAverage
    state_type = curvax.curvature_estimator.StateType
    assert curvax.CurvatureEstimator[state_type].__origin__ is curvax.CurvatureEstimator


# --- tracer: v0.0.8 generation vs documented generation and oracles --------------------


def test_v008_loss_tags_vjp_returns_function_and_extractor_with_documented_products():
    loss, params, batch = _setup()
    vjp, extractor = curvax.tracer.loss_tags_vjp(loss)
    losses, vjp_fn = vjp((params, batch))
    cot = jax.random.normal(KEY, (5, 2))
    _, oracle = jax.vjp(lambda p: _model(p, batch[0]), params)
    got = vjp_fn([(cot,)])
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10), got, oracle(cot)[0])
    doc = curvax.loss_tags_vjp(loss)((params, batch))[1]([(cot,)])
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b), got, doc)
    pj = extractor((params, batch))
    assert isinstance(pj, curvax.ProcessedJaxpr) and len(pj.loss_tags) == 1
    np.testing.assert_allclose(losses[0].evaluate(), jnp.sum((_model(params, batch[0]) - batch[1]) ** 2, -1))


def test_v008_loss_tags_jvp_and_hvp_against_jax_oracles():
    loss, params, batch = _setup()
    tangent = jax.tree_util.tree_map(lambda x: 0.3 * jnp.ones_like(x), params)
    jvp, _ = curvax.tracer.loss_tags_jvp(loss)
    _, tangents = jvp((params, batch), tangent)
    _, want = jax.jvp(lambda p: _model(p, batch[0]), (params,), (tangent,))
    np.testing.assert_allclose(tangents[0][0], want, rtol=1e-10)

    hvp, extractor = curvax.tracer.loss_tags_hvp(loss)
    flat, unravel = ravel_pytree(params)
    v = jax.random.normal(KEY, flat.shape)
    hv, losses = hvp((params, batch), unravel(v))
    dense = jax.jit(jax.hessian(lambda f: loss(unravel(f), batch)))(flat)
    np.testing.assert_allclose(ravel_pytree(hv)[0], dense @ v, rtol=1e-8)
    assert len(losses) == 1 and extractor((params, batch)).params_tree == jax.tree_util.tree_structure(params)


def test_v008_layer_tags_vjp_gives_layer_vjp_data_matching_the_documented_dicts():
    loss, params, batch = _setup()
    vjp, extractor = curvax.tracer.layer_tags_vjp(loss)
    losses, vjp_fn = vjp((params, batch))
    cot = jax.random.normal(KEY, (5, 2))
    data = vjp_fn([(cot,)])
    doc = curvax.layer_tags_vjp(loss)((params, batch))[1]([(cot,)])
    assert len(data) == len(doc) == 2 == len(extractor((params, batch)).layer_tags)
    for d, e in zip(data, doc):
        assert isinstance(d, curvax.LayerVjpData) and isinstance(d.primals, curvax.LayerData)
        assert d.tangents.inputs == ()
        for got, want in (
            (d.primals.inputs, e["inputs"]), (d.primals.outputs, e["outputs"]), (d.primals.params, e["params"]),
            (d.tangents.outputs, e["outputs_tangent"]), (d.tangents.params, e["params_tangent"]),
        ):
            assert len(got) == len(want)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
    # The parameter cotangents are the model's vjp; the layer data is a pytree.
    _, oracle = jax.vjp(lambda p: _model(p, batch[0]), params)
    (g,) = oracle(cot)
    np.testing.assert_allclose(data[0].tangents.params[0], g["w1"], rtol=1e-10)
    np.testing.assert_allclose(data[1].tangents.params[0], g["w2"], rtol=1e-10)
    assert len(jax.tree_util.tree_leaves(data[0])) == 1 + 1 + 2 + 1 + 2


def test_v008_layer_tags_vjp_gives_the_normalised_input_of_a_scale_and_shift_layer():
    """curvax keeps a layer norm's input as two factors; v0.0.8's LayerData holds their product."""
    ks = jax.random.split(KEY, 4)
    params = {"scale": jax.random.normal(ks[0], (4,)), "offset": jax.random.normal(ks[1], (4,))}
    x = jax.random.normal(ks[2], (6, 4))

    def normalised(x):
        mean = jnp.mean(x, -1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5)

    def loss(p, x):
        y = normalised(x) * p["scale"] + p["offset"]
        curvax.register_squared_error_loss(y, jnp.zeros_like(y))
        return 0.5 * jnp.sum(y**2)

    vjp, _ = curvax.tracer.layer_tags_vjp(loss)
    _, vjp_fn = vjp((params, x))
    (data,) = vjp_fn([(jnp.ones((6, 4)),)])
    assert len(data.primals.inputs) == 1
    np.testing.assert_allclose(data.primals.inputs[0], normalised(x), rtol=1e-10)


def test_v008_compute_all_losses():
    loss, params, batch = _setup()
    compute, _ = curvax.tracer.compute_all_losses(loss)
    (l,) = compute((params, batch))
    np.testing.assert_allclose(l.parameter_dependants[0], _model(params, batch[0]), rtol=1e-12)


def test_top_level_transformations_keep_the_documented_generation():
    loss, params, batch = _setup()
    f = curvax.loss_tags_vjp(loss)
    assert callable(f) and not isinstance(f, tuple)
    assert isinstance(curvax.tracer.loss_tags_vjp(loss), tuple)


# --- tags ------------------------------------------------------------------------------


def test_loss_tag_bind_with_loss_meta_data_registers_the_loss_class():
    tags = curvax.layers_and_loss_tags
    loss, params, batch = _setup()

    def fn(p, b):
        out = _model(p, b[0])
        args, names = curvax.loss_functions.filter_none(mean=out, targets=b[1], weight=None)
        assert names == ("mean", "targets")
        tags.loss_tag.bind(
            *args,
            meta=tags.LossMetaData(
                loss_class=curvax.NormalMeanNegativeLogProbLoss,
                parameter_dependants=names[:1],
                parameter_independants=names[1:],
                argument_names=names,
            ),
        )
        return jnp.sum(out)

    (got,), _ = curvax.tracer.loss_tags_vjp(fn)[0]((params, batch))
    assert type(got) is curvax.NormalMeanNegativeLogProbLoss
    np.testing.assert_array_equal(got.targets, batch[1])
    # The same class and split give the same primitive each time (equal jaxprs).
    meta = tags.LossMetaData(loss_class=curvax.NormalMeanNegativeLogProbLoss, parameter_dependants=("mean",),
                             parameter_independants=("targets",), argument_names=("mean", "targets"))
    assert tags.loss_tag.tag_for(meta) is tags.loss_tag.tag_for(meta)
    with pytest.raises(ValueError, match="argument_names"):
        tags.loss_tag.bind(jnp.ones((2, 2)), meta=meta)


def test_register_dense_accepts_kfac_dot_general_keywords_and_rejects_other_contractions():
    x, w, b = jnp.ones((5, 3)), jnp.ones((3, 2)), jnp.ones((2,))
    y = x @ w + b
    out = curvax.layers_and_loss_tags.register_dense(
        y, x, w, b, dimension_numbers=(((1,), (0,)), ((), ())), precision=None,
        preferred_element_type=jnp.float64, out_sharding=None,
    )
    np.testing.assert_array_equal(out, y)
    eqns = jax.make_jaxpr(lambda y: curvax.layers_and_loss_tags.register_dense(y, x, w, b))(y).jaxpr.eqns
    assert [e.primitive for e in eqns] == [curvax.tags.dense]
    with pytest.raises(ValueError, match="dimension_numbers"):
        curvax.layers_and_loss_tags.register_dense(y, x, w, b, dimension_numbers=(((0,), (0,)), ((), ())))


def test_ferminet_style_repeated_dense_pattern_is_detected_with_its_variant():
    dense = functools.partial(curvax.tag_graph_matcher._dense, axes=1, with_reshape=False)
    pattern = curvax.tag_graph_matcher.GraphPattern(
        name="repeated_dense1_with_bias",
        tag_primitive=curvax.layers_and_loss_tags.layer_tag,
        compute_func=jax.vmap(dense, in_axes=[0, [None, None]]),
        parameters_extractor_func=functools.partial(
            curvax.tag_graph_matcher._dense_parameter_extractor, variant="repeated_dense"
        ),
        example_args=[np.zeros([9, 11, 13]), [np.zeros([13, 7]), np.zeros([7])]],
    )

    def loss(p, x):
        y = jax.vmap(lambda xi: xi @ p["w"] + p["b"])(x)
        curvax.register_squared_error_loss(y.reshape(y.shape[0], -1))
        return jnp.sum(y**2)

    params = {"w": jnp.ones((13, 7)), "b": jnp.ones((7,))}
    x = jnp.ones((4, 5, 13))
    tagged = curvax.auto_register_tags(
        loss, (params, x), graph_patterns=(pattern,) + curvax.tag_graph_matcher.DEFAULT_GRAPH_PATTERNS,
        compute_only_loss_tags=False,
    )
    (eqn,) = [e for e in jax.make_jaxpr(tagged)(params, x).jaxpr.eqns if isinstance(e.primitive, curvax.LayerTag)]
    assert eqn.primitive is curvax.tags.dense and eqn.params["variant"] == "repeated_dense"
    np.testing.assert_allclose(tagged(params, x), loss(params, x), rtol=1e-12)
    np.testing.assert_allclose(dense(x[0], [params["w"], params["b"]]), x[0] @ params["w"] + params["b"])


# --- patches_second_moment ---------------------------------------------------------------


@pytest.mark.parametrize(
    "size, kernel, strides, padding",
    [(8, (3, 3), (1, 1), "SAME"), (9, (2, 3), (2, 3), "VALID"), (8, (2, 2), (1, 3), ((0, 1), (2, 3)))],
)
def test_num_conv_locations_counts_the_patches(size, kernel, strides, padding):
    patches = jax.lax.conv_general_dilated_patches(
        jnp.zeros((1, size, size, 1)), filter_shape=kernel, window_strides=strides, padding=padding,
        dimension_numbers=("NHWC", "IOHW", "NHWC"),
    )
    assert curvax.patches_second_moment.num_conv_locations((size, size), kernel, strides, padding) == (
        patches.size // patches.shape[-1]
    )
    with pytest.raises(ValueError, match="spatial axis"):
        curvax.patches_second_moment.num_conv_locations((size, size), (3,), strides, padding)


# --- utils -----------------------------------------------------------------------------


def _spd(key, n):
    a = jax.random.normal(key, (n, n))
    return a @ a.T + n * jnp.eye(n)


def test_psd_inv_and_psd_solve_against_dense_inverse():
    m = _spd(KEY, 5)
    np.testing.assert_allclose(jax.jit(curvax.utils.psd_inv)(m), np.linalg.inv(m), rtol=1e-10, atol=1e-12)
    b = jnp.arange(5.0)
    np.testing.assert_allclose(jax.jit(curvax.utils.psd_solve)(m, b), np.linalg.solve(m, b), rtol=1e-10)
    with pytest.raises(ValueError, match="square"):
        curvax.utils.psd_inv(jnp.ones((2, 3)))
    a = m.at[-1].set(0).at[:, -1].set(0)
    x = jax.jit(curvax.utils.psd_solve_maybe_zero_last_idx)(a, b)
    np.testing.assert_allclose(x[:-1], np.linalg.solve(m[:-1, :-1], b[:-1]), rtol=1e-10)
    assert x[-1] == 0


def test_pi_adjusted_kronecker_inverse_against_dense_oracle():
    ka, kg = jax.random.split(KEY)
    a, g = _spd(ka, 3), 0.1 * _spd(kg, 4)
    damping = 0.7
    # (jit: far fewer dispatches than op-by-op execution)
    inverse = jax.jit(functools.partial(curvax.utils.pi_adjusted_kronecker_inverse, damping=damping))
    factors = jax.jit(functools.partial(curvax.utils.pi_adjusted_kronecker_factors, damping=damping))
    ia, ig = inverse(a, g)
    fa, fg = factors(a, g)
    np.testing.assert_allclose(np.kron(ia, ig), np.linalg.inv(np.kron(fa, fg)), rtol=1e-9, atol=1e-12)
    # Same damped Kronecker product as curvax's own two-factor pi-adjustment,
    # which approximates kron(A, G) + damping I with the damping split by pi.
    la, lg = jax.jit(curvax.linalg.pi_adjusted_factors)(a, g, damping)
    np.testing.assert_allclose(np.kron(fa, fg), np.kron(la, lg), rtol=1e-10)
    pi = np.sqrt((np.trace(a) / 3) / (np.trace(g) / 4))
    want = np.kron(a + pi * np.sqrt(damping) * np.eye(3), g + np.sqrt(damping) / pi * np.eye(4))
    np.testing.assert_allclose(np.kron(fa, fg), want, rtol=1e-10)
    # A diagonal factor follows the same rule (its norm is its mean).
    d = np.array([1.0, 2.0, 3.0, 4.0])
    fa2, fd = factors(a, d)
    nd = np.mean(d)
    pi2 = np.sqrt((np.trace(a) / 3) / nd)
    np.testing.assert_allclose(np.kron(fa2, np.diag(fd)), np.kron(a + pi2 * np.sqrt(damping) * np.eye(3),
                                                                   np.diag(d + np.sqrt(damping) / pi2)), rtol=1e-10)
    # With one matrix and a scalar factor s the damped product is exact: s A + damping I.
    fa3, fs = factors(a, np.array(2.0))
    np.testing.assert_allclose(fa3 * fs, 2.0 * a + damping * np.eye(3), rtol=1e-10)
    # The curvature blocks' rule (curvax.linalg) is the same for 1 x 1 factors, on either side.
    for f1, f2 in ((a, np.array([[2.0]])), (np.array([[2.0]]), g), (np.array([[2.0]]), np.array([[0.5]]))):
        np.testing.assert_allclose(np.kron(*curvax.linalg.pi_adjusted_factors(f1, f2, damping)),
                                   np.kron(*factors(f1, f2)), rtol=1e-10)
        np.testing.assert_allclose(np.kron(*factors(f1, f2)), np.kron(f1, f2) + damping * np.eye(len(np.kron(f1, f2))), rtol=1e-10)
    # All-zero factors: damping * I overall.
    za, zg = factors(np.zeros((3, 3)), np.zeros((4, 4)))
    np.testing.assert_allclose(np.kron(za, zg), damping * np.eye(12), rtol=1e-12)


def test_kronecker_products_against_dense_kron():
    ka, kb, kv = jax.random.split(KEY, 3)
    a, b = jax.random.normal(ka, (3, 3)), jax.random.normal(kb, (4, 4))
    v = jax.random.normal(kv, (3, 4))
    got = curvax.utils.kronecker_product_axis_mul_v([a, b], v)
    np.testing.assert_allclose(got.reshape(-1), np.kron(a, b) @ v.reshape(-1), rtol=1e-10)
    got_t = curvax.utils.kronecker_product_axis_mul_v([a, b], v, transpose=True)
    np.testing.assert_allclose(got_t.reshape(-1), np.kron(a, b).T @ v.reshape(-1), rtol=1e-10)
    # kfac-jax's column-major convention: unvec((A kron B) vec(V)) = B V A^T for V of shape (dim B, dim A).
    w = jax.random.normal(kv, (4, 3))
    np.testing.assert_allclose(curvax.utils.kronecker_product_mul_v(a, b, w, True), b @ w @ a.T, rtol=1e-10)
    qa, qb = jnp.linalg.qr(a)[0], jnp.linalg.qr(b)[0]
    s = jax.random.uniform(kv, (3, 4))
    q = np.kron(qa, qb)
    got = curvax.utils.kronecker_eigen_basis_axis_mul_v([qa, qb], s, v)
    np.testing.assert_allclose(got.reshape(-1), q @ (s.reshape(-1) * (q.T @ v.reshape(-1))), rtol=1e-10)


def test_rearrange_matches_transpose_and_reshape():
    x = jax.random.normal(KEY, (2, 3, 4, 5))
    f = curvax.utils.rearrange
    np.testing.assert_array_equal(f(x, "b h w c -> b (c h w)"), jnp.transpose(x, (0, 3, 1, 2)).reshape(2, 60))
    np.testing.assert_array_equal(f(x, "b h w c -> h (b w) c"), jnp.transpose(x, (1, 0, 2, 3)).reshape(3, 8, 5))
    assert f(x[:, 0, 0, 0], "b->b1").shape == (2, 1)
    with pytest.raises(ValueError, match="every axis"):
        f(x, "b h w c -> b h w")
    with pytest.raises(ValueError, match="name each"):
        f(x, "b h w -> b h w")


def test_pmap_helpers_outside_and_inside_pmap():
    u = curvax.utils
    assert not u.in_pmap("i") and not u.in_pmap(None)
    x = jnp.arange(3.0)
    assert u.pmean_if_pmap(x, "i") is x and u.psum_if_pmap(x, "i") is x

    def f(v):
        assert u.in_pmap("i") and not u.in_pmap("j")
        return u.psum_if_pmap(v, "i"), u.pmean_if_pmap(v, "i")

    n = jax.local_device_count()
    s, m = jax.pmap(f, axis_name="i")(jnp.arange(float(n)))
    np.testing.assert_allclose(s, jnp.full((n,), n * (n - 1) / 2))
    np.testing.assert_allclose(m, jnp.full((n,), (n - 1) / 2))
    rep = u.replicate_all_local_devices({"a": jnp.ones(2)})
    assert rep["a"].shape == (n, 2)
    np.testing.assert_array_equal(u.get_first(rep)["a"], jnp.ones(2))
    keys = u.make_different_rng_key_on_all_devices(KEY)
    assert keys.shape[0] == n
    k1, k2 = u.p_split(keys)
    assert k1.shape == k2.shape == keys.shape and not np.array_equal(k1, k2)


def test_tree_and_math_helpers():
    u = curvax.utils
    a = {"x": jnp.array([1.0, 2.0]), "y": jnp.array(3.0)}
    b = {"x": jnp.array([0.5, -1.0]), "y": jnp.array(2.0)}
    assert u.product([2, 3, 4]) == 24 and u.product([]) == 1
    np.testing.assert_allclose(u.inner_product(a, b, in_float64=True), 0.5 - 2 + 6)
    np.testing.assert_allclose(u.cosine_similarity(a, a), 1.0)
    assert u.pytree_size(a) == 3 and u.tree_is_empty({}) and not u.tree_is_empty(a)
    assert u.abstract_objects_equal(a, b) and not u.abstract_objects_equal(a, {"x": a["x"]})
    np.testing.assert_allclose(u.sum_of_objects([a, b])["x"], [1.5, 1.0])
    np.testing.assert_allclose(u.scalar_div(a, 2.0)["y"], 1.5)
    np.testing.assert_allclose(u.outer_product(jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0, 5.0])),
                               jnp.outer(jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0, 5.0])))
    m = jnp.arange(25.0).reshape(5, 5)
    got = u.block_permuted(m, [2, 3], [1, 0])
    idx = jnp.array([2, 3, 4, 0, 1])
    np.testing.assert_array_equal(got, m[idx][:, idx])
    vs = [a, b]
    np.testing.assert_allclose(u.symmetric_matrix_inner_products(vs, vs), u.matrix_of_inner_products(vs))
    np.testing.assert_allclose(u.asymmetric_matrix_inner_products(vs, vs), u.matrix_of_inner_products(vs))
    assert u.to_tuple_or_repeat(2.0, 3) == (2.0, 2.0, 2.0) and u.filter_sequence((1, 2, 3), [True, False, True]) == (1, 3)
    with pytest.raises(ValueError, match="3 items"):
        u.to_tuple_or_repeat([1, 2], 3)


def test_loop_and_parallelize_average_equals_the_mean_with_and_without_chunks():
    x = jax.random.normal(KEY, (7, 3))
    fn = lambda v: jnp.outer(v, v)
    want = jnp.mean(jax.vmap(fn)(x), axis=0)
    for max_size in (None, 9, 20, 1000):
        np.testing.assert_allclose(curvax.utils.loop_and_parallelize_average(fn, max_size)(x), want, rtol=1e-10)


def test_state_serialization_round_trip():
    @curvax.utils.register_state_class
    class MyState(curvax.utils.State):
        a: jax.Array
        b: dict

    s = MyState(a=jnp.ones(2), b={"c": jnp.zeros(3)})
    assert s.field_names() == ("a", "b") and len(jax.tree_util.tree_leaves(s)) == 2
    rep = curvax.utils.serialize_state_tree([s])
    back = curvax.utils.deserialize_state_tree(rep)
    assert type(back[0]) is MyState
    np.testing.assert_array_equal(back[0].b["c"], s.b["c"])


def test_finalizable_freezes_attributes():
    class Thing(curvax.utils.Finalizable):
        def __init__(self):
            super().__init__(excluded_attribute_names=("free",))
            self.x = 1
            self.free = 0

    t = Thing()
    t.finalize()
    t.free = 2
    with pytest.raises(AttributeError):
        t.x = 3
    with pytest.raises(AttributeError):
        t.new = 3


def test_multi_chunk_accumulator_is_the_weighted_mean():
    acc = curvax.utils.MultiChunkAccumulator.empty(multi_device=False)
    acc.add({"x": jnp.array([1.0, 2.0])}, 2)
    acc.add({"x": jnp.array([4.0, 8.0])}, 1)
    np.testing.assert_allclose(acc.value["x"], [2.0, 4.0])
    leaves = jax.tree_util.tree_leaves(acc)
    np.testing.assert_allclose(leaves[0], [6.0, 12.0])
    assert int(leaves[1]) == 3
    assert curvax.utils.get_float_dtype_and_check_consistency({"a": jnp.ones(2), "b": jnp.ones(())}) == jnp.float64
    with pytest.raises(ValueError, match="mix"):
        curvax.utils.get_float_dtype_and_check_consistency([jnp.ones(2), jnp.ones(2, jnp.float32)])


def test_staged_methods_compile_once_and_run_nested_calls_inline():
    traces = []

    class Thing(curvax.utils.WithStagedMethods):
        @functools.partial(curvax.utils.staged, static_argnums=0)
        def outer(self, k, x):
            traces.append("outer")
            return self.inner(x) * k

        @curvax.utils.staged
        def inner(self, x):
            traces.append("inner")
            return x + 1

    t = Thing()
    np.testing.assert_allclose(t.outer(3, jnp.ones(2)), 6.0)
    np.testing.assert_allclose(t.outer(3, 2 * jnp.ones(2)), 9.0)
    assert traces == ["outer", "inner"]  # traced once; inner ran inside outer's trace
    debug = Thing(debug=True)
    np.testing.assert_allclose(debug.outer(2, jnp.ones(2)), 4.0)
    assert traces[2:] == ["outer", "inner"]
    with pytest.raises(ValueError, match="pmap_axis_name"):
        Thing(multi_device=True)


def test_tag_equation_helpers_read_curvax_tags():
    tags = curvax.layers_and_loss_tags
    loss, params, batch = _setup()
    tagged = curvax.auto_register_tags(loss, (params, batch), compute_only_loss_tags=False)
    eqns = jax.make_jaxpr(tagged)(params, batch).jaxpr.eqns
    (loss_eqn,) = [e for e in eqns if isinstance(e.primitive, curvax.LossTag)]
    layer_eqns = [e for e in eqns if isinstance(e.primitive, curvax.LayerTag)]
    assert tags.loss_eqn_class_name(loss_eqn) == "NormalMeanNegativeLogProbLoss"
    (dep,) = tags.loss_eqn_parameter_dependants(loss_eqn)
    assert dep is loss_eqn.invars[0]
    values = [jnp.ones((5, 2)), jnp.zeros((5, 2))] + [v.val for v in loss_eqn.invars[2:]]
    built = tags.loss_eqn_construct_loss(loss_eqn, *values)
    np.testing.assert_allclose(built.evaluate(), jnp.full((5,), 2.0))
    assert tags.loss_eqn_parameter_dependants(layer_eqns[0], raise_an_error=False) == []
    d = tags.layer_eqn_data(layer_eqns[0])
    assert len(d.outputs) == 1 and len(d.inputs) == 1 and [v.aval.shape for v in d.params] == [(3, 4), (4,)]
    assert tags.layer_eqn_data(loss_eqn, raise_an_error=False) == curvax.LayerData(inputs=(), outputs=(), params=())
    with pytest.raises(ValueError, match="layer tag"):
        tags.layer_eqn_data(loss_eqn)
