"""Embedding layers: the diagonal-input Kronecker block against dense K-FAC and the exact Fisher."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import blocks, tags, transforms
from curvax.layers import embedding as emb

pytestmark = pytest.mark.usefixtures("x64")

V, D, B, T = 6, 3, 4, 5


def sds(shape, dtype=jnp.float64):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def emb_eqn(batch=B, seq=T, mode="clip"):
    return tags.LayerTagEqn(
        primitive=emb.embedding, outputs=(sds((batch, seq, D)),), inputs=(sds((batch, seq), jnp.int32),),
        params=(sds((V, D)),), param_indices=(0,), meta={"mode": mode}, name="emb",
    )


def fitted(block, datas, batch=B, **init_kwargs):
    kwargs = dict(exact_powers_to_cache=None, approx_powers_to_cache=None, cache_eigenvalues=False)
    kwargs.update(init_kwargs)
    state = block.init(jax.random.PRNGKey(0), **kwargs)
    for i, d in enumerate(datas):
        state = block.update_curvature_matrix_estimate(state, d, 0.9 if i else 0.0, 1.0, batch)
    return state


def random_data(seed, batch=B, seq=T):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    ids = jax.random.randint(k1, (batch, seq), 0, V)
    return {"inputs": (ids,), "outputs_tangent": (jax.random.normal(k2, (batch, seq, D)),), "params": ()}


def test_equals_dense_kfac_with_explicit_one_hot_inputs():
    datas = [random_data(s) for s in (1, 2)]
    block = emb.EmbeddingKroneckerFactored(emb_eqn(), "emb")
    state = fitted(block, datas)
    dense_eqn = tags.LayerTagEqn(
        primitive=tags.dense, outputs=(sds((B, T, D)),), inputs=(sds((B, T, V)),), params=(sds((V, D)),),
        param_indices=(0,), meta={"kernel_layout": "io"}, name="dense",
    )
    dense = blocks.DenseTwoKroneckerFactored(dense_eqn, "dense")
    one_hot = [{**d, "inputs": (jax.nn.one_hot(d["inputs"][0], V, dtype=jnp.float64),)} for d in datas]
    dstate = fitted(dense, one_hot)
    np.testing.assert_allclose(jnp.diag(state.inputs_factor.value), dstate.inputs_factor.value, atol=1e-14)
    np.testing.assert_allclose(state.outputs_factor.value, dstate.outputs_factor.value, atol=1e-12)
    np.testing.assert_allclose(block.to_dense_matrix(state), dense.to_dense_matrix(dstate), atol=1e-12)
    np.testing.assert_allclose(
        jnp.sort(block.eigenvalues(state, False)), jnp.sort(dense.eigenvalues(dstate, False)), atol=1e-10
    )
    # The pi-damped approximate inverse and an exact power agree with the dense K-FAC block.
    v = (jax.random.normal(jax.random.PRNGKey(3), (V, D)),)
    for exact, p in ((False, -1), (True, -0.5)):
        np.testing.assert_allclose(
            block.multiply_matpower(state, v, 0.2, p, exact, False)[0],
            dense.multiply_matpower(dstate, v, 0.2, p, exact, False)[0], rtol=1e-8, atol=1e-12,
        )


def test_powers_and_cache_match_the_dense_matrix():
    block = emb.EmbeddingKroneckerFactored(emb_eqn(), "emb")
    state = fitted(block, [random_data(4)], exact_powers_to_cache=[-1, -0.5], approx_powers_to_cache=-1,
                   cache_eigenvalues=True)
    m = block.to_dense_matrix(state)
    s, q = jnp.linalg.eigh(m)
    v = (jax.random.normal(jax.random.PRNGKey(5), (V, D)),)
    cached = block.update_cache(state, 0.3, [-1, -0.5], -1, True)
    for p in (1, -1, -0.5):
        want = (q * (s + 0.3) ** p) @ q.T @ v[0].ravel()
        for use_cached in (False, True):
            got = block.multiply_matpower(cached, v, 0.3, p, True, use_cached)[0]
            np.testing.assert_allclose(got.ravel(), want, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(
        block.multiply_inverse(cached, v, 0.3, False, True)[0], block.multiply_inverse(state, v, 0.3, False, False)[0],
        rtol=1e-9,
    )
    np.testing.assert_allclose(jnp.sort(block.eigenvalues(cached, True)), jnp.sort(s), atol=1e-10)
    # Approximate product: diag(a + pi sqrt(w)) (x) (G + sqrt(w)/pi I) with pi from the average traces.
    a, g = state.inputs_factor.value, state.outputs_factor.value
    pi = jnp.sqrt(jnp.mean(a) / (jnp.trace(g) / D))
    damped = jnp.kron(jnp.diag(a + pi * jnp.sqrt(0.3)), g + jnp.sqrt(0.3) / pi * jnp.eye(D))
    np.testing.assert_allclose(block.multiply(state, v, 0.3, False, False)[0].ravel(), damped @ v[0].ravel(), rtol=1e-9)
    with pytest.raises(NotImplementedError, match="power"):
        block.init(jax.random.PRNGKey(0), None, -0.5, False)


def test_one_example_one_token_is_the_exact_fisher():
    data = random_data(6, batch=1, seq=1)
    (tok,), (dy,) = data["inputs"][0].ravel(), data["outputs_tangent"]
    g = jax.grad(lambda table: jnp.sum(table[tok] * dy))(jnp.zeros((V, D))).ravel()
    block = emb.EmbeddingKroneckerFactored(emb_eqn(1, 1), "emb")
    np.testing.assert_allclose(block.to_dense_matrix(fitted(block, [data], batch=1)), jnp.outer(g, g), atol=1e-14)


def test_out_of_range_ids_are_clipped_or_dropped():
    ids = jnp.array([[-3, 0, V + 2, 1, 1]] * B)
    dy = jnp.ones((B, T, D))
    data = {"inputs": (ids,), "outputs_tangent": (dy,), "params": ()}
    clip = fitted(emb.EmbeddingKroneckerFactored(emb_eqn(mode="clip"), "e"), [data])
    drop = fitted(emb.EmbeddingKroneckerFactored(emb_eqn(mode="drop"), "e"), [data])
    np.testing.assert_allclose(clip.inputs_factor.value, jnp.array([2, 2, 0, 0, 0, 1]) / T)
    np.testing.assert_allclose(drop.inputs_factor.value, jnp.array([1, 2, 0, 0, 0, 0]) / T)


# ----------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------


def _plain(kind):
    def apply(p, ids):
        e = jnp.take(p["table"], ids, axis=0) if kind == "take" else p["table"][ids]
        return e @ p["w"]

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return apply, {"table": jax.random.normal(k1, (V, D)), "w": jax.random.normal(k2, (D, 2))}


def _linen(_):
    import flax.linen as nn

    class M(nn.Module):
        @nn.compact
        def __call__(self, i):
            return nn.Dense(2)(nn.Embed(V, D)(i))

    return M().apply, M().init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))


def _nnx(_):
    from flax import nnx

    class M(nnx.Module):
        def __init__(self, rngs):
            self.e, self.l = nnx.Embed(V, D, rngs=rngs), nnx.Linear(D, 2, rngs=rngs)

        def __call__(self, i):
            return self.l(self.e(i))

    g, st = nnx.split(M(nnx.Rngs(0)))
    return (lambda p, i: nnx.merge(g, p)(i)), st


def _haiku(_):
    import haiku as hk

    t = hk.without_apply_rng(hk.transform(lambda i: hk.Linear(2)(hk.Embed(V, D)(i))))
    return t.apply, t.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))


def _equinox(_):
    import equinox as eqx

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    p, static = eqx.partition((eqx.nn.Embedding(V, D, key=k1), eqx.nn.Linear(D, 2, key=k2)), eqx.is_inexact_array)

    def apply(p, ids):
        e, lin = eqx.combine(p, static)
        return jax.vmap(jax.vmap(lambda i: lin(e(i))))(ids)

    return apply, p


MODELS = {"take": _plain, "index": _plain, "flax_linen": _linen, "flax_nnx": _nnx, "haiku": _haiku, "equinox": _equinox}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_detected_in_every_framework_and_exact_for_one_token(name):
    apply, params = MODELS[name](name)
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
    ids = jnp.array([[4]])
    target = jnp.ones((1, 1, 2))

    def loss(p, b):
        out = apply(p, b[0])
        curvax.register_squared_error_loss(out, b[1])
        return jnp.mean((out - b[1]) ** 2)

    f = curvax.layer_tags_vjp(loss)
    losses, vjp = f((params, (ids, target)))
    pj = f.processed_jaxpr.first
    kinds = sorted(s.pattern for s in pj.layer_sites)
    assert kinds == (["dense_no_bias", "embedding"] if name in ("take", "index") else ["dense_with_bias", "embedding"])
    j = [s.pattern for s in pj.layer_sites].index("embedding")
    (i_table,) = pj.layer_sites[j].param_indices
    leaves, tree = jax.tree_util.tree_flatten(params)
    assert leaves[i_table].shape == (V, D)
    # One example with one token: the block is the outer product of the exact table gradient.
    cot = jax.random.normal(jax.random.PRNGKey(7), (1, 1, 2))
    data = vjp([(cot,)])[j]
    block = blocks.get_default_tag_to_block_ctor(pj.layer_sites[j].tag.name)(pj.layer_tags[j], "emb")
    assert isinstance(block, emb.EmbeddingKroneckerFactored)

    def contribution(table):
        new = list(leaves)
        new[i_table] = table
        return jnp.sum(apply(jax.tree_util.tree_unflatten(tree, new), ids) * cot)

    g = jax.grad(contribution)(leaves[i_table]).ravel()
    np.testing.assert_allclose(block.to_dense_matrix(fitted(block, [data], batch=1)), jnp.outer(g, g), atol=1e-12)


def test_manual_registration_and_shared_tables():
    def loss(p, b):
        e = emb.register_embedding(p["table"][b[0]], b[0], p["table"])
        out = e @ p["w"]
        curvax.register_squared_error_loss(out, b[1])
        return jnp.mean((out - b[1]) ** 2)

    params = _plain("index")[1]
    batch = (jnp.array([[1, 2], [3, 1]]), jnp.zeros((2, 2, 2)))
    pj = transforms.ProcessedJaxpr.make_from_func(loss, (params, batch))
    assert sorted((s.pattern, s.tag.name) for s in pj.layer_sites) == [("dense_no_bias", "dense"), ("manual", "embedding")]

    def tied(p, b):  # the table is also the output projection: weight sharing, generic block
        out = p["table"][b[0]] @ p["table"].T
        curvax.register_squared_error_loss(out, b[1])
        return jnp.mean((out - b[1]) ** 2)

    pj = transforms.ProcessedJaxpr.make_from_func(tied, ({"table": params["table"]}, (batch[0], jnp.zeros((2, 2, V)))))
    assert [s.pattern for s in pj.layer_sites] == ["generic"]
    table = params["table"]
    with pytest.raises(ValueError, match="2-D"):
        emb.register_embedding(table[0], jnp.array(1), table[0])
    with pytest.raises(TypeError, match="integer"):
        emb.register_embedding(table[:2], jnp.array([0.0, 1.0]), table)
    with pytest.raises(ValueError, match="shape"):
        emb.register_embedding(table[:2], jnp.array([0, 1, 2]), table)


def test_optimizer_reduces_the_loss_of_an_embedding_model():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(8), 3)
    params = {"table": jax.random.normal(k1, (V, D)), "w": jax.random.normal(k2, (D, 3)) / 2, "b": jnp.zeros(3)}
    ids = jax.random.randint(k3, (16, 4), 0, V)
    labels = (ids * 2 + 1) % 3  # a function of the token: the loss can go to zero

    def loss(p, b):
        logits = p["table"][b[0]] @ p["w"] + p["b"]
        curvax.register_softmax_cross_entropy_loss(logits, b[1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b[1][..., None], axis=-1))

    opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=1e-3, num_burnin_steps=0)
    batch = (ids, labels)
    state = opt.init(params, jax.random.PRNGKey(0), batch)
    names = [type(b).__name__ for b in opt.estimator.blocks]
    assert "EmbeddingKroneckerFactored" in names
    first = float(loss(params, batch))
    for i in range(8):
        params, state, _ = opt.step(
            params, state, jax.random.PRNGKey(i), batch=batch, learning_rate=0.5, momentum=0.5, damping=1e-2
        )
    assert float(loss(params, batch)) < 0.5 * first
