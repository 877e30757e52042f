"""Small, jit-safe linear-algebra helpers for positive semi-definite matrices.

Curvature factors are PSD in exact arithmetic but arrive slightly asymmetric
and slightly indefinite after float accumulation. Every helper here therefore
symmetrizes its input, clips negative eigenvalues, and falls back to a more
robust algorithm (selected with ``lax.cond``, never Python control flow on
traced values) when the fast one returns non-finite numbers: first the same
factorization in float64 (enabled locally with ``jax.enable_x64``, so a float32
program needs no global x64 flag), else an SVD (eigh) or a diagonal solve
(Cholesky).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import jax.scipy.linalg
from jax import lax

Array = jax.Array
Numeric = Any


def symmetrize(m: Array) -> Array:
    """``(m + m^T) / 2``: removes the asymmetry accumulated by float round-off."""
    return (m + jnp.swapaxes(m, -1, -2)) / 2


def map_decompositions(fn: Callable[..., Any], *xs: Any) -> Any:
    """``fn`` on every slice of ``xs`` along their leading axis, outputs stacked: ``vmap`` on
    accelerators, a ``lax.map`` (one loop, one slice at a time) on CPU.

    For functions that decompose matrices (``eigh``, Cholesky). On CPU jaxlib 0.10 spreads a
    batched LAPACK call over XLA's intra-op thread pool and blocks until its pieces finish;
    when as many batched calls as the pool has threads run at once (two on a 2-core machine),
    each holds a thread waiting for pieces that no free thread runs: the program hangs.
    A ``lax.map`` body holds one unbatched call, and the program stays one loop whatever the
    number of slices. The branch is chosen per platform when the program is lowered.
    """
    n = jax.tree_util.tree_leaves(xs)[0].shape[0]
    if n == 1:
        return jax.tree_util.tree_map(lambda y: y[None], fn(*jax.tree_util.tree_map(lambda x: x[0], xs)))
    return lax.platform_dependent(*xs, cpu=lambda *a: lax.map(lambda t: fn(*t), a), default=jax.vmap(fn))


def gram(x: Array, min_split: int = 400) -> Array:
    """``x^T x`` for a 2-D ``x``, with about 3/4 of the multiply-adds when ``x`` is wide.

    Curvature factors are Grams of activations or gradients; XLA has no
    symmetric rank-k update, so for ``x.shape[1] >= min_split`` the columns are
    split in two halves and only the blocks on and below the diagonal are
    multiplied, the upper block being the transpose of the lower one (10-15%
    faster factor statistics on CPU for 500-1000 wide layers).
    """
    d = x.shape[-1]
    if x.ndim != 2 or d < min_split:
        return x.T @ x
    h = d // 2
    x1, x2 = x[:, :h], x[:, h:]
    lower = x2.T @ x1
    return jnp.block([[x1.T @ x1, lower.T], [lower, x2.T @ x2]])


def _all_finite(*xs: Array) -> Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))


def sum_is_finite(*xs: Array) -> Array:
    """Whether every entry of ``xs`` is finite, tested on their sum (one scalar): a NaN or an
    infinity makes the sum non-finite. Finite entries whose sum overflows read as not finite,
    a false alarm. One reduction per array fuses with its producer, where an elementwise
    ``isfinite`` is copied into every fusion that reads the array."""
    return jnp.isfinite(sum(jnp.sum(x.astype(jnp.result_type(x, jnp.float32))) for x in xs))


def float64_retry_available(dtype: Any) -> bool:
    """Whether a failed ``dtype`` factorization can be redone in float64.

    True for floating dtypes narrower than float64 on backends with float64
    linear algebra (not TPU). The retry enables 64-bit types only locally, with
    the public ``jax.enable_x64`` context manager, so it works inside a jitted
    float32 program without turning x64 on globally.
    """
    return (
        jnp.issubdtype(dtype, jnp.floating)
        and jnp.dtype(dtype).itemsize < 8
        and jax.default_backend() != "tpu"
    )


def _eigh_in_float64(m: Array) -> tuple[Array, Array]:
    with jax.enable_x64(True):
        s, q = jnp.linalg.eigh(m.astype(jnp.float64))
    return s.astype(m.dtype), q.astype(m.dtype)


def safe_psd_eigh(m: Array) -> tuple[Array, Array]:
    """Eigen-decomposition ``m = Q diag(s) Q^T`` of a PSD matrix, eigenvalues clipped at 0.

    ``m`` is symmetrized first. If ``eigh`` returns non-finite values for a
    finite input (it can, for badly conditioned matrices on some backends), it
    is redone in float64 when ``float64_retry_available(m.dtype)``; otherwise
    (float64 input, TPU) the SVD is used: for a PSD matrix its left singular
    vectors and singular values are an eigen-decomposition. The fallback runs
    under ``lax.cond``, so it costs nothing unless needed. Returns ``(s, Q)``.
    """
    m = symmetrize(m)
    s, q = jnp.linalg.eigh(m)
    bad = jnp.logical_and(_all_finite(m), jnp.logical_not(_all_finite(s, q)))

    def fallback(_: Any) -> tuple[Array, Array]:
        if float64_retry_available(m.dtype):
            return _eigh_in_float64(m)
        u, sv, _vt = jnp.linalg.svd(m, full_matrices=True)
        return sv.astype(s.dtype), u.astype(q.dtype)

    s, q = lax.cond(bad, fallback, lambda _: (s, q), None)
    return jnp.maximum(s, 0), q


def safe_eigvalsh(m: Array) -> Array:
    """Eigenvalues of a PSD matrix (symmetrized first), clipped at 0.

    Non-finite results for a finite input are recomputed as in ``safe_psd_eigh``.
    """
    m = symmetrize(m)
    s = jnp.linalg.eigvalsh(m)
    bad = jnp.logical_and(_all_finite(m), jnp.logical_not(_all_finite(s)))
    s = lax.cond(bad, lambda _: jnp.sort(safe_psd_eigh(m)[0]), lambda _: s, None)
    return jnp.maximum(s, 0)


def psd_matrix_power(m: Array, power: Numeric) -> Array:
    """``m^power`` for a PSD matrix through its eigen-decomposition."""
    s, q = safe_psd_eigh(m)
    return (q * _pow(s, power)) @ q.T


def _pow(s: Array, power: Numeric) -> Array:
    """``s ** power`` with exact reciprocals for power -1 (no ``pow`` round-off)."""
    if isinstance(power, (int, float)) and power == -1:
        return 1 / s
    if isinstance(power, (int, float)) and power == 1:
        return s
    return jnp.power(s, power)


def _cholesky_solve(m: Array, b: Array) -> Array:
    return jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(m, lower=True), b)


def _cholesky_solve_in_float64(m: Array, b: Array) -> Array:
    with jax.enable_x64(True):
        x = _cholesky_solve(m.astype(jnp.float64), b.astype(jnp.float64))
    return x.astype(jnp.result_type(m.dtype, b.dtype))


def psd_solve(m: Array, b: Array) -> Array:
    """Solves ``m x = b`` for a symmetric positive-definite ``m`` (vector or matrix ``b``).

    Uses one Cholesky factorization. If that yields non-finite values while the
    inputs are finite (``m`` too ill-conditioned for its precision), the solve is
    redone in float64 when ``float64_retry_available(m.dtype)`` (under
    ``lax.cond``: no cost unless needed). If the result is still not finite
    (``m`` not positive definite), it falls back to the diagonal (Jacobi)
    approximation ``b / diag(m)``, so no NaN spreads.
    """
    m = symmetrize(m)
    x = _cholesky_solve(m, b)
    inputs_finite = _all_finite(m, b)
    if float64_retry_available(m.dtype):
        retry = jnp.logical_and(inputs_finite, jnp.logical_not(_all_finite(x)))
        x = lax.cond(retry, lambda _: _cholesky_solve_in_float64(m, b).astype(x.dtype), lambda _: x, None)
    d = jnp.diagonal(m)
    d = jnp.where(d > 0, d, jnp.maximum(jnp.max(jnp.abs(d)), jnp.finfo(m.dtype).tiny))
    jacobi = b / (d[:, None] if b.ndim == 2 else d)
    bad = jnp.logical_and(inputs_finite, jnp.logical_not(_all_finite(x)))
    return jnp.where(bad, jacobi, x)


def psd_inv(m: Array) -> Array:
    """Inverse of a symmetric positive-definite matrix (damped curvature factors).

    One Cholesky factorization and a solve against the identity. On CPU (jax 0.10) it
    runs as fast as an LU-based inverse, lowers and compiles faster (the autoencoder's
    16 factor inverses: the step program lowers 0.3 s and compiles 1 s faster) and is
    4x faster than an eigendecomposition. Damped factors are positive definite; an
    input that is not gives non-finite values, which the optimizer detects once per
    step (it then skips the update) rather than paying a check per block here. Every
    op in this function is compiled once per block: keep it minimal.
    """
    return symmetrize(_cholesky_solve(symmetrize(m), jnp.eye(m.shape[0], dtype=m.dtype)))


def average_trace(m: Array) -> Array:
    """``tr(m) / dim``: the "average diagonal" norm used by pi-adjusted damping."""
    return jnp.trace(m) / m.shape[-1]


def pi_damping(na: Array, ng: Array, dim_a: int, dim_g: int, damping: Numeric) -> tuple[Array, Array, Array]:
    """How pi-adjusted damping splits ``d`` between two Kronecker factors: ``(ok, w_A, w_G)``.

    ``na``/``ng`` are the factors' average diagonals and ``dim_a``/``dim_g`` their
    (static) sides. Two matrices get ``w_A = pi sqrt(d)``, ``w_G = sqrt(d) / pi`` with
    ``pi = sqrt(na / ng)`` (Martens & Grosse, 2015, section 6.3). A 1 x 1 factor ``g``
    takes no damping and the other factor gets ``d / g``, so that ``A_d (x) g = g A + d I``
    exactly: kfac-jax 0.0.8's rule for scalar factors (a layer with one output, e.g. a
    wavefunction's final layer, or one input). ``ok`` is false when either trace is not
    positive; callers then use ``sqrt(d) I`` for both factors (product ``d I``).
    """
    dtype = jnp.result_type(na, ng)
    d = jnp.asarray(damping, dtype)
    ok = jnp.logical_and(na > 0, ng > 0)
    na, ng = jnp.where(ok, na, 1), jnp.where(ok, ng, 1)
    zero = jnp.zeros((), dtype)
    if dim_g == 1:
        return ok, d / ng, zero
    if dim_a == 1:
        return ok, zero, d / na
    sqrt_d = jnp.sqrt(d)
    pi = jnp.sqrt(na / ng)
    return ok, pi * sqrt_d, sqrt_d / pi


def pi_adjusted_factors(a: Array, g: Array, damping: Numeric) -> tuple[Array, Array]:
    """Damped Kronecker factors ``(A + w_A I, G + w_G I)`` with ``A_d (x) G_d ~ A (x) G + d I``.

    The split of ``d`` is ``pi_damping``'s: balanced by the factors' average traces, exact
    when a factor is 1 x 1. If either average trace is not positive (a zero factor), both
    factors become ``sqrt(d) I``, whose product is ``d I``.
    """
    a = symmetrize(a)
    g = symmetrize(g)
    dtype = jnp.result_type(a.dtype, g.dtype)
    sqrt_d = jnp.sqrt(jnp.asarray(damping, dtype))
    ok, wa, wg = pi_damping(average_trace(a), average_trace(g), a.shape[-1], g.shape[-1], damping)
    eye_a = jnp.eye(a.shape[-1], dtype=a.dtype)
    eye_g = jnp.eye(g.shape[-1], dtype=g.dtype)
    a_d = jnp.where(ok, a + wa * eye_a, sqrt_d * eye_a)
    g_d = jnp.where(ok, g + wg * eye_g, sqrt_d * eye_g)
    return a_d.astype(a.dtype), g_d.astype(g.dtype)


def kronecker_product_mul(a: Array, g: Array, v: Array) -> Array:
    """``(A (x) G) vec(V)`` as a matrix: ``A V G`` for symmetric ``A`` and ``G``.

    ``vec`` is the row-major flattening of ``V`` (shape ``dim_A x dim_G``).
    """
    return a @ v @ g


def cholesky_solve(m: Array, b: Array) -> Array:
    """Solves ``m x = b`` for a positive-definite ``m`` by one Cholesky factorization, with no
    fallback: the optimizer's solve with damped factors, as ``psd_inv`` is its inverse.

    An ``m`` that is not positive definite in its precision gives non-finite values. The
    optimizer's ``curvax.step.precondition`` then redoes the whole preconditioned gradient once
    in float64 (one branch for every block), and skips and reports the update if that fails
    too: ``psd_solve``'s fallbacks under a ``lax.cond`` per call made a step that solves with
    every factor compile several times longer (``benchmarks/solve_compile.py``).
    """
    return _cholesky_solve(symmetrize(m), b)


def kronecker_solve(a: Array, g: Array, v: Array) -> Array:
    """``(A (x) G)^{-1} vec(V)`` as a matrix: ``A^{-1} V G^{-1}`` by two Cholesky solves
    (``cholesky_solve``: non-finite where a factor is not positive definite)."""
    left = cholesky_solve(a, v)
    return cholesky_solve(g, left.T).T


def kronecker_eigen_mul(
    qa: Array, sa: Array, qg: Array, sg: Array, v: Array, identity_weight: Numeric, power: Numeric
) -> Array:
    """``(A (x) G + w I)^p vec(V)`` from eigen-decompositions of ``A`` and ``G``.

    With ``A = Q_A S_A Q_A^T`` and ``G = Q_G S_G Q_G^T`` the Kronecker product has
    eigenvectors ``Q_A (x) Q_G`` and eigenvalues ``s_A s_G^T``, so the power acts
    elementwise in that basis. This is exact, for any real power.
    """
    inner = qa.T @ v @ qg
    lam = sa[:, None] * sg[None, :] + identity_weight
    return qa @ (inner * _pow(lam, power)) @ qg.T


def eigen_mul(q: Array, s: Array, v: Array, identity_weight: Numeric, power: Numeric) -> Array:
    """``(Q diag(s) Q^T + w I)^p v`` for a vector ``v``."""
    return q @ (_pow(s + identity_weight, power) * (q.T @ v))


def kronecker_eigen_basis_mul(qa: Array, qg: Array, s: Array, v: Array, identity_weight: Numeric, power: Numeric) -> Array:
    """``(Q diag(s) Q^T + w I)^p vec(V)`` with ``Q = Q_A (x) Q_G`` orthogonal, as a matrix.

    ``s`` has shape ``(dim_A, dim_G)``: entry ``(i, j)`` is the eigenvalue of
    the eigenvector ``q_A,i (x) q_G,j`` (no Kronecker structure assumed for it).
    """
    inner = qa.T @ v @ qg
    return qa @ (inner * _pow(s + identity_weight, power)) @ qg.T


# ----------------------------------------------------------------------------------
# Norms of PSD matrices (kfac-jax v0.0.8's ``psd_matrix_norm`` names)
# ----------------------------------------------------------------------------------

# The norm names kfac-jax v0.0.8 accepts (not all are norms: "one_over_dim" is ``1 / dim``).
NORM_TYPES: tuple[str, ...] = (
    "avg_diag", "trace", "median_diag", "median_eig", "one_over_dim", "1_norm", "2_norm", "avg_fro", "fro",
)
# Earlier curvax spellings, kept working.
_NORM_ALIASES = {"1norm": "1_norm", "2norm": "2_norm"}


def norm_type_name(norm_type: Any, arg_name: str = "norm_type") -> str:
    """``norm_type`` as one of ``NORM_TYPES`` (``"1norm"``/``"2norm"`` map to ``"1_norm"``/``"2_norm"``);
    a ``ValueError`` naming ``arg_name`` for anything else."""
    name = _NORM_ALIASES.get(norm_type, norm_type) if isinstance(norm_type, str) else None
    if name not in NORM_TYPES:
        raise ValueError(f"`{arg_name}` must be one of {', '.join(NORM_TYPES)}; got {norm_type!r}.")
    return name


def block_diagonal_psd_norm(blocks: Sequence[Array], norm_type: str) -> Array:
    """A norm of the PSD matrix ``blockdiag(...)`` of every square block in ``blocks``.

    ``blocks``: arrays of shape ``(count, b, b)`` (``count`` blocks of side ``b`` each), so a
    block-diagonal factor is normed without forming it. ``norm_type`` (``NORM_TYPES``):
    ``"avg_diag"`` (trace / dim), ``"trace"``, ``"median_diag"`` (median of the diagonal),
    ``"median_eig"`` (median eigenvalue), ``"one_over_dim"``, ``"1_norm"`` (largest absolute
    column sum), ``"2_norm"`` (largest eigenvalue), ``"avg_fro"`` (Frobenius / sqrt(dim)) or
    ``"fro"``. Eigenvalues are exact (``safe_eigvalsh``), not iterative estimates.
    """
    kind = norm_type_name(norm_type)
    blocks = [jnp.asarray(m) for m in blocks]
    dim = sum(m.shape[0] * m.shape[-1] for m in blocks)
    dtype = jnp.result_type(*blocks)
    if kind == "one_over_dim":
        return jnp.asarray(1.0 / dim, dtype)
    if kind in ("avg_diag", "trace", "median_diag"):
        diag = jnp.concatenate([jnp.diagonal(m, axis1=-2, axis2=-1).reshape(-1) for m in blocks])
        return {"avg_diag": jnp.sum(diag) / dim, "trace": jnp.sum(diag), "median_diag": jnp.median(diag)}[kind]
    if kind in ("fro", "avg_fro"):
        fro = jnp.sqrt(sum(jnp.sum(jnp.square(m)) for m in blocks))
        return fro if kind == "fro" else fro / jnp.sqrt(jnp.asarray(dim, dtype))
    if kind == "1_norm":
        return jnp.max(jnp.stack([jnp.max(jnp.sum(jnp.abs(m), axis=-2)) for m in blocks]))
    eigs = jnp.concatenate([
        m[:, 0, 0] if m.shape[-1] == 1 else map_decompositions(safe_eigvalsh, m).reshape(-1) for m in blocks
    ])
    return jnp.max(eigs) if kind == "2_norm" else jnp.median(eigs)


def psd_matrix_norm(matrix: Array, norm_type: str = "avg_diag") -> Array:
    """A norm of a PSD matrix given as a square matrix, a vector (the diagonal of a diagonal
    matrix) or a scalar (a 1 x 1 matrix); ``norm_type`` as for ``block_diagonal_psd_norm``."""
    m = jnp.asarray(matrix)
    if m.ndim == 2 and m.shape[0] == m.shape[1]:
        return block_diagonal_psd_norm([m[None]], norm_type)
    if m.ndim in (0, 1):
        return block_diagonal_psd_norm([m.reshape(-1, 1, 1)], norm_type)
    raise ValueError(f"`matrix` must be a square matrix, a vector (a diagonal) or a scalar; got shape {m.shape}.")
