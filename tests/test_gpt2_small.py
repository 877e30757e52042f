"""The GPT-2-small benchmark's model (``benchmarks/gpt2_small.py``), scaled down: K-FAC trains it,
every layer gets the block the registration table promises, and AdamW runs the same code."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpt2_small  # noqa: E402


@pytest.mark.parametrize("untied", [False, True])
def test_scaled_down_gpt2_trains_with_kfac(untied):
    r = gpt2_small.child("kfac", "tiny", steps=6, inverse_period=2, untied=untied)
    assert r["all_finite"]
    assert r["losses"][-1] < r["losses"][0] - 0.2, r["losses"]  # random tokens: log(97) = 4.57 at the start
    table = r["registration_table"]
    # 4 dense layers per block, and the head, all over the sequence axis: the repeated-dense block
    assert table.count("RepeatedDenseKroneckerFactored") == 8 + untied
    assert table.count("ScaleAndShiftDiagonal") == 5  # 2 LayerNorms per block and the final one
    # The tied embedding/head is one weight used twice: a diagonal block, and the table says why.
    assert ("weight sharing" in table) != untied


def test_scaled_down_gpt2_runs_with_adamw():
    r = gpt2_small.child("adamw", "tiny", steps=3, inverse_period=2)
    assert r["all_finite"] and np.isfinite(r["step_median_s"])
    assert r["losses"][-1] < r["losses"][0]
