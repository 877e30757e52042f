"""Layers inside ``lax.scan`` (stacked layers, RNN cells) and inside ``jax.checkpoint``.

A scan over stacked parameters is the same model as a Python loop over the
slices, and a scan over a shared cell is the same model as the unrolled loop with
tied weights; curvax must estimate the same curvature for both (each slice its own
block; the steps of a shared cell pooled like positions). The stacked blocks are
also checked against the exact GGN built with ``jax.jacobian``/``jax.hessian``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import curvax
import models

pytestmark = pytest.mark.usefixtures("x64")
KEY = jax.random.PRNGKey(0)
L, D, B, OUT = 3, 4, 5, 2


def stacked_params(key=KEY):
    k = jax.random.split(key, 3)
    return {
        "w": jax.random.normal(k[0], (L, D, D)) / 2,
        "b": jax.random.normal(k[1], (L, D)) * 0.1,
        "out": jax.random.normal(k[2], (D, OUT)),
    }


def stacked_model(p, x, reverse=False):
    def body(h, wb):
        w, b = wb
        return jnp.tanh(h @ w + b), None

    h, _ = jax.lax.scan(body, x, (p["w"], p["b"]), reverse=reverse)
    return h @ p["out"]


def looped_model(p, x, reverse=False):
    h = x
    for l in (reversed(range(L)) if reverse else range(L)):
        h = jnp.tanh(h @ p["w"][l] + p["b"][l])
    return h @ p["out"]


def unstack(p):
    """The stacked parameters as a list of per-layer dicts (for the Python-loop model)."""
    return {"layers": [{"w": p["w"][l], "b": p["b"][l]} for l in range(L)], "out": p["out"]}


def listed_model(q, x, reverse=False):
    h = x
    for l in (reversed(range(L)) if reverse else range(L)):
        h = jnp.tanh(h @ q["layers"][l]["w"] + q["layers"][l]["b"])
    return h @ q["out"]


def make_loss(model):
    def loss(p, batch):
        x, t = batch
        y = model(p, x)
        curvax.register_squared_error_loss(y, t)
        return 0.5 * jnp.mean(jnp.sum((y - t) ** 2, -1))

    return loss


def batch(n=B, key=jax.random.PRNGKey(7)):
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, (n, D)), jax.random.normal(k2, (n, OUT))


def estimate(loss, params, data, mode="ggn_exact", **kwargs):
    est = curvax.BlockDiagonalCurvature(loss, **kwargs)
    state = est.init(KEY, (params, data))
    state = est.update_curvature_matrix_estimate(
        state, 0.0, 1.0, data[0].shape[0], jax.random.PRNGKey(3), (params, data), estimation_mode=mode
    )
    return est, state


# --- detection ------------------------------------------------------------------------


def test_stacked_scan_is_one_stacked_dense_layer():
    p = stacked_params()
    est, _ = estimate(make_loss(stacked_model), p, batch())
    sites = est.processed_jaxpr.layer_sites
    scanned = [s for s in sites if s.scan is not None]
    assert len(scanned) == 1 and scanned[0].scan.mode == "stacked" and scanned[0].scan.length == L
    assert scanned[0].tag.name == "dense"
    names = [type(b).__name__ for b in est.blocks]
    assert names.count("StackedBlock") == 1 and "generic" not in " ".join(s.name for s in sites)
    table = est.processed_jaxpr.registration_table(p, names)
    assert "@scan[stacked x3]" in table and "generic fallback" not in table


# --- stacked layers: the same curvature as the Python loop ------------------------------


@pytest.mark.parametrize(
    "mode, reverse",
    [("ggn_exact", False), ("fisher_exact", False), ("fisher_gradients", False), ("fisher_empirical", False),
     ("ggn_exact", True), ("fisher_gradients", True)],
)
def test_stacked_scan_equals_python_loop(mode, reverse):
    _check_scan_equals_loop(mode, reverse)


@pytest.mark.parametrize("block", ["DenseEigenvalueCorrected", "DenseTNT", "DenseDiagonal", "DenseFull"])
def test_stacked_scan_equals_python_loop_for_every_dense_block(block):
    _check_scan_equals_loop("ggn_exact", False, layer_tag_to_block_ctor={"dense": getattr(curvax, block)})


def _check_scan_equals_loop(mode, reverse, **kwargs):
    p = stacked_params()
    data = batch()
    scan_loss = make_loss(lambda q, x: stacked_model(q, x, reverse))
    loop_loss = make_loss(lambda q, x: listed_model(q, x, reverse))
    est_s, st_s = estimate(scan_loss, p, data, mode, **kwargs)
    est_l, st_l = estimate(loop_loss, unstack(p), data, mode, **kwargs)
    dense_s = est_s.to_dense_matrix(st_s)
    dense_l = est_l.to_dense_matrix(st_l)
    # Map the listed model's flat order onto the stacked model's flat order.
    perm = models.loop_order(p, unstack(p))
    np.testing.assert_allclose(dense_s, dense_l[np.ix_(perm, perm)], rtol=1e-10, atol=1e-12)
    assert np.abs(dense_s).max() > 1e-3


def test_stacked_blocks_equal_exact_ggn_for_one_example():
    """K-FAC is exact for a dense layer and one example: each slice's block is its exact GGN block."""
    p = stacked_params()
    x, t = batch(1)
    est, st = estimate(make_loss(stacked_model), p, (x, t), "ggn_exact")
    dense = np.asarray(est.to_dense_matrix(st))
    flat, unravel = ravel_pytree(p)
    f = lambda v: stacked_model(unravel(v), x)[0]
    jac = jax.jacobian(f)(flat)
    ggn = np.asarray(2.0 * jac.T @ jac)  # the registered squared error is |y - t|^2 (Gaussian, variance 1/2)
    pos = models.flat_positions(p)
    for l in range(L):
        idx = np.concatenate([pos["['w']"][l * D * D : (l + 1) * D * D], pos["['b']"][l * D : (l + 1) * D]])
        np.testing.assert_allclose(dense[np.ix_(idx, idx)], ggn[np.ix_(idx, idx)], rtol=1e-9, atol=1e-12)
    # Different slices are different blocks.
    w0, w1 = pos["['w']"][: D * D], pos["['w']"][D * D : 2 * D * D]
    assert np.all(dense[np.ix_(w0, w1)] == 0) and np.abs(ggn[np.ix_(w0, w1)]).max() > 1e-6


def test_stacked_block_products_match_its_dense_matrix():
    p = stacked_params()
    est, st = estimate(make_loss(stacked_model), p, batch())
    (j,) = [i for i, b in enumerate(est.blocks) if type(b).__name__ == "StackedBlock"]
    block, bst = est.blocks[j], st.blocks_states[j]
    bst = block.update_cache(bst, 0.5, exact_powers=-1, approx_powers=(), eigenvalues=True)
    dense = np.asarray(block.to_dense_matrix(bst))
    v = tuple(jax.random.normal(jax.random.PRNGKey(i), s) for i, s in enumerate(block.parameters_shapes))
    vflat = np.concatenate([np.ravel(a) for a in v])
    for power in (1, -1):
        got = block.multiply_matpower(bst, v, 0.5, power, exact_power=True, use_cached=False)
        want = np.linalg.matrix_power(dense + 0.5 * np.eye(len(dense)), power) @ vflat
        np.testing.assert_allclose(np.concatenate([np.ravel(a) for a in got]), want, rtol=1e-8)
    np.testing.assert_allclose(
        np.sort(np.asarray(block.eigenvalues(bst, use_cached=False))), np.linalg.eigvalsh(dense), atol=1e-9
    )


def test_optimizer_on_stacked_scan_follows_the_python_loop():
    p = stacked_params()
    data = batch(8)
    kwargs = dict(
        use_adaptive_learning_rate=True, use_adaptive_momentum=True, use_adaptive_damping=True,
        initial_damping=1.0, multi_device=False, estimation_mode="ggn_curvature_prop",
    )
    results = []
    for loss, params in ((make_loss(stacked_model), p), (make_loss(listed_model), unstack(p))):
        opt = curvax.Optimizer(jax.value_and_grad(loss), l2_reg=0.0, value_func_has_aux=False, **kwargs)
        state = opt.init(params, jax.random.PRNGKey(1), data)
        losses = []
        for i in range(4):
            params, state, stats = opt.step(params, state, jax.random.PRNGKey(10 + i), batch=data, global_step_int=i)
            losses.append(float(stats["loss"]))
        results.append((params, losses))
    (ps, ls), (pl, ll) = results
    np.testing.assert_allclose(ls, ll, rtol=1e-8)
    np.testing.assert_allclose(ps["w"], np.stack([q["w"] for q in pl["layers"]]), rtol=1e-7, atol=1e-10)
    assert ls[-1] < 0.5 * ls[0]


# --- a shared cell (RNN): the steps are positions of one layer ----------------------------


T = 4


def rnn_params(key=KEY):
    k = jax.random.split(key, 4)
    return {
        "w": jax.random.normal(k[0], (D, D)) / 2,
        "u": jax.random.normal(k[1], (D, D)) / 2,
        "b": jax.random.normal(k[2], (D,)) * 0.1,
        "out": jax.random.normal(k[3], (D, OUT)),
    }


def rnn_scan(p, xs):  # xs: (B, T, D)
    def cell(h, x):
        return jnp.tanh((x @ p["u"] + p["b"]) + h @ p["w"]), None

    h, _ = jax.lax.scan(cell, jnp.zeros((xs.shape[0], D)), jnp.swapaxes(xs, 0, 1))
    return h @ p["out"]


def rnn_unrolled(p, xs):
    h = jnp.zeros((xs.shape[0], D))
    for t in range(T):
        h = jnp.tanh((xs[:, t] @ p["u"] + p["b"]) + h @ p["w"])
    return h @ p["out"]


@pytest.mark.parametrize("mode", ["ggn_exact", "fisher_gradients"])
def test_rnn_scan_equals_unrolled_tied_weights(mode):
    p = rnn_params()
    xs = jax.random.normal(jax.random.PRNGKey(5), (B, T, D))
    t = jax.random.normal(jax.random.PRNGKey(6), (B, OUT))
    est_s, st_s = estimate(make_loss(rnn_scan), p, (xs, t), mode)
    est_u, st_u = estimate(make_loss(rnn_unrolled), p, (xs, t), mode)
    shared = [s for s in est_s.processed_jaxpr.layer_sites if s.scan is not None]
    assert {s.scan.mode for s in shared} == {"shared"} and len(shared) == 2
    assert all(s.pattern != "generic" for s in est_u.processed_jaxpr.layer_sites)
    np.testing.assert_allclose(est_s.to_dense_matrix(st_s), est_u.to_dense_matrix(st_u), rtol=1e-10, atol=1e-12)


# --- robustness ---------------------------------------------------------------------------


def test_parameter_used_inside_and_outside_a_scan_is_generic_and_reported():
    p = stacked_params()

    def model(q, x):
        return stacked_model(q, x) + jnp.sum(q["b"])  # b is also used outside the scan

    est, _ = estimate(make_loss(model), p, batch())
    table = est.processed_jaxpr.registration_table(p)
    by_name = {tuple(s.param_indices): s for s in est.processed_jaxpr.layer_sites}
    assert all(s.scan is None for s in by_name.values())
    assert "generic fallback" in table


def test_scan_over_a_cast_parameter_falls_back_with_a_reason():
    p = stacked_params()

    def model(q, x):
        return stacked_model({**q, "w": q["w"].astype(jnp.float32).astype(jnp.float64)}, x)

    est, _ = estimate(make_loss(model), p, batch())
    table = est.processed_jaxpr.registration_table(p)
    assert "lax.scan" in table and "generic fallback" in table


# --- jax.checkpoint -----------------------------------------------------------------------


def test_layers_inside_checkpoint_are_detected_like_without():
    p = unstack(stacked_params())
    data = batch()

    def remat_model(q, x):
        layer = jax.checkpoint(lambda h, w, b: jnp.tanh(h @ w + b))
        h = x
        for l in range(L):
            h = layer(h, q["layers"][l]["w"], q["layers"][l]["b"])
        return h @ q["out"]

    est_r, st_r = estimate(make_loss(remat_model), p, data)
    est_p, st_p = estimate(make_loss(listed_model), p, data)
    assert [s.name for s in est_r.processed_jaxpr.layer_sites] == [s.name for s in est_p.processed_jaxpr.layer_sites]
    assert all(s.pattern != "generic" for s in est_r.processed_jaxpr.layer_sites)
    np.testing.assert_allclose(est_r.to_dense_matrix(st_r), est_p.to_dense_matrix(st_p), rtol=1e-12)


def test_checkpointed_body_inside_a_scan():
    p = stacked_params()
    data = batch()

    def model(q, x):
        step = jax.checkpoint(lambda h, wb: (jnp.tanh(h @ wb[0] + wb[1]), None))
        h, _ = jax.lax.scan(step, x, (q["w"], q["b"]))
        return h @ q["out"]

    est_c, st_c = estimate(make_loss(model), p, data)
    est_s, st_s = estimate(make_loss(stacked_model), p, data)
    assert [type(b).__name__ for b in est_c.blocks] == [type(b).__name__ for b in est_s.blocks]
    np.testing.assert_allclose(est_c.to_dense_matrix(st_c), est_s.to_dense_matrix(st_s), rtol=1e-12)


# --- a stacked transformer: every layer kind inside the scan -------------------------------

V, TT, DM, H = 7, 4, 6, 8  # vocabulary, tokens, width, MLP hidden


@pytest.mark.slow  # ~50 s on 2 cores; the stacked MLP and conv tests cover the same machinery by default
def test_stacked_transformer_registers_every_layer_and_matches_the_loop():
    p = models.transformer_params(KEY, L, DM, H, V)
    ids = jax.random.randint(jax.random.PRNGKey(4), (3, TT + 1), 0, V)
    data = (ids[:, :-1], ids[:, 1:])
    est_s, st_s = estimate(models.xent_loss(models.transformer_scan), p, data, "fisher_gradients")
    sites = est_s.processed_jaxpr.layer_sites
    scanned = sorted((s.tag.name, s.pattern) for s in sites if s.scan is not None)
    assert scanned == sorted([("dense", "dense_with_bias")] * 6 + [("scale_and_shift", "scale_and_shift_both")])
    assert all(s.scan.mode == "stacked" for s in sites if s.scan is not None)
    assert not any(s.pattern == "generic" for s in sites)
    listed = models.unstack_transformer(p)
    est_l, st_l = estimate(models.xent_loss(models.transformer_loop), listed, data, "fisher_gradients")
    perm = models.loop_order(p, listed, "stack")
    dense_s, dense_l = est_s.to_dense_matrix(st_s), est_l.to_dense_matrix(st_l)
    np.testing.assert_allclose(dense_s, dense_l[np.ix_(perm, perm)], rtol=1e-9, atol=1e-12)


# --- frameworks: their own scanned-layer idioms ------------------------------------------


def _fw_stacked_mlp(framework):
    """``(apply(params, x), params)``: L tanh-dense layers scanned with the framework's idiom, then a head."""
    x = jnp.ones((2, D))
    if framework == "equinox":
        eqx = pytest.importorskip("equinox")

        class EqxLayer(eqx.Module):
            lin: Any

            def __init__(self, key):
                self.lin = eqx.nn.Linear(D, D, key=key)

        class Net(eqx.Module):
            layers: Any
            out: Any

            def __init__(self, key):
                k1, k2 = jax.random.split(key)
                self.layers = eqx.filter_vmap(EqxLayer)(jax.random.split(k1, L))
                self.out = eqx.nn.Linear(D, OUT, key=k2)

            def __call__(self, x):
                dyn, static = eqx.partition(self.layers, eqx.is_array)
                h, _ = jax.lax.scan(lambda h, d: (jnp.tanh(eqx.combine(d, static).lin(h)), None), x, dyn)
                return self.out(h)

        params, static = eqx.partition(Net(KEY), eqx.is_inexact_array)
        return (lambda p, xb: jax.vmap(eqx.combine(p, static))(xb)), params
    if framework == "flax_linen":
        nn = pytest.importorskip("flax.linen")

        class LinenLayer(nn.Module):
            @nn.compact
            def __call__(self, h, _):
                return jnp.tanh(nn.Dense(D)(h)), None

        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                stack = nn.scan(nn.remat(LinenLayer), variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
                return nn.Dense(OUT)(stack()(x, None)[0])

        m = Net()
        return m.apply, m.init(KEY, x)
    if framework == "flax_nnx":
        nnx = pytest.importorskip("flax.nnx")

        class NnxLayer(nnx.Module):
            def __init__(self, rngs):
                self.lin = nnx.Linear(D, D, rngs=rngs)

        class Net(nnx.Module):
            def __init__(self, rngs):
                @nnx.split_rngs(splits=L)
                @nnx.vmap(in_axes=(0,), out_axes=0)
                def make(rngs):
                    return NnxLayer(rngs)

                self.layers = make(rngs)
                self.out = nnx.Linear(D, OUT, rngs=rngs)

            def __call__(self, x):
                @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
                def run(h, layer):
                    return jnp.tanh(layer.lin(h))

                return self.out(run(x, self.layers))

        graphdef, params = nnx.split(Net(nnx.Rngs(0)), nnx.Param)
        return (lambda p, xb: nnx.merge(graphdef, p)(xb)), params
    if framework == "haiku":
        hk = pytest.importorskip("haiku")

        def net(x):
            @hk.experimental.layer_stack(L)
            def stack(h):
                return jnp.tanh(hk.Linear(D)(h))

            return hk.Linear(OUT)(stack(x))

        m = hk.without_apply_rng(hk.transform(net))
        return m.apply, m.init(KEY, x)
    raise ValueError(framework)


@pytest.mark.parametrize("framework", ["equinox", "flax_linen", "flax_nnx", "haiku"])
def test_framework_scanned_layers_get_stacked_blocks_and_train(framework):
    apply, params = _fw_stacked_mlp(framework)
    data = batch(8)
    loss = make_loss(apply)
    est = curvax.BlockDiagonalCurvature(loss)
    est.init(KEY, (params, data))
    sites = est.processed_jaxpr.layer_sites
    stacked = [s for s in sites if s.scan is not None]
    assert len(stacked) == 1 and stacked[0].scan.mode == "stacked" and len(stacked[0].param_indices) == 2
    assert [type(b).__name__ for b in est.blocks].count("StackedBlock") == 1
    assert not any(s.pattern == "generic" for s in sites)
    opt = curvax.Optimizer(
        jax.value_and_grad(loss), l2_reg=0.0, value_func_has_aux=False, use_adaptive_learning_rate=True,
        use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1.0, multi_device=False,
    )
    state = opt.init(params, jax.random.PRNGKey(1), data)
    losses = []
    for i in range(5):
        params, state, stats = opt.step(params, state, jax.random.PRNGKey(i), batch=data)
        losses.append(float(stats["loss"]))
    assert np.all(np.isfinite(losses)) and np.all(np.diff(losses) < 0) and losses[-1] < 0.8 * losses[0]


# --- convolutions in a scan -----------------------------------------------------------------


def _conv(h, w, b):
    return jax.lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + b


def _conv_data():
    k = jax.random.split(jax.random.PRNGKey(11), 5)
    p = {"w": jax.random.normal(k[0], (2, 3, 3, 2, 2)) / 3, "b": jax.random.normal(k[1], (2, 2)) * 0.1,
         "out": jax.random.normal(k[2], (5 * 5 * 2, OUT)) / 5}
    return p, (jax.random.normal(k[3], (3, 5, 5, 2)), jax.random.normal(k[4], (3, OUT)))


def test_stacked_convolution_slices_equal_per_layer_blocks():
    p, data = _conv_data()

    def scan_model(q, x):
        h, _ = jax.lax.scan(lambda h, wb: (jnp.tanh(_conv(h, *wb)), None), x, (q["w"], q["b"]))
        return h.reshape(h.shape[0], -1) @ q["out"]

    est_s, st_s = estimate(make_loss(scan_model), p, data)
    scanned = [s for s in est_s.processed_jaxpr.layer_sites if s.scan is not None]
    assert [s.tag.name for s in scanned] == ["conv2d"] and scanned[0].scan.mode == "stacked"
    # Each slice's block equals the block of the same layer in a model with one parameter per layer.
    listed = {"layers": [{"w": p["w"][l], "b": p["b"][l]} for l in range(2)], "out": p["out"]}

    def listed_model(q, x):
        h = x
        for lay in q["layers"]:
            h = jnp.tanh(_conv(h, lay["w"], lay["b"]))
        return h.reshape(h.shape[0], -1) @ q["out"]

    est_l, st_l = estimate(make_loss(listed_model), listed, data)
    (j,) = [i for i, s in enumerate(est_s.processed_jaxpr.layer_sites) if s.scan is not None]
    dense_s = np.asarray(est_s.blocks[j].to_dense_matrix(st_s.blocks_states[j]))
    n = dense_s.shape[0] // 2
    conv_blocks = [i for i, s in enumerate(est_l.processed_jaxpr.layer_sites) if s.tag.name == "conv2d"]
    assert len(conv_blocks) == 2
    for l, i in enumerate(conv_blocks):
        want = np.asarray(est_l.blocks[i].to_dense_matrix(st_l.blocks_states[i]))
        # stacked layout: all w slices, then all b slices
        w_size = 3 * 3 * 2 * 2
        idx = np.concatenate([l * w_size + np.arange(w_size), 2 * w_size + l * 2 + np.arange(2)])
        np.testing.assert_allclose(dense_s[np.ix_(idx, idx)], want, rtol=1e-9, atol=1e-12)
    assert n == 3 * 3 * 2 * 2 + 2


def test_shared_convolution_in_a_scan_is_generic_with_a_reason():
    p, data = _conv_data()
    p = {**p, "w": p["w"][0], "b": p["b"][0]}

    def model(q, x):
        h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(_conv(h, q["w"], q["b"])), None), x, None, length=2)
        return h.reshape(h.shape[0], -1) @ q["out"]

    est, _ = estimate(make_loss(model), p, data)
    table = est.processed_jaxpr.registration_table(p)
    line = next(line for line in table.splitlines() if line.strip().startswith("w"))
    assert "generic fallback" in line and "lax.scan" in line


@pytest.mark.parametrize("cell", ["SimpleCell", "LSTMCell", "GRUCell"])
def test_flax_recurrent_cells_are_shared_dense_layers(cell):
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(OUT)(nn.RNN(getattr(nn, cell)(6))(x)[:, -1])

    xs = jax.random.normal(jax.random.PRNGKey(5), (B, T, D), jnp.float32)  # Flax cells keep a float32 carry
    t = jax.random.normal(jax.random.PRNGKey(6), (B, OUT), jnp.float32)
    m = Net()
    params = m.init(KEY, xs)
    est, st = estimate(make_loss(m.apply), params, (xs, t), "ggn_exact")
    sites = est.processed_jaxpr.layer_sites
    assert not any(s.pattern == "generic" for s in sites)
    in_scan = [s for s in sites if s.scan is not None]
    assert len(in_scan) == len(sites) - 1 and {s.scan.mode for s in in_scan} == {"shared"}
    assert all(s.scan.length == T for s in in_scan)
    assert np.all(np.isfinite(np.asarray(est.to_dense_matrix(st))))
