"""MNIST digits with a Flax NNX CNN: K-FAC (curvax.Optimizer) against Adam, on minibatches.

curvax ships the 10,000 MNIST test images (``curvax.datasets``); this example splits them into
a training set and a held-out set. Both optimizers start from the same initialisation, read the
same stream of minibatches and run the same number of steps. The table reports the training
loss, the held-out loss and accuracy, and the time each took (compilation included).

K-FAC's first step runs ``num_burnin_steps`` curvature-only updates on batches drawn from the
``data_iterator`` given to ``step`` (the parameters do not move during the burn-in), then
steps on the next batch; later steps draw one batch each.

    python examples/mnist_cnn_nnx.py            # 300 steps of batch 128 (a few minutes on 2 cores)
    python examples/mnist_cnn_nnx.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import curvax
from curvax import datasets

L2_REG = 1e-5


class CNN(nnx.Module):
    """conv 3x3 -> relu -> 2x2 avg pool, twice, then a dense layer to 10 logits."""

    def __init__(self, channels: tuple[int, int], *, rngs: nnx.Rngs):
        c1, c2 = channels
        self.conv1 = nnx.Conv(1, c1, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(c1, c2, (3, 3), rngs=rngs)
        self.out = nnx.Linear(7 * 7 * c2, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], 28, 28, 1)
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
        return self.out(x.reshape(x.shape[0], -1))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def make_loss(graphdef: Any):
    """``loss(params, batch)``: mean cross-entropy (registered with curvax) plus the L2 term."""

    def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        images, labels = batch
        logits = nnx.merge(graphdef, params)(images)
        curvax.register_softmax_cross_entropy_loss(logits, labels)
        return cross_entropy(logits, labels) + 0.5 * L2_REG * curvax.utils.inner_product(params, params)

    return loss


def minibatches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int) -> Iterator[tuple[jax.Array, jax.Array]]:
    """An endless stream of shuffled minibatches (one fixed size, so the step compiles once)."""
    rng = np.random.default_rng(seed)
    for _ in itertools.count():
        order = rng.permutation(len(x))
        for i in range(0, len(x) - batch_size + 1, batch_size):
            idx = order[i : i + batch_size]
            yield jnp.asarray(x[idx]), jnp.asarray(y[idx])


def evaluate(graphdef: Any, params: Any, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Held-out mean cross-entropy and accuracy."""
    logits = jax.jit(lambda p, im: nnx.merge(graphdef, p)(im))(params, jnp.asarray(x))
    return float(cross_entropy(logits, jnp.asarray(y))), float(jnp.mean(jnp.argmax(logits, -1) == y))


def train_kfac(loss, params, data: Iterator, example_batch: Any, steps: int, burnin: int, seed: int) -> tuple[Any, list[float], list[float]]:
    optimizer = curvax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss),
        l2_reg=L2_REG,
        use_adaptive_learning_rate=True,
        use_adaptive_momentum=True,
        use_adaptive_damping=True,
        initial_damping=1.0,
        num_burnin_steps=burnin,
        inverse_update_period=5,
    )
    key = jax.random.PRNGKey(seed)
    state = optimizer.init(params, key, example_batch)  # traces the model; shapes only
    losses, times = [], []
    for i in range(steps):
        key, sub = jax.random.split(key)
        start = time.perf_counter()
        # step 0 draws `burnin` batches from the iterator for the burn-in, then one to step on
        params, state, stats = optimizer.step(params, state, sub, data_iterator=data, global_step_int=i)
        losses.append(float(stats["loss"]))  # float() waits for the step to finish
        times.append(time.perf_counter() - start)
    return params, losses, times


def train_adam(loss, params, data: Iterator, steps: int, lr: float) -> tuple[Any, list[float], list[float]]:
    tx = optax.adam(lr)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, value = step(params, opt_state, next(data))
        losses.append(float(value))
        times.append(time.perf_counter() - start)
    return params, losses, times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps on a small split (smoke test)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (both optimizers)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--num-train", type=int, default=8000, help="training images; the rest of the 10,000 are held out")
    parser.add_argument("--num-test", type=int, default=2000)
    parser.add_argument("--burnin", type=int, default=5, help="K-FAC's num_burnin_steps")
    parser.add_argument("--adam-lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size, args.num_train, args.num_test, args.burnin = 12, 64, 1024, 500, 2
        channels = (4, 8)
    else:
        channels = (16, 32)
    if args.num_train + args.num_test > datasets.NUM_EXAMPLES:
        parser.error(f"--num-train + --num-test must be at most {datasets.NUM_EXAMPLES}")

    images, labels = datasets.load_mnist_images(), datasets.load_mnist_labels()
    x_train, y_train = images[: args.num_train], labels[: args.num_train]
    x_test, y_test = images[-args.num_test :], labels[-args.num_test :]

    graphdef, params0 = nnx.split(CNN(channels, rngs=nnx.Rngs(args.seed)))
    loss = make_loss(graphdef)

    rows = []
    for name in ("curvax K-FAC", "optax Adam"):
        data = minibatches(x_train, y_train, args.batch_size, args.seed)  # the same batches for both
        if name.startswith("curvax"):
            example = (jnp.asarray(x_train[: args.batch_size]), jnp.asarray(y_train[: args.batch_size]))
            params, losses, times = train_kfac(loss, params0, data, example, args.steps, args.burnin, args.seed)
        else:
            params, losses, times = train_adam(loss, params0, data, args.steps, args.adam_lr)
        test_loss, test_acc = evaluate(graphdef, params, x_test, y_test)
        last = float(np.mean(losses[-5:]))
        rows.append((name, args.steps, losses[0], last, test_loss, test_acc, times))

    print(f"MNIST CNN (Flax NNX), {args.num_train} training / {args.num_test} held-out images, batch {args.batch_size}")
    print(f"{'optimizer':<14} {'steps':>5} {'first loss':>10} {'last loss':>10} {'test loss':>10} {'test acc':>9} "
          f"{'first step s':>12} {'median step ms':>14} {'total s':>8}")
    for name, steps, first, last, test_loss, test_acc, times in rows:
        print(f"{name:<14} {steps:>5} {first:>10.4f} {last:>10.4f} {test_loss:>10.4f} {test_acc:>9.3f} "
              f"{times[0]:>12.1f} {1000 * np.median(times[1:]):>14.1f} {sum(times):>8.1f}")
    print("('last loss': mean training loss of the last 5 minibatches; 'first step': compilation, and K-FAC's "
          "burn-in, included)")
    ok = all(np.isfinite(r[3]) and r[3] < r[2] for r in rows)
    print(f"RESULT kfac_test_acc={rows[0][5]:.4f} adam_test_acc={rows[1][5]:.4f} finite_and_decreasing={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
