"""K-FAC as an Optax gradient transformation.

``kfac_preconditioner`` maps gradients ``g`` to ``(C + (damping + l2_reg) I)^{-1} g``, where ``C``
is the block-diagonal curvature (K-FAC blocks for the detected layers) estimated from the batch
passed to ``update``. Optax supplies the rest of the update: learning rate, momentum, clipping,
weight decay. ``optax.chain(kfac_preconditioner(...), optax.sgd(lr, momentum=m))`` takes the
same steps as ``curvax.Optimizer`` with that fixed learning rate, momentum and damping
(``tests/test_preconditioner.py``). The optimizer's adaptive learning rate, momentum and damping
need the loss at the new parameters and exact curvature products, which a gradient
transformation does not see: use ``curvax.Optimizer`` for those.

Both transformations here (and kfac-jax 0.0.8's ``OptaxPreconditioner``) are compositions of
the optimizer's own phases (``curvax.step``): the statistics update with its non-finite guard
and counter, the inverse refresh, the preconditioning product, the norm constraint.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from curvax import distributed, estimators, utils
from curvax.step import config as _config
from curvax.step import guard, precondition, refresh, statistics


class KFACPreconditionerState(NamedTuple):
    """``count``: updates so far; ``rng_key``: for the sampled curvature; ``estimator_state``: the
    blocks; ``curvature_updates_skipped``: statistics updates dropped because they were not finite."""

    count: jax.Array
    rng_key: jax.Array
    estimator_state: Any
    curvature_updates_skipped: jax.Array


def _damping_at(damping: float | Callable[[jax.Array], Any], count: jax.Array) -> jax.Array:
    """The damping at update ``count``: the schedule's value or the constant, as float32."""
    value = damping(count) if callable(damping) else damping
    return jnp.asarray(value, jnp.float32)


class _BatchSpec:
    """``example_batch``'s structure, per-example shapes and dtypes, which every batch must share."""

    def __init__(self, example_batch: Any):
        self.leaves, self.tree = jax.tree_util.tree_flatten(example_batch)

    def check(self, batch: Any) -> None:
        """``batch`` has the example's structure, per-example shapes and dtypes (any batch size)."""
        utils.check_batch_leading_sizes(batch)
        leaves, tree = jax.tree_util.tree_flatten(batch)
        if tree != self.tree:
            raise ValueError(f"`batch` must have the structure of `example_batch`: {self.tree}, got {tree}.")
        for i, (a, b) in enumerate(zip(leaves, self.leaves)):
            if np.shape(a)[1:] != np.shape(b)[1:] or np.ndim(a) != np.ndim(b) or jnp.result_type(a) != jnp.result_type(b):
                raise ValueError(
                    f"`batch` leaf {i} has shape {np.shape(a)} and dtype {jnp.result_type(a)}, but `example_batch`'s "
                    f"has {np.shape(b)} and {jnp.result_type(b)}: only the leading (batch) size may differ."
                )


class _ParamsSpec:
    """The parameters' structure, shapes and dtypes at the first ``init`` (the model was traced for those)."""

    def __init__(self) -> None:
        self.spec: Any = None

    def check(self, params: Any, where: str) -> None:
        """``params`` match the first init's (``where`` names the caller in the error)."""
        spec = utils.tree_spec(params)
        if self.spec is not None and spec != self.spec:
            raise ValueError(
                f"`params` passed to {where} differ in structure, shapes or dtypes from those of the first init "
                f"(the transformation traced the model for those):\nfirst init: {self.spec}\n{where}: {spec}"
            )
        self.spec = spec


def _check_update_args(updates: Any, state: Any, params: Any, batch: Any, params_spec: _ParamsSpec) -> None:
    """The arguments of ``kfac_preconditioner``'s ``update``: parameters and batch given, the state
    its own, ``init`` called, ``updates`` shaped as ``params``."""
    if params is None:
        raise ValueError("kfac_preconditioner's update needs `params`: tx.update(grads, state, params, batch=batch).")
    if batch is None:
        raise ValueError(
            "kfac_preconditioner's update needs the batch the gradients came from: "
            "tx.update(grads, state, params, batch=batch)."
        )
    if not isinstance(state, KFACPreconditionerState):
        raise TypeError(f"`state` must be the KFACPreconditionerState from init, got {type(state).__name__}.")
    if params_spec.spec is None:
        raise RuntimeError("Call the transformation's init(params) before update.")
    params_spec.check(params, "update")
    if jax.tree_util.tree_structure(updates) != jax.tree_util.tree_structure(params):
        raise ValueError(
            "`updates` and `params` differ in structure: "
            f"{jax.tree_util.tree_structure(updates)} vs {jax.tree_util.tree_structure(params)}."
        )


def _split_over(mesh: Any) -> distributed.Distribution | None:
    """The split of the curvature work over ``mesh``'s devices (None: no mesh, or one device)."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"`mesh` must be a jax.sharding.Mesh or None, got {type(mesh).__name__}.")
    return distributed.make_distribution(True, True, mesh=mesh)


def kfac_preconditioner(
    loss_fn: Callable[[Any, Any], Any],
    example_batch: Any,
    damping: float | Callable[[jax.Array], Any],
    *,
    l2_reg: float = 0.0,
    curvature_ema: float = 0.95,
    inverse_update_period: int = 5,
    estimation_mode: str = "fisher_gradients",
    layer_tag_to_block_ctor: Mapping[str, Callable[..., Any]] | None = None,
    batch_size_extractor: Callable[[Any], Any] = utils.default_batch_size_extractor,
    seed: int = 0,
    mesh: Mesh | None = None,
    curvature_dtype: Any = None,
    inverse_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """K-FAC preconditioning of the incoming updates (gradients), as an Optax transformation.

    Args:
      loss_fn: ``loss_fn(params, batch)``, which registers its loss (``register_*_loss``);
        its layers are found as by ``curvax.Optimizer``. Only the registrations matter: the
        returned value may be anything.
      example_batch: a batch of the shapes ``update`` will see, for ``init`` to trace the model.
      damping: added, with ``l2_reg``, to the curvature before inverting it; a float (>= 0;
        0 only with ``l2_reg > 0``: undamped inverses are singular) or ``count -> damping``.
      l2_reg: the coefficient of an L2 term ``l2_reg/2 * |params|^2`` the user's objective
        contains, added with ``damping`` to the curvature's diagonal (the gradient must already
        include the term: this transformation does not add it). Non-negative; default 0.
      curvature_ema: decay of the statistics' moving average per update, as for
        ``curvax.Optimizer``. In [0, 1]; default 0.95.
      inverse_update_period: the damped inverses are recomputed every this many updates,
        starting with the first. Positive integer; default 5.
      estimation_mode: how the statistics are estimated (``curvax.estimators.ESTIMATION_MODES``,
        as for ``curvax.Optimizer``). Default ``"fisher_gradients"``.
      layer_tag_to_block_ctor: block classes by layer tag name, as for ``curvax.Optimizer``.
        Default None (the default blocks).
      batch_size_extractor: ``f(batch) -> number of examples``, the statistics' normaliser.
        Default: the leading size of the batch's first leaf.
      seed: the integer seed of the first PRNG key of the sampled estimation modes (e.g.
        ``fisher_gradients``); ``update`` may also be given ``rng=`` instead. Default 0.
      mesh: the ``jax.sharding.Mesh`` the parameters are replicated on, if any: each of its
        devices then refreshes and applies ~1/N of the blocks (``curvax.distributed``), the
        same numbers as without. Default None.
      curvature_dtype: the statistics' dtype, float32 or float64. Default None: the
        parameters' promoted to at least float32 (updates keep each parameter's dtype).
      inverse_dtype: the dtype of the damped inverses and their decompositions, float32 or
        float64. Default None: ``curvature_dtype``'s.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``init(params)`` traces ``loss_fn``
      on ``(params, example_batch)`` and returns a ``KFACPreconditionerState``.

    ``update(updates, state, params, *, batch, rng=None)`` needs the parameters and the batch
    (Optax passes extra keyword arguments through ``optax.chain``). It updates the curvature
    statistics on ``batch``, refreshes the damped inverses every ``inverse_update_period``
    updates (starting with the first) and returns the preconditioned updates. A non-finite
    result (an ill-conditioned curvature with tiny damping) becomes a zero update. A batch
    whose statistics are not finite (a NaN example) leaves the statistics as they were:
    the state's ``curvature_updates_skipped`` counts such updates.
    """
    period = _config.check_kfac_preconditioner_args(loss_fn, damping, l2_reg, curvature_ema, inverse_update_period, estimation_mode, example_batch)
    estimator = estimators.BlockDiagonalCurvature(
        loss_fn, params_index=0, default_estimation_mode=estimation_mode, layer_tag_to_block_ctor=layer_tag_to_block_ctor,
        curvature_dtype=curvature_dtype, inverse_dtype=inverse_dtype,
    )
    example, params_spec, split = _BatchSpec(example_batch), _ParamsSpec(), _split_over(mesh)

    def init_fn(params: Any) -> KFACPreconditionerState:
        utils.check_float_params(params)
        params_spec.check(params, "init")
        func_args = (params, example_batch)
        estimator.finalize(func_args)
        key = jax.random.PRNGKey(seed)
        est_state = estimator.init(key, func_args, None, -1, False)
        return KFACPreconditionerState(jnp.zeros([], jnp.int32), key, est_state, jnp.zeros([], jnp.int32))

    def update_fn(
        updates: Any, state: KFACPreconditionerState, params: Any = None, *, batch: Any = None,
        rng: jax.Array | None = None, **extra_args: Any,
    ) -> tuple[Any, KFACPreconditionerState]:
        del extra_args  # meant for other transformations of a chain
        _check_update_args(updates, state, params, batch, params_spec)
        example.check(batch)
        key = state.rng_key
        if rng is None:
            key, rng = jax.random.split(key)
        # curvax.step's phases: statistics (non-finite ones dropped), refresh, product, guard.
        est_state, skipped = statistics.update_from_args(
            estimator, state.estimator_state, curvature_ema, 1.0, batch_size_extractor(batch), rng, (params, batch)
        )
        identity_weight = l2_reg + _damping_at(damping, state.count)
        est_state = refresh.refresh(estimator, est_state, state.count, period, identity_weight, None, -1, distribution=split)
        precon = precondition.precondition(
            estimator, est_state, updates, identity_weight, False, True, like=updates, distribution=split
        )
        precon = guard.zero_unless_finite(precon, updates)
        count = guard.count(state.curvature_updates_skipped, skipped)
        return precon, KFACPreconditionerState(state.count + 1, key, est_state, count)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ------------------------------------------------------------------------------------------------
# kfac-jax v0.0.8's Optax interface (compatibility-only)
# ------------------------------------------------------------------------------------------------


class OptaxPreconditionState(NamedTuple):
    """``count``: preconditioner steps so far; ``estimator_state``: the curvature blocks;
    ``curvature_updates_skipped`` (ours): statistics updates dropped because they were not
    finite (None in a state built by hand with kfac-jax's two fields: then nothing is counted).

    kfac-jax v0.0.8 name (compatibility-only); ``kfac_preconditioner``'s state is
    ``KFACPreconditionerState``.
    """

    count: jax.Array
    estimator_state: Any
    curvature_updates_skipped: Any = None


class OptaxPreconditioner:
    """kfac-jax v0.0.8's ``OptaxPreconditioner`` over curvax's block-diagonal estimator.

    Compatibility-only: the caller drives the steps (``maybe_update`` with the function's
    arguments, ``apply`` to precondition, ``increment_count``), as in kfac-jax;
    ``as_gradient_transform`` gives an Optax transformation that multiplies by the
    (inverse) curvature held in a ``precond_state`` passed as an extra argument. For a
    self-contained Optax transformation use ``kfac_preconditioner``.

    The arguments are kfac-jax's; ``curvature_update_period`` must be 1 (as in kfac-jax) and
    ``num_samples`` 1.

    Args:
      value_func: the model's value function, ``value_func(params, ..., batch)``, which
        registers its losses; traced for the layers (parameters first, batch last).
      l2_reg: L2 coefficient added with the damping to the curvature's diagonal. Default 0.
      damping: a fixed damping (>= 0; 0 only with ``l2_reg > 0``). Give exactly one of
        ``damping`` and ``damping_schedule``.
      damping_schedule: ``schedule(count) -> damping``, evaluated at the state's count.
      norm_constraint: if given, ``apply`` multiplies the preconditioned vector ``p`` by
        ``min(1, sqrt(norm_constraint / (p^T g)))``, ``g`` being the incoming updates.
        Default None.
      estimation_mode: one of ``curvax.estimators.ESTIMATION_MODES``. Default
        ``"fisher_gradients"``.
      curvature_ema: decay of the statistics' moving average. In [0, 1]; default 0.95.
      curvature_update_period: must be 1 (kfac-jax's only supported value).
      inverse_update_period: cached inverses are refreshed when the count is a multiple of
        this; 1 computes them from the statistics at every product. Default 5.
      use_exact_inverses: exact (eigendecomposition) inverses instead of the factored
        damping approximation. Default False.
      use_sqrt_inv: ``apply`` multiplies by the inverse square root instead of the inverse.
        Default False.
      register_only_generic: generic blocks for every parameter not registered by hand, as
        for ``curvax.Optimizer``. Default False.
      patterns_to_skip: layer pattern names detection must not match, as for
        ``curvax.Optimizer``. Default ``()``.
      auto_register_kwargs: further layer-detection options, as for ``curvax.Optimizer``.
      layer_tag_to_block_ctor: block classes by layer tag name, as for ``curvax.Optimizer``.
      pmap_axis_name: the ``pmap`` axis statistics are averaged over (inside a ``pmap`` only).
        Default ``"kfac_axis"``.
      batch_size_extractor: ``f(batch) -> number of examples``, applied to the last of
        ``func_args``. Default: the leading size of the batch's first leaf.
      distributed_inverses: inside a ``pmap`` over ``pmap_axis_name``, each device refreshes
        the cached inverses of its share of the blocks (dealt by cost) and one ``all_gather``
        shares them (``curvax.distributed``); the same numbers as undistributed. Default True.
      distributed_precon_apply: likewise for the products of ``apply``. Default True.
      num_samples: kfac-jax compatibility: only 1 (``NotImplementedError`` otherwise).
      should_vmap_samples: kfac-jax compatibility, accepted and unused.
      norm_to_scale_identity_weight_per_block: None or ``"none"`` (default: the damping as
        given), or a norm name (``curvax.linalg.NORM_TYPES``, e.g. ``"avg_diag"``): each
        block's damping is multiplied by ``block.norm(state, name)``, its current statistics'
        norm (scale included), in ``apply``, ``multiply_curvature`` and the cache refresh, as
        in kfac-jax 0.0.8. An unknown name raises ``ValueError``.
      curvature_dtype: ours, keyword only: the dtype of the curvature statistics, float32 or
        float64. Default None: the parameters' dtype promoted to at least float32.
      inverse_dtype: ours, keyword only: the dtype of the cached decompositions and inverses,
        float32 or float64. Default None: ``curvature_dtype``'s.
    """

    def __init__(
        self,
        value_func: Callable[..., Any],
        l2_reg: float = 0.0,
        damping: float | None = None,
        damping_schedule: Callable[[jax.Array], Any] | None = None,
        norm_constraint: float | None = None,
        estimation_mode: str = "fisher_gradients",
        curvature_ema: float = 0.95,
        curvature_update_period: int = 1,
        inverse_update_period: int = 5,
        use_exact_inverses: bool = False,
        use_sqrt_inv: bool = False,
        register_only_generic: bool = False,
        patterns_to_skip: Sequence[str] = (),
        auto_register_kwargs: Mapping[str, Any] | None = None,
        layer_tag_to_block_ctor: Mapping[str, Callable[..., Any]] | None = None,
        pmap_axis_name: str = "kfac_axis",
        batch_size_extractor: Callable[[Any], Any] = utils.default_batch_size_extractor,
        distributed_inverses: bool = True,
        distributed_precon_apply: bool = True,
        num_samples: int = 1,
        should_vmap_samples: bool = False,
        norm_to_scale_identity_weight_per_block: str | None = None,
        *,
        curvature_dtype: Any = None,
        inverse_dtype: Any = None,
    ):
        _config.check_optax_preconditioner_args(locals())
        del should_vmap_samples
        # Inside a pmap over `pmap_axis_name` each device refreshes and applies its share of the
        # blocks; elsewhere (one device, no such axis) the split is a no-op.
        self._distribution = distributed.make_distribution(
            bool(distributed_inverses), bool(distributed_precon_apply), axis_name=pmap_axis_name
        )
        self._inverse_update_period = int(inverse_update_period)
        self._l2_reg = l2_reg
        self._damping = damping
        self._damping_schedule = damping_schedule
        self._norm_constraint = norm_constraint
        self._curvature_ema = curvature_ema
        self._pmap_axis_name = pmap_axis_name
        self._batch_size_extractor = batch_size_extractor
        self._use_cached_inverses = self._inverse_update_period != 1
        self._use_exact_inverses = bool(use_exact_inverses)
        self._use_sqrt_inv = bool(use_sqrt_inv)
        self._block_norm = estimators.block_norm_name(norm_to_scale_identity_weight_per_block)
        kwargs = dict(auto_register_kwargs or {})
        if register_only_generic:
            kwargs["register_only_generic"] = True
        if patterns_to_skip:
            kwargs["patterns_to_skip"] = tuple(patterns_to_skip)
        self._estimator = estimators.BlockDiagonalCurvature(
            value_func,
            params_index=0,
            default_estimation_mode=estimators.check_estimation_mode(estimation_mode),
            layer_tag_to_block_ctor=layer_tag_to_block_ctor,
            curvature_dtype=curvature_dtype,
            inverse_dtype=inverse_dtype,
            **kwargs,
        )

    # --- configuration ---------------------------------------------------------------------

    @property
    def estimator(self) -> estimators.BlockDiagonalCurvature:
        """The block-diagonal curvature estimator behind the preconditioner."""
        return self._estimator

    @property
    def pmap_axis_name(self) -> str:
        """The pmap axis name over which statistics are averaged."""
        return self._pmap_axis_name

    @property
    def _exact_powers_to_cache(self) -> int | None:
        return -1 if self._use_exact_inverses and self._use_cached_inverses else None

    @property
    def _approx_powers_to_cache(self) -> int | None:
        return -1 if not self._use_exact_inverses and self._use_cached_inverses else None

    def get_identity_weight(self, state: OptaxPreconditionState) -> Any:
        """``damping + l2_reg`` (the damping from the schedule at ``state.count`` if one was given).

        ``state`` is the ``OptaxPreconditionState``.
        """
        damping = self._damping if self._damping is not None else self._damping_schedule(state.count)  # type: ignore[misc]
        return damping + self._l2_reg

    # --- state ----------------------------------------------------------------------------

    def init(self, func_args: Sequence[Any], rng: jax.Array) -> OptaxPreconditionState:
        """The initial state; traces ``value_func`` on ``func_args`` to find the layers.

        ``func_args`` are example arguments of ``value_func`` (shapes matter); ``rng`` is a PRNG
        key for the blocks' initial state. The count starts at 0, the statistics empty.
        """
        return OptaxPreconditionState(
            count=jnp.zeros([], jnp.int32),
            estimator_state=self._estimator.init(
                rng, func_args, self._exact_powers_to_cache, self._approx_powers_to_cache, False
            ),
            curvature_updates_skipped=jnp.zeros([], jnp.int32),
        )

    def increment_count(self, state: OptaxPreconditionState) -> OptaxPreconditionState:
        """``state`` with its step count incremented (saturating at int32 max)."""
        return state._replace(count=optax.safe_int32_increment(state.count))

    def sync_estimator_state(self, state: OptaxPreconditionState) -> OptaxPreconditionState:
        """Averages the statistics of ``state`` over the devices of a ``pmap`` over ``pmap_axis_name`` (else unchanged)."""
        return state._replace(estimator_state=self._estimator.sync(state.estimator_state, self._pmap_axis_name))

    def should_update_estimator_curvature(self, state: OptaxPreconditionState) -> bool:
        """Always ``True``: the curvature estimate is updated every step (``state`` is not read)."""
        del state
        return True  # curvature_update_period is 1

    def should_update_inverse_cache(self, state: OptaxPreconditionState) -> Any:
        """Whether this step refreshes cached inverses (cached inverses on and ``state``'s count divisible by the update period)."""
        if not self._use_cached_inverses:
            return False
        return state.count % self._inverse_update_period == 0

    def should_sync_estimate_curvature(self, state: OptaxPreconditionState) -> Any:
        """Whether the curvature estimate is synced across devices this step: always without cached inverses, else when the inverse cache is refreshed.

        ``state`` is the ``OptaxPreconditionState`` the step starts from.
        """
        return True if not self._use_cached_inverses else self.should_update_inverse_cache(state)

    # --- updates --------------------------------------------------------------------------

    def _update_estimator_curvature(
        self, estimator_state: Any, func_args: Sequence[Any], rng: jax.Array, ema_old: Any, ema_new: Any,
        sync: Any = True, identity_weight: Any = 0.0,
    ) -> Any:
        """``(state, skipped)``: the statistics phase (``curvax.step.statistics``), averaged over the
        pmap devices when ``sync`` and dropped whole, on every device alike, when not finite."""
        return statistics.update_from_args(
            self._estimator, estimator_state, ema_old, ema_new, self._batch_size_extractor(func_args[-1]), rng,
            func_args, self._pmap_axis_name, identity_weight=identity_weight, sync=sync,
        )

    def maybe_update_estimator_curvature(
        self, state: OptaxPreconditionState, func_args: Sequence[Any], rng: jax.Array,
        decay_old_ema: Any = True, sync: Any = True,
    ) -> OptaxPreconditionState:
        """Folds the statistics of ``func_args`` into the moving average (``ema_old=1`` if not ``decay_old_ema``).

        Args:
          state: the ``OptaxPreconditionState``.
          func_args: the arguments of ``value_func`` for this batch (batch last).
          rng: a PRNG key for the sampled estimation modes.
          decay_old_ema: True decays the old average by ``curvature_ema``; False keeps a
            running mean (a bool or a traced boolean). Default True.
          sync: average the statistics over the ``pmap`` devices after the update (a bool or a
            traced boolean). Default True.
        """
        ema_old = decay_old_ema * self._curvature_ema + (1.0 - decay_old_ema) * 1.0
        est_state, skipped = self._update_estimator_curvature(
            state.estimator_state, func_args, rng, ema_old, 1.0, sync, self.get_identity_weight(state)
        )
        count = guard.count(state.curvature_updates_skipped, skipped)
        return state._replace(estimator_state=est_state, curvature_updates_skipped=count)

    def maybe_update_inverse_cache(self, state: OptaxPreconditionState) -> OptaxPreconditionState:
        """Refreshes the cached inverses of ``state`` every ``inverse_update_period`` steps."""
        est_state = refresh.refresh_when(
            self._estimator, state.estimator_state, self.should_update_inverse_cache(state),
            self.get_identity_weight(state), self._exact_powers_to_cache, self._approx_powers_to_cache,
            self._distribution, self._block_norm,
        )
        return state._replace(estimator_state=est_state)

    def maybe_update(self, state: OptaxPreconditionState, func_args: Sequence[Any], rng: jax.Array) -> OptaxPreconditionState:
        """Updates the statistics and, when due, the cached inverses.

        ``state`` is the ``OptaxPreconditionState``, ``func_args`` the arguments of
        ``value_func`` for this batch, ``rng`` a PRNG key for the sampled estimation modes.
        """
        state = self.maybe_update_estimator_curvature(
            state, func_args, rng, sync=self.should_sync_estimate_curvature(state)
        )
        return self.maybe_update_inverse_cache(state)

    # --- products -------------------------------------------------------------------------

    def apply(self, updates: Any, state: OptaxPreconditionState) -> Any:
        """``(C + (damping + l2_reg) I)^-1 updates`` (``^-1/2`` with ``use_sqrt_inv``), norm-constrained if asked.

        ``updates`` is a parameter-shaped pytree; ``C`` comes from ``state``.
        """
        new = precondition.precondition(
            self._estimator, state.estimator_state, updates, self.get_identity_weight(state), self._use_exact_inverses,
            self._use_cached_inverses, -0.5 if self._use_sqrt_inv else -1, self._pmap_axis_name,
            distribution=self._distribution, block_norm=self._block_norm,
        )
        if self._norm_constraint is not None:
            new, _ = precondition.constrain_norm(new, updates, self._norm_constraint, floor=None)
        return new

    def multiply_curvature(self, updates: Any, state: OptaxPreconditionState) -> Any:
        """``(C + (damping + l2_reg) I) updates`` for a parameter-shaped ``updates``, ``C`` from ``state``."""
        return precondition.curvature_product(
            self._estimator, state.estimator_state, updates, self.get_identity_weight(state), self._use_exact_inverses,
            self._use_cached_inverses, self._pmap_axis_name, self._block_norm,
        )

    def as_gradient_transform(self, use_inverse: bool = True) -> optax.GradientTransformationExtraArgs:
        """An Optax transformation multiplying by the (inverse) curvature of ``precond_state=`` (an extra argument).

        ``use_inverse`` True multiplies with ``apply`` (the damped inverse), False with
        ``multiply_curvature``.
        """
        multiply_fn = self.apply if use_inverse else self.multiply_curvature

        def init_fn(params: Any) -> optax.EmptyState:
            del params
            return optax.EmptyState()

        def update_fn(updates: Any, state: Any, params: Any = None, *, precond_state: OptaxPreconditionState, **extra_args: Any):
            del params, extra_args
            return multiply_fn(updates, precond_state), state

        return optax.GradientTransformationExtraArgs(init_fn, update_fn)
