"""Matrix-free estimators on any operator: trace, diagonal and top eigenvalues from products only.

All take an operator ``K`` (anything with ``K.mv`` on ``(dim, k)`` matrices and ``K.dim``), a PRNG
key and a static number of products. Bounds below are for symmetric ``K`` with ``m`` products.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from curvax import utils
from curvax.operators.base import CurvatureOperator, lanczos_eigenpairs  # noqa: F401 (public here too)

Array = jax.Array


def _check(op: Any, num: Any, name: str, minimum: int) -> int:
    if not isinstance(op, CurvatureOperator):
        raise TypeError(f"`operator` must be a curvax.operators.CurvatureOperator, got {type(op).__name__}.")
    return utils.check_int(num, name, minimum)


def _rademacher(key: Array, dim: int, m: int, dtype: Any) -> Array:
    return jax.random.rademacher(key, (dim, m), dtype=dtype)


def hutchinson_trace(operator: CurvatureOperator, key: Array, num_samples: int) -> Array:
    """``(1/m) sum_i z_i^T K z_i`` with Rademacher ``z_i`` (Hutchinson 1990): unbiased.

    Variance ``2 (||K||_F^2 - sum_i K_ii^2) / m``: the error's standard deviation shrinks as ``1/sqrt(m)``.
    """
    m = _check(operator, num_samples, "num_samples", 1)
    z = _rademacher(key, operator.dim, m, operator.dtype)
    return jnp.sum(z * operator.mv(z)) / m


def hutchinson_diagonal(operator: CurvatureOperator, key: Array, num_samples: int) -> Array:
    """``(1/m) sum_i z_i * (K z_i)`` with Rademacher ``z_i`` (Bekas et al. 2007): unbiased, flat.

    Entry ``j`` has variance ``sum_{k != j} K_jk^2 / m``.
    """
    m = _check(operator, num_samples, "num_samples", 1)
    z = _rademacher(key, operator.dim, m, operator.dtype)
    return jnp.mean(z * operator.mv(z), axis=1)


def _sketch(operator: CurvatureOperator, key: Array, m: int) -> tuple[Array, Array, int]:
    """Splits ``m`` products: ``k = m // 3`` for the range sketch ``Q`` of ``K S``; returns ``Q``, key, residual count."""
    k = max(m // 3, 1)
    k_sketch, k_rest = jax.random.split(key)
    s = _rademacher(k_sketch, operator.dim, k, operator.dtype)
    q, _ = jnp.linalg.qr(operator.mv(s))
    return q, k_rest, m - 2 * k


def hutchpp_trace(operator: CurvatureOperator, key: Array, num_samples: int) -> Array:
    """Hutch++ (Meyer, Musco, Musco, Woodruff 2021) with ``m`` products (``m >= 3``).

    ``tr(Q^T K Q) + Hutchinson((I - QQ^T) K (I - QQ^T))`` with ``Q`` an orthonormal basis of
    ``K S`` for ``m/3`` random vectors: for PSD ``K`` the relative error is ``O(1/m)``
    (``|est - tr K| <= eps tr K`` with probability ``1 - delta`` for ``m = O(sqrt(log(1/delta))/eps
    + log(1/delta))``), against ``O(1/sqrt(m))`` for Hutchinson.
    """
    m = _check(operator, num_samples, "num_samples", 3)
    q, key, rest = _sketch(operator, key, m)
    exact_part = jnp.sum(q * operator.mv(q))
    g = _rademacher(key, operator.dim, rest, operator.dtype)
    g = g - q @ (q.T @ g)
    return exact_part + jnp.sum(g * operator.mv(g)) / rest


def hutchpp_diagonal(operator: CurvatureOperator, key: Array, num_samples: int) -> Array:
    """Diag++ (Baston & Nakatsukasa 2022): ``diag(Q Q^T K)`` plus Hutchinson on ``(I - QQ^T) K``.

    Unbiased for symmetric ``K``; the variance of Hutchinson's diagonal with ``K`` replaced by
    its residual off the ``m/3``-dimensional sketched range (small for fast-decaying spectra).
    """
    m = _check(operator, num_samples, "num_samples", 3)
    q, key, rest = _sketch(operator, key, m)
    kq = operator.mv(q)
    top = jnp.sum(q * kq, axis=1)  # diag(Q (K Q)^T) = diag(Q Q^T K) for symmetric K
    g = _rademacher(key, operator.dim, rest, operator.dtype)
    kg = operator.mv(g)
    return top + jnp.mean(g * (kg - q @ (q.T @ kg)), axis=1)


def _lanczos_from(operator: CurvatureOperator, v0: Array, k: int) -> tuple[Array, Array]:
    """``k`` Lanczos steps from the unit vector ``v0``, fully re-orthogonalised: ``(alpha, beta)``."""
    dim, dtype = operator.dim, operator.dtype
    basis = jnp.zeros((k + 1, dim), dtype).at[0].set(v0)

    def step(i: Array, carry: tuple) -> tuple:
        basis, alpha, beta = carry
        v = basis[i]
        w = operator.mv(v)
        a = jnp.dot(w, v)
        # full re-orthogonalisation against every vector so far (twice, for stability); the
        # rows of `basis` after row i are still zero
        for _ in range(2):
            w = w - basis.T @ (basis @ w)
        b = jnp.linalg.norm(w)
        nxt = jnp.where(b > 0, w / jnp.where(b > 0, b, 1), 0)
        return basis.at[i + 1].set(nxt), alpha.at[i].set(a), beta.at[i].set(b)

    _, alpha, beta = jax.lax.fori_loop(0, k, step, (basis, jnp.zeros(k, dtype), jnp.zeros(k, dtype)))
    return alpha, beta[:-1]


def _check_iterations(operator: CurvatureOperator, num_iterations: Any) -> int:
    k = _check(operator, num_iterations, "num_iterations", 1)
    if k > operator.dim:
        raise ValueError(f"`num_iterations` must be <= the operator's dim {operator.dim}, got {k}.")
    return k


def lanczos(operator: CurvatureOperator, key: Array, num_iterations: int) -> tuple[Array, Array]:
    """``num_iterations`` Lanczos steps with full re-orthogonalisation from a random start.

    Returns the tridiagonal matrix's diagonal ``alpha`` and off-diagonal ``beta`` (symmetric ``K``).
    """
    k = _check_iterations(operator, num_iterations)
    v0 = jax.random.normal(key, (operator.dim,), operator.dtype)
    return _lanczos_from(operator, v0 / jnp.linalg.norm(v0), k)


def lanczos_eigenvalues(operator: CurvatureOperator, key: Array, num_iterations: int, num_eigenvalues: int = 1) -> Array:
    """The ``num_eigenvalues`` largest Ritz values after ``num_iterations`` Lanczos steps, descending.

    Exact (to round-off) when ``num_iterations == dim``. Otherwise each Ritz value is a lower
    bound of its eigenvalue and, for the largest (Kaniel-Paige-Saad),
    ``0 <= l_1 - r_1 <= (l_1 - l_min) (tan(angle(v0, u_1)) / T_{k-1}(1 + 2 (l_1 - l_2)/(l_2 - l_min)))^2``
    with ``T`` the Chebyshev polynomial: the error falls geometrically with the iterations,
    the faster the larger the gap ``l_1 - l_2``.
    """
    n = _check(operator, num_eigenvalues, "num_eigenvalues", 1)
    if n > num_iterations:
        raise ValueError(f"`num_eigenvalues` ({n}) must be <= `num_iterations` ({num_iterations}).")
    alpha, beta = lanczos(operator, key, num_iterations)
    t = jnp.diag(alpha) + jnp.diag(beta, 1) + jnp.diag(beta, -1)
    return jnp.linalg.eigvalsh(t)[::-1][:n]


def slq_quadrature(operator: CurvatureOperator, key: Array, num_iterations: int, num_probes: int) -> tuple[Array, Array]:
    """Stochastic Lanczos quadrature nodes and weights (Ubaru, Chen & Saad 2017).

    For each of ``num_probes`` Rademacher probes ``z_l``, ``num_iterations`` Lanczos steps from
    ``z_l / sqrt(dim)`` give a tridiagonal ``T_l = Y diag(theta) Y^T``; the nodes are ``theta``
    and the weights ``tau_k = Y_{0k}^2 / num_probes`` (each probe's weights sum to 1). Then
    ``sum(tau * f(theta)) ~ tr(f(K)) / dim`` for smooth ``f``: ``m``-node Gauss quadrature of
    ``z^T f(K) z / dim``, exact for polynomials of degree ``<= 2m - 1`` (and for every ``f`` when
    ``num_iterations == dim``). Returns two ``(num_probes, num_iterations)`` arrays.
    """
    k = _check_iterations(operator, num_iterations)
    n = _check(operator, num_probes, "num_probes", 1)
    z = _rademacher(key, operator.dim, n, operator.dtype).T / jnp.sqrt(jnp.asarray(operator.dim, operator.dtype))

    def one(v0: Array) -> tuple[Array, Array]:
        alpha, beta = _lanczos_from(operator, v0, k)
        theta, y = jnp.linalg.eigh(jnp.diag(alpha) + jnp.diag(beta, 1) + jnp.diag(beta, -1))
        return theta, y[0] ** 2

    nodes, weights = jax.vmap(one)(z)
    return nodes, weights / n


def spectral_density(
    operator: CurvatureOperator, key: Array, num_iterations: int, num_probes: int, grid: Any, sigma: Any
) -> Array:
    """The Gaussian-smoothed spectral density of ``K`` on ``grid``, by stochastic Lanczos quadrature.

    Estimates ``phi(t) = (1/dim) sum_i g(t - lambda_i)`` with ``g`` the ``N(0, sigma^2)`` density
    and ``lambda_i`` the eigenvalues of symmetric ``K`` (Ubaru, Chen & Saad 2017; the
    dimension-normalised density, which integrates to 1 over the real line: every probe's
    quadrature weights sum to 1). ``grid``: a 1-D array of points; the result has its shape.

    Error, with ``n = num_probes``, ``m = num_iterations``, ``G_t = g(t I - K)``:

    * probes: when the quadrature is exact (``m = dim``), the estimate at ``t`` is the Hutchinson
      estimate of ``tr(G_t) / dim``: unbiased with variance
      ``2 (||G_t||_F^2 - sum_j (G_t)_jj^2) / (dim^2 n) <= 2 phi(t) / (dim n sigma sqrt(2 pi))``;
      the error's standard deviation falls as ``1/sqrt(n)``, and relative to ``phi`` as
      ``1/sqrt(dim)`` too: for large models a few probes suffice.
    * Lanczos steps: per probe the quadrature error is at most
      ``2 min_{deg p <= 2m-1} max_{lambda in [lambda_min, lambda_max]} |g(t - lambda) - p(lambda)|``,
      which falls geometrically in ``m`` once ``m`` exceeds about ``(lambda_max - lambda_min) / sigma``
      (Ubaru et al., Theorem 4.1): a smaller ``sigma`` needs more steps.
    """
    grid = jnp.asarray(grid)
    if grid.ndim != 1 or grid.size == 0:
        raise ValueError(f"`grid` must be a non-empty 1-D array of points, got shape {grid.shape}.")
    if not jnp.issubdtype(grid.dtype, jnp.floating):
        grid = grid.astype(operator.dtype)
    if isinstance(sigma, bool) or jnp.ndim(sigma) != 0:
        raise ValueError(f"`sigma` must be a positive scalar, got {sigma!r}.")
    try:
        bad = not float(sigma) > 0
    except (TypeError, jax.errors.ConcretizationTypeError):
        bad = False  # traced: unchecked
    if bad:
        raise ValueError(f"`sigma` must be > 0, got {sigma!r}.")
    nodes, weights = slq_quadrature(operator, key, num_iterations, num_probes)
    sigma = jnp.asarray(sigma, grid.dtype)
    x = (grid[:, None] - nodes.reshape(1, -1).astype(grid.dtype)) / sigma
    kernel = jnp.exp(-0.5 * x**2) / (sigma * jnp.sqrt(2 * jnp.pi).astype(grid.dtype))
    return kernel @ weights.reshape(-1).astype(grid.dtype)
