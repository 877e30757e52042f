"""Dense layers applied at many positions (sequence dims) and tied weights.

Convention: the registered loss of a ``(B, T, ...)`` prediction is summed over
positions per example and averaged over the batch, so the estimated matrix is
the curvature of ``(1/B) sum_n sum_t l(y_nt)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax

pytestmark = pytest.mark.usefixtures("x64")
KEY = jax.random.PRNGKey(0)


def estimate(loss, params, batch, mode="ggn_exact", **kwargs):
    est = curvax.BlockDiagonalCurvature(loss, **kwargs)
    state = est.init(KEY, (params, batch))
    n = batch[0].shape[0]
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, n, KEY, (params, batch), estimation_mode=mode)
    return est, state


def ggn_oracle(per_example_loss, params, batch):
    """(1/B) sum_n J_n^T H_n J_n, the GGN of the batch-mean loss, with dense Jacobians."""
    flat, unravel = ravel_pytree(params)
    x, t = batch
    mats = []
    for n in range(x.shape[0]):
        model = lambda f: per_example_loss.model(unravel(f), x[n])
        z = model(flat)
        jac = jax.jacobian(model)(flat).reshape(z.size, -1)
        hess = jax.hessian(lambda zz: per_example_loss.loss(zz, t[n]))(z).reshape(z.size, z.size)
        mats.append(jac.T @ hess @ jac)
    return sum(mats) / len(mats)


class PerPosition:
    """y_t = W x_t + b at every position, squared error at every position."""

    @staticmethod
    def model(p, x):
        return x @ p["w"] + p["b"]

    @staticmethod
    def loss(y, t):
        return jnp.sum((y - t) ** 2)


class MeanPooled:
    """z = mean_t (W x_t + b), softmax cross-entropy on z."""

    @staticmethod
    def model(p, x):
        return jnp.mean(x @ p["w"] + p["b"], axis=-2)

    @staticmethod
    def loss(z, t):
        return -jax.nn.log_softmax(z)[t]


def problem(kind, batch, seq=4, d_in=3, d_out=2, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    params = {"b": jax.random.normal(ks[0], (d_out,)), "w": jax.random.normal(ks[1], (d_in, d_out))}
    x = jax.random.normal(ks[2], (batch, seq, d_in))
    if kind is PerPosition:
        t = jax.random.normal(ks[3], (batch, seq, d_out))

        def loss(p, b):
            y = PerPosition.model(p, b[0])
            curvax.register_squared_error_loss(y, b[1])
            return jnp.sum((y - b[1]) ** 2) / b[0].shape[0]
    else:
        t = jax.random.randint(ks[3], (batch,), 0, d_out)

        def loss(p, b):
            z = MeanPooled.model(p, b[0])
            curvax.register_softmax_cross_entropy_loss(z, b[1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), b[1][:, None], axis=1))

    return loss, params, (x, t)


@pytest.mark.parametrize("batch", [1, 3])
def test_kfac_expand_is_exact_for_a_per_position_loss(batch):
    """With a linear layer shared over positions and a per-position squared error,
    A (x) G from KFAC-expand equals the exact GGN block for any batch size."""
    loss, params, data = problem(PerPosition, batch)
    est, state = estimate(loss, params, data)
    assert [type(b).__name__ for b in est.blocks] == ["RepeatedDenseKroneckerFactored"]  # KFAC-expand, padding masked
    np.testing.assert_allclose(est.to_dense_matrix(state), ggn_oracle(PerPosition, params, data), rtol=1e-8, atol=1e-10)


def test_kfac_expand_is_not_exact_after_mean_pooling():
    """The case KFAC-reduce exists for: expand's factors disagree with the exact block."""
    loss, params, data = problem(MeanPooled, 1)
    est, state = estimate(loss, params, data)
    diff = np.abs(est.to_dense_matrix(state) - ggn_oracle(MeanPooled, params, data)).max()
    assert diff > 1e-3


def tied_problem(batch=3, seed=1):
    """h = tanh(x W + b); out = (h W + b) V: W and b tied across two dense products."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    d = 3
    params = {
        "b": 0.1 * jax.random.normal(ks[0], (d,)),
        "v": jax.random.normal(ks[1], (d, 2)),
        "w": jax.random.normal(ks[2], (d, d)) / np.sqrt(d),
    }
    x = jax.random.normal(ks[3], (batch, d))
    t = jax.random.normal(ks[4], (batch, 2))

    def model(p, xx):
        h = jnp.tanh(xx @ p["w"] + p["b"])
        return (h @ p["w"] + p["b"]) @ p["v"]

    def loss(p, b):
        y = model(p, b[0])
        curvax.register_squared_error_loss(y, b[1])
        return jnp.sum((y - b[1]) ** 2) / b[0].shape[0]

    return model, loss, params, (x, t)


def test_tied_dense_weights_form_one_kronecker_layer():
    model, loss, params, data = tied_problem()
    pj = curvax.ProcessedJaxpr.make_from_func(loss, (params, data))
    sites = {s.param_indices: s for s in pj.layer_sites}
    tied = sites[(2, 0)]  # w (index 2) with its bias b (index 0)
    assert tied.tag.name == "dense" and len(tied.uses) == 2
    assert sites[(1,)].pattern == "dense_no_bias"
    assert any("tied" in n for n in pj.notes)
    assert "generic fallback" not in pj.registration_table(params)


def test_tied_dense_statistics_pool_both_uses():
    """A and G equal their definitions with the two uses stacked as positions, and the
    per-example gradients seen by the block sum over both uses (DenseFull == exact
    empirical Fisher block of the tied parameters)."""
    model, loss, params, data = tied_problem()
    x, t = data
    est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor={"dense": curvax.DenseFull})
    state = est.init(KEY, (params, data))
    state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, x.shape[0], KEY, (params, data), estimation_mode="fisher_empirical")
    j = [b.parameters_shapes for b in est.blocks].index(((3, 3), (3,)))
    got = est.blocks[j].to_dense_matrix(state.blocks_states[j])

    def per_example(n):
        g = jax.grad(lambda p: jnp.sum((model(p, x[n : n + 1]) - t[n : n + 1]) ** 2))(params)
        return jnp.concatenate([g["w"].ravel(), g["b"]])

    grads = jnp.stack([per_example(n) for n in range(x.shape[0])])
    want = grads.T @ grads / x.shape[0]
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)


def test_optimizer_trains_a_model_with_tied_weights():
    """On targets from a teacher of the same (tied) architecture, the loss falls 10x in 10 steps."""
    model, loss, params, data = tied_problem(batch=16)
    _, _, teacher, _ = tied_problem(seed=7)
    data = (data[0], model(teacher, data[0]))
    opt = curvax.Optimizer(
        value_and_grad_func=jax.value_and_grad(loss), l2_reg=0.0, use_adaptive_learning_rate=True,
        use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1.0, num_burnin_steps=0,
    )
    state = opt.init(params, KEY, data)
    first = None
    for _ in range(10):
        params, state, stats = opt.step(params, state, KEY, batch=data, global_step_int=None)
        first = float(stats["loss"]) if first is None else first
    assert float(stats["loss"]) < 0.1 * first


def test_kfac_reduce_is_exact_after_mean_pooling():
    loss, params, data = problem(MeanPooled, 1)
    est, state = estimate(loss, params, data, layer_tag_to_block_ctor={"dense": curvax.DenseTwoKroneckerFactoredReduce})
    np.testing.assert_allclose(est.to_dense_matrix(state), ggn_oracle(MeanPooled, params, data), rtol=1e-8, atol=1e-10)


def test_kfac_reduce_factors_match_their_definition():
    """A = mean_n xbar xbar^T (bias-augmented), G = (1/B) sum_n s_n s_n^T with s_n = sum_t dy_nt."""
    loss, params, data = problem(PerPosition, 3)
    x, t = data
    est, state = estimate(loss, params, data, "fisher_empirical",
                          layer_tag_to_block_ctor={"dense": curvax.DenseTwoKroneckerFactoredReduce})
    st = state.blocks_states[0]
    xbar = jnp.concatenate([x.mean(1), jnp.ones((3, 1))], axis=1)
    np.testing.assert_allclose(st.inputs_factor.value, xbar.T @ xbar / 3, rtol=1e-10)
    # Empirical Fisher cotangent of (1/B) sum ||y - t||^2 w.r.t. the outputs is 2 (y - t) (sqrt-scaled per example).
    y = PerPosition.model(params, x)
    s = jax.vmap(lambda yy, tt: jax.grad(lambda z: PerPosition.loss(z, tt))(yy).sum(0))(y, t)
    np.testing.assert_allclose(st.outputs_factor.value, s.T @ s / 3, rtol=1e-8)
