"""Memory of a K-FAC operator's ``trace``/``logdet``/``frobenius_norm`` at size, from compiled
memory analysis on abstract shapes (nothing materialised): the temporary memory is a small
fraction of the factors' bytes, and nothing of the dense ``dim x dim`` size is ever allocated.
A bound on bytes (deterministic for a given XLA), not a timing."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import curvax
from curvax import operators as ops


def _load_benchmark() -> ModuleType:
    """``benchmarks/operator_memory.py``, whose transformer this test measures at a small size."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "operator_memory.py"
    spec = importlib.util.spec_from_file_location("curvax_benchmarks_operator_memory", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


operator_memory = _load_benchmark()


def test_trace_and_logdet_of_an_abstract_transformer_fit_in_the_factors_memory():
    d, ff, layers, vocab = 256, 1024, 3, 512  # ~2.6M parameters, 19 Kronecker blocks
    # The benchmark's model and abstract state: float32, 2 sequences of 8 tokens.
    est, state, params = operator_memory.abstract_kfac(d, ff, layers, vocab, batch=2, seq=8)
    # Dense layers over the sequence axis: the repeated-dense block (kfac-jax's for them).
    assert [type(b).__name__ for b in est.blocks] == ["RepeatedDenseKroneckerFactored"] * (6 * layers + 1)
    n = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
    factor_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))
    largest = max(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))
    assert factor_bytes < 4 * n * n / 1000  # the factors are far smaller than the dense matrix

    def temp_bytes(fn: Any) -> tuple[int, int]:
        mem = jax.jit(lambda st: fn(ops.from_estimator(est, st))).lower(state).compile().memory_analysis()
        return int(mem.temp_size_in_bytes), int(mem.argument_size_in_bytes)

    for name, fn in [("trace", lambda K: K.trace()), ("frobenius_norm", lambda K: K.frobenius_norm())]:
        temp, args = temp_bytes(fn)
        assert args <= factor_bytes and temp <= 0.01 * factor_bytes, (name, temp, factor_bytes)
    for name, fn in [("logdet", lambda K: K.logdet()), ("logdet_damped", lambda K: K.logdet(1e-3)),
                     ("det", lambda K: K.det(1e-3))]:
        temp, args = temp_bytes(fn)
        # one eigendecomposition workspace per factor shape, reused across the layers (lax.scan)
        assert temp <= 0.5 * factor_bytes and temp <= 4 * largest, (name, temp, factor_bytes, largest)


def _mlp_loss(p: Any, batch: Any) -> jax.Array:
    x = batch[0]
    for i, (w, b) in enumerate(p):
        x = x @ w + b
        x = jnp.tanh(x) if i < len(p) - 1 else x
    curvax.register_squared_error_loss(x, batch[1])
    return jnp.mean(jnp.sum((x - batch[1]) ** 2, axis=-1))


def test_logdet_over_same_shaped_layers_equals_the_dense_one_in_jit_vmap_and_grad():
    """Same-shaped Kronecker blocks go through one ``lax.scan`` in ``logdet``: its values."""
    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.PRNGKey(0), 5)
        params = [(jax.random.normal(keys[i], (4, 4)) / 2, 0.1 * jnp.ones(4)) for i in range(3)]
        batch = (jax.random.normal(keys[3], (16, 4)), jax.random.normal(keys[4], (16, 4)))
        K = ops.kfac(_mlp_loss, params, batch, fisher_type="type-2", separate_weight_and_bias=False)
        dense = np.asarray(K.to_dense())
        n = dense.shape[0]
        want = lambda d: np.linalg.slogdet(dense + d * np.eye(n))[1]  # noqa: E731
        damps = jnp.asarray([1e-3, 0.1, 1.0])
        got = jax.jit(jax.vmap(lambda d: K.logdet(d)))(damps)
        np.testing.assert_allclose(got, [want(float(d)) for d in damps], rtol=1e-10)
        np.testing.assert_allclose(jax.jit(lambda K: K.logdet())(K), want(0.0), rtol=1e-9)
        # d/dd logdet(K + d I) = tr((K + d I)^-1)
        np.testing.assert_allclose(jax.grad(lambda d: K.logdet(d))(0.1), np.trace(np.linalg.inv(dense + 0.1 * np.eye(n))),
                                   rtol=1e-9)
        # a power and the inverse keep the same path: logdet(K^-1 + 0) = -logdet(K + d I)
        np.testing.assert_allclose(jax.jit(lambda K: K.inverse(0.1).logdet())(K), -want(0.1), rtol=1e-10)
