"""Benchmark: distributed curvature work on several devices (issue 20, ``curvax.distributed``).

An MLP of ``--layers`` equal dense layers ``--width`` wide (8 x 512: eight Kronecker blocks with
factors of sides 513 and 512), float32, on ``--devices`` CPU devices
(``--xla_force_host_platform_device_count``, set before JAX starts). Two sections:

* ``estimator``: a ``BlockDiagonalCurvature`` with real statistics. ``refresh`` is a refresh
  step's curvature work (``update_cache`` then the cached preconditioning product), ``apply`` an
  ordinary step's (the product alone), for the approximate inverses (Cholesky; the optimizer's
  default) and the exact ones (eigendecompositions). Each on one device, and on all devices in
  pmap mode and through ``jax.sharding`` (jit on a mesh), with ``distribution`` off (every
  device does all the work, today's optimizer) and on. Compiled once each, then timed
  interleaved. From the compiled HLO: the collectives (and their bytes) and, per device branch,
  the decompositions each device runs. The results of "on" are compared with "off".
* ``optimizer``: ``curvax.Optimizer`` steps (pmap mode, and sharding), ordinary and refresh
  steps, with ``distributed_inverses``/``distributed_precon_apply`` off and on (the default).

CPU devices of one process share its cores, so the gain measured here is the work removed (each
device decomposes 1/N of the blocks instead of all of them), not parallel hardware. The machine
may be loaded: ``os.getloadavg()`` is recorded before and after each section.

Writes JSON (``--output``, default ``benchmarks/results/distributed.json``). ``--quick``: a smoke
run (width 64, few repeats).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import harness  # noqa: E402

if __name__ == "__main__":  # the device count is fixed when JAX starts
    harness.force_cpu_devices(sys.argv)

import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import curvax  # noqa: E402
from curvax import distributed  # noqa: E402
from autoencoder import machine_info, write_results  # noqa: E402

AXIS = "kfac_axis"
DAMPING = 1e-2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_devices_argument(p)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=512, help="global batch (split over the devices)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=11, help="optimizer steps per variant after the first")
    p.add_argument("--period", type=int, default=5, help="the optimizer's inverse_update_period")
    p.add_argument("--skip-optimizer", action="store_true")
    p.add_argument("--skip-estimator", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--output", default=str(Path(__file__).parent / "results" / "distributed.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.repeats, args.steps, args.batch = 64, 2, 6, 64
    return args


def mlp(layers: int, width: int, batch: int, lib: Any = curvax) -> tuple[Callable, Any, Any]:
    """``layers`` tanh dense layers ``width`` wide and a squared-error loss registered with ``lib``
    (curvax or kfac_jax); parameters and a batch."""
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 2)
    params = [{"w": jax.random.normal(k, (width, width)) / np.sqrt(width), "b": jnp.zeros(width)} for k in keys[:layers]]

    def loss(p: Any, data: Any) -> jax.Array:
        h, y = data
        for i, layer in enumerate(p):
            h = h @ layer["w"] + layer["b"]
            h = jnp.tanh(h) if i < len(p) - 1 else h
        lib.register_squared_error_loss(h, y)
        return 0.5 * jnp.mean(jnp.sum((h - y) ** 2, axis=-1))

    data = (jax.random.normal(keys[-2], (batch, width)), jax.random.normal(keys[-1], (batch, width)))
    return loss, params, data


def max_rel_diff(a: Any, b: Any) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))) / (np.max(np.abs(np.asarray(y, np.float64))) or 1.0))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def hlo_summary(text: str, n: int) -> dict[str, Any]:
    """The collectives of a compiled program, and per device branch its eigh and Cholesky calls."""
    branches = lambda target: [b for b in distributed.hlo_branch_custom_calls(text, target) if len(b) == n and sum(b)]
    ops = distributed.hlo_collectives(text)
    return {"collectives": ops, "collective_bytes": sum(o["bytes"] for o in ops),
            "eigh_per_device_branch": branches("syevd"), "cholesky_per_device_branch": branches("potrf"),
            "eigh_in_program": text.count("syevd"), "cholesky_in_program": text.count('potrf')}


def estimator_section(args: argparse.Namespace, n: int) -> dict[str, Any]:
    loss, params, data = mlp(args.layers, args.width, args.batch)
    est = curvax.BlockDiagonalCurvature(loss)
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    rep_mesh = lambda t: jax.device_put(t, NamedSharding(mesh, PartitionSpec()))
    rep_pmap = curvax.utils.replicate_all_local_devices
    one = lambda t: jax.device_put(t, jax.devices()[0])
    grad = jax.jit(jax.grad(loss))(params, data)
    out: dict[str, Any] = {"blocks": [type(b).__name__ for b in est.blocks] if est.blocks else None}
    for inverses in ("approx", "exact"):
        powers = dict(exact_powers_to_cache=-1) if inverses == "exact" else dict(approx_powers_to_cache=-1)
        exact = inverses == "exact"
        state = est.init(jax.random.PRNGKey(1), (params, data), **powers)
        statistics = lambda s, p, d: est.update_curvature_matrix_estimate(s, 0.0, 1.0, args.batch, jax.random.PRNGKey(2), (p, d))
        state = jax.jit(statistics)(state, params, data)  # arguments, not constants (XLA would fold them)
        out["blocks"] = [f"{type(b).__name__}({b.input_size()}x{b.output_size()})" for b in est.blocks]
        exact_p, approx_p = (-1, None) if exact else (None, -1)

        def refresh(dist: Any) -> Callable:
            kw = {} if dist is None else {"distribution": dist}

            def f(s: Any, g: Any) -> Any:
                s = est.update_cache(s, DAMPING, exact_p, approx_p, False, **kw)
                return s, est.multiply_matpower(s, g, DAMPING, -1, exact, True, **kw)

            return f

        def apply(dist: Any) -> Callable:
            kw = {} if dist is None else {"distribution": dist}
            return lambda s, g: est.multiply_matpower(s, g, DAMPING, -1, exact, True, **kw)

        cached = jax.jit(refresh(None))(state, grad)[0]  # a state with caches, for `apply`
        pmap_on = distributed.Distribution(axis_name=AXIS)
        mesh_on = distributed.Distribution(mesh=mesh)
        variants = {  # name -> (compile wrapper, distribution, placement)
            "one_device": (jax.jit, None, one),
            "pmap_off": (lambda f: jax.pmap(f, axis_name=AXIS), None, rep_pmap),
            "pmap_on": (lambda f: jax.pmap(f, axis_name=AXIS), pmap_on, rep_pmap),
            "sharding_off": (jax.jit, None, rep_mesh),
            "sharding_on": (jax.jit, mesh_on, rep_mesh),
        }
        section: dict[str, Any] = {"load_average_before": os.getloadavg()}
        for work_name, work, st in (("refresh", refresh, state), ("apply", apply, cached)):
            thunks, results, info = {}, {}, {}
            for name, (wrap, dist, place) in variants.items():
                args_ = (place(st), place(grad))
                t = time.perf_counter()
                compiled = wrap(work(dist)).lower(*args_).compile()
                info[name] = {"compile_s": time.perf_counter() - t, **hlo_summary(compiled.as_text(), n)}
                results[name] = compiled(*args_)
                thunks[name] = lambda c=compiled, a=args_: c(*a)
            timings = harness.interleave_thunks(thunks, args.repeats, keep_all=True)
            first = lambda r, name: jax.tree_util.tree_map(lambda x: x[0], r) if name.startswith("pmap") else r
            for name in variants:
                info[name].update(timings[name])
                info[name]["max_rel_diff_vs_one_device"] = max_rel_diff(first(results[name], name), results["one_device"])
            for mode in ("pmap", "sharding"):
                info[f"{mode}_speedup_on_vs_off"] = info[f"{mode}_off"]["median_s"] / info[f"{mode}_on"]["median_s"]
                info[f"{mode}_collectives_added"] = info[f"{mode}_on"]["collectives"]
            section[work_name] = info
        section["load_average_after"] = os.getloadavg()
        out[inverses] = section
    return out


def libraries() -> dict[str, Any]:
    """curvax, and kfac-jax where this interpreter has it (kfac-jax 0.0.8 needs JAX 0.9.0)."""
    libs: dict[str, Any] = {"curvax": curvax}
    try:
        import kfac_jax

        libs["kfac_jax"] = kfac_jax
    except ImportError:
        pass
    return libs


def optimizer_section(args: argparse.Namespace, n: int) -> dict[str, Any]:
    """Optimizer steps with the split off and on, per library and mode, all variants alternating
    step by step (a busy machine's drift hits them alike). kfac-jax runs in pmap mode only (its
    sharding path is not what its users run)."""
    fixed = dict(learning_rate=1e-3, momentum=0.5, damping=DAMPING)
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    out: dict[str, Any] = {"load_average_before": os.getloadavg(), "period": args.period}
    runs: dict[str, Any] = {}
    for lib_name, lib in libraries().items():
        loss, params, data = mlp(args.layers, args.width, args.batch, lib)
        for mode in ("pmap", "sharding") if lib_name == "curvax" else ("pmap",):
            for variant in ("off", "on"):
                split = variant == "on"
                opt = lib.Optimizer(value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0,
                                    inverse_update_period=args.period, num_burnin_steps=0,
                                    multi_device=mode == "pmap", pmap_axis_name=AXIS,
                                    distributed_inverses=split, distributed_precon_apply=split)
                if mode == "pmap":
                    rep = curvax.utils.replicate_all_local_devices
                    p = rep(params)
                    batch = jax.tree_util.tree_map(lambda a: a.reshape((n, -1) + a.shape[1:]), data)
                    kwargs = {k: rep(jnp.asarray(v, jnp.float32)) for k, v in fixed.items()}
                    state = opt.init(p, rep(jax.random.PRNGKey(1)), batch)
                    key = lambda i: jax.random.split(jax.random.PRNGKey(i), n)
                else:
                    p = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
                    batch = jax.device_put(data, NamedSharding(mesh, PartitionSpec("data")))
                    kwargs = dict(fixed)
                    state = opt.init(p, jax.random.PRNGKey(1), batch)
                    key = jax.random.PRNGKey
                runs[f"{lib_name}/{mode}/{variant}"] = {"opt": opt, "params": p, "state": state, "batch": batch,
                                                        "kwargs": kwargs, "key": key, "times": [], "losses": []}
    names = list(runs)
    for i in range(args.steps + 1):  # step 0 compiles (and refreshes); the order rotates every step
        for name in names[i % len(names):] + names[:i % len(names)]:
            r = runs[name]
            t = time.perf_counter()
            r["params"], r["state"], stats = r["opt"].step(r["params"], r["state"], r["key"](i), batch=r["batch"],
                                                           global_step_int=i, **r["kwargs"])
            jax.block_until_ready((r["params"], r["state"]))
            r["times"].append(time.perf_counter() - t)
            r["losses"].append(float(np.mean(np.asarray(stats["loss"]))))
    for name, r in runs.items():
        ordinary = [t for i, t in enumerate(r["times"]) if i and i % args.period]
        refresh = [t for i, t in enumerate(r["times"]) if i and i % args.period == 0]
        out[name] = {
            "first_step_s": r["times"][0], "ordinary_step_median_s": statistics.median(ordinary),
            "refresh_step_median_s": statistics.median(refresh) if refresh else None,
            "ordinary_steps_s": ordinary, "refresh_steps_s": refresh, "losses": r["losses"],
        }
    for prefix in {n.rsplit("/", 1)[0] for n in names}:
        out[f"{prefix}/max_rel_param_diff_on_vs_off"] = max_rel_diff(runs[f"{prefix}/on"]["params"], runs[f"{prefix}/off"]["params"])
    out["load_average_after"] = os.getloadavg()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    n = harness.check_device_count(args.devices)
    out: dict[str, Any] = {
        "benchmark": "distributed",
        "machine": machine_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
    }
    if not args.skip_estimator:
        out["estimator"] = estimator_section(args, n)
    if not args.skip_optimizer:
        out["optimizer"] = optimizer_section(args, n)
    summary: dict[str, Any] = {}
    for inverses in ("approx", "exact") if "estimator" in out else ():
        for work in ("refresh", "apply"):
            s = out["estimator"][inverses][work]
            summary[f"{inverses}/{work}"] = {
                k: round(s[k]["median_s"], 4) for k in ("one_device", "pmap_off", "pmap_on", "sharding_off", "sharding_on")
            } | {"collective_bytes_added": s["pmap_on"]["collective_bytes"]}
    if "optimizer" in out:
        for name, r in out["optimizer"].items():
            if isinstance(r, dict) and "ordinary_step_median_s" in r:
                summary[f"optimizer/{name}"] = {k: r[k] for k in ("first_step_s", "ordinary_step_median_s", "refresh_step_median_s")}
    out["summary"] = summary
    write_results(args.output, out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
