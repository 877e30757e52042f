"""Block and estimator overrides that forward ``(self, *args, **kwargs)`` to ``super()``.

The extension guide's pattern, ``def update_curvature_matrix_estimate(self, *args, **kwargs):
return super().update_curvature_matrix_estimate(*args, **kwargs)``, names no argument, so its
signature says nothing about which kfac-jax block-API generation it follows (documented:
dict data and ``pmap_axis_name``; v0.0.8: ``LayerVjpData`` and ``identity_weight``). It must
work under both: called by the user in either generation, and called by curvax's estimator
(which passes every generation's arguments), forwarding to a built-in block (documented), to a
v0.0.8-style override and to a documented-style override. Oracles: the Kronecker factors of a
dense layer computed directly, ``A = [X 1]^T [X 1] / B`` and, for the exact GGN of the squared
error, ``G = 2 I`` (or ``dY^T dY / B`` for given output tangents).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import blocks, estimators
from curvax.kfac_api.tracer import LayerData, LayerVjpData

pytestmark = pytest.mark.usefixtures("x64")

KEY = jax.random.PRNGKey(0)
B, D_IN, D_OUT = 5, 3, 2
LOG: list = []


def _problem():
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(3), 4)
    params = {"w": jax.random.normal(k1, (D_IN, D_OUT)), "b": jax.random.normal(k2, (D_OUT,))}
    x = jax.random.normal(k3, (B, D_IN))
    t = jax.random.normal(k4, (B, D_OUT))

    def loss(p, batch):
        xb, tb = batch
        y = curvax.register_dense(xb @ p["w"] + p["b"], xb, p["w"], p["b"])
        curvax.register_squared_error_loss(y, tb)
        return jnp.mean(jnp.sum((y - tb) ** 2, axis=-1))

    return loss, params, (x, t)


def _oracle(batch):
    x, _ = batch
    xa = jnp.concatenate([x, jnp.ones((B, 1))], axis=1)
    return np.asarray(xa.T @ xa / B), 2.0 * np.eye(D_OUT)


# --- the blocks forwarded to -----------------------------------------------------------


class V008Block(blocks.DenseTwoKroneckerFactored):
    """v0.0.8 style: ``LayerVjpData`` and ``identity_weight``; doubles dy (G becomes 4 G)."""

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new, identity_weight, batch_size):
        LOG.append(("v008", type(estimation_data).__name__, float(identity_weight)))
        [dy] = estimation_data.tangents.outputs
        estimation_data = dataclasses.replace(
            estimation_data, tangents=dataclasses.replace(estimation_data.tangents, outputs=(2.0 * dy,))
        )
        return super().update_curvature_matrix_estimate(
            state, estimation_data, ema_old=ema_old, ema_new=ema_new, identity_weight=identity_weight, batch_size=batch_size
        )


class DocBlock(blocks.DenseTwoKroneckerFactored):
    """Documented style: dict data and ``pmap_axis_name``; triples the inputs."""

    def update_curvature_matrix_estimate(self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None):
        LOG.append(("doc", type(estimation_data).__name__, pmap_axis_name))
        data = dict(estimation_data)
        data["inputs"] = tuple(3.0 * x for x in data["inputs"])
        return super().update_curvature_matrix_estimate(state, data, ema_old, ema_new, batch_size, pmap_axis_name)


def _expected(base, batch):
    """The factors the block ``base`` computes for this problem (built-in: the oracle)."""
    a, g = _oracle(batch)
    if issubclass(base, V008Block):
        return a, 4.0 * g
    if issubclass(base, DocBlock):
        s = np.array([3.0] * D_IN + [1.0])
        return a * np.outer(s, s), g
    return a, g


# --- forwarders over each of them -------------------------------------------------------


def _forwarders(base):
    class Pure(base):
        def update_curvature_matrix_estimate(self, *args, **kwargs):
            return super().update_curvature_matrix_estimate(*args, **kwargs)

    class Counting(base):
        """Adds work before forwarding: counts the calls and records what it was handed."""

        def update_curvature_matrix_estimate(self, *args, **kwargs):
            LOG.append(("count", len(args), tuple(sorted(kwargs))))
            return super().update_curvature_matrix_estimate(*args, **kwargs)

    class ArgsOnly(base):
        def update_curvature_matrix_estimate(self, *args):
            return super().update_curvature_matrix_estimate(*args)

    class KwargsOnly(base):
        def update_curvature_matrix_estimate(self, **kwargs):
            return super().update_curvature_matrix_estimate(**kwargs)

    class StateFirst(base):
        """Names the leading arguments both generations share, forwards the rest."""

        def update_curvature_matrix_estimate(self, state, estimation_data, *args, **kwargs):
            LOG.append(("state_first", type(estimation_data).__name__))
            return super().update_curvature_matrix_estimate(state, estimation_data, *args, **kwargs)

    class Chained(Counting):  # a forwarder over a forwarder
        def update_curvature_matrix_estimate(self, *args, **kwargs):
            return super().update_curvature_matrix_estimate(*args, **kwargs)

    return {"pure": Pure, "counting": Counting, "args_only": ArgsOnly, "kwargs_only": KwargsOnly,
            "state_first": StateFirst, "chained": Chained}


BASES = {"builtin": blocks.DenseTwoKroneckerFactored, "v008": V008Block, "doc": DocBlock}
KINDS = ["pure", "counting", "args_only", "kwargs_only", "state_first", "chained"]


def test_forwarders_take_the_forward_generation():
    for base in BASES.values():
        for cls in _forwarders(base).values():
            assert cls.update_curvature_matrix_estimate.__curvax_generation__ == "forward"


@pytest.mark.parametrize("v008_call", [False, True], ids=["documented_call", "v008_call"])
@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("kind", KINDS)
def test_forwarder_in_estimator_equals_base_block(kind, base, v008_call):
    loss, params, batch = _problem()
    fwd = _forwarders(BASES[base])[kind]
    est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor={"dense": fwd})
    state = est.init(KEY, (params, batch), None, None, False)
    LOG.clear()
    if v008_call:  # v0.0.8 positional order, identity_weight 0.25
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 0.25, B, KEY, (params, batch), "ggn_exact")
    else:
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, B, KEY, (params, batch), estimation_mode="ggn_exact")
    assert isinstance(est.blocks[0], fwd)
    a, g = _expected(BASES[base], batch)
    (s,) = state.blocks_states
    np.testing.assert_allclose(s.inputs_factor.value, a, rtol=1e-12)
    np.testing.assert_allclose(s.outputs_factor.value, g, rtol=1e-12, atol=1e-14)
    if kind in ("counting", "chained"):
        counts = [e for e in LOG if e[0] == "count"]
        assert len(counts) == 1
        # Called as kfac-jax calls a block: state and data positionally, the rest by keyword.
        assert counts[0][1] == 2
    if kind == "state_first":  # the data arrive in the format of the generation forwarded to
        fmt = "LayerVjpData" if base == "v008" else "dict"
        assert [e for e in LOG if e[0] == "state_first"] == [("state_first", fmt)]
    if base == "v008":  # the v0.0.8 override gets LayerVjpData and the caller's identity_weight
        assert [e for e in LOG if e[0] == "v008"] == [("v008", "LayerVjpData", 0.25 if v008_call else 0.0)]
    if base == "doc":
        assert [e[:2] for e in LOG if e[0] == "doc"] == [("doc", "dict")]


def _layer_data():
    loss, params, batch = _problem()
    est = curvax.BlockDiagonalCurvature(loss)
    est.finalize((params, batch))
    eqn = est.processed_jaxpr.layer_tags[0]
    x = batch[0]
    dy = jax.random.normal(jax.random.PRNGKey(7), (B, D_OUT))
    data = {"inputs": (x,), "outputs": (), "params": (params["w"], params["b"]), "outputs_tangent": (dy,), "params_tangent": ()}
    vjp = LayerVjpData(
        primals=LayerData(inputs=(x,), outputs=(), params=(params["w"], params["b"])),
        tangents=LayerData(inputs=(), outputs=(dy,), params=()),
    )
    xa = jnp.concatenate([x, jnp.ones((B, 1))], axis=1)
    return eqn, data, vjp, np.asarray(xa.T @ xa / B), np.asarray(dy.T @ dy / B)


@pytest.mark.parametrize("base", ["builtin", "v008"])
def test_direct_calls_in_either_generation_reach_super_unchanged(base):
    """A user calling a forwarder directly, in either generation, gets what the base gives."""
    eqn, data, vjp, a, g = _layer_data()
    g_scale = 4.0 if base == "v008" else 1.0
    fwds = _forwarders(BASES[base])
    calls = {
        "doc_positional": ((data, 0.0, 1.0, B), {}),
        "doc_axis": ((data, 0.0, 1.0, B, None), {}),
        "v008_positional": ((vjp, 0.0, 1.0, 0.1, B), {}),
        "v008_keywords": ((vjp,), dict(ema_old=0.0, ema_new=1.0, identity_weight=0.1, batch_size=B)),
    }
    for kind in ("pure", "counting", "args_only", "chained"):
        block = blocks.construct_block(fwds[kind], eqn, "layer")
        s0 = block.init(KEY, None, None, False)
        for name, (args, kwargs) in calls.items():
            if kind == "args_only" and kwargs:
                continue  # (self, *args) takes no keywords: Python's own TypeError, as for any function
            s1 = jax.jit(lambda s: block.update_curvature_matrix_estimate(s, *args, **kwargs))(s0)
            np.testing.assert_allclose(s1.inputs_factor.value, a, rtol=1e-12, err_msg=f"{kind} {name}")
            np.testing.assert_allclose(s1.outputs_factor.value, g_scale * g, rtol=1e-12, err_msg=f"{kind} {name}")


def test_forwarder_with_unreadable_call_raises_from_super():
    eqn, data, _, _, _ = _layer_data()
    block = blocks.construct_block(_forwarders(blocks.DenseTwoKroneckerFactored)["pure"], eqn, "layer")
    s0 = block.init(KEY, None, None, False)
    with pytest.raises(TypeError, match="neither kfac-jax signature"):
        block.update_curvature_matrix_estimate(s0, data, 0.0, 1.0, B, "axis", 3)


def test_partially_named_star_args_override_still_raises():
    """Naming an argument past the shared prefix but taking the rest as *args stays ambiguous."""
    with pytest.raises(TypeError, match="cannot say which kfac-jax generation"):

        class Opaque(blocks.DenseTwoKroneckerFactored):
            def update_curvature_matrix_estimate(self, state, batch_size, *args):
                return state

        del Opaque


@pytest.mark.parametrize("kind", ["pure", "counting"])
@pytest.mark.parametrize("v008_call", [False, True], ids=["documented_call", "v008_call"])
def test_estimator_forwarder_equals_base_estimator(kind, v008_call):
    loss, params, batch = _problem()
    calls = []

    class Pure(curvax.BlockDiagonalCurvature):
        def update_curvature_matrix_estimate(self, *args, **kwargs):
            return super().update_curvature_matrix_estimate(*args, **kwargs)

    class Counting(curvax.BlockDiagonalCurvature):
        def update_curvature_matrix_estimate(self, *args, **kwargs):
            calls.append(len(args))
            return super().update_curvature_matrix_estimate(*args, **kwargs)

    cls = {"pure": Pure, "counting": Counting}[kind]
    assert cls.update_curvature_matrix_estimate.__curvax_generation__ == "forward"
    est = cls(loss)
    state = est.init(KEY, (params, batch), None, None, False)
    if v008_call:
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, 0.25, B, KEY, (params, batch), "ggn_exact")
    else:
        state = est.update_curvature_matrix_estimate(state, 0.0, 1.0, B, KEY, (params, batch), estimation_mode="ggn_exact")
    a, g = _oracle(batch)
    (s,) = state.blocks_states
    np.testing.assert_allclose(s.inputs_factor.value, a, rtol=1e-12)
    np.testing.assert_allclose(s.outputs_factor.value, g, rtol=1e-12, atol=1e-14)
    if kind == "counting":
        assert calls == [8 if v008_call else 6]


def test_optimizer_step_with_forwarding_block_equals_builtin():
    """One fixed-coefficient optimizer step: the forwarding block gives the built-in's parameters."""
    loss, params, batch = _problem()
    counting = _forwarders(blocks.DenseTwoKroneckerFactored)["counting"]

    def run(ctor):
        opt = curvax.Optimizer(
            jax.value_and_grad(loss), l2_reg=0.0, use_adaptive_learning_rate=False, use_adaptive_momentum=False,
            use_adaptive_damping=False, estimation_mode="ggn_exact", multi_device=False,
            layer_tag_to_block_ctor=None if ctor is None else {"dense": ctor},
        )
        state = opt.init(params, KEY, batch)
        p, _, _ = opt.step(params, state, KEY, batch=batch, learning_rate=0.1, momentum=0.0, damping=0.5)
        return p

    LOG.clear()
    p_fwd = run(counting)
    assert LOG and {e[0] for e in LOG} == {"count"}  # the override ran (once per trace)
    p_ref = run(None)
    jax.tree_util.tree_map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-14), p_fwd, p_ref)
    assert not np.allclose(p_ref["w"], params["w"])
