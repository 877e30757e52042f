"""Loss functions: what curvax needs to know about the loss to build its curvature.

Conventions (tested in ``tests/test_losses.py``):

* The parameter-dependent input (logits, mean, ...) has the batch as dim 0 and
  the distribution over its **last** axis; any dims in between (e.g. sequence
  positions) are independent cases.
* ``evaluate`` returns per-case values of shape ``inputs.shape[:-1]`` times the
  coefficient. The model's loss is expected to be
  ``weight * sum(per-case losses) / batch_size``.
* Curvature products act on one case at a time; "weighted" matrix products
  multiply by ``weight`` and factor products by ``sqrt(weight)``. For the
  natural-parameter losses here the GGN equals the Fisher.
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax.tags import LossTag

Array = jax.Array

_COEFFICIENT_MODES = ("regular", "sqrt", "off")


def _coefficient(weight: Array, mode: str) -> Array:
    if mode == "regular":
        return weight
    if mode == "sqrt":
        return jnp.sqrt(weight)
    if mode == "off":
        return jnp.ones_like(weight)
    raise ValueError(f"coefficient_mode must be one of {_COEFFICIENT_MODES}, got {mode!r}.")


@jax.custom_jvp
def stable_sqrt(x: Array) -> Array:
    """``sqrt`` whose derivative is capped at 1000 (finite at 0)."""
    return jnp.sqrt(x)


@stable_sqrt.defjvp
def _stable_sqrt_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = jnp.sqrt(x)
    return y, t / (2 * jnp.maximum(y, 1.0 / 2000.0))


def _as_tuple(vector: Any) -> tuple:
    return tuple(vector) if isinstance(vector, (tuple, list)) else (vector,)


class LossFunction(abc.ABC):
    """A loss over per-case inputs, with its curvature (GGN) products."""

    def __init__(self, weight: Any):
        self._weight = jnp.asarray(weight)

    @property
    def weight(self) -> Array:
        return self._weight

    @property
    def dtype(self) -> Any:
        return self.parameter_dependants[0].dtype

    @property
    @abc.abstractmethod
    def targets(self) -> Array | None:
        """The targets, if given."""

    @property
    @abc.abstractmethod
    def parameter_dependants(self) -> tuple[Array, ...]:
        """The inputs that depend on the model parameters."""

    @property
    def num_parameter_dependants(self) -> int:
        return len(self.parameter_dependants)

    @property
    @abc.abstractmethod
    def parameter_independants(self) -> tuple[Any, ...]:
        """The other constructor arguments (targets, mask, weight ...)."""

    @property
    def num_parameter_independants(self) -> int:
        return len(self.parameter_independants)

    @abc.abstractmethod
    def copy_with_different_inputs(self, parameter_dependants: Sequence[Array]) -> "LossFunction":
        """The same loss with other parameter-dependent inputs."""

    def _check_inputs(self, parameter_dependants: Sequence[Array], n: int) -> None:
        if len(parameter_dependants) != n:
            raise ValueError(f"{type(self).__name__} takes {n} parameter-dependent input(s), got {len(parameter_dependants)}.")

    def evaluate(self, targets: Array | None = None, coefficient_mode: str = "regular") -> Array:
        """Per-case losses times the coefficient (see module docstring)."""
        targets = self.targets if targets is None else targets
        if targets is None:
            raise ValueError(f"{type(self).__name__}.evaluate needs targets: none were registered or passed.")
        return _coefficient(self.weight, coefficient_mode) * self._evaluate(targets)

    @abc.abstractmethod
    def _evaluate(self, targets: Array) -> Array:
        """Unweighted per-case losses."""

    def grad_of_evaluate(self, targets: Array | None, coefficient_mode: str) -> tuple[Array, ...]:
        """Gradient of ``sum(evaluate(targets))`` w.r.t. the parameter-dependent inputs."""
        def total(*inputs: Array) -> Array:
            return jnp.sum(self.copy_with_different_inputs(inputs).evaluate(targets, coefficient_mode))

        return tuple(jax.grad(total, argnums=tuple(range(self.num_parameter_dependants)))(*self.parameter_dependants))

    def multiply_ggn(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        return tuple(self.weight * v for v in self.multiply_ggn_unweighted(vector))

    def multiply_ggn_factor(self, vector: Array) -> tuple[Array, ...]:
        return tuple(jnp.sqrt(self.weight) * v for v in self.multiply_ggn_factor_unweighted(vector))

    def multiply_ggn_factor_transpose(self, vector: Sequence[Array]) -> Array:
        return jnp.sqrt(self.weight) * self.multiply_ggn_factor_transpose_unweighted(vector)

    def multiply_ggn_factor_replicated_one_hot(self, index: Sequence[int]) -> tuple[Array, ...]:
        return tuple(jnp.sqrt(self.weight) * v for v in self.multiply_ggn_factor_replicated_one_hot_unweighted(index))

    @abc.abstractmethod
    def multiply_ggn_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """``G v`` per case."""

    @abc.abstractmethod
    def multiply_ggn_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        """``B u`` with ``G = B B^T``."""

    @abc.abstractmethod
    def multiply_ggn_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        """``B^T v``."""

    @abc.abstractmethod
    def multiply_ggn_factor_replicated_one_hot_unweighted(self, index: Sequence[int]) -> tuple[Array, ...]:
        """``B e_index`` for every case at once."""

    @property
    @abc.abstractmethod
    def ggn_factor_inner_shape(self) -> tuple[int, ...]:
        """Shape of the vectors ``multiply_ggn_factor`` takes."""

    # pytree support: children are the arrays, the class is the aux data.
    def tree_flatten(self) -> tuple[tuple, Any]:
        return self._children(), None

    @abc.abstractmethod
    def _children(self) -> tuple:
        """Constructor arguments in order."""

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Sequence[Any]) -> "LossFunction":
        return cls(*children)


class NegativeLogProbLoss(LossFunction):
    """``-log p(y | inputs)`` of a distribution: adds Fisher products and sampling."""

    @property
    def parameter_dependants(self) -> tuple[Array, ...]:
        return self.params

    @property
    @abc.abstractmethod
    def params(self) -> tuple[Array, ...]:
        """The distribution's parameters."""

    def multiply_fisher(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        return tuple(self.weight * v for v in self.multiply_fisher_unweighted(vector))

    def multiply_fisher_factor(self, vector: Array) -> tuple[Array, ...]:
        return tuple(jnp.sqrt(self.weight) * v for v in self.multiply_fisher_factor_unweighted(vector))

    def multiply_fisher_factor_transpose(self, vector: Sequence[Array]) -> Array:
        return jnp.sqrt(self.weight) * self.multiply_fisher_factor_transpose_unweighted(vector)

    def multiply_fisher_factor_replicated_one_hot(self, index: Sequence[int]) -> tuple[Array, ...]:
        return tuple(jnp.sqrt(self.weight) * v for v in self.multiply_fisher_factor_replicated_one_hot_unweighted(index))

    @abc.abstractmethod
    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """``F v`` per case."""

    @abc.abstractmethod
    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        """``B u`` with ``F = B B^T``."""

    @abc.abstractmethod
    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        """``B^T v``."""

    @abc.abstractmethod
    def multiply_fisher_factor_replicated_one_hot_unweighted(self, index: Sequence[int]) -> tuple[Array, ...]:
        """``B e_index`` for every case."""

    @property
    @abc.abstractmethod
    def fisher_factor_inner_shape(self) -> tuple[int, ...]:
        """Shape of the vectors ``multiply_fisher_factor`` takes."""

    @abc.abstractmethod
    def sample(self, rng: Array) -> Array:
        """Targets drawn from the model's predictive distribution."""

    def grad_of_evaluate_on_sample(self, rng: Array, coefficient_mode: str) -> tuple[Array, ...]:
        """Gradient of the loss at targets sampled from the model: ``E[g g^T] = F``."""
        return self.grad_of_evaluate(jax.lax.stop_gradient(self.sample(rng)), coefficient_mode)


class NaturalParamsNegativeLogProbLoss(NegativeLogProbLoss):
    """Exponential families in natural parameters: the GGN equals the Fisher."""

    def multiply_ggn_unweighted(self, vector):
        return self.multiply_fisher_unweighted(vector)

    def multiply_ggn_factor_unweighted(self, vector):
        return self.multiply_fisher_factor_unweighted(vector)

    def multiply_ggn_factor_transpose_unweighted(self, vector):
        return self.multiply_fisher_factor_transpose_unweighted(vector)

    def multiply_ggn_factor_replicated_one_hot_unweighted(self, index):
        return self.multiply_fisher_factor_replicated_one_hot_unweighted(index)

    @property
    def ggn_factor_inner_shape(self):
        return self.fisher_factor_inner_shape


class _Distribution:
    """A minimal distribution object (``log_prob``, ``sample``, ``mean``): no distrax needed."""

    def __init__(self, log_prob, sample, mean):
        self._log_prob, self._sample, self._mean = log_prob, sample, mean

    def log_prob(self, value: Array) -> Array:
        return self._log_prob(value)

    def sample(self, seed: Array) -> Array:
        return self._sample(seed)

    def mean(self) -> Array:
        return self._mean()


class DistributionNegativeLogProbLoss(NegativeLogProbLoss):
    """A negative log-probability loss defined through its ``dist``."""

    @property
    @abc.abstractmethod
    def dist(self) -> _Distribution:
        """The predictive distribution."""

    def _evaluate(self, targets: Array) -> Array:
        return -self.dist.log_prob(targets)

    def sample(self, rng: Array) -> Array:
        return self.dist.sample(rng)

    @property
    def fisher_factor_inner_shape(self) -> tuple[int, ...]:
        return tuple(self.params[0].shape)


def _one_hot_column(shape: Sequence[int], index: Sequence[int], dtype: Any) -> Array:
    index = tuple(int(i) for i in np.atleast_1d(np.asarray(index)))
    if len(index) != len(shape) - 1:
        raise ValueError(f"index must have {len(shape) - 1} entries (the non-batch dims of {tuple(shape)}), got {index}.")
    e = np.zeros(shape[1:], dtype=np.float32)
    e[index] = 1.0
    return jnp.broadcast_to(jnp.asarray(e, dtype), tuple(shape))


@jax.tree_util.register_pytree_node_class
class NormalMeanNegativeLogProbLoss(DistributionNegativeLogProbLoss, NaturalParamsNegativeLogProbLoss):
    """``-log N(y; mean, variance I)`` over the last axis; ``F = I / variance``."""

    def __init__(self, mean: Array, targets: Array | None = None, variance: Any = 0.5, weight: Any = 1.0, normalize_log_prob: Any = True):
        super().__init__(weight)
        self._mean = mean
        self._targets = targets
        self._variance = jnp.asarray(variance)
        self._normalize = normalize_log_prob

    def _children(self):
        return (self._mean, self._targets, self._variance, self._weight, self._normalize)

    @property
    def targets(self):
        return self._targets

    @property
    def params(self):
        return (self._mean,)

    @property
    def variance(self) -> Array:
        return self._variance

    @property
    def parameter_independants(self):
        return (self._targets, self._variance, self._weight)

    def copy_with_different_inputs(self, parameter_dependants):
        self._check_inputs(parameter_dependants, 1)
        return NormalMeanNegativeLogProbLoss(parameter_dependants[0], self._targets, self._variance, self._weight, self._normalize)

    @property
    def dist(self) -> _Distribution:
        mean, var = self._mean, self._variance

        def log_prob(y):
            sq = -0.5 * jnp.sum((y - mean) ** 2, axis=-1) / var
            const = 0.5 * mean.shape[-1] * jnp.log(2 * jnp.pi * var)
            return jnp.where(jnp.asarray(self._normalize, bool), sq - const, sq)

        return _Distribution(
            log_prob,
            lambda seed: mean + jnp.sqrt(var) * jax.random.normal(seed, mean.shape, mean.dtype),
            lambda: mean,
        )

    def multiply_fisher_unweighted(self, vector):
        (v,) = _as_tuple(vector)
        return (v / self._variance,)

    def multiply_fisher_factor_unweighted(self, vector):
        return (vector / jnp.sqrt(self._variance),)

    def multiply_fisher_factor_transpose_unweighted(self, vector):
        (v,) = _as_tuple(vector)
        return v / jnp.sqrt(self._variance)

    def multiply_fisher_factor_replicated_one_hot_unweighted(self, index):
        return (_one_hot_column(self._mean.shape, index, self._mean.dtype) / jnp.sqrt(self._variance),)


@jax.tree_util.register_pytree_node_class
class NormalMeanVarianceNegativeLogProbLoss(DistributionNegativeLogProbLoss):
    """``-log N(y; mean, diag(variance))``; Fisher ``diag(1/s, 1/(2 s^2))`` in (mean, s)."""

    def __init__(self, mean: Array, variance: Array, targets: Array | None = None, weight: Any = 1.0):
        super().__init__(weight)
        self._mean, self._variance, self._targets = mean, variance, targets

    def _children(self):
        return (self._mean, self._variance, self._targets, self._weight)

    @property
    def targets(self):
        return self._targets

    @property
    def params(self):
        return (self._mean, self._variance)

    @property
    def parameter_independants(self):
        return (self._targets, self._weight)

    def copy_with_different_inputs(self, parameter_dependants):
        self._check_inputs(parameter_dependants, 2)
        return NormalMeanVarianceNegativeLogProbLoss(parameter_dependants[0], parameter_dependants[1], self._targets, self._weight)

    @property
    def dist(self) -> _Distribution:
        mean, s = self._mean, self._variance
        return _Distribution(
            lambda y: jnp.sum(-0.5 * (y - mean) ** 2 / s - 0.5 * jnp.log(2 * jnp.pi * s), axis=-1),
            lambda seed: mean + jnp.sqrt(s) * jax.random.normal(seed, mean.shape, mean.dtype),
            lambda: mean,
        )

    @property
    def fisher_factor_inner_shape(self):
        return tuple(self._mean.shape[:-1]) + (2 * self._mean.shape[-1],)

    def multiply_fisher_unweighted(self, vector):
        vm, vs = _as_tuple(vector)
        return (vm / self._variance, vs / (2 * self._variance**2))

    def multiply_fisher_factor_unweighted(self, vector):
        d = self._mean.shape[-1]
        um, us = vector[..., :d], vector[..., d:]
        return (um / jnp.sqrt(self._variance), us / (jnp.sqrt(2.0) * self._variance))

    def multiply_fisher_factor_transpose_unweighted(self, vector):
        vm, vs = _as_tuple(vector)
        return jnp.concatenate([vm / jnp.sqrt(self._variance), vs / (jnp.sqrt(2.0) * self._variance)], axis=-1)

    def multiply_fisher_factor_replicated_one_hot_unweighted(self, index):
        e = _one_hot_column(self.fisher_factor_inner_shape, index, self._mean.dtype)
        return self.multiply_fisher_factor_unweighted(e)

    def _no_ggn(self, *_: Any) -> Any:
        raise NotImplementedError(
            "NormalMeanVarianceNegativeLogProbLoss has no GGN (its Hessian in (mean, variance) is not PSD); "
            "use a 'fisher_*' estimation mode."
        )

    multiply_ggn_unweighted = _no_ggn
    multiply_ggn_factor_unweighted = _no_ggn
    multiply_ggn_factor_transpose_unweighted = _no_ggn
    multiply_ggn_factor_replicated_one_hot_unweighted = _no_ggn

    @property
    def ggn_factor_inner_shape(self):
        return self._no_ggn()


@jax.tree_util.register_pytree_node_class
class MultiBernoulliNegativeLogProbLoss(DistributionNegativeLogProbLoss, NaturalParamsNegativeLogProbLoss):
    """Independent Bernoullis with logits; ``F = diag(p (1 - p))``."""

    def __init__(self, logits: Array, targets: Array | None = None, weight: Any = 1.0):
        super().__init__(weight)
        self._logits, self._targets = logits, targets

    def _children(self):
        return (self._logits, self._targets, self._weight)

    @property
    def targets(self):
        return self._targets

    @property
    def params(self):
        return (self._logits,)

    @property
    def parameter_independants(self):
        return (self._targets, self._weight)

    def copy_with_different_inputs(self, parameter_dependants):
        self._check_inputs(parameter_dependants, 1)
        return MultiBernoulliNegativeLogProbLoss(parameter_dependants[0], self._targets, self._weight)

    @property
    def _probs(self) -> Array:
        return jax.nn.sigmoid(self._logits)

    @property
    def dist(self) -> _Distribution:
        z = self._logits
        return _Distribution(
            lambda y: jnp.sum(y * jax.nn.log_sigmoid(z) + (1 - y) * jax.nn.log_sigmoid(-z), axis=-1),
            lambda seed: jax.random.bernoulli(seed, jax.nn.sigmoid(z)).astype(z.dtype),
            lambda: jax.nn.sigmoid(z),
        )

    def multiply_fisher_unweighted(self, vector):
        (v,) = _as_tuple(vector)
        p = self._probs
        return (p * (1 - p) * v,)

    def _factor(self) -> Array:
        p = self._probs
        return stable_sqrt(p * (1 - p))

    def multiply_fisher_factor_unweighted(self, vector):
        return (self._factor() * vector,)

    def multiply_fisher_factor_transpose_unweighted(self, vector):
        (v,) = _as_tuple(vector)
        return self._factor() * v

    def multiply_fisher_factor_replicated_one_hot_unweighted(self, index):
        return (self._factor() * _one_hot_column(self._logits.shape, index, self._logits.dtype),)


@jax.tree_util.register_pytree_node_class
class CategoricalLogitsNegativeLogProbLoss(DistributionNegativeLogProbLoss, NaturalParamsNegativeLogProbLoss):
    """Softmax over the last axis with integer targets; ``F = diag(p) - p p^T``.

    The factor is ``B = diag(q) - p q^T`` with ``q = sqrt(p)`` (``B B^T = F``
    because ``q^T q = 1``). A 0/1 ``mask`` of shape ``logits.shape[:-1]``
    removes cases from the losses and the curvature.
    """

    def __init__(self, logits: Array, targets: Array | None = None, mask: Array | None = None, weight: Any = 1.0):
        super().__init__(weight)
        self._logits, self._targets, self._mask = logits, targets, mask

    def _children(self):
        return (self._logits, self._targets, self._mask, self._weight)

    @property
    def targets(self):
        return self._targets

    @property
    def mask(self) -> Array | None:
        return self._mask

    @property
    def params(self):
        return (self._logits,)

    @property
    def parameter_independants(self):
        return (self._targets, self._mask, self._weight)

    def copy_with_different_inputs(self, parameter_dependants):
        self._check_inputs(parameter_dependants, 1)
        return type(self)(parameter_dependants[0], self._targets, self._mask, self._weight)

    def _masked(self, x: Array) -> Array:
        return x if self._mask is None else x * self._mask[..., None].astype(x.dtype)

    @property
    def _probs(self) -> Array:
        return self._masked(jax.nn.softmax(self._logits, axis=-1))

    @property
    def _sqrt_probs(self) -> Array:
        return self._masked(jnp.sqrt(jax.nn.softmax(self._logits, axis=-1)))

    def _log_prob_of(self, y: Array) -> Array:
        logp = jax.nn.log_softmax(self._logits, axis=-1)
        return jnp.take_along_axis(logp, y[..., None].astype(jnp.int32), axis=-1)[..., 0]

    @property
    def dist(self) -> _Distribution:
        return _Distribution(
            self._log_prob_of,
            lambda seed: jax.random.categorical(seed, self._logits, axis=-1),
            lambda: jax.nn.softmax(self._logits, axis=-1),
        )

    def _evaluate(self, targets: Array) -> Array:
        nll = -self.dist.log_prob(targets)
        return nll if self._mask is None else nll * self._mask.astype(nll.dtype)

    def multiply_fisher_unweighted(self, vector):
        (v,) = _as_tuple(vector)
        p = self._probs
        return (p * v - p * jnp.sum(p * v, axis=-1, keepdims=True),)

    def multiply_fisher_factor_unweighted(self, vector):
        p, q = self._probs, self._sqrt_probs
        return (q * vector - p * jnp.sum(q * vector, axis=-1, keepdims=True),)

    def multiply_fisher_factor_transpose_unweighted(self, vector):
        (v,) = _as_tuple(vector)
        p, q = self._probs, self._sqrt_probs
        return q * v - q * jnp.sum(p * v, axis=-1, keepdims=True)

    def multiply_fisher_factor_replicated_one_hot_unweighted(self, index):
        return self.multiply_fisher_factor_unweighted(_one_hot_column(self._logits.shape, index, self._logits.dtype))


@jax.tree_util.register_pytree_node_class
class OneHotCategoricalLogitsNegativeLogProbLoss(CategoricalLogitsNegativeLogProbLoss):
    """As ``CategoricalLogitsNegativeLogProbLoss`` with one-hot targets."""

    def _log_prob_of(self, y: Array) -> Array:
        return jnp.sum(y * jax.nn.log_softmax(self._logits, axis=-1), axis=-1)

    @property
    def dist(self) -> _Distribution:
        n = self._logits.shape[-1]
        return _Distribution(
            self._log_prob_of,
            lambda seed: jax.nn.one_hot(jax.random.categorical(seed, self._logits, axis=-1), n, dtype=self._logits.dtype),
            lambda: jax.nn.softmax(self._logits, axis=-1),
        )


# --- tags and registration ----------------------------------------------------------------

normal_mean_tag = LossTag(NormalMeanNegativeLogProbLoss, ["mean"], ["targets", "variance", "weight", "normalize_log_prob"])
normal_mean_variance_tag = LossTag(NormalMeanVarianceNegativeLogProbLoss, ["mean", "variance"], ["targets", "weight"])
multi_bernoulli_tag = LossTag(MultiBernoulliNegativeLogProbLoss, ["logits"], ["targets", "weight"])
categorical_logits_tag = LossTag(CategoricalLogitsNegativeLogProbLoss, ["logits"], ["targets", "mask", "weight"])
one_hot_categorical_logits_tag = LossTag(OneHotCategoricalLogitsNegativeLogProbLoss, ["logits"], ["targets", "mask", "weight"])

LOSS_TAGS = (
    normal_mean_tag,
    normal_mean_variance_tag,
    multi_bernoulli_tag,
    categorical_logits_tag,
    one_hot_categorical_logits_tag,
)


def _describe(x: Any) -> str:
    return f"shape {tuple(np.shape(x))} {jnp.result_type(x)}" if hasattr(x, "shape") or np.ndim(x) == 0 else type(x).__name__


def _check_floating(fn: str, name: str, x: Any, min_ndim: int = 2) -> None:
    if not hasattr(x, "shape") or not jnp.issubdtype(jnp.result_type(x), jnp.floating) or np.ndim(x) < min_ndim:
        raise ValueError(f"{fn}: `{name}` must be a floating-point array with at least {min_ndim} dims (batch first), got {_describe(x)}.")


def _check_weight(fn: str, weight: Any) -> None:
    if np.ndim(weight) != 0:
        raise ValueError(f"{fn}: `weight` must be a scalar, got {_describe(weight)}.")
    try:
        w = float(weight)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return
    if not w >= 0:
        raise ValueError(f"{fn}: `weight` must be non-negative, got {w}.")


def _bind(tag: LossTag, **kwargs: Any) -> Array:
    names = tuple(k for k, v in kwargs.items() if v is not None)
    operands = [jnp.asarray(v) for v in kwargs.values() if v is not None]
    out = tag.bind(*operands, args_names=names)
    return out[0] if len(out) == 1 else tuple(out)


def register_normal_predictive_distribution(mean: Array, targets: Array | None = None, variance: Any = 0.5, weight: Any = 1.0, normalize_log_prob: bool = True) -> Array:
    """Registers ``-log N(targets; mean, variance I)`` (``weight/(2 variance) ||targets - mean||^2`` + const)."""
    fn = "register_normal_predictive_distribution"
    _check_floating(fn, "mean", mean)
    if targets is not None and np.shape(targets) != np.shape(mean):
        raise ValueError(f"{fn}: `targets` must have the shape of `mean` {np.shape(mean)}, got {_describe(targets)}.")
    if np.ndim(variance) != 0:
        raise ValueError(f"{fn}: `variance` must be a scalar, got {_describe(variance)}.")
    try:
        if not float(variance) > 0:
            raise ValueError(f"{fn}: `variance` must be positive, got {float(variance)}.")
    except (TypeError, jax.errors.ConcretizationTypeError):
        pass
    _check_weight(fn, weight)
    return _bind(normal_mean_tag, mean=mean, targets=targets, variance=variance, weight=weight, normalize_log_prob=bool(normalize_log_prob))


def register_squared_error_loss(prediction: Array, targets: Array | None = None, weight: Any = 1.0) -> Array:
    """Registers ``weight * ||targets - prediction||^2`` per case (a normal with variance 0.5)."""
    return register_normal_predictive_distribution(prediction, targets, variance=0.5, weight=weight, normalize_log_prob=False)


def register_multi_bernoulli_predictive_distribution(logits: Array, targets: Array | None = None, weight: Any = 1.0) -> Array:
    """Registers independent Bernoulli distributions with these logits (sigmoid cross-entropy)."""
    fn = "register_multi_bernoulli_predictive_distribution"
    _check_floating(fn, "logits", logits)
    if targets is not None and np.shape(targets) != np.shape(logits):
        raise ValueError(f"{fn}: `targets` must have the shape of `logits` {np.shape(logits)}, got {_describe(targets)}.")
    _check_weight(fn, weight)
    return _bind(multi_bernoulli_tag, logits=logits, targets=targets, weight=weight)


def register_sigmoid_cross_entropy_loss(logits: Array, targets: Array | None = None, weight: Any = 1.0) -> Array:
    """Registers a sigmoid cross-entropy (same as a multi-Bernoulli predictive distribution)."""
    return register_multi_bernoulli_predictive_distribution(logits, targets, weight)


def register_categorical_predictive_distribution(logits: Array, targets: Array | None = None, mask: Array | None = None, weight: Any = 1.0) -> Array:
    """Registers a categorical distribution over the last axis of ``logits``.

    ``targets`` are integer classes of shape ``logits.shape[:-1]``, or one-hot
    vectors of the shape of ``logits``.
    """
    fn = "register_categorical_predictive_distribution"
    _check_floating(fn, "logits", logits)
    tag = categorical_logits_tag
    if targets is not None:
        if np.shape(targets) == np.shape(logits):
            tag = one_hot_categorical_logits_tag
        elif np.shape(targets) != np.shape(logits)[:-1] or not jnp.issubdtype(jnp.result_type(targets), jnp.integer):
            raise ValueError(
                f"{fn}: `targets` must be integer classes of shape logits.shape[:-1]={tuple(np.shape(logits)[:-1])} "
                f"(or one-hot of shape {tuple(np.shape(logits))}), got {_describe(targets)}."
            )
    if mask is not None and np.shape(mask) != np.shape(logits)[:-1]:
        raise ValueError(f"{fn}: `mask` must have shape logits.shape[:-1]={tuple(np.shape(logits)[:-1])}, got {_describe(mask)}.")
    _check_weight(fn, weight)
    return _bind(tag, logits=logits, targets=targets, mask=mask, weight=weight)


def register_softmax_cross_entropy_loss(logits: Array, targets: Array | None = None, mask: Array | None = None, weight: Any = 1.0) -> Array:
    """Registers a softmax cross-entropy (same as a categorical predictive distribution)."""
    return register_categorical_predictive_distribution(logits, targets, mask, weight)
