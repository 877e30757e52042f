"""Shared test fixtures."""

from __future__ import annotations

import os
from typing import Iterator

from xla_env import with_test_flags

os.environ["XLA_FLAGS"] = with_test_flags(os.environ.get("XLA_FLAGS", ""))  # before JAX starts: see xla_env.py

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def x64() -> Iterator[None]:
    """Runs a test in float64 without leaking the setting to other tests.

    Modules that compare against dense oracles opt in with
    ``pytestmark = pytest.mark.usefixtures("x64")``.
    """
    with jax.enable_x64(True):
        yield


# The modules whose tests take longest (a multi-device child process built once per module, or
# many compiled runs), longest first. ``--dist loadfile`` hands each module whole to the next
# free worker in collection order; collected alphabetically, these came last, and one worker ran
# the last of them while the other sat idle. Started first, the short modules fill in the end.
HEAVY_MODULES = (
    "test_split_state.py", "test_distributed.py", "test_sharding.py", "test_doc_blocks.py", "test_examples.py",
    "test_pmap.py", "test_compile_cache.py", "test_mixed_precision.py", "test_gpt2_small.py", "test_claims.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Moves the ``HEAVY_MODULES`` to the front, in that order; every module keeps its tests'
    order, and the other modules theirs."""
    rank = {name: i for i, name in enumerate(HEAVY_MODULES)}
    items[:] = sorted(items, key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort
