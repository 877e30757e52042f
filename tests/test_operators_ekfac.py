"""``curvax.operators.kfac`` with eigenvalue-corrected (EKFAC) blocks: the eigenbasis and the
corrected eigenvalues are computed before the operator is returned, and equal an independent
dense construction (eigenvectors of ``A (x) G``, the per-example projected gradients' second
moments) on small float64 models; where EKFAC is exact, it is the Fisher."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax
from models import tanh_mlp_apply, tanh_mlp_loss, tanh_mlp_problem
from curvax import operators as ops

pytestmark = pytest.mark.usefixtures("x64")

EKFAC = {"dense": curvax.DenseEigenvalueCorrected}


def _sym_sqrt(f: np.ndarray) -> np.ndarray:
    s, q = np.linalg.eigh(f)
    return (q * np.sqrt(np.maximum(s, 0))) @ q.T


def _dense_ekfac(p: Any, x: jax.Array, y: jax.Array, kind: str) -> tuple[np.ndarray, list]:
    """EKFAC built by hand in parameter order: per layer, ``Q = eig(A) (x) eig(G)`` and
    ``s = mean_n sum_c (Q_A^T V_nc Q_G)^2`` with ``V_nc = [x_n; 1] (J_n^T c)^T`` the example's
    gradient for each column ``c`` of ``sqrt(F_L)`` (type-2) or for the observed target (empirical)."""
    n = x.shape[0]
    pre1, logits = tanh_mlp_apply(p, x)
    probs = np.asarray(jax.nn.softmax(logits))
    if kind == "type-2":
        cots = [_sym_sqrt(np.diag(q) - np.outer(q, q)).T for q in probs]  # rows: the columns c
    else:
        cots = [(q - np.eye(3)[int(t)])[None, :] for q, t in zip(probs, np.asarray(y))]
    d1 = 1 - np.tanh(np.asarray(pre1)) ** 2
    jac = {1: [np.asarray(p["w2"]).T * d for d in d1], 2: [np.eye(3)] * n}  # d logits / d pre-activation
    inputs = {1: np.asarray(x), 2: np.tanh(np.asarray(pre1))}
    size = ravel_pytree(p)[0].size
    index = ravel_pytree(p)[1](jnp.arange(size, dtype=jnp.float64))
    out = np.zeros((size, size))
    bases = []
    for layer in (1, 2):
        xt = np.concatenate([inputs[layer], np.ones((n, 1))], axis=1)
        dys = [[j.T @ c for c in cs] for j, cs in zip(jac[layer], cots)]  # per example, per column
        a = xt.T @ xt / n
        g = sum(np.outer(dy, dy) for ds in dys for dy in ds) / n
        qa, qg = np.linalg.eigh(a)[1], np.linalg.eigh(g)[1]
        s = sum((qa.T @ np.outer(xn, dy) @ qg) ** 2 for xn, ds in zip(xt, dys) for dy in ds) / n
        q = np.kron(qa, qg)  # acts on the row-major vec of V = [W; b^T]
        idx = np.concatenate([np.asarray(index[f"w{layer}"]).astype(int).ravel(), np.asarray(index[f"b{layer}"]).astype(int)])
        out[np.ix_(idx, idx)] = (q * s.ravel()) @ q.T
        bases.append((idx, q, s.ravel(), np.kron(a, g)))
    return out, bases


@pytest.mark.parametrize("kind", ["type-2", "empirical"])
def test_kfac_with_ekfac_blocks_equals_the_dense_construction(kind):
    p, (x, y) = tanh_mlp_problem()
    want, bases = _dense_ekfac(p, x, y, kind)
    # two batches: the factors and the corrections are means over all 24 examples
    K = ops.kfac(tanh_mlp_loss, p, [(x[:10], y[:10]), (x[10:], y[10:])], fisher_type=kind, layer_tag_to_block_ctor=EKFAC)
    assert all(isinstance(b, curvax.DenseEigenvalueCorrected) for b in K.estimator.blocks)
    got = np.asarray(K.to_dense())
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    # not the diagonal Fisher that an identity basis gives (issue 24), nor K-FAC
    diag_fisher = np.diag(np.diag(np.asarray(ops.fisher(tanh_mlp_loss, p, (x, y), kind=kind).to_dense())))
    assert np.abs(got - diag_fisher).max() > 1e-2
    kfac = np.asarray(ops.kfac(tanh_mlp_loss, p, (x, y), fisher_type=kind, separate_weight_and_bias=False).to_dense())
    assert np.abs(got - kfac).max() > 1e-3
    # per layer: the basis diagonalises A (x) G, and s is the exact Fisher's diagonal in it
    fisher = np.asarray(ops.fisher(tanh_mlp_loss, p, (x, y), kind=kind).to_dense())
    for idx, q, s, ag in bases:
        t = q.T @ ag @ q
        np.testing.assert_allclose(t - np.diag(np.diag(t)), 0, atol=1e-12)
        np.testing.assert_allclose(np.diag(q.T @ fisher[np.ix_(idx, idx)] @ q), s, rtol=1e-9, atol=1e-13)
    # the operator's closed forms on it
    ev = np.linalg.eigvalsh(want)
    v = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (want.shape[0],)))
    np.testing.assert_allclose(K.eigenvalues(), ev, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(K.logdet(0.1), np.linalg.slogdet(want + 0.1 * np.eye(len(v)))[1], rtol=1e-10)
    np.testing.assert_allclose(K.inverse(0.1) @ v, np.linalg.solve(want + 0.1 * np.eye(len(v)), v), rtol=1e-9)


def _linear_loss(p: Any, batch: Any) -> jax.Array:
    out = batch[0] @ p["w"] + p["b"]
    curvax.register_squared_error_loss(out, batch[1], weight=0.5)
    return 0.5 * jnp.mean(jnp.sum((out - batch[1]) ** 2, axis=1))


def test_ekfac_is_the_fisher_where_kfac_is_exact():
    # linear regression with a squared error: F = E[x x^T] (x) I = A (x) G exactly, diagonal in
    # the Kronecker eigenbasis, so EKFAC (and K-FAC) equal the exact type-2 Fisher
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((4, 3))), "b": jnp.asarray(rng.standard_normal(3))}
    batch = (jnp.asarray(rng.standard_normal((16, 4)) + 0.5), jnp.asarray(rng.standard_normal((16, 3))))
    fisher = np.asarray(ops.fisher(_linear_loss, p, batch, kind="type-2").to_dense())
    K = ops.kfac(_linear_loss, p, batch, fisher_type="type-2", layer_tag_to_block_ctor=EKFAC)
    np.testing.assert_allclose(np.asarray(K.to_dense()), fisher, rtol=1e-10, atol=1e-13)
    # one example, empirical Fisher: every block is the rank-one g g^T, which EKFAC reproduces
    one = (batch[0][:1], batch[1][:1])
    emp = np.asarray(ops.fisher(_linear_loss, p, one, kind="empirical").to_dense())
    K1 = ops.kfac(_linear_loss, p, one, fisher_type="empirical", layer_tag_to_block_ctor=EKFAC)
    np.testing.assert_allclose(np.asarray(K1.to_dense()), emp, rtol=1e-10, atol=1e-12)
