"""``curvax demo``: K-FAC against Adam on the deep MNIST autoencoder.

Both optimizers train the same model from the same initialisation on the same
full batch of real MNIST images, each for a fixed wall-clock budget (or step
count). The demo prints a results table and writes a loss-vs-time plot.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from curvax import autoencoder as ae
from curvax import datasets


@dataclasses.dataclass
class Run:
    """One optimizer's trajectory: loss after each step and the wall time it was reached."""

    name: str
    losses: list[float]
    times: list[float]
    first_step_seconds: float

    def time_to(self, target: float) -> float | None:
        for loss, t in zip(self.losses, self.times):
            if loss <= target:
                return t
        return None


def _progress(total: int, desc: str, quiet: bool) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - exercised only without the extra
        return None
    return tqdm(total=total, desc=desc, disable=quiet, leave=True, dynamic_ncols=True)


def run_kfac(images: jax.Array, steps: int, budget: float, seed: int, initial_damping: float, quiet: bool) -> Run:
    params = ae.init_params(jax.random.PRNGKey(seed))
    opt = ae.make_kfac(adaptive=True, initial_damping=initial_damping)
    rng = jax.random.PRNGKey(seed + 1)
    state = opt.init(params, rng, images)
    if not quiet:
        print(opt.registration_table())
    return _loop("curvax K-FAC", steps, budget, quiet, lambda p, s, i: _kfac_step(opt, p, s, i, images, rng), params, state)


def _kfac_step(opt: Any, params: Any, state: Any, i: int, images: jax.Array, rng: jax.Array) -> tuple[Any, Any, float]:
    # Full batch: the data "iterator" repeats the batch (burn-in draws from it too).
    params, state, stats = opt.step(
        params, state, jax.random.fold_in(rng, i), data_iterator=itertools.repeat(images), global_step_int=i
    )
    return params, state, float(stats["loss"])


def run_adam(images: jax.Array, steps: int, budget: float, seed: int, learning_rate: float, quiet: bool) -> Run:
    params = ae.init_params(jax.random.PRNGKey(seed))
    tx = optax.adam(learning_rate)

    @jax.jit
    def step(params: Any, opt_state: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(ae.loss_fn)(params, images)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def one(p: Any, s: Any, i: int) -> tuple[Any, Any, float]:
        p, s, loss = step(p, s)
        return p, s, float(loss)

    return _loop(f"Optax Adam (lr={learning_rate:g})", steps, budget, quiet, one, params, tx.init(params))


def _loop(name: str, steps: int, budget: float, quiet: bool, step: Callable, params: Any, state: Any) -> Run:
    """Runs ``step`` until ``steps`` or ``budget`` seconds; losses are those before each update."""
    bar = _progress(steps, name, quiet)
    losses, times = [], []
    start = time.perf_counter()
    first = 0.0
    for i in range(steps):
        params, state, loss = step(params, state, i)
        now = time.perf_counter() - start
        if i == 0:
            first = now
        losses.append(loss)
        times.append(now)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.2f}")
        if now > budget:
            break
    if bar is not None:
        bar.close()
    return Run(name, losses, times, first)


def results_table(runs: list[Run]) -> str:
    """A plain-text table: final loss, steps, seconds, time to a common target."""
    target = max(min(r.losses) for r in runs)
    rows = [("optimizer", "final loss", "best loss", "steps", "seconds", "first step s", f"s to loss {target:.2f}")]
    for r in runs:
        reach = r.time_to(target)
        rows.append(
            (r.name, f"{r.losses[-1]:.3f}", f"{min(r.losses):.3f}", str(len(r.losses)), f"{r.times[-1]:.1f}",
             f"{r.first_step_seconds:.1f}", "-" if reach is None else f"{reach:.1f}")
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    line = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths))
    return "\n".join([line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]])


def plot(runs: list[Run], path: str, title: str) -> bool:
    """Writes a loss-vs-time PNG; returns False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ax.plot(r.times, r.losses, label=r.name)
    ax.set_yscale("log")
    ax.set_xlabel("wall-clock seconds (including compilation)")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(args: Any) -> int:
    missing = [m for m in ("matplotlib", "tqdm") if not _importable(m)]
    if missing:
        print(f"note: {', '.join(missing)} not installed (pip install '.[examples]'); "
              "running without progress bars/plot.", file=sys.stderr)
    images = jnp.asarray(datasets.load_mnist_images(args.num_images))
    print(f"MNIST autoencoder {'-'.join(map(str, ae.LAYER_SIZES))}, full batch of {args.num_images} images, "
          f"{jax.device_count()} {jax.default_backend()} device(s), budget {args.time_budget:g} s per optimizer")
    runs = [
        run_kfac(images, args.steps, args.time_budget, args.seed, args.initial_damping, args.quiet),
        run_adam(images, args.adam_steps, args.time_budget, args.seed, args.adam_lr, args.quiet),
    ]
    print()
    print(results_table(runs))
    if plot(runs, args.output, f"MNIST autoencoder, {args.num_images} images, full batch"):
        print(f"\nloss-vs-time plot written to {args.output}")
    return 0


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False
