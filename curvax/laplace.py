"""Laplace approximations from a curvature estimate: log-determinants, posterior samples, evidence.

Around trained parameters ``theta*``, the Laplace approximation of the posterior under a
``N(0, I / prior_precision)`` prior is ``N(theta*, H^{-1})`` with ``H = N C + prior_precision I``:
``C`` is the per-example curvature an estimator holds (the mean over its batches; Fisher or GGN,
any block structure) and ``N`` the number of training examples. The functions here take the
estimator and its state and work block by block, exactly for the block-diagonal ``C``: log
determinants from each block's eigenvalues, marginal variances from each block's inverse
diagonal, samples through each block's inverse square root.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from curvax import utils
from curvax.estimators import BlockDiagonalCurvature


def _check_estimator(estimator: Any) -> None:
    if not isinstance(estimator, BlockDiagonalCurvature):
        raise TypeError(f"`estimator` must be a curvax BlockDiagonalCurvature, got {type(estimator).__name__}.")
    if estimator.blocks is None:
        raise ValueError("`estimator` has no blocks yet: call its `init` (or `finalize`) with example arguments.")


def log_determinant(estimator: BlockDiagonalCurvature, state: Any, identity_weight: float, scale: float = 1.0) -> jax.Array:
    """``log det(scale C + identity_weight I)`` for the block-diagonal curvature ``C`` in ``state``.

    Exact for the estimated matrix: the sum over blocks of ``log(scale * eigenvalue + weight)``
    (a Kronecker block's eigenvalues are the products of its factors' eigenvalues).
    """
    _check_estimator(estimator)
    weight = utils.check_number(identity_weight, "identity_weight", 0.0, low_open=True)
    scale = utils.check_number(scale, "scale", 0.0, low_open=True)
    eigenvalues = estimator.eigenvalues(state, use_cached=False)
    return jnp.sum(jnp.log(scale * eigenvalues + weight))


def marginal_variances(estimator: BlockDiagonalCurvature, state: Any, identity_weight: float, scale: float = 1.0) -> Any:
    """``diag((scale C + identity_weight I)^{-1})``, structured like the parameters.

    The Laplace posterior's marginal variances (``scale = N``, ``identity_weight = prior
    precision``); ``theta_q^2 / (2 [H^-1]_qq)`` is the Optimal Brain Surgeon saliency of
    parameter ``q``. Exact for the block-diagonal ``C`` (``BlockDiagonalCurvature.inverse_diagonal``).
    """
    _check_estimator(estimator)
    weight = utils.check_number(identity_weight, "identity_weight", 0.0, low_open=True)
    scale = utils.check_number(scale, "scale", 0.0, low_open=True)
    return utils.scalar_mul(estimator.inverse_diagonal(state, weight / scale), 1.0 / scale)


def _parameter_template(estimator: BlockDiagonalCurvature) -> Any:
    pj = estimator.processed_jaxpr
    avals = [pj.program.avals[pj.program.input_keys[pj.params_offset + i]] for i in range(pj.num_params)]
    return jax.tree_util.tree_unflatten(pj.params_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])


def sample(
    estimator: BlockDiagonalCurvature, state: Any, rng: jax.Array, identity_weight: float, scale: float = 1.0,
    num_samples: int | None = None,
) -> Any:
    """Draws ``delta ~ N(0, (scale C + identity_weight I)^{-1})``, structured like the parameters.

    ``theta* + delta`` samples the Laplace posterior for ``scale = N`` and ``identity_weight =
    prior_precision``. Each block maps standard normal noise through its symmetric inverse
    square root (from its eigendecomposition). With ``num_samples``, every leaf gets a leading
    axis of that size.
    """
    _check_estimator(estimator)
    weight = utils.check_number(identity_weight, "identity_weight", 0.0, low_open=True)
    scale = utils.check_number(scale, "scale", 0.0, low_open=True)
    if num_samples is not None:
        num_samples = utils.check_int(num_samples, "num_samples", 1)
    template = _parameter_template(estimator)

    def one(key: jax.Array) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(template)
        keys = jax.random.split(key, len(leaves))
        noise = jax.tree_util.tree_unflatten(
            treedef, [jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves)]
        )
        # (s C + w I)^{-1/2} = s^{-1/2} (C + (w / s) I)^{-1/2}
        root = estimator.multiply_matpower(state, noise, weight / scale, -0.5, True, False)
        return utils.scalar_mul(root, scale**-0.5)

    if num_samples is None:
        return one(rng)
    return jax.vmap(one)(jax.random.split(rng, num_samples))


def log_marginal_likelihood(
    estimator: BlockDiagonalCurvature, state: Any, params: Any, mean_nll: Any, num_data: int, prior_precision: float,
) -> jax.Array:
    """The Laplace estimate of ``log p(data)`` for a ``N(0, I / prior_precision)`` prior.

    ``log p(data | theta*) + d/2 log(prior_precision) - prior_precision/2 |theta*|^2 - 1/2 log det H``
    with ``H = num_data C + prior_precision I`` and ``log p(data | theta*) = -num_data * mean_nll``.
    ``mean_nll`` is the mean negative log-likelihood per example at ``params`` (include the
    likelihood's constants for an absolute value; they do not move the maximum over
    ``prior_precision``). Exact for a linear model with a Gaussian likelihood when ``C`` is its
    exact GGN.
    """
    _check_estimator(estimator)
    alpha = utils.check_number(prior_precision, "prior_precision", 0.0, low_open=True)
    num_data = utils.check_int(num_data, "num_data", 1)
    if utils.tree_spec(params) != utils.tree_spec(_parameter_template(estimator)):
        raise ValueError("`params` must have the structure, shapes and dtypes of the parameters the estimator traced.")
    dim = sum(int(math.prod(jnp.shape(x))) for x in jax.tree_util.tree_leaves(params))
    logdet = log_determinant(estimator, state, alpha, scale=float(num_data))
    norm_sq = utils.inner_product(params, params)
    return -num_data * jnp.asarray(mean_nll) + 0.5 * dim * jnp.log(alpha) - 0.5 * alpha * norm_sq - 0.5 * logdet
