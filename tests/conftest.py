"""Shared test fixtures."""

from __future__ import annotations

from typing import Iterator

import jax
import pytest


@pytest.fixture
def x64() -> Iterator[None]:
    """Runs a test in float64 without leaking the setting to other tests.

    Modules that compare against dense oracles opt in with
    ``pytestmark = pytest.mark.usefixtures("x64")``.
    """
    with jax.enable_x64(True):
        yield
