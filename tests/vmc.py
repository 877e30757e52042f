"""A variational Monte Carlo model of the hydrogen atom, for the tests.

One electron, the nucleus at the origin: ``H = -1/2 laplacian - 1/r``, ground state
``psi = exp(-r)`` with energy exactly -1/2 Ha. The trial wave function is
``log psi(x) = -cusp * r + MLP(x)``: with ``cusp = 1`` and a constant MLP it is the exact
ground state, whose local energy is -1/2 at every point.

The loss follows the pattern of FermiNet and DeepQMC: ``total_energy`` is a
``jax.custom_jvp`` whose primal is the mean local energy over the walkers and whose rule
gives the VMC gradient ``2 mean((E_L - E) dlogpsi)`` (the derivative of the *expectation*,
not of the sampled mean) and registers ``log psi`` of the walkers as the model's output
(``register_normal_predictive_distribution``, so the Fisher is the one of ``|psi|^2``).
Differentiating the primal instead gives another vector, ``mean(dE_L)``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

import curvax


def init_params(key: jax.Array, hidden: int = 8, cusp: float = 0.6) -> dict[str, Any]:
    """The trial wave function's parameters (float64 when x64 is enabled)."""
    k0, k1 = jax.random.split(key)
    dtype = jnp.zeros(()).dtype
    return {
        "envelope": {"w": jnp.full((1, 1), -cusp, dtype), "b": jnp.zeros(1, dtype)},
        "dense0": {"w": 0.5 * jax.random.normal(k0, (3, hidden), dtype), "b": jnp.zeros(hidden, dtype)},
        "dense1": {"w": 0.1 * jax.random.normal(k1, (hidden, 1), dtype)},
    }


def log_psi(params: dict[str, Any], x: jax.Array) -> jax.Array:
    """``log psi`` at electron positions ``x`` of shape ``(..., 3)``."""
    r = jnp.linalg.norm(x, axis=-1, keepdims=True)
    h = jnp.tanh(x @ params["dense0"]["w"] + params["dense0"]["b"])
    return (r @ params["envelope"]["w"] + params["envelope"]["b"] + h @ params["dense1"]["w"])[..., 0]


def local_energy(params: dict[str, Any], x: jax.Array) -> jax.Array:
    """``E_L = -1/2 (laplacian log psi + |grad log psi|^2) - 1/r`` at one position ``x`` (3,)."""
    f = lambda y: log_psi(params, y)
    grad = jax.grad(f)(x)
    laplacian = jnp.trace(jax.hessian(f)(x))
    return -0.5 * (laplacian + grad @ grad) - 1.0 / jnp.linalg.norm(x)


def local_energies(params: dict[str, Any], walkers: jax.Array) -> jax.Array:
    """``E_L`` at every walker, shape ``(n,)``."""
    return jax.vmap(local_energy, in_axes=(None, 0))(params, walkers)


def _energy(params: dict[str, Any], walkers: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(mean E_L, aux)`` over the walkers: the primal of the custom-JVP losses below."""
    e_l = local_energies(params, walkers)
    energy = jnp.mean(e_l)
    return energy, {"local_energy": e_l, "variance": jnp.mean((e_l - energy) ** 2)}


def _vmc_rule(primal: Callable) -> Callable:
    """The JVP rule: tangent ``2 mean((E_L - E) <dlogpsi, t>)``, registering ``log psi``; the
    primal output is ``primal(params, walkers)``."""

    def rule(primals: tuple, tangents: tuple) -> tuple:
        params, walkers = primals
        energy, aux = primal(params, walkers)
        logpsi, dlogpsi = jax.jvp(lambda p: log_psi(p, walkers), (params,), (tangents[0],))
        curvax.register_normal_predictive_distribution(logpsi[:, None])
        tangent = 2.0 * jnp.mean((aux["local_energy"] - energy) * dlogpsi)
        return (energy, aux), (tangent, jax.tree_util.tree_map(jnp.zeros_like, aux))

    return rule


# FermiNet's form: the rule calls the custom function itself for the primal output.
total_energy = jax.custom_jvp(_energy)
total_energy.defjvp(_vmc_rule(total_energy))

# The rule evaluates the primal's equations itself (no nested custom call in the traced value).
total_energy_inline_rule = jax.custom_jvp(_energy)
total_energy_inline_rule.defjvp(_vmc_rule(_energy))

# How the clients write it: ``jax.value_and_grad`` of the custom-JVP loss, with aux.
value_and_grad_func = jax.value_and_grad(total_energy, has_aux=True)
value_and_grad_func_inline_rule = jax.value_and_grad(total_energy_inline_rule, has_aux=True)


def vmc_gradient(params: dict[str, Any], walkers: jax.Array) -> Any:
    """The VMC gradient written out directly (no custom rule): ``2 mean((E_L - E) grad log psi)``."""
    e_l = local_energies(params, walkers)
    centred = jax.lax.stop_gradient(e_l - jnp.mean(e_l))
    return jax.grad(lambda p: 2.0 * jnp.mean(centred * log_psi(p, walkers)))(params)


def primal_gradient(params: dict[str, Any], walkers: jax.Array) -> Any:
    """The derivative of the sampled mean local energy, ``mean(dE_L)``: not the VMC gradient."""
    return jax.grad(lambda p: jnp.mean(local_energies(p, walkers)))(params)


def make_mcmc(num_steps: int, width: float = 0.5) -> Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """A jitted ``(params, walkers, key) -> (walkers, acceptance)``: ``num_steps`` Metropolis
    steps with Gaussian proposals of std ``width``, sampling ``|psi|^2``."""

    @jax.jit
    def mcmc(params: Any, walkers: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(_, carry):
            x, lp, key, accepted = carry
            key, k_prop, k_acc = jax.random.split(key, 3)
            proposal = x + width * jax.random.normal(k_prop, x.shape, x.dtype)
            lp_new = 2.0 * log_psi(params, proposal)
            accept = jnp.log(jax.random.uniform(k_acc, lp.shape, x.dtype)) < lp_new - lp
            x = jnp.where(accept[:, None], proposal, x)
            return x, jnp.where(accept, lp_new, lp), key, accepted + jnp.mean(accept)

        lp = 2.0 * log_psi(params, walkers)
        x, _, _, accepted = jax.lax.fori_loop(0, num_steps, body, (walkers, lp, key, jnp.zeros((), walkers.dtype)))
        return x, accepted / num_steps

    return mcmc


def initial_walkers(key: jax.Array, n: int) -> jax.Array:
    """``n`` starting positions around the nucleus (shape ``(n, 3)``)."""
    return jax.random.normal(key, (n, 3), jnp.zeros(()).dtype)
