"""Benchmark: per-step time of curvax K-FAC variants over an Optax Adam step, interleaved.

A shared machine drifts: an optimizer timed for two minutes and another timed two
minutes later see different loads. Here every optimizer is built and compiled
first, then the steps are interleaved round by round (one step of each, in an order
that rotates every round), so drift and background load hit all of them alike.

Each optimizer keeps its own trajectory from the same initialisation on the MNIST
autoencoder (full batch). Reported per optimizer: median and mean step time, the
ratio of each to Adam's median step, and the median over rounds of the per-round
ratio (this round's step over this round's Adam step). K-FAC's mean includes the
inverse refreshes (every 5 steps); run a multiple of 5 rounds. Writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
import autoencoder as bench  # noqa: E402

from curvax import datasets  # noqa: E402

FIXED = {"learning_rate": 0.1, "momentum": 0.0, "damping": 3.0}
# name -> (adaptive, extra Optimizer arguments)
VARIANTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "curvax_fixed": (False, {}),
    "curvax_adaptive": (True, {}),
    f"curvax_fixed_{bench.FRACTION_NAME}": (False, {"curvature_batch_fraction": bench.FRACTION_VARIANT}),
    f"curvax_adaptive_{bench.FRACTION_NAME}": (True, {"curvature_batch_fraction": bench.FRACTION_VARIANT}),
    f"curvax_fixed_period{bench.PERIOD_VARIANT}": (False, {"curvature_update_period": bench.PERIOD_VARIANT}),
    f"curvax_adaptive_period{bench.PERIOD_VARIANT}": (True, {"curvature_update_period": bench.PERIOD_VARIANT}),
}


def handwritten_value_and_grad(params: Any, images: jax.Array) -> Any:
    """``jax.value_and_grad(loss_fn)`` behind a plain function: nothing proves it is curvax's gradient.

    The optimizer then calls it every step for the loss and the gradient (the fallback of
    ``curvax.gradients``); timing it next to ``curvax_fixed`` measures what the fallback costs.
    """
    return jax.value_and_grad(bench.ae.loss_fn)(params, images)


VARIANTS["curvax_fixed_user_grad"] = (False, {"value_and_grad_func": handwritten_value_and_grad})
VARIANTS["curvax_adaptive_user_grad"] = (True, {"value_and_grad_func": handwritten_value_and_grad})
DEFAULT = tuple(list(VARIANTS)[:4])
# curvax.kfac_preconditioner chained with optax.sgd: the fixed mode through Optax (named in --only).
OPTAX_VARIANT = "optax_kfac_fixed"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-images", type=int, default=2000, help="full-batch size (default 2000)")
    p.add_argument("--rounds", type=int, default=40, help="timed rounds, one step of each optimizer (default 40)")
    p.add_argument("--warmup", type=int, default=6, help="untimed steps of each optimizer first (default 6)")
    p.add_argument("--only", nargs="+", choices=[*VARIANTS, OPTAX_VARIANT], default=list(DEFAULT),
                   help="curvax variants to time against Adam (default: fixed and adaptive, whole batch and sub25)")
    p.add_argument("--adam-lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="benchmarks/results/step_ratio.json", help="JSON output path")
    return p.parse_args(argv)


def timed(step: Callable[[Any], tuple[Any, Any]], carry: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    carry, loss = step(carry)
    jax.block_until_ready((carry, loss))
    return carry, time.perf_counter() - t


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    images = jnp.asarray(datasets.load_mnist_images(args.num_images))
    runners: dict[str, Any] = {"adam": bench.adam_runner(images, args.adam_lr, args.seed)}
    for name in args.only:
        if name == OPTAX_VARIANT:
            runners[name] = bench.kfac_optax_runner(images, args.seed, FIXED)
            continue
        adaptive, extra = VARIANTS[name]
        runners[name] = bench.kfac_runner(images, args.seed, adaptive, FIXED, 1.0, **extra)
    names = list(runners)
    carries = {n: runners[n][1] for n in names}
    first: dict[str, float] = {}
    for n in names:  # compile and burn in, then a few untimed steps
        carries[n], first[n] = timed(runners[n][0], carries[n])
        for _ in range(args.warmup):
            carries[n], _ = timed(runners[n][0], carries[n])
        print(f"{n:24s} first step {first[n]:6.2f} s", flush=True)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            carries[n], dt = timed(runners[n][0], carries[n])
            times[n].append(dt)
    adam_median = statistics.median(times["adam"])
    summary: dict[str, Any] = {"adam_step_median_s": adam_median}
    for n in names[1:]:
        ts = times[n]
        summary[n] = {
            "step_median_s": statistics.median(ts),
            "step_mean_s": statistics.fmean(ts),
            "ratio_median": statistics.median(ts) / adam_median,
            "ratio_mean": statistics.fmean(ts) / adam_median,
            "ratio_per_round_median": statistics.median(t / a for t, a in zip(ts, times["adam"])),
        }
        print(f"{n:24s} median {summary[n]['ratio_median']:.2f}x  mean {summary[n]['ratio_mean']:.2f}x  "
              f"per-round median {summary[n]['ratio_per_round_median']:.2f}x", flush=True)
    out = {
        "benchmark": "mnist_autoencoder_step_ratio",
        "machine": bench.machine_info(),
        "settings": vars(args),
        "summary": summary,
        "first_step_s": first,
        "step_times_s": times,
    }
    bench.write_results(args.output, out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
