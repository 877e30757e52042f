"""Every model in every framework registers the same layers (tests/zoo.py)."""

from __future__ import annotations

import jax
import pytest

import zoo

CASES = [(m, f) for m, fs in zoo.BUILDERS.items() for f in fs]


@pytest.mark.parametrize("model,framework", CASES, ids=[f"{m}-{f}" for m, f in CASES])
def test_each_framework_registers_the_expected_layers(model, framework):
    loss, params, batch = zoo.BUILDERS[model][framework](jax.random.PRNGKey(0))
    assert zoo.registration(loss, params, batch) == zoo.EXPECTED[model]
