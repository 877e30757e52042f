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

from curvax import _compat, estimators, parallel, utils
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

    Every constructor argument of kfac-jax's documented API (in its positional order) and of
    kfac-jax 0.0.8 (its additions keyword-only here) is accepted. kfac-jax 0.0.8
    arguments that curvax does not implement accept their default only and raise
    ``NotImplementedError`` for anything else, rather than being ignored silently.
    ``curvature_batch_fraction`` is curvax's own.

    **The value_and_grad_func contract.** It is called as ``value_and_grad_func(params,
    [func_state], [rng], batch)`` (``func_state`` only with ``value_func_has_state``, ``rng``
    only with ``value_func_has_rng``, in that order) and returns ``(value, grads)``, the way
    ``jax.value_and_grad(loss_fn, has_aux=...)`` does:

    - ``value`` is the scalar ``loss`` when neither ``value_func_has_aux`` nor
      ``value_func_has_state``; ``(loss, aux)`` with ``value_func_has_aux`` only; ``(loss,
      new_func_state)`` with ``value_func_has_state`` only; ``(loss, (new_func_state, aux))``
      with both. ``aux`` is any pytree (returned in ``stats["aux"]``); ``new_func_state`` is
      returned by ``step`` and passed to the next one.
    - ``grads`` is the gradient of ``loss`` with respect to ``params``, with their structure.
      This gradient is the one the step uses. When ``init`` proves that curvax's own
      linearized forward pass computes the same gradient (``shares_gradient_pass``), the step
      takes it from that pass instead of calling the function again; otherwise it calls
      ``value_and_grad_func`` every step.
    - The function must register its loss: inside the computation of ``loss`` (the function
      being differentiated, or ``value_func_for_estimator`` when given), call a
      ``curvax.register_*_loss`` on the model's output (logits, predictions), e.g.
      ``register_softmax_cross_entropy_loss(logits, labels)``. Registrations made outside it
      are not seen, and ``init`` raises ``ValueError`` when none is found. ``loss`` is expected
      to be a mean over the batch's examples; a registered loss with weight ``w`` stands for
      ``w`` times the per-example loss averaged over the batch, so scale ``weight`` to match
      any other normalisation (e.g. by sequence length). Regularisers in ``loss`` are not
      registered; tell the optimizer about an L2 term through ``l2_reg``.

    The layers are found by tracing the value function (``jax.make_jaxpr``) at ``init``; it
    need not be jitted, since the optimizer compiles the whole step once.

    **Statistics.** ``step`` returns a dict of scalar arrays (``aux`` excepted; with a leading
    device axis under ``multi_device``). Values not computed on a step are nan.

    - ``step``: the step counter after this step (1 after the first step).
    - ``batch_size``: examples in this step's batch (summed over the devices under
      ``multi_device``).
    - ``data_seen``: examples processed so far, this step's included (burn-in excluded; summed
      over the devices under ``multi_device``).
    - ``loss``: the loss at the parameters before the update.
    - ``new_loss``: the loss on the same batch after the update, computed only on the steps where
      adaptive damping adapts (nan otherwise).
    - ``learning_rate``: the coefficient ``lr`` of ``-lr * preconditioned gradient`` actually
      applied (given, scheduled or adaptive; 0 when the update was skipped). ``norm_constraint``
      rescales the preconditioned gradient, not this coefficient.
    - ``momentum``: the coefficient of the previous update actually applied (0 when skipped).
    - ``damping``: the damping used in this step (before adaptive damping moves it).
    - ``rho``: the reduction ratio ``(new_loss - loss) / quad_model_change`` of adaptive damping,
      on adapting steps (nan otherwise; -100 when it is not finite).
    - ``quad_model_change``: the change of loss the quadratic model predicts for the update:
      every step with an adaptive learning rate or momentum, on adapting steps with adaptive
      damping, nan otherwise.
    - ``update_skipped``: True when the loss, the preconditioned gradient or the coefficients
      were not finite; the parameters were then left unchanged and the velocity reset to zero.
    - ``updates_skipped``: how many steps so far skipped their update (a running count kept in
      the state).
    - ``curvature_update_skipped``: True when this step's curvature statistics came out
      non-finite, or its loss did (e.g. a NaN example, or labels out of range whose statistics
      would still be finite); that statistics update was dropped and the previous statistics
      kept.
    - ``curvature_updates_skipped``: how many statistics updates were dropped so far (burn-in
      included; a running count kept in the state).
    - ``learning_rate_invalid``, ``momentum_invalid``, ``damping_invalid``: True when the
      given or scheduled value was out of range (not finite; a negative damping) where the
      host could not check it (traced, or a schedule that leaves the range after step 0); the
      update is then skipped and the log names the coefficient.
    - ``loss_diverged``: True when the loss is finite but more than ``DIVERGENCE_FACTOR`` (1e3)
      times the magnitude of the first finite loss (or of 1, if larger). A report only:
      nothing is changed.
    - ``scaled_grad_norm_sq``: only with ``norm_constraint``: ``lr**2 * g^T (C + (l2_reg +
      damping) I)^-1 g`` before the rescaling.
    - ``aux``: only with ``value_func_has_aux``: the ``aux`` output of the value function (averaged
      over devices under ``multi_device``).
    - ``param_norm``, ``grad_norm``, ``precon_grad_norm``, ``update_norm``: only with
      ``include_norms_in_stats``: Euclidean norms of the parameters before the update, the
      gradient, the preconditioned gradient and the update.
    - ``param_norm(<path>)``, ``grad_norm(<path>)``, ``precon_grad_norm(<path>)``,
      ``update_norm(<path>)``: only with ``include_per_param_norms_in_stats``: the same norms
      for each parameter leaf, ``<path>`` being its ``/``-joined pytree path (e.g.
      ``update_norm(dense/w)``).

    Skipped updates, dropped statistics and a diverging loss are also logged as warnings on the
    ``"curvax"`` logger, a few steps later at most (the step never waits for the device).

    **kfac-jax's pmap mode.** ``multi_device=True`` is kept for code written against kfac-jax
    (on several devices ``jax.sharding`` needs no special mode: see ``curvax.parallel``). Every
    array passed to ``init``/``step`` carries a leading axis of ``jax.local_device_count()``;
    the step runs under ``jax.pmap(axis_name=pmap_axis_name)``, averages the loss, gradient,
    aux, curvature statistics, exact quadratic model and the damping's new loss over that axis,
    and returns stats with the axis. ``debug`` does not apply in this mode (the step is always
    pmapped).

    Args:
      value_and_grad_func: the user's function returning ``(value, grads)``; see the contract
        above. Required.
      l2_reg: the coefficient ``c`` of an L2 term ``c/2 * sum(params**2)`` that the user's loss
        already contains (the optimizer does not add it). It is added to the curvature's
        diagonal, together with the damping, in the preconditioner and the quadratic model.
        Non-negative; required.
      value_func_has_aux: whether the function's value carries an ``aux`` output (see the
        contract). Default False.
      value_func_has_state: whether the function takes a ``func_state`` after ``params`` and
        returns the new one; ``init`` and ``step`` then need ``func_state``. Default False.
      value_func_has_rng: whether the function takes a PRNG key after ``params`` (and
        ``func_state``); the step passes it a key derived from ``step``'s ``rng``. Default False.
      use_adaptive_learning_rate: choose the learning rate every step by minimising the
        quadratic model (exact curvature, damped) along the preconditioned gradient (jointly
        with the momentum when that is adaptive too). Then ``step`` must not get
        ``learning_rate``. Suited to large or full batches. Default False: pass
        ``learning_rate`` to ``step`` or a ``learning_rate_schedule``.
      learning_rate_schedule: ``schedule(step_counter) -> learning rate``, called inside the
        compiled step with the int32 step counter (0 at the first step). Excludes
        ``use_adaptive_learning_rate`` and ``step(learning_rate=...)``. Unlike kfac-jax, it is
        not passed ``data_seen``. Default None.
      use_adaptive_momentum: choose the momentum every step from the quadratic model over the
        span of the preconditioned gradient and the previous update. Then ``step`` must not get
        ``momentum``. Default False: pass ``momentum`` to ``step`` or a ``momentum_schedule``.
      momentum_schedule: ``schedule(step_counter) -> momentum``, as ``learning_rate_schedule``.
        Default None.
      use_adaptive_damping: adapt the damping with the Levenberg-Marquardt rule every
        ``damping_adaptation_interval`` steps, from the reduction ratio ``rho`` of the loss
        change to the quadratic model's prediction (one more forward pass on those steps).
        Needs ``initial_damping``; then ``step`` must not get ``damping``. Default False: pass
        ``damping`` to ``step`` or a ``damping_schedule``.
      damping_schedule: ``schedule(step_counter) -> damping``, as ``learning_rate_schedule``.
        Default None.
      initial_damping: the damping adaptive damping starts from (required with
        ``use_adaptive_damping``, unused otherwise). A finite number >= 0; 0 only with
        ``l2_reg > 0`` (an undamped inverse is singular for most batches). Default None.
      min_damping: lower bound adaptive damping clips to. Default 1e-8.
      max_damping: upper bound adaptive damping clips to. Default infinity.
      include_damping_in_quad_change: add the damping term ``damping/2 * |delta|^2`` to the
        quadratic model's predicted change used for ``rho`` (the ``l2_reg`` term is always
        included). Default False.
      damping_adaptation_interval: adaptive damping acts on steps whose counter plus one is a
        multiple of this. Positive integer; default 5.
      damping_adaptation_decay: on an adapting step the damping is multiplied by ``decay **
        interval`` when ``rho`` exceeds the upper threshold and divided by it when ``rho`` is
        below the lower one. Default 0.9.
      damping_lower_threshold: ``rho`` below this raises the damping. Default 0.25.
      damping_upper_threshold: ``rho`` above this lowers the damping; not below the lower
        threshold. Default 0.75.
      always_use_exact_qmodel_for_damping_adjustment: with adaptive damping but a fixed or
        scheduled learning rate and momentum, compute ``rho``'s predicted change with the exact
        curvature (one more linearized product) rather than the block-diagonal estimate. With an
        adaptive learning rate or momentum the exact model is always used. Default False.
      norm_constraint: scale the update down so that ``lr**2 * g^T (C + (l2_reg + damping) I)^-1
        g`` (the squared norm of the step in the damped estimated curvature) is at most this
        value. Only with a fixed or scheduled learning rate. Default None (no constraint).
      num_burnin_steps: curvature-only steps run by the first ``step`` (step counter 0) before
        its update: each draws a batch (from ``data_iterator``, or reuses ``batch`` with a
        warning) and updates the statistics with uniform weights, without moving the parameters.
        Non-negative integer; default 10.
      estimation_mode: how the curvature statistics are estimated: ``"fisher_gradients"``
        (gradients of losses on labels sampled from the model), ``"fisher_empirical"`` (the
        observed labels; needs registered targets), ``"fisher_curvature_prop"`` and
        ``"ggn_curvature_prop"`` (random-sign factor products), ``"fisher_exact"`` and
        ``"ggn_exact"`` (every factor column: exact, cost grows with the output size), or
        ``"forward_only"`` (FOOF: Kronecker blocks keep their input factor only, no backward
        pass). ``ggn_*`` also works with non-probabilistic losses. Default
        ``"fisher_gradients"`` (kfac-jax 0.0.8's ``None`` is not accepted: name a mode).
      curvature_ema: decay of the statistics' moving average: each update keeps ``ema`` of the
        old average and adds the new batch's estimate, normalised by the accumulated weight (so
        early estimates are not biased towards zero). In [0, 1]; default 0.95.
      inverse_update_period: the blocks recompute their damped inverses (or eigenbases) every
        this many steps, starting at step 0, with the damping of that step; other steps reuse
        them. 1 computes them from the statistics every step. Positive integer; default 5.
      use_exact_inverses: invert each Kronecker block's ``A (x) G + lambda I`` exactly through
        both factors' eigendecompositions, instead of the cheaper factored (pi-adjusted)
        damping approximation. Default False.
      batch_process_func: applied to every batch before use (init, burn-in and step), inside the
        compiled functions. Default None.
      register_only_generic: give every parameter a generic (diagonal) block instead of
        detecting layers; manually registered layer tags are still honoured. Default False.
      patterns_to_skip: names of layer patterns automatic detection must not match (e.g.
        ``"dense_with_bias"``, ``"conv2d_no_bias"``, ``"scale_and_shift_both"``; see
        ``curvax.detection.known_pattern_names()``); their parameters go to another pattern or
        fall back to generic blocks. Unknown names raise ``ValueError``. Default ``()``.
      auto_register_kwargs: extra keyword arguments of the layer detection: ``graph_patterns``
        (a sequence of ``curvax.patterns.GraphPattern`` replacing the built-in patterns) or
        ``auto_register_tags`` (see ``use_automatic_registration``). Default None.
      layer_tag_to_block_ctor: maps a layer tag's name (with or without kfac-jax's ``_tag``
        suffix, e.g. ``"dense"``) or a layer variant (e.g. ``"repeated_dense"``) to the block
        class used for such layers, instead of the default one. Default None.
      multi_device: kfac-jax's pmap mode (see above). Default False.
      debug: run ``init``/``step`` without ``jax.jit`` (eagerly), to debug the value function
        with prints and breakpoints. Ignored under ``multi_device``. Default False.
      batch_size_extractor: ``f(batch) -> number of examples`` (per device under
        ``multi_device``), used for the curvature normalisation and ``stats``. Default: the
        leading size of the batch's first leaf (``utils.default_batch_size_extractor``).
      pmap_axis_name: the ``pmap`` axis name of ``multi_device``; a non-empty string. Default
        ``"kfac_axis"``.
      forbid_setting_attributes_after_finalize: after construction, setting a public attribute
        raises ``AttributeError`` (the compiled step would not see the change). False allows
        it. Default True.
      modifiable_attribute_exceptions: names of public attributes that may still be set after
        construction. Default ``()``.
      include_norms_in_stats: add the global norms ``param_norm``, ``grad_norm``,
        ``precon_grad_norm`` and ``update_norm`` to the step's stats. Default False.
      include_per_param_norms_in_stats: add the same norms for each parameter leaf
        (``grad_norm(<path>)``, ...). Default False.
      distributed_precon_apply: on several devices (``multi_device=True``, or parameters on a
        ``jax.sharding`` mesh), each device multiplies only its share of the blocks by their
        inverses and one ``all_gather`` shares the results (``curvax.distributed``). The same
        numbers as one device. Default True.
      distributed_inverses: likewise for the inverse refresh: each device decomposes its share of
        the blocks, dealt by cost (largest first onto the least-loaded device), and one
        ``all_gather`` shares them. Default True.
      curvature_update_period: update the curvature statistics only on steps whose counter is a
        multiple of this; the other steps skip the sampled backward pass and the factor products
        and precondition with the statistics they have (``curvature_ema`` then decays per
        update, not per step). Positive integer; default 1 (every step).
      curvature_batch_fraction: curvax's own: estimate the curvature on a random ``ceil(fraction
        * n)`` examples of each batch of ``n``, drawn anew every step: the statistics (burn-in
        included) and the exact quadratic model's curvature products ``v^T C w`` of the
        adaptive learning rate and momentum. The gradient, the loss and the damping's reduction
        ratio keep the whole batch. The curvature work shrinks with the fraction, at the price
        of a separate forward pass on the sub-batch. In (0, 1]; default 1.0.
      value_func_for_estimator: kfac-jax 0.0.8: a function with the value function's arguments
        and value (not its gradient), traced for the curvature instead of
        ``value_and_grad_func``, e.g. without costly regularisers; it must register the losses.
        The loss and gradient still come from ``value_and_grad_func``. Default None.
      precon_damping_mult: kfac-jax 0.0.8: the preconditioner's damping is the step's damping
        times this (the quadratic model and adaptive damping keep the damping itself). Positive;
        default 1.0.
      precon_damping_schedule: kfac-jax 0.0.8: ``schedule(step_counter) -> damping`` for the
        preconditioner only, replacing ``damping * precon_damping_mult``. Default None.
      use_automatic_registration: kfac-jax 0.0.8: False skips layer detection: only layers
        registered by hand (``curvax.register_dense`` etc.) get their blocks, every other
        parameter a generic one. Default True.
      regularized_parameters_path_exclusions: kfac-jax 0.0.8, not implemented: only ``""``.
      use_initial_damping_calibration: kfac-jax 0.0.8, not implemented: only False.
      use_step_rejection: kfac-jax 0.0.8, not implemented: only False.
      reject_damping_increase_factor: kfac-jax 0.0.8, not implemented: only 1.0.
      custom_estimator_ctor: kfac-jax 0.0.8, not implemented: only None.
      invalid_metric_value: kfac-jax 0.0.8: the value of stats not computed on a step; only nan
        is implemented.
      include_registered_loss_in_stats: kfac-jax 0.0.8, not implemented: only False.
      num_estimator_samples: kfac-jax 0.0.8, not implemented: only 1 (one sample per example).
      should_vmap_estimator_samples: kfac-jax 0.0.8, not implemented: only False.
      norm_to_scale_identity_weight_per_block: kfac-jax 0.0.8, not implemented: only None.
      precon_power: kfac-jax 0.0.8, not implemented: only -1.0 (the inverse).
      exact_quad_model_matrix_type: kfac-jax 0.0.8, not implemented: only None (the exact
        quadratic model uses the GGN for ``ggn_*`` estimation modes, the Fisher otherwise).
      inverse_update_staggered: ours. True spreads the refresh over the period: every block
        refreshes at step 0, then block ``i`` at the steps ``t`` with ``t % inverse_update_period
        == phase_i`` (``estimator.refresh_phases``, phases balanced by factor size), so no step
        pays for all inverses. Needs ``inverse_update_period > 1``. Default False (kfac-jax's
        schedule).
      shard_curvature_state: ours. With parameters on a ``jax.sharding`` mesh of several
        devices, True splits the curvature state (Kronecker factors, cached inverses and
        eigenbases) over the mesh: every matrix of at least ``curvax.parallel.SHARD_MIN_ELEMENTS``
        elements along one axis a mesh size divides (``curvax.parallel.split_spec``), so each
        device stores ~1/N of it; XLA gathers what a computation needs. The numbers are those of
        one device. False replicates it on every device. None (default): split exactly when
        some parameter is sharded (FSDP-style), replicated otherwise. No effect on one device or
        under ``multi_device``.

    Raises:
      ValueError, TypeError: for contradictory or out-of-range arguments, naming the argument
        (e.g. an adaptive learning rate together with a schedule).
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
        shard_curvature_state: bool | None = None,
    ):
        """Checks the arguments and builds the (not yet traced) curvature estimator.

        Every argument is explained in the class docstring (``help(curvax.Optimizer)``). Nothing
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
        self.distributed_precon_apply = distributed_precon_apply
        self.distributed_inverses = distributed_inverses
        self._burnin_warned = False
        self._report = _guard.Reporter()
        self.trace_count = 0  # how many times the step function was traced (compiled)
        self._estimator = _config.estimator_from_args(args, self._func.value)
        self._program = StepProgram(
            self._config, self._func, self._estimator, batch_process_func, batch_size_extractor, self._axis,
            bool(include_norms_in_stats), bool(include_per_param_norms_in_stats),
        )
        self._program.distribute = (bool(distributed_inverses), bool(distributed_precon_apply))
        if shard_curvature_state is not None and not isinstance(shard_curvature_state, bool):
            raise TypeError(f"`shard_curvature_state` must be True, False or None, got {shard_curvature_state!r}.")
        self._program.shard_curvature_state = shard_curvature_state
        self._params_spec: Any = None
        self._state_spec: Any = None
        self._compile()
        self._forbid = bool(forbid_setting_attributes_after_finalize)
        self._modifiable = frozenset(modifiable_attribute_exceptions)
        self._finalized = True

    def _compile(self) -> None:
        """Wraps init, burn-in and step in ``jax.jit`` (nothing with ``debug``) or, in the pmap
        mode, ``jax.pmap``; as in kfac-jax, the pmapped step donates the parameters, the state
        and func_state, and the burn-in its state."""
        if self._multi_device:
            pmap = lambda f, donate=(): jax.pmap(f, axis_name=self._pmap_axis_name, donate_argnums=donate)
            self._jit_step = pmap(self._step_impl, (0, 1, 4))
            self._jit_burnin = pmap(self._program.burnin, (1,))
            self._jit_init = pmap(self._program.init)
        else:
            wrap = (lambda f, **kw: f) if self._debug else jax.jit
            self._jit_step = wrap(self._step_impl)
            self._jit_burnin = wrap(self._program.burnin)
            self._jit_init = wrap(self._program.init)

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
          params: the parameters pytree that ``step`` will update: float32 or float64 leaves
            (half precision is refused: cast inside the loss function instead).
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
        """The parameter → layer → block table (available after ``init``)."""
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
        step_int = self._check_step_args(params, state, rng, data_iterator, batch, func_state, learning_rate, momentum, damping, global_step_int)
        lr, mom, damp = (
            _config.scalar_arg(v, name, self._multi_device)
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
        self._check_batch(batch)
        params, state, func_state, stats = self._jit_step(params, state, rng, batch, func_state, lr, mom, damp)
        self._report(stats)
        if self._has_state:
            return params, state, func_state, stats
        return params, state, stats

    def _check_step_args(
        self, params: Any, state: Any, rng: Any, data_iterator: Any, batch: Any, func_state: Any, learning_rate: Any,
        momentum: Any, damping: Any, global_step_int: int | None,
    ) -> int:
        """The host-side checks of ``step``'s arguments; returns the step number (see ``step``)."""
        _config.check_step_call(
            self._params_spec, self._multi_device, self._has_state, params, state, rng, data_iterator, batch, func_state
        )
        needs_counter = self._config.num_burnin_steps > 0 and global_step_int is None
        step_int = self.verify_args_and_get_step_counter(
            (state.step_counter[0] if self._multi_device else state.step_counter) if needs_counter else 0,
            learning_rate, momentum, damping, global_step_int,
        )
        # Checked here where concrete; a traced value is flagged by the step (`invalid_coefficients`).
        for value, name in ((learning_rate, "learning_rate"), (momentum, "momentum"), (damping, "damping")):
            _config.check_concrete_coefficient(value, name, self._config.l2_reg)
        _config.check_state_spec(self._state_spec, state, self._multi_device)
        return step_int

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

    def _step_impl(
        self, params: Any, state: OptimizerState, rng: jax.Array, batch: Any, func_state: Any, lr_arg: jax.Array,
        mom_arg: jax.Array, damp_arg: jax.Array, batch_size_override: int | None = None,
    ) -> tuple[Any, OptimizerState, Any, dict[str, Any]]:
        """The compiled step (``StepProgram.step``), counting its traces in ``trace_count``."""
        self.trace_count += 1
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
        lin = self._program.linearize(func_args)
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
