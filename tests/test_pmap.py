"""kfac-jax's pmap mode, ``Optimizer(multi_device=True)``: the one-device run, split over devices.

Every input carries a leading device axis (the parameters, the state and ``func_state`` copied
on every device, the batch split over them, one key per device), curvax runs its own
``jax.pmap`` and averages the loss, the gradient, the curvature statistics, the exact quadratic
model and the damping's new loss over the axis. With deterministic curvature
(``estimation_mode="fisher_exact"``) the result must be the one-device result on the whole
batch. The device count is fixed when JAX starts, so the runs happen in a subprocess
(``tests/pmap_child.py``) with four CPU devices.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from xla_env import child_env

import curvax
import models
import pmap_child as child

# A module's tests share one xdist worker (`--dist loadfile`), so its module-scoped children run
# once. (`xdist_group`/`--dist loadgroup` do not group under pytest 9.2 with pytest-xdist 3.8.)

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def runs() -> dict:
    proc = subprocess.run([sys.executable, "pmap_child.py"], cwd=HERE, env=child_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config", list(child.CONFIGS))
def test_split_batch_on_four_devices_matches_one_device(runs, config):
    assert runs["devices"] == 4
    r = runs[config]
    # Parameters, velocities and curvature statistics: the one-device values, on every device.
    assert r["param_diff"] < 1e-5 and r["velocity_diff"] < 1e-5, r
    assert r["statistics_diff"] < 1e-5, r
    assert r["device_spread"] == 0.0, r
    for k in child.COMPARED_STATS:
        one, many = (np.array(v, dtype=float) for v in r[k])
        assert many.shape == (child.STEPS, 4), k  # stats come back with the device axis
        np.testing.assert_array_equal(many, np.repeat(many[:, :1], 4, axis=1), err_msg=k)
        np.testing.assert_allclose(many[:, 0], one, rtol=1e-5, atol=1e-5, err_msg=f"{config}: {k}")
    if child.CONFIGS[config][0].get("use_adaptive_damping"):
        assert np.isfinite(np.array(r["rho"][0], dtype=float)).all()  # the reduction ratio was computed
    # The batch of a step is every device's share.
    assert r["batch_size"] == [child.BATCH, [child.BATCH] * 4]
    assert r["data_seen"] == [child.STEPS * child.BATCH, [child.STEPS * child.BATCH] * 4]
    assert r["losses"][-1] < r["losses"][0]
    if child.CONFIGS[config][3]:  # func_state averaged by the loss itself: the one-device state
        assert r["func_state_diff"] < 1e-5


def test_wrongly_shaped_arguments_name_the_argument(runs):
    e = runs["errors"]
    assert "`params` needs a leading device axis of size n = 4" in e["params_without_axis"]
    assert "params['b1'] has shape (8,)" in e["params_without_axis"]
    assert "`rng`" in e["rng_single_key"] and "one key per device" in e["rng_single_key"]
    assert "`batch`" in e["batch_wrong_axis"] and "(2, 16, 6)" in e["batch_wrong_axis"]
    assert "`batch`" in e["step_batch_wrong_axis"]
    assert "`learning_rate`" in e["step_lr_wrong_shape"] and "(5,)" in e["step_lr_wrong_shape"]


def test_one_device_pmap_mode_in_process():
    """With one device the device axis has size 1: the step equals the plain step."""
    params, batch = models.classifier(8)
    kw = dict(l2_reg=1e-3, num_burnin_steps=0, estimation_mode="fisher_exact", inverse_update_period=1)
    plain = curvax.Optimizer(jax.value_and_grad(models.softmax_loss), **kw)
    pm = curvax.Optimizer(jax.value_and_grad(models.softmax_loss), multi_device=True, **kw)
    add = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)
    key = jax.random.PRNGKey(0)
    s1 = plain.init(params, key, batch)
    sn = pm.init(add(params), add(key), add(batch))
    p1, s1, st1 = plain.step(params, s1, key, batch=batch, learning_rate=0.1, momentum=0.5, damping=0.1)
    pn, sn, stn = pm.step(add(params), sn, add(key), batch=add(batch), learning_rate=0.1, momentum=0.5, damping=0.1)
    for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(pn)):
        np.testing.assert_allclose(np.asarray(b)[0], a, rtol=1e-6, atol=1e-7)
    assert stn["loss"].shape == (1,) and np.isclose(stn["loss"][0], st1["loss"])
    assert pm.multi_device and pm.pmap_axis_name == "kfac_axis" and plain.pmap_axis_name is None
    assert pm.get_first(stn)["loss"].shape == () and plain.get_first(st1) is st1
    with pytest.raises(ValueError, match="`params` needs a leading device axis of size n = 1"):
        pm.init(params, add(key), add(batch))


def test_ferminet_style_usage(runs):
    """rng and aux, ``lax.pmean`` in the loss, sampled Fisher, burn-in from a data iterator,
    keys from ``utils.p_split``, momentum and damping replicated over the devices."""
    r = runs["ferminet_style"]
    losses, aux = np.array(r["losses"]), np.array(r["aux"])
    assert losses.shape == aux.shape == (4, 4) and np.isfinite(losses).all()
    assert r["device_spread"] == 0.0 and (losses == losses[:, :1]).all()
    # aux is averaged over the devices: the mean over the whole batch of the step.
    np.testing.assert_allclose(aux, np.repeat(np.array(r["expected_aux"])[:, None], 4, axis=1), rtol=1e-5, atol=1e-6)
    assert r["data_seen"] == [4 * child.BATCH] * 4
    assert losses[-1, 0] < losses[0, 0]


def test_bound_axes_lets_traces_see_the_device_axis():
    """``init`` traces the loss outside the pmap; collectives on the device axis must trace there."""
    from curvax import _compat

    f = lambda x: jax.lax.pmean(x * 2.0, "devices")
    with pytest.raises(NameError):
        jax.make_jaxpr(f)(1.0)
    with _compat.bound_axes([("devices", 4)]):
        text = str(_compat.make_jaxpr(f, 1.0))
        assert "axes=('devices',)" in text and "div" in text and "4.0" in text  # the mean over 4 devices
        assert jax.eval_shape(f, 1.0).shape == ()
    with pytest.raises(NameError):
        jax.make_jaxpr(f)(1.0)


def _pmap_run(sizes: tuple[int, ...]) -> tuple[curvax.Optimizer, list]:
    """Steps of a one-device pmap-mode optimizer on batches of the given sizes; the parameters after each."""
    params, batch = models.classifier(8)
    add = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)
    opt = curvax.Optimizer(jax.value_and_grad(models.softmax_loss), multi_device=True, l2_reg=1e-3, num_burnin_steps=0,
                           estimation_mode="fisher_exact", inverse_update_period=1, learning_rate_schedule=lambda s: 0.1)
    key = add(jax.random.PRNGKey(0))
    p, state = add(params), opt.init(add(params), key, add(batch))
    out = []
    for n in sizes:
        p, state, _ = opt.step(p, state, key, batch=add(jax.tree_util.tree_map(lambda a: a[:n], batch)), momentum=0.5, damping=0.1)
        out.append(np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(p)]))
    return opt, out


def test_pmap_mode_calls_one_compiled_program_per_signature_with_the_pmaps_numbers(monkeypatch):
    """``parallel.CompiledPmap``: the step's compiled programs are called directly (no pmap
    dispatch in Python), one per batch shape, and give the pmap's numbers bit for bit."""
    from curvax import parallel

    opt, direct = _pmap_run((8, 8, 4, 8))
    assert parallel.CompiledPmap.direct_calls()  # JAX's pmap is a jitted shard_map here
    assert len(opt._call_step._programs) == 2 and opt.trace_count == 2
    monkeypatch.setattr(parallel.CompiledPmap, "direct_calls", staticmethod(lambda: False))
    opt_pmap, through_pmap = _pmap_run((8, 8, 4, 8))
    assert opt_pmap._call_step._programs == {}
    for a, b in zip(direct, through_pmap):
        np.testing.assert_array_equal(a, b)


def test_a_traced_call_has_no_signature():
    """``step`` traced inside a ``jit`` cannot call a compiled program: no signature, so the pmap is called."""
    from curvax.step import config

    assert config.call_signature({"a": np.ones(3)}, None) is not None
    seen = []
    jax.jit(lambda x: seen.append(config.call_signature({"a": x})) or x)(np.ones(3))
    assert seen == [None]


def test_averaged_statistics_are_judged_finite_without_another_collective():
    """Statistics averaged over the devices (every step here) are the same on every device, so
    is their finiteness: the step needs no all-reduce of the decision (a ``pmin``) after the
    average, one collective fewer per step. (A NaN on one device still reaches every device
    through the average: ``tests/test_nan_guard.py`` and ``test_claims.py`` run that on 4 devices.)"""
    import re

    params, batch = models.classifier(8)
    add = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)
    opt = curvax.Optimizer(jax.value_and_grad(models.softmax_loss), multi_device=True, l2_reg=1e-3, num_burnin_steps=0,
                           estimation_mode="fisher_exact", inverse_update_period=1)
    key = add(jax.random.PRNGKey(0))
    state = opt.init(add(params), key, add(batch))
    c = np.full((1,), 0.1, np.float32)
    text = opt._jit_step.lower(add(params), state, key, add(batch), None, c, c, c).as_text()
    reductions = re.findall(r"all_reduce.*?stablehlo\.return", text, flags=re.S)
    assert reductions and all("stablehlo.add" in r for r in reductions)  # the averages, and no min
    assert not any("minimum" in r for r in reductions)
