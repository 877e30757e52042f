"""kfac-jax's ``layers_and_loss_tags`` module, for ``import curvax as kfac_jax`` code.

Compatibility-only namespace. kfac-jax v0.0.8 marks every loss with one
``loss_tag`` primitive carrying a ``LossMetaData`` and every layer with one
``layer_tag`` carrying a ``LayerMetaData``. curvax has one primitive per loss
class and per layer kind (``curvax.tags``); the adapters here translate the
kfac-jax calling convention into curvax's tags, so both produce the same jaxpr.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import jax

from curvax import tags as _tags
from curvax.layers import conv as _conv
from curvax.layers.scale_and_shift import register_scale_and_shift  # noqa: F401
from curvax.tags import LayerTag, LayerTagEqn, LossTag, register_generic  # noqa: F401
from curvax.tracing import LayerData

T = TypeVar("T")
Array = jax.Array

__all__ = [
    "LayerData",
    "LayerMetaData",
    "LayerTag",
    "LossMetaData",
    "LossTag",
    "layer_eqn_data",
    "layer_tag",
    "loss_eqn_class_name",
    "loss_eqn_construct_loss",
    "loss_eqn_parameter_dependants",
    "loss_tag",
    "register_conv2d",
    "register_dense",
    "register_generic",
    "register_scale_and_shift",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerMetaData:
    """kfac-jax's description of a layer tag's operands (compatibility-only; curvax tags
    know their operand layout from the tag itself)."""

    variant: str
    outputs_index: tuple[int, ...]
    inputs_index: tuple[int, ...]
    params_index: tuple[int, ...]
    name: str | None = None
    nesting: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossMetaData(Generic[T]):
    """What ``loss_tag.bind`` needs to know about a loss (kfac-jax name).

    ``loss_class`` is built as ``loss_class(**dict(zip(argument_names, args)))``;
    ``parameter_dependants`` name the arguments the parameters influence.
    """

    loss_class: type
    parameter_dependants: tuple[str, ...]
    parameter_independants: tuple[str, ...]
    argument_names: tuple[str, ...]


class _LossTagBinder:
    """kfac-jax's single ``loss_tag`` primitive: ``loss_tag.bind(*args, meta=LossMetaData)``.

    Compatibility-only. It binds curvax's ``LossTag`` for ``meta.loss_class``
    (one per class and argument split, created on first use and then reused, so
    the jaxpr holds the same primitive each time).
    """

    def __init__(self) -> None:
        self._tags: dict[tuple, LossTag] = {}

    def tag_for(self, meta: LossMetaData) -> LossTag:
        """The curvax ``LossTag`` standing for ``meta``'s loss class."""
        if not isinstance(meta, LossMetaData):
            raise TypeError(f"loss_tag.bind: `meta` must be a LossMetaData, got {type(meta).__name__}.")
        key = (meta.loss_class, tuple(meta.parameter_dependants), tuple(meta.parameter_independants))
        if key not in self._tags:
            self._tags[key] = LossTag(*key)
        return self._tags[key]

    def bind(self, *args: Any, meta: LossMetaData) -> tuple[Array, ...]:
        """Tags ``args`` (named by ``meta.argument_names``); returns the parameter-dependent ones."""
        tag = self.tag_for(meta)
        if len(args) != len(meta.argument_names):
            raise ValueError(
                f"loss_tag.bind: got {len(args)} arguments but meta.argument_names has "
                f"{len(meta.argument_names)} names {tuple(meta.argument_names)}."
            )
        return tuple(tag.bind(*args, args_names=tuple(meta.argument_names)))


loss_tag = _LossTagBinder()
"""kfac-jax's ``loss_tag`` (compatibility-only; see ``_LossTagBinder``)."""

layer_tag = _tags.dense
"""kfac-jax's ``layer_tag`` primitive, as used by ``GraphPattern(tag_primitive=...)``.

Compatibility-only: kfac-jax has one layer primitive whose ``meta.variant`` names
the kind; in curvax the kind is the primitive, and a pattern's
``parameters_extractor_func`` may return ``variant`` to pick a registered kind.
Patterns over dense-like computations (FermiNet's repeated dense) use this one.
"""


_DOT_GENERAL_KWARGS = ("dimension_numbers", "precision", "preferred_element_type", "out_sharding")


def register_dense(y: Array, x: Array, w: Array, b: Array | None = None, variant: str = "dense", **kwargs: Any) -> Array:
    """``curvax.register_dense`` accepting kfac-jax's extra ``dot_general`` keywords.

    Compatibility-only. kfac-jax passes the layer's ``dot_general`` parameters
    through the tag; curvax's dense tag always means "contract ``x``'s last axis
    with ``w``'s first", so ``dimension_numbers`` must say exactly that and the
    other ``dot_general`` keywords (precision, output type, sharding) are dropped.
    """
    dn = kwargs.pop("dimension_numbers", None)
    if dn is not None:
        (lc, rc), (lb, rb) = dn
        if tuple(lc) != (x.ndim - 1,) or tuple(rc) != (0,) or tuple(lb) or tuple(rb):
            raise ValueError(
                "register_dense: curvax's dense tag contracts x's last axis with w's first and has no batch "
                f"axes, i.e. dimension_numbers=((({x.ndim - 1},), (0,)), ((), ())); got {dn!r}."
            )
    for k in _DOT_GENERAL_KWARGS:
        kwargs.pop(k, None)
    if variant != "dense":
        kwargs["variant"] = variant
    return _tags.register_dense(y, x, w, b, **kwargs)


def register_conv2d(y: Array, x: Array, w: Array, b: Array | None = None, variant: str = "conv2d", **kwargs: Any) -> Array:
    """``curvax.register_conv2d`` accepting kfac-jax's keywords (compatibility-only).

    ``out_sharding`` (a ``conv_general_dilated`` keyword newer than curvax's
    conv tag) must be None; ``variant`` must be ``"conv2d"``.
    """
    if kwargs.pop("out_sharding", None) is not None:
        raise ValueError("register_conv2d: `out_sharding` is not supported by curvax's conv tag; pass None.")
    if variant != "conv2d":
        raise ValueError(f"register_conv2d: only variant='conv2d' is supported, got {variant!r}.")
    return _conv.register_conv2d(y, x, w, b, **kwargs)


# --- reading tag equations (kfac-jax helpers over jaxpr equations) ------------------------


def _check_loss_eqn(eqn: Any) -> LossTag:
    if not isinstance(getattr(eqn, "primitive", None), LossTag):
        raise ValueError(f"Expected a loss tag equation, got primitive {getattr(eqn, 'primitive', eqn)!r}.")
    return eqn.primitive


def loss_eqn_parameter_dependants(eqn: Any, raise_an_error: bool = True) -> list[Any]:
    """The operands of a loss tag equation that depend on the parameters (e.g. the logits)."""
    if not isinstance(getattr(eqn, "primitive", None), LossTag):
        if raise_an_error:
            _check_loss_eqn(eqn)
        return []
    names = eqn.params["args_names"]
    return [v for v, n in zip(eqn.invars, names) if n in eqn.primitive.parameter_dependants_names]


def loss_eqn_construct_loss(eqn: Any, *args: Any) -> Any:
    """The ``LossFunction`` a loss tag equation stands for, built from the values ``args`` of its operands."""
    return _check_loss_eqn(eqn).loss(*args, args_names=eqn.params["args_names"])


def loss_eqn_class_name(eqn: Any) -> str:
    """The name of the loss class of a loss tag equation."""
    return _check_loss_eqn(eqn).loss_class.__name__


def layer_eqn_data(eqn: Any, raise_an_error: bool = True) -> LayerData:
    """A layer tag equation's operands (variables) split into ``LayerData`` (empty for other equations)."""
    if not isinstance(getattr(eqn, "primitive", None), LayerTag):
        if raise_an_error:
            raise ValueError(f"Expected a layer tag equation, got primitive {getattr(eqn, 'primitive', eqn)!r}.")
        return LayerData(inputs=(), outputs=(), params=())
    outputs, inputs, params = eqn.primitive.split_operands(eqn.invars)
    return LayerData(inputs=inputs, outputs=outputs, params=params)
