"""``BlockDiagonalOperator.factorized()``: the factor eigendecompositions are computed once and
every derived operator gives the numbers of the unfactorized one (which the dense oracles of
``test_operators.py`` check), without decomposing a factor again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from curvax import operators as ops

from test_operators import _cnn_problem, _estimate, _mlp_batch, _mlp_loss, _mlp_params

pytestmark = pytest.mark.usefixtures("x64")


def _problems(kronecker_only: bool = False):
    # the MLP's scale layer gets a diagonal block: factorized operators mix both kinds
    yield "mlp", _estimate(_mlp_loss, _mlp_params(scale_layer=not kronecker_only), _mlp_batch())
    loss, params, batch = _cnn_problem()
    yield "cnn", _estimate(loss, params, batch)


DERIVED = {
    "K": lambda k: k,
    "K + 0.3 I": lambda k: k.damped(0.3),
    "(K + 0.1 I)^-1 exact": lambda k: k.inverse(0.1),
    "(K + 0.1 I)^-1 pi-adjusted": lambda k: k.inverse(0.1, exact=False),
    "per-factor (0.2, 0.05)^-1": lambda k: k.inverse((0.2, 0.05), exact=False),
    "(K + 0.1 I)^-1/2": lambda k: k.damped(0.1).power(-0.5),
    "K^2": lambda k: k.power(2),
}


def _eigh_count(f, *args) -> int:
    return str(jax.make_jaxpr(f)(*args)).count("eigh")


@pytest.mark.parametrize("name", list(DERIVED))
def test_factorized_operators_equal_the_unfactorized_ones(name):
    for model, (est, state) in _problems(kronecker_only=name.startswith("per-factor")):
        k = ops.from_estimator(est, state)
        kf = k.factorized()
        a, b = DERIVED[name](k), DERIVED[name](kf)
        v = jax.random.normal(jax.random.PRNGKey(5), (k.shape[0],), jnp.float64)
        scale = float(jnp.max(jnp.abs(a @ v)))
        np.testing.assert_allclose(b @ v, a @ v, rtol=1e-9, atol=1e-10 * scale, err_msg=f"{model} {name}")
        for method in ("trace", "frobenius_norm", "eigenvalues", "diagonal"):
            np.testing.assert_allclose(getattr(b, method)(), getattr(a, method)(), rtol=1e-9, atol=1e-12,
                                       err_msg=f"{model} {name} {method}")
        dense = np.asarray(a.to_dense())
        for d in (0.0, 0.7):
            ev = np.linalg.eigvalsh(dense + d * np.eye(dense.shape[0]))
            if ev[0] <= ev.size * np.finfo(ev.dtype).eps * np.abs(ev).max():
                # numerically singular (the softmax's G, undamped): -inf in both
                assert name in ("K", "K^2") and d == 0.0, (model, name, d)
                assert float(a.logdet(d)) == float(b.logdet(d)) == -np.inf, (model, name, a.logdet(d), b.logdet(d))
                continue
            want = np.linalg.slogdet(dense + d * np.eye(dense.shape[0]))[1]
            np.testing.assert_allclose(b.logdet(d), a.logdet(d), rtol=1e-10, err_msg=f"{model} {name} logdet({d})")
            np.testing.assert_allclose(a.logdet(d), want, rtol=1e-8, err_msg=f"{model} {name} logdet({d}) vs slogdet")


def test_factorized_inverse_products_decompose_nothing_and_work_under_jit_and_vmap():
    est, state = next(_problems())[1]
    k = ops.from_estimator(est, state)
    kf = jax.jit(lambda op: op.factorized())(k)  # an operator crosses jit as a pytree
    v = jax.random.normal(jax.random.PRNGKey(6), (3, k.shape[0]), jnp.float64)
    solve = lambda op, x: op.inverse(0.1) @ x  # noqa: E731
    assert _eigh_count(solve, k, v[0]) > 0
    assert _eigh_count(solve, kf, v[0]) == 0
    assert _eigh_count(lambda op: op.logdet(0.5), kf) == 0
    assert _eigh_count(lambda op, x: op.inverse(0.1, exact=False) @ x, kf, v[0]) == 0
    batched = jax.jit(jax.vmap(solve, in_axes=(None, 0)))(kf, v)
    np.testing.assert_allclose(batched, jnp.stack([solve(k, x) for x in v]), rtol=1e-9, atol=1e-12)
    # K (K + 0.1 I)^-1 v + 0.1 (K + 0.1 I)^-1 v = v
    x = solve(kf, v[0])
    np.testing.assert_allclose(kf @ x + 0.1 * x, v[0], rtol=1e-8, atol=1e-10)


def test_factorized_keeps_other_blocks_computing_from_their_statistics():
    # A Full block (not Kronecker) is not factorized; its products are unchanged.
    from curvax import blocks
    est, state = _estimate(_mlp_loss, _mlp_params(), _mlp_batch(), ctors={"dense": blocks.DenseFull})
    k = ops.from_estimator(est, state)
    kf = k.factorized()
    assert all(e is None for e in kf.eigen)
    v = jnp.ones(k.shape[0], jnp.float64)
    np.testing.assert_allclose(kf.inverse(0.1) @ v, k.inverse(0.1) @ v, rtol=1e-12)
