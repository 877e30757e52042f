"""The three models of ``benchmarks/compare.py``: MNIST autoencoder, MNIST CNN, character-level transformer.

Each model is plain JAX whose loss registers its output with ``reg``: ``curvax`` in the main
benchmark process, ``kfac_jax`` in the child process that runs kfac-jax 0.0.8 (under JAX 0.9.0).
Registration is a no-op outside K-FAC, so the same loss serves the Optax optimizers. The
autoencoder and CNN reuse ``curvax/autoencoder.py`` and ``benchmarks/cnn.py`` (parameters,
forward pass, data); the transformer is written here.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from curvax import autoencoder as ae
from curvax import datasets

sys.path.insert(0, str(Path(__file__).parent))
import cnn as cnn_bench  # noqa: E402  (parameters and forward pass of the benchmark CNN)

MODELS = ("autoencoder", "cnn", "transformer")


@dataclasses.dataclass
class Model:
    """A benchmark problem: parameters, a full batch, its loss and K-FAC's settings for it."""

    name: str
    description: str
    params: Any
    batch: Any
    loss_fn: Callable[[Any, Any], jax.Array]
    kfac_settings: dict[str, Any]
    batch_size: int

    @property
    def num_params(self) -> int:
        """Number of trainable scalars."""
        return int(sum(np.size(x) for x in jax.tree_util.tree_leaves(self.params)))


# ---------------------------------------------------------------------------------------------
# Deep MNIST autoencoder (curvax/autoencoder.py)

AE_QUICK_SIZES = (784, 32, 16, 8, 4, 8, 16, 32, 784)  # same depth and code layer, tiny widths


def autoencoder(reg: ModuleType, num_images: int, quick: bool, seed: int) -> Model:
    """784-1000-500-250-30-250-500-1000-784 (``quick``: 784-32-16-8-4-8-16-32-784), full batch."""
    sizes = AE_QUICK_SIZES if quick else ae.LAYER_SIZES
    images = jnp.asarray(datasets.load_mnist_images(num_images))

    def loss_fn(params: Any, batch: jax.Array) -> jax.Array:
        logits = ae.logits_fn(params, batch)
        reg.register_sigmoid_cross_entropy_loss(logits, batch)
        return ae.cross_entropy(logits, batch) + 0.5 * ae.L2_REG * sum(
            jnp.vdot(x, x) for x in jax.tree_util.tree_leaves(params))

    kfac = dict(l2_reg=ae.L2_REG, initial_damping=1.0, num_burnin_steps=5, inverse_update_period=5,
                curvature_ema=0.95, estimation_mode="fisher_gradients", damping_adaptation_interval=5,
                damping_adaptation_decay=0.95, min_damping=1e-5, max_damping=1000.0)
    return Model("autoencoder", f"deep MNIST autoencoder {'-'.join(map(str, sizes))}, tanh, sigmoid "
                 f"cross-entropy summed over pixels, {num_images} images full batch",
                 ae.init_params(jax.random.PRNGKey(seed), sizes), images, loss_fn, kfac, num_images)


# ---------------------------------------------------------------------------------------------
# MNIST CNN (benchmarks/cnn.py)

def cnn(reg: ModuleType, num_images: int, quick: bool, seed: int) -> Model:
    """conv 3x3x16, pool, conv 3x3x32, pool, dense 10; softmax cross-entropy; full batch."""
    x = jnp.asarray(datasets.load_mnist_images(num_images).reshape(-1, 28, 28, 1))
    labels = jnp.asarray(datasets.load_mnist_labels(num_images))

    def loss_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        images, y = batch
        h = cnn_bench._conv_relu_pool(cnn_bench._conv_relu_pool(images, params["conv1"]), params["conv2"])
        logits = h.reshape(h.shape[0], -1) @ params["out"]["w"] + params["out"]["b"]
        reg.register_softmax_cross_entropy_loss(logits, y)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    kfac = dict(l2_reg=1e-5, initial_damping=1.0, num_burnin_steps=2, inverse_update_period=5)
    return Model("cnn", f"MNIST CNN (conv 3x3x16, avg-pool, conv 3x3x32, avg-pool, dense 10), softmax "
                 f"cross-entropy, {num_images} images full batch",
                 cnn_bench.init_params(jax.random.PRNGKey(seed)), (x, labels), loss_fn, kfac, num_images)


# ---------------------------------------------------------------------------------------------
# Character-level transformer language model on synthetic structured text

_NAMES = ("alice", "bob", "carol", "dave", "erin", "frank")
_VERBS = ("sees", "takes", "gives", "finds", "likes")
_ADJ = ("red", "blue", "small", "old", "green")
_NOUNS = ("cat", "box", "key", "cup", "map")
_NUMBERS = ("one", "two", "three", "four")


def synthetic_text(num_chars: int, seed: int = 0) -> str:
    """Sentences from a small grammar with agreement ("bob finds two old keys. "), seeded.

    Structure a character model can learn (words, plural ``s`` after numbers above one, an
    optional adjective, a full stop); generated so the benchmark needs no corpus file.
    """
    rng = np.random.default_rng(seed)
    parts: list[str] = []
    total = 0
    while total < num_chars:
        n = int(rng.integers(len(_NUMBERS)))
        noun = _NOUNS[rng.integers(len(_NOUNS))] + ("s" if n > 0 else "")
        adj = f"{_ADJ[rng.integers(len(_ADJ))]} " if rng.random() < 0.5 else ""
        s = f"{_NAMES[rng.integers(len(_NAMES))]} {_VERBS[rng.integers(len(_VERBS))]} {_NUMBERS[n]} {adj}{noun}. "
        parts.append(s)
        total += len(s)
    return "".join(parts)[:num_chars]


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Transformer sizes."""

    seq_len: int = 32
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    d_ff: int = 256


def _dense_init(key: jax.Array, d_in: int, d_out: int, bias: bool = True) -> dict[str, jax.Array]:
    p = {"w": jax.random.normal(key, (d_in, d_out)) / np.sqrt(d_in)}
    if bias:
        p["b"] = jnp.zeros(d_out)
    return p


def _dense(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """A dense layer on ``(tokens, features)``: the 2-D form both K-FAC libraries detect."""
    y = x @ p["w"]
    return y + p["b"] if "b" in p else y


def _norm(x: jax.Array) -> jax.Array:
    """Layer normalisation without learned scale and offset."""
    mu = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + 1e-5)


def _positions(seq_len: int, d: int) -> np.ndarray:
    """Fixed sinusoidal position codes (no parameters)."""
    pos = np.arange(seq_len)[:, None]
    freq = np.exp(-np.log(10000.0) * np.arange(0, d, 2) / d)
    out = np.zeros((seq_len, d), np.float32)
    out[:, 0::2], out[:, 1::2] = np.sin(pos * freq), np.cos(pos * freq)
    return out


def transformer(reg: ModuleType, num_sequences: int, quick: bool, seed: int) -> Model:
    """A pre-norm causal transformer over characters; every parameter is a dense layer."""
    cfg = LMConfig(seq_len=16, d_model=16, heads=2, layers=1, d_ff=32) if quick else LMConfig()
    text = synthetic_text(20000, seed=1234)
    vocab = sorted(set(text))
    ids = np.array([vocab.index(c) for c in text], np.int32)
    starts = np.random.default_rng(seed).integers(0, len(ids) - cfg.seq_len - 1, num_sequences)
    windows = np.stack([ids[s:s + cfg.seq_len + 1] for s in starts])
    batch = (jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:]))
    v, d, t = len(vocab), cfg.d_model, cfg.seq_len
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 + 4 * cfg.layers))
    params = {
        "embed": _dense_init(next(keys), v, d, bias=False),
        "blocks": [{"qkv": _dense_init(next(keys), d, 3 * d), "proj": _dense_init(next(keys), d, d),
                    "ff1": _dense_init(next(keys), d, cfg.d_ff), "ff2": _dense_init(next(keys), cfg.d_ff, d)}
                   for _ in range(cfg.layers)],
        "head": _dense_init(next(keys), d, v),
    }
    pos = jnp.asarray(_positions(t, d))
    mask = jnp.tril(jnp.ones((t, t), bool))
    dh = d // cfg.heads

    def loss_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        tokens, targets = batch
        b = tokens.shape[0]
        h = (_dense(jax.nn.one_hot(tokens.reshape(-1), v), params["embed"]).reshape(b, t, d) + pos).reshape(b * t, d)
        for blk in params["blocks"]:
            q, k, val = jnp.split(_dense(_norm(h), blk["qkv"]).reshape(b, t, 3, cfg.heads, dh), 3, axis=2)
            att = jnp.einsum("bqhd,bkhd->bhqk", q[:, :, 0], k[:, :, 0]) / np.sqrt(dh)
            att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
            mixed = jnp.einsum("bhqk,bkhd->bqhd", att, val[:, :, 0]).reshape(b * t, d)
            h = h + _dense(mixed, blk["proj"])
            h = h + _dense(jax.nn.gelu(_dense(_norm(h), blk["ff1"])), blk["ff2"])
        logits = _dense(_norm(h), params["head"])
        labels = targets.reshape(-1)
        reg.register_softmax_cross_entropy_loss(logits, labels)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))

    # Every token is an example of the mean loss: the dense layers see (batch x context) rows.
    kfac = dict(l2_reg=1e-5, initial_damping=1.0, num_burnin_steps=5, inverse_update_period=5, curvature_ema=0.95,
                batch_size_extractor=tokens_per_batch)
    return Model("transformer", f"character-level causal transformer ({cfg.layers} layers, d_model {d}, "
                 f"{cfg.heads} heads, d_ff {cfg.d_ff}, context {t}, vocabulary {v}) on synthetic grammar "
                 f"sentences, {num_sequences} sequences full batch", params, batch, loss_fn, kfac, num_sequences)


def tokens_per_batch(batch: tuple[jax.Array, jax.Array]) -> int:
    """The number of predicted tokens in a language-model batch (K-FAC's ``batch_size_extractor``)."""
    return batch[0].shape[0] * batch[0].shape[1]


def json_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with functions replaced by their names, for the results file."""
    return {k: v if isinstance(v, (bool, int, float, str)) or v is None else getattr(v, "__name__", repr(v))
            for k, v in settings.items()}


BUILDERS: dict[str, Callable[[ModuleType, int, bool, int], Model]] = {
    "autoencoder": autoencoder, "cnn": cnn, "transformer": transformer,
}


def kfac_optimizer(mod: ModuleType, model: Model, **overrides: Any) -> Any:
    """``mod.Optimizer`` (curvax or kfac_jax) in adaptive mode with the model's K-FAC settings."""
    settings: dict[str, Any] = dict(
        value_and_grad_func=jax.value_and_grad(model.loss_fn), use_adaptive_learning_rate=True,
        use_adaptive_momentum=True, use_adaptive_damping=True, multi_device=False,
    )
    settings.update(model.kfac_settings)
    settings.update(overrides)
    return mod.Optimizer(**settings)
