"""The K-FAC optimizer, with kfac-jax's documented interface.

One step, compiled once (periodic work is ``lax.cond`` inside it), composed of the phases in
``curvax.step`` (``curvax.step.program.StepProgram.step``):

1. one forward pass of the user's value function through our tracer, linearized
   (``curvax.step.forward``);
2. transposes of that linearization give the gradient and the gradients of the
   sampled loss w.r.t. every layer output (curvature statistics, every
   ``curvature_update_period`` steps: 1 by default, as in kfac-jax; ``curvax.step.statistics``).
   With ``curvature_batch_fraction < 1`` the curvature (statistics and the exact
   quadratic model below) comes from a second linearization, on a random sub-batch;
3. every ``inverse_update_period`` steps the blocks refresh their inverses (``curvax.step.refresh``);
4. the preconditioned gradient ``Delta = (C + (l2 + damping) I)^-1 g`` (``curvax.step.precondition``);
5. learning rate and momentum either given, scheduled, or chosen by minimising
   the quadratic model over ``span(Delta, velocity)`` (exact curvature products
   come from the same linearization; ``curvax.step.coefficients``); non-finite updates are
   skipped and counted (``curvax.step.guard``);
6. every ``damping_adaptation_interval`` steps the Levenberg–Marquardt rule
   moves the damping by ``decay ** interval`` from the reduction ratio (``curvax.step.damping``).

This module adds the host side: the constructor (arguments checked by
``curvax.step.config``), ``init`` (tracing, the gradient proof), compilation (``jax.jit`` or
kfac-jax's ``jax.pmap`` mode), the burn-in loop and the reports.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp

from curvax import _compat, estimators, parallel, partitioned, utils
from curvax.step import coefficients as _coefficients
from curvax.step import config as _config
from curvax.step import damping as _damping
from curvax.step import guard as _guard
from curvax.step.program import StepProgram
from curvax.step.state import OptimizerState
from curvax.step.value_function import ValueFunction

logger = logging.getLogger("curvax")

# A finite loss this many times larger in magnitude than the first finite loss (or than 1) is
# reported as diverging (``stats["loss_diverged"]`` and a warning in the "curvax" log).
DIVERGENCE_FACTOR = _guard.DIVERGENCE_FACTOR

# kfac-jax 0.0.8's name for the argument tuples of the value function (compatibility only):
# ``(params, batch)``, ``(params, func_state, batch)``, ``(params, rng, batch)`` or all four.
FuncArgsVariants = tuple
# kfac-jax 0.0.8's example values of `regularized_parameters_path_exclusions` (compatibility only).
HAIKU_BIASES = "b,bias"
HAIKU_BIASES_AND_NORMS = "b,bias,scale,offset"



class Optimizer:
    """The K-FAC optimizer (Martens & Grosse, 2015), drop-in for ``kfac_jax.Optimizer``.

    Usage: ``opt = Optimizer(jax.value_and_grad(loss_fn), l2_reg=...)``, then ``state =
    opt.init(params, rng, batch)`` once and ``params, state, stats = opt.step(params, state,
    rng, batch=batch, ...)`` per step. Each step computes the gradient ``g`` (the one
    ``value_and_grad_func`` returns), folds the batch into the block-diagonal curvature estimate
    ``C`` (one block per detected layer, see ``registration_table``), and moves the parameters
    by ``delta = -lr * (C + (l2_reg + damping) I)^-1 g + momentum * previous_delta``.

    The full reference, each argument and each ``stats`` key explained, is the docs page
    ``docs/reference/optimizer.md`` ("Optimizer reference" in the built documentation).

    **The value_and_grad_func contract.** It is called as ``value_and_grad_func(params,
    [func_state], [rng], batch)`` and returns ``(value, grads)`` like ``jax.value_and_grad``:
    ``value`` is the scalar ``loss``, ``(loss, aux)`` with ``value_func_has_aux``, ``(loss,
    new_func_state)`` with ``value_func_has_state``, ``(loss, (new_func_state, aux))`` with
    both. ``grads`` is the gradient of ``loss``. This gradient is the one the step uses (taken
    from curvax's own pass when ``init`` proves it equal: ``shares_gradient_pass``). Inside the
    computation of ``loss`` the function must call a ``curvax.register_*_loss`` on the model's
    output (e.g. ``register_softmax_cross_entropy_loss(logits, labels)``); ``init`` raises
    ``ValueError`` when none is found. An L2 term in ``loss`` is declared through ``l2_reg``.

    Every constructor argument of kfac-jax's documented API (in its positional order) and of
    kfac-jax 0.0.8 (its additions keyword-only) is accepted; those curvax does not implement
    accept their default only and raise ``NotImplementedError`` otherwise. The arguments, by
    group (required: ``value_and_grad_func`` and ``l2_reg``):

    - The value function: ``value_and_grad_func``, ``l2_reg``, ``value_func_has_aux``,
      ``value_func_has_state``, ``value_func_has_rng``, ``value_func_for_estimator``,
      ``batch_process_func``, ``batch_size_extractor``.
    - Learning rate and momentum: ``use_adaptive_learning_rate``, ``learning_rate_schedule``,
      ``use_adaptive_momentum``, ``momentum_schedule``, ``norm_constraint``.
    - Damping: ``use_adaptive_damping``, ``damping_schedule``, ``initial_damping``,
      ``min_damping``, ``max_damping``, ``include_damping_in_quad_change``,
      ``damping_adaptation_interval``, ``damping_adaptation_decay``,
      ``damping_lower_threshold``, ``damping_upper_threshold``,
      ``always_use_exact_qmodel_for_damping_adjustment``, ``precon_damping_mult``,
      ``precon_damping_schedule``, ``norm_to_scale_identity_weight_per_block``.
    - The curvature estimate: ``estimation_mode``, ``curvature_ema``,
      ``curvature_update_period``, ``curvature_batch_fraction``, ``num_burnin_steps``,
      ``inverse_update_period``, ``inverse_update_staggered``, ``use_exact_inverses``,
      ``curvature_dtype``, ``inverse_dtype``, ``factor_budget``, ``oversized_factor``.
    - Layer detection: ``use_automatic_registration``, ``register_only_generic``,
      ``patterns_to_skip``, ``auto_register_kwargs``, ``layer_tag_to_block_ctor``.
    - Devices and debugging: ``multi_device``, ``pmap_axis_name``, ``debug``,
      ``distributed_precon_apply``, ``distributed_inverses``, ``shard_curvature_state``.
    - Statistics and attributes: ``include_norms_in_stats``,
      ``include_per_param_norms_in_stats``, ``invalid_metric_value``,
      ``forbid_setting_attributes_after_finalize``, ``modifiable_attribute_exceptions``.
    - kfac-jax 0.0.8 arguments curvax does not implement:
      ``regularized_parameters_path_exclusions``, ``use_initial_damping_calibration``,
      ``use_step_rejection``, ``reject_damping_increase_factor``, ``custom_estimator_ctor``,
      ``include_registered_loss_in_stats``, ``num_estimator_samples``,
      ``should_vmap_estimator_samples``, ``precon_power``, ``exact_quad_model_matrix_type``.

    ``norm_to_scale_identity_weight_per_block`` (kfac-jax 0.0.8): None or ``"none"`` leaves the
    damping as it is; a norm name of ``curvax.linalg.NORM_TYPES`` (e.g. ``"avg_diag"``)
    multiplies each block's damping (``l2_reg`` included) by that block's norm,
    ``block.norm(state, name)``, in the preconditioned gradient and the cached inverses. It is
    refused (``ValueError``) with adaptive learning rate, momentum or damping, as in kfac-jax.

    ``step`` returns a dict of scalar ``stats`` (``loss``, ``learning_rate``, ``momentum``,
    ``damping``, ``update_skipped`` ...; nan where not computed on a step), listed in the
    reference page. Skipped updates, dropped statistics and a diverging loss are also logged as
    warnings on the ``"curvax"`` logger.

    Raises:
      ValueError, TypeError: for contradictory or out-of-range arguments, naming the argument.
      NotImplementedError: for a non-default value of a kfac-jax 0.0.8 argument curvax does not
        implement.
    """

    State = OptimizerState

    def __init__(
        self,
        value_and_grad_func: Callable[..., Any],
        l2_reg: Any,
        value_func_has_aux: bool = False,
        value_func_has_state: bool = False,
        value_func_has_rng: bool = False,
        use_adaptive_learning_rate: bool = False,
        learning_rate_schedule: Callable[[Any], Any] | None = None,
        use_adaptive_momentum: bool = False,
        momentum_schedule: Callable[[Any], Any] | None = None,
        use_adaptive_damping: bool = False,
        damping_schedule: Callable[[Any], Any] | None = None,
        initial_damping: Any = None,
        min_damping: Any = 1e-8,
        max_damping: Any = math.inf,
        include_damping_in_quad_change: bool = False,
        damping_adaptation_interval: int = 5,
        damping_adaptation_decay: Any = 0.9,
        damping_lower_threshold: Any = 0.25,
        damping_upper_threshold: Any = 0.75,
        always_use_exact_qmodel_for_damping_adjustment: bool = False,
        norm_constraint: Any = None,
        num_burnin_steps: int = 10,
        estimation_mode: str = "fisher_gradients",
        curvature_ema: Any = 0.95,
        inverse_update_period: int = 5,
        use_exact_inverses: bool = False,
        batch_process_func: Callable[[Any], Any] | None = None,
        register_only_generic: bool = False,
        patterns_to_skip: Sequence[str] = (),
        auto_register_kwargs: Mapping[str, Any] | None = None,
        layer_tag_to_block_ctor: Mapping[str, Any] | None = None,
        multi_device: bool = False,
        debug: bool = False,
        batch_size_extractor: Callable[[Any], Any] = utils.default_batch_size_extractor,
        pmap_axis_name: str = "kfac_axis",
        forbid_setting_attributes_after_finalize: bool = True,
        modifiable_attribute_exceptions: Sequence[str] = (),
        include_norms_in_stats: bool = False,
        include_per_param_norms_in_stats: bool = False,
        distributed_precon_apply: bool = True,
        distributed_inverses: bool = True,
        curvature_update_period: int = 1,
        curvature_batch_fraction: float = 1.0,
        *,
        value_func_for_estimator: Callable[..., Any] | None = None,
        precon_damping_mult: Any = 1.0,
        precon_damping_schedule: Callable[[Any], Any] | None = None,
        use_automatic_registration: bool = True,
        regularized_parameters_path_exclusions: str = "",
        use_initial_damping_calibration: bool = False,
        use_step_rejection: bool = False,
        reject_damping_increase_factor: Any = 1.0,
        custom_estimator_ctor: Callable[..., Any] | None = None,
        invalid_metric_value: Any = math.nan,
        include_registered_loss_in_stats: bool = False,
        num_estimator_samples: int = 1,
        should_vmap_estimator_samples: bool = False,
        norm_to_scale_identity_weight_per_block: str | None = None,
        precon_power: Any = -1.0,
        exact_quad_model_matrix_type: str | None = None,
        inverse_update_staggered: bool = False,
        curvature_dtype: Any = None, inverse_dtype: Any = None,
        factor_budget: int | None = partitioned.DEFAULT_FACTOR_BUDGET, oversized_factor: str | int = "partition",
        shard_curvature_state: bool | None = None,
    ):
        """Checks the arguments and builds the (not yet traced) curvature estimator.

        Every argument is explained in ``docs/reference/optimizer.md``. Nothing
        is traced or compiled here: ``init`` traces the value function on its example batch.
        """
        args = {name: value for name, value in locals().items() if name != "self"}
        _config.check_optimizer_args(args)
        self._config = _config.optimizer_config(args)
        _config.check_schedules(self._config)
        self._func = ValueFunction(
            value_and_grad_func, bool(value_func_has_aux), bool(value_func_has_state), bool(value_func_has_rng)
        )
        self._has_state = self._func.has_state
        self._multi_device = bool(multi_device)
        # kfac-jax's pmap mode: every input has a leading device axis and every batch quantity is
        # averaged over it (`self._axis`, None otherwise).
        self._axis: str | None = pmap_axis_name if self._multi_device else None
        self._pmap_axis_name = pmap_axis_name
        self._debug = bool(debug)
        self.distributed_precon_apply, self.distributed_inverses = distributed_precon_apply, distributed_inverses
        self._burnin_warned, self._report = False, _guard.Reporter()
        self.trace_count = 0  # how many times the step function was traced (compiled)
        self._estimator = _config.estimator_from_args(args, self._func.value)
        self._program = self._make_program(args)
        self._params_spec: Any = None
        self._state_spec: Any = None
        self._checked_signature: Any = None  # of the last step arguments that passed the checks
        self._checked_batch_signature: Any = None  # of the last batch that passed them
        self._compile()
        self._forbid = bool(forbid_setting_attributes_after_finalize)
        self._modifiable = frozenset(modifiable_attribute_exceptions)
        self._finalized = True

    def _make_program(self, args: dict[str, Any]) -> StepProgram:
        """The step's phases (``curvax.step.program``) over this optimizer's function, estimator
        and flags, with kfac-jax's distribution flags."""
        program = StepProgram(
            self._config, self._func, self._estimator, args["batch_process_func"], args["batch_size_extractor"],
            self._axis, bool(args["include_norms_in_stats"]), bool(args["include_per_param_norms_in_stats"]),
        )
        program.distribute = (bool(args["distributed_inverses"]), bool(args["distributed_precon_apply"]))
        shard = args["shard_curvature_state"]
        if shard is not None and not isinstance(shard, bool):
            raise TypeError(f"`shard_curvature_state` must be True, False or None, got {shard!r}.")
        program.shard_curvature_state = shard
        return program

    def _compile(self) -> None:
        """Wraps init, burn-in and step in ``jax.jit`` (nothing with ``debug``) or, in the pmap
        mode, ``jax.pmap``; as in kfac-jax, the pmapped step donates the parameters, the state
        and func_state, and the burn-in its state."""
        if self._multi_device:
            pmap = lambda f, donate=(): jax.pmap(f, axis_name=self._pmap_axis_name, donate_argnums=donate)
            self._jit_step = pmap(self._step_impl, (0, 1, 4))
            self._jit_burnin = pmap(self._program.burnin, (1,))
            self._jit_init = pmap(self._program.init)
            # The step as ``step`` calls it: with the flags word of its report (``_guard``), by
            # its compiled program (``parallel.CompiledPmap``: no pmap dispatch in Python).
            reported = parallel.CompiledPmap(pmap(self._step_reported, (0, 1, 4)))
            self._call_step = reported
        else:
            wrap = (lambda f, **kw: f) if self._debug else jax.jit
            self._jit_step = wrap(self._step_impl)
            self._jit_burnin = wrap(self._program.burnin)
            self._jit_init = wrap(self._program.init)
            reported = wrap(self._step_reported)
            self._call_step = lambda key, *args: reported(*args)

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_finalized", False) and self._forbid and not name.startswith("_") and name not in self._modifiable and name != "trace_count":
            raise AttributeError(
                f"Cannot set {name!r} after construction: compiled methods would not see it. Pass "
                "forbid_setting_attributes_after_finalize=False or modifiable_attribute_exceptions to allow it."
            )
        object.__setattr__(self, name, value)

    # --- documented properties ---------------------------------------------------------------

    @property
    def multi_device(self) -> bool:
        """Whether the optimizer runs kfac-jax's pmap mode (kfac-jax compatibility)."""
        return self._multi_device

    @property
    def pmap_axis_name(self) -> str | None:
        """The pmap axis name with ``multi_device``, else None (kfac-jax compatibility)."""
        return self._axis

    def get_first(self, obj: Any) -> Any:
        """The first device's slice of ``obj`` with ``multi_device``, else ``obj`` (kfac-jax compatibility)."""
        return utils.get_first(obj) if self._multi_device else obj

    @property
    def num_burnin_steps(self) -> int:
        """Number of curvature-estimation (burn-in) steps run at step 0, before the first update."""
        return self._config.num_burnin_steps

    @property
    def l2_reg(self) -> jax.Array:
        """The L2 regularisation coefficient, as an array."""
        return jnp.asarray(self._config.l2_reg)

    @property
    def estimator(self) -> estimators.BlockDiagonalCurvature:
        """The block-diagonal curvature estimator used as preconditioner."""
        return self._estimator

    @property
    def damping_decay_factor(self) -> float:
        """Factor applied to the damping per adaptive-damping update: ``decay ** interval``."""
        return _damping.decay_factor(self._config)

    def should_update_damping(self, state: OptimizerState) -> jax.Array:
        """Whether this step adapts the damping: adaptive damping is on and the next step counter is a multiple of the interval.

        ``state`` is the ``Optimizer.State`` the step starts from; the answer is a boolean array.
        """
        return _damping.due(self._config, state.step_counter)

    # --- init ------------------------------------------------------------------------------------

    def init(self, params: Any, rng: jax.Array, batch: Any, func_state: Any = None) -> OptimizerState:
        """Builds the curvature blocks from one example batch and returns the initial state.

        Traces the value function on ``(params, [func_state], [rng], batch)``, checks its outputs
        against the ``value_func_has_*`` flags, detects the layers and the registered losses
        (logging the parameter → layer → block table, as a warning when a parameter fell back to
        a generic block; see ``registration_table``) and decides whether the step may share
        its pass for the gradient (``shares_gradient_pass``). No statistics are gathered here:
        the burn-in runs at the first ``step``.

        With ``multi_device=True`` (kfac-jax's pmap mode) every array carries a leading axis of
        ``jax.local_device_count()``: ``params``, ``rng`` and ``func_state`` alike on every device,
        ``batch`` split over them; the state comes back with that axis.

        Args:
          params: the parameters pytree that ``step`` will update: floating-point leaves
            (bfloat16, float16, float32 or float64; half-precision models get float32
            curvature, see ``curvature_dtype``).
          rng: a PRNG key (``jax.random.PRNGKey``); passed to the value function when
            ``value_func_has_rng``, and used for the blocks' initial state.
          batch: an example batch with the shapes of the training batches (after
            ``batch_process_func``); its leaves share their leading (batch) size. Another batch
            size later costs one more trace and compilation.
          func_state: the value function's state; required when ``value_func_has_state``,
            otherwise leave it None.

        Returns:
          The initial ``Optimizer.State``: zero velocities, empty curvature statistics, the
          damping set to ``initial_damping`` (0 when None), ``data_seen`` and ``step_counter``
          zero.

        Raises:
          ValueError, TypeError: when the value function's call or outputs do not match the
            flags, no loss is registered, a parameter is not floating point, the batch's leaves
            disagree on their leading size, or ``func_state`` is missing.
        """
        utils.check_rng(rng)
        if self._multi_device:
            n = jax.local_device_count()
            parallel.check_device_axis({"params": params, "rng": rng, "batch": batch, "func_state": func_state}, n)
            # Trace the loss on one device's slice, with the device axis bound: it may call collectives.
            # The slice is taken off the pmap's mesh, so that the trace fits inside the pmapped step.
            with _compat.bound_axes([(self._pmap_axis_name, n)]):
                self._prepare(*parallel.unplaced_slice((params, rng, batch, func_state)))
            self._program.state_shardings = None  # pmap places the state itself
            state = self._jit_init(params, rng, batch, func_state)
        else:
            self._prepare(params, rng, batch, func_state)
            state = self._jit_init(params, rng, batch, func_state)
        self._state_spec = _config.state_spec(state)
        self._checked_signature = self._checked_batch_signature = None
        return state

    def _prepare(self, params: Any, rng: jax.Array, batch: Any, func_state: Any) -> None:
        """The host-side part of ``init``: checks the arguments, traces the loss, builds the blocks."""
        self._check_params_dtype(params)
        _config.check_finite_params(params)
        utils.check_batch_leading_sizes(batch)
        if self._has_state and func_state is None:
            raise ValueError("value_func_has_state=True: pass `func_state` to init.")
        self._gradient_proof, self._registration_table = self._program.prepare(params, rng, batch, func_state)
        self._params_spec = utils.tree_spec(params)

    @property
    def shares_gradient_pass(self) -> bool:
        """Whether the step takes the gradient from its own linearized pass (known after ``init``).

        True only when that gradient is proven equal to the one ``value_and_grad_func`` returns
        (``jax.value_and_grad`` of the traced loss, no custom derivative rule around the
        parameters); otherwise every step calls ``value_and_grad_func`` for the loss and gradient.
        ``gradient_source_reason`` says why.
        """
        if self._params_spec is None:
            raise RuntimeError("Call `init` first.")
        return self._gradient_proof.shared

    @property
    def gradient_source_reason(self) -> str:
        """Why the gradient is (or is not) taken from curvax's own pass; see ``shares_gradient_pass``."""
        if self._params_spec is None:
            raise RuntimeError("Call `init` first.")
        return self._gradient_proof.reason

    def registration_table(self) -> str:
        """The parameter → layer → block table (available after ``init``); a layer whose factor
        exceeds ``factor_budget`` says how it is partitioned and why."""
        if self._params_spec is None:
            raise RuntimeError("Call `init` first.")
        return self._registration_table

    # --- burn-in -------------------------------------------------------------------------------

    def burnin(self, num_steps: int, params: Any, state: OptimizerState, rng: jax.Array, data_iterator: Iterator[Any], func_state: Any = None) -> tuple[OptimizerState, Any]:
        """Accumulates curvature statistics for ``num_steps`` batches without moving the parameters.

        ``step`` calls it at step 0 with ``num_burnin_steps``; calling it directly is the kfac-jax
        API for more burn-in. Each batch's estimate is averaged in with equal weight.

        Args:
          num_steps: how many batches to draw from ``data_iterator``.
          params: the parameters at which the curvature is estimated.
          state: the ``Optimizer.State``; only its curvature statistics change.
          rng: a PRNG key, split once per batch.
          data_iterator: an iterator of batches.
          func_state: the value function's state (when ``value_func_has_state``), passed
            through unchanged.

        Returns:
          ``(state, func_state)``.
        """
        for i in range(num_steps):
            rng, key = parallel.split_keys(rng, 2, self._multi_device)
            try:
                batch = next(data_iterator)
            except StopIteration:
                raise ValueError(
                    f"`data_iterator` ran out after {i} batch(es) of the burn-in's {num_steps} "
                    f"(num_burnin_steps={self._config.num_burnin_steps}); the first step needs "
                    "num_burnin_steps + 1 batches from it."
                ) from None
            self._check_batch(batch)
            state = self._jit_burnin(params, state, key, batch, func_state)
        return state, func_state

    def _check_batch(self, batch: Any) -> None:
        """Batch leaves agree on their batch size (and, with ``multi_device``, carry the device axis)."""
        if self._multi_device:
            parallel.check_device_axis({"batch": batch}, jax.local_device_count())
            batch = parallel.local_shapes(batch)
        utils.check_batch_leading_sizes(batch)

    # --- step --------------------------------------------------------------------------------

    def verify_args_and_get_step_counter(self, step_counter: Any, learning_rate: Any = None, momentum: Any = None, damping: Any = None, global_step_int: int | None = None) -> int:
        """Checks which of learning_rate/momentum/damping must be passed; returns the step as an int.

        Each of ``learning_rate``, ``momentum`` and ``damping`` (the values given to ``step``,
        or None) is required when it is neither adaptive nor scheduled and refused otherwise
        (``ValueError`` naming it). Returns ``global_step_int`` when given, else
        ``step_counter`` (the state's counter) as a Python int (kfac-jax's method; ``step``
        calls it).
        """
        _config.check_step_coefficients(self._config, learning_rate, momentum, damping)
        if global_step_int is not None:
            return int(global_step_int)
        return int(step_counter)

    def step(
        self,
        params: Any,
        state: OptimizerState,
        rng: jax.Array,
        data_iterator: Iterator[Any] | None = None,
        batch: Any = None,
        func_state: Any = None,
        learning_rate: Any = None,
        momentum: Any = None,
        damping: Any = None,
        global_step_int: int | None = None,
    ) -> tuple:
        """One optimizer step: statistics, (periodic) inverses, preconditioned update, damping.

        The first call (step counter 0) first runs ``num_burnin_steps`` curvature-only updates.
        The step is compiled once (``trace_count`` counts its traces); a batch of another shape
        compiles it again. Under ``multi_device`` every argument carries the device axis, as
        for ``init``, and the input ``params``, ``state`` and ``func_state`` are donated.

        Args:
          params: the current parameters, with the structure, shapes and dtypes given to
            ``init``.
          state: the ``Optimizer.State`` returned by ``init`` or the previous ``step``.
          rng: a PRNG key for this step (split for the burn-in, the sampled curvature
            cotangents, the ``curvature_batch_fraction`` sub-batch and the value function's
            ``rng`` argument); pass a fresh key every step.
          data_iterator: an iterator of batches; ``next`` is called once per step, plus
            ``num_burnin_steps`` times at the first step for the burn-in. Give exactly one of
            ``data_iterator`` and ``batch``.
          batch: this step's batch (kfac-jax 0.0.8's way); the burn-in, if any, then reuses it
            (with a warning). Give exactly one of ``data_iterator`` and ``batch``.
          func_state: the value function's state; required when ``value_func_has_state``.
          learning_rate: scalar learning rate for this step; required when the optimizer has
            neither ``use_adaptive_learning_rate`` nor a ``learning_rate_schedule``, refused
            otherwise.
          momentum: scalar momentum for this step; required unless ``use_adaptive_momentum``
            or a ``momentum_schedule`` (then refused). Pass 0 for none.
          damping: scalar damping for this step; required unless ``use_adaptive_damping`` or a
            ``damping_schedule`` (then refused). A finite number >= 0; 0 only with
            ``l2_reg > 0`` (``ValueError`` otherwise).
          global_step_int: the step number as a Python int, if the caller tracks it; it
            decides whether this is the first step (burn-in) without reading
            ``state.step_counter`` from the device. Schedules still use the state's counter.

        Returns:
          ``(params, state, stats)``, or ``(params, state, func_state, stats)`` when
          ``value_func_has_state``: the updated parameters, the new state, the value function's
          new state, and the statistics dict whose keys the class docstring lists.

        Raises:
          ValueError, TypeError, RuntimeError: when both or neither of ``data_iterator`` and
            ``batch`` are given, ``init`` was not called, ``state`` is not an
            ``Optimizer.State``, ``params`` differ from those given to ``init``, a required
            ``learning_rate``/``momentum``/``damping``/``func_state`` is missing or a refused
            one is given, or the batch's leaves disagree on their leading size.
        """
        step_int, sig = self._check_step_args(params, state, rng, data_iterator, batch, func_state, learning_rate, momentum, damping, global_step_int)
        # A coefficient not given (scheduled or adaptive) is passed as None: nothing to transfer.
        lr, mom, damp = (
            None if v is None else _config.scalar_arg(v, name, self._multi_device)
            for v, name in ((learning_rate, "learning_rate"), (momentum, "momentum"), (damping, "damping"))
        )
        if self._config.num_burnin_steps > 0 and step_int == 0:
            rng, key = parallel.split_keys(rng, 2, self._multi_device)
            state, func_state = self._first_burnin(params, state, key, data_iterator, batch, func_state)
        if batch is None:
            try:
                batch = next(data_iterator)  # type: ignore[arg-type]
            except StopIteration:
                raise ValueError("`data_iterator` is exhausted: step needs one batch from it.") from None
        batch_sig = _config.call_signature(batch)
        if sig is None or batch_sig is None or batch_sig != self._checked_batch_signature:
            self._check_batch(batch)
            self._checked_batch_signature = batch_sig
        key = None if sig is None or batch_sig is None else (sig, batch_sig)
        params, state, func_state, stats, flags = self._call_step(key, params, state, rng, batch, func_state, lr, mom, damp)
        self._report(stats, flags)
        if self._has_state:
            return params, state, func_state, stats
        return params, state, stats

    def _check_step_args(
        self, params: Any, state: Any, rng: Any, data_iterator: Any, batch: Any, func_state: Any, learning_rate: Any,
        momentum: Any, damping: Any, global_step_int: int | None,
    ) -> tuple[int, Any]:
        """The host-side checks of ``step``'s arguments; returns the step number (see ``step``)
        and the arguments' signature (``_config.call_signature``; None when traced).

        The structural checks depend only on the arguments' tree structures, shapes and dtypes:
        a call whose signature equals the last checked one skips them (they are most of a small
        model's host time per step)."""
        sig = _config.call_signature(params, state, rng, func_state)
        if (sig is None or sig != self._checked_signature or (data_iterator is None) == (batch is None)
                or (self._has_state and func_state is None)):
            _config.check_step_call(
                self._params_spec, self._multi_device, self._has_state, params, state, rng, data_iterator, batch, func_state
            )
            _config.check_state_spec(self._state_spec, state, self._multi_device)
            self._checked_signature = sig
        needs_counter = self._config.num_burnin_steps > 0 and global_step_int is None
        step_int = self.verify_args_and_get_step_counter(
            (state.step_counter[0] if self._multi_device else state.step_counter) if needs_counter else 0,
            learning_rate, momentum, damping, global_step_int,
        )
        # Checked here where concrete; a traced value is flagged by the step (`invalid_coefficients`).
        for value, name in ((learning_rate, "learning_rate"), (momentum, "momentum"), (damping, "damping")):
            _config.check_concrete_coefficient(value, name, self._config.l2_reg)
        return step_int, sig

    def _first_burnin(self, params: Any, state: Any, key: jax.Array, data_iterator: Any, batch: Any, func_state: Any) -> tuple[Any, Any]:
        """The burn-in of the first step: from ``data_iterator``, or repeating ``batch`` (with a warning)."""
        num = self._config.num_burnin_steps
        if data_iterator is not None:
            return self.burnin(num, params, state, key, data_iterator, func_state)
        if not self._burnin_warned:
            warnings.warn(
                f"num_burnin_steps={num} but step() got `batch` rather than a "
                "`data_iterator`: the burn-in curvature updates run on this same batch.",
                stacklevel=3,
            )
            self._burnin_warned = True
        return self.burnin(num, params, state, key, iter([batch] * num), func_state)

    def _step_reported(self, *args: Any) -> tuple[Any, OptimizerState, Any, dict[str, Any], jax.Array]:
        """``_step_impl``'s outputs and the flags word its report reads (one device transfer)."""
        params, state, func_state, stats = self._step_impl(*args)
        return params, state, func_state, stats, _guard.flags_word(stats)

    def _step_impl(
        self, params: Any, state: OptimizerState, rng: jax.Array, batch: Any, func_state: Any, lr_arg: jax.Array,
        mom_arg: jax.Array, damp_arg: jax.Array, batch_size_override: int | None = None,
    ) -> tuple[Any, OptimizerState, Any, dict[str, Any]]:
        """The compiled step (``StepProgram.step``), counting its traces in ``trace_count``.
        A coefficient passed as None (not given to ``step``) is a zero, as ``scalar_arg`` makes it."""
        self.trace_count += 1
        lr_arg, mom_arg, damp_arg = (_config.scalar_arg(None, "") if a is None else a for a in (lr_arg, mom_arg, damp_arg))
        return self._program.step(params, state, rng, batch, func_state, lr_arg, mom_arg, damp_arg, batch_size_override)

    # --- quadratic model -----------------------------------------------------------------------

    def compute_l2_quad_matrix(self, vectors: Sequence[Any]) -> jax.Array:
        """``l2_reg * <v_i, v_j>`` for the parameter-shaped ``vectors`` ``v_i``: the L2 term's quadratic model."""
        return self._config.l2_reg * utils.matrix_of_inner_products(vectors)

    def compute_exact_quad_model(self, vectors: Sequence[Any], grads: Any, func_args: Sequence[Any] | None = None):
        """The exact quadratic model's ``(A, D, b)`` at ``func_args``.

        For the ``vectors`` ``v_i`` (parameter-shaped pytrees, e.g. the preconditioned gradient
        and the previous update): ``A_ij = v_i^T C v_j`` with the exact Fisher (GGN for
        ``ggn_*`` estimation modes) of the batch in ``func_args`` (the value function's
        argument tuple), ``D_ij = v_i^T v_j`` and ``b_i = grads^T v_i`` for the gradient
        ``grads``.
        """
        if func_args is None:
            raise ValueError("compute_exact_quad_model needs `func_args`.")
        lin = self._program.linearize(func_args, with_outputs=False)
        kind = "ggn" if self._config.estimation_mode.startswith("ggn") else "fisher"
        bs = self._program.batch_size_extractor(func_args[-1])
        return _coefficients.exact_quad_model(lin.deps_jvp, lin.losses, vectors, grads, bs, kind, self._axis)

    def compute_approx_quad_model(self, state: OptimizerState, vectors: Sequence[Any], grads: Any):
        """The quadratic model's ``(A, D, b)`` with the curvature estimate in place of the exact matrix.

        As ``compute_exact_quad_model`` (same ``vectors`` and ``grads``), with ``A_ij = v_i^T C
        v_j`` for the block-diagonal estimate held in ``state`` (undamped).
        """
        return _coefficients.approx_quad_model(self._estimator, state.estimator_state, vectors, grads)

    def _solve_coefficients(self, quad: Any, damping: Any, lr: Any, mom: Any) -> jax.Array:
        """Minimises the damped quadratic model over the adaptive coefficients (``curvax.step.coefficients.solve``)."""
        cfg = self._config
        return _coefficients.solve(quad, cfg.l2_reg, damping, lr, mom, cfg.adaptive_lr, cfg.adaptive_momentum)

    def compute_loss_value(self, func_args: Sequence[Any]) -> jax.Array:
        """The loss value of ``value_func(*func_args)``, without its state or aux outputs.

        ``func_args`` is the value function's argument tuple, ``(params, [func_state], [rng],
        batch)``.
        """
        return self._func.split_outputs(self._func.value(*func_args))[0]

    def _check_params_dtype(self, params: Any) -> None:
        utils.check_float_params(params)
