"""Runs for tests/test_split_state.py: the distributed refresh and products with the curvature
state stored split over N CPU devices, in float64.

``python split_state_child.py N`` trains a three-layer MLP with FSDP-sharded parameters (the
default then splits the curvature state by rows) on N devices and the same on one device, and
prints one JSON line: per configuration (approximate inverses; exact ones, i.e. cached
eigendecompositions; a 2 x 2 mesh with a factor split over one axis only), the largest relative parameter and state differences after burn-in and 3
steps (inverses refreshed at steps 0 and 2), the placements of the state, the collectives of
the compiled step, the whole split factors' shapes, and the same collectives when the step is
compiled the old way (``split_state`` off: replicated in and out of the ``shard_map``), to show
what the check would catch.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import xla_env

if __name__ == "__main__":  # before JAX starts
    xla_env.request_devices(int(sys.argv[1]))

from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import curvax  # noqa: E402
from curvax import distributed, parallel  # noqa: E402

BATCH = 32
COEFFS = (0.1, 0.5, 0.1)  # learning rate, momentum, damping
# name -> (Optimizer arguments, layer widths, mesh shape): a one-axis mesh, and a 2 x 2 mesh where a
# side of 66 is split over one axis only (4 does not divide it; 2 does) and copied over the other.
CONFIGS: dict[str, tuple[dict[str, Any], tuple[int, ...], tuple[int, ...]]] = {
    "approximate": ({}, (64, 128, 64, 8), (-1,)),
    "exact": ({"use_exact_inverses": True}, (64, 128, 64, 8), (-1,)),
    "mesh2x2": ({}, (64, 132, 66, 8), (2, 2)),
}


def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """A tanh MLP with a squared-error loss and a bias on the last layer only. Widths 64 -> 128 ->
    64 -> 8: factors of sides 64 and 128 (split over 2 or 4 devices), 65 (no mesh size divides
    it: replicated) and 8 (small: replicated); three blocks, so owners differ."""
    x, y = batch
    layers = sorted(k for k in params if k.startswith("w"))
    for k in layers[:-1]:
        x = jnp.tanh(x @ params[k])
    out = x @ params[layers[-1]] + params["b"]
    curvax.register_squared_error_loss(out, y)
    return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


def data(widths: tuple[int, ...]) -> tuple[Any, Any]:
    k = jax.random.split(jax.random.PRNGKey(5), len(widths) + 1)
    params = {f"w{i}": jax.random.normal(k[i], (a, b), jnp.float64) / np.sqrt(a)
              for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))}
    params["b"] = jnp.zeros(widths[-1], jnp.float64)
    batch = (jax.random.normal(k[-2], (BATCH, widths[0]), jnp.float64),
             jax.random.normal(k[-1], (BATCH, widths[-1]), jnp.float64))
    return jax.tree_util.tree_map(np.asarray, (params, batch))


def train(params: Any, batch: Any, steps: int = 3, old: bool = False, **kw: Any) -> tuple[curvax.Optimizer, Any, Any]:
    """Burn-in and ``steps`` steps; ``old``: with the state replicated into the distributed work
    (``split_state`` off), as before the exchange by shares."""
    opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=1e-3, num_burnin_steps=2, inverse_update_period=2,
                           estimation_mode="fisher_exact", **kw)
    state = opt.init(params, jax.random.PRNGKey(1), batch)
    if old:  # before the step is first traced
        opt._program.distribution = dataclasses.replace(opt._program.distribution, split_state=False)
    lr, mom, damp = COEFFS
    for i in range(steps):
        params, state, _ = opt.step(params, state, jax.random.PRNGKey(2 + i), batch=batch, learning_rate=lr,
                                    momentum=mom, damping=damp)
    return opt, params, state


def compiled_text(opt: curvax.Optimizer, params: Any, state: Any, batch: Any) -> tuple[str, int]:
    """The compiled step's HLO and its temporaries per device (bytes)."""
    compiled = opt._jit_step.lower(params, state, jax.random.PRNGKey(0), batch, None,
                                   *(jnp.asarray(c) for c in COEFFS)).compile()
    mem = compiled.memory_analysis()
    return compiled.as_text(), int(mem.temp_size_in_bytes) if mem is not None else -1


def rel_diff(a: Any, b: Any) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / max(1.0, float(np.max(np.abs(np.asarray(y))))))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    )


def main() -> None:
    jax.config.update("jax_enable_x64", True)
    n = jax.device_count()
    out: dict[str, Any] = {"devices": n, "configs": {}}
    one = jax.devices()[0]
    for name, (kw, widths, shape) in CONFIGS.items():
        mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data",) if len(shape) == 1 else ("a", "b"))
        params, batch = data(widths)
        # FSDP: every weight split by rows as the state would be (over the mesh axes dividing them).
        fsdp = {k: NamedSharding(mesh, parallel.split_spec(v.shape, mesh, 1) if k != "b" else P()) for k, v in params.items()}
        sharded_batch = jax.device_put(batch, NamedSharding(mesh, P(mesh.axis_names)))
        _, p1, s1 = train(jax.device_put(params, one), jax.device_put(batch, one), **kw)
        opt, pn, sn = train(jax.device_put(params, fsdp), sharded_batch, **kw)
        est = sn.estimator_state
        split = [x for x in jax.tree_util.tree_leaves(est) if not x.sharding.is_fully_replicated]
        hlo, temp = compiled_text(opt, pn, sn, sharded_batch)
        # The same run the old way: the state replicated into the shard_map.
        old, po, so = train(jax.device_put(params, fsdp), sharded_batch, old=True, **kw)
        old_hlo, old_temp = compiled_text(old, po, so, sharded_batch)
        out["configs"][name] = {
            "split_state": bool(opt._program.distribution.split_state),
            "old_split_state": bool(old._program.distribution.split_state),
            "max_param_rel_diff": rel_diff(pn, p1),
            # A cached eigenbasis may differ from one device's in its vectors' signs (the factors
            # differ in the last bits: sums in another order), so the state is also compared
            # with the old path's on the same devices.
            "max_state_rel_diff": rel_diff(est, s1.estimator_state),
            "max_param_rel_diff_old": rel_diff(pn, po),
            "max_state_rel_diff_old": rel_diff(est, so.estimator_state),
            "moved": rel_diff(pn, params),
            "split_leaves": [[list(x.shape), str(x.sharding.spec)] for x in split],
            "whole_split_shapes": sorted({f"f64[{','.join(map(str, x.shape))}]" for x in split}),
            "collectives": distributed.hlo_collectives(hlo),
            "collectives_old": distributed.hlo_collectives(old_hlo),
            "temp_bytes": temp,
            "temp_bytes_old": old_temp,
            "state_bytes_per_device": parallel.bytes_per_device(est),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
