"""Smoke test of ``benchmarks/compare.py --quick``: it runs, and its JSON has the documented layout.

No timing is asserted; the checks are on structure and on facts that hold for any timing
(the target step is the first curve point at or below the target, the clock only grows,
Adam's ratio to itself is 1).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULT_KEYS = {
    "setup_s", "first_step_s", "step_median_s", "step_mean_s", "timed_steps", "steps_run", "seconds_run",
    "stopped_by", "final_loss", "best_loss", "diverged", "steps_to_target", "seconds_to_target",
    "seconds_to_target_after_compile", "curve", "learning_rate", "environment",
}
SUMMARY_KEYS = {
    "learning_rate", "setup_s", "first_step_s", "step_median_s", "step_ratio_median", "step_ratio_mean",
    "steps_to_target", "seconds_to_target", "seconds_to_target_after_compile", "final_loss", "steps_run",
    "interleaved_ratio_median", "interleaved_ratio_per_round_median",
}


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "compare.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--quick", "--output", str(out), *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check(d: dict, models: list[str], optimizers: list[str]) -> None:
    assert d["benchmark"] == "compare"
    assert {"date", "cpu_count", "jax", "optax"} <= set(d["machine"])
    assert d["kfac_jax"]["status"].startswith("not requested")
    assert set(d["models"]) == set(models)
    for name, entry in d["models"].items():
        assert {"description", "num_params", "batch_size", "target_loss", "max_steps", "tuning", "results",
                "summary"} <= set(entry)
        target = entry["target_loss"]
        assert set(entry["results"]) == set(optimizers)
        for opt, tuning in entry["tuning"].items():
            assert opt in optimizers and opt not in ("lbfgs", "curvax_kfac")
            assert tuning["chosen_lr"] in tuning["grid"]
            assert set(tuning["loss_at_end_of_tuning"]) == {f"{lr:g}" for lr in tuning["grid"]}
        assert "adam" in entry["tuning"] and entry["results"]["adam"]["learning_rate"] == entry["tuning"]["adam"]["chosen_lr"]
        for opt, r in entry["results"].items():
            assert RESULT_KEYS <= set(r), (name, opt, RESULT_KEYS - set(r))
            c = r["curve"]
            assert len(c["step"]) == len(c["loss"]) == len(c["seconds"]) > 0
            assert c["step"][0] == 1 and c["step"][-1] == r["steps_run"] <= entry["max_steps"]
            assert all(b > a for a, b in zip(c["seconds"], c["seconds"][1:]))
            assert c["seconds"][0] == pytest.approx(r["setup_s"] + r["first_step_s"])
            assert r["steps_run"] == 1 + r["timed_steps"] + d["settings"]["warmup_steps"] or r["stopped_by"] != "steps"
            finite = [x for x in c["loss"] if x is not None]
            if r["steps_to_target"] is None:
                assert all(x > target for x in finite)
            else:
                k = c["step"].index(r["steps_to_target"])
                assert c["loss"][k] <= target and all(x > target for x in c["loss"][:k] if x is not None)
                assert r["seconds_to_target"] == c["seconds"][k]
                assert r["seconds_to_target_after_compile"] == pytest.approx(
                    r["seconds_to_target"] - r["setup_s"] - r["first_step_s"])
            s = entry["summary"][opt]
            assert SUMMARY_KEYS <= set(s)
            if not r["diverged"]:  # every finite run takes part in the interleaved rounds
                assert len(r["interleaved_step_times_s"]) == d["settings"]["ratio_rounds"]
                assert s["interleaved_ratio_median"] == pytest.approx(
                    statistics.median(r["interleaved_step_times_s"])
                    / statistics.median(entry["results"]["adam"]["interleaved_step_times_s"]))
            if s["step_ratio_median"] is not None:
                assert s["step_ratio_median"] == pytest.approx(r["step_median_s"] / entry["summary"]["adam_step_median_s"])
        assert entry["summary"]["adam"]["step_ratio_median"] == pytest.approx(1.0)
        fastest = entry["summary"]["fastest_to_target"]
        reached = {o: r["seconds_to_target"] for o, r in entry["results"].items() if r["seconds_to_target"] is not None}
        assert fastest == (min(reached, key=reached.__getitem__) if reached else None)
    assert all(math.isfinite(r["first_step_s"]) for e in d["models"].values() for r in e["results"].values())


def test_compare_quick_schema(tmp_path):
    """One model, Adam and curvax K-FAC: the layout of the results file."""
    d = _run(tmp_path, "--models", "cnn", "--optimizers", "adam", "curvax_kfac")
    _check(d, ["cnn"], ["adam", "curvax_kfac"])


@pytest.mark.slow
def test_compare_quick_every_optimizer_and_model(tmp_path):
    """Every model and every optimizer the installed Optax has."""
    d = _run(tmp_path)
    _check(d, ["autoencoder", "cnn", "transformer"], d["optimizers_available"])
