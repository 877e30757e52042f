"""Laplace approximation of an MNIST classifier, and whether it is better calibrated than the MAP.

A small MLP (plain JAX) is trained to its MAP estimate ``theta*`` on a few MNIST images, long
enough to become overconfident. ``curvax.laplace`` then builds a Gaussian posterior over the
last layer's weights (the features of the hidden layer kept at the MAP: "last-layer Laplace",
the cheap and robust choice of Daxberger et al., 2021):
``N(theta*, (N C + alpha I)^-1)``, with ``C`` the K-FAC estimate of the per-example GGN
(``BlockDiagonalCurvature``, ``estimation_mode="ggn_exact"``) and ``alpha`` the prior precision.
The logits are linear in the last layer, so averaging the softmax over posterior samples
(``laplace.sample``, each K-FAC block mapping noise through its inverse square root) is the
linearised ("GLM") predictive.

The prior precision ``alpha`` is chosen two ways, from a grid:

1. by the Laplace evidence (``laplace.log_marginal_likelihood``), from the training data alone;
2. by the NLL on a validation split (images that are neither training nor test images).

On held-out test images the table compares the MAP and both Laplace predictives: accuracy,
negative log-likelihood (NLL) and expected calibration error (ECE, 15 confidence bins).

    python examples/laplace_calibration.py            # 2000 training images, 50 posterior samples
    python examples/laplace_calibration.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import curvax
from curvax import datasets, laplace

L2_REG = 1e-4  # weight decay of the MAP fit


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def features(params, x: jax.Array) -> jax.Array:
    """Everything but the last layer."""
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x


def head(last: dict[str, jax.Array], phi: jax.Array) -> jax.Array:
    return phi @ last["w"] + last["b"]


def mean_nll(last: dict[str, jax.Array], batch) -> jax.Array:
    """Mean negative log-likelihood of the last layer on fixed features; registers the softmax
    cross-entropy so that curvax knows the loss's curvature."""
    phi, y = batch
    logits = head(last, phi)
    curvax.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def map_loss(params, batch) -> jax.Array:
    x, y = batch
    return mean_nll(params[-1], (features(params, x), y)) + 0.5 * L2_REG * curvax.utils.inner_product(params, params)


def metrics(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> tuple[float, float, float]:
    """Accuracy, NLL and ECE of predicted class probabilities."""
    conf, pred = probs.max(-1), probs.argmax(-1)
    correct = (pred == labels).astype(np.float64)
    nll = -np.mean(np.log(np.clip(probs[np.arange(len(labels)), labels], 1e-12, None)))
    which = np.minimum((conf * bins).astype(int), bins - 1)
    ece = sum(
        abs(correct[which == b].mean() - conf[which == b].mean()) * np.mean(which == b)
        for b in range(bins) if np.any(which == b)
    )
    return float(correct.mean()), float(nll), float(ece)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few samples (smoke test)")
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-val", type=int, default=1000)
    parser.add_argument("--num-test", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1000, help="full-batch Adam steps to the MAP")
    parser.add_argument("--samples", type=int, default=50, help="posterior samples for the predictive")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_train, args.num_val, args.num_test, args.hidden, args.steps, args.samples = 500, 500, 1000, 32, 300, 20
    if args.num_train + args.num_val + args.num_test > datasets.NUM_EXAMPLES:
        parser.error(f"--num-train + --num-val + --num-test must be at most {datasets.NUM_EXAMPLES}")

    images, labels = datasets.load_mnist_images(), datasets.load_mnist_labels()
    n, n_val = args.num_train, args.num_val
    x_train, y_train = jnp.asarray(images[:n]), jnp.asarray(labels[:n])
    x_val, y_val = jnp.asarray(images[n : n + n_val]), labels[n : n + n_val]
    x_test, y_test = jnp.asarray(images[-args.num_test :]), labels[-args.num_test :]
    timings = {}

    # 1. the MAP estimate (full-batch Adam on the regularised loss)
    start = time.perf_counter()
    params = init_mlp(jax.random.PRNGKey(args.seed), (784, args.hidden, 10))
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    @jax.jit
    def adam_step(params, opt_state):
        grads = jax.grad(map_loss)(params, (x_train, y_train))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(args.steps):
        params, opt_state = adam_step(params, opt_state)
    last = params[-1]
    phi_train, phi_val, phi_test = (features(params, x) for x in (x_train, x_val, x_test))
    train_nll = float(mean_nll(last, (phi_train, y_train)))
    timings["MAP fit"] = time.perf_counter() - start

    # 2. the K-FAC GGN of the last layer over the training set
    start = time.perf_counter()
    key = jax.random.PRNGKey(args.seed + 1)
    estimator = curvax.BlockDiagonalCurvature(mean_nll)
    state = estimator.init(key, (last, (phi_train, y_train)), None, None)
    state = estimator.update_curvature_matrix_estimate(
        state, 0.0, 1.0, n, key, (last, (phi_train, y_train)), estimation_mode="ggn_exact"
    )

    # 3a. alpha by the Laplace evidence. log det(N C + alpha I) = sum(log(N lambda + alpha)) over
    #     the eigenvalues of C (a Kronecker block's are its factors' products), so one
    #     eigendecomposition serves the whole grid; laplace.log_marginal_likelihood gives the same
    #     evidence for one alpha.
    grid = np.logspace(-2, 4, 13)
    eigenvalues = np.asarray(curvax.operators.from_estimator(estimator, state).eigenvalues(), np.float64)
    norm_sq = float(curvax.utils.inner_product(last, last))
    evidence = [
        -n * train_nll + 0.5 * eigenvalues.size * np.log(a) - 0.5 * a * norm_sq - 0.5 * np.sum(np.log(n * eigenvalues + a))
        for a in grid
    ]
    alpha_evidence = float(grid[int(np.argmax(evidence))])
    log_evidence = float(laplace.log_marginal_likelihood(estimator, state, last, train_nll, n, alpha_evidence))

    # 3b. the predictive for a given alpha: the softmax averaged over posterior samples
    def predictive(alpha: float, phi: jax.Array) -> np.ndarray:
        deltas = laplace.sample(estimator, state, jax.random.PRNGKey(args.seed + 2), alpha, scale=n,
                                num_samples=args.samples)
        logits = jax.vmap(lambda d: head(jax.tree_util.tree_map(jnp.add, last, d), phi))(deltas)
        return np.asarray(jnp.mean(jax.nn.softmax(logits), axis=0))

    val_nll = [metrics(predictive(float(a), phi_val), y_val)[1] for a in grid]
    alpha_val = float(grid[int(np.argmin(val_nll))])
    timings["curvature + choosing alpha"] = time.perf_counter() - start

    start = time.perf_counter()
    rows = [
        ("map", "MAP", metrics(np.asarray(jax.nn.softmax(head(last, phi_test))), y_test)),
        ("evidence", f"Laplace, alpha {alpha_evidence:.3g} (evidence)", metrics(predictive(alpha_evidence, phi_test), y_test)),
        ("val", f"Laplace, alpha {alpha_val:.3g} (validation)", metrics(predictive(alpha_val, phi_test), y_test)),
    ]
    timings["predictive"] = time.perf_counter() - start

    print(f"MLP 784-{args.hidden}-10, MAP on {n} MNIST images (training NLL {train_nll:.4f}); Laplace over the "
          f"last layer ({eigenvalues.size} parameters); {n_val} validation and {args.num_test} test images")
    print(f"log evidence at alpha {alpha_evidence:.3g}: {log_evidence:.1f}; alpha grid {grid[0]:g}..{grid[-1]:g}; "
          f"{args.samples} posterior samples")
    print(f"{'predictive':<34} {'accuracy':>8} {'NLL':>8} {'ECE':>8}")
    for _, name, (acc, nll, ece) in rows:
        print(f"{name:<34} {acc:>8.3f} {nll:>8.4f} {ece:>8.4f}")
    print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    results = {k: m for k, _, m in rows}
    ok = all(np.isfinite(m).all() for m in results.values())
    print(f"RESULT map_nll={results['map'][1]:.4f} laplace_val_nll={results['val'][1]:.4f} "
          f"laplace_evidence_nll={results['evidence'][1]:.4f} map_ece={results['map'][2]:.4f} "
          f"laplace_val_ece={results['val'][2]:.4f} finite={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    if "--json" in sys.argv[1:]:  # --json PATH: also write what the run printed (examples/_record.py)
        from _record import run_recorded

        i = sys.argv.index("--json")
        raise SystemExit(run_recorded(main, sys.argv[1:i] + sys.argv[i + 2:], sys.argv[i + 1], "examples/laplace_calibration.py"))
    raise SystemExit(main())
