"""Small models in every framework, shared by the tests.

Each builder returns ``(loss_fn, params, batch)`` where ``loss_fn(params, batch)``
registers its loss with curvax and returns the mean loss, and the expected
registration as a list of (parameter paths, pattern name).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

import curvax

IN, HID, OUT, B = 3, 5, 2, 4


def _batch(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (B, IN)), jax.random.normal(ky, (B, OUT))


def _sq_loss(out: jax.Array, y: jax.Array) -> jax.Array:
    curvax.register_squared_error_loss(out, y)
    return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


def plain_jax(key: jax.Array) -> tuple[Callable, Any, Any]:
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "l0": {"w": jax.random.normal(k1, (IN, HID)) / 2, "b": jnp.zeros(HID)},
        "l1": {"w": jax.random.normal(k2, (HID, OUT)) / 2, "b": jnp.zeros(OUT)},
    }

    def loss_fn(p, batch):
        x, y = batch
        h = jax.nn.gelu(x @ p["l0"]["w"] + p["l0"]["b"])
        return _sq_loss(jnp.dot(h, p["l1"]["w"]) + p["l1"]["b"], y)

    return loss_fn, params, _batch(k3)


def haiku_mlp(key: jax.Array) -> tuple[Callable, Any, Any]:
    import haiku as hk

    model = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([HID, OUT], activation=jax.nn.relu)(x)))
    batch = _batch(key)
    params = model.init(key, batch[0])
    return (lambda p, b: _sq_loss(model.apply(p, b[0]), b[1])), params, batch


def linen_mlp(key: jax.Array) -> tuple[Callable, Any, Any]:
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(OUT)(jax.nn.tanh(nn.Dense(HID)(x)))

    model = MLP()
    batch = _batch(key)
    params = model.init(key, batch[0])
    return (lambda p, b: _sq_loss(model.apply(p, b[0]), b[1])), params, batch


def nnx_mlp(key: jax.Array) -> tuple[Callable, Any, Any]:
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l0 = nnx.Linear(IN, HID, rngs=rngs)
            self.l1 = nnx.Linear(HID, OUT, rngs=rngs)

        def __call__(self, x):
            return self.l1(jax.nn.relu(self.l0(x)))

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    return (lambda p, b: _sq_loss(nnx.merge(graphdef, p)(b[0]), b[1])), state, _batch(key)


def equinox_mlp(key: jax.Array) -> tuple[Callable, Any, Any]:
    import equinox as eqx

    model = eqx.nn.MLP(IN, OUT, HID, 1, activation=jax.nn.tanh, key=key)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return (lambda p, b: _sq_loss(jax.vmap(eqx.combine(p, static))(b[0]), b[1])), params, _batch(key)


FRAMEWORK_MLPS = {
    "plain_jax": plain_jax,
    "haiku": haiku_mlp,
    "flax_linen": linen_mlp,
    "flax_nnx": nnx_mlp,
    "equinox": equinox_mlp,
}


def softmax_loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """A tanh MLP classifier (``classifier``'s parameters), softmax cross-entropy registered."""
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    curvax.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(-jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, logits.shape[-1]), axis=-1))


def classifier(num_examples: int, dims: tuple[int, int, int] = (6, 8, 3)) -> tuple[Any, Any]:
    """Parameters and a batch for ``softmax_loss`` (the same in every process: key 0)."""
    d_in, d_hid, d_out = dims
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (d_in, d_hid)) / 2, "b1": jnp.zeros(d_hid),
        "w2": jax.random.normal(k[1], (d_hid, d_out)) / 2, "b2": jnp.zeros(d_out),
    }
    batch = (jax.random.normal(k[2], (num_examples, d_in)), jax.random.randint(k[3], (num_examples,), 0, d_out))
    return params, batch
