"""kfac-jax's ``loss_functions`` module: curvax's losses under kfac-jax names.

Compatibility-only namespace; the implementations live in ``curvax.losses``.
"""

from __future__ import annotations

from typing import Any

import jax

from curvax.losses import *  # noqa: F401,F403
from curvax.losses import __all__ as _losses_all

LossFunctionInputs = tuple[jax.Array, ...]
"""The parameter-dependent inputs of one loss (kfac-jax type name)."""


def filter_none(**kwargs: Any) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """The non-None keyword arguments as ``(values, names)`` (kfac-jax helper for ``loss_tag.bind``)."""
    pairs = [(v, k) for k, v in kwargs.items() if v is not None]
    if not pairs:
        raise ValueError("filter_none: every argument is None; a loss needs at least one input.")
    values, names = zip(*pairs)
    return tuple(values), tuple(names)


__all__ = [*_losses_all, "LossFunctionInputs", "filter_none"]
