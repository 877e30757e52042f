"""Differential test: the same K-FAC steps with kfac-jax 0.0.8 and with curvax, in float64.

Each backend runs in a child process of its own (``--child kfac_jax`` imports the released
kfac-jax; ``--child curvax`` does ``import curvax as kfac_jax``), with the same model code, the
same float64 initial parameters and batches (NumPy, seeded), the same PRNG keys per step and the
same optimizer arguments (burn-in batches read from the same ``data_iterator``). Each child writes, per configuration and step, the loss, the
optimizer's learning rate, momentum and damping, and every parameter (as exact float64 numbers);
the parent compares them and writes, per configuration and step, the largest absolute parameter
difference ``max |p_curvax - p_kfac_jax|``, the relative one (that divided by ``max |p_kfac_jax|``),
the largest elementwise relative difference, and both losses.

Every scalar entry of the step's stats (``include_norms_in_stats=True``: ``param_norm``,
``precon_grad_norm``, ``update_norm``, ..., and ``precon_damping``, ``rho``, ...) is compared as
well: per configuration the largest relative difference of each, and the keys only one backend
returns.

Configurations (``CONFIGS``): an MLP (tanh, softmax cross-entropy) and a CNN (conv, LayerNorm
as normalise-then-``x * scale + shift``, ReLU, average pooling, dense, softmax cross-entropy),
both in plain JAX so that kfac-jax's automatic registration and curvax's detection see the same
program; fixed coefficients (``learning_rate``/``momentum``/``damping`` passed to ``step``),
adaptive ones (``use_adaptive_learning_rate``/``momentum``/``damping``) and schedules (of the
step, or of ``data_seen``); exact curvature
(``ggn_exact``, ``fisher_exact``) and sampled (``fisher_gradients``: labels drawn from the model;
``ggn_curvature_prop`` and ``fisher_curvature_prop``: curvature propagation with random sign
vectors), with the same step keys in both. Then the blocks' edge cases (``EDGE_CASES``): layers
with one output or one input (1 x 1 Kronecker factors), a dense layer over an extra axis with and
without padding, scale-and-shift (vector and scalar scale), strided and VALID convolutions, a
shared and an unused parameter, two losses, per-position logits with a mask, the other block
classes (full, diagonal, TNT, naive, scaled identity) and optimizer options (``norm_constraint``,
``min_damping``/``max_damping``, ``precon_damping_mult``, ``curvature_update_period``,
``inverse_update_period``, ``use_exact_inverses``, ``norm_to_scale_identity_weight_per_block``).
The differences that remain are explained in ``EMPIRICAL_FISHER``, ``SEQUENCE_LOGITS`` and
``BLOCK_NORM_CACHE`` and in docs/migration/kfac_jax.md (a repeated dense layer's bias row with
padding: ``repeated_dense_masked*``).

kfac-jax 0.0.8 needs JAX <= 0.9.1 (its jaxpr interpreter fails on newer JAX); run this script with
the interpreter of such an environment, with curvax importable (this checkout is put on the
children's ``PYTHONPATH``)::

    python3 -m venv /tmp/kfj && /tmp/kfj/bin/pip install "jax==0.9.0" "jaxlib==0.9.0" kfac-jax==0.0.8 optax
    /tmp/kfj/bin/python benchmarks/kfac_jax_differential.py           # ~12 minutes on 2 CPU cores
    /tmp/kfj/bin/python benchmarks/kfac_jax_differential.py --configs mlp_fixed_ggn --steps 3

``--curvax-python`` runs the curvax child with another interpreter (e.g. a newer JAX): the
numbers then include the two JAX versions' own rounding differences. Results go to
``benchmarks/results/kfac_jax_differential.json``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

BATCH = 16
CLASSES = 4
BINARY = dict(learning_rate=0.0625, momentum=0.5, damping=0.125)
# name -> model, coefficients (fixed: passed to step; adaptive: the optimizer's own), estimation mode.
CONFIGS: dict[str, dict[str, Any]] = {
    # Exact curvature: no randomness in the step, so the runs must agree to rounding.
    "mlp_fixed_ggn_exact": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact"),
    "mlp_adaptive_ggn_exact": dict(model="mlp", mode="adaptive", estimation_mode="ggn_exact"),
    "mlp_fixed_fisher_exact": dict(model="mlp", mode="fixed", estimation_mode="fisher_exact"),
    "mlp_adaptive_fisher_exact": dict(model="mlp", mode="adaptive", estimation_mode="fisher_exact"),
    "cnn_ln_fixed_ggn_exact": dict(model="cnn_ln", mode="fixed", estimation_mode="ggn_exact"),
    "cnn_ln_adaptive_ggn_exact": dict(model="cnn_ln", mode="adaptive", estimation_mode="ggn_exact"),
    # The same with coefficients that float32 represents exactly (FLOAT32_NOTE): powers of two for
    # the learning rate, momentum, damping and l2_reg (2^-13 ~ 1.2e-4), and adaptive damping
    # multiplied or divided by 2 (damping_adaptation_decay=0.5).
    "mlp_fixed_ggn_exact_binary_coefficients": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", fixed=BINARY, optimizer=dict(l2_reg=2.0**-13)),
    "cnn_ln_fixed_ggn_exact_binary_coefficients": dict(model="cnn_ln", mode="fixed", estimation_mode="ggn_exact", fixed=BINARY, optimizer=dict(l2_reg=2.0**-13)),
    "mlp_adaptive_ggn_exact_binary_damping": dict(model="mlp", mode="adaptive", estimation_mode="ggn_exact", optimizer=dict(damping_adaptation_decay=0.5, l2_reg=2.0**-13)),
    "cnn_ln_adaptive_ggn_exact_binary_damping": dict(model="cnn_ln", mode="adaptive", estimation_mode="ggn_exact", optimizer=dict(damping_adaptation_decay=0.5, l2_reg=2.0**-13)),
    # Sampled curvature, the same step keys: equal only where both libraries draw the same samples.
    "mlp_fixed_fisher_gradients": dict(model="mlp", mode="fixed", estimation_mode="fisher_gradients"),
    "mlp_fixed_ggn_curvature_prop": dict(model="mlp", mode="fixed", estimation_mode="ggn_curvature_prop"),
    "mlp_fixed_fisher_curvature_prop": dict(model="mlp", mode="fixed", estimation_mode="fisher_curvature_prop"),
    "mlp_adaptive_fisher_gradients": dict(model="mlp", mode="adaptive", estimation_mode="fisher_gradients"),
    "cnn_ln_fixed_fisher_gradients": dict(model="cnn_ln", mode="fixed", estimation_mode="fisher_gradients"),
    # The same sampled runs with kfac-jax handed, each step, the key curvax's estimator samples with
    # (KEY_ALIGNMENT), and no burn-in (whose keys the two libraries also derive differently).
    "mlp_fixed_fisher_gradients_keys_aligned": dict(model="mlp", mode="fixed", estimation_mode="fisher_gradients", align_keys=True),
    "mlp_fixed_ggn_curvature_prop_keys_aligned": dict(model="mlp", mode="fixed", estimation_mode="ggn_curvature_prop", align_keys=True),
    "mlp_adaptive_fisher_gradients_keys_aligned": dict(model="mlp", mode="adaptive", estimation_mode="fisher_gradients", align_keys=True),
    "cnn_ln_fixed_fisher_gradients_keys_aligned": dict(model="cnn_ln", mode="fixed", estimation_mode="fisher_gradients", align_keys=True),
    # Edge cases of the curvature blocks (EDGE_CASES), all with exact curvature.
    "one_out_squared_fixed_ggn_exact": dict(model="one_out_squared", mode="fixed", estimation_mode="ggn_exact"),
    "one_out_squared_adaptive_ggn_exact": dict(model="one_out_squared", mode="adaptive", estimation_mode="ggn_exact"),
    "one_out_normal_fixed_fisher_exact": dict(model="one_out_normal", mode="fixed", estimation_mode="fisher_exact"),
    "one_out_squared_fixed_ggn_exact_period3": dict(model="one_out_squared", mode="fixed", estimation_mode="ggn_exact", optimizer=dict(inverse_update_period=3)),
    "one_in_no_bias_fixed_ggn_exact": dict(model="one_in_no_bias", mode="fixed", estimation_mode="ggn_exact"),
    "one_in_no_bias_adaptive_ggn_exact": dict(model="one_in_no_bias", mode="adaptive", estimation_mode="ggn_exact"),
    "repeated_dense_fixed_ggn_exact": dict(model="repeated_dense", mode="fixed", estimation_mode="ggn_exact"),
    "repeated_dense_adaptive_ggn_exact": dict(model="repeated_dense", mode="adaptive", estimation_mode="ggn_exact"),
    "repeated_dense_masked_fixed_ggn_exact": dict(model="repeated_dense_masked", mode="fixed", estimation_mode="ggn_exact"),
    "repeated_dense_masked_adaptive_ggn_exact": dict(model="repeated_dense_masked", mode="adaptive", estimation_mode="ggn_exact"),
    "repeated_dense_masked_no_bias_fixed_ggn_exact": dict(model="repeated_dense_masked_no_bias", mode="fixed", estimation_mode="ggn_exact"),
    "scale_shift_fixed_ggn_exact": dict(model="scale_shift", mode="fixed", estimation_mode="ggn_exact"),
    "scale_shift_full_fixed_ggn_exact": dict(model="scale_shift", mode="fixed", estimation_mode="ggn_exact", blocks={"scale_and_shift": "ScaleAndShiftFull"}),
    "shared_weight_fixed_ggn_exact": dict(model="shared_weight", mode="fixed", estimation_mode="ggn_exact"),
    "unused_param_fixed_ggn_exact": dict(model="unused_param", mode="fixed", estimation_mode="ggn_exact"),
    "unused_param_adaptive_ggn_exact": dict(model="unused_param", mode="adaptive", estimation_mode="ggn_exact"),
    # Other block types for the same layers.
    "mlp_dense_full_fixed_ggn_exact": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", blocks={"dense": "DenseFull"}),
    "mlp_dense_diagonal_fixed_ggn_exact": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", blocks={"dense": "DenseDiagonal"}),
    "mlp_generic_only_fixed_ggn_exact": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", optimizer=dict(register_only_generic=True)),
    "cnn_ln_conv_diagonal_fixed_ggn_exact": dict(model="cnn_ln", mode="fixed", estimation_mode="ggn_exact", blocks={"conv2d": "Conv2DDiagonal"}),
    "cnn_ln_conv_full_fixed_ggn_exact": dict(model="cnn_ln", mode="fixed", estimation_mode="ggn_exact", blocks={"conv2d": "Conv2DFull"}),
    "mlp_generic_naive_full_fixed_ggn_exact": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", blocks={"generic": "NaiveFull"}, optimizer=dict(register_only_generic=True)),
    "mlp_generic_naive_tnt_fixed_ggn_exact": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", blocks={"generic": "NaiveTNT"}, optimizer=dict(register_only_generic=True)),
    "scale_shift_scaled_identity_fixed_ggn_exact": dict(model="scale_shift", mode="fixed", estimation_mode="ggn_exact", blocks={"scale_and_shift": "ScaledIdentity"}),
    "mlp_dense_full_adaptive_ggn_exact": dict(model="mlp", mode="adaptive", estimation_mode="ggn_exact", blocks={"dense": "DenseFull"}),
    "mlp_tnt_fixed_ggn_exact": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", blocks={"dense": "DenseTNT"}),
    # Optimizer options.
    "mlp_fixed_ggn_exact_norm_constraint": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", optimizer=dict(norm_constraint=1e-3)),
    "mlp_fixed_ggn_exact_per_param_norms": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", optimizer=dict(include_per_param_norms_in_stats=True)),
    "mlp_schedule_ggn_exact": dict(model="mlp", mode="schedule", estimation_mode="ggn_exact"),
    "mlp_schedule_ggn_exact_period3": dict(model="mlp", mode="schedule", estimation_mode="ggn_exact", optimizer=dict(inverse_update_period=3)),
    "mlp_fixed_fisher_empirical": dict(model="mlp", mode="fixed", estimation_mode="fisher_empirical"),
    "mlp_fixed_ggn_exact_exact_inverses": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", optimizer=dict(use_exact_inverses=True)),
    "mlp_adaptive_ggn_exact_min_damping": dict(model="mlp", mode="adaptive", estimation_mode="ggn_exact", optimizer=dict(min_damping=0.6, damping_adaptation_decay=0.5, damping_adaptation_interval=1)),
    "mlp_adaptive_ggn_exact_precon_damping_mult": dict(model="mlp", mode="adaptive", estimation_mode="ggn_exact", optimizer=dict(precon_damping_mult=2.0, include_damping_in_quad_change=True)),
    "mlp_fixed_ggn_exact_curvature_period2": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", optimizer=dict(curvature_update_period=2, inverse_update_period=2)),
    "mlp_schedule_data_seen_ggn_exact": dict(model="mlp", mode="schedule", estimation_mode="ggn_exact", data_seen=True),
    "mlp_schedule_adaptive_damping_ggn_exact": dict(model="mlp", mode="schedule", estimation_mode="ggn_exact", optimizer=dict(
        damping_schedule=None, use_adaptive_damping=True, initial_damping=1.0, damping_adaptation_interval=1, max_damping=1.5)),
    "mlp_schedule_adaptive_damping_exact_qmodel_ggn_exact": dict(model="mlp", mode="schedule", estimation_mode="ggn_exact", optimizer=dict(
        damping_schedule=None, use_adaptive_damping=True, initial_damping=1.0, damping_adaptation_interval=1,
        always_use_exact_qmodel_for_damping_adjustment=True)),
    "two_losses_fixed_ggn_exact": dict(model="two_losses", mode="fixed", estimation_mode="ggn_exact"),
    "two_losses_adaptive_fisher_exact": dict(model="two_losses", mode="adaptive", estimation_mode="fisher_exact"),
    "one_out_sigmoid_fixed_fisher_exact": dict(model="one_out_sigmoid", mode="fixed", estimation_mode="fisher_exact"),
    "one_out_sigmoid_adaptive_ggn_exact": dict(model="one_out_sigmoid", mode="adaptive", estimation_mode="ggn_exact"),
    "conv_valid_no_bias_fixed_ggn_exact": dict(model="conv_valid_no_bias", mode="fixed", estimation_mode="ggn_exact"),
    "conv_valid_no_bias_diagonal_fixed_ggn_exact": dict(model="conv_valid_no_bias", mode="fixed", estimation_mode="ggn_exact", blocks={"conv2d": "Conv2DDiagonal"}),
    # kfac-jax 0.0.8's TNT block for convolutions (per-location weights, fixed scale T).
    "cnn_ln_conv_tnt_fixed_ggn_exact": dict(model="cnn_ln", mode="fixed", estimation_mode="ggn_exact", blocks={"conv2d": "Conv2DTNT"}),
    "conv_valid_no_bias_tnt_fixed_ggn_exact": dict(model="conv_valid_no_bias", mode="fixed", estimation_mode="ggn_exact", blocks={"conv2d": "Conv2DTNT"}),
    "cnn_ln_conv_tnt_per_example_fixed_ggn_exact": dict(model="cnn_ln", mode="fixed", estimation_mode="ggn_exact",
                                                        blocks={"conv2d": ("Conv2DTNT", {"weighting_per_location": False})}),
    # curvax's empirical Fisher is B times kfac-jax's (docs/migration/kfac_jax.md, EMPIRICAL_FISHER):
    # with l2_reg, damping and learning rate B times larger curvax takes kfac-jax's steps.
    "mlp_fixed_fisher_empirical_rescaled": dict(model="mlp", mode="fixed", estimation_mode="fisher_empirical",
        curvax_optimizer=dict(l2_reg=1e-4 * BATCH), curvax_fixed=dict(learning_rate=0.05 * BATCH, damping=0.1 * BATCH)),
    "two_losses_fixed_fisher_empirical": dict(model="two_losses", mode="fixed", estimation_mode="fisher_empirical"),
    "scalar_scale_fixed_ggn_exact": dict(model="scalar_scale", mode="fixed", estimation_mode="ggn_exact"),
    "conv_strided_fixed_ggn_exact": dict(model="conv_strided", mode="fixed", estimation_mode="ggn_exact"),
    "conv_strided_adaptive_ggn_exact": dict(model="conv_strided", mode="adaptive", estimation_mode="ggn_exact"),
    "seq_masked_loss_fixed_ggn_exact": dict(model="seq_masked_loss", mode="fixed", estimation_mode="ggn_exact"),
    "seq_masked_loss_no_bias_fixed_ggn_exact": dict(model="seq_masked_loss_no_bias", mode="fixed", estimation_mode="ggn_exact"),
    # kfac-jax's exact-mode columns for logits with extra axes are wrong (SEQUENCE_LOGITS); sampled
    # modes (with the same keys) do not use them: without biases (the repeated-dense bias corner)
    # the two then agree.
    "seq_masked_loss_no_bias_fixed_fisher_gradients_keys_aligned": dict(model="seq_masked_loss_no_bias", mode="fixed", estimation_mode="fisher_gradients", align_keys=True),
    "seq_masked_loss_no_bias_fixed_ggn_curvature_prop_keys_aligned": dict(model="seq_masked_loss_no_bias", mode="fixed", estimation_mode="ggn_curvature_prop", align_keys=True),
    "seq_masked_loss_adaptive_fisher_exact": dict(model="seq_masked_loss", mode="adaptive", estimation_mode="fisher_exact"),
    "mlp_fixed_ggn_exact_norm_identity_weight": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", optimizer=dict(norm_to_scale_identity_weight_per_block="avg_diag")),
    # Each block's damping times its norm (kfac-jax's block.norm): other norms, conv and
    # scale-and-shift blocks, exact inverses served from the cache with the call-time damping.
    "mlp_fixed_ggn_exact_norm_identity_weight_fro": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", optimizer=dict(norm_to_scale_identity_weight_per_block="fro")),
    "cnn_ln_fixed_ggn_exact_norm_identity_weight_avg_fro": dict(model="cnn_ln", mode="fixed", estimation_mode="ggn_exact", optimizer=dict(norm_to_scale_identity_weight_per_block="avg_fro")),
    "mlp_fixed_ggn_exact_norm_identity_weight_exact_inverses_period3": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", optimizer=dict(norm_to_scale_identity_weight_per_block="fro", use_exact_inverses=True, inverse_update_period=3)),
    # kfac-jax 0.0.8 computes the normed damping in update_cache but bakes the plain one into the
    # cached approximate inverses (BLOCK_NORM_CACHE); curvax uses the normed one there too.
    "mlp_fixed_ggn_exact_norm_identity_weight_period3": dict(model="mlp", mode="fixed", estimation_mode="ggn_exact", optimizer=dict(norm_to_scale_identity_weight_per_block="avg_diag", inverse_update_period=3)),
}
EMPIRICAL_FISHER = (
    "fisher_empirical: kfac-jax 0.0.8 divides the cotangents w * grad(loss) by sqrt(B), so its statistics are "
    "(1/B^2) sum_n w^2 g_n g_n^T; curvax's are (1/B) sum_n w g_n g_n^T (sqrt(w) * grad(loss), the same scale as "
    "the Fisher). mlp_fixed_fisher_empirical (w = 1) differs by that; mlp_fixed_fisher_empirical_rescaled gives "
    "curvax B times kfac-jax's l2_reg, damping and learning rate, which is then the same step. "
    "two_losses_fixed_fisher_empirical (w = 0.5 on one loss) differs by both."
)
BLOCK_NORM_CACHE = (
    "norm_to_scale_identity_weight_per_block with cached approximate inverses (inverse_update_period > 1, "
    "use_exact_inverses=False): kfac-jax 0.0.8's BlockDiagonalCurvature.update_cache multiplies each block's "
    "identity weight by its norm and then passes the unmultiplied weight to block.update_cache, so its cached "
    "(pi-damped) Kronecker inverses ignore the option; curvax bakes the normed damping into them, as its "
    "products from the statistics and kfac-jax's own do. mlp_fixed_ggn_exact_norm_identity_weight_period3 "
    "differs by that; with period 1 or exact inverses (the damping applied at call time) the two agree."
)
SEQUENCE_LOGITS = (
    "seq_masked_loss* (softmax cross-entropy on logits (B, T, C)) in fisher_exact/ggn_exact: kfac-jax 0.0.8's "
    "CategoricalLogitsNegativeLogProbLoss.multiply_fisher_factor_replicated_one_hot(index) subtracts p * sqrt(p[index]) "
    "at every position, not only at the index's one, so the outer products of its columns are not the GGN of the "
    "logits (for logits (1, 2, 3): max error 0.69; curvax's: 3e-17), and its statistics differ from curvax's. "
    "With sampled curvature and the same keys (no one-hot columns) and no biases, the two agree."
)
EDGE_CASES = (
    "one_out_*: a final layer with one output (1 x 1 output factor: pi-adjusted damping gives it none, kfac-jax's "
    "scalar-factor rule); one_in_no_bias: a 1 -> 1 layer (both factors 1 x 1) and a 1 -> 8 layer, no biases; "
    "repeated_dense: one dense layer vmapped over 3 particles (RepeatedDenseKroneckerFactored, average_repeats "
    "scale); scale_shift: x * s + t and x * s (ScaleAndShiftDiagonal, or ScaleAndShiftFull); shared_weight: one "
    "matrix used by two layers; unused_param: a parameter the loss does not use; other block classes through "
    "layer_tag_to_block_ctor; and optimizer options (norm_constraint, schedules, min_damping, ...)."
)
FLOAT32_NOTE = (
    "Both libraries keep a float64 run's step coefficients (learning rate, momentum, damping) in float64. "
    "Until curvax commit 5d882e5 curvax rounded them to float32 under jax_enable_x64, which left ~1e-9 "
    "parameter differences per step; the *_binary_* runs (coefficients float32 represents exactly) were "
    "added to show that, and now agree like the others."
)
KEY_ALIGNMENT = (
    "With the same step key both libraries sample with different keys: kfac-jax 0.0.8 gives its estimator the "
    "step's key itself (optimizer._step, value_func_has_rng=False) and, with one registered loss, samples with "
    "that key unsplit (block_diagonal.py: `jax.random.split(rng_i, len(losses)) if len(losses) > 1 else "
    "[rng_i]`); curvax splits the step key (`k_est, k_func = jax.random.split(rng)`, optimizer._step_impl) and "
    "splits again per loss, one loss included (`jax.random.split(rng, max(len(losses), 1))`, "
    "estimators.loss_cotangents). The burn-in keys differ likewise. The *_keys_aligned runs hand kfac-jax "
    "`split(split(key)[0], 1)[0]` and use num_burnin_steps=0, so that both draw the same samples."
)
SAMPLED = {"fisher_gradients", "fisher_curvature_prop", "ggn_curvature_prop"}  # curvature propagation: random signs

FIXED = dict(learning_rate=0.05, momentum=0.5, damping=0.1)


# --- the child: one backend, every configuration ------------------------------------------


def _models(jnp, jax, kfac_jax):
    """Per model: ``init(rng) -> params`` (NumPy float64), ``loss(params, batch)`` (registers its
    loss with ``kfac_jax``) and ``batch(step)``; all in plain JAX, seeded NumPy data."""
    import numpy as np

    def dense_init(rng, n_in, n_out, bias=True):
        p = {"w": rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)}
        if bias:
            p["b"] = 0.1 * rng.normal(size=(n_out,))
        return p

    def dense(p, x):
        y = x @ p["w"]
        return y + p["b"] if "b" in p else y

    def softmax_xent(logits, y):
        kfac_jax.register_softmax_cross_entropy_loss(logits, y)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def squared_error(pred, y):  # kfac-jax's value of it: sum((y - pred)^2) / batch
        kfac_jax.register_squared_error_loss(pred, y)
        return jnp.sum((pred - y) ** 2) / pred.shape[0]

    def normal_nll(mean, y):  # variance 0.5: the same curvature as squared_error
        kfac_jax.register_normal_predictive_distribution(mean, y, variance=0.5)
        return jnp.sum((mean - y) ** 2) / mean.shape[0]

    def data(step, x_shape, target):
        rng = np.random.default_rng(1000 + step)
        x = rng.normal(size=(BATCH, *x_shape))
        y = rng.integers(0, CLASSES, size=(BATCH,)) if target == "class" else rng.normal(size=(BATCH, 1))
        return jnp.asarray(x), jnp.asarray(y)

    def mlp_init(rng):
        return {"l0": dense_init(rng, 6, 12), "l1": dense_init(rng, 12, 8), "l2": dense_init(rng, 8, CLASSES)}

    def mlp_loss(p, batch):
        x, y = batch
        h = jnp.tanh(dense(p["l0"], x))
        h = jnp.tanh(dense(p["l1"], h))
        return softmax_xent(dense(p["l2"], h), y)

    def cnn_init(rng):
        return {
            "conv": {"w": rng.normal(size=(3, 3, 2, 4)) / np.sqrt(18), "b": 0.1 * rng.normal(size=(4,))},
            "ln": {"scale": 1.0 + 0.1 * rng.normal(size=(4,)), "shift": 0.1 * rng.normal(size=(4,))},
            "out": dense_init(rng, 4 * 3 * 3, CLASSES),
        }

    def cnn_loss(p, batch):
        x, t = batch
        y = jax.lax.conv_general_dilated(x, p["conv"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = y + p["conv"]["b"]
        mean = jnp.mean(y, axis=-1, keepdims=True)
        var = jnp.mean((y - mean) ** 2, axis=-1, keepdims=True)
        y = (y - mean) * jax.lax.rsqrt(var + 1e-5)
        y = y * p["ln"]["scale"] + p["ln"]["shift"]
        y = jax.nn.relu(y)
        y = jax.lax.reduce_window(y, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0
        y = y.reshape(y.shape[0], -1)
        return softmax_xent(dense(p["out"], y), t)

    # A final layer with one output (a 1 x 1 output factor), squared error or normal predictive.
    def one_out_init(rng):
        return {"l0": dense_init(rng, 6, 12), "l1": dense_init(rng, 12, 8), "l2": dense_init(rng, 8, 1)}

    def one_out_body(p, x):
        h = jnp.tanh(dense(p["l0"], x))
        h = jnp.tanh(dense(p["l1"], h))
        return dense(p["l2"], h)

    # One input: a 1 -> 1 layer without bias (both factors 1 x 1), a 1 -> 8 layer without bias
    # (a 1 x 1 input factor), then 8 -> CLASSES.
    def one_in_init(rng):
        return {"a": dense_init(rng, 1, 1, bias=False), "b": dense_init(rng, 1, 8, bias=False), "c": dense_init(rng, 8, CLASSES)}

    def one_in_loss(p, batch):
        x, y = batch
        h = jnp.tanh(dense(p["a"], x) + 0.5)
        h = jnp.tanh(dense(p["b"], h))
        return softmax_xent(dense(p["c"], h), y)

    # The same weights over an extra axis (particles): a repeated dense layer, in a per-example
    # function ``vmap``-ed over the batch (as a wavefunction is); then a mean over particles.
    # (``vmap`` over the particle axis instead moves the batch axis off the front: kfac-jax
    # 0.0.8 then fails an assertion that the first axis is the batch.)
    def repeated_init(rng):
        return {"emb": dense_init(rng, 6, 10), "out": dense_init(rng, 10, CLASSES)}

    def repeated_loss(p, batch):
        x, y = batch  # (batch, particles, 6)
        h = jax.vmap(lambda xs: jnp.mean(jnp.tanh(dense(p["emb"], xs)), axis=0))(x)
        return softmax_xent(dense(p["out"], h), y)

    # The same with padding: the last particle of every other example is masked out of the loss,
    # so its output cotangents are zero (RepeatedDenseKroneckerFactored's use_masking).
    def repeated_masked_loss(p, batch):
        x, y = batch
        mask = jnp.ones(x.shape[:2]).at[::2, -1].set(0.0)
        h = jax.vmap(lambda xs, ms: jnp.sum(jnp.tanh(dense(p["emb"], xs)) * ms[:, None], axis=0) / 3.0)(x, mask)
        return softmax_xent(dense(p["out"], h), y)

    # Scale-and-shift (x * s + t) and scale only (x * s) on a hidden layer.
    def scale_shift_init(rng):
        return {"l0": dense_init(rng, 6, 8), "ss": {"scale": 1.0 + 0.1 * rng.normal(size=(8,)), "shift": 0.1 * rng.normal(size=(8,))},
                "s": {"scale": 1.0 + 0.1 * rng.normal(size=(8,))}, "out": dense_init(rng, 8, CLASSES)}

    def scale_shift_loss(p, batch):
        x, y = batch
        h = jnp.tanh(dense(p["l0"], x))
        h = jnp.tanh(h * p["ss"]["scale"] + p["ss"]["shift"])
        h = h * p["s"]["scale"]
        return softmax_xent(dense(p["out"], h), y)

    # One weight matrix used by two layers, and a parameter the loss does not use.
    def shared_init(rng):
        return {"w": rng.normal(size=(6, 6)) / np.sqrt(6), "b0": 0.1 * rng.normal(size=(6,)), "b1": 0.1 * rng.normal(size=(6,)),
                "out": dense_init(rng, 6, CLASSES)}

    def shared_loss(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["w"] + p["b0"])
        h = jnp.tanh(h @ p["w"] + p["b1"])
        return softmax_xent(dense(p["out"], h), y)

    def unused_init(rng):
        return {**mlp_init(rng), "unused": {"w": rng.normal(size=(3, 2))}}

    def unused_loss(p, batch):
        return mlp_loss({k: v for k, v in p.items() if k != "unused"}, batch)

    # Two registered losses on two heads: softmax cross-entropy (weight 0.5) and a normal
    # predictive distribution with variance 2 on a one-output head.
    def two_losses_init(rng):
        return {"l0": dense_init(rng, 6, 10), "cls": dense_init(rng, 10, CLASSES), "reg": dense_init(rng, 10, 1)}

    def two_losses_loss(p, batch):
        x, y = batch
        h = jnp.tanh(dense(p["l0"], x))
        logits, mean = dense(p["cls"], h), dense(p["reg"], h)
        kfac_jax.register_softmax_cross_entropy_loss(logits, y, weight=0.5)
        ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))
        target = jnp.sum(x[:, :2], axis=1, keepdims=True)
        kfac_jax.register_normal_predictive_distribution(mean, target, variance=2.0)
        return 0.5 * ce + jnp.sum((mean - target) ** 2) / (2 * 2.0) / x.shape[0]

    # A one-output layer with a Bernoulli loss (sigmoid cross-entropy).
    def sigmoid_loss(p, batch):
        x, y = batch
        logit = one_out_body(p, x)
        t = (y > 0).astype(logit.dtype)
        kfac_jax.register_sigmoid_cross_entropy_loss(logit, t)
        return jnp.sum(jnp.maximum(logit, 0) - logit * t + jnp.log1p(jnp.exp(-jnp.abs(logit)))) / x.shape[0]

    # A strided convolution without bias and with VALID padding (9 of 36 locations), then dense.
    def conv_valid_init(rng):
        return {"conv": {"w": rng.normal(size=(2, 2, 2, 3)) / np.sqrt(8)}, "out": dense_init(rng, 3 * 3 * 3, CLASSES)}

    def conv_valid_loss(p, batch):
        x, t = batch
        y = jax.lax.conv_general_dilated(x, p["conv"]["w"], (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = jnp.tanh(y).reshape(y.shape[0], -1)
        return softmax_xent(dense(p["out"], y), t)

    # A scalar scale and a vector shift: x * a + t (a of shape ()).
    def scalar_scale_init(rng):
        return {"l0": dense_init(rng, 6, 8), "ss": {"a": np.asarray(1.1), "t": 0.1 * rng.normal(size=(8,))}, "out": dense_init(rng, 8, CLASSES)}

    def scalar_scale_loss(p, batch):
        x, y = batch
        h = jnp.tanh(dense(p["l0"], x))
        h = jnp.tanh(h * p["ss"]["a"] + p["ss"]["t"])
        return softmax_xent(dense(p["out"], h), y)

    # Strided SAME convolution with bias (6x6 -> 3x3), then a 2x2 VALID one without (3x3 -> 2x2).
    def conv_strided_init(rng):
        return {"c1": {"w": rng.normal(size=(3, 3, 2, 4)) / np.sqrt(18), "b": 0.1 * rng.normal(size=(4,))},
                "c2": {"w": rng.normal(size=(2, 2, 4, 3)) / 4.0}, "out": dense_init(rng, 2 * 2 * 3, CLASSES)}

    def conv_strided_loss(p, batch):
        x, t = batch
        dn = ("NHWC", "HWIO", "NHWC")
        y = jax.lax.conv_general_dilated(x, p["c1"]["w"], (2, 2), "SAME", dimension_numbers=dn) + p["c1"]["b"]
        y = jax.lax.conv_general_dilated(jnp.tanh(y), p["c2"]["w"], (1, 1), "VALID", dimension_numbers=dn)
        return softmax_xent(dense(p["out"], jnp.tanh(y).reshape(y.shape[0], -1)), t)

    # A loss per position with a mask (the last position of every other sequence is padding).
    def seq_init(rng):
        return {"l0": dense_init(rng, 6, 8), "out": dense_init(rng, 8, CLASSES)}

    def seq_loss(p, batch):
        x, y = batch  # (B, 3, 6); labels from the example's class and position
        labels = (y[:, None] + jnp.arange(3)[None, :]) % CLASSES
        mask = jnp.ones(x.shape[:2], bool).at[::2, -1].set(False)
        logits = dense(p["out"], jnp.tanh(dense(p["l0"], x)))
        kfac_jax.register_softmax_cross_entropy_loss(logits, labels, mask=mask)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(mask, logp, 0.0)) / x.shape[0]

    return {
        "scalar_scale": (scalar_scale_init, scalar_scale_loss, lambda i: data(i, (6,), "class")),
        "conv_strided": (conv_strided_init, conv_strided_loss, lambda i: data(i, (6, 6, 2), "class")),
        "seq_masked_loss": (seq_init, seq_loss, lambda i: data(i, (3, 6), "class")),
        "seq_masked_loss_no_bias": (lambda rng: {"l0": dense_init(rng, 6, 8, bias=False), "out": dense_init(rng, 8, CLASSES, bias=False)},
                                    seq_loss, lambda i: data(i, (3, 6), "class")),
        "two_losses": (two_losses_init, two_losses_loss, lambda i: data(i, (6,), "class")),
        "one_out_sigmoid": (one_out_init, sigmoid_loss, lambda i: data(i, (6,), "real")),
        "conv_valid_no_bias": (conv_valid_init, conv_valid_loss, lambda i: data(i, (6, 6, 2), "class")),
        "mlp": (mlp_init, mlp_loss, lambda i: data(i, (6,), "class")),
        "cnn_ln": (cnn_init, cnn_loss, lambda i: data(i, (6, 6, 2), "class")),
        "one_out_squared": (one_out_init, lambda p, b: squared_error(one_out_body(p, b[0]), b[1]), lambda i: data(i, (6,), "real")),
        "one_out_normal": (one_out_init, lambda p, b: normal_nll(one_out_body(p, b[0]), b[1]), lambda i: data(i, (6,), "real")),
        "one_in_no_bias": (one_in_init, one_in_loss, lambda i: data(i, (1,), "class")),
        "repeated_dense": (repeated_init, repeated_loss, lambda i: data(i, (3, 6), "class")),
        "repeated_dense_masked": (repeated_init, repeated_masked_loss, lambda i: data(i, (3, 6), "class")),
        "repeated_dense_masked_no_bias": (lambda rng: {"emb": dense_init(rng, 6, 10, bias=False), "out": dense_init(rng, 10, CLASSES)},
                                          repeated_masked_loss, lambda i: data(i, (3, 6), "class")),
        "scale_shift": (scale_shift_init, scale_shift_loss, lambda i: data(i, (6,), "class")),
        "shared_weight": (shared_init, shared_loss, lambda i: data(i, (6,), "class")),
        "unused_param": (unused_init, unused_loss, lambda i: data(i, (6,), "class")),
    }


# Schedules (callables of the step counter) for ``mode="schedule"`` configurations.
SCHEDULES = dict(
    learning_rate_schedule=lambda t: 0.05 / (1.0 + 0.25 * t),
    momentum_schedule=lambda t: 0.5 - 0.3 / (1.0 + t),
    damping_schedule=lambda t: 0.1 * 0.7 ** t,
)
# The same as functions of the examples seen (kfac-jax passes ``data_seen`` to a schedule that
# has a parameter of that name); the defaults would give other numbers if it were not passed.
DATA_SEEN_SCHEDULES = dict(
    learning_rate_schedule=lambda t, data_seen=0: 0.05 / (1.0 + data_seen / (4.0 * BATCH)),
    momentum_schedule=lambda t, data_seen=0: 0.5 - 0.3 / (1.0 + data_seen / BATCH),
    damping_schedule=lambda t, data_seen=0: 0.1 * 0.7 ** (data_seen / BATCH),
    precon_damping_schedule=lambda t, data_seen=0: 0.2 * 0.7 ** (data_seen / BATCH),
)


def _scalar_stats(stats: dict[str, Any], np: Any) -> dict[str, float]:
    """Every 0-d float entry of ``stats`` (nested dictionaries flattened with ``/``)."""
    out: dict[str, float] = {}
    for k, v in stats.items():
        if isinstance(v, dict):
            out.update({f"{k}/{kk}": vv for kk, vv in _scalar_stats(v, np).items()})
            continue
        a = np.asarray(v)
        if a.ndim == 0 and np.issubdtype(a.dtype, np.floating):
            out[k] = float(a)
    return out


def run_child(backend: str, configs: list[str], steps: int, out_path: Path, overrides: dict[str, Any]) -> None:
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np

    if backend == "curvax":
        import curvax

        sys.modules["kfac_jax"] = curvax
    import kfac_jax

    models = _models(jnp, jax, kfac_jax)
    results: dict[str, Any] = {"backend": backend, "module": kfac_jax.__name__, "jax": jax.__version__}
    try:
        import importlib.metadata as md

        results["kfac_jax_version"] = md.version("kfac-jax")
    except Exception:  # noqa: BLE001
        results["kfac_jax_version"] = None
    results["configs"] = {}
    for name in configs:
        cfg = CONFIGS[name]
        init, loss_fn, make_batch = models[cfg["model"]]
        params = jax.tree_util.tree_map(jnp.asarray, init(np.random.default_rng(0)))
        mode = cfg["mode"]
        adaptive = mode == "adaptive"
        kwargs = dict(
            value_and_grad_func=jax.value_and_grad(loss_fn),
            l2_reg=1e-4,
            use_adaptive_learning_rate=adaptive,
            use_adaptive_momentum=adaptive,
            use_adaptive_damping=adaptive,
            initial_damping=1.0 if adaptive else None,
            damping_adaptation_interval=2,
            estimation_mode=cfg["estimation_mode"],
            curvature_ema=0.9,
            inverse_update_period=1,
            num_burnin_steps=2,
            multi_device=False,
            include_norms_in_stats=True,
        )
        if mode == "schedule":
            kwargs.update(DATA_SEEN_SCHEDULES if cfg.get("data_seen") else SCHEDULES)
        if "blocks" in cfg:  # tag name -> block class name ({"dense": "DenseFull"}), or (name, its options)
            kwargs["layer_tag_to_block_ctor"] = {
                t: getattr(kfac_jax, c) if isinstance(c, str) else functools.partial(getattr(kfac_jax, c[0]), **c[1])
                for t, c in cfg["blocks"].items()
            }
        kwargs.update(cfg.get("optimizer", {}))
        if backend == "curvax":
            kwargs.update(cfg.get("curvax_optimizer", {}))
        kwargs.update(overrides)
        align = cfg.get("align_keys", False)
        if align:
            kwargs["num_burnin_steps"] = 0
        rec: dict[str, Any] = {"steps": []}
        try:
            opt = kfac_jax.Optimizer(**kwargs)
            state = opt.init(params, jax.random.PRNGKey(42), make_batch(0))
            rec["step0_params"] = [float(v) for v in np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(params)])]
            # One stream of batches, read through ``data_iterator`` (kfac-jax takes the burn-in
            # batches from it on the first step): batches 0..num_burnin_steps-1 for the burn-in.
            batches = (make_batch(j) for j in itertools.count())
            for i in range(steps):
                key = jax.random.fold_in(jax.random.PRNGKey(7), i)
                if align and backend == "kfac_jax":  # the key curvax's estimator samples with (KEY_ALIGNMENT)
                    key = jax.random.split(jax.random.split(key)[0], 1)[0]
                step_kw = dict(cfg.get("fixed", FIXED)) if mode == "fixed" else {}
                if backend == "curvax" and mode == "fixed":
                    step_kw.update(cfg.get("curvax_fixed", {}))
                params, state, stats = opt.step(params, state, key, data_iterator=batches, **step_kw)
                flat = np.concatenate([np.ravel(np.asarray(a)) for a in jax.tree_util.tree_leaves(params)])
                row = {"params": [float(v) for v in flat], "stats": _scalar_stats(stats, np)}
                for k in ("loss", "learning_rate", "momentum", "damping"):
                    if k in stats:
                        row[k] = float(np.asarray(stats[k]))
                rec["steps"].append(row)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()[-3000:]
        results["configs"][name] = rec
    out_path.write_text(json.dumps(results))


# --- the parent ---------------------------------------------------------------------------


def _child(python: str, backend: str, configs: list[str], steps: int, tmp: Path, overrides: str) -> dict[str, Any]:
    out = tmp / f"{backend}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [python, str(Path(__file__).resolve()), "--child", backend, "--steps", str(steps), "--out", str(out),
           "--overrides", overrides, "--configs", *configs]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0 or not out.exists():
        raise SystemExit(f"{backend} child failed (exit {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}")
    data = json.loads(out.read_text())
    data["wall_s"] = round(time.perf_counter() - t0, 1)
    return data


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per-step differences of ``b`` (curvax) against ``a`` (kfac-jax)."""
    import numpy as np

    if "error" in a or "error" in b:
        return {"error_kfac_jax": a.get("error"), "error_curvax": b.get("error"),
                "traceback_curvax": b.get("traceback"), "traceback_kfac_jax": a.get("traceback")}
    rows = []
    for i, (ra, rb) in enumerate(zip(a["steps"], b["steps"])):
        pa, pb = np.asarray(ra["params"]), np.asarray(rb["params"])
        diff = np.abs(pb - pa)
        row = {
            "step": i + 1,
            "max_abs_param_diff": float(diff.max()),
            "max_rel_param_diff": float(diff.max() / np.abs(pa).max()),
            "max_elementwise_rel_param_diff": float(np.max(diff / np.maximum(np.abs(pa), 1e-300))),
            "loss_kfac_jax": ra.get("loss"),
            "loss_curvax": rb.get("loss"),
        }
        for k in ("learning_rate", "momentum", "damping"):
            if k in ra or k in rb:
                row[f"{k}_kfac_jax"], row[f"{k}_curvax"] = ra.get(k), rb.get(k)
        sa, sb = ra.get("stats", {}), rb.get("stats", {})
        row["stats_rel_diff"] = {k: _rel(sa[k], sb[k]) for k in sorted(set(sa) & set(sb))}
        rows.append(row)
    stat_diffs: dict[str, float] = {}
    for r in rows:
        for k, v in r["stats_rel_diff"].items():
            stat_diffs[k] = max(stat_diffs.get(k, 0.0), v)
    only = sorted(set(a["steps"][0].get("stats", {})) ^ set(b["steps"][0].get("stats", {}))) if rows else []
    p0a, p0b = np.asarray(a["step0_params"]), np.asarray(b["step0_params"])
    return {
        "initial_params_identical": bool(np.array_equal(p0a, p0b)),
        "num_params": int(p0a.size),
        "steps": rows,
        "max_abs_param_diff": max(r["max_abs_param_diff"] for r in rows),
        "max_rel_param_diff": max(r["max_rel_param_diff"] for r in rows),
        "param_update_size": float(np.abs(np.asarray(a["steps"][-1]["params"]) - p0a).max()),
        "max_rel_stat_diff": stat_diffs,
        "stats_in_one_backend_only": only,
    }


def _rel(x: float, y: float) -> float:
    """``|y - x| / |x|`` (0 when both are equal, NaNs included; ``inf`` when only ``x`` is 0)."""
    import math

    if x == y or (math.isnan(x) and math.isnan(y)):
        return 0.0
    return abs(y - x) / abs(x) if x != 0 else math.inf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--python", default=sys.executable, help="interpreter with kfac-jax 0.0.8 (JAX <= 0.9.1)")
    ap.add_argument("--curvax-python", default=None, help="interpreter for the curvax child (default: --python)")
    ap.add_argument("--output", type=Path, default=REPO / "benchmarks/results/kfac_jax_differential.json")
    ap.add_argument("--overrides", default="{}", help="JSON of optimizer arguments replacing the defaults in every configuration")
    ap.add_argument("--child", choices=["kfac_jax", "curvax"], help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_child(args.child, args.configs, args.steps, args.out, json.loads(args.overrides))
        return 0

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kfac_jax_diff_") as tmp:
        ref = _child(args.python, "kfac_jax", args.configs, args.steps, Path(tmp), args.overrides)
        cur = _child(args.curvax_python or args.python, "curvax", args.configs, args.steps, Path(tmp), args.overrides)
    if ref["module"] != "kfac_jax" or cur["module"] != "curvax":
        raise SystemExit(f"the children imported {ref['module']} and {cur['module']}")
    results = {}
    for name in args.configs:
        res = {"align_keys": False, **CONFIGS[name], "sampled": CONFIGS[name]["estimation_mode"] in SAMPLED}
        res.update(compare(ref["configs"][name], cur["configs"][name]))
        results[name] = res
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = None
    out = {
        "description": "same K-FAC steps (float64, same init, batches and step keys) with kfac-jax 0.0.8 and curvax; "
        "per step the largest parameter difference of curvax from kfac-jax",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "curvax_commit": head,
        "versions": {"kfac_jax": ref["kfac_jax_version"], "jax_kfac_jax_child": ref["jax"], "jax_curvax_child": cur["jax"],
                     "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "runtime_s": {"total": round(time.perf_counter() - t0, 1), "kfac_jax_child": ref["wall_s"], "curvax_child": cur["wall_s"]},
        "settings": {"overrides": json.loads(args.overrides), "steps": args.steps, "batch_size": BATCH, "classes": CLASSES, "fixed_step_arguments": FIXED,
                     "l2_reg": 1e-4, "curvature_ema": 0.9, "inverse_update_period": 1, "num_burnin_steps": 2,
                     "damping_adaptation_interval": 2, "initial_damping_adaptive": 1.0, "init_rng": "PRNGKey(42)",
                     "step_rng": "fold_in(PRNGKey(7), step)"},
        "sampling_keys": KEY_ALIGNMENT,
        "float32_coefficients": FLOAT32_NOTE,
        "edge_cases": EDGE_CASES,
        "empirical_fisher": EMPIRICAL_FISHER,
        "sequence_logits": SEQUENCE_LOGITS,
        "block_norm_cache": BLOCK_NORM_CACHE,
        "summary": {n: {"max_abs_param_diff": r.get("max_abs_param_diff"), "max_rel_param_diff": r.get("max_rel_param_diff"),
                        "max_rel_stat_diff": max(r.get("max_rel_stat_diff", {}).values(), default=None),
                        "sampled": r["sampled"], "error": r.get("error_curvax") or r.get("error_kfac_jax")}
                    for n, r in results.items()},
        "configs": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'configuration':44s} {'max |dp|':>10s} {'max rel':>10s} {'update':>9s}  worst stat (rel)")
    for n, r in results.items():
        if "steps" not in r:
            print(f"{n:44s} error: curvax {r.get('error_curvax')} | kfac-jax {r.get('error_kfac_jax')}")
            continue
        worst = max(r["max_rel_stat_diff"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        print(f"{n:44s} {r['max_abs_param_diff']:10.2e} {r['max_rel_param_diff']:10.2e} {r['param_update_size']:9.2e}"
              f"  {worst[0]} {worst[1]:.1e}" + (f"  only in one: {r['stats_in_one_backend_only']}" if r["stats_in_one_backend_only"] else ""))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
