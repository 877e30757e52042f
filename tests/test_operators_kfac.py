"""``curvax.operators.kfac``: curvlinops' ``KFACLinearOperator`` options (``separate_weight_and_bias``,
``fisher_type`` names, ``mc_samples``, ``kfac_approx``, ``num_data``) against Kronecker products
computed by hand on small float64 models."""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.flatten_util import ravel_pytree

import curvax
from models import tanh_mlp_apply, tanh_mlp_loss, tanh_mlp_problem
from curvax import operators as ops

pytestmark = pytest.mark.usefixtures("x64")


def _hand_kfac(p: Any, x: jax.Array, separate: bool, y: Any = None, kind: str = "type-2") -> np.ndarray:
    """The K-FAC matrix in parameter order, from per-example Jacobians and the softmax's Fisher
    (type-2), gradient outer products at the targets ``y`` (empirical) or identities (forward-only)."""
    n = x.shape[0]
    pre1, logits = tanh_mlp_apply(p, x)
    probs = np.asarray(jax.nn.softmax(logits))
    if kind == "type-2":
        fishers = [np.diag(q) - np.outer(q, q) for q in probs]
    else:
        r = probs - np.eye(3)[np.asarray(y)]
        fishers = [np.outer(v, v) for v in r]
    d1 = 1 - np.tanh(np.asarray(pre1)) ** 2
    w2 = np.asarray(p["w2"])
    jac = {1: [w2.T * d for d in d1], 2: [np.eye(3)] * n}  # d logits / d pre-activation, per example
    inputs = {1: np.asarray(x), 2: np.tanh(np.asarray(pre1))}
    _, unravel = ravel_pytree(p)
    flat_index = ravel_pytree(jax.tree_util.tree_map(lambda a: jnp.zeros_like(a), p))[0].size
    index = unravel(jnp.arange(flat_index, dtype=jnp.float64))
    out = np.zeros((flat_index, flat_index))
    for layer in (1, 2):
        g = sum(j.T @ f @ j for j, f in zip(jac[layer], fishers)) / n
        if kind == "forward-only":
            g = np.eye(g.shape[0])
        xs = inputs[layer]
        a_w = xs.T @ xs / n
        w_idx = np.asarray(index[f"w{layer}"]).astype(int).ravel()  # (in, out) row-major = vec of V's rows
        b_idx = np.asarray(index[f"b{layer}"]).astype(int)
        if separate:
            out[np.ix_(w_idx, w_idx)] = np.kron(a_w, g)
            out[np.ix_(b_idx, b_idx)] = g
        else:
            m = xs.mean(axis=0)
            a = np.block([[a_w, m[:, None]], [m[None, :], np.ones((1, 1))]])
            idx = np.concatenate([w_idx, b_idx])
            out[np.ix_(idx, idx)] = np.kron(a, g)
    return out


@pytest.mark.parametrize("separate", [True, False])
def test_kfac_blocks_equal_the_kronecker_products_by_hand(separate):
    p, (x, y) = tanh_mlp_problem()
    want = _hand_kfac(p, x, separate)
    # two batches of sizes 10 and 14: the factors are the means over all 24 examples
    K = ops.kfac(tanh_mlp_loss, p, [(x[:10], y[:10]), (x[10:], y[10:])], fisher_type=ops.FisherType.TYPE2,
                 separate_weight_and_bias=separate)
    np.testing.assert_allclose(np.asarray(K.to_dense()), want, rtol=1e-10, atol=1e-12)
    # the closed forms on the separate blocks: trace, logdet, Frobenius norm, exact damped inverse
    d = 0.1
    ev = np.linalg.eigvalsh(want)
    v = np.asarray(jax.random.normal(jax.random.PRNGKey(4), (want.shape[0],)))
    tr, fro, logdet, eig, inv_v = jax.jit(
        lambda K: (K.trace(), K.frobenius_norm(), K.logdet(d), K.eigenvalues(), K.inverse(d) @ v))(K)
    np.testing.assert_allclose(tr, np.trace(want), rtol=1e-10)
    np.testing.assert_allclose(fro, np.linalg.norm(want), rtol=1e-10)
    np.testing.assert_allclose(logdet, np.sum(np.log(ev + d)), rtol=1e-10)
    np.testing.assert_allclose(eig, ev, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(inv_v, np.linalg.solve(want + d * np.eye(len(v)), v), rtol=1e-9)
    blocks = K.estimator.blocks
    assert all(type(b).__name__.endswith("SeparateWeightAndBias") == separate for b in blocks)
    # num_data: the operator of (sum of batch sizes / num_data) times the mean
    K2 = ops.kfac(tanh_mlp_loss, p, (x, y), fisher_type="type-2", separate_weight_and_bias=separate, num_data=48)
    np.testing.assert_allclose(np.asarray(K2.to_dense()), want / 2, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(jax.jit(lambda K: K.logdet(d))(K2), np.sum(np.log(ev / 2 + d)), rtol=1e-10)


def _cnn_loss(p: Any, batch: Any) -> jax.Array:
    h = lax.conv_general_dilated(batch[0], p["conv"]["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    logits = jnp.tanh(h + p["conv"]["b"]).reshape(batch[0].shape[0], -1) @ p["out"]["w"] + p["out"]["b"]
    curvax.register_softmax_cross_entropy_loss(logits, batch[1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], axis=1))


def test_separate_weight_and_bias_on_a_cnn_zeroes_exactly_the_weight_bias_cross_terms():
    rng = np.random.default_rng(3)
    p = {"conv": {"w": jnp.asarray(rng.standard_normal((2, 2, 2, 3)) / 2), "b": jnp.asarray(0.1 * rng.standard_normal(3))},
         "out": {"w": jnp.asarray(rng.standard_normal((27, 3)) / 4), "b": jnp.zeros(3)}}
    batch = (jnp.asarray(rng.standard_normal((6, 3, 3, 2))), jnp.arange(6) % 3)
    joint = ops.kfac(_cnn_loss, p, batch, fisher_type="empirical", separate_weight_and_bias=False)
    sep = ops.kfac(_cnn_loss, p, batch, fisher_type="empirical", separate_weight_and_bias=True)
    assert [type(b).__name__ for b in sep.estimator.blocks] == [
        "Conv2DTwoKroneckerFactoredSeparateWeightAndBias", "DenseTwoKroneckerFactoredSeparateWeightAndBias"]
    j, s = np.asarray(joint.to_dense()), np.asarray(sep.to_dense())
    index = ravel_pytree(jax.tree_util.tree_map(lambda a: jnp.zeros_like(a), p))[1](jnp.arange(j.shape[0], dtype=jnp.float64))
    mask = np.ones_like(j, dtype=bool)
    for layer in ("conv", "out"):
        w = np.asarray(index[layer]["w"]).astype(int).ravel()
        b = np.asarray(index[layer]["b"]).astype(int)
        mask[np.ix_(w, b)] = mask[np.ix_(b, w)] = False
    np.testing.assert_array_equal(s[~mask], 0.0)
    np.testing.assert_allclose(s[mask], j[mask], rtol=1e-12, atol=1e-15)
    assert np.abs(j[~mask]).max() > 1e-3  # the joint blocks do have cross terms


class _CurvlinopsFisherType(str, enum.Enum):  # how curvlinops defines FisherType
    TYPE2 = "type-2"
    MC = "mc"
    EMPIRICAL = "empirical"
    FORWARD_ONLY = "forward-only"


def test_fisher_type_names_and_mc_samples():
    p, batch = tanh_mlp_problem()
    assert ops.FISHER_TO_ESTIMATION_MODE == {"type-2": "fisher_exact", "mc": "fisher_gradients",
                                             "empirical": "fisher_empirical", "forward-only": "forward_only"}
    for member in (_CurvlinopsFisherType.TYPE2, _CurvlinopsFisherType.EMPIRICAL, _CurvlinopsFisherType.FORWARD_ONLY):
        K = ops.kfac(tanh_mlp_loss, p, batch, fisher_type=member)
        want = _hand_kfac(p, batch[0], True, batch[1], member.value)
        np.testing.assert_allclose(np.asarray(K.to_dense()), want, rtol=1e-10, atol=1e-12)
    # the exact operators take the same names
    np.testing.assert_allclose(np.asarray(ops.fisher(tanh_mlp_loss, p, batch, kind=_CurvlinopsFisherType.EMPIRICAL).to_dense()),
                               np.asarray(ops.fisher(tanh_mlp_loss, p, batch, kind="empirical").to_dense()), rtol=1e-12)
    # mc_samples: the MC K-FAC converges to the type-2 one (A is exact; each G is a mean of
    # mc_samples sampled outer products), its error falling as 1/sqrt(mc_samples)
    want = ops.kfac(tanh_mlp_loss, p, batch, fisher_type="type-2").state.blocks_states
    samples = np.array([1, 8, 64])
    errs = []
    for k in samples:
        err = 0.0
        for seed in range(2):
            got = ops.kfac(tanh_mlp_loss, p, batch, mc_samples=int(k), rng=jax.random.PRNGKey(seed)).state.blocks_states
            for g, w in zip(got, want):
                np.testing.assert_allclose(g.inputs_factor.value, w.inputs_factor.value, rtol=1e-12, atol=1e-15)
                err += float(np.sum((np.asarray(g.outputs_factor.value) - np.asarray(w.outputs_factor.value)) ** 2))
        errs.append(np.sqrt(err / 2))
    slope = np.polyfit(np.log(samples), np.log(errs), 1)[0]
    assert -0.75 < slope < -0.3, (slope, errs)


def test_kfac_bad_input_names_the_argument():
    p, batch = tanh_mlp_problem()
    with pytest.raises(ValueError, match="`mc_samples` must be 1 when `fisher_type` is 'type-2'"):
        ops.kfac(tanh_mlp_loss, p, batch, fisher_type="type-2", mc_samples=2)
    with pytest.raises(ValueError, match="`mc_samples` must be an integer >= 1"):
        ops.kfac(tanh_mlp_loss, p, batch, mc_samples=0)
    with pytest.raises(ValueError, match="`mc_samples` must be 1 when `kind`"):
        ops.fisher(tanh_mlp_loss, p, batch, kind="empirical", mc_samples=3)
    with pytest.raises(ValueError, match="`fisher_type` must be one of"):
        ops.kfac(tanh_mlp_loss, p, batch, fisher_type="ggn")
    with pytest.raises(ValueError, match="`kfac_approx` must be one of"):
        ops.kfac(tanh_mlp_loss, p, batch, kfac_approx="full")
    with pytest.raises(TypeError, match="`separate_weight_and_bias` must be a bool"):
        ops.kfac(tanh_mlp_loss, p, batch, separate_weight_and_bias="yes")
    with pytest.raises(ValueError, match="`num_data` must be an integer >= 1"):
        ops.kfac(tanh_mlp_loss, p, batch, num_data=0)
    with pytest.raises(TypeError, match="`base`"):
        ops.separate_bias_class(curvax.DenseEigenvalueCorrected)
    # a grouped convolution with kfac_approx='reduce': tests/test_conv_reduce.py
