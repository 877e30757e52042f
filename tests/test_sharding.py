"""Several devices and several processes through ``jax.sharding``: one step, partitioned by XLA.

The optimizer's step is one jitted function of global arrays. With the batch sharded over a mesh
axis and the parameters replicated, XLA partitions it: each device runs its share of the forward
and backward passes and of the curvature statistics, and the sums over the batch (gradients,
Kronecker factors, the quadratic model) become all-reduces. The result must be the one-device
result. The device count is fixed when JAX starts, so the runs happen in subprocesses
(``tests/sharding_child.py``): four CPU devices in one process
(``--xla_force_host_platform_device_count``), and two processes of two devices each joined by
``jax.distributed`` over loopback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import sharding_child as child

# Multi-device children run on one xdist worker, one module after another (`--dist loadgroup`):
# several groups of virtual CPU devices at once on two cores could miss XLA's collective deadline.
pytestmark = pytest.mark.xdist_group("devices")

HERE = Path(__file__).parent


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[list[float], list[np.ndarray]]]:
    """Each configuration trained in this process, on one device."""
    params, batch = child.data()
    out = {}
    for config in child.CONFIGS:
        _, p, _, losses = child.train(config, params, batch)
        out[config] = (losses, [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(p)])
    return out


def test_sharded_batch_on_four_devices_matches_one_device():
    proc = subprocess.run([sys.executable, "sharding_child.py", "devices"], cwd=HERE, env=_env(4),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _last_json(proc.stdout)
    assert out["devices"] == 4
    for config in child.CONFIGS:
        r = out[config]
        np.testing.assert_allclose(r["losses_sharded"], r["losses_one_device"], rtol=1e-5, err_msg=config)
        assert r["losses_sharded"][-1] < r["losses_sharded"][0], config
        assert r["max_param_diff"] < 1e-5, config
        # The updated parameters stay replicated on every device, and the step compiled once.
        assert r["params_replicated"] and r["params_on_all_devices"], config
        assert r["trace_count"] == 1, config
        # The batch was not gathered onto every device: the statistics were reduced instead. The
        # only gathers share the distributed curvature work, one row per device (the refresh's
        # decompositions and the preconditioned gradient: at most one each).
        assert r["all_reduces"] > 0, config
        assert 0 < len(r["all_gather_shapes"]) <= 2, (config, r["all_gather_shapes"])
        assert all(shape.split("[")[1].startswith("4,") for shape in r["all_gather_shapes"]), r["all_gather_shapes"]
    # The Optax path (kfac_preconditioner + SGD in a jitted step) partitions the same way.
    r = out["optax"]
    np.testing.assert_allclose(r["losses_sharded"], r["losses_one_device"], rtol=1e-5)
    assert r["losses_sharded"][-1] < r["losses_sharded"][0] and r["params_replicated"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_over_loopback_match_one_device(reference):
    port = _free_port()
    procs = [
        subprocess.Popen([sys.executable, "sharding_child.py", "process", str(pid), "2", str(port)], cwd=HERE,
                         env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for pid in range(2)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=600))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [_last_json(stdout) for stdout, _ in outs]
    assert [r["pid"] for r in results] == [0, 1]
    for r in results:
        assert r["processes"] == 2 and r["devices"] == 4
        for config in child.CONFIGS:
            losses, params = reference[config]
            np.testing.assert_allclose(r[config]["losses"], losses, rtol=1e-5, err_msg=config)
            for got, want in zip(r[config]["params"], params):
                np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=config)
            assert r[config]["trace_count"] == 1


def test_state_placement_is_left_to_jax_on_one_device():
    """``parallel.params_mesh`` picks a mesh only for parameters spread over several devices."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from curvax import parallel

    params, _ = child.data()
    assert parallel.params_mesh(params) is None  # NumPy arrays
    assert parallel.params_mesh(jax.device_put(params)) is None  # one device
    one = jax.device_put(params, NamedSharding(Mesh(jax.devices()[:1], ("data",)), PartitionSpec()))
    assert parallel.params_mesh(one) is None  # a mesh of one device
    assert parallel.constrain(params, None) is params
