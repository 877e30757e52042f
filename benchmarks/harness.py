"""Shared pieces of the benchmark scripts: the CPU device count fixed before JAX starts, and
timing several runners in interleaved, rotating rounds with the load average around them.

Nothing here imports JAX at module level: ``force_cpu_devices`` must run before JAX starts
(JAX reads ``JAX_PLATFORMS`` when imported and ``XLA_FLAGS`` when its CPU backend starts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable, Iterator, Sequence


def force_cpu_devices(argv: Sequence[str], default: int = 4) -> None:
    """Makes JAX start with the CPU device count given as ``--devices=N`` in ``argv`` (else
    ``default``); call it before JAX is imported. ``JAX_PLATFORMS`` defaults to ``cpu``."""
    devices = next((a.split("=", 1)[1] for a in argv if a.startswith("--devices=")), str(default))
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def add_devices_argument(parser: argparse.ArgumentParser, default: int = 4) -> None:
    """The ``--devices`` option that goes with ``force_cpu_devices`` (same default)."""
    parser.add_argument("--devices", type=int, default=default,
                        help="CPU devices (pass as --devices=N; read before JAX starts)")


def check_device_count(expected: int) -> int:
    """JAX's device count, after checking that it is ``expected`` (``--devices`` given with a space
    is read by argparse but not before JAX starts)."""
    import jax

    n = jax.device_count()
    if n != expected:
        raise SystemExit(f"JAX sees {n} devices, not --devices={expected} (pass it as --devices=N).")
    return n


def rotation(names: Sequence[str], rounds: int) -> Iterator[str]:
    """Each name once per round, starting one further along every round, so that no runner always
    follows the same other one (caches, frequency scaling and load drift even out)."""
    names = list(names)
    for r in range(rounds):
        yield from names[r % len(names):] + names[: r % len(names)]


def timed_step(step: Callable[[Any], tuple[Any, Any]], carry: Any) -> tuple[Any, Any, float]:
    """One ``carry, loss = step(carry)``, waited for; returns the new carry, the loss and the seconds."""
    import jax

    t = time.perf_counter()
    carry, loss = step(carry)
    jax.block_until_ready((carry, loss))
    return carry, loss, time.perf_counter() - t


def interleave_steps(steps: dict[str, Callable[[Any], tuple[Any, Any]]], carries: dict[str, Any],
                     rounds: int) -> dict[str, Any]:
    """Runs one step of each runner per round (``carry, loss = step(carry)``; ``carries`` advance in
    place) in ``rotation``. Returns ``times`` (each runner's step seconds), ``losses`` (its last
    loss) and ``load_average_before``/``_after`` (``os.getloadavg()``)."""
    times: dict[str, list[float]] = {n: [] for n in steps}
    losses: dict[str, float] = {}
    load_before = os.getloadavg()
    for n in rotation(list(steps), rounds):
        carries[n], loss, dt = timed_step(steps[n], carries[n])
        times[n].append(dt)
        losses[n] = float(loss)
    return {"times": times, "losses": losses, "load_average_before": load_before, "load_average_after": os.getloadavg()}


def interleave_thunks(fns: dict[str, Callable[[], Any]], repeats: int, keep_all: bool = False) -> dict[str, dict[str, Any]]:
    """Median and min seconds of each (already compiled) thunk, called ``repeats`` times in
    ``rotation``; with ``keep_all`` every time too (``all_s``)."""
    import jax

    times: dict[str, list[float]] = {n: [] for n in fns}
    for n in rotation(list(fns), repeats):
        t = time.perf_counter()
        jax.block_until_ready(fns[n]())
        times[n].append(time.perf_counter() - t)
    return {n: {"median_s": statistics.median(t), "min_s": min(t), **({"all_s": t} if keep_all else {})} for n, t in times.items()}
