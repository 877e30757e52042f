"""Layer-tag equations built from shapes alone (float64), for testing blocks without tracing a model.

Shared by ``test_blocks.py``, ``test_ekfac.py`` and ``test_tnt.py``.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from curvax import tags


def sds(shape: Sequence[int]) -> jax.ShapeDtypeStruct:
    """A float64 abstract value of ``shape``."""
    return jax.ShapeDtypeStruct(tuple(shape), jnp.float64)


def dense_eqn(d_in: int, d_out: int, batch: int = 4, extra: tuple[int, ...] = (), bias: bool = True,
              layout: str = "io") -> tags.LayerTagEqn:
    """A dense layer's tag equation: inputs ``(batch, *extra, d_in)``, a ``layout`` kernel
    (``"io"``: ``(d_in, d_out)``; ``"oi"``: transposed) and, with ``bias``, a bias."""
    w_shape = (d_in, d_out) if layout == "io" else (d_out, d_in)
    params = (sds(w_shape),) + ((sds((d_out,)),) if bias else ())
    return tags.LayerTagEqn(
        primitive=tags.dense, outputs=(sds((batch, *extra, d_out)),), inputs=(sds((batch, *extra, d_in)),),
        params=params, param_indices=tuple(range(len(params))), meta={"kernel_layout": layout}, name="layer",
    )


def generic_eqn(*shapes: Sequence[int]) -> tags.LayerTagEqn:
    """A generic tag equation over parameters of these shapes."""
    params = tuple(sds(s) for s in shapes)
    return tags.LayerTagEqn(primitive=tags.generic, outputs=(), inputs=(), params=params,
                            param_indices=tuple(range(len(params))), meta={}, name="gen")
