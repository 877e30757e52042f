"""kfac-jax v0.0.8's ``tracer`` module, for ``import curvax as kfac_jax`` code.

Compatibility-only namespace. The two API generations differ in what the
transformations return, and cannot be told apart by the call:

* documented generation -- ``curvax.loss_tags_vjp(func)`` (also ``jvp``/``hvp``
  and ``layer_tags_vjp``) returns the transformed function ``f``;
  ``layer_tags_vjp``'s ``f`` gives one dict per layer.
* v0.0.8 generation -- the functions of *this* module (``curvax.tracer.*``)
  return ``(f, jaxpr_extractor)``, where ``jaxpr_extractor(func_args)`` is the
  ``ProcessedJaxpr`` that ``f`` uses for those arguments, and
  ``layer_tags_vjp``'s ``f`` gives one ``LayerVjpData`` per layer.

The rule: top-level ``curvax.*`` names keep the documented generation; the
``tracer`` namespace has v0.0.8's. Both share one implementation
(``curvax.transforms``), so they give identical products.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from curvax import transforms as _transforms
from curvax.layers.scale_and_shift import scale_and_shift_product as _scale_and_shift_product
from curvax.tracing import LayerData, LayerVjpData
from curvax.transforms import ProcessedJaxpr, auto_register_tags  # noqa: F401

JaxprExtractor = Callable[..., ProcessedJaxpr]

__all__ = [
    "LayerVjpData",
    "ProcessedJaxpr",
    "compute_all_losses",
    "layer_tags_vjp",
    "loss_tags_hvp",
    "loss_tags_jvp",
    "loss_tags_vjp",
]


def _with_extractor(f: Callable[..., Any]) -> tuple[Callable[..., Any], JaxprExtractor]:
    cache = f.processed_jaxpr  # type: ignore[attr-defined]

    def jaxpr_extractor(func_args: Sequence[Any], *_: Any) -> ProcessedJaxpr:
        """The ``ProcessedJaxpr`` the transformed function uses for ``func_args``."""
        return cache.get(func_args)

    return f, jaxpr_extractor


def loss_tags_vjp(func: Callable[..., Any], params_index: int = 0) -> tuple[Callable[..., Any], JaxprExtractor]:
    """v0.0.8 ``loss_tags_vjp``: ``(f, jaxpr_extractor)`` with ``f`` as ``curvax.loss_tags_vjp``'s."""
    return _with_extractor(_transforms.loss_tags_vjp(func, params_index))


def loss_tags_jvp(func: Callable[..., Any], params_index: int = 0) -> tuple[Callable[..., Any], JaxprExtractor]:
    """v0.0.8 ``loss_tags_jvp``: ``(f, jaxpr_extractor)`` with ``f`` as ``curvax.loss_tags_jvp``'s."""
    return _with_extractor(_transforms.loss_tags_jvp(func, params_index))


def loss_tags_hvp(func: Callable[..., Any], params_index: int = 0) -> tuple[Callable[..., Any], JaxprExtractor]:
    """v0.0.8 ``loss_tags_hvp``: ``(f, jaxpr_extractor)``; ``f(func_args, v) -> (H v, losses)``."""
    return _with_extractor(_transforms.loss_tags_hvp(func, params_index))


def compute_all_losses(func: Callable[..., Any], params_index: int = 0) -> tuple[Callable[..., Any], JaxprExtractor]:
    """v0.0.8 ``compute_all_losses``: ``(f, jaxpr_extractor)``; ``f(func_args)`` is the tuple of losses."""
    vjp = _transforms.loss_tags_vjp(func, params_index)

    def losses(func_args: Sequence[Any]) -> tuple[Any, ...]:
        return vjp(func_args)[0]

    losses.processed_jaxpr = vjp.processed_jaxpr  # type: ignore[attr-defined]
    return _with_extractor(losses)


def _as_layer_vjp_data(entry: dict, site: Any) -> LayerVjpData:
    inputs = tuple(entry["inputs"])
    if site.tag is _scale_and_shift_product:
        # curvax keeps a normalisation's input as two factors (x_hat = x1 * x2);
        # kfac-jax's layer data holds x_hat itself.
        inputs = (inputs[0] * inputs[1],)
    return LayerVjpData(
        primals=LayerData(inputs=inputs, outputs=tuple(entry["outputs"]), params=tuple(entry["params"])),
        tangents=LayerData(inputs=(), outputs=tuple(entry["outputs_tangent"]), params=tuple(entry["params_tangent"])),
    )


def layer_tags_vjp(
    func: Callable[..., Any],
    params_index: int = 0,
    auto_register_tags: bool = True,
    raise_error_on_diff_jaxpr: bool = True,
    **auto_registration_kwargs: Any,
) -> tuple[Callable[..., Any], JaxprExtractor]:
    """v0.0.8 ``layer_tags_vjp``: ``(f, jaxpr_extractor)``.

    ``f(func_args) -> (losses, vjp)``; ``vjp(loss_cotangents)`` is a tuple with
    one ``LayerVjpData`` per layer, holding the same arrays as the dicts of
    ``curvax.layer_tags_vjp`` (features last).
    """
    documented = _transforms.layer_tags_vjp(
        func, params_index, auto_register_tags, raise_error_on_diff_jaxpr, **auto_registration_kwargs
    )

    def wrapped(func_args: Sequence[Any]) -> tuple[tuple[Any, ...], Callable[[Any], tuple[LayerVjpData, ...]]]:
        losses, vjp = documented(func_args)
        sites = documented.processed_jaxpr.get(func_args).layer_sites  # the order of vjp's entries

        def vjp_fn(cotangents: Sequence[Sequence[Any]]) -> tuple[LayerVjpData, ...]:
            return tuple(_as_layer_vjp_data(e, site) for e, site in zip(vjp(cotangents), sites))

        return losses, vjp_fn

    wrapped.processed_jaxpr = documented.processed_jaxpr  # type: ignore[attr-defined]
    return _with_extractor(wrapped)
