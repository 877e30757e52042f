"""Curvature blocks for stacked layers: one block per slice of a leading axis.

A ``lax.scan`` over layers (a transformer written with ``nn.scan``, an Equinox
model vmapped into stacked parameters) applies a different slice ``W[l]`` of one
parameter at step ``l``. Each slice is its own layer, so its curvature is its own
block. ``StackedBlock`` runs any ``CurvatureBlock`` built for one slice under
``jax.vmap`` over the slices: states, statistics and parameter vectors all carry
the leading axis, and the matrix is block-diagonal over it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax import linalg, tags
from curvax.blocks import CurvatureBlock, Numeric, ScalarOrSequence, construct_block


def slice_tag_eqn(eqn: tags.LayerTagEqn) -> tags.LayerTagEqn:
    """The description of one slice: every shape without its leading (stack) axis."""
    strip = lambda s: jax.ShapeDtypeStruct(tuple(s.shape[1:]), s.dtype)
    meta = {k: v for k, v in dict(eqn.meta or {}).items() if k not in ("scan_mode", "scan_length")}
    return tags.LayerTagEqn(
        primitive=eqn.primitive,
        outputs=tuple(strip(o) for o in eqn.outputs),
        inputs=tuple(strip(i) for i in eqn.inputs),
        params=tuple(strip(p) for p in eqn.params),
        param_indices=eqn.param_indices,
        meta=meta,
        name=eqn.name,
    )


class StackedBlock(CurvatureBlock):
    """``length`` independent copies of ``inner`` (built for one slice), vmapped.

    Parameters, vectors and estimation data have a leading axis of size ``length``;
    ``to_dense_matrix`` is in the parameters' own (stacked, C-order) layout.
    """

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str, inner: CurvatureBlock, length: int):
        super().__init__(layer_tag_eq, name)
        if any(not p.shape or p.shape[0] != length for p in layer_tag_eq.params):
            raise ValueError(
                f"{name}: every parameter of a stacked layer needs a leading axis of size {length}, got shapes "
                f"{[tuple(p.shape) for p in layer_tag_eq.params]}."
            )
        self.inner = inner
        self.length = int(length)

    @classmethod
    def from_ctor(cls, ctor: Callable[..., CurvatureBlock], eqn: tags.LayerTagEqn, name: str) -> "StackedBlock":
        """Builds the per-slice block with ``ctor`` and wraps it."""
        return cls(eqn, name, construct_block(ctor, slice_tag_eqn(eqn), name), int(eqn.meta["scan_length"]))

    def __repr__(self) -> str:
        return f"StackedBlock({self.length} x {self.inner!r})"

    @property
    def dtype(self) -> Any:
        return self.inner.dtype

    # The public methods are the inner block's, vmapped over the slices.

    def init(self, rng: Any, exact_powers_to_cache: ScalarOrSequence, approx_powers_to_cache: ScalarOrSequence, cache_eigenvalues: bool) -> Any:
        init = lambda r: self.inner.init(r, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues)
        return jax.vmap(init)(jax.random.split(rng, self.length))

    def update_curvature_matrix_estimate(
        self, state: Any, estimation_data: Mapping[str, Sequence[Any]], ema_old: Numeric, ema_new: Numeric,
        batch_size: Numeric, pmap_axis_name: str | None = None,
    ) -> Any:
        update = lambda s, d: self.inner.update_curvature_matrix_estimate(s, d, ema_old, ema_new, batch_size, pmap_axis_name)
        return jax.vmap(update)(state, {k: tuple(v) for k, v in estimation_data.items()})

    # ``identity_weight`` is one number for every slice, or one per slice (shape ``(length,)``:
    # each slice's own damping, as ``norm`` scales it per slice).

    def _slice_weights(self, identity_weight: Any) -> Any:
        w = jnp.asarray(identity_weight)
        if w.shape != (self.length,):
            raise ValueError(
                f"{self.name}: `identity_weight` must be a scalar or one per slice, shape ({self.length},); "
                f"got shape {w.shape}."
            )
        return w

    def multiply_matpower(self, state: Any, vector: Sequence[Any], identity_weight: Numeric, power: Numeric, exact_power: bool, use_cached: bool) -> tuple:
        vec = self._check_vector(vector)
        if np.ndim(identity_weight) == 0:
            mul = lambda s, v: self.inner.multiply_matpower(s, v, identity_weight, power, exact_power, use_cached)
            return tuple(jax.vmap(mul)(state, vec))
        mul_w = lambda s, v, w: self.inner.multiply_matpower(s, v, w, power, exact_power, use_cached)
        return tuple(jax.vmap(mul_w)(state, vec, self._slice_weights(identity_weight)))

    # Those that decompose the slices' factors map over the slices one at a time on CPU, where
    # batched LAPACK calls can deadlock each other (``linalg.map_decompositions``).

    def _map_slices(self, fn: Callable[..., Any], state: Any, *per_slice: Any) -> Any:
        """``fn(slice_state, *slice_args)`` for every slice, stacked. A state without arrays (a
        scaled identity's) is every slice's: ``fn`` is mapped over ``per_slice`` alone, or
        called once and its outputs broadcast to the slices."""
        if jax.tree_util.tree_leaves(state):
            return linalg.map_decompositions(fn, state, *per_slice)
        if per_slice:
            return jax.vmap(lambda *args: fn(state, *args))(*per_slice)
        return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (self.length, *jnp.shape(x))), fn(state))

    def inverse_diagonal(self, state: Any, identity_weight: Numeric) -> tuple:
        if np.ndim(identity_weight) == 0:
            return tuple(self._map_slices(lambda s: self.inner.inverse_diagonal(s, identity_weight), state))
        return tuple(self._map_slices(self.inner.inverse_diagonal, state, self._slice_weights(identity_weight)))

    def eigenvalues(self, state: Any, use_cached: bool) -> Any:
        return jnp.ravel(self._map_slices(lambda s: self.inner.eigenvalues(s, use_cached), state))

    def norm(self, state: Any, norm_type: str) -> Any:
        """Each slice's norm (shape ``(length,)``): every slice is its own block."""
        return self._map_slices(lambda s: self.inner.norm(s, norm_type), state)

    def update_cache(self, state: Any, identity_weight: Numeric, exact_powers: ScalarOrSequence, approx_powers: ScalarOrSequence, eigenvalues: bool) -> Any:
        if np.ndim(identity_weight) == 0:
            update = lambda s: self.inner.update_cache(s, identity_weight, exact_powers, approx_powers, eigenvalues)
            return self._map_slices(update, state)
        update_w = lambda s, w: self.inner.update_cache(s, w, exact_powers, approx_powers, eigenvalues)
        return self._map_slices(update_w, state, self._slice_weights(identity_weight))

    def to_dense_matrix(self, state: Any) -> Any:
        per_slice = jax.vmap(self.inner.to_dense_matrix)(state)  # (L, n, n) in per-slice parameter order
        pos = self._slice_positions()
        n = self.dim
        return jnp.zeros((n, n), per_slice.dtype).at[pos[:, :, None], pos[:, None, :]].set(per_slice)

    def _slice_positions(self) -> np.ndarray:
        """``pos[l, i]``: where entry ``i`` of slice ``l``'s flat vector sits in the stacked flat vector."""
        sizes = [int(np.prod(s[1:], dtype=int)) for s in self.parameters_shapes]
        starts = np.concatenate([[0], np.cumsum(sizes)]) * self.length
        rows = [starts[j] + np.arange(self.length)[:, None] * sizes[j] + np.arange(sizes[j])[None, :] for j in range(len(sizes))]
        return np.concatenate(rows, axis=1)

    # Hooks of the base class: unused, the public methods above delegate whole.

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):  # pragma: no cover
        raise NotImplementedError

    def _multiply_matpower_unscaled(self, state, vector, identity_weight, power, exact_power, use_cached):  # pragma: no cover
        raise NotImplementedError

    def _eigenvalues_unscaled(self, state, use_cached):  # pragma: no cover
        raise NotImplementedError

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):  # pragma: no cover
        raise NotImplementedError

    def _to_dense_unscaled(self, state):  # pragma: no cover
        raise NotImplementedError
