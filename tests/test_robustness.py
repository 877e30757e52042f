"""Models with primitives curvax knows nothing about: host callbacks, custom derivatives, kernels, loops.

Detection must not crash on them, must still find the layers around them, and
the optimizer must train the model. The user's own backward pass (inside
``value_and_grad_func``) is evaluated but never differentiated again, so a
custom backward rule that JAX cannot differentiate (a host callback, a kernel)
is fine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import transforms


def host(fn, x):
    """``fn`` run on the host through ``jax.pure_callback`` (no JAX derivative rules at all)."""
    return jax.pure_callback(fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="broadcast_all")


@jax.custom_jvp
def host_tanh(x):
    return host(np.tanh, x)


host_tanh.defjvp(lambda p, t: (host_tanh(p[0]), t[0] * (1 - host_tanh(p[0]) ** 2)))


@jax.custom_vjp
def double_with_host_backward(x):
    return 2.0 * x


double_with_host_backward.defvjp(lambda x: (2.0 * x, None), lambda _, g: (host(lambda a: 2.0 * a, g),))


def make_problem():
    def loss(p, batch):
        x, t = batch
        x = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] * 0.9), (0, x))[1]  # input path
        h = host_tanh(x @ p["w1"] + p["b1"])
        h = double_with_host_backward(h @ p["w2"])
        h = jax.lax.fori_loop(0, 2, lambda i, c: c * p["gate"], h)
        out = h @ p["w3"]
        curvax.register_squared_error_loss(out, t)
        return jnp.mean(jnp.sum((out - t) ** 2, -1))

    k = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {
        "w1": jax.random.normal(k[0], (3, 4)), "b1": jnp.zeros(4), "w2": jax.random.normal(k[1], (4, 4)) / 2,
        "gate": jnp.ones(4) * 0.9, "w3": jax.random.normal(k[2], (4, 2)),
    }
    batch = (jax.random.normal(k[3], (16, 3)), jax.random.normal(k[4], (16, 2)))
    return loss, params, batch


def test_unknown_primitives_do_not_crash_detection_and_the_layers_around_them_are_found():
    loss, params, batch = make_problem()
    pj = transforms.ProcessedJaxpr.make_from_func(loss, (params, batch))
    paths = sorted(params)
    by_param = {tuple(paths[i] for i in s.param_indices): s for s in pj.layer_sites}
    assert by_param[("w1", "b1")].pattern == "dense_with_bias"
    assert by_param[("w2",)].pattern == "dense_no_bias" and by_param[("w3",)].pattern == "dense_no_bias"
    assert by_param[("gate",)].pattern == "generic"
    line = next(l for l in pj.registration_table(params).splitlines() if l.strip().startswith("gate"))
    assert "generic fallback" in line and "lax.scan" in line


def test_optimizer_trains_through_host_callbacks_and_custom_rules():
    loss, params, batch = make_problem()
    opt = curvax.Optimizer(
        jax.value_and_grad(loss), l2_reg=0.0, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
        use_adaptive_damping=True, initial_damping=1.0, num_burnin_steps=0,
    )
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    losses = []
    for i in range(5):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=batch)
        losses.append(float(stats["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0]


def test_only_the_value_output_is_differentiated():
    """``evaluate(with_outputs=True)``: the value keeps its derivative, the user's gradient is read only."""
    loss, params, batch = make_problem()
    vg = jax.value_and_grad(loss)
    pj = transforms.ProcessedJaxpr.make_from_func(vg, (params, batch))
    p, o = pj.split_args((params, batch))

    def value(q):
        (_, outs), _ = pj.evaluate(q, o, with_outputs=True)
        return outs[0]

    def grad_output_sum(q):
        (_, outs), _ = pj.evaluate(q, o, with_outputs=True)
        return sum(jnp.sum(g) for g in outs[1:])

    want = jax.tree_util.tree_leaves(jax.grad(loss)(params, batch))
    got = jax.grad(value)(p)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert all(np.all(np.asarray(g) == 0) for g in jax.grad(grad_output_sum)(p))
    (_, outs), _ = pj.evaluate(p, o, with_outputs=True)
    for a, b in zip(outs[1:], want):  # the values themselves are the user's gradient
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_kernel_in_a_custom_backward_rule():
    pl = pytest.importorskip("jax.experimental.pallas")

    def scale_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    def kernel_double(x):
        return pl.pallas_call(scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    @jax.custom_vjp
    def op(x):
        return 2.0 * x

    op.defvjp(lambda x: (2.0 * x, None), lambda _, g: (kernel_double(g),))

    def loss(p, batch):
        out = jnp.tanh(op(batch[0] @ p["w1"])) @ p["w2"]
        curvax.register_squared_error_loss(out, batch[1])
        return jnp.mean(jnp.sum((out - batch[1]) ** 2, -1))

    k = jax.random.split(jax.random.PRNGKey(2), 4)
    params = {"w1": jax.random.normal(k[0], (3, 4)) / 2, "w2": jax.random.normal(k[1], (4, 2))}
    batch = (jax.random.normal(k[2], (8, 3)), jax.random.normal(k[3], (8, 2)))
    opt = curvax.Optimizer(
        jax.value_and_grad(loss), l2_reg=0.0, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
        use_adaptive_damping=True, initial_damping=1.0, num_burnin_steps=0,
    )
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    assert "generic" not in opt.registration_table()
    losses = []
    for i in range(4):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=batch)
        losses.append(float(stats["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
