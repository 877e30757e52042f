"""The extension API: user ``GraphPattern``s and ``DEFAULT_GRAPH_PATTERNS``.

The first test runs kfac-jax's "Extending KFAC-JAX" guide (new dense tag, its graph pattern, its
Kronecker block; ``tests/extension_guide.py``) with ``kfac_jax`` replaced by ``curvax``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import detection, patterns, tags, transforms
from extension_guide import (
    DenseTwoKroneckerFactored, dense, dense_function, dense_with_bias_pattern, my_dense_no_bias_pattern,
)

pytestmark = pytest.mark.usefixtures("x64")

KEY = jax.random.PRNGKey(0)
RNG = np.random.default_rng(0)  # numpy data: no per-shape compilation of random ops

def test_guide_example_optimizer_takes_the_newton_step():
    """One dense layer + squared error: K-FAC with exact inverses is Newton's method (lstsq)."""
    x = jnp.asarray(RNG.normal(size=(24, 4)))
    t = x @ RNG.normal(size=(4, 3)) + 0.1 * RNG.normal(size=(24, 3))

    def loss(p, b):
        out = jnp.matmul(b[0], p["w"]) + p["b"]
        curvax.register_squared_error_loss(out, b[1])
        return jnp.mean(jnp.sum((out - b[1]) ** 2, -1))

    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
    opt = curvax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss),
        l2_reg=0.0,
        estimation_mode="ggn_exact",
        curvature_ema=0.0,
        inverse_update_period=1,
        use_exact_inverses=True,
        num_burnin_steps=0,
        auto_register_kwargs=dict(graph_patterns=(dense_with_bias_pattern,) + patterns.DEFAULT_GRAPH_PATTERNS),
        layer_tag_to_block_ctor=dict(dense_tag=DenseTwoKroneckerFactored),
    )
    state = opt.init(params, KEY, (x, t))
    (block,) = opt.estimator.blocks
    assert type(block) is DenseTwoKroneckerFactored and block.layer_tag_primitive is dense
    loss0 = loss(params, (x, t))
    params, state, _ = opt.step(params, state, KEY, batch=(x, t), learning_rate=1.0, momentum=0.0, damping=1e-8)
    best = jnp.linalg.lstsq(jnp.concatenate([x, jnp.ones((24, 1))], 1), t)[0]
    np.testing.assert_allclose(params["w"], best[:4], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(params["b"], best[4], rtol=1e-5, atol=1e-6)
    assert loss(params, (x, t)) < 0.1 * loss0
    # kfac-jax's module spelling; the tagged function binds the guide's tag and computes the same loss.
    tagged = patterns.auto_register_tags(
        loss, (params, (x, t)), graph_patterns=(dense_with_bias_pattern,), compute_only_loss_tags=False
    )
    jaxpr = jax.make_jaxpr(tagged)(params, (x, t))
    assert [e.primitive for e in jaxpr.eqns].count(dense) == 1
    np.testing.assert_allclose(tagged(params, (x, t)), loss(params, (x, t)), rtol=1e-12)


# --- detection -----------------------------------------------------------------------------


def _sites(func, args, **kwargs):
    pj = transforms.ProcessedJaxpr.make_from_func(func, args, **kwargs)
    return pj, [(s.tag.name, s.pattern, s.param_indices) for s in pj.layer_sites]


def _mlp_loss(p, batch):
    x, t = batch
    h = jnp.tanh(jnp.matmul(x, p["a_w"]) + p["b_b"])
    h = p["c_b"] + h @ p["d_w"]  # operands of the add written the other way round
    out = h @ p["e_w"] + jnp.sin(p["f_s"])  # no bias: the sine is no layer kind's
    curvax.register_squared_error_loss(out, t)
    return jnp.sum((out - t) ** 2)


def _mlp_args(x_shape=(6, 3)):
    shapes = {"a_w": (3, 5), "b_b": (5,), "c_b": (4,), "d_w": (5, 4), "e_w": (4, 2), "f_s": (2,)}
    p = {k: jnp.asarray(RNG.normal(size=s)) for k, s in shapes.items()}
    return p, (jnp.asarray(RNG.normal(size=x_shape)), jnp.asarray(RNG.normal(size=x_shape[:-1] + (2,))))


def test_guide_pattern_claims_exactly_the_dense_layers():
    p, batch = _mlp_args()
    gp = (dense_with_bias_pattern, my_dense_no_bias_pattern) + patterns.DEFAULT_GRAPH_PATTERNS
    pj, got = _sites(_mlp_loss, (p, batch), graph_patterns=gp)
    # Parameter leaves in order: a_w 0, b_b 1, c_b 2, d_w 3, e_w 4, f_s 5.
    assert got == [
        ("dense_tag", "dense_with_bias", (0, 1)),
        ("dense_tag", "dense_with_bias", (3, 2)),
        ("dense_tag", "my_dense_no_bias", (4,)),
        ("generic", "generic", (5,)),
    ]
    # The extractor's meta (the dot_general's parameters) reaches the layer.
    assert pj.layer_sites[0].meta["dimension_numbers"] == (((1,), (0,)), ((), ()))
    # Without the user patterns the built-in dense kind finds the same layers.
    _, builtin = _sites(_mlp_loss, (p, batch), graph_patterns=patterns.DEFAULT_GRAPH_PATTERNS)
    assert builtin == [
        ("dense", "dense_with_bias", (0, 1)),
        ("dense", "dense_with_bias", (3, 2)),
        ("dense", "dense_no_bias", (4,)),
        ("generic", "generic", (5,)),
    ]


def test_pattern_traced_on_2d_examples_matches_3d_inputs_and_fills_dense_meta():
    """Example shapes are free: extra leading axes still match; the built-in dense tag gets its meta."""
    pat = patterns.GraphPattern("seq_dense", tags.dense, dense_function, lambda eqns: {}, [np.zeros([2, 3]), [np.zeros([3, 4]), np.zeros([4])]])
    p, batch = _mlp_args(x_shape=(2, 7, 3))
    pj, got = _sites(_mlp_loss, (p, batch), graph_patterns=(pat,))
    assert got[:2] == [("dense", "seq_dense", (0, 1)), ("dense", "seq_dense", (3, 2))]
    assert pj.layer_sites[0].meta == {"kernel_layout": "io", "input_feature_axis": -1, "output_feature_axis": -1}
    builtin = transforms.ProcessedJaxpr.make_from_func(_mlp_loss, (p, batch))
    for mine, ref in zip(pj.layer_tags[:2], builtin.layer_tags[:2]):
        assert (mine.inputs, mine.outputs, mine.params) == (ref.inputs, ref.outputs, ref.params)
        curvax.DenseTwoKroneckerFactored(mine, "x")  # the built-in block accepts the layer


masked = curvax.LayerTag("masked_dense", num_inputs=1, num_outputs=1)
two_matmul = curvax.LayerTag("two_matmul", num_inputs=1, num_outputs=1)
masked_pattern = patterns.GraphPattern(
    "masked_dense", masked, lambda x, p: x @ (p[0] * p[1]), lambda eqns: {"n_eqns": len(eqns)},
    [np.zeros([2, 3]), [np.zeros([3, 4]), np.zeros([3, 4])]],
)


def _two_matmul_pattern(precedence=0):
    return patterns.GraphPattern(
        "two_matmul", two_matmul, lambda x, p: x @ p[0] @ p[1], lambda eqns: {"ops": tuple(e.primitive.name for e in eqns)}, [np.zeros([2, 3]), [np.zeros([3, 4]), np.zeros([4, 5])]],
        precedence=precedence,
    )


def _unknown_layers_loss(jit: bool):
    def model(p, x):
        h = jnp.tanh(x @ (p["m"] * p["w"]))  # mask first: the operands of `mul` are swapped
        return h @ p["u"] @ p["v"]

    model = jax.jit(model) if jit else model

    def loss(p, batch):
        out = model(p, batch[0])
        curvax.register_squared_error_loss(out, batch[1])
        return jnp.sum((out - batch[1]) ** 2)

    p = {
        "m": jnp.asarray((RNG.uniform(size=(3, 4)) < 0.7).astype(float)), "u": jnp.asarray(RNG.normal(size=(4, 6))),
        "v": jnp.asarray(RNG.normal(size=(6, 2))), "w": jnp.asarray(RNG.normal(size=(3, 4))),
    }
    return loss, p, (jnp.asarray(RNG.normal(size=(5, 3))), jnp.asarray(RNG.normal(size=(5, 2))))


@pytest.mark.parametrize("mode", ["plain", "jit", "value_and_grad"])
def test_user_patterns_find_layers_curvax_does_not_know(mode):
    loss, p, batch = _unknown_layers_loss(jit=mode == "jit")
    if mode == "value_and_grad":  # what the optimizer traces
        loss = (lambda f: lambda p, b: jax.value_and_grad(f)(p, b)[0])(loss)
    gp = (masked_pattern, _two_matmul_pattern()) + patterns.DEFAULT_GRAPH_PATTERNS
    pj, got = _sites(loss, (p, batch), graph_patterns=gp)
    # Leaves: m 0, u 1, v 2, w 3; params in the pattern's order (w then m; u then v).
    # `w * m` is symmetric, so either order of the two is a valid match.
    assert [(t, n, tuple(sorted(i))) for t, n, i in got] == [
        ("masked_dense", "masked_dense", (0, 3)), ("two_matmul", "two_matmul", (1, 2))
    ]
    # The extractors see the matched model equations.
    assert pj.layer_sites[0].meta == {"n_eqns": 2}
    assert pj.layer_sites[1].meta == {"ops": ("dot_general", "dot_general")}
    # The built-in patterns alone see `u` and `v` as two ordinary dense layers.
    _, builtin = _sites(loss, (p, batch))
    assert ("dense", "dense_no_bias", (1,)) in builtin and ("dense", "dense_no_bias", (2,)) in builtin


def test_pattern_layer_data_matches_autodiff():
    """Inputs, output cotangents and parameter cotangents of a pattern-found layer equal an oracle."""
    loss, p, batch = _unknown_layers_loss(jit=False)
    f = curvax.layer_tags_vjp(loss, graph_patterns=(masked_pattern, _two_matmul_pattern()))
    losses, vjp = f((p, batch))
    cot = jnp.asarray(RNG.normal(size=batch[1].shape))
    sites = f.processed_jaxpr.first.layer_sites
    by_tag = {site.tag.name: d for site, d in zip(sites, vjp([(cot,)]))}
    masked_indices = {s.tag.name: s.param_indices for s in sites}["masked_dense"]
    x = batch[0]
    h = jnp.tanh(x @ (p["m"] * p["w"]))
    # two_matmul: y = h @ u @ v is the model output, so its cotangent is `cot` itself.
    np.testing.assert_allclose(by_tag["two_matmul"]["inputs"][0], h, rtol=1e-12)
    np.testing.assert_allclose(by_tag["two_matmul"]["outputs_tangent"][0], cot, rtol=1e-12)
    # masked_dense: y = x @ (m * w); dL/dy through tanh and the two matmuls.
    y = x @ (p["m"] * p["w"])
    _, pull = jax.vjp(lambda y: jnp.tanh(y) @ p["u"] @ p["v"], y)
    np.testing.assert_allclose(by_tag["masked_dense"]["inputs"][0], x, rtol=1e-12)
    np.testing.assert_allclose(by_tag["masked_dense"]["outputs_tangent"][0], pull(cot)[0], rtol=1e-10)
    _, pull_p = jax.vjp(lambda q: jnp.tanh(x @ (q["m"] * q["w"])) @ q["u"] @ q["v"], p)
    want = jax.tree_util.tree_leaves(pull_p(cot)[0])
    for i, g in zip(masked_indices, by_tag["masked_dense"]["params_tangent"]):
        np.testing.assert_allclose(g, want[i], rtol=1e-10)


def test_pattern_with_a_custom_jvp_function_matches_under_value_and_grad():
    relu_dense = curvax.LayerTag("relu_dense", num_inputs=1, num_outputs=1)
    pat = patterns.GraphPattern(
        "relu_dense", relu_dense, lambda x, q: jax.nn.relu(x @ q[0]), lambda eqns: {}, [np.zeros([2, 3]), [np.zeros([3, 4])]]
    )
    _, p, batch = _unknown_layers_loss(jit=False)

    def loss(q, b):
        out = jax.nn.relu(b[0] @ q["a"]) @ q["b"]
        curvax.register_squared_error_loss(out, b[1])
        return jnp.sum((out - b[1]) ** 2)

    value = lambda q, b: jax.value_and_grad(loss)(q, b)[0]
    _, got = _sites(value, ({"a": p["w"], "b": p["u"][:, :2]}, batch), graph_patterns=(pat,))
    assert got == [("relu_dense", "relu_dense", (0,)), ("generic", "generic", (1,))]


def test_layer_whose_intermediate_is_used_elsewhere_is_not_matched():
    def make_loss(leak: bool):
        def loss(p, batch):
            h = batch[0] @ p["u"]
            out = h @ p["v"]
            if leak:
                out = out + jnp.sum(h, axis=1, keepdims=True)  # `h` leaves the would-be layer
            curvax.register_squared_error_loss(out, batch[1])
            return jnp.sum((out - batch[1]) ** 2)

        return loss

    _, _, batch = _unknown_layers_loss(jit=False)
    p = {"u": jnp.ones((3, 4)), "v": jnp.ones((4, 2))}
    _, got = _sites(make_loss(True), (p, batch), graph_patterns=(_two_matmul_pattern(),))
    assert got == [("generic", "generic", (0,)), ("generic", "generic", (1,))]
    _, got = _sites(make_loss(False), (p, batch), graph_patterns=(_two_matmul_pattern(),))
    assert got == [("two_matmul", "two_matmul", (0, 1))]


def test_a_parameter_is_never_a_layer_input():
    mm = curvax.LayerTag("mm", num_inputs=1, num_outputs=1)
    pat = patterns.GraphPattern("mm", mm, lambda x, q: x @ q[0], lambda eqns: {}, [np.zeros([2, 3]), [np.zeros([3, 4])]])

    def loss(q, b):
        out = b[0] @ (q["c"] @ q["d"])  # `c @ d` has the shape of `x @ w`, but `c` is a parameter
        curvax.register_squared_error_loss(out, b[1])
        return jnp.sum((out - b[1]) ** 2)

    _, _, batch = _unknown_layers_loss(jit=False)
    q = {"c": jnp.ones((3, 4)), "d": jnp.ones((4, 2))}
    assert _sites(loss, (q, batch), graph_patterns=(pat,))[1] == [("generic", "generic", (0,)), ("generic", "generic", (1,))]


def test_precedence_then_position_decide_between_patterns_at_the_same_equation():
    loss, p, batch = _unknown_layers_loss(jit=False)
    defaults = patterns.DEFAULT_GRAPH_PATTERNS
    _, first = _sites(loss, (p, batch), graph_patterns=(_two_matmul_pattern(),) + defaults)
    _, last = _sites(loss, (p, batch), graph_patterns=defaults + (_two_matmul_pattern(),))
    _, high = _sites(loss, (p, batch), graph_patterns=defaults + (_two_matmul_pattern(precedence=1),))
    assert ("two_matmul", "two_matmul", (1, 2)) in first and first == high
    assert ("dense", "dense_no_bias", (1,)) in last and ("dense", "dense_no_bias", (2,)) in last


def test_patterns_to_skip_takes_pattern_and_kind_names():
    loss, p, batch = _unknown_layers_loss(jit=False)
    gp = (masked_pattern, _two_matmul_pattern()) + patterns.DEFAULT_GRAPH_PATTERNS
    _, got = _sites(loss, (p, batch), graph_patterns=gp, patterns_to_skip=("two_matmul",))
    assert [g[:2] for g in got] == [("masked_dense", "masked_dense"), ("dense", "dense_no_bias"), ("dense", "dense_no_bias")]
    assert [g[2] for g in got][1:] == [(1,), (2,)]
    _, got = _sites(loss, (p, batch), graph_patterns=gp, patterns_to_skip=("two_matmul", "dense_no_bias"))
    assert [g[0] for g in got] == ["masked_dense", "generic", "generic"]
    _, got = _sites(loss, (p, batch), graph_patterns=gp, patterns_to_skip=("masked_dense", "dense"))
    assert [g[1] for g in got] == ["generic", "two_matmul", "generic"]
    with pytest.raises(ValueError, match="patterns_to_skip"):
        _sites(loss, (p, batch), graph_patterns=gp, patterns_to_skip=("no_such_pattern",))


def test_empty_graph_patterns_register_only_generic_layers():
    p, batch = _mlp_args()
    _, got = _sites(_mlp_loss, (p, batch), graph_patterns=())
    assert got == [("generic", "generic", (i,)) for i in range(6)]


def test_default_graph_patterns_follow_the_registry(monkeypatch):
    names = [n for m in detection.registered_matchers() for n in m.pattern_names]
    assert [g.name for g in patterns.DEFAULT_GRAPH_PATTERNS] == names
    p, batch = _mlp_args()
    assert _sites(_mlp_loss, (p, batch), graph_patterns=patterns.DEFAULT_GRAPH_PATTERNS)[1] == _sites(_mlp_loss, (p, batch))[1]
    # A kind registered later shows up without re-importing anything.
    kind = detection.LayerMatcher("scale_only", lambda program, idx, ctx: None, ("scale_only_pattern",))
    monkeypatch.setitem(detection._MATCHERS, "scale_only", kind)
    assert "scale_only_pattern" in [g.name for g in patterns.DEFAULT_GRAPH_PATTERNS]


def test_bad_patterns_get_clear_errors():
    p, batch = _mlp_args()
    with pytest.raises(TypeError, match=r"graph_patterns`\[1\]"):
        _sites(_mlp_loss, (p, batch), graph_patterns=(dense_with_bias_pattern, "dense"))
    with pytest.raises(TypeError, match="graph_patterns"):
        _sites(_mlp_loss, (p, batch), graph_patterns=dense_with_bias_pattern)
    args = [np.zeros([2, 3]), [np.zeros([3, 4])]]
    with pytest.raises(TypeError, match="tag_primitive"):
        patterns.GraphPattern("p", "dense", dense_function, dict, args)
    with pytest.raises(TypeError, match="compute_func"):
        patterns.GraphPattern("p", dense, None, dict, args)
    with pytest.raises(ValueError, match="example_args"):
        patterns.GraphPattern("p", dense, dense_function, dict, [np.zeros([2, 3])])
    with pytest.raises(ValueError, match="1 inputs"):
        patterns.GraphPattern("p", dense, dense_function, dict, [[np.zeros([2, 3]), np.zeros(3)], [np.zeros([3, 4])]])
    with pytest.raises(NotImplementedError, match="in_values_preprocessor"):
        patterns.GraphPattern("p", dense, dense_function, dict, args, in_values_preprocessor=lambda v: v)
    unused = patterns.GraphPattern("p", dense, lambda x, q: x @ q[0], dict, [np.zeros([2, 3]), [np.zeros([3, 4]), np.zeros(4)]])
    with pytest.raises(ValueError, match="does not depend on parameter leaves \\[1\\]"):
        _sites(_mlp_loss, (p, batch), graph_patterns=(unused,))
    bad_meta = patterns.GraphPattern("p", dense, dense_function, lambda eqns: None, args)
    with pytest.raises(TypeError, match="parameters_extractor_func"):
        _sites(_mlp_loss, (p, batch), graph_patterns=(bad_meta,))
