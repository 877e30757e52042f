"""Influence functions with curvax.operators: which training images most affect a test prediction?

The influence of up-weighting training example ``i`` on the loss at a test point is
``score_i = -g_test^T (K + lambda I)^-1 g_i`` (Koh & Liang, 2017), with ``g`` per-example loss
gradients and ``K + lambda I`` the curvature of the training objective: removing example ``i``
changes the test loss by about ``-score_i / n``. ``curvax.operators.influence_scores`` computes
all ``n`` scores with one inverse product.

The model is softmax regression on 7x7 down-sampled MNIST images with an L2 penalty
``lambda / 2 |theta|^2`` (convex, so leave-one-out retraining is well defined). For one
misclassified test image the script

1. prints the training images that help and hurt its prediction most;
2. checks the scores against the truth: it retrains the model without each of a set of
   training examples (Newton's method from the trained weights, in float64) and compares the
   actual change of the test loss with the predicted ``-score_i / n`` (Pearson correlation), for
   the exact Hessian (``operators.hessian``) and the K-FAC estimate (``operators.from_estimator``);
3. removes the 10 most helpful examples at once, and 10 random ones, and compares the changes.

    python examples/influence.py            # 1000 training images, 60 leave-one-out retrainings
    python examples/influence.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.flatten_util

jax.config.update("jax_enable_x64", True)  # leave-one-out changes are small: float64 for the checks

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import curvax  # noqa: E402
from curvax import datasets  # noqa: E402
from curvax import operators as ops  # noqa: E402


def downsample(images: np.ndarray) -> np.ndarray:
    """28x28 -> 7x7 by 4x4 average pooling: 49 features, 500 parameters in all."""
    return images.reshape(-1, 7, 4, 7, 4).mean(axis=(2, 4)).reshape(-1, 49)


def logits_fn(params, x: jax.Array) -> jax.Array:
    return x @ params["w"] + params["b"]


def example_loss(params, example) -> jax.Array:
    """The loss of one example (no batch axis): what the scores are about."""
    x, y = example
    return -jax.nn.log_softmax(logits_fn(params, x))[y]


def mean_loss(params, batch) -> jax.Array:
    """The mean training loss over a batch; registers the softmax cross-entropy for K-FAC."""
    x, y = batch
    logits = logits_fn(params, x)
    curvax.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def make_fit(x: jax.Array, y: jax.Array, l2: float):
    """``fit(params, weights, newton_steps)``: the minimiser of ``sum_i w_i loss_i / sum_i w_i +
    l2/2 |theta|^2`` by Newton's method from ``params`` (a weight of 0 removes an example)."""
    _, unravel = jax.flatten_util.ravel_pytree({"w": jnp.zeros((x.shape[1], 10)), "b": jnp.zeros(10)})

    def objective(flat, weights):
        losses = jax.vmap(example_loss, in_axes=(None, 0))(unravel(flat), (x, y))
        return jnp.sum(weights * losses) / jnp.sum(weights) + 0.5 * l2 * flat @ flat

    def newton(_, flat, weights):
        g = jax.grad(objective)(flat, weights)
        return flat - jnp.linalg.solve(jax.hessian(objective)(flat, weights), g)

    @functools.partial(jax.jit, static_argnums=2)
    def fit(params, weights, newton_steps):
        flat = jax.flatten_util.ravel_pytree(params)[0]
        return unravel(jax.lax.fori_loop(0, newton_steps, lambda i, f: newton(i, f, weights), flat))

    return fit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer images and retrainings (smoke test)")
    parser.add_argument("--num-train", type=int, default=1000)
    parser.add_argument("--num-test", type=int, default=1000)
    parser.add_argument("--l2", type=float, default=1e-3, help="L2 penalty lambda (the damping of the inverse)")
    parser.add_argument("--loo", type=int, default=60, help="leave-one-out retrainings (half top-|score|, half random)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_train, args.num_test, args.loo = 300, 300, 16

    images, labels = datasets.load_mnist_images(), datasets.load_mnist_labels()
    n = args.num_train
    x = jnp.asarray(downsample(images[:n]))
    y = jnp.asarray(labels[:n])
    x_test = jnp.asarray(downsample(images[-args.num_test :]))
    y_test = jnp.asarray(labels[-args.num_test :])
    start = time.perf_counter()

    # train to the optimum (Newton's method on a convex objective)
    fit = make_fit(x, y, args.l2)
    params = fit({"w": jnp.zeros((49, 10)), "b": jnp.zeros(10)}, jnp.ones(n), 10)
    test_losses = jax.vmap(example_loss, in_axes=(None, 0))(params, (x_test, y_test))
    predictions = jnp.argmax(logits_fn(params, x_test), -1)
    wrong = np.flatnonzero(np.asarray(predictions != y_test))
    t = int(wrong[np.argsort(np.asarray(test_losses)[wrong])[len(wrong) // 2]])  # a typical mistake
    test_point = (x_test[t], y_test[t])
    accuracy = float(jnp.mean(predictions == y_test))

    # influence scores: one inverse product of the test gradient serves all training examples
    train_grads = ops.per_example_gradients(example_loss, params, (x, y))
    test_grad = jax.grad(example_loss)(params, test_point)
    hessian = ops.hessian(mean_loss, params, (x, y))
    scores = np.asarray(ops.influence_scores(hessian, train_grads, test_grad, damping=args.l2))
    estimator = curvax.BlockDiagonalCurvature(mean_loss)
    key = jax.random.PRNGKey(args.seed)
    state = estimator.init(key, (params, (x, y)), None, None)
    state = estimator.update_curvature_matrix_estimate(state, 0.0, 1.0, n, key, (params, (x, y)),
                                                       estimation_mode="ggn_exact")
    kfac_scores = np.asarray(ops.influence_scores(ops.from_estimator(estimator, state), train_grads, test_grad,
                                                  damping=args.l2))
    predicted = -scores / n  # change of the test loss when example i is removed

    print(f"softmax regression on 7x7 MNIST, {n} training images, L2 {args.l2:g}; test accuracy {accuracy:.3f}")
    print(f"test image #{t}: label {int(y_test[t])}, predicted {int(predictions[t])}, loss {float(test_losses[t]):.3f}")
    order = np.argsort(scores)
    for title, idx in (("most helpful (removing them raises the test loss)", order[:5]),
                       ("most harmful (removing them lowers the test loss)", order[::-1][:5])):
        print(f"  {title}: " + ", ".join(f"#{i} (label {int(y[i])}, {predicted[i]:+.2e})" for i in idx))

    # leave-one-out retraining: actual vs predicted changes of the test loss
    rng = np.random.default_rng(args.seed)
    top = np.argsort(-np.abs(scores))[: args.loo // 2]
    rest = np.setdiff1d(np.arange(n), top)
    chosen = np.concatenate([top, rng.choice(rest, args.loo - len(top), replace=False)])
    base = float(example_loss(params, test_point))

    def changes_without(removed: list[np.ndarray]) -> np.ndarray:
        """The test loss after retraining without each set of examples, minus the original."""
        weights = jnp.ones((len(removed), n))
        for row, idx in enumerate(removed):
            weights = weights.at[row, jnp.asarray(idx)].set(0.0)
        # 3 Newton steps from the trained weights: removing a few examples is a small change
        refit = jax.vmap(lambda w: example_loss(fit(params, w, 3), test_point))(weights)
        return np.asarray(refit) - base

    removals = [np.array([i]) for i in chosen] + [order[:10], rng.choice(n, 10, replace=False)]
    *actual, helpful_change, random_change = changes_without(removals)
    actual = np.array(actual)
    corr_exact = float(np.corrcoef(actual, predicted[chosen])[0, 1])
    corr_kfac = float(np.corrcoef(actual, -kfac_scores[chosen] / n)[0, 1])
    seconds = time.perf_counter() - start

    print(f"leave-one-out check on {len(chosen)} examples ({len(top)} with the largest |score|, the rest random):")
    print(f"{'curvature':<24} {'Pearson r (actual vs predicted change)':>40}")
    print(f"{'exact Hessian':<24} {corr_exact:>40.4f}")
    print(f"{'K-FAC (GGN)':<24} {corr_kfac:>40.4f}")
    print(f"removing the 10 most helpful examples changes the test loss by {helpful_change:+.4f}, "
          f"10 random ones by {random_change:+.4f}")
    print(f"time {seconds:.1f} s")
    ok = bool(np.isfinite(scores).all()) and corr_exact > 0.9 and helpful_change > abs(random_change)
    print(f"RESULT corr_exact={corr_exact:.4f} corr_kfac={corr_kfac:.4f} helpful_removed={helpful_change:.4f} "
          f"random_removed={random_change:.4f} consistent={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    if "--json" in sys.argv[1:]:  # --json PATH: also write what the run printed (examples/_record.py)
        from _record import run_recorded

        i = sys.argv.index("--json")
        raise SystemExit(run_recorded(main, sys.argv[1:i] + sys.argv[i + 2:], sys.argv[i + 1], "examples/influence.py"))
    raise SystemExit(main())
