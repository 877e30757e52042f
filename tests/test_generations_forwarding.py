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

import jax
import numpy as np
import pytest

import curvax
from curvax import blocks
from dense_blocks import (
    B, CALLS, DOC_INPUT_SCALE, KEY, DocBlock, V008Block, dense_problem, layer_data, oracle_factors, update_in_generation,
)

pytestmark = pytest.mark.usefixtures("x64")

SEED = 3  # the dense problem's
LOG = CALLS  # the overrides' calls and the forwarders' below, in order


def _expected(base, batch):
    """The factors the block ``base`` computes for this problem (built-in: the oracle)."""
    a, g = oracle_factors(batch)
    if issubclass(base, V008Block):
        return a, 4.0 * g
    if issubclass(base, DocBlock):
        return a * np.outer(DOC_INPUT_SCALE, DOC_INPUT_SCALE), g
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
    loss, params, batch = dense_problem(SEED)
    fwd = _forwarders(BASES[base])[kind]
    est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor={"dense": fwd})
    state = est.init(KEY, (params, batch), None, None, False)
    LOG.clear()
    state = update_in_generation(est, state, params, batch, v008_call)  # v0.0.8: identity_weight 0.25
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
        assert [(e[0], e[1], float(e[2])) for e in LOG if e[0] == "v008"] == [("v008", "LayerVjpData", 0.25 if v008_call else 0.0)]
    if base == "doc":
        assert [e[:2] for e in LOG if e[0] == "doc"] == [("doc", "dict")]


@pytest.mark.parametrize("base", ["builtin", "v008"])
def test_direct_calls_in_either_generation_reach_super_unchanged(base):
    """A user calling a forwarder directly, in either generation, gets what the base gives."""
    eqn, data, vjp, a, g = layer_data(SEED)
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
    eqn, data, _, _, _ = layer_data(SEED)
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
    loss, params, batch = dense_problem(SEED)
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
    state = update_in_generation(est, state, params, batch, v008_call)
    a, g = oracle_factors(batch)
    (s,) = state.blocks_states
    np.testing.assert_allclose(s.inputs_factor.value, a, rtol=1e-12)
    np.testing.assert_allclose(s.outputs_factor.value, g, rtol=1e-12, atol=1e-14)
    if kind == "counting":
        assert calls == [8 if v008_call else 6]


def test_optimizer_step_with_forwarding_block_equals_builtin():
    """One fixed-coefficient optimizer step: the forwarding block gives the built-in's parameters."""
    loss, params, batch = dense_problem(SEED)
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
