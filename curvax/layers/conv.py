"""Convolution layers (1-D, 2-D, 3-D): tags, detection, patch moments, curvature blocks.

A convolution ``y = conv(x, W) (+ b)`` is described by the parameters of
``jax.lax.conv_general_dilated`` (strides, explicit padding pairs, lhs/rhs
dilation, dimension numbers, feature groups), which the tag carries as its
``meta``. Blocks read the inputs and output cotangents in the layer's own
layout (NHWC, NCHW, ...), so nothing is transposed before they see it.

Parameter arrangement of the Kronecker block: ``V = [W_flat; b^T]`` where
``W_flat`` is the kernel transposed to ``(*spatial, in, out)`` and reshaped to
``(prod(spatial) * in, out)``: rows follow the patch order of
``patches_moments`` (spatial offsets major, input channel minor).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from curvax import blocks, detection, linalg, tags
from curvax.tracing import Key, Lit, Program

Array = jax.Array

_SPATIAL_LETTERS = {1: "W", 2: "HW", 3: "DHW"}
_DEFAULT_DIMENSION_NUMBERS = {n: ("N" + s + "C", s + "IO", "N" + s + "C") for n, s in _SPATIAL_LETTERS.items()}
_CONV_KWARGS = (
    "window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers",
    "feature_group_count", "batch_group_count", "precision", "preferred_element_type",
)
# Ops that leave the values of a convolution output unchanged when they restore its shape.
_SHAPE_ONLY = frozenset({"reshape", "squeeze", "expand_dims", "copy"})
_ADD_OPS = frozenset({"add", "add_any"})

conv1d = tags.LayerTag("conv1d", num_inputs=1, num_outputs=1)
conv2d = tags.LayerTag("conv2d", num_inputs=1, num_outputs=1)
conv3d = tags.LayerTag("conv3d", num_inputs=1, num_outputs=1)
_TAGS = {1: conv1d, 2: conv2d, 3: conv3d}


# ----------------------------------------------------------------------------------
# Convolution description
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvSpec:
    """A fully resolved ``conv_general_dilated`` configuration (padding as explicit pairs)."""

    window_strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    dimension_numbers: lax.ConvDimensionNumbers
    feature_group_count: int = 1
    batch_group_count: int = 1
    precision: Any = None

    @property
    def num_spatial(self) -> int:
        return len(self.window_strides)

    def conv(self, x: Array, w: Array) -> Array:
        """The convolution itself."""
        return lax.conv_general_dilated(
            x, w, self.window_strides, self.padding, self.lhs_dilation, self.rhs_dilation,
            self.dimension_numbers, self.feature_group_count, self.batch_group_count, self.precision,
        )

    def meta(self) -> dict[str, Any]:
        """The tag parameters (hashable values)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def kernel_perm(self) -> tuple[int, ...]:
        """Kernel axes in ``(*spatial, in, out)`` order."""
        r = self.dimension_numbers.rhs_spec
        return (*r[2:], r[1], r[0])


def _ints(value: Any, n: int, name: str, where: str, default: int = 1) -> tuple[int, ...]:
    if value is None:
        return (default,) * n
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (int(value),) * n
    try:
        out = tuple(int(v) for v in value)
        ok = len(out) == n and all(v >= 1 and v == u for v, u in zip(out, value))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{where}: `{name}` must be a positive int or {n} positive ints, got {value!r}.")
    return out


def _dimension_numbers(dn: Any, ndim: int, where: str) -> lax.ConvDimensionNumbers:
    n = ndim - 2
    if dn is None:
        dn = _DEFAULT_DIMENSION_NUMBERS.get(n)
        if dn is None:
            raise ValueError(f"{where}: only 1, 2 or 3 spatial dimensions are supported, got arrays of rank {ndim}.")
    try:
        out = lax.conv_dimension_numbers((1,) * ndim, (1,) * ndim, dn)
    except Exception as e:  # noqa: BLE001 - re-raised with the argument named
        raise ValueError(
            f"{where}: `dimension_numbers` must be a lax.ConvDimensionNumbers or three layout strings such as "
            f"('NHWC', 'HWIO', 'NHWC') for rank-{ndim} arrays, got {dn!r} ({e})."
        ) from None
    return lax.ConvDimensionNumbers(*(tuple(int(i) for i in s) for s in out))


def resolve_conv_spec(
    lhs_shape: Sequence[int],
    rhs_shape: Sequence[int],
    *,
    window_strides: Any = None,
    padding: Any = "VALID",
    lhs_dilation: Any = None,
    rhs_dilation: Any = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    where: str = "conv",
) -> ConvSpec:
    """Validates convolution arguments and resolves them to a ``ConvSpec``.

    ``dimension_numbers=None`` means channels last (``NHWC``/``HWIO``/``NHWC``
    for 2-D); string padding (``"SAME"``, ``"VALID"``, ``"SAME_LOWER"``) becomes
    explicit pairs as ``lax.conv_general_dilated`` computes them.
    """
    lhs_shape, rhs_shape = tuple(lhs_shape), tuple(rhs_shape)
    if len(lhs_shape) != len(rhs_shape) or len(lhs_shape) not in (3, 4, 5):
        raise ValueError(
            f"{where}: inputs and kernel must both have rank 3, 4 or 5 (1-3 spatial dims), got shapes "
            f"{lhs_shape} and {rhs_shape}."
        )
    n = len(lhs_shape) - 2
    dn = _dimension_numbers(dimension_numbers, len(lhs_shape), where)
    strides = _ints(window_strides, n, "window_strides", where)
    lhs_dil = _ints(lhs_dilation, n, "lhs_dilation", where)
    rhs_dil = _ints(rhs_dilation, n, "rhs_dilation", where)
    for name, v in (("feature_group_count", feature_group_count), ("batch_group_count", batch_group_count)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{where}: `{name}` must be a positive int, got {v!r}.")
    c_in = lhs_shape[dn.lhs_spec[1]]
    if c_in % feature_group_count or rhs_shape[dn.rhs_spec[1]] * feature_group_count != c_in:
        raise ValueError(
            f"{where}: with feature_group_count={feature_group_count} the kernel's input-channel axis must be "
            f"{c_in} / {feature_group_count}; inputs {lhs_shape}, kernel {rhs_shape}."
        )
    k_sp = tuple(rhs_shape[i] for i in dn.rhs_spec[2:])
    if isinstance(padding, str):
        eff = tuple((k - 1) * d + 1 for k, d in zip(k_sp, rhs_dil))
        in_sp = tuple(lhs_shape[i] for i in dn.lhs_spec[2:])
        try:
            pads = lax.padtype_to_pads(in_sp, eff, strides, padding)
        except Exception:  # noqa: BLE001
            raise ValueError(f"{where}: `padding` must be 'SAME', 'VALID', 'SAME_LOWER' or pairs, got {padding!r}.") from None
    else:
        try:
            pads = [tuple(int(p) for p in pair) for pair in padding]
            ok = len(pads) == n and all(len(p) == 2 for p in pads)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{where}: `padding` must be a string or {n} (low, high) int pairs, got {padding!r}.")
    pads = tuple((int(lo), int(hi)) for lo, hi in pads)
    return ConvSpec(strides, pads, lhs_dil, rhs_dil, dn, int(feature_group_count), int(batch_group_count), precision)


def spec_from_meta(meta: Mapping[str, Any], lhs_shape: Sequence[int], rhs_shape: Sequence[int], where: str) -> ConvSpec:
    """The ``ConvSpec`` of a conv tag's ``meta`` (missing keys take their defaults)."""
    kwargs = {k: meta[k] for k in _CONV_KWARGS if k in meta and k != "preferred_element_type"}
    return resolve_conv_spec(lhs_shape, rhs_shape, where=where, **kwargs)


# ----------------------------------------------------------------------------------
# Manual registration
# ----------------------------------------------------------------------------------


def _register(num_spatial: int, y: Array, x: Array, w: Array, b: Array | None, kwargs: dict) -> Array:
    where = f"register_conv{num_spatial}d"
    tags._check_array("y", y)
    tags._check_array("x", x)
    tags._check_array("w", w)
    unknown = sorted(set(kwargs) - set(_CONV_KWARGS))
    if unknown:
        raise TypeError(f"{where}: unknown keyword arguments {unknown}; expected some of {list(_CONV_KWARGS)}.")
    for name, a in (("x", x), ("w", w), ("y", y)):
        if a.ndim != num_spatial + 2:
            raise ValueError(f"{where}: `{name}` must have rank {num_spatial + 2}, got shape {a.shape}.")
    kwargs = {k: v for k, v in kwargs.items() if k != "preferred_element_type"}
    spec = resolve_conv_spec(x.shape, w.shape, where=where, **kwargs)
    if spec.batch_group_count != 1:
        raise ValueError(f"{where}: batch_group_count must be 1 (it mixes examples), got {spec.batch_group_count}.")
    want = jax.eval_shape(spec.conv, jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype))
    if tuple(y.shape) != tuple(want.shape):
        raise ValueError(
            f"{where}: y has shape {tuple(y.shape)}, but the convolution of x {tuple(x.shape)} with w "
            f"{tuple(w.shape)} and these arguments has shape {tuple(want.shape)}."
        )
    operands = [y, x, w]
    if b is not None:
        tags._check_array("b", b)
        c_out = w.shape[spec.dimension_numbers.rhs_spec[0]]
        if b.size != c_out or sum(d != 1 for d in b.shape) > 1:
            raise ValueError(f"{where}: b must hold one value per output channel ({c_out},), got shape {b.shape}.")
        operands.append(b)
    return _TAGS[num_spatial].bind(*operands, **spec.meta())


def register_conv1d(y: Array, x: Array, w: Array, b: Array | None = None, **kwargs: Any) -> Array:
    """Marks ``y = conv1d(x, w) (+ b)`` as a 1-D convolution layer; returns ``y``.

    Same arguments as ``register_conv2d`` (default layout ``NWC``/``WIO``).
    """
    return _register(1, y, x, w, b, kwargs)


def register_conv2d(y: Array, x: Array, w: Array, b: Array | None = None, **kwargs: Any) -> Array:
    """Marks ``y = conv2d(x, w) (+ b)`` as a 2-D convolution layer; returns ``y``.

    ``kwargs`` are those of ``jax.lax.conv_general_dilated``: ``window_strides``,
    ``padding`` (string or pairs), ``lhs_dilation``, ``rhs_dilation``,
    ``dimension_numbers`` (default ``("NHWC", "HWIO", "NHWC")``),
    ``feature_group_count``, ``precision``. ``y``'s shape is checked against them.
    """
    return _register(2, y, x, w, b, kwargs)


def register_conv3d(y: Array, x: Array, w: Array, b: Array | None = None, **kwargs: Any) -> Array:
    """Marks ``y = conv3d(x, w) (+ b)`` as a 3-D convolution layer; returns ``y``.

    Same arguments as ``register_conv2d`` (default layout ``NDHWC``/``DHWIO``).
    """
    return _register(3, y, x, w, b, kwargs)


# ----------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------


def _bias_on_channels(program: Program, chain: Sequence[int], bias: Key, out_shape: tuple, axis: int) -> bool:
    """Whether the plumbing puts bias element j at channel j of ``axis`` (any bias shape with that size)."""
    shape = tuple(program.avals[bias].shape)
    if len(shape) == 1:
        return detection.bias_maps_to_feature_axis(program, chain, bias, out_shape, axis)
    if math.prod(shape) != out_shape[axis]:
        return False
    got = detection.push_labels(program, chain, np.arange(1, out_shape[axis] + 1, dtype=np.float32).reshape(shape), out_shape)
    if got is None:
        return False
    want_shape = [1] * len(out_shape)
    want_shape[axis] = out_shape[axis]
    want = np.broadcast_to(np.arange(1, out_shape[axis] + 1, dtype=np.float32).reshape(want_shape), out_shape)
    return bool(np.array_equal(got, want))


def _make_matcher(num_spatial: int) -> detection.Matcher:
    name = f"conv{num_spatial}d"

    def match(program: Program, idx: int, ctx: detection.Context) -> detection.Match | None:
        node = program.nodes[idx]
        if node.primitive.name != "conv_general_dilated" or len(node.inputs) != 2:
            return None
        x, w_in = node.inputs
        found = detection.cast_source(program, ctx, w_in)
        if found is None or isinstance(x, Lit) or x == found[0]:
            return None
        w, casts = found
        if len(program.avals[w].shape) != num_spatial + 2:
            return None
        p = node.params
        if p.get("batch_group_count", 1) != 1:
            return None
        try:
            spec = resolve_conv_spec(
                program.avals[x].shape, program.avals[w].shape,
                window_strides=p["window_strides"], padding=p["padding"], lhs_dilation=p["lhs_dilation"],
                rhs_dilation=p["rhs_dilation"], dimension_numbers=p["dimension_numbers"],
                feature_group_count=p["feature_group_count"], precision=p.get("precision"), where=name,
            )
        except (ValueError, KeyError):
            return None
        y = node.outputs[0]
        out_shape = tuple(program.avals[y].shape)
        axis = spec.dimension_numbers.out_spec[1]
        nodes, params, output, pattern = {idx, *casts}, (w,), y, f"{name}_no_bias"
        # Follow shape-only plumbing (e.g. equinox's vmapped reshape/squeeze) to a bias add.
        cur, path = y, []
        while True:
            users = ctx.consumers(program, cur)
            if len(users) != 1:
                break
            user = program.nodes[users[0]]
            if user.primitive.name in _ADD_OPS and tuple(program.avals[cur].shape) == out_shape:
                other = user.inputs[1] if user.inputs[0] == cur else user.inputs[0]
                bias = detection.bias_source(program, ctx, other)
                add_out = user.outputs[0]
                if (
                    bias is not None and bias[0] != w
                    and tuple(program.avals[add_out].shape) == out_shape
                    and _bias_on_channels(program, bias[1], bias[0], out_shape, axis)
                ):
                    params, output, pattern = (w, bias[0]), add_out, f"{name}_with_bias"
                    nodes |= {*path, users[0], *bias[1]}
                break
            if user.primitive.name not in _SHAPE_ONLY or len(user.inputs) != 1:
                break
            path.append(users[0])
            cur = user.outputs[0]
        return detection.Match(_TAGS[num_spatial], output, (x,), params, spec.meta(), pattern, frozenset(nodes))

    match.__name__ = f"match_{name}"
    match.__doc__ = f"``conv_general_dilated`` with {num_spatial} spatial dims and a parameter kernel (+ bias add)."
    return match


def _manual_defaults(num_spatial: int) -> dict[str, Any]:
    return {
        "window_strides": (1,) * num_spatial, "padding": "VALID", "lhs_dilation": (1,) * num_spatial,
        "rhs_dilation": (1,) * num_spatial, "dimension_numbers": _DEFAULT_DIMENSION_NUMBERS[num_spatial],
        "feature_group_count": 1, "batch_group_count": 1, "precision": None,
    }


match_conv1d, match_conv2d, match_conv3d = (_make_matcher(n) for n in (1, 2, 3))
for _n, _fn in ((1, match_conv1d), (2, match_conv2d), (3, match_conv3d)):
    detection.register_layer_matcher(
        f"conv{_n}d", _fn, (f"conv{_n}d_with_bias", f"conv{_n}d_no_bias"), manual_meta_defaults=_manual_defaults(_n)
    )


# ----------------------------------------------------------------------------------
# Patch moments
# ----------------------------------------------------------------------------------


def _patches_setup(
    inputs: Array, kernel_spatial_shape: Any, strides: Any, padding: Any, data_format: str | None,
    dim_numbers: Any, inputs_dilation: Any, kernel_dilation: Any, feature_group_count: int,
    batch_group_count: int, precision: Any, where: str,
) -> tuple[ConvSpec, tuple[int, ...], int]:
    """Resolves ``patches_moments`` arguments: (spec of a 1-output-channel conv, kernel shape, channels).

    The default ``data_format="NHWC"`` stands for channels last at any rank.
    """
    tags._check_array("inputs", inputs)
    if inputs.ndim != 4 and data_format == "NHWC":
        data_format = None
    n = inputs.ndim - 2
    if n not in _SPATIAL_LETTERS:
        raise ValueError(f"{where}: `inputs` must have rank 3, 4 or 5 (batch, channels, 1-3 spatial), got {inputs.shape}.")
    k_sp = _ints(kernel_spatial_shape, n, "kernel_spatial_shape", where)
    if dim_numbers is None:
        sp = _SPATIAL_LETTERS[n]
        fmt = "N" + sp + "C" if data_format is None else data_format
        if fmt not in ("N" + sp + "C", "NC" + sp):
            raise ValueError(f"{where}: `data_format` must be 'N{sp}C' or 'NC{sp}' for rank-{n + 2} inputs, got {data_format!r}.")
        dim_numbers = (fmt, "OI" + sp, fmt)
    dn = _dimension_numbers(dim_numbers, inputs.ndim, where)
    c = inputs.shape[dn.lhs_spec[1]]
    if batch_group_count != 1:
        raise ValueError(f"{where}: `batch_group_count` must be 1, got {batch_group_count!r}.")
    if feature_group_count not in (1, c):
        raise ValueError(
            f"{where}: `feature_group_count` must be 1 or the number of input channels ({c}), got {feature_group_count!r}."
        )
    kernel = [0] * inputs.ndim
    kernel[dn.rhs_spec[0]], kernel[dn.rhs_spec[1]] = 1, c
    for i, k in zip(dn.rhs_spec[2:], k_sp):
        kernel[i] = k
    spec = resolve_conv_spec(
        inputs.shape, kernel, window_strides=strides, padding=padding, lhs_dilation=inputs_dilation,
        rhs_dilation=kernel_dilation, dimension_numbers=dn, precision=precision, where=where,
    )
    return spec, k_sp, c


def _patches_precision(precision: Any) -> Any:
    """The precision to extract patches with, from a convolution's ``precision``.

    ``lax.conv_general_dilated_patches`` takes one precision for its input (it pairs it with
    ``DEFAULT`` for its one-hot kernel itself), while a traced convolution carries an
    ``(lhs, rhs)`` pair (or a dot algorithm): the input's half is what rounds the patches.
    A dot algorithm (or a preset's name) has no per-operand half; patches are then copied
    exactly (``HIGHEST``). Strings become ``lax.Precision`` values (JAX rejects mixed pairs).
    """
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
        precision = precision[0]
    if precision is None or isinstance(precision, lax.Precision):
        return precision
    if isinstance(precision, str):
        try:
            return lax.Precision(precision)
        except ValueError:
            pass
    return lax.Precision.HIGHEST


def _kernel_shape(spec: ConvSpec, k_sp: Sequence[int], c_out: int, c_in: int) -> tuple[int, ...]:
    shape = [0] * (spec.num_spatial + 2)
    r = spec.dimension_numbers.rhs_spec
    shape[r[0]], shape[r[1]] = c_out, c_in
    for i, k in zip(r[2:], k_sp):
        shape[i] = k
    return tuple(shape)


def _weights_in_out_layout(weighting_array: Any, out_shape: Sequence[int], spec: ConvSpec, where: str) -> Array:
    """The weighting array in the output's layout with a size-1 channel axis."""
    out_spec = spec.dimension_numbers.out_spec
    w = jnp.asarray(weighting_array)
    n = spec.num_spatial
    if w.ndim == 1:
        shape = [1] * (n + 2)
        shape[out_spec[0]] = w.shape[0]
        w = w.reshape(shape)
    elif w.ndim == n + 1:
        w = jnp.expand_dims(w, out_spec[1])
    elif w.ndim != n + 2:
        raise ValueError(
            f"{where}: `weighting_array` must have shape (batch,), the output's shape without its channel axis, "
            f"or the output's shape with a size-1 channel axis; got {w.shape} for outputs {tuple(out_shape)}."
        )
    want = list(out_shape)
    want[out_spec[1]] = 1
    try:
        return jnp.broadcast_to(w, want)
    except ValueError:
        raise ValueError(f"{where}: `weighting_array` of shape {w.shape} does not broadcast to {tuple(want)}.") from None


def _conv_patches(x: Array, spec: ConvSpec, k_sp: Sequence[int]) -> Array:
    """Every patch of ``x`` that the convolution ``spec`` reads, in its output layout.

    One ``lax.conv_general_dilated_patches``: the channel axis of the result holds
    a patch's features in (input channel, kernel offset) order.
    """
    return lax.conv_general_dilated_patches(
        x, tuple(k_sp), spec.window_strides, spec.padding, spec.lhs_dilation, spec.rhs_dilation,
        spec.dimension_numbers, _patches_precision(spec.precision),
    )


def _sliced_patches(x: Array, spec: ConvSpec, k_sp: Sequence[int]) -> Array:
    """Every patch of ``x`` that the convolution ``spec`` reads, as ``(batch, *out_spatial, k, C)``.

    The same values as ``_conv_patches`` (rearranged), taken by copying instead of convolving:
    one ``lax.pad`` (its interior padding is the input dilation) and one strided slice per kernel
    offset, stacked in the kernel's (offset, channel) order. XLA on CPU runs the one-hot grouped
    convolution of ``conv_general_dilated_patches`` ~10x slower than the layer's own convolution;
    slices cost a copy of the patches. Copies are exact at any precision. Plain convolutions
    (``feature_group_count == batch_group_count == 1``) only.
    """
    lhs = spec.dimension_numbers.lhs_spec
    xc = jnp.transpose(x, (lhs[0], *lhs[2:], lhs[1]))  # (batch, *spatial, channels)
    config = [(0, 0, 0)] + [(lo, hi, d - 1) for (lo, hi), d in zip(spec.padding, spec.lhs_dilation)] + [(0, 0, 0)]
    xp = lax.pad(xc, jnp.zeros((), xc.dtype), config)
    out_sp = [
        (size - ((k - 1) * d + 1)) // s + 1
        for size, k, d, s in zip(xp.shape[1:-1], k_sp, spec.rhs_dilation, spec.window_strides)
    ]
    pieces = []
    for offset in np.ndindex(*k_sp):
        start = [0] + [o * d for o, d in zip(offset, spec.rhs_dilation)] + [0]
        limit = [xp.shape[0]] + [st + (m - 1) * s + 1 for st, m, s in zip(start[1:], out_sp, spec.window_strides)]
        limit.append(xp.shape[-1])
        pieces.append(lax.slice(xp, start, limit, (1, *spec.window_strides, 1)))
    return jnp.stack(pieces, axis=-2)


def _canonical_out(a: Array, spec: ConvSpec) -> Array:
    """Output-layout array as (batch, *spatial, channels)."""
    o = spec.dimension_numbers.out_spec
    return jnp.transpose(a, (o[0], *o[2:], o[1]))


def patches_moments_explicit(
    inputs: Array,
    kernel_spatial_shape: int | Sequence[int],
    strides: int | Sequence[int] = 1,
    padding: str | Sequence[tuple[int, int]] = "VALID",
    data_format: str | None = "NHWC",
    dim_numbers: Any = None,
    inputs_dilation: int | Sequence[int] | None = None,
    kernel_dilation: int | Sequence[int] | None = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    unroll_loop: bool = False,
    precision: Any = None,
    weighting_array: Array | None = None,
) -> tuple[Array, Array]:
    """Same as ``patches_moments``, extracting every patch with ``lax.conv_general_dilated_patches``.

    Simple and fast, but it materialises ``prod(kernel) * channels`` values per
    output location. ``unroll_loop`` is accepted for signature parity (no loop here).
    """
    del unroll_loop
    where = "patches_moments_explicit"
    spec, k_sp, c = _patches_setup(
        inputs, kernel_spatial_shape, strides, padding, data_format, dim_numbers, inputs_dilation,
        kernel_dilation, feature_group_count, batch_group_count, precision, where,
    )
    patches = _conv_patches(inputs, spec, k_sp)
    k = math.prod(k_sp)
    # Features come as (channel, *kernel offsets): reorder to (offset, channel).
    p = _canonical_out(patches, spec)
    p = p.reshape(-1, c, k).transpose(0, 2, 1)
    wp = p
    if weighting_array is not None:
        w = _weights_in_out_layout(weighting_array, patches.shape, spec, where)
        wp = p * _canonical_out(w, spec).reshape(-1, 1, 1)
    vector = jnp.sum(wp, axis=0).reshape(*k_sp, c)
    if feature_group_count == 1:
        matrix = jnp.einsum("rac,rbd->acbd", wp, p, precision=precision).reshape(*k_sp, c, *k_sp, c)
    else:
        matrix = jnp.einsum("rac,rbc->abc", wp, p, precision=precision).reshape(*k_sp, *k_sp, c)
    return matrix, vector


# On CPU the patch Gram runs over batch chunks of at most this many patch values (4 MiB in
# float32): a Gram of patches that stay in cache is ~2x faster than one of the whole batch's.
_CPU_PATCH_CHUNK_ELEMENTS = 2**20


def _sum_over_example_chunks(fn: Callable[..., Any], xs: Sequence[Array], axes: Sequence[int], per_example: int) -> Any:
    """``fn(*xs)`` for an ``fn`` that sums over the examples of its arguments (batch axes ``axes``),
    computed over chunks of the examples and summed.

    Chunks hold at most ``get_max_parallel_elements()`` values (``per_example`` per example), and
    on CPU at most ``_CPU_PATCH_CHUNK_ELEMENTS`` (so that they stay in cache); ``lax.map`` runs
    them, the last one filled up with zero examples (one compiled body), so ``fn`` must give
    exactly nothing for an all-zero example.
    """
    n = xs[0].shape[axes[0]]
    limit = blocks.get_max_parallel_elements()
    if jax.default_backend() == "cpu":
        limit = min(limit, _CPU_PATCH_CHUNK_ELEMENTS)
    size = max(1, limit // max(per_example, 1))
    if size >= n:
        return fn(*xs)
    num = -(-n // size)

    def chunked(x: Array, axis: int) -> Array:
        x = jnp.moveaxis(x, axis, 0)
        x = jnp.pad(x, [(0, num * size - n)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num, size, *x.shape[1:])

    outs = lax.map(lambda cs: fn(*(jnp.moveaxis(c, 0, a) for c, a in zip(cs, axes))),
                   tuple(chunked(x, a) for x, a in zip(xs, axes)))
    return jax.tree_util.tree_map(lambda o: jnp.sum(o, axis=0), outs)


def _patch_gram(x: Array, spec: ConvSpec, k_sp: Sequence[int], c: int) -> tuple[Array, Array]:
    """``(sum p p^T, sum p)`` over all patches, as a ``(k*C, k*C)`` matrix in (offset, channel) order.

    The fast path used by the KFC block: patches are copied out explicitly
    (``_sliced_patches``, already in (offset, channel) order) and multiplied as one
    2-D matmul per chunk of the batch (``_sum_over_example_chunks``; zero examples' patches are
    zero and add exactly nothing).
    """
    d = math.prod(k_sp) * c
    batch_axis = spec.dimension_numbers.lhs_spec[0]

    def moments(xc: Array) -> tuple[Array, Array]:
        p = _sliced_patches(xc, spec, k_sp).reshape(-1, d)  # features (offset, channel)
        return jnp.matmul(p.T, p, precision=spec.precision), jnp.sum(p, axis=0)

    per_example = d * math.prod(_out_shape(spec, x, k_sp)) // max(x.shape[batch_axis], 1)
    return _sum_over_example_chunks(moments, (x,), (batch_axis,), per_example)


def _out_shape(spec: ConvSpec, inputs: Array, k_sp: Sequence[int]) -> tuple[int, ...]:
    c = inputs.shape[spec.dimension_numbers.lhs_spec[1]]
    w = jax.ShapeDtypeStruct(_kernel_shape(spec, k_sp, 1, c), inputs.dtype)
    return tuple(jax.eval_shape(spec.conv, jax.ShapeDtypeStruct(inputs.shape, inputs.dtype), w).shape)


def patches_moments(
    inputs: Array,
    kernel_spatial_shape: int | Sequence[int],
    strides: int | Sequence[int] = 1,
    padding: str | Sequence[tuple[int, int]] = "VALID",
    data_format: str | None = "NHWC",
    dim_numbers: Any = None,
    inputs_dilation: int | Sequence[int] | None = None,
    kernel_dilation: int | Sequence[int] | None = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    unroll_loop: bool = False,
    precision: Any = None,
    weighting_array: Array | None = None,
) -> tuple[Array, Array]:
    """Sums over all patches (examples x output locations) of ``p p^T`` and of ``p``.

    A patch ``p`` is what one output location of the convolution sees: shape
    ``kernel_spatial_shape + (channels,)`` (zero where it covers padding). Returns
    ``(matrix, vector)`` with shapes ``k + (C,) + k + (C,)`` and ``k + (C,)``;
    for a depthwise layout (``feature_group_count == channels``) the matrix only
    pairs equal channels and has shape ``k + k + (C,)``. ``weighting_array``
    weights each patch: shape ``(batch,)``, the output's shape without its
    channel axis, or with a size-1 channel axis. Sums, not means. The layout is
    ``data_format`` (channels last ``"NHWC"``/``"NWC"``/``"NDHWC"``, the default,
    or channels first ``"NCHW"``...) or ``dim_numbers`` (whose kernel spec is
    ignored); ``padding`` is a string or explicit (low, high) pairs.

    Patches are never all materialised at once: kernel offsets are split into
    chunks of ``T`` offsets with ``T * rows * C <= get_max_parallel_elements()``;
    the shifted inputs of one chunk come from a one-hot depthwise convolution and
    every pair of chunks contributes one block of the matrix (``lax.map`` over
    chunks, a Python loop when ``unroll_loop``). When everything fits this is
    one chunk, as fast as ``patches_moments_explicit``.
    """
    where = "patches_moments"
    spec, k_sp, c = _patches_setup(
        inputs, kernel_spatial_shape, strides, padding, data_format, dim_numbers, inputs_dilation,
        kernel_dilation, feature_group_count, batch_group_count, precision, where,
    )
    k = math.prod(k_sp)
    depthwise = feature_group_count != 1
    out_shape = _out_shape(spec, inputs, k_sp)
    rows = math.prod(out_shape) // out_shape[spec.dimension_numbers.out_spec[1]]
    weights = None
    if weighting_array is not None:
        w = _weights_in_out_layout(weighting_array, out_shape, spec, where)
        weights = _canonical_out(w, spec).reshape(rows, 1, 1)
    chunk = max(1, min(k, blocks.get_max_parallel_elements() // max(rows * c, 1)))
    num = -(-k // chunk)
    onehots = jnp.eye(num * chunk, k, dtype=inputs.dtype).reshape(num, chunk, *k_sp)  # padded offsets are zero
    select = dataclasses.replace(spec, feature_group_count=c)
    rhs_inv = np.argsort(spec.kernel_perm())

    def shifted(onehot: Array) -> Array:
        # Output channel c * chunk + t of a depthwise conv reads channel c at offset t: (rows, C, chunk).
        ker = jnp.broadcast_to(jnp.moveaxis(onehot, 0, -1)[..., None, None, :], (*k_sp, 1, c, chunk))
        out = select.conv(inputs, jnp.transpose(ker.reshape(*k_sp, 1, c * chunk), rhs_inv))
        return _canonical_out(out, spec).reshape(rows, c, chunk)

    def loop(f: Callable[[Array], Any], xs: Array) -> Any:
        if unroll_loop:
            outs = [f(x) for x in xs]
            return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
        return lax.map(f, xs)

    spec_pair = "rct,rcu->tuc" if depthwise else "rct,rdu->tcud"

    def row_of_blocks(onehot_a: Array) -> tuple[Array, Array]:
        xa = shifted(onehot_a)
        wxa = xa if weights is None else xa * weights
        blocks_ = loop(lambda onehot_b: jnp.einsum(spec_pair, wxa, shifted(onehot_b), precision=precision), onehots)
        return blocks_, jnp.sum(wxa, axis=0)

    mats, vecs = loop(row_of_blocks, onehots)
    vector = jnp.transpose(vecs, (0, 2, 1)).reshape(num * chunk, c)[:k].reshape(*k_sp, c)
    if depthwise:  # mats: [i, j, t, u, c]
        matrix = jnp.transpose(mats, (0, 2, 1, 3, 4)).reshape(num * chunk, num * chunk, c)[:k, :k]
        return matrix.reshape(*k_sp, *k_sp, c), vector
    # mats: [i, j, t, c, u, d] -> [(i, t), c, (j, u), d]
    matrix = jnp.transpose(mats, (0, 2, 3, 1, 4, 5)).reshape(num * chunk, c, num * chunk, c)[:k, :, :k]
    return matrix.reshape(*k_sp, c, *k_sp, c), vector


# ----------------------------------------------------------------------------------
# Curvature blocks
# ----------------------------------------------------------------------------------


class _ConvMixin:
    """Shape bookkeeping and per-example gradients for a convolution tag."""

    _required_spatial: int | None = None
    _max_elements: int | None = None  # the constructor's ``max_elements_for_vmap``, where it has one

    def _setup_conv(self) -> None:
        eqn = self.layer_tag_eq  # type: ignore[attr-defined]
        name = self.name  # type: ignore[attr-defined]
        if len(eqn.inputs) != 1 or len(eqn.params) not in (1, 2):
            raise ValueError(
                f"{name}: a convolution block needs one input, a kernel and an optional bias, got "
                f"{len(eqn.inputs)} inputs and parameters {self.parameters_shapes}."  # type: ignore[attr-defined]
            )
        self._spec = spec_from_meta(eqn.meta or {}, eqn.inputs[0].shape, eqn.params[0].shape, name)
        if self._required_spatial is not None and self._spec.num_spatial != self._required_spatial:
            raise ValueError(
                f"{name}: {type(self).__name__} is for {self._required_spatial}-D convolutions, got a kernel of "
                f"shape {tuple(eqn.params[0].shape)}; use the N-D Conv* blocks."
            )
        if self._spec.batch_group_count != 1:
            raise ValueError(f"{name}: batch_group_count must be 1, got {self._spec.batch_group_count}.")
        if len(eqn.params) == 2 and math.prod(eqn.params[1].shape) != self.num_outputs_channels:
            raise ValueError(f"{name}: the bias must have {self.num_outputs_channels} entries, got shape {eqn.params[1].shape}.")
        x = jax.ShapeDtypeStruct(eqn.inputs[0].shape, eqn.inputs[0].dtype)
        w = jax.ShapeDtypeStruct(eqn.params[0].shape, eqn.inputs[0].dtype)  # the kernel may be cast in the model
        self._out_shape = tuple(jax.eval_shape(self._spec.conv, x, w).shape)

    @property
    def max_elements_for_vmap(self) -> int:
        """The chunk size for vmapped per-example work (the constructor's value, else the global default)."""
        return self._max_elements or blocks.get_max_parallel_elements()

    @property
    def conv_spec(self) -> ConvSpec:
        """The resolved convolution configuration."""
        return self._spec

    @property
    def inputs_channel_index(self) -> int:
        return self._spec.dimension_numbers.lhs_spec[1]

    @property
    def outputs_channel_index(self) -> int:
        return self._spec.dimension_numbers.out_spec[1]

    @property
    def weights_output_channel_index(self) -> int:
        return self._spec.dimension_numbers.rhs_spec[0]

    @property
    def kernel_spatial_shape(self) -> tuple[int, ...]:
        w = self.parameters_shapes[0]  # type: ignore[attr-defined]
        return tuple(w[i] for i in self._spec.dimension_numbers.rhs_spec[2:])

    @property
    def weights_spatial_size(self) -> int:
        return math.prod(self.kernel_spatial_shape)

    @property
    def num_locations(self) -> int:
        """Output locations per example: the product of the output's spatial sizes."""
        return math.prod(self._out_shape[i] for i in self._spec.dimension_numbers.out_spec[2:])

    @property
    def num_inputs_channels(self) -> int:
        return self.inputs_shapes[0][self.inputs_channel_index]  # type: ignore[attr-defined]

    @property
    def num_outputs_channels(self) -> int:
        return self.parameters_shapes[0][self.weights_output_channel_index]  # type: ignore[attr-defined]

    def _conv_data(self, estimation_data: Mapping[str, Sequence[Array]]) -> tuple[Array, Array]:
        xs, dys = tuple(estimation_data["inputs"]), tuple(estimation_data["outputs_tangent"])
        if len(xs) != 1 or len(dys) != 1:
            raise ValueError(
                f"{self.name}: a convolution block needs one input and one output tangent, "  # type: ignore[attr-defined]
                f"got {len(xs)} and {len(dys)}."
            )
        x, dy = xs[0], dys[0]
        dn = self._spec.dimension_numbers
        if x.ndim != self._spec.num_spatial + 2 or x.shape[dn.lhs_spec[1]] != self.num_inputs_channels:
            raise ValueError(f"{self.name}: inputs have shape {x.shape}, expected the layout of {self.inputs_shapes[0]}.")  # type: ignore[attr-defined]
        if dy.ndim != x.ndim or dy.shape[dn.out_spec[1]] != self.num_outputs_channels:
            raise ValueError(f"{self.name}: output tangents have shape {dy.shape}, expected the layout of {self._out_shape}.")  # type: ignore[attr-defined]
        dtype = self.dtype  # type: ignore[attr-defined]
        return x.astype(dtype), dy.astype(dtype)

    def _per_example_reduce(
        self, x: Array, dy: Array, stat: Callable[[tuple[Array, ...]], Any], max_elements: int
    ) -> Any:
        """``sum_chunks stat(per-example gradients of the chunk)``; chunks bounded by ``max_elements``.

        The per-example gradient of example n is that of ``sum(y_n * dy_n)``
        w.r.t. (kernel, bias); padding examples have zero ``dy`` and contribute 0.
        """
        spec = self._spec
        dn = spec.dimension_numbers
        xb, dyb = jnp.moveaxis(x, dn.lhs_spec[0], 0), jnp.moveaxis(dy, dn.out_spec[0], 0)
        n = xb.shape[0]
        shapes = self.parameters_shapes  # type: ignore[attr-defined]
        kernel0 = jnp.zeros(shapes[0], x.dtype)
        bias_axes = tuple(i for i in range(dy.ndim - 1) if i != (dn.out_spec[1] - (dn.out_spec[1] > dn.out_spec[0])))

        def grads(xn: Array, dyn: Array) -> tuple[Array, ...]:
            x1, dy1 = jnp.expand_dims(xn, dn.lhs_spec[0]), jnp.expand_dims(dyn, dn.out_spec[0])
            _, pull = jax.vjp(lambda k: spec.conv(x1, k), kernel0)
            out = pull(dy1)
            if len(shapes) == 2:
                out += (jnp.sum(dyn, axis=bias_axes).reshape(shapes[1]),)
            return out

        per_example = math.prod(xb.shape[1:]) + math.prod(dyb.shape[1:]) + sum(self.parameters_sizes)  # type: ignore[attr-defined]
        chunk = max(1, min(n, max_elements // max(per_example, 1)))
        num = -(-n // chunk)
        pad = num * chunk - n
        if pad:
            xb = jnp.concatenate([xb, jnp.zeros((pad, *xb.shape[1:]), xb.dtype)])
            dyb = jnp.concatenate([dyb, jnp.zeros((pad, *dyb.shape[1:]), dyb.dtype)])
        xb, dyb = xb.reshape(num, chunk, *xb.shape[1:]), dyb.reshape(num, chunk, *dyb.shape[1:])
        init = jax.eval_shape(lambda a, b: stat(jax.vmap(grads)(a, b)), xb[0], dyb[0])
        init = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), init)

        def body(acc: Any, xs: tuple[Array, Array]) -> tuple[Any, None]:
            new = stat(jax.vmap(grads)(*xs))
            return jax.tree_util.tree_map(jnp.add, acc, new), None

        return lax.scan(body, init, (xb, dyb))[0]


class ConvTwoKroneckerFactored(_ConvMixin, blocks.TwoKroneckerFactored):
    """KFC (Grosse & Martens, 2016) for an N-D convolution: ``C ~= A (x) G``.

    ``A`` is the mean over examples and output locations of ``[p; 1][p; 1]^T``
    (``p`` a patch, the 1 only with a bias); ``G = (1/B) sum_{n, t} dy_nt dy_nt^T``
    sums the output cotangents over locations per example. For one example and
    one output location ``A (x) G`` is exactly ``g g^T``. Grouped convolutions
    (``feature_group_count > 1``) use ``ConvGroupedTwoKroneckerFactored``.
    """

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str):
        super().__init__(layer_tag_eq, name)
        self._setup_conv()
        if self._spec.feature_group_count != 1:
            raise ValueError(
                f"{name}: {type(self).__name__} needs feature_group_count == 1, got "
                f"{self._spec.feature_group_count}; use ConvGroupedTwoKroneckerFactored (or a Diagonal/Full block)."
            )

    def input_size(self) -> int:
        return self.weights_spatial_size * self.num_inputs_channels + int(self.has_bias)

    def output_size(self) -> int:
        return self.num_outputs_channels

    def _params_to_array(self, params: Sequence[Any], xp: Any) -> Any:
        w = params[0].transpose(self._spec.kernel_perm()).reshape(-1, self.num_outputs_channels)
        if self.has_bias:
            w = xp.concatenate([w, params[1].reshape(1, -1)], axis=0)
        return w

    def array_to_parameters_shaped_list(self, array: Array) -> tuple[Array, ...]:
        """Inverse of ``parameters_shaped_list_to_array``."""
        shapes = self.parameters_shapes
        perm = self._spec.kernel_perm()
        w_rows = array[:-1] if self.has_bias else array
        w = w_rows.reshape(tuple(shapes[0][i] for i in perm)).transpose(np.argsort(perm))
        return (w, array[-1].reshape(shapes[1])) if self.has_bias else (w,)

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del pmap_axis_name
        x, dy = self._conv_data(estimation_data)
        s = self._spec
        matrix, vector = _patch_gram(x, s, self.kernel_spatial_shape, self.num_inputs_channels)
        d = self.weights_spatial_size * self.num_inputs_channels
        rows = x.shape[s.dimension_numbers.lhs_spec[0]] * self.num_locations
        a = matrix / rows
        if self.has_bias:
            a = blocks.bias_augmented(a, vector.reshape(d) / rows)
        dy2 = jnp.moveaxis(dy, s.dimension_numbers.out_spec[1], -1).reshape(-1, self.num_outputs_channels)
        return self._with_factors_updated(state, a, (dy2.T @ dy2) / batch_size, ema_old, ema_new)


class ConvTwoKroneckerFactoredReduce(ConvTwoKroneckerFactored):
    """K-FAC-reduce (Eschenhagen et al. 2023) for an N-D convolution: ``C ~= A (x) G``.

    ``A = (1/B) sum_n [pbar_n; 1][pbar_n; 1]^T`` with ``pbar_n`` the mean of example n's
    patches over the output locations, and ``G = (1/B) sum_n s_n s_n^T`` with ``s_n`` the sum
    of its output cotangents over the locations (curvlinops' ``kfac_approx="reduce"``). Exact
    for one example when the locations are summed or averaged before the loss (global pooling),
    where KFC is not; for one output location it equals KFC. Plain convolutions only
    (``feature_group_count == 1``). Select it with ``layer_tag_to_block_ctor={"conv2d":
    ConvTwoKroneckerFactoredReduce}`` or ``curvax.operators.kfac(..., kfac_approx="reduce")``.
    """

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del pmap_axis_name
        x, dy = self._conv_data(estimation_data)
        s = self._spec
        k_sp = self.kernel_spatial_shape
        c, k = self.num_inputs_channels, self.weights_spatial_size
        p = _sliced_patches(x, s, k_sp)  # (batch, *locations, offset, channel): the kernel's order
        n = p.shape[0]
        pbar = jnp.mean(p.reshape(n, -1, k * c), axis=1)
        sums = jnp.sum(_canonical_out(dy, s).reshape(n, -1, self.num_outputs_channels), axis=1)
        return self._with_factors_updated(state, self._input_moment(pbar), linalg.gram(sums) / batch_size, ema_old, ema_new)


class ConvTNT(blocks._TwoFactorTNT, ConvTwoKroneckerFactored):
    """TNT (Ren & Goldfarb, 2021) for a plain N-D convolution: kfac-jax 0.0.8's ``Conv2DTNT`` in N-D.

    Under KFC's location independence each (example, output location) contributes the gradient
    ``[p; 1] dy^T`` (``p`` its patch, the 1 only with a bias), whose mode second moments are
    ``|dy|^2 [p; 1][p; 1]^T`` and ``(|p|^2 + 1) dy dy^T``. With ``T`` locations:

        ``A = 1/(B T) sum_{n,t} |dy_nt|^2 [p_nt; 1][p_nt; 1]^T``,
        ``G = 1/(B T) sum_{n,t} (|p_nt|^2 + 1) dy_nt dy_nt^T``,
        ``C = T (A (x) G) / sqrt(tr A tr G)``

    (``fixed_scale`` ``T``, ``state_dependent_scale`` TNT's, as kfac-jax). For one example
    and one location ``C`` is exactly ``g g^T``. ``weighting_per_location=False`` weighs
    every location of example ``n`` by that example's sums instead, ``sum_t |dy_nt|^2`` and
    ``sum_t (|p_nt|^2 + 1)``. Plain convolutions only (``feature_group_count == 1``). The
    patches are taken over chunks of the examples, as KFC's are, so memory stays bounded.
    """

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None, weighting_per_location: bool = True):
        super().__init__(layer_tag_eq, name)
        if not isinstance(weighting_per_location, (bool, np.bool_)):
            raise TypeError(
                f"{self.name}: `weighting_per_location` must be a bool, got {type(weighting_per_location).__name__}."
            )
        self.weighting_per_location = bool(weighting_per_location)

    # TNT's update and scale come first in the method order, KFC's layout (patches, sizes) after.
    def fixed_scale(self) -> float:
        return float(self.num_locations)

    def _tnt_factors_from_data(self, estimation_data, batch_size):
        del batch_size  # normalised by the examples seen (the inputs' batch axis), as kfac-jax does
        x, dy = self._conv_data(estimation_data)
        s, c_out = self._spec, self.num_outputs_channels
        dn = s.dimension_numbers
        d = self.weights_spatial_size * self.num_inputs_channels

        def sums(xc: Array, dyc: Array) -> tuple[Array, Array]:
            m = xc.shape[dn.lhs_spec[0]]
            p = _sliced_patches(xc, s, self.kernel_spatial_shape).reshape(m, -1, d)  # (batch, locations, features)
            g = _canonical_out(dyc, s).reshape(m, -1, c_out)  # (batch, locations, channels), as the patches
            if self.has_bias:
                p = jnp.concatenate([p, jnp.ones(p.shape[:2] + (1,), p.dtype)], axis=-1)
            dy_sq = jnp.sum(jnp.square(g), axis=-1, keepdims=True)  # (batch, locations, 1)
            p_sq = jnp.sum(jnp.square(p), axis=-1, keepdims=True)  # the bias's 1 included
            if not self.weighting_per_location:
                dy_sq = jnp.broadcast_to(jnp.sum(dy_sq, axis=1, keepdims=True), dy_sq.shape)
                p_sq = jnp.broadcast_to(jnp.sum(p_sq, axis=1, keepdims=True), p_sq.shape)
            flat = lambda v: v.reshape(-1, v.shape[-1])  # noqa: E731
            # A zero example (the chunks' filling) has dy = 0: it adds exactly nothing to either sum.
            return flat(p * dy_sq).T @ flat(p), flat(g * p_sq).T @ flat(g)

        n = x.shape[dn.lhs_spec[0]]
        per_example = (d + int(self.has_bias)) * self.num_locations
        a, g = _sum_over_example_chunks(sums, (x, dy), (dn.lhs_spec[0], dn.out_spec[0]), per_example)
        rows = n * self.num_locations
        return a / rows, g / rows


class Conv2DTNT(ConvTNT):
    """``ConvTNT`` for 2-D convolutions (kfac-jax 0.0.8's ``Conv2DTNT``)."""

    _required_spatial = 2


class ConvGroupedTwoKroneckerFactored(_ConvMixin, blocks.CurvatureBlock):
    """KFC per feature group for grouped (e.g. depthwise) convolutions.

    Group ``g`` maps input channels ``g*ci:(g+1)*ci`` to output channels
    ``g*co:(g+1)*co`` with its own ``V_g = [W_g; b_g^T]``; its block is
    ``A_g (x) G_g`` with the ``ConvTwoKroneckerFactored`` normalisation (patches
    of the group's channels, cotangents of its outputs). Cross-group curvature is
    dropped. The state holds the groups' factors stacked along a leading axis;
    every operation is that of a ``DenseTwoKroneckerFactored`` block vmapped
    over the groups.
    """

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str):
        super().__init__(layer_tag_eq, name)
        self._setup_conv()
        g = self._spec.feature_group_count
        self._groups = g
        self._rows = self.weights_spatial_size * (self.num_inputs_channels // g)
        self._co = self.num_outputs_channels // g
        dt = self.dtype
        inner_params = (jax.ShapeDtypeStruct((self._rows, self._co), dt),)
        if self.number_of_parameters == 2:
            inner_params += (jax.ShapeDtypeStruct((self._co,), dt),)
        self._inner = blocks.DenseTwoKroneckerFactored(
            tags.LayerTagEqn(
                primitive=tags.dense, outputs=(jax.ShapeDtypeStruct((1, self._co), dt),),
                inputs=(jax.ShapeDtypeStruct((1, self._rows), dt),), params=inner_params,
                param_indices=tuple(range(len(inner_params))), meta={"kernel_layout": "io"}, name=f"{name}/group",
            ),
            f"{name}/group",
        )

    # --- parameters <-> per-group (W_g, b_g) ------------------------------------------

    def _to_groups(self, params: Sequence[Any]) -> tuple[Any, ...]:
        g, co = self._groups, self._co
        w = params[0].transpose(self._spec.kernel_perm()).reshape(self._rows, g, co).transpose(1, 0, 2)
        return (w,) if len(params) == 1 else (w, params[1].reshape(g, co))

    def _from_groups(self, groups: Sequence[Array]) -> tuple[Array, ...]:
        shapes = self.parameters_shapes
        perm = self._spec.kernel_perm()
        w = groups[0].transpose(1, 0, 2).reshape(tuple(shapes[0][i] for i in perm)).transpose(np.argsort(perm))
        return (w,) if len(groups) == 1 else (w, groups[1].reshape(shapes[1]))

    # --- state ------------------------------------------------------------------------

    def _init(self, rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues):
        one = self._inner._init(rng, exact_powers_to_cache, approx_powers_to_cache, cache_eigenvalues)
        return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (self._groups, *a.shape)), one)

    def update_curvature_matrix_estimate(
        self, state, estimation_data, ema_old, ema_new, batch_size, pmap_axis_name=None
    ):
        del pmap_axis_name
        x, dy = self._conv_data(estimation_data)
        s, g, k = self._spec, self._groups, self.weights_spatial_size
        ci = self.num_inputs_channels // g
        matrix, vector = patches_moments(
            x, self.kernel_spatial_shape, s.window_strides, s.padding, None, s.dimension_numbers,
            s.lhs_dilation, s.rhs_dilation, precision=s.precision,
        )
        n_rows = x.shape[s.dimension_numbers.lhs_spec[0]] * self.num_locations
        # Keep each group's own channels: [a, g, c, b, g, d] -> [g, (a, c), (b, d)].
        a = jnp.einsum("agcbgd->gacbd", matrix.reshape(k, g, ci, k, g, ci)).reshape(g, k * ci, k * ci) / n_rows
        if self.number_of_parameters == 2:
            mean = vector.reshape(k, g, ci).transpose(1, 0, 2).reshape(g, k * ci) / n_rows
            a = jax.vmap(blocks.bias_augmented)(a, mean)
        dy2 = jnp.moveaxis(dy, s.dimension_numbers.out_spec[1], -1).reshape(-1, g, self._co)
        gg = jnp.einsum("rgi,rgj->gij", dy2, dy2) / batch_size
        return jax.vmap(lambda st, a_g, g_g: self._inner._with_factors_updated(st, a_g, g_g, ema_old, ema_new))(state, a, gg)

    # --- products, eigenvalues, caches: the inner block per group ------------------------

    def _serves_from_cache(self, power, exact_power):
        return self._inner._serves_from_cache(power, exact_power)

    def _multiply_matpower_unscaled(self, state, vector, identity_weight, power, exact_power, use_cached):
        out = jax.vmap(
            lambda st, v: self._inner._multiply_matpower_unscaled(st, v, identity_weight, power, exact_power, use_cached)
        )(state, self._to_groups(vector))
        return self._from_groups(out)

    def _eigenvalues_unscaled(self, state, use_cached):
        return jax.vmap(lambda st: self._inner._eigenvalues_unscaled(st, use_cached))(state).ravel()

    def _update_cache(self, state, identity_weight, exact_powers, approx_powers, eigenvalues):
        return jax.vmap(
            lambda st: self._inner._update_cache(st, identity_weight, exact_powers, approx_powers, eigenvalues)
        )(state)

    def _to_dense_unscaled(self, state):
        per_group = jax.vmap(self._inner._to_dense_unscaled)(state)  # (G, d_g, d_g), inner parameter order
        offsets = np.cumsum([0, *self.parameters_sizes])
        index = [np.arange(offsets[i], offsets[i + 1]).reshape(sh) for i, sh in enumerate(self.parameters_shapes)]
        ix = np.concatenate([t.reshape(self._groups, -1) for t in self._to_groups(index)], axis=1)
        dense = jnp.zeros((self.dim, self.dim), per_group.dtype)
        return dense.at[ix[:, :, None], ix[:, None, :]].set(per_group)


class ConvDiagonal(_ConvMixin, blocks.Diagonal):
    """Diagonal of the per-example Fisher of an N-D convolution: ``(1/B) sum_n g_n^2``.

    Per-example gradients are exact (``vmap`` of the convolution's vjp), computed
    in chunks of at most ``max_elements_for_vmap`` elements (default
    ``get_max_parallel_elements()``). Correct for any layout, stride, dilation
    and feature grouping.
    """

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str, max_elements_for_vmap: int | None = None):
        super().__init__(layer_tag_eq, name)
        self._setup_conv()
        self._max_elements = max_elements_for_vmap

    def _diagonals_from_data(self, estimation_data, batch_size):
        x, dy = self._conv_data(estimation_data)
        sums = self._per_example_reduce(
            x, dy, lambda gs: tuple(jnp.sum(jnp.square(g), axis=0) for g in gs), self.max_elements_for_vmap
        )
        return tuple(s / batch_size for s in sums)


class ConvFull(_ConvMixin, blocks.Full):
    """Per-example Fisher of an N-D convolution: ``(1/B) sum_n g_n g_n^T`` (parameter order).

    Per-example gradients as in ``ConvDiagonal``.
    """

    def __init__(
        self, layer_tag_eq: tags.LayerTagEqn, name: str, max_elements_for_vmap: int | None = None,
        eigen_decomposition_threshold: int | None = None,
    ):
        super().__init__(layer_tag_eq, name, eigen_decomposition_threshold)
        self._setup_conv()
        self._max_elements = max_elements_for_vmap

    def _matrix_from_data(self, estimation_data, batch_size):
        x, dy = self._conv_data(estimation_data)

        def outer(gs: tuple[Array, ...]) -> Array:
            g = jnp.concatenate([t.reshape(t.shape[0], -1) for t in gs], axis=1)
            return g.T @ g

        return self._per_example_reduce(x, dy, outer, self.max_elements_for_vmap) / batch_size


class ConvEigenvalueCorrected(blocks.EigenvalueCorrectedKroneckerFactored, ConvTwoKroneckerFactored):
    """EKFAC (George et al., 2018) for an N-D convolution, on top of KFC's factors.

    ``A`` and ``G`` are those of ``ConvTwoKroneckerFactored``; the correction ``s``
    is the diagonal of the per-example Fisher in their eigenbasis, from example
    n's exact gradient ``V_n = sum_t [p_nt; 1] dy_nt^T`` (the ``vmap`` of the
    convolution's vjp, in chunks of at most ``max_elements_for_vmap`` elements).
    """

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str, max_elements_for_vmap: int | None = None):
        super().__init__(layer_tag_eq, name)
        self._max_elements = max_elements_for_vmap

    def _eigenvalue_correction_from_data(self, estimation_data, qa, qg, batch_size):
        x, dy = self._conv_data(estimation_data)
        x, dy = x.astype(qa.dtype), dy.astype(qa.dtype)

        def stat(gs: tuple[Array, ...]) -> Array:
            v = jax.vmap(lambda *g: self._params_to_array(g, jnp))(*gs)  # (chunk, input_size, output_size)
            return jnp.sum(jnp.square(jnp.einsum("ia,nij,jb->nab", qa, v, qg)), axis=0)

        return self._per_example_reduce(x, dy, stat, self.max_elements_for_vmap) / batch_size


class Conv2DEigenvalueCorrected(ConvEigenvalueCorrected):
    """``ConvEigenvalueCorrected`` for 2-D convolutions."""

    _required_spatial = 2


class Conv2DTwoKroneckerFactored(ConvTwoKroneckerFactored):
    """``ConvTwoKroneckerFactored`` for 2-D convolutions (KFC)."""

    _required_spatial = 2


class Conv2DDiagonal(ConvDiagonal):
    """Diagonal curvature block for a 2-D convolution (kfac-jax's ``Conv2DDiagonal``).

    It keeps ``(1/B) sum_n g_n^2``, the diagonal of the per-example Fisher of the
    kernel (and bias), from exact per-example gradients (see ``ConvDiagonal``). It
    costs one number per parameter, so it suits layers too wide for a Kronecker
    block, and it ignores every correlation between parameters. It is kfac-jax's
    2-D block: it refuses a 1-D or 3-D kernel, where ``ConvDiagonal`` takes any.
    """

    _required_spatial = 2


class Conv2DFull(ConvFull):
    """Full curvature block for a 2-D convolution (kfac-jax's ``Conv2DFull``).

    It keeps the whole ``(1/B) sum_n g_n g_n^T`` over the layer's parameters
    (kernel and bias flattened in parameter order), from exact per-example
    gradients (see ``ConvFull``). No approximation within the layer, at the cost of
    a ``d x d`` matrix for ``d`` parameters: meant for small layers and for checking
    the cheaper blocks. It is kfac-jax's 2-D block: it refuses a 1-D or 3-D kernel,
    where ``ConvFull`` takes any.
    """

    _required_spatial = 2


def _default_block(kronecker: type) -> Callable[..., blocks.CurvatureBlock]:
    def ctor(layer_tag_eq: tags.LayerTagEqn, name: str) -> blocks.CurvatureBlock:
        """KFC for plain convolutions, KFC per feature group for grouped ones."""
        groups = (layer_tag_eq.meta or {}).get("feature_group_count", 1)
        return (kronecker if groups == 1 else ConvGroupedTwoKroneckerFactored)(layer_tag_eq, name)

    ctor.__name__ = f"default_{kronecker.__name__}"
    return ctor


blocks.set_default_tag_to_block_ctor(conv1d, _default_block(ConvTwoKroneckerFactored))
blocks.set_default_tag_to_block_ctor(conv2d, _default_block(Conv2DTwoKroneckerFactored))
blocks.set_default_tag_to_block_ctor(conv3d, _default_block(ConvTwoKroneckerFactored))
