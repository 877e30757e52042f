"""Matrix-free exact curvature operators of a loss over one batch or a dataset.

``value_func(params, batch)`` returns the mean loss over ``batch`` and registers its losses
(``curvax.register_softmax_cross_entropy_loss`` ...) exactly as for the optimizer. With batches
``b_1 .. b_k`` of sizes ``B_i`` the operators represent the matrix of the mean loss over the data,
``sum_i (B_i / num_data) M_i`` with ``M_i`` the matrix of batch ``i``'s mean loss and
``num_data = sum_i B_i`` unless given. Products use one Jacobian-vector and one
vector-Jacobian product per batch (``curvax.ImplicitExactCurvature`` and
``curvax.transforms``); nothing dense is built unless ``to_dense()`` is called.

* ``ggn``: ``J^T H_L J`` (``H_L`` the Hessian of the registered losses w.r.t. their inputs);
* ``fisher(kind="type-2")``: ``J^T F_L J`` with the losses' exact Fisher (the GGN for the
  canonical losses); ``kind="mc"``: ``F_L`` replaced by ``mc_samples`` sampled gradient outer
  products (fixed by ``rng``, so the operator is a fixed symmetric PSD matrix);
  ``kind="empirical"``: the gradient outer products at the observed targets;
* ``hessian``: the Hessian of ``value_func`` itself (forward-over-reverse), registrations not needed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp

from curvax import transforms, utils
from curvax.estimators import ImplicitExactCurvature, loss_cotangents
from curvax.operators.base import CurvatureOperator, ParameterSpace, _register

Array = jax.Array

FISHER_TYPES = ("type-2", "mc", "empirical")
"""``fisher(kind=...)`` values: curvlinops' ``FisherType`` names (``TYPE2``, ``MC``, ``EMPIRICAL``)."""


@dataclasses.dataclass(frozen=True)
class _Products:
    """The static part of an exact operator: the function and its Jacobian-product machinery."""

    value_func: Callable[..., Any]
    implicit: ImplicitExactCurvature
    jvp: Callable[..., Any]
    vjp: Callable[..., Any]

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: Any) -> bool:
        return self is other


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ExactCurvatureOperator(CurvatureOperator):
    """The exact GGN, Fisher (type-2, MC, empirical) or Hessian of a loss; see the module docstring."""

    params: Any
    batches: tuple
    weights: tuple
    rng: Any
    products: _Products
    space: ParameterSpace
    kind: str
    mc_samples: int = 1

    @property
    def is_psd(self) -> bool:
        return self.kind != "hessian"

    def __repr__(self) -> str:
        return f"ExactCurvatureOperator(kind={self.kind!r}, dim={self.dim}, batches={len(self.batches)})"

    def _one_batch(self, i: int, batch: Any, v: Any) -> Any:
        args = (self.params, batch)
        if self.kind == "ggn":
            return self.products.implicit.multiply_ggn(args, v)
        if self.kind == "type-2":
            return self.products.implicit.multiply_fisher(args, v)
        if self.kind == "hessian":
            grad = jax.grad(self.products.value_func)
            return jax.jvp(lambda p: grad(p, batch), (self.params,), (v,))[1]
        # mc / empirical: (1/B) sum_n J_n^T c_n (c_n^T J_n v), per sample c.
        losses, jv = self.products.jvp(args, v)
        _, vjp = self.products.vjp(args)
        b = utils.default_batch_size_extractor(batch)
        if self.kind == "empirical":
            keys, mode = None, "fisher_empirical"
        else:
            keys = jax.random.split(jax.random.fold_in(self.rng, i), self.mc_samples)
            mode = "fisher_gradients"

        def weighted(key: Any) -> tuple:
            """The cotangents ``c_n (c_n^T J_n v)`` of one sample (``c`` drawn with ``key``)."""
            cots = loss_cotangents(losses, key, mode)
            coef = sum(
                jnp.sum((c * t).reshape(c.shape[0], -1), axis=1) for cs, ts in zip(cots, jv) for c, t in zip(cs, ts)
            )
            return tuple(tuple(c * coef.reshape((-1,) + (1,) * (c.ndim - 1)) for c in cs) for cs in cots)

        if keys is None:
            cot, count = weighted(jax.random.PRNGKey(0)), 1
        else:  # J^T is linear: one vector-Jacobian product of the summed cotangents
            cot, count = jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0), jax.vmap(weighted)(keys)), self.mc_samples
        return jax.tree_util.tree_map(lambda x: x / (b * count), vjp(cot))

    def _matvec_tree(self, tree: Any) -> Any:
        total = None
        for i, (batch, w) in enumerate(zip(self.batches, self.weights)):
            out = jax.tree_util.tree_map(lambda x, w=w: x * w, self._one_batch(i, batch, tree))
            total = out if total is None else jax.tree_util.tree_map(jnp.add, total, out)
        return jax.tree_util.tree_map(lambda x, p: x.astype(jnp.result_type(p)), total, tree)


_register(ExactCurvatureOperator, ["params", "batches", "weights", "rng"], ["products", "space", "kind", "mc_samples"])


def _make(
    kind: str, value_func: Callable[..., Any], params: Any, data: Any, num_data: int | None,
    batch_size_extractor: Callable[[Any], int] | None, rng: Any = None, mc_samples: int = 1,
) -> ExactCurvatureOperator:
    if not callable(value_func):
        raise TypeError(f"`value_func` must be callable as value_func(params, batch), got {type(value_func).__name__}.")
    if isinstance(data, list):
        batches = tuple(data)
    elif hasattr(data, "__next__") or (isinstance(data, Iterable) and not isinstance(data, (tuple, dict)) and not hasattr(data, "shape")):
        batches = tuple(data)  # an iterable of batches: read once and kept
    else:
        batches = (data,)  # a tuple or dict is one batch
    if not batches:
        raise ValueError("`data` has no batches.")
    extract = batch_size_extractor or utils.default_batch_size_extractor
    sizes = [int(extract(b)) for b in batches]
    n = sum(sizes) if num_data is None else utils.check_int(num_data, "num_data", 1)
    weights = tuple(float(s) / n for s in sizes)
    products = _Products(
        value_func, ImplicitExactCurvature(value_func, batch_size_extractor=extract),
        transforms.loss_tags_jvp(value_func), transforms.loss_tags_vjp(value_func),
    )
    return ExactCurvatureOperator(
        params, batches, weights, rng, products, ParameterSpace.from_tree(params), kind, int(mc_samples)
    )


def ggn(value_func: Callable[..., Any], params: Any, data: Any, num_data: int | None = None,
        batch_size_extractor: Callable[[Any], int] | None = None) -> ExactCurvatureOperator:
    """The exact generalised Gauss-Newton matrix of the mean loss (curvlinops' ``GGNLinearOperator``).

    ``data``: one batch (a tuple or dict of arrays), or a list / iterator of batches (read once and kept).
    """
    return _make("ggn", value_func, params, data, num_data, batch_size_extractor)


def fisher(value_func: Callable[..., Any], params: Any, data: Any, kind: str = "type-2", mc_samples: int = 1,
           rng: Any = None, num_data: int | None = None,
           batch_size_extractor: Callable[[Any], int] | None = None) -> ExactCurvatureOperator:
    """The Fisher of the mean loss: ``kind`` in ``FISHER_TYPES`` (see the module docstring).

    ``kind="mc"`` needs ``rng`` and uses ``mc_samples`` samples per example; it converges to the
    type-2 Fisher as ``mc_samples`` grows (variance ``O(1 / (mc_samples * num_data))``).
    """
    kind = getattr(kind, "value", kind)  # curvlinops' FisherType members are str enums
    if kind not in FISHER_TYPES:
        raise ValueError(f"`kind` must be one of {list(FISHER_TYPES)}, got {kind!r}.")
    mc_samples = utils.check_int(mc_samples, "mc_samples", 1)
    if mc_samples != 1 and kind != "mc":
        raise ValueError(f"`mc_samples` must be 1 when `kind` is {kind!r} (only 'mc' samples), got {mc_samples}.")
    if kind == "mc":
        if rng is None:
            raise ValueError("`rng` is needed for kind='mc' (the sampled targets are drawn from it).")
    return _make(kind, value_func, params, data, num_data, batch_size_extractor, rng, mc_samples)


def hessian(value_func: Callable[..., Any], params: Any, data: Any, num_data: int | None = None,
            batch_size_extractor: Callable[[Any], int] | None = None) -> ExactCurvatureOperator:
    """The Hessian of the mean of ``value_func`` over the data (curvlinops' ``HessianLinearOperator``)."""
    return _make("hessian", value_func, params, data, num_data, batch_size_extractor)

