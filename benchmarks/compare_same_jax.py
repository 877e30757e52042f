"""Benchmark: curvax and kfac-jax K-FAC steps side by side in one process, on the same JAX.

``benchmarks/compare.py`` times kfac-jax in a child process on JAX 0.9.0 (kfac-jax 0.0.8 needs
it) while curvax runs in the parent on the newest JAX, one after the other. Its step medians
therefore mix three things: the library, the JAX version and the machine's load at two
different minutes. This script takes the library alone: in one interpreter that has both
(JAX 0.9.0, kfac-jax 0.0.8 and curvax), each model's two K-FAC optimizers (same settings as
``compare.py``: ``_compare_models.kfac_optimizer``) and an Optax Adam step are built, compiled
and warmed up, then stepped in rounds, one step of each per round in a rotating order, so load
and drift hit them alike. Run it also in an interpreter with only curvax (the newest JAX): the
``curvax / adam`` ratio there against the same ratio on JAX 0.9.0 isolates the JAX version.

Per model it records every step time, the medians, the per-round ratios' median, the load
average before and after, and the losses after the rounds (both libraries must still agree).
Rounds are a multiple of the inverse-refresh period (5), so refresh steps weigh alike.

    /work/venv-kfac/bin/python benchmarks/compare_same_jax.py --output benchmarks/results/compare_same_jax.json
    python benchmarks/compare_same_jax.py --output benchmarks/results/compare_same_jax.json   # appends a curvax-only run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import jax
import optax

sys.path.insert(0, str(Path(__file__).parent))
import _compare_models as models  # noqa: E402
import harness  # noqa: E402
from autoencoder import machine_info  # noqa: E402
from compare import DEFAULTS, kfac_runner, optax_runner  # noqa: E402

import curvax  # noqa: E402


def run_model(name: str, size: int, rounds: int, warmup: int, seed: int, with_kfac_jax: bool) -> dict[str, Any]:
    """Builds, warms up and interleaves the runners of one model; returns its record."""
    runners = {"adam": optax_runner(models.BUILDERS[name](curvax, size, False, seed), optax.adam(3e-3), "plain"),
               "curvax": kfac_runner(curvax, models.BUILDERS[name](curvax, size, False, seed), seed)}
    if with_kfac_jax:
        import kfac_jax

        runners["kfac_jax"] = kfac_runner(kfac_jax, models.BUILDERS[name](kfac_jax, size, False, seed), seed)
    steps = {n: r[0] for n, r in runners.items()}
    carries = {n: r[1] for n, r in runners.items()}
    warm = harness.interleave_steps(steps, carries, warmup)["times"]  # compilation, K-FAC's burn-in, the first refreshes
    timed = harness.interleave_steps(steps, carries, rounds)
    times = timed["times"]
    med = {n: statistics.median(ts) for n, ts in times.items()}
    out: dict[str, Any] = {
        "size": size,
        "rounds": rounds,
        "warmup_steps": warmup,
        "first_step_s": {n: ts[0] for n, ts in warm.items()},
        "load_average_before": timed["load_average_before"],
        "load_average_after": timed["load_average_after"],
        "step_median_s": med,
        "ratio_to_adam_median": {n: med[n] / med["adam"] for n in med},
        "ratio_to_adam_per_round_median": {
            n: statistics.median(a / b for a, b in zip(ts, times["adam"])) for n, ts in times.items()
        },
        "loss_after": timed["losses"],
        "step_times_s": times,
    }
    if with_kfac_jax:
        out["curvax_over_kfac_jax_median"] = med["curvax"] / med["kfac_jax"]
        out["curvax_over_kfac_jax_per_round_median"] = statistics.median(
            a / b for a, b in zip(times["curvax"], times["kfac_jax"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["autoencoder", "transformer", "cnn"], choices=models.MODELS)
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds (a multiple of 5)")
    p.add_argument("--warmup", type=int, default=7, help="steps of each before timing (burn-in, compiles)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON file; a run is appended under its JAX version")
    args = p.parse_args()
    try:
        import kfac_jax  # noqa: F401
        with_kfac_jax = True
    except ImportError:
        with_kfac_jax = False
    record: dict[str, Any] = {"machine": machine_info(), "with_kfac_jax": with_kfac_jax, "models": {}}
    for name in args.models:
        record["models"][name] = r = run_model(name, DEFAULTS[name][0], args.rounds, args.warmup, args.seed,
                                               with_kfac_jax)
        msg = " ".join(f"{n} {1e3 * v:.1f}ms" for n, v in r["step_median_s"].items())
        print(f"{name}: {msg}; curvax/kfac-jax {r.get('curvax_over_kfac_jax_per_round_median', 'n/a')}", flush=True)
    if args.output:
        path = Path(args.output)
        data = json.loads(path.read_text()) if path.exists() else {"benchmark": "compare_same_jax", "runs": {}}
        data["runs"][f"jax {jax.__version__}"] = record
        path.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
