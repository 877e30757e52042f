"""The operator of a block-diagonal curvature estimate (K-FAC, EKFAC, diagonal, full ... blocks).

``from_estimator(estimator, state)`` is the matrix ``estimator.to_dense_matrix(state)`` as an
operator. Every method works block by block through the blocks' own API
(``multiply_matpower``, ``eigenvalues``, ``inverse_diagonal``) plus closed forms for
Kronecker-factored blocks ``s A (x) G``: ``tr = s tr(A) tr(G)``, ``||.||_F = s ||A||_F ||G||_F``,
eigenvalues ``s a_i g_j``. Nothing builds a ``dim x dim`` matrix unless ``to_dense()`` is called.

Each block is represented in one of two forms:

* exact: ``(C_b + w I)^p`` with the block's curvature ``C_b`` (any block type);
* factored (Kronecker blocks only): ``(A' + d_A I)^p (x) (G' + d_G I)^p`` with
  ``A' = sqrt(s) A`` and ``G' = sqrt(s) G``: per-factor damping, as in ``inverse(exact=False)``
  (pi-adjusted, Martens & Grosse 2015 section 6.3; what kfac-jax's approximate inverse uses) or
  a ``(d_A, d_G)`` tuple.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from curvax import blocks as blocks_lib
from curvax import linalg
from curvax.estimators import BlockDiagonalCurvature
from curvax.operators.base import (
    CurvatureOperator,
    ParameterSpace,
    _register,
    check_damping,
    check_exact,
    check_top_k,
    clamp_null,
    is_concrete,
    is_static_zero,
    static_power,
)

Array = jax.Array

EXACT = "exact"
FACTORED = "factored"


def _is_kronecker(block: Any) -> bool:
    return isinstance(block, blocks_lib.TwoKroneckerFactored) and not isinstance(
        block, blocks_lib.EigenvalueCorrectedKroneckerFactored
    )


def _scaled_factors(block: Any, state: Any) -> tuple[Array, Array]:
    """``(sqrt(s) A, sqrt(s) G)``: the block's matrix is their Kronecker product."""
    root = jnp.sqrt(jnp.asarray(block.scale(state, False), block.dtype))
    a = linalg.symmetrize(state.inputs_factor.value)
    g = linalg.symmetrize(state.outputs_factor.value)
    return a * root, g * root


def _damped_factors(block: Any, state: Any, damping: tuple[Array, Array]) -> tuple[Array, Array]:
    a, g = _scaled_factors(block, state)
    return a + damping[0] * jnp.eye(a.shape[0], dtype=a.dtype), g + damping[1] * jnp.eye(g.shape[0], dtype=g.dtype)


def _trace(m: Array) -> Array:
    """``tr(m)`` without a temporary copy of ``m`` (``jnp.trace`` makes one)."""
    return jnp.sum(jnp.diagonal(m))


def _lean_eigvalsh(m: Array) -> Array:
    """Eigenvalues of a PSD factor clipped at 0, with one temporary copy of ``m`` (LAPACK's).

    ``linalg.safe_eigvalsh`` adds a fallback eigendecomposition (4 copies); here a failed
    decomposition gives ``nan``.
    """
    return jnp.maximum(jnp.linalg.eigvalsh(m, symmetrize_input=False), 0)


def _pow(s: Array, p: Any) -> Array:
    return linalg._pow(s, p)


def _diag_of_power(m: Array, p: Any) -> Array:
    """``diag(m^p)`` for a PSD ``m`` from its eigendecomposition (``diag(m)`` for ``p == 1``)."""
    if p == 1:
        return jnp.diagonal(m)
    s, q = linalg.safe_psd_eigh(m)
    return (q**2) @ _pow(s, p)


def _parameter_space(estimator: BlockDiagonalCurvature) -> ParameterSpace:
    pj = estimator.processed_jaxpr
    avals = [pj.program.avals[pj.program.input_keys[pj.params_offset + i]] for i in range(pj.num_params)]
    template = jax.tree_util.tree_unflatten(pj.params_tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    return ParameterSpace.from_tree(template)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class BlockDiagonalOperator(CurvatureOperator):
    """A block-diagonal curvature ``(C + w I)^p`` (or per-factor damped Kronecker blocks).

    Build it with ``from_estimator``; ``inverse``, ``power`` and ``damped`` return new ones.
    ``dampings[i]`` is the block's ``w`` (exact form) or ``(d_A, d_G)`` (factored form).
    """

    state: Any
    dampings: tuple
    estimator: BlockDiagonalCurvature
    space: ParameterSpace
    modes: tuple
    exponent: Any = 1
    # Per block: ``(sa, qa, sg, qg)``, the eigendecompositions of a Kronecker block's scaled
    # factors ``A'``, ``G'`` computed once by ``factorized()``, or None (computed on each call).
    eigen: tuple | None = None

    # --- helpers ----------------------------------------------------------------------

    def _blocks(self) -> tuple:
        return tuple(zip(self.estimator.blocks, self.state.blocks_states, self.dampings, self.modes))

    def _eigen(self, i: int) -> tuple | None:
        return None if self.eigen is None else self.eigen[i]

    def _cached_values(self, e: tuple, w: Any, mode: str) -> Array:
        """A factorized Kronecker block's eigenvalues (``in x out``), damped and powered."""
        sa, _, sg, _ = e
        if mode == FACTORED:
            return jnp.outer(_pow(sa + w[0], self.exponent), _pow(sg + w[1], self.exponent))
        return _pow(jnp.outer(sa, sg) + w, self.exponent)

    def factorized(self) -> "BlockDiagonalOperator":
        """The same operator with its Kronecker blocks' factor eigendecompositions computed now.

        Every later product, inverse, power, log-determinant, eigenvalue and diagonal of it (and
        of the operators ``inverse``/``power``/``damped`` derive from it, whatever their damping)
        reuses them instead of decomposing the factors again: the pattern for many solves or
        log-determinants with one curvature (curvlinops keeps its inverse factors the same way).
        Costs one ``eigh`` per factor now and two factor-sized matrices per factor of memory.
        Other blocks (EKFAC, diagonal, full) keep computing from their statistics.
        """
        eigen = []
        for b, s, _, _ in self._blocks():
            if _is_kronecker(b):
                a, g = _scaled_factors(b, s)
                sa, qa = linalg.safe_psd_eigh(a)
                sg, qg = linalg.safe_psd_eigh(g)
                eigen.append((sa, qa, sg, qg))
            else:
                eigen.append(None)
        return self._replace(eigen=tuple(eigen))

    def _to_tree(self, per_block: Any) -> Any:
        return self.estimator.blocks_vectors_to_params_vector(per_block)

    def _block_eigenvalues(self, b: Any, s: Any, w: Any, mode: str, e: tuple | None = None) -> Array:
        if e is not None:
            return self._cached_values(e, w, mode).ravel()
        if mode == FACTORED:
            a, g = _damped_factors(b, s, w)
            return jnp.outer(_pow(linalg.safe_eigvalsh(a), self.exponent), _pow(linalg.safe_eigvalsh(g), self.exponent)).ravel()
        return _pow(jnp.ravel(b.eigenvalues(s, False)) + w, self.exponent)

    # --- products -----------------------------------------------------------------------

    def _matvec_tree(self, tree: Any) -> Any:
        vecs = self.estimator.params_vector_to_blocks_vectors(tree)
        out = []
        p = self.exponent
        for i, ((b, s, w, mode), v) in enumerate(zip(self._blocks(), vecs)):
            e = self._eigen(i)
            if e is not None:
                _, qa, _, qg = e
                m = b.parameters_shaped_list_to_array(v)
                r = qa @ ((qa.T @ m @ qg) * self._cached_values(e, w, mode)) @ qg.T
                out.append(tuple(x.astype(y.dtype) for x, y in zip(b.array_to_parameters_shaped_list(r), v)))
                continue
            if mode == EXACT:
                out.append(b.multiply_matpower(s, v, w, p, True, False))
                continue
            a, g = _damped_factors(b, s, w)
            m = b.parameters_shaped_list_to_array(v)
            if p == 1:
                r = a @ m @ g
            elif p == -1:
                r = linalg.kronecker_solve(a, g, m)
            else:
                r = linalg.psd_matrix_power(a, p) @ m @ linalg.psd_matrix_power(g, p)
            out.append(tuple(x.astype(y.dtype) for x, y in zip(b.array_to_parameters_shaped_list(r), v)))
        return self._to_tree(tuple(out))

    # --- closed forms --------------------------------------------------------------------

    def eigenvalues(self) -> Array:
        """All eigenvalues, ascending (per block: the block's eigenvalues, damped and powered)."""
        return jnp.sort(jnp.concatenate([
            self._block_eigenvalues(b, s, w, m, self._eigen(i)) for i, (b, s, w, m) in enumerate(self._blocks())
        ]))

    def _accumulate(self, per_block: Any, from_values: Any) -> Array:
        """``sum_b per_block(b, s, w, mode)`` over the blocks; ``from_values(eigenvalues)`` for a
        factorized Kronecker block (except at power 1 in exact form, cheaper from the factors)."""
        total = jnp.zeros([], self.dtype)
        for i, (b, s, w, mode) in enumerate(self._blocks()):
            e = self._eigen(i)
            if e is not None and not (self.exponent == 1 and mode == EXACT):
                # closed forms from the cached eigenvalues (power 1 exact: from the factors, cheaper)
                total = total + from_values(self._cached_values(e, w, mode))
            else:
                total = total + per_block(b, s, w, mode)
        return total

    def trace(self) -> Array:
        """``tr`` block by block; ``s tr(A) tr(G)`` (+ ``w dim``) for an undamped-power Kronecker block."""

        def one(b: Any, s: Any, w: Any, mode: str) -> Array:
            if mode == FACTORED:
                a, g = _damped_factors(b, s, w)
                if self.exponent == 1:
                    return _trace(a) * _trace(g)
                return jnp.sum(_pow(linalg.safe_eigvalsh(a), self.exponent)) * jnp.sum(_pow(linalg.safe_eigvalsh(g), self.exponent))
            if self.exponent == 1 and _is_kronecker(b):
                scale = jnp.asarray(b.scale(s, False), b.dtype)
                return scale * _trace(s.inputs_factor.value) * _trace(s.outputs_factor.value) + w * b.dim
            return jnp.sum(self._block_eigenvalues(b, s, w, mode))

        return self._accumulate(one, jnp.sum)

    def frobenius_norm(self) -> Array:
        """``||.||_F``; ``||A'||_F ||G'||_F`` for an undamped Kronecker block (``+ 2 w tr + w^2 dim`` when damped)."""

        def one(b: Any, s: Any, w: Any, mode: str) -> Array:
            if mode == FACTORED:
                ea, eg = (linalg.safe_eigvalsh(x) for x in _damped_factors(b, s, w))
                return jnp.sum(_pow(ea, 2 * self.exponent)) * jnp.sum(_pow(eg, 2 * self.exponent))
            if self.exponent == 1 and _is_kronecker(b):
                scale = jnp.asarray(b.scale(s, False), b.dtype)
                a, g = s.inputs_factor.value, s.outputs_factor.value  # symmetric up to round-off
                return (scale**2 * jnp.sum(a * a) * jnp.sum(g * g) + 2 * w * scale * _trace(a) * _trace(g)
                        + w**2 * b.dim)
            return jnp.sum(self._block_eigenvalues(b, s, w, mode) ** 2)

        return jnp.sqrt(self._accumulate(one, lambda ev: jnp.sum(ev**2)))

    def _null_clamped_eigenvalues(self, b: Any, s: Any) -> Array:
        """A non-Kronecker block's (undamped) eigenvalues with its numerical null space set to 0.

        Diagonal blocks' entries are exact (no decomposition): only negatives are clipped. EKFAC
        blocks' corrected eigenvalues at or below ``rank_tolerance`` with ``n = max(d_A, d_G)``
        (the decomposed factors' order), other blocks' with ``n = dim_b``, become 0.
        """
        ev = jnp.ravel(b.eigenvalues(s, False))
        if isinstance(b, (blocks_lib.Diagonal, blocks_lib.ScaledIdentity)):
            return jnp.maximum(ev, 0)
        if isinstance(b, blocks_lib.EigenvalueCorrectedKroneckerFactored):
            # second moments in the factors' eigenbasis: the round-off is the factors' (order max(d_A, d_G))
            return clamp_null(ev, max(s.inputs_factor.value.shape[0], s.outputs_factor.value.shape[0]))
        return clamp_null(ev, int(b.dim))

    def logdet(self, damping: Any = 0.0) -> Array:
        """``log det(K + damping I)`` from the blocks' eigenvalues; ``-inf`` when (numerically) singular.

        Numerically singular: every eigendecomposed PSD matrix (a Kronecker block's factors
        ``A'``, ``G'``; a full block; an EKFAC block's corrected eigenvalues, with ``n`` its
        factors' larger order) has its eigenvalues at or below
        ``n * eps * largest`` (``n`` its order, ``eps`` the dtype's machine epsilon:
        ``base.rank_tolerance``, ``numpy.linalg.matrix_rank``'s rule) set to exactly 0 before the
        block's damping, power and ``damping`` are applied exactly. So an undamped singular
        factor gives ``-inf`` (not a finite round-off value or ``nan``) and ``damping > 0``
        gives the exact ``log(damping)`` on the null space. Factorized operators use the same rule
        on their cached eigenvalues.

        A Kronecker block's eigenvalues are products of its factors' (one eigenvalue
        decomposition of each factor, summed without forming the products). Kronecker blocks
        whose factors have the same shapes (a transformer's layers) go through one
        ``lax.scan``, so XLA reuses one workspace for all of them: the compiled temporary memory
        is a few copies of the largest factors, not a copy of every factor
        (``benchmarks/operator_memory.py``).
        """
        d = check_damping(damping)
        p = self.exponent

        def factor_values(x: Array) -> Array:
            return clamp_null(_lean_eigvalsh(x))

        def one(b: Any, s: Any, w: Any, mode: str) -> Array:
            if mode == FACTORED:
                a, g = _scaled_factors(b, s)
                ea, eg = factor_values(a) + w[0], factor_values(g) + w[1]
                if is_static_zero(d):
                    return p * (eg.size * jnp.sum(jnp.log(ea)) + ea.size * jnp.sum(jnp.log(eg)))
                return jnp.sum(jnp.log(_pow(jnp.outer(ea, eg), p) + d))
            return jnp.sum(jnp.log(_pow(self._null_clamped_eigenvalues(b, s) + w, p) + d))

        def kron(a: Array, g: Array, scale: Array, w: Array) -> Array:
            # (s A (x) G + w I)^p + d I: eigenvalues from the factors', summed fused
            ea, eg = factor_values(linalg.symmetrize(a)), factor_values(linalg.symmetrize(g))
            return jnp.sum(jnp.log(_pow(scale * jnp.outer(ea, eg) + w, p) + d))

        total = jnp.zeros([], self.dtype)
        groups: dict = {}
        for i, (b, s, w, mode) in enumerate(self._blocks()):
            e = self._eigen(i)
            if e is not None:
                sa, qa, sg, qg = e
                clamped = (clamp_null(sa), qa, clamp_null(sg), qg)
                total = total + jnp.sum(jnp.log(self._cached_values(clamped, w, mode) + d))
            elif mode == EXACT and _is_kronecker(b):
                a, g = s.inputs_factor.value, s.outputs_factor.value
                key = (a.shape, g.shape, str(a.dtype), str(g.dtype))
                groups.setdefault(key, []).append((a, g, jnp.asarray(b.scale(s, False), b.dtype), jnp.asarray(w, b.dtype)))
            else:
                total = total + one(b, s, w, mode)
        for items in groups.values():
            if len(items) == 1:
                total = total + kron(*items[0])
                continue
            scales = jnp.stack([it[2] for it in items])
            ws = jnp.stack([it[3] for it in items])

            def body(acc: Array, i: Array, items=items, scales=scales, ws=ws) -> tuple[Array, None]:
                a = jax.lax.switch(i, [lambda it=it: it[0] for it in items])
                g = jax.lax.switch(i, [lambda it=it: it[1] for it in items])
                return acc + kron(a, g, scales[i], ws[i]).astype(acc.dtype), None

            total = jax.lax.scan(body, total, jnp.arange(len(items)))[0]
        return total

    # --- eigenpairs -------------------------------------------------------------------------

    def _block_eigensystem(self, i: int, b: Any, s: Any, w: Any, mode: str) -> tuple[Array, Any]:
        """A block's eigenvalues (damped, powered; flat) and ``vector(j)``: the block-shaped
        parameter list of eigenvector ``j`` (unit norm)."""
        p = self.exponent
        if _is_kronecker(b) or isinstance(b, blocks_lib.EigenvalueCorrectedKroneckerFactored):
            if _is_kronecker(b):
                e = self._eigen(i)
                if e is None:
                    a, g = _scaled_factors(b, s)
                    sa, qa = linalg.safe_psd_eigh(a)
                    sg, qg = linalg.safe_psd_eigh(g)
                    e = (sa, qa, sg, qg)
                values = self._cached_values(e, w, mode).ravel()
                qa, qg = e[1], e[3]
            else:  # EKFAC: the basis in its cache, the corrected eigenvalues
                qa, qg = s.cache["inputs_factor_eigen_vectors"], s.cache["outputs_factor_eigen_vectors"]
                values = _pow(jnp.ravel(b.eigenvalues(s, False)) + w, p)
            dg = qg.shape[1]

            def vector(j: Array, b=b, qa=qa, qg=qg, dg=dg) -> tuple:
                return b.array_to_parameters_shaped_list(jnp.outer(qa[:, j // dg], qg[:, j % dg]))

            return values, vector
        shapes = b.parameters_shapes
        sizes = np.cumsum([int(math.prod(sh)) for sh in shapes])[:-1]

        def split(x: Array, shapes=shapes, sizes=sizes) -> tuple:
            return tuple(y.reshape(sh) for y, sh in zip(jnp.split(x, sizes), shapes))

        if isinstance(b, (blocks_lib.Diagonal, blocks_lib.ScaledIdentity)):
            ones = tuple(jnp.ones(sh, b.dtype) for sh in shapes)
            diag = jnp.concatenate([jnp.ravel(x) for x in b.multiply_matpower(s, ones, w, p, True, False)])

            def unit(j: Array, n=diag.size, dtype=diag.dtype, split=split) -> tuple:
                return split(jax.nn.one_hot(j, n, dtype=dtype))

            return diag, unit
        eye = jnp.eye(b.dim, dtype=b.dtype)

        def col(e: Array, b=b, s=s, split=split) -> Array:
            return jnp.concatenate([jnp.ravel(x) for x in b.multiply_matpower(s, split(e), 0.0, 1, True, False)])

        m = jax.vmap(col, in_axes=1, out_axes=1)(eye)
        ev, q = jnp.linalg.eigh((m + m.T) / 2)
        values = _pow(jnp.maximum(ev, 0) + w, p)

        def dense_vector(j: Array, q=q, split=split) -> tuple:
            return split(q[:, j])

        return values, dense_vector

    def eigenpairs(self, k: int, key: Any = None, num_iterations: int | None = None) -> tuple[Array, Array]:
        """The ``k`` largest eigenvalues (descending) and unit eigenvectors, exactly.

        Per block: a Kronecker block's pairs are ``(s a_i g_j + w)^p`` with
        ``vec(q_A,i q_G,j^T)`` from its factors' eigendecompositions (cached by ``factorized()``),
        an EKFAC block's its corrected eigenvalues in its Kronecker eigenbasis, a diagonal
        block's its entries with unit vectors, other blocks' from ``eigh`` of their dense matrix.
        The top ``min(k, dim_b)`` of every block are merged and the largest ``k`` kept. Returns
        ``(values (k,), vectors (dim, k))``, flat columns (``K.space.unflatten`` gives pytrees).
        ``key``/``num_iterations`` are unused (no iteration).
        """
        k = check_top_k(k, self.dim)
        zeros = [tuple(jnp.zeros(sh, b.dtype) for sh in b.parameters_shapes) for b in self.estimator.blocks]
        all_values, all_vectors = [], []
        for i, (b, s, w, mode) in enumerate(self._blocks()):
            values, vector = self._block_eigensystem(i, b, s, w, mode)
            top, idx = jax.lax.top_k(values, min(k, int(values.size)))

            def embed(j: Array, i=i, vector=vector) -> Array:
                per_block = list(zeros)
                per_block[i] = vector(j)
                return self.space.flatten(self._to_tree(tuple(per_block)))

            all_values.append(top)
            all_vectors.append(jax.vmap(embed)(idx))
        values = jnp.concatenate(all_values)
        top, idx = jax.lax.top_k(values, k)
        return top, jnp.concatenate(all_vectors)[idx].T

    def det(self, damping: Any = 0.0) -> Array:
        """``det(K + damping I) = exp(logdet)`` (overflows for large models: prefer ``logdet``)."""
        return jnp.exp(self.logdet(damping))

    def diagonal(self) -> Array:
        """The diagonal as a flat vector: closed forms for Kronecker and diagonal blocks, the
        blocks' ``inverse_diagonal`` for inverses, a block's dense matrix otherwise."""
        out = []
        p = self.exponent
        for i, (b, s, w, mode) in enumerate(self._blocks()):
            e = self._eigen(i)
            if e is not None:
                _, qa, _, qg = e
                out.append(b.array_to_parameters_shaped_list((qa**2) @ self._cached_values(e, w, mode) @ (qg**2).T))
            elif mode == FACTORED:
                a, g = _damped_factors(b, s, w)
                out.append(b.array_to_parameters_shaped_list(jnp.outer(_diag_of_power(a, p), _diag_of_power(g, p))))
            elif _is_kronecker(b):
                a, g = _scaled_factors(b, s)
                if p == 1:
                    arr = jnp.outer(jnp.diagonal(a), jnp.diagonal(g)) + w
                else:
                    sa, qa = linalg.safe_psd_eigh(a)
                    sg, qg = linalg.safe_psd_eigh(g)
                    arr = (qa**2) @ _pow(jnp.outer(sa, sg) + w, p) @ (qg**2).T
                out.append(b.array_to_parameters_shaped_list(arr))
            elif isinstance(b, (blocks_lib.Diagonal, blocks_lib.ScaledIdentity)):
                ones = tuple(jnp.ones(shape, b.dtype) for shape in b.parameters_shapes)
                out.append(b.multiply_matpower(s, ones, w, p, True, False))
            elif p == -1:
                out.append(b.inverse_diagonal(s, w))
            else:
                eye = jnp.eye(b.dim, dtype=b.dtype)
                sizes = np.cumsum([int(math.prod(sh)) for sh in b.parameters_shapes])[:-1]

                def col(e: Array, b=b, s=s, w=w) -> Array:
                    parts = [x.reshape(sh) for x, sh in zip(jnp.split(e, sizes), b.parameters_shapes)]
                    return jnp.concatenate([jnp.ravel(x) for x in b.multiply_matpower(s, parts, w, p, True, False)])

                diag = jnp.diagonal(jax.vmap(col, in_axes=1, out_axes=1)(eye))
                out.append(tuple(x.reshape(sh) for x, sh in zip(jnp.split(diag, sizes), b.parameters_shapes)))
        return self.space.flatten(self._to_tree(tuple(out)))

    # --- new operators --------------------------------------------------------------------

    def _replace(self, **changes: Any) -> "BlockDiagonalOperator":
        return dataclasses.replace(self, **changes)

    def damped(self, damping: Any) -> CurvatureOperator:
        """``K + damping I`` (closed forms kept when ``K`` is an exact-form operator with power 1)."""
        d = check_damping(damping)
        if self.exponent == 1 and all(m == EXACT for m in self.modes):
            return self._replace(dampings=tuple(w + d for w in self.dampings))
        return super().damped(d)

    def power(self, p: Any) -> "BlockDiagonalOperator":
        """``K^p`` for any real static ``p`` (block by block, exactly)."""
        return self._replace(exponent=static_power(self.exponent * static_power(p, "p"), "p"))

    def inverse(self, damping: Any = 0.0, exact: bool = True, min_damping: Any = 0.0) -> "BlockDiagonalOperator":
        """``(K + damping I)^-1`` block by block.

        ``exact=True``: the exact inverse of every damped block (``damping`` a scalar; raised to
        ``min_damping``). ``exact=False`` (on the undamped ``K``): Kronecker blocks invert
        ``(A' + d_A I) (x) (G' + d_G I)`` with ``d_A = max(pi sqrt(damping), min_damping)``,
        ``d_G = max(sqrt(damping) / pi, min_damping)``, ``pi = sqrt((tr A'/dim_A) / (tr G'/dim_G))``
        (pi-adjusted damping, as kfac-jax's approximate inverse; a 1 x 1 factor ``g`` takes none and
        the other ``damping / g``, see ``curvax.linalg.pi_damping``), or ``(d_A, d_G) = damping`` when
        a tuple is given (each raised to ``min_damping``); other blocks are inverted exactly.
        A singular result (zero damping on a singular block) raises a ValueError when the values
        are concrete; under ``jit`` it gives ``inf``.
        """
        exact = check_exact(exact)
        floor = check_damping(min_damping, "min_damping")
        if isinstance(damping, (tuple, list)):
            if exact:
                raise ValueError("A per-factor `damping` tuple (d_A, d_G) needs `exact=False`; exact damping is one scalar.")
            if len(damping) != 2:
                raise ValueError(f"A per-factor `damping` must be a pair (d_A, d_G), got {len(damping)} values.")
            pair = (check_damping(damping[0], "damping[0]"), check_damping(damping[1], "damping[1]"))
            d = None
        else:
            d = check_damping(damping)
            pair = None
        if exact:
            d = jnp.maximum(d, floor) if not is_static_zero(floor) else d
            dampings = []
            for b, s, w, mode in self._blocks():
                if self.exponent != 1 or mode == FACTORED:
                    if not is_static_zero(d):
                        raise NotImplementedError(
                            "inverse(damping > 0) of a powered or factor-damped operator has no closed form; "
                            "call `inverse` on the undamped operator."
                        )
                    dampings.append(w)
                else:
                    dampings.append(w + d)
            new = self._replace(dampings=tuple(dampings), exponent=static_power(-self.exponent))
        else:
            if self.exponent != 1 or any(m != EXACT for m in self.modes):
                raise ValueError("inverse(exact=False) applies to an operator of power 1 without factor damping.")
            dampings, modes = [], []
            for b, s, w, _ in self._blocks():  # a damped K + w I: w joins the damping
                if pair is None:
                    d_b = d + w
                elif not is_static_zero(w):
                    raise ValueError("A per-factor `damping` tuple needs the undamped operator.")
                if _is_kronecker(b):
                    if pair is not None:
                        da, dg = pair
                    else:
                        a, g = _scaled_factors(b, s)
                        ok, da, dg = linalg.pi_damping(
                            linalg.average_trace(a), linalg.average_trace(g), a.shape[-1], g.shape[-1], d_b
                        )
                        root = jnp.sqrt(d_b)
                        da, dg = jnp.where(ok, da, root), jnp.where(ok, dg, root)
                    dampings.append((jnp.maximum(da, floor), jnp.maximum(dg, floor)))
                    modes.append(FACTORED)
                else:
                    if pair is not None:
                        raise ValueError(
                            f"A per-factor `damping` tuple needs Kronecker-factored blocks, but {b.name} is a "
                            f"{type(b).__name__}; pass a scalar `damping`."
                        )
                    dampings.append(jnp.maximum(d_b, floor))
                    modes.append(EXACT)
            new = self._replace(dampings=tuple(dampings), modes=tuple(modes), exponent=-1)
        new._check_invertible()
        return new

    def _check_invertible(self) -> None:
        """Raises for a negative power of a singular block when the values are known now."""
        if self.exponent >= 0 or not is_concrete((self.state, self.dampings)):
            return
        for b, s, w, mode in self._blocks():
            zero = all(is_static_zero(x) for x in (w if mode == FACTORED else (w,)))
            if not zero:
                continue
            if mode == EXACT:
                ev = np.asarray(jnp.ravel(b.eigenvalues(s, False)))
            else:
                ev = np.concatenate([np.asarray(linalg.safe_eigvalsh(x)) for x in _damped_factors(b, s, w)])
            top = float(np.max(np.abs(ev))) if ev.size else 0.0
            if ev.size and float(np.min(ev)) <= ev.size * np.finfo(ev.dtype).eps * max(top, np.finfo(ev.dtype).tiny):
                raise ValueError(
                    f"Block {b.name} ({type(b).__name__}) is singular (smallest eigenvalue {float(np.min(ev)):.3g}) and "
                    "the `damping` is 0: pass `damping` > 0 to invert it."
                )


_register(BlockDiagonalOperator, ["state", "dampings", "eigen"], ["estimator", "space", "modes", "exponent"])


def from_estimator(estimator: BlockDiagonalCurvature, state: Any) -> BlockDiagonalOperator:
    """The operator of a ``BlockDiagonalCurvature`` state: ``estimator.to_dense_matrix(state)``, matrix-free."""
    if not isinstance(estimator, BlockDiagonalCurvature):
        raise TypeError(f"`estimator` must be a curvax BlockDiagonalCurvature, got {type(estimator).__name__}.")
    if estimator.blocks is None:
        raise ValueError("`estimator` has no blocks yet: call its `init` (or `finalize`) with example arguments.")
    states = getattr(state, "blocks_states", None)
    if states is None or len(states) != estimator.num_blocks:
        raise ValueError(
            f"`state` must be the estimator's state (a BlockDiagonalState with {estimator.num_blocks} block states), "
            f"got {type(state).__name__}."
        )
    n = estimator.num_blocks
    zero = jnp.zeros([], jnp.result_type(*[b.dtype for b in estimator.blocks]))
    return BlockDiagonalOperator(state, (zero,) * n, estimator, _parameter_space(estimator), (EXACT,) * n, 1)
