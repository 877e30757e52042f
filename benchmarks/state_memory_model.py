"""Benchmark: the curvature state's bytes per parameter for each block type (the memory model).

For one bias-free dense layer ``d_in x d_out`` (several shapes), builds ``curvax.Optimizer`` with
each block type and reads the shapes of its state with ``jax.eval_shape`` (nothing is allocated,
so GPT-2's 768 x 50257 head costs nothing here). Reports the curvature state's bytes per
parameter (statistics and cache; the optimizer's velocities, one parameter-sized buffer, come on
top) next to the closed form the devices guide states, and fails if they differ. ``s`` is the
curvature dtype's item size (float32 by default, also under bfloat16 parameters).

Writes JSON (``--output``, default ``benchmarks/results/state_memory_model.json``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

import curvax

sys.path.insert(0, str(Path(__file__).parent))
from autoencoder import machine_info, write_results  # noqa: E402

SHAPES = [(64, 64), (1024, 1024), (768, 3072), (3072, 768), (768, 50257)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="benchmarks/results/state_memory_model.json")
    return p.parse_args(argv)


def kron(i: int, o: int, s: int) -> float:
    """Two factors and their two cached inverses."""
    return 2 * s * (i * i + o * o) / (i * o)


# name -> (block constructor, Optimizer options, closed form in bytes per parameter or None, largest n = d_in d_out)
BLOCKS: dict[str, tuple[Any, dict[str, Any], Callable[[int, int, int], float] | None, int]] = {
    # factor_budget=None: the plain Kronecker block even where a factor is over the budget.
    "kronecker (Cholesky inverses, default)": (curvax.DenseTwoKroneckerFactored, {"factor_budget": None}, kron, 10**9),
    "kronecker (eigendecompositions, use_exact_inverses)": (
        curvax.DenseTwoKroneckerFactored, {"use_exact_inverses": True, "factor_budget": None},
        lambda i, o, s: kron(i, o, s) + s * (i + o) / (i * o), 10**9),
    "ekfac": (curvax.DenseEigenvalueCorrected, {}, lambda i, o, s: kron(i, o, s) + s, 10**9),
    "tnt": (curvax.DenseTNT, {}, kron, 10**9),
    "diagonal": (curvax.DenseDiagonal, {}, lambda i, o, s: 2 * s, 10**9),
    "full": (curvax.DenseFull, {}, lambda i, o, s: 2 * s * i * o, 64 * 64),
    # The default: Kronecker under the factor budget, else the partitioned block (its own row).
    "default (factor_budget 256 MiB)": (None, {}, None, 10**9),
}


def state_bytes(d_in: int, d_out: int, ctor: Any, options: dict[str, Any], param_dtype: Any) -> tuple[int, Any]:
    def loss(p: Any, batch: Any) -> jax.Array:
        x, y = batch
        out = (x @ p["w"]).astype(jnp.float32)
        curvax.register_squared_error_loss(out, y)
        return jnp.mean((out - y) ** 2)

    params = {"w": jax.ShapeDtypeStruct((d_in, d_out), param_dtype)}
    batch = (jax.ShapeDtypeStruct((4, d_in), param_dtype), jax.ShapeDtypeStruct((4, d_out), jnp.float32))
    extra = {} if ctor is None else {"layer_tag_to_block_ctor": {"dense": ctor}}
    opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=0.0, **extra, **options)
    state = jax.eval_shape(lambda p, b: opt.init(p, jax.random.PRNGKey(0), b), params, batch)
    leaves = jax.tree_util.tree_leaves(state.estimator_state)
    kinds = sorted({type(b).__name__ for b in opt.estimator.blocks}) if hasattr(opt, "estimator") else None
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves), kinds


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for param_dtype in (jnp.float32, jnp.bfloat16):
        for d_in, d_out in SHAPES:
            for name, (ctor, options, formula, largest) in BLOCKS.items():
                if d_in * d_out > largest or (param_dtype == jnp.bfloat16 and d_out > 4096):
                    continue
                total, kinds = state_bytes(d_in, d_out, ctor, options, param_dtype)
                per_param = total / (d_in * d_out)
                expected = formula(d_in, d_out, 4) if formula is not None else None
                if expected is not None and not math.isclose(per_param, expected, rel_tol=1e-3, abs_tol=1e-3):
                    raise SystemExit(f"{name} {d_in}x{d_out}: measured {per_param} B/parameter, the closed form says {expected}")
                rows.append({
                    "block": name, "blocks_built": kinds, "d_in": d_in, "d_out": d_out,
                    "param_dtype": jnp.dtype(param_dtype).name, "curvature_state_bytes": total,
                    "bytes_per_parameter": round(per_param, 4),
                    "closed_form_bytes_per_parameter": None if expected is None else round(expected, 4),
                })
                print(rows[-1], flush=True)
    out = {"benchmark": "state_memory_model", "description": __doc__.split("\n")[0], "machine": machine_info(), "rows": rows}
    write_results(args.output, out, {"rows": len(rows)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
