"""The optimizer interface of ``kfac_ferminet_alpha`` (FermiNet's K-FAC before kfac-jax), over curvax.

Exists only for compatibility: code written for ``kfac_ferminet_alpha.optimizer.Optimizer``
runs with ``from curvax.kfac_ferminet_alpha import optimizer as kfac_optim`` (and ``utils``,
``loss_functions``, ``layers_and_loss_tags`` likewise). The curvature, the preconditioning and
the update are curvax's (the phases of ``curvax.step``, composed by ``curvax.step.program``);
this module adds the alpha's calling convention and its few differences from kfac-jax:

* **No adaptive anything.** Learning rate, momentum and damping each come from a schedule
  (``*_schedule(step)``) or from the ``step(..., learning_rate=, momentum=, damping=)`` argument;
  exactly one of the two. ``min_damping``/``max_damping`` are accepted and kept but, as in the
  alpha, never used; ``stats["rho"]`` is always NaN.
* **Momentum is 0 on the first step** (a passed value is replaced, a schedule is masked at
  step 0). The velocities start at zero, so this changes only ``stats["momentum"]``.
* **step takes an iterator.** ``step(params, state, rng, data_iterator, func_state=None,
  learning_rate=None, momentum=None, damping=None, batch_size=None, global_step_int=None)``
  draws one batch with ``next``; the first step (step counter 0, or ``global_step_int == 0``)
  first draws ``num_burnin_steps`` more for the burn-in. It returns ``(params, state, stats)``,
  or ``(params, state, func_state, stats)`` with ``value_func_has_state=True``.
* **Burn-in averages.** Burn-in batch ``i`` enters the curvature moving averages with weight
  ``1/num_burnin_steps`` (kfac-jax and ``curvax.Optimizer``: weight 1), so after it the
  statistics are the same mean but weigh as one batch against the ``curvature_ema`` decay of
  later steps. With ``num_burnin_steps`` 0 or 1 the two are identical.
* **rng.** Each burn-in step uses ``rng, key = split(rng)`` and ``key``; the step itself gets
  the remaining ``rng`` (curvax splits it into an estimator key and the function's key).
* **stats** holds exactly ``step`` (the counter *before* the step), ``loss``,
  ``learning_rate``, ``momentum``, ``damping``, ``rho`` and, with ``value_func_has_aux``, ``aux``.
* **state** is a dict ``{"velocities", "estimator", "step_counter"}`` as in the alpha; its
  ``"estimator"`` entry is curvax's block-diagonal state, not the alpha's block dicts.
* **batch_size** (static) overrides the leading-axis batch size used to normalise the statistics.
* ``donate_parameters``, ``donate_optimizer_state``, ``donate_batch_inputs`` and
  ``donate_func_state`` compile the step with ``donate_argnums`` for those arguments: their
  buffers are deleted by the step (JAX warns about donated buffers no output can reuse, typically
  the batch's). ``debug=True`` compiles nothing (init, burn-in and step run op by op); unlike the
  alpha, where it silently switched pmap off, it refuses ``multi_device=True``.
  ``use_jax_cond`` is accepted and ignored, as in the alpha.
* ``multi_device=True`` is the alpha's (and kfac-jax's) pmap mode, delegated to
  ``curvax.Optimizer(multi_device=True)``: every argument carries a leading axis of
  ``jax.local_device_count()`` (replicated parameters and learning rate/momentum/damping, one
  key per device, the batch split), the step is ``jax.pmap``-ed over ``pmap_axis_name`` and
  averages the loss, gradients and statistics over it.
* ``layer_tag_to_block_cls`` maps tag names (the alpha's ``"dense_tag"``, ``"generic_tag"`` ...,
  or curvax's ``"dense"``) to curvax block classes, e.g. ``curvax.DenseFull``; a callable of one
  argument (the alpha's ``cls(eqn)``) is accepted too. The alpha's own block classes (and
  subclasses of them, like FermiNet's ``QmcBlockedDense``) have another interface and are not
  supported.
* ``estimation_mode``: the alpha's six modes; ``"fisher_empirical"``, which the alpha left
  unimplemented, works here.
* Non-finite preconditioned gradients skip the update (curvax's guard; the alpha applied them),
  and a non-finite burn-in batch leaves the statistics as they were (curvax's statistics guard).
"""

from __future__ import annotations

import inspect
import math
import types
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax import blocks as _blocks
from curvax import losses as _losses
from curvax import parallel as _parallel
from curvax import tags as _tags
from curvax import utils
from curvax.optimizer import Optimizer as _CurvaxOptimizer
from curvax.optimizer import OptimizerState as _CurvaxState
from curvax.step import config as _config
from curvax.step import guard as _guard
from curvax.step import statistics as _statistics

State = Mapping[str, Any]
"""The optimizer state: ``{"velocities", "estimator", "step_counter"}`` (as the alpha's)."""

ESTIMATION_MODES = (
    "fisher_gradients",
    "fisher_empirical",
    "fisher_exact",
    "fisher_curvature_prop",
    "ggn_exact",
    "ggn_curvature_prop",
)
"""The alpha's estimation modes (all supported; ``fisher_empirical`` was not in the alpha)."""

_STATE_KEYS = ("velocities", "estimator", "step_counter")
# The per-step flags of the non-finite guard that the alpha's stats carry (see curvax.Optimizer).
_GUARD_KEYS = (
    "update_skipped", "curvature_update_skipped", "loss_diverged", "learning_rate_invalid", "momentum_invalid",
    "damping_invalid",
)


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a bool, got {value!r}.")
    return bool(value)


def _check_optional_callable(value: Any, name: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"`{name}` must be callable or None, got {type(value).__name__}.")


def _block_ctor(value: Any, key: Any) -> Callable[..., Any]:
    """A curvax ``ctor(layer_tag_eqn, name)`` from a block class or an alpha-style ``cls(eqn)``."""
    if not callable(value):
        raise TypeError(
            f"layer_tag_to_block_cls[{key!r}] must be a curvax block class (e.g. curvax.DenseFull) or a "
            f"callable, got {type(value).__name__}."
        )
    if isinstance(value, type):
        if not issubclass(value, _blocks.CurvatureBlock):
            raise TypeError(
                f"layer_tag_to_block_cls[{key!r}] = {value.__name__} is not a curvax CurvatureBlock subclass; "
                "kfac_ferminet_alpha's own block classes are not supported, use curvax's (e.g. curvax.DenseFull)."
            )
        return value
    try:
        params = inspect.signature(value).parameters.values()
    except (TypeError, ValueError):
        return value
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) == 1 and not variadic:
        return lambda eqn, name: value(eqn)  # the alpha called ``cls(eqn)``
    return value


def _map_block_classes(mapping: Mapping[Any, Any] | None) -> dict[str, Callable[..., Any]] | None:
    """``layer_tag_to_block_cls`` (alpha) as curvax's ``layer_tag_to_block_ctor``."""
    if mapping is None:
        return None
    if not isinstance(mapping, Mapping):
        raise TypeError(f"`layer_tag_to_block_cls` must be a mapping from tag names to block classes, got {type(mapping).__name__}.")
    out = {}
    for key, value in mapping.items():
        name = getattr(key, "name", key)
        if not isinstance(name, str):
            raise TypeError(f"`layer_tag_to_block_cls` keys must be tag names (str) or LayerTags, got {key!r}.")
        try:
            _blocks.get_default_tag_to_block_ctor(name)
        except ValueError as e:
            raise ValueError(f"`layer_tag_to_block_cls` has an unknown layer tag {name!r}: {e}") from None
        out[name.removesuffix("_tag")] = _block_ctor(value, key)
    return out


def _zero_at_first_step(schedule: Callable[[Any], Any]) -> Callable[[jax.Array], jax.Array]:
    """``schedule``, masked to 0 at step 0 (the alpha's first step has no momentum)."""

    def first_step_zero(step: jax.Array) -> jax.Array:
        value = jnp.asarray(schedule(step))
        return jnp.where(step == 0, jnp.zeros_like(value), value)

    return first_step_zero


def _check_args(args: Mapping[str, Any]) -> dict[str, bool]:
    """The alpha's own checks of the constructor's ``args`` (name to value); returns its bool flags.

    Ranges and integers are left to ``curvax.Optimizer``, with its own messages.
    """
    if not callable(args["value_and_grad_func"]):
        raise TypeError(f"`value_and_grad_func` must be callable, got {type(args['value_and_grad_func']).__name__}.")
    if args["estimation_mode"] not in ESTIMATION_MODES:
        raise ValueError(f"`estimation_mode` must be one of {list(ESTIMATION_MODES)}, got {args['estimation_mode']!r}.")
    for name in ("learning_rate_schedule", "momentum_schedule", "damping_schedule", "batch_process_func"):
        _check_optional_callable(args[name], name)
    flags = {
        name: _check_bool(args[name], name)
        for name in (
            "value_func_has_aux", "value_func_has_state", "value_func_has_rng", "register_only_generic",
            "donate_parameters", "donate_optimizer_state", "donate_batch_inputs", "donate_func_state",
            "multi_device", "use_jax_cond", "debug",
        )
    }
    if not isinstance(args["pmap_axis_name"], str):
        raise TypeError(f"`pmap_axis_name` must be a str, got {args['pmap_axis_name']!r}.")
    if flags["multi_device"] and flags["debug"]:
        raise ValueError(
            "debug=True runs without jit or pmap, so it cannot run multi_device=True (inputs with a leading "
            "device axis); pass one of them."
        )
    return flags


class Optimizer:
    """``kfac_ferminet_alpha.optimizer.Optimizer`` on curvax's K-FAC (kept for compatibility).

    The constructor takes the alpha's arguments with the alpha's defaults; see the module
    docstring for what differs from ``curvax.Optimizer`` / kfac-jax. ``init(params, rng, batch,
    func_state=None)`` returns the state; ``step`` performs one update.
    """

    def __init__(
        self,
        value_and_grad_func: Callable[..., Any],
        l2_reg: Any,
        value_func_has_aux: bool = False,
        value_func_has_state: bool = False,
        value_func_has_rng: bool = False,
        learning_rate_schedule: Callable[[Any], Any] | None = None,
        momentum_schedule: Callable[[Any], Any] | None = None,
        damping_schedule: Callable[[Any], Any] | None = None,
        min_damping: Any = 1e-8,
        max_damping: Any = math.inf,
        norm_constraint: Any = None,
        num_burnin_steps: int = 10,
        estimation_mode: str = "fisher_gradients",
        curvature_ema: Any = 0.95,
        inverse_update_period: int = 5,
        register_only_generic: bool = False,
        layer_tag_to_block_cls: Mapping[Any, Any] | None = None,
        patterns_to_skip: Sequence[str] = (),
        donate_parameters: bool = False,
        donate_optimizer_state: bool = False,
        donate_batch_inputs: bool = False,
        donate_func_state: bool = False,
        batch_process_func: Callable[[Any], Any] | None = None,
        multi_device: bool = False,
        use_jax_cond: bool = True,
        debug: bool = False,
        pmap_axis_name: str = "kfac_axis",
    ):
        """Checks the arguments (the alpha's checks here, the rest by ``curvax.Optimizer``) and
        builds the ``curvax.Optimizer`` that does the work; nothing is traced here."""
        flags = _check_args(locals())
        for name, value in flags.items():  # value_func_has_*, register_only_generic, donate_*, multi_device, ...
            setattr(self, name, value)
        self.value_and_grad_func = value_and_grad_func
        self.l2_reg = l2_reg
        self.learning_rate_schedule = learning_rate_schedule
        self.momentum_schedule = None if momentum_schedule is None else _zero_at_first_step(momentum_schedule)
        self.damping_schedule = damping_schedule
        self.min_damping = min_damping
        self.max_damping = max_damping
        self.norm_constraint = norm_constraint
        self.num_burnin_steps = num_burnin_steps
        self.estimation_mode = estimation_mode
        self.curvature_ema = curvature_ema
        self.inverse_update_period = inverse_update_period
        self.layer_tag_to_block_cls = layer_tag_to_block_cls
        self.patterns_to_skip = tuple(patterns_to_skip)
        self.batch_process_func = batch_process_func
        self.pmap_axis_name = pmap_axis_name if self.multi_device else None

        # curvax validates the remaining arguments (ranges, integers) with its own messages.
        self._report = _guard.Reporter()
        self._inner = self._make_inner(
            value_and_grad_func,
            l2_reg,
            value_func_has_aux=self.value_func_has_aux,
            value_func_has_state=self.value_func_has_state,
            value_func_has_rng=self.value_func_has_rng,
            learning_rate_schedule=learning_rate_schedule,
            momentum_schedule=self.momentum_schedule,
            damping_schedule=damping_schedule,
            min_damping=min_damping,
            max_damping=max_damping,
            norm_constraint=norm_constraint,
            num_burnin_steps=num_burnin_steps,
            estimation_mode=estimation_mode,
            curvature_ema=curvature_ema,
            inverse_update_period=inverse_update_period,
            batch_process_func=batch_process_func,
            register_only_generic=self.register_only_generic,
            patterns_to_skip=self.patterns_to_skip,
            layer_tag_to_block_ctor=_map_block_classes(layer_tag_to_block_cls),
            multi_device=self.multi_device,
            debug=self.debug,
            pmap_axis_name=pmap_axis_name,
        )
        self._compile()
        self.finalized = False

    def _compile(self) -> None:
        """``jax.jit`` (``jax.pmap`` with ``multi_device``, nothing with ``debug``) of the step and
        the burn-in, donating the buffers the ``donate_*`` flags name."""
        # Arguments of _step: params, state, rng, batch, func_state, batch_size, lr, momentum, damping.
        donate = []
        if self.donate_parameters:
            donate.append(0)
        if self.donate_optimizer_state:
            donate.append(1)
        if self.donate_batch_inputs:
            donate.append(3)
        if self.donate_func_state and self.value_func_has_state:
            donate.append(4)
        self.donate_argnums = tuple(donate)
        if self.debug:
            self._step_fn = self._step
            self._burnin_fn = self._burnin
        elif self.multi_device:
            axis = self.pmap_axis_name
            self._step_fn = jax.pmap(
                self._step, axis_name=axis, static_broadcasted_argnums=(5,), donate_argnums=self.donate_argnums
            )
            self._burnin_fn = jax.pmap(self._burnin, axis_name=axis, static_broadcasted_argnums=(5,))
        else:
            self._step_fn = jax.jit(self._step, static_argnums=(5,), donate_argnums=self.donate_argnums)
            self._burnin_fn = jax.jit(self._burnin, static_argnums=(5,))

    @staticmethod
    def _make_inner(*args: Any, **kwargs: Any) -> _CurvaxOptimizer:
        """The ``curvax.Optimizer`` doing the work; a clear error where it lacks the pmap mode."""
        try:
            inner = _CurvaxOptimizer(*args, **kwargs)
        except NotImplementedError as e:
            if not kwargs.get("multi_device"):
                raise
            raise NotImplementedError(
                "kfac_ferminet_alpha Optimizer: multi_device=True delegates to curvax.Optimizer(multi_device=True), "
                f"which this curvax does not support ({e})."
            ) from e
        if kwargs.get("multi_device") and getattr(inner, "_axis", None) is None:
            raise NotImplementedError(
                "kfac_ferminet_alpha Optimizer: multi_device=True needs curvax.Optimizer's pmap mode, which this "
                "curvax does not have."
            )
        return inner

    # --- properties -----------------------------------------------------------------------------

    @property
    def estimator(self) -> Any:
        """curvax's block-diagonal curvature estimator (its blocks exist after ``init``)."""
        return self._inner.estimator

    @property
    def curvax_optimizer(self) -> _CurvaxOptimizer:
        """The ``curvax.Optimizer`` that does the work."""
        return self._inner

    # --- state conversion ---------------------------------------------------------------------

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, Mapping) or any(k not in state for k in _STATE_KEYS):
            raise TypeError(
                f"`state` must be the dict returned by init/step with keys {list(_STATE_KEYS)}, "
                f"got {type(state).__name__}" + (f" with keys {sorted(state)}" if isinstance(state, Mapping) else "") + "."
            )

    @staticmethod
    def _to_curvax(state: State, damping: Any) -> _CurvaxState:
        return _CurvaxState(
            velocities=state["velocities"],
            estimator_state=state["estimator"],
            damping=jnp.asarray(damping, jnp.float32),
            data_seen=jnp.zeros([], int),
            step_counter=state["step_counter"],
        )

    @staticmethod
    def _from_curvax(state: _CurvaxState) -> dict[str, Any]:
        return dict(velocities=state.velocities, estimator=state.estimator_state, step_counter=state.step_counter)

    # --- init -----------------------------------------------------------------------------------

    def init(self, params: Any, rng: jax.Array, batch: Any, func_state: Any = None) -> dict[str, Any]:
        """Traces the model on ``batch``, builds the curvature blocks and returns the initial state."""
        state = self._from_curvax(self._inner.init(params, rng, batch, func_state))
        self.finalized = True
        return state

    # --- the per-call functions (compiled unless debug) -----------------------------------------

    def _burnin(self, params: Any, state: State, rng: jax.Array, batch: Any, func_state: Any, batch_size: int | None):
        """One burn-in update: the statistics of ``batch`` enter with weight ``1/num_burnin_steps``.

        Through curvax's statistics phase (``curvax.step.statistics``): a non-finite batch's
        update is dropped. As in the alpha, the burn-in does not average the statistics over
        the pmap devices.
        """
        program = self._inner._program
        batch = program.process(batch)
        rng, func_rng = jax.random.split(rng) if self.value_func_has_rng else (rng, None)
        func_args = program.func.make_args(params, func_state, func_rng, batch)
        size = program.batch_size_extractor(batch) if batch_size is None else batch_size
        est, _ = _statistics.update_from_args(
            self._inner.estimator, state["estimator"], 1.0, 1.0 / self.num_burnin_steps, size, rng, func_args,
            self.pmap_axis_name, self.estimation_mode, sync=False,
        )
        if self.value_func_has_state:
            func_state = program.func.split_outputs(self.value_and_grad_func(*func_args)[0])[1]
        return dict(state, estimator=est), func_state

    def _step(self, params, state, rng, batch, func_state, batch_size, learning_rate, momentum, damping):
        """One update through ``curvax.Optimizer``'s step (``curvax.step.program``), with the alpha's stats."""
        step = state["step_counter"]
        new_params, new_state, new_func_state, inner_stats = self._inner._step_impl(
            params, self._to_curvax(state, 0.0), rng, batch, func_state, learning_rate, momentum, damping,
            batch_size_override=batch_size,
        )
        stats = {
            "step": step,
            "loss": inner_stats["loss"],
            "learning_rate": inner_stats["learning_rate"],
            "momentum": inner_stats["momentum"],
            "damping": inner_stats["damping"],
            "rho": jnp.asarray(jnp.nan, jnp.float32),
        }
        # The non-finite guard's flags, as curvax.Optimizer reports them (this step only: the
        # alpha's state keeps kfac_ferminet_alpha's fields, so there is no running count).
        for key in _GUARD_KEYS:
            stats[key] = inner_stats[key]
        if self.value_func_has_aux:
            stats["aux"] = inner_stats["aux"]
        return new_params, self._from_curvax(new_state), new_func_state, stats

    # --- step -----------------------------------------------------------------------------------

    def verify_args_and_get_step_counter(
        self,
        params: Any,
        state: State,
        rng: jax.Array,
        data_iterator: Iterator[Any],
        func_state: Any = None,
        learning_rate: Any = None,
        momentum: Any = None,
        damping: Any = None,
        global_step_int: int | None = None,
    ) -> int:
        """Checks the ``step`` arguments; returns the step number (``global_step_int`` or the state's)."""
        del params, rng
        if not self.finalized:
            raise RuntimeError("Call `optimizer.init(params, rng, batch)` before `step`.")
        self._check_state(state)
        if not hasattr(data_iterator, "__next__"):
            raise TypeError(
                f"`data_iterator` must be an iterator of batches (e.g. iter([batch])), got {type(data_iterator).__name__}."
            )
        if self.value_func_has_state and func_state is None:
            raise ValueError("value_func_has_state=True: pass `func_state` to step.")
        for name, given, schedule in (
            ("learning_rate", learning_rate, self.learning_rate_schedule),
            ("momentum", momentum, self.momentum_schedule),
            ("damping", damping, self.damping_schedule),
        ):
            if schedule is not None and given is not None:
                raise ValueError(
                    f"When you have passed a `{name}_schedule` you should not pass `{name}` to the step function."
                )
            if schedule is None and given is None:
                raise ValueError(f"step needs `{name}=`: no `{name}_schedule` was passed to the constructor.")
        if global_step_int is not None:
            if isinstance(global_step_int, bool) or not isinstance(global_step_int, (int, np.integer)):
                raise TypeError(f"`global_step_int` must be a Python int or None, got {global_step_int!r}.")
            return int(global_step_int)
        counter = state["step_counter"]
        if self.multi_device:
            _parallel.check_device_axis({"state": state}, jax.local_device_count())
            counter = counter[0]
        return int(counter)

    def _scalar(self, value: Any, name: str) -> jax.Array:
        """A float32 scalar (None: 0); with ``multi_device`` one per device (shape ``(devices,)``) for ``pmap``."""
        return _config.scalar_arg(value, name, self.multi_device)

    def step(
        self,
        params: Any,
        state: State,
        rng: jax.Array,
        data_iterator: Iterator[Any],
        func_state: Any = None,
        learning_rate: Any = None,
        momentum: Any = None,
        damping: Any = None,
        batch_size: int | None = None,
        global_step_int: int | None = None,
    ) -> tuple:
        """One update. Returns ``(params, state, stats)`` or ``(params, state, func_state, stats)``.

        On the first step (counter 0) ``num_burnin_steps`` batches are drawn from
        ``data_iterator`` for the burn-in before the step's own batch.
        """
        step_int = self.verify_args_and_get_step_counter(
            params, state, rng, data_iterator, func_state, learning_rate, momentum, damping, global_step_int
        )
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1):
            raise ValueError(f"`batch_size` must be a positive int or None, got {batch_size!r}.")
        batch_size = None if batch_size is None else int(batch_size)
        lr = self._scalar(learning_rate, "learning_rate")
        mom = self._scalar(momentum, "momentum")
        damp = self._scalar(damping, "damping")
        if step_int == 0:
            for i in range(self.num_burnin_steps):
                rng, key = _parallel.split_keys(rng, 2, self.multi_device)
                try:
                    burn_batch = next(data_iterator)
                except StopIteration:
                    raise ValueError(
                        f"num_burnin_steps={self.num_burnin_steps}: the first step needs {self.num_burnin_steps + 1} "
                        f"batches from `data_iterator`, which ran out after {i}."
                    ) from None
                self._inner._check_batch(burn_batch)
                state, func_state = self._burnin_fn(params, state, key, burn_batch, func_state, batch_size)
            if self.momentum_schedule is None:
                mom = jnp.zeros_like(mom)  # the alpha treats the first step's momentum as 0
        try:
            batch = next(data_iterator)
        except StopIteration:
            raise ValueError("`data_iterator` has no batch left for this step.") from None
        self._inner._check_batch(batch)
        params, state, func_state, stats = self._step_fn(params, state, rng, batch, func_state, batch_size, lr, mom, damp)
        self._report(stats)
        if self.value_func_has_state:
            return params, state, func_state, stats
        return params, state, stats


optimizer = types.SimpleNamespace(Optimizer=Optimizer, State=State)
"""``kfac_ferminet_alpha.optimizer``'s names (compatibility namespace)."""

loss_functions = _losses
"""``kfac_ferminet_alpha.loss_functions``: curvax's loss module (same ``register_*`` functions)."""

layers_and_loss_tags = _tags
"""``kfac_ferminet_alpha.layers_and_loss_tags``: curvax's tag module (``LayerTag``, ``register_dense`` ...)."""

register_normal_predictive_distribution = _losses.register_normal_predictive_distribution
register_squared_error_loss = _losses.register_squared_error_loss
register_sigmoid_cross_entropy_loss = _losses.register_sigmoid_cross_entropy_loss
register_multi_bernoulli_predictive_distribution = _losses.register_multi_bernoulli_predictive_distribution
register_softmax_cross_entropy_loss = _losses.register_softmax_cross_entropy_loss
register_categorical_predictive_distribution = _losses.register_categorical_predictive_distribution
register_dense = _tags.register_dense
register_generic = _tags.register_generic

__all__ = [
    "ESTIMATION_MODES",
    "Optimizer",
    "State",
    "layers_and_loss_tags",
    "loss_functions",
    "optimizer",
    "register_categorical_predictive_distribution",
    "register_dense",
    "register_generic",
    "register_multi_bernoulli_predictive_distribution",
    "register_normal_predictive_distribution",
    "register_sigmoid_cross_entropy_loss",
    "register_softmax_cross_entropy_loss",
    "register_squared_error_loss",
    "utils",
]
