"""kfac-jax's ``patches_second_moment`` module: curvax's convolution patch moments.

Compatibility-only namespace; the implementations live in ``curvax.layers.conv``.
"""

from __future__ import annotations

from typing import Any, Sequence

from curvax.layers.conv import patches_moments, patches_moments_explicit, resolve_conv_spec

__all__ = ["num_conv_locations", "patches_moments", "patches_moments_explicit"]


def num_conv_locations(
    inputs_spatial_shape: Sequence[int],
    kernel_spatial_shape: int | Sequence[int],
    spatial_strides: int | Sequence[int],
    spatial_padding: Any,
) -> int:
    """The number of output locations of a convolution (product of the output's spatial sizes).

    ``kernel_spatial_shape`` and ``spatial_strides`` are ints (same for every
    spatial axis) or one per axis; ``spatial_padding`` is ``"VALID"``, ``"SAME"``
    or ``(low, high)`` pairs, as in ``jax.lax.conv_general_dilated``.
    """
    in_sp = tuple(int(d) for d in inputs_spatial_shape)
    n = len(in_sp)
    k_sp = (int(kernel_spatial_shape),) * n if isinstance(kernel_spatial_shape, int) else tuple(kernel_spatial_shape)
    strides = (int(spatial_strides),) * n if isinstance(spatial_strides, int) else tuple(spatial_strides)
    if len(k_sp) != n or len(strides) != n:
        raise ValueError(
            f"num_conv_locations: `kernel_spatial_shape` {k_sp} and `spatial_strides` {strides} must have one "
            f"entry per spatial axis of `inputs_spatial_shape` {in_sp}."
        )
    spec = resolve_conv_spec(
        (1, *in_sp, 1), (*k_sp, 1, 1), window_strides=strides, padding=spatial_padding, where="num_conv_locations"
    )
    count = 1
    for size, k, s, (lo, hi) in zip(in_sp, k_sp, strides, spec.padding):
        count *= max(0, (size + lo + hi - k) // s + 1)
    return count
