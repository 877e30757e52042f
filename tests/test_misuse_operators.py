"""What a user gets wrong with operators and the Laplace API: every error names the argument;
where a borderline input is valid, the value returned is checked against a dense float64 oracle."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import laplace
from curvax import operators as ops

from test_operators import _mlp_batch, _mlp_loss, _problem

pytestmark = pytest.mark.usefixtures("x64")


@functools.lru_cache(maxsize=None)
def _setup() -> tuple:
    est, state, p = _problem("mlp-kfac")
    K = ops.from_estimator(est, state)
    G = ops.ggn(_mlp_loss, p, _mlp_batch())
    return est, state, p, K, G


def _ops() -> tuple:
    with jax.enable_x64(True):
        return _setup()


# (name, call, exception, message the error must contain)
CASES = [
    ("flat vector too long", lambda est, st, p, K, G: K @ jnp.ones(K.dim + 1), ValueError, "`v` has shape (45,)"),
    ("columns transposed", lambda est, st, p, K, G: K @ jnp.ones((3, K.dim)), ValueError, "`v` has shape (3, 44)"),
    ("3-D array", lambda est, st, p, K, G: K @ jnp.ones((K.dim, 2, 2)), ValueError, "`v` has shape (44, 2, 2)"),
    ("leaf shape wrong", lambda est, st, p, K, G: K @ {**p, "w1": jnp.ones((5, 4))}, ValueError, "`v` does not match the parameters"),
    ("leaf missing", lambda est, st, p, K, G: K @ {k: v for k, v in p.items() if k != "t"}, ValueError, "`v` does not match"),
    ("damping negative", lambda est, st, p, K, G: K.inverse(-1.0), ValueError, "`damping` must be a finite number >= 0, got -1.0"),
    ("damping NaN", lambda est, st, p, K, G: K.inverse(float("nan")), ValueError, "`damping` must be a finite number >= 0, got nan"),
    ("damping inf (exact)", lambda est, st, p, K, G: G.inverse(float("inf")), ValueError, "`damping` must be a finite number"),
    ("damping array", lambda est, st, p, K, G: K.logdet(jnp.ones(2)), ValueError, "`damping` must be a scalar"),
    ("damping string", lambda est, st, p, K, G: K.logdet("0.1"), TypeError, "`damping` must be a non-negative real number"),
    ("damping bool", lambda est, st, p, K, G: K.inverse(True), TypeError, "`damping` must be a non-negative real number"),
    ("damped negative", lambda est, st, p, K, G: G.damped(-1.0), ValueError, "`damping` must be a finite number >= 0"),
    ("min_damping negative (K-FAC)", lambda est, st, p, K, G: K.inverse(0.1, min_damping=-1.0), ValueError,
     "`min_damping` must be a finite number >= 0, got -1.0"),
    ("min_damping negative (dense)", lambda est, st, p, K, G: ops.dense(np.eye(K.dim), p).inverse(0.1, min_damping=-1.0),
     ValueError, "`min_damping` must be a finite number >= 0"),
    ("min_damping NaN (GGN)", lambda est, st, p, K, G: G.inverse(0.1, min_damping=float("nan")), ValueError,
     "`min_damping` must be a finite number >= 0, got nan"),
    ("min_damping negative (identity)", lambda est, st, p, K, G: ops.identity(p).inverse(0.1, min_damping=-2.0), ValueError,
     "`min_damping` must be a finite number >= 0"),
    ("min_damping tuple", lambda est, st, p, K, G: K.inverse(0.1, min_damping=(0.1, 0.2)), TypeError, "`min_damping` must be"),
    ("exact not a bool", lambda est, st, p, K, G: K.inverse(0.1, exact="no"), TypeError, "`exact` must be True or False"),
    ("exact not a bool (GGN)", lambda est, st, p, K, G: G.inverse(0.1, exact=None), TypeError, "`exact` must be True or False"),
    ("per-factor damping, exact", lambda est, st, p, K, G: K.inverse((0.1, 0.2)), ValueError, "needs `exact=False`"),
    ("per-factor damping of 3", lambda est, st, p, K, G: K.inverse((0.1, 0.2, 0.3), exact=False), ValueError,
     "`damping` must be a pair (d_A, d_G), got 3"),
    ("per-factor damping, GGN", lambda est, st, p, K, G: G.inverse((0.1, 0.2)), TypeError, "Per-factor (tuple) `damping`"),
    ("singular, no damping (K-FAC)", lambda est, st, p, K, G: K.inverse(0.0), ValueError, "pass `damping` > 0"),
    ("singular, no damping (GGN)", lambda est, st, p, K, G: G.inverse(0.0), ValueError, "pass `damping` > 0"),
    ("eigenpairs k = 0", lambda est, st, p, K, G: K.eigenpairs(0), ValueError, "`k` must be in [1, 44]"),
    ("eigenpairs k > dim", lambda est, st, p, K, G: K.eigenpairs(K.dim + 1), ValueError, "`k` must be in [1, 44] (the operator's dim), got 45"),
    ("eigenpairs k > dim (Lanczos)", lambda est, st, p, K, G: G.eigenpairs(K.dim + 1), ValueError, "`k` must be in [1, 44]"),
    ("eigenpairs k float", lambda est, st, p, K, G: K.eigenpairs(2.5), TypeError, "`k` must be an integer"),
    ("eigenpairs iterations < k", lambda est, st, p, K, G: G.eigenpairs(5, num_iterations=3), ValueError,
     "`num_iterations` (3) must be >= `k` (5)"),
    ("eigenpairs iterations > dim", lambda est, st, p, K, G: G.eigenpairs(5, num_iterations=K.dim + 3), ValueError,
     "`num_iterations` must be <= the operator's dim 44"),
    ("eigenpairs key", lambda est, st, p, K, G: G.eigenpairs(2, key=3), TypeError, "`key` must be a jax.random key"),
    ("eigenpairs non-symmetric", lambda est, st, p, K, G: (K @ G).eigenpairs(2), NotImplementedError, "not symmetric"),
    ("power NaN", lambda est, st, p, K, G: K.power(float("nan")), TypeError, "`p` must be a static finite real number"),
    ("dense not square", lambda est, st, p, K, G: ops.dense(np.ones((K.dim, K.dim + 1)), p), ValueError,
     "`matrix` has shape (44, 45), expected (44, 44)"),
    ("dense 1-D", lambda est, st, p, K, G: ops.dense(np.ones(K.dim), p), ValueError, "`matrix` has shape (44,)"),
    ("scale by a vector", lambda est, st, p, K, G: K * jnp.ones(3), ValueError, "scaled by a scalar, got shape (3,)"),
    ("sum of different parameters", lambda est, st, p, K, G: K + ops.identity({"a": jnp.ones(3)}), ValueError,
     "Operators act on different parameters"),
    ("negative scale inverse", lambda est, st, p, K, G: (-1.0 * K).inverse(0.1), NotImplementedError, "positive scales only"),
    ("solve vector shape", lambda est, st, p, K, G: ops.solve(G, jnp.ones(3), damping=0.1), ValueError,
     "`vector` must be a parameter pytree"),
    ("solve rtol negative", lambda est, st, p, K, G: ops.solve(G, jnp.ones(K.dim), damping=0.1, rtol=-1.0), ValueError,
     "`rtol` must be a finite number >= 0"),
    ("solve atol string", lambda est, st, p, K, G: ops.solve(G, jnp.ones(K.dim), damping=0.1, atol="1e-6"), TypeError,
     "`atol` must be a non-negative float"),
    ("solve damping negative", lambda est, st, p, K, G: ops.solve(G, jnp.ones(K.dim), damping=-0.1), ValueError,
     "`damping` must be a finite number >= 0"),
    ("solve preconditioner array", lambda est, st, p, K, G: ops.solve(G, jnp.ones(K.dim), damping=0.1,
                                                                      preconditioner=jnp.eye(K.dim)), TypeError,
     "`preconditioner` must be a curvax.operators.CurvatureOperator"),
    ("solve operator array", lambda est, st, p, K, G: ops.solve(jnp.eye(3), jnp.ones(3)), TypeError,
     "`operator` must be a curvax.operators.CurvatureOperator"),
    ("solve Hessian", lambda est, st, p, K, G: ops.solve(ops.hessian(_mlp_loss, p, _mlp_batch()), jnp.ones(K.dim), damping=0.1),
     ValueError, "must be symmetric positive semi-definite for CG"),
    ("posterior num_data 0", lambda est, st, p, K, G: laplace.posterior(K, p, num_data=0, prior_precision=1.0), ValueError,
     "`num_data` must be an integer >= 1, got 0"),
    ("posterior num_data float", lambda est, st, p, K, G: laplace.posterior(K, p, num_data=10.5, prior_precision=1.0),
     ValueError, "`num_data` must be an integer >= 1"),
    ("posterior prior negative", lambda est, st, p, K, G: laplace.posterior(K, p, 10, prior_precision=-1.0), ValueError,
     "`prior_precision` must be a finite number > 0, got -1.0"),
    ("posterior prior NaN", lambda est, st, p, K, G: laplace.posterior(K, p, 10, prior_precision=float("nan")), ValueError,
     "`prior_precision` must be a finite number > 0, got nan"),
    ("posterior prior vector", lambda est, st, p, K, G: laplace.posterior(K, p, 10, prior_precision=jnp.ones(2)), ValueError,
     "`prior_precision` must be a positive scalar"),
    ("posterior params", lambda est, st, p, K, G: laplace.posterior(K, {"w": jnp.ones(3)}, 10, 1.0), ValueError,
     "`params` must be a pytree"),
    ("posterior curvature array", lambda est, st, p, K, G: laplace.posterior(jnp.eye(3), p, 10, 1.0), TypeError,
     "`curvature` must be a curvax.operators.CurvatureOperator"),
    ("posterior num_samples 0", lambda est, st, p, K, G: laplace.posterior(K, p, 10, 1.0).sample(jax.random.PRNGKey(0), 0),
     ValueError, "`num_samples` must be an integer >= 1, got 0"),
    ("laplace identity_weight negative", lambda est, st, p, K, G: laplace.log_determinant(est, st, identity_weight=-1.0),
     ValueError, "`identity_weight` must be a number in (0, inf)"),
    ("laplace scale 0", lambda est, st, p, K, G: laplace.log_determinant(est, st, 1.0, scale=0.0), ValueError,
     "`scale` must be a number in (0, inf)"),
    ("laplace estimator", lambda est, st, p, K, G: laplace.sample("est", st, jax.random.PRNGKey(0), 1.0), TypeError,
     "`estimator` must be a curvax BlockDiagonalCurvature"),
    ("from_estimator state", lambda est, st, p, K, G: ops.from_estimator(est, None), ValueError,
     "`state` must be the estimator's state"),
    ("influence grads shape", lambda est, st, p, K, G: ops.influence_scores(K, jnp.ones((3, K.dim + 1)), p, damping=0.1),
     ValueError, "`train_grads` must be the parameters' pytree"),
    ("obs q out of range", lambda est, st, p, K, G: ops.obs_update(K, p, K.dim, damping=0.1), ValueError,
     "`q` must be an integer index in [0, 44), got 44"),
]


@pytest.mark.parametrize("name,call,exc,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_an_error_naming_the_argument(name, call, exc, message):
    with pytest.raises(exc) as info:
        call(*_ops())
    assert message in str(info.value), str(info.value)


def test_borderline_but_valid_inputs_return_the_right_numbers():
    est, state, p, K, G = _ops()
    m = np.asarray(K.to_dense())
    eye = np.eye(K.dim)
    v = np.random.default_rng(0).standard_normal(K.dim)
    # integer, NumPy and 0-d JAX dampings are dampings
    for d in (1, np.float32(0.5), jnp.asarray(0.25)):
        np.testing.assert_allclose(K.inverse(d) @ v, np.linalg.solve(m + float(d) * eye, v), rtol=1e-9)
    # min_damping equal to the damping, and a zero damping lifted by the floor
    np.testing.assert_allclose(K.inverse(0.3, min_damping=0.3) @ v, np.linalg.solve(m + 0.3 * eye, v), rtol=1e-9)
    np.testing.assert_allclose(G.inverse(0.0, min_damping=0.3) @ v,
                               np.linalg.solve(np.asarray(G.to_dense()) + 0.3 * eye, v), rtol=1e-9)
    # an integer vector and a single column: products in the operator's dtype
    ints = jnp.arange(K.dim)
    np.testing.assert_allclose(K @ ints, m @ np.arange(K.dim), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(K @ v[:, None], (m @ v)[:, None], rtol=1e-10, atol=1e-12)
    # k = dim (every eigenpair) and a NumPy integer k
    values, vectors = K.eigenpairs(np.int64(K.dim))
    np.testing.assert_allclose(values, np.linalg.eigvalsh(m)[::-1], rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(m @ vectors, vectors * values, atol=1e-10)
    # an integer prior precision: the posterior's log-determinant is the dense one
    post = laplace.posterior(K, p, num_data=10, prior_precision=1)
    np.testing.assert_allclose(post.log_determinant(), np.linalg.slogdet(10 * m + eye)[1], rtol=1e-10)
    # logdet of a singular operator is -inf, not a round-off number; with damping, the dense value
    assert float(K.logdet()) == -np.inf
    np.testing.assert_allclose(K.logdet(0.2), np.linalg.slogdet(m + 0.2 * eye)[1], rtol=1e-10)
