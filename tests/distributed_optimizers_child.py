"""Runs for tests/test_distributed.py: the optimizers with their curvature work split over N CPU
devices (``distributed_inverses`` / ``distributed_precon_apply``, on by default) against the same
optimizers with the split turned off, in float64.

``python distributed_optimizers_child.py N`` prints one JSON line with, per entry point
(``curvax.Optimizer`` in pmap mode and on a ``jax.sharding`` mesh, ``OptaxPreconditioner`` in a
pmap, ``kfac_preconditioner(mesh=...)`` in a jitted Optax step, ``kfac_ferminet_alpha`` in pmap
mode): the largest parameter difference after 3 steps (inverses refreshed at steps 0 and 2) between
split and unsplit, and the all-gathers of the compiled step (split and unsplit), so a test can
check that the split really happened and what it communicates.
"""

from __future__ import annotations

import itertools
import json
import sys

import xla_env

if __name__ == "__main__":  # before JAX starts
    xla_env.request_devices(int(sys.argv[1]))

from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import curvax  # noqa: E402
from curvax import distributed  # noqa: E402
from distributed_child import MODELS, max_diff, model  # noqa: E402

AXIS = "kfac_axis"
STEPS = 3
ALPHA_DEFAULT: list = []  # what the alpha's optimizer hands curvax when nobody overrides it
COEFFS = dict(learning_rate=0.1, momentum=0.5, damping=0.1)


def gathers(hlo: str) -> list[str]:
    """The shapes the all-gathers of a compiled program produce."""
    return [s for c in distributed.hlo_collectives(hlo) if c["op"] == "all-gather" for s in c["shapes"]]


def replicate(tree: Any, n: int) -> Any:
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)


def split_batch(batch: Any, n: int) -> Any:
    return jax.tree_util.tree_map(lambda x: x.reshape((n, -1) + x.shape[1:]), batch)


def optimizer_pmap(loss: Callable, params: Any, batch: Any, n: int, on: bool) -> tuple[Any, list[str]]:
    opt = curvax.Optimizer(
        jax.value_and_grad(loss), l2_reg=1e-3, num_burnin_steps=0, inverse_update_period=2, multi_device=True,
        pmap_axis_name=AXIS, estimation_mode="fisher_exact", distributed_inverses=on, distributed_precon_apply=on,
    )
    p, b = replicate(params, n), split_batch(batch, n)
    keys = jax.random.split(jax.random.PRNGKey(1), n)
    state = opt.init(p, keys, b)
    for i in range(STEPS):
        p, state, _ = opt.step(p, state, jax.random.split(jax.random.PRNGKey(2 + i), n), batch=b,
                               **{k: jnp.full((n,), v) for k, v in COEFFS.items()})
    lowered = opt._jit_step.lower(p, state, jax.random.split(jax.random.PRNGKey(0), n), b, None,
                                  *(jnp.full((n,), COEFFS[k]) for k in ("learning_rate", "momentum", "damping")))
    return jax.tree_util.tree_map(lambda x: x[0], p), gathers(lowered.compile().as_text())


def optimizer_mesh(loss: Callable, params: Any, batch: Any, mesh: Mesh, on: bool) -> tuple[Any, list[str]]:
    opt = curvax.Optimizer(
        jax.value_and_grad(loss), l2_reg=1e-3, num_burnin_steps=0, inverse_update_period=2,
        estimation_mode="fisher_exact", distributed_inverses=on, distributed_precon_apply=on,
    )
    p = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    b = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
    state = opt.init(p, jax.random.PRNGKey(1), b)
    for i in range(STEPS):
        p, state, _ = opt.step(p, state, jax.random.PRNGKey(2 + i), batch=b, **COEFFS)
    lowered = opt._jit_step.lower(p, state, jax.random.PRNGKey(0), b, None,
                                  *(jnp.asarray(COEFFS[k]) for k in ("learning_rate", "momentum", "damping")))
    return p, gathers(lowered.compile().as_text())


def optax_preconditioner(loss: Callable, params: Any, batch: Any, n: int, on: bool) -> tuple[Any, list[str]]:
    pre = curvax.OptaxPreconditioner(
        loss, damping=0.1, inverse_update_period=2, pmap_axis_name=AXIS, estimation_mode="fisher_exact",
        distributed_inverses=on, distributed_precon_apply=on,
    )

    def step(p: Any, state: Any, b: Any, key: jax.Array) -> tuple[Any, Any]:
        state = pre.maybe_update(state, (p, b), key)
        g = jax.lax.pmean(jax.grad(loss)(p, b), AXIS)
        new = pre.apply(g, state)
        return jax.tree_util.tree_map(lambda x, u: x - 0.1 * u, p, new), pre.increment_count(state)

    pstep = jax.pmap(step, axis_name=AXIS)
    state = jax.pmap(lambda p, b, k: pre.init((p, b), k), axis_name=AXIS)(
        replicate(params, n), split_batch(batch, n), jax.random.split(jax.random.PRNGKey(1), n))
    p, b = replicate(params, n), split_batch(batch, n)
    for i in range(STEPS):
        p, state = pstep(p, state, b, jax.random.split(jax.random.PRNGKey(2 + i), n))
    hlo = pstep.lower(p, state, b, jax.random.split(jax.random.PRNGKey(0), n)).compile().as_text()
    return jax.tree_util.tree_map(lambda x: x[0], p), gathers(hlo)


def kfac_preconditioner(loss: Callable, params: Any, batch: Any, mesh: Mesh, on: bool) -> tuple[Any, list[str]]:
    b = jax.device_put(batch, NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
    tx = optax.chain(
        curvax.kfac_preconditioner(loss, b, 0.1, inverse_update_period=2, estimation_mode="fisher_exact",
                                   mesh=mesh if on else None),
        optax.sgd(0.1),
    )

    @jax.jit
    def step(p: Any, s: Any) -> tuple[Any, Any]:
        updates, s = tx.update(jax.grad(loss)(p, b), s, p, batch=b)
        return optax.apply_updates(p, updates), s

    p = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    s = tx.init(p)
    for _ in range(STEPS):
        p, s = step(p, s)
    return p, gathers(step.lower(p, s).compile().as_text())


def ferminet_alpha(loss: Callable, params: Any, batch: Any, n: int, on: bool) -> tuple[Any, list[str]]:
    from curvax.kfac_ferminet_alpha import optimizer as alpha

    opt = alpha.Optimizer(
        jax.value_and_grad(loss), l2_reg=1e-3, value_func_has_aux=False, value_func_has_state=False,
        value_func_has_rng=False, learning_rate_schedule=lambda t: 0.1, momentum_schedule=lambda t: 0.5,
        damping_schedule=lambda t: 0.1, norm_constraint=None, num_burnin_steps=0, estimation_mode="fisher_exact",
        inverse_update_period=2, multi_device=True, pmap_axis_name=AXIS,
    )
    # The alpha's own Optimizer takes no distribution flags; it hands kfac-jax's defaults (on) to curvax.
    default = opt._inner._program.distribute
    opt._inner._program.distribute = (on, on)
    p, b = replicate(params, n), split_batch(batch, n)
    state = opt.init(p, jax.random.split(jax.random.PRNGKey(1), n), b)
    for i in range(STEPS):
        p, state, _ = opt.step(p, state, jax.random.split(jax.random.PRNGKey(2 + i), n), itertools.repeat(b))
    ALPHA_DEFAULT.append(list(default))
    return jax.tree_util.tree_map(lambda x: x[0], p), []


def main() -> None:
    jax.config.update("jax_enable_x64", True)
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    loss, params, batch = model(MODELS["five"])
    out: dict[str, Any] = {"devices": n, "entries": {}}
    runs = {
        "optimizer/pmap": lambda on: optimizer_pmap(loss, params, batch, n, on),
        "optimizer/mesh": lambda on: optimizer_mesh(loss, params, batch, mesh, on),
        "optax_preconditioner/pmap": lambda on: optax_preconditioner(loss, params, batch, n, on),
        "kfac_preconditioner/mesh": lambda on: kfac_preconditioner(loss, params, batch, mesh, on),
        "ferminet_alpha/pmap": lambda on: ferminet_alpha(loss, params, batch, n, on),
    }
    for name, run in runs.items():
        (p_on, g_on), (p_off, g_off) = run(True), run(False)
        out["entries"][name] = {
            "max_param_diff": max_diff(p_on, p_off),
            "moved": max_diff(p_on, params),
            "finite": bool(all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(p_on))),
            "gathers_on": g_on,
            "gathers_off": g_off,
        }
    out["ferminet_alpha_default"] = ALPHA_DEFAULT[0]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
