"""Benchmark: the K-FAC loss curve of the MNIST autoencoder in bfloat16 against float32.

All runs start from the same parameters (the float32 initialisation rounded to bfloat16) and
train on the same images (rounded to bfloat16) with kfac-jax's adaptive autoencoder settings
(``curvax.autoencoder.make_kfac``). The bfloat16 runs keep bfloat16 parameters and activations;
their curvature statistics and inverses are float32 (curvax's default for half precision). One
computes the whole loss in bfloat16, the other casts the logits to float32 first. Writes
each step's loss, the largest relative gap between the curves, the dtypes of the bfloat16 run's
parameters and statistics, and the machine's load average. Loss curves only: no timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import curvax
from curvax import autoencoder, datasets


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), tree)


def float32_head_loss(params: Any, images: jax.Array) -> jax.Array:
    """``autoencoder.loss_fn`` with the logits cast to float32 before the loss: the usual mixed
    precision recipe (the sum over 784 pixels of a bfloat16 loss keeps 8 significant bits)."""
    logits = autoencoder.logits_fn(params, images).astype(jnp.float32)
    targets = images.astype(jnp.float32)
    curvax.register_sigmoid_cross_entropy_loss(logits, targets)
    return autoencoder.cross_entropy(logits, targets) + 0.5 * autoencoder.L2_REG * curvax.utils.inner_product(params, params)


def curve(params: Any, images: jax.Array, steps: int, seed: int, loss_fn: Any = autoencoder.loss_fn) -> tuple[list[float], Any, Any]:
    """The per-step losses of adaptive K-FAC, and the final parameters and optimizer state."""
    opt = autoencoder.make_kfac(adaptive=True, value_and_grad_func=jax.value_and_grad(loss_fn))
    state = opt.init(params, jax.random.PRNGKey(seed), images)
    losses = []
    for i in range(steps):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(seed + 1 + i), batch=images, global_step_int=None)
        losses.append(float(stats["loss"]))
    return losses, params, state


def dtypes(tree: Any) -> list[str]:
    return sorted({str(x.dtype) for x in jax.tree_util.tree_leaves(tree)})


def run(num_images: int, steps: int, seed: int) -> dict[str, Any]:
    images = _cast(_cast(jnp.asarray(datasets.load_mnist_images(num_images)), jnp.bfloat16), jnp.float32)
    params = _cast(_cast(autoencoder.init_params(jax.random.PRNGKey(seed)), jnp.bfloat16), jnp.float32)
    load_before = os.getloadavg()
    f32, _, _ = curve(params, images, steps, seed)
    bf16, p_half, state = curve(_cast(params, jnp.bfloat16), _cast(images, jnp.bfloat16), steps, seed)
    head, _, _ = curve(_cast(params, jnp.bfloat16), _cast(images, jnp.bfloat16), steps, seed, float32_head_loss)
    gaps = [abs(b - f) / abs(f) for b, f in zip(bf16, f32)]
    head_gaps = [abs(b - f) / abs(f) for b, f in zip(head, f32)]
    return {
        "model": "MNIST autoencoder 784-1000-500-250-30-250-500-1000-784, adaptive K-FAC (make_kfac)",
        "num_images": num_images,
        "steps": steps,
        "seed": seed,
        "loss_float32": f32,
        "loss_bfloat16": bf16,
        "loss_bfloat16_float32_head": head,
        "max_relative_gap": max(gaps),
        "final_relative_gap": gaps[-1],
        "max_relative_gap_float32_head": max(head_gaps),
        "final_relative_gap_float32_head": head_gaps[-1],
        "bfloat16_run_param_dtypes": dtypes(p_half),
        "bfloat16_run_statistics_dtypes": dtypes(state.estimator_state),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "platform": platform.platform(),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-images", type=int, default=500)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=str(Path(__file__).parent / "results" / "mixed_precision.json"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="num_burnin_steps")  # the burn-in reuses the one batch, by design
    result = run(args.num_images, args.steps, args.seed)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if "loss" in k or "gap" in k}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
