"""Distributed curvature work (``curvax.distributed``): each of N devices refreshes and applies its
share of the blocks, and the results equal the one-device ones.

The multi-device runs happen in subprocesses (``tests/distributed_child.py``; the device count is
fixed when JAX starts), on 4 and on 2 CPU devices at once. Here: float64 equality with one device
to 1e-10 for Kronecker, diagonal, full and EKFAC blocks, in pmap mode and through ``shard_map``
over a mesh, with 5 blocks (not divisible by the device count) and with 1 block (more devices
than blocks); that a device's results for block b come from the device assigned to b (each
device fed its own statistics); that in the compiled program each device's branch holds exactly
its blocks' eigendecompositions; which collectives appear. In process (one device): the
assignment, the fallbacks and the configuration (the HLO readers: ``test_hlo_readers.py``).

The optimizers' entry points (``distributed_optimizers_child.py``, 4 devices) run by default:
with the split on, the parameters equal those with it off, bit for bit. The block-level children
above (every block kind, ownership, per-branch decompositions) are marked slow (``-m slow``).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from xla_env import child_env

import distributed_child as child
from curvax import distributed

# A module's tests share one xdist worker (`--dist loadfile`), so its module-scoped children run
# once. (`xdist_group`/`--dist loadgroup` do not group under pytest 9.2 with pytest-xdist 3.8.)

HERE = Path(__file__).parent
TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, Any]]:
    """The child's JSON on 4 and on 2 devices, one after the other."""
    out = {}
    for n in (4, 2):
        proc = subprocess.run([sys.executable, "distributed_child.py", str(n)], cwd=HERE, env=child_env(),
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[n] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("n", [4, 2])
@pytest.mark.slow  # multi-device children: see the module docstring
def test_results_equal_one_device(runs, n):
    out = runs[n]
    assert out["devices"] == n
    assert set(out["cases"]) == {"kronecker/five", "diagonal/five", "full/five", "ekfac/five", "kronecker/one"}
    for case, r in out["cases"].items():
        assert r["types_match"], case  # same structure, shapes, dtypes and weak types as undistributed
        assert r["errors"], case
        for quantity, err in r["errors"].items():
            assert err <= TOLERANCE, (case, quantity, err)
    modes = {key.split("/")[0] for r in out["cases"].values() for key in r["errors"]}
    assert modes == {"pmap", "mesh"}  # on 2 devices: the mesh, and pmap for the one-block model


@pytest.mark.slow  # multi-device children: see the module docstring
def test_each_block_comes_from_its_assigned_device(runs):
    """Devices fed different statistics: block b everywhere equals what its owner computes alone."""
    for case in ("kronecker/five", "ekfac/five"):
        owners = runs[4]["cases"][case]["owners"]
        assert owners["inputs_differ_by"] > 1e-3, case  # a wrong owner would be noticed
        for quantity, err in owners["errors"].items():
            assert err <= TOLERANCE, (case, quantity, err)


@pytest.mark.parametrize("n", [4, 2])
@pytest.mark.slow  # multi-device children: see the module docstring
def test_each_device_runs_only_its_decompositions(runs, n):
    for case, r in runs[n]["cases"].items():
        hlo = r["hlo"]
        for mode in ("pmap", "mesh"):
            if mode not in hlo:
                continue
            # One conditional per distributed call with a branch per device; branch d holds the
            # eigendecompositions of device d's blocks, and no eigh is left outside them.
            assert hlo[mode]["branches"] == hlo["expected_branches"], (case, mode)
            assert hlo[mode]["eigh"] == sum(map(sum, hlo[mode]["branches"])), (case, mode)
            assert all(max(b) < sum(b) for b in hlo[mode]["branches"] if case.endswith("five")), (case, mode)


@pytest.mark.parametrize("n", [4, 2])
@pytest.mark.slow  # multi-device children: see the module docstring
def test_collectives_are_one_all_gather_per_call(runs, n):
    for case, r in runs[n]["cases"].items():
        for mode in ("pmap", "mesh"):
            if mode not in r["hlo"]:
                continue
            ops = r["hlo"][mode]["collectives"]
            assert {op["op"] for op in ops} == {"all-gather"}, (case, mode)
            assert 1 <= len(ops) <= 5, (case, mode)  # the refresh and four products, one dtype
            for op in ops:
                (shape,) = op["shapes"]
                assert shape.startswith(f"f64[{n},"), (case, mode, shape)


@pytest.mark.slow  # multi-device children: see the module docstring
def test_switches_and_configuration(runs):
    for n in (4, 2):
        assert runs[n]["all_gather_in_refresh"] == {"on": True, "inverses_off": False, "estimator_off": False}
        assert all(runs[n]["make_distribution"].values()), runs[n]["make_distribution"]


# --- in process ---------------------------------------------------------------------------------


def test_assign_is_largest_first_onto_least_loaded():
    assert distributed.assign([5, 4, 3, 3, 3], 2) == (0, 1, 1, 0, 1)
    assert distributed.assign([8] * 8, 4) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert distributed.assign([1, 9, 4], 5) == (2, 0, 1)  # more devices than blocks: one each
    assert distributed.assign([], 3) == ()
    with pytest.raises(ValueError, match="num_bins"):
        distributed.assign([1], 0)
    rng = random.Random(0)
    for _ in range(50):
        costs = [rng.randint(1, 1000) ** 3 for _ in range(rng.randint(1, 12))]
        n = rng.randint(1, 5)
        bins = distributed.assign(costs, n)
        load = [sum(c for c, b in zip(costs, bins) if b == d) for d in range(n)]
        assert all(0 <= b < n for b in bins)
        assert max(load) <= sum(costs) / n + max(costs)  # list scheduling's bound


def test_distribution_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        distributed.Distribution()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    with pytest.raises(ValueError, match="exactly one"):
        distributed.Distribution(axis_name="i", mesh=mesh)
    with pytest.raises(TypeError, match="Mesh"):
        distributed.Distribution(mesh="x")  # type: ignore[arg-type]
    assert distributed.Distribution(axis_name="i").num_devices() == 1  # outside a pmap over "i"
    assert distributed.make_distribution(False, False, axis_name="i") is None


def test_one_device_is_the_plain_computation(x64):
    """On one device (a pmap of one, a mesh of one) nothing is split: no collective, same numbers."""
    case = child.Case("kronecker", "five")
    state, grad = case.inputs()
    reference = jax.jit(child.work(case.est, None))(state, grad)
    one = jax.devices()[:1]
    dist = distributed.Distribution(axis_name=child.AXIS)
    pmapped = jax.pmap(child.work(case.est, dist), axis_name=child.AXIS, devices=one)(
        *jax.tree_util.tree_map(lambda x: x[None], (state, grad)))
    assert child.max_diff(child.device(pmapped, 0), reference) <= TOLERANCE
    mesh = jax.sharding.Mesh(np.array(one), ("x",))
    text = str(jax.make_jaxpr(child.work(case.est, distributed.Distribution(mesh=mesh)))(state, grad))
    assert "all_gather" not in text and "shard_map" not in text


@pytest.fixture(scope="module")
def optimizer_runs() -> dict[str, Any]:
    """``distributed_optimizers_child.py`` on 4 devices."""
    proc = subprocess.run([sys.executable, "distributed_optimizers_child.py", "4"], cwd=HERE,
                          env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_optimizer_splits_its_curvature_work_and_keeps_its_numbers(optimizer_runs):
    """``curvax.Optimizer`` (pmap mode and a mesh), ``OptaxPreconditioner`` (pmap),
    ``kfac_preconditioner(mesh=)`` and ``kfac_ferminet_alpha`` (pmap), float64 on 4 devices:
    with the split (the default) the parameters after 3 steps equal those without it, bit for
    bit (the owner runs the same computation; the gather only moves bits), and the compiled step
    gathers one row per device of the blocks' results, where without the split it gathers nothing."""
    out = optimizer_runs
    assert out["devices"] == 4
    assert out["ferminet_alpha_default"] == [True, True]  # kfac-jax's defaults reach curvax
    for name, r in out["entries"].items():
        assert r["finite"] and r["moved"] > 1e-2, name  # the runs trained
        assert r["max_param_diff"] <= TOLERANCE, (name, r["max_param_diff"])
        assert r["gathers_off"] == [], name
        if name != "ferminet_alpha/pmap":  # (its compiled step is the Optimizer's, checked above)
            # The refresh's and the product's gathers (the refresh is in the step: inverse_update_period=2).
            assert len(r["gathers_on"]) == 2, (name, r["gathers_on"])
            assert all(s.startswith("f64[4,") for s in r["gathers_on"]), (name, r["gathers_on"])
