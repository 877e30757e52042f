"""kfac-jax v0.0.8's ``kfac_jax.utils`` names that curvax's own code does not need.

Compatibility-only. ``kfac_jax.utils`` is ``curvax.utils``: ``curvax/__init__.py``
adds every name of ``__all__`` to ``curvax.utils`` (so ``kfac_jax.utils.X`` works
with ``import curvax as kfac_jax``), while curvax's own modules import only the
core ``curvax.utils``. Implementations reuse ``curvax.utils``, ``curvax.linalg``
and ``curvax.blocks``; the helpers the core needs too (``in_pmap``, ``get_first``
...) live in ``curvax.utils`` and are listed here as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import operator
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from curvax import blocks, linalg
from curvax.blocks import WeightedMovingAverage
from curvax.losses import stable_sqrt
from curvax.utils import (
    Params,
    _is_scalar,
    get_first,
    in_pmap,
    inner_product,
    norm,
    param_paths,
    pmean_if_pmap,
    psum_if_pmap,
    scalar_mul,
    tree_add,
    tree_zeros_like,
    weighted_sum_of_objects,
    wrap_if_pmap,
)

__all__ = [
    "Array",
    "PRNGKey",
    "Scalar",
    "Numeric",
    "Shape",
    "DType",
    "PyTree",
    "ArrayTree",
    "TArrayTree",
    "FuncState",
    "FuncAux",
    "PyTreeDef",
    "FuncOuts",
    "Func",
    "ValueFunc",
    "ValueAndGradFunc",
    "AssumedFuncOutput",
    "ScheduleType",
    "tree_is_empty",
    "abstract_objects_equal",
    "product",
    "to_tuple_or_repeat",
    "filter_sequence",
    "fake_element_from_iterator",
    "replace_char",
    "call_func_with_conditional_kwargs",
    "auto_scope_function",
    "auto_scope_method",
    "rearrange",
    "State",
    "serialize_state_tree",
    "deserialize_state_tree",
    "register_state_class",
    "Finalizable",
    "outer_product",
    "scalar_div",
    "sum_of_objects",
    "pytree_size",
    "symmetric_matrix_inner_products",
    "asymmetric_matrix_inner_products",
    "block_permuted",
    "per_parameter_norm",
    "cosine_similarity",
    "set_special_case_zero_inv",
    "get_special_case_zero_inv",
    "set_use_cholesky_inversion",
    "get_use_cholesky_inversion",
    "psd_inv",
    "psd_solve",
    "psd_solve_maybe_zero_last_idx",
    "safe_psd_eigh",
    "psd_matrix_norm",
    "pi_adjusted_kronecker_factors",
    "invert_psd_matrices",
    "inverse_sqrt_psd_matrices",
    "pi_adjusted_kronecker_inverse",
    "kronecker_product_axis_mul_v",
    "kronecker_eigen_basis_axis_mul_v",
    "kronecker_product_mul_v",
    "kronecker_eigen_basis_mul_v",
    "tnt_scale",
    "loop_and_parallelize_average",
    "in_pmap",
    "wrap_if_pmap",
    "pmean_if_pmap",
    "psum_if_pmap",
    "pmap_mean",
    "pmap_sum",
    "using_legacy_pmap",
    "get_first",
    "get_mean",
    "get_sum",
    "broadcast_all_local_devices",
    "replicate_all_local_devices",
    "make_different_rng_key_on_all_devices",
    "p_split",
    "p_split_num",
    "pmap_zeros_like",
    "jit_zeros_like",
    "host_sync",
    "host_all_gather",
    "host_mean",
    "pmap_sync_and_divide_value",
    "jit_sync_and_divide_value",
    "copy_array",
    "copy_obj",
    "pmap_copy_obj",
    "distribute_thunks",
    "default_add_function",
    "get_float_dtype_and_check_consistency",
    "MultiChunkAccumulator",
    "WithStagedMethods",
    "staged",
    "WeightedMovingAverage",
    "stable_sqrt",
]

# ----------------------------------------------------------------------------------
# kfac-jax v0.0.8 ``kfac_jax.utils`` names (compatibility; ``import curvax as kfac_jax``)
# ----------------------------------------------------------------------------------
# Type names. kfac-jax declares ``Params``/``Batch``/``FuncState`` as TypeVars; here
# they stay ``Any`` (as above) since they are only ever used in annotations.

_T = TypeVar("_T")
Array = jax.Array
PRNGKey = jax.Array
Scalar = Union[float, int]
Numeric = Union[jax.Array, float, int]
Shape = tuple[int, ...]
DType = Any
PyTree = Union[_T, Sequence[Any], Mapping[str, Any]]
ArrayTree = Any
TArrayTree = TypeVar("TArrayTree")
FuncState = Any
FuncAux = dict[str, Any]
PyTreeDef = jax.tree_util.PyTreeDef
FuncOuts = Union[jax.Array, tuple[jax.Array, FuncAux]]
Func = Callable[..., FuncOuts]
ValueFunc = Callable[..., jax.Array]
ValueAndGradFunc = Callable[..., tuple[jax.Array, Params]]
AssumedFuncOutput = Union[jax.Array, tuple[jax.Array, FuncAux], tuple[jax.Array, tuple[FuncState, FuncAux]]]
ScheduleType = Callable[..., Any]


def tree_is_empty(obj: Any) -> bool:
    """Whether ``obj`` has no array leaves."""
    return not jax.tree_util.tree_leaves(obj)


def abstract_objects_equal(obj1: Any, obj2: Any, check_dtype: bool = True) -> bool:
    """Whether two pytrees have the same structure and leaf shapes (and dtypes, if ``check_dtype``)."""
    l1, t1 = jax.tree_util.tree_flatten(obj1)
    l2, t2 = jax.tree_util.tree_flatten(obj2)
    return t1 == t2 and all(
        np.shape(a) == np.shape(b) and (not check_dtype or jnp.result_type(a) == jnp.result_type(b))
        for a, b in zip(l1, l2)
    )


# --- small sequence / function helpers ----------------------------------------------


def product(iterable_object: Iterable[Any]) -> Any:
    """The product of the elements (1 for an empty iterable)."""
    return functools.reduce(operator.mul, iterable_object, 1)


def to_tuple_or_repeat(x: Any, length: int) -> tuple[Any, ...]:
    """``x`` as a tuple of ``length`` items: a sequence is checked, an array split on its
    last axis, a scalar repeated."""
    if isinstance(x, (list, tuple)):
        if len(x) != length:
            raise ValueError(f"to_tuple_or_repeat: expected {length} items, got {len(x)}.")
        return tuple(x)
    if hasattr(x, "shape") and np.size(x) > 1:
        if x.shape[-1] != length:
            raise ValueError(f"to_tuple_or_repeat: the array's last axis must have size {length}, got {x.shape}.")
        return tuple(x[..., i] for i in range(length))
    if isinstance(x, (int, float)) or hasattr(x, "shape"):
        return (x,) * length
    raise TypeError(f"to_tuple_or_repeat: expected a number, array or sequence, got {type(x).__name__}.")


def filter_sequence(unfiltered_sequence: Sequence[Any], bool_sequence: Sequence[bool]) -> Sequence[Any]:
    """The items whose flag is true (a tuple for a tuple input, a list otherwise)."""
    kept = [x for x, keep in zip(unfiltered_sequence, bool_sequence) if keep]
    return tuple(kept) if isinstance(unfiltered_sequence, tuple) else kept


def fake_element_from_iterator(iterator: Iterator[Any]) -> tuple[Any, Iterator[Any]]:
    """A zeroed copy of the iterator's first element, and an iterator still yielding that element."""
    first = next(iterator)
    return tree_zeros_like(first), itertools.chain([first], iterator)


def replace_char(original: str, new_str: str, index: int) -> str:
    """``original`` with the character at ``index`` replaced by ``new_str``."""
    return original[:index] + new_str + original[index + 1 :]


def call_func_with_conditional_kwargs(func: Callable[..., _T], *func_args: Any, **kwargs: Any) -> _T:
    """Calls ``func`` with only those ``kwargs`` that its signature names."""
    names = inspect.signature(func).parameters
    return func(*func_args, **{k: v for k, v in kwargs.items() if k in names})


def auto_scope_function(func: Callable[..., _T]) -> Callable[..., _T]:
    """Runs ``func`` inside ``jax.named_scope(func.__name__)`` (names in profiles and HLO)."""

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> _T:
        with jax.named_scope(func.__name__):
            return func(*args, **kwargs)

    return wrapped


def auto_scope_method(method: Callable[..., _T]) -> Callable[..., _T]:
    """Runs a method inside ``jax.named_scope("<Class>_<method>")`` (leading ``_`` dropped)."""

    @functools.wraps(method)
    def wrapped(instance: Any, *args: Any, **kwargs: Any) -> _T:
        with jax.named_scope(f"{type(instance).__name__}_{method.__name__.lstrip('_')}"):
            return method(instance, *args, **kwargs)

    return wrapped


def rearrange(x: jax.Array, spec: str) -> jax.Array:
    """Transposes and regroups axes as an einops-style ``spec`` says.

    The left side names each axis with one letter; the right side permutes
    them, groups them with parentheses (merged into one axis) and may insert
    ``1`` (a new axis of size 1). Spaces are ignored. E.g. ``"b h w c -> b (c h w)"``.
    """
    if spec.count("->") != 1:
        raise ValueError(f"rearrange: `spec` must have the form 'in -> out', got {spec!r}.")
    lhs, rhs = (side.replace(" ", "") for side in spec.split("->"))
    if len(lhs) != x.ndim or len(set(lhs)) != len(lhs) or not lhs.isalpha():
        raise ValueError(f"rearrange: the left side {lhs!r} must name each of the {x.ndim} axes once, by one letter.")
    names = [c for c in rhs if c not in "()1"]
    if sorted(names) != sorted(lhs):
        raise ValueError(f"rearrange: the right side {rhs!r} must use every axis of {lhs!r} exactly once.")
    x = jnp.transpose(x, [lhs.index(c) for c in names])
    sizes = dict(zip(names, x.shape))
    shape: list[int] = []
    group: int | None = None
    for c in rhs:
        if c == "(":
            if group is not None:
                raise ValueError(f"rearrange: nested parentheses in {rhs!r}.")
            group = 1
        elif c == ")":
            if group is None:
                raise ValueError(f"rearrange: unbalanced parentheses in {rhs!r}.")
            shape.append(group)
            group = None
        else:
            size = 1 if c == "1" else sizes[c]
            if group is None:
                shape.append(size)
            else:
                group *= size
    if group is not None:
        raise ValueError(f"rearrange: unbalanced parentheses in {rhs!r}.")
    return x.reshape(shape)


class State:
    """Base of kfac-jax-style state dataclasses: pytrees whose children are the fields.

    Compatibility name (kfac-jax's ``utils.State``); use ``register_state_class`` on subclasses.
    """

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @property
    def field_values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, n) for n in self.field_names())

    def copy(self: Any) -> Any:
        """A new object with the same structure, sharing the (immutable) arrays."""
        return jax.tree_util.tree_map(lambda x: x, self)


_STATE_CLASSES: dict[str, type] = {}


def _state_class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def serialize_state_tree(instance: Any) -> Any:
    """Nested dicts/lists of arrays for a tree of registered state objects (each dict names its class)."""
    if dataclasses.is_dataclass(instance) and not isinstance(instance, type):
        out = {f.name: serialize_state_tree(getattr(instance, f.name)) for f in dataclasses.fields(instance)}
        out["__class__"] = _state_class_name(type(instance))
        return out
    if isinstance(instance, (list, tuple, set)):
        return type(instance)(serialize_state_tree(v) for v in instance)
    if isinstance(instance, dict):
        return {k: serialize_state_tree(v) for k, v in instance.items()}
    return instance


def deserialize_state_tree(representation: Any) -> Any:
    """Inverse of ``serialize_state_tree`` (classes must have gone through ``register_state_class``)."""
    if isinstance(representation, (list, tuple, set)):
        return type(representation)(deserialize_state_tree(v) for v in representation)
    if isinstance(representation, dict):
        if "__class__" not in representation:
            return {k: deserialize_state_tree(v) for k, v in representation.items()}
        fields = dict(representation)
        name = fields.pop("__class__")
        if name not in _STATE_CLASSES:
            raise ValueError(
                f"deserialize_state_tree: unknown state class {name!r}; decorate it with "
                "curvax.utils.register_state_class before deserializing."
            )
        return _STATE_CLASSES[name](**{k: deserialize_state_tree(v) for k, v in fields.items()})
    return representation


def register_state_class(class_type: type) -> type:
    """Makes ``class_type`` a dataclass registered as a pytree, known to ``deserialize_state_tree``.

    Same as ``curvax.blocks.register_state_class`` (kfac-jax name), plus the
    registration used for (de)serialization.
    """
    cls = blocks.register_state_class(class_type)
    _STATE_CLASSES[_state_class_name(cls)] = cls
    return cls


class Finalizable:
    """Mixin whose attributes cannot be set after ``finalize()`` (kfac-jax's ``utils.Finalizable``).

    Compatibility name. ``excluded_attribute_names`` may still be set afterwards.
    """

    def __init__(
        self,
        forbid_setting_attributes_after_finalize: bool = True,
        excluded_attribute_names: Sequence[str] = (),
        **parent_kwargs: Any,
    ):
        self._finalized = False
        self._forbid_setting_attributes = forbid_setting_attributes_after_finalize
        self._excluded_attribute_names = frozenset(excluded_attribute_names) | {"_forbid_setting_attributes"}
        super().__init__(**parent_kwargs)

    @property
    def finalized(self) -> bool:
        return getattr(self, "_finalized", False)

    def finalize(self, *args: Any, **kwargs: Any) -> None:
        """Runs ``_finalize`` and freezes the attributes."""
        if self.finalized:
            raise ValueError("finalize: the object has already been finalized.")
        self._finalize(*args, **kwargs)
        self._finalized = True

    def _finalize(self, *args: Any, **kwargs: Any) -> None:
        """Subclasses' finalization logic."""

    def unlock_attributes(self) -> None:
        self._forbid_setting_attributes = False

    def lock_attributes(self) -> None:
        self._forbid_setting_attributes = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_finalized", False):
            if not hasattr(self, name):
                raise AttributeError(f"Cannot create attribute {name!r} after finalization.")
            if getattr(self, "_forbid_setting_attributes", True) and name not in getattr(
                self, "_excluded_attribute_names", ()
            ):
                raise AttributeError(f"Cannot set attribute {name!r} after finalization.")
        super().__setattr__(name, value)


# --- math ----------------------------------------------------------------------------


def outer_product(*arrays: jax.Array) -> jax.Array:
    """The outer product of vectors: ``out[i, j, ...] = a[i] * b[j] * ...``."""
    if not arrays or any(np.ndim(a) != 1 for a in arrays):
        raise ValueError("outer_product: every argument must be a vector (1-D array).")
    out = arrays[0]
    for a in arrays[1:]:
        out = out[..., None] * a
    return out


def scalar_div(obj: Any, scalar: Any) -> Any:
    """Every leaf of ``obj`` divided by ``scalar``."""
    return jax.tree_util.tree_map(lambda x: x / scalar, obj)


def sum_of_objects(objects: Sequence[Any]) -> Any:
    """The leafwise sum of pytrees of one structure."""
    return weighted_sum_of_objects(objects, [1] * len(objects))


def pytree_size(pytree: Any) -> int:
    """The total number of elements over the leaves."""
    return sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(pytree))


def symmetric_matrix_inner_products(
    vectors1: Sequence[Any], vectors2: Sequence[Any], ip_function: Callable[[Any, Any], Any] = inner_product
) -> jax.Array:
    """``M[i, j] = ip(v1_i, v2_j)`` computing only ``j >= i`` and mirroring (for symmetric pairs)."""
    if len(vectors1) != len(vectors2):
        raise ValueError("symmetric_matrix_inner_products: the two sequences must have the same length.")
    n = len(vectors1)
    m: list[list[Any]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(i, n):
            m[i][j] = m[j][i] = ip_function(vectors1[i], vectors2[j])
    return jnp.asarray(m)


def asymmetric_matrix_inner_products(
    vectors1: Sequence[Any], vectors2: Sequence[Any], ip_function: Callable[[Any, Any], Any] = inner_product
) -> jax.Array:
    """``M[i, j] = ip(v1_i, v2_j)`` for all pairs."""
    return jnp.asarray([[ip_function(a, b) for b in vectors2] for a in vectors1])


def block_permuted(matrix: jax.Array, block_sizes: Sequence[int], block_order: Sequence[int]) -> jax.Array:
    """``matrix`` with its row and column blocks (of ``block_sizes``) reordered as ``block_order``."""
    if len(block_sizes) != len(block_order) or sorted(block_order) != list(range(len(block_sizes))):
        raise ValueError("block_permuted: `block_order` must be a permutation of range(len(block_sizes)).")
    starts = np.concatenate([[0], np.cumsum(block_sizes)])
    idx = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in block_order]).astype(int)
    return matrix[idx][:, idx]


def per_parameter_norm(obj: Any, key_prefix: str) -> dict[str, jax.Array]:
    """``{f"{key_prefix}(path)": norm(leaf)}`` for every leaf."""
    return {f"{key_prefix}({name})": jnp.linalg.norm(leaf) for name, leaf in zip(param_paths(obj), jax.tree_util.tree_leaves(obj))}


def cosine_similarity(v1: Any, v2: Any) -> jax.Array:
    """``<v1, v2> / (|v1| |v2|)`` over flattened pytrees."""
    return inner_product(v1, v2) / (norm(v1) * norm(v2))


_SPECIAL_CASE_ZERO_INV = True
_USE_CHOLESKY_INVERSION = True


def set_special_case_zero_inv(value: bool) -> None:
    """Whether ``pi_adjusted_kronecker_factors`` maps an all-zero factor set to ``damping**(1/k) I``."""
    global _SPECIAL_CASE_ZERO_INV
    _SPECIAL_CASE_ZERO_INV = bool(value)


def get_special_case_zero_inv() -> bool:
    """The value set by ``set_special_case_zero_inv`` (default ``True``); kfac-jax compatibility."""
    return _SPECIAL_CASE_ZERO_INV


def set_use_cholesky_inversion(value: bool) -> None:
    """kfac-jax switch between Cholesky and LU inverses; curvax's ``psd_inv`` always uses Cholesky
    (kept for compatibility: the value is stored and reported only)."""
    global _USE_CHOLESKY_INVERSION
    _USE_CHOLESKY_INVERSION = bool(value)


def get_use_cholesky_inversion() -> bool:
    """The value set by ``set_use_cholesky_inversion`` (default ``True``; stored only); kfac-jax compatibility."""
    return _USE_CHOLESKY_INVERSION


def _check_square(name: str, matrix: Any) -> None:
    if np.ndim(matrix) != 2 or np.shape(matrix)[0] != np.shape(matrix)[1]:
        raise ValueError(f"{name}: expected a square matrix, got shape {np.shape(matrix)}.")


def psd_inv(matrix: jax.Array) -> jax.Array:
    """Inverse of a symmetric positive-definite matrix (``curvax.linalg.psd_inv``, kfac-jax name)."""
    _check_square("psd_inv", matrix)
    return linalg.psd_inv(matrix)


def psd_solve(matrix: jax.Array, vector: jax.Array) -> jax.Array:
    """Solves ``matrix x = vector`` for a PSD ``matrix`` (``curvax.linalg.psd_solve``, kfac-jax name)."""
    _check_square("psd_solve", matrix)
    return linalg.psd_solve(matrix, vector)


def psd_solve_maybe_zero_last_idx(a: jax.Array, b: jax.Array) -> jax.Array:
    """``psd_solve(a, b)``, except that when ``a``'s last row and column are zero the
    last unknown is set to 0 and the rest solved from the leading block."""
    _check_square("psd_solve_maybe_zero_last_idx", a)

    def without_last(a: jax.Array, b: jax.Array) -> jax.Array:
        x = linalg.psd_solve(a[:-1, :-1], b[:-1])
        return jnp.concatenate([x, jnp.zeros_like(b[-1:])], axis=0)

    zero_last = jnp.logical_and(jnp.all(a[-1] == 0), jnp.all(a[:, -1] == 0))
    return lax.cond(zero_last, without_last, linalg.psd_solve, a, b)


def safe_psd_eigh(x: jax.Array, force_on_host: bool = False) -> tuple[jax.Array, jax.Array]:
    """``(eigenvalues, eigenvectors)`` of a PSD matrix, eigenvalues clipped at 0
    (``curvax.linalg.safe_psd_eigh``; ``force_on_host`` is accepted and ignored)."""
    del force_on_host
    return linalg.safe_psd_eigh(x)


def psd_matrix_norm(matrix: jax.Array, norm_type: str = "avg_diag", method_2norm: str = "lobpcg", rng_key: Any = None) -> jax.Array:
    """A norm of a PSD matrix given as a square matrix, a vector (read as the diagonal of a
    diagonal matrix) or a scalar (a 1 x 1 matrix): kfac-jax v0.0.8's names ``"avg_diag"``
    (trace / dim), ``"trace"``, ``"median_diag"``, ``"median_eig"``, ``"one_over_dim"``,
    ``"1_norm"`` (largest absolute column sum), ``"2_norm"`` (largest eigenvalue),
    ``"avg_fro"`` (Frobenius / sqrt(dim)) and ``"fro"``; ``"1norm"`` and ``"2norm"`` are
    accepted for the two with an underscore (``curvax.linalg.psd_matrix_norm``).

    ``method_2norm`` and ``rng_key`` are accepted for kfac-jax compatibility; the 2-norm is
    computed exactly from the eigenvalues, not by LOBPCG or power iteration.
    """
    del method_2norm, rng_key
    try:
        return linalg.psd_matrix_norm(matrix, linalg.norm_type_name(norm_type))
    except ValueError as e:
        raise ValueError(f"psd_matrix_norm: {e}") from None


def _factor_norm(f: jax.Array) -> jax.Array:
    if np.size(f) == 1:
        return jnp.reshape(f, ())
    if np.ndim(f) == 1:
        return jnp.mean(f)
    return linalg.average_trace(f)


def pi_adjusted_kronecker_factors(*factors: jax.Array, damping: Numeric) -> tuple[jax.Array, ...]:
    """Damped factors ``F_i'`` with ``kron(F_i') ~= kron(F_i) + damping I`` (pi-adjusted damping).

    Factors may be matrices, diagonals (1-D) or scalars. Each non-scalar factor
    is normalised by its average diagonal ``n_i``, gets damping
    ``damping**(1/m) / c`` (``m`` non-scalar factors, ``c`` the geometric mean of
    the norms to the power ``k/m``), and is rescaled by the geometric mean of all
    norms, so the scale is shared equally (Martens & Grosse 2015, section 6.3).
    For two matrices the Kronecker product equals ``curvax.linalg.pi_adjusted_factors``'s.
    If any norm is not positive (and ``get_special_case_zero_inv()``) every factor
    becomes ``damping**(1/k)`` times identity, so the product is ``damping I``.
    """
    if not factors:
        raise ValueError("pi_adjusted_kronecker_factors: give at least one factor.")
    k = len(factors)
    norms = jnp.stack([_factor_norm(f) for f in factors])
    non_scalar = [np.size(f) != 1 for f in factors]
    m = sum(non_scalar)

    def regular() -> tuple[jax.Array, ...]:
        safe = jnp.where(norms > 0, norms, 1)
        geo = jnp.exp(jnp.mean(jnp.log(safe)))
        if m == 0:
            c_k = jnp.power(jnp.prod(norms) + damping, 1.0 / k)
            d_hat = 0.0
        else:
            c_k = geo
            d_hat = jnp.power(damping, 1.0 / m) / geo ** (float(k) / m)
        out = []
        for f, n, big in zip(factors, safe, non_scalar):
            if not big:
                out.append(jnp.ones_like(f) * c_k)
            elif np.ndim(f) == 2:
                out.append((f / n + d_hat * jnp.eye(f.shape[0], dtype=f.dtype)) * c_k)
            else:
                out.append((f / n + d_hat) * c_k)
        return tuple(o.astype(f.dtype) for o, f in zip(out, factors))

    def zero() -> tuple[jax.Array, ...]:
        c = jnp.power(damping, 1.0 / k)
        return tuple(
            (c * (jnp.eye(f.shape[0], dtype=f.dtype) if np.ndim(f) == 2 else jnp.ones_like(f))).astype(f.dtype)
            for f in factors
        )

    if get_special_case_zero_inv():
        return lax.cond(jnp.min(norms) > 0, regular, zero)
    return regular()


def invert_psd_matrices(matrices: Any) -> Any:
    """Inverts every leaf: matrices with ``psd_inv``, vectors/scalars elementwise."""
    return jax.tree_util.tree_map(lambda m: psd_inv(m) if np.ndim(m) == 2 else 1.0 / m, matrices)


def inverse_sqrt_psd_matrices(matrices: Any) -> Any:
    """``M^{-1/2}`` of every leaf: matrices by eigendecomposition, vectors/scalars elementwise."""
    return jax.tree_util.tree_map(
        lambda m: linalg.psd_matrix_power(m, -0.5) if np.ndim(m) == 2 else 1.0 / jnp.sqrt(m), matrices
    )


def pi_adjusted_kronecker_inverse(*factors: jax.Array, damping: Numeric) -> tuple[jax.Array, ...]:
    """The inverses of ``pi_adjusted_kronecker_factors(*factors, damping=damping)``:
    their Kronecker product is ``~ (kron(F_i) + damping I)^{-1}``."""
    return tuple(invert_psd_matrices(list(pi_adjusted_kronecker_factors(*factors, damping=damping))))


_ALPHABET = "abcdefghijklmnopqrstuvwx"


def kronecker_product_axis_mul_v(
    factors: Sequence[Any],
    v: jax.Array,
    axis_groups: Sequence[Sequence[int]] | None = None,
    transpose: bool | Sequence[bool] = False,
) -> jax.Array:
    """``kron(*factors) rvec(v)`` reshaped like ``v``: factor ``i`` acts on the axes of group ``i``.

    ``rvec`` is the row-major flattening; groups (default: one per axis) must be
    consecutive and cover ``v``'s axes. A ``None`` factor is the identity;
    ``transpose`` applies ``F_i^T`` instead.
    """
    groups = tuple((i,) for i in range(v.ndim)) if axis_groups is None else tuple(tuple(g) for g in axis_groups)
    if sum(groups, ()) != tuple(range(v.ndim)):
        raise ValueError(f"kronecker_product_axis_mul_v: axis_groups {groups} must be consecutive and cover v's {v.ndim} axes.")
    if len(factors) != len(groups):
        raise ValueError("kronecker_product_axis_mul_v: give one factor per axis group.")
    flags = [transpose] * len(factors) if isinstance(transpose, bool) else list(transpose)
    if len(flags) != len(factors):
        raise ValueError("kronecker_product_axis_mul_v: `transpose` must have one entry per factor.")
    out = v
    for group, f, t in zip(groups, factors, flags):
        if f is None:
            continue
        lo, hi = min(group), max(group)
        w = out.reshape(v.shape[:lo] + (-1,) + v.shape[hi + 1 :])
        w = jnp.moveaxis(jnp.tensordot(f.T if t else f, w, axes=[[1], [lo]]), 0, lo)
        out = w.reshape(v.shape)
    return out


def kronecker_eigen_basis_axis_mul_v(
    q_factors: Sequence[jax.Array],
    eigenvalues: jax.Array,
    v: jax.Array,
    axis_groups: Sequence[Sequence[int]] | None = None,
) -> jax.Array:
    """``Q diag(eigenvalues) Q^T rvec(v)`` with ``Q = kron(*q_factors)``; ``eigenvalues`` shaped like ``v``."""
    projected = kronecker_product_axis_mul_v(q_factors, v, axis_groups, True)
    if eigenvalues.shape != projected.shape:
        raise ValueError(
            f"kronecker_eigen_basis_axis_mul_v: eigenvalues must have shape {projected.shape}, got {eigenvalues.shape}."
        )
    return kronecker_product_axis_mul_v(q_factors, eigenvalues * projected, axis_groups)


def kronecker_product_mul_v(a: jax.Array, b: jax.Array, v: jax.Array, a_is_symmetric: bool) -> jax.Array:
    """``unvec((a kron b) vec(v))`` with column-major ``vec``: ``b v a^T`` (kfac-jax convention)."""
    del a_is_symmetric
    return kronecker_product_axis_mul_v([b, a], v)


def kronecker_eigen_basis_mul_v(q_a: jax.Array, q_b: jax.Array, eigenvalues: jax.Array, v: jax.Array) -> jax.Array:
    """``kronecker_product_mul_v`` in an eigen-basis: ``Q diag(eigenvalues) Q^T`` with ``Q = q_a kron q_b``."""
    return kronecker_eigen_basis_axis_mul_v([q_b, q_a], eigenvalues, v)


def tnt_scale(factors: Sequence[jax.Array]) -> jax.Array | float:
    """The scale making a TNT factorization's trace right: ``prod(tr F_i)^(-(k-1)/k)`` (1 if any trace <= 0)."""
    if len(factors) == 1:
        return 1.0
    traces = jnp.stack([jnp.trace(f) for f in factors])
    ok = jnp.min(traces) > 0
    mean_log = jnp.where(ok, jnp.mean(jnp.log(jnp.where(ok, traces, 1))), 0.0)
    return jnp.exp(-(len(factors) - 1) * mean_log)


def loop_and_parallelize_average(func: Callable[..., Any], max_parallel_size: int | None) -> Callable[..., Any]:
    """``f(*args)`` = the mean over the leading axis of ``func`` applied to each slice,
    computed ``vmap``-ed in chunks whose output has at most ``max_parallel_size`` elements."""
    vfunc = jax.vmap(func)

    @functools.wraps(func)
    def average(*args: Any) -> Any:
        sizes = {x.shape[0] for x in jax.tree_util.tree_leaves(args)}
        if len(sizes) != 1:
            raise ValueError(f"loop_and_parallelize_average: the arguments' leading sizes must agree, got {sizes}.")
        (n,) = sizes
        out_shape = jax.eval_shape(func, *jax.tree_util.tree_map(lambda x: x[0], args))
        per_item = max(1, sum(int(np.prod(o.shape)) for o in jax.tree_util.tree_leaves(out_shape)))
        chunk = n if max_parallel_size is None or per_item * n <= max_parallel_size else max(1, min(n, max_parallel_size // per_item))
        mean0 = lambda t: jax.tree_util.tree_map(lambda x: jnp.mean(x, axis=0), t)
        full = (n // chunk) * chunk
        head = jax.tree_util.tree_map(lambda x: x[:full], args)
        if full == chunk:
            total = mean0(vfunc(*head))
        else:
            stacked = jax.tree_util.tree_map(lambda x: x.reshape((full // chunk, chunk) + x.shape[1:]), head)

            def body(acc: Any, xs: Any) -> tuple[Any, None]:
                return jax.tree_util.tree_map(jnp.add, acc, mean0(vfunc(*xs))), None

            zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
            total = scalar_div(lax.scan(body, zeros, stacked)[0], full // chunk)
        if full == n:
            return total
        rest = mean0(vfunc(*jax.tree_util.tree_map(lambda x: x[full:], args)))
        return weighted_sum_of_objects([total, rest], [full / n, (n - full) / n])

    return average


# --- multiple devices (pmap) ----------------------------------------------------------


_pmap_mean_fn = jax.pmap(lambda x: lax.pmean(x, "i"), axis_name="i")
_pmap_sum_fn = jax.pmap(lambda x: lax.psum(x, "i"), axis_name="i")


def pmap_mean(obj: Any) -> Any:
    """The mean over devices of a device-stacked pytree (leading axis = local devices), replicated."""
    return obj if tree_is_empty(obj) else _pmap_mean_fn(obj)


def pmap_sum(obj: Any) -> Any:
    """The sum over devices of a device-stacked pytree, replicated."""
    return obj if tree_is_empty(obj) else _pmap_sum_fn(obj)


def using_legacy_pmap() -> bool:
    """Whether ``jax.pmap`` is the legacy implementation (kfac-jax helper)."""
    return not bool(jax.config.values.get("jax_pmap_shmap_merge", False))


def get_mean(obj: Any) -> Any:
    """The mean over devices of a device-stacked pytree, unstacked."""
    return get_first(pmap_mean(obj))


def get_sum(obj: Any) -> Any:
    """The sum over devices of a device-stacked pytree, unstacked."""
    return get_first(pmap_sum(obj))


def broadcast_all_local_devices(obj: Any, axis_name: str | None = None) -> Any:
    """Splits each leaf's leading axis (one entry per local device) across the local devices."""
    if tree_is_empty(obj):
        return obj
    sharding = _local_devices_sharding(axis_name)
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, sharding), obj)


def _local_devices_sharding(axis_name: str | None) -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()), (axis_name or "devices",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis_name or "devices"))


def replicate_all_local_devices(obj: Any, axis_name: str | None = None) -> Any:
    """A copy of ``obj`` on every local device, stacked on a new leading axis."""
    if tree_is_empty(obj):
        return obj
    n = jax.local_device_count()
    return broadcast_all_local_devices(jax.tree_util.tree_map(lambda x: jnp.stack([jnp.asarray(x)] * n), obj), axis_name)


def make_different_rng_key_on_all_devices(rng: jax.Array) -> jax.Array:
    """A different key per local device (and per process), stacked over the local devices."""
    rng = jax.random.fold_in(rng, jax.process_index())
    return broadcast_all_local_devices(jax.random.split(rng, jax.local_device_count()))


_p_split_fn = jax.pmap(lambda key: tuple(jax.random.split(key)))
_p_split_num_fns: dict[int, Callable[..., Any]] = {}


def p_split(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Splits a device-stacked key into two device-stacked keys."""
    return _p_split_fn(key)


def p_split_num(key: jax.Array, num: int) -> tuple[jax.Array, ...]:
    """Splits a device-stacked key into ``num`` device-stacked keys."""
    if num not in _p_split_num_fns:
        _p_split_num_fns[num] = jax.pmap(lambda k: tuple(jax.random.split(k, num)))
    return _p_split_num_fns[num](key)


def pmap_zeros_like(obj: Any) -> Any:
    """Zeros shaped like a device-stacked pytree, computed on the devices."""
    return obj if tree_is_empty(obj) else jax.pmap(lambda x: jax.tree_util.tree_map(jnp.zeros_like, x))(obj)


jit_zeros_like = jax.jit(tree_zeros_like)


def host_sync(obj: Any, sync_op: Callable[[Any, str], Any]) -> Any:
    """Combines ``obj`` across processes with ``sync_op`` (identity with a single process)."""
    if jax.process_count() == 1:
        return obj
    from jax.experimental import multihost_utils

    return _sync_gathered(multihost_utils.process_allgather(obj), sync_op)


def _sync_gathered(gathered: Any, sync_op: Callable[[Any, str], Any]) -> Any:
    """Applies ``sync_op`` (pmean, psum or all_gather) to values gathered from every process (axis 0)."""
    if sync_op is lax.pmean:
        return jax.tree_util.tree_map(lambda x: jnp.mean(x, axis=0), gathered)
    if sync_op is lax.psum:
        return jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), gathered)
    if sync_op is lax.all_gather:
        return gathered
    raise ValueError("host_sync: supported sync_op are lax.pmean, lax.psum and lax.all_gather.")


def host_all_gather(x: Any) -> Any:
    """The values of ``x`` from every process, stacked on a new leading axis (as is, with one process)."""
    return host_sync(x, lax.all_gather)


def host_mean(x: Any) -> Any:
    """The mean of ``x`` over processes."""
    return host_sync(x, lax.pmean)


_pmap_divide_mean_fn = jax.pmap(lambda v, c: lax.pmean(scalar_div(v, c), "i"), axis_name="i")


def pmap_sync_and_divide_value(value: Any, counter: Numeric, axis_name: str = "i") -> Any:
    """``value / counter`` averaged over devices, for device-stacked ``value`` and ``counter`` (replicated)."""
    del axis_name
    return _pmap_divide_mean_fn(value, counter)


@jax.jit
def jit_sync_and_divide_value(value: Any, counter: Numeric) -> Any:
    """``value / counter`` (the single-device counterpart of ``pmap_sync_and_divide_value``)."""
    return scalar_div(value, counter)


def copy_array(x: jax.Array) -> jax.Array:
    """A new buffer with ``x``'s values (so that the copy can be donated)."""
    return jnp.array(x, copy=True)


def copy_obj(obj: Any) -> Any:
    """``copy_array`` on every leaf (None passes through)."""
    return None if obj is None else jax.tree_util.tree_map(copy_array, obj)


def pmap_copy_obj(obj: Any) -> Any:
    """``copy_obj`` for a device-stacked pytree, run on the devices."""
    if obj is None or tree_is_empty(obj):
        return obj
    return jax.pmap(copy_obj)(obj)


def distribute_thunks(thunks: Sequence[Callable[[], Any]], pmap_axis_name: str) -> tuple[Any, ...]:
    """Evaluates thunk ``i`` on device ``i % n`` only and sums the results over devices,
    so every device gets every thunk's value while each computes about ``1/n`` of them."""
    if not in_pmap(pmap_axis_name):
        raise ValueError(f"distribute_thunks: must be called inside a pmap over axis {pmap_axis_name!r}.")
    n = lax.psum(1, pmap_axis_name)
    shapes = [jax.eval_shape(t) for t in thunks]
    zeros = lambda s: jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), s)

    def branch(d: int) -> Callable[[], tuple[Any, ...]]:
        return lambda: tuple(t() if i % n == d else zeros(s) for i, (t, s) in enumerate(zip(thunks, shapes)))

    out = lax.switch(lax.axis_index(pmap_axis_name), [branch(d) for d in range(n)])
    return lax.psum(out, pmap_axis_name)


def default_add_function(obj1: Any, obj2: Any, coeff1: Numeric, coeff2: Numeric) -> Any:
    """``coeff1 * obj1 + coeff2 * obj2`` leafwise."""
    return jax.tree_util.tree_map(lambda x, y: coeff1 * x + coeff2 * y, obj1, obj2)


def get_float_dtype_and_check_consistency(obj: Any) -> Any:
    """The common floating dtype of ``obj``'s leaves (None if it has none); raises if they differ
    or a leaf is not floating."""
    dtype = None
    for leaf in jax.tree_util.tree_leaves(obj):
        d = jnp.result_type(leaf)
        if not jnp.issubdtype(d, jnp.floating):
            raise ValueError(f"get_float_dtype_and_check_consistency: a leaf has non-float dtype {d}.")
        if dtype is not None and d != dtype:
            raise ValueError(f"get_float_dtype_and_check_consistency: leaves mix dtypes {dtype} and {d}.")
        dtype = d
    return dtype


class MultiChunkAccumulator:
    """A weighted sum of pytrees and its total weight, whose ``value`` is their weighted mean.

    ``add(x, w)`` does ``accumulator += w * x`` and ``weight += w``. With
    ``multi_device=True`` the arrays are device-stacked and ``value`` also
    averages over devices. A pytree (kfac-jax's ``utils.MultiChunkAccumulator``).
    """

    def __init__(self, init_obj_value: Any, weight: Numeric, multi_device: bool):
        self._accumulator = init_obj_value
        self._weight = weight
        self._multi_device = bool(multi_device)

    @property
    def accumulator(self) -> Any:
        return self._accumulator

    @property
    def weight(self) -> Numeric:
        return self._weight

    @property
    def multi_device(self) -> bool:
        return self._multi_device

    @property
    def value(self) -> Any:
        """``accumulator / weight`` (averaged over devices when ``multi_device``)."""
        if tree_is_empty(self._accumulator):
            return self._accumulator
        if self._multi_device:
            return pmap_sync_and_divide_value(self._accumulator, self._weight)
        return jit_sync_and_divide_value(self._accumulator, self._weight)

    def clear(self) -> None:
        self._accumulator = None
        self._weight = None

    def value_and_clear(self) -> Any:
        value = self.value
        self.clear()
        return value

    def add(self, value_obj: Any, weight: Numeric = 1) -> None:
        """``accumulator += weight * value_obj``; ``weight += weight``."""
        scaled = scalar_mul(value_obj, weight)
        if self._accumulator is None:
            self._accumulator = scaled
            if isinstance(weight, (int, float)):
                self._weight = jnp.full_like(self._weight, weight)
            elif np.shape(weight) != np.shape(self._weight):
                raise ValueError(
                    f"MultiChunkAccumulator.add: an array `weight` must have the accumulator's weight shape "
                    f"{np.shape(self._weight)}, got {np.shape(weight)}."
                )
            else:
                self._weight = weight
            return
        if tree_is_empty(self._accumulator) != tree_is_empty(scaled):
            raise ValueError("MultiChunkAccumulator.add: `value_obj` and the accumulator differ in emptiness.")
        if not tree_is_empty(scaled):
            self._accumulator = tree_add(self._accumulator, scaled)
        self._weight = self._weight + weight

    @classmethod
    def zeros_like(cls, obj: Any, multi_device: bool) -> "MultiChunkAccumulator":
        """An accumulator of zeros shaped like ``obj``, with zero weight."""
        weight = jnp.zeros([], dtype=jnp.int32)
        if multi_device:
            return cls(pmap_zeros_like(obj), replicate_all_local_devices(weight), True)
        return cls(obj if tree_is_empty(obj) else jit_zeros_like(obj), weight, False)

    @classmethod
    def empty(cls, multi_device: bool) -> "MultiChunkAccumulator":
        """An accumulator that takes its structure from the first ``add``."""
        weight = jnp.zeros([], dtype=jnp.int32)
        return cls(None, replicate_all_local_devices(weight) if multi_device else weight, multi_device)

    def copy(self) -> "MultiChunkAccumulator":
        return jax.tree_util.tree_map(lambda x: x, self)

    def __repr__(self) -> str:
        return f"MultiChunkAccumulator({self._accumulator!r}, {self._weight!r}, {self._multi_device})"


jax.tree_util.register_pytree_node(
    MultiChunkAccumulator,
    lambda a: ((a.accumulator, a.weight), (a.multi_device,)),
    lambda aux, children: MultiChunkAccumulator(*children, *aux),
)


class WithStagedMethods(Finalizable):
    """Mixin for classes with ``@staged`` methods (kfac-jax's ``utils.WithStagedMethods``).

    Compatibility name. A staged method runs under ``jax.jit`` (or ``jax.pmap``
    over ``pmap_axis_name`` when ``multi_device``); a staged method called from
    inside another runs inline, so nothing is compiled twice. ``debug=True``
    runs methods eagerly.
    """

    def __init__(self, multi_device: bool = False, pmap_axis_name: str | None = None, debug: bool = False, **parent_kwargs: Any):
        excluded = ("_in_staging",) + tuple(parent_kwargs.pop("excluded_attribute_names", ()))
        super().__init__(excluded_attribute_names=excluded, **parent_kwargs)
        if multi_device and not isinstance(pmap_axis_name, str):
            raise ValueError("WithStagedMethods: with multi_device=True, `pmap_axis_name` must be a string.")
        self._multi_device = bool(multi_device)
        self._pmap_axis_name = pmap_axis_name
        self._debug = bool(debug)
        self._in_staging = False

    @property
    def multi_device(self) -> bool:
        return self._multi_device

    @property
    def pmap_axis_name(self) -> str | None:
        return None if self._debug else self._pmap_axis_name

    @property
    def debug(self) -> bool:
        return self._debug

    @property
    def in_staging(self) -> bool:
        return self._in_staging

    @contextlib.contextmanager
    def staging_context(self) -> Iterator[None]:
        """Marks the instance as being staged (nested staged calls run inline)."""
        if self._in_staging:
            raise RuntimeError("WithStagedMethods: already in a staging context.")
        self._in_staging = True
        try:
            yield
        finally:
            self._in_staging = False

    def get_first(self, obj: Any) -> Any:
        return get_first(obj) if self._multi_device else obj

    def copy_obj(self, obj: Any) -> Any:
        return pmap_copy_obj(obj) if self._multi_device else copy_obj(obj)

    def replicate(self, obj: Any) -> Any:
        return replicate_all_local_devices(obj) if self._multi_device else obj

    def pmean_if_pmap_wrapper(self, func: Callable[..., Any]) -> Callable[..., Any]:
        if self._multi_device and not self._debug:
            return lambda *args, **kwargs: lax.pmean(func(*args, **kwargs), self.pmap_axis_name)
        return func


def staged(
    method: Callable[..., Any],
    static_argnums: int | Sequence[int] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
) -> Callable[..., Any]:
    """Makes a ``WithStagedMethods`` method compiled: ``jax.jit``, or ``jax.pmap`` when the instance is
    ``multi_device`` (scalar arguments broadcast). Argument numbers do not count ``self``."""
    static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums or ())
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums or ())
    static_all = (0,) + tuple(i + 1 for i in static)
    donate_all = tuple(i + 1 for i in donate)
    jitted = jax.jit(method, static_argnums=static_all, donate_argnums=donate_all)
    pmapped: dict[Any, Callable[..., Any]] = {}
    signature = inspect.signature(method)

    @functools.wraps(method)
    def decorated(instance: WithStagedMethods, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(instance, *args, **kwargs)
        bound.apply_defaults()
        args, kwargs = bound.args[1:], bound.kwargs
        if instance.in_staging:
            return method(instance, *args, **kwargs)
        with instance.staging_context():
            if instance.debug:
                with jax.disable_jit():
                    return method(instance, *args, **kwargs)
            if not instance.multi_device:
                return jitted(instance, *args, **kwargs)
            in_axes = (None,) + tuple(None if (i in static or _is_scalar(a)) else 0 for i, a in enumerate(args))
            key = (instance.pmap_axis_name, in_axes)
            if key not in pmapped:
                pmapped[key] = jax.pmap(
                    method, axis_name=instance.pmap_axis_name, in_axes=in_axes,
                    static_broadcasted_argnums=static_all, donate_argnums=donate_all,
                )
            return pmapped[key](instance, *args, **kwargs)

    return decorated


