"""Scale-and-shift layers: ``y = x * scale + shift`` (the affine part of normalisation).

``scale`` and ``shift`` are parameters broadcast along the trailing feature
dims of ``x`` (either may be absent). LayerNorm, RMSNorm and BatchNorm end in
such a layer whose input is the normalised ``x_hat``. Frameworks often never
form ``x_hat``: flax computes ``(x - mean) * (rsqrt(var) * scale) + bias``. The
detector then records the layer input as two factors whose (broadcast) product
is ``x_hat`` (tag ``scale_and_shift`` with two inputs); blocks always multiply
their inputs together.

Detection (``match_scale_and_shift``, patterns ``scale_and_shift_both``,
``scale_only``, ``shift_only``) runs after dense/conv, whose bias adds it
leaves alone. A 1-D parameter may also sit on a middle axis (NCHW channels);
its data is then moved features-last like a dense layer's.

The blocks use exact per-example gradients (summed over non-feature positions
of each example): ``g_scale = sum(x_hat * dy)``, ``g_shift = sum(dy)``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax import blocks, detection, tags
from curvax.tracing import Key, Lit, Program

__all__ = [
    "scale_and_shift",
    "scale_and_shift_product",
    "register_scale_and_shift",
    "ScaleAndShiftDiagonal",
    "ScaleAndShiftFull",
    "match_scale_and_shift",
]

scale_and_shift = tags.LayerTag("scale_and_shift", num_inputs=1, num_outputs=1)
# The same layer kind with its input given as two factors (``x_hat = x1 * x2``).
scale_and_shift_product = tags.LayerTag("scale_and_shift", num_inputs=2, num_outputs=1)

_ADD_OPS = frozenset({"add", "add_any"})
PRECEDENCE = -10  # below dense/conv: their bias adds must stay theirs


# ----------------------------------------------------------------------------------
# Manual registration
# ----------------------------------------------------------------------------------


def register_scale_and_shift(
    y: jax.Array, x: Any, scale: Any = None, shift: Any = None, **kwargs: Any
) -> jax.Array:
    """Marks ``y = x * scale + shift`` as a scale-and-shift layer; returns ``y``.

    ``scale`` and ``shift`` (at least one) broadcast along the trailing dims of
    ``y``; ``x`` broadcasts to ``y``'s shape. The older kfac-jax form
    ``register_scale_and_shift(y, [x, *params], has_scale, has_shift)`` is also
    accepted. Extra ``kwargs`` are stored as the tag's (hashable) parameters.
    """
    if isinstance(x, (list, tuple)):
        if not isinstance(scale, bool) or not isinstance(shift, bool):
            raise TypeError(
                "register_scale_and_shift(y, inputs, has_scale, has_shift): with a sequence of inputs, "
                f"`has_scale` and `has_shift` must be bools, got {scale!r} and {shift!r}."
            )
        has_scale, has_shift = scale, shift
        if len(x) != 1 + has_scale + has_shift:
            raise ValueError(
                f"register_scale_and_shift: `inputs` must hold x plus {int(has_scale) + int(has_shift)} "
                f"parameter(s) for has_scale={has_scale}, has_shift={has_shift}; got {len(x)} arrays."
            )
        x, *rest = x
        scale = rest.pop(0) if has_scale else None
        shift = rest.pop(0) if has_shift else None
    tags._check_array("y", y)
    tags._check_array("x", x)
    if scale is None and shift is None:
        raise ValueError("register_scale_and_shift: at least one of `scale` and `shift` must be given.")
    params = []
    for name, p in (("scale", scale), ("shift", shift)):
        if p is None:
            continue
        tags._check_array(name, p)
        if p.ndim > y.ndim or tuple(y.shape[y.ndim - p.ndim :]) != tuple(p.shape):
            raise ValueError(
                f"register_scale_and_shift: `{name}` of shape {p.shape} must equal the trailing dims of y "
                f"(shape {y.shape})."
            )
        params.append(p)
    try:
        ok = np.broadcast_shapes(tuple(x.shape), tuple(y.shape)) == tuple(y.shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"register_scale_and_shift: x of shape {x.shape} does not broadcast to y's shape {y.shape}.")
    return scale_and_shift.bind(y, x, *params, has_scale=scale is not None, has_shift=shift is not None, **kwargs)


# ----------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------


def _core_shape(shape: Sequence[int], rank: int) -> tuple[int, ...]:
    """``shape`` without the leading size-1 dims that exceed ``rank`` (Haiku's ``(1, C)`` norm
    parameters broadcast like ``(C,)``: their leading 1 lines up with the batch axis)."""
    core = tuple(shape)
    while len(core) > rank and core and core[0] == 1:
        core = core[1:]
    return core


def _unbroadcast(t: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums ``t`` of shape ``(B, *S)`` down to ``(B, *shape)`` (inverse of broadcasting)."""
    core = _core_shape(shape, t.ndim - 1)
    extra = t.ndim - 1 - len(core)
    if extra:
        t = jnp.sum(t, axis=tuple(range(1, 1 + extra)))
    axes = tuple(1 + i for i, n in enumerate(core) if n == 1 and t.shape[1 + i] != 1)
    if axes:
        t = jnp.sum(t, axis=axes, keepdims=True)
    return t.reshape((t.shape[0], *shape))


class _ScaleAndShiftMixin:
    """Per-example gradients of a scale-and-shift layer from its inputs and output tangent."""

    def _check_scale_and_shift(self) -> None:
        n = self.number_of_parameters  # type: ignore[attr-defined]
        if n != int(self.has_scale) + int(self.has_shift) or n == 0:
            raise ValueError(
                f"{self.name}: a scale-and-shift layer with has_scale={self.has_scale}, has_shift={self.has_shift} "  # type: ignore[attr-defined]
                f"needs {int(self.has_scale) + int(self.has_shift)} parameter(s), got shapes "
                f"{self.parameters_shapes}."  # type: ignore[attr-defined]
            )

    def _meta_flag(self, key: str) -> bool:
        meta = self._layer_tag_eq.meta or {}  # type: ignore[attr-defined]
        if key in meta:
            return bool(meta[key])
        if self.number_of_parameters == 2:  # type: ignore[attr-defined]
            return True
        raise ValueError(
            f"{self.name}: a scale-and-shift layer with one parameter needs meta['has_scale'] and "  # type: ignore[attr-defined]
            "meta['has_shift'] to say which it is."
        )

    @property
    def has_scale(self) -> bool:
        """Whether this layer's equation has a scale."""
        return self._meta_flag("has_scale")

    @property
    def has_shift(self) -> bool:
        """Whether this layer's equation has a shift."""
        return self._meta_flag("has_shift")

    def _per_example_grads(self, estimation_data: Any) -> tuple[jax.Array, ...]:
        """``(B, *param_shape)`` gradients of each parameter, in parameter order."""
        dys = tuple(estimation_data["outputs_tangent"])
        if len(dys) != 1:
            raise ValueError(f"{self.name}: expected one output tangent, got {len(dys)}.")  # type: ignore[attr-defined]
        dy = dys[0]
        shapes = self.parameters_shapes  # type: ignore[attr-defined]
        k = max(len(_core_shape(s, dys[0].ndim - 1)) for s in shapes)
        if dy.ndim < k:
            raise ValueError(f"{self.name}: output tangent of shape {dy.shape} has fewer dims than the parameters {shapes}.")  # type: ignore[attr-defined]
        single = dy.ndim == k  # no batch axis: the whole array is one example
        if single:
            dy = dy[None]
        grads = []
        shapes_iter = iter(shapes)
        if self.has_scale:
            xs = tuple(estimation_data["inputs"])
            if not xs:
                raise ValueError(f"{self.name}: a scale needs the layer input, got no inputs.")  # type: ignore[attr-defined]
            x_hat = xs[0]
            for other in xs[1:]:
                x_hat = x_hat * other
            if single:
                x_hat = x_hat[None]
            try:
                x_hat = jnp.broadcast_to(x_hat, dy.shape)
            except ValueError as e:
                raise ValueError(
                    f"{self.name}: inputs {[x.shape for x in xs]} do not broadcast to the output tangent {dy.shape}."  # type: ignore[attr-defined]
                ) from e
            grads.append(_unbroadcast(x_hat * dy, next(shapes_iter)))
        if self.has_shift:
            grads.append(_unbroadcast(dy, next(shapes_iter)))
        return tuple(g.astype(self.dtype) for g in grads)  # type: ignore[attr-defined]


class ScaleAndShiftDiagonal(_ScaleAndShiftMixin, blocks.Diagonal):
    """A diagonal approximation specifically for a scale and shift layers.

    The diagonal of the per-example Fisher ``mean_n g_n^2`` with exact
    per-example gradients of scale (``sum x_hat * dy``) and shift (``sum dy``).
    """

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None):
        super().__init__(layer_tag_eq, name)
        self._check_scale_and_shift()

    def _diagonals_from_data(self, estimation_data, batch_size):
        return tuple(jnp.sum(jnp.square(g), axis=0) / batch_size for g in self._per_example_grads(estimation_data))


class ScaleAndShiftFull(_ScaleAndShiftMixin, blocks.Full):
    """A full dense approximation specifically for a scale and shift layers.

    ``sum_n g_n g_n^T / B`` with ``g_n`` example n's (scale, shift) gradient,
    flattened in parameter order: it keeps the scale/shift cross terms.
    """

    def __init__(self, layer_tag_eq: tags.LayerTagEqn, name: str | None = None, eigen_decomposition_threshold: int | None = None):
        super().__init__(layer_tag_eq, name, eigen_decomposition_threshold)
        self._check_scale_and_shift()

    def _matrix_from_data(self, estimation_data, batch_size):
        grads = self._per_example_grads(estimation_data)
        g = jnp.concatenate([t.reshape(t.shape[0], -1) for t in grads], axis=1)
        return (g.T @ g) / batch_size


blocks.set_default_tag_to_block_ctor("scale_and_shift", ScaleAndShiftDiagonal)


# ----------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------

_MAX_CHECKED_SIZE = 2**22  # float32 labels 1..n stay exact well below 2**24


def _traces_to_param(program: Program, ctx: detection.Context, atom: Any) -> bool:
    """Whether ``atom`` is any parameter, possibly after broadcast/reshape plumbing."""
    if isinstance(atom, Lit):
        return False
    every = detection.Context(ctx.live, set(program.param_keys))
    return detection.bias_source(program, every, atom) is not None


def _param_operand(program: Program, ctx: detection.Context, node: Any) -> tuple[Key, list[int], Any] | None:
    """``(param, plumbing chain, other operand)`` when exactly one operand of ``node`` is a parameter."""
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    fa = None if isinstance(a, Lit) else detection.bias_source(program, ctx, a)
    fb = None if isinstance(b, Lit) else detection.bias_source(program, ctx, b)
    if (fa is None) == (fb is None):
        return None
    (key, chain), other = (fa, b) if fa is not None else (fb, a)
    if isinstance(other, Lit) or _traces_to_param(program, ctx, other):
        return None
    return key, chain, other


def _scale_part(program: Program, ctx: detection.Context, idx: int) -> tuple[tuple, Key, list[int], set[int]] | None:
    """``x * scale`` at node ``idx``: ``(inputs, scale, chain, nodes)``.

    Either one operand is the (broadcast) scale, or one operand is itself
    ``x2 * scale`` used only here, giving the two-factor input ``(x1, x2)``.
    """
    node = program.nodes[idx]
    if node.primitive.name != "mul" or len(node.inputs) != 2:
        return None
    direct = _param_operand(program, ctx, node)
    if direct is not None:
        key, chain, other = direct
        return (other,), key, chain, {idx, *chain}
    a, b = node.inputs
    for inner, other in ((a, b), (b, a)):
        if isinstance(inner, Lit) or isinstance(other, Lit) or _traces_to_param(program, ctx, other):
            continue
        j = program.producer.get(inner)
        if j is None or j not in ctx.live or program.nodes[j].primitive.name != "mul":
            continue
        if ctx.consumers(program, inner) != [idx]:
            continue
        found = _param_operand(program, ctx, program.nodes[j])
        if found is not None:
            key, chain, factor = found
            return (other, factor), key, chain, {idx, j, *chain}
    return None


def _placement(program: Program, chain: Sequence[int], key: Key, out_shape: tuple[int, ...]) -> Any:
    """Where the plumbing puts parameter ``key`` in ``out_shape``.

    Returns ``"trailing"`` (the parameter's dims are the trailing dims), an int
    axis (a 1-D parameter along a middle axis, e.g. NCHW channels) or None. Checked numerically by
    pushing distinct labels through the plumbing equations.
    """
    full_shape = tuple(program.avals[key].shape)
    # Leading size-1 dims (Haiku's ``(1, C)`` and ``(1, 1, 1, C)`` BatchNorm parameters)
    # broadcast: the parameter is placed like its core.
    p_shape = _core_shape(full_shape, 0)
    size = int(np.prod(p_shape, dtype=np.int64))
    if size > _MAX_CHECKED_SIZE or len(p_shape) > len(out_shape):
        return None
    base = np.arange(1, size + 1, dtype=np.float32).reshape(full_shape)
    got = detection.push_labels(program, chain, base, out_shape)
    if got is None:
        return None
    n, k = len(out_shape), len(p_shape)
    if tuple(out_shape[n - k :]) == p_shape and np.array_equal(got, np.broadcast_to(base, out_shape)):
        return "trailing"
    if k == 1:
        for ax in range(1, n - 1):  # never axis 0: that is the batch axis
            if out_shape[ax] == p_shape[0]:
                shape = [1] * n
                shape[ax] = p_shape[0]
                if np.array_equal(got, np.broadcast_to(base.reshape(shape), out_shape)):
                    return ax
    return None


def _claimed_upstream(program: Program, ctx: detection.Context, nodes: set[int], inputs: Sequence[Any]) -> bool:
    """Whether a higher-precedence matcher anchored just upstream claims any of ``nodes``.

    Matchers run last equation first, so without this check a bias ``add`` would
    be taken as a shift before the dense/conv matcher at its producer is tried.
    """
    higher = [m for m in detection.registered_matchers() if m.precedence > PRECEDENCE]
    frontier = [a for a in inputs if not isinstance(a, Lit)]
    seen: set[int] = set()
    for _ in range(3):
        nxt = []
        for a in frontier:
            j = program.producer.get(a)
            if j is None or j in seen or j not in ctx.live:
                continue
            seen.add(j)
            for lm in higher:
                m = lm.fn(program, j, ctx)
                if m is not None and m.nodes & nodes:
                    return True
            nxt.extend(x for x in program.nodes[j].inputs if not isinstance(x, Lit))
        frontier = nxt
    return False


def _build(
    program: Program,
    ctx: detection.Context,
    output: Key,
    inputs: tuple,
    params: Sequence[tuple[Key, list[int]]],
    nodes: set[int],
    has_scale: bool,
    has_shift: bool,
    pattern: str,
) -> detection.Match | None:
    out_shape = tuple(program.avals[output].shape)
    places = {_placement(program, chain, key, out_shape) for key, chain in params}
    if len(places) != 1 or None in places:
        return None
    (place,) = places
    meta: dict[str, Any] = {"has_scale": has_scale, "has_shift": has_shift}
    if place != "trailing":
        if any(not isinstance(a, Lit) and len(program.avals[a].shape) != len(out_shape) for a in inputs):
            return None
        meta["input_feature_axis"] = meta["output_feature_axis"] = place
    # Every value made inside the layer must be used only inside it.
    for i in nodes:
        for k in program.nodes[i].outputs:
            if k is not None and k != output and any(c not in nodes for c in ctx.consumers(program, k)):
                return None
    if _claimed_upstream(program, ctx, nodes, inputs):
        return None
    tag = scale_and_shift if len(inputs) == 1 else scale_and_shift_product
    return detection.Match(tag, output, tuple(inputs), tuple(k for k, _ in params), meta, pattern, frozenset(nodes))


def match_scale_and_shift(program: Program, idx: int, ctx: detection.Context) -> detection.Match | None:
    """``x * scale + shift``, ``x * scale`` or ``x + shift`` with broadcast parameters.

    ``x`` may be given as two factors (``x1 * (x2 * scale)``, the flax/haiku
    normalisation layout). A shift is left alone when a dense/conv matcher
    claims it as that layer's bias.
    """
    node = program.nodes[idx]
    name = node.primitive.name
    if (name != "mul" and name not in _ADD_OPS) or len(node.outputs) != 1 or node.outputs[0] is None:
        return None
    output = node.outputs[0]
    if not jnp.issubdtype(program.avals[output].dtype, jnp.floating):
        return None
    if name == "mul":
        part = _scale_part(program, ctx, idx)
        if part is None:
            return None
        inputs, key, chain, nodes = part
        return _build(program, ctx, output, inputs, [(key, chain)], nodes, True, False, "scale_only")
    shift = _param_operand(program, ctx, node)
    if shift is None:
        return None
    skey, schain, other = shift
    j = program.producer.get(other)
    if j is not None and j in ctx.live and ctx.consumers(program, other) == [idx]:
        part = _scale_part(program, ctx, j)
        if part is not None and part[1] != skey:
            inputs, key, chain, nodes = part
            m = _build(
                program, ctx, output, inputs, [(key, chain), (skey, schain)], nodes | {idx, *schain},
                True, True, "scale_and_shift_both",
            )
            if m is not None:
                return m
    return _build(program, ctx, output, (other,), [(skey, schain)], {idx, *schain}, False, True, "shift_only")


detection.register_layer_matcher(
    "scale_and_shift",
    match_scale_and_shift,
    ("scale_and_shift_both", "scale_only", "shift_only"),
    precedence=PRECEDENCE,
)
