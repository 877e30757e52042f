"""One registered dense layer, its Kronecker-factor oracle, and block overrides written in each
kfac-jax block-API generation; shared by ``test_block_api_v008.py`` and
``test_generations_forwarding.py``.

The generations: the documented API passes dict data and ``pmap_axis_name``; v0.0.8 passes
``LayerVjpData`` and ``identity_weight``. Each override records its calls in ``CALLS`` and changes
the data in a way the factors show (``V008Block``: ``G`` becomes ``4 G``; ``DocBlock``: the input
rows of ``A`` are tripled), so a test can tell which override ran and that it received its data.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import curvax
from curvax import blocks
from curvax.kfac_api.tracer import LayerData, LayerVjpData

KEY = jax.random.PRNGKey(0)
B, D_IN, D_OUT = 5, 3, 2
# (generation, type name of the data, identity_weight or pmap_axis_name) per call of an override.
CALLS: list = []


def dense_problem(seed: int = 0, variant: str | None = None) -> tuple[Callable, dict[str, jax.Array], tuple]:
    """``(loss, params, batch)``: one dense layer registered by hand (with ``variant``, if given)
    under the squared error, ``B`` examples."""
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    params = {"w": jax.random.normal(k1, (D_IN, D_OUT)), "b": jax.random.normal(k2, (D_OUT,))}
    x = jax.random.normal(k3, (B, D_IN))
    t = jax.random.normal(k4, (B, D_OUT))

    def loss(p, batch):
        xb, tb = batch
        kw = {} if variant is None else {"variant": variant}
        y = curvax.register_dense(xb @ p["w"] + p["b"], xb, p["w"], p["b"], **kw)
        curvax.register_squared_error_loss(y, tb)
        return jnp.mean(jnp.sum((y - tb) ** 2, axis=-1))

    return loss, params, (x, t)


def oracle_factors(batch: tuple) -> tuple[np.ndarray, np.ndarray]:
    """``A = [X 1]^T [X 1] / B`` (bias row included) and ``G`` for the exact GGN of the squared
    error: each example's cotangents span ``sqrt(M) = sqrt(2) I``, so ``G = 2 I``."""
    x, _ = batch
    xa = jnp.concatenate([x, jnp.ones((B, 1))], axis=1)
    return np.asarray(xa.T @ xa / B), 2.0 * np.eye(D_OUT)


def layer_data(seed: int = 0) -> tuple[Any, dict, LayerVjpData, np.ndarray, np.ndarray]:
    """The dense layer's tag equation and one batch of its data in both generations' formats, with
    given output tangents ``dY``: ``(eqn, dict data, LayerVjpData, A, G = dY^T dY / B)``."""
    loss, params, batch = dense_problem(seed)
    est = curvax.BlockDiagonalCurvature(loss)
    est.finalize((params, batch))
    eqn = est.processed_jaxpr.layer_tags[0]
    x = batch[0]
    dy = jax.random.normal(jax.random.PRNGKey(7), (B, D_OUT))
    data = {"inputs": (x,), "outputs": (), "params": (params["w"], params["b"]), "outputs_tangent": (dy,), "params_tangent": ()}
    vjp = LayerVjpData(
        primals=LayerData(inputs=(x,), outputs=(), params=(params["w"], params["b"])),
        tangents=LayerData(inputs=(), outputs=(dy,), params=()),
    )
    xa = jnp.concatenate([x, jnp.ones((B, 1))], axis=1)
    return eqn, data, vjp, np.asarray(xa.T @ xa / B), np.asarray(dy.T @ dy / B)


class V008Block(blocks.DenseTwoKroneckerFactored):
    """A v0.0.8-style override (FermiNet's pattern): doubles dy (``G`` becomes ``4 G``), then calls
    super by keyword."""

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new, identity_weight, batch_size):
        CALLS.append(("v008", type(estimation_data).__name__, identity_weight))
        [dy] = estimation_data.tangents.outputs
        estimation_data = dataclasses.replace(
            estimation_data, tangents=dataclasses.replace(estimation_data.tangents, outputs=(2.0 * dy,))
        )
        return super().update_curvature_matrix_estimate(
            state=state, estimation_data=estimation_data, ema_old=ema_old, ema_new=ema_new,
            identity_weight=identity_weight, batch_size=batch_size,
        )


class DocBlock(blocks.DenseTwoKroneckerFactored):
    """A documented-style override: triples the inputs, then calls super positionally."""

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None):
        CALLS.append(("doc", type(estimation_data).__name__, pmap_axis_name))
        data = dict(estimation_data)
        data["inputs"] = tuple(3.0 * x for x in data["inputs"])
        return super().update_curvature_matrix_estimate(state, data, ema_old, ema_new, batch_size, pmap_axis_name)


# DocBlock's scale of ``A``'s rows and columns: the inputs tripled, the bias column not.
DOC_INPUT_SCALE = np.array([3.0] * D_IN + [1.0])


def update_in_generation(est: Any, state: Any, params: Any, batch: tuple, v008_call: bool) -> Any:
    """One exact-GGN statistics update of the estimator ``est``, called in kfac-jax v0.0.8's
    positional order (``identity_weight`` 0.25 before ``batch_size``) or in the documented one."""
    if v008_call:
        return est.update_curvature_matrix_estimate(state, 0.0, 1.0, 0.25, B, KEY, (params, batch), "ggn_exact")
    return est.update_curvature_matrix_estimate(state, 0.0, 1.0, B, KEY, (params, batch), estimation_mode="ggn_exact")
