"""Layer detection: find the layers of a traced function.

Layers come from two places: tags the user bound by hand (``register_dense``,
``register_generic``) and patterns we recognise in the equations. A pattern is
a small matcher over the flat ``Program``; each returns ``LayerSite``s. Every
parameter that ends up in no layer gets a ``generic`` site of its own, so each
parameter has exactly one curvature block.

Adding a layer type means writing one matcher and registering it with
``register_layer_matcher`` (and a block for its tag with
``blocks.set_default_tag_to_block_ctor``); the modules in ``curvax/layers/``
do exactly that, one module per layer kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from curvax import tags
from curvax.tracing import Key, LayerSite, LayerUse, Lit, Program, ScanRef, features_last

# Ops that only broadcast/reshape/cast a bias vector on its way to the add.
_BIAS_PLUMBING = frozenset({"broadcast_in_dim", "reshape", "convert_element_type", "expand_dims", "squeeze", "copy"})
_ADD_OPS = frozenset({"add", "add_any"})
_CASTS = frozenset({"convert_element_type", "copy"})


@dataclasses.dataclass(frozen=True)
class Detection:
    """The outcome of detection: layer sites (sorted by parameter) and notes."""

    sites: tuple[LayerSite, ...]
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Match:
    """One layer found by a matcher: the equations (``nodes``) it claims."""

    tag: tags.LayerTag
    output: Key
    inputs: tuple[Any, ...]
    params: tuple[Key, ...]
    meta: dict
    pattern: str
    nodes: frozenset[int]
    extra_uses: tuple[LayerUse, ...] = ()
    scan: ScanRef | None = None


Matcher = Callable[[Program, int, "Context"], "Match | None"]


@dataclasses.dataclass
class Context:
    """What a matcher may look at besides the program: live nodes, claimable parameters."""

    live: frozenset[int]
    matchable_params: set[Key]

    def consumers(self, program: Program, key: Key) -> list[int]:
        return [i for i in program.consumers.get(key, []) if i in self.live]


def bias_source(program: Program, ctx: Context, atom: Any) -> tuple[Key, list[int]] | None:
    """Follows broadcast/reshape/cast equations back from ``atom`` to a parameter."""
    chain: list[int] = []
    while not isinstance(atom, Lit):
        if atom in ctx.matchable_params:
            return atom, chain[::-1]
        idx = program.producer.get(atom)
        if idx is None:
            return None
        node = program.nodes[idx]
        if node.primitive.name not in _BIAS_PLUMBING or len(node.inputs) != 1:
            return None
        chain.append(idx)
        atom = node.inputs[0]
    return None


def push_labels(program: Program, chain: Sequence[int], labels: np.ndarray, out_shape: tuple) -> np.ndarray | None:
    """``labels`` sent through the plumbing equations ``chain`` and broadcast to ``out_shape``.

    How detection checks numerically where a parameter lands in a layer's output:
    push distinct values through the broadcasts, reshapes and casts between them
    (casts to float32, so that every label stays exact). None when the plumbing
    does not take them to ``out_shape``.
    """
    try:
        with jax.ensure_compile_time_eval():  # detection may itself run under a jax transformation
            val: Any = labels
            for idx in chain:
                node = program.nodes[idx]
                params = dict(node.params)
                if node.primitive.name == "convert_element_type":
                    params["new_dtype"] = np.float32
                val = np.asarray(node.primitive.bind(val, **params))
        return np.broadcast_to(val, out_shape)
    except Exception:  # noqa: BLE001 - plumbing that does not place the labels is no match
        return None


def cast_source(program: Program, ctx: Context, atom: Any) -> tuple[Key, list[int]] | None:
    """The matchable parameter behind ``atom`` through single-use dtype casts and copies, and those nodes.

    Mixed precision casts a kernel or table before use; the layer is still the
    parameter's. None when ``atom`` is no such parameter.
    """
    casts: list[int] = []
    while not isinstance(atom, Lit):
        if atom in ctx.matchable_params:
            return atom, casts
        idx = program.producer.get(atom)
        if idx is None or program.nodes[idx].primitive.name not in _CASTS or len(ctx.consumers(program, atom)) != 1:
            return None
        casts.append(idx)
        atom = program.nodes[idx].inputs[0]
    return None


def bias_maps_to_feature_axis(program: Program, chain: Sequence[int], bias_key: Key, out_shape: tuple, axis: Any) -> bool:
    """Checks numerically that the plumbing places ``b[j]`` at index j of ``axis``.

    ``axis`` may be a tuple of output axes; the bias then has their sizes as its
    shape, in that order (e.g. a ``(heads, head_dim)`` bias of a multi-head projection).
    """
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    want_shape = tuple(out_shape[a] for a in axes)
    d = tuple(program.avals[bias_key].shape)
    if int(np.prod(d, dtype=int)) != int(np.prod(want_shape, dtype=int)) or len(d) not in (1, len(axes)):
        return False
    size = int(np.prod(d, dtype=int))
    got = push_labels(program, chain, np.arange(1, size + 1, dtype=np.float32).reshape(d), out_shape)
    if got is None:
        return False
    base = np.arange(1, size + 1, dtype=np.float32).reshape(want_shape + (1,) * (len(out_shape) - len(axes)))
    want = np.broadcast_to(np.moveaxis(base, tuple(range(len(axes))), axes), out_shape)
    return bool(np.array_equal(got, want))


def param_through_casts(program: Program, ctx: Context, atom: Any) -> tuple[Any, list[int]]:
    """``atom``, or the matchable parameter it is a dtype cast of (with the cast nodes).

    Mixed precision casts parameters before use (e.g. float32 weights in a float64
    or bfloat16 computation); the layer is still the parameter's.
    """
    chain: list[int] = []
    cur = atom
    while not isinstance(cur, Lit) and cur not in ctx.matchable_params:
        idx = program.producer.get(cur)
        if idx is None or program.nodes[idx].primitive.name != "convert_element_type":
            return atom, []
        if len(ctx.consumers(program, cur)) != 1 and chain:
            return atom, []
        chain.append(idx)
        cur = program.nodes[idx].inputs[0]
    return (cur, chain) if chain and not isinstance(cur, Lit) else (atom, [])


def match_dense(program: Program, idx: int, ctx: Context) -> Match | None:
    """``y = x @ W (+ b)`` as a ``dot_general`` with a parameter operand ``W``.

    Works for either kernel layout (``(d_in, d_out)`` or ``(d_out, d_in)``) and
    either operand order, for any number of leading dims of ``x``, and for
    multi-axis kernels such as Flax's ``DenseGeneral`` (``(d, heads, head_dim)``):
    contracted kernel axes form the input features, the others the output features.
    """
    node = program.nodes[idx]
    if node.primitive.name != "dot_general" or len(node.inputs) != 2:
        return None
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    if lb or rb or not lc:
        return None
    (a, a_casts), (b, b_casts) = (param_through_casts(program, ctx, v) for v in node.inputs)
    a_is_p = not isinstance(a, Lit) and a in ctx.matchable_params
    b_is_p = not isinstance(b, Lit) and b in ctx.matchable_params
    if a_is_p == b_is_p:
        return None
    w, x = (a, b) if a_is_p else (b, a)
    casts = a_casts if a_is_p else b_casts
    w_shape = tuple(program.avals[w].shape)
    if isinstance(x, Lit) or len(w_shape) < 2:
        return None
    w_contract = tuple(int(i) for i in (lc if a_is_p else rc))
    x_contract = tuple(int(i) for i in (rc if a_is_p else lc))
    w_free = tuple(i for i in range(len(w_shape)) if i not in w_contract)
    x_ndim = len(program.avals[x].shape)
    if not w_free or x_ndim < 1:
        return None
    # dot_general output: lhs free dims, then rhs free dims.
    x_free = x_ndim - len(x_contract)
    out_axes = tuple(range(len(w_free))) if a_is_p else tuple(range(x_free, x_free + len(w_free)))
    simple = len(w_shape) == 2
    meta: dict[str, Any]
    if simple:
        meta = {
            "kernel_layout": "io" if w_contract[0] == 0 else "oi",
            "input_feature_axis": x_contract[0],
            "output_feature_axis": out_axes[0],
        }
    else:
        meta = {
            "kernel_layout": "general",
            "kernel_in_axes": w_contract,
            "kernel_out_axes": w_free,
            "input_feature_axis": x_contract,
            "output_feature_axis": out_axes,
        }
    y = node.outputs[0]
    nodes = {idx, *casts}
    params: tuple[Key, ...] = (w,)
    output: Key = y
    pattern = "dense_no_bias"
    users = ctx.consumers(program, y)
    # A transpose right after the product (e.g. ``W @ x`` under ``vmap``) is part of the layer.
    if len(users) == 1 and program.nodes[users[0]].primitive.name == "transpose":
        tnode = program.nodes[users[0]]
        perm = tuple(tnode.params["permutation"])
        out_axes = tuple(perm.index(k) for k in out_axes)
        meta["output_feature_axis"] = out_axes[0] if simple else out_axes
        y = output = tnode.outputs[0]
        nodes.add(users[0])
        users = ctx.consumers(program, y)
    out_shape = tuple(program.avals[y].shape)
    if len(users) == 1 and program.nodes[users[0]].primitive.name in _ADD_OPS:
        add = program.nodes[users[0]]
        other = add.inputs[1] if add.inputs[0] == y else add.inputs[0]
        found = bias_source(program, ctx, other)
        add_out = add.outputs[0]
        if (
            found is not None
            and found[0] != w
            and tuple(program.avals[add_out].shape) == out_shape
            and bias_maps_to_feature_axis(program, found[1], found[0], out_shape, out_axes[0] if simple else out_axes)
        ):
            params = (w, found[0])
            output = add_out
            nodes |= {users[0], *found[1]}
            pattern = "dense_with_bias"
    return Match(tags.dense, output, (x,), params, meta, pattern, frozenset(nodes))


@dataclasses.dataclass(frozen=True)
class LayerMatcher:
    """A registered layer kind: its matcher and the pattern names it can report.

    Matchers are tried in decreasing ``precedence`` (then registration order)
    on every live equation, last equation first; the first match wins.
    """

    name: str
    fn: Matcher
    pattern_names: tuple[str, ...]
    precedence: int = 0


_MATCHERS: dict[str, LayerMatcher] = {}
_MANUAL_META_DEFAULTS: dict[str, dict[str, Any]] = {}


def register_layer_matcher(
    name: str, fn: Matcher, pattern_names: Sequence[str], precedence: int = 0, manual_meta_defaults: dict | None = None
) -> LayerMatcher:
    """Adds (or replaces) the matcher for the layer kind ``name``.

    ``manual_meta_defaults`` fills in meta keys for tags of this name bound by
    hand (``register_*``) that the block needs but the user did not pass.
    """
    if not callable(fn):
        raise TypeError(f"register_layer_matcher: `fn` must be callable, got {type(fn).__name__}.")
    lm = LayerMatcher(name, fn, tuple(pattern_names), int(precedence))
    _MATCHERS[name] = lm
    if manual_meta_defaults:
        _MANUAL_META_DEFAULTS[name] = dict(manual_meta_defaults)
    return lm


def manual_meta_defaults(tag_name: str) -> dict[str, Any]:
    """Meta keys filled in for a hand-bound tag of this name (see ``register_layer_matcher``)."""
    return dict(_MANUAL_META_DEFAULTS.get(tag_name, {}))


def registered_matchers() -> tuple[LayerMatcher, ...]:
    """The registered layer kinds, in the order they are tried."""
    order = {n: i for i, n in enumerate(_MATCHERS)}
    return tuple(sorted(_MATCHERS.values(), key=lambda m: (-m.precedence, order[m.name])))


def known_pattern_names() -> tuple[str, ...]:
    """Every name accepted by ``patterns_to_skip`` (layer kinds and their patterns)."""
    out: list[str] = []
    for m in registered_matchers():
        out += [m.name, *m.pattern_names]
    return tuple(dict.fromkeys(out))


def layer_matchers(graph_patterns: Sequence[Any]) -> tuple[LayerMatcher, ...]:
    """Detection matchers for ``graph_patterns``, by decreasing precedence, then position.

    Each entry is a ``LayerMatcher`` or a pattern object with a ``layer_matcher()``
    method (``curvax.GraphPattern``, an entry of ``DEFAULT_GRAPH_PATTERNS``). The
    result replaces the registered layer kinds: a kind left out is not detected.
    Detection walks the equations from last to first and at each one tries the
    patterns in this order (a pattern is anchored at its last equation); the
    first match wins.
    """
    if (
        isinstance(graph_patterns, (str, bytes))
        or hasattr(graph_patterns, "layer_matcher")
        or not isinstance(graph_patterns, Sequence)
    ):
        raise TypeError(
            "`graph_patterns` must be a sequence of curvax.GraphPattern objects (e.g. "
            f"`(my_pattern,) + curvax.tag_graph_matcher.DEFAULT_GRAPH_PATTERNS`), got {type(graph_patterns).__name__}."
        )
    out = []
    for i, p in enumerate(graph_patterns):
        if isinstance(p, LayerMatcher):
            out.append(p)
        elif callable(getattr(p, "layer_matcher", None)):
            out.append(p.layer_matcher())
        else:
            raise TypeError(
                f"`graph_patterns`[{i}] must be a curvax.GraphPattern (or an entry of "
                f"DEFAULT_GRAPH_PATTERNS), got {type(p).__name__}: {p!r}."
            )
    order = sorted(range(len(out)), key=lambda i: (-out[i].precedence, i))
    return tuple(out[i] for i in order)


register_layer_matcher(
    "dense",
    match_dense,
    ("dense_with_bias", "dense_no_bias"),
    manual_meta_defaults={"kernel_layout": "io", "input_feature_axis": -1, "output_feature_axis": -1},
)


def __getattr__(name: str) -> Any:
    # Read-only views kept for backwards compatibility.
    if name == "DEFAULT_MATCHERS":
        return tuple((m.name, m.fn) for m in registered_matchers())
    if name == "PATTERN_NAMES":
        return tuple(p for m in registered_matchers() for p in m.pattern_names)
    raise AttributeError(name)


def _match_tied_dense(
    program: Program, ctx: Context, w: Key, shared: set[Key], use_count: dict[Key, int]
) -> tuple[Match, int] | None:
    """One ``Match`` for a weight used by several ``dot_general``s, each a dense layer.

    Every use must match the same parameters (the weight, and the same bias or
    none), with the same kernel layout, and a bias must be used by these
    products only. Uses become ``extra`` entries in the match's meta.
    """
    users = ctx.consumers(program, w)
    if len(users) != use_count[w]:
        return None
    trial = Context(ctx.live, set(ctx.matchable_params) | shared)
    found = []
    for i in users:
        m = match_dense(program, i, trial)
        if m is None or m.params[0] != w:
            return None
        found.append(m)
    first = found[0]
    if any(m.params != first.params or m.meta["kernel_layout"] != first.meta["kernel_layout"] for m in found):
        return None
    if len(first.params) == 2 and use_count.get(first.params[1], 0) != len(found):
        return None
    # Uses may feed each other (``h @ w @ w``): each use's output tangent already carries
    # the later uses. They must share a batch (leading) size to pool as positions.
    leading = {program.avals[m.inputs[0]].shape[0] if program.avals[m.inputs[0]].shape else None for m in found}
    if len(leading) != 1 or None in leading:
        return None
    found.sort(key=lambda m: min(m.nodes))
    extra = tuple(LayerUse(m.output, m.inputs, m.meta) for m in found[1:])
    nodes = frozenset().union(*(m.nodes for m in found))
    pattern = first.pattern
    return Match(first.tag, found[0].output, found[0].inputs, first.params, {**found[0].meta}, pattern, nodes, extra), len(found)


def detect_layers(
    program: Program,
    live: Sequence[int],
    num_params: int,
    register_only_generic: bool = False,
    patterns_to_skip: Sequence[str] = (),
    matchers: Sequence[LayerMatcher] | None = None,
    param_keys: Sequence[Key] | None = None,
) -> Detection:
    """Finds every layer among the live nodes of ``program``.

    Manual tags win; then layers inside ``lax.scan`` bodies that take parameters
    directly (detected on the body, recursively with the same rules); patterns
    then claim single-use parameters; each remaining parameter gets a generic
    site. Parameters used several times (weight sharing) are pooled when they are
    tied dense kernels, else left to the generic block and reported in ``notes``.
    ``matchers`` replaces the registered layer kinds (tried in the given order);
    ``param_keys`` are the parameter keys in order (default: the program's).
    """
    matchers = registered_matchers() if matchers is None else tuple(matchers)
    known = list(dict.fromkeys([*known_pattern_names(), *(n for m in matchers for n in (m.name, *m.pattern_names))]))
    unknown = set(patterns_to_skip) - set(known)
    if unknown:
        raise ValueError(f"patterns_to_skip: unknown pattern names {sorted(unknown)}; known: {known}.")
    skip = set(patterns_to_skip)
    if param_keys is None:
        param_keys = program.param_key_list if len(program.param_key_list) == num_params else program.input_keys[:num_params]
    param_keys = list(param_keys)
    index_of = {k: i for i, k in enumerate(param_keys)}
    live_set = frozenset(live)
    notes: list[str] = []
    matches: list[Match] = []
    claimed: set[Key] = set()

    # 1. Manual registrations.
    matches.extend(_manual_matches(program, live, index_of, claimed))

    # 2. Patterns, on parameters used exactly once and not tagged by hand.
    use_count: dict[Key, int] = {}
    for i in live:
        for a in program.nodes[i].inputs:
            if not isinstance(a, Lit) and a in index_of:
                use_count[a] = use_count.get(a, 0) + 1
    for k, c in use_count.items():
        if c > 1 and k not in claimed:
            notes.append(f"parameter {index_of[k]} is used {c} times (weight sharing); it gets a generic block")
    if not register_only_generic:
        for i in live:
            for m in _scan_matches(program, i, use_count, claimed, patterns_to_skip, matchers, notes, index_of):
                matches.append(m)
                claimed.update(m.params)
    matchable = {k for k in param_keys if use_count.get(k, 0) == 1 and k not in claimed}
    ctx = Context(live_set, matchable)
    taken: set[int] = set()
    if not register_only_generic and "dense" not in skip:
        # Tied weights: one parameter applied by several dense products becomes one layer.
        matches.extend(_tied_matches(program, ctx, use_count, claimed, taken, notes, index_of))
    if not register_only_generic:
        for i in reversed(live):
            if i in taken:
                continue
            for lm in matchers:
                if lm.name in skip:
                    continue
                m = lm.fn(program, i, ctx)
                if m is None or m.pattern in skip:
                    continue
                if any(p in claimed for p in m.params) or m.nodes & taken:
                    continue
                matches.append(m)
                taken |= m.nodes
                claimed.update(m.params)
                ctx.matchable_params.difference_update(m.params)
                break

    # 3. Everything else is generic, with the reason recorded for the report.
    for k in param_keys:
        if k not in claimed:
            reason = _fallback_reason(program, live_set, k, use_count.get(k, 0), register_only_generic)
            matches.append(Match(tags.generic, k, (), (k,), {"fallback_reason": reason}, "generic", frozenset()))

    return Detection(_sites(matches, index_of), tuple(notes))


def _manual_matches(program: Program, live: Sequence[int], index_of: dict, claimed: set) -> list[Match]:
    """The layers the user tagged by hand (their parameters join ``claimed``); a tag on a
    computed value or a parameter tagged twice is an error."""
    matches = []
    for i in live:
        node = program.nodes[i]
        prim = node.primitive
        if not isinstance(prim, tags.LayerTag):
            continue
        outs, ins, ps = prim.split_operands(node.inputs)
        for p in ps:
            if isinstance(p, Lit) or p not in index_of:
                raise ValueError(
                    f"A manually registered '{prim.name}' layer takes a parameter that is not one of the "
                    "model's parameter leaves (it was computed from them or is a constant). Register the raw "
                    "parameter arrays from the `params` argument."
                )
            if p in claimed:
                raise ValueError(f"Parameter {index_of[p]} is registered in more than one layer tag.")
            claimed.add(p)
        meta = {**_MANUAL_META_DEFAULTS.get(prim.name, {}), **dict(node.params)}
        matches.append(Match(prim, node.outputs[0], tuple(ins), tuple(ps), meta, "manual", frozenset({i})))
    return matches


def _tied_matches(
    program: Program, ctx: Context, use_count: dict, claimed: set, taken: set, notes: list[str], index_of: dict
) -> list[Match]:
    """Tied weights: one parameter applied by several dense products becomes one layer (its
    parameters join ``claimed``, its nodes ``taken``, and ``notes`` says so)."""
    matches = []
    shared = {k for k, c in use_count.items() if c > 1 and k not in claimed}
    for k in sorted(shared, key=lambda key: index_of[key]):
        tied = _match_tied_dense(program, ctx, k, shared, use_count)
        if tied is None or tied[0].nodes & taken or any(p in claimed for p in tied[0].params):
            continue
        matches.append(tied[0])
        taken |= tied[0].nodes
        claimed.update(tied[0].params)
        notes[:] = [n for n in notes if not any(n.startswith(f"parameter {index_of[p]} ") for p in tied[0].params)]
        notes.append(
            f"parameters {[index_of[p] for p in tied[0].params]} are tied across {tied[1]} dense products; "
            "their uses are pooled into one Kronecker-factored layer"
        )
    return matches


def _sites(matches: list[Match], index_of: dict) -> tuple[LayerSite, ...]:
    """The matches as named ``LayerSite``s, in parameter order (``Auto[dense(0)]``, ...)."""
    matches = sorted(matches, key=lambda m: min(index_of[p] for p in m.params))
    sites = []
    counts: dict[str, int] = {}
    for m in matches:
        n = counts.get(m.pattern, 0)
        counts[m.pattern] = n + 1
        kind = "Manual" if m.pattern == "manual" else "Auto"
        label = m.tag.name if m.pattern in ("manual", "generic") else m.pattern
        where = f"@scan[{m.scan.mode} x{m.scan.length}]" if m.scan is not None else ""
        sites.append(
            LayerSite(
                tag=m.tag,
                output=m.output,
                inputs=m.inputs,
                param_indices=tuple(index_of[p] for p in m.params),
                meta=m.meta,
                name=f"{kind}[{label}({n})]{where}",
                pattern=m.pattern,
                extra_uses=m.extra_uses,
                scan=m.scan,
            )
        )
    return tuple(sites)


def _scan_matches(
    program: Program,
    idx: int,
    use_count: dict[Key, int],
    claimed: set[Key],
    patterns_to_skip: Sequence[str],
    matchers: Sequence[LayerMatcher],
    notes: list[str],
    index_of: dict[Key, int],
) -> list[Match]:
    """Layers inside the body of the scan at node ``idx``, with outer parameter keys.

    A body layer is kept when each of its parameters is used by this scan only,
    and all of them are stacked (``xs``) or all shared (constants). Stacked layers
    may be of any kind; shared ones must be dense with a batch axis in each step's
    values (their steps become positions, as for tied weights).
    """
    sb = program.nodes[idx].scan
    if sb is None:
        return []
    body = sb.program
    to_outer = {**sb.stacked, **sb.shared}
    det = detect_layers(
        body, body.live_nodes(body.output_atoms), len(body.param_key_list), False, patterns_to_skip, matchers
    )
    out: list[Match] = []
    for site in det.sites:
        if site.tag is tags.generic:
            continue
        okeys = tuple(to_outer[body.param_key_list[j]] for j in site.param_indices)
        if any(use_count.get(k, 0) != 1 or k in claimed for k in okeys):
            continue
        modes = {"stacked" if body.param_key_list[j] in sb.stacked else "shared" for j in site.param_indices}
        if len(modes) != 1:
            notes.append(f"parameters {[index_of[k] for k in okeys]} mix scanned and constant operands of a lax.scan")
            continue
        mode = modes.pop()
        if mode == "shared" and (site.tag is not tags.dense or any(len(body.avals[u.output].shape) < 2 for u in site.uses)):
            continue  # steps pool as positions, which only the dense blocks define (as for tied weights)
        ref = ScanRef(idx, mode, sb.length, body)
        out.append(
            Match(site.tag, site.output, site.inputs, okeys, dict(site.meta), site.pattern, frozenset(), site.extra_uses, ref)
        )
    return out


_CONTROL_FLOW = {"scan": "lax.scan", "while": "lax.while_loop", "cond": "lax.cond"}


def _fallback_reason(program: Program, live: frozenset[int], key: Key, uses: int, only_generic: bool) -> str:
    """Why a parameter ended up in a generic block, in words for the registration report."""
    if only_generic:
        return "register_only_generic=True"
    if uses == 0:
        return "not used by the registered losses"
    if uses > 1:
        return f"used {uses} times (weight sharing)"
    frontier, via = [key], False
    while len(frontier) == 1:  # follow casts/copies of the parameter to its real use
        users = [i for i in program.consumers.get(frontier[0], []) if i in live]
        if len(users) != 1 or program.nodes[users[0]].primitive.name not in _BIAS_PLUMBING:
            break
        frontier, via = [k for k in program.nodes[users[0]].outputs if k is not None], True
    if via and frontier:
        for i in program.consumers.get(frontier[0], []):
            name = program.nodes[i].primitive.name
            if i in live and name in _CONTROL_FLOW:
                return (
                    f"passed to {_CONTROL_FLOW[name]} after a cast or reshape; layers are detected inside "
                    "lax.scan only for parameters passed to it directly (as constants or xs)"
                )
    for i in program.consumers.get(key, []):
        name = program.nodes[i].primitive.name
        if i in live and program.nodes[i].scan is not None:
            return (
                "used inside lax.scan, where no supported layer uses it (supported: stacked layers of any kind "
                "passed as xs, dense layers passed as constants)"
            )
        if i in live and name in _CONTROL_FLOW:
            return (
                f"used inside {_CONTROL_FLOW[name]}, where layers are not detected (only parameters passed "
                "directly as lax.scan constants or xs are; a Python loop gives each layer its own block)"
            )
    return "no known layer pattern uses it"


def _repeated_dense(site: LayerSite, inputs: Sequence[jax.ShapeDtypeStruct]) -> bool:
    """Whether a detected dense layer is applied over extra axes (input ``(B, ..., d_in)``, one
    application; in a stacked ``lax.scan``, each layer's slice): kfac-jax 0.0.8's graph matcher
    makes such a layer its ``"repeated_dense"`` variant, whose block
    (``RepeatedDenseKroneckerFactored``) leaves the positions with an all-zero output cotangent
    (padding) out of the statistics. A stacked scan's slices get the same block as the Python
    loop's layers, so the two keep exactly the same curvature."""
    if site.scan is None:
        rank = len(inputs[0].shape) if len(inputs) == 1 else 0
    elif site.scan.mode == "stacked":
        rank = len(inputs[0].shape) - 1 if len(inputs) == 1 else 0  # a slice: without the stack axis
    else:
        return False
    return (
        site.tag is tags.dense
        and not site.extra_uses
        and site.meta.get("kernel_layout") in ("io", "oi")
        and "variant" not in site.meta
        and rank > 2
    )


def site_to_tag_eqn(program: Program, site: LayerSite) -> tags.LayerTagEqn:
    """The block-facing description of a layer (shapes, dtypes, meta)."""

    def struct_in(prog: Program, a: Any) -> jax.ShapeDtypeStruct:
        if isinstance(a, Lit):
            arr = np.asarray(a.value)
            return jax.ShapeDtypeStruct(arr.shape, arr.dtype)
        aval = prog.avals[a]
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)

    scan = site.scan

    def struct(a: Any) -> jax.ShapeDtypeStruct:
        return struct_in(program, a)

    def moved(s: jax.ShapeDtypeStruct, axis: Any) -> jax.ShapeDtypeStruct:
        if axis is None or not s.shape:
            return s
        return jax.eval_shape(lambda a: features_last(a, axis), s)

    def pooled(structs: Sequence[jax.ShapeDtypeStruct]) -> jax.ShapeDtypeStruct:
        if len(structs) == 1:
            return structs[0]
        rows = sum(int(np.prod(s.shape[1:-1], dtype=int)) for s in structs)
        return jax.ShapeDtypeStruct((structs[0].shape[0], rows, structs[0].shape[-1]), structs[0].dtype)

    def data(a: Any, axis: Any) -> jax.ShapeDtypeStruct:
        """A layer input/output as the blocks see it (scan steps: a leading axis, or positions)."""
        if scan is None:
            return moved(struct(a), axis)
        one = moved(struct_in(scan.body, a), axis)
        if scan.mode == "stacked":
            return jax.ShapeDtypeStruct((scan.length,) + tuple(one.shape), one.dtype)
        return jax.ShapeDtypeStruct((one.shape[0], scan.length) + tuple(one.shape[1:]), one.dtype)

    def pooled_data(structs: Sequence[jax.ShapeDtypeStruct]) -> jax.ShapeDtypeStruct:
        if scan is None or scan.mode == "shared" or len(structs) == 1:
            return pooled(structs)
        inner = pooled([jax.ShapeDtypeStruct(s.shape[1:], s.dtype) for s in structs])
        return jax.ShapeDtypeStruct((scan.length,) + tuple(inner.shape), inner.dtype)

    params = tuple(struct(program.param_key_list[i]) for i in site.param_indices)
    uses = site.uses
    outputs = ()
    if site.tag is not tags.generic:
        outputs = (pooled_data([data(u.output, u.meta.get("output_feature_axis")) for u in uses]),)
    inputs = tuple(
        pooled_data([data(u.inputs[k], u.meta.get("input_feature_axis")) for u in uses])
        for k in range(len(site.inputs))
    )
    meta = dict(site.meta)
    if scan is not None:
        meta["scan_mode"], meta["scan_length"] = scan.mode, scan.length
    if _repeated_dense(site, inputs):
        meta["variant"] = "repeated_dense"
    return tags.LayerTagEqn(
        primitive=site.tag,
        outputs=outputs,
        inputs=inputs,
        params=params,
        param_indices=site.param_indices,
        meta=meta,
        name=site.name,
    )
