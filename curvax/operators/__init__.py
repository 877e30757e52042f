"""Curvature as operator objects: ``K @ v``, ``K.trace()``, ``K.logdet()``, ``K.inverse(...)``.

The JAX counterpart of curvlinops' linear operators. Every operator is an immutable pytree
(usable inside ``jit``/``vmap``) acting on a model's parameters:

* ``from_estimator(estimator, state)``: a K-FAC / EKFAC / diagonal / full block-diagonal
  estimate (``blockwise``), with closed-form trace, log-determinant, norms and inverses;
* ``kfac(loss_fn, params, data, fisher_type=..., mc_samples=..., kfac_approx=...,
  separate_weight_and_bias=...)``: the same with curvlinops' ``KFACLinearOperator`` options
  (``FisherType``, ``KFACType``; ``kfac``);
* ``ggn``, ``fisher``, ``hessian``: the exact matrices of a loss over one batch or a dataset,
  matrix-free by Jacobian-vector products (``exact``);
* ``hutchinson_trace``, ``hutchpp_trace``, ``hutchinson_diagonal``, ``hutchpp_diagonal``,
  ``lanczos_eigenvalues``, ``spectral_density`` (stochastic Lanczos quadrature): matrix-free estimates on any operator (``stochastic``);
* ``to_lineax``, ``solve``: the operators as ``lineax`` operators, for CG solves (``interop``;
  needs the optional extra ``curvax[lineax]``).
* ``influence_scores``, ``per_example_gradients``, ``obs_saliencies``, ``obs_update``:
  influence functions and Optimal Brain Surgeon pruning on any operator (``influence``).

Scaling ``a * K``, sums ``K1 + K2``, products ``K1 @ K2`` and ``K.T`` compose operators
(``base``).
"""

from curvax.operators.base import (
    DENSE_FALLBACK_LIMIT,
    CurvatureOperator,
    DenseOperator,
    IdentityOperator,
    ParameterSpace,
    ProductOperator,
    ScaledOperator,
    SumOperator,
    dense,
    identity,
)
from curvax.operators.blockwise import BlockDiagonalOperator, from_estimator
from curvax.operators.stochastic import (
    hutchinson_diagonal,
    hutchinson_trace,
    hutchpp_diagonal,
    hutchpp_trace,
    lanczos,
    lanczos_eigenpairs,
    lanczos_eigenvalues,
    slq_quadrature,
    spectral_density,
)
from curvax.operators.interop import default_tolerance, solve, to_lineax
from curvax.operators.kfac import (
    FISHER_TO_ESTIMATION_MODE,
    FisherType,
    KFACType,
    block_ctors,
    kfac,
    separate_bias_class,
    separate_weight_and_bias,
)
from curvax.operators.exact import FISHER_TYPES, ExactCurvatureOperator, fisher, ggn, hessian
from curvax.operators.influence import (
    INVERSE_METHODS,
    influence_scores,
    inverse_product,
    obs_saliencies,
    obs_update,
    per_example_gradients,
)

__all__ = [
    "DENSE_FALLBACK_LIMIT",
    "BlockDiagonalOperator",
    "CurvatureOperator",
    "DenseOperator",
    "ExactCurvatureOperator",
    "FISHER_TYPES",
    "FISHER_TO_ESTIMATION_MODE",
    "FisherType",
    "KFACType",
    "block_ctors",
    "kfac",
    "separate_bias_class",
    "separate_weight_and_bias",
    "IdentityOperator",
    "ParameterSpace",
    "ProductOperator",
    "ScaledOperator",
    "SumOperator",
    "dense",
    "fisher",
    "ggn",
    "hessian",
    "from_estimator",
    "identity",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "hutchpp_diagonal",
    "hutchpp_trace",
    "lanczos",
    "lanczos_eigenpairs",
    "lanczos_eigenvalues",
    "slq_quadrature",
    "spectral_density",
    "default_tolerance",
    "solve",
    "to_lineax",
    "INVERSE_METHODS",
    "influence_scores",
    "inverse_product",
    "obs_saliencies",
    "obs_update",
    "per_example_gradients",
]
