"""Loss and layer tags: JAX primitives that mark a computation and do nothing else.

A tag returns (some of) its operands unchanged, so it is invisible to ``jit``,
``grad``, ``vmap``, ``jvp`` and ``vjp``; its only job is to appear as an
equation in a jaxpr, telling curvax "these are the logits of a softmax
cross-entropy" or "this is a dense layer with output y, input x, weights w, b".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax

from curvax import _compat


def _is_zero_tangent(t: Any) -> bool:
    return type(t).__name__ == "Zero"


class LossTag(_compat.Primitive):
    """A primitive that marks the inputs of one registered loss of class ``cls``.

    Operands are the loss constructor's arguments (named by ``args_names``); the
    outputs are the parameter-dependent ones (e.g. the logits), unchanged.
    """

    def __init__(self, cls: type, parameter_dependants: Sequence[str], parameter_independants: Sequence[str]):
        super().__init__(f"loss_tag[{cls.__name__}]")
        self.multiple_results = True
        self._cls = cls
        self._dependants = tuple(parameter_dependants)
        self._independants = tuple(parameter_independants)
        _compat.define_identity_rules(self, self._impl, self._abstract_eval, self._jvp, self._batch)

    @property
    def loss_class(self) -> type:
        """The loss class this tag constructs from its operands."""
        return self._cls

    @property
    def parameter_dependants_names(self) -> tuple[str, ...]:
        """Names of the loss's operands that depend on the parameters."""
        return self._dependants

    @property
    def parameter_independants_names(self) -> tuple[str, ...]:
        """Names of the loss's operands that do not depend on the parameters (e.g. targets)."""
        return self._independants

    def _dependant_positions(self, args_names: Sequence[str]) -> list[int]:
        return [i for i, n in enumerate(args_names) if n in self._dependants]

    def _impl(self, *args: Any, args_names: tuple[str, ...]) -> list[Any]:
        return [args[i] for i in self._dependant_positions(args_names)]

    def _abstract_eval(self, *avals: Any, args_names: tuple[str, ...]) -> list[Any]:
        return [avals[i] for i in self._dependant_positions(args_names)]

    def _jvp(self, primals: Sequence[Any], tangents: Sequence[Any], *, args_names: tuple[str, ...]):
        out = self.bind(*primals, args_names=args_names)
        return out, [tangents[i] for i in self._dependant_positions(args_names)]

    def _batch(self, args: Sequence[Any], dims: Sequence[Any], *, args_names: tuple[str, ...]):
        out = self.bind(*args, args_names=args_names)
        return out, [dims[i] for i in self._dependant_positions(args_names)]

    def bind(self, *args: Any, args_names: Sequence[str]) -> Any:  # type: ignore[override]
        """Binds the tag to ``args``, named by ``args_names``.

        Raises ``ValueError`` if the counts differ or a name is not one of the loss's operands.
        """
        if len(args) != len(args_names):
            raise ValueError(f"LossTag.bind got {len(args)} operands but {len(args_names)} names.")
        for n in args_names:
            if n not in self._dependants and n not in self._independants:
                raise ValueError(f"Unknown argument name {n!r} for loss {self._cls.__name__}.")
        return super().bind(*args, args_names=tuple(args_names))

    def loss(self, *args: Any, args_names: Sequence[str]) -> Any:
        """Builds the ``LossFunction`` instance that this tag stands for."""
        return self._cls(**dict(zip(args_names, args)))


class LayerTag(_compat.Primitive):
    """A primitive marking one layer: ``tag(*outputs, *inputs, *params, **meta)``.

    It returns its output operand(s) unchanged. Gradients flow through the real
    computation that produced the outputs, never through the tag's other operands.
    """

    def __init__(self, name: str, num_inputs: int, num_outputs: int):
        super().__init__(name)
        if num_outputs < 1:
            raise ValueError(f"LayerTag {name!r}: num_outputs must be >= 1, got {num_outputs}.")
        self._num_inputs = int(num_inputs)
        self._num_outputs = int(num_outputs)
        self.multiple_results = num_outputs > 1
        _compat.define_identity_rules(self, self._impl, self._abstract_eval, self._jvp, self._batch)

    @property
    def num_inputs(self) -> int:
        """Number of layer-input operands of the tag."""
        return self._num_inputs

    @property
    def num_outputs(self) -> int:
        """Number of layer-output operands of the tag."""
        return self._num_outputs

    def _select(self, xs: Sequence[Any]) -> Any:
        return list(xs[: self._num_outputs]) if self.multiple_results else xs[0]

    def _impl(self, *operands: Any, **_: Any) -> Any:
        return self._select(operands)

    def _abstract_eval(self, *avals: Any, **_: Any) -> Any:
        return self._select(avals)

    def _jvp(self, primals: Sequence[Any], tangents: Sequence[Any], **params: Any):
        return self.bind(*primals, **params), self._select(tangents)

    def _batch(self, args: Sequence[Any], dims: Sequence[Any], **params: Any):
        return self.bind(*args, **params), self._select(dims)

    def split_operands(self, operands: Sequence[Any]) -> tuple[tuple, tuple, tuple]:
        """Splits a tag's operands into (outputs, inputs, params)."""
        o, i = self._num_outputs, self._num_inputs
        return tuple(operands[:o]), tuple(operands[o : o + i]), tuple(operands[o + i :])


dense = LayerTag("dense", num_inputs=1, num_outputs=1)
generic = LayerTag("generic", num_inputs=0, num_outputs=1)


def register_dense(y: jax.Array, x: jax.Array, w: jax.Array, b: jax.Array | None = None, **kwargs: Any) -> jax.Array:
    """Marks ``y = x @ w (+ b)`` as a dense layer; returns ``y``.

    ``w`` has shape ``(d_in, d_out)``; ``x`` may have any number of leading dims.

    ``variant="<name>"`` (kfac-jax's keyword) marks a dense-like layer of that kind, e.g.
    FermiNet's ``"repeated_dense"`` or ``"qmc"``: estimators then build the block registered
    for the variant (``layer_tag_to_block_ctor`` / ``set_default_tag_to_block_ctor``),
    falling back to the ``"dense"`` one. A variant other than ``"dense"`` may have any
    shapes (as in kfac-jax; its block interprets them); ``variant="dense"`` is plain dense.
    """
    _check_array("y", y)
    _check_array("x", x)
    _check_array("w", w)
    variant = kwargs.pop("variant", None)
    if variant is not None and not isinstance(variant, str):
        raise TypeError(f"register_dense: `variant` must be a string, got {type(variant).__name__}.")
    if variant not in (None, "dense"):
        if b is not None:
            _check_array("b", b)
        operands = (y, x, w) if b is None else (y, x, w, b)
        return dense.bind(*operands, variant=variant, **kwargs)
    if w.ndim != 2:
        raise ValueError(f"register_dense: w must be a 2-D (d_in, d_out) array, got shape {w.shape}.")
    if x.shape[-1] != w.shape[0] or y.shape[-1] != w.shape[1]:
        raise ValueError(
            f"register_dense: shapes do not form y = x @ w: x {x.shape}, w {w.shape}, y {y.shape}."
        )
    if b is None:
        return dense.bind(y, x, w, **kwargs)
    _check_array("b", b)
    if b.shape != (w.shape[1],):
        raise ValueError(f"register_dense: b must have shape ({w.shape[1]},), got {b.shape}.")
    return dense.bind(y, x, w, b, **kwargs)


def register_generic(parameter: jax.Array) -> jax.Array:
    """Marks ``parameter`` to get its own generic (diagonal) curvature block."""
    _check_array("parameter", parameter)
    return generic.bind(parameter)


def _check_array(name: str, x: Any) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a JAX array, got {type(x).__name__}.")


@dataclasses.dataclass(frozen=True)
class LayerTagEqn:
    """A layer found in a traced function: what a curvature block is built from.

    This plays the role of kfac-jax's tag equation, without exposing jaxpr
    internals: shapes/dtypes of the tag's outputs, inputs and parameters, the
    tag's extra parameters (``meta``), and the flat indices of its parameters in
    the model's parameter pytree.
    """

    primitive: LayerTag
    outputs: tuple[jax.ShapeDtypeStruct, ...]
    inputs: tuple[jax.ShapeDtypeStruct, ...]
    params: tuple[jax.ShapeDtypeStruct, ...]
    param_indices: tuple[int, ...]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    name: str = ""

    @property
    def tag_name(self) -> str:
        """Name of the tag primitive of this equation."""
        return self.primitive.name

    @property
    def variant(self) -> str:
        """The layer's kind for choosing a block: ``meta["variant"]`` (kfac-jax's name; also read
        from a kfac-jax ``LayerMetaData`` under ``meta["meta"]``), else the tag's name."""
        meta = dict(self.meta or {})
        v = meta.get("variant")
        if v is None and meta.get("meta") is not None:
            v = getattr(meta["meta"], "variant", None)
        return v if isinstance(v, str) and v else self.primitive.name
