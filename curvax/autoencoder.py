"""The deep MNIST autoencoder used by the demo and the benchmarks (plain JAX).

784-1000-500-250-30-250-500-1000-784 with tanh (none on the 30-unit code),
logits output, sigmoid cross-entropy against the input pixels summed over
pixels and averaged over the batch, plus ``l2_reg / 2 * ||params||^2``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import curvax

LAYER_SIZES = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
CODE_LAYER = 3  # index of the linear (no activation) code layer
L2_REG = 1e-5

Params = list[dict[str, jax.Array]]


def init_params(key: jax.Array, sizes: Sequence[int] = LAYER_SIZES) -> Params:
    """Truncated-normal weights with std 1/sqrt(fan_in), zero biases."""
    params = []
    for k, (d_in, d_out) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        w = jax.random.truncated_normal(k, -2.0, 2.0, (d_in, d_out)) / np.sqrt(d_in)
        params.append({"w": w, "b": jnp.zeros(d_out)})
    return params


def logits_fn(params: Params, images: jax.Array) -> jax.Array:
    h = images
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1 and i != CODE_LAYER:
            h = jnp.tanh(h)
    return h


def cross_entropy(logits: jax.Array, images: jax.Array) -> jax.Array:
    """Sigmoid cross-entropy summed over pixels, averaged over the batch."""
    per_pixel = jax.nn.softplus(logits) - images * logits
    return jnp.mean(jnp.sum(per_pixel, axis=-1))


def loss_fn(params: Params, images: jax.Array, l2_reg: float = L2_REG) -> jax.Array:
    """The training loss; registers the sigmoid cross-entropy with curvax."""
    logits = logits_fn(params, images)
    curvax.register_sigmoid_cross_entropy_loss(logits, images)
    return cross_entropy(logits, images) + 0.5 * l2_reg * curvax.utils.inner_product(params, params)


def make_kfac(adaptive: bool = True, initial_damping: float = 10.0, **kwargs: Any) -> curvax.Optimizer:
    """K-FAC as in kfac-jax's autoencoder example (adaptive) or with fixed hyper-parameters."""
    settings: dict[str, Any] = dict(
        value_and_grad_func=jax.value_and_grad(loss_fn),
        l2_reg=L2_REG,
        num_burnin_steps=5,
        inverse_update_period=5,
        curvature_ema=0.95,
        estimation_mode="fisher_gradients",
    )
    if adaptive:
        settings.update(
            use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True,
            initial_damping=initial_damping, damping_adaptation_interval=5, damping_adaptation_decay=0.95,
            min_damping=1e-5, max_damping=1000.0,
        )
    settings.update(kwargs)
    return curvax.Optimizer(**settings)


def entropy_floor(images: np.ndarray | jax.Array) -> float:
    """The lowest possible data loss: the pixels' binary entropy, summed over pixels, batch mean.

    Sigmoid cross-entropy against soft targets ``x`` is minimised by predicting
    ``x`` itself, where it equals ``-x log x - (1 - x) log(1 - x)``.
    """
    x = np.asarray(images, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(np.where(x > 0, x * np.log(x), 0.0) + np.where(x < 1, (1 - x) * np.log1p(-x), 0.0))
    return float(h.sum(axis=-1).mean())
