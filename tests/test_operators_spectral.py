"""``curvax.operators.spectral_density``: stochastic Lanczos quadrature against the smoothed density
of the dense eigenvalues of a small float64 model's K-FAC matrix, at its stated variance and rate."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from curvax import operators as ops

pytestmark = pytest.mark.usefixtures("x64")


@functools.lru_cache(maxsize=None)
def _kfac() -> tuple:
    p, batch = models.tanh_mlp_problem((4, 5, 3), 32, (1.0, 1.0))
    est, state = models.fisher_exact_estimate(models.tanh_mlp_loss, p, batch)
    K = ops.from_estimator(est, state)
    return K, np.asarray(est.to_dense_matrix(state))


def _gauss(x: np.ndarray, sigma: float) -> np.ndarray:
    return np.exp(-0.5 * (x / sigma) ** 2) / (sigma * np.sqrt(2 * np.pi))


def _truth(dense: np.ndarray, grid: np.ndarray, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """The smoothed density of the dense eigenvalues and the stated per-probe variance at each point."""
    lam, q = np.linalg.eigh(dense)
    n = dense.shape[0]
    phi = _gauss(grid[:, None] - lam[None], sigma).mean(axis=1)
    var1 = []
    for t in grid:
        g = (q * _gauss(t - lam, sigma)) @ q.T
        var1.append(2 * (np.sum(g**2) - np.sum(np.diag(g) ** 2)) / n**2)
    return phi, np.asarray(var1)


def _runs(K: Any, m: int, n: int, grid: np.ndarray, sigma: float, trials: int) -> np.ndarray:
    keys = jax.random.split(jax.random.PRNGKey(1000 + n), trials)
    f = jax.jit(jax.vmap(lambda key: ops.spectral_density(K, key, m, n, grid, sigma)))
    return np.asarray(f(keys))


def test_spectral_density_converges_at_the_stated_variance_and_rate():
    K, dense = _kfac()
    lam = np.linalg.eigvalsh(dense)
    sigma = 0.05 * (lam[-1] - lam[0])
    grid = np.linspace(lam[0] - 4 * sigma, lam[-1] + 4 * sigma, 60)
    phi, var1 = _truth(dense, grid, sigma)
    probes = np.array([1, 8, 64])
    mse = []
    for n in probes:
        est = _runs(K, K.dim, int(n), grid, sigma, 32)  # dim steps: exact quadrature, only probe noise
        err2 = np.sum((est - phi) ** 2, axis=1)  # squared error summed over the grid, per trial
        mse.append(np.mean(err2))
        # the stated variance, summed over the grid (32 trials: a chi-square spread of ~25%)
        np.testing.assert_allclose(mse[-1], np.sum(var1) / n, rtol=0.5)
        assert np.all(var1 / n <= 2 * phi / (K.dim * n * sigma * np.sqrt(2 * np.pi)) * (1 + 1e-9))  # the bound
    slope = np.polyfit(np.log(probes), np.log(mse), 1)[0]
    assert -1.2 < slope < -0.8, slope  # MSE ~ 1/n: the error's std falls as 1/sqrt(n)


def test_spectral_density_integrates_to_one_and_truncated_lanczos_converges():
    K, dense = _kfac()
    lam = np.linalg.eigvalsh(dense)
    sigma = 0.05 * (lam[-1] - lam[0])
    grid = np.linspace(lam[0] - 8 * sigma, lam[-1] + 8 * sigma, 2001)
    key = jax.random.PRNGKey(7)
    run = jax.jit(ops.spectral_density, static_argnums=(2, 3))
    # the exact-quadrature value for these 16 probes, densely: mean_l z_l^T g(t I - K) z_l / dim
    z = np.asarray(jax.random.rademacher(key, (K.dim, 16), dtype=jnp.float64))
    ev, q = np.linalg.eigh(dense)
    proj = (q.T @ z) ** 2  # (dim, 16)
    exact = _gauss(grid[:, None] - ev[None], sigma) @ proj.mean(axis=1) / K.dim
    np.testing.assert_allclose(np.trapezoid(exact, grid), 1.0, rtol=1e-9)
    # fewer Lanczos steps than dim: the quadrature error falls geometrically with the steps
    dens = {m: np.asarray(run(K, key, m, 16, grid, sigma)) for m in (4, 8, 16)}
    errs = [np.max(np.abs(dens[m] - exact)) for m in (4, 8, 16)]
    assert errs[2] < errs[1] / 100 < errs[0] / 500 and errs[2] < 1e-4 * np.max(exact), errs
    np.testing.assert_allclose(np.trapezoid(dens[4], grid), 1.0, rtol=1e-9)  # integrates to 1 at any m
    # quadrature weights: each probe's sum to 1 (over num_probes); the nodes are Ritz values
    nodes, weights = ops.slq_quadrature(K, key, 8, 3)
    assert nodes.shape == weights.shape == (3, 8)
    np.testing.assert_allclose(np.sum(weights, axis=1), 1 / 3, rtol=1e-12)
    assert np.all(nodes >= lam[0] - 1e-10) and np.all(nodes <= lam[-1] + 1e-10)
    # exact moments: sum tau theta^j = z^T K^j z / dim for j <= 2m - 1
    z = np.asarray(jax.random.rademacher(key, (K.dim, 3), dtype=jnp.float64)).T
    for j in (1, 2, 5):
        want = np.einsum("pi,ij,pj->p", z, np.linalg.matrix_power(dense, j), z) / K.dim
        np.testing.assert_allclose(3 * np.sum(np.asarray(weights) * np.asarray(nodes) ** j, axis=1), want, rtol=1e-8)


def test_spectral_density_bad_input():
    K, _ = _kfac()
    key = jax.random.PRNGKey(0)
    grid = jnp.linspace(0, 1, 5)
    with pytest.raises(ValueError, match="`sigma`"):
        ops.spectral_density(K, key, 4, 2, grid, 0.0)
    with pytest.raises(ValueError, match="`grid`"):
        ops.spectral_density(K, key, 4, 2, jnp.zeros((2, 2)), 0.1)
    with pytest.raises(ValueError, match="`num_probes`"):
        ops.spectral_density(K, key, 4, 0, grid, 0.1)
    with pytest.raises(ValueError, match="`num_iterations`"):
        ops.spectral_density(K, key, K.dim + 1, 2, grid, 0.1)
    with pytest.raises(TypeError, match="`operator`"):
        ops.spectral_density(np.eye(3), key, 2, 2, grid, 0.1)
