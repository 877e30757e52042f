"""The model: a small MLP whose loss registers its predictive distribution through kfac_jax."""

import jax
import jax.numpy as jnp
from kfac_jax.loss_functions import register_softmax_cross_entropy_loss
import kfac_jax.layers_and_loss_tags


def init(key, sizes=(4, 16, 3)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
            for k, m, n in zip(keys, sizes[:-1], sizes[1:])]


def loss(params, batch):
    x, y = batch
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


LAYER_DATA = kfac_jax.layers_and_loss_tags.LayerData
