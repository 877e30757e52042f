"""Headline claims of the README, checked in the default run on small problems.

* One NaN example on one device skips the step on every device: kfac-jax's pmap mode
  (``multi_device=True``), ``jax.sharding`` (batch sharded, parameters replicated) and the Optax
  path, on 2 CPU devices in a subprocess (the device count is fixed when JAX starts). The oracle:
  a one-device run that never saw the bad batch; the skipped step must leave parameters and
  statistics bit for bit (and reset the velocity, as documented), and the step after it must give
  the oracle's parameters (float64).
* Layers in ``lax.scan`` give exactly the curvature of the same model written as a Python loop:
  a small stacked transformer block (attention, LayerNorm, MLP) here; ``tests/test_scan.py`` has
  the stacked MLP, conv and every framework's idiom.

(The user-gradient and re-batching guarantees run in every framework by default in
``tests/test_user_gradient.py`` and ``tests/test_rebatch.py``; every example's ``--quick`` in
``tests/test_examples.py``.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from xla_env import child_env

import curvax
import models

# --- one NaN example on one device: every device skips ------------------------------------

_NAN_CHILD = r'''
import os, json
import xla_env
xla_env.request_devices(2)
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import curvax, models

assert jax.device_count() == 2
params, batch = models.classifier(8)
params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
x, y = batch
x = jnp.asarray(x, jnp.float64)
good = (x, y)
bad = (x.at[6, 0].set(jnp.nan), y)  # example 6: in the second half, on device 1 only
HYPER = dict(learning_rate=0.1, momentum=0.5, damping=1e-2)
host = lambda t: jax.tree_util.tree_map(lambda a: np.array(a), t)
leaves = lambda t: [np.asarray(l) for l in jax.tree_util.tree_leaves(t)]
out = {}

def make(multi_device):
    return curvax.Optimizer(jax.value_and_grad(models.softmax_loss), l2_reg=1e-3, num_burnin_steps=0,
                            inverse_update_period=1, estimation_mode="ggn_exact",
                            multi_device=multi_device, pmap_axis_name="d")

def three_steps(opt, p, state, batches, key, hyper):
    """good, bad, good: the parameters and states after each, copied to the host."""
    res = []
    for i, b in enumerate(batches):
        p, state, stats = opt.step(p, state, key(i), batch=b, **hyper)
        res.append((host(p), host(state), host(stats)))
    return res

# The oracle: one device, the bad batch never seen.
opt = make(False)
state = opt.init(params, jax.random.PRNGKey(0), good)
# A skipped step resets the velocity to zero (Optimizer docstring), so the step after it has no
# momentum term: the oracle's second step is taken with momentum 0.
p1, s1, _ = opt.step(params, state, jax.random.PRNGKey(0), batch=good, **HYPER)
ref_params, _, _ = opt.step(p1, s1, jax.random.PRNGKey(2), batch=good, **{**HYPER, "momentum": 0.0})
ref_params = host(ref_params)

def report(res, per_device):
    (p1, s1, _), (p2, s2, st2), (p3, s3, st3) = res
    pick = (lambda a: a[1]) if per_device else (lambda a: a)  # device 1's copy: the one that saw the NaN
    return {
        "skipped": np.atleast_1d(st2["update_skipped"]).tolist(),
        "curvature_skipped": np.atleast_1d(st2["curvature_update_skipped"]).tolist(),
        "after": np.atleast_1d(st3["update_skipped"]).tolist() + np.atleast_1d(st3["curvature_update_skipped"]).tolist(),
        "params_unchanged": all(np.array_equal(a, b) for a, b in zip(leaves(p1), leaves(p2))),
        "statistics_unchanged": all(np.array_equal(a, b) for a, b in zip(leaves(s1.estimator_state), leaves(s2.estimator_state))),
        "velocities_reset": all(not np.any(a) for a in leaves(s2.velocities)) and any(np.any(a) for a in leaves(s1.velocities)),
        "finite": all(bool(np.all(np.isfinite(l))) for l in leaves((p3, s3)) if l.dtype.kind == "f"),
        "same_on_devices": all(bool(np.all(l == l[:1])) for l in leaves((p3, s3))) if per_device else True,
        "max_diff_to_oracle": max(float(np.max(np.abs(pick(a) - b))) for a, b in zip(leaves(p3), leaves(ref_params))),
        "moved": max(float(np.max(np.abs(pick(a) - b))) for a, b in zip(leaves(p3), leaves(params))),
    }

# kfac-jax's pmap mode: batch split over the devices, each device its own half.
rep = curvax.utils.replicate_all_local_devices
split = lambda b: jax.tree_util.tree_map(lambda a: a.reshape((2, -1) + a.shape[1:]), b)
opt = make(True)
state = opt.init(rep(params), rep(jax.random.PRNGKey(0)), split(good))
hyper = {k: rep(jnp.asarray(v)) for k, v in HYPER.items()}
res = three_steps(opt, rep(params), state, [split(good), split(bad), split(good)],
                  lambda i: jax.random.split(jax.random.PRNGKey(i), 2), hyper)
out["pmap"] = report(res, per_device=True)

# jax.sharding: parameters replicated, batch sharded over the 2 devices (rows 4..7 on device 1).
mesh = Mesh(jax.devices(), ("data",))
shard = lambda b: jax.device_put(b, NamedSharding(mesh, P("data")))
assert shard(bad)[0].addressable_shards[1].data.shape[0] == 4
opt = make(False)
p = jax.device_put(params, NamedSharding(mesh, P()))
state = opt.init(p, jax.random.PRNGKey(0), shard(good))
batches = [shard(good), shard(bad), shard(good)]
p_cur, s_cur, res = p, state, []
for i, b in enumerate(batches):
    p_cur, s_cur, stats = opt.step(p_cur, s_cur, jax.random.PRNGKey(i), batch=b, **HYPER)
    if i == 2:
        replicated = all(l.sharding.is_fully_replicated for l in jax.tree_util.tree_leaves(p_cur))
    res.append((host(p_cur), host(s_cur), host(stats)))
out["sharding"] = report(res, per_device=False)
out["sharding"]["params_replicated"] = replicated

# kfac-jax's OptaxPreconditioner in a pmap without syncing: each device's statistics are its
# own, and the guard's decision is still taken for every device together.
pre = curvax.OptaxPreconditioner(models.softmax_loss, l2_reg=1e-3, damping=1e-2, inverse_update_period=1,
                                 pmap_axis_name="d")
st = jax.pmap(lambda p, b: pre.init((p, b), jax.random.PRNGKey(0)), axis_name="d")(rep(params), split(good))
upd = jax.pmap(lambda s, p, b: pre.maybe_update_estimator_curvature(s, (p, b), jax.random.PRNGKey(1), sync=False),
               axis_name="d")
new_bad, new_good = upd(st, rep(params), split(bad)), upd(st, rep(params), split(good))
changed = lambda new: [any(bool(np.any(np.asarray(a)[d] != np.asarray(b)[d]))
                           for a, b in zip(jax.tree_util.tree_leaves(new.estimator_state), jax.tree_util.tree_leaves(st.estimator_state)))
                       for d in range(2)]
out["optax_changed_per_device_bad"] = changed(new_bad)
out["optax_changed_per_device_good"] = changed(new_good)
print(json.dumps(out))
'''


def test_one_nan_example_on_one_device_skips_the_step_on_every_device():
    proc = subprocess.run([sys.executable, "-c", _NAN_CHILD], cwd=Path(__file__).parent,
                          env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode, n in (("pmap", 2), ("sharding", 1)):
        m = r[mode]
        assert m["skipped"] == [True] * n and m["curvature_skipped"] == [True] * n, (mode, m)
        assert m["after"] == [False] * (2 * n), (mode, m)
        assert m["params_unchanged"] and m["statistics_unchanged"] and m["velocities_reset"], (mode, m)
        assert m["finite"] and m["same_on_devices"], (mode, m)
        # The step after the skipped one is the step of a run that never saw the bad batch.
        assert m["moved"] > 1e-3, (mode, m)
        assert m["max_diff_to_oracle"] < 1e-12 * max(1.0, m["moved"]) + 1e-13, (mode, m)
    assert r["sharding"]["params_replicated"]
    assert r["optax_changed_per_device_bad"] == [False, False]  # device 1's NaN drops device 0's update too
    assert r["optax_changed_per_device_good"] == [True, True]  # (and a good batch does update both)


# --- lax.scan and a Python loop: exactly the same curvature -------------------------------

L, T, D, H, V, B = 2, 3, 4, 5, 5, 2  # layers, tokens, width, MLP hidden, vocabulary, sequences


@pytest.mark.usefixtures("x64")
def test_stacked_transformer_in_scan_has_exactly_the_python_loops_curvature(mode="ggn_exact"):
    """(``tests/test_scan.py``'s slow transformer test, smaller: 2 layers, width 4, 2 sequences of 3
    tokens, the exact GGN; the sampled modes share the machinery and run there.)"""
    p = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64),
                               models.transformer_params(jax.random.PRNGKey(3), L, D, H, V))
    ids = jax.random.randint(jax.random.PRNGKey(4), (B, T + 1), 0, V)
    data = (ids[:, :-1], ids[:, 1:])
    listed = models.unstack_transformer(p)
    mats, ests = [], []
    for model, params in ((models.transformer_scan, p), (models.transformer_loop, listed)):
        est = curvax.BlockDiagonalCurvature(models.xent_loss(model))
        state = est.init(jax.random.PRNGKey(0), (params, data), None, None, False)
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, B, jax.random.PRNGKey(5), (params, data),
                                                     estimation_mode=mode)
        mats.append(np.asarray(est.to_dense_matrix(state)))
        ests.append(est)
    sites = ests[0].processed_jaxpr.layer_sites
    scanned = sorted((s.tag.name, s.pattern) for s in sites if s.scan is not None)
    assert scanned == sorted([("dense", "dense_with_bias")] * 6 + [("scale_and_shift", "scale_and_shift_both")])
    assert not any(s.pattern == "generic" for s in sites)
    # The stacked matrix in the loop's parameter order.
    perm = models.loop_order(p, listed, "stack")
    assert sorted(perm.tolist()) == list(range(len(perm)))
    # "Exactly": the same statistics up to float64 summation order.
    np.testing.assert_allclose(mats[0], mats[1][np.ix_(perm, perm)], rtol=1e-12, atol=1e-14)
    assert np.abs(mats[0]).max() > 1e-3


# --- float64 runs take float64 coefficients ---------------------------------------------


@pytest.mark.usefixtures("x64")
def test_a_float64_step_uses_the_float64_coefficients():
    """One dense layer and the squared error: with exact inverses and no EMA the step is
    ``-lr (GGN + damping I)^-1 g`` with the GGN ``2 J^T J / B``, in float64 throughout."""
    from jax.flatten_util import ravel_pytree

    kx, ky, kw = jax.random.split(jax.random.PRNGKey(0), 3)
    x, t = jax.random.normal(kx, (6, 3), jnp.float64), jax.random.normal(ky, (6, 2), jnp.float64)
    params = {"w": jax.random.normal(kw, (3, 2), jnp.float64), "b": jnp.zeros(2, jnp.float64)}
    apply = lambda p, x: x @ p["w"] + p["b"]

    def loss(p, batch):
        out = apply(p, batch[0])
        curvax.register_squared_error_loss(out, batch[1])
        return jnp.mean(jnp.sum((out - batch[1]) ** 2, axis=-1))

    lr, damping = 0.1, 0.1  # not representable in float32
    opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=0.0, num_burnin_steps=0, curvature_ema=0.0,
                           inverse_update_period=1, use_exact_inverses=True, estimation_mode="ggn_exact")
    state = opt.init(params, jax.random.PRNGKey(1), (x, t))
    new, _, stats = opt.step(params, state, jax.random.PRNGKey(2), batch=(x, t), learning_rate=lr, momentum=0.0,
                             damping=damping)
    theta, unravel = ravel_pytree(params)
    jac = jax.jacobian(lambda th: apply(unravel(th), x).reshape(-1))(theta)
    ggn = 2.0 * jac.T @ jac / x.shape[0]
    g = ravel_pytree(jax.grad(loss)(params, (x, t)))[0]
    expected = -lr * np.linalg.solve(np.asarray(ggn) + damping * np.eye(theta.size), np.asarray(g))
    np.testing.assert_allclose(ravel_pytree(new)[0] - theta, expected, rtol=1e-13, atol=1e-15)
    assert float(stats["learning_rate"]) == lr and float(stats["damping"]) == damping
