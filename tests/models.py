"""Small models in every framework, shared by the tests.

Each builder returns ``(loss_fn, params, batch)`` where ``loss_fn(params, batch)``
registers its loss with curvax and returns the mean loss, and the expected
registration as a list of (parameter paths, pattern name).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

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


# --- parameter positions in the flat (``to_dense_matrix``) order ----------------------------------


def flat_positions(tree: Any) -> dict[str, np.ndarray]:
    """Each leaf's key path (``jax.tree_util.keystr``) -> its flat positions in ``ravel_pytree`` order."""
    positions, start = {}, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        positions[jax.tree_util.keystr(path)] = np.arange(start, start + leaf.size)
        start += leaf.size
    return positions


def loop_order(stacked: Any, listed: Any, stack_key: str | None = None) -> np.ndarray:
    """The permutation ``perm`` with ``stacked_matrix == listed_matrix[np.ix_(perm, perm)]``.

    ``stacked`` holds per-layer parameters with a leading layer axis (under ``stacked[stack_key]``,
    or at the top level when ``stack_key`` is None); ``listed`` holds the same numbers as
    ``listed["layers"][l][name]`` (the Python-loop model's parameters). Every other top-level leaf
    keeps its path. ``perm[i]`` is the listed position of the stacked position ``i``.
    """
    pos_s, pos_l = flat_positions(stacked), flat_positions(listed)
    names = list(listed["layers"][0])
    stack = stacked[stack_key] if stack_key is not None else {n: stacked[n] for n in names}
    prefix = f"[{stack_key!r}]" if stack_key is not None else ""
    perm = np.zeros(sum(leaf.size for leaf in jax.tree_util.tree_leaves(stacked)), dtype=int)
    for name, stacked_leaf in stack.items():
        size = stacked_leaf[0].size
        for l in range(stacked_leaf.shape[0]):
            perm[pos_s[f"{prefix}[{name!r}]"][l * size:(l + 1) * size]] = pos_l[f"['layers'][{l}][{name!r}]"]
    for key in stacked:
        if key != stack_key and key not in stack:
            perm[pos_s[f"[{key!r}]"]] = pos_l[f"[{key!r}]"]
    return perm


# --- a small transformer, stacked in a ``lax.scan`` or unrolled in a Python loop ------------------


def _layer_norm(x: jax.Array, scale: jax.Array, shift: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6) * scale + shift


def transformer_block(h: jax.Array, q: dict[str, jax.Array]) -> jax.Array:
    """One pre-norm block on ``h`` (sequences, tokens, width): causal attention, then a GELU MLP."""
    lin = lambda x, n: x @ q[n + "_w"] + q[n + "_b"]
    tokens, width = h.shape[-2], h.shape[-1]
    a = _layer_norm(h, q["ln_s"], q["ln_b"])
    scores = jnp.einsum("btd,bsd->bts", lin(a, "q"), lin(a, "k")) / np.sqrt(width)
    mask = jnp.tril(jnp.ones((tokens, tokens), bool))
    h = h + lin(jax.nn.softmax(jnp.where(mask, scores, -1e9), -1) @ lin(a, "v"), "o")
    return h + lin(jax.nn.gelu(lin(h, "m1")), "m2")


def transformer_params(key: jax.Array, layers: int, width: int, hidden: int, vocab: int) -> dict[str, Any]:
    """``transformer_scan``'s parameters: the blocks' stacked under ``"stack"``, ``"emb"``, ``"out"``."""
    shapes = {"ln_s": (width,), "ln_b": (width,)}
    dims = {"q": (width, width), "k": (width, width), "v": (width, width), "o": (width, width),
            "m1": (width, hidden), "m2": (hidden, width)}
    for n, (i, o) in dims.items():
        shapes[n + "_w"], shapes[n + "_b"] = (i, o), (o,)
    keys = jax.random.split(key, len(shapes) + 2)
    stack = {n: jax.random.normal(k, (layers,) + s) / np.sqrt(s[0]) for k, (n, s) in zip(keys, shapes.items())}
    return {"stack": stack, "emb": jax.random.normal(keys[-2], (vocab, width)),
            "out": jax.random.normal(keys[-1], (width, vocab)) / 3}


def transformer_scan(p: dict[str, Any], ids: jax.Array) -> jax.Array:
    """Logits of the transformer whose blocks run in one ``lax.scan`` over ``p["stack"]``."""
    h, _ = jax.lax.scan(lambda h, q: (transformer_block(h, q), None), p["emb"][ids], p["stack"])
    return h @ p["out"]


def transformer_loop(p: dict[str, Any], ids: jax.Array) -> jax.Array:
    """The same transformer with its blocks in a Python loop over ``p["layers"]`` (``unstack_transformer``)."""
    h = p["emb"][ids]
    for q in p["layers"]:
        h = transformer_block(h, q)
    return h @ p["out"]


def unstack_transformer(p: dict[str, Any]) -> dict[str, Any]:
    """``transformer_params``'s numbers as ``transformer_loop``'s parameters."""
    layers = next(iter(p["stack"].values())).shape[0]
    return {"layers": [{n: a[l] for n, a in p["stack"].items()} for l in range(layers)], "emb": p["emb"], "out": p["out"]}


def xent_loss(model: Callable[[Any, jax.Array], jax.Array]) -> Callable:
    """Next-token softmax cross-entropy of ``model(params, ids)`` on ``(ids, labels)``, registered;
    summed over tokens, averaged over sequences."""
    def loss(p, data):
        ids, labels = data
        logits = model(p, ids)
        curvax.register_softmax_cross_entropy_loss(logits, labels)
        return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)) / ids.shape[0]

    return loss


# --- a tanh MLP classifier with random biases, for hand-built curvature oracles ------------------


def tanh_mlp_apply(p: dict[str, jax.Array], x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(first pre-activation, logits)`` of ``x -> tanh(x w1 + b1) w2 + b2``: the oracles need both."""
    pre1 = x @ p["w1"] + p["b1"]
    return pre1, jnp.tanh(pre1) @ p["w2"] + p["b2"]


def tanh_mlp_loss(p: dict[str, jax.Array], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy of ``tanh_mlp_apply``'s logits on integer labels, registered."""
    logits = tanh_mlp_apply(p, batch[0])[1]
    curvax.register_softmax_cross_entropy_loss(logits, batch[1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], axis=1))


def tanh_mlp_problem(dims: tuple[int, int, int] = (4, 5, 3), n: int = 24,
                     weight_scales: tuple[float, float] = (0.5, 0.5)) -> tuple[dict[str, jax.Array], tuple[jax.Array, jax.Array]]:
    """Parameters (``d_in -> d_hid -> d_out`` of ``dims``, standard-normal weights times
    ``weight_scales``, non-zero biases) and ``n`` labelled examples for ``tanh_mlp_loss``, in the
    caller's default float dtype (float64 under the ``x64`` fixture); built once per dtype."""
    return _tanh_mlp_problem(str(jnp.zeros(()).dtype), tuple(dims), n, tuple(weight_scales))


@functools.lru_cache(maxsize=None)
def _tanh_mlp_problem(dtype: str, dims: tuple[int, int, int], n: int,
                      weight_scales: tuple[float, float]) -> tuple[dict[str, jax.Array], tuple[jax.Array, jax.Array]]:
    del dtype  # a cache key only: the arrays take the caller's default dtype
    d_in, d_hid, d_out = dims
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    p = {"w1": jax.random.normal(k[0], (d_in, d_hid)) * weight_scales[0], "b1": 0.1 * jax.random.normal(k[1], (d_hid,)),
         "w2": jax.random.normal(k[2], (d_hid, d_out)) * weight_scales[1], "b2": 0.1 * jax.random.normal(k[3], (d_out,))}
    x, y = jax.random.normal(k[4], (n, d_in)), jax.random.randint(k[5], (n,), 0, d_out)
    return p, (x, y)


def fisher_exact_estimate(loss: Callable, params: Any, batch: Any) -> tuple[curvax.BlockDiagonalCurvature, Any]:
    """``(estimator, state)``: the block-diagonal estimate of ``loss`` from one exact-Fisher update on ``batch``."""
    est = curvax.BlockDiagonalCurvature(loss)
    state = est.init(jax.random.PRNGKey(1), (params, batch), None, None)
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, batch[0].shape[0], jax.random.PRNGKey(2),
                                                 (params, batch), estimation_mode="fisher_exact")
    return est, state


# --- the same tanh MLP in each framework's own idiom: (apply(params, x), float64 params) ---------


def _to_float64(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), tree)


def _haiku_tanh_mlp(key: jax.Array, d_in: int, d_hid: int, d_out: int) -> tuple[Callable, Any]:
    import haiku as hk

    model = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([d_hid, d_out], activation=jnp.tanh)(x)))
    return model.apply, model.init(key, jnp.zeros((1, d_in)))


def _linen_tanh_mlp(key: jax.Array, d_in: int, d_hid: int, d_out: int) -> tuple[Callable, Any]:
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(d_out)(jnp.tanh(nn.Dense(d_hid)(x)))

    model = MLP()
    return model.apply, model.init(key, jnp.zeros((1, d_in)))


def _nnx_tanh_mlp(key: jax.Array, d_in: int, d_hid: int, d_out: int) -> tuple[Callable, Any]:
    from flax import nnx

    del key  # nnx modules draw from their own ``Rngs`` (seed 0)

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l0 = nnx.Linear(d_in, d_hid, rngs=rngs)
            self.l1 = nnx.Linear(d_hid, d_out, rngs=rngs)

        def __call__(self, x):
            return self.l1(jnp.tanh(self.l0(x)))

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    return (lambda p, x: nnx.merge(graphdef, p)(x)), state


def _equinox_tanh_mlp(key: jax.Array, d_in: int, d_hid: int, d_out: int) -> tuple[Callable, Any]:
    import equinox as eqx

    model = eqx.nn.MLP(d_in, d_out, d_hid, 1, activation=jnp.tanh, key=key)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return (lambda p, x: jax.vmap(eqx.combine(p, static))(x)), params


_TANH_MLPS = {"haiku": _haiku_tanh_mlp, "flax_linen": _linen_tanh_mlp, "flax_nnx": _nnx_tanh_mlp,
              "equinox": _equinox_tanh_mlp}
TANH_MLP_FRAMEWORKS = tuple(_TANH_MLPS)


def framework_tanh_mlp(framework: str, key: jax.Array, d_in: int, d_hid: int, d_out: int) -> tuple[Callable, Any]:
    """``x -> dense(tanh(dense(x)))`` written with ``framework``'s own layers (one of
    ``TANH_MLP_FRAMEWORKS``): ``(apply(params, x), params in float64)``."""
    apply, params = _TANH_MLPS[framework](key, d_in, d_hid, d_out)
    return apply, _to_float64(params)
