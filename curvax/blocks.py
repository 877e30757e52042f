"""Curvature blocks: per-layer approximations of the curvature matrix.

A block owns one layer's parameters (the ``params`` of its ``LayerTagEqn``) and
keeps a moving-average estimate of that layer's diagonal block of the
curvature (Fisher / GGN). It can multiply vectors by powers of
``C + identity_weight * I`` either exactly or with a cheaper approximation,
and can cache expensive pieces (eigen-decompositions, inverses) so that they
are recomputed only every few optimizer steps.

Conventions shared by all blocks:

* Vectors are tuples of arrays shaped like the block's parameters, in ``params``
  order. Dense matrices use the same order: each parameter flattened in C order,
  concatenated.
* The represented matrix is ``C = s * C_unscaled`` with
  ``s = fixed_scale() * state_dependent_scale(state)``. Products computed from
  the cache apply only ``fixed_scale`` at call time; the state dependent part is
  folded into the cache when it is built.
* Exact powers are served from cached eigen-decompositions, which do not depend
  on the damping, so the ``identity_weight`` passed at call time is always used.
  Approximate inverses (pi-damped Kronecker factors) bake in the damping given
  to ``update_cache``; it is stored in the cache as ``identity_weight``.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import math
import numbers
from typing import Any, Callable, Mapping, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from curvax import _generations, linalg, tags, utils
from curvax.tracing import LayerData, LayerVjpData

Array = jax.Array
Numeric = Any
Shape = tuple[int, ...]
ScalarOrSequence = Union[Numeric, Sequence[Numeric], None]

__all__ = [
    "WeightedMovingAverage",
    "register_state_class",
    "CurvatureBlock",
    "ScaledIdentity",
    "Diagonal",
    "NaiveDiagonal",
    "DenseDiagonal",
    "Full",
    "NaiveFull",
    "DenseFull",
    "TwoKroneckerFactored",
    "KroneckerFactored",
    "DenseTwoKroneckerFactored",
    "RepeatedDenseKroneckerFactored",
    "DenseTwoKroneckerFactoredReduce",
    "EigenvalueCorrectedKroneckerFactored",
    "DenseEigenvalueCorrected",
    "NaiveTNT",
    "DenseTNT",
    "get_default_tag_to_block_ctor",
    "set_default_tag_to_block_ctor",
    "set_multi_default_tag_to_block_ctor",
    "find_default_tag_to_block_ctor",
    "construct_block",
    "get_default_eigen_decomposition_threshold",
    "set_default_eigen_decomposition_threshold",
    "get_max_parallel_elements",
    "set_max_parallel_elements",
]


# ----------------------------------------------------------------------------------
# Moving averages and state classes
# ----------------------------------------------------------------------------------


# Blocks without a closed form build their dense matrix for ``inverse_diagonal`` up to this size.
DENSE_INVERSE_DIAGONAL_LIMIT = 4096


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class WeightedMovingAverage:
    """A normalised (bias-corrected) exponential moving average.

    ``update(x, ema_old, ema_new)`` sets ``weight <- ema_old * weight + ema_new``
    and ``value <- (ema_old * old_weight * value + ema_new * x) / weight``, so
    ``value`` is the weighted mean of everything seen. It starts with zero weight,
    so the first update replaces the value. The object is mutable on purpose
    (blocks and user code update factors in place, as in kfac-jax); it is a
    pytree, so it can live inside jitted state.
    """

    weight: Array
    value: Array

    @classmethod
    def zeros(cls, shape: Sequence[int], dtype: Any = None) -> "WeightedMovingAverage":
        """An empty average (zero weight) of arrays with ``shape`` and ``dtype``."""
        dtype = jnp.float32 if dtype is None else dtype
        return cls(weight=jnp.zeros([], dtype), value=jnp.zeros(tuple(shape), dtype))

    zeros_array = zeros

    @classmethod
    def zeros_like(cls, value: Any) -> "WeightedMovingAverage":
        """An empty average of arrays shaped like ``value``."""
        dtype = value.dtype if hasattr(value, "dtype") else jnp.asarray(value).dtype
        return cls.zeros(np.shape(value), dtype)

    @property
    def raw_value(self) -> Array:
        """The un-normalised sum ``weight * value``."""
        return self.value * self.weight

    def update(self, value: Array, ema_old: Numeric, ema_new: Numeric) -> None:
        """Folds ``value`` into the average, in place (see the class docstring)."""
        if np.shape(value) != np.shape(self.value):
            raise ValueError(
                f"WeightedMovingAverage.update: value has shape {np.shape(value)}, "
                f"the average holds shape {np.shape(self.value)}."
            )
        old_w = self.weight
        new_w = ema_old * old_w + ema_new
        nonzero = new_w != 0
        safe_w = jnp.where(nonzero, new_w, 1)
        new_v = (ema_old * old_w * self.value + ema_new * value) / safe_w
        new_v = jnp.where(nonzero, new_v, self.value)
        self.weight = jnp.asarray(new_w).astype(old_w.dtype)
        self.value = jnp.asarray(new_v).astype(self.value.dtype)

    def copy(self) -> "WeightedMovingAverage":
        """A new object sharing the (immutable) arrays."""
        return WeightedMovingAverage(weight=self.weight, value=self.value)

    def clear(self) -> None:
        """Resets to an empty average, in place."""
        self.weight = jnp.zeros_like(self.weight)
        self.value = jnp.zeros_like(self.value)

    def sync(self, pmap_axis_name: str | None) -> None:
        """Averages ``value`` across devices (``lax.pmean``), in place.

        Only inside a ``pmap``/``shard_map`` binding ``pmap_axis_name``; elsewhere (e.g. a
        plain ``jit``, where shardings reduce the statistics) it does nothing, as in kfac-jax.
        """
        if utils.in_pmap(pmap_axis_name):
            self.value = lax.pmean(self.value, pmap_axis_name)


def register_state_class(cls: type) -> type:
    """Makes ``cls`` a dataclass registered as a pytree (all fields are children).

    Use it on ``State`` subclasses of custom blocks that add fields.
    """
    if not dataclasses.is_dataclass(cls) or "__dataclass_fields__" not in cls.__dict__:
        cls = dataclasses.dataclass(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])


def _copy_state(state: Any) -> Any:
    """A structural copy: new dataclass, dict and moving-average objects, same arrays."""
    return jax.tree_util.tree_map(lambda x: x, state)


# ----------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------


def _to_powers(value: ScalarOrSequence, arg_name: str) -> tuple[Numeric, ...]:
    """Normalises ``None | scalar | sequence`` of (static) powers to a tuple without repeats."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
    out: list[Numeric] = []
    for p in items:
        if isinstance(p, (jax.Array, np.ndarray)) and np.ndim(p) == 0:
            try:
                p = float(p)
            except Exception as e:  # a tracer
                raise TypeError(f"`{arg_name}` must hold static Python numbers, got a traced value.") from e
        if isinstance(p, bool) or not isinstance(p, numbers.Real):
            raise TypeError(f"`{arg_name}` must hold real numbers, got {p!r}.")
        p = _normalise_power(p)
        if p not in out:
            out.append(p)
    return tuple(out)


def _normalise_power(p: Numeric) -> Numeric:
    p = float(p)
    return int(p) if p.is_integer() else p


def power_key(power: Numeric) -> str:
    """The cache key of a matrix power: ``-1 -> "-1"``, ``-0.5 -> "-0.5"``."""
    return str(_normalise_power(power))


def _check_power(power: Any) -> Numeric:
    if isinstance(power, bool) or not isinstance(power, numbers.Real):
        if isinstance(power, (jax.Array, np.ndarray)) and np.ndim(power) == 0:
            try:
                return _normalise_power(float(power))
            except Exception as e:
                raise TypeError("`power` must be a static Python number, got a traced value.") from e
        raise TypeError(f"`power` must be a real number, got {power!r}.")
    return _normalise_power(power)


def _cast_floating(tree: Any, dtype: Any) -> Any:
    """``tree`` with its floating-point leaves cast to ``dtype`` (a structural copy)."""
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x
    return jax.tree_util.tree_map(cast, tree)


def _is_one(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == 1


def _mul(x: Array, factor: Any) -> Array:
    return x if _is_one(factor) else x * factor


def _pow_scalar(s: Any, p: Numeric) -> Any:
    if _is_one(s):
        return 1
    if isinstance(s, numbers.Real):
        return float(s) ** p
    return jnp.power(s, p)


def _div(x: Any, s: Any) -> Any:
    return x if _is_one(s) else x / s


def _per_example(x: Array, feature_dim: int, what: str) -> Array:
    """Reshapes ``(B, *extra, d)`` to ``(B, T, d)`` (``T = prod(extra)``); 1-D is one example."""
    if x.shape[-1] != feature_dim:
        raise ValueError(f"{what} must have {feature_dim} features in its last axis, got shape {x.shape}.")
    if x.ndim == 1:
        return x.reshape(1, 1, feature_dim)
    return x.reshape(x.shape[0], -1, feature_dim)


# ----------------------------------------------------------------------------------
# Base class
# ----------------------------------------------------------------------------------


def estimation_data_as_dict(data: Any) -> dict[str, tuple]:
    """Block estimation data as curvax's dict (``inputs``, ``outputs``, ``params``,
    ``outputs_tangent``, ``params_tangent``); accepts a dict or a kfac-jax v0.0.8 ``LayerVjpData``."""
    if isinstance(data, Mapping):
        return data  # type: ignore[return-value]
    if hasattr(data, "primals") and hasattr(data, "tangents"):
        p, t = data.primals, data.tangents
        return {
            "inputs": tuple(p.inputs), "outputs": tuple(p.outputs), "params": tuple(p.params),
            "outputs_tangent": tuple(t.outputs), "params_tangent": tuple(t.params),
        }
    raise TypeError(
        f"`estimation_data` must be a dict of layer data or a LayerVjpData (primals/tangents), got {type(data).__name__}."
    )


def estimation_data_as_layer_vjp_data(data: Any) -> Any:
    """Block estimation data as kfac-jax v0.0.8's ``LayerVjpData`` (``primals``/``tangents``)."""
    if hasattr(data, "primals") and hasattr(data, "tangents"):
        return data
    if not isinstance(data, Mapping):
        raise TypeError(
            f"`estimation_data` must be a dict of layer data or a LayerVjpData (primals/tangents), got {type(data).__name__}."
        )
    return LayerVjpData(
        primals=LayerData(
            inputs=tuple(data.get("inputs", ())), outputs=tuple(data.get("outputs", ())), params=tuple(data.get("params", ()))
        ),
        tangents=LayerData(inputs=(), outputs=tuple(data.get("outputs_tangent", ())), params=tuple(data.get("params_tangent", ()))),
    )


def _prepare_block_args(generation: str, named: dict) -> dict:
    """Converts the estimation data for an override of ``generation``.

    A v0.0.8 override called in the documented order gets ``identity_weight=0.0``
    (the documented call has none; curvax's estimators pass the real one when they have it).
    """
    named = dict(named)
    if generation == _generations.V008:
        named["estimation_data"] = estimation_data_as_layer_vjp_data(named["estimation_data"])
        named.setdefault("identity_weight", 0.0)
    else:
        named["estimation_data"] = estimation_data_as_dict(named["estimation_data"])
    return named


def construct_block(ctor: Callable[..., "CurvatureBlock"], layer_tag_eq: tags.LayerTagEqn, name: str) -> "CurvatureBlock":
    """``ctor(layer_tag_eq, name=name)``, or ``ctor(layer_tag_eq)`` for a kfac-jax v0.0.8-style
    constructor that takes no ``name`` (the block is then named ``layer_tag_eq.name``).

    ``name`` is passed by keyword only to constructors whose signature names it (or takes
    ``**kwargs``), so a v0.0.8 constructor's second positional parameter never receives it.
    """
    try:
        sig = inspect.signature(ctor)
    except (TypeError, ValueError):  # a builtin or C callable: the documented convention
        return ctor(layer_tag_eq, name)
    params = sig.parameters.values()
    if any(p.name == "name" and p.kind is not p.VAR_POSITIONAL for p in params) or any(
        p.kind is p.VAR_KEYWORD for p in params
    ):
        return ctor(layer_tag_eq, name=name)
    return ctor(layer_tag_eq)


class CurvatureBlock(abc.ABC):
    """Abstract curvature block: a moving-average estimate of one layer's curvature.

    Subclasses implement ``_init``, ``update_curvature_matrix_estimate``,
    ``_multiply_matpower_unscaled``, ``_eigenvalues_unscaled``, ``_update_cache``
    and ``_to_dense_unscaled``; the public methods here add validation and the
    scale ``s = fixed_scale() * state_dependent_scale(state)``.

    ``update_curvature_matrix_estimate`` may be written in either kfac-jax
    generation: documented ``(state, estimation_data, ema_old, ema_new, batch_size,
    pmap_axis_name=None)`` with a dict of data, or v0.0.8 ``(state, estimation_data,
    ema_old, ema_new, identity_weight, batch_size)`` with a ``LayerVjpData``. Every
    override is wrapped (``__init_subclass__``) so that calls in either generation
    reach it by keyword, with the data converted to the format it expects
    (``curvax._generations``).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fn = cls.__dict__.get("update_curvature_matrix_estimate")
        if fn is not None and not getattr(fn, "__isabstractmethod__", False) and not hasattr(fn, "__curvax_wrapped__"):
            cls.update_curvature_matrix_estimate = _generations.dispatching(  # type: ignore[method-assign]
                "block", f"{cls.__name__}.update_curvature_matrix_estimate", fn, _prepare_block_args
            )

    @register_state_class
    class State:
        """Persistent block state. ``cache``: data refreshed by ``update_cache`` only."""

        cache: dict[str, Any] | None

        def copy(self) -> Any:
            return _copy_state(self)

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None):
        if name is None:  # kfac-jax v0.0.8 constructs blocks from the equation alone
            name = getattr(layer_tag_eq, "name", "") or type(self).__name__
        if not isinstance(name, str):
            raise TypeError(
                f"{type(self).__name__}: `name` must be a string, got {type(name).__name__} {name!r}; kfac-jax v0.0.8 "
                "blocks take their options after the equation by keyword (e.g. `ScaledIdentity(eqn, scale=2.0)`)."
            )
        for attr in ("primitive", "outputs", "inputs", "params"):
            if not hasattr(layer_tag_eq, attr):
                raise TypeError(
                    f"{type(self).__name__}: `layer_tag_eq` must be a curvax.tags.LayerTagEqn, "
                    f"got {type(layer_tag_eq).__name__}."
                )
        self._layer_tag_eq = layer_tag_eq
        self._name = str(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, parameters_shapes={self.parameters_shapes})"

    # --- description -------------------------------------------------------------

    @property
    def name(self) -> str:
        """The block's name, as given to the constructor."""
        return self._name

    @property
    def layer_tag_eq(self) -> tags.LayerTagEqn:
        """The layer tag equation this block approximates."""
        return self._layer_tag_eq

    @property
    def layer_tag_primitive(self) -> tags.LayerTag:
        """The tag primitive of the layer this block approximates."""
        return self._layer_tag_eq.primitive

    @property
    def parameter_variables(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Shape/dtype descriptions of the block's parameters, in tag order."""
        return tuple(self._layer_tag_eq.params)

    @property
    def outputs_shapes(self) -> tuple[Shape, ...]:
        """Shapes of the tagged layer's outputs."""
        return tuple(tuple(o.shape) for o in self._layer_tag_eq.outputs)

    @property
    def inputs_shapes(self) -> tuple[Shape, ...]:
        """Shapes of the tagged layer's inputs."""
        return tuple(tuple(i.shape) for i in self._layer_tag_eq.inputs)

    @property
    def parameters_shapes(self) -> tuple[Shape, ...]:
        """Shapes of the block's parameters, in tag order."""
        return tuple(tuple(p.shape) for p in self._layer_tag_eq.params)

    @property
    def parameters_canonical_order(self) -> tuple[int, ...]:
        """Positions of the parameters sorted by their index in the model's flat parameters."""
        idx = tuple(getattr(self._layer_tag_eq, "param_indices", ()) or ())
        if len(idx) != self.number_of_parameters:
            return tuple(range(self.number_of_parameters))
        return tuple(int(i) for i in np.argsort(np.asarray(idx), kind="stable"))

    @property
    def layer_tag_extra_params(self) -> dict[str, Any]:
        """The tag's extra parameters (``LayerTagEqn.meta``)."""
        return dict(self._layer_tag_eq.meta or {})

    @property
    def number_of_parameters(self) -> int:
        """Number of parameter arrays of the block (e.g. 2 for a dense layer with bias)."""
        return len(self._layer_tag_eq.params)

    @property
    def parameters_sizes(self) -> tuple[int, ...]:
        """Number of scalars in each parameter array, in tag order."""
        return tuple(int(math.prod(s)) for s in self.parameters_shapes)

    @property
    def dim(self) -> int:
        """Total number of scalar parameters: the side of the block's matrix."""
        return int(sum(self.parameters_sizes))

    # Set by ``set_dtypes`` (the estimator's ``curvature_dtype`` and ``inverse_dtype``); None: default.
    _curvature_dtype: Any = None
    _inverse_dtype: Any = None

    @property
    def dtype(self) -> Any:
        """The dtype of the block's statistics: ``set_dtypes``'s ``curvature_dtype``, by default
        its first parameter's dtype promoted to at least float32 (float32 for bfloat16 and
        float16 parameters; float32 and float64 parameters keep theirs)."""
        if self._curvature_dtype is not None:
            return self._curvature_dtype
        params = self._layer_tag_eq.params
        return utils.at_least_float32(params[0].dtype) if params else jnp.float32

    def _statistics_dtype(self, param_dtype: Any) -> Any:
        """The statistics' dtype for one parameter of ``param_dtype`` (blocks with one array per
        parameter): ``curvature_dtype`` when set, else ``param_dtype`` at least float32."""
        return utils.at_least_float32(param_dtype) if self._curvature_dtype is None else self._curvature_dtype

    @property
    def inverse_dtype(self) -> Any:
        """The dtype ``update_cache`` decomposes the statistics in (eigh, Cholesky, inverses) and
        stores the cache in: ``set_dtypes``'s ``inverse_dtype``, by default ``dtype``."""
        return self.dtype if self._inverse_dtype is None else self._inverse_dtype

    def set_dtypes(self, curvature_dtype: Any = None, inverse_dtype: Any = None) -> None:
        """Chooses the statistics' dtype and the cache's (float32 or float64; None: the default),
        for this block and the blocks it wraps (attributes holding blocks, or lists or tuples of
        them). Call it before ``init``."""
        self._curvature_dtype = utils.check_curvature_dtype(curvature_dtype, "curvature_dtype")
        self._inverse_dtype = utils.check_curvature_dtype(inverse_dtype, "inverse_dtype")
        for member in vars(self).values():  # wrapped blocks: an attribute, or a list or tuple of them
            for block in member if isinstance(member, (list, tuple)) else (member,):
                if isinstance(block, CurvatureBlock):
                    block.set_dtypes(curvature_dtype, inverse_dtype)

    # --- scale ----------------------------------------------------------------------

    def fixed_scale(self) -> Numeric:
        """A constant pre-factor of the curvature (1 unless a subclass says otherwise)."""
        return 1.0

    def state_dependent_scale(self, state: Any) -> Numeric:
        """A pre-factor computed from the current estimate (1 unless overridden)."""
        del state
        return 1.0

    def scale(self, state: Any, use_cache: bool) -> Numeric:
        """The scalar multiplying the unscaled representation.

        Cached values already contain the state dependent scale, so only
        ``fixed_scale`` applies to them.
        """
        fixed = self.fixed_scale()
        if use_cache:
            return fixed
        dep = self.state_dependent_scale(state)
        if _is_one(dep):
            return fixed
        if _is_one(fixed):
            return dep
        return fixed * dep

    # --- validation -----------------------------------------------------------------

    def _check_vector(self, vector: Any, arg_name: str = "vector") -> tuple[Array, ...]:
        if not isinstance(vector, (tuple, list)):
            raise TypeError(
                f"{self._name}: `{arg_name}` must be a tuple of {self.number_of_parameters} arrays shaped like "
                f"the block's parameters {self.parameters_shapes}, got {type(vector).__name__}."
            )
        if len(vector) != self.number_of_parameters:
            raise ValueError(
                f"{self._name}: `{arg_name}` has {len(vector)} arrays, the block has "
                f"{self.number_of_parameters} parameters with shapes {self.parameters_shapes}."
            )
        got = tuple(tuple(np.shape(v)) for v in vector)
        if got != self.parameters_shapes:
            raise ValueError(
                f"{self._name}: `{arg_name}` has shapes {got}, expected the parameters' shapes "
                f"{self.parameters_shapes}."
            )
        return tuple(jnp.asarray(v) for v in vector)

    def _missing_cache(self, what: str, init_arg: str) -> Exception:
        return ValueError(
            f"{self._name} ({type(self).__name__}): {what} is not in the cache. Request it when creating the "
            f"state, e.g. `init(..., {init_arg}=...)`, and call `update_cache` before multiplying with "
            f"`use_cached=True`."
        )

    # --- public API ------------------------------------------------------------------

    def init(
        self,
        rng: Array,
        exact_powers_to_cache: ScalarOrSequence,
        approx_powers_to_cache: ScalarOrSequence,
        cache_eigenvalues: bool,
    ) -> "CurvatureBlock.State":
        """The initial state, with cache entries for the requested powers/eigenvalues."""
        exact = _to_powers(exact_powers_to_cache, "exact_powers_to_cache")
        approx = _to_powers(approx_powers_to_cache, "approx_powers_to_cache")
        state = self._init(rng, exact, approx, bool(cache_eigenvalues))
        if self.inverse_dtype != self.dtype and getattr(state, "cache", None) is not None:
            state.cache = _cast_floating(state.cache, self.inverse_dtype)
        return state

    def multiply_matpower(
        self,
        state: "CurvatureBlock.State",
        vector: Sequence[Array],
        identity_weight: Numeric,
        power: Numeric,
        exact_power: bool,
        use_cached: bool,
    ) -> tuple[Array, ...]:
        """``(C + identity_weight I)^power`` times ``vector`` (exactly or approximately).

        ``power``, ``exact_power`` and ``use_cached`` must be static.
        """
        vec = self._check_vector(vector)
        power = _check_power(power)
        from_cache = bool(use_cached) and self._serves_from_cache(power, bool(exact_power))
        s = self.scale(state, from_cache)
        # Half-precision vectors are multiplied in the statistics' dtype, then cast back.
        wide = tuple(v if jnp.promote_types(v.dtype, self.dtype) == v.dtype else v.astype(self.dtype) for v in vec)
        out = self._multiply_matpower_unscaled(
            state, wide, _div(identity_weight, s), power, bool(exact_power), from_cache
        )
        factor = _pow_scalar(s, power)
        return tuple(_mul(o, factor).astype(v.dtype) for o, v in zip(out, vec))

    def multiply(
        self, state: "CurvatureBlock.State", vector: Sequence[Array], identity_weight: Numeric,
        exact_power: bool, use_cached: bool,
    ) -> tuple[Array, ...]:
        """``(C + identity_weight I) vector``."""
        return self.multiply_matpower(state, vector, identity_weight, 1, exact_power, use_cached)

    def multiply_inverse(
        self, state: "CurvatureBlock.State", vector: Sequence[Array], identity_weight: Numeric,
        exact_power: bool, use_cached: bool,
    ) -> tuple[Array, ...]:
        """``(C + identity_weight I)^-1 vector``."""
        return self.multiply_matpower(state, vector, identity_weight, -1, exact_power, use_cached)

    def eigenvalues(self, state: "CurvatureBlock.State", use_cached: bool) -> Array:
        """The eigenvalues of ``C`` (not damped); from the cache if ``use_cached``."""
        s = self.scale(state, bool(use_cached))
        return _mul(self._eigenvalues_unscaled(state, bool(use_cached)), s)

    def inverse_diagonal(self, state: "CurvatureBlock.State", identity_weight: Numeric) -> tuple[Array, ...]:
        """The diagonal of ``(C + identity_weight I)^-1``, shaped like the block's parameters.

        Exact, from the live statistics: the marginal variances of a Laplace posterior and the
        denominators of Optimal Brain Surgeon saliencies. Kronecker, eigenvalue-corrected and
        diagonal blocks have closed forms; other blocks use their dense matrix, up to
        ``DENSE_INVERSE_DIAGONAL_LIMIT`` parameters.
        """
        s = self.scale(state, False)
        out = self._inverse_diagonal_unscaled(state, _div(identity_weight, s))
        factor = _pow_scalar(s, -1)
        return tuple(_mul(jnp.reshape(o, shape), factor) for o, shape in zip(out, self.parameters_shapes))

    def _inverse_diagonal_unscaled(self, state: Any, identity_weight: Numeric) -> tuple[Array, ...]:
        """Default: the dense unscaled matrix's eigendecomposition (small blocks only)."""
        if self.dim > DENSE_INVERSE_DIAGONAL_LIMIT:
            raise NotImplementedError(
                f"{self._name} ({type(self).__name__}): the diagonal of the inverse needs this block's dense "
                f"{self.dim}x{self.dim} matrix, above the limit of {DENSE_INVERSE_DIAGONAL_LIMIT} parameters."
            )
        return self._dense_inverse_diagonal(self._to_dense_unscaled(state), identity_weight)

    def _dense_inverse_diagonal(self, matrix: Array, identity_weight: Numeric) -> tuple[Array, ...]:
        """``diag((matrix + w I)^-1) = (Q^2) (1 / (s + w))`` from ``matrix = Q diag(s) Q^T``, split per parameter."""
        evals, evecs = linalg.safe_psd_eigh(matrix)
        diag = (evecs**2) @ (1.0 / (evals + identity_weight))
        return tuple(jnp.split(diag, np.cumsum(self.parameters_sizes)[:-1]))

    def update_cache(
        self,
        state: "CurvatureBlock.State",
        identity_weight: Numeric,
        exact_powers: ScalarOrSequence,
        approx_powers: ScalarOrSequence,
        eigenvalues: bool,
    ) -> "CurvatureBlock.State":
        """Recomputes the cached quantities from the current estimate; returns a new state."""
        exact = _to_powers(exact_powers, "exact_powers")
        approx = _to_powers(approx_powers, "approx_powers")
        if self.inverse_dtype == self.dtype:
            return self._update_cache(_copy_state(state), identity_weight, exact, approx, bool(eigenvalues))
        return self._update_cache_in_inverse_dtype(state, identity_weight, exact, approx, bool(eigenvalues))

    def _update_cache_in_inverse_dtype(
        self, state: Any, identity_weight: Numeric, exact: tuple, approx: tuple, eigenvalues: bool
    ) -> Any:
        """``_update_cache`` on the statistics cast to ``inverse_dtype``: the decompositions run in
        it and the cache is stored in it; the statistics come back in their own dtypes."""
        work = _copy_state(state)
        stats = [f.name for f in dataclasses.fields(work) if f.name != "cache"]
        for name in stats:
            setattr(work, name, _cast_floating(getattr(work, name), self.inverse_dtype))
        new = self._update_cache(work, identity_weight, exact, approx, eigenvalues)
        for name in stats:
            setattr(new, name, jax.tree_util.tree_map(lambda n, o: n.astype(o.dtype), getattr(new, name), getattr(state, name)))
        if new.cache is not None:
            new.cache = _cast_floating(new.cache, self.inverse_dtype)
        return new

    def to_dense_matrix(self, state: "CurvatureBlock.State") -> Array:
        """The ``dim x dim`` matrix ``C`` in parameter order (each parameter flattened, C order)."""
        return _mul(self._to_dense_unscaled(state), self.scale(state, False))

    def norm(self, state: "CurvatureBlock.State", norm_type: str) -> Array:
        """The block's norm ``norm_type`` (a name of ``curvax.linalg.NORM_TYPES``), scale included.

        kfac-jax v0.0.8's definition, from the current statistics: the product of the norms
        of the block's factors (a Kronecker block's ``A`` and ``G``, each parameter's diagonal
        of a diagonal block, the matrix of a full block, ``ones(dim)`` for the scaled
        identity) times ``scale``. The optimizer's ``norm_to_scale_identity_weight_per_block``
        multiplies the block's damping by it.
        """
        kind = linalg.norm_type_name(norm_type, "norm_type")
        return _mul(jnp.asarray(self._norm_unscaled(state, kind)), self.scale(state, False))

    def sync(self, state: "CurvatureBlock.State", pmap_axis_name: str | None) -> "CurvatureBlock.State":
        """Averages the moving-average values (not the cache) across devices."""
        state = _copy_state(state)
        if pmap_axis_name is None:
            return state
        for f in dataclasses.fields(state):
            if f.name == "cache":
                continue
            for leaf in jax.tree_util.tree_leaves(
                getattr(state, f.name), is_leaf=lambda x: isinstance(x, WeightedMovingAverage)
            ):
                if isinstance(leaf, WeightedMovingAverage):
                    leaf.sync(pmap_axis_name)
        return state

    @abc.abstractmethod
    def update_curvature_matrix_estimate(
        self,
        state: "CurvatureBlock.State",
        estimation_data: Mapping[str, Sequence[Array]],
        ema_old: Numeric,
        ema_new: Numeric,
        batch_size: Numeric,
        pmap_axis_name: str | None = None,
    ) -> "CurvatureBlock.State":
        """Folds the statistics of one batch into the moving-average estimate."""

    # --- hooks for subclasses -----------------------------------------------------

    @abc.abstractmethod
    def _init(
        self, rng: Array, exact_powers_to_cache: tuple[Numeric, ...],
        approx_powers_to_cache: tuple[Numeric, ...], cache_eigenvalues: bool,
    ) -> "CurvatureBlock.State":
        """The initial state; powers arrive normalised to tuples."""

    def _serves_from_cache(self, power: Numeric, exact_power: bool) -> bool:
        """Whether ``use_cached=True`` actually reads the cache for this product."""
        del power, exact_power
        return True

    @abc.abstractmethod
    def _multiply_matpower_unscaled(
        self, state: Any, vector: tuple[Array, ...], identity_weight: Numeric, power: Numeric,
        exact_power: bool, use_cached: bool,
    ) -> tuple[Array, ...]:
        """``(C_unscaled + identity_weight I)^power vector``."""

    @abc.abstractmethod
    def _eigenvalues_unscaled(self, state: Any, use_cached: bool) -> Array:
        """Eigenvalues of ``C_unscaled``."""

    @abc.abstractmethod
    def _update_cache(
        self, state: Any, identity_weight: Numeric, exact_powers: tuple[Numeric, ...],
        approx_powers: tuple[Numeric, ...], eigenvalues: bool,
    ) -> Any:
        """Refreshes ``state.cache`` (``state`` is already a private copy)."""

    @abc.abstractmethod
    def _to_dense_unscaled(self, state: Any) -> Array:
        """``C_unscaled`` as a dense matrix in parameter order."""

    def _norm_unscaled(self, state: Any, norm_type: str) -> Array:
        """Default: the norm of the dense unscaled matrix (blocks of at most
        ``DENSE_INVERSE_DIAGONAL_LIMIT`` parameters); factored blocks override it."""
        if self.dim > DENSE_INVERSE_DIAGONAL_LIMIT:
            raise NotImplementedError(
                f"{self._name} ({type(self).__name__}): the {norm_type!r} norm needs this block's dense "
                f"{self.dim}x{self.dim} matrix, above the limit of {DENSE_INVERSE_DIAGONAL_LIMIT} parameters."
            )
        return linalg.psd_matrix_norm(self._to_dense_unscaled(state), norm_type)


# ----------------------------------------------------------------------------------
# Scaled identity
# ----------------------------------------------------------------------------------


class ScaledIdentity(CurvatureBlock):
    """``C = scale * I``: no statistics, useful to exclude a layer from preconditioning."""

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None, scale: Numeric = 1.0):
        super().__init__(layer_tag_eq, name)
        self._scale = scale

    def fixed_scale(self) -> Numeric:
        return self._scale

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues
        return CurvatureBlock.State(cache=None)

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del estimation_data, ema_old, ema_new, batch_size, pmap_axis_name
        return _copy_state(state)

    def _multiply_matpower_unscaled(self, state, vector, identity_weight, power, exact_power, use_cached):
        del state, exact_power, use_cached
        factor = linalg._pow(jnp.asarray(1 + identity_weight, self.dtype), power)
        return tuple(v * factor for v in vector)

    def _eigenvalues_unscaled(self, state, use_cached):
        del state, use_cached
        return jnp.ones([self.dim], self.dtype)

    def _inverse_diagonal_unscaled(self, state, identity_weight):
        del state
        return tuple(jnp.full(size, 1.0 / (1.0 + identity_weight), self.dtype) for size in self.parameters_sizes)

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        del identity_weight, exact_powers, approx_powers, eigenvalues
        return state

    def _to_dense_unscaled(self, state):
        del state
        return jnp.eye(self.dim, dtype=self.dtype)

    def _norm_unscaled(self, state, norm_type):
        del state
        return linalg.psd_matrix_norm(jnp.ones([self.dim], self.dtype), norm_type)


# ----------------------------------------------------------------------------------
# Diagonal family
# ----------------------------------------------------------------------------------


class Diagonal(CurvatureBlock, abc.ABC):
    """Keeps only the diagonal of the curvature, one array per parameter.

    Every power is exact and elementwise: ``(d + w)^p * v``. The cache, when
    requested, is a snapshot ``cache["diagonals"]`` (tuple shaped like the
    parameters, state dependent scale included); the damping is applied at call
    time.
    """

    @register_state_class
    class State(CurvatureBlock.State):
        """``diagonal_factors``: one ``WeightedMovingAverage`` per parameter."""

        diagonal_factors: tuple

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del rng
        dtypes = [self._statistics_dtype(p.dtype) for p in self.parameter_variables]
        factors = tuple(WeightedMovingAverage.zeros(p.shape, d) for p, d in zip(self.parameter_variables, dtypes))
        cache = None
        if exact_powers_to_cache or approx_powers_to_cache or cache_eigenvalues:
            cache = {"diagonals": tuple(jnp.zeros(p.shape, d) for p, d in zip(self.parameter_variables, dtypes))}
        return Diagonal.State(cache=cache, diagonal_factors=factors)

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del pmap_axis_name
        diagonals = self._diagonals_from_data(estimation_data, batch_size)
        state = _copy_state(state)
        for factor, d in zip(state.diagonal_factors, diagonals):
            factor.update(jnp.asarray(d).astype(factor.value.dtype), ema_old, ema_new)
        return state

    @abc.abstractmethod
    def _diagonals_from_data(self, estimation_data: Mapping[str, Sequence[Array]], batch_size: Numeric) -> tuple:
        """This batch's estimate of the diagonal, one array per parameter."""

    def _diagonals(self, state: Any, use_cached: bool) -> tuple[Array, ...]:
        if use_cached:
            if not state.cache or "diagonals" not in state.cache:
                raise self._missing_cache("the diagonal snapshot", "exact_powers_to_cache")
            return tuple(state.cache["diagonals"])
        return tuple(f.value for f in state.diagonal_factors)

    def _serves_from_cache(self, power, exact_power):
        del exact_power
        return power != 1

    def _multiply_matpower_unscaled(self, state, vector, identity_weight, power, exact_power, use_cached):
        del exact_power
        return tuple(
            v * linalg._pow(d + identity_weight, power) for v, d in zip(vector, self._diagonals(state, use_cached))
        )

    def _eigenvalues_unscaled(self, state, use_cached):
        return jnp.concatenate([jnp.ravel(d) for d in self._diagonals(state, use_cached)])

    def _inverse_diagonal_unscaled(self, state, identity_weight):
        return tuple(1.0 / (d + identity_weight) for d in self._diagonals(state, False))

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        del identity_weight
        if state.cache is None and not (exact_powers or approx_powers or eigenvalues):
            return state
        s = self.state_dependent_scale(state)
        cache = dict(state.cache or {})
        cache["diagonals"] = tuple(_mul(f.value, s) for f in state.diagonal_factors)
        state.cache = cache
        return state

    def _to_dense_unscaled(self, state):
        return jnp.diag(self._eigenvalues_unscaled(state, False))

    def _norm_unscaled(self, state, norm_type):
        # kfac-jax's definition: the product over the parameters of their diagonal's norm.
        return math.prod(linalg.psd_matrix_norm(jnp.ravel(d), norm_type) for d in self._diagonals(state, False))


class NaiveDiagonal(Diagonal):
    """``d <- g^2 / B`` with ``g`` the batch-summed (sampled-loss) parameter gradient.

    This is unbiased for the Fisher diagonal when the per-example gradients of
    the sampled loss are independent and zero-mean; it needs nothing but the
    parameter gradients, so it works for any parameter (``generic`` tags).
    """

    def _diagonals_from_data(self, estimation_data, batch_size):
        tangents = tuple(estimation_data["params_tangent"])
        if len(tangents) != self.number_of_parameters:
            raise ValueError(
                f"{self._name}: expected {self.number_of_parameters} parameter tangents, got {len(tangents)}."
            )
        return tuple(jnp.square(t) / batch_size for t in tangents)


# ----------------------------------------------------------------------------------
# Dense-layer helpers
# ----------------------------------------------------------------------------------


def kernel_axes(meta: Mapping[str, Any] | None, w_shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The (input, output) axes of a dense kernel, or ``None`` for a plain ``(-1, last)`` reshape.

    ``meta["kernel_layout"]`` is ``"io"`` (``(d_in, d_out)``), ``"oi"`` or
    ``"general"`` with ``kernel_in_axes``/``kernel_out_axes`` (multi-axis kernels
    such as ``(d, heads, head_dim)``); the kernel is then the matrix
    ``transpose(w, in_axes + out_axes).reshape(prod(in), prod(out))``.
    """
    meta = meta or {}
    layout = meta.get("kernel_layout", "io")
    if layout == "general":
        return tuple(meta["kernel_in_axes"]), tuple(meta["kernel_out_axes"])
    if layout == "oi" and len(w_shape) == 2:
        return (1,), (0,)
    return None


def kernel_to_matrix(w: Any, axes: tuple[tuple[int, ...], tuple[int, ...]] | None) -> Any:
    """A kernel as its ``(inputs, outputs)`` matrix (works for numpy and jax arrays)."""
    if axes is None:
        return w.reshape(-1, w.shape[-1])
    ins, outs = axes
    d_in = int(np.prod([w.shape[i] for i in ins], dtype=int))
    return w.transpose(ins + outs).reshape(d_in, -1)


def matrix_to_kernel(m: Any, axes: tuple[tuple[int, ...], tuple[int, ...]] | None, w_shape: Sequence[int]) -> Any:
    """Inverse of ``kernel_to_matrix`` (leading batch axes of ``m`` are kept)."""
    lead = m.shape[:-2]
    if axes is None:
        return m.reshape(*lead, *w_shape)
    ins, outs = axes
    order = ins + outs
    permuted = m.reshape(*lead, *(w_shape[i] for i in order))
    inverse = np.argsort(order)
    return permuted.transpose(*range(len(lead)), *(len(lead) + int(i) for i in inverse))


class _DenseLayerMixin:
    """Shape bookkeeping for ``y = x @ W (+ b)`` with ``W`` stored "io" or "oi"."""

    def _check_dense(self) -> None:
        shapes = self.parameters_shapes  # type: ignore[attr-defined]
        name = self.name  # type: ignore[attr-defined]
        layout = self.kernel_layout
        if layout not in ("io", "oi", "general"):
            raise ValueError(f"{name}: meta['kernel_layout'] must be 'io', 'oi' or 'general', got {layout!r}.")
        if len(shapes) not in (1, 2) or (len(shapes[0]) != 2 and layout != "general"):
            raise ValueError(f"{name}: a dense layer needs a 2-D weight and an optional bias, got shapes {shapes}.")
        if layout == "general":
            ins, outs = self._kernel_axes  # type: ignore[misc]
            if sorted(ins + outs) != list(range(len(shapes[0]))) or not ins or not outs:
                raise ValueError(
                    f"{name}: meta kernel_in_axes {ins} and kernel_out_axes {outs} must split the axes of the "
                    f"weight of shape {shapes[0]}."
                )
        if len(shapes) == 2 and math.prod(shapes[1]) != self.dense_out_dim:
            raise ValueError(f"{name}: the bias must have {self.dense_out_dim} entries, got shape {shapes[1]}.")

    @property
    def kernel_layout(self) -> str:
        return (self._layer_tag_eq.meta or {}).get("kernel_layout", "io")  # type: ignore[attr-defined]

    @property
    def _kernel_axes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        w = self.parameters_shapes[0]  # type: ignore[attr-defined]
        return kernel_axes(self._layer_tag_eq.meta, w) or ((0,), (1,))  # type: ignore[attr-defined]

    @property
    def dense_in_dim(self) -> int:
        w = self.parameters_shapes[0]  # type: ignore[attr-defined]
        return math.prod(w[i] for i in self._kernel_axes[0])

    @property
    def dense_out_dim(self) -> int:
        w = self.parameters_shapes[0]  # type: ignore[attr-defined]
        return math.prod(w[i] for i in self._kernel_axes[1])

    def _from_matrix(self, m: Array) -> Array:
        """An ``(..., d_in, d_out)`` array as ``(..., *weight_shape)``."""
        w = self.parameters_shapes[0]  # type: ignore[attr-defined]
        return matrix_to_kernel(m, kernel_axes(self._layer_tag_eq.meta, w), w)  # type: ignore[attr-defined]

    def _bias_like(self, v: Array) -> Array:
        """An ``(..., d_out)`` array as ``(..., *bias_shape)``."""
        return v.reshape(*v.shape[:-1], *self.parameters_shapes[1])  # type: ignore[attr-defined]

    def _dense_data(self, estimation_data: Mapping[str, Sequence[Array]]) -> tuple[Array, Array]:
        name = self.name  # type: ignore[attr-defined]
        xs = tuple(estimation_data["inputs"])
        dys = tuple(estimation_data["outputs_tangent"])
        if len(xs) != 1 or len(dys) != 1:
            raise ValueError(f"{name}: a dense block needs one input and one output tangent, got {len(xs)} and {len(dys)}.")
        return xs[0], dys[0]

    def _augmented_per_example(self, estimation_data: Mapping[str, Sequence[Array]], dtype: Any) -> tuple[Array, Array]:
        """Inputs ``(B, T, d_in [+1])`` (a ones column for the bias) and output tangents ``(B, T, d_out)``."""
        x, dy = self._dense_data(estimation_data)
        x3 = _per_example(x, self.dense_in_dim, "inputs[0]").astype(dtype)
        dy3 = _per_example(dy, self.dense_out_dim, "outputs_tangent[0]").astype(dtype)
        if x3.shape[:2] != dy3.shape[:2]:
            raise ValueError(f"{self.name}: inputs {x.shape} and output tangents {dy.shape} disagree on leading axes.")  # type: ignore[attr-defined]
        if len(self.parameters_shapes) == 2:  # type: ignore[attr-defined]
            x3 = jnp.concatenate([x3, jnp.ones(x3.shape[:2] + (1,), dtype)], axis=-1)
        return x3, dy3

    def _per_example_grads(self, x: Array, dy: Array) -> tuple[Array, ...]:
        """Per-example parameter gradients, shaped ``(B, *param_shape)``, summed over extra axes."""
        x3 = _per_example(x, self.dense_in_dim, "inputs[0]")
        dy3 = _per_example(dy, self.dense_out_dim, "outputs_tangent[0]")
        if x3.shape[:2] != dy3.shape[:2]:
            raise ValueError(f"{self.name}: inputs {x.shape} and output tangents {dy.shape} disagree on leading axes.")  # type: ignore[attr-defined]
        grads = (self._from_matrix(jnp.einsum("bti,bto->bio", x3, dy3)),)
        if len(self.parameters_shapes) == 2:  # type: ignore[attr-defined]
            grads += (self._bias_like(jnp.sum(dy3, axis=1)),)
        return grads


class _DenseKroneckerMixin(_DenseLayerMixin):
    """A dense layer's Kronecker factors: ``A`` over the inputs (and the bias), ``G`` over the outputs."""

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None):
        super().__init__(layer_tag_eq, name)  # type: ignore[call-arg]
        self._check_dense()

    def input_size(self) -> int:
        return self.dense_in_dim + int(self.has_bias)  # type: ignore[attr-defined]

    def output_size(self) -> int:
        return self.dense_out_dim


class DenseDiagonal(_DenseLayerMixin, Diagonal):
    """Diagonal of the per-example Fisher of a dense layer: ``mean_n g_n^2``.

    ``g_n`` is example n's weight gradient (summed over any extra positions) and
    bias gradient.
    """

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None):
        super().__init__(layer_tag_eq, name)
        self._check_dense()

    def _diagonals_from_data(self, estimation_data, batch_size):
        x, dy = self._dense_data(estimation_data)
        if x.ndim == 2 and dy.ndim == 2:
            out = (self._from_matrix((jnp.square(x).T @ jnp.square(dy)) / batch_size),)
            if len(self.parameters_shapes) == 2:
                out += (self._bias_like(jnp.sum(jnp.square(dy), axis=0) / batch_size),)
            return out
        return tuple(jnp.sum(jnp.square(g), axis=0) / batch_size for g in self._per_example_grads(x, dy))


# ----------------------------------------------------------------------------------
# Full family
# ----------------------------------------------------------------------------------

_DEFAULT_EIGEN_DECOMPOSITION_THRESHOLD = 5


def set_default_eigen_decomposition_threshold(value: int) -> None:
    """Sets how many approximate powers ``Full`` caches one by one before switching to eigh."""
    global _DEFAULT_EIGEN_DECOMPOSITION_THRESHOLD
    _DEFAULT_EIGEN_DECOMPOSITION_THRESHOLD = utils.check_int(value, "eigen_decomposition_threshold", 0)


def get_default_eigen_decomposition_threshold() -> int:
    """The default ``eigen_decomposition_threshold`` of ``Full`` blocks (initially 5)."""
    return _DEFAULT_EIGEN_DECOMPOSITION_THRESHOLD


class Full(CurvatureBlock, abc.ABC):
    """The full ``dim x dim`` curvature of the block (parameter order).

    Exact and approximate products are the same matrix function. Cache layout:
    ``"eigenvalues"`` (dim,) and ``"eigen_vectors"`` (dim, dim) for exact powers
    (and for approximate ones when more than ``eigen_decomposition_threshold``
    are requested), served with the call-time damping; otherwise one entry per
    approximate power ``cache[str(p)] = {"matrix": (M + w I)^p, "identity_weight": w}``
    computed with the damping given to ``update_cache``.
    """

    @register_state_class
    class State(CurvatureBlock.State):
        """``matrix``: ``WeightedMovingAverage`` of the ``dim x dim`` estimate."""

        matrix: WeightedMovingAverage

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None, eigen_decomposition_threshold: int | None = None):
        super().__init__(layer_tag_eq, name)
        if eigen_decomposition_threshold is None:
            eigen_decomposition_threshold = get_default_eigen_decomposition_threshold()
        self._eigen_decomposition_threshold = int(eigen_decomposition_threshold)

    @property
    def eigen_decomposition_threshold(self) -> int:
        """Number of cached powers above which one eigendecomposition is used instead of computing each power."""
        return self._eigen_decomposition_threshold

    def parameters_list_to_single_vector(self, parameters_shaped_list: Sequence[Array]) -> Array:
        """Flattens each parameter-shaped array (C order) and concatenates them."""
        vec = self._check_vector(parameters_shaped_list, "parameters_shaped_list")
        return jnp.concatenate([jnp.ravel(v) for v in vec])

    def single_vector_to_parameters_list(self, vector: Array) -> tuple[Array, ...]:
        """Inverse of ``parameters_list_to_single_vector``."""
        if np.shape(vector) != (self.dim,):
            raise ValueError(f"{self._name}: expected a vector of shape ({self.dim},), got {np.shape(vector)}.")
        splits = np.cumsum(self.parameters_sizes)[:-1]
        return tuple(p.reshape(s) for p, s in zip(jnp.split(vector, splits), self.parameters_shapes))

    def _uses_eigen_for_approx(self, approx: tuple) -> bool:
        return len(approx) > self._eigen_decomposition_threshold

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del rng
        d, dtype = self.dim, self.dtype
        cache: dict[str, Any] = {}
        eigen = bool(exact_powers_to_cache) or self._uses_eigen_for_approx(approx_powers_to_cache)
        if eigen or cache_eigenvalues:
            cache["eigenvalues"] = jnp.zeros([d], dtype)
        if eigen:
            cache["eigen_vectors"] = jnp.eye(d, dtype=dtype)
        if not self._uses_eigen_for_approx(approx_powers_to_cache):
            for p in approx_powers_to_cache:
                cache[power_key(p)] = {"matrix": jnp.eye(d, dtype=dtype), "identity_weight": jnp.zeros([], dtype)}
        return Full.State(cache=cache or None, matrix=WeightedMovingAverage.zeros((d, d), dtype))

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del pmap_axis_name
        m = self._matrix_from_data(estimation_data, batch_size)
        if m.shape != (self.dim, self.dim):
            raise ValueError(f"{self._name}: the estimate has shape {m.shape}, expected {(self.dim, self.dim)}.")
        state = _copy_state(state)
        state.matrix.update(m.astype(state.matrix.value.dtype), ema_old, ema_new)
        return state

    @abc.abstractmethod
    def _matrix_from_data(self, estimation_data: Mapping[str, Sequence[Array]], batch_size: Numeric) -> Array:
        """This batch's ``dim x dim`` estimate."""

    def _serves_from_cache(self, power, exact_power):
        del exact_power
        return power != 1

    def _multiply_matpower_unscaled(self, state, vector, identity_weight, power, exact_power, use_cached):
        v = jnp.concatenate([jnp.ravel(x) for x in vector])
        if use_cached:
            cache = state.cache or {}
            key = power_key(power)
            if not exact_power and key in cache:
                out = cache[key]["matrix"] @ v
            elif "eigen_vectors" in cache:
                out = linalg.eigen_mul(cache["eigen_vectors"], cache["eigenvalues"], v, identity_weight, power)
            else:
                raise self._missing_cache(
                    f"power {power} ({'exact' if exact_power else 'approximate'})",
                    "exact_powers_to_cache" if exact_power else "approx_powers_to_cache",
                )
        else:
            m = linalg.symmetrize(state.matrix.value)
            if power == 1:
                out = m @ v + identity_weight * v
            elif power == -1:
                out = linalg.psd_solve(m + identity_weight * jnp.eye(self.dim, dtype=m.dtype), v)
            else:
                s, q = linalg.safe_psd_eigh(m)
                out = linalg.eigen_mul(q, s, v, identity_weight, power)
        return self.single_vector_to_parameters_list(out)

    def _eigenvalues_unscaled(self, state, use_cached):
        if use_cached:
            if not state.cache or "eigenvalues" not in state.cache:
                raise self._missing_cache("the eigenvalues", "cache_eigenvalues")
            return state.cache["eigenvalues"]
        return linalg.safe_eigvalsh(state.matrix.value)

    def _inverse_diagonal_unscaled(self, state, identity_weight):
        return self._dense_inverse_diagonal(self._to_dense_unscaled(state), identity_weight)  # held anyway: no limit

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        cache = dict(state.cache or {})
        m = _mul(linalg.symmetrize(state.matrix.value), self.state_dependent_scale(state))
        eigen = bool(exact_powers) or "eigen_vectors" in cache or self._uses_eigen_for_approx(approx_powers)
        if eigen:
            s, q = linalg.safe_psd_eigh(m)
            cache["eigenvalues"], cache["eigen_vectors"] = s, q
        elif eigenvalues or "eigenvalues" in cache:
            cache["eigenvalues"] = linalg.safe_eigvalsh(m)
        if not self._uses_eigen_for_approx(approx_powers):
            w = _div(identity_weight, self.fixed_scale())
            md = m + w * jnp.eye(self.dim, dtype=m.dtype)
            for p in approx_powers:
                if p == -1:
                    mat = linalg.psd_inv(md)
                elif p == 1:
                    mat = md
                else:
                    mat = linalg.psd_matrix_power(md, p)
                cache[power_key(p)] = {
                    "matrix": mat.astype(m.dtype),
                    "identity_weight": jnp.asarray(identity_weight, m.dtype),
                }
        state.cache = cache or None
        return state

    def _to_dense_unscaled(self, state):
        return linalg.symmetrize(state.matrix.value)

    def _norm_unscaled(self, state, norm_type):
        return linalg.psd_matrix_norm(linalg.symmetrize(state.matrix.value), norm_type)


class NaiveFull(Full):
    """``M <- g g^T / B`` with ``g`` the flattened batch-summed (sampled-loss) gradient."""

    def _matrix_from_data(self, estimation_data, batch_size):
        tangents = tuple(estimation_data["params_tangent"])
        if len(tangents) != self.number_of_parameters:
            raise ValueError(
                f"{self._name}: expected {self.number_of_parameters} parameter tangents, got {len(tangents)}."
            )
        g = jnp.concatenate([jnp.ravel(t) for t in tangents])
        return jnp.outer(g, g) / batch_size


class DenseFull(_DenseLayerMixin, Full):
    """Per-example Fisher of a dense layer: ``sum_n g_n g_n^T / B``.

    ``g_n`` is example n's flattened (weight, bias) gradient in parameter order.
    """

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None, eigen_decomposition_threshold: int | None = None):
        super().__init__(layer_tag_eq, name, eigen_decomposition_threshold)
        self._check_dense()

    def _matrix_from_data(self, estimation_data, batch_size):
        x, dy = self._dense_data(estimation_data)
        grads = self._per_example_grads(x, dy)
        t = jnp.concatenate([g.reshape(g.shape[0], -1) for g in grads], axis=1)
        return (t.T @ t) / batch_size


# ----------------------------------------------------------------------------------
# Kronecker-factored family
# ----------------------------------------------------------------------------------


def bias_augmented(a: Array, mean: Array) -> Array:
    """``[[A, m], [m^T, 1]]``: the second moment of ``[x; 1]`` from that of ``x`` (``A``) and its mean ``m``.

    How a bias enters a Kronecker input factor; assembled from pieces, so no copy
    of the inputs with a ones column is made.
    """
    return jnp.block([[a, mean[:, None]], [mean[None, :], jnp.ones((1, 1), a.dtype)]])


class _FactorPairBlock(CurvatureBlock, abc.ABC):
    """A block kept as an inputs factor ``A`` and an outputs factor ``G`` (moving averages).

    What ``TwoKroneckerFactored`` and the embedding block (``A`` diagonal) share:
    how a batch's factors enter the state, which products the cache serves (exact
    powers other than 1 and the approximate inverse), the cached eigenvalues and
    the factors scaled for the cache. Subclasses define ``_factors`` and ``_factor_eigenvalues``.
    """

    @abc.abstractmethod
    def _factors(self, state: Any) -> tuple[Array, Array]:
        """``A`` and ``G`` as read from the state's moving averages."""

    @staticmethod
    def _with_factors_updated(state: Any, a: Array, g: Array, ema_old: Numeric, ema_new: Numeric) -> Any:
        """A copy of ``state`` whose ``inputs_factor`` and ``outputs_factor`` averages took in ``a`` and ``g``."""
        state = _copy_state(state)
        state.inputs_factor.update(a, ema_old, ema_new)
        state.outputs_factor.update(g, ema_old, ema_new)
        return state

    def _check_approx_cacheable(self, power: Numeric) -> None:
        if power != -1:
            raise NotImplementedError(
                f"{self._name} ({type(self).__name__}): approximate power {power} cannot be cached; only the "
                "approximate inverse (power -1) can. Use exact powers for other powers."
            )

    def _serves_from_cache(self, power, exact_power):
        return power != 1 if exact_power else power == -1

    @abc.abstractmethod
    def _factor_eigenvalues(self, a: Array, g: Array) -> tuple[Array, Array]:
        """The eigenvalues of ``A`` and ``G`` (as ``_factors`` returns them)."""

    def _eigenvalues_unscaled(self, state, use_cached):
        if use_cached:
            cache = state.cache or {}
            if "inputs_factor_eigenvalues" not in cache:
                raise self._missing_cache("the eigenvalues", "cache_eigenvalues")
            sa, sg = cache["inputs_factor_eigenvalues"], cache["outputs_factor_eigenvalues"]
        else:
            sa, sg = self._factor_eigenvalues(*self._factors(state))
        return jnp.outer(sa, sg).ravel()

    def _norm_unscaled(self, state, norm_type):
        # kfac-jax's definition: the product of the factors' norms (the Kronecker product's
        # norm for every name but the two medians).
        a, g = self._factors(state)
        return linalg.psd_matrix_norm(a, norm_type) * linalg.psd_matrix_norm(g, norm_type)

    def _cache_and_scaled_factors(self, state: Any, approx_powers: Sequence[Numeric]) -> tuple[dict, Array, Array]:
        """Where ``_update_cache`` starts: a copy of the cache, and ``A`` and ``G`` each times
        ``sqrt(state_dependent_scale)`` (the cache holds the scaled matrix's pieces)."""
        for p in approx_powers:
            self._check_approx_cacheable(p)
        a, g = self._factors(state)
        s = self.state_dependent_scale(state)
        if not _is_one(s):
            root = jnp.sqrt(s)
            a, g = a * root, g * root
        return dict(state.cache or {}), a, g


class TwoKroneckerFactored(_FactorPairBlock, abc.ABC):
    """``C ~= A (x) G`` for a layer with a weight and an optional bias.

    The parameters are arranged as one matrix ``V = [W; b^T]`` of shape
    ``(input_size(), output_size())`` (weight flattened to ``(-1, d_out)``, or
    transposed first when ``meta["kernel_layout"] == "oi"``); then
    ``(A (x) G) vec(V) = A V G``.

    Cache layout (all optional, allocated by ``init``):
    ``"inputs_factor_eigenvalues"``, ``"outputs_factor_eigenvalues"`` (exact powers or
    eigenvalues), ``"inputs_factor_eigen_vectors"``, ``"outputs_factor_eigen_vectors"``
    (exact powers; served with the call-time damping), and ``"-1"`` =
    ``{"inputs_factor": A_d^-1, "outputs_factor": G_d^-1, "identity_weight": w}`` for
    the approximate (pi-damped) inverse built with the damping ``w`` given to
    ``update_cache``.
    """

    @register_state_class
    class State(CurvatureBlock.State):
        """``inputs_factor`` (A) and ``outputs_factor`` (G): ``WeightedMovingAverage`` objects."""

        inputs_factor: WeightedMovingAverage
        outputs_factor: WeightedMovingAverage

        @property
        def factors(self) -> tuple[WeightedMovingAverage, WeightedMovingAverage]:
            return (self.inputs_factor, self.outputs_factor)

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None):
        super().__init__(layer_tag_eq, name)
        if self.number_of_parameters not in (1, 2):
            raise ValueError(
                f"{self.name}: a Kronecker-factored block needs a weight and an optional bias, got "
                f"{self.number_of_parameters} parameters with shapes {self.parameters_shapes}."
            )

    @property
    def has_bias(self) -> bool:
        """Whether the layer has a bias (a second parameter)."""
        return self.number_of_parameters == 2

    @abc.abstractmethod
    def input_size(self) -> int:
        """Side of the inputs factor ``A`` (rows of ``V``, bias row included)."""

    @abc.abstractmethod
    def output_size(self) -> int:
        """Side of the outputs factor ``G`` (columns of ``V``)."""

    # --- parameters <-> V -------------------------------------------------------------

    def _params_to_array(self, params: Sequence[Any], xp: Any) -> Any:
        w = kernel_to_matrix(params[0], kernel_axes(self._layer_tag_eq.meta, params[0].shape))
        if self.has_bias:
            w = xp.concatenate([w, params[1].reshape(1, -1)], axis=0)
        return w

    def parameters_shaped_list_to_array(self, parameters_shaped_list: Sequence[Array]) -> Array:
        """The parameters (or a vector shaped like them) as the matrix ``V``."""
        return self._params_to_array(self._check_vector(parameters_shaped_list, "parameters_shaped_list"), jnp)

    def array_to_parameters_shaped_list(self, array: Array) -> tuple[Array, ...]:
        """Inverse of ``parameters_shaped_list_to_array``."""
        shapes = self.parameters_shapes
        w_rows = array[:-1] if self.has_bias else array
        out = (matrix_to_kernel(w_rows, kernel_axes(self._layer_tag_eq.meta, shapes[0]), shapes[0]),)
        if self.has_bias:
            out += (array[-1].reshape(shapes[1]),)
        return out

    def _array_shape(self) -> tuple[int, int]:
        dummies = [np.zeros(s) for s in self.parameters_shapes]
        return tuple(self._params_to_array(dummies, np).shape)  # type: ignore[return-value]

    def _check_sizes(self) -> None:
        want = (int(self.input_size()), int(self.output_size()))
        got = self._array_shape()
        if got != want:
            raise ValueError(
                f"{self._name}: the parameters {self.parameters_shapes} arrange to a matrix of shape {got}, "
                f"but input_size() x output_size() is {want}."
            )

    # --- state ------------------------------------------------------------------------

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del rng
        self._check_sizes()
        di, do, dtype = int(self.input_size()), int(self.output_size()), self.dtype
        cache: dict[str, Any] = {}
        if exact_powers_to_cache or cache_eigenvalues:
            cache["inputs_factor_eigenvalues"] = jnp.zeros([di], dtype)
            cache["outputs_factor_eigenvalues"] = jnp.zeros([do], dtype)
        if exact_powers_to_cache:
            cache["inputs_factor_eigen_vectors"] = jnp.eye(di, dtype=dtype)
            cache["outputs_factor_eigen_vectors"] = jnp.eye(do, dtype=dtype)
        for p in approx_powers_to_cache:
            self._check_approx_cacheable(p)
            cache["-1"] = {
                "inputs_factor": jnp.eye(di, dtype=dtype),
                "outputs_factor": jnp.eye(do, dtype=dtype),
                "identity_weight": jnp.zeros([], dtype),
            }
        return TwoKroneckerFactored.State(
            cache=cache or None,
            inputs_factor=WeightedMovingAverage.zeros((di, di), dtype),
            outputs_factor=WeightedMovingAverage.zeros((do, do), dtype),
        )

    def _factors(self, state: Any) -> tuple[Array, Array]:
        return linalg.symmetrize(state.inputs_factor.value), linalg.symmetrize(state.outputs_factor.value)

    def _input_moment(self, rows: Array) -> Array:
        """``A = (1/n) sum_i [r_i; 1][r_i; 1]^T`` over the ``n`` rows ``r_i`` of ``rows`` (the 1 only with a bias)."""
        n = rows.shape[0]
        a = linalg.gram(rows) / n
        return bias_augmented(a, jnp.sum(rows, axis=0) / n) if self.has_bias else a

    def _multiply_matpower_unscaled(self, state, vector, identity_weight, power, exact_power, use_cached):
        v = self._params_to_array(vector, jnp)
        cache = state.cache or {}
        if exact_power:
            if power == 1:
                a, g = self._factors(state)
                out = linalg.kronecker_product_mul(a, g, v) + identity_weight * v
            elif use_cached:
                if "inputs_factor_eigen_vectors" not in cache:
                    raise self._missing_cache(f"exact power {power}", "exact_powers_to_cache")
                out = linalg.kronecker_eigen_mul(
                    cache["inputs_factor_eigen_vectors"], cache["inputs_factor_eigenvalues"],
                    cache["outputs_factor_eigen_vectors"], cache["outputs_factor_eigenvalues"],
                    v, identity_weight, power,
                )
            else:
                a, g = self._factors(state)
                sa, qa = linalg.safe_psd_eigh(a)
                sg, qg = linalg.safe_psd_eigh(g)
                out = linalg.kronecker_eigen_mul(qa, sa, qg, sg, v, identity_weight, power)
        elif use_cached:  # power == -1
            if "-1" not in cache:
                raise self._missing_cache("the approximate inverse (power -1)", "approx_powers_to_cache")
            out = cache["-1"]["inputs_factor"] @ v @ cache["-1"]["outputs_factor"]
        else:
            a, g = self._factors(state)
            a_d, g_d = linalg.pi_adjusted_factors(a, g, identity_weight)
            if power == 1:
                out = linalg.kronecker_product_mul(a_d, g_d, v)
            elif power == -1:
                out = linalg.kronecker_solve(a_d, g_d, v)
            else:
                out = linalg.psd_matrix_power(a_d, power) @ v @ linalg.psd_matrix_power(g_d, power)
        return self.array_to_parameters_shaped_list(out)

    def _inverse_diagonal_unscaled(self, state, identity_weight):
        # (A (x) G + w I)^-1 = (Qa (x) Qg) diag(1 / (sa sg^T + w)) (Qa (x) Qg)^T, whose diagonal
        # in the block's (inputs x outputs) layout is Qa^2 [1 / (sa sg^T + w)] (Qg^2)^T.
        a, g = self._factors(state)
        sa, qa = linalg.safe_psd_eigh(a)
        sg, qg = linalg.safe_psd_eigh(g)
        return self.array_to_parameters_shaped_list((qa**2) @ (1.0 / (jnp.outer(sa, sg) + identity_weight)) @ (qg**2).T)

    def _factor_eigenvalues(self, a: Array, g: Array) -> tuple[Array, Array]:
        return linalg.safe_eigvalsh(a), linalg.safe_eigvalsh(g)

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        cache, a, g = self._cache_and_scaled_factors(state, approx_powers)
        if exact_powers or "inputs_factor_eigen_vectors" in cache:
            sa, qa = linalg.safe_psd_eigh(a)
            sg, qg = linalg.safe_psd_eigh(g)
            cache.update(
                inputs_factor_eigenvalues=sa, outputs_factor_eigenvalues=sg,
                inputs_factor_eigen_vectors=qa, outputs_factor_eigen_vectors=qg,
            )
        elif eigenvalues or "inputs_factor_eigenvalues" in cache:
            cache.update(
                inputs_factor_eigenvalues=linalg.safe_eigvalsh(a),
                outputs_factor_eigenvalues=linalg.safe_eigvalsh(g),
            )
        if approx_powers:
            a_d, g_d = linalg.pi_adjusted_factors(a, g, _div(identity_weight, self.fixed_scale()))
            cache["-1"] = {
                "inputs_factor": linalg.psd_inv(a_d),
                "outputs_factor": linalg.psd_inv(g_d),
                "identity_weight": jnp.asarray(identity_weight, a.dtype),
            }
        state.cache = cache or None
        return state

    def _to_dense_unscaled(self, state):
        a, g = self._factors(state)
        return self._vec_v_to_parameter_order(jnp.kron(a, g))

    def _vec_v_to_parameter_order(self, dense_v: Array) -> Array:
        """Reorders a matrix acting on ``vec(V)`` (row-major) to parameter order."""
        # perm[k] = position in parameter order of the k-th entry of vec(V).
        offsets = np.cumsum([0] + list(self.parameters_sizes))
        index_params = [np.arange(offsets[i], offsets[i + 1]).reshape(s) for i, s in enumerate(self.parameters_shapes)]
        perm = np.asarray(self._params_to_array(index_params, np)).ravel()
        inv = np.argsort(perm)
        return dense_v[inv][:, inv]


KroneckerFactored = TwoKroneckerFactored


class DenseTwoKroneckerFactored(_DenseKroneckerMixin, TwoKroneckerFactored):
    """K-FAC for dense layers: ``A = E[x x^T]`` (x with a trailing 1 for the bias), ``G = E[dy dy^T]``.

    With extra (sequence) axes the positions are treated like extra examples
    for ``A`` (averaged over ``B * T`` rows) while ``G`` sums them per example
    (divided by ``B``): the "KFAC-expand" convention. For 2-D inputs both are
    plain batch averages, and for a single example ``A (x) G`` is exactly the
    outer product of the gradient.
    """

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del pmap_axis_name
        x, dy = self._dense_data(estimation_data)
        x = _per_example(x, self.dense_in_dim, "inputs[0]").reshape(-1, self.dense_in_dim)
        dy = _per_example(dy, self.dense_out_dim, "outputs_tangent[0]").reshape(-1, self.dense_out_dim)
        if x.shape[0] != dy.shape[0]:
            raise ValueError(f"{self._name}: inputs and output tangents have different numbers of rows.")
        x, dy = x.astype(self.dtype), dy.astype(self.dtype)
        return self._with_factors_updated(state, self._input_moment(x), linalg.gram(dy) / batch_size, ema_old, ema_new)


class DenseTwoKroneckerFactoredReduce(DenseTwoKroneckerFactored):
    """K-FAC-reduce (Eschenhagen et al. 2023) for dense layers shared over positions.

    With inputs ``(B, T, d)``: ``A = (1/B) sum_n xbar_n xbar_n^T`` with ``xbar_n``
    the mean of example n's (bias-augmented) inputs over positions, and
    ``G = (1/B) sum_n s_n s_n^T`` with ``s_n`` the sum of its output gradients.
    Exact for one example when the positions are averaged before the loss (mean
    pooling), where the default KFAC-expand is not. Select it per optimizer or
    estimator with ``layer_tag_to_block_ctor={"dense": DenseTwoKroneckerFactoredReduce}``
    (or per layer with ``index_to_block_ctor``). For 2-D inputs it equals the default.
    """

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del pmap_axis_name
        x, dy = self._dense_data(estimation_data)
        dtype = self.dtype
        x3 = _per_example(x, self.dense_in_dim, "inputs[0]").astype(dtype)
        dy3 = _per_example(dy, self.dense_out_dim, "outputs_tangent[0]").astype(dtype)
        if x3.shape[:2] != dy3.shape[:2]:
            raise ValueError(f"{self._name}: inputs {x.shape} and output tangents {dy.shape} disagree on leading axes.")
        xbar, s = jnp.mean(x3, axis=1), jnp.sum(dy3, axis=1)
        return self._with_factors_updated(state, self._input_moment(xbar), linalg.gram(s) / batch_size, ema_old, ema_new)


# ----------------------------------------------------------------------------------
# Eigenvalue-corrected K-FAC (EKFAC)
# ----------------------------------------------------------------------------------


class RepeatedDenseKroneckerFactored(DenseTwoKroneckerFactored):
    """K-FAC-expand for a dense layer applied at many positions, with padding masked out.

    kfac-jax's repeated-dense block. A position whose output cotangent is zero in
    every feature is padding (a masked loss gives it no gradient); with
    ``use_masking`` it is left out of ``A``. With ``R`` the mean number of kept
    positions per example (a moving average like the factors):
    ``A = (1/B) sum_kept [x; 1][x; 1]^T``, ``G = (1/B) sum dy dy^T`` and
    ``C = (A (x) G) / R`` -- the ``DenseTwoKroneckerFactored`` estimate over the
    kept positions only, so sequences of different lengths can share a padded
    batch. Without padding the two blocks are equal.
    """

    @register_state_class
    class State(TwoKroneckerFactored.State):
        """Adds ``average_repeats``: ``WeightedMovingAverage`` of the kept positions per example."""

        average_repeats: WeightedMovingAverage

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None, use_masking: bool = True):
        super().__init__(layer_tag_eq, name)
        self.use_masking = bool(use_masking)

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        base = super()._init(rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues)
        return RepeatedDenseKroneckerFactored.State(
            cache=base.cache,
            inputs_factor=base.inputs_factor,
            outputs_factor=base.outputs_factor,
            average_repeats=WeightedMovingAverage.zeros((), self.dtype),
        )

    def state_dependent_scale(self, state: Any) -> Array:
        r = state.average_repeats.value
        return jnp.where(r > 0, 1 / jnp.where(r > 0, r, 1), 1)

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del pmap_axis_name
        x3, dy3 = self._augmented_per_example(estimation_data, self.dtype)  # (B, T, d_in [+1]), (B, T, d_out)
        if self.use_masking:
            keep = jnp.any(dy3 != 0, axis=-1).astype(self.dtype)
        else:
            keep = jnp.ones(x3.shape[:2], self.dtype)
        x2 = (x3 * keep[..., None]).reshape(-1, x3.shape[-1])
        dy2 = dy3.reshape(-1, dy3.shape[-1])
        state = self._with_factors_updated(state, linalg.gram(x2) / batch_size, linalg.gram(dy2) / batch_size, ema_old, ema_new)
        state.average_repeats.update(jnp.sum(keep) / batch_size, ema_old, ema_new)
        return state


class EigenvalueCorrectedKroneckerFactored(TwoKroneckerFactored, abc.ABC):
    """EKFAC (George et al., 2018): ``C ~= Q diag(s) Q^T`` with ``Q = Q_A (x) Q_G``.

    ``Q_A``, ``Q_G`` are eigenvectors of the K-FAC factors ``A``, ``G`` (moving
    averages estimated exactly as by the K-FAC block this class is combined
    with), and ``s`` (shape ``input_size() x output_size()``) is a moving average
    of the per-example gradient second moments in that basis,
    ``s = (1/B) sum_n (Q_A^T V_n Q_G)^2`` (elementwise), ``V_n`` being example n's
    gradient arranged as ``V``. So ``s`` is the diagonal of the per-example Fisher
    in the Kronecker eigenbasis: with the basis of the same statistics, EKFAC is
    never further from that Fisher (Frobenius norm) than K-FAC, whose eigenvalues
    ``s_A s_G^T`` are another diagonal in the same basis.

    Basis: recomputed only by ``update_cache`` (``eigh`` of ``A`` and ``G``) and
    kept in ``cache["inputs_factor_eigen_vectors"]`` /
    ``cache["outputs_factor_eigen_vectors"]`` whatever powers were requested. It
    is the identity before the first ``update_cache``, where the block is the
    diagonal per-example Fisher (as ``DenseDiagonal``); a caller that never
    calls ``update_cache`` therefore gets a diagonal preconditioner. When the basis changes,
    ``s`` is carried over as the diagonal of the previous estimate in the new
    basis (its Frobenius projection; same moving-average weight), and later
    batches are measured in the new basis.

    Every product, exact or approximate, cached or not, is
    ``Q diag(s + w)^p Q^T v`` with the current ``s`` and the damping ``w`` given
    at call time: nothing but the basis is cached. ``eigenvalues`` returns ``s``.

    Subclasses list a concrete ``TwoKroneckerFactored`` (which estimates ``A``
    and ``G``) after this class in their bases and implement
    ``_eigenvalue_correction_from_data``.
    """

    @register_state_class
    class State(TwoKroneckerFactored.State):
        """Adds ``eigenvalue_correction``: ``WeightedMovingAverage`` of ``s``."""

        eigenvalue_correction: WeightedMovingAverage

    @abc.abstractmethod
    def _eigenvalue_correction_from_data(
        self, estimation_data: Mapping[str, Sequence[Array]], qa: Array, qg: Array, batch_size: Numeric
    ) -> Array:
        """This batch's ``(1/B) sum_n (Q_A^T V_n Q_G)^2``, shape ``(input_size(), output_size())``."""

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues
        self._check_sizes()
        di, do, dtype = int(self.input_size()), int(self.output_size()), self.dtype
        return EigenvalueCorrectedKroneckerFactored.State(
            cache={
                "inputs_factor_eigen_vectors": jnp.eye(di, dtype=dtype),
                "outputs_factor_eigen_vectors": jnp.eye(do, dtype=dtype),
            },
            inputs_factor=WeightedMovingAverage.zeros((di, di), dtype),
            outputs_factor=WeightedMovingAverage.zeros((do, do), dtype),
            eigenvalue_correction=WeightedMovingAverage.zeros((di, do), dtype),
        )

    def _basis(self, state: Any) -> tuple[Array, Array]:
        cache = state.cache or {}
        if "inputs_factor_eigen_vectors" not in cache or "outputs_factor_eigen_vectors" not in cache:
            raise ValueError(
                f"{self._name} ({type(self).__name__}): the state has no eigenbasis in its cache; create it with "
                "this block's `init`."
            )
        return cache["inputs_factor_eigen_vectors"], cache["outputs_factor_eigen_vectors"]

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        state = _copy_state(
            super().update_curvature_matrix_estimate(state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name)
        )
        qa, qg = self._basis(state)
        s = self._eigenvalue_correction_from_data(estimation_data, qa, qg, batch_size)
        state.eigenvalue_correction.update(s.astype(state.eigenvalue_correction.value.dtype), ema_old, ema_new)
        return state

    def _serves_from_cache(self, power, exact_power):
        del power, exact_power
        return False  # s is read live, so the whole scale applies at call time

    def _multiply_matpower_unscaled(self, state, vector, identity_weight, power, exact_power, use_cached):
        del exact_power, use_cached
        qa, qg = self._basis(state)
        v = self._params_to_array(vector, jnp)
        s = state.eigenvalue_correction.value
        return self.array_to_parameters_shaped_list(
            linalg.kronecker_eigen_basis_mul(qa, qg, s, v, identity_weight, power)
        )

    def _eigenvalues_unscaled(self, state, use_cached):
        del use_cached
        return jnp.ravel(state.eigenvalue_correction.value)

    def _inverse_diagonal_unscaled(self, state, identity_weight):
        qa, qg = self._basis(state)
        scalings = state.eigenvalue_correction.value
        return self.array_to_parameters_shaped_list((qa**2) @ (1.0 / (scalings + identity_weight)) @ (qg**2).T)

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        del identity_weight, exact_powers, approx_powers, eigenvalues
        a, g = self._factors(state)
        qa_old, qg_old = self._basis(state)
        _, qa = linalg.safe_psd_eigh(a)
        _, qg = linalg.safe_psd_eigh(g)
        # diag((Q_A (x) Q_G)^T C_old (Q_A (x) Q_G)) = P_A s_old P_G^T with P = (Q_new^T Q_old)^2.
        s = state.eigenvalue_correction
        projected = jnp.square(qa.T @ qa_old) @ s.value @ jnp.square(qg.T @ qg_old).T
        state.eigenvalue_correction = WeightedMovingAverage(weight=s.weight, value=projected.astype(s.value.dtype))
        state.cache = dict(state.cache, inputs_factor_eigen_vectors=qa, outputs_factor_eigen_vectors=qg)
        return state

    def _to_dense_unscaled(self, state):
        qa, qg = self._basis(state)
        q = jnp.kron(qa, qg)
        return self._vec_v_to_parameter_order((q * jnp.ravel(state.eigenvalue_correction.value)) @ q.T)

    def _norm_unscaled(self, state, norm_type):
        # No kfac-jax counterpart: the norm of C = Q diag(s) Q^T itself. Its eigenvalues are s,
        # its diagonal (Q_A^2) s (Q_G^2)^T; only the 1-norm needs the dense matrix.
        s = state.eigenvalue_correction.value
        if norm_type == "1_norm":
            return CurvatureBlock._norm_unscaled(self, state, norm_type)
        if norm_type == "median_diag":
            qa, qg = self._basis(state)
            return jnp.median((qa**2) @ s @ (qg**2).T)
        return linalg.psd_matrix_norm(jnp.ravel(s), norm_type)


class DenseEigenvalueCorrected(EigenvalueCorrectedKroneckerFactored, DenseTwoKroneckerFactored):
    """EKFAC for dense layers: ``A``, ``G`` as in ``DenseTwoKroneckerFactored``.

    ``V_n = sum_t [x_nt; 1] dy_nt^T`` is example n's (weight, bias) gradient,
    summed over any extra (sequence) positions ``t``.
    """

    def _eigenvalue_correction_from_data(self, estimation_data, qa, qg, batch_size):
        x3, dy3 = self._augmented_per_example(estimation_data, qa.dtype)
        xr, dyr = x3 @ qa, dy3 @ qg
        if x3.shape[1] == 1:  # one position: (Q_A^T x)^2 (Q_G^T dy)^2^T, no per-example matrices
            s = jnp.square(xr[:, 0]).T @ jnp.square(dyr[:, 0])
        else:
            s = jnp.sum(jnp.square(jnp.einsum("bti,bto->bio", xr, dyr)), axis=0)
        return s / batch_size



# ----------------------------------------------------------------------------------
# Tensor Normal Training (TNT)
# ----------------------------------------------------------------------------------


class _TwoFactorTNT(TwoKroneckerFactored, abc.ABC):
    """TNT (Ren & Goldfarb, 2021) for a gradient arranged as the matrix ``V``.

    The gradient is modelled as tensor-normal, ``Cov(vec V) = U_A (x) U_G``. The
    factors are the mode second moments ``A = E[V V^T]`` and ``G = E[V^T V]``
    (moving averages of batch estimates, see the subclasses), and

        ``C = (A (x) G) / sqrt(tr(A) tr(G))``,

    i.e. ``state_dependent_scale = (tr A tr G)^(-1/2)`` (1 while a trace is not
    positive). Why this normalisation: ``tr A = tr G = E[|V|^2] = tr E[vec V vec V^T]``,
    so ``tr C`` equals the trace of the per-example Fisher for any data; for a
    single example (rank one) ``C = vec V vec V^T`` exactly; and if the
    covariance really is ``U_A (x) U_G`` then ``A = U_A tr U_G``,
    ``G = U_G tr U_A`` and ``C`` recovers it. How the scale is split between the
    two factors does not change ``C``; pi-adjusted damping balances them.
    """

    def state_dependent_scale(self, state: Any) -> Array:
        ta = jnp.trace(state.inputs_factor.value)
        tg = jnp.trace(state.outputs_factor.value)
        ok = jnp.logical_and(ta > 0, tg > 0)
        return jnp.where(ok, 1 / jnp.sqrt(jnp.where(ok, ta, 1)) / jnp.sqrt(jnp.where(ok, tg, 1)), 1)

    @abc.abstractmethod
    def _tnt_factors_from_data(
        self, estimation_data: Mapping[str, Sequence[Array]], batch_size: Numeric
    ) -> tuple[Array, Array]:
        """This batch's estimates of ``E[V V^T]`` and ``E[V^T V]``."""

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del pmap_axis_name
        a, g = self._tnt_factors_from_data(estimation_data, batch_size)
        a, g = a.astype(state.inputs_factor.value.dtype), g.astype(state.outputs_factor.value.dtype)
        return self._with_factors_updated(state, a, g, ema_old, ema_new)


class NaiveTNT(_TwoFactorTNT):
    """TNT from the batch-summed (sampled-loss) gradient ``g``: ``A = V V^T / B``, ``G = V^T V / B``.

    ``V`` is ``g`` arranged as a matrix: the first parameter reshaped to
    ``(-1, last axis)`` (transposed first for ``meta["kernel_layout"] == "oi"``),
    with an optional second parameter of that last axis' size as an extra row.
    This suits any parameter of at least one axis (``generic`` tags included);
    like ``NaiveDiagonal`` it is unbiased when the per-example gradients of the
    sampled loss are independent and zero-mean.
    """

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None):
        super().__init__(layer_tag_eq, name)
        shapes = self.parameters_shapes
        if len(shapes[0]) == 0 or (self.has_bias and math.prod(shapes[1]) != self._last_axis()):
            raise ValueError(
                f"{self.name}: NaiveTNT needs a parameter with at least one axis and an optional second parameter with "
                f"as many entries as the first one's last axis, got shapes {shapes}."
            )

    def _last_axis(self) -> int:
        w = self.parameters_shapes[0]
        axes = kernel_axes(self._layer_tag_eq.meta, w)
        return w[-1] if axes is None else math.prod(w[i] for i in axes[1])

    def input_size(self) -> int:
        return int(math.prod(self.parameters_shapes[0])) // self._last_axis() + int(self.has_bias)

    def output_size(self) -> int:
        return self._last_axis()

    def _tnt_factors_from_data(self, estimation_data, batch_size):
        tangents = tuple(estimation_data["params_tangent"])
        if len(tangents) != self.number_of_parameters:
            raise ValueError(
                f"{self._name}: expected {self.number_of_parameters} parameter tangents, got {len(tangents)}."
            )
        v = self._params_to_array(tangents, jnp).astype(self.dtype)
        return (v @ v.T) / batch_size, (v.T @ v) / batch_size


class DenseTNT(_DenseKroneckerMixin, _TwoFactorTNT):
    """TNT for dense layers from per-example gradients ``V_n = sum_t [x_nt; 1] dy_nt^T``.

    ``A = (1/B) sum_n V_n V_n^T`` and ``G = (1/B) sum_n V_n^T V_n``; with one
    position per example these are ``(1/B) sum_n |dy_n|^2 [x_n; 1][x_n; 1]^T``
    and ``(1/B) sum_n (|x_n|^2 + 1) dy_n dy_n^T``.
    """

    def _tnt_factors_from_data(self, estimation_data, batch_size):
        x3, dy3 = self._augmented_per_example(estimation_data, self.dtype)
        if x3.shape[1] == 1:
            x2, dy2 = x3[:, 0], dy3[:, 0]
            a = (x2 * jnp.sum(jnp.square(dy2), axis=1, keepdims=True)).T @ x2
            g = (dy2 * jnp.sum(jnp.square(x2), axis=1, keepdims=True)).T @ dy2
        else:
            v = jnp.einsum("bti,bto->bio", x3, dy3)
            a = jnp.einsum("bio,bjo->ij", v, v)
            g = jnp.einsum("bio,bip->op", v, v)
        return a / batch_size, g / batch_size


# ----------------------------------------------------------------------------------
# Defaults
# ----------------------------------------------------------------------------------

_DEFAULT_TAG_TO_BLOCK_CTOR: dict[str, Callable[..., CurvatureBlock]] = {
    "dense": DenseTwoKroneckerFactored,
    "generic": NaiveDiagonal,
    "repeated_dense": RepeatedDenseKroneckerFactored,  # a dense-tag variant, as in kfac-jax
}


def _tag_name(tag_name: Any) -> str:
    name = getattr(tag_name, "name", tag_name)
    if not isinstance(name, str):
        raise TypeError(f"A tag name must be a string (or a LayerTag), got {type(tag_name).__name__}.")
    return name


def set_default_tag_to_block_ctor(tag_name: Any, block_ctor: Callable[..., CurvatureBlock]) -> None:
    """Makes ``block_ctor(layer_tag_eq, name)`` the default block for layers tagged ``tag_name``.

    ``tag_name`` may also be a variant of a tag (kfac-jax: ``register_dense(...,
    variant="repeated_dense")``); layers of that variant then get this block. A kfac-jax
    v0.0.8-style ``block_ctor(layer_tag_eq)`` without ``name`` works too.
    """
    if not callable(block_ctor):
        raise TypeError(f"`block_ctor` must be callable, got {type(block_ctor).__name__}.")
    _DEFAULT_TAG_TO_BLOCK_CTOR[_tag_name(tag_name)] = block_ctor


def set_multi_default_tag_to_block_ctor(tags_to_block_ctor: Mapping[str, Callable[..., CurvatureBlock]]) -> None:
    """``set_default_tag_to_block_ctor`` for each ``(tag name or variant, ctor)`` pair (kfac-jax v0.0.8 name)."""
    if not isinstance(tags_to_block_ctor, Mapping):
        raise TypeError(f"`tags_to_block_ctor` must be a mapping of tag names to block constructors, got {type(tags_to_block_ctor).__name__}.")
    for tag_name, ctor in tags_to_block_ctor.items():
        set_default_tag_to_block_ctor(tag_name, ctor)


def find_default_tag_to_block_ctor(tag_name: Any) -> Callable[..., CurvatureBlock] | None:
    """The default block constructor for a tag name or variant, or None if there is none."""
    name = _tag_name(tag_name)
    for key in (name, name.removesuffix("_tag")):
        if key in _DEFAULT_TAG_TO_BLOCK_CTOR:
            return _DEFAULT_TAG_TO_BLOCK_CTOR[key]
    return None


def get_default_tag_to_block_ctor(tag_name: Any) -> Callable[..., CurvatureBlock]:
    """The default block constructor for a tag name (``"dense"``, ``"generic"``, ...).

    kfac-jax style names with a ``_tag`` suffix (``"dense_tag"``) are accepted too.
    """
    name = _tag_name(tag_name)
    if name in _DEFAULT_TAG_TO_BLOCK_CTOR:
        return _DEFAULT_TAG_TO_BLOCK_CTOR[name]
    if name.endswith("_tag") and name[: -len("_tag")] in _DEFAULT_TAG_TO_BLOCK_CTOR:
        return _DEFAULT_TAG_TO_BLOCK_CTOR[name[: -len("_tag")]]
    raise ValueError(
        f"No default curvature block for layer tag {name!r}; known tags: {sorted(_DEFAULT_TAG_TO_BLOCK_CTOR)}. "
        "Register one with `set_default_tag_to_block_ctor` or pass `layer_tag_to_block_ctor`."
    )


_MAX_PARALLEL_ELEMENTS = 2**23


def set_max_parallel_elements(value: int) -> None:
    """Sets the memory/parallelism trade-off knob of per-example blocks (kept for API parity)."""
    global _MAX_PARALLEL_ELEMENTS
    _MAX_PARALLEL_ELEMENTS = utils.check_int(value, "max_parallel_elements", 1)


def get_max_parallel_elements() -> int:
    """The current value set by ``set_max_parallel_elements``."""
    return _MAX_PARALLEL_ELEMENTS
