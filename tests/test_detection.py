"""Automatic layer detection: every framework's MLP registers the same dense layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import transforms

from models import FRAMEWORK_MLPS


def _value_func(loss_fn):
    vg = jax.value_and_grad(loss_fn)
    return lambda p, b: vg(p, b)[0]


@pytest.mark.parametrize("framework", sorted(FRAMEWORK_MLPS))
def test_framework_mlp_registers_two_dense_layers_with_bias(framework):
    loss_fn, params, batch = FRAMEWORK_MLPS[framework](jax.random.PRNGKey(0))
    pj = transforms.ProcessedJaxpr.make_from_func(_value_func(loss_fn), (params, batch))
    assert [s.pattern for s in pj.layer_sites] == ["dense_with_bias", "dense_with_bias"]
    assert [s.tag.name for s in pj.layer_sites] == ["dense", "dense"]
    # Every parameter leaf belongs to exactly one layer.
    covered = sorted(i for s in pj.layer_sites for i in s.param_indices)
    assert covered == list(range(len(jax.tree_util.tree_leaves(params))))
    # Canonical (features-last) shapes: 3 -> 5 and 5 -> 2 (order follows the parameter tree).
    dims = sorted((e.inputs[0].shape[-1], e.outputs[0].shape[-1]) for e in pj.layer_tags)
    assert dims == [(3, 5), (5, 2)]


@pytest.mark.parametrize("framework", sorted(FRAMEWORK_MLPS))
def test_framework_mlp_layer_data_matches_autodiff(framework):
    """Inputs and output cotangents of each detected layer equal an autodiff oracle."""
    loss_fn, params, batch = FRAMEWORK_MLPS[framework](jax.random.PRNGKey(1))
    f = curvax.layer_tags_vjp(_value_func(loss_fn))
    losses, vjp = f((params, batch))
    cot = jax.random.normal(jax.random.PRNGKey(2), losses[0].parameter_dependants[0].shape)
    data = vjp([(cot,)])
    # The parameter cotangents equal jax.vjp of the model output w.r.t. the parameters.
    out_fn = lambda p: losses_output(loss_fn, p, batch)
    _, pullback = jax.vjp(out_fn, params)
    (want,) = pullback(cot)
    want_leaves = jax.tree_util.tree_leaves(want)
    pj = f.processed_jaxpr.first
    for site, d in zip(pj.layer_sites, data):
        for i, g in zip(site.param_indices, d["params_tangent"]):
            np.testing.assert_allclose(g, want_leaves[i], rtol=1e-5, atol=1e-5)
    # The output layer's output cotangent is the loss cotangent itself; the input layer sees the data.
    by_out = {d["outputs_tangent"][0].shape[-1]: d for d in data}
    np.testing.assert_allclose(by_out[2]["outputs_tangent"][0], cot, rtol=1e-6)
    np.testing.assert_allclose(by_out[5]["inputs"][0], batch[0], rtol=1e-6)


def losses_output(loss_fn, params, batch):
    """The model output that the loss registers (traced through the loss function)."""
    captured = {}
    orig = curvax.register_squared_error_loss

    def capture(out, y=None, weight=1.0):
        captured["out"] = out
        return out

    curvax.register_squared_error_loss = capture
    try:
        loss_fn(params, batch)
    finally:
        curvax.register_squared_error_loss = orig
    return captured["out"]


def test_dense_inside_nested_jit_is_detected():
    w = jnp.ones((3, 4))
    b = jnp.zeros(4)

    @jax.jit
    def layer(x, w, b):
        return jax.jit(lambda x, w: x @ w)(x, w) + b

    def loss(p, batch):
        out = layer(batch[0], p["w"], p["b"])
        curvax.register_squared_error_loss(out, batch[1])
        return jnp.mean((out - batch[1]) ** 2)

    pj = transforms.ProcessedJaxpr.make_from_func(_value_func(loss), ({"w": w, "b": b}, (jnp.ones((2, 3)), jnp.ones((2, 4)))))
    assert [s.pattern for s in pj.layer_sites] == ["dense_with_bias"]


def test_weight_sharing_and_unknown_ops_fall_back_to_generic():
    """A weight used twice and a parameter inside a custom_jvp function never crash detection."""

    @jax.custom_jvp
    def weird(x, s):
        return x * s

    weird.defjvp(lambda primals, tangents: (weird(*primals), tangents[0] * primals[1] + primals[0] * tangents[1]))

    def loss(p, batch):
        h = jnp.tanh(batch[0] @ p["w"]) @ p["w"].T  # w used twice
        out = weird(h, p["s"])
        curvax.register_squared_error_loss(out, batch[1])
        return jnp.mean((out - batch[1]) ** 2)

    params = {"w": jnp.ones((3, 3)), "s": jnp.ones(3)}
    pj = transforms.ProcessedJaxpr.make_from_func(_value_func(loss), (params, (jnp.ones((2, 3)), jnp.ones((2, 3)))))
    # The custom_jvp function is read through (its operand is a parameter): ``x * s`` is a scale layer.
    assert [s.pattern for s in pj.layer_sites] == ["scale_only", "generic"]
    assert any("weight sharing" in n for n in pj.notes)
    table = pj.registration_table(params)
    assert "generic fallback" in table


def test_manual_registration_wins_and_patterns_can_be_skipped():
    def loss(p, batch):
        x = batch[0]
        y = curvax.register_dense(x @ p["w"] + p["b"], x, p["w"], p["b"])
        out = y @ p["v"]
        curvax.register_squared_error_loss(out, batch[1])
        return jnp.mean((out - batch[1]) ** 2)

    params = {"b": jnp.zeros(4), "v": jnp.ones((4, 2)), "w": jnp.ones((3, 4))}
    args = (params, (jnp.ones((2, 3)), jnp.ones((2, 2))))
    pj = transforms.ProcessedJaxpr.make_from_func(_value_func(loss), args)
    assert sorted(s.pattern for s in pj.layer_sites) == ["dense_no_bias", "manual"]
    pj = transforms.ProcessedJaxpr.make_from_func(_value_func(loss), args, patterns_to_skip=("dense_no_bias",))
    assert sorted(s.pattern for s in pj.layer_sites) == ["generic", "manual"]
    pj = transforms.ProcessedJaxpr.make_from_func(_value_func(loss), args, register_only_generic=True)
    assert sorted(s.pattern for s in pj.layer_sites) == ["generic", "manual"]
    with pytest.raises(ValueError, match="patterns_to_skip"):
        transforms.ProcessedJaxpr.make_from_func(_value_func(loss), args, patterns_to_skip=("nope",))


def test_no_registered_loss_is_a_clear_error():
    loss = lambda p, b: jnp.mean((b[0] @ p["w"]) ** 2)
    with pytest.raises(ValueError, match="No loss is registered"):
        transforms.ProcessedJaxpr.make_from_func(loss, ({"w": jnp.ones((3, 2))}, (jnp.ones((2, 3)),)))


def test_auto_register_tags_binds_tags_and_keeps_values():
    loss_fn, params, batch = FRAMEWORK_MLPS["haiku"](jax.random.PRNGKey(0))
    tagged = curvax.auto_register_tags(_value_func(loss_fn), (params, batch), compute_only_loss_tags=False)
    jaxpr = jax.make_jaxpr(tagged)(params, batch)
    assert sum(e.primitive.name == "dense" for e in jaxpr.jaxpr.eqns) == 2
    np.testing.assert_allclose(tagged(params, batch), loss_fn(params, batch), rtol=1e-6)


def test_generic_fallbacks_are_explained_in_the_report():
    """Every fallback parameter says why it is generic; control flow does not crash detection."""

    def loss(p, batch):
        x, t = batch
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        h = h @ p["tied"] + jnp.sum(p["tied"])  # one parameter, two different uses

        def body(c, w):
            return jnp.tanh(c + jnp.sin(w)), None  # no layer pattern inside the scan

        h, _ = jax.lax.scan(body, h, p["stack"])
        h = jax.lax.cond(jnp.sum(h) > 0, lambda v: v * p["gate"], lambda v: v, h)
        out = h @ p["w2"]
        curvax.register_squared_error_loss(out, t)
        return jnp.mean((out - t) ** 2)

    params = {
        "b1": jnp.zeros(4), "gate": jnp.ones(4), "stack": jnp.ones((2, 4)) * 0.1,
        "tied": jnp.eye(4), "unused": jnp.ones(3), "w1": jnp.ones((3, 4)), "w2": jnp.ones((4, 2)),
    }
    args = (params, (jnp.ones((5, 3)), jnp.ones((5, 2))))
    pj = transforms.ProcessedJaxpr.make_from_func(_value_func(loss), args)
    by_param = {s.param_indices: s for s in pj.layer_sites}
    paths = sorted(params)  # dict leaves flatten in sorted key order
    idx = {k: (paths.index(k),) for k in paths}
    assert by_param[(paths.index("w1"), paths.index("b1"))].pattern == "dense_with_bias"
    assert by_param[idx["w2"]].pattern == "dense_no_bias"
    reasons = {k: by_param[idx[k]].meta["fallback_reason"] for k in ("gate", "stack", "tied", "unused")}
    assert "lax.cond" in reasons["gate"]
    assert "lax.scan" in reasons["stack"]
    assert "2 times" in reasons["tied"]
    assert "not used" in reasons["unused"]
    table = pj.registration_table(params)
    for k, why in reasons.items():
        line = next(line for line in table.splitlines() if line.strip().startswith(k))
        assert why in line
    assert "hint:" in table
