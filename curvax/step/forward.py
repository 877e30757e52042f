"""The gradient and curvature pass: one linearized forward pass of the traced loss.

The step linearizes the loss in (parameters, layer-output perturbations) once; transposing
that linearization gives the gradient (when ``curvax.gradients`` proves it is the user's) and
the per-layer data of the curvature statistics, and pushing parameter vectors through it gives
the exact quadratic model's curvature products.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from curvax.transforms import assemble_layer_data, zero_tangents


class Linearization(NamedTuple):
    """The loss at ``func_args``, linearized.

    ``loss`` and ``deps`` (the registered losses' inputs) are the primal outputs; ``f_vjp`` the
    transposed linearization, of cotangents ``(loss, deps)`` (None when the loss was not
    linearized: ``linearize(..., with_loss=False)``); ``outs`` the function's flat outputs; ``losses`` the registered
    losses; ``data_for(cotangents)`` the per-layer estimation data for cotangents of the loss
    inputs (None: forward-only data); ``deps_jvp(v)`` the loss inputs' tangents along a
    parameter vector ``v``.
    """

    loss: Any
    deps: Any
    f_vjp: Callable[..., Any] | None
    outs: Any
    losses: Sequence[Any]
    data_for: Callable[[Any], list]
    deps_jvp: Callable[[Any], Any]


class CurvatureView(NamedTuple):
    """What the curvature phases see of a batch: its losses, its per-layer data, its
    curvature products (``deps_jvp``) and its number of examples."""

    losses: Sequence[Any]
    data_for: Callable[[Any], list]
    deps_jvp: Callable[[Any], Any]
    batch_size: Any


def linearize(pj: Any, func_args: Sequence[Any], with_loss: bool = True, with_outputs: bool = True) -> Linearization:
    """The traced function ``pj`` (a ``ProcessedJaxpr``) at ``func_args``, linearized.

    ``with_loss`` False linearizes only the registered losses' inputs: the loss value is then a
    primal output (``f_vjp`` is None), so its derivative is neither built nor transposed. That
    is what the curvature needs, and all it can use when the gradient comes from the user's
    ``value_and_grad_func``: a loss whose value is computed by other code than its derivative
    (a custom rule, e.g. the VMC energy over local energies with second derivatives, or an
    iterative solver's ``while_loop``) would otherwise have that value code differentiated,
    which costs a pass the step discards, or fails (``while_loop`` has no transpose).

    ``with_outputs`` False (with ``with_loss`` False) evaluates only what the registered losses
    and the layers need: ``loss`` is then None and ``outs`` empty. When the loss and gradient
    come from the user's ``value_and_grad_func``, the value's own equations (FermiNet's local
    energy, second derivatives included) are not traced a second time.
    """
    if with_loss and not with_outputs:
        raise ValueError("linearize: with_loss=True needs with_outputs=True.")
    p, o = pj.split_args(func_args)
    eps = pj.zero_perturbations(p, o)

    def fwd(q: Any, e: Any) -> Any:
        (deps, outs), aux = pj.evaluate(q, o, e, with_outputs=with_outputs)
        return ((outs[0], deps) if with_loss else deps), (aux, outs)

    primal, f_jvp, ((ops, layer_data), outs) = jax.linearize(fwd, p, eps, has_aux=True)
    f_t = jax.linear_transpose(f_jvp, p, eps)
    if with_loss:
        (loss, deps), f_vjp = primal, f_t
        deps_of = lambda t: t[1]  # noqa: E731
        vjp_of_deps = lambda cot: f_t((jnp.zeros_like(loss), cot))  # noqa: E731
    else:
        loss, deps, f_vjp = (outs[0] if outs else None), primal, None
        deps_of = lambda t: t  # noqa: E731
        vjp_of_deps = f_t

    def data_for(cot: Any) -> list:
        dp, de = zero_tangents(p, eps) if cot is None else vjp_of_deps(cot)
        return assemble_layer_data(pj, p, layer_data, dp, de)

    def deps_jvp(v: Any) -> Any:
        return deps_of(f_jvp(jax.tree_util.tree_leaves(v), jax.tree_util.tree_map(jnp.zeros_like, eps)))

    return Linearization(loss, deps, f_vjp, outs, pj.losses_from_operands(ops), data_for, deps_jvp)


def shared_gradient(lin: Linearization, pj: Any) -> tuple[Any, Any]:
    """``(value, grads)`` from the pass itself: the value function's output tree and the
    gradient of the loss (valid when ``curvax.gradients`` proved it equal to the user's)."""
    if lin.f_vjp is None:
        raise ValueError("shared_gradient needs a linearization of the loss (linearize(..., with_loss=True)).")
    zero_deps = jax.tree_util.tree_map(jnp.zeros_like, lin.deps)
    grads_flat, _ = lin.f_vjp((jnp.ones_like(lin.loss), zero_deps))
    grads = jax.tree_util.tree_unflatten(pj.params_tree, grads_flat)
    value = jax.tree_util.tree_unflatten(pj.out_tree, list(lin.outs))
    return value, grads


def view_of(lin: Linearization, batch_size: Any) -> CurvatureView:
    """The curvature's view of the batch ``lin`` was linearized on."""
    return CurvatureView(lin.losses, lin.data_for, lin.deps_jvp, batch_size)


def sub_batch_view(linearize_fn: Callable[[], Linearization], batch_size: Any, eager: bool) -> Callable[[], CurvatureView]:
    """The curvature's view of a sub-batch (``curvature_batch_fraction``), as a thunk.

    ``linearize_fn()`` linearizes the loss on the sub-batch. With ``eager`` (the view is needed
    on every step) it runs once, here, outside any conditional; otherwise each call of the
    thunk linearizes inside the conditional that needs it, so that off-period steps skip it.
    """

    def view() -> CurvatureView:
        return view_of(linearize_fn(), batch_size)

    if not eager:
        return view
    once = view()
    return lambda: once
