"""The optimizer's compiled functions (init, burn-in, step), composed of the step's phases.

``StepProgram`` holds what the phases need (the ``StepConfig``, the value function, the
estimator) and nothing that changes from step to step: its methods are pure functions of the
explicit state, for ``jax.jit``/``jax.pmap``. ``curvax.Optimizer`` adds the host side (argument
checks, compilation, the burn-in loop, reports); the ``kfac_ferminet_alpha`` optimizer calls the
same methods.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax import distributed, gradients, parallel, utils
from curvax.step import coefficients, damping, forward, guard, precondition, refresh, statistics, stats
from curvax.step.config import StepConfig, invalid_coefficients
from curvax.step.state import OptimizerState, initial_state
from curvax.step.value_function import ValueFunction

logger = logging.getLogger("curvax")


class Gradient(NamedTuple):
    """The gradient and curvature pass of a step: the (device-averaged) loss and gradient, the
    value function's new state and aux output, and the pass's linearization."""

    loss: jax.Array
    grads: Any
    func_state: Any
    aux: Any
    lin: forward.Linearization


class StepProgram:
    """init, burn-in and step as pure functions over ``OptimizerState`` (see the module docstring).

    ``shares_gradient`` (the gradient proof's verdict) and ``state_shardings`` (where the state
    lives on a mesh, None otherwise) are set by ``curvax.Optimizer.init`` before compiling;
    ``shard_curvature_state`` (the optimizer's option) decides whether the curvature state is
    split over that mesh.
    """

    def __init__(
        self, cfg: StepConfig, func: ValueFunction, estimator: Any, batch_process_func: Callable[[Any], Any] | None,
        batch_size_extractor: Callable[[Any], Any], axis: str | None, include_norms: bool, include_per_param_norms: bool,
    ):
        self.cfg = cfg
        self.func = func
        self.estimator = estimator
        self.batch_process_func = batch_process_func
        self.batch_size_extractor = batch_size_extractor
        self.axis = axis
        self.include_norms = include_norms
        self.include_per_param_norms = include_per_param_norms
        self.shares_gradient = False
        self.state_shardings: OptimizerState | None = None
        # Split the curvature state over the parameters' mesh: True, False, or None (when the
        # parameters are sharded); see ``state_shardings_for``.
        self.shard_curvature_state: bool | None = None
        # kfac-jax's distributed_inverses / distributed_precon_apply (set by the optimizer), and
        # the split of the curvature work over the devices they give (``prepare``; None on one).
        self.distribute: tuple[bool, bool] = (False, False)
        self.distribution: Any = None

    # --- helpers ---------------------------------------------------------------------------

    def process(self, batch: Any) -> Any:
        """``batch_process_func(batch)``, or the batch itself."""
        return batch if self.batch_process_func is None else self.batch_process_func(batch)

    def cache_powers(self) -> tuple[Any, Any]:
        """The inverse powers the blocks cache (see ``curvax.step.refresh.cache_powers``)."""
        return refresh.cache_powers(self.cfg.inverse_update_period, self.cfg.use_exact_inverses)

    def curvature_batch(self, key: jax.Array, batch: Any) -> Any:
        """The examples the curvature is estimated on: all of ``batch``, or a random fraction of it."""
        fraction = self.cfg.curvature_batch_fraction
        if fraction >= 1.0:
            return batch
        return utils.subsample_batch(batch, fraction, jax.random.fold_in(key, 1))

    def trace(self, func_args: Sequence[Any], sub_batch: bool = False) -> Any:
        """The traced function at the shapes of ``func_args``, with an error that says why it failed.

        ``init`` traced it once, so a failure here is a new batch shape: another batch, or the
        sub-batches of ``curvature_batch_fraction`` (``sub_batch``).
        """
        try:
            return self.estimator.processed_jaxpr_for(func_args)
        except Exception as e:
            shapes = [np.shape(x) for x in jax.tree_util.tree_leaves(func_args[-1])]
            fraction = self.cfg.curvature_batch_fraction
            why = (
                f"curvature_batch_fraction={fraction:g}: the curvature is estimated on sub-batches of "
                f"{self.batch_size_extractor(func_args[-1])} examples. " if sub_batch else ""
            )
            raise ValueError(
                f"{why}Tracing the loss on a batch with leaf shapes {shapes} failed ({type(e).__name__}: {e}); "
                "init traced it on other shapes. Does the model assume a fixed batch size (e.g. reshape(16, -1))? "
                "Use reshape(x.shape[0], -1)" + (", or curvature_batch_fraction=1." if sub_batch else ".")
            ) from e

    def linearize(self, func_args: Sequence[Any], with_loss: bool = False, with_outputs: bool = True) -> forward.Linearization:
        """The value function at ``func_args``, linearized (``curvax.step.forward.linearize``);
        the loss itself only with ``with_loss`` (for the shared gradient pass), the function's
        outputs (the loss value) only with ``with_outputs``."""
        return forward.linearize(self.estimator.processed_jaxpr_for(func_args), func_args, with_loss, with_outputs)

    def state_shardings_for(self, params: Any, example: tuple[Any, Any, Any] | None = None) -> OptimizerState | None:
        """Where the state lives when ``params`` span a mesh of several devices (else None).

        Velocities take the parameters' shardings; the damping and the counters are replicated
        on their mesh. The curvature state is replicated too, unless ``shard_curvature_state``
        (or, when that is None, sharded parameters) asks to split it: then every leaf gets its
        own ``NamedSharding`` (``curvax.parallel.curvature_shardings``: large matrices split
        along one axis, the rest replicated), from the shapes ``init`` gives it at ``example``
        = ``(rng, batch, func_state)``.
        """
        mesh = parallel.params_mesh(params)
        if mesh is None:
            return None
        rep = parallel.replicated(mesh)
        velocities = jax.tree_util.tree_map(lambda x: x.sharding, params)
        curvature: Any = rep
        if example is not None and parallel.shards_curvature(self.shard_curvature_state, params):
            shapes = jax.eval_shape(self.initial_estimator_state, params, *example)
            curvature = parallel.curvature_shardings(shapes, mesh)
        return OptimizerState(
            velocities=velocities, estimator_state=curvature, damping=rep, data_seen=rep, step_counter=rep,
            curvature_updates_skipped=rep, updates_skipped=rep, first_loss=rep,
        )

    def prepare(self, params: Any, rng: jax.Array, batch: Any, func_state: Any) -> tuple[gradients.GradientProof, str]:
        """The host-side part of ``init``: traces the loss, builds the blocks, proves (or not) the
        shared gradient and places the state; returns ``(gradient proof, registration table)``.

        Logs where the gradient comes from, and the parameter → layer → block table (a warning
        when a parameter fell back to a generic block).
        """
        func_args = self.func.make_args(params, func_state, rng, self.process(batch))
        user_jaxpr, value_trace = self.func.check_outputs(func_args)
        # The value's trace serves the estimator when the estimator traces the value itself (not
        # a `value_func_for_estimator`) and takes a trace (curvax's; kfac-jax's signature does not).
        takes_trace = (getattr(self.estimator, "func", None) == self.func.value
                       and "traced" in inspect.signature(self.estimator.finalize).parameters)
        self.estimator.finalize(func_args, **({"traced": value_trace} if takes_trace else {}))
        pj = self.estimator.processed_jaxpr
        proof = gradients.prove_shared_gradient(
            self.func.value_and_grad_func, self.func.has_aux or self.func.has_state, func_args, pj.program,
            range(pj.params_offset, pj.params_offset + pj.num_params), user_jaxpr,
        )
        self.shares_gradient = proof.shared
        logger.info(
            "Gradient: %s (%s).", "from curvax's shared forward pass" if proof.shared else "from value_and_grad_func",
            proof.reason,
        )
        names = [type(b).__name__ for b in self.estimator.blocks]
        table = pj.registration_table(params, names, getattr(self.estimator, "block_notes", None))
        has_generic = any(s.pattern == "generic" for s in pj.layer_sites)
        logger.log(logging.WARNING if has_generic else logging.INFO, "\n%s", table)
        self.state_shardings = self.state_shardings_for(params, (rng, batch, func_state))
        # A curvature state stored split (not one replicated sharding) is moved by shares, not gathered.
        split = self.state_shardings is not None and not isinstance(self.state_shardings.estimator_state, jax.sharding.Sharding)
        self.distribution = distributed.make_distribution(*self.distribute, axis_name=self.axis, params=params,
                                                          split_state=split)
        return proof, table

    # --- init and burn-in --------------------------------------------------------------------

    def initial_estimator_state(self, params: Any, rng: jax.Array, batch: Any, func_state: Any) -> Any:
        """The curvature estimator's initial state (empty statistics, the blocks' caches)."""
        func_args = self.func.make_args(params, func_state, rng, self.process(batch))
        exact, approx = self.cache_powers()
        return self.estimator.init(rng, func_args, exact, approx, False)

    def init(self, params: Any, rng: jax.Array, batch: Any, func_state: Any) -> OptimizerState:
        """The initial state: zero velocities, empty statistics, the initial damping (0 if None)."""
        est_state = self.initial_estimator_state(params, rng, batch, func_state)
        initial = self.cfg.initial_damping
        damping_value = jnp.asarray(initial if initial is not None else 0.0, utils.coefficient_dtype())
        state = initial_state(utils.tree_zeros_like(params), est_state, damping_value)
        return parallel.constrain(state, self.state_shardings)

    def burnin(self, params: Any, state: OptimizerState, rng: jax.Array, batch: Any, func_state: Any) -> OptimizerState:
        """One burn-in update: the statistics of ``batch`` (or of its curvature sub-batch) enter
        with weight 1 (a running mean); a non-finite batch's update is dropped and counted."""
        batch = self.process(batch)
        k1, k2 = jax.random.split(rng)
        sub_batch = self.curvature_batch(k1, batch)
        func_args = self.func.make_args(params, func_state, k2, sub_batch)
        if sub_batch is not batch:
            self.trace(func_args, sub_batch=True)
        # One linearized pass, as in the step, gives the curvature's data and the loss (its value
        # only: the user's value_and_grad_func is not called, nor the loss differentiated).
        lin = self.linearize(func_args)
        view = forward.view_of(lin, self.batch_size_extractor(sub_batch))
        # A batch whose loss is not finite (a NaN example, out-of-range labels whose statistics
        # may still be finite) is invalid: its statistics are dropped too.
        est, skipped = statistics.update_from_view(
            self.estimator, state.estimator_state, view, k1, self.cfg.estimation_mode, 1.0, self.axis,
            valid=statistics.loss_is_finite(lin.loss, self.axis),
        )
        state = dataclasses.replace(
            state, estimator_state=est, curvature_updates_skipped=state.curvature_updates_skipped + skipped
        )
        return parallel.constrain(state, self.state_shardings)

    # --- the step --------------------------------------------------------------------------

    def gradient(self, func_args: Sequence[Any], pj: Any) -> Gradient:
        """Phases 1-2: one linearized forward pass gives the curvature's data and, where proven
        the same (``curvax.gradients``), the loss and the gradient; otherwise those come from
        the user's ``value_and_grad_func``. Averaged over the pmap devices."""
        # The value and gradient from the user's function: this pass needs only the curvature's part.
        lin = self.linearize(func_args, with_loss=self.shares_gradient, with_outputs=self.shares_gradient)
        loss = lin.loss
        if self.shares_gradient:
            value, grads = forward.shared_gradient(lin, pj)
        else:
            value, grads = self.func.value_and_grad_func(*func_args)
            loss = self.func.split_outputs(value)[0]
        _, new_func_state, aux = self.func.split_outputs(value)
        if self.axis is not None:  # multi_device: each device saw its share of the batch
            loss, grads = jax.lax.pmean((loss, grads), self.axis)
        return Gradient(loss, grads, new_func_state, aux, lin)

    def curvature_view(
        self, lin: forward.Linearization, batch: Any, batch_size: Any, make_args: Callable[[Any], tuple], key: jax.Array,
        size_of: Callable[[Any], Any],
    ) -> Callable[[], forward.CurvatureView]:
        """The curvature's view of the step's batch, as a thunk: the step's own pass, or a pass
        on a random sub-batch (``curvature_batch_fraction``), linearized once when every step
        needs it, else inside the conditionals that do."""
        curvature_batch = self.curvature_batch(key, batch)
        if curvature_batch is batch:
            view = forward.view_of(lin, batch_size)
            return lambda: view
        curvature_args = make_args(curvature_batch)
        self.trace(curvature_args, sub_batch=True)
        eager = self.cfg.curvature_update_period == 1 or self.cfg.adaptive_coefficients
        return forward.sub_batch_view(
            lambda: self.linearize(curvature_args, with_outputs=False), size_of(curvature_batch), eager
        )

    def update_curvature(
        self, est_state: Any, step: jax.Array, view: Callable[[], forward.CurvatureView], key: jax.Array,
        identity_weight: Any, valid: jax.Array,
    ) -> tuple[Any, jax.Array]:
        """Phases 2-3: the statistics update (every ``curvature_update_period`` steps), then the
        inverse refresh due at ``step``; returns ``(state, curvature_update_skipped)``.

        ``valid`` False (the step's loss is not finite: a NaN example, out-of-range labels whose
        statistics may still be finite) drops the statistics update as non-finite ones are."""
        cfg = self.cfg

        def update(s: Any) -> tuple[Any, jax.Array]:
            return statistics.update_from_view(
                self.estimator, s, view(), key, cfg.estimation_mode, cfg.curvature_ema, self.axis, valid
            )

        est_state, skipped = statistics.periodic(step, cfg.curvature_update_period, update, est_state)
        exact, approx = self.cache_powers()
        est_state = refresh.refresh(
            self.estimator, est_state, step, cfg.inverse_update_period, identity_weight, exact, approx,
            cfg.inverse_update_staggered, self.distribution, cfg.block_norm,
        )
        return est_state, skipped

    def step(
        self, params: Any, state: OptimizerState, rng: jax.Array, batch: Any, func_state: Any, lr_arg: jax.Array,
        mom_arg: jax.Array, damp_arg: jax.Array, batch_size_override: int | None = None,
    ) -> tuple[Any, OptimizerState, Any, dict[str, Any]]:
        """One step: ``(params, state, func_state, stats)`` (see ``curvax.Optimizer.step``).

        ``batch_size_override`` replaces ``batch_size_extractor`` (the ferminet alpha's static
        ``batch_size``).
        """
        cfg, step = self.cfg, state.step_counter
        size_of = self.batch_size_extractor if batch_size_override is None else (lambda b: batch_size_override)
        batch = self.process(batch)
        batch_size = size_of(batch)
        k_est, k_func = jax.random.split(rng)
        make_args = lambda b: self.func.make_args(params, func_state, k_func, b)
        func_args = make_args(batch)
        pj = self.trace(func_args)
        damp = damping.step_damping(cfg, state.damping, damp_arg, step, state.data_seen)
        precon_damp = damping.precon_damping(cfg, damp, step, state.data_seen)
        identity_weight = damping.identity_weight(cfg, precon_damp)
        g = self.gradient(func_args, pj)
        view = self.curvature_view(g.lin, batch, batch_size, make_args, k_est, size_of)
        est_state, curvature_skipped = self.update_curvature(
            state.estimator_state, step, view, k_est, identity_weight, jnp.isfinite(g.loss)
        )
        # Phase 4: the preconditioned gradient, in the parameters' dtypes.
        precon = precondition.precondition(
            self.estimator, est_state, g.grads, identity_weight, cfg.use_exact_inverses, cfg.inverse_update_period != 1,
            like=params, distribution=self.distribution, block_norm=cfg.block_norm,
        )
        # Phase 5: the coefficients, with the norm constraint on the preconditioned gradient.
        lr = coefficients.schedule_value(cfg.lr_schedule, lr_arg, step, state.data_seen)
        mom = coefficients.schedule_value(cfg.momentum_schedule, mom_arg, step, state.data_seen)
        scaled_sq = None
        if cfg.norm_constraint is not None:
            precon, scaled_sq = precondition.constrain_norm(precon, g.grads, cfg.norm_constraint, scale=lr)
        vectors = (precon, state.velocities)
        damping_due = damping.due(cfg, step)
        kind = "ggn" if cfg.estimation_mode.startswith("ggn") else "fisher"

        def exact_model() -> coefficients.QuadModel:
            v = view()
            return coefficients.exact_quad_model(v.deps_jvp, v.losses, vectors, g.grads, v.batch_size, kind, self.axis)

        coeffs, quad_change = coefficients.choose(
            cfg, lr, mom, damp, exact_model,
            lambda: coefficients.approx_quad_model(self.estimator, est_state, vectors, g.grads), damping_due,
        )
        # The guard: an update is applied only if the loss, gradient and coefficients are finite.
        # A given or scheduled coefficient out of range (traced, so not checked on the host) skips
        # the update as well, and is named in the stats and the log.
        invalid = invalid_coefficients(cfg, lr, mom, damp)
        finite = guard.update_is_finite(precon, g.grads, coeffs, g.loss) & ~jnp.any(jnp.stack(list(invalid.values())))
        coeffs, delta = guard.guarded_update(finite, coeffs, precon, state.velocities)
        new_params = utils.tree_add(params, delta)
        if self.state_shardings is not None:  # several devices: the parameters keep their shardings
            new_params = parallel.constrain(new_params, self.state_shardings.velocities)

        # Phase 6: the damping.
        def new_loss() -> jax.Array:
            args = self.func.make_args(new_params, func_state, k_func, batch)
            nl = self.func.split_outputs(self.func.value(*args))[0]
            return nl if self.axis is None else jax.lax.pmean(nl, self.axis)

        adapted = damping.adapt(cfg, damping_due, new_loss, g.loss, quad_change, damp)
        first_loss, diverged = guard.divergence(state.first_loss, g.loss)
        # multi_device: the batch of the step is every device's share.
        total_batch_size = batch_size if self.axis is None else batch_size * jax.lax.psum(1, self.axis)
        new_state = OptimizerState(
            velocities=delta,
            estimator_state=est_state,
            damping=jnp.asarray(adapted.damping, utils.coefficient_dtype()),
            data_seen=state.data_seen + total_batch_size,
            step_counter=step + 1,
            curvature_updates_skipped=state.curvature_updates_skipped + curvature_skipped,
            updates_skipped=state.updates_skipped + jnp.logical_not(finite),
            first_loss=first_loss,
        )
        new_state = parallel.constrain(new_state, self.state_shardings)
        out = stats.step_stats(stats.StepOutcome(
            step + 1, total_batch_size, new_state.data_seen, g.loss, adapted.new_loss, coeffs, damp, adapted.rho,
            quad_change, jnp.logical_not(finite), new_state.updates_skipped, curvature_skipped,
            new_state.curvature_updates_skipped, diverged, precon_damp,
        ))
        for name in ("learning_rate", "momentum", "damping"):
            out[f"{name}_invalid"] = invalid.get(name, jnp.asarray(False))
        # The parameter norms are those of the parameters this step returns (kfac-jax 0.0.8's).
        self._extra_stats(out, scaled_sq, g.aux, new_params, g.grads, precon, delta)
        return new_params, new_state, g.func_state if self.func.has_state else func_state, out

    def _extra_stats(self, out: dict, scaled_sq: Any, aux: Any, params: Any, grads: Any, precon: Any, delta: Any) -> None:
        """The optional stats: ``scaled_grad_norm_sq``, ``aux`` and the norms, added to ``out``."""
        if scaled_sq is not None:
            out["scaled_grad_norm_sq"] = scaled_sq
        if aux is not None:
            out["aux"] = aux if self.axis is None else jax.lax.pmean(aux, self.axis)
        if self.include_norms:
            out.update(stats.norm_stats(params, grads, precon, delta, per_param=False))
        if self.include_per_param_norms:
            out.update(stats.norm_stats(params, grads, precon, delta, per_param=True))
