"""Derived functions of a traced model: losses, their Jacobians, per-layer data.

``ProcessedJaxpr`` ties a traced ``Program`` to its registered losses and its
detected layers. From it we build the functions the estimators need, all with
public transformations (``jax.vjp``, ``jax.jvp``, ``jax.linearize``):

* ``loss_tags_vjp/jvp/hvp``: products with the Jacobian (and Hessian) of the
  registered loss inputs with respect to the parameters;
* ``layer_tags_vjp``: for every layer its inputs, outputs and the gradient of
  the (sampled) loss with respect to its outputs and parameters.
"""

from __future__ import annotations

import dataclasses

import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from curvax import _compat, detection, tags, utils
from curvax.tracing import LayerSite, LossSite, Program, ScanSpec, features_last, find_loss_sites, make_loss

logger = logging.getLogger("curvax")


def _shape_key(func_args: Sequence[Any]) -> Any:
    leaves, tree = jax.tree_util.tree_flatten(func_args)
    return tree, tuple((np.shape(x), jnp.result_type(x)) for x in leaves)


class ProcessedJaxpr:
    """A traced function with its registered losses and its layers.

    Build one from a function with ``ProcessedJaxpr.make_from_func(func, func_args)``,
    or from a jaxpr as kfac-jax documents: ``ProcessedJaxpr(jaxpr, consts, in_tree,
    params_index)``, where ``in_tree`` is the structure of the argument tuple.

    Attributes:
      jaxpr, consts: the traced function (``in_vars``/``params_vars`` and their
        ``_flat`` forms are its input and parameter variables).
      program: the flat program of the function that curvax evaluates.
      in_tree: pytree structure of the function's arguments.
      params_index: which argument holds the parameters.
      loss_sites / layer_sites: the registered losses and the layers (sorted by
        their first parameter); ``loss_tags`` is ``loss_sites``.
      layer_tags: one ``LayerTagEqn`` per layer, which blocks are built from.
      layer_indices: per layer, the flat indices of its parameters.
    """

    def __init__(
        self,
        jaxpr: _compat.Jaxpr,
        consts: Sequence[Any],
        in_tree: Any,
        params_index: int = 0,
        allow_left_out_params: bool = False,
        *,
        out_tree: Any = None,
        auto_register_tags: bool = True,
        register_only_generic: bool = False,
        patterns_to_skip: Sequence[str] = (),
        allow_no_losses: bool = False,
        graph_patterns: Sequence[Any] | None = None,
        **unused_kwargs: Any,
    ):
        if not isinstance(jaxpr, _compat.Jaxpr):
            raise TypeError(
                f"ProcessedJaxpr takes a jaxpr (jax.make_jaxpr(f)(*args).jaxpr), got {type(jaxpr).__name__}; "
                "to trace a function use ProcessedJaxpr.make_from_func(func, func_args)."
            )
        if in_tree.num_leaves != len(jaxpr.invars):
            raise ValueError(f"in_tree has {in_tree.num_leaves} leaves but the jaxpr takes {len(jaxpr.invars)} inputs.")
        arg_trees = in_tree.children()
        if not 0 <= params_index < len(arg_trees):
            raise ValueError(f"params_index={params_index} is out of range for {len(arg_trees)} function arguments.")
        offset = sum(t.num_leaves for t in arg_trees[:params_index])
        self.params_index = params_index
        self.in_tree = in_tree
        self.params_tree = arg_trees[params_index]
        self.num_params = self.params_tree.num_leaves
        self.params_offset = offset
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(
            jax.tree_util.tree_unflatten(self.params_tree, range(self.num_params)))[0]]
        for path, v in zip(paths, jaxpr.invars[offset : offset + self.num_params]):
            if not jnp.issubdtype(v.aval.dtype, jnp.inexact):
                path = jax.tree_util.keystr(path)
                raise TypeError(
                    f"Parameter {path or '<root>'} has dtype {v.aval.dtype}; "
                    "curvax optimizes floating-point parameters only (cast it, or move it out of `params`)."
                )
        closed = _compat.ClosedJaxpr(jaxpr, list(consts))
        self.closed_jaxpr = closed
        self.out_tree = out_tree if out_tree is not None else jax.tree_util.tree_structure([0] * len(jaxpr.outvars))
        self.program = Program(closed, range(offset, offset + self.num_params))
        self.loss_sites: tuple[LossSite, ...] = tuple(find_loss_sites(self.program))
        if not self.loss_sites and not allow_no_losses:
            raise ValueError(
                "No loss is registered in the function: call one of curvax.register_*_loss (e.g. "
                "register_softmax_cross_entropy_loss(logits, labels)) inside your loss function, on the "
                "model's output, so that curvax knows which curvature to approximate."
            )
        loss_roots = [a for s in self.loss_sites for a in s.operands]
        self.loss_nodes = self.program.live_nodes(loss_roots)
        self.all_nodes = self.program.live_nodes(loss_roots + list(self.program.output_atoms))
        self._memo: dict[Any, Any] = {}

        matchers = None if graph_patterns is None else detection.layer_matchers(graph_patterns)
        if auto_register_tags:
            det = detection.detect_layers(
                self.program, self.loss_nodes, self.num_params, register_only_generic, patterns_to_skip, matchers
            )
        else:
            det = detection.detect_layers(self.program, self.loss_nodes, self.num_params, True, ())
        self.notes = det.notes
        self.layer_sites: tuple[LayerSite, ...] = det.sites
        self.layer_tags = tuple(detection.site_to_tag_eqn(self.program, s) for s in self.layer_sites)
        self.layer_indices = tuple(s.param_indices for s in self.layer_sites)
        # With automatic registration every parameter gets a block (a generic one at worst),
        # as in kfac-jax; without it, parameters outside manually registered layers are left out.
        left = [i for s in self.layer_sites if s.pattern == "generic" for i in s.param_indices]
        if not allow_left_out_params and not auto_register_tags and left:
            raise ValueError(
                f"Parameters {left} are not part of any registered layer (auto_register_tags=False); register "
                "them, or pass allow_left_out_params=True to give them generic blocks."
            )

    @classmethod
    def make_from_func(
        cls,
        func: Callable[..., Any],
        func_args: Sequence[Any],
        params_index: int = 0,
        auto_register_tags: bool = True,
        allow_left_out_params: bool = False,
        traced: tuple[Any, Any] | None = None,
        **auto_registration_kwargs: Any,
    ) -> "ProcessedJaxpr":
        """Traces ``func(*func_args)`` and detects its losses and layers. ``traced``: that trace
        already made, ``(closed jaxpr, output shapes)``, used instead of tracing again."""
        func_args = tuple(func_args)
        closed, out_shape = traced if traced is not None else _compat.make_jaxpr(func, *func_args, return_shape=True)
        out_tree = jax.tree_util.tree_structure(out_shape)
        return cls(
            closed.jaxpr, closed.consts, jax.tree_util.tree_structure(func_args), params_index, allow_left_out_params,
            out_tree=out_tree, auto_register_tags=auto_register_tags, **auto_registration_kwargs,
        )

    # --- kfac-jax's documented attributes -------------------------------------------

    @property
    def jaxpr(self) -> _compat.Jaxpr:
        """The traced jaxpr (without its constants); kfac-jax compatibility."""
        return self.closed_jaxpr.jaxpr

    @property
    def consts(self) -> list[Any]:
        """The constants of the traced jaxpr; kfac-jax compatibility."""
        return list(self.closed_jaxpr.consts)

    @property
    def in_vars_flat(self) -> list[Any]:
        """The jaxpr's input variables, one per flat leaf of the function arguments."""
        return list(self.jaxpr.invars)

    @property
    def in_vars(self) -> Any:
        """The jaxpr's input variables in the structure of the function arguments."""
        return jax.tree_util.tree_unflatten(self.in_tree, self.in_vars_flat)

    @property
    def params_vars_flat(self) -> list[Any]:
        """The jaxpr's input variables of the parameter leaves."""
        return self.in_vars_flat[self.params_offset : self.params_offset + self.num_params]

    @property
    def params_vars(self) -> Any:
        """The parameter input variables in the structure of the parameters."""
        return jax.tree_util.tree_unflatten(self.params_tree, self.params_vars_flat)

    @property
    def loss_tags(self) -> tuple[LossSite, ...]:
        """The detected loss sites (alias of ``loss_sites``); kfac-jax compatibility."""
        return self.loss_sites

    # --- structure ----------------------------------------------------------------

    def structure(self) -> tuple:
        """What must not change between re-traces (layers and losses)."""
        return (
            tuple((s.tag.name, s.param_indices, s.pattern) for s in self.layer_sites),
            tuple(s.tag.name for s in self.loss_sites),
        )

    def split_args(self, func_args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """Flat parameter leaves and the other flat leaves of ``func_args``."""
        leaves, tree = jax.tree_util.tree_flatten(tuple(func_args))
        if tree != self.in_tree:
            raise ValueError(
                "The function arguments have a different structure from those the function was traced with:\n"
                f"expected {self.in_tree}\ngot      {tree}"
            )
        o, n = self.params_offset, self.num_params
        return leaves[o : o + n], leaves[:o] + leaves[o + n :]

    def join_args(self, params_flat: Sequence[Any], other_flat: Sequence[Any]) -> list[Any]:
        """Inverse of ``split_args``: the full flat argument list from parameter and other leaves."""
        o = self.params_offset
        return list(other_flat[:o]) + list(params_flat) + list(other_flat[o:])

    # --- evaluation ---------------------------------------------------------------

    def perturbable_sites(self) -> list[int]:
        """Indices of the layer sites with a non-generic tag (those whose outputs get perturbations)."""
        return [i for i, s in enumerate(self.layer_sites) if s.tag is not tags.generic]

    def evaluate(
        self,
        params_flat: Sequence[Any],
        other_flat: Sequence[Any],
        perturbations: Sequence[Any] | None = None,
        with_outputs: bool = False,
        differentiable_outputs: int = 1,
    ) -> tuple[tuple, tuple]:
        """Runs the program.

        Returns ``(differentiable, aux)``: ``differentiable`` holds, per loss, its
        parameter-dependent inputs (and the function's flat outputs when
        ``with_outputs``); ``aux`` holds every loss operand and every layer's
        inputs and outputs. Only the first ``differentiable_outputs`` flat outputs
        (the value, for a ``value_and_grad`` function) carry derivatives: equations
        needed only by the others (e.g. the user's own backward pass) read their
        inputs through ``stop_gradient``, so they are never differentiated again.
        """
        sites = self.perturbable_sites()
        transform = {}
        scans: dict[int, ScanSpec] = {}
        if perturbations is not None:
            for i, eps_uses in zip(sites, perturbations):
                site = self.layer_sites[i]
                for use, eps in zip(site.uses, eps_uses):
                    if site.scan is None:
                        transform[use.output] = lambda v, e=eps: v + e
                    else:
                        scans.setdefault(site.scan.node, ScanSpec()).perturb[use.output] = eps
        wanted: list[Any] = []
        for s in self.loss_sites:
            wanted.extend(s.operands)
        plan: list[list[Any]] = []  # per site and use: None (top level) or (scan node, first recorded slot)
        for s in self.layer_sites:
            plan.append([])
            for use in s.uses:
                atoms = [*use.inputs, use.output]
                if s.scan is None:
                    wanted.extend(atoms)
                    plan[-1].append(None)
                else:
                    spec = scans.setdefault(s.scan.node, ScanSpec())
                    plan[-1].append((s.scan.node, len(spec.record)))
                    spec.record.extend(atoms)
        if with_outputs:
            wanted.extend(self.program.output_atoms)
        nodes = self.all_nodes if with_outputs else self.loss_nodes
        recorded: dict[int, list[Any]] = {}
        detach = self._read_only_nodes(differentiable_outputs) if with_outputs else frozenset()
        vals = self.program.evaluate(
            self.join_args(params_flat, other_flat), nodes, wanted, transform, scans, recorded, detach
        )
        it = iter(vals)
        operands = tuple(tuple(next(it) for _ in s.operands) for s in self.loss_sites)
        layer_data = []
        for s, where in zip(self.layer_sites, plan):
            per_use = []
            for use, w in zip(s.uses, where):
                n = len(use.inputs) + 1
                got = [next(it) for _ in range(n)] if w is None else recorded[w[0]][w[1] : w[1] + n]
                per_use.append((tuple(got[:-1]), got[-1]))
            layer_data.append(tuple(per_use))
        outputs = tuple(it) if with_outputs else ()
        dependants = tuple(
            tuple(v for v, n in zip(ops, s.args_names) if n in s.tag.parameter_dependants_names)
            for s, ops in zip(self.loss_sites, operands)
        )
        return (dependants, outputs), (operands, tuple(layer_data))

    def _read_only_nodes(self, differentiable_outputs: int) -> frozenset[int]:
        """Equations needed only by outputs past the first ``differentiable_outputs``."""
        key = ("read_only", differentiable_outputs)
        if key not in self._memo:
            roots = [a for s in self.loss_sites for a in s.operands] + list(self.program.output_atoms[:differentiable_outputs])
            self._memo[key] = frozenset(self.all_nodes) - frozenset(self.program.live_nodes(roots))
        return self._memo[key]

    def losses_from_operands(self, operands: Sequence[Sequence[Any]]) -> tuple[Any, ...]:
        """One loss object per loss site, built from that site's operands."""
        return tuple(make_loss(s, ops) for s, ops in zip(self.loss_sites, operands))

    def zero_perturbations(self, params_flat: Sequence[Any], other_flat: Sequence[Any]) -> tuple[Any, ...]:
        """Zero arrays shaped like the outputs of each perturbable site, for ``evaluate(perturbations=...)``."""
        shapes = jax.eval_shape(lambda p, o: self.evaluate(p, o)[1][1], params_flat, other_flat)
        return tuple(
            tuple(jnp.zeros(y.shape, y.dtype) for _, y in shapes[i]) for i in self.perturbable_sites()
        )

    # --- reporting ----------------------------------------------------------------

    def registration_table(
        self, params: Any, block_names: Sequence[str] | None = None, block_notes: Sequence[str | None] | None = None
    ) -> str:
        """One line per layer: its parameters (by path), kind and block; ``block_notes[j]``, when
        given and not None, is appended in brackets (e.g. why a factor is partitioned)."""
        paths = utils.param_paths(params)
        lines = ["Graph parameter registrations:"]
        for j, site in enumerate(self.layer_sites):
            names = ", ".join(paths[i] for i in site.param_indices)
            block = f" -> {block_names[j]}" if block_names else ""
            flag = ""
            if site.pattern == "generic":
                why = site.meta.get("fallback_reason", "no known layer pattern uses it")
                flag = f"  [generic fallback: {why}]"
            if block_notes and block_notes[j]:
                flag += f"  [{block_notes[j]}]"
            lines.append(f"  {names:<40s} {site.name}{block}{flag}")
        if any(s.pattern == "generic" for s in self.layer_sites):
            lines.append(
                "  hint: a generic block is a diagonal approximation. If a fallback parameter belongs to a layer, "
                "register it inside the model with curvax.register_dense / register_conv2d / register_scale_and_shift, "
                "or describe the layer with a curvax.GraphPattern (auto_register_kwargs=dict(graph_patterns=...))."
            )
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


class _Cache:
    """Traces a function once per argument shape and keeps the layers fixed."""

    def __init__(self, func: Callable[..., Any], params_index: int, raise_on_diff: bool = True, **kwargs: Any):
        self.func = func
        self.params_index = params_index
        self.kwargs = kwargs
        self.raise_on_diff = raise_on_diff
        self._by_shape: dict[Any, ProcessedJaxpr] = {}
        self.first: ProcessedJaxpr | None = None

    def get(self, func_args: Sequence[Any], traced: tuple[Any, Any] | None = None) -> ProcessedJaxpr:
        """The processed trace of ``func`` at ``func_args``' shapes; ``traced`` (``(closed
        jaxpr, output shapes)`` of ``func`` there), if given, spares a trace on a miss."""
        key = _shape_key(func_args)
        pj = self._by_shape.get(key)
        if pj is None:
            pj = ProcessedJaxpr.make_from_func(
                self.func, func_args, self.params_index, allow_left_out_params=True, traced=traced, **self.kwargs
            )
            if self.first is None:
                self.first = pj
            elif self.raise_on_diff and pj.structure() != self.first.structure():
                raise ValueError(
                    "Tracing the function with differently shaped arguments found different layers or "
                    "losses than the first trace; curvax needs the same model structure for every batch."
                )
            self._by_shape[key] = pj
        return pj


def loss_tags_vjp(func: Callable[..., Any], params_index: int = 0) -> Callable[..., Any]:
    """``f(func_args) -> (losses, vjp)``; ``vjp(cotangents)`` gives parameter cotangents.

    ``cotangents`` has, per loss, a tuple of arrays shaped like its
    parameter-dependent inputs; the result is shaped like the parameters.
    """
    cache = _Cache(func, params_index)

    def wrapped(func_args: Sequence[Any]) -> tuple[tuple[Any, ...], Callable[[Any], Any]]:
        pj = cache.get(func_args)
        p, o = pj.split_args(func_args)
        (deps, _), vjp, (ops, _) = jax.vjp(lambda q: pj.evaluate(q, o), p, has_aux=True)
        losses = pj.losses_from_operands(ops)

        def vjp_fn(cotangents: Sequence[Sequence[Any]]) -> Any:
            cot = _check_loss_vectors(cotangents, deps, "loss cotangents")
            (g,) = vjp((cot, ()))
            return jax.tree_util.tree_unflatten(pj.params_tree, g)

        return losses, vjp_fn

    wrapped.processed_jaxpr = cache  # type: ignore[attr-defined]
    return wrapped


def loss_tags_jvp(func: Callable[..., Any], params_index: int = 0) -> Callable[..., Any]:
    """``f(func_args, params_tangents) -> (losses, tangents of each loss's inputs)``."""
    cache = _Cache(func, params_index)

    def wrapped(func_args: Sequence[Any], params_tangents: Any) -> tuple[tuple[Any, ...], tuple]:
        pj = cache.get(func_args)
        p, o = pj.split_args(func_args)
        t = _flat_like_params(pj, params_tangents, "params_tangents")
        (deps, _), (tdeps, _), (ops, _) = jax.jvp(lambda q: pj.evaluate(q, o), (p,), (t,), has_aux=True)
        return pj.losses_from_operands(ops), tdeps

    wrapped.processed_jaxpr = cache  # type: ignore[attr-defined]
    return wrapped


def loss_tags_hvp(func: Callable[..., Any], params_index: int = 0) -> Callable[..., Any]:
    """``f(func_args, params_vector) -> (H v, losses)`` for the sum of all registered losses.

    H is the Hessian of ``sum_losses sum(loss.evaluate())`` (not divided by the
    batch size) with respect to the parameters.
    """
    cache = _Cache(func, params_index)

    def wrapped(func_args: Sequence[Any], params_vector: Any) -> tuple[Any, tuple[Any, ...]]:
        pj = cache.get(func_args)
        p, o = pj.split_args(func_args)
        v = _flat_like_params(pj, params_vector, "params_vector")

        def total(q: Sequence[Any]) -> tuple[jax.Array, Any]:
            _, (ops, _) = pj.evaluate(q, o)
            losses = pj.losses_from_operands(ops)
            return sum(jnp.sum(loss.evaluate()) for loss in losses), ops

        def grad_dot(q: Sequence[Any]) -> tuple[Any, Any]:
            g, ops = jax.grad(total, has_aux=True)(q)
            return g, ops

        _, hv, ops = jax.jvp(grad_dot, (p,), (v,), has_aux=True)
        return jax.tree_util.tree_unflatten(pj.params_tree, hv), pj.losses_from_operands(ops)

    wrapped.processed_jaxpr = cache  # type: ignore[attr-defined]
    return wrapped


def canonical_layer_data(site: Any, xs: Sequence[Any], y: Any) -> tuple[tuple, Any]:
    """Moves feature axes last so that blocks see ``(batch, ..., features)``.

    ``site`` is a ``LayerSite`` or one of its ``LayerUse``s (anything with ``meta``).
    """
    ia = site.meta.get("input_feature_axis")
    oa = site.meta.get("output_feature_axis")
    xs = tuple(features_last(x, ia) for x in xs)
    if y is not None:
        y = features_last(y, oa)
    return xs, y


def layer_tags_vjp(
    func: Callable[..., Any],
    params_index: int = 0,
    auto_register_tags: bool = True,
    raise_error_on_diff_jaxpr: bool = True,
    **auto_registration_kwargs: Any,
) -> Callable[..., Any]:
    """``f(func_args) -> (losses, vjp)``: ``vjp(loss_cotangents)`` returns per-layer data.

    Each entry is a dict with ``inputs``, ``outputs``, ``params``,
    ``outputs_tangent`` (the cotangent of the layer's outputs) and
    ``params_tangent`` (of its parameters), features last. A stacked layer
    inside a ``lax.scan`` has a leading axis over its slices in every entry; a
    layer shared by the steps of a scan has the steps as positions (after the batch axis).
    """
    cache = _Cache(
        func, params_index, raise_error_on_diff_jaxpr, auto_register_tags=auto_register_tags, **auto_registration_kwargs
    )

    def wrapped(func_args: Sequence[Any]) -> tuple[tuple[Any, ...], Callable[[Any], list[dict]]]:
        pj = cache.get(func_args)
        p, o = pj.split_args(func_args)
        eps = pj.zero_perturbations(p, o)
        (deps, _), vjp, (ops, layer_data) = jax.vjp(lambda q, e: pj.evaluate(q, o, e), p, eps, has_aux=True)
        losses = pj.losses_from_operands(ops)

        def vjp_fn(cotangents: Sequence[Sequence[Any]]) -> list[dict]:
            cot = _check_loss_vectors(cotangents, deps, "loss cotangents")
            dp, de = vjp((cot, ()))
            return assemble_layer_data(pj, p, layer_data, dp, de)

        return losses, vjp_fn

    wrapped.processed_jaxpr = cache  # type: ignore[attr-defined]
    return wrapped


def zero_tangents(params_flat: Sequence[Any], perturbations: Any) -> tuple[list[Any], Any]:
    """Zero parameter and layer-output cotangents: what ``forward_only`` statistics use."""
    zeros = lambda t: jax.tree_util.tree_map(jnp.zeros_like, t)
    return zeros(list(params_flat)), zeros(perturbations)


def _pool_positions(arrays: Sequence[Any]) -> Any:
    """Stacks ``(B, ..., d)`` arrays as ``(B, T_1 + T_2 + ..., d)``."""
    return jnp.concatenate([a.reshape(a.shape[0], -1, a.shape[-1]) for a in arrays], axis=1)


def _pool_stacked_positions(arrays: Sequence[Any]) -> Any:
    """Stacks ``(L, B, ..., d)`` arrays as ``(L, B, T_1 + T_2 + ..., d)`` (per slice of a stacked layer)."""
    return jnp.concatenate([a.reshape(a.shape[0], a.shape[1], -1, a.shape[-1]) for a in arrays], axis=2)


def _canonical_use(use: Any, scan: Any, xs: Sequence[Any], y: Any, dy: Any) -> tuple[tuple, Any, Any]:
    """One use's inputs, output and output cotangent with features last.

    Inside a scan every value has a leading step axis: stacked layers keep it
    (one slice per layer), shared layers move it after the batch axis so that the
    steps count as positions.
    """

    def canon(xs: Sequence[Any], y: Any, dy: Any) -> tuple[tuple, Any, Any]:
        xs_c, y_c = canonical_layer_data(use, xs, y)
        return xs_c, y_c, (None if dy is None else canonical_layer_data(use, (), dy)[1])

    if scan is None:
        return canon(xs, y, dy)
    xs_c, y_c, dy_c = jax.vmap(canon)(tuple(xs), y, dy)
    if scan.mode == "shared":
        swap = lambda a: None if a is None else jnp.moveaxis(a, 0, 1)
        return tuple(swap(x) for x in xs_c), swap(y_c), swap(dy_c)
    return xs_c, y_c, dy_c


def assemble_layer_data(
    pj: ProcessedJaxpr, params_flat: Sequence[Any], layer_data: Sequence[Any], dparams: Sequence[Any], deps: Sequence[Any]
) -> list[dict]:
    """Per-layer estimation data from a joint vjp over parameters and perturbations."""
    out = []
    pert = {j: i for i, j in enumerate(pj.perturbable_sites())}
    for j, site in enumerate(pj.layer_sites):
        dys = deps[pert[j]] if j in pert else (None,) * len(site.uses)
        canon = [_canonical_use(use, site.scan, xs, y, dy) for use, (xs, y), dy in zip(site.uses, layer_data[j], dys)]
        stacked = site.scan is not None and site.scan.mode == "stacked"
        pool = _pool_stacked_positions if stacked else _pool_positions
        if len(canon) == 1:
            xs_c, y_c, dy_c = canon[0]
        else:  # tied weights: the uses become extra positions of one layer
            xs_c = tuple(pool([c[0][k] for c in canon]) for k in range(len(canon[0][0])))
            y_c = pool([c[1] for c in canon])
            dy_c = pool([c[2] for c in canon]) if j in pert else None
        out.append(
            {
                "inputs": xs_c,
                "outputs": (y_c,) if j in pert else (),
                "params": tuple(params_flat[i] for i in site.param_indices),
                "outputs_tangent": (dy_c,) if j in pert else (),
                "params_tangent": tuple(dparams[i] for i in site.param_indices),
            }
        )
    return out


def _flat_like_params(pj: ProcessedJaxpr, tree: Any, name: str) -> list[Any]:
    leaves, t = jax.tree_util.tree_flatten(tree)
    if t != pj.params_tree:
        raise ValueError(f"`{name}` must have the structure of the parameters:\nexpected {pj.params_tree}\ngot      {t}")
    return leaves


def _check_loss_vectors(vectors: Sequence[Sequence[Any]], like: Sequence[Sequence[Any]], name: str) -> tuple:
    if len(vectors) != len(like):
        raise ValueError(f"`{name}` must have one entry per registered loss ({len(like)}), got {len(vectors)}.")
    out = []
    for i, (v, l) in enumerate(zip(vectors, like)):
        v = tuple(v) if isinstance(v, (tuple, list)) else (v,)
        if len(v) != len(l) or any(np.shape(a) != np.shape(b) for a, b in zip(v, l)):
            raise ValueError(
                f"`{name}`[{i}] must match the loss inputs' shapes {[np.shape(b) for b in l]}, "
                f"got {[np.shape(a) for a in v]}."
            )
        out.append(tuple(jnp.asarray(a, b.dtype) for a, b in zip(v, l)))
    return tuple(out)


def auto_register_tags(
    func: Callable[..., Any],
    func_args: Sequence[Any],
    params_index: int = 0,
    register_only_generic: bool = False,
    compute_only_loss_tags: bool = True,
    patterns_to_skip: Sequence[str] = (),
    allow_multiple_registrations: bool = False,
    graph_matcher_rules: Any = None,
    graph_patterns: Any = None,
) -> Callable[..., Any]:
    """Returns ``func`` with a layer tag bound at every detected layer (and its loss tags kept).

    Tracing the returned function shows the layer and loss tags (``jax.make_jaxpr``), so
    it can be given to an estimator with ``auto_register_tags=False``. With
    ``compute_only_loss_tags=True`` (the default, as in kfac-jax) it computes only what
    the registered losses need and returns the loss tags' outputs as a flat list;
    with ``False`` it returns ``func``'s outputs. Its ``processed_jaxpr`` attribute
    holds the detection result for ``func_args``; arguments of other shapes are traced
    again (with the same layers), never run through a trace of other shapes.
    """
    if graph_matcher_rules is not None:
        raise NotImplementedError(
            "Custom `graph_matcher_rules` are not supported by curvax: its pattern matcher compares "
            "primitives by name and parameters. Pass `graph_patterns` instead."
        )
    if allow_multiple_registrations:
        raise NotImplementedError("allow_multiple_registrations=True is not implemented in curvax yet (planned).")
    cache = _Cache(
        func, params_index, register_only_generic=register_only_generic, patterns_to_skip=patterns_to_skip,
        graph_patterns=graph_patterns,
    )
    pj0 = cache.get(tuple(func_args))

    def tagged(*args: Any) -> Any:
        pj = cache.get(args)
        p, o = pj.split_args(args)
        flat = pj.join_args(p, o)
        env_sites = {
            use.output: dataclasses.replace(s, output=use.output, inputs=use.inputs, meta=use.meta, extra_uses=())
            for s in pj.layer_sites
            if s.pattern not in ("manual", "generic") and s.scan is None
            for use in s.uses
        }
        # The loss tags are evaluated even where the function's outputs do not read them.
        loss_tag_nodes = [i for i, n in enumerate(pj.program.nodes) if isinstance(n.primitive, tags.LossTag)]
        if compute_only_loss_tags:
            nodes = sorted(set(pj.loss_nodes) | set(loss_tag_nodes))
            wanted = []
            for i in loss_tag_nodes:
                node = pj.program.nodes[i]
                # A loss tag returns its parameter-dependent operands: where an output is dropped, read the operand.
                dependants = [a for a, n in zip(node.inputs, node.params["args_names"]) if n in node.primitive.parameter_dependants_names]
                wanted.extend(a if k is None else k for k, a in zip(node.outputs, dependants))
        else:
            nodes = sorted(set(pj.all_nodes) | set(loss_tag_nodes))
            wanted = list(pj.program.output_atoms)
        values: dict[Any, Any] = {}

        def make(site: LayerSite) -> Callable[[Any], Any]:
            def fn(v: Any) -> Any:
                xs = [values[a] if not hasattr(a, "value") else a.value for a in site.inputs]
                ps = [p[i] for i in site.param_indices]
                return site.tag.bind(v, *xs, *ps, **{k: _hashable(x) for k, x in site.meta.items()})

            return fn

        # Record inputs as they are computed, then bind the tags on the outputs.
        needed_inputs = {a for s in env_sites.values() for a in s.inputs if not hasattr(a, "value")}
        transform = {}
        for k in needed_inputs:
            transform[k] = lambda v, k=k: values.__setitem__(k, v) or v
        for k, site in env_sites.items():
            prev = transform.get(k)
            fn = make(site)
            transform[k] = (lambda v, prev=prev, fn=fn: fn(prev(v))) if prev else fn
        outs = pj.program.evaluate(flat, nodes, wanted, transform)
        if compute_only_loss_tags:
            return list(outs)
        return jax.tree_util.tree_unflatten(pj.out_tree, outs)

    tagged.processed_jaxpr = pj0  # type: ignore[attr-defined]
    return tagged


def _hashable(x: Any) -> Any:
    if isinstance(x, dict):
        return tuple(sorted(x.items()))
    if isinstance(x, list):
        return tuple(x)
    return x
