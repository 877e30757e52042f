"""Benchmark: the optimizer state's memory per device, curvature state replicated or sharded.

The model is a transformer-like stack of ``--layers`` residual blocks of dense layers of width
``--width`` (default 20 x 2048, about 1.0e9 parameters), with no biases (as in most recent
transformers) and no attention: each block has four ``d x d`` projections standing for q, k, v
and o, mixed elementwise (``q * sigmoid(k) + v``, so no ``T x T`` attention to compile), and a
``d -> 4d -> d`` GELU MLP; a squared-error loss on the last block's output. That is 12 d^2
parameters and 6 Kronecker blocks per layer (factors of sides d and 4d). The parameters are
FSDP-sharded: every weight split by rows over a one-axis mesh of all devices; the batch of
``--batch`` tokens is split over it too.

Nothing is materialised. ``Optimizer.init`` needs concrete parameters (it checks that they are
finite), so this calls what ``init`` runs on the host, ``StepProgram.prepare`` (tracing, layer
detection, the gradient proof, the state's placement), on ``jax.ShapeDtypeStruct``s with
shardings; the state's shapes come from ``jax.eval_shape`` of the jitted init; and the jitted
step (the function ``Optimizer.step`` calls, fixed learning rate, momentum and damping,
default ``inverse_update_period=5``, approximate inverses) is lowered on those abstract values
and compiled for the CPU devices. Reported per device count and variant:

* ``state_bytes_per_device``: the optimizer state one device stores (each leaf's shard by the
  placement the optimizer chose), and ``curvature_state_bytes_per_device``, its curvature part.
* ``memory_analysis``: XLA's figures of the compiled step per device (arguments: parameters,
  state and batch; outputs; temporaries: the step's working memory, e.g. gathered factors).

The variants: ``replicated`` (``shard_curvature_state=False``: every device stores the whole
curvature state) and ``sharded`` (the default with sharded parameters). Each device count runs
in its own child process (``--xla_force_host_platform_device_count``). The full 20 layers are
compiled by default (2 to 8 minutes per variant on the loaded 2-core machine; 35 to 60 minutes
in all). ``--layers 2,4,6`` compiles smaller stacks instead and extrapolates every figure to
``--target-layers`` (20) by a least-squares line in the layer count
(``fit_max_relative_residual`` says how straight the points lie; the stored state is exactly
linear in it; about 15 minutes in all).

Writes ``benchmarks/results/sharded_state_memory.json`` (``--output``): since the distributed
work exchanges slices of a split state (``curvax.distributed``), the 2/4/6-layer fit. Before
that change (every whole factor gathered onto every device),
``sharded_state_memory_before_exchange.json`` (the full compile) and
``sharded_state_memory_before_exchange_fit.json`` (the fit, within 3% of it). ``--quick``:
width 256, 2 layers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="1,2,4,8", help="comma-separated device counts")
    p.add_argument("--layers", default="20", help="comma-separated layer counts (two or more: a linear fit)")
    p.add_argument("--target-layers", type=int, default=20, help="layer count the fit extrapolates to")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=512, help="tokens per step (split over the devices)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--output", default=str(HERE / "results" / "sharded_state_memory.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.target_layers, args.batch = 256, "1,2", 2, 64
    return args


# --- the child: one device count, every layer count and variant ------------------------------


def model(layers: int, width: int) -> Any:
    """The loss and the parameters' shapes (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    import curvax

    def loss(params: Any, batch: Any) -> Any:
        x, y = batch
        for p in params:
            q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
            x = x + (q * jax.nn.sigmoid(k) + v) @ p["o"]
            x = x + jax.nn.gelu(x @ p["up"]) @ p["down"]
        curvax.register_squared_error_loss(x, y)
        return jnp.mean(jnp.sum((x - y) ** 2, axis=-1))

    d = width
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "up": (d, 4 * d), "down": (4 * d, d)}
    return loss, [shapes] * layers


def measure(devices: int, layers: int, width: int, batch: int, shard: bool, **options: Any) -> dict[str, Any]:
    """Places, lowers and compiles one variant; returns its figures."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import curvax
    from curvax import parallel

    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    rows = NamedSharding(mesh, P("data", None))
    loss, shapes = model(layers, width)
    params = [{k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=rows) for k, s in layer.items()} for layer in shapes]
    data = tuple(jax.ShapeDtypeStruct((batch, width), jnp.float32, sharding=rows) for _ in range(2))
    rng = jax.random.PRNGKey(0)
    opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=1e-5, num_burnin_steps=0, shard_curvature_state=shard,
                           **options)
    program = opt._program
    t0 = time.perf_counter()
    program.prepare(params, rng, data, None)  # what Optimizer.init runs on the host
    state = jax.eval_shape(opt._jit_init, params, rng, data, None)
    placement = program.state_shardings
    if placement is not None:
        state = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                                       jax.tree_util.tree_map(lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub),
                                                              placement, state, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding)))
    coeff = jnp.asarray(0.1, jnp.float32)
    lowered = opt._jit_step.lower(params, state, rng, data, None, coeff, coeff, coeff)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    curvature = parallel.bytes_per_device(state.estimator_state)
    leaves = jax.tree_util.tree_leaves(state.estimator_state)
    return {
        "parameters": int(sum(np.prod(s) for layer in shapes for s in layer.values())),
        "blocks": len(opt.estimator.blocks),
        "state_bytes_per_device": parallel.bytes_per_device(state),
        "curvature_state_bytes_per_device": curvature,
        "curvature_state_bytes_whole": int(sum(np.prod(x.shape) * x.dtype.itemsize for x in leaves)),
        "curvature_leaves_split": sum(not x.sharding.is_fully_replicated for x in leaves if x.sharding is not None),
        "curvature_leaves": len(leaves),
        "memory_analysis": {f: int(getattr(mem, f)) for f in fields} if mem is not None else None,
        "seconds_trace_and_lower": t1 - t0,
        "seconds_compile": t2 - t1,
    }


def child(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    devices = args.child
    assert jax.device_count() == devices, (jax.device_count(), devices)
    out: dict[str, Any] = {}
    for layers in [int(n) for n in args.layers.split(",")]:
        for variant, shard in (("replicated", False), ("sharded", True)):
            load = os.getloadavg()
            r = measure(devices, layers, args.width, args.batch, shard)
            r["load_average_before"], r["load_average_after"] = load, os.getloadavg()
            out[f"{layers}/{variant}"] = r
            print(json.dumps({"devices": devices, "layers": layers, "variant": variant,
                              "curvature_MiB": r["curvature_state_bytes_per_device"] / 2**20,
                              "temp_MiB": (r["memory_analysis"] or {}).get("temp_size_in_bytes", 0) / 2**20,
                              "compile_s": round(r["seconds_compile"], 1)}), file=sys.stderr, flush=True)
    return out


# --- the parent: a child per device count, the table, the fit ---------------------------------


def extrapolate(by_layers: dict[int, dict[str, Any]], target: int) -> dict[str, float]:
    """Each figure at ``target`` layers from a least-squares line through the measured layer counts."""
    counts = sorted(by_layers)
    keys = ["state_bytes_per_device", "curvature_state_bytes_per_device", "parameters"]
    keys += [f"memory_analysis.{k}" for k in (by_layers[counts[0]].get("memory_analysis") or {})]

    def get(r: dict[str, Any], key: str) -> float:
        return float(r["memory_analysis"][key.split(".")[1]]) if key.startswith("memory_analysis.") else float(r[key])

    out: dict[str, Any] = {"fit_max_relative_residual": {}}
    for key in keys:
        values = np.array([get(by_layers[n], key) for n in counts])
        slope, intercept = np.polyfit(counts, values, 1)
        out[key] = float(slope * target + intercept)
        # How straight the measured points lie (0 for two points): the fit's trust.
        residual = np.abs(slope * np.array(counts) + intercept - values) / np.maximum(np.abs(values), 1.0)
        out["fit_max_relative_residual"][key] = float(residual.max())
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    sys.path.insert(0, str(HERE))
    from autoencoder import machine_info, write_results

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    results: dict[str, Any] = {}
    for n in [int(d) for d in args.devices.split(",")]:
        cmd = [sys.executable, __file__, f"--child={n}", f"--layers={args.layers}", f"--width={args.width}",
               f"--batch={args.batch}"]
        load = os.getloadavg()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env={**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"},
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{n} devices: child failed\n{proc.stderr[-4000:]}")
        results[str(n)] = {"runs": json.loads(proc.stdout.strip().splitlines()[-1]), "load_average_before": load,
                           "load_average_after": os.getloadavg(), "seconds": time.perf_counter() - t0}
    layer_counts = sorted(int(n) for n in args.layers.split(","))
    table = {}
    for n, r in results.items():
        for variant in ("replicated", "sharded"):
            by_layers = {m: r["runs"][f"{m}/{variant}"] for m in layer_counts}
            if args.target_layers in by_layers:
                row = by_layers[args.target_layers]
                fig = {"state_bytes_per_device": row["state_bytes_per_device"],
                       "curvature_state_bytes_per_device": row["curvature_state_bytes_per_device"],
                       "parameters": row["parameters"],
                       **{f"memory_analysis.{k}": v for k, v in (row["memory_analysis"] or {}).items()},
                       "extrapolated": False}
            else:
                fig = {**extrapolate(by_layers, args.target_layers), "extrapolated": True}
            if "memory_analysis.temp_size_in_bytes" in fig:  # what the step holds at once: the docs' last column
                fig["step_arguments_outputs_temporaries_gib"] = round(sum(
                    fig[f"memory_analysis.{k}_size_in_bytes"] for k in ("argument", "output", "temp")) / 2**30, 2)
            table[f"{n}/{variant}"] = fig
    gib = lambda b: round(b / 2**30, 3)
    summary = {
        key: {"params_B": round(f["parameters"] / 1e9, 3), "state_GiB": gib(f["state_bytes_per_device"]),
              "curvature_GiB": gib(f["curvature_state_bytes_per_device"]),
              "step_temp_GiB": gib(f.get("memory_analysis.temp_size_in_bytes", float("nan"))),
              "step_args_GiB": gib(f.get("memory_analysis.argument_size_in_bytes", float("nan"))),
              "extrapolated": f["extrapolated"]}
        for key, f in table.items()
    }
    out = {
        "benchmark": "sharded_state_memory",
        "description": __doc__.split("\n\n")[0],
        "model": {"width": args.width, "layers_measured": layer_counts, "target_layers": args.target_layers,
                  "batch_tokens": args.batch, "dtype": "float32",
                  "layer": "4 d x d projections (q, k, v, o; mixed elementwise, no attention) + d -> 4d -> d GELU MLP, no biases"},
        "optimizer": {"inverse_update_period": 5, "use_exact_inverses": False, "fixed_coefficients": True,
                      "parameters": "FSDP: every weight split by rows over the mesh"},
        "machine": machine_info(),
        "table_at_target_layers": table,
        "summary": summary,
        "children": results,
    }
    write_results(args.output, out, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
