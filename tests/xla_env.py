"""The XLA settings of the test processes and of the child processes the tests start.

The tests check numbers and programs, not speed, and most of their time is XLA compiling small
programs. ``--xla_backend_optimization_level=0`` turns off LLVM's optimizations of the generated
CPU code: the HLO programs, the library calls (matrix products, decompositions) and the order
of every sum are the same, so the results are too, and the suite compiles about a quarter
faster. ``conftest.py`` sets it for the pytest processes; ``child_env`` passes it on.
"""

from __future__ import annotations

import os

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def with_test_flags(flags: str) -> str:
    """``flags`` with the test settings added (once)."""
    return flags if TEST_XLA_FLAGS in flags else f"{flags} {TEST_XLA_FLAGS}".strip()


def child_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """This process's environment for a child JAX process on the CPU: the test settings only (no
    device count leaks from the parent), ``devices`` CPU devices if given, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    flags = TEST_XLA_FLAGS + (f" --xla_force_host_platform_device_count={devices}" if devices else "")
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, **extra}


def request_devices(n: int) -> None:
    """In a child, before JAX starts: ``n`` CPU devices, keeping the flags it was given."""
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
