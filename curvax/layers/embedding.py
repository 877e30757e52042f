"""Embedding layers: ``y = table[ids]`` with a ``(vocab, d)`` parameter table.

A lookup is a dense layer whose input is the one-hot encoding of ``ids``, so
its K-FAC input factor ``A = E[onehot onehot^T]`` is diagonal: the token
frequencies. ``EmbeddingKroneckerFactored`` stores only that diagonal, never a
``vocab x vocab`` matrix, and the full ``d x d`` output factor ``G``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from curvax import blocks, detection, linalg, tags
from curvax.blocks import WeightedMovingAverage, register_state_class
from curvax.tracing import Lit, Program

__all__ = ["embedding", "register_embedding", "EmbeddingKroneckerFactored", "match_embedding"]

embedding = tags.LayerTag("embedding", num_inputs=1, num_outputs=1)


def register_embedding(y: jax.Array, ids: jax.Array, table: jax.Array, **kwargs: Any) -> jax.Array:
    """Marks ``y = table[ids]`` as an embedding lookup; returns ``y``.

    ``table`` has shape ``(vocab, d)``, ``ids`` is an integer array and ``y`` has
    shape ``ids.shape + (d,)``. Ids outside ``[0, vocab)`` are clipped, as
    ``jnp.take(..., mode="clip")`` does (pass ``mode="drop"`` if the lookup
    dropped them instead). This is curvax's own function: kfac-jax has none.
    """
    tags._check_array("y", y)
    tags._check_array("ids", ids)
    tags._check_array("table", table)
    if table.ndim != 2:
        raise ValueError(f"register_embedding: table must be a 2-D (vocab, d) array, got shape {table.shape}.")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"register_embedding: ids must be an integer array, got dtype {ids.dtype}.")
    if tuple(y.shape) != tuple(ids.shape) + (table.shape[1],):
        raise ValueError(
            f"register_embedding: y must have shape ids.shape + (d,) = {tuple(ids.shape) + (table.shape[1],)}, "
            f"got {y.shape}."
        )
    mode = kwargs.pop("mode", "clip")
    if mode not in ("clip", "drop"):
        raise ValueError(f"register_embedding: mode must be 'clip' or 'drop', got {mode!r}.")
    return embedding.bind(y, ids, table, mode=mode, **kwargs)


# ----------------------------------------------------------------------------------
# Block
# ----------------------------------------------------------------------------------


class EmbeddingKroneckerFactored(blocks._FactorPairBlock):
    """K-FAC for an embedding table: ``C = diag(a) (x) G``.

    ``a[v]`` is the fraction of looked-up rows (tokens) equal to ``v`` (the
    one-hot input factor ``x^T x / N_rows``, which is diagonal) and
    ``G = dy^T dy / B`` sums the output tangents of all rows (the same
    conventions as ``DenseTwoKroneckerFactored``, so it equals that block fed
    with explicit one-hot inputs). Every product costs ``O(vocab d + d^3)``.

    Cache layout (as for ``TwoKroneckerFactored``, with ``A`` kept as its
    diagonal): ``"inputs_factor_eigenvalues"`` (vocab,),
    ``"outputs_factor_eigenvalues"`` (d,), ``"outputs_factor_eigen_vectors"``
    (d, d) and ``"-1" = {"inputs_factor": 1 / a_d, "outputs_factor": G_d^-1,
    "identity_weight": w}`` for the pi-damped approximate inverse.
    """

    @register_state_class
    class State(blocks.CurvatureBlock.State):
        """``inputs_factor``: moving average of ``a`` (vocab,); ``outputs_factor``: of ``G`` (d, d)."""

        inputs_factor: WeightedMovingAverage
        outputs_factor: WeightedMovingAverage

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None):
        super().__init__(layer_tag_eq, name)
        if self.number_of_parameters != 1 or len(self.parameters_shapes[0]) != 2:
            raise ValueError(
                f"{self.name}: an embedding block needs exactly one (vocab, d) table, got shapes {self.parameters_shapes}."
            )
        mode = self.layer_tag_extra_params.get("mode", "clip")
        if mode not in ("clip", "drop"):
            raise ValueError(f"{self.name}: meta['mode'] must be 'clip' or 'drop', got {mode!r}.")
        self._mode = mode

    @property
    def vocab_size(self) -> int:
        """Number of rows of the embedding table (its first dimension)."""
        return self.parameters_shapes[0][0]

    @property
    def embedding_dim(self) -> int:
        """Width of each embedding vector (the table's second dimension)."""
        return self.parameters_shapes[0][1]

    # --- state ------------------------------------------------------------------------

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        del rng
        n, d, dtype = self.vocab_size, self.embedding_dim, self.dtype
        cache: dict[str, Any] = {}
        if exact_powers_to_cache or cache_eigenvalues:
            cache["inputs_factor_eigenvalues"] = jnp.zeros([n], dtype)
            cache["outputs_factor_eigenvalues"] = jnp.zeros([d], dtype)
        if exact_powers_to_cache:
            cache["outputs_factor_eigen_vectors"] = jnp.eye(d, dtype=dtype)
        for p in approx_powers_to_cache:
            self._check_approx_cacheable(p)
            cache["-1"] = {
                "inputs_factor": jnp.ones([n], dtype),
                "outputs_factor": jnp.eye(d, dtype=dtype),
                "identity_weight": jnp.zeros([], dtype),
            }
        return EmbeddingKroneckerFactored.State(
            cache=cache or None,
            inputs_factor=WeightedMovingAverage.zeros((n,), dtype),
            outputs_factor=WeightedMovingAverage.zeros((d, d), dtype),
        )

    def _ids(self, estimation_data) -> jax.Array:
        xs = tuple(estimation_data["inputs"])
        if len(xs) != 1:
            raise ValueError(f"{self.name}: an embedding block needs one input (the ids), got {len(xs)}.")
        ids = xs[0]
        column = self.layer_tag_extra_params.get("id_column")
        if column is not None:
            ids = ids[..., column]
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{self.name}: the ids must be integers, got dtype {ids.dtype}.")
        return ids.reshape(-1)

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del pmap_axis_name
        ids = self._ids(estimation_data)
        dys = tuple(estimation_data["outputs_tangent"])
        if len(dys) != 1 or dys[0].shape[-1] != self.embedding_dim:
            raise ValueError(
                f"{self.name}: expected one output tangent with {self.embedding_dim} features last, got shapes "
                f"{[t.shape for t in dys]}."
            )
        dy = dys[0].reshape(-1, self.embedding_dim).astype(self.dtype)
        if dy.shape[0] != ids.shape[0]:
            raise ValueError(f"{self.name}: {ids.shape[0]} ids but {dy.shape[0]} output rows.")
        n = self.vocab_size
        if self._mode == "clip":
            ids = jnp.clip(ids, 0, n - 1)
        else:
            ids = jnp.where((ids >= 0) & (ids < n), ids, n)  # index n is dropped below
        counts = jnp.zeros([n], self.dtype).at[ids].add(1, mode="drop")
        return self._with_factors_updated(state, counts / ids.shape[0], (dy.T @ dy) / batch_size, ema_old, ema_new)

    # --- matrix functions -------------------------------------------------------------

    def _factors(self, state) -> tuple[jax.Array, jax.Array]:
        return jnp.maximum(state.inputs_factor.value, 0), linalg.symmetrize(state.outputs_factor.value)

    @staticmethod
    def _damped(a: jax.Array, g: jax.Array, damping) -> tuple[jax.Array, jax.Array]:
        """Pi-adjusted damped factors with ``A = diag(a)`` (see ``linalg.pi_adjusted_factors``)."""
        sqrt_d = jnp.sqrt(jnp.asarray(damping, g.dtype))
        ok, wa, wg = linalg.pi_damping(jnp.mean(a), linalg.average_trace(g), a.shape[0], g.shape[0], damping)
        eye = jnp.eye(g.shape[0], dtype=g.dtype)
        a_d = jnp.where(ok, a + wa, sqrt_d * jnp.ones_like(a))
        g_d = jnp.where(ok, g + wg * eye, sqrt_d * eye)
        return a_d.astype(a.dtype), g_d.astype(g.dtype)

    def _multiply_matpower_unscaled(self, state, vector, identity_weight, power, exact_power, use_cached):
        v = vector[0]
        cache = state.cache or {}
        if exact_power:
            if power == 1:
                a, g = self._factors(state)
                out = a[:, None] * (v @ g) + identity_weight * v
            else:
                if use_cached:
                    if "outputs_factor_eigen_vectors" not in cache:
                        raise self._missing_cache(f"exact power {power}", "exact_powers_to_cache")
                    sa, sg = cache["inputs_factor_eigenvalues"], cache["outputs_factor_eigenvalues"]
                    qg = cache["outputs_factor_eigen_vectors"]
                else:
                    sa, g = self._factors(state)
                    sg, qg = linalg.safe_psd_eigh(g)
                lam = sa[:, None] * sg[None, :] + identity_weight
                out = ((v @ qg) * linalg._pow(lam, power)) @ qg.T
        elif use_cached:  # power == -1
            if "-1" not in cache:
                raise self._missing_cache("the approximate inverse (power -1)", "approx_powers_to_cache")
            out = cache["-1"]["inputs_factor"][:, None] * (v @ cache["-1"]["outputs_factor"])
        else:
            a_d, g_d = self._damped(*self._factors(state), identity_weight)
            if power == 1:
                out = a_d[:, None] * (v @ g_d)
            elif power == -1:
                out = linalg.cholesky_solve(g_d, v.T).T / a_d[:, None]
            else:
                out = linalg._pow(a_d, power)[:, None] * (v @ linalg.psd_matrix_power(g_d, power))
        return (out,)

    def _factor_eigenvalues(self, a: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
        return a, linalg.safe_eigvalsh(g)  # A is diagonal: its eigenvalues are its entries

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        cache, a, g = self._cache_and_scaled_factors(state, approx_powers)
        if exact_powers or "outputs_factor_eigen_vectors" in cache:
            sg, qg = linalg.safe_psd_eigh(g)
            cache.update(inputs_factor_eigenvalues=a, outputs_factor_eigenvalues=sg, outputs_factor_eigen_vectors=qg)
        elif eigenvalues or "inputs_factor_eigenvalues" in cache:
            cache.update(inputs_factor_eigenvalues=a, outputs_factor_eigenvalues=linalg.safe_eigvalsh(g))
        if approx_powers:
            a_d, g_d = self._damped(a, g, blocks._div(identity_weight, self.fixed_scale()))
            cache["-1"] = {
                "inputs_factor": 1 / a_d,
                "outputs_factor": linalg.psd_inv(g_d),
                "identity_weight": jnp.asarray(identity_weight, g.dtype),
            }
        state.cache = cache or None
        return state

    def _to_dense_unscaled(self, state):
        a, g = self._factors(state)
        return jnp.kron(jnp.diag(a), g)


blocks.set_default_tag_to_block_ctor("embedding", EmbeddingKroneckerFactored)


# ----------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------


def match_embedding(program: Program, idx: int, ctx: detection.Context) -> detection.Match | None:
    """``table[ids]``: a ``gather`` of whole rows of a single-use ``(vocab, d)`` parameter.

    Covers ``jnp.take``/indexing (flax, nnx, haiku) and equinox's two-column
    indices whose second column is clamped to 0.
    """
    node = program.nodes[idx]
    if node.primitive.name != "gather" or len(node.inputs) != 2 or node.outputs[0] is None:
        return None
    operand, indices = node.inputs
    found = detection.cast_source(program, ctx, operand)
    if found is None or isinstance(indices, Lit):
        return None
    table, casts = found
    t_shape = tuple(program.avals[table].shape)
    if len(t_shape) != 2 or not jnp.issubdtype(program.avals[indices].dtype, jnp.integer):
        return None
    params = node.params
    dn = params["dimension_numbers"]
    if tuple(params["slice_sizes"]) != (1, t_shape[1]):
        return None
    if tuple(getattr(dn, "operand_batching_dims", ())) or tuple(getattr(dn, "start_indices_batching_dims", ())):
        return None
    index_map = tuple(dn.start_index_map)
    collapsed = tuple(dn.collapsed_slice_dims)
    mode = getattr(params.get("mode"), "name", str(params.get("mode")))
    drops = "FILL" in mode.upper()
    if 0 not in index_map or collapsed not in ((), (0,)) or len(set(index_map)) != len(index_map):
        return None
    if 1 in index_map and drops:
        return None  # a non-zero column start would fill the row; only clamping modes make it harmless
    if program.avals[indices].shape[-1:] != (len(index_map),):
        return None
    out = node.outputs[0]
    feature_axis = tuple(dn.offset_dims)[-1]
    meta = {"id_column": index_map.index(0), "mode": "drop" if drops else "clip", "output_feature_axis": int(feature_axis)}
    return detection.Match(embedding, out, (indices,), (table,), meta, "embedding", frozenset({idx, *casts}))


detection.register_layer_matcher("embedding", match_embedding, ("embedding",), manual_meta_defaults={"mode": "clip"})
