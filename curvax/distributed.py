"""Distributed curvature work: on N devices each one refreshes and applies ~1/N of the blocks.

Without this, every device of a data-parallel step recomputes every block's decompositions
(the statistics are the same on all of them after the averaging), so N devices do N times
the work of one. Here the blocks are dealt to the devices by cost (``assign``: largest first,
each onto the device with the least work so far), each device runs only its blocks' work
inside one ``lax.switch`` on its index, and one ``all_gather`` per dtype shares the results;
every device then unpacks the same full set. The owner runs exactly the computation a single
device would, and packing, gathering and unpacking only move bits, so the results equal the
undistributed ones.

Two ways of running on several devices are served (``Distribution``):

* kfac-jax's pmap mode: the caller already runs under ``jax.pmap(axis_name=...)``; the device
  index is ``lax.axis_index(axis_name)`` and the gather runs over that axis.
* ``jax.sharding``: the caller runs (typically jitted) on arrays replicated over a ``Mesh``;
  the work goes through ``shard_map`` over all the mesh's axes, flattened into one device
  index, with replicated inputs and outputs.

Only the outputs that differ from the inputs are shared: a jaxpr of each block's work tells
which output leaves are its inputs passed through (a refresh leaves the statistics as they are,
except EKFAC's eigenvalue correction), and those are taken from the local inputs unsent.

When the curvature state itself is split over the mesh (``Distribution.split_state``: every
large matrix placed by ``curvax.parallel.split_spec``, as ``Optimizer(shard_curvature_state=...)``
stores it), replicated inputs and outputs would make XLA gather every whole factor onto every
device. There the ``shard_map`` takes and returns the state as it is stored, and only what each
device needs moves (``_exchange``): one ``all_to_all`` per dtype brings the owner of a block
every device's slice of the block's inputs that its work reads, and after the work a second
``all_to_all`` sends each device its slice of the results that live split. So a device holds
its own blocks' whole matrices and its slices of the others, ~1/N of the state, not all of it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from curvax import parallel

try:  # `jax.shard_map` (JAX >= 0.7); before, the experimental module with its `check_rep` flag
    _shard_map = jax.shard_map
    _UNCHECKED: dict[str, bool] = {"check_vma": False}
except AttributeError:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map as _shard_map

    _UNCHECKED = {"check_rep": False}


@dataclasses.dataclass(frozen=True)
class Distribution:
    """Where and which curvature work is split over devices.

    Exactly one of ``axis_name`` (pmap mode: the calls run inside a ``pmap`` over it) and
    ``mesh`` (sharding path: the arrays are replicated on it) is given.

    Attributes:
      axis_name: the ``pmap`` axis name, or None.
      mesh: the ``jax.sharding.Mesh`` the state is replicated on, or None.
      inverses: split the cache refresh (decompositions, inverses). kfac-jax's
        ``distributed_inverses``.
      precon_apply: split the products with the (inverse) curvature. kfac-jax's
        ``distributed_precon_apply``.
      split_state: the curvature state is stored split over ``mesh``, every leaf as
        ``curvax.parallel.split_spec`` places it (the optimizer's ``shard_curvature_state``);
        the work then moves only each device's share of it (mesh only).
    """

    axis_name: Any = None
    mesh: Mesh | None = None
    inverses: bool = True
    precon_apply: bool = True
    split_state: bool = False

    def __post_init__(self) -> None:
        if (self.axis_name is None) == (self.mesh is None):
            raise ValueError("A Distribution needs exactly one of `axis_name` (pmap mode) and `mesh` (sharding).")
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise TypeError(f"`mesh` must be a jax.sharding.Mesh, got {type(self.mesh).__name__}.")
        if self.split_state and self.mesh is None:
            raise ValueError("`split_state=True` needs a `mesh`: pmap mode stores a whole state on every device.")

    def num_devices(self) -> int:
        """How many devices share the work here: the mesh's size, or the bound pmap axis's size
        (1 outside a pmap over ``axis_name``, where the work is not split)."""
        if self.mesh is not None:
            return int(self.mesh.size)
        try:
            return int(lax.axis_size(self.axis_name)) if hasattr(lax, "axis_size") else int(lax.psum(1, self.axis_name))
        except NameError:  # not inside a pmap over axis_name: nothing to share with
            return 1


def make_distribution(
    distributed_inverses: bool, distributed_precon_apply: bool, axis_name: Any = None, params: Any = None,
    mesh: Mesh | None = None, split_state: bool = False,
) -> Distribution | None:
    """The ``Distribution`` an optimizer hands its estimator, or None where nothing is split.

    ``axis_name`` (pmap mode) wins; otherwise the mesh is ``mesh`` or that of ``params``
    (``curvax.parallel.params_mesh``: every leaf a ``NamedSharding`` on one mesh of several
    devices). None when both flags are off or there is no axis and no such mesh.
    ``split_state``: the curvature state is stored split on that mesh (ignored in pmap mode).
    """
    if not (distributed_inverses or distributed_precon_apply):
        return None
    if axis_name is None:
        if mesh is None and params is not None:
            mesh = parallel.params_mesh(params)
        if not isinstance(mesh, Mesh) or mesh.size <= 1:  # no mesh, or an abstract one (inside jit)
            return None
    return Distribution(axis_name, None if axis_name is not None else mesh,
                        bool(distributed_inverses), bool(distributed_precon_apply),
                        bool(split_state) and axis_name is None)


def assign(costs: Sequence[float], num_bins: int) -> tuple[int, ...]:
    """Each item's bin, balancing the bins' summed costs (LPT scheduling).

    Items are taken largest cost first (ties: lowest index) and each goes to the bin with the
    least cost so far (ties: lowest bin). The largest bin is at most 4/3 of the optimum.
    A pure function of its arguments, so every device and every trace agrees on it.
    """
    if num_bins < 1:
        raise ValueError(f"`num_bins` must be at least 1, got {num_bins}.")
    load = [0.0] * num_bins
    bins = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        b = min(range(num_bins), key=lambda q: (load[q], q))
        bins[i] = b
        load[b] += costs[i]
    return tuple(bins)


def map_blocks(
    fns: Sequence[Callable[[Any], Any]], operands: Sequence[Any], costs: Sequence[float],
    distribution: Distribution | None, enabled: bool = True, split: Sequence[Any] | None = None,
    split_outputs: bool = False,
) -> list[Any]:
    """``[fns[i](operands[i]) for i]``, each device computing only the items ``assign`` gives it.

    ``operands[i]`` is a pytree (array leaves are the work's inputs, other leaves are static);
    ``costs`` weigh the items for ``assign``. With ``distribution`` None, ``enabled`` False, or
    one device, this is the plain list. Otherwise every device gets the full list, the same
    numbers as the plain one.

    ``split`` (per operand, a pytree prefix of bools) marks the leaves stored like the
    curvature state, and ``split_outputs`` says the outputs are state too: with
    ``distribution.split_state`` those leaves enter and leave split by ``parallel.split_spec``
    and only the owners' shares move (see the module docstring); the rest are replicated.
    """
    num = distribution.num_devices() if distribution is not None and enabled else 1
    if num <= 1 or not fns:
        return [f(x) for f, x in zip(fns, operands)]
    owners = assign(costs, num)
    plans = [_Plan.of(f, x) for f, x in zip(fns, operands)]
    dynamic = [p.dynamic for p in plans]
    assert distribution is not None
    if distribution.axis_name is not None:
        shared = _share(plans, dynamic, owners, num, distribution.axis_name)
        return [p.assemble(s, d) for p, s, d in zip(plans, shared, dynamic)]
    mesh = distribution.mesh
    assert mesh is not None
    axes = tuple(mesh.axis_names)
    in_specs, out_specs = _state_specs(plans, operands, split, split_outputs, distribution)
    if in_specs is None:  # nothing stored split: replicated in and out, one all_gather
        run = lambda dyn: _share(plans, dyn, owners, num, axes)
        spec = PartitionSpec()
        shared = _shard_map(run, mesh=mesh, in_specs=(spec,), out_specs=spec, **_UNCHECKED)(dynamic)
    else:
        run = lambda dyn: _exchange(plans, dyn, owners, mesh, in_specs, out_specs)
        shared = _shard_map(run, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, **_UNCHECKED)(dynamic)
    return [p.assemble(s, d) for p, s, d in zip(plans, shared, dynamic)]


def _state_specs(
    plans: Sequence["_Plan"], operands: Sequence[Any], split: Sequence[Any] | None, split_outputs: bool,
    distribution: Distribution,
) -> tuple[Any, Any]:
    """Per item, the ``PartitionSpec`` of each dynamic input and of each travelling output; (None,
    None) when the state is not stored split or no such leaf is actually split."""
    if not distribution.split_state or (split is None and not split_outputs):
        return None, None
    mesh = distribution.mesh
    rep = PartitionSpec()
    if split is not None and len(split) != len(plans):
        raise ValueError(f"`split` needs one entry per operand ({len(plans)}), got {len(split)}.")
    in_specs, out_specs = [], []
    for i, (p, x) in enumerate(zip(plans, operands)):
        flags = [False] * len(p.static)
        if split is not None:
            marks = jax.tree_util.tree_map(lambda f, sub: jax.tree_util.tree_map(lambda _: bool(f), sub), split[i], x)
            flags = jax.tree_util.tree_leaves(marks)
        dyn_flags = [f for f, s in zip(flags, p.static) if s is None]
        in_specs.append([parallel.split_spec(tuple(d.shape), mesh) if f else rep for d, f in zip(p.dynamic, dyn_flags)])
        out_specs.append([parallel.split_spec(tuple(p.out_shapes[j].shape), mesh) if split_outputs else rep
                          for j in p.sent()])
    if all(s == rep for specs in in_specs + out_specs for s in specs):
        return None, None
    return in_specs, out_specs


# --- the mechanism ---------------------------------------------------------------------------


def _transport_dtype(dtype: Any) -> Any:
    """The dtype a leaf travels in: its own, but ``bool`` as ``uint8`` (gathered everywhere)."""
    return np.dtype(np.uint8) if np.dtype(dtype) == np.bool_ else np.dtype(dtype)


@dataclasses.dataclass
class _Plan:
    """One item's work, analysed once: its dynamic inputs and which outputs must travel."""

    fn: Callable[[Any], Any]
    treedef: Any  # of the operand
    static: list  # operand leaves, None where dynamic
    dynamic: list  # the operand's array leaves
    out_treedef: Any
    out_shapes: list  # ShapeDtypeStruct per output leaf
    forwarded: list  # per output leaf: index into ``dynamic`` it passes through, or None
    read: list = dataclasses.field(default_factory=list)  # per dynamic input: whether the work reads it

    @classmethod
    def of(cls, fn: Callable[[Any], Any], operand: Any) -> "_Plan":
        leaves, treedef = jax.tree_util.tree_flatten(operand)
        is_dyn = [isinstance(x, (jax.Array, np.ndarray, np.generic)) for x in leaves]
        static = [None if d else x for x, d in zip(leaves, is_dyn)]
        dynamic = [x for x, d in zip(leaves, is_dyn) if d]
        plan = cls(fn, treedef, static, dynamic, None, [], [])
        closed, out = jax.make_jaxpr(lambda *dyn: fn(plan.operand(dyn)), return_shape=True)(*dynamic)
        out_leaves, plan.out_treedef = jax.tree_util.tree_flatten(out)
        plan.out_shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out_leaves]
        position = {id(v): k for k, v in enumerate(closed.jaxpr.invars)}
        plan.forwarded = [position.get(id(v)) for v in closed.jaxpr.outvars]
        # An input the work reads: one an equation takes (a passed-through output is not read).
        taken = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars}
        plan.read = [id(v) in taken for v in closed.jaxpr.invars]
        return plan

    def operand(self, dynamic: Sequence[Any]) -> Any:
        """The operand rebuilt from its dynamic leaves and the static ones."""
        it = iter(dynamic)
        return jax.tree_util.tree_unflatten(self.treedef, [next(it) if s is None else s for s in self.static])

    def sent(self) -> list[int]:
        """Indices of the output leaves that travel (computed, not passed through)."""
        return [j for j, f in enumerate(self.forwarded) if f is None]

    def assemble(self, shared: Sequence[Any], dynamic: Sequence[Any]) -> Any:
        """The full output from the travelled leaves ``shared`` and the local inputs ``dynamic``."""
        it = iter(shared)
        leaves = [next(it) if f is None else dynamic[f] for f in self.forwarded]
        return jax.tree_util.tree_unflatten(self.out_treedef, leaves)


def _share(plans: Sequence[_Plan], dynamic: Sequence[Sequence[Any]], owners: Sequence[int], num: int, axis: Any) -> list[list[Any]]:
    """Inside the device context: run this device's items, gather, unpack everyone's.

    Each device packs its items' travelling outputs into one flat buffer per transport dtype,
    padded to the longest device's length so every branch of the ``switch`` has one shape.
    Returns, per item, its travelling output leaves.
    """
    dtypes: list[Any] = []
    for p in plans:
        for j in p.sent():
            t = _transport_dtype(p.out_shapes[j].dtype)
            if t not in dtypes:
                dtypes.append(t)
    # Static layout: (dtype, offset, size) of each travelling leaf in its owner's buffer.
    fill = [{t: 0 for t in dtypes} for _ in range(num)]
    where: list[list[tuple[Any, int, int]]] = []
    for p, d in zip(plans, owners):
        spots = []
        for j in p.sent():
            t, size = _transport_dtype(p.out_shapes[j].dtype), int(np.prod(p.out_shapes[j].shape, dtype=int))
            spots.append((t, fill[d][t], size))
            fill[d][t] += size
        where.append(spots)
    length = {t: max(f[t] for f in fill) for t in dtypes}

    def branch(device: int) -> Callable[[Any], tuple]:
        def run(dyn: Sequence[Sequence[Any]]) -> tuple:
            parts: dict[Any, list] = {t: [] for t in dtypes}
            for p, d, x in zip(plans, owners, dyn):
                if d != device:
                    continue
                out = jax.tree_util.tree_leaves(p.fn(p.operand(x)))
                for j in p.sent():
                    parts[_transport_dtype(p.out_shapes[j].dtype)].append(jnp.ravel(out[j]).astype(_transport_dtype(out[j].dtype)))
            return tuple(
                jnp.concatenate(parts[t] + [jnp.zeros(length[t] - sum(x.size for x in parts[t]), t)]) for t in dtypes
            )

        return run

    if not dtypes:
        return [[] for _ in plans]
    local = lax.switch(lax.axis_index(axis), [branch(d) for d in range(num)], dynamic)
    gathered = dict(zip(dtypes, lax.all_gather(local, axis)))  # each (num, length)
    out = []
    for p, d, spots in zip(plans, owners, where):
        leaves = []
        for j, (t, offset, size) in zip(p.sent(), spots):
            shape = p.out_shapes[j]
            leaves.append(gathered[t][d, offset:offset + size].reshape(shape.shape).astype(shape.dtype))
        out.append(leaves)
    return out


# --- the state stored split: moving only each device's share ---------------------------------


class _Layout:
    """Static places of flat pieces in per-row buffers, one buffer per transport dtype.

    Row ``r`` holds the pieces ``add``-ed for it, one after the other; every row of a dtype is
    padded to the longest, so the buffers of all rows stack into one ``(rows, length)`` array.
    """

    def __init__(self, rows: int) -> None:
        self.fill: list[dict[Any, int]] = [{} for _ in range(rows)]
        self.keys: list[list[Any]] = [[] for _ in range(rows)]
        self.spots: dict[tuple[int, Any], tuple[Any, int, int]] = {}  # (row, key) -> (dtype, offset, size)
        self.dtypes: list[Any] = []

    def add(self, row: int, key: Any, shape: tuple[int, ...], dtype: Any) -> None:
        t, size = _transport_dtype(dtype), int(np.prod(shape, dtype=int))
        if t not in self.dtypes:
            self.dtypes.append(t)
        offset = self.fill[row].get(t, 0)
        self.fill[row][t] = offset + size
        self.spots[(row, key)] = (t, offset, size)
        self.keys[row].append(key)

    def length(self, t: Any) -> int:
        return max(f.get(t, 0) for f in self.fill)

    def row(self, row: int, piece: Callable[[Any], Any]) -> tuple:
        """Row ``row``'s buffers (a tuple over ``dtypes``), ``piece(key)`` giving each piece."""
        parts: dict[Any, list] = {t: [] for t in self.dtypes}
        for key in self.keys[row]:
            x = piece(key)
            t = _transport_dtype(x.dtype)
            parts[t].append(jnp.ravel(x).astype(t))
        return tuple(jnp.concatenate(parts[t] + [jnp.zeros(self.length(t) - self.fill[row].get(t, 0), t)])
                     for t in self.dtypes)

    def read(self, buffers: Sequence[Any], row: int, key: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """The piece ``key`` of row ``row`` out of ``buffers`` (one flat row per dtype)."""
        t, offset, size = self.spots[(row, key)]
        return buffers[self.dtypes.index(t)][offset:offset + size].reshape(shape).astype(dtype)


def _device_slices(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> list[tuple[slice, ...]]:
    """The part of a ``shape`` array placed by ``spec`` that each device holds, by flat device
    index (the order of ``lax.axis_index`` over all the mesh's axes)."""
    where = NamedSharding(mesh, spec).devices_indices_map(shape)
    return [tuple(slice(*s.indices(n)) for s, n in zip(where[d], shape)) for d in mesh.devices.flat]


def _whole(pieces: Callable[[int], Any], shape: tuple[int, ...], dtype: Any, slices: Sequence[tuple[slice, ...]]) -> Any:
    """The whole array from the devices' pieces (``pieces(device)``), one device per distinct part."""
    out = jnp.zeros(shape, dtype)
    seen: set = set()
    for device, part in enumerate(slices):
        key = tuple((s.start, s.stop) for s in part)
        if key not in seen:
            seen.add(key)
            out = lax.dynamic_update_slice(out, pieces(device), tuple(s.start for s in part))
    return out


def _exchange(
    plans: Sequence[_Plan], dynamic: Sequence[Sequence[Any]], owners: Sequence[int], mesh: Mesh,
    in_specs: Sequence[Sequence[PartitionSpec]], out_specs: Sequence[Sequence[PartitionSpec]],
) -> list[list[Any]]:
    """Inside the ``shard_map`` of a split state: bring each owner its items' inputs, run its
    items, send the results where they live. Returns, per item, its travelling output leaves
    (a device's slice for a split one, the whole for a replicated one).

    1. Every device sends each owner its slice of every split input the owner's items read (one
       ``all_to_all`` per dtype; replicated inputs are already whole everywhere).
    2. In the ``switch`` branch of its index, the owner rebuilds those inputs whole, runs its
       items, and cuts each split output into every device's slice.
    3. A second ``all_to_all`` delivers the slices; one ``all_gather`` shares replicated outputs.
    """
    num, axes, rep = mesh.size, tuple(mesh.axis_names), PartitionSpec()
    inbound, outbound, gathered = _Layout(num), _Layout(num), _Layout(num)
    in_slices: dict[tuple[int, int], list] = {}
    out_slices: dict[tuple[int, int], list] = {}
    for i, (p, d) in enumerate(zip(plans, owners)):
        for k, (x, spec) in enumerate(zip(dynamic[i], in_specs[i])):
            if spec != rep and p.read[k]:
                in_slices[(i, k)] = _device_slices(tuple(p.dynamic[k].shape), spec, mesh)
                inbound.add(d, (i, k), tuple(x.shape), x.dtype)
        for j, spec in zip(p.sent(), out_specs[i]):
            o = p.out_shapes[j]
            if spec == rep:
                gathered.add(d, (i, j), tuple(o.shape), o.dtype)
            else:
                out_slices[(i, j)] = _device_slices(tuple(o.shape), spec, mesh)
                shard = tuple(s.stop - s.start for s in out_slices[(i, j)][0])
                outbound.add(d, (i, j), shard, o.dtype)

    # 1. Row d of the send buffer: this device's slices of owner d's inputs (the same layout on
    # every device); after the exchange, row s of the received buffer is device s's slices.
    received: tuple = ()
    if inbound.dtypes:
        rows = [inbound.row(d, lambda key: dynamic[key[0]][key[1]]) for d in range(num)]
        received = tuple(lax.all_to_all(jnp.stack([r[n] for r in rows]), axes, 0, 0, tiled=True)
                         for n in range(len(inbound.dtypes)))

    def branch(device: int) -> Callable[[Any], tuple]:
        def run(args: tuple) -> tuple:
            got, dyn = args
            results: dict[tuple[int, int], Any] = {}
            for i, (p, d) in enumerate(zip(plans, owners)):
                if d != device:
                    continue
                inputs = []
                for k, (x, spec) in enumerate(zip(dyn[i], in_specs[i])):
                    whole = p.dynamic[k]
                    if spec == rep:
                        inputs.append(x)
                    elif not p.read[k]:  # never read: a placeholder XLA drops
                        inputs.append(jnp.zeros(whole.shape, whole.dtype))
                    else:
                        pieces = lambda s, k=k, x=x: inbound.read([g[s] for g in got], device, (i, k), tuple(x.shape), x.dtype)
                        inputs.append(_whole(pieces, tuple(whole.shape), whole.dtype, in_slices[(i, k)]))
                out = jax.tree_util.tree_leaves(p.fn(p.operand(inputs)))
                results.update({(i, j): out[j] for j in p.sent()})
            back = [outbound.row(device, lambda key: results[key][out_slices[key][s]]) for s in range(num)]
            stacked = tuple(jnp.stack([b[n] for b in back]) for n in range(len(outbound.dtypes)))
            return gathered.row(device, results.__getitem__), stacked

        return run

    mine, back = lax.switch(lax.axis_index(axes), [branch(d) for d in range(num)], (received, dynamic))
    everyone = tuple(lax.all_gather(x, axes) for x in mine)  # each (num, length)
    delivered = tuple(lax.all_to_all(x, axes, 0, 0, tiled=True) for x in back)  # row d: from owner d
    out = []
    for i, (p, d) in enumerate(zip(plans, owners)):
        leaves = []
        for j, spec in zip(p.sent(), out_specs[i]):
            o = p.out_shapes[j]
            if spec == rep:
                leaves.append(gathered.read([g[d] for g in everyone], d, (i, j), tuple(o.shape), o.dtype))
            else:
                shard = tuple(s.stop - s.start for s in out_slices[(i, j)][0])
                leaves.append(outbound.read([g[d] for g in delivered], d, (i, j), shard, o.dtype))
        out.append(leaves)
    return out


# --- reading compiled programs (to check what a step communicates and who computes what) -----

_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_ARRAY_TYPE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
# A computation's header: ``[ENTRY] %name (params) -> result {`` at the start of a line
# (instructions are indented; a computation ends at a line starting with ``}``).
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
# The attributes through which an instruction calls computations: one name, or a braced list.
_CALL_ATTRIBUTES = ("calls", "to_apply", "body", "condition", "true_computation", "false_computation",
                    "branch_computations", "called_computations", "select", "scatter")
_CALLED = re.compile(r"(?<![\w.\-])(?:" + "|".join(_CALL_ATTRIBUTES) + r")=(\{[^}]*\}|%?[\w.\-]+)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_OPCODE = re.compile(r"=\s.*?\s([a-z][\w\-]*)\(")  # ``%x = TYPE opcode(operands), attributes``


def _opcode(instruction: str) -> str | None:
    m = _OPCODE.search(_STRING.sub('""', instruction))
    return m.group(1) if m is not None else None


def hlo_computations(hlo_text: str) -> dict[str, list[str]]:
    """The computations of an HLO module's text (``.compile().as_text()``): name (without ``%``)
    to its instruction lines, stripped, in the order printed.

    The common ground of the readers below: which instruction sits in which computation tells
    e.g. whether a collective runs on every step or only inside a conditional's branch.
    Raises ``ValueError`` on text with no computation or with one left open (truncated text).
    """
    if not isinstance(hlo_text, str):
        raise TypeError(f"hlo_text must be the HLO module's text (a str, e.g. `.compile().as_text()`), "
                        f"got {type(hlo_text).__name__}")
    bodies: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m is not None:
            if name is not None:
                raise ValueError(f"hlo_text: computation {name!r} is not closed before {m.group(1)!r} starts")
            name = m.group(1)
            bodies[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and line.strip():
            bodies[name].append(line.strip())
    if name is not None:
        raise ValueError(f"hlo_text: computation {name!r} is not closed (truncated text?)")
    if not bodies:
        raise ValueError("hlo_text has no HLO computation; expected a module's text such as "
                         "`jax.jit(f).lower(...).compile().as_text()`")
    return bodies


def hlo_called(instruction: str) -> list[str]:
    """The computations one HLO instruction line calls, in order and without ``%``: every entry of
    ``branch_computations={%a, %b, %c}`` (a conditional's branches, in branch order), ``calls=``,
    ``to_apply=``, a while's ``condition=`` and ``body=``, and the like.

    Quoted strings (metadata, frontend attributes) are skipped, so text inside them is not read
    as a call.
    """
    out = []
    for m in _CALLED.finditer(_STRING.sub('""', instruction)):
        out += [c.strip().lstrip("%") for c in m.group(1).strip("{}").split(",") if c.strip()]
    return out


def hlo_custom_call_target(instruction: str) -> str | None:
    """The ``custom_call_target`` of an HLO instruction line (e.g. ``"lapack_ssyevd_ffi"``), or
    None for an instruction that is not a custom call."""
    m = _TARGET.search(instruction)
    return m.group(1) if m is not None and _opcode(instruction) == "custom-call" else None


def hlo_conditionals(computations: dict[str, list[str]]) -> list[list[str]]:
    """Each conditional of a module (``hlo_computations``'s result), in the order printed: the
    names of its branch computations, in branch order (for a ``lax.switch`` on the device index,
    branch d is what device d runs)."""
    return [hlo_called(line) for lines in computations.values() for line in lines if _opcode(line) == "conditional"]


def _callees(computations: dict[str, list[str]], line: str) -> list[str]:
    called = hlo_called(line)
    for c in called:
        if c not in computations:
            raise ValueError(f"computations: {c!r} is called by `{line[:80]}` but is not among "
                             f"the computations ({len(computations)} given)")
    return called


def hlo_reachable(computations: dict[str, list[str]], roots: Sequence[str]) -> set[str]:
    """The computations that ``roots`` are or call, directly or through nested calls (e.g. every
    computation that runs inside some conditional's branch)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        c = todo.pop()
        if c not in computations:
            raise ValueError(f"roots: {c!r} is not a computation of the module")
        if c not in seen:
            seen.add(c)
            todo += [d for line in computations[c] for d in _callees(computations, line)]
    return seen


def _element_bytes(dtype: str) -> int:
    if dtype == "pred":
        return 1
    return {"bf16": 2, "c64": 8, "c128": 16}.get(dtype, int(dtype[1:]) // 8 if dtype[1:].isdigit() else 0)


def hlo_collectives(hlo_text: str) -> list[dict[str, Any]]:
    """Every collective of a compiled HLO module (``.compile().as_text()``), with its result's bytes.

    One entry per op (an async ``*-start`` counts once, its ``*-done`` not): ``op`` (e.g.
    ``"all-gather"``), ``shapes`` (e.g. ``["f32[4,1024]"]``) and ``bytes`` (of the result, per
    device). For checking which communication a distributed step adds.
    """
    out = []
    for line in hlo_text.splitlines():
        m = re.search(r"=\s*(.*?)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(", line)
        if m is None:
            continue
        types = _ARRAY_TYPE.findall(m.group(1))
        size = sum(_element_bytes(t) * int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) for t, dims in types)
        out.append({"op": m.group(2), "shapes": [f"{t}[{dims}]" for t, dims in types], "bytes": int(size)})
    return out


def hlo_branch_custom_calls(hlo_text: str, target: str) -> list[list[int]]:
    """For each conditional of a compiled HLO module: per branch, how many custom calls whose target
    contains ``target`` (e.g. ``"syevd"``, LAPACK's eigendecomposition) it holds, counting what
    it calls: a computation called twice counts twice, every branch of a nested conditional counts.

    A distributed refresh compiles to one conditional with a branch per device: each device
    runs only its branch, so this shows how many decompositions each device does.
    """
    computations = hlo_computations(hlo_text)
    memo: dict[str, int] = {}

    def holds(line: str) -> bool:
        found = hlo_custom_call_target(line)
        return found is not None and target in found

    def count(name: str) -> int:
        if name not in memo:
            memo[name] = 0  # HLO has no recursion; this only guards against looping on odd text
            memo[name] = sum(holds(line) + sum(count(c) for c in _callees(computations, line)) for line in computations[name])
        return memo[name]

    return [[count(b) for b in branches] for branches in hlo_conditionals(computations)]
