"""Issues 22 and 24 on every operator against dense float64 oracles: ``min_damping`` is a floor
(``(K + max(d, m) I)^-1``), ``logdet`` is ``-inf`` exactly when the matrix is numerically
singular, ``eigenpairs`` gives the top eigenpairs of ``jnp.linalg.eigh``, and ``solve``'s default
tolerances work in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import operators as ops

from test_operators import _problem, _mlp_loss, _mlp_params, _mlp_batch

pytestmark = pytest.mark.usefixtures("x64")


def _operators() -> dict:
    """Every kind of operator, on the 44-parameter MLP (float64)."""
    est, state, p = _problem("mlp-kfac")
    K = ops.from_estimator(est, state)
    batch = _mlp_batch()
    G = ops.ggn(_mlp_loss, p, batch)
    rng = np.random.default_rng(0)
    b = rng.standard_normal((K.dim, K.dim))
    return {
        "kfac": K,
        "kfac factorized": K.factorized(),
        "ekfac": ops.from_estimator(*_problem("mlp-ekfac")[:2]),
        "full blocks": ops.from_estimator(*_problem("mlp-full")[:2]),
        "dense": ops.dense(b @ b.T / K.dim, p),
        "identity": ops.identity(p),
        "ggn": G,
        "fisher type-2": ops.fisher(_mlp_loss, p, batch, kind="type-2"),
        "empirical fisher": ops.fisher(_mlp_loss, p, batch, kind="empirical"),
        "hessian": ops.hessian(_mlp_loss, p, batch),
        "scaled": 3.0 * K,
        "sum": K + G,
        "product": K @ K,
        "product (non-symmetric)": K @ G,
    }


OPERATORS = ["kfac", "kfac factorized", "ekfac", "full blocks", "dense", "identity", "ggn", "fisher type-2",
             "empirical fisher", "hessian", "scaled", "sum", "product", "product (non-symmetric)"]


@pytest.fixture(scope="module")
def operators() -> dict:
    with jax.enable_x64(True):
        yield {k: (v, np.asarray(v.to_dense())) for k, v in _operators().items()}


@pytest.mark.parametrize("name", OPERATORS)
def test_min_damping_is_a_floor_on_every_operator(operators, name):
    K, m = operators[name]
    v = np.random.default_rng(1).standard_normal(K.dim)
    eye = np.eye(K.dim)
    for d, floor in ((0.1, 0.5), (0.5, 0.1), (0.0, 0.3)):
        want = np.linalg.inv(m + max(d, floor) * eye) @ v
        got = np.asarray(K.inverse(d, min_damping=floor) @ v)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11 * np.abs(want).max(), err_msg=f"{name} d={d} m={floor}")
    # the floor is not the damping: below it, the damping itself is used
    np.testing.assert_allclose(np.asarray(K.inverse(0.5, min_damping=0.1) @ v), np.linalg.solve(m + 0.5 * eye, v), rtol=1e-9)


@pytest.mark.parametrize("name", ["kfac", "kfac factorized", "full blocks", "ekfac", "dense", "ggn"])
def test_logdet_is_minus_inf_exactly_when_numerically_singular(operators, name):
    K, m = operators[name]
    ev = np.linalg.eigvalsh(m)
    tol = K.dim * np.finfo(np.float64).eps * np.abs(ev).max()
    singular = ev[0] <= tol
    # the MLP's softmax makes K-FAC, full blocks and the GGN singular; EKFAC and the dense one are not
    assert singular == (name not in ("ekfac", "dense")), (name, ev[:3])
    got = float(K.logdet(0.0))
    if singular:
        assert got == -np.inf, (name, got)
    else:
        np.testing.assert_allclose(got, np.linalg.slogdet(m)[1], rtol=1e-10)
    for d in (1e-3, 0.5):
        sign, want = np.linalg.slogdet(m + d * np.eye(K.dim))
        assert sign == 1
        np.testing.assert_allclose(float(K.logdet(d)), want, rtol=1e-10, err_msg=f"{name} logdet({d})")


def test_logdet_of_derived_block_operators_against_slogdet(operators):
    K, m = operators["kfac"]
    eye = np.eye(K.dim)
    for op in (K, K.factorized()):
        assert float(op.power(2).logdet()) == -np.inf
        assert float(op.power(0.5).logdet()) == -np.inf
        assert float(op.inverse(0.1, exact=False).power(-1).logdet()) > -np.inf
        np.testing.assert_allclose(float(op.inverse(0.1).logdet()), -np.linalg.slogdet(m + 0.1 * eye)[1], rtol=1e-10)
        np.testing.assert_allclose(float(op.damped(0.2).logdet(0.3)), np.linalg.slogdet(m + 0.5 * eye)[1], rtol=1e-10)
        fac = np.asarray(op.inverse(0.1, exact=False).to_dense())
        np.testing.assert_allclose(float(op.inverse(0.1, exact=False).logdet()), np.linalg.slogdet(fac)[1], rtol=1e-9)
        # jit: the same values
        assert float(jax.jit(lambda k: k.logdet())(op)) == -np.inf


def test_logdet_of_a_singular_factor_on_the_cnn_is_minus_inf():
    est, state, _ = _problem("cnn")
    K = ops.from_estimator(est, state)
    m = np.asarray(K.to_dense())
    ev = np.linalg.eigvalsh(m)
    assert ev[0] <= K.dim * np.finfo(np.float64).eps * ev[-1]
    for op in (K, K.factorized()):
        assert float(op.logdet()) == -np.inf
        np.testing.assert_allclose(float(op.logdet(0.01)), np.linalg.slogdet(m + 0.01 * np.eye(K.dim))[1], rtol=1e-10)


def _check_eigenpairs(K, m, k, values, vectors, rtol=1e-9, overlap_tol=1e-7, min_separated=2):
    w, q = np.linalg.eigh((m + m.T) / 2)
    w, q = w[::-1], q[:, ::-1]
    values, vectors = np.asarray(values), np.asarray(vectors)
    assert values.shape == (k,) and vectors.shape == (K.dim, k)
    np.testing.assert_allclose(values, w[:k], rtol=rtol, atol=1e-12 * abs(w[0]))
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=0), 1.0, rtol=1e-9)
    gaps = np.minimum(np.abs(np.diff(w, prepend=np.inf)), np.abs(np.diff(w, append=-np.inf)))[:k]
    separated = gaps > 1e-4 * abs(w[0])
    assert separated.sum() >= min(min_separated, k)
    overlaps = np.abs(np.sum(vectors * q[:, :k], axis=0))
    np.testing.assert_allclose(overlaps[separated], 1.0, atol=overlap_tol)
    # K v = lambda v for every returned pair (separated or not)
    np.testing.assert_allclose(m @ vectors, vectors * values, atol=1e-7 * abs(w[0]))


@pytest.mark.parametrize("name", ["kfac", "kfac factorized", "ekfac", "full blocks", "dense", "scaled"])
def test_eigenpairs_of_closed_form_operators_equal_eigh(operators, name):
    K, m = operators[name]
    for k in (1, 6, K.dim):
        values, vectors = K.eigenpairs(k)
        _check_eigenpairs(K, m, k, values, vectors)


def test_eigenpairs_of_derived_block_operators_and_cnn(operators):
    K, _ = operators["kfac"]
    derived = {"inverse": K.inverse(0.1), "pi-adjusted": K.inverse(0.1, exact=False), "sqrt": K.power(0.5),
               "damped": K.damped(0.2), "scaled (jit: closed form)": 3.0 * K,
               "cnn": ops.from_estimator(*_problem("cnn")[:2])}
    for name, op in derived.items():
        m = np.asarray(op.to_dense())
        values, vectors = jax.jit(lambda o: o.eigenpairs(5))(op)
        # the exact inverse's top eigenvalue 1/0.1 is K's null space: degenerate, checked by K v = l v
        _check_eigenpairs(op, m, 5, values, vectors, min_separated=0 if name == "inverse" else 2)


@pytest.mark.parametrize("name", ["ggn", "fisher type-2", "hessian", "sum", "identity"])
def test_eigenpairs_by_lanczos_equal_eigh(operators, name):
    K, m = operators[name]
    values, vectors = K.eigenpairs(4, num_iterations=K.dim)  # a full Krylov space: exact to round-off
    _check_eigenpairs(K, m, 4, values, vectors, rtol=1e-8, overlap_tol=1e-6, min_separated=0 if name == "identity" else 2)
    if name == "identity":
        return
    # fewer steps than dim: the top pair converges first (the Ritz value a lower bound)
    values, vectors = K.eigenpairs(2, key=jax.random.PRNGKey(3), num_iterations=30)
    w, q = np.linalg.eigh(m)
    assert float(values[0]) <= w[-1] * (1 + 1e-12)
    np.testing.assert_allclose(float(values[0]), w[-1], rtol=1e-6)
    assert abs(float(np.dot(np.asarray(vectors[:, 0]), q[:, -1]))) > 1 - 1e-5


def test_eigenpairs_vectors_unflatten_to_parameter_pytrees(operators):
    K, _ = operators["kfac"]
    values, vectors = K.eigenpairs(3)
    tree = K.space.unflatten(vectors[:, 0])
    out = K @ tree
    np.testing.assert_allclose(K.space.flatten(out), values[0] * vectors[:, 0], atol=1e-12)


def test_float32_solve_with_default_tolerances_meets_them():
    with jax.enable_x64(False):
        p = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), _mlp_params(seed=4))
        x, y = _mlp_batch(48, seed=5)
        batch = (jnp.asarray(x, jnp.float32), y)
        G = ops.ggn(_mlp_loss, p, batch)
        g = jax.grad(_mlp_loss)(p, batch)
        assert G.dtype == jnp.float32
        tol = ops.default_tolerance(jnp.float32)
        assert tol == pytest.approx(np.sqrt(np.finfo(np.float32).eps))
        assert ops.default_tolerance(jnp.float64) == 1e-10
        sols = {"eager": ops.solve(G, g, damping=1e-3), "jit": jax.jit(lambda G, g: ops.solve(G, g, damping=1e-3))(G, g)}
        m = np.asarray(G.to_dense(), np.float64)
        b = np.asarray(G.space.flatten(g), np.float64)
        for how, sol in sols.items():
            xs = np.asarray(G.space.flatten(sol), np.float64)
            assert np.all(np.isfinite(xs)), how
            r = (m + 1e-3 * np.eye(len(b))) @ xs - b
            # lineax's rule |r_i| <= atol + rtol |b_i| (the recursive residual; the true one within 2x)
            assert np.max(np.abs(r) / (tol + tol * np.abs(b))) <= 2.0, how
        # influence by CG in float32 agrees with the dense inverse to the tolerance's scale
        train = ops.per_example_gradients(lambda p, e: _mlp_loss(p, (e[0][None], e[1][None])), p, batch)
        exact = ops.influence_scores(ops.dense(m.astype(np.float32), p), train, g, damping=1e-2)
        cg = ops.influence_scores(G, train, g, damping=1e-2, method="cg")
        assert cg.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(cg), np.asarray(exact), rtol=0, atol=0.05 * np.abs(np.asarray(exact)).max())
        # a tolerance float32 cannot reach: a clear error naming rtol, not lineax's
        with pytest.raises(RuntimeError, match="`rtol`=1e-10"):
            ops.solve(G, g, damping=1e-3, rtol=1e-10, atol=1e-10)
