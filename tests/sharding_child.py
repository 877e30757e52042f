"""Training runs for tests/test_sharding.py, in a process whose device count is already set.

``python sharding_child.py devices`` trains every configuration on one device and on all the
process's devices (batch sharded, parameters replicated) and prints one JSON line.
``python sharding_child.py state`` trains, in float64, with the curvature state split over the
devices (FSDP-sharded parameters, or ``shard_curvature_state=True``) and on one device, and
prints one JSON line of the differences and the placements.
``python sharding_child.py process PID NUM PORT`` joins a ``jax.distributed`` job over loopback
as process ``PID`` of ``NUM``, feeds its own rows of the batch (replicated parameters, then
FSDP-sharded ones with the curvature state split over all the processes' devices, in float64),
and prints one JSON line.
The test process imports ``train`` for the one-device reference.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import curvax
import models
from curvax import distributed

BATCH = 32
# name -> (Optimizer arguments, step arguments)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # Adaptive everything: exact quadratic model, damping from the reduction ratio, burn-in,
    # inverses refreshed every other step.
    "adaptive": (
        dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True,
             initial_damping=1.0, num_burnin_steps=2, inverse_update_period=2),
        {},
    ),
    # Fixed coefficients, curvature on a random half of the (sharded) batch.
    "fixed_half_batch": (
        dict(num_burnin_steps=0, curvature_batch_fraction=0.5),
        dict(learning_rate=0.1, momentum=0.5, damping=0.1),
    ),
}


loss_fn = models.softmax_loss


def data() -> tuple[Any, tuple[np.ndarray, np.ndarray]]:
    """Parameters and a batch, identical in every process, as NumPy arrays."""
    params, batch = models.classifier(BATCH)
    return jax.tree_util.tree_map(np.asarray, (params, batch))


def train(config: str, params: Any, batch: Any, steps: int = 4) -> tuple[curvax.Optimizer, Any, Any, list[float]]:
    """``steps`` optimizer steps; returns the optimizer, parameters, state and the losses."""
    ctor, step_kwargs = CONFIGS[config]
    opt = curvax.Optimizer(jax.value_and_grad(loss_fn), l2_reg=1e-3, **ctor)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    losses = []
    for i in range(steps):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(2 + i), batch=batch, **step_kwargs)
        losses.append(float(stats["loss"]))
    return opt, params, state, losses


def train_optax(params: Any, batch: Any, steps: int = 4) -> tuple[Any, list[float]]:
    """The Optax path: ``kfac_preconditioner`` chained with SGD, in a jitted step."""
    import optax

    tx = optax.chain(curvax.kfac_preconditioner(loss_fn, batch, 0.1, inverse_update_period=2), optax.sgd(0.1))

    @jax.jit
    def step(params: Any, opt_state: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, batch=batch)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = tx.init(params)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return params, losses


def _compiled_step_text(opt: curvax.Optimizer, params: Any, state: Any, batch: Any, config: str) -> str:
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    kw = CONFIGS[config][1]
    coeffs = [f32(kw.get(k, 0.0)) for k in ("learning_rate", "momentum", "damping")]
    return opt._jit_step.lower(params, state, jax.random.PRNGKey(0), batch, None, *coeffs).compile().as_text()


def on_devices() -> dict[str, Any]:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(jax.devices(), ("data",))  # as in README, Several devices and hosts
    params, batch = data()
    out: dict[str, Any] = {"devices": jax.device_count()}
    for config in CONFIGS:
        _, p1, _, l1 = train(config, jax.device_put(params, jax.devices()[0]), jax.device_put(batch, jax.devices()[0]))
        sharded_batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        opt, pn, state, ln = train(config, jax.device_put(params, NamedSharding(mesh, P())), sharded_batch)
        trace_count = opt.trace_count  # before lowering the step again below
        hlo = _compiled_step_text(opt, pn, state, sharded_batch, config)
        out[config] = {
            "losses_one_device": l1,
            "losses_sharded": ln,
            "max_param_diff": max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(pn))
            ),
            "params_replicated": all(leaf.sharding.is_fully_replicated for leaf in jax.tree_util.tree_leaves(pn)),
            "params_on_all_devices": all(len(leaf.sharding.device_set) == jax.device_count() for leaf in jax.tree_util.tree_leaves(pn)),
            "trace_count": trace_count,
            "all_reduces": hlo.count("all-reduce("),
            "all_gathers": hlo.count("all-gather("),
            # The shapes of what is gathered: only the curvature work shared by
            # `distributed_inverses`/`distributed_precon_apply` (one row per device), never the batch.
            "all_gather_shapes": [
                shape for c in distributed.hlo_collectives(hlo) if c["op"] == "all-gather" for shape in c["shapes"]
            ],
        }
    _, l1 = train_optax(jax.device_put(params, jax.devices()[0]), jax.device_put(batch, jax.devices()[0]))
    pn, ln = train_optax(jax.device_put(params, NamedSharding(mesh, P())), sharded_batch)
    out["optax"] = {"losses_one_device": l1, "losses_sharded": ln,
                    "params_replicated": all(leaf.sharding.is_fully_replicated for leaf in jax.tree_util.tree_leaves(pn))}
    return out


# --- the curvature state split over the devices (``python sharding_child.py state``) -----------


def state_loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """A classifier whose first layer has no bias: Kronecker factors of 64 x 64 and 128 x 128
    (split over 4 devices), 129 x 129 (no mesh size divides it: replicated) and 8 x 8 (small)."""
    x, y = batch
    logits = jnp.tanh(x @ params["w1"]) @ params["w2"] + params["b2"]
    curvax.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(-jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, logits.shape[-1]), axis=-1))


def state_data() -> tuple[Any, tuple[np.ndarray, np.ndarray]]:
    """Float64 parameters and a batch for ``state_loss``."""
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    params = {"w1": jax.random.normal(k[0], (64, 128), jnp.float64) / 8,
              "w2": jax.random.normal(k[1], (128, 8), jnp.float64) / 8, "b2": jnp.zeros(8, jnp.float64)}
    batch = (jax.random.normal(k[2], (BATCH, 64), jnp.float64), jax.random.randint(k[3], (BATCH,), 0, 8))
    return jax.tree_util.tree_map(np.asarray, (params, batch))


def train_state(params: Any, batch: Any, steps: int = 3, **kw: Any) -> tuple[curvax.Optimizer, Any, list[Any], list[float]]:
    """Burn-in, then ``steps`` steps (inverses every other step); returns the optimizer, the
    parameters, the states (after init and after every step) and the losses."""
    opt = curvax.Optimizer(jax.value_and_grad(state_loss), l2_reg=1e-3, num_burnin_steps=2, inverse_update_period=2,
                           use_adaptive_learning_rate=True, use_adaptive_momentum=True, **kw)
    states = [opt.init(params, jax.random.PRNGKey(1), batch)]
    losses = []
    for i in range(steps):
        params, state, stats = opt.step(params, states[-1], jax.random.PRNGKey(2 + i), batch=batch, damping=0.1)
        states.append(state)
        losses.append(float(stats["loss"]))
    return opt, params, states, losses


def deep_loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Four dense layers, one block each, so that the distributed refresh gives each of 4
    devices one block: Kronecker factors of 64 x 64 and 128 x 128 (split over 4 devices),
    65 x 65 (the biased layer's input: replicated) and 8 x 8 (small)."""
    x, y = batch
    h = jnp.tanh(jnp.tanh(jnp.tanh(x @ params["w1"]) @ params["w2"]) @ params["w3"])
    logits = h @ params["w4"] + params["b4"]
    curvax.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(-jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, logits.shape[-1]), axis=-1))


def deep_data() -> tuple[Any, tuple[np.ndarray, np.ndarray]]:
    """Float64 parameters and a batch for ``deep_loss``, as NumPy arrays (call under x64)."""
    k = jax.random.split(jax.random.PRNGKey(4), 6)
    shapes = {"w1": (64, 128), "w2": (128, 64), "w3": (64, 64), "w4": (64, 8)}
    params = {name: jax.random.normal(key, shape, jnp.float64) / 8 for key, (name, shape) in zip(k, shapes.items())}
    params["b4"] = jnp.zeros(8, jnp.float64)
    batch = (jax.random.normal(k[4], (BATCH, 64), jnp.float64), jax.random.randint(k[5], (BATCH,), 0, 8))
    return jax.tree_util.tree_map(np.asarray, (params, batch))


def train_deep(params: Any, batch: Any, steps: int = 3) -> tuple[curvax.Optimizer, Any, list[Any], list[float]]:
    """``steps`` steps of ``deep_loss`` in the adaptive mode (learning rate, momentum and
    damping), inverses refreshed at steps 0 and 2; no burn-in (one program fewer to compile).
    Returns the optimizer, the parameters, the states (after init and every step) and the losses."""
    opt = curvax.Optimizer(jax.value_and_grad(deep_loss), l2_reg=1e-3, num_burnin_steps=0, inverse_update_period=2,
                           use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True,
                           initial_damping=1.0)
    states = [opt.init(params, jax.random.PRNGKey(1), batch)]
    losses = []
    for i in range(steps):
        params, state, stats = opt.step(params, states[-1], jax.random.PRNGKey(2 + i), batch=batch)
        states.append(state)
        losses.append(float(stats["loss"]))
    return opt, params, states, losses


def _specs(tree: Any) -> list[str]:
    return [str(leaf.sharding.spec) for leaf in jax.tree_util.tree_leaves(tree)]


def _max_rel_diff(a: Any, b: Any) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / max(1.0, float(np.max(np.abs(np.asarray(y))))))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    )


def sharded_state() -> dict[str, Any]:
    """FSDP-sharded parameters (the default splits the state) and replicated ones with
    ``shard_curvature_state=True``, each against the same run on one device."""
    jax.config.update("jax_enable_x64", True)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from curvax import parallel

    mesh = Mesh(jax.devices(), ("data",))
    params, batch = state_data()
    one = jax.devices()[0]
    _, p1, states1, l1 = train_state(jax.device_put(params, one), jax.device_put(batch, one))
    fsdp = {k: NamedSharding(mesh, P() if k == "b2" else P("data", None)) for k in params}
    runs = {
        "fsdp": (jax.device_put(params, fsdp), {}),
        "requested": (jax.device_put(params, NamedSharding(mesh, P())), {"shard_curvature_state": True}),
    }
    sharded_batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    out: dict[str, Any] = {"devices": jax.device_count(), "min_elements": parallel.SHARD_MIN_ELEMENTS}
    for name, (p0, kw) in runs.items():
        opt, pn, states, ln = train_state(p0, sharded_batch, **kw)
        trace_count = opt.trace_count  # before lowering the step again below
        compiled = opt._jit_step.lower(pn, states[-1], jax.random.PRNGKey(0), sharded_batch, None,
                                       *(jnp.asarray(0.1),) * 3).compile()
        state_in, state_out = compiled.input_shardings[0][1], compiled.output_shardings[1]
        est = states[-1].estimator_state
        out[name] = {
            "losses": ln, "losses_one_device": l1,
            "max_param_rel_diff": _max_rel_diff(pn, p1),
            "max_state_rel_diff": _max_rel_diff(est, states1[-1].estimator_state),
            "trace_count": trace_count,
            # (shape, spec, shard shape) of every curvature-state leaf after the last step
            "leaves": [(list(x.shape), str(x.sharding.spec), list(x.sharding.shard_shape(x.shape)))
                       for x in jax.tree_util.tree_leaves(est)],
            "same_placement_every_step": all(_specs(s) == _specs(states[-1]) for s in states),
            # The compiled step takes the curvature state and the velocities where it returns them
            # (an unused input, e.g. a damping given to `step`, has no sharding: not compared).
            "compiled_in_equals_out": all(
                _specs_of(getattr(state_in, f)) == _specs_of(getattr(state_out, f)) == _specs(getattr(states[-1], f))
                for f in ("estimator_state", "velocities")
            ),
            "bytes_per_device": parallel.bytes_per_device(est),
            "bytes_one_device": parallel.bytes_per_device(states1[-1].estimator_state),
        }
    # shard_curvature_state=False keeps the state replicated next to sharded parameters.
    opt = curvax.Optimizer(jax.value_and_grad(state_loss), l2_reg=1e-3, shard_curvature_state=False)
    state = opt.init(jax.device_put(params, fsdp), jax.random.PRNGKey(1), sharded_batch)
    out["declined_replicated"] = all(x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(state.estimator_state))
    return out


def _specs_of(shardings: Any) -> list[str]:
    return [str(s.spec) for s in jax.tree_util.tree_leaves(shardings, is_leaf=lambda s: hasattr(s, "spec"))]


def in_process(pid: int, num: int, port: int) -> dict[str, Any]:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num, process_id=pid)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(jax.devices(), ("data",))  # as in README, Several devices and hosts
    params, (x, y) = data()
    rows = slice(pid * BATCH // num, (pid + 1) * BATCH // num)  # this process's rows only
    batch = tuple(jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), a[rows]) for a in (x, y))
    replicated = NamedSharding(mesh, P())
    params = jax.tree_util.tree_map(lambda a: jax.make_array_from_callback(a.shape, replicated, lambda i: a[i]), params)
    out: dict[str, Any] = {"pid": pid, "processes": jax.process_count(), "devices": jax.device_count()}
    for config in CONFIGS:
        opt, p, _, losses = train(config, params, batch)
        out[config] = {
            "losses": losses,
            "params": [np.asarray(leaf.addressable_data(0)).tolist() for leaf in jax.tree_util.tree_leaves(p)],
            "trace_count": opt.trace_count,
        }
    with jax.enable_x64(True):
        out["fsdp"] = fsdp_in_process(mesh, pid, num)
    return out


def fsdp_in_process(mesh: Any, pid: int, num: int) -> dict[str, Any]:
    """``train_deep`` in float64 with FSDP-sharded parameters on the global mesh: the default
    then splits the curvature state over all the processes' devices, and the distributed
    refresh and preconditioning deal their blocks to all of them. Reports the losses, the global
    parameters and curvature state (gathered to every process), each state leaf's placement as
    this process sees it, the compiled step's all-gathers and per-device decompositions, and
    the error ``init`` gives for a NaN in another process's rows."""
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    params, (x, y) = deep_data()
    rows = slice(pid * BATCH // num, (pid + 1) * BATCH // num)
    batch = tuple(jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), a[rows]) for a in (x, y))
    place = {k: NamedSharding(mesh, P() if k == "b4" else P("data", None)) for k in params}
    fsdp = lambda tree: {k: jax.make_array_from_callback(a.shape, place[k], lambda i, a=a: a[i]) for k, a in tree.items()}
    opt, p, states, losses = train_deep(fsdp(params), batch)
    trace_count = opt.trace_count  # before lowering the step again below
    hlo = opt._jit_step.lower(p, states[-1], jax.random.PRNGKey(0), batch, None,
                              *(jnp.asarray(0.1),) * 3).compile().as_text()
    gather = lambda tree: [np.asarray(a).tolist() for a in
                           jax.tree_util.tree_leaves(multihost_utils.process_allgather(tree, tiled=True))]
    est = states[-1].estimator_state
    # A NaN in the last row of w3: on the last process's devices only.
    params["w3"] = params["w3"].copy()
    params["w3"][-1, 0] = np.nan
    try:
        opt.init(fsdp(params), jax.random.PRNGKey(1), batch)
        nan_error = None
    except ValueError as e:
        nan_error = str(e)
    return {
        "losses": losses,
        "trace_count": trace_count,
        "params": gather(p),
        "params_shards": [list(a.sharding.shard_shape(a.shape)) for a in jax.tree_util.tree_leaves(p)],
        "state": gather(est),
        # per curvature-state leaf: its shape and spec, its shards' shape, how many devices
        # hold it in all, and the devices and shard shapes this process holds
        "leaves": [
            {"shape": list(a.shape), "spec": str(a.sharding.spec), "shard": list(a.sharding.shard_shape(a.shape)),
             "devices": len(a.sharding.device_set), "fully_addressable": a.is_fully_addressable,
             "local_devices": sorted(s.device.id for s in a.addressable_shards),
             "local_shards": [list(s.data.shape) for s in a.addressable_shards]}
            for a in jax.tree_util.tree_leaves(est)
        ],
        "same_placement_every_step": all(_specs(s) == _specs(states[-1]) for s in states),
        "process_devices": sorted(d.id for d in jax.local_devices()),
        "all_gather_shapes": [s for c in distributed.hlo_collectives(hlo) if c["op"] == "all-gather" for s in c["shapes"]],
        # LAPACK calls (the decompositions) per branch of each conditional, and in all
        "lapack_branches": distributed.hlo_branch_custom_calls(hlo, "lapack"),
        "lapack_calls": hlo.count('custom_call_target="lapack'),
        "nan_error": nan_error,
    }


if __name__ == "__main__":
    if sys.argv[1] == "devices":
        print(json.dumps(on_devices()))
    elif sys.argv[1] == "state":
        print(json.dumps(sharded_state()))
    else:
        print(json.dumps(in_process(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
