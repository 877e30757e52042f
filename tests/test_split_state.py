"""The distributed refresh and products with the curvature state stored split over the devices
(``curvax.distributed``, ``Distribution.split_state``): only the owners' shares move.

The runs happen in a subprocess on 4 CPU devices (``tests/split_state_child.py``): FSDP-sharded
parameters (the curvature state then lives split by rows), float64, burn-in and 3 steps with
inverses refreshed at steps 0 and 2: approximate and exact (eigendecomposition) inverses on a
one-axis mesh, and a 2 x 2 mesh where one factor is split over one axis and copied over the other.
Checked: parameters and state equal one device's to 1e-10 (an exact eigenbasis may flip its
vectors' signs between one and four devices, so there the state is compared with the old
distributed path, which computes on the same factors), and no all-gather in the compiled step
produces a whole split factor, while the old path (state replicated into the ``shard_map``) did.
In process: the configuration checks and the exchange's placement on a small mesh of one device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from xla_env import child_env
from jax.sharding import Mesh

from curvax import distributed

# One xdist worker runs this module (`--dist loadfile`): the child below runs once.

HERE = Path(__file__).parent
TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "split_state_child.py", "4"], cwd=HERE, env=child_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_split_state_run_equals_one_device(run):
    assert run["devices"] == 4
    assert set(run["configs"]) == {"approximate", "exact", "mesh2x2"}
    for name, r in run["configs"].items():
        assert r["split_state"] and not r["old_split_state"], name
        assert r["moved"] > 1e-3, name  # the steps really changed the parameters
        assert r["max_param_rel_diff"] <= TOLERANCE, (name, r["max_param_rel_diff"])
        # Against the old distributed path on the same devices (same factors): the same numbers.
        assert r["max_param_rel_diff_old"] <= TOLERANCE and r["max_state_rel_diff_old"] <= TOLERANCE, name
        if name != "exact":  # an eigenbasis may flip signs between one and four devices
            assert r["max_state_rel_diff"] <= TOLERANCE, (name, r["max_state_rel_diff"])


def test_state_is_split_as_configured(run):
    rows = {"approximate": ["f64[128,128]", "f64[64,64]"], "exact": ["f64[128,128]", "f64[64,64]"],
            "mesh2x2": ["f64[132,132]", "f64[64,64]", "f64[66,66]"]}
    for name, r in run["configs"].items():
        assert r["whole_split_shapes"] == rows[name], name
        specs = {tuple(shape): spec for shape, spec in r["split_leaves"]}
        if name == "mesh2x2":  # 4 divides 64 and 132 (both axes); 66 only by 2 (one axis, copied over the other)
            assert specs == {(64, 64): "P(('a', 'b'),)", (132, 132): "P(('a', 'b'),)", (66, 66): "P('a',)"}
        else:
            assert specs == {(64, 64): "P('data',)", (128, 128): "P('data',)"}, name


def _gathered_whole(collectives: list[dict[str, Any]], shapes: list[str]) -> list[str]:
    return [s for c in collectives if c["op"] == "all-gather" for s in c["shapes"] if s in shapes]


def _gathered_bytes(collectives: list[dict[str, Any]]) -> int:
    return sum(c["bytes"] for c in collectives if c["op"] == "all-gather")


def test_no_whole_factor_is_gathered(run):
    for name, r in run["configs"].items():
        whole = r["whole_split_shapes"]
        assert _gathered_whole(r["collectives"], whole) == [], name
        # The old path gathered them (so the check can fail), and the new one exchanges instead.
        assert sorted(set(_gathered_whole(r["collectives_old"], whole))) == whole, name
        assert any(c["op"] == "all-to-all" for c in r["collectives"]), name
        assert _gathered_bytes(r["collectives"]) < _gathered_bytes(r["collectives_old"]), name


def test_split_state_needs_a_mesh():
    with pytest.raises(ValueError, match="`split_state=True` needs a `mesh`"):
        distributed.Distribution(axis_name="i", split_state=True)
    assert distributed.make_distribution(True, True, axis_name="i", split_state=True).split_state is False


def test_split_entries_must_match_the_operands():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    dist = distributed.Distribution(mesh=mesh, split_state=True)
    plan = distributed._Plan.of(lambda x: x * 2, np.ones((4, 4)))
    with pytest.raises(ValueError, match="`split` needs one entry per operand"):
        distributed._state_specs([plan], [np.ones((4, 4))], [True, True], False, dist)
