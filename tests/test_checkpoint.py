"""Checkpoints: the optimizer state is a pytree of arrays, so any array store can save it.

Training that stops, saves ``(params, state)`` to a file, and resumes in a new optimizer (as a
new process would: ``init`` traces the model again, the loaded arrays replace its state) must
continue exactly as training that never stopped: the same losses, damping and parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
import models


_loss = models.softmax_loss


def _make() -> curvax.Optimizer:
    return curvax.Optimizer(
        jax.value_and_grad(_loss), l2_reg=1e-3, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
        use_adaptive_damping=True, initial_damping=1.0, num_burnin_steps=2, inverse_update_period=2,
        damping_adaptation_interval=2,
    )


def _data() -> tuple[dict[str, jax.Array], tuple[jax.Array, jax.Array]]:
    return models.classifier(24, (5, 7, 4))


def _train(opt: curvax.Optimizer, params: Any, state: Any, batch: Any, steps: range) -> tuple[Any, Any, list]:
    stats = []
    for i in steps:
        params, state, s = opt.step(params, state, jax.random.PRNGKey(100 + i), batch=batch, global_step_int=i)
        stats.append((float(s["loss"]), float(s["damping"]), float(s["learning_rate"])))
    return params, state, stats


def _save(path: Path, tree: Any) -> None:
    leaves = jax.tree_util.tree_leaves(tree)
    np.savez(path, **{f"leaf{i:04d}": np.asarray(x) for i, x in enumerate(leaves)})


def _load(path: Path, like: Any) -> Any:
    """The arrays saved in ``path``, in the structure of ``like`` (a freshly initialised tree)."""
    with np.load(path) as f:
        leaves = [f[f"leaf{i:04d}"] for i in range(len(f.files))]
    treedef = jax.tree_util.tree_structure(like)
    assert treedef.num_leaves == len(leaves)
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in leaves])


def test_resuming_from_a_saved_state_continues_exactly(tmp_path):
    params0, batch = _data()
    opt = _make()
    state0 = opt.init(params0, jax.random.PRNGKey(1), batch)
    p_all, s_all, stats_all = _train(opt, params0, state0, batch, range(6))

    opt_a = _make()
    state_a = opt_a.init(params0, jax.random.PRNGKey(1), batch)
    p_a, s_a, stats_a = _train(opt_a, params0, state_a, batch, range(3))
    _save(tmp_path / "ckpt.npz", (p_a, s_a))

    # A new optimizer, as in a new process: init traces the model, the file supplies the arrays.
    opt_b = _make()
    fresh_state = opt_b.init(params0, jax.random.PRNGKey(1), batch)
    p_b, s_b = _load(tmp_path / "ckpt.npz", (params0, fresh_state))
    assert isinstance(s_b, curvax.Optimizer.State)
    assert int(s_b.step_counter) == 3
    p_b, s_b, stats_b = _train(opt_b, p_b, s_b, batch, range(3, 6))

    np.testing.assert_allclose(stats_a + stats_b, stats_all, rtol=1e-6)
    for got, want in zip(jax.tree_util.tree_leaves((p_b, s_b)), jax.tree_util.tree_leaves((p_all, s_all))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
    # The run changed the damping and the parameters, so the comparison above had something to compare.
    assert len({round(d, 6) for _, d, _ in stats_all}) > 1
    assert stats_all[-1][0] < stats_all[0][0]


def test_an_older_state_of_a_dense_layer_over_extra_axes_is_refused_not_misloaded(tmp_path):
    """Such a layer gets RepeatedDenseKroneckerFactored now (kfac-jax's repeated_dense); a state
    saved with the plain dense block (as older versions gave it) is refused by a default
    optimizer and loads into one built with that block."""
    from curvax import checkpoint

    def loss(p: Any, b: Any) -> jax.Array:
        y = b[0] @ p["w"]
        curvax.register_squared_error_loss(y, b[1])
        return 0.5 * jnp.mean((y - b[1]) ** 2)

    p = {"w": jnp.ones((3, 2))}
    b = (jnp.ones((4, 5, 3)), jnp.zeros((4, 5, 2)))
    make = lambda **kw: curvax.Optimizer(jax.value_and_grad(loss), l2_reg=0.0, learning_rate_schedule=lambda n: 0.1,
                                         damping_schedule=lambda n: 1e-3, momentum_schedule=lambda n: 0.0, **kw)
    old_ctor = {"repeated_dense": curvax.DenseTwoKroneckerFactored}
    old, new = make(layer_tag_to_block_ctor=old_ctor), make()
    s_old = old.init(p, jax.random.PRNGKey(0), b)
    s_new = new.init(p, jax.random.PRNGKey(0), b)
    assert type(new.estimator.blocks[0]).__name__ == "RepeatedDenseKroneckerFactored"
    path = str(tmp_path / "old.npz")
    checkpoint.save(path, (p, s_old))
    with pytest.raises(checkpoint.CheckpointError, match="another model or optimizer configuration"):
        checkpoint.load(path, (p, s_new))
    _, restored = checkpoint.load(path, (p, make(layer_tag_to_block_ctor=old_ctor).init(p, jax.random.PRNGKey(1), b)))
    for a, c in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(s_old)):
        np.testing.assert_array_equal(a, c)
