"""``curvax demo``: K-FAC against Adam on the deep MNIST autoencoder.

Both optimizers train the same model from the same initialisation on the same full batch of
real MNIST images for a fixed number of steps each (a wall-clock cap is optional). The first step
— building the optimizer, tracing, layer detection, burn-in and compilation — is timed on its own;
training seconds start after it. The results table gives, for each optimizer, the steps it ran,
its losses, its first-step and median step times, and the steps and training seconds it needed to
reach the best loss every run reached. It states no winner: steps are comparable across machines,
seconds only within one run on one machine. The plot shows the loss against steps and against
training seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from curvax import autoencoder as ae
from curvax import datasets

EXTRAS_HINT = "pip install '.[examples]'"

# A step function: (params, state, step index) -> (params, state, loss before the update).
StepFn = Callable[[Any, Any, int], tuple[Any, Any, float]]
# Builds an optimizer: () -> (step function, params, state).
SetupFn = Callable[[], tuple[StepFn, Any, Any]]


@dataclasses.dataclass
class Run:
    """One optimizer's trajectory.

    ``losses[i]``: the loss before update ``i``; ``times[i]``: training seconds when it was seen,
    counted from the end of the first step (so ``times[0] == 0``); ``first_step_seconds``: building
    the optimizer and its first step (tracing, burn-in and compilation included).
    """

    name: str
    losses: list[float]
    times: list[float]
    first_step_seconds: float

    def steps_to(self, target: float) -> int | None:
        """Updates made before the loss first reached ``target`` (None if it never did)."""
        for i, loss in enumerate(self.losses):
            if loss <= target:
                return i
        return None

    def time_to(self, target: float) -> float | None:
        """Training seconds until the loss first reached ``target`` (None if it never did)."""
        i = self.steps_to(target)
        return None if i is None else self.times[i]

    def best(self) -> float:
        """The lowest finite loss seen (inf if none)."""
        finite = [x for x in self.losses if math.isfinite(x)]
        return min(finite) if finite else math.inf

    def median_step_seconds(self) -> float:
        """The median time of a step after the first (nan with fewer than two steps)."""
        gaps = sorted(b - a for a, b in zip(self.times, self.times[1:]))
        return gaps[len(gaps) // 2] if gaps else math.nan


def _progress(total: int, desc: str, quiet: bool) -> Any:
    """A tqdm bar, or None when tqdm is missing or ``quiet``."""
    if quiet:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=True, dynamic_ncols=True)


def kfac_setup(
    images: jax.Array, seed: int, initial_damping: float, quiet: bool, curvature_batch_fraction: float = 1.0
) -> SetupFn:
    """curvax K-FAC with adaptive learning rate, momentum and damping."""

    def setup() -> tuple[StepFn, Any, Any]:
        params = ae.init_params(jax.random.PRNGKey(seed))
        opt = ae.make_kfac(
            adaptive=True, initial_damping=initial_damping, curvature_batch_fraction=curvature_batch_fraction
        )
        rng = jax.random.PRNGKey(seed + 1)
        state = opt.init(params, rng, images)
        if not quiet:
            print(opt.registration_table())

        def step(params: Any, state: Any, i: int) -> tuple[Any, Any, float]:
            # Full batch: the data iterator repeats the batch (the burn-in on step 0 draws from it too).
            params, state, stats = opt.step(
                params, state, jax.random.fold_in(rng, i), data_iterator=itertools.repeat(images), global_step_int=i
            )
            return params, state, float(stats["loss"])

        return step, params, state

    return setup


def adam_setup(images: jax.Array, seed: int, learning_rate: float) -> SetupFn:
    """Optax Adam with a jitted full-batch step."""

    def setup() -> tuple[StepFn, Any, Any]:
        params = ae.init_params(jax.random.PRNGKey(seed))
        tx = optax.adam(learning_rate)

        @jax.jit
        def update(params: Any, opt_state: Any) -> tuple[Any, Any, jax.Array]:
            loss, grads = jax.value_and_grad(ae.loss_fn)(params, images)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        def step(params: Any, opt_state: Any, i: int) -> tuple[Any, Any, float]:
            params, opt_state, loss = update(params, opt_state)
            return params, opt_state, float(loss)

        return step, params, tx.init(params)

    return setup


def run(name: str, setup: SetupFn, steps: int, budget: float | None, quiet: bool) -> Run:
    """Builds the optimizer, then takes ``steps`` steps (fewer if ``budget`` training seconds pass).

    The first step (with building the optimizer) is timed separately; the training clock and the
    optional ``budget`` start after it. A non-finite loss stops the run.
    """
    start = time.perf_counter()
    step, params, state = setup()
    bar = _progress(steps, name, quiet)
    losses: list[float] = []
    times: list[float] = []
    first = 0.0
    train_start = start
    for i in range(steps):
        params, state, loss = step(params, state, i)
        now = time.perf_counter()
        if i == 0:
            first, train_start = now - start, now
        losses.append(loss)
        times.append(now - train_start)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.2f}")
        if (budget is not None and times[-1] > budget) or not math.isfinite(loss):
            break
    if bar is not None:
        bar.close()
    return Run(name, losses, times, first)


def results_table(runs: list[Run], floor: float | None = None) -> str:
    """A plain-text table; the shared target is the best loss that every optimizer reached.

    ``floor``, if given, is the lowest loss possible on the data (noted under the table). No
    verdict: the reader compares steps (machine-independent) and seconds (this run only).
    """
    target = max(r.best() for r in runs)
    rows = [("optimizer", "steps", "final loss", "best loss", "first step s", "median step s",
             f"steps to {target:.2f}", f"train s to {target:.2f}")]
    for r in runs:
        n, t = r.steps_to(target), r.time_to(target)
        rows.append(
            (r.name, str(len(r.losses)), f"{r.losses[-1]:.3f}", f"{r.best():.3f}", f"{r.first_step_seconds:.1f}",
             f"{r.median_step_seconds():.3f}", "-" if n is None else str(n), "-" if t is None else f"{t:.1f}")
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    notes = (
        "'first step s': building the optimizer and its first step (tracing, burn-in, compilation);\n"
        "'train s': seconds after the first step. Steps compare across machines; seconds only within this run\n"
        f"(a busy machine slows every optimizer, not always alike). Target {target:.2f}: the best loss every run reached."
    )
    if floor is not None:
        notes += f"\nThe lowest loss possible on these images (their pixel entropy) is {floor:.2f}."
    return "\n".join([line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]] + ["", notes])


def plot(runs: list[Run], path: str, title: str, floor: float | None = None) -> bool:
    """Writes the loss against steps and against training seconds to a PNG; False without matplotlib.

    With ``floor`` (the lowest possible loss) both panels show the loss above it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    shift = floor if floor is not None else 0.0
    for r in runs:
        label = f"{r.name} ({len(r.losses)} steps, first step {r.first_step_seconds:.1f} s)"
        ys = [max(x - shift, 1e-6) for x in r.losses]
        axes[0].plot(range(len(ys)), ys, label=label)
        axes[1].plot(r.times, ys, label=label)
    ylabel = "training loss" if floor is None else f"training loss - lowest possible ({floor:.2f})"
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("seconds after the first step (compilation excluded)")
    for ax in axes:
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def missing_extras() -> list[str]:
    """The optional demo packages (matplotlib, tqdm) that cannot be imported."""
    missing = []
    for name in ("matplotlib", "tqdm"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def use_compilation_cache(directory: str) -> None:
    """Turns on JAX's persistent compilation cache in ``directory``, for every compile.

    Must run before the process compiles anything: JAX reads these settings once.
    A rerun then loads the compiled K-FAC step instead of compiling it again.
    """
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def main(args: argparse.Namespace) -> int:
    """Runs the demo for parsed ``curvax demo`` arguments (see ``curvax.cli``)."""
    if args.compilation_cache:
        use_compilation_cache(args.compilation_cache)
    effects = {"tqdm": "no progress bars", "matplotlib": "no plot"}
    for name in missing_extras():
        print(f"note: {name} is not installed ({EXTRAS_HINT}): {effects[name]}.", file=sys.stderr)
    images = jnp.asarray(datasets.load_mnist_images(args.num_images))
    print(f"MNIST autoencoder {'-'.join(map(str, ae.LAYER_SIZES))}, full batch of {args.num_images} images, "
          f"{jax.device_count()} {jax.default_backend()} device(s); {args.steps} K-FAC steps, {args.adam_steps} Adam steps"
          + (f", at most {args.time_budget:g} training seconds each" if args.time_budget is not None else ""))
    runs: list[Run] = []
    fraction = args.curvature_batch_fraction
    name = "curvax K-FAC" if fraction == 1 else f"curvax K-FAC (curvature on {fraction:g} of the batch)"
    setup = kfac_setup(images, args.seed, args.initial_damping, args.quiet, fraction)
    runs.append(run(name, setup, args.steps, args.time_budget, args.quiet))
    runs.append(run(f"Optax Adam (lr={args.adam_lr:g})", adam_setup(images, args.seed, args.adam_lr),
                    args.adam_steps, args.time_budget, args.quiet))
    floor = ae.entropy_floor(images)
    print()
    print(results_table(runs, floor))
    if plot(runs, args.output, f"MNIST autoencoder, {args.num_images} images, full batch", floor):
        print(f"\nloss-vs-time plot written to {args.output}")
    else:
        print(f"\nno plot written: matplotlib is not installed ({EXTRAS_HINT}).")
    return 0
