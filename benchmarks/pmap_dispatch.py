"""Benchmark: the host cost of a pmap-mode step (``Optimizer(multi_device=True)``) on a tiny model.

On a small model (FermiNet's, a few ms per step) the Python work around each step matters. curvax
calls its pmapped step through the compiled program of each call signature
(``curvax.parallel.CompiledPmap``); JAX's ``pmap``, where it is a jitted ``shard_map`` (JAX 0.10;
0.9 unless ``jax_pmap_shmap_merge`` is off, as kfac-jax 0.0.8 sets it on import), re-derives its
axes and mesh in Python on every call. Runners, in the same process, interleaved in rotating
rounds of ``--block`` steps each (milliseconds per step, median over rounds):

* ``curvax``: the step as shipped;
* ``curvax_via_pmap``: the same optimizer class, every step through the pmap (``CompiledPmap``
  bypassed);
* ``kfac_jax``: the released kfac-jax 0.0.8 on the same model and arguments, when it imports
  (it needs JAX <= 0.9.1; run this script with that environment's interpreter and curvax on
  ``PYTHONPATH``).

The model: a 8 -> 16 -> 4 tanh MLP, squared error, batch 32 on one device, fixed schedules,
``inverse_update_period=1`` (FermiNet's settings), so the device work is microseconds and the
step time is mostly dispatch. Run it twice to see both pmap implementations on JAX 0.9::

    python benchmarks/pmap_dispatch.py --no-kfac-jax --output benchmarks/results/pmap_dispatch_jax09_merged.json
    python benchmarks/pmap_dispatch.py --output benchmarks/results/pmap_dispatch_jax09_kfac_jax.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).parent))
from harness import rotation  # noqa: E402

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def make_runner(lib: Any, bypass: bool = False) -> Callable[[int], None]:
    """A function running ``n`` steps of ``lib``'s pmap-mode optimizer on the tiny model, waited for."""
    import jax
    import jax.numpy as jnp

    def loss(params: Any, batch: Any) -> jax.Array:
        x, y = batch
        out = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
        lib.register_squared_error_loss(out, y)
        return 0.5 * jnp.mean(jnp.sum((out - y) ** 2, -1))

    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k[0], (8, 16)) / 3, "b1": jnp.zeros(16), "w2": jax.random.normal(k[1], (16, 4)) / 4,
              "b2": jnp.zeros(4)}
    n = jax.local_device_count()
    batch = (jax.random.normal(k[2], (n, 32 // n, 8)), jax.random.normal(k[3], (n, 32 // n, 4)))
    put = jax.pmap(lambda x: x)
    params = jax.tree_util.tree_map(lambda x: put(jnp.stack([x] * n)), params)
    opt = lib.Optimizer(jax.value_and_grad(loss), l2_reg=0.0, value_func_has_aux=False, multi_device=True,
                        learning_rate_schedule=lambda s: 1e-2, momentum_schedule=lambda s: 0.0,
                        damping_schedule=lambda s: 1e-3, inverse_update_period=1, num_burnin_steps=0,
                        estimation_mode="fisher_exact")
    if bypass:
        compiled = opt._call_step
        opt._call_step = lambda key, *args: compiled.pmapped(*args)
    key = jax.random.split(jax.random.PRNGKey(1), n)
    carry = {"params": params, "state": opt.init(params, key, batch), "step": 0}

    def run(steps: int) -> None:
        p, s = carry["params"], carry["state"]
        for _ in range(steps):
            p, s, _ = opt.step(p, s, key, batch=batch, global_step_int=carry["step"])
            carry["step"] += 1
        jax.block_until_ready(p)
        carry["params"], carry["state"] = p, s

    run(3)  # compiled
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--block", type=int, default=50, help="steps per round and runner")
    ap.add_argument("--no-kfac-jax", action="store_true", help="leave kfac-jax out (it sets JAX's pmap flag on import)")
    ap.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "pmap_dispatch.json")
    args = ap.parse_args()
    import jax

    import curvax

    kfac_jax = None
    if not args.no_kfac_jax:
        try:  # first: kfac-jax sets JAX's pmap flag on import, and every runner should see the same pmap
            kfac_jax = importlib.import_module("kfac_jax")
        except ImportError:
            pass
    runners = {"curvax": make_runner(curvax), "curvax_via_pmap": make_runner(curvax, bypass=True)}
    versions = {"jax": jax.__version__, "curvax_direct_calls": curvax.parallel.CompiledPmap.direct_calls(),
                "jax_pmap_shmap_merge": jax.config.values.get("jax_pmap_shmap_merge")}
    if kfac_jax is not None and kfac_jax is not curvax:
        runners["kfac_jax"] = make_runner(kfac_jax)
        versions["kfac_jax"] = getattr(kfac_jax, "__version__", "?")
    times: dict[str, list[float]] = {n: [] for n in runners}
    load_before = os.getloadavg()
    for name in rotation(list(runners), args.rounds):
        t = time.perf_counter()
        runners[name](args.block)
        times[name].append((time.perf_counter() - t) / args.block * 1e3)
    med = {n: statistics.median(t) for n, t in times.items()}
    out = {
        "description": "pmap-mode step of a tiny MLP on one CPU device: milliseconds per step (host dispatch dominates)",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "settings": {"rounds": args.rounds, "steps_per_round": args.block},
        "median_ms_per_step": med,
        "ratios": {f"{n}/curvax": med[n] / med["curvax"] for n in med if n != "curvax"},
        "ms_per_step_by_round": times,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1))
    print(json.dumps({"median_ms_per_step": med, "versions": versions, "load": load_before}))


if __name__ == "__main__":
    main()
