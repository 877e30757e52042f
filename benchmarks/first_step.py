"""Benchmark: time to the first step, in fresh processes, with and without a compilation cache.

The first K-FAC step traces the loss, compiles the burn-in and the step, runs
the burn-in and the step; compilation dominates it. JAX's persistent
compilation cache lets a later process load the compiled programs instead.
For each optimizer (Optax Adam, curvax fixed, curvax adaptive; optionally both
with the curvature on a quarter of the batch) this script runs
fresh child processes on the MNIST autoencoder:

* ``no_cache``: no persistent cache (what the autoencoder benchmark measures);
* ``cold``: an empty cache directory (compiles and writes the cache);
* ``warm``: the directory the cold run filled (loads instead of compiling).

Each child reports its import, setup (optimizer build and ``init``), first and
second step times; the parent adds the child's total wall time. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

# The sub-batch variants (curvature on a quarter of the batch) run only when named in --only.
MODES = ("adam", "curvax_fixed", "curvax_adaptive", "curvax_fixed_sub25", "curvax_adaptive_sub25")
DEFAULT_MODES = MODES[:3]
CACHES = ("no_cache", "cold", "warm")
FIGURES = ("import_s", "setup_s", "first_step_s", "second_step_s", "process_s")


def child(mode: str, num_images: int) -> dict[str, float]:
    """Runs in the child: builds one optimizer and times its first two steps."""
    t0 = time.perf_counter()
    import jax

    sys.path.insert(0, str(Path(__file__).parent))
    import autoencoder as bench
    from curvax import datasets

    images = jax.numpy.asarray(datasets.load_mnist_images(num_images))
    jax.block_until_ready(images)
    t1 = time.perf_counter()
    fixed = {"learning_rate": 0.1, "momentum": 0.0, "damping": 3.0}
    if mode == "adam":
        step, carry = bench.adam_runner(images, 1e-3, 0)
    else:
        extra = {"curvature_batch_fraction": bench.FRACTION_VARIANT} if mode.endswith(bench.FRACTION_NAME) else {}
        step, carry = bench.kfac_runner(images, 0, mode.startswith("curvax_adaptive"), fixed, 1.0, **extra)
    t2 = time.perf_counter()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        carry, loss = step(carry)
        jax.block_until_ready((carry, loss))
        times.append(time.perf_counter() - t)
    return {"import_s": t1 - t0, "setup_s": t2 - t1, "first_step_s": times[0], "second_step_s": times[1]}


def run_child(mode: str, num_images: int, cache_dir: str | None) -> dict[str, float]:
    """One fresh process; ``cache_dir`` turns on JAX's persistent cache for every compile."""
    env = dict(os.environ)
    for key in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(key, None)
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--num-images", str(num_images)],
        env=env, capture_output=True, text=True, check=True,
    )
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    figures["process_s"] = time.perf_counter() - t
    return figures


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-images", type=int, default=2000, help="full-batch size (default 2000)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each optimizer and cache state (default 2)")
    p.add_argument("--only", nargs="+", choices=MODES, help="a subset of the optimizers")
    p.add_argument("--output", default="benchmarks/results/first_step.json", help="JSON output path")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.num_images)))
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    import autoencoder as bench

    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    for repeat in range(args.repeats):
        for mode in args.only or DEFAULT_MODES:
            per_cache = runs.setdefault(mode, {c: [] for c in CACHES})
            per_cache["no_cache"].append(run_child(mode, args.num_images, None))
            with tempfile.TemporaryDirectory() as cache_dir:
                per_cache["cold"].append(run_child(mode, args.num_images, cache_dir))
                per_cache["warm"].append(run_child(mode, args.num_images, cache_dir))
            for cache in CACHES:
                r = per_cache[cache][-1]
                print(f"repeat {repeat} {mode:16s} {cache:8s} " + "  ".join(f"{k} {r[k]:6.2f}" for k in FIGURES),
                      flush=True)
    summary = {
        mode: {cache: {k: statistics.median(r[k] for r in rs) for k in FIGURES} for cache, rs in per_cache.items()}
        for mode, per_cache in runs.items()
    }
    out = {"benchmark": "first_step", "machine": bench.machine_info(), "settings": vars(args),
           "summary_median": summary, "runs": runs}
    bench.write_results(args.output, out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
