"""Loss functions checked against their definitions (float64).

Curvature products are compared with dense closed forms and with ``jax.hessian``
of the evaluated loss; factors with their defining identity ``B B^T = F``;
sampling with a Monte-Carlo estimate of ``E[g g^T]``; registration functions
with the tag they leave in a jaxpr and the errors they raise.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import curvax
from curvax import losses

Array = jax.Array
WEIGHT = 1.7


pytestmark = pytest.mark.usefixtures("x64")


# ----------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def normal_loss(normalize: bool = True, shape: Sequence[int] = (3, 4)) -> losses.NormalMeanNegativeLogProbLoss:
    r = _rng(0)
    return losses.NormalMeanNegativeLogProbLoss(
        jnp.asarray(r.normal(size=shape)),
        jnp.asarray(r.normal(size=shape)),
        variance=0.7,
        weight=WEIGHT,
        normalize_log_prob=normalize,
    )


def bernoulli_loss(shape: Sequence[int] = (3, 4)) -> losses.MultiBernoulliNegativeLogProbLoss:
    r = _rng(1)
    return losses.MultiBernoulliNegativeLogProbLoss(
        jnp.asarray(r.normal(size=shape) * 2.0),
        jnp.asarray(r.integers(0, 2, size=shape).astype(np.float64)),
        weight=WEIGHT,
    )


def categorical_loss(
    shape: Sequence[int] = (3, 4), mask: Any = None, one_hot: bool = False
) -> losses.CategoricalLogitsNegativeLogProbLoss:
    r = _rng(2)
    logits = jnp.asarray(r.normal(size=shape) * 1.5)
    classes = r.integers(0, shape[-1], size=shape[:-1])
    if one_hot:
        targets = jnp.asarray(np.eye(shape[-1])[classes])
        return losses.OneHotCategoricalLogitsNegativeLogProbLoss(logits, targets, mask=mask, weight=WEIGHT)
    return losses.CategoricalLogitsNegativeLogProbLoss(logits, jnp.asarray(classes), mask=mask, weight=WEIGHT)


def mean_variance_loss(shape: Sequence[int] = (3, 4)) -> losses.NormalMeanVarianceNegativeLogProbLoss:
    r = _rng(3)
    return losses.NormalMeanVarianceNegativeLogProbLoss(
        jnp.asarray(r.normal(size=shape)),
        jnp.asarray(r.uniform(0.5, 1.5, size=shape)),
        jnp.asarray(r.normal(size=shape)),
        weight=WEIGHT,
    )


NATURAL_LOSSES: dict[str, Callable[[], losses.NegativeLogProbLoss]] = {
    "normal": normal_loss,
    "normal_unnormalized": lambda: normal_loss(normalize=False),
    "normal_3d": lambda: normal_loss(shape=(2, 3, 4)),
    "bernoulli": bernoulli_loss,
    "bernoulli_3d": lambda: bernoulli_loss(shape=(2, 3, 4)),
    "categorical": categorical_loss,
    "categorical_3d": lambda: categorical_loss(shape=(2, 3, 4)),
    "categorical_masked": lambda: categorical_loss(mask=jnp.asarray([1.0, 0.0, 1.0])),
    "one_hot": lambda: categorical_loss(one_hot=True),
    "one_hot_masked": lambda: categorical_loss(one_hot=True, mask=jnp.asarray([True, True, False])),
}
ALL_LOSSES = {**NATURAL_LOSSES, "mean_variance": mean_variance_loss}
# Dense curvature checks on the cases the oracle tests below do not cover (middle
# dims, masks); plain 2-D cases are checked there against jax.hessian.
CURVATURE_CASES = ["normal_3d", "bernoulli_3d", "categorical_3d", "categorical_masked", "one_hot_masked"]


def closed_form_fisher_blocks(loss: losses.NegativeLogProbLoss) -> np.ndarray:
    """Per-case unweighted Fisher ``(cases, d, d)`` from the textbook formulas."""
    (x,) = loss.parameter_dependants
    x = np.asarray(x)
    d = x.shape[-1]
    z = x.reshape(-1, d)
    if isinstance(loss, losses.NormalMeanNegativeLogProbLoss):
        return np.broadcast_to(np.eye(d) / float(loss.variance), (z.shape[0], d, d))
    if isinstance(loss, losses.MultiBernoulliNegativeLogProbLoss):
        p = 1.0 / (1.0 + np.exp(-z))
        return np.stack([np.diag(pi * (1 - pi)) for pi in p])
    if isinstance(loss, losses.CategoricalLogitsNegativeLogProbLoss):
        e = np.exp(z - z.max(-1, keepdims=True))
        p = e / e.sum(-1, keepdims=True)
        blocks = np.stack([np.diag(pi) - np.outer(pi, pi) for pi in p])
        if loss.mask is not None:
            blocks = blocks * np.asarray(loss.mask, dtype=np.float64).reshape(-1)[:, None, None]
        return blocks
    raise TypeError(type(loss))


def block_diag(blocks: np.ndarray) -> np.ndarray:
    n, d, _ = blocks.shape
    out = np.zeros((n * d, n * d))
    for i, b in enumerate(blocks):
        out[i * d : (i + 1) * d, i * d : (i + 1) * d] = b
    return out


def flat(xs: Sequence[Array]) -> Array:
    return jnp.concatenate([jnp.ravel(x) for x in xs])


def unflat(v: Array, shapes: Sequence[Sequence[int]]) -> tuple[Array, ...]:
    out, start = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(v[start : start + n].reshape(s))
        start += n
    return tuple(out)


def dense(fn: Callable[[tuple[Array, ...]], Sequence[Array]], in_shapes: Sequence[Sequence[int]]) -> Array:
    """The matrix of a linear map between (tuples of) arrays, from its action on a basis."""
    n = sum(int(np.prod(s)) for s in in_shapes)
    return jax.vmap(lambda e: flat(fn(unflat(e, in_shapes))))(jnp.eye(n)).T


def input_shapes(loss: losses.LossFunction) -> list[tuple[int, ...]]:
    return [tuple(x.shape) for x in loss.parameter_dependants]


@jax.jit
def dense_curvature(loss: losses.NegativeLogProbLoss) -> dict[str, Array]:
    """Dense Fisher, factor ``B``, ``B^T`` (and GGN, Hessian for natural parameters) of ``loss``.

    One compiled function per loss structure (the loss is a pytree argument), so
    the tests that need these matrices for the same case share the compilation.
    """
    shapes = input_shapes(loss)
    out = {
        "fisher": dense(loss.multiply_fisher, shapes),
        "factor": dense(lambda u: loss.multiply_fisher_factor(u[0]), [loss.fisher_factor_inner_shape]),
        "factor_transpose": dense(lambda v: (loss.multiply_fisher_factor_transpose(v),), shapes),
    }
    if isinstance(loss, losses.NaturalParamsNegativeLogProbLoss):

        def total(v: Array) -> Array:
            return jnp.sum(loss.copy_with_different_inputs(unflat(v, shapes)).evaluate())

        out["ggn"] = dense(loss.multiply_ggn, shapes)
        out["hessian"] = jax.hessian(total)(flat(loss.parameter_dependants))
    return out


def fisher_dense(loss: losses.NegativeLogProbLoss) -> np.ndarray:
    return np.asarray(dense_curvature(loss)["fisher"])


# ----------------------------------------------------------------------------------
# Curvature products
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CURVATURE_CASES)
def test_fisher_equals_closed_form_and_hessian(name: str) -> None:
    loss = NATURAL_LOSSES[name]()
    expected = WEIGHT * block_diag(closed_form_fisher_blocks(loss))
    mats = dense_curvature(loss)
    np.testing.assert_allclose(mats["fisher"], expected, atol=1e-12)
    np.testing.assert_allclose(mats["hessian"], expected, atol=1e-10)
    # Natural parameters: the GGN is the Fisher.
    np.testing.assert_allclose(mats["ggn"], expected, atol=1e-12)
    assert loss.ggn_factor_inner_shape == loss.fisher_factor_inner_shape


@pytest.mark.parametrize("name", CURVATURE_CASES + ["mean_variance"])
def test_factor_products_multiply_back(name: str) -> None:
    loss = ALL_LOSSES[name]()
    mats = dense_curvature(loss)
    b = np.asarray(mats["factor"])
    np.testing.assert_allclose(b @ b.T, mats["fisher"], atol=1e-12)
    np.testing.assert_allclose(mats["factor_transpose"], b.T, atol=1e-12)

    r = _rng(7)
    u = jnp.asarray(r.normal(size=loss.fisher_factor_inner_shape))
    v = tuple(jnp.asarray(r.normal(size=s)) for s in input_shapes(loss))
    lhs = jnp.vdot(flat(loss.multiply_fisher_factor(u)), flat(v))
    rhs = jnp.vdot(u, loss.multiply_fisher_factor_transpose(v))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-12)


@pytest.mark.parametrize("name", sorted(ALL_LOSSES))
def test_replicated_one_hot_is_factor_of_one_hot(name: str) -> None:
    loss = ALL_LOSSES[name]()
    inner = loss.fisher_factor_inner_shape
    for index in np.ndindex(*inner[1:]):
        e = np.zeros(inner)
        e[(slice(None),) + index] = 1.0
        got = loss.multiply_fisher_factor_replicated_one_hot(index)
        want = loss.multiply_fisher_factor(jnp.asarray(e))
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-14)
    if not isinstance(loss, losses.NormalMeanVarianceNegativeLogProbLoss):
        got = loss.multiply_ggn_factor_replicated_one_hot((0,) * (len(inner) - 1))
        assert got[0].shape == inner


def test_one_hot_columns_of_per_position_logits_give_the_hessian() -> None:
    """Logits with an extra (position) axis: the columns ``B e_(t, c)`` for every index of the
    inner shape, outer products summed, are the Hessian of the summed per-position
    cross-entropy (block-diagonal over positions). kfac-jax 0.0.8's columns subtract
    ``p * sqrt(p[t, c])`` at every position (error 0.69 here); curvax's only at position t."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 3))
    loss = losses.CategoricalLogitsNegativeLogProbLoss(logits)
    cols = [np.ravel(loss.multiply_ggn_factor_replicated_one_hot(i)[0]) for i in np.ndindex(logits.shape[1:])]
    c = np.stack(cols, axis=1)
    hessian = jax.hessian(lambda z: -jnp.sum(jax.nn.log_softmax(z)[..., 0]))(logits).reshape(6, 6)
    np.testing.assert_allclose(c @ c.T, hessian, atol=1e-14)


def test_replicated_one_hot_rejects_bad_index() -> None:
    loss = categorical_loss()
    with pytest.raises(ValueError, match="one entry per non-batch dim"):
        loss.multiply_fisher_factor_replicated_one_hot((0, 1))
    with pytest.raises(ValueError, match="out of range"):
        loss.multiply_fisher_factor_replicated_one_hot((4,))


def test_mean_variance_fisher_closed_form() -> None:
    loss = mean_variance_loss()
    s = np.asarray(loss.variance).ravel()
    expected = WEIGHT * np.diag(np.concatenate([1.0 / s, 1.0 / (2.0 * s**2)]))
    np.testing.assert_allclose(fisher_dense(loss), expected, atol=1e-12)
    assert loss.fisher_factor_inner_shape == (3, 8)


def test_mean_variance_has_no_ggn() -> None:
    loss = mean_variance_loss()
    v = tuple(jnp.ones_like(x) for x in loss.parameter_dependants)
    for call in (
        lambda: loss.multiply_ggn(v),
        lambda: loss.multiply_ggn_factor(jnp.ones((3, 8))),
        lambda: loss.multiply_ggn_factor_transpose(v),
        lambda: loss.multiply_ggn_factor_replicated_one_hot((0,)),
        lambda: loss.ggn_factor_inner_shape,
    ):
        with pytest.raises(NotImplementedError, match="Fisher estimation mode"):
            call()


def test_weighted_products_scale_by_weight() -> None:
    loss = categorical_loss()
    r = _rng(8)
    v = (jnp.asarray(r.normal(size=(3, 4))),)
    u = jnp.asarray(r.normal(size=(3, 4)))
    sw = np.sqrt(WEIGHT)
    np.testing.assert_allclose(loss.multiply_fisher(v)[0], WEIGHT * loss.multiply_fisher_unweighted(v)[0])
    np.testing.assert_allclose(loss.multiply_ggn(v)[0], WEIGHT * loss.multiply_ggn_unweighted(v)[0])
    np.testing.assert_allclose(loss.multiply_fisher_factor(u)[0], sw * loss.multiply_fisher_factor_unweighted(u)[0])
    np.testing.assert_allclose(loss.multiply_ggn_factor(u)[0], sw * loss.multiply_ggn_factor_unweighted(u)[0])
    np.testing.assert_allclose(
        loss.multiply_fisher_factor_transpose(v), sw * loss.multiply_fisher_factor_transpose_unweighted(v)
    )
    np.testing.assert_allclose(
        loss.multiply_fisher_factor_replicated_one_hot((2,))[0],
        sw * loss.multiply_fisher_factor_replicated_one_hot_unweighted((2,))[0],
    )


def test_products_keep_input_dtype() -> None:
    """A float64 weight (x64 on) must not promote float32 products or losses."""
    logits = jnp.ones((2, 3), jnp.float32)
    loss = losses.CategoricalLogitsNegativeLogProbLoss(logits, jnp.zeros((2,), jnp.int32), weight=jnp.float64(2.0))
    assert loss.dtype == jnp.float32
    assert loss.multiply_fisher((logits,))[0].dtype == jnp.float32
    assert loss.multiply_fisher_factor(logits)[0].dtype == jnp.float32
    assert loss.multiply_fisher_factor_transpose((logits,)).dtype == jnp.float32
    assert loss.evaluate().dtype == jnp.float32
    assert loss.grad_of_evaluate(None, "sqrt")[0].dtype == jnp.float32


def test_vector_arity_is_checked() -> None:
    loss = mean_variance_loss()
    with pytest.raises(ValueError, match="expected 2 array"):
        loss.multiply_fisher((jnp.ones((3, 4)),))


# ----------------------------------------------------------------------------------
# Sampling: E[g g^T] = weight * F
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["categorical_3d", "mean_variance"])
def test_sampled_gradients_estimate_fisher(name: str) -> None:
    loss = ALL_LOSSES[name]()
    n_samples = 20000
    keys = jax.random.split(jax.random.key(0), n_samples)
    grads = jax.jit(jax.vmap(lambda k: flat(loss.grad_of_evaluate_on_sample(k, "sqrt"))))(keys)
    estimate = np.asarray(grads.T @ grads) / n_samples
    fisher = fisher_dense(loss)
    np.testing.assert_allclose(estimate, fisher, atol=0.08 * np.abs(fisher).max())


def test_samples_have_the_right_kind() -> None:
    key = jax.random.key(1)
    y = normal_loss().sample(key)
    assert y.shape == (3, 4) and y.dtype == jnp.float64
    y = bernoulli_loss().sample(key)
    assert y.shape == (3, 4) and set(np.unique(np.asarray(y))) <= {0.0, 1.0}
    y = categorical_loss().sample(key)
    assert y.shape == (3,) and jnp.issubdtype(y.dtype, jnp.integer)
    y = categorical_loss(one_hot=True).sample(key)
    assert y.shape == (3, 4)
    np.testing.assert_allclose(np.asarray(y).sum(-1), 1.0)
    assert categorical_loss().dist.mean().shape == (3, 4)


# ----------------------------------------------------------------------------------
# Evaluation, coefficients, masks
# ----------------------------------------------------------------------------------


def test_evaluate_matches_reference_losses() -> None:
    loss = normal_loss(normalize=False)
    m, y = np.asarray(loss.mean), np.asarray(loss.targets)
    np.testing.assert_allclose(loss.evaluate(), WEIGHT * ((m - y) ** 2).sum(-1) / (2 * 0.7))

    loss = normal_loss()
    const = 0.5 * 4 * np.log(2 * np.pi * 0.7)
    np.testing.assert_allclose(loss.evaluate(), WEIGHT * (((m - y) ** 2).sum(-1) / (2 * 0.7) + const))

    loss = bernoulli_loss(shape=(2, 3, 4))
    # One value per logit, as kfac-jax (its Bernoulli's log_prob is elementwise).
    ref = optax.sigmoid_binary_cross_entropy(loss.logits, loss.targets)
    assert loss.evaluate().shape == (2, 3, 4)
    np.testing.assert_allclose(loss.evaluate(), WEIGHT * ref, rtol=1e-12)

    loss = categorical_loss(shape=(2, 3, 4))
    ref = optax.softmax_cross_entropy_with_integer_labels(loss.logits, loss.targets)
    assert loss.evaluate().shape == (2, 3)
    np.testing.assert_allclose(loss.evaluate(), WEIGHT * ref, rtol=1e-12)

    loss = categorical_loss(one_hot=True)
    np.testing.assert_allclose(loss.evaluate(), WEIGHT * optax.softmax_cross_entropy(loss.logits, loss.targets))

    loss = mean_variance_loss()
    m, s, y = (np.asarray(a) for a in (loss.mean, loss.variance, loss.targets))
    ref = (0.5 * (y - m) ** 2 / s + 0.5 * np.log(2 * np.pi * s)).sum(-1)
    np.testing.assert_allclose(loss.evaluate(), WEIGHT * ref, rtol=1e-12)


def test_coefficient_modes() -> None:
    loss = categorical_loss()
    off = loss.evaluate(coefficient_mode="off")
    np.testing.assert_allclose(loss.evaluate(), WEIGHT * off)
    np.testing.assert_allclose(loss.evaluate(coefficient_mode="sqrt"), np.sqrt(WEIGHT) * off)
    g_off = loss.grad_of_evaluate(None, "off")[0]
    np.testing.assert_allclose(loss.grad_of_evaluate(None, "sqrt")[0], np.sqrt(WEIGHT) * g_off)
    # The gradient of sum(evaluate) for softmax cross-entropy is p - onehot(y).
    p = jax.nn.softmax(loss.logits)
    np.testing.assert_allclose(g_off, p - jax.nn.one_hot(loss.targets, 4), atol=1e-12)
    with pytest.raises(ValueError, match="coefficient_mode must be one of"):
        loss.evaluate(coefficient_mode="half")


def test_evaluate_uses_given_targets_and_needs_some() -> None:
    loss = categorical_loss()
    other = jnp.asarray([0, 0, 0])
    ref = optax.softmax_cross_entropy_with_integer_labels(loss.logits, other)
    np.testing.assert_allclose(loss.evaluate(other), WEIGHT * ref)
    no_targets = losses.CategoricalLogitsNegativeLogProbLoss(loss.logits)
    with pytest.raises(ValueError, match="needs targets"):
        no_targets.evaluate()
    with pytest.raises(ValueError, match="needs targets"):
        no_targets.grad_of_evaluate(None, "regular")


def test_mask_removes_cases() -> None:
    mask = jnp.asarray([1.0, 0.0, 1.0])
    masked, full = categorical_loss(mask=mask), categorical_loss()
    # Padding targets at masked positions are harmless.
    padded = losses.CategoricalLogitsNegativeLogProbLoss(
        masked.logits, masked.targets.at[1].set(-1), mask=mask, weight=WEIGHT
    )
    for loss in (masked, padded):
        values = loss.evaluate()
        assert values[1] == 0.0
        np.testing.assert_allclose(values[jnp.asarray([0, 2])], full.evaluate()[jnp.asarray([0, 2])])
        assert np.all(np.asarray(loss.grad_of_evaluate(None, "regular")[0][1]) == 0.0)
    v = (jnp.asarray(_rng(9).normal(size=(3, 4))),)
    for product in (
        masked.multiply_fisher(v)[0],
        masked.multiply_fisher_factor(v[0])[0],
        masked.multiply_fisher_factor_transpose(v),
        masked.multiply_fisher_factor_replicated_one_hot((1,))[0],
        masked.grad_of_evaluate_on_sample(jax.random.key(0), "sqrt")[0],
    ):
        assert np.all(np.asarray(product[1]) == 0.0)
        assert np.any(np.asarray(product[0]) != 0.0)
    np.testing.assert_allclose(masked.multiply_fisher(v)[0][0], full.multiply_fisher(v)[0][0])


def test_stable_sqrt_has_bounded_derivative() -> None:
    np.testing.assert_allclose(losses.stable_sqrt(4.0), 2.0)
    np.testing.assert_allclose(jax.grad(losses.stable_sqrt)(4.0), 0.25)
    assert np.isfinite(jax.grad(losses.stable_sqrt)(0.0))
    # Saturated Bernoulli logits: the factor's gradient stays finite.
    loss = losses.MultiBernoulliNegativeLogProbLoss(jnp.asarray([[-800.0, 0.0, 800.0]]))
    g = jax.grad(lambda z: jnp.sum(loss.copy_with_different_inputs((z,)).multiply_fisher_factor(jnp.ones((1, 3)))[0]))(
        loss.logits
    )
    assert np.all(np.isfinite(np.asarray(g)))


# ----------------------------------------------------------------------------------
# Structure: copies and pytrees
# ----------------------------------------------------------------------------------


def test_structure_properties() -> None:
    loss = categorical_loss(mask=jnp.ones(3))
    assert loss.num_parameter_dependants == 1
    assert loss.parameter_dependants[0] is loss.logits
    assert loss.num_parameter_independants == 3
    assert loss.parameter_independants[0] is loss.targets
    assert loss.params == loss.parameter_dependants
    mv = mean_variance_loss()
    assert mv.num_parameter_dependants == 2 and mv.num_parameter_independants == 2
    assert "NormalMeanVarianceNegativeLogProbLoss(mean=(3, 4)" in repr(mv)
    with pytest.raises(TypeError):
        losses.LossFunction(1.0)  # type: ignore[abstract]


@pytest.mark.parametrize("name", sorted(ALL_LOSSES))
def test_copy_with_different_inputs(name: str) -> None:
    loss = ALL_LOSSES[name]()
    new_inputs = tuple(1.5 * x + 0.25 for x in loss.parameter_dependants)
    copy = loss.copy_with_different_inputs(new_inputs)
    assert type(copy) is type(loss)
    for a, b in zip(copy.parameter_dependants, new_inputs):
        assert a is b
    for a, b in zip(copy.parameter_independants, loss.parameter_independants):
        assert a is b
    assert not np.allclose(copy.evaluate(), loss.evaluate())
    with pytest.raises(ValueError, match="parameter-dependent input"):
        loss.copy_with_different_inputs(new_inputs + new_inputs)


@pytest.mark.parametrize("name", sorted(ALL_LOSSES))
def test_pytree_round_trip_under_jit(name: str) -> None:
    loss = ALL_LOSSES[name]()
    leaves, treedef = jax.tree_util.tree_flatten(loss)
    assert all(isinstance(x, (jax.Array, np.ndarray, bool)) for x in leaves)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    np.testing.assert_allclose(rebuilt.evaluate(), loss.evaluate())

    @jax.jit
    def through_jit(l: losses.LossFunction) -> losses.LossFunction:
        return l.copy_with_different_inputs(tuple(2.0 * x for x in l.parameter_dependants))

    out = through_jit(loss)
    assert type(out) is type(loss)
    expected = loss.copy_with_different_inputs(tuple(2.0 * x for x in loss.parameter_dependants))
    np.testing.assert_allclose(out.evaluate(), expected.evaluate(), rtol=1e-12)
    v = tuple(jnp.ones_like(x) for x in loss.parameter_dependants)
    np.testing.assert_allclose(flat(out.multiply_fisher(v)), flat(expected.multiply_fisher(v)), rtol=1e-12)
    # tree_map builds losses from arbitrary leaves without running __init__.
    shapes = jax.tree_util.tree_map(lambda x: jnp.shape(x), loss)
    assert type(shapes) is type(loss)


def test_loss_built_inside_jit() -> None:
    logits = jnp.asarray(_rng(4).normal(size=(3, 4)))
    targets = jnp.asarray([0, 1, 2])
    make = jax.jit(lambda z, y: losses.CategoricalLogitsNegativeLogProbLoss(z, y, weight=0.5))
    loss = make(logits, targets)
    ref = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    np.testing.assert_allclose(loss.evaluate(), 0.5 * ref)


# ----------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------


def _logits(shape: Sequence[int] = (3, 4)) -> Array:
    return jnp.asarray(_rng(5).normal(size=shape))


Registration = tuple[Callable[..., Array], dict[str, Any], losses.LossTag, tuple[str, ...]]


def registrations() -> dict[str, Registration]:
    """Per case: the register function, its extra arguments, the tag it binds, its operand names."""
    return {
        "softmax": (
            curvax.register_softmax_cross_entropy_loss,
            dict(targets=jnp.asarray([0, 2, 1])),
            losses.categorical_logits_tag,
            ("logits", "targets", "weight"),
        ),
        "softmax_masked": (
            curvax.register_softmax_cross_entropy_loss,
            dict(targets=jnp.asarray([0, 3, 1]), mask=jnp.asarray([1.0, 0.0, 1.0]), weight=0.3),
            losses.categorical_logits_tag,
            ("logits", "targets", "mask", "weight"),
        ),
        "categorical_one_hot": (
            curvax.register_categorical_predictive_distribution,
            dict(targets=jnp.eye(4)[jnp.asarray([0, 2, 1])]),
            losses.one_hot_categorical_logits_tag,
            ("logits", "targets", "weight"),
        ),
        "categorical_no_targets": (
            curvax.register_categorical_predictive_distribution,
            dict(),
            losses.categorical_logits_tag,
            ("logits", "weight"),
        ),
        "sigmoid": (
            curvax.register_sigmoid_cross_entropy_loss,
            dict(targets=jnp.asarray(_rng(6).integers(0, 2, size=(3, 4)).astype(np.float64)), weight=2.0),
            losses.multi_bernoulli_tag,
            ("logits", "targets", "weight"),
        ),
        "multi_bernoulli": (
            curvax.register_multi_bernoulli_predictive_distribution,
            dict(),
            losses.multi_bernoulli_tag,
            ("logits", "weight"),
        ),
        "squared_error": (
            curvax.register_squared_error_loss,
            dict(targets=_logits() + 1.0, weight=0.5),
            losses.normal_mean_tag,
            ("mean", "targets", "variance", "weight", "normalize_log_prob"),
        ),
        "normal": (
            curvax.register_normal_predictive_distribution,
            dict(targets=_logits() - 1.0, variance=2.0),
            losses.normal_mean_tag,
            ("mean", "targets", "variance", "weight", "normalize_log_prob"),
        ),
    }


REGISTRATION_NAMES = [
    "categorical_no_targets",
    "categorical_one_hot",
    "multi_bernoulli",
    "normal",
    "sigmoid",
    "softmax",
    "softmax_masked",
    "squared_error",
]


def _tag_equations(jaxpr: Any, tag: losses.LossTag) -> list[Any]:
    return [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive is tag]


@pytest.mark.parametrize("name", REGISTRATION_NAMES)
def test_registration_is_identity_under_transformations(name: str) -> None:
    register, kwargs, _, _ = registrations()[name]
    z = _logits()
    np.testing.assert_array_equal(register(z, **kwargs), z)
    np.testing.assert_array_equal(jax.jit(lambda x: register(x, **kwargs))(z), z)
    g = jax.grad(lambda x: jnp.sum(register(x, **kwargs) ** 2))(z)
    np.testing.assert_allclose(g, 2.0 * z)
    zs = jnp.stack([z, 2.0 * z])
    np.testing.assert_array_equal(jax.vmap(lambda x: register(x, **kwargs))(zs), zs)


@pytest.mark.parametrize("name", REGISTRATION_NAMES)
def test_registration_leaves_tag_in_jaxpr(name: str) -> None:
    register, kwargs, tag, names = registrations()[name]
    closed = jax.make_jaxpr(lambda x: register(x, **kwargs) * 2.0)(_logits())
    (eqn,) = _tag_equations(closed, tag)
    assert tuple(eqn.params["args_names"]) == names
    assert len(eqn.invars) == len(names)
    assert tag in losses.LOSS_TAGS.values()
    assert sorted(registrations()) == REGISTRATION_NAMES


@pytest.mark.parametrize("name", REGISTRATION_NAMES)
def test_tag_operands_rebuild_the_loss(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    register, kwargs, tag, names = registrations()[name]
    seen: list[tuple[tuple[Any, ...], tuple[str, ...]]] = []
    original_bind = tag.bind

    def recording_bind(*args: Any, args_names: Sequence[str]) -> Any:
        seen.append((args, tuple(args_names)))
        return original_bind(*args, args_names=args_names)

    monkeypatch.setattr(tag, "bind", recording_bind)
    z = _logits()
    register(z, **kwargs)
    ((operands, args_names),) = seen
    assert args_names == names
    assert all(isinstance(x, jax.Array) for x in operands)
    loss = tag.loss(*operands, args_names=args_names)
    assert isinstance(loss, tag.loss_class)
    assert loss.parameter_dependants[0] is operands[0]
    w = kwargs.get("weight", 1.0)
    np.testing.assert_allclose(loss.weight, w)
    v = (jnp.ones_like(z),)
    if tag is losses.normal_mean_tag:
        variance = 0.5 if register is curvax.register_squared_error_loss else kwargs["variance"]
        np.testing.assert_allclose(loss.multiply_fisher(v)[0], w / variance * v[0])
    if loss.targets is not None:
        # One value per case; Bernoulli losses keep one per logit, as kfac-jax's.
        want = z.shape if tag is losses.multi_bernoulli_tag else (3,)
        assert loss.evaluate().shape == want
    if register is curvax.register_squared_error_loss:
        np.testing.assert_allclose(loss.evaluate(), w * jnp.sum((kwargs["targets"] - z) ** 2, axis=-1))


def test_registration_with_traced_weight_and_variance() -> None:
    """Values unknown at trace time skip the value checks but keep the shape checks."""

    def f(z: Array, w: Array, var: Array) -> Array:
        return curvax.register_normal_predictive_distribution(z, variance=var, weight=w)

    z = _logits()
    np.testing.assert_array_equal(jax.jit(f)(z, 0.5, 2.0), z)
    with pytest.raises(ValueError, match="`weight` must be a scalar"):
        jax.jit(f)(z, jnp.ones(2), 2.0)


BAD_INPUTS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "softmax float targets",
        lambda: curvax.register_softmax_cross_entropy_loss(jnp.zeros((128, 5)), jnp.zeros((128, 10), jnp.float32)),
        ValueError,
        r"register_softmax_cross_entropy_loss: `targets` must be integer classes of shape "
        r"logits.shape\[:-1\]=\(128,\) \(or one-hot of shape logits.shape=\(128, 5\)\), got \(128, 10\) float32",
    ),
    (
        "softmax targets wrong rank",
        lambda: curvax.register_softmax_cross_entropy_loss(jnp.zeros((128, 10)), jnp.zeros((128, 10, 1))),
        ValueError,
        r"register_softmax_cross_entropy_loss: `targets` must be integer classes of shape logits.shape\[:-1\]=\(128,\)",
    ),
    (
        "softmax float class targets",
        lambda: curvax.register_softmax_cross_entropy_loss(jnp.zeros((128, 10)), jnp.zeros((128,), jnp.float32)),
        ValueError,
        r"`targets` must be integer classes of shape logits.shape\[:-1\]=\(128,\) .*got \(128,\) float32",
    ),
    (
        "categorical targets wrong batch",
        lambda: curvax.register_categorical_predictive_distribution(jnp.zeros((8, 3)), jnp.zeros((7,), jnp.int32)),
        ValueError,
        r"register_categorical_predictive_distribution: `targets` must be integer classes of shape "
        r"logits.shape\[:-1\]=\(8,\)",
    ),
    (
        "1-D logits",
        lambda: curvax.register_softmax_cross_entropy_loss(jnp.zeros((10,))),
        ValueError,
        r"`logits` must be a floating-point array with at least 2 dims .*got \(10,\) float",
    ),
    (
        "integer logits",
        lambda: curvax.register_sigmoid_cross_entropy_loss(jnp.zeros((4, 3), jnp.int32)),
        ValueError,
        r"register_sigmoid_cross_entropy_loss: `logits` must be a floating-point array .*int32",
    ),
    (
        "list logits",
        lambda: curvax.register_softmax_cross_entropy_loss([[0.0, 1.0]]),
        TypeError,
        r"register_softmax_cross_entropy_loss: `logits` must be a JAX array, got list",
    ),
    (
        "vector weight",
        lambda: curvax.register_softmax_cross_entropy_loss(jnp.zeros((4, 3)), weight=jnp.ones(4)),
        ValueError,
        r"`weight` must be a scalar, got \(4,\)",
    ),
    (
        "negative weight",
        lambda: curvax.register_squared_error_loss(jnp.zeros((4, 3)), weight=-1.0),
        ValueError,
        r"register_squared_error_loss: `weight` must be non-negative, got -1.0",
    ),
    (
        "string weight",
        lambda: curvax.register_squared_error_loss(jnp.zeros((4, 3)), weight="1"),
        TypeError,
        r"`weight` must be an array, got str",
    ),
    (
        "mask shape",
        lambda: curvax.register_softmax_cross_entropy_loss(jnp.zeros((4, 3)), mask=jnp.ones((4, 3))),
        ValueError,
        r"`mask` must have shape logits.shape\[:-1\]=\(4,\) .*got \(4, 3\)",
    ),
    (
        "sigmoid targets shape",
        lambda: curvax.register_sigmoid_cross_entropy_loss(jnp.zeros((4, 3)), jnp.zeros((4,))),
        ValueError,
        r"`targets` must have the shape of `logits` \(4, 3\), got \(4,\)",
    ),
    (
        "normal targets shape",
        lambda: curvax.register_normal_predictive_distribution(jnp.zeros((4, 3)), jnp.zeros((4, 2))),
        ValueError,
        r"register_normal_predictive_distribution: `targets` must have the shape of `mean` \(4, 3\)",
    ),
    (
        "zero variance",
        lambda: curvax.register_normal_predictive_distribution(jnp.zeros((4, 3)), variance=0.0),
        ValueError,
        r"`variance` must be positive, got 0.0",
    ),
    (
        "array variance",
        lambda: curvax.register_normal_predictive_distribution(jnp.zeros((4, 3)), variance=jnp.ones(3)),
        ValueError,
        r"`variance` must be a scalar",
    ),
    (
        "1-D prediction",
        lambda: curvax.register_squared_error_loss(jnp.zeros((4,)), jnp.zeros((4,))),
        ValueError,
        r"register_squared_error_loss: `prediction` must be a floating-point array with at least 2 dims",
    ),
    (
        "normalize flag",
        lambda: curvax.register_normal_predictive_distribution(jnp.zeros((4, 3)), normalize_log_prob=jnp.bool_(1)),
        TypeError,
        r"`normalize_log_prob` must be a Python bool",
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_registration_inputs_raise_clear_errors(case: tuple[str, Callable[[], Any], type[Exception], str]) -> None:
    _, call, error, match = case
    with pytest.raises(error, match=match):
        call()


def test_bad_inputs_also_caught_at_trace_time() -> None:
    def f(z: Array) -> Array:
        return curvax.register_softmax_cross_entropy_loss(z, jnp.zeros((3,), jnp.int32))

    with pytest.raises(ValueError, match=r"`targets` must be integer classes of shape logits.shape\[:-1\]=\(4,\)"):
        jax.jit(f)(jnp.zeros((4, 5)))


# ----------------------------------------------------------------------------------
# Oracle tests (kept from the first version of this file): per-case dense
# matrices against jax.hessian, factors, Monte-Carlo Fisher, masks, registration.
# ----------------------------------------------------------------------------------

ORACLE_KEY = jax.random.PRNGKey(0)
OB, OD = 3, 4


def oracle_make(kind: str, weight: float = 1.3) -> losses.NegativeLogProbLoss:
    k1, k2 = jax.random.split(ORACLE_KEY)
    z = jax.random.normal(k1, (OB, OD))
    if kind == "normal":
        return losses.NormalMeanNegativeLogProbLoss(z, jax.random.normal(k2, (OB, OD)), variance=0.7, weight=weight)
    if kind == "bernoulli":
        return losses.MultiBernoulliNegativeLogProbLoss(z, jax.random.bernoulli(k2, 0.5, (OB, OD)).astype(z.dtype), weight=weight)
    if kind == "categorical":
        return losses.CategoricalLogitsNegativeLogProbLoss(z, jax.random.randint(k2, (OB,), 0, OD), weight=weight)
    if kind == "onehot":
        return losses.OneHotCategoricalLogitsNegativeLogProbLoss(z, jax.nn.one_hot(jax.random.randint(k2, (OB,), 0, OD), OD), weight=weight)
    raise ValueError(kind)


ORACLE_KINDS = ["normal", "bernoulli", "categorical", "onehot"]


def oracle_dense(loss: losses.LossFunction, method: Callable[..., Any], inner: bool | None = None) -> Array:
    """Per-case dense matrices of a linear map acting on (OB, OD) arrays, shape (OB, OD, OD)."""
    shape = loss.parameter_dependants[0].shape
    cols = []
    for j in range(shape[-1]):
        e = jnp.zeros(shape).at[:, j].set(1.0)
        out = method((e,)) if inner is None else method(e)
        cols.append(out[0] if isinstance(out, tuple) else out)
    return jnp.stack(cols, axis=-1)


@pytest.mark.parametrize("kind", ORACLE_KINDS)
def test_oracle_fisher_and_ggn_equal_hessian_of_the_loss(kind: str) -> None:
    loss = oracle_make(kind)
    z = loss.parameter_dependants[0]
    # For natural parameters the Hessian of the negative log-likelihood is the Fisher (and GGN).
    hess = jax.jit(jax.hessian(lambda zz: jnp.sum(loss.copy_with_different_inputs((zz,)).evaluate())))(z)
    per_case = jnp.stack([hess[n, :, n, :] for n in range(OB)])
    np.testing.assert_allclose(oracle_dense(loss, loss.multiply_fisher), per_case, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(oracle_dense(loss, loss.multiply_ggn), per_case, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ORACLE_KINDS)
def test_oracle_factor_products_multiply_back(kind: str) -> None:
    loss = oracle_make(kind)
    f = oracle_dense(loss, loss.multiply_fisher)
    b = oracle_dense(loss, loss.multiply_fisher_factor, inner=True)
    np.testing.assert_allclose(jnp.einsum("nij,nkj->nik", b, b), f, rtol=1e-10, atol=1e-12)
    u = jax.random.normal(ORACLE_KEY, loss.fisher_factor_inner_shape)
    v = jax.random.normal(jax.random.PRNGKey(1), loss.parameter_dependants[0].shape)
    lhs = jnp.sum(loss.multiply_fisher_factor(u)[0] * v)
    rhs = jnp.sum(u * loss.multiply_fisher_factor_transpose((v,)))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-10)
    for j in range(OD):
        want = loss.multiply_fisher_factor(jnp.zeros(loss.fisher_factor_inner_shape).at[:, j].set(1.0))[0]
        np.testing.assert_allclose(loss.multiply_fisher_factor_replicated_one_hot((j,))[0], want, rtol=1e-12)
        np.testing.assert_allclose(loss.multiply_ggn_factor_replicated_one_hot([j])[0], want, rtol=1e-12)


@pytest.mark.parametrize("kind", ORACLE_KINDS)
def test_oracle_monte_carlo_fisher_converges(kind: str) -> None:
    loss = oracle_make(kind, weight=1.0)
    grads = jax.jit(jax.vmap(lambda k: loss.grad_of_evaluate_on_sample(k, "sqrt")[0]))(jax.random.split(ORACLE_KEY, 40000))
    mc = jnp.einsum("snd,sne->nde", grads, grads) / grads.shape[0]
    exact = oracle_dense(loss, loss.multiply_fisher)
    assert np.abs(mc - exact).max() < 0.04 * max(1.0, float(np.abs(exact).max()))


def test_oracle_weights_coefficient_modes_and_copies() -> None:
    loss = oracle_make("categorical", weight=4.0)
    plain = oracle_make("categorical", weight=1.0)
    np.testing.assert_allclose(loss.evaluate(), 4 * plain.evaluate())
    np.testing.assert_allclose(loss.evaluate(coefficient_mode="sqrt"), 2 * plain.evaluate())
    np.testing.assert_allclose(loss.evaluate(coefficient_mode="off"), plain.evaluate())
    np.testing.assert_allclose(loss.grad_of_evaluate(None, "regular")[0], 4 * plain.grad_of_evaluate(None, "regular")[0])
    with pytest.raises(ValueError, match="coefficient_mode"):
        loss.evaluate(coefficient_mode="double")
    z2 = jnp.zeros((OB, OD))
    copy = loss.copy_with_different_inputs((z2,))
    np.testing.assert_allclose(copy.evaluate(), 4 * np.log(OD) * np.ones(OB), rtol=1e-12)
    with pytest.raises(ValueError, match="1 parameter-dependent"):
        loss.copy_with_different_inputs((z2, z2))
    # Pytree round trip through jit.
    out = jax.jit(lambda l: l)(loss)
    assert isinstance(out, losses.CategoricalLogitsNegativeLogProbLoss)
    np.testing.assert_allclose(out.evaluate(), loss.evaluate())


def test_oracle_squared_error_and_normal_evaluate() -> None:
    y = jnp.ones((2, 3))
    pred = jnp.zeros((2, 3))
    sq = losses.NormalMeanNegativeLogProbLoss(pred, y, variance=0.5, weight=2.0, normalize_log_prob=False)
    np.testing.assert_allclose(sq.evaluate(), 2.0 * 3.0 * np.ones(2))  # weight * ||y - pred||^2
    full = losses.NormalMeanNegativeLogProbLoss(pred, y, variance=1.0)
    np.testing.assert_allclose(full.evaluate(), 0.5 * 3 + 1.5 * np.log(2 * np.pi))


def test_oracle_mask_removes_cases() -> None:
    loss = oracle_make("categorical")
    mask = jnp.array([1.0, 0.0, 1.0])
    masked = losses.CategoricalLogitsNegativeLogProbLoss(loss.parameter_dependants[0], loss.targets, mask, weight=loss.weight)
    assert float(masked.evaluate()[1]) == 0.0
    f = oracle_dense(masked, masked.multiply_fisher)
    np.testing.assert_allclose(f[1], 0.0)
    np.testing.assert_allclose(f[0], oracle_dense(loss, loss.multiply_fisher)[0])


def test_oracle_normal_mean_variance_fisher_and_no_ggn() -> None:
    mean, var = jnp.zeros((2, 3)), jnp.full((2, 3), 0.5)
    loss = losses.NormalMeanVarianceNegativeLogProbLoss(mean, var, targets=jnp.ones((2, 3)))
    fm, fv = loss.multiply_fisher((jnp.ones((2, 3)), jnp.ones((2, 3))))
    np.testing.assert_allclose(fm, 2.0)
    np.testing.assert_allclose(fv, 2.0)  # 1 / (2 s^2) with s = 0.5
    u = jax.random.normal(ORACLE_KEY, loss.fisher_factor_inner_shape)
    bm, bv = loss.multiply_fisher_factor(u)
    v = (jax.random.normal(ORACLE_KEY, (2, 3)), jax.random.normal(jax.random.PRNGKey(1), (2, 3)))
    np.testing.assert_allclose(  # <OB u, v> == <u, OB^T v>
        jnp.sum(bm * v[0]) + jnp.sum(bv * v[1]), jnp.sum(u * loss.multiply_fisher_factor_transpose(v)), rtol=1e-10)
    bbt = loss.multiply_fisher_factor(loss.multiply_fisher_factor_transpose(v))  # OB OB^T v == F v
    for a, b in zip(bbt, loss.multiply_fisher(v)):
        np.testing.assert_allclose(a, b, rtol=1e-10)
    # The Fisher is the Hessian's expectation: check it against the MC estimate of g g^T.
    grads = jax.jit(jax.vmap(lambda k: loss.grad_of_evaluate_on_sample(k, "off")))(jax.random.split(ORACLE_KEY, 40000))
    np.testing.assert_allclose(jnp.mean(grads[0] ** 2, 0), 2.0, rtol=0.05)
    np.testing.assert_allclose(jnp.mean(grads[1] ** 2, 0), 2.0, rtol=0.08)
    with pytest.raises(NotImplementedError, match="fisher"):
        loss.multiply_ggn((mean, var))


def test_oracle_registration_is_transparent_and_tags_the_jaxpr() -> None:
    logits = jax.random.normal(ORACLE_KEY, (OB, OD))
    labels = jnp.array([0, 1, 2])

    def f(z: Array) -> Array:
        z = curvax.register_softmax_cross_entropy_loss(z, labels)
        return jnp.sum(jax.nn.log_softmax(z)[jnp.arange(OB), labels])

    np.testing.assert_allclose(jax.jit(jax.grad(f))(logits), jax.grad(lambda z: jnp.sum(jax.nn.log_softmax(z)[jnp.arange(OB), labels]))(logits))
    jaxpr = jax.make_jaxpr(f)(logits)
    tag_eqns = [e for e in jaxpr.jaxpr.eqns if isinstance(e.primitive, curvax.LossTag)]
    assert len(tag_eqns) == 1
    rebuilt = tag_eqns[0].primitive.loss(logits, labels, 1.0, args_names=tag_eqns[0].params["args_names"])
    np.testing.assert_allclose(rebuilt.evaluate(), oracle_make_loss_like(logits, labels).evaluate())
    assert jax.vmap(lambda z: curvax.register_squared_error_loss(z, z))(jnp.ones((5, 2, 3))).shape == (5, 2, 3)


def oracle_make_loss_like(logits: Array, labels: Array) -> losses.CategoricalLogitsNegativeLogProbLoss:
    return losses.CategoricalLogitsNegativeLogProbLoss(logits, labels)


def test_oracle_registration_errors_name_the_argument() -> None:
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
    # The error names the caller's argument (`prediction`), not the normal's `mean`.
    with pytest.raises(ValueError, match="`prediction` must be a floating-point"):
        curvax.register_squared_error_loss(jnp.ones((4, 2), jnp.int32))
