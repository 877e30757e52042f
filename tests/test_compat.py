"""The JAX-internals module: equation evaluation and primitive rules, on this JAX version."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from curvax import _compat, tags


def _eqns(fn, *args):
    return jax.make_jaxpr(fn)(*args).jaxpr.eqns


def test_eval_equation_first_and_higher_order():
    x = jnp.arange(6.0).reshape(2, 3)
    for fn in (
        lambda x: jnp.tanh(x),
        lambda x: jax.jit(lambda y: y * 2 + 1)(x),
        lambda x: jax.nn.relu(x - 2),
        lambda x: jax.lax.scan(lambda c, r: (c + r, r * c), jnp.zeros(3), x)[0],
        lambda x: jax.lax.cond(x.sum() > 0, lambda y: y + 1, lambda y: y - 1, x),
        lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1],
    ):
        closed = jax.make_jaxpr(fn)(x)
        env = {v: x for v in closed.jaxpr.invars}
        for v, c in zip(closed.jaxpr.constvars, closed.consts):
            env[v] = c
        for eqn in closed.jaxpr.eqns:
            vals = [v.val if _compat.is_literal(v) else env[v] for v in eqn.invars]
            for v, out in zip(eqn.outvars, _compat.eval_equation(eqn, vals)):
                if not _compat.is_dropvar(v):
                    env[v] = out
        got = [env[v] if not _compat.is_literal(v) else v.val for v in closed.jaxpr.outvars]
        np.testing.assert_allclose(got[0], fn(x), rtol=1e-6)


def test_sub_closed_jaxpr_of_calls():
    eqns = _eqns(lambda x: jax.jit(jnp.sin)(jax.nn.relu(x)), jnp.ones(2))
    subs = [_compat.sub_closed_jaxpr(e) for e in eqns]
    assert all(s is not None for s in subs)
    assert _compat.sub_closed_jaxpr(_eqns(jnp.sin, jnp.ones(2))[0]) is None


def test_tag_primitives_are_transparent_to_transformations():
    x, w = jnp.ones((4, 3)), jnp.arange(6.0).reshape(3, 2)
    f = lambda w: jnp.sum(tags.register_dense(x @ w, x, w) ** 2)
    g = lambda w: jnp.sum((x @ w) ** 2)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(w), jax.grad(g)(w))
    np.testing.assert_allclose(jax.jvp(f, (w,), (w,))[1], jax.jvp(g, (w,), (w,))[1])
    batched = jax.vmap(lambda w: tags.register_dense(x @ w, x, w))(jnp.stack([w, 2 * w]))
    np.testing.assert_allclose(batched[1], x @ (2 * w))
    assert any(e.primitive is tags.dense for e in _eqns(f, w))


def test_first_outputs_is_the_trace_of_the_leading_outputs():
    """``first_outputs``: a jaxpr with its first outputs only, as the trace of ``f(*a)[:k]``."""
    from jax.extend import core as jex_core

    def f(p, x):
        return jnp.sum(jnp.tanh(x @ p) ** 2), {"a": p.sum()}

    vg = jax.value_and_grad(f, has_aux=True)
    p, x = jnp.ones((3, 2)) / 3, jnp.arange(12.0).reshape(4, 3)
    closed, (value, _) = _compat.make_jaxpr(vg, p, x, return_shape=True)
    count = len(jax.tree_util.tree_leaves(value))
    first = _compat.first_outputs(closed, count)
    assert len(first.jaxpr.outvars) == count == 2
    direct = jax.make_jaxpr(lambda *a: vg(*a)[0])(p, x)
    assert [e.primitive for e in first.jaxpr.eqns] == [e.primitive for e in direct.jaxpr.eqns]
    got = jex_core.jaxpr_as_fun(first)(p, x)
    want = jax.tree_util.tree_leaves(vg(p, x)[0])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
