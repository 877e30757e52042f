"""The user's ``value_and_grad_func`` and its contract (see ``curvax.Optimizer``'s docstring).

It is called as ``value_and_grad_func(params, [func_state], [rng], batch)`` and returns
``(value, grads)``; ``value`` is the loss, or ``(loss, aux)``, ``(loss, new_func_state)`` or
``(loss, (new_func_state, aux))`` as the ``value_func_has_*`` flags say.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from curvax import _compat


def describe(x: Any) -> str:
    """A short description of a value's shape, for error messages."""
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}: (" + ", ".join(describe(e) for e in x) + ")"
    if hasattr(x, "shape"):
        return f"array{tuple(x.shape)}"
    return type(x).__name__


@dataclasses.dataclass(frozen=True, eq=False)
class ValueFunction:
    """``value_and_grad_func`` with its flags: builds its argument tuple and splits its outputs."""

    value_and_grad_func: Callable[..., Any]
    has_aux: bool
    has_state: bool
    has_rng: bool

    def value(self, *args: Any) -> Any:
        """The function's value (its first output) at ``args``."""
        return self.value_and_grad_func(*args)[0]

    def make_args(self, params: Any, func_state: Any, rng: Any, batch: Any) -> tuple:
        """``(params, [func_state], [rng], batch)`` as the flags say."""
        args = [params]
        if self.has_state:
            args.append(func_state)
        if self.has_rng:
            args.append(rng)
        args.append(batch)
        return tuple(args)

    def split_outputs(self, out: Any) -> tuple[Any, Any, Any]:
        """``(loss, func_state, aux)`` from the function's value ``out`` (None where absent)."""
        if not self.has_state and not self.has_aux:
            return out, None, None
        loss, rest = out
        if self.has_state and self.has_aux:
            return loss, rest[0], rest[1]
        if self.has_state:
            return loss, rest, None
        return loss, None, rest

    def signature(self) -> str:
        """The argument list the function is called with, e.g. ``(params, rng, batch)``."""
        parts = ["params"] + (["func_state"] if self.has_state else []) + (["rng"] if self.has_rng else []) + ["batch"]
        return "(" + ", ".join(parts) + ")"

    def _expected_value(self) -> str:
        if not (self.has_aux or self.has_state):
            return "loss"
        rest = "(func_state, aux)" if self.has_aux and self.has_state else "func_state" if self.has_state else "aux"
        return f"(loss, {rest})"

    def _check_value(self, value: Any) -> None:
        """Raises ``ValueError`` unless ``value`` has the shape the flags announce, with a scalar loss."""
        flags = f"(value_func_has_aux={self.has_aux}, value_func_has_state={self.has_state})"
        try:
            if self.has_aux or self.has_state:
                if not isinstance(value, (tuple, list)) or len(value) != 2:
                    raise ValueError
                if self.has_aux and self.has_state and (not isinstance(value[1], (tuple, list)) or len(value[1]) != 2):
                    raise ValueError
                loss = value[0]
            else:
                loss = value
            if not hasattr(loss, "shape") or loss.shape != ():
                raise ValueError
        except ValueError:
            raise ValueError(
                f"value_and_grad_func's value must be {self._expected_value()} with a scalar loss {flags}; "
                f"got {describe(value)}."
            ) from None

    def check_outputs(self, func_args: Sequence[Any]) -> tuple[Any, tuple[Any, Any]]:
        """Checks the function's outputs at ``func_args`` against the flags; returns its jaxpr,
        and the trace of ``value`` taken from it (``(closed jaxpr, output shapes)``).

        The jaxpr serves the gradient proof (``curvax.gradients``) and the value's trace the
        estimator's (``finalize(..., traced=...)``), so that the function is traced once (a
        second trace of a VMC loss with second derivatives costs seconds).
        """
        try:
            jaxpr, out = _compat.make_jaxpr(self.value_and_grad_func, *func_args, return_shape=True)
        except TypeError as e:
            raise TypeError(
                f"Calling value_and_grad_func{self.signature()} failed: {e}. Check the "
                "value_func_has_state/value_func_has_rng flags against your function's arguments."
            ) from e
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(f"value_and_grad_func must return (value, grads); got {type(out).__name__}.")
        value, grads = out
        if jax.tree_util.tree_structure(grads) != jax.tree_util.tree_structure(func_args[0]):
            raise ValueError("The gradients returned by value_and_grad_func do not have the structure of the parameters.")
        self._check_value(value)
        return jaxpr, (_compat.first_outputs(jaxpr, len(jax.tree_util.tree_leaves(value))), value)
