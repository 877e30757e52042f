"""The operator base class, the parameter space it acts on, and composite operators.

A ``CurvatureOperator`` is an immutable pytree representing a square matrix acting on a
model's parameters. ``K @ v`` accepts a parameter pytree (returns one), a flat vector of
length ``K.dim`` (the parameters' leaves in pytree order, each flattened in C order: the
order of ``BlockDiagonalCurvature.to_dense_matrix``) or a ``(dim, k)`` matrix whose columns
are flat vectors. Scaling, sums and products build new operators without computing anything.

Methods without a closed form for an operator (e.g. ``logdet`` of a sum) fall back to the
dense matrix up to ``DENSE_FALLBACK_LIMIT`` parameters and raise beyond it, pointing to the
matrix-free estimators in ``curvax.operators.stochastic``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax import utils

Array = jax.Array

DENSE_FALLBACK_LIMIT = 4096
"""Largest ``dim`` for which methods without a closed form build the dense matrix."""


# ----------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------


def is_concrete(x: Any) -> bool:
    """Whether ``x`` has a value now (not a tracer inside ``jit``/``vmap``)."""
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x))


def check_damping(value: Any, name: str = "damping") -> Any:
    """A non-negative scalar damping (a Python float stays one, so that zero stays static).

    The check runs when the value is concrete (not inside ``jit``).
    """
    if isinstance(value, bool) or not (isinstance(value, (numbers.Real, np.ndarray, jax.Array))):
        raise TypeError(f"`{name}` must be a non-negative real number, got {value!r}.")
    if np.ndim(value) != 0:
        raise ValueError(f"`{name}` must be a scalar, got an array of shape {np.shape(value)}.")
    if is_concrete(value):
        v = float(value)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"`{name}` must be a finite number >= 0, got {v!r}.")
    return float(value) if isinstance(value, numbers.Real) else jnp.asarray(value)


def floored_damping(damping: Any, min_damping: Any) -> Any:
    """The damping ``inverse`` applies: ``max(damping, min_damping)`` (both checked >= 0).

    ``min_damping`` is a floor, the same rule as the K-FAC operator's exact inverse (and, per
    factor, its ``exact=False`` inverse): ``inverse(d, min_damping=m)`` is ``(K + max(d, m) I)^-1``.
    Python floats stay Python floats (a static zero stays static).
    """
    d = check_damping(damping)
    m = check_damping(min_damping, "min_damping")
    if isinstance(d, float) and isinstance(m, float):
        return max(d, m)
    if is_static_zero(m):
        return d
    return jnp.maximum(d, m)


def rank_tolerance(eigenvalues: Array, size: int) -> Array:
    """The threshold below which an eigenvalue of a decomposed PSD matrix counts as zero.

    ``size * eps * max(eigenvalues)`` with ``eps`` the dtype's machine epsilon and ``size`` the
    decomposed matrix's order: ``numpy.linalg.matrix_rank``'s default, the size of the round-off
    an eigendecomposition leaves on a zero eigenvalue.
    """
    eps = jnp.finfo(eigenvalues.dtype).eps
    return size * eps * jnp.max(jnp.abs(eigenvalues), initial=0.0)


def clamp_null(eigenvalues: Array, size: int | None = None) -> Array:
    """PSD eigenvalues with those at or below ``rank_tolerance`` (and negative round-off) set to exactly 0."""
    size = eigenvalues.size if size is None else size
    return jnp.where(eigenvalues <= rank_tolerance(eigenvalues, size), 0.0, eigenvalues).astype(eigenvalues.dtype)


def check_exact(exact: Any) -> bool:
    """``inverse``'s ``exact`` flag: a bool (a string such as ``"no"`` would be truthy)."""
    if not isinstance(exact, (bool, np.bool_)):
        raise TypeError(f"`exact` must be True or False, got {exact!r}.")
    return bool(exact)


def check_key(key: Any, name: str = "key") -> Any:
    """A ``jax.random`` key (typed, or a raw ``uint32[2]`` from ``PRNGKey``), or None."""
    if key is None:
        return None
    ok = isinstance(key, (jax.Array, np.ndarray)) and (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or (key.dtype == np.uint32 and key.shape == (2,))
    )
    if not ok:
        raise TypeError(f"`{name}` must be a jax.random key (jax.random.PRNGKey(seed) or jax.random.key(seed)), got {key!r}.")
    return key


def check_top_k(k: Any, dim: int, name: str = "k") -> int:
    """An integer ``1 <= k <= dim``."""
    if isinstance(k, bool) or not isinstance(k, (numbers.Integral, np.integer)):
        raise TypeError(f"`{name}` must be an integer in [1, {dim}], got {k!r}.")
    if not 1 <= int(k) <= dim:
        raise ValueError(f"`{name}` must be in [1, {dim}] (the operator's dim), got {int(k)}.")
    return int(k)


def is_static_zero(x: Any) -> bool:
    """Whether ``x`` is known now to be exactly zero."""
    return is_concrete(x) and float(x) == 0.0


def static_power(p: Any, name: str = "p") -> float | int:
    """A static real power, normalised to ``int`` when integral."""
    if isinstance(p, (jax.Array, np.ndarray)) and np.ndim(p) == 0 and is_concrete(p):
        p = float(p)
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not math.isfinite(float(p)):
        raise TypeError(f"`{name}` must be a static finite real number, got {p!r}.")
    p = float(p)
    return int(p) if p.is_integer() else p


# ----------------------------------------------------------------------------------
# Parameter space
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParameterSpace:
    """The structure, shapes and dtypes of the parameters an operator acts on (static, hashable)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def from_tree(cls, tree: Any) -> "ParameterSpace":
        """The space of ``tree`` (arrays or ``jax.ShapeDtypeStruct`` leaves)."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if not leaves:
            raise ValueError("The parameters have no array leaves.")
        return cls(treedef, tuple(tuple(np.shape(x)) for x in leaves), tuple(str(jnp.result_type(x)) for x in leaves))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(math.prod(s)) for s in self.shapes)

    @property
    def dim(self) -> int:
        return int(sum(self.sizes))

    @property
    def dtype(self) -> Any:
        """The dtype of flat vectors and dense matrices: the parameters' common dtype, at least
        float32 (a bfloat16 or float16 model's curvature is float32)."""
        return utils.at_least_float32(jnp.result_type(*self.dtypes))

    def template(self) -> Any:
        """The parameters as ``jax.ShapeDtypeStruct`` leaves."""
        return jax.tree_util.tree_unflatten(
            self.treedef, [jax.ShapeDtypeStruct(s, d) for s, d in zip(self.shapes, self.dtypes)]
        )

    def matches(self, tree: Any) -> bool:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return treedef == self.treedef and tuple(tuple(np.shape(x)) for x in leaves) == self.shapes

    def flatten(self, tree: Any) -> Array:
        """A parameter pytree as one flat vector (leaves in pytree order, C order)."""
        leaves = jax.tree_util.tree_leaves(tree)
        return jnp.concatenate([jnp.ravel(x).astype(self.dtype) for x in leaves])

    def unflatten(self, flat: Array) -> Any:
        """Inverse of ``flatten``; leaves get the parameters' dtypes."""
        parts = jnp.split(flat, np.cumsum(self.sizes)[:-1])
        leaves = [p.reshape(s).astype(d) for p, s, d in zip(parts, self.shapes, self.dtypes)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def describe(self) -> str:
        return f"a pytree {self.treedef} with leaf shapes {list(self.shapes)}, or a flat array of shape ({self.dim},) or ({self.dim}, k)"


# ----------------------------------------------------------------------------------
# Base class
# ----------------------------------------------------------------------------------


class CurvatureOperator:
    """A square matrix on the parameters, applied matrix-free (see the module docstring).

    Subclasses set ``space`` and implement ``_matvec_tree``; they override the spectral
    methods where a closed form exists. ``is_symmetric`` / ``is_psd`` describe the matrix.
    """

    space: ParameterSpace

    # --- description --------------------------------------------------------------

    @property
    def dim(self) -> int:
        return self.space.dim

    @property
    def shape(self) -> tuple[int, int]:
        return (self.dim, self.dim)

    @property
    def dtype(self) -> Any:
        return self.space.dtype

    @property
    def is_symmetric(self) -> bool:
        return True

    @property
    def is_psd(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"

    # --- products -------------------------------------------------------------------

    def _matvec_tree(self, tree: Any) -> Any:
        raise NotImplementedError

    def _matvec_flat(self, flat: Array) -> Array:
        return self.space.flatten(self._matvec_tree(self.space.unflatten(flat)))

    def mv(self, v: Any) -> Any:
        """``K v`` for a parameter pytree, a flat vector or a ``(dim, k)`` matrix of column vectors."""
        if isinstance(v, CurvatureOperator):
            raise TypeError("`v` is an operator; use `K1 @ K2` for the product operator.")
        if self.space.matches(v):
            return self._matvec_tree(v)
        if isinstance(v, (jax.Array, np.ndarray)) or hasattr(v, "shape"):
            shape = tuple(np.shape(v))
            if shape == (self.dim,):
                return self._matvec_flat(jnp.asarray(v))
            if len(shape) == 2 and shape[0] == self.dim:
                return jax.vmap(self._matvec_flat, in_axes=1, out_axes=1)(jnp.asarray(v))
            raise ValueError(f"`v` has shape {shape}; expected {self.space.describe()}.")
        raise ValueError(f"`v` does not match the parameters: expected {self.space.describe()}, got {jax.tree_util.tree_structure(v)}.")

    matvec = mv

    def __matmul__(self, other: Any) -> Any:
        if isinstance(other, CurvatureOperator):
            return ProductOperator.of(self, other)
        return self.mv(other)

    @property
    def T(self) -> "CurvatureOperator":
        """The transposed operator (the operator itself when symmetric)."""
        if self.is_symmetric:
            return self
        raise NotImplementedError(f"{type(self).__name__} has no transpose.")

    # --- algebra ----------------------------------------------------------------------

    def __mul__(self, scalar: Any) -> "CurvatureOperator":
        if isinstance(scalar, CurvatureOperator):
            raise TypeError("Use `K1 @ K2` for the product of two operators.")
        if np.ndim(scalar) != 0:
            raise ValueError(f"An operator can only be scaled by a scalar, got shape {np.shape(scalar)}.")
        known = bool(float(scalar) >= 0) if is_concrete(scalar) else None  # before jnp.asarray traces it
        return ScaledOperator(jnp.asarray(scalar), self, known)

    __rmul__ = __mul__

    def __truediv__(self, scalar: Any) -> "CurvatureOperator":
        return self * (1.0 / jnp.asarray(scalar))

    def __neg__(self) -> "CurvatureOperator":
        return self * -1.0

    def __add__(self, other: Any) -> "CurvatureOperator":
        if not isinstance(other, CurvatureOperator):
            return NotImplemented
        return SumOperator.of(self, other)

    def __sub__(self, other: Any) -> "CurvatureOperator":
        if not isinstance(other, CurvatureOperator):
            return NotImplemented
        return SumOperator.of(self, -other)

    def damped(self, damping: Any) -> "CurvatureOperator":
        """``K + damping I``."""
        return self + check_damping(damping) * IdentityOperator(self.space)

    # --- dense fallbacks ------------------------------------------------------------------

    def to_dense(self) -> Array:
        """The ``dim x dim`` matrix, column by column (``dim`` products, compiled once): small models only."""
        return _to_dense_compiled(self)

    def _to_dense_impl(self) -> Array:
        return jax.vmap(self._matvec_flat, in_axes=1, out_axes=1)(jnp.eye(self.dim, dtype=self.dtype))

    def _dense_for(self, what: str) -> Array:
        if self.dim > DENSE_FALLBACK_LIMIT:
            raise NotImplementedError(
                f"{type(self).__name__}.{what}: no closed form for this operator, and its dense {self.dim}x{self.dim} "
                f"matrix is above DENSE_FALLBACK_LIMIT={DENSE_FALLBACK_LIMIT}; use the matrix-free estimators in "
                "curvax.operators (hutchinson_trace, hutchpp_diagonal, lanczos_eigenvalues ...)."
            )
        return self.to_dense()

    def _dense_eigenvalues(self, what: str) -> Array:
        m = self._dense_for(what)
        if self.is_symmetric:
            return jnp.linalg.eigvalsh((m + m.T) / 2)
        raise NotImplementedError(f"{type(self).__name__}.{what}: the operator is not symmetric; use `to_dense()`.")

    # --- spectral quantities (defaults: dense) -------------------------------------------

    def diagonal(self) -> Array:
        """The diagonal, as a flat vector (``space.unflatten`` gives the pytree)."""
        return jnp.diagonal(self._dense_for("diagonal"))

    def trace(self) -> Array:
        return jnp.sum(self.diagonal())

    def frobenius_norm(self) -> Array:
        return jnp.linalg.norm(self._dense_for("frobenius_norm"))

    def eigenvalues(self) -> Array:
        """All eigenvalues, ascending (symmetric operators)."""
        return self._dense_eigenvalues("eigenvalues")

    def logdet(self, damping: Any = 0.0) -> Array:
        """``log det(K + damping I)`` (``-inf`` when singular, ``nan`` when the determinant is negative).

        Symmetric PSD operators: from the eigenvalues of the dense ``K + damping I``, ``-inf``
        when the smallest is at most ``dim * eps * largest`` (``rank_tolerance``: numerically
        singular). Others: ``slogdet``.
        """
        d = check_damping(damping)
        m = self._dense_for("logdet")
        m = m + d * jnp.eye(self.dim, dtype=m.dtype)
        if self.is_symmetric and self.is_psd:
            ev = jnp.linalg.eigvalsh((m + m.T) / 2)
            return jnp.where(ev[0] <= rank_tolerance(ev, self.dim), -jnp.inf, jnp.sum(jnp.log(jnp.abs(ev))))
        sign, value = jnp.linalg.slogdet(m)
        return jnp.where(sign > 0, value, jnp.where(sign == 0, -jnp.inf, jnp.nan))

    def det(self, damping: Any = 0.0) -> Array:
        """``det(K + damping I)``."""
        d = check_damping(damping)
        m = self._dense_for("det")
        return jnp.linalg.det(m + d * jnp.eye(self.dim, dtype=m.dtype))

    def inverse(self, damping: Any = 0.0, exact: bool = True, min_damping: Any = 0.0) -> "CurvatureOperator":
        """``(K + max(damping, min_damping) I)^-1`` as an operator (dense fallback for operators
        without a closed form). ``min_damping`` is a floor on the damping, as for the K-FAC
        operator; ``exact`` only matters for Kronecker-factored operators."""
        check_exact(exact)
        if isinstance(damping, (tuple, list)):
            raise TypeError(f"Per-factor (tuple) `damping` needs a Kronecker-factored operator, not {type(self).__name__}.")
        d = floored_damping(damping, min_damping)
        m = self._dense_for("inverse")
        m = m + d * jnp.eye(self.dim, dtype=m.dtype)
        if is_concrete(m):
            s = np.linalg.svd(np.asarray(m), compute_uv=False)
            if s[-1] <= self.dim * np.finfo(s.dtype).eps * max(s[0], np.finfo(s.dtype).tiny):
                raise ValueError(f"The operator plus `damping`={float(d)} I is singular; pass `damping` > 0.")
        return DenseOperator(jnp.linalg.inv(m), self.space, symmetric=self.is_symmetric, psd=self.is_psd)

    def eigenpairs(self, k: int, key: Any = None, num_iterations: int | None = None) -> tuple[Array, Array]:
        """The ``k`` largest eigenvalues (descending) and their unit eigenvectors.

        Returns ``(values, vectors)``: ``values`` of shape ``(k,)`` and ``vectors`` of shape
        ``(dim, k)``, flat columns in the operator's flat order (``K.space.unflatten(vectors[:, i])``
        is a parameter pytree). Matrix-free operators (exact GGN / Fisher / Hessian, sums ...) use
        Lanczos with full re-orthogonalisation (``lanczos_eigenpairs``: ``key`` the random start,
        ``num_iterations`` steps; exact when equal to ``dim``). Block-diagonal, dense, scaled and
        identity operators override this with exact closed forms (``key``/``num_iterations`` unused).
        """
        return lanczos_eigenpairs(self, k, key, num_iterations)

    def power(self, p: Any) -> "CurvatureOperator":
        """``K^p``: integer ``p >= 1`` as a product; other powers from the dense eigendecomposition."""
        p = static_power(p)
        if isinstance(p, int) and p >= 1:
            return ProductOperator((self,) * p) if p > 1 else self
        if not self.is_symmetric:
            raise NotImplementedError(f"{type(self).__name__}.power({p}): only integer powers >= 1 of a non-symmetric operator.")
        m = self._dense_for("power")
        s, q = jnp.linalg.eigh((m + m.T) / 2)
        return DenseOperator((q * s**p) @ q.T, self.space, symmetric=True, psd=True)


@jax.jit
def _to_dense_compiled(operator: CurvatureOperator) -> Array:
    return operator._to_dense_impl()


def _register(cls: type, data: Sequence[str], meta: Sequence[str]) -> type:
    return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))


def _same_space(ops: Sequence[CurvatureOperator]) -> ParameterSpace:
    space = ops[0].space
    for op in ops[1:]:
        if op.space != space:
            raise ValueError(
                f"Operators act on different parameters: {space.treedef} {list(space.shapes)} {list(space.dtypes)} vs "
                f"{op.space.treedef} {list(op.space.shapes)} {list(op.space.dtypes)}."
            )
    return space


# ----------------------------------------------------------------------------------
# Concrete simple operators
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class DenseOperator(CurvatureOperator):
    """An explicit ``dim x dim`` matrix (closed forms from the matrix itself)."""

    matrix: Array
    space: ParameterSpace
    symmetric: bool = True
    psd: bool = True

    def __post_init__(self) -> None:
        if tuple(np.shape(self.matrix)) != (self.space.dim, self.space.dim):
            raise ValueError(f"`matrix` has shape {np.shape(self.matrix)}, expected {(self.space.dim,) * 2}.")

    @property
    def is_symmetric(self) -> bool:
        return self.symmetric

    @property
    def is_psd(self) -> bool:
        return self.psd

    def _matvec_flat(self, flat: Array) -> Array:
        return self.matrix @ flat

    def _matvec_tree(self, tree: Any) -> Any:
        return self.space.unflatten(self._matvec_flat(self.space.flatten(tree)))

    def to_dense(self) -> Array:
        return self.matrix

    def _dense_for(self, what: str) -> Array:
        return self.matrix

    def eigenpairs(self, k: int, key: Any = None, num_iterations: int | None = None) -> tuple[Array, Array]:
        """The ``k`` largest eigenpairs from ``eigh`` of the matrix (symmetric only)."""
        if not self.symmetric:
            raise NotImplementedError("DenseOperator.eigenpairs: the matrix is not symmetric.")
        k = check_top_k(k, self.dim)
        s, q = jnp.linalg.eigh((self.matrix + self.matrix.T) / 2)
        return s[::-1][:k], q[:, ::-1][:, :k]

    @property
    def T(self) -> "DenseOperator":
        return self if self.symmetric else DenseOperator(self.matrix.T, self.space, False, self.psd)


_register(DenseOperator, ["matrix"], ["space", "symmetric", "psd"])


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class IdentityOperator(CurvatureOperator):
    """The identity on the parameters."""

    space: ParameterSpace

    def _matvec_tree(self, tree: Any) -> Any:
        return tree

    def _matvec_flat(self, flat: Array) -> Array:
        return flat

    def diagonal(self) -> Array:
        return jnp.ones(self.dim, self.dtype)

    def trace(self) -> Array:
        return jnp.asarray(self.dim, self.dtype)

    def frobenius_norm(self) -> Array:
        return jnp.sqrt(jnp.asarray(self.dim, self.dtype))

    def eigenvalues(self) -> Array:
        return jnp.ones(self.dim, self.dtype)

    def logdet(self, damping: Any = 0.0) -> Array:
        return self.dim * jnp.log1p(jnp.asarray(check_damping(damping), self.dtype))

    def det(self, damping: Any = 0.0) -> Array:
        return jnp.exp(self.logdet(damping))

    def inverse(self, damping: Any = 0.0, exact: bool = True, min_damping: Any = 0.0) -> CurvatureOperator:
        """``(1 + max(damping, min_damping))^-1 I``."""
        check_exact(exact)
        if isinstance(damping, (tuple, list)):
            raise TypeError("Per-factor (tuple) `damping` needs a Kronecker-factored operator, not IdentityOperator.")
        return ScaledOperator(jnp.asarray(1.0 / (1.0 + floored_damping(damping, min_damping)), self.dtype), self)

    def power(self, p: Any) -> CurvatureOperator:
        static_power(p)
        return self

    def eigenpairs(self, k: int, key: Any = None, num_iterations: int | None = None) -> tuple[Array, Array]:
        """Eigenvalues 1 with the first ``k`` unit vectors (any orthonormal set is an eigenbasis)."""
        k = check_top_k(k, self.dim)
        return jnp.ones(k, self.dtype), jnp.eye(self.dim, k, dtype=self.dtype)


_register(IdentityOperator, [], ["space"])


def identity(space_or_operator: Any) -> IdentityOperator:
    """The identity on the parameters of an operator, a ``ParameterSpace`` or a parameter pytree."""
    if isinstance(space_or_operator, CurvatureOperator):
        return IdentityOperator(space_or_operator.space)
    if isinstance(space_or_operator, ParameterSpace):
        return IdentityOperator(space_or_operator)
    return IdentityOperator(ParameterSpace.from_tree(space_or_operator))


def dense(matrix: Any, params: Any, symmetric: bool = True, psd: bool = True) -> DenseOperator:
    """An explicit matrix as an operator on parameters shaped like ``params``."""
    space = params if isinstance(params, ParameterSpace) else ParameterSpace.from_tree(params)
    return DenseOperator(jnp.asarray(matrix), space, bool(symmetric), bool(psd))


# ----------------------------------------------------------------------------------
# Composite operators
# ----------------------------------------------------------------------------------


def _positive_scale(scale: Array, what: str) -> None:
    if is_concrete(scale) and not float(scale) > 0:
        raise NotImplementedError(f"ScaledOperator.{what} has a closed form for positive scales only, got {float(scale)}.")


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ScaledOperator(CurvatureOperator):
    """``scale * K``. Spectral closed forms of ``K`` carry over (positive ``scale`` for logdet/inverse/power)."""

    scale: Array
    operator: CurvatureOperator
    # whether ``scale >= 0``, recorded (static) when the scale is known at construction, so that
    # ``is_psd`` survives ``jit`` (where the scale is traced); None when unknown
    nonnegative: bool | None = None

    def __post_init__(self) -> None:
        if self.nonnegative is None and is_concrete(self.scale):
            object.__setattr__(self, "nonnegative", bool(float(self.scale) >= 0))

    @property
    def space(self) -> ParameterSpace:  # type: ignore[override]
        return self.operator.space

    @property
    def is_symmetric(self) -> bool:
        return self.operator.is_symmetric

    @property
    def is_psd(self) -> bool:
        return self.operator.is_psd and bool(self.nonnegative)

    def _matvec_tree(self, tree: Any) -> Any:
        return jax.tree_util.tree_map(lambda x: (self.scale * x).astype(x.dtype), self.operator._matvec_tree(tree))

    def _matvec_flat(self, flat: Array) -> Array:
        return (self.scale * self.operator._matvec_flat(flat)).astype(flat.dtype)

    @property
    def T(self) -> CurvatureOperator:
        return ScaledOperator(self.scale, self.operator.T, self.nonnegative)

    def to_dense(self) -> Array:
        return self.scale * self.operator.to_dense()

    def diagonal(self) -> Array:
        return self.scale * self.operator.diagonal()

    def trace(self) -> Array:
        return self.scale * self.operator.trace()

    def frobenius_norm(self) -> Array:
        return jnp.abs(self.scale) * self.operator.frobenius_norm()

    def eigenvalues(self) -> Array:
        return jnp.sort(self.scale * self.operator.eigenvalues())

    def logdet(self, damping: Any = 0.0) -> Array:
        # log det(s K + d I) = n log s + log det(K + (d / s) I) for s > 0.
        _positive_scale(self.scale, "logdet")
        d = check_damping(damping)
        return self.dim * jnp.log(self.scale) + self.operator.logdet(d / self.scale)

    def det(self, damping: Any = 0.0) -> Array:
        return jnp.exp(self.logdet(damping))

    def inverse(self, damping: Any = 0.0, exact: bool = True, min_damping: Any = 0.0) -> CurvatureOperator:
        # (s K + d I)^-1 = s^-1 (K + (d / s) I)^-1 for s > 0.
        # Per-factor dampings (and their floor) scale with sqrt(s): s (A + a I) (x) (G + g I) has
        # factors sqrt(s) A + sqrt(s) a I and sqrt(s) G + sqrt(s) g I.
        check_exact(exact)
        _positive_scale(self.scale, "inverse")
        floor = check_damping(min_damping, "min_damping")
        if isinstance(damping, tuple):
            inner = tuple(check_damping(x, "damping") / jnp.sqrt(self.scale) for x in damping)
        else:
            inner = check_damping(damping) / self.scale
        floor = floor / self.scale if exact else floor / jnp.sqrt(self.scale)
        return ScaledOperator(1.0 / self.scale, self.operator.inverse(inner, exact, floor), self.nonnegative)

    def power(self, p: Any) -> CurvatureOperator:
        p = static_power(p)
        if not (isinstance(p, int) and p >= 1):
            _positive_scale(self.scale, "power")
        even = isinstance(p, int) and p % 2 == 0
        return ScaledOperator(self.scale**p, self.operator.power(p), True if even else self.nonnegative)

    def eigenpairs(self, k: int, key: Any = None, num_iterations: int | None = None) -> tuple[Array, Array]:
        """The inner operator's top ``k`` pairs, values scaled (scales known >= 0; Lanczos otherwise)."""
        if self.nonnegative:
            values, vectors = self.operator.eigenpairs(k, key, num_iterations)
            return self.scale * values, vectors
        return super().eigenpairs(k, key, num_iterations)


_register(ScaledOperator, ["scale", "operator"], ["nonnegative"])


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class _Composite(CurvatureOperator):
    """Operators combining ``operators`` on one parameter space (sums and products)."""

    operators: tuple

    @classmethod
    def of(cls, *ops: CurvatureOperator) -> Any:
        """The combination of ``ops``, nested combinations of the same kind flattened."""
        flat: list[CurvatureOperator] = []
        for op in ops:
            flat.extend(op.operators if isinstance(op, cls) else (op,))
        _same_space(flat)
        return cls(tuple(flat))

    @property
    def space(self) -> ParameterSpace:  # type: ignore[override]
        return self.operators[0].space


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class SumOperator(_Composite):
    """``K_1 + ... + K_n``: products, diagonal and trace term by term; the rest dense."""

    @property
    def is_symmetric(self) -> bool:
        return all(op.is_symmetric for op in self.operators)

    @property
    def is_psd(self) -> bool:
        return all(op.is_psd for op in self.operators)

    def _matvec_tree(self, tree: Any) -> Any:
        outs = [op._matvec_tree(tree) for op in self.operators]
        return jax.tree_util.tree_map(lambda *xs: sum(xs[1:], xs[0]), *outs)

    def _matvec_flat(self, flat: Array) -> Array:
        return sum((op._matvec_flat(flat) for op in self.operators[1:]), self.operators[0]._matvec_flat(flat))

    @property
    def T(self) -> CurvatureOperator:
        return SumOperator(tuple(op.T for op in self.operators))

    def diagonal(self) -> Array:
        return sum((op.diagonal() for op in self.operators[1:]), self.operators[0].diagonal())

    def trace(self) -> Array:
        return sum((op.trace() for op in self.operators[1:]), self.operators[0].trace())


_register(SumOperator, ["operators"], [])


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ProductOperator(_Composite):
    """``K_1 K_2 ... K_n`` (``K_n`` applied first): ``det``/``logdet`` multiply; the rest dense."""

    @property
    def is_symmetric(self) -> bool:
        return len(set(map(id, self.operators))) == 1 and self.operators[0].is_symmetric

    @property
    def is_psd(self) -> bool:
        return self.is_symmetric and (len(self.operators) % 2 == 0 or self.operators[0].is_psd)

    def _matvec_tree(self, tree: Any) -> Any:
        for op in reversed(self.operators):
            tree = op._matvec_tree(tree)
        return tree

    def _matvec_flat(self, flat: Array) -> Array:
        for op in reversed(self.operators):
            flat = op._matvec_flat(flat)
        return flat

    @property
    def T(self) -> CurvatureOperator:
        return ProductOperator(tuple(op.T for op in reversed(self.operators)))

    def logdet(self, damping: Any = 0.0) -> Array:
        d = check_damping(damping)
        if is_static_zero(d):
            return sum((op.logdet() for op in self.operators[1:]), self.operators[0].logdet())
        return super().logdet(d)

    def det(self, damping: Any = 0.0) -> Array:
        d = check_damping(damping)
        if is_static_zero(d):
            out = self.operators[0].det()
            for op in self.operators[1:]:
                out = out * op.det()
            return out
        return super().det(d)


_register(ProductOperator, ["operators"], [])


# Lanczos eigenpairs: the default ``eigenpairs`` of matrix-free operators (also public as
# ``curvax.operators.lanczos_eigenpairs``); here, beside the base class, so that the operators
# need no import of the stochastic estimators.

def _lanczos_basis(operator: "CurvatureOperator", key: Array, m: int) -> tuple[Array, Array, Array]:
    """``m`` Lanczos steps from a random start with full re-orthogonalisation (twice per step).

    On breakdown (an invariant subspace found, ``beta`` below ``dim * eps`` times the largest
    ``|alpha|``), the next vector is a fresh random one orthogonalised against the basis, with
    ``beta = 0``: the tridiagonal matrix then splits and the basis still grows to ``m``
    orthonormal vectors. Returns the basis ``(m, dim)``, ``alpha`` ``(m,)`` and ``beta`` ``(m - 1,)``.
    """
    dim, dtype = operator.dim, operator.dtype
    k0, k1 = jax.random.split(key)
    v0 = jax.random.normal(k0, (dim,), dtype)
    basis = jnp.zeros((m, dim), dtype).at[0].set(v0 / jnp.linalg.norm(v0))
    eps = jnp.finfo(dtype).eps

    def orth(w: Array, basis: Array) -> Array:
        for _ in range(2):
            w = w - basis.T @ (basis @ w)
        return w

    def step(i: Array, carry: tuple) -> tuple:
        basis, alpha, beta = carry
        v = basis[i]
        w = operator.mv(v)
        a = jnp.dot(w, v)
        alpha = alpha.at[i].set(a)
        w = orth(w, basis)
        b = jnp.linalg.norm(w)
        broke = b <= dim * eps * jnp.maximum(jnp.max(jnp.abs(alpha)), jnp.finfo(dtype).tiny)
        fresh = orth(jax.random.normal(jax.random.fold_in(k1, i), (dim,), dtype), basis)
        nxt = jnp.where(broke, fresh / jnp.linalg.norm(fresh), w / jnp.where(broke, 1, b))
        basis = jnp.where(i + 1 < m, basis.at[jnp.minimum(i + 1, m - 1)].set(nxt), basis)
        return basis, alpha, beta.at[i].set(jnp.where(broke, 0, b))

    basis, alpha, beta = jax.lax.fori_loop(0, m, step, (basis, jnp.zeros(m, dtype), jnp.zeros(m, dtype)))
    return basis, alpha, beta[:-1]


def lanczos_eigenpairs(
    operator: "CurvatureOperator", k: int, key: Array | None = None, num_iterations: int | None = None
) -> tuple[Array, Array]:
    """The ``k`` largest eigenvalues (descending) and their eigenvectors by Lanczos.

    ``num_iterations`` steps (default ``min(dim, max(2 k + 20, 40))``) with full
    re-orthogonalisation and restarts on breakdown (``_lanczos_basis``) from a random start
    (``key``, default ``PRNGKey(0)``); the Ritz pairs of the tridiagonal matrix. Exact (to
    round-off) when ``num_iterations == dim``; otherwise each Ritz value is a lower bound of its
    eigenvalue, converging fastest for the largest well-separated ones (see
    ``lanczos_eigenvalues``). Returns ``(values (k,), vectors (dim, k))``: flat unit vectors
    (``operator.space.unflatten`` of a column gives a parameter pytree). Symmetric operators only.
    """
    if not isinstance(operator, CurvatureOperator):
        raise TypeError(f"`operator` must be a curvax.operators.CurvatureOperator, got {type(operator).__name__}.")
    if not operator.is_symmetric:
        raise NotImplementedError(f"{type(operator).__name__}.eigenpairs: the operator is not symmetric.")
    k = check_top_k(k, operator.dim)
    if num_iterations is None:
        m = min(operator.dim, max(2 * k + 20, 40))
    else:
        if isinstance(num_iterations, bool) or not isinstance(num_iterations, (numbers.Integral, np.integer)):
            raise TypeError(f"`num_iterations` must be an integer, got {num_iterations!r}.")
        m = int(num_iterations)
        if m > operator.dim:
            raise ValueError(f"`num_iterations` must be <= the operator's dim {operator.dim}, got {m}.")
        if m < k:
            raise ValueError(f"`num_iterations` ({m}) must be >= `k` ({k}).")
    key = jax.random.PRNGKey(0) if check_key(key) is None else key
    basis, alpha, beta = _lanczos_basis(operator, key, m)
    theta, y = jnp.linalg.eigh(jnp.diag(alpha) + jnp.diag(beta, 1) + jnp.diag(beta, -1))
    order = jnp.argsort(-theta)[:k]
    vectors = basis.T @ y[:, order]
    return theta[order], vectors / jnp.linalg.norm(vectors, axis=0, keepdims=True)
