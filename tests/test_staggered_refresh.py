"""Staggered inverse refresh (``Optimizer(inverse_update_staggered=True)``): each block
recomputes its cache on its own phase of ``inverse_update_period``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax

KEY = jax.random.PRNGKey(0)
L2 = 1e-2
SIZES = (4, 6, 5, 3)  # three dense blocks of different sizes: A sides 5, 7, 6; G sides 6, 5, 3


def init_mlp(key):
    keys = jax.random.split(key, len(SIZES) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, SIZES[:-1], SIZES[1:])
    ]


def loss_fn(params, batch):
    x, y = batch
    for i, p in enumerate(params):
        x = x @ p["w"] + p["b"]
        if i < len(params) - 1:
            x = jnp.tanh(x)
    curvax.register_softmax_cross_entropy_loss(x, y)
    ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(x), y[:, None], axis=1))
    return ce + 0.5 * L2 * curvax.utils.inner_product(params, params)


def batch_for(key, n=24):
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (n, SIZES[0])), jax.random.randint(ky, (n,), 0, SIZES[-1])


def make_opt(**kwargs):
    kw = dict(value_and_grad_func=jax.value_and_grad(loss_fn), l2_reg=L2, num_burnin_steps=0, inverse_update_period=3)
    kw.update(kwargs)
    return curvax.Optimizer(**kw)


def make_estimator():
    est = curvax.BlockDiagonalCurvature(loss_fn)
    est.finalize((init_mlp(KEY), batch_for(KEY)))
    return est


def caches(est_state):
    return [jax.tree_util.tree_leaves(s.cache) for s in est_state.blocks_states]


def test_refresh_phases_deal_blocks_largest_first_to_the_least_loaded_phase():
    est = make_estimator()
    costs = est.block_refresh_costs()
    assert costs == (5**3 + 6**3, 7**3 + 5**3, 6**3 + 3**3)
    # Period 3: one block per phase, the costliest (block 1) first.
    assert est.refresh_phases(3) == (1, 0, 2)
    # Period 2: the costliest alone, the two others share the other phase (341 + 243 > 468).
    assert est.refresh_phases(2) == (1, 0, 1)
    assert est.refresh_phases(1) == (0, 0, 0)
    # Period 5: two phases stay empty.
    assert est.refresh_phases(5) == (1, 0, 2)
    for period in (1, 2, 3, 5):
        assert est.blocks_refreshed_at(0, period) == (0, 1, 2)  # step 0 refreshes every block
        for start in (1, 7):
            seen = [i for t in range(start, start + period) for i in est.blocks_refreshed_at(t, period)]
            assert sorted(seen) == [0, 1, 2]  # every block exactly once per period
    assert est.blocks_refreshed_at(4, 3) == (0,) and est.blocks_refreshed_at(6, 3) == (1,)


@pytest.mark.parametrize("exact_inverses", [False, True])
def test_after_a_full_period_every_cache_equals_the_default_refresh(exact_inverses):
    """Same statistics and damping: after one period each block's cache is bit-for-bit the one
    ``update_cache`` computes for all blocks at once."""
    params, batch = init_mlp(KEY), batch_for(jax.random.PRNGKey(1))
    est = make_estimator()
    exact, approx = (-1, None) if exact_inverses else (None, -1)
    s = est.init(KEY, (params, batch), exact, approx)
    s = est.update_curvature_matrix_estimate(s, 0.0, 1.0, batch[0].shape[0], KEY, (params, batch))
    weight = jnp.asarray(L2 + 0.3, jnp.float32)

    staggered = jax.jit(lambda s, t: est.update_cache_staggered(s, t, 3, weight, exact, approx, False))
    default = jax.jit(lambda s: est.update_cache(s, weight, exact, approx, False))
    want = caches(default(s))
    got = s
    for t in (4, 5, 6):  # one full period, no step 0
        before = caches(got)
        got = staggered(got, jnp.asarray(t, jnp.int32))
        for i, (new, old, ref) in enumerate(zip(caches(got), before, want)):
            if i in est.blocks_refreshed_at(t, 3):
                for a, b in zip(new, ref):
                    np.testing.assert_array_equal(a, b)
            else:
                for a, b in zip(new, old):
                    np.testing.assert_array_equal(a, b)
    for got_block, want_block in zip(caches(got), want):
        for a, b in zip(got_block, want_block):
            np.testing.assert_array_equal(a, b)
    # Step 0 refreshes everything at once.
    for got_block, want_block in zip(caches(staggered(s, jnp.asarray(0, jnp.int32))), want):
        for a, b in zip(got_block, want_block):
            np.testing.assert_array_equal(a, b)


def test_optimizer_steps_recompute_only_the_blocks_of_their_phase():
    params = init_mlp(KEY)
    batches = [batch_for(jax.random.PRNGKey(10 + t)) for t in range(6)]
    kw = dict(curvature_ema=0.7)
    default, staggered = make_opt(**kw), make_opt(inverse_update_staggered=True, **kw)
    s_def = default.init(params, KEY, batches[0])
    s_stg = staggered.init(params, KEY, batches[0])
    est = staggered.estimator
    lr, damping = 0.2, 0.5
    p_def = p_stg = params
    refresh_all = jax.jit(lambda s: est.update_cache(s, L2 + damping, None, -1, False))
    for t, batch in enumerate(batches):
        old = caches(s_stg.estimator_state)
        p_def, s_def, _ = default.step(p_def, s_def, KEY, batch=batch, learning_rate=lr, momentum=0.0, damping=damping)
        p_stg, s_stg, _ = staggered.step(p_stg, s_stg, KEY, batch=batch, learning_rate=lr, momentum=0.0, damping=damping)
        new = caches(s_stg.estimator_state)
        due = est.blocks_refreshed_at(t, 3)
        # A due block's cache is the refresh of this step's statistics; the others are untouched.
        fresh = caches(refresh_all(s_stg.estimator_state))
        for i in range(3):
            if i in due:
                assert not all(np.array_equal(a, b) for a, b in zip(new[i], old[i]))
                for a, b in zip(new[i], fresh[i]):
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            else:
                for a, b in zip(new[i], old[i]):
                    np.testing.assert_array_equal(a, b)
        if t == 0:  # step 0 refreshes every block in both modes: the same step
            jax.tree_util.tree_map(np.testing.assert_array_equal, p_stg, p_def)
    assert [len(est.blocks_refreshed_at(t, 3)) for t in range(6)] == [3, 1, 1, 1, 1, 1]
    assert staggered.trace_count == 1  # one compiled step serves every phase
    # Inverses at most a period old either way: the trajectories stay close.
    flat = lambda p: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(p)])
    assert np.linalg.norm(flat(p_stg) - flat(p_def)) < 0.1 * np.linalg.norm(flat(p_def) - flat(params))


def test_argument_validation():
    with pytest.raises(TypeError, match="inverse_update_staggered"):
        make_opt(inverse_update_staggered="yes")
    with pytest.raises(ValueError, match="inverse_update_staggered.*inverse_update_period"):
        make_opt(inverse_update_staggered=True, inverse_update_period=1)
    est = make_estimator()
    with pytest.raises(ValueError, match="`period`"):
        est.refresh_phases(0)
    with pytest.raises(ValueError, match="`step`"):
        est.blocks_refreshed_at(-1, 3)
    with pytest.raises(ValueError, match="`period`"):
        est.update_cache_staggered(None, 0, 2.5, 1.0, None, -1, False)
