"""Laplace approximations from a curvature estimate: log-determinants, posterior samples, evidence.

Around trained parameters ``theta*``, the Laplace approximation of the posterior under a
``N(0, I / prior_precision)`` prior is ``N(theta*, H^{-1})`` with ``H = N C + prior_precision I``:
``C`` is the per-example curvature an estimator holds (the mean over its batches; Fisher or GGN,
any block structure) and ``N`` the number of training examples. The functions here take the
estimator and its state and work block by block, exactly for the block-diagonal ``C``: log
determinants from each block's eigenvalues, marginal variances from each block's inverse
diagonal, samples through each block's inverse square root. ``posterior(K, params, num_data,
prior_precision)`` does the same for any ``curvax.operators`` operator ``K`` (a K-FAC estimate's
or the exact GGN's), as a ``LaplacePosterior`` object.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from curvax import utils
from curvax.estimators import BlockDiagonalCurvature
from curvax.operators.base import CurvatureOperator


def _check_estimator(estimator: Any) -> None:
    if not isinstance(estimator, BlockDiagonalCurvature):
        raise TypeError(f"`estimator` must be a curvax BlockDiagonalCurvature, got {type(estimator).__name__}.")
    if estimator.blocks is None:
        raise ValueError("`estimator` has no blocks yet: call its `init` (or `finalize`) with example arguments.")


def log_determinant(estimator: BlockDiagonalCurvature, state: Any, identity_weight: float, scale: float = 1.0) -> jax.Array:
    """``log det(scale C + identity_weight I)`` for the block-diagonal curvature ``C`` in ``state``.

    Exact for the estimated matrix: the sum over blocks of ``log(scale * eigenvalue + weight)``
    (a Kronecker block's eigenvalues are the products of its factors' eigenvalues).

    Args:
      estimator: a ``BlockDiagonalCurvature`` (or ``ExplicitExactCurvature``) that has been
        initialised.
      state: its state, holding the accumulated statistics ``C``.
      identity_weight: the weight of the identity (for a Laplace posterior, the prior
        precision). Positive.
      scale: the factor on ``C`` (for a Laplace posterior, the number of training examples
        ``N``). Positive; default 1.
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

    Args:
      estimator: an initialised ``BlockDiagonalCurvature``.
      state: its state, holding ``C``.
      identity_weight: the weight of the identity (the prior precision). Positive.
      scale: the factor on ``C`` (the number of training examples). Positive; default 1.
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

    Args:
      estimator: an initialised ``BlockDiagonalCurvature``.
      state: its state, holding ``C``.
      rng: a PRNG key for the Gaussian noise.
      identity_weight: the weight of the identity (the prior precision). Positive.
      scale: the factor on ``C`` (the number of training examples). Positive; default 1.
      num_samples: how many independent samples to draw (a leading axis on every leaf);
        None draws one, without that axis. Default None.
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

    Args:
      estimator: an initialised ``BlockDiagonalCurvature``.
      state: its state, holding the per-example curvature ``C`` at ``params``.
      params: the trained parameters ``theta*`` (the structure, shapes and dtypes the
        estimator traced).
      mean_nll: the mean negative log-likelihood per training example at ``params``.
      num_data: the number of training examples ``N``. Positive integer.
      prior_precision: the prior's precision ``alpha``. Positive.
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


# ----------------------------------------------------------------------------------
# The posterior of any curvature operator
# ----------------------------------------------------------------------------------


def _check_positive(value: Any, name: str) -> Any:
    """A positive scalar; checked when concrete (a traced value passes, e.g. under ``jax.grad``)."""
    if isinstance(value, bool) or jnp.ndim(value) != 0:
        raise ValueError(f"`{name}` must be a positive scalar, got {value!r}.")
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(value)):
        v = float(value)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"`{name}` must be a finite number > 0, got {v!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class LaplacePosterior:
    """``N(mean, H^-1)`` with ``H = num_data K + prior_precision I`` for a curvature operator ``K``.

    Build it with ``posterior``. ``K`` is the per-example curvature (the mean over the data):
    ``curvax.operators.from_estimator`` (K-FAC, EKFAC, diagonal ... blocks: every method here
    exact and matrix-free), or the exact ``ggn`` / ``fisher`` operators (their methods build the
    dense matrix, up to ``curvax.operators.DENSE_FALLBACK_LIMIT`` parameters). A pytree:
    usable inside ``jit``, and differentiable in ``prior_precision`` (e.g. to maximise
    ``log_marginal_likelihood``).
    """

    mean: Any
    curvature: CurvatureOperator
    prior_precision: Any
    num_data: int

    def precision(self) -> CurvatureOperator:
        """``H = num_data K + prior_precision I`` as an operator."""
        return (self.num_data * self.curvature).damped(self.prior_precision)

    def covariance(self) -> CurvatureOperator:
        """``H^-1`` as an operator (``num_data^-1 (K + (prior_precision / num_data) I)^-1``)."""
        return (1.0 / self.num_data) * self.curvature.inverse(self.prior_precision / self.num_data)

    def covariance_sqrt(self) -> CurvatureOperator:
        """``H^-1/2``, the symmetric square root of the covariance (maps noise to samples)."""
        return self.num_data**-0.5 * self.curvature.damped(self.prior_precision / self.num_data).power(-0.5)

    def log_determinant(self) -> jax.Array:
        """``log det H`` (the posterior covariance's is its negative)."""
        return self.dim * jnp.log(self.num_data) + self.curvature.logdet(self.prior_precision / self.num_data)

    def marginal_variances(self) -> Any:
        """``diag(H^-1)``, structured like the parameters."""
        return self.curvature.space.unflatten(self.covariance().diagonal())

    def sample(self, rng: jax.Array, num_samples: int | None = None) -> Any:
        """``mean + H^-1/2 z`` with ``z ~ N(0, I)``: posterior samples (a leading axis with ``num_samples``)."""
        if num_samples is not None:
            num_samples = utils.check_int(num_samples, "num_samples", 1)
        root = self.covariance_sqrt()
        space = self.curvature.space
        flat_mean = space.flatten(self.mean)
        if num_samples is None:
            return space.unflatten(flat_mean + root @ jax.random.normal(rng, (self.dim,), space.dtype))
        z = jax.random.normal(rng, (self.dim, num_samples), space.dtype)
        return jax.vmap(space.unflatten)((flat_mean[:, None] + root @ z).T)

    def log_marginal_likelihood(self, mean_nll: Any) -> jax.Array:
        """The Laplace estimate of ``log p(data)`` (see the module-level ``log_marginal_likelihood``)."""
        alpha = self.prior_precision
        flat = self.curvature.space.flatten(self.mean)
        return (
            -self.num_data * jnp.asarray(mean_nll) + 0.5 * self.dim * jnp.log(alpha)
            - 0.5 * alpha * jnp.dot(flat, flat) - 0.5 * self.log_determinant()
        )

    @property
    def dim(self) -> int:
        """The number of parameters."""
        return self.curvature.dim


jax.tree_util.register_dataclass(
    LaplacePosterior, data_fields=["mean", "curvature", "prior_precision"], meta_fields=["num_data"]
)


def posterior(curvature: CurvatureOperator, params: Any, num_data: int, prior_precision: Any) -> LaplacePosterior:
    """The Laplace posterior around ``params`` from a curvature operator (``curvax.operators``).

    ``N(params, (num_data K + prior_precision I)^-1)`` for a ``N(0, I / prior_precision)``
    prior, ``K = curvature`` the per-example curvature (e.g. ``curvax.operators.from_estimator(est, state)``
    or ``curvax.operators.ggn(loss_fn, params, data)``). Example::

        K = curvax.operators.from_estimator(est, state)
        post = curvax.laplace.posterior(K, params, num_data=50_000, prior_precision=1.0)
        post.marginal_variances(), post.sample(key, 8), post.log_marginal_likelihood(mean_nll)
    """
    if not isinstance(curvature, CurvatureOperator):
        raise TypeError(f"`curvature` must be a curvax.operators.CurvatureOperator, got {type(curvature).__name__}.")
    if not curvature.space.matches(params):
        raise ValueError(f"`params` must be {curvature.space.describe().split(', or')[0]} (the operator's parameters).")
    num_data = utils.check_int(num_data, "num_data", 1)
    return LaplacePosterior(params, curvature, _check_positive(prior_precision, "prior_precision"), num_data)
