"""kfac-jax's pmap mode on inputs that come out of a ``jax.pmap``, with a FermiNet-like loss.

Since JAX lowers ``pmap`` through ``shard_map`` (the default of 0.9, the only way from 0.10),
the arrays a pmap returns carry a mesh over the pmap axis, and so do their device slices.
``init`` traces the loss on such a slice; that trace used to record the mesh (as ``Auto``) in its
avals and equation parameters, and re-evaluating it inside the pmapped step (the same axis,
``Manual`` there) failed: ``Mesh for all inputs should be equal`` at a ``scan``, or a context
mesh that does not match the aval mesh at a ``broadcast_in_dim``. The same goes for arrays from
``utils.replicate_all_local_devices`` (a mesh of another axis name). FermiNet and DeepQMC hit
this: their walkers and parameters are pmap outputs and FermiNet's
Laplacian is a ``lax.fori_loop``. The loss here has the same structure: a ``custom_jvp`` energy
with a ``pmean``, a Laplacian by a ``fori_loop`` of forward-over-reverse products whose body
closes over the per-device walkers. The run on pmap outputs must equal the run on plain arrays.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import xla_env

if __name__ == "__main__":  # the four-device run: before JAX starts
    xla_env.request_devices(4)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import curvax

# A module's tests share one xdist worker (`--dist loadfile`), so its module-scoped children run
# once. (`xdist_group`/`--dist loadgroup` do not group under pytest 9.2 with pytest-xdist 3.8.)

AXIS = "qmc_axis"
WALKERS, DIM, HIDDEN = 8, 3, 6


def init_params() -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    return {
        "w1": 0.5 * jax.random.normal(k1, (DIM, HIDDEN)),
        "b1": jnp.zeros(HIDDEN),
        "w2": 0.5 * jax.random.normal(k2, (HIDDEN,)),
    }


def log_psi(params: dict[str, jax.Array], r: jax.Array) -> jax.Array:
    """One walker's log-amplitude (a scalar)."""
    h = jnp.tanh(r @ params["w1"] + params["b1"])
    return h @ params["w2"] - 0.5 * jnp.sum(r**2)


def local_energy(params: dict[str, jax.Array], r: jax.Array) -> jax.Array:
    """``-(lap + |grad|^2) / 2 + r^2 / 2`` per walker; the Laplacian summed by a ``fori_loop``."""
    grad_f = jax.grad(log_psi, argnums=1)
    eye = jnp.eye(DIM)

    def one(x):
        g = grad_f(params, x)

        def body(i, acc):  # closes over the walker `x` and the parameters
            return acc + jax.jvp(lambda y: grad_f(params, y), (x,), (eye[i],))[1][i]

        lap = jax.lax.fori_loop(0, DIM, body, jnp.zeros(()))
        return -0.5 * (lap + g @ g) + 0.5 * x @ x

    return jax.vmap(one)(r)


def make_loss():
    """FermiNet's loss shape: a ``custom_jvp`` mean energy (pmean over the devices) whose
    tangent is ``2 mean((E_L - E) d log psi)``, and the amplitude registered as the model output."""

    @jax.custom_jvp
    def total_energy(params, r):
        e = local_energy(params, r)
        return jax.lax.pmean(jnp.mean(e), AXIS), e

    @total_energy.defjvp
    def total_energy_jvp(primals, tangents):
        params, r = primals
        loss, e = total_energy(params, r)
        out, psi_tangent = jax.jvp(lambda p: jax.vmap(log_psi, (None, 0))(p, r), (params,), (tangents[0],))
        curvax.register_normal_predictive_distribution(out[:, None])
        t = jax.lax.pmean(2.0 * jnp.mean((e - loss) * psi_tangent), AXIS)
        return (loss, e), (t, jnp.zeros_like(e))

    def loss(params, batch):
        value, e = total_energy(params, batch)
        return value, {"variance": jax.lax.pmean(jnp.mean((e - value) ** 2), AXIS)}

    return loss


def run(from_pmap: bool, steps: int = 2) -> dict[str, Any]:
    """Steps of the pmap-mode optimizer; the inputs come out of ``replicate_all_local_devices`` and
    a ``jax.pmap`` when ``from_pmap`` (they carry meshes then), else they are plain arrays."""
    n = jax.local_device_count()
    walkers = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (n, WALKERS, DIM)))
    if from_pmap:  # placed as FermiNet places them: replicated over the devices, then pmap outputs
        params = curvax.utils.replicate_all_local_devices(init_params())
        params = jax.pmap(lambda p: jax.tree_util.tree_map(lambda a: a * 1.0, p))(params)
        batch = jax.pmap(lambda x: x * 1.0)(jnp.asarray(walkers))
    else:  # plain arrays on one device, with no mesh
        params = jax.tree_util.tree_map(lambda a: jnp.stack([a] * n), init_params())
        batch = jnp.asarray(walkers)
    opt = curvax.Optimizer(
        jax.value_and_grad(make_loss(), has_aux=True), l2_reg=0.0, value_func_has_aux=True,
        num_burnin_steps=0, inverse_update_period=1, estimation_mode="fisher_exact",
        learning_rate_schedule=lambda t: 0.05, momentum_schedule=lambda t: 0.0, damping_schedule=lambda t: 1e-2,
        include_norms_in_stats=True, multi_device=True, pmap_axis_name=AXIS,
    )
    keys = jax.random.split(jax.random.PRNGKey(3), n)
    state = opt.init(params, keys, batch)
    losses, grad_norms = [], []
    for _ in range(steps):
        params, state, stats = opt.step(params, state, keys, batch=batch)
        losses.append(np.asarray(stats["loss"]).tolist())
        grad_norms.append(np.asarray(stats["grad_norm"]).tolist())
    # The oracle: the energy of the whole batch at the initial parameters, without any pmap.
    e0 = float(jnp.mean(local_energy(init_params(), jnp.asarray(walkers.reshape(-1, DIM)))))
    return {
        "devices": n, "losses": losses, "grad_norms": grad_norms, "e0": e0,
        "params": [np.asarray(a).tolist() for a in jax.tree_util.tree_leaves(params)],
    }


def check(plain: dict[str, Any], piped: dict[str, Any]) -> None:
    n = plain["devices"]
    losses = np.array(piped["losses"], dtype=float)
    assert losses.shape == (2, n) and np.isfinite(losses).all()
    assert (losses == losses[:, :1]).all()  # averaged over the devices
    np.testing.assert_allclose(losses[0, 0], plain["e0"], rtol=1e-5)  # the step-0 loss is the energy
    np.testing.assert_allclose(losses, np.array(plain["losses"]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.array(piped["grad_norms"]), np.array(plain["grad_norms"]), rtol=1e-6, atol=1e-7)
    for a, b in zip(piped["params"], plain["params"]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.array(piped["params"][0])[0], np.asarray(init_params()["b1"]))  # it moved


def test_inputs_from_a_pmap_with_a_fori_loop_laplacian_one_device():
    check(run(from_pmap=False), run(from_pmap=True))


@pytest.mark.slow
def test_inputs_from_a_pmap_with_a_fori_loop_laplacian_four_devices():
    proc = subprocess.run([sys.executable, Path(__file__).name], cwd=Path(__file__).parent,
                          env=xla_env.child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["plain"]["devices"] == 4
    check(r["plain"], r["piped"])


if __name__ == "__main__":
    print(json.dumps({"plain": run(from_pmap=False), "piped": run(from_pmap=True)}))
