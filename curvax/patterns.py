"""The extension API for layer detection: ``GraphPattern`` (kfac-jax's ``tag_graph_matcher``).

A ``GraphPattern`` describes a new kind of layer by example: a function that
computes the layer in isolation (``compute_func(inputs, params)``) and example
arguments to trace it with. We trace it into a small ``Program`` and look for
copies of that little graph in the model's program: same primitives, same
parameters where they define the computation (shapes and dtypes are free, since
the pattern was traced with example shapes), the pattern's parameters bound to
distinct single-use model parameters, and no intermediate value of the layer
used outside it. Each copy becomes a layer tagged with ``tag_primitive``.

``auto_register_tags(..., graph_patterns=...)`` (and the ``Optimizer``'s
``auto_register_kwargs``) take a sequence of patterns that *replaces* the
built-in ones, as in kfac-jax; add ``DEFAULT_GRAPH_PATTERNS`` to keep them::

    graph_patterns=(my_pattern,) + curvax.tag_graph_matcher.DEFAULT_GRAPH_PATTERNS

``DEFAULT_GRAPH_PATTERNS`` is computed from the registered layer kinds
(``detection.registered_matchers()``) each time it is read, so kinds added by
``curvax.layers`` modules are always included.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax import _compat, detection, tags
from curvax.detection import layer_matchers  # noqa: F401  (how ProcessedJaxpr reads `graph_patterns`)
from curvax.tracing import Key, Lit, Program
from curvax.transforms import auto_register_tags  # noqa: F401  (kfac-jax's `tag_graph_matcher.auto_register_tags`)

# Binary primitives whose two operands may be swapped.
_COMMUTATIVE = frozenset({"add", "add_any", "mul", "max", "min", "and", "or", "xor", "eq", "ne"})
# Parameters that never change what is computed, only shapes, dtypes, placement or speed.
_FREE_PARAMS = frozenset(
    {
        "sharding", "out_sharding", "precision", "preferred_element_type", "new_dtype", "weak_type",
        "accumulation_type", "lhs_shape", "rhs_shape",
        # custom-derivative rules (functions, compared through the primal jaxpr instead)
        "jvp_jaxpr_fun", "jvp_jaxpr_thunk", "jvp", "fwd_jaxpr_thunk", "bwd", "out_trees",
    }
)
# Per primitive, parameters that only follow the (example) shapes.
_SHAPE_PARAMS: dict[str, frozenset[str]] = {
    "broadcast_in_dim": frozenset({"shape", "broadcast_dimensions"}),
    "reshape": frozenset({"new_sizes", "dimensions"}),
    "iota": frozenset({"shape", "dimension"}),
}
# Per primitive, parameters holding axes of the first operand (compared counting from the end too).
_AXIS_PARAMS: dict[str, str] = {
    "reduce_sum": "axes", "reduce_max": "axes", "reduce_min": "axes", "reduce_prod": "axes",
    "argmax": "axes", "argmin": "axes", "squeeze": "dimensions", "cumsum": "axis", "cumprod": "axis",
    "cummax": "axis", "cummin": "axis",
}


@dataclasses.dataclass(frozen=True, eq=False)
class GraphPattern:
    """A layer kind described by an example computation (kfac-jax's ``GraphPattern``).

    Attributes:
      name: the pattern's name (reported by detection, accepted by ``patterns_to_skip``).
      tag_primitive: the ``LayerTag`` that found layers get; it must have one
        output and as many inputs as ``example_args[0]`` has leaves.
      compute_func: ``compute_func(inputs, params)`` computes the layer in isolation.
      parameters_extractor_func: receives the matched model equations (with
        ``.primitive.name`` and ``.params``) and returns the layer's ``meta`` dict.
      example_args: ``[inputs, params]`` to trace ``compute_func`` with; the
        leaves of ``params`` are the layer's parameters, in order.
      precedence: patterns with higher precedence are tried first; equal ones
        in the order given.
      in_values_preprocessor: not supported (must be None): curvax's layer
        inputs are values of the model's program.
    """

    name: str
    tag_primitive: tags.LayerTag
    compute_func: Callable[..., Any]
    parameters_extractor_func: Callable[[Sequence[Any]], Mapping[str, Any]]
    example_args: Sequence[Any]
    precedence: int = 0
    in_values_preprocessor: Callable[..., Any] | None = None
    _traced: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"GraphPattern: `name` must be a non-empty string, got {self.name!r}.")
        where = f"GraphPattern {self.name!r}"
        if not isinstance(self.tag_primitive, tags.LayerTag):
            raise TypeError(
                f"{where}: `tag_primitive` must be a curvax.LayerTag, got {type(self.tag_primitive).__name__}."
            )
        if not callable(self.compute_func):
            raise TypeError(f"{where}: `compute_func` must be callable, got {type(self.compute_func).__name__}.")
        if not callable(self.parameters_extractor_func):
            raise TypeError(
                f"{where}: `parameters_extractor_func` must be callable, got "
                f"{type(self.parameters_extractor_func).__name__}."
            )
        if isinstance(self.precedence, bool) or not isinstance(self.precedence, (int, np.integer)):
            raise TypeError(f"{where}: `precedence` must be an int, got {self.precedence!r}.")
        if self.in_values_preprocessor is not None:
            raise NotImplementedError(
                f"{where}: `in_values_preprocessor` is not supported by curvax (a layer's inputs must be "
                "values the model computes). Write `compute_func` so that its inputs are such values."
            )
        args = self.example_args
        if isinstance(args, (str, bytes)) or not isinstance(args, Sequence) or len(args) != 2:
            raise ValueError(f"{where}: `example_args` must be a sequence `[inputs, params]`, got {args!r}.")
        n_in = len(jax.tree_util.tree_leaves(args[0]))
        n_params = len(jax.tree_util.tree_leaves(args[1]))
        if n_params == 0:
            raise ValueError(f"{where}: `example_args[1]` (the parameters) has no array leaves.")
        tag = self.tag_primitive
        if tag.num_outputs != 1:
            raise ValueError(f"{where}: curvax supports layer tags with one output; {tag.name!r} has {tag.num_outputs}.")
        if n_in != tag.num_inputs:
            raise ValueError(
                f"{where}: `example_args[0]` has {n_in} input leaves but the tag {tag.name!r} takes "
                f"{tag.num_inputs} inputs."
            )

    def layer_matcher(self) -> detection.LayerMatcher:
        """This pattern as a detection ``LayerMatcher`` (traces ``compute_func`` once per float width)."""
        self._graph()  # errors in the pattern itself surface here, not mid-detection
        return detection.LayerMatcher(self.name, self._match, (self.name,), int(self.precedence))

    # --- the pattern's own graph ----------------------------------------------------

    def _graph(self) -> "_PatternGraph":
        key = jnp.dtype(jnp.result_type(float)).name  # tracing differs with jax_enable_x64
        if key not in self._traced:
            self._traced[key] = _PatternGraph.trace(self)
        return self._traced[key]

    def _match(self, program: Program, idx: int, ctx: detection.Context) -> detection.Match | None:
        graph = self._graph()
        node = program.nodes[idx]
        if node.primitive.name != graph.anchor_name or idx not in ctx.live:
            return None
        for found in _Matcher(graph, program, ctx).run(idx):
            eqns = [program.nodes[i].eqn for i in sorted(found.nodes.values())]
            meta = self.parameters_extractor_func(eqns)
            if not isinstance(meta, Mapping):
                raise TypeError(
                    f"GraphPattern {self.name!r}: `parameters_extractor_func` must return a mapping (the "
                    f"layer's meta), got {type(meta).__name__}."
                )
            meta = {**detection.manual_meta_defaults(self.tag_primitive.name), **meta}
            out_key = program.nodes[found.nodes[graph.anchor]].outputs[graph.output_position]
            return detection.Match(
                tag=self.tag_primitive,
                output=out_key,
                inputs=tuple(found.atoms[k] for k in graph.inputs),
                params=tuple(found.atoms[k] for k in graph.params),
                meta=meta,
                pattern=self.name,
                nodes=frozenset(found.nodes.values()),
            )
        return None


@dataclasses.dataclass(frozen=True)
class _PatternGraph:
    """A traced pattern: its program, the roles of its values and its anchor equation."""

    program: Program
    inputs: tuple[Key, ...]
    params: tuple[Key, ...]
    anchor: int
    anchor_name: str
    output_position: int
    uses: dict[Key, int]

    @classmethod
    def trace(cls, pattern: GraphPattern) -> "_PatternGraph":
        where = f"GraphPattern {pattern.name!r}"
        x, p = pattern.example_args
        n_in = len(jax.tree_util.tree_leaves(x))
        n_params = len(jax.tree_util.tree_leaves(p))
        closed = _compat.make_jaxpr(pattern.compute_func, x, p)
        program = Program(closed, range(n_in, n_in + n_params))
        outs = program.output_atoms
        if len(outs) != 1 or isinstance(outs[0], Lit) or outs[0] not in program.producer:
            raise ValueError(f"{where}: `compute_func` must return one array computed from its arguments.")
        live = program.live_nodes(outs)
        inputs = tuple(program.input_keys[:n_in])
        params = tuple(program.input_keys[n_in:])
        used = {a for i in live for a in program.nodes[i].inputs if not isinstance(a, Lit)}
        unused = [i for i, k in enumerate(params) if k not in used]
        if unused:
            raise ValueError(f"{where}: the output of `compute_func` does not depend on parameter leaves {unused}.")
        unused = [i for i, k in enumerate(inputs) if k not in used]
        if unused:
            raise ValueError(f"{where}: the output of `compute_func` does not depend on input leaves {unused}.")
        anchor = program.producer[outs[0]]
        uses: dict[Key, int] = {}
        for i in live:
            for a in program.nodes[i].inputs:
                if not isinstance(a, Lit):
                    uses[a] = uses.get(a, 0) + 1
        return cls(
            program=program,
            inputs=inputs,
            params=params,
            anchor=anchor,
            anchor_name=program.nodes[anchor].primitive.name,
            output_position=program.nodes[anchor].outputs.index(outs[0]),
            uses=uses,
        )


@dataclasses.dataclass(frozen=True)
class _State:
    """A partial match: pattern node -> model node, pattern value -> model atom."""

    nodes: dict[int, int]
    atoms: dict[Key, Any]

    def extend(self, nodes: Mapping[int, int] | None = None, atoms: Mapping[Key, Any] | None = None) -> "_State":
        return _State({**self.nodes, **(nodes or {})}, {**self.atoms, **(atoms or {})})


class _Matcher:
    """Backtracking search for one copy of a pattern graph ending at a model equation."""

    def __init__(self, graph: _PatternGraph, program: Program, ctx: detection.Context):
        self.g = graph
        self.program = program
        self.ctx = ctx
        self.param_set = frozenset(graph.params)
        self.input_set = frozenset(graph.inputs)

    def run(self, idx: int) -> Iterator[_State]:
        for state in self._node(self.g.anchor, idx, _State({}, {})):
            if self._closed(state):
                yield state

    def _closed(self, state: _State) -> bool:
        """No layer-internal value is used outside the layer; inputs come from outside it."""
        matched = set(state.nodes.values())
        out_key = self.program.nodes[state.nodes[self.g.anchor]].outputs[self.g.output_position]
        for pn, mn in state.nodes.items():
            for pk, mk in zip(self.g.program.nodes[pn].outputs, self.program.nodes[mn].outputs):
                if mk is None or mk == out_key:
                    continue
                users = self.ctx.consumers(self.program, mk)
                if any(u not in matched for u in users) or len(users) != self.g.uses.get(pk, 0):
                    return False
        for k in self.g.inputs:
            a = state.atoms[k]
            if not isinstance(a, Lit) and self.program.producer.get(a) in matched:
                return False
        return True

    def _node(self, pn: int, mn: int, state: _State) -> Iterator[_State]:
        if mn in state.nodes.values() or mn not in self.ctx.live:
            return
        p, m = self.g.program.nodes[pn], self.program.nodes[mn]
        if (
            p.primitive.name != m.primitive.name
            or len(p.inputs) != len(m.inputs)
            or len(p.outputs) != len(m.outputs)
            or not _same_params(p, m, self.g.program, self.program)
        ):
            return
        outs = {pk: mk for pk, mk in zip(p.outputs, m.outputs) if pk is not None and mk is not None}
        state = state.extend({pn: mn}, outs)
        orders = [tuple(m.inputs)]
        if p.primitive.name in _COMMUTATIVE and len(m.inputs) == 2:
            orders.append(tuple(m.inputs[::-1]))
        for m_inputs in orders:
            yield from self._atoms(list(zip(p.inputs, m_inputs)), state)

    def _atoms(self, pairs: list[tuple[Any, Any]], state: _State) -> Iterator[_State]:
        if not pairs:
            yield state
            return
        (pa, ma), rest = pairs[0], pairs[1:]
        for st in self._atom(pa, ma, state):
            yield from self._atoms(rest, st)

    def _atom(self, pa: Any, ma: Any, state: _State) -> Iterator[_State]:
        if isinstance(pa, Lit):
            if isinstance(ma, Lit) and _same_value(pa.value, ma.value):
                yield state
            return
        if pa in state.atoms:
            if _same_atom(state.atoms[pa], ma):
                yield state
            return
        is_model_param = not isinstance(ma, Lit) and ma in self.program.param_keys
        if pa in self.param_set:
            if is_model_param and ma in self.ctx.matchable_params and ma not in state.atoms.values():
                yield state.extend(atoms={pa: ma})
            return
        if pa in self.input_set or pa in self.g.program.consts:
            # Layer inputs (and the pattern's constants) match any value but a parameter.
            if not is_model_param:
                yield state.extend(atoms={pa: ma})
            return
        # An intermediate value of the pattern: match the equation that produced it.
        if isinstance(ma, Lit) or ma not in self.program.producer:
            return
        pn, mn = self.g.program.producer[pa], self.program.producer[ma]
        if self.g.program.nodes[pn].outputs.index(pa) != self.program.nodes[mn].outputs.index(ma):
            return
        yield from self._node(pn, mn, state)


def _same_atom(a: Any, b: Any) -> bool:
    if isinstance(a, Lit) or isinstance(b, Lit):
        return isinstance(a, Lit) and isinstance(b, Lit) and _same_value(a.value, b.value)
    return a == b


def _same_value(a: Any, b: Any) -> bool:
    """Structural equality of equation parameters and literals."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, (_compat.Jaxpr, _compat.ClosedJaxpr)) and isinstance(b, (_compat.Jaxpr, _compat.ClosedJaxpr)):
        return _jaxpr_signature(a) == _jaxpr_signature(b)
    if isinstance(a, (np.ndarray, jax.Array, np.generic)) or isinstance(b, (np.ndarray, jax.Array, np.generic)):
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except Exception:  # noqa: BLE001 - incomparable values differ
            return False
    if callable(a) and callable(b) and not isinstance(a, type) and not isinstance(b, type):
        return True  # e.g. custom-derivative rule thunks: their jaxprs are compared instead
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values differ
        return False


def _jaxpr_signature(j: Any) -> tuple:
    jaxpr = j.jaxpr if isinstance(j, _compat.ClosedJaxpr) else j
    return tuple((e.primitive.name, len(e.invars), len(e.outvars)) for e in jaxpr.eqns)


def _rank(program: Program, atom: Any) -> int:
    return int(np.ndim(atom.value)) if isinstance(atom, Lit) else len(program.avals[atom].shape)


def _from_end(axes: Any, rank: int) -> Any:
    if isinstance(axes, (tuple, list)):
        return tuple(_from_end(a, rank) for a in axes)
    if isinstance(axes, (int, np.integer)) and not isinstance(axes, bool):
        return int(axes) - rank if axes >= 0 else int(axes)
    return axes


def _same_params(p: Any, m: Any, p_prog: Program, m_prog: Program) -> bool:
    """Whether two equations of the same primitive compute the same thing, up to shapes."""
    name = p.primitive.name
    if set(p.params) != set(m.params):
        return False
    free = _FREE_PARAMS | _SHAPE_PARAMS.get(name, frozenset())
    for k in p.params:
        if k in free:
            continue
        pv, mv = p.params[k], m.params[k]
        if _same_value(pv, mv):
            continue
        # Axes may differ only by extra leading dimensions: compare them counted from the end.
        if name == "dot_general" and k == "dimension_numbers":
            pr = [_rank(p_prog, a) for a in p.inputs]
            mr = [_rank(m_prog, a) for a in m.inputs]
            (plc, prc), (plb, prb) = pv
            (mlc, mrc), (mlb, mrb) = mv
            pn = (_from_end(plc, pr[0]), _from_end(prc, pr[1]), _from_end(plb, pr[0]), _from_end(prb, pr[1]))
            mm = (_from_end(mlc, mr[0]), _from_end(mrc, mr[1]), _from_end(mlb, mr[0]), _from_end(mrb, mr[1]))
            if pn == mm:
                continue
        elif _AXIS_PARAMS.get(name) == k and p.inputs and m.inputs:
            if _from_end(pv, _rank(p_prog, p.inputs[0])) == _from_end(mv, _rank(m_prog, m.inputs[0])):
                continue
        return False
    return True


# ----------------------------------------------------------------------------------
# Built-in layer kinds as patterns
# ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BuiltinPattern:
    """One pattern of a registered layer kind (an entry of ``DEFAULT_GRAPH_PATTERNS``).

    It runs the kind's registered matcher and keeps only the layers it reports
    under ``name``; ``kind`` is the layer kind (``"dense"``, ...). So leaving
    out ``dense_with_bias`` but keeping ``dense_no_bias`` leaves dense layers
    that have a bias to generic blocks (kfac-jax would match their weight alone).
    """

    name: str
    kind: str
    matcher: detection.LayerMatcher
    precedence: int = 0

    def layer_matcher(self) -> detection.LayerMatcher:
        fn, name = self.matcher.fn, self.name

        def match(program: Program, idx: int, ctx: detection.Context) -> detection.Match | None:
            m = fn(program, idx, ctx)
            return m if m is not None and m.pattern == name else None

        # Named after the kind so that `patterns_to_skip=("dense",)` skips all its patterns.
        return detection.LayerMatcher(self.kind, match, (self.name,), int(self.precedence))


def default_graph_patterns() -> tuple[BuiltinPattern, ...]:
    """The patterns of every registered layer kind, in the order detection tries them."""
    return tuple(
        BuiltinPattern(name, m.name, m, m.precedence) for m in detection.registered_matchers() for name in m.pattern_names
    )


def __getattr__(name: str) -> Any:
    # Computed on access so that layer kinds registered later are included.
    if name == "DEFAULT_GRAPH_PATTERNS":
        return default_graph_patterns()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- kfac-jax helpers that client code (FermiNet) builds its own patterns from -------


def _dense(x: Any, params: Sequence[Any], axes: int = 1, with_reshape: bool = False) -> Any:
    """A dense layer for ``GraphPattern.compute_func``: ``tensordot(x, w, axes) (+ b)``.

    kfac-jax name (``tag_graph_matcher._dense``), kept because client code such as
    FermiNet wraps it (e.g. ``jax.vmap``-ed, for a repeated dense layer).
    ``params`` is ``[w]`` or ``[w, b]``; ``with_reshape`` reshapes ``b`` to
    ``y``'s rank before adding it.
    """
    if len(params) not in (1, 2):
        raise ValueError(f"_dense: `params` must be [w] or [w, b], got {len(params)} arrays.")
    y = jnp.tensordot(x, params[0], axes=axes)
    if len(params) == 1:
        return y
    b = params[1]
    return y + (b.reshape((1,) * (y.ndim - b.ndim) + b.shape) if with_reshape else b)


def _dense_parameter_extractor(reversed_eqns: Sequence[Any], variant: str = "dense") -> dict[str, Any]:
    """A ``parameters_extractor_func`` for dense-like patterns (kfac-jax name, used by FermiNet).

    The matched equations must contain a ``dot_general``. curvax's dense tag
    needs no parameters from it (the layer contracts ``x``'s last axis with
    ``w``'s first); a ``variant`` other than ``"dense"`` is recorded in the tag's
    meta so that blocks can be chosen for it (``set_default_tag_to_block_ctor(variant, ...)``).
    """
    if not any(e.primitive.name == "dot_general" for e in reversed_eqns):
        raise ValueError("_dense_parameter_extractor: the matched equations contain no dot_general.")
    return {} if variant == "dense" else {"variant": variant}
