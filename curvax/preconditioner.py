"""K-FAC as an Optax gradient transformation.

``kfac_preconditioner`` maps gradients ``g`` to ``(C + (damping + l2_reg) I)^{-1} g``, where ``C``
is the block-diagonal curvature (K-FAC blocks for the detected layers) estimated from the batch
passed to ``update``. Optax supplies the rest of the update: learning rate, momentum, clipping,
weight decay. ``optax.chain(kfac_preconditioner(...), optax.sgd(lr, momentum=m))`` takes the
same steps as ``curvax.Optimizer`` with that fixed learning rate, momentum and damping
(``tests/test_preconditioner.py``). The optimizer's adaptive learning rate, momentum and damping
need the loss at the new parameters and exact curvature products, which a gradient
transformation does not see: use ``curvax.Optimizer`` for those.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

from curvax import estimators, utils


class KFACPreconditionerState(NamedTuple):
    """``count``: updates so far; ``rng_key``: for the sampled curvature; ``estimator_state``: the blocks."""

    count: jax.Array
    rng_key: jax.Array
    estimator_state: Any


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
) -> optax.GradientTransformationExtraArgs:
    """K-FAC preconditioning of the incoming updates (gradients), as an Optax transformation.

    Args:
      loss_fn: ``loss_fn(params, batch)``, which registers its loss (``register_*_loss``);
        its layers are found as by ``curvax.Optimizer``. Only the registrations matter: the
        returned value may be anything.
      example_batch: a batch of the shapes ``update`` will see, for ``init`` to trace the model.
      damping: added, with ``l2_reg``, to the curvature before inverting it; a float or a
        schedule ``count -> damping``.
      l2_reg, curvature_ema, inverse_update_period, estimation_mode, layer_tag_to_block_ctor,
        batch_size_extractor: as for ``curvax.Optimizer``.
      seed: the first key of the random cotangents of ``fisher_gradients``; ``update`` may
        also be given ``rng=`` instead.

    ``update(updates, state, params, *, batch, rng=None)`` needs the parameters and the batch
    (Optax passes extra keyword arguments through ``optax.chain``). It updates the curvature
    statistics on ``batch``, refreshes the damped inverses every ``inverse_update_period``
    updates (starting with the first) and returns the preconditioned updates. A non-finite
    result (an ill-conditioned curvature with tiny damping) becomes a zero update.
    """
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}.")
    if not callable(damping):
        utils.check_number(damping, "damping", 0.0)
    utils.check_number(l2_reg, "l2_reg", 0.0)
    utils.check_number(curvature_ema, "curvature_ema", 0.0, 1.0)
    period = utils.check_int(inverse_update_period, "inverse_update_period", 1)
    mode = estimators.check_estimation_mode(estimation_mode)
    utils.check_batch_leading_sizes(example_batch)
    estimator = estimators.BlockDiagonalCurvature(
        loss_fn, params_index=0, default_estimation_mode=mode, layer_tag_to_block_ctor=layer_tag_to_block_ctor
    )

    def damping_at(count: jax.Array) -> jax.Array:
        value = damping(count) if callable(damping) else damping
        return jnp.asarray(value, jnp.float32)

    init_spec: list[Any] = []  # the parameters' structure, shapes and dtypes at the first init

    def check_params(params: Any, where: str) -> None:
        spec = utils.tree_spec(params)
        if init_spec and spec != init_spec[0]:
            raise ValueError(
                f"`params` passed to {where} differ in structure, shapes or dtypes from those of the first init "
                f"(the transformation traced the model for those):\nfirst init: {init_spec[0]}\n{where}: {spec}"
            )
        init_spec[:] = [spec]

    def init_fn(params: Any) -> KFACPreconditionerState:
        check_params(params, "init")
        func_args = (params, example_batch)
        estimator.finalize(func_args)
        key = jax.random.PRNGKey(seed)
        est_state = estimator.init(key, func_args, None, -1, False)
        return KFACPreconditionerState(jnp.zeros([], jnp.int32), key, est_state)

    def update_fn(
        updates: Any, state: KFACPreconditionerState, params: Any = None, *, batch: Any = None,
        rng: jax.Array | None = None, **extra_args: Any,
    ) -> tuple[Any, KFACPreconditionerState]:
        del extra_args  # meant for other transformations of a chain
        if params is None:
            raise ValueError("kfac_preconditioner's update needs `params`: tx.update(grads, state, params, batch=batch).")
        if batch is None:
            raise ValueError(
                "kfac_preconditioner's update needs the batch the gradients came from: "
                "tx.update(grads, state, params, batch=batch)."
            )
        if not isinstance(state, KFACPreconditionerState):
            raise TypeError(f"`state` must be the KFACPreconditionerState from init, got {type(state).__name__}.")
        if not init_spec:
            raise RuntimeError("Call the transformation's init(params) before update.")
        check_params(params, "update")
        if jax.tree_util.tree_structure(updates) != jax.tree_util.tree_structure(params):
            raise ValueError(
                "`updates` and `params` differ in structure: "
                f"{jax.tree_util.tree_structure(updates)} vs {jax.tree_util.tree_structure(params)}."
            )
        utils.check_batch_leading_sizes(batch)
        key = state.rng_key
        if rng is None:
            key, rng = jax.random.split(key)
        func_args = (params, batch)
        est_state = estimator.update_curvature_matrix_estimate(
            state.estimator_state, curvature_ema, 1.0, batch_size_extractor(batch), rng, func_args
        )
        identity_weight = l2_reg + damping_at(state.count)
        est_state = jax.lax.cond(
            state.count % period == 0,
            lambda s: estimator.update_cache(s, identity_weight, None, -1, False),
            lambda s: s,
            est_state,
        )
        precon = estimator.multiply_matpower(est_state, updates, identity_weight, -1, False, True)
        precon = jax.tree_util.tree_map(lambda v, u: v.astype(jnp.result_type(u)), precon, updates)
        finite = jnp.isfinite(utils.inner_product(precon, updates))
        precon = jax.tree_util.tree_map(lambda v: jnp.where(finite, v, jnp.zeros_like(v)), precon)
        return precon, KFACPreconditionerState(state.count + 1, key, est_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
