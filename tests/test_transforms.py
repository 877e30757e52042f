"""loss_tags_vjp/jvp/hvp and layer_tags_vjp against jax.vjp / jax.jvp / Hessian oracles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax

KEY = jax.random.PRNGKey(0)


pytestmark = pytest.mark.usefixtures("x64")


def model(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return h @ p["w2"]


def setup():
    ks = jax.random.split(KEY, 5)
    params = {"w1": jax.random.normal(ks[0], (3, 4)), "b1": jax.random.normal(ks[1], (4,)), "w2": jax.random.normal(ks[2], (4, 2))}
    batch = (jax.random.normal(ks[3], (5, 3)), jax.random.normal(ks[4], (5, 2)))

    def loss(p, b):
        out = model(p, b[0])
        curvax.register_normal_predictive_distribution(out, b[1], variance=0.5)
        return jnp.mean(jnp.sum((out - b[1]) ** 2, -1))

    return loss, params, batch


def test_loss_tags_vjp_equals_jax_vjp():
    loss, params, batch = setup()
    losses, vjp = curvax.loss_tags_vjp(loss)((params, batch))
    np.testing.assert_allclose(losses[0].parameter_dependants[0], model(params, batch[0]), rtol=1e-12)
    cot = jax.random.normal(KEY, (5, 2))
    _, oracle = jax.vjp(lambda p: model(p, batch[0]), params)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10), vjp([(cot,)]), oracle(cot)[0])


def test_loss_tags_jvp_equals_jax_jvp():
    loss, params, batch = setup()
    tangent = jax.tree_util.tree_map(lambda x: jnp.ones_like(x) * 0.3, params)
    losses, tangents = curvax.loss_tags_jvp(loss)((params, batch), tangent)
    _, want = jax.jvp(lambda p: model(p, batch[0]), (params,), (tangent,))
    np.testing.assert_allclose(tangents[0][0], want, rtol=1e-10)


def test_loss_tags_hvp_equals_dense_hessian():
    loss, params, batch = setup()
    flat, unravel = ravel_pytree(params)
    v = jax.random.normal(KEY, flat.shape)
    hv, _ = curvax.loss_tags_hvp(loss)((params, batch), unravel(v))

    def total(f):  # sum over examples of the registered loss: 0.5 * sum (out - y)^2 / 0.5 + const
        out = model(unravel(f), batch[0])
        return jnp.sum((out - batch[1]) ** 2)

    np.testing.assert_allclose(ravel_pytree(hv)[0], jax.hessian(total)(flat) @ v, rtol=1e-8)


def test_layer_tags_vjp_output_gradients_equal_explicit_perturbation_oracle():
    loss, params, batch = setup()
    losses, vjp = curvax.layer_tags_vjp(loss)((params, batch))
    cot = jax.random.normal(KEY, (5, 2))
    data = vjp([(cot,)])

    def perturbed(e1, e2):
        h = jnp.tanh(batch[0] @ params["w1"] + params["b1"] + e1)
        return h @ params["w2"] + e2

    e1, e2 = jnp.zeros((5, 4)), jnp.zeros((5, 2))
    _, pb = jax.vjp(perturbed, e1, e2)
    d1, d2 = pb(cot)
    np.testing.assert_allclose(data[0]["outputs_tangent"][0], d1, rtol=1e-10)
    np.testing.assert_allclose(data[1]["outputs_tangent"][0], d2, rtol=1e-10)
    np.testing.assert_allclose(data[1]["inputs"][0], jnp.tanh(batch[0] @ params["w1"] + params["b1"]), rtol=1e-10)


def test_results_split_over_half_batches():
    """vjp results are sums over examples: two half batches add up to the full batch."""
    loss, params, batch = setup()
    f = curvax.loss_tags_vjp(loss)
    cot = jax.random.normal(KEY, (5, 2))
    full = ravel_pytree(f((params, batch))[1]([(cot,)]))[0]
    a = ravel_pytree(f((params, (batch[0][:2], batch[1][:2])))[1]([(cot[:2],)]))[0]
    b = ravel_pytree(f((params, (batch[0][2:], batch[1][2:])))[1]([(cot[2:],)]))[0]
    np.testing.assert_allclose(a + b, full, rtol=1e-10)


def test_wrong_cotangent_shapes_are_reported():
    loss, params, batch = setup()
    _, vjp = curvax.loss_tags_vjp(loss)((params, batch))
    with pytest.raises(ValueError, match="one entry per registered loss"):
        vjp([])
    with pytest.raises(ValueError, match="shapes"):
        vjp([(jnp.ones((5, 3)),)])


def test_processed_jaxpr_from_documented_constructor_equals_make_from_func():
    loss, params, batch = setup()
    pj = curvax.ProcessedJaxpr.make_from_func(loss, (params, batch))
    closed = jax.make_jaxpr(loss)(params, batch)
    again = curvax.ProcessedJaxpr(closed.jaxpr, closed.consts, jax.tree_util.tree_structure((params, batch)), 0)
    assert [t.tag_name for t in again.layer_tags] == [t.tag_name for t in pj.layer_tags] == ["dense", "dense"]
    assert again.layer_indices == pj.layer_indices and len(again.loss_tags) == len(pj.loss_tags) == 1
    # Its variables are the jaxpr's, split as the arguments are.
    assert again.in_vars_flat == list(closed.jaxpr.invars)
    leaves = jax.tree_util.tree_leaves(params)
    assert [v.aval.shape for v in jax.tree_util.tree_leaves(again.params_vars)] == [x.shape for x in leaves]
    assert jax.tree_util.tree_structure(again.params_vars) == jax.tree_util.tree_structure(params)
    assert again.params_vars_flat == list(closed.jaxpr.invars[: len(leaves)])
    # And it evaluates the same loss input as the function.
    p, o = again.split_args((params, batch))
    (deps, _), _ = again.evaluate(p, o)
    np.testing.assert_allclose(deps[0][0], model(params, batch[0]), rtol=1e-12)


def test_processed_jaxpr_bad_input():
    loss, params, batch = setup()
    with pytest.raises(TypeError, match="make_from_func"):
        curvax.ProcessedJaxpr(loss, (params, batch), None)
    closed = jax.make_jaxpr(loss)(params, batch)
    with pytest.raises(ValueError, match="params_index=2"):
        curvax.ProcessedJaxpr(closed.jaxpr, closed.consts, jax.tree_util.tree_structure((params, batch)), 2)
    with pytest.raises(ValueError, match="leaves"):
        curvax.ProcessedJaxpr(closed.jaxpr, closed.consts, jax.tree_util.tree_structure((params,)), 0)


def test_left_out_parameters_are_an_error_only_without_automatic_registration():
    loss, params, batch = setup()
    with pytest.raises(ValueError, match="not part of any registered layer"):
        curvax.ProcessedJaxpr.make_from_func(loss, (params, batch), auto_register_tags=False)
    manual = curvax.ProcessedJaxpr.make_from_func(loss, (params, batch), auto_register_tags=False,
                                                  allow_left_out_params=True)
    assert {t.tag_name for t in manual.layer_tags} == {"generic"}
    auto = curvax.ProcessedJaxpr.make_from_func(loss, (params, batch))
    assert [t.tag_name for t in auto.layer_tags] == ["dense", "dense"]
