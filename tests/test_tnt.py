"""TNT (tensor-normal training) blocks checked against their definition from per-example gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from curvax import blocks
from layer_eqns import dense_eqn, generic_eqn

pytestmark = pytest.mark.usefixtures("x64")

KEY = jax.random.PRNGKey(0)


def arrange(vec, layout="io"):
    """Test-side ``V``: weight as ``(-1, last axis)`` ("oi" weights transposed), bias as the last row."""
    w = vec[0].T if layout == "oi" else vec[0]
    w = w.reshape(-1, w.shape[-1])
    return np.concatenate([w, np.reshape(vec[1], (1, -1))], 0) if len(vec) == 2 else w


def tnt_definition(vs, shapes, layout="io"):
    """``(M_A (x) M_G) / sqrt(tr M_A tr M_G)`` in parameter order, ``M_A = mean V V^T``, ``M_G = mean V^T V``."""
    ma = np.mean([v @ v.T for v in vs], axis=0)
    mg = np.mean([v.T @ v for v in vs], axis=0)
    c_v = np.kron(ma, mg) / np.sqrt(np.trace(ma) * np.trace(mg))
    offsets = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
    index = [np.arange(offsets[i], offsets[i + 1]).reshape(s) for i, s in enumerate(shapes)]
    perm = arrange(index, layout).ravel()  # perm[k]: parameter position of the k-th entry of vec(V)
    out = np.zeros_like(c_v)
    out[np.ix_(perm, perm)] = c_v
    return out


def per_example_dense_grads(seed, batch, extra, d_in, d_out, bias, layout):
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    x = jax.random.normal(k[0], (batch, *extra, d_in))
    dy = jax.random.normal(k[1], (batch, *extra, d_out))
    w_shape = (d_in, d_out) if layout == "io" else (d_out, d_in)
    params = (jnp.ones(w_shape),) + ((jnp.ones(d_out),) if bias else ())

    def contrib(p, xn, dyn):
        y = xn @ (p[0] if layout == "io" else p[0].T) + (p[1] if bias else 0.0)
        return jnp.sum(y * dyn)

    grads = jax.vmap(jax.grad(contrib), in_axes=(None, 0, 0))(params, x, dy)
    per_example = [tuple(np.asarray(g[n]) for g in grads) for n in range(batch)]
    return {"inputs": (x,), "outputs_tangent": (dy,)}, per_example


def estimate(block, data, batch):
    state = block.init(KEY, None, None, False)
    return block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch)


@pytest.mark.parametrize("extra,bias,layout", [((), True, "io"), ((3,), True, "oi"), ((2,), False, "io")])
def test_dense_tnt_equals_its_definition(extra, bias, layout):
    batch = 5
    block = blocks.DenseTNT(dense_eqn(3, 2, batch, extra, bias, layout), "t")
    data, per_example = per_example_dense_grads(1, batch, extra, 3, 2, bias, layout)
    dense = np.asarray(jax.jit(lambda d: block.to_dense_matrix(estimate(block, d, batch)))(data))
    want = tnt_definition([arrange(g, layout) for g in per_example], block.parameters_shapes, layout)
    np.testing.assert_allclose(dense, want, rtol=1e-10, atol=1e-12)
    flat = np.stack([np.concatenate([np.ravel(p) for p in g]) for g in per_example])
    np.testing.assert_allclose(np.trace(dense), np.trace(flat.T @ flat / batch), rtol=1e-10)  # Fisher's trace


def test_single_example_tnt_is_the_gradient_outer_product():
    block = blocks.DenseTNT(dense_eqn(3, 2, 1), "t")
    data, per_example = per_example_dense_grads(2, 1, (), 3, 2, True, "io")
    g = np.concatenate([np.ravel(p) for p in per_example[0]])
    np.testing.assert_allclose(block.to_dense_matrix(estimate(block, data, 1)), np.outer(g, g), atol=1e-12)


@pytest.mark.parametrize("shapes", [((3, 4), (4,)), ((2, 3, 4),), ((5,), (5,))])
def test_naive_tnt_equals_its_definition(shapes):
    block = blocks.NaiveTNT(generic_eqn(*shapes), "g")
    keys = jax.random.split(KEY, len(shapes))
    tangent = tuple(jax.random.normal(k, s) for k, s in zip(keys, shapes))
    batch = 4
    dense = block.to_dense_matrix(estimate(block, {"params_tangent": tangent}, batch))
    v = arrange(tuple(np.asarray(t) for t in tangent)) / np.sqrt(batch)  # mean over one "example" of V V^T / B
    np.testing.assert_allclose(dense, tnt_definition([v], shapes), rtol=1e-10, atol=1e-12)


def test_multiply_and_inverse_match_dense_powers():
    batch = 6
    block = blocks.DenseTNT(dense_eqn(3, 2, batch, (2,)), "t")
    data, _ = per_example_dense_grads(3, batch, (2,), 3, 2, True, "io")
    keys = jax.random.split(KEY, 2)
    vec = tuple(jax.random.normal(k, s) for k, s in zip(keys, block.parameters_shapes))
    w = 0.2
    exact_combos = [(p, c) for p in (1, -1, -0.5) for c in (True, False)]

    @jax.jit
    def run(data):
        state = block.init(KEY, -1, -1, True)
        state = block.update_curvature_matrix_estimate(state, data, 0.0, 1.0, batch)
        state = block.update_cache(state, w, -1, -1, True)
        exact = [block.multiply_matpower(state, vec, w, p, True, c) for p, c in exact_combos]
        approx = block.multiply_matpower(state, vec, w, 1, False, False)
        approx_inv = block.multiply_matpower(state, approx, w, -1, False, True)
        return block.to_dense_matrix(state), block.eigenvalues(state, True), exact, approx_inv

    dense, eigenvalues, exact, approx_inv = run(data)
    dense = np.asarray(dense)
    np.testing.assert_allclose(np.sort(eigenvalues), np.linalg.eigvalsh(dense), atol=1e-10)
    s, q = np.linalg.eigh(dense + w * np.eye(block.dim))
    flat_vec = np.concatenate([np.ravel(v) for v in vec])
    for (power, cached), got in zip(exact_combos, exact):
        want = (q * s**power) @ q.T @ flat_vec
        np.testing.assert_allclose(np.concatenate([np.ravel(x) for x in got]), want, rtol=1e-9, atol=1e-12,
                                   err_msg=f"power={power} cached={cached}")
    # The approximate (pi-damped) product and its cached inverse undo each other.
    np.testing.assert_allclose(np.concatenate([np.ravel(x) for x in approx_inv]), flat_vec, rtol=1e-9)


def test_errors():
    with pytest.raises(ValueError, match="NaiveTNT"):
        blocks.NaiveTNT(generic_eqn((3, 4), (3,)), "g")
    with pytest.raises(ValueError, match="NaiveTNT"):
        blocks.NaiveTNT(generic_eqn(()), "g")
    with pytest.raises(ValueError, match="dense layer"):
        blocks.DenseTNT(generic_eqn((2, 3, 4)), "g")
    block = blocks.NaiveTNT(generic_eqn((3, 4)), "g")
    with pytest.raises(ValueError, match="parameter tangents"):
        estimate(block, {"params_tangent": (jnp.zeros((3, 4)), jnp.zeros(4))}, 2)
