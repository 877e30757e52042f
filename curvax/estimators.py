"""Curvature estimators: a model's curvature as a set of blocks, and exact products.

``BlockDiagonalCurvature`` owns one curvature block per layer of a traced
model. Updating it runs the model forward once, draws loss cotangents according
to the estimation mode, back-propagates them to every layer output, and hands
each block its layer's inputs and output gradients.

Normalisation convention (tested): the model's loss is the mean over the batch
of per-example losses, each registered loss contributing
``weight * sum(per-example values) / batch_size``. The estimated matrices are
then those of that mean loss, e.g. the Fisher ``(1/B) sum_n J_n^T F_n J_n``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from curvax import blocks as blocks_lib
from curvax import _generations, distributed, linalg, partitioned, tags, utils
from curvax.stacked import StackedBlock, slice_tag_eqn
from curvax.transforms import ProcessedJaxpr, _Cache, assemble_layer_data, zero_tangents

ESTIMATION_MODES = (
    "fisher_gradients",
    "fisher_empirical",
    "fisher_curvature_prop",
    "fisher_exact",
    "ggn_curvature_prop",
    "ggn_exact",
    "forward_only",
)
"""Estimation modes. ``forward_only`` is FOOF (Benzing 2022): Kronecker blocks keep
the input factor ``A`` and use the identity as gradient factor, so no backward
pass is run for the statistics; generic (diagonal) blocks get no curvature."""


def check_estimation_mode(mode: str, arg_name: str = "estimation_mode") -> str:
    if mode not in ESTIMATION_MODES:
        raise ValueError(f"`{arg_name}` must be one of {list(ESTIMATION_MODES)}, got {mode!r}.")
    return mode


def _statistics_leaves(block_state: Any) -> list[Any]:
    """The arrays of a block state that statistics updates write: every leaf but the ``cache``."""
    if dataclasses.is_dataclass(block_state) and not isinstance(block_state, type):
        return [
            leaf for f in dataclasses.fields(block_state) if f.name != "cache"
            for leaf in jax.tree_util.tree_leaves(getattr(block_state, f.name))
        ]
    return jax.tree_util.tree_leaves(block_state)


def statistics_are_finite(state: Any, pmap_axis_name: str | None = None) -> jax.Array:
    """One boolean scalar: every curvature statistic of ``state`` (caches excluded) is finite.

    ``state`` is a ``BlockDiagonalState`` (or one block's state). Inside a ``pmap`` over
    ``pmap_axis_name`` the answer is reduced over the devices (all must be finite), so that
    every device takes the same decision.
    """
    blocks_states = state.blocks_states if isinstance(state, BlockDiagonalState) else (state,)
    # ``sum(x * 0)`` is 0 when every entry of ``x`` is finite and NaN otherwise (inf * 0 and NaN
    # * 0 are NaN; no finite entry can overflow it): one add-reduction per leaf and one test,
    # which XLA compiles several times faster than a boolean all-reduction per leaf.
    zeros = [jnp.sum(x * 0) for s in blocks_states for x in _statistics_leaves(s)
             if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    finite = jnp.isfinite(sum(z.astype(jnp.result_type(*zeros)) for z in zeros)) if zeros else jnp.asarray(True)
    if utils.in_pmap(pmap_axis_name):
        finite = jax.lax.pmin(finite.astype(jnp.int32), pmap_axis_name).astype(bool)
    return finite


def keep_finite_statistics(old: Any, new: Any, pmap_axis_name: str | None = None, valid: Any = True) -> tuple[Any, jax.Array]:
    """``(new, False)`` when ``new``'s statistics are all finite and ``valid``, else ``(old, True)``.

    The guard that keeps one non-finite batch (a NaN example, an overflow) from poisoning a
    moving average for good: the whole update is dropped, not just its bad entries. On finite
    statistics ``new`` comes back unchanged (a select, bit for bit). ``valid`` (a boolean
    scalar, e.g. "the batch's loss is finite") drops it for another reason in the same select.
    """
    finite = jnp.logical_and(statistics_are_finite(new, pmap_axis_name), valid)
    # A conditional, not a select per leaf: XLA would copy the flag's reduction over every leaf
    # into each leaf's fusion (a program quadratic in the number of leaves, slow to compile).
    kept = jax.lax.cond(finite, lambda ops: ops[0], lambda ops: ops[1], (new, old))
    return kept, jnp.logical_not(finite)


def loss_cotangents(losses: Sequence[Any], rng: jax.Array, mode: str) -> tuple[tuple[jax.Array, ...], ...]:
    """One cotangent per loss input whose outer product estimates the loss curvature.

    ``E[c c^T]`` equals the (weighted) Fisher or GGN of each loss w.r.t. its
    inputs, per example; ``fisher_empirical`` uses the observed targets.
    """
    keys = jax.random.split(rng, max(len(losses), 1))
    out = []
    for loss, key in zip(losses, keys):
        if mode == "fisher_gradients":
            _require_nll(loss, mode)
            out.append(tuple(loss.grad_of_evaluate_on_sample(key, coefficient_mode="sqrt")))
        elif mode == "fisher_empirical":
            if loss.targets is None:
                raise ValueError(
                    f"estimation_mode='fisher_empirical' needs targets, but a {type(loss).__name__} was "
                    "registered without `targets`; pass the targets to its register_* call."
                )
            out.append(tuple(loss.grad_of_evaluate(None, coefficient_mode="sqrt")))
        elif mode in ("fisher_curvature_prop", "ggn_curvature_prop"):
            kind = mode.split("_")[0]
            if kind == "fisher":
                _require_nll(loss, mode)
            shape = getattr(loss, f"{kind}_factor_inner_shape")
            r = jax.random.rademacher(key, shape, dtype=loss.dtype)
            out.append(tuple(getattr(loss, f"multiply_{kind}_factor")(r)))
        else:
            raise ValueError(f"loss_cotangents: unsupported mode {mode!r}.")
    return tuple(out)


def _require_nll(loss: Any, mode: str) -> None:
    if not hasattr(loss, "grad_of_evaluate_on_sample"):
        raise ValueError(
            f"estimation_mode={mode!r} needs a probabilistic loss (a NegativeLogProbLoss), but "
            f"{type(loss).__name__} is not one; use a 'ggn_*' mode."
        )


def exact_cotangent_fn(losses: Sequence[Any], mode: str) -> tuple[int, Callable[[jax.Array], tuple]]:
    """For exact modes: the number K of factor columns and ``k -> sqrt(K) * B e_k``.

    Summing the outer products of these K cotangents (divided by K) gives the
    exact loss curvature; ``sqrt(K)`` compensates the average over k that the
    blocks' moving averages take.
    """
    kind = mode.split("_")[0]
    sizes = []
    for loss in losses:
        if kind == "fisher":
            _require_nll(loss, mode)
        shape = getattr(loss, f"{kind}_factor_inner_shape")
        sizes.append(int(np.prod(shape[1:])))
    total = int(sum(sizes))
    offsets = np.cumsum([0] + sizes)

    def cot(k: jax.Array) -> tuple:
        out = []
        for i, loss in enumerate(losses):
            shape = getattr(loss, f"{kind}_factor_inner_shape")
            local = k - offsets[i]
            inside = (local >= 0) & (local < sizes[i])
            onehot = jax.nn.one_hot(jnp.clip(local, 0, sizes[i] - 1), sizes[i], dtype=loss.dtype)
            onehot = jnp.broadcast_to(onehot.reshape((1,) + tuple(shape[1:])), shape) * inside
            vec = getattr(loss, f"multiply_{kind}_factor")(onehot)
            out.append(tuple(jnp.sqrt(jnp.asarray(total, loss.dtype)) * v for v in vec))
        return tuple(out)

    return total, cot


def _lookup_tag(table: Mapping[str, Any], tag_name: str) -> Any:
    """``table[tag_name]``, also accepting kfac-jax's ``"<name>_tag"`` spelling either way round."""
    for key in (tag_name, f"{tag_name}_tag", tag_name.removesuffix("_tag")):
        if key in table:
            return table[key]
    return None


BLOCK_NORM_ARG = "norm_to_scale_identity_weight_per_block"


def block_norm_name(norm: Any) -> str | None:
    """kfac-jax v0.0.8's ``norm_to_scale_identity_weight_per_block``: None for None or ``"none"``
    (the damping as given), else the norm's name (``curvax.linalg.NORM_TYPES``); a
    ``ValueError`` naming the argument for an unknown name."""
    if norm is None or norm == "none":
        return None
    return linalg.norm_type_name(norm, BLOCK_NORM_ARG)


def _block_norm_kwarg(kwargs: Mapping[str, Any]) -> str | None:
    """The checked ``norm_to_scale_identity_weight_per_block`` of a call's ``kwargs`` (the only
    keyword accepted there)."""
    extra = dict(kwargs)
    norm = extra.pop(BLOCK_NORM_ARG, None)
    if extra:
        raise TypeError(f"unexpected keyword arguments {sorted(extra)}.")
    return block_norm_name(norm)


def _normed_weight(block: Any, state: Any, identity_weight: Any, norm: str | None) -> Any:
    """The damping a block gets: ``identity_weight``, times the block's norm (``block.norm``,
    from its current statistics) when ``norm`` names one (kfac-jax v0.0.8's per-block scaling)."""
    return identity_weight if norm is None else identity_weight * block.norm(state, norm)


def _canonical_dense(block: Any, state: Any) -> jax.Array:
    """``block.to_dense_matrix(state)`` with the parameters in canonical (ascending flat index) order."""
    m = block.to_dense_matrix(state)
    order = tuple(block.parameters_canonical_order)
    if order == tuple(range(len(order))):
        return m
    offsets = np.concatenate([[0], np.cumsum(block.parameters_sizes)]).astype(int)
    perm = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in order])
    return m[np.ix_(perm, perm)]


def _prepare_estimator_args(generation: str, named: dict) -> dict:
    """v0.0.8 overrides need an ``identity_weight``; documented calls have none (0.0 then)."""
    if generation == _generations.V008:
        named.setdefault("identity_weight", 0.0)
    return named


def _refresh_cost(block: Any) -> int:
    """Static cost estimate of one block's cache refresh (see ``block_refresh_costs``)."""
    if isinstance(block, StackedBlock):
        return block.length * _refresh_cost(block.inner)
    if isinstance(block, blocks_lib.TwoKroneckerFactored):
        return int(block.input_size()) ** 3 + int(block.output_size()) ** 3
    if isinstance(block, partitioned.DensePartitionedKroneckerFactored):
        return block.refresh_cost()
    if isinstance(block, blocks_lib.Full):
        return int(block.dim) ** 3
    return int(block.dim)


def _apply_cost(block: Any) -> int:
    """Static cost estimate of one block's product with a vector: ``d_in d_out (d_in + d_out)``
    for Kronecker blocks (two matrix products), ``dim**2`` for full blocks, ``dim`` otherwise."""
    if isinstance(block, StackedBlock):
        return block.length * _apply_cost(block.inner)
    if isinstance(block, blocks_lib.TwoKroneckerFactored):
        di, do = int(block.input_size()), int(block.output_size())
        return di * do * (di + do)
    if isinstance(block, partitioned.DensePartitionedKroneckerFactored):
        return block.apply_cost()
    return int(block.dim) ** 2 if isinstance(block, blocks_lib.Full) else int(block.dim)


def _update_block(block: Any, state: Any, data: Any, ema_old: Any, ema_new: Any, batch_size: Any, pmap_axis_name: Any, identity_weight: Any) -> Any:
    """``block.update_curvature_matrix_estimate`` with every argument named, so that a block
    written for either kfac-jax generation gets what it asks for (``curvax._generations``)."""
    method = type(block).update_curvature_matrix_estimate
    if getattr(method, "__curvax_generation__", None) is None:  # not a CurvatureBlock subclass: documented order
        return block.update_curvature_matrix_estimate(state, data, ema_old, ema_new, batch_size, pmap_axis_name)
    return block.update_curvature_matrix_estimate(
        _curvax_named=dict(
            state=state, estimation_data=data, ema_old=ema_old, ema_new=ema_new, batch_size=batch_size,
            pmap_axis_name=pmap_axis_name, identity_weight=identity_weight,
        )
    )


def _forward_only_state(block: Any, state: Any) -> Any:
    """FOOF: the gradient factor of a Kronecker block is the identity."""
    if isinstance(block, StackedBlock):
        return jax.vmap(lambda s: _forward_only_state(block.inner, s))(state)
    if isinstance(block, partitioned.DensePartitionedKroneckerFactored):
        return block.forward_only_state(state)
    if isinstance(block, blocks_lib.TwoKroneckerFactored):
        state = jax.tree_util.tree_map(lambda x: x, state)
        state.outputs_factor.value = jnp.eye(state.outputs_factor.value.shape[0], dtype=state.outputs_factor.value.dtype)
        return state
    if isinstance(block, blocks_lib.Diagonal) and block.layer_tag_primitive is tags.generic:
        return state  # no curvature information without a backward pass: zero statistics
    raise ValueError(
        f"estimation_mode='forward_only' needs Kronecker-factored blocks (or generic diagonal ones), but "
        f"{block.name} uses {type(block).__name__}; choose another block with `layer_tag_to_block_ctor` "
        "or another estimation mode."
    )


def _site_block(site: Any, eqn: tags.LayerTagEqn, ctor: Callable[..., Any], budget: int | None, oversized: Any) -> tuple[Any, str | None]:
    """One layer's block (a ``StackedBlock`` for a stacked scan) under the factor budget, and the
    registration table's note on it (``partitioned.budget_note``)."""
    stacked = site.scan is not None and site.scan.mode == "stacked"
    ctor = partitioned.ctor_within_budget(ctor, slice_tag_eqn(eqn) if stacked else eqn, site.name, budget, oversized)
    if stacked:
        block = StackedBlock.from_ctor(ctor, eqn, site.name)  # one block per stacked layer
        return block, partitioned.budget_note(block.inner, budget)
    block = blocks_lib.construct_block(ctor, eqn, site.name)
    return block, partitioned.budget_note(block, budget)


def _traced_or_error(est: Any, func_args: Sequence[Any]) -> Any:
    """``est.processed_jaxpr_for(func_args)``; once the blocks exist, a failed trace (arguments
    shaped unlike those the blocks were built from) is a ``ValueError`` saying so."""
    finalized = est._blocks is not None
    try:
        return est.processed_jaxpr_for(func_args)
    except Exception as e:
        if not finalized:
            raise  # the first trace: the user's function's own error
        shapes = [tuple(np.shape(x)) for x in jax.tree_util.tree_leaves(func_args)]
        raise ValueError(
            f"Tracing the function on `func_args` (leaf shapes {shapes}) failed ({type(e).__name__}: {e}); "
            "the blocks were built from arguments of other shapes. Pass arguments shaped like those given "
            "to `init`/`finalize` (the batch size may differ)."
        ) from e


StateType = TypeVar("StateType")
"""An estimator's state type (``CurvatureEstimator[StateType]``, as in kfac-jax)."""


class CurvatureEstimator(abc.ABC, Generic[StateType]):
    """Something that estimates a curvature matrix of ``func`` and multiplies with it.

    ``update_curvature_matrix_estimate`` accepts both kfac-jax argument orders
    (documented and v0.0.8, see ``curvax._generations``): every subclass's override is
    wrapped so that it is called by keyword in the generation its signature names.

    Args:
      func: the model's value function, called as ``func(*func_args)``; it must register its
        losses (``curvax.register_*_loss``) and may return the loss alone or with extra outputs.
      params_index: position of the parameters in ``func_args``. Default 0.
      default_estimation_mode: the estimation mode used when an update names none (see
        ``ESTIMATION_MODES``). Default ``"fisher_gradients"``.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fn = cls.__dict__.get("update_curvature_matrix_estimate")
        if fn is not None and not getattr(fn, "__isabstractmethod__", False) and not hasattr(fn, "__curvax_wrapped__"):
            cls.update_curvature_matrix_estimate = _generations.dispatching(  # type: ignore[method-assign]
                "estimator", f"{cls.__name__}.update_curvature_matrix_estimate", fn, _prepare_estimator_args
            )

    def __init__(self, func: Callable[..., Any], params_index: int = 0, default_estimation_mode: str = "fisher_gradients"):
        if not callable(func):
            raise TypeError(f"`func` must be callable, got {type(func).__name__}.")
        self.func = func
        self.params_index = params_index
        self.default_estimation_mode = check_estimation_mode(default_estimation_mode, "default_estimation_mode")

    @property
    def default_mat_type(self) -> str:
        """The curvature kind of ``default_estimation_mode`` (e.g. ``"fisher"`` for ``"fisher_gradients"``)."""
        return self.default_estimation_mode.split("_")[0]

    @property
    @abc.abstractmethod
    def dim(self) -> int:
        """The number of parameters."""

    @abc.abstractmethod
    def init(self, rng, func_args, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues=False) -> Any:
        """The initial state, with empty statistics, for the model traced at ``func_args``.

        Args:
          rng: a PRNG key for the state's initialisation.
          func_args: example arguments of ``func`` (shapes matter, values do not).
          exact_powers_to_cache: matrix powers whose exact products ``update_cache`` will keep.
          approx_powers_to_cache: matrix powers whose approximate products it will keep.
          cache_eigenvalues: whether it will keep the eigenvalues too.
        """

    @abc.abstractmethod
    def multiply_matpower(self, state, parameter_structured_vector, identity_weight, power, exact_power, use_cached, pmap_axis_name=None) -> Any:
        """``(C + identity_weight I)^power v``, shaped like the parameters.

        Args:
          state: the estimator's state.
          parameter_structured_vector: ``v``, a pytree shaped like the parameters.
          identity_weight: the weight of the identity added to ``C`` (damping).
          power: the matrix power, e.g. 1, -1 or -0.5.
          exact_power: compute the power exactly rather than with the cheaper approximation.
          use_cached: read what ``update_cache`` stored rather than use the live statistics.
          pmap_axis_name: the ``pmap`` axis, where the estimator needs one.
        """

    def multiply(self, state, parameter_structured_vector, identity_weight, exact_power, use_cached, pmap_axis_name=None, *, distribution: distributed.Distribution | None = None, **kwargs: Any) -> Any:
        """``(C + identity_weight I) v``: ``multiply_matpower`` with ``power=1``.

        ``state``, ``parameter_structured_vector``, ``identity_weight``, ``exact_power``,
        ``use_cached``, ``pmap_axis_name``, ``distribution`` (passed on only when given) and
        ``kwargs`` (kfac-jax v0.0.8's ``norm_to_scale_identity_weight_per_block``) are those of
        ``multiply_matpower``.
        """
        return self._multiply_power(1, state, parameter_structured_vector, identity_weight, exact_power, use_cached,
                                    pmap_axis_name, distribution, kwargs)

    def multiply_inverse(self, state, parameter_structured_vector, identity_weight, exact_power, use_cached, pmap_axis_name=None, *, distribution: distributed.Distribution | None = None, **kwargs: Any) -> Any:
        """``(C + identity_weight I)^-1 v``: ``multiply_matpower`` with ``power=-1``.

        The arguments are those of ``multiply``: ``state``, ``parameter_structured_vector``,
        ``identity_weight``, ``exact_power``, ``use_cached``, ``pmap_axis_name``, ``distribution``
        and ``kwargs``.
        """
        return self._multiply_power(-1, state, parameter_structured_vector, identity_weight, exact_power, use_cached,
                                    pmap_axis_name, distribution, kwargs)

    def _multiply_power(self, power, state, vector, identity_weight, exact_power, use_cached, pmap_axis_name,
                        distribution, kwargs) -> Any:
        """``multiply_matpower`` for ``multiply``/``multiply_inverse``: passes ``distribution`` and
        kfac-jax v0.0.8's per-block norm on only when given."""
        norm = _block_norm_kwarg(kwargs)
        extra: dict[str, Any] = ({} if distribution is None else {"distribution": distribution}) | ({} if norm is None else {BLOCK_NORM_ARG: norm})
        return self.multiply_matpower(state, vector, identity_weight, power, exact_power, use_cached, pmap_axis_name, **extra)

    @abc.abstractmethod
    def eigenvalues(self, state, use_cached) -> jax.Array:
        """Eigenvalues of the estimated (undamped) matrix in ``state``; from the cache if ``use_cached``."""

    @abc.abstractmethod
    def update_curvature_matrix_estimate(self, state, ema_old, ema_new, batch_size, rng, func_args, pmap_axis_name=None, estimation_mode=None) -> Any:
        """Folds a new estimate from ``func_args`` into the moving average; returns the new state.

        Args:
          state: the estimator's state.
          ema_old: the weight of the current average.
          ema_new: the weight of the new batch's estimate.
          batch_size: the number of examples in ``func_args``' batch.
          rng: a PRNG key for sampled estimation modes.
          func_args: the arguments of ``func`` for this batch.
          pmap_axis_name: the ``pmap`` axis, where the estimator needs one.
          estimation_mode: overrides ``default_estimation_mode`` for this update.
        """

    @abc.abstractmethod
    def update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues, pmap_axis_name=None) -> Any:
        """Recomputes the cached matrix powers and eigenvalues from the statistics; returns the new state.

        Args:
          state: the estimator's state.
          identity_weight: the damping the approximate powers are computed with.
          exact_powers: the exact powers to recompute.
          approx_powers: the approximate powers to recompute.
          eigenvalues: whether to recompute the eigenvalues.
          pmap_axis_name: the ``pmap`` axis, where the estimator needs one.
        """


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockDiagonalState:
    """State of a ``BlockDiagonalCurvature``: one state per block."""

    blocks_states: tuple


class BlockDiagonalCurvature(CurvatureEstimator):
    """A block-diagonal curvature estimate: one block per detected layer.

    ``C`` approximates the Fisher or GGN of ``func``'s mean loss with one block per layer
    (Kronecker-factored for dense and convolution layers, diagonal for generic parameters, or
    whatever ``layer_tag_to_block_ctor`` names). Typical use: ``state = est.init(rng,
    func_args)``, then ``est.update_curvature_matrix_estimate(...)`` per batch, and products
    with ``multiply``/``multiply_inverse``/``multiply_matpower``, optionally from a cache
    refreshed by ``update_cache``. The blocks are built at the first ``init``/``finalize``,
    from one trace of ``func``; every later batch must give the same layers.

    Args:
      func: the model's value function, called as ``func(*func_args)``; it must register its
        losses (``curvax.register_*_loss``); its return value may be the loss alone or a tuple
        starting with it.
      params_index: position of the parameters in ``func_args``. Default 0.
      default_estimation_mode: the mode an update uses when it names none: one of
        ``ESTIMATION_MODES``. Default ``"fisher_gradients"``.
      layer_tag_to_block_ctor: maps a layer tag's name (``"dense"``, ``"conv2d"``, ... with or
        without kfac-jax's ``_tag`` suffix) or a layer variant (``"repeated_dense"``) to the
        block class for such layers, instead of the defaults
        (``curvax.set_default_tag_to_block_ctor``). Default None.
      index_to_block_ctor: maps the tuple of flat parameter indices of one layer (see
        ``params_structure_vector_of_indices``) to its block class; checked before
        ``layer_tag_to_block_ctor``. Default None.
      auto_register_tags: detect layers automatically. False keeps only the layers registered
        by hand (``curvax.register_dense`` etc.); every other parameter gets a generic block.
        Default True.
      distributed_multiplies: allow ``multiply_matpower(..., distribution=...)`` to split the
        products over devices (``curvax.distributed``). Default True.
      distributed_cache_updates: likewise for ``update_cache``. Default True.
      curvature_dtype: the statistics' dtype, float32 or float64. Default None: the parameters'
        dtype, at least float32 (bfloat16 and float16 models get float32 statistics).
      inverse_dtype: the dtype of the cached decompositions (eigh, Cholesky, inverses), float32
        or float64. Default None: ``curvature_dtype``'s.
      factor_budget: bytes per Kronecker factor: a dense layer whose default block has a larger
        factor gets a ``DensePartitionedKroneckerFactored``, only that factor split into diagonal
        blocks (``block_notes`` says why). None disables it. Default ``DEFAULT_FACTOR_BUDGET`` (256 MiB).
      oversized_factor: an over-budget factor becomes ``"partition"`` (the largest blocks fitting
        the budget, at most 2048), ``"diagonal"``, or an int: blocks of at most that side. Default ``"partition"``.
      auto_register_kwargs: further options of the layer detection: ``register_only_generic``
        (generic blocks for everything not registered by hand), ``patterns_to_skip`` (pattern
        names not to match, see ``curvax.detection.known_pattern_names()``) and
        ``graph_patterns`` (``curvax.patterns.GraphPattern`` objects replacing the built-in
        patterns).
    """

    State = BlockDiagonalState

    def __init__(
        self,
        func: Callable[..., Any],
        params_index: int = 0,
        default_estimation_mode: str = "fisher_gradients",
        layer_tag_to_block_ctor: Mapping[str, Any] | None = None,
        index_to_block_ctor: Mapping[tuple[int, ...], Any] | None = None,
        auto_register_tags: bool = True,
        distributed_multiplies: bool = True,
        distributed_cache_updates: bool = True,
        curvature_dtype: Any = None, inverse_dtype: Any = None,
        factor_budget: int | None = partitioned.DEFAULT_FACTOR_BUDGET,
        oversized_factor: str | int = "partition",
        **auto_register_kwargs: Any,
    ):
        super().__init__(func, params_index, default_estimation_mode)
        self.curvature_dtype = utils.check_curvature_dtype(curvature_dtype, "curvature_dtype")
        self.inverse_dtype = utils.check_curvature_dtype(inverse_dtype, "inverse_dtype")
        self._factor_budget = partitioned.check_factor_budget(factor_budget)
        self._oversized_factor = partitioned.check_oversized_factor(oversized_factor)
        self._block_notes: tuple[str | None, ...] = ()
        self._layer_tag_to_block_ctor = dict(layer_tag_to_block_ctor or {})
        self._index_to_block_ctor = {tuple(k): v for k, v in (index_to_block_ctor or {}).items()}
        self._cache = _Cache(func, params_index, auto_register_tags=auto_register_tags, **auto_register_kwargs)
        self._blocks: tuple[Any, ...] | None = None
        self._pj: ProcessedJaxpr | None = None
        self.distributed_multiplies, self.distributed_cache_updates = bool(distributed_multiplies), bool(distributed_cache_updates)

    # --- structure ----------------------------------------------------------------

    def finalize(self, func_args: Sequence[Any], traced: tuple[Any, Any] | None = None) -> None:
        """Traces ``func`` on ``func_args`` and builds the blocks (once; later calls only trace).

        Args:
          func_args: example arguments of ``func`` (only their shapes and dtypes matter).
          traced: ours: ``func``'s trace at ``func_args``, ``(closed jaxpr, output shapes)``,
            when the caller has it (the optimizer, from ``value_and_grad_func``'s): not traced again.

        Raises:
          ValueError: when ``func`` registers no loss, or a trace at other shapes finds other
            layers than the first.
        """
        pj = self._cache.get(func_args, traced)
        if self._blocks is not None:
            return
        self._pj = pj
        built = []
        for site, eqn in zip(pj.layer_sites, pj.layer_tags):
            ctor = self._index_to_block_ctor.get(site.param_indices)
            built.append(_site_block(site, eqn, ctor or self.block_ctor_for(eqn), self._factor_budget, self._oversized_factor))
            if self.curvature_dtype is not None or self.inverse_dtype is not None:
                built[-1][0].set_dtypes(self.curvature_dtype, self.inverse_dtype)
        self._blocks, self._block_notes = tuple(b for b, _ in built), tuple(n for _, n in built)

    def block_ctor_for(self, eqn: tags.LayerTagEqn) -> Callable[..., Any]:
        """The block constructor for a layer: by its variant (``eqn.variant``, e.g.
        ``"repeated_dense"``), then by its tag's name; ``layer_tag_to_block_ctor`` first,
        then the defaults (``set_default_tag_to_block_ctor``).

        Args:
          eqn: the layer's tag equation (one of ``processed_jaxpr.layer_tags``).
        """
        tag_name = eqn.primitive.name
        variant = getattr(eqn, "variant", tag_name)
        names = (variant, tag_name) if variant != tag_name else (tag_name,)
        for name in names:
            ctor = _lookup_tag(self._layer_tag_to_block_ctor, name)
            if ctor is not None:
                return ctor
        for name in names:
            ctor = blocks_lib.find_default_tag_to_block_ctor(name)
            if ctor is not None:
                return ctor
        return blocks_lib.get_default_tag_to_block_ctor(tag_name)  # raises, naming the tag

    def _require_finalized(self) -> None:
        if self._blocks is None:
            raise RuntimeError("The estimator is not initialized yet: call `init` (or `finalize`) with example arguments.")

    def _check_state(self, state: Any) -> None:
        """A clear error unless ``state`` is this estimator's state (from its ``init``)."""
        states = getattr(state, "blocks_states", None)
        if not isinstance(states, (tuple, list)) or len(states) != len(self._blocks):  # type: ignore[arg-type]
            raise ValueError(
                f"`state` must be this estimator's state (a BlockDiagonalState with {len(self._blocks)} block "  # type: ignore[arg-type]
                f"states, from its `init`), got {type(state).__name__}."
            )

    @property
    def processed_jaxpr(self) -> ProcessedJaxpr:
        """The traced function the blocks were built from; raises ``RuntimeError`` before ``init``/``finalize``."""
        self._require_finalized()
        return self._pj  # type: ignore[return-value]

    def processed_jaxpr_for(self, func_args: Sequence[Any]) -> ProcessedJaxpr:
        """The traced function at the shapes of ``func_args`` (traced once per shape).

        Every trace must find the same layers and losses as the first, so the blocks built
        from the first apply to all; a batch of another size gets its own trace.

        Args:
          func_args: arguments of ``func`` (only their shapes and dtypes matter).
        """
        self.finalize(func_args)
        return self._cache.get(func_args)

    @property
    def blocks(self) -> tuple[Any, ...] | None:
        """The curvature blocks, one per layer tag, in tag order (``None`` before ``init``/``finalize``)."""
        return self._blocks

    @property
    def block_notes(self) -> tuple[str | None, ...]:
        """Per block, why its Kronecker factors are partitioned or diagonal under ``factor_budget``
        (or that a block chosen by the user exceeds it); None where nothing is to say."""
        self._require_finalized()
        return self._block_notes

    @property
    def num_blocks(self) -> int:
        """Number of curvature blocks (requires ``init``/``finalize``)."""
        self._require_finalized()
        return len(self._blocks)  # type: ignore[arg-type]

    @property
    def block_dims(self) -> tuple[int, ...]:
        """The number of scalar parameters of each block, in block order."""
        self._require_finalized()
        return tuple(b.dim for b in self._blocks)  # type: ignore[union-attr]

    @property
    def dim(self) -> int:
        return int(sum(self.block_dims))

    @property
    def num_params_variables(self) -> int:
        """Number of parameter leaves of the function's parameters pytree."""
        return self.processed_jaxpr.num_params

    @property
    def params_structure_vector_of_indices(self) -> Any:
        """The parameters pytree with each leaf replaced by its flat index (0, 1, ...)."""
        pj = self.processed_jaxpr
        return jax.tree_util.tree_unflatten(pj.params_tree, list(range(pj.num_params)))

    @property
    def indices_to_block_map(self) -> dict[tuple[int, ...], Any]:
        """Maps each block's tuple of flat parameter indices to the block."""
        pj = self.processed_jaxpr
        return {idx: b for idx, b in zip(pj.layer_indices, self._blocks)}  # type: ignore[arg-type]

    @property
    def params_block_index(self) -> Any:
        """The parameters pytree with each leaf replaced by the index of the block that owns it."""
        pj = self.processed_jaxpr
        flat = [0] * pj.num_params
        for j, idx in enumerate(pj.layer_indices):
            for i in idx:
                flat[i] = j
        return jax.tree_util.tree_unflatten(pj.params_tree, flat)

    def params_vector_to_blocks_vectors(self, parameter_structured_vector: Any) -> tuple[tuple[jax.Array, ...], ...]:
        """Splits a parameter-shaped pytree into one tuple of arrays per block.

        ``parameter_structured_vector`` must have the parameters' structure and leaf shapes
        (``ValueError`` otherwise); each block's tuple lists its parameters in its tag's order.
        """
        pj = self.processed_jaxpr
        leaves, tree = jax.tree_util.tree_flatten(parameter_structured_vector)
        if tree != pj.params_tree:
            raise ValueError(
                "The vector must have the structure of the parameters:\n"
                f"expected {pj.params_tree}\ngot      {tree}"
            )
        for i, (leaf, eqn_idx) in enumerate(zip(leaves, range(len(leaves)))):
            want = pj.program.avals[pj.program.input_keys[pj.params_offset + i]].shape
            if np.shape(leaf) != tuple(want):
                raise ValueError(f"Vector leaf {i} has shape {np.shape(leaf)}, the parameter has shape {tuple(want)}.")
        return tuple(tuple(leaves[i] for i in idx) for idx in pj.layer_indices)

    def blocks_vectors_to_params_vector(self, blocks_vectors: Sequence[Sequence[jax.Array]]) -> Any:
        """Inverse of ``params_vector_to_blocks_vectors``: per-block arrays back to a parameter-shaped pytree.

        ``blocks_vectors`` holds one tuple of arrays per block, in block order.
        """
        pj = self.processed_jaxpr
        flat: list[Any] = [None] * pj.num_params
        for idx, vecs in zip(pj.layer_indices, blocks_vectors):
            for i, v in zip(idx, vecs):
                flat[i] = v
        return jax.tree_util.tree_unflatten(pj.params_tree, flat)

    def _per_block(self, value: Any, name: str) -> tuple[Any, ...]:
        if isinstance(value, (list, tuple)):
            if len(value) != self.num_blocks:
                raise ValueError(f"`{name}` has {len(value)} entries but there are {self.num_blocks} blocks.")
            return tuple(value)
        return (value,) * self.num_blocks

    # --- state ----------------------------------------------------------------------

    def init(self, rng, func_args, exact_powers_to_cache=None, approx_powers_to_cache=None, cache_eigenvalues=False) -> BlockDiagonalState:
        """Builds the blocks (``finalize``) and returns their initial state, statistics empty.

        Args:
          rng: a PRNG key, split into one key per block.
          func_args: example arguments of ``func``, e.g. ``(params, batch)``; only their shapes
            and dtypes matter here.
          exact_powers_to_cache: a matrix power or a sequence of them (e.g. -1) whose exact
            products ``update_cache`` will store, for ``multiply_matpower(...,
            exact_power=True, use_cached=True)``. None: none.
          approx_powers_to_cache: likewise for the approximate products (for Kronecker blocks,
            the factored-damping inverse), read with ``exact_power=False, use_cached=True``.
            None: none.
          cache_eigenvalues: whether ``update_cache`` also stores the eigenvalues, for
            ``eigenvalues(..., use_cached=True)``. Default False.

        Returns:
          A ``BlockDiagonalState`` with one state per block (zero-weight averages). Reading a
          cached power that was not requested here raises an error naming the argument.
        """
        self.finalize(func_args)
        keys = jax.random.split(rng, self.num_blocks)
        return BlockDiagonalState(
            tuple(
                b.init(k, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues)
                for b, k in zip(self._blocks, keys)  # type: ignore[arg-type]
            )
        )

    def update_blocks(self, state: BlockDiagonalState, layer_data: Sequence[dict], ema_old: Any, ema_new: Any, batch_size: Any, pmap_axis_name: str | None = None, identity_weight: Any = 0.0) -> BlockDiagonalState:
        """Feeds per-layer estimation data to each block (each device's own; ``sync`` averages them).

        The low-level step of ``update_curvature_matrix_estimate``: ``layer_data`` holds one
        estimation-data dict per block, in block order; ``state``, ``ema_old``, ``ema_new``,
        ``batch_size``, ``pmap_axis_name`` and ``identity_weight`` are handed to each block's
        ``update_curvature_matrix_estimate``.
        """
        return BlockDiagonalState(
            tuple(
                _update_block(b, s, d, ema_old, ema_new, batch_size, pmap_axis_name, identity_weight)
                for b, s, d in zip(self._blocks, state.blocks_states, layer_data)  # type: ignore[arg-type]
            )
        )

    def update_curvature_matrix_estimate(
        self, state, ema_old, ema_new, batch_size, rng, func_args, pmap_axis_name=None, estimation_mode=None,
        identity_weight=0.0,
    ) -> BlockDiagonalState:
        """Folds a new estimate from ``func_args`` into the moving average.

        Runs ``func`` forward once, draws loss cotangents by the estimation mode, propagates
        them back to every layer and updates each block. Each block's average becomes
        ``(ema_old * W * old + ema_new * estimate) / (ema_old * W + ema_new)``, ``W`` being its
        accumulated weight: ``(0, 1)`` replaces it by this batch's estimate, ``(1, 1)`` keeps
        a running mean with equal weights, ``(ema, 1)`` an exponential moving average.
        Jit-compatible (``batch_size`` may be a static int or an array).

        Also callable with kfac-jax v0.0.8's argument order ``(state, ema_old, ema_new,
        identity_weight, batch_size, rng, func_args, estimation_mode, pmap_axis_name)``
        (see ``curvax._generations``).

        Args:
          state: the ``BlockDiagonalState`` from ``init`` or a previous update.
          ema_old: the weight of the current average (see above).
          ema_new: the weight of this batch's estimate.
          batch_size: the number of examples in the batch of ``func_args``: the estimate is
            the sum over examples divided by it, i.e. the curvature of the mean loss.
          rng: a PRNG key for the sampled modes (``fisher_gradients``, ``*_curvature_prop``);
            unused by the others.
          func_args: the arguments of ``func`` for this batch, e.g. ``(params, batch)``.
          pmap_axis_name: the ``pmap`` axis the call runs under, handed to the blocks; each
            device keeps its own statistics until ``sync`` averages them. Default None.
          estimation_mode: this update's mode (one of ``ESTIMATION_MODES``); None uses
            ``default_estimation_mode``. ``*_exact`` modes loop over every column of the loss
            curvature's factor and give the exact block-diagonal of the Fisher or GGN.
          identity_weight: reaches blocks whose update takes one (v0.0.8-style blocks) and is
            otherwise unused. Default 0.0.

        Returns:
          The updated ``BlockDiagonalState``.
        """
        pj = _traced_or_error(self, func_args)
        self._check_state(state)
        mode = check_estimation_mode(estimation_mode or self.default_estimation_mode)
        p, o = pj.split_args(func_args)  # type: ignore[union-attr]
        eps = pj.zero_perturbations(p, o)  # type: ignore[union-attr]
        (deps, _), vjp, (ops, layer_data) = jax.vjp(lambda q, e: pj.evaluate(q, o, e), p, eps, has_aux=True)  # type: ignore[union-attr]
        losses = pj.losses_from_operands(ops)  # type: ignore[union-attr]

        def data_for(cot: tuple | None) -> list[dict]:
            dp, de = zero_tangents(p, eps) if cot is None else vjp((cot, ()))
            return assemble_layer_data(pj, p, layer_data, dp, de)  # type: ignore[arg-type]

        return self._update_from_cotangents(
            state, losses, data_for, rng, mode, ema_old, ema_new, batch_size, pmap_axis_name, identity_weight
        )

    def _update_from_cotangents(self, state, losses, data_for, rng, mode, ema_old, ema_new, batch_size, pmap_axis_name, identity_weight=0.0):
        """Updates every block; ``data_for(cotangents)`` gives per-layer data (``None``: forward only)."""
        if isinstance(batch_size, (int, np.integer)) and not isinstance(batch_size, bool) and batch_size <= 0:
            raise ValueError(f"`batch_size` must be positive (an empty batch has no statistics), got {batch_size}.")
        if mode == "forward_only":
            new = self.update_blocks(state, data_for(None), ema_old, ema_new, batch_size, pmap_axis_name, identity_weight)
            return BlockDiagonalState(tuple(_forward_only_state(b, s) for b, s in zip(self._blocks, new.blocks_states)))  # type: ignore[arg-type]
        if mode.endswith("_exact"):
            total, cot_fn = exact_cotangent_fn(losses, mode)

            def body(k: jax.Array, st: BlockDiagonalState) -> BlockDiagonalState:
                old = jnp.where(k == 0, ema_old, 1.0)
                return self.update_blocks(st, data_for(cot_fn(k)), old, ema_new / total, batch_size, pmap_axis_name, identity_weight)

            if total == 1:  # one column (a scalar output, e.g. a wavefunction's): no loop to compile
                return body(jnp.asarray(0), state)
            return jax.lax.fori_loop(0, total, body, state)
        return self.update_blocks(
            state, data_for(loss_cotangents(losses, rng, mode)), ema_old, ema_new, batch_size, pmap_axis_name, identity_weight
        )

    def update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues, pmap_axis_name=None, distribution=None, **kwargs: Any) -> BlockDiagonalState:
        """Refreshes each block's cache from its current statistics; returns the new state.

        The expensive part of preconditioning (eigendecompositions, factor inverses), run every
        few steps so that ``multiply_matpower(..., use_cached=True)`` is cheap in between.

        Args:
          state: the ``BlockDiagonalState``.
          identity_weight: the damping baked into the approximate powers (a scalar, or one
            per block). Exact powers come from damping-free eigendecompositions and take the
            damping given at multiplication time instead.
          exact_powers: the exact powers to recompute (a power, a sequence, or None); they
            must have been requested at ``init``.
          approx_powers: likewise for the approximate powers.
          eigenvalues: whether to recompute the cached eigenvalues.
          pmap_axis_name: kfac-jax compatibility, unused.
          distribution: a ``curvax.distributed.Distribution`` with ``inverses`` on: each device
            refreshes ~1/N of the blocks (by ``block_refresh_costs``) and shares them; same
            result. None (default): every device refreshes every block.
          kwargs: ``norm_to_scale_identity_weight_per_block``, as for ``multiply_matpower``: the
            normed damping is baked into the cache.
        """
        norm = _block_norm_kwarg(kwargs)
        self._require_finalized()
        refresh = lambda b: lambda sw: b.update_cache(sw[0], _normed_weight(b, sw[0], sw[1], norm), exact_powers, approx_powers, eigenvalues)
        on = distribution is not None and distribution.inverses and self.distributed_cache_updates
        return BlockDiagonalState(tuple(distributed.map_blocks(
            [refresh(b) for b in self._blocks], list(zip(state.blocks_states, self._per_block(identity_weight, "identity_weight"))),  # type: ignore[union-attr]
            self.block_refresh_costs(), distribution, on, split=[(True, False)] * len(self._blocks), split_outputs=True,  # type: ignore[arg-type]
        )))

    # --- staggered refresh (ours) ---------------------------------------------------------

    def block_refresh_costs(self) -> tuple[int, ...]:
        """A static estimate of each block's ``update_cache`` cost (ours): the sum of ``n**3``
        over the sides ``n`` of the matrices it factorizes (both factors of a Kronecker block,
        the whole matrix of a full block), the dimension for diagonal blocks; times the
        number of slices of a stacked block. Used to balance ``refresh_phases``."""
        self._require_finalized()
        return tuple(_refresh_cost(b) for b in self._blocks)  # type: ignore[union-attr]

    def refresh_phases(self, period: int) -> tuple[int, ...]:
        """Each block's phase in a staggered refresh of period ``period`` (ours).

        Block ``i`` recomputes its cache at the steps ``t`` with ``t % period == phases[i]``
        (and at step 0, when every block does), so each step of a period pays for about
        ``1 / period`` of the inverses instead of one step paying for all. Blocks are dealt
        largest first (``block_refresh_costs``) to the phase with the least cost so far; ties
        go to the lowest phase. A pure function of the block structure: the schedule is
        static, so one compiled step serves every phase.
        """
        return distributed.assign(self.block_refresh_costs(), utils.check_int(period, "period", 1))

    def blocks_refreshed_at(self, step: int, period: int) -> tuple[int, ...]:
        """Indices of the blocks whose cache ``update_cache_staggered`` recomputes at ``step`` (ours).

        ``step`` is a non-negative Python int (every block at step 0); ``period`` the refresh
        period, as for ``refresh_phases``.
        """
        step = utils.check_int(step, "step", 0)
        phases = self.refresh_phases(period)
        return tuple(i for i, p in enumerate(phases) if step == 0 or step % period == p)

    def update_cache_staggered(
        self, state: BlockDiagonalState, step: Any, period: int, identity_weight: Any, exact_powers: Any,
        approx_powers: Any, eigenvalues: bool, **kwargs: Any,
    ) -> BlockDiagonalState:
        """``update_cache`` for the blocks due at ``step`` only (ours; see ``refresh_phases``).

        ``step`` may be traced: each block's refresh sits in its own ``lax.cond``, so the
        compiled program holds every block's refresh once (as the plain refresh does) and
        runs only the due ones. A block refreshed here gets exactly the cache ``update_cache``
        would give it from the same statistics and ``identity_weight``.

        Args:
          state: the ``BlockDiagonalState``.
          step: the step number (an int or a traced integer scalar); every block is due at 0.
          period: the refresh period (positive int); block ``i`` is due when ``step % period
            == refresh_phases(period)[i]``.
          identity_weight: the damping baked into approximate powers, as for ``update_cache``.
          exact_powers: the exact powers to recompute, as for ``update_cache``.
          approx_powers: the approximate powers to recompute, as for ``update_cache``.
          eigenvalues: whether to recompute cached eigenvalues, as for ``update_cache``.
          kwargs: ``norm_to_scale_identity_weight_per_block``, as for ``update_cache``.
        """
        norm = _block_norm_kwarg(kwargs)
        self._require_finalized()
        period = utils.check_int(period, "period", 1)
        phases = self.refresh_phases(period)
        weights = self._per_block(identity_weight, "identity_weight")
        step = jnp.asarray(step)
        out = []
        for b, s, w, phase in zip(self._blocks, state.blocks_states, weights, phases):  # type: ignore[arg-type]
            due = jnp.logical_or(step == 0, step % period == phase)
            refresh = lambda s, b=b, w=w: b.update_cache(s, _normed_weight(b, s, w, norm), exact_powers, approx_powers, eigenvalues)
            out.append(jax.lax.cond(due, refresh, lambda s: s, s))
        return BlockDiagonalState(tuple(out))

    # --- products -----------------------------------------------------------------------

    def multiply_matpower(self, state, parameter_structured_vector, identity_weight, power, exact_power, use_cached, pmap_axis_name=None, distribution=None, **kwargs: Any) -> Any:
        """``(C + identity_weight I)^power v``, block by block, shaped like the parameters.

        Args:
          state: the ``BlockDiagonalState``.
          parameter_structured_vector: ``v``, a pytree with the parameters' structure and shapes.
          identity_weight: the damping added to ``C`` (a scalar, or one per block). Ignored by
            approximate powers read from the cache, which use the damping of ``update_cache``.
          power: the matrix power, e.g. 1, -1 or -0.5 (static).
          exact_power: True computes the power of ``C + identity_weight I`` exactly (through
            eigendecompositions for Kronecker blocks); False allows the block's cheaper
            approximation (factored damping for Kronecker blocks). Static.
          use_cached: True reads what ``update_cache`` last stored (a power the block cannot
            serve from its cache, e.g. 1, is computed live; others must have been requested at
            ``init``, or a ``ValueError`` says so); False computes from the current statistics.
            Static.
          pmap_axis_name: kfac-jax compatibility, unused.
          distribution: a ``curvax.distributed.Distribution`` with ``precon_apply`` on: each
            device multiplies ~1/N of the blocks and shares the products; same result. None
            (default): every device multiplies every block.
          kwargs: kfac-jax v0.0.8's ``norm_to_scale_identity_weight_per_block``: None/``"none"``
            (default), or a norm name (``curvax.linalg.NORM_TYPES``) multiplying each block's
            ``identity_weight`` by ``block.norm(state, name)``. Another keyword: ``TypeError``.

        Returns:
          A pytree shaped like the parameters.
        """
        norm = _block_norm_kwarg(kwargs)
        self._require_finalized()
        self._check_state(state)
        operands = zip(state.blocks_states, self.params_vector_to_blocks_vectors(parameter_structured_vector), self._per_block(identity_weight, "identity_weight"))
        product = lambda b: lambda svw: b.multiply_matpower(svw[0], svw[1], _normed_weight(b, svw[0], svw[2], norm), power, exact_power, use_cached)
        on = distribution is not None and distribution.precon_apply and self.distributed_multiplies
        out = distributed.map_blocks([product(b) for b in self._blocks], list(operands), [_apply_cost(b) for b in self._blocks], distribution, on,  # type: ignore[union-attr]
                                     split=[(True, True, False)] * len(self._blocks), split_outputs=True)  # type: ignore[arg-type]
        return self.blocks_vectors_to_params_vector(out)

    def block_eigenvalues(self, state, use_cached) -> tuple[jax.Array, ...]:
        """Each block's eigenvalues; a Kronecker block's as the ``(input_size, output_size)``
        outer product of its factors' eigenvalues (kfac-jax's shape; ``block.eigenvalues``
        gives the same numbers flattened).

        ``state`` is the ``BlockDiagonalState``; ``use_cached`` reads the eigenvalues stored by
        ``update_cache`` (requested with ``init(..., cache_eigenvalues=True)``) instead of
        computing them from the statistics. Undamped.
        """
        self._require_finalized()
        out = []
        for b, s in zip(self._blocks, state.blocks_states):  # type: ignore[arg-type]
            e = b.eigenvalues(s, use_cached)
            if (
                isinstance(b, blocks_lib.TwoKroneckerFactored)
                and type(b)._eigenvalues_unscaled is blocks_lib.TwoKroneckerFactored._eigenvalues_unscaled
            ):
                e = e.reshape(b.input_size(), b.output_size())
            out.append(e)
        return tuple(out)

    def eigenvalues(self, state, use_cached) -> jax.Array:
        """All eigenvalues of the block-diagonal ``C`` (undamped), block after block, in one vector.

        ``state`` is the ``BlockDiagonalState``; ``use_cached`` as for ``block_eigenvalues``.
        Their count is ``dim``; ``curvax.laplace.log_determinant`` sums their logarithms.
        """
        return jnp.concatenate([jnp.ravel(e) for e in self.block_eigenvalues(state, use_cached)])

    def inverse_diagonal(self, state: BlockDiagonalState, identity_weight: Any) -> Any:
        """The diagonal of ``(C + identity_weight I)^-1``, structured like the parameters (ours).

        Exact for the block-diagonal ``C``, block by block (``CurvatureBlock.inverse_diagonal``),
        from the current statistics of ``state``; ``identity_weight`` is the damping added to
        ``C`` (a scalar, or one per block).
        """
        self._require_finalized()
        weights = self._per_block(identity_weight, "identity_weight")
        out = tuple(
            b.inverse_diagonal(s, w) for b, s, w in zip(self._blocks, state.blocks_states, weights)  # type: ignore[arg-type]
        )
        return self.blocks_vectors_to_params_vector(out)

    def sync(self, state: BlockDiagonalState, pmap_axis_name: str | None) -> BlockDiagonalState:
        """Averages every block's statistics over the devices of a ``pmap`` over ``pmap_axis_name``.

        Outside such a ``pmap`` (or with ``None``) the state is returned unchanged, as in
        kfac-jax v0.0.8 (whose tests call it under a plain ``jit``). ``state`` is the
        ``BlockDiagonalState``; the caches are not averaged (refresh them after syncing).
        """
        self._require_finalized()
        if not utils.in_pmap(pmap_axis_name):
            return state
        return dataclasses.replace(
            state,
            blocks_states=tuple(b.sync(s, pmap_axis_name) for b, s in zip(self._blocks, state.blocks_states)),  # type: ignore[arg-type]
        )

    @property
    def param_order(self) -> tuple[int, ...]:
        """Flat parameter indices (pytree leaf order): block by block, ascending within a block.

        kfac-jax v0.0.8 name: ``ExplicitExactCurvature(param_order=...)`` orders its dense
        matrix this way, so its diagonal blocks line up with ``to_diagonal_block_dense_matrix``.
        """
        return tuple(int(i) for idx in self.processed_jaxpr.layer_indices for i in sorted(idx))

    def to_diagonal_block_dense_matrix(self, state: BlockDiagonalState) -> tuple[jax.Array, ...]:
        """Each block's dense matrix, in block order (kfac-jax v0.0.8 name).

        As in kfac-jax, a block's parameters appear in their canonical order (ascending
        flat index, ``block.parameters_canonical_order``), not in the tag's order that
        ``block.to_dense_matrix`` uses. ``state`` is the ``BlockDiagonalState``.
        """
        self._require_finalized()
        return tuple(_canonical_dense(b, s) for b, s in zip(self._blocks, state.blocks_states))  # type: ignore[arg-type]

    def to_dense_matrix(self, state) -> jax.Array:
        """The block-diagonal matrix ``C`` of ``state`` as a dense ``dim x dim`` array (undamped).

        Rows and columns follow the flat parameter order: leaves in pytree order, each
        flattened in C order. Memory is ``dim**2``: for small models and tests.
        """
        self._require_finalized()
        pj = self._pj
        sizes = [int(np.prod(pj.program.avals[pj.program.input_keys[pj.params_offset + i]].shape)) for i in range(pj.num_params)]  # type: ignore[union-attr]
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        n = int(offsets[-1])
        dense = jnp.zeros((n, n))
        for b, s, idx in zip(self._blocks, state.blocks_states, pj.layer_indices):  # type: ignore[union-attr]
            m = b.to_dense_matrix(s)
            pos = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx])
            dense = dense.astype(m.dtype).at[np.ix_(pos, pos)].set(m)
        return dense


class ExplicitExactCurvature(BlockDiagonalCurvature):
    """The full curvature matrix of all parameters, built example by example.

    One ``NaiveFull`` block holds a ``dim x dim`` matrix; each example's
    contribution is the outer product of its (sampled, or in exact modes
    column-by-column) loss gradients. With ``fisher_exact``/``ggn_exact`` this is
    exactly ``(1/B) sum_n J_n^T M_n J_n``. Memory is ``dim**2``: small models only.
    Layers are not detected: all parameters form the one block. The methods are those of
    ``BlockDiagonalCurvature``, with a single block.

    Args:
      func: the model's value function, called as ``func(*func_args)``; it must register its
        losses and must accept a batch of one example (it is evaluated example by example).
      params_index: position of the parameters in ``func_args``. Default 0.
      batch_index: position of the batch in ``func_args``; its leaves' leading axis is the
        example axis that updates loop over. Default 1.
      default_estimation_mode: the mode an update uses when it names none. Default
        ``"fisher_exact"``.
      layer_tag_to_block_ctor: only its ``"generic"`` entry is used: the class of the single
        full block (default ``curvax.curvature_blocks.NaiveFull``). Default None.
      index_to_block_ctor: kfac-jax compatibility, accepted and unused. Default None.
      auto_register_tags: kfac-jax compatibility, accepted and unused (no layer detection).
        Default True.
      param_order: kfac-jax v0.0.8: a permutation of the flat parameter indices giving the
        order of ``to_dense_matrix``'s rows, e.g. another estimator's ``param_order``; None
        keeps the pytree leaf order. Default None.
      auto_register_kwargs: kfac-jax compatibility, accepted and unused.
    """

    def __init__(
        self,
        func: Callable[..., Any],
        params_index: int = 0,
        batch_index: int = 1,
        default_estimation_mode: str = "fisher_exact",
        layer_tag_to_block_ctor: Mapping[str, Any] | None = None,
        index_to_block_ctor: Mapping[tuple[int, ...], Any] | None = None,
        auto_register_tags: bool = True,
        param_order: Sequence[int] | None = None,
        **auto_register_kwargs: Any,
    ):
        super().__init__(func, params_index, default_estimation_mode, auto_register_tags=False)
        self._batch_index = batch_index
        self._full_ctor = (layer_tag_to_block_ctor or {}).get("generic", blocks_lib.NaiveFull)
        if param_order is not None:
            param_order = tuple(int(i) for i in param_order)
            if sorted(param_order) != list(range(len(param_order))):
                raise ValueError(f"`param_order` must be a permutation of 0..n-1 (flat parameter indices), got {param_order}.")
        self._param_order = param_order

    @property
    def param_order(self) -> tuple[int, ...]:
        """The order of the parameters (flat leaf indices) in ``to_dense_matrix`` (kfac-jax v0.0.8).

        Set with the ``param_order`` argument (e.g. another estimator's ``param_order``);
        the default is the pytree leaf order.
        """
        n = self.processed_jaxpr.num_params
        order = self._param_order if self._param_order is not None else tuple(range(n))
        if len(order) != n:
            raise ValueError(f"`param_order` has {len(order)} entries but the function has {n} parameter leaves.")
        return order

    def _dense_permutation(self) -> np.ndarray:
        """Element positions of the leaf-ordered dense matrix, in ``param_order``."""
        pj = self.processed_jaxpr
        sizes = [int(np.prod(pj.program.avals[pj.program.input_keys[pj.params_offset + i]].shape)) for i in range(pj.num_params)]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        return np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in self.param_order] or [np.zeros(0, int)])

    def to_diagonal_block_dense_matrix(self, state: BlockDiagonalState) -> tuple[jax.Array, ...]:
        """The one dense matrix of ``state`` (in ``param_order``), as a 1-tuple (kfac-jax v0.0.8 name)."""
        return (self.to_dense_matrix(state),)

    @property
    def batch_index(self) -> int:
        """Position in ``func_args`` of the batch that is evaluated one example at a time."""
        return self._batch_index

    def finalize(self, func_args: Sequence[Any], traced: tuple[Any, Any] | None = None) -> None:
        """Traces ``func`` on ``func_args`` and builds the single full block (once).

        ``func_args``: example arguments of ``func`` (only shapes and dtypes matter); ``traced``
        as for ``BlockDiagonalCurvature.finalize``.
        """
        pj = self._cache.get(func_args, traced)
        if self._blocks is not None:
            return
        self._pj = pj
        structs = tuple(
            jax.ShapeDtypeStruct(pj.program.avals[pj.program.input_keys[pj.params_offset + i]].shape,
                                 pj.program.avals[pj.program.input_keys[pj.params_offset + i]].dtype)
            for i in range(pj.num_params)
        )
        eqn = tags.LayerTagEqn(tags.generic, (), (), structs, tuple(range(pj.num_params)), {}, "Exact[all parameters]")
        self._blocks = (self._full_ctor(eqn, eqn.name),)
        self._block_notes = (None,)
        self._all_indices = (tuple(range(pj.num_params)),)

    def params_vector_to_blocks_vectors(self, parameter_structured_vector: Any) -> tuple[tuple[jax.Array, ...], ...]:
        """``parameter_structured_vector`` (a parameter-shaped pytree) as a 1-tuple holding all its leaves.

        The single block's vector, leaves in pytree order; ``ValueError`` if the structure
        differs from the parameters'.
        """
        self._require_finalized()
        leaves, tree = jax.tree_util.tree_flatten(parameter_structured_vector)
        if tree != self._pj.params_tree:  # type: ignore[union-attr]
            raise ValueError(f"The vector must have the structure of the parameters: {self._pj.params_tree}, got {tree}.")  # type: ignore[union-attr]
        return (tuple(leaves),)

    def blocks_vectors_to_params_vector(self, blocks_vectors: Sequence[Sequence[jax.Array]]) -> Any:
        """Inverse of ``params_vector_to_blocks_vectors``: the single block's arrays as a parameter-shaped pytree.

        ``blocks_vectors`` is a 1-tuple holding the one block's arrays, in leaf order.
        """
        return jax.tree_util.tree_unflatten(self._pj.params_tree, list(blocks_vectors[0]))  # type: ignore[union-attr]

    @property
    def indices_to_block_map(self) -> dict[tuple[int, ...], Any]:
        """Maps the tuple of all flat parameter indices to the single full block."""
        return {self._all_indices[0]: self._blocks[0]}  # type: ignore[index]

    @property
    def params_block_index(self) -> Any:
        """The parameters pytree with every leaf set to ``0`` (all belong to the single block)."""
        pj = self.processed_jaxpr
        return jax.tree_util.tree_unflatten(pj.params_tree, [0] * pj.num_params)

    def to_dense_matrix(self, state) -> jax.Array:
        """The ``dim x dim`` curvature of ``state``, parameters in ``param_order`` (default: pytree leaf order)."""
        self._require_finalized()
        m = self._blocks[0].to_dense_matrix(state.blocks_states[0])  # type: ignore[index]
        if self._param_order is None:
            return m
        perm = self._dense_permutation()
        return m[np.ix_(perm, perm)]

    def update_curvature_matrix_estimate(
        self, state, ema_old, ema_new, batch_size, rng, func_args, pmap_axis_name=None, estimation_mode=None
    ) -> BlockDiagonalState:
        """Folds the full curvature of the batch in ``func_args`` into the moving average.

        Loops over the examples of ``func_args[batch_index]`` (``jax.lax.fori_loop``), adding
        each one's contribution divided by the batch's size; the weights ``ema_old`` and
        ``ema_new`` act as in ``BlockDiagonalCurvature.update_curvature_matrix_estimate``.

        Args:
          state: the state from ``init`` or a previous update.
          ema_old: the weight of the current average.
          ema_new: the weight of this batch's estimate.
          batch_size: kfac-jax compatibility, unused: the size comes from the batch's leading
            axis.
          rng: a PRNG key for sampled modes, folded with each example's index.
          func_args: the arguments of ``func``; the batch sits at ``batch_index``.
          pmap_axis_name: handed to the block, as for ``BlockDiagonalCurvature``. Default None.
          estimation_mode: this update's mode; None uses ``default_estimation_mode``.

        Returns:
          The updated state.
        """
        self.finalize(func_args)
        mode = check_estimation_mode(estimation_mode or self.default_estimation_mode)
        func_args = tuple(func_args)
        batch = func_args[self._batch_index]
        n = utils.default_batch_size_extractor(batch)
        pj = self._example_jaxpr(func_args)

        def one(i: jax.Array, st: BlockDiagonalState) -> BlockDiagonalState:
            example = jax.tree_util.tree_map(lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1, 0), batch)
            args = func_args[: self._batch_index] + (example,) + func_args[self._batch_index + 1 :]
            p, o = pj.split_args(args)  # type: ignore[union-attr]
            (deps, _), vjp, (ops, _) = jax.vjp(lambda q: pj.evaluate(q, o), p, has_aux=True)  # type: ignore[union-attr]
            losses = pj.losses_from_operands(ops)  # type: ignore[union-attr]

            def data_for(cot: tuple) -> list[dict]:
                (dp,) = vjp((cot, ()))
                return [{"inputs": (), "outputs": (), "params": tuple(p), "outputs_tangent": (), "params_tangent": tuple(dp)}]

            old = jnp.where(i == 0, ema_old, 1.0)
            return self._update_from_cotangents(st, losses, data_for, jax.random.fold_in(rng, i), mode, old, ema_new / n, 1, pmap_axis_name)

        return jax.lax.fori_loop(0, n, one, state)

    def _example_jaxpr(self, func_args: tuple) -> ProcessedJaxpr:
        """The function traced on a batch of one example, which the per-example loop evaluates.

        The trace of the full batch cannot be re-run on one example: frameworks bake the
        batch size into the traced equations (Haiku broadcasts a dense bias to ``(B, out)``).
        """
        batch = func_args[self._batch_index]
        one = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((1, *jnp.shape(x)[1:]), jnp.result_type(x)), batch)
        args = func_args[: self._batch_index] + (one,) + func_args[self._batch_index + 1 :]
        try:
            return self._cache.get(args)
        except Exception as e:
            shapes = [tuple(jnp.shape(x)) for x in jax.tree_util.tree_leaves(batch)]
            raise ValueError(
                f"ExplicitExactCurvature evaluates the function one example at a time, but tracing it on a "
                f"batch of one example (func_args[{self._batch_index}] with leaf shapes {shapes} cut to a "
                f"leading size of 1) failed ({type(e).__name__}: {e}). Does the model assume a fixed batch "
                "size (e.g. reshape(16, -1))? Use reshape(x.shape[0], -1)."
            ) from e


class ImplicitExactCurvature:
    """Exact curvature products that never build a matrix.

    For the mean loss over a batch of size ``B`` (from ``batch_size_extractor``
    applied to the last function argument): ``multiply_ggn(v) = J^T G_L J v / B``,
    ``multiply_fisher`` likewise with the loss Fisher, ``multiply_hessian`` the
    Hessian of the registered losses' total divided by ``B``; factor products
    satisfy ``C v = factor(factor_transpose(v))``.

    Every method takes ``func_args``, the arguments of ``func`` for one batch (e.g. ``(params,
    batch)``), and traces ``func`` there; vectors named ``parameter_structured_vector`` are
    pytrees shaped like the parameters, and per-loss vectors are tuples with one entry per
    registered loss, in registration order.

    Args:
      func: the model's value function, called as ``func(*func_args)``; it must register its
        losses (``curvax.register_*_loss``).
      params_index: position of the parameters in ``func_args``. Default 0.
      batch_size_extractor: ``f(batch) -> B``, applied to the last of ``func_args``. Default:
        the leading size of the batch's first leaf.
    """

    def __init__(self, func: Callable[..., Any], params_index: int = 0, batch_size_extractor: Callable[[Any], Any] = utils.default_batch_size_extractor):
        from curvax import transforms

        self.func = func
        self.params_index = params_index
        self._batch_size_extractor = batch_size_extractor
        self._vjp = transforms.loss_tags_vjp(func, params_index)
        self._jvp = transforms.loss_tags_jvp(func, params_index)
        self._hvp = transforms.loss_tags_hvp(func, params_index)

    def batch_size(self, func_args: Sequence[Any]) -> Any:
        """The batch size ``B``: ``batch_size_extractor`` applied to the last of ``func_args``."""
        return self._batch_size_extractor(func_args[-1])

    def multiply_jacobian(self, func_args: Sequence[Any], parameter_structured_vector: Any) -> tuple:
        """``J v``: the Jacobian-vector product of the registered losses' inputs, one tuple per loss.

        ``v`` is ``parameter_structured_vector``; ``J`` is taken at ``func_args``.
        """
        return self._jvp(func_args, parameter_structured_vector)[1]

    def multiply_jacobian_transpose(self, func_args: Sequence[Any], loss_input_vectors: Sequence[Sequence[Any]]) -> Any:
        """``J^T u``: maps per-loss input vectors (one tuple per loss) to a parameter-shaped pytree.

        ``u`` is ``loss_input_vectors``, shaped like each loss's inputs; ``J`` is taken at
        ``func_args``.
        """
        return self._vjp(func_args)[1](loss_input_vectors)

    def _scaled(self, func_args: Sequence[Any], tree: Any, power: float) -> Any:
        b = jnp.asarray(self.batch_size(func_args))
        return jax.tree_util.tree_map(lambda x: x / b**power, tree)

    def _multiply(self, func_args, vector, kind: str) -> Any:
        losses, jv = self._jvp(func_args, vector)
        mv = tuple(tuple(getattr(l, f"multiply_{kind}")(t)) for l, t in zip(losses, jv))
        return self._scaled(func_args, self.multiply_jacobian_transpose(func_args, mv), 1.0)

    def multiply_fisher(self, func_args: Sequence[Any], parameter_structured_vector: Any) -> Any:
        """``F v = J^T F_L J v / B``, the Fisher-vector product of the mean loss.

        ``v`` is ``parameter_structured_vector``; everything is evaluated at ``func_args``.
        """
        return self._multiply(func_args, parameter_structured_vector, "fisher")

    def multiply_ggn(self, func_args: Sequence[Any], parameter_structured_vector: Any) -> Any:
        """``G v = J^T G_L J v / B``, the Gauss-Newton-vector product of the mean loss.

        ``v`` is ``parameter_structured_vector``; everything is evaluated at ``func_args``.
        """
        return self._multiply(func_args, parameter_structured_vector, "ggn")

    def multiply_hessian(self, func_args: Sequence[Any], parameter_structured_vector: Any) -> Any:
        """The Hessian-vector product of the registered losses' total, divided by ``B``.

        The vector is ``parameter_structured_vector``; the Hessian is taken at ``func_args``.
        """
        hv, _ = self._hvp(func_args, parameter_structured_vector)
        return self._scaled(func_args, hv, 1.0)

    def _factor_transpose(self, func_args, vector, kind: str) -> tuple:
        losses, jv = self._jvp(func_args, vector)
        out = tuple(getattr(l, f"multiply_{kind}_factor_transpose")(t) for l, t in zip(losses, jv))
        return self._scaled(func_args, out, 0.5)

    def _factor(self, func_args, loss_inner_vectors, kind: str) -> Any:
        losses, _ = self._vjp(func_args)
        if len(loss_inner_vectors) != len(losses):
            raise ValueError(f"`loss_inner_vectors` needs one entry per registered loss ({len(losses)}).")
        vecs = tuple(tuple(getattr(l, f"multiply_{kind}_factor")(u)) for l, u in zip(losses, loss_inner_vectors))
        return self._scaled(func_args, self.multiply_jacobian_transpose(func_args, vecs), 0.5)

    def multiply_fisher_factor_transpose(self, func_args, parameter_structured_vector) -> tuple:
        """``L^T J v / sqrt(B)``, one inner vector per loss, where ``F_L = L L^T`` is the loss Fisher's factor.

        ``v`` is ``parameter_structured_vector``; everything is evaluated at ``func_args``.
        """
        return self._factor_transpose(func_args, parameter_structured_vector, "fisher")

    def multiply_ggn_factor_transpose(self, func_args, parameter_structured_vector) -> tuple:
        """``L^T J v / sqrt(B)``, one inner vector per loss, where ``G_L = L L^T`` is the loss GGN's factor.

        ``v`` is ``parameter_structured_vector``; everything is evaluated at ``func_args``.
        """
        return self._factor_transpose(func_args, parameter_structured_vector, "ggn")

    def multiply_fisher_factor(self, func_args, loss_inner_vectors) -> Any:
        """``J^T L u / sqrt(B)``: per-loss inner vectors ``u`` to a parameter-shaped pytree (``F_L = L L^T``).

        ``u`` is ``loss_inner_vectors`` (shapes from ``get_loss_inner_vector_shapes_and_batch_size``);
        everything is evaluated at ``func_args``.
        """
        return self._factor(func_args, loss_inner_vectors, "fisher")

    def multiply_ggn_factor(self, func_args, loss_inner_vectors) -> Any:
        """``J^T L u / sqrt(B)``: per-loss inner vectors ``u`` to a parameter-shaped pytree (``G_L = L L^T``).

        ``u`` is ``loss_inner_vectors`` (shapes from ``get_loss_inner_vector_shapes_and_batch_size``);
        everything is evaluated at ``func_args``.
        """
        return self._factor(func_args, loss_inner_vectors, "ggn")

    def get_loss_inner_vector_shapes_and_batch_size(self, func_args, mode: str) -> tuple[tuple, Any]:
        """The shape of each loss's factor inner vector for ``mode`` (``"fisher"`` or ``"ggn"``), and ``B``.

        Both for the batch in ``func_args``.
        """
        if mode not in ("fisher", "ggn"):
            raise ValueError(f"`mode` must be 'fisher' or 'ggn', got {mode!r}.")
        losses, _ = self._vjp(func_args)
        return tuple(tuple(getattr(l, f"{mode}_factor_inner_shape")) for l in losses), self.batch_size(func_args)

    def get_loss_input_shapes_and_batch_size(self, func_args) -> tuple[tuple, Any]:
        """The shapes of each loss's parameter-dependent inputs (one tuple per loss), and ``B``.

        Both for the batch in ``func_args``.
        """
        losses, _ = self._vjp(func_args)
        return tuple(tuple(tuple(x.shape) for x in l.parameter_dependants) for l in losses), self.batch_size(func_args)
