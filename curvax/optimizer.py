"""The K-FAC optimizer, with kfac-jax's documented interface.

One step, compiled once (periodic work is ``lax.cond`` inside it):

1. one forward pass of the user's value function through our tracer, linearized;
2. transposes of that linearization give the gradient and the gradients of the
   sampled loss w.r.t. every layer output (curvature statistics, every
   ``curvature_update_period`` steps: 1 by default, as in kfac-jax). With
   ``curvature_batch_fraction < 1`` the curvature (statistics and the exact
   quadratic model below) comes from a second linearization, on a random sub-batch;
3. every ``inverse_update_period`` steps the blocks refresh their inverses;
4. the preconditioned gradient ``Delta = (C + (l2 + damping) I)^-1 g``;
5. learning rate and momentum either given, scheduled, or chosen by minimising
   the quadratic model over ``span(Delta, velocity)`` (exact curvature products
   come from the same linearization);
6. every ``damping_adaptation_interval`` steps the Levenberg–Marquardt rule
   moves the damping by ``decay ** interval`` from the reduction ratio.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax import _compat, estimators, gradients, parallel, utils
from curvax.transforms import assemble_layer_data, zero_tangents

logger = logging.getLogger("curvax")

# A finite loss this many times larger in magnitude than the first finite loss (or than 1) is
# reported as diverging (``stats["loss_diverged"]`` and a warning in the "curvax" log).
DIVERGENCE_FACTOR = 1e3
# How many steps' reports may wait for their device results before ``step`` waits for the oldest.
_REPORT_BACKLOG = 8


# kfac-jax 0.0.8's name for the argument tuples of the value function (compatibility only):
# ``(params, batch)``, ``(params, func_state, batch)``, ``(params, rng, batch)`` or all four.
FuncArgsVariants = tuple
# kfac-jax 0.0.8's example values of `regularized_parameters_path_exclusions` (compatibility only).
HAIKU_BIASES = "b,bias"
HAIKU_BIASES_AND_NORMS = "b,bias,scale,offset"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OptimizerState:
    """Persistent optimizer state (a pytree).

    velocities: the last update ``theta_t - theta_{t-1}``; estimator_state: the
    curvature blocks; damping: current damping; data_seen: examples processed;
    step_counter: the step number; curvature_updates_skipped: statistics updates dropped
    because they were not finite; updates_skipped: parameter updates skipped because the
    loss, gradient or update was not finite; first_loss: the first finite loss (NaN before),
    the reference of the divergence check.
    """

    velocities: Any
    estimator_state: Any
    damping: jax.Array
    data_seen: jax.Array
    step_counter: jax.Array
    # Ours, with defaults so that kfac-jax's five-field construction still works.
    curvature_updates_skipped: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros([], jnp.int32))
    updates_skipped: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros([], jnp.int32))
    first_loss: jax.Array = dataclasses.field(default_factory=lambda: jnp.asarray(jnp.nan, jnp.float32))


def _as_float(x: Any, name: str) -> jax.Array:
    try:
        arr = jnp.asarray(x, dtype=jnp.float32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"`{name}` must be a scalar number, got {type(x).__name__}.") from e
    if arr.ndim != 0:
        raise ValueError(f"`{name}` must be a scalar, got shape {arr.shape}.")
    return arr


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
      non-finite (e.g. a NaN example); that statistics update was dropped and the previous
      statistics kept.
    - ``curvature_updates_skipped``: how many statistics updates were dropped so far (burn-in
      included; a running count kept in the state).
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
      distributed_precon_apply: kfac-jax compatibility, accepted and stored; it has no effect
        (XLA partitions the step). Default True.
      distributed_inverses: kfac-jax compatibility, accepted and stored; no effect. Default True.
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
    ):
        """Checks the arguments and builds the (not yet traced) curvature estimator.

        Every argument is explained in the class docstring (``help(curvax.Optimizer)``). Nothing
        is traced or compiled here: ``init`` traces the value function on its example batch.
        """
        if not callable(value_and_grad_func):
            raise TypeError(f"`value_and_grad_func` must be callable, got {type(value_and_grad_func).__name__}.")
        if multi_device and (not isinstance(pmap_axis_name, str) or not pmap_axis_name):
            raise TypeError(f"multi_device=True needs `pmap_axis_name`, a non-empty string; got {pmap_axis_name!r}.")
        if use_adaptive_learning_rate and learning_rate_schedule is not None:
            raise ValueError("Pass either use_adaptive_learning_rate=True or a learning_rate_schedule, not both.")
        if use_adaptive_momentum and momentum_schedule is not None:
            raise ValueError("Pass either use_adaptive_momentum=True or a momentum_schedule, not both.")
        if use_adaptive_damping and damping_schedule is not None:
            raise ValueError("Pass either use_adaptive_damping=True or a damping_schedule, not both.")
        if use_adaptive_damping and initial_damping is None:
            raise ValueError("use_adaptive_damping=True needs `initial_damping` (e.g. initial_damping=1.0).")
        if norm_constraint is not None and use_adaptive_learning_rate:
            raise ValueError("`norm_constraint` can only be used with a fixed or scheduled learning rate.")
        for name, v in (
            ("damping_adaptation_interval", damping_adaptation_interval),
            ("inverse_update_period", inverse_update_period),
            ("curvature_update_period", curvature_update_period),
        ):
            utils.check_int(v, name, 1)
        utils.check_number(curvature_batch_fraction, "curvature_batch_fraction", 0.0, 1.0, low_open=True, high_open=False)
        if not isinstance(num_burnin_steps, (int, np.integer)) or num_burnin_steps < 0:
            raise ValueError(f"`num_burnin_steps` must be a non-negative integer, got {num_burnin_steps!r}.")
        if not 0.0 <= float(curvature_ema) <= 1.0:
            raise ValueError(f"`curvature_ema` must lie in [0, 1], got {curvature_ema}.")
        if float(l2_reg) < 0:
            raise ValueError(f"`l2_reg` must be non-negative, got {l2_reg}.")
        if initial_damping is not None:  # negative never; zero only with l2_reg > 0 (utils.check_damping)
            utils.check_damping(initial_damping, "initial_damping", float(l2_reg))
        if use_adaptive_damping:  # adaptation multiplies the damping: it could never leave 0
            utils.check_damping(min_damping, "min_damping", float(l2_reg))
        if not float(damping_lower_threshold) <= float(damping_upper_threshold):
            raise ValueError("`damping_lower_threshold` must not exceed `damping_upper_threshold`.")
        estimators.check_estimation_mode(estimation_mode)
        auto_kwargs = dict(auto_register_kwargs or {})
        # kfac-jax 0.0.8's constructor arguments that curvax does not implement: their defaults
        # are accepted, anything else is refused rather than silently ignored.
        for name, given, default in (
            ("regularized_parameters_path_exclusions", regularized_parameters_path_exclusions, ""),
            ("use_initial_damping_calibration", use_initial_damping_calibration, False),
            ("use_step_rejection", use_step_rejection, False),
            ("reject_damping_increase_factor", reject_damping_increase_factor, 1.0),
            ("custom_estimator_ctor", custom_estimator_ctor, None),
            ("include_registered_loss_in_stats", include_registered_loss_in_stats, False),
            ("num_estimator_samples", num_estimator_samples, 1),
            ("should_vmap_estimator_samples", should_vmap_estimator_samples, False),
            ("norm_to_scale_identity_weight_per_block", norm_to_scale_identity_weight_per_block, None),
            ("precon_power", precon_power, -1.0),
            ("exact_quad_model_matrix_type", exact_quad_model_matrix_type, None),
        ):
            if not (given is default or (default is not None and given == default)):
                raise NotImplementedError(
                    f"`{name}`={given!r} (a kfac-jax 0.0.8 argument) is not implemented by curvax; only its "
                    f"default {default!r} is accepted."
                )
        if not (isinstance(invalid_metric_value, float) and math.isnan(invalid_metric_value)):
            raise NotImplementedError("`invalid_metric_value` other than nan (kfac-jax 0.0.8) is not implemented by curvax.")
        if value_func_for_estimator is not None and not callable(value_func_for_estimator):
            raise TypeError(f"`value_func_for_estimator` must be callable, got {type(value_func_for_estimator).__name__}.")
        if precon_damping_schedule is not None and not callable(precon_damping_schedule):
            raise TypeError(f"`precon_damping_schedule` must be callable, got {type(precon_damping_schedule).__name__}.")
        utils.check_number(precon_damping_mult, "precon_damping_mult", 0.0, math.inf, low_open=True)
        if not use_automatic_registration:
            auto_kwargs.setdefault("auto_register_tags", False)
        self._precon_damping_mult = float(precon_damping_mult)
        self._precon_damping_schedule = precon_damping_schedule
        self._value_func_for_estimator = value_func_for_estimator

        self._value_and_grad_func = value_and_grad_func
        self._l2_reg = float(l2_reg)
        self._has_aux = bool(value_func_has_aux)
        self._has_state = bool(value_func_has_state)
        self._has_rng = bool(value_func_has_rng)
        self._adaptive_lr = bool(use_adaptive_learning_rate)
        self._lr_schedule = learning_rate_schedule
        self._adaptive_momentum = bool(use_adaptive_momentum)
        self._momentum_schedule = momentum_schedule
        self._adaptive_damping = bool(use_adaptive_damping)
        self._damping_schedule = damping_schedule
        self._initial_damping = initial_damping
        self._min_damping = float(min_damping)
        self._max_damping = float(max_damping)
        self._include_damping_in_quad_change = bool(include_damping_in_quad_change)
        self._damping_interval = int(damping_adaptation_interval)
        self._damping_decay = float(damping_adaptation_decay)
        self._lower = float(damping_lower_threshold)
        self._upper = float(damping_upper_threshold)
        self._always_exact_qmodel = bool(always_use_exact_qmodel_for_damping_adjustment)
        self._norm_constraint = norm_constraint
        self._num_burnin_steps = int(num_burnin_steps)
        self._estimation_mode = estimation_mode
        self._curvature_ema = float(curvature_ema)
        self._inverse_update_period = int(inverse_update_period)
        if not isinstance(inverse_update_staggered, (bool, np.bool_)):
            raise TypeError(f"`inverse_update_staggered` must be a bool, got {inverse_update_staggered!r}.")
        if inverse_update_staggered and self._inverse_update_period == 1:
            raise ValueError(
                "`inverse_update_staggered=True` needs `inverse_update_period` > 1 (with 1 every step "
                "computes every inverse: there is nothing to stagger)."
            )
        self._inverse_update_staggered = bool(inverse_update_staggered)
        self._curvature_update_period = int(curvature_update_period)
        self._curvature_batch_fraction = float(curvature_batch_fraction)
        self._use_exact_inverses = bool(use_exact_inverses)
        self._batch_process_func = batch_process_func
        self._debug = bool(debug)
        self._batch_size_extractor = batch_size_extractor
        self._pmap_axis_name = pmap_axis_name
        self._include_norms = bool(include_norms_in_stats)
        self._include_per_param_norms = bool(include_per_param_norms_in_stats)
        self.distributed_precon_apply = distributed_precon_apply
        self.distributed_inverses = distributed_inverses
        self._burnin_warned = False
        self._pending_reports: collections.deque = collections.deque()  # see `_report`
        self.trace_count = 0  # how many times the step function was traced (compiled)

        self._estimator = estimators.BlockDiagonalCurvature(
            value_func_for_estimator if value_func_for_estimator is not None else self._value_func,
            params_index=0,
            default_estimation_mode=estimation_mode,
            layer_tag_to_block_ctor=layer_tag_to_block_ctor,
            register_only_generic=register_only_generic,
            patterns_to_skip=tuple(patterns_to_skip),
            **auto_kwargs,
        )
        self._params_spec: Any = None
        self._state_shardings: OptimizerState | None = None
        # kfac-jax's pmap mode: every input has a leading device axis and every batch quantity is
        # averaged over it (`self._axis`, None otherwise). As in kfac-jax, the step donates the
        # parameters, the state and func_state, and the burn-in its state.
        self._multi_device = bool(multi_device)
        self._axis: str | None = pmap_axis_name if self._multi_device else None
        if self._multi_device:
            pmap = lambda f, donate=(): jax.pmap(f, axis_name=pmap_axis_name, donate_argnums=donate)
            self._jit_step = pmap(self._step_impl, (0, 1, 4))
            self._jit_burnin = pmap(self._burnin_impl, (1,))
            self._jit_init = pmap(self._init_impl)
        else:
            wrap = (lambda f, **kw: f) if self._debug else jax.jit
            self._jit_step = wrap(self._step_impl)
            self._jit_burnin = wrap(self._burnin_impl)
            self._jit_init = wrap(self._init_impl)
        self._forbid = bool(forbid_setting_attributes_after_finalize)
        self._modifiable = frozenset(modifiable_attribute_exceptions)
        self._finalized = True

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
        return self._num_burnin_steps

    @property
    def l2_reg(self) -> jax.Array:
        """The L2 regularisation coefficient, as an array."""
        return jnp.asarray(self._l2_reg)

    @property
    def estimator(self) -> estimators.BlockDiagonalCurvature:
        """The block-diagonal curvature estimator used as preconditioner."""
        return self._estimator

    @property
    def damping_decay_factor(self) -> float:
        """Factor applied to the damping per adaptive-damping update: ``decay ** interval``."""
        return self._damping_decay**self._damping_interval

    def should_update_damping(self, state: OptimizerState) -> jax.Array:
        """Whether this step adapts the damping: adaptive damping is on and the next step counter is a multiple of the interval.

        ``state`` is the ``Optimizer.State`` the step starts from; the answer is a boolean array.
        """
        return self._adaptive_damping & ((state.step_counter + 1) % self._damping_interval == 0)

    # --- the user function ---------------------------------------------------------------------

    def _value_func(self, *args: Any) -> Any:
        return self._value_and_grad_func(*args)[0]

    def _make_func_args(self, params: Any, func_state: Any, rng: Any, batch: Any) -> tuple:
        args = [params]
        if self._has_state:
            args.append(func_state)
        if self._has_rng:
            args.append(rng)
        args.append(batch)
        return tuple(args)

    def _split_outputs(self, out: Any) -> tuple[Any, Any, Any]:
        """``(loss, func_state, aux)`` from the value function's output."""
        if not self._has_state and not self._has_aux:
            return out, None, None
        loss, rest = out
        if self._has_state and self._has_aux:
            return loss, rest[0], rest[1]
        if self._has_state:
            return loss, rest, None
        return loss, None, rest

    def _check_value_and_grad_output(self, func_args: Sequence[Any]) -> Any:
        """Checks the user function's outputs against the ``value_func_has_*`` flags; returns its
        jaxpr (for the gradient proof, so that the function is traced once)."""
        try:
            jaxpr, out = jax.make_jaxpr(self._value_and_grad_func, return_shape=True)(*func_args)
        except TypeError as e:
            raise TypeError(
                f"Calling value_and_grad_func{self._signature()} failed: {e}. Check the "
                "value_func_has_state/value_func_has_rng flags against your function's arguments."
            ) from e
        flags = f"(value_func_has_aux={self._has_aux}, value_func_has_state={self._has_state})"
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(f"value_and_grad_func must return (value, grads); got {type(out).__name__}.")
        value, grads = out
        if jax.tree_util.tree_structure(grads) != jax.tree_util.tree_structure(func_args[0]):
            raise ValueError("The gradients returned by value_and_grad_func do not have the structure of the parameters.")
        expect = "loss" if not (self._has_aux or self._has_state) else "(loss, " + (
            "(func_state, aux)" if self._has_aux and self._has_state else "func_state" if self._has_state else "aux"
        ) + ")"
        try:
            if self._has_aux or self._has_state:
                if not isinstance(value, (tuple, list)) or len(value) != 2:
                    raise ValueError
                if self._has_aux and self._has_state and (not isinstance(value[1], (tuple, list)) or len(value[1]) != 2):
                    raise ValueError
                loss = value[0]
            else:
                loss = value
            if not hasattr(loss, "shape") or loss.shape != ():
                raise ValueError
        except ValueError:
            raise ValueError(
                f"value_and_grad_func's value must be {expect} with a scalar loss {flags}; got {_describe(value)}."
            ) from None
        return jaxpr

    def _signature(self) -> str:
        parts = ["params"] + (["func_state"] if self._has_state else []) + (["rng"] if self._has_rng else []) + ["batch"]
        return "(" + ", ".join(parts) + ")"

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
            self._state_shardings = None  # pmap places the state itself
            return self._jit_init(params, rng, batch, func_state)
        self._prepare(params, rng, batch, func_state)
        return self._jit_init(params, rng, batch, func_state)

    def _prepare(self, params: Any, rng: jax.Array, batch: Any, func_state: Any) -> None:
        """The host-side part of ``init``: checks the arguments, traces the loss, builds the blocks."""
        self._check_params_dtype(params)
        utils.check_batch_leading_sizes(batch)
        if self._has_state and func_state is None:
            raise ValueError("value_func_has_state=True: pass `func_state` to init.")
        if self._batch_process_func is not None:
            batch = self._batch_process_func(batch)
        func_args = self._make_func_args(params, func_state, rng, batch)
        user_jaxpr = self._check_value_and_grad_output(func_args)
        self._estimator.finalize(func_args)
        pj = self._estimator.processed_jaxpr
        self._gradient_proof = gradients.prove_shared_gradient(
            self._value_and_grad_func, self._has_aux or self._has_state, func_args, pj.program,
            range(pj.params_offset, pj.params_offset + pj.num_params), user_jaxpr,
        )
        logger.info(
            "Gradient: %s (%s).",
            "from curvax's shared forward pass" if self._gradient_proof.shared else "from value_and_grad_func",
            self._gradient_proof.reason,
        )
        self._params_spec = utils.tree_spec(params)
        names = [type(b).__name__ for b in self._estimator.blocks]
        table = self._estimator.processed_jaxpr.registration_table(params, names)
        has_generic = any(s.pattern == "generic" for s in self._estimator.processed_jaxpr.layer_sites)
        logger.log(logging.WARNING if has_generic else logging.INFO, "\n%s", table)
        self._registration_table = table
        self._state_shardings = self._state_shardings_for(params)

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

    def _cache_powers(self) -> tuple[Any, Any]:
        if self._inverse_update_period == 1:
            return None, None
        return (-1, None) if self._use_exact_inverses else (None, -1)

    def _state_shardings_for(self, params: Any) -> OptimizerState | None:
        """Where the state lives when ``params`` span a mesh of several devices (else None).

        Velocities take the parameters' shardings; everything else is replicated on their mesh
        (see ``curvax.parallel``).
        """
        mesh = parallel.params_mesh(params)
        if mesh is None:
            return None
        rep = parallel.replicated(mesh)
        velocities = jax.tree_util.tree_map(lambda x: x.sharding, params)
        return OptimizerState(
            velocities=velocities, estimator_state=rep, damping=rep, data_seen=rep, step_counter=rep,
            curvature_updates_skipped=rep, updates_skipped=rep, first_loss=rep,
        )

    def _init_impl(self, params: Any, rng: jax.Array, batch: Any, func_state: Any) -> OptimizerState:
        if self._batch_process_func is not None:
            batch = self._batch_process_func(batch)
        func_args = self._make_func_args(params, func_state, rng, batch)
        exact, approx = self._cache_powers()
        est_state = self._estimator.init(rng, func_args, exact, approx, False)
        damping = jnp.asarray(self._initial_damping if self._initial_damping is not None else 0.0, jnp.float32)
        state = OptimizerState(
            velocities=utils.tree_zeros_like(params),
            estimator_state=est_state,
            damping=damping,
            data_seen=jnp.zeros([], jnp.int32),
            step_counter=jnp.zeros([], jnp.int32),
            curvature_updates_skipped=jnp.zeros([], jnp.int32),
            updates_skipped=jnp.zeros([], jnp.int32),
            first_loss=jnp.asarray(jnp.nan, jnp.float32),
        )
        return parallel.constrain(state, self._state_shardings)

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
        for _ in range(num_steps):
            rng, key = parallel.split_keys(rng, 2, self._multi_device)
            batch = next(data_iterator)
            self._check_batch(batch)
            state = self._jit_burnin(params, state, key, batch, func_state)
        return state, func_state

    def _burnin_impl(self, params: Any, state: OptimizerState, rng: jax.Array, batch: Any, func_state: Any) -> OptimizerState:
        if self._batch_process_func is not None:
            batch = self._batch_process_func(batch)
        k1, k2 = jax.random.split(rng)
        sub_batch = self._curvature_batch(k1, batch)
        func_args = self._make_func_args(params, func_state, k2, sub_batch)
        if sub_batch is not batch:
            self._trace(func_args, sub_batch=True)
        batch = sub_batch
        est = self._estimator.update_curvature_matrix_estimate(
            state.estimator_state, 1.0, 1.0, self._batch_size_extractor(batch), k1, func_args,
            pmap_axis_name=self._axis, estimation_mode=self._estimation_mode,
        )
        est = self._estimator.sync(est, self._axis)  # multi_device: average each device's statistics
        # A non-finite batch must not poison the statistics: drop its update (counted in the state).
        est, skipped = estimators.keep_finite_statistics(state.estimator_state, est, self._axis)
        state = dataclasses.replace(
            state, estimator_state=est, curvature_updates_skipped=state.curvature_updates_skipped + skipped
        )
        return parallel.constrain(state, self._state_shardings)

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
        for name, given, adaptive, schedule in (
            ("learning_rate", learning_rate, self._adaptive_lr, self._lr_schedule),
            ("momentum", momentum, self._adaptive_momentum, self._momentum_schedule),
            ("damping", damping, self._adaptive_damping, self._damping_schedule),
        ):
            if adaptive and given is not None:
                raise ValueError(f"`{name}` was passed to step, but use_adaptive_{name}=True chooses it; remove it.")
            if schedule is not None and given is not None:
                raise ValueError(f"`{name}` was passed to step, but a {name}_schedule was given to the constructor.")
            if not adaptive and schedule is None and given is None:
                raise ValueError(
                    f"step needs `{name}=`: the optimizer has neither use_adaptive_{name}=True nor a {name}_schedule."
                )
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
        if (data_iterator is None) == (batch is None):
            raise ValueError("Pass exactly one of `data_iterator` and `batch` to step.")
        if self._params_spec is None:
            raise RuntimeError("Call `optimizer.init(params, rng, batch)` before `step`.")
        if not isinstance(state, OptimizerState):
            raise TypeError(f"`state` must be the Optimizer.State returned by init/step, got {type(state).__name__}.")
        utils.check_rng(rng)
        n = jax.local_device_count()
        if self._multi_device:
            parallel.check_device_axis({"params": params, "state": state, "rng": rng, "func_state": func_state}, n)
        spec = utils.tree_spec(parallel.local_shapes(params) if self._multi_device else params)
        if spec != self._params_spec:
            raise ValueError(
                "`params` differ in structure, shapes or dtypes from those passed to init:\n"
                f"init: {self._params_spec}\nstep: {spec}"
            )
        if self._has_state and func_state is None:
            raise ValueError("value_func_has_state=True: pass `func_state` to step.")
        needs_counter = self._num_burnin_steps > 0 and global_step_int is None
        step_int = self.verify_args_and_get_step_counter(
            (state.step_counter[0] if self._multi_device else state.step_counter) if needs_counter else 0,
            learning_rate, momentum, damping, global_step_int,
        )
        if damping is not None:  # checked here where concrete (a traced value passes unchecked)
            utils.check_damping(damping, "damping", self._l2_reg)
        if self._multi_device:  # pmap maps every argument: one value per device
            lr, mom, damp = (
                parallel.device_scalar(0.0 if v is None else v, n, name)
                for v, name in ((learning_rate, "learning_rate"), (momentum, "momentum"), (damping, "damping"))
            )
        else:
            lr = _as_float(0.0 if learning_rate is None else learning_rate, "learning_rate")
            mom = _as_float(0.0 if momentum is None else momentum, "momentum")
            damp = _as_float(0.0 if damping is None else damping, "damping")
        if self._num_burnin_steps > 0 and step_int == 0:
            rng, key = parallel.split_keys(rng, 2, self._multi_device)
            if data_iterator is not None:
                state, func_state = self.burnin(self._num_burnin_steps, params, state, key, data_iterator, func_state)
            else:
                if not self._burnin_warned:
                    warnings.warn(
                        f"num_burnin_steps={self._num_burnin_steps} but step() got `batch` rather than a "
                        "`data_iterator`: the burn-in curvature updates run on this same batch.",
                        stacklevel=2,
                    )
                    self._burnin_warned = True
                state, func_state = self.burnin(
                    self._num_burnin_steps, params, state, key, iter([batch] * self._num_burnin_steps), func_state
                )
        if batch is None:
            batch = next(data_iterator)  # type: ignore[arg-type]
        self._check_batch(batch)
        params, state, func_state, stats = self._jit_step(params, state, rng, batch, func_state, lr, mom, damp)
        self._report(stats)
        if self._has_state:
            return params, state, func_state, stats
        return params, state, stats

    def _report(self, stats: Mapping[str, Any]) -> None:
        """Logs a warning for each step whose update or statistics were skipped, or whose loss diverged.

        The flags are read only once they are computed (``jax.Array.is_ready``), so reporting never
        waits for the device: a step's line appears at a later call of ``step`` (at most
        ``_REPORT_BACKLOG`` steps later, when the oldest is waited for).
        """
        keys = ("step", "loss", "update_skipped", "curvature_update_skipped", "loss_diverged")
        entry = tuple(stats[k] for k in keys)
        if any(isinstance(a, jax.core.Tracer) for a in entry):
            return  # ``step`` traced inside the user's own jit: there is nothing to read on the host
        self._pending_reports.append(entry)
        while self._pending_reports:
            entry = self._pending_reports[0]
            if len(self._pending_reports) <= _REPORT_BACKLOG and not all(
                not hasattr(a, "is_ready") or a.is_ready() for a in entry
            ):
                break
            self._pending_reports.popleft()
            step, loss, skipped, curv_skipped, diverged = (np.asarray(a).reshape(-1)[0] for a in entry)
            what = [
                text for flag, text in (
                    (skipped, "update skipped (non-finite loss, gradient or update; parameters unchanged)"),
                    (curv_skipped, "curvature statistics update skipped (non-finite; previous statistics kept)"),
                    (diverged, f"loss diverging (more than {DIVERGENCE_FACTOR:g}x the first loss)"),
                ) if flag
            ]
            if what:
                logger.warning("curvax step %d (loss %s): %s.", int(step), float(loss), "; ".join(what))

    def _linearized(self, func_args: Sequence[Any]) -> tuple:
        """The value function at ``func_args``, linearized in (parameters, layer-output perturbations).

        Returns ``((loss, deps), f_vjp, outs, losses, data_for, deps_jvp)``: ``f_vjp`` is the
        transposed linearization, ``outs`` the function's flat outputs, ``losses`` the registered
        losses, ``data_for(cotangents)`` the per-layer estimation data for cotangents of the loss
        inputs, and ``deps_jvp(v)`` the loss inputs' tangents along a parameter vector ``v``.
        """
        pj = self._estimator.processed_jaxpr_for(func_args)
        p, o = pj.split_args(func_args)
        eps = pj.zero_perturbations(p, o)

        def fwd(q, e):
            (deps, outs), aux = pj.evaluate(q, o, e, with_outputs=True)
            return (outs[0], deps), (aux, outs)

        (loss, deps), f_jvp, ((ops, layer_data), outs) = jax.linearize(fwd, p, eps, has_aux=True)
        f_vjp = jax.linear_transpose(f_jvp, p, eps)

        def data_for(cot):
            dp, de = zero_tangents(p, eps) if cot is None else f_vjp((jnp.zeros_like(loss), cot))
            return assemble_layer_data(pj, p, layer_data, dp, de)

        def deps_jvp(v):
            return f_jvp(jax.tree_util.tree_leaves(v), jax.tree_util.tree_map(jnp.zeros_like, eps))[1]

        return (loss, deps), f_vjp, outs, pj.losses_from_operands(ops), data_for, deps_jvp

    def _curvature_batch(self, key: jax.Array, batch: Any) -> Any:
        """The examples the curvature is estimated on: all of ``batch``, or a random fraction of it."""
        if self._curvature_batch_fraction >= 1.0:
            return batch
        return utils.subsample_batch(batch, self._curvature_batch_fraction, jax.random.fold_in(key, 1))

    def _trace(self, func_args: Sequence[Any], sub_batch: bool = False) -> Any:
        """The traced function at the shapes of ``func_args``, with an error that says why it failed.

        ``init`` traced it once, so a failure here is a new batch shape: another batch, or the
        sub-batches of ``curvature_batch_fraction`` (``sub_batch``).
        """
        try:
            return self._estimator.processed_jaxpr_for(func_args)
        except Exception as e:
            shapes = [np.shape(x) for x in jax.tree_util.tree_leaves(func_args[-1])]
            why = (
                f"curvature_batch_fraction={self._curvature_batch_fraction:g}: the curvature is estimated on "
                f"sub-batches of {self._batch_size_extractor(func_args[-1])} examples. " if sub_batch else ""
            )
            raise ValueError(
                f"{why}Tracing the loss on a batch with leaf shapes {shapes} failed ({type(e).__name__}: {e}); "
                "init traced it on other shapes. Does the model assume a fixed batch size (e.g. reshape(16, -1))? "
                "Use reshape(x.shape[0], -1)" + (", or curvature_batch_fraction=1." if sub_batch else ".")
            ) from e

    def _schedule_value(self, schedule: Callable | None, given: jax.Array, step: jax.Array) -> jax.Array:
        return jnp.asarray(schedule(step), jnp.float32) if schedule is not None else given

    def _step_impl(self, params, state, rng, batch, func_state, lr_arg, mom_arg, damp_arg):
        self.trace_count += 1
        est = self._estimator
        step = state.step_counter
        if self._batch_process_func is not None:
            batch = self._batch_process_func(batch)
        batch_size = self._batch_size_extractor(batch)
        k_est, k_func = jax.random.split(rng)
        func_args = self._make_func_args(params, func_state, k_func, batch)
        pj = self._trace(func_args)

        damping = state.damping if self._adaptive_damping else self._schedule_value(self._damping_schedule, damp_arg, step)
        # The preconditioner's damping (kfac-jax 0.0.8): its own schedule, or the damping times
        # `precon_damping_mult` (1 by default: the damping itself).
        if self._precon_damping_schedule is not None:
            precon_damping = jnp.asarray(self._precon_damping_schedule(step), jnp.float32)
        else:
            precon_damping = damping * self._precon_damping_mult
        identity_weight = self._l2_reg + precon_damping

        # 1-2. One linearized forward pass: the curvature statistics and, where provably the same
        # (see curvax.gradients), the loss and the gradient; otherwise those come from the user.
        (loss, deps), f_vjp, outs, losses, data_for, deps_jvp = self._linearized(func_args)
        if self.shares_gradient_pass:
            zero_deps = jax.tree_util.tree_map(jnp.zeros_like, deps)
            grads_flat, _ = f_vjp((jnp.ones_like(loss), zero_deps))
            grads = jax.tree_util.tree_unflatten(pj.params_tree, grads_flat)
            value = jax.tree_util.tree_unflatten(pj.out_tree, list(outs))
        else:
            value, grads = self._value_and_grad_func(*func_args)
            loss = self._split_outputs(value)[0]
        _, new_func_state, aux = self._split_outputs(value)
        if self._axis is not None:  # multi_device: each device saw its share of the batch
            loss, grads = jax.lax.pmean((loss, grads), self._axis)
        adaptive = self._adaptive_lr or self._adaptive_momentum

        # The curvature's view of the batch: the same linearization, or one of a sub-batch.
        curvature_batch = self._curvature_batch(k_est, batch)
        if curvature_batch is batch:
            curvature_view = lambda: (losses, data_for, deps_jvp, batch_size)
        else:
            curvature_args = self._make_func_args(params, func_state, k_func, curvature_batch)
            self._trace(curvature_args, sub_batch=True)

            def curvature_view():
                _, _, _, c_losses, c_data_for, c_deps_jvp = self._linearized(curvature_args)
                return c_losses, c_data_for, c_deps_jvp, self._batch_size_extractor(curvature_batch)

            if self._curvature_update_period == 1 or adaptive:
                # Needed on every step: linearize the sub-batch once, outside the conditionals.
                view = curvature_view()
                curvature_view = lambda: view

        def update_statistics(s):
            c_losses, c_data_for, _, c_size = curvature_view()
            new = est._update_from_cotangents(
                s, c_losses, c_data_for, k_est, self._estimation_mode, self._curvature_ema, 1.0, c_size, self._axis
            )
            new = est.sync(new, self._axis)  # multi_device: average each device's statistics
            # Statistics never absorb non-finite values: a bad batch's update is dropped whole
            # (one scalar decides, the same on every device).
            return estimators.keep_finite_statistics(s, new, self._axis)

        if self._curvature_update_period == 1:
            est_state, curvature_skipped = update_statistics(state.estimator_state)
        else:
            # Off-period steps skip the sampled backward pass and the factor products entirely
            # (a conditional runs only its taken branch); the forward pass is shared.
            est_state, curvature_skipped = jax.lax.cond(
                step % self._curvature_update_period == 0, update_statistics,
                lambda s: (s, jnp.asarray(False)), state.estimator_state,
            )

        # 3. Periodic inverse refresh.
        exact, approx = self._cache_powers()
        use_cached = self._inverse_update_period != 1
        if use_cached and self._inverse_update_staggered:
            # Each block on its own phase of the period (one compiled step serves every phase).
            est_state = est.update_cache_staggered(
                est_state, step, self._inverse_update_period, identity_weight, exact, approx, False
            )
        elif use_cached:
            est_state = jax.lax.cond(
                step % self._inverse_update_period == 0,
                lambda s: est.update_cache(s, identity_weight, exact, approx, False),
                lambda s: s,
                est_state,
            )
        else:
            # Powers are computed from the statistics directly; blocks that keep other derived
            # state in their cache (EKFAC's eigenbasis) still refresh it every step.
            est_state = est.update_cache(est_state, identity_weight, None, None, False)

        # 4. Preconditioned gradient.
        precon = est.multiply_matpower(est_state, grads, identity_weight, -1, self._use_exact_inverses, use_cached)
        # Blocks may hold statistics in a wider dtype than the parameters: come back to the parameters' dtypes.
        precon = jax.tree_util.tree_map(lambda v, p: v.astype(jnp.result_type(p)), precon, params)

        # 5. Coefficients.
        lr = self._schedule_value(self._lr_schedule, lr_arg, step)
        mom = self._schedule_value(self._momentum_schedule, mom_arg, step)
        scaled_sq = None
        if self._norm_constraint is not None:
            scaled_sq = lr**2 * utils.inner_product(precon, grads)
            factor = jnp.minimum(1.0, jnp.sqrt(self._norm_constraint / jnp.maximum(scaled_sq, 1e-30)))
            precon = utils.scalar_mul(precon, factor)
        vectors = (precon, state.velocities)
        update_damping = self.should_update_damping(state)

        def exact_quad_model():
            c_losses, _, c_deps_jvp, c_size = curvature_view()
            return self._exact_quad_model_from(c_deps_jvp, c_losses, vectors, grads, c_size)

        if adaptive:
            quad = exact_quad_model()
            coeffs = self._solve_coefficients(quad, damping, lr, mom)
        else:
            coeffs = jnp.stack([-lr, mom])

        def quad_change_of(quad):
            a, d, b = quad
            a_hat = a + self._l2_reg * d + (damping * d if self._include_damping_in_quad_change else 0.0)
            return 0.5 * coeffs @ a_hat @ coeffs + coeffs @ b

        if adaptive:
            quad_change = quad_change_of(quad)
        else:
            quad_change = jnp.asarray(jnp.nan, jnp.float32)
        if not adaptive and self._adaptive_damping:
            if self._always_exact_qmodel:
                model = exact_quad_model
            else:
                model = lambda: self.compute_approx_quad_model(
                    dataclasses.replace(state, estimator_state=est_state), vectors, grads
                )
            quad_change = jax.lax.cond(
                update_damping, lambda: quad_change_of(model()), lambda: jnp.asarray(jnp.nan, jnp.float32)
            )

        # A non-finite preconditioned gradient (singular curvature with zero damping) must
        # not reach the parameters: skip the update instead. One scalar decides.
        # The same rule covers a non-finite loss (a NaN example, out-of-range labels) whose
        # gradient may still be finite: an update is applied only if the loss is finite too.
        finite = (
            jnp.isfinite(utils.inner_product(precon, grads)) & jnp.all(jnp.isfinite(coeffs)) & jnp.isfinite(loss)
        )
        coeffs = jnp.where(finite, coeffs, 0.0)
        # The coefficients may be wider than the parameters (float32 weights, float64 data): keep each leaf's dtype.
        delta = jax.tree_util.tree_map(
            lambda a, b: jnp.where(finite, coeffs[0] * a + coeffs[1] * b, 0.0).astype(jnp.result_type(a)),
            precon, state.velocities,
        )
        new_params = utils.tree_add(params, delta)
        if self._state_shardings is not None:  # several devices: the parameters keep their shardings
            new_params = parallel.constrain(new_params, self._state_shardings.velocities)

        # 6. Damping.
        new_loss = jnp.asarray(jnp.nan, jnp.float32)
        rho = jnp.asarray(jnp.nan, jnp.float32)
        new_damping = damping
        if self._adaptive_damping:
            def adapt():
                args = self._make_func_args(new_params, func_state, k_func, batch)
                nl = self._split_outputs(self._value_func(*args))[0]
                if self._axis is not None:
                    nl = jax.lax.pmean(nl, self._axis)
                r = (nl - loss) / quad_change
                r = jnp.where(jnp.isfinite(r), r, -100.0)
                factor = self.damping_decay_factor
                d = jnp.where(r < self._lower, damping / factor, jnp.where(r > self._upper, damping * factor, damping))
                d = jnp.clip(d, self._min_damping, self._max_damping)
                return nl.astype(jnp.float32), r.astype(jnp.float32), d.astype(jnp.float32)

            new_loss, rho, new_damping = jax.lax.cond(
                update_damping, adapt, lambda: (new_loss, rho, jnp.asarray(damping, jnp.float32))
            )

        # Divergence check (a report only, nothing is changed): the loss is finite but more than
        # DIVERGENCE_FACTOR times the first finite loss's magnitude (at least 1).
        loss32 = jnp.asarray(loss, jnp.float32)
        first_loss = jnp.where(jnp.isnan(state.first_loss) & jnp.isfinite(loss32), loss32, state.first_loss)
        diverged = jnp.isfinite(loss32) & (
            jnp.abs(loss32) > DIVERGENCE_FACTOR * jnp.maximum(jnp.abs(jnp.nan_to_num(first_loss)), 1.0)
        )

        # multi_device: the batch of the step is every device's share.
        total_batch_size = batch_size if self._axis is None else batch_size * jax.lax.psum(1, self._axis)
        new_state = OptimizerState(
            velocities=delta,
            estimator_state=est_state,
            damping=jnp.asarray(new_damping, jnp.float32),
            data_seen=state.data_seen + total_batch_size,
            step_counter=step + 1,
            curvature_updates_skipped=state.curvature_updates_skipped + curvature_skipped,
            updates_skipped=state.updates_skipped + jnp.logical_not(finite),
            first_loss=first_loss,
        )
        new_state = parallel.constrain(new_state, self._state_shardings)
        stats = {
            "step": step + 1,
            "batch_size": jnp.asarray(total_batch_size, jnp.int32),
            "data_seen": new_state.data_seen,
            "loss": loss,
            "new_loss": new_loss,
            "learning_rate": -coeffs[0],
            "momentum": coeffs[1],
            "damping": jnp.asarray(damping, jnp.float32),
            "rho": rho,
            "quad_model_change": quad_change,
            "update_skipped": jnp.logical_not(finite),  # loss, gradient or update not finite: params unchanged
            "updates_skipped": new_state.updates_skipped,  # running count of skipped updates
            "curvature_update_skipped": curvature_skipped,  # this step's statistics not finite: old ones kept
            "curvature_updates_skipped": new_state.curvature_updates_skipped,  # running count (burn-in included)
            "loss_diverged": diverged,  # finite loss > DIVERGENCE_FACTOR * max(|first finite loss|, 1)
        }
        if scaled_sq is not None:
            stats["scaled_grad_norm_sq"] = scaled_sq
        if aux is not None:
            stats["aux"] = aux if self._axis is None else jax.lax.pmean(aux, self._axis)
        if self._include_norms:
            stats["param_norm"] = utils.norm(params)
            stats["grad_norm"] = utils.norm(grads)
            stats["precon_grad_norm"] = utils.norm(precon)
            stats["update_norm"] = utils.norm(delta)
        if self._include_per_param_norms:
            for path, g, pg, u, w in zip(
                utils.param_paths(params), jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(precon),
                jax.tree_util.tree_leaves(delta), jax.tree_util.tree_leaves(params),
            ):
                stats[f"param_norm({path})"] = jnp.linalg.norm(w)
                stats[f"grad_norm({path})"] = jnp.linalg.norm(g)
                stats[f"precon_grad_norm({path})"] = jnp.linalg.norm(pg)
                stats[f"update_norm({path})"] = jnp.linalg.norm(u)
        return new_params, new_state, new_func_state if self._has_state else func_state, stats

    # --- quadratic model -----------------------------------------------------------------------

    def compute_l2_quad_matrix(self, vectors: Sequence[Any]) -> jax.Array:
        """``l2_reg * <v_i, v_j>`` for the parameter-shaped ``vectors`` ``v_i``: the L2 term's quadratic model."""
        return self._l2_reg * utils.matrix_of_inner_products(vectors)

    def _exact_quad_model_from(self, deps_jvp, losses, vectors, grads, batch_size):
        """``(A, D, b)`` with ``A_ij = v_i^T C v_j`` for the exact Fisher/GGN, ``D = V^T V``, ``b = V^T g``."""
        kind = "ggn" if self._estimation_mode.startswith("ggn") else "fisher"
        jvs = [deps_jvp(v) for v in vectors]
        n = len(vectors)
        rows = []
        for i in range(n):
            row = []
            for j in range(n):
                total = 0.0
                for li, loss in enumerate(losses):
                    prod = getattr(loss, f"multiply_{kind}")(jvs[j][li])
                    total = total + sum(jnp.sum(a * b) for a, b in zip(jvs[i][li], prod))
                row.append(total / batch_size)
            rows.append(row)
        a = jnp.array(rows)
        a = utils.pmean_if_pmap(a, self._axis)  # multi_device: each device saw its share of the batch
        return a, utils.matrix_of_inner_products(vectors), utils.vector_of_inner_products(grads, vectors)

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
        *_, losses, _, deps_jvp = self._linearized(func_args)
        bs = self._batch_size_extractor(func_args[-1])
        return self._exact_quad_model_from(deps_jvp, losses, vectors, grads, bs)

    def compute_approx_quad_model(self, state: OptimizerState, vectors: Sequence[Any], grads: Any):
        """The quadratic model's ``(A, D, b)`` with the curvature estimate in place of the exact matrix.

        As ``compute_exact_quad_model`` (same ``vectors`` and ``grads``), with ``A_ij = v_i^T C
        v_j`` for the block-diagonal estimate held in ``state`` (undamped).
        """
        cvs = [
            self._estimator.multiply(state.estimator_state, v, 0.0, True, False) for v in vectors
        ]
        a = jnp.array([[utils.inner_product(vi, cj) for cj in cvs] for vi in vectors])
        return a, utils.matrix_of_inner_products(vectors), utils.vector_of_inner_products(grads, vectors)

    def _solve_coefficients(self, quad, damping, lr, mom) -> jax.Array:
        """Minimises the damped quadratic model over the adaptive coefficients."""
        a, d, b = quad
        ad = a + (self._l2_reg + damping) * d
        safe = lambda num, den: jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
        if self._adaptive_lr and self._adaptive_momentum:
            w0_only = safe(-b[0], ad[0, 0])
            det = ad[0, 0] * ad[1, 1] - ad[0, 1] * ad[1, 0]
            w_full = jnp.stack([(-b[0] * ad[1, 1] + b[1] * ad[0, 1]), (-b[1] * ad[0, 0] + b[0] * ad[1, 0])])
            w_full = w_full / jnp.where(det > 0, det, 1.0)
            use_full = (d[1, 1] > 0) & (det > 0)
            return jnp.where(use_full, w_full, jnp.stack([w0_only, 0.0]))
        if self._adaptive_lr:
            w1 = mom
            return jnp.stack([safe(-(b[0] + ad[1, 0] * w1), ad[0, 0]), w1])
        w0 = -lr
        return jnp.stack([w0, safe(-(b[1] + ad[0, 1] * w0), ad[1, 1])])

    def compute_loss_value(self, func_args: Sequence[Any]) -> jax.Array:
        """The loss value of ``value_func(*func_args)``, without its state or aux outputs.

        ``func_args`` is the value function's argument tuple, ``(params, [func_state], [rng],
        batch)``.
        """
        return self._split_outputs(self._value_func(*func_args))[0]

    def _check_params_dtype(self, params: Any) -> None:
        utils.check_float_params(params)


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}: (" + ", ".join(_describe(e) for e in x) + ")"
    if hasattr(x, "shape"):
        return f"array{tuple(x.shape)}"
    return type(x).__name__
