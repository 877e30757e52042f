"""``curvax.operators``: every method against dense oracles (``to_dense_matrix``, ``jax.hessian``,
``jax.jacobian``) on small float64 MLP and CNN models; stochastic estimators at their stated rates."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.flatten_util import ravel_pytree

import curvax
from curvax import operators as ops

pytestmark = pytest.mark.usefixtures("x64")


# ----------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------


def _mlp_apply(p: Any, x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    out = h @ p["w2"] + p["b2"]
    return out * p["t"] if "t" in p else out


def _mlp_loss(p: Any, batch: Any) -> jax.Array:
    logits = _mlp_apply(p, batch[0])
    curvax.register_softmax_cross_entropy_loss(logits, batch[1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], axis=1))


def _mlp_params(scale_layer: bool = True, seed: int = 0) -> dict:
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    p = {"w1": jax.random.normal(k[0], (4, 5)) / 2, "b1": 0.1 * jax.random.normal(k[1], (5,)),
         "w2": jax.random.normal(k[2], (5, 3)) / 2, "b2": 0.1 * jax.random.normal(k[3], (3,))}
    if scale_layer:
        p["t"] = jnp.asarray(1.3)
    return p


def _mlp_batch(n: int = 24, seed: int = 1) -> tuple:
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    return jax.random.normal(k[0], (n, 4)), jax.random.randint(k[1], (n,), 0, 3)


def _cnn_apply(p: Any, x: jax.Array) -> jax.Array:
    h = lax.conv_general_dilated(x, p["conv"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jnp.tanh(h + p["conv"]["b"])
    return h.reshape(x.shape[0], -1) @ p["out"]["w"] + p["out"]["b"]


def _cnn_loss(p: Any, batch: Any) -> jax.Array:
    logits = _cnn_apply(p, batch[0])
    curvax.register_softmax_cross_entropy_loss(logits, batch[1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], axis=1))


def _cnn_problem() -> tuple:
    rng = np.random.default_rng(3)
    p = {"conv": {"w": jnp.asarray(rng.standard_normal((2, 2, 2, 3)) / 2), "b": jnp.asarray(0.1 * rng.standard_normal(3))},
         "out": {"w": jnp.asarray(rng.standard_normal((3 * 9, 3)) / 4), "b": jnp.zeros(3)}}
    batch = (jnp.asarray(rng.standard_normal((6, 3, 3, 2))), jnp.arange(6) % 3)
    return _cnn_loss, p, batch


def _estimate(loss: Any, params: Any, batch: Any, ctors: Any = None, mode: str = "fisher_exact") -> tuple:
    est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor=ctors)
    state = est.init(jax.random.PRNGKey(1), (params, batch), None, None)
    state = est.update_curvature_matrix_estimate(
        state, 0.0, 1.0, batch[1].shape[0], jax.random.PRNGKey(2), (params, batch), estimation_mode=mode
    )
    return est, state


@functools.lru_cache(maxsize=None)
def _problem(kind: str) -> tuple:
    if kind == "cnn":
        loss, p, batch = _cnn_problem()
        est, state = _estimate(loss, p, batch)
    else:
        p, batch = _mlp_params(), _mlp_batch()
        ctors = {"dense": curvax.DenseEigenvalueCorrected} if kind == "mlp-ekfac" else None
        if kind == "mlp-full":
            ctors = {"dense": curvax.DenseFull, "scale_and_shift": curvax.ScaleAndShiftFull}
        est, state = _estimate(_mlp_loss, p, batch, ctors)
    return est, state, p


KINDS = ["mlp-kfac", "mlp-ekfac", "mlp-full", "cnn"]


def _tol(a: Any, b: Any, rtol: float = 1e-10, atol: float = 1e-10) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _eigh_pow(m: np.ndarray, p: float) -> np.ndarray:
    s, q = np.linalg.eigh(m)
    return (q * s**p) @ q.T


# ----------------------------------------------------------------------------------
# 1. Block-diagonal operators
# ----------------------------------------------------------------------------------


def _block_quantities(K: Any, v: jax.Array, mat: jax.Array, tree_v: Any) -> dict:
    """Everything ``test_block_operator_methods_equal_the_dense_matrix`` checks, in one compiled call."""
    out = {"mv": K @ v, "tree": K @ tree_v, "cols": K @ mat, "dense": K.to_dense(), "diag": K.diagonal(),
           "trace": K.trace(), "fro": K.frobenius_norm(), "eig": K.eigenvalues(), "pow2": K.power(2).to_dense()}
    for i, d in enumerate((1e-3, 0.5)):
        inv = K.inverse(damping=d)
        out[f"d{i}"] = (K.logdet(damping=d), K.det(d), inv @ v, inv.diagonal(), inv.trace(), inv.logdet(),
                        inv.frobenius_norm())
    damped = K.damped(0.2)
    root = damped.power(0.5)
    out["damped"] = (damped.trace(), damped.frobenius_norm(), damped.diagonal())
    out["root"] = (root.to_dense(), root.diagonal(), root.trace(), (root @ root) @ v, root.inverse().to_dense())
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_block_operator_methods_equal_the_dense_matrix(kind):
    est, state, params = _problem(kind)
    dense = np.asarray(est.to_dense_matrix(state))
    n = dense.shape[0]
    eye = np.eye(n)
    K = ops.from_estimator(est, state)
    assert K.shape == (n, n) and K.is_symmetric and K.T is K
    v = jax.random.normal(jax.random.PRNGKey(5), (n,))
    mat = jax.random.normal(jax.random.PRNGKey(6), (n, 3))
    _, unravel = ravel_pytree(params)
    got = jax.jit(_block_quantities)(K, v, mat, unravel(v))
    _tol(got["mv"], dense @ v)
    _tol(ravel_pytree(got["tree"])[0], dense @ v)  # a parameter pytree
    _tol(got["cols"], dense @ mat)  # columns
    _tol(got["dense"], dense)
    _tol(got["diag"], np.diag(dense))
    _tol(got["trace"], np.trace(dense))
    _tol(got["fro"], np.linalg.norm(dense))
    _tol(got["eig"], np.linalg.eigvalsh(dense), atol=1e-9)
    _tol(got["pow2"], dense @ dense)
    for i, d in enumerate((1e-3, 0.5)):
        logdet, det, inv_v, inv_diag, inv_tr, inv_logdet, inv_fro = got[f"d{i}"]
        _tol(logdet, np.linalg.slogdet(dense + d * eye)[1], rtol=1e-9)
        _tol(det, np.linalg.det(dense + d * eye), rtol=1e-8, atol=0)
        want = np.linalg.inv(dense + d * eye)
        _tol(inv_v, want @ v, rtol=1e-8)
        _tol(inv_diag, np.diag(want), rtol=1e-8)
        _tol(inv_tr, np.trace(want), rtol=1e-8)
        _tol(inv_logdet, -np.linalg.slogdet(dense + d * eye)[1], rtol=1e-9)
        _tol(inv_fro, np.linalg.norm(want), rtol=1e-8)
    tr, fro, diag = got["damped"]
    _tol(tr, np.trace(dense) + 0.2 * n)
    _tol(fro, np.linalg.norm(dense + 0.2 * eye))
    _tol(diag, np.diag(dense) + 0.2)
    root, root_diag, root_tr, square_v, root_inv = got["root"]
    want_root = _eigh_pow(dense + 0.2 * eye, 0.5)
    _tol(root, want_root, rtol=1e-8)
    _tol(root_diag, np.diag(want_root), rtol=1e-8)
    _tol(root_tr, np.trace(want_root), rtol=1e-8)
    _tol(square_v, (dense + 0.2 * eye) @ v, rtol=1e-8)
    _tol(root_inv, _eigh_pow(dense + 0.2 * eye, -0.5), rtol=1e-7)
    # the same numbers outside jit (static-zero damping paths)
    _tol(K.trace(), np.trace(dense))
    _tol(K.logdet(1e-3), got["d0"][0])


def test_pi_adjusted_inverse_is_kfac_jax_approximate_inverse():
    est, state, params = _problem("mlp-kfac")
    flat, unravel = ravel_pytree(params)
    v = jax.random.normal(jax.random.PRNGKey(7), flat.shape)
    K = ops.from_estimator(est, state)

    @jax.jit
    def quantities(K: Any, d: jax.Array) -> tuple:
        approx = K.inverse(d, exact=False)
        want = ravel_pytree(est.multiply_matpower(state, unravel(v), d, -1, False, False))[0]
        return (approx @ v, want, approx.to_dense(), approx.trace(), approx.diagonal(), approx.logdet(),
                approx.frobenius_norm(), approx.eigenvalues(), K.inverse(d).to_dense(), approx.inverse().to_dense())

    for d in (1e-2, 1.0):
        av, want, dense_inv, tr, diag, logdet, fro, eig, exact, back = quantities(K, d)
        _tol(av, want)
        dense_inv = np.asarray(dense_inv)
        _tol(tr, np.trace(dense_inv), rtol=1e-9)
        _tol(diag, np.diag(dense_inv), rtol=1e-9)
        _tol(logdet, np.linalg.slogdet(dense_inv)[1], rtol=1e-9)
        _tol(fro, np.linalg.norm(dense_inv), rtol=1e-9)
        _tol(eig, np.linalg.eigvalsh(dense_inv), rtol=1e-8, atol=1e-9)
        # the approximation differs from the exact damped inverse, but not by much
        assert 0 < np.linalg.norm(dense_inv - exact) < np.linalg.norm(exact)
        _tol(back, np.linalg.inv(dense_inv), rtol=1e-8)


def test_pi_adjusted_inverse_is_exact_where_a_factor_is_one_wide():
    """A layer with one output (a wavefunction's or a regression's last layer) has a 1 x 1
    outputs factor ``g``: ``A (x) g + d I = g A + d I`` is itself a Kronecker product, so the
    approximate inverse is exact there (kfac-jax 0.0.8's rule), while the wider layer's block
    keeps the pi-split approximation."""
    k = jax.random.split(jax.random.PRNGKey(4), 4)
    params = {"w1": jax.random.normal(k[0], (3, 4)) / 2, "w2": jax.random.normal(k[1], (4, 1))}
    batch = (jax.random.normal(k[2], (10, 3)), jax.random.normal(k[3], (10, 1)))

    def loss(p: Any, b: Any) -> jax.Array:
        out = jnp.tanh(b[0] @ p["w1"]) @ p["w2"]
        curvax.register_squared_error_loss(out, b[1])
        return 0.5 * jnp.mean(jnp.sum((out - b[1]) ** 2, axis=-1))

    est, state = _estimate(loss, params, batch)
    dense = np.asarray(est.to_dense_matrix(state))
    K = ops.from_estimator(est, state)
    for d in (1e-3, 0.5):
        approx = np.asarray(K.inverse(d, exact=False).to_dense())
        exact = np.linalg.inv(dense + d * np.eye(dense.shape[0]))
        _tol(approx[12:, 12:], exact[12:, 12:], rtol=1e-9)  # w2: 4 x 1, outputs factor 1 x 1
        assert np.linalg.norm(approx[:12, :12] - exact[:12, :12]) > 1e-3 * np.linalg.norm(exact[:12, :12])
        # the optimizer's approximate inverse (the estimator's) gives the same numbers
        v = jax.random.normal(jax.random.PRNGKey(9), (16,))
        got = est.multiply_matpower(state, {"w1": v[:12].reshape(3, 4), "w2": v[12:].reshape(4, 1)}, d, -1, False, False)
        _tol(np.ravel(got["w2"]), exact[12:, 12:] @ np.asarray(v[12:]), rtol=1e-9)


def _damp_factors(state: Any, da: float, dg: float) -> Any:
    """The state whose Kronecker factors are ``A + da I`` and ``G + dg I`` (scale 1 blocks)."""
    state = jax.tree_util.tree_map(lambda x: x, state)
    for s in state.blocks_states:
        s.inputs_factor.value = s.inputs_factor.value + da * jnp.eye(s.inputs_factor.value.shape[0])
        s.outputs_factor.value = s.outputs_factor.value + dg * jnp.eye(s.outputs_factor.value.shape[0])
    return state


def test_per_factor_damping_and_min_damping_floor():
    params, batch = _mlp_params(scale_layer=False), _mlp_batch()
    est, state = _estimate(_mlp_loss, params, batch)
    K = ops.from_estimator(est, state)
    want = np.linalg.inv(np.asarray(est.to_dense_matrix(_damp_factors(state, 0.3, 0.02))))
    _tol(K.inverse((0.3, 0.02), exact=False).to_dense(), want, rtol=1e-8)
    floored = np.linalg.inv(np.asarray(est.to_dense_matrix(_damp_factors(state, 0.3, 0.1))))
    _tol(K.inverse((0.3, 0.02), exact=False, min_damping=0.1).to_dense(), floored, rtol=1e-8)
    # the floor on exact damping
    dense = np.asarray(est.to_dense_matrix(state))
    _tol(K.inverse(0.0, min_damping=0.05).to_dense(), np.linalg.inv(dense + 0.05 * np.eye(dense.shape[0])), rtol=1e-8)


def test_composite_operators():
    est, state, params = _problem("mlp-kfac")
    K = ops.from_estimator(est, state)
    dense = np.asarray(est.to_dense_matrix(state))
    n = dense.shape[0]
    eye = np.eye(n)
    v = jax.random.normal(jax.random.PRNGKey(8), (n,))

    @jax.jit
    def quantities(K: Any, v: jax.Array) -> dict:
        M = K.inverse(0.3, exact=False)
        S, P, Kd, I = K + M, K @ M, K.damped(0.1), ops.identity(K)
        return {
            "M": M.to_dense(), "scaled": ((2.5 * K) @ v, (K * 2.5).trace(), (K / 4).frobenius_norm(),
                                          (3.0 * K).logdet(0.1), (3.0 * K).inverse(0.1) @ v, (3.0 * K).eigenvalues()),
            "sum": (S @ v, S.trace(), S.diagonal(), S.logdet(), (K - K).frobenius_norm()),
            "product": (P @ v, P.T @ v, P.to_dense(), P.trace(), P.damped(0.1).logdet(), (Kd @ M).logdet(), Kd.to_dense()),
            "identity": ((K + 0.1 * I).inverse() @ v, Kd.power(-1) @ v),
        }

    got = quantities(K, v)
    dm = np.asarray(got["M"])
    mv, tr, fro, logdet, inv_v, eig = got["scaled"]
    _tol(mv, 2.5 * dense @ v)
    _tol(tr, 2.5 * np.trace(dense))
    _tol(fro, np.linalg.norm(dense) / 4)
    _tol(logdet, np.linalg.slogdet(3 * dense + 0.1 * eye)[1], rtol=1e-9)
    _tol(inv_v, np.linalg.solve(3 * dense + 0.1 * eye, v), rtol=1e-8)
    _tol(eig, np.linalg.eigvalsh(3 * dense), atol=1e-9)
    mv, tr, diag, logdet, zero = got["sum"]
    _tol(mv, (dense + dm) @ v)
    _tol(tr, np.trace(dense + dm))
    _tol(diag, np.diag(dense + dm))
    _tol(logdet, np.linalg.slogdet(dense + dm)[1], rtol=1e-9)
    _tol(zero, 0.0)
    assert not (K @ K.inverse(0.3, exact=False)).is_symmetric and (K @ K).is_symmetric
    mv, tmv, pd, tr, logdet, logdet2, kd = got["product"]
    _tol(mv, dense @ dm @ v)
    _tol(tmv, dm @ dense @ v)
    _tol(pd, dense @ dm)
    _tol(tr, np.trace(dense @ dm), rtol=1e-9)
    _tol(logdet, np.linalg.slogdet(dense @ dm + 0.1 * eye)[1], rtol=1e-9)
    _tol(logdet2, np.linalg.slogdet(np.asarray(kd) @ dm)[1], rtol=1e-9)
    for x in got["identity"]:
        _tol(x, np.linalg.solve(dense + 0.1 * eye, v), rtol=1e-8)


def test_operators_inside_jit_and_vmap():
    est, state, params = _problem("mlp-kfac")
    K = ops.from_estimator(est, state)
    dense = np.asarray(est.to_dense_matrix(state))
    n = dense.shape[0]
    vs = jax.random.normal(jax.random.PRNGKey(9), (5, n))

    @jax.jit
    def f(op, v, d):
        inv = op.inverse(d)
        return op @ v, inv @ v, op.logdet(d), op.trace(), (2.0 * op + inv).diagonal(), op.inverse(d, exact=False) @ v

    mv, iv, ld, tr, dg, av = f(K, vs[0], 0.25)
    _tol(mv, dense @ vs[0])
    _tol(iv, np.linalg.solve(dense + 0.25 * np.eye(n), vs[0]), rtol=1e-8)
    _tol(ld, np.linalg.slogdet(dense + 0.25 * np.eye(n))[1], rtol=1e-9)
    _tol(tr, np.trace(dense))
    _tol(dg, 2 * np.diag(dense) + np.diag(np.linalg.inv(dense + 0.25 * np.eye(n))), rtol=1e-8)
    _tol(av, K.inverse(0.25, exact=False) @ vs[0])
    _tol(jax.vmap(lambda v: K @ v)(vs), vs @ dense)
    _tol(jax.jit(jax.vmap(lambda v: (K @ K) @ v))(vs), vs @ dense @ dense)
    leaves, treedef = jax.tree_util.tree_flatten(K)
    assert jax.tree_util.tree_unflatten(treedef, leaves).trace() == K.trace()


def test_bad_input_errors_name_the_argument():
    est, state, params = _problem("mlp-kfac")
    K = ops.from_estimator(est, state)
    n = K.dim
    with pytest.raises(ValueError, match="`v` has shape"):
        K @ jnp.ones(n + 1)
    with pytest.raises(ValueError, match="`v` has shape"):
        K @ jnp.ones((n + 1, 2))
    with pytest.raises(ValueError, match="`damping` must be a finite number >= 0"):
        K.inverse(-1.0)
    with pytest.raises(ValueError, match="`damping` must be a finite number >= 0"):
        K.logdet(damping=-0.1)
    with pytest.raises(ValueError, match="`min_damping`"):
        K.inverse(0.1, min_damping=-1.0)
    with pytest.raises(ValueError, match="`damping` tuple .* needs `exact=False`"):
        K.inverse((0.1, 0.1))
    with pytest.raises(ValueError, match="Kronecker-factored blocks"):
        K.inverse((0.1, 0.1), exact=False)  # the scale layer has a diagonal block
    with pytest.raises(TypeError, match="`estimator`"):
        ops.from_estimator(object(), state)
    other = ops.identity({"a": jnp.ones(3)})
    with pytest.raises(ValueError, match="different parameters"):
        K + other
    # singular without damping: 3 examples cannot fill the 5x5 input factor of the first layer
    params, batch = _mlp_params(scale_layer=False), _mlp_batch(n=3)
    est2, state2 = _estimate(_mlp_loss, params, batch)
    K2 = ops.from_estimator(est2, state2)
    with pytest.raises(ValueError, match="singular .* pass `damping` > 0"):
        K2.inverse()
    with pytest.raises(ValueError, match="singular .* pass `damping` > 0"):
        K2.inverse((0.0, 0.0), exact=False)
    assert np.isfinite(K2.inverse(1e-3).trace())


# ----------------------------------------------------------------------------------
# 2. Exact matrix-free operators
# ----------------------------------------------------------------------------------


def _dense_oracles(apply: Any, params: Any, batches: list) -> dict:
    """GGN, Hessian and empirical Fisher of the mean cross-entropy over all ``batches``."""
    x = jnp.concatenate([b[0] for b in batches])
    y = jnp.concatenate([b[1] for b in batches])
    flat, unravel = ravel_pytree(params)

    @jax.jit
    def oracles(flat: jax.Array, x: jax.Array, y: jax.Array) -> dict:
        n = x.shape[0]

        def ce(logits: jax.Array) -> jax.Array:
            return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]

        jac = jax.jacobian(lambda f: apply(unravel(f), x).ravel())(flat)  # (n C, P)
        h_out = jax.hessian(lambda z: jnp.mean(ce(z.reshape(n, -1))))(apply(unravel(flat), x).ravel())
        per_example = jax.jacobian(lambda f: ce(apply(unravel(f), x)))(flat)  # (n, P)
        return {
            "ggn": jac.T @ h_out @ jac,
            "hessian": jax.hessian(lambda f: jnp.mean(ce(apply(unravel(f), x))))(flat),
            "empirical": per_example.T @ per_example / n,
            "jac": jac,
        }

    return oracles(flat, x, y)


def _split(batch: tuple, sizes: list) -> list:
    cuts = np.cumsum(sizes)[:-1]
    return [(x, y) for x, y in zip(jnp.split(batch[0], cuts), jnp.split(batch[1], cuts))]


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_exact_operators_equal_dense_jacobian_and_hessian(model):
    if model == "mlp":
        loss, apply, params, batch = _mlp_loss, _mlp_apply, _mlp_params(), _mlp_batch()
    else:
        loss, params, batch = _cnn_problem()
        apply = _cnn_apply
    n = batch[0].shape[0]
    batches = _split(batch, [n // 3, n - n // 3])  # unequal batch sizes
    want = _dense_oracles(apply, params, batches)
    flat, unravel = ravel_pytree(params)
    v = jax.random.normal(jax.random.PRNGKey(11), flat.shape)
    G = ops.ggn(loss, params, batches)
    _tol(G.to_dense(), want["ggn"])
    _tol(ravel_pytree(jax.jit(lambda op, v: op @ v)(G, unravel(v)))[0], want["ggn"] @ v)  # pytrees
    H = ops.hessian(loss, params, batches)
    assert not H.is_psd
    _tol(H.to_dense(), want["hessian"])
    # the dataset weights B_i / num_data, for a list, an iterator, one batch and a given num_data
    assert G.weights == (1 / 3, 2 / 3) and len(ops.ggn(loss, params, iter(batches)).batches) == 2
    assert ops.ggn(loss, params, batches, num_data=2 * n).weights == (1 / 6, 1 / 3)
    assert ops.ggn(loss, params, batch).weights == (1.0,)
    if model == "cnn":
        return
    _tol(ops.ggn(loss, params, batch).to_dense(), want["ggn"])
    _tol(ops.fisher(loss, params, batches).to_dense(), want["ggn"])  # type-2 Fisher = GGN for softmax CE
    _tol(ops.fisher(loss, params, batches, kind="empirical").to_dense(), want["empirical"])
    # an exact operator composes with a K-FAC one
    est, state = _estimate(loss, params, batch)
    K = ops.from_estimator(est, state)
    _tol((G + 0.5 * K).to_dense(), want["ggn"] + 0.5 * np.asarray(est.to_dense_matrix(state)))


def test_mc_fisher_is_the_sampled_gradient_outer_products_and_converges():
    params, batch = _mlp_params(), _mlp_batch(n=8)
    flat, _ = ravel_pytree(params)
    want = _dense_oracles(_mlp_apply, params, [batch])
    rng = jax.random.PRNGKey(4)
    F = ops.fisher(_mlp_loss, params, batch, kind="mc", mc_samples=3, rng=rng)
    # oracle: the same sampled loss cotangents c_nm, contracted with the dense Jacobian
    losses, _ = curvax.loss_tags_vjp(_mlp_loss)((params, batch))
    keys = jax.random.split(jax.random.fold_in(rng, 0), 3)
    cots = [curvax.estimators.loss_cotangents(losses, k, "fisher_gradients")[0][0] for k in keys]  # (n, C) each
    jac = want["jac"].reshape(8, 3, -1)
    grads = jnp.stack([jnp.einsum("nc,ncp->np", c, jac) for c in cots])  # (M, n, P)
    dense_mc = jnp.einsum("mnp,mnq->pq", grads, grads) / (8 * 3)
    _tol(F.to_dense(), dense_mc)
    assert np.linalg.matrix_rank(np.asarray(dense_mc)) <= 8 * 3 < flat.size
    # unbiased: the error to the type-2 Fisher shrinks with mc_samples
    many = ops.fisher(_mlp_loss, params, batch, kind="mc", mc_samples=4096, rng=rng).to_dense()
    errs = [np.linalg.norm(dense_mc - want["ggn"]), np.linalg.norm(many - want["ggn"])]
    assert errs[1] < 0.1 * np.linalg.norm(want["ggn"]) and errs[1] < errs[0] / 8


def test_exact_operator_in_jit_and_vmap_and_bad_input():
    params, batch = _mlp_params(), _mlp_batch(n=8)
    want = _dense_oracles(_mlp_apply, params, [batch])["ggn"]
    G = ops.ggn(_mlp_loss, params, batch)
    vs = jax.random.normal(jax.random.PRNGKey(12), (4, G.dim))
    _tol(jax.jit(lambda op, v: op @ v)(G, vs[0]), want @ vs[0])
    _tol(jax.jit(jax.vmap(lambda v: G @ v))(vs), vs @ want)
    with pytest.raises(ValueError, match="`v` has shape"):
        G @ jnp.ones(3)
    with pytest.raises(ValueError, match="`kind` must be one of"):
        ops.fisher(_mlp_loss, params, batch, kind="type-1")
    with pytest.raises(ValueError, match="`rng` is needed"):
        ops.fisher(_mlp_loss, params, batch, kind="mc")
    with pytest.raises(ValueError, match="`mc_samples` must be an integer >= 1"):
        ops.fisher(_mlp_loss, params, batch, kind="mc", mc_samples=0, rng=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="`num_data` must be an integer >= 1"):
        ops.ggn(_mlp_loss, params, batch, num_data=0)
    with pytest.raises(ValueError, match="`data` has no batches"):
        ops.ggn(_mlp_loss, params, [])


# ----------------------------------------------------------------------------------
# 3. Matrix-free estimators
# ----------------------------------------------------------------------------------


def _spectrum_operator(dim: int, eigenvalues: np.ndarray, seed: int = 0) -> tuple:
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((dim, dim)))
    m = (q * eigenvalues) @ q.T
    return ops.dense(m, jnp.zeros(dim)), m


def _errors(estimator: Any, op: Any, m: int, truth: np.ndarray, seeds: int) -> np.ndarray:
    keys = jax.random.split(jax.random.PRNGKey(m), seeds)
    est = jax.jit(jax.vmap(lambda k: estimator(op, k, m)))(keys)
    return np.asarray(est) - truth


def test_hutchinson_error_shrinks_as_one_over_sqrt_m_with_the_stated_variance():
    est, state, _ = _problem("mlp-kfac")
    dense = np.asarray(est.to_dense_matrix(state))
    K = ops.dense(dense, jnp.zeros(dense.shape[0]))  # the K-FAC matrix, cheap products
    var1 = 2 * (np.sum(dense**2) - np.sum(np.diag(dense) ** 2))  # variance of one sample
    var1_diag = np.sum(dense**2, axis=1) - np.diag(dense) ** 2
    ms = np.array([16, 64, 256, 1024])
    stds, diag_rms = [], []
    for m in ms:
        err = _errors(ops.hutchinson_trace, K, int(m), np.trace(dense), 400)
        stds.append(np.std(err))
        assert abs(np.mean(err)) < 4 * np.sqrt(var1 / m / 400)  # unbiased
        np.testing.assert_allclose(np.std(err), np.sqrt(var1 / m), rtol=0.15)  # the stated variance
        derr = _errors(ops.hutchinson_diagonal, K, int(m), np.diag(dense), 100)
        diag_rms.append(np.sqrt(np.mean(derr**2)))
        np.testing.assert_allclose(np.sum(np.mean(derr**2, axis=0)), np.sum(var1_diag) / m, rtol=0.2)
    slope = np.polyfit(np.log(ms), np.log(stds), 1)[0]
    diag_slope = np.polyfit(np.log(ms), np.log(diag_rms), 1)[0]
    assert -0.6 < slope < -0.4 and -0.6 < diag_slope < -0.4, (slope, diag_slope)


def test_hutchpp_error_shrinks_as_one_over_m_and_is_exact_for_low_rank():
    op, m_dense = _spectrum_operator(300, 1.0 / np.arange(1, 301))
    ms = np.array([12, 48, 192])
    rms_pp = [np.sqrt(np.mean(_errors(ops.hutchpp_trace, op, int(m), np.trace(m_dense), 100) ** 2)) for m in ms]
    rms_h = np.sqrt(np.mean(_errors(ops.hutchinson_trace, op, 192, np.trace(m_dense), 100) ** 2))
    slope = np.polyfit(np.log(ms), np.log(rms_pp), 1)[0]
    assert slope < -0.85, slope  # O(1/m); Hutchinson is O(1/sqrt(m))
    assert rms_pp[-1] < rms_h / 3
    # rank r <= m/3: the sketch holds the whole range, both estimates are exact
    op_low, low = _spectrum_operator(40, np.r_[np.arange(5, 0, -1.0), np.zeros(35)])
    key = jax.random.PRNGKey(3)
    _tol(ops.hutchpp_trace(op_low, key, 18), np.trace(low))
    _tol(ops.hutchpp_diagonal(op_low, key, 18), np.diag(low))
    derr = _errors(ops.hutchpp_diagonal, op, 48, np.diag(m_dense), 50)
    herr = _errors(ops.hutchinson_diagonal, op, 48, np.diag(m_dense), 50)
    assert np.mean(derr**2) < np.mean(herr**2) / 2


def test_lanczos_top_eigenvalues():
    est, state, params = _problem("mlp-kfac")
    K = ops.from_estimator(est, state)
    want = np.sort(np.linalg.eigvalsh(np.asarray(est.to_dense_matrix(state))))[::-1]
    key = jax.random.PRNGKey(0)
    run = jax.jit(ops.lanczos_eigenvalues, static_argnums=(2, 3))
    _tol(run(K, key, K.dim, 5), want[:5], rtol=1e-8, atol=1e-10)  # dim steps: exact
    errs = [float(want[0] - run(K, key, k, 1)[0]) for k in (2, 4, 8)]
    assert all(e >= -1e-12 for e in errs)  # Ritz values are lower bounds
    assert errs[2] < errs[1] < errs[0] and errs[2] < 1e-3 * want[0]
    with pytest.raises(ValueError, match="`num_iterations`"):
        ops.lanczos_eigenvalues(K, key, K.dim + 1)
    with pytest.raises(ValueError, match="`num_samples` must be an integer >= 3"):
        ops.hutchpp_trace(K, key, 2)
    with pytest.raises(TypeError, match="`operator`"):
        ops.hutchinson_trace(np.eye(3), key, 4)


# ----------------------------------------------------------------------------------
# 4. lineax
# ----------------------------------------------------------------------------------


def test_lineax_cg_solve_on_the_exact_ggn_with_kfac_preconditioner():
    lx = pytest.importorskip("lineax")
    params, batch = _mlp_params(scale_layer=False), _mlp_batch()
    G = ops.ggn(_mlp_loss, params, batch)
    want_g = np.asarray(_dense_oracles(_mlp_apply, params, [batch])["ggn"])
    n = G.dim
    b = jax.random.normal(jax.random.PRNGKey(13), (n,))
    d = 1e-3
    want = np.linalg.solve(want_g + d * np.eye(n), b)
    lop = ops.to_lineax(G)
    assert lx.is_symmetric(lop) and lx.is_positive_semidefinite(lop)
    assert not lx.is_positive_semidefinite(ops.to_lineax(ops.hessian(_mlp_loss, params, batch)))
    x, stats = ops.solve(G, b, damping=d, return_stats=True, max_steps=500)
    _tol(x, want, rtol=1e-6, atol=1e-8)
    est, state = _estimate(_mlp_loss, params, batch)
    P = ops.from_estimator(est, state).inverse(d, exact=False)
    xp, stats_p = ops.solve(G, b, damping=d, preconditioner=P, return_stats=True, max_steps=500)
    _tol(xp, want, rtol=1e-6, atol=1e-8)
    # the exact inverse as preconditioner: CG converges at once
    exact_inv = ops.dense(np.linalg.inv(want_g + d * np.eye(n)), params)
    _, stats_e = ops.solve(G, b, damping=d, preconditioner=exact_inv, return_stats=True, max_steps=500)
    assert int(stats_e["num_steps"]) <= 2 < int(stats["num_steps"])
    _, unravel = ravel_pytree(params)
    _tol(ravel_pytree(ops.solve(G, unravel(b), damping=d))[0], want, rtol=1e-6, atol=1e-8)  # pytrees
    with pytest.raises(ValueError, match="`vector` must be"):
        ops.solve(G, jnp.ones(n + 1))
    with pytest.raises(ValueError, match="symmetric positive semi-definite"):
        ops.solve(ops.hessian(_mlp_loss, params, batch), b)
