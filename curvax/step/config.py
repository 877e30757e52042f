"""Constructor arguments, checked once, and the step's coefficient arguments.

``check_optimizer_args`` is the one place where ``curvax.Optimizer``'s constructor arguments
are validated (argument validation hooks in here); ``StepConfig`` is what the step phases read
of them, frozen so that the compiled step cannot see a later change.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from curvax import estimators, parallel, utils
from curvax.step.state import OptimizerState

# kfac-jax 0.0.8's constructor arguments that curvax does not implement, with the one value
# (their default) that is accepted.
UNIMPLEMENTED_V008_ARGS: tuple[tuple[str, Any], ...] = (
    ("regularized_parameters_path_exclusions", ""),
    ("use_initial_damping_calibration", False),
    ("use_step_rejection", False),
    ("reject_damping_increase_factor", 1.0),
    ("custom_estimator_ctor", None),
    ("include_registered_loss_in_stats", False),
    ("num_estimator_samples", 1),
    ("should_vmap_estimator_samples", False),
    ("precon_power", -1.0),
    ("exact_quad_model_matrix_type", None),
)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The settings the phases of ``curvax.Optimizer``'s step read (see its docstring).

    Built by ``optimizer_config`` from the checked constructor arguments; names are the
    constructor's, shortened where they were long.
    """

    l2_reg: float
    adaptive_lr: bool
    lr_schedule: Callable[[Any], Any] | None
    adaptive_momentum: bool
    momentum_schedule: Callable[[Any], Any] | None
    adaptive_damping: bool
    damping_schedule: Callable[[Any], Any] | None
    initial_damping: Any
    min_damping: float
    max_damping: float
    include_damping_in_quad_change: bool
    damping_interval: int
    damping_decay: float
    lower_threshold: float
    upper_threshold: float
    always_exact_qmodel: bool
    norm_constraint: Any
    num_burnin_steps: int
    estimation_mode: str
    curvature_ema: float
    inverse_update_period: int
    inverse_update_staggered: bool
    curvature_update_period: int
    curvature_batch_fraction: float
    use_exact_inverses: bool
    precon_damping_mult: float
    precon_damping_schedule: Callable[[Any], Any] | None
    # kfac-jax 0.0.8's norm_to_scale_identity_weight_per_block (None: off).
    block_norm: str | None = None

    @property
    def adaptive_coefficients(self) -> bool:
        """Whether the quadratic model chooses the learning rate or the momentum."""
        return self.adaptive_lr or self.adaptive_momentum


def _check_exclusive(args: Mapping[str, Any]) -> None:
    """Adaptive versus scheduled coefficients, and the arguments adaptive damping needs."""
    for name in ("learning_rate", "momentum", "damping"):
        if args[f"use_adaptive_{name}"] and args[f"{name}_schedule"] is not None:
            raise ValueError(f"Pass either use_adaptive_{name}=True or a {name}_schedule, not both.")
    if args["use_adaptive_damping"] and args["initial_damping"] is None:
        raise ValueError("use_adaptive_damping=True needs `initial_damping` (e.g. initial_damping=1.0).")
    if args["norm_constraint"] is not None and args["use_adaptive_learning_rate"]:
        raise ValueError("`norm_constraint` can only be used with a fixed or scheduled learning rate.")
    norm = estimators.block_norm_name(args.get("norm_to_scale_identity_weight_per_block"))
    adaptive = [f"use_adaptive_{n}" for n in ("learning_rate", "momentum", "damping") if args[f"use_adaptive_{n}"]]
    if norm is not None and adaptive:
        raise ValueError(
            f"`norm_to_scale_identity_weight_per_block`={norm!r} cannot be combined with {', '.join(adaptive)}=True "
            "(as in kfac-jax 0.0.8): the quadratic model behind adaptive coefficients does not use the scaled damping."
        )


def _check_ranges(args: Mapping[str, Any]) -> None:
    """Periods, fractions, the moving average, l2_reg and the damping bounds."""
    for name in ("damping_adaptation_interval", "inverse_update_period", "curvature_update_period"):
        utils.check_int(args[name], name, 1)
    utils.check_number(
        args["curvature_batch_fraction"], "curvature_batch_fraction", 0.0, 1.0, low_open=True, high_open=False
    )
    burnin = args["num_burnin_steps"]
    if not isinstance(burnin, (int, np.integer)) or burnin < 0:
        raise ValueError(f"`num_burnin_steps` must be a non-negative integer, got {burnin!r}.")
    if not 0.0 <= float(args["curvature_ema"]) <= 1.0:
        raise ValueError(f"`curvature_ema` must lie in [0, 1], got {args['curvature_ema']}.")
    l2_reg = args["l2_reg"]
    if float(l2_reg) < 0:
        raise ValueError(f"`l2_reg` must be non-negative, got {l2_reg}.")
    if args["initial_damping"] is not None:  # negative never; zero only with l2_reg > 0 (utils.check_damping)
        utils.check_damping(args["initial_damping"], "initial_damping", float(l2_reg))
    if args["use_adaptive_damping"]:  # adaptation multiplies the damping: it could never leave 0
        utils.check_damping(args["min_damping"], "min_damping", float(l2_reg))
    lo, hi = float(args["min_damping"]), float(args["max_damping"])
    if math.isnan(lo) or math.isnan(hi) or hi < lo:
        raise ValueError(
            f"`max_damping` ({args['max_damping']!r}) must not be below `min_damping` ({args['min_damping']!r}): "
            "adaptive damping is clipped to [min_damping, max_damping]."
        )
    if not float(args["damping_lower_threshold"]) <= float(args["damping_upper_threshold"]):
        raise ValueError("`damping_lower_threshold` must not exceed `damping_upper_threshold`.")
    estimators.check_estimation_mode(args["estimation_mode"])


def _check_v008(args: Mapping[str, Any]) -> None:
    """kfac-jax 0.0.8's additions: the unimplemented ones accept their default only."""
    for name, default in UNIMPLEMENTED_V008_ARGS:
        given = args[name]
        if not (given is default or (default is not None and given == default)):
            raise NotImplementedError(
                f"`{name}`={given!r} (a kfac-jax 0.0.8 argument) is not implemented by curvax; only its "
                f"default {default!r} is accepted."
            )
    invalid = args["invalid_metric_value"]
    if not (isinstance(invalid, float) and math.isnan(invalid)):
        raise NotImplementedError("`invalid_metric_value` other than nan (kfac-jax 0.0.8) is not implemented by curvax.")
    for name in ("value_func_for_estimator", "precon_damping_schedule"):
        if args[name] is not None and not callable(args[name]):
            raise TypeError(f"`{name}` must be callable, got {type(args[name]).__name__}.")
    utils.check_number(args["precon_damping_mult"], "precon_damping_mult", 0.0, math.inf, low_open=True)


def _check_staggered(args: Mapping[str, Any]) -> None:
    staggered = args["inverse_update_staggered"]
    if not isinstance(staggered, (bool, np.bool_)):
        raise TypeError(f"`inverse_update_staggered` must be a bool, got {staggered!r}.")
    if staggered and int(args["inverse_update_period"]) == 1:
        raise ValueError(
            "`inverse_update_staggered=True` needs `inverse_update_period` > 1 (with 1 every step "
            "computes every inverse: there is nothing to stagger)."
        )


def check_optimizer_args(args: Mapping[str, Any]) -> None:
    """Checks ``curvax.Optimizer``'s constructor arguments (a mapping of name to value).

    Raises ``TypeError``/``ValueError`` naming the argument for contradictory or out-of-range
    values, ``NotImplementedError`` for a non-default kfac-jax 0.0.8 argument curvax lacks.
    """
    func = args["value_and_grad_func"]
    if not callable(func):
        raise TypeError(f"`value_and_grad_func` must be callable, got {type(func).__name__}.")
    axis = args["pmap_axis_name"]
    if args["multi_device"] and (not isinstance(axis, str) or not axis):
        raise TypeError(f"multi_device=True needs `pmap_axis_name`, a non-empty string; got {axis!r}.")
    _check_exclusive(args)
    _check_ranges(args)
    _check_v008(args)
    _check_staggered(args)


def optimizer_config(args: Mapping[str, Any]) -> StepConfig:
    """The ``StepConfig`` of already checked constructor arguments (see ``check_optimizer_args``)."""
    return StepConfig(
        l2_reg=float(args["l2_reg"]),
        adaptive_lr=bool(args["use_adaptive_learning_rate"]),
        lr_schedule=args["learning_rate_schedule"],
        adaptive_momentum=bool(args["use_adaptive_momentum"]),
        momentum_schedule=args["momentum_schedule"],
        adaptive_damping=bool(args["use_adaptive_damping"]),
        damping_schedule=args["damping_schedule"],
        initial_damping=args["initial_damping"],
        min_damping=float(args["min_damping"]),
        max_damping=float(args["max_damping"]),
        include_damping_in_quad_change=bool(args["include_damping_in_quad_change"]),
        damping_interval=int(args["damping_adaptation_interval"]),
        damping_decay=float(args["damping_adaptation_decay"]),
        lower_threshold=float(args["damping_lower_threshold"]),
        upper_threshold=float(args["damping_upper_threshold"]),
        always_exact_qmodel=bool(args["always_use_exact_qmodel_for_damping_adjustment"]),
        norm_constraint=args["norm_constraint"],
        num_burnin_steps=int(args["num_burnin_steps"]),
        estimation_mode=args["estimation_mode"],
        curvature_ema=float(args["curvature_ema"]),
        inverse_update_period=int(args["inverse_update_period"]),
        inverse_update_staggered=bool(args["inverse_update_staggered"]),
        curvature_update_period=int(args["curvature_update_period"]),
        curvature_batch_fraction=float(args["curvature_batch_fraction"]),
        use_exact_inverses=bool(args["use_exact_inverses"]),
        precon_damping_mult=float(args["precon_damping_mult"]),
        precon_damping_schedule=args["precon_damping_schedule"],
        block_norm=estimators.block_norm_name(args.get("norm_to_scale_identity_weight_per_block")),
    )


def check_step_coefficients(cfg: StepConfig, learning_rate: Any, momentum: Any, damping: Any) -> None:
    """Each of the step's ``learning_rate``/``momentum``/``damping`` (None when not given) is
    required when neither adaptive nor scheduled in ``cfg``, refused otherwise (``ValueError``)."""
    for name, given, adaptive, schedule in (
        ("learning_rate", learning_rate, cfg.adaptive_lr, cfg.lr_schedule),
        ("momentum", momentum, cfg.adaptive_momentum, cfg.momentum_schedule),
        ("damping", damping, cfg.adaptive_damping, cfg.damping_schedule),
    ):
        if adaptive and given is not None:
            raise ValueError(f"`{name}` was passed to step, but use_adaptive_{name}=True chooses it; remove it.")
        if schedule is not None and given is not None:
            raise ValueError(f"`{name}` was passed to step, but a {name}_schedule was given to the constructor.")
        if not adaptive and schedule is None and given is None:
            raise ValueError(
                f"step needs `{name}=`: the optimizer has neither use_adaptive_{name}=True nor a {name}_schedule."
            )


def scalar_arg(value: Any, name: str, multi_device: bool = False) -> jax.Array:
    """A step's coefficient argument as a scalar of ``utils.coefficient_dtype()`` (None: 0), for the compiled step.

    With ``multi_device`` (pmap) one value per local device, shape ``(devices,)``.
    """
    if multi_device:
        n = jax.local_device_count()
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            # A host array: no eager JAX dispatch per step (the pmap transfers it with the call).
            return np.full((n,), 0.0 if value is None else value, dtype=jax.dtypes.canonicalize_dtype(jnp.float64))  # type: ignore[return-value]
        return parallel.device_scalar(value, n, name)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return np.asarray(0.0 if value is None else value, dtype=utils.coefficient_dtype())  # type: ignore[return-value]
    try:
        arr = jnp.asarray(0.0 if value is None else value, dtype=utils.coefficient_dtype())
    except (TypeError, ValueError) as e:
        raise TypeError(f"`{name}` must be a scalar number, got {type(value).__name__}.") from e
    if arr.ndim != 0:
        raise ValueError(f"`{name}` must be a scalar, got shape {arr.shape}.")
    return arr


def check_kfac_preconditioner_args(
    loss_fn: Any, damping: Any, l2_reg: Any, curvature_ema: Any, inverse_update_period: Any, estimation_mode: Any,
    example_batch: Any,
) -> int:
    """Checks ``curvax.kfac_preconditioner``'s arguments; returns the refresh period as an int."""
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}.")
    utils.check_number(l2_reg, "l2_reg", 0.0)
    if not callable(damping):
        utils.check_number(damping, "damping", 0.0)
        utils.check_damping(damping, "damping", l2_reg)
    utils.check_number(curvature_ema, "curvature_ema", 0.0, 1.0)
    period = utils.check_int(inverse_update_period, "inverse_update_period", 1)
    estimators.check_estimation_mode(estimation_mode)
    utils.check_batch_leading_sizes(example_batch, "example_batch")
    return period


def check_optax_preconditioner_args(args: Mapping[str, Any]) -> None:
    """Checks the constructor arguments of kfac-jax 0.0.8's ``OptaxPreconditioner`` (name to value)."""
    if not callable(args["value_func"]):
        raise TypeError(f"`value_func` must be callable, got {type(args['value_func']).__name__}.")
    if (args["damping"] is None) == (args["damping_schedule"] is None):
        raise ValueError("OptaxPreconditioner: pass exactly one of `damping` and `damping_schedule`.")
    utils.check_number(args["l2_reg"], "l2_reg", 0.0)
    if args["damping"] is not None:
        utils.check_number(args["damping"], "damping", 0.0)
        utils.check_damping(args["damping"], "damping", args["l2_reg"], allow_zero=True)
    utils.check_number(args["curvature_ema"], "curvature_ema", 0.0, 1.0)
    if args["curvature_update_period"] != 1:
        raise ValueError(f"`curvature_update_period` must be 1 (as in kfac-jax), got {args['curvature_update_period']!r}.")
    utils.check_int(args["inverse_update_period"], "inverse_update_period", 1)
    if args["num_samples"] != 1:
        raise NotImplementedError(f"OptaxPreconditioner: `num_samples` must be 1, got {args['num_samples']!r}.")
    estimators.block_norm_name(args.get("norm_to_scale_identity_weight_per_block"))
    if args["norm_constraint"] is not None:
        utils.check_number(args["norm_constraint"], "norm_constraint", 0.0)


def estimator_from_args(args: Mapping[str, Any], value_func: Callable[..., Any]) -> estimators.BlockDiagonalCurvature:
    """The block-diagonal estimator of ``curvax.Optimizer``'s constructor ``args`` (blocks built
    at ``init``), tracing ``value_func_for_estimator`` when given, else ``value_func``."""
    auto_kwargs = dict(args["auto_register_kwargs"] or {})
    if not args["use_automatic_registration"]:
        auto_kwargs.setdefault("auto_register_tags", False)
    func = args["value_func_for_estimator"]
    return estimators.BlockDiagonalCurvature(
        func if func is not None else value_func,
        params_index=0,
        default_estimation_mode=args["estimation_mode"],
        layer_tag_to_block_ctor=args["layer_tag_to_block_ctor"],
        factor_budget=args["factor_budget"],
        oversized_factor=args["oversized_factor"],
        register_only_generic=args["register_only_generic"],
        patterns_to_skip=tuple(args["patterns_to_skip"]),
        curvature_dtype=args["curvature_dtype"],
        inverse_dtype=args["inverse_dtype"],
        **auto_kwargs,
    )


def check_step_call(
    params_spec: Any, multi_device: bool, has_state: bool, params: Any, state: Any, rng: Any, data_iterator: Any,
    batch: Any, func_state: Any,
) -> None:
    """The host-side checks of a ``curvax.Optimizer.step`` call, before any coefficient.

    ``params_spec`` is the parameters' spec at ``init`` (None before it); ``multi_device`` and
    ``has_state`` the optimizer's; the rest ``step``'s arguments.
    """
    if (data_iterator is None) == (batch is None):
        raise ValueError("Pass exactly one of `data_iterator` and `batch` to step.")
    if params_spec is None:
        raise RuntimeError("Call `optimizer.init(params, rng, batch)` before `step`.")
    if not isinstance(state, OptimizerState):
        raise TypeError(f"`state` must be the Optimizer.State returned by init/step, got {type(state).__name__}.")
    utils.check_rng(rng)
    if multi_device:
        n = jax.local_device_count()
        parallel.check_device_axis({"params": params, "state": state, "rng": rng, "func_state": func_state}, n)
    spec = utils.tree_spec(parallel.local_shapes(params) if multi_device else params)
    if spec != params_spec:
        raise ValueError(
            "`params` differ in structure, shapes or dtypes from those passed to init:\n"
            f"init: {params_spec}\nstep: {spec}"
        )
    if has_state and func_state is None:
        raise ValueError("value_func_has_state=True: pass `func_state` to step.")


def check_concrete_coefficient(value: Any, name: str, l2_reg: float) -> None:
    """A learning rate, momentum or damping known on the host (a step argument, or a schedule's
    value at step 0) must be finite; a damping also >= 0 (``utils.check_damping``). Traced
    values pass here; the compiled step flags them (``invalid_coefficients``)."""
    if value is None:
        return
    if name.startswith("damping"):
        utils.check_damping(value, name, l2_reg)
        return
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if arr.size and not np.all(np.isfinite(arr)):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.")


def call_schedule(schedule: Callable[..., Any], step: Any, data_seen: Any) -> Any:
    """``schedule(step)``, or ``schedule(step, data_seen=data_seen)`` when the schedule has a
    parameter named ``data_seen`` (the examples seen before this step): kfac-jax 0.0.8 calls its
    schedules so, and a schedule of the data seen gets them in curvax too."""
    try:
        takes_data_seen = "data_seen" in inspect.signature(schedule).parameters
    except (TypeError, ValueError):  # no signature (some builtins): called with the step only
        takes_data_seen = False
    return schedule(step, data_seen=data_seen) if takes_data_seen else schedule(step)


def check_schedules(cfg: StepConfig) -> None:
    """Each schedule's value at step 0, where it can be computed on the host, passes
    ``check_concrete_coefficient`` (``ValueError`` naming the schedule otherwise). A schedule
    that only goes out of range later is reported by the step (``invalid_coefficients``)."""
    for name, schedule in (
        ("learning_rate_schedule", cfg.lr_schedule), ("momentum_schedule", cfg.momentum_schedule),
        ("damping_schedule", cfg.damping_schedule),
    ):
        if schedule is None:
            continue
        try:
            value = call_schedule(schedule, jnp.zeros([], int), jnp.zeros([], int))
        except Exception:  # noqa: BLE001 - the step calls it again and shows its own error
            continue
        try:
            check_concrete_coefficient(value, "damping" if name.startswith("damping") else name, cfg.l2_reg)
        except ValueError as e:
            raise ValueError(f"`{name}` returned {value!r} at step 0: {e}") from None


def invalid_coefficients(cfg: StepConfig, lr: jax.Array, mom: jax.Array, damp: jax.Array) -> dict[str, jax.Array]:
    """In the compiled step: which of the given or scheduled coefficients are out of range
    (learning rate or momentum not finite, damping not finite or negative). Adaptive ones are
    the quadratic model's and are covered by the non-finite guard."""
    flags = {}
    if not cfg.adaptive_lr:
        flags["learning_rate"] = ~jnp.isfinite(lr)
    if not cfg.adaptive_momentum:
        flags["momentum"] = ~jnp.isfinite(mom)
    flags["damping"] = ~jnp.isfinite(damp) | (damp < 0)
    return flags


def _spans_other_processes(leaf: Any) -> bool:
    """Whether ``leaf`` is a concrete array with shards on other processes' devices (multi-host)."""
    try:
        return isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
    except Exception:  # a tracer has no placement to read
        return False


def check_finite_params(params: Any) -> None:
    """``params`` given to ``init`` hold no NaN or infinity (``ValueError`` naming the leaf):
    every update from such parameters would be skipped. Traced parameters pass unchecked.

    A leaf with shards on other processes' devices cannot be read here: those leaves are
    counted by one jitted reduction whose replicated result every process reads, so all the
    processes agree on raising."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    counts: list[Any] = []
    spread: list[int] = []  # indices of the leaves spanning other processes
    for _, leaf in leaves:
        if _spans_other_processes(leaf):
            spread.append(len(counts))
            counts.append(leaf)
            continue
        try:
            arr = np.asarray(leaf)
        except (TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            return
        counts.append(int(arr.size - np.count_nonzero(np.isfinite(arr))) if np.issubdtype(arr.dtype, np.inexact) else 0)
    if spread:
        count = lambda x: jnp.sum(~jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros((), jnp.int32)
        for i, n in zip(spread, jax.jit(lambda xs: [count(x) for x in xs])([counts[i] for i in spread])):
            counts[i] = int(n)
    for (path, _), bad in zip(leaves, counts):
        if bad:
            raise ValueError(
                f"`params` given to init hold {bad} non-finite value(s) in {jax.tree_util.keystr(path) or 'the root'}: "
                "every update from them would be skipped."
            )


def state_spec(state: Any) -> tuple[Any, tuple[tuple[int, ...], ...]]:
    """The structure and shapes of an ``OptimizerState``: what a state from another model breaks."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    return treedef, tuple(tuple(np.shape(x)) for x in leaves)


def call_signature(*trees: Any) -> tuple | None:
    """The tree structures, shapes and dtypes of ``trees``: everything the structural checks of a
    step call depend on (a cheap key to skip them for a call like the last checked one, and to
    find the step's compiled program). None when a leaf is traced (``step`` inside a ``jit``)."""
    out = []
    for tree in trees:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return None
        out.append((treedef, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves)))
    return tuple(out)


def check_state_spec(expected: Any, state: Any, multi_device: bool) -> None:
    """``state`` has the structure and shapes of the state ``init`` returned (``ValueError``
    naming ``state`` and the first leaf that differs, e.g. a state of another model)."""
    if expected is None:
        return
    treedef, shapes = state_spec(state)
    if treedef != expected[0]:
        raise ValueError(
            "`state` does not have the structure of the state init returned (another model or optimizer "
            f"configuration?):\ninit: {expected[0]}\nstep: {treedef}"
        )
    if shapes != expected[1]:
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        for path, got, want in zip(paths, shapes, expected[1]):
            if got != want:
                raise ValueError(
                    f"`state` leaf state{path} has shape {got}, but init made it {want}: the state comes from "
                    "another model or optimizer configuration."
                )
