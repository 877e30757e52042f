"""Tracing: a user function as a flat program we can read and re-run.

``jax.make_jaxpr`` gives the equations of the user's function. We flatten
calls (``jit``, ``closed_call``, ``remat``) into one list of equations keyed by
integers, drop what the registered losses do not need, and evaluate the rest
with public JAX calls. While evaluating we can add a perturbation to chosen
values (the outputs of layers) and record others (their inputs): differentiating
with respect to a zero perturbation gives the loss's gradient w.r.t. a layer's
output, which is what every curvature block is estimated from.

Nothing here re-implements JAX semantics: first-order primitives are bound with
their own parameters; equations with sub-jaxprs are evaluated by JAX itself
(see ``_compat.eval_equation``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, Iterable, Mapping, Sequence, TypeVar

import jax
import jax.numpy as jnp

from curvax import _compat, tags

Key = int
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, eq=False)
class Lit:
    """A literal operand of an equation (compared and hashed by identity: values may be arrays)."""

    value: Any


Atom = Any  # Key | Lit


@dataclasses.dataclass
class Node:
    """One equation of the flattened program, with integer keys for its values."""

    eqn: Any
    inputs: tuple[Atom, ...]
    outputs: tuple[Key | None, ...]
    scan: "ScanBody | None" = None

    @property
    def primitive(self) -> Any:
        return self.eqn.primitive

    @property
    def params(self) -> Mapping[str, Any]:
        return self.eqn.params


@dataclasses.dataclass
class ScanBody:
    """The body of a ``lax.scan`` that takes parameters directly, as its own ``Program``.

    Layers inside it are detected on ``program``; ``stacked`` maps its parameter
    keys that iterate over a leading axis (scan ``xs``, one slice per step: stacked
    layers) to the outer parameter keys, ``shared`` those passed unchanged to every
    step (scan constants: one layer applied ``length`` times, e.g. an RNN cell).
    """

    program: "Program"
    layout: Any  # _compat.ScanLayout
    stacked: dict[Key, Key]
    shared: dict[Key, Key]

    @property
    def length(self) -> int:
        return self.layout.length


@dataclasses.dataclass
class ScanSpec:
    """What to do inside one scan while evaluating: perturb body keys, record body atoms.

    ``perturb`` maps a body key to a ``(length, ...)`` array added at step ``i``
    (slice ``i``); ``record`` lists body atoms whose per-step values are returned
    stacked along a new leading axis.
    """

    perturb: dict[Key, Any] = dataclasses.field(default_factory=dict)
    record: list[Atom] = dataclasses.field(default_factory=list)


class Program:
    """The flattened equations of a traced function.

    Attributes:
      nodes: equations in evaluation order.
      input_keys: one key per flat argument leaf.
      output_atoms: one atom per flat output leaf.
      consts: values of the closed-over constants, by key.
      avals: abstract value (shape, dtype) of every key.
    """

    def __init__(self, closed_jaxpr: Any, param_leaf_positions: Sequence[int] = (), open_scans: bool = True):
        self.nodes: list[Node] = []
        self.consts: dict[Key, Any] = {}
        self.avals: dict[Key, Any] = {}
        self._counter = 0
        self._open_scans = open_scans
        # Custom-derivative calls whose primal body was inlined (to find layers inside): the
        # program's derivative there is the primal's, not the user's rule.
        self.inlined_custom_derivatives: list[str] = []
        self.input_keys = [self._new_key(v.aval) for v in closed_jaxpr.jaxpr.invars]
        self.param_key_list = [self.input_keys[i] for i in param_leaf_positions]
        self.param_keys = frozenset(self.param_key_list)
        self.output_atoms = self._flatten(closed_jaxpr, self.input_keys)
        self.producer: dict[Key, int] = {}
        self.consumers: dict[Key, list[int]] = {}
        for i, node in enumerate(self.nodes):
            for k in node.outputs:
                if k is not None:
                    self.producer[k] = i
            for a in node.inputs:
                if not isinstance(a, Lit):
                    self.consumers.setdefault(a, []).append(i)

    def _new_key(self, aval: Any) -> Key:
        k = self._counter
        self._counter += 1
        self.avals[k] = aval
        return k

    def _flatten(self, closed: Any, in_atoms: Sequence[Atom]) -> list[Atom]:
        jaxpr = closed.jaxpr
        env: dict[Any, Atom] = {}
        for v, val in zip(jaxpr.constvars, closed.consts):
            k = self._new_key(v.aval)
            self.consts[k] = val
            env[v] = k
        for v, a in zip(jaxpr.invars, in_atoms):
            env[v] = a

        def read(v: Any) -> Atom:
            return Lit(v.val) if _compat.is_literal(v) else env[v]

        for eqn in jaxpr.eqns:
            ins = tuple(read(v) for v in eqn.invars)
            sub = _compat.sub_closed_jaxpr(eqn)
            name = eqn.primitive.name
            inline = sub is not None and (
                name in _compat.CALL_PRIMITIVE_NAMES
                or (name in _compat.CUSTOM_DERIVATIVE_NAMES and any(a in self.param_keys for a in ins))
            )
            if inline and len(sub.jaxpr.invars) == len(ins):
                if name in _compat.CUSTOM_DERIVATIVE_NAMES:
                    self.inlined_custom_derivatives.append(name)
                outs = self._flatten(sub, ins)
                for v, a in zip(eqn.outvars, outs):
                    if not _compat.is_dropvar(v):
                        env[v] = a
                continue
            outs_keys: list[Key | None] = []
            for v in eqn.outvars:
                if _compat.is_dropvar(v):
                    outs_keys.append(None)
                else:
                    k = self._new_key(v.aval)
                    env[v] = k
                    outs_keys.append(k)
            self.nodes.append(Node(eqn, ins, tuple(outs_keys), self._scan_body(eqn, ins)))
        return [read(v) for v in jaxpr.outvars]

    def _scan_body(self, eqn: Any, ins: Sequence[Atom]) -> ScanBody | None:
        """Opens a top-level ``lax.scan`` whose constants or ``xs`` are parameters."""
        if not self._open_scans:
            return None
        layout = _compat.scan_layout(eqn)
        if layout is None:
            return None
        nc, ncar = layout.num_consts, layout.num_carry
        positions = [j for j, a in enumerate(ins) if not isinstance(a, Lit) and a in self.param_keys and not nc <= j < nc + ncar]
        if not positions:
            return None
        body = Program(layout.body, positions, open_scans=False)
        self.inlined_custom_derivatives.extend(body.inlined_custom_derivatives)
        stacked = {body.input_keys[j]: ins[j] for j in positions if j >= nc + ncar}
        shared = {body.input_keys[j]: ins[j] for j in positions if j < nc}
        return ScanBody(body, layout, stacked, shared)

    # --- analysis -----------------------------------------------------------------

    def live_nodes(self, roots: Iterable[Atom]) -> list[int]:
        """Indices of the nodes that the given atoms depend on, in order."""
        needed = {a for a in roots if not isinstance(a, Lit)}
        live: list[int] = []
        for i in range(len(self.nodes) - 1, -1, -1):
            node = self.nodes[i]
            if any(k in needed for k in node.outputs if k is not None):
                live.append(i)
                needed.update(a for a in node.inputs if not isinstance(a, Lit))
        return live[::-1]

    # --- evaluation ---------------------------------------------------------------

    def check_inputs(self, flat_args: Sequence[Any]) -> None:
        """Raises unless ``flat_args`` have exactly the shapes and dtypes the program was traced with.

        A traced program is specialised to its input shapes: frameworks bake sizes into its
        equations (Haiku broadcasts a dense layer's bias to ``(batch, out)``), so running it on,
        say, one example of a batch can compute something else without failing. Re-trace the
        function at the new shapes instead (``ProcessedJaxpr.make_from_func``, or an estimator's
        ``processed_jaxpr_for``).
        """
        if len(flat_args) != len(self.input_keys):
            raise ValueError(
                f"The traced program takes {len(self.input_keys)} flat inputs, got {len(flat_args)}; "
                "re-trace the function for these arguments."
            )
        for i, (k, x) in enumerate(zip(self.input_keys, flat_args)):
            aval = self.avals[k]
            shape, dtype = tuple(jnp.shape(x)), jnp.result_type(x)
            if shape != tuple(aval.shape) or dtype != aval.dtype:
                raise ValueError(
                    f"The traced program was evaluated on flat input {i} of shape {shape} and dtype {dtype}, "
                    f"but it was traced with shape {tuple(aval.shape)} and dtype {aval.dtype}. A traced program "
                    "only computes the function at the shapes it was traced with (sizes such as the batch "
                    "size are baked into its equations); re-trace the function at these shapes "
                    "(e.g. an estimator's processed_jaxpr_for(func_args))."
                )

    def evaluate(
        self,
        flat_args: Sequence[Any],
        node_indices: Sequence[int],
        wanted: Sequence[Atom],
        transform: Mapping[Key, Callable[[Any], Any]] | None = None,
        scans: Mapping[int, ScanSpec] | None = None,
        recorded: dict[int, list[Any]] | None = None,
        detach: frozenset[int] = frozenset(),
    ) -> list[Any]:
        """Evaluates the given nodes; returns the values of ``wanted``.

        ``transform[k]`` (if given) replaces the value of key ``k`` right after it
        is computed (or, for inputs, before use): this is how perturbations are
        added to layer outputs. ``scans[i]`` does the same inside the body of the
        scan at node ``i``; the values it records go to ``recorded[i]``. Nodes in
        ``detach`` read their inputs through ``stop_gradient``: values that are only
        read (e.g. the user's own backward pass) are not differentiated again.
        """
        self.check_inputs(flat_args)
        scans = scans or {}
        transform = transform or {}
        env: dict[Key, Any] = dict(self.consts)
        for k, x in zip(self.input_keys, flat_args):
            env[k] = x
        for k, fn in transform.items():
            if k in env:
                env[k] = fn(env[k])

        def read(a: Atom) -> Any:
            return a.value if isinstance(a, Lit) else env[a]

        for i in node_indices:
            node = self.nodes[i]
            invals = [read(a) for a in node.inputs]
            if i in detach:
                invals = [jax.lax.stop_gradient(v) for v in invals]
            if i in scans:
                outs, rec = _eval_scan(node, invals, scans[i])
                if recorded is not None:
                    recorded[i] = rec
            else:
                outs = _compat.eval_equation(node.eqn, invals)
            for k, x in zip(node.outputs, outs):
                if k is None:
                    continue
                env[k] = transform[k](x) if k in transform else x
        return [read(a) for a in wanted]


def _eval_scan(node: Node, invals: Sequence[Any], spec: ScanSpec) -> tuple[list[Any], list[Any]]:
    """Runs a scan node with ``lax.scan`` over its body program, perturbing and recording per step."""
    assert node.scan is not None
    body, lay = node.scan.program, node.scan.layout
    nc, ncar = lay.num_consts, lay.num_carry
    consts, init, xs = list(invals[:nc]), list(invals[nc : nc + ncar]), list(invals[nc + ncar :])
    pert_keys = list(spec.perturb)
    outs_atoms = list(body.output_atoms)
    nodes = body.live_nodes(outs_atoms + list(spec.record))
    carry_avals = [v.aval for v in lay.body.jaxpr.outvars[:ncar]]

    def step(carry: tuple, x: tuple) -> tuple[tuple, tuple]:
        xs_i, eps_i = x
        tf = {k: (lambda v, e=e: v + e) for k, e in zip(pert_keys, eps_i)}
        vals = body.evaluate(consts + list(carry) + list(xs_i), nodes, outs_atoms + list(spec.record), tf)
        new_carry = tuple(jnp.asarray(v, a.dtype) for v, a in zip(vals[:ncar], carry_avals))
        return new_carry, (tuple(vals[ncar : len(outs_atoms)]), tuple(vals[len(outs_atoms) :]))

    eps = tuple(spec.perturb[k] for k in pert_keys)
    carry, (ys, rec) = jax.lax.scan(
        step, tuple(init), (tuple(xs), eps), length=lay.length, reverse=lay.reverse, unroll=lay.unroll
    )
    return list(carry) + list(ys), list(rec)


@dataclasses.dataclass(frozen=True)
class LossSite:
    """Where a registered loss sits in the program: its tag and operand atoms."""

    tag: tags.LossTag
    operands: tuple[Atom, ...]
    args_names: tuple[str, ...]

    @property
    def dependant_operands(self) -> tuple[Atom, ...]:
        return tuple(a for a, n in zip(self.operands, self.args_names) if n in self.tag.parameter_dependants_names)


@dataclasses.dataclass(frozen=True)
class LayerSite:
    """One layer in the program.

    ``output`` is the key to which a perturbation is added, ``inputs`` the layer's
    inputs, ``param_indices`` positions in the flat parameter leaves. ``meta``
    says how to bring inputs/outputs to the canonical layout the blocks expect
    (features last): ``input_feature_axis`` and ``output_feature_axis``.
    ``extra_uses`` lists further applications of the same parameters (tied
    weights); their statistics are pooled like extra positions. ``scan`` is set
    for a layer inside a ``lax.scan`` body: its keys are then keys of that body.
    """

    tag: tags.LayerTag
    output: Key
    inputs: tuple[Atom, ...]
    param_indices: tuple[int, ...]
    meta: Mapping[str, Any]
    name: str
    pattern: str
    extra_uses: tuple["LayerUse", ...] = ()
    scan: "ScanRef | None" = None

    @property
    def uses(self) -> tuple["LayerUse", ...]:
        """Every application of the layer's parameters: one, or several for tied weights."""
        return (LayerUse(self.output, self.inputs, self.meta),) + tuple(self.extra_uses)


@dataclasses.dataclass(frozen=True, eq=False)
class ScanRef:
    """Where a layer inside a scan lives: the scan's node index and how its parameters iterate.

    ``mode`` is ``"stacked"`` (a parameter with a leading axis of size ``length``,
    one independent layer per slice) or ``"shared"`` (the same parameter at every
    step: the steps are pooled like extra positions, KFAC-expand over time).
    """

    node: int
    mode: str
    length: int
    body: Program


@dataclasses.dataclass(frozen=True)
class LayerUse:
    """One application of a layer: where its output is, its inputs, its layout meta."""

    output: Key
    inputs: tuple[Atom, ...]
    meta: Mapping[str, Any]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerData(Generic[T]):
    """A layer's ``inputs``, ``outputs`` and ``params`` (a pytree of three tuples).

    The values a layer tag equation binds, split by the tag. kfac-jax calls this
    class ``layers_and_loss_tags.LayerData``; ``curvax.kfac_api`` re-exports it.
    """

    inputs: tuple[T, ...]
    outputs: tuple[T, ...]
    params: tuple[T, ...]

    def tree_flatten(self) -> tuple[tuple[tuple, tuple, tuple], None]:
        """Pytree flattening: children ``(inputs, outputs, params)``, no aux data."""
        return (self.inputs, self.outputs, self.params), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: Sequence[tuple]) -> "LayerData":
        inputs, outputs, params = children
        return cls(inputs=inputs, outputs=outputs, params=params)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerVjpData(Generic[T]):
    """One layer's ``primals`` and ``tangents`` (each a ``LayerData``): what a block is estimated from.

    ``tangents.outputs`` and ``tangents.params`` are the cotangents of the
    layer's outputs and parameters; ``tangents.inputs`` is always ``()``. Blocks
    written against kfac-jax v0.0.8 receive their estimation data in this form
    (kfac-jax's ``tracer.LayerVjpData``; ``curvax.kfac_api`` re-exports it).
    """

    primals: LayerData[T]
    tangents: LayerData[T]

    def tree_flatten(self) -> tuple[tuple[LayerData, LayerData], None]:
        """Pytree flattening: children ``(primals, tangents)``, no aux data."""
        return (self.primals, self.tangents), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: Sequence[LayerData]) -> "LayerVjpData":
        primals, tangents = children
        return cls(primals=primals, tangents=tangents)


def features_last(x: Any, axes: Any) -> Any:
    """Moves the feature axis (an int) or axes (a tuple, flattened in that order) of ``x`` last.

    This is how layer inputs and outputs reach the blocks: ``(batch, ..., features)``.
    """
    if axes is None:
        return x
    if isinstance(axes, int):
        return jnp.moveaxis(x, axes, -1)
    axes = tuple(a % x.ndim for a in axes)
    moved = jnp.moveaxis(x, axes, tuple(range(x.ndim - len(axes), x.ndim)))
    return moved.reshape(moved.shape[: x.ndim - len(axes)] + (-1,))


def find_loss_sites(program: Program) -> list[LossSite]:
    sites = []
    for node in program.nodes:
        if isinstance(node.primitive, tags.LossTag):
            sites.append(LossSite(node.primitive, node.inputs, tuple(node.params["args_names"])))
    return sites


def make_loss(site: LossSite, values: Sequence[Any]) -> Any:
    return site.tag.loss(*values, args_names=site.args_names)
