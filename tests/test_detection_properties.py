"""Property-based detection tests: random MLP and CNN architectures register exactly their layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import curvax

ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu, "gelu": jax.nn.gelu, "none": lambda x: x}
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


def _detected(loss, params, batch):
    pj = curvax.ProcessedJaxpr.make_from_func(loss, (params, batch))
    paths = curvax.utils.param_paths(params)
    return sorted((s.tag.name, s.pattern, tuple(paths[i] for i in s.param_indices)) for s in pj.layer_sites)


@st.composite
def mlps(draw):
    depth = draw(st.integers(1, 3))
    widths = draw(st.lists(st.integers(1, 5), min_size=depth + 1, max_size=depth + 1))
    layers = [
        {
            "bias": draw(st.booleans()),
            "layout": draw(st.sampled_from(["io", "oi"])),
            "act": draw(st.sampled_from(sorted(ACTIVATIONS))),
            "jit": draw(st.booleans()),
        }
        for _ in range(depth)
    ]
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    return widths, layers, lead


@SETTINGS
@given(mlps())
def test_random_mlps_register_one_dense_layer_per_weight(arch):
    widths, layers, lead = arch
    rng = np.random.default_rng(0)
    params = {}
    for i, spec in enumerate(layers):
        shape = (widths[i], widths[i + 1]) if spec["layout"] == "io" else (widths[i + 1], widths[i])
        params[f"l{i}"] = {"w": jnp.asarray(rng.normal(size=shape))}
        if spec["bias"]:
            params[f"l{i}"]["b"] = jnp.asarray(rng.normal(size=widths[i + 1]))

    def layer(p, spec_items, x):
        spec = dict(spec_items)
        y = x @ p["w"] if spec["layout"] == "io" else jnp.einsum("oi,...i->...o", p["w"], x)
        if spec["bias"]:
            y = y + p["b"]
        return ACTIVATIONS[spec["act"]](y)

    def loss(p, batch):
        x = batch[0]
        for i, spec in enumerate(layers):
            fn = jax.jit(layer, static_argnums=1) if spec["jit"] else layer  # layers inside nested jit too
            x = fn(p[f"l{i}"], tuple(sorted(spec.items())), x)
        curvax.register_squared_error_loss(x, batch[1])
        return jnp.sum((x - batch[1]) ** 2)

    batch = (jnp.ones(lead + (widths[0],)), jnp.zeros(lead + (widths[-1],)))
    want = sorted(
        ("dense", "dense_with_bias" if spec["bias"] else "dense_no_bias",
         (f"l{i}/w", f"l{i}/b") if spec["bias"] else (f"l{i}/w",))
        for i, spec in enumerate(layers)
    )
    assert _detected(loss, params, batch) == want


@st.composite
def cnns(draw):
    depth = draw(st.integers(1, 2))
    convs = [
        {
            "k": draw(st.integers(1, 3)),
            "stride": draw(st.integers(1, 2)),
            "padding": draw(st.sampled_from(["SAME", "VALID"])),
            "bias": draw(st.booleans()),
            "cout": draw(st.integers(1, 3)),
            "dilation": draw(st.integers(1, 2)),
        }
        for _ in range(depth)
    ]
    return convs, draw(st.booleans())


@SETTINGS
@given(cnns())
def test_random_cnns_register_every_conv_and_the_head(arch):
    convs, head_bias = arch
    rng = np.random.default_rng(1)
    params, cin, hw = {}, 2, 8
    for i, c in enumerate(convs):
        params[f"c{i}"] = {"w": jnp.asarray(rng.normal(size=(c["k"], c["k"], cin, c["cout"])))}
        if c["bias"]:
            params[f"c{i}"]["b"] = jnp.asarray(rng.normal(size=c["cout"]))
        cin = c["cout"]

    def features(p, x):
        for i, c in enumerate(convs):
            x = jax.lax.conv_general_dilated(
                x, p[f"c{i}"]["w"], (c["stride"],) * 2, c["padding"], rhs_dilation=(c["dilation"],) * 2,
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
            )
            if c["bias"]:
                x = x + p[f"c{i}"]["b"]
            x = jax.nn.relu(x)
        return x.reshape(x.shape[0], -1)

    x = jnp.ones((2, hw, hw, 2))
    n_feat = jax.eval_shape(lambda: features(params, x)).shape[1]
    params["head"] = {"w": jnp.asarray(rng.normal(size=(n_feat, 3)))}
    if head_bias:
        params["head"]["b"] = jnp.zeros(3)

    def loss(p, batch):
        y = features(p, batch[0]) @ p["head"]["w"]
        if head_bias:
            y = y + p["head"]["b"]
        curvax.register_softmax_cross_entropy_loss(y, batch[1])
        return jnp.sum(jax.nn.logsumexp(y, axis=-1))

    want = [
        ("conv2d", "conv2d_with_bias" if c["bias"] else "conv2d_no_bias",
         (f"c{i}/w", f"c{i}/b") if c["bias"] else (f"c{i}/w",))
        for i, c in enumerate(convs)
    ]
    want.append(("dense", "dense_with_bias" if head_bias else "dense_no_bias",
                 ("head/w", "head/b") if head_bias else ("head/w",)))
    assert _detected(loss, params, (x, jnp.zeros(2, jnp.int32))) == sorted(want)
