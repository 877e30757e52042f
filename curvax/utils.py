"""Small pytree, batch and device helpers used across curvax (and by user code, as in kfac-jax).

This module imports no other curvax module, so every layer can use it. It is
also kfac-jax's ``utils`` module: ``curvax/__init__.py`` adds kfac-jax's other
``utils`` names (``curvax.kfac_api.utils_names``) to it.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Params = Any
Batch = Any
FuncArgs = Sequence[Any]


def inner_product(obj1: Any, obj2: Any, in_float64: bool = False) -> jax.Array:
    """Sum over leaves of ``sum(a * b)``; the two pytrees must have the same structure.

    Half-precision leaves are multiplied and summed in float32 (the result is float32).

    ``in_float64=True`` accumulates in float64 (when x64 is available) and
    returns the result in the leaves' dtype (kfac-jax's keyword).
    """
    l1, t1 = jax.tree_util.tree_flatten(obj1)
    l2, t2 = jax.tree_util.tree_flatten(obj2)
    if t1 != t2:
        raise ValueError(f"inner_product: the two pytrees differ in structure:\n{t1}\nvs\n{t2}")
    if not l1:
        return jnp.zeros([])
    if in_float64:
        dtype = jnp.result_type(*l1, *l2)
        with jax.enable_x64(True):
            total = sum(jnp.sum(a.astype(jnp.float64) * b.astype(jnp.float64)) for a, b in zip(l1, l2))
        return total.astype(dtype)
    # Half-precision leaves (bfloat16/float16 parameters) are multiplied and summed in float32:
    # the scalar products choose the step's coefficients. Wider leaves are left untouched.
    return sum(jnp.sum(widen_half(a) * widen_half(b)) for a, b in zip(l1, l2))


def widen_half(x: Any) -> Any:
    """``x`` in float32 when it is a half-precision (bfloat16/float16) array, else ``x`` itself,
    untouched: the scalar products of a half-precision model's step are taken in float32."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return x.astype(jnp.float32)
    return x


def squared_norm(obj: Any) -> jax.Array:
    """The squared Euclidean norm of a pytree: the sum of its leaves' squared entries."""
    return inner_product(obj, obj)


def norm(obj: Any) -> jax.Array:
    """The Euclidean (Frobenius) norm of a pytree, over all its leaves together."""
    return jnp.sqrt(squared_norm(obj))


def scalar_mul(obj: Any, scalar: Any) -> Any:
    """Every leaf of ``obj`` multiplied by ``scalar``."""
    return jax.tree_util.tree_map(lambda x: x * scalar, obj)


def tree_add(a: Any, b: Any) -> Any:
    """The leaf-wise sum ``a + b`` of two pytrees with the same structure."""
    return jax.tree_util.tree_map(jnp.add, a, b)


def weighted_sum_of_objects(objects: Sequence[Any], coefficients: Sequence[Any]) -> Any:
    """``sum_i c_i * obj_i`` over pytrees of the same structure."""
    if len(objects) != len(coefficients):
        raise ValueError("weighted_sum_of_objects: objects and coefficients differ in length.")
    return jax.tree_util.tree_map(lambda *xs: sum(c * x for c, x in zip(coefficients, xs)), *objects)


def matrix_of_inner_products(vectors: Sequence[Any], ip_function: Callable[[Any, Any], Any] = inner_product) -> jax.Array:
    """The Gram matrix ``M[i, j] = ip_function(v_i, v_j)`` (each pair computed once; symmetric)."""
    n = len(vectors)
    rows: list[list[Any]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(i, n):
            rows[i][j] = rows[j][i] = ip_function(vectors[i], vectors[j])
    return jnp.array(rows) if n else jnp.zeros((0, 0))


def vector_of_inner_products(
    base: Any, vectors: Sequence[Any], ip_function: Callable[[Any, Any], Any] = inner_product
) -> jax.Array:
    """``[ip_function(base, v) for v in vectors]`` as an array."""
    return jnp.stack([ip_function(base, v) for v in vectors])


def check_int(value: Any, name: str, minimum: int) -> int:
    """``value`` as an int, or a ValueError naming ``name`` unless it is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def check_number(value: Any, name: str, low: float, high: float = math.inf, *, low_open: bool = False,
                 high_open: bool = True) -> float:
    """``value`` as a float, or a ValueError naming ``name`` unless it is a real number in the interval."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
    if ok:
        v = float(value)
        ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"`{name}` must be a number in {interval}, got {value!r}.")
    return float(value)


def check_float_params(params: Any, arg_name: str = "params") -> None:
    """Parameters must be real floating-point arrays (bfloat16, float16, float32 or float64).

    Integer and boolean leaves have no gradient to precondition; complex ones are refused
    because the curvature blocks are real symmetric matrices (their factors, eigenvalues and
    damping assume real parameters). Half-precision parameters train with float32 curvature
    statistics by default (see ``at_least_float32``).
    """
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
        raise ValueError(f"`{arg_name}` has no array leaves.")
    for path, leaf in leaves:
        where = f"`{arg_name}`{jax.tree_util.keystr(path)}"
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"{where} has dtype {dtype}: complex parameters are not supported, because the curvature "
                "blocks are real symmetric matrices (Fisher/GGN factors of real parameters). Split it into "
                "real and imaginary float parameters."
            )
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"{where} has dtype {dtype}: curvax needs floating-point parameters, because an integer or "
                "boolean leaf has no gradient to precondition. Move it out of the parameters (into the batch "
                "or the function's state)."
            )


def at_least_float32(dtype: Any) -> Any:
    """``dtype`` promoted to at least float32: bfloat16 and float16 give float32, wider dtypes
    stay as they are. The default dtype of curvature statistics: sums of outer products in
    half precision would keep only 8 (bfloat16) or 11 (float16) bits, and the factorisations
    (eigh, Cholesky) have no half-precision kernels."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.dtype(jnp.float32)
    return dtype


def check_curvature_dtype(value: Any, name: str) -> Any:
    """``value`` (None, ``jnp.float32``/``"float32"`` or float64) as a numpy dtype, or None.

    The dtypes of curvature statistics and of their decompositions must be float32 or float64:
    half precision is refused (no eigh/Cholesky kernels, and sums of outer products would lose
    their low bits), and float64 only with ``jax_enable_x64`` (JAX would silently give float32).
    """
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in ("float32", "float64"):
        raise ValueError(
            f"`{name}` must be None (float32 for half-precision parameters, the parameters' dtype "
            f"otherwise), float32 or float64, got {value!r}. Half precision is not accepted: the "
            "decompositions (eigh, Cholesky) need float32 or float64."
        )
    if dtype == jnp.float64 and jax.dtypes.canonicalize_dtype(jnp.float64) != jnp.float64:
        raise ValueError(
            f"`{name}`=float64 needs 64-bit JAX: set jax.config.update('jax_enable_x64', True) before "
            "building the optimizer (JAX would silently compute in float32 otherwise)."
        )
    return dtype


def check_rng(rng: Any, name: str = "rng") -> None:
    """A clear error unless ``rng`` is a JAX PRNG key: a typed key (``jax.random.key``) or a raw
    ``uint32`` key array (``jax.random.PRNGKey``), possibly with leading (device) axes."""
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return
    if dtype is not None and np.dtype(dtype) == np.uint32 and np.ndim(rng) >= 1:
        return
    desc = f"an array of shape {np.shape(rng)} and dtype {dtype}" if dtype is not None else type(rng).__name__
    raise TypeError(f"`{name}` must be a JAX PRNG key (jax.random.PRNGKey(seed) or jax.random.key(seed)), got {desc}.")


def check_damping(value: Any, name: str, l2_reg: float, allow_zero: bool = False) -> None:
    """Rejects a damping that makes every update degenerate; values only known under ``jit`` pass.

    Negative damping is never valid. Zero damping is valid when ``l2_reg > 0`` (the identity
    weight ``damping + l2_reg`` stays positive, as kfac-jax allows); with ``l2_reg == 0`` it
    would invert the curvature undamped, singular whenever a batch has fewer examples than a
    layer has inputs, so every update would be skipped: that is refused too, unless
    ``allow_zero`` (kfac-jax's ``OptaxPreconditioner`` is also used only to compute curvature,
    with ``damping=0``): then it is a warning, and non-finite updates are skipped as always.
    """
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # a tracer (or something the scalar conversion reports on itself)
    if arr.size == 0:
        return
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
    if np.any(arr + float(l2_reg) <= 0):
        if allow_zero:
            warnings.warn(
                f"`{name}`=0 with l2_reg=0: the curvature is inverted undamped; where it is singular the "
                "preconditioned update is not finite and is skipped. Pass a positive damping to precondition.",
                UserWarning,
                stacklevel=3,
            )
            return
        raise ValueError(
            f"`{name}`=0 with l2_reg=0 would invert the curvature undamped (singular for most batches, so every "
            f"update would be skipped); pass a positive `{name}` (e.g. 1e-3) or l2_reg > 0."
        )


def tree_spec(tree: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], str], ...]]:
    """The structure, shapes and dtypes of ``tree`` (arrays or tracers): what a compiled step depends on."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves)


def default_batch_size_extractor(batch: Batch) -> int:
    """The size of the leading axis of the batch's first leaf (static)."""
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise ValueError("The batch has no array leaves; cannot infer the batch size.")
    shape = np.shape(leaves[0])
    if not shape:
        raise ValueError("The batch's first leaf is a scalar; cannot infer the batch size.")
    return int(shape[0])


def check_batch_leading_sizes(batch: Batch, arg_name: str = "batch") -> None:
    """Raises a clear error when batch leaves disagree on their leading size."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(batch)
    sizes = {}
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if shape:
            sizes[jax.tree_util.keystr(path) or "<root>"] = int(shape[0])
    if len(set(sizes.values())) > 1:
        desc = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(f"All leaves of `{arg_name}` must have the same leading (batch) size; got {desc}.")
    if sizes and set(sizes.values()) == {0}:
        raise ValueError(f"`{arg_name}` is empty (batch size 0): it needs at least one example.")


def subsample_batch(batch: Batch, fraction: float, key: jax.Array) -> Batch:
    """``ceil(fraction * n)`` examples of ``batch`` drawn without replacement by ``key``.

    Rows are taken along the leading (batch) axis of every leaf, in increasing order; leaves
    without a leading axis are kept. The batch itself comes back when every example is kept.
    The sizes are static, so the result has a fixed shape under ``jit``.
    """
    if not 0.0 < float(fraction) <= 1.0:
        raise ValueError(f"`fraction` must be in (0, 1], got {fraction!r}.")
    sizes = {np.shape(leaf)[0] for leaf in jax.tree_util.tree_leaves(batch) if np.ndim(leaf) > 0}
    if len(sizes) > 1:
        check_batch_leading_sizes(batch)
    if not sizes:
        return batch
    (n,) = sizes
    m = max(1, math.ceil(round(fraction * n, 9)))  # 0.07 * 100 is 7.000000000000001: 7 examples
    if m >= n:
        return batch
    rows = jnp.sort(jax.random.choice(key, n, (m,), replace=False))
    return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0) if np.ndim(x) > 0 else x, batch)


def first_dim_is_size(size: int, *arrays: jax.Array) -> bool:
    """Whether every array in ``arrays`` has leading dimension ``size``."""
    return all(a.shape[0] == size for a in arrays)


def tree_zeros_like(obj: Any) -> Any:
    """A pytree of zeros with the structure, shapes and dtypes of ``obj``."""
    return jax.tree_util.tree_map(jnp.zeros_like, obj)


def param_paths(params: Params) -> list[str]:
    """Readable '/'-joined names for each leaf of a parameter pytree, in leaf order."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        parts = []
        for k in path:
            if isinstance(k, jax.tree_util.DictKey):
                parts.append(str(k.key))
            elif isinstance(k, jax.tree_util.SequenceKey):
                parts.append(str(k.idx))
            elif isinstance(k, jax.tree_util.GetAttrKey):
                parts.append(str(k.name))
            else:
                parts.append(str(k))
        out.append("/".join(parts) or "<root>")
    return out


Schedule = Callable[[Any], Any]


# --- multiple devices (pmap) ----------------------------------------------------------


def in_pmap(axis_name: str | None) -> bool:
    """Whether the code is being traced inside a ``pmap`` (or ``shard_map``) binding ``axis_name``."""
    if axis_name is None:
        return False
    try:
        lax.axis_index(axis_name)
    except NameError:
        return False
    return True


def wrap_if_pmap(p_func: Callable[[Any, str], Any]) -> Callable[[Any, str | None], Any]:
    """``f(obj, axis_name)``: ``p_func(obj, axis_name)`` inside a pmap over ``axis_name``, else ``obj``."""

    @functools.wraps(p_func)
    def wrapped(obj: Any, axis_name: str | None) -> Any:
        return p_func(obj, axis_name) if in_pmap(axis_name) else obj

    return wrapped


def pmean_if_pmap(obj: Any, axis_name: str | None) -> Any:
    """``lax.pmean(obj, axis_name)`` inside a pmap over ``axis_name``, ``obj`` otherwise."""
    return lax.pmean(obj, axis_name) if in_pmap(axis_name) else obj


def psum_if_pmap(obj: Any, axis_name: str | None) -> Any:
    """``lax.psum(obj, axis_name)`` inside a pmap over ``axis_name``, ``obj`` otherwise."""
    return lax.psum(obj, axis_name) if in_pmap(axis_name) else obj


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float)) or (hasattr(x, "shape") and x.shape == ())


def get_first(obj: Any) -> Any:
    """The first device's copy of each leaf of a device-stacked pytree (scalars kept)."""
    return jax.tree_util.tree_map(lambda x: x if _is_scalar(x) else x[0], obj)


def coefficient_dtype() -> Any:
    """The dtype of the step's scalar coefficients (learning rate, momentum, damping): float64
    when ``jax_enable_x64`` is on, as the data then are, float32 otherwise. A float64 run must
    not round its coefficients to float32 (kfac-jax keeps them in float64 too)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)
