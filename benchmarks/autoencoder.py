"""Benchmark: curvax K-FAC (fixed and adaptive) against Optax Adam on the MNIST autoencoder.

Everything is measured in one run on one machine, so the ratios are meaningful
even where absolute times are noisy:

* first step (trace + compile + burn-in + run) of each optimizer;
* per-step wall time (median and mean over many steps, which for K-FAC include
  the periodic inverse and damping steps) and its ratio to an Adam step;
* steps and seconds to reach a target training loss within a budget.

Writes JSON (``--output``). ``--quick`` is a smoke run on a tiny problem.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from curvax import autoencoder as ae
from curvax import datasets


def _sync(tree: Any) -> None:
    jax.block_until_ready(tree)


def adam_runner(images: jax.Array, lr: float) -> tuple[Callable, Any]:
    tx = optax.adam(lr)
    params = ae.init_params(jax.random.PRNGKey(0))

    @jax.jit
    def step(state: Any) -> tuple[Any, jax.Array]:
        params, opt_state = state
        loss, grads = jax.value_and_grad(ae.loss_fn)(params, images)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, tx.init(params))


def kfac_runner(images: jax.Array, adaptive: bool, fixed: dict[str, float], **kwargs: Any) -> tuple[Callable, Any]:
    opt = ae.make_kfac(adaptive=adaptive, **kwargs)
    params = ae.init_params(jax.random.PRNGKey(0))
    rng = jax.random.PRNGKey(1)
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


def measure(step: Callable, state: Any, timed_steps: int, max_steps: int, budget_s: float, target: float) -> dict[str, Any]:
    """First-step time, then per-step times, then the run to the target loss."""
    losses: list[float] = []
    t0 = time.perf_counter()
    state, loss = step(state)
    _sync(loss)
    first = time.perf_counter() - t0
    losses.append(float(loss))
    elapsed = first
    reached: tuple[int, float] | None = (1, elapsed) if losses[-1] <= target else None
    per_step = []
    for i in range(1, max_steps):
        t = time.perf_counter()
        state, loss = step(state)
        _sync(loss)
        dt = time.perf_counter() - t
        elapsed += dt
        if i <= timed_steps:
            per_step.append(dt)
        losses.append(float(loss))
        if reached is None and losses[-1] <= target:
            reached = (i + 1, elapsed)
        if (reached is not None and i >= timed_steps) or elapsed > budget_s or not np.isfinite(losses[-1]):
            break
    return {
        "first_step_s": first,
        "step_median_s": statistics.median(per_step),
        "step_mean_s": statistics.fmean(per_step),
        "timed_steps": len(per_step),
        "steps_run": len(losses),
        "final_loss": losses[-1],
        "best_loss": min(losses),
        "steps_to_target": None if reached is None else reached[0],
        "seconds_to_target": None if reached is None else reached[1],
        "loss_curve_every_10": losses[::10],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-images", type=int, default=2000)
    p.add_argument("--target-loss", type=float, default=100.0)
    p.add_argument("--timed-steps", type=int, default=20, help="steps timed for the per-step figures (after the first)")
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--budget", type=float, default=120.0, help="seconds per optimizer for the time-to-target run")
    p.add_argument("--adam-lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3, 3e-3])
    p.add_argument("--fixed-lr", type=float, default=0.2)
    p.add_argument("--fixed-momentum", type=float, default=0.8)
    p.add_argument("--fixed-damping", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--output", default="benchmarks/results/autoencoder.json")
    args = p.parse_args()
    if args.quick:
        args.num_images, args.timed_steps, args.max_steps, args.budget, args.adam_lrs = 64, 3, 6, 30.0, [1e-3]
    images = jnp.asarray(datasets.load_mnist_images(args.num_images))
    fixed = {"learning_rate": args.fixed_lr, "momentum": args.fixed_momentum, "damping": args.fixed_damping}
    results: dict[str, Any] = {}
    runs: list[tuple[str, Callable[[], tuple[Callable, Any]]]] = [
        (f"adam_lr{lr:g}", lambda lr=lr: adam_runner(images, lr)) for lr in args.adam_lrs
    ]
    runs += [
        ("curvax_fixed", lambda: kfac_runner(images, False, fixed)),
        ("curvax_adaptive", lambda: kfac_runner(images, True, fixed)),
    ]
    for name, make in runs:
        t0 = time.perf_counter()
        step, state = make()
        init_s = time.perf_counter() - t0
        results[name] = {"init_s": init_s, **measure(step, state, args.timed_steps, args.max_steps, args.budget, args.target_loss)}
        r = results[name]
        print(f"{name:18s} first {r['first_step_s']:6.2f}s  step median {r['step_median_s']*1e3:7.1f}ms "
              f"mean {r['step_mean_s']*1e3:7.1f}ms  final {r['final_loss']:8.2f}  "
              f"to target: {r['steps_to_target']} steps / {r['seconds_to_target'] and round(r['seconds_to_target'], 1)} s", flush=True)
    adam_names = [n for n in results if n.startswith("adam")]
    adam_step = statistics.median(results[n]["step_median_s"] for n in adam_names)
    reached = [n for n in adam_names if results[n]["seconds_to_target"] is not None]
    best_adam = min(reached, key=lambda n: results[n]["seconds_to_target"]) if reached else None
    summary = {"adam_step_median_s": adam_step, "best_adam": best_adam}
    for mode in ("curvax_fixed", "curvax_adaptive"):
        r = results[mode]
        summary[mode] = {
            "step_ratio_median": r["step_median_s"] / adam_step,
            "step_ratio_mean": r["step_mean_s"] / adam_step,
            "first_step_s": r["first_step_s"],
            "seconds_to_target": r["seconds_to_target"],
            "steps_to_target": r["steps_to_target"],
            "speedup_vs_best_adam_to_target": (
                results[best_adam]["seconds_to_target"] / r["seconds_to_target"]
                if best_adam and r["seconds_to_target"] else None
            ),
        }
    out = {
        "benchmark": "mnist_autoencoder",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "jax": jax.__version__, "backend": jax.default_backend()},
        "settings": vars(args),
        "summary": summary,
        "results": results,
    }
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
