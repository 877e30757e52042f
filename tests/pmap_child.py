"""Training runs for tests/test_pmap.py: kfac-jax's pmap mode (``multi_device=True``) on 4 CPU devices.

``python pmap_child.py`` trains every configuration twice, on one device with the whole batch
and with ``multi_device=True`` with the batch split over the 4 devices, checks the argument
errors, and prints one JSON line. The device count is fixed when JAX starts, hence the
subprocess (and the environment variable set before ``import jax``).
"""

from __future__ import annotations

import json

import xla_env

if __name__ == "__main__":  # before JAX starts; not when the test imports the configurations
    xla_env.request_devices(4)

from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import curvax  # noqa: E402
import models  # noqa: E402

BATCH = 32
STEPS = 3
AXIS = "devices"  # not kfac-jax's default, to check that pmap_axis_name is used
FIXED = dict(learning_rate=0.1, momentum=0.5, damping=0.1)
# name -> (Optimizer arguments, step arguments, value_func_has_state, loss calls lax.pmean)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], bool, bool]] = {
    "fixed": (dict(num_burnin_steps=1, inverse_update_period=1), FIXED, False, False),
    "adaptive": (
        dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True,
             initial_damping=1.0, damping_adaptation_interval=1, num_burnin_steps=1, inverse_update_period=2),
        {}, False, False,
    ),
    "fixed_state": (dict(num_burnin_steps=0, inverse_update_period=2), FIXED, True, False),
    # The loss and the new func_state average over the device axis themselves (lax.pmean).
    "adaptive_state_pmean": (
        dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True,
             initial_damping=1.0, damping_adaptation_interval=1, num_burnin_steps=1),
        {}, True, True,
    ),
}
COMPARED_STATS = ("loss", "learning_rate", "momentum", "damping", "new_loss", "rho")


def make_loss(has_state: bool, collective: bool):
    """``models.softmax_loss``, optionally with a func_state (a running input mean) and ``lax.pmean``."""
    mean = (lambda x: jax.lax.pmean(x, AXIS)) if collective else (lambda x: x)

    def loss(params, *rest):
        func_state, batch = rest if has_state else (None, rest[0])
        value = mean(models.softmax_loss(params, batch))
        if not has_state:
            return value
        new_state = {"mean": 0.5 * func_state["mean"] + 0.5 * mean(jnp.mean(batch[0], axis=0)),
                     "count": func_state["count"] + 1}
        return value, new_state

    return loss


def train(config: str, params: Any, batch: Any, devices: int) -> tuple[Any, Any, list[dict[str, float]]]:
    """``STEPS`` steps on one device (``devices=0``) or with the batch split over ``devices``."""
    ctor, step_kwargs, has_state, collective = CONFIGS[config]
    loss = make_loss(has_state, collective and devices > 0)
    opt = curvax.Optimizer(
        jax.value_and_grad(loss, has_aux=has_state), l2_reg=1e-3, value_func_has_state=has_state,
        estimation_mode="fisher_exact", multi_device=devices > 0, pmap_axis_name=AXIS, **ctor,
    )
    func_state = {"mean": jnp.zeros(batch[0].shape[-1]), "count": jnp.zeros([], jnp.int32)} if has_state else None
    rng = jax.random.PRNGKey(1)
    if devices:
        rep = lambda t: curvax.utils.replicate_all_local_devices(t)
        params, func_state = rep(params), rep(func_state)
        batch = jax.tree_util.tree_map(lambda a: a.reshape((devices, -1) + a.shape[1:]), batch)
        init_rng, rng = rep(rng), jax.random.split(rng, devices)
        kwargs = {k: rep(jnp.asarray(v)) for k, v in step_kwargs.items()}  # as FermiNet passes them
    else:
        init_rng, kwargs = rng, step_kwargs
    state = opt.init(params, init_rng, batch, func_state)
    stats_log = []
    for i in range(STEPS):
        key = jax.random.fold_in(rng, i) if not devices else jax.vmap(lambda k: jax.random.fold_in(k, i))(rng)
        out = opt.step(params, state, key, batch=batch, func_state=func_state, **kwargs)
        params, state, stats = (out[0], out[1], out[3]) if has_state else out
        func_state = out[2] if has_state else None
        stats_log.append({k: np.asarray(v).tolist() for k, v in stats.items() if k in COMPARED_STATS + ("batch_size", "data_seen")})
    return params, (state, func_state), stats_log


def max_diff(a: Any, b: Any) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def spread(tree: Any) -> float:
    """Largest difference between devices (all slices of the leading axis should be equal)."""
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(x)[:1]))) for x in jax.tree_util.tree_leaves(tree))


def compare(config: str) -> dict[str, Any]:
    params, batch = models.classifier(BATCH)
    p1, (s1, f1), st1 = train(config, params, batch, 0)
    pn, (sn, fn), stn = train(config, params, batch, jax.local_device_count())
    first = lambda t: jax.tree_util.tree_map(lambda x: np.asarray(x)[0], t)
    out: dict[str, Any] = {
        "param_diff": max_diff(p1, first(pn)),
        "statistics_diff": max_diff(s1.estimator_state, first(sn.estimator_state)),
        "velocity_diff": max_diff(s1.velocities, first(sn.velocities)),
        "device_spread": spread((pn, sn)),
        "losses": [s["loss"] for s in st1],
        "data_seen": [st1[-1]["data_seen"], stn[-1]["data_seen"]],
        "batch_size": [st1[-1]["batch_size"], stn[-1]["batch_size"]],
    }
    for k in COMPARED_STATS:
        out[k] = [[s[k] for s in st1], [s[k] for s in stn]]  # one device: (steps,); pmap: (steps, devices)
    if f1 is not None:
        out["func_state_diff"] = max_diff(f1, first(fn))
    return out


def errors() -> dict[str, str]:
    """The messages of wrongly shaped arguments."""
    n = jax.local_device_count()
    params, batch = models.classifier(BATCH)
    opt = curvax.Optimizer(jax.value_and_grad(models.softmax_loss), l2_reg=1e-3, multi_device=True, num_burnin_steps=0)
    rep = curvax.utils.replicate_all_local_devices
    split = jax.tree_util.tree_map(lambda a: a.reshape((n, -1) + a.shape[1:]), batch)
    wrong = jax.tree_util.tree_map(lambda a: a.reshape((n // 2, -1) + a.shape[1:]), batch)
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    out = {}
    for name, args in {
        "params_without_axis": (params, keys, split),
        "rng_single_key": (rep(params), jax.random.PRNGKey(0), split),
        "batch_wrong_axis": (rep(params), keys, wrong),
    }.items():
        try:
            opt.init(*args)
            out[name] = ""
        except ValueError as e:
            out[name] = str(e)
    state = opt.init(rep(params), keys, split)
    try:
        opt.step(rep(params), state, keys, batch=wrong, **FIXED)
        out["step_batch_wrong_axis"] = ""
    except ValueError as e:
        out["step_batch_wrong_axis"] = str(e)
    try:
        opt.step(rep(params), state, keys, batch=split, learning_rate=jnp.ones(n + 1), momentum=0.5, damping=0.1)
        out["step_lr_wrong_shape"] = ""
    except ValueError as e:
        out["step_lr_wrong_shape"] = str(e)
    return out


def ferminet_style() -> dict[str, Any]:
    """Used as FermiNet uses kfac-jax: rng and aux, a pmean in the loss, sampled Fisher, a data iterator."""
    utils = curvax.utils
    n = jax.local_device_count()
    params, (x, y) = models.classifier(BATCH * 4)

    def loss(params, key, batch):
        value = jax.lax.pmean(models.softmax_loss(params, batch), AXIS)
        return value, {"first_logit": jax.lax.pmean(jnp.mean(batch[0][:, 0]), AXIS), "noise": jax.random.normal(key)}

    opt = curvax.Optimizer(
        jax.value_and_grad(loss, has_aux=True), l2_reg=0.0, value_func_has_aux=True, value_func_has_rng=True,
        learning_rate_schedule=lambda t: 0.2, norm_constraint=1.0, num_burnin_steps=2, inverse_update_period=1,
        multi_device=True, pmap_axis_name=AXIS,
    )
    batches = [tuple(a[i * BATCH:(i + 1) * BATCH].reshape((n, -1) + a.shape[1:]) for a in (x, y)) for i in range(4)]
    data = iter(batches * 3)
    sharded_key = utils.make_different_rng_key_on_all_devices(jax.random.PRNGKey(0))
    sharded_key, subkeys = utils.p_split(sharded_key)
    params = utils.replicate_all_local_devices(params)
    state = opt.init(params, subkeys, batches[0])
    shared_mom, shared_damping = utils.replicate_all_local_devices(jnp.asarray(0.0)), utils.replicate_all_local_devices(jnp.asarray(1e-2))
    losses, aux = [], []
    for _ in range(4):
        sharded_key, subkeys = utils.p_split(sharded_key)
        params, state, stats = opt.step(params, state, subkeys, data_iterator=data, momentum=shared_mom, damping=shared_damping)
        losses.append(np.asarray(stats["loss"]).tolist())
        aux.append(np.asarray(stats["aux"]["first_logit"]).tolist())
    # The burn-in took two batches from the iterator; the steps take the next four.
    expected_aux = [float(np.mean(batches[i % 4][0][..., 0])) for i in range(2, 6)]
    return {"losses": losses, "aux": aux, "expected_aux": expected_aux, "device_spread": spread((params, state)),
            "data_seen": np.asarray(state.data_seen).tolist()}


if __name__ == "__main__":
    result: dict[str, Any] = {"devices": jax.local_device_count()}
    for c in CONFIGS:
        result[c] = compare(c)
    result["errors"] = errors()
    result["ferminet_style"] = ferminet_style()
    print(json.dumps(result))
