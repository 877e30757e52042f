"""The same three small models written in every framework, for detection tests.

Models: a CNN (conv, pooling, dense), a transformer block (embedding, LayerNorm,
single-head self-attention, MLP, per-token softmax cross-entropy) and a
ResNet-style block (conv, LayerNorm, residual add, pooling, dense). Each builder
returns ``(loss_fn, params, batch)``; ``EXPECTED[model]`` is the registration
every framework must produce, as a multiset of ``(tag name, sorted parameter
sizes)`` (sizes do not depend on a framework's kernel layout).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import curvax

B, HW, C, CLASSES = 2, 6, 3, 5  # images: B x 6 x 6 x 1, 3 conv channels
T, VOCAB, D, HIDDEN = 4, 7, 6, 8  # tokens: B x 4, vocabulary 7, width 6


def _images(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (B, HW, HW, 1)), jax.random.randint(ky, (B,), 0, CLASSES)


def _tokens(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    ids = jax.random.randint(key, (B, T + 1), 0, VOCAB)
    return ids[:, :-1], ids[:, 1:]


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    curvax.register_softmax_cross_entropy_loss(logits, labels)
    logp = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.take_along_axis(logp, labels[..., None], axis=-1)) / labels.shape[0]


def _attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    scores = jnp.einsum("...td,...sd->...ts", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((q.shape[-2], q.shape[-2]), bool))
    return jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1) @ v


def _pool(x: jax.Array) -> jax.Array:
    """2x2 average pooling of NHWC images, as plain JAX (frameworks use their own)."""
    b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


# --- plain JAX --------------------------------------------------------------------


def _conv(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + b


def _layer_norm(x: jax.Array, scale: jax.Array, shift: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    xhat = (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
    return xhat * scale + shift


def _init(key: jax.Array, shapes: dict[str, tuple[int, ...]]) -> dict[str, jax.Array]:
    keys = jax.random.split(key, len(shapes))
    return {n: 0.5 * jax.random.normal(k, s) / np.sqrt(max(1, int(np.prod(s[:-1])))) for k, (n, s) in zip(keys, shapes.items())}


def jax_cnn(key):
    params = _init(key, {"conv_w": (3, 3, 1, C), "conv_b": (C,), "out_w": (C * (HW // 2) ** 2, CLASSES), "out_b": (CLASSES,)})

    def loss(p, batch):
        h = _pool(jax.nn.relu(_conv(batch[0], p["conv_w"], p["conv_b"])))
        return _xent(h.reshape(B, -1) @ p["out_w"] + p["out_b"], batch[1])

    return loss, params, _images(key)


def jax_transformer(key):
    shapes = {"emb": (VOCAB, D), "ln1_s": (D,), "ln1_b": (D,), "ln2_s": (D,), "ln2_b": (D,)}
    for n, (i, o) in {"q": (D, D), "k": (D, D), "v": (D, D), "o": (D, D), "m1": (D, HIDDEN), "m2": (HIDDEN, D), "out": (D, VOCAB)}.items():
        shapes[n + "_w"], shapes[n + "_b"] = (i, o), (o,)
    params = _init(key, shapes)

    def loss(p, batch):
        lin = lambda x, n: x @ p[n + "_w"] + p[n + "_b"]
        h = p["emb"][batch[0]]
        a = _layer_norm(h, p["ln1_s"], p["ln1_b"])
        h = h + lin(_attention(lin(a, "q"), lin(a, "k"), lin(a, "v")), "o")
        h = h + lin(jax.nn.gelu(lin(_layer_norm(h, p["ln2_s"], p["ln2_b"]), "m1")), "m2")
        return _xent(lin(h, "out"), batch[1])

    return loss, params, _tokens(key)


def jax_resnet(key):
    params = _init(key, {
        "c0_w": (3, 3, 1, C), "c0_b": (C,), "ln_s": (C,), "ln_b": (C,), "c1_w": (3, 3, C, C), "c1_b": (C,),
        "out_w": (C * (HW // 2) ** 2, CLASSES), "out_b": (CLASSES,),
    })

    def loss(p, batch):
        h = _conv(batch[0], p["c0_w"], p["c0_b"])
        r = _conv(jax.nn.relu(_layer_norm(h, p["ln_s"], p["ln_b"])), p["c1_w"], p["c1_b"])
        h = _pool(h + r)
        return _xent(h.reshape(B, -1) @ p["out_w"] + p["out_b"], batch[1])

    return loss, params, _images(key)


# --- Flax Linen -------------------------------------------------------------------


def _linen(module: Any, key: jax.Array, batch: Any) -> tuple[Callable, Any, Any]:
    params = module.init(key, batch[0])
    return (lambda p, b: _xent(module.apply(p, b[0]), b[1])), params, batch


def linen_cnn(key):
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.avg_pool(nn.relu(nn.Conv(C, (3, 3))(x)), (2, 2), (2, 2))
            return nn.Dense(CLASSES)(h.reshape(h.shape[0], -1))

    return _linen(CNN(), key, _images(key))


def linen_transformer(key):
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, ids):
            h = nn.Embed(VOCAB, D)(ids)
            a = nn.LayerNorm()(h)
            h = h + nn.Dense(D)(_attention(nn.Dense(D)(a), nn.Dense(D)(a), nn.Dense(D)(a)))
            h = h + nn.Dense(D)(nn.gelu(nn.Dense(HIDDEN)(nn.LayerNorm()(h))))
            return nn.Dense(VOCAB)(h)

    return _linen(Block(), key, _tokens(key))


def linen_resnet(key):
    import flax.linen as nn

    class ResNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Conv(C, (3, 3))(x)
            h = h + nn.Conv(C, (3, 3))(nn.relu(nn.LayerNorm()(h)))
            h = nn.avg_pool(h, (2, 2), (2, 2))
            return nn.Dense(CLASSES)(h.reshape(h.shape[0], -1))

    return _linen(ResNet(), key, _images(key))


# --- Flax NNX ---------------------------------------------------------------------


def _nnx(module: Any, batch: Any) -> tuple[Callable, Any, Any]:
    from flax import nnx

    graphdef, params = nnx.split(module)
    return (lambda p, b: _xent(nnx.merge(graphdef, p)(b[0]), b[1])), params, batch


def nnx_cnn(key):
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, C, (3, 3), rngs=rngs)
            self.out = nnx.Linear(C * (HW // 2) ** 2, CLASSES, rngs=rngs)

        def __call__(self, x):
            h = nnx.avg_pool(nnx.relu(self.conv(x)), (2, 2), (2, 2))
            return self.out(h.reshape(h.shape[0], -1))

    return _nnx(CNN(nnx.Rngs(0)), _images(key))


def nnx_transformer(key):
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(VOCAB, D, rngs=rngs)
            self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
            self.q, self.k, self.v, self.o = (nnx.Linear(D, D, rngs=rngs) for _ in range(4))
            self.m1, self.m2 = nnx.Linear(D, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, D, rngs=rngs)
            self.out = nnx.Linear(D, VOCAB, rngs=rngs)

        def __call__(self, ids):
            h = self.emb(ids)
            a = self.ln1(h)
            h = h + self.o(_attention(self.q(a), self.k(a), self.v(a)))
            h = h + self.m2(nnx.gelu(self.m1(self.ln2(h))))
            return self.out(h)

    return _nnx(Block(nnx.Rngs(0)), _tokens(key))


def nnx_resnet(key):
    from flax import nnx

    class ResNet(nnx.Module):
        def __init__(self, rngs):
            self.c0, self.c1 = nnx.Conv(1, C, (3, 3), rngs=rngs), nnx.Conv(C, C, (3, 3), rngs=rngs)
            self.ln = nnx.LayerNorm(C, rngs=rngs)
            self.out = nnx.Linear(C * (HW // 2) ** 2, CLASSES, rngs=rngs)

        def __call__(self, x):
            h = self.c0(x)
            h = nnx.avg_pool(h + self.c1(nnx.relu(self.ln(h))), (2, 2), (2, 2))
            return self.out(h.reshape(h.shape[0], -1))

    return _nnx(ResNet(nnx.Rngs(0)), _images(key))


# --- Haiku ------------------------------------------------------------------------


def _haiku(fn: Callable, key: jax.Array, batch: Any) -> tuple[Callable, Any, Any]:
    import haiku as hk

    model = hk.without_apply_rng(hk.transform(fn))
    params = model.init(key, batch[0])
    return (lambda p, b: _xent(model.apply(p, b[0]), b[1])), params, batch


def haiku_cnn(key):
    import haiku as hk

    def fn(x):
        h = hk.avg_pool(jax.nn.relu(hk.Conv2D(C, 3)(x)), (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return hk.Linear(CLASSES)(h.reshape(h.shape[0], -1))

    return _haiku(fn, key, _images(key))


def haiku_transformer(key):
    import haiku as hk

    def fn(ids):
        ln = lambda: hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)
        h = hk.Embed(VOCAB, D)(ids)
        a = ln()(h)
        h = h + hk.Linear(D)(_attention(hk.Linear(D)(a), hk.Linear(D)(a), hk.Linear(D)(a)))
        h = h + hk.Linear(D)(jax.nn.gelu(hk.Linear(HIDDEN)(ln()(h))))
        return hk.Linear(VOCAB)(h)

    return _haiku(fn, key, _tokens(key))


def haiku_resnet(key):
    import haiku as hk

    def fn(x):
        h = hk.Conv2D(C, 3)(x)
        r = hk.Conv2D(C, 3)(jax.nn.relu(hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(h)))
        h = hk.avg_pool(h + r, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return hk.Linear(CLASSES)(h.reshape(h.shape[0], -1))

    return _haiku(fn, key, _images(key))


# --- Equinox (per-example modules, vmapped over the batch) --------------------------


def _equinox(model: Any, batch: Any, prepare: Callable = lambda x: x) -> tuple[Callable, Any, Any]:
    import equinox as eqx

    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p, b):
        return _xent(jax.vmap(eqx.combine(p, static))(prepare(b[0])), b[1])

    return loss, params, batch


def _nchw(x: jax.Array) -> jax.Array:
    return jnp.transpose(x, (0, 3, 1, 2))


def equinox_cnn(key):
    import equinox as eqx

    class CNN(eqx.Module):
        conv: eqx.nn.Conv2d
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.conv = eqx.nn.Conv2d(1, C, 3, padding=1, key=k1)
            self.out = eqx.nn.Linear(C * (HW // 2) ** 2, CLASSES, key=k2)

        def __call__(self, x):
            h = eqx.nn.AvgPool2d(2, 2)(jax.nn.relu(self.conv(x)))
            return self.out(h.reshape(-1))

    return _equinox(CNN(key), _images(key), _nchw)


def equinox_transformer(key):
    import equinox as eqx

    class Block(eqx.Module):
        emb: eqx.nn.Embedding
        ln1: eqx.nn.LayerNorm
        ln2: eqx.nn.LayerNorm
        q: eqx.nn.Linear
        k: eqx.nn.Linear
        v: eqx.nn.Linear
        o: eqx.nn.Linear
        m1: eqx.nn.Linear
        m2: eqx.nn.Linear
        out: eqx.nn.Linear

        def __init__(self, key):
            ks = jax.random.split(key, 8)
            self.emb = eqx.nn.Embedding(VOCAB, D, key=ks[0])
            self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
            self.q, self.k, self.v, self.o = (eqx.nn.Linear(D, D, key=k) for k in ks[1:5])
            self.m1, self.m2 = eqx.nn.Linear(D, HIDDEN, key=ks[5]), eqx.nn.Linear(HIDDEN, D, key=ks[6])
            self.out = eqx.nn.Linear(D, VOCAB, key=ks[7])

        def __call__(self, ids):
            per_token = lambda f, x: jax.vmap(f)(x)
            h = per_token(self.emb, ids)
            a = per_token(self.ln1, h)
            h = h + per_token(self.o, _attention(per_token(self.q, a), per_token(self.k, a), per_token(self.v, a)))
            h = h + per_token(self.m2, jax.nn.gelu(per_token(self.m1, per_token(self.ln2, h))))
            return per_token(self.out, h)

    return _equinox(Block(key), _tokens(key))


def equinox_resnet(key):
    import equinox as eqx

    class ResNet(eqx.Module):
        c0: eqx.nn.Conv2d
        c1: eqx.nn.Conv2d
        ln: eqx.nn.LayerNorm
        out: eqx.nn.Linear

        def __init__(self, key):
            k0, k1, k2 = jax.random.split(key, 3)
            self.c0, self.c1 = eqx.nn.Conv2d(1, C, 3, padding=1, key=k0), eqx.nn.Conv2d(C, C, 3, padding=1, key=k1)
            self.ln = eqx.nn.LayerNorm(C)
            self.out = eqx.nn.Linear(C * (HW // 2) ** 2, CLASSES, key=k2)

        def __call__(self, x):  # x: (1, H, W); LayerNorm over channels at every pixel
            h = self.c0(x)
            normed = jax.vmap(jax.vmap(self.ln, 1, 1), 2, 2)(h)
            h = eqx.nn.AvgPool2d(2, 2)(h + self.c1(jax.nn.relu(normed)))
            return self.out(h.reshape(-1))

    return _equinox(ResNet(key), _images(key), _nchw)


BUILDERS: dict[str, dict[str, Callable[[jax.Array], tuple[Callable, Any, Any]]]] = {
    "cnn": {"plain_jax": jax_cnn, "flax_linen": linen_cnn, "flax_nnx": nnx_cnn, "haiku": haiku_cnn, "equinox": equinox_cnn},
    "transformer": {
        "plain_jax": jax_transformer, "flax_linen": linen_transformer, "flax_nnx": nnx_transformer,
        "haiku": haiku_transformer, "equinox": equinox_transformer,
    },
    "resnet": {
        "plain_jax": jax_resnet, "flax_linen": linen_resnet, "flax_nnx": nnx_resnet,
        "haiku": haiku_resnet, "equinox": equinox_resnet,
    },
}

_FLAT = C * (HW // 2) ** 2
EXPECTED: dict[str, Counter] = {
    "cnn": Counter({("conv2d", (C, 9 * C)): 1, ("dense", (CLASSES, _FLAT * CLASSES)): 1}),
    "transformer": Counter({
        ("embedding", (VOCAB * D,)): 1,
        ("scale_and_shift", (D, D)): 2,
        ("dense", (D, D * D)): 4,
        ("dense", (HIDDEN, D * HIDDEN)): 1,
        ("dense", (D, HIDDEN * D)): 1,
        ("dense", (VOCAB, D * VOCAB)): 1,
    }),
    "resnet": Counter({
        ("conv2d", (C, 9 * C)): 1,
        ("conv2d", (C, 9 * C * C)): 1,
        ("scale_and_shift", (C, C)): 1,
        ("dense", (CLASSES, _FLAT * CLASSES)): 1,
    }),
}


def registration(loss: Callable, params: Any, batch: Any) -> Counter:
    """What curvax detected, in the form of ``EXPECTED``."""
    pj = curvax.ProcessedJaxpr.make_from_func(loss, (params, batch))
    sizes = [int(np.prod(np.shape(leaf))) for leaf in jax.tree_util.tree_leaves(params)]
    return Counter((s.tag.name, tuple(sorted(sizes[i] for i in s.param_indices))) for s in pj.layer_sites)
