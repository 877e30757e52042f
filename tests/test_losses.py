"""Loss functions against jax.hessian oracles; factors, sampling, masks, registration errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import losses as L

KEY = jax.random.PRNGKey(0)
B, D = 3, 4


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def make(kind, weight=1.3):
    k1, k2 = jax.random.split(KEY)
    z = jax.random.normal(k1, (B, D))
    if kind == "normal":
        return L.NormalMeanNegativeLogProbLoss(z, jax.random.normal(k2, (B, D)), variance=0.7, weight=weight)
    if kind == "bernoulli":
        return L.MultiBernoulliNegativeLogProbLoss(z, jax.random.bernoulli(k2, 0.5, (B, D)).astype(z.dtype), weight=weight)
    if kind == "categorical":
        return L.CategoricalLogitsNegativeLogProbLoss(z, jax.random.randint(k2, (B,), 0, D), weight=weight)
    if kind == "onehot":
        return L.OneHotCategoricalLogitsNegativeLogProbLoss(z, jax.nn.one_hot(jax.random.randint(k2, (B,), 0, D), D), weight=weight)
    raise ValueError(kind)


KINDS = ["normal", "bernoulli", "categorical", "onehot"]


def dense(loss, method, inner=None):
    """Per-case dense matrices of a linear map acting on (B, D) arrays, shape (B, D, D)."""
    shape = loss.parameter_dependants[0].shape
    cols = []
    for j in range(shape[-1]):
        e = jnp.zeros(shape).at[:, j].set(1.0)
        out = method((e,)) if inner is None else method(e)
        cols.append(out[0] if isinstance(out, tuple) else out)
    return jnp.stack(cols, axis=-1)


@pytest.mark.parametrize("kind", KINDS)
def test_fisher_and_ggn_equal_hessian_of_the_loss(kind):
    loss = make(kind)
    z = loss.parameter_dependants[0]
    # For natural parameters the Hessian of the negative log-likelihood is the Fisher (and GGN).
    hess = jax.hessian(lambda zz: jnp.sum(loss.copy_with_different_inputs((zz,)).evaluate()))(z)
    per_case = jnp.stack([hess[n, :, n, :] for n in range(B)])
    np.testing.assert_allclose(dense(loss, loss.multiply_fisher), per_case, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dense(loss, loss.multiply_ggn), per_case, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_factor_products_multiply_back(kind):
    loss = make(kind)
    f = dense(loss, loss.multiply_fisher)
    b = dense(loss, loss.multiply_fisher_factor, inner=True)
    np.testing.assert_allclose(jnp.einsum("nij,nkj->nik", b, b), f, rtol=1e-10, atol=1e-12)
    u = jax.random.normal(KEY, loss.fisher_factor_inner_shape)
    v = jax.random.normal(jax.random.PRNGKey(1), loss.parameter_dependants[0].shape)
    lhs = jnp.sum(loss.multiply_fisher_factor(u)[0] * v)
    rhs = jnp.sum(u * loss.multiply_fisher_factor_transpose((v,)))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-10)
    for j in range(D):
        want = loss.multiply_fisher_factor(jnp.zeros(loss.fisher_factor_inner_shape).at[:, j].set(1.0))[0]
        np.testing.assert_allclose(loss.multiply_fisher_factor_replicated_one_hot((j,))[0], want, rtol=1e-12)
        np.testing.assert_allclose(loss.multiply_ggn_factor_replicated_one_hot([j])[0], want, rtol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_monte_carlo_fisher_converges(kind):
    loss = make(kind, weight=1.0)
    grads = jax.vmap(lambda k: loss.grad_of_evaluate_on_sample(k, "sqrt")[0])(jax.random.split(KEY, 40000))
    mc = jnp.einsum("snd,sne->nde", grads, grads) / grads.shape[0]
    exact = dense(loss, loss.multiply_fisher)
    assert np.abs(mc - exact).max() < 0.04 * max(1.0, float(np.abs(exact).max()))


def test_weights_coefficient_modes_and_copies():
    loss = make("categorical", weight=4.0)
    plain = make("categorical", weight=1.0)
    np.testing.assert_allclose(loss.evaluate(), 4 * plain.evaluate())
    np.testing.assert_allclose(loss.evaluate(coefficient_mode="sqrt"), 2 * plain.evaluate())
    np.testing.assert_allclose(loss.evaluate(coefficient_mode="off"), plain.evaluate())
    np.testing.assert_allclose(loss.grad_of_evaluate(None, "regular")[0], 4 * plain.grad_of_evaluate(None, "regular")[0])
    with pytest.raises(ValueError, match="coefficient_mode"):
        loss.evaluate(coefficient_mode="double")
    z2 = jnp.zeros((B, D))
    copy = loss.copy_with_different_inputs((z2,))
    np.testing.assert_allclose(copy.evaluate(), 4 * np.log(D) * np.ones(B), rtol=1e-12)
    with pytest.raises(ValueError, match="1 parameter-dependent"):
        loss.copy_with_different_inputs((z2, z2))
    # Pytree round trip through jit.
    out = jax.jit(lambda l: l)(loss)
    assert isinstance(out, L.CategoricalLogitsNegativeLogProbLoss)
    np.testing.assert_allclose(out.evaluate(), loss.evaluate())


def test_squared_error_and_normal_evaluate():
    y = jnp.ones((2, 3))
    pred = jnp.zeros((2, 3))
    sq = L.NormalMeanNegativeLogProbLoss(pred, y, variance=0.5, weight=2.0, normalize_log_prob=False)
    np.testing.assert_allclose(sq.evaluate(), 2.0 * 3.0 * np.ones(2))  # weight * ||y - pred||^2
    full = L.NormalMeanNegativeLogProbLoss(pred, y, variance=1.0)
    np.testing.assert_allclose(full.evaluate(), 0.5 * 3 + 1.5 * np.log(2 * np.pi))


def test_mask_removes_cases():
    loss = make("categorical")
    mask = jnp.array([1.0, 0.0, 1.0])
    masked = L.CategoricalLogitsNegativeLogProbLoss(loss.parameter_dependants[0], loss.targets, mask, weight=loss.weight)
    assert float(masked.evaluate()[1]) == 0.0
    f = dense(masked, masked.multiply_fisher)
    np.testing.assert_allclose(f[1], 0.0)
    np.testing.assert_allclose(f[0], dense(loss, loss.multiply_fisher)[0])


def test_normal_mean_variance_fisher_and_no_ggn():
    mean, var = jnp.zeros((2, 3)), jnp.full((2, 3), 0.5)
    loss = L.NormalMeanVarianceNegativeLogProbLoss(mean, var, targets=jnp.ones((2, 3)))
    fm, fv = loss.multiply_fisher((jnp.ones((2, 3)), jnp.ones((2, 3))))
    np.testing.assert_allclose(fm, 2.0)
    np.testing.assert_allclose(fv, 2.0)  # 1 / (2 s^2) with s = 0.5
    u = jax.random.normal(KEY, loss.fisher_factor_inner_shape)
    bm, bv = loss.multiply_fisher_factor(u)
    v = (jax.random.normal(KEY, (2, 3)), jax.random.normal(jax.random.PRNGKey(1), (2, 3)))
    np.testing.assert_allclose(  # <B u, v> == <u, B^T v>
        jnp.sum(bm * v[0]) + jnp.sum(bv * v[1]), jnp.sum(u * loss.multiply_fisher_factor_transpose(v)), rtol=1e-10)
    bbt = loss.multiply_fisher_factor(loss.multiply_fisher_factor_transpose(v))  # B B^T v == F v
    for a, b in zip(bbt, loss.multiply_fisher(v)):
        np.testing.assert_allclose(a, b, rtol=1e-10)
    # The Fisher is the Hessian's expectation: check it against the MC estimate of g g^T.
    grads = jax.vmap(lambda k: loss.grad_of_evaluate_on_sample(k, "off"))(jax.random.split(KEY, 40000))
    np.testing.assert_allclose(jnp.mean(grads[0] ** 2, 0), 2.0, rtol=0.05)
    np.testing.assert_allclose(jnp.mean(grads[1] ** 2, 0), 2.0, rtol=0.08)
    with pytest.raises(NotImplementedError, match="fisher"):
        loss.multiply_ggn((mean, var))


def test_registration_is_transparent_and_tags_the_jaxpr():
    logits = jax.random.normal(KEY, (B, D))
    labels = jnp.array([0, 1, 2])

    def f(z):
        z = curvax.register_softmax_cross_entropy_loss(z, labels)
        return jnp.sum(jax.nn.log_softmax(z)[jnp.arange(B), labels])

    np.testing.assert_allclose(jax.jit(jax.grad(f))(logits), jax.grad(lambda z: jnp.sum(jax.nn.log_softmax(z)[jnp.arange(B), labels]))(logits))
    jaxpr = jax.make_jaxpr(f)(logits)
    tag_eqns = [e for e in jaxpr.jaxpr.eqns if isinstance(e.primitive, curvax.LossTag)]
    assert len(tag_eqns) == 1
    rebuilt = tag_eqns[0].primitive.loss(logits, labels, 1.0, args_names=tag_eqns[0].params["args_names"])
    np.testing.assert_allclose(rebuilt.evaluate(), make_loss_like(logits, labels).evaluate())
    assert jax.vmap(lambda z: curvax.register_squared_error_loss(z, z))(jnp.ones((5, 2, 3))).shape == (5, 2, 3)


def make_loss_like(logits, labels):
    return L.CategoricalLogitsNegativeLogProbLoss(logits, labels)


def test_registration_errors_name_the_argument():
    z = jnp.ones((4, 10))
    with pytest.raises(ValueError, match="targets.*integer classes of shape"):
        curvax.register_softmax_cross_entropy_loss(z, jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="`logits` must be a floating-point array"):
        curvax.register_softmax_cross_entropy_loss(jnp.ones(4))
    with pytest.raises(ValueError, match="`mask` must have shape"):
        curvax.register_softmax_cross_entropy_loss(z, jnp.zeros(4, jnp.int32), mask=jnp.ones(3))
    with pytest.raises(ValueError, match="`weight` must be a scalar"):
        curvax.register_sigmoid_cross_entropy_loss(z, weight=jnp.ones(2))
    with pytest.raises(ValueError, match="`targets` must have the shape of `logits`"):
        curvax.register_sigmoid_cross_entropy_loss(z, jnp.ones((4, 9)))
    with pytest.raises(ValueError, match="`variance` must be positive"):
        curvax.register_normal_predictive_distribution(z, variance=0.0)
    with pytest.raises(ValueError, match="`mean` must be a floating-point"):
        curvax.register_squared_error_loss(jnp.ones((4, 2), jnp.int32))
