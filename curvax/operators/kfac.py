"""A K-FAC operator built the way curvlinops' ``KFACLinearOperator`` is: its options and names.

``kfac(loss_fn, params, data, fisher_type=..., mc_samples=..., kfac_approx=...,
separate_weight_and_bias=...)`` runs a ``BlockDiagonalCurvature`` over the data and returns
``from_estimator``'s operator of the dataset mean. The names:

* ``FisherType``: curvlinops' ``FisherType`` members as curvax's strings (``FISHER_TO_ESTIMATION_MODE``
  maps them to the estimator's ``estimation_mode``);
* ``KFACType``: ``EXPAND`` / ``REDUCE`` (dense layers with extra position axes);
* ``separate_weight_and_bias(block_ctor)``: a block constructor whose Kronecker blocks keep a
  layer's weight and bias as two blocks, ``A_w (x) G`` and ``G`` (curvlinops' default),
  instead of one block with the bias as an extra row of ``A``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp

from curvax import blocks as blocks_lib
from curvax import linalg, utils
from curvax.estimators import BlockDiagonalCurvature
from curvax.layers.conv import ConvTwoKroneckerFactoredReduce
from curvax.operators.base import CurvatureOperator
from curvax.operators.blockwise import from_estimator

Array = jax.Array


class FisherType:
    """curvlinops' ``FisherType`` names as curvax strings (``fisher(kind=...)``, ``kfac(fisher_type=...)``)."""

    TYPE2 = "type-2"
    MC = "mc"
    EMPIRICAL = "empirical"
    FORWARD_ONLY = "forward-only"


class KFACType:
    """curvlinops' ``KFACType`` names: K-FAC-expand or K-FAC-reduce (Eschenhagen et al. 2023)."""

    EXPAND = "expand"
    REDUCE = "reduce"


FISHER_TO_ESTIMATION_MODE = {
    FisherType.TYPE2: "fisher_exact",
    FisherType.MC: "fisher_gradients",
    FisherType.EMPIRICAL: "fisher_empirical",
    FisherType.FORWARD_ONLY: "forward_only",
}
"""``FisherType`` -> ``BlockDiagonalCurvature`` ``estimation_mode``."""


def _name(value: Any, name: str, allowed: Iterable[str]) -> str:
    """A curvlinops enum member or string as its string value, checked against ``allowed``."""
    s = getattr(value, "value", value)
    allowed = tuple(allowed)
    if not isinstance(s, str) or s.lower() not in allowed:
        raise ValueError(f"`{name}` must be one of {list(allowed)}, got {value!r}.")
    return s.lower()


def fisher_type_name(fisher_type: Any) -> str:
    """``fisher_type`` (a ``FisherType`` string, or curvlinops' enum member) as curvax's string."""
    return _name(fisher_type, "fisher_type", FISHER_TO_ESTIMATION_MODE)


def check_mc_samples(mc_samples: Any, fisher_type: str) -> int:
    """curvlinops' rule: ``mc_samples >= 1``, and exactly 1 unless ``fisher_type`` is ``"mc"``."""
    k = utils.check_int(mc_samples, "mc_samples", 1)
    if k != 1 and fisher_type != FisherType.MC:
        raise ValueError(f"`mc_samples` must be 1 when `fisher_type` is {fisher_type!r} (only 'mc' samples), got {k}.")
    return k


# ----------------------------------------------------------------------------------
# separate_weight_and_bias
# ----------------------------------------------------------------------------------


def _is_plain_kronecker(block: Any) -> bool:
    return isinstance(block, blocks_lib.TwoKroneckerFactored) and not isinstance(
        block, blocks_lib.EigenvalueCorrectedKroneckerFactored
    )


@functools.lru_cache(maxsize=None)
def separate_bias_class(base: type) -> type:
    """The subclass of a Kronecker block class whose ``A`` has no weight-bias cross terms.

    A layer's block ``[W; b^T]`` then has ``A = [[A_w, 0], [0, 1]]`` and
    ``A (x) G = blockdiag(A_w (x) G, G)``: the weight's K-FAC block and the bias's ``G``, as
    curvlinops' ``separate_weight_and_bias=True`` (the bias's input factor is the mean of ones,
    1; its output factor is the layer's ``G``). Everything else (products, exact and damped
    inverses, eigenvalues) is the base block's, on this matrix.
    """
    if not (isinstance(base, type) and issubclass(base, blocks_lib.TwoKroneckerFactored)) or issubclass(
        base, blocks_lib.EigenvalueCorrectedKroneckerFactored
    ):
        raise TypeError(f"`base` must be a (non-EKFAC) TwoKroneckerFactored block class, got {base!r}.")

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None):
        state = base.update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name)
        if self.has_bias:  # the cross terms are zero before the update too, so zeroing after is exact
            a = state.inputs_factor.value
            state.inputs_factor.value = a.at[:-1, -1].set(0).at[-1, :-1].set(0)
        return state

    doc = f"``{base.__name__}`` with the weight and the bias as separate blocks (curvlinops' ``separate_weight_and_bias=True``)."
    return type(f"{base.__name__}SeparateWeightAndBias", (base,), {
        "update_curvature_matrix_estimate": update_curvature_matrix_estimate, "__doc__": doc,
        "__module__": __name__,
    })


def separate_weight_and_bias(block_ctor: Callable[..., Any]) -> Callable[..., Any]:
    """A block constructor building ``block_ctor``'s block with weight and bias as separate blocks.

    For ``layer_tag_to_block_ctor`` (e.g. ``{"dense": separate_weight_and_bias(curvax.DenseTwoKroneckerFactored)}``):
    Kronecker blocks are rebuilt as ``separate_bias_class(type(block))``; other blocks (diagonal,
    full, EKFAC, grouped convolutions) are returned unchanged.
    """
    if not callable(block_ctor):
        raise TypeError(f"`block_ctor` must be a block class or constructor, got {block_ctor!r}.")

    def ctor(layer_tag_eq: Any, name: str | None = None) -> Any:
        block = block_ctor(layer_tag_eq, name)
        if not _is_plain_kronecker(block):
            return block
        return separate_bias_class(type(block))(layer_tag_eq, name)

    ctor.__name__ = f"separate_weight_and_bias({getattr(block_ctor, '__name__', 'ctor')})"
    return ctor


# ----------------------------------------------------------------------------------
# The constructor
# ----------------------------------------------------------------------------------

_DENSE_TAGS = ("dense",)
_CONV_TAGS = ("conv1d", "conv2d", "conv3d")


def _conv_reduce(layer_tag_eq: Any, name: str | None = None) -> Any:
    """KFAC-reduce for a plain convolution; a grouped one has no reduce block (clear error)."""
    if (layer_tag_eq.meta or {}).get("feature_group_count", 1) != 1:
        raise NotImplementedError(
            f"kfac_approx='reduce' for the grouped convolution {name}: curvax has KFAC-reduce for plain "
            "convolutions only; use kfac_approx='expand' (one KFC block per group) for this layer."
        )
    return ConvTwoKroneckerFactoredReduce(layer_tag_eq, name)


def block_ctors(kfac_approx: Any = KFACType.EXPAND, separate: bool = True) -> dict[str, Any]:
    """The ``layer_tag_to_block_ctor`` of ``kfac``'s options (dense and convolution tags)."""
    approx = _name(kfac_approx, "kfac_approx", (KFACType.EXPAND, KFACType.REDUCE))
    if not isinstance(separate, bool):
        raise TypeError(f"`separate_weight_and_bias` must be a bool, got {separate!r}.")
    dense = blocks_lib.DenseTwoKroneckerFactoredReduce if approx == KFACType.REDUCE else blocks_lib.DenseTwoKroneckerFactored
    out: dict[str, Any] = {"dense": separate_weight_and_bias(dense) if separate else dense}
    for tag in _CONV_TAGS:
        if approx == KFACType.REDUCE:
            out[tag] = separate_weight_and_bias(_conv_reduce) if separate else _conv_reduce
        elif separate:
            out[tag] = separate_weight_and_bias(blocks_lib.get_default_tag_to_block_ctor(tag))
    return out


def _is_ekfac(block: Any) -> bool:
    return isinstance(block, blocks_lib.EigenvalueCorrectedKroneckerFactored)


def with_kronecker_eigenbasis(estimator: BlockDiagonalCurvature, state: Any) -> Any:
    """``state`` with every EKFAC block's basis set to its Kronecker factors' eigenvectors and its
    eigenvalue correction emptied (zero weight), ready to be measured again in that basis.

    The basis is ``(Q_A, Q_G)`` from ``eigh`` of the block's factors ``A``, ``G`` (their scale does
    not change eigenvectors); other blocks' states are returned unchanged.
    """
    states = []
    for b, s in zip(estimator.blocks, state.blocks_states):
        if _is_ekfac(b):
            s = jax.tree_util.tree_map(lambda x: x, s)  # a structural copy
            _, qa = linalg.safe_psd_eigh(s.inputs_factor.value)
            _, qg = linalg.safe_psd_eigh(s.outputs_factor.value)
            s.cache = dict(s.cache or {}, inputs_factor_eigen_vectors=qa, outputs_factor_eigen_vectors=qg)
            s.eigenvalue_correction = blocks_lib.WeightedMovingAverage.zeros_like(s.eigenvalue_correction.value)
        states.append(s)
    return type(state)(tuple(states))


def _keep_corrections(estimator: BlockDiagonalCurvature, factors: Any, corrected: Any) -> Any:
    """``factors``' block states with the EKFAC blocks' basis and corrections from ``corrected``."""
    states = []
    for b, f, c in zip(estimator.blocks, factors.blocks_states, corrected.blocks_states):
        if _is_ekfac(b):
            f = jax.tree_util.tree_map(lambda x: x, f)
            f.cache, f.eigenvalue_correction = c.cache, c.eigenvalue_correction
        states.append(f)
    return type(factors)(tuple(states))


def _batches(data: Any) -> tuple:
    if isinstance(data, list):
        return tuple(data)
    if isinstance(data, (tuple, dict)) or hasattr(data, "shape"):
        return (data,)
    return tuple(data)  # an iterable of batches, read once


def kfac(
    loss_fn: Callable[..., Any], params: Any, data: Any, fisher_type: Any = FisherType.MC, mc_samples: int = 1,
    kfac_approx: Any = KFACType.EXPAND, separate_weight_and_bias: bool = True, rng: Any = None,
    num_data: int | None = None, batch_size_extractor: Callable[[Any], int] | None = None,
    layer_tag_to_block_ctor: dict[str, Any] | None = None, curvature_dtype: Any = None,
) -> CurvatureOperator:
    """The K-FAC operator of the mean loss over ``data``, with curvlinops' ``KFACLinearOperator`` options.

    ``loss_fn(params, batch)`` registers its losses (``curvax.register_*_loss``). ``data``: one
    batch or a list / iterable of batches (read once). The defaults are curvlinops':
    ``fisher_type="mc"`` with ``mc_samples`` sampled targets per example (each sample is one
    estimator update; their factors are averaged), ``kfac_approx="expand"``,
    ``separate_weight_and_bias=True``. Batch ``i`` of size ``B_i`` weighs ``B_i`` in the factors'
    running means, so they are the dataset's means; with ``num_data`` the operator is scaled by
    ``sum_i B_i / num_data``. ``rng`` (a ``jax.random`` key; default ``PRNGKey(0)``) draws the
    MC targets. ``layer_tag_to_block_ctor`` entries override the option's blocks per tag.
    Returns ``from_estimator(estimator, state)`` (``K.estimator``, ``K.state`` hold both).
    ``curvature_dtype`` (float32 or float64) is the factors' dtype; by default the parameters'
    dtype, at least float32 (a bfloat16 model's factors are float32).

    EKFAC: with an eigenvalue-corrected block for a tag (``layer_tag_to_block_ctor={"dense":
    curvax.DenseEigenvalueCorrected}``), the data are read twice, as curvlinops'
    ``EKFACLinearOperator`` does: the first pass estimates the Kronecker factors ``A``, ``G``; the
    block's eigenbasis is set to ``Q_A (x) Q_G`` (their eigenvectors); the second pass (the same
    batches and MC targets) measures the corrected eigenvalues, the gradients' second moments in
    that basis, ``s = mean_n (Q_A^T V_n Q_G)^2``. The operator is ``(Q_A (x) Q_G) diag(s)
    (Q_A (x) Q_G)^T`` per such layer (not the diagonal Fisher an identity basis would give).
    """
    ftype = fisher_type_name(fisher_type)
    k = check_mc_samples(mc_samples, ftype)
    ctors = block_ctors(kfac_approx, separate_weight_and_bias)
    ctors.update(layer_tag_to_block_ctor or {})
    batches = _batches(data)
    if not batches:
        raise ValueError("`data` has no batches.")
    extract = batch_size_extractor or utils.default_batch_size_extractor
    sizes = [int(extract(b)) for b in batches]
    rng = jax.random.PRNGKey(0) if rng is None else rng
    mode = FISHER_TO_ESTIMATION_MODE[ftype]
    est = BlockDiagonalCurvature(loss_fn, layer_tag_to_block_ctor=ctors, curvature_dtype=curvature_dtype)
    state = est.init(rng, (params, batches[0]), None, None)

    @functools.partial(jax.jit, static_argnums=(2,))
    def update(state: Any, batch: Any, size: int, key: Array) -> Any:
        return est.update_curvature_matrix_estimate(state, 1.0, float(size), size, key, (params, batch), estimation_mode=mode)

    def run(state: Any) -> Any:
        for i, (batch, size) in enumerate(zip(batches, sizes)):
            for j in range(k):
                state = update(state, batch, size, jax.random.fold_in(jax.random.fold_in(rng, i), j))
        return state

    state = run(state)
    if any(_is_ekfac(b) for b in est.blocks):
        state = _keep_corrections(est, state, run(with_kronecker_eigenbasis(est, state)))
    op = from_estimator(est, state)
    if num_data is not None:
        n = utils.check_int(num_data, "num_data", 1)
        if n != sum(sizes):
            return (sum(sizes) / n) * op
    return op
