"""Benchmark: what one optimizer step communicates on several devices (issue 21, devices guide).

Compiles ``curvax.Optimizer``'s step for ``--devices`` CPU devices (set before JAX starts) on an
MLP of ``--layers`` bias-free dense layers ``--width`` wide with a softmax head, and reads every
collective out of the compiled HLO (``curvax.distributed.hlo_collectives``): its op, shapes and
result bytes per device. Each collective is marked ``in_conditional`` when it sits inside a
conditional's branch: the periodic inverse refresh is a ``lax.cond`` (so is the adaptive
damping's periodic update), and the split curvature work is a ``lax.switch`` on the device
index; the others run on every step.

Configurations: data parallel through ``jax.sharding`` (replicated parameters, batch split), the
split of the curvature work (``distributed_inverses``/``distributed_precon_apply``) off and on,
fixed and adaptive coefficients; FSDP-sharded parameters with the curvature state sharded; and
kfac-jax's pmap mode. Nothing is timed: the figures are exact properties of the programs.

Writes JSON (``--output``, default ``benchmarks/results/step_collectives.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

if __name__ == "__main__":  # the device count is fixed when JAX starts
    harness.force_cpu_devices(sys.argv)

from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import curvax  # noqa: E402
from curvax import distributed  # noqa: E402
from autoencoder import machine_info, write_results  # noqa: E402

AXIS = "kfac_axis"
CLASSES = 16


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_devices_argument(p)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--output", default="benchmarks/results/step_collectives.json")
    return p.parse_args(argv)


def mlp(layers: int, width: int, batch: int) -> tuple[Any, Any, Any]:
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 3)
    params = {f"w{i}": jax.random.normal(keys[i], (width, width)) / np.sqrt(width) for i in range(layers)}
    params["head"] = jax.random.normal(keys[layers], (width, CLASSES)) / np.sqrt(width)
    x = jax.random.normal(keys[-2], (batch, width))
    y = jax.random.randint(keys[-1], (batch,), 0, CLASSES)

    def loss(p: Any, data: Any) -> jax.Array:
        h, labels = data
        for i in range(layers):
            h = jnp.tanh(h @ p[f"w{i}"])
        logits = h @ p["head"]
        curvax.register_softmax_cross_entropy_loss(logits, labels)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    return loss, params, (x, y)


def collectives_by_place(text: str) -> list[dict[str, Any]]:
    """``hlo_collectives`` of each computation, each marked ``in_conditional`` when the computation is
    reachable from a conditional's branch."""
    computations = distributed.hlo_computations(text)
    in_branch = distributed.hlo_reachable(computations, [b for bs in distributed.hlo_conditionals(computations) for b in bs])
    out = []
    for name, lines in computations.items():
        for c in distributed.hlo_collectives("\n".join(lines)):
            out.append(dict(c, in_conditional=name in in_branch))
    return out


def summary(colls: list[dict[str, Any]]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for c in colls:
        key = f"{c['op']}/{'in_conditional' if c['in_conditional'] else 'every_step'}"
        entry = s.setdefault(key, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += c["bytes"]
    return s


def compiled_text(opt: curvax.Optimizer, params: Any, state: Any, key: Any, batch: Any, coeffs: list[Any]) -> str:
    return opt._jit_step.lower(params, state, key, batch, None, *coeffs).compile().as_text()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    n = harness.check_device_count(args.devices)
    loss, params, data = mlp(args.layers, args.width, args.batch)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    fixed = dict(learning_rate=0.1, momentum=0.5, damping=1e-2)
    adaptive = dict(use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1.0)
    configs: dict[str, tuple[str, dict[str, Any], bool]] = {
        "sharding/data_parallel/fixed/split_off": ("replicated", dict(distributed_inverses=False, distributed_precon_apply=False), True),
        "sharding/data_parallel/fixed/split_on": ("replicated", {}, True),
        "sharding/data_parallel/adaptive/split_on": ("replicated", adaptive, False),
        "sharding/fsdp_sharded_state/fixed/split_on": ("fsdp", {}, True),
        "pmap/fixed/split_off": ("pmap", dict(distributed_inverses=False, distributed_precon_apply=False), True),
        "pmap/fixed/split_on": ("pmap", {}, True),
    }
    results: dict[str, Any] = {}
    for name, (placement, kwargs, is_fixed) in configs.items():
        opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=0.0, num_burnin_steps=0, inverse_update_period=5,
                               multi_device=placement == "pmap", pmap_axis_name=AXIS, **kwargs)
        if placement == "pmap":
            rep = curvax.utils.replicate_all_local_devices
            p = rep(params)
            batch = jax.tree_util.tree_map(lambda a: a.reshape((n, -1) + a.shape[1:]), data)
            state = opt.init(p, rep(jax.random.PRNGKey(1)), batch)
            key = jax.random.split(jax.random.PRNGKey(2), n)
            coeffs = [rep(jnp.asarray(fixed[k], jnp.float32)) if is_fixed else None for k in ("learning_rate", "momentum", "damping")]
        else:
            spec = P("data", None) if placement == "fsdp" else P()
            p = jax.device_put(params, NamedSharding(mesh, spec))
            batch = jax.device_put(data, NamedSharding(mesh, P("data")))
            state = opt.init(p, jax.random.PRNGKey(1), batch)
            key = jax.random.PRNGKey(2)
            coeffs = [jnp.asarray(fixed[k], jnp.float32) if is_fixed else None for k in ("learning_rate", "momentum", "damping")]
        colls = collectives_by_place(compiled_text(opt, p, state, key, batch, coeffs))
        results[name] = {"summary": summary(colls), "collectives": colls}
        print(name, results[name]["summary"], flush=True)
    param_bytes = sum(int(np.prod(x.shape)) * 4 for x in jax.tree_util.tree_leaves(params))
    out = {
        "benchmark": "step_collectives",
        "description": __doc__.split("\n")[0],
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "model": {"parameter_bytes": param_bytes, "factor_sides": [args.width] * (args.layers + 1) + [CLASSES]},
        "configs": results,
    }
    write_results(args.output, out, {k: v["summary"] for k, v in results.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
