"""Kronecker factors kept as block diagonals: K-FAC for layers too wide for a whole factor.

A dense layer's K-FAC block is ``A (x) G`` with ``A`` of side ``d_in + 1`` and ``G`` of side
``d_out``. A language-model head from 768 features to a 50257-token vocabulary has a ``G`` of
50257 x 50257: 9.4 GiB in float32, and an eigendecomposition that takes hours. Here an
oversized factor is replaced by its block diagonal ``blockdiag(F_11, ..., F_kk)`` (each block
side at most a bound, as Distributed Shampoo partitions its preconditioners) or by its
diagonal; the Kronecker structure stays: ``C ~= A_part (x) G_part``. Only the factors that
exceed the budget change, so the head keeps its whole 769 x 769 ``A``.

Memory and work scale with the partition: a factor of side ``n`` in blocks of side ``<= b``
holds ``n b`` numbers, its refresh costs ``n b^2`` and its products ``n b`` per column. The
whole factor is never formed. ``"partition"`` caps ``b`` at ``MAX_BLOCK_SIDE`` (2048) even when the
budget allows more, so the refresh grows only linearly with the side.

The blocks of a group of equal-sized blocks are decomposed by one program whatever their
number: a batched ``eigh``/Cholesky on accelerators, a ``lax.map`` (one loop, one block at a
time) on CPU. On CPU jaxlib 0.10 spreads a batched LAPACK call over XLA's intra-op thread
pool and blocks until its pieces finish: two such calls running at once (the two groups of a
layout, or two layers) can take every pool thread and wait forever -- a 768 -> 50257 head's refresh
hung on a 2-core machine (``benchmarks/partitioned_head.py``). See
``linalg.map_decompositions``.

The budget (``factor_budget``, bytes per factor) is an option of ``BlockDiagonalCurvature`` and
``curvax.Optimizer``; ``DEFAULT_FACTOR_BUDGET`` is 256 MiB, the size of a float32 factor of side
8192 (see its comment). ``DensePartitionedKroneckerFactored`` can also be chosen explicitly
through ``layer_tag_to_block_ctor`` / ``set_default_tag_to_block_ctor``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax import blocks, linalg, tags
from curvax.blocks import WeightedMovingAverage, register_state_class

Array = jax.Array
Numeric = Any
Factor = tuple  # one (count, size, size) array per group of equal-sized diagonal blocks

__all__ = [
    "DEFAULT_FACTOR_BUDGET",
    "MAX_BLOCK_SIDE",
    "FactorLayout",
    "DensePartitionedKroneckerFactored",
    "check_factor_budget",
    "check_oversized_factor",
    "plan_factor",
    "ctor_within_budget",
    "budget_note",
    "format_bytes",
]

# 256 MiB per Kronecker factor: a float32 factor of side 8192 (8192^2 x 4 B) fits exactly, a
# float64 one of side 5792. Every hidden layer of common models (widths up to 8192) keeps its
# whole factors, while vocabulary-sized factors (32k-250k) are partitioned. At side 8192 one
# refresh is an eigendecomposition of ~10^12 flops (seconds on a GPU) and the factor, its
# eigenvectors and the solver's workspace take about 1 GiB: beyond that the refresh dominates
# the step and the memory outgrows the layer's own parameters.
DEFAULT_FACTOR_BUDGET = 256 * 2**20

# The largest block side ``"partition"`` picks, whatever the budget allows (Distributed Shampoo
# partitions its preconditioners in blocks of 1024-2048): a factor of side n then refreshes in
# at most n x 2048^2 flops, linear in n, and its products cost at most 2048 per entry.
MAX_BLOCK_SIDE = 2048

OVERSIZED_MODES = ("partition", "diagonal")


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``268435456 -> "256 MiB"``, ``10103070196 -> "9.41 GiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if float(value).is_integer() else f"{value:.3g} {unit}"
    return f"{n} B"


def check_factor_budget(value: Any, arg_name: str = "factor_budget") -> int | None:
    """``value`` as a positive int (bytes per Kronecker factor), or None (no budget)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(
            f"`{arg_name}` must be a positive integer number of bytes per Kronecker factor (e.g. "
            f"{DEFAULT_FACTOR_BUDGET} = 256 MiB) or None for no budget, got {type(value).__name__} {value!r}."
        )
    if value <= 0:
        raise ValueError(f"`{arg_name}` must be a positive number of bytes per Kronecker factor (or None), got {value!r}.")
    return int(value)


def check_oversized_factor(value: Any, arg_name: str = "oversized_factor") -> str | int:
    """``"partition"``, ``"diagonal"`` or a positive int (the block side bound)."""
    if isinstance(value, str):
        if value not in OVERSIZED_MODES:
            raise ValueError(f"`{arg_name}` must be 'partition', 'diagonal' or a positive block side, got {value!r}.")
        return value
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)) or value < 1:
        raise ValueError(f"`{arg_name}` must be 'partition', 'diagonal' or a positive block side, got {value!r}.")
    return int(value)


def _check_block_size(value: Any, arg_name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)) or value < 1:
        raise ValueError(f"`{arg_name}` must be None or a positive block side (1: diagonal), got {value!r}.")
    return int(value)


# ----------------------------------------------------------------------------------
# Layout and the operations on partitioned factors
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FactorLayout:
    """A factor of side ``side`` as ``ceil(side / max_block)`` diagonal blocks of nearly equal sides.

    ``groups`` lists ``(start, count, size)``: ``count`` consecutive blocks of side ``size``
    starting at row ``start`` (at most two groups: sides ``q + 1`` and ``q``). One block is the
    whole factor; blocks of side 1 are its diagonal.
    """

    side: int
    max_block: int

    @functools.cached_property
    def groups(self) -> tuple[tuple[int, int, int], ...]:
        """``(start, count, size)`` per run of equal-sized blocks (see the class docstring)."""
        k = -(-self.side // min(self.max_block, self.side))
        q, r = divmod(self.side, k)
        out = []
        if r:
            out.append((0, r, q + 1))
        if k - r:
            out.append((r * (q + 1), k - r, q))
        return tuple(out)

    @property
    def num_blocks(self) -> int:
        """How many diagonal blocks."""
        return sum(c for _, c, _ in self.groups)

    @property
    def largest(self) -> int:
        """The largest block side."""
        return max(b for _, _, b in self.groups)

    @property
    def is_whole(self) -> bool:
        """Whether the factor is one block (kept whole)."""
        return self.num_blocks == 1

    @property
    def is_diagonal(self) -> bool:
        """Whether every block has side 1 (only the diagonal is kept)."""
        return self.largest == 1

    def nbytes(self, itemsize: int) -> int:
        """Bytes of the stored blocks."""
        return sum(c * b * b for _, c, b in self.groups) * itemsize

    def describe(self) -> str:
        """``"whole"``, ``"diagonal"`` or ``"k blocks of <= b"``."""
        if self.is_whole:
            return "whole"
        if self.is_diagonal:
            return "diagonal"
        return f"{self.num_blocks} blocks of <= {self.largest}"


def plan_factor(side: int, itemsize: int, factor_budget: int | None, oversized: str | int) -> tuple[int, str | None]:
    """The block side bound of a factor and why: ``(side, None)`` when it fits the budget.

    Over the budget: ``"partition"`` takes the largest blocks whose total (``side x block``
    numbers) fits it, at most ``MAX_BLOCK_SIDE``, the diagonal when not even blocks of side 2
    fit; ``"diagonal"`` the diagonal; an int that bound. The reason names the choice and what
    decided it (the budget, the cap or the option).
    """
    full = side * side * itemsize
    if factor_budget is None or full <= factor_budget:
        return side, None
    fits = factor_budget // (side * itemsize)  # the largest block side whose blocks fit the budget
    if oversized == "diagonal":
        block, because = 1, "oversized_factor='diagonal'"
    elif isinstance(oversized, int):
        block, because = min(oversized, side), f"oversized_factor={oversized}"
    elif fits < 2:
        block, because = 1, "not even blocks of side 2 fit the budget"
    elif fits > MAX_BLOCK_SIDE:
        block, because = MAX_BLOCK_SIDE, f"block side capped at MAX_BLOCK_SIDE={MAX_BLOCK_SIDE} to bound the refresh"
    else:
        block, because = fits, "the largest blocks within the budget"
    layout = FactorLayout(side, block)
    why = f"{side}\u00b2 x {itemsize} B = {format_bytes(full)} > budget {format_bytes(factor_budget)}: "
    if layout.is_diagonal:
        over = ", still over the budget" if side * itemsize > factor_budget else ""
        why += f"diagonal ({format_bytes(side * itemsize)}{over}; {because})"
    elif layout.is_whole:
        why += f"kept whole ({because})"
    else:
        why += f"partitioned into {layout.num_blocks} blocks of <= {layout.largest} ({format_bytes(layout.nbytes(itemsize))}; {because})"
    return block, why


def _from_rows(layout: FactorLayout, rows: Array, denom: Numeric) -> Factor:
    """The diagonal blocks of ``rows^T rows / denom`` (rows ``(N, side)``), never the whole Gram."""
    out = []
    for s, c, b in layout.groups:
        r = rows[:, s : s + c * b]
        if b == 1:
            out.append((jnp.sum(r * r, axis=0) / denom)[:, None, None])
        else:
            r = r.reshape(rows.shape[0], c, b)
            out.append(jnp.einsum("nci,ncj->cij", r, r) / denom)
    return tuple(out)


def _apply(layout: FactorLayout, mats: Factor, v: Array, axis: int, transpose: bool = False) -> Array:
    """``blockdiag(mats) @ v`` (``axis=0``) or ``v @ blockdiag(mats)`` (``axis=1``); the blocks
    transposed with ``transpose``."""
    parts = []
    for (s, c, b), m in zip(layout.groups, mats):
        if axis == 0:
            vg = v[s : s + c * b]
            if b == 1:
                parts.append(m[:, 0, 0][:, None] * vg)
                continue
            spec = "cji,cjm->cim" if transpose else "cij,cjm->cim"
            parts.append(jnp.einsum(spec, m, vg.reshape(c, b, -1)).reshape(c * b, -1))
        else:
            vg = v[:, s : s + c * b]
            if b == 1:
                parts.append(vg * m[:, 0, 0][None, :])
                continue
            spec = "mcj,ckj->mck" if transpose else "mcj,cjk->mck"
            parts.append(jnp.einsum(spec, vg.reshape(-1, c, b), m).reshape(-1, c * b))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


def _eigh(layout: FactorLayout, mats: Factor) -> tuple[Array, Factor]:
    """Eigenvalues (flat, block order, clipped at 0) and eigenvectors (per group) of every block:
    one decomposition program per group of equal-sized blocks (``linalg.map_decompositions``)."""
    values, vectors = [], []
    for (_, c, b), m in zip(layout.groups, mats):
        if b == 1:
            values.append(jnp.maximum(m[:, 0, 0], 0))
            vectors.append(jnp.ones_like(m))
        else:
            s, q = linalg.map_decompositions(linalg.safe_psd_eigh, m)
            values.append(s.reshape(-1))
            vectors.append(q)
    return jnp.concatenate(values) if len(values) > 1 else values[0], tuple(vectors)


def _eigvalsh(layout: FactorLayout, mats: Factor) -> Array:
    vals = [
        jnp.maximum(m[:, 0, 0], 0) if b == 1 else linalg.map_decompositions(linalg.safe_eigvalsh, m).reshape(-1)
        for (_, _, b), m in zip(layout.groups, mats)
    ]
    return jnp.concatenate(vals) if len(vals) > 1 else vals[0]


def _inv(layout: FactorLayout, mats: Factor) -> Factor:
    return tuple(1 / m if b == 1 else linalg.map_decompositions(linalg.psd_inv, m) for (_, _, b), m in zip(layout.groups, mats))


def _power(layout: FactorLayout, mats: Factor, power: Numeric) -> Factor:
    def one(m: Array) -> Array:
        s, q = linalg.safe_psd_eigh(m)
        return (q * linalg._pow(s, power)) @ q.T

    return tuple(
        linalg._pow(jnp.maximum(m, 0), power) if b == 1 else linalg.map_decompositions(one, m)
        for (_, _, b), m in zip(layout.groups, mats)
    )


def _trace(mats: Factor) -> Array:
    return sum(jnp.sum(jnp.diagonal(m, axis1=-2, axis2=-1)) for m in mats)


def _add_identity(mats: Factor, w: Numeric) -> Factor:
    return tuple(m + w * jnp.eye(m.shape[-1], dtype=m.dtype) for m in mats)


def _scale(mats: Factor, s: Numeric) -> Factor:
    return tuple(m * s for m in mats)


def _to_dense(mats: Factor) -> Array:
    """``blockdiag`` of every block, as one ``side x side`` matrix (tests and small layers only)."""
    parts = []
    for m in mats:
        c, b = m.shape[0], m.shape[-1]
        parts.append((jnp.eye(c, dtype=m.dtype)[:, None, :, None] * m[:, :, None, :]).reshape(c * b, c * b))
    return parts[0] if len(parts) == 1 else jax.scipy.linalg.block_diag(*parts)


def pi_damped(a: Factor, g: Factor, side_a: int, side_g: int, damping: Numeric) -> tuple[Factor, Factor]:
    """``(A + w_A I, G + w_G I)`` with ``linalg.pi_damping``'s split of the damping, on
    partitioned factors (their traces are the whole factors'). A zero factor gives
    ``sqrt(d) I`` for both."""
    dtype = a[0].dtype
    sqrt_d = jnp.sqrt(jnp.asarray(damping, dtype))
    ok, wa, wg = linalg.pi_damping(_trace(a) / side_a, _trace(g) / side_g, side_a, side_g, damping)

    def damp(mats: Factor, w: Array) -> Factor:
        out = []
        for m in mats:
            eye = jnp.eye(m.shape[-1], dtype=m.dtype)
            out.append(jnp.where(ok, m + w * eye, sqrt_d * eye).astype(m.dtype))
        return tuple(out)

    return damp(a, wa), damp(g, wg)


# ----------------------------------------------------------------------------------
# The block
# ----------------------------------------------------------------------------------


class DensePartitionedKroneckerFactored(blocks._DenseKroneckerMixin, blocks.CurvatureBlock):
    """K-FAC for a dense layer with block-diagonal (or diagonal) Kronecker factors.

    ``C ~= A_part (x) G_part`` where ``A_part`` keeps the diagonal blocks of the
    ``DenseTwoKroneckerFactored`` factor ``A = E[[x; 1][x; 1]^T]`` (blocks of consecutive
    inputs, the bias last) and ``G_part`` those of ``G = E[dy dy^T]``, with the same
    normalisation; a factor in one block is the whole factor, so with both factors whole the
    block equals ``DenseTwoKroneckerFactored``. Products, powers and the pi-damped approximate
    inverse follow that block's conventions (``curvax.blocks``), block by block.

    Args:
      layer_tag_eq: the dense layer's tag equation.
      name: the block's name. Default: the equation's.
      inputs_block_size: the largest block side of ``A``: 1 keeps its diagonal, ``>= d_in + 1``
        the whole factor; None decides from ``factor_budget`` and ``oversized_factor``.
      outputs_block_size: the same for ``G`` (side ``d_out``).
      factor_budget: bytes a factor may take before it is partitioned (for a size left None);
        None never partitions. Default ``DEFAULT_FACTOR_BUDGET`` (256 MiB).
      oversized_factor: what an over-budget factor becomes: ``"partition"`` (the largest
        blocks whose total fits the budget, at most ``MAX_BLOCK_SIDE``; the diagonal when even
        side 2 does not), ``"diagonal"``, or an int: blocks of at most that side. Default
        ``"partition"``.

    Cache (as ``TwoKroneckerFactored``'s, factors kept per group of equal-sized blocks):
    ``"inputs_factor_eigenvalues"`` (``d_in + 1``,), ``"outputs_factor_eigenvalues"``,
    ``"inputs_factor_eigen_vectors"``/``"outputs_factor_eigen_vectors"`` (tuples of
    ``(count, size, size)`` arrays) and ``"-1"`` with the damped factors' inverses.
    """

    @register_state_class
    class State(blocks.CurvatureBlock.State):
        """``inputs_factor``/``outputs_factor``: one ``WeightedMovingAverage`` of ``(count, size, size)``
        blocks per group of the factor's layout."""

        inputs_factor: tuple
        outputs_factor: tuple

    def __init__(
        self,
        layer_tag_eq: tags.LayerTagEqn,
        name: str | None = None,
        inputs_block_size: int | None = None,
        outputs_block_size: int | None = None,
        factor_budget: int | None = DEFAULT_FACTOR_BUDGET,
        oversized_factor: str | int = "partition",
    ):
        super().__init__(layer_tag_eq, name)
        budget = check_factor_budget(factor_budget)
        oversized = check_oversized_factor(oversized_factor)
        itemsize = jnp.dtype(self.dtype).itemsize
        self._notes: list[str] = []
        layouts = []
        for which, side, given in (
            ("inputs", self.input_size(), _check_block_size(inputs_block_size, "inputs_block_size")),
            ("outputs", self.output_size(), _check_block_size(outputs_block_size, "outputs_block_size")),
        ):
            if given is None:
                given, why = plan_factor(side, itemsize, budget, oversized)
                if why:
                    self._notes.append(f"{which} factor {why}")
            elif given < side:
                desc = FactorLayout(side, given).describe()
                self._notes.append(f"{which} factor {side}\u00b2: {desc} ({which}_block_size={given})")
            layouts.append(FactorLayout(side, min(given, side)))
        self.inputs_layout, self.outputs_layout = layouts

    # --- description --------------------------------------------------------------------

    @property
    def has_bias(self) -> bool:
        """Whether the layer has a bias (a second parameter)."""
        return self.number_of_parameters == 2

    @property
    def budget_note(self) -> str | None:
        """Why a factor is partitioned or diagonal (for the registration table); None if both are whole."""
        return "; ".join(self._notes) or None

    @property
    def is_plain(self) -> bool:
        """Whether both factors are whole (the block is then ``DenseTwoKroneckerFactored``)."""
        return self.inputs_layout.is_whole and self.outputs_layout.is_whole

    def refresh_cost(self) -> int:
        """Static estimate of a cache refresh: ``sum n_i^3`` over the blocks of both factors."""
        return sum(c * b**3 for lay in (self.inputs_layout, self.outputs_layout) for _, c, b in lay.groups)

    def apply_cost(self) -> int:
        """Static estimate of a product: ``d_in d_out (b_A + b_G)`` with the largest block sides."""
        return self.input_size() * self.output_size() * (self.inputs_layout.largest + self.outputs_layout.largest)

    # --- parameters <-> V (the (d_in [+1], d_out) matrix of TwoKroneckerFactored) -------------

    def _to_array(self, params: Sequence[Any], xp: Any) -> Any:
        w = blocks.kernel_to_matrix(params[0], blocks.kernel_axes(self._layer_tag_eq.meta, params[0].shape))
        return xp.concatenate([w, params[1].reshape(1, -1)], axis=0) if self.has_bias else w

    def parameters_shaped_list_to_array(self, parameters_shaped_list: Sequence[Array]) -> Array:
        """The parameters (or a vector shaped like them) as the matrix ``V = [W; b^T]``."""
        return self._to_array(self._check_vector(parameters_shaped_list, "parameters_shaped_list"), jnp)

    def array_to_parameters_shaped_list(self, array: Array) -> tuple[Array, ...]:
        """Inverse of ``parameters_shaped_list_to_array``."""
        shapes = self.parameters_shapes
        rows = array[:-1] if self.has_bias else array
        out = (blocks.matrix_to_kernel(rows, blocks.kernel_axes(self._layer_tag_eq.meta, shapes[0]), shapes[0]),)
        return out + ((array[-1].reshape(shapes[1]),) if self.has_bias else ())

    # --- state ---------------------------------------------------------------------------

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del rng
        dtype, la, lg = self.dtype, self.inputs_layout, self.outputs_layout

        def eyes(layout: FactorLayout) -> Factor:
            return tuple(jnp.broadcast_to(jnp.eye(b, dtype=dtype), (c, b, b)) for _, c, b in layout.groups)

        cache: dict[str, Any] = {}
        if exact_powers_to_cache or cache_eigenvalues:
            cache["inputs_factor_eigenvalues"] = jnp.zeros([la.side], dtype)
            cache["outputs_factor_eigenvalues"] = jnp.zeros([lg.side], dtype)
        if exact_powers_to_cache:
            cache["inputs_factor_eigen_vectors"] = eyes(la)
            cache["outputs_factor_eigen_vectors"] = eyes(lg)
        for p in approx_powers_to_cache:
            self._check_approx_cacheable(p)
            cache["-1"] = {"inputs_factor": eyes(la), "outputs_factor": eyes(lg), "identity_weight": jnp.zeros([], dtype)}
        return DensePartitionedKroneckerFactored.State(
            cache=cache or None,
            inputs_factor=tuple(WeightedMovingAverage.zeros((c, b, b), dtype) for _, c, b in la.groups),
            outputs_factor=tuple(WeightedMovingAverage.zeros((c, b, b), dtype) for _, c, b in lg.groups),
        )

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del pmap_axis_name
        x, dy = self._dense_data(estimation_data)
        x = blocks._per_example(x, self.dense_in_dim, "inputs[0]").reshape(-1, self.dense_in_dim).astype(self.dtype)
        dy = blocks._per_example(dy, self.dense_out_dim, "outputs_tangent[0]").reshape(-1, self.dense_out_dim).astype(self.dtype)
        if x.shape[0] != dy.shape[0]:
            raise ValueError(f"{self._name}: inputs and output tangents have different numbers of rows.")
        if self.has_bias:
            x = jnp.concatenate([x, jnp.ones((x.shape[0], 1), x.dtype)], axis=1)
        a = _from_rows(self.inputs_layout, x, x.shape[0])
        g = _from_rows(self.outputs_layout, dy, batch_size)
        state = blocks._copy_state(state)
        for avg, new in zip(state.inputs_factor + state.outputs_factor, a + g):
            avg.update(new, ema_old, ema_new)
        return state

    def forward_only_state(self, state: Any) -> Any:
        """``state`` with ``G`` the identity (FOOF, ``estimation_mode="forward_only"``)."""
        state = blocks._copy_state(state)
        for avg in state.outputs_factor:
            c, b = avg.value.shape[0], avg.value.shape[-1]
            avg.value = jnp.broadcast_to(jnp.eye(b, dtype=avg.value.dtype), (c, b, b))
        return state

    def _factors(self, state: Any) -> tuple[Factor, Factor]:
        return (tuple(linalg.symmetrize(f.value) for f in state.inputs_factor),
                tuple(linalg.symmetrize(f.value) for f in state.outputs_factor))

    # --- matrix functions ----------------------------------------------------------------

    # The same cache rules as the plain Kronecker block (only the approximate inverse is cached).
    _check_approx_cacheable = blocks._FactorPairBlock._check_approx_cacheable
    _serves_from_cache = blocks._FactorPairBlock._serves_from_cache

    def _kron(self, a: Factor, g: Factor, v: Array) -> Array:
        """``A_part V G_part``."""
        return _apply(self.outputs_layout, g, _apply(self.inputs_layout, a, v, 0), 1)

    def _eigen_mul(self, qa: Factor, sa: Array, qg: Factor, sg: Array, v: Array, w: Numeric, power: Numeric) -> Array:
        """``(A (x) G + w I)^p vec(V)`` in the factors' (block-diagonal) eigenbases."""
        la, lg = self.inputs_layout, self.outputs_layout
        inner = _apply(lg, qg, _apply(la, qa, v, 0, transpose=True), 1)
        lam = linalg._pow(sa[:, None] * sg[None, :] + w, power)
        return _apply(lg, qg, _apply(la, qa, inner * lam, 0), 1, transpose=True)

    def _damped(self, a: Factor, g: Factor, w: Numeric) -> tuple[Factor, Factor]:
        return pi_damped(a, g, self.inputs_layout.side, self.outputs_layout.side, w)

    def _multiply_matpower_unscaled(self, state, vector, identity_weight, power, exact_power, use_cached):
        v = self._to_array(vector, jnp)
        cache = state.cache or {}
        la, lg = self.inputs_layout, self.outputs_layout
        if exact_power and power == 1:
            out = self._kron(*self._factors(state), v) + identity_weight * v
        elif exact_power:
            if use_cached:
                if "inputs_factor_eigen_vectors" not in cache:
                    raise self._missing_cache(f"exact power {power}", "exact_powers_to_cache")
                sa, qa = cache["inputs_factor_eigenvalues"], cache["inputs_factor_eigen_vectors"]
                sg, qg = cache["outputs_factor_eigenvalues"], cache["outputs_factor_eigen_vectors"]
            else:
                a, g = self._factors(state)
                (sa, qa), (sg, qg) = _eigh(la, a), _eigh(lg, g)
            out = self._eigen_mul(qa, sa, qg, sg, v, identity_weight, power)
        elif use_cached:  # power == -1
            if "-1" not in cache:
                raise self._missing_cache("the approximate inverse (power -1)", "approx_powers_to_cache")
            out = self._kron(cache["-1"]["inputs_factor"], cache["-1"]["outputs_factor"], v)
        else:
            a_d, g_d = self._damped(*self._factors(state), identity_weight)
            if power == -1:
                a_d, g_d = _inv(la, a_d), _inv(lg, g_d)
            elif power != 1:
                a_d, g_d = _power(la, a_d, power), _power(lg, g_d, power)
            out = self._kron(a_d, g_d, v)
        return self.array_to_parameters_shaped_list(out)

    def _eigenvalues_unscaled(self, state, use_cached):
        if use_cached:
            cache = state.cache or {}
            if "inputs_factor_eigenvalues" not in cache:
                raise self._missing_cache("the eigenvalues", "cache_eigenvalues")
            sa, sg = cache["inputs_factor_eigenvalues"], cache["outputs_factor_eigenvalues"]
        else:
            a, g = self._factors(state)
            sa, sg = _eigvalsh(self.inputs_layout, a), _eigvalsh(self.outputs_layout, g)
        return jnp.outer(sa, sg).ravel()

    def _inverse_diagonal_unscaled(self, state, identity_weight):
        # diag((A (x) G + w I)^-1) = Qa^2 [1 / (sa sg^T + w)] (Qg^2)^T, Q block diagonal.
        la, lg = self.inputs_layout, self.outputs_layout
        a, g = self._factors(state)
        (sa, qa), (sg, qg) = _eigh(la, a), _eigh(lg, g)
        mid = 1.0 / (jnp.outer(sa, sg) + identity_weight)
        sq = lambda qs: tuple(q * q for q in qs)
        return self.array_to_parameters_shaped_list(_apply(lg, sq(qg), _apply(la, sq(qa), mid, 0), 1, transpose=True))

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        for p in approx_powers:
            self._check_approx_cacheable(p)
        la, lg = self.inputs_layout, self.outputs_layout
        cache = dict(state.cache or {})
        a, g = self._factors(state)
        s = self.state_dependent_scale(state)
        if not blocks._is_one(s):
            a, g = _scale(a, jnp.sqrt(s)), _scale(g, jnp.sqrt(s))
        if exact_powers or "inputs_factor_eigen_vectors" in cache:
            (sa, qa), (sg, qg) = _eigh(la, a), _eigh(lg, g)
            cache.update(
                inputs_factor_eigenvalues=sa, outputs_factor_eigenvalues=sg,
                inputs_factor_eigen_vectors=qa, outputs_factor_eigen_vectors=qg,
            )
        elif eigenvalues or "inputs_factor_eigenvalues" in cache:
            cache.update(inputs_factor_eigenvalues=_eigvalsh(la, a), outputs_factor_eigenvalues=_eigvalsh(lg, g))
        if approx_powers:
            a_d, g_d = self._damped(a, g, blocks._div(identity_weight, self.fixed_scale()))
            cache["-1"] = {
                "inputs_factor": _inv(la, a_d),
                "outputs_factor": _inv(lg, g_d),
                "identity_weight": jnp.asarray(identity_weight, self.dtype),
            }
        state.cache = cache or None
        return state

    def _to_dense_unscaled(self, state):
        a, g = self._factors(state)
        return self._vec_v_to_parameter_order(jnp.kron(_to_dense(a), _to_dense(g)))

    def _norm_unscaled(self, state, norm_type):
        # The product of the block-diagonal factors' norms, as for the whole-factor block.
        a, g = self._factors(state)
        return linalg.block_diagonal_psd_norm(a, norm_type) * linalg.block_diagonal_psd_norm(g, norm_type)

    def _vec_v_to_parameter_order(self, dense_v: Array) -> Array:
        """A matrix acting on ``vec(V)`` (row-major) reordered to act on the flat parameters."""
        offsets = np.cumsum([0] + list(self.parameters_sizes))
        positions = [np.arange(offsets[i], offsets[i + 1]).reshape(s) for i, s in enumerate(self.parameters_shapes)]
        order = np.argsort(np.asarray(self._to_array(positions, np)).ravel())
        return dense_v[order][:, order]


# ----------------------------------------------------------------------------------
# Choosing blocks under a budget
# ----------------------------------------------------------------------------------


def ctor_within_budget(
    ctor: Callable[..., Any], layer_tag_eq: tags.LayerTagEqn, name: str, factor_budget: int | None,
    oversized_factor: str | int,
) -> Callable[..., Any]:
    """The block constructor of a layer under a factor budget.

    Only the default dense K-FAC blocks (``DenseTwoKroneckerFactored``, and
    ``RepeatedDenseKroneckerFactored`` for a dense layer over extra axes) are replaced, and only
    when one of their factors exceeds ``factor_budget``: by ``DensePartitionedKroneckerFactored``
    with that budget, which partitions (or diagonalises) just the oversized factors (over all
    positions: padding is not masked there). Any other constructor, chosen by the user, is kept.
    """
    if factor_budget is None or ctor not in (blocks.DenseTwoKroneckerFactored, blocks.RepeatedDenseKroneckerFactored):
        return ctor
    budgeted = functools.partial(
        DensePartitionedKroneckerFactored, factor_budget=factor_budget, oversized_factor=oversized_factor
    )
    return ctor if budgeted(layer_tag_eq, name).is_plain else budgeted


def budget_note(block: Any, factor_budget: int | None) -> str | None:
    """The registration table's remark on a block and the budget: why its factors are
    partitioned, or that a Kronecker block of the user's choice exceeds the budget; else None."""
    if isinstance(block, DensePartitionedKroneckerFactored):
        return block.budget_note
    if factor_budget is None or not isinstance(block, blocks.TwoKroneckerFactored):
        return None
    itemsize = jnp.dtype(block.dtype).itemsize
    try:  # a user's Kronecker subclass may leave the sizes unimplemented (kfac-jax's abstract ones)
        sides = (("inputs", int(block.input_size())), ("outputs", int(block.output_size())))
    except NotImplementedError:
        return None
    over = []
    for which, side in sides:
        if side * side * itemsize > factor_budget:
            over.append(f"{which} factor {side}\u00b2 x {itemsize} B = {format_bytes(side * side * itemsize)}")
    if not over:
        return None
    return (
        f"{' and '.join(over)} > budget {format_bytes(factor_budget)}, kept whole: only the default "
        f"DenseTwoKroneckerFactored is partitioned automatically (pick DensePartitionedKroneckerFactored "
        "with layer_tag_to_block_ctor)"
    )
