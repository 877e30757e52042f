"""Is curvax's own gradient the gradient the user's ``value_and_grad_func`` returns?

The optimizer gets the gradient and the curvature statistics from one linearized pass over its
traced copy of the loss: the *value* of ``value_and_grad_func``. Its derivative is not always the
gradient the user returns: a ``jax.custom_jvp``/``custom_vjp`` rule (the VMC gradient of FermiNet
and DeepQMC, straight-through estimators, clipped gradients) or a hand-written
``value_and_grad_func`` gives another vector. kfac-jax always steps along the user's gradient, and
so does curvax: it shares its pass for the gradient only when it can prove, at trace time, that
both are JAX's derivative of the same equations:

1. ``value_and_grad_func`` is ``jax.value_and_grad(f)``: it carries ``__wrapped__ = f``, and its
   program equals the program of ``jax.value_and_grad(f, has_aux=...)`` on the same arguments;
   ``f``'s own program is traced too (its custom-derivative calls are still calls there);
2. neither that program nor the program curvax differentiates inlines a custom-derivative call
   (their rules are kept when they are evaluated as calls; inlined, only the primal is left);
3. the equations the loss depends on in that program are, one by one, the equations of ``f``.

Otherwise the optimizer calls ``value_and_grad_func`` for the loss and the gradient and uses its
own pass for the curvature only (one more forward and backward pass per step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from curvax.tracing import Lit, Program


@dataclasses.dataclass(frozen=True)
class GradientProof:
    """The outcome of :func:`prove_shared_gradient`: ``shared`` and, when not, why not."""

    shared: bool
    reason: str


def prove_shared_gradient(
    value_and_grad_func: Callable[..., Any],
    has_aux: bool,
    func_args: Sequence[Any],
    program: Program,
    params_positions: Sequence[int],
    user_jaxpr: Any = None,
) -> GradientProof:
    """Whether differentiating ``program`` (the traced value) gives ``value_and_grad_func``'s gradient.

    ``has_aux``: whether the value is ``(loss, extra)`` (auxiliary outputs or a function state);
    ``program``: the flattened program of the value function that the optimizer differentiates;
    ``params_positions``: the flat argument positions of the parameters. Conservative: any doubt
    (a trace that fails, a difference in any equation) answers ``shared=False``. ``user_jaxpr``:
    ``jax.make_jaxpr(value_and_grad_func)(*func_args)`` when the caller already has it.
    """
    f = getattr(value_and_grad_func, "__wrapped__", None)
    if not callable(f):
        return GradientProof(False, "value_and_grad_func is not jax.value_and_grad(f) (it has no __wrapped__ function)")
    # Cheapest tests first (each trace of a large loss costs seconds); every early answer is False.
    # A custom rule around the parameters in either program: curvax's copy may hold only the rule's
    # primal computation (JAX's linearization replaces the call by it), which the comparison below
    # would find equal to the inlined primal of ``f`` although the user's gradient is the rule's.
    if program.inlined_custom_derivatives:
        names = ", ".join(sorted(set(program.inlined_custom_derivatives)))
        return GradientProof(False, f"the loss defines its own derivative ({names}) around the parameters")
    untraceable = "jax.value_and_grad of its __wrapped__ function could not be traced"
    try:
        theirs = Program(jax.make_jaxpr(f)(*func_args), params_positions)
    except Exception as e:  # noqa: BLE001 - any failure only means "not proven"
        return GradientProof(False, f"{untraceable} ({type(e).__name__})")
    if theirs.inlined_custom_derivatives:
        names = ", ".join(sorted(set(theirs.inlined_custom_derivatives)))
        return GradientProof(False, f"the loss defines its own derivative ({names}) around the parameters")
    try:
        user = user_jaxpr if user_jaxpr is not None else jax.make_jaxpr(value_and_grad_func)(*func_args)
        ref = jax.make_jaxpr(jax.value_and_grad(f, has_aux=has_aux))(*func_args)
    except Exception as e:  # noqa: BLE001 - any failure only means "not proven"
        return GradientProof(False, f"{untraceable} ({type(e).__name__})")
    if str(user) != str(ref) or not _same_consts(user.consts, ref.consts):
        return GradientProof(False, "value_and_grad_func's program differs from jax.value_and_grad(value_and_grad_func.__wrapped__)")
    if not program.output_atoms or not theirs.output_atoms:
        return GradientProof(False, "the value function has no outputs")
    if _canonical(program, program.output_atoms[0]) != _canonical(theirs, theirs.output_atoms[0]):
        return GradientProof(False, "the traced loss is not the program of value_and_grad_func.__wrapped__")
    return GradientProof(True, "value_and_grad_func is jax.value_and_grad of the traced loss")


def _same_consts(a: Sequence[Any], b: Sequence[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        if np.shape(x) != np.shape(y) or np.result_type(x) != np.result_type(y):
            return False
        if not np.array_equal(np.asarray(x), np.asarray(y)):
            return False
    return True


def _const_key(x: Any) -> tuple:
    arr = np.asarray(x)
    return ("const", arr.shape, str(arr.dtype), arr.tobytes() if arr.size <= 4096 else None)


def _eqn_key(eqn: Any) -> tuple:
    """The parts of an equation that decide its derivative, free of variable names and object ids."""
    subs, plain = [], []
    for name, v in sorted(eqn.params.items()):
        vals = v if isinstance(v, (tuple, list)) else (v,)
        jaxprs = [x for x in vals if hasattr(x, "eqns") or hasattr(x, "jaxpr")]
        if jaxprs:
            subs.append((name, tuple(str(x) for x in jaxprs)))
        elif callable(v):
            plain.append((name, "<callable>"))  # rules (e.g. custom_jvp's) are named, not compared
        else:
            plain.append((name, repr(v)))
    return eqn.primitive.name, tuple(plain), tuple(subs), tuple(str(o.aval) for o in eqn.outvars)


def _canonical(program: Program, root: Any) -> tuple:
    """The equations ``root`` depends on, with their operands named by position, in order."""
    if isinstance(root, Lit):
        return ("lit", repr(root.value))
    names: dict[Any, tuple] = {k: ("arg", i) for i, k in enumerate(program.input_keys)}
    for k, v in program.consts.items():
        names[k] = _const_key(v)
    out = []
    for j, i in enumerate(program.live_nodes([root])):
        node = program.nodes[i]
        ins = tuple(("lit", repr(a.value)) if isinstance(a, Lit) else names.get(a, ("?",)) for a in node.inputs)
        for m, k in enumerate(node.outputs):
            if k is not None:
                names[k] = ("node", j, m)
        out.append((_eqn_key(node.eqn), ins))
    return tuple(out), names.get(root)
