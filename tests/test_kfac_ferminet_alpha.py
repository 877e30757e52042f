"""The kfac_ferminet_alpha compatibility optimizer: curvax's steps behind the alpha's interface."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_env import child_env

import curvax
from curvax import kfac_ferminet_alpha as kfa
from curvax.blocks import WeightedMovingAverage

pytestmark = pytest.mark.usefixtures("x64")

KEY = jax.random.PRNGKey(0)
STEP_ARGS = dict(learning_rate=0.1, momentum=0.9, damping=1e-2)


def mlp(p, x):
    h = jnp.tanh(x @ p[0]["w"] + p[0]["b"])
    return h @ p[1]["w"] + p[1]["b"]


def init_params(key=KEY, d_in=3, d_hid=5, d_out=2):
    k1, k2 = jax.random.split(key)
    return [
        {"w": jax.random.normal(k1, (d_in, d_hid)) / 2, "b": jnp.zeros(d_hid)},
        {"w": jax.random.normal(k2, (d_hid, d_out)) / 2, "b": jnp.zeros(d_out)},
    ]


def make_batch(i, n=8):
    x = jax.random.normal(jax.random.PRNGKey(100 + i), (n, 3))
    return x, jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], -1)


def sq_loss(p, batch):
    x, y = batch
    out = mlp(p, x)
    kfa.register_squared_error_loss(out, y)
    return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, -1))


VG = jax.value_and_grad(sq_loss)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def assert_trees_close(a, b, atol=1e-6):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def batches_for(step, burnin):
    """The batches the ``step``-th call draws: burn-in batches (first call only), then its own."""
    own = [make_batch(step)]
    return [make_batch(50 + j) for j in range(burnin)] + own if step == 0 else own


def test_trains_a_small_model():
    opt = kfa.Optimizer(VG, l2_reg=0.0, num_burnin_steps=2, inverse_update_period=2)
    params = init_params()
    batch = make_batch(0, n=32)
    state = opt.init(params, KEY, batch)
    rng = KEY
    losses = []
    for _ in range(12):
        rng, key = jax.random.split(rng)
        params, state, stats = opt.step(params, state, key, iter([batch] * 3), learning_rate=0.2, momentum=0.5, damping=1e-2)
        losses.append(float(stats["loss"]))
    assert int(state["step_counter"]) == 12
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    "mode, burnin, schedules",
    [("fisher_exact", 1, False), ("fisher_gradients", 0, True)],
)
def test_steps_equal_curvax_optimizer(mode, burnin, schedules):
    """Same settings, same rng, same batches: the alpha steps are curvax.Optimizer's steps."""
    common = dict(l2_reg=1e-3, num_burnin_steps=burnin, estimation_mode=mode, inverse_update_period=2, curvature_ema=0.9)
    if schedules:
        common.update(
            learning_rate_schedule=lambda t: 0.1 / (1.0 + t),
            momentum_schedule=lambda t: 0.5 + 0.0 * t,
            damping_schedule=lambda t: 1e-2 + 0.0 * t,
            norm_constraint=1e-3,
        )
    step_args = {} if schedules else STEP_ARGS
    alpha = kfa.Optimizer(VG, **common)
    ref = curvax.Optimizer(VG, **common)
    params = init_params()
    a_state = alpha.init(params, KEY, make_batch(0))
    c_state = ref.init(params, KEY, make_batch(0))
    a_params = c_params = params
    for t in range(3):  # inverses refreshed at steps 0 and 2, cached at 1
        key = jax.random.fold_in(KEY, t)
        a_params, a_state, a_stats = alpha.step(a_params, a_state, key, iter(batches_for(t, burnin)), **step_args)
        c_params, c_state, c_stats = ref.step(c_params, c_state, key, iter(batches_for(t, burnin)), **step_args)
        assert_trees_close(a_params, c_params)
        assert_trees_close(a_state["velocities"], c_state.velocities)
        assert_trees_close(a_state["estimator"], c_state.estimator_state)
        assert int(a_state["step_counter"]) == int(c_state.step_counter) == t + 1
        assert set(a_stats) == {"step", "loss", "learning_rate", "momentum", "damping", "rho", *kfa._GUARD_KEYS}
        assert int(a_stats["step"]) == t  # the counter before the step, as in the alpha
        np.testing.assert_allclose(a_stats["loss"], c_stats["loss"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(a_stats["learning_rate"], c_stats["learning_rate"], rtol=0, atol=1e-6)
        assert np.isnan(a_stats["rho"])
        # The alpha's first step has momentum 0 (the velocities are 0 then, so the update is the same).
        assert float(a_stats["momentum"]) == (0.0 if t == 0 else float(c_stats["momentum"]))
    assert a_params[0]["w"].dtype == jnp.float64


def test_burnin_batches_weigh_one_over_n():
    """After burn-in of N batches and one step, each average is (ema * mean(S_burn) + S_step) / (ema + 1)."""
    n, ema = 3, 0.8
    opt = kfa.Optimizer(VG, l2_reg=0.0, num_burnin_steps=n, estimation_mode="fisher_exact", curvature_ema=ema,
                        inverse_update_period=1)
    params = init_params()
    state = opt.init(params, KEY, make_batch(0))
    _, state, _ = opt.step(params, state, KEY, iter(batches_for(0, n)), **STEP_ARGS)

    est = opt.estimator
    fresh = est.init(KEY, (params, make_batch(0)), None, None, False)

    def stats_of(batch):  # one batch's statistics: an average of weight 1
        s = est.update_curvature_matrix_estimate(fresh, 0.0, 1.0, 8, KEY, (params, batch), estimation_mode="fisher_exact")
        return [w.value for w in wmas(s)]

    def wmas(s):
        return [x for x in jax.tree_util.tree_leaves(s, is_leaf=lambda x: isinstance(x, WeightedMovingAverage))
                if isinstance(x, WeightedMovingAverage)]

    burn = [stats_of(make_batch(50 + j)) for j in range(n)]
    new = stats_of(make_batch(0))
    got = wmas(state["estimator"])
    assert len(got) == 4  # two Kronecker blocks, two factors each
    for i, w in enumerate(got):
        mean = sum(b[i] for b in burn) / n
        np.testing.assert_allclose(w.weight, ema + 1.0, rtol=1e-12)
        np.testing.assert_allclose(w.value, (ema * mean + new[i]) / (ema + 1.0), rtol=1e-10, atol=1e-12)


def test_donated_buffers_are_deleted():
    def loss_with_state(p, fs, batch):
        return sq_loss(p, batch), fs + 1.0

    vg = jax.value_and_grad(loss_with_state, has_aux=True)
    flags = dict(donate_parameters=True, donate_optimizer_state=True, donate_batch_inputs=True, donate_func_state=True)
    opt = kfa.Optimizer(vg, l2_reg=0.0, value_func_has_state=True, num_burnin_steps=0, **flags)
    assert opt.donate_argnums == (0, 1, 3, 4)
    params = init_params()
    state = opt.init(params, KEY, make_batch(0), jnp.zeros([]))
    params = jax.tree_util.tree_map(lambda x: x + 0.0, params)
    batch = jax.tree_util.tree_map(lambda x: x + 0.0, make_batch(1))
    fs = jnp.zeros([]) + 0.0
    # The batch is donated too, but no output can take its buffers: JAX says so, naming their shapes.
    with pytest.warns(UserWarning, match=r"donated buffers were not usable: float64\[8,3\], float64\[8,2\]\."):
        new_params, new_state, new_fs, stats = opt.step(params, state, KEY, iter([batch]), fs, **STEP_ARGS)
    for tree in (params, state, fs):
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(tree))
    assert float(new_fs) == 1.0 and np.isfinite(stats["loss"])
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves((new_params, new_state)))

    # Without donation nothing is deleted.
    keep = kfa.Optimizer(vg, l2_reg=0.0, value_func_has_state=True, num_burnin_steps=0)
    assert keep.donate_argnums == ()
    state = keep.init(new_params, KEY, make_batch(0), new_fs)
    batch = make_batch(2)
    keep.step(new_params, state, KEY, iter([batch]), new_fs, **STEP_ARGS)
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves((new_params, state, batch, new_fs)))


def test_aux_state_and_rng_match_curvax():
    def loss_fn(p, fs, rng, batch):
        noise = 1e-3 * jax.random.normal(rng, batch[1].shape)
        value = sq_loss(p, (batch[0], batch[1] + noise))
        return value, (fs + 1.0, {"noise": jnp.mean(noise)})

    vg = jax.value_and_grad(loss_fn, has_aux=True)
    flags = dict(value_func_has_aux=True, value_func_has_state=True, value_func_has_rng=True, l2_reg=0.0,
                 num_burnin_steps=0, estimation_mode="fisher_exact")
    alpha, ref = kfa.Optimizer(vg, **flags), curvax.Optimizer(vg, **flags)
    params = init_params()
    fs = jnp.zeros([])
    a_state, c_state = alpha.init(params, KEY, make_batch(0), fs), ref.init(params, KEY, make_batch(0), fs)
    a_p, a_fs, c_p, c_fs = params, fs, params, fs
    for t in range(2):
        key = jax.random.fold_in(KEY, t)
        a_p, a_state, a_fs, a_stats = alpha.step(a_p, a_state, key, iter([make_batch(t)]), a_fs, **STEP_ARGS)
        c_p, c_state, c_fs, c_stats = ref.step(c_p, c_state, key, iter([make_batch(t)]), func_state=c_fs, **STEP_ARGS)
        assert_trees_close(a_p, c_p)
        np.testing.assert_allclose(a_stats["aux"]["noise"], c_stats["aux"]["noise"], rtol=0, atol=1e-12)
    assert float(a_fs) == float(c_fs) == 2.0


def test_batch_process_func_is_applied_and_debug_runs_eagerly():
    calls = []

    def double_inputs(batch):
        calls.append(1)
        return batch[0] * 2.0, batch[1]

    raw = [make_batch(t) for t in range(3)]
    processed = [double_inputs(b) for b in raw]
    calls.clear()
    results = {}
    for name, kwargs, data in (
        ("plain", {}, processed),
        ("jit", dict(batch_process_func=double_inputs), raw),
        ("debug", dict(batch_process_func=double_inputs, debug=True), raw),
    ):
        opt = kfa.Optimizer(VG, l2_reg=0.0, num_burnin_steps=1, estimation_mode="fisher_exact", **kwargs)
        params = init_params()
        state = opt.init(params, KEY, data[0])
        before = len(calls)
        for t in range(2):
            it = iter([data[2], data[t]]) if t == 0 else iter([data[t]])
            params, state, _ = opt.step(params, state, KEY, it, **STEP_ARGS)
        results[name] = (params, len(calls) - before)
    assert_trees_close(results["jit"][0], results["plain"][0], atol=1e-6)
    assert_trees_close(results["debug"][0], results["plain"][0], atol=1e-6)
    assert results["plain"][1] == 0
    # Compiled: traced once per function (burn-in, step). Debug: run on every call (1 burn-in + 2 steps).
    assert results["jit"][1] == 2
    assert results["debug"][1] == 3


def test_batch_size_argument_normalises_the_statistics():
    """``step(..., batch_size=16)`` on batches of 8 is curvax with a batch size extractor saying 16."""
    alpha = kfa.Optimizer(VG, l2_reg=0.0, num_burnin_steps=0, estimation_mode="fisher_exact")
    ref = curvax.Optimizer(VG, l2_reg=0.0, num_burnin_steps=0, estimation_mode="fisher_exact",
                           batch_size_extractor=lambda batch: 16)
    params = init_params()
    a_state, c_state = alpha.init(params, KEY, make_batch(0)), ref.init(params, KEY, make_batch(0))
    a_p, a_state, _ = alpha.step(params, a_state, KEY, iter([make_batch(1)]), batch_size=16, **STEP_ARGS)
    c_p, c_state, _ = ref.step(params, c_state, KEY, iter([make_batch(1)]), **STEP_ARGS)
    assert_trees_close(a_p, c_p)
    assert_trees_close(a_state["estimator"], c_state.estimator_state)
    plain_p, _, _ = alpha.step(params, alpha.init(params, KEY, make_batch(0)), KEY, iter([make_batch(1)]), **STEP_ARGS)
    assert not np.allclose(leaves(plain_p)[0], leaves(a_p)[0])
    with pytest.raises(ValueError, match="batch_size"):
        alpha.step(params, a_state, KEY, iter([make_batch(1)]), batch_size=0, **STEP_ARGS)


def test_layer_tag_to_block_cls():
    alpha = kfa.Optimizer(VG, l2_reg=0.0, num_burnin_steps=0, layer_tag_to_block_cls={"dense_tag": curvax.DenseFull})
    one_arg = kfa.Optimizer(VG, l2_reg=0.0, num_burnin_steps=0,
                            layer_tag_to_block_cls={"dense_tag": lambda eqn: curvax.DenseFull(eqn, "dense")})
    ref = curvax.Optimizer(VG, l2_reg=0.0, num_burnin_steps=0, layer_tag_to_block_ctor={"dense": curvax.DenseFull})
    default = kfa.Optimizer(VG, l2_reg=0.0, num_burnin_steps=0)
    params = init_params()
    out = []
    for opt in (alpha, ref):
        state = opt.init(params, KEY, make_batch(0))
        p, *_ = opt.step(params, state, KEY, iter([make_batch(1)]), **STEP_ARGS)
        out.append(p)
    assert_trees_close(out[0], out[1])
    for opt in (one_arg, default):
        opt.init(params, KEY, make_batch(0))
    for opt in (alpha, one_arg, default):
        assert len(opt.estimator.blocks) == 2
        assert all(isinstance(b, curvax.DenseFull) for b in opt.estimator.blocks) == (opt is not default)

    with pytest.raises(TypeError, match=r"layer_tag_to_block_cls\['dense_tag'\]"):
        kfa.Optimizer(VG, l2_reg=0.0, layer_tag_to_block_cls={"dense_tag": 3})
    with pytest.raises(TypeError, match="not a curvax CurvatureBlock"):
        kfa.Optimizer(VG, l2_reg=0.0, layer_tag_to_block_cls={"dense_tag": dict})
    with pytest.raises(ValueError, match="unknown layer tag 'dnese_tag'"):
        kfa.Optimizer(VG, l2_reg=0.0, layer_tag_to_block_cls={"dnese_tag": curvax.DenseFull})


def test_argument_errors():
    params, batch = init_params(), make_batch(0)
    with pytest.raises(ValueError, match="estimation_mode"):
        kfa.Optimizer(VG, l2_reg=0.0, estimation_mode="fisher")
    with pytest.raises(TypeError, match="donate_parameters"):
        kfa.Optimizer(VG, l2_reg=0.0, donate_parameters=1)
    with pytest.raises(TypeError, match="learning_rate_schedule"):
        kfa.Optimizer(VG, l2_reg=0.0, learning_rate_schedule=0.1)
    with pytest.raises(ValueError, match="debug=True.*multi_device=True"):
        kfa.Optimizer(VG, l2_reg=0.0, multi_device=True, debug=True)
    with pytest.raises(TypeError, match="value_and_grad_func"):
        kfa.Optimizer(None, l2_reg=0.0)

    opt = kfa.Optimizer(VG, l2_reg=0.0, num_burnin_steps=2)
    with pytest.raises(RuntimeError, match="init"):
        opt.step(params, {}, KEY, iter([batch]), **STEP_ARGS)
    state = opt.init(params, KEY, batch)
    with pytest.raises(ValueError, match="learning_rate="):
        opt.step(params, state, KEY, iter([batch] * 3), momentum=0.0, damping=1.0)
    with pytest.raises(ValueError, match="damping="):
        opt.step(params, state, KEY, iter([batch] * 3), learning_rate=0.1, momentum=0.0)
    with pytest.raises(TypeError, match="data_iterator.*iter"):
        opt.step(params, state, KEY, batch, **STEP_ARGS)
    with pytest.raises(TypeError, match="state"):
        opt.step(params, {"velocities": 0}, KEY, iter([batch]), **STEP_ARGS)
    with pytest.raises(ValueError, match="learning_rate.*scalar"):
        opt.step(params, state, KEY, iter([batch] * 3), learning_rate=jnp.ones(2), momentum=0.0, damping=1.0)
    with pytest.raises(ValueError, match=r"num_burnin_steps=2: the first step needs 3 batches.*ran out after 1"):
        opt.step(params, state, KEY, iter([batch]), **STEP_ARGS)

    scheduled = kfa.Optimizer(VG, l2_reg=0.0, learning_rate_schedule=lambda t: 0.1, num_burnin_steps=0)
    state = scheduled.init(params, KEY, batch)
    with pytest.raises(ValueError, match="learning_rate_schedule.*should not pass `learning_rate`"):
        scheduled.step(params, state, KEY, iter([batch]), **STEP_ARGS)


def test_compatibility_namespaces():
    """FermiNet's imports (``optimizer as kfac_optim``, ``utils as kfac_utils``, ``loss_functions``) resolve."""
    from curvax.kfac_ferminet_alpha import loss_functions, optimizer as kfac_optim, utils as kfac_utils

    assert kfac_optim.Optimizer is kfa.Optimizer
    assert loss_functions.register_normal_predictive_distribution is kfa.register_normal_predictive_distribution
    for name in ("p_split", "replicate_all_local_devices", "make_different_rng_key_on_all_devices",
                 "broadcast_all_local_devices", "pmean_if_pmap", "psum_if_pmap", "get_first"):
        assert callable(getattr(kfac_utils, name)), name


_MULTI_DEVICE_CHILD = textwrap.dedent(
    """
    import json, jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    import test_kfac_ferminet_alpha as t
    from curvax import kfac_ferminet_alpha as kfa

    n = jax.local_device_count()
    rep = kfa.utils.replicate_all_local_devices
    shard = lambda b: jax.tree_util.tree_map(lambda x: x.reshape((n, -1) + x.shape[1:]), b)
    kw = dict(l2_reg=1e-3, num_burnin_steps=1, estimation_mode="fisher_exact", inverse_update_period=2)
    single = kfa.Optimizer(t.VG, **kw)
    multi = kfa.Optimizer(t.VG, multi_device=True, pmap_axis_name="alpha_axis", donate_optimizer_state=True, **kw)
    params = t.init_params()
    full = lambda i: t.make_batch(i, n=16)
    s_state = single.init(params, t.KEY, full(0))
    keys = jax.random.split(t.KEY, n)
    m_state = multi.init(rep(params), keys, shard(full(0)))
    sp, mp = params, rep(params)
    mom, damp = rep(jnp.asarray(0.9)), rep(jnp.asarray(1e-2))
    diffs, losses = [], []
    for step in range(3):
        data = [full(50), full(step)] if step == 0 else [full(step)]
        sp, s_state, s_stats = single.step(sp, s_state, t.KEY, iter(data), learning_rate=0.1, momentum=0.9, damping=1e-2)
        old_state = m_state
        mp, m_state, m_stats = multi.step(mp, m_state, keys, iter([shard(b) for b in data]),
                                          learning_rate=rep(jnp.asarray(0.1)), momentum=mom, damping=damp)
        deleted = all(x.is_deleted() for x in jax.tree_util.tree_leaves(old_state))
        diffs.append(max(float(np.max(np.abs(np.asarray(a)[i] - np.asarray(b))))
                         for a, b in zip(jax.tree_util.tree_leaves(mp), jax.tree_util.tree_leaves(sp)) for i in range(n)))
        losses.append([float(s_stats["loss"]), float(m_stats["loss"][0])])

    # FermiNet's use (train.py before kfac-jax): aux and rng in the loss, a learning rate schedule,
    # no burn-in, replicated momentum and damping, one batch per step through iter([batch]).
    def fermi_loss(p, key, batch):
        out = t.mlp(p, batch[0])
        kfa.register_normal_predictive_distribution(out)
        return 0.5 * jnp.mean(jnp.sum((out - batch[1]) ** 2, -1)), {"u": jax.random.uniform(key)}

    fkw = dict(l2_reg=0.0, value_func_has_aux=True, value_func_has_rng=True, num_burnin_steps=0,
               learning_rate_schedule=lambda s: 0.2 / (1.0 + 0.1 * s), estimation_mode="fisher_exact")
    vg = jax.value_and_grad(fermi_loss, has_aux=True)
    single = kfa.Optimizer(vg, **fkw)
    multi = kfa.Optimizer(vg, multi_device=True, pmap_axis_name="qmc_pmap_axis", **fkw)
    batch = full(7)
    s_state = single.init(params, t.KEY, batch)
    m_state = multi.init(rep(params), keys, shard(batch))
    sp, mp, fermi = params, rep(params), []
    for step in range(4):
        sp, s_state, s_stats = single.step(sp, s_state, t.KEY, iter([batch]), momentum=0.5, damping=1e-2)
        keys, sub = kfa.utils.p_split(keys)
        mp, m_state, m_stats = multi.step(params=mp, state=m_state, rng=sub, data_iterator=iter([shard(batch)]),
                                          momentum=rep(jnp.asarray(0.5)), damping=rep(jnp.asarray(1e-2)))
        assert m_stats["aux"]["u"].shape == (n,)
        fermi.append([float(s_stats["loss"]), float(m_stats["loss"][0])])
    fermi_diff = max(float(np.max(np.abs(np.asarray(a)[0] - np.asarray(b))))
                     for a, b in zip(jax.tree_util.tree_leaves(mp), jax.tree_util.tree_leaves(sp)))
    print(json.dumps({"devices": n, "diffs": diffs, "losses": losses, "deleted": deleted,
                      "fermi_losses": fermi, "fermi_diff": fermi_diff}))
    """
)


@pytest.mark.slow
def test_multi_device_matches_one_device():
    """multi_device=True (pmap, four CPU devices, batch split over them) makes the one-device steps."""
    env = child_env(4)
    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, "-c", _MULTI_DEVICE_CHILD], cwd=here, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    assert max(out["diffs"]) < 1e-6, out
    for single, multi in out["losses"]:
        assert abs(single - multi) < 1e-6, out
    assert out["deleted"]
    assert out["fermi_diff"] < 1e-6, out
    fermi = np.array(out["fermi_losses"])
    np.testing.assert_allclose(fermi[:, 1], fermi[:, 0], rtol=0, atol=1e-6)
    assert fermi[-1, 1] < fermi[0, 1]


def test_a_nan_batch_is_reported_like_the_optimizer(caplog):
    """The alpha's stats carry the non-finite guard's flags and its log names the skip."""
    import logging

    opt = kfa.Optimizer(VG, l2_reg=0.0, num_burnin_steps=0, inverse_update_period=1)
    params = init_params()
    state = opt.init(params, KEY, make_batch(0))
    params, state, stats = opt.step(params, state, KEY, iter([make_batch(0)]), **STEP_ARGS)
    assert not bool(stats["update_skipped"]) and not bool(stats["curvature_update_skipped"])
    x, y = make_batch(1)
    bad = (x.at[2, 0].set(jnp.nan), y)
    with caplog.at_level(logging.WARNING, logger="curvax"):
        new_params, state, stats = opt.step(params, state, KEY, iter([bad]), **STEP_ARGS)
        for i in range(2, 12):  # a step's line is logged once its flags are ready
            opt.step(new_params, state, KEY, iter([make_batch(i)]), **STEP_ARGS)
    assert bool(stats["update_skipped"]) and bool(stats["curvature_update_skipped"])
    assert_trees_close(new_params, params, atol=0.0)
    assert "update skipped" in caplog.text
