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


def test_the_optimizers_own_part_is_the_step_less_the_clients_gradient():
    """``--time-gradient``: each step after the first also times the client's gradient alone; the
    summary's medians leave out step 0 (it compiles) and the runs that did not time it."""
    steps = [{"step_s": 5.0, "client_gradient_s": None, "loss": -1.0}]
    steps += [{"step_s": s, "client_gradient_s": g, "loss": -1.0} for s, g in ((0.010, 0.007), (0.012, 0.008), (0.011, 0.006))]
    rec = clients.summarize({"phase": "done", "steps": 4, "opt_steps": steps, "iterations": [],
                             "client_gradient_first_s": 2.5})
    s = rec["summary"]
    assert s["ok"] and s["step_median_s"] == pytest.approx(0.011)
    assert s["client_gradient_median_s"] == pytest.approx(0.007)
    assert s["optimizer_own_median_s"] == pytest.approx(0.004)  # median of 0.003, 0.004, 0.005
    assert s["client_gradient_first_s"] == 2.5
    untimed = clients.summarize({"phase": "done", "steps": 2, "opt_steps": [
        {"step_s": 1.0, "loss": -1.0}, {"step_s": 0.01, "client_gradient_s": None, "loss": -1.0}], "iterations": []})
    assert untimed["summary"]["optimizer_own_median_s"] is None
    short = clients.summarize({"phase": "done", "steps": 40, "opt_steps": steps, "iterations": []})
    assert not short["summary"]["ok"]  # 4 of the 40 steps asked for


def test_the_energy_gap_is_judged_over_the_first_15_steps_of_a_longer_run():
    late = [-1.0] * 15 + [-1.0, -1.05]  # MCMC chains of float32 runs part after many steps
    runs = [_run("kfac_jax", "default", 1, 0, 0.01, [-1.0] * 17), _run("curvax", "default", 1, 0, 0.01, late)]
    runs[1]["summary"]["energies"][3] = -1.0 + 2e-6
    (row,) = clients.compare_rows(runs)
    assert row["max_energy_diff"] == pytest.approx(2e-6)
    assert row["max_energy_diff_all_steps"] == pytest.approx(0.05)


def test_the_step_count_and_the_gradient_timing_reach_the_child(monkeypatch):
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen["env"] = env
        raise clients.subprocess.TimeoutExpired(cmd, 1)

    monkeypatch.setattr(clients.subprocess, "run", fake_run)
    clients.run_child("ferminet", "kfac_jax", 1.0, "default", 1, time_gradient=True, steps=40)
    assert seen["env"]["CLIENTS_STEPS"] == "40" and seen["env"]["CLIENTS_TIME_GRADIENT"] == "1"
    clients.run_child("ferminet", "kfac_jax", 1.0, "default", 1)
    assert seen["env"]["CLIENTS_STEPS"] == str(clients.STEPS) and "CLIENTS_TIME_GRADIENT" not in seen["env"]


def test_pooling_files_takes_medians_over_all_their_runs(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(clients.json.dumps({"runs": [_run("kfac_jax", "default", 1, 0, 0.010, [-1.0]),
                                              _run("curvax", "default", 1, 0, 0.020, [-1.0])]}))
    b.write_text(clients.json.dumps({"runs": [_run("kfac_jax", "default", 1, 0, 0.012, [-1.0]),
                                              _run("curvax", "default", 1, 0, 0.008, [-1.0]),
                                              _run("kfac_jax", "default", 1, 1, 0.011, [-1.0]),
                                              _run("curvax", "default", 1, 1, 0.009, [-1.0])]}))
    out = tmp_path / "pooled.json"
    assert clients.main(["--pool", str(a), str(b), "--output", str(out)]) == 0
    pooled = clients.json.loads(out.read_text())
    (row,) = pooled["rows"]
    assert row["kfac_jax/step_median_s"] == pytest.approx(0.011)  # median of 0.010, 0.012, 0.011
    assert row["curvax/step_median_s"] == pytest.approx(0.009)  # median of 0.020, 0.008, 0.009
    assert [r["pooled_from"] for r in pooled["runs"]] == ["a.json", "a.json", "b.json", "b.json", "b.json", "b.json"]
