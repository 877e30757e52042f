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
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from xla_env import child_env

import sharding_child as child

# A module's tests share one xdist worker (`--dist loadfile`), so its module-scoped children run
# once. (`xdist_group`/`--dist loadgroup` do not group under pytest 9.2 with pytest-xdist 3.8.)

HERE = Path(__file__).parent


def _env(devices: int) -> dict[str, str]:
    return child_env(devices)


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


@pytest.fixture(scope="module")
def loopback(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """``sharding_child.py process`` run as 2 processes of 2 CPU devices, joined over loopback:
    each one's JSON result, in process order."""
    port = _free_port()
    # Output goes to files: a child blocked on a full pipe while the other is read would stall
    # both at the job's shutdown barrier (the results hold the gathered state: megabytes).
    logs = tmp_path_factory.mktemp("loopback")
    files = [(open(logs / f"{pid}.out", "w+"), open(logs / f"{pid}.err", "w+")) for pid in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "sharding_child.py", "process", str(pid), "2", str(port)], cwd=HERE,
                         env=_env(2), stdout=out, stderr=err, text=True)
        for pid, (out, err) in enumerate(files)
    ]
    try:
        for p in procs:
            p.wait(timeout=600)
    except subprocess.TimeoutExpired:
        for q in procs:
            q.kill()
        raise
    outs = []
    for out, err in files:
        outs.append(tuple(f.seek(0) or f.read() for f in (out, err)))
        out.close()
        err.close()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [_last_json(stdout) for stdout, _ in outs]
    assert [r["pid"] for r in results] == [0, 1]
    return results


def test_two_processes_over_loopback_match_one_device(reference, loopback):
    for r in loopback:
        assert r["processes"] == 2 and r["devices"] == 4
        for config in child.CONFIGS:
            losses, params = reference[config]
            np.testing.assert_allclose(r[config]["losses"], losses, rtol=1e-5, err_msg=config)
            for got, want in zip(r[config]["params"], params):
                np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, err_msg=config)
            assert r[config]["trace_count"] == 1


def _rel_diff(got: list, want: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(np.asarray(g) - w)) / max(1.0, float(np.max(np.abs(w))))) for g, w in zip(got, want))


def test_two_processes_with_sharded_state_and_distributed_work_match_one_device(loopback):
    """2 processes x 2 devices, FSDP-sharded parameters: the default splits the curvature state
    over the 4 global devices and the refresh and preconditioning are distributed (on by
    default). Three adaptive float64 steps with two refreshes give one device's losses,
    parameters and curvature state to 1e-10; each process holds a quarter of each large
    factor on each of its devices and nothing else; every device decomposes its own block and
    an all-gather shares them; the step compiles once; a NaN on the other process's rows is
    reported by both processes."""
    with jax.enable_x64(True):
        params, batch = child.deep_data()
        _, p1, states1, l1 = child.train_deep(params, batch)
        want_params = [np.asarray(a) for a in jax.tree_util.tree_leaves(p1)]
        want_state = [np.asarray(a) for a in jax.tree_util.tree_leaves(states1[-1].estimator_state)]
    for pid, full in enumerate(loopback):
        r = full["fsdp"]
        np.testing.assert_allclose(r["losses"], l1, rtol=1e-10)
        assert r["losses"][-1] < r["losses"][0]
        assert _rel_diff(r["params"], want_params) < 1e-10 and _rel_diff(r["state"], want_state) < 1e-10
        # The parameters stay FSDP-sharded (b4, w1..w4: a quarter of each matrix's rows per device).
        assert r["params_shards"] == [[8], [16, 128], [32, 64], [16, 64], [16, 8]]
        assert r["trace_count"] == 1 and r["same_placement_every_step"]
        assert len(r["process_devices"]) == 2
        split = 0
        for leaf in r["leaves"]:
            shape = leaf["shape"]
            # every leaf is on the 4 global devices; this process holds its own 2 shards only
            assert leaf["devices"] == 4 and not leaf["fully_addressable"], leaf
            assert leaf["local_devices"] == r["process_devices"], leaf
            if len(shape) == 2 and shape[0] * shape[1] >= 4096 and shape[0] % 4 == 0:
                assert leaf["spec"] == "P('data',)" and leaf["shard"] == [shape[0] // 4, shape[1]], leaf
                split += 1
            else:  # scalars, the 8 x 8 factor, the 65 x 65 one (4 does not divide 65)
                assert leaf["spec"] == "P()" and leaf["shard"] == shape, leaf
            assert leaf["local_shards"] == [leaf["shard"]] * 2, leaf
        # The factors of w1, w2, w3 (64 and 128 wide) and their cached inverses.
        assert split == 12 and any(leaf["shape"] == [65, 65] for leaf in r["leaves"])
        # Decompositions are distributed: one conditional with a branch per global device, each
        # decomposing one block's two factors, holds every LAPACK call of the step ...
        per_device = [b for b in r["lapack_branches"] if len(b) == 4 and sum(b)]
        assert len(per_device) == 1 and all(n > 0 for n in per_device[0]), r["lapack_branches"]
        assert sum(per_device[0]) == r["lapack_calls"]
        # ... and the all-gathers of one row per device share the results: one for the
        # refresh, one for the preconditioned gradient.
        rows = [s for s in r["all_gather_shapes"] if s.startswith("f64[4,") and s.count(",") == 1]
        assert len(rows) == 2, r["all_gather_shapes"]
        assert "1 non-finite value(s) in ['w3']" in r["nan_error"], (pid, r["nan_error"])


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


def test_split_spec_divides_the_largest_share_it_can():
    """``parallel.split_spec``: all devices where a dimension's length divides, else the largest
    mesh-axis product that divides one, else replicated; small leaves and vectors replicated."""
    from jax.sharding import AbstractMesh, PartitionSpec as P

    from curvax import parallel

    mesh = AbstractMesh((4, 2), ("data", "model"))
    assert parallel.split_spec((2048, 2048), mesh) == P(("data", "model"))  # 1/8 of the rows each
    assert parallel.split_spec((2052, 2052), mesh) == P("data")  # 2052 = 4 * 513: not by 8
    assert parallel.split_spec((2050, 2050), mesh) == P("model")  # 2050 = 2 * 1025
    assert parallel.split_spec((2049, 2049), mesh) == P()  # a biased layer's d + 1 = 3 * 683
    assert parallel.split_spec((6, 4096), mesh) == P(None, ("data", "model"))  # 8 columns beat 2 rows
    assert parallel.split_spec((8192,), mesh) == P()  # vectors (eigenvalues, diagonals) stay whole
    assert parallel.split_spec((32, 32), mesh) == P()  # below SHARD_MIN_ELEMENTS
    assert parallel.split_spec((32, 32), mesh, min_elements=1024) == P(("data", "model"))


def test_bytes_per_device_counts_each_shard():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from curvax import parallel

    tree = {"a": jax.ShapeDtypeStruct((64, 64), np.float32), "b": jax.ShapeDtypeStruct((3,), np.float64)}
    assert parallel.bytes_per_device(tree) == 64 * 64 * 4 + 3 * 8
    one = NamedSharding(Mesh(jax.devices()[:1], ("data",)), P("data"))
    assert parallel.bytes_per_device(tree, {"a": one, "b": one}) == 64 * 64 * 4 + 3 * 8


def test_shard_curvature_state_must_be_a_bool_or_none():
    import curvax

    with pytest.raises(TypeError, match="`shard_curvature_state` must be True, False or None"):
        curvax.Optimizer(jax.value_and_grad(child.loss_fn), l2_reg=0.0, shard_curvature_state="yes")


def test_curvature_state_split_over_four_devices_matches_one_device():
    """FSDP-sharded parameters (the default then splits the curvature state) and replicated ones
    with ``shard_curvature_state=True``: float64 runs equal one device's, the large factors and
    their inverses are split by rows over the 4 devices (a quarter of each per device), the
    placement is the same after init, burn-in and every step, and the step compiles once."""
    proc = subprocess.run([sys.executable, "sharding_child.py", "state"], cwd=HERE, env=_env(4),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _last_json(proc.stdout)
    assert out["devices"] == 4
    for name in ("fsdp", "requested"):
        r = out[name]
        np.testing.assert_allclose(r["losses"], r["losses_one_device"], rtol=1e-10, err_msg=name)
        assert r["max_param_rel_diff"] < 1e-10 and r["max_state_rel_diff"] < 1e-10, name
        assert r["trace_count"] == 1, name
        assert r["same_placement_every_step"] and r["compiled_in_equals_out"], name
        split = 0
        for shape, spec, shard in r["leaves"]:
            big = len(shape) == 2 and shape[0] * shape[1] >= out["min_elements"]
            if big and shape[0] % 4 == 0:  # the 64 x 64 and 128 x 128 factors and cached inverses
                assert spec == "P('data',)" and shard == [shape[0] // 4, shape[1]], (name, shape, spec)
                split += 1
            else:  # scalars, the 8 x 8 factor, the 129 x 129 one (no mesh size divides 129)
                assert spec == "P()" and shard == shape, (name, shape, spec)
        assert split == 4, name
        assert any(shape == [129, 129] for shape, _, _ in r["leaves"]), name
        # Each device keeps a quarter of the split leaves: 129 x 129 and 8 x 8 stay whole.
        whole = sum(np.prod(shape) for shape, _, _ in r["leaves"]) * 8
        split_bytes = sum(np.prod(shape) for shape, spec, _ in r["leaves"] if spec != "P()") * 8
        assert r["bytes_one_device"] == whole
        assert r["bytes_per_device"] == whole - split_bytes * 3 // 4, name
    assert out["declined_replicated"]
