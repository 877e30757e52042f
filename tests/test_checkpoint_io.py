"""curvax.checkpoint: saving and loading ``(params, state)`` refuses what would resume wrongly.

The numbers a resumed run gives are those of a run that never stopped; a file that is truncated,
from another model, or holds a non-finite value is refused at load time with an error that names
the file and the leaf, instead of a numpy traceback or a layer silently preconditioned by damping
alone.
"""

from __future__ import annotations

import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax
from curvax import checkpoint
import models


def _make() -> curvax.Optimizer:
    return curvax.Optimizer(
        jax.value_and_grad(models.softmax_loss), l2_reg=1e-3, use_adaptive_learning_rate=True,
        use_adaptive_momentum=True, use_adaptive_damping=True, initial_damping=1.0, inverse_update_period=2,
        damping_adaptation_interval=2,
    )


def _train(opt, params, state, batch, steps):
    losses = []
    for i in steps:
        params, state, s = opt.step(params, state, jax.random.PRNGKey(100 + i), batch=batch, global_step_int=i)
        losses.append(float(s["loss"]))
    return params, state, losses


@pytest.fixture(scope="module")
def trained():
    params0, batch = models.classifier(24, (5, 7, 4))
    opt = _make()
    state0 = opt.init(params0, jax.random.PRNGKey(1), batch)
    params, state, losses = _train(opt, params0, state0, batch, range(3))
    return opt, params0, batch, state0, params, state, losses


def test_round_trip_resumes_exactly(tmp_path, trained):
    opt, params0, batch, state0, params, state, _ = trained
    _, _, want = _train(opt, params, state, batch, range(3, 5))
    checkpoint.save(tmp_path / "ckpt.npz", (params, state))
    opt_b = _make()
    fresh = opt_b.init(params0, jax.random.PRNGKey(1), batch)
    p_b, s_b = checkpoint.load(tmp_path / "ckpt.npz", (params0, fresh))
    for got, saved in zip(jax.tree_util.tree_leaves((p_b, s_b)), jax.tree_util.tree_leaves((params, state))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
    _, _, got = _train(opt_b, p_b, s_b, batch, range(3, 5))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_fresh_state_with_nan_first_loss_loads(tmp_path, trained):
    # `first_loss` is NaN until the first finite loss: a legitimate value, not a corruption.
    _, params0, _, state0, _, _, _ = trained
    assert np.isnan(float(state0.first_loss))
    checkpoint.save(tmp_path / "fresh.npz", (params0, state0))
    _, s = checkpoint.load(tmp_path / "fresh.npz", (params0, state0))
    assert np.isnan(float(s.first_loss))


def test_truncated_file_names_the_file(tmp_path, trained):
    _, _, _, _, params, state, _ = trained
    path = tmp_path / "ckpt.npz"
    checkpoint.save(path, (params, state))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match=r"ckpt\.npz.*could not be read") as info:
        checkpoint.load(path, (params, state))
    assert isinstance(info.value.__cause__, (zipfile.BadZipFile, EOFError, OSError, ValueError))


def test_missing_file_and_foreign_npz(tmp_path, trained):
    _, _, _, _, params, state, _ = trained
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        checkpoint.load(tmp_path / "nope.npz", (params, state))
    np.savez(tmp_path / "plain.npz", *[np.asarray(x) for x in jax.tree_util.tree_leaves((params, state))])
    with pytest.raises(checkpoint.CheckpointError, match="no manifest"):
        checkpoint.load(tmp_path / "plain.npz", (params, state))


def test_non_finite_factor_is_refused_and_named(tmp_path, trained):
    _, _, _, _, params, state, _ = trained
    leaves, treedef = jax.tree_util.tree_flatten((params, state))
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path((params, state))[0]]
    # The first square matrix in the estimator state: a Kronecker factor.
    index = next(
        i for i, (n, x) in enumerate(zip(names, leaves))
        if "estimator_state" in n and np.ndim(x) == 2 and np.shape(x)[0] == np.shape(x)[1]
    )
    broken = list(leaves)
    broken[index] = jnp.asarray(leaves[index]).at[0, 0].set(jnp.nan)
    checkpoint.save(tmp_path / "nan.npz", jax.tree_util.tree_unflatten(treedef, broken))
    with pytest.raises(checkpoint.CheckpointError, match=r"nan\.npz.*non-finite") as info:
        checkpoint.load(tmp_path / "nan.npz", (params, state))
    assert names[index] in str(info.value)
    # Inspection is still possible, on request.
    _, s = checkpoint.load(tmp_path / "nan.npz", (params, state), allow_non_finite=True)
    assert np.isnan(np.asarray(jax.tree_util.tree_leaves(s)[index - len(jax.tree_util.tree_leaves(params))])).any()


def test_state_from_another_model_is_refused(tmp_path, trained):
    opt, _, _, _, params, state, _ = trained
    checkpoint.save(tmp_path / "ckpt.npz", (params, state))
    other_params, other_batch = models.classifier(24, (5, 9, 4))
    other_state = _make().init(other_params, jax.random.PRNGKey(1), other_batch)
    with pytest.raises(checkpoint.CheckpointError, match=r"ckpt\.npz.*shape.*another model"):
        checkpoint.load(tmp_path / "ckpt.npz", (other_params, other_state))
    with pytest.raises(checkpoint.CheckpointError, match="another model"):
        checkpoint.load(tmp_path / "ckpt.npz", params)
