"""A catalogue of likely misuse of every public entry point, and what the user gets.

Each case calls one entry point wrongly (shapes, dtypes, empty batch, a value given twice,
a missing loss registration, a call before ``init``, a negative damping, ...) and expects an
error whose message names the argument at fault, raised before anything deep inside JAX.
Cases marked "no error" are misuse that curvax handles (a NaN batch is skipped and
reported, an unused parameter is left alone). In every case the user's arrays are unchanged:
the numpy batch is compared with a copy, and no JAX array was donated (deleted).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import operators

# Errors must come from curvax's own checks, wherever curvax is installed (source or site-packages).
CURVAX_DIR = Path(curvax.__file__).resolve().parent


def _loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["l0"]["w"] + p["l0"]["b"])
    out = h @ p["l1"]["w"] + p["l1"]["b"]
    curvax.register_squared_error_loss(out, y)
    return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


def _loss_without_registration(p, batch):
    x, y = batch
    out = jnp.tanh(x @ p["l0"]["w"] + p["l0"]["b"]) @ p["l1"]["w"] + p["l1"]["b"]
    return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))


def _loss_ignoring_extra(p, batch):
    return _loss({"l0": p["l0"], "l1": p["l1"]}, batch)


class Ctx:
    """What a user holds: parameters (JAX arrays), a numpy batch, and initialised objects."""

    def __init__(self) -> None:
        k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
        self.params = {
            "l0": {"w": jax.random.normal(k1, (3, 5)), "b": jnp.zeros(5)},
            "l1": {"w": jax.random.normal(k2, (5, 2)), "b": jnp.zeros(2)},
        }
        self.batch = (np.asarray(jax.random.normal(k3, (4, 3))), np.asarray(jax.random.normal(k4, (4, 2))))
        self.rng = jax.random.PRNGKey(1)
        self.opt = self.optimizer()
        self.state = self.opt.init(self.params, self.rng, self.batch)
        self.tx = curvax.kfac_preconditioner(_loss, self.batch, damping=1e-2)
        self.tx_state = self.tx.init(self.params)
        self.est = curvax.BlockDiagonalCurvature(_loss)
        self.est_state = self.est.init(self.rng, (self.params, self.batch))

    def optimizer(self, fn: Callable = _loss, **kw: Any) -> curvax.Optimizer:
        args = dict(l2_reg=1e-3, num_burnin_steps=0)
        args.update(kw)
        return curvax.Optimizer(jax.value_and_grad(fn), **args)

    def step(self, **kw: Any) -> Any:
        args = dict(params=self.params, state=self.state, rng=self.rng, batch=self.batch, learning_rate=0.1,
                    momentum=0.0, damping=1e-2)
        args.update(kw)
        return self.opt.step(**args)

    def nan_batch(self):
        x = self.batch[0].copy()
        x[0, 0] = np.nan
        return x, self.batch[1]

    def empty_batch(self):
        return self.batch[0][:0], self.batch[1][:0]

    def cast(self, dtype):
        return jax.tree_util.tree_map(lambda a: a.astype(dtype), self.params)


@pytest.fixture(scope="module")
def ctx() -> Ctx:
    return Ctx()


@dataclasses.dataclass
class Case:
    name: str
    call: Callable[[Ctx], Any]
    error: type[Exception] | None  # None: no error, `check` judges the result
    match: str = ""  # a regex the message must contain: the argument's name
    check: Callable[[Ctx, Any], None] | None = None


def _skipped(ctx: Ctx, out: Any) -> None:
    assert bool(out[-1]["update_skipped"]) and bool(out[-1]["curvature_update_skipped"])
    for a, b in zip(jax.tree_util.tree_leaves(out[0]), jax.tree_util.tree_leaves(ctx.params)):
        np.testing.assert_array_equal(a, b)


def _extra_unchanged(ctx: Ctx, out: Any) -> None:
    new_params, _, stats = out
    assert not bool(stats["update_skipped"])
    np.testing.assert_array_equal(new_params["extra"], np.ones(3))


def _unused(ctx: Ctx) -> Any:
    params = dict(ctx.params, extra=jnp.ones(3))
    opt = ctx.optimizer(_loss_ignoring_extra)
    state = opt.init(params, ctx.rng, ctx.batch)
    return opt.step(params, state, ctx.rng, batch=ctx.batch, learning_rate=0.1, momentum=0.0, damping=1e-2)


def _zero_damping(ctx: Ctx) -> Any:
    opt = ctx.optimizer(l2_reg=0.0)
    state = opt.init(ctx.params, ctx.rng, ctx.batch)
    return opt.step(ctx.params, state, ctx.rng, batch=ctx.batch, learning_rate=0.1, momentum=0.0, damping=0.0)


CASES = [
    # --- Optimizer(...) ------------------------------------------------------------------------
    Case("Optimizer: value_and_grad_func not callable", lambda c: curvax.Optimizer(3.0, l2_reg=0.0),
         TypeError, "`value_and_grad_func`"),
    Case("Optimizer: negative l2_reg", lambda c: c.optimizer(l2_reg=-1.0), ValueError, "`l2_reg`"),
    Case("Optimizer: negative initial_damping",
         lambda c: c.optimizer(use_adaptive_damping=True, initial_damping=-1.0), ValueError, "`initial_damping`"),
    Case("Optimizer: zero min_damping, adaptive damping, zero l2_reg",
         lambda c: c.optimizer(l2_reg=0.0, use_adaptive_damping=True, initial_damping=1.0, min_damping=0.0),
         ValueError, "`min_damping`=0 with l2_reg=0"),
    Case("Optimizer: curvature_ema out of range", lambda c: c.optimizer(curvature_ema=2.0), ValueError, "`curvature_ema`"),
    Case("Optimizer: unknown estimation_mode", lambda c: c.optimizer(estimation_mode="fisher"), ValueError,
         "`estimation_mode`"),
    Case("Optimizer: zero inverse_update_period", lambda c: c.optimizer(inverse_update_period=0), ValueError,
         "`inverse_update_period`"),
    Case("Optimizer: inverse_dtype not a dtype", lambda c: c.optimizer(inverse_dtype="fp32"), ValueError,
         r"`inverse_dtype` must be None.*float32 or float64, got 'fp32'"),
    # --- Optimizer.init ------------------------------------------------------------------------
    Case("init: integer parameters", lambda c: c.optimizer().init(c.cast(jnp.int32), c.rng, c.batch), TypeError,
         r"`params`\['l0'\]\['b'\] has dtype int32.*no gradient"),
    Case("init: complex parameters", lambda c: c.optimizer().init(c.cast(jnp.complex64), c.rng, c.batch), TypeError,
         r"`params`.*complex64.*real symmetric"),
    Case("init: empty batch", lambda c: c.optimizer().init(c.params, c.rng, c.empty_batch()), ValueError,
         r"`batch` is empty"),
    Case("init: batch leaves of different sizes", lambda c: c.optimizer().init(c.params, c.rng, (c.batch[0], c.batch[1][:3])),
         ValueError, r"leaves of `batch` must have the same leading"),
    Case("init: rng is not a key", lambda c: c.optimizer().init(c.params, 0, c.batch), TypeError, "`rng`"),
    Case("init: no loss registered", lambda c: c.optimizer(_loss_without_registration).init(c.params, c.rng, c.batch),
         ValueError, r"No loss is registered.*register_\*_loss"),
    # --- Optimizer.step ------------------------------------------------------------------------
    Case("step before init", lambda c: c.optimizer().step(c.params, c.state, c.rng, batch=c.batch, learning_rate=0.1,
                                                          momentum=0.0, damping=1e-2), RuntimeError, r"init"),
    Case("step: batch and data_iterator both given", lambda c: c.step(data_iterator=iter([c.batch])), ValueError,
         "`data_iterator` and `batch`"),
    Case("step: neither batch nor data_iterator", lambda c: c.step(batch=None), ValueError, "`data_iterator` and `batch`"),
    Case("step: parameters of another shape",
         lambda c: c.step(params=dict(c.params, l1={"w": jnp.zeros((5, 3)), "b": jnp.zeros(3)})), ValueError, "`params`"),
    Case("step: state is not the optimizer's", lambda c: c.step(state=c.tx_state), TypeError, "`state`"),
    Case("step: rng is not a key", lambda c: c.step(rng=np.float32(1.0)), TypeError, "`rng`"),
    Case("step: learning_rate missing", lambda c: c.step(learning_rate=None), ValueError, "`learning_rate=`"),
    Case("step: learning_rate not a scalar", lambda c: c.step(learning_rate=np.ones(3)), ValueError, "`learning_rate`"),
    Case("step: negative damping", lambda c: c.step(damping=-1e-3), ValueError, "`damping`"),
    Case("step: zero damping and zero l2_reg", lambda c: _zero_damping(c), ValueError, "`damping`=0 with l2_reg=0"),
    Case("step: empty batch", lambda c: c.step(batch=c.empty_batch()), ValueError, r"`batch` is empty"),
    Case("step: batch of another example shape", lambda c: c.step(batch=(c.batch[0][:, :2], c.batch[1])), ValueError,
         r"on a batch with leaf shapes \[\(4, 2\), \(4, 2\)\]"),
    Case("step: a NaN example (no error: skipped and reported)", lambda c: c.step(batch=c.nan_batch()), None,
         check=_skipped),
    Case("step: an unused parameter (no error: left unchanged)", _unused, None, check=_extra_unchanged),
    # --- kfac_preconditioner -------------------------------------------------------------------
    Case("kfac_preconditioner: loss_fn not callable", lambda c: curvax.kfac_preconditioner(None, c.batch, damping=1e-2),
         TypeError, "`loss_fn`"),
    Case("kfac_preconditioner: negative damping", lambda c: curvax.kfac_preconditioner(_loss, c.batch, damping=-1.0),
         ValueError, "`damping`"),
    Case("kfac_preconditioner: zero damping and zero l2_reg",
         lambda c: curvax.kfac_preconditioner(_loss, c.batch, damping=0), ValueError, "`damping`=0 with l2_reg=0"),
    Case("kfac_preconditioner: negative l2_reg",
         lambda c: curvax.kfac_preconditioner(_loss, c.batch, damping=1e-2, l2_reg=-1.0), ValueError, "`l2_reg`"),
    Case("kfac_preconditioner: empty example_batch",
         lambda c: curvax.kfac_preconditioner(_loss, c.empty_batch(), damping=1e-2), ValueError, "`example_batch` is empty"),
    Case("kfac_preconditioner: complex parameters", lambda c: c.tx.init(c.cast(jnp.complex64)), TypeError,
         r"`params`.*complex64"),
    Case("kfac_preconditioner: half-precision curvature_dtype",
         lambda c: curvax.kfac_preconditioner(_loss, c.batch, damping=1e-2, curvature_dtype=jnp.bfloat16), ValueError,
         r"`curvature_dtype` must be None.*float32 or float64"),
    Case("kfac_preconditioner: update before init",
         lambda c: curvax.kfac_preconditioner(_loss, c.batch, damping=1e-2).update(c.params, c.tx_state, c.params,
                                                                                  batch=c.batch),
         RuntimeError, r"init\(params\) before update"),
    Case("kfac_preconditioner: update without batch", lambda c: c.tx.update(c.params, c.tx_state, c.params),
         ValueError, r"batch=batch"),
    Case("kfac_preconditioner: update without params", lambda c: c.tx.update(c.params, c.tx_state, batch=c.batch),
         ValueError, "`params`"),
    Case("kfac_preconditioner: updates of another structure",
         lambda c: c.tx.update(c.params["l0"], c.tx_state, c.params, batch=c.batch), ValueError, "`updates`"),
    Case("kfac_preconditioner: batch of another example shape",
         lambda c: c.tx.update(c.params, c.tx_state, c.params, batch=(c.batch[0][:, :2], c.batch[1])), ValueError,
         "`batch` leaf 0"),
    # --- estimators ----------------------------------------------------------------------------
    Case("estimator: func not callable", lambda c: curvax.BlockDiagonalCurvature("loss"), TypeError, "`func`"),
    Case("estimator: unknown estimation mode",
         lambda c: curvax.BlockDiagonalCurvature(_loss, default_estimation_mode="gnn_exact"), ValueError,
         "`default_estimation_mode`"),
    Case("estimator: update with a state that is not its own",
         lambda c: c.est.update_curvature_matrix_estimate(c.tx_state, 0.9, 1.0, 4, c.rng, (c.params, c.batch)),
         ValueError, "`state`"),
    Case("estimator: update with batch_size 0",
         lambda c: c.est.update_curvature_matrix_estimate(c.est_state, 0.9, 1.0, 0, c.rng, (c.params, c.batch)),
         ValueError, "`batch_size`"),
    Case("estimator: func_args of other shapes",
         lambda c: c.est.update_curvature_matrix_estimate(c.est_state, 0.9, 1.0, 4, c.rng,
                                                          (c.params, (c.batch[0][:, :2], c.batch[1]))),
         ValueError, "`func_args`"),
    Case("estimator: multiply before init",
         lambda c: curvax.BlockDiagonalCurvature(_loss).multiply_inverse(c.est_state, c.params, 1.0, False, False),
         RuntimeError, r"call `init`"),
    # --- laplace, operators --------------------------------------------------------------------
    Case("laplace: estimator of the wrong type", lambda c: curvax.laplace.log_determinant(c.opt, c.est_state, 1.0),
         TypeError, "`estimator`"),
    Case("laplace: non-positive identity_weight",
         lambda c: curvax.laplace.marginal_variances(c.est, c.est_state, 0.0), ValueError, "`identity_weight`"),
    Case("laplace: estimator before init",
         lambda c: curvax.laplace.log_determinant(curvax.BlockDiagonalCurvature(_loss), c.est_state, 1.0),
         ValueError, "`estimator` has no blocks"),
    Case("operators.from_estimator: not an estimator", lambda c: operators.from_estimator(c.tx, c.est_state),
         TypeError, "`estimator`"),
    Case("operators.from_estimator: not its state", lambda c: operators.from_estimator(c.est, c.state),
         ValueError, "`state`"),
    # --- register_* losses ---------------------------------------------------------------------
    Case("register_squared_error_loss: targets of another shape",
         lambda c: curvax.register_squared_error_loss(jnp.ones((4, 3)), jnp.ones((4, 2))), ValueError, "`targets`"),
    Case("register_squared_error_loss: integer prediction",
         lambda c: curvax.register_squared_error_loss(jnp.ones((4, 3), jnp.int32), jnp.ones((4, 3))), ValueError,
         "`prediction`"),
    Case("register_softmax_cross_entropy_loss: float labels",
         lambda c: curvax.register_softmax_cross_entropy_loss(jnp.ones((4, 3)), jnp.ones((4,))), ValueError,
         "`targets`"),
    Case("register_softmax_cross_entropy_loss: labels of another batch size",
         lambda c: curvax.register_softmax_cross_entropy_loss(jnp.ones((4, 3)), jnp.ones((5,), jnp.int32)),
         ValueError, "`targets`"),
    Case("register_sigmoid_cross_entropy_loss: targets of another shape",
         lambda c: curvax.register_sigmoid_cross_entropy_loss(jnp.ones((4, 3)), jnp.ones((4, 2))), ValueError,
         "`targets`"),
    Case("register_normal_predictive_distribution: targets of another shape",
         lambda c: curvax.register_normal_predictive_distribution(jnp.ones((4, 3)), jnp.ones((4, 2))), ValueError,
         "`targets`"),
]


def _user_arrays(ctx: Ctx) -> list[Any]:
    return jax.tree_util.tree_leaves((ctx.params, ctx.batch, ctx.state, ctx.tx_state, ctx.est_state))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_misuse_gets_a_clear_error_and_leaves_the_users_arrays_alone(ctx: Ctx, case: Case):
    arrays = _user_arrays(ctx)
    copies = [np.array(a, copy=True) for a in arrays]
    if case.error is None:
        out = case.call(ctx)
        case.check(ctx, out)  # type: ignore[misc]
    else:
        with pytest.raises(case.error, match=case.match) as info:
            case.call(ctx)
        # Raised by curvax's own checks, not deep inside JAX or a LAPACK kernel.
        origin = Path(str(info.traceback[-1].path)).resolve()
        assert CURVAX_DIR in origin.parents, (str(origin), info.value)
    for a, c in zip(arrays, copies):
        assert not (isinstance(a, jax.Array) and a.is_deleted())
        np.testing.assert_array_equal(np.asarray(a), c)
