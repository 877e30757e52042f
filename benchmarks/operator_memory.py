"""Benchmark: compiled memory of a K-FAC operator's ``trace``/``logdet``/... at ~100M parameters.

Nothing is materialised: the parameters and the batch are ``jax.ShapeDtypeStruct``s, the K-FAC
state comes from ``jax.eval_shape`` of the estimator's ``init``, and each operator method is
compiled with ``jax.jit(...).lower(state).compile()``; XLA's ``memory_analysis()`` gives its
argument bytes (the factors) and temporary bytes. The model is a pre-norm-free transformer
stack (q, k, v, o, up, down dense layers with biases per layer, a linear head), float32.

    python benchmarks/operator_memory.py                      # d=1024, ff=4096, 8 layers: ~101M
    python benchmarks/operator_memory.py --layers 2 --d-model 256 --d-ff 1024 --output /tmp/x.json

Writes JSON (default ``benchmarks/results/operator_memory.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import curvax
from curvax import operators as ops


def transformer_params(d: int, ff: int, layers: int, vocab: int, dtype: Any = jnp.float32) -> dict:
    """Abstract parameters of the transformer stack."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    dense = lambda i, o: {"w": s(i, o), "b": s(o)}  # noqa: E731
    blocks = [{"q": dense(d, d), "k": dense(d, d), "v": dense(d, d), "o": dense(d, d),
               "up": dense(d, ff), "down": dense(ff, d)} for _ in range(layers)]
    return {"layers": blocks, "head": dense(d, vocab)}


def transformer_loss(p: Any, batch: Any) -> jax.Array:
    """Single-head self-attention + GELU MLP per layer, residual connections, softmax cross-entropy."""
    x, y = batch
    for layer in p["layers"]:
        q, k, v = (x @ layer[n]["w"] + layer[n]["b"] for n in ("q", "k", "v"))
        att = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1]), axis=-1) @ v
        x = x + (att @ layer["o"]["w"] + layer["o"]["b"])
        x = x + (jax.nn.gelu(x @ layer["up"]["w"] + layer["up"]["b"]) @ layer["down"]["w"] + layer["down"]["b"])
    logits = x @ p["head"]["w"] + p["head"]["b"]
    curvax.register_softmax_cross_entropy_loss(logits, y)
    return jnp.mean(-jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, logits.shape[-1]), axis=-1))


def abstract_kfac(d: int, ff: int, layers: int, vocab: int, batch: int = 2, seq: int = 8) -> tuple:
    """The estimator and the abstract K-FAC state (``ShapeDtypeStruct`` leaves) of the model."""
    params = transformer_params(d, ff, layers, vocab)
    data = (jax.ShapeDtypeStruct((batch, seq, d), jnp.float32), jax.ShapeDtypeStruct((batch, seq), jnp.int32))
    est = curvax.BlockDiagonalCurvature(transformer_loss)
    state = jax.eval_shape(lambda p, b: est.init(jax.random.PRNGKey(0), (p, b), None, None), params, data)
    return est, state, params


METHODS = {
    "trace": lambda K: K.trace(),
    "frobenius_norm": lambda K: K.frobenius_norm(),
    "logdet": lambda K: K.logdet(),
    "logdet_damped": lambda K: K.logdet(1e-3),
}


def measure(est: Any, state: Any, methods: dict = METHODS) -> dict:
    """Per method: compiled argument / temporary / output bytes and the compile time."""
    out = {}
    for name, fn in methods.items():
        t0 = time.perf_counter()
        compiled = jax.jit(lambda s, fn=fn: fn(ops.from_estimator(est, s))).lower(state).compile()
        mem = compiled.memory_analysis()
        out[name] = {"argument_bytes": int(mem.argument_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
                     "output_bytes": int(mem.output_size_in_bytes), "compile_s": round(time.perf_counter() - t0, 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--d-ff", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "operator_memory.json"))
    args = parser.parse_args()
    est, state, params = abstract_kfac(args.d_model, args.d_ff, args.layers, args.vocab)
    n = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
    factor_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))
    largest = max(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))
    results = measure(est, state)
    for r in results.values():
        r["temp_over_factor_bytes"] = round(r["temp_bytes"] / factor_bytes, 4)
        r["peak_over_factor_bytes"] = round((r["temp_bytes"] + r["argument_bytes"]) / factor_bytes, 4)
    report = {
        "model": {"d_model": args.d_model, "d_ff": args.d_ff, "layers": args.layers, "vocab": args.vocab,
                  "dtype": "float32", "num_parameters": n, "num_blocks": est.num_blocks,
                  "block_types": sorted({type(b).__name__ for b in est.blocks})},
        "factor_bytes": int(factor_bytes),
        "largest_factor_bytes": int(largest),
        "dense_matrix_bytes": 4 * n * n,
        "methods": results,
        "jax": jax.__version__, "backend": jax.default_backend(), "machine": platform.machine(),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
