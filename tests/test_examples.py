"""The scripts in ``examples/`` run with ``--quick`` and report what they claim.

Each script runs in a fresh interpreter (``sys.executable``), as a user would start it; its last
line is ``RESULT key=value ...``, which the tests read. Every example runs in the default run
(the autoencoder and the transformer are the heaviest: about 20 s of CPU each, mostly compilation).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from xla_env import child_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *flags: str) -> dict[str, str]:
    """Runs ``examples/<name> --quick``; checks exit code 0 and returns its RESULT line's fields."""
    pytest.importorskip("flax")
    env = child_env()
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--quick", *flags], capture_output=True, text=True, timeout=600,
        cwd=EXAMPLES.parent, env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out.stdout[-3000:]
    return dict(field.split("=", 1) for field in lines[0].split()[1:])


def test_mnist_cnn_nnx():
    r = run_example("mnist_cnn_nnx.py")
    assert r["finite_and_decreasing"] == "True"
    assert float(r["kfac_test_acc"]) > 0.5  # 10 classes: chance is 0.1
    assert 0.0 <= float(r["adam_test_acc"]) <= 1.0


def test_autoencoder():
    r = run_example("autoencoder.py")
    assert r["finite_and_decreasing"] == "True"
    assert math.isfinite(float(r["kfac_final"])) and float(r["kfac_final"]) < float(r["kfac_first"])
    assert float(r["adam_final"]) < float(r["kfac_first"])


def test_transformer_lm():
    r = run_example("transformer_lm.py")
    assert r["finite_and_decreasing"] == "True"
    assert float(r["kfac_last"]) < float(r["kfac_first"])
    # below the loss of a uniform guess over the corpus' 66 characters
    assert float(r["kfac_held_out"]) < math.log(66)


@pytest.fixture(scope="module")
def vmc_one_device() -> dict[str, str]:
    return run_example("vmc_hydrogen.py")


def test_vmc_hydrogen(vmc_one_device):
    r = vmc_one_device
    assert r["within_20mHa"] == "True" and r["devices"] == "1"
    assert abs(float(r["kfac_energy"]) + 0.5) < 0.02  # the exact ground-state energy is -1/2 Ha
    assert float(r["kfac_first"]) > float(r["kfac_energy"])  # the energy went down


def test_vmc_hydrogen_sharded_over_two_devices_is_the_one_device_run(vmc_one_device):
    # jax.sharding: the walkers are one global array split over 2 CPU devices; the same program,
    # the same random numbers, so the same energies as on one device.
    r = run_example("vmc_hydrogen.py", "--devices", "2")
    assert r["devices"] == "2" and r["mode"] == "sharding" and r["within_20mHa"] == "True"
    for k in ("kfac_first", "kfac_energy", "adam_energy"):
        assert abs(float(r[k]) - float(vmc_one_device[k])) < 2e-4, (k, r, vmc_one_device)


def test_vmc_hydrogen_pmap_mode_on_two_devices():
    # kfac-jax's pmap mode with a lax.pmean in the custom_jvp rule (FermiNet's layout); each
    # device samples its own walkers, so the run differs from one device but converges alike.
    r = run_example("vmc_hydrogen.py", "--devices", "2", "--pmap")
    assert r["devices"] == "2" and r["mode"] == "pmap" and r["within_20mHa"] == "True"
    assert abs(float(r["kfac_energy"]) + 0.5) < 0.02 and float(r["kfac_first"]) > float(r["kfac_energy"])


def test_laplace_calibration():
    r = run_example("laplace_calibration.py")
    assert r["finite"] == "True"
    # the validation-tuned Laplace predictive is better calibrated than the MAP on the test set
    assert float(r["laplace_val_nll"]) < float(r["map_nll"])
    assert 0.0 <= float(r["map_ece"]) <= 1.0 and 0.0 <= float(r["laplace_val_ece"]) <= 1.0


def test_influence():
    r = run_example("influence.py")
    assert r["consistent"] == "True"
    # predicted and actual leave-one-out changes agree; the most helpful examples matter most
    assert float(r["corr_exact"]) > 0.9
    assert float(r["corr_kfac"]) > 0.5
    assert float(r["helpful_removed"]) > abs(float(r["random_removed"]))
