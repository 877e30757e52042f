"""README's code examples run as written (the quickstart has its own test, test_quickstart.py).

Each example is taken from README.md under its heading and executed after a prelude that
defines what the text assumes: a small classifier ``loss_fn`` with its ``params``, ``batch``
and ``key``, an ``optimizer``, and ``n``, ``alpha``, ``mean_nll`` for the Laplace example.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

README = (Path(__file__).parent.parent / "README.md").read_text()

PRELUDE = """
import jax
import jax.numpy as jnp
import curvax

def loss_fn(params, batch):
    x, y = batch
    logits = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    curvax.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(-jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 3), axis=-1))

key = jax.random.PRNGKey(0)
k = jax.random.split(key, 4)
params = {"w1": jax.random.normal(k[0], (6, 8)) / 2, "b1": jnp.zeros(8), "w2": jax.random.normal(k[1], (8, 3)) / 2}
batch = (jax.random.normal(k[2], (32, 6)), jax.random.randint(k[3], (32,), 0, 3))
n, alpha = 32, 1.0
mean_nll = loss_fn(params, batch)
optimizer = curvax.Optimizer(jax.value_and_grad(loss_fn), l2_reg=1e-3, use_adaptive_learning_rate=True,
                             use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1.0,
                             num_burnin_steps=0)
"""


def example(heading: str) -> str:
    """The first ```python block under ``## heading`` (before the next ``## `` heading)."""
    start = README.index(f"\n## {heading}\n")
    end = README.find("\n## ", start + 1)
    section = README[start: end if end > 0 else None]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python example under '{heading}'"
    return match.group(1)


def run(heading: str) -> dict:
    scope: dict = {}
    exec(PRELUDE, scope)
    exec(example(heading), scope)
    return scope


def test_optax_example_trains():
    scope = run("With Optax")
    params, opt_state = scope["params"], scope["opt_state"]
    losses = []
    for _ in range(5):
        params, opt_state, loss = scope["train_step"](params, opt_state, scope["batch"])
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_laplace_example_runs(x64):
    scope = run("Laplace approximations")
    deltas = scope["deltas"]
    for d, p in zip(jax.tree_util.tree_leaves(deltas), jax.tree_util.tree_leaves(scope["params"])):
        assert d.shape == (10, *p.shape) and bool(jnp.all(jnp.isfinite(d)))
    est, state, alpha, n = scope["est"], scope["state"], scope["alpha"], scope["n"]
    logdet = scope["laplace"].log_determinant(est, state, identity_weight=alpha, scale=n)
    _, want = jnp.linalg.slogdet(n * est.to_dense_matrix(state) + alpha * jnp.eye(est.dim))
    np.testing.assert_allclose(logdet, want, rtol=1e-8)
    variances = jnp.concatenate([jnp.ravel(v) for v in jax.tree_util.tree_leaves(scope["variances"])])
    inverse = jnp.linalg.inv(n * est.to_dense_matrix(state) + alpha * jnp.eye(est.dim))
    np.testing.assert_allclose(variances, jnp.diag(inverse), rtol=1e-8)


def test_several_devices_example_steps():
    scope = run("Several devices and hosts")
    assert np.isfinite(float(scope["stats"]["loss"]))
    assert scope["optimizer"].trace_count == 1



MNIST_PRELUDE = """
import jax
import jax.numpy as jnp
import curvax
from curvax import datasets

images = jnp.asarray(datasets.load_mnist_images(2000))
labels = jnp.asarray(datasets.load_mnist_labels(2000))

def loss_fn(params, batch):
    x, y = batch
    logits = jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    curvax.register_softmax_cross_entropy_loss(logits, y)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

k1, k2 = jax.random.split(jax.random.PRNGKey(0))
params = {"w1": jax.random.normal(k1, (784, 128)) / 28, "b1": jnp.zeros(128),
          "w2": jax.random.normal(k2, (128, 10)) / 11, "b2": jnp.zeros(10)}
batch = (images[:128], labels[:128])
"""


def test_optax_example_values_train_an_mnist_mlp():
    # The README's damping, learning rate and momentum, on a real problem: an MNIST MLP with
    # minibatches. (Values that only work on a toy model once made the README diverge here.)
    scope: dict = {}
    exec(MNIST_PRELUDE, scope)
    exec(example("With Optax"), scope)
    params, opt_state = scope["params"], scope["opt_state"]
    images, labels = scope["images"], scope["labels"]
    losses = []
    for i in range(150):
        j = (i * 128) % (2000 - 128)
        params, opt_state, loss = scope["train_step"](params, opt_state, (images[j:j + 128], labels[j:j + 128]))
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and max(losses) <= losses[0] * 1.05
    assert float(scope["loss_fn"](params, (images, labels))) < 0.05
