"""Loss functions: what curvax needs to know about a loss to build its curvature.

A loss object holds the loss's parameter-dependent inputs (logits, a mean, ...)
and its other arguments (targets, mask, weight, ...). It can evaluate the loss,
and multiply vectors by the loss's curvature with respect to its inputs: the
generalised Gauss-Newton matrix (GGN) and, for negative log-probabilities, the
Fisher, together with a factor ``B`` of each (``M = B B^T``).

Conventions (checked in ``tests/test_losses.py``):

* The parameter-dependent input has the **batch as dim 0** and the
  distribution over its **last** axis. Any dims in between (e.g. sequence
  positions) are independent cases, just like the batch.
* ``evaluate`` returns unreduced values of shape ``inputs.shape[:-1]`` (the
  Normal and Bernoulli losses sum over the last axis, middle dims are kept),
  times the coefficient: ``weight`` (``'regular'``), ``sqrt(weight)``
  (``'sqrt'``) or 1 (``'off'``).
* The model's loss is expected to be ``weight * sum(per-example losses) /
  batch_size``, i.e. the batch mean of per-example losses that *sum* over all
  non-batch dims. A loss that averages over other dims too (e.g. over pixels)
  must pass a correspondingly smaller ``weight``.
* Curvature products act on each case independently and take (and return)
  sequences of arrays shaped like the parameter-dependent inputs. Factor
  products ``B u`` take one array shaped like ``*_factor_inner_shape``.
  Weighted matrix products multiply by ``weight``, weighted factor products by
  ``sqrt(weight)``.
* For the natural-parameter losses (Normal mean, Bernoulli and categorical
  logits) the GGN equals the Fisher, and both equal the Hessian of the
  unweighted loss with respect to its inputs.
* Every loss is a JAX pytree whose children are its constructor arguments (in
  order, ``None`` allowed), so losses can cross ``jit`` boundaries.

The ``register_*`` functions mark a loss in a computation with a ``LossTag``
(see ``curvax.tags``); they are the identity on their first argument.
"""

from __future__ import annotations

import abc
import math
from typing import Any, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax.tags import LossTag

Array = jax.Array
Numeric = Any  # an array or a Python/NumPy scalar
Shape = tuple[int, ...]

COEFFICIENT_MODES = ("regular", "sqrt", "off")

# ``stable_sqrt``'s derivative is capped at this value (reached near 0).
_MAX_SQRT_DERIVATIVE = 1000.0


# ----------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------


@jax.custom_jvp
def stable_sqrt(x: Array) -> Array:
    """``sqrt(x)`` whose derivative is bounded (by 1000), so it stays finite at 0."""
    return jnp.sqrt(x)


@stable_sqrt.defjvp
def _stable_sqrt_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    (x,), (t,) = primals, tangents
    y = jnp.sqrt(x)
    floor = 1.0 / (2.0 * _MAX_SQRT_DERIVATIVE)
    return y, t / (2.0 * jnp.maximum(y, floor))


def _coefficient(weight: Numeric, mode: str) -> Array:
    """The factor ``evaluate`` multiplies the loss by, for ``coefficient_mode=mode``."""
    w = jnp.asarray(weight)
    if mode == "regular":
        return w
    if mode == "sqrt":
        return jnp.sqrt(w)
    if mode == "off":
        return jnp.ones_like(w)
    raise ValueError(f"coefficient_mode must be one of {COEFFICIENT_MODES}, got {mode!r}.")


def _scale(c: Numeric, x: Array) -> Array:
    """``c * x`` in ``x``'s dtype (a float64 weight must not promote a float32 product)."""
    return jnp.asarray(c).astype(x.dtype) * x


def _scale_all(c: Numeric, xs: Sequence[Array]) -> tuple[Array, ...]:
    return tuple(_scale(c, x) for x in xs)


def _vectors(vector: Any, n: int, what: str) -> tuple[Array, ...]:
    """Normalises a vector argument to a tuple of ``n`` arrays."""
    vs = tuple(vector) if isinstance(vector, (tuple, list)) else (vector,)
    if len(vs) != n:
        raise ValueError(f"{what}: expected {n} array(s), one per parameter-dependent input, got {len(vs)}.")
    return tuple(jnp.asarray(v) for v in vs)


def _replicated_one_hot(shape: Sequence[int], index: Any, dtype: Any) -> Array:
    """An array of ``shape`` that is 1 at ``index`` (non-batch dims) in every batch row."""
    shape = tuple(int(s) for s in shape)
    idx = tuple(int(i) for i in np.atleast_1d(np.asarray(index)).reshape(-1))
    if len(idx) != len(shape) - 1:
        raise ValueError(
            f"index must have one entry per non-batch dim of the factor's inner shape {shape} "
            f"({len(shape) - 1} entries), got {tuple(idx)}."
        )
    for i, s in zip(idx, shape[1:]):
        if not -s <= i < s:
            raise ValueError(f"index {idx} is out of range for the inner shape {shape}.")
    row = np.zeros(shape[1:], dtype=np.float32)
    row[idx] = 1.0
    return jnp.broadcast_to(jnp.asarray(row, dtype=dtype), shape)


# ----------------------------------------------------------------------------------
# Minimal distributions (no distrax / TFP dependency)
# ----------------------------------------------------------------------------------


class _DiagonalNormal:
    """Normal over the last axis with diagonal covariance ``variance * I``."""

    def __init__(self, loc: Array, variance: Numeric, normalized: Numeric = True):
        self.loc = loc
        self.variance = jnp.asarray(variance, dtype=loc.dtype)
        self.normalized = normalized

    def log_prob(self, value: Array) -> Array:
        quadratic = -0.5 * jnp.sum((value - self.loc) ** 2 / self.variance, axis=-1)
        log_norm = 0.5 * jnp.sum(jnp.broadcast_to(jnp.log(2.0 * jnp.pi * self.variance), self.loc.shape), axis=-1)
        return jnp.where(jnp.asarray(self.normalized, dtype=bool), quadratic - log_norm, quadratic)

    def sample(self, seed: Array) -> Array:
        noise = jax.random.normal(seed, self.loc.shape, self.loc.dtype)
        return self.loc + jnp.sqrt(self.variance) * noise

    def mean(self) -> Array:
        return self.loc


class _Bernoulli:
    """Independent Bernoullis given by logits; ``log_prob`` is elementwise (as kfac-jax's, one value per logit)."""

    def __init__(self, logits: Array):
        self.logits = logits

    def log_prob(self, value: Array) -> Array:
        y = jnp.asarray(value).astype(self.logits.dtype)
        z = self.logits
        return y * jax.nn.log_sigmoid(z) + (1.0 - y) * jax.nn.log_sigmoid(-z)

    def sample(self, seed: Array) -> Array:
        return jax.random.bernoulli(seed, jax.nn.sigmoid(self.logits)).astype(self.logits.dtype)

    def mean(self) -> Array:
        return jax.nn.sigmoid(self.logits)


class _Categorical:
    """Categorical over the last axis of ``logits``; values are integer classes."""

    def __init__(self, logits: Array):
        self.logits = logits

    def log_prob(self, value: Array) -> Array:
        logp = jax.nn.log_softmax(self.logits, axis=-1)
        classes = jnp.asarray(value).astype(jnp.int32)[..., None]
        return jnp.take_along_axis(logp, classes, axis=-1)[..., 0]

    def sample(self, seed: Array) -> Array:
        return jax.random.categorical(seed, self.logits, axis=-1)

    def mean(self) -> Array:
        return jax.nn.softmax(self.logits, axis=-1)


class _OneHotCategorical(_Categorical):
    """Categorical whose values are one-hot vectors over the last axis."""

    def log_prob(self, value: Array) -> Array:
        y = jnp.asarray(value).astype(self.logits.dtype)
        return jnp.sum(y * jax.nn.log_softmax(self.logits, axis=-1), axis=-1)

    def sample(self, seed: Array) -> Array:
        classes = super().sample(seed)
        return jax.nn.one_hot(classes, self.logits.shape[-1], dtype=self.logits.dtype)


# ----------------------------------------------------------------------------------
# Abstract interfaces
# ----------------------------------------------------------------------------------


class LossFunction(abc.ABC):
    """A loss of per-case inputs, with products by its GGN and by a GGN factor.

    Subclasses list their constructor arguments in ``_FIELDS`` (stored as
    ``self._<name>``) and the parameter-dependent ones in ``_DEPENDANTS``; this
    drives the pytree structure, ``parameter_(in)dependants`` and
    ``copy_with_different_inputs``.
    """

    _FIELDS: ClassVar[tuple[str, ...]] = ("weight",)
    _DEPENDANTS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, weight: Numeric):
        self._weight = jnp.asarray(weight)

    # -- structure -----------------------------------------------------------------

    @property
    def weight(self) -> Numeric:
        """The loss's scalar coefficient."""
        return self._weight

    @property
    def targets(self) -> Array | None:
        """The targets, if given (only needed to evaluate the loss)."""
        return getattr(self, "_targets", None)

    @property
    def parameter_dependants(self) -> tuple[Array, ...]:
        """The inputs that depend on the model's parameters (e.g. the logits)."""
        return tuple(getattr(self, "_" + n) for n in self._DEPENDANTS)

    @property
    def num_parameter_dependants(self) -> int:
        """Number of parameter-dependent inputs of the loss."""
        return len(self.parameter_dependants)

    @property
    def parameter_independants(self) -> tuple[Any, ...]:
        """The other constructor arguments (targets, mask, weight, ...), in order."""
        return tuple(getattr(self, "_" + n) for n in self._FIELDS if n not in self._DEPENDANTS)

    @property
    def num_parameter_independants(self) -> int:
        """Number of parameter-independent inputs of the loss (e.g. targets)."""
        return len(self.parameter_independants)

    @property
    def dtype(self) -> Any:
        """The dtype of the (first) parameter-dependent input."""
        return jnp.result_type(self.parameter_dependants[0])

    def copy_with_different_inputs(self, parameter_dependants: Sequence[Array]) -> "LossFunction":
        """The same loss (same targets, weight, ...) with other parameter-dependent inputs."""
        if not self._DEPENDANTS:
            raise NotImplementedError(
                f"{type(self).__name__} must define _FIELDS/_DEPENDANTS or override copy_with_different_inputs."
            )
        new = tuple(parameter_dependants)
        if len(new) != self.num_parameter_dependants:
            raise ValueError(
                f"{type(self).__name__} has {self.num_parameter_dependants} parameter-dependent input(s) "
                f"{self._DEPENDANTS}, got {len(new)}."
            )
        fields = dict(zip(self._FIELDS, self.tree_flatten()[0]))
        fields.update(zip(self._DEPENDANTS, new))
        return self.tree_unflatten(None, [fields[n] for n in self._FIELDS])

    # -- pytree --------------------------------------------------------------------

    def tree_flatten(self) -> tuple[tuple[Any, ...], None]:
        """Children: the constructor arguments in ``_FIELDS`` order."""
        return tuple(getattr(self, "_" + n) for n in self._FIELDS), None

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Sequence[Any]) -> "LossFunction":
        """Rebuilds a loss without running ``__init__`` (children may be placeholders)."""
        del aux
        obj = object.__new__(cls)
        for name, value in zip(cls._FIELDS, children):
            setattr(obj, "_" + name, value)
        return obj

    def __repr__(self) -> str:
        parts = []
        for name, value in zip(self._FIELDS, self.tree_flatten()[0]):
            parts.append(f"{name}={'None' if value is None else tuple(np.shape(value))}")
        return f"{type(self).__name__}({', '.join(parts)})"

    # -- evaluation ----------------------------------------------------------------

    def evaluate(self, targets: Array | None = None, coefficient_mode: str = "regular") -> Array:
        """Per-case losses (shape ``inputs.shape[:-1]``) times the coefficient.

        ``targets=None`` uses the registered targets.
        """
        targets = self.targets if targets is None else targets
        if targets is None:
            raise ValueError(
                f"{type(self).__name__}.evaluate needs targets: none were given here or at construction."
            )
        values = self._evaluate(targets)
        return _scale(_coefficient(self.weight, coefficient_mode), values)

    @abc.abstractmethod
    def _evaluate(self, targets: Array) -> Array:
        """Unweighted per-case losses."""

    def grad_of_evaluate(self, targets: Array | None, coefficient_mode: str) -> tuple[Array, ...]:
        """Gradient of ``sum(evaluate(targets, coefficient_mode))`` w.r.t. the parameter-dependent inputs."""

        def total(inputs: tuple[Array, ...]) -> Array:
            return jnp.sum(self.copy_with_different_inputs(inputs).evaluate(targets, coefficient_mode))

        return tuple(jax.grad(total)(self.parameter_dependants))

    # -- GGN products --------------------------------------------------------------

    def multiply_ggn(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """``weight * G v``, per case."""
        return _scale_all(self.weight, self.multiply_ggn_unweighted(vector))

    def multiply_ggn_factor(self, vector: Array) -> tuple[Array, ...]:
        """``sqrt(weight) * B u`` (``G = B B^T``); ``u`` has shape ``ggn_factor_inner_shape``."""
        return _scale_all(jnp.sqrt(self.weight), self.multiply_ggn_factor_unweighted(vector))

    def multiply_ggn_factor_transpose(self, vector: Sequence[Array]) -> Array:
        """``sqrt(weight) * B^T v``, of shape ``ggn_factor_inner_shape``."""
        return _scale(jnp.sqrt(self.weight), self.multiply_ggn_factor_transpose_unweighted(vector))

    def multiply_ggn_factor_replicated_one_hot(self, index: Sequence[int]) -> tuple[Array, ...]:
        """``sqrt(weight) * B e`` with ``e`` one at ``index`` (non-batch dims) in every batch row."""
        return _scale_all(jnp.sqrt(self.weight), self.multiply_ggn_factor_replicated_one_hot_unweighted(index))

    @abc.abstractmethod
    def multiply_ggn_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """``G v``."""

    @abc.abstractmethod
    def multiply_ggn_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        """``B u``."""

    @abc.abstractmethod
    def multiply_ggn_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        """``B^T v``."""

    def multiply_ggn_factor_replicated_one_hot_unweighted(self, index: Sequence[int]) -> tuple[Array, ...]:
        """``B e_index`` for every batch row at once: ``B`` applied to the replicated one-hot array."""
        e = _replicated_one_hot(self.ggn_factor_inner_shape, index, self.parameter_dependants[0].dtype)
        return self.multiply_ggn_factor_unweighted(e)

    @property
    @abc.abstractmethod
    def ggn_factor_inner_shape(self) -> Shape:
        """Shape of the ``u`` in ``B u`` (batch first)."""


class NegativeLogProbLoss(LossFunction):
    """``-log p(targets | params)``: adds Fisher products and sampling from ``p``."""

    @property
    def parameter_dependants(self) -> tuple[Array, ...]:
        return self.params

    @property
    @abc.abstractmethod
    def params(self) -> tuple[Array, ...]:
        """The distribution's parameters (the parameter-dependent inputs)."""

    def multiply_fisher(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """``weight * F v``, per case."""
        return _scale_all(self.weight, self.multiply_fisher_unweighted(vector))

    def multiply_fisher_factor(self, vector: Array) -> tuple[Array, ...]:
        """``sqrt(weight) * B u`` (``F = B B^T``); ``u`` has shape ``fisher_factor_inner_shape``."""
        return _scale_all(jnp.sqrt(self.weight), self.multiply_fisher_factor_unweighted(vector))

    def multiply_fisher_factor_transpose(self, vector: Sequence[Array]) -> Array:
        """``sqrt(weight) * B^T v``, of shape ``fisher_factor_inner_shape``."""
        return _scale(jnp.sqrt(self.weight), self.multiply_fisher_factor_transpose_unweighted(vector))

    def multiply_fisher_factor_replicated_one_hot(self, index: Sequence[int]) -> tuple[Array, ...]:
        """``sqrt(weight) * B e`` with ``e`` one at ``index`` (non-batch dims) in every batch row."""
        return _scale_all(jnp.sqrt(self.weight), self.multiply_fisher_factor_replicated_one_hot_unweighted(index))

    @abc.abstractmethod
    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        """``F v``."""

    @abc.abstractmethod
    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        """``B u``."""

    @abc.abstractmethod
    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        """``B^T v``."""

    def multiply_fisher_factor_replicated_one_hot_unweighted(self, index: Sequence[int]) -> tuple[Array, ...]:
        """``B e_index`` for every batch row at once: ``B`` applied to the replicated one-hot array."""
        e = _replicated_one_hot(self.fisher_factor_inner_shape, index, self.params[0].dtype)
        return self.multiply_fisher_factor_unweighted(e)

    @property
    @abc.abstractmethod
    def fisher_factor_inner_shape(self) -> Shape:
        """Shape of the ``u`` in ``B u`` (batch first)."""

    @abc.abstractmethod
    def sample(self, rng: Array) -> Array:
        """Targets drawn from the model's predictive distribution."""

    def grad_of_evaluate_on_sample(self, rng: Array, coefficient_mode: str) -> tuple[Array, ...]:
        """The loss gradient at sampled targets: with ``'sqrt'``, ``E[g g^T] = weight * F``."""
        sample = jax.lax.stop_gradient(self.sample(rng))
        return self.grad_of_evaluate(sample, coefficient_mode)


class NaturalParamsNegativeLogProbLoss(NegativeLogProbLoss):
    """An exponential family in its natural parameters: the GGN is the Fisher."""

    def multiply_ggn_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        return self.multiply_fisher_unweighted(vector)

    def multiply_ggn_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        return self.multiply_fisher_factor_unweighted(vector)

    def multiply_ggn_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        return self.multiply_fisher_factor_transpose_unweighted(vector)

    @property
    def ggn_factor_inner_shape(self) -> Shape:
        return self.fisher_factor_inner_shape


class DistributionNegativeLogProbLoss(NegativeLogProbLoss):
    """A negative log-probability given by a distribution object ``dist``.

    ``dist`` has ``log_prob(value)``, ``sample(seed)`` and ``mean()`` (curvax's
    own minimal distributions; no distrax needed).
    """

    @property
    @abc.abstractmethod
    def dist(self) -> Any:
        """The predictive distribution."""

    def _evaluate(self, targets: Array) -> Array:
        return -self.dist.log_prob(targets)

    def sample(self, rng: Array) -> Array:
        return self.dist.sample(rng)

    @property
    def fisher_factor_inner_shape(self) -> Shape:
        return tuple(np.shape(self.params[0]))


# ----------------------------------------------------------------------------------
# Concrete losses
# ----------------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class NormalMeanNegativeLogProbLoss(DistributionNegativeLogProbLoss, NaturalParamsNegativeLogProbLoss):
    """``-log N(targets; mean, variance * I)`` over the last axis.

    Fisher (= GGN = Hessian) ``I / variance``, factor ``I / sqrt(variance)``.
    With ``normalize_log_prob=False`` the loss is ``sum((mean - y)^2) / (2 variance)``
    over the last axis: the default ``variance=0.5`` is then plain squared error.
    """

    _FIELDS = ("mean", "targets", "variance", "weight", "normalize_log_prob")
    _DEPENDANTS = ("mean",)

    def __init__(
        self,
        mean: Array,
        targets: Array | None = None,
        variance: Numeric = 0.5,
        weight: Numeric = 1.0,
        normalize_log_prob: Numeric = True,
    ):
        super().__init__(weight)
        self._mean = mean
        self._targets = targets
        self._variance = jnp.asarray(variance)
        self._normalize_log_prob = normalize_log_prob

    @property
    def params(self) -> tuple[Array, ...]:
        return (self._mean,)

    @property
    def mean(self) -> Array:
        """The predicted mean."""
        return self._mean

    @property
    def variance(self) -> Array:
        """The fixed variance of the Gaussian."""
        return self._variance

    @property
    def normalize_log_prob(self) -> Numeric:
        """Whether the log-probability includes its normalising constant."""
        return self._normalize_log_prob

    def _var(self) -> Array:
        return jnp.asarray(self._variance).astype(self._mean.dtype)

    @property
    def dist(self) -> _DiagonalNormal:
        return _DiagonalNormal(self._mean, self._var(), self._normalize_log_prob)

    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        (v,) = _vectors(vector, 1, "multiply_fisher")
        return (v / self._var(),)

    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        return (jnp.asarray(vector) / jnp.sqrt(self._var()),)

    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        (v,) = _vectors(vector, 1, "multiply_fisher_factor_transpose")
        return v / jnp.sqrt(self._var())


@jax.tree_util.register_pytree_node_class
class NormalMeanVarianceNegativeLogProbLoss(DistributionNegativeLogProbLoss):
    """``-log N(targets; mean, diag(variance))`` over the last axis; both are inputs.

    Fisher in ``(mean, s = variance)``: ``diag(1/s, 1/(2 s^2))``. The factor's
    inner shape concatenates a mean part and a variance part on the last axis.
    Not in natural parameters, so there is no GGN (its Hessian is not PSD).
    """

    _FIELDS = ("mean", "variance", "targets", "weight")
    _DEPENDANTS = ("mean", "variance")

    def __init__(self, mean: Array, variance: Array, targets: Array | None = None, weight: Numeric = 1.0):
        super().__init__(weight)
        self._mean = mean
        self._variance = variance
        self._targets = targets

    @property
    def params(self) -> tuple[Array, ...]:
        return (self._mean, self._variance)

    @property
    def mean(self) -> Array:
        """The predicted mean."""
        return self._mean

    @property
    def variance(self) -> Array:
        """The predicted variance."""
        return self._variance

    @property
    def dist(self) -> _DiagonalNormal:
        return _DiagonalNormal(self._mean, self._variance, True)

    @property
    def fisher_factor_inner_shape(self) -> Shape:
        shape = tuple(np.shape(self._mean))
        return shape[:-1] + (2 * shape[-1],)

    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        vm, vs = _vectors(vector, 2, "multiply_fisher")
        s = self._variance
        return (vm / s, vs / (2.0 * s**2))

    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        u = jnp.asarray(vector)
        d = np.shape(self._mean)[-1]
        s = self._variance
        return (u[..., :d] / jnp.sqrt(s), u[..., d:] / (math.sqrt(2.0) * s))

    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        vm, vs = _vectors(vector, 2, "multiply_fisher_factor_transpose")
        s = self._variance
        return jnp.concatenate([vm / jnp.sqrt(s), vs / (math.sqrt(2.0) * s)], axis=-1)

    def _no_ggn(self) -> Any:
        raise NotImplementedError(
            "NormalMeanVarianceNegativeLogProbLoss has no GGN (its Hessian in (mean, variance) is not "
            "positive semi-definite): use a Fisher estimation mode such as 'fisher_gradients', "
            "'fisher_curvature_prop' or 'fisher_exact'."
        )

    def multiply_ggn_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        return self._no_ggn()

    def multiply_ggn_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        return self._no_ggn()

    def multiply_ggn_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        return self._no_ggn()

    @property
    def ggn_factor_inner_shape(self) -> Shape:
        return self._no_ggn()


@jax.tree_util.register_pytree_node_class
class MultiBernoulliNegativeLogProbLoss(DistributionNegativeLogProbLoss, NaturalParamsNegativeLogProbLoss):
    """Independent Bernoullis given by logits (sigmoid cross-entropy), summed over the last axis.

    Fisher ``diag(p (1 - p))`` with ``p = sigmoid(logits)``; factor its
    square root (a ``stable_sqrt``, so gradients stay finite when ``p`` saturates).
    """

    _FIELDS = ("logits", "targets", "weight")
    _DEPENDANTS = ("logits",)

    def __init__(self, logits: Array, targets: Array | None = None, weight: Numeric = 1.0):
        super().__init__(weight)
        self._logits = logits
        self._targets = targets

    @property
    def params(self) -> tuple[Array, ...]:
        return (self._logits,)

    @property
    def logits(self) -> Array:
        """The logits of the independent Bernoulli outputs."""
        return self._logits

    @property
    def dist(self) -> _Bernoulli:
        return _Bernoulli(self._logits)

    def _variances(self) -> Array:
        p = jax.nn.sigmoid(self._logits)
        return p * (1.0 - p)

    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        (v,) = _vectors(vector, 1, "multiply_fisher")
        return (self._variances() * v,)

    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        return (stable_sqrt(self._variances()) * jnp.asarray(vector),)

    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        (v,) = _vectors(vector, 1, "multiply_fisher_factor_transpose")
        return stable_sqrt(self._variances()) * v


@jax.tree_util.register_pytree_node_class
class CategoricalLogitsNegativeLogProbLoss(DistributionNegativeLogProbLoss, NaturalParamsNegativeLogProbLoss):
    """Softmax cross-entropy over the last axis of ``logits``, with integer targets.

    Fisher ``F = diag(p) - p p^T`` with ``p = softmax(logits)``; factor
    ``B = diag(q) - p q^T`` with ``q = sqrt(p)`` (``B B^T = F`` since ``q.q = 1``).
    An optional ``mask`` of shape ``logits.shape[:-1]`` (0/1) multiplies each
    case's loss, so its curvature becomes ``mask * F`` and its factor
    ``sqrt(mask) * B``: masked cases contribute nothing.
    """

    _FIELDS = ("logits", "targets", "mask", "weight")
    _DEPENDANTS = ("logits",)
    _ONE_HOT_TARGETS: ClassVar[bool] = False

    def __init__(
        self,
        logits: Array,
        targets: Array | None = None,
        mask: Array | None = None,
        weight: Numeric = 1.0,
    ):
        super().__init__(weight)
        self._logits = logits
        self._targets = targets
        self._mask = mask

    @property
    def params(self) -> tuple[Array, ...]:
        return (self._logits,)

    @property
    def logits(self) -> Array:
        """The logits, shape ``(batch, num_classes)``."""
        return self._logits

    @property
    def mask(self) -> Array | None:
        """The optional per-example mask, or ``None``."""
        return self._mask

    @property
    def dist(self) -> _Categorical:
        return _Categorical(self._logits)

    def _case_mask(self) -> Array | None:
        """The mask as a float array broadcastable against the logits, or None."""
        if self._mask is None:
            return None
        return jnp.asarray(self._mask).astype(self._logits.dtype)[..., None]

    def _evaluate(self, targets: Array) -> Array:
        if self._mask is not None and not self._ONE_HOT_TARGETS:
            # Masked cases may hold padding targets (e.g. -1): read a valid class there.
            targets = jnp.where(jnp.asarray(self._mask) != 0, targets, 0)
        nll = -self.dist.log_prob(targets)
        if self._mask is None:
            return nll
        return nll * jnp.asarray(self._mask).astype(nll.dtype)

    def _probs(self) -> tuple[Array, Array]:
        """``(p, q = sqrt(p))``, both from the log-softmax (smooth, no sqrt at 0)."""
        logp = jax.nn.log_softmax(self._logits, axis=-1)
        return jnp.exp(logp), jnp.exp(0.5 * logp)

    def _apply_mask(self, x: Array, root: bool) -> Array:
        m = self._case_mask()
        if m is None:
            return x
        return x * (jnp.sqrt(m) if root else m)

    def multiply_fisher_unweighted(self, vector: Sequence[Array]) -> tuple[Array, ...]:
        (v,) = _vectors(vector, 1, "multiply_fisher")
        p, _ = self._probs()
        fv = p * v - p * jnp.sum(p * v, axis=-1, keepdims=True)
        return (self._apply_mask(fv, root=False),)

    def multiply_fisher_factor_unweighted(self, vector: Array) -> tuple[Array, ...]:
        u = jnp.asarray(vector)
        p, q = self._probs()
        bu = q * u - p * jnp.sum(q * u, axis=-1, keepdims=True)
        return (self._apply_mask(bu, root=True),)

    def multiply_fisher_factor_transpose_unweighted(self, vector: Sequence[Array]) -> Array:
        (v,) = _vectors(vector, 1, "multiply_fisher_factor_transpose")
        p, q = self._probs()
        btv = q * v - q * jnp.sum(p * v, axis=-1, keepdims=True)
        return self._apply_mask(btv, root=True)


@jax.tree_util.register_pytree_node_class
class OneHotCategoricalLogitsNegativeLogProbLoss(CategoricalLogitsNegativeLogProbLoss):
    """``CategoricalLogitsNegativeLogProbLoss`` with one-hot targets (shape of ``logits``)."""

    _ONE_HOT_TARGETS = True

    @property
    def dist(self) -> _OneHotCategorical:
        return _OneHotCategorical(self._logits)


# ----------------------------------------------------------------------------------
# Tags
# ----------------------------------------------------------------------------------

normal_mean_tag = LossTag(
    NormalMeanNegativeLogProbLoss, ["mean"], ["targets", "variance", "weight", "normalize_log_prob"]
)
normal_mean_variance_tag = LossTag(NormalMeanVarianceNegativeLogProbLoss, ["mean", "variance"], ["targets", "weight"])
multi_bernoulli_tag = LossTag(MultiBernoulliNegativeLogProbLoss, ["logits"], ["targets", "weight"])
categorical_logits_tag = LossTag(CategoricalLogitsNegativeLogProbLoss, ["logits"], ["targets", "mask", "weight"])
one_hot_categorical_logits_tag = LossTag(
    OneHotCategoricalLogitsNegativeLogProbLoss, ["logits"], ["targets", "mask", "weight"]
)

LOSS_TAGS: dict[str, LossTag] = {
    "normal_mean": normal_mean_tag,
    "normal_mean_variance": normal_mean_variance_tag,
    "multi_bernoulli": multi_bernoulli_tag,
    "categorical_logits": categorical_logits_tag,
    "one_hot_categorical_logits": one_hot_categorical_logits_tag,
}


# ----------------------------------------------------------------------------------
# Registration (with trace-time validation)
# ----------------------------------------------------------------------------------


def _describe(x: Any) -> str:
    """``(128, 10) float32`` for arrays, the type name otherwise."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{tuple(x.shape)} {np.dtype(x.dtype).name}"
    if isinstance(x, (bool, int, float, complex, np.generic)):
        return f"() {np.asarray(x).dtype.name} ({x!r})"
    return type(x).__name__


def _concrete(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array if its value is known at trace time, else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
    except Exception:  # noqa: BLE001 - anything unconvertible simply has no concrete value
        return None


def _require_array(fn: str, name: str, x: Any) -> Any:
    """``x`` if it is array-like (has shape and dtype, or is a Python/NumPy scalar)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return x
    if isinstance(x, (bool, int, float, np.generic)):
        return np.asarray(x)
    raise TypeError(f"{fn}: `{name}` must be an array, got {_describe(x)}.")


def _check_inputs_array(fn: str, name: str, x: Any, what: str) -> None:
    """The parameter-dependent input: a floating array with a batch dim and a last (event) dim."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{fn}: `{name}` must be a JAX array, got {_describe(x)}.")
    if len(x.shape) < 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"{fn}: `{name}` must be a floating-point array with at least 2 dims (batch first, {what} last), "
            f"got {_describe(x)}."
        )


def _check_scalar(fn: str, name: str, x: Any, positive: bool) -> None:
    """A real scalar; non-negative (or positive) when its value is known at trace time."""
    x = _require_array(fn, name, x)
    if len(np.shape(x)) != 0:
        raise ValueError(f"{fn}: `{name}` must be a scalar, got {_describe(x)}.")
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise ValueError(f"{fn}: `{name}` must be a real number, got {_describe(x)}.")
    value = _concrete(x)
    if value is None:
        return
    v = float(value)
    if positive and not v > 0:
        raise ValueError(f"{fn}: `{name}` must be positive, got {v}.")
    if not positive and not v >= 0:
        raise ValueError(f"{fn}: `{name}` must be non-negative, got {v}.")


def _check_same_shape(fn: str, name: str, x: Any, like_name: str, like: Any) -> None:
    x = _require_array(fn, name, x)
    if tuple(x.shape) != tuple(like.shape):
        raise ValueError(
            f"{fn}: `{name}` must have the shape of `{like_name}` {tuple(like.shape)}, got {_describe(x)}."
        )
    if not (jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_)):
        raise ValueError(f"{fn}: `{name}` must be numeric, got {_describe(x)}.")


def _check_mask(fn: str, mask: Any, logits: Any) -> None:
    mask = _require_array(fn, "mask", mask)
    expected = tuple(logits.shape[:-1])
    if tuple(mask.shape) != expected:
        raise ValueError(
            f"{fn}: `mask` must have shape logits.shape[:-1]={expected} (0/1 values), got {_describe(mask)}."
        )
    if not (jnp.issubdtype(mask.dtype, jnp.number) or jnp.issubdtype(mask.dtype, jnp.bool_)):
        raise ValueError(f"{fn}: `mask` must be boolean or numeric (0/1 values), got {_describe(mask)}.")


def _bind(tag: LossTag, **arguments: Any) -> Any:
    """Binds ``tag`` on the non-None arguments (as arrays); returns the tagged input(s)."""
    names = tuple(n for n, v in arguments.items() if v is not None)
    operands = [jnp.asarray(arguments[n]) for n in names]
    out = tag.bind(*operands, args_names=names)
    return out[0] if len(out) == 1 else tuple(out)


def _register_normal(
    fn: str,
    mean_name: str,
    mean: Array,
    targets: Array | None,
    variance: Numeric,
    weight: Numeric,
    normalize_log_prob: bool,
) -> Array:
    _check_inputs_array(fn, mean_name, mean, "the distribution's dim")
    if targets is not None:
        _check_same_shape(fn, "targets", targets, mean_name, mean)
    _check_scalar(fn, "variance", variance, positive=True)
    _check_scalar(fn, "weight", weight, positive=False)
    if not isinstance(normalize_log_prob, (bool, np.bool_)):
        raise TypeError(f"{fn}: `normalize_log_prob` must be a Python bool, got {_describe(normalize_log_prob)}.")
    return _bind(
        normal_mean_tag,
        mean=mean,
        targets=targets,
        variance=variance,
        weight=weight,
        normalize_log_prob=bool(normalize_log_prob),
    )


def register_normal_predictive_distribution(
    mean: Array,
    targets: Array | None = None,
    variance: float = 0.5,
    weight: Numeric = 1.0,
    normalize_log_prob: bool = True,
) -> Array:
    """Registers ``-log N(targets; mean, variance * I)`` per example; returns ``mean``.

    Up to a constant this is ``weight / (2 variance) * ||targets - mean||^2``:
    ``variance=0.5`` matches ``weight * ||targets - mean||^2``, ``variance=1``
    matches ``0.5 * weight * ||targets - mean||^2``. ``targets`` are only needed
    for the empirical Fisher.
    """
    return _register_normal(
        "register_normal_predictive_distribution", "mean", mean, targets, variance, weight, normalize_log_prob
    )


def register_squared_error_loss(prediction: Array, targets: Array | None = None, weight: Numeric = 1.0) -> Array:
    """Registers ``weight * ||targets - prediction||^2`` per example; returns ``prediction``.

    A normal with ``variance=0.5`` and no normalising constant. A loss with a
    factor 1/2 should pass ``weight=0.5``.
    """
    return _register_normal("register_squared_error_loss", "prediction", prediction, targets, 0.5, weight, False)


def _register_bernoulli(fn: str, logits: Array, targets: Array | None, weight: Numeric) -> Array:
    _check_inputs_array(fn, "logits", logits, "the independent outcomes")
    if targets is not None:
        _check_same_shape(fn, "targets", targets, "logits", logits)
    _check_scalar(fn, "weight", weight, positive=False)
    return _bind(multi_bernoulli_tag, logits=logits, targets=targets, weight=weight)


def register_multi_bernoulli_predictive_distribution(
    logits: Array, targets: Array | None = None, weight: Numeric = 1.0
) -> Array:
    """Registers independent Bernoullis with these ``logits`` (0/1 targets of the same shape); returns ``logits``."""
    return _register_bernoulli("register_multi_bernoulli_predictive_distribution", logits, targets, weight)


def register_sigmoid_cross_entropy_loss(logits: Array, targets: Array | None = None, weight: Numeric = 1.0) -> Array:
    """Registers a sigmoid cross-entropy, summed over the last axis per example; returns ``logits``."""
    return _register_bernoulli("register_sigmoid_cross_entropy_loss", logits, targets, weight)


def _register_categorical(
    fn: str, logits: Array, targets: Array | None, mask: Array | None, weight: Numeric
) -> Array:
    _check_inputs_array(fn, "logits", logits, "classes")
    tag = categorical_logits_tag
    if targets is not None:
        targets = _require_array(fn, "targets", targets)
        one_hot = len(targets.shape) == len(logits.shape)
        if one_hot:
            numeric = jnp.issubdtype(targets.dtype, jnp.number) or jnp.issubdtype(targets.dtype, jnp.bool_)
            valid = tuple(targets.shape) == tuple(logits.shape) and numeric
        else:
            valid = tuple(targets.shape) == tuple(logits.shape[:-1]) and jnp.issubdtype(targets.dtype, jnp.integer)
        if not valid:
            raise ValueError(
                f"{fn}: `targets` must be integer classes of shape logits.shape[:-1]={tuple(logits.shape[:-1])} "
                f"(or one-hot of shape logits.shape={tuple(logits.shape)}), got {_describe(targets)}."
            )
        if one_hot:
            tag = one_hot_categorical_logits_tag
    if mask is not None:
        _check_mask(fn, mask, logits)
    _check_scalar(fn, "weight", weight, positive=False)
    return _bind(tag, logits=logits, targets=targets, mask=mask, weight=weight)


def register_categorical_predictive_distribution(
    logits: Array, targets: Array | None = None, mask: Array | None = None, weight: Numeric = 1.0
) -> Array:
    """Registers a categorical distribution over the last axis of ``logits``; returns ``logits``.

    ``targets``: integer classes of shape ``logits.shape[:-1]``, or one-hot
    vectors of the shape of ``logits``. ``mask`` (shape ``logits.shape[:-1]``,
    0/1) removes cases, e.g. padding positions.
    """
    return _register_categorical("register_categorical_predictive_distribution", logits, targets, mask, weight)


def register_softmax_cross_entropy_loss(
    logits: Array, targets: Array | None = None, mask: Array | None = None, weight: Numeric = 1.0
) -> Array:
    """Registers a softmax cross-entropy over the last axis of ``logits``; returns ``logits``.

    Same arguments as ``register_categorical_predictive_distribution``.
    """
    return _register_categorical("register_softmax_cross_entropy_loss", logits, targets, mask, weight)


__all__ = [
    "COEFFICIENT_MODES",
    "CategoricalLogitsNegativeLogProbLoss",
    "DistributionNegativeLogProbLoss",
    "LOSS_TAGS",
    "LossFunction",
    "MultiBernoulliNegativeLogProbLoss",
    "NaturalParamsNegativeLogProbLoss",
    "NegativeLogProbLoss",
    "NormalMeanNegativeLogProbLoss",
    "NormalMeanVarianceNegativeLogProbLoss",
    "OneHotCategoricalLogitsNegativeLogProbLoss",
    "categorical_logits_tag",
    "multi_bernoulli_tag",
    "normal_mean_tag",
    "normal_mean_variance_tag",
    "one_hot_categorical_logits_tag",
    "register_categorical_predictive_distribution",
    "register_multi_bernoulli_predictive_distribution",
    "register_normal_predictive_distribution",
    "register_sigmoid_cross_entropy_loss",
    "register_softmax_cross_entropy_loss",
    "register_squared_error_loss",
    "stable_sqrt",
]
