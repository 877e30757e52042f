"""Benchmark: curvax K-FAC (fixed and adaptive) against Optax Adam on the MNIST autoencoder.

Everything is measured in one run on one machine, so the ratios are meaningful
even where absolute times are noisy:

* setup (building the optimizer: for K-FAC, tracing and layer detection) and
  the first step (trace + compile + burn-in + run) of each optimizer;
* per-step wall time after a warm-up (median and mean over ``--timed-steps``
  steps, which for K-FAC include the periodic inverse and damping steps), with
  ``jax.block_until_ready`` on all outputs, and its ratio to an Adam step;
* steps and seconds (setup and compilation included) to reach a target
  training loss within a step and time budget.

Writes JSON (``--output``). ``--quick`` is a smoke run on a tiny problem.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import jaxlib
import optax

from curvax import autoencoder as ae
from curvax import datasets

import harness  # shared benchmark helpers (benchmarks/ is on the path)

# A benchmark step: carry -> (carry, loss before the update).
Step = Callable[[Any], tuple[Any, jax.Array]]


def adam_runner(images: jax.Array, lr: float, seed: int) -> tuple[Step, Any]:
    """A jitted full-batch Optax Adam step and its initial carry."""
    tx = optax.adam(lr)
    params = ae.init_params(jax.random.PRNGKey(seed))

    @jax.jit
    def step(carry: Any) -> tuple[Any, jax.Array]:
        params, opt_state = carry
        loss, grads = jax.value_and_grad(ae.loss_fn)(params, images)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, tx.init(params))


def kfac_optax_runner(images: jax.Array, seed: int, fixed: dict[str, float]) -> tuple[Step, Any]:
    """curvax's Optax transformation chained with ``optax.sgd``, in a user's jitted step.

    The fixed mode's update (same learning rate, momentum, damping, EMA and inverse period),
    but the gradient comes from the user's own ``value_and_grad``: the curvature statistics
    pay a second forward pass that ``Optimizer.step`` shares.
    """
    import curvax

    tx = optax.chain(
        curvax.kfac_preconditioner(ae.loss_fn, images, fixed["damping"], l2_reg=ae.L2_REG, curvature_ema=0.95,
                                   inverse_update_period=5, seed=seed + 1),
        optax.sgd(fixed["learning_rate"], momentum=fixed["momentum"] or None),
    )
    params = ae.init_params(jax.random.PRNGKey(seed))

    @jax.jit
    def step(carry: Any) -> tuple[Any, jax.Array]:
        params, opt_state = carry
        loss, grads = jax.value_and_grad(ae.loss_fn)(params, images)
        updates, opt_state = tx.update(grads, opt_state, params, batch=images)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, tx.init(params))


# Curvature variants compared with the default Kronecker blocks (issue: EKFAC and diagonal).
BLOCK_VARIANTS: dict[str, dict[str, Any]] = {
    "kronecker": {},
    "ekfac": {"dense": "DenseEigenvalueCorrected"},
    "diagonal": {"dense": "DenseDiagonal"},
}
# Kronecker blocks whose statistics are updated every 5 steps (``curvature_update_period=5``).
PERIOD_VARIANT = 5
# Kronecker blocks estimated on a random quarter of the batch (``curvature_batch_fraction=0.25``).
FRACTION_VARIANT = 0.25
FRACTION_NAME = f"sub{round(100 * FRACTION_VARIANT)}"
ALL_RUNS = (
    "adam", "curvax_fixed", "curvax_adaptive", "curvax_adaptive_ekfac", "curvax_adaptive_diagonal",
    f"curvax_fixed_period{PERIOD_VARIANT}", f"curvax_adaptive_period{PERIOD_VARIANT}",
    f"curvax_fixed_{FRACTION_NAME}", f"curvax_adaptive_{FRACTION_NAME}",
)


def kfac_runner(
    images: jax.Array, seed: int, adaptive: bool, fixed: dict[str, float], initial_damping: float,
    blocks: str = "kronecker", **opt_kwargs: Any,
) -> tuple[Step, Any]:
    """A curvax K-FAC step (adaptive, or with ``fixed`` lr/momentum/damping passed to ``step``)."""
    import curvax

    ctors = {tag: getattr(curvax, name) for tag, name in BLOCK_VARIANTS[blocks].items()}
    opt = ae.make_kfac(
        adaptive=adaptive, initial_damping=initial_damping, layer_tag_to_block_ctor=ctors or None, **opt_kwargs
    )
    params = ae.init_params(jax.random.PRNGKey(seed))
    rng = jax.random.PRNGKey(seed + 1)
    state = opt.init(params, rng, images)
    counter = itertools.count()
    extra = {} if adaptive else fixed

    def step(carry: Any) -> tuple[Any, jax.Array]:
        params, state = carry
        i = next(counter)
        params, state, stats = opt.step(
            params, state, jax.random.fold_in(rng, i), data_iterator=itertools.repeat(images), global_step_int=i, **extra
        )
        return (params, state), stats["loss"]

    return step, (params, state)


def measure(
    step: Step, carry: Any, setup_s: float, warmup: int, timed: int, max_steps: int, budget_s: float, target: float
) -> dict[str, Any]:
    """Runs ``step`` and records first-step, per-step and time-to-target figures.

    Steps ``2 .. warmup + 1`` are not timed (they may compile further variants),
    the next ``timed`` steps are; the run goes on until the target is reached,
    ``max_steps`` or ``budget_s`` seconds (setup included), or the loss is not finite.
    """
    losses: list[float] = []
    per_step: list[float] = []
    elapsed = setup_s
    reached: tuple[int, float] | None = None
    first = math.nan
    for i in range(max_steps):
        carry, loss, dt = harness.timed_step(step, carry)
        elapsed += dt
        if i == 0:
            first = dt
        elif warmup < i <= warmup + timed:
            per_step.append(dt)
        losses.append(float(loss))
        if reached is None and losses[-1] <= target:
            reached = (i + 1, elapsed)
        timing_done = i >= warmup + timed
        if not math.isfinite(losses[-1]) or (timing_done and (reached is not None or elapsed > budget_s)):
            break
    finite = [x for x in losses if math.isfinite(x)]
    return {
        "setup_s": setup_s,
        "first_step_s": first,
        "step_median_s": statistics.median(per_step) if per_step else None,
        "step_mean_s": statistics.fmean(per_step) if per_step else None,
        "step_min_s": min(per_step) if per_step else None,
        "timed_steps": len(per_step),
        "steps_run": len(losses),
        "seconds_run": elapsed,
        "final_loss": losses[-1],
        "best_loss": min(finite) if finite else None,
        "diverged": not math.isfinite(losses[-1]),
        "steps_to_target": None if reached is None else reached[0],
        "seconds_to_target": None if reached is None else reached[1],
        "loss_curve_every_10": [x if math.isfinite(x) else None for x in losses[::10]],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-images", type=int, default=2000, help="full-batch size (default 2000)")
    p.add_argument("--target-loss", type=float, default=100.0, help="training loss to reach (default 100)")
    p.add_argument("--warmup-steps", type=int, default=10, help="untimed steps after the first (default 10)")
    p.add_argument("--timed-steps", type=int, default=20, help="steps timed for the per-step figures (default 20)")
    p.add_argument("--max-steps", type=int, default=3000, help="step budget per optimizer (default 3000)")
    p.add_argument("--budget", type=float, default=120.0, help="seconds per optimizer, setup included (default 120)")
    p.add_argument("--adam-lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3, 3e-3], help="Adam learning rates")
    p.add_argument("--fixed-lr", type=float, default=0.1, help="K-FAC fixed mode learning rate (default 0.1)")
    p.add_argument("--fixed-momentum", type=float, default=0.0, help="K-FAC fixed mode momentum (default 0)")
    p.add_argument("--fixed-damping", type=float, default=3.0, help="K-FAC fixed mode damping (default 3)")
    p.add_argument("--initial-damping", type=float, default=1.0, help="K-FAC adaptive initial damping (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only", nargs="+", choices=ALL_RUNS,
        help="run a subset (the block, period and sub-batch variants run only when named here)",
    )
    p.add_argument("--quick", action="store_true", help="tiny smoke run (64 images, a few steps)")
    p.add_argument("--output", default="benchmarks/results/autoencoder.json", help="JSON output path")
    args = p.parse_args(argv)
    if args.quick:
        args.num_images, args.warmup_steps, args.timed_steps, args.max_steps, args.budget = 64, 2, 3, 8, 30.0
        args.adam_lrs = [1e-3]
    return args


def machine_info() -> dict[str, Any]:
    """Where the numbers were taken."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    images = jnp.asarray(datasets.load_mnist_images(args.num_images))
    fixed = {"learning_rate": args.fixed_lr, "momentum": args.fixed_momentum, "damping": args.fixed_damping}
    wanted = set(args.only or ["adam", "curvax_fixed", "curvax_adaptive"])
    runs: list[tuple[str, Callable[[], tuple[Step, Any]]]] = []
    if "adam" in wanted:
        runs += [(f"adam_lr{lr:g}", lambda lr=lr: adam_runner(images, lr, args.seed)) for lr in args.adam_lrs]
    if "curvax_fixed" in wanted:
        runs.append(("curvax_fixed", lambda: kfac_runner(images, args.seed, False, fixed, args.initial_damping)))
    if "curvax_adaptive" in wanted:
        runs.append(("curvax_adaptive", lambda: kfac_runner(images, args.seed, True, fixed, args.initial_damping)))
    for variant in ("ekfac", "diagonal"):
        if f"curvax_adaptive_{variant}" in wanted:
            runs.append((f"curvax_adaptive_{variant}",
                         lambda v=variant: kfac_runner(images, args.seed, True, fixed, args.initial_damping, v)))
    for adaptive in (False, True):
        name = f"curvax_{'adaptive' if adaptive else 'fixed'}_period{PERIOD_VARIANT}"
        if name in wanted:
            runs.append((name, lambda a=adaptive: kfac_runner(
                images, args.seed, a, fixed, args.initial_damping, curvature_update_period=PERIOD_VARIANT)))
        name = f"curvax_{'adaptive' if adaptive else 'fixed'}_{FRACTION_NAME}"
        if name in wanted:
            runs.append((name, lambda a=adaptive: kfac_runner(
                images, args.seed, a, fixed, args.initial_damping, curvature_batch_fraction=FRACTION_VARIANT)))
    print(f"MNIST autoencoder, {args.num_images} images full batch, target loss {args.target_loss:g}, "
          f"{jax.default_backend()} backend, {os.cpu_count()} CPUs", flush=True)
    results: dict[str, Any] = {}
    for name, make in runs:
        t0 = time.perf_counter()
        step, carry = make()
        setup_s = time.perf_counter() - t0
        r = results[name] = measure(step, carry, setup_s, args.warmup_steps, args.timed_steps, args.max_steps,
                                    args.budget, args.target_loss)
        median = "n/a" if r["step_median_s"] is None else f"{r['step_median_s'] * 1e3:7.1f}ms"
        to_target = ("not reached" if r["steps_to_target"] is None
                     else f"{r['steps_to_target']} steps / {r['seconds_to_target']:.1f}s")
        print(f"{name:16s} setup {setup_s:5.1f}s  first step {r['first_step_s']:6.2f}s  step median {median}  "
              f"final loss {r['final_loss']:8.2f} after {r['steps_run']} steps  target: {to_target}", flush=True)
    summary = summarize(results)
    out = {
        "benchmark": "mnist_autoencoder",
        "model": "-".join(map(str, ae.LAYER_SIZES)),
        "machine": machine_info(),
        "settings": vars(args),
        "summary": summary,
        "results": results,
    }
    write_results(args.output, out, summary)
    return 0


def write_results(output: str, out: dict[str, Any], summary: dict[str, Any]) -> None:
    """Writes ``out`` as JSON to ``output`` (creating its folder) and prints ``summary``."""
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per-step ratios to Adam and time-to-target speed-ups over the best Adam learning rate."""
    adam = [n for n in results if n.startswith("adam") and results[n]["step_median_s"] is not None]
    adam_step = statistics.median(results[n]["step_median_s"] for n in adam) if adam else None
    reached = [n for n in adam if results[n]["seconds_to_target"] is not None]
    best_adam = min(reached, key=lambda n: results[n]["seconds_to_target"]) if reached else None
    summary: dict[str, Any] = {
        "adam_step_median_s": adam_step,
        "best_adam": best_adam,
        "best_adam_seconds_to_target": results[best_adam]["seconds_to_target"] if best_adam else None,
    }
    for mode in ALL_RUNS[1:]:
        if mode not in results:
            continue
        r = results[mode]
        ratio = adam_step is not None and r["step_median_s"] is not None
        summary[mode] = {
            "step_ratio_median": r["step_median_s"] / adam_step if ratio else None,
            "step_ratio_mean": r["step_mean_s"] / adam_step if ratio else None,
            "setup_s": r["setup_s"],
            "first_step_s": r["first_step_s"],
            "steps_to_target": r["steps_to_target"],
            "loss_after_50_steps": r["loss_curve_every_10"][5] if len(r["loss_curve_every_10"]) > 5 else None,
            "seconds_to_target": r["seconds_to_target"],
            "speedup_vs_best_adam_to_target": (
                results[best_adam]["seconds_to_target"] / r["seconds_to_target"]
                if best_adam and r["seconds_to_target"] else None
            ),
        }
    return summary


if __name__ == "__main__":
    sys.exit(main())
