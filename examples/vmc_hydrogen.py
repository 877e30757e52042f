"""Variational Monte Carlo for the hydrogen atom, optimised with K-FAC (as FermiNet does).

One electron around a proton at the origin: ``H = -1/2 laplacian - 1/r`` (atomic units). The
exact ground state is ``psi(x) = exp(-|x|)`` with energy -1/2 Hartree. The trial wave function
is ``log psi(x) = -a |x| + MLP(x)``; VMC minimises the energy expectation
``E = <psi|H|psi> / <psi|psi>``, estimated as the mean *local energy*
``E_L(x) = (H psi)(x) / psi(x)`` over walkers ``x`` sampled from ``|psi|^2`` by Metropolis moves.

Two things make this an unusual loss, and both are how FermiNet writes it with kfac-jax:

* The gradient of the expectation is not the derivative of the sampled mean (the walkers
  depend on the parameters through ``|psi|^2``): it is ``2 mean((E_L - E) d log psi)``. The
  energy is a ``jax.custom_jvp`` whose rule returns that gradient; ``curvax.Optimizer`` always
  steps along the gradient ``value_and_grad_func`` returns.
* The curvature K-FAC should use is the Fisher of ``|psi|^2``. The rule registers
  ``log psi`` of the walkers as the mean of a unit normal
  (``register_normal_predictive_distribution``): its Fisher is ``mean(d log psi d log psi^T)``,
  which is that Fisher up to a factor and the centring.

The table shows the energy (mean over the last steps) and the local energy's variance, which
is zero at the exact ground state, for K-FAC and for Adam on the same VMC gradient.

    python examples/vmc_hydrogen.py            # 200 steps, 512 walkers
    python examples/vmc_hydrogen.py --quick    # smoke run
    python examples/vmc_hydrogen.py --devices 2              # walkers sharded over 2 devices (jax.sharding)
    python examples/vmc_hydrogen.py --devices 2 --pmap       # kfac-jax's pmap mode, as FermiNet runs it

With ``--devices N`` on a CPU-only machine the script asks XLA for ``N`` host devices (before JAX
starts); on GPUs it uses the first ``N`` GPUs. The loss is the same function in both modes but for
one line: under ``--pmap`` each device holds its share of the walkers, so the means over walkers
inside the loss and its ``custom_jvp`` rule are followed by ``lax.pmean`` over the device axis;
under ``jax.sharding`` the walkers are one global array and ``jnp.mean`` already is the mean over
every device's walkers, so that ``pmean`` is simply left out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any


def _devices_requested(argv: list[str]) -> int:
    """``--devices N`` from the command line, read before JAX starts (the CPU device count is fixed then)."""
    for i, arg in enumerate(argv):
        if arg == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
    return 1


if __name__ == "__main__" and _devices_requested(sys.argv[1:]) > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Only the host (CPU) platform reads this flag; GPUs are counted as they are.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                               + str(_devices_requested(sys.argv[1:]))).strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax

import curvax

EXACT_ENERGY = -0.5  # Hartree


# --- the trial wave function ----------------------------------------------------------------


def init_params(key: jax.Array, hidden: int = 8, cusp: float = 0.6) -> dict[str, Any]:
    """An envelope ``-cusp * r`` (the exact state has cusp 1) plus a small tanh MLP of ``x``."""
    k0, k1 = jax.random.split(key)
    return {
        "envelope": {"w": jnp.full((1, 1), -cusp), "b": jnp.zeros(1)},
        "dense0": {"w": 0.5 * jax.random.normal(k0, (3, hidden)), "b": jnp.zeros(hidden)},
        "dense1": {"w": 0.1 * jax.random.normal(k1, (hidden, 1))},
    }


def log_psi(params: dict[str, Any], x: jax.Array) -> jax.Array:
    """``log psi`` at electron positions ``x`` of shape ``(..., 3)``; each dense layer is detected."""
    r = jnp.linalg.norm(x, axis=-1, keepdims=True)
    h = jnp.tanh(x @ params["dense0"]["w"] + params["dense0"]["b"])
    return (r @ params["envelope"]["w"] + params["envelope"]["b"] + h @ params["dense1"]["w"])[..., 0]


def local_energy(params: dict[str, Any], x: jax.Array) -> jax.Array:
    """``E_L(x) = -1/2 (laplacian log psi + |grad log psi|^2) - 1/|x|`` at one position ``x``."""
    f = lambda y: log_psi(params, y)
    grad = jax.grad(f)(x)
    return -0.5 * (jnp.trace(jax.hessian(f)(x)) + grad @ grad) - 1.0 / jnp.linalg.norm(x)


# --- the loss: mean local energy, with the VMC gradient as its derivative --------------------


def make_total_energy(pmap_axis_name: str | None = None):
    """The loss ``(params, walkers) -> (E, variance of E_L)`` with the VMC gradient as its derivative.

    ``pmap_axis_name``: in kfac-jax's pmap mode each device sees its share of the walkers, and
    every mean over walkers is followed by ``lax.pmean`` over that axis (as in FermiNet). With
    ``None`` (one device, or ``jax.sharding``: the walkers are one global array) ``jnp.mean`` is
    already the mean over all walkers.
    """
    mean = jnp.mean if pmap_axis_name is None else (lambda x: jax.lax.pmean(jnp.mean(x), pmap_axis_name))

    @jax.custom_jvp
    def total_energy(params: dict[str, Any], walkers: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(E, variance of E_L)`` over the walkers (the variance is auxiliary output)."""
        e_l = jax.vmap(local_energy, in_axes=(None, 0))(params, walkers)
        energy = mean(e_l)
        return energy, mean((e_l - energy) ** 2)

    @total_energy.defjvp
    def _total_energy_jvp(primals: tuple, tangents: tuple) -> tuple:
        params, walkers = primals
        e_l = jax.vmap(local_energy, in_axes=(None, 0))(params, walkers)
        energy = mean(e_l)
        logpsi, dlogpsi = jax.jvp(lambda p: log_psi(p, walkers), (params,), (tangents[0],))
        # tell curvax what the model's output is: log psi of each walker, as a unit-normal mean
        curvax.register_normal_predictive_distribution(logpsi[:, None])
        tangent = 2.0 * mean((e_l - energy) * dlogpsi)
        return (energy, mean((e_l - energy) ** 2)), (tangent, jnp.zeros_like(energy))

    return total_energy


total_energy = make_total_energy()
value_and_grad_func = jax.value_and_grad(total_energy, has_aux=True)
PMAP_AXIS = "vmc_devices"


# --- sampling |psi|^2 --------------------------------------------------------------------------


def make_mcmc(num_moves: int, width: float = 0.5):
    """A jitted ``(params, walkers, key) -> walkers``: Metropolis moves with Gaussian proposals."""

    @jax.jit
    def mcmc(params: Any, walkers: jax.Array, key: jax.Array) -> jax.Array:
        def move(_, carry):
            x, log_p, key = carry
            key, k_prop, k_acc = jax.random.split(key, 3)
            proposal = x + width * jax.random.normal(k_prop, x.shape)
            log_p_new = 2.0 * log_psi(params, proposal)
            accept = jnp.log(jax.random.uniform(k_acc, log_p.shape)) < log_p_new - log_p
            return jnp.where(accept[:, None], proposal, x), jnp.where(accept, log_p_new, log_p), key

        x, _, _ = jax.lax.fori_loop(0, num_moves, move, (walkers, 2.0 * log_psi(params, walkers), key))
        return x

    return mcmc


# --- training ---------------------------------------------------------------------------------


def run_pmap(params: Any, walkers: jax.Array, steps: int, args: argparse.Namespace) -> tuple[list, list]:
    """K-FAC in kfac-jax's pmap mode: every input with a leading axis of ``n`` devices."""
    n, utils = args.devices, curvax.utils
    vgf = jax.value_and_grad(make_total_energy(PMAP_AXIS), has_aux=True)
    optimizer = curvax.Optimizer(vgf, l2_reg=0.0, value_func_has_aux=True, num_burnin_steps=0,
                                 multi_device=True, pmap_axis_name=PMAP_AXIS)
    mcmc = jax.pmap(make_mcmc(args.moves))
    params = utils.replicate_all_local_devices(params)               # a copy on every device
    walkers = walkers.reshape((n, -1) + walkers.shape[1:])            # each device its share
    key = utils.make_different_rng_key_on_all_devices(jax.random.PRNGKey(args.seed + 1))  # one key per device
    key, subkeys = utils.p_split(key)
    state = optimizer.init(params, subkeys, walkers)
    # fixed coefficients: one copy per device, like the parameters
    lr, damping, momentum = (utils.replicate_all_local_devices(jnp.asarray(v)) for v in (args.lr, args.damping, 0.0))
    energies, variances = [], []
    for _ in range(steps):
        key, k_mcmc = utils.p_split(key)
        walkers = mcmc(params, walkers, k_mcmc)
        key, k_step = utils.p_split(key)
        params, state, stats = optimizer.step(params, state, k_step, batch=walkers, learning_rate=lr,
                                              momentum=momentum, damping=damping)
        energies.append(float(stats["loss"][0]))       # stats carry the device axis; every copy is equal
        variances.append(float(stats["aux"][0]))
    return energies, variances


def run(name: str, params: Any, walkers: jax.Array, steps: int, args: argparse.Namespace) -> tuple[list, list]:
    if name == "curvax K-FAC" and args.pmap:
        return run_pmap(params, walkers, steps, args)
    mcmc = make_mcmc(args.moves)
    key = jax.random.PRNGKey(args.seed + 1)
    energies, variances = [], []
    if args.devices > 1:  # jax.sharding: parameters replicated, walkers split over a mesh axis
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        mesh = Mesh(np.array(jax.devices()[: args.devices]), ("walkers",))
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
        walkers = jax.device_put(walkers, NamedSharding(mesh, PartitionSpec("walkers")))
    if name == "curvax K-FAC":
        optimizer = curvax.Optimizer(value_and_grad_func, l2_reg=0.0, value_func_has_aux=True, num_burnin_steps=0)
        state = optimizer.init(params, key, walkers)
    else:
        tx = optax.adam(args.adam_lr)
        opt_state = tx.init(params)

        @jax.jit
        def adam_step(params, opt_state, walkers):
            (energy, variance), grads = value_and_grad_func(params, walkers)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, energy, variance

    for _ in range(steps):
        key, k_mcmc, k_step = jax.random.split(key, 3)
        walkers = mcmc(params, walkers, k_mcmc)
        if name == "curvax K-FAC":
            params, state, stats = optimizer.step(
                params, state, k_step, batch=walkers, learning_rate=args.lr, momentum=0.0, damping=args.damping
            )
            energy, variance = stats["loss"], stats["aux"]
        else:
            params, opt_state, energy, variance = adam_step(params, opt_state, walkers)
        energies.append(float(energy))
        variances.append(float(variance))
    return energies, variances


def steps_to_converge(energies: list[float], tol: float = 0.01, window: int = 10) -> str:
    """The first step after which the running mean of ``window`` energies stays within ``tol`` of
    the exact energy ("-" if it never does)."""
    means = np.convolve(energies, np.ones(window) / window, mode="valid")
    outside = np.flatnonzero(np.abs(means - EXACT_ENERGY) >= tol)
    if len(outside) == 0:
        return str(window)
    first = outside[-1] + 1  # the first window after the last one outside
    return str(first + window) if first < len(means) else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and walkers (smoke test)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--walkers", type=int, default=512)
    parser.add_argument("--moves", type=int, default=10, help="Metropolis moves between optimizer steps")
    parser.add_argument("--lr", type=float, default=0.3, help="K-FAC learning rate")
    parser.add_argument("--damping", type=float, default=1e-2, help="K-FAC damping")
    parser.add_argument("--adam-lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--devices", type=int, default=1,
                        help="split the walkers over this many devices (on CPU: host devices made for it)")
    parser.add_argument("--pmap", action="store_true",
                        help="with --devices: kfac-jax's pmap mode (multi_device=True) instead of jax.sharding")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.walkers = 60, 256
    if args.devices > jax.device_count():
        parser.error(f"--devices {args.devices}: JAX sees {jax.device_count()} device(s) ({jax.devices()[0].platform})")
    if args.walkers % args.devices:
        parser.error("--walkers must be a multiple of --devices")

    params = init_params(jax.random.PRNGKey(args.seed))
    # equilibrate the walkers under the initial wave function
    walkers = make_mcmc(100)(params, jax.random.normal(jax.random.PRNGKey(args.seed + 2), (args.walkers, 3)),
                             jax.random.PRNGKey(args.seed + 3))
    last = max(args.steps // 5, 1)
    rows = []
    for name in ("curvax K-FAC", "optax Adam"):
        start = time.perf_counter()
        energies, variances = run(name, params, walkers, args.steps, args)
        rows.append((name, energies, variances, time.perf_counter() - start))

    mode = "one device" if args.devices == 1 else f"{args.devices} {jax.devices()[0].platform} devices, " + (
        "kfac-jax's pmap mode" if args.pmap else "jax.sharding")
    print(f"Hydrogen atom, VMC with {args.walkers} walkers, {args.moves} Metropolis moves per step "
          f"(exact ground-state energy {EXACT_ENERGY} Ha); {mode}")
    print(f"{'optimizer':<14} {'steps':>5} {'first E':>9} {'E (last ' + str(last) + ')':>13} {'error (mHa)':>11} "
          f"{'variance':>9} {'steps to 10 mHa':>15} {'seconds':>8}")
    for name, energies, variances, seconds in rows:
        e = float(np.mean(energies[-last:]))
        print(f"{name:<14} {len(energies):>5} {energies[0]:>9.4f} {e:>13.4f} {1000 * (e - EXACT_ENERGY):>11.1f} "
              f"{np.mean(variances[-last:]):>9.4f} {steps_to_converge(energies):>15} {seconds:>8.1f}")
    print("(energies in Hartree; variance: of the local energy, zero at the exact ground state; steps to 10 mHa: "
          "from then on the 10-step running mean stays within 10 mHa of -1/2; seconds include compilation)")
    energies = rows[0][1]
    e_kfac = float(np.mean(energies[-last:]))
    ok = bool(np.all(np.isfinite(energies))) and abs(e_kfac - EXACT_ENERGY) < 0.02
    print(f"RESULT kfac_first={energies[0]:.4f} kfac_energy={e_kfac:.4f} adam_energy={np.mean(rows[1][1][-last:]):.4f} "
          f"within_20mHa={ok} devices={args.devices} mode={'pmap' if args.pmap else 'sharding'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
