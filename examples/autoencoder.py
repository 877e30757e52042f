"""The deep MNIST autoencoder (Hinton & Salakhutdinov, 2006): K-FAC against Adam.

784-1000-500-250-30-250-500-1000-784 with tanh units, a linear 30-unit code and a sigmoid
cross-entropy reconstruction loss summed over pixels (the model lives in ``curvax.autoencoder``).
It is K-FAC's classic benchmark: deep, badly conditioned, and slow for first-order methods.
Both optimizers train full batch on the same images from the same initialisation:

* ``curvax.Optimizer`` with adaptive learning rate, momentum and damping (kfac-jax's
  autoencoder settings, ``curvax.autoencoder.make_kfac``), ``--steps`` steps;
* Optax Adam, ``--adam-steps`` steps (an Adam step costs less; see the benchmarks page).

The table gives, per optimizer, the steps run, the first, final and best loss, the steps each
took to reach the best loss both reached, and the time (compilation included). The lowest
loss possible on these images is their pixel entropy, printed for reference.

    python examples/autoencoder.py            # 100 K-FAC and 500 Adam steps on 1000 images
    python examples/autoencoder.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from curvax import autoencoder, datasets


def train_kfac(params, images: jax.Array, steps: int, seed: int) -> tuple[list[float], list[float]]:
    optimizer = autoencoder.make_kfac(adaptive=True, initial_damping=10.0)
    key = jax.random.PRNGKey(seed)
    state = optimizer.init(params, key, images)
    losses, times = [], []
    for i in range(steps):
        key, sub = jax.random.split(key)
        start = time.perf_counter()
        # full batch: the burn-in (5 curvature-only updates) runs on this same batch at step 0
        params, state, stats = optimizer.step(params, state, sub, batch=images, global_step_int=i)
        losses.append(float(stats["loss"]))  # float() waits for the step to finish
        times.append(time.perf_counter() - start)
    return losses, times


def train_adam(params, images: jax.Array, steps: int, lr: float) -> tuple[list[float], list[float]]:
    tx = optax.adam(lr)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(autoencoder.loss_fn)(params, images)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, value = step(params, opt_state)
        losses.append(float(value))
        times.append(time.perf_counter() - start)
    return losses, times


def steps_to(losses: list[float], target: float) -> str:
    hit = [i + 1 for i, v in enumerate(losses) if v <= target]
    return str(hit[0]) if hit else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps on a few images (smoke test)")
    parser.add_argument("--num-images", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=100, help="K-FAC steps")
    parser.add_argument("--adam-steps", type=int, default=500)
    parser.add_argument("--adam-lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = autoencoder.LAYER_SIZES
    if args.quick:  # a narrower network of the same depth: compiles and runs in seconds
        args.num_images, args.steps, args.adam_steps = 256, 10, 30
        sizes = (784, 200, 100, 50, 10, 50, 100, 200, 784)

    import warnings

    warnings.filterwarnings("ignore", message="num_burnin_steps=.*data_iterator")  # full batch: intended
    images = jnp.asarray(datasets.load_mnist_images(args.num_images))
    params = autoencoder.init_params(jax.random.PRNGKey(args.seed), sizes)

    runs = {}
    for name in ("curvax K-FAC", "optax Adam"):
        if name.startswith("curvax"):
            runs[name] = train_kfac(params, images, args.steps, args.seed)
        else:
            runs[name] = train_adam(params, images, args.adam_steps, args.adam_lr)

    common = max(min(losses) for losses, _ in runs.values())  # the best loss both reached
    print(f"Deep autoencoder {'-'.join(map(str, sizes))}, {args.num_images} MNIST images, full batch "
          f"(lowest possible loss: {autoencoder.entropy_floor(images):.2f})")
    print(f"{'optimizer':<14} {'steps':>5} {'first loss':>10} {'final loss':>10} {'best loss':>10} "
          f"{'steps to ' + format(common, '.1f'):>14} {'first step s':>12} {'median step ms':>14} {'total s':>8}")
    for name, (losses, times) in runs.items():
        print(f"{name:<14} {len(losses):>5} {losses[0]:>10.2f} {losses[-1]:>10.2f} {min(losses):>10.2f} "
              f"{steps_to(losses, common):>14} {times[0]:>12.1f} {1000 * np.median(times[1:]):>14.1f} {sum(times):>8.1f}")
    print("('first step': compilation, and K-FAC's burn-in, included; compare steps across machines, "
          "seconds only within one run)")
    ok = all(np.isfinite(l[-1]) and l[-1] < l[0] for l, _ in runs.values())
    kfac, adam = runs["curvax K-FAC"][0], runs["optax Adam"][0]
    print(f"RESULT kfac_first={kfac[0]:.4f} kfac_final={kfac[-1]:.4f} adam_final={adam[-1]:.4f} "
          f"finite_and_decreasing={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
