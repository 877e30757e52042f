"""``benchmarks/clients.py``'s side-by-side rows, on synthetic run records (the clients themselves
are not installed here): medians over repeats per backend, curvax / kfac-jax, the energy gap,
and the arguments a child gets for an ansatz and a device count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import clients  # noqa: E402


def _run(backend: str, ansatz: str, devices: int, repeat: int, step: float, energies: list[float]) -> dict:
    return {
        "client": "ferminet", "backend": backend, "ansatz": ansatz, "num_devices": devices, "repeat": repeat,
        "summary": {"ok": True, "step_median_s": step, "first_step_s": 10 * step, "train_start_to_step0_end_s": 20 * step,
                    "energies": energies},
    }


def test_rows_take_medians_over_repeats_and_compare_backends():
    runs = [
        _run("kfac_jax", "attention", 1, 0, 0.010, [-1.0, -1.1]),
        _run("curvax", "attention", 1, 0, 0.012, [-1.0, -1.1 + 3e-6]),
        _run("curvax", "attention", 1, 1, 0.008, [-1.0, -1.1]),
        _run("kfac_jax", "attention", 1, 1, 0.010, [-1.0, -1.1]),
        _run("kfac_jax", "attention", 1, 2, 0.040, [-1.0, -1.1]),  # an outlier the median ignores
        _run("kfac_jax", "default", 4, 0, 0.020, [-2.0]),
        _run("curvax", "default", 4, 0, 0.010, [-2.0]),
    ]
    rows = {(r["ansatz"], r["devices"]): r for r in clients.compare_rows(runs)}
    assert set(rows) == {("attention", 1), ("default", 4)}
    attn = rows["attention", 1]
    assert attn["kfac_jax/step_median_s"] == pytest.approx(0.010)
    assert attn["curvax/step_median_s"] == pytest.approx(0.010)  # median of 0.012 and 0.008
    assert attn["ratio/step_median_s"] == pytest.approx(1.0)
    assert attn["ratio/first_step_s"] == pytest.approx(1.0)
    assert attn["max_energy_diff"] == pytest.approx(3e-6)  # repeat 0's energies
    assert rows["default", 4]["ratio/train_start_to_step0_end_s"] == pytest.approx(0.5)


def test_a_failed_run_is_left_out_of_the_medians():
    bad = _run("curvax", "default", 1, 1, 99.0, [])
    bad["summary"]["ok"] = False
    runs = [_run("kfac_jax", "default", 1, 0, 0.01, [-1.0]), _run("curvax", "default", 1, 0, 0.02, [-1.0]), bad]
    (row,) = clients.compare_rows(runs)
    assert row["curvax/step_median_s"] == pytest.approx(0.02)
    assert row["ratio/step_median_s"] == pytest.approx(2.0)


def test_every_row_option_reaches_the_child(monkeypatch, tmp_path):
    """The ansatz reaches the child's command line and the device count its XLA flags."""
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen["cmd"], seen["env"] = cmd, env
        raise clients.subprocess.TimeoutExpired(cmd, 1)

    monkeypatch.setattr(clients.subprocess, "run", fake_run)
    rec = clients.run_child("deepqmc", "curvax", 1.0, "attention", 4)
    assert seen["cmd"][seen["cmd"].index("--child-ansatz") + 1] == "attention"
    assert seen["env"]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    assert rec["num_devices"] == 4 and rec["ansatz"] == "attention" and rec["returncode"] == "timeout"
    clients.run_child("deepqmc", "curvax", 1.0, "default", 1)
    assert "XLA_FLAGS" not in seen["env"]
