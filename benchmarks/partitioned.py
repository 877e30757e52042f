"""Benchmark: a wide dense layer's K-FAC block with its output factor whole or partitioned.

For each layer (``d_in -> d_out``, float32, a batch of random inputs and output gradients), the
plain ``DenseTwoKroneckerFactored`` block and ``DensePartitionedKroneckerFactored`` with the
output factor in blocks of at most ``--block`` (and, for the language-model head, under the
default 256 MiB budget) are compared on:

* ``state_inverse_mib`` / ``state_eigh_mib``: the block state's bytes (factors and, in the cache,
  their inverses / their eigenvectors and eigenvalues);
* ``stats_s``: one statistics update (jitted, compiled first; median of ``--repeats``);
* ``refresh_inverse_s``: ``update_cache`` of the approximate inverse (Cholesky per block, the
  optimizer's default refresh);
* ``refresh_eigh_s``: ``update_cache`` of the eigendecompositions (``use_exact_inverses=True``).

The plain block of the 768 -> 50257 head is not run: its output factor alone is 9.4 GiB and its
eigendecomposition would take hours on this machine; its state size is computed from the shapes.
Variants are timed in turns, so that a shared machine's load hits them alike; the machine's
load average is recorded. Writes ``benchmarks/results/partitioned.json`` (``--output``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import curvax
from curvax import blocks, tags
from curvax.partitioned import DensePartitionedKroneckerFactored

sys.path.insert(0, str(Path(__file__).parent))
from autoencoder import machine_info, write_results  # noqa: E402


def _eqn(d_in: int, d_out: int, rows: int) -> tags.LayerTagEqn:
    f32 = jnp.float32
    return tags.LayerTagEqn(
        primitive=tags.dense, outputs=(jax.ShapeDtypeStruct((rows, d_out), f32),),
        inputs=(jax.ShapeDtypeStruct((rows, d_in), f32),),
        params=(jax.ShapeDtypeStruct((d_in, d_out), f32), jax.ShapeDtypeStruct((d_out,), f32)),
        param_indices=(0, 1), meta={"kernel_layout": "io"}, name="layer",
    )


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def _timer(f: Callable[..., Any], *args: Any) -> Callable[[], float]:
    compiled = f.lower(*args).compile()  # ahead of time: no untimed run of the (slow) program

    def run() -> float:
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        return time.perf_counter() - t

    return run


def measure(name: str, d_in: int, d_out: int, variants: dict[str, Any], rows: int, repeats: int) -> dict[str, Any]:
    eqn = _eqn(d_in, d_out, rows)
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    data = {"inputs": (jax.random.normal(k[0], (rows, d_in)),), "outputs_tangent": (jax.random.normal(k[1], (rows, d_out)) / rows,)}
    out: dict[str, Any] = {"d_in": d_in, "d_out": d_out, "rows": rows, "variants": {}}
    timers: dict[str, dict[str, Callable[[], float]]] = {}
    for label, ctor in variants.items():
        block = blocks.construct_block(ctor, eqn, name)
        # One state per refresh kind (a cache with eigenvectors would make every refresh redo them);
        # the data and the states are arguments, never constants XLA could fold at compile time.
        update = jax.jit(lambda s, d, block=block: block.update_curvature_matrix_estimate(s, d, 0.0, 1.0, rows))
        s_inv = jax.block_until_ready(update(block.init(jax.random.PRNGKey(1), None, -1, False), data))
        s_eig = jax.block_until_ready(update(block.init(jax.random.PRNGKey(1), [-1], None, False), data))
        inverse = jax.jit(lambda s, block=block: block.update_cache(s, 1e-3, None, -1, False))
        eigh = jax.jit(lambda s, block=block: block.update_cache(s, 1e-3, [-1], None, False))
        timers[label] = {"stats_s": _timer(update, s_inv, data), "refresh_inverse_s": _timer(inverse, s_inv), "refresh_eigh_s": _timer(eigh, s_eig)}
        note = getattr(block, "budget_note", None)
        out["variants"][label] = {
            "block": type(block).__name__, "note": note,
            "state_inverse_mib": _nbytes(s_inv) / 2**20, "state_eigh_mib": _nbytes(s_eig) / 2**20,  # factors + their cache
        }
    samples: dict[str, dict[str, list[float]]] = {label: {m: [] for m in t} for label, t in timers.items()}
    for _ in range(repeats):  # in turns
        for label, t in timers.items():
            for metric, run in t.items():
                samples[label][metric].append(run())
    for label, per in samples.items():
        for metric, values in per.items():
            out["variants"][label][metric] = statistics.median(values)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small layers only (a smoke run)")
    parser.add_argument("--no-head", action="store_true", help="skip the 768 -> 50257 head (minutes on a loaded CPU)")
    parser.add_argument("--output", default="benchmarks/results/partitioned.json")
    args = parser.parse_args(argv)
    part = functools.partial(DensePartitionedKroneckerFactored, outputs_block_size=args.block)
    layers = [("wide", 256, 512 if args.quick else 4096, {"plain": blocks.DenseTwoKroneckerFactored, f"blocks<={args.block}": part})]
    if not (args.quick or args.no_head):
        layers.append(("lm_head", 768, 50257, {"budget 256 MiB": DensePartitionedKroneckerFactored}))
    out: dict[str, Any] = {"machine_before": machine_info(), "layers": {}}
    for name, d_in, d_out, variants in layers:
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        out["layers"][name] = measure(name, d_in, d_out, variants, args.rows, 1 if name == "lm_head" else args.repeats)
        print(out["layers"][name], file=sys.stderr, flush=True)
    head = out["layers"].get("lm_head")
    if head is not None:  # the plain block's state from the shapes: A and G, and their inverses or eigenvectors
        whole = 4 * (769**2 + 50257**2) / 2**20
        head["variants"]["plain (not run)"] = {"block": "DenseTwoKroneckerFactored", "state_inverse_mib": 2 * whole, "state_eigh_mib": 2 * whole}
    out["machine_after"] = machine_info()
    summary = {name: {k: {m: v[m] for m in v if m.endswith("_s") or m.endswith("_mib")} for k, v in layer["variants"].items()}
               for name, layer in out["layers"].items()}
    write_results(args.output, out, summary)


if __name__ == "__main__":
    main()
