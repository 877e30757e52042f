"""Runs for tests/test_distributed.py: distributed curvature work on N CPU devices, in float64.

``python distributed_child.py N`` starts JAX with N CPU devices and prints one JSON line:

* ``cases``: for every block kind (Kronecker, diagonal, full, EKFAC), both ways of running on
  several devices (a ``pmap`` over an axis name; ``shard_map`` over a mesh, 2-D where N = 4)
  and two models (six blocks of unequal cost: not divisible by 2 or 4; and one block: more
  devices than blocks), the largest difference between the distributed and the one-device
  results of the cache refresh and of four products (cached approximate and exact inverses,
  a live ``-1/2`` power, the curvature itself); also whether the outputs' types match;
* ``owners``: every device starts from its *own* statistics and vector; after a distributed
  refresh/product every device must hold, for block ``b``, what device ``assign(...)[b]``
  computes from its own inputs alone (so the work is really split as assigned and shared);
* ``hlo``: per device branch of the compiled refresh, the eigendecompositions it runs, against
  those its blocks need; and the collectives the refresh adds.

The device count is fixed when JAX starts, hence the subprocess.
"""

from __future__ import annotations

import json
import sys

import xla_env

if __name__ == "__main__":  # before JAX starts
    xla_env.request_devices(int(sys.argv[1]))

from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import curvax  # noqa: E402
from curvax import distributed  # noqa: E402

AXIS = "dev"
IDENTITY_WEIGHT = 0.1
KINDS: dict[str, Any] = {
    "kronecker": None,
    "diagonal": curvax.DenseDiagonal,
    "full": curvax.DenseFull,
    "ekfac": curvax.DenseEigenvalueCorrected,
}
# Model "six": five dense layers of unequal widths and one generic (diagonal) block; "one": one layer.
# Model "five": three dense layers of unequal widths and two more blocks for an output scale and
# shift (five blocks: not divisible by 2 or 4); model "one": one dense layer (fewer blocks than devices).
MODELS = {"five": (3, 7, 5, 2), "one": (4, 3)}


def model(widths: tuple[int, ...]) -> tuple[Callable, Any, Any]:
    """A tanh MLP with a squared-error loss (and, for several layers, an elementwise output scale and shift)."""
    ks = jax.random.split(jax.random.PRNGKey(0), len(widths) + 2)
    params: dict[str, Any] = {
        f"l{i}": {"w": jax.random.normal(ks[i], (a, b)) / np.sqrt(a), "b": 0.1 * jnp.ones(b)}
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))
    }
    if len(widths) > 2:
        params["scale"], params["shift"] = 1.5 * jnp.ones(widths[-1]), 0.2 * jnp.ones(widths[-1])

    def loss(p: Any, batch: Any) -> jax.Array:
        h, y = batch
        for i in range(len(widths) - 1):
            h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            h = jnp.tanh(h) if i < len(widths) - 2 else h
        out = jnp.sin(h * p["scale"]) + p["shift"] if "scale" in p else h
        curvax.register_squared_error_loss(out, y)
        return jnp.mean(jnp.sum((out - y) ** 2, axis=-1))

    x = jax.random.normal(ks[-2], (16, widths[0]))
    return loss, params, (x, jax.random.normal(ks[-1], (16, widths[-1])))


class Case:
    """An estimator of one block kind on one model; ``inputs(seed)``: real statistics (the exact
    Fisher of a batch, seed 0 the model's own, others shifted: another device's data) and a
    gradient to precondition."""

    def __init__(self, kind: str, model_name: str):
        loss, params, batch = model(MODELS[model_name])
        ctor = KINDS[kind]
        self.est = est = curvax.BlockDiagonalCurvature(loss, layer_tag_to_block_ctor=None if ctor is None else {"dense": ctor})
        init = est.init(jax.random.PRNGKey(1), (params, batch), exact_powers_to_cache=-1, approx_powers_to_cache=-1,
                        cache_eigenvalues=True)

        def inputs(b: Any) -> tuple[Any, Any]:
            state = est.update_curvature_matrix_estimate(init, 0.0, 1.0, 16, jax.random.PRNGKey(2), (params, b),
                                                         estimation_mode="fisher_exact")
            return state, jax.grad(loss)(params, b)

        self._inputs, self._batch = jax.jit(inputs), batch

    def inputs(self, seed: int = 0) -> tuple[Any, Any]:
        return self._inputs(jax.tree_util.tree_map(lambda x: x * (1.0 + 0.3 * seed) + 0.1 * seed, self._batch))


def work(est: Any, dist: Any) -> Callable[[Any, Any], tuple]:
    """The refresh and four products, as a refresh step does them (``dist`` None: undistributed)."""
    kw = {} if dist is None else {"distribution": dist}

    def run(state: Any, grad: Any) -> tuple:
        cached = est.update_cache(state, IDENTITY_WEIGHT, -1, -1, True, **kw)
        return cached, {
            "approx_inverse": est.multiply_matpower(cached, grad, IDENTITY_WEIGHT, -1, False, True, **kw),
            "exact_inverse": est.multiply_inverse(cached, grad, IDENTITY_WEIGHT, True, True, **kw),
            "live_inverse_sqrt": est.multiply_matpower(state, grad, IDENTITY_WEIGHT, -0.5, True, False, **kw),
            "curvature": est.multiply(state, grad, IDENTITY_WEIGHT, False, False, **kw),
        }

    return run


def max_diff(a: Any, b: Any) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    return max([float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(la, lb)] + [0.0])


def same_types(a: Any, b: Any) -> bool:
    """Same tree structure and, leaf by leaf, the same shape, dtype and weak type."""
    sa, sb = jax.eval_shape(lambda: a), jax.eval_shape(lambda: b)
    return jax.tree_util.tree_structure(sa) == jax.tree_util.tree_structure(sb) and all(
        (x.shape, x.dtype, getattr(x, "weak_type", False)) == (y.shape, y.dtype, getattr(y, "weak_type", False))
        for x, y in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb))
    )


def stacked(trees: list) -> Any:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *trees)


def device(tree: Any, d: int) -> Any:
    return jax.tree_util.tree_map(lambda x: x[d], tree)


def eighs_per_block(block: Any) -> tuple[int, int]:
    """Eigendecompositions of one block's refresh, and of its live exact product (``work``)."""
    if isinstance(block, curvax.EigenvalueCorrectedKroneckerFactored):
        return 2, 0  # the product uses the cached basis
    if isinstance(block, curvax.TwoKroneckerFactored):
        return 2, 2
    return (1, 1) if isinstance(block, curvax.Full) else (0, 0)


def run_case(case: Case, n: int, mesh: Mesh, modes: tuple[str, ...], owners: bool) -> dict[str, Any]:
    """Distributed (``modes``: "pmap", "mesh") against one device; with ``owners``, also every
    device on its own inputs (pmap)."""
    est = case.est
    state, grad = case.inputs()
    reference_fn = jax.jit(work(est, None)).lower(state, grad).compile()
    reference = reference_fn(state, grad)
    put = lambda t: jax.device_put(t, NamedSharding(mesh, PartitionSpec()))
    fns, results = {}, {}
    if "pmap" in modes:
        fns["pmap"] = pmap_fn = jax.pmap(work(est, distributed.Distribution(axis_name=AXIS)), axis_name=AXIS).lower(
            stacked([state] * n), stacked([grad] * n)).compile()
        results["pmap"] = [device(pmap_fn(stacked([state] * n), stacked([grad] * n)), d) for d in range(n)]
    if "mesh" in modes:
        fns["mesh"] = jax.jit(work(est, distributed.Distribution(mesh=mesh))).lower(put(state), put(grad)).compile()
        results["mesh"] = [fns["mesh"](put(state), put(grad))]
    out: dict[str, Any] = {"errors": {}, "types_match": True}
    for mode, per_device in results.items():
        for got in per_device:
            out["types_match"] &= same_types(got, reference)
            pairs = [("refresh", got[0], reference[0])] + [(q, got[1][q], reference[1][q]) for q in reference[1]]
            for q, x, y in pairs:
                out["errors"][f"{mode}/{q}"] = max(out["errors"].get(f"{mode}/{q}", 0.0), max_diff(x, y))
    kron = [isinstance(b, curvax.TwoKroneckerFactored) for b in est.blocks]
    refresh_owner = distributed.assign(est.block_refresh_costs(), n)
    apply_owner = distributed.assign([curvax.estimators._apply_cost(b) for b in est.blocks], n)
    need = [eighs_per_block(b) for b in est.blocks]
    per_device = lambda owner, k: [sum(e[k] for e, o in zip(need, owner) if o == d) for d in range(n)]
    expected = [per_device(refresh_owner, 0), per_device(apply_owner, 1)]
    out["hlo"] = {
        "expected_branches": sorted(b for b in expected if sum(b)),
        "eigh_one_device": reference_fn.as_text().count('custom_call_target="lapack_dsyevd'),
    }
    for mode, fn in fns.items():
        text = fn.as_text()
        branches = [b for b in distributed.hlo_branch_custom_calls(text, "syevd") if len(b) == n and sum(b)]
        out["hlo"][mode] = {"branches": sorted(branches), "eigh": text.count('custom_call_target="lapack_dsyevd'),
                            "collectives": distributed.hlo_collectives(text)}
    if owners and n > 1:
        # Every device gets its own statistics and vector. Block b of every device's result must be
        # what the device assigned to it computes from its own inputs (blocks with decompositions:
        # a diagonal block's cache may be its statistics passed through, taken locally).
        inputs = [case.inputs(seed=d) for d in range(n)]
        got = fns["pmap"](stacked([i[0] for i in inputs]), stacked([i[1] for i in inputs]))
        own = [reference_fn(*i) for i in inputs]
        err = {"refresh": 0.0, "live_inverse_sqrt": 0.0}
        differ = 0.0
        for d in range(n):
            mine = device(got, d)
            vecs = est.params_vector_to_blocks_vectors(mine[1]["live_inverse_sqrt"])
            for b in (b for b in range(est.num_blocks) if kron[b]):
                o, a = refresh_owner[b], apply_owner[b]
                err["refresh"] = max(err["refresh"], max_diff(mine[0].blocks_states[b].cache, own[o][0].blocks_states[b].cache))
                want = est.params_vector_to_blocks_vectors(own[a][1]["live_inverse_sqrt"])[b]
                err["live_inverse_sqrt"] = max(err["live_inverse_sqrt"], max_diff(vecs[b], want))
                differ = max(differ, max_diff(own[(o + 1) % n][0].blocks_states[b].cache, own[o][0].blocks_states[b].cache))
        out["owners"] = {"errors": err, "inputs_differ_by": differ}
    return out


def switches(n: int) -> dict[str, bool]:
    """Whether a traced refresh holds an ``all_gather``, with the split on and turned off either way."""
    case = Case("kronecker", "one")
    est, (state, _) = case.est, case.inputs()
    text = lambda d: str(jax.make_jaxpr(lambda s: est.update_cache(s, IDENTITY_WEIGHT, -1, None, False, distribution=d),
                                        axis_env=[(AXIS, n)])(state))
    on = text(distributed.Distribution(axis_name=AXIS))
    inverses_off = text(distributed.Distribution(axis_name=AXIS, inverses=False))
    est.distributed_cache_updates = False
    estimator_off = text(distributed.Distribution(axis_name=AXIS))
    return {"on": "all_gather" in on, "inverses_off": "all_gather" in inverses_off, "estimator_off": "all_gather" in estimator_off}


def main() -> None:
    jax.config.update("jax_enable_x64", True)
    n = jax.device_count()
    shape = (2, n // 2) if n >= 4 else (n,)
    mesh = Mesh(np.array(jax.devices()).reshape(shape), ("x", "y")[: len(shape)])
    out: dict[str, Any] = {"devices": n, "mesh_shape": list(shape), "cases": {}}
    # Four devices: every kind both ways; two devices (a 1-D mesh): every kind through the mesh.
    modes = ("pmap", "mesh") if n >= 4 else ("mesh",)
    for kind in KINDS:
        out["cases"][f"{kind}/five"] = run_case(Case(kind, "five"), n, mesh, modes, owners=n >= 4 and kind in ("kronecker", "ekfac"))
    out["cases"]["kronecker/one"] = run_case(Case("kronecker", "one"), n, mesh, ("pmap",), owners=False)
    out["all_gather_in_refresh"] = switches(n)
    params = jax.device_put(model(MODELS["one"])[1], NamedSharding(mesh, PartitionSpec()))
    made = distributed.make_distribution(True, False, params=params)
    out["make_distribution"] = {
        "from_params": made is not None and made.mesh == mesh and made.inverses and not made.precon_apply,
        "flags_off": distributed.make_distribution(False, False, params=params) is None,
        "one_device_params": distributed.make_distribution(True, True, params=model(MODELS["one"])[1]) is None,
        "axis_name_wins": distributed.make_distribution(True, True, AXIS, params=params) == distributed.Distribution(AXIS),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
