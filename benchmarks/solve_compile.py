"""Benchmark: what the optimizer's fallbacks for its factor solves cost in compile time.

A step that solves with every damped Kronecker factor (``inverse_update_period=1``, as FermiNet
and DeepQMC run) used ``curvax.linalg.psd_solve`` per solve: a Cholesky solve, a float64 retry
and a Jacobi fallback, each under its own ``lax.cond``. It now solves by plain Cholesky
(``linalg.cholesky_solve``), and ``curvax.step.precondition`` redoes the whole product once in
float64 when it comes out non-finite. This script compiles the three forms of the same
solves (the shapes of FermiNet's small H2 network in ``clients.py``: ten solves), ``--rounds``
times each, the forms alternating, and writes the instruction counts after XLA's optimizations
and the median compile times with the load average::

    PYTHONPATH=. python benchmarks/solve_compile.py

Results go to ``benchmarks/results/solve_compile.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from curvax import linalg

# (factor side, right-hand sides) of the ten solves of FermiNet's small network's step.
SHAPES = [(5, 4), (33, 16), (57, 16), (16, 4), (16, 4), (4, 4), (16, 16), (33, 33), (57, 57), (5, 5)]


def per_solve(ms: list, bs: list) -> list:
    """Before: each solve with its own float64 retry and Jacobi fallback."""
    return [linalg.psd_solve(m, b) for m, b in zip(ms, bs)]


def plain(ms: list, bs: list) -> list:
    """No fallback at all (the lower bound)."""
    return [linalg.cholesky_solve(m, b) for m, b in zip(ms, bs)]


def whole_product_retry(ms: list, bs: list) -> list:
    """Now: plain solves, and one float64 branch for all of them when any result is not finite."""
    out = plain(ms, bs)
    failed = linalg.sum_is_finite(*bs) & ~linalg.sum_is_finite(*out)

    def in_float64(_: Any) -> list:
        with jax.enable_x64(True):
            wide = plain([m.astype(jnp.float64) for m in ms], [b.astype(jnp.float64) for b in bs])
        return [w.astype(o.dtype) for w, o in zip(wide, out)]

    return lax.cond(failed, in_float64, lambda _: out, None)


FORMS: dict[str, Callable] = {"per_solve_fallbacks": per_solve, "plain": plain, "whole_product_retry": whole_product_retry}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "solve_compile.json")
    args = p.parse_args(argv)
    ms = [2.0 * jnp.eye(n, dtype=jnp.float32) for n, _ in SHAPES]
    bs = [jnp.ones((n, k), jnp.float32) for n, k in SHAPES]
    times: dict[str, list[float]] = {k: [] for k in FORMS}
    instructions: dict[str, int] = {}
    load_before = list(os.getloadavg())
    for r in range(args.rounds):
        for name, form in FORMS.items():
            fn = jax.jit(lambda m, b, form=form: form(m, b))  # a new function each round: no cache hit
            t = time.perf_counter()
            compiled = fn.lower(ms, bs).compile()
            times[name].append(time.perf_counter() - t)
            instructions[name] = sum(1 for line in compiled.as_text().splitlines() if " = " in line)
    medians = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "what": __doc__.split("\n")[0], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "jax_version": jax.__version__, "python": sys.version.split()[0], "solves": len(SHAPES), "shapes": SHAPES,
        "rounds": args.rounds, "instructions_after_optimizations": instructions, "compile_s": times,
        "compile_median_s": medians,
        "ratio_to_plain": {k: medians[k] / medians["plain"] for k in medians},
        "machine": {"cpu_count": os.cpu_count(), "load_average_before": load_before, "load_average_after": list(os.getloadavg())},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    for k in FORMS:
        print(f"{k:22s} {instructions[k]:6d} instructions, compile median {medians[k]:.3f} s")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
